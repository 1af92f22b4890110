//! The engine contract and one QP run.
//!
//! [`QpCtx`] is what the sans-IO engines ([`req`](super::req), [`resp`](super::resp),
//! [`comp`](super::comp)) know about their QP and device for one run: the memory core, the
//! QP's attributes and state. They write into an [`Out`]. A run ([`QpObject::run`]) takes the
//! QP's inbox, checks each packet ([`receive_check`]), hands it to the engines, settles
//! deferred copies, pushes completions, flushes on ERR and registers the QP's next timer; what
//! it needs from the device beyond the memory core it asks of a [`RunHost`] (the driver).
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::{comp, req, resp, QpAttr, QpState, RecvWqe};
use crate::access::AccessFlags;
use crate::cq::{CqObject, Wc, WcOpcode, WcStatus};
use crate::device::StatusModel;
use crate::events::AsyncEvent;
use crate::memcore::MemCore;
use crate::pd::PdObject;
use crate::pkt::Pkt;
use crate::stats::RxDrop;

/// Everything the engines need to know about their QP for one run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QpCtx<'a> {
    /// The memory core: the access predicate, key invalidation, window binding.
    pub mem: &'a crate::memcore::MemCore,
    pub qpn: u32,
    pub pd: u32,
    pub mtu: usize,
    pub dest_qpn: u32,
    pub dest_node: u64,
    pub dest_ip: Option<std::net::IpAddr>,
    pub src_node: u64,
    pub access: AccessFlags,
    pub max_rd_atomic: u32,
    pub max_dest_rd_atomic: u32,
    pub min_rnr_timer: u8,
    pub model: StatusModel,
    pub state: QpState,
}

/// Whose deferred placement a copy is, and for which packet (`Out::flush_copies`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CopyOwner {
    /// The responder, placing request packet `psn` (an RDMA WRITE).
    Resp { psn: u32 },
    /// The requester, placing READ response `psn`.
    Req { psn: u32 },
}

/// Something another context learned about one of this QP's packets after the QP sent it:
/// the bytes of a packet could not be read from registered memory when they were finally
/// copied (unmapped memory of an mlock-pinned MR, `copy.rs`). A NIC finds this while it
/// gathers the packet; here the gather is deferred to the send (UDP) or to the receiving QP's
/// copy (loopback), so the finding comes back to the QP and its next run turns it into the
/// error the NIC reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Notice {
    /// The gather of request packet `psn` (SEND/WRITE data) failed: its WQE completes with
    /// LOC_PROT_ERR and the QP moves to ERR.
    GatherFault { psn: u32 },
    /// The source of READ response `psn` could not be read: the responder NAKs it with a
    /// remote access error and moves to ERR.
    ReadSourceFault { psn: u32 },
}

/// Outputs of one engine run.
#[derive(Debug, Default)]
pub(crate) struct Out {
    pub pkts: Vec<Pkt>,
    /// Receive completions with their solicited flag.
    pub recv_wcs: Vec<(Wc, bool)>,
    /// The QP must move to ERR (after the completions above).
    pub error: bool,
    pub events: Vec<AsyncEvent>,
    /// RDMA WRITE placements and READ response placements not yet copied (coalesced by
    /// [`Out::flush_copies`]).
    pub copies: Vec<(crate::mr::MrGuard, crate::pkt::Payload, CopyOwner)>,
    /// The first responder placement a flush could not do: (PSN, side). Taken by the
    /// responder before it acknowledges anything (`resp::Responder::copy_failed`).
    pub resp_fault: Option<(u32, crate::copy::Unreachable)>,
    /// The first READ response placement a flush could not do: (PSN, side). Taken by the run
    /// before completions are produced (`comp::Completer::copy_failed`).
    pub req_fault: Option<(u32, crate::copy::Unreachable)>,
    /// Notices for the peer QP `(node, qpn, notice)` on the loopback link: a copy from its
    /// memory failed here (the driver hands them over after the run).
    pub peer_notices: Vec<(u64, u32, Notice)>,
}

impl Out {
    /// Place `payload` at the start of `dst` — deferred when it is registered memory, so that
    /// consecutive packets of a message become one large copy. An immediate copy returns its
    /// result; a deferred one reports through `resp_fault`/`req_fault` when flushed.
    pub(crate) fn place(
        &mut self,
        dst: crate::mr::MrGuard,
        payload: crate::pkt::Payload,
        owner: CopyOwner,
    ) -> std::result::Result<(), crate::copy::Unreachable> {
        match payload {
            crate::pkt::Payload::Mem(_) => {
                self.copies.push((dst, payload, owner));
                Ok(())
            }
            p => p.copy_to(0, &dst, 0, p.len()),
        }
    }

