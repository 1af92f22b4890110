//! Two hosts: two network namespaces joined by a veth pair (made here as root, with addresses
//! from TEST-NET-1 that exist only inside those namespaces), `mrkit perf` server in one and
//! client in the other, every operation with data verified. The veth keeps its default
//! 1500-byte MTU, so the QPs use a 1024-byte path MTU as rxe would choose for such a link.
//! Without root or `ip` the test says SKIP loudly (and fails if `MRKIT_REQUIRE_NETNS=1`,
//! which CI sets).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn sh(args: &[&str]) -> bool {
    Command::new(args[0])
        .args(&args[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

struct Netns {
    a: String,
    b: String,
}

impl Netns {
    fn create() -> Option<Netns> {
        let pid = std::process::id();
        let n = Netns {
            a: format!("mrk-a-{pid}"),
            b: format!("mrk-b-{pid}"),
        };
        let (va, vb) = (format!("mka{pid}"), format!("mkb{pid}"));
        let ok = sh(&["ip", "netns", "add", &n.a])
            && sh(&["ip", "netns", "add", &n.b])
            && sh(&[
                "ip", "link", "add", &va, "type", "veth", "peer", "name", &vb,
            ])
            && sh(&["ip", "link", "set", &va, "netns", &n.a])
            && sh(&["ip", "link", "set", &vb, "netns", &n.b])
            && sh(&["ip", "-n", &n.a, "addr", "add", "192.0.2.1/24", "dev", &va])
            && sh(&["ip", "-n", &n.b, "addr", "add", "192.0.2.2/24", "dev", &vb])
            && sh(&["ip", "-n", &n.a, "link", "set", &va, "up"])
            && sh(&["ip", "-n", &n.b, "link", "set", &vb, "up"])
            && sh(&["ip", "-n", &n.a, "link", "set", "lo", "up"])
            && sh(&["ip", "-n", &n.b, "link", "set", "lo", "up"]);
        if ok {
            Some(n)
        } else {
            drop(n);
            None
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        sh(&["ip", "netns", "del", &self.a]);
        sh(&["ip", "netns", "del", &self.b]);
    }
}

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn two_hosts_over_veth() {
    if !rustix::process::geteuid().is_root() || !sh(&["ip", "-V"]) {
        eprintln!("SKIP two_hosts_over_veth: needs root and iproute2");
        assert!(
            std::env::var("MRKIT_REQUIRE_NETNS").is_err(),
            "MRKIT_REQUIRE_NETNS set but the test cannot run"
        );
        return;
    }
    let Some(ns) = Netns::create() else {
        eprintln!("SKIP two_hosts_over_veth: cannot create network namespaces here");
        assert!(
            std::env::var("MRKIT_REQUIRE_NETNS").is_err(),
            "MRKIT_REQUIRE_NETNS set but netns creation failed"
        );
        return;
    };
    let bin = env!("CARGO_BIN_EXE_mrkit");
    let ops = [
        ("write", "64KiB"),
        ("read", "64KiB"),
        ("send", "1000"),
        ("atomic", "8"),
    ];
    let server = Command::new("ip")
        .args([
            "netns",
            "exec",
            &ns.a,
            bin,
            "perf",
            "--server",
            "--addr",
            "192.0.2.1",
        ])
        .args(["--mtu", "1024", "--count", &ops.len().to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let _server = Kill(server);
    // Wait until the server's exchange port answers inside its namespace.
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let probe = Command::new("ip")
            .args(["netns", "exec", &ns.a, "ss", "-ltn", "sport", "=", ":18515"])
            .output()
            .unwrap();
        if String::from_utf8_lossy(&probe.stdout).contains("18515") {
            break;
        }
        assert!(Instant::now() < end, "server did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    for (op, size) in ops {
        let out = Command::new("ip")
            .args(["netns", "exec", &ns.b, bin, "perf", "--client", "192.0.2.1"])
            .args([
                "--addr",
                "192.0.2.2",
                "--mtu",
                "1024",
                "--op",
                op,
                "--size",
                size,
            ])
            .args(["--iters", "300", "--json"])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{op}: {stdout} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        assert_eq!(v["errors"], 0, "{v}");
        eprintln!("two hosts {op} {size}: {v}");
    }
}
