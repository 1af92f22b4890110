//! Two processes on one host: `mrkit perf --server` and `mrkit perf --client` over RoCEv2/UDP,
//! every operation with its data verified (the client READs back what it wrote, checks READ
//! data against the server's pattern, counts atomics; the server checks SEND payloads). On
//! the embedded mrkit0, on the drop-in's mrkit0 through the rdma-core provider
//! (`--device rdma-core:mrkit0`), and mixed (server on one, client on the other).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod support;
use support::{drop_in_dir, Dev};

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
    start_server_on(
        Dev::Native,
        Path::new("/nonexistent"),
        role,
        port,
        count,
        env,
    )
}

fn start_server_on(
    dev: Dev,
    dir: &Path,
    role: u8,
    port: u16,
    count: u32,
    env: &[(&str, &str)],
) -> Server {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mrkit"));
    c.args(["perf", "--server", "--port", &port.to_string()])
        .args(["--count", &count.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    dev.apply(&mut c, &addr(role), dir);
    for (k, v) in env {
        c.env(k, v);
    }
    let mut child = c.spawn().unwrap();
    // Wait for the exchange port.
    let end = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err()
        && std::net::TcpStream::connect((addr(role).as_str(), port)).is_err()
    {
        assert!(child.try_wait().unwrap().is_none(), "server exited");
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
    client_on(
        Dev::Native,
        Path::new("/nonexistent"),
        role,
        port,
        op,
        size,
        iters,
        env,
    )
}

#[allow(clippy::too_many_arguments)]
fn client_on(
    dev: Dev,
    dir: &Path,
    role: u8,
    port: u16,
    op: &str,
    size: &str,
    iters: &str,
    env: &[(&str, &str)],
) -> serde_json::Value {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mrkit"));
    c.args(["perf", "--client", &addr(role), "--port", &port.to_string()])
        .args(["--op", op, "--size", size, "--iters", iters, "--json"]);
    dev.apply(&mut c, &addr(role + 1), dir);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "client {op} {size} on {dev:?} failed: {stdout} {stderr}"
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

/// Every operation, verified, between a server on `server` and clients on `client`.
fn every_operation(server: Dev, client: Dev, role: u8) {
    let dir = drop_in_dir();
    let port = free_tcp_port();
    let _s = start_server_on(server, dir.path(), role, port, 7, &[]);
    for (op, size) in [
        ("write", "64KiB"),
        ("read", "64KiB"),
        ("send", "4096"),
        ("atomic", "8"),
        ("write", "8"),
        ("send", "8"),
    ] {
        let v = client_on(client, dir.path(), role, port, op, size, "400", &[]);
        eprintln!("{server:?} <- {client:?}: {v}");
    }
}

/// Both processes on the drop-in's mrkit0 through the rdma-core provider.
#[test]
fn two_processes_over_rdma_core() {
    every_operation(Dev::DropIn, Dev::DropIn, 7);
}

/// The server on the embedded mrkit0, the client on the drop-in's (and the other way round):
/// the two implementations of the device speak the same RoCEv2 to each other.
#[test]
fn two_processes_mixed_native_and_rdma_core() {
    every_operation(Dev::Native, Dev::DropIn, 9);
    every_operation(Dev::DropIn, Dev::Native, 11);
}

/// `--addr` sets mrkit0's address only: on another device it is refused with the reason
/// (status 2), before anything is opened.
#[test]
fn addr_is_refused_on_rdma_core() {
    let dir = drop_in_dir();
    let mut c = Command::new(env!("CARGO_BIN_EXE_mrkit"));
    c.args(["perf", "--server", "--port", "1"]);
    Dev::DropIn.apply(&mut c, &addr(13), dir.path());
    c.args(["--addr", &addr(13)]);
    let o = c.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("is its GID"), "{err}");
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
