//! Receive-side checks against a hostile local sender: a plain UDP socket sends crafted,
//! ICRC-valid RoCEv2 packets (WRITE, READ, atomics, out-of-sequence requests, ACKs) at a live
//! RC connection between two device instances. Packets from another address than the QP's
//! remote, with a wrong P_Key, or for a QP whose state does not take them are dropped and
//! counted; nothing executes, and the connection keeps working. A forged ACK does not complete
//! a WRITE that was never delivered.
mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use common::{all, connect_udp, ctx_with, host_with_cap, init, poll_n, udp_ip, BufHost};
use mrkit_soft::cq::WcStatus;
use mrkit_soft::net::udp::{NetStatsSnapshot, ROCE_PORT};
use mrkit_soft::qp::connect::{connect_qp, ConnectOpts, RemoteQp};
use mrkit_soft::qp::{attr_mask, send_flags, QpAttr, QpCap, QpState, SendWr, WrOpcode};
use mrkit_soft::wire::{Aeth, AtomicEth, IcrcInputs, Opcode, PacketBuilder, Reth};
use mrkit_soft::DeviceConfig;

const LEN: usize = 64 << 10;

fn host() -> BufHost {
    let cap = QpCap {
        max_send_wr: 64,
        max_recv_wr: 64,
        ..QpCap::default()
    };
    host_with_cap(ctx_with(DeviceConfig::rxe(), false), 256, cap, false).with_buf(LEN, all())
}

/// A UDP socket bound to `ip` (any port), configured like a RoCEv2 sender (ID 0 with DF).
fn hostile(ip: IpAddr) -> UdpSocket {
    let s = UdpSocket::bind(SocketAddr::new(ip, 0)).expect("bind the hostile socket");
    mrkit_soft::sockio::configure(&s, false).unwrap();
    s.set_nonblocking(true).unwrap();
    s
}

/// Send `b` (a packet built without its ICRC inputs) from `s` to `to`, ICRC computed for
/// that path.
fn send(s: &UdpSocket, to: IpAddr, b: PacketBuilder, payload: &[u8]) {
    let dst = SocketAddr::new(to, ROCE_PORT);
    let inputs = IcrcInputs::from_socket_addrs(s.local_addr().unwrap(), dst);
    let d = b.to_vec(payload, &inputs).unwrap();
    s.send_to(&d, dst).unwrap();
}

