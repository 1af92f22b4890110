//! Fuzzing the receive path and the responder: arbitrary datagrams go through
//! [`Pkt::from_wire`](crate::pkt::Pkt::from_wire) into a real RC QP whose registered buffer is
//! surrounded by canary bytes, and its QPs run until idle. Whatever the input, nothing may
//! panic, hang, or write outside the registered range.
//!
//! [`fuzz_completer`] does the same for the other direction: arbitrary responses (ACKs, NAKs,
//! RNR NAKs, READ responses, atomic ACKs, garbage) and retransmission timeouts reach a requester
//! with SEND, WRITE, READ and atomic WQEs outstanding. Whatever arrives, no completion may be
//! reported twice or out of order, progress must converge, and READ data and atomic results
//! may only land inside the local buffer.
//!
//! Both run on the test kit's virtual clock ([`VirtualNode`]): the engines on a bare memory
//! core, packets handed in and out by hand, time advanced only by the input. An iteration
//! costs no device open, no progress thread and no socket, and it is deterministic.
//!
//! The bodies are library functions (feature `testkit`) so that stable-toolchain tests drive
//! them with proptest and the cargo-fuzz targets `fuzz/fuzz_targets/{responder,completer}.rs`
//! drive them with libFuzzer.
#![forbid(unsafe_code)]

use std::cell::RefCell;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use crate::access::AccessFlags;
use crate::device::DeviceConfig;
use crate::pkt::Pkt;
use crate::qp::connect::{connect_qp, ConnectOpts, RemoteQp};
use crate::qp::{QpCap, QpInitAttr, QpState, RecvWr, Sge};
use crate::testkit::VirtualNode;
use crate::user_mem::UserMemory;
use crate::wire::IcrcInputs;
use std::sync::Arc;

const CANARY: u8 = 0xa5;

/// The remote address of the fuzzed QPs: fuzzed packets "from the peer" come from here, and
/// what the QPs send goes here over UDP, where nothing listens (127.x.y.254 is never a
/// default device address).
const PEER: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 254, 254, 254)), 0xc001);
/// Another local address: packets from here must be dropped by the source-address check.
const STRANGER: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 1, 1, 1)), 0xc001);
/// The destination the fuzzed packets' ICRCs are computed for.
const DST: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 1, 1, 2)), 4791);
const PAD: usize = 4096;
const MR_LEN: usize = 16384;

/// The fuzzed node's loopback id (what it puts in packets it builds).
const NODE: u64 = 1;
/// The node id the responder's peer would have on the loopback link (its replies go to
/// `PEER` over UDP instead, that is: nowhere).
const PEER_NODE: u64 = 2;

/// A node on the virtual clock with one PD, one CQ of `cq_entries` and one RC QP on it for
/// both queues: `(node, pd, cq, qp)`.
fn rc_node(cq_entries: u32, sq_sig_all: bool) -> (VirtualNode, u32, u32, u32) {
    let node = VirtualNode::new(DeviceConfig::rxe(), NODE);
    let pd = node.mem().alloc_pd().expect("pd");
    let cq = node.create_cq(cq_entries).expect("cq");
    let qp = node
        .create_qp(QpInitAttr {
            pd,
            send_cq: cq,
            recv_cq: cq,
            cap: QpCap::default(),
            sq_sig_all,
        })
        .expect("qp");
    (node, pd, cq, qp)
}

/// What a fuzzed node sent, as it would leave on the UDP link to `PEER`: each packet is
/// serialised (its payload gathered from registered memory) and must parse back, with the
/// ICRC the receiver checks, to the same headers and payload length (and the right pad). Then it is dropped
/// (nothing listens at `PEER`).
fn sent_to_peer(pkts: Vec<Pkt>) {
    let inputs = IcrcInputs::from_socket_addrs(DST, PEER);
    for p in pkts {
        let d = p
            .to_wire(&inputs)
            .expect("a packet the QP sends serialises");
        let back = Pkt::from_wire(&d, DST, PEER, PEER_NODE).expect("and parses back");
        // The pad count is the serialiser's (a packet in memory does not carry one).
        let len = p.payload.len();
        assert_eq!(usize::from(back.bth.pad_count), (4 - len % 4) % 4);
        let bth = crate::wire::Bth {
            pad_count: p.bth.pad_count,
            ..back.bth
        };
        assert_eq!(
            (bth, back.ext, back.payload.len()),
            (p.bth, p.ext, len),
            "a sent packet survives the wire"
        );
    }
}

