//! The rdma-core provider's handle lookup (a lock-free index in front of its maps): with more
//! objects than index slots (handles then share slots), after destroys and with reused
//! handles, every live handle finds its own object and a destroyed one is EINVAL.
mod providers_util;

use mrkit::provider::{QpInitAttr, Wc};
use mrkit::{Errno, QpCap};

#[test]
fn every_handle_finds_its_own_object() {
    let ctx = providers_util::rdma_core();
    let dev = ctx.provider();
    let pd = ctx.alloc_pd().unwrap();
    // More CQs than the index has slots (1024).
    let mut cqs: Vec<u32> = (0..1500).map(|_| dev.create_cq(1, None).unwrap()).collect();
    let mut out: Vec<Wc> = Vec::new();
    for &cq in &cqs {
        assert_eq!(dev.poll_cq(cq, &mut out, 4).unwrap(), 0, "cq {cq}");
        dev.req_notify_cq(cq, false).unwrap();
    }
    // QPs on some of them: each QP reports its own CQs back.
    let qps: Vec<(u32, u32)> = cqs
        .iter()
        .step_by(100)
        .map(|&cq| {
            let (qpn, _) = dev
                .create_qp(QpInitAttr {
                    pd: pd.handle(),
                    send_cq: cq,
                    recv_cq: cq,
                    cap: QpCap::default(),
                    sq_sig_all: true,
                })
                .unwrap();
            (qpn, cq)
        })
        .collect();
    for &(qpn, _) in &qps {
        assert_eq!(
            dev.query_qp(qpn).unwrap().qp_state,
            0,
            "qp {qpn} is in RESET"
        );
    }
    // Destroy every other CQ that carries no QP: gone from the index and the map.
    let with_qp: Vec<u32> = qps.iter().map(|&(_, cq)| cq).collect();
    let (mut gone, mut kept) = (Vec::new(), Vec::new());
    for (i, &cq) in cqs.iter().enumerate() {
        if i % 2 == 1 && !with_qp.contains(&cq) {
            gone.push(cq);
        } else {
            kept.push(cq);
        }
    }
    for &cq in &gone {
        dev.destroy_cq(cq).unwrap();
    }
    for &cq in &gone {
        let e = dev.poll_cq(cq, &mut out, 4).unwrap_err();
        assert_eq!(e.errno(), Errno::EINVAL, "destroyed cq {cq}: {e}");
    }
    for &cq in &kept {
        assert_eq!(dev.poll_cq(cq, &mut out, 4).unwrap(), 0, "cq {cq}");
    }
    // New CQs (the library may hand out the freed handles again).
    let again: Vec<u32> = (0..gone.len())
        .map(|_| dev.create_cq(1, None).unwrap())
        .collect();
    for &cq in kept.iter().chain(&again) {
        assert_eq!(dev.poll_cq(cq, &mut out, 4).unwrap(), 0, "cq {cq}");
    }
    for (qpn, _) in qps {
        dev.destroy_qp(qpn).unwrap();
        let e = dev.query_qp(qpn).unwrap_err();
        assert_eq!(e.errno(), Errno::EINVAL, "destroyed qp {qpn}: {e}");
    }
    cqs = kept;
    cqs.extend(again);
    for cq in cqs {
        dev.destroy_cq(cq).unwrap();
    }
}
