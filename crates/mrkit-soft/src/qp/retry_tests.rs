//! Deterministic tests of the requester/completer retry logic (sans-IO: packets in, packets
//! and completions out, `now` passed explicitly). Each case replays a response sequence that
//! loss, duplication and reordering produce on the wire and checks what is resent.
use std::time::{Duration, Instant};

use super::comp::Completer;
use super::req::{Requester, SendQueue, Wqe, WqeSt};
use super::{Out, QpCtx, QpState, SendWr, WrOpcode};
use crate::access::AccessFlags;
use crate::cq::WcStatus;
use crate::device::StatusModel;
use crate::net::{Payload, Pkt};
use crate::wire::{Aeth, Bth, ExtHeaders, NakCode, Opcode};
use crate::{Context, DeviceConfig};

/// Timeout attribute 12: 4.096 µs << 12 ≈ 16.8 ms.
const TIMEOUT_ATTR: u8 = 12;
const LATER: Duration = Duration::from_millis(100);

struct Rig {
    ctx: Context,
    req: Requester,
    comp: Completer,
    sq: SendQueue,
    now: Instant,
    model: StatusModel,
}

/// The QP's engines, borrowed for one call.
struct Engines<'a> {
    req: &'a mut Requester,
    comp: &'a mut Completer,
    sq: &'a mut SendQueue,
    now: Instant,
}

impl Rig {
    /// A requester at PSN 0 with `n` one-packet inline SENDs posted (every one signaled).
    fn new(n: u64) -> Rig {
        let ctx = Context::open(DeviceConfig::rxe());
        ctx.set_manual_progress();
        let now = Instant::now();
        let mut req = Requester::default();
        req.start(0);
        let mut comp = Completer::new(now);
        comp.start(0, 7, 7, TIMEOUT_ATTR, now);
        let mut sq = SendQueue::default();
        for id in 0..n {
            let mut wr = SendWr::new(id, WrOpcode::Send);
            wr.inline_data = vec![id as u8; 16];
            sq.q.push_back(Wqe::new(wr, 16, true));
        }
        Rig {
            ctx,
            req,
            comp,
            sq,
            now,
            model: StatusModel::Rxe,
        }
    }

    /// As [`Rig::new`], with the hardware (IBA/mlx5) status model.
    fn hardware(n: u64) -> Rig {
        Rig {
            model: StatusModel::Hardware,
            ..Rig::new(n)
        }
    }

    /// Run one engine call with the QP's context; it must not move the QP to ERR.
    fn engine<R>(
        &mut self,
        f: impl FnOnce(&QpCtx<'_>, &mut Engines<'_>, &mut Out) -> R,
    ) -> (R, Out) {
        let (r, out) = self.engine_may_fail(f);
        assert!(!out.error);
        (r, out)
    }

    /// As [`engine`](Self::engine), also when the QP moves to ERR.
    fn engine_may_fail<R>(
        &mut self,
        f: impl FnOnce(&QpCtx<'_>, &mut Engines<'_>, &mut Out) -> R,
    ) -> (R, Out) {
        let q = QpCtx {
            ctx: &self.ctx,
            qpn: 0x11,
            pd: 0,
            mtu: 1024,
            dest_qpn: 0x12,
            dest_node: 0,
            dest_ip: None,
            src_node: 0,
            access: AccessFlags::empty(),
            max_rd_atomic: 16,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 0,
            model: self.model,
            state: QpState::Rts,
        };
        let mut e = Engines {
            req: &mut self.req,
            comp: &mut self.comp,
            sq: &mut self.sq,
            now: self.now,
        };
        let mut out = Out::default();
        let r = f(&q, &mut e, &mut out);
        (r, out)
    }

    /// Run the requester; the PSNs it sent.
    fn step(&mut self) -> Vec<u32> {
        let ((), out) = self.engine(|q, e, out| e.req.step(q, e.sq, e.comp, e.now, out));
        out.pkts.iter().map(|p| p.bth.psn).collect()
    }

