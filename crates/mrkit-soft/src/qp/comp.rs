//! Completer: responses (ACK, NAK, RNR NAK, read responses, atomic ACKs) → WQE completions
//! (sans-IO). Handles coalesced ACKs, RNR back-off, PSN-sequence NAK and timeout retries
//! (go-back-N through `Requester::rewind`), scatters READ
//! data and atomic results into local SGEs (LOCAL_WRITE required) and maps NAK codes to
//! completion statuses (docs/roce.md §3.8).
#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use super::req::{for_pieces, ReadWindow, Requester, SendQueue, WqeState};
use super::{CopyOwner, Notice, Out, QpCtx, WrOpcode};
use crate::access::AccessFlags;
use crate::copy::Unreachable;
use crate::cq::{Wc, WcStatus};
use crate::device::StatusModel;
use crate::mr::AccessDenied;
use crate::pkt::{Payload, Pkt};
use crate::wire::{
    local_ack_timeout, psn_add, psn_cmp, psn_diff, rnr_timer_to_duration, NakCode, Opcode, Syndrome,
};

/// Completer state.
#[derive(Debug)]
pub(crate) struct Completer {
    /// Oldest unacknowledged PSN.
    pub comp_psn: u32,
    retry_cnt: u8,
    rnr_retry: u8,
    retry_left: u8,
    rnr_left: u8,
    timeout: Option<Duration>,
    last_activity: Instant,
    rnr_until: Option<Instant>,
    rewind: Option<u32>,
    /// What an implied NAK (a response beyond a missing one) re-requested: from PSN `.0` to
    /// `.1`, the last PSN of that WQE. Gaps within it are covered by the re-request, whose
    /// responses are still to come: the rest of the stream that was under way (more
    /// responses beyond the gap) must not re-request them again. Cleared when the
    /// re-request's responses begin (a READ response FIRST or ONLY at `.0`) and by the
    /// retransmit timer.
    gap_retry: Option<(u32, u32)>,
    /// A retry after a PSN-sequence NAK or an implied NAK is under way: further sequence
    /// NAKs and gaps start no new one (they are what the retry is answering: requests and
    /// responses of the old round still in flight) until a response makes progress or the
    /// retransmit timer fires (rxe's `started_retry`). Without this, a burst of NAKs from
    /// one round of reordered requests used up `retry_cnt` in an instant.
    started_retry: bool,
}

/// Requester status for a NAK code.
pub fn nak_status(code: NakCode) -> WcStatus {
    match code {
        NakCode::InvalidRequest => WcStatus::RemInvReqErr,
        NakCode::RemoteAccessError => WcStatus::RemAccessErr,
        _ => WcStatus::RemOpErr,
    }
}

impl Completer {
    pub(crate) fn new(now: Instant) -> Completer {
        Completer {
            comp_psn: 0,
            retry_cnt: 7,
            rnr_retry: 7,
            retry_left: 7,
            rnr_left: 7,
            timeout: local_ack_timeout(14),
            last_activity: now,
            rnr_until: None,
            rewind: None,
            gap_retry: None,
            started_retry: false,
        }
    }

    pub(crate) fn start(&mut self, psn: u32, retry: u8, rnr: u8, timeout: u8, now: Instant) {
        self.comp_psn = psn;
        self.set_limits(retry, rnr, timeout);
        self.retry_left = retry;
        self.rnr_left = rnr;
        self.last_activity = now;
    }

    pub(crate) fn set_limits(&mut self, retry: u8, rnr: u8, timeout: u8) {
        self.retry_cnt = retry;
        self.rnr_retry = rnr;
        self.timeout = local_ack_timeout(timeout);
    }

    pub(crate) fn mark_activity(&mut self, now: Instant) {
        self.last_activity = now;
    }

    pub(crate) fn rnr_pending(&self) -> bool {
        self.rnr_until.is_some()
    }

    /// A pending rewind once its RNR delay (if any) has passed. A rewind is scheduled at
    /// `comp_psn`; responses that arrived meanwhile may have acknowledged more, so it
    /// restarts at the later of the two.
    pub(crate) fn take_rewind(&mut self, now: Instant) -> Option<u32> {
        if let Some(t) = self.rnr_until {
            if now < t {
                return None;
            }
            self.rnr_until = None;
        }
        let r = self.rewind.take()?;
        Some(if psn_cmp(self.comp_psn, r).is_gt() {
            self.comp_psn
        } else {
            r
        })
    }

