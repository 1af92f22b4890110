//! One ownership story: owned, borrowed and list buffers through one `QueuePair` API, buffers
//! back with their completions, errors as `std::error::Error`, and a deadline on every wait.
mod providers_util;
use std::time::{Duration, Instant};

use mrkit::qp::{Completion, Owned, WcError};
use mrkit::{
    AccessFlags as A, Buffer, Errno, MemoryRegion, ProtectionDomain, QpCap, QpState, QueuePair,
    Registered, WcStatus,
};

/// Bound on waits that must succeed (generous: the machine is shared).
const WAIT: Duration = Duration::from_secs(60);

fn new_pd() -> ProtectionDomain {
    providers_util::open().alloc_pd().unwrap()
}

fn pair_in<B1: Registered, B2: Registered>(
    pd: &ProtectionDomain,
) -> (QueuePair<B1>, QueuePair<B2>) {
    let q1 = QueuePair::new_typed(pd, QpCap::default()).unwrap();
    let q2 = QueuePair::new_typed(pd, QpCap::default()).unwrap();
    QueuePair::connect(&q1, &q2, A::REMOTE_WRITE | A::REMOTE_READ).unwrap();
    (q1, q2)
}

fn pair<B1: Registered, B2: Registered>() -> (ProtectionDomain, QueuePair<B1>, QueuePair<B2>) {
    let pd = new_pd();
    let (q1, q2) = pair_in(&pd);
    (pd, q1, q2)
}

fn mr(pd: &ProtectionDomain, len: usize, fill: u8) -> MemoryRegion {
    let mut m = pd
        .register(
            Buffer::new(len).unwrap(),
            A::LOCAL_WRITE | A::REMOTE_WRITE | A::REMOTE_READ,
        )
        .unwrap();
    m.as_mut_slice().fill(fill);
    m
}

#[test]
fn borrowed_buffers_post_and_come_back_through_the_completion() {
    let pd = new_pd();
    let src = mr(&pd, 4096, 1);
    let dst = mr(&pd, 4096, 0);
    // The queue pair borrows `src`: it must be declared after it (dropped before it).
    let (q1, q2): (QueuePair<&MemoryRegion>, QueuePair) = pair_in(&pd);
    let t = q1
        .post_write(&src, 0..4096, dst.remote(0..4096).unwrap())
        .unwrap();
    let c = q1.wait(WAIT).unwrap();
    assert_eq!(c.wr_id(), t.wr_id());
    assert!(std::ptr::eq(c.buf, &src), "the borrow itself comes back");
    assert!(dst.as_slice().iter().all(|&b| b == 1));
    drop(q2);

    // Exclusive borrows for READ destinations.
    let remote = mr(&pd, 4096, 9);
    let mut local = mr(&pd, 4096, 0);
    let (q3, _q4): (QueuePair<&mut MemoryRegion>, QueuePair) = pair_in(&pd);
    let _ = q3
        .post_read(&mut local, 0..100, remote.remote(0..100).unwrap())
        .unwrap();
    let c = q3.wait(WAIT).unwrap();
    c.result().unwrap();
    assert_eq!(c.buf.as_slice()[99], 9);
    assert_eq!(c.buf.as_slice()[100], 0, "nothing past the range");
    drop(q3);
    assert_eq!(local.as_slice()[0], 9);
}

