//! CQ overflow/resize, completion channels and solicited arming, SQD drain event, RNR retry
//! exhaustion, signaled/unsignaled completions per opcode and FENCE.
mod common;

use std::time::Duration;

use common::*;
use mrkit_soft::cq::{WcOpcode, WcStatus};
use mrkit_soft::mw::{BindInfo, MwType};
use mrkit_soft::progress::AsyncEvent;
use mrkit_soft::qp::{attr_mask as m, send_flags as f, BindWr, QpAttr, QpState, SendWr, WrOpcode};
use mrkit_soft::{AccessFlags as A, Context, Errno, MrInfo};

fn write(wr_id: u64, l: &mrkit_soft::MrInfo, r: &mrkit_soft::MrInfo, len: u32) -> SendWr {
    SendWr::new(wr_id, WrOpcode::RdmaWrite)
        .sge(l.iova, len, l.lkey)
        .remote(r.iova, r.rkey)
}

#[test]
fn cq_overflow_moves_qp_to_err_and_raises_cq_err() {
    let a = host_with(ctx(true), 2, true);
    let b = host_with(ctx(true), 16, false);
    connect(&a, &b, all(), 3);
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let (_sb, sm) = unsafe { buf_mr(&a, 1, 64) };
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let (_rb, rm) = unsafe { buf_mr(&b, 0, 64) };
    let wrs: Vec<_> = (0..3).map(|i| write(i, &sm, &rm, 8)).collect();
    a.ctx.post_send(a.qp, &wrs).unwrap();
    drive(&a, &b);
    // Two fit; the third overflows: CQ in error, CQ_ERR + QP_FATAL, QP → ERR.
    assert!(a.ctx.cq_overflowed(a.cq).unwrap());
    assert_eq!(a.ctx.qp_state(a.qp).unwrap(), QpState::Err);
    let ev = events(&a.ctx);
    assert!(ev.contains(&AsyncEvent::CqErr { cqn: a.cq }), "{ev:?}");
    assert!(ev.contains(&AsyncEvent::QpFatal { qpn: a.qp }), "{ev:?}");
    // The completions already queued stay pollable, with their statuses.
    let w = drain(&a);
    assert_eq!(
        w.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(0, WcStatus::Success), (1, WcStatus::Success)]
    );
    // An overflowed CQ stays in error: later completions are lost.
    a.ctx.post_send(a.qp, &[write(9, &sm, &rm, 8)]).unwrap();
    drive(&a, &b);
    assert!(drain(&a).is_empty());
}

#[test]
fn resize_cq_grow_shrink_and_einval_below_entries() {
    let (a, b) = pair();
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let (_sb, sm) = unsafe { buf_mr(&a, 1, 64) };
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let (_rb, rm) = unsafe { buf_mr(&b, 0, 64) };
    let max = a.ctx.query_device().max_cqe;
    a.ctx.resize_cq(a.cq, 4).unwrap();
    assert_eq!(a.ctx.cq_len(a.cq).unwrap(), (0, 4));
    for e in [0, max + 1] {
        assert_eq!(a.ctx.resize_cq(a.cq, e).unwrap_err().errno(), Errno::EINVAL);
    }
    assert_eq!(
        a.ctx.resize_cq(a.cq + 100, 8).unwrap_err().errno(),
        Errno::EINVAL
    );
    let wrs: Vec<_> = (0..3).map(|i| write(i, &sm, &rm, 8)).collect();
    a.ctx.post_send(a.qp, &wrs).unwrap();
    drive(&a, &b);
    assert_eq!(a.ctx.cq_len(a.cq).unwrap(), (3, 4));
    assert_eq!(a.ctx.resize_cq(a.cq, 2).unwrap_err().errno(), Errno::EINVAL);
    a.ctx.resize_cq(a.cq, 3).unwrap(); // exactly the entries present
    assert_eq!(a.ctx.cq_len(a.cq).unwrap(), (3, 3));
    a.ctx.resize_cq(a.cq, 64).unwrap(); // grow
    let wrs: Vec<_> = (3..40).map(|i| write(i, &sm, &rm, 8)).collect();
    a.ctx.post_send(a.qp, &wrs).unwrap();
    drive(&a, &b);
    let w = drain(&a);
    assert_eq!(w.len(), 40);
    assert!(w
        .iter()
        .enumerate()
        .all(|(i, w)| w.wr_id == i as u64 && w.status == WcStatus::Success));
    assert!(!a.ctx.cq_overflowed(a.cq).unwrap());
    assert_eq!(a.ctx.qp_state(a.qp).unwrap(), QpState::Rts);
}

