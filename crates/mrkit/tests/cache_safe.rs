//! The registration cache's safe entry points (issue 20, item 1): which rights each path
//! grants, what keeps the memory alive, and the scatter/gather lists each handle yields.

mod cache_util;
mod providers_util;

use std::sync::{Arc, Weak};

use cache_util::*;
use mrkit::cache::{CacheConfig, RegCache, Registration, Shape};
use mrkit::pool::{MrPool, PoolConfig};
use mrkit::{
    AccessFlags as A, Buffer, DeviceConfig, DeviceWritable, Errno, LocalSlice, QpCap, QueuePair,
    Registered, WcStatus,
};

const RW: A = A::LOCAL_WRITE;

fn explicit() -> CacheConfig {
    CacheConfig {
        monitor: explicit_only(),
        ..CacheConfig::default()
    }
}

fn sges(r: &impl Registered, range: std::ops::Range<u64>) -> mrkit::Result<Vec<LocalSlice>> {
    let mut v = Vec::new();
    r.sges(range, &mut v).map(|()| v)
}

/// Borrowed memory never gets remote rights (nor, through a shared borrow, write rights):
/// the cached registration outlives the borrow.
#[test]
fn borrowed_paths_refuse_rights_a_borrow_cannot_back() {
    let (_ctx, pd) = open();
    let cache = RegCache::new(&pd, explicit()).unwrap();
    let s = String::from("an immutable string");
    let mut v = vec![0u8; 4096];
    for acc in [
        A::REMOTE_WRITE,
        A::REMOTE_READ,
        A::REMOTE_ATOMIC,
        A::MW_BIND,
        RW | A::REMOTE_WRITE,
    ] {
        let e = cache.get_ref(s.as_bytes(), acc).unwrap_err();
        assert_eq!(e.errno(), Errno::EINVAL, "{acc:?}");
        assert!(e.to_string().contains("get_owned"), "{e}");
        let e = cache.get_mut(&mut v, acc).unwrap_err();
        assert_eq!(e.errno(), Errno::EINVAL, "{acc:?}");
        assert!(e.to_string().contains("get_owned"), "{e}");
    }
    // A shared borrow cannot let the device write.
    let e = cache.get_ref(s.as_bytes(), RW).unwrap_err();
    assert_eq!(e.errno(), Errno::EINVAL);
    assert!(e.to_string().contains("get_mut"), "{e}");
    assert!(cache.is_empty(), "nothing registered");
    // Local rights work, and a second lookup is a hit.
    drop(cache.get_ref(s.as_bytes(), A::empty()).unwrap());
    drop(cache.get_mut(&mut v, RW).unwrap());
    drop(cache.get_mut(&mut v, RW).unwrap());
    assert_eq!(cache.stats().misses, 2);
    assert_eq!(cache.stats().hits, 1);
}

/// With remote rights the entry keeps the owner alive after every handle (and the caller's
/// own `Arc`) is gone, so the rkey a peer holds never reaches freed memory; the owner goes
/// only once the entry is deregistered.
#[test]
fn owned_remote_entry_keeps_its_owner_until_deregistered() {
    let (ctx, pd) = open();
    let cache = RegCache::new(&pd, explicit()).unwrap();
    let buf = Arc::new(Buffer::new(16 << 10).unwrap());
    let weak: Weak<Buffer> = Arc::downgrade(&buf);
    let (addr, len) = (buf.addr(), buf.len() as u64);
    let h = cache.get_owned(&buf, 0..len, RW | A::REMOTE_WRITE).unwrap();
    let rkey = h.rkey();
    let mrs = ctx.soft().map(|_| live_mrs(&ctx)); // mrkit0 only (see the end)
    drop(h);
    drop(buf);
    let alive = weak.upgrade().expect("the cached entry keeps the buffer");
    assert_eq!(alive.addr(), addr);
    drop(alive);
    assert!(
        key_valid(&ctx, &pd, rkey, addr),
        "the rkey still translates"
    );
    assert_eq!(cache.invalidate(addr, len), 1);
    assert!(
        weak.upgrade().is_none(),
        "deregistered: the buffer is freed"
    );
    if let Some(mrs) = mrs {
        assert_live_mrs(&ctx, mrs - 1, "the entry's MR deregistered");
    } else {
        assert!(providers_util::needs_native("counts mrkit-soft's live MRs"));
    }
}

