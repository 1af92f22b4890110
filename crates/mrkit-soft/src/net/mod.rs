//! Packets between QPs, and the links that carry them.
//!
//! A [`Pkt`] is a RoCEv2 packet in structured form: the [`Bth`], the extension headers and a
//! [`Payload`]. On the in-process [`loopback`] link the payload of a request or read response
//! is a list of **guarded memory pieces** (an [`MrGuard`] per piece, taken by the sender's
//! access check for exactly this packet's bytes), so the receiver copies straight from the
//! sender's registered memory into its own: one copy per byte, like a DMA engine. The guards
//! drop when the packet has been consumed, so a packet can delay a dereg by at most its own
//! processing. A UDP link (next issue) materialises the payload with [`Pkt::to_wire`].
#![forbid(unsafe_code)]

pub mod fault;
pub mod fuzz;
pub mod loopback;
pub mod udp;

use crate::copy;
use crate::mr::MrGuard;
use crate::wire::{Bth, ExtHeaders, IcrcInputs, PacketBuilder, WireError};

/// Packet payload.
#[derive(Debug, Default)]
pub enum Payload {
    /// No payload.
    #[default]
    Empty,
    /// Owned bytes (inline sends, packets received from a wire).
    Bytes(Vec<u8>),
    /// Up to [`SMALL_PAYLOAD`] bytes held in the packet itself (short messages, atomics,
    /// inline sends): no allocation and no shared receive buffer per packet.
    Small {
        /// Bytes used.
        len: u8,
        /// The bytes (`..len`).
        bytes: [u8; SMALL_PAYLOAD],
    },
    /// Pieces of registered memory `(guard, offset in guard, length)`.
    Mem(Vec<(MrGuard, u64, usize)>),
    /// A range of a shared receive buffer (packets from the UDP link: no per-packet copy or
    /// allocation; the buffer is recycled once every packet in it is consumed).
    Shared(std::sync::Arc<Vec<u8>>, usize, usize),
}

/// Largest payload kept in the packet itself ([`Payload::Small`]).
pub const SMALL_PAYLOAD: usize = 32;

impl Payload {
    /// Owned copy of `bytes`: in the packet itself when short, else on the heap.
    pub fn copied(bytes: &[u8]) -> Payload {
        match bytes.len() {
            0 => Payload::Empty,
            n if n <= SMALL_PAYLOAD => {
                let mut b = [0u8; SMALL_PAYLOAD];
                b[..n].copy_from_slice(bytes);
                Payload::Small {
                    len: n as u8,
                    bytes: b,
                }
            }
            _ => Payload::Bytes(bytes.to_vec()),
        }
    }

    /// The bytes of a payload held in one piece (owned, in the packet, or a range of a receive
    /// buffer); `None` for no payload and for pieces of registered memory.
    pub(crate) fn contiguous(&self) -> Option<&[u8]> {
        match self {
            Payload::Bytes(b) => Some(b),
            Payload::Small { len, bytes } => Some(&bytes[..usize::from(*len)]),
            Payload::Shared(b, start, n) => Some(&b[*start..*start + *n]),
            Payload::Empty | Payload::Mem(_) => None,
        }
    }

    /// Payload length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Payload::Mem(p) => p.iter().map(|x| x.2).sum(),
            _ => self.contiguous().map_or(0, <[u8]>::len),
        }
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copy `n` payload bytes starting at `poff` into registered memory `dst` at `doff`.
    pub(crate) fn copy_to(&self, mut poff: usize, dst: &MrGuard, mut doff: u64, mut n: usize) {
        if let Some(b) = self.contiguous() {
            return copy::write_from(dst, doff, &b[poff..poff + n]);
        }
        match self {
            Payload::Mem(pieces) => {
                for (g, goff, glen) in pieces {
                    if n == 0 {
                        break;
                    }
                    if poff >= *glen {
                        poff -= glen;
                        continue;
                    }
                    let k = (glen - poff).min(n);
                    copy::mem_to_mem(dst, doff, g, goff + poff as u64, k);
                    doff += k as u64;
                    n -= k;
                    poff = 0;
                }
            }
            _ => debug_assert_eq!(n, 0), // no payload
        }
    }
    /// Copy `dst.len()` payload bytes starting at `poff` into a slice.
    pub(crate) fn read(&self, mut poff: usize, dst: &mut [u8]) {
        if let Some(b) = self.contiguous() {
            return dst.copy_from_slice(&b[poff..poff + dst.len()]);
        }
        // Otherwise pieces of registered memory (or no payload: nothing to read).
        if let Payload::Mem(pieces) = self {
            let mut d = 0;
            for (g, goff, glen) in pieces {
                if d == dst.len() {
                    break;
                }
                if poff >= *glen {
                    poff -= glen;
                    continue;
                }
                let k = (glen - poff).min(dst.len() - d);
                copy::read_into(g, goff + poff as u64, &mut dst[d..d + k]);
                d += k;
                poff = 0;
            }
        }
    }
    /// The payload as owned bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.len()];
        self.read(0, &mut v);
        v
    }
}

