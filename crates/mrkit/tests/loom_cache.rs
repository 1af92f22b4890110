//! loom models of the registration cache's hit / invalidate / evict / release races, run
//! on the cache's own lease core (`mrkit::cache::test_support::lease`, whose atomics and mutex come from
//! the cache's sync shim and are loom's under `--cfg loom`).
//!
//! The cache counts handles on per-thread *leases* (one word per thread and entry, see the
//! module doc of `lease`). Here a probe entry stands in for `Entry`: its `retire` is the
//! deregistration, which must happen exactly once, after the entry was killed, and never
//! while a handle uses the keys. The drivers do what the cache does:
//!
//! * hit: `Hold::get` on the thread's hold (the per-thread table's reference; not `Send`:
//!   the thread that makes the lease owns it and is the only one hitting through it);
//! * invalidate / evict / supersede: `LeaseSet::kill` (under the index write lock in the
//!   cache), then `LeaseSet::try_retire` (after unlocking); eviction only of an entry whose
//!   lease set reports no user;
//! * handle drop and clone on any thread (the owner's plain count, or the shared
//!   read-modify-write path), hold drop (table slot replaced, thread exit) on the owner.
//!
//! The hit and the owner's drop have no read-modify-write: they and the kill are ordered
//! by an asymmetric barrier (membarrier on the killing side), modelled here as one
//! read-modify-write of an atomic of the entry's lease set on both sides. Removing the
//! hit's side of it makes `hits_race_invalidation`, `hit_races_eviction` and
//! `hit_races_invalidation_on_an_existing_lease` fail (a handle on a retired entry); taking
//! an off-owner clone outside the set's mutex makes `clone_off_owner_dropped_on_owner_races_kill`
//! fail (the kill's count misses a handle). A handle dropped off its owner thread is ordered
//! with the kill by their read-modify-writes of the lease's `x` (the kill sets `DEAD` there):
//! without the kill's `x |= DEAD`, or with the drop checking `DEAD` in a load before a plain
//! `fetch_add` instead of in its compare-and-swap, five of these models fail (an entry killed
//! with a handle out is never retired after that handle's drop).
//!
//! Properties:
//!
//! * the registration is retired exactly once, and never while a handle uses it;
//! * a hit that starts after an invalidation returned never gets the entry (no stale
//!   translation), whatever the interleaving with other hits;
//! * every lease is freed exactly once (the lease list ends empty; a double free trips the
//!   core's own check);
//! * a handle cloned on one thread and dropped on another keeps the entry registered until
//!   the last drop.
//!
//! Run: `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p mrkit --profile loom
//! --test loom_cache`
#![cfg(loom)]

use std::sync::Arc;

use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use mrkit::cache::test_support::lease::{self, Handle, Hold, LeaseSet, LeaseTable, Retire};

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

/// Stand-in for the cache's entry.
struct Probe {
    leases: LeaseSet<Probe>,
    retired: AtomicBool,
    deregs: AtomicUsize,
    in_use: AtomicUsize,
    /// `invalidate()` returned.
    invalidated: AtomicBool,
}

impl Retire for Probe {
    type Meta = ();
    fn meta(&self) {}
    fn leases(&self) -> &LeaseSet<Probe> {
        &self.leases
    }
    fn retire(&self) {
        // Idempotent like `Entry::retire` (which takes the keys under a mutex).
        assert_eq!(self.in_use.load(SeqCst), 0, "deregistered while in use");
        if !self.retired.swap(true, SeqCst) {
            self.deregs.fetch_add(1, SeqCst);
        }
    }
}

fn probe() -> Arc<Probe> {
    Arc::new(Probe {
        leases: LeaseSet::new(),
        retired: AtomicBool::new(false),
        deregs: AtomicUsize::new(0),
        in_use: AtomicUsize::new(0),
        invalidated: AtomicBool::new(false),
    })
}

/// A thread's hold, as the per-thread table keeps it after a slow-path hit (whose handle
/// is dropped here).
fn hold(p: &Arc<Probe>) -> Hold<Probe> {
    let (h, hold) = lease::lease(p);
    drop(h);
    hold
}

fn use_keys(h: &Handle<Probe>) {
    let p = h.entry();
    p.in_use.fetch_add(1, SeqCst);
    assert!(!p.retired.load(SeqCst), "keys used after deregistration");
    p.in_use.fetch_sub(1, SeqCst);
}

