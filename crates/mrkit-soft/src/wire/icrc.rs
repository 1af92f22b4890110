//! The RoCEv2 invariant CRC (docs/roce.md §2).
//!
//! The ICRC is the zlib/Ethernet CRC-32 over a pseudo-packet:
//! 8 bytes `0xFF` (stand-in for the IB LRH) ‖ IP header with TOS/TTL/checksum (IPv4) or
//! traffic class/flow label/hop limit (IPv6) set to ones ‖ UDP header with checksum `0xFFFF` ‖
//! BTH with byte 4 set to `0xFF` ‖ extension headers, payload and pad. It is stored
//! **little-endian** in the last 4 bytes of the UDP payload.
//!
//! A UDP socket does not see the IP header, so the covered IP fields are rebuilt from the
//! addresses and the datagram length ([`IcrcInputs`]). For IPv4 the identification and
//! flags/fragment fields are covered too; our own sender uses an unconnected socket with
//! `IP_PMTUDISC_DO`, which makes the kernel send ID 0 with DF (docs/roce.md §2.3), and that is what
//! [`IcrcInputs::ipv4`] assumes. [`Ipv4IdSolver`] recovers an unknown ID (docs/roce.md §2.4).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use super::error::WireError;
use super::ICRC_LEN;

/// IPv4 flags/fragment-offset word with only DF set.
pub const IPV4_FLAGS_DF: u16 = 0x4000;

const LRH_STANDIN: [u8; 8] = [0xFF; 8];
const IPV4_HDR_LEN: usize = 20;
const IPV6_HDR_LEN: usize = 40;
const UDP_HDR_LEN: usize = 8;
const IPPROTO_UDP: u8 = 17;

/// The covered IP header fields that a UDP socket does not show.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IpInfo {
    /// IPv4 without options.
    V4 {
        /// Source address.
        src: Ipv4Addr,
        /// Destination address.
        dst: Ipv4Addr,
        /// IP identification (0 for our own sender, see the module docs).
        identification: u16,
        /// Flags (3 bits) and fragment offset (13 bits); [`IPV4_FLAGS_DF`] for RoCE.
        flags_fragment: u16,
    },
    /// IPv6 without extension headers.
    V6 {
        /// Source address.
        src: Ipv6Addr,
        /// Destination address.
        dst: Ipv6Addr,
    },
}

/// Everything besides the UDP payload that the ICRC covers.
///
/// ```
/// use mrkit_soft::wire::IcrcInputs;
/// use std::net::Ipv4Addr;
/// // ACKNOWLEDGE from docs/roce.md §2.2 vector 3 (UDP payload only).
/// let payload = [0x11, 0x00, 0xff, 0xff, 0, 0, 0, 0x12, 0x00, 0x0a, 0xbc, 0xde,
///                0x1f, 0x00, 0x00, 0x01, 0x13, 0x28, 0x3c, 0xd5];
/// let lo = Ipv4Addr::LOCALHOST;
/// let inputs = IcrcInputs::ipv4(lo, lo, 0xc124, 4791);
/// assert_eq!(inputs.compute(&payload[..16]).to_le_bytes(), [0x13, 0x28, 0x3c, 0xd5]);
/// assert!(inputs.verify(&payload).is_ok());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IcrcInputs {
    /// IP addresses and (IPv4) identification/flags.
    pub ip: IpInfo,
    /// UDP source port.
    pub src_port: u16,
    /// UDP destination port (normally 4791).
    pub dst_port: u16,
}

impl IcrcInputs {
    /// IPv4 inputs with identification 0 and DF set (what our unconnected `IP_PMTUDISC_DO`
    /// socket and the kernel produce).
    pub const fn ipv4(src: Ipv4Addr, dst: Ipv4Addr, src_port: u16, dst_port: u16) -> IcrcInputs {
        IcrcInputs {
            ip: IpInfo::V4 {
                src,
                dst,
                identification: 0,
                flags_fragment: IPV4_FLAGS_DF,
            },
            src_port,
            dst_port,
        }
    }

    /// IPv6 inputs.
    pub const fn ipv6(src: Ipv6Addr, dst: Ipv6Addr, src_port: u16, dst_port: u16) -> IcrcInputs {
        IcrcInputs {
            ip: IpInfo::V6 { src, dst },
            src_port,
            dst_port,
        }
    }

