//! The RC opcode table (docs/roce.md §1.5).

use super::error::WireError;
use super::{
    AETH_LEN, ATOMIC_ACK_ETH_LEN, ATOMIC_ETH_LEN, BTH_LEN, CNP_PAD_LEN, IETH_LEN, IMMDT_LEN,
    RETH_LEN,
};

bitflags::bitflags! {
    /// Which extension headers follow the BTH. They always appear in the order
    /// RETH, AETH, AtomicETH, AtomicAckETH, ImmDt, IETH, CNP padding (at most two at once).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct HeaderSet: u8 {
        /// RDMA extended transport header (16 bytes).
        const RETH = 1 << 0;
        /// ACK extended transport header (4 bytes).
        const AETH = 1 << 1;
        /// Atomic extended transport header (28 bytes).
        const ATOMIC_ETH = 1 << 2;
        /// Atomic ACK extended transport header (8 bytes).
        const ATOMIC_ACK_ETH = 1 << 3;
        /// Immediate data (4 bytes).
        const IMMDT = 1 << 4;
        /// Invalidate extended transport header (4 bytes).
        const IETH = 1 << 5;
        /// The 16 reserved bytes of a CNP.
        const CNP_PAD = 1 << 6;
    }
}

bitflags::bitflags! {
    /// Properties of an opcode.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct OpFlags: u32 {
        /// Sent by the requester.
        const REQUEST = 1 << 0;
        /// Sent by the responder (read responses, ACKs).
        const RESPONSE = 1 << 1;
        /// First packet of a multi-packet message.
        const FIRST = 1 << 2;
        /// Middle packet of a multi-packet message.
        const MIDDLE = 1 << 3;
        /// Last packet of a multi-packet message.
        const LAST = 1 << 4;
        /// The only packet of a message.
        const ONLY = 1 << 5;
        /// May carry payload.
        const PAYLOAD = 1 << 6;
        /// SEND family.
        const SEND = 1 << 7;
        /// RDMA WRITE family.
        const WRITE = 1 << 8;
        /// RDMA READ request or response.
        const READ = 1 << 9;
        /// Atomic request or atomic ACK.
        const ATOMIC = 1 << 10;
        /// ACKNOWLEDGE or ATOMIC_ACKNOWLEDGE.
        const ACK = 1 << 11;
        /// Carries immediate data.
        const IMMEDIATE = 1 << 12;
        /// Carries an R_Key to invalidate.
        const INVALIDATE = 1 << 13;
        /// The responder consumes a receive WQE here (or RNR NAKs).
        const NEEDS_RECV_WQE = 1 << 14;
        /// Congestion notification packet (not RC proper; accepted and ignored).
        const CNP = 1 << 15;
    }
}

/// Every opcode mrkit understands: the RC opcodes of docs/roce.md §1.5 plus the CNP (0x81).
///
/// ```
/// use mrkit_soft::wire::Opcode;
/// let op = Opcode::from_u8(0x0a).unwrap();
/// assert_eq!(op, Opcode::RdmaWriteOnly);
/// assert_eq!(op.info().header_len, 28);
/// assert!(Opcode::from_u8(0x24).is_err()); // UC SEND ONLY
/// ```
#[allow(missing_docs)] // variant names are the IBA names
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Opcode {
    SendFirst = 0x00,
    SendMiddle = 0x01,
    SendLast = 0x02,
    SendLastWithImmediate = 0x03,
    SendOnly = 0x04,
    SendOnlyWithImmediate = 0x05,
    RdmaWriteFirst = 0x06,
    RdmaWriteMiddle = 0x07,
    RdmaWriteLast = 0x08,
    RdmaWriteLastWithImmediate = 0x09,
    RdmaWriteOnly = 0x0A,
    RdmaWriteOnlyWithImmediate = 0x0B,
    RdmaReadRequest = 0x0C,
    RdmaReadResponseFirst = 0x0D,
    RdmaReadResponseMiddle = 0x0E,
    RdmaReadResponseLast = 0x0F,
    RdmaReadResponseOnly = 0x10,
    Acknowledge = 0x11,
    AtomicAcknowledge = 0x12,
    CompareSwap = 0x13,
    FetchAdd = 0x14,
    SendLastWithInvalidate = 0x16,
    SendOnlyWithInvalidate = 0x17,
    Cnp = 0x81,
}