    /// Complete the SENDs and WRITEs an ACK for `psn` covers (cumulative, IBA 9.7.5.1.3):
    /// waiting ones, and also ones a retry is resending, since the responder had them from an
    /// earlier copy. READ/atomic WQEs stop the walk: their responses are still needed.
    fn ack_before(&mut self, sq: &mut SendQueue, psn: u32, inclusive: bool) {
        for w in sq.q.iter_mut() {
            if matches!(w.st, WqeState::Done(_)) {
                continue;
            }
            if !w.psn_valid {
                break;
            }
            let c = psn_cmp(w.last_psn, psn);
            let covered = if inclusive { c.is_le() } else { c.is_lt() };
            if !covered {
                break;
            }
            if w.wr.opcode.is_rd_atomic() {
                break; // its responses are missing: left to the retry timer
            }
            w.st = WqeState::Done(WcStatus::Success);
            // Every PSN of a completed WQE is acknowledged: the retry point can never
            // be left behind it (nothing there would be resent, and the QP would stall).
            let next = psn_add(w.last_psn, 1);
            if psn_cmp(next, self.comp_psn).is_gt() {
                self.comp_psn = next;
            }
        }
    }

    /// Consume one transport retry (a retransmission timeout or a PSN-sequence NAK); false
    /// when none is left (the WQE then completes with RETRY_EXC_ERR).
    ///
    /// `retry_cnt` 7 means seven retries in the IBA (only the RNR retry count uses 7 for
    /// "infinite") and on mlx5, so a dead peer ends the connection after
    /// (retry_cnt + 1) × timeout. rxe never decrements a count of 7 and retries forever; the
    /// rxe status model keeps that quirk.
    fn take_retry(&mut self, model: StatusModel) -> bool {
        if model == StatusModel::Rxe && self.retry_cnt == 7 {
            crate::counters::inc(crate::counters::Hw::CompleterRetryErr);
            return true;
        }
        if self.retry_left == 0 {
            return false;
        }
        self.retry_left -= 1;
        crate::counters::inc(crate::counters::Hw::CompleterRetryErr);
        true
    }

    /// A response answered everything up to `psn` in order: the retry counts start over and a
    /// retry under way is answered.
    fn advance(&mut self, psn: u32) {
        let next = psn_add(psn, 1);
        if psn_cmp(next, self.comp_psn).is_gt() {
            self.comp_psn = next;
        }
        self.retry_left = self.retry_cnt;
        self.rnr_left = self.rnr_retry;
        self.started_retry = false;
    }

    /// The first PSN whose response is still missing: the next READ response (or the atomic
    /// ACK) of the oldest incomplete READ/atomic, or the first unacknowledged PSN of the oldest
    /// incomplete SEND/WRITE. An ACK or a PSN-sequence NAK for a later PSN implicitly
    /// acknowledges SENDs and WRITEs only (IBA 9.7.5.1.3): READ data and atomic results that
    /// were lost must still be requested again, so retries never start beyond this PSN.
    fn oldest_missing(sq: &SendQueue) -> Option<u32> {
        let w = sq.q.iter().find(|w| !matches!(w.st, WqeState::Done(_)))?;
        if !w.psn_valid {
            return None;
        }
        match w.st {
            _ if w.wr.opcode == WrOpcode::RdmaRead => Some(psn_add(w.first_psn, w.sent)),
            _ if w.wr.opcode.is_atomic() => Some(w.first_psn),
            WqeState::Wait => Some(w.first_psn),
            _ => None,
        }
    }

    /// Whether the oldest unfinished WQE is a READ or an atomic.
    fn head_is_rd_atomic(sq: &SendQueue) -> bool {
        sq.q.iter()
            .find(|w| !matches!(w.st, WqeState::Done(_)))
            .is_some_and(|w| w.wr.opcode.is_rd_atomic())
    }

