//! Whole-packet parsing and building (UDP payload = BTH .. ICRC).

use super::bth::Bth;
use super::error::WireError;
use super::ext::{Aeth, AtomicAckEth, AtomicEth, Ieth, ImmDt, Reth};
use super::icrc::{split_icrc, IcrcInputs};
use super::opcode::{HeaderSet, OpFlags, Opcode, OpcodeInfo};
use super::params::Mtu;
use super::{CNP_PAD_LEN, ICRC_LEN};

/// The extension headers of one packet. Exactly the ones the opcode lists are `Some`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ExtHeaders {
    /// RETH (WRITE FIRST/ONLY, READ REQUEST).
    pub reth: Option<Reth>,
    /// AETH (ACKs, read responses FIRST/LAST/ONLY).
    pub aeth: Option<Aeth>,
    /// AtomicETH (COMPARE_SWAP, FETCH_ADD).
    pub atomic_eth: Option<AtomicEth>,
    /// AtomicAckETH (ATOMIC_ACKNOWLEDGE).
    pub atomic_ack_eth: Option<AtomicAckEth>,
    /// Immediate data (`*_WITH_IMMEDIATE`).
    pub immdt: Option<ImmDt>,
    /// IETH (`SEND_*_WITH_INVALIDATE`).
    pub ieth: Option<Ieth>,
}

impl ExtHeaders {
    /// The set of headers present (never contains [`HeaderSet::CNP_PAD`]).
    pub fn present(&self) -> HeaderSet {
        let mut h = HeaderSet::empty();
        h.set(HeaderSet::RETH, self.reth.is_some());
        h.set(HeaderSet::AETH, self.aeth.is_some());
        h.set(HeaderSet::ATOMIC_ETH, self.atomic_eth.is_some());
        h.set(HeaderSet::ATOMIC_ACK_ETH, self.atomic_ack_eth.is_some());
        h.set(HeaderSet::IMMDT, self.immdt.is_some());
        h.set(HeaderSet::IETH, self.ieth.is_some());
        h
    }

    /// True if these headers are exactly the ones `opcode` carries.
    pub fn matches(&self, opcode: Opcode) -> bool {
        self.present() == opcode.headers().difference(HeaderSet::CNP_PAD)
    }
}

/// A parsed RoCEv2 packet borrowing the UDP payload it came from.
///
/// [`PacketView::parse`] checks the structure only; check the ICRC with
/// [`PacketView::verify_icrc`] (or use [`PacketView::parse_verified`]) and the per-opcode
/// payload rules with [`PacketView::check_payload_len`].
///
/// ```
/// use mrkit_soft::wire::{Packet, Opcode, IcrcInputs};
/// use std::net::Ipv4Addr;
/// // RDMA WRITE ONLY "hello RoCE!" from docs/roce.md §2.2 vector 2 (UDP payload).
/// let hex = "0a10ffff00000011800abcde00007f0012345000000012340000000b68656c6c6f20526f43452100f64ef899";
/// let dgram: Vec<u8> = (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
/// let pkt = Packet::parse(&dgram).unwrap();
/// assert_eq!(pkt.opcode(), Opcode::RdmaWriteOnly);
/// assert_eq!(pkt.bth.psn, 703_710);
/// assert_eq!(pkt.ext.reth.unwrap().dma_len, 11);
/// assert_eq!(pkt.payload, b"hello RoCE!");
/// let lo = Ipv4Addr::LOCALHOST;
/// assert!(pkt.verify_icrc(&IcrcInputs::ipv4(lo, lo, 0xc124, 4791)).is_ok());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PacketView<'a> {
    /// The base transport header.
    pub bth: Bth,
    /// The extension headers.
    pub ext: ExtHeaders,
    /// The payload, pad bytes excluded.
    pub payload: &'a [u8],
    datagram: &'a [u8],
}

/// `Packet::parse(..)` reads better at call sites; it is the same type as [`PacketView`].
pub type Packet<'a> = PacketView<'a>;

