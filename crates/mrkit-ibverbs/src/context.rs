//! The open context: the per-context state every verb reaches through its `ibv_context`, and
//! the process's one device instance behind all contexts. The bottom of the crate's object
//! layer: it knows no object kind and no ops table (the table is filled in by `ops.rs`, above
//! every object file, which hands it to [`open`]).
//!
//! * Each `ibv_open_device` allocates `[front padding][verbs_context][Rust state]`; the
//!   `ibv_context` handed out is the last member of the `verbs_context` (`sz = 648`,
//!   `abi_compat = UINTPTR_MAX`), so the inline `ibv_query_port` / `ibv_query_device_ex` of the
//!   headers dispatch through it.
//! * The contexts of a process share one `mrkit_soft::Context` (tables, limits from the
//!   `MRKIT_*` environment): one GID, one QPN space, as one RNIC per host.
//! * Use after close: a closed context's memory is never returned to the allocator; its magic
//!   word is cleared and the memory waits in a quarantine for the next `ibv_open_device`, so
//!   every verb on a closed context reads live memory, finds no magic and fails with EINVAL.
//! * fork: a context remembers the process ([`mrkit_soft::mem::fork_generation`]) that opened
//!   it. In a forked child the parent's contexts (and every object on them) are refused with
//!   EINVAL, and the child's first `ibv_open_device` opens a device instance of its own (new
//!   address, socket and threads); the parent's instance, copied into the child, is never
//!   touched or dropped there.

use std::collections::HashMap;
use std::ffi::c_int;
use std::mem::offset_of;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use mrkit_soft::mem::{fork_generation, PerProcess};

use crate::abi::{ibv_async_event, ibv_context, verbs_context};
use crate::events::{EventQueue, Router};
use crate::ffi::{guard, set_errno};

const CTX_MAGIC: u64 = 0x6d72_6b69_7463_7478; // "mrkitctx"

/// An open device: `verbs_context` (ending in the `ibv_context`) followed by our state.
#[repr(C)]
pub(crate) struct MrkitContext {
    /// Zeroes in front of the `verbs_context`: newer headers prepend ops there (they are
    /// gated by `sz`, so never read, but the memory exists).
    _front: [u64; 16],
    pub(crate) vctx: verbs_context,
    /// [`CTX_MAGIC`] while open; 0 once closed. Close clears it with a compare-exchange
    /// (AcqRel: exactly one close wins) before the state is dropped; verbs load it with Acquire
    /// before touching the state. (A verb racing with the close of its own context is the
    /// caller's bug, as with libibverbs; the check makes a verb *after* the close fail.)
    magic: AtomicU64,
    /// The fork generation of the process that opened it: a forked child refuses it.
    gen: u64,
    pub(crate) soft: mrkit_soft::Context,
    /// This context's async events; its eventfd is `async_fd`.
    pub(crate) events: Arc<EventQueue>,
    /// The device instance's event router (shared by all contexts, `events.rs`).
    pub(crate) router: Arc<Router>,
    /// CQ number → `*mut ibv_cq` (for `ibv_get_cq_event`).
    pub(crate) cqs: Mutex<HashMap<u32, usize>>,
}

const CTX_OFFSET: usize = offset_of!(MrkitContext, vctx) + offset_of!(verbs_context, context);

/// Allocations of closed contexts (their state dropped, magic 0), reused by the next open.
/// They are never freed, so reading the magic word of a closed context is reading live memory.
/// Per process: a forked child starts with an empty list (a lock held at `fork` by another
/// thread of the parent would otherwise stay held in the child).
static QUARANTINE: PerProcess<Mutex<Vec<usize>>> = PerProcess::new();

fn quarantine() -> std::sync::MutexGuard<'static, Vec<usize>> {
    let cell = QUARANTINE.get_or_init(Mutex::default);
    cell.lock().unwrap_or_else(|e| e.into_inner())
}

