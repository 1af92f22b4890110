//! QP state machine: every (from, to) pair and every mask bit against the §8 table.
use mrkit_soft::qp::state::{check_modify, rc_transition};
use mrkit_soft::qp::{attr_mask as m, QpAttr, QpCap, QpInitAttr, QpState};
use mrkit_soft::{Context, DeviceConfig, Errno};

/// The table transcribed independently from docs/semantics.md §8.1: (from, to, required, optional).
fn expected(from: QpState, to: QpState) -> Option<(u32, u32)> {
    use QpState::*;
    let rows: &[(QpState, QpState, u32, u32)] = &[
        (Reset, Reset, 0, 0),
        (Reset, Init, 0x38, 0),
        (Init, Init, 0, 0x38),
        (Init, Rtr, 0x129180, 0x4000 | 0x8 | 0x10),
        (Rtr, Rts, 0x12E00, 0x2 | 0x4000 | 0x8 | 0x8000 | 0x40000),
        (Rts, Rts, 0, 0x2 | 0x8 | 0x4000 | 0x40000 | 0x8000),
        (Rts, Sqd, 0, 0x4),
        (Sqd, Rts, 0, 0x2 | 0x4000 | 0x8 | 0x8000 | 0x40000),
        (
            Sqd,
            Sqd,
            0,
            0x20 | 0x80
                | 0x200
                | 0x400
                | 0x800
                | 0x2000
                | 0x20000
                | 0x4000
                | 0x8
                | 0x10
                | 0x8000
                | 0x40000,
        ),
    ];
    if let Some(r) = rows.iter().find(|r| r.0 == from && r.1 == to) {
        return Some((r.2, r.3));
    }
    if from != Reset && (to == Reset || to == Err) {
        return Some((0, 0));
    }
    None
}

#[test]
fn every_transition_and_mask_bit() {
    let mut checked = 0;
    for from in QpState::ALL {
        for to in QpState::ALL {
            let exp = expected(from, to);
            assert_eq!(rc_transition(from, to), exp, "{from:?}->{to:?}");
            let Some((req, opt)) = exp else {
                let e = check_modify(from, m::STATE, to as u32).unwrap_err();
                assert_eq!(e.errno(), Errno::EINVAL, "{from:?}->{to:?}");
                continue;
            };
            assert_eq!(check_modify(from, m::STATE | req, to as u32).unwrap(), to);
            assert_eq!(
                check_modify(from, m::STATE | req | opt, to as u32).unwrap(),
                to
            );
            for bit in (0..21).map(|b| 1u32 << b).filter(|b| *b != m::STATE) {
                let r = if req & bit != 0 {
                    check_modify(from, m::STATE | (req & !bit), to as u32)
                } else if opt & bit == 0 {
                    check_modify(from, m::STATE | req | bit, to as u32)
                } else {
                    continue;
                };
                assert_eq!(
                    r.unwrap_err().errno(),
                    Errno::EINVAL,
                    "{from:?}->{to:?} bit {bit:#x}"
                );
                checked += 1;
            }
            let e = check_modify(from, m::STATE | req | m::RATE_LIMIT, to as u32).unwrap_err();
            assert_eq!(e.errno(), Errno::EOPNOTSUPP);
        }
    }
    assert!(checked > 300);
    // qp_state > ERR.
    assert_eq!(
        check_modify(QpState::Init, m::STATE, 7)
            .unwrap_err()
            .errno(),
        Errno::EINVAL
    );
    // No STATE: same-state modify; in RESET nothing can be modified.
    assert_eq!(
        check_modify(QpState::Rts, m::ACCESS_FLAGS, 0).unwrap(),
        QpState::Rts
    );
    assert_eq!(
        check_modify(QpState::Reset, m::ACCESS_FLAGS, 0)
            .unwrap_err()
            .errno(),
        Errno::EINVAL
    );
}

/// Manual progress on `ctx`, a PD and a CQ of 16, and RC QP attributes with default caps.
fn manual_qp_attrs(ctx: &Context) -> QpInitAttr {
    ctx.set_manual_progress();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None).unwrap();
    QpInitAttr {
        pd,
        send_cq: cq,
        recv_cq: cq,
        cap: QpCap::default(),
        sq_sig_all: false,
    }
}