/// a → b connected, b's CQ on a completion channel (returned): a 64-byte buffer of 3s
/// registered on a (its MR returned), four 64-byte receives posted on b. The buffers are
/// returned too: keep them alive while the hosts are used.
fn chan_pair() -> (Host, Host, u32, MrInfo, [Vec<u8>; 2]) {
    let a = host_with(ctx(true), 64, true);
    let bc = ctx(true);
    let pd = bc.alloc_pd().unwrap();
    let ch = bc.create_comp_channel();
    let cq = bc.create_cq(64, Some(ch)).unwrap();
    let (qp, _) = bc.create_qp(init(pd, cq, false)).unwrap();
    let b = Host {
        ctx: bc,
        pd,
        cq,
        qp,
    };
    connect(&a, &b, all(), 3);
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let (sb, sm) = unsafe { buf_mr(&a, 3, 64) };
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let (rb, rm) = unsafe { buf_mr(&b, 0, 1024) };
    let recvs: Vec<_> = (0..4).map(|i| recv_wr(i, &rm, i * 64, 64)).collect();
    b.ctx.post_recv(b.qp, &recvs).unwrap();
    (a, b, ch, sm, [sb, rb])
}

/// The CQ whose event arrives on completion channel `ch` of `h` within `wait`, if any.
fn cq_event(h: &Host, ch: u32, wait: Duration) -> Option<u32> {
    h.ctx.get_cq_event(ch, Some(wait)).unwrap()
}

fn send(a: &Host, mr: &mrkit_soft::MrInfo, wr_id: u64, flags: u32) {
    a.ctx
        .post_send(
            a.qp,
            &[SendWr::new(wr_id, WrOpcode::Send)
                .sge(mr.iova, 16, mr.lkey)
                .flags(flags)],
        )
        .unwrap();
}

#[test]
fn comp_channel_blocking_wait_and_rearm() {
    let (a, b, ch, sm, _bufs) = chan_pair();
    assert_eq!(
        b.ctx.get_cq_event(ch + 5, None).unwrap_err().errno(),
        Errno::EINVAL
    );
    b.ctx.req_notify_cq(b.cq, false).unwrap();
    // Block in get_cq_event while another thread moves the message.
    let (actx, bctx) = (a.ctx.clone(), b.ctx.clone());
    let (aqp, smc) = (a.qp, sm.clone());
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        actx.post_send(
            aqp,
            &[SendWr::new(1, WrOpcode::Send).sge(smc.iova, 16, smc.lkey)],
        )
        .unwrap();
        mrkit_soft::driver::loopback::drive_until_idle(&[&actx, &bctx]);
    });
    let got = cq_event(&b, ch, Duration::from_secs(10));
    t.join().unwrap();
    assert_eq!(got, Some(b.cq));
    assert_eq!(drain(&b).len(), 1);
    // One-shot: without re-arming, the next completion posts no event.
    send(&a, &sm, 2, f::SIGNALED);
    drive(&a, &b);
    assert_eq!(cq_event(&b, ch, Duration::from_millis(20)), None);
    assert_eq!(drain(&b).len(), 1);
    // Re-armed: fires again.
    b.ctx.req_notify_cq(b.cq, false).unwrap();
    send(&a, &sm, 3, f::SIGNALED);
    drive(&a, &b);
    assert_eq!(cq_event(&b, ch, Duration::from_secs(1)), Some(b.cq));
}

