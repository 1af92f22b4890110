//! Responder: request packets → memory, ACK/NAK, read responses, atomic results (sans-IO).
//!
//! Order of checks (docs/semantics.md §6.4, docs/roce.md §3.4): PSN (ahead → one PSN-sequence NAK;
//! behind → duplicate: re-ACK, replay a READ from its resource, or resend a saved atomic
//! result), opcode sequence, QP access flags, responder resources, receive WQE (RNR NAK),
//! lengths, rkey through the access predicate (once for the whole RETH range, then again for
//! every packet's bytes so a dereg mid-message stops the next packet), execution.
#![forbid(unsafe_code)]

use std::collections::VecDeque;

use super::{CopyOwner, Notice, Out, QpCtx, RecvWqe};
use crate::access::AccessFlags;
use crate::copy::{self, AtomicOp, Unreachable};
use crate::cq::{Wc, WcOpcode, WcStatus, WC_WITH_IMM, WC_WITH_INV};
use crate::device::StatusModel;
use crate::events::AsyncEvent;
use crate::mr::KeyUse;
use crate::pkt::{Payload, Pkt};
use crate::wire::{
    psn_add, psn_cmp, psn_diff, Aeth, AtomicAckEth, Bth, ExtHeaders, NakCode, Opcode, MSN_MASK,
};

/// The inbound message the responder is in the middle of: a SEND being placed into its
/// receive WQE, or an RDMA WRITE being placed at `va` (`off` bytes so far).
#[derive(Debug, Default)]
enum InboundMessage {
    #[default]
    None,
    Send {
        recv: RecvWqe,
        off: u64,
    },
    Write {
        va: u64,
        rkey: u32,
        len: u64,
        off: u64,
    },
}

/// A responder resource (IBA: one per outstanding READ or atomic the requester may have):
/// what is needed to answer a duplicate of that request again (a READ's range, an atomic's
/// original value).
#[derive(Debug, Clone, Copy)]
enum ResponderResource {
    Read {
        first: u32,
        last: u32,
        va: u64,
        rkey: u32,
        len: u64,
    },
    Atomic {
        psn: u32,
        orig: u64,
    },
}

/// A READ response stream being sent: packets `k..npkts` of `len` bytes at `va`, PSNs from
/// `psn` (packet `k` has PSN `psn + k`).
#[derive(Debug, Clone, Copy)]
struct ReadJob {
    psn: u32,
    va: u64,
    rkey: u32,
    len: u64,
    k: u32,
    npkts: u32,
}

/// READ response packets one QP run sends at most; the rest follow in the next runs (the QP
/// is scheduled again). Bounds what a READ of any size (or a flood of duplicate READs of a
/// large region) makes the responder hold at once: 64 packets, 256 KiB at MTU 4096.
pub(crate) const READ_BURST: u32 = 64;

/// Requests that arrive while a READ response stream is under way wait in order behind it
/// (responses must leave in PSN order); at most this many, later ones are dropped as if lost
/// (the requester retransmits them). The requester's window is 128 PSNs.
pub(crate) const BACKLOG_MAX: usize = 256;

/// Responder state.
#[derive(Debug, Default)]
pub(crate) struct Responder {
    epsn: u32,
    msn: u32,
    sent_psn_nak: bool,
    message: InboundMessage,
    /// Responder resources: the last `max_dest_rd_atomic` READ/atomic requests, the only ones
    /// a duplicate is answered for.
    resources: VecDeque<ResponderResource>,
    /// The READ response stream being sent.
    job: Option<ReadJob>,
    /// Requests waiting behind `job`.
    backlog: VecDeque<Pkt>,
    /// READ response packets this run may still send (`begin_run`).
    budget: u32,
}

/// How a failed request ends on the responder side.
struct Fail {
    nak: NakCode,
    /// Status for the receive WQE in use (if one is), else none.
    recv_status: Option<WcStatus>,
    event: Option<fn(u32) -> AsyncEvent>,
}

const fn fail(nak: NakCode, recv_status: Option<WcStatus>) -> Fail {
    Fail {
        nak,
        recv_status,
        event: None,
    }
}

fn is_first_or_only(op: Opcode) -> bool {
    use Opcode::*;
    matches!(
        op,
        SendFirst
            | SendOnly
            | SendOnlyWithImmediate
            | SendOnlyWithInvalidate
            | RdmaWriteFirst
            | RdmaWriteOnly
            | RdmaWriteOnlyWithImmediate
    )
}

fn is_last_or_only(op: Opcode) -> bool {
    op.info().ends_message()
}

impl Responder {
    pub(crate) fn reset(&mut self, epsn: u32) {
        *self = Responder {
            epsn,
            ..Responder::default()
        };
    }

    /// Start a QP run: the READ response budget is refilled.
    pub(crate) fn begin_run(&mut self) {
        self.budget = READ_BURST;
    }

    /// A READ response stream is under way or requests wait behind one: the QP must run
    /// again soon.
    pub(crate) fn busy(&self) -> bool {
        self.job.is_some() || !self.backlog.is_empty()
    }

    /// READ response packets still to send and requests waiting (tests: what the responder
    /// holds).
    #[cfg(test)]
    pub(crate) fn pending(&self) -> (u32, usize) {
        (self.job.map_or(0, |j| j.npkts - j.k), self.backlog.len())
    }

