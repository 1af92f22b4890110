//! The data path over `mrkit_soft`: completion channels, CQs (incl. `ibv_create_cq_ex` and
//! its poll API), RC QPs, SRQs, AHs, and the `ctx->ops` entry points the inline verbs call
//! (`post_send`, `post_recv`, `post_srq_recv`, `poll_cq`, `req_notify_cq`, `bind_mw`).
//!
//! Translation rules (`struct ibv_send_wr` → [`SendWr`] and back for `ibv_wc`):
//! * WR chains are posted in one call; on failure `*bad_wr` is the first WR not posted (a WR
//!   the library cannot translate, e.g. an unknown opcode, fails with EINVAL before the device
//!   sees it; the WRs before it are posted).
//! * `IBV_SEND_INLINE`: the gather list's bytes are copied at post time (no lkey check), so
//!   the buffer may be reused as soon as `ibv_post_send` returns.
//! * `imm_data` is `__be32` (the wire bytes) in both `ibv_send_wr` and `ibv_wc`;
//!   `invalidate_rkey` / `invalidated_rkey` (same unions) are host order.
//! * Address handles and QP address vectors: `is_global` with an IPv4-mapped `dgid` → the
//!   peer's IPv4 address (packets go over UDP); other GIDs → IPv6. Without a GRH the QP talks
//!   to its own device instance (in-process loopback only).

use std::collections::VecDeque;
use std::ffi::{c_int, c_void};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mrkit_soft::cq::{Wc, WC_WITH_IMM, WC_WITH_INV};
use mrkit_soft::mw::BindInfo;
use mrkit_soft::qp::{
    AddressVector, BindWr, PostError, QpAttr, QpCap, QpInitAttr, RecvWr, SendWr, Sge, WrOpcode,
};
use mrkit_soft::srq::SrqAttr;
use mrkit_soft::AccessFlags;

use crate::abi::*;
use crate::device::{mctx, MrkitContext};
use crate::events::{add_completed, wait_until, Kind, ObjEvents};
use crate::ffi::{guard, set_errno};
use crate::verbs::pd_parts;

fn fail_null<T>(e: c_int) -> *mut T {
    set_errno(e);
    std::ptr::null_mut()
}

fn fail(e: c_int) -> c_int {
    set_errno(e);
    e
}

fn soft_errno(e: &mrkit_soft::Error) -> c_int {
    e.errno().raw()
}

fn zeroed<T>() -> T {
    // SAFETY: only used for the plain-data C structs below (pointers, integers, pthread
    // objects), for which all-zero bytes are a valid value (PTHREAD_*_INITIALIZER is zero).
    unsafe { std::mem::zeroed() }
}

/// A library object handed to C as a pointer to its first member (`ibv_cq`, `ibv_srq`,
/// `ibv_qp`), recognised by a magic word.
trait Obj: Sized {
    const MAGIC: u64;
    fn magic(&self) -> u64;
    /// The `ibv_context` it was created on.
    fn context(&self) -> *mut ibv_context;
}

/// The library object `p` points to; None for NULL or an object of another origin (a zeroed
/// struct: wrong magic).
///
/// # Safety
/// `p` NULL or a live object of type `T` created by this library (or memory at least as large
/// whose magic word does not match).
unsafe fn obj<'a, T: Obj>(p: *mut c_void) -> Option<&'a mut T> {
    if p.is_null() {
        return None;
    }
    // SAFETY: caller contract: p starts a T.
    let o = unsafe { &mut *p.cast::<T>() };
    (o.magic() == T::MAGIC).then_some(o)
}

/// [`obj`] plus the open context it belongs to.
///
/// # Safety
/// As [`obj`]; the object's context must be open.
unsafe fn obj_ctx<'a, T: Obj>(p: *mut c_void) -> Option<(&'a mut T, &'a MrkitContext)> {
    // SAFETY: forwarded contract.
    let o = unsafe { obj::<T>(p) }?;
    // SAFETY: the object's context is open (caller contract).
    let m = unsafe { mctx(o.context()) }?;
    Some((o, m))
}

/// A QP or SRQ: an object with affiliated async events and one `events_completed` counter.
trait EventObj: Obj {
    const KIND: Kind;
    /// QPN / SRQN.
    fn num(&self) -> u32;
    fn events(&self) -> &Arc<ObjEvents>;
    /// Mark it freed (wrong magic from now on).
    fn kill(&mut self);
    /// Its `(mutex, cond, events_completed)`.
    ///
    /// # Safety
    /// `this` is live.
    unsafe fn ack_sync(
        this: *mut Self,
    ) -> (
        *mut libc::pthread_mutex_t,
        *mut libc::pthread_cond_t,
        *mut u32,
    );
}

/// `impl Obj for $t` (`$field`: its leading `ibv_*` struct), and with `events: $kind, $num`
/// also `impl EventObj` (`$num`: the QPN/SRQN field).
macro_rules! impl_obj {
    ($t:ty, $($field:ident).+, $magic:expr) => {
        impl Obj for $t {
            const MAGIC: u64 = $magic;
            fn magic(&self) -> u64 {
                self.magic
            }
            fn context(&self) -> *mut ibv_context {
                self.$($field).+.context
            }
        }
    };
    ($t:ty, $field:ident, $magic:expr, events: $kind:expr, $num:ident) => {
        impl_obj!($t, $field, $magic);
        impl EventObj for $t {
            const KIND: Kind = $kind;
            fn num(&self) -> u32 {
                self.$num
            }
            fn events(&self) -> &Arc<ObjEvents> {
                &self.ev
            }
            fn kill(&mut self) {
                self.magic = 0;
            }
            unsafe fn ack_sync(
                this: *mut Self,
            ) -> (
                *mut libc::pthread_mutex_t,
                *mut libc::pthread_cond_t,
                *mut u32,
            ) {
                // SAFETY: caller contract (this is live); only addresses are taken.
                unsafe {
                    (
                        std::ptr::addr_of_mut!((*this).$field.mutex),
                        std::ptr::addr_of_mut!((*this).$field.cond),
                        std::ptr::addr_of_mut!((*this).$field.events_completed),
                    )
                }
            }
        }
    };
}

impl_obj!(MrkitCq, ex.cq, CQ_MAGIC);
impl_obj!(MrkitSrq, srq, SRQ_MAGIC, events: Kind::Srq, srqn);
impl_obj!(MrkitQp, qp, QP_MAGIC, events: Kind::Qp, qpn);

/// The end of `ibv_destroy_qp` / `ibv_destroy_srq` once the device answered `r`: on success
/// stop routing the object's events (its unread ones are dropped), wait until every event
/// handed out for it was acked (libibverbs' `events_completed == events_reported` wait), free
/// it and return 0; on failure return the errno value (errno set), the object stays valid.
///
/// # Safety
/// `p` a live `T` allocated by Box in this library, not used after success; `m` its context.
unsafe fn finish_destroy<T: EventObj>(
    p: *mut T,
    m: &MrkitContext,
    r: mrkit_soft::Result<()>,
) -> c_int {
    if let Err(e) = r {
        return fail(soft_errno(&e));
    }
    let reported = {
        // SAFETY: p is live (caller contract).
        let o = unsafe { &*p };
        m.router.unregister(T::KIND, o.num(), o.events())
    };
    // SAFETY: p is live; its mutex/cond are initialised and events_completed is written under
    // that mutex (ibv_ack_async_event).
    unsafe {
        let (mutex, cond, completed) = T::ack_sync(p);
        wait_until(mutex, cond, || *completed == reported);
    }
    // SAFETY: p is live until the Box is freed below; allocated by Box in this library and
    // freed once (caller contract).
    unsafe {
        (*p).kill();
        drop(Box::from_raw(p));
    }
    0
}