    /// **Implied NAK** (the IBA's PSN sequence error as the requester detects it): a
    /// response for `psn` arrived while an earlier READ response or atomic ACK is still
    /// missing. A responder sends its responses in PSN order, so the missing ones were lost:
    /// re-request from the first missing PSN at once, as hardware does, instead of waiting a
    /// whole retransmission timeout (a READ of 100 KB under 100 µs of jitter waited ~67 ms
    /// per gap). It consumes a retry like a PSN-sequence NAK; every response that makes
    /// progress restores the count. One re-request per gap: the rest of the stream that was
    /// under way (more responses beyond the gap) does not re-request it again; if the
    /// re-request is lost too, the retransmit timer takes over.
    ///
    /// `ack`: the response is a plain ACK, which implies the loss already when its PSN equals
    /// the missing one (a READ response or atomic ACK for that PSN is the awaited response).
    fn implied_nak(
        &mut self,
        q: &QpCtx<'_>,
        sq: &mut SendQueue,
        psn: u32,
        ack: bool,
        out: &mut Out,
    ) -> bool {
        let Some(m) = Self::oldest_missing(sq) else {
            return false;
        };
        let c = psn_cmp(psn, m);
        if !Self::head_is_rd_atomic(sq) || c.is_lt() || c.is_eq() && !ack {
            return false;
        }
        let covered = self
            .gap_retry
            .is_some_and(|(from, to)| psn_cmp(m, from).is_ge() && psn_cmp(m, to).is_le());
        if self.rewind.is_some() || self.rnr_until.is_some() || self.started_retry || covered {
            return true; // a retry is already under way, or this gap was re-requested already
        }
        crate::counters::implied_nak(q.qpn, m);
        if !self.take_retry(q.model) {
            Self::fail(sq, Some(m), WcStatus::RetryExcErr, out);
            return true;
        }
        let last =
            sq.q.iter()
                .find(|w| !matches!(w.st, WqeState::Done(_)))
                .map_or(m, |w| w.last_psn);
        self.gap_retry = Some((m, last));
        self.started_retry = true;
        self.comp_psn = m;
        self.rewind = Some(m);
        tracing::debug!(
            missing = m,
            got = psn,
            "implied NAK: re-request from the gap"
        );
        true
    }

    /// Keep `comp_psn` at or before the oldest missing response.
    fn clamp(&mut self, sq: &SendQueue) {
        if let Some(m) = Self::oldest_missing(sq) {
            if psn_cmp(m, self.comp_psn).is_lt() {
                self.comp_psn = m;
            }
        }
    }

    fn fail(sq: &mut SendQueue, psn: Option<u32>, status: WcStatus, out: &mut Out) {
        let idx = psn
            .and_then(|p| sq.q.iter().position(|w| w.contains(p)))
            .or_else(|| sq.q.iter().position(|w| !matches!(w.st, WqeState::Done(_))));
        if let Some(i) = idx {
            sq.q[i].st = WqeState::Done(status);
        }
        out.error = true;
    }

