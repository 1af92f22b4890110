//! RoCEv2 wire format: headers, opcode table, ICRC (sans-IO, no allocation in the parse path).
//!
//! Everything here follows the project's RoCEv2 research note `docs/roce.md` (section numbers refer to it):
//!
//! * [`Opcode`] / [`OPCODE_TABLE`]: the RC opcodes (§1.5) plus CNP, with their headers and flags.
//! * Headers: [`Bth`] (§1.2), [`Reth`], [`Aeth`] (+ [`Syndrome`], [`NakCode`], §1.4),
//!   [`AtomicEth`], [`AtomicAckEth`], [`ImmDt`], [`Ieth`] (§1.3). Each has
//!   `parse(&[u8]) -> Result<(Self, &[u8]), WireError>`, `to_bytes()` and `write(&mut [u8])`.
//! * Packets: [`Packet::parse`] gives a borrowed [`PacketView`]; [`PacketBuilder`], [`build`],
//!   or the zero-copy pair [`emit_headers`] + [`finish`] build one.
//! * ICRC (§2): [`IcrcInputs`] (what a UDP socket knows besides the payload),
//!   [`icrc_for_udp_payload`], [`check_icrc_ip_packet`] for captures, [`Ipv4IdSolver`] for
//!   foreign IPv4 peers whose IP ID is unknown.
//! * [`psn_add`], [`psn_diff`], [`psn_cmp`] (§3.1); [`rnr_timer_to_duration`] (§3.7);
//!   [`local_ack_timeout`]; [`udp_sport_for_qpn`] (§4.2); [`Mtu`] (§4.3).
//! * [`fuzz_parse`]: the fuzz target body (driven by `fuzz/` with cargo-fuzz and by a proptest).
//!
//! A datagram here is always the **UDP payload**: BTH, extension headers, payload, pad, ICRC.
//!
//! ```
//! use mrkit_soft::wire::{Aeth, IcrcInputs, Opcode, Packet, PacketBuilder, Syndrome};
//! use std::net::Ipv4Addr;
//! let (a, b) = (Ipv4Addr::new(127, 0, 0, 2), Ipv4Addr::new(127, 0, 0, 3));
//! let tx = IcrcInputs::ipv4(a, b, 0xc000, 4791);
//! let ack = PacketBuilder::new(Opcode::Acknowledge, 0x12, 41).aeth(Aeth::ack(7)).to_vec(&[], &tx).unwrap();
//! // The receiver sees source a:0xc000 and destination b:4791.
//! let pkt = Packet::parse_verified(&ack, &IcrcInputs::ipv4(a, b, 0xc000, 4791)).unwrap();
//! assert_eq!(pkt.ext.aeth.unwrap().kind(), Syndrome::Ack { credit: 31 });
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod bth;
mod error;
mod ext;
mod fuzz;
mod icrc;
mod opcode;
mod packet;
mod params;
mod psn;
#[cfg(test)]
mod tests;

pub use bth::Bth;
pub use error::WireError;
pub use ext::{
    ack_credit_count, Aeth, AtomicAckEth, AtomicEth, Ieth, ImmDt, NakCode, Reth, Syndrome,
    ACK_NO_CREDIT_INFO,
};
pub use fuzz::fuzz_parse;
pub use icrc::{
    check_icrc_ip_packet, check_icrc_ipv4_packet, check_icrc_ipv6_packet, fill_icrc_ip_packet,
    icrc_for_udp_payload, split_ip_packet, IcrcInputs, IpInfo, Ipv4IcrcMode, Ipv4IdSolver,
    IPV4_FLAGS_DF,
};
pub use opcode::{ext_len, HeaderSet, OpFlags, Opcode, OpcodeInfo, OPCODE_TABLE};
pub use packet::{
    build, check_payload_len, emit_headers, finish, pad_for, wire_len, ExtHeaders, Layout, Packet,
    PacketBuilder, PacketView,
};
pub use params::{
    duration_to_rnr_timer, flow_label_from_qpns, local_ack_timeout, rnr_timer_to_duration,
    udp_sport_for_qpn, udp_sport_from_flow_label, Mtu, RNR_TIMER_US, RXE_MAX_HDR_LENGTH,
};
pub use psn::{psn_add, psn_cmp, psn_diff, psn_sub};

/// RoCEv2 UDP destination port.
pub const ROCE_V2_UDP_PORT: u16 = 4791;
/// Base Transport Header length.
pub const BTH_LEN: usize = 12;
/// RETH length.
pub const RETH_LEN: usize = 16;
/// AETH length.
pub const AETH_LEN: usize = 4;
/// AtomicETH length.
pub const ATOMIC_ETH_LEN: usize = 28;
/// AtomicAckETH length.
pub const ATOMIC_ACK_ETH_LEN: usize = 8;
/// ImmDt length.
pub const IMMDT_LEN: usize = 4;
/// IETH length.
pub const IETH_LEN: usize = 4;
/// Reserved bytes after the BTH of a CNP.
pub const CNP_PAD_LEN: usize = 16;
/// ICRC length.
pub const ICRC_LEN: usize = 4;
/// Default P_Key (full member).
pub const DEFAULT_PKEY: u16 = 0xFFFF;
/// PSN width mask (24 bits).
pub const PSN_MASK: u32 = 0x00FF_FFFF;
/// QPN width mask (24 bits).
pub const QPN_MASK: u32 = 0x00FF_FFFF;
/// MSN width mask (24 bits).
pub const MSN_MASK: u32 = 0x00FF_FFFF;
/// Largest UDP payload mrkit emits: BTH + RETH + ImmDt + 4096 payload + ICRC.
pub const MAX_DATAGRAM_LEN: usize = BTH_LEN + RETH_LEN + IMMDT_LEN + 4096 + ICRC_LEN;
