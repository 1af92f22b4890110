//! Refcounted `MADV_DONTFORK` ranges: the first registration over a page marks it, the last one
//! gone restores `MADV_DOFORK` (so the kernel can merge the VMA back).
//!
//! Per-page counts live in a process-global [`RangeCounter`]; `madvise(MADV_DONTFORK)` is only
//! issued for the pages whose count goes 0 → 1 and `MADV_DOFORK` for those going 1 → 0, so
//! overlapping registrations never clear each other's mark (libibverbs' `ibv_fork_init` range
//! tree does the same).
//!
//! The counts are per process: a forked child does not have the parent's DONTFORK ranges at all
//! (they were not copied), so it starts with no marks, and dropping a mark it inherited changes
//! neither its counts nor its mappings (memory it mapped there since is its own).

use parking_lot::Mutex;

use super::range_count::RangeCounter;
use crate::error::{err, Result};

/// Per-page DONTFORK mark counts of this process; held across the madvise calls so the
/// kernel's VMA flags always match the counts.
static MARKS: super::PerProcess<Mutex<RangeCounter>> = super::PerProcess::new();

/// This process's mark counts and its fork generation.
fn marks() -> &'static super::Generation<Mutex<RangeCounter>> {
    MARKS.get_or_init(|| Mutex::new(RangeCounter::new()))
}

/// A DONTFORK mark on `[start, start + len)`; dropping it releases the mark.
#[derive(Debug)]
pub struct DontFork {
    start: u64,
    len: u64,
    /// Fork generation of the process that marked the range.
    gen: u64,
}

