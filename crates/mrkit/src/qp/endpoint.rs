//! What two queue pairs exchange to connect: [`Endpoint`] (QP number, first PSN, GID, path
//! MTU), and the attributes of the connection, [`ConnectOpts`].
//!
//! This is the out-of-band exchange of perftest and `ibv_rc_pingpong`: each side creates its
//! QP, sends its [`Endpoint`] to the peer by any means (a TCP socket, a file, a message
//! queue), and calls [`QueuePair::connect_to`] with the peer's. [`crate::tcp`] does the whole
//! exchange over a TCP side channel.
//!
//! ```
//! use mrkit::{ConnectOpts, Context, Endpoint, QpCap, QueuePair, QpState};
//! let ctx = Context::open_default().unwrap();
//! let pd = ctx.alloc_pd().unwrap();
//! let mut a = QueuePair::new(&pd, QpCap::default()).unwrap();
//! let mut b = QueuePair::new(&pd, QpCap::default()).unwrap();
//! let opts = ConnectOpts::default();
//! // Each side's endpoint travels to the other as 48 bytes (or through serde).
//! let wire_a = a.endpoint_for(&opts).unwrap().to_bytes();
//! let wire_b = b.endpoint_for(&opts).unwrap().to_bytes();
//! a.connect_to(&Endpoint::from_bytes(&wire_b).unwrap(), &opts).unwrap();
//! b.connect_to(&Endpoint::from_bytes(&wire_a).unwrap(), &opts).unwrap();
//! assert_eq!(a.state().unwrap(), QpState::Rts);
//! ```
//!
//! # Addressing on `mrkit0`
//!
//! The GID of `mrkit0` is the address its RoCEv2 UDP link is bound to (IPv4-mapped for
//! IPv4): `MRKIT_ADDR` (`ip` or `ip:port`), or by default a `127.x.y.z` address derived from
//! the process id, so two processes on one host reach each other with no setup. Processes on
//! different hosts (or network namespaces) must each set `MRKIT_ADDR` to their address on the
//! link between them. Two queue pairs of one process talk over the in-process loopback link
//! instead of UDP: an endpoint also names its device instance and its process, and
//! [`QueuePair::connect_to`] uses the loopback link when the peer is in the same process.
#![forbid(unsafe_code)]

use std::fmt;
use std::hash::BuildHasher;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::OnceLock;

use crate::{AccessFlags, Errno, Error, Result};
use serde::{Deserialize, Serialize};

use super::registered::Registered;
use super::QueuePair;
use crate::verbs::RemoteSlice;
use mrkit_soft::qp::AddressVector;

/// A path MTU (`enum ibv_mtu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[repr(u8)]
pub enum Mtu {
    /// 256 bytes (`IBV_MTU_256` = 1).
    B256 = 1,
    /// 512 bytes (`IBV_MTU_512` = 2).
    B512 = 2,
    /// 1024 bytes (`IBV_MTU_1024` = 3).
    B1024 = 3,
    /// 2048 bytes (`IBV_MTU_2048` = 4).
    B2048 = 4,
    /// 4096 bytes (`IBV_MTU_4096` = 5).
    B4096 = 5,
}

impl Mtu {
    /// From the `IBV_MTU_*` value (1..=5); EINVAL otherwise.
    ///
    /// ```
    /// use mrkit::Mtu;
    /// assert_eq!(Mtu::from_ibv(3).unwrap(), Mtu::B1024);
    /// assert_eq!(Mtu::from_ibv(6).unwrap_err().errno(), mrkit::Errno::EINVAL);
    /// ```
    pub fn from_ibv(v: u8) -> Result<Mtu> {
        Ok(match v {
            1 => Mtu::B256,
            2 => Mtu::B512,
            3 => Mtu::B1024,
            4 => Mtu::B2048,
            5 => Mtu::B4096,
            _ => {
                return Err(Error::new(
                    Errno::EINVAL,
                    format!("path MTU {v} is not IBV_MTU_256 (1) .. IBV_MTU_4096 (5)"),
                ))
            }
        })
    }

    /// The `IBV_MTU_*` value.
    ///
    /// ```
    /// use mrkit::Mtu;
    /// assert_eq!(Mtu::B1024.ibv(), 3); // IBV_MTU_1024
    /// assert_eq!(Mtu::from_ibv(Mtu::B4096.ibv()).unwrap(), Mtu::B4096);
    /// ```
    pub fn ibv(self) -> u8 {
        self as u8
    }

