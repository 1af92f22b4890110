//! Requester: send WQEs → request packets (sans-IO). Segments SEND/WRITE by path MTU, builds
//! BTH/RETH/ImmDt/IETH/AtomicETH, gathers local SGEs through the access predicate (one
//! guarded piece per SGE fragment per packet), applies the flow limits (128 unacked PSNs,
//! `max_rd_atomic`, FENCE, LOCAL_INV/BIND_MW ordering) and executes local operations.
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::time::Instant;

use super::comp::Completer;
use super::{send_flags, Out, QpCtx, SendWr, Sge, WrOpcode};
use crate::access::AccessFlags;
use crate::cq::{Wc, WcStatus};
use crate::device::StatusModel;
use crate::mr::{AccessDenied, KeyUse};
use crate::pkt::{Payload, Pkt};
use crate::wire::{
    psn_add, psn_cmp, psn_diff, AtomicEth, Bth, ExtHeaders, Ieth, ImmDt, Opcode, Reth,
};

/// Maximum PSNs in flight past the oldest unacknowledged one (rxe).
pub const MAX_UNACKED_PSNS: i32 = 128;
/// AckReq at least every this many packets (rxe).
pub const MAX_PKT_PER_ACK: u32 = 64;

/// Progress of one WQE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WqeState {
    Pending,
    Sending,
    Wait,
    Done(WcStatus),
}

/// A send WQE.
#[derive(Debug)]
pub(crate) struct Wqe {
    /// The work request, without its unused vector: an inline WQE's `sg_list` and every
    /// WQE's `inline_data` are empty here (see `inline_bytes`).
    pub wr: SendWr,
    /// An inline WQE's bytes (copied at post time; in the WQE itself up to
    /// `pkt::SMALL_PAYLOAD` bytes, so posting a short inline message allocates nothing).
    pub inline_bytes: Payload,
    pub len: u64,
    pub inline: bool,
    pub first_psn: u32,
    pub last_psn: u32,
    /// `first_psn..=last_psn` were assigned (the WQE was started once). A retry resends the
    /// same PSNs, so a WQE put back to `Pending` by a rewind keeps them: an ACK can still
    /// acknowledge it and a later rewind can still find it.
    pub psn_valid: bool,
    pub npkts: u32,
    /// SEND/WRITE: packets sent. READ: response packets received in order (the next one
    /// expected is `sent`).
    pub sent: u32,
    pub st: WqeState,
    /// READ: responses that arrived ahead of `sent` and were placed already
    /// ([`ReadWindow`]); allocated at the first such response.
    pub ahead: Option<Box<ReadWindow>>,
}

/// Response packets of a READ that arrived ahead of the next expected one (reordered on the
/// way) and were placed in the destination already, by packet index: bit `k % BITS` stands
/// for packet `k` in `sent + 1 .. sent + BITS`. Their bytes are final (a READ response
/// carries the bytes of its own offset), so they need not be requested again.
#[derive(Debug, Clone, Default)]
pub(crate) struct ReadWindow([u64; ReadWindow::WORDS]);

impl ReadWindow {
    const WORDS: usize = 16;
    /// Packets the window reaches past the next expected one.
    pub(crate) const BITS: u32 = 64 * Self::WORDS as u32;

    pub(crate) fn set(&mut self, k: u32) {
        let b = (k % Self::BITS) as usize;
        self.0[b / 64] |= 1 << (b % 64);
    }

    /// Whether packet `k` is here, clearing its bit.
    pub(crate) fn take(&mut self, k: u32) -> bool {
        let b = (k % Self::BITS) as usize;
        let had = self.0[b / 64] & (1 << (b % 64)) != 0;
        self.0[b / 64] &= !(1 << (b % 64));
        had
    }

    pub(crate) fn has(&self, k: u32) -> bool {
        let b = (k % Self::BITS) as usize;
        self.0[b / 64] & (1 << (b % 64)) != 0
    }
}

impl Wqe {
    #[cfg(test)]
    pub(crate) fn new(wr: SendWr, len: u64, inline: bool) -> Wqe {
        Wqe::from_wr(&wr, len, inline)
    }