impl<'a> PacketView<'a> {
    /// Parses a UDP payload (BTH through ICRC). Does not allocate and never panics.
    ///
    /// Checks: length covers BTH + extension headers + ICRC; known RC opcode (or CNP); TVer 0;
    /// total length a multiple of 4; PadCnt not larger than the data area; no payload on opcodes
    /// that carry none. The ICRC is **not** checked here.
    pub fn parse(datagram: &'a [u8]) -> Result<PacketView<'a>, WireError> {
        let (bth, mut rest) = Bth::parse(datagram)?;
        if bth.tver != 0 {
            return Err(WireError::BadVersion(bth.tver));
        }
        let info = bth.opcode.info();
        let min = info.header_len + ICRC_LEN;
        if datagram.len() < min {
            return Err(WireError::Truncated {
                needed: min,
                available: datagram.len(),
            });
        }
        if datagram.len() % 4 != 0 {
            return Err(WireError::Misaligned(datagram.len()));
        }
        let h = info.headers;
        let mut ext = ExtHeaders::default();
        if h.contains(HeaderSet::RETH) {
            let (x, r) = Reth::parse(rest)?;
            ext.reth = Some(x);
            rest = r;
        }
        if h.contains(HeaderSet::AETH) {
            let (x, r) = Aeth::parse(rest)?;
            ext.aeth = Some(x);
            rest = r;
        }
        if h.contains(HeaderSet::ATOMIC_ETH) {
            let (x, r) = AtomicEth::parse(rest)?;
            ext.atomic_eth = Some(x);
            rest = r;
        }
        if h.contains(HeaderSet::ATOMIC_ACK_ETH) {
            let (x, r) = AtomicAckEth::parse(rest)?;
            ext.atomic_ack_eth = Some(x);
            rest = r;
        }
        if h.contains(HeaderSet::IMMDT) {
            let (x, r) = ImmDt::parse(rest)?;
            ext.immdt = Some(x);
            rest = r;
        }
        if h.contains(HeaderSet::IETH) {
            let (x, r) = Ieth::parse(rest)?;
            ext.ieth = Some(x);
            rest = r;
        }
        if h.contains(HeaderSet::CNP_PAD) {
            rest = rest.get(CNP_PAD_LEN..).unwrap_or(&[]);
        }
        let data_len = rest.len().saturating_sub(ICRC_LEN);
        let data = &rest[..data_len];
        let pad = usize::from(bth.pad_count);
        if !info.has_payload() {
            if !data.is_empty() {
                return Err(WireError::PayloadNotAllowed {
                    opcode: bth.opcode,
                    len: data.len(),
                });
            }
            if pad != 0 {
                return Err(WireError::BadPad {
                    pad: bth.pad_count,
                    data_len,
                });
            }
        }
        if pad > data_len {
            return Err(WireError::BadPad {
                pad: bth.pad_count,
                data_len,
            });
        }
        Ok(PacketView {
            bth,
            ext,
            payload: &data[..data_len - pad],
            datagram,
        })
    }

    /// [`PacketView::parse`] followed by [`PacketView::verify_icrc`].
    pub fn parse_verified(
        datagram: &'a [u8],
        inputs: &IcrcInputs,
    ) -> Result<PacketView<'a>, WireError> {
        let p = PacketView::parse(datagram)?;
        p.verify_icrc(inputs)?;
        Ok(p)
    }

    /// The opcode.
    pub fn opcode(&self) -> Opcode {
        self.bth.opcode
    }

    /// The opcode's table row.
    pub fn info(&self) -> &'static OpcodeInfo {
        self.bth.opcode.info()
    }

    /// The PSN (shortcut for `bth.psn`).
    pub fn psn(&self) -> u32 {
        self.bth.psn
    }

    /// The whole UDP payload this view was parsed from.
    pub fn datagram(&self) -> &'a [u8] {
        self.datagram
    }

    /// The pad bytes (normally zero; not checked).
    pub fn pad(&self) -> &'a [u8] {
        let start = self.info().header_len + self.payload.len();
        let end = self.datagram.len() - ICRC_LEN;
        self.datagram.get(start..end).unwrap_or(&[])
    }

    /// The ICRC value carried by the packet (its 4 last bytes read little-endian).
    pub fn icrc(&self) -> u32 {
        split_icrc(self.datagram).map(|(_, v)| v).unwrap_or(0)
    }

    /// Checks the ICRC against the IP/UDP fields in `inputs`.
    pub fn verify_icrc(&self, inputs: &IcrcInputs) -> Result<(), WireError> {
        inputs.verify(self.datagram)
    }

    /// Checks the payload length against the per-opcode rules of docs/roce.md §1.5 for path MTU
    /// `mtu`: FIRST/MIDDLE carry exactly `mtu` bytes, LAST `1..=mtu`, ONLY `0..=mtu`, the others
    /// none. (Violations deserve a NAK invalid request, so [`PacketView::parse`] does not drop them.)
    pub fn check_payload_len(&self, mtu: Mtu) -> Result<(), WireError> {
        check_payload_len(self.bth.opcode, self.payload.len(), mtu)
    }

    /// The headers and payload as a [`PacketBuilder`] (for re-emitting or modifying a packet).
    pub fn to_builder(&self) -> PacketBuilder {
        PacketBuilder {
            bth: self.bth,
            ext: self.ext,
        }
    }
}