    /// Inputs from two addresses as a UDP socket reports them.
    ///
    /// If both addresses are IPv4 or IPv4-mapped IPv6 (`::ffff:a.b.c.d`, as a dual-stack socket
    /// reports IPv4 peers), the packet is IPv4 with ID 0 and DF ([`IcrcInputs::ipv4`]).
    /// Otherwise it is IPv6, with IPv4 addresses taken in their mapped form.
    pub fn new(src: IpAddr, dst: IpAddr, src_port: u16, dst_port: u16) -> IcrcInputs {
        match (as_v4(src), as_v4(dst)) {
            (Some(s), Some(d)) => IcrcInputs::ipv4(s, d, src_port, dst_port),
            _ => IcrcInputs::ipv6(as_v6(src), as_v6(dst), src_port, dst_port),
        }
    }

    /// Same as [`IcrcInputs::new`] with socket addresses.
    pub fn from_socket_addrs(src: SocketAddr, dst: SocketAddr) -> IcrcInputs {
        IcrcInputs::new(src.ip(), dst.ip(), src.port(), dst.port())
    }

    /// Replaces the IPv4 identification and flags/fragment word (no effect for IPv6).
    pub const fn with_ipv4_id(mut self, identification: u16, flags_fragment: u16) -> IcrcInputs {
        if let IpInfo::V4 { src, dst, .. } = self.ip {
            self.ip = IpInfo::V4 {
                src,
                dst,
                identification,
                flags_fragment,
            };
        }
        self
    }

    /// True for IPv4.
    pub const fn is_ipv4(&self) -> bool {
        matches!(self.ip, IpInfo::V4 { .. })
    }

    /// The ICRC value of a UDP payload `body` (BTH through pad, **without** the 4 ICRC bytes).
    /// The wire bytes are `value.to_le_bytes()`.
    pub fn compute(&self, body: &[u8]) -> u32 {
        let udp_len = UDP_HDR_LEN + body.len() + ICRC_LEN;
        let mut h = crc32fast::Hasher::new_with_initial(self.pseudo_header_crc(udp_len));
        if body.len() > 4 {
            // BTH bytes 0-3 as they are, byte 4 (FECN/BECN/resv6a) replaced by 0xFF. (Three
            // updates are cheaper than copying a short packet to mask the byte.)
            h.update(&body[..4]);
            h.update(&[0xFF]);
            h.update(&body[5..]);
        } else {
            h.update(body);
        }
        h.finalize()
    }

    /// The CRC-32 of the pseudo-header (LRH stand-in, IP header, UDP header) of a datagram
    /// whose UDP length is `udp_len`.
    ///
    /// The CRC is affine in its input, so this is the CRC of the pseudo-header with both
    /// length fields zero (which depends on the addresses and ports only, and is cached per
    /// thread for the last two `IcrcInputs` seen: a QP's outgoing and incoming flows) XOR the
    /// length fields' contribution from [`LengthTerms`]. Saves ~40 of the ~60 bytes a short
    /// packet's ICRC covers, on every packet sent and received.
    fn pseudo_header_crc(&self, udp_len: usize) -> u32 {
        let base = zero_length_crc(self);
        let terms = LengthTerms::get();
        let udp = udp_len as u16;
        match self.ip {
            IpInfo::V4 { .. } => base ^ terms.v4((IPV4_HDR_LEN + udp_len) as u16, udp),
            IpInfo::V6 { .. } => base ^ terms.v6(udp, udp),
        }
    }

