//! In-crate data-path tests that need to craft packets: a misaligned atomic reaching the
//! responder (bypassing the post-time check), and `Pkt::to_wire` against the wire parser.
use std::sync::Arc;
use std::time::Instant;

use crate::user_mem::UserMemory;

use super::{rc_connect, QpState, SendWr, WrOpcode};
use crate::cq::{Wc, WcStatus};
use crate::driver::loopback::drive_until_idle;
use crate::events::AsyncEvent;
use crate::pkt::{Payload, Pkt};
use crate::wire::{
    Aeth, AtomicAckEth, AtomicEth, Bth, ExtHeaders, IcrcInputs, Ieth, ImmDt, Opcode, Packet, Reth,
};
use crate::{AccessFlags as A, Context};

/// A manual device, its PD, CQ and RC QP.
type Host = (Context, u32, u32, u32);

/// Two manual hosts whose RC QPs are connected to each other with `access` (MTU 1024).
fn connected(access: A) -> (Host, Host) {
    let a = crate::testkit::host::manual_rc_host(64, true);
    let b = crate::testkit::host::manual_rc_host(64, true);
    rc_connect(&a.0, a.3, &b.0, b.3, access, 3).unwrap();
    (a, b)
}

#[test]
fn responder_misaligned_atomic_is_rem_inv_req_err() {
    let all = A::LOCAL_WRITE | A::REMOTE_WRITE | A::REMOTE_READ | A::REMOTE_ATOMIC;
    let ((a, apd, acq, aqp), (b, bpd, _, bqp)) = connected(all);
    // The MRs own their buffers (kept alive until deregistered).
    let res = Arc::new(vec![0u8; 8]);
    let target = Arc::new(vec![0x11u8; 64]);
    let rm = a.reg_mr_va(apd, UserMemory::owned(res), all).unwrap();
    let tm = b
        .reg_mr_va(bpd, UserMemory::owned(target.clone()), all)
        .unwrap();
    // A legitimate FETCH_ADD with PSN 0 is posted (not yet sent: manual progress) ...
    let mut wr = SendWr::new(1, WrOpcode::AtomicFetchAndAdd)
        .sge(rm.iova, 8, rm.lkey)
        .remote(tm.iova, tm.rkey);
    wr.compare_add = 1;
    a.post_send(aqp, &[wr]).unwrap();
    // ... and a crafted one with the same PSN and a misaligned address reaches b first.
    let mut bth = Bth::new(Opcode::FetchAdd, bqp, 0);
    bth.ack_req = true;
    let p = Pkt {
        dst_node: b.node_id(),
        dst_ip: None,
        src_ip: None,
        src_node: a.node_id(),
        src_qpn: aqp,
        bth,
        ext: ExtHeaders {
            atomic_eth: Some(AtomicEth {
                va: tm.iova + 4,
                rkey: tm.rkey,
                swap_add: 1,
                compare: 0,
            }),
            ..ExtHeaders::default()
        },
        payload: Payload::Empty,
    };
    b.dev.dp.enqueue_packet(p);
    drive_until_idle(&[&a, &b]);
    let mut v: Vec<Wc> = Vec::new();
    a.poll_cq(acq, &mut v, 8).unwrap();
    assert_eq!((v[0].wr_id, v[0].status), (1, WcStatus::RemInvReqErr));
    assert_eq!(a.qp_state(aqp).unwrap(), QpState::Err);
    assert_eq!(b.qp_state(bqp).unwrap(), QpState::Err);
    assert!(target.iter().all(|&x| x == 0x11), "nothing executed");
    let mut evs = Vec::new();
    while let Some(e) = b.get_async_event(std::time::Duration::ZERO) {
        evs.push(e);
    }
    assert!(evs.contains(&AsyncEvent::QpReqErr { qpn: bqp }), "{evs:?}");
    let _ = Instant::now();
}