/// Move `qp` to RESET (whatever state an input left it in) and connect it again.
fn reconnect(c: &VirtualNode, qp: u32, remote: RemoteQp, opts: ConnectOpts) -> crate::Result<()> {
    let reset = crate::qp::QpAttr {
        qp_state: QpState::Reset as u32,
        ..crate::qp::QpAttr::default()
    };
    c.modify_qp(qp, &reset, crate::qp::attr_mask::STATE)?;
    connect_qp(c, qp, remote, opts)
}

struct Harness {
    resp: VirtualNode,
    qp: u32,
    cq: u32,
    /// `PAD` canary bytes, the registered `MR_LEN` bytes, `PAD` canary bytes.
    mem: Arc<Vec<u8>>,
    lkey: u32,
    iova: u64,
}

fn bring_up(h: &Harness) {
    // The responder's peer is at `PEER`: its replies go there over UDP (in this harness: they
    // are dropped), and the fuzzed requests come from there.
    if h.resp.qp_state(h.qp).ok() != Some(QpState::Rts) {
        let remote = RemoteQp {
            qpn: PEER_QPN,
            psn: 0,
            ip: Some(PEER.ip()),
            node: PEER_NODE,
        };
        let _ = reconnect(&h.resp, h.qp, remote, ConnectOpts::default());
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
    let (resp, pd, cq, qp) = rc_node(4096, false);
    let mut mem = vec![CANARY; PAD + MR_LEN + PAD];
    mem[PAD..PAD + MR_LEN].fill(0);
    // The MR holds the buffer (with its canaries) until it is deregistered.
    let mem = Arc::new(mem);
    let range = UserMemory::owned_range(mem.clone(), PAD as u64, MR_LEN as u64).expect("range");
    let all = AccessFlags::LOCAL_WRITE
        | AccessFlags::REMOTE_WRITE
        | AccessFlags::REMOTE_READ
        | AccessFlags::REMOTE_ATOMIC;
    let mr = resp.mem().reg_mr_va(pd, range, all).expect("mr");
    let h = Harness {
        resp,
        qp,
        cq,
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
/// outside it), and the ICRC is recomputed unless bit 3 is set. The datagram comes from the
/// QP's remote address unless bit 4 is set (then from another local address: the receive
/// checks must drop it), and its P_Key is set to the default 0xFFFF unless bit 5 is set (then
/// the fuzzed one is checked). Bit 6 makes it segment `1 + len % 63` of a receive batch
/// (the ICRC then covers that IPv4 ID), and bits 7 and 3 together check the ICRC as given in
/// solve mode. The rest is the datagram.
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
            if mode & 0x20 == 0 {
                d[2..4].copy_from_slice(&crate::wire::DEFAULT_PKEY.to_be_bytes());
            }
            if mode & 4 != 0 && d.len() >= 28 {
                // RETH/AtomicETH start right after the BTH for requests that carry them.
                let off = u64::from(u16::from_be_bytes([d[12], d[13]])) % (MR_LEN as u64 + 64);
                let va = (h.iova + off).wrapping_sub(32);
                d[12..20].copy_from_slice(&va.to_be_bytes());
                d[20..24].copy_from_slice(&h.lkey.to_be_bytes());
            }
        }
        let src = if mode & 0x10 == 0 { PEER } else { STRANGER };
        let dst = DST;
        // Bit 6: the datagram arrives as segment 1..=63 of a receive batch (exact check with
        // that ID); bit 7 (with bit 3: the ICRC as given) checks it in solve mode.
        let seg = if mode & 0x40 != 0 {
            1 + d.len() % 63
        } else {
            0
        };
        let icrc_mode = if mode & 0x88 == 0x88 {
            crate::wire::Ipv4IcrcMode::Solve
        } else {
            crate::wire::Ipv4IcrcMode::Exact
        };
        if mode & 8 == 0 && d.len() >= 16 {
            let inputs = IcrcInputs::from_socket_addrs(src, dst)
                .with_ipv4_id(seg as u16, crate::wire::IPV4_FLAGS_DF);
            let _ = inputs.fill(&mut d);
        }
        if let Ok(p) = Pkt::from_wire_in_batch(&d, src, dst, h.resp.node_id(), seg, icrc_mode) {
            h.resp.receive(p);
        }
        // A millisecond per input (settle panics if the runs do not converge).
        h.resp.advance(Duration::from_millis(1));
        sent_to_peer(h.resp.settle());
        let mut wcs = Vec::new();
        while h.resp.poll_cq(h.cq, &mut wcs, 64).unwrap_or(0) > 0 {
            wcs.clear();
        }
        assert!(
            h.mem[..PAD].iter().all(|&b| b == CANARY)
                && h.mem[PAD + MR_LEN..].iter().all(|&b| b == CANARY),
            "a packet wrote outside the registered range"
        );
        bring_up(h);
    });
}