    /// Bytes of payload per packet.
    ///
    /// ```
    /// assert_eq!(mrkit::Mtu::B4096.bytes(), 4096);
    /// ```
    pub fn bytes(self) -> u32 {
        128 << self.ibv()
    }
}

/// Attributes of a connection ([`QueuePair::connect_to`], [`crate::tcp`]).
///
/// ```
/// let o = mrkit::ConnectOpts::default();
/// // A dead peer ends the connection after (retry_cnt + 1) × 4.096 µs × 2^timeout ≈ 0.94 s.
/// assert_eq!((o.timeout, o.retry_cnt), (15, 6));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectOpts {
    /// What the peer may do through this QP (REMOTE_WRITE / REMOTE_READ / REMOTE_ATOMIC), on
    /// top of what each memory region allows. Default: all three, as RDMA-CM grants; the
    /// rights of each MR (or window) are what limit a peer.
    pub access: AccessFlags,
    /// Largest path MTU to use. The connection uses the smaller of this and the peer
    /// endpoint's [`Endpoint::mtu`] (default 4096).
    pub path_mtu: Mtu,
    /// Local ACK timeout exponent: a request unanswered for 4.096 µs × 2^`timeout` is resent
    /// (0..=31; 0 = never). Default 15 (≈ 134 ms).
    pub timeout: u8,
    /// Resends after a timeout (or a PSN-sequence NAK) before the work request completes with
    /// `RETRY_EXC_ERR` and the QP goes to ERR (0..=7). Default **6**: a peer that died is
    /// noticed after (6 + 1) × 134 ms ≈ 0.94 s. (7 would be seven resends on a ConnectX, but
    /// resends forever on rxe, whose behaviour the rxe status model keeps; so a default of 7
    /// hangs a READ on a dead peer forever there.)
    pub retry_cnt: u8,
    /// Resends after a receiver-not-ready NAK (0..=7; 7 = forever, as the IBA says).
    /// Default 7.
    pub rnr_retry: u8,
    /// READs and atomics outstanding at once, as requester and as responder. Default 16.
    pub rd_atomic: u32,
    /// First PSN of this side's send queue, which the peer must learn through this side's
    /// endpoint ([`QueuePair::endpoint_for`] puts it there). `None` (the default): a PSN
    /// derived from the QP and a random per-process value, different for every QP, as
    /// perftest and RDMA-CM pick a random one.
    pub psn: Option<u32>,
}

impl Default for ConnectOpts {
    fn default() -> Self {
        ConnectOpts {
            access: AccessFlags::REMOTE_WRITE
                | AccessFlags::REMOTE_READ
                | AccessFlags::REMOTE_ATOMIC,
            path_mtu: Mtu::B4096,
            timeout: 15,
            retry_cnt: 6,
            rnr_retry: 7,
            rd_atomic: 16,
            psn: None,
        }
    }
}

impl ConnectOpts {
    fn check(&self) -> Result<()> {
        let bad = |what: String| Err(Error::new(Errno::EINVAL, what));
        if self.timeout > 31 {
            return bad(format!("timeout {} is not 0..=31", self.timeout));
        }
        if self.retry_cnt > 7 {
            return bad(format!("retry_cnt {} is not 0..=7", self.retry_cnt));
        }
        if self.rnr_retry > 7 {
            return bad(format!("rnr_retry {} is not 0..=7", self.rnr_retry));
        }
        if let Some(p) = self.psn {
            if p > PSN_MAX {
                return bad(format!("psn {p:#x} does not fit in 24 bits"));
            }
        }
        Ok(())
    }
}

/// Largest 24-bit PSN.
const PSN_MAX: u32 = 0xFF_FFFF;
/// QP numbers an RC peer can have: 0 and 1 are the special QPs, 0xFFFFFF the multicast QPN.
const QPN_RANGE: std::ops::RangeInclusive<u32> = 2..=0xFF_FFFE;