    /// The next request that waited behind a READ response stream, once the stream is done.
    pub(crate) fn next_backlog(&mut self) -> Option<Pkt> {
        if self.job.is_some() {
            return None;
        }
        let p = self.backlog.pop_front();
        if self.backlog.is_empty() && self.backlog.capacity() > 64 {
            self.backlog = VecDeque::new(); // memory returns after a burst
        }
        p
    }

    /// Send what the budget allows of the READ response stream under way.
    pub(crate) fn pump(&mut self, q: &QpCtx<'_>, out: &mut Out) {
        let Some(mut j) = self.job else { return };
        let n = (j.npkts - j.k).min(self.budget);
        self.budget -= n;
        let end = j.k + n;
        let r = self.read_responses(q, j.psn, j.va, j.rkey, j.len, j.k, end, out);
        j.k = end;
        self.job = (j.k < j.npkts).then_some(j);
        if let Err(bad) = r {
            self.error(q, bad, fail(NakCode::RemoteAccessError, None), None, out);
        }
    }

    /// Whether `p` is the in-sequence packet of a message that consumes a receive WQE (the
    /// QP then takes one from its SRQ first).
    pub(crate) fn needs_wqe(&self, p: &Pkt) -> bool {
        use Opcode::*;
        p.bth.psn == self.epsn
            && matches!(
                p.bth.opcode,
                SendFirst
                    | SendOnly
                    | SendOnlyWithImmediate
                    | SendOnlyWithInvalidate
                    | RdmaWriteLastWithImmediate
                    | RdmaWriteOnlyWithImmediate
            )
    }

    fn reply(&self, q: &QpCtx<'_>, opcode: Opcode, psn: u32) -> Pkt {
        Pkt {
            dst_node: q.dest_node,
            dst_ip: q.dest_ip,
            src_ip: None,
            src_node: q.src_node,
            src_qpn: q.qpn,
            bth: Bth::new(opcode, q.dest_qpn, psn),
            ext: ExtHeaders::default(),
            payload: Payload::Empty,
        }
    }

    /// Queue an ACK or NAK. **ACK coalescing**: a plain ACK replaces a plain ACK for an
    /// earlier (or the same) PSN that is still the last packet of this run's output, because
    /// ACKs are cumulative (IBA 9.7.5.1.2: an ACK for PSN n acknowledges every request up to
    /// n; its MSN and credits are the newer ones). A run that takes several messages from one
    /// receive batch (a GRO batch of a bandwidth stream) then sends one ACK, not one per
    /// message. NAKs and responses with data are never merged.
    fn ack(&self, q: &QpCtx<'_>, psn: u32, aeth: Aeth, out: &mut Out) {
        let mut p = self.reply(q, Opcode::Acknowledge, psn);
        p.ext.aeth = Some(aeth);
        let plain =
            |x: &Pkt| x.bth.opcode == Opcode::Acknowledge && x.ext.aeth.is_some_and(|a| a.is_ack());
        if let Some(last) = out.pkts.last_mut() {
            if plain(&p) && plain(last) && psn_cmp(last.bth.psn, psn) != std::cmp::Ordering::Greater
            {
                *last = p;
                return;
            }
        }
        out.pkts.push(p);
    }

    fn recv_wc(&self, q: &QpCtx<'_>, r: &RecvWqe, status: WcStatus, opcode: WcOpcode) -> Wc {
        crate::counters::recv_done(status);
        Wc {
            wr_id: r.wr_id,
            status,
            opcode,
            vendor_err: 0,
            byte_len: 0,
            imm_data: 0,
            qp_num: q.qpn,
            src_qp: q.dest_qpn,
            wc_flags: 0,
        }
    }

    /// Error: NAK with the packet's PSN, complete the receive WQE in use with its status,
    /// QP → ERR.
    fn error(&mut self, q: &QpCtx<'_>, psn: u32, f: Fail, taken: Option<RecvWqe>, out: &mut Out) {
        // A NAK acknowledges every earlier packet: their deferred placements must land first,
        // and one that could not is the error to report (it came first). Only WRITE packets
        // without a receive WQE leave placements pending (`write`), so `taken` is None then.
        out.flush_copies();
        if let Some((fpsn, side)) = out.resp_fault.take() {
            self.copy_failed(q, fpsn, side, taken, out);
            return;
        }
        self.job = None;
        self.backlog = VecDeque::new();
        crate::counters::nak_sent(f.nak);
        self.ack(q, psn, Aeth::nak(f.nak, self.msn), out);
        let recv = match std::mem::take(&mut self.message) {
            InboundMessage::Send { recv, .. } => Some(recv),
            _ => taken,
        };
        if let (Some(r), Some(st)) = (recv, f.recv_status) {
            let op = if f.nak == NakCode::RemoteAccessError {
                WcOpcode::RecvRdmaWithImm
            } else {
                WcOpcode::Recv
            };
            out.recv_wcs.push((self.recv_wc(q, &r, st, op), false));
        }
        if q.model == StatusModel::Hardware {
            let ev = f.event.unwrap_or(match f.nak {
                NakCode::RemoteAccessError => |qpn| AsyncEvent::QpAccessErr { qpn },
                _ => |qpn| AsyncEvent::QpReqErr { qpn },
            });
            out.events.push(ev(q.qpn));
        }
        out.error = true;
    }

