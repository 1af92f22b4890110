//! MR pool: carving, growth, limits, slicing, slots as registered memory, concurrency, and
//! the seed scenario (16384 x 4 KiB) against per-message registration with data verified.

mod cache_util;
mod providers_util;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Instant;

use cache_util::*;
use mrkit::pool::{MrPool, OwnedSlot, PoolConfig, Slot};
use mrkit::{AccessFlags, Buffer, DeviceWritable, Errno, LocalSlice, Registered};

fn small(max_chunks: usize) -> PoolConfig {
    PoolConfig {
        chunk_size: 64 << 10,
        slot_size: 4096,
        initial_chunks: 1,
        max_chunks,
        thp: false,
        magazine: 8,
        ..PoolConfig::default()
    }
}

#[test]
fn carves_grows_and_fails_at_the_limit() {
    let (ctx, pd) = open();
    let pool = MrPool::new(&pd, small(2)).unwrap();
    assert_eq!(pool.stats().total, 16);
    let mut held = Vec::new();
    let mut seen = HashSet::new();
    for _ in 0..32 {
        let s = pool.alloc().unwrap();
        assert!(seen.insert(s.index()), "slot handed out twice");
        assert_eq!(s.addr() % 4096, 0);
        // The slot's keys translate to the slot's bytes on the device.
        assert_translates_key(&ctx, &pd, s.lkey(), s.addr(), 4096);
        let chunks = pool.chunks();
        let (base, lkey, _rkey) = chunks[s.chunk() as usize];
        assert_eq!(s.lkey(), lkey);
        assert_eq!(s.addr(), base + s.offset());
        held.push(s);
    }
    let st = pool.stats();
    assert_eq!(
        (st.total, st.in_use, st.free, st.chunks, st.growth_events),
        (32, 32, 0, 2, 1)
    );
    let e = pool.alloc().unwrap_err();
    assert_eq!(e.errno(), mrkit::Errno::ENOMEM);
    assert_eq!(pool.stats().alloc_failures, 1);
    held.clear();
    let st = pool.stats();
    assert_eq!((st.in_use, st.free), (0, 32));
}

#[test]
fn slices_and_bytes() {
    let (_ctx, pd) = open();
    let pool = MrPool::new(&pd, small(1)).unwrap();
    let mut s = pool.alloc().unwrap();
    s.as_mut_slice().fill(7);
    let l = s.local(100..200).unwrap();
    assert_eq!((l.addr, l.len, l.lkey), (s.addr() + 100, 100, s.lkey()));
    assert_eq!(s.local(0..4096).unwrap(), s.local_all());
    assert_eq!(s.local(4096..4096).unwrap().len, 0);
    assert!(s.as_slice().iter().all(|&b| b == 7));
    let mut o = pool.alloc_owned().unwrap();
    assert_ne!(o.addr(), s.addr());
    o.as_mut_slice().fill(9);
    let l = o.local(0..10).unwrap();
    assert_eq!((l.addr, l.len, l.lkey), (o.addr(), 10, o.lkey()));
    // Outside the slot, reversed, or overflowing: EINVAL on both kinds, never a panic.
    #[allow(clippy::reversed_empty_ranges)]
    for r in [
        0..4097,
        4096..4097,
        10..5,
        u64::MAX - 1..u64::MAX,
        1..u64::MAX,
    ] {
        assert_eq!(
            s.local(r.clone()).unwrap_err().errno(),
            Errno::EINVAL,
            "{r:?}"
        );
        assert_eq!(
            o.local(r.clone()).unwrap_err().errno(),
            Errno::EINVAL,
            "{r:?}"
        );
        assert_eq!(
            s.remote(r.clone()).unwrap_err().errno(),
            Errno::EINVAL,
            "{r:?}"
        );
        assert_eq!(
            o.remote(r.clone()).unwrap_err().errno(),
            Errno::EINVAL,
            "{r:?}"
        );
    }
    // No remote rights by default: no remote descriptor.
    assert_eq!(s.remote(0..64).unwrap_err().errno(), Errno::EINVAL);
    assert_eq!(o.remote(0..64).unwrap_err().errno(), Errno::EINVAL);
    // Chunk-wide remote rights, when asked for explicitly, give the chunk's rkey.
    let wide = MrPool::new(
        &pd,
        PoolConfig {
            access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
            ..small(1)
        },
    )
    .unwrap();
    let w = wide.alloc().unwrap();
    let r = w.remote(8..16).unwrap();
    assert_eq!(
        (r.addr, r.len, r.rkey),
        (w.addr() + 8, 8, wide.chunks()[0].2)
    );
}