/// Everything a peer needs to connect its RC queue pair to this one: QP number, first PSN,
/// GID and path MTU (what perftest and `ibv_rc_pingpong` exchange), plus this QP's place on
/// `mrkit0`'s in-process loopback link (used only by a peer in the same process).
///
/// Travels as a fixed, versioned 48-byte form ([`Endpoint::to_bytes`]) or through serde;
/// both refuse malformed input with EINVAL. Layout (big-endian):
///
/// | bytes  | field |
/// |--------|-------|
/// | 0..4   | magic `MRKE` |
/// | 4      | version (1) |
/// | 5      | path MTU (`IBV_MTU_*`, 1..=5) |
/// | 6..8   | reserved, zero |
/// | 8..12  | QP number (2..=0xFFFFFE) |
/// | 12..16 | first PSN (24 bits) |
/// | 16..32 | GID (unicast; IPv4-mapped for IPv4) |
/// | 32..40 | loopback node (0: none) |
/// | 40..48 | process tag (0: none; only a peer in the same process reads it) |
///
/// ```
/// use mrkit::{Endpoint, Mtu};
/// let ep = Endpoint::new(0x11, 0x1234, "127.0.0.2".parse().unwrap(), Mtu::B1024).unwrap();
/// let back = Endpoint::from_bytes(&ep.to_bytes()).unwrap();
/// assert_eq!(back, ep);
/// assert_eq!(back.ip().to_string(), "127.0.0.2");
/// // Hostile bytes are an error, never a panic.
/// assert!(Endpoint::from_bytes(&[0xff; 48]).is_err());
/// assert!(Endpoint::from_bytes(&ep.to_bytes()[..47]).is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "EndpointFields", into = "EndpointFields")]
pub struct Endpoint {
    qpn: u32,
    psn: u32,
    gid: [u8; 16],
    mtu: Mtu,
    node: u64,
    process: u64,
}

/// The serde form of [`Endpoint`]: plain fields, checked on the way in.
#[derive(Serialize, Deserialize)]
struct EndpointFields {
    qpn: u32,
    psn: u32,
    gid: Ipv6Addr,
    mtu: Mtu,
    #[serde(default)]
    node: u64,
    #[serde(default)]
    process: u64,
}

impl From<Endpoint> for EndpointFields {
    fn from(e: Endpoint) -> Self {
        EndpointFields {
            qpn: e.qpn,
            psn: e.psn,
            gid: Ipv6Addr::from(e.gid),
            mtu: e.mtu,
            node: e.node,
            process: e.process,
        }
    }
}

impl TryFrom<EndpointFields> for Endpoint {
    type Error = Error;
    fn try_from(f: EndpointFields) -> Result<Endpoint> {
        Endpoint::checked(Endpoint {
            qpn: f.qpn,
            psn: f.psn,
            gid: f.gid.octets(),
            mtu: f.mtu,
            node: f.node,
            process: f.process,
        })
    }
}

const MAGIC: [u8; 4] = *b"MRKE";
const VERSION: u8 = 1;

impl Endpoint {
    /// Size of the binary form.
    pub const LEN: usize = 48;

    /// An endpoint for a peer reached over RoCEv2 at `ip` (any RC peer, also a C program on
    /// the drop-in libibverbs, given its QP number, PSN and GID). EINVAL for a QP number
    /// outside 2..=0xFFFFFE, a PSN over 24 bits, or an address a peer cannot be reached at
    /// (unspecified, multicast, broadcast).
    ///
    /// ```
    /// use mrkit::{Endpoint, Errno, Mtu};
    /// // What `ibv_rc_pingpong` on the peer printed: QP number, PSN, GID.
    /// let peer = Endpoint::new(0x11, 0x1234, "192.0.2.7".parse().unwrap(), Mtu::B1024).unwrap();
    /// assert_eq!((peer.qp_num(), peer.psn(), peer.mtu()), (0x11, 0x1234, Mtu::B1024));
    /// let ip = "192.0.2.7".parse().unwrap();
    /// assert_eq!(Endpoint::new(1, 0, ip, Mtu::B1024).unwrap_err().errno(), Errno::EINVAL); // QP1
    /// assert_eq!(Endpoint::new(0x11, 1 << 24, ip, Mtu::B1024).unwrap_err().errno(), Errno::EINVAL);
    /// let any = "0.0.0.0".parse().unwrap();
    /// assert_eq!(Endpoint::new(0x11, 0, any, Mtu::B1024).unwrap_err().errno(), Errno::EINVAL);
    /// ```
    pub fn new(qpn: u32, psn: u32, ip: IpAddr, mtu: Mtu) -> Result<Endpoint> {
        Endpoint::checked(Endpoint {
            qpn,
            psn,
            gid: gid_of(ip),
            mtu,
            node: 0,
            process: 0,
        })
    }

