//! RC queue pairs: creation, the modify state machine, posting, and the per-QP run loop that
//! drives the three sans-IO engines ([`req`], [`resp`], [`comp`]).
#![forbid(unsafe_code)]

pub mod comp;
pub mod connect;
#[cfg(test)]
mod dp_tests;
pub mod req;
pub mod resp;
#[cfg(test)]
mod retry_tests;
pub mod state;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use crate::access::AccessFlags;
use crate::cq::{CqObject, Wc, WcOpcode, WcStatus};
use crate::device::StatusModel;
use crate::error::{err, Error, Result};
use crate::events::AsyncEvent;
use crate::memcore::MemCore;
use crate::mw::BindInfo;
use crate::pd::PdObject;
use crate::pkt::Pkt;
use crate::stats::RxDrop;

pub use connect::rc_connect;
pub use state::{attr_mask, QpState};

/// `enum ibv_wr_opcode` (RC subset).
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum WrOpcode {
    RdmaWrite = 0,
    RdmaWriteWithImm = 1,
    Send = 2,
    SendWithImm = 3,
    RdmaRead = 4,
    AtomicCmpAndSwp = 5,
    AtomicFetchAndAdd = 6,
    LocalInv = 7,
    BindMw = 8,
    SendWithInv = 9,
}

impl WrOpcode {
    fn is_atomic(self) -> bool {
        matches!(
            self,
            WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd
        )
    }
    fn is_rd_atomic(self) -> bool {
        self.is_atomic() || self == WrOpcode::RdmaRead
    }
    fn is_local(self) -> bool {
        matches!(self, WrOpcode::LocalInv | WrOpcode::BindMw)
    }
    pub(crate) fn wc_opcode(self) -> WcOpcode {
        match self {
            WrOpcode::Send | WrOpcode::SendWithImm | WrOpcode::SendWithInv => WcOpcode::Send,
            WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm => WcOpcode::RdmaWrite,
            WrOpcode::RdmaRead => WcOpcode::RdmaRead,
            WrOpcode::AtomicCmpAndSwp => WcOpcode::CompSwap,
            WrOpcode::AtomicFetchAndAdd => WcOpcode::FetchAdd,
            WrOpcode::LocalInv => WcOpcode::LocalInv,
            WrOpcode::BindMw => WcOpcode::BindMw,
        }
    }
}

/// `enum ibv_send_flags`.
pub mod send_flags {
    /// Wait for earlier READ/atomics to complete first.
    pub const FENCE: u32 = 1;
    /// Generate a completion on success.
    pub const SIGNALED: u32 = 2;
    /// Set SE on the last packet (the receiver's solicited-only arm fires).
    pub const SOLICITED: u32 = 4;
    /// Copy the gather list at post time (no lkey check).
    pub const INLINE: u32 = 8;
}

/// A scatter/gather element (`struct ibv_sge`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sge {
    /// Address in the MR's iova space.
    pub addr: u64,
    /// Length.
    pub length: u32,
    /// lkey.
    pub lkey: u32,
}

/// What a BIND_MW work request binds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BindWr {
    /// The window's current rkey.
    pub mw_rkey: u32,
    /// The new 8-bit key (low byte of the new rkey).
    pub new_key: u8,
    /// MR, range and rights.
    pub info: BindInfo,
}

/// A send work request (`struct ibv_send_wr`, RC fields).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Operation.
    pub opcode: WrOpcode,
    /// [`send_flags`] bits.
    pub flags: u32,
    /// Gather list (READ/atomic: where the device writes the result).
    pub sg_list: Vec<Sge>,
    /// Immediate data (`*_WITH_IMM`).
    pub imm_data: u32,
    /// rkey to invalidate (SEND_WITH_INV, LOCAL_INV).
    pub invalidate_rkey: u32,
    /// Remote address (RDMA and atomics).
    pub remote_addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Compare (CMP_AND_SWP) or addend (FETCH_AND_ADD).
    pub compare_add: u64,
    /// Swap value.
    pub swap: u64,
    /// BIND_MW parameters.
    pub bind: Option<BindWr>,
    /// With [`send_flags::INLINE`]: the message bytes (copied at post time; the gather list is
    /// ignored and no lkey is checked, as IBA specifies for inline data).
    pub inline_data: Vec<u8>,
}