#[test]
fn scatter_gather_lists_of_several_pieces() {
    // Gather: three MRs as one WRITE.
    let (pd, q1, _q2): (_, QueuePair<Vec<MemoryRegion>>, QueuePair) = pair();
    let dst = mr(&pd, 3 * 4096, 0);
    let pieces = vec![mr(&pd, 4096, 1), mr(&pd, 4096, 2), mr(&pd, 4096, 3)];
    assert_eq!(Registered::len(&pieces), 3 * 4096);
    // A range across piece boundaries: the tail of piece 0, all of 1, the head of 2.
    let _ = q1
        .post_write(pieces, 4000..8300, dst.remote(0..4300).unwrap())
        .unwrap();
    let c = q1.wait(WAIT).unwrap();
    c.result().unwrap();
    assert_eq!(c.wc.byte_len, 4300);
    assert_eq!(c.buf.len(), 3, "the list comes back whole");
    let d = dst.as_slice();
    assert!(d[..96].iter().all(|&b| b == 1));
    assert!(d[96..96 + 4096].iter().all(|&b| b == 2));
    assert!(d[96 + 4096..4300].iter().all(|&b| b == 3));
    assert!(d[4300..].iter().all(|&b| b == 0));

    // Scatter: one READ into two exclusive borrows, as `Owned::List` in a default QP too.
    let (pd, q3, _q4): (_, QueuePair, QueuePair) = pair();
    let src = mr(&pd, 8192, 0);
    let mut s = src;
    s.as_mut_slice()[..4096].fill(4);
    s.as_mut_slice()[4096..].fill(5);
    let list = Owned::from(vec![
        Owned::from(mr(&pd, 4096, 0)),
        Owned::from(mr(&pd, 4096, 0)),
    ]);
    let _ = q3
        .post_read(list, 0..8192, s.remote(0..8192).unwrap())
        .unwrap();
    let (wc, buf) = q3.wait(WAIT).unwrap().into_result().unwrap();
    assert_eq!(wc.byte_len, 8192);
    let Owned::List(v) = buf else {
        panic!("a list comes back as a list")
    };
    assert!(v[0].as_slice().unwrap().iter().all(|&b| b == 4));
    assert!(v[1].as_slice().unwrap().iter().all(|&b| b == 5));
}

#[test]
fn pipelined_receives_hand_their_buffers_back_in_order() {
    let (pd, q1, q2): (_, QueuePair, QueuePair) = pair();
    let mut tickets = Vec::new();
    for _ in 0..8 {
        tickets.push(q2.post_recv(mr(&pd, 256, 0), 0..256).unwrap());
    }
    let mut tx = mr(&pd, 256, 0);
    for i in 0..8u8 {
        tx.as_mut_slice()[0] = i;
        q1.send(&tx, 0..(i as u64 + 1)).unwrap();
    }
    for (i, t) in tickets.iter().enumerate() {
        let c = q2.wait(WAIT).unwrap();
        assert_eq!(c.wr_id(), t.wr_id(), "receives complete in posting order");
        assert_eq!(c.wc.byte_len as usize, i + 1);
        assert_eq!(c.buf.as_slice().unwrap()[0], i as u8);
    }
    assert_eq!(q2.in_flight(), 0);
}

#[test]
fn errors_are_std_errors_and_keep_the_buffer() {
    let (pd, q1, _q2): (_, QueuePair, QueuePair) = pair();
    let dst = mr(&pd, 4096, 0);
    // A range outside the buffer: refused, buffer back, `?`-able into Box<dyn Error>.
    let post = || -> Result<(), Box<dyn std::error::Error>> {
        let _ = q1.post_write(mr(&pd, 64, 0), 0..65, dst.remote(0..65).unwrap())?;
        Ok(())
    };
    let e = post().unwrap_err();
    assert!(e.to_string().contains("EINVAL"), "{e}");
    assert!(e.source().is_some());
    // Longer than the remote slice: refused before the wire.
    let refused = q1
        .post_write(mr(&pd, 4096, 0), 0..4096, dst.remote(0..100).unwrap())
        .unwrap_err();
    assert_eq!(refused.error.errno(), Errno::EINVAL);
    assert!(matches!(refused.buf, Owned::Mr(_)));
    // An error completion: an error value with the buffer.
    let mut bad = dst.remote(0..64).unwrap();
    bad.rkey ^= 0x100;
    let _ = q1.post_write(mr(&pd, 64, 0), 0..64, bad).unwrap();
    let c: Completion<Owned> = q1.wait(WAIT).unwrap();
    let e = c.result().unwrap_err();
    assert_eq!(e.wc.status, WcStatus::RemAccessErr);
    assert!(e.to_string().contains("REM_ACCESS_ERR"), "{e}");
    let boxed: Box<dyn std::error::Error> = Box::new(c.into_result().unwrap_err());
    assert!(boxed.to_string().contains("REM_ACCESS_ERR"));
    assert!(WcError::check(q1.write(&dst, 0..8, dst.remote(0..8).unwrap()).unwrap()).is_err());
}

