//! Shared receive queues: create/modify/query/destroy, post_srq_recv, QPs fed by an SRQ, the
//! limit event and LAST_WQE_REACHED.
mod common;

use common::*;
use mrkit_soft::cq::{WcOpcode, WcStatus};
use mrkit_soft::progress::AsyncEvent;
use mrkit_soft::qp::{rc_connect, QpAttr, QpState, SendWr, WrOpcode};
use mrkit_soft::srq::{srq_attr_mask as m, SrqAttr};
use mrkit_soft::{Context, Errno};

fn attr(max_wr: u32, max_sge: u32) -> SrqAttr {
    SrqAttr {
        max_wr,
        max_sge,
        srq_limit: 0,
    }
}

#[test]
fn srq_create_modify_query_destroy_rules() {
    let c = ctx(true);
    let pd = c.alloc_pd().unwrap();
    let max_wr = c.query_device().max_srq_wr;
    let max_sge = c.query_device().max_srq_sge;
    assert_eq!(
        c.create_srq(pd, attr(max_wr + 1, 1)).unwrap_err().errno(),
        Errno::EINVAL
    );
    assert_eq!(
        c.create_srq(pd, attr(16, max_sge + 1)).unwrap_err().errno(),
        Errno::EINVAL
    );
    assert_eq!(
        c.create_srq(pd + 77, attr(16, 1)).unwrap_err().errno(),
        Errno::EINVAL
    );
    let (s, a) = c.create_srq(pd, attr(16, 2)).unwrap();
    assert_eq!(a, attr(16, 2));
    assert_eq!(c.query_srq(s).unwrap(), attr(16, 2));
    // The SRQ holds its PD.
    assert_eq!(c.dealloc_pd(pd).unwrap_err().errno(), Errno::EBUSY);
    // Limit above max_wr → EINVAL; arming works; 0 disarms.
    let lim = |l| SrqAttr {
        srq_limit: l,
        ..SrqAttr::default()
    };
    assert_eq!(
        c.modify_srq(s, lim(17), m::LIMIT).unwrap_err().errno(),
        Errno::EINVAL
    );
    c.modify_srq(s, lim(4), m::LIMIT).unwrap();
    assert_eq!(c.query_srq(s).unwrap().srq_limit, 4);
    // Resize: 0 / above max / below the armed limit → EINVAL; grow is fine.
    for bad in [0, max_wr + 1, 3] {
        assert_eq!(
            c.modify_srq(s, attr(bad, 0), m::MAX_WR)
                .unwrap_err()
                .errno(),
            Errno::EINVAL,
            "max_wr {bad}"
        );
    }
    c.modify_srq(s, attr(64, 0), m::MAX_WR).unwrap();
    assert_eq!(c.query_srq(s).unwrap().max_wr, 64);
    assert_eq!(
        c.modify_srq(s, attr(8, 0), 4).unwrap_err().errno(),
        Errno::EINVAL,
        "unknown mask bit"
    );
    // post_srq_recv: too many SGEs → EINVAL, full → ENOMEM (bad_wr index).
    let mut buf = vec![0u8; 4096];
    let mr = c
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(buf.as_mut_ptr() as u64, 4096) },
            all(),
        )
        .unwrap();
    let mut wr = recv_wr(1, &mr, 0, 8);
    wr.sg_list = vec![wr.sg_list[0]; 3];
    let e = c
        .post_srq_recv(s, &[recv_wr(0, &mr, 0, 8), wr])
        .unwrap_err();
    assert_eq!((e.bad_wr, e.error.errno()), (1, Errno::EINVAL));
    assert_eq!(c.srq_len(s).unwrap(), 1);
    c.modify_srq(s, attr(8, 0), m::MAX_WR | m::LIMIT).unwrap(); // limit 0 with it
    let wrs: Vec<_> = (0..8).map(|i| recv_wr(i, &mr, 0, 8)).collect();
    let e = c.post_srq_recv(s, &wrs).unwrap_err();
    assert_eq!((e.bad_wr, e.error.errno()), (7, Errno::ENOMEM));
    // Shrinking below the queued WQEs → EINVAL.
    assert_eq!(
        c.modify_srq(s, attr(4, 0), m::MAX_WR).unwrap_err().errno(),
        Errno::EINVAL
    );
    // Destroy: EBUSY while a QP uses it.
    let cq = c.create_cq(16, None).unwrap();
    let (qp, cap) = c.create_qp_srq(init(pd, cq, false), s).unwrap();
    assert_eq!((cap.max_recv_wr, cap.max_recv_sge), (0, 0));
    assert_eq!(c.destroy_srq(s).unwrap_err().errno(), Errno::EBUSY);
    c.destroy_qp(qp).unwrap();
    c.destroy_srq(s).unwrap();
    assert_eq!(c.query_srq(s).unwrap_err().errno(), Errno::EINVAL);
    assert_eq!(c.destroy_srq(s).unwrap_err().errno(), Errno::EINVAL);
    c.dereg_mr(mr.lkey).unwrap();
    c.destroy_cq(cq).unwrap();
    c.dealloc_pd(pd).unwrap();
}

