//! Owned slots without a per-slot reference count: the pool's memory outlives every handle
//! until the last owned slot returns, wherever it returns, and is freed then (counted as live
//! chunk MRs on a device of the test's own).

mod cache_util;
mod providers_util;

use std::sync::mpsc;
use std::sync::Barrier;

use cache_util::assert_live_mrs;
use mrkit::pool::{MrPool, OwnedSlot, PoolConfig};

fn cfg() -> PoolConfig {
    PoolConfig {
        chunk_size: 64 << 10,
        initial_chunks: 2,
        max_chunks: 2,
        thp: false,
        magazine: 8,
        ..PoolConfig::default()
    }
}

fn listed(id: u64) -> bool {
    mrkit::stat_export::snapshot()["sources"]["pool"]["pools"]
        .as_array()
        .is_some_and(|a| a.iter().any(|p| p["id"] == id))
}

/// The handle goes first, the slots live on three other threads and return one thread at a
/// time: the chunks stay registered (and the slots usable) until the very last slot.
#[test]
fn handle_dropped_first_memory_goes_with_the_last_slot() {
    let ctx = providers_util::open();
    let pd = ctx.alloc_pd().unwrap();
    let pool = MrPool::new(&pd, cfg()).unwrap();
    let id = pool.id();
    assert_live_mrs(&ctx, 2, "live MRs");
    // 24 slots over both chunks, 8 per thread.
    let mut slots: Vec<OwnedSlot> = (0..24).map(|_| pool.alloc_owned().unwrap()).collect();
    assert!(slots.iter().any(|s| s.chunk() == 1));
    drop(pool);
    assert_live_mrs(&ctx, 2, "pool memory freed while owned slots live");
    assert!(listed(id));
    let mut go = Vec::new();
    let mut joins = Vec::new();
    let (ack_tx, ack) = mpsc::channel::<()>();
    for t in 0..3u8 {
        let mine: Vec<OwnedSlot> = slots.drain(..8).collect();
        let (tx, rx) = mpsc::channel::<usize>();
        go.push(tx);
        let ack_tx = ack_tx.clone();
        joins.push(std::thread::spawn(move || {
            let mut mine = mine;
            for s in &mut mine {
                s.as_mut_slice().fill(t + 1);
            }
            // Drop `n` slots per message, checking the bytes of what is still held.
            for n in rx {
                for s in &mine {
                    assert!(s.as_slice().iter().all(|&b| b == t + 1));
                }
                for s in mine.drain(..n.min(mine.len())) {
                    drop(s);
                }
                ack_tx.send(()).unwrap();
                if mine.is_empty() {
                    break;
                }
            }
        }));
    }
    let (t0, t1, t2) = (joins.remove(0), joins.remove(0), joins.remove(0));
    go[0].send(8).unwrap();
    t0.join().unwrap();
    assert_live_mrs(&ctx, 2, "live MRs");
    go[1].send(8).unwrap();
    t1.join().unwrap();
    assert_live_mrs(&ctx, 2, "live MRs");
    go[2].send(7).unwrap();
    // One slot left on thread 2 (which still checks its bytes when told to go on).
    for _ in 0..3 {
        ack.recv().unwrap();
    }
    assert_live_mrs(&ctx, 2, "freed with one slot still live");
    go[2].send(1).unwrap();
    t2.join().unwrap();
    assert_live_mrs(&ctx, 0, "the last slot did not free the pool's memory");
    assert!(!listed(id), "freed pool still exported");
}

/// The race the protocol exists for: the last handle is dropped at the same moment as the
/// last slots are freed on other threads. Every round, the memory goes exactly once (no slot
/// is used after it, the device ends with no MR left) and never before the last slot.
#[test]
fn closing_races_the_last_frees() {
    let ctx = providers_util::open();
    let pd = ctx.alloc_pd().unwrap();
    for round in 0..100 {
        let pool = MrPool::new(&pd, cfg()).unwrap();
        let slots: Vec<Vec<OwnedSlot>> = (0..4)
            .map(|_| (0..6).map(|_| pool.alloc_owned().unwrap()).collect())
            .collect();
        let start = Barrier::new(5);
        std::thread::scope(|sc| {
            for (t, mut mine) in slots.into_iter().enumerate() {
                let start = &start;
                sc.spawn(move || {
                    start.wait();
                    for s in mine.iter_mut() {
                        s.as_mut_slice()[..64].fill(t as u8);
                    }
                    for s in mine {
                        assert_eq!(s.as_slice()[0], t as u8);
                        drop(s);
                    }
                });
            }
            start.wait();
            drop(pool);
        });
        assert_live_mrs(&ctx, 0, &format!("round {round}: pool memory not freed"));
    }
}

/// Allocated here, freed there (the producer/consumer shape): the counts stay exact.
#[test]
fn cross_thread_frees_are_counted() {
    let ctx = providers_util::open();
    let pd = ctx.alloc_pd().unwrap();
    let pool = MrPool::new(&pd, cfg()).unwrap();
    // At most 12 slots in the channel and the two threads' hands, 8 in the consumer's
    // magazine: the 32 slots always suffice.
    let (tx, rx) = mpsc::sync_channel::<Vec<OwnedSlot>>(1);
    let consumer = std::thread::spawn(move || {
        let mut n = 0;
        for v in rx {
            n += v.len();
        }
        n
    });
    for _ in 0..2000 {
        let v: Vec<OwnedSlot> = (0..4).map(|_| pool.alloc_owned().unwrap()).collect();
        tx.send(v).unwrap();
    }
    drop(tx);
    assert_eq!(consumer.join().unwrap(), 8000);
    let st = pool.stats();
    assert_eq!((st.in_use, st.free, st.total), (0, 32, 32), "{st:?}");
    // Every slot is still handed out once.
    let all: Vec<_> = (0..32).map(|_| pool.alloc().unwrap()).collect();
    let mut idx: Vec<u32> = all.iter().map(|s| s.index()).collect();
    idx.sort_unstable();
    idx.dedup();
    assert_eq!(idx.len(), 32);
    assert!(pool.alloc().is_err());
}
