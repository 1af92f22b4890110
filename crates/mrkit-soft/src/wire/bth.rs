//! The Base Transport Header (docs/roce.md §1.2).

use super::error::WireError;
use super::opcode::Opcode;
use super::{BTH_LEN, DEFAULT_PKEY, PSN_MASK, QPN_MASK};

/// The 12-byte Base Transport Header.
///
/// Reserved bits (`resv6a`, `resv7`) are ignored on parse and written as 0.
///
/// ```
/// use mrkit_soft::wire::{Bth, Opcode};
/// let bth = Bth { ack_req: true, ..Bth::new(Opcode::Acknowledge, 0x12, 703_710) };
/// let bytes = bth.to_bytes();
/// assert_eq!(bytes, [0x11, 0, 0xff, 0xff, 0, 0, 0, 0x12, 0x80, 0x0a, 0xbc, 0xde]);
/// let (back, rest) = Bth::parse(&bytes).unwrap();
/// assert_eq!(back, bth);
/// assert!(rest.is_empty());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bth {
    /// Opcode (byte 0).
    pub opcode: Opcode,
    /// Solicited event.
    pub se: bool,
    /// MigReq (rxe sends 0, receivers ignore it).
    pub migreq: bool,
    /// Pad count, 0..=3. The builder computes it from the payload length.
    pub pad_count: u8,
    /// Transport header version, 4 bits; must be 0.
    pub tver: u8,
    /// Partition key.
    pub pkey: u16,
    /// Forward ECN (congestion experienced).
    pub fecn: bool,
    /// Backward ECN (set in CNPs).
    pub becn: bool,
    /// Destination QP number, 24 bits.
    pub dest_qpn: u32,
    /// Acknowledge request.
    pub ack_req: bool,
    /// Packet sequence number, 24 bits.
    pub psn: u32,
}

impl Bth {
    /// A BTH with P_Key 0xFFFF and every flag clear.
    pub const fn new(opcode: Opcode, dest_qpn: u32, psn: u32) -> Bth {
        Bth {
            opcode,
            se: false,
            migreq: false,
            pad_count: 0,
            tver: 0,
            pkey: DEFAULT_PKEY,
            fecn: false,
            becn: false,
            dest_qpn: dest_qpn & QPN_MASK,
            ack_req: false,
            psn: psn & PSN_MASK,
        }
    }

    /// Parses the first 12 bytes of `buf` and returns the header and the rest.
    ///
    /// Errors: [`WireError::Truncated`], or the opcode errors of [`Opcode::from_u8`].
    /// TVer is returned as found (checked by [`PacketView::parse`](super::PacketView::parse)).
    pub fn parse(buf: &[u8]) -> Result<(Bth, &[u8]), WireError> {
        let Some((h, rest)) = buf.split_first_chunk::<BTH_LEN>() else {
            return Err(WireError::Truncated {
                needed: BTH_LEN,
                available: buf.len(),
            });
        };
        let opcode = Opcode::from_u8(h[0])?;
        Ok((
            Bth {
                opcode,
                se: h[1] & 0x80 != 0,
                migreq: h[1] & 0x40 != 0,
                pad_count: (h[1] >> 4) & 3,
                tver: h[1] & 0x0F,
                pkey: u16::from_be_bytes([h[2], h[3]]),
                fecn: h[4] & 0x80 != 0,
                becn: h[4] & 0x40 != 0,
                dest_qpn: u32::from_be_bytes([0, h[5], h[6], h[7]]),
                ack_req: h[8] & 0x80 != 0,
                psn: u32::from_be_bytes([0, h[9], h[10], h[11]]),
            },
            rest,
        ))
    }

    /// The 12 wire bytes. Fields wider than their wire width are truncated to it.
    pub const fn to_bytes(&self) -> [u8; BTH_LEN] {
        let q = (self.dest_qpn & QPN_MASK).to_be_bytes();
        let p = (self.psn & PSN_MASK).to_be_bytes();
        let k = self.pkey.to_be_bytes();
        [
            self.opcode as u8,
            ((self.se as u8) << 7)
                | ((self.migreq as u8) << 6)
                | ((self.pad_count & 3) << 4)
                | (self.tver & 0x0F),
            k[0],
            k[1],
            ((self.fecn as u8) << 7) | ((self.becn as u8) << 6),
            q[1],
            q[2],
            q[3],
            (self.ack_req as u8) << 7,
            p[1],
            p[2],
            p[3],
        ]
    }

    /// Writes the header into the first 12 bytes of `buf` and returns 12.
    pub fn write(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        write_bytes(buf, &self.to_bytes())
    }
}

/// Copies `src` to the front of `buf`, or fails with [`WireError::BufferTooSmall`].
pub(crate) fn write_bytes(buf: &mut [u8], src: &[u8]) -> Result<usize, WireError> {
    match buf.get_mut(..src.len()) {
        Some(dst) => {
            dst.copy_from_slice(src);
            Ok(src.len())
        }
        None => Err(WireError::BufferTooSmall {
            needed: src.len(),
            available: buf.len(),
        }),
    }
}