/// Static description of one opcode (one row of [`OPCODE_TABLE`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpcodeInfo {
    /// The opcode this row describes.
    pub opcode: Opcode,
    /// The IBA name, e.g. `"RDMA_WRITE_ONLY"`.
    pub name: &'static str,
    /// The extension headers, in wire order.
    pub headers: HeaderSet,
    /// Properties.
    pub flags: OpFlags,
    /// BTH plus extension headers, in bytes (offset of the payload).
    pub header_len: usize,
}

impl OpcodeInfo {
    /// True if packets of this opcode may carry payload bytes.
    pub const fn has_payload(&self) -> bool {
        self.flags.contains(OpFlags::PAYLOAD)
    }
    /// True for requester-to-responder opcodes.
    pub const fn is_request(&self) -> bool {
        self.flags.contains(OpFlags::REQUEST)
    }
    /// True for responder-to-requester opcodes.
    pub const fn is_response(&self) -> bool {
        self.flags.contains(OpFlags::RESPONSE)
    }
    /// True if this packet ends a message (LAST or ONLY; also ACKs, atomics, READ requests).
    pub const fn ends_message(&self) -> bool {
        self.flags.intersects(OpFlags::LAST.union(OpFlags::ONLY))
    }
}

/// Length in bytes of the extension headers in `h`.
pub const fn ext_len(h: HeaderSet) -> usize {
    let mut n = 0;
    if h.contains(HeaderSet::RETH) {
        n += RETH_LEN;
    }
    if h.contains(HeaderSet::AETH) {
        n += AETH_LEN;
    }
    if h.contains(HeaderSet::ATOMIC_ETH) {
        n += ATOMIC_ETH_LEN;
    }
    if h.contains(HeaderSet::ATOMIC_ACK_ETH) {
        n += ATOMIC_ACK_ETH_LEN;
    }
    if h.contains(HeaderSet::IMMDT) {
        n += IMMDT_LEN;
    }
    if h.contains(HeaderSet::IETH) {
        n += IETH_LEN;
    }
    if h.contains(HeaderSet::CNP_PAD) {
        n += CNP_PAD_LEN;
    }
    n
}

const fn row(
    opcode: Opcode,
    name: &'static str,
    headers: HeaderSet,
    flags: OpFlags,
) -> Option<OpcodeInfo> {
    Some(OpcodeInfo {
        opcode,
        name,
        headers,
        flags,
        header_len: BTH_LEN + ext_len(headers),
    })
}