    /// Execute the deferred placements (in order) and release their guards. A placement that
    /// cannot reach memory is recorded (the first per owner, `resp_fault`/`req_fault`) and the
    /// later placements of the same owner are not done (their packets come after the error);
    /// the other owner's still are.
    pub(crate) fn flush_copies(&mut self) {
        if self.copies.is_empty() {
            return;
        }
        let mut items = Vec::new();
        for (dst, p, _) in &self.copies {
            if let crate::pkt::Payload::Mem(pieces) = p {
                let mut doff = 0u64;
                for (g, goff, glen) in pieces {
                    items.push((dst, doff, g, *goff, *glen));
                    doff += *glen as u64;
                }
            }
        }
        // The owner of each item, built on the first failure only (the fault-free flush
        // allocates nothing more than before).
        let mut owners: Vec<CopyOwner> = Vec::new();
        let (mut resp_fault, mut req_fault) = (None, None);
        while let Err((k, side)) = crate::copy::mem_to_mem_batch(&items) {
            // The failure path only: record it, drop the failed owner's later placements and
            // go on with the rest.
            if owners.is_empty() {
                for (_, p, owner) in &self.copies {
                    if let crate::pkt::Payload::Mem(pieces) = p {
                        owners.extend(std::iter::repeat_n(*owner, pieces.len()));
                    }
                }
            }
            let failed = owners[k];
            let is_resp = matches!(failed, CopyOwner::Resp { .. });
            match failed {
                CopyOwner::Resp { psn } => resp_fault = Some((psn, side)),
                CopyOwner::Req { psn } => req_fault = Some((psn, side)),
            }
            let keep: Vec<usize> = (k + 1..items.len())
                .filter(|&i| matches!(owners[i], CopyOwner::Resp { .. }) != is_resp)
                .collect();
            items = keep.iter().map(|&i| items[i]).collect();
            owners = keep.iter().map(|&i| owners[i]).collect();
        }
        drop(items);
        self.copies.clear();
        self.resp_fault = self.resp_fault.or(resp_fault);
        self.req_fault = self.req_fault.or(req_fault);
    }
}

/// The checks a received packet passes before its QP acts on it, in rxe's order (the ICRC
/// was checked when the datagram was parsed):
///
/// 1. the QP's state takes it: a request needs RTR, RTS or SQD, a response (ACK, NAK, READ
///    response, atomic ACK) RTS or SQD; RESET, INIT and ERR take nothing;
/// 2. a packet from the UDP link comes from the QP's remote address (the IP of its address
///    vector's GID; the UDP source port is not checked: a RoCEv2 sender picks it per QP for
///    entropy). The destination address needs no check: the device's socket is bound to its
///    own address, and the ICRC covers the destination;
/// 3. its P_Key matches the QP's: the port's table has one entry, the default full-member
///    0xFFFF, and like rxe every QP is checked against it; two P_Keys match when their low
///    15 bits are equal and not zero and at least one of them is a full member (bit 15).
///
/// A packet that fails is dropped and counted (`mrkit stat`: `rx_drop_qp_state`,
/// `rx_drop_src_addr`, `rx_drop_pkey`). Packets built in this process (the in-process
/// loopback link) carry no source address and skip step 2. The transport type needs no check
/// here: every QP is RC, and the parser drops every opcode that is not RC.
fn receive_check(
    p: &Pkt,
    response: bool,
    state: QpState,
    attr: &QpAttr,
) -> std::result::Result<(), crate::stats::RxDrop> {
    use crate::stats::RxDrop;
    let state_ok = if response {
        matches!(state, QpState::Rts | QpState::Sqd)
    } else {
        matches!(state, QpState::Rtr | QpState::Rts | QpState::Sqd)
    };
    if !state_ok {
        return Err(RxDrop::QpState);
    }
    if let Some(src) = p.src_ip {
        if attr.ah_attr.dgid.map(canonical_ip) != Some(canonical_ip(src)) {
            return Err(RxDrop::SrcAddr);
        }
    }
    if !pkey_match(p.bth.pkey, crate::wire::DEFAULT_PKEY) {
        return Err(RxDrop::Pkey);
    }
    Ok(())
}

