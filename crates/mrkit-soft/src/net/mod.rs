//! The link: RoCEv2 over UDP, wire in and wire out.
//!
//! [`Pkt::from_wire`] parses a received datagram into a packet after checking its structure
//! and ICRC ([`Ipv4IcrcMode`] says how an IPv4 ICRC is checked), [`Pkt::to_wire`] serialises
//! one; [`udp`] owns the device's sockets (segmentation and receive offload, adaptive
//! receive, the serialiser that writes packets straight into send buffers, link counters) and
//! [`sockio`] their system calls. An optional seeded [`fault`] injector sits on the send path.
//! The link knows no QP and no device: the driver hands it packets to send and takes the
//! packets it receives.
#![deny(unsafe_code)]

pub use crate::fault;
#[allow(unsafe_code)] // sendmmsg / recvmmsg with their control messages
pub mod sockio;
pub mod udp;

mod recv;
mod send;
mod stats;

pub use crate::pkt::{Payload, Pkt, SMALL_PAYLOAD};
pub use crate::wire::Ipv4IcrcMode;
use crate::wire::{IcrcInputs, PacketBuilder, WireError};

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
pub enum DatagramDrop {
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
    ) -> Result<Pkt, DatagramDrop> {
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
    ) -> Result<Pkt, DatagramDrop> {
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
    ) -> Result<(Pkt, std::ops::Range<usize>), DatagramDrop> {
        let view = crate::wire::Packet::parse(datagram).map_err(|_| DatagramDrop::Malformed)?;
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
) -> Result<(), DatagramDrop> {
    let inputs = IcrcInputs::from_socket_addrs(src, dst);
    if !inputs.is_ipv4() {
        return inputs.verify(datagram).map_err(|_| DatagramDrop::BadIcrc);
    }
    let Some((body, found)) = datagram.split_last_chunk::<{ crate::wire::ICRC_LEN }>() else {
        return Err(DatagramDrop::BadIcrc);
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
            Some((id, df)) => Err(DatagramDrop::IcrcIpv4Id { id, df }),
            None => Err(DatagramDrop::BadIcrc),
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

    fn check(d: &[u8], seg: usize, mode: Ipv4IcrcMode) -> Result<(), DatagramDrop> {
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
                    Err(DatagramDrop::IcrcIpv4Id { id, df: true }),
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
                Err(DatagramDrop::IcrcIpv4Id {
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
            assert_eq!(
                icrc_check(&d, src6, other, 0, mode),
                Err(DatagramDrop::BadIcrc)
            );
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
}