/// The requester side of [`fuzz_completer`]: one RC QP on the virtual clock whose peer does
/// not exist (its packets are dropped), and one registered buffer between canaries that is the source of
/// the SENDs/WRITEs and the target of READ data and atomic results.
struct ReqHarness {
    node: VirtualNode,
    qp: u32,
    cq: u32,
    /// `PAD` canary bytes, the registered `MR_LEN` bytes, `PAD` canary bytes.
    mem: Arc<Vec<u8>>,
    lkey: u32,
    iova: u64,
}

/// The peer QPN the requester talks to (it exists nowhere).
const GHOST_QPN: u32 = 0x77;
/// The QPN of the responder's peer (it exists nowhere either).
const PEER_QPN: u32 = 0x78;
/// A node id no node has: what is sent there is dropped.
const GHOST_NODE: u64 = u64::MAX - 1;
/// Send WQEs posted per input: SEND (3 packets at MTU 1024), WRITE, READ (3 responses),
/// FETCH_ADD, SEND. PSNs 0-2, 3, 4-6, 7, 8.
const BATCH: u64 = 5;

fn req_harness() -> ReqHarness {
    let (node, pd, cq, qp) = rc_node(4096, true);
    let mut mem = vec![CANARY; PAD + MR_LEN + PAD];
    mem[PAD..PAD + MR_LEN].fill(0);
    let mem = Arc::new(mem);
    let range = UserMemory::owned_range(mem.clone(), PAD as u64, MR_LEN as u64).expect("range");
    let mr = node
        .mem()
        .reg_mr_va(pd, range, AccessFlags::LOCAL_WRITE)
        .expect("mr");
    ReqHarness {
        node,
        qp,
        cq,
        mem,
        lkey: mr.lkey,
        iova: mr.iova,
    }
}