    /// Request packet `psn` could not be copied: `Dst`, this side's memory (the target of a
    /// WRITE): a remote access violation, NAK remote access error, QP → ERR, `taken` (the
    /// receive WQE of a WRITE with immediate) completes with REM_ACCESS_ERR. `Src`, the
    /// requester's memory (loopback: this side copies from it): a NIC's requester fails that
    /// gather and never sends the packet, so the packet is taken as not received (the
    /// expected PSN goes back to it, the message under way is dropped) and the requester is
    /// told (`Notice::GatherFault`).
    pub(crate) fn copy_failed(
        &mut self,
        q: &QpCtx<'_>,
        psn: u32,
        side: Unreachable,
        taken: Option<RecvWqe>,
        out: &mut Out,
    ) {
        // Placements are deferred past the ACKs of their packets (coalesced copies): the
        // ACKs (and NAKs) this run produced for `psn` or later are withdrawn before they
        // leave, so nothing acknowledges bytes that did not land. What they acknowledged
        // before `psn` the NAK below acknowledges too; without a NAK (`Src`) the requester
        // moves to ERR anyway.
        out.pkts
            .retain(|p| p.bth.opcode != Opcode::Acknowledge || psn_cmp(p.bth.psn, psn).is_lt());
        match side {
            Unreachable::Dst => {
                if matches!(self.message, InboundMessage::Write { .. }) {
                    self.message = InboundMessage::None;
                }
                let f = fail(NakCode::RemoteAccessError, Some(WcStatus::RemAccessErr));
                self.error(q, psn, f, taken, out);
            }
            Unreachable::Src => {
                if let Some(r) = taken {
                    // Not reached (a receive WQE is never taken while placements wait), but a
                    // WQE is never lost: it ends as the QP's flush would end it.
                    let wc = self.recv_wc(q, &r, WcStatus::WrFlushErr, WcOpcode::Recv);
                    out.recv_wcs.push((wc, false));
                }
                if matches!(self.message, InboundMessage::Write { .. }) {
                    self.message = InboundMessage::None;
                }
                self.epsn = psn;
                out.peer_notices
                    .push((q.dest_node, q.dest_qpn, Notice::GatherFault { psn }));
            }
        }
    }

    /// READ response `psn` could not read its source (this side's memory): NAK remote access
    /// error with its PSN, QP → ERR, as for any remote access violation.
    pub(crate) fn read_source_fault(&mut self, q: &QpCtx<'_>, psn: u32, out: &mut Out) {
        self.error(q, psn, fail(NakCode::RemoteAccessError, None), None, out);
    }

    /// Process one request packet.
    pub(crate) fn on_request(
        &mut self,
        q: &QpCtx<'_>,
        rq: &mut VecDeque<RecvWqe>,
        p: Pkt,
        out: &mut Out,
    ) {
        use Opcode::*;
        let psn = p.bth.psn;
        let d = psn_diff(psn, self.epsn);
        if self.job.is_some() && !(d < 0 && p.bth.opcode == RdmaReadRequest) {
            // Responses leave in PSN order: everything but a duplicate READ (which replaces
            // the stream, `duplicate`) waits for the READ responses under way.
            if self.backlog.len() < BACKLOG_MAX {
                self.backlog.push_back(p);
            }
            return;
        }
        if d > 0 {
            crate::counters::out_of_seq(!self.sent_psn_nak);
            if !self.sent_psn_nak {
                self.sent_psn_nak = true;
                self.ack(
                    q,
                    self.epsn,
                    Aeth::nak(NakCode::PsnSequenceError, self.msn),
                    out,
                );
            }
            return;
        }
        if d < 0 {
            crate::counters::inc(crate::counters::Hw::DuplicateRequest);
            self.duplicate(q, p, out);
            return;
        }
        self.sent_psn_nak = false;
        let op = p.bth.opcode;
        // Opcode sequence.
        let seq_ok = match (&self.message, op) {
            (
                InboundMessage::Send { .. },
                SendMiddle | SendLast | SendLastWithImmediate | SendLastWithInvalidate,
            ) => true,
            (InboundMessage::Send { .. }, _) => false,
            (
                InboundMessage::Write { .. },
                RdmaWriteMiddle | RdmaWriteLast | RdmaWriteLastWithImmediate,
            ) => true,
            (InboundMessage::Write { .. }, _) => false,
            (
                InboundMessage::None,
                SendMiddle
                | SendLast
                | SendLastWithImmediate
                | SendLastWithInvalidate
                | RdmaWriteMiddle
                | RdmaWriteLast
                | RdmaWriteLastWithImmediate,
            ) => false,
            (InboundMessage::None, _) => true,
        };
        if !seq_ok {
            let st = Some(WcStatus::RemInvReqErr);
            self.error(q, psn, fail(NakCode::InvalidRequest, st), None, out);
            return;
        }
        // QP-level access: an unsupported operation → invalid request.
        let need = match op {
            RdmaWriteFirst
            | RdmaWriteMiddle
            | RdmaWriteLast
            | RdmaWriteLastWithImmediate
            | RdmaWriteOnly
            | RdmaWriteOnlyWithImmediate => AccessFlags::REMOTE_WRITE,
            RdmaReadRequest => AccessFlags::REMOTE_READ,
            CompareSwap | FetchAdd => AccessFlags::REMOTE_ATOMIC,
            _ => AccessFlags::empty(),
        };
        if !q.access.contains(need) {
            self.error(q, psn, fail(NakCode::InvalidRequest, None), None, out);
            return;
        }
        if matches!(op, RdmaReadRequest | CompareSwap | FetchAdd) && q.max_dest_rd_atomic == 0 {
            self.error(q, psn, fail(NakCode::InvalidRequest, None), None, out);
            return;
        }
        let needs_recv = matches!(
            op,
            SendFirst
                | SendOnly
                | SendOnlyWithImmediate
                | SendOnlyWithInvalidate
                | RdmaWriteLastWithImmediate
                | RdmaWriteOnlyWithImmediate
        );
        if needs_recv && rq.is_empty() {
            crate::counters::inc(crate::counters::Hw::SendRnrErr);
            self.ack(q, psn, Aeth::rnr_nak(q.min_rnr_timer, self.msn), out);
            return;
        }
        // Payload length rules.
        let n = p.payload.len();
        let len_ok = match op {
            SendFirst | SendMiddle | RdmaWriteFirst | RdmaWriteMiddle => n == q.mtu,
            SendLast
            | SendLastWithImmediate
            | SendLastWithInvalidate
            | RdmaWriteLast
            | RdmaWriteLastWithImmediate => (1..=q.mtu).contains(&n),
            _ => n <= q.mtu,
        };
        if !len_ok || p.ext.reth.is_some_and(|r| r.dma_len > 1 << 31) {
            self.error(
                q,
                psn,
                fail(NakCode::InvalidRequest, Some(WcStatus::RemInvReqErr)),
                None,
                out,
            );
            return;
        }
        match op {
            SendFirst
            | SendMiddle
            | SendLast
            | SendLastWithImmediate
            | SendLastWithInvalidate
            | SendOnly
            | SendOnlyWithImmediate
            | SendOnlyWithInvalidate => self.send(q, rq, p, out),
            RdmaWriteFirst
            | RdmaWriteMiddle
            | RdmaWriteLast
            | RdmaWriteLastWithImmediate
            | RdmaWriteOnly
            | RdmaWriteOnlyWithImmediate => self.write(q, rq, p, out),
            RdmaReadRequest => self.read(q, p, out),
            CompareSwap | FetchAdd => self.atomic(q, p, out),
            _ => {}
        }
    }

