//! Completion queues: `ibv_create_cq`, `ibv_create_cq_ex` (and the `ibv_cq_ex` poll API),
//! resize, destroy, `ops.poll_cq` / `ops.req_notify_cq`, and the completion events of a channel
//! (`ibv_get_cq_event` / `ibv_ack_cq_events`): a destroy waits until every event
//! `ibv_get_cq_event` returned for the CQ was acked, as libibverbs does.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use mrkit_soft::cq::{Wc, WC_WITH_IMM, WC_WITH_INV};

use crate::abi::*;
use crate::channel::MrkitChannel;
use crate::context::{open_context, MrkitContext};
use crate::events::{add_completed, wait_until, Kind, ObjEvents};
use crate::ffi::{fail, fail_null, guard, set_errno, soft_errno, zeroed};
use crate::obj::{impl_obj, obj, obj_ctx};

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
    let channel = unsafe { &*ch.cast::<MrkitChannel>() };
    // SAFETY: the channel's context is open.
    let Some(m) = (unsafe { open_context(channel.ch.context) }) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    loop {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a valid u64 (semaphore eventfd: one event).
        let r = unsafe { libc::read(channel.ch.fd, (&mut v as *mut u64).cast(), 8) };
        if r != 8 {
            return -1; // errno from read
        }
        let cqn = channel
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

impl_obj!(MrkitCq, ex.cq, CQ_MAGIC);

/// `ibv_cq_ex` (whose first 128 bytes are the `ibv_cq`) plus our state.
#[repr(C)]
pub(crate) struct MrkitCq {
    ex: ibv_cq_ex,
    magic: u64,
    pub(crate) cqn: u32,
    /// The completion the `ibv_cq_ex` poll API is positioned on.
    current: Wc,
    /// Completion events `ibv_get_cq_event` returned for this CQ; incremented under the
    /// context's `cqs` map lock, read by `ibv_destroy_cq` after removing the CQ from that map
    /// (it then waits for `comp_events_completed` to reach it).
    comp_reported: AtomicU32,
    /// Async events (CQ_ERR) handed out for this CQ (`events.rs`).
    ev: Arc<ObjEvents>,
}

/// # Safety
/// `cq` NULL or a CQ created by this library, live.
pub(crate) unsafe fn cq_of<'a>(cq: *mut ibv_cq) -> Option<&'a mut MrkitCq> {
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
    let Some(m) = (unsafe { open_context(ctx) }) else {
        return fail_null(libc::EINVAL);
    };
    if cqe <= 0 || comp_vector != 0 {
        return fail_null(libc::EINVAL);
    }
    let device_channel = if channel.is_null() {
        None
    } else {
        // SAFETY: a live channel (caller contract).
        Some(unsafe { (*channel.cast::<MrkitChannel>()).device_channel })
    };
    guard(std::ptr::null_mut(), || {
        let cqn = match m.soft.create_cq(cqe as u32, device_channel) {
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
            current: empty_wc(),
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
            c.current = w;
            c.ex.status = w.status as u32;
            c.ex.wr_id = w.wr_id;
            0
        }
        None => libc::ENOENT,
    }
}

/// `ibv_cq_ex.start_poll`: position on the oldest completion (ENOENT when there is none).
///
/// # Safety
/// `cq` a live `ibv_cq_ex` of this library.
unsafe extern "C" fn cqex_start_poll(cq: *mut ibv_cq_ex, _attr: *mut c_void) -> c_int {
    // SAFETY: forwarded contract (cq from this library).
    unsafe { cqex_poll_one(cq) }
}

/// `ibv_cq_ex.next_poll`: position on the next completion (ENOENT when there is none).
///
/// # Safety
/// `cq` a live `ibv_cq_ex` of this library.
unsafe extern "C" fn cqex_next_poll(cq: *mut ibv_cq_ex) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { cqex_poll_one(cq) }
}

/// `ibv_cq_ex.end_poll`: nothing to release (each completion was taken off the CQ when polled).
///
/// # Safety
/// `cq` a live `ibv_cq_ex` of this library.
unsafe extern "C" fn cqex_end_poll(_cq: *mut ibv_cq_ex) {}

/// # Safety
/// `cq` a live `ibv_cq_ex` of this library.
unsafe fn current_wc(cq: *mut ibv_cq_ex) -> ibv_wc {
    // SAFETY: caller contract.
    match unsafe { cq_of(cq.cast()) } {
        Some(c) => wc_to_c(&c.current),
        None => ibv_wc::default(),
    }
}

/// `ibv_cq_ex.read_opcode` of the current completion.
///
/// # Safety
/// `cq` a live `ibv_cq_ex` of this library.
unsafe extern "C" fn cqex_read_opcode(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: forwarded contract.
    unsafe { current_wc(cq) }.opcode
}

/// `ibv_cq_ex.read_vendor_err` of the current completion.
///
/// # Safety
/// `cq` a live `ibv_cq_ex` of this library.
unsafe extern "C" fn cqex_read_vendor_err(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: forwarded contract.
    unsafe { current_wc(cq) }.vendor_err
}

/// `ibv_cq_ex.read_byte_len` of the current completion.
///
/// # Safety
/// `cq` a live `ibv_cq_ex` of this library.
unsafe extern "C" fn cqex_read_byte_len(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: forwarded contract.
    unsafe { current_wc(cq) }.byte_len
}

/// `ibv_cq_ex.read_imm_data` of the current completion.
///
/// # Safety
/// `cq` a live `ibv_cq_ex` of this library.
unsafe extern "C" fn cqex_read_imm_data(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: forwarded contract.
    unsafe { current_wc(cq) }.imm_data
}

/// `ibv_cq_ex.read_qp_num` of the current completion.
///
/// # Safety
/// `cq` a live `ibv_cq_ex` of this library.
unsafe extern "C" fn cqex_read_qp_num(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: forwarded contract.
    unsafe { current_wc(cq) }.qp_num
}

/// `ibv_cq_ex.read_src_qp` of the current completion.
///
/// # Safety
/// `cq` a live `ibv_cq_ex` of this library.
unsafe extern "C" fn cqex_read_src_qp(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: forwarded contract.
    unsafe { current_wc(cq) }.src_qp
}

/// `ibv_cq_ex.read_wc_flags` of the current completion.
///
/// # Safety
/// `cq` a live `ibv_cq_ex` of this library.
unsafe extern "C" fn cqex_read_wc_flags(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: forwarded contract.
    unsafe { current_wc(cq) }.wc_flags
}

/// The `ibv_cq_ex` readers of fields RoCE does not have (SLID): 0.
///
/// # Safety
/// The argument is not dereferenced.
unsafe extern "C" fn cqex_read_zero32(_cq: *mut ibv_cq_ex) -> u32 {
    0
}

/// The `ibv_cq_ex` readers of 8-bit fields RoCE does not have (SL, DLID path bits): 0.
///
/// # Safety
/// The argument is not dereferenced.
unsafe extern "C" fn cqex_read_zero8(_cq: *mut ibv_cq_ex) -> u8 {
    0
}
