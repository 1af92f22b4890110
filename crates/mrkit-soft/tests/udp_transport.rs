//! RoCEv2 over real UDP sockets between two device instances in one process (each binds its
//! own 127.x.y.z:4791), with and without injected faults.
mod common;

use std::time::{Duration, Instant};

use common::{all, connect_udp, ctx_with, host_with_cap, poll_n, udp_ip, BufHost};
use mrkit_soft::cq::{WcOpcode, WcStatus};
use mrkit_soft::device::StatusModel;
use mrkit_soft::net::fault::FaultConfig;
use mrkit_soft::qp::connect::ConnectOpts;
use mrkit_soft::qp::{send_flags, QpCap, RecvWr, SendWr, Sge, WrOpcode};
use mrkit_soft::DeviceConfig;

const LEN: usize = 1 << 20;

/// Progress thread, CQ of 4096, 1024-deep queues, sq_sig_all off, a 1 MiB buffer.
fn host(cfg: DeviceConfig) -> BufHost {
    let cap = QpCap {
        max_send_wr: 1024,
        max_recv_wr: 1024,
        ..QpCap::default()
    };
    host_with_cap(ctx_with(cfg, false), 4096, cap, false).with_buf(LEN, all())
}

/// A device for the lossy tests: rxe's status model, whose `retry_cnt` 7 retries forever.
/// These tests are about exactly-once delivery and recovery, not the retry limit (the
/// `peer_death_*` tests are): with a ~1 ms timeout, the hardware model's seven retries end a
/// QP whenever a loaded 2-vCPU machine keeps a progress thread off the CPU for ~10 ms (seen
/// with a load average of 9: 100+ ms without a run).
fn lossy(faults: FaultConfig) -> DeviceConfig {
    DeviceConfig::rxe()
        .status_model(StatusModel::Rxe)
        .faults(faults)
}

