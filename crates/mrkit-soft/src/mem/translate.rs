//! The page walk: which page size backs each part of a range, and the frame numbers.
//!
//! Page sizes come from the `PAGEMAP_SCAN` ioctl (`PAGE_IS_HUGE`, Linux >= 6.7) on
//! `/proc/self/pagemap`; frame numbers from batched `pread`s of `/proc/self/pagemap` (zero
//! unless the process has CAP_SYS_ADMIN, in which case they are reported as unknown).
//!
//! # Entry-count model
//!
//! The segments model what an HCA's translation table (MTT) needs for the range given its
//! alignment: only *whole, 2 MiB-aligned* huge blocks inside `[start, start + len)` become
//! 2 MiB entries; a huge page that the range covers only partially (at either edge) is counted
//! as 4 KiB pages, because a 2 MiB entry would have to start before or end after the range. The
//! ioctl is therefore only issued when the range contains at least one whole aligned 2 MiB
//! block, which keeps small registrations at a single `pread` (or none when frame numbers are
//! not readable). hugetlb pages of 1 GiB are reported as 2 MiB segments (PAGEMAP_SCAN does not
//! tell the huge page size; the count is an upper bound for them).
//!
//! # The pagemap file
//!
//! `/proc/self/pagemap` is opened once per process and kept open. The file is bound to the
//! address space of the process that opened it, so a `pthread_atfork` child handler bumps a
//! generation and a forked child opens its own. (A child created by a raw `clone` syscall that
//! bypasses libc's fork handlers would read its parent's tables; checking the pid instead would
//! cost a system call, ~95 ns here, per walk.) The file is published through an atomic
//! pointer, not behind a lock: a lock that another thread holds at `fork` (a walk under way)
//! stays held forever in the child, whose first walk then hung (a test forks while another
//! thread walks). Whether frame numbers are visible is decided by the kernel at
//! open time (CAP_SYS_ADMIN of the opener) and cached with the file.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::error::{err, Result};

/// A run of equally sized pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Address of the first page (aligned to `page_size`).
    pub start: u64,
    /// Page size backing this run: 4 KiB, 2 MiB (THP or hugetlb) or 1 GiB (hugetlb).
    pub page_size: u64,
    /// Number of pages in the run.
    pub count: u64,
}

/// Translation of a pinned range: segments of pages and (if readable) frame numbers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PageList {
    /// Runs of pages covering the range in address order.
    pub segments: Vec<Segment>,
    /// One frame number per translation entry (per page of each segment) when the process may
    /// read them; empty otherwise.
    pub pfns: Vec<u64>,
}

impl PageList {
    /// Translation entries (MTT entries) this list needs: one per page of each segment.
    pub fn entries(&self) -> u64 {
        self.segments.iter().map(|s| s.count).sum()
    }
    /// The largest page size used.
    pub fn max_page_size(&self) -> u64 {
        self.segments.iter().map(|s| s.page_size).max().unwrap_or(0)
    }
    /// True when frame numbers were readable.
    pub fn has_pfns(&self) -> bool {
        !self.pfns.is_empty()
    }
}

/// Size of a PMD-mapped huge page (THP / hugetlb 2 MiB).
pub const HUGE_2M: u64 = 2 << 20;

/// pagemap entry: page present in RAM.
pub(crate) const PM_PRESENT: u64 = 1 << 63;
/// pagemap entry: page swapped out.
pub(crate) const PM_SWAPPED: u64 = 1 << 62;
/// pagemap entry: frame-number bits (0-54).
pub(crate) const PM_PFN_MASK: u64 = (1 << 55) - 1;

/// Entries per `pread` of the pagemap (2 MiB of entries = 1 GiB of 4 KiB pages).
const PREAD_ENTRIES: u64 = 256 * 1024;

// ---------------------------------------------------------------------------------------------
// The process-wide pagemap file

const UNKNOWN: u8 = 0;
const YES: u8 = 1;
const NO: u8 = 2;

struct Pagemap {
    file: File,
    /// Whether frame numbers read through this file are real (UNKNOWN until seen).
    pfns: AtomicU8,
}

/// The open `/proc/self/pagemap` of this process: a forked child opens its own (the parent's
/// file shows the parent's address space) and takes no lock a walking thread held at `fork`.
static PAGEMAP: super::PerProcess<Pagemap> = super::PerProcess::new();
/// PAGEMAP_SCAN availability: UNKNOWN, YES or NO.
static HUGE_DETECT: AtomicU8 = AtomicU8::new(UNKNOWN);

