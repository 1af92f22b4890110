//! Extension transport headers (docs/roce.md §1.3, §1.4).

use super::bth::write_bytes;
use super::error::WireError;
use super::{
    AETH_LEN, ATOMIC_ACK_ETH_LEN, ATOMIC_ETH_LEN, IETH_LEN, IMMDT_LEN, MSN_MASK, RETH_LEN,
};

fn take<const N: usize>(buf: &[u8]) -> Result<(&[u8; N], &[u8]), WireError> {
    buf.split_first_chunk::<N>().ok_or(WireError::Truncated {
        needed: N,
        available: buf.len(),
    })
}

fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

fn be32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_be_bytes(a)
}

/// RDMA Extended Transport Header (16 bytes): on WRITE FIRST/ONLY and READ REQUEST.
///
/// ```
/// use mrkit_soft::wire::Reth;
/// let r = Reth { va: 0x7f00_1234_5000, rkey: 0x1234, dma_len: 11 };
/// let (back, _) = Reth::parse(&r.to_bytes()).unwrap();
/// assert_eq!(back, r);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Reth {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// DMA length: the whole message (or the remaining part on a retried READ).
    pub dma_len: u32,
}

impl Reth {
    /// Parses the header from the front of `buf`, returning it and the rest.
    pub fn parse(buf: &[u8]) -> Result<(Reth, &[u8]), WireError> {
        let (h, rest) = take::<RETH_LEN>(buf)?;
        Ok((
            Reth {
                va: be64(&h[0..]),
                rkey: be32(&h[8..]),
                dma_len: be32(&h[12..]),
            },
            rest,
        ))
    }
    /// The wire bytes.
    pub fn to_bytes(&self) -> [u8; RETH_LEN] {
        let mut b = [0u8; RETH_LEN];
        b[0..8].copy_from_slice(&self.va.to_be_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_be_bytes());
        b[12..16].copy_from_slice(&self.dma_len.to_be_bytes());
        b
    }
    /// Writes the header to the front of `buf`; returns its length.
    pub fn write(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        write_bytes(buf, &self.to_bytes())
    }
}

/// NAK codes (AETH syndrome `0x60 | code`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NakCode {
    /// 0: PSN sequence error; the NAK's PSN is the PSN the responder expects.
    PsnSequenceError,
    /// 1: invalid request.
    InvalidRequest,
    /// 2: remote access error.
    RemoteAccessError,
    /// 3: remote operational error.
    RemoteOperationalError,
    /// 4: invalid RD request (RD only; treat as a remote operational error).
    InvalidRdRequest,
    /// 5..=31: reserved codes (the requester treats them as remote operational errors).
    Reserved(u8),
}

impl NakCode {
    /// The 5-bit code.
    pub const fn code(self) -> u8 {
        match self {
            NakCode::PsnSequenceError => 0,
            NakCode::InvalidRequest => 1,
            NakCode::RemoteAccessError => 2,
            NakCode::RemoteOperationalError => 3,
            NakCode::InvalidRdRequest => 4,
            NakCode::Reserved(c) => c & 0x1F,
        }
    }
    /// Decodes a 5-bit code (upper bits ignored).
    pub const fn from_code(c: u8) -> NakCode {
        match c & 0x1F {
            0 => NakCode::PsnSequenceError,
            1 => NakCode::InvalidRequest,
            2 => NakCode::RemoteAccessError,
            3 => NakCode::RemoteOperationalError,
            4 => NakCode::InvalidRdRequest,
            c => NakCode::Reserved(c),
        }
    }
}

/// Decoded AETH syndrome (docs/roce.md §1.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Syndrome {
    /// ACK with a 5-bit credit code (31 = no credit information).
    Ack {
        /// Credit code, see [`ack_credit_count`].
        credit: u8,
    },
    /// RNR NAK with a 5-bit timer code, see [`rnr_timer_to_duration`](super::rnr_timer_to_duration).
    RnrNak {
        /// Timer code.
        timer: u8,
    },
    /// NAK.
    Nak(NakCode),
    /// Type 0b10 or bit 7 set: reserved syndrome (the full byte).
    Reserved(u8),
}