fn pattern(seed: u8, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn write(a: &BufHost, b: &BufHost, wr_id: u64, off: u64, len: u32) -> SendWr {
    let mut w = SendWr::new(wr_id, WrOpcode::RdmaWrite);
    w.sg_list = vec![Sge {
        addr: a.mr.iova + off,
        length: len,
        lkey: a.mr.lkey,
    }];
    w.remote_addr = b.mr.iova + off;
    w.rkey = b.mr.rkey;
    w
}

#[test]
fn write_read_send_atomic_over_udp() {
    let mut a = host(DeviceConfig::rxe());
    let b = host(DeviceConfig::rxe());
    connect_udp(&a, &b, ConnectOpts::default());
    assert_ne!(udp_ip(&a), udp_ip(&b));
    let gid = a.ctx.query_gid().unwrap();
    assert_eq!(&gid[10..12], &[0xff, 0xff], "IPv4-mapped GID");

    // WRITE 256 KiB (64 packets at MTU 4096).
    let data = pattern(7, 256 << 10);
    a.buf[..data.len()].copy_from_slice(&data);
    a.ctx
        .post_send(a.qp, &[write(&a, &b, 1, 0, data.len() as u32)])
        .unwrap();
    let wc = poll_n(&a, 1, Duration::from_secs(10));
    assert_eq!(
        wc.len(),
        1,
        "a {:?} {:?} b {:?} {:?}",
        a.ctx.net_stats(),
        a.ctx.udp_addr(),
        b.ctx.net_stats(),
        b.ctx.udp_addr()
    );
    assert_eq!(wc[0].status, WcStatus::Success, "{wc:?}");
    assert_eq!(&b.buf[..data.len()], &data[..]);

    // READ it back into another part of a's buffer.
    let mut r = SendWr::new(2, WrOpcode::RdmaRead);
    r.sg_list = vec![Sge {
        addr: a.mr.iova + (512 << 10),
        length: 100_000,
        lkey: a.mr.lkey,
    }];
    r.remote_addr = b.mr.iova;
    r.rkey = b.mr.rkey;
    a.ctx.post_send(a.qp, &[r]).unwrap();
    let wc = poll_n(&a, 1, Duration::from_secs(10));
    assert_eq!(wc[0].status, WcStatus::Success, "{wc:?}");
    assert_eq!(&a.buf[512 << 10..(512 << 10) + 100_000], &data[..100_000]);

    // SEND with immediate into a posted receive.
    let recv_off = 768u64 << 10;
    b.ctx
        .post_recv(
            b.qp,
            &[RecvWr {
                wr_id: 9,
                sg_list: vec![Sge {
                    addr: b.mr.iova + recv_off,
                    length: 8192,
                    lkey: b.mr.lkey,
                }],
            }],
        )
        .unwrap();
    let msg = pattern(3, 5000);
    a.buf[..5000].copy_from_slice(&msg);
    let mut s = SendWr::new(3, WrOpcode::SendWithImm);
    s.sg_list = vec![Sge {
        addr: a.mr.iova,
        length: 5000,
        lkey: a.mr.lkey,
    }];
    s.imm_data = 0x1234_5678;
    s.flags |= send_flags::SOLICITED;
    a.ctx.post_send(a.qp, &[s]).unwrap();
    assert_eq!(
        poll_n(&a, 1, Duration::from_secs(10))[0].status,
        WcStatus::Success
    );
    let rw = poll_n(&b, 1, Duration::from_secs(10));
    assert_eq!(rw[0].status, WcStatus::Success);
    assert_eq!(rw[0].opcode, WcOpcode::Recv);
    assert_eq!(rw[0].byte_len, 5000);
    assert_eq!(rw[0].imm_data, 0x1234_5678);
    let ro = recv_off as usize;
    assert_eq!(&b.buf[ro..ro + 5000], &msg[..]);

    // FETCH_AND_ADD on b's first 8 bytes.
    let before = u64::from_ne_bytes(b.buf[..8].try_into().unwrap());
    let mut f = SendWr::new(4, WrOpcode::AtomicFetchAndAdd);
    f.sg_list = vec![Sge {
        addr: a.mr.iova + 8,
        length: 8,
        lkey: a.mr.lkey,
    }];
    f.remote_addr = b.mr.iova;
    f.rkey = b.mr.rkey;
    f.compare_add = 5;
    a.ctx.post_send(a.qp, &[f]).unwrap();
    assert_eq!(
        poll_n(&a, 1, Duration::from_secs(10))[0].status,
        WcStatus::Success
    );
    assert_eq!(u64::from_ne_bytes(a.buf[8..16].try_into().unwrap()), before);
    assert_eq!(
        u64::from_ne_bytes(b.buf[..8].try_into().unwrap()),
        before + 5
    );

    let (na, nb) = (a.ctx.net_stats(), b.ctx.net_stats());
    assert!(
        na.tx_datagrams >= 64 && nb.rx_datagrams >= 64,
        "{na:?} {nb:?}"
    );
    assert_eq!(
        nb.rx_bad_icrc + nb.rx_malformed + na.rx_bad_icrc + na.rx_malformed,
        0
    );
    let _ = (a.pd, b.pd);
}

/// Request/response traffic long enough for both sides to switch receive offload off (and
/// receive with plain `recvfrom`), then bulk transfers that switch it back on, then small
/// round trips again: every byte lands, nothing is misparsed.
#[test]
fn round_trips_then_bulk_then_round_trips() {
    let mut a = host(DeviceConfig::rxe());
    let b = host(DeviceConfig::rxe());
    connect_udp(&a, &b, ConnectOpts::default());
    let round_trips = |a: &mut BufHost, b: &BufHost, seed: u8, n: u64| {
        for i in 0..n {
            let v = u64::from(seed) << 56 | i;
            let off = (i % 1024) * 8;
            a.buf[off as usize..off as usize + 8].copy_from_slice(&v.to_ne_bytes());
            let mut w = write(a, b, i, off, 8);
            w.flags |= send_flags::SIGNALED;
            a.ctx.post_send(a.qp, &[w]).unwrap();
            let wc = poll_n(a, 1, Duration::from_secs(10));
            assert_eq!(wc.len(), 1, "round trip {i}");
            assert_eq!(wc[0].status, WcStatus::Success);
            let got = u64::from_ne_bytes(b.buf[off as usize..off as usize + 8].try_into().unwrap());
            assert_eq!(got, v, "round trip {i}");
        }
    };
    round_trips(&mut a, &b, 1, 300);
    // Bulk: a 1 MiB WRITE (GSO runs of MTU packets), then half of it READ back.
    let data = pattern(11, LEN);
    a.buf.copy_from_slice(&data);
    let mut w = write(&a, &b, 1000, 0, LEN as u32);
    w.flags |= send_flags::SIGNALED;
    a.ctx.post_send(a.qp, &[w]).unwrap();
    let wc = poll_n(&a, 1, Duration::from_secs(10));
    assert_eq!(wc[0].status, WcStatus::Success, "{wc:?}");
    assert!(b.buf == data, "the 1 MiB WRITE landed intact");
    a.buf.fill(0);
    let half = LEN / 2;
    let cut_before_read = a.ctx.net_stats().rx_icrc_cut_run;
    let mut r = SendWr::new(1001, WrOpcode::RdmaRead);
    r.sg_list = vec![Sge {
        addr: a.mr.iova + half as u64,
        length: half as u32,
        lkey: a.mr.lkey,
    }];
    r.remote_addr = b.mr.iova;
    r.rkey = b.mr.rkey;
    r.flags |= send_flags::SIGNALED;
    a.ctx.post_send(a.qp, &[r]).unwrap();
    let wc = poll_n(&a, 1, Duration::from_secs(10));
    assert_eq!(wc[0].status, WcStatus::Success, "{wc:?}");
    assert!(a.buf[half..] == data[..half], "the READ came back intact");
    // The requester switched its receive offload back on before the READ request left: no
    // READ response arrived cut apart from its GSO run (it would have waited for the timer).
    assert_eq!(
        a.ctx.net_stats().rx_icrc_cut_run,
        cut_before_read,
        "{:?}",
        a.ctx.net_stats()
    );
    round_trips(&mut a, &b, 2, 300);
    let (na, nb) = (a.ctx.net_stats(), b.ctx.net_stats());
    assert_eq!(
        na.rx_bad_icrc + na.rx_malformed + nb.rx_bad_icrc + nb.rx_malformed,
        0,
        "{na:?} {nb:?}"
    );
    // Every packet's ICRC matched the one IPv4 ID its receiver expected, except GSO segments
    // that reached a socket whose receive offload was off (cut apart from their batch, their
    // ID unknowable: dropped, counted, retransmitted).
    assert_eq!(
        na.rx_icrc_foreign_id + nb.rx_icrc_foreign_id,
        0,
        "{na:?} {nb:?}"
    );
}

#[test]
fn exactly_once_under_loss_reordering_duplication() {
    let faults = FaultConfig::parse("loss=10%,reorder=5%,dup=3%,corrupt=1%,seed=11").unwrap();
    let a = host(lossy(faults));
    let b = host(lossy(FaultConfig { seed: 12, ..faults }));
    connect_udp(
        &a,
        &b,
        ConnectOpts {
            timeout: 8, // ~1 ms: the loopback round trip is microseconds
            ..ConnectOpts::default()
        },
    );
    // 32 WRITEs of 16 KiB (4 packets each), signaled, into distinct regions, plus 32 SENDs.
    let mut a = a;
    let data = pattern(42, LEN);
    a.buf.copy_from_slice(&data);
    let recvs: Vec<RecvWr> = (0..32u64)
        .map(|i| RecvWr {
            wr_id: 1000 + i,
            sg_list: vec![Sge {
                addr: b.mr.iova + (512 << 10) + i * 4096,
                length: 4096,
                lkey: b.mr.lkey,
            }],
        })
        .collect();
    b.ctx.post_recv(b.qp, &recvs).unwrap();
    let mut wrs = Vec::new();
    for i in 0..32u64 {
        wrs.push(write(&a, &b, i, i * 16384, 16384));
        let mut s = SendWr::new(100 + i, WrOpcode::Send);
        s.sg_list = vec![Sge {
            addr: a.mr.iova + (512 << 10) + i * 4096,
            length: 4096,
            lkey: a.mr.lkey,
        }];
        wrs.push(s);
    }
    a.ctx.post_send(a.qp, &wrs).unwrap();
    let wcs = poll_n(&a, 64, Duration::from_secs(60));
    assert_eq!(wcs.len(), 64, "every WR completes");
    let mut ids: Vec<u64> = wcs.iter().map(|w| w.wr_id).collect();
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 64, "no duplicate completion");
    let rwcs = poll_n(&b, 32, Duration::from_secs(30));
    assert_eq!(rwcs.len(), 32);
    let mut rids: Vec<u64> = rwcs.iter().map(|w| w.wr_id).collect();
    rids.sort_unstable();
    assert_eq!(
        rids,
        (1000..1032).collect::<Vec<_>>(),
        "each receive completes exactly once, in order"
    );
    // No extra completion shows up later.
    std::thread::sleep(Duration::from_millis(50));
    let mut extra = Vec::new();
    a.ctx.poll_cq(a.cq, &mut extra, 16).unwrap();
    b.ctx.poll_cq(b.cq, &mut extra, 16).unwrap();
    assert!(extra.is_empty(), "{extra:?}");
    assert!(
        b.buf[..512 << 10] == data[..512 << 10],
        "all written data intact"
    );
    let sent = (512 << 10)..(512 << 10) + 32 * 4096;
    assert!(b.buf[sent.clone()] == data[sent], "all sent data intact");
    let fa = a.ctx.fault_stats().unwrap();
    assert!(
        fa.dropped > 0 && fa.reordered > 0,
        "faults were injected: {fa:?}"
    );
    let nb = b.ctx.net_stats();
    assert!(
        nb.rx_bad_icrc > 0 || fa.corrupted == 0,
        "corrupted packets are caught by the ICRC: {nb:?} {fa:?}"
    );
}

