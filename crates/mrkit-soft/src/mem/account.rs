//! RLIMIT_MEMLOCK accounting of pinned pages, modelled on the kernel's `mm->pinned_vm`.
//!
//! The kernel (`ib_umem_get`) checks `can_do_mlock()` (EPERM when RLIMIT_MEMLOCK is 0 and the
//! process lacks CAP_IPC_LOCK), then `pinned_vm + npages > RLIMIT_MEMLOCK >> PAGE_SHIFT` (ENOMEM
//! unless CAP_IPC_LOCK). Overlapping registrations are counted twice. The counter is process-wide
//! (one `mm`), shared by every device instance of the process.
//!
//! A forked child has a new `mm` whose `pinned_vm` starts at 0: the child counts in a counter of
//! its own (keyed by [`super::fork_generation`]), and a [`Charge`] it inherited from its parent
//! uncharges nothing when the child drops it (the pages are the parent's).
//!
//! The limit is read with `getrlimit` on every call (the process may change it at any time);
//! `capget` is only issued when the limit check fails, so the common path of [`charge`] is one
//! `getrlimit` plus one compare-exchange.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{err, Result};
use rustix::process::{getrlimit, Resource};
use rustix::thread::{capabilities, CapabilitySet};

/// Pages charged by every live [`Charge`] of this process (the model of `mm->pinned_vm`), one
/// counter per process: a forked child starts from 0 as the kernel's does.
///
/// Guards the RLIMIT_MEMLOCK check: it is only ever raised by a successful compare-exchange
/// from the value the limit was checked against, so two concurrent charges can never both pass
/// the limit; it is lowered by exactly `npages` when a [`Charge`] of the same process drops.
static PINNED_PAGES: super::PerProcess<AtomicU64> = super::PerProcess::new();

/// This process's counter and its fork generation.
fn counter() -> &'static super::Generation<AtomicU64> {
    PINNED_PAGES.get_or_init(|| AtomicU64::new(0))
}

fn page_shift() -> u32 {
    super::page_size().trailing_zeros()
}

/// True if the process may pin memory at all: RLIMIT_MEMLOCK != 0 or CAP_IPC_LOCK.
pub fn can_do_mlock() -> bool {
    memlock_limit() != 0 || has_cap_ipc_lock()
}

/// True if the process holds CAP_IPC_LOCK in its effective set.
pub fn has_cap_ipc_lock() -> bool {
    match capabilities(None) {
        Ok(sets) => sets.effective.contains(CapabilitySet::IPC_LOCK),
        Err(_) => false,
    }
}

/// Current soft RLIMIT_MEMLOCK in bytes (`u64::MAX` for unlimited).
pub fn memlock_limit() -> u64 {
    getrlimit(Resource::Memlock).current.unwrap_or(u64::MAX)
}

/// Pages currently charged by this process (all devices).
pub fn pinned_pages() -> u64 {
    counter().load(Ordering::Relaxed)
}

/// A charge of `npages` against the process's pinned_vm. Dropping it uncharges (in the process
/// that made it; in a forked child it is a no-op).
#[derive(Debug)]
pub struct Charge {
    npages: u64,
    /// Fork generation of the process whose counter was charged.
    gen: u64,
}

impl Charge {
    /// Pages held by this charge.
    pub fn pages(&self) -> u64 {
        self.npages
    }
}

fn human(bytes: u64) -> String {
    if bytes == u64::MAX {
        "unlimited".to_string()
    } else if bytes >= 1 << 30 && bytes % (1 << 30) == 0 {
        format!("{} GiB", bytes >> 30)
    } else if bytes >= 1 << 20 && bytes % (1 << 20) == 0 {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes % (1 << 10) == 0 {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} bytes")
    }
}