    /// The pseudo-header with the given IP length field (IPv4 total length, IPv6 payload
    /// length) and UDP length field; returns the buffer and how many bytes of it are used.
    fn pseudo_header(&self, ip_len: u16, udp_len: u16) -> ([u8; MAX_PSEUDO_HEADER], usize) {
        let mut pre = [0xFFu8; MAX_PSEUDO_HEADER];
        let mut at = LRH_STANDIN.len();
        match self.ip {
            IpInfo::V4 {
                src,
                dst,
                identification,
                flags_fragment,
            } => {
                let ip = &mut pre[at..at + IPV4_HDR_LEN];
                ip[0] = 0x45;
                ip[1] = 0xFF; // TOS
                ip[2..4].copy_from_slice(&ip_len.to_be_bytes());
                ip[4..6].copy_from_slice(&identification.to_be_bytes());
                ip[6..8].copy_from_slice(&flags_fragment.to_be_bytes());
                ip[8] = 0xFF; // TTL
                ip[9] = IPPROTO_UDP;
                ip[10] = 0xFF; // header checksum
                ip[11] = 0xFF;
                ip[12..16].copy_from_slice(&src.octets());
                ip[16..20].copy_from_slice(&dst.octets());
                at += IPV4_HDR_LEN;
            }
            IpInfo::V6 { src, dst } => {
                let ip = &mut pre[at..at + IPV6_HDR_LEN];
                ip[0..4].copy_from_slice(&[0x6F, 0xFF, 0xFF, 0xFF]); // TC + flow label
                ip[4..6].copy_from_slice(&ip_len.to_be_bytes());
                ip[6] = IPPROTO_UDP;
                ip[7] = 0xFF; // hop limit
                ip[8..24].copy_from_slice(&src.octets());
                ip[24..40].copy_from_slice(&dst.octets());
                at += IPV6_HDR_LEN;
            }
        }
        let udp = &mut pre[at..at + UDP_HDR_LEN];
        udp[0..2].copy_from_slice(&self.src_port.to_be_bytes());
        udp[2..4].copy_from_slice(&self.dst_port.to_be_bytes());
        udp[4..6].copy_from_slice(&udp_len.to_be_bytes());
        udp[6..8].copy_from_slice(&[0xFF, 0xFF]); // checksum
        (pre, at + UDP_HDR_LEN)
    }

    /// Checks the ICRC of a whole UDP payload (BTH through ICRC).
    pub fn verify(&self, datagram: &[u8]) -> Result<(), WireError> {
        let (body, found) = split_icrc(datagram)?;
        let expected = self.compute(body);
        if expected == found {
            Ok(())
        } else {
            Err(WireError::BadIcrc { expected, found })
        }
    }

    /// Computes the ICRC over `datagram[..len - 4]` and stores it little-endian in the last 4 bytes.
    /// Returns the value.
    pub fn fill(&self, datagram: &mut [u8]) -> Result<u32, WireError> {
        let n = datagram.len();
        if n < ICRC_LEN {
            return Err(WireError::BufferTooSmall {
                needed: ICRC_LEN,
                available: n,
            });
        }
        let v = self.compute(&datagram[..n - ICRC_LEN]);
        datagram[n - ICRC_LEN..].copy_from_slice(&v.to_le_bytes());
        Ok(v)
    }
}

const MAX_PSEUDO_HEADER: usize = LRH_STANDIN.len() + IPV6_HDR_LEN + UDP_HDR_LEN;
const V4_PSEUDO_HEADER: usize = LRH_STANDIN.len() + IPV4_HDR_LEN + UDP_HDR_LEN;
/// Offsets of the IP and UDP length fields in the pseudo-header.
const V4_IP_LEN_AT: usize = LRH_STANDIN.len() + 2;
const V4_UDP_LEN_AT: usize = LRH_STANDIN.len() + IPV4_HDR_LEN + 4;
const V6_IP_LEN_AT: usize = LRH_STANDIN.len() + 4;
const V6_UDP_LEN_AT: usize = LRH_STANDIN.len() + IPV6_HDR_LEN + 4;

/// The CRC of `inputs`' pseudo-header with both length fields zero, from a per-thread cache of
/// the last two inputs seen (a thread that sends and receives for one connection sees two).
fn zero_length_crc(inputs: &IcrcInputs) -> u32 {
    use std::cell::Cell;
    type Slot = Cell<Option<(IcrcInputs, u32)>>;
    thread_local! {
        static LAST: [Slot; 2] = const { [Cell::new(None), Cell::new(None)] };
    }
    let compute = || {
        let (pre, n) = inputs.pseudo_header(0, 0);
        crc32fast::hash(&pre[..n])
    };
    LAST.try_with(|last| {
        for slot in last {
            if let Some((i, v)) = slot.get() {
                if i == *inputs {
                    return v;
                }
            }
        }
        let v = compute();
        last[1].set(last[0].get());
        last[0].set(Some((*inputs, v)));
        v
    })
    .unwrap_or_else(|_| compute())
}

/// The contribution of the pseudo-header's length fields to its CRC: for each of the four
/// length bytes, a table of `crc(zeros with that byte set) ^ crc(zeros)` (the CRC is affine:
/// `crc(a ^ b) = crc(a) ^ crc(b) ^ crc(0)` for messages of one length). 8 KiB, built once.
struct LengthTerms {
    /// IPv4: IP total length high/low byte, UDP length high/low byte.
    v4: [[u32; 256]; 4],
    /// IPv6: payload length high/low byte, UDP length high/low byte.
    v6: [[u32; 256]; 4],
}

