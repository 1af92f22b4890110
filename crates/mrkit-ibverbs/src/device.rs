//! The device list, contexts and queries.
//!
//! * One device, `mrkit0`, in a static (it outlives `ibv_free_device_list`, as pyverbs needs),
//!   followed by a NULL pointer at offset 664 (`verbs_device.ops`, read by libmlx5/libefa to
//!   recognise their own devices).
//! * Each `ibv_open_device` opens its own `mrkit_soft::Context` (tables, limits from the
//!   `MRKIT_*` environment) and allocates `[front padding][verbs_context][Rust state]`; the
//!   `ibv_context` handed out is the last member of the `verbs_context`, with `sz = 648` and
//!   `abi_compat = UINTPTR_MAX`, so the inline `ibv_query_port` / `ibv_query_device_ex` dispatch
//!   to `query_port` / `query_device_ex` below.
//! * Identity: vendor_id 0xFFFFFF (no vendor; rxe's value), vendor_part_id 0, so perftest stays
//!   on the classic `ibv_post_send` path and the mlx5/EFA tests of rdma-core skip.
//! * Port 1: ACTIVE, Ethernet, max MTU 4096, active MTU 1024, 4X EDR, LID 0.
//! * GID table: one RoCE v2 entry, `::ffff:127.0.0.1`. **Placeholder** until the UDP transport
//!   lands and the table lists the host's IPv4 addresses.
//! * Use after close: a closed context's memory is never returned to the allocator; its magic
//!   word is cleared and the memory waits in a quarantine for the next `ibv_open_device`, so
//!   every verb on a closed context reads live memory, finds no magic and fails with EINVAL.
//! * fork: a context remembers the process ([`mrkit_soft::mem::fork_generation`]) that opened
//!   it. In a forked child the parent's contexts (and every object on them) are refused with
//!   EINVAL, and the child's first `ibv_open_device` opens a device instance of its own (new
//!   address, socket and threads); the parent's instance, copied into the child, is never
//!   touched or dropped there.

use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::mem::offset_of;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use mrkit_soft::mem::{fork_generation, PerProcess};

use crate::abi::*;
use crate::events::{add_completed, event_type as et, EventQueue, Router};
use crate::ffi::{copy_prefix, guard, set_errno};

/// Name of the device (`ibv_get_device_name`).
pub const DEVICE_NAME: &str = mrkit_soft::DEVICE_NAME;

/// Vendor id reported: not zero (pyverbs checks), not Mellanox/EFA/Chelsio/Intel.
const VENDOR_ID: u32 = 0x00ff_ffff;

/// `ibv_device` plus the `verbs_device.ops` word libmlx5/libefa read at offset 664.
#[repr(C)]
pub(crate) struct MrkitDevice {
    pub(crate) dev: ibv_device,
    verbs_device_ops: *const c_void,
    _reserved: [u64; 7],
}

struct StaticDevice(UnsafeCell<MrkitDevice>);
// SAFETY: the device is never written after initialisation (C callers treat it as read-only);
// the cell only exists because C receives a `*mut`.
unsafe impl Sync for StaticDevice {}

const fn cbuf<const N: usize>(s: &str) -> [c_char; N] {
    let b = s.as_bytes();
    let mut a = [0 as c_char; N];
    let mut i = 0;
    while i < b.len() && i + 1 < N {
        a[i] = b[i] as c_char;
        i += 1;
    }
    a
}

static DEVICE: StaticDevice = StaticDevice(UnsafeCell::new(MrkitDevice {
    dev: ibv_device {
        _ops: _ibv_device_ops {
            _dummy1: std::ptr::null(),
            _dummy2: std::ptr::null(),
        },
        node_type: IBV_NODE_CA,
        transport_type: IBV_TRANSPORT_IB,
        name: cbuf("mrkit0"),
        dev_name: cbuf("uverbs0"),
        dev_path: cbuf("/sys/class/infiniband_verbs/uverbs0"),
        ibdev_path: cbuf("/sys/class/infiniband/mrkit0"),
    },
    verbs_device_ops: std::ptr::null(),
    _reserved: [0; 7],
}));

pub(crate) fn device_ptr() -> *mut ibv_device {
    DEVICE.0.get().cast()
}