/// Both kinds of slot are registered memory a work request can carry (read or written by the
/// device), alone or in a scatter/gather list.
#[test]
fn slots_are_registered_memory() {
    fn writable<T: DeviceWritable>(_: &T) {}
    fn owned_static<T: DeviceWritable + Send + Sync + 'static>() {}
    owned_static::<OwnedSlot>();
    let (ctx, pd) = open();
    let pool = MrPool::new(&pd, small(1)).unwrap();
    let s: Slot<'_> = pool.alloc().unwrap();
    let o = pool.alloc_owned().unwrap();
    writable(&s);
    writable(&o);
    assert_eq!((Registered::len(&s), Registered::len(&o)), (4096, 4096));
    let mut v = Vec::new();
    s.sges(16..32, &mut v).unwrap();
    o.sges(0..4096, &mut v).unwrap();
    assert_eq!(
        v,
        vec![
            LocalSlice {
                addr: s.addr() + 16,
                len: 16,
                lkey: s.lkey()
            },
            LocalSlice {
                addr: o.addr(),
                len: 4096,
                lkey: o.lkey()
            },
        ]
    );
    for l in &v {
        assert_translates_key(&ctx, &pd, l.lkey, l.addr, u64::from(l.len));
    }
    assert_eq!(s.sges(0..4097, &mut v).unwrap_err().errno(), Errno::EINVAL);
    assert_eq!(v.len(), 2, "a refused range appends nothing");
    // A list of owned slots is one piece of registered memory spanning them.
    let list: Vec<OwnedSlot> = (0..3).map(|_| pool.alloc_owned().unwrap()).collect();
    writable(&list);
    let mut v = Vec::new();
    list.sges(4000..8200, &mut v).unwrap();
    assert_eq!(v.len(), 3);
    assert_eq!((v[0].addr, v[0].len), (list[0].addr() + 4000, 96));
    assert_eq!((v[1].addr, v[1].len), (list[1].addr(), 4096));
    assert_eq!((v[2].addr, v[2].len), (list[2].addr(), 8));
    drop((s, o, list));
    assert_eq!(pool.stats().in_use, 0);
}

#[test]
fn threads_never_share_a_slot() {
    let (_ctx, pd) = open();
    let pool = MrPool::new(&pd, small(4)).unwrap();
    let owner: Vec<AtomicU8> = (0..64).map(|_| AtomicU8::new(0)).collect();
    std::thread::scope(|sc| {
        for t in 1..=4u8 {
            let (pool, owner) = (&pool, &owner);
            sc.spawn(move || {
                let mut mine = Vec::new();
                for i in 0..20_000u32 {
                    if i % 3 != 2 {
                        if let Ok(mut s) = pool.alloc() {
                            let prev = owner[s.index() as usize].swap(t, Ordering::SeqCst);
                            assert_eq!(prev, 0, "slot {} owned twice", s.index());
                            s.as_mut_slice()[0] = t;
                            mine.push(s);
                        }
                    } else if let Some(s) = mine.pop() {
                        assert_eq!(s.as_slice()[0], t);
                        owner[s.index() as usize].store(0, Ordering::SeqCst);
                        drop(s);
                    }
                    if mine.len() > 10 {
                        let s = mine.swap_remove(0);
                        owner[s.index() as usize].store(0, Ordering::SeqCst);
                        // Cross-thread free: hand it to the pool from here anyway.
                        drop(s);
                    }
                }
                for s in mine {
                    owner[s.index() as usize].store(0, Ordering::SeqCst);
                }
            });
        }
    });
    let st = pool.stats();
    assert_eq!(st.in_use, 0, "{st:?}");
    assert_eq!(st.free, st.total);
}