/// The same when the cache is dropped with the entry in it, and when the entry is evicted.
#[test]
fn owned_remote_entry_releases_its_owner_on_drop_and_eviction() {
    let (_ctx, pd) = open();
    let cache = RegCache::new(
        &pd,
        CacheConfig {
            max_entries: 1,
            ..explicit()
        },
    )
    .unwrap();
    let a = Arc::new(Buffer::new(4096).unwrap());
    let b = Arc::new(Buffer::new(4096).unwrap());
    drop(cache.get_owned(&a, 0..4096, A::REMOTE_READ).unwrap());
    assert_eq!(Arc::strong_count(&a), 2);
    // Room for one entry: `a`'s (idle) is evicted for `b`'s.
    drop(cache.get_owned(&b, 0..4096, A::REMOTE_READ).unwrap());
    assert_eq!(Arc::strong_count(&a), 1, "evicted: owner released");
    assert_eq!(Arc::strong_count(&b), 2);
    drop(cache);
    assert_eq!(Arc::strong_count(&b), 1, "cache dropped: owner released");
}

/// With local rights only the entry keeps nothing: once the handle is gone the memory is the
/// caller's alone again (it can be written through `Arc::get_mut`) and stays cached.
#[test]
fn owned_local_entry_hands_the_memory_back() {
    let (_ctx, pd) = open();
    let cache = RegCache::new(&pd, explicit()).unwrap();
    let mut buf = Arc::new(Buffer::new(8192).unwrap());
    for round in 0..3u8 {
        Arc::get_mut(&mut buf)
            .expect("no other owner")
            .as_mut_slice()[0] = round;
        let h = cache.get_owned(&buf, 0..8192, RW).unwrap();
        assert_eq!(Arc::strong_count(&buf), 2, "the handle co-owns");
        assert_eq!(h.memory().as_slice()[0], round);
        drop(h);
        assert_eq!(Arc::strong_count(&buf), 1);
    }
    assert_eq!(cache.stats().misses, 1);
    assert_eq!(cache.len(), 1);
}

/// A remote registration never reaches past the owner's bytes (page rounding, the whole
/// allocation shape): a peer with the rkey could otherwise write the neighbours of a heap
/// buffer.
#[test]
fn owned_remote_registration_stays_inside_the_owner() {
    let (_ctx, pd) = open();
    for shape in [
        Shape::PageRounded,
        Shape::WholeAllocation { cap: 1 << 30 },
        Shape::Merge { cap: 1 << 20 },
    ] {
        let cache = shaped_cache(&pd, shape);
        // A heap vector starting and ending inside pages.
        let v: Arc<Vec<u8>> = Arc::new((0..5000).map(|i| i as u8).collect());
        let (start, end) = (v.as_ptr() as u64, v.as_ptr() as u64 + 5000);
        let h = cache.get_owned(&v, 100..4100, A::REMOTE_READ).unwrap();
        let entries = cache.entries();
        assert_eq!(entries.len(), 1);
        let (s, e, _, _) = entries[0];
        assert!(
            start <= s && e <= end,
            "{shape:?}: {s:#x}..{e:#x} outside {start:#x}..{end:#x}"
        );
        let r = h.remote(0..4000).unwrap();
        assert_eq!((r.addr, r.len), (start + 100, 4000));
        drop(h);
        // Local rights may be widened (no peer can reach the extra bytes).
        drop(cache.get_ref(&v[100..4100], A::empty()).unwrap());
    }
}

