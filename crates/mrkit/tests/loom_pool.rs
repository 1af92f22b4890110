//! loom models of the pool's lock-free parts, on the pool's own code:
//! * the shared free list (Treiber stack with ABA tag, batch pop in one CAS): concurrent pops
//!   and pushes never hand one slot to two owners and never lose a slot;
//! * the lifetime protocol of owned slots (`pool::life`): the pool's memory (the keepalive) is
//!   released exactly once, only when the last handle is gone and every slot was freed, however
//!   the last frees race the closing handle.
//!
//! Run: `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p mrkit --profile loom --test loom_pool`
#![cfg(loom)]

use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use mrkit::pool::freelist::FreeStack;
use mrkit::pool::life::{bump, Life};

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

fn drain(s: &FreeStack) -> Vec<u32> {
    let mut all = Vec::new();
    while let Some(i) = s.pop() {
        all.push(i);
    }
    all.sort_unstable();
    all
}

#[test]
fn pop_push_races_keep_a_permutation() {
    model(|| {
        let s = Arc::new(FreeStack::new(3));
        s.push_many(&[0, 1, 2]);
        let s1 = s.clone();
        let t1 = loom::thread::spawn(move || {
            let x = s1.pop().unwrap();
            s1.push(x);
        });
        let s2 = s.clone();
        let t2 = loom::thread::spawn(move || {
            let y = s2.pop().unwrap();
            let z = s2.pop();
            assert_ne!(Some(y), z, "one slot popped twice");
            s2.push(y);
            if let Some(z) = z {
                s2.push(z);
            }
        });
        t1.join().unwrap();
        t2.join().unwrap();
        assert_eq!(drain(&s), vec![0, 1, 2], "slot lost or duplicated");
    });
}

#[test]
fn batch_push_vs_pop() {
    model(|| {
        let s = Arc::new(FreeStack::new(4));
        s.push_many(&[0]);
        let s1 = s.clone();
        let t1 = loom::thread::spawn(move || s1.push_many(&[1, 2, 3]));
        let s2 = s.clone();
        let t2 = loom::thread::spawn(move || s2.pop());
        t1.join().unwrap();
        let got = t2.join().unwrap();
        let mut all: Vec<u32> = got.into_iter().collect();
        all.extend(drain(&s));
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 2, 3]);
    });
}

/// A magazine refill (a chain popped in one CAS) racing a pop-and-push-back (the ABA case the
/// tag exists for) and a batch push.
#[test]
fn batch_pop_races_pop_and_push() {
    model(|| {
        let s = Arc::new(FreeStack::new(5));
        s.push_many(&[0, 1, 2]);
        let s1 = s.clone();
        let t1 = loom::thread::spawn(move || {
            let mut v = Vec::new();
            let n = s1.pop_many(2, &mut v);
            assert_eq!(n, v.len());
            v
        });
        let s2 = s.clone();
        let t2 = loom::thread::spawn(move || {
            let x = s2.pop();
            s2.push_many(&[3, 4]);
            if let Some(x) = x {
                s2.push(x);
            }
        });
        let mut all = t1.join().unwrap();
        t2.join().unwrap();
        let mut mine = all.clone();
        mine.sort_unstable();
        mine.dedup();
        assert_eq!(mine.len(), all.len(), "one slot popped twice");
        all.extend(drain(&s));
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 2, 3, 4], "slot lost or duplicated");
    });
}

/// The keepalive: counts its own release.
struct Keep(Arc<AtomicUsize>);

impl Drop for Keep {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// Two owned slots allocated on the main thread are freed on two other threads while the main
/// thread drops the last handle: the memory goes exactly once, after both frees, whoever is
/// last (a free that counts itself just before `closing` is set must be seen by the closer, or
/// see `closing` itself).
#[test]
fn last_frees_race_the_closing_handle() {
    model(|| {
        let released = Arc::new(AtomicUsize::new(0));
        let life = Arc::new(Life::new());
        life.arm(Keep(released.clone()));
        let main = life.register();
        bump(&main.allocs);
        bump(&main.allocs);
        let ts: Vec<_> = (0..2)
            .map(|_| {
                let (l, r) = (life.clone(), released.clone());
                loom::thread::spawn(move || {
                    let cell = l.register();
                    // This thread still holds its slot: the memory must be there.
                    assert_eq!(r.load(Ordering::SeqCst), 0, "released while a slot is live");
                    bump(&cell.frees);
                    // The free path of `pool::release`.
                    if l.closing_after_free(&cell) {
                        drop(l.settle());
                    }
                })
            })
            .collect();
        drop(life.close());
        for t in ts {
            t.join().unwrap();
        }
        assert_eq!(
            released.load(Ordering::SeqCst),
            1,
            "memory leaked or freed twice"
        );
    });
}

/// A slot allocated on one thread and freed on another while the handle is still open, then
/// the handle closes with one slot still live elsewhere, freed through the shared count (a
/// thread whose thread-local storage is gone): released only by that last free.
#[test]
fn close_with_a_live_slot_waits_for_it() {
    model(|| {
        let released = Arc::new(AtomicUsize::new(0));
        let life = Arc::new(Life::new());
        life.arm(Keep(released.clone()));
        let main = life.register();
        bump(&main.allocs);
        bump(&main.allocs);
        bump(&main.frees);
        let (l, r) = (life.clone(), released.clone());
        let t = loom::thread::spawn(move || {
            assert_eq!(r.load(Ordering::SeqCst), 0, "released while a slot is live");
            // A free without thread-local storage (the shared cell).
            drop(l.count_free_shared());
        });
        drop(life.close());
        t.join().unwrap();
        assert_eq!(released.load(Ordering::SeqCst), 1);
    });
}