// ---------------------------------------------------------------------------------------------
// Completion channels.

struct ChanShared {
    queue: Mutex<VecDeque<u32>>,
    fd: OwnedFd,
    stop: AtomicBool,
}

/// `ibv_comp_channel` plus our state. `fd` is an eventfd (semaphore mode) that a forwarder
/// thread signals for every CQ event of the device's channel, so it is pollable and honours
/// O_NONBLOCK like the kernel's.
#[repr(C)]
struct MrkitChannel {
    ch: ibv_comp_channel,
    chn: u32,
    shared: Arc<ChanShared>,
}

/// `struct ibv_comp_channel *ibv_create_comp_channel(struct ibv_context *)`.
///
/// # Safety
/// `ctx` NULL or an open context.
pub(crate) unsafe extern "C" fn ibv_create_comp_channel(
    ctx: *mut ibv_context,
) -> *mut ibv_comp_channel {
    // SAFETY: caller contract.
    let Some(m) = (unsafe { mctx(ctx) }) else {
        return fail_null(libc::EINVAL);
    };
    guard(std::ptr::null_mut(), || {
        // SAFETY: plain eventfd creation, checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_SEMAPHORE) };
        if fd < 0 {
            return std::ptr::null_mut();
        }
        // SAFETY: fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let raw = fd.as_raw_fd();
        let chn = m.soft.create_comp_channel();
        let shared = Arc::new(ChanShared {
            queue: Mutex::new(VecDeque::new()),
            fd,
            stop: AtomicBool::new(false),
        });
        let soft = m.soft.clone();
        let sh = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("mrkit-compchan".into())
            .spawn(move || {
                while !sh.stop.load(Ordering::Acquire) {
                    match soft.get_cq_event(chn, Some(Duration::from_millis(20))) {
                        Ok(Some(cqn)) => {
                            sh.queue
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push_back(cqn);
                            let one: u64 = 1;
                            // SAFETY: 8 bytes from a valid u64 to our own eventfd (alive:
                            // `sh` holds it).
                            unsafe {
                                libc::write(sh.fd.as_raw_fd(), (&one as *const u64).cast(), 8)
                            };
                        }
                        Ok(None) => {}
                        Err(_) => break,
                    }
                }
            });
        if spawned.is_err() {
            return fail_null(libc::ENOMEM);
        }
        Box::into_raw(Box::new(MrkitChannel {
            ch: ibv_comp_channel {
                context: ctx,
                fd: raw,
                refcnt: 0,
            },
            chn,
            shared,
        }))
        .cast()
    })
}

/// `int ibv_destroy_comp_channel(struct ibv_comp_channel *)`: EBUSY while CQs use it.
///
/// # Safety
/// `ch` NULL or a channel from [`ibv_create_comp_channel`]; not used after success.
pub(crate) unsafe extern "C" fn ibv_destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int {
    if ch.is_null() {
        return fail(libc::EINVAL);
    }
    // SAFETY: ch is live (caller contract).
    if unsafe { (*ch).refcnt } > 0 {
        return fail(libc::EBUSY);
    }
    // SAFETY: allocated as a MrkitChannel by ibv_create_comp_channel; freed once.
    let b = unsafe { Box::from_raw(ch.cast::<MrkitChannel>()) };
    b.shared.stop.store(true, Ordering::Release);
    0
}

/// `int ibv_get_cq_event(channel, struct ibv_cq **cq, void **cq_context)`: 0, or -1 with errno
/// (EAGAIN when the channel fd is non-blocking and nothing is pending).
///
/// # Safety
/// `ch` a live channel; `cq`/`cq_context` valid for writes.
pub(crate) unsafe extern "C" fn ibv_get_cq_event(
    ch: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    if ch.is_null() || cq.is_null() || cq_context.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: ch was created by ibv_create_comp_channel (caller contract).
    let mch = unsafe { &*ch.cast::<MrkitChannel>() };
    // SAFETY: the channel's context is open.
    let Some(m) = (unsafe { mctx(mch.ch.context) }) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    loop {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a valid u64 (semaphore eventfd: one event).
        let r = unsafe { libc::read(mch.ch.fd, (&mut v as *mut u64).cast(), 8) };
        if r != 8 {
            return -1; // errno from read
        }
        let cqn = mch
            .shared
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front();
        let Some(cqn) = cqn else { continue };
        let cqs = m.cqs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&p) = cqs.get(&cqn) {
            // SAFETY: p is a live MrkitCq of this context: ibv_destroy_cq removes it from the
            // map (under this lock) before freeing it.
            let c = unsafe { &*(p as *const MrkitCq) };
            // Counted under the map lock, so ibv_destroy_cq reads a final value.
            c.comp_reported.fetch_add(1, Ordering::AcqRel);
            let p = p as *mut ibv_cq;
            // SAFETY: the out-pointers are valid (caller contract); p is live (above).
            unsafe {
                *cq = p;
                *cq_context = (*p).cq_context;
            }
            return 0;
        }
        drop(cqs);
        // Event of a CQ destroyed meanwhile: skip it.
    }
}

/// `void ibv_ack_cq_events(struct ibv_cq *cq, unsigned int nevents)`: as libibverbs,
/// `comp_events_completed += nevents` under the CQ's mutex, signalling its cond (a pending
/// `ibv_destroy_cq` waits for all events `ibv_get_cq_event` returned to be acked).
///
/// # Safety
/// `cq` NULL or a live CQ.
pub(crate) unsafe extern "C" fn ibv_ack_cq_events(cq: *mut ibv_cq, nevents: u32) {
    if !cq.is_null() {
        // SAFETY: live CQ (caller contract) with initialised mutex/cond; the counter is only
        // written under the mutex.
        unsafe {
            add_completed(
                std::ptr::addr_of_mut!((*cq).mutex),
                std::ptr::addr_of_mut!((*cq).cond),
                std::ptr::addr_of_mut!((*cq).comp_events_completed),
                nevents,
            )
        };
    }
}

// ---------------------------------------------------------------------------------------------
// Completion queues.

const CQ_MAGIC: u64 = 0x6d72_6b69_7463_7121; // "mrkitcq!"

/// `ibv_cq_ex` (whose first 128 bytes are the `ibv_cq`) plus our state.
#[repr(C)]
struct MrkitCq {
    ex: ibv_cq_ex,
    magic: u64,
    cqn: u32,
    /// The completion the `ibv_cq_ex` poll API is positioned on.
    cur: Wc,
    /// Completion events `ibv_get_cq_event` returned for this CQ; incremented under the
    /// context's `cqs` map lock, read by `ibv_destroy_cq` after removing the CQ from that map
    /// (it then waits for `comp_events_completed` to reach it).
    comp_reported: AtomicU32,
    /// Async events (CQ_ERR) handed out for this CQ (`events.rs`).
    ev: Arc<ObjEvents>,
}

/// # Safety
/// `cq` NULL or a CQ created by this library, live.
unsafe fn mcq<'a>(cq: *mut ibv_cq) -> Option<&'a mut MrkitCq> {
    // SAFETY: forwarded contract.
    unsafe { obj(cq.cast()) }
}

