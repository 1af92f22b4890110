//! loom models of the registration cache's hit / invalidate / evict races.
//!
//! The cache's entry life cycle is an `Arc<Entry>` (the index holds one reference, every
//! handle one; thread-local caches hold `Weak`s) plus a `dead` flag set under the index write
//! lock, and a hit is `gen check -> Weak::upgrade -> dead check`. loom has no `Weak`, so the
//! model mirrors std's protocol exactly (upgrade = CAS from n > 0 to n + 1, drop =
//! `fetch_sub(Release)` + `fence(Acquire)` on reaching 0, which runs `Entry::drop` = the
//! deregistration). Properties:
//!
//! * the MR is deregistered exactly once, and never while a hit is using it;
//! * a hit that starts after an invalidation returned never gets the entry (no stale
//!   translation), whatever the interleaving with other hits;
//! * eviction of an idle entry racing a hit never deregisters under the hit.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p mrkit --release --test loom_cache`
#![cfg(loom)]

use loom::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
use loom::sync::Arc;

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

struct Cache {
    gen: AtomicU64,
    strong: AtomicUsize,
    dead: AtomicBool,
    in_use: AtomicUsize,
    deregs: AtomicUsize,
    invalidated: AtomicBool,
}

impl Cache {
    fn new() -> Arc<Cache> {
        Arc::new(Cache {
            gen: AtomicU64::new(0),
            strong: AtomicUsize::new(1), // the index's reference
            dead: AtomicBool::new(false),
            in_use: AtomicUsize::new(0),
            deregs: AtomicUsize::new(0),
            invalidated: AtomicBool::new(false),
        })
    }

    /// `Weak::upgrade`.
    fn upgrade(&self) -> bool {
        let mut n = self.strong.load(Ordering::Relaxed);
        loop {
            if n == 0 {
                return false;
            }
            match self
                .strong
                .compare_exchange_weak(n, n + 1, Ordering::Acquire, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(cur) => n = cur,
            }
        }
    }

    /// `Drop for Arc` -> `Drop for Entry` (deregistration) on the last reference.
    fn drop_ref(&self) {
        if self.strong.fetch_sub(1, Ordering::Release) == 1 {
            fence(Ordering::Acquire);
            assert_eq!(
                self.in_use.load(Ordering::SeqCst),
                0,
                "deregistered while in use"
            );
            self.deregs.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// The per-thread fast path: returns whether the hit got the entry.
    fn hit(&self, gen_seen: u64) -> bool {
        if self.gen.load(Ordering::Acquire) != gen_seen {
            return false;
        }
        if !self.upgrade() {
            return false;
        }
        // Did invalidate() return before our reference was taken?
        let after_invalidation = self.invalidated.load(Ordering::SeqCst);
        if self.dead.load(Ordering::Acquire) {
            self.drop_ref();
            return false;
        }
        assert!(
            !after_invalidation,
            "hit after invalidate() returned: stale translation"
        );
        self.in_use.fetch_add(1, Ordering::SeqCst);
        self.in_use.fetch_sub(1, Ordering::SeqCst);
        self.drop_ref();
        true
    }

    /// `invalidate()`: under the write lock mark dead, bump the generation; then drop the
    /// index's reference.
    fn invalidate(&self) {
        self.dead.store(true, Ordering::Release);
        self.gen.fetch_add(2, Ordering::AcqRel);
        self.invalidated.store(true, Ordering::SeqCst);
        self.drop_ref();
    }
}

#[test]
fn hits_race_invalidation() {
    model(|| {
        let c = Cache::new();
        let (c1, c2) = (c.clone(), c.clone());
        let h1 = loom::thread::spawn(move || c1.hit(0));
        let h2 = loom::thread::spawn(move || c2.hit(0));
        c.invalidate();
        h1.join().unwrap();
        h2.join().unwrap();
        assert_eq!(
            c.deregs.load(Ordering::SeqCst),
            1,
            "deregistered {} times",
            c.deregs.load(Ordering::SeqCst)
        );
        // After everything: a new hit can never get the entry.
        assert!(!c.hit(0));
        assert!(!c.hit(2));
    });
}

#[test]
fn hit_races_eviction() {
    model(|| {
        let c = Cache::new();
        let c1 = c.clone();
        let h1 = loom::thread::spawn(move || c1.hit(0));
        // Evictor (under the write lock): only an entry referenced by the index alone.
        if c.strong.load(Ordering::Acquire) == 1 {
            c.dead.store(true, Ordering::Release);
            c.gen.fetch_add(2, Ordering::AcqRel);
            c.drop_ref();
        } else {
            c.invalidate();
        }
        h1.join().unwrap();
        assert_eq!(c.deregs.load(Ordering::SeqCst), 1);
    });
}
