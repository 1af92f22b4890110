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

pub use crate::fault;
pub mod fuzz;
pub mod loopback;
pub mod udp;

use crate::copy;
use crate::mr::MrGuard;
pub use crate::wire::Ipv4IcrcMode;
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
    /// The error names the side that could not be reached: `dst`, or (pieces of registered
    /// memory) the sender's memory.
    pub(crate) fn copy_to(
        &self,
        mut poff: usize,
        dst: &MrGuard,
        mut doff: u64,
        mut n: usize,
    ) -> Result<(), copy::Unreachable> {
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
                    copy::mem_to_mem(dst, doff, g, goff + poff as u64, k)?;
                    doff += k as u64;
                    n -= k;
                    poff = 0;
                }
            }
            _ => debug_assert_eq!(n, 0), // no payload
        }
        Ok(())
    }
    /// Copy `dst.len()` payload bytes starting at `poff` into a slice. Fails (and `dst` must
    /// not be used) when a piece of registered memory could not be read.
    pub(crate) fn read(&self, mut poff: usize, dst: &mut [u8]) -> Result<(), copy::Unreachable> {
        if let Some(b) = self.contiguous() {
            dst.copy_from_slice(&b[poff..poff + dst.len()]);
            return Ok(());
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
                copy::read_into(g, goff + poff as u64, &mut dst[d..d + k])?;
                d += k;
                poff = 0;
            }
        }
        Ok(())
    }
    /// The payload as owned bytes; [`WireError::PayloadUnreachable`] when a piece of registered
    /// memory could not be read (unmapped memory of an mlock-pinned MR).
    pub fn to_vec(&self) -> Result<Vec<u8>, WireError> {
        let mut v = vec![0; self.len()];
        self.read(0, &mut v)
            .map_err(|_| WireError::PayloadUnreachable)?;
        Ok(v)
    }
}

/// A packet in flight between two QPs.
#[derive(Debug)]
pub struct Pkt {
    /// Node (device instance) the packet is for (loopback link).
    pub dst_node: u64,
    /// Destination IP (UDP link); `None` on the loopback link.
    pub dst_ip: Option<std::net::IpAddr>,
    /// Source IP of a packet received from the UDP link (checked against the QP's remote
    /// address before the QP acts on it); `None` for packets built in this process.
    pub src_ip: Option<std::net::IpAddr>,
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
        pb.to_vec(&self.payload.to_vec()?, inputs)
    }
}

/// Why a received datagram was dropped (counted per device; none of them touches memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drop {
    /// Not a well-formed RoCEv2 RC packet (truncated, bad version, unknown opcode, bad pad...).
    Malformed,
    /// The ICRC does not match.
    BadIcrc,
    /// The ICRC does not match the one IPv4 identification this receiver expects, but does
    /// match another `(identification, DF)`: a foreign sender's ID (which
    /// [`Ipv4IcrcMode::Solve`] would accept), or one of an mrkit sender's GSO segments that
    /// reached the socket cut apart from its batch.
    IcrcIpv4Id {
        /// The identification the ICRC matches.
        id: u16,
        /// Whether it matches with DF set.
        df: bool,
    },
    /// No QP with the destination QPN.
    UnknownQp,
}

impl Pkt {
    /// Build a packet from a received RoCEv2 datagram (UDP payload, BTH .. ICRC) after checking
    /// its structure and ICRC. `src`/`dst` are the UDP endpoints it travelled between; the
    /// datagram is taken to have arrived alone ([`Ipv4IcrcMode::Exact`], ID 0 with DF).
    pub fn from_wire(
        datagram: &[u8],
        src: std::net::SocketAddr,
        dst: std::net::SocketAddr,
        node: u64,
    ) -> Result<Pkt, Drop> {
        Self::from_wire_in_batch(datagram, src, dst, node, 0, Ipv4IcrcMode::Exact)
    }

