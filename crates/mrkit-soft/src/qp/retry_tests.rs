//! Deterministic tests of the requester/completer retry logic (sans-IO: packets in, packets
//! and completions out, `now` passed explicitly; the engines run on a bare memory core, no
//! device is opened). Each case replays a response sequence that loss, duplication and
//! reordering produce on the wire and checks what is resent.
use std::time::{Duration, Instant};

use super::comp::Completer;
use super::req::{Requester, SendQueue, Wqe, WqeState};
use super::{Out, QpCtx, QpState, SendWr, WrOpcode};
use crate::access::AccessFlags;
use crate::cq::WcStatus;
use crate::device::StatusModel;
use crate::memcore::MemCore;
use crate::pkt::{Payload, Pkt};
use crate::wire::{Aeth, Bth, ExtHeaders, NakCode, Opcode};
use crate::DeviceConfig;

/// Timeout attribute 12: 4.096 µs << 12 ≈ 16.8 ms.
const TIMEOUT_ATTR: u8 = 12;
const LATER: Duration = Duration::from_millis(100);

struct Rig {
    /// The memory core alone: the engines run without a device.
    mem: MemCore,
    req: Requester,
    comp: Completer,
    sq: SendQueue,
    now: Instant,
    model: StatusModel,
    /// PD handle for local SGEs (READ destinations).
    pd: u32,
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
        let mem = MemCore::new(DeviceConfig::rxe());
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
            mem,
            req,
            comp,
            sq,
            now,
            model: StatusModel::Rxe,
            pd: 0,
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
            mem: &self.mem,
            qpn: 0x11,
            pd: self.pd,
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
            src_ip: None,
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
        .all(|(w, psn)| w.first_psn == psn && w.st == WqeState::Wait || w.st != WqeState::Wait));
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
fn a_sequence_nak_consumes_a_retry_and_naks_during_that_retry_do_not() {
    // Hardware model, retry_cnt 7. A PSN-sequence NAK starts a retry (one used). More NAKs
    // of the same round (the responder answering requests still in flight) start none and use
    // none, until a response makes progress or the timer fires: six timeouts use the rest and
    // the next one fails.
    let mut r = Rig::hardware(1);
    assert_eq!(r.step(), [0]);
    r.respond(0, psn_nak());
    assert_eq!(r.step(), [0], "the NAK starts a retry");
    for _ in 0..3 {
        r.respond(0, psn_nak());
        assert_eq!(r.step(), Vec::<u32>::new(), "a retry is under way");
    }
    for _ in 0..6 {
        assert!(!silent_timeout(&mut r));
        assert_eq!(r.step(), [0]);
    }
    assert!(
        silent_timeout(&mut r),
        "1 NAK + 6 timeouts used retry_cnt 7; the 8th fails"
    );
}

/// A READ response for `psn` with `len` bytes of `fill`.
fn read_response(op: Opcode, psn: u32, len: usize, fill: u8) -> Pkt {
    let mut p = Pkt {
        dst_node: 0,
        dst_ip: None,
        src_ip: None,
        src_node: 0,
        src_qpn: 0x12,
        bth: Bth::new(op, 0x11, psn),
        ext: ExtHeaders::default(),
        payload: Payload::copied(&vec![fill; len]),
    };
    if op != Opcode::RdmaReadResponseMiddle {
        p.ext.aeth = Some(ack());
    }
    p
}

impl Rig {
    fn deliver(&mut self, p: Pkt) {
        self.engine(|q, e, out| e.comp.on_response(q, e.sq, e.req, p, e.now, out));
    }

    /// The packets the requester sends now, as (opcode, PSN, RETH va offset, RETH length).
    fn step_reads(&mut self, base: u64) -> Vec<(Opcode, u32, u64, u32)> {
        let ((), out) = self.engine(|q, e, out| e.req.step(q, e.sq, e.comp, e.now, out));
        out.pkts
            .iter()
            .map(|p| {
                let r = p.ext.reth.expect("a READ request");
                (p.bth.opcode, p.bth.psn, r.va - base, r.dma_len)
            })
            .collect()
    }
}