    fn checked(e: Endpoint) -> Result<Endpoint> {
        let bad = |what: String| Err(Error::new(Errno::EINVAL, what));
        if !QPN_RANGE.contains(&e.qpn) {
            return bad(format!("QP number {:#x} cannot be an RC peer", e.qpn));
        }
        if e.psn > PSN_MAX {
            return bad(format!("PSN {:#x} does not fit in 24 bits", e.psn));
        }
        let ip = e.ip();
        let unusable = ip.is_unspecified()
            || ip.is_multicast()
            || matches!(ip, IpAddr::V4(v4) if v4.is_broadcast());
        if unusable {
            return bad(format!(
                "GID {ip} is not a unicast address a peer can reach"
            ));
        }
        Ok(e)
    }

    /// The QP number.
    ///
    /// ```
    /// # use mrkit::{Context, DeviceConfig, QueuePair};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let q = QueuePair::new(&pd, Default::default()).unwrap();
    /// assert_eq!(q.endpoint().unwrap().qp_num(), q.qp_num());
    /// ```
    pub fn qp_num(&self) -> u32 {
        self.qpn
    }

    /// The first PSN of the QP's send queue (the peer's receive PSN).
    ///
    /// ```
    /// # use mrkit::{Context, DeviceConfig, QueuePair};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let q = QueuePair::new(&pd, Default::default()).unwrap();
    /// let opts = mrkit::ConnectOpts { psn: Some(0x42), ..Default::default() };
    /// assert_eq!(q.endpoint_for(&opts).unwrap().psn(), 0x42);
    /// assert!(q.endpoint().unwrap().psn() <= 0xFF_FFFF); // default: 24 bits, per QP
    /// ```
    pub fn psn(&self) -> u32 {
        self.psn
    }

    /// The GID (16 bytes, network order).
    ///
    /// ```
    /// use std::net::Ipv6Addr;
    /// use mrkit::{Endpoint, Mtu};
    /// let ep = Endpoint::new(0x11, 0, "192.0.2.7".parse().unwrap(), Mtu::B1024).unwrap();
    /// let mapped: Ipv6Addr = "::ffff:192.0.2.7".parse().unwrap(); // IPv4-mapped
    /// assert_eq!(ep.gid(), mapped.octets());
    /// ```
    pub fn gid(&self) -> [u8; 16] {
        self.gid
    }