/// Checks a payload length against the per-opcode MTU rules (see [`PacketView::check_payload_len`]).
pub fn check_payload_len(opcode: Opcode, len: usize, mtu: Mtu) -> Result<(), WireError> {
    let m = mtu.bytes();
    let f = opcode.flags();
    let ok = if !f.contains(OpFlags::PAYLOAD) {
        len == 0
    } else if f.intersects(OpFlags::FIRST.union(OpFlags::MIDDLE)) {
        len == m
    } else if f.contains(OpFlags::LAST) {
        (1..=m).contains(&len)
    } else {
        len <= m
    };
    if ok {
        Ok(())
    } else {
        Err(WireError::PayloadLength {
            opcode,
            len,
            mtu: m,
        })
    }
}

/// Pad bytes needed after a payload of `payload_len` bytes: `(-len) & 3`.
pub const fn pad_for(payload_len: usize) -> u8 {
    (payload_len.wrapping_neg() & 3) as u8
}

/// Length of the UDP payload (BTH .. ICRC) for `opcode` carrying `payload_len` bytes.
///
/// ```
/// use mrkit_soft::wire::{wire_len, Opcode};
/// assert_eq!(wire_len(Opcode::RdmaWriteOnly, 11), 28 + 11 + 1 + 4);
/// assert_eq!(wire_len(Opcode::Acknowledge, 0), 20);
/// ```
pub const fn wire_len(opcode: Opcode, payload_len: usize) -> usize {
    opcode.header_len() + payload_len + pad_for(payload_len) as usize + ICRC_LEN
}

/// Where the parts of a packet being built sit in the output buffer (from [`emit_headers`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// BTH + extension headers.
    pub header_len: usize,
    /// Payload bytes (pad excluded).
    pub payload_len: usize,
    /// Pad bytes.
    pub pad: u8,
    /// Whole UDP payload, ICRC included.
    pub total_len: usize,
}

impl Layout {
    /// Byte range of the payload in the output buffer.
    pub fn payload_range(&self) -> core::ops::Range<usize> {
        self.header_len..self.header_len + self.payload_len
    }
}

/// First half of a zero-copy build: writes BTH (with PadCnt computed from `payload_len`) and the
/// extension headers to the front of `out`, which must hold the whole packet. The caller then
/// copies the payload into `out[layout.payload_range()]` and calls [`finish`].
pub fn emit_headers(
    out: &mut [u8],
    bth: &Bth,
    ext: &ExtHeaders,
    payload_len: usize,
) -> Result<Layout, WireError> {
    let op = bth.opcode;
    if !ext.matches(op) {
        return Err(WireError::HeaderMismatch(op));
    }
    if payload_len != 0 && !op.info().has_payload() {
        return Err(WireError::PayloadNotAllowed {
            opcode: op,
            len: payload_len,
        });
    }
    let pad = pad_for(payload_len);
    let header_len = op.header_len();
    let total_len = header_len + payload_len + usize::from(pad) + ICRC_LEN;
    if out.len() < total_len {
        return Err(WireError::BufferTooSmall {
            needed: total_len,
            available: out.len(),
        });
    }
    let b = Bth {
        pad_count: pad,
        ..*bth
    };
    let mut off = b.write(out)?;
    if let Some(x) = ext.reth {
        off += x.write(&mut out[off..])?;
    }
    if let Some(x) = ext.aeth {
        off += x.write(&mut out[off..])?;
    }
    if let Some(x) = ext.atomic_eth {
        off += x.write(&mut out[off..])?;
    }
    if let Some(x) = ext.atomic_ack_eth {
        off += x.write(&mut out[off..])?;
    }
    if let Some(x) = ext.immdt {
        off += x.write(&mut out[off..])?;
    }
    if let Some(x) = ext.ieth {
        off += x.write(&mut out[off..])?;
    }
    if op.headers().contains(HeaderSet::CNP_PAD) {
        out[off..off + CNP_PAD_LEN].fill(0);
        off += CNP_PAD_LEN;
    }
    debug_assert_eq!(off, header_len);
    Ok(Layout {
        header_len,
        payload_len,
        pad,
        total_len,
    })
}

/// Second half of a zero-copy build: writes the zero pad bytes and the ICRC; returns the total length.
pub fn finish(out: &mut [u8], layout: &Layout, inputs: &IcrcInputs) -> Result<usize, WireError> {
    let Some(pkt) = out.get_mut(..layout.total_len) else {
        return Err(WireError::BufferTooSmall {
            needed: layout.total_len,
            available: out.len(),
        });
    };
    let pad_start = layout.header_len + layout.payload_len;
    pkt[pad_start..pad_start + usize::from(layout.pad)].fill(0);
    inputs.fill(pkt)?;
    Ok(layout.total_len)
}