/// The `MrkitContext` allocation an `ibv_context` of `ibv_open_device` lives in, its magic
/// word and its process generation (without requiring it to be open).
///
/// # Safety
/// `ctx` must be non-NULL and a context returned by `ibv_open_device` (open or closed).
unsafe fn shell(ctx: *mut ibv_context) -> (*mut MrkitContext, u64, u64) {
    // SAFETY: per the contract ctx is the `context` member inside a MrkitContext allocation
    // (never freed, see QUARANTINE), so stepping back by its offset gives its start, and its
    // `magic` and `gen` words are always initialised (a closed context keeps them).
    unsafe {
        let p = ctx.cast::<u8>().sub(CTX_OFFSET).cast::<MrkitContext>();
        let magic = (*std::ptr::addr_of!((*p).magic)).load(Ordering::Acquire);
        (p, magic, std::ptr::addr_of!((*p).gen).read())
    }
}

/// The `MrkitContext` of an `ibv_context` handed out by `ibv_open_device`: None for NULL, a
/// closed context, or (in a forked child) a context the parent opened.
///
/// The checks are one atomic load and two compares (the fork generation is an atomic load
/// too), so every verb, including `ibv_post_send` / `ibv_poll_cq`, makes them.
///
/// # Safety
/// `ctx` must be NULL or a context returned by `ibv_open_device` (open or closed).
pub(crate) unsafe fn open_context<'a>(ctx: *mut ibv_context) -> Option<&'a MrkitContext> {
    if ctx.is_null() {
        return None;
    }
    // SAFETY: forwarded contract.
    let (p, magic, gen) = unsafe { shell(ctx) };
    if magic != CTX_MAGIC || gen != fork_generation() {
        return None;
    }
    // SAFETY: the magic word says the context is open (its state initialised and not
    // dropped: close clears the magic before dropping), in this process.
    Some(unsafe { &*p })
}

/// Post an asynchronous event on a context: it is queued and the context's `async_fd` becomes
/// readable, so `poll()` + `ibv_get_async_event` see it. The device's own QP/CQ/SRQ events
/// arrive through the router (`events.rs`); this is for other events (port, device) and tests:
/// they are not counted against any object (`ibv_ack_async_event` on them must not name a
/// QP/CQ/SRQ event type unless `element` is a live object of that kind).
///
/// # Safety
/// `ctx` must be a live context returned by `ibv_open_device`.
pub unsafe fn post_async_event(ctx: *mut ibv_context, element: u64, event_type: c_int) -> bool {
    // SAFETY: forwarded contract.
    let Some(m) = (unsafe { open_context(ctx) }) else {
        return false;
    };
    m.events.push_untracked(ibv_async_event {
        element,
        event_type,
    })
}

/// The process's device instance, shared by every open context (a real RNIC is one device
/// per host however often it is opened): one UDP address / GID, one QPN space, so two
/// contexts of one process (pyverbs' client and server) reach each other through the GID.
/// Counted by open contexts; the last `ibv_close_device` drops it (releasing everything still
/// registered). Its async events go through its [`Router`] (installed as mrkit-soft's hook).
///
/// Per process ([`PerProcess`]): a forked child finds no instance and opens its own on its first
/// `ibv_open_device`, with its own threads and a UDP address of its own (the default 127.x.y.z
/// is derived from the pid; an inherited `MRKIT_ADDR` names the parent's bound address, so the
/// child's bind fails with a message until it sets another one: it never shares the parent's
/// socket). The parent's instance stays in the child's memory, never used nor dropped there
/// (dropping it would wait for threads that do not exist in the child and act on sockets the
/// parent still uses).
type Shared = (mrkit_soft::Context, Arc<Router>);
static SHARED: PerProcess<Mutex<(Option<Shared>, usize)>> = PerProcess::new();

fn shared() -> std::sync::MutexGuard<'static, (Option<Shared>, usize)> {
    let cell = SHARED.get_or_init(Mutex::default);
    cell.lock().unwrap_or_else(|e| e.into_inner())
}

fn open_soft_context() -> Result<Shared, String> {
    let mut g = shared();
    if let Some(c) = &g.0 {
        let c = c.clone();
        g.1 += 1;
        return Ok(c);
    }
    let c = new_soft_context()?;
    let router = Arc::new(Router::default());
    let r = router.clone();
    c.set_async_event_hook(Some(Arc::new(move |e| r.deliver(e))));
    *g = (Some((c.clone(), router.clone())), 1);
    Ok((c, router))
}