/// Wait until `f(stats)` holds (the progress thread receives), at most 10 s.
fn wait_stats(h: &BufHost, what: &str, f: impl Fn(&NetStatsSnapshot) -> bool) {
    let end = Instant::now() + Duration::from_secs(10);
    while !f(&h.ctx.net_stats()) {
        assert!(
            Instant::now() < end,
            "{what}: not seen within 10 s: {:?}",
            h.ctx.net_stats()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The hostile requests: WRITE ONLY, WRITE MIDDLE (out of sequence: would put the QP in
/// ERR), READ, FETCH_ADD and COMPARE_SWAP, all aimed at `b`'s buffer with its real R_Key and
/// the PSN `b` expects next (`psn`), P_Key `pkey`.
fn requests(b: &BufHost, psn: u32, pkey: u16) -> Vec<(PacketBuilder, Vec<u8>)> {
    let reth = Reth {
        va: b.mr.iova,
        rkey: b.mr.rkey,
        dma_len: 64,
    };
    let atomic = |swap_add| AtomicEth {
        va: b.mr.iova,
        rkey: b.mr.rkey,
        swap_add,
        compare: 0,
    };
    let p = |op| PacketBuilder::new(op, b.qp, psn).pkey(pkey).ack_req(true);
    vec![
        (p(Opcode::RdmaWriteOnly).reth(reth), vec![0xEE; 64]),
        (p(Opcode::RdmaWriteMiddle), vec![0xEE; 4096]),
        (p(Opcode::RdmaReadRequest).reth(reth), Vec::new()),
        (p(Opcode::FetchAdd).atomic_eth(atomic(0x0101)), Vec::new()),
        (
            p(Opcode::CompareSwap).atomic_eth(atomic(0xDEAD)),
            Vec::new(),
        ),
    ]
}

/// One WRITE from `a` to `b` with a fresh pattern; checks it completes and, if `lands`, that
/// the bytes landed.
fn write_works(a: &mut BufHost, b: &BufHost, seed: u8, lands: bool) {
    let off = 4096usize;
    for (i, x) in a.buf[off..off + 4096].iter_mut().enumerate() {
        *x = (i as u8).wrapping_mul(13).wrapping_add(seed);
    }
    let mut w = SendWr::new(u64::from(seed), WrOpcode::RdmaWrite);
    w.sg_list = a.sge(off as u64, 4096);
    w.remote_addr = b.mr.iova + off as u64;
    w.rkey = b.mr.rkey;
    w.flags |= send_flags::SIGNALED;
    a.ctx.post_send(a.qp, &[w]).unwrap();
    let wc = poll_n(a, 1, Duration::from_secs(10));
    assert_eq!(wc.len(), 1, "the connection still works");
    assert_eq!(wc[0].status, WcStatus::Success);
    assert_eq!(b.buf[off..off + 4096] == a.buf[off..off + 4096], lands);
}

/// Requests from another local address, and from the peer's address with a wrong P_Key, are
/// dropped and counted; nothing in `b`'s buffer changes, no reply leaves, and the connection
/// keeps carrying traffic (also after an out-of-sequence request that would have put the QP
/// in ERR).
#[test]
fn spoofed_requests_are_dropped_and_counted() {
    let mut a = host();
    let b = host();
    connect_udp(&a, &b, ConnectOpts::default());
    write_works(&mut a, &b, 1, true);
    let b_ip = udp_ip(&b);
    // b expects PSN 1 now (one single-packet WRITE arrived).
    let before = b.buf.clone();
    let s0 = b.ctx.net_stats();

    // 1. Another local address (right QPN, R_Key, PSN and P_Key).
    let other = hostile(IpAddr::V4(Ipv4Addr::new(127, 254, 254, 1)));
    let reqs = requests(&b, 1, 0xFFFF);
    for (p, payload) in &reqs {
        send(&other, b_ip, *p, payload);
    }
    let n = reqs.len() as u64;
    wait_stats(&b, "source-address drops", |s| {
        s.rx_drop_src_addr >= s0.rx_drop_src_addr + n
    });

    // 2. The peer's own address (another port: RoCE senders pick their source port), with
    //    P_Keys that do not match the port's 0xFFFF: another partition, the invalid P_Key,
    //    and a limited member of another partition.
    let same = hostile(udp_ip(&a));
    let mut sent = 0;
    for pkey in [0x1234u16, 0x0000, 0x8000, 0x7FFE] {
        for (p, payload) in requests(&b, 1, pkey) {
            send(&same, b_ip, p, &payload);
            sent += 1;
        }
    }
    wait_stats(&b, "P_Key drops", |s| {
        s.rx_drop_pkey >= s0.rx_drop_pkey + sent
    });

    std::thread::sleep(Duration::from_millis(50));
    let s1 = b.ctx.net_stats();
    assert_eq!(s1.rx_drop_src_addr, s0.rx_drop_src_addr + n, "{s1:?}");
    assert_eq!(s1.rx_drop_pkey, s0.rx_drop_pkey + sent, "{s1:?}");
    assert_eq!(
        s1.rx_bad_icrc + s1.rx_icrc_foreign_id,
        0,
        "ICRC-valid: {s1:?}"
    );
    assert!(b.buf == before, "a dropped request changed memory");
    assert_eq!(b.ctx.qp_state(b.qp).unwrap(), QpState::Rts);
    let mut buf = [0u8; 64];
    for s in [&other, &same] {
        assert!(
            s.recv_from(&mut buf).is_err(),
            "a reply reached the spoofer"
        );
    }
    // The drops reach the process-wide counters `mrkit stat` exports.
    let drops = mrkit_soft::stats::rx_drops().snapshot();
    let get = |k: &str| drops.iter().find(|(n, _)| *n == k).unwrap().1;
    assert!(get("rx_drop_src_addr") >= n && get("rx_drop_pkey") >= sent);

    // The connection is unharmed: a limited-member P_Key of the default partition (0x7FFF)
    // matches the port's full-member 0xFFFF, as on hardware, so a legitimate WRITE with it
    // from the peer's address executes.
    let legit = PacketBuilder::new(Opcode::RdmaWriteOnly, b.qp, 1)
        .pkey(0x7FFF)
        .reth(Reth {
            va: b.mr.iova + 60_000,
            rkey: b.mr.rkey,
            dma_len: 4,
        });
    let seen = b.ctx.net_stats().rx_datagrams;
    send(&same, b_ip, legit, &[1, 2, 3, 4]);
    wait_stats(&b, "the legitimate WRITE", |s| s.rx_datagrams > seen);
    // a's next PSN (1) is now a duplicate at b: a WRITE at PSN 1 is acknowledged without
    // executing (and its completion orders b's handling of the injected WRITE before the
    // check below); the one after it lands.
    write_works(&mut a, &b, 2, false);
    assert_eq!(
        b.buf[60_000..60_004],
        [1, 2, 3, 4],
        "the legitimate WRITE landed"
    );
    write_works(&mut a, &b, 3, true);
}

/// Packets for a QP in RESET, INIT or RTR (responses) are dropped and counted, even from
/// the QP's own remote address.
#[test]
fn packets_for_a_qp_in_the_wrong_state_are_dropped_and_counted() {
    let a = host();
    let b = host();
    let a_ip = udp_ip(&a);
    let b_ip = udp_ip(&b);
    let from_a = hostile(a_ip);
    // A second QP on b, in RESET.
    let (q, _) = b.ctx.create_qp(init(b.pd, b.cq, false)).unwrap();
    let s0 = b.ctx.net_stats();
    let reth = Reth {
        va: b.mr.iova,
        rkey: b.mr.rkey,
        dma_len: 8,
    };
    let write = PacketBuilder::new(Opcode::RdmaWriteOnly, q, 0).reth(reth);
    let ack = PacketBuilder::new(Opcode::Acknowledge, q, 0).aeth(Aeth::ack(1));
    send(&from_a, b_ip, write, &[0xEE; 8]);
    send(&from_a, b_ip, ack, &[]);
    wait_stats(&b, "RESET drops", |s| {
        s.rx_drop_qp_state >= s0.rx_drop_qp_state + 2
    });
    // INIT.
    let init = QpAttr {
        qp_state: QpState::Init as u32,
        qp_access_flags: all(),
        port_num: 1,
        ..QpAttr::default()
    };
    b.ctx
        .modify_qp(
            q,
            &init,
            attr_mask::STATE | attr_mask::PKEY_INDEX | attr_mask::PORT | attr_mask::ACCESS_FLAGS,
        )
        .unwrap();
    send(&from_a, b_ip, write, &[0xEE; 8]);
    send(&from_a, b_ip, ack, &[]);
    wait_stats(&b, "INIT drops", |s| {
        s.rx_drop_qp_state >= s0.rx_drop_qp_state + 4
    });
    assert!(
        b.buf[..8].iter().all(|x| *x == 0),
        "a dropped WRITE executed"
    );
    assert_eq!(b.ctx.qp_state(q).unwrap(), QpState::Init);
    let s = b.ctx.net_stats();
    assert_eq!(s.rx_drop_qp_state, s0.rx_drop_qp_state + 4, "{s:?}");
    assert_eq!(
        s.rx_unknown_qp + s.rx_drop_src_addr + s.rx_drop_pkey,
        0,
        "{s:?}"
    );
}

/// A forged ACK from another address (or with a wrong P_Key) does not complete a WRITE that
/// was never delivered; the same ACK from the QP's remote address does (the check, not the
/// test setup, stops the forgeries).
#[test]
fn a_forged_ack_does_not_complete_an_undelivered_write() {
    let a = host();
    // The QP's peer address: nothing listens there, so the WRITE is never delivered.
    let ghost_ip = IpAddr::V4(Ipv4Addr::new(127, 254, 254, 2));
    let ghost = hostile(ghost_ip);
    let remote = RemoteQp {
        qpn: 0x77,
        psn: 0,
        ip: Some(ghost_ip),
        node: 0,
    };
    let opts = ConnectOpts {
        timeout: 20, // ~4 s: no retransmission while the test runs
        ..ConnectOpts::default()
    };
    connect_qp(&a.ctx, a.qp, remote, opts).unwrap();
    let a_ip = udp_ip(&a);
    let mut w = SendWr::new(7, WrOpcode::RdmaWrite);
    w.sg_list = a.sge(0, 64);
    w.remote_addr = 0x1000;
    w.rkey = 0x1234;
    w.flags |= send_flags::SIGNALED;
    a.ctx.post_send(a.qp, &[w]).unwrap();
    // The WRITE went to the ghost's port 4791 (PSN 0), where nobody receives it.
    let s0 = a.ctx.net_stats();
    let ack = |pkey| {
        PacketBuilder::new(Opcode::Acknowledge, a.qp, 0)
            .pkey(pkey)
            .aeth(Aeth::ack(1))
    };
    let other = hostile(IpAddr::V4(Ipv4Addr::new(127, 254, 254, 3)));
    send(&other, a_ip, ack(0xFFFF), &[]);
    send(&ghost, a_ip, ack(0x1234), &[]);
    wait_stats(&a, "forged ACK drops", |s| {
        s.rx_drop_src_addr > s0.rx_drop_src_addr && s.rx_drop_pkey > s0.rx_drop_pkey
    });
    std::thread::sleep(Duration::from_millis(50));
    let mut wcs = Vec::new();
    a.ctx.poll_cq(a.cq, &mut wcs, 4).unwrap();
    assert!(wcs.is_empty(), "a forged ACK completed the WRITE: {wcs:?}");
    // The genuine peer's ACK completes it.
    send(&ghost, a_ip, ack(0xFFFF), &[]);
    let wc = poll_n(&a, 1, Duration::from_secs(10));
    assert_eq!(wc.len(), 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (7, WcStatus::Success));
}