impl LengthTerms {
    fn get() -> &'static LengthTerms {
        static TERMS: std::sync::OnceLock<Box<LengthTerms>> = std::sync::OnceLock::new();
        TERMS.get_or_init(|| {
            let table = |len: usize, at: usize| {
                let zero = crc_of_sparse(len, None);
                let mut t = [0u32; 256];
                for (v, e) in t.iter_mut().enumerate() {
                    *e = crc_of_sparse(len, Some((at, v as u8))) ^ zero;
                }
                t
            };
            let v6_len = MAX_PSEUDO_HEADER;
            Box::new(LengthTerms {
                v4: [
                    table(V4_PSEUDO_HEADER, V4_IP_LEN_AT),
                    table(V4_PSEUDO_HEADER, V4_IP_LEN_AT + 1),
                    table(V4_PSEUDO_HEADER, V4_UDP_LEN_AT),
                    table(V4_PSEUDO_HEADER, V4_UDP_LEN_AT + 1),
                ],
                v6: [
                    table(v6_len, V6_IP_LEN_AT),
                    table(v6_len, V6_IP_LEN_AT + 1),
                    table(v6_len, V6_UDP_LEN_AT),
                    table(v6_len, V6_UDP_LEN_AT + 1),
                ],
            })
        })
    }

    fn v4(&self, ip_len: u16, udp_len: u16) -> u32 {
        Self::term(&self.v4, ip_len, udp_len)
    }

    fn v6(&self, ip_len: u16, udp_len: u16) -> u32 {
        Self::term(&self.v6, ip_len, udp_len)
    }

    fn term(t: &[[u32; 256]; 4], ip_len: u16, udp_len: u16) -> u32 {
        let [ih, il] = ip_len.to_be_bytes();
        let [uh, ul] = udp_len.to_be_bytes();
        t[0][usize::from(ih)]
            ^ t[1][usize::from(il)]
            ^ t[2][usize::from(uh)]
            ^ t[3][usize::from(ul)]
    }
}

fn as_v4(a: IpAddr) -> Option<Ipv4Addr> {
    match a {
        IpAddr::V4(v) => Some(v),
        IpAddr::V6(v) => v.to_ipv4_mapped(),
    }
}

fn as_v6(a: IpAddr) -> Ipv6Addr {
    match a {
        IpAddr::V4(v) => v.to_ipv6_mapped(),
        IpAddr::V6(v) => v,
    }
}

/// Splits a UDP payload into the covered part and the carried ICRC value.
pub(crate) fn split_icrc(datagram: &[u8]) -> Result<(&[u8], u32), WireError> {
    match datagram.split_last_chunk::<ICRC_LEN>() {
        Some((body, icrc)) => Ok((body, u32::from_le_bytes(*icrc))),
        None => Err(WireError::Truncated {
            needed: ICRC_LEN,
            available: datagram.len(),
        }),
    }
}

/// ICRC value for a UDP payload as seen by a plain UDP socket.
///
/// `udp_payload_without_icrc` is BTH through pad. IPv4 is assumed to carry ID 0 and DF (see
/// [`IcrcInputs::new`] for how the address family is chosen). The wire bytes are
/// `value.to_le_bytes()`.
///
/// ```
/// use mrkit_soft::wire::icrc_for_udp_payload;
/// use std::net::{IpAddr, Ipv4Addr};
/// let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
/// let ack = [0x11, 0x00, 0xff, 0xff, 0, 0, 0, 0x12, 0x00, 0x0a, 0xbc, 0xde, 0x1f, 0, 0, 1];
/// assert_eq!(icrc_for_udp_payload(lo, lo, 0xc124, 4791, &ack).to_le_bytes(), [0x13, 0x28, 0x3c, 0xd5]);
/// ```
pub fn icrc_for_udp_payload(
    src_ip: IpAddr,
    dst_ip: IpAddr,
    src_port: u16,
    dst_port: u16,
    udp_payload_without_icrc: &[u8],
) -> u32 {
    IcrcInputs::new(src_ip, dst_ip, src_port, dst_port).compute(udp_payload_without_icrc)
}