#[test]
fn srq_qp_needs_same_pd_and_rejects_post_recv() {
    let c = ctx(true);
    let pd = c.alloc_pd().unwrap();
    let pd2 = c.alloc_pd().unwrap();
    let cq = c.create_cq(16, None).unwrap();
    let (s, _) = c.create_srq(pd, attr(16, 1)).unwrap();
    assert_eq!(
        c.create_qp_srq(init(pd2, cq, false), s)
            .unwrap_err()
            .errno(),
        Errno::EINVAL
    );
    assert_eq!(
        c.create_qp_srq(init(pd, cq, false), s + 9)
            .unwrap_err()
            .errno(),
        Errno::EINVAL
    );
    let (qp, _) = c.create_qp_srq(init(pd, cq, false), s).unwrap();
    let e = c
        .post_recv(qp, &[mrkit_soft::qp::RecvWr::default()])
        .unwrap_err();
    assert_eq!((e.bad_wr, e.error.errno()), (0, Errno::EINVAL));
}

/// A responder host whose QPs take receives from one SRQ.
struct SrqSide {
    h: Host,
    srq: u32,
}

fn srq_pair(nqps: usize) -> (Vec<Host>, SrqSide, Vec<u32>) {
    let rc = ctx(true);
    let pd = rc.alloc_pd().unwrap();
    let cq = rc.create_cq(256, None).unwrap();
    let (srq, _) = rc.create_srq(pd, attr(64, 2)).unwrap();
    let mut senders = Vec::new();
    let mut qps = Vec::new();
    for _ in 0..nqps {
        let a = host_with(ctx(true), 256, true);
        let (qp, _) = rc.create_qp_srq(init(pd, cq, false), srq).unwrap();
        rc_connect(&a.ctx, a.qp, &rc, qp, all(), 3).unwrap();
        senders.push(a);
        qps.push(qp);
    }
    let h = Host {
        ctx: rc,
        pd,
        cq,
        qp: qps[0],
    };
    (senders, SrqSide { h, srq }, qps)
}