fn empty_wc() -> Wc {
    Wc {
        wr_id: 0,
        status: mrkit_soft::cq::WcStatus::Success,
        opcode: mrkit_soft::cq::WcOpcode::Send,
        vendor_err: 0,
        byte_len: 0,
        imm_data: 0,
        qp_num: 0,
        src_qp: 0,
        wc_flags: 0,
    }
}

const WC_STANDARD_FLAGS: u64 = 0x7f;

/// # Safety
/// `ctx` an open context, `channel` NULL or a live channel of it.
unsafe fn create_cq_common(
    ctx: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> *mut MrkitCq {
    // SAFETY: caller contract.
    let Some(m) = (unsafe { mctx(ctx) }) else {
        return fail_null(libc::EINVAL);
    };
    if cqe <= 0 || comp_vector != 0 {
        return fail_null(libc::EINVAL);
    }
    let chn = if channel.is_null() {
        None
    } else {
        // SAFETY: a live channel (caller contract).
        Some(unsafe { (*channel.cast::<MrkitChannel>()).chn })
    };
    guard(std::ptr::null_mut(), || {
        let cqn = match m.soft.create_cq(cqe as u32, chn) {
            Ok(n) => n,
            Err(e) => return fail_null(soft_errno(&e)),
        };
        let mut ex: ibv_cq_ex = zeroed();
        ex.cq.context = ctx;
        ex.cq.channel = channel;
        ex.cq.cq_context = cq_context;
        ex.cq.handle = cqn;
        ex.cq.cqe = cqe;
        ex.start_poll = Some(cqex_start_poll);
        ex.next_poll = Some(cqex_next_poll);
        ex.end_poll = Some(cqex_end_poll);
        ex.read_opcode = Some(cqex_read_opcode);
        ex.read_vendor_err = Some(cqex_read_vendor_err);
        ex.read_byte_len = Some(cqex_read_byte_len);
        ex.read_imm_data = Some(cqex_read_imm_data);
        ex.read_qp_num = Some(cqex_read_qp_num);
        ex.read_src_qp = Some(cqex_read_src_qp);
        ex.read_wc_flags = Some(cqex_read_wc_flags);
        ex.read_slid = Some(cqex_read_zero32);
        ex.read_sl = Some(cqex_read_zero8);
        ex.read_dlid_path_bits = Some(cqex_read_zero8);
        let p = Box::into_raw(Box::new(MrkitCq {
            ex,
            magic: CQ_MAGIC,
            cqn,
            cur: empty_wc(),
            comp_reported: AtomicU32::new(0),
            ev: Arc::default(),
        }));
        if !channel.is_null() {
            // SAFETY: live channel.
            unsafe { (*channel).refcnt += 1 };
        }
        m.cqs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(cqn, p as usize);
        // SAFETY: p was just allocated above and is not shared yet.
        let ev = unsafe { &(*p).ev };
        m.router.register(Kind::Cq, cqn, &m.events, p as usize, ev);
        p
    })
}

/// `struct ibv_cq *ibv_create_cq(ctx, int cqe, void *cq_context, channel, int comp_vector)`.
///
/// # Safety
/// `ctx` NULL or an open context; `channel` NULL or a live channel of it.
pub(crate) unsafe extern "C" fn ibv_create_cq(
    ctx: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> *mut ibv_cq {
    // SAFETY: forwarded contract.
    unsafe { create_cq_common(ctx, cqe, cq_context, channel, comp_vector) }.cast()
}

/// `verbs_context.create_cq_ex(ctx, struct ibv_cq_init_attr_ex *)`: the standard WC fields
/// only (timestamps, cvlan, flow tag, TM info → EOPNOTSUPP); no parent domain.
///
/// # Safety
/// `ctx` an open context; `attr` valid.
pub(crate) unsafe extern "C" fn vctx_create_cq_ex(
    ctx: *mut ibv_context,
    attr: *mut ibv_cq_init_attr_ex,
) -> *mut ibv_cq_ex {
    if attr.is_null() {
        return fail_null(libc::EINVAL);
    }
    // SAFETY: attr valid (caller contract).
    let a = unsafe { *attr };
    if a.comp_mask & !1 != 0 || (a.comp_mask & 1 != 0 && a.flags != 0) {
        return fail_null(libc::EOPNOTSUPP);
    }
    if a.wc_flags & !WC_STANDARD_FLAGS != 0 {
        return fail_null(libc::EOPNOTSUPP);
    }
    // SAFETY: forwarded contract.
    unsafe {
        create_cq_common(
            ctx,
            a.cqe.min(i32::MAX as u32) as c_int,
            a.cq_context,
            a.channel,
            a.comp_vector.min(i32::MAX as u32) as c_int,
        )
    }
    .cast()
}

/// `int ibv_destroy_cq(struct ibv_cq *)`: EBUSY while QPs use it. Then, as libibverbs, waits
/// until every completion event `ibv_get_cq_event` returned and every async event
/// `ibv_get_async_event` returned for it were acked (unread async events are dropped).
///
/// # Safety
/// `cq` NULL or a live CQ; not used after success.
pub(crate) unsafe extern "C" fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int {
    // SAFETY: caller contract (a live object of this library; its context is open).
    let Some((c, m)) = (unsafe { obj_ctx::<MrkitCq>(cq.cast()) }) else {
        return fail(libc::EINVAL);
    };
    if let Err(e) = m.soft.destroy_cq(c.cqn) {
        return fail(soft_errno(&e));
    }
    m.cqs
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&c.cqn);
    let async_reported = m.router.unregister(Kind::Cq, c.cqn, &c.ev);
    let comp_reported = c.comp_reported.load(Ordering::Acquire);
    // SAFETY: cq is live (freed below); mutex/cond initialised; the counters are written
    // under that mutex (ibv_ack_cq_events / ibv_ack_async_event).
    unsafe {
        wait_until(
            std::ptr::addr_of_mut!((*cq).mutex),
            std::ptr::addr_of_mut!((*cq).cond),
            || {
                (*cq).comp_events_completed == comp_reported
                    && (*cq).async_events_completed == async_reported
            },
        )
    };
    let ch = c.ex.cq.channel;
    if !ch.is_null() {
        // SAFETY: the channel outlives its CQs (destroy_comp_channel is EBUSY until then).
        unsafe { (*ch).refcnt -= 1 };
    }
    c.magic = 0;
    // SAFETY: allocated by Box in create_cq_common; freed once.
    drop(unsafe { Box::from_raw(cq.cast::<MrkitCq>()) });
    0
}

/// `int ibv_resize_cq(struct ibv_cq *, int cqe)`.
///
/// # Safety
/// `cq` NULL or a live CQ.
pub(crate) unsafe extern "C" fn ibv_resize_cq(cq: *mut ibv_cq, cqe: c_int) -> c_int {
    // SAFETY: caller contract (a live object of this library; its context is open).
    let Some((c, m)) = (unsafe { obj_ctx::<MrkitCq>(cq.cast()) }) else {
        return fail(libc::EINVAL);
    };
    if cqe <= 0 {
        return fail(libc::EINVAL);
    }
    match m.soft.resize_cq(c.cqn, cqe as u32) {
        Ok(()) => {
            c.ex.cq.cqe = cqe;
            0
        }
        Err(e) => fail(soft_errno(&e)),
    }
}

fn wc_to_c(w: &Wc) -> ibv_wc {
    let imm = if w.wc_flags & WC_WITH_IMM != 0 {
        w.imm_data.to_be()
    } else if w.wc_flags & WC_WITH_INV != 0 {
        w.imm_data
    } else {
        0
    };
    ibv_wc {
        wr_id: w.wr_id,
        status: w.status as u32,
        opcode: w.opcode as u32,
        vendor_err: w.vendor_err,
        byte_len: w.byte_len,
        imm_data: imm,
        qp_num: w.qp_num,
        src_qp: w.src_qp,
        wc_flags: w.wc_flags,
        pkey_index: 0,
        slid: 0,
        sl: 0,
        dlid_path_bits: 0,
    }
}

thread_local! {
    static WC_BUF: std::cell::RefCell<Vec<Wc>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn poll_into(c: &MrkitCq, m: &MrkitContext, max: usize, mut f: impl FnMut(usize, &Wc)) -> c_int {
    WC_BUF.with(|b| {
        let mut b = b.borrow_mut();
        b.clear();
        match m.soft.poll_cq(c.cqn, &mut b, max) {
            Ok(_) => {
                for (i, w) in b.iter().enumerate() {
                    f(i, w);
                }
                b.len() as c_int
            }
            Err(e) => -soft_errno(&e),
        }
    })
}

/// `ops.poll_cq(cq, num_entries, wc)`: number of completions, or a negative errno.
///
/// # Safety
/// `cq` a live CQ; `wc` valid for `n` entries.
pub(crate) unsafe extern "C" fn op_poll_cq(cq: *mut c_void, n: c_int, wc: *mut c_void) -> c_int {
    // SAFETY: caller contract (a live object of this library; its context is open).
    let Some((c, m)) = (unsafe { obj_ctx::<MrkitCq>(cq.cast()) }) else {
        return -libc::EINVAL;
    };
    if n <= 0 {
        return 0;
    }
    let wc = wc.cast::<ibv_wc>();
    guard(-libc::EIO, || {
        poll_into(c, m, n as usize, |i, w| {
            // SAFETY: i < n and wc is valid for n entries (caller contract).
            unsafe { wc.add(i).write(wc_to_c(w)) }
        })
    })
}

/// `ops.req_notify_cq(cq, solicited_only)`.
///
/// # Safety
/// `cq` a live CQ.
pub(crate) unsafe extern "C" fn op_req_notify_cq(cq: *mut c_void, solicited: c_int) -> c_int {
    // SAFETY: caller contract (a live object of this library; its context is open).
    let Some((c, m)) = (unsafe { obj_ctx::<MrkitCq>(cq.cast()) }) else {
        return libc::EINVAL;
    };
    match m.soft.req_notify_cq(c.cqn, solicited != 0) {
        Ok(()) => 0,
        Err(e) => soft_errno(&e),
    }
}

/// # Safety
/// `cq` a live `ibv_cq_ex` of this library.
unsafe fn cqex_poll_one(cq: *mut ibv_cq_ex) -> c_int {
    // SAFETY: caller contract (a live object of this library; its context is open).
    let Some((c, m)) = (unsafe { obj_ctx::<MrkitCq>(cq.cast()) }) else {
        return libc::EINVAL;
    };
    let mut got = None;
    let r = poll_into(c, m, 1, |_, w| got = Some(*w));
    if r < 0 {
        return -r;
    }
    match got {
        Some(w) => {
            c.cur = w;
            c.ex.status = w.status as u32;
            c.ex.wr_id = w.wr_id;
            0
        }
        None => libc::ENOENT,
    }
}

unsafe extern "C" fn cqex_start_poll(cq: *mut ibv_cq_ex, _attr: *mut c_void) -> c_int {
    // SAFETY: forwarded contract (cq from this library).
    unsafe { cqex_poll_one(cq) }
}

unsafe extern "C" fn cqex_next_poll(cq: *mut ibv_cq_ex) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { cqex_poll_one(cq) }
}

unsafe extern "C" fn cqex_end_poll(_cq: *mut ibv_cq_ex) {}

/// # Safety
/// `cq` a live `ibv_cq_ex` of this library.
unsafe fn cur(cq: *mut ibv_cq_ex) -> ibv_wc {
    // SAFETY: caller contract.
    match unsafe { mcq(cq.cast()) } {
        Some(c) => wc_to_c(&c.cur),
        None => ibv_wc::default(),
    }
}

unsafe extern "C" fn cqex_read_opcode(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: forwarded contract.
    unsafe { cur(cq) }.opcode
}
unsafe extern "C" fn cqex_read_vendor_err(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: forwarded contract.
    unsafe { cur(cq) }.vendor_err
}
unsafe extern "C" fn cqex_read_byte_len(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: forwarded contract.
    unsafe { cur(cq) }.byte_len
}
unsafe extern "C" fn cqex_read_imm_data(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: forwarded contract.
    unsafe { cur(cq) }.imm_data
}
unsafe extern "C" fn cqex_read_qp_num(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: forwarded contract.
    unsafe { cur(cq) }.qp_num
}
unsafe extern "C" fn cqex_read_src_qp(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: forwarded contract.
    unsafe { cur(cq) }.src_qp
}
unsafe extern "C" fn cqex_read_wc_flags(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: forwarded contract.
    unsafe { cur(cq) }.wc_flags
}
unsafe extern "C" fn cqex_read_zero32(_cq: *mut ibv_cq_ex) -> u32 {
    0
}
unsafe extern "C" fn cqex_read_zero8(_cq: *mut ibv_cq_ex) -> u8 {
    0
}

// ---------------------------------------------------------------------------------------------
// Shared receive queues.

const SRQ_MAGIC: u64 = 0x6d72_6b69_7473_7271; // "mrkitsrq"

#[repr(C)]
struct MrkitSrq {
    srq: ibv_srq,
    magic: u64,
    srqn: u32,
    /// Async events (SRQ_LIMIT_REACHED) handed out for this SRQ (`events.rs`).
    ev: Arc<ObjEvents>,
}

/// # Safety
/// `srq` NULL or a live SRQ of this library.
unsafe fn msrq<'a>(srq: *mut ibv_srq) -> Option<&'a mut MrkitSrq> {
    // SAFETY: forwarded contract.
    unsafe { obj(srq.cast()) }
}

/// `struct ibv_srq *ibv_create_srq(struct ibv_pd *, struct ibv_srq_init_attr *)`; the actual
/// attributes are written back to `init_attr->attr`.
///
/// # Safety
/// `pd` NULL or a live PD; `init` valid.
pub(crate) unsafe extern "C" fn ibv_create_srq(
    pd: *mut ibv_pd,
    init: *mut ibv_srq_init_attr,
) -> *mut ibv_srq {
    // SAFETY: caller contract.
    let (Some((ctx, handle, m)), false) = ((unsafe { pd_parts(pd) }), init.is_null()) else {
        return fail_null(libc::EINVAL);
    };
    // SAFETY: valid init (caller contract).
    let ia = unsafe { *init };
    guard(std::ptr::null_mut(), || {
        let attr = SrqAttr {
            max_wr: ia.attr.max_wr,
            max_sge: ia.attr.max_sge,
            srq_limit: ia.attr.srq_limit,
        };
        match m.soft.create_srq(handle, attr) {
            Ok((srqn, got)) => {
                // SAFETY: init valid for writes.
                unsafe {
                    (*init).attr.max_wr = got.max_wr;
                    (*init).attr.max_sge = got.max_sge;
                }
                let mut srq: ibv_srq = zeroed();
                srq.context = ctx;
                srq.srq_context = ia.srq_context;
                srq.pd = pd;
                srq.handle = srqn;
                let ev = Arc::<ObjEvents>::default();
                let p = Box::into_raw(Box::new(MrkitSrq {
                    srq,
                    magic: SRQ_MAGIC,
                    srqn,
                    ev: ev.clone(),
                }));
                m.router
                    .register(Kind::Srq, srqn, &m.events, p as usize, &ev);
                p.cast()
            }
            Err(e) => fail_null(soft_errno(&e)),
        }
    })
}

/// `int ibv_modify_srq(struct ibv_srq *, struct ibv_srq_attr *, int srq_attr_mask)`.
///
/// # Safety
/// `srq` NULL or a live SRQ; `attr` valid.
pub(crate) unsafe extern "C" fn ibv_modify_srq(
    srq: *mut ibv_srq,
    attr: *mut ibv_srq_attr,
    mask: c_int,
) -> c_int {
    // SAFETY: caller contract (a live object of this library; its context is open).
    let Some((s, m)) = (unsafe { obj_ctx::<MrkitSrq>(srq.cast()) }) else {
        return fail(libc::EINVAL);
    };
    if attr.is_null() {
        return fail(libc::EINVAL);
    }
    // SAFETY: attr valid (caller contract).
    let a = unsafe { *attr };
    let sa = SrqAttr {
        max_wr: a.max_wr,
        max_sge: a.max_sge,
        srq_limit: a.srq_limit,
    };
    match m.soft.modify_srq(s.srqn, sa, mask as u32) {
        Ok(()) => 0,
        Err(e) => fail(soft_errno(&e)),
    }
}

/// `int ibv_query_srq(struct ibv_srq *, struct ibv_srq_attr *)`.
///
/// # Safety
/// `srq` NULL or a live SRQ; `attr` valid for a write.
pub(crate) unsafe extern "C" fn ibv_query_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr) -> c_int {
    // SAFETY: caller contract (a live object of this library; its context is open).
    let Some((s, m)) = (unsafe { obj_ctx::<MrkitSrq>(srq.cast()) }) else {
        return fail(libc::EINVAL);
    };
    if attr.is_null() {
        return fail(libc::EINVAL);
    }
    match m.soft.query_srq(s.srqn) {
        Ok(a) => {
            // SAFETY: attr valid for a write.
            unsafe {
                attr.write(ibv_srq_attr {
                    max_wr: a.max_wr,
                    max_sge: a.max_sge,
                    srq_limit: a.srq_limit,
                })
            };
            0
        }
        Err(e) => fail(soft_errno(&e)),
    }
}

