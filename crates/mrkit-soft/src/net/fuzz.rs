//! Fuzzing the receive path and the responder: arbitrary datagrams go through
//! [`Pkt::from_wire`](super::Pkt::from_wire) into a real RC QP whose registered buffer is
//! surrounded by canary bytes, and the device makes progress until idle. Whatever the input, the
//! device must not panic, hang, or write outside the registered range.
//!
//! The body is a library function so that stable-toolchain tests drive it with proptest and
//! the cargo-fuzz target `fuzz/fuzz_targets/responder.rs` drives it with libFuzzer.
#![forbid(unsafe_code)]

use std::cell::RefCell;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Instant;

use super::Pkt;
use crate::access::AccessFlags;
use crate::device::DeviceConfig;
use crate::qp::connect::{connect_qp, ConnectOpts, RemoteQp};
use crate::qp::{QpCap, QpInitAttr, QpState, RecvWr, Sge};
use crate::wire::IcrcInputs;
use crate::Context;

const CANARY: u8 = 0xa5;
const PAD: usize = 4096;
const MR_LEN: usize = 16384;

struct Harness {
    resp: Context,
    peer: Context,
    qp: u32,
    peer_qp: u32,
    pd: u32,
    /// `PAD` canary bytes, the registered `MR_LEN` bytes, `PAD` canary bytes.
    mem: Vec<u8>,
    lkey: u32,
    iova: u64,
}

fn bring_up(h: &Harness) {
    for (c, q, pq, node) in [
        (&h.resp, h.qp, h.peer_qp, h.peer.node_id()),
        (&h.peer, h.peer_qp, h.qp, h.resp.node_id()),
    ] {
        if c.qp_state(q).ok() == Some(QpState::Rts) {
            continue;
        }
        let reset = crate::qp::QpAttr {
            qp_state: QpState::Reset as u32,
            ..crate::qp::QpAttr::default()
        };
        let _ = c.modify_qp(q, &reset, crate::qp::attr_mask::STATE);
        let remote = RemoteQp {
            qpn: pq,
            psn: 0,
            ip: None,
            node,
        };
        let _ = connect_qp(c, q, remote, ConnectOpts::default());
    }
    let recv = RecvWr {
        wr_id: 1,
        sg_list: vec![Sge {
            addr: h.iova,
            length: 4096,
            lkey: h.lkey,
        }],
    };
    let _ = h.resp.post_recv(h.qp, &[recv]);
}

fn harness() -> Harness {
    let mk = || {
        let c = Context::open(DeviceConfig::rxe());
        c.set_manual_progress();
        c
    };
    let (resp, peer) = (mk(), mk());
    let pd = resp.alloc_pd().expect("pd");
    let ppd = peer.alloc_pd().expect("pd");
    let cq = resp.create_cq(4096, None).expect("cq");
    let pcq = peer.create_cq(4096, None).expect("cq");
    let init = |pd, cq| QpInitAttr {
        pd,
        send_cq: cq,
        recv_cq: cq,
        cap: QpCap::default(),
        sq_sig_all: false,
    };
    let (qp, _) = resp.create_qp(init(pd, cq)).expect("qp");
    let (peer_qp, _) = peer.create_qp(init(ppd, pcq)).expect("qp");
    let mut mem = vec![CANARY; PAD + MR_LEN + PAD];
    mem[PAD..PAD + MR_LEN].fill(0);
    let addr = mem.as_ptr() as u64 + PAD as u64;
    let all = AccessFlags::LOCAL_WRITE
        | AccessFlags::REMOTE_WRITE
        | AccessFlags::REMOTE_READ
        | AccessFlags::REMOTE_ATOMIC;
    let mr = resp.reg_mr_va(pd, addr, MR_LEN as u64, all).expect("mr");
    let h = Harness {
        resp,
        peer,
        qp,
        peer_qp,
        pd,
        mem,
        lkey: mr.lkey,
        iova: mr.iova,
    };
    bring_up(&h);
    h
}

thread_local! {
    static H: RefCell<Option<Harness>> = const { RefCell::new(None) };
}

