//! Property test: the MR pool against a model, over random sequences of alloc (borrowed and
//! owned), free (here or on a helper thread), write, slicing with arbitrary (hostile) ranges,
//! expose / unexpose, and dropping the handle while owned slots live. Checked after every step:
//!
//! * no slot index or address is held twice; every held slot keeps the bytes last written;
//! * `local` / `remote` / `sges` succeed exactly for ranges inside the slot (EINVAL otherwise,
//!   never a panic), and `remote` only where the slot has remote rights;
//! * `stats().in_use` is the number of slots held, and ENOMEM comes exactly when all are held;
//! * an exposed slot's window covers the slot alone on the device;
//! * at the end, the pool's chunks are deregistered once the handle and the last slot are gone.

mod cache_util;
mod providers_util;

use std::collections::HashSet;
use std::ops::Range;
use std::sync::mpsc;

use cache_util::*;
use mrkit::pool::{MrPool, OwnedSlot, PoolConfig};
use mrkit::{AccessFlags as A, Errno, Registered};
use proptest::prelude::*;

const SLOTS: usize = 16;
const SZ: u64 = 4096;

#[derive(Debug, Clone)]
enum Op {
    Alloc { owned: bool },
    Free { i: usize, other_thread: bool },
    Write { i: usize, byte: u8 },
    Slice { i: usize, start: u64, end: u64 },
    Expose { i: usize },
    Unexpose { i: usize },
}

fn any_bound() -> impl Strategy<Value = u64> {
    prop_oneof![
        0..=SZ + 2,
        Just(u64::MAX),
        Just(u64::MAX - 1),
        Just(1u64 << 32),
        any::<u64>(),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => any::<bool>().prop_map(|owned| Op::Alloc { owned }),
        3 => (any::<usize>(), any::<bool>()).prop_map(|(i, other_thread)| Op::Free { i, other_thread }),
        2 => (any::<usize>(), any::<u8>()).prop_map(|(i, byte)| Op::Write { i, byte }),
        3 => (any::<usize>(), any_bound(), any_bound()).prop_map(|(i, start, end)| Op::Slice { i, start, end }),
        1 => any::<usize>().prop_map(|i| Op::Expose { i }),
        1 => any::<usize>().prop_map(|i| Op::Unexpose { i }),
    ]
}

/// A held slot: the owned kind only (borrowed slots are exercised through `alloc` in the
/// same sequence but freed at once, since a model holding them would borrow the pool).
struct Held {
    s: OwnedSlot,
    byte: u8,
    exposed: bool,
}