    /// The WQE of a validated work request: copies what the device needs of it, without
    /// allocating for an inline message of up to `pkt::SMALL_PAYLOAD` bytes.
    pub(crate) fn from_wr(wr: &SendWr, len: u64, inline: bool) -> Wqe {
        let stored = SendWr {
            wr_id: wr.wr_id,
            opcode: wr.opcode,
            flags: wr.flags,
            sg_list: if inline {
                Vec::new()
            } else {
                wr.sg_list.clone()
            },
            imm_data: wr.imm_data,
            invalidate_rkey: wr.invalidate_rkey,
            remote_addr: wr.remote_addr,
            rkey: wr.rkey,
            compare_add: wr.compare_add,
            swap: wr.swap,
            bind: wr.bind,
            inline_data: Vec::new(),
        };
        Wqe {
            wr: stored,
            inline_bytes: if inline {
                Payload::copied(&wr.inline_data)
            } else {
                Payload::Empty
            },
            len,
            inline,
            first_psn: 0,
            last_psn: 0,
            psn_valid: false,
            npkts: 0,
            sent: 0,
            st: WqeState::Pending,
            ahead: None,
        }
    }
    pub(crate) fn wc(&self, qpn: u32, status: WcStatus) -> Wc {
        Wc {
            wr_id: self.wr.wr_id,
            status,
            opcode: self.wr.opcode.wc_opcode(),
            vendor_err: 0,
            byte_len: self.len as u32,
            imm_data: 0,
            qp_num: qpn,
            src_qp: 0,
            wc_flags: 0,
        }
    }
    pub(crate) fn flush_wc(&self, qpn: u32) -> Wc {
        self.wc(qpn, WcStatus::WrFlushErr)
    }
    /// `psn` is one of this unfinished WQE's PSNs.
    pub(crate) fn contains(&self, psn: u32) -> bool {
        self.psn_valid
            && !matches!(self.st, WqeState::Done(_))
            && psn_cmp(psn, self.first_psn).is_ge()
            && psn_cmp(psn, self.last_psn).is_le()
    }
}

/// The send queue: WQEs in post order; `cursor` is the first WQE the requester has not
/// finished sending.
#[derive(Debug, Default)]
pub(crate) struct SendQueue {
    pub q: VecDeque<Wqe>,
    pub cursor: usize,
}

impl SendQueue {
    /// WQEs started and not finished (SQD is drained when this is 0: WQEs not yet started
    /// wait for the return to RTS).
    pub(crate) fn in_flight(&self) -> usize {
        self.q
            .iter()
            .filter(|w| matches!(w.st, WqeState::Sending | WqeState::Wait))
            .count()
    }
}

/// Requester state.
#[derive(Debug, Default)]
pub(crate) struct Requester {
    /// Next PSN to send (behind `max_psn` while a retry resends).
    pub psn: u32,
    /// One past the highest PSN ever sent: responses for PSNs at or beyond it answer nothing
    /// we sent and are ignored (IBA 9.7.5.1: outside the outstanding window).
    pub max_psn: u32,
    pkts_since_ackreq: u32,
}

/// Status for a failed local gather (`docs/datapath.md`).
pub(crate) fn gather_status(model: StatusModel, d: AccessDenied) -> WcStatus {
    match (model, d) {
        (_, AccessDenied::Fault) => WcStatus::LocProtErr,
        (StatusModel::Rxe, _) => WcStatus::LocQpOpErr,
        (StatusModel::Hardware, _) => WcStatus::LocProtErr,
    }
}

impl QpCtx<'_> {
    /// The lkey check for `len` bytes at offset `soff` of the local SGE `s`, through the one
    /// access predicate (`MemCore::check_access`): gathers need no rights, scatters (READ
    /// data, atomic results, received SENDs) need LOCAL_WRITE.
    pub(crate) fn local_sge(
        &self,
        s: &Sge,
        soff: u64,
        len: u64,
        need: AccessFlags,
    ) -> Result<crate::mr::MrGuard, AccessDenied> {
        self.mem.check_access(
            s.lkey,
            self.pd,
            need,
            s.addr.wrapping_add(soff),
            len,
            KeyUse::Local,
            self.qpn,
        )
    }
}