const fn build_table() -> [Option<OpcodeInfo>; 256] {
    use HeaderSet as H;
    use OpFlags as F;
    const NONE: H = H::empty();
    const REQ_SEND: F = F::REQUEST.union(F::SEND).union(F::PAYLOAD);
    const REQ_WRITE: F = F::REQUEST.union(F::WRITE).union(F::PAYLOAD);
    const RESP_READ: F = F::RESPONSE.union(F::READ).union(F::PAYLOAD);
    let mut t: [Option<OpcodeInfo>; 256] = [None; 256];
    t[0x00] = row(
        Opcode::SendFirst,
        "SEND_FIRST",
        NONE,
        REQ_SEND.union(F::FIRST).union(F::NEEDS_RECV_WQE),
    );
    t[0x01] = row(
        Opcode::SendMiddle,
        "SEND_MIDDLE",
        NONE,
        REQ_SEND.union(F::MIDDLE),
    );
    t[0x02] = row(Opcode::SendLast, "SEND_LAST", NONE, REQ_SEND.union(F::LAST));
    t[0x03] = row(
        Opcode::SendLastWithImmediate,
        "SEND_LAST_WITH_IMMEDIATE",
        H::IMMDT,
        REQ_SEND.union(F::LAST).union(F::IMMEDIATE),
    );
    t[0x04] = row(
        Opcode::SendOnly,
        "SEND_ONLY",
        NONE,
        REQ_SEND.union(F::ONLY).union(F::NEEDS_RECV_WQE),
    );
    t[0x05] = row(
        Opcode::SendOnlyWithImmediate,
        "SEND_ONLY_WITH_IMMEDIATE",
        H::IMMDT,
        REQ_SEND
            .union(F::ONLY)
            .union(F::IMMEDIATE)
            .union(F::NEEDS_RECV_WQE),
    );
    t[0x06] = row(
        Opcode::RdmaWriteFirst,
        "RDMA_WRITE_FIRST",
        H::RETH,
        REQ_WRITE.union(F::FIRST),
    );
    t[0x07] = row(
        Opcode::RdmaWriteMiddle,
        "RDMA_WRITE_MIDDLE",
        NONE,
        REQ_WRITE.union(F::MIDDLE),
    );
    t[0x08] = row(
        Opcode::RdmaWriteLast,
        "RDMA_WRITE_LAST",
        NONE,
        REQ_WRITE.union(F::LAST),
    );
    t[0x09] = row(
        Opcode::RdmaWriteLastWithImmediate,
        "RDMA_WRITE_LAST_WITH_IMMEDIATE",
        H::IMMDT,
        REQ_WRITE
            .union(F::LAST)
            .union(F::IMMEDIATE)
            .union(F::NEEDS_RECV_WQE),
    );
    t[0x0A] = row(
        Opcode::RdmaWriteOnly,
        "RDMA_WRITE_ONLY",
        H::RETH,
        REQ_WRITE.union(F::ONLY),
    );
    t[0x0B] = row(
        Opcode::RdmaWriteOnlyWithImmediate,
        "RDMA_WRITE_ONLY_WITH_IMMEDIATE",
        H::RETH.union(H::IMMDT),
        REQ_WRITE
            .union(F::ONLY)
            .union(F::IMMEDIATE)
            .union(F::NEEDS_RECV_WQE),
    );
    t[0x0C] = row(
        Opcode::RdmaReadRequest,
        "RDMA_READ_REQUEST",
        H::RETH,
        F::REQUEST.union(F::READ).union(F::ONLY),
    );
    t[0x0D] = row(
        Opcode::RdmaReadResponseFirst,
        "RDMA_READ_RESPONSE_FIRST",
        H::AETH,
        RESP_READ.union(F::FIRST),
    );
    t[0x0E] = row(
        Opcode::RdmaReadResponseMiddle,
        "RDMA_READ_RESPONSE_MIDDLE",
        NONE,
        RESP_READ.union(F::MIDDLE),
    );
    t[0x0F] = row(
        Opcode::RdmaReadResponseLast,
        "RDMA_READ_RESPONSE_LAST",
        H::AETH,
        RESP_READ.union(F::LAST),
    );
    t[0x10] = row(
        Opcode::RdmaReadResponseOnly,
        "RDMA_READ_RESPONSE_ONLY",
        H::AETH,
        RESP_READ.union(F::ONLY),
    );
    t[0x11] = row(
        Opcode::Acknowledge,
        "ACKNOWLEDGE",
        H::AETH,
        F::RESPONSE.union(F::ACK).union(F::ONLY),
    );
    t[0x12] = row(
        Opcode::AtomicAcknowledge,
        "ATOMIC_ACKNOWLEDGE",
        H::AETH.union(H::ATOMIC_ACK_ETH),
        F::RESPONSE.union(F::ACK).union(F::ATOMIC).union(F::ONLY),
    );
    t[0x13] = row(
        Opcode::CompareSwap,
        "COMPARE_SWAP",
        H::ATOMIC_ETH,
        F::REQUEST.union(F::ATOMIC).union(F::ONLY),
    );
    t[0x14] = row(
        Opcode::FetchAdd,
        "FETCH_ADD",
        H::ATOMIC_ETH,
        F::REQUEST.union(F::ATOMIC).union(F::ONLY),
    );
    t[0x16] = row(
        Opcode::SendLastWithInvalidate,
        "SEND_LAST_WITH_INVALIDATE",
        H::IETH,
        REQ_SEND.union(F::LAST).union(F::INVALIDATE),
    );
    t[0x17] = row(
        Opcode::SendOnlyWithInvalidate,
        "SEND_ONLY_WITH_INVALIDATE",
        H::IETH,
        REQ_SEND
            .union(F::ONLY)
            .union(F::INVALIDATE)
            .union(F::NEEDS_RECV_WQE),
    );
    t[0x81] = row(Opcode::Cnp, "CNP", H::CNP_PAD, F::CNP);
    t
}

/// The opcode table, indexed by the BTH opcode byte. `None` for opcodes mrkit does not handle.
///
/// ```
/// use mrkit_soft::wire::{OPCODE_TABLE, HeaderSet};
/// let row = OPCODE_TABLE[0x12].unwrap();
/// assert_eq!(row.name, "ATOMIC_ACKNOWLEDGE");
/// assert_eq!(row.headers, HeaderSet::AETH | HeaderSet::ATOMIC_ACK_ETH);
/// assert_eq!(row.header_len, 24);
/// ```
pub static OPCODE_TABLE: [Option<OpcodeInfo>; 256] = build_table();