/// An IP address with IPv4-mapped IPv6 addresses as IPv4 (how GIDs and dual-stack sockets
/// write IPv4 peers).
fn canonical_ip(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, std::net::IpAddr::V4),
        v4 => v4,
    }
}

/// The IBA P_Key match rule (as rxe's `pkey_match`): equal low 15 bits, not zero (the
/// invalid P_Key), and at least one full member.
pub(crate) fn pkey_match(a: u16, b: u16) -> bool {
    a & 0x7FFF != 0 && a & 0x7FFF == b & 0x7FFF && (a | b) & 0x8000 != 0
}

/// Packets whose only effect on memory is placing bytes (RDMA WRITE requests, READ
/// responses): deferred copies may stay pending across them and coalesce; any other packet
/// flushes them first.
fn plain_write(op: crate::wire::Opcode) -> bool {
    use crate::wire::Opcode::*;
    matches!(
        op,
        RdmaWriteFirst
            | RdmaWriteMiddle
            | RdmaWriteLast
            | RdmaWriteOnly
            | RdmaReadResponseFirst
            | RdmaReadResponseMiddle
            | RdmaReadResponseLast
            | RdmaReadResponseOnly
    )
}

pub(crate) struct QpInner {
    pub attr: QpAttr,
    pub state: QpState,
    pub sq: req::SendQueue,
    pub rq: VecDeque<RecvWqe>,
    pub req: req::Requester,
    pub comp: comp::Completer,
    pub resp: resp::Responder,
    pub destroyed: bool,
    pub sqd_notified: bool,
    /// LAST_WQE_REACHED raised for this stay in ERR (SRQ QPs).
    pub last_wqe_notified: bool,
    /// Reused buffer for a run's send completions (no allocation per completion).
    pub send_wcs: Vec<Wc>,
    /// Reused buffer for a run's receive completions (`Out::recv_wcs`).
    pub recv_wcs: Vec<(Wc, bool)>,
    /// Empty buffer swapped with `QpObject::inbox` by a run (no allocation per run).
    pub inbox_spare: Vec<Pkt>,
    /// The earliest timer this QP registered in the device's timer heap (`ns` since the
    /// progress epoch), if one is pending. A run that needs a timer registers one only when
    /// it is due earlier than this: an ACK that moves the retransmission deadline later
    /// registers nothing (request/response traffic touches the heap once per timeout, not
    /// per message); the earlier entry then finds the QP, which registers its later deadline.
    pub timer_at: Option<u64>,
}

/// A QP as the device keeps it.
pub(crate) struct QpObject {
    pub qpn: u32,
    pub pd: Arc<PdObject>,
    pub send_cq: Arc<CqObject>,
    pub recv_cq: Arc<CqObject>,
    pub sq_sig_all: bool,
    /// The SRQ receive WQEs come from (`rq` then only holds the one taken for the next
    /// message).
    pub srq: Option<Arc<crate::srq::SrqObject>>,
    pub inbox: Inbox,
    pub scheduled: AtomicBool,
    /// Whether application passes may hold this QP's plain ACKs back (delayed ACK,
    /// `held_acks::ACK_DELAY_MAX`). Cleared when a held ACK had to leave on its own (the
    /// application did not send within the bound: a one-way stream, whose sender would wait
    /// for every ACK); set again by `post_send` (the request/response pattern that pays).
    /// A hint only: no other data is ordered by it.
    pub delay_acks: AtomicBool,
    /// Set by `destroy_qp` once the QP is out of the table (the per-thread last-used cache
    /// checks it, `last_used.rs`). Guards nothing else.
    pub destroyed: AtomicBool,
    /// Runs of this QP whose packets are not yet with the link: raised before a run takes the
    /// QP lock (or while it holds it), lowered once its packets are delivered
    /// (`driver::delivery::Delivering`). A run pushes its completions before the driver hands
    /// its packets to the link, so an application can see a receive completion while the ACK
    /// of that message is still in a driver thread's hands; `destroy_qp` and the exit handler
    /// wait for this count to fall to zero, so the ACK a ConnectX would already have sent
    /// leaves before the QP (or the process) goes. Release on the decrement, Acquire on the
    /// waiters' loads: the packets were handed over before the waiter goes on.
    pub delivering: std::sync::atomic::AtomicU32,
    pub inner: Mutex<QpInner>,
}