impl Syndrome {
    /// Decodes an AETH syndrome byte.
    pub const fn from_byte(b: u8) -> Syndrome {
        if b & 0x80 != 0 {
            return Syndrome::Reserved(b);
        }
        let v = b & 0x1F;
        match (b >> 5) & 3 {
            0 => Syndrome::Ack { credit: v },
            1 => Syndrome::RnrNak { timer: v },
            3 => Syndrome::Nak(NakCode::from_code(v)),
            _ => Syndrome::Reserved(b),
        }
    }
    /// Encodes the syndrome byte (5-bit values are truncated).
    pub const fn to_byte(self) -> u8 {
        match self {
            Syndrome::Ack { credit } => credit & 0x1F,
            Syndrome::RnrNak { timer } => 0x20 | (timer & 0x1F),
            Syndrome::Nak(c) => 0x60 | c.code(),
            Syndrome::Reserved(b) => b,
        }
    }
}

/// Credit code that means "no credit information" (what rxe always sends).
pub const ACK_NO_CREDIT_INFO: u8 = 0x1F;

/// Number of receive WQEs an ACK credit code stands for (rdmavt table), or `None` for code 31.
///
/// ```
/// use mrkit_soft::wire::ack_credit_count;
/// assert_eq!(ack_credit_count(5), Some(6));
/// assert_eq!(ack_credit_count(30), Some(32768));
/// assert_eq!(ack_credit_count(31), None);
/// ```
pub const fn ack_credit_count(code: u8) -> Option<u32> {
    const T: [u32; 31] = [
        0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536,
        2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768,
    ];
    let c = (code & 0x1F) as usize;
    if c < T.len() {
        Some(T[c])
    } else {
        None
    }
}

/// ACK Extended Transport Header (4 bytes): syndrome and 24-bit MSN.
///
/// ```
/// use mrkit_soft::wire::{Aeth, NakCode, Syndrome};
/// assert_eq!(Aeth::ack(1).to_bytes(), [0x1f, 0, 0, 1]);
/// assert_eq!(Aeth::rnr_nak(14, 7).syndrome, 0x2e);
/// let nak = Aeth::nak(NakCode::RemoteAccessError, 3);
/// assert_eq!(nak.syndrome, 0x62);
/// assert_eq!(nak.kind(), Syndrome::Nak(NakCode::RemoteAccessError));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Aeth {
    /// Raw syndrome byte; see [`Aeth::kind`].
    pub syndrome: u8,
    /// Message sequence number, 24 bits.
    pub msn: u32,
}

impl Aeth {
    /// ACK without credit information (syndrome 0x1F), as rxe sends.
    pub const fn ack(msn: u32) -> Aeth {
        Aeth {
            syndrome: ACK_NO_CREDIT_INFO,
            msn: msn & MSN_MASK,
        }
    }
    /// ACK with a 5-bit credit code.
    pub const fn ack_with_credit(credit: u8, msn: u32) -> Aeth {
        Aeth {
            syndrome: credit & 0x1F,
            msn: msn & MSN_MASK,
        }
    }
    /// RNR NAK with a 5-bit timer code (syndrome `0x20 | timer`).
    pub const fn rnr_nak(timer: u8, msn: u32) -> Aeth {
        Aeth {
            syndrome: 0x20 | (timer & 0x1F),
            msn: msn & MSN_MASK,
        }
    }
    /// NAK (syndrome `0x60 | code`).
    pub const fn nak(code: NakCode, msn: u32) -> Aeth {
        Aeth {
            syndrome: 0x60 | code.code(),
            msn: msn & MSN_MASK,
        }
    }
    /// Decoded syndrome.
    pub const fn kind(&self) -> Syndrome {
        Syndrome::from_byte(self.syndrome)
    }
    /// True for any ACK (whatever the credit).
    pub const fn is_ack(&self) -> bool {
        matches!(self.kind(), Syndrome::Ack { .. })
    }
    /// Parses the header from the front of `buf`, returning it and the rest.
    pub fn parse(buf: &[u8]) -> Result<(Aeth, &[u8]), WireError> {
        let (h, rest) = take::<AETH_LEN>(buf)?;
        Ok((
            Aeth {
                syndrome: h[0],
                msn: u32::from_be_bytes([0, h[1], h[2], h[3]]),
            },
            rest,
        ))
    }
    /// The wire bytes (MSN truncated to 24 bits).
    pub const fn to_bytes(&self) -> [u8; AETH_LEN] {
        let m = (self.msn & MSN_MASK).to_be_bytes();
        [self.syndrome, m[1], m[2], m[3]]
    }
    /// Writes the header to the front of `buf`; returns its length.
    pub fn write(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        write_bytes(buf, &self.to_bytes())
    }
}

