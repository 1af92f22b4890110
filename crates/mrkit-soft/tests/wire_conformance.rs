//! Wire conformance: capture mrkit0's RoCEv2 traffic on loopback with tshark, decode it with
//! Wireshark's InfiniBand dissector, and check opcode, QPN, PSN, RETH fields, IP ID/DF, the UDP
//! source port, and the ICRC (recomputed with the project's own checker) for every opcode the
//! device sends. Needs root (capture) and tshark (installed by scripts/test.sh); without them
//! the test says SKIP loudly and fails if `MRKIT_REQUIRE_TSHARK=1` (set by CI).

mod common;

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{all, connect_udp, ctx_with, host_with, poll_n, BufHost};
use mrkit_soft::cq::{Wc, WcStatus};
use mrkit_soft::mw::BindInfo;
use mrkit_soft::qp::connect::ConnectOpts;
use mrkit_soft::qp::{BindWr, RecvWr, SendWr, WrOpcode};
use mrkit_soft::wire::{udp_sport_for_qpn, IcrcInputs, Opcode};
use mrkit_soft::{AccessFlags, DeviceConfig, MwType};

/// A device bound to `ip` (GSO off: one datagram per packet on the wire), CQ of 1024,
/// sq_sig_all on, a 64 KiB buffer that also allows binding windows.
fn host(ip: Ipv4Addr) -> BufHost {
    let cfg = DeviceConfig::rxe()
        .gso(false)
        .udp_addr((IpAddr::V4(ip), 4791).into());
    host_with(ctx_with(cfg, false), 1024, true).with_buf(1 << 16, all() | AccessFlags::MW_BIND)
}

/// Exactly `n` completions of `h` within 10 s.
fn poll(h: &BufHost, n: usize) -> Vec<Wc> {
    let out = poll_n(h, n, Duration::from_secs(10));
    assert_eq!(out.len(), n, "completions");
    out
}

fn skip(why: &str) {
    eprintln!("SKIP wire_conformance: {why}");
    assert!(
        std::env::var("MRKIT_REQUIRE_TSHARK").is_err(),
        "MRKIT_REQUIRE_TSHARK is set but the capture test cannot run: {why}"
    );
}

const NOHEUR: [&str; 8] = [
    "rpcrdma_infiniband",
    "smb_direct_infiniband",
    "smcr_infiniband",
    "iser_infiniband",
    "sdp_infiniband",
    "fc_infiniband",
    "eth_over_ib",
    "lnet_ib",
];

