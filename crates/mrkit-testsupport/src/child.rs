//! Waiting for a child process with a deadline, draining its pipes while it runs.

use std::io::Read;
use std::process::{Child, Output};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

/// Read `r` to its end on a thread; the bytes arrive on the returned channel.
fn drain(r: Option<impl Read + Send + 'static>) -> Option<Receiver<Vec<u8>>> {
    r.map(|mut r| {
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            let _ = tx.send(v);
        });
        rx
    })
}

/// What a drained pipe held; a grandchild that keeps the pipe open after the child exited
/// gets two seconds, then what was read is lost rather than the caller hanging.
fn collect(rx: Option<Receiver<Vec<u8>>>) -> Vec<u8> {
    rx.and_then(|rx| rx.recv_timeout(Duration::from_secs(2)).ok())
        .unwrap_or_default()
}

/// Wait for `child` for at most `limit`, reading its piped stdout and stderr meanwhile (a
/// child that writes more than a pipe holds, 64 KiB, would otherwise block forever and look
/// like a hang). `Ok` with its output when it exited in time; `Err` with what it wrote when
/// it was killed at the deadline.
pub fn output_within(mut child: Child, limit: Duration) -> Result<Output, Output> {
    let out = drain(child.stdout.take());
    let err = drain(child.stderr.take());
    let end = Instant::now() + limit;
    let (status, in_time) = loop {
        if let Some(st) = child.try_wait().expect("wait for a child") {
            break (st, true);
        }
        if Instant::now() > end {
            let _ = child.kill();
            break (child.wait().expect("wait for a killed child"), false);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let o = Output {
        status,
        stdout: collect(out),
        stderr: collect(err),
    };
    if in_time {
        Ok(o)
    } else {
        Err(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    #[test]
    fn a_child_writing_more_than_a_pipe_holds_finishes() {
        let c = Command::new("sh")
            .args([
                "-c",
                "head -c 1000000 /dev/zero; head -c 200000 /dev/zero >&2",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let o = output_within(c, Duration::from_secs(30)).expect("finished");
        assert_eq!((o.stdout.len(), o.stderr.len()), (1_000_000, 200_000));
    }

    #[test]
    fn a_hanging_child_is_killed_at_the_deadline() {
        let c = Command::new("sh")
            .args(["-c", "echo started; exec sleep 30"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let t = Instant::now();
        let o = output_within(c, Duration::from_millis(300)).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(10));
        assert_eq!(o.stdout, b"started\n");
    }
}