impl DontFork {
    /// Marked range start.
    pub fn start(&self) -> u64 {
        self.start
    }
    /// Marked range length.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Whether the running kernel copies pinned pages into a forked child instead of sharing them
/// copy-on-write (Linux 5.13 and later, the kernels whose RDMA netlink reports "copy-on-fork";
/// rdma-core's `ibv_is_fork_initialized` then answers `IBV_FORK_UNNEEDED`). Read from `uname`.
pub fn kernel_copies_pinned_pages_on_fork() -> bool {
    let uts = rustix::system::uname();
    let release = uts.release().to_string_lossy();
    let mut parts = release
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let major = parts.next().unwrap_or(0);
    let minor = parts.next().unwrap_or(0);
    (major, minor) >= (5, 13)
}

fn advise(start: u64, end: u64, dontfork: bool) -> rustix::io::Result<()> {
    let advice = if dontfork {
        rustix::mm::Advice::LinuxDontFork
    } else {
        rustix::mm::Advice::LinuxDoFork
    };
    // SAFETY: MADV_(DONT|DO)FORK only changes whether fork() copies the VMA; it touches neither
    // contents nor the parent's mapping layout.
    unsafe { rustix::mm::madvise(start as *mut _, (end - start) as usize, advice) }
}

/// Mark the page-aligned range DONTFORK (refcounted per page).
pub fn dontfork(start: u64, len: u64) -> Result<DontFork> {
    let ps = super::page_size() as u64;
    if start % ps != 0 || len % ps != 0 {
        return Err(err!(
            EINVAL,
            "DONTFORK range [{start:#x}, +{len:#x}) is not page aligned; round it with \
             mem::page_span first"
        ));
    }
    let end = start.checked_add(len).ok_or_else(|| {
        err!(
            EINVAL,
            "DONTFORK range [{start:#x}, +{len:#x}) wraps the address space; pass a valid range"
        )
    })?;
    let cell = marks();
    let mut marks = cell.lock();
    for (s, e) in marks.inc(start, end) {
        if let Err(errno) = advise(s, e, true) {
            for (gs, ge) in marks.dec(start, end) {
                let _ = advise(gs, ge, false);
            }
            return Err(match errno {
                rustix::io::Errno::NOMEM => err!(
                    EFAULT,
                    "cannot mark [{s:#x}, {e:#x}) DONTFORK: part of it is unmapped; register \
                     mapped memory"
                ),
                other => err!(
                    EFAULT,
                    "madvise(MADV_DONTFORK) on [{s:#x}, {e:#x}) failed: {other}; register \
                     ordinary mapped memory (not VM_IO/VM_PFNMAP)"
                ),
            });
        }
    }
    Ok(DontFork {
        start,
        len,
        gen: cell.gen,
    })
}

impl Drop for DontFork {
    fn drop(&mut self) {
        let cell = marks();
        if self.len == 0 || cell.gen != self.gen {
            return;
        }
        let mut marks = cell.lock();
        for (s, e) in marks.dec(self.start, self.start + self.len) {
            // Failure means the caller unmapped the range already: nothing left to restore.
            let _ = advise(s, e, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Errno;
    use crate::mem::test_util::{serial, Map};

    /// Fork; the child reports with its exit code whether each page of `addrs` is mapped.
    fn mapped_in_child(addrs: &[u64]) -> Vec<bool> {
        // SAFETY: the child only calls mincore and _exit (async-signal-safe) before exiting.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let mut code = 0;
            for (i, &a) in addrs.iter().enumerate() {
                let mut v = 0u8;
                // SAFETY: mincore only writes one byte into `v`; the address is not accessed.
                let rc = unsafe { libc::mincore(a as *mut _, 4096, &mut v) };
                if rc == 0 {
                    code |= 1 << i;
                }
            }
            // SAFETY: leave the forked child without running any destructor.
            unsafe { libc::_exit(code) };
        }
        assert!(pid > 0, "fork failed");
        let mut status = 0;
        // SAFETY: reaping our own child.
        let rc = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(rc, pid);
        assert!(libc::WIFEXITED(status));
        let code = libc::WEXITSTATUS(status);
        (0..addrs.len()).map(|i| code & (1 << i) != 0).collect()
    }

    #[test]
    fn refcounted_marks() {
        let _g = serial();
        let ps = 4096;
        let m = Map::new(8 * ps);
        let page = |i: u64| m.addr + i * ps;
        let probe: Vec<u64> = (0..8).map(page).collect();
        assert_eq!(mapped_in_child(&probe), vec![true; 8]);
        // A = pages 0..4, B = pages 2..6.
        let a = dontfork(page(0), 4 * ps).unwrap();
        assert_eq!((a.start(), a.len()), (page(0), 4 * ps));
        let b = dontfork(page(2), 4 * ps).unwrap();
        let expect_ab = [false, false, false, false, false, false, true, true];
        assert_eq!(mapped_in_child(&probe), expect_ab);
        drop(a);
        // Pages 2..6 stay DONTFORK (B), pages 0..2 are copied again.
        let expect_b = [true, true, false, false, false, false, true, true];
        assert_eq!(mapped_in_child(&probe), expect_b);
        drop(b);
        assert_eq!(mapped_in_child(&probe), vec![true; 8]);
    }

    /// A forked child does not have its parent's DONTFORK ranges; memory it maps there and
    /// registers is marked for its own forks (the parent's counts would have said "already
    /// marked"), and dropping the inherited mark leaves the child's mark alone.
    #[test]
    fn forked_child_marks_its_own_memory() {
        let _g = serial();
        let ps = 4096;
        let m = Map::new(2 * ps);
        let parent_mark = dontfork(m.addr, 2 * ps).unwrap();
        // SAFETY: the child maps memory where the parent's DONTFORK range was (absent in the
        // child), forks once more to probe it and leaves with `_exit`; a panic is caught and
        // turned into an exit code, so the child never returns into the test harness.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let code = std::panic::catch_unwind(|| {
                // SAFETY: MAP_FIXED_NOREPLACE over a range that is unmapped in this child.
                let p = unsafe {
                    libc::mmap(
                        m.addr as *mut _,
                        2 * ps as usize,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                        -1,
                        0,
                    )
                };
                if p as u64 != m.addr {
                    return 10;
                }
                let Ok(mine) = dontfork(m.addr, 2 * ps) else {
                    return 11;
                };
                // The inherited mark: dropping it in the child must not clear the child's.
                // SAFETY: a bitwise copy of the parent's mark, dropped once in this child only.
                drop(unsafe { std::ptr::read(&parent_mark) });
                let code = match mapped_in_child(&[m.addr, m.addr + ps]).as_slice() {
                    [false, false] => 0,
                    _ => 12,
                };
                drop(mine);
                code
            })
            .unwrap_or(99);
            // SAFETY: terminating the forked child.
            unsafe { libc::_exit(code) };
        }
        assert!(pid > 0, "fork failed");
        let mut status = 0;
        // SAFETY: reaping our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "child died: {status:#x}");
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "child's own range was not marked"
        );
        assert_eq!(
            mapped_in_child(&[m.addr]),
            vec![false],
            "parent's mark lost"
        );
        drop(parent_mark);
    }

    #[test]
    fn unmapped_is_efault_and_rolls_back() {
        let _g = serial();
        let ps = 4096;
        let m = Map::new(4 * ps);
        // Unmap page 2 only.
        // SAFETY: punching a hole into our own mapping that nothing references.
        unsafe { rustix::mm::munmap((m.addr + 2 * ps) as *mut _, ps as usize) }.unwrap();
        let e = dontfork(m.addr, 4 * ps).unwrap_err();
        assert_eq!(e.errno(), Errno::EFAULT, "{e}");
        assert_eq!(marks().lock().count_at(m.addr), 0);
        assert_eq!(
            mapped_in_child(&[m.addr, m.addr + 3 * ps]),
            vec![true, true],
            "failed mark was not rolled back"
        );
        assert_eq!(dontfork(m.addr + 1, ps).unwrap_err().errno(), Errno::EINVAL);
    }
}
