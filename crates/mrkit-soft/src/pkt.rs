//! Packets between QPs in structured form: what the engines consume and produce.
//!
//! A [`Pkt`] is a RoCEv2 packet as the engines see it: the [`Bth`], the extension headers and
//! a [`Payload`]. On the in-process loopback link the payload of a request or read response
//! is a list of **guarded memory pieces** (an [`MrGuard`] per piece, taken by the sender's
//! access check for exactly this packet's bytes), so the receiver copies straight from the
//! sender's registered memory into its own: one copy per byte, like a DMA engine. The guards
//! drop when the packet has been consumed, so a packet can delay a dereg by at most its own
//! processing. The UDP link (`net/`) materialises the payload when it serialises the packet
//! and parses received datagrams into packets.
#![forbid(unsafe_code)]

use crate::copy;
use crate::mr::MrGuard;
use crate::wire::{Bth, ExtHeaders, WireError};

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

#[cfg(test)]
mod tests {
    use super::*;

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