    /// Let the retransmit timer expire.
    fn timeout(&mut self) {
        self.now += LATER;
        self.engine(|q, e, out| e.comp.tick(q, e.sq, e.req, e.now, out));
    }

    fn respond(&mut self, psn: u32, aeth: Aeth) {
        let p = Pkt {
            dst_node: 0,
            dst_ip: None,
            src_node: 0,
            src_qpn: 0x12,
            bth: Bth::new(Opcode::Acknowledge, 0x11, psn),
            ext: ExtHeaders {
                aeth: Some(aeth),
                ..ExtHeaders::default()
            },
            payload: Payload::Empty,
        };
        self.engine(|q, e, out| e.comp.on_response(q, e.sq, e.req, p, e.now, out));
    }

    /// wr_ids completed so far (drained in order).
    fn completed(&mut self) -> Vec<u64> {
        let mut wcs = Vec::new();
        self.comp
            .drain_done(0x11, false, &mut self.sq, &mut self.req, &mut wcs);
        assert!(wcs.iter().all(|w| w.status == WcStatus::Success));
        wcs.iter().map(|w| w.wr_id).collect()
    }
}

fn ack() -> Aeth {
    Aeth::ack(0)
}
fn psn_nak() -> Aeth {
    Aeth::nak(NakCode::PsnSequenceError, 0)
}

#[test]
fn nak_during_a_pending_retry_moves_the_retry_past_what_it_acknowledged() {
    // The stall once seen under loss: the timer schedules a retry from PSN 0, then a NAK
    // for PSN 2 (the responder has 0 and 1) completes WQEs 0 and 1 before the requester
    // runs. The retry must start at PSN 2, not at a PSN no unfinished WQE contains.
    let mut r = Rig::new(3);
    assert_eq!(r.step(), [0, 1, 2]);
    r.timeout();
    r.respond(2, psn_nak());
    assert_eq!(r.step(), [2], "resends exactly the missing PSN");
    assert_eq!(r.completed(), [0, 1]);
    r.respond(2, ack());
    assert_eq!(r.completed(), [2]);
    assert!(r.sq.q.is_empty());
}

#[test]
fn duplicate_ack_during_rnr_wait_skips_what_the_responder_already_has() {
    // RNR NAK for PSN 1 schedules a retry from 1 after the RNR delay; meanwhile a delayed
    // ACK for PSN 2 (the responder got 1 and 2 from an earlier copy) arrives. Nothing
    // must be resent, and the next new WQE must take PSN 3, never a consumed PSN.
    let mut r = Rig::new(3);
    assert_eq!(r.step(), [0, 1, 2]);
    r.respond(1, Aeth::rnr_nak(1, 0));
    assert_eq!(r.step(), Vec::<u32>::new(), "waits for the RNR delay");
    r.respond(2, ack());
    r.now += LATER;
    assert_eq!(r.step(), Vec::<u32>::new());
    assert_eq!(r.completed(), [0, 1, 2]);
    let mut wr = SendWr::new(3, WrOpcode::Send);
    wr.inline_data = vec![3; 16];
    r.sq.q.push_back(Wqe::new(wr, 16, true));
    assert_eq!(r.step(), [3]);
}

#[test]
fn stale_and_foreign_responses_change_nothing() {
    let mut r = Rig::new(3);
    assert_eq!(r.step(), [0, 1, 2]);
    r.respond(1, ack());
    assert_eq!(r.completed(), [0, 1]);
    // A duplicated NAK and RNR NAK older than the retry point, and an ACK for a PSN never
    // sent (outside the window): ignored, no retry, no completion.
    r.respond(0, psn_nak());
    r.respond(1, Aeth::rnr_nak(1, 0));
    r.respond(7, ack());
    assert_eq!(r.step(), Vec::<u32>::new());
    assert_eq!(r.completed(), Vec::<u64>::new());
    assert_eq!(r.comp.comp_psn, 2);
    // The timer still retries the one unacknowledged PSN.
    r.timeout();
    assert_eq!(r.step(), [2]);
    r.respond(2, ack());
    assert_eq!(r.completed(), [2]);
}