/// Run `f` with the current process's pagemap file (opened on first use, and again in a
/// forked child).
fn with_pagemap<R>(f: impl FnOnce(&Pagemap) -> R) -> Result<R> {
    let p = PAGEMAP.get_or_try_init(|_| {
        let file = File::open("/proc/self/pagemap").map_err(|e| {
            err!(
                EOPNOTSUPP,
                "cannot open /proc/self/pagemap ({e}); mount procfs to enable page walks"
            )
        })?;
        HUGE_DETECT.store(UNKNOWN, Ordering::Relaxed);
        Ok(Pagemap {
            file,
            pfns: AtomicU8::new(UNKNOWN),
        })
    })?;
    Ok(f(p))
}

/// Read the pagemap entries of `n` base pages starting at page-aligned `start` into `out`
/// (appended). Pages beyond the end of the address space read as 0.
fn read_entries(p: &Pagemap, start: u64, n: u64, out: &mut Vec<u64>) -> Result<()> {
    let ps = super::page_size() as u64;
    let mut buf: Vec<u8> = Vec::new();
    let mut done = 0u64;
    while done < n {
        let chunk = PREAD_ENTRIES.min(n - done);
        buf.clear();
        buf.resize((chunk * 8) as usize, 0);
        let off = (start / ps + done) * 8;
        let mut got = 0usize;
        while got < buf.len() {
            match rustix::io::pread(&p.file, &mut buf[got..], off + got as u64) {
                Ok(0) => break,
                Ok(k) => got += k,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    return Err(err!(
                        EFAULT,
                        "reading /proc/self/pagemap at {:#x} failed: {e}; pass a user-space \
                         address range",
                        start + done * ps
                    ))
                }
            }
        }
        out.extend(
            buf.chunks_exact(8)
                .map(|c| u64::from_ne_bytes(c.try_into().expect("8-byte chunk"))),
        );
        done += chunk;
    }
    Ok(())
}

