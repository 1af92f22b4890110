//! The memory floor under a per-thread hit, for the benchmark: the accesses a hit of
//! [`RegCache::get_ref`](super::RegCache::get_ref) makes, over the same layout, without the
//! cache around them.
//!
//! A hit on a large working set is bound by memory, not instructions: the thread's lease
//! table cell of the page, at random, a likely cache miss (the cell is the lease: one line).
//! This model makes exactly those accesses over the same layout (64-byte cells placed by the
//! table's own hash, [`home`], in a THP-advised array, [`Slots`], as large as the table):
//! the probe of the cell's state and key, the coverage check, and the hit's and the handle
//! drop's owner-only count updates (a plain load and store each, with the dead-flag loads
//! that follow them, as in `lease`). `mrkit bench pool-cache` runs it beside the cache in the
//! same run and the same thread protocol, so that what the machine's memory costs (and what a
//! second thread on it costs) is told apart from what the cache adds. [`serialize`]
//! separates lookups for the bench's isolated shape.

use std::sync::atomic::{compiler_fence, AtomicBool, AtomicU64, Ordering};

use super::lease::mem::Slots;
use super::lease::table::{cells_holding, home, live_tag, next_cell};
use super::tls::page_key;

/// A lease cell as the hit sees it: its tag (state and key), the owner's count, the dead
/// flag and the entry's range.
#[repr(align(64))]
struct FloorCell {
    /// 0 empty, else the live tag of its key (as the table's).
    tag: u32,
    /// Handles taken minus dropped: written by the owning thread only, with a plain load and
    /// store (Release, as the real lease's `own`).
    own: AtomicU64,
    /// Never set here; loaded after each count update, as the real hit and drop do.
    dead: AtomicBool,
    start: u64,
    end: u64,
}

/// One thread's table over `n` 4 KiB entries starting at `base`.
///
/// ```
/// use mrkit::cache::test_support::HitFloor;
/// let f = HitFloor::new(0x7f00_0000_0000, 64);
/// assert!(f.hit(0x7f00_0000_0000 + 5 * 4096, 4096));
/// assert!(!f.hit(0x7f00_0000_0000 + 64 * 4096, 4096)); // not an entry
/// assert!(!f.hit(0x7f00_0000_0000 + 5 * 4096 + 1, 4096)); // not covered
/// ```
pub struct HitFloor {
    cells: Slots<FloorCell>,
    n: usize,
}

impl std::fmt::Debug for HitFloor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HitFloor")
            .field("entries", &self.n)
            .finish()
    }
}

impl HitFloor {
    /// A table of `n` page-sized entries at `base`, `base + 4096`, ….
    pub fn new(base: u64, n: usize) -> HitFloor {
        Self::at_pages(&(0..n as u64).map(|k| base + k * 4096).collect::<Vec<_>>())
    }

    /// A table of page-sized entries at `pages` (page-aligned addresses, distinct).
    ///
    /// ```
    /// use mrkit::cache::test_support::HitFloor;
    /// let f = HitFloor::at_pages(&[0x7f00_0000_0000, 0x7f00_0002_3000]);
    /// assert!(f.hit(0x7f00_0002_3000, 4096));
    /// assert!(!f.hit(0x7f00_0000_1000, 4096));
    /// ```
    pub fn at_pages(pages: &[u64]) -> HitFloor {
        let n = pages.len();
        let size = cells_holding(n);
        let mut cells = Slots::new(size, || FloorCell {
            tag: 0,
            own: AtomicU64::new(0),
            dead: AtomicBool::new(false),
            start: 0,
            end: 0,
        });
        for &start in pages {
            let tag = live_tag(page_key(start));
            let mut i = home(tag, size);
            while cells[i].tag != 0 {
                i = next_cell(i, size);
            }
            let c = &mut cells[i];
            (c.tag, c.start, c.end) = (tag, start, start + 4096);
        }
        HitFloor { cells, n }
    }

    /// The hit's accesses for `addr..addr + len`: false when no entry covers it. Inlined,
    /// as the cache's lookups are (until session 20 neither was in the bench: this function
    /// was kept out of line to match the bench's outlined cache lookup).
    #[inline(always)]
    pub fn hit(&self, addr: u64, len: u64) -> bool {
        let want = live_tag(page_key(addr));
        let cells = self.cells.len();
        let mut i = home(want, cells);
        let c = loop {
            let c = &self.cells[i];
            match c.tag {
                t if t == want => break c,
                0 => return false,
                _ => i = next_cell(i, cells),
            }
        };
        if !(c.start <= addr && addr.saturating_add(len) <= c.end) {
            return false;
        }
        // The hit's count, then the handle drop's, each followed by the dead-flag load (with
        // a compiler fence between, the light side of the lease's asymmetric barrier), as in
        // `lease::take` and `lease::Handle::drop`.
        for d in [1, u64::MAX] {
            let n = c.own.load(Ordering::Relaxed);
            c.own.store(n.wrapping_add(d), Ordering::Release);
            compiler_fence(Ordering::SeqCst);
            if c.dead.load(Ordering::Relaxed) {
                return false;
            }
        }
        true
    }
}
/// Let no later instruction start before every earlier one has completed: x86_64 `LFENCE`
/// (dispatch-serialising on the CPUs Linux runs on: it sets AMD's LFENCE-serialising bit), a
/// sequentially consistent fence elsewhere. Between two lookups it makes each pay its cache
/// misses in full, as a program that looks a buffer up and then posts does; a full memory fence
/// alone does not (the next lookup's loads still overlap on this machine: measured).
///
/// ```
/// mrkit::cache::test_support::serialize();
/// ```
#[inline(always)]
pub fn serialize() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: LFENCE has no preconditions and SSE2 is part of the x86_64 baseline.
    unsafe {
        core::arch::x86_64::_mm_lfence()
    };
    #[cfg(not(target_arch = "x86_64"))]
    std::sync::atomic::fence(Ordering::SeqCst);
}