#[test]
fn a_gap_in_read_responses_re_requests_from_it_at_once_without_a_timer() {
    // A READ of 4 KiB at MTU 1024 is 4 responses (PSNs 0..=3) into a registered buffer.
    let mut r = Rig::hardware(0);
    let pd = r.mem.alloc_pd().unwrap();
    r.pd = pd;
    let buf = std::sync::Arc::new(vec![0u8; 4096]);
    let mr = r
        .mem
        .reg_mr_va(
            pd,
            crate::UserMemory::owned(buf.clone()),
            AccessFlags::LOCAL_WRITE,
        )
        .unwrap();
    const REMOTE: u64 = 0x10_0000;
    let wr = SendWr::new(7, WrOpcode::RdmaRead)
        .sge(mr.iova, 4096, mr.lkey)
        .remote(REMOTE, 0x99);
    r.sq.q.push_back(Wqe::new(wr, 4096, false));
    use Opcode::*;
    assert_eq!(r.step_reads(REMOTE), [(RdmaReadRequest, 0, 0, 4096)]);
    // Response 0 arrives, 1 is lost, 2 arrives: re-request from PSN 1 (VA + 1024, the
    // remaining 3 KiB) in the same instant: the clock does not move in this test.
    r.deliver(read_response(RdmaReadResponseFirst, 0, 1024, 0xA0));
    r.deliver(read_response(RdmaReadResponseMiddle, 2, 1024, 0xA2));
    assert_eq!(r.step_reads(REMOTE), [(RdmaReadRequest, 1, 1024, 3072)]);
    // The rest of the first stream (PSN 3) lies beyond the same gap: no second re-request.
    r.deliver(read_response(RdmaReadResponseLast, 3, 1024, 0xA3));
    assert_eq!(r.step_reads(REMOTE), []);
    // Responses 2 and 3 arrived ahead of the gap and were placed: the first response of the
    // re-request fills the gap and completes the READ; its later ones are duplicates.
    r.deliver(read_response(RdmaReadResponseFirst, 1, 1024, 0xB1));
    let mut wcs = Vec::new();
    r.comp
        .drain_done(0x11, false, &mut r.sq, &mut r.req, &mut wcs);
    assert_eq!(wcs.len(), 1);
    assert_eq!((wcs[0].wr_id, wcs[0].status), (7, WcStatus::Success));
    r.deliver(read_response(RdmaReadResponseMiddle, 2, 1024, 0xB2));
    r.deliver(read_response(RdmaReadResponseLast, 3, 1024, 0xB3));
    assert_eq!(r.step_reads(REMOTE), []);
    let want: Vec<u8> = [0xA0u8, 0xB1, 0xA2, 0xA3]
        .iter()
        .flat_map(|&b| [b; 1024])
        .collect();
    assert!(
        *buf == want,
        "every packet's bytes land at its own offset, once"
    );
}

#[test]
fn an_ack_beyond_a_missing_read_response_re_requests_it() {
    // READ (PSN 0) then a SEND (PSN 1): the READ's only response is lost, the SEND's ACK
    // arrives. The ACK cannot complete the READ: re-request it at once, no timer.
    let mut r = Rig::hardware(0);
    let wr = SendWr::new(1, WrOpcode::RdmaRead)
        .sge(0x1000, 8, 5)
        .remote(0x2000, 0x99);
    r.sq.q.push_back(Wqe::new(wr, 8, false));
    let mut s = SendWr::new(2, WrOpcode::Send);
    s.inline_data = vec![1; 8];
    r.sq.q.push_back(Wqe::new(s, 8, true));
    assert_eq!(r.step(), [0, 1]);
    r.respond(1, ack());
    assert_eq!(r.step(), [0, 1], "go-back-N from the READ");
    // A second copy of that ACK (the rest of the gap) re-requests nothing more.
    r.respond(1, ack());
    assert_eq!(r.step(), Vec::<u32>::new());
}