#[test]
fn srq_feeds_several_qps_and_limit_event_fires_once() {
    let (senders, r, qps) = srq_pair(2);
    let mut rbuf = vec![0u8; 64 * 64];
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let rmr = unsafe { reg(&r.h, &mut rbuf) };
    let wrs: Vec<_> = (0..6).map(|i| recv_wr(100 + i, &rmr, i * 64, 64)).collect();
    r.h.ctx.post_srq_recv(r.srq, &wrs).unwrap();
    r.h.ctx
        .modify_srq(
            r.srq,
            SrqAttr {
                srq_limit: 3,
                ..SrqAttr::default()
            },
            m::LIMIT,
        )
        .unwrap();
    let mut sbufs: Vec<Vec<u8>> = (0..2).map(|i| vec![i as u8 + 1; 64]).collect();
    let smrs: Vec<_> = senders
        .iter()
        .zip(sbufs.iter_mut())
        // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
        .map(|(s, b)| unsafe { reg(s, b) })
        .collect();
    let ctxs: Vec<&Context> = senders.iter().map(|s| &s.ctx).chain([&r.h.ctx]).collect();
    // Sender 0, then sender 1, then sender 0: three WQEs in SRQ order.
    for (k, si) in [0usize, 1, 0].into_iter().enumerate() {
        let s = &senders[si];
        s.ctx
            .post_send(
                s.qp,
                &[SendWr::new(k as u64, WrOpcode::Send).sge(
                    smrs[si].iova,
                    10 + k as u32,
                    smrs[si].lkey,
                )],
            )
            .unwrap();
        mrkit_soft::driver::loopback::drive_until_idle(&ctxs);
        let ev = events(&r.h.ctx);
        // 6 queued, limit 3: fires when fewer than 3 remain (after the 4th take) — not yet.
        assert!(ev.is_empty(), "{ev:?}");
    }
    let wcs = drain(&r.h);
    let got: Vec<_> = wcs
        .iter()
        .map(|w| (w.wr_id, w.status, w.opcode, w.byte_len, w.qp_num))
        .collect();
    assert_eq!(
        got,
        vec![
            (100, WcStatus::Success, WcOpcode::Recv, 10, qps[0]),
            (101, WcStatus::Success, WcOpcode::Recv, 11, qps[1]),
            (102, WcStatus::Success, WcOpcode::Recv, 12, qps[0]),
        ]
    );
    assert_eq!(rbuf[0], 1);
    assert_eq!(rbuf[64], 2);
    assert_eq!(rbuf[128], 1);
    assert_eq!(r.h.ctx.srq_len(r.srq).unwrap(), 3);
    assert_eq!(r.h.ctx.query_srq(r.srq).unwrap().srq_limit, 3);
    // 4th message: 2 left < 3 → one SRQ_LIMIT_REACHED, limit disarmed.
    let s = &senders[1];
    s.ctx
        .post_send(
            s.qp,
            &[SendWr::new(9, WrOpcode::Send).sge(smrs[1].iova, 5, smrs[1].lkey)],
        )
        .unwrap();
    mrkit_soft::driver::loopback::drive_until_idle(&ctxs);
    assert_eq!(
        events(&r.h.ctx),
        vec![AsyncEvent::SrqLimitReached { srqn: r.srq }]
    );
    assert_eq!(r.h.ctx.query_srq(r.srq).unwrap().srq_limit, 0);
    // 5th: below the (now disarmed) limit again, no second event.
    s.ctx
        .post_send(
            s.qp,
            &[SendWr::new(10, WrOpcode::Send).sge(smrs[1].iova, 5, smrs[1].lkey)],
        )
        .unwrap();
    mrkit_soft::driver::loopback::drive_until_idle(&ctxs);
    assert!(events(&r.h.ctx).is_empty());
    assert_eq!(r.h.ctx.srq_len(r.srq).unwrap(), 1);
    assert_eq!(drain(&r.h).len(), 2);
}

#[test]
fn srq_empty_means_rnr_then_delivery_when_posted() {
    let (senders, r, _qps) = srq_pair(1);
    let s = &senders[0];
    let mut sb = vec![7u8; 32];
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let smr = unsafe { reg(s, &mut sb) };
    let mut rb = vec![0u8; 32];
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let rmr = unsafe { reg(&r.h, &mut rb) };
    s.ctx
        .post_send(
            s.qp,
            &[SendWr::new(1, WrOpcode::Send).sge(smr.iova, 32, smr.lkey)],
        )
        .unwrap();
    drive(s, &r.h);
    assert!(drain(s).is_empty(), "RNR: nothing completes yet");
    r.h.ctx
        .post_srq_recv(r.srq, &[recv_wr(5, &rmr, 0, 32)])
        .unwrap();
    drive_until(&[&s.ctx, &r.h.ctx], || {
        r.h.ctx.cq_len(r.h.cq).unwrap().0 == 1
    });
    let w = drain(&r.h);
    assert_eq!(
        (w[0].wr_id, w[0].status, w[0].byte_len),
        (5, WcStatus::Success, 32)
    );
    assert_eq!(rb, sb);
    drive_until(&[&s.ctx, &r.h.ctx], || s.ctx.cq_len(s.cq).unwrap().0 == 1);
    assert_eq!(drain(s)[0].status, WcStatus::Success);
}

