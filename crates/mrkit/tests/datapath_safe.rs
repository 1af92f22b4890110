//! Safe queue-pair API: borrow-scoped blocking work requests, completions as values.
use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QpState, QueuePair, WcStatus};

#[test]
fn safe_write_read_atomic_and_error_as_value() {
    let c1 = Context::open(mrkit::DeviceConfig::rxe());
    let c2 = Context::open(mrkit::DeviceConfig::rxe());
    let (p1, p2) = (c1.alloc_pd().unwrap(), c2.alloc_pd().unwrap());
    let mut q1 = QueuePair::new(&p1, QpCap::default()).unwrap();
    let mut q2 = QueuePair::new(&p2, QpCap::default()).unwrap();
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