    /// The GID as the IP address of the device's RoCEv2 link (IPv4 for an IPv4-mapped GID).
    ///
    /// ```
    /// use mrkit::{Endpoint, Mtu};
    /// let ep = Endpoint::new(0x11, 0, "192.0.2.7".parse().unwrap(), Mtu::B1024).unwrap();
    /// assert_eq!(ep.ip().to_string(), "192.0.2.7");
    /// # use mrkit::{Context, DeviceConfig, QueuePair};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let q = QueuePair::new(&pd, Default::default()).unwrap();
    /// // mrkit0 binds a 127.x.y.z address of its own unless told another one.
    /// assert!(q.endpoint().unwrap().ip().is_loopback());
    /// ```
    pub fn ip(&self) -> IpAddr {
        match Ipv6Addr::from(self.gid).to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from(self.gid)),
        }
    }

    /// The largest path MTU this side accepts.
    ///
    /// ```
    /// # use mrkit::{Context, DeviceConfig, QueuePair};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let q = QueuePair::new(&pd, Default::default()).unwrap();
    /// let opts = mrkit::ConnectOpts { path_mtu: mrkit::Mtu::B1024, ..Default::default() };
    /// assert_eq!(q.endpoint_for(&opts).unwrap().mtu(), mrkit::Mtu::B1024);
    /// ```
    pub fn mtu(&self) -> Mtu {
        self.mtu
    }

    /// The same endpoint with another first PSN (EINVAL over 24 bits).
    ///
    /// ```
    /// use mrkit::{Endpoint, Mtu};
    /// let ep = Endpoint::new(0x11, 0, "192.0.2.7".parse().unwrap(), Mtu::B1024).unwrap();
    /// assert_eq!(ep.with_psn(0x99).unwrap().psn(), 0x99);
    /// assert_eq!(ep.with_psn(1 << 24).unwrap_err().errno(), mrkit::Errno::EINVAL);
    /// ```
    pub fn with_psn(self, psn: u32) -> Result<Endpoint> {
        Endpoint::checked(Endpoint { psn, ..self })
    }

    /// The same endpoint with a path MTU of at most `mtu` (never raises it).
    ///
    /// ```
    /// use mrkit::{Endpoint, Mtu};
    /// let ep = Endpoint::new(0x11, 0, "192.0.2.7".parse().unwrap(), Mtu::B2048).unwrap();
    /// assert_eq!(ep.with_mtu(Mtu::B1024).mtu(), Mtu::B1024);
    /// assert_eq!(ep.with_mtu(Mtu::B4096).mtu(), Mtu::B2048);
    /// ```
    pub fn with_mtu(self, mtu: Mtu) -> Endpoint {
        Endpoint {
            mtu: self.mtu.min(mtu),
            ..self
        }
    }

    /// The fixed, versioned binary form (see the table above).
    ///
    /// ```
    /// use mrkit::{Endpoint, Mtu};
    /// let ep = Endpoint::new(0x11, 0x1234, "192.0.2.7".parse().unwrap(), Mtu::B1024).unwrap();
    /// let b = ep.to_bytes();
    /// assert_eq!((b.len(), &b[0..4], b[4], b[5]), (Endpoint::LEN, &b"MRKE"[..], 1, 3));
    /// assert_eq!(b[8..12], 0x11u32.to_be_bytes()); // QP number, big-endian
    /// ```
    pub fn to_bytes(&self) -> [u8; Endpoint::LEN] {
        let mut b = [0u8; Endpoint::LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.mtu.ibv();
        b[8..12].copy_from_slice(&self.qpn.to_be_bytes());
        b[12..16].copy_from_slice(&self.psn.to_be_bytes());
        b[16..32].copy_from_slice(&self.gid);
        b[32..40].copy_from_slice(&self.node.to_be_bytes());
        b[40..48].copy_from_slice(&self.process.to_be_bytes());
        b
    }

    /// Parse the binary form. EINVAL for a wrong length, magic or version, a nonzero
    /// reserved byte, or a field out of range; never panics.
    ///
    /// ```
    /// use mrkit::{Endpoint, Errno, Mtu};
    /// let ep = Endpoint::new(0x11, 0x1234, "192.0.2.7".parse().unwrap(), Mtu::B1024).unwrap();
    /// let mut b = ep.to_bytes();
    /// assert_eq!(Endpoint::from_bytes(&b).unwrap(), ep);
    /// b[6] = 1; // a reserved byte
    /// assert_eq!(Endpoint::from_bytes(&b).unwrap_err().errno(), Errno::EINVAL);
    /// assert_eq!(Endpoint::from_bytes(b"MRKE").unwrap_err().errno(), Errno::EINVAL);
    /// ```
    pub fn from_bytes(b: &[u8]) -> Result<Endpoint> {
        let bad = |what: String| Err(Error::new(Errno::EINVAL, what));
        let Ok(b) = <&[u8; Endpoint::LEN]>::try_from(b) else {
            return bad(format!(
                "an endpoint is {} bytes, not {}",
                Endpoint::LEN,
                b.len()
            ));
        };
        if b[0..4] != MAGIC {
            return bad("not an mrkit endpoint (bad magic)".into());
        }
        if b[4] != VERSION {
            return bad(format!(
                "endpoint version {} is not supported (this mrkit reads version {VERSION})",
                b[4]
            ));
        }
        if b[6..8] != [0, 0] {
            return bad("reserved endpoint bytes are not zero".into());
        }
        let u32_at = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_be_bytes(x)
        };
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[16..32]);
        Endpoint::checked(Endpoint {
            qpn: u32_at(8),
            psn: u32_at(12),
            gid,
            mtu: Mtu::from_ibv(b[5])?,
            node: u64_at(32),
            process: u64_at(40),
        })
    }

    /// The peer's place on the loopback link, if it is in this process.
    fn loopback_node(&self) -> Option<u64> {
        (self.node != 0 && self.process == process_tag(self.node, self.qpn)).then_some(self.node)
    }
}

impl fmt::Display for Endpoint {
    /// `qpn 0x11 psn 0x1234 gid 127.0.0.2 mtu 1024`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "qpn {:#x} psn {:#x} gid {} mtu {}",
            self.qpn,
            self.psn,
            self.ip(),
            self.mtu.bytes()
        )
    }
}