/// Splits a whole IP packet (IPv4 without options, or IPv6 without extension headers, carrying
/// UDP) into the ICRC inputs (taken from the actual headers, including the IPv4 ID and flags)
/// and the UDP payload (BTH through ICRC).
///
/// Bytes after the IP total length (for example Ethernet padding) are ignored. The UDP
/// destination port is not checked (tests may use ports other than 4791).
pub fn split_ip_packet(pkt: &[u8]) -> Result<(IcrcInputs, &[u8]), WireError> {
    let bad = WireError::BadIpHeader;
    let first = *pkt.first().ok_or(WireError::Truncated {
        needed: IPV4_HDR_LEN,
        available: 0,
    })?;
    let (ip, l4) = match first >> 4 {
        4 => {
            if pkt.len() < IPV4_HDR_LEN {
                return Err(WireError::Truncated {
                    needed: IPV4_HDR_LEN,
                    available: pkt.len(),
                });
            }
            if first != 0x45 {
                return Err(bad("IPv4 header with options"));
            }
            if pkt[9] != IPPROTO_UDP {
                return Err(bad("IPv4 protocol is not UDP"));
            }
            let total = usize::from(u16::from_be_bytes([pkt[2], pkt[3]]));
            if total < IPV4_HDR_LEN {
                return Err(bad("IPv4 total length shorter than its header"));
            }
            let Some(l4) = pkt.get(IPV4_HDR_LEN..total) else {
                return Err(WireError::Truncated {
                    needed: total,
                    available: pkt.len(),
                });
            };
            let ip = IpInfo::V4 {
                src: Ipv4Addr::new(pkt[12], pkt[13], pkt[14], pkt[15]),
                dst: Ipv4Addr::new(pkt[16], pkt[17], pkt[18], pkt[19]),
                identification: u16::from_be_bytes([pkt[4], pkt[5]]),
                flags_fragment: u16::from_be_bytes([pkt[6], pkt[7]]),
            };
            (ip, l4)
        }
        6 => {
            if pkt.len() < IPV6_HDR_LEN {
                return Err(WireError::Truncated {
                    needed: IPV6_HDR_LEN,
                    available: pkt.len(),
                });
            }
            if pkt[6] != IPPROTO_UDP {
                return Err(bad("IPv6 next header is not UDP"));
            }
            let plen = usize::from(u16::from_be_bytes([pkt[4], pkt[5]]));
            let Some(l4) = pkt.get(IPV6_HDR_LEN..IPV6_HDR_LEN + plen) else {
                return Err(WireError::Truncated {
                    needed: IPV6_HDR_LEN + plen,
                    available: pkt.len(),
                });
            };
            let mut s = [0u8; 16];
            let mut d = [0u8; 16];
            s.copy_from_slice(&pkt[8..24]);
            d.copy_from_slice(&pkt[24..40]);
            (
                IpInfo::V6 {
                    src: Ipv6Addr::from(s),
                    dst: Ipv6Addr::from(d),
                },
                l4,
            )
        }
        _ => return Err(bad("not IPv4 or IPv6")),
    };
    if l4.len() < UDP_HDR_LEN {
        return Err(WireError::Truncated {
            needed: UDP_HDR_LEN,
            available: l4.len(),
        });
    }
    if usize::from(u16::from_be_bytes([l4[4], l4[5]])) != l4.len() {
        return Err(bad("UDP length does not match the IP length"));
    }
    let inputs = IcrcInputs {
        ip,
        src_port: u16::from_be_bytes([l4[0], l4[1]]),
        dst_port: u16::from_be_bytes([l4[2], l4[3]]),
    };
    Ok((inputs, &l4[UDP_HDR_LEN..]))
}

/// Checks the ICRC of a whole IP packet (IPv4 or IPv6), e.g. one read from a tshark/pcap capture
/// with `LINKTYPE_RAW`. Every covered field is taken from the packet itself.
///
/// ```
/// use mrkit_soft::wire::check_icrc_ip_packet;
/// // ConnectX-4 Lx CNP (docs/roce.md §2.2 vector 1), IP ID 0x718c.
/// let hex = "45c2003c718c4000401191610a0011010a001201000012b7002800008100ffff40000118000000000000000000000000000000000000000082fd002a";
/// let pkt: Vec<u8> = (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
/// assert!(check_icrc_ip_packet(&pkt).is_ok());
/// ```
pub fn check_icrc_ip_packet(pkt: &[u8]) -> Result<(), WireError> {
    let (inputs, payload) = split_ip_packet(pkt)?;
    inputs.verify(payload)
}

