//! Shared helpers for the data-path tests (manual progress, two "hosts" on the loopback link).
#![allow(dead_code)]

use std::time::{Duration, Instant};

use mrkit_soft::cq::Wc;
use mrkit_soft::mr::MrInfo;
use mrkit_soft::net::loopback::drive_until_idle;
use mrkit_soft::qp::{rc_connect, QpCap, QpInitAttr, RecvWr, Sge};
use mrkit_soft::{AccessFlags as A, Context, DeviceConfig};

pub struct Host {
    pub ctx: Context,
    pub pd: u32,
    pub cq: u32,
    pub qp: u32,
}

pub fn all() -> A {
    A::LOCAL_WRITE | A::REMOTE_WRITE | A::REMOTE_READ | A::REMOTE_ATOMIC
}

pub fn ctx(manual: bool) -> Context {
    let ctx = Context::open(DeviceConfig::rxe());
    if manual {
        ctx.set_manual_progress();
    }
    ctx
}

pub fn init(pd: u32, cq: u32, sig_all: bool) -> QpInitAttr {
    QpInitAttr {
        pd,
        send_cq: cq,
        recv_cq: cq,
        cap: QpCap::default(),
        sq_sig_all: sig_all,
    }
}

pub fn host_with(ctx: Context, cqe: u32, sig_all: bool) -> Host {
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(cqe, None).unwrap();
    let (qp, _) = ctx.create_qp(init(pd, cq, sig_all)).unwrap();
    Host { ctx, pd, cq, qp }
}

/// Two connected hosts, manual progress, CQs of 256, sq_sig_all off.
pub fn pair() -> (Host, Host) {
    let a = host_with(ctx(true), 256, false);
    let b = host_with(ctx(true), 256, false);
    rc_connect(&a.ctx, a.qp, &b.ctx, b.qp, all(), 3).unwrap();
    (a, b)
}

pub fn drive(a: &Host, b: &Host) {
    drive_until_idle(&[&a.ctx, &b.ctx]);
}

pub fn drain(h: &Host) -> Vec<Wc> {
    let mut v = Vec::new();
    h.ctx.poll_cq(h.cq, &mut v, 1024).unwrap();
    v
}

pub fn reg(h: &Host, buf: &mut [u8]) -> MrInfo {
    h.ctx
        .reg_mr_va(h.pd, buf.as_mut_ptr() as u64, buf.len() as u64, all())
        .unwrap()
}

pub fn recv_wr(wr_id: u64, mr: &MrInfo, off: u64, len: u32) -> RecvWr {
    RecvWr {
        wr_id,
        sg_list: vec![Sge {
            addr: mr.iova + off,
            length: len,
            lkey: mr.lkey,
        }],
    }
}

/// Drive (manual) until `f` holds or a few seconds pass; with timers this needs real time.
pub fn drive_until(ctxs: &[&Context], mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        drive_until_idle(ctxs);
        assert!(Instant::now() < deadline, "condition not reached");
        std::thread::sleep(Duration::from_micros(200));
    }
}

pub fn events(ctx: &Context) -> Vec<mrkit_soft::progress::AsyncEvent> {
    let mut v = Vec::new();
    while let Some(e) = ctx.get_async_event(Duration::ZERO) {
        v.push(e);
    }
    v
}