/// Corruption on the wire never becomes a wrong byte: thousands of 4 KiB WRITEs (one
/// 4124-byte datagram each) with a bit flipped in 20 % of the datagrams, and every completed
/// WRITE's bytes are compared. Every corrupted datagram is dropped for its ICRC (the exact
/// IPv4 check rejects every single-bit error) and retransmitted.
#[test]
fn corrupted_writes_never_land_a_wrong_byte() {
    let faults = FaultConfig::parse("corrupt=20%,seed=21").unwrap();
    let mut a = host(lossy(faults));
    let b = host(lossy(FaultConfig { seed: 22, ..faults }));
    connect_udp(
        &a,
        &b,
        ConnectOpts {
            timeout: 8, // ~1 ms
            ..ConnectOpts::default()
        },
    );
    const N: u64 = 2048;
    const BATCH: u64 = 64;
    const SLOTS: u64 = (LEN as u64) / 4096;
    for round in 0..N / BATCH {
        let seed = round as u8;
        let data = pattern(seed.wrapping_mul(7), LEN);
        a.buf.copy_from_slice(&data);
        let wrs: Vec<SendWr> = (0..BATCH)
            .map(|i| {
                let off = (i % SLOTS) * 4096;
                let mut w = write(&a, &b, round * BATCH + i, off, 4096);
                w.flags |= send_flags::SIGNALED;
                w
            })
            .collect();
        a.ctx.post_send(a.qp, &wrs).unwrap();
        let wcs = poll_n(&a, BATCH as usize, Duration::from_secs(30));
        assert_eq!(wcs.len() as u64, BATCH, "round {round}");
        assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
        for i in 0..BATCH {
            let off = ((i % SLOTS) * 4096) as usize;
            assert!(
                b.buf[off..off + 4096] == data[off..off + 4096],
                "round {round}: WRITE {i} completed with wrong bytes"
            );
        }
    }
    let (fa, fb) = (a.ctx.fault_stats().unwrap(), b.ctx.fault_stats().unwrap());
    let (na, nb) = (a.ctx.net_stats(), b.ctx.net_stats());
    assert!(fa.corrupted >= N / 10, "{fa:?}");
    // The corrupted datagrams were dropped by their receiver's checks, except flips in BTH
    // byte 4 (FECN, BECN, reserved: not covered by the ICRC, as on every RoCE device, and
    // harmless), 8 of the 32,992 bits of a WRITE datagram, and those the kernel dropped
    // before (a full socket buffer under the bursts: about 1 % of the datagrams here).
    let dropped = nb.rx_bad_icrc + nb.rx_icrc_foreign_id + nb.rx_malformed + nb.rx_unknown_qp;
    assert!(
        dropped <= fa.corrupted && dropped >= fa.corrupted - fa.corrupted / 10,
        "{nb:?} {fa:?}"
    );
    let dropped = na.rx_bad_icrc + na.rx_icrc_foreign_id + na.rx_malformed + na.rx_unknown_qp;
    assert!(dropped <= fb.corrupted, "{na:?} {fb:?}");
}

