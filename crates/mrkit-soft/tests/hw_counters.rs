//! The port counters (`mrkit_soft::counters`) move by the right amounts: an RNR NAK and its
//! retry, a remote access error, and retransmission timeouts answered by duplicates. The
//! counters are per process, so this binary holds one test that runs the cases in turn.
mod common;

use std::time::{Duration, Instant};

use common::{all, pair_with, reg, Host};
use mrkit_soft::counters::{self as hw, Hw};
use mrkit_soft::cq::{Wc, WcStatus};
use mrkit_soft::driver::loopback::drive_until_idle;
use mrkit_soft::qp::{SendWr, WrOpcode};
use mrkit_soft::wire::{wire_len, Opcode};

fn poll_one(h: &Host, other: &Host) -> Wc {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut v = Vec::new();
    loop {
        drive_until_idle(&[&h.ctx, &other.ctx]);
        if h.ctx.poll_cq(h.cq, &mut v, 1).unwrap() == 1 {
            return v[0];
        }
        assert!(Instant::now() < deadline, "no completion");
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Counter deltas since `base`.
fn delta<'a>(base: &'a [(&'static str, u64)]) -> impl Fn(Hw) -> u64 + 'a {
    move |c| hw::get(c) - base[c as usize].1
}

#[test]
fn counters_move_by_the_right_amounts() {
    // 1. A SEND before the receive is posted: one RNR NAK, then the retry succeeds.
    let (a, b) = pair_with(true, all());
    let mut src = vec![7u8; 100];
    let mut dst = vec![0u8; 100];
    // SAFETY: the buffers outlive every work request over them; no other peer knows the keys.
    let (ma, mb) = (unsafe { reg(&a, &mut src) }, unsafe { reg(&b, &mut dst) });
    let base = hw::snapshot();
    let d = delta(&base);
    a.ctx
        .post_send(
            a.qp,
            &[SendWr::new(1, WrOpcode::Send).sge(ma.iova, 100, ma.lkey)],
        )
        .unwrap();
    drive_until_idle(&[&a.ctx, &b.ctx]); // SEND, RNR NAK
    b.ctx
        .post_recv(b.qp, &[common::recv_wr(2, &mb, 0, 100)])
        .unwrap();
    let wc = poll_one(&a, &b);
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(poll_one(&b, &a).status, WcStatus::Success);
    // The sender retries after the RNR timer the NAK names (10 µs here); if the receive is
    // posted later than that on a loaded machine, the retry meets another RNR NAK. Whatever
    // their number `n`, every counter must agree with it exactly.
    let n = d(Hw::SendRnrErr);
    assert!(
        n >= 1,
        "the first SEND met no receive: one RNR NAK at least"
    );
    assert_eq!(d(Hw::RcvdRnrErr), n);
    assert_eq!(d(Hw::RnrNakRetryErr), n);
    assert_eq!(d(Hw::RetryRnrExceededErr), 0);
    assert_eq!(d(Hw::RdmaSends), 1);
    assert_eq!(d(Hw::RdmaRecvs), 1);
    // n SENDs met by n RNR NAKs, then the SEND and its ACK: 2n + 2 packets each way of the
    // loopback link.
    assert_eq!(d(Hw::SentPkts), 2 * n + 2);
    assert_eq!(d(Hw::PortXmitPackets), 2 * n + 2);
    assert_eq!(d(Hw::RcvdPkts), 2 * n + 2);
    assert_eq!(d(Hw::PortRcvPackets), 2 * n + 2);
    let bytes =
        (n + 1) as usize * (wire_len(Opcode::SendOnly, 100) + wire_len(Opcode::Acknowledge, 0));
    assert_eq!(d(Hw::PortXmitData), bytes as u64 / 4, "in 4-byte words");
    assert_eq!(d(Hw::PortRcvData), bytes as u64 / 4);
    assert_eq!(d(Hw::LocalAckTimeoutErr), 0);
    assert_eq!(d(Hw::CompleterRetryErr), 0);

    // 2. A WRITE with a wrong rkey: the responder NAKs a remote access error.
    let base = hw::snapshot();
    let d = delta(&base);
    let wr = SendWr::new(3, WrOpcode::RdmaWrite)
        .sge(ma.iova, 8, ma.lkey)
        .remote(mb.iova, mb.rkey ^ 0x100);
    a.ctx.post_send(a.qp, &[wr]).unwrap();
    assert_eq!(poll_one(&a, &b).status, WcStatus::RemAccessErr);
    assert_eq!(d(Hw::RespRemoteAccessErrors), 1);
    assert_eq!(d(Hw::ReqRemoteAccessErrors), 1);
    assert_eq!(d(Hw::SentPkts), 2, "the WRITE and its NAK");
    drop((a, b));

    // 3. Retransmissions: the responder is not driven while the requester's retransmission
    // timer expires; every retry then reaches it as a duplicate.
    let (a, b) = pair_with(true, all());
    let mut src = vec![1u8; 64];
    let mut dst = vec![0u8; 64];
    // SAFETY: as above.
    let (ma, mb) = (unsafe { reg(&a, &mut src) }, unsafe { reg(&b, &mut dst) });
    let base = hw::snapshot();
    let d = delta(&base);
    let wr = SendWr::new(4, WrOpcode::RdmaWrite)
        .sge(ma.iova, 64, ma.lkey)
        .remote(mb.iova, mb.rkey)
        .flags(mrkit_soft::qp::send_flags::SIGNALED);
    a.ctx.post_send(a.qp, &[wr]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while d(Hw::LocalAckTimeoutErr) < 2 {
        a.ctx.progress_once(Instant::now());
        assert!(
            Instant::now() < deadline,
            "the retransmission timer never fired"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let timeouts = d(Hw::LocalAckTimeoutErr);
    assert_eq!(poll_one(&a, &b).status, WcStatus::Success);
    assert_eq!(dst, src);
    assert_eq!(
        d(Hw::LocalAckTimeoutErr),
        timeouts,
        "no timeout once answered"
    );
    assert_eq!(
        d(Hw::CompleterRetryErr),
        timeouts,
        "one go-back-N per timeout"
    );
    assert_eq!(
        d(Hw::DuplicateRequest),
        timeouts,
        "each retry arrives as a duplicate"
    );
    assert_eq!(d(Hw::OutOfSequence), 0);
    assert_eq!(d(Hw::RetryExceededErr), 0);
    // The WRITE and its retries one way; ACKs the other way (the responder coalesces the
    // ACKs of the copies it takes in one run).
    let writes = 1 + timeouts;
    let acks = d(Hw::SentPkts) - writes;
    assert!(
        (1..=writes).contains(&acks),
        "{acks} ACKs for {writes} WRITEs"
    );
    let bytes = writes * wire_len(Opcode::RdmaWriteOnly, 64) as u64
        + acks * wire_len(Opcode::Acknowledge, 0) as u64;
    assert_eq!(d(Hw::PortXmitData), bytes / 4);
    assert_eq!(d(Hw::RcvdPkts), d(Hw::SentPkts));
}
