//! Delayed ACKs on the UDP link (`fastpath::ACK_DELAY_MAX`): a plain ACK an application
//! progress pass holds back leaves within the bound even if the application never sends
//! again, and at once when the QP is destroyed or the device closed. Deterministic: manual
//! progress, and the application's passes get an injected `now`.
mod common;

use std::time::{Duration, Instant};

use common::{all, connect_udp, ctx_with, host_with_cap, BufHost};
use mrkit_soft::cq::{Wc, WcOpcode, WcStatus};
use mrkit_soft::fastpath::ACK_DELAY_MAX;
use mrkit_soft::qp::connect::ConnectOpts;
use mrkit_soft::qp::{attr_mask, QpAttr, QpCap, QpState, RecvWr, SendWr, WrOpcode};
use mrkit_soft::DeviceConfig;

fn host() -> BufHost {
    host_with_cap(
        ctx_with(DeviceConfig::rxe().delayed_acks(true), true),
        64,
        QpCap::default(),
        false,
    )
    .with_buf(4096, all())
}

fn pair() -> (BufHost, BufHost) {
    let a = host();
    let b = host();
    connect_udp(&a, &b, ConnectOpts::default());
    (a, b)
}

fn tx(h: &BufHost) -> u64 {
    h.ctx.net_stats().tx_datagrams
}

/// Run `pass` until `h`'s CQ yields a completion (packets take a moment to cross the sockets).
fn until_wc(h: &BufHost, mut pass: impl FnMut()) -> Wc {
    let end = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    while Instant::now() < end {
        pass();
        h.ctx.poll_cq(h.cq, &mut out, 1).unwrap();
        if let Some(wc) = out.pop() {
            return wc;
        }
        std::thread::yield_now();
    }
    panic!("no completion within 10 s: {:?}", h.ctx.net_stats());
}

/// `a` SENDs 8 bytes to `b`, whose application pass (at `t0`) receives it.
fn send_one(a: &BufHost, b: &BufHost, t0: Instant) {
    b.ctx
        .post_recv(
            b.qp,
            &[RecvWr {
                wr_id: 7,
                sg_list: b.sge(0, 64),
            }],
        )
        .unwrap();
    let mut s = SendWr::new(1, WrOpcode::Send);
    s.sg_list = a.sge(0, 8);
    a.ctx.post_send(a.qp, &[s]).unwrap();
    a.ctx.progress_once(Instant::now());
    let wc = until_wc(b, || {
        b.ctx.progress_once_as_app(t0);
    });
    assert_eq!((wc.status, wc.opcode), (WcStatus::Success, WcOpcode::Recv));
}

/// As [`send_one`], and `b` holds the ACK.
fn send_and_hold(a: &BufHost, b: &BufHost, t0: Instant) {
    send_one(a, b, t0);
    assert_eq!(b.ctx.held_ack_count(), 1, "the ACK is held back");
}

fn send_completes(a: &BufHost) {
    let wc = until_wc(a, || {
        a.ctx.progress_once(Instant::now());
    });
    assert_eq!((wc.status, wc.opcode), (WcStatus::Success, WcOpcode::Send));
}

#[test]
fn held_ack_leaves_within_the_bound_when_the_application_stops_sending() {
    let (a, b) = pair();
    let t0 = Instant::now();
    send_and_hold(&a, &b, t0);
    let sent = tx(&b);
    // Younger than the bound: still held.
    b.ctx
        .progress_once_as_app(t0 + ACK_DELAY_MAX - Duration::from_micros(1));
    assert_eq!(b.ctx.held_ack_count(), 1);
    assert_eq!(tx(&b), sent);
    // The first application pass at the bound sends it, though the application sends nothing.
    b.ctx.progress_once_as_app(t0 + ACK_DELAY_MAX);
    assert_eq!(b.ctx.held_ack_count(), 0);
    assert_eq!(tx(&b), sent + 1);
    send_completes(&a);

    // That ACK waited for nothing (b never answered): b's next ACKs on this QP leave at once.
    send_one(&a, &b, t0 + 2 * ACK_DELAY_MAX);
    assert_eq!(
        b.ctx.held_ack_count(),
        0,
        "not held after one that waited in vain"
    );
    assert_eq!(tx(&b), sent + 2);
    send_completes(&a);
}