impl QpObject {
    /// A new QP in RESET with attributes `attr` (its capacities set). The caller has taken
    /// the references its PD, CQs and SRQ count.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        qpn: u32,
        pd: Arc<PdObject>,
        send_cq: Arc<CqObject>,
        recv_cq: Arc<CqObject>,
        sq_sig_all: bool,
        srq: Option<Arc<crate::srq::SrqObject>>,
        attr: QpAttr,
    ) -> QpObject {
        QpObject {
            qpn,
            pd,
            send_cq,
            recv_cq,
            sq_sig_all,
            srq,
            inbox: Inbox::default(),
            scheduled: AtomicBool::new(false),
            delay_acks: AtomicBool::new(true),
            destroyed: AtomicBool::new(false),
            delivering: std::sync::atomic::AtomicU32::new(0),
            inner: Mutex::new(QpInner {
                attr,
                state: QpState::Reset,
                sq: req::SendQueue::default(),
                rq: VecDeque::new(),
                req: req::Requester::default(),
                comp: comp::Completer::new(Instant::now()),
                resp: resp::Responder::default(),
                destroyed: false,
                sqd_notified: false,
                last_wqe_notified: false,
                send_wcs: Vec::new(),
                inbox_spare: Vec::new(),
                recv_wcs: Vec::new(),
                timer_at: None,
            }),
        }
    }
}

thread_local! {
    /// The QP this thread posted to or received for last (`last_used.rs`).
    pub(crate) static LAST_QP: crate::last_used::Slot<QpObject> = const { std::cell::RefCell::new(None) };
}

impl crate::last_used::Cached for QpObject {
    fn number(&self) -> u32 {
        self.qpn
    }
    fn destroyed(&self) -> bool {
        self.destroyed.load(Ordering::Acquire)
    }
}

impl std::fmt::Debug for QpObject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QpObject").field("qpn", &self.qpn).finish()
    }
}

/// Packets received for a QP, waiting for its next run. Producers append and then schedule
/// the QP (or hand it to the pass that runs it), so a run always follows an append.
#[derive(Debug, Default)]
pub(crate) struct Inbox {
    pkts: Mutex<Vec<Pkt>>,
    /// Whether `pkts` may be non-empty: set under the lock by every append, cleared under it by
    /// the run that takes the packets. Lets a run with nothing received (an inline
    /// `post_send`) skip the lock. A stale `false` cannot strand packets: the append is
    /// followed by scheduling, which orders it before that scheduled run's read of this flag.
    ready: AtomicBool,
    /// Notices about this QP's own packets (rare: a copy that could not reach memory).
    notices: Mutex<Vec<Notice>>,
    /// Whether `notices` may be non-empty; Release by `notify` after the push, Acquire by the
    /// run, as `ready` (the notify is followed by scheduling the QP).
    noticed: AtomicBool,
}

impl Inbox {
    /// Append packets (and leave `pkts` empty).
    pub(crate) fn append(&self, pkts: &mut Vec<Pkt>) {
        let mut g = self.pkts.lock();
        g.append(pkts);
        self.ready.store(true, Ordering::Release);
    }

    /// Append one packet.
    pub(crate) fn push(&self, p: Pkt) {
        let mut g = self.pkts.lock();
        g.push(p);
        self.ready.store(true, Ordering::Release);
    }

    /// Swap the waiting packets into `into` (an empty buffer, which becomes the inbox).
    pub(crate) fn swap_into(&self, into: &mut Vec<Pkt>) {
        if !self.ready.load(Ordering::Acquire) {
            return;
        }
        let mut g = self.pkts.lock();
        std::mem::swap(&mut *g, into);
        self.ready.store(false, Ordering::Release);
    }

    /// The waiting packets' (opcode, PSN, is a plain ACK) (tests).
    #[cfg(test)]
    pub(crate) fn summary(&self) -> Vec<(crate::wire::Opcode, u32, bool)> {
        let g = self.pkts.lock();
        g.iter()
            .map(|p| {
                (
                    p.bth.opcode,
                    p.bth.psn,
                    p.ext.aeth.is_some_and(|x| x.is_ack()),
                )
            })
            .collect()
    }

    /// Record a notice for the QP's next run (the caller schedules the QP).
    pub(crate) fn notify(&self, n: Notice) {
        let mut g = self.notices.lock();
        g.push(n);
        self.noticed.store(true, Ordering::Release);
    }