fn release_soft_context() {
    let last = {
        let mut g = shared();
        g.1 = g.1.saturating_sub(1);
        if g.1 == 0 {
            g.0.take()
        } else {
            None
        }
    };
    // Dropped outside the lock (it joins the device's threads).
    drop(last);
}

fn new_soft_context() -> Result<mrkit_soft::Context, String> {
    // The device's own vendor_id is rxe's 0xFFFFFF (not zero, as pyverbs checks; no vendor
    // whose provider code paths perftest or rdma-core's tests would take).
    let mut cfg = mrkit_soft::DeviceConfig::from_env()?;
    if crate::fork::fork_protection_requested() {
        cfg = cfg.dontfork(true);
    }
    Ok(mrkit_soft::Context::open(cfg))
}

/// Open a context whose `verbs_context` is `vctx` (its ops filled in, its `async_fd` set
/// here): the process's device instance (opened on first use), a fresh async event queue and
/// an allocation that is never freed. NULL with errno on failure.
pub(crate) fn open(mut vctx: verbs_context) -> *mut ibv_context {
    let (soft, router) = match open_soft_context() {
        Ok(s) => s,
        Err(e) => {
            eprintln!(
                "libibverbs (mrkit): cannot open {}: {e}",
                mrkit_soft::DEVICE_NAME
            );
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        }
    };
    let Some(events) = EventQueue::new() else {
        release_soft_context();
        return std::ptr::null_mut(); // errno set by eventfd
    };
    vctx.context.async_fd = events.raw_fd();
    let value = MrkitContext {
        _front: [0; 16],
        vctx,
        magic: AtomicU64::new(CTX_MAGIC),
        gen: fork_generation(),
        soft,
        events: Arc::new(events),
        router,
        cqs: Mutex::new(HashMap::new()),
    };
    let reused = quarantine().pop();
    let m = match reused {
        Some(p) => p as *mut MrkitContext,
        None => Box::into_raw(Box::new(std::mem::MaybeUninit::<MrkitContext>::uninit()))
            .cast::<MrkitContext>(),
    };
    // SAFETY: m is a MrkitContext allocation that is never freed: fresh, or a closed
    // context whose state was dropped (so overwriting it drops nothing twice).
    unsafe { m.write(value) };
    // SAFETY: m was initialised above; the context stays at this address for good.
    unsafe { std::ptr::addr_of_mut!((*m).vctx.context) }
}

/// `int ibv_close_device(struct ibv_context *context)`.
///
/// # Safety
/// `ctx` must be NULL or an open context; it must not be used afterwards.
pub(crate) unsafe extern "C" fn ibv_close_device(ctx: *mut ibv_context) -> c_int {
    if ctx.is_null() {
        set_errno(libc::EINVAL);
        return libc::EINVAL;
    }
    // SAFETY: caller contract (a context of ibv_open_device, open or closed).
    let (p, magic, gen) = unsafe { shell(ctx) };
    // SAFETY: p is a context allocation (never freed); `magic` is atomic.
    let magic_word = unsafe { &*std::ptr::addr_of!((*p).magic) };
    if magic != CTX_MAGIC
        || magic_word
            .compare_exchange(CTX_MAGIC, 0, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
    {
        // Closed already (or being closed by another thread).
        set_errno(libc::EINVAL);
        return libc::EINVAL;
    }
    if gen != fork_generation() {
        // A parent's context in a forked child: now refused (magic cleared), its state left
        // as it is (the parent's threads, sockets and device instance are not the child's).
        return 0;
    }
    // SAFETY: the magic was ours to clear, so the context is open and this is its only close.
    let m = unsafe { &*p };
    m.router.forget_queue(&m.events);
    guard(libc::EIO, || {
        // SAFETY: the state is initialised and dropped exactly once (the magic is 0 now, so no
        // verb and no second close reaches it). Dropping it closes the async fd and releases the
        // soft context (its MRs are unpinned). The allocation itself goes to the quarantine.
        unsafe { std::ptr::drop_in_place(p) };
        quarantine().push(p as usize);
        release_soft_context();
        0
    })
}