#[test]
fn held_ack_leaves_with_the_next_send() {
    let (a, b) = pair();
    a.ctx
        .post_recv(
            a.qp,
            &[RecvWr {
                wr_id: 8,
                sg_list: a.sge(64, 64),
            }],
        )
        .unwrap();
    let t0 = Instant::now();
    send_and_hold(&a, &b, t0);
    let sent = tx(&b);
    // b replies: its SEND and the held ACK leave together (one GSO send: two datagrams).
    let mut s = SendWr::new(2, WrOpcode::Send);
    s.sg_list = b.sge(0, 8);
    b.ctx.post_send(b.qp, &[s]).unwrap();
    b.ctx.progress_once_as_app(t0);
    assert_eq!(b.ctx.held_ack_count(), 0);
    assert_eq!(tx(&b), sent + 2);
    let mut got = Vec::new();
    let end = Instant::now() + Duration::from_secs(10);
    while got.len() < 2 && Instant::now() < end {
        a.ctx.progress_once(Instant::now());
        a.ctx.poll_cq(a.cq, &mut got, 2).unwrap();
    }
    let mut ops: Vec<_> = got.iter().map(|w| (w.status, w.opcode)).collect();
    ops.sort_by_key(|o| o.1 as u32);
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(
        ops.contains(&(WcStatus::Success, WcOpcode::Send)),
        "{ops:?}"
    );
    assert!(
        ops.contains(&(WcStatus::Success, WcOpcode::Recv)),
        "{ops:?}"
    );
}

#[test]
fn held_ack_is_flushed_at_destroy_qp() {
    let (a, b) = pair();
    send_and_hold(&a, &b, Instant::now());
    let sent = tx(&b);
    b.ctx.destroy_qp(b.qp).unwrap();
    assert_eq!(b.ctx.held_ack_count(), 0);
    assert_eq!(tx(&b), sent + 1);
    send_completes(&a);
}

#[test]
fn held_ack_is_flushed_when_the_device_closes() {
    let (a, b) = pair();
    send_and_hold(&a, &b, Instant::now());
    drop(b); // the last Context of b's device: ibv_close_device
    send_completes(&a);
}

#[test]
fn progress_thread_pass_flushes_held_acks() {
    let (a, b) = pair();
    send_and_hold(&a, &b, Instant::now());
    b.ctx.progress_once(Instant::now());
    assert_eq!(
        b.ctx.held_ack_count(),
        0,
        "the progress thread's pass sends it"
    );
    send_completes(&a);
}

#[test]
fn held_ack_is_flushed_at_modify_qp() {
    let (a, b) = pair();
    send_and_hold(&a, &b, Instant::now());
    let sent = tx(&b);
    let attr = QpAttr {
        qp_state: QpState::Err as u32,
        ..QpAttr::default()
    };
    b.ctx.modify_qp(b.qp, &attr, attr_mask::STATE).unwrap();
    assert_eq!(b.ctx.held_ack_count(), 0);
    assert_eq!(tx(&b), sent + 1);
    send_completes(&a);
}

#[test]
fn rnr_nak_is_never_held() {
    let (a, b) = pair();
    // No receive posted at b: the SEND gets an RNR NAK, which leaves at once.
    let mut s = SendWr::new(1, WrOpcode::Send);
    s.sg_list = a.sge(0, 8);
    a.ctx.post_send(a.qp, &[s]).unwrap();
    a.ctx.progress_once(Instant::now());
    let t0 = Instant::now();
    let sent = tx(&b);
    let end = Instant::now() + Duration::from_secs(10);
    while tx(&b) == sent && Instant::now() < end {
        b.ctx.progress_once_as_app(t0);
    }
    assert_eq!(
        tx(&b),
        sent + 1,
        "RNR NAK sent by the pass that produced it"
    );
    assert_eq!(b.ctx.held_ack_count(), 0);
}

#[test]
fn off_by_default_every_ack_leaves_at_once() {
    let mk = || {
        host_with_cap(
            ctx_with(DeviceConfig::rxe(), true),
            64,
            QpCap::default(),
            false,
        )
        .with_buf(4096, all())
    };
    let (a, b) = (mk(), mk());
    connect_udp(&a, &b, ConnectOpts::default());
    let sent = tx(&b);
    send_one(&a, &b, Instant::now());
    assert_eq!(
        b.ctx.held_ack_count(),
        0,
        "hardware behaviour: nothing held"
    );
    assert_eq!(tx(&b), sent + 1, "the ACK left in the same pass");
    send_completes(&a);
}