/// A request with remote rights never merges with a neighbour that has none (nor the other
/// way round): the union would expose the neighbour's bytes to peers.
#[test]
fn remote_rights_merge_only_with_remote_rights() {
    let (_ctx, pd) = open();
    let cache = RegCache::new(
        &pd,
        CacheConfig {
            shape: Shape::Merge { cap: 1 << 20 },
            ..explicit()
        },
    )
    .unwrap();
    let mut buf = Buffer::new(4 * 4096).unwrap();
    let base = buf.addr();
    // Page 0: borrowed, local rights.
    drop(cache.get_mut(&mut buf.as_mut_slice()[..4096], RW).unwrap());
    // Page 1: raw with remote rights, next to it.
    let h = cache.raw(base + 4096, 4096, RW | A::REMOTE_WRITE).unwrap();
    assert_eq!(
        h.range(),
        (base + 4096, base + 8192),
        "not merged with page 0"
    );
    drop(h);
    // Page 2: borrowed again, next to the remote entry: not merged with it either.
    drop(
        cache
            .get_mut(&mut buf.as_mut_slice()[8192..12288], RW)
            .unwrap(),
    );
    let mut e = cache.entries();
    e.sort_by_key(|x| x.0);
    let ranges: Vec<(u64, u64)> = e.iter().map(|x| (x.0, x.1)).collect();
    assert_eq!(
        ranges,
        vec![
            (base, base + 4096),
            (base + 4096, base + 8192),
            (base + 8192, base + 12288)
        ]
    );
    assert!(!e[0].2.intersects(A::REMOTE_WRITE));
    assert!(!e[2].2.intersects(A::REMOTE_WRITE));
    // Remote with remote does merge (raw callers' contract covers the union).
    assert_eq!(cache.invalidate(base + 8192, 4096), 1);
    let h = cache.raw(base + 8192, 4096, A::REMOTE_READ).unwrap();
    assert_eq!(h.range(), (base + 4096, base + 12288));
    assert_eq!(cache.stats().merges, 1);
    drop(h);
    cache.invalidate(base, 4 * 4096);
}

/// Each handle's SGEs run over offsets of its own range and split where the registration
/// does (several MRs above the device's `max_mr_size`); a range outside is EINVAL with the
/// list unchanged.
#[test]
fn handles_yield_sges_over_their_range() {
    let Some(ctx) = providers_util::open_with(
        DeviceConfig::rxe().max_mr_size(64 << 10),
        &[("MRKIT_MAX_MR_SIZE", "65536")],
    ) else {
        return;
    };
    let pd = ctx.alloc_pd().unwrap();
    let cache = RegCache::new(&pd, explicit()).unwrap();
    let mut buf = Buffer::new(256 << 10).unwrap();
    let base = buf.addr();
    {
        let h = cache.get_mut(buf.as_mut_slice(), RW).unwrap();
        assert_eq!(h.len(), 256 << 10);
        let v = sges(&h, (60 << 10)..(70 << 10)).unwrap();
        assert_eq!(v.len(), 2, "split at the 64 KiB piece boundary");
        assert_eq!((v[0].addr, v[0].len), (base + (60 << 10), 4 << 10));
        assert_eq!((v[1].addr, v[1].len), (base + (64 << 10), 6 << 10));
        assert_ne!(v[0].lkey, v[1].lkey);
        for s in &v {
            assert_translates_key(&ctx, &pd, s.lkey, s.addr, u64::from(s.len));
        }
        let mut out = vec![LocalSlice {
            addr: 1,
            len: 1,
            lkey: 1,
        }];
        let e = h.sges((250 << 10)..(257 << 10), &mut out).unwrap_err();
        assert_eq!(e.errno(), Errno::EINVAL);
        #[allow(clippy::reversed_empty_ranges)]
        let e = h.sges(10..5, &mut out).unwrap_err();
        assert_eq!(e.errno(), Errno::EINVAL);
        assert_eq!(out.len(), 1, "unchanged on error");
        assert!(sges(&h, 7..7).unwrap().is_empty());
    }
    // A sub-slice: offsets start at the slice.
    let h = cache
        .get_ref(&buf.as_slice()[5000..9000], A::empty())
        .unwrap();
    assert_eq!(
        sges(&h, 0..4000).unwrap(),
        vec![LocalSlice {
            addr: base + 5000,
            len: 4000,
            lkey: h.lkey()
        }]
    );
    drop(h);
    // Owned, over a range of the owner.
    let owned = Arc::new(Buffer::new(128 << 10).unwrap());
    let h = cache.get_owned(&owned, (8 << 10)..(72 << 10), RW).unwrap();
    let v = sges(&h, 0..(64 << 10)).unwrap();
    assert_eq!(v.iter().map(|s| u64::from(s.len)).sum::<u64>(), 64 << 10);
    assert_eq!(v[0].addr, owned.addr() + (8 << 10));
    // Raw: offsets from the registration's start.
    let r = cache.raw(base + 100, 10, RW).unwrap();
    let (s, e) = r.range();
    assert_eq!(Registered::len(&r), e - s);
    assert_eq!(sges(&r, 100..110).unwrap()[0].addr, s + 100);
}