#[test]
fn waits_time_out_and_the_buffers_stay_with_the_queue_pair() {
    let (pd, q1, q2): (_, QueuePair, QueuePair) = pair();
    let t = q2.post_recv(mr(&pd, 64, 0), 0..64).unwrap();
    let t0 = Instant::now();
    let e = q2.wait(Duration::from_millis(50)).unwrap_err();
    assert_eq!(e.errno(), Errno::ETIMEDOUT);
    assert!(t0.elapsed() >= Duration::from_millis(50));
    let e = q2.wait_all(Duration::from_millis(20)).unwrap_err();
    assert_eq!(e.errno(), Errno::ETIMEDOUT);
    assert_eq!(q2.in_flight(), 1, "the receive buffer is still held");
    // The message arrives later: the buffer comes back with it.
    let tx = mr(&pd, 64, 0x77);
    q1.send(&tx, 0..64).unwrap();
    let c = q2.wait(WAIT).unwrap();
    assert_eq!(c.wr_id(), t.wr_id());
    assert!(c.buf.as_slice().unwrap().iter().all(|&b| b == 0x77));
    // Nothing in flight: no wait at all.
    assert_eq!(q2.wait(WAIT).unwrap_err().errno(), Errno::ENOENT);
}

#[test]
fn a_blocking_call_that_times_out_flushes_its_work_request_first() {
    let (pd, q1, mut q2): (_, QueuePair, QueuePair) = pair();
    q2.set_timeout(Some(Duration::from_millis(50)));
    let mut rx = mr(&pd, 64, 0);
    let e = q2.recv(&mut rx, 0..64).unwrap_err();
    assert_eq!(e.errno(), Errno::ETIMEDOUT);
    // The receive was flushed before `recv` returned (the QP is in ERR), so the borrow of
    // `rx` really ended: a SEND now cannot land in it.
    assert_eq!(q2.state().unwrap(), QpState::Err);
    rx.as_mut_slice().fill(0x11);
    let tx = mr(&pd, 64, 0x22);
    let _ = q1.send(&tx, 0..64);
    assert!(rx.as_slice().iter().all(|&b| b == 0x11));
}

#[test]
fn a_shared_queue_pair_serves_blocking_calls_from_several_threads() {
    let (pd, q1, _q2): (_, QueuePair, QueuePair) = pair();
    let q1 = std::sync::Arc::new(q1);
    let dst = std::sync::Arc::new(mr(&pd, 8 * 4096, 0));
    let threads: Vec<_> = (0..4u64)
        .map(|i| {
            let (q1, dst, pd) = (q1.clone(), dst.clone(), pd.clone());
            std::thread::spawn(move || {
                let src = mr(&pd, 4096, i as u8 + 1);
                for k in 0..20u64 {
                    let at = ((i * 2 + k % 2) * 4096)..((i * 2 + k % 2 + 1) * 4096);
                    let wc = q1.write(&src, 0..4096, dst.remote(at).unwrap()).unwrap();
                    assert_eq!(wc.status, WcStatus::Success);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    for i in 0..8usize {
        let want = (i / 2) as u8 + 1;
        assert!(dst.as_slice()[i * 4096..(i + 1) * 4096]
            .iter()
            .all(|&b| b == want));
    }
}

/// Deadlines are overflow-safe: a timeout too far away to add to the clock means "forever".
#[test]
fn huge_timeouts_mean_no_deadline() {
    let (pd, mut q1, _q2): (_, QueuePair, QueuePair) = pair();
    q1.set_timeout(Some(Duration::MAX));
    let (src, dst) = (mr(&pd, 64, 1), mr(&pd, 64, 0));
    let wc = q1.write(&src, 0..64, dst.remote(0..64).unwrap()).unwrap();
    assert_eq!(wc.status, WcStatus::Success);
    let _ = q1
        .post_write(mr(&pd, 64, 2), 0..64, dst.remote(0..64).unwrap())
        .unwrap();
    q1.wait(Duration::MAX).unwrap().into_result().unwrap();
    assert!(q1.wait_all(Duration::MAX).unwrap().is_empty());
}