#[test]
fn pkt_to_wire_round_trips_through_the_parser() {
    let inputs = IcrcInputs::new(
        "10.0.0.1".parse().unwrap(),
        "10.0.0.2".parse().unwrap(),
        0xc000,
        4791,
    );
    let mk = |op: Opcode, ext: ExtHeaders, payload: Vec<u8>| {
        let mut bth = Bth::new(op, 0x12345, 0xabcdef);
        bth.ack_req = true;
        bth.se = matches!(op, Opcode::SendOnlyWithImmediate);
        Pkt {
            dst_node: 0,
            dst_ip: None,
            src_ip: None,
            src_node: 0,
            src_qpn: 0,
            bth,
            ext,
            payload: if payload.is_empty() {
                Payload::Empty
            } else {
                Payload::Bytes(payload)
            },
        }
    };
    let cases = vec![
        mk(
            Opcode::RdmaWriteOnly,
            ExtHeaders {
                reth: Some(Reth {
                    va: 0x1000_0000_0042,
                    rkey: 0x1234,
                    dma_len: 13,
                }),
                ..ExtHeaders::default()
            },
            b"hello, RoCEv2".to_vec(),
        ),
        mk(
            Opcode::SendOnlyWithImmediate,
            ExtHeaders {
                immdt: Some(ImmDt(0xdead_beef)),
                ..ExtHeaders::default()
            },
            vec![7; 1024],
        ),
        mk(
            Opcode::SendOnlyWithInvalidate,
            ExtHeaders {
                ieth: Some(Ieth { rkey: 0x8000_0107 }),
                ..ExtHeaders::default()
            },
            vec![1, 2, 3],
        ),
        mk(
            Opcode::CompareSwap,
            ExtHeaders {
                atomic_eth: Some(AtomicEth {
                    va: 0x2000,
                    rkey: 9,
                    swap_add: 5,
                    compare: 6,
                }),
                ..ExtHeaders::default()
            },
            vec![],
        ),
        mk(
            Opcode::Acknowledge,
            ExtHeaders {
                aeth: Some(Aeth::ack(77)),
                ..ExtHeaders::default()
            },
            vec![],
        ),
        mk(
            Opcode::AtomicAcknowledge,
            ExtHeaders {
                aeth: Some(Aeth::ack(78)),
                atomic_ack_eth: Some(AtomicAckEth { orig: u64::MAX - 3 }),
                ..ExtHeaders::default()
            },
            vec![],
        ),
        mk(
            Opcode::RdmaReadResponseMiddle,
            ExtHeaders::default(),
            (0..=255).collect(),
        ),
    ];
    for p in cases {
        let d = p.to_wire(&inputs).unwrap();
        let v = Packet::parse_verified(&d, &inputs).unwrap();
        // The builder fills PadCnt for the payload length; everything else is as given.
        let n = p.payload.len();
        assert_eq!(v.bth.pad_count as usize, (4 - n % 4) % 4);
        let mut want = p.bth;
        want.pad_count = v.bth.pad_count;
        assert_eq!(v.bth, want, "{:?}", p.bth.opcode);
        assert_eq!(v.ext, p.ext, "{:?}", p.bth.opcode);
        assert_eq!(
            v.payload,
            &p.payload.to_vec().unwrap()[..],
            "{:?}",
            p.bth.opcode
        );
        // A flipped payload/header bit fails the ICRC.
        let mut bad = d.clone();
        bad[5] ^= 1;
        assert!(Packet::parse_verified(&bad, &inputs).is_err());
    }
}

#[test]
fn responder_coalesces_the_acks_of_one_batch_into_one() {
    let all = A::LOCAL_WRITE | A::REMOTE_WRITE | A::REMOTE_READ;
    let ((a, apd, acq, aqp), (b, bpd, _, _)) = connected(all);
    let src = Arc::new(vec![7u8; 64]);
    let dst = Arc::new(vec![0u8; 64]);
    let sm = a.reg_mr_va(apd, UserMemory::owned(src), all).unwrap();
    let dm = b
        .reg_mr_va(bpd, UserMemory::owned(dst.clone()), all)
        .unwrap();
    // Four one-packet WRITEs, each with AckReq (last packet of its message) ...
    let wrs: Vec<SendWr> = (0..4u64)
        .map(|i| {
            SendWr::new(i, WrOpcode::RdmaWrite)
                .sge(sm.iova + i * 16, 16, sm.lkey)
                .remote(dm.iova + i * 16, dm.rkey)
        })
        .collect();
    a.post_send(aqp, &wrs).unwrap();
    let now = Instant::now();
    a.progress_once(now); // a sends all four into b's inbox
    b.progress_once(now); // b takes them in one run
                          // ... are acknowledged by one ACK for the last PSN: ACKs are cumulative.
    let inbox = a.dev.dp.qps.read()[&aqp].inbox.summary();
    assert_eq!(inbox, vec![(Opcode::Acknowledge, 3, true)]);
    drive_until_idle(&[&a, &b]);
    let mut wcs: Vec<Wc> = Vec::new();
    a.poll_cq(acq, &mut wcs, 16).unwrap();
    let ids: Vec<(u64, WcStatus)> = wcs.iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(
        ids,
        (0..4).map(|i| (i, WcStatus::Success)).collect::<Vec<_>>(),
        "one ACK completes all four, in order"
    );
    assert_eq!(dst[..], [7u8; 64]);
}
