//! Property test: random WRITE / READ / FETCH_ADD / CMP_SWP sequences on random MR layouts
//! (some out of bounds → REM_ACCESS_ERR, then both QPs are reset and reconnected) end with
//! memory equal to a simple model.
mod common;

use common::*;
use mrkit_soft::cq::WcStatus;
use mrkit_soft::qp::{attr_mask, QpAttr, QpState, SendWr, WrOpcode};
use proptest::prelude::*;

const LOCAL: usize = 4096;

#[derive(Debug, Clone)]
enum Op {
    Write {
        mr: usize,
        roff: usize,
        loff: usize,
        len: usize,
    },
    Read {
        mr: usize,
        roff: usize,
        loff: usize,
        len: usize,
    },
    FetchAdd {
        mr: usize,
        word: usize,
        lword: usize,
        add: u64,
    },
    CmpSwp {
        mr: usize,
        word: usize,
        lword: usize,
        hit: bool,
        swap: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    // Offsets are drawn wide (up to 2x the largest MR) so that some ops fall out of bounds.
    let mr = 0usize..4;
    prop_oneof![
        (mr.clone(), 0usize..2048, 0usize..LOCAL, 1usize..600).prop_map(|(mr, roff, loff, len)| {
            Op::Write {
                mr,
                roff,
                loff,
                len,
            }
        }),
        (mr.clone(), 0usize..2048, 0usize..LOCAL, 1usize..600).prop_map(|(mr, roff, loff, len)| {
            Op::Read {
                mr,
                roff,
                loff,
                len,
            }
        }),
        (mr.clone(), 0usize..200, 0usize..(LOCAL / 8), any::<u64>()).prop_map(
            |(mr, word, lword, add)| Op::FetchAdd {
                mr,
                word,
                lword,
                add
            }
        ),
        (
            mr,
            0usize..200,
            0usize..(LOCAL / 8),
            any::<bool>(),
            any::<u64>()
        )
            .prop_map(|(mr, word, lword, hit, swap)| Op::CmpSwp {
                mr,
                word,
                lword,
                hit,
                swap
            }),
    ]
}

fn bytes(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|w| w.to_ne_bytes()).collect()
}

fn reconnect(a: &Host, b: &Host) {
    let reset = QpAttr {
        qp_state: QpState::Reset as u32,
        ..QpAttr::default()
    };
    a.ctx.modify_qp(a.qp, &reset, attr_mask::STATE).unwrap();
    b.ctx.modify_qp(b.qp, &reset, attr_mask::STATE).unwrap();
    drain(a);
    drain(b);
    connect(a, b, all(), 1);
}