impl SendWr {
    /// A signaled WR with everything else zero.
    pub fn new(wr_id: u64, opcode: WrOpcode) -> SendWr {
        SendWr {
            wr_id,
            opcode,
            flags: send_flags::SIGNALED,
            sg_list: Vec::new(),
            imm_data: 0,
            invalidate_rkey: 0,
            remote_addr: 0,
            rkey: 0,
            compare_add: 0,
            swap: 0,
            bind: None,
            inline_data: Vec::new(),
        }
    }
    /// Builder: gather list.
    pub fn sge(mut self, addr: u64, length: u32, lkey: u32) -> SendWr {
        self.sg_list.push(Sge { addr, length, lkey });
        self
    }
    /// Builder: remote address and key.
    pub fn remote(mut self, addr: u64, rkey: u32) -> SendWr {
        self.remote_addr = addr;
        self.rkey = rkey;
        self
    }
    /// Builder: replace the flags.
    pub fn flags(mut self, flags: u32) -> SendWr {
        self.flags = flags;
        self
    }
    /// Builder: immediate data.
    pub fn imm(mut self, imm: u32) -> SendWr {
        self.imm_data = imm;
        self
    }
    fn total_len(&self) -> u64 {
        if self.flags & send_flags::INLINE != 0 {
            return self.inline_data.len() as u64;
        }
        self.sg_list.iter().map(|s| u64::from(s.length)).sum()
    }
}

/// A receive work request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RecvWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Scatter list.
    pub sg_list: Vec<Sge>,
}

/// A post failed at WR `bad_wr` (earlier WRs were posted).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("work request {bad_wr}: {error}")]
pub struct PostError {
    /// Index of the failing WR.
    pub bad_wr: usize,
    /// Why.
    pub error: Error,
}

/// Queue capacities (`struct ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCap {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// SGEs per send WR.
    pub max_send_sge: u32,
    /// SGEs per receive WR.
    pub max_recv_sge: u32,
    /// Inline bytes per send WR (≤ 512).
    pub max_inline_data: u32,
}

impl Default for QpCap {
    fn default() -> Self {
        QpCap {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 64,
        }
    }
}

/// `struct ibv_qp_init_attr` for an RC QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpInitAttr {
    /// Protection domain.
    pub pd: u32,
    /// CQ for send completions.
    pub send_cq: u32,
    /// CQ for receive completions.
    pub recv_cq: u32,
    /// Capacities.
    pub cap: QpCap,
    /// Signal every send WR.
    pub sq_sig_all: bool,
}

/// Address vector: the destination device instance on the in-process loopback link, or the
/// destination GID's IP address on the UDP (RoCEv2) link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AddressVector {
    /// Destination node ([`Context::node_id`] of the peer) on the loopback link; ignored when
    /// `dgid` is set.
    pub dest_node: u64,
    /// Destination GID as an IP address (IPv4-mapped GIDs are IPv4): packets go over UDP.
    pub dgid: Option<std::net::IpAddr>,
    /// Port (must be 1).
    pub port_num: u8,
}

/// `struct ibv_qp_attr` (RC fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpAttr {
    /// Target / current state.
    pub qp_state: u32,
    /// Current state (with IBV_QP_CUR_STATE).
    pub cur_qp_state: u32,
    /// Raise SQ_DRAINED when SQD drains.
    pub en_sqd_async_notify: bool,
    /// REMOTE_WRITE / REMOTE_READ / REMOTE_ATOMIC the QP allows.
    pub qp_access_flags: AccessFlags,
    /// P_Key index.
    pub pkey_index: u16,
    /// Port (1).
    pub port_num: u8,
    /// Address vector.
    pub ah_attr: AddressVector,
    /// `IBV_MTU_*` (1=256 .. 5=4096).
    pub path_mtu: u8,
    /// Local ACK timeout exponent (0 = none).
    pub timeout: u8,
    /// Transport retries after a timeout or a sequence NAK (0..=7; 7 is seven retries in the
    /// hardware status model, forever in the rxe model).
    pub retry_cnt: u8,
    /// RNR retries (0..=7; 7 = infinite, as the IBA says).
    pub rnr_retry: u8,
    /// Expected receive PSN.
    pub rq_psn: u32,
    /// Outstanding READ/atomics as requester (rounded up to a power of two).
    pub max_rd_atomic: u32,
    /// RNR timer code this side puts in its RNR NAKs (0..=31).
    pub min_rnr_timer: u8,
    /// Initial send PSN.
    pub sq_psn: u32,
    /// Responder resources (rounded up to a power of two; 0 disables incoming READ/atomics).
    pub max_dest_rd_atomic: u32,
    /// Peer QP number.
    pub dest_qp_num: u32,
    /// Capacities (IBV_QP_CAP).
    pub cap: QpCap,
}