#[test]
fn modify_qp_through_the_device() {
    let ctx = Context::open(DeviceConfig::rxe());
    let init = manual_qp_attrs(&ctx);
    // Creation limits.
    for cap in [
        QpCap {
            max_inline_data: 513,
            ..QpCap::default()
        },
        QpCap {
            max_send_sge: 33,
            ..QpCap::default()
        },
        QpCap {
            max_recv_wr: (1 << 20) + 1,
            ..QpCap::default()
        },
    ] {
        assert_eq!(
            ctx.create_qp(QpInitAttr { cap, ..init })
                .unwrap_err()
                .errno(),
            Errno::EINVAL
        );
    }
    let (qp, _) = ctx.create_qp(init).unwrap();
    let mut a = QpAttr {
        qp_state: QpState::Err as u32,
        ..QpAttr::default()
    };
    assert_eq!(
        ctx.modify_qp(qp, &a, m::STATE).unwrap_err().errno(),
        Errno::EINVAL,
        "RESET->ERR"
    );
    a.qp_state = QpState::Init as u32;
    a.port_num = 2;
    assert_eq!(
        ctx.modify_qp(qp, &a, m::STATE | 0x38).unwrap_err().errno(),
        Errno::EINVAL,
        "port 2"
    );
    a.port_num = 1;
    ctx.modify_qp(qp, &a, m::STATE | 0x38).unwrap();
    a.qp_state = QpState::Rtr as u32;
    a.path_mtu = 6;
    assert_eq!(
        ctx.modify_qp(qp, &a, m::STATE | 0x129180)
            .unwrap_err()
            .errno(),
        Errno::EINVAL,
        "mtu"
    );
    a.path_mtu = 3;
    a.max_dest_rd_atomic = 3;
    ctx.modify_qp(qp, &a, m::STATE | 0x129180).unwrap();
    assert_eq!(
        ctx.query_qp(qp).unwrap().max_dest_rd_atomic,
        4,
        "rounded up to a power of two"
    );
    a.qp_state = QpState::Rts as u32;
    a.timeout = 32;
    assert_eq!(
        ctx.modify_qp(qp, &a, m::STATE | 0x12E00)
            .unwrap_err()
            .errno(),
        Errno::EINVAL
    );
    a.timeout = 14;
    a.max_rd_atomic = 129;
    assert_eq!(
        ctx.modify_qp(qp, &a, m::STATE | 0x12E00)
            .unwrap_err()
            .errno(),
        Errno::EINVAL
    );
    a.max_rd_atomic = 1;
    ctx.modify_qp(qp, &a, m::STATE | 0x12E00).unwrap();
    assert_eq!(ctx.qp_state(qp).unwrap(), QpState::Rts);
    a.qp_state = QpState::Sqd as u32;
    ctx.modify_qp(qp, &a, m::STATE).unwrap();
    a.qp_state = QpState::Rts as u32;
    ctx.modify_qp(qp, &a, m::STATE).unwrap();
    a.qp_state = QpState::Err as u32;
    ctx.modify_qp(qp, &a, m::STATE).unwrap();
    a.qp_state = QpState::Rts as u32;
    assert_eq!(
        ctx.modify_qp(qp, &a, m::STATE).unwrap_err().errno(),
        Errno::EINVAL,
        "ERR->RTS"
    );
    a.qp_state = QpState::Reset as u32;
    ctx.modify_qp(qp, &a, m::STATE).unwrap();
    assert_eq!(ctx.qp_state(qp).unwrap(), QpState::Reset);
    ctx.destroy_qp(qp).unwrap();
    ctx.destroy_cq(init.send_cq).unwrap();
    ctx.dealloc_pd(init.pd).unwrap();
}

