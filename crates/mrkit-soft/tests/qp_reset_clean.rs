//! QP → RESET cleans the QP's completions out of its CQs (mlx5's `mlx5_ib_cq_clean`
//! semantics, `cq.rs`): only that QP's completions go, from a CQ shared with other QPs, from
//! separate send/receive CQs, and from the receive CQ of QPs fed by an SRQ. Self-contained
//! (no `tests/common`), manual progress throughout.

use mrkit_soft::cq::{Wc, WcOpcode, WcStatus};
use mrkit_soft::driver::loopback::drive_until_idle;
use mrkit_soft::qp::{
    attr_mask as m, rc_connect, QpAttr, QpCap, QpInitAttr, QpState, RecvWr, SendWr, Sge, WrOpcode,
};
use mrkit_soft::srq::SrqAttr;
use mrkit_soft::{AccessFlags as A, Context, DeviceConfig, MrInfo};

fn all() -> A {
    A::LOCAL_WRITE | A::REMOTE_WRITE | A::REMOTE_READ | A::REMOTE_ATOMIC
}

fn manual_ctx() -> Context {
    let c = Context::open(DeviceConfig::rxe());
    c.set_manual_progress();
    c
}

fn qp(c: &Context, pd: u32, scq: u32, rcq: u32) -> u32 {
    c.create_qp(QpInitAttr {
        pd,
        send_cq: scq,
        recv_cq: rcq,
        cap: QpCap::default(),
        sq_sig_all: true,
    })
    .unwrap()
    .0
}

fn srq_qp(c: &Context, pd: u32, cq: u32, srq: u32) -> u32 {
    c.create_qp_srq(
        QpInitAttr {
            pd,
            send_cq: cq,
            recv_cq: cq,
            cap: QpCap::default(),
            sq_sig_all: true,
        },
        srq,
    )
    .unwrap()
    .0
}

/// # Safety
///
/// Nothing may access the MR once `buf` is freed (the test posts no work request over it
/// afterwards; no other peer knows its keys).
unsafe fn reg(c: &Context, pd: u32, buf: &mut [u8]) -> MrInfo {
    // SAFETY: passed on to the caller (above).
    let mem = unsafe { mrkit_soft::UserMemory::new(buf.as_mut_ptr() as u64, buf.len() as u64) };
    c.reg_mr_va(pd, mem, all()).unwrap()
}

fn recv(wr_id: u64, mr: &MrInfo) -> RecvWr {
    RecvWr {
        wr_id,
        sg_list: vec![Sge {
            addr: mr.iova,
            length: 64,
            lkey: mr.lkey,
        }],
    }
}

fn send(wr_id: u64, mr: &MrInfo) -> SendWr {
    SendWr::new(wr_id, WrOpcode::Send).sge(mr.iova, 16, mr.lkey)
}

fn poll_all(c: &Context, cq: u32) -> Vec<Wc> {
    let mut v = Vec::new();
    c.poll_cq(cq, &mut v, 4096).unwrap();
    v
}

fn to_state(c: &Context, qpn: u32, s: QpState) {
    let a = QpAttr {
        qp_state: s as u32,
        ..QpAttr::default()
    };
    c.modify_qp(qpn, &a, m::STATE).unwrap();
}

/// (qp_num, wr_id, status, opcode) of each completion, in order.
fn summary(v: &[Wc]) -> Vec<(u32, u64, WcStatus, WcOpcode)> {
    v.iter()
        .map(|w| (w.qp_num, w.wr_id, w.status, w.opcode))
        .collect()
}

