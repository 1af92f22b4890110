//! The error type of the wire module.

use super::opcode::Opcode;

/// Everything that can go wrong while parsing, checking or emitting RoCEv2 packets.
///
/// No function of the wire module panics on any input; they return one of these instead.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The input ends before a header (or the ICRC) that the format requires.
    #[error("truncated packet: need {needed} bytes, have {available}")]
    Truncated {
        /// Bytes the format needs at this point.
        needed: usize,
        /// Bytes actually available.
        available: usize,
    },
    /// The output buffer is too small for the packet being emitted.
    #[error("output buffer too small: need {needed} bytes, have {available}")]
    BufferTooSmall {
        /// Bytes the packet needs.
        needed: usize,
        /// Bytes the buffer has.
        available: usize,
    },
    /// A packet's payload lies in registered memory that could not be read (unmapped while
    /// registered, with no pinned frame left behind it).
    #[error("payload memory unreachable (unmapped registered memory)")]
    PayloadUnreachable,
    /// BTH TVer is not 0.
    #[error("unsupported BTH transport version {0}")]
    BadVersion(u8),
    /// The opcode is reserved (no transport defines it).
    #[error("unknown opcode {0:#04x}")]
    UnknownOpcode(u8),
    /// The opcode exists in IBA but belongs to a transport or extension we do not carry
    /// (UC, RD, UD, RC FLUSH/ATOMIC_WRITE, ...).
    #[error("unsupported opcode {0:#04x} (not an RC opcode handled by mrkit)")]
    UnsupportedOpcode(u8),
    /// The datagram length is not a multiple of 4 (headers, payload+pad and ICRC all are).
    #[error("datagram length {0} is not a multiple of 4")]
    Misaligned(usize),
    /// BTH PadCnt is larger than the data area, or non-zero where no payload is allowed.
    #[error("bad pad count {pad} for a data area of {data_len} bytes")]
    BadPad {
        /// The PadCnt field.
        pad: u8,
        /// Bytes between the last header and the ICRC (payload + pad).
        data_len: usize,
    },
    /// The opcode carries no payload but the packet has one.
    #[error("opcode {opcode:?} carries no payload but {len} bytes are present")]
    PayloadNotAllowed {
        /// The packet's opcode.
        opcode: Opcode,
        /// The payload length found.
        len: usize,
    },
    /// The payload length breaks the per-opcode MTU rules (docs/roce.md §1.5).
    #[error("payload of {len} bytes is invalid for {opcode:?} at MTU {mtu}")]
    PayloadLength {
        /// The packet's opcode.
        opcode: Opcode,
        /// The payload length (pad excluded).
        len: usize,
        /// The path MTU in bytes.
        mtu: usize,
    },
    /// The extension headers given to the builder do not match the opcode's header set.
    #[error("extension headers do not match opcode {0:?}")]
    HeaderMismatch(Opcode),
    /// The ICRC carried by the packet differs from the one computed.
    #[error("bad ICRC: computed {expected:#010x}, packet carries {found:#010x}")]
    BadIcrc {
        /// The ICRC value computed over the packet.
        expected: u32,
        /// The ICRC value found in the packet (read little-endian).
        found: u32,
    },
    /// An IP/UDP header handed to a checker is not one RoCEv2 allows.
    #[error("bad IP/UDP header: {0}")]
    BadIpHeader(&'static str),
    /// A path MTU value that is not one of 256, 512, 1024, 2048, 4096 (or enum 1..=5).
    #[error("invalid MTU {0}")]
    InvalidMtu(u32),
}