/// Charge `npages`; ENOMEM (with a sentence naming the limit and the fix) when it would exceed
/// RLIMIT_MEMLOCK and the process lacks CAP_IPC_LOCK.
pub fn charge(npages: u64) -> Result<Charge> {
    let limit = memlock_limit();
    let limit_pages = if limit == u64::MAX {
        u64::MAX
    } else {
        limit >> page_shift()
    };
    // `None` until capget was needed (only when the limit check fails).
    let mut cap: Option<bool> = None;
    let pinned = counter();
    let mut cur = pinned.load(Ordering::Relaxed);
    loop {
        let new = cur.checked_add(npages).ok_or_else(|| {
            err!(
                ENOMEM,
                "pinning {npages} pages overflows the pinned-page counter ({cur} already \
                 pinned); pin a smaller range"
            )
        })?;
        if new > limit_pages && !*cap.get_or_insert_with(has_cap_ipc_lock) {
            return Err(err!(
                ENOMEM,
                "pinning {npages} pages would exceed RLIMIT_MEMLOCK ({}, {cur} pages already \
                 pinned); raise `ulimit -l` or grant CAP_IPC_LOCK",
                human(limit)
            ));
        }
        match pinned.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => {
                return Ok(Charge {
                    npages,
                    gen: pinned.gen,
                })
            }
            Err(actual) => cur = actual,
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        let pinned = counter();
        // A charge inherited from the parent was never counted in this (child) process.
        if pinned.gen == self.gen {
            pinned.fetch_sub(self.npages, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Errno;
    use rustix::process::{setrlimit, Rlimit};

    const CHILD_ENV: &str = "MRKIT_MEM_ACCOUNT_CHILD";

    /// Run `f` in a forked child and return its result as the child's exit code.
    fn in_forked_child(f: impl FnOnce() -> i32) -> i32 {
        // SAFETY: the child runs `f` (atomics and, at most, the syscalls of a charge) and
        // leaves with `_exit`, running no destructor or exit handler of the parent's state.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let code = f();
            // SAFETY: terminating the forked child.
            unsafe { libc::_exit(code) };
        }
        assert!(pid > 0, "fork failed");
        let mut status = 0;
        // SAFETY: reaping our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "child died: {status:#x}");
        libc::WEXITSTATUS(status)
    }

    #[test]
    fn charge_and_uncharge_with_cap() {
        // Other tests of the crate may charge concurrently: only relative facts are checked.
        assert!(can_do_mlock());
        let c = charge(10).unwrap();
        assert_eq!(c.pages(), 10);
        assert!(pinned_pages() >= 10);
        // While `c` is held the counter is >= 10, so this overflows and must be refused.
        let e = charge(u64::MAX).unwrap_err();
        assert_eq!(e.errno(), Errno::ENOMEM);
        assert!(e.cause().contains("overflows"), "{e}");
        drop(c);
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(64 << 10), "64 KiB");
        assert_eq!(human(8 << 20), "8 MiB");
        assert_eq!(human(u64::MAX), "unlimited");
        assert_eq!(human(100), "100 bytes");
    }

    /// Re-executes this test binary without CAP_IPC_LOCK (via `setpriv`) and runs
    /// [`child_limit_checks`] there.
    #[test]
    fn limit_enforced_without_cap_ipc_lock() {
        if std::env::var_os(CHILD_ENV).is_some() {
            return;
        }
        let exe = std::env::current_exe().unwrap();
        let out = std::process::Command::new("setpriv")
            .args(["--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", "--"])
            .arg(&exe)
            .args([
                "--exact",
                "mem::account::tests::child_limit_checks",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, "1")
            .output();
        let out = match out {
            Ok(o) => o,
            Err(e) => panic!("cannot run setpriv (util-linux) to drop CAP_IPC_LOCK: {e}"),
        };
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
        assert!(
            stdout.contains("CHILD-OK"),
            "child did not run the checks:\n{stdout}\n{stderr}"
        );
    }

    /// Child half of [`limit_enforced_without_cap_ipc_lock`]; a no-op in the normal test run.
    #[test]
    fn child_limit_checks() {
        if std::env::var_os(CHILD_ENV).is_none() {
            return;
        }
        assert!(!has_cap_ipc_lock(), "setpriv did not drop CAP_IPC_LOCK");
        let set = |bytes: u64| {
            setrlimit(
                Resource::Memlock,
                Rlimit {
                    current: Some(bytes),
                    maximum: getrlimit(Resource::Memlock).maximum,
                },
            )
            .unwrap()
        };
        set(64 << 10);
        assert_eq!(memlock_limit(), 64 << 10);
        assert!(can_do_mlock());
        let small = charge(16).expect("16 pages fit in 64 KiB");
        let e = charge(256).unwrap_err();
        assert_eq!(e.errno(), Errno::ENOMEM);
        assert!(
            e.cause().contains("RLIMIT_MEMLOCK (64 KiB, 16 pages"),
            "{e}"
        );
        assert!(e.cause().contains("CAP_IPC_LOCK"), "{e}");
        // The limit is 16 pages: 16 + 1 fails, and after dropping the first charge 16 fits.
        assert_eq!(charge(1).unwrap_err().errno(), Errno::ENOMEM);
        // A forked child has a pinned_vm of its own, starting at 0: it may pin its own 16 pages
        // under the same limit while the parent holds 16, and dropping the parent's charge in
        // the child uncharges nothing.
        assert_eq!(
            in_forked_child(|| {
                if pinned_pages() != 0 {
                    return 1;
                }
                let Ok(mine) = charge(16) else { return 2 };
                // The inherited charge: a no-op in the child (a bitwise copy of `small`).
                // SAFETY: `small` is not used again in the child except through this copy,
                // which is dropped once here.
                drop(unsafe { std::ptr::read(&small) });
                if pinned_pages() != 16 {
                    return 3;
                }
                drop(mine);
                if pinned_pages() != 0 {
                    return 4;
                }
                0
            }),
            0,
            "forked child inherited the parent's pinned-page count"
        );
        assert_eq!(pinned_pages(), 16, "the child's drops touched the parent");
        drop(small);
        assert_eq!(pinned_pages(), 0);

        // Concurrent charges never overshoot the limit together.
        let ok: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8).map(|_| s.spawn(|| charge(3).ok())).collect();
            let charges: Vec<Charge> = hs.into_iter().filter_map(|h| h.join().unwrap()).collect();
            let n = charges.iter().map(|c| c.pages()).sum();
            assert!(pinned_pages() <= 16);
            n
        });
        assert_eq!(ok, 15);
        assert_eq!(pinned_pages(), 0);

        // The kernel agrees: an io_uring long-term pin of 1 MiB fails with ENOMEM, 16 KiB works.
        if crate::mem::pin::io_uring_available() {
            let len = 1u64 << 20;
            // SAFETY: fresh anonymous mapping, unmapped below; no references into it exist.
            let p = unsafe {
                rustix::mm::mmap_anonymous(
                    std::ptr::null_mut(),
                    len as usize,
                    rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                    rustix::mm::MapFlags::PRIVATE,
                )
            }
            .unwrap();
            let e =
                crate::mem::pin::pin_via(crate::mem::pin::PinPath::IoUring, p as u64, len, true)
                    .unwrap_err();
            assert_eq!(e.errno(), Errno::ENOMEM, "{e}");
            let small = crate::mem::pin::pin_via(
                crate::mem::pin::PinPath::IoUring,
                p as u64,
                16 << 10,
                true,
            )
            .expect("16 KiB io_uring pin under a 64 KiB limit");
            drop(small);
            // mlock refuses as well.
            let e = crate::mem::pin::pin_via(crate::mem::pin::PinPath::Mlock, p as u64, len, true)
                .unwrap_err();
            assert_eq!(e.errno(), Errno::ENOMEM, "{e}");
            // SAFETY: `p` is the mapping created above; nothing references it any more.
            unsafe { rustix::mm::munmap(p, len as usize) }.unwrap();
        } else {
            println!("io_uring unavailable: kernel-side ENOMEM check skipped");
        }

        set(0);
        assert!(!can_do_mlock());
        assert_eq!(charge(1).unwrap_err().errno(), Errno::ENOMEM);
        println!("CHILD-OK");
    }
}