/// Feed one fuzz input. Byte 0 chooses how much of the packet is repaired so that the fuzzer
/// reaches deep states: bit 0 sets the destination QPN to the live QP, bit 1 points PSNs at the
/// expected one, bit 2 aims RETH/AtomicETH addresses and keys at the registered buffer (or just
/// outside it), and the ICRC is recomputed unless bit 3 is set. The rest is the datagram.
pub fn fuzz_responder(data: &[u8]) {
    if data.is_empty() {
        return;
    }
    H.with(|cell| {
        let mut g = cell.borrow_mut();
        let h = g.get_or_insert_with(harness);
        let mode = data[0];
        let mut d = data[1..].to_vec();
        if d.len() >= 12 {
            if mode & 1 != 0 {
                d[5..8].copy_from_slice(&h.qp.to_be_bytes()[1..]);
            }
            if mode & 2 != 0 {
                d[9..12].fill(0);
            }
            if mode & 4 != 0 && d.len() >= 28 {
                // RETH/AtomicETH start right after the BTH for requests that carry them.
                let off = u64::from(u16::from_be_bytes([d[12], d[13]])) % (MR_LEN as u64 + 64);
                let va = (h.iova + off).wrapping_sub(32);
                d[12..20].copy_from_slice(&va.to_be_bytes());
                d[20..24].copy_from_slice(&h.lkey.to_be_bytes());
            }
        }
        let src = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 1, 1, 1)), 0xc001);
        let dst = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 1, 1, 2)), 4791);
        if mode & 8 == 0 && d.len() >= 16 {
            let _ = IcrcInputs::from_socket_addrs(src, dst).fill(&mut d);
        }
        if let Ok(p) = Pkt::from_wire(&d, src, dst, h.resp.node_id()) {
            h.resp.dev.dp.enqueue_packet(p);
        }
        let now = Instant::now();
        let mut rounds = 0;
        while h.resp.progress_once(now) + h.peer.progress_once(now) > 0 {
            rounds += 1;
            assert!(rounds < 10_000, "progress does not converge (livelock)");
        }
        let mut wcs = Vec::new();
        for c in [&h.resp, &h.peer] {
            for cqn in c.dev.dp.cqs.read().keys().copied().collect::<Vec<_>>() {
                while c.poll_cq(cqn, &mut wcs, 64).unwrap_or(0) > 0 {
                    wcs.clear();
                }
            }
        }
        assert!(
            h.mem[..PAD].iter().all(|&b| b == CANARY)
                && h.mem[PAD + MR_LEN..].iter().all(|&b| b == CANARY),
            "a packet wrote outside the registered range"
        );
        let _ = h.pd;
        bring_up(h);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{ExtHeaders, Opcode, PacketBuilder, Reth};
    use proptest::prelude::*;

    /// Structured inputs: real request headers with random fields.
    fn structured() -> impl Strategy<Value = Vec<u8>> {
        (
            0u8..16,
            prop::sample::select(Opcode::ALL.to_vec()),
            any::<u32>(),
            any::<u64>(),
            any::<u32>(),
            proptest::collection::vec(any::<u8>(), 0..300),
        )
            .prop_map(|(mode, op, psn, va, len, payload)| {
                let mut b = PacketBuilder::new(op, 0, psn & 0xff_ffff);
                let info = op.info();
                let mut ext = ExtHeaders::default(); // RETH only; other headers stay absent
                if info.headers.contains(crate::wire::HeaderSet::RETH) {
                    ext.reth = Some(Reth {
                        va,
                        rkey: 0,
                        dma_len: len % 70_000,
                    });
                }
                if let Some(r) = ext.reth {
                    b = b.reth(r);
                }
                let pl = if info.has_payload() {
                    payload
                } else {
                    Vec::new()
                };
                let inputs = IcrcInputs::ipv4(
                    Ipv4Addr::new(127, 1, 1, 1),
                    Ipv4Addr::new(127, 1, 1, 2),
                    0xc001,
                    4791,
                );
                let mut v = vec![mode];
                v.extend(b.to_vec(&pl, &inputs).unwrap_or_default());
                v
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]
        #[test]
        fn random_datagrams_never_escape_the_mr(data in proptest::collection::vec(any::<u8>(), 0..200)) {
            fuzz_responder(&data);
        }

        #[test]
        fn structured_requests_never_escape_the_mr(data in structured()) {
            fuzz_responder(&data);
        }
    }
}
