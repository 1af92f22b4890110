//! Two hosts: two network namespaces joined by a veth pair (made here as root, with addresses
//! from TEST-NET-1 that exist only inside those namespaces), `mrkit perf` server in one and
//! client in the other, every operation with data verified. The veth keeps its default
//! 1500-byte MTU, so the QPs use a 1024-byte path MTU as rxe would choose for such a link.
//! Without root or `ip` the test says SKIP loudly (and fails if `MRKIT_REQUIRE_NETNS=1`,
//! which CI sets).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use mrkit_testsupport::{Netns, ADDR_A, ADDR_B};

#[path = "../../mrkit/tests/providers_util/mod.rs"]
mod providers_util;

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn two_hosts_over_veth() {
    if providers_util::needs_native(
        "`mrkit perf --addr` runs mrkit0's own transport; it refuses other devices",
    ) {
        return;
    }
    let Some(ns) = Netns::for_test("two_hosts_over_veth", "") else {
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
            "netns", "exec", &ns.a, bin, "perf", "--server", "--addr", ADDR_A,
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
            .args(["netns", "exec", &ns.b, bin, "perf", "--client", ADDR_A])
            .args([
                "--addr", ADDR_B, "--mtu", "1024", "--op", op, "--size", size,
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
