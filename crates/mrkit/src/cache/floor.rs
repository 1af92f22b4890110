//! The memory floor under a per-thread hit, for the benchmark: the accesses a hit of
//! [`RegCache::get_ref`](super::RegCache::get_ref) makes, over the same layout, without the
//! cache around them.
//!
//! A hit on a large working set is bound by memory, not instructions: a slot of the thread's
//! page table at random, then the entry's 64-byte lease line, each a likely cache miss. This
//! model makes exactly those accesses with the cache's own [`PageTable`] and THP-advised
//! arrays ([`Slots`]): the slot, a coverage check on the lease line, and the hit's and the
//! handle drop's owner-only count updates (a plain load and store each, with the dead-flag
//! loads that follow them, as in `lease`). `mrkit bench
//! pool-cache` runs it beside the cache in the same run and the same thread protocol, so
//! that what the machine's memory costs (and what a second thread on it costs) is told apart
//! from what the cache adds. [`serialize`] separates lookups for the bench's isolated shape.

use std::sync::atomic::{compiler_fence, AtomicBool, AtomicU64, Ordering};

use super::lease::mem::Slots;
use super::tls::{page_key, PageTable};

/// A lease line as the hit sees it: the owner's count, the dead flag and the entry's range.
#[repr(align(64))]
struct FloorLease {
    /// Handles taken minus dropped: written by the owning thread only, with a plain load and
    /// store (Release, as the real lease's `own`).
    own: AtomicU64,
    /// Never set here; loaded after each count update, as the real hit and drop do.
    dead: AtomicBool,
    start: u64,
    end: u64,
}

/// One thread's table and leases over `n` 4 KiB entries starting at `base`.
///
/// ```
/// use mrkit::cache::test_support::HitFloor;
/// let f = HitFloor::new(0x7f00_0000_0000, 64);
/// assert!(f.hit(0x7f00_0000_0000 + 5 * 4096, 4096));
/// assert!(!f.hit(0x7f00_0000_0000 + 64 * 4096, 4096)); // not an entry
/// assert!(!f.hit(0x7f00_0000_0000 + 5 * 4096 + 1, 4096)); // not covered
/// ```
pub struct HitFloor {
    table: PageTable<u32>,
    leases: Slots<FloorLease>,
}

impl std::fmt::Debug for HitFloor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HitFloor")
            .field("entries", &self.leases.len())
            .finish()
    }
}

impl HitFloor {
    /// A table of `n` page-sized entries at `base`, `base + 4096`, … (at most `u32::MAX`).
    pub fn new(base: u64, n: usize) -> HitFloor {
        let n32 = u32::try_from(n).expect("at most u32::MAX entries");
        let mut i = 0u64;
        let leases = Slots::new(n, || {
            let start = base + i * 4096;
            i += 1;
            FloorLease {
                own: AtomicU64::new(0),
                dead: AtomicBool::new(false),
                start,
                end: start + 4096,
            }
        });
        let mut table = PageTable::default();
        for k in 0..n32 {
            table.insert(page_key(base + u64::from(k) * 4096), k);
        }
        HitFloor { table, leases }
    }

    /// The hit's accesses for `addr..addr + len`: false when no entry covers it. Not inlined:
    /// a caller pays one call, as a lookup of the cache costs the bench one.
    #[inline(never)]
    pub fn hit(&self, addr: u64, len: u64) -> bool {
        let Some(&i) = self.table.get(page_key(addr)) else {
            return false;
        };
        let l = &self.leases[i as usize];
        if !(l.start <= addr && addr.saturating_add(len) <= l.end) {
            return false;
        }
        // The hit's count, then the handle drop's, each followed by the dead-flag load (with
        // a compiler fence between, the light side of the lease's asymmetric barrier), as in
        // `lease::Hold::try_get` and `lease::Handle::drop`.
        for d in [1, u64::MAX] {
            let n = l.own.load(Ordering::Relaxed);
            l.own.store(n.wrapping_add(d), Ordering::Release);
            compiler_fence(Ordering::SeqCst);
            if l.dead.load(Ordering::Relaxed) {
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
