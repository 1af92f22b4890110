//! Table-driven protection tests: every violation, both status models, status on each side
//! and the QP states after (docs/datapath.md has the same table).
mod common;

use std::time::{Duration, Instant};

use common::{connect, ctx_with, drain, host_with, init, Host};
use mrkit_soft::cq::WcStatus as S;
use mrkit_soft::driver::loopback::drive_until_idle;
use mrkit_soft::mw::{BindInfo, MwType};
use mrkit_soft::qp::{BindWr, QpState, RecvWr, SendWr, Sge, WrOpcode as O};
use mrkit_soft::{AccessFlags as A, DeviceConfig, Errno, StatusModel};

/// Manual progress under `model`, CQ of 64, every WR signaled.
fn side(model: StatusModel) -> Host {
    host_with(
        ctx_with(DeviceConfig::rxe().status_model(model), true),
        64,
        true,
    )
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Case {
    WriteBadRkey,
    WriteNoRemoteWriteOnMr,
    WriteOutOfRange,
    WriteWrongPd,
    WriteQpLacksRemoteWrite,
    WriteImmBadRkey,
    ReadNoRemoteReadOnMr,
    ReadQpLacksRemoteRead,
    ReadDestNoLocalWrite,
    AtomicNoRemoteAtomicOnMr,
    AtomicQpLacksRemoteAtomic,
    AtomicResultNoLocalWrite,
    SendBadGatherLkey,
    SendGatherOutOfRange,
    SendRecvTooSmall,
    SendRecvNoLocalWrite,
    LocalInvOrdinaryMr,
    SendWithInvOrdinaryMr,
    WindowBeyondBounds,
    DeregisteredRkey,
}

/// (requester status, responder receive status, requester QP, responder QP)
type Outcome = (S, Option<S>, QpState, QpState);

fn scenario(model: StatusModel, case: Case) -> Outcome {
    use Case::*;
    let a = side(model);
    let b = side(model);
    let full = A::LOCAL_WRITE | A::REMOTE_WRITE | A::REMOTE_READ | A::REMOTE_ATOMIC;
    let qp_access = match case {
        WriteQpLacksRemoteWrite => A::REMOTE_READ | A::REMOTE_ATOMIC,
        ReadQpLacksRemoteRead => A::REMOTE_WRITE | A::REMOTE_ATOMIC,
        AtomicQpLacksRemoteAtomic => A::REMOTE_WRITE | A::REMOTE_READ,
        _ => full,
    };
    connect(&a, &b, qp_access, 3);
    let src = vec![1u8; 8192];
    let mut dst = vec![0u8; 8192];
    let mut small = vec![0u8; 64];
    let la = a
        .ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            a.pd,
            unsafe { mrkit_soft::UserMemory::new(src.as_ptr() as u64, 8192) },
            full,
        )
        .unwrap();
    let la_ro = a
        .ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            a.pd,
            unsafe { mrkit_soft::UserMemory::new(small.as_mut_ptr() as u64, 64) },
            A::empty(),
        )
        .unwrap();
    let rb_access = match case {
        WriteNoRemoteWriteOnMr => A::LOCAL_WRITE | A::REMOTE_READ,
        ReadNoRemoteReadOnMr => A::LOCAL_WRITE | A::REMOTE_WRITE,
        AtomicNoRemoteAtomicOnMr => A::LOCAL_WRITE | A::REMOTE_READ,
        SendRecvNoLocalWrite => A::REMOTE_READ,
        _ => full | A::MW_BIND,
    };
    let rb = b
        .ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            b.pd,
            unsafe { mrkit_soft::UserMemory::new(dst.as_mut_ptr() as u64, 8192) },
            rb_access,
        )
        .unwrap();
    let mut rkey = rb.rkey;
    let mut raddr = rb.iova;
    if case == WriteWrongPd {
        let pd2 = b.ctx.alloc_pd().unwrap();
        let mut other = vec![0u8; 4096];
        let m = b
            .ctx
            // SAFETY: test memory: it stays allocated while any work request can reach this MR.
            .reg_mr_va(
                pd2,
                unsafe { mrkit_soft::UserMemory::new(other.as_mut_ptr() as u64, 4096) },
                full,
            )
            .unwrap();
        rkey = m.rkey;
        raddr = m.iova;
        std::mem::forget(other);
    }
    if case == DeregisteredRkey {
        let mut tmp = vec![0u8; 4096];
        let m = b
            .ctx
            // SAFETY: test memory: it stays allocated while any work request can reach this MR.
            .reg_mr_va(
                b.pd,
                unsafe { mrkit_soft::UserMemory::new(tmp.as_mut_ptr() as u64, 4096) },
                full,
            )
            .unwrap();
        b.ctx.dereg_mr(m.lkey).unwrap();
        rkey = m.rkey;
        raddr = m.iova;
    }
    if case == WindowBeyondBounds {
        let mw = b.ctx.alloc_mw(b.pd, MwType::Type1).unwrap();
        let bind = BindWr {
            mw_rkey: mw,
            new_key: 7,
            info: BindInfo {
                mr_lkey: rb.lkey,
                addr: rb.iova + 1024,
                length: 1024,
                access: A::REMOTE_WRITE,
            },
        };
        let mut wr = SendWr::new(99, O::BindMw);
        wr.bind = Some(bind);
        b.ctx.post_send(b.qp, &[wr]).unwrap();
        drive_until_idle(&[&a.ctx, &b.ctx]);
        let w = drain(&b);
        assert_eq!(w[0].status, S::Success, "bind");
        rkey = (mw & !0xff) | 7;
        raddr = rb.iova + 1024 + 512; // 1024 bytes from here overrun the window by 512
    }
    let recv_sges = match case {
        SendRecvTooSmall => vec![Sge {
            addr: rb.iova,
            length: 100,
            lkey: rb.lkey,
        }],
        _ => vec![Sge {
            addr: rb.iova,
            length: 4096,
            lkey: rb.lkey,
        }],
    };
    b.ctx
        .post_recv(
            b.qp,
            &[RecvWr {
                wr_id: 500,
                sg_list: recv_sges,
            }],
        )
        .unwrap();
    let wr = match case {
        WriteBadRkey => SendWr::new(1, O::RdmaWrite)
            .sge(la.iova, 1024, la.lkey)
            .remote(raddr, rkey ^ 0x100),
        WriteOutOfRange => SendWr::new(1, O::RdmaWrite)
            .sge(la.iova, 1024, la.lkey)
            .remote(raddr + 8000, rkey),
        WriteImmBadRkey => SendWr::new(1, O::RdmaWriteWithImm)
            .sge(la.iova, 100, la.lkey)
            .remote(raddr, rkey ^ 0x100),
        WriteNoRemoteWriteOnMr
        | WriteWrongPd
        | WriteQpLacksRemoteWrite
        | DeregisteredRkey
        | WindowBeyondBounds => SendWr::new(1, O::RdmaWrite)
            .sge(la.iova, 1024, la.lkey)
            .remote(raddr, rkey),
        ReadNoRemoteReadOnMr | ReadQpLacksRemoteRead => SendWr::new(1, O::RdmaRead)
            .sge(la.iova, 1024, la.lkey)
            .remote(raddr, rkey),
        ReadDestNoLocalWrite => SendWr::new(1, O::RdmaRead)
            .sge(la_ro.iova, 64, la_ro.lkey)
            .remote(raddr, rkey),
        AtomicNoRemoteAtomicOnMr | AtomicQpLacksRemoteAtomic => {
            SendWr::new(1, O::AtomicFetchAndAdd)
                .sge(la.iova, 8, la.lkey)
                .remote(raddr, rkey)
        }
        AtomicResultNoLocalWrite => SendWr::new(1, O::AtomicFetchAndAdd)
            .sge(la_ro.iova, 8, la_ro.lkey)
            .remote(raddr, rkey),
        SendBadGatherLkey => SendWr::new(1, O::Send).sge(la.iova, 100, la.lkey ^ 0x100),
        SendGatherOutOfRange => SendWr::new(1, O::Send).sge(la.iova + 8000, 1000, la.lkey),
        SendRecvTooSmall | SendRecvNoLocalWrite => {
            SendWr::new(1, O::Send).sge(la.iova, 1000, la.lkey)
        }
        LocalInvOrdinaryMr => {
            let mut w = SendWr::new(1, O::LocalInv);
            w.invalidate_rkey = la.lkey;
            w
        }
        SendWithInvOrdinaryMr => {
            let mut w = SendWr::new(1, O::SendWithInv).sge(la.iova, 10, la.lkey);
            w.invalidate_rkey = rb.rkey;
            w
        }
    };
    a.ctx.post_send(a.qp, &[wr]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut wa = Vec::new();
    while wa.is_empty() {
        drive_until_idle(&[&a.ctx, &b.ctx]);
        wa = drain(&a);
        assert!(
            Instant::now() < deadline,
            "{case:?}: no requester completion"
        );
    }
    drive_until_idle(&[&a.ctx, &b.ctx]);
    let wb = drain(&b);
    let recv = wb.iter().find(|w| w.wr_id == 500).map(|w| w.status);
    let out = (
        wa[0].status,
        recv,
        a.ctx.qp_state(a.qp).unwrap(),
        b.ctx.qp_state(b.qp).unwrap(),
    );
    drop(dst);
    drop(small);
    out
}