/// Like [`check_icrc_ip_packet`] but rejects anything that is not IPv4.
pub fn check_icrc_ipv4_packet(pkt: &[u8]) -> Result<(), WireError> {
    match pkt.first() {
        Some(b) if b >> 4 == 4 => check_icrc_ip_packet(pkt),
        Some(_) => Err(WireError::BadIpHeader("not IPv4")),
        None => Err(WireError::Truncated {
            needed: IPV4_HDR_LEN,
            available: 0,
        }),
    }
}

/// Like [`check_icrc_ip_packet`] but rejects anything that is not IPv6.
pub fn check_icrc_ipv6_packet(pkt: &[u8]) -> Result<(), WireError> {
    match pkt.first() {
        Some(b) if b >> 4 == 6 => check_icrc_ip_packet(pkt),
        Some(_) => Err(WireError::BadIpHeader("not IPv6")),
        None => Err(WireError::Truncated {
            needed: IPV6_HDR_LEN,
            available: 0,
        }),
    }
}

/// Recomputes and stores the ICRC of a whole IP packet in place (for tests that write pcaps).
pub fn fill_icrc_ip_packet(pkt: &mut [u8]) -> Result<u32, WireError> {
    let (inputs, payload) = split_ip_packet(pkt)?;
    let start = if inputs.is_ipv4() {
        IPV4_HDR_LEN
    } else {
        IPV6_HDR_LEN
    } + UDP_HDR_LEN;
    let end = start + payload.len();
    inputs.fill(&mut pkt[start..end])
}

/// Recovers the unknown IPv4 identification and DF bit of a received packet from its ICRC
/// (docs/roce.md §2.4, option 1).
///
/// The ICRC is affine in the covered bits, so the 16 ID bits and the DF bit act on it through a
/// fixed 32×17 linear map that depends only on the datagram length. Build one solver per length
/// (and cache it); [`Ipv4IdSolver::solve`] then costs one CRC. An unrelated corruption is accepted
/// with probability about 2^-15, so this is weaker than an exact check.
///
/// ```
/// use mrkit_soft::wire::{IcrcInputs, Ipv4IdSolver};
/// use std::net::Ipv4Addr;
/// let lo = Ipv4Addr::LOCALHOST;
/// let mut dgram = vec![0x11, 0, 0xff, 0xff, 0, 0, 0, 0x12, 0, 0, 0, 5, 0x1f, 0, 0, 1, 0, 0, 0, 0];
/// let sender = IcrcInputs::ipv4(lo, lo, 0xc000, 4791).with_ipv4_id(0x1234, 0x4000);
/// sender.fill(&mut dgram).unwrap();
/// let solver = Ipv4IdSolver::new(dgram.len());
/// let (id, df) = solver.solve(&IcrcInputs::ipv4(lo, lo, 0xc000, 4791), &dgram).unwrap();
/// assert_eq!((id, df), (0x1234, true));
/// ```
#[derive(Debug, Clone)]
pub struct Ipv4IdSolver {
    datagram_len: usize,
    /// XOR basis indexed by pivot bit: (vector, combination of unknown bits).
    basis: [(u32, u32); 32],
    /// The CRC term of the DF bit alone (the ICRC with DF set is the one with DF clear XOR
    /// this).
    df_term: u32,
    /// The CRC term of each identification bit alone (bit `i` of the ID): the ICRC with ID
    /// `k` is the one with ID 0 XOR the terms of `k`'s set bits.
    id_terms: [u32; 16],
}