/// The seed's case study: 16384 messages of 4 KiB, one registration per message vs one
/// 64 MiB MR carved into 16384 slots. Every message's bytes are verified through the
/// device's access predicate (the data path's view: key + address -> translated VA).
#[test]
fn seed_scenario_16384_messages_per_message_vs_pool() {
    if providers_util::needs_native("reads slots through mrkit-soft's key check and its counters") {
        return;
    }
    let (ctx, pd) = open();
    const N: usize = 16384;
    const SZ: usize = 4096;
    let soft = ctx.soft().unwrap();
    let check = |key: u32, addr: u64, i: usize| {
        let b = read_through_key(&ctx, &pd, key, addr, SZ as u64);
        assert!(
            b.iter().all(|&x| x == (i % 251) as u8),
            "message {i} corrupted"
        );
    };
    // Per-message registration (the 35 % CPU anti-pattern).
    let mut src = Buffer::new(N * SZ).unwrap();
    let mut per_msg = std::time::Duration::ZERO;
    for i in 0..N {
        let off = i * SZ;
        let t0 = Instant::now();
        src.as_mut_slice()[off..off + SZ].fill((i % 251) as u8);
        let addr = src.addr() + off as u64;
        // SAFETY: `src` outlives the registration, which is dropped at the end of this
        // iteration.
        let mr =
            unsafe { pd.register_raw(addr, SZ as u64, addr, AccessFlags::LOCAL_WRITE) }.unwrap();
        let key = mr.lkey();
        per_msg += t0.elapsed();
        check(key, addr, i); // verification (not timed)
        let t0 = Instant::now();
        drop(mr);
        per_msg += t0.elapsed();
    }
    // Pool: one 64 MiB MR, 16384 slots.
    let pool = MrPool::new(
        &pd,
        PoolConfig {
            chunk_size: 64 << 20,
            max_chunks: 1,
            ..PoolConfig::default()
        },
    )
    .unwrap();
    let regs_before = soft.stats().registrations;
    let mut pooled = std::time::Duration::ZERO;
    let mut posted = Vec::with_capacity(N);
    for i in 0..N {
        let t0 = Instant::now();
        let mut s = pool.alloc().unwrap();
        s.as_mut_slice().fill((i % 251) as u8);
        let sge = s.local_all();
        pooled += t0.elapsed();
        check(sge.lkey, sge.addr, i); // verification (not timed)
        posted.push(s); // held, as a queue pair holds a posted slot until its completion
    }
    let t0 = Instant::now();
    assert_eq!(pool.stats().in_use, N as u64);
    for (i, s) in posted.into_iter().enumerate() {
        assert!(s.as_slice().iter().all(|&x| x == (i % 251) as u8));
    }
    pooled += t0.elapsed();
    assert_eq!(
        soft.stats().registrations,
        regs_before,
        "the pool registered per message"
    );
    assert_eq!(pool.stats().in_use, 0);
    eprintln!(
        "seed scenario: per-message {:?}, pooled {:?} ({:.1}x)",
        per_msg,
        pooled,
        per_msg.as_secs_f64() / pooled.as_secs_f64()
    );
    // Timing is the benchmark's business (`mrkit bench pool-cache`, release build); this
    // test checks data and that the pool registered nothing per message.
}

#[test]
fn pool_counters_are_exported_to_mrkit_stat() {
    let (_ctx, pd) = open();
    let pool = MrPool::new(&pd, small(1)).unwrap();
    let find = |id: u64| {
        let snap = mrkit::stat_export::snapshot();
        snap["sources"]["pool"]["pools"]
            .as_array()
            .expect("pool section registered")
            .iter()
            .find(|p| p["id"] == id)
            .cloned()
    };
    let slot = pool.alloc().unwrap();
    let p = find(pool.id()).expect("live pool listed");
    let s = pool.stats();
    assert_eq!(p["total"], s.total);
    assert_eq!(p["in_use"], 1);
    assert_eq!(p["chunks"], s.chunks);
    assert_eq!(p["slot_size"], pool.slot_size() as u64);
    drop(slot);
    assert_eq!(find(pool.id()).unwrap()["in_use"], 0);
    let id = pool.id();
    drop(pool);
    assert!(find(id).is_none(), "dropped pool still exported");
}