/// Builds a whole packet (BTH .. ICRC) into `out` and returns its length.
///
/// PadCnt in `bth` is ignored and computed from the payload; `ext` must hold exactly the headers
/// the opcode needs.
pub fn build(
    out: &mut [u8],
    bth: &Bth,
    ext: &ExtHeaders,
    payload: &[u8],
    inputs: &IcrcInputs,
) -> Result<usize, WireError> {
    let layout = emit_headers(out, bth, ext, payload.len())?;
    out[layout.payload_range()].copy_from_slice(payload);
    finish(out, &layout, inputs)
}

/// Fluent packet builder.
///
/// ```
/// use mrkit_soft::wire::{PacketBuilder, Packet, Opcode, Reth, IcrcInputs};
/// use std::net::Ipv4Addr;
/// let lo = Ipv4Addr::LOCALHOST;
/// let inputs = IcrcInputs::ipv4(lo, lo, 0xc124, 4791);
/// let dgram = PacketBuilder::new(Opcode::RdmaWriteOnly, 0x11, 703_710)
///     .ack_req(true)
///     .reth(Reth { va: 0x7f00_1234_5000, rkey: 0x1234, dma_len: 11 })
///     .to_vec(b"hello RoCE!", &inputs)
///     .unwrap();
/// // Byte-identical to docs/roce.md §2.2 vector 2, ICRC included.
/// assert_eq!(&dgram[dgram.len() - 4..], &[0xf6, 0x4e, 0xf8, 0x99]);
/// let p = Packet::parse_verified(&dgram, &inputs).unwrap();
/// assert_eq!(p.bth.pad_count, 1);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PacketBuilder {
    /// The BTH (PadCnt is overwritten when building).
    pub bth: Bth,
    /// The extension headers.
    pub ext: ExtHeaders,
}

impl PacketBuilder {
    /// A builder with [`Bth::new`] and no extension headers.
    pub const fn new(opcode: Opcode, dest_qpn: u32, psn: u32) -> PacketBuilder {
        PacketBuilder {
            bth: Bth::new(opcode, dest_qpn, psn),
            ext: ExtHeaders {
                reth: None,
                aeth: None,
                atomic_eth: None,
                atomic_ack_eth: None,
                immdt: None,
                ieth: None,
            },
        }
    }
    /// Sets BTH.SE.
    pub const fn se(mut self, v: bool) -> Self {
        self.bth.se = v;
        self
    }
    /// Sets BTH.AckReq.
    pub const fn ack_req(mut self, v: bool) -> Self {
        self.bth.ack_req = v;
        self
    }
    /// Sets BTH.M.
    pub const fn migreq(mut self, v: bool) -> Self {
        self.bth.migreq = v;
        self
    }
    /// Sets the P_Key.
    pub const fn pkey(mut self, v: u16) -> Self {
        self.bth.pkey = v;
        self
    }
    /// Sets FECN.
    pub const fn fecn(mut self, v: bool) -> Self {
        self.bth.fecn = v;
        self
    }
    /// Sets BECN.
    pub const fn becn(mut self, v: bool) -> Self {
        self.bth.becn = v;
        self
    }
    /// Adds a RETH.
    pub const fn reth(mut self, v: Reth) -> Self {
        self.ext.reth = Some(v);
        self
    }
    /// Adds an AETH.
    pub const fn aeth(mut self, v: Aeth) -> Self {
        self.ext.aeth = Some(v);
        self
    }
    /// Adds an AtomicETH.
    pub const fn atomic_eth(mut self, v: AtomicEth) -> Self {
        self.ext.atomic_eth = Some(v);
        self
    }
    /// Adds an AtomicAckETH.
    pub const fn atomic_ack_eth(mut self, v: AtomicAckEth) -> Self {
        self.ext.atomic_ack_eth = Some(v);
        self
    }
    /// Adds immediate data.
    pub const fn immdt(mut self, v: ImmDt) -> Self {
        self.ext.immdt = Some(v);
        self
    }
    /// Adds an IETH.
    pub const fn ieth(mut self, v: Ieth) -> Self {
        self.ext.ieth = Some(v);
        self
    }
    /// Length of the packet this builder makes with `payload_len` payload bytes.
    pub const fn wire_len(&self, payload_len: usize) -> usize {
        wire_len(self.bth.opcode, payload_len)
    }
    /// Builds into `out`; returns the length (see [`build`]).
    pub fn build(
        &self,
        payload: &[u8],
        inputs: &IcrcInputs,
        out: &mut [u8],
    ) -> Result<usize, WireError> {
        build(out, &self.bth, &self.ext, payload, inputs)
    }
    /// Builds into a new vector of exactly the packet's length.
    pub fn to_vec(&self, payload: &[u8], inputs: &IcrcInputs) -> Result<Vec<u8>, WireError> {
        let mut v = vec![0u8; self.wire_len(payload.len())];
        self.build(payload, inputs, &mut v)?;
        Ok(v)
    }
}