/// Reset the QP, connect it to the ghost peer and post [`BATCH`] WQEs (sent and dropped).
fn req_bring_up(h: &ReqHarness) {
    use crate::qp::{SendWr, WrOpcode};
    let remote = RemoteQp {
        qpn: GHOST_QPN,
        psn: 0,
        ip: Some(PEER.ip()),
        node: GHOST_NODE,
    };
    let opts = ConnectOpts {
        path_mtu: 3,
        sq_psn: 0,
        timeout: 10,
        retry_cnt: 2,
        rnr_retry: 2,
        ..ConnectOpts::default()
    };
    reconnect(&h.node, h.qp, remote, opts).expect("reset and connect");
    let sge = |off: u64, len: u32| Sge {
        addr: h.iova + off,
        length: len,
        lkey: h.lkey,
    };
    let mut send = SendWr::new(0, WrOpcode::Send);
    send.sg_list = vec![sge(0, 3000)];
    let mut write = SendWr::new(1, WrOpcode::RdmaWrite);
    write.sg_list = vec![sge(0, 100)];
    write.remote_addr = 0x1000;
    write.rkey = 0x1234;
    let mut read = SendWr::new(2, WrOpcode::RdmaRead);
    read.sg_list = vec![sge(4096, 2500)];
    read.remote_addr = 0x2000;
    read.rkey = 0x1234;
    let mut fadd = SendWr::new(3, WrOpcode::AtomicFetchAndAdd);
    fadd.sg_list = vec![sge(MR_LEN as u64 - 8, 8)];
    fadd.remote_addr = 0x3000;
    fadd.rkey = 0x1234;
    fadd.compare_add = 1;
    let mut last = SendWr::new(4, WrOpcode::Send);
    last.sg_list = vec![sge(8192, 10)];
    h.node
        .post_send(h.qp, &[send, write, read, fadd, last])
        .expect("post");
    settle(&h.node);
}

/// Run the node until idle at its virtual time; what it sends goes to the ghost peer
/// ([`sent_to_peer`]). Panics if the runs do not converge.
fn settle(node: &VirtualNode) {
    sent_to_peer(node.settle());
}

thread_local! {
    static R: RefCell<Option<ReqHarness>> = const { RefCell::new(None) };
}