    /// Take the waiting notices (none: one atomic load).
    pub(crate) fn take_notices(&self) -> Vec<Notice> {
        if !self.noticed.load(Ordering::Acquire) {
            return Vec::new();
        }
        let mut g = self.notices.lock();
        self.noticed.store(false, Ordering::Release);
        std::mem::take(&mut *g)
    }

    /// Drop every waiting packet (and notice: they are about packets of the QP's old life).
    pub(crate) fn clear(&self) {
        let mut g = self.pkts.lock();
        g.clear();
        self.ready.store(false, Ordering::Release);
        drop(self.take_notices());
    }
}

/// What a QP run needs from the device that runs it, beyond the memory core. The driver
/// implements it; a run calls it only for these side effects, so the engines and the run loop
/// know nothing of threads, links or the device object.
pub(crate) trait RunHost {
    /// The memory core (access predicate, key invalidation, window binding).
    fn mem(&self) -> &MemCore;
    /// This device instance's node id on the loopback link.
    fn node_id(&self) -> u64;
    /// Count a received packet the QP dropped.
    fn count_rx_drop(&self, why: RxDrop);
    /// The key under which a timer due at `at` is registered (ns since the driver's epoch).
    fn timer_key(&self, at: Instant) -> u64;
    /// How long after `now` a QP with WQEs not yet sent looks again (the progress tick).
    fn tick(&self) -> std::time::Duration;
    /// Register QP `qpn`'s timer under `key` (see `QpInner::timer_at`).
    fn arm_timer(&self, qpn: u32, key: u64);
    /// Run QP `qpn` again soon.
    fn schedule(&self, qpn: u32);
    /// Raise an asynchronous event.
    fn raise(&self, e: AsyncEvent);
    /// Hand a notice to QP `qpn` of node `node` (loopback link).
    fn notify_peer(&self, node: u64, qpn: u32, n: Notice);
}

impl QpObject {
    /// Execute the deferred placements and turn one that could not reach memory into its
    /// error (responder: NAK remote access error; requester: the READ's WQE fails), before
    /// anything produced later in the run can report success for those bytes.
    fn settle(st: &mut QpInner, q: &QpCtx<'_>, out: &mut Out) {
        out.flush_copies();
        if let Some((psn, side)) = out.resp_fault.take() {
            st.resp.copy_failed(q, psn, side, None, out);
        }
        if let Some((psn, side)) = out.req_fault.take() {
            st.comp.copy_failed(q, &mut st.sq, psn, side, out);
        }
    }

    /// One run: process the inbox, timers and the send queue; push completions; hand back the
    /// packets to send. When its timers next fall due is registered in the device's timer heap
    /// before the QP lock is released (`QpInner::timer_at`).
    pub(crate) fn run(&self, host: &impl RunHost, now: Instant) -> Vec<Pkt> {
        self.run_locked(host, now, self.inner.lock())
    }