    fn finish_packet(&mut self, q: &QpCtx<'_>, p: &Pkt, out: &mut Out) {
        self.epsn = psn_add(p.bth.psn, 1);
        if p.bth.ack_req {
            self.ack(q, p.bth.psn, Aeth::ack(self.msn), out);
        }
    }

    fn send(&mut self, q: &QpCtx<'_>, rq: &mut VecDeque<RecvWqe>, p: Pkt, out: &mut Out) {
        let op = p.bth.opcode;
        let psn = p.bth.psn;
        if is_first_or_only(op) {
            let recv = rq.pop_front().expect("checked non-empty");
            self.message = InboundMessage::Send { recv, off: 0 };
        }
        let InboundMessage::Send { recv, off } = &mut self.message else {
            return;
        };
        let n = p.payload.len() as u64;
        let cap: u64 = recv.sges.iter().map(|s| u64::from(s.length)).sum();
        let hw = q.model == StatusModel::Hardware;
        if *off + n > cap {
            let f = if hw {
                fail(NakCode::InvalidRequest, Some(WcStatus::LocLenErr))
            } else {
                fail(NakCode::RemoteOperationalError, Some(WcStatus::LocQpOpErr))
            };
            self.error(q, psn, f, None, out);
            return;
        }
        let r = super::comp::scatter(q, &recv.sges, *off, n, &p.payload);
        if let Err(super::comp::PlaceError::Copy(side)) = r {
            match side {
                // The requester's memory (loopback): not received (see `copy_failed`); a
                // receive WQE this packet took goes back.
                Unreachable::Src => {
                    if is_first_or_only(op) {
                        if let InboundMessage::Send { recv, .. } = std::mem::take(&mut self.message)
                        {
                            rq.push_front(recv);
                        }
                    }
                    out.peer_notices
                        .push((q.dest_node, q.dest_qpn, Notice::GatherFault { psn }));
                }
                // The receive buffer could not be reached: a local protection error on the
                // receive WQE in both models (a fault, not a malformed WQE), the class of a
                // bad receive SGE (NAK remote operational error).
                Unreachable::Dst => {
                    let f = fail(NakCode::RemoteOperationalError, Some(WcStatus::LocProtErr));
                    self.error(q, psn, f, None, out);
                }
            }
            return;
        }
        if r.is_err() {
            let st = if hw {
                WcStatus::LocProtErr
            } else {
                WcStatus::LocQpOpErr
            };
            self.error(
                q,
                psn,
                fail(NakCode::RemoteOperationalError, Some(st)),
                None,
                out,
            );
            return;
        }
        *off += n;
        if is_last_or_only(op) {
            let InboundMessage::Send { recv, off } = std::mem::take(&mut self.message) else {
                unreachable!()
            };
            self.msn = (self.msn + 1) & MSN_MASK;
            let mut wc = self.recv_wc(q, &recv, WcStatus::Success, WcOpcode::Recv);
            wc.byte_len = off as u32;
            if let Some(imm) = p.ext.immdt {
                wc.imm_data = imm.0;
                wc.wc_flags |= WC_WITH_IMM;
            }
            let mut inv_failed = false;
            if let Some(ieth) = p.ext.ieth {
                match q.mem.invalidate_rkey(q.pd, q.qpn, ieth.rkey) {
                    Ok(()) => {
                        wc.imm_data = ieth.rkey;
                        wc.wc_flags |= WC_WITH_INV;
                    }
                    Err(_) => {
                        // Class J: the receive completes in error, the sender is still ACKed.
                        wc.status = WcStatus::RemInvReqErr;
                        inv_failed = true;
                    }
                }
            }
            out.recv_wcs.push((wc, p.bth.se));
            self.finish_packet(q, &p, out);
            if inv_failed {
                out.error = true;
            }
        } else {
            self.finish_packet(q, &p, out);
        }
    }

