//! Object lifetimes through the C API (tests/c/lifecycle.c, linked against the system
//! libibverbs and run with ours): use after close, double release, fork.

mod common;

use common::{compile_c, lib_dir, text};

/// Run `lifecycle <mode>` against our library, killed after 120 s (a hang is a failure).
fn lifecycle(mode: &str, env: &[(&str, &str)]) {
    let prog = compile_c("lifecycle.c", true);
    let mut cmd = std::process::Command::new("timeout");
    cmd.args(["-s", "KILL", "120"])
        .arg(&prog)
        .arg(mode)
        .env("LD_LIBRARY_PATH", lib_dir());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let o = cmd.output().expect("run timeout(1)");
    let out = text(&o);
    println!("{out}");
    assert!(
        o.status.success() && out.contains("all checks passed"),
        "lifecycle {mode} failed ({}):\n{out}",
        o.status
    );
}

#[test]
fn verbs_on_a_closed_context_and_double_release_are_einval() {
    lifecycle("closed", &[]);
}

#[test]
fn forked_child_gets_a_device_of_its_own() {
    lifecycle("fork", &[]);
}

#[test]
fn forked_child_with_fork_protection() {
    // RDMAV_FORK_SAFE: the parent's registered pages are absent in the child (DONTFORK); the
    // child never touches them, so everything else holds as without it.
    lifecycle("fork", &[("RDMAV_FORK_SAFE", "1")]);
}

#[test]
fn forked_child_never_takes_the_parents_mrkit_addr() {
    // Addresses of this test process only (other test runs may use 127.x addresses too).
    let pid = std::process::id();
    let (x, y) = (((pid >> 8) & 0xff) as u8 | 1, (pid & 0xff) as u8 | 1);
    let parent = format!("127.{x}.{y}.41");
    let child = format!("127.{x}.{y}.42");
    lifecycle(
        "forkaddr",
        &[("MRKIT_ADDR", &parent), ("MRKIT_CHILD_ADDR", &child)],
    );
}