    /// As [`from_wire`](Self::from_wire) for the `seg`-th datagram of a receive offload batch
    /// (its IPv4 ICRC is checked for ID `seg` with DF), or with the `mode` of a device
    /// configured for foreign peers.
    pub fn from_wire_in_batch(
        datagram: &[u8],
        src: std::net::SocketAddr,
        dst: std::net::SocketAddr,
        node: u64,
        seg: usize,
        mode: Ipv4IcrcMode,
    ) -> Result<Pkt, Drop> {
        let (mut p, at) = Self::parse_wire(datagram, src, dst, node, seg, mode)?;
        p.payload = Payload::copied(&datagram[at]);
        Ok(p)
    }

    /// As [`from_wire`](Self::from_wire), but the payload is left [`Payload::Empty`] and its
    /// byte range in `datagram` returned, for the caller to place (the UDP receiver shares
    /// its buffer for long payloads instead of copying them). `seg` is the datagram's index
    /// in its receive batch (see [`Ipv4IcrcMode::Exact`]).
    pub(crate) fn parse_wire(
        datagram: &[u8],
        src: std::net::SocketAddr,
        dst: std::net::SocketAddr,
        node: u64,
        seg: usize,
        mode: Ipv4IcrcMode,
    ) -> Result<(Pkt, std::ops::Range<usize>), Drop> {
        let view = crate::wire::Packet::parse(datagram).map_err(|_| Drop::Malformed)?;
        icrc_check(view.datagram(), src, dst, seg, mode)?;
        // The payload's position inside the datagram.
        let at = view.payload.as_ptr() as usize - datagram.as_ptr() as usize;
        let range = at..at + view.payload.len();
        Ok((
            Pkt {
                dst_node: node,
                dst_ip: None,
                src_ip: Some(src.ip()),
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

/// ICRC check of a datagram received on a plain UDP socket, `seg`-th of its receive batch.
/// IPv6 is exact. For IPv4 the identification and flags are not visible to a UDP socket; see
/// [`Ipv4IcrcMode`] for what each mode accepts. The CRC over the packet is computed once
/// (with ID 0 and DF, as a lone datagram from an mrkit sender carries); another expected ID
/// and the solver work from that value alone (the ID and DF terms are linear).
fn icrc_check(
    datagram: &[u8],
    src: std::net::SocketAddr,
    dst: std::net::SocketAddr,
    seg: usize,
    mode: Ipv4IcrcMode,
) -> Result<(), Drop> {
    let inputs = IcrcInputs::from_socket_addrs(src, dst);
    if !inputs.is_ipv4() {
        return inputs.verify(datagram).map_err(|_| Drop::BadIcrc);
    }
    let Some((body, found)) = datagram.split_last_chunk::<{ crate::wire::ICRC_LEN }>() else {
        return Err(Drop::BadIcrc);
    };
    let found = u32::from_le_bytes(*found);
    let expected = inputs.compute(body);
    // A lone datagram (the latency path): one CRC, one compare, no solver lookup.
    if seg == 0 && expected == found {
        return Ok(());
    }
    with_solver(datagram.len(), |solver| {
        if mode == Ipv4IcrcMode::Exact && seg != 0 {
            // A GSO segment's index beyond the ID field's range cannot be ours.
            if let Ok(k) = u16::try_from(seg) {
                if expected ^ solver.id_term(k) == found {
                    return Ok(());
                }
            }
        }
        match solver.solve_values_df(expected, found) {
            Some(_) if mode == Ipv4IcrcMode::Solve => Ok(()),
            Some((id, df)) => Err(Drop::IcrcIpv4Id { id, df }),
            None => Err(Drop::BadIcrc),
        }
    })
}

/// Run `f` with this thread's solver for datagrams of `len` bytes. The solver's basis depends
/// only on the length: a few are cached per thread (FxHash: this lookup runs for every
/// datagram of a receive batch but the first).
fn with_solver<R>(len: usize, f: impl FnOnce(&crate::wire::Ipv4IdSolver) -> R) -> R {
    thread_local! {
        static SOLVERS: std::cell::RefCell<rustc_hash::FxHashMap<usize, crate::wire::Ipv4IdSolver>> =
            std::cell::RefCell::new(rustc_hash::FxHashMap::default());
    }
    SOLVERS.with(|c| {
        let mut c = c.borrow_mut();
        if c.len() > 64 && !c.contains_key(&len) {
            c.clear();
        }
        f(c.entry(len)
            .or_insert_with(|| crate::wire::Ipv4IdSolver::new(len)))
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

    use crate::wire::{Opcode, PacketBuilder, IPV4_FLAGS_DF};

    fn addrs() -> (std::net::SocketAddr, std::net::SocketAddr) {
        (
            "127.0.0.2:49152".parse().unwrap(),
            "127.0.0.1:4791".parse().unwrap(),
        )
    }

    /// A valid datagram of exactly `len` bytes (BTH .. ICRC), sent with IPv4 ID `id` and DF.
    fn datagram(len: usize, id: u16) -> Vec<u8> {
        let (src, dst) = addrs();
        let inputs = IcrcInputs::from_socket_addrs(src, dst).with_ipv4_id(id, IPV4_FLAGS_DF);
        // SEND_ONLY: BTH (12) + payload + ICRC (4); payloads a multiple of 4 need no pad.
        let payload: Vec<u8> = (0..len - 16).map(|i| (i * 7 + 3) as u8).collect();
        let d = PacketBuilder::new(Opcode::SendOnly, 0x12, 7)
            .to_vec(&payload, &inputs)
            .unwrap();
        assert_eq!(d.len(), len);
        d
    }

    fn check(d: &[u8], seg: usize, mode: Ipv4IcrcMode) -> Result<(), Drop> {
        let (src, dst) = addrs();
        icrc_check(d, src, dst, seg, mode)
    }

    /// Flip the bits of `pattern` (bit 0 = the burst's first bit) starting at bit `at` of the
    /// datagram (bit 0 = the most significant bit of byte 0).
    fn flip(d: &mut [u8], at: usize, pattern: u32, len: usize) {
        for i in 0..len {
            if pattern >> i & 1 != 0 {
                let bit = at + i;
                d[bit / 8] ^= 0x80 >> (bit % 8);
            }
        }
    }

    /// BTH byte 4 (FECN, BECN, reserved) is not covered by the ICRC (it is replaced by ones).
    fn covered(bit: usize) -> bool {
        bit / 8 != 4
    }

    /// The exact IPv4 check takes the one ID an mrkit sender uses (the index in the receive
    /// batch, with DF) and rejects every other: ID 0 for a lone datagram, ID `k` for the
    /// `k`-th of a batch; without DF, or any other ID, it is a drop that names the ID. The
    /// solve mode takes any ID and DF value. IPv6 is exact.
    #[test]
    fn ipv4_icrc_check_takes_exactly_the_senders_id() {
        for len in [16usize, 24, 116, 4112] {
            for (id, seg) in [(0u16, 0usize), (1, 1), (63, 63), (5, 5)] {
                let d = datagram(len, id);
                assert_eq!(
                    check(&d, seg, Ipv4IcrcMode::Exact),
                    Ok(()),
                    "len {len} id {id}"
                );
                assert_eq!(check(&d, seg, Ipv4IcrcMode::Solve), Ok(()));
                // The same datagram at another batch index, or as a lone datagram.
                let other = if seg == 0 { 1 } else { 0 };
                assert_eq!(
                    check(&d, other, Ipv4IcrcMode::Exact),
                    Err(Drop::IcrcIpv4Id { id, df: true }),
                    "len {len} id {id} at {other}"
                );
            }
            let (src, dst) = addrs();
            let foreign = IcrcInputs::from_socket_addrs(src, dst).with_ipv4_id(0xBEEF, 0);
            let d = PacketBuilder::new(Opcode::SendOnly, 0x12, 7)
                .to_vec(&vec![0xA5; len - 16], &foreign)
                .unwrap();
            assert_eq!(
                check(&d, 0, Ipv4IcrcMode::Exact),
                Err(Drop::IcrcIpv4Id {
                    id: 0xBEEF,
                    df: false
                })
            );
            assert_eq!(check(&d, 0, Ipv4IcrcMode::Solve), Ok(()));
        }
        let src6: std::net::SocketAddr = "[fd00::2]:49152".parse().unwrap();
        let dst6: std::net::SocketAddr = "[fd00::1]:4791".parse().unwrap();
        let b = PacketBuilder::new(Opcode::SendOnly, 0x12, 7);
        let d = b
            .to_vec(&[1, 2, 3, 4], &IcrcInputs::from_socket_addrs(src6, dst6))
            .unwrap();
        for mode in [Ipv4IcrcMode::Exact, Ipv4IcrcMode::Solve] {
            assert_eq!(icrc_check(&d, src6, dst6, 0, mode), Ok(()));
            let other: std::net::SocketAddr = "[fd00::3]:4791".parse().unwrap();
            assert_eq!(icrc_check(&d, src6, other, 0, mode), Err(Drop::BadIcrc));
        }
    }

    /// The bounded proof of the exact check: for datagrams of 60, 1084 and 4124 bytes sent
    /// alone (ID 0) and as GSO segments (IDs 1 and 63), every single-bit error in the bytes
    /// the ICRC covers is rejected, and so is every burst of 2..=32 bits (first and last bits
    /// set; middles all clear, all set, and two alternating patterns) at a sample of positions
    /// (every position of the 60-byte datagram). The old check, which accepted any ID/DF
    /// (`Solve`), demonstrably accepts some of these single-bit errors.
    #[test]
    fn exact_ipv4_icrc_rejects_every_single_bit_error_and_short_burst() {
        let mut solve_accepted = 0;
        for len in [60usize, 1084, 4124] {
            for id in [0u16, 1, 63] {
                let d = datagram(len, id);
                let seg = usize::from(id);
                let bits = len * 8;
                let mut e = d.clone();
                for bit in (0..bits).filter(|b| covered(*b)) {
                    flip(&mut e, bit, 1, 1);
                    assert!(
                        check(&e, seg, Ipv4IcrcMode::Exact).is_err(),
                        "single-bit error at bit {bit} of {len} bytes (ID {id}) accepted"
                    );
                    if id == 0 && check(&e, seg, Ipv4IcrcMode::Solve).is_ok() {
                        solve_accepted += 1;
                    }
                    flip(&mut e, bit, 1, 1);
                }
                let step = if len <= 60 { 1 } else { 97 };
                for burst in 2..=32usize {
                    let ends = 1u32 | 1 << (burst - 1);
                    let mask = if burst == 32 {
                        u32::MAX
                    } else {
                        (1u32 << burst) - 1
                    };
                    for middle in [0u32, u32::MAX, 0xAAAA_AAAA, 0x3C96_5AA5] {
                        let pattern = (middle & mask) | ends;
                        for at in (0..=bits - burst).step_by(step) {
                            if !(at..at + burst).all(covered) {
                                continue;
                            }
                            flip(&mut e, at, pattern, burst);
                            assert!(
                                check(&e, seg, Ipv4IcrcMode::Exact).is_err(),
                                "burst {pattern:#x} ({burst} bits) at bit {at} of {len} bytes \
                                 (ID {id}) accepted"
                            );
                            flip(&mut e, at, pattern, burst);
                        }
                    }
                }
                assert_eq!(e, d);
            }
        }
        assert!(
            solve_accepted > 0,
            "the any-ID check accepted no single-bit error at these lengths"
        );
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
            assert_eq!(p.to_vec().unwrap(), src);
            if n > 2 {
                let mut part = vec![0u8; n - 2];
                p.read(1, &mut part).unwrap();
                assert_eq!(part, src[1..n - 1]);
            }
        }
    }
}