/// A packet in flight between two QPs.
#[derive(Debug)]
pub struct Pkt {
    /// Node (device instance) the packet is for (loopback link).
    pub dst_node: u64,
    /// Destination IP (UDP link); `None` on the loopback link.
    pub dst_ip: Option<std::net::IpAddr>,
    /// Node that sent it.
    pub src_node: u64,
    /// Sending QP (the wire derives it from the UDP flow; kept here for completions).
    pub src_qpn: u32,
    /// Base transport header.
    pub bth: Bth,
    /// Extension headers.
    pub ext: ExtHeaders,
    /// Payload.
    pub payload: Payload,
}

impl Pkt {
    /// Serialise to a RoCEv2 UDP payload (BTH .. ICRC) with the wire module's builder.
    pub fn to_wire(&self, inputs: &IcrcInputs) -> Result<Vec<u8>, WireError> {
        let b = &self.bth;
        let mut pb = PacketBuilder::new(b.opcode, b.dest_qpn, b.psn)
            .se(b.se)
            .ack_req(b.ack_req)
            .pkey(b.pkey);
        let e = &self.ext;
        if let Some(x) = e.reth {
            pb = pb.reth(x);
        }
        if let Some(x) = e.aeth {
            pb = pb.aeth(x);
        }
        if let Some(x) = e.atomic_eth {
            pb = pb.atomic_eth(x);
        }
        if let Some(x) = e.atomic_ack_eth {
            pb = pb.atomic_ack_eth(x);
        }
        if let Some(x) = e.immdt {
            pb = pb.immdt(x);
        }
        if let Some(x) = e.ieth {
            pb = pb.ieth(x);
        }
        pb.to_vec(&self.payload.to_vec(), inputs)
    }
}

/// Why a received datagram was dropped (counted per device; none of them touches memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drop {
    /// Not a well-formed RoCEv2 RC packet (truncated, bad version, unknown opcode, bad pad...).
    Malformed,
    /// The ICRC does not match.
    BadIcrc,
    /// No QP with the destination QPN.
    UnknownQp,
}

impl Pkt {
    /// Build a packet from a received RoCEv2 datagram (UDP payload, BTH .. ICRC) after checking
    /// its structure and ICRC. `src`/`dst` are the UDP endpoints it travelled between.
    pub fn from_wire(
        datagram: &[u8],
        src: std::net::SocketAddr,
        dst: std::net::SocketAddr,
        node: u64,
    ) -> Result<Pkt, Drop> {
        let (mut p, at) = Self::parse_wire(datagram, src, dst, node)?;
        p.payload = Payload::copied(&datagram[at]);
        Ok(p)
    }

