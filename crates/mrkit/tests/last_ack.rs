//! A receiver process that leaves the moment its last receive completes still acknowledges
//! that message: the sender's SEND completes with SUCCESS, as it does against a ConnectX,
//! whose responder sent the ACK before the receive completion was even written.
//!
//! Before the fix the ACK could still be in the progress thread's hands (the run had pushed
//! the completion, its packets were not yet with the link) when the application saw the
//! completion, destroyed its QP and exited; the sender then retried into the void and failed
//! with RETRY_EXC_ERR. `examples/pool_echo` is exactly that program (its server exits on the
//! empty message that ends the session); it failed 2–4 runs in 10 before the fix. `cargo
//! test` (all targets, as `.ci/run`) builds the examples next to the test binaries, so this test
//! runs it as it is (run alone, build it first: `cargo build -p mrkit --examples`).

use std::path::PathBuf;
use std::process::Command;

const RUNS: usize = 40;

fn example(name: &str) -> PathBuf {
    // target/<profile>/deps/last_ack-<hash> -> target/<profile>/examples/<name>
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name)
}

#[test]
fn a_server_that_exits_at_once_still_acks_the_last_message() {
    let pool_echo = example("pool_echo");
    assert!(pool_echo.exists(), "{} not built", pool_echo.display());
    for run in 0..RUNS {
        let out = Command::new(&pool_echo).output().unwrap();
        assert!(
            out.status.success(),
            "run {run}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