/// A fast-path hit: true if it got (and used) the entry.
fn hit(hold: &Hold<Probe>) -> bool {
    let after_invalidation = hold.entry().invalidated.load(SeqCst);
    match hold.get() {
        Some(h) => {
            assert!(
                !after_invalidation,
                "hit after invalidate() returned: stale translation"
            );
            use_keys(&h);
            true
        }
        None => false,
    }
}

/// `RegCache::invalidate` of the entry.
fn invalidate(p: &Probe) {
    p.leases.kill();
    LeaseSet::try_retire(p);
    p.invalidated.store(true, SeqCst);
}

fn finish(p: &Arc<Probe>) {
    assert_eq!(p.deregs.load(SeqCst), 1, "deregistrations");
    assert_eq!(p.leases.live_leases(), 0, "leases leaked");
}

#[test]
fn hits_race_invalidation() {
    model(|| {
        let p = probe();
        // Each thread hits through its own lease (made on the thread: it owns it).
        let p1 = p.clone();
        let t1 = loom::thread::spawn(move || {
            let h1 = hold(&p1);
            hit(&h1);
            hit(&h1);
        });
        let p2 = p.clone();
        let t2 = loom::thread::spawn(move || {
            let h2 = hold(&p2);
            hit(&h2);
        });
        invalidate(&p);
        t1.join().unwrap();
        t2.join().unwrap();
        // After everything: a new hit can never get the entry.
        let h3 = hold(&p);
        assert!(!hit(&h3));
        drop(h3);
        finish(&p);
    });
}

#[test]
fn hit_races_invalidation_on_an_existing_lease() {
    model(|| {
        let p = probe();
        // The lease exists before the race (a warm table); the hit keeps its handle
        // while it uses it, then drops it on its own thread.
        let p1 = p.clone();
        let (tx, rx) = loom::sync::mpsc::channel::<()>();
        let t1 = loom::thread::spawn(move || {
            let h1 = hold(&p1);
            tx.send(()).unwrap();
            hit(&h1);
        });
        rx.recv().unwrap();
        invalidate(&p);
        t1.join().unwrap();
        finish(&p);
    });
}

#[test]
fn hit_races_eviction() {
    model(|| {
        let p = probe();
        let p1 = p.clone();
        let t1 = loom::thread::spawn(move || {
            let h1 = hold(&p1);
            hit(&h1);
        });
        // Evictor (under the index write lock in the cache): only an idle entry; a hit
        // racing in after the check backs out, or is seen by try_retire.
        if p.leases.users() == 0 {
            p.leases.kill();
            LeaseSet::try_retire(&*p);
        } else {
            invalidate(&p);
        }
        t1.join().unwrap();
        finish(&p);
    });
}

#[test]
fn hold_drop_races_last_handle_release_and_kill() {
    model(|| {
        let p = probe();
        // A handle taken on the owner (this thread) moves to thread 1 and is dropped there
        // (the shared path) while the owner drops its hold (slot replaced, thread exit:
        // the lease is orphaned) and another thread kills the entry.
        let hold0 = hold(&p);
        let h = hold0.get().expect("live entry");
        let t1 = loom::thread::spawn(move || {
            use_keys(&h);
            drop(h);
        });
        let p2 = p.clone();
        let inv = loom::thread::spawn(move || invalidate(&p2));
        drop(hold0);
        t1.join().unwrap();
        inv.join().unwrap();
        finish(&p);
    });
}

#[test]
fn handle_moved_across_threads_races_invalidation() {
    model(|| {
        let p = probe();
        // A handle taken on the owner, cloned (same lease), the clone dropped on another
        // thread while the original is used and dropped on the owner and an invalidation
        // runs.
        let hold0 = hold(&p);
        let h = hold0.get().expect("live entry");
        let c = h.clone();
        let t = loom::thread::spawn(move || {
            use_keys(&c);
            drop(c);
        });
        let p2 = p.clone();
        let inv = loom::thread::spawn(move || invalidate(&p2));
        use_keys(&h);
        drop(h);
        t.join().unwrap();
        inv.join().unwrap();
        drop(hold0);
        finish(&p);
    });
}