impl Ipv4IdSolver {
    /// Prepares the linear map for UDP payloads (BTH through ICRC) of `datagram_len` bytes.
    pub fn new(datagram_len: usize) -> Ipv4IdSolver {
        let body_len = datagram_len.saturating_sub(ICRC_LEN);
        // The covered message: LRH stand-in, IPv4, UDP, body. Bit positions of the unknowns:
        // ID = IPv4 bytes 4-5, DF = bit 6 of IPv4 byte 6.
        let total = LRH_STANDIN.len() + IPV4_HDR_LEN + UDP_HDR_LEN + body_len;
        let zero = crc_of_sparse(total, None);
        let mut basis = [(0u32, 0u32); 32];
        let mut df_term = 0;
        let mut id_terms = [0u32; 16];
        for unknown in 0..17u32 {
            let (byte, bit) = if unknown < 16 {
                (
                    LRH_STANDIN.len() + 4 + (1 - (unknown as usize) / 8),
                    unknown % 8,
                )
            } else {
                (LRH_STANDIN.len() + 6, 6)
            };
            let mut v = crc_of_sparse(total, Some((byte, 1u8 << bit))) ^ zero;
            if unknown == 16 {
                df_term = v;
            } else {
                id_terms[unknown as usize] = v;
            }
            let mut c = 1u32 << unknown;
            for p in (0..32).rev() {
                if v & (1 << p) == 0 {
                    continue;
                }
                if basis[p].0 == 0 {
                    basis[p] = (v, c);
                    break;
                }
                v ^= basis[p].0;
                c ^= basis[p].1;
            }
        }
        Ipv4IdSolver {
            datagram_len,
            basis,
            df_term,
            id_terms,
        }
    }

    /// What identification `id` adds to the ICRC of a datagram of this length, against ID 0
    /// (flags unchanged): the ICRC computed with ID 0, XOR this, is the ICRC with ID `id`. One
    /// CRC over the packet then serves any single expected ID.
    ///
    /// ```
    /// use mrkit_soft::wire::{IcrcInputs, Ipv4IdSolver};
    /// use std::net::Ipv4Addr;
    /// let lo = Ipv4Addr::LOCALHOST;
    /// let body = [0x11, 0, 0xff, 0xff, 0, 0, 0, 0x12, 0, 0, 0, 5, 0x1f, 0, 0, 1];
    /// let base = IcrcInputs::ipv4(lo, lo, 0xc000, 4791);
    /// let solver = Ipv4IdSolver::new(body.len() + 4);
    /// for id in [1u16, 7, 63, 0xBEEF] {
    ///     let want = base.with_ipv4_id(id, 0x4000).compute(&body);
    ///     assert_eq!(base.compute(&body) ^ solver.id_term(id), want);
    /// }
    /// ```
    pub fn id_term(&self, id: u16) -> u32 {
        let mut t = 0;
        let mut rest = id;
        while rest != 0 {
            t ^= self.id_terms[rest.trailing_zeros() as usize];
            rest &= rest - 1;
        }
        t
    }

    /// The datagram length this solver was built for.
    pub fn datagram_len(&self) -> usize {
        self.datagram_len
    }

    /// Finds the `(identification, df)` that make the ICRC of `datagram` (BTH through ICRC) correct
    /// with the addresses and ports of `inputs` (its ID/flags are ignored).
    ///
    /// Errors: [`WireError::BadIcrc`] if no ID/DF fits (values computed with ID 0, DF clear),
    /// [`WireError::BadIpHeader`] for IPv6 inputs or a datagram of another length.
    pub fn solve(&self, inputs: &IcrcInputs, datagram: &[u8]) -> Result<(u16, bool), WireError> {
        if !inputs.is_ipv4() {
            return Err(WireError::BadIpHeader("ID solver needs IPv4 inputs"));
        }
        if datagram.len() != self.datagram_len {
            return Err(WireError::BadIpHeader(
                "datagram length differs from the solver's",
            ));
        }
        let (body, found) = split_icrc(datagram)?;
        let expected = inputs.with_ipv4_id(0, 0).compute(body);
        self.solve_values(expected, found)
            .ok_or(WireError::BadIcrc { expected, found })
    }

    /// [`solve`](Self::solve) from the two CRC values alone: `expected` is the ICRC computed
    /// with ID 0 and DF clear (`inputs.with_ipv4_id(0, 0).compute(body)`), `found` the one
    /// carried. Lets a receiver compute the CRC over the packet once and both check the common
    /// case and solve for the ID.
    pub fn solve_values(&self, expected: u32, found: u32) -> Option<(u16, bool)> {
        self.solve_diff(expected ^ found)
    }

