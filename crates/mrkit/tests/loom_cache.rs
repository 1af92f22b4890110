//! loom models of the registration cache's hit / invalidate / evict races.
//!
//! The cache separates an entry's *memory* (an `Arc`: index, per-thread leases, waiters —
//! std's `Arc`, not modelled here) from its *registration*, which is counted by per-thread
//! lease counters (each on a cache line only its thread writes) and retired once the entry
//! is dead and the counters sum to 0. The model mirrors that protocol exactly (all SeqCst):
//!
//! * hit: `gen` check, increment *own* counter, check `dead` (dead: release and miss);
//! * release (handle drop, or a hit backing out): decrement own counter, then if `dead`,
//!   `try_retire`;
//! * kill (invalidate / evict / supersede): set `dead` (under the index write lock), bump
//!   `gen`, then `try_retire`;
//! * `try_retire`: if `dead` and the sum of counters is 0, deregister — guarded by a
//!   `retired` swap so racing retirers deregister once.
//!
//! The code makes every access of that handshake `SeqCst` (a counter RMW then a load of
//! `dead`; a store of `dead` then loads of the counters): C++/Rust forbid the
//! store-buffering outcome for SeqCst accesses, so one side always sees the other. loom
//! models SeqCst *accesses* only as acquire/release, so the model states the same
//! guarantee with `fence(SeqCst)` between the write and the read of each side (without the
//! fences loom reports the store-buffering interleaving, which SeqCst rules out).
//!
//! Properties:
//!
//! * the MR is deregistered exactly once, and never while a hit is using it;
//! * a hit that starts after an invalidation returned never gets the entry (no stale
//!   translation), whatever the interleaving with other hits;
//! * eviction of an idle entry racing a hit never deregisters under the hit;
//! * a handle cloned on one thread and dropped on another keeps the entry registered until
//!   the last drop.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p mrkit --release --test loom_cache`
#![cfg(loom)]

use loom::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
use loom::sync::Arc;

const SC: Ordering = Ordering::SeqCst;

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

/// One entry with two per-thread lease counters.
struct Cache {
    gen: AtomicU64,
    counts: [AtomicU64; 2],
    dead: AtomicBool,
    retired: AtomicBool,
    in_use: AtomicUsize,
    deregs: AtomicUsize,
    invalidated: AtomicBool,
}

impl Cache {
    fn new() -> Arc<Cache> {
        Arc::new(Cache {
            gen: AtomicU64::new(0),
            counts: [AtomicU64::new(0), AtomicU64::new(0)],
            dead: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            in_use: AtomicUsize::new(0),
            deregs: AtomicUsize::new(0),
            invalidated: AtomicBool::new(false),
        })
    }

    fn users(&self) -> u64 {
        self.counts.iter().map(|c| c.load(SC)).sum()
    }

    /// `Entry::try_retire` + `Entry::retire`.
    fn try_retire(&self) {
        if !self.dead.load(SC) {
            return;
        }
        // As in the code (`Entry::try_retire`): a fence between reading `dead` and reading
        // the counters (with SC fences between all accesses the handshake is SC).
        fence(SC);
        if self.users() == 0 && !self.retired.swap(true, Ordering::AcqRel) {
            assert_eq!(self.in_use.load(SC), 0, "deregistered while in use");
            self.deregs.fetch_add(1, SC);
        }
    }

    /// `Lease::release`.
    fn release(&self, lease: usize) {
        self.counts[lease].fetch_sub(1, SC);
        fence(SC);
        if self.dead.load(SC) {
            self.try_retire();
        }
    }

    /// The per-thread fast path (`RegCache::fast_hit`): takes a count on `lease` and
    /// returns whether the hit got the entry (the caller then owns one count).
    fn take(&self, gen_seen: u64, lease: usize) -> bool {
        if self.gen.load(Ordering::Acquire) != gen_seen {
            return false;
        }
        self.counts[lease].fetch_add(1, SC);
        fence(SC);
        // Did invalidate() return before our count was taken?
        let after_invalidation = self.invalidated.load(SC);
        if self.dead.load(SC) {
            self.release(lease);
            return false;
        }
        assert!(
            !after_invalidation,
            "hit after invalidate() returned: stale translation"
        );
        true
    }

    /// Use the keys while holding a count.
    fn use_keys(&self) {
        self.in_use.fetch_add(1, SC);
        assert!(!self.retired.load(SC), "keys used after deregistration");
        self.in_use.fetch_sub(1, SC);
    }

    fn hit(&self, gen_seen: u64, lease: usize) -> bool {
        if !self.take(gen_seen, lease) {
            return false;
        }
        self.use_keys();
        self.release(lease);
        true
    }

    /// Kill under the write lock, then retire if unused (after unlocking).
    fn kill(&self) {
        self.dead.store(true, SC);
        fence(SC);
        self.gen.fetch_add(2, Ordering::AcqRel);
    }

    /// `invalidate()`.
    fn invalidate(&self) {
        self.kill();
        self.invalidated.store(true, SC);
        self.try_retire();
    }
}

#[test]
fn hits_race_invalidation() {
    model(|| {
        let c = Cache::new();
        let (c1, c2) = (c.clone(), c.clone());
        let h1 = loom::thread::spawn(move || c1.hit(0, 0));
        let h2 = loom::thread::spawn(move || c2.hit(0, 1));
        c.invalidate();
        h1.join().unwrap();
        h2.join().unwrap();
        assert_eq!(
            c.deregs.load(SC),
            1,
            "deregistered {} times",
            c.deregs.load(SC)
        );
        // After everything: a new hit can never get the entry.
        assert!(!c.hit(0, 0));
        assert!(!c.hit(2, 1));
    });
}

#[test]
fn hit_races_eviction() {
    model(|| {
        let c = Cache::new();
        let c1 = c.clone();
        let h1 = loom::thread::spawn(move || c1.hit(0, 0));
        // Evictor (under the write lock): only an entry without users; a hit racing in
        // after the check finds it dead (backs out) or is seen by try_retire.
        if c.users() == 0 {
            c.kill();
            c.try_retire();
        } else {
            c.invalidate();
        }
        h1.join().unwrap();
        assert_eq!(c.deregs.load(SC), 1);
    });
}

#[test]
fn handle_moved_across_threads_races_invalidation() {
    model(|| {
        let c = Cache::new();
        // A handle taken on thread 0 (lease 0), cloned (same lease), the clone dropped on
        // another thread while the original is used and an invalidation runs.
        assert!(c.take(0, 0));
        c.counts[0].fetch_add(1, SC); // RegHandle::clone
        let c1 = c.clone();
        let t = loom::thread::spawn(move || {
            c1.use_keys();
            c1.release(0);
        });
        let c2 = c.clone();
        let inv = loom::thread::spawn(move || c2.invalidate());
        c.use_keys();
        c.release(0);
        t.join().unwrap();
        inv.join().unwrap();
        assert_eq!(c.deregs.load(SC), 1);
    });
}
