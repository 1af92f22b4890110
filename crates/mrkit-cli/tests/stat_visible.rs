//! Issue 21: the CLI's own verbs are visible to `mrkit stat` (the device starts the export),
//! with port counters that move; `mrkit reg --json` carries the registration timing.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[path = "../../mrkit/tests/providers_util/mod.rs"]
mod providers_util;

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn mrkit() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mrkit"))
}

fn free_tcp_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn mrkit_perf_server_is_listed_with_counters() {
    if providers_util::needs_native(
        "`mrkit perf` measures mrkit0's own transport and refuses other devices (tests/rdma_core.rs checks the refusal)",
    ) {
        return;
    }
    // A directory the exporter creates, inside a private one (a predictable name under /tmp
    // could be planted by another user).
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path().join("stat");
    let port = free_tcp_port();
    let (srv, cli) = (
        mrkit_testsupport::loopback_addr(150),
        mrkit_testsupport::loopback_addr(151),
    );
    let server = mrkit()
        .args([
            "perf",
            "--server",
            "--addr",
            &srv,
            "--port",
            &port.to_string(),
        ])
        .args(["--count", "100"])
        .env("MRKIT_STAT_DIR", &dir)
        .env("MRKIT_STAT_INTERVAL_MS", "50")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let server = Kill(server);
    let pid = server.0.id().to_string();
    let stat = |extra: &[&str]| {
        let o = mrkit()
            .args(["stat", "--pid", &pid])
            .arg("--dir")
            .arg(&dir)
            .args(extra)
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
        )
    };
    // Listed once it opened mrkit0 (before any client).
    let end = Instant::now() + Duration::from_secs(20);
    while !stat(&[]).0 {
        assert!(Instant::now() < end, "mrkit perf --server never listed");
        std::thread::sleep(Duration::from_millis(50));
    }
    let o = mrkit()
        .args([
            "perf",
            "--client",
            &srv,
            "--addr",
            &cli,
            "--port",
            &port.to_string(),
        ])
        .args(["--op", "write", "--size", "4096", "--iters", "50", "--json"])
        .env("MRKIT_STAT", "0")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (ok, json) = stat(&["--json", "--counters"]);
    assert!(ok, "{json}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let p = &v["processes"][0];
    assert_eq!(p["pid"].as_u64(), Some(u64::from(server.0.id())), "{v}");
    let c = &p["counters"]["values"];
    // 50 WRITEs of 4 KiB (at least a packet each) reached the server: 200 KiB in 4-byte words.
    assert!(c["rcvd_pkts"].as_u64() >= Some(50), "{c}");
    assert!(c["port_rcv_data"].as_u64() >= Some(50 * 4096 / 4), "{c}");
    assert!(c["sent_pkts"].as_u64() > Some(0), "{c}");
    let (ok, text) = stat(&["--counters"]);
    assert!(
        ok && text.starts_with(&format!("link mrkit0/1 pid {pid} ")),
        "{text}"
    );
    assert!(text.contains(" rcvd_pkts "), "{text}");
    drop(server);
}

#[test]
fn reg_json_carries_the_timing() {
    if providers_util::needs_native(
        "the registration's phase timing is mrkit0's; libibverbs reports none (query_mr's reg_timing is unknown)",
    ) {
        return;
    }
    let o = mrkit()
        .args(["reg", "--size", "1MiB", "--access", "local-write", "--json"])
        .env("MRKIT_STAT", "0")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let t = &v["timing_ns"];
    let get = |k: &str| {
        t[k].as_u64()
            .unwrap_or_else(|| panic!("timing_ns.{k}: {v}"))
    };
    let parts: u64 = ["accounting", "pin", "walk", "translation", "key"]
        .iter()
        .map(|k| get(k))
        .sum();
    assert!(get("pin") > 0 && get("walk") > 0, "{t}");
    assert!(parts <= get("total") && get("total") > 0, "{t}");
    let o = mrkit()
        .args(["reg", "--size", "64KiB"])
        .env("MRKIT_STAT", "0")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("  took ") && text.contains("    pin "),
        "{text}"
    );
}