    /// [`run`](Self::run) with the QP lock already held (`post_send` posts and runs under
    /// one lock); releases it before raising events.
    pub(crate) fn run_locked(
        &self,
        host: &impl RunHost,
        now: Instant,
        mut g: parking_lot::MutexGuard<'_, QpInner>,
    ) -> Vec<Pkt> {
        let st = &mut *g;
        if st.destroyed {
            self.inbox.clear();
            return Vec::new();
        }
        // Swap the inbox with this QP's empty spare (lock order: inner, then inbox): the
        // packets are taken under one short lock and the buffer returns as the next spare,
        // so neither side allocates and no second inbox lock is needed.
        let mut inbox = std::mem::take(&mut st.inbox_spare);
        self.inbox.swap_into(&mut inbox);
        let q = QpCtx {
            mem: host.mem(),
            qpn: self.qpn,
            pd: self.pd.handle,
            mtu: 128usize << st.attr.path_mtu.clamp(1, 5),
            dest_qpn: st.attr.dest_qp_num,
            dest_node: st.attr.ah_attr.dest_node,
            dest_ip: st.attr.ah_attr.dgid,
            src_node: host.node_id(),
            access: st.attr.qp_access_flags,
            max_rd_atomic: st.attr.max_rd_atomic,
            max_dest_rd_atomic: st.attr.max_dest_rd_atomic,
            min_rnr_timer: st.attr.min_rnr_timer,
            model: host.mem().config.model(),
            state: st.state,
        };
        let mut out = Out {
            pkts: crate::pkt::pkt_vec(),
            recv_wcs: std::mem::take(&mut st.recv_wcs),
            ..Out::default()
        };
        st.resp.begin_run();
        for p in inbox.drain(..) {
            let response = p.bth.opcode.info().is_response();
            if !plain_write(p.bth.opcode) {
                Self::settle(st, &q, &mut out);
            }
            // A QP in ERR (or one an earlier packet of this run put there) drops everything.
            let state = if out.error { QpState::Err } else { st.state };
            if let Err(why) = receive_check(&p, response, state, &st.attr) {
                host.count_rx_drop(why);
                continue;
            }
            crate::counters::rx_pkt(&p);
            if response {
                st.comp
                    .on_response(&q, &mut st.sq, &mut st.req, p, now, &mut out);
            } else {
                self.request(st, &q, p, &mut out);
            }
        }
        // Notices about this QP's own packets, after the packets received: those answer
        // earlier packets (an ACK for a WRITE before the SEND whose gather failed).
        for n in self.inbox.take_notices() {
            if out.error {
                break;
            }
            match n {
                Notice::GatherFault { psn } if matches!(st.state, QpState::Rts | QpState::Sqd) => {
                    st.comp.gather_fault(&mut st.sq, psn, &mut out);
                }
                Notice::ReadSourceFault { psn }
                    if matches!(st.state, QpState::Rtr | QpState::Rts | QpState::Sqd) =>
                {
                    st.resp.read_source_fault(&q, psn, &mut out);
                }
                _ => {}
            }
        }
        // READ responses under way (bounded per run, `resp::READ_BURST`), then the requests
        // that waited behind them.
        while !out.error && matches!(st.state, QpState::Rtr | QpState::Rts | QpState::Sqd) {
            Self::settle(st, &q, &mut out);
            if out.error {
                break;
            }
            st.resp.pump(&q, &mut out);
            match st.resp.next_backlog() {
                Some(p) => self.request(st, &q, p, &mut out),
                None => break,
            }
        }
        Self::settle(st, &q, &mut out);
        if !out.error && matches!(st.state, QpState::Rts | QpState::Sqd) {
            st.comp.tick(&q, &mut st.sq, &mut st.req, now, &mut out);
            st.req.step(&q, &mut st.sq, &mut st.comp, now, &mut out);
        }
        // Completions, in order.
        let mut send_wcs = std::mem::take(&mut st.send_wcs);
        st.comp.drain_done(
            self.qpn,
            self.sq_sig_all,
            &mut st.sq,
            &mut st.req,
            &mut send_wcs,
        );
        if out.error {
            st.state = QpState::Err;
        }
        if st.state == QpState::Err {
            // Flush: every remaining send WQE, then every receive WQE.
            for w in st.sq.q.drain(..) {
                // The WQE that failed keeps its status even behind WQEs still outstanding
                // (those are flushed, in order); every other one is flushed.
                send_wcs.push(match w.st {
                    req::WqeState::Done(status) if status != WcStatus::Success => {
                        w.wc(self.qpn, status)
                    }
                    _ => w.flush_wc(self.qpn),
                });
            }
            st.sq.cursor = 0;
            st.req.reset_flow();
            if let Some(srq) = &self.srq {
                // SRQ WQEs are not flushed: an unused prefetched one goes back.
                srq.give_back(st.rq.drain(..));
                if !st.last_wqe_notified {
                    st.last_wqe_notified = true;
                    out.events
                        .push(AsyncEvent::QpLastWqeReached { qpn: self.qpn });
                }
            }
            for r in st.rq.drain(..) {
                out.recv_wcs.push((
                    Wc {
                        wr_id: r.wr_id,
                        status: WcStatus::WrFlushErr,
                        opcode: WcOpcode::Recv,
                        vendor_err: 0,
                        byte_len: 0,
                        imm_data: 0,
                        qp_num: self.qpn,
                        src_qp: 0,
                        wc_flags: 0,
                    },
                    false,
                ));
            }
        }
        let mut overflow = None;
        for wc in send_wcs.drain(..) {
            if self.send_cq.push(wc, false).is_err() {
                overflow = Some(self.send_cq.cqn);
            }
        }
        st.send_wcs = send_wcs;
        let mut recv_wcs = std::mem::take(&mut out.recv_wcs);
        for (wc, sol) in recv_wcs.drain(..) {
            if self.recv_cq.push(wc, sol).is_err() {
                overflow = Some(self.recv_cq.cqn);
            }
        }
        st.recv_wcs = recv_wcs;
        if let Some(cqn) = overflow {
            out.events.push(AsyncEvent::CqErr { cqn });
            if st.state != QpState::Err {
                st.state = QpState::Err;
                out.events.push(AsyncEvent::QpFatal { qpn: self.qpn });
                // Flush what is left (into the full CQ: those completions are lost, as on
                // hardware after a CQ overrun).
                for w in st.sq.q.drain(..) {
                    let _ = self.send_cq.push(w.flush_wc(self.qpn), false);
                }
                st.sq.cursor = 0;
                if let Some(srq) = &self.srq {
                    srq.give_back(st.rq.drain(..));
                    st.last_wqe_notified = true;
                    out.events
                        .push(AsyncEvent::QpLastWqeReached { qpn: self.qpn });
                }
                st.rq.clear();
            }
        }
        if st.state == QpState::Sqd && !st.sqd_notified && st.sq.in_flight() == 0 {
            st.sqd_notified = true;
            if st.attr.en_sqd_async_notify {
                out.events.push(AsyncEvent::SqDrained { qpn: self.qpn });
            }
        }
        // More READ responses to send: run again soon (not at the next tick).
        let more = st.state != QpState::Err && st.resp.busy();
        // The next time this QP needs a run without a packet or a post: its retransmission
        // or RNR timer, or (WQEs not sent yet, nothing outstanding) a look one tick later.
        let timer = if matches!(st.state, QpState::Rts | QpState::Sqd) {
            st.comp.next_timer(&st.sq).or_else(|| {
                (st.state == QpState::Rts && st.sq.cursor < st.sq.q.len())
                    .then(|| now + host.tick())
            })
        } else {
            None
        };
        inbox.clear(); // what an error left unprocessed
        st.inbox_spare = inbox;
        if let Some(at) = timer {
            let ns = host.timer_key(at);
            if st.timer_at.is_none_or(|t| ns < t) {
                st.timer_at = Some(ns);
                host.arm_timer(self.qpn, ns);
            }
        }
        drop(g);
        if more {
            host.schedule(self.qpn);
        }
        for (node, qpn, n) in out.peer_notices {
            host.notify_peer(node, qpn, n);
        }
        for e in out.events {
            host.raise(e);
        }
        out.pkts
    }

