//! Basic data movement between two device instances on the loopback link.
mod common;

use std::time::{Duration, Instant};

use common::{all, pair_with, reg, Host};
use mrkit_soft::cq::{Wc, WcOpcode, WcStatus};
use mrkit_soft::driver::loopback::drive_until_idle;
use mrkit_soft::qp::{send_flags, QpState, RecvWr, SendWr, Sge, WrOpcode};

fn poll_one(h: &Host, other: &Host, manual: bool) -> Wc {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut v = Vec::new();
    loop {
        if manual {
            drive_until_idle(&[&h.ctx, &other.ctx]);
        }
        if h.ctx.poll_cq(h.cq, &mut v, 1).unwrap() == 1 {
            return v[0];
        }
        assert!(Instant::now() < deadline, "no completion");
        if !manual {
            h.ctx.wait_cq(h.cq, Duration::from_millis(10)).unwrap();
        }
    }
}

fn run(manual: bool) {
    let (a, b) = pair_with(manual, all());
    let mut src: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
    let mut dst = vec![0u8; 20_000];
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let (ma, mb) = (unsafe { reg(&a, &mut src) }, unsafe { reg(&b, &mut dst) });
    // WRITE 20000 bytes (20 packets at MTU 1024), two SGEs.
    let wr = SendWr::new(1, WrOpcode::RdmaWrite)
        .sge(ma.iova, 7000, ma.lkey)
        .sge(ma.iova + 7000, 13_000, ma.lkey)
        .remote(mb.iova, mb.rkey);
    a.ctx.post_send(a.qp, &[wr]).unwrap();
    let wc = poll_one(&a, &b, manual);
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
        (1, WcStatus::Success, WcOpcode::RdmaWrite, 20_000)
    );
    assert_eq!(src, dst);
    // READ back into a fresh buffer.
    let mut back = vec![0u8; 20_000];
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let mc = unsafe { reg(&a, &mut back) };
    let wr = SendWr::new(2, WrOpcode::RdmaRead)
        .sge(mc.iova, 20_000, mc.lkey)
        .remote(mb.iova, mb.rkey);
    a.ctx.post_send(a.qp, &[wr]).unwrap();
    let wc = poll_one(&a, &b, manual);
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (2, WcStatus::Success, WcOpcode::RdmaRead)
    );
    assert_eq!(back, src);
    // Atomics on dst[0..8].
    let mut res = [0u8; 8];
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let mr_res = unsafe { reg(&a, &mut res) };
    let before = u64::from_ne_bytes(dst[..8].try_into().unwrap());
    let mut wr = SendWr::new(3, WrOpcode::AtomicFetchAndAdd)
        .sge(mr_res.iova, 8, mr_res.lkey)
        .remote(mb.iova, mb.rkey);
    wr.compare_add = 5;
    a.ctx.post_send(a.qp, &[wr]).unwrap();
    assert_eq!(poll_one(&a, &b, manual).status, WcStatus::Success);
    assert_eq!(u64::from_ne_bytes(res), before);
    assert_eq!(u64::from_ne_bytes(dst[..8].try_into().unwrap()), before + 5);
    let mut wr = SendWr::new(4, WrOpcode::AtomicCmpAndSwp)
        .sge(mr_res.iova, 8, mr_res.lkey)
        .remote(mb.iova, mb.rkey);
    wr.compare_add = before + 5;
    wr.swap = 42;
    a.ctx.post_send(a.qp, &[wr]).unwrap();
    assert_eq!(poll_one(&a, &b, manual).opcode, WcOpcode::CompSwap);
    assert_eq!(u64::from_ne_bytes(dst[..8].try_into().unwrap()), 42);
    // SEND with immediate into a two-SGE receive; inline SEND.
    let mut rbuf = vec![0u8; 3000];
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let mr = unsafe { reg(&b, &mut rbuf) };
    b.ctx
        .post_recv(
            b.qp,
            &[RecvWr {
                wr_id: 10,
                sg_list: vec![
                    Sge {
                        addr: mr.iova,
                        length: 1000,
                        lkey: mr.lkey,
                    },
                    Sge {
                        addr: mr.iova + 1000,
                        length: 2000,
                        lkey: mr.lkey,
                    },
                ],
            }],
        )
        .unwrap();
    let wr = SendWr::new(5, WrOpcode::SendWithImm)
        .sge(ma.iova, 2500, ma.lkey)
        .imm(0xdead_beef);
    a.ctx.post_send(a.qp, &[wr]).unwrap();
    assert_eq!(poll_one(&a, &b, manual).status, WcStatus::Success);
    let rwc = poll_one(&b, &a, manual);
    assert_eq!(
        (
            rwc.wr_id,
            rwc.status,
            rwc.opcode,
            rwc.byte_len,
            rwc.imm_data
        ),
        (10, WcStatus::Success, WcOpcode::Recv, 2500, 0xdead_beef)
    );
    assert_eq!(&rbuf[..2500], &src[..2500]);
    b.ctx
        .post_recv(
            b.qp,
            &[RecvWr {
                wr_id: 11,
                sg_list: vec![Sge {
                    addr: mr.iova,
                    length: 100,
                    lkey: mr.lkey,
                }],
            }],
        )
        .unwrap();
    let mut wr = SendWr::new(6, WrOpcode::Send).flags(send_flags::INLINE | send_flags::SIGNALED);
    wr.inline_data = b"inline hello".to_vec();
    a.ctx.post_send(a.qp, &[wr]).unwrap();
    assert_eq!(poll_one(&a, &b, manual).wr_id, 6);
    assert_eq!(poll_one(&b, &a, manual).byte_len, 12);
    assert_eq!(&rbuf[..12], b"inline hello");
    // WRITE_WITH_IMM consumes a receive and reports the RETH length.
    b.ctx
        .post_recv(
            b.qp,
            &[RecvWr {
                wr_id: 12,
                sg_list: vec![],
            }],
        )
        .unwrap();
    let wr = SendWr::new(7, WrOpcode::RdmaWriteWithImm)
        .sge(ma.iova, 4096, ma.lkey)
        .remote(mb.iova, mb.rkey)
        .imm(9);
    a.ctx.post_send(a.qp, &[wr]).unwrap();
    assert_eq!(poll_one(&a, &b, manual).status, WcStatus::Success);
    let rwc = poll_one(&b, &a, manual);
    assert_eq!(
        (rwc.opcode, rwc.byte_len, rwc.imm_data),
        (WcOpcode::RecvRdmaWithImm, 4096, 9)
    );
    assert_eq!(a.ctx.qp_state(a.qp).unwrap(), QpState::Rts);
    assert_eq!(b.ctx.qp_state(b.qp).unwrap(), QpState::Rts);
    // Unsignaled WRITE then a signaled one: one completion.
    let w1 = SendWr::new(8, WrOpcode::RdmaWrite)
        .sge(ma.iova, 64, ma.lkey)
        .remote(mb.iova, mb.rkey)
        .flags(0);
    let w2 = SendWr::new(9, WrOpcode::RdmaWrite)
        .sge(ma.iova, 64, ma.lkey)
        .remote(mb.iova, mb.rkey);
    a.ctx.post_send(a.qp, &[w1, w2]).unwrap();
    assert_eq!(poll_one(&a, &b, manual).wr_id, 9);
}

#[test]
fn datapath_manual_progress() {
    run(true);
}

#[test]
fn datapath_progress_thread() {
    run(false);
}

#[test]
fn rnr_then_success() {
    let (a, b) = pair_with(true, all());
    let mut src = vec![7u8; 100];
    let mut dst = vec![0u8; 100];
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let (ma, mb) = (unsafe { reg(&a, &mut src) }, unsafe { reg(&b, &mut dst) });
    a.ctx
        .post_send(
            a.qp,
            &[SendWr::new(1, WrOpcode::Send).sge(ma.iova, 100, ma.lkey)],
        )
        .unwrap();
    drive_until_idle(&[&a.ctx, &b.ctx]); // RNR NAK
    b.ctx
        .post_recv(
            b.qp,
            &[RecvWr {
                wr_id: 2,
                sg_list: vec![Sge {
                    addr: mb.iova,
                    length: 100,
                    lkey: mb.lkey,
                }],
            }],
        )
        .unwrap();
    let wc = poll_one(&a, &b, true);
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(poll_one(&b, &a, true).byte_len, 100);
    assert_eq!(dst, src);
}