    fn write(&mut self, q: &QpCtx<'_>, rq: &mut VecDeque<RecvWqe>, mut p: Pkt, out: &mut Out) {
        let op = p.bth.opcode;
        let psn = p.bth.psn;
        let imm_recv = matches!(
            op,
            Opcode::RdmaWriteLastWithImmediate | Opcode::RdmaWriteOnlyWithImmediate
        );
        let rkey_fail = |s: &mut Self, rq: &mut VecDeque<RecvWqe>, out: &mut Out| {
            let taken = if imm_recv { rq.pop_front() } else { None };
            s.message = InboundMessage::None;
            s.error(
                q,
                psn,
                fail(NakCode::RemoteAccessError, Some(WcStatus::RemAccessErr)),
                taken,
                out,
            );
        };
        if let Some(reth) = p.ext.reth {
            let len = u64::from(reth.dma_len);
            // A message of one packet carrying all of it: the per-packet check below covers
            // exactly the same key, rights and range (and fails the same way), so the
            // message-wide check is skipped (one key lookup less per small WRITE).
            let single = is_last_or_only(op) && p.payload.len() as u64 == len;
            if len > 0
                && !single
                && q.mem
                    .check_access(
                        reth.rkey,
                        q.pd,
                        AccessFlags::REMOTE_WRITE,
                        reth.va,
                        len,
                        KeyUse::Remote,
                        q.qpn,
                    )
                    .is_err()
            {
                rkey_fail(self, rq, out);
                return;
            }
            self.message = InboundMessage::Write {
                va: reth.va,
                rkey: reth.rkey,
                len,
                off: 0,
            };
        }
        let InboundMessage::Write { va, rkey, len, off } = &mut self.message else {
            return;
        };
        let n = p.payload.len() as u64;
        let remaining = *len - *off;
        if n > remaining || (is_last_or_only(op) && n != remaining) {
            self.message = InboundMessage::None;
            let taken = if imm_recv { rq.pop_front() } else { None };
            self.error(
                q,
                psn,
                fail(NakCode::InvalidRequest, Some(WcStatus::RemInvReqErr)),
                taken,
                out,
            );
            return;
        }
        if n > 0 {
            match q.mem.check_access(
                *rkey,
                q.pd,
                AccessFlags::REMOTE_WRITE,
                va.wrapping_add(*off),
                n,
                KeyUse::Remote,
                q.qpn,
            ) {
                Ok(g) => {
                    let owner = CopyOwner::Resp { psn };
                    if let Err(side) = out.place(g, std::mem::take(&mut p.payload), owner) {
                        let taken = if imm_recv { rq.pop_front() } else { None };
                        self.copy_failed(q, psn, side, taken, out);
                        return;
                    }
                }
                Err(_) => {
                    rkey_fail(self, rq, out);
                    return;
                }
            }
        }
        *off += n;
        if imm_recv {
            // A receive completion follows: the placements must have landed. (ACKs need not
            // wait: a placement that fails later withdraws them, `copy_failed`.)
            out.flush_copies();
            if let Some((fpsn, side)) = out.resp_fault.take() {
                let taken = if imm_recv && side == Unreachable::Dst {
                    rq.pop_front()
                } else {
                    None
                };
                self.copy_failed(q, fpsn, side, taken, out);
                return;
            }
        }
        let InboundMessage::Write { len, .. } = &self.message else {
            return;
        };
        let len = *len;
        if is_last_or_only(op) {
            let total = len;
            self.message = InboundMessage::None;
            self.msn = (self.msn + 1) & MSN_MASK;
            if imm_recv {
                let r = rq.pop_front().expect("checked non-empty");
                let mut wc = self.recv_wc(q, &r, WcStatus::Success, WcOpcode::RecvRdmaWithImm);
                wc.byte_len = total as u32;
                wc.imm_data = p.ext.immdt.map(|i| i.0).unwrap_or(0);
                wc.wc_flags = WC_WITH_IMM;
                out.recv_wcs.push((wc, p.bth.se));
            }
        }
        self.finish_packet(q, &p, out);
    }

    fn read(&mut self, q: &QpCtx<'_>, p: Pkt, out: &mut Out) {
        let psn = p.bth.psn;
        let Some(reth) = p.ext.reth else { return };
        let len = u64::from(reth.dma_len);
        if len > 0
            && q.mem
                .check_access(
                    reth.rkey,
                    q.pd,
                    AccessFlags::REMOTE_READ,
                    reth.va,
                    len,
                    KeyUse::Remote,
                    q.qpn,
                )
                .is_err()
        {
            self.error(q, psn, fail(NakCode::RemoteAccessError, None), None, out);
            return;
        }
        let npkts = len.div_ceil(q.mtu as u64).max(1) as u32;
        let last = psn_add(psn, npkts - 1);
        self.push_res(
            q,
            ResponderResource::Read {
                first: psn,
                last,
                va: reth.va,
                rkey: reth.rkey,
                len,
            },
        );
        self.msn = (self.msn + 1) & MSN_MASK;
        self.epsn = psn_add(last, 1);
        self.job = Some(ReadJob {
            psn,
            va: reth.va,
            rkey: reth.rkey,
            len,
            k: 0,
            npkts,
        });
        self.pump(q, out);
    }