/// `int ibv_destroy_srq(struct ibv_srq *)`: EBUSY while QPs use it; then waits until every
/// async event returned for it was acked (unread ones are dropped), as libibverbs.
///
/// # Safety
/// `srq` NULL or a live SRQ; not used after success.
pub(crate) unsafe extern "C" fn ibv_destroy_srq(srq: *mut ibv_srq) -> c_int {
    // SAFETY: caller contract (a live object of this library; its context is open).
    let Some((s, m)) = (unsafe { obj_ctx::<MrkitSrq>(srq.cast()) }) else {
        return fail(libc::EINVAL);
    };
    let r = m.soft.destroy_srq(s.srqn);
    // SAFETY: srq is a live MrkitSrq (checked above); not used after success (caller contract).
    unsafe { finish_destroy(srq.cast::<MrkitSrq>(), m, r) }
}

// ---------------------------------------------------------------------------------------------
// Address handles and address vectors.

fn ip_of_gid(g: &[u8; 16]) -> IpAddr {
    if g[..10].iter().all(|&b| b == 0) && g[10] == 0xff && g[11] == 0xff {
        IpAddr::V4(Ipv4Addr::new(g[12], g[13], g[14], g[15]))
    } else {
        IpAddr::V6(Ipv6Addr::from(*g))
    }
}