/// Atomic Extended Transport Header (28 bytes): on COMPARE_SWAP and FETCH_ADD.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AtomicEth {
    /// Remote virtual address (must be 8-byte aligned; checked by the responder, not here).
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Swap value (COMPARE_SWAP) or addend (FETCH_ADD).
    pub swap_add: u64,
    /// Compare value (COMPARE_SWAP; 0 for FETCH_ADD).
    pub compare: u64,
}

impl AtomicEth {
    /// Parses the header from the front of `buf`, returning it and the rest.
    pub fn parse(buf: &[u8]) -> Result<(AtomicEth, &[u8]), WireError> {
        let (h, rest) = take::<ATOMIC_ETH_LEN>(buf)?;
        Ok((
            AtomicEth {
                va: be64(&h[0..]),
                rkey: be32(&h[8..]),
                swap_add: be64(&h[12..]),
                compare: be64(&h[20..]),
            },
            rest,
        ))
    }
    /// The wire bytes.
    pub fn to_bytes(&self) -> [u8; ATOMIC_ETH_LEN] {
        let mut b = [0u8; ATOMIC_ETH_LEN];
        b[0..8].copy_from_slice(&self.va.to_be_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_be_bytes());
        b[12..20].copy_from_slice(&self.swap_add.to_be_bytes());
        b[20..28].copy_from_slice(&self.compare.to_be_bytes());
        b
    }
    /// Writes the header to the front of `buf`; returns its length.
    pub fn write(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        write_bytes(buf, &self.to_bytes())
    }
}

/// Atomic ACK Extended Transport Header (8 bytes): the original remote value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AtomicAckEth {
    /// Original remote data.
    pub orig: u64,
}

impl AtomicAckEth {
    /// Parses the header from the front of `buf`, returning it and the rest.
    pub fn parse(buf: &[u8]) -> Result<(AtomicAckEth, &[u8]), WireError> {
        let (h, rest) = take::<ATOMIC_ACK_ETH_LEN>(buf)?;
        Ok((
            AtomicAckEth {
                orig: u64::from_be_bytes(*h),
            },
            rest,
        ))
    }
    /// The wire bytes.
    pub const fn to_bytes(&self) -> [u8; ATOMIC_ACK_ETH_LEN] {
        self.orig.to_be_bytes()
    }
    /// Writes the header to the front of `buf`; returns its length.
    pub fn write(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        write_bytes(buf, &self.to_bytes())
    }
}

/// Immediate data (4 bytes), read as a big-endian `u32`.
///
/// verbs' `imm_data` is a `__be32` holding the wire bytes, so convert with
/// `ImmDt(u32::from_be(wr_imm_data))` and `wc_imm_data = imm.0.to_be()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ImmDt(pub u32);

impl ImmDt {
    /// Parses the header from the front of `buf`, returning it and the rest.
    pub fn parse(buf: &[u8]) -> Result<(ImmDt, &[u8]), WireError> {
        let (h, rest) = take::<IMMDT_LEN>(buf)?;
        Ok((ImmDt(u32::from_be_bytes(*h)), rest))
    }
    /// The wire bytes.
    pub const fn to_bytes(&self) -> [u8; IMMDT_LEN] {
        self.0.to_be_bytes()
    }
    /// Writes the header to the front of `buf`; returns its length.
    pub fn write(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        write_bytes(buf, &self.to_bytes())
    }
}

/// Invalidate Extended Transport Header (4 bytes): the R_Key to invalidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Ieth {
    /// R_Key the responder invalidates.
    pub rkey: u32,
}

impl Ieth {
    /// Parses the header from the front of `buf`, returning it and the rest.
    pub fn parse(buf: &[u8]) -> Result<(Ieth, &[u8]), WireError> {
        let (h, rest) = take::<IETH_LEN>(buf)?;
        Ok((
            Ieth {
                rkey: u32::from_be_bytes(*h),
            },
            rest,
        ))
    }
    /// The wire bytes.
    pub const fn to_bytes(&self) -> [u8; IETH_LEN] {
        self.rkey.to_be_bytes()
    }
    /// Writes the header to the front of `buf`; returns its length.
    pub fn write(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        write_bytes(buf, &self.to_bytes())
    }
}