/// A keyed hash with a random key fixed for the life of this process (SipHash keyed from
/// the OS's random source): the process tag and the default PSN of a QP are this hash of the
/// QP's loopback node and number. A peer in this process recognises a tag as its own; one in
/// another process cannot forge a tag for another QP of this process (and so cannot steer a
/// QP of this process onto the loopback link), nor predict a PSN.
fn keyed(what: u8, node: u64, qpn: u32) -> u64 {
    static KEY: OnceLock<std::hash::RandomState> = OnceLock::new();
    KEY.get_or_init(std::hash::RandomState::new)
        .hash_one((what, node, qpn))
}

/// The process tag of QP `qpn` at loopback node `node` (never 0).
fn process_tag(node: u64, qpn: u32) -> u64 {
    keyed(0, node, qpn) | 1
}

/// The GID of a RoCEv2 address: `::ffff:a.b.c.d` for IPv4.
fn gid_of(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// What the device says about a QP's address: its GID and loopback node.
struct DeviceAddress {
    gid: [u8; 16],
    node: u64,
}

/// Where the peer is.
#[derive(Debug, Clone, Copy)]
enum PeerPath {
    /// Over RoCEv2 at this address.
    Udp(IpAddr),
    /// On the in-process loopback link, at this node.
    Loopback(u64),
}

/// Connection attributes after both sides' wishes are combined.
#[derive(Debug, Clone, Copy)]
struct Resolved {
    peer_qpn: u32,
    peer_psn: u32,
    sq_psn: u32,
    mtu: Mtu,
    opts: ConnectOpts,
}

/// **The one place that reads a QP's address from the device** (GID of its RoCEv2 link,
/// binding the link if needed, and, for mrkit0, its in-process loopback node; 0 elsewhere).
fn device_address<B: Registered>(qp: &QueuePair<B>) -> Result<DeviceAddress> {
    let provider = qp.ctx.provider();
    let gid = provider.query_gid()?;
    let node = match provider.local_av() {
        Ok(av) if av.dgid.is_none() => av.dest_node,
        _ => 0,
    };
    Ok(DeviceAddress { gid, node })
}

/// **The one place that connects a QP to a peer on the device**: RESET → INIT → RTR → RTS
/// through the provider's `modify_qp`. On failure the QP is put back to RESET, so it can be
/// connected again.
fn device_connect<B: Registered>(qp: &QueuePair<B>, path: PeerPath, r: &Resolved) -> Result<()> {
    let av = match path {
        PeerPath::Udp(ip) => AddressVector {
            dest_node: 0,
            dgid: Some(ip),
            port_num: 1,
        },
        PeerPath::Loopback(node) => AddressVector {
            dest_node: node,
            dgid: None,
            port_num: 1,
        },
    };
    let opts = ConnectOpts {
        path_mtu: r.mtu,
        ..r.opts
    };
    let res = qp.bring_up(av, r.peer_qpn, r.peer_psn, r.sq_psn, &opts);
    if res.is_err() {
        let reset = mrkit_soft::qp::QpAttr {
            qp_state: mrkit_soft::qp::QpState::Reset as u32,
            ..Default::default()
        };
        if let Err(e) = qp.modify_qp(&reset, mrkit_soft::qp::attr_mask::STATE) {
            tracing::warn!(error = %e, qpn = qp.qpn, "could not reset a QP whose connect failed");
        }
    }
    res
}

impl<B: Registered> QueuePair<B> {
    /// This QP's endpoint with the default options: [`QueuePair::endpoint_for`] with
    /// [`ConnectOpts::default`]. Binds the device's RoCEv2 link if it is not yet bound
    /// (`MRKIT_ADDR`, see the [module docs](crate::qp::endpoint)).
    ///
    /// ```
    /// # use mrkit::{Context, DeviceConfig, QueuePair};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let q = QueuePair::new(&pd, Default::default()).unwrap();
    /// let ep = q.endpoint().unwrap(); // send this to the peer
    /// assert_eq!((ep.qp_num(), ep.mtu()), (q.qp_num(), mrkit::Mtu::B4096));
    /// assert_eq!(q.endpoint().unwrap(), ep); // stable until the QP is gone
    /// ```
    pub fn endpoint(&self) -> Result<Endpoint> {
        self.endpoint_for(&ConnectOpts::default())
    }

    /// This QP's endpoint as [`QueuePair::connect_to`] with `opts` will use it: the PSN is
    /// `opts.psn` (or this QP's own), the MTU at most `opts.path_mtu`. Send it to the peer.
    ///
    /// EADDRNOTAVAIL when the device's link is bound to an address no peer can reach (a
    /// wildcard `MRKIT_ADDR` such as `0.0.0.0`) or cannot be bound.
    ///
    /// ```
    /// use mrkit::{ConnectOpts, Mtu};
    /// # use mrkit::{Context, DeviceConfig, QueuePair};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let q = QueuePair::new(&pd, Default::default()).unwrap();
    /// let opts = ConnectOpts { path_mtu: Mtu::B1024, psn: Some(7), ..Default::default() };
    /// let ep = q.endpoint_for(&opts).unwrap(); // the endpoint `connect_to(.., &opts)` matches
    /// assert_eq!((ep.mtu(), ep.psn()), (Mtu::B1024, 7));
    /// let bad = ConnectOpts { psn: Some(1 << 24), ..Default::default() };
    /// assert_eq!(q.endpoint_for(&bad).unwrap_err().errno(), mrkit::Errno::EINVAL);
    /// ```
    pub fn endpoint_for(&self, opts: &ConnectOpts) -> Result<Endpoint> {
        opts.check()?;
        let a = device_address(self)?;
        let e = Endpoint {
            qpn: self.qpn,
            psn: self.first_psn(opts, a.node),
            gid: a.gid,
            mtu: opts.path_mtu,
            node: a.node,
            process: process_tag(a.node, self.qpn),
        };
        Endpoint::checked(e).map_err(|err| {
            Error::new(
                Errno::EADDRNOTAVAIL,
                format!(
                    "this device's RoCEv2 address cannot be given to a peer ({}); set \
                     MRKIT_ADDR to this host's address on the link to the peer",
                    err.cause()
                ),
            )
        })
    }

    /// The first send PSN `connect_to` uses with `opts` (`node`: this QP's loopback node).
    fn first_psn(&self, opts: &ConnectOpts, node: u64) -> u32 {
        opts.psn
            .unwrap_or_else(|| keyed(1, node, self.qpn) as u32 & PSN_MAX)
    }

    /// Connect this QP (in RESET, as [`QueuePair::new`] makes it) to the peer at `remote`
    /// and move it to RTS. The peer connects its QP to this one's endpoint the same way;
    /// this side may send once the peer is in RTR (the [`crate::tcp`] helper waits for that).
    ///
    /// The path MTU is the smaller of `opts.path_mtu` and `remote.mtu()`; both sides get the
    /// same one when each sends [`QueuePair::endpoint_for`] with its own `opts`. A peer in
    /// the same process is reached over the loopback link when this QP is on an mrkit0
    /// device, any other over RoCEv2 at `remote.ip()`.
    ///
    /// EINVAL when this QP is not in RESET (already connected) or an option is out of range;
    /// any other failure puts the QP back in RESET.
    ///
    /// ```
    /// use mrkit::{ConnectOpts, Context, QpCap, QueuePair};
    /// let ctx = Context::open_default().unwrap();
    /// let pd = ctx.alloc_pd().unwrap();
    /// let mut a = QueuePair::new(&pd, QpCap::default()).unwrap();
    /// let b = QueuePair::new(&pd, QpCap::default()).unwrap();
    /// a.connect_to(&b.endpoint().unwrap(), &ConnectOpts::default()).unwrap();
    /// // Connecting twice is refused, and the connection stays up.
    /// let again = a.connect_to(&b.endpoint().unwrap(), &ConnectOpts::default());
    /// assert_eq!(again.unwrap_err().errno(), mrkit::Errno::EINVAL);
    /// assert_eq!(a.state().unwrap(), mrkit::QpState::Rts);
    /// ```
    pub fn connect_to(&mut self, remote: &Endpoint, opts: &ConnectOpts) -> Result<()> {
        opts.check()?;
        let state = self.state()?;
        if state != crate::QpState::Reset {
            return Err(Error::new(
                Errno::EINVAL,
                format!(
                    "QP {:#x} is in {state:?}, not RESET: it is already connected",
                    self.qpn
                ),
            ));
        }
        let me = device_address(self)?;
        // The loopback link joins mrkit0 instances only: a QP on a device without one (an
        // rdma-core device, node 0) reaches even a peer of this process over RoCEv2.
        let path = match remote.loopback_node() {
            Some(node) if me.node != 0 => PeerPath::Loopback(node),
            _ => PeerPath::Udp(remote.ip()),
        };
        let r = Resolved {
            peer_qpn: remote.qpn,
            peer_psn: remote.psn,
            sq_psn: self.first_psn(opts, me.node),
            mtu: opts.path_mtu.min(remote.mtu),
            opts: *opts,
        };
        device_connect(self, path, &r)
    }
}

impl RemoteSlice {
    /// Size of [`RemoteSlice::to_bytes`].
    pub const LEN: usize = 20;

    /// A fixed 20-byte form (address, length, rkey; big-endian), e.g. to send as the private
    /// data of a [`crate::tcp`] handshake.
    ///
    /// ```
    /// use mrkit::RemoteSlice;
    /// let r = RemoteSlice { addr: 0x1000, len: 64, rkey: 7 };
    /// assert_eq!(RemoteSlice::from_bytes(&r.to_bytes()).unwrap(), r);
    /// assert!(RemoteSlice::from_bytes(&[0xff; 20]).is_err()); // addr + len overflows
    /// ```
    pub fn to_bytes(&self) -> [u8; RemoteSlice::LEN] {
        let mut b = [0u8; RemoteSlice::LEN];
        b[0..8].copy_from_slice(&self.addr.to_be_bytes());
        b[8..16].copy_from_slice(&self.len.to_be_bytes());
        b[16..20].copy_from_slice(&self.rkey.to_be_bytes());
        b
    }

    /// Parse [`RemoteSlice::to_bytes`]: EINVAL for a wrong length or a range that wraps
    /// around the address space.
    ///
    /// ```
    /// use mrkit::{Errno, RemoteSlice};
    /// // As received from a peer: address 0x1000, 64 bytes, rkey 7.
    /// let mut wire = [0u8; RemoteSlice::LEN];
    /// wire[0..8].copy_from_slice(&0x1000u64.to_be_bytes());
    /// wire[8..16].copy_from_slice(&64u64.to_be_bytes());
    /// wire[16..20].copy_from_slice(&7u32.to_be_bytes());
    /// assert_eq!(RemoteSlice::from_bytes(&wire).unwrap(), RemoteSlice { addr: 0x1000, len: 64, rkey: 7 });
    /// assert_eq!(RemoteSlice::from_bytes(&wire[..19]).unwrap_err().errno(), Errno::EINVAL);
    /// ```
    pub fn from_bytes(b: &[u8]) -> Result<RemoteSlice> {
        let Ok(b) = <&[u8; RemoteSlice::LEN]>::try_from(b) else {
            return Err(Error::new(
                Errno::EINVAL,
                format!(
                    "a remote slice is {} bytes, not {}",
                    RemoteSlice::LEN,
                    b.len()
                ),
            ));
        };
        let mut a = [0u8; 8];
        let mut l = [0u8; 8];
        a.copy_from_slice(&b[0..8]);
        l.copy_from_slice(&b[8..16]);
        let r = RemoteSlice {
            addr: u64::from_be_bytes(a),
            len: u64::from_be_bytes(l),
            rkey: u32::from_be_bytes([b[16], b[17], b[18], b[19]]),
        };
        if r.addr.checked_add(r.len).is_none() {
            return Err(Error::new(
                Errno::EINVAL,
                format!("remote slice {:#x} + {} wraps around", r.addr, r.len),
            ));
        }
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psn_of_two_qps_differ_and_fit() {
        let ctx = crate::Context::open_default().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let a = QueuePair::new(&pd, Default::default()).unwrap();
        let b = QueuePair::new(&pd, Default::default()).unwrap();
        let (pa, pb) = (a.endpoint().unwrap().psn(), b.endpoint().unwrap().psn());
        assert_ne!(pa, pb);
        assert!(pa <= PSN_MAX && pb <= PSN_MAX);
        // Stable for one QP, and what connect_to will use.
        assert_eq!(a.endpoint().unwrap().psn(), pa);
        let node = device_address(&a).unwrap().node;
        assert_eq!(a.first_psn(&ConnectOpts::default(), node), pa);
    }

    #[test]
    fn opts_out_of_range_are_einval() {
        for o in [
            ConnectOpts {
                timeout: 32,
                ..Default::default()
            },
            ConnectOpts {
                retry_cnt: 8,
                ..Default::default()
            },
            ConnectOpts {
                rnr_retry: 8,
                ..Default::default()
            },
            ConnectOpts {
                psn: Some(1 << 24),
                ..Default::default()
            },
        ] {
            assert_eq!(o.check().unwrap_err().errno(), Errno::EINVAL, "{o:?}");
        }
    }
}
