//! Least privilege in the MR pool: chunks grant peers nothing by default, and an exposed slot
//! is reachable through its own memory window only, exactly the slot with exactly the rights
//! asked, until the exposure ends. Checked with real RDMA WRITE/READ from a peer device.
mod providers_util;

use mrkit::pool::{MrPool, PoolConfig, Slot};
use mrkit::{
    AccessFlags as A, Buffer, Context, Errno, MemoryRegion, ProtectionDomain, QpCap, QueuePair,
    RemoteSlice, WcStatus,
};

struct Peer {
    pd: ProtectionDomain,
    src: MemoryRegion,
    dst: MemoryRegion,
}

fn peer() -> Peer {
    let ctx = providers_util::open();
    let pd = ctx.alloc_pd().unwrap();
    let mut src = pd
        .register(Buffer::new(8192).unwrap(), A::LOCAL_WRITE)
        .unwrap();
    src.as_mut_slice().fill(0xab);
    let dst = pd
        .register(Buffer::new(8192).unwrap(), A::LOCAL_WRITE)
        .unwrap();
    Peer { pd, src, dst }
}

/// A fresh connected pair (an error completion moves a QP to ERR): (owner side, peer side).
fn pair(owner: &ProtectionDomain, p: &Peer) -> (QueuePair, QueuePair) {
    let a = QueuePair::new(owner, QpCap::default()).unwrap();
    let b = QueuePair::new(&p.pd, QpCap::default()).unwrap();
    QueuePair::connect(&a, &b, A::REMOTE_READ | A::REMOTE_WRITE).unwrap();
    (a, b)
}

/// The peer RDMA WRITEs `len` bytes of 0xab to `to`.
fn peer_write(owner: &ProtectionDomain, p: &Peer, to: RemoteSlice, len: u64) -> WcStatus {
    let (_a, b) = pair(owner, p);
    b.write(&p.src, 0..len, to).unwrap().status
}

/// The peer RDMA READs `len` bytes from `from`.
fn peer_read(owner: &ProtectionDomain, p: &mut Peer, from: RemoteSlice, len: u64) -> WcStatus {
    let (_a, b) = pair(owner, p);
    b.read(&mut p.dst, 0..len, from).unwrap().status
}

fn open() -> (Context, ProtectionDomain) {
    let ctx = providers_util::open();
    let pd = ctx.alloc_pd().unwrap();
    (ctx, pd)
}

fn small(remote: A) -> PoolConfig {
    PoolConfig {
        chunk_size: 64 << 10,
        max_chunks: 1,
        thp: false,
        remote,
        ..PoolConfig::default()
    }
}

/// Two slots next to each other in one chunk: (lower, upper).
fn neighbours(pool: &MrPool) -> (Slot<'_>, Slot<'_>) {
    let mut all: Vec<Slot<'_>> = (0..16).map(|_| pool.alloc().unwrap()).collect();
    all.sort_by_key(|s| s.addr());
    let upper = all.remove(1);
    let lower = all.remove(0);
    assert_eq!(upper.addr(), lower.addr() + 4096);
    (lower, upper)
}

/// Default pools register their chunks with local rights only: a peer that learns a chunk's
/// rkey (or guesses it) reaches nothing. (Before, every chunk had REMOTE_READ | REMOTE_WRITE.)
#[test]
fn default_chunks_grant_peers_nothing() {
    let (_ctx, pd) = open();
    let mut p = peer();
    let pool = MrPool::new(&pd, small(A::empty())).unwrap();
    let (base, _lkey, rkey) = pool.chunks()[0];
    let mut s = pool.alloc().unwrap();
    s.as_mut_slice().fill(0);
    let at = RemoteSlice {
        addr: s.addr(),
        len: 64,
        rkey,
    };
    assert_eq!(peer_write(&pd, &p, at, 64), WcStatus::RemAccessErr);
    assert_eq!(peer_read(&pd, &mut p, at, 64), WcStatus::RemAccessErr);
    assert!(s.as_slice().iter().all(|&b| b == 0), "a peer wrote a slot");
    let whole = RemoteSlice {
        addr: base,
        len: 64 << 10,
        rkey,
    };
    assert_eq!(peer_write(&pd, &p, whole, 64), WcStatus::RemAccessErr);
    // And the slot API gives no remote descriptor for it.
    assert_eq!(s.remote(0..64).unwrap_err().errno(), Errno::EINVAL);
    assert_eq!(s.expose(A::REMOTE_READ).unwrap_err().errno(), Errno::EINVAL);
}

