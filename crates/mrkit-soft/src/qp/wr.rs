//! Work requests and QP attributes as the verbs take them (`struct ibv_send_wr`,
//! `ibv_recv_wr`, `ibv_qp_init_attr`, `ibv_qp_attr`, ...), and the receive WQE the device keeps.
#![forbid(unsafe_code)]

use crate::access::AccessFlags;
use crate::cq::WcOpcode;
use crate::error::Error;
use crate::mw::BindInfo;

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
    pub(crate) fn is_atomic(self) -> bool {
        matches!(
            self,
            WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd
        )
    }
    pub(crate) fn is_rd_atomic(self) -> bool {
        self.is_atomic() || self == WrOpcode::RdmaRead
    }
    pub(crate) fn is_local(self) -> bool {
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
    pub(crate) fn total_len(&self) -> u64 {
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
    /// Destination node ([`Context::node_id`](crate::Context::node_id) of the peer) on the loopback link; ignored when
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