/// Walk the SGE fragments covering `[off, off+n)` of a message.
pub(crate) fn for_pieces(
    sges: &[Sge],
    mut off: u64,
    mut n: u64,
    mut f: impl FnMut(&Sge, u64, u64) -> Result<(), AccessDenied>,
) -> Result<(), AccessDenied> {
    for s in sges {
        if n == 0 {
            break;
        }
        let l = u64::from(s.length);
        if l == 0 {
            continue; // zero-length SGEs are never key-checked
        }
        if off >= l {
            off -= l;
            continue;
        }
        let k = (l - off).min(n);
        f(s, off, k)?;
        n -= k;
        off = 0;
    }
    if n > 0 {
        return Err(AccessDenied::OutOfRange);
    }
    Ok(())
}

impl Requester {
    pub(crate) fn start(&mut self, psn: u32) {
        self.psn = psn;
        self.max_psn = psn;
        self.pkts_since_ackreq = 0;
    }

    pub(crate) fn reset_flow(&mut self) {
        self.pkts_since_ackreq = 0;
    }

    /// Restart sending at `psn`: go back (go-back-N after a NAK or timeout) or skip ahead
    /// (an ACK acknowledged PSNs a retry had not resent yet). The WQE containing `psn`
    /// resumes there and later unfinished ones restart. When no WQE contains it, every PSN
    /// sent before `psn` has been acknowledged: the next new WQE starts at `psn`.
    pub(crate) fn rewind(&mut self, sq: &mut SendQueue, psn: u32) {
        let Some(idx) = sq.q.iter().position(|w| w.contains(psn)) else {
            if psn_cmp(psn, self.psn).is_gt() && psn_cmp(psn, self.max_psn).is_le() {
                self.psn = psn;
                sq.cursor =
                    sq.q.iter()
                        .position(|w| !matches!(w.st, WqeState::Done(_)))
                        .unwrap_or(sq.q.len());
            }
            return;
        };
        let k = psn_diff(psn, sq.q[idx].first_psn).max(0) as u32;
        {
            let w = &mut sq.q[idx];
            let sent = if w.wr.opcode.is_atomic() { 0 } else { k };
            if sent != w.sent {
                w.ahead = None; // its bits are relative to the old `sent`
            }
            w.sent = sent;
            w.st = WqeState::Sending;
        }
        for w in sq.q.iter_mut().skip(idx + 1) {
            if !matches!(w.st, WqeState::Done(_)) {
                w.st = WqeState::Pending;
                w.sent = 0;
                w.ahead = None;
            }
        }
        sq.cursor = idx;
        self.psn = psn;
    }

