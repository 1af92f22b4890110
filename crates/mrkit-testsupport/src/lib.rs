//! Helpers shared by the integration tests of several crates of the workspace (a dev-only
//! crate: `publish = false`, used only as a dev-dependency).
//!
//! [`Netns`]: two network namespaces joined by a veth pair, the "two hosts" of the
//! `mrkit perf` and `ibv_rc_pingpong` tests.
//!
//! Hosts on the software device (context, PD, CQ, RC QP), connected pairs over the loopback
//! link or UDP, and the virtual clock that runs the QP engines without a device are in
//! mrkit-soft itself: `mrkit_soft::testkit` (feature `testkit`), because the fuzz bodies in
//! that library and its own unit tests use them (see `docs/architecture.md`, "Test kit").
//!
//! ```no_run
//! use mrkit_testsupport::{Netns, ADDR_A};
//! use std::process::Command;
//!
//! // Root creates the namespaces (removed on drop); other users get None and a skip line
//! // (a failure when MRKIT_REQUIRE_NETNS=1).
//! let Some(ns) = Netns::for_test("my_test", "doc") else { return };
//! let exec = ns.exec_b(); // ["ip", "netns", "exec", <b>]
//! let ok = Command::new(exec[0])
//!     .args(&exec[1..])
//!     .args(["ip", "route", "get", ADDR_A])
//!     .status()
//!     .unwrap()
//!     .success();
//! assert!(ok, "host B has a route to host A over the veth pair");
//! ```

#![forbid(unsafe_code)]

pub mod child;
pub mod ibverbs_shim;

pub use child::output_within;

use std::process::{Command, Stdio};

/// Run `args[0]` with the rest as arguments, output discarded; whether it ran and exited 0.
pub fn sh(args: &[&str]) -> bool {
    Command::new(args[0])
        .args(&args[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Address of namespace `a` on the veth link (TEST-NET-1, exists only inside the namespaces).
pub const ADDR_A: &str = "192.0.2.1";
/// Address of namespace `b` on the veth link.
pub const ADDR_B: &str = "192.0.2.2";

/// Two network namespaces `a` and `b` joined by a veth pair with [`ADDR_A`] / [`ADDR_B`]
/// (/24), the veth ends and `lo` up in both. The veth keeps its default 1500-byte MTU.
/// Dropping it deletes both namespaces (and with them the veth pair).
pub struct Netns {
    /// Name of the first namespace (for `ip netns exec`).
    pub a: String,
    /// Name of the second namespace.
    pub b: String,
}

impl Netns {
    /// The namespaces of the test `test`, or `None` after [`skip`] when they cannot be made
    /// here (not root, no iproute2, or namespace creation refused, e.g. in a container).
    ///
    /// `tag` keeps the names of different test binaries apart: the namespaces are
    /// `mrk{tag}-a-<pid>` / `mrk{tag}-b-<pid>`, the veth ends `mk{tag}a<pid>` / `mk{tag}b<pid>`
    /// (interface names have at most 15 bytes: keep `tag` short).
    pub fn for_test(test: &str, tag: &str) -> Option<Netns> {
        if !rustix::process::geteuid().is_root() || !sh(&["ip", "-V"]) {
            skip(test, "needs root and iproute2");
            return None;
        }
        let ns = Netns::create(tag);
        if ns.is_none() {
            skip(test, "cannot create network namespaces here");
        }
        ns
    }

    /// Make the namespaces (see [`Netns::for_test`] for the names); `None` if any step fails
    /// (what was made is removed again).
    pub fn create(tag: &str) -> Option<Netns> {
        let pid = std::process::id();
        let n = Netns {
            a: format!("mrk{tag}-a-{pid}"),
            b: format!("mrk{tag}-b-{pid}"),
        };
        let (va, vb) = (format!("mk{tag}a{pid}"), format!("mk{tag}b{pid}"));
        let (cidr_a, cidr_b) = (format!("{ADDR_A}/24"), format!("{ADDR_B}/24"));
        let ok = sh(&["ip", "netns", "add", &n.a])
            && sh(&["ip", "netns", "add", &n.b])
            && sh(&[
                "ip", "link", "add", &va, "type", "veth", "peer", "name", &vb,
            ])
            && sh(&["ip", "link", "set", &va, "netns", &n.a])
            && sh(&["ip", "link", "set", &vb, "netns", &n.b])
            && sh(&["ip", "-n", &n.a, "addr", "add", &cidr_a, "dev", &va])
            && sh(&["ip", "-n", &n.b, "addr", "add", &cidr_b, "dev", &vb])
            && sh(&["ip", "-n", &n.a, "link", "set", &va, "up"])
            && sh(&["ip", "-n", &n.b, "link", "set", &vb, "up"])
            && sh(&["ip", "-n", &n.a, "link", "set", "lo", "up"])
            && sh(&["ip", "-n", &n.b, "link", "set", "lo", "up"]);
        // On failure `n` is dropped here, which deletes whatever namespace was made.
        ok.then_some(n)
    }

    /// `ip netns exec <a>`: the prefix that runs a command inside namespace `a`.
    pub fn exec_a(&self) -> [&str; 4] {
        ["ip", "netns", "exec", self.a.as_str()]
    }

    /// `ip netns exec <b>`.
    pub fn exec_b(&self) -> [&str; 4] {
        ["ip", "netns", "exec", self.b.as_str()]
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        sh(&["ip", "netns", "del", &self.a]);
        sh(&["ip", "netns", "del", &self.b]);
    }
}

/// Say loudly that `test` is skipped and why; fail instead when `MRKIT_REQUIRE_NETNS` is
/// set (CI runs as root and sets it, so the two-host tests cannot silently stop running).
pub fn skip(test: &str, why: &str) {
    eprintln!("SKIP {test}: {why}");
    assert!(
        std::env::var("MRKIT_REQUIRE_NETNS").is_err(),
        "MRKIT_REQUIRE_NETNS set but the test cannot run: {why}"
    );
}

/// A loopback address `127.<first>.y.z` with `y.z` derived from this process's pid: distinct
/// per test binary (processes run concurrently under `cargo test`) and, with a different
/// `first` per role, per role within one binary.
pub fn loopback_addr(first: u8) -> String {
    let pid = std::process::id();
    format!(
        "127.{first}.{}.{}",
        (pid >> 8) as u8 % 250 + 1,
        pid as u8 % 250 + 1
    )
}