impl Default for QpAttr {
    fn default() -> Self {
        QpAttr {
            qp_state: 0,
            cur_qp_state: 0,
            en_sqd_async_notify: false,
            qp_access_flags: AccessFlags::empty(),
            pkey_index: 0,
            port_num: 1,
            ah_attr: AddressVector::default(),
            path_mtu: 5,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            rq_psn: 0,
            max_rd_atomic: 16,
            min_rnr_timer: 1,
            sq_psn: 0,
            max_dest_rd_atomic: 16,
            dest_qp_num: 0,
            cap: QpCap::default(),
        }
    }
}

/// A posted receive.
#[derive(Debug, Clone)]
pub(crate) struct RecvWqe {
    pub wr_id: u64,
    pub sges: Vec<Sge>,
}

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
                        owners.extend(std::iter::repeat(*owner).take(pieces.len()));
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
    /// `fastpath::ACK_DELAY_MAX`). Cleared when a held ACK had to leave on its own (the
    /// application did not send within the bound: a one-way stream, whose sender would wait
    /// for every ACK); set again by `post_send` (the request/response pattern that pays).
    /// A hint only: no other data is ordered by it.
    pub delay_acks: AtomicBool,
    /// Set by `destroy_qp` once the QP is out of the table (the per-thread last-used cache
    /// checks it, `last_used.rs`). Guards nothing else.
    pub destroyed: AtomicBool,
    pub inner: Mutex<QpInner>,
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

