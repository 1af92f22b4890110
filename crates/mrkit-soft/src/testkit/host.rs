//! Hosts and connected pairs on a real device instance: a context with a PD, a CQ and an RC
//! QP ([`Host`]), two of them connected over the in-process loopback link ([`pair`],
//! [`pair_with`]) or over UDP on 127.0.0.0/8 ([`connect_udp`], with [`BufHost`]s), and the
//! small helpers the data-path tests, the fuzzers' neighbours and the CLI's demo and bench
//! share (driving manual progress, draining a CQ, receive WRs, waiting with a deadline).
#![forbid(unsafe_code)]

use std::net::IpAddr;
use std::time::{Duration, Instant};

use crate::cq::Wc;
use crate::driver::loopback::drive_until_idle;
use crate::mr::MrInfo;
use crate::qp::connect::{connect_qp, ConnectOpts, RemoteQp};
use crate::qp::{rc_connect, QpCap, QpInitAttr, RecvWr, Sge};
use crate::{AccessFlags as A, Context, DeviceConfig};

pub use super::buf_host::BufHost;

/// One side of a test or benchmark: a device instance, a PD, one CQ for both queues and an
/// RC QP on them.
#[derive(Debug)]
pub struct Host {
    /// The device instance.
    pub ctx: Context,
    /// Its PD.
    pub pd: u32,
    /// The QP's send and receive CQ.
    pub cq: u32,
    /// The RC QP (RESET until connected).
    pub qp: u32,
}

/// Every right: local write, remote write, read and atomic.
pub fn all() -> A {
    A::LOCAL_WRITE | A::REMOTE_WRITE | A::REMOTE_READ | A::REMOTE_ATOMIC
}

/// A device instance with `cfg`, in manual-progress mode if `manual`.
pub fn ctx_with(cfg: DeviceConfig, manual: bool) -> Context {
    let ctx = Context::open(cfg);
    if manual {
        ctx.set_manual_progress();
    }
    ctx
}

/// An rxe-profile device instance, in manual-progress mode if `manual`.
pub fn ctx(manual: bool) -> Context {
    ctx_with(DeviceConfig::rxe(), manual)
}

/// An RC QP on `pd` with `cq` for both queues and the default queue sizes.
pub fn init(pd: u32, cq: u32, sig_all: bool) -> QpInitAttr {
    init_cap(pd, cq, QpCap::default(), sig_all)
}

/// An RC QP on `pd` with `cq` for both queues and the queue sizes of `cap`.
pub fn init_cap(pd: u32, cq: u32, cap: QpCap, sig_all: bool) -> QpInitAttr {
    QpInitAttr {
        pd,
        send_cq: cq,
        recv_cq: cq,
        cap,
        sq_sig_all: sig_all,
    }
}

/// A PD, a CQ of `cqe` entries and an RC QP (default queue sizes) on `ctx`.
pub fn host_with(ctx: Context, cqe: u32, sig_all: bool) -> Host {
    host_with_cap(ctx, cqe, QpCap::default(), sig_all)
}

/// A PD, a CQ of `cqe` entries and an RC QP (queue sizes `cap`) on `ctx`.
pub fn host_with_cap(ctx: Context, cqe: u32, cap: QpCap, sig_all: bool) -> Host {
    Host::new(ctx, cqe, cap, sig_all).unwrap()
}

impl Host {
    /// A PD, a CQ of `cqe` entries and an RC QP (queue sizes `cap`, every send WR signaled
    /// if `sig_all`) on `ctx`; the first error of the three verbs.
    pub fn new(ctx: Context, cqe: u32, cap: QpCap, sig_all: bool) -> crate::Result<Host> {
        let pd = ctx.alloc_pd()?;
        let cq = ctx.create_cq(cqe, None)?;
        let (qp, _) = ctx.create_qp(init_cap(pd, cq, cap, sig_all))?;
        Ok(Host { ctx, pd, cq, qp })
    }
}

/// Connect the QPs of `a` and `b` on the loopback link (`rc_connect`).
pub fn connect(a: &Host, b: &Host, access: A, mtu: u8) {
    rc_connect(&a.ctx, a.qp, &b.ctx, b.qp, access, mtu).unwrap();
}

/// Two connected hosts (MTU 1024), CQs of 256, sq_sig_all off.
pub fn pair_with(manual: bool, access: A) -> (Host, Host) {
    let a = host_with(ctx(manual), 256, false);
    let b = host_with(ctx(manual), 256, false);
    connect(&a, &b, access, 3);
    (a, b)
}

/// Two connected hosts, manual progress, CQs of 256, sq_sig_all off.
pub fn pair() -> (Host, Host) {
    pair_with(true, all())
}

/// Run both hosts' devices (manual progress) until neither has work.
pub fn drive(a: &Host, b: &Host) {
    drive_until_idle(&[&a.ctx, &b.ctx]);
}

/// Up to 1024 completions from `h`'s CQ.
pub fn drain(h: &Host) -> Vec<Wc> {
    let mut v = Vec::new();
    h.ctx.poll_cq(h.cq, &mut v, 1024).unwrap();
    v
}

/// A receive WR of one SGE: `len` bytes at offset `off` of `mr`.
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

/// The asynchronous events `ctx` has queued (taken, without waiting).
pub fn events(ctx: &Context) -> Vec<crate::events::AsyncEvent> {
    let mut v = Vec::new();
    while let Some(e) = ctx.get_async_event(Duration::ZERO) {
        v.push(e);
    }
    v
}

/// The address `h`'s device bound for RoCEv2 (binds it on first use).
pub fn udp_ip(h: &BufHost) -> IpAddr {
    h.ctx.udp_port().unwrap().local_addr().ip()
}

/// Connect the QPs of `a` and `b` over UDP, both with `opts`: each side's first PSN is
/// `opts.sq_psn`, so that is also the PSN each expects from its peer.
pub fn connect_udp(a: &BufHost, b: &BufHost, opts: ConnectOpts) {
    for (x, y) in [(a, b), (b, a)] {
        let remote = RemoteQp {
            qpn: y.qp,
            psn: opts.sq_psn,
            ip: Some(udp_ip(y)),
            node: 0,
        };
        connect_qp(&x.ctx, x.qp, remote, opts).unwrap();
    }
}

/// Up to `n` completions of `h`'s CQ, polling (the progress thread runs) until `timeout`.
pub fn poll_n(h: &BufHost, n: usize, timeout: Duration) -> Vec<Wc> {
    let end = Instant::now() + timeout;
    let mut out = Vec::new();
    while out.len() < n && Instant::now() < end {
        let want = n - out.len();
        h.ctx.poll_cq(h.cq, &mut out, want).unwrap();
    }
    out
}

/// A manual-progress rxe device with a PD, a CQ of `cq_entries` and an RC QP (default queue
/// sizes): `(context, pd, cq, qp)`. The in-crate engine and driver tests use it.
#[cfg(test)]
pub(crate) fn manual_rc_host(cq_entries: u32, sq_sig_all: bool) -> (Context, u32, u32, u32) {
    let Host { ctx, pd, cq, qp } = host_with(ctx(true), cq_entries, sq_sig_all);
    (ctx, pd, cq, qp)
}