#[test]
fn every_opcode_on_the_wire_decodes_and_checks() {
    if Command::new("tshark").arg("--version").output().is_err() {
        return skip("tshark is not installed (scripts/test.sh installs it)");
    }
    if !rustix::process::geteuid().is_root() {
        return skip("capturing needs root");
    }
    let pid = std::process::id();
    let ip_a = Ipv4Addr::new(127, 211, (pid >> 8) as u8, pid as u8 | 1);
    let ip_b = Ipv4Addr::new(127, 212, (pid >> 8) as u8, pid as u8 | 1);
    // In a private directory: the capture (written by root) and its log must not follow a
    // file planted under a predictable name.
    let scratch = tempfile::tempdir().unwrap();
    let pcap = scratch.path().join("capture.pcap");
    let log = scratch.path().join("tshark.log");
    let filter = format!("udp port 4791 and host {ip_a} and host {ip_b}");
    let mut cap = Command::new("tshark")
        .args(["-i", "lo", "-f", &filter, "-w"])
        .arg(&pcap)
        .args(["-F", "pcap"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let end = Instant::now() + Duration::from_secs(20);
    // "Capturing on" is printed before the capture really runs; wait for "Capture started"
    // (and a little more) so the first packets are not missed.
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("Capture started")
    {
        assert!(
            Instant::now() < end,
            "tshark did not start: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));

    let mut a = host(ip_a);
    let b = host(ip_b);
    connect_udp(
        &a,
        &b,
        ConnectOpts {
            path_mtu: 3, // 1024: multi-packet messages from 3000 bytes
            sq_psn: 100, // both sides start at PSN 100
            ..ConnectOpts::default()
        },
    );
    a.buf.iter_mut().enumerate().for_each(|(i, v)| *v = i as u8);
    // Receives for SENDs and WRITE_WITH_IMMs.
    let recvs: Vec<RecvWr> = (0..7)
        .map(|i| RecvWr {
            wr_id: 500 + i,
            sg_list: b.sge(8192 * (1 + i % 4), 4096),
        })
        .collect();
    b.ctx.post_recv(b.qp, &recvs).unwrap();
    // A type-2 window on b, bound by b's QP, for SEND_WITH_INV.
    let w = b.ctx.alloc_mw(b.pd, MwType::Type2).unwrap();
    let mut bind = SendWr::new(900, WrOpcode::BindMw);
    bind.bind = Some(BindWr {
        mw_rkey: w,
        new_key: 7,
        info: BindInfo {
            mr_lkey: b.mr.lkey,
            addr: b.mr.iova,
            length: 4096,
            access: AccessFlags::REMOTE_READ,
        },
    });
    b.ctx.post_send(b.qp, &[bind]).unwrap();
    assert_eq!(poll(&b, 1)[0].status, WcStatus::Success);
    let window_rkey = (w & !0xff) | 7;

    let rdma = |op: WrOpcode, id: u64, len: u32| {
        let mut wr = SendWr::new(id, op);
        wr.sg_list = a.sge(0, len);
        wr.remote_addr = b.mr.iova;
        wr.rkey = b.mr.rkey;
        wr
    };
    let mut wrs = vec![
        rdma(WrOpcode::RdmaWrite, 1, 3000), // WRITE FIRST / MIDDLE / LAST
        rdma(WrOpcode::RdmaWrite, 2, 100),  // WRITE ONLY
        rdma(WrOpcode::RdmaWriteWithImm, 3, 3000), // ... LAST WITH IMM
        rdma(WrOpcode::RdmaWriteWithImm, 4, 100), // ... ONLY WITH IMM
    ];
    for (id, op, len) in [
        (5, WrOpcode::Send, 3000),
        (6, WrOpcode::Send, 100),
        (7, WrOpcode::SendWithImm, 3000),
        (8, WrOpcode::SendWithImm, 100),
        (9, WrOpcode::SendWithInv, 100),
    ] {
        let mut s = SendWr::new(id, op);
        s.sg_list = a.sge(0, len);
        s.imm_data = 0xabcd;
        s.invalidate_rkey = window_rkey;
        wrs.push(s);
    }
    let mut r = rdma(WrOpcode::RdmaRead, 10, 3000); // READ REQUEST + RESPONSE FIRST/MIDDLE/LAST
    r.sg_list = a.sge(16384, 3000);
    wrs.push(r);
    let mut r = rdma(WrOpcode::RdmaRead, 11, 100); // RESPONSE ONLY
    r.sg_list = a.sge(20480, 100);
    wrs.push(r);
    let mut c = rdma(WrOpcode::AtomicCmpAndSwp, 12, 8);
    c.sg_list = a.sge(24576, 8);
    wrs.push(c);
    let mut f = rdma(WrOpcode::AtomicFetchAndAdd, 13, 8);
    f.sg_list = a.sge(24584, 8);
    f.compare_add = 3;
    wrs.push(f);
    a.ctx.post_send(a.qp, &wrs).unwrap();
    let wcs = poll(&a, wrs.len());
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    // RNR NAK: a SEND with no receive posted, then the receive arrives.
    let wcs = poll(&b, 7);
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    let mut s = SendWr::new(14, WrOpcode::Send);
    s.sg_list = a.sge(0, 64);
    a.ctx.post_send(a.qp, &[s]).unwrap();
    // b's 7 receives completed above (5 SENDs, 2 WRITE_WITH_IMM); none is left for it.
    std::thread::sleep(Duration::from_millis(5));
    b.ctx
        .post_recv(
            b.qp,
            &[RecvWr {
                wr_id: 600,
                sg_list: b.sge(40960, 4096),
            }],
        )
        .unwrap();
    assert_eq!(poll(&a, 1)[0].status, WcStatus::Success);
    // NAK remote access error: a WRITE with a bad rkey (last: the QPs go to ERR).
    let mut bad = rdma(WrOpcode::RdmaWrite, 15, 64);
    bad.rkey ^= 0x100;
    a.ctx.post_send(a.qp, &[bad]).unwrap();
    assert_eq!(poll(&a, 1)[0].status, WcStatus::RemAccessErr);
    std::thread::sleep(Duration::from_millis(300));
    let _ = Command::new("kill")
        .args(["-INT", &cap.id().to_string()])
        .status();
    let _ = cap.wait();

    // Decode.
    let mut args: Vec<String> = vec!["-r".into(), pcap.display().to_string()];
    for h in NOHEUR {
        args.push("--disable-heuristic".into());
        args.push(h.into());
    }
    args.extend(
        [
            "-Y",
            "infiniband",
            "-T",
            "fields",
            "-E",
            "separator=,",
            "-E",
            "occurrence=f",
            "-e",
            "ip.src",
            "-e",
            "ip.dst",
            "-e",
            "ip.id",
            "-e",
            "ip.flags.df",
            "-e",
            "udp.srcport",
            "-e",
            "udp.dstport",
            "-e",
            "infiniband.bth.opcode",
            "-e",
            "infiniband.bth.destqp",
            "-e",
            "infiniband.bth.psn",
            "-e",
            "infiniband.reth.va",
            "-e",
            "infiniband.reth.r_key",
            "-e",
            "infiniband.reth.dmalen",
            "-e",
            "infiniband.aeth.syndrome",
            "-e",
            "udp.payload",
        ]
        .map(String::from),
    );
    let out = Command::new("tshark").args(&args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "tshark decode failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    if std::env::var("MRKIT_KEEP_PCAP").is_ok() {
        // Kept for inspection (otherwise removed with the directory).
        eprintln!("capture kept: {}", pcap.display());
        let _ = scratch.keep();
    }

    let mut seen = BTreeSet::new();
    let mut syndromes = BTreeSet::new();
    let mut n = 0;
    let mut first_write_reth = None;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split(',').collect();
        assert_eq!(f.len(), 14, "{line}");
        let (src, dst): (Ipv4Addr, Ipv4Addr) = (f[0].parse().unwrap(), f[1].parse().unwrap());
        assert_eq!(
            f[2], "0x0000",
            "IP ID 0 (unconnected socket, PMTU probe): {line}"
        );
        assert_eq!(f[3], "1", "DF set: {line}");
        let sport: u16 = f[4].parse().unwrap();
        assert_eq!(f[5], "4791");
        let opcode: u8 = f[6].parse().unwrap();
        let op = Opcode::from_u8(opcode).unwrap_or_else(|_| panic!("unknown opcode {opcode}"));
        let destqp = u32::from_str_radix(f[7].trim_start_matches("0x"), 16).unwrap();
        let (src_qp, dst_qp) = if src == ip_a {
            (a.qp, b.qp)
        } else {
            (b.qp, a.qp)
        };
        assert!(
            src == ip_a && dst == ip_b || src == ip_b && dst == ip_a,
            "{line}"
        );
        assert_eq!(destqp, dst_qp, "DestQP: {line}");
        assert_eq!(
            sport,
            udp_sport_for_qpn(src_qp),
            "UDP source port from the QPN: {line}"
        );
        let psn: u32 = f[8].parse().unwrap();
        assert!(
            (100..1100).contains(&psn),
            "PSN from the agreed start: {line}"
        );
        if op == Opcode::RdmaWriteFirst && first_write_reth.is_none() {
            first_write_reth = Some((f[9].to_string(), f[10].to_string(), f[11].to_string(), psn));
        }
        if !f[12].is_empty() {
            syndromes.insert(match f[12].strip_prefix("0x") {
                Some(hex) => u8::from_str_radix(hex, 16).unwrap(),
                None => f[12].parse::<u8>().unwrap(), // tshark prints the syndrome in decimal
            });
        }
        // ICRC with our own checker, from what the capture shows.
        let payload: Vec<u8> = (0..f[13].len() / 2)
            .map(|i| u8::from_str_radix(&f[13][2 * i..2 * i + 2], 16).unwrap())
            .collect();
        let inputs = IcrcInputs::ipv4(src, dst, sport, 4791);
        assert!(inputs.verify(&payload).is_ok(), "ICRC mismatch: {line}");
        seen.insert(opcode);
        n += 1;
    }
    assert!(n > 20, "too few packets captured ({n}):\n{text}");
    let (va, rkey, len, psn) = first_write_reth.expect("a WRITE FIRST was captured");
    assert_eq!(
        u64::from_str_radix(va.trim_start_matches("0x"), 16).unwrap(),
        b.mr.iova
    );
    assert_eq!(
        u32::from_str_radix(rkey.trim_start_matches("0x"), 16).unwrap(),
        b.mr.rkey
    );
    assert_eq!(len, "3000");
    assert_eq!(psn, 100, "the first WRITE starts at the agreed PSN");
    use Opcode::*;
    let want = [
        SendFirst,
        SendMiddle,
        SendLast,
        SendLastWithImmediate,
        SendOnly,
        SendOnlyWithImmediate,
        SendOnlyWithInvalidate,
        RdmaWriteFirst,
        RdmaWriteMiddle,
        RdmaWriteLast,
        RdmaWriteLastWithImmediate,
        RdmaWriteOnly,
        RdmaWriteOnlyWithImmediate,
        RdmaReadRequest,
        RdmaReadResponseFirst,
        RdmaReadResponseMiddle,
        RdmaReadResponseLast,
        RdmaReadResponseOnly,
        Acknowledge,
        AtomicAcknowledge,
        CompareSwap,
        FetchAdd,
    ];
    for op in want {
        assert!(
            seen.contains(&op.as_u8()),
            "{op:?} never seen on the wire: {seen:?}"
        );
    }
    assert!(
        syndromes.iter().any(|s| s & 0xe0 == 0x20),
        "an RNR NAK was sent: {syndromes:?}"
    );
    assert!(
        syndromes.contains(&0x62),
        "a remote-access NAK was sent: {syndromes:?}"
    );
    assert!(
        syndromes.iter().any(|s| s & 0xe0 == 0),
        "ACKs were sent: {syndromes:?}"
    );
}