#[test]
fn solicited_only_arm_ignores_unsolicited_send() {
    let (a, b, ch, sm, _bufs) = chan_pair();
    b.ctx.req_notify_cq(b.cq, true).unwrap();
    send(&a, &sm, 1, f::SIGNALED);
    drive(&a, &b);
    assert_eq!(drain(&b).len(), 1, "the message arrived");
    assert_eq!(
        cq_event(&b, ch, Duration::from_millis(20)),
        None,
        "an unsolicited SEND does not wake a solicited-only arm"
    );
    send(&a, &sm, 2, f::SIGNALED | f::SOLICITED);
    drive(&a, &b);
    assert_eq!(cq_event(&b, ch, Duration::from_secs(1)), Some(b.cq));
    let w = drain(&b);
    assert_eq!((w[0].wr_id, w[0].status), (1, WcStatus::Success));
    // Disarmed after firing: another solicited SEND posts nothing.
    send(&a, &sm, 3, f::SIGNALED | f::SOLICITED);
    drive(&a, &b);
    assert_eq!(cq_event(&b, ch, Duration::from_millis(20)), None);
}

#[test]
fn sqd_drain_raises_sq_drained() {
    let (a, b) = pair();
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let (_sb, sm) = unsafe { buf_mr(&a, 1, 8192) };
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let (rb, rm) = unsafe { buf_mr(&b, 0, 8192) };
    a.ctx.post_send(a.qp, &[write(1, &sm, &rm, 4096)]).unwrap();
    a.ctx.progress_once(std::time::Instant::now()); // WRITE 1 in flight
    let at = QpAttr {
        qp_state: QpState::Sqd as u32,
        en_sqd_async_notify: true,
        ..QpAttr::default()
    };
    a.ctx
        .modify_qp(a.qp, &at, m::STATE | m::EN_SQD_ASYNC_NOTIFY)
        .unwrap();
    assert_eq!(a.ctx.qp_state(a.qp).unwrap(), QpState::Sqd);
    // A WR posted in SQD waits; the one in flight finishes, then SQ_DRAINED.
    let w2 = SendWr::new(2, WrOpcode::RdmaWrite)
        .sge(sm.iova + 4096, 4096, sm.lkey)
        .remote(rm.iova + 4096, rm.rkey)
        .flags(f::SIGNALED);
    a.ctx.post_send(a.qp, &[w2]).unwrap();
    drive(&a, &b);
    assert_eq!(events(&a.ctx), vec![AsyncEvent::SqDrained { qpn: a.qp }]);
    assert!(rb[..4096].iter().all(|&x| x == 1));
    assert!(rb[4096..].iter().all(|&x| x == 0), "WR posted in SQD waits");
    drive(&a, &b);
    assert!(events(&a.ctx).is_empty(), "raised once");
    // Back to RTS: the waiting WR goes.
    let at = QpAttr {
        qp_state: QpState::Rts as u32,
        ..QpAttr::default()
    };
    a.ctx.modify_qp(a.qp, &at, m::STATE).unwrap();
    drive(&a, &b);
    assert!(rb.iter().all(|&x| x == 1));
    let w = drain(&a);
    assert_eq!(
        w.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    assert_eq!(a.ctx.qp_state(a.qp).unwrap(), QpState::Rts);
}

/// Connect with explicit rnr_retry (and min_rnr_timer 0.01 ms on the responder, the
/// default), path MTU 1024.
fn connect_rnr(a: &Host, b: &Host, rnr_retry: u8) {
    use mrkit_soft::qp::connect::{connect_qp, ConnectOpts, RemoteQp};
    for (c, q, node, qpn) in [
        (&a.ctx, a.qp, b.ctx.node_id(), b.qp),
        (&b.ctx, b.qp, a.ctx.node_id(), a.qp),
    ] {
        let remote = RemoteQp {
            qpn,
            psn: 0,
            ip: None,
            node,
        };
        let opts = ConnectOpts {
            access: all(),
            path_mtu: 3,
            rnr_retry,
            ..ConnectOpts::default()
        };
        connect_qp(c, q, remote, opts).unwrap();
    }
}

#[test]
fn rnr_retry_exhausted_gives_rnr_retry_exc_err() {
    for rnr_retry in [0u8, 2] {
        let a = host_with(ctx(true), 64, true);
        let b = host_with(ctx(true), 64, true);
        connect_rnr(&a, &b, rnr_retry);
        let mut sb = vec![1u8; 64];
        // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
        let sm = unsafe { reg(&a, &mut sb) };
        send(&a, &sm, 1, f::SIGNALED);
        send(&a, &sm, 2, f::SIGNALED);
        drive_until(&[&a.ctx, &b.ctx], || a.ctx.cq_len(a.cq).unwrap().0 == 2);
        let w = drain(&a);
        assert_eq!(
            w.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
            vec![(1, WcStatus::RnrRetryExcErr), (2, WcStatus::WrFlushErr)],
            "rnr_retry {rnr_retry}"
        );
        assert_eq!(a.ctx.qp_state(a.qp).unwrap(), QpState::Err);
        assert_eq!(b.ctx.qp_state(b.qp).unwrap(), QpState::Rts);
    }
}

/// Every opcode posted unsignaled then signaled (sq_sig_all off): only the signaled WR
/// completes, with the right opcode; an unsignaled WR that fails still completes.
#[test]
fn every_opcode_signaled_vs_unsignaled() {
    let (a, b) = pair();
    let mut sb = vec![5u8; 4096];
    let mut rb = vec![0u8; 4096];
    let sm = a
        .ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            a.pd,
            unsafe { mrkit_soft::UserMemory::new(sb.as_mut_ptr() as u64, 4096) },
            all() | A::MW_BIND,
        )
        .unwrap();
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let rm = unsafe { reg(&b, &mut rb) };
    let recvs: Vec<_> = (0..16).map(|i| recv_wr(1000 + i, &rm, 2048, 64)).collect();
    b.ctx.post_recv(b.qp, &recvs).unwrap();
    // A type-2 window on a's side for LOCAL_INV / BIND_MW / SEND_WITH_INV.
    let mw = a.ctx.alloc_mw(a.pd, MwType::Type2).unwrap();
    let bind = |key: u8| {
        let mut wr = SendWr::new(0, WrOpcode::BindMw);
        wr.bind = Some(BindWr {
            mw_rkey: if key == 8 { (mw & !0xff) | 7 } else { mw },
            new_key: key,
            info: BindInfo {
                mr_lkey: sm.lkey,
                addr: sm.iova,
                length: 64,
                access: A::REMOTE_READ,
            },
        });
        wr
    };
    let key = |k: u8| (mw & !0xff) | u32::from(k);
    let mut wcs_expected = 0;
    for (n, op) in [
        WrOpcode::RdmaWrite,
        WrOpcode::RdmaWriteWithImm,
        WrOpcode::Send,
        WrOpcode::SendWithImm,
        WrOpcode::RdmaRead,
        WrOpcode::AtomicCmpAndSwp,
        WrOpcode::AtomicFetchAndAdd,
        WrOpcode::BindMw,
        WrOpcode::LocalInv,
        WrOpcode::SendWithInv,
    ]
    .into_iter()
    .enumerate()
    {
        let mk = |wr_id: u64, k: u8| -> SendWr {
            let mut wr = match op {
                WrOpcode::BindMw => bind(k),
                WrOpcode::LocalInv => {
                    let mut w = SendWr::new(0, op);
                    w.invalidate_rkey = key(k);
                    w
                }
                WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => SendWr::new(0, op)
                    .sge(sm.iova + 1024, 8, sm.lkey)
                    .remote(rm.iova, rm.rkey),
                WrOpcode::RdmaRead => SendWr::new(0, op)
                    .sge(sm.iova + 512, 64, sm.lkey)
                    .remote(rm.iova, rm.rkey),
                _ => SendWr::new(0, op)
                    .sge(sm.iova, 64, sm.lkey)
                    .remote(rm.iova, rm.rkey),
            };
            wr.wr_id = wr_id;
            wr
        };
        let base = n as u64 * 10;
        let (w1, w2) = match op {
            // Bind key 7 then invalidate it, rebind key 8 then invalidate it.
            WrOpcode::BindMw => (mk(base, 7), mk(base + 1, 8)),
            WrOpcode::LocalInv => (mk(base, 8), mk(base + 1, 8)),
            _ => (mk(base, 0), mk(base + 1, 0)),
        };
        if op == WrOpcode::BindMw {
            // bind(7) unsignaled, LOCAL_INV(7) unsignaled, then the signaled bind(8).
            let mut inv = SendWr::new(base + 5, WrOpcode::LocalInv).flags(0);
            inv.invalidate_rkey = key(7);
            a.ctx
                .post_send(a.qp, &[w1.flags(0), inv, w2.flags(f::SIGNALED)])
                .unwrap();
        } else if op == WrOpcode::SendWithInv {
            // The rkey is not invalidatable on b: b's receive fails (class J) and b → ERR, so
            // only one (signaled) WR; the sender is ACKed (datapath_violations covers b's side).
            a.ctx.post_send(a.qp, &[w2.flags(f::SIGNALED)]).unwrap();
        } else if op == WrOpcode::LocalInv {
            // LOCAL_INV(8) signaled; then an unsignaled failing one (already invalid) completes
            // in error anyway (and moves the QP to ERR: last in the list).
            a.ctx.post_send(a.qp, &[w1.flags(f::SIGNALED)]).unwrap();
        } else {
            a.ctx
                .post_send(a.qp, &[w1.flags(0), w2.flags(f::SIGNALED)])
                .unwrap();
        }
        drive(&a, &b);
        let w = drain(&a);
        let expect_id = if op == WrOpcode::LocalInv {
            base
        } else {
            base + 1
        };
        assert_eq!(w.len(), 1, "{op:?}: {w:?}");
        assert_eq!(
            (w[0].wr_id, w[0].status, w[0].opcode),
            (expect_id, WcStatus::Success, op_wc(op)),
            "{op:?}"
        );
        wcs_expected += 1;
        if op == WrOpcode::SendWithInv {
            // The receiver invalidated nothing valid → its receive completes in error (class J);
            // that is the responder's business; the sender is ACKed.
        }
    }
    assert_eq!(wcs_expected, 10);
    // An unsignaled WR that fails still produces a completion.
    let mut bad = SendWr::new(77, WrOpcode::LocalInv).flags(0);
    bad.invalidate_rkey = key(8);
    a.ctx.post_send(a.qp, &[bad]).unwrap();
    drive(&a, &b);
    let w = drain(&a);
    assert_eq!((w[0].wr_id, w[0].status), (77, WcStatus::LocQpOpErr));
}

