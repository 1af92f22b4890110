//! Safe queue-pair API: borrow-scoped blocking work requests, completions as values.
mod providers_util;
use mrkit::{AccessFlags as A, Buffer, QpCap, QpState, QueuePair, WcStatus};

/// Bound on every wait (generous: the machine is shared).
const WAIT: std::time::Duration = std::time::Duration::from_secs(60);

#[test]
fn safe_write_read_atomic_and_error_as_value() {
    let c1 = providers_util::open();
    let c2 = providers_util::open();
    let (p1, p2) = (c1.alloc_pd().unwrap(), c2.alloc_pd().unwrap());
    let q1 = QueuePair::new(&p1, QpCap::default()).unwrap();
    let q2 = QueuePair::new(&p2, QpCap::default()).unwrap();
    QueuePair::connect(
        &q1,
        &q2,
        A::REMOTE_WRITE | A::REMOTE_READ | A::REMOTE_ATOMIC,
    )
    .unwrap();
    let mut src = p1
        .register(Buffer::new(8192).unwrap(), A::LOCAL_WRITE)
        .unwrap();
    src.as_mut_slice().fill(0x42);
    let mut dst = p2
        .register(
            Buffer::new(8192).unwrap(),
            A::LOCAL_WRITE | A::REMOTE_WRITE | A::REMOTE_READ | A::REMOTE_ATOMIC,
        )
        .unwrap();
    let remote = dst.remote(0..8192).unwrap();
    let wc = q1.write(&src, 0..8192, remote).unwrap();
    assert_eq!(wc.status, WcStatus::Success);
    assert!(dst.as_slice().iter().all(|&b| b == 0x42));
    dst.as_mut_slice()[100] = 7;
    let wc = q1.read(&mut src, 0..200, remote).unwrap();
    assert_eq!((wc.status, src.as_slice()[100]), (WcStatus::Success, 7));
    let wc = q1
        .fetch_add(&mut src, 0, dst.remote(0..8).unwrap(), 1)
        .unwrap();
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(
        u64::from_ne_bytes(src.as_slice()[..8].try_into().unwrap()),
        0x4242_4242_4242_4242
    );
    // SEND/RECV across threads.
    let mut rbuf = p2
        .register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE)
        .unwrap();
    let t = std::thread::spawn(move || {
        let wc = q2.recv(&mut rbuf, 0..4096).unwrap();
        (wc.status, wc.byte_len, rbuf.as_slice()[0], q2)
    });
    assert_eq!(q1.send(&src, 0..300).unwrap().status, WcStatus::Success);
    let (st, n, b0, _q2) = t.join().unwrap();
    assert_eq!((st, n), (WcStatus::Success, 300));
    assert_eq!(b0, src.as_slice()[0]);
    // A violation is a completion value, and the QP goes to ERR.
    let mut bad = remote;
    bad.rkey ^= 0x100;
    let wc = q1.write(&src, 0..10, bad).unwrap();
    assert_eq!(wc.status, WcStatus::RemAccessErr);
    assert_eq!(q1.state().unwrap(), QpState::Err);
}

/// Pipelined WRs: many WRITEs/READs in flight, each owning its buffer (MRs and pool slots),
/// buffers handed back with their completions.
#[test]
fn pipelined_owned_buffers_come_back_with_completions() {
    use mrkit::pool::{MrPool, PoolConfig};
    use mrkit::qp::Owned;
    let c1 = providers_util::open();
    let c2 = providers_util::open();
    let (p1, p2) = (c1.alloc_pd().unwrap(), c2.alloc_pd().unwrap());
    let q1 = QueuePair::new(&p1, QpCap::default()).unwrap();
    let q2 = QueuePair::new(&p2, QpCap::default()).unwrap();
    QueuePair::connect(&q1, &q2, A::REMOTE_WRITE | A::REMOTE_READ).unwrap();
    let dst = p2
        .register(
            Buffer::new(64 << 10).unwrap(),
            A::LOCAL_WRITE | A::REMOTE_WRITE | A::REMOTE_READ,
        )
        .unwrap();
    let mut tickets = Vec::new();
    for i in 0..8u64 {
        let mut src = p1
            .register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE)
            .unwrap();
        src.as_mut_slice().fill(i as u8 + 1);
        let r = dst.remote(i * 4096..(i + 1) * 4096).unwrap();
        tickets.push(q1.post_write(src, 0..4096, r).unwrap());
    }
    let pool = MrPool::new(
        &p1,
        PoolConfig {
            chunk_size: 1 << 20,
            thp: false,
            ..PoolConfig::default()
        },
    )
    .unwrap();
    for i in 8..12u64 {
        let mut s = pool.alloc_owned().unwrap();
        s.as_mut_slice().fill(i as u8 + 1);
        let r = dst.remote(i * 4096..(i + 1) * 4096).unwrap();
        tickets.push(q1.post_write(s, 0..4096, r).unwrap());
    }
    assert_eq!(q1.in_flight(), 12);
    // A blocking call in the middle still gets its own completion.
    let mut probe = p1
        .register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE)
        .unwrap();
    let wc = q1
        .read(&mut probe, 0..16, dst.remote(0..16).unwrap())
        .unwrap();
    assert_eq!(wc.status, WcStatus::Success);
    let done = q1.wait_all(WAIT).unwrap();
    assert_eq!(done.len(), 12);
    assert_eq!(q1.in_flight(), 0);
    let mut ids: Vec<u64> = done.iter().map(|c| c.wc.wr_id).collect();
    ids.sort();
    let mut want: Vec<u64> = tickets.iter().map(|t| t.wr_id()).collect();
    want.sort();
    assert_eq!(ids, want);
    let mut slots = 0;
    for c in done {
        assert_eq!(c.wc.status, WcStatus::Success);
        match c.buf {
            Owned::Mr(m) => assert_eq!(m.as_slice().len(), 4096),
            Owned::Slot(_) => slots += 1,
            other => panic!("unexpected buffer kind {other:?}"),
        }
    }
    assert_eq!(slots, 4);
    for i in 0..12usize {
        assert!(dst.as_slice()[i * 4096..(i + 1) * 4096]
            .iter()
            .all(|&b| b == i as u8 + 1));
    }
    // A pipelined READ into a pool slot, then a refused post hands the buffer back.
    let s = pool.alloc_owned().unwrap();
    let t = q1
        .post_read(s, 0..4096, dst.remote(4096..8192).unwrap())
        .unwrap();
    let c = q1.wait_all(WAIT).unwrap().pop().unwrap();
    assert_eq!((c.wc.wr_id, c.wc.status), (t.wr_id(), WcStatus::Success));
    let buf = c.buf;
    assert!(buf.as_slice().unwrap().iter().all(|&b| b == 2));
    let refused = q1
        .post_write(buf, 0..8192, dst.remote(0..8192).unwrap())
        .unwrap_err();
    assert_eq!(refused.error.errno(), mrkit::Errno::EINVAL);
    assert!(matches!(refused.buf, Owned::Slot(_)));
}