/// `poll_cq` keeps the CQ a thread polled last in a per-thread cache: a destroyed CQ must still
/// answer EINVAL, a CQ number reused by a new CQ must reach the new CQ, and a CQ with the same
/// number on another device must not be confused with this one.
#[test]
fn poll_cq_finds_the_right_cq_through_its_per_thread_cache() {
    let a = Context::open(DeviceConfig::default());
    let b = Context::open(DeviceConfig::default());
    a.set_manual_progress();
    b.set_manual_progress();
    let mut out = Vec::new();
    let ca = a.create_cq(4, None).unwrap();
    let cb = b.create_cq(4, None).unwrap();
    assert_eq!(ca, cb, "both devices number their first CQ alike");
    assert_eq!(a.poll_cq(ca, &mut out, 1).unwrap(), 0); // cached: (a, ca)
    assert_eq!(b.poll_cq(cb, &mut out, 1).unwrap(), 0); // another device: not the cached one
    assert_eq!(a.poll_cq(ca, &mut out, 1).unwrap(), 0); // cached again: (a, ca)
    a.destroy_cq(ca).unwrap();
    assert_eq!(
        a.poll_cq(ca, &mut out, 1).unwrap_err().errno(),
        Errno::EINVAL
    );
    assert_eq!(b.poll_cq(cb, &mut out, 1).unwrap(), 0);
    assert_eq!(
        a.poll_cq(ca, &mut out, 1).unwrap_err().errno(),
        Errno::EINVAL
    );
    // A new CQ (its number may be the old one's): polled, not the destroyed one.
    let c2 = a.create_cq(4, None).unwrap();
    assert_eq!(a.poll_cq(c2, &mut out, 1).unwrap(), 0);
    assert_eq!(a.cq_len(c2).unwrap().1, 4);
    b.destroy_cq(cb).unwrap();
    assert_eq!(
        b.poll_cq(cb, &mut out, 1).unwrap_err().errno(),
        Errno::EINVAL
    );
    assert_eq!(a.poll_cq(c2, &mut out, 1).unwrap(), 0);
}

/// `post_send`/`post_recv` reach their QP through a per-thread last-used cache: a QP with the
/// same number on another device must not be confused with the cached one, and a destroyed
/// QP must answer EINVAL while the cache still holds it.
#[test]
fn post_finds_the_right_qp_through_its_per_thread_cache() {
    use mrkit_soft::qp::{RecvWr, SendWr, WrOpcode};
    let qp_on = |ctx: &Context| ctx.create_qp(manual_qp_attrs(ctx)).unwrap().0;
    let a = Context::open(DeviceConfig::default());
    let b = Context::open(DeviceConfig::default());
    let (qa, qb) = (qp_on(&a), qp_on(&b));
    assert_eq!(qa, qb, "both devices number their first QP alike");
    // a's QP in INIT takes receives; b's, in RESET, refuses them.
    let init = QpAttr {
        qp_state: QpState::Init as u32,
        port_num: 1,
        ..QpAttr::default()
    };
    a.modify_qp(qa, &init, m::STATE | 0x38).unwrap();
    let recv = [RecvWr {
        wr_id: 1,
        sg_list: vec![],
    }];
    let send = [SendWr::new(2, WrOpcode::Send)];
    for _ in 0..2 {
        a.post_recv(qa, &recv).unwrap(); // cached: (a, qa)
        let e = b.post_recv(qb, &recv).unwrap_err();
        assert_eq!(e.error.errno(), Errno::EINVAL, "b's QP is in RESET");
        assert_eq!(
            b.post_send(qb, &send).unwrap_err().error.errno(),
            Errno::EINVAL
        );
    }
    a.post_recv(qa, &recv).unwrap();
    a.destroy_qp(qa).unwrap();
    for _ in 0..2 {
        assert_eq!(
            a.post_recv(qa, &recv).unwrap_err().error.errno(),
            Errno::EINVAL
        );
        assert_eq!(
            a.post_send(qa, &send).unwrap_err().error.errno(),
            Errno::EINVAL
        );
        assert_eq!(a.query_qp(qa).unwrap_err().errno(), Errno::EINVAL);
    }
    // b's QP is still there and still in RESET.
    assert_eq!(
        b.post_recv(qb, &recv).unwrap_err().error.errno(),
        Errno::EINVAL
    );
    b.modify_qp(qb, &init, m::STATE | 0x38).unwrap();
    b.post_recv(qb, &recv).unwrap();
}