fn gid_of_ip(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

fn av_from_c(m: &MrkitContext, a: &ibv_ah_attr) -> AddressVector {
    if a.is_global != 0 {
        AddressVector {
            dest_node: 0,
            dgid: Some(ip_of_gid(&a.grh.dgid.raw)),
            port_num: a.port_num,
        }
    } else {
        AddressVector {
            dest_node: m.soft.node_id(),
            dgid: None,
            port_num: a.port_num,
        }
    }
}

fn av_to_c(av: &AddressVector) -> ibv_ah_attr {
    let mut a = ibv_ah_attr {
        port_num: av.port_num,
        ..Default::default()
    };
    if let Some(ip) = av.dgid {
        a.is_global = 1;
        a.grh.dgid.raw = gid_of_ip(ip);
        a.grh.hop_limit = 1;
    }
    a
}

#[repr(C)]
struct MrkitAh {
    ah: ibv_ah,
    attr: ibv_ah_attr,
}

/// `struct ibv_ah *ibv_create_ah(struct ibv_pd *, struct ibv_ah_attr *)`: port 1 and a GRH
/// only (RoCE); the attributes are kept (mrkit0 has no UD QPs, so nothing sends through it yet).
///
/// # Safety
/// `pd` NULL or a live PD; `attr` valid.
pub(crate) unsafe extern "C" fn ibv_create_ah(
    pd: *mut ibv_pd,
    attr: *mut ibv_ah_attr,
) -> *mut ibv_ah {
    if pd.is_null() || attr.is_null() {
        return fail_null(libc::EINVAL);
    }
    // SAFETY: live PD, valid attr (caller contract).
    let (ctx, a) = unsafe { ((*pd).context, *attr) };
    // SAFETY: the PD's context is open.
    if unsafe { mctx(ctx) }.is_none() || a.port_num != 1 {
        return fail_null(libc::EINVAL);
    }
    // RoCE: an AH needs a GRH (the kernel's rdma_check_ah_attr: EINVAL).
    if a.is_global == 0 {
        return fail_null(libc::EINVAL);
    }
    Box::into_raw(Box::new(MrkitAh {
        ah: ibv_ah {
            context: ctx,
            pd,
            handle: 0,
        },
        attr: a,
    }))
    .cast()
}

/// `int ibv_destroy_ah(struct ibv_ah *)`.
///
/// # Safety
/// `ah` NULL or a live AH; not used afterwards.
pub(crate) unsafe extern "C" fn ibv_destroy_ah(ah: *mut ibv_ah) -> c_int {
    if ah.is_null() {
        return fail(libc::EINVAL);
    }
    // SAFETY: allocated by Box in ibv_create_ah; freed once.
    drop(unsafe { Box::from_raw(ah.cast::<MrkitAh>()) });
    0
}

// ---------------------------------------------------------------------------------------------
// Queue pairs.

const QP_MAGIC: u64 = 0x6d72_6b69_7471_7021; // "mrkitqp!"

#[repr(C)]
struct MrkitQp {
    qp: ibv_qp,
    /// Room for the rest of an `ibv_qp_ex` (352 bytes), never handed out as such.
    _ex: [u64; 24],
    magic: u64,
    qpn: u32,
    cap: ibv_qp_cap,
    sq_sig_all: c_int,
    /// Async events handed out for this QP (`events.rs`).
    ev: Arc<ObjEvents>,
}

/// `struct ibv_qp *ibv_create_qp(struct ibv_pd *, struct ibv_qp_init_attr *)`: RC only (other
/// types → EOPNOTSUPP). The actual caps are written back to `init_attr->cap`.
///
/// # Safety
/// `pd` NULL or a live PD; `init` valid; its CQs/SRQ live objects of this library.
pub(crate) unsafe extern "C" fn ibv_create_qp(
    pd: *mut ibv_pd,
    init: *mut ibv_qp_init_attr,
) -> *mut ibv_qp {
    // SAFETY: caller contract.
    let (Some((ctx, pdh, m)), false) = ((unsafe { pd_parts(pd) }), init.is_null()) else {
        return fail_null(libc::EINVAL);
    };
    // SAFETY: valid init (caller contract).
    let ia = unsafe { *init };
    if ia.qp_type != IBV_QPT_RC {
        return fail_null(libc::EOPNOTSUPP);
    }
    // SAFETY: the CQs / SRQ are NULL or live objects of this library (caller contract).
    let (scq, rcq, srq) = unsafe { (mcq(ia.send_cq), mcq(ia.recv_cq), msrq(ia.srq)) };
    let (Some(scq), Some(rcq)) = (scq, rcq) else {
        return fail_null(libc::EINVAL);
    };
    if !ia.srq.is_null() && srq.is_none() {
        return fail_null(libc::EINVAL);
    }
    guard(std::ptr::null_mut(), || {
        let init_attr = QpInitAttr {
            pd: pdh,
            send_cq: scq.cqn,
            recv_cq: rcq.cqn,
            cap: QpCap {
                max_send_wr: ia.cap.max_send_wr,
                max_recv_wr: ia.cap.max_recv_wr,
                max_send_sge: ia.cap.max_send_sge,
                max_recv_sge: ia.cap.max_recv_sge,
                max_inline_data: ia.cap.max_inline_data,
            },
            sq_sig_all: ia.sq_sig_all != 0,
        };
        let r = match &srq {
            Some(s) => m.soft.create_qp_srq(init_attr, s.srqn),
            None => m.soft.create_qp(init_attr),
        };
        match r {
            Ok((qpn, c)) => {
                let cap = ibv_qp_cap {
                    max_send_wr: c.max_send_wr,
                    max_recv_wr: c.max_recv_wr,
                    max_send_sge: c.max_send_sge,
                    max_recv_sge: c.max_recv_sge,
                    max_inline_data: c.max_inline_data,
                };
                // SAFETY: init valid for writes.
                unsafe { (*init).cap = cap };
                let mut qp: ibv_qp = zeroed();
                qp.context = ctx;
                qp.qp_context = ia.qp_context;
                qp.pd = pd;
                qp.send_cq = ia.send_cq;
                qp.recv_cq = ia.recv_cq;
                qp.srq = ia.srq;
                qp.handle = qpn;
                qp.qp_num = qpn;
                qp.state = 0; // IBV_QPS_RESET
                qp.qp_type = IBV_QPT_RC;
                let ev = Arc::<ObjEvents>::default();
                let p = Box::into_raw(Box::new(MrkitQp {
                    qp,
                    _ex: [0; 24],
                    magic: QP_MAGIC,
                    qpn,
                    cap,
                    sq_sig_all: ia.sq_sig_all,
                    ev: ev.clone(),
                }));
                m.router.register(Kind::Qp, qpn, &m.events, p as usize, &ev);
                p.cast()
            }
            Err(e) => fail_null(soft_errno(&e)),
        }
    })
}

/// `int ibv_modify_qp(struct ibv_qp *, struct ibv_qp_attr *, int attr_mask)`: 0 or the errno
/// value (errno set too). The mask bits are `enum ibv_qp_attr_mask`.
///
/// # Safety
/// `qp` NULL or a live QP; `attr` valid.
pub(crate) unsafe extern "C" fn ibv_modify_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    mask: c_int,
) -> c_int {
    // SAFETY: caller contract (a live object of this library; its context is open).
    let Some((q, m)) = (unsafe { obj_ctx::<MrkitQp>(qp.cast()) }) else {
        return fail(libc::EINVAL);
    };
    if attr.is_null() {
        return fail(libc::EINVAL);
    }
    // SAFETY: attr valid (caller contract).
    let a = unsafe { *attr };
    let sa = QpAttr {
        qp_state: a.qp_state,
        cur_qp_state: a.cur_qp_state,
        en_sqd_async_notify: a.en_sqd_async_notify != 0,
        qp_access_flags: AccessFlags::from_bits_retain(a.qp_access_flags),
        pkey_index: a.pkey_index,
        port_num: a.port_num,
        ah_attr: av_from_c(m, &a.ah_attr),
        path_mtu: a.path_mtu.min(255) as u8,
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
        rq_psn: a.rq_psn,
        max_rd_atomic: u32::from(a.max_rd_atomic),
        min_rnr_timer: a.min_rnr_timer,
        sq_psn: a.sq_psn,
        max_dest_rd_atomic: u32::from(a.max_dest_rd_atomic),
        dest_qp_num: a.dest_qp_num,
        cap: QpCap {
            max_send_wr: a.cap.max_send_wr,
            max_recv_wr: a.cap.max_recv_wr,
            max_send_sge: a.cap.max_send_sge,
            max_recv_sge: a.cap.max_recv_sge,
            max_inline_data: a.cap.max_inline_data,
        },
    };
    guard(libc::EIO, || {
        match m.soft.modify_qp(q.qpn, &sa, mask as u32) {
            Ok(()) => {
                if let Ok(st) = m.soft.qp_state(q.qpn) {
                    q.qp.state = st as u32;
                }
                if mask as u32 & mrkit_soft::qp::attr_mask::CAP != 0 {
                    q.cap = a.cap;
                }
                0
            }
            Err(e) => fail(soft_errno(&e)),
        }
    })
}