    /// Hand one request packet to the responder (taking a receive WQE from the SRQ first when
    /// the packet consumes one).
    fn request(&self, st: &mut QpInner, q: &QpCtx<'_>, p: Pkt, out: &mut Out) {
        if let Some(srq) = &self.srq {
            if st.rq.is_empty() && st.resp.needs_wqe(&p) {
                if let Some((w, ev)) = srq.take() {
                    st.rq.push_back(w);
                    out.events.extend(ev);
                }
            }
        }
        st.resp.on_request(q, &mut st.rq, p, out);
    }

    /// Run this QP for its timer entry due at `at` (`ns_since_epoch`), unless the entry is
    /// stale (the QP registered another since): then `None`.
    pub(crate) fn run_timer(&self, host: &impl RunHost, at: u64, now: Instant) -> Option<Vec<Pkt>> {
        let mut g = self.inner.lock();
        if g.timer_at != Some(at) {
            return None;
        }
        g.timer_at = None;
        Some(self.run_locked(host, now, g))
    }
}

#[cfg(test)]
mod receive_check_tests {
    use super::*;

    /// The IBA P_Key rule, against the port's only entry (0xFFFF, full member) and between
    /// arbitrary keys.
    #[test]
    fn pkey_match_rule() {
        // (key, table, match)
        let table = [
            (0xFFFF, 0xFFFF, true),
            (0x7FFF, 0xFFFF, true),  // limited member of the default partition
            (0x7FFF, 0x7FFF, false), // two limited members
            (0x8000, 0xFFFF, false), // another partition
            (0x0000, 0xFFFF, false), // the invalid P_Key
            (0x8000, 0x8000, false), // the invalid P_Key, full member
            (0x1234, 0xFFFF, false),
            (0x9234, 0x1234, true),
            (0x1234, 0x9234, true),
        ];
        for (k, t, want) in table {
            assert_eq!(pkey_match(k, t), want, "{k:#06x} vs {t:#06x}");
        }
    }
}