/// The raw pagemap entries (`PM_PRESENT`, `PM_SWAPPED`, PFN bits) of `n` base pages from the
/// page-aligned `start`.
pub(crate) fn pagemap_entries(start: u64, n: u64) -> Result<Vec<u64>> {
    let mut out = Vec::with_capacity(n as usize);
    with_pagemap(|p| read_entries(p, start, n, &mut out))??;
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// PAGEMAP_SCAN

/// `struct pm_scan_arg` (linux/fs.h).
#[repr(C)]
#[derive(Debug, Default)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

/// `struct page_region` (linux/fs.h).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}

/// `_IOWR('f', 16, struct pm_scan_arg)`.
const PAGEMAP_SCAN: u64 =
    (3 << 30) | ((std::mem::size_of::<PmScanArg>() as u64) << 16) | ((b'f' as u64) << 8) | 16;
/// `PAGE_IS_PRESENT` (linux/fs.h; bit 3).
const PAGE_IS_PRESENT: u64 = 1 << 3;
/// `PAGE_IS_HUGE` (linux/fs.h; bit 6).
const PAGE_IS_HUGE: u64 = 1 << 6;

/// Present huge-page runs in `[start, end)` from PAGEMAP_SCAN, or `None` when the ioctl is not
/// supported by this kernel (recorded for [`huge_detection_available`]) or failed.
fn scan_huge(p: &Pagemap, start: u64, end: u64) -> Option<Vec<(u64, u64)>> {
    if HUGE_DETECT.load(Ordering::Relaxed) == NO {
        return None;
    }
    let mut regions = [PageRegion::default(); 32];
    let mut runs: Vec<(u64, u64)> = Vec::new();
    let mut cursor = start;
    while cursor < end {
        let mut arg = PmScanArg {
            size: std::mem::size_of::<PmScanArg>() as u64,
            start: cursor,
            end,
            vec: regions.as_mut_ptr() as u64,
            vec_len: regions.len() as u64,
            category_mask: PAGE_IS_HUGE | PAGE_IS_PRESENT,
            return_mask: PAGE_IS_HUGE | PAGE_IS_PRESENT,
            ..PmScanArg::default()
        };
        // SAFETY: `arg` is a valid pm_scan_arg whose `vec` points at `regions` with `vec_len`
        // writable entries; both outlive the call. The kernel writes only `walk_end` and the
        // region array.
        let rc = unsafe {
            libc::ioctl(
                p.file.as_raw_fd(),
                PAGEMAP_SCAN as _,
                &mut arg as *mut PmScanArg,
            )
        };
        if rc < 0 {
            let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            if e == libc::ENOTTY || e == libc::EINVAL || e == libc::EOPNOTSUPP {
                HUGE_DETECT.store(NO, Ordering::Relaxed);
            }
            return None;
        }
        HUGE_DETECT.store(YES, Ordering::Relaxed);
        for r in &regions[..rc as usize] {
            match runs.last_mut() {
                Some(last) if last.1 == r.start => last.1 = r.end,
                _ => runs.push((r.start, r.end)),
            }
        }
        if arg.walk_end <= cursor {
            break; // no progress: never loop forever on an odd kernel answer
        }
        cursor = arg.walk_end;
    }
    Some(runs)
}

/// Whether huge pages can be detected (the PAGEMAP_SCAN ioctl works on this kernel).
/// Probed on first call; without it every page is reported as 4 KiB.
pub fn huge_detection_available() -> bool {
    match HUGE_DETECT.load(Ordering::Relaxed) {
        YES => return true,
        NO => return false,
        _ => {}
    }
    static PROBE: u8 = 0;
    let page = &PROBE as *const u8 as u64 & !(super::page_size() as u64 - 1);
    let ok = with_pagemap(|p| scan_huge(p, page, page + super::page_size() as u64).is_some())
        .unwrap_or(false);
    if !ok {
        HUGE_DETECT.store(NO, Ordering::Relaxed);
    }
    ok
}

// ---------------------------------------------------------------------------------------------
// The walk

fn push_segment(segs: &mut Vec<Segment>, start: u64, page_size: u64, count: u64) {
    if count == 0 {
        return;
    }
    if let Some(last) = segs.last_mut() {
        if last.page_size == page_size && last.start + last.count * page_size == start {
            last.count += count;
            return;
        }
    }
    segs.push(Segment {
        start,
        page_size,
        count,
    });
}

/// Walk the page-aligned, resident range `[start, start + len)` (call after pinning).
pub fn walk(start: u64, len: u64) -> Result<PageList> {
    let ps = super::page_size() as u64;
    if start % ps != 0 || len % ps != 0 {
        return Err(err!(
            EINVAL,
            "page walk of [{start:#x}, +{len:#x}) is not page aligned; round it with \
             mem::page_span first"
        ));
    }
    let end = start.checked_add(len).ok_or_else(|| {
        err!(
            EINVAL,
            "page walk of [{start:#x}, +{len:#x}) wraps the address space; pass a valid range"
        )
    })?;
    let mut list = PageList::default();
    if len == 0 {
        return Ok(list);
    }
    let r = with_pagemap(|p| -> Result<PageList> {
        // Whole 2 MiB-aligned blocks inside the range: the only place a 2 MiB entry can go.
        let hs = start.checked_add(HUGE_2M - 1).map(|x| x & !(HUGE_2M - 1));
        let he = end & !(HUGE_2M - 1);
        let mut huge: Vec<(u64, u64)> = Vec::new();
        if let Some(hs) = hs.filter(|&hs| hs < he) {
            if let Some(runs) = scan_huge(p, hs, he) {
                for (a, b) in runs {
                    // Keep whole aligned blocks only.
                    let a = ((a.max(hs)) + HUGE_2M - 1) & !(HUGE_2M - 1);
                    let b = b.min(he) & !(HUGE_2M - 1);
                    if a < b {
                        huge.push((a, b));
                    }
                }
            }
        }
        let mut segs = Vec::new();
        let mut cursor = start;
        for &(a, b) in &huge {
            push_segment(&mut segs, cursor, ps, (a - cursor) / ps);
            push_segment(&mut segs, a, HUGE_2M, (b - a) / HUGE_2M);
            cursor = b;
        }
        push_segment(&mut segs, cursor, ps, (end - cursor) / ps);

        let mut pfns = Vec::new();
        if p.pfns.load(Ordering::Relaxed) != NO {
            let entries = {
                let mut v = Vec::with_capacity((len / ps) as usize);
                read_entries(p, start, len / ps, &mut v)?;
                v
            };
            let mut any_present = false;
            let mut any_pfn = false;
            for s in &segs {
                let first = ((s.start - start) / ps) as usize;
                let step = (s.page_size / ps) as usize;
                for k in 0..s.count as usize {
                    let e = entries[first + k * step];
                    let present = e & PM_PRESENT != 0 && e & PM_SWAPPED == 0;
                    any_present |= present;
                    let pfn = if present { e & PM_PFN_MASK } else { 0 };
                    any_pfn |= pfn != 0;
                    pfns.push(pfn);
                }
            }
            if !any_pfn {
                if any_present {
                    // Present pages with frame number 0: the kernel hides PFNs from us.
                    p.pfns.store(NO, Ordering::Relaxed);
                }
                pfns.clear();
            } else {
                p.pfns.store(YES, Ordering::Relaxed);
            }
        }
        Ok(PageList {
            segments: segs,
            pfns,
        })
    });
    match r {
        Ok(r) => r,
        // No procfs: every page is reported as 4 KiB, frame numbers unknown.
        Err(_) => {
            list.segments.push(Segment {
                start,
                page_size: ps,
                count: len / ps,
            });
            Ok(list)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::test_util::Map;

    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * 1024;

    #[test]
    fn small_walk_is_4k() {
        let m = Map::new(64 * KIB);
        m.touch();
        let l = walk(m.addr, m.len).unwrap();
        assert_eq!(
            l.segments,
            vec![Segment {
                start: m.addr,
                page_size: 4096,
                count: 16
            }]
        );
        assert_eq!(l.entries(), 16);
        assert_eq!(l.max_page_size(), 4096);
        if l.has_pfns() {
            assert_eq!(l.pfns.len(), 16);
            assert!(l.pfns.iter().all(|&p| p != 0));
            // Distinct pages have distinct frames.
            let mut s = l.pfns.clone();
            s.sort_unstable();
            s.dedup();
            assert_eq!(s.len(), 16);
        } else {
            println!("frame numbers hidden (no CAP_SYS_ADMIN)");
        }
        assert_eq!(walk(m.addr, 0).unwrap(), PageList::default());
        assert_eq!(
            walk(m.addr + 1, 4096).unwrap_err().errno(),
            crate::Errno::EINVAL
        );
    }

    fn thp_mode() -> String {
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_else(|_| "(no THP support in this kernel)".into())
    }

    #[test]
    fn thp_walk() {
        let len = 8 * MIB;
        let m = Map::aligned(len, HUGE_2M);
        // SAFETY: advice on our own mapping; MADV_HUGEPAGE changes no contents.
        let adv = unsafe {
            rustix::mm::madvise(
                m.addr as *mut _,
                len as usize,
                rustix::mm::Advice::LinuxHugepage,
            )
        };
        // Block 2 stays 4 KiB, so the walk sees huge, small and huge runs in one range (the
        // PFN check below must find each segment's own entries).
        // SAFETY: advice on our own mapping; MADV_NOHUGEPAGE changes no contents.
        let _ = unsafe {
            rustix::mm::madvise(
                (m.addr + 2 * HUGE_2M) as *mut _,
                HUGE_2M as usize,
                rustix::mm::Advice::LinuxNoHugepage,
            )
        };
        m.touch();
        // Pages we will use as a sub-range that starts and ends in the middle of huge blocks.
        let l = walk(m.addr, len).unwrap();
        let huge = l.segments.iter().any(|s| s.page_size == HUGE_2M);
        let total: u64 = l.segments.iter().map(|s| s.count * s.page_size).sum();
        assert_eq!(total, len);
        if !huge {
            println!(
                "THP not obtained (MADV_HUGEPAGE: {adv:?}; enabled: {}; PAGEMAP_SCAN \
                 available: {}): checking the 4 KiB result only",
                thp_mode().trim(),
                huge_detection_available()
            );
            assert_eq!(
                l.segments,
                vec![Segment {
                    start: m.addr,
                    page_size: 4096,
                    count: len / 4096
                }]
            );
            return;
        }
        assert!(huge_detection_available());
        println!("THP segments: {:?}", l.segments);
        assert_eq!(l.max_page_size(), HUGE_2M);
        if l.has_pfns() {
            assert_eq!(l.pfns.len() as u64, l.entries());
            // One PFN per entry: a segment's entries start at the sum of the earlier counts.
            let mut first = 0usize;
            for s in &l.segments {
                if s.page_size == HUGE_2M {
                    for pfn in &l.pfns[first..first + s.count as usize] {
                        assert_eq!(pfn % 512, 0, "head PFN of a 2 MiB page is 2 MiB aligned");
                    }
                }
                first += s.count as usize;
            }
        }
        // Range from the middle of block 0 to the middle of block 3: the partial blocks count
        // as 4 KiB pages, the whole blocks 1 and 2 (if huge) as 2 MiB.
        let sub = walk(m.addr + MIB, 6 * MIB).unwrap();
        assert_eq!(sub.segments[0].page_size, 4096);
        assert_eq!(sub.segments[0].start, m.addr + MIB);
        assert_eq!(sub.segments.last().unwrap().page_size, 4096);
        let huge_blocks: u64 = sub
            .segments
            .iter()
            .filter(|s| s.page_size == HUGE_2M)
            .map(|s| s.count)
            .sum();
        assert!(huge_blocks <= 2);
        let total: u64 = sub.segments.iter().map(|s| s.count * s.page_size).sum();
        assert_eq!(total, 6 * MIB);
        // A range inside one huge page stays 4 KiB and needs no ioctl.
        let small = walk(m.addr + 2 * MIB, 4096).unwrap();
        assert_eq!(small.segments[0].page_size, 4096);
        assert_eq!(small.entries(), 1);
    }

    /// A child forked while another thread of the parent is in the middle of a walk walks its
    /// own pages: nothing it inherits from that walk (a lock held at the fork, a file of the
    /// parent's address space) may block or mislead it.
    #[test]
    fn fork_during_another_threads_walk() {
        let _g = crate::mem::test_util::serial();
        let small = crate::mem::test_util::Map::new(4 * 4096);
        small.touch();
        if !walk(small.addr, small.len).unwrap().has_pfns() {
            return;
        }
        // An untouched 256 MiB range: each walk reads 64 Ki entries, so the other thread is
        // inside a walk most of the time.
        let big = crate::mem::test_util::Map::new(256 << 20);
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    walk(big.addr, big.len).unwrap();
                }
            });
            for i in 0..20 {
                let child = crate::mem::test_util::child_pfns_within(
                    small.addr,
                    small.len,
                    std::time::Duration::from_secs(5),
                );
                if child.is_none() {
                    stop.store(true, Ordering::Relaxed);
                }
                let child = child.unwrap_or_else(|| panic!("fork {i}: the child's walk hung"));
                assert!(child.iter().all(|&p| p != 0), "fork {i}: {child:?}");
            }
            stop.store(true, Ordering::Relaxed);
        });
    }

    #[test]
    fn fork_reopens_pagemap() {
        // Open the parent's file first, then walk in a forked child: the child must see its own
        // frames (after fork the child's anonymous pages are COW copies with new frames once
        // written).
        let m = Map::new(4096);
        m.touch();
        let parent = walk(m.addr, 4096).unwrap();
        if !parent.has_pfns() {
            return;
        }
        let _g = crate::mem::test_util::serial();
        let (mut r, mut w) = std::os::unix::net::UnixStream::pair().unwrap();
        r.set_read_timeout(Some(std::time::Duration::from_secs(20)))
            .unwrap();
        // SAFETY: the test process is multi-threaded; the child only writes its own memory,
        // walks (malloc is fork-safe in glibc; page walks take no lock), writes to a socket and
        // `_exit`s. A deadlock would surface as a read timeout below, not as a false pass.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: writing our own private mapping in the child.
            unsafe { std::ptr::write_volatile(m.addr as *mut u8, 2) };
            let c = walk(m.addr, 4096).map(|l| l.pfns.first().copied().unwrap_or(0));
            let v = c.unwrap_or(0).to_ne_bytes();
            let _ = std::io::Write::write_all(&mut w, &v);
            // SAFETY: terminating the forked child without running the parent's destructors.
            unsafe { libc::_exit(0) };
        }
        assert!(pid > 0);
        drop(w);
        let mut buf = [0u8; 8];
        let res = std::io::Read::read_exact(&mut r, &mut buf);
        let mut status = 0;
        if res.is_err() {
            // SAFETY: killing our own child process.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        // SAFETY: reaping our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        res.expect("child walk answered");
        let child_pfn = u64::from_ne_bytes(buf);
        assert_ne!(child_pfn, 0);
        assert_ne!(
            child_pfn, parent.pfns[0],
            "child read the parent's page tables"
        );
    }
}