#[test]
fn go_back_n_resends_from_the_nak_and_keeps_the_psns() {
    let mut r = Rig::new(5);
    assert_eq!(r.step(), [0, 1, 2, 3, 4]);
    r.respond(1, psn_nak());
    assert_eq!(r.step(), [1, 2, 3, 4]);
    assert!(r
        .sq
        .q
        .iter()
        .zip(0u32..)
        .all(|(w, psn)| w.first_psn == psn && w.st == WqeSt::Wait || w.st != WqeSt::Wait));
    assert_eq!(r.completed(), [0]);
    r.respond(4, ack());
    assert_eq!(r.completed(), [1, 2, 3, 4]);
}

/// Let the retransmit timer expire with nobody answering; whether the QP failed.
fn silent_timeout(r: &mut Rig) -> bool {
    r.now += LATER;
    let ((), out) = r.engine_may_fail(|q, e, out| e.comp.tick(q, e.sq, e.req, e.now, out));
    out.error
}

#[test]
fn retry_cnt_7_means_seven_retries_in_the_hardware_model() {
    // A dead peer: nothing answers. IBA/mlx5: the first send and seven retries, then
    // RETRY_EXC_ERR (only the RNR retry count uses 7 for "forever").
    let mut r = Rig::hardware(2);
    assert_eq!(r.step(), [0, 1]);
    for retry in 1..=7 {
        assert!(!silent_timeout(&mut r), "retry {retry} still allowed");
        assert_eq!(r.step(), [0, 1], "retry {retry} resends both PSNs");
    }
    assert!(silent_timeout(&mut r), "the eighth timeout ends the QP");
    let mut wcs = Vec::new();
    r.comp
        .drain_done(0x11, false, &mut r.sq, &mut r.req, &mut wcs);
    assert_eq!(wcs.len(), 1, "{wcs:?}");
    assert_eq!(wcs[0].status, WcStatus::RetryExcErr);
    assert_eq!(wcs[0].wr_id, 0);
}

#[test]
fn retry_cnt_7_is_forever_in_the_rxe_model_and_any_response_restores_the_count() {
    let mut r = Rig::new(1);
    assert_eq!(r.step(), [0]);
    for _ in 0..50 {
        assert!(
            !silent_timeout(&mut r),
            "rxe never gives up with retry_cnt 7"
        );
        assert_eq!(r.step(), [0]);
    }
    // Hardware: seven timeouts, then an ACK restores the full count, so seven more are
    // allowed before the eighth fails.
    let mut h = Rig::hardware(2);
    assert_eq!(h.step(), [0, 1]);
    for _ in 0..7 {
        assert!(!silent_timeout(&mut h));
        assert_eq!(h.step(), [0, 1]);
    }
    h.respond(0, ack());
    assert_eq!(h.completed(), [0]);
    for _ in 0..7 {
        assert!(!silent_timeout(&mut h));
        assert_eq!(h.step(), [1]);
    }
    assert!(silent_timeout(&mut h));
}

#[test]
fn sequence_naks_consume_the_retry_count_in_the_hardware_model() {
    // A responder that keeps NAKing the same PSN: each NAK is a retry; the eighth ends it.
    let mut r = Rig::hardware(1);
    assert_eq!(r.step(), [0]);
    for _ in 0..7 {
        r.respond(0, psn_nak());
        assert_eq!(r.step(), [0]);
    }
    let p = Pkt {
        dst_node: 0,
        dst_ip: None,
        src_node: 0,
        src_qpn: 0x12,
        bth: Bth::new(Opcode::Acknowledge, 0x11, 0),
        ext: ExtHeaders {
            aeth: Some(psn_nak()),
            ..ExtHeaders::default()
        },
        payload: Payload::Empty,
    };
    let ((), out) =
        r.engine_may_fail(|q, e, out| e.comp.on_response(q, e.sq, e.req, p, e.now, out));
    assert!(out.error, "the eighth sequence NAK exhausts retry_cnt 7");
}