#[test]
fn clone_off_owner_dropped_on_owner_races_kill() {
    model(|| {
        let p = probe();
        // The owner's handle goes to thread 1, which clones it (the shared path) and sends
        // the clone back; the owner drops the clone (its plain count) while thread 1 still
        // uses the original and the entry is killed: the kill's count must not miss the
        // original.
        let hold0 = hold(&p);
        let h = hold0.get().expect("live entry");
        let (tx, rx) = loom::sync::mpsc::channel::<Handle<Probe>>();
        let t1 = loom::thread::spawn(move || {
            let c = h.clone();
            tx.send(c).unwrap();
            use_keys(&h);
            drop(h);
        });
        let p2 = p.clone();
        let inv = loom::thread::spawn(move || invalidate(&p2));
        let c = rx.recv().unwrap();
        drop(c);
        t1.join().unwrap();
        inv.join().unwrap();
        drop(hold0);
        finish(&p);
    });
}

// The per-thread lease table (`LeaseTable`): its cells are the leases, so its hit is the
// core's hit; what it adds is placement — a cell whose lease another thread frees is reused
// by the table's thread, and a growing table moves leases no handle points at. (The block's
// record of leased cells is kept under the slab's mutex, which loom does not see; these
// models check the lease protocol around those steps.)

/// A hit through the table at `key`, whose cell should hold `p`'s lease (as `hit` through a
/// hold): never `p` once its invalidation returned before the hit started.
fn table_hit(t: &LeaseTable<Probe>, key: u64, p: &Probe) -> Option<Handle<Probe>> {
    let after_invalidation = p.invalidated.load(SeqCst);
    let h = t.hit(key, |()| true)?.ok()?;
    assert!(std::ptr::eq(h.entry(), p), "another entry's lease");
    assert!(
        !after_invalidation,
        "table hit after invalidate() returned: stale translation"
    );
    use_keys(&h);
    Some(h)
}

#[test]
fn table_hit_races_invalidation() {
    model(|| {
        let p = probe();
        let p1 = p.clone();
        let t1 = loom::thread::spawn(move || {
            let mut t = LeaseTable::default();
            let mut out = Vec::new();
            t.insert(7, &p1, &mut out);
            drop(table_hit(&t, 7, &p1));
            drop(table_hit(&t, 7, &p1));
            drop(t);
        });
        invalidate(&p);
        t1.join().unwrap();
        finish(&p);
    });
}

#[test]
fn a_cell_freed_on_another_thread_is_reused_for_a_new_entry() {
    model(|| {
        let old = probe();
        let new = probe();
        let mut t = LeaseTable::default();
        let mut out = Vec::new();
        t.insert(7, &old, &mut out);
        let h = table_hit(&t, 7, &old).expect("live entry");
        // The handle is dropped elsewhere (the shared path frees the lease if last).
        let t1 = loom::thread::spawn(move || drop(h));
        // The table lets go of the cell (the entry is invalidated), then places the new
        // entry's lease on the same key: in the old cell if its lease is freed by then.
        invalidate(&old);
        t.remove_if(7, |_| true, &mut out);
        drop(std::mem::take(&mut out));
        t.insert(7, &new, &mut out);
        drop(table_hit(&t, 7, &new).expect("the new entry"));
        t1.join().unwrap();
        drop(t);
        finish(&old);
        assert_eq!(new.leases.live_leases(), 0, "leases leaked");
    });
}

#[test]
fn a_growing_table_moves_leases_while_a_handle_is_dropped_elsewhere() {
    model(|| {
        let ps: Vec<Arc<Probe>> = (0..41).map(|_| probe()).collect();
        let mut t = LeaseTable::default();
        let mut out = Vec::new();
        for (k, p) in ps.iter().take(40).enumerate() {
            t.insert(k as u64, p, &mut out);
        }
        let h = table_hit(&t, 3, &ps[3]).expect("live entry");
        let t1 = loom::thread::spawn(move || drop(h));
        // The 41st lease rebuilds the table: the lease of key 3 moves if the handle is gone
        // by then, else it is let go of where it is.
        t.insert(40, &ps[40], &mut out);
        drop(std::mem::take(&mut out));
        drop(table_hit(&t, 3, &ps[3]));
        invalidate(&ps[3]);
        assert!(
            table_hit(&t, 3, &ps[3]).is_none(),
            "hit on an invalidated entry"
        );
        t1.join().unwrap();
        drop(t);
        finish(&ps[3]);
        for p in &ps {
            assert_eq!(p.leases.live_leases(), 0, "leases leaked");
        }
    });
}