    /// [`solve_values`](Self::solve_values) from the ICRC computed with ID 0 and **DF set**
    /// (what [`IcrcInputs::ipv4`] describes): a receiver computes that one value, accepts our
    /// own senders' packets when it matches, and solves only otherwise.
    ///
    /// ```
    /// use mrkit_soft::wire::{IcrcInputs, Ipv4IdSolver};
    /// use std::net::Ipv4Addr;
    /// let lo = Ipv4Addr::LOCALHOST;
    /// let mut dgram = vec![0x11, 0, 0xff, 0xff, 0, 0, 0, 0x12, 0, 0, 0, 5, 0x1f, 0, 0, 1, 0, 0, 0, 0];
    /// IcrcInputs::ipv4(lo, lo, 0xc000, 4791).with_ipv4_id(7, 0).fill(&mut dgram).unwrap();
    /// let body = &dgram[..dgram.len() - 4];
    /// let found = u32::from_le_bytes(dgram[dgram.len() - 4..].try_into().unwrap());
    /// let with_df = IcrcInputs::ipv4(lo, lo, 0xc000, 4791).compute(body);
    /// let solver = Ipv4IdSolver::new(dgram.len());
    /// assert_eq!(solver.solve_values_df(with_df, found), Some((7, false)));
    /// ```
    pub fn solve_values_df(&self, expected_with_df: u32, found: u32) -> Option<(u16, bool)> {
        self.solve_diff(expected_with_df ^ self.df_term ^ found)
    }

    fn solve_diff(&self, diff: u32) -> Option<(u16, bool)> {
        let mut d = diff;
        let mut c = 0u32;
        for p in (0..32).rev() {
            if d & (1 << p) != 0 && self.basis[p].0 != 0 {
                d ^= self.basis[p].0;
                c ^= self.basis[p].1;
            }
        }
        if d != 0 {
            return None;
        }
        Some(((c & 0xFFFF) as u16, c & (1 << 16) != 0))
    }
}

/// CRC-32 of `len` zero bytes, optionally with one byte set to `val`.
fn crc_of_sparse(len: usize, set: Option<(usize, u8)>) -> u32 {
    fn zeros(h: &mut crc32fast::Hasher, mut n: usize) {
        const Z: [u8; 256] = [0; 256];
        while n > 0 {
            let k = n.min(Z.len());
            h.update(&Z[..k]);
            n -= k;
        }
    }
    let mut h = crc32fast::Hasher::new();
    match set {
        Some((pos, val)) if pos < len => {
            zeros(&mut h, pos);
            h.update(&[val]);
            zeros(&mut h, len - pos - 1);
        }
        _ => zeros(&mut h, len),
    }
    h.finalize()
}

/// How the receiver checks the ICRC of an IPv4 packet. A UDP socket does not show the IP
/// header, but the ICRC covers its identification and DF bit.
///
/// IPv6 packets are always checked exactly (the ICRC covers nothing a socket cannot see).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Ipv4IcrcMode {
    /// One expected value per packet (default): identification `k` with DF, where `k` is the
    /// packet's index within the receive offload batch it arrived in (0 for a datagram that
    /// arrived alone). That is exactly what an mrkit sender puts on the wire: a lone datagram
    /// leaves with ID 0 and DF, segment `k` of a GSO send with ID `k`, and on loopback and
    /// veth a GSO send reaches a receive-offload socket as one batch. As a plain CRC-32
    /// check against one value, it rejects every error of up to 3 bits and every burst of up
    /// to 32 bits in datagrams of up to 11 KiB (mrkit's are at most 4.2 KiB), and any other
    /// corruption except with probability 2^-32.
    #[default]
    Exact,
    /// Accept the packet if **any** identification and DF value makes the ICRC match (a
    /// linear solve over the 17 unknown bits): for peers whose IDs cannot be predicted (a
    /// foreign RoCE stack, or a path whose receive offload re-batches datagrams, such as a
    /// NIC's GRO). Weaker: a random corruption passes with probability about 2^-15, and no
    /// error pattern is guaranteed to be caught (for every bit position, some single-bit
    /// flips pass for packets of some lengths, and bursts of up to 32 bits can pass).
    Solve,
}

impl Ipv4IcrcMode {
    /// Parse `exact` or `solve`.
    pub fn parse(s: &str) -> Option<Ipv4IcrcMode> {
        match s.trim() {
            "exact" => Some(Ipv4IcrcMode::Exact),
            "solve" => Some(Ipv4IcrcMode::Solve),
            _ => None,
        }
    }

    /// The name [`parse`](Self::parse) reads.
    pub fn name(self) -> &'static str {
        match self {
            Ipv4IcrcMode::Exact => "exact",
            Ipv4IcrcMode::Solve => "solve",
        }
    }
}