    fn push_res(&mut self, q: &QpCtx<'_>, r: ResponderResource) {
        let cap = q.max_dest_rd_atomic.max(1) as usize;
        while self.resources.len() >= cap {
            self.resources.pop_front();
        }
        self.resources.push_back(r);
    }

    /// Emit READ responses for packets `k0..end` of a READ of `len` bytes at `va` whose
    /// packet 0 has PSN `first` (packet 0 is FIRST or ONLY). Each packet re-checks the rkey
    /// for its own bytes; on failure returns that packet's PSN.
    #[allow(clippy::too_many_arguments)]
    fn read_responses(
        &self,
        q: &QpCtx<'_>,
        first: u32,
        va: u64,
        rkey: u32,
        len: u64,
        k0: u32,
        end: u32,
        out: &mut Out,
    ) -> Result<(), u32> {
        use Opcode::*;
        let mtu = q.mtu as u64;
        let npkts = len.div_ceil(mtu).max(1) as u32;
        for k in k0..end.min(npkts) {
            let psn = psn_add(first, k);
            let off = u64::from(k) * mtu;
            let n = (len - off.min(len)).min(mtu);
            let opcode = match (k == 0, k + 1 == npkts) {
                (true, true) => RdmaReadResponseOnly,
                (true, false) => RdmaReadResponseFirst,
                (false, false) => RdmaReadResponseMiddle,
                (false, true) => RdmaReadResponseLast,
            };
            let mut r = self.reply(q, opcode, psn);
            if opcode != RdmaReadResponseMiddle {
                r.ext.aeth = Some(Aeth::ack(self.msn));
            }
            if n > 0 {
                let g = q
                    .mem
                    .check_access(
                        rkey,
                        q.pd,
                        AccessFlags::REMOTE_READ,
                        va.wrapping_add(off),
                        n,
                        KeyUse::Remote,
                        q.qpn,
                    )
                    .map_err(|_| psn)?;
                r.payload = Payload::Mem(vec![(g, 0, n as usize)]);
            }
            out.pkts.push(r);
        }
        Ok(())
    }

    fn atomic(&mut self, q: &QpCtx<'_>, p: Pkt, out: &mut Out) {
        let psn = p.bth.psn;
        let Some(ae) = p.ext.atomic_eth else { return };
        if ae.va % 8 != 0 {
            self.error(q, psn, fail(NakCode::InvalidRequest, None), None, out);
            return;
        }
        let g = match q.mem.check_access(
            ae.rkey,
            q.pd,
            AccessFlags::REMOTE_ATOMIC,
            ae.va,
            8,
            KeyUse::Remote,
            q.qpn,
        ) {
            Ok(g) if g.va % 8 == 0 => g,
            Ok(_) => {
                self.error(q, psn, fail(NakCode::InvalidRequest, None), None, out);
                return;
            }
            Err(_) => {
                self.error(q, psn, fail(NakCode::RemoteAccessError, None), None, out);
                return;
            }
        };
        let opx = if p.bth.opcode == Opcode::CompareSwap {
            AtomicOp::CmpSwap {
                compare: ae.compare,
                swap: ae.swap_add,
            }
        } else {
            AtomicOp::FetchAdd { add: ae.swap_add }
        };
        let orig = copy::atomic(&g, opx);
        drop(g);
        let Ok(orig) = orig else {
            // The target could not be reached: a remote access violation.
            self.error(q, psn, fail(NakCode::RemoteAccessError, None), None, out);
            return;
        };
        self.push_res(q, ResponderResource::Atomic { psn, orig });
        self.msn = (self.msn + 1) & MSN_MASK;
        self.epsn = psn_add(psn, 1);
        self.atomic_ack(q, psn, orig, out);
    }

    fn atomic_ack(&self, q: &QpCtx<'_>, psn: u32, orig: u64, out: &mut Out) {
        let mut r = self.reply(q, Opcode::AtomicAcknowledge, psn);
        r.ext.aeth = Some(Aeth::ack(self.msn));
        r.ext.atomic_ack_eth = Some(AtomicAckEth { orig });
        out.pkts.push(r);
    }