fn op_wc(op: WrOpcode) -> WcOpcode {
    match op {
        WrOpcode::Send | WrOpcode::SendWithImm | WrOpcode::SendWithInv => WcOpcode::Send,
        WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm => WcOpcode::RdmaWrite,
        WrOpcode::RdmaRead => WcOpcode::RdmaRead,
        WrOpcode::AtomicCmpAndSwp => WcOpcode::CompSwap,
        WrOpcode::AtomicFetchAndAdd => WcOpcode::FetchAdd,
        WrOpcode::LocalInv => WcOpcode::LocalInv,
        WrOpcode::BindMw => WcOpcode::BindMw,
    }
}

/// FENCE: a WRITE posted after a READ of the same remote bytes does not start before the READ
/// completed, so the READ returns the old bytes. Also for an atomic before a fenced WRITE.
#[test]
fn fence_waits_for_preceding_read_and_atomic() {
    let (a, b) = pair();
    let mut sb = vec![0xBBu8; 65536];
    let mut back = vec![0u8; 65536];
    let mut rb = vec![0xAAu8; 65536];
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let (sm, bm, rm) = (
        unsafe { reg(&a, &mut sb) },
        unsafe { reg(&a, &mut back) },
        unsafe { reg(&b, &mut rb) },
    );
    let read = SendWr::new(1, WrOpcode::RdmaRead)
        .sge(bm.iova, 65536, bm.lkey)
        .remote(rm.iova, rm.rkey);
    let w = write(2, &sm, &rm, 65536).flags(f::SIGNALED | f::FENCE);
    a.ctx.post_send(a.qp, &[read, w]).unwrap();
    // One requester run: only the READ request leaves (the fenced WRITE waits).
    a.ctx.progress_once(std::time::Instant::now());
    b.ctx.progress_once(std::time::Instant::now());
    assert!(rb.iter().all(|&x| x == 0xAA), "fenced WRITE started early");
    drive(&a, &b);
    let wc = drain(&a);
    assert_eq!(
        wc.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    assert!(back.iter().all(|&x| x == 0xAA), "READ saw the old bytes");
    assert!(rb.iter().all(|&x| x == 0xBB));
    // Atomic then fenced WRITE of the same word.
    let mut fa = SendWr::new(3, WrOpcode::AtomicFetchAndAdd)
        .sge(bm.iova, 8, bm.lkey)
        .remote(rm.iova, rm.rkey);
    fa.compare_add = 1;
    let w = write(4, &sm, &rm, 8).flags(f::SIGNALED | f::FENCE);
    sb[..8].copy_from_slice(&7u64.to_ne_bytes());
    a.ctx.post_send(a.qp, &[fa, w]).unwrap();
    drive(&a, &b);
    assert_eq!(drain(&a).len(), 2);
    assert_eq!(
        u64::from_ne_bytes(back[..8].try_into().unwrap()),
        u64::from_ne_bytes([0xBB; 8])
    );
    assert_eq!(u64::from_ne_bytes(rb[..8].try_into().unwrap()), 7);
    let _ = Context::node_id;
}

/// Latency fast path (background thread running): a spinning `poll_cq` plus the inline
/// requester complete many small WRITEs; every completion arrives, in order.
#[test]
fn spinning_poll_completes_writes_with_the_fast_path() {
    let a = host_with(ctx(false), 64, true);
    let b = host_with(ctx(false), 64, false);
    connect(&a, &b, all(), 5);
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let (_sb, sm) = unsafe { buf_mr(&a, 0, 4096) };
    // SAFETY: the buffer outlives every work request over it; no other peer knows the keys.
    let (_rb, rm) = unsafe { buf_mr(&b, 0, 4096) };
    let mut v = Vec::new();
    for i in 0..2000u64 {
        let off = (i % 512) * 8;
        let wr = SendWr::new(i, WrOpcode::RdmaWrite)
            .sge(sm.iova + off, 8, sm.lkey)
            .remote(rm.iova + off, rm.rkey);
        a.ctx.post_send(a.qp, &[wr]).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        v.clear();
        while a.ctx.poll_cq(a.cq, &mut v, 1).unwrap() == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "WRITE {i} did not complete"
            );
        }
        assert_eq!((v[0].wr_id, v[0].status), (i, WcStatus::Success));
    }
}