fn run(sizes: Vec<usize>, seed: u64, ops: Vec<Op>) {
    let (a, b) = pair();
    // Backing stores are u64 so every MR start is 8-aligned (atomics need it).
    let mut local: Vec<u64> = (0..LOCAL / 8)
        .map(|i| seed.wrapping_mul(i as u64 + 1))
        .collect();
    let mut remote: Vec<Vec<u64>> = sizes
        .iter()
        .enumerate()
        .map(|(k, &s)| {
            (0..s / 8)
                .map(|i| (seed ^ k as u64).wrapping_add(i as u64 * 0x9E37))
                .collect()
        })
        .collect();
    let mut mlocal = bytes(&local);
    let mut mremote: Vec<Vec<u8>> = remote.iter().map(|r| bytes(r)).collect();
    let lm = a
        .ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            a.pd,
            unsafe { mrkit_soft::UserMemory::new(local.as_mut_ptr() as u64, LOCAL as u64) },
            all(),
        )
        .unwrap();
    let rms: Vec<_> = remote
        .iter_mut()
        .map(|r| {
            b.ctx
                // SAFETY: test memory: it stays allocated while any work request can reach this MR.
                .reg_mr_va(
                    b.pd,
                    unsafe {
                        mrkit_soft::UserMemory::new(r.as_mut_ptr() as u64, (r.len() * 8) as u64)
                    },
                    all(),
                )
                .unwrap()
        })
        .collect();
    for (i, op) in ops.iter().enumerate() {
        let id = i as u64;
        let (wr, in_bounds) = match *op {
            Op::Write {
                mr,
                roff,
                loff,
                len,
            }
            | Op::Read {
                mr,
                roff,
                loff,
                len,
            } => {
                let mr = mr % sizes.len();
                let len = len.min(LOCAL - loff);
                let opc = if matches!(op, Op::Write { .. }) {
                    WrOpcode::RdmaWrite
                } else {
                    WrOpcode::RdmaRead
                };
                let wr = SendWr::new(id, opc)
                    .sge(lm.iova + loff as u64, len as u32, lm.lkey)
                    .remote(rms[mr].iova + roff as u64, rms[mr].rkey);
                let ok = roff + len <= sizes[mr];
                if ok {
                    if opc == WrOpcode::RdmaWrite {
                        let src = mlocal[loff..loff + len].to_vec();
                        mremote[mr][roff..roff + len].copy_from_slice(&src);
                    } else {
                        let src = mremote[mr][roff..roff + len].to_vec();
                        mlocal[loff..loff + len].copy_from_slice(&src);
                    }
                }
                (wr, ok)
            }
            Op::FetchAdd {
                mr,
                word,
                lword,
                add,
            }
            | Op::CmpSwp {
                mr,
                word,
                lword,
                swap: add,
                ..
            } => {
                let mr = mr % sizes.len();
                let ok = (word + 1) * 8 <= sizes[mr];
                let cmp = matches!(op, Op::CmpSwp { .. });
                let (ro, lo) = (word * 8, lword * 8);
                let cur = if ok {
                    u64::from_ne_bytes(mremote[mr][ro..ro + 8].try_into().unwrap())
                } else {
                    0
                };
                let mut wr = SendWr::new(
                    id,
                    if cmp {
                        WrOpcode::AtomicCmpAndSwp
                    } else {
                        WrOpcode::AtomicFetchAndAdd
                    },
                )
                .sge(lm.iova + lo as u64, 8, lm.lkey)
                .remote(rms[mr].iova + ro as u64, rms[mr].rkey);
                if cmp {
                    let hit = matches!(op, Op::CmpSwp { hit: true, .. });
                    wr.compare_add = if hit { cur } else { cur.wrapping_add(1) };
                    wr.swap = add;
                } else {
                    wr.compare_add = add;
                }
                if ok {
                    let new = if cmp {
                        if wr.compare_add == cur {
                            add
                        } else {
                            cur
                        }
                    } else {
                        cur.wrapping_add(add)
                    };
                    mremote[mr][ro..ro + 8].copy_from_slice(&new.to_ne_bytes());
                    mlocal[lo..lo + 8].copy_from_slice(&cur.to_ne_bytes());
                }
                (wr, ok)
            }
        };
        a.ctx.post_send(a.qp, &[wr]).unwrap();
        drive(&a, &b);
        let w = drain(&a);
        assert_eq!(w.len(), 1, "op {i} {op:?}: {w:?}");
        if in_bounds {
            assert_eq!(w[0].status, WcStatus::Success, "op {i} {op:?}");
        } else {
            assert_eq!(w[0].status, WcStatus::RemAccessErr, "op {i} {op:?}");
            assert_eq!(a.ctx.qp_state(a.qp).unwrap(), QpState::Err);
            assert_eq!(b.ctx.qp_state(b.qp).unwrap(), QpState::Err);
            reconnect(&a, &b);
        }
    }
    for m in &rms {
        b.ctx.dereg_mr(m.lkey).unwrap();
    }
    a.ctx.dereg_mr(lm.lkey).unwrap();
    assert_eq!(bytes(&local), mlocal, "local memory");
    for (k, r) in remote.iter().enumerate() {
        assert_eq!(bytes(r), mremote[k], "remote MR {k}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn random_ops_match_the_model(
        sizes in prop::collection::vec((1usize..=256).prop_map(|w| w * 8), 1..=4),
        seed in any::<u64>(),
        ops in prop::collection::vec(op(), 1..40),
    ) {
        run(sizes, seed, ops);
    }
}