/// Two QPs of one device connected to each other, both completing into one CQ. QP 1 sends two
/// messages to QP 2 and QP 2 one to QP 1, then QP 1 is moved to `via` (its spare receives are
/// flushed if `via` is ERR) and on to RESET: exactly QP 1's completions leave the CQ; QP 2's
/// stay, in order; reconnected, QP 1 then sees only its new completions.
#[test]
fn reset_cleans_only_that_qps_completions_from_a_shared_cq() {
    for via in [QpState::Rts, QpState::Sqd, QpState::Err] {
        let c = manual_ctx();
        let pd = c.alloc_pd().unwrap();
        let cq = c.create_cq(256, None).unwrap();
        let mut buf = vec![0u8; 4096];
        // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
        let mr = unsafe { reg(&c, pd, &mut buf) };
        let q1 = qp(&c, pd, cq, cq);
        let q2 = qp(&c, pd, cq, cq);
        rc_connect(&c, q1, &c, q2, all(), 3).unwrap();
        c.post_recv(q1, &[recv(10, &mr), recv(11, &mr), recv(12, &mr)])
            .unwrap();
        c.post_recv(q2, &[recv(20, &mr), recv(21, &mr), recv(22, &mr)])
            .unwrap();
        c.post_send(q1, &[send(1, &mr), send(2, &mr)]).unwrap();
        drive_until_idle(&[&c]);
        c.post_send(q2, &[send(3, &mr)]).unwrap();
        drive_until_idle(&[&c]);
        if via != QpState::Rts {
            to_state(&c, q1, via);
            drive_until_idle(&[&c]);
        }
        let (queued, _) = c.cq_len(cq).unwrap();
        let expect_q1 = if via == QpState::Err { 5 } else { 3 }; // 2 sends, 1 recv (+2 flushed)
        assert_eq!(
            queued,
            expect_q1 + 3,
            "{via:?}: q1 {expect_q1} + q2 3 completions"
        );

        to_state(&c, q1, QpState::Reset);
        assert_eq!(
            c.cq_len(cq).unwrap().0,
            3,
            "{via:?}: only q2's completions left"
        );
        let left = poll_all(&c, cq);
        assert_eq!(
            summary(&left),
            vec![
                (q2, 20, WcStatus::Success, WcOpcode::Recv),
                (q2, 21, WcStatus::Success, WcOpcode::Recv),
                (q2, 3, WcStatus::Success, WcOpcode::Send),
            ],
            "{via:?}"
        );
        assert_eq!(
            c.qp_state(q2).unwrap(),
            QpState::Rts,
            "{via:?}: q2 untouched"
        );

        // Both QPs again (q2 drained: its reset cleans nothing); then only new completions.
        to_state(&c, q2, QpState::Reset);
        rc_connect(&c, q1, &c, q2, all(), 3).unwrap();
        c.post_recv(q1, &[recv(13, &mr)]).unwrap();
        c.post_send(q2, &[send(4, &mr)]).unwrap();
        drive_until_idle(&[&c]);
        let got = summary(&poll_all(&c, cq));
        assert!(
            got.contains(&(q1, 13, WcStatus::Success, WcOpcode::Recv))
                && got.iter().all(|w| w.0 != q1 || w.1 == 13),
            "{via:?}: q1 sees only its new receive: {got:?}"
        );
    }
}

