//! Shared helpers for the data-path tests: two "hosts" (device instance, PD, CQ, RC QP) on the
//! loopback link with manual progress or the progress thread, or on the UDP link (RoCEv2 over
//! real sockets) each with one registered buffer.
#![allow(dead_code)]

use std::net::IpAddr;
use std::time::{Duration, Instant};

use mrkit_soft::cq::Wc;
use mrkit_soft::driver::loopback::drive_until_idle;
use mrkit_soft::mr::MrInfo;
use mrkit_soft::qp::connect::{connect_qp, ConnectOpts, RemoteQp};
use mrkit_soft::qp::{rc_connect, QpCap, QpInitAttr, RecvWr, Sge};
use mrkit_soft::{AccessFlags as A, Context, DeviceConfig, UserMemory};

pub struct Host {
    pub ctx: Context,
    pub pd: u32,
    pub cq: u32,
    pub qp: u32,
}

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

pub fn host_with(ctx: Context, cqe: u32, sig_all: bool) -> Host {
    host_with_cap(ctx, cqe, QpCap::default(), sig_all)
}

/// A PD, a CQ of `cqe` entries and an RC QP (queue sizes `cap`) on `ctx`.
pub fn host_with_cap(ctx: Context, cqe: u32, cap: QpCap, sig_all: bool) -> Host {
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(cqe, None).unwrap();
    let (qp, _) = ctx.create_qp(init_cap(pd, cq, cap, sig_all)).unwrap();
    Host { ctx, pd, cq, qp }
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

pub fn drive(a: &Host, b: &Host) {
    drive_until_idle(&[&a.ctx, &b.ctx]);
}

pub fn drain(h: &Host) -> Vec<Wc> {
    let mut v = Vec::new();
    h.ctx.poll_cq(h.cq, &mut v, 1024).unwrap();
    v
}

/// Register `buf` on `h` with all rights.
///
/// # Safety
///
/// Nothing may access the MR once `buf` is freed or moved: the caller posts no work request
/// over it after that, and no peer outside the test knows its keys (the tests' hosts talk only
/// to each other), so an MR left registered until the device is dropped is never used.
pub unsafe fn reg(h: &Host, buf: &mut [u8]) -> MrInfo {
    // SAFETY: the caller guarantees no access reaches the range once `buf` is gone (above).
    let mem = unsafe { UserMemory::new(buf.as_mut_ptr() as u64, buf.len() as u64) };
    h.ctx.reg_mr_va(h.pd, mem, all()).unwrap()
}

/// `len` bytes of `fill` registered on `h` with all rights: the bytes (the MR is valid while
/// they live: bind them to a name, not `_`) and the MR.
///
/// # Safety
///
/// As for [`reg`]: nothing accesses the MR once the returned bytes are dropped.
pub unsafe fn buf_mr(h: &Host, fill: u8, len: usize) -> (Vec<u8>, MrInfo) {
    let mut buf = vec![fill; len];
    // SAFETY: passed on to our caller; the vector's heap buffer does not move with the Vec.
    let mr = unsafe { reg(h, &mut buf) };
    (buf, mr)
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

// ---------------------------------------------------------------------------------------------
// Hosts with one registered buffer (the UDP tests).

/// A host that owns a buffer registered as one MR.
pub struct BufHost {
    pub ctx: Context,
    pub pd: u32,
    pub cq: u32,
    pub qp: u32,
    pub buf: Vec<u8>,
    pub mr: MrInfo,
}

impl Host {
    /// Add a zeroed buffer of `len` bytes registered with `access`.
    pub fn with_buf(self, len: usize, access: A) -> BufHost {
        let Host { ctx, pd, cq, qp } = self;
        let buf = vec![0u8; len];
        // SAFETY: `BufHost` owns `buf` and deregisters the MR before freeing it (its `Drop`);
        // its users never resize `buf`.
        let mem = unsafe { UserMemory::new(buf.as_ptr() as u64, len as u64) };
        let mr = ctx.reg_mr_va(pd, mem, access).unwrap();
        BufHost {
            ctx,
            pd,
            cq,
            qp,
            buf,
            mr,
        }
    }
}

impl Drop for BufHost {
    /// Deregister the MR before its buffer is freed: `dereg_mr` waits until no packet uses the
    /// memory any more. Without it a progress pass still running (the peer retransmitting a
    /// READ, a WRITE arriving late) read or wrote the freed buffer: a crash seen in the UDP
    /// tests once peers kept retrying after the end of a test. If deregistration fails the
    /// buffer is leaked, never freed under a live MR.
    fn drop(&mut self) {
        if self.ctx.dereg_mr(self.mr.lkey).is_err() {
            std::mem::forget(std::mem::take(&mut self.buf));
        }
    }
}

impl BufHost {
    /// One SGE of `len` bytes at offset `off` of the buffer.
    pub fn sge(&self, off: u64, len: u32) -> Vec<Sge> {
        vec![Sge {
            addr: self.mr.iova + off,
            length: len,
            lkey: self.mr.lkey,
        }]
    }
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