/// `int ibv_query_qp(qp, struct ibv_qp_attr *, int attr_mask, struct ibv_qp_init_attr *)`:
/// fills every attribute regardless of the mask (allowed by the verbs spec).
///
/// # Safety
/// `qp` NULL or a live QP; `attr` and `init` valid for writes.
pub(crate) unsafe extern "C" fn ibv_query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    _mask: c_int,
    init: *mut ibv_qp_init_attr,
) -> c_int {
    // SAFETY: caller contract (a live object of this library; its context is open).
    let Some((q, m)) = (unsafe { obj_ctx::<MrkitQp>(qp.cast()) }) else {
        return fail(libc::EINVAL);
    };
    if attr.is_null() || init.is_null() {
        return fail(libc::EINVAL);
    }
    let a = match m.soft.query_qp(q.qpn) {
        Ok(a) => a,
        Err(e) => return fail(soft_errno(&e)),
    };
    let cap = ibv_qp_cap {
        max_send_wr: a.cap.max_send_wr,
        max_recv_wr: a.cap.max_recv_wr,
        max_send_sge: a.cap.max_send_sge,
        max_recv_sge: a.cap.max_recv_sge,
        max_inline_data: a.cap.max_inline_data,
    };
    let out = ibv_qp_attr {
        qp_state: a.qp_state,
        cur_qp_state: a.cur_qp_state,
        path_mtu: u32::from(a.path_mtu),
        path_mig_state: 0, // IBV_MIG_MIGRATED
        qkey: 0,
        rq_psn: a.rq_psn,
        sq_psn: a.sq_psn,
        dest_qp_num: a.dest_qp_num,
        qp_access_flags: a.qp_access_flags.bits(),
        cap,
        ah_attr: av_to_c(&a.ah_attr),
        alt_ah_attr: ibv_ah_attr::default(),
        pkey_index: a.pkey_index,
        alt_pkey_index: 0,
        en_sqd_async_notify: u8::from(a.en_sqd_async_notify),
        sq_draining: 0,
        max_rd_atomic: a.max_rd_atomic.min(255) as u8,
        max_dest_rd_atomic: a.max_dest_rd_atomic.min(255) as u8,
        min_rnr_timer: a.min_rnr_timer,
        port_num: a.port_num,
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
        alt_port_num: 0,
        alt_timeout: 0,
        rate_limit: 0,
    };
    q.qp.state = a.qp_state;
    // SAFETY: attr and init valid for writes (caller contract).
    unsafe {
        attr.write(out);
        init.write(ibv_qp_init_attr {
            qp_context: q.qp.qp_context,
            send_cq: q.qp.send_cq,
            recv_cq: q.qp.recv_cq,
            srq: q.qp.srq,
            cap,
            qp_type: IBV_QPT_RC,
            sq_sig_all: q.sq_sig_all,
        });
    }
    0
}