pub(crate) fn pow2(v: u32) -> u32 {
    if v == 0 {
        0
    } else {
        v.next_power_of_two()
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
                    req::WqeSt::Done(status) if status != WcStatus::Success => {
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
            if st.timer_at.map_or(true, |t| ns < t) {
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

pub(crate) fn validate_send(wr: &SendWr, cap: &QpCap) -> Result<req::Wqe> {
    use WrOpcode as O;
    if wr.sg_list.len() as u32 > cap.max_send_sge && wr.flags & send_flags::INLINE == 0 {
        return Err(err!(
            EINVAL,
            "{} SGEs > max_send_sge {}",
            wr.sg_list.len(),
            cap.max_send_sge
        ));
    }
    let len = wr.total_len();
    if len > 1 << 31 {
        return Err(err!(
            EINVAL,
            "message of {len} bytes exceeds max_msg_sz 2^31"
        ));
    }
    let inline = wr.flags & send_flags::INLINE != 0;
    if wr.opcode.is_atomic() {
        if len != 8 {
            return Err(err!(
                EINVAL,
                "atomics need exactly 8 bytes of local result buffer, got {len}"
            ));
        }
        if wr.remote_addr % 8 != 0 {
            return Err(err!(
                EINVAL,
                "atomic remote address {:#x} is not 8-byte aligned",
                wr.remote_addr
            ));
        }
    }
    if inline {
        if !matches!(
            wr.opcode,
            O::Send | O::SendWithImm | O::SendWithInv | O::RdmaWrite | O::RdmaWriteWithImm
        ) {
            return Err(err!(EINVAL, "{:?} cannot be INLINE", wr.opcode));
        }
        if len > u64::from(cap.max_inline_data) {
            return Err(err!(
                EINVAL,
                "inline message of {len} bytes > max_inline_data {}",
                cap.max_inline_data
            ));
        }
        // The bytes of an inline message are `inline_data`; a gather list with bytes beside
        // an empty `inline_data` would silently send an empty message (this API cannot read
        // raw addresses the way `ibv_post_send` copies an inline gather list).
        if wr.inline_data.is_empty() && wr.sg_list.iter().any(|s| s.length > 0) {
            return Err(err!(
                EINVAL,
                "INLINE with an empty inline_data but a gather list: put the bytes in inline_data"
            ));
        }
    }
    if wr.opcode == O::BindMw && (!wr.sg_list.is_empty() || wr.imm_data != 0 || wr.bind.is_none()) {
        return Err(err!(
            EINVAL,
            "BIND_MW takes no SGEs and no immediate, and needs bind info"
        ));
    }
    if wr.opcode == O::LocalInv && !wr.sg_list.is_empty() {
        return Err(err!(EINVAL, "LOCAL_INV takes no SGEs"));
    }
    Ok(req::Wqe::from_wr(wr, len, inline))
}

/// Whether `post_send` runs the requester on the caller's thread: the send queue is empty, or
/// holds one message already sent that waits for its ACK. The second case is request/response
/// traffic with delayed ACKs (`fastpath::ACK_DELAY_MAX`): the peer's ACK of this side's last
/// reply travels behind its next request, so the reply to that request is posted before the ACK
/// of the previous one is processed; scheduling it instead cost a progress pass (~2.4 µs of a
/// SEND echo). More than one WQE queued is a stream, whose packets the next progress pass sends
/// together (one GSO send per run): running each post inline sends each message on its own
/// (4 KiB WRITEs with 64 in flight fell from ~2.9 to ~1.1 GB/s).
pub(crate) fn idle_for_inline(sq: &req::SendQueue) -> bool {
    sq.cursor == sq.q.len() && sq.q.len() <= 1
}

#[cfg(test)]
mod inline_tests {
    use super::req::{SendQueue, Wqe};
    use super::*;

    #[test]
    fn post_send_runs_inline_only_on_an_idle_or_answering_queue() {
        // (WQEs queued, of which started) -> inline
        let table = [
            ((0, 0), true),  // empty
            ((1, 1), true),  // the last reply, sent, waiting for its (delayed) ACK
            ((1, 0), false), // one not yet sent: the requester is busy (a retry, a window)
            ((2, 2), false), // a stream in flight: the next pass batches
            ((3, 1), false),
        ];
        for ((queued, started), want) in table {
            let mut sq = SendQueue::default();
            for _ in 0..queued {
                sq.q.push_back(Wqe::new(SendWr::new(1, WrOpcode::Send), 8, false));
            }
            sq.cursor = started;
            assert_eq!(
                idle_for_inline(&sq),
                want,
                "{queued} queued, {started} started"
            );
        }
    }

    #[test]
    fn inline_post_time_rules() {
        let cap = QpCap::default(); // max_inline_data 64
        let inline = |op, bytes: usize, sge_len: Option<u32>| {
            let mut w = SendWr::new(1, op).flags(send_flags::INLINE | send_flags::SIGNALED);
            w.inline_data = vec![7; bytes];
            if let Some(l) = sge_len {
                w = w.sge(0x1000, l, 5);
            }
            w
        };
        use WrOpcode as O;
        // (WR, accepted at post)
        let table = [
            (inline(O::Send, 8, None), true),
            (inline(O::Send, 8, Some(8)), true), // the libibverbs shape: bytes + gather list
            (inline(O::RdmaWrite, 64, None), true),
            (inline(O::Send, 0, None), true), // a zero-length message
            (inline(O::Send, 0, Some(0)), true), // ... with a zero-length SGE
            (inline(O::Send, 65, None), false), // > max_inline_data
            (inline(O::RdmaRead, 8, None), false),
            (inline(O::AtomicFetchAndAdd, 8, None), false),
            // The bytes left in the gather list: would send an empty message.
            (inline(O::Send, 0, Some(8)), false),
            (inline(O::RdmaWrite, 0, Some(8)), false),
        ];
        for (i, (wr, ok)) in table.into_iter().enumerate() {
            match validate_send(&wr, &cap) {
                Ok(_) => assert!(ok, "row {i} accepted"),
                Err(e) => {
                    assert!(!ok, "row {i}: {e}");
                    assert_eq!(e.errno(), crate::Errno::EINVAL, "row {i}");
                }
            }
        }
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