    /// Send what the flow limits allow.
    pub(crate) fn step(
        &mut self,
        q: &QpCtx<'_>,
        sq: &mut SendQueue,
        comp: &mut Completer,
        now: Instant,
        out: &mut Out,
    ) {
        if let Some(p) = comp.take_rewind(now) {
            self.rewind(sq, p);
        }
        if psn_cmp(comp.comp_psn, self.psn).is_gt() && !comp.rnr_pending() {
            // An ACK covered PSNs this retry has not resent yet (the responder had them
            // from an earlier copy): continue after them instead of resending duplicates,
            // and above all never give a new WQE PSNs the responder already consumed.
            self.rewind(sq, comp.comp_psn);
        }
        if comp.rnr_pending() {
            return;
        }
        let mut rd_out =
            sq.q.iter()
                .take(sq.cursor)
                .filter(|w| w.wr.opcode.is_rd_atomic() && w.st == WqeState::Wait)
                .count() as u32;
        while sq.cursor < sq.q.len() {
            let idx = sq.cursor;
            let w = &sq.q[idx];
            match w.st {
                WqeState::Done(_) | WqeState::Wait => {
                    sq.cursor += 1;
                    continue;
                }
                WqeState::Pending if q.state == super::QpState::Sqd => break,
                _ => {}
            }
            if psn_diff(self.psn, comp.comp_psn) >= MAX_UNACKED_PSNS {
                break;
            }
            let op = w.wr.opcode;
            let earlier_done = |sq: &SendQueue| {
                sq.q.iter()
                    .take(idx)
                    .all(|w| matches!(w.st, WqeState::Done(_)))
            };
            if op.is_local() {
                if !earlier_done(sq) {
                    break;
                }
                let status = exec_local(q, &sq.q[idx].wr);
                sq.q[idx].st = WqeState::Done(status);
                sq.cursor += 1;
                if status != WcStatus::Success {
                    out.error = true;
                    return;
                }
                continue;
            }
            if w.wr.flags & send_flags::FENCE != 0
                && sq
                    .q
                    .iter()
                    .take(idx)
                    .any(|x| x.wr.opcode.is_rd_atomic() && !matches!(x.st, WqeState::Done(_)))
            {
                break;
            }
            if op.is_rd_atomic() && rd_out >= q.max_rd_atomic.max(1) {
                break;
            }
            if self.psn == comp.comp_psn {
                comp.mark_activity(now);
            }
            let w = &mut sq.q[idx];
            if w.st == WqeState::Pending {
                debug_assert!(
                    !w.psn_valid || w.first_psn == self.psn,
                    "a retried WQE keeps its PSNs"
                );
                w.psn_valid = true;
                w.first_psn = self.psn;
                w.npkts = if op.is_atomic() {
                    1
                } else {
                    (w.len.div_ceil(q.mtu as u64)).max(1) as u32
                };
                w.last_psn = psn_add(w.first_psn, w.npkts - 1);
                w.sent = 0;
                w.ahead = None;
                w.st = WqeState::Sending;
            }
            if op.is_rd_atomic() {
                out.pkts.push(self.rd_atomic_packet(q, w));
                self.psn = psn_add(w.last_psn, 1);
                self.note_sent();
                w.st = WqeState::Wait;
                rd_out += 1;
                sq.cursor += 1;
                continue;
            }
            // SEND / WRITE: one packet per PSN within the window.
            while w.sent < w.npkts {
                if psn_diff(self.psn, comp.comp_psn) >= MAX_UNACKED_PSNS {
                    return;
                }
                match self.data_packet(q, w) {
                    Ok(p) => out.pkts.push(p),
                    Err(status) => {
                        w.st = WqeState::Done(status);
                        sq.cursor += 1;
                        out.error = true;
                        return;
                    }
                }
                w.sent += 1;
                self.psn = psn_add(self.psn, 1);
                self.note_sent();
            }
            w.st = WqeState::Wait;
            sq.cursor += 1;
        }
    }

    fn note_sent(&mut self) {
        if psn_cmp(self.psn, self.max_psn).is_gt() {
            self.max_psn = self.psn;
        }
    }