/// The GID table of port 1 (raw 16-byte GIDs, network order): one entry, the device's RoCEv2
/// UDP address (`MRKIT_ADDR`, or the default 127.x.y.z of this device instance) as an
/// IPv4-mapped GID. Querying it binds the UDP port. Empty if the port cannot be bound.
fn gid_table(m: &MrkitContext) -> Vec<[u8; 16]> {
    match m.soft.query_gid() {
        Ok(g) => vec![g],
        Err(e) => {
            eprintln!("libibverbs (mrkit): {DEVICE_NAME} has no GID: {e}");
            Vec::new()
        }
    }
}

/// rxe's rule for the active MTU: the largest IB MTU ≤ netdev MTU − 80 (RoCEv2 headers);
/// loopback addresses → 4096. `IBV_MTU_*` enum value; 1024 if the interface is unknown.
fn active_mtu(m: &MrkitContext) -> u32 {
    let Some(addr) = m.soft.udp_port().ok().map(|p| p.local_addr()) else {
        return IBV_MTU_1024;
    };
    let ip = addr.ip();
    if ip.is_loopback() {
        return IBV_MTU_4096;
    }
    match netdev_mtu(ip) {
        Some(mtu) => ib_mtu_enum(mtu.saturating_sub(80)),
        None => IBV_MTU_1024,
    }
}

/// The `IBV_MTU_*` value of the largest IB MTU ≤ `bytes` (at least 256).
pub(crate) fn ib_mtu_enum(bytes: u32) -> u32 {
    match bytes {
        4096.. => IBV_MTU_4096,
        2048.. => 4,
        1024.. => IBV_MTU_1024,
        512.. => 2,
        _ => 1,
    }
}

