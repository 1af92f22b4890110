//! A registration cache in a forked child, after the parent used one.
//!
//! The lease protocol decides once per process whether it may use
//! `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)` (registering for it), and a forked child
//! inherits that decision with the parent's memory. The kernel keeps the registration across
//! `fork` (it is reset only by `execve`); if it did not, the child's invalidations would find
//! the command refused and keep the registration of an entry another thread leased until the
//! entry itself goes (late, never unsafe). This test forks after a cache was used and checks,
//! in the child, that an invalidation of an entry leased by another live thread releases its
//! registration at once, and that a hit after it misses.
//!
//! One test in this file: no other test thread may hold a lock at the fork.

mod cache_util;
mod providers_util;

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use cache_util::*;
use mrkit::cache::{CacheConfig, RegCache};
use mrkit::{AccessFlags, Buffer};

const ACC: AccessFlags = AccessFlags::LOCAL_WRITE.union(AccessFlags::REMOTE_WRITE);

fn config() -> CacheConfig {
    CacheConfig {
        monitor: explicit_only(),
        ..CacheConfig::default()
    }
}

/// The child's checks; an error says which failed.
fn child() -> Result<(), String> {
    let (ctx, pd) = open();
    let cache = RegCache::new(&pd, config()).map_err(|e| format!("cache: {e}"))?;
    let buf = Arc::new(Buffer::new(4096).map_err(|e| format!("buffer: {e}"))?);
    let (leased_tx, leased) = mpsc::channel();
    let (done, done_rx) = mpsc::channel::<()>();
    std::thread::scope(|s| {
        let (cache, buf) = (&cache, &buf);
        // Another live thread leases the entry (its table keeps the lease, not a handle).
        s.spawn(move || {
            let got = cache
                .get_owned(buf, 0..4096, ACC)
                .and_then(|_| cache.get_owned(buf, 0..4096, ACC))
                .map(|h| h.lkey());
            let _ = leased_tx.send(got);
            let _ = done_rx.recv();
        });
        // `done` is dropped on every way out of this closure: the helper never waits forever.
        let done = done;
        let key = leased
            .recv()
            .map_err(|_| "helper gone".to_string())?
            .map_err(|e| format!("helper lookup: {e}"))?;
        let h = cache
            .get_owned(buf, 0..4096, ACC)
            .map_err(|e| format!("lookup: {e}"))?;
        if h.lkey() != key {
            return Err("two registrations of one buffer".into());
        }
        drop(h);
        let before = cache.stats().fast_hits;
        cache.invalidate(buf.addr(), 4096);
        // Released at once: the entry held the buffer while registered.
        if Arc::strong_count(buf) != 1 {
            return Err(format!(
                "registration kept after the invalidation ({} owners): the membarrier of the \
                 kill side failed in the forked child",
                Arc::strong_count(buf)
            ));
        }
        let again = cache
            .get_owned(buf, 0..4096, ACC)
            .map_err(|e| format!("lookup after invalidation: {e}"))?;
        if cache.stats().fast_hits != before {
            return Err("a hit after the invalidation".into());
        }
        drop(again);
        drop(done);
        Ok(())
    })?;
    drop(cache);
    assert_live_mrs(&ctx, 0, "MRs left in the child");
    Ok(())
}

#[test]
fn a_forked_child_releases_an_invalidated_registration_at_once() {
    // The parent uses a cache first: the barrier kind is decided (and membarrier registered)
    // before the fork.
    {
        let (_ctx, pd) = open();
        let cache = RegCache::new(&pd, config()).unwrap();
        let buf = Arc::new(Buffer::new(4096).unwrap());
        drop(cache.get_owned(&buf, 0..4096, ACC).unwrap());
    }
    // SAFETY: one test in this binary: the only other thread is the harness's, blocked
    // waiting for this one; the child runs its checks and leaves with `_exit`, never
    // returning into the harness.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let code = match std::panic::catch_unwind(child) {
            Ok(Ok(())) => 0,
            Ok(Err(e)) => {
                eprintln!("child: {e}");
                1
            }
            Err(_) => 2,
        };
        // SAFETY: leaves the child without running the parent's atexit handlers or the
        // harness.
        unsafe { libc::_exit(code) };
    }
    // Wait at most a minute (a lock held at the fork would hang the child).
    let t0 = Instant::now();
    let mut status = 0;
    loop {
        // SAFETY: our child; `status` is a valid out-pointer.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            break;
        }
        assert_eq!(r, 0, "waitpid: {}", std::io::Error::last_os_error());
        if t0.elapsed() > Duration::from_secs(60) {
            // SAFETY: our child, still running.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("the forked child hung");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "child failed: status {status:#x} (see its stderr above)"
    );
}