    /// As [`from_wire`](Self::from_wire), but the payload is left [`Payload::Empty`] and its
    /// byte range in `datagram` returned, for the caller to place (the UDP receiver shares
    /// its buffer for long payloads instead of copying them).
    pub(crate) fn parse_wire(
        datagram: &[u8],
        src: std::net::SocketAddr,
        dst: std::net::SocketAddr,
        node: u64,
    ) -> Result<(Pkt, std::ops::Range<usize>), Drop> {
        let view = crate::wire::Packet::parse(datagram).map_err(|_| Drop::Malformed)?;
        if !icrc_ok(&view, src, dst) {
            return Err(Drop::BadIcrc);
        }
        // The payload's position inside the datagram.
        let at = view.payload.as_ptr() as usize - datagram.as_ptr() as usize;
        let range = at..at + view.payload.len();
        Ok((
            Pkt {
                dst_node: node,
                dst_ip: None,
                src_node: 0,
                src_qpn: 0,
                bth: view.bth,
                ext: view.ext,
                payload: Payload::Empty,
            },
            range,
        ))
    }
}

/// ICRC check of a datagram received on a plain UDP socket. IPv6 is exact. For IPv4 the IP
/// identification and flags are not visible to a UDP socket: packets from mrkit peers carry
/// ID 0 with DF unless they were segmented by UDP GSO (IDs 0, 1, 2, ...), so the check solves
/// for the 17 unknown bits (roce.md §2.4), which accepts any ID and DF value (ID 0 with DF
/// among them) and still rejects a corrupted packet with probability 1 - 2^-15. The CRC over
/// the packet is computed once (with ID 0, DF clear); the solve works on that value alone.
fn icrc_ok(
    view: &crate::wire::PacketView<'_>,
    src: std::net::SocketAddr,
    dst: std::net::SocketAddr,
) -> bool {
    let inputs = IcrcInputs::from_socket_addrs(src, dst);
    if !inputs.is_ipv4() {
        return view.verify_icrc(&inputs).is_ok();
    }
    let datagram = view.datagram();
    let Some((body, found)) = datagram.split_last_chunk::<{ crate::wire::ICRC_LEN }>() else {
        return false;
    };
    let found = u32::from_le_bytes(*found);
    // Computed as our own sender sends (ID 0, DF): the common case is accepted without the
    // solver. Anything else (a GSO segment's ID, a foreign peer) goes through the solver,
    // which starts from the value with DF clear (the DF bit's term is linear).
    let expected = inputs.compute(body);
    if expected == found {
        return true;
    }
    // The solver's basis depends only on the datagram length: cache a few per thread (FxHash:
    // this lookup runs for every datagram received).
    thread_local! {
        static SOLVERS: std::cell::RefCell<rustc_hash::FxHashMap<usize, crate::wire::Ipv4IdSolver>> =
            std::cell::RefCell::new(rustc_hash::FxHashMap::default());
    }
    let len = datagram.len();
    SOLVERS.with(|c| {
        let mut c = c.borrow_mut();
        if c.len() > 64 && !c.contains_key(&len) {
            c.clear();
        }
        c.entry(len)
            .or_insert_with(|| crate::wire::Ipv4IdSolver::new(len))
            .solve_values_df(expected, found)
            .is_some()
    })
}