/// MTU of the interface holding `ip` (getifaddrs + /sys/class/net/<if>/mtu).
fn netdev_mtu(ip: std::net::IpAddr) -> Option<u32> {
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills ifap on success; freed with freeifaddrs below.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return None;
    }
    let mut name = None;
    let mut p = ifap;
    while !p.is_null() {
        // SAFETY: p is an element of the list getifaddrs returned.
        let ifa = unsafe { &*p };
        if !ifa.ifa_addr.is_null() {
            // SAFETY: ifa_addr points to a sockaddr of the family it names.
            let a = unsafe { sockaddr_ip(ifa.ifa_addr) };
            if a == Some(ip) {
                // SAFETY: ifa_name is a NUL-terminated string.
                name = Some(
                    unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
                        .to_string_lossy()
                        .into_owned(),
                );
                break;
            }
        }
        p = ifa.ifa_next;
    }
    // SAFETY: the list from getifaddrs, freed once.
    unsafe { libc::freeifaddrs(ifap) };
    let name = name?;
    std::fs::read_to_string(format!("/sys/class/net/{name}/mtu"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// # Safety
/// `sa` points to a valid sockaddr.
unsafe fn sockaddr_ip(sa: *const libc::sockaddr) -> Option<std::net::IpAddr> {
    // SAFETY: caller contract; the family tells the real type.
    unsafe {
        match i32::from((*sa).sa_family) {
            libc::AF_INET => {
                let s = &*sa.cast::<libc::sockaddr_in>();
                Some(std::net::IpAddr::from(
                    u32::from_be(s.sin_addr.s_addr).to_be_bytes(),
                ))
            }
            libc::AF_INET6 => {
                let s = &*sa.cast::<libc::sockaddr_in6>();
                Some(std::net::IpAddr::from(s.sin6_addr.s6_addr))
            }
            _ => None,
        }
    }
}

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

/// The `MrkitContext` allocation an `ibv_context` of [`ibv_open_device`] lives in, its magic
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

/// The `MrkitContext` of an `ibv_context` handed out by [`ibv_open_device`]: None for NULL, a
/// closed context, or (in a forked child) a context the parent opened.
///
/// The checks are one atomic load and two compares (the fork generation is an atomic load
/// too), so every verb, including `ibv_post_send` / `ibv_poll_cq`, makes them.
///
/// # Safety
/// `ctx` must be NULL or a context returned by `ibv_open_device` (open or closed).
pub(crate) unsafe fn mctx<'a>(ctx: *mut ibv_context) -> Option<&'a MrkitContext> {
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
    let Some(m) = (unsafe { mctx(ctx) }) else {
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
    let mut cfg = mrkit_soft::DeviceConfig::from_env()?;
    if cfg.attr().vendor_id == 0 {
        cfg = cfg.with_attr(|a| a.vendor_id = VENDOR_ID);
    }
    if crate::verbs::fork_protection_requested() {
        cfg = cfg.dontfork(true);
    }
    Ok(mrkit_soft::Context::open(cfg))
}

fn new_ops() -> ibv_context_ops {
    let n = std::ptr::null();
    ibv_context_ops {
        _compat_query_device: n,
        _compat_query_port: n,
        _compat_alloc_pd: n,
        _compat_dealloc_pd: n,
        _compat_reg_mr: n,
        _compat_rereg_mr: n,
        _compat_dereg_mr: n,
        alloc_mw: Some(crate::verbs::op_alloc_mw),
        bind_mw: Some(crate::dp::op_bind_mw),
        dealloc_mw: Some(crate::verbs::op_dealloc_mw),
        _compat_create_cq: n,
        poll_cq: Some(crate::dp::op_poll_cq),
        req_notify_cq: Some(crate::dp::op_req_notify_cq),
        _compat_cq_event: n,
        _compat_resize_cq: n,
        _compat_destroy_cq: n,
        _compat_create_srq: n,
        _compat_modify_srq: n,
        _compat_query_srq: n,
        _compat_destroy_srq: n,
        post_srq_recv: Some(crate::dp::op_post_srq_recv),
        _compat_create_qp: n,
        _compat_query_qp: n,
        _compat_modify_qp: n,
        _compat_destroy_qp: n,
        post_send: Some(crate::dp::op_post_send),
        post_recv: Some(crate::dp::op_post_recv),
        _compat_create_ah: n,
        _compat_destroy_ah: n,
        _compat_attach_mcast: n,
        _compat_detach_mcast: n,
        _compat_async_event: n,
    }
}

fn new_vctx() -> verbs_context {
    let n = std::ptr::null();
    verbs_context {
        query_port: Some(vctx_query_port),
        advise_mr: Some(crate::verbs::vctx_advise_mr),
        alloc_null_mr: n,
        read_counters: n,
        attach_counters_point_flow: n,
        create_counters: n,
        destroy_counters: n,
        reg_dm_mr: n,
        alloc_dm: n,
        free_dm: n,
        modify_flow_action_esp: n,
        destroy_flow_action: n,
        create_flow_action_esp: n,
        modify_qp_rate_limit: n,
        alloc_parent_domain: n,
        dealloc_td: n,
        alloc_td: n,
        modify_cq: n,
        post_srq_ops: n,
        destroy_rwq_ind_table: n,
        create_rwq_ind_table: n,
        destroy_wq: n,
        modify_wq: n,
        create_wq: n,
        query_rt_values: n,
        create_cq_ex: Some(crate::dp::vctx_create_cq_ex),
        priv_: n,
        query_device_ex: Some(vctx_query_device_ex),
        ibv_destroy_flow: n,
        ABI_placeholder2: n,
        ibv_create_flow: n,
        ABI_placeholder1: n,
        open_qp: n,
        create_qp_ex: n,
        get_srq_num: n,
        create_srq_ex: n,
        open_xrcd: n,
        close_xrcd: n,
        _ABI_placeholder3: 0,
        sz: std::mem::size_of::<verbs_context>(),
        context: ibv_context {
            device: device_ptr(),
            ops: new_ops(),
            cmd_fd: -1,
            async_fd: -1,
            num_comp_vectors: 1,
            mutex: libc::PTHREAD_MUTEX_INITIALIZER,
            abi_compat: usize::MAX as *mut c_void,
        },
    }
}

// ---------------------------------------------------------------------------------------------
// Exported functions.

/// `struct ibv_device **ibv_get_device_list(int *num_devices)`.
///
/// # Safety
/// `num` must be NULL or valid for a write.
pub(crate) unsafe extern "C" fn ibv_get_device_list(num: *mut c_int) -> *mut *mut ibv_device {
    guard(std::ptr::null_mut(), || {
        // SAFETY: calloc of 2 pointers; checked for NULL below.
        let list = unsafe { libc::calloc(2, std::mem::size_of::<*mut ibv_device>()) }
            .cast::<*mut ibv_device>();
        if list.is_null() {
            set_errno(libc::ENOMEM);
            return list;
        }
        // SAFETY: list has room for 2 pointers; the second stays NULL (calloc).
        unsafe { *list = device_ptr() };
        if !num.is_null() {
            // SAFETY: caller contract.
            unsafe { *num = 1 };
        }
        list
    })
}

/// `void ibv_free_device_list(struct ibv_device **list)`.
///
/// # Safety
/// `list` must be NULL or a list returned by [`ibv_get_device_list`], not yet freed.
pub(crate) unsafe extern "C" fn ibv_free_device_list(list: *mut *mut ibv_device) {
    // SAFETY: allocated with calloc in ibv_get_device_list (free(NULL) is a no-op).
    unsafe { libc::free(list.cast()) }
}

/// `const char *ibv_get_device_name(struct ibv_device *device)`.
///
/// # Safety
/// `device` must be NULL or a device from [`ibv_get_device_list`].
pub(crate) unsafe extern "C" fn ibv_get_device_name(device: *mut ibv_device) -> *const c_char {
    if device.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null();
    }
    // SAFETY: device points to a live ibv_device (ours is static).
    unsafe { (*device).name.as_ptr() }
}

/// `__be64 ibv_get_device_guid(struct ibv_device *device)`.
///
/// # Safety
/// `device` must be NULL or a device from [`ibv_get_device_list`].
pub(crate) unsafe extern "C" fn ibv_get_device_guid(_device: *mut ibv_device) -> u64 {
    mrkit_soft::DeviceConfig::rxe().attr().node_guid.to_be()
}

/// `int ibv_get_device_index(struct ibv_device *device)`.
///
/// # Safety
/// `device` must be NULL or a device from [`ibv_get_device_list`].
pub(crate) unsafe extern "C" fn ibv_get_device_index(device: *mut ibv_device) -> c_int {
    if device == device_ptr() {
        0
    } else {
        -1
    }
}

/// `struct ibv_context *ibv_open_device(struct ibv_device *device)`.
///
/// # Safety
/// `device` must be NULL or a device from [`ibv_get_device_list`].
pub(crate) unsafe extern "C" fn ibv_open_device(device: *mut ibv_device) -> *mut ibv_context {
    guard(std::ptr::null_mut(), || {
        if device != device_ptr() {
            set_errno(libc::ENODEV);
            return std::ptr::null_mut();
        }
        let (soft, router) = match open_soft_context() {
            Ok(s) => s,
            Err(e) => {
                eprintln!("libibverbs (mrkit): cannot open {DEVICE_NAME}: {e}");
                set_errno(libc::EINVAL);
                return std::ptr::null_mut();
            }
        };
        let Some(events) = EventQueue::new() else {
            release_soft_context();
            return std::ptr::null_mut(); // errno set by eventfd
        };
        let fd = events.raw_fd();
        let mut vctx = new_vctx();
        vctx.context.async_fd = fd;
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
    })
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

fn device_attr(m: &MrkitContext) -> ibv_device_attr {
    let a = m.soft.query_device();
    let i = |v: u32| v.min(i32::MAX as u32) as c_int;
    ibv_device_attr {
        fw_ver: cbuf(&a.fw_ver),
        node_guid: a.node_guid.to_be(),
        sys_image_guid: a.sys_image_guid.to_be(),
        max_mr_size: a.max_mr_size,
        page_size_cap: a.page_size_cap,
        vendor_id: a.vendor_id,
        vendor_part_id: a.vendor_part_id,
        hw_ver: a.hw_ver,
        max_qp: i(a.max_qp),
        max_qp_wr: i(a.max_qp_wr),
        device_cap_flags: a.device_cap_flags as c_uint,
        max_sge: i(a.max_sge),
        max_sge_rd: i(a.max_sge_rd),
        max_cq: i(a.max_cq),
        max_cqe: i(a.max_cqe),
        max_mr: i(a.max_mr),
        max_pd: i(a.max_pd),
        max_qp_rd_atom: i(a.max_qp_rd_atom),
        max_ee_rd_atom: 0,
        max_res_rd_atom: i(a.max_res_rd_atom),
        max_qp_init_rd_atom: i(a.max_qp_init_rd_atom),
        max_ee_init_rd_atom: 0,
        atomic_cap: i(a.atomic_cap),
        max_ee: 0,
        max_rdd: 0,
        max_mw: i(a.max_mw),
        max_raw_ipv6_qp: 0,
        max_raw_ethy_qp: 0,
        max_mcast_grp: 0,
        max_mcast_qp_attach: 0,
        max_total_mcast_qp_attach: 0,
        max_ah: 32767,
        max_fmr: 0,
        max_map_per_fmr: 0,
        max_srq: i(a.max_srq),
        max_srq_wr: i(a.max_srq_wr),
        max_srq_sge: i(a.max_srq_sge),
        max_pkeys: a.max_pkeys,
        local_ca_ack_delay: a.local_ca_ack_delay,
        phys_port_cnt: a.phys_port_cnt,
    }
}

fn device_attr_ex(m: &MrkitContext) -> ibv_device_attr_ex {
    let a = m.soft.query_device();
    ibv_device_attr_ex {
        orig_attr: device_attr(m),
        comp_mask: 0,
        odp_caps: ibv_odp_caps {
            general_caps: a.odp_general_caps,
            per_transport_caps: ibv_odp_transport_caps {
                rc_odp_caps: if a.odp_general_caps != 0 {
                    a.odp_rc_caps
                } else {
                    0
                },
                uc_odp_caps: 0,
                ud_odp_caps: 0,
            },
        },
        completion_timestamp_mask: 0,
        hca_core_clock: 0,
        device_cap_flags_ex: a.device_cap_flags,
        tso_caps: Default::default(),
        rss_caps: Default::default(),
        max_wq_type_rq: 0,
        packet_pacing_caps: Default::default(),
        raw_packet_caps: 0,
        tm_caps: Default::default(),
        cq_mod_caps: Default::default(),
        max_dm_size: 0,
        pci_atomic_caps: Default::default(),
        xrc_odp_caps: 0,
        phys_port_cnt_ex: u32::from(a.phys_port_cnt),
    }
}

/// `int ibv_query_device(struct ibv_context *, struct ibv_device_attr *)`.
///
/// # Safety
/// `ctx` must be NULL or an open context; `attr` NULL or valid for a write.
pub(crate) unsafe extern "C" fn ibv_query_device(
    ctx: *mut ibv_context,
    attr: *mut ibv_device_attr,
) -> c_int {
    // SAFETY: caller contract.
    let Some(m) = (unsafe { mctx(ctx) }) else {
        return einval();
    };
    if attr.is_null() {
        return einval();
    }
    guard(libc::EIO, || {
        let v = device_attr(m);
        // SAFETY: attr is valid for a full ibv_device_attr (caller contract).
        unsafe { attr.write(v) };
        0
    })
}

/// `verbs_context.query_device_ex`: `(ctx, input, attr, attr_size)`; copies
/// `min(attr_size, 400)` bytes.
///
/// # Safety
/// `ctx` an open context; `input` NULL or valid; `attr` valid for `attr_size` bytes.
unsafe extern "C" fn vctx_query_device_ex(
    ctx: *mut ibv_context,
    input: *const ibv_query_device_ex_input,
    attr: *mut ibv_device_attr_ex,
    attr_size: usize,
) -> c_int {
    // SAFETY: caller contract.
    let Some(m) = (unsafe { mctx(ctx) }) else {
        return einval();
    };
    // SAFETY: input is NULL or valid (caller contract).
    if !input.is_null() && unsafe { (*input).comp_mask } != 0 {
        return einval();
    }
    if attr.is_null() || attr_size < std::mem::size_of::<ibv_device_attr>() {
        return einval();
    }
    guard(libc::EIO, || {
        let v = device_attr_ex(m);
        // SAFETY: attr is valid for attr_size bytes (caller contract).
        unsafe { copy_prefix(&v, attr, attr_size) };
        0
    })
}

fn port_attr(m: &MrkitContext) -> ibv_port_attr {
    let a = m.soft.query_device();
    ibv_port_attr {
        state: IBV_PORT_ACTIVE,
        max_mtu: IBV_MTU_4096,
        active_mtu: active_mtu(m),
        gid_tbl_len: gid_table(m).len() as c_int,
        port_cap_flags: IBV_PORT_CM_SUP,
        max_msg_sz: a.max_msg_sz,
        bad_pkey_cntr: 0,
        qkey_viol_cntr: 0,
        pkey_tbl_len: 1,
        lid: 0,
        sm_lid: 0,
        lmc: 0,
        max_vl_num: 1,
        sm_sl: 0,
        subnet_timeout: 0,
        init_type_reply: 0,
        active_width: 2,  // 4X
        active_speed: 32, // EDR (25 Gb/s per lane)
        phys_state: 5,    // LinkUp
        link_layer: IBV_LINK_LAYER_ETHERNET,
        flags: 0,
        port_cap_flags2: 0,
    }
}

fn einval() -> c_int {
    set_errno(libc::EINVAL);
    libc::EINVAL
}

/// `verbs_context.query_port`: `(ctx, port, attr, attr_len)`; copies `min(attr_len, 52)`.
///
/// # Safety
/// `ctx` an open context; `attr` valid for `len` bytes.
unsafe extern "C" fn vctx_query_port(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
    len: usize,
) -> c_int {
    // SAFETY: caller contract.
    let Some(m) = (unsafe { mctx(ctx) }) else {
        return einval();
    };
    if port != 1 || attr.is_null() {
        return einval();
    }
    let v = port_attr(m);
    // SAFETY: attr valid for len bytes (caller contract).
    unsafe { copy_prefix(&v, attr, len) };
    0
}

/// Exported `ibv_query_port@IBVERBS_1.1`: the compat entry that fills only the 48-byte prefix
/// (`struct _compat_ibv_port_attr`).
///
/// # Safety
/// `ctx` an open context; `attr` valid for 48 bytes.
pub(crate) unsafe extern "C" fn ibv_query_port(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { vctx_query_port(ctx, port, attr, COMPAT_PORT_ATTR_LEN) }
}

fn gid_at(m: &MrkitContext, port: u32, index: i64) -> Option<[u8; 16]> {
    if port != 1 || index < 0 {
        return None;
    }
    gid_table(m).get(index as usize).copied()
}

/// `int ibv_query_gid(struct ibv_context *, uint8_t port, int index, union ibv_gid *gid)`:
/// 0, or -1 with errno EINVAL.
///
/// # Safety
/// `ctx` an open context; `gid` valid for 16 bytes.
pub(crate) unsafe extern "C" fn ibv_query_gid(
    ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    gid: *mut ibv_gid,
) -> c_int {
    // SAFETY: caller contract.
    let m = unsafe { mctx(ctx) }.filter(|_| !gid.is_null());
    match m.and_then(|m| gid_at(m, u32::from(port), i64::from(index))) {
        Some(raw) => {
            // SAFETY: gid valid for a write (caller contract).
            unsafe { gid.write(ibv_gid { raw }) };
            0
        }
        None => {
            set_errno(libc::EINVAL);
            -1
        }
    }
}

/// `int ibv_query_gid_type(struct ibv_context *, uint8_t port, unsigned int index,
/// enum ibv_gid_type_sysfs *type)` (IBVERBS_PRIVATE_34, used by ibv_devinfo): RoCE v2.
///
/// # Safety
/// `ctx` an open context; `ty` valid for a write.
pub(crate) unsafe extern "C" fn ibv_query_gid_type(
    ctx: *mut ibv_context,
    port: u8,
    index: c_uint,
    ty: *mut c_int,
) -> c_int {
    // SAFETY: caller contract.
    let Some(m) = (unsafe { mctx(ctx) }) else {
        return einval();
    };
    if ty.is_null() || gid_at(m, u32::from(port), i64::from(index)).is_none() {
        return einval();
    }
    // SAFETY: ty valid for a write.
    unsafe { ty.write(IBV_GID_TYPE_SYSFS_ROCE_V2) };
    0
}

fn gid_entry(index: u32, raw: [u8; 16]) -> ibv_gid_entry {
    ibv_gid_entry {
        gid: ibv_gid { raw },
        gid_index: index,
        port_num: 1,
        gid_type: IBV_GID_TYPE_ROCE_V2,
        ndev_ifindex: 0,
    }
}

/// `int _ibv_query_gid_ex(ctx, uint32_t port, uint32_t index, struct ibv_gid_entry *,
/// uint32_t flags, size_t entry_size)`: 0 or an errno value.
///
/// # Safety
/// `ctx` an open context; `entry` valid for `entry_size` bytes.
pub(crate) unsafe extern "C" fn _ibv_query_gid_ex(
    ctx: *mut ibv_context,
    port: u32,
    index: u32,
    entry: *mut ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    // SAFETY: caller contract.
    let Some(m) = (unsafe { mctx(ctx) }) else {
        return einval();
    };
    if entry.is_null() || flags != 0 {
        return einval();
    }
    let Some(raw) = gid_at(m, port, i64::from(index)) else {
        return einval();
    };
    // SAFETY: entry valid for entry_size bytes.
    unsafe { copy_prefix(&gid_entry(index, raw), entry, entry_size) };
    0
}

/// `ssize_t _ibv_query_gid_table(ctx, struct ibv_gid_entry *entries, size_t max_entries,
/// uint32_t flags, size_t entry_size)`: number of entries, or a negative errno.
///
/// # Safety
/// `ctx` an open context; `entries` valid for `max_entries * entry_size` bytes.
pub(crate) unsafe extern "C" fn _ibv_query_gid_table(
    ctx: *mut ibv_context,
    entries: *mut ibv_gid_entry,
    max_entries: usize,
    flags: u32,
    entry_size: usize,
) -> isize {
    // SAFETY: caller contract.
    let Some(m) = (unsafe { mctx(ctx) }) else {
        return -(libc::EINVAL as isize);
    };
    if flags != 0 || entry_size < std::mem::size_of::<ibv_gid_entry>() {
        return -(libc::EINVAL as isize);
    }
    let table = gid_table(m);
    if max_entries < table.len() || entries.is_null() {
        return -(libc::EINVAL as isize);
    }
    for (i, raw) in table.iter().enumerate() {
        // SAFETY: entry i lies inside the caller's max_entries * entry_size bytes.
        let dst = unsafe { entries.cast::<u8>().add(i * entry_size) }.cast::<ibv_gid_entry>();
        // SAFETY: dst valid for entry_size >= 32 bytes (checked), possibly unaligned.
        unsafe { dst.write_unaligned(gid_entry(i as u32, *raw)) };
    }
    table.len() as isize
}

/// `int ibv_query_pkey(ctx, uint8_t port, int index, __be16 *pkey)`: the default P_Key 0xffff
/// at index 0; -1 with errno EINVAL otherwise.
///
/// # Safety
/// `ctx` an open context; `pkey` valid for a write.
pub(crate) unsafe extern "C" fn ibv_query_pkey(
    ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    // SAFETY: caller contract.
    if unsafe { mctx(ctx) }.is_none() || port != 1 || index != 0 || pkey.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: pkey valid for a write.
    unsafe { pkey.write(0xffffu16.to_be()) };
    0
}

/// `int ibv_get_pkey_index(ctx, uint8_t port, __be16 pkey)`.
///
/// # Safety
/// `ctx` an open context.
pub(crate) unsafe extern "C" fn ibv_get_pkey_index(
    ctx: *mut ibv_context,
    port: u8,
    pkey: u16,
) -> c_int {
    // SAFETY: caller contract.
    if unsafe { mctx(ctx) }.is_some() && port == 1 && u16::from_be(pkey) | 0x8000 == 0xffff {
        0
    } else {
        set_errno(libc::EINVAL);
        -1
    }
}

/// `int ibv_get_async_event(ctx, struct ibv_async_event *event)`: blocks on the context's
/// eventfd (unless the application made it non-blocking: then -1 with EAGAIN). `element` is
/// the application's `ibv_qp*` / `ibv_cq*` / `ibv_srq*`; the event counts as reported for that
/// object (its destroy waits for the matching [`ibv_ack_async_event`]).
///
/// # Safety
/// `ctx` an open context; `event` valid for a write.
pub(crate) unsafe extern "C" fn ibv_get_async_event(
    ctx: *mut ibv_context,
    event: *mut ibv_async_event,
) -> c_int {
    // SAFETY: caller contract.
    let Some(m) = (unsafe { mctx(ctx) }) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    if event.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    match m.events.get() {
        Ok(ev) => {
            // SAFETY: event valid for a write.
            unsafe { event.write(ev) };
            0
        }
        Err(()) => -1, // errno from read (EAGAIN when non-blocking)
    }
}

/// `void ibv_ack_async_event(struct ibv_async_event *event)`: as libibverbs, by event type:
/// `++cq->async_events_completed` (CQ_ERR), `++qp->events_completed` (QP events),
/// `++srq->events_completed` (SRQ events), each under the object's mutex with its cond
/// signalled (a pending `ibv_destroy_*` waits for it); other types need no ack.
///
/// # Safety
/// `event` NULL or an event returned by [`ibv_get_async_event`] whose object was not
/// destroyed (it cannot be: its destroy waits for this ack).
pub(crate) unsafe extern "C" fn ibv_ack_async_event(event: *mut ibv_async_event) {
    if event.is_null() {
        return;
    }
    // SAFETY: a valid event (caller contract).
    let ev = unsafe { *event };
    if ev.element == 0 {
        return;
    }
    let p = ev.element as usize;
    // (mutex, cond, counter) of the object the event type names, by field offset (the
    // element is the application's ibv_cq / ibv_qp / ibv_srq).
    let (mutex, cond, counter) = match ev.event_type {
        et::CQ_ERR => (
            std::mem::offset_of!(ibv_cq, mutex),
            std::mem::offset_of!(ibv_cq, cond),
            std::mem::offset_of!(ibv_cq, async_events_completed),
        ),
        et::QP_FATAL
        | et::QP_REQ_ERR
        | et::QP_ACCESS_ERR
        | et::COMM_EST
        | et::SQ_DRAINED
        | et::PATH_MIG
        | et::PATH_MIG_ERR
        | et::QP_LAST_WQE_REACHED => (
            std::mem::offset_of!(ibv_qp, mutex),
            std::mem::offset_of!(ibv_qp, cond),
            std::mem::offset_of!(ibv_qp, events_completed),
        ),
        et::SRQ_ERR | et::SRQ_LIMIT_REACHED => (
            std::mem::offset_of!(ibv_srq, mutex),
            std::mem::offset_of!(ibv_srq, cond),
            std::mem::offset_of!(ibv_srq, events_completed),
        ),
        _ => return,
    };
    // SAFETY: the element is the live object of the kind the event type names (caller
    // contract), so the offsets of that type's fields address its initialised mutex and cond
    // (zero = the static initialisers) and its counter, which is only written under the mutex.
    unsafe {
        add_completed(
            (p + mutex) as *mut libc::pthread_mutex_t,
            (p + cond) as *mut libc::pthread_cond_t,
            (p + counter) as *mut u32,
            1,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn async_events_are_pollable_and_delivered_in_order() {
        // SAFETY: test of the exported functions with valid arguments throughout.
        unsafe {
            let mut n = 0;
            let list = ibv_get_device_list(&mut n);
            assert_eq!(n, 1);
            let ctx = ibv_open_device(*list);
            ibv_free_device_list(list);
            assert!(!ctx.is_null());
            let fd = (*ctx).async_fd;
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            assert_eq!(libc::poll(&mut pfd, 1, 0), 0, "nothing pending");
            assert!(post_async_event(ctx, 7, 9)); // IBV_EVENT_PORT_ACTIVE
            assert!(post_async_event(ctx, 8, 10)); // IBV_EVENT_PORT_ERR
            assert_eq!(libc::poll(&mut pfd, 1, 0), 1, "readable after an event");
            let mut ev = ibv_async_event {
                element: 0,
                event_type: 0,
            };
            assert_eq!(ibv_get_async_event(ctx, &mut ev), 0);
            assert_eq!((ev.element, ev.event_type), (7, 9));
            ibv_ack_async_event(&mut ev);
            assert_eq!(ibv_get_async_event(ctx, &mut ev), 0);
            assert_eq!((ev.element, ev.event_type), (8, 10));
            assert_eq!(libc::poll(&mut pfd, 1, 0), 0, "drained");
            assert_eq!(ibv_close_device(ctx), 0);
        }
    }

    #[test]
    fn compat_query_port_fills_only_the_48_byte_prefix() {
        // SAFETY: valid arguments; attr is a full ibv_port_attr; the context is closed.
        unsafe {
            let ctx = ibv_open_device(device_ptr());
            let mut attr = ibv_port_attr {
                port_cap_flags2: 0xaaaa,
                ..Default::default()
            };
            assert_eq!(ibv_query_port(ctx, 1, &mut attr), 0);
            assert_eq!(attr.state, IBV_PORT_ACTIVE);
            assert_eq!(attr.link_layer, IBV_LINK_LAYER_ETHERNET);
            assert_eq!(
                attr.port_cap_flags2, 0xaaaa,
                "compat entry wrote past 48 bytes"
            );
            let mut full = ibv_port_attr {
                port_cap_flags2: 0xaaaa,
                ..Default::default()
            };
            assert_eq!(vctx_query_port(ctx, 1, &mut full, 52), 0);
            assert_eq!(full.port_cap_flags2, 0);
            assert_eq!(ibv_query_port(ctx, 0, &mut attr), libc::EINVAL);
            assert_eq!(ibv_close_device(ctx), 0);
        }
    }

    #[test]
    fn context_layout_is_what_inline_verbs_expect() {
        // SAFETY: valid arguments; the context is closed at the end.
        unsafe {
            let ctx = ibv_open_device(device_ptr());
            assert!(!ctx.is_null());
            assert_eq!((*ctx).abi_compat as usize, usize::MAX);
            assert_eq!((*ctx).device, device_ptr());
            // verbs_context.sz sits right before the ibv_context (ibv_devinfo: *(ctx-8)).
            assert_eq!(*(ctx.cast::<u8>().sub(8).cast::<usize>()), 648);
            // The word after the device (verbs_device.ops) is NULL.
            assert!((*device_ptr().cast::<MrkitDevice>())
                .verbs_device_ops
                .is_null());
            assert!((*ctx).ops.post_send.is_some() && (*ctx).ops.poll_cq.is_some());
            assert_eq!(ibv_close_device(ctx), 0);
        }
    }
}