    fn pkt(&self, q: &QpCtx<'_>, opcode: Opcode, psn: u32) -> Pkt {
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

    fn rd_atomic_packet(&mut self, q: &QpCtx<'_>, w: &Wqe) -> Pkt {
        self.pkts_since_ackreq = 0;
        if w.wr.opcode == WrOpcode::RdmaRead {
            let done = u64::from(w.sent) * q.mtu as u64;
            let mut p = self.pkt(q, Opcode::RdmaReadRequest, psn_add(w.first_psn, w.sent));
            p.ext.reth = Some(Reth {
                va: w.wr.remote_addr.wrapping_add(done),
                rkey: w.wr.rkey,
                dma_len: (w.len - done.min(w.len)) as u32,
            });
            p.bth.ack_req = true;
            p
        } else {
            let cmp = w.wr.opcode == WrOpcode::AtomicCmpAndSwp;
            let mut p = self.pkt(
                q,
                if cmp {
                    Opcode::CompareSwap
                } else {
                    Opcode::FetchAdd
                },
                w.first_psn,
            );
            p.ext.atomic_eth = Some(AtomicEth {
                va: w.wr.remote_addr,
                rkey: w.wr.rkey,
                swap_add: if cmp { w.wr.swap } else { w.wr.compare_add },
                compare: if cmp { w.wr.compare_add } else { 0 },
            });
            p.bth.ack_req = true;
            p
        }
    }

    fn data_packet(&mut self, q: &QpCtx<'_>, w: &Wqe) -> Result<Pkt, WcStatus> {
        use Opcode::*;
        let k = w.sent;
        let first = k == 0;
        let last = k + 1 == w.npkts;
        let off = u64::from(k) * q.mtu as u64;
        let n = (w.len - off).min(q.mtu as u64);
        let op = w.wr.opcode;
        let opcode = match (op, first, last) {
            (WrOpcode::Send | WrOpcode::SendWithImm | WrOpcode::SendWithInv, true, false) => {
                SendFirst
            }
            (WrOpcode::Send | WrOpcode::SendWithImm | WrOpcode::SendWithInv, false, false) => {
                SendMiddle
            }
            (WrOpcode::Send, false, true) => SendLast,
            (WrOpcode::Send, true, true) => SendOnly,
            (WrOpcode::SendWithImm, false, true) => SendLastWithImmediate,
            (WrOpcode::SendWithImm, true, true) => SendOnlyWithImmediate,
            (WrOpcode::SendWithInv, false, true) => SendLastWithInvalidate,
            (WrOpcode::SendWithInv, true, true) => SendOnlyWithInvalidate,
            (_, true, false) => RdmaWriteFirst,
            (_, false, false) => RdmaWriteMiddle,
            (WrOpcode::RdmaWriteWithImm, false, true) => RdmaWriteLastWithImmediate,
            (WrOpcode::RdmaWriteWithImm, true, true) => RdmaWriteOnlyWithImmediate,
            (_, false, true) => RdmaWriteLast,
            (_, true, true) => RdmaWriteOnly,
        };
        let mut p = self.pkt(q, opcode, self.psn);
        let h = opcode.headers();
        use crate::wire::HeaderSet;
        if h.contains(HeaderSet::RETH) {
            p.ext.reth = Some(Reth {
                va: w.wr.remote_addr,
                rkey: w.wr.rkey,
                dma_len: w.len as u32,
            });
        }
        if h.contains(HeaderSet::IMMDT) {
            p.ext.immdt = Some(ImmDt(w.wr.imm_data));
        }
        if h.contains(HeaderSet::IETH) {
            p.ext.ieth = Some(Ieth {
                rkey: w.wr.invalidate_rkey,
            });
        }
        p.bth.se =
            last && w.wr.flags & send_flags::SOLICITED != 0 && !matches!(op, WrOpcode::RdmaWrite);
        self.pkts_since_ackreq += 1;
        if last || self.pkts_since_ackreq >= MAX_PKT_PER_ACK {
            p.bth.ack_req = true;
            self.pkts_since_ackreq = 0;
        }
        p.payload = if n == 0 {
            Payload::Empty
        } else if w.inline {
            let bytes = w.inline_bytes.contiguous().unwrap_or(&[]);
            Payload::copied(&bytes[off as usize..(off + n) as usize])
        } else {
            let mut pieces = Vec::with_capacity(1);
            for_pieces(&w.wr.sg_list, off, n, |s, soff, len| {
                let g = q.local_sge(s, soff, len, AccessFlags::empty())?;
                pieces.push((g, 0, len as usize));
                Ok(())
            })
            .map_err(|d| gather_status(q.model, d))?;
            Payload::Mem(pieces)
        };
        Ok(p)
    }
}

fn exec_local(q: &QpCtx<'_>, wr: &SendWr) -> WcStatus {
    match wr.opcode {
        WrOpcode::LocalInv => match q.mem.invalidate_rkey(q.pd, q.qpn, wr.invalidate_rkey) {
            Ok(()) => WcStatus::Success,
            Err(_) => WcStatus::LocQpOpErr,
        },
        WrOpcode::BindMw => {
            let Some(b) = wr.bind else {
                return WcStatus::MwBindErr;
            };
            match q.mem.bind_mw(q.pd, q.qpn, b.mw_rkey, b.new_key, b.info) {
                Ok(_) => WcStatus::Success,
                Err(_) => WcStatus::MwBindErr,
            }
        }
        _ => WcStatus::LocQpOpErr,
    }
}