thread_local! {
    /// Emptied packet vectors kept for reuse (`pkt_vec`/`recycle`).
    static SPARE_PKT_VECS: std::cell::RefCell<Vec<Vec<Pkt>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Spare packet vectors a thread keeps, and the largest capacity kept.
const SPARE_PKT_VECS_MAX: usize = 4;
const SPARE_PKT_VEC_CAP_MAX: usize = 64;

/// An empty packet vector, reused from this thread's spares when there is one. A QP run's
/// output, the held-ACK list and each send's list would otherwise be one allocation and free
/// apiece per message (three per request/response leg).
pub(crate) fn pkt_vec() -> Vec<Pkt> {
    SPARE_PKT_VECS
        .try_with(|s| s.try_borrow_mut().ok().and_then(|mut s| s.pop()))
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// Give a packet vector back for [`pkt_vec`] (its packets are dropped).
pub(crate) fn recycle(mut v: Vec<Pkt>) {
    v.clear();
    if v.capacity() == 0 || v.capacity() > SPARE_PKT_VEC_CAP_MAX {
        return;
    }
    let _ = SPARE_PKT_VECS.try_with(|s| {
        if let Ok(mut s) = s.try_borrow_mut() {
            if s.len() < SPARE_PKT_VECS_MAX {
                s.push(v);
            }
        }
    });
}

/// Send packets: over the in-process loopback link, or as RoCEv2 datagrams over UDP when the
/// packet names an IP destination.
pub(crate) fn deliver(ctx: &crate::Context, pkts: Vec<Pkt>) {
    if pkts.iter().all(|p| p.dst_ip.is_none()) {
        return loopback::deliver(pkts);
    }
    if pkts.iter().all(|p| p.dst_ip.is_some()) {
        return udp::send_pkts(ctx, pkts);
    }
    let mut local = Vec::new();
    let mut wire = Vec::new();
    for p in pkts {
        if p.dst_ip.is_some() {
            wire.push(p);
        } else {
            local.push(p);
        }
    }
    if !local.is_empty() {
        loopback::deliver(local);
    }
    udp::send_pkts(ctx, wire);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The receive-side ICRC check accepts every IPv4 ID and DF value a sender may use (our
    /// own: ID 0 with DF, GSO segments 1, 2, ...; a foreign stack: any ID, DF or not), and
    /// rejects a corrupted packet; IPv6 is exact.
    #[test]
    fn icrc_check_accepts_any_ipv4_id_and_df_and_rejects_corruption() {
        use crate::wire::{Opcode, PacketBuilder, IPV4_FLAGS_DF};
        let src: std::net::SocketAddr = "127.0.0.2:49152".parse().unwrap();
        let dst: std::net::SocketAddr = "127.0.0.1:4791".parse().unwrap();
        let base = IcrcInputs::from_socket_addrs(src, dst);
        let b = PacketBuilder::new(Opcode::SendOnly, 0x12, 7);
        for (id, flags) in [
            (0, IPV4_FLAGS_DF),
            (1, IPV4_FLAGS_DF),
            (63, IPV4_FLAGS_DF),
            (0, 0),
            (0xBEEF, 0),
        ] {
            for len in [0usize, 8, 100, 4096] {
                let sender = base.with_ipv4_id(id, flags);
                let d = b.to_vec(&vec![0xA5; len], &sender).unwrap();
                let view = crate::wire::Packet::parse(&d).unwrap();
                assert!(
                    icrc_ok(&view, src, dst),
                    "id {id} flags {flags:#x} len {len}"
                );
                let mut bad = d.clone();
                let at = bad.len() / 2;
                bad[at] ^= 0x10;
                let view = crate::wire::Packet::parse(&bad).unwrap();
                assert!(!icrc_ok(&view, src, dst), "corrupted: id {id} len {len}");
            }
        }
        let src6: std::net::SocketAddr = "[fd00::2]:49152".parse().unwrap();
        let dst6: std::net::SocketAddr = "[fd00::1]:4791".parse().unwrap();
        let d = b
            .to_vec(&[1, 2, 3, 4], &IcrcInputs::from_socket_addrs(src6, dst6))
            .unwrap();
        assert!(icrc_ok(
            &crate::wire::Packet::parse(&d).unwrap(),
            src6,
            dst6
        ));
        assert!(!icrc_ok(
            &crate::wire::Packet::parse(&d).unwrap(),
            src6,
            "[fd00::3]:4791".parse().unwrap()
        ));
    }

    #[test]
    fn copied_payloads_live_in_the_packet_up_to_small_payload_bytes() {
        // (length, variant) and every byte reads back.
        for n in [0, 1, 8, SMALL_PAYLOAD, SMALL_PAYLOAD + 1, 4096] {
            let src: Vec<u8> = (0..n).map(|i| i as u8 ^ 0x5a).collect();
            let p = Payload::copied(&src);
            let kind = match &p {
                Payload::Empty => "empty",
                Payload::Small { .. } => "small",
                Payload::Bytes(_) => "heap",
                _ => "other",
            };
            let want = match n {
                0 => "empty",
                n if n <= SMALL_PAYLOAD => "small",
                _ => "heap",
            };
            assert_eq!((n, kind), (n, want));
            assert_eq!(p.len(), n);
            assert_eq!(p.to_vec(), src);
            if n > 2 {
                let mut part = vec![0u8; n - 2];
                p.read(1, &mut part);
                assert_eq!(part, src[1..n - 1]);
            }
        }
    }
}