/// The pieces of a bounce buffer, as SGEs over its slots.
#[test]
fn bounce_buffer_yields_sges_over_its_slots() {
    let Some(ctx) = providers_util::open_with_max_mr(3) else {
        return;
    };
    let pd = ctx.alloc_pd().unwrap();
    let pool = MrPool::new(
        &pd,
        PoolConfig {
            chunk_size: 64 << 10,
            max_chunks: 1,
            thp: false,
            ..PoolConfig::default()
        },
    )
    .unwrap();
    let cache = RegCache::new(
        &pd,
        CacheConfig {
            bounce: Some(pool),
            ..explicit()
        },
    )
    .unwrap();
    let m = Map::new(64 << 10);
    let a = cache.raw(m.addr, 4096, RW).unwrap();
    let b = cache.raw(m.addr + 8192, 4096, RW).unwrap();
    let Registration::Bounce(bb) = cache.raw_or_bounce(m.addr + 16384, 6000, RW).unwrap() else {
        panic!("expected a bounce buffer");
    };
    let all = sges(&bb, 0..6000).unwrap();
    assert_eq!(
        all.iter().map(|s| s.len).collect::<Vec<_>>(),
        vec![4096, 1904]
    );
    let mid = sges(&bb, 4000..4200).unwrap();
    assert_eq!(mid.len(), 2);
    assert_eq!((mid[0].addr, mid[0].len), (all[0].addr + 4000, 96));
    assert_eq!((mid[1].addr, mid[1].len), (all[1].addr, 104));
    assert_eq!(sges(&bb, 0..6001).unwrap_err().errno(), Errno::EINVAL);
    let reg = Registration::Bounce(bb);
    assert_eq!(Registered::len(&reg), 6000);
    fn writable(_: &impl DeviceWritable) {}
    writable(&reg);
    drop((a, b));
}