/// Separate send and receive CQs, shared with a second QP: both are cleaned of the reset QP's
/// completions only.
#[test]
fn reset_cleans_both_the_send_and_the_receive_cq() {
    let c = manual_ctx();
    let pd = c.alloc_pd().unwrap();
    let scq = c.create_cq(64, None).unwrap();
    let rcq = c.create_cq(64, None).unwrap();
    let mut buf = vec![0u8; 4096];
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let mr = unsafe { reg(&c, pd, &mut buf) };
    let q1 = qp(&c, pd, scq, rcq);
    let q2 = qp(&c, pd, scq, rcq);
    rc_connect(&c, q1, &c, q2, all(), 3).unwrap();
    c.post_recv(q1, &[recv(10, &mr), recv(11, &mr)]).unwrap();
    c.post_recv(q2, &[recv(20, &mr), recv(21, &mr)]).unwrap();
    c.post_send(q1, &[send(1, &mr)]).unwrap();
    c.post_send(q2, &[send(2, &mr)]).unwrap();
    drive_until_idle(&[&c]);
    assert_eq!(c.cq_len(scq).unwrap().0, 2);
    assert_eq!(c.cq_len(rcq).unwrap().0, 2);
    to_state(&c, q2, QpState::Err);
    drive_until_idle(&[&c]);
    assert_eq!(c.cq_len(rcq).unwrap().0, 3, "q2's spare receive flushed");
    to_state(&c, q2, QpState::Reset);
    assert_eq!(
        summary(&poll_all(&c, scq)),
        vec![(q1, 1, WcStatus::Success, WcOpcode::Send)]
    );
    assert_eq!(
        summary(&poll_all(&c, rcq)),
        vec![(q1, 10, WcStatus::Success, WcOpcode::Recv)]
    );
    // RESET → RESET cleans nothing more (and is legal).
    c.post_send(q1, &[send(5, &mr)]).unwrap();
    drive_until_idle(&[&c]);
    let before = c.cq_len(scq).unwrap().0;
    to_state(&c, q2, QpState::Reset);
    assert_eq!(c.cq_len(scq).unwrap().0, before);
}

/// Two QPs fed by one SRQ, completing into one receive CQ: resetting one removes its receive
/// completions (the SRQ WQEs it consumed are not given back) and keeps the other's.
#[test]
fn reset_cleans_srq_receive_completions_of_that_qp_only() {
    let a = manual_ctx();
    let b = manual_ctx();
    let pda = a.alloc_pd().unwrap();
    let pdb = b.alloc_pd().unwrap();
    let cqa = a.create_cq(64, None).unwrap();
    let cqb = b.create_cq(64, None).unwrap();
    let mut bufa = vec![0u8; 4096];
    let mut bufb = vec![0u8; 4096];
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let mra = unsafe { reg(&a, pda, &mut bufa) };
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let mrb = unsafe { reg(&b, pdb, &mut bufb) };
    let (srq, _) = a
        .create_srq(
            pda,
            SrqAttr {
                max_wr: 16,
                max_sge: 1,
                srq_limit: 0,
            },
        )
        .unwrap();
    let wrs: Vec<RecvWr> = (100..108).map(|i| recv(i, &mra)).collect();
    a.post_srq_recv(srq, &wrs).unwrap();
    let x = srq_qp(&a, pda, cqa, srq);
    let y = srq_qp(&a, pda, cqa, srq);
    let px = qp(&b, pdb, cqb, cqb);
    let py = qp(&b, pdb, cqb, cqb);
    rc_connect(&a, x, &b, px, all(), 3).unwrap();
    rc_connect(&a, y, &b, py, all(), 3).unwrap();
    b.post_send(px, &[send(1, &mrb)]).unwrap();
    drive_until_idle(&[&a, &b]);
    b.post_send(py, &[send(2, &mrb)]).unwrap();
    drive_until_idle(&[&a, &b]);
    b.post_send(px, &[send(3, &mrb)]).unwrap();
    drive_until_idle(&[&a, &b]);
    assert_eq!(a.cq_len(cqa).unwrap().0, 3);
    let srq_left = a.srq_len(srq).unwrap();
    assert_eq!(srq_left, 5, "three SRQ WQEs consumed");

    to_state(&a, x, QpState::Reset);
    assert_eq!(
        summary(&poll_all(&a, cqa)),
        vec![(y, 101, WcStatus::Success, WcOpcode::Recv)],
        "only y's receive is left"
    );
    assert_eq!(
        a.srq_len(srq).unwrap(),
        srq_left,
        "consumed WQEs stay consumed"
    );
    assert_eq!(a.qp_state(y).unwrap(), QpState::Rts);
    // y keeps receiving from the SRQ.
    b.post_send(py, &[send(4, &mrb)]).unwrap();
    drive_until_idle(&[&a, &b]);
    assert_eq!(
        summary(&poll_all(&a, cqa)),
        vec![(y, 103, WcStatus::Success, WcOpcode::Recv)]
    );
}
