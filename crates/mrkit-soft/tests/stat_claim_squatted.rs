//! Another local process that binds this process's statistics claim name (`mrkit-stat/<pid>`,
//! an abstract Unix socket: no permissions protect it) before the device opens must not
//! silence `mrkit stat`: the claim counts only when this process holds it, so the device
//! still exports `<pid>.stat`. Before, any holder of the name made the device skip exporting.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

#[test]
fn a_squatted_claim_name_does_not_stop_the_export() {
    let pid = std::process::id();
    // The squatter: another process binding (not listening on) our claim name.
    let script = format!(
        "import socket,sys,time\n\
         s=socket.socket(socket.AF_UNIX,socket.SOCK_DGRAM)\n\
         s.bind(b'\\0mrkit-stat/{pid}')\n\
         print('ready',flush=True)\n\
         time.sleep(30)\n"
    );
    let mut squatter = Command::new("python3")
        .args(["-c", &script])
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 (installed by scripts/test.sh)");
    let mut line = String::new();
    BufReader::new(squatter.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready");
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path().join("stat");
    std::fs::create_dir(&dir).unwrap();
    std::env::set_var("MRKIT_STAT_DIR", &dir);
    std::env::remove_var("MRKIT_STAT");
    let ctx = mrkit_soft::Context::open(mrkit_soft::DeviceConfig::rxe());
    let stat = dir.join(format!("{pid}.stat"));
    let exported = stat.exists();
    drop(ctx);
    let _ = squatter.kill();
    let _ = squatter.wait();
    assert!(
        exported,
        "{} missing: the squatter silenced the export",
        stat.display()
    );
}
