//! `mrkit stat` lists a process whose device is an rdma-core one: `mrkit __stat-hold` on
//! `rdma-core:mrkit0` (the drop-in libibverbs through mrkit's rdma-core provider) shows the
//! provider's counters and MRs as device `rdma-core:mrkit0`, and the drop-in's own mrkit0
//! inside that process as its second copy of mrkit.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod support;
use support::{drop_in_so, mrkit_clean};

struct Child(std::process::Child);
impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn mrkit(dir: &Path) -> Command {
    let so = drop_in_so();
    let mut c = mrkit_clean();
    c.env("MRKIT_RDMA_CORE_LIB", so)
        .env("MRKIT_ADDR", "127.0.91.31")
        .env("MRKIT_STAT_DIR", dir);
    c
}

fn out(c: &mut Command) -> String {
    let o = c.output().unwrap();
    assert!(
        o.status.success(),
        "{c:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn stat_lists_the_rdma_core_device_and_the_drop_in_copy() {
    let dir = tempfile::tempdir().unwrap();
    let child = Child(
        mrkit(dir.path())
            .args([
                "__stat-hold",
                "--seconds",
                "30",
                "--regs",
                "3",
                "--no-install",
            ])
            .env("MRKIT_DEVICE", "rdma-core:mrkit0")
            .env("MRKIT_STAT_INTERVAL_MS", "50")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let pid = child.0.id();
    let file = dir.path().join(format!("{pid}.stat"));
    let t = Instant::now();
    let pid_s = pid.to_string();
    let text = loop {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{} never listed the rdma-core device",
            file.display()
        );
        if file.exists() {
            let s = out(mrkit(dir.path()).args(["stat", "--pid", &pid_s]));
            // The hold registers after it opened the device: wait for all three.
            if s.contains("mr: live 3  registered 3") && s.contains("second copy") {
                break s;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let lines: Vec<&str> = text.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.starts_with("  device rdma-core:mrkit0 ("))
        .unwrap_or_else(|| panic!("no rdma-core device in:\n{text}"));
    // registered 3 and one EINVAL failure (the hold's deliberate one)
    assert_eq!(
        lines[at + 1],
        "    mr: live 3  registered 3  deregistered 0  failed EINVAL=1",
        "{text}"
    );
    assert!(
        lines[at + 2].starts_with("    bytes registered 192 KiB"),
        "{text}"
    );
    // The drop-in's own mrkit0 in that process: the same three registrations.
    let copy = lines
        .iter()
        .position(|l| *l == "  device mrkit0 (second copy of mrkit in this process):")
        .unwrap_or_else(|| panic!("no second copy in:\n{text}"));
    assert!(
        lines[copy + 1].starts_with("    mr: live 3  registered 3  deregistered 0"),
        "{text}"
    );
    // This program's own copy opened no mrkit0: no zero mrkit0 block before the devices.
    assert!(!lines[1].starts_with("  mr: live 0"), "{text}");

    let mrs = out(mrkit(dir.path()).args(["stat", "--mrs", "--pid", &pid_s]));
    let rc: Vec<&str> = mrs
        .lines()
        .filter(|l| l.starts_with("dev rdma-core:mrkit0 "))
        .collect();
    assert_eq!(rc.len(), 3, "{mrs}");
    assert!(rc.iter().all(|l| l.contains(" mrlen 65536 ")), "{mrs}");
    let own: Vec<&str> = mrs
        .lines()
        .filter(|l| l.starts_with("dev mrkit0 "))
        .collect();
    assert_eq!(own.len(), 3, "{mrs}");
    drop(child);
}
