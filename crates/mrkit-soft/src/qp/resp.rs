//! Responder: request packets → memory, ACK/NAK, read responses, atomic results (sans-IO).
//!
//! Order of checks (semantics.md §6.4, roce.md §3.4): PSN (ahead → one PSN-sequence NAK;
//! behind → duplicate: re-ACK, replay a READ from its resource, or resend a saved atomic
//! result), opcode sequence, QP access flags, responder resources, receive WQE (RNR NAK),
//! lengths, rkey through the access predicate (once for the whole RETH range, then again for
//! every packet's bytes so a dereg mid-message stops the next packet), execution.
#![forbid(unsafe_code)]

use std::collections::VecDeque;

use super::{Out, QpCtx, RecvWqe};
use crate::access::AccessFlags;
use crate::copy::{self, AtomicOp};
use crate::cq::{Wc, WcOpcode, WcStatus, WC_WITH_IMM, WC_WITH_INV};
use crate::device::StatusModel;
use crate::mr::KeyUse;
use crate::net::{Payload, Pkt};
use crate::progress::AsyncEvent;
use crate::wire::{
    psn_add, psn_cmp, psn_diff, Aeth, AtomicAckEth, Bth, ExtHeaders, NakCode, Opcode, MSN_MASK,
};

#[derive(Debug, Default)]
enum Cur {
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

#[derive(Debug, Clone, Copy)]
enum Res {
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

/// Responder state.
#[derive(Debug, Default)]
pub(crate) struct Responder {
    epsn: u32,
    msn: u32,
    sent_psn_nak: bool,
    cur: Cur,
    res: VecDeque<Res>,
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
        self.ack(q, psn, Aeth::nak(f.nak, self.msn), out);
        let recv = match std::mem::take(&mut self.cur) {
            Cur::Send { recv, .. } => Some(recv),
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
        if d > 0 {
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
            self.duplicate(q, p, out);
            return;
        }
        self.sent_psn_nak = false;
        let op = p.bth.opcode;
        // Opcode sequence.
        let seq_ok = match (&self.cur, op) {
            (
                Cur::Send { .. },
                SendMiddle | SendLast | SendLastWithImmediate | SendLastWithInvalidate,
            ) => true,
            (Cur::Send { .. }, _) => false,
            (Cur::Write { .. }, RdmaWriteMiddle | RdmaWriteLast | RdmaWriteLastWithImmediate) => {
                true
            }
            (Cur::Write { .. }, _) => false,
            (
                Cur::None,
                SendMiddle
                | SendLast
                | SendLastWithImmediate
                | SendLastWithInvalidate
                | RdmaWriteMiddle
                | RdmaWriteLast
                | RdmaWriteLastWithImmediate,
            ) => false,
            (Cur::None, _) => true,
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
            self.cur = Cur::Send { recv, off: 0 };
        }
        let Cur::Send { recv, off } = &mut self.cur else {
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
            let Cur::Send { recv, off } = std::mem::take(&mut self.cur) else {
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
                match q.ctx.invalidate_rkey(q.pd, q.qpn, ieth.rkey) {
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
            s.cur = Cur::None;
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
                && q.ctx
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
            self.cur = Cur::Write {
                va: reth.va,
                rkey: reth.rkey,
                len,
                off: 0,
            };
        }
        let Cur::Write { va, rkey, len, off } = &mut self.cur else {
            return;
        };
        let n = p.payload.len() as u64;
        let remaining = *len - *off;
        if n > remaining || (is_last_or_only(op) && n != remaining) {
            self.cur = Cur::None;
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
            match q.ctx.check_access(
                *rkey,
                q.pd,
                AccessFlags::REMOTE_WRITE,
                va.wrapping_add(*off),
                n,
                KeyUse::Remote,
                q.qpn,
            ) {
                Ok(g) => out.place(g, std::mem::take(&mut p.payload)),
                Err(_) => {
                    rkey_fail(self, rq, out);
                    return;
                }
            }
        }
        *off += n;
        if is_last_or_only(op) {
            let total = *len;
            self.cur = Cur::None;
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
            && q.ctx
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
            Res::Read {
                first: psn,
                last,
                va: reth.va,
                rkey: reth.rkey,
                len,
            },
        );
        self.msn = (self.msn + 1) & MSN_MASK;
        self.epsn = psn_add(last, 1);
        if let Err(bad) = self.read_responses(q, psn, reth.va, reth.rkey, len, 0, out) {
            self.error(q, bad, fail(NakCode::RemoteAccessError, None), None, out);
        }
    }

    fn push_res(&mut self, q: &QpCtx<'_>, r: Res) {
        let cap = q.max_dest_rd_atomic.max(1) as usize;
        while self.res.len() >= cap {
            self.res.pop_front();
        }
        self.res.push_back(r);
    }

    /// Emit READ responses for packets `k0..` of a READ starting at `first`. Each packet
    /// re-checks the rkey for its own bytes; on failure returns that packet's PSN.
    #[allow(clippy::too_many_arguments)]
    fn read_responses(
        &self,
        q: &QpCtx<'_>,
        first: u32,
        va: u64,
        rkey: u32,
        len: u64,
        k0: u32,
        out: &mut Out,
    ) -> Result<(), u32> {
        use Opcode::*;
        let mtu = q.mtu as u64;
        let npkts = len.div_ceil(mtu).max(1) as u32;
        for k in k0..npkts {
            let psn = psn_add(first, k);
            let off = u64::from(k) * mtu;
            let n = (len - off.min(len)).min(mtu);
            let opcode = match (k == k0, k + 1 == npkts) {
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
                    .ctx
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
        let g = match q.ctx.check_access(
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
        self.push_res(q, Res::Atomic { psn, orig });
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
                let found = self.res.iter().rev().find_map(|r| match *r {
                    Res::Read {
                        first,
                        last,
                        va,
                        rkey,
                        len,
                    } if psn_cmp(psn, first).is_ge() && psn_cmp(psn, last).is_le() => {
                        Some((first, va, rkey, len))
                    }
                    _ => None,
                });
                if let Some((first, va, rkey, len)) = found {
                    if p.ext.reth.is_some_and(|r| r.rkey == rkey) {
                        let k = psn_diff(psn, first) as u32;
                        if let Err(bad) = self.read_responses(q, first, va, rkey, len, k, out) {
                            self.error(q, bad, fail(NakCode::RemoteAccessError, None), None, out);
                        }
                    }
                }
            }
            Opcode::CompareSwap | Opcode::FetchAdd => {
                let found = self.res.iter().rev().find_map(|r| match *r {
                    Res::Atomic { psn: rp, orig } if rp == psn => Some(orig),
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