#[test]
fn srq_qp_to_err_raises_last_wqe_reached_and_keeps_srq_wqes() {
    let (senders, r, qps) = srq_pair(2);
    let mut rb = vec![0u8; 256];
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let rmr = unsafe { reg(&r.h, &mut rb) };
    let wrs: Vec<_> = (0..4).map(|i| recv_wr(i, &rmr, i * 64, 64)).collect();
    r.h.ctx.post_srq_recv(r.srq, &wrs).unwrap();
    // QP 0 → ERR by modify: LAST_WQE_REACHED, no flush completions, SRQ keeps all 4.
    let at = QpAttr {
        qp_state: QpState::Err as u32,
        ..QpAttr::default()
    };
    r.h.ctx
        .modify_qp(qps[0], &at, mrkit_soft::qp::attr_mask::STATE)
        .unwrap();
    let ctxs: Vec<&Context> = senders.iter().map(|s| &s.ctx).chain([&r.h.ctx]).collect();
    mrkit_soft::driver::loopback::drive_until_idle(&ctxs);
    assert_eq!(
        events(&r.h.ctx),
        vec![AsyncEvent::QpLastWqeReached { qpn: qps[0] }]
    );
    assert!(drain(&r.h).is_empty(), "SRQ WQEs are not flushed");
    assert_eq!(r.h.ctx.srq_len(r.srq).unwrap(), 4);
    // Running it again does not repeat the event.
    r.h.ctx
        .modify_qp(qps[0], &at, mrkit_soft::qp::attr_mask::STATE)
        .unwrap();
    mrkit_soft::driver::loopback::drive_until_idle(&ctxs);
    assert!(events(&r.h.ctx).is_empty());
    // A responder error on QP 1 (receive too short): that WQE completes in error, QP 1 → ERR
    // with LAST_WQE_REACHED, the other WQEs stay for the next QP.
    let s = &senders[1];
    let mut sb = vec![1u8; 100];
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let smr = unsafe { reg(s, &mut sb) };
    s.ctx
        .post_send(
            s.qp,
            &[SendWr::new(1, WrOpcode::Send).sge(smr.iova, 100, smr.lkey)],
        )
        .unwrap();
    mrkit_soft::driver::loopback::drive_until_idle(&ctxs);
    let w = drain(&r.h);
    assert_eq!(w.len(), 1, "{w:?}");
    assert_eq!((w[0].wr_id, w[0].status), (0, WcStatus::LocLenErr));
    assert_eq!(r.h.ctx.qp_state(qps[1]).unwrap(), QpState::Err);
    let ev = events(&r.h.ctx);
    assert!(
        ev.contains(&AsyncEvent::QpLastWqeReached { qpn: qps[1] }),
        "{ev:?}"
    );
    assert_eq!(r.h.ctx.srq_len(r.srq).unwrap(), 3);
    assert_eq!(drain(s)[0].status, WcStatus::RemInvReqErr);
    // After RESET the event can fire again (new stay in ERR).
    let reset = QpAttr {
        qp_state: QpState::Reset as u32,
        ..QpAttr::default()
    };
    r.h.ctx
        .modify_qp(qps[0], &reset, mrkit_soft::qp::attr_mask::STATE)
        .unwrap();
    let to_init = QpAttr {
        qp_state: QpState::Init as u32,
        ..QpAttr::default()
    };
    use mrkit_soft::qp::attr_mask as am;
    r.h.ctx
        .modify_qp(
            qps[0],
            &to_init,
            am::STATE | am::PKEY_INDEX | am::PORT | am::ACCESS_FLAGS,
        )
        .unwrap();
    r.h.ctx
        .modify_qp(qps[0], &at, mrkit_soft::qp::attr_mask::STATE)
        .unwrap();
    mrkit_soft::driver::loopback::drive_until_idle(&ctxs);
    assert_eq!(
        events(&r.h.ctx),
        vec![AsyncEvent::QpLastWqeReached { qpn: qps[0] }]
    );
}