    fn duplicate(&mut self, q: &QpCtx<'_>, p: Pkt, out: &mut Out) {
        let psn = p.bth.psn;
        match p.bth.opcode {
            Opcode::RdmaReadRequest => {
                // Answered only from a responder resource (the last `max_dest_rd_atomic`
                // READ/atomic requests), and only for the bytes the duplicate asks for, which
                // must lie within that READ (same rkey, its range, its PSNs): a retry asks for
                // what it still misses. Anything else is dropped silently (IBA class D; rxe).
                let Some(reth) = p.ext.reth else { return };
                let found = self.resources.iter().rev().find_map(|r| match *r {
                    ResponderResource::Read {
                        first,
                        last,
                        va,
                        rkey,
                        len,
                    } if psn_cmp(psn, first).is_ge() && psn_cmp(psn, last).is_le() => {
                        Some((last, va, rkey, len))
                    }
                    _ => None,
                });
                let Some((last, va, rkey, len)) = found else {
                    return;
                };
                let dlen = u64::from(reth.dma_len);
                let dpkts = dlen.div_ceil(q.mtu as u64).max(1) as u32;
                let within = reth.rkey == rkey
                    && reth.va >= va
                    && reth
                        .va
                        .checked_add(dlen)
                        .is_some_and(|e| e <= va.saturating_add(len))
                    && psn_diff(last, psn) >= i32::try_from(dpkts - 1).unwrap_or(i32::MAX);
                if !within {
                    return;
                }
                // It replaces the stream under way (a requester that retries wants this one
                // first; it re-requests whatever else it misses), so duplicates of one READ
                // never add up: each restarts the same stream.
                self.job = Some(ReadJob {
                    psn,
                    va: reth.va,
                    rkey,
                    len: dlen,
                    k: 0,
                    npkts: dpkts,
                });
                self.backlog.retain(|b| {
                    b.bth.opcode != Opcode::RdmaReadRequest || psn_diff(b.bth.psn, self.epsn) >= 0
                });
                self.pump(q, out);
            }
            Opcode::CompareSwap | Opcode::FetchAdd => {
                let found = self.resources.iter().rev().find_map(|r| match *r {
                    ResponderResource::Atomic { psn: rp, orig } if rp == psn => Some(orig),
                    _ => None,
                });
                if let Some(orig) = found {
                    self.atomic_ack(q, psn, orig, out);
                }
            }
            _ => {
                let last = crate::wire::psn_sub(self.epsn, 1);
                self.ack(q, last, Aeth::ack(self.msn), out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Bounded responder resources: duplicate READs answered within the resources and the
    //! range they were given, and READ responses streamed in bounded bursts.
    use std::time::Instant;

    use super::{BACKLOG_MAX, READ_BURST};
    use crate::driver::loopback::drive_until_idle;
    use crate::pkt::{Payload, Pkt};
    use crate::qp::{rc_connect, QpState, SendWr, WrOpcode};
    use crate::wire::{Bth, ExtHeaders, Opcode, Reth};
    use crate::{AccessFlags as A, Context};

    const MTU: u64 = 1024; // rc_connect with IBV_MTU_1024

    struct Pair {
        a: Context,
        aqp: u32,
        acq: u32,
        b: Context,
        bqp: u32,
        src: std::sync::Arc<Vec<u8>>,
        dst: std::sync::Arc<Vec<u8>>,
        rkey: u32,
        lkey: u32,
    }

    /// Two manual hosts, `b` exposing `len` bytes for READ, `a` a `len`-byte destination.
    fn pair(len: usize) -> Pair {
        let all = A::LOCAL_WRITE | A::REMOTE_WRITE | A::REMOTE_READ | A::REMOTE_ATOMIC;
        let (a, apd, acq, aqp) = crate::testkit::host::manual_rc_host(256, true);
        let (b, bpd, _, bqp) = crate::testkit::host::manual_rc_host(256, true);
        rc_connect(&a, aqp, &b, bqp, all, 3).unwrap();
        let src = std::sync::Arc::new((0..len).map(|i| (i * 7 + 3) as u8).collect::<Vec<u8>>());
        let dst = std::sync::Arc::new(vec![0u8; len]);
        let sm = b
            .reg_mr_va(bpd, crate::UserMemory::owned(src.clone()), all)
            .unwrap();
        let dm = a
            .reg_mr_va(apd, crate::UserMemory::owned(dst.clone()), all)
            .unwrap();
        Pair {
            a,
            aqp,
            acq,
            b,
            bqp,
            src,
            dst,
            rkey: sm.rkey,
            lkey: dm.lkey,
        }
    }

    impl Pair {
        /// A READ of `len` bytes at offset `off`, run to completion.
        fn read(&mut self, wr_id: u64, off: u64, len: u32) {
            let wr = SendWr::new(wr_id, WrOpcode::RdmaRead)
                .sge(self.dst.as_ptr() as u64 + off, len, self.lkey)
                .remote(self.src.as_ptr() as u64 + off, self.rkey);
            self.a.post_send(self.aqp, &[wr]).unwrap();
            drive_until_idle(&[&self.a, &self.b]);
            let mut wcs = Vec::new();
            self.a.poll_cq(self.acq, &mut wcs, 16).unwrap();
            assert_eq!(wcs.len(), 1, "{wcs:?}");
            assert_eq!(wcs[0].status, crate::cq::WcStatus::Success);
        }

        /// A crafted READ request from `a`'s QP to `b` (a duplicate when `psn` was used).
        fn read_request(&self, psn: u32, off: u64, len: u32) -> Pkt {
            let mut bth = Bth::new(Opcode::RdmaReadRequest, self.bqp, psn);
            bth.ack_req = true;
            Pkt {
                dst_node: self.b.node_id(),
                dst_ip: None,
                src_ip: None,
                src_node: self.a.node_id(),
                src_qpn: self.aqp,
                bth,
                ext: ExtHeaders {
                    reth: Some(Reth {
                        va: self.src.as_ptr() as u64 + off,
                        rkey: self.rkey,
                        dma_len: len,
                    }),
                    ..ExtHeaders::default()
                },
                payload: Payload::Empty,
            }
        }

        /// Run `b`'s QP until it has nothing left to send; (packets, payload bytes) per run.
        fn drain_b(&self) -> Vec<(usize, u64)> {
            let q = self.b.dev.dp.qp_object(self.bqp).unwrap();
            let mut runs = Vec::new();
            loop {
                let pkts = q.run(&self.b, Instant::now());
                if pkts.is_empty() {
                    return runs;
                }
                let bytes = pkts.iter().map(|p| p.payload.len() as u64).sum();
                runs.push((pkts.len(), bytes));
                assert!(runs.len() < 100_000, "the responder never stops sending");
            }
        }

        fn pending(&self) -> (u32, usize) {
            let q = self.b.dev.dp.qp_object(self.bqp).unwrap();
            let g = q.inner.lock();
            g.resp.pending()
        }
    }

    #[test]
    fn duplicate_reads_restart_one_stream_instead_of_adding_up() {
        // The report: 200 duplicate READ requests (28-byte packets) of a 330 KB READ produced
        // 66 MB of responses (each replayed the whole READ). Now each duplicate restarts the
        // one stream of that READ: the burst costs about one READ.
        const LEN: u32 = 330_000;
        let mut p = pair(LEN as usize);
        p.read(1, 0, LEN);
        assert!(p.dst == p.src);
        for _ in 0..200 {
            p.b.dev.dp.enqueue_packet(p.read_request(0, 0, LEN));
        }
        let runs = p.drain_b();
        let total: u64 = runs.iter().map(|r| r.1).sum();
        // At most the burst cut short by the restarts plus one whole READ (66 MB before).
        assert!(
            total <= 2 * u64::from(LEN),
            "{total} bytes of responses for 200 duplicates of a {LEN}-byte READ"
        );
        assert!(
            total >= u64::from(LEN),
            "the last duplicate is answered in full"
        );
        assert!(
            runs.iter().all(|&(n, _)| n <= READ_BURST as usize + 1),
            "bounded per run: {runs:?}"
        );
        assert_eq!(p.pending(), (0, 0), "nothing held after the burst");
    }

    #[test]
    fn a_duplicate_read_gets_only_the_range_it_asks_for_and_only_within_the_original() {
        const LEN: u32 = 64 * 1024;
        let mut p = pair(LEN as usize);
        p.read(1, 0, LEN);
        // A retry from packet 60 (the last 4 KiB): 4 packets, not the whole READ again.
        p.b.dev
            .dp
            .enqueue_packet(p.read_request(60, 60 * MTU, 4 * MTU as u32));
        let bytes: u64 = p.drain_b().iter().map(|r| r.1).sum();
        assert_eq!(bytes, 4 * MTU);
        // Beyond the original READ's range, longer than it, another rkey, or PSNs past its
        // last: dropped, nothing sent.
        for bad in [
            p.read_request(0, 0, LEN + 1),
            p.read_request(60, 60 * MTU, 8 * MTU as u32),
            {
                let mut r = p.read_request(0, 0, 16);
                r.ext.reth.as_mut().unwrap().rkey ^= 0x100;
                r
            },
            {
                let mut r = p.read_request(0, 0, 16);
                r.ext.reth.as_mut().unwrap().va -= 1;
                r
            },
        ] {
            p.b.dev.dp.enqueue_packet(bad);
            assert!(
                p.drain_b().is_empty(),
                "a duplicate outside the READ is dropped"
            );
        }
        assert_eq!(p.b.qp_state(p.bqp).unwrap(), QpState::Rts);
    }

    #[test]
    fn duplicates_are_answered_only_within_the_responder_resources() {
        // max_dest_rd_atomic 16 (rc_connect): after 16 newer READs the first one's resource
        // is gone and its duplicate is dropped, as hardware drops it.
        let mut p = pair(64 * 1024);
        for i in 0..17u64 {
            p.read(i, i * 1024, 1024);
        }
        p.b.dev.dp.enqueue_packet(p.read_request(0, 0, 1024));
        assert!(p.drain_b().is_empty(), "evicted: not answered");
        p.b.dev
            .dp
            .enqueue_packet(p.read_request(16, 16 * 1024, 1024));
        assert_eq!(p.drain_b().iter().map(|r| r.1).sum::<u64>(), 1024);
    }

    #[test]
    fn a_large_read_streams_in_bounded_bursts_and_requests_behind_it_wait_in_order() {
        const LEN: u32 = 4 << 20; // 4096 packets at MTU 1024
        let p = pair(LEN as usize);
        let wr = SendWr::new(1, WrOpcode::RdmaRead)
            .sge(p.dst.as_ptr() as u64, LEN, p.lkey)
            .remote(p.src.as_ptr() as u64, p.rkey);
        p.a.post_send(p.aqp, &[wr]).unwrap();
        // Move the request to b without running b, then run b's QP by hand.
        p.a.progress_once(Instant::now());
        let q = p.b.dev.dp.qp_object(p.bqp).unwrap();
        let first = q.run(&p.b, Instant::now());
        assert_eq!(first.len(), READ_BURST as usize, "one burst per run");
        let (left, backlog) = p.pending();
        assert_eq!(left, 4096 - READ_BURST, "the rest waits for the next runs");
        assert_eq!(backlog, 0);
        // Requests arriving meanwhile wait (bounded) behind the stream.
        for i in 0..(BACKLOG_MAX as u32 + 50) {
            p.b.dev.dp.enqueue_packet(p.read_request(4096 + i, 0, 8));
        }
        let q2 = q.clone();
        drop(first);
        let pkts = q2.run(&p.b, Instant::now());
        assert!(pkts.len() <= READ_BURST as usize);
        assert_eq!(p.pending().1, BACKLOG_MAX, "the backlog is bounded");
        drop(pkts);
        // Delivering everything completes the READ with the right bytes.
        drive_until_idle(&[&p.a, &p.b]);
        let mut wcs = Vec::new();
        p.a.poll_cq(p.acq, &mut wcs, 16).unwrap();
        assert_eq!(wcs.len(), 1, "{wcs:?}");
        assert_eq!(wcs[0].status, crate::cq::WcStatus::Success);
        assert!(p.dst == p.src);
        let g = q.inner.lock();
        assert_eq!(g.resp.pending(), (0, 0));
        assert!(
            g.resp.backlog.capacity() <= 64,
            "the backlog's memory was returned"
        );
    }
}
