//! Two processes on one host: `mrkit perf --server` and `mrkit perf --client` over RoCEv2/UDP,
//! every operation with its data verified (the client READs back what it wrote, checks READ
//! data against the server's pattern, counts atomics; the server checks SEND payloads).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_tcp_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Distinct 127.x.y.z addresses per test process and role.
fn addr(role: u8) -> String {
    mrkit_testsupport::loopback_addr(100 + role)
}

fn start_server(role: u8, port: u16, count: u32, env: &[(&str, &str)]) -> Server {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mrkit"));
    c.args([
        "perf",
        "--server",
        "--addr",
        &addr(role),
        "--port",
        &port.to_string(),
    ])
    .args(["--count", &count.to_string()])
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    for (k, v) in env {
        c.env(k, v);
    }
    let child = c.spawn().unwrap();
    // Wait for the exchange port.
    let end = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err()
        && std::net::TcpStream::connect((addr(role).as_str(), port)).is_err()
    {
        assert!(Instant::now() < end, "server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    Server(child)
}

fn client(
    role: u8,
    port: u16,
    op: &str,
    size: &str,
    iters: &str,
    env: &[(&str, &str)],
) -> serde_json::Value {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mrkit"));
    c.args([
        "perf",
        "--client",
        &addr(role),
        "--addr",
        &addr(role + 1),
        "--port",
        &port.to_string(),
    ])
    .args(["--op", op, "--size", size, "--iters", iters, "--json"]);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "client {op} {size} failed: {stdout} {stderr}"
    );
    let v: serde_json::Value =
        serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    for k in [
        "op",
        "size",
        "bw_mbps",
        "msg_rate",
        "lat_us_p50",
        "lat_us_p99",
        "errors",
    ] {
        assert!(v.get(k).is_some(), "missing key {k}: {v}");
    }
    assert_eq!(v["errors"], 0, "{v}");
    assert!(v["bw_mbps"].as_f64().unwrap() > 0.0);
    v
}

#[test]
fn two_processes_every_operation() {
    // The connection probe above counts as a client: serve the probe plus six runs. The
    // 8-byte WRITE and SEND are posted inline (the latency tests' sizes): their data is
    // checked like the others'.
    let port = free_tcp_port();
    let _s = start_server(1, port, 7, &[]);
    for (op, size) in [
        ("write", "64KiB"),
        ("read", "64KiB"),
        ("send", "4096"),
        ("atomic", "8"),
        ("write", "8"),
        ("send", "8"),
    ] {
        let v = client(1, port, op, size, "400", &[]);
        eprintln!("{v}");
    }
}

#[test]
fn two_processes_under_loss() {
    let port = free_tcp_port();
    let faults = [("MRKIT_FAULTS", "loss=5%,reorder=2%,dup=1%,seed=5")];
    let _s = start_server(3, port, 3, &faults);
    for (op, size) in [("write", "16KiB"), ("read", "16KiB")] {
        client(3, port, op, size, "200", &faults);
    }
}

#[test]
fn two_processes_sends_under_loss() {
    let port = free_tcp_port();
    let faults = [("MRKIT_FAULTS", "loss=5%,reorder=2%,dup=1%,seed=5")];
    let _s = start_server(5, port, 2, &faults);
    client(5, port, "send", "2048", "200", &faults);
}