/// Data moves through a cached owned registration with the safe `QueuePair`: a loopback
/// RDMA WRITE into it and an RDMA READ back out of it, by its rkey.
#[test]
fn owned_entry_is_a_loopback_rdma_target() {
    let (_ctx, pd) = open();
    let cache = RegCache::new(&pd, explicit()).unwrap();
    let io = Arc::new(Buffer::new(8192).unwrap());
    let acc = RW | A::REMOTE_WRITE | A::REMOTE_READ;
    let q1 = QueuePair::new(&pd, QpCap::default()).unwrap();
    let q2 = QueuePair::new(&pd, QpCap::default()).unwrap();
    QueuePair::connect(&q1, &q2, acc).unwrap();
    let mut src = pd.register(Buffer::new(4096).unwrap(), RW).unwrap();
    src.as_mut_slice().copy_from_slice(&[0x5a; 4096]);
    let h = cache.get_owned(&io, 0..8192, acc).unwrap();
    let wc = q1
        .write(&src, 0..4096, h.remote(4096..8192).unwrap())
        .unwrap();
    assert_eq!(wc.status, WcStatus::Success);
    drop(h);
    assert!(io.as_slice()[4096..].iter().all(|&b| b == 0x5a));
    assert!(io.as_slice()[..4096].iter().all(|&b| b == 0));
    // A hit, and the bytes come back by RDMA READ.
    let h = cache.get_owned(&io, 4096..8192, A::REMOTE_READ).unwrap();
    let mut dst = pd.register(Buffer::new(4096).unwrap(), RW).unwrap();
    let wc = q1
        .read(&mut dst, 0..4096, h.remote(0..4096).unwrap())
        .unwrap();
    assert_eq!(wc.status, WcStatus::Success);
    assert!(dst.as_slice().iter().all(|&b| b == 0x5a));
    assert_eq!(cache.stats().misses, 1);
}

/// The entry points of the safe paths keep the address arithmetic of hostile sizes in range:
/// an empty owned range is EINVAL, a range past the owner is EINVAL.
#[test]
fn owned_ranges_are_checked() {
    let (_ctx, pd) = open();
    let cache = RegCache::new(&pd, explicit()).unwrap();
    let b = Arc::new(Buffer::new(4096).unwrap());
    for r in [0..0, 0..4097, 4096..4097, u64::MAX - 1..u64::MAX] {
        let e = cache.get_owned(&b, r.clone(), RW).unwrap_err();
        assert_eq!(e.errno(), Errno::EINVAL, "{r:?}");
    }
    let e = cache.get_ref(&[], A::empty()).unwrap_err();
    assert_eq!(e.errno(), Errno::EINVAL);
    assert!(cache.is_empty());
}