/// `int ibv_destroy_qp(struct ibv_qp *)`; waits until every async event returned for the QP
/// was acked (unread ones are dropped), as libibverbs.
///
/// # Safety
/// `qp` NULL or a live QP; not used after success.
pub(crate) unsafe extern "C" fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int {
    // SAFETY: caller contract (a live object of this library; its context is open).
    let Some((q, m)) = (unsafe { obj_ctx::<MrkitQp>(qp.cast()) }) else {
        return fail(libc::EINVAL);
    };
    let r = m.soft.destroy_qp(q.qpn);
    // SAFETY: qp is a live MrkitQp (checked above); not used after success (caller contract).
    unsafe { finish_destroy(qp.cast::<MrkitQp>(), m, r) }
}

// ---------------------------------------------------------------------------------------------
// Posting.

/// # Safety
/// `sg` valid for `n` entries when `n > 0`.
unsafe fn sges(sg: *const ibv_sge, n: c_int) -> Vec<Sge> {
    let mut v = Vec::new();
    // SAFETY: forwarded contract.
    unsafe { extend_sges(&mut v, sg, n) };
    v
}

/// Append the `n` entries of the C gather/scatter list `sg` to `out`.
///
/// # Safety
/// `sg` valid for `n` entries when `n > 0`.
unsafe fn extend_sges(out: &mut Vec<Sge>, sg: *const ibv_sge, n: c_int) {
    if n <= 0 || sg.is_null() {
        return;
    }
    // SAFETY: caller contract.
    let c = unsafe { std::slice::from_raw_parts(sg, n as usize) };
    out.extend(c.iter().map(|s| Sge {
        addr: s.addr,
        length: s.length,
        lkey: s.lkey,
    }));
}

fn opcode_of(op: u32) -> Option<WrOpcode> {
    Some(match op {
        0 => WrOpcode::RdmaWrite,
        1 => WrOpcode::RdmaWriteWithImm,
        2 => WrOpcode::Send,
        3 => WrOpcode::SendWithImm,
        4 => WrOpcode::RdmaRead,
        5 => WrOpcode::AtomicCmpAndSwp,
        6 => WrOpcode::AtomicFetchAndAdd,
        7 => WrOpcode::LocalInv,
        8 => WrOpcode::BindMw,
        9 => WrOpcode::SendWithInv,
        _ => return None,
    })
}

const SEND_INLINE: u32 = 8;

/// Translate one `ibv_send_wr` into `s`, reusing the capacity of its two vectors (a thread
/// posting one WR at a time allocates nothing per post, `op_post_send`).
///
/// # Safety
/// `w` a valid WR whose `sg_list` (and, for INLINE, the memory it describes) is readable, and
/// whose `bind_mw.mw` / `bind_info.mr` are live objects when the opcode is BIND_MW.
unsafe fn send_wr_from_c(w: &ibv_send_wr, s: &mut SendWr) -> Result<(), c_int> {
    let opcode = opcode_of(w.opcode).ok_or(libc::EINVAL)?;
    let mut sg = std::mem::take(&mut s.sg_list);
    let mut data = std::mem::take(&mut s.inline_data);
    sg.clear();
    data.clear();
    // SAFETY: forwarded contract (`num_sge` readable entries).
    unsafe { extend_sges(&mut sg, w.sg_list, w.num_sge) };
    *s = SendWr::new(w.wr_id, opcode).flags(w.send_flags);
    match opcode {
        WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm | WrOpcode::RdmaRead => {
            s.remote_addr = w.wr[0];
            s.rkey = w.wr[1] as u32;
        }
        WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => {
            s.remote_addr = w.wr[0];
            s.compare_add = w.wr[1];
            s.swap = w.wr[2];
            s.rkey = w.wr[3] as u32;
        }
        WrOpcode::BindMw => {
            let mw = w.bind_mw[0] as *mut ibv_mw;
            let mr = w.bind_mw[2] as *mut ibv_mr;
            if mw.is_null() {
                return Err(libc::EINVAL);
            }
            // SAFETY: live MW / MR (caller contract).
            let (mw_rkey, mr_lkey) =
                unsafe { ((*mw).rkey, if mr.is_null() { 0 } else { (*mr).lkey }) };
            s.bind = Some(BindWr {
                mw_rkey,
                new_key: w.bind_mw[1] as u8,
                info: BindInfo {
                    mr_lkey,
                    addr: w.bind_mw[3],
                    length: w.bind_mw[4],
                    access: AccessFlags::from_bits_retain(w.bind_mw[5] as u32),
                },
            });
        }
        _ => {}
    }
    match opcode {
        WrOpcode::RdmaWriteWithImm | WrOpcode::SendWithImm => s.imm_data = u32::from_be(w.imm_data),
        WrOpcode::SendWithInv | WrOpcode::LocalInv => s.invalidate_rkey = w.imm_data,
        _ => {}
    }
    if w.send_flags & SEND_INLINE != 0 {
        for g in &sg {
            if g.length > 0 {
                // SAFETY: the application's gather list is readable at post time (INLINE
                // contract); addresses are process virtual addresses.
                data.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(g.addr as usize as *const u8, g.length as usize)
                });
            }
        }
    }
    s.inline_data = data;
    s.sg_list = sg;
    Ok(())
}

/// WRs a thread keeps translated for reuse (their vectors' capacity with them).
const POST_SCRATCH_WRS: usize = 64;