/// Feed one fuzz input to a requester with `BATCH` WQEs outstanding. The input is a list of
/// 6-byte records `[kind, psn, syndrome, len, x, y]`: kind 0 is an ACK/NAK (AETH syndrome
/// byte as given), 1-4 a READ response first/middle/last/only with `len * 8 + y % 8` payload
/// bytes,
/// 5 an atomic ACK, 6 lets `syndrome` × 10 ms pass (retransmission and RNR timers), 7 sends
/// the rest of the input as a raw datagram. PSNs are taken modulo 16 so that most fall in or
/// near the window (0-8). Bit 3 of `kind` sends the packet from another local address than
/// the QP's remote (the receive checks must drop it), bit 4 gives it the P_Key `[x, y]`
/// instead of the default 0xFFFF. Returns the completions (for tests of the harness itself).
pub fn fuzz_completer(data: &[u8]) -> Vec<crate::cq::Wc> {
    use crate::wire::{Aeth, AtomicAckEth, Opcode, PacketBuilder};
    R.with(|cell| {
        let mut g = cell.borrow_mut();
        let h = g.get_or_insert_with(req_harness);
        req_bring_up(h);
        let mut rest = data;
        while rest.len() >= 6 {
            let (r, tail) = rest.split_at(6);
            rest = tail;
            let src = if r[0] & 8 == 0 { PEER } else { STRANGER };
            let inputs = IcrcInputs::from_socket_addrs(src, DST);
            let pkey = if r[0] & 0x10 == 0 {
                crate::wire::DEFAULT_PKEY
            } else {
                u16::from_be_bytes([r[4], r[5]])
            };
            let psn = u32::from(r[1] % 16);
            let aeth = Aeth {
                syndrome: r[2],
                msn: u32::from(r[4]),
            };
            let dgram = match r[0] % 8 {
                0 => PacketBuilder::new(Opcode::Acknowledge, h.qp, psn)
                    .pkey(pkey)
                    .aeth(aeth)
                    .to_vec(&[], &inputs),
                k @ 1..=4 => {
                    let op = [
                        Opcode::RdmaReadResponseFirst,
                        Opcode::RdmaReadResponseMiddle,
                        Opcode::RdmaReadResponseLast,
                        Opcode::RdmaReadResponseOnly,
                    ][usize::from(k - 1)];
                    let mut b = PacketBuilder::new(op, h.qp, psn).pkey(pkey);
                    if op.info().headers.contains(crate::wire::HeaderSet::AETH) {
                        b = b.aeth(aeth);
                    }
                    let len = usize::from(r[3]) * 8 + usize::from(r[5] % 8);
                    b.to_vec(&vec![r[5]; len], &inputs)
                }
                5 => PacketBuilder::new(Opcode::AtomicAcknowledge, h.qp, psn)
                    .pkey(pkey)
                    .aeth(aeth)
                    .atomic_ack_eth(AtomicAckEth {
                        orig: u64::from_le_bytes([r[3], r[4], r[5], 0, 0, 0, 0, 1]),
                    })
                    .to_vec(&[], &inputs),
                6 => {
                    h.node.advance(Duration::from_millis(u64::from(r[2]) * 10));
                    settle(&h.node);
                    continue;
                }
                _ => {
                    let raw = std::mem::take(&mut rest).to_vec();
                    Ok(raw)
                }
            };
            if let Ok(d) = dgram {
                if let Ok(p) = Pkt::from_wire(&d, src, DST, h.node.node_id()) {
                    h.node.receive(p);
                }
            }
            settle(&h.node);
        }
        let mut wcs = Vec::new();
        while h.node.poll_cq(h.cq, &mut wcs, 64).unwrap_or(0) > 0 {}
        let ids: Vec<u64> = wcs.iter().map(|w| w.wr_id).collect();
        assert!(
            ids.len() as u64 <= BATCH && ids.windows(2).all(|w| w[0] < w[1]),
            "completions must be unique and in order: {wcs:?}"
        );
        assert!(
            h.mem[..PAD].iter().all(|&b| b == CANARY)
                && h.mem[PAD + MR_LEN..].iter().all(|&b| b == CANARY),
            "a response wrote outside the registered range"
        );
        wcs
    })
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
                harness_input(mode, b, &pl).unwrap_or_else(|| vec![mode])
            })
    }

    /// A harness input: the mode byte, then `b`'s datagram with `payload` and the ICRC of a
    /// packet from 127.1.1.1:0xc001 to 127.1.1.2:4791 (`None` when `b` cannot build it).
    fn harness_input(mode: u8, b: PacketBuilder, payload: &[u8]) -> Option<Vec<u8>> {
        let inputs = IcrcInputs::ipv4(
            Ipv4Addr::new(127, 1, 1, 1),
            Ipv4Addr::new(127, 1, 1, 2),
            0xc001,
            4791,
        );
        let mut v = vec![mode];
        v.extend(b.to_vec(payload, &inputs).ok()?);
        Some(v)
    }

    fn statuses(data: &[u8]) -> Vec<(u64, crate::cq::WcStatus)> {
        fuzz_completer(data)
            .iter()
            .map(|w| (w.wr_id, w.status))
            .collect()
    }

    /// The completer harness is not vacuous: well-formed responses complete every WQE, time
    /// alone exhausts the retries, and a NAK only causes a retry.
    #[test]
    fn completer_harness_reaches_success_and_retry_exhaustion() {
        use crate::cq::WcStatus::*;
        let ok = [
            0, 3, 0x1f, 0, 0, 0, // ACK PSN 3: SEND (0-2) and WRITE (3)
            1, 4, 0x1f, 128, 0, 0, // READ response first, 1024 bytes
            2, 5, 0x1f, 128, 0, 0, // middle, 1024 bytes
            3, 6, 0x1f, 56, 0, 4, // last, 452 bytes
            5, 7, 0x1f, 1, 2, 3, // atomic ACK
            0, 8, 0x1f, 0, 0, 0, // ACK PSN 8: the last SEND
        ];
        assert_eq!(
            statuses(&ok),
            [
                (0, Success),
                (1, Success),
                (2, Success),
                (3, Success),
                (4, Success)
            ]
        );
        let time_only = [6, 0, 200, 0, 0, 0].repeat(3);
        assert_eq!(
            statuses(&time_only),
            [
                (0, RetryExcErr),
                (1, WrFlushErr),
                (2, WrFlushErr),
                (3, WrFlushErr),
                (4, WrFlushErr)
            ]
        );
        assert_eq!(statuses(&[0, 1, 0x60, 0, 0, 0]), []);
    }

    /// The receive checks run on fuzzed input: an ACK from another local address, or with a
    /// P_Key of another partition, completes nothing; with the default partition's limited
    /// P_Key from the QP's remote address it completes the SEND and the WRITE.
    #[test]
    fn fuzzed_responses_go_through_the_receive_checks() {
        use crate::cq::WcStatus::*;
        assert_eq!(statuses(&[8, 3, 0x1f, 0, 0, 0]), []);
        assert_eq!(statuses(&[16, 3, 0x1f, 0, 0x12, 0x34]), []);
        assert_eq!(statuses(&[8 | 16, 3, 0x1f, 0, 0xff, 0xff]), []);
        assert_eq!(
            statuses(&[16, 3, 0x1f, 0, 0x7f, 0xff]),
            [(0, Success), (1, Success)]
        );
    }

    /// Fuzzed requests from another local address, or with a fuzzed P_Key, are dropped and
    /// counted by the responder's device.
    #[test]
    fn fuzzed_requests_go_through_the_receive_checks() {
        let write = |mode: u8, pkey: u16| {
            let reth = Reth {
                va: 0,
                rkey: 0,
                dma_len: 8,
            };
            let b = PacketBuilder::new(Opcode::RdmaWriteOnly, 0, 0)
                .pkey(pkey)
                .reth(reth);
            harness_input(mode, b, &[0xEE; 8]).unwrap()
        };
        let stats = || H.with(|h| h.borrow().as_ref().map(|h| h.resp.net_stats()).unwrap());
        fuzz_responder(&write(0x7, 0xFFFF));
        let s0 = stats();
        fuzz_responder(&write(0x7 | 0x10, 0xFFFF)); // from a stranger
        fuzz_responder(&write(0x7 | 0x20, 0x1234)); // another partition
        fuzz_responder(&write(0x7 | 0x20, 0xFFFF)); // the default one, fuzzed: passes
        let s1 = stats();
        assert_eq!(s1.rx_drop_src_addr, s0.rx_drop_src_addr + 1, "{s1:?}");
        assert_eq!(s1.rx_drop_pkey, s0.rx_drop_pkey + 1, "{s1:?}");
    }

    /// The responder harness is not vacuous: a repaired RDMA WRITE (QPN, PSN and RETH aimed
    /// at the buffer) lands in the registered range, at the offset the harness aims it.
    #[test]
    fn responder_harness_places_a_repaired_write_in_the_mr() {
        let reth = Reth {
            // Bytes 12-13 of the datagram (0x0100) choose offset 256 - 32 into the MR.
            va: 0x0100_0000_0000_0000,
            rkey: 0,
            dma_len: 8,
        };
        let b = PacketBuilder::new(Opcode::RdmaWriteOnly, 0, 0).reth(reth);
        fuzz_responder(&harness_input(0x7, b, &[0xEE; 8]).unwrap());
        H.with(|h| {
            let g = h.borrow();
            let m = &g.as_ref().unwrap().mem;
            assert_eq!(m[PAD + 224..PAD + 232], [0xEE; 8]);
            assert!(m[PAD..PAD + 224].iter().all(|&b| b == 0));
        });
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

        #[test]
        fn random_responses_complete_each_wqe_at_most_once(
            data in proptest::collection::vec(any::<u8>(), 0..120)
        ) {
            fuzz_completer(&data);
        }

        #[test]
        fn response_records_near_the_window_complete_each_wqe_at_most_once(
            recs in proptest::collection::vec(
                (0u8..7, 0u8..12, prop::sample::select(vec![0x1f, 0x00, 0x21, 0x3f, 0x60, 0x61, 0x62, 0x63, 0x64, 0x70]), 0u8..200, any::<u8>(), any::<u8>()),
                0..24,
            )
        ) {
            let data: Vec<u8> = recs
                .iter()
                .flat_map(|r| [r.0, r.1, r.2, r.3, r.4, r.5])
                .collect();
            fuzz_completer(&data);
        }
    }
}
