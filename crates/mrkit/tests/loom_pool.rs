//! loom model of the pool's shared free list (Treiber stack with ABA tag): concurrent pops
//! and pushes never hand one slot to two owners and never lose a slot.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p mrkit --release --test loom_pool`
#![cfg(loom)]

use loom::sync::Arc;
use mrkit::pool::freelist::FreeStack;

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
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
        let mut all = Vec::new();
        while let Some(i) = s.pop() {
            all.push(i);
        }
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 2], "slot lost or duplicated");
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
        while let Some(i) = s.pop() {
            all.push(i);
        }
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 2, 3]);
    });
}
