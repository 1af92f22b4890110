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

pub mod loopback;

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
    /// Pieces of registered memory `(guard, offset in guard, length)`.
    Mem(Vec<(MrGuard, u64, usize)>),
}

impl Payload {
    /// Payload length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Payload::Empty => 0,
            Payload::Bytes(b) => b.len(),
            Payload::Mem(p) => p.iter().map(|x| x.2).sum(),
        }
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copy `n` payload bytes starting at `poff` into registered memory `dst` at `doff`.
    pub(crate) fn copy_to(&self, mut poff: usize, dst: &MrGuard, mut doff: u64, mut n: usize) {
        match self {
            Payload::Empty => debug_assert_eq!(n, 0),
            Payload::Bytes(b) => copy::write_from(dst, doff, &b[poff..poff + n]),
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
        }
    }
    /// Copy `dst.len()` payload bytes starting at `poff` into a slice.
    pub(crate) fn read(&self, mut poff: usize, dst: &mut [u8]) {
        match self {
            Payload::Empty => {}
            Payload::Bytes(b) => dst.copy_from_slice(&b[poff..poff + dst.len()]),
            Payload::Mem(pieces) => {
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
    /// Node (device instance) the packet is for.
    pub dst_node: u64,
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