    /// Process one response packet.
    pub(crate) fn on_response(
        &mut self,
        q: &QpCtx<'_>,
        sq: &mut SendQueue,
        req: &mut Requester,
        p: Pkt,
        now: Instant,
        out: &mut Out,
    ) {
        let psn = p.bth.psn;
        if psn_cmp(psn, req.max_psn).is_ge() {
            return; // answers a PSN never sent: outside the window (IBA 9.7.5.1), ignored
        }
        self.last_activity = now;
        match p.bth.opcode {
            Opcode::Acknowledge => {
                let Some(aeth) = p.ext.aeth else { return };
                match aeth.kind() {
                    Syndrome::Ack { .. } => {
                        self.ack_before(sq, psn, true);
                        if self.implied_nak(q, sq, psn, true, out) {
                            // An ACK at or beyond a READ response / atomic ACK still missing:
                            // those were lost (they travel before any later response).
                            return;
                        }
                        self.advance(psn);
                        self.clamp(sq);
                    }
                    Syndrome::RnrNak { timer } => {
                        if psn_cmp(psn, self.comp_psn).is_lt() {
                            return; // stale (duplicated or reordered): see the NAK case below
                        }
                        self.ack_before(sq, psn, false);
                        crate::counters::rnr_nak_rcvd(q.qpn, psn, self.rnr_left == 0);
                        if self.rnr_left == 0 {
                            Self::fail(sq, Some(psn), WcStatus::RnrRetryExcErr, out);
                            return;
                        }
                        if self.rnr_left != 7 {
                            self.rnr_left -= 1;
                        }
                        self.rnr_until = Some(now + rnr_timer_to_duration(timer));
                        self.rewind = Some(psn);
                        self.comp_psn = psn;
                    }
                    Syndrome::Nak(NakCode::PsnSequenceError) => {
                        if psn_cmp(psn, self.comp_psn).is_lt() {
                            // A stale (duplicated or reordered) NAK for a PSN already behind
                            // us: retrying from there would resend nothing and stall.
                            return;
                        }
                        self.ack_before(sq, psn, false);
                        crate::counters::seq_nak_rcvd(q.qpn, psn);
                        if self.rewind.is_some() || self.rnr_until.is_some() || self.started_retry {
                            return; // a retry is already under way
                        }
                        if !self.take_retry(q.model) {
                            Self::fail(sq, Some(psn), WcStatus::RetryExcErr, out);
                            return;
                        }
                        self.started_retry = true;
                        self.comp_psn = psn;
                        self.clamp(sq);
                        self.rewind = Some(self.comp_psn);
                    }
                    Syndrome::Nak(code) => {
                        self.ack_before(sq, psn, false);
                        crate::counters::nak_rcvd(code);
                        Self::fail(sq, Some(psn), nak_status(code), out);
                    }
                    Syndrome::Reserved(_) => {}
                }
            }
            Opcode::RdmaReadResponseFirst
            | Opcode::RdmaReadResponseMiddle
            | Opcode::RdmaReadResponseLast
            | Opcode::RdmaReadResponseOnly => {
                self.ack_before(sq, psn, false);
                let Some(i) = sq.q.iter().position(|w| !matches!(w.st, WqeState::Done(_))) else {
                    return;
                };
                let w = &mut sq.q[i];
                if w.wr.opcode != WrOpcode::RdmaRead || w.st != WqeState::Wait || !w.contains(psn) {
                    // A response for a later request (or a stray one): if it lies beyond the
                    // oldest missing READ response or atomic ACK, that one was lost.
                    self.implied_nak(q, sq, psn, false, out);
                    return;
                }
                let k = psn_diff(psn, w.first_psn) as u32;
                if k < w.sent || w.ahead.as_ref().is_some_and(|a| k > w.sent && a.has(k)) {
                    return; // duplicate
                }
                if k - w.sent >= ReadWindow::BITS {
                    self.implied_nak(q, sq, psn, false, out);
                    return;
                }
                let restarted = matches!(
                    p.bth.opcode,
                    Opcode::RdmaReadResponseFirst | Opcode::RdmaReadResponseOnly
                );
                let off = u64::from(k) * q.mtu as u64;
                let n = p.payload.len() as u64;
                let r = scatter_deferred(q, &w.wr.sg_list, off, n, p.payload, psn, out);
                if let Err(e) = r {
                    w.st = WqeState::Done(match e {
                        PlaceError::Copy(Unreachable::Src) => {
                            // The responder's memory (loopback): see `copy_failed`.
                            let n = Notice::ReadSourceFault { psn };
                            out.peer_notices.push((q.dest_node, q.dest_qpn, n));
                            WcStatus::RemAccessErr
                        }
                        _ => WcStatus::LocProtErr,
                    });
                    out.error = true;
                    return;
                }
                if k > w.sent {
                    // Ahead of a gap: placed (its bytes are final), remembered, and the gap
                    // re-requested at once (implied NAK) unless a re-request covers it.
                    w.ahead.get_or_insert_with(Box::default).set(k);
                    if restarted && self.gap_retry.is_some_and(|(m0, _)| m0 == psn) {
                        self.gap_retry = None; // the re-request's responses have begun
                    }
                    self.implied_nak(q, sq, psn, false, out);
                    return;
                }
                if restarted && self.gap_retry.is_some_and(|(m0, _)| m0 == psn) {
                    self.gap_retry = None;
                }
                w.sent += 1;
                if let Some(a) = w.ahead.as_mut() {
                    while w.sent < w.npkts && a.take(w.sent) {
                        w.sent += 1;
                    }
                }
                let done_to = psn_add(w.first_psn, w.sent - 1);
                let complete = w.sent == w.npkts;
                if complete {
                    w.ahead = None;
                    w.st = WqeState::Done(WcStatus::Success);
                }
                self.advance(done_to);
            }
            Opcode::AtomicAcknowledge => {
                self.ack_before(sq, psn, false);
                let Some(i) = sq.q.iter().position(|w| !matches!(w.st, WqeState::Done(_))) else {
                    return;
                };
                let w = &mut sq.q[i];
                if !w.wr.opcode.is_rd_atomic() || w.st != WqeState::Wait || w.first_psn != psn {
                    self.implied_nak(q, sq, psn, false, out);
                    return;
                }
                let orig = p.ext.atomic_ack_eth.map(|a| a.orig).unwrap_or(0);
                let r = scatter(
                    q,
                    &w.wr.sg_list,
                    0,
                    8,
                    &Payload::copied(&orig.to_ne_bytes()),
                );
                self.advance(psn);
                w.st = WqeState::Done(if r.is_ok() {
                    WcStatus::Success
                } else {
                    out.error = true;
                    WcStatus::LocProtErr
                });
            }
            _ => {}
        }
    }