thread_local! {
    /// `op_post_send`'s translated chain, reused per thread: the WR pointers and the WRs.
    static POST_SEND_SCRATCH: std::cell::RefCell<(Vec<*mut ibv_send_wr>, Vec<SendWr>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// `ops.post_send(qp, wr, bad_wr)`: 0, or an errno value with `*bad_wr` the first WR not
/// posted.
///
/// # Safety
/// `qp` a live QP; `wr` a valid chain; `bad_wr` valid for a write.
pub(crate) unsafe extern "C" fn op_post_send(
    qp: *mut c_void,
    wr: *mut c_void,
    bad_wr: *mut *mut c_void,
) -> c_int {
    let set_bad = |p: *mut ibv_send_wr| {
        if !bad_wr.is_null() {
            // SAFETY: valid out-pointer (caller contract).
            unsafe { bad_wr.write(p.cast()) };
        }
    };
    // SAFETY: caller contract (a live object of this library; its context is open).
    let Some((q, m)) = (unsafe { obj_ctx::<MrkitQp>(qp.cast()) }) else {
        set_bad(wr.cast());
        return fail(libc::EINVAL);
    };
    let qpn = q.qpn;
    let post = |ptrs: &mut Vec<*mut ibv_send_wr>, wrs: &mut Vec<SendWr>| {
        ptrs.clear();
        let mut early: Option<c_int> = None;
        let mut p = wr.cast::<ibv_send_wr>();
        while !p.is_null() {
            // SAFETY: p is an element of the caller's valid chain.
            let w = unsafe { &*p };
            let n = ptrs.len();
            if n == wrs.len() {
                wrs.push(SendWr::new(0, WrOpcode::Send));
            }
            // SAFETY: forwarded contract for the WR's memory.
            match unsafe { send_wr_from_c(w, &mut wrs[n]) } {
                Ok(()) => ptrs.push(p),
                Err(e) => {
                    early = Some(e);
                    break;
                }
            }
            p = w.next;
        }
        let n = ptrs.len();
        let r = if n > 0 {
            m.soft.post_send(qpn, &wrs[..n]).err()
        } else {
            None
        };
        wrs.truncate(POST_SCRATCH_WRS);
        if let Some(PostError { bad_wr: i, error }) = r {
            set_bad(ptrs[i]);
            return fail(soft_errno(&error));
        }
        if let Some(e) = early {
            set_bad(p);
            return fail(e);
        }
        0
    };
    guard(libc::EIO, || {
        // This thread's scratch, unless it is in use (a post from a signal handler that
        // interrupted a post): then fresh vectors.
        POST_SEND_SCRATCH
            .try_with(|c| match c.try_borrow_mut() {
                Ok(mut g) => {
                    let (ptrs, wrs) = &mut *g;
                    post(ptrs, wrs)
                }
                Err(_) => post(&mut Vec::new(), &mut Vec::new()),
            })
            .unwrap_or_else(|_| post(&mut Vec::new(), &mut Vec::new()))
    })
}

/// Translate a receive chain.
///
/// # Safety
/// `wr` a valid chain.
unsafe fn recv_chain(wr: *mut ibv_recv_wr) -> (Vec<*mut ibv_recv_wr>, Vec<RecvWr>) {
    let mut ptrs = Vec::new();
    let mut wrs = Vec::new();
    let mut p = wr;
    while !p.is_null() {
        // SAFETY: element of the caller's chain.
        let w = unsafe { &*p };
        ptrs.push(p);
        wrs.push(RecvWr {
            wr_id: w.wr_id,
            // SAFETY: the WR's sg_list is valid for num_sge entries.
            sg_list: unsafe { sges(w.sg_list, w.num_sge) },
        });
        p = w.next;
    }
    (ptrs, wrs)
}

/// Post a receive chain through `post` (the QP's RQ or an SRQ): `*bad_wr` is the first WR not
/// posted on failure (all of them when `target` is not a live object of this library).
///
/// # Safety
/// `target` NULL or a live `T` of this library; `wr` a valid chain; `bad_wr` NULL or valid for
/// a write.
unsafe fn post_recv_common<T: Obj>(
    target: *mut c_void,
    wr: *mut c_void,
    bad_wr: *mut *mut c_void,
    post: impl FnOnce(&MrkitContext, &T, &[RecvWr]) -> Result<(), PostError>,
) -> c_int {
    let set_bad = |p: *mut c_void| {
        if !bad_wr.is_null() {
            // SAFETY: valid out-pointer (caller contract).
            unsafe { bad_wr.write(p) };
        }
    };
    // SAFETY: caller contract (a live object of this library; its context is open).
    let Some((t, m)) = (unsafe { obj_ctx::<T>(target) }) else {
        set_bad(wr);
        return fail(libc::EINVAL);
    };
    guard(libc::EIO, || {
        // SAFETY: caller contract.
        let (ptrs, wrs) = unsafe { recv_chain(wr.cast()) };
        match post(m, t, &wrs) {
            Ok(()) => 0,
            Err(PostError { bad_wr: i, error }) => {
                set_bad(ptrs[i].cast());
                fail(soft_errno(&error))
            }
        }
    })
}

/// `ops.post_recv(qp, wr, bad_wr)`.
///
/// # Safety
/// `qp` a live QP; `wr` a valid chain; `bad_wr` valid for a write.
pub(crate) unsafe extern "C" fn op_post_recv(
    qp: *mut c_void,
    wr: *mut c_void,
    bad_wr: *mut *mut c_void,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe {
        post_recv_common(qp, wr, bad_wr, |m, q: &MrkitQp, wrs| {
            m.soft.post_recv(q.qpn, wrs)
        })
    }
}

/// `ops.post_srq_recv(srq, wr, bad_wr)`.
///
/// # Safety
/// `srq` a live SRQ; `wr` a valid chain; `bad_wr` valid for a write.
pub(crate) unsafe extern "C" fn op_post_srq_recv(
    srq: *mut c_void,
    wr: *mut c_void,
    bad_wr: *mut *mut c_void,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe {
        post_recv_common(srq, wr, bad_wr, |m, s: &MrkitSrq, wrs| {
            m.soft.post_srq_recv(s.srqn, wrs)
        })
    }
}

/// `struct ibv_mw_bind` (48 bytes): `wr_id`, `send_flags`, `bind_info {mr, addr, length,
/// mw_access_flags}`.
#[repr(C)]
struct ibv_mw_bind {
    wr_id: u64,
    send_flags: u32,
    mr: *mut ibv_mr,
    addr: u64,
    length: u64,
    mw_access_flags: u32,
}

/// `ops.bind_mw(qp, mw, mw_bind)` (`ibv_bind_mw`, type-1 windows): posts a BIND_MW WR with
/// the next rkey (`ibv_inc_rkey`) and updates `mw->rkey` when the post succeeds.
///
/// # Safety
/// `qp`, `mw` live objects; `bind` valid.
pub(crate) unsafe extern "C" fn op_bind_mw(
    qp: *mut c_void,
    mw: *mut ibv_mw,
    bind: *mut c_void,
) -> c_int {
    if qp.is_null() || mw.is_null() || bind.is_null() {
        return fail(libc::EINVAL);
    }
    // SAFETY: caller contract.
    let (b, rkey) = unsafe { (&*bind.cast::<ibv_mw_bind>(), (*mw).rkey) };
    let new_rkey = (rkey & 0xffff_ff00) | (rkey.wrapping_add(1) & 0xff);
    let mut wr: ibv_send_wr = zeroed();
    wr.wr_id = b.wr_id;
    wr.opcode = 8;
    wr.send_flags = b.send_flags;
    wr.bind_mw = [
        mw as u64,
        u64::from(new_rkey),
        b.mr as u64,
        b.addr,
        b.length,
        u64::from(b.mw_access_flags),
    ];
    let mut bad: *mut c_void = std::ptr::null_mut();
    // SAFETY: a valid one-element chain on the stack; forwarded contract for qp.
    let r = unsafe { op_post_send(qp, (&mut wr as *mut ibv_send_wr).cast(), &mut bad) };
    if r == 0 {
        // SAFETY: live MW.
        unsafe { (*mw).rkey = new_rkey };
    }
    r
}