/// Drop `h`'s device and wait until it is gone (its UDP address can be bound again): a
/// progress pass still running for a moment after the drop must not answer the packets of a
/// test that expects a dead peer (it NAKed a WRITE whose MR was already deregistered).
fn kill(h: BufHost) {
    let addr = h.ctx.udp_port().unwrap().local_addr();
    drop(h);
    let end = Instant::now() + Duration::from_secs(10);
    while std::net::UdpSocket::bind(addr).is_err() {
        assert!(
            Instant::now() < end,
            "the peer's socket {addr} was never closed"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn peer_death_gives_retry_exc_err() {
    let a = host(DeviceConfig::rxe());
    let b = host(DeviceConfig::rxe());
    connect_udp(
        &a,
        &b,
        ConnectOpts {
            timeout: 10, // 4.2 ms
            retry_cnt: 3,
            ..ConnectOpts::default()
        },
    );
    let w = write(&a, &b, 1, 0, 4096);
    kill(b); // the peer goes away: nothing answers any more
    let t0 = Instant::now();
    a.ctx.post_send(a.qp, &[w]).unwrap();
    let wc = poll_n(&a, 1, Duration::from_secs(10));
    let took = t0.elapsed();
    assert_eq!(wc.len(), 1);
    assert_eq!(wc[0].status, WcStatus::RetryExcErr, "{wc:?}");
    // 4 attempts × 4.2 ms plus the 1 ms tick granularity: well under a second.
    assert!(took < Duration::from_secs(1), "took {took:?}");
    assert!(
        took >= Duration::from_millis(12),
        "gave up too early: {took:?}"
    );
}

/// The peer's device goes away after connecting with `retry_cnt` 7 (what perftest and
/// `mrkit perf` use) and local ACK timeout `timeout`: a WRITE must end with RETRY_EXC_ERR, the
/// first send and seven retries later (IBA, mlx5: only the RNR retry count uses 7 for
/// "forever"). Returns how long it took.
fn dead_peer_retry_cnt_7(timeout: u8) -> Duration {
    let a = host(DeviceConfig::default());
    let b = host(DeviceConfig::default());
    connect_udp(
        &a,
        &b,
        ConnectOpts {
            timeout,
            retry_cnt: 7,
            ..ConnectOpts::default()
        },
    );
    // One WRITE that completes: the connection works before the peer dies.
    a.ctx.post_send(a.qp, &[write(&a, &b, 1, 0, 4096)]).unwrap();
    let wc = poll_n(&a, 1, Duration::from_secs(10));
    assert_eq!(wc.len(), 1);
    assert_eq!(wc[0].status, WcStatus::Success, "{wc:?}");
    let w = write(&a, &b, 2, 0, 4096);
    kill(b);
    let t0 = Instant::now();
    a.ctx.post_send(a.qp, &[w]).unwrap();
    let wc = poll_n(&a, 1, Duration::from_secs(20));
    let took = t0.elapsed();
    assert_eq!(
        wc.len(),
        1,
        "no completion within 20 s: retry_cnt 7 retried forever"
    );
    assert_eq!(wc[0].status, WcStatus::RetryExcErr, "{wc:?}");
    assert_eq!(wc[0].wr_id, 2);
    took
}

#[test]
fn peer_death_with_retry_cnt_7_ends_in_retry_exc_err() {
    // timeout 10: 4.096 µs × 2^10 ≈ 4.2 ms; 8 × 4.2 ms ≈ 34 ms.
    let took = dead_peer_retry_cnt_7(10);
    assert!(
        took >= Duration::from_millis(30),
        "gave up too early: {took:?}"
    );
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

#[test]
fn peer_death_with_perftest_defaults_ends_in_bounded_time() {
    // perftest's timeout 14 (≈ 67 ms) and retry_cnt 7: 8 × 67 ms ≈ 0.54 s.
    let took = dead_peer_retry_cnt_7(14);
    assert!(
        took >= Duration::from_millis(500),
        "gave up too early: {took:?}"
    );
    assert!(took < Duration::from_secs(10), "took {took:?}");
}

/// READs and atomics (whose responses carry data, so lost responses must be re-requested,
/// and duplicated atomics must be answered from the replay cache, never re-executed).
fn reads_and_atomics(spec: &str, n_ops: u64) {
    let faults = FaultConfig::parse(spec).unwrap();
    let a = host(lossy(faults));
    let mut b = host(lossy(FaultConfig {
        seed: faults.seed + 1000,
        ..faults
    }));
    connect_udp(
        &a,
        &b,
        ConnectOpts {
            timeout: 8,
            ..ConnectOpts::default()
        },
    );
    let data = pattern(9, LEN);
    b.buf.copy_from_slice(&data);
    b.buf[..8].copy_from_slice(&0u64.to_ne_bytes());
    let mut wrs = Vec::new();
    for i in 0..n_ops {
        let mut r = SendWr::new(i, WrOpcode::RdmaRead);
        r.sg_list = vec![Sge {
            addr: a.mr.iova + 16384 + i * 16384,
            length: 16384,
            lkey: a.mr.lkey,
        }];
        r.remote_addr = b.mr.iova + 16384 + i * 16384;
        r.rkey = b.mr.rkey;
        wrs.push(r);
        let mut f = SendWr::new(100 + i, WrOpcode::AtomicFetchAndAdd);
        f.sg_list = vec![Sge {
            addr: a.mr.iova + i * 8,
            length: 8,
            lkey: a.mr.lkey,
        }];
        f.remote_addr = b.mr.iova;
        f.rkey = b.mr.rkey;
        f.compare_add = 1;
        wrs.push(f);
    }
    a.ctx.post_send(a.qp, &wrs).unwrap();
    let n = 2 * n_ops as usize;
    let wcs = poll_n(&a, n, Duration::from_secs(20));
    assert_eq!(
        wcs.len(),
        n,
        "{spec}: every WR completes: {:?} {:?}",
        a.ctx.net_stats(),
        a.ctx.fault_stats()
    );
    assert!(
        wcs.iter().all(|w| w.status == WcStatus::Success),
        "{spec}: {wcs:?}"
    );
    let range = 16384..16384 + n_ops as usize * 16384;
    assert!(
        a.buf[range.clone()] == data[range],
        "{spec}: READ data intact"
    );
    assert_eq!(
        u64::from_ne_bytes(b.buf[..8].try_into().unwrap()),
        n_ops,
        "{spec}: each atomic executed exactly once"
    );
    let mut olds: Vec<u64> = (0..n_ops as usize)
        .map(|i| u64::from_ne_bytes(a.buf[i * 8..i * 8 + 8].try_into().unwrap()))
        .collect();
    olds.sort_unstable();
    assert_eq!(
        olds,
        (0..n_ops).collect::<Vec<_>>(),
        "{spec}: distinct original values"
    );
}

#[test]
fn reads_and_atomics_under_loss() {
    for seed in 1..=6 {
        for spec in [
            "loss=10%",
            "reorder=10%",
            "dup=10%",
            "loss=10%,reorder=5%,dup=3%,corrupt=1%",
        ] {
            reads_and_atomics(&format!("{spec},seed={seed}"), 32);
        }
    }
}

/// Many SENDs under loss with a receiver that reposts one receive per completion (the shape
/// of `mrkit perf --op send`): every message arrives exactly once and nothing stalls. Mostly
/// unsignaled WQEs, so ACKs complete WQEs that were never individually answered; duplicated
/// and reordered ACKs and NAKs cross retries (this once stalled the QP: an implicit ACK
/// completed the WQE a pending retry pointed into, so the retry resent nothing).
#[test]
fn many_sends_under_loss_with_reposted_receives() {
    for (spec, seed) in ["loss=5%,reorder=2%,dup=1%", "loss=10%,reorder=5%,dup=3%"]
        .into_iter()
        .flat_map(|spec| (1..=6u64).map(move |seed| (spec, seed)))
    {
        let faults = FaultConfig::parse(&format!("{spec},seed={seed}")).unwrap();
        let a = host(lossy(faults));
        let b = host(lossy(FaultConfig {
            seed: seed + 100,
            ..faults
        }));
        connect_udp(
            &a,
            &b,
            ConnectOpts {
                timeout: 12,
                ..ConnectOpts::default()
            },
        );
        let recv = |id: u64| RecvWr {
            wr_id: id,
            sg_list: vec![Sge {
                addr: b.mr.iova,
                length: 2048,
                lkey: b.mr.lkey,
            }],
        };
        let initial: Vec<RecvWr> = (0..64).map(recv).collect();
        b.ctx.post_recv(b.qp, &initial).unwrap();
        let total = 600u64;
        let mut posted = 0u64;
        let mut completed = 0u64;
        let mut received = 0u64;
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut wcs = Vec::new();
        while received < total || completed < total {
            while posted < total && posted - completed < 32 {
                let mut s = SendWr::new(posted, WrOpcode::Send);
                if (posted + 1) % 8 != 0 && posted + 1 != total {
                    s.flags = 0;
                }
                s.sg_list = vec![Sge {
                    addr: a.mr.iova,
                    length: 2048,
                    lkey: a.mr.lkey,
                }];
                a.ctx.post_send(a.qp, &[s]).unwrap();
                posted += 1;
            }
            wcs.clear();
            a.ctx.poll_cq(a.cq, &mut wcs, 16).unwrap();
            for w in &wcs {
                assert_eq!(w.status, WcStatus::Success, "seed {seed}: {w:?}");
                completed = completed.max(w.wr_id + 1);
            }
            wcs.clear();
            b.ctx.poll_cq(b.cq, &mut wcs, 16).unwrap();
            for w in &wcs {
                assert_eq!(w.status, WcStatus::Success, "seed {seed}: {w:?}");
                received += 1;
                b.ctx.post_recv(b.qp, &[recv(1000 + received)]).unwrap();
            }
            assert!(
                Instant::now() < deadline,
                "seed {seed}: stalled at posted {posted} completed {completed} received {received}: \\
                 a {:?} {:?} b {:?} {:?}",
                a.ctx.net_stats(),
                a.ctx.fault_stats(),
                b.ctx.net_stats(),
                b.ctx.fault_stats()
            );
        }
        assert_eq!(
            received, total,
            "{spec} seed {seed}: every message exactly once"
        );
    }
}

/// READs of 100 KB under 100 µs of delay with as much jitter (the injector delivers datagrams
/// out of order when their jitter differs): a gap in the READ responses is re-requested at once
/// (implied NAK), not after a retransmission timeout, so 400 READs finish in bounded time
/// (before, a gap waited ~67 ms each and 400 READs did not finish in 120 s), every byte intact.
#[test]
fn many_reads_under_delay_and_jitter_recover_from_gaps_at_once() {
    let faults = FaultConfig::parse("delay=100us,jitter=100us,seed=11").unwrap();
    let a = host(DeviceConfig::default().faults(faults));
    let mut b = host(DeviceConfig::default().faults(FaultConfig { seed: 12, ..faults }));
    connect_udp(&a, &b, ConnectOpts::default()); // perftest's timeout 14 (≈ 67 ms)
    let data = pattern(5, LEN);
    b.buf.copy_from_slice(&data);
    const READ: usize = 100_000;
    const N: usize = 400;
    let t0 = Instant::now();
    let mut done = 0;
    while done < N {
        // Eight READs at a time (a's buffer holds eight 100 KB destinations + margin).
        let batch = (N - done).min(8);
        let wrs: Vec<SendWr> = (0..batch)
            .map(|i| {
                let src = ((done + i) * 7919 % (LEN - READ)) as u64;
                let mut r = SendWr::new((done + i) as u64, WrOpcode::RdmaRead);
                r.sg_list = vec![Sge {
                    addr: a.mr.iova + (i * (READ + 4096)) as u64,
                    length: READ as u32,
                    lkey: a.mr.lkey,
                }];
                r.remote_addr = b.mr.iova + src;
                r.rkey = b.mr.rkey;
                r
            })
            .collect();
        a.ctx.post_send(a.qp, &wrs).unwrap();
        let wcs = poll_n(&a, batch, Duration::from_secs(60));
        assert_eq!(
            wcs.len(),
            batch,
            "READs {done}..: {:?}",
            a.ctx.fault_stats()
        );
        assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
        for i in 0..batch {
            let src = (done + i) * 7919 % (LEN - READ);
            let dst = i * (READ + 4096);
            assert!(
                a.buf[dst..dst + READ] == data[src..src + READ],
                "READ {} intact",
                done + i
            );
        }
        done += batch;
    }
    let took = t0.elapsed();
    let fb = b.ctx.fault_stats().unwrap();
    assert!(fb.offered > 0, "{fb:?}");
    eprintln!("{N} READs of {READ} B under delay+jitter: {took:?} ({fb:?})");
    assert!(took < Duration::from_secs(60), "took {took:?}");
}