    /// A deferred placement of READ response `psn` could not reach memory (found when the
    /// copies were flushed, before any completion of this run is produced). `Dst`, the local
    /// SGE: LOC_PROT_ERR. `Src`, the responder's memory (loopback: this side copies from it):
    /// what the responder's NAK would give, REM_ACCESS_ERR, and the responder is told
    /// (`Notice::ReadSourceFault`) so that it moves to ERR as a NIC's does. The QP moves to
    /// ERR; WQEs after the READ that were completed in this run are flushed instead (a NIC
    /// would have stopped at the READ).
    pub(crate) fn copy_failed(
        &mut self,
        q: &QpCtx<'_>,
        sq: &mut SendQueue,
        psn: u32,
        side: Unreachable,
        out: &mut Out,
    ) {
        let status = match side {
            Unreachable::Dst => WcStatus::LocProtErr,
            Unreachable::Src => {
                let n = Notice::ReadSourceFault { psn };
                out.peer_notices.push((q.dest_node, q.dest_qpn, n));
                WcStatus::RemAccessErr
            }
        };
        out.error = true;
        let Some(i) = sq.q.iter().position(|w| {
            w.psn_valid && psn_cmp(psn, w.first_psn).is_ge() && psn_cmp(psn, w.last_psn).is_le()
        }) else {
            return;
        };
        sq.q[i].st = WqeState::Done(status);
        for w in sq.q.iter_mut().skip(i + 1) {
            if w.st == WqeState::Done(WcStatus::Success) {
                w.st = WqeState::Done(WcStatus::WrFlushErr);
            }
        }
    }

    /// The gather of request packet `psn` failed after the packet left the QP (its bytes
    /// could not be read when they were copied: `Notice::GatherFault`): its WQE completes with
    /// LOC_PROT_ERR and the QP moves to ERR, as when a NIC's gather faults. A WQE no longer
    /// outstanding (an earlier copy of the packet was acknowledged) is left alone.
    pub(crate) fn gather_fault(&mut self, sq: &mut SendQueue, psn: u32, out: &mut Out) {
        if let Some(w) = sq.q.iter_mut().find(|w| w.contains(psn)) {
            w.st = WqeState::Done(WcStatus::LocProtErr);
            out.error = true;
        }
    }

    /// Retransmit timer: with outstanding PSNs and no response for `timeout`, retry from
    /// `comp_psn`; after `retry_cnt` retries complete with RETRY_EXC_ERR.
    pub(crate) fn tick(
        &mut self,
        q: &QpCtx<'_>,
        sq: &mut SendQueue,
        req: &mut Requester,
        now: Instant,
        out: &mut Out,
    ) {
        let Some(t) = self.timeout else { return };
        if self.rnr_until.is_some() || self.rewind.is_some() {
            return;
        }
        let outstanding =
            sq.q.iter()
                .any(|w| matches!(w.st, WqeState::Wait | WqeState::Sending));
        if !outstanding || now.duration_since(self.last_activity) < t {
            return;
        }
        self.last_activity = now;
        crate::counters::ack_timeout(q.qpn, self.comp_psn);
        self.gap_retry = None;
        self.started_retry = true;
        if !self.take_retry(q.model) {
            Self::fail(sq, None, WcStatus::RetryExcErr, out);
            return;
        }
        self.clamp(sq);
        self.rewind = Some(self.comp_psn);
        tracing::debug!(
            comp_psn = self.comp_psn,
            req_psn = req.psn,
            max_psn = req.max_psn,
            retry_left = self.retry_left,
            "retransmit timer: go back"
        );
    }

