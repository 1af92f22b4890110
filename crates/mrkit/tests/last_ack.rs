//! A receiver process that leaves the moment its last receive completes still acknowledges
//! that message: the sender's SEND completes with SUCCESS, as it does against a ConnectX,
//! whose responder sent the ACK before the receive completion was even written.
//!
//! Before the fix the ACK could still be in the progress thread's hands (the run had pushed
//! the completion, its packets were not yet with the link) when the application saw the
//! completion, destroyed its QP and exited; the sender then retried into the void and failed
//! with RETRY_EXC_ERR. `examples/pool_echo` is exactly that program (its server returns on the
//! empty message that ends the session, and the process exits); it failed 2–4 runs in 10
//! before the fix. This test runs the example's own `server` and `client` (the file is
//! included as a module), the server in a child process (this test binary run again).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

#[path = "../examples/pool_echo.rs"]
#[allow(dead_code)] // the example's `main`
mod pool_echo;

const ROLE: &str = "MRKIT_LAST_ACK_SERVER";
const TEST: &str = "a_server_that_exits_at_once_still_acks_the_last_message";
const RUNS: usize = 40;

#[test]
fn a_server_that_exits_at_once_still_acks_the_last_message() {
    if std::env::var_os(ROLE).is_some() {
        // The child: serve one session; the process exits right after the last message.
        return pool_echo::server("127.0.0.1:0").unwrap();
    }
    for run in 0..RUNS {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", TEST, "--nocapture", "--test-threads=1"])
            .env(ROLE, "1")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        let addr = loop {
            line.clear();
            assert!(
                out.read_line(&mut line).unwrap() > 0,
                "the server did not start"
            );
            // (libtest may print the test's name on the same line first)
            if let Some(i) = line.find("listening on ") {
                break line[i + "listening on ".len()..].trim().to_string();
            }
        };
        let words = ["ping", "hello, pool", "x"];
        let echoes = pool_echo::client(&addr, &words).unwrap_or_else(|e| panic!("run {run}: {e}"));
        assert_eq!(echoes, words);
        assert!(
            child.wait().unwrap().success(),
            "run {run}: the server failed"
        );
    }
}