/// An exposed slot's rkey reaches that slot with the rights asked, and nothing else: not the
/// neighbouring slot, not past its end, not with other rights, not after the exposure ends.
#[test]
fn exposure_is_slot_scoped_and_ends() {
    let (_ctx, pd) = open();
    let mut p = peer();
    let pool = MrPool::new(&pd, small(A::REMOTE_READ | A::REMOTE_WRITE)).unwrap();
    let (mut a, mut b) = neighbours(&pool);
    a.as_mut_slice().fill(0);
    b.as_mut_slice().fill(0);
    let r = a.expose(A::REMOTE_WRITE).unwrap();
    assert_eq!((r.addr, r.len), (a.addr(), 4096));
    assert_eq!(pool.stats().exposures, 1);
    // The slot itself: written.
    assert_eq!(peer_write(&pd, &p, r, 4096), WcStatus::Success);
    assert!(a.as_slice().iter().all(|&x| x == 0xab));
    // The neighbour through the same rkey: refused, untouched.
    let next = RemoteSlice {
        addr: b.addr(),
        ..r
    };
    assert_eq!(peer_write(&pd, &p, next, 64), WcStatus::RemAccessErr);
    let before = RemoteSlice {
        addr: a.addr() - 64,
        ..r
    };
    assert_eq!(peer_write(&pd, &p, before, 64), WcStatus::RemAccessErr);
    // Straddling the slot's end: refused as a whole.
    let tail = RemoteSlice {
        addr: a.addr() + 4000,
        ..r
    };
    assert_eq!(peer_write(&pd, &p, tail, 200), WcStatus::RemAccessErr);
    assert!(
        b.as_slice().iter().all(|&x| x == 0),
        "the neighbour was written"
    );
    // Only the rights asked: no READ through a write exposure.
    assert_eq!(peer_read(&pd, &mut p, r, 64), WcStatus::RemAccessErr);
    // The chunk's own rkey grants nothing either.
    let chunk = RemoteSlice {
        rkey: pool.chunks()[0].2,
        ..r
    };
    assert_eq!(peer_write(&pd, &p, chunk, 64), WcStatus::RemAccessErr);
    // A sub-range descriptor carries the exposure's rkey.
    let part = a.remote(64..128).unwrap();
    assert_eq!(
        (part.addr, part.len, part.rkey),
        (a.addr() + 64, 64, r.rkey)
    );
    // The exposure ends: its rkey stops working, the slot keeps its bytes.
    a.as_mut_slice().fill(1);
    a.unexpose();
    assert!(!a.is_exposed());
    assert_eq!(peer_write(&pd, &p, r, 64), WcStatus::RemAccessErr);
    assert!(a.as_slice().iter().all(|&x| x == 1));
    // Re-exposing gives a new rkey; the old one stays dead.
    let r2 = a.expose(A::REMOTE_READ).unwrap();
    assert_ne!(r2.rkey, r.rkey);
    assert_eq!(peer_write(&pd, &p, r, 64), WcStatus::RemAccessErr);
    assert_eq!(peer_read(&pd, &mut p, r2, 4096), WcStatus::Success);
    assert!(p.dst.as_slice()[..4096].iter().all(|&x| x == 1));
    // Freeing an exposed slot ends its exposure before anyone can get the slot again.
    let rb = b.expose(A::REMOTE_WRITE).unwrap();
    let b_addr = b.addr();
    drop(b);
    assert_eq!(peer_write(&pd, &p, rb, 64), WcStatus::RemAccessErr);
    let again: Vec<_> = (0..15).map(|_| pool.alloc().unwrap()).collect();
    let b2 = again
        .iter()
        .find(|s| s.addr() == b_addr)
        .expect("slot reused");
    assert!(b2.as_slice()[..64].iter().all(|&x| x == 0));
}

/// Owned slots expose the same way, and rights beyond the pool's are refused.
#[test]
fn owned_slot_exposure_and_refusals() {
    let (_ctx, pd) = open();
    let p = peer();
    let pool = MrPool::new(&pd, small(A::REMOTE_WRITE)).unwrap();
    let mut o = pool.alloc_owned().unwrap();
    for bad in [A::REMOTE_READ, A::REMOTE_ATOMIC, A::LOCAL_WRITE, A::empty()] {
        assert_eq!(o.expose(bad).unwrap_err().errno(), Errno::EINVAL, "{bad:?}");
    }
    assert!(!o.is_exposed());
    let r = o.expose(A::REMOTE_WRITE).unwrap();
    drop(pool); // the owned slot (and its exposure) keep the pool
    assert_eq!(peer_write(&pd, &p, r, 128), WcStatus::Success);
    assert!(o.as_slice()[..128].iter().all(|&x| x == 0xab));
    drop(o);
    assert_eq!(peer_write(&pd, &p, r, 64), WcStatus::RemAccessErr);
    // Pool creation refuses remote rights it cannot give.
    let bad = PoolConfig {
        remote: A::REMOTE_WRITE | A::LOCAL_WRITE,
        ..small(A::empty())
    };
    assert_eq!(MrPool::new(&pd, bad).unwrap_err().errno(), Errno::EINVAL);
    let no_local = PoolConfig {
        access: A::empty(),
        ..small(A::REMOTE_WRITE)
    };
    assert_eq!(
        MrPool::new(&pd, no_local).unwrap_err().errno(),
        Errno::EINVAL
    );
}