#[test]
fn violation_table_both_models() {
    use Case::*;
    use QpState::{Err as E, Rts};
    use StatusModel::{Hardware as H, Rxe as R};
    let fl = Some(S::WrFlushErr);
    #[rustfmt::skip]
    let table: &[(Case, StatusModel, Outcome)] = &[
        (WriteBadRkey, H, (S::RemAccessErr, fl, E, E)),
        (WriteBadRkey, R, (S::RemAccessErr, fl, E, E)),
        (WriteNoRemoteWriteOnMr, H, (S::RemAccessErr, fl, E, E)),
        (WriteOutOfRange, H, (S::RemAccessErr, fl, E, E)),
        (WriteWrongPd, H, (S::RemAccessErr, fl, E, E)),
        (DeregisteredRkey, H, (S::RemAccessErr, fl, E, E)),
        (WindowBeyondBounds, H, (S::RemAccessErr, fl, E, E)),
        (WriteQpLacksRemoteWrite, H, (S::RemInvReqErr, fl, E, E)),
        (WriteQpLacksRemoteWrite, R, (S::RemInvReqErr, fl, E, E)),
        (WriteImmBadRkey, H, (S::RemAccessErr, Some(S::RemAccessErr), E, E)),
        (ReadNoRemoteReadOnMr, H, (S::RemAccessErr, fl, E, E)),
        (ReadQpLacksRemoteRead, H, (S::RemInvReqErr, fl, E, E)),
        (ReadDestNoLocalWrite, H, (S::LocProtErr, None, E, Rts)),
        (ReadDestNoLocalWrite, R, (S::LocProtErr, None, E, Rts)),
        (AtomicNoRemoteAtomicOnMr, H, (S::RemAccessErr, fl, E, E)),
        (AtomicQpLacksRemoteAtomic, H, (S::RemInvReqErr, fl, E, E)),
        (AtomicResultNoLocalWrite, H, (S::LocProtErr, None, E, Rts)),
        (SendBadGatherLkey, H, (S::LocProtErr, None, E, Rts)),
        (SendBadGatherLkey, R, (S::LocQpOpErr, None, E, Rts)),
        (SendGatherOutOfRange, H, (S::LocProtErr, None, E, Rts)),
        (SendGatherOutOfRange, R, (S::LocQpOpErr, None, E, Rts)),
        (SendRecvTooSmall, H, (S::RemInvReqErr, Some(S::LocLenErr), E, E)),
        (SendRecvTooSmall, R, (S::RemOpErr, Some(S::LocQpOpErr), E, E)),
        (SendRecvNoLocalWrite, H, (S::RemOpErr, Some(S::LocProtErr), E, E)),
        (SendRecvNoLocalWrite, R, (S::RemOpErr, Some(S::LocQpOpErr), E, E)),
        (LocalInvOrdinaryMr, H, (S::LocQpOpErr, None, E, Rts)),
        (SendWithInvOrdinaryMr, H, (S::Success, Some(S::RemInvReqErr), Rts, E)),
    ];
    for &(case, model, want) in table {
        let got = scenario(model, case);
        assert_eq!(got, want, "{case:?} under {model:?}");
    }
}

