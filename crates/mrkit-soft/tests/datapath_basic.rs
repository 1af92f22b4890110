//! Basic data movement between two device instances on the loopback link.
use std::time::{Duration, Instant};

use mrkit_soft::cq::{Wc, WcOpcode, WcStatus};
use mrkit_soft::net::loopback::drive_until_idle;
use mrkit_soft::qp::{
    rc_connect, send_flags, QpCap, QpInitAttr, QpState, RecvWr, SendWr, Sge, WrOpcode,
};
use mrkit_soft::{AccessFlags, Context, DeviceConfig};

pub struct Host {
    pub ctx: Context,
    pub pd: u32,
    pub cq: u32,
    pub qp: u32,
}

pub fn host(manual: bool) -> Host {
    let ctx = Context::open(DeviceConfig::rxe());
    if manual {
        ctx.set_manual_progress();
    }
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(256, None).unwrap();
    let (qp, _) = ctx
        .create_qp(QpInitAttr {
            pd,
            send_cq: cq,
            recv_cq: cq,
            cap: QpCap::default(),
            sq_sig_all: false,
        })
        .unwrap();
    Host { ctx, pd, cq, qp }
}

pub fn pair(manual: bool, access: AccessFlags) -> (Host, Host) {
    let a = host(manual);
    let b = host(manual);
    rc_connect(&a.ctx, a.qp, &b.ctx, b.qp, access, 3).unwrap();
    (a, b)
}

fn all() -> AccessFlags {
    AccessFlags::LOCAL_WRITE
        | AccessFlags::REMOTE_WRITE
        | AccessFlags::REMOTE_READ
        | AccessFlags::REMOTE_ATOMIC
}

fn poll_one(h: &Host, other: &Host, manual: bool) -> Wc {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut v = Vec::new();
    loop {
        if manual {
            drive_until_idle(&[&h.ctx, &other.ctx]);
        }
        if h.ctx.poll_cq(h.cq, &mut v, 1).unwrap() == 1 {
            return v[0];
        }
        assert!(Instant::now() < deadline, "no completion");
        if !manual {
            h.ctx.wait_cq(h.cq, Duration::from_millis(10)).unwrap();
        }
    }
}