    /// When this QP's timers next need a run: the end of the RNR wait, or the
    /// retransmission deadline while WQEs are outstanding; `None` if no timer is pending.
    pub(crate) fn next_timer(&self, sq: &SendQueue) -> Option<Instant> {
        if let Some(t) = self.rnr_until {
            return Some(t);
        }
        let t = self.timeout?;
        sq.q.iter()
            .any(|w| matches!(w.st, WqeState::Wait | WqeState::Sending))
            .then(|| self.last_activity + t)
    }

    /// Pop finished WQEs from the head, in order, into completions (error completions always;
    /// successful ones when signaled or `sq_sig_all`).
    pub(crate) fn drain_done(
        &mut self,
        qpn: u32,
        sig_all: bool,
        sq: &mut SendQueue,
        _req: &mut Requester,
        wcs: &mut Vec<Wc>,
    ) {
        while let Some(WqeState::Done(status)) = sq.q.front().map(|w| w.st) {
            let w = sq.q.pop_front().expect("front exists");
            crate::counters::send_wqe_done(
                w.wr.opcode.wc_opcode() == crate::cq::WcOpcode::Send,
                status,
            );
            sq.cursor = sq.cursor.saturating_sub(1);
            if status != WcStatus::Success
                || sig_all
                || w.wr.flags & super::send_flags::SIGNALED != 0
            {
                wcs.push(w.wc(qpn, status));
            }
        }
    }
}

/// Why bytes could not be placed into local SGEs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PlaceError {
    /// The access check of an SGE failed.
    Denied(AccessDenied),
    /// The copy could not reach memory: the SGE's (`Dst`) or, for a payload of registered
    /// memory (loopback), the sender's (`Src`).
    Copy(Unreachable),
}

impl From<AccessDenied> for PlaceError {
    fn from(d: AccessDenied) -> Self {
        PlaceError::Denied(d)
    }
}

/// As [`scatter`], but when the bytes land in a single SGE fragment and come from registered
/// memory the copy is deferred to [`Out::flush_copies`](super::Out::flush_copies) (coalesced
/// with the next response packets of the READ into one large copy; a failure then comes back
/// through [`Completer::copy_failed`]). `psn`: the READ response's.
pub(crate) fn scatter_deferred(
    q: &QpCtx<'_>,
    sges: &[super::Sge],
    off: u64,
    n: u64,
    payload: Payload,
    psn: u32,
    out: &mut Out,
) -> Result<(), PlaceError> {
    let mut frags = 0;
    let mut one = None;
    let walk = for_pieces(sges, off, n, |s, soff, len| {
        frags += 1;
        one = Some((*s, soff, len));
        Ok(())
    });
    match (walk, frags, one, &payload) {
        (Ok(()), 1, Some((s, soff, len)), Payload::Mem(_)) if len == n => {
            let g = q.local_sge(&s, soff, len, AccessFlags::LOCAL_WRITE)?;
            out.place(g, payload, CopyOwner::Req { psn })
                .map_err(PlaceError::Copy)
        }
        _ => scatter(q, sges, off, n, &payload),
    }
}

/// Write `n` payload bytes into the local SGEs at message offset `off` (LOCAL_WRITE needed).
pub(crate) fn scatter(
    q: &QpCtx<'_>,
    sges: &[super::Sge],
    off: u64,
    n: u64,
    payload: &Payload,
) -> Result<(), PlaceError> {
    let mut poff = 0usize;
    let mut copy = Ok(());
    for_pieces(sges, off, n, |s, soff, len| {
        let g = q.local_sge(s, soff, len, AccessFlags::LOCAL_WRITE)?;
        copy = payload.copy_to(poff, &g, 0, len as usize);
        if copy.is_err() {
            // Stop the walk; reported below.
            return Err(AccessDenied::Fault);
        }
        poff += len as usize;
        Ok(())
    })
    .map_err(|d| copy.err().map_or(PlaceError::Denied(d), PlaceError::Copy))
}
