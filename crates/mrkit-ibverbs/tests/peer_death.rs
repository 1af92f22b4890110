//! Peer death under perftest (perftest package) on the drop-in library: the server process is
//! killed with SIGKILL in the middle of a bandwidth run and the client, with perftest's own
//! transport settings (local ACK timeout 14 ≈ 67 ms, `retry_cnt` 7), must end with
//! RETRY_EXC_ERR (perftest prints the failed completion and exits non-zero) in bounded time:
//! `retry_cnt` 7 is seven retries (IBA, mlx5), so about 8 × 67 ms after the last answer.

mod common;

use common::lib_dir;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Kills and reaps the child when dropped (a failing test leaves no process behind).
struct Reap(Child);
impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn perftest(tool: &str, addr: &str, args: &[&str]) -> Reap {
    let prog = Path::new("/usr/bin").join(tool);
    assert!(
        prog.exists(),
        "{} missing: apt-get install perftest (scripts/test.sh installs it)",
        prog.display()
    );
    let c = Command::new(prog)
        .args(args)
        .env("LD_LIBRARY_PATH", lib_dir())
        .env("MRKIT_ADDR", addr)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn perftest");
    Reap(c)
}

/// Whether something listens on TCP `port` (perftest's out-of-band exchange).
fn listening(port: u16) -> bool {
    let o = Command::new("ss")
        .args(["-ltnH", "sport", "=", &format!(":{port}")])
        .output()
        .expect("run ss (iproute2)");
    String::from_utf8_lossy(&o.stdout).contains(&format!(":{port}"))
}

/// `tool` server on `srv`, client on `cli`; the server is SIGKILLed once the client has run
/// for a while; the client must fail with RETRY_EXC_ERR (status 12) within `bound`.
fn server_killed_mid_run(tool: &str, port: u16, srv: &str, cli: &str) {
    let port_s = port.to_string();
    // -D 60: a run of 60 s that only the peer's death can end early; -F: no "cpu MHz" check.
    let args = ["-d", "mrkit0", "-x", "0", "-F", "-D", "60", "-p", &port_s];
    let mut server = perftest(tool, srv, &args);
    let end = Instant::now() + Duration::from_secs(20);
    while !listening(port) {
        if let Ok(Some(st)) = server.0.try_wait() {
            panic!("{tool} server exited before listening: {st}");
        }
        assert!(
            Instant::now() < end,
            "{tool} server did not listen on {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut cargs = args.to_vec();
    cargs.push(srv);
    let mut client = perftest(tool, cli, &cargs);
    // Let the connection come up and traffic flow (the client is in its measured run).
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        client.0.try_wait().expect("wait").is_none(),
        "{tool} client ended before the server was killed"
    );
    server.0.kill().expect("SIGKILL the server");
    let _ = server.0.wait();
    let killed = Instant::now();
    // 8 × 67 ms of retries, plus the slack a loaded 2-vCPU machine needs.
    let bound = Duration::from_secs(15);
    let status = loop {
        if let Some(st) = client.0.try_wait().expect("wait") {
            break st;
        }
        assert!(
            killed.elapsed() < bound,
            "{tool} client still running {bound:?} after the server died (retrying forever?)"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = killed.elapsed();
    let out = output(&mut client.0);
    assert!(
        !status.success(),
        "{tool} client exited 0 after its peer died:\n{out}"
    );
    assert!(
        out.contains("Failed status 12"),
        "{tool} client did not report RETRY_EXC_ERR (12):\n{out}"
    );
    eprintln!("{tool}: client failed {took:?} after the server's SIGKILL");
}

/// What an exited child printed.
fn output(c: &mut Child) -> String {
    use std::io::Read;
    let mut s = String::new();
    if let Some(mut o) = c.stdout.take() {
        let _ = o.read_to_string(&mut s);
    }
    if let Some(mut e) = c.stderr.take() {
        let _ = e.read_to_string(&mut s);
    }
    s
}

#[test]
fn ib_write_bw_client_ends_when_the_server_is_killed() {
    server_killed_mid_run("ib_write_bw", 18690, "127.0.64.2", "127.0.64.3");
}

#[test]
fn ib_send_bw_client_ends_when_the_server_is_killed() {
    server_killed_mid_run("ib_send_bw", 18691, "127.0.64.4", "127.0.64.5");
}