/// The SGEs of a handle over two MRs carry a real work request: an RDMA WRITE whose source is
/// a borrowed handle's bytes across the MR boundary lands whole in the destination. (Posted
/// on the device directly: the safe `QueuePair` takes handles once it is generic over
/// `Registered`.)
#[test]
fn handle_sges_carry_a_work_request_across_mrs() {
    if providers_util::needs_native("posts its work request on mrkit-soft directly") {
        return;
    }
    use mrkit_soft::qp::{rc_connect, send_flags, QpInitAttr, SendWr, WrOpcode};
    use std::time::{Duration, Instant};
    let Some(ctx) = providers_util::open_with(
        DeviceConfig::rxe().max_mr_size(64 << 10),
        &[("MRKIT_MAX_MR_SIZE", "65536")],
    ) else {
        return;
    };
    let pd = ctx.alloc_pd().unwrap();
    let soft = ctx.soft().unwrap().clone();
    let cq = soft.create_cq(16, None).unwrap();
    let qp = || {
        soft.create_qp(QpInitAttr {
            pd: pd.handle(),
            send_cq: cq,
            recv_cq: cq,
            cap: QpCap::default(),
            sq_sig_all: false,
        })
        .unwrap()
        .0
    };
    let (a, b) = (qp(), qp());
    rc_connect(&soft, a, &soft, b, RW | A::REMOTE_WRITE, 3).unwrap();
    let cache = RegCache::new(&pd, explicit()).unwrap();
    let mut src = Buffer::new(128 << 10).unwrap();
    for (i, x) in src.as_mut_slice().iter_mut().enumerate() {
        *x = (i % 253) as u8;
    }
    let dst = pd
        .register(Buffer::new(16 << 10).unwrap(), RW | A::REMOTE_WRITE)
        .unwrap();
    let h = cache.get_ref(src.as_slice(), A::empty()).unwrap();
    let list = sges(&h, (60 << 10)..(70 << 10)).unwrap();
    assert_eq!(list.len(), 2);
    let r = dst.remote(0..(10 << 10)).unwrap();
    let mut wr = SendWr::new(7, WrOpcode::RdmaWrite)
        .remote(r.addr, r.rkey)
        .flags(send_flags::SIGNALED);
    for s in &list {
        wr = wr.sge(s.addr, s.len, s.lkey);
    }
    soft.post_send(a, &[wr]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut wcs = Vec::new();
    while soft.poll_cq(cq, &mut wcs, 1).unwrap() == 0 {
        assert!(Instant::now() < deadline, "no completion");
        let _ = soft.wait_cq(cq, Duration::from_millis(10));
    }
    assert_eq!((wcs[0].wr_id, wcs[0].status), (7, WcStatus::Success));
    drop(h);
    assert_eq!(
        &dst.as_slice()[..10 << 10],
        &src.as_slice()[60 << 10..70 << 10]
    );
}

/// Handles are values a work request can carry across threads, and owned ones clone.
#[test]
fn handles_are_send_and_owned_handles_clone() {
    fn send<T: Send>(_: &T) {}
    let (_ctx, pd) = open();
    let cache = RegCache::new(&pd, explicit()).unwrap();
    let b = Arc::new(Buffer::new(4096).unwrap());
    let h = cache.get_owned(&b, 0..4096, A::REMOTE_READ).unwrap();
    let h2 = h.clone();
    assert_eq!(h2.rkey(), h.rkey());
    send(&h2);
    std::thread::spawn(move || drop(h2)).join().unwrap();
    assert_eq!(Arc::strong_count(&b), 3, "caller, handle, entry");
}

/// Cache handles post through `QueuePair` like any registered memory (issue 20, item 3): an
/// owned handle moves into a pipelined work request of a `QueuePair<Owned>` and comes back
/// with its completion; a `&mut`-borrowed handle is the READ destination of
/// a queue pair whose type carries the borrow.
#[test]
fn cache_handles_post_through_queue_pairs() {
    use mrkit::Owned;
    use std::time::Duration;
    let (_ctx, pd) = open();
    let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    let q1 = QueuePair::new(&pd, QpCap::default()).unwrap();
    let q2 = QueuePair::new(&pd, QpCap::default()).unwrap();
    QueuePair::connect(&q1, &q2, A::REMOTE_WRITE | A::REMOTE_READ).unwrap();
    let dst = pd
        .register(
            Buffer::new(8192).unwrap(),
            RW | A::REMOTE_WRITE | A::REMOTE_READ,
        )
        .unwrap();

    // An owned cached handle is the source of a pipelined WRITE and comes back.
    let mut io = Buffer::new(4096).unwrap();
    io.as_mut_slice().fill(0x11);
    let io = Arc::new(io);
    let h = cache.get_owned(&io, 0..4096, RW).unwrap();
    let t = q1
        .post_write(h, 0..4096, dst.remote(0..4096).unwrap())
        .unwrap();
    let c = q1.wait_ticket(t, Duration::from_secs(10)).unwrap();
    assert_eq!(c.status(), WcStatus::Success);
    assert!(matches!(c.buf, Owned::Cached(_)));
    drop(c);
    assert!(dst.as_slice()[..4096].iter().all(|&b| b == 0x11));

    // A borrowed handle (`get_mut`) is the destination of a READ on a QP typed by the borrow.
    let mut mine = vec![0u8; 4096];
    {
        let h = cache.get_mut(&mut mine, RW).unwrap();
        let q3: QueuePair<mrkit::cache::RegMut<'_>> =
            QueuePair::new_typed(&pd, QpCap::default()).unwrap();
        let q4 = QueuePair::new(&pd, QpCap::default()).unwrap();
        QueuePair::connect(&q3, &q4, A::REMOTE_READ).unwrap();
        let t = q3
            .post_read(h, 0..4096, dst.remote(0..4096).unwrap())
            .unwrap();
        let c = q3.wait_ticket(t, Duration::from_secs(10)).unwrap();
        assert_eq!(c.status(), WcStatus::Success);
    }
    assert!(mine.iter().all(|&b| b == 0x11));
}