fn inside(r: &Range<u64>) -> bool {
    r.start <= r.end && r.end <= SZ
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]
    #[test]
    fn pool_against_model(ops in proptest::collection::vec(op(), 1..60), drop_handle_at in 0usize..60) {
        let (ctx, pd) = open();
        let pool = MrPool::new(&pd, PoolConfig {
            chunk_size: SLOTS * SZ as usize,
            max_chunks: 1,
            thp: false,
            magazine: 4,
            remote: A::REMOTE_READ,
            ..PoolConfig::default()
        }).unwrap();
        let mut pool = Some(pool);
        let (tx, rx) = mpsc::channel::<OwnedSlot>();
        let (ack_tx, ack) = mpsc::channel::<()>();
        let helper = std::thread::spawn(move || {
            for s in rx {
                drop(s);
                let _ = ack_tx.send(());
            }
        });
        let mut held: Vec<Held> = Vec::new();
        for (step, op) in ops.into_iter().enumerate() {
            if step == drop_handle_at {
                pool = None; // owned slots live on
            }
            match op {
                Op::Alloc { owned } => {
                    let Some(p) = pool.as_ref() else { continue };
                    if owned {
                        match p.alloc_owned() {
                            Ok(mut s) => {
                                s.as_mut_slice().fill(0x11);
                                held.push(Held { s, byte: 0x11, exposed: false });
                            }
                            Err(e) => {
                                prop_assert_eq!(e.errno(), Errno::ENOMEM);
                                prop_assert_eq!(held.len(), SLOTS);
                            }
                        }
                    } else {
                        match p.alloc() {
                            Ok(mut s) => {
                                prop_assert!(held.iter().all(|h| h.s.index() != s.index()));
                                s.as_mut_slice()[0] = 1;
                                prop_assert_eq!(p.stats().in_use, held.len() as u64 + 1);
                            }
                            Err(e) => {
                                prop_assert_eq!(e.errno(), Errno::ENOMEM);
                                prop_assert_eq!(held.len(), SLOTS);
                            }
                        }
                    }
                }
                Op::Free { i, other_thread } => {
                    if held.is_empty() { continue }
                    let h = held.swap_remove(i % held.len());
                    if other_thread {
                        tx.send(h.s).unwrap();
                        ack.recv().unwrap();
                    } else {
                        drop(h.s)
                    }
                }
                Op::Write { i, byte } => {
                    if held.is_empty() { continue }
                    let n = held.len();
                    let h = &mut held[i % n];
                    h.s.as_mut_slice().fill(byte);
                    h.byte = byte;
                }
                Op::Slice { i, start, end } => {
                    if held.is_empty() { continue }
                    let h = &held[i % held.len()];
                    let r = start..end;
                    let l = h.s.local(r.clone());
                    let mut v = Vec::new();
                    let g = h.s.sges(r.clone(), &mut v);
                    let rem = h.s.remote(r.clone());
                    if inside(&r) {
                        let l = l.unwrap();
                        prop_assert_eq!((l.addr, u64::from(l.len), l.lkey), (h.s.addr() + start, end - start, h.s.lkey()));
                        prop_assert!(g.is_ok());
                        prop_assert_eq!(v, vec![l]);
                        prop_assert_eq!(rem.is_ok(), h.exposed);
                    } else {
                        prop_assert_eq!(l.unwrap_err().errno(), Errno::EINVAL);
                        prop_assert_eq!(g.unwrap_err().errno(), Errno::EINVAL);
                        prop_assert!(v.is_empty());
                        prop_assert_eq!(rem.unwrap_err().errno(), Errno::EINVAL);
                    }
                }
                Op::Expose { i } => {
                    if held.is_empty() { continue }
                    let n = held.len();
                    let h = &mut held[i % n];
                    let r = h.s.expose(A::REMOTE_READ).unwrap();
                    h.exposed = true;
                    prop_assert_eq!((r.addr, r.len), (h.s.addr(), SZ));
                    let info = ctx.provider().query_mw(r.rkey).unwrap();
                    let (_, addr, len, acc) = info.bound.unwrap();
                    prop_assert_eq!((addr, len, acc), (h.s.addr(), SZ, A::REMOTE_READ));
                }
                Op::Unexpose { i } => {
                    if held.is_empty() { continue }
                    let n = held.len();
                    let h = &mut held[i % n];
                    h.s.unexpose();
                    h.exposed = false;
                    prop_assert!(!h.s.is_exposed());
                }
            }
            // Invariants.
            let mut idx = HashSet::new();
            for h in &held {
                prop_assert!(idx.insert(h.s.index()), "slot {} held twice", h.s.index());
                prop_assert!(h.s.as_slice().iter().all(|&b| b == h.byte), "slot bytes changed");
                prop_assert_eq!(Registered::len(&h.s), SZ);
            }
            if let Some(p) = pool.as_ref() {
                prop_assert_eq!(p.stats().in_use, held.len() as u64);
            }
        }
        drop(pool);
        drop(held);
        drop(tx);
        helper.join().unwrap();
        if !providers_util::needs_native("counts mrkit-soft's live MRs (chunks left registered)") {
            prop_assert_eq!(live_mrs(&ctx), 0, "chunks left registered");
        }
    }
}