impl Opcode {
    /// Every opcode, in numeric order.
    pub const ALL: [Opcode; 24] = [
        Opcode::SendFirst,
        Opcode::SendMiddle,
        Opcode::SendLast,
        Opcode::SendLastWithImmediate,
        Opcode::SendOnly,
        Opcode::SendOnlyWithImmediate,
        Opcode::RdmaWriteFirst,
        Opcode::RdmaWriteMiddle,
        Opcode::RdmaWriteLast,
        Opcode::RdmaWriteLastWithImmediate,
        Opcode::RdmaWriteOnly,
        Opcode::RdmaWriteOnlyWithImmediate,
        Opcode::RdmaReadRequest,
        Opcode::RdmaReadResponseFirst,
        Opcode::RdmaReadResponseMiddle,
        Opcode::RdmaReadResponseLast,
        Opcode::RdmaReadResponseOnly,
        Opcode::Acknowledge,
        Opcode::AtomicAcknowledge,
        Opcode::CompareSwap,
        Opcode::FetchAdd,
        Opcode::SendLastWithInvalidate,
        Opcode::SendOnlyWithInvalidate,
        Opcode::Cnp,
    ];

    /// Decodes a BTH opcode byte.
    ///
    /// Errors: [`WireError::UnsupportedOpcode`] for opcodes IBA defines for UC/RD/UD or for the RC
    /// extensions FLUSH (0x1C) and ATOMIC_WRITE (0x1D); [`WireError::UnknownOpcode`] for reserved values.
    pub const fn from_u8(b: u8) -> Result<Opcode, WireError> {
        match OPCODE_TABLE[b as usize] {
            Some(info) => Ok(info.opcode),
            None => Err(if is_iba_defined(b) {
                WireError::UnsupportedOpcode(b)
            } else {
                WireError::UnknownOpcode(b)
            }),
        }
    }

    /// The opcode byte.
    pub const fn as_u8(self) -> u8 {
        self as u8
    }

    /// The table row of this opcode.
    pub const fn info(self) -> &'static OpcodeInfo {
        match &OPCODE_TABLE[self as usize] {
            Some(i) => i,
            // Every variant has a row (checked by a unit test); this arm is unreachable.
            None => &FALLBACK,
        }
    }

    /// The IBA name, e.g. `"SEND_ONLY"`.
    pub const fn name(self) -> &'static str {
        self.info().name
    }

    /// The extension headers this opcode carries.
    pub const fn headers(self) -> HeaderSet {
        self.info().headers
    }

    /// The properties of this opcode.
    pub const fn flags(self) -> OpFlags {
        self.info().flags
    }

    /// BTH + extension header length.
    pub const fn header_len(self) -> usize {
        self.info().header_len
    }
}

const FALLBACK: OpcodeInfo = OpcodeInfo {
    opcode: Opcode::Cnp,
    name: "CNP",
    headers: HeaderSet::CNP_PAD,
    flags: OpFlags::CNP,
    header_len: BTH_LEN + CNP_PAD_LEN,
};

impl TryFrom<u8> for Opcode {
    type Error = WireError;
    fn try_from(b: u8) -> Result<Self, WireError> {
        Opcode::from_u8(b)
    }
}

impl From<Opcode> for u8 {
    fn from(o: Opcode) -> u8 {
        o as u8
    }
}

impl core::fmt::Display for Opcode {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.name())
    }
}

/// True if IBA (or the rxe extensions) assigns a meaning to this opcode byte in some transport.
const fn is_iba_defined(b: u8) -> bool {
    let low = b & 0x1F;
    match b >> 5 {
        // RC: 0x00-0x14, 0x16-0x17 (0x15 reserved), FLUSH 0x1C, ATOMIC_WRITE 0x1D
        0 => low <= 0x14 || low == 0x16 || low == 0x17 || low == 0x1C || low == 0x1D,
        // UC: SEND 0-5, WRITE 6-0x0B
        1 => low <= 0x0B,
        // RD: 0x00-0x15
        2 => low <= 0x15,
        // UD: SEND_ONLY 4, SEND_ONLY_WITH_IMMEDIATE 5
        3 => low == 0x04 || low == 0x05,
        // CNP (0x81) is in the table; the 0xC0-0xFF manufacturer range is not ours
        _ => false,
    }
}
