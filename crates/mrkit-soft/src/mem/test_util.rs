//! Shared helpers for the `mem` tests: real anonymous mappings and `/proc/self/status` fields.

use std::sync::{Mutex, MutexGuard};

use rustix::mm::{MapFlags, ProtFlags};

static LOCK: Mutex<()> = Mutex::new(());

/// Serialise the tests that read process-wide counters (VmPin, VmLck).
pub(crate) fn serial() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A `/proc/self/status` field in KiB (`VmPin`, `VmLck`, ...).
pub(crate) fn status_kb(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    for line in s.lines() {
        if let Some(rest) = line.strip_prefix(field).and_then(|r| r.strip_prefix(':')) {
            return rest.trim().trim_end_matches("kB").trim().parse().unwrap();
        }
    }
    panic!("no {field} in /proc/self/status")
}

/// Run `f` (which returns `(rise, fall)` of some counter) until both equal `expect`; other
/// tests of the crate may pin concurrently and disturb the process-wide counters, so a few
/// retries are allowed.
pub(crate) fn expect_delta(what: &str, expect: u64, mut f: impl FnMut() -> (u64, u64)) {
    let mut seen = Vec::new();
    for _ in 0..5 {
        let (rise, fall) = f();
        if rise == expect && fall == expect {
            return;
        }
        seen.push((rise, fall));
    }
    panic!("{what}: expected rise and fall of {expect} KiB, saw (rise, fall) = {seen:?}");
}

/// An anonymous private mapping, unmapped on drop.
pub(crate) struct Map {
    pub(crate) addr: u64,
    pub(crate) len: u64,
}

impl Map {
    /// `len` bytes, PROT_READ|PROT_WRITE.
    pub(crate) fn new(len: u64) -> Map {
        Map::with_prot(len, ProtFlags::READ | ProtFlags::WRITE)
    }

    /// `len` bytes with the given protection.
    pub(crate) fn with_prot(len: u64, prot: ProtFlags) -> Map {
        // SAFETY: a fresh anonymous mapping at a kernel-chosen address aliases nothing.
        let p = unsafe {
            rustix::mm::mmap_anonymous(std::ptr::null_mut(), len as usize, prot, MapFlags::PRIVATE)
        }
        .unwrap();
        Map {
            addr: p as u64,
            len,
        }
    }

    /// `len` bytes aligned to `align` (over-map and trim).
    pub(crate) fn aligned(len: u64, align: u64) -> Map {
        let big = Map::new(len + align);
        let start = (big.addr + align - 1) & !(align - 1);
        let (baddr, blen) = (big.addr, big.len);
        std::mem::forget(big);
        // SAFETY: trimming the head and tail of the mapping created just above, which nothing
        // references.
        unsafe {
            if start > baddr {
                rustix::mm::munmap(baddr as *mut _, (start - baddr) as usize).unwrap();
            }
            let end = start + len;
            if baddr + blen > end {
                rustix::mm::munmap(end as *mut _, (baddr + blen - end) as usize).unwrap();
            }
        }
        Map { addr: start, len }
    }

    /// Write one byte per base page (fault everything in).
    pub(crate) fn touch(&self) {
        let ps = crate::mem::page_size() as u64;
        let mut a = self.addr;
        while a < self.addr + self.len {
            // SAFETY: `a` lies inside this live, writable mapping.
            unsafe { std::ptr::write_volatile(a as *mut u8, 1) };
            a += ps;
        }
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: the mapping is owned by this value and nothing borrows into it any more.
        let _ = unsafe { rustix::mm::munmap(self.addr as *mut _, self.len as usize) };
    }
}

/// Frame numbers of `[addr, addr + len)` as seen by a forked child that only reads them (no
/// writes, so shared copy-on-write pages keep the parent's frames). Hold [`serial`].
pub(crate) fn child_pfns(addr: u64, len: u64) -> Vec<u64> {
    child_pfns_within(addr, len, std::time::Duration::from_secs(20))
        .expect("forked child reported its frame numbers")
}

/// [`child_pfns`], or `None` when the child does not answer within `timeout` (it is killed).
pub(crate) fn child_pfns_within(
    addr: u64,
    len: u64,
    timeout: std::time::Duration,
) -> Option<Vec<u64>> {
    let (mut r, mut w) = std::os::unix::net::UnixStream::pair().unwrap();
    r.set_read_timeout(Some(timeout)).unwrap();
    let n = (len / crate::mem::page_size() as u64) as usize;
    // SAFETY: the test process is multi-threaded; the child only walks its page tables
    // (malloc is fork-safe in glibc; page walks take no lock), writes to a socket and `_exit`s.
    // A deadlock would show up as a read timeout below, never as a wrong answer.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let pfns = crate::mem::translate::walk(addr, len)
            .map(|l| l.pfns)
            .unwrap_or_default();
        let mut bytes = Vec::with_capacity(n * 8);
        for i in 0..n {
            bytes.extend_from_slice(&pfns.get(i).copied().unwrap_or(0).to_ne_bytes());
        }
        let _ = std::io::Write::write_all(&mut w, &bytes);
        // SAFETY: leave the forked child without running the parent's destructors.
        unsafe { libc::_exit(0) };
    }
    assert!(pid > 0, "fork failed");
    drop(w);
    let mut buf = vec![0u8; n * 8];
    let res = std::io::Read::read_exact(&mut r, &mut buf);
    if res.is_err() {
        // SAFETY: killing our own child.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let mut status = 0;
    // SAFETY: reaping our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    res.ok()?;
    Some(
        buf.chunks_exact(8)
            .map(|c| u64::from_ne_bytes(c.try_into().unwrap()))
            .collect(),
    )
}
