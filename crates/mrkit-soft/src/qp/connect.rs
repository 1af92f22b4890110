//! Bringing an RC QP up against a remote peer: RESET → INIT → RTR → RTS with the attributes a
//! perftest-style out-of-band exchange provides (QPN, PSN, GID).
#![forbid(unsafe_code)]

use std::net::IpAddr;

use super::{attr_mask as m, AddressVector, QpAttr, QpState};
use crate::access::AccessFlags;
use crate::error::Result;

/// What a peer tells us about its QP (the out-of-band exchange of perftest / rc_pingpong).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteQp {
    /// Its QP number.
    pub qpn: u32,
    /// Its first PSN.
    pub psn: u32,
    /// Its GID as an IP address (the UDP link), or `None` with `node` for the loopback link.
    pub ip: Option<IpAddr>,
    /// Loopback node (when `ip` is `None`).
    pub node: u64,
}

/// Connection parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectOpts {
    /// Remote rights this QP grants (REMOTE_WRITE / READ / ATOMIC).
    pub access: AccessFlags,
    /// `IBV_MTU_*` (1 = 256 … 5 = 4096).
    pub path_mtu: u8,
    /// Our first PSN.
    pub sq_psn: u32,
    /// Local ACK timeout exponent (4.096 µs × 2^t).
    pub timeout: u8,
    /// Transport retries after a timeout or a sequence NAK (0..=7; 7 is seven retries in the
    /// hardware status model, forever in the rxe model).
    pub retry_cnt: u8,
    /// RNR retries (0..=7; 7 = infinite, as the IBA says).
    pub rnr_retry: u8,
    /// Outstanding READ/atomic as requester and as responder.
    pub rd_atomic: u32,
}

impl Default for ConnectOpts {
    fn default() -> Self {
        ConnectOpts {
            access: AccessFlags::LOCAL_WRITE
                | AccessFlags::REMOTE_WRITE
                | AccessFlags::REMOTE_READ
                | AccessFlags::REMOTE_ATOMIC,
            path_mtu: 5,
            sq_psn: 0,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            rd_atomic: 16,
        }
    }
}

/// The verbs connecting a QP uses. The device's `Context` implements it; the functions here
/// stay below the driver that way.
pub trait ConnectVerbs {
    /// `ibv_modify_qp`.
    fn modify_qp(&self, qpn: u32, attr: &QpAttr, mask: u32) -> Result<()>;
    /// Bind the device's RoCEv2 UDP port if it is not bound yet.
    fn bind_udp_port(&self) -> Result<()>;
    /// This device instance's node id on the loopback link.
    fn node_id(&self) -> u64;
}

/// Move `qp` from RESET to RTS connected to `remote`.
pub fn connect_qp(
    ctx: &impl ConnectVerbs,
    qp: u32,
    remote: RemoteQp,
    o: ConnectOpts,
) -> Result<()> {
    if remote.ip.is_some() {
        ctx.bind_udp_port()?; // bind before traffic can arrive
    }
    let mut at = QpAttr {
        qp_state: QpState::Init as u32,
        qp_access_flags: o.access,
        port_num: 1,
        ..QpAttr::default()
    };
    ctx.modify_qp(
        qp,
        &at,
        m::STATE | m::PKEY_INDEX | m::PORT | m::ACCESS_FLAGS,
    )?;
    at.qp_state = QpState::Rtr as u32;
    at.ah_attr = AddressVector {
        dest_node: remote.node,
        dgid: remote.ip,
        port_num: 1,
    };
    at.path_mtu = o.path_mtu;
    at.dest_qp_num = remote.qpn;
    at.rq_psn = remote.psn;
    at.max_dest_rd_atomic = o.rd_atomic;
    ctx.modify_qp(
        qp,
        &at,
        m::STATE
            | m::AV
            | m::PATH_MTU
            | m::DEST_QPN
            | m::RQ_PSN
            | m::MAX_DEST_RD_ATOMIC
            | m::MIN_RNR_TIMER,
    )?;
    at.qp_state = QpState::Rts as u32;
    at.sq_psn = o.sq_psn;
    at.timeout = o.timeout;
    at.retry_cnt = o.retry_cnt;
    at.rnr_retry = o.rnr_retry;
    at.max_rd_atomic = o.rd_atomic;
    ctx.modify_qp(
        qp,
        &at,
        m::STATE | m::TIMEOUT | m::RETRY_CNT | m::RNR_RETRY | m::SQ_PSN | m::MAX_QP_RD_ATOMIC,
    )
}

/// Bring two RC QPs (possibly on different device instances) to RTS, connected to each other:
/// RESET→INIT (port 1, `access`), INIT→RTR (path MTU `mtu` as `IBV_MTU_*`, PSN 0, 16
/// responder resources, min_rnr_timer 1), RTR→RTS (timeout 14, retry 7, rnr_retry 7, 16
/// outstanding READ/atomics).
pub fn rc_connect<C: ConnectVerbs>(
    a: &C,
    qpa: u32,
    b: &C,
    qpb: u32,
    access: AccessFlags,
    mtu: u8,
) -> Result<()> {
    let opts = ConnectOpts {
        access,
        path_mtu: mtu,
        ..ConnectOpts::default()
    };
    for (c, q, node, qpn) in [(a, qpa, b.node_id(), qpb), (b, qpb, a.node_id(), qpa)] {
        let remote = RemoteQp {
            qpn,
            psn: 0,
            ip: None,
            node,
        };
        connect_qp(c, q, remote, opts)?;
    }
    Ok(())
}