#[test]
fn misaligned_atomic_is_einval_at_post_and_flush_after_error() {
    let a = side(StatusModel::Hardware);
    let b = side(StatusModel::Hardware);
    connect(&a, &b, A::REMOTE_WRITE, 3);
    let buf = vec![0u8; 4096];
    let m = a
        .ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            a.pd,
            unsafe { mrkit_soft::UserMemory::new(buf.as_ptr() as u64, 4096) },
            A::LOCAL_WRITE,
        )
        .unwrap();
    let ok = SendWr::new(1, O::RdmaWrite)
        .sge(m.iova, 8, m.lkey)
        .remote(0x1000, 0x1234);
    let bad = SendWr::new(2, O::AtomicFetchAndAdd)
        .sge(m.iova, 8, m.lkey)
        .remote(0x1004, 0x1234);
    let e = a.ctx.post_send(a.qp, &[ok.clone(), bad]).unwrap_err();
    assert_eq!((e.bad_wr, e.error.errno()), (1, Errno::EINVAL));
    // The first WR was posted; its bad rkey fails; then two more flush.
    a.ctx.post_send(a.qp, &[ok.clone(), ok.clone()]).unwrap();
    b.ctx
        .post_recv(
            b.qp,
            &[RecvWr {
                wr_id: 9,
                sg_list: vec![],
            }],
        )
        .unwrap();
    drive_until_idle(&[&a.ctx, &b.ctx]);
    let st: Vec<S> = drain(&a).iter().map(|w| w.status).collect();
    assert_eq!(st, vec![S::RemAccessErr, S::WrFlushErr, S::WrFlushErr]);
    assert_eq!(b.ctx.qp_state(b.qp).unwrap(), QpState::Err);
    assert_eq!(
        drain(&b).iter().map(|w| w.status).collect::<Vec<_>>(),
        vec![S::WrFlushErr]
    );
    // Posting in ERR: accepted, flushed at once (unsignaled too).
    a.ctx.post_send(a.qp, &[ok.flags(0)]).unwrap();
    drive_until_idle(&[&a.ctx, &b.ctx]);
    assert_eq!(drain(&a)[0].status, S::WrFlushErr);
    // Posting in RESET/INIT/RTR → EINVAL.
    let (q2, _) = a.ctx.create_qp(init(a.pd, a.cq, false)).unwrap();
    let e = a.ctx.post_send(q2, &[SendWr::new(1, O::Send)]).unwrap_err();
    assert_eq!(e.error.errno(), Errno::EINVAL);
    let e = a.ctx.post_recv(q2, &[RecvWr::default()]).unwrap_err();
    assert_eq!(e.error.errno(), Errno::EINVAL);
    // Too many SGEs / SQ full.
    let mut many = SendWr::new(1, O::Send);
    for _ in 0..5 {
        many = many.sge(m.iova, 1, m.lkey);
    }
    assert_eq!(
        a.ctx.post_send(a.qp, &[many]).unwrap_err().error.errno(),
        Errno::EINVAL
    );
    assert_eq!(a.ctx.destroy_cq(a.cq).unwrap_err().errno(), Errno::EBUSY);
}