/// Coalesced placement never merges overlapping source/destination runs: a multi-packet
/// WRITE from an MR into itself, shifted forward by 100 bytes, gives exactly the result of
/// placing its packets one after the other (MTU 1024).
#[test]
fn overlapping_self_write_matches_packetwise_placement() {
    let c = ctx(true);
    let pd = c.alloc_pd().unwrap();
    let cq = c.create_cq(16, None).unwrap();
    let (q1, _) = c.create_qp(init(pd, cq, true)).unwrap();
    let (q2, _) = c.create_qp(init(pd, cq, true)).unwrap();
    mrkit_soft::qp::rc_connect(&c, q1, &c, q2, all(), 3).unwrap();
    let mut buf: Vec<u8> = (0..16384u32).map(|i| (i * 7 % 251) as u8).collect();
    let mut model = buf.clone();
    let m = c
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(buf.as_mut_ptr() as u64, buf.len() as u64) },
            all(),
        )
        .unwrap();
    let len = 8192usize;
    let wr = SendWr::new(1, WrOpcode::RdmaWrite)
        .sge(m.iova, len as u32, m.lkey)
        .remote(m.iova + 100, m.rkey);
    c.post_send(q1, &[wr]).unwrap();
    mrkit_soft::driver::loopback::drive_until_idle(&[&c]);
    let mut v = Vec::new();
    c.poll_cq(cq, &mut v, 4).unwrap();
    assert_eq!(v[0].status, WcStatus::Success);
    for k in 0..len / 1024 {
        let src = model[k * 1024..(k + 1) * 1024].to_vec();
        model[100 + k * 1024..100 + (k + 1) * 1024].copy_from_slice(&src);
    }
    c.dereg_mr(m.lkey).unwrap();
    assert!(
        buf == model,
        "overlapping placement differs from packet order"
    );
}