fn run(manual: bool) {
    let (a, b) = pair(manual, all());
    let src: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
    let mut dst = vec![0u8; 20_000];
    let ma = a
        .ctx
        .reg_mr_va(a.pd, src.as_ptr() as u64, src.len() as u64, all())
        .unwrap();
    let mb = b
        .ctx
        .reg_mr_va(b.pd, dst.as_mut_ptr() as u64, dst.len() as u64, all())
        .unwrap();
    // WRITE 20000 bytes (20 packets at MTU 1024), two SGEs.
    let wr = SendWr::new(1, WrOpcode::RdmaWrite)
        .sge(ma.iova, 7000, ma.lkey)
        .sge(ma.iova + 7000, 13_000, ma.lkey)
        .remote(mb.iova, mb.rkey);
    a.ctx.post_send(a.qp, &[wr]).unwrap();
    let wc = poll_one(&a, &b, manual);
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
        (1, WcStatus::Success, WcOpcode::RdmaWrite, 20_000)
    );
    assert_eq!(src, dst);
    // READ back into a fresh buffer.
    let mut back = vec![0u8; 20_000];
    let mc = a
        .ctx
        .reg_mr_va(a.pd, back.as_mut_ptr() as u64, back.len() as u64, all())
        .unwrap();
    let wr = SendWr::new(2, WrOpcode::RdmaRead)
        .sge(mc.iova, 20_000, mc.lkey)
        .remote(mb.iova, mb.rkey);
    a.ctx.post_send(a.qp, &[wr]).unwrap();
    let wc = poll_one(&a, &b, manual);
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (2, WcStatus::Success, WcOpcode::RdmaRead)
    );
    assert_eq!(back, src);
    // Atomics on dst[0..8].
    let mut res = [0u8; 8];
    let mr_res = a
        .ctx
        .reg_mr_va(a.pd, res.as_mut_ptr() as u64, 8, all())
        .unwrap();
    let before = u64::from_ne_bytes(dst[..8].try_into().unwrap());
    let mut wr = SendWr::new(3, WrOpcode::AtomicFetchAndAdd)
        .sge(mr_res.iova, 8, mr_res.lkey)
        .remote(mb.iova, mb.rkey);
    wr.compare_add = 5;
    a.ctx.post_send(a.qp, &[wr]).unwrap();
    assert_eq!(poll_one(&a, &b, manual).status, WcStatus::Success);
    assert_eq!(u64::from_ne_bytes(res), before);
    assert_eq!(u64::from_ne_bytes(dst[..8].try_into().unwrap()), before + 5);
    let mut wr = SendWr::new(4, WrOpcode::AtomicCmpAndSwp)
        .sge(mr_res.iova, 8, mr_res.lkey)
        .remote(mb.iova, mb.rkey);
    wr.compare_add = before + 5;
    wr.swap = 42;
    a.ctx.post_send(a.qp, &[wr]).unwrap();
    assert_eq!(poll_one(&a, &b, manual).opcode, WcOpcode::CompSwap);
    assert_eq!(u64::from_ne_bytes(dst[..8].try_into().unwrap()), 42);
    // SEND with immediate into a two-SGE receive; inline SEND.
    let mut rbuf = vec![0u8; 3000];
    let mr = b
        .ctx
        .reg_mr_va(b.pd, rbuf.as_mut_ptr() as u64, 3000, all())
        .unwrap();
    b.ctx
        .post_recv(
            b.qp,
            &[RecvWr {
                wr_id: 10,
                sg_list: vec![
                    Sge {
                        addr: mr.iova,
                        length: 1000,
                        lkey: mr.lkey,
                    },
                    Sge {
                        addr: mr.iova + 1000,
                        length: 2000,
                        lkey: mr.lkey,
                    },
                ],
            }],
        )
        .unwrap();
    let wr = SendWr::new(5, WrOpcode::SendWithImm)
        .sge(ma.iova, 2500, ma.lkey)
        .imm(0xdead_beef);
    a.ctx.post_send(a.qp, &[wr]).unwrap();
    assert_eq!(poll_one(&a, &b, manual).status, WcStatus::Success);
    let rwc = poll_one(&b, &a, manual);
    assert_eq!(
        (
            rwc.wr_id,
            rwc.status,
            rwc.opcode,
            rwc.byte_len,
            rwc.imm_data
        ),
        (10, WcStatus::Success, WcOpcode::Recv, 2500, 0xdead_beef)
    );
    assert_eq!(&rbuf[..2500], &src[..2500]);
    b.ctx
        .post_recv(
            b.qp,
            &[RecvWr {
                wr_id: 11,
                sg_list: vec![Sge {
                    addr: mr.iova,
                    length: 100,
                    lkey: mr.lkey,
                }],
            }],
        )
        .unwrap();
    let mut wr = SendWr::new(6, WrOpcode::Send).flags(send_flags::INLINE | send_flags::SIGNALED);
    wr.inline_data = b"inline hello".to_vec();
    a.ctx.post_send(a.qp, &[wr]).unwrap();
    assert_eq!(poll_one(&a, &b, manual).wr_id, 6);
    assert_eq!(poll_one(&b, &a, manual).byte_len, 12);
    assert_eq!(&rbuf[..12], b"inline hello");
    // WRITE_WITH_IMM consumes a receive and reports the RETH length.
    b.ctx
        .post_recv(
            b.qp,
            &[RecvWr {
                wr_id: 12,
                sg_list: vec![],
            }],
        )
        .unwrap();
    let wr = SendWr::new(7, WrOpcode::RdmaWriteWithImm)
        .sge(ma.iova, 4096, ma.lkey)
        .remote(mb.iova, mb.rkey)
        .imm(9);
    a.ctx.post_send(a.qp, &[wr]).unwrap();
    assert_eq!(poll_one(&a, &b, manual).status, WcStatus::Success);
    let rwc = poll_one(&b, &a, manual);
    assert_eq!(
        (rwc.opcode, rwc.byte_len, rwc.imm_data),
        (WcOpcode::RecvRdmaWithImm, 4096, 9)
    );
    assert_eq!(a.ctx.qp_state(a.qp).unwrap(), QpState::Rts);
    assert_eq!(b.ctx.qp_state(b.qp).unwrap(), QpState::Rts);
    // Unsignaled WRITE then a signaled one: one completion.
    let w1 = SendWr::new(8, WrOpcode::RdmaWrite)
        .sge(ma.iova, 64, ma.lkey)
        .remote(mb.iova, mb.rkey)
        .flags(0);
    let w2 = SendWr::new(9, WrOpcode::RdmaWrite)
        .sge(ma.iova, 64, ma.lkey)
        .remote(mb.iova, mb.rkey);
    a.ctx.post_send(a.qp, &[w1, w2]).unwrap();
    assert_eq!(poll_one(&a, &b, manual).wr_id, 9);
}

#[test]
fn datapath_manual_progress() {
    run(true);
}

#[test]
fn datapath_progress_thread() {
    run(false);
}

#[test]
fn rnr_then_success() {
    let (a, b) = pair(true, all());
    let src = vec![7u8; 100];
    let mut dst = vec![0u8; 100];
    let ma = a
        .ctx
        .reg_mr_va(a.pd, src.as_ptr() as u64, 100, all())
        .unwrap();
    let mb = b
        .ctx
        .reg_mr_va(b.pd, dst.as_mut_ptr() as u64, 100, all())
        .unwrap();
    a.ctx
        .post_send(
            a.qp,
            &[SendWr::new(1, WrOpcode::Send).sge(ma.iova, 100, ma.lkey)],
        )
        .unwrap();
    drive_until_idle(&[&a.ctx, &b.ctx]); // RNR NAK
    b.ctx
        .post_recv(
            b.qp,
            &[RecvWr {
                wr_id: 2,
                sg_list: vec![Sge {
                    addr: mb.iova,
                    length: 100,
                    lkey: mb.lkey,
                }],
            }],
        )
        .unwrap();
    let wc = poll_one(&a, &b, true);
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(poll_one(&b, &a, true).byte_len, 100);
    assert_eq!(dst, src);
}
