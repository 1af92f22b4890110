//! PD, MR, MW, fork support and the `ibv_*_str` helpers, implemented over `mrkit_soft`.
//!
//! errno values are mrkit-soft's (the kernel's): the C API reports them the way libibverbs
//! does — NULL + errno for constructors, the errno value as the return code for
//! `ibv_dealloc_pd` / `ibv_dereg_mr` / `ibv_dealloc_mw`, and `enum ibv_rereg_mr_err_code` with
//! errno for `ibv_rereg_mr`.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};

use mrkit_soft::{AccessFlags, MwType, ReregFlags, UserMemory};

use crate::abi::*;
use crate::device::mctx;
use crate::ffi::{guard, set_errno};

fn fail_null<T>(e: c_int) -> *mut T {
    set_errno(e);
    std::ptr::null_mut()
}

fn soft_errno(e: &mrkit_soft::Error) -> c_int {
    e.errno().raw()
}

/// Addresses of the PDs, MRs and MWs this library handed out and has not freed (this process's:
/// a forked child starts empty, so the parent's objects are refused there without being read).
/// The release verbs look the pointer up before reading the struct, so a second
/// `ibv_dereg_mr` / `ibv_dealloc_pd` / `dealloc_mw` of a freed object is EINVAL instead of a
/// read of freed memory. Control path only (one hash insert per create, one remove per
/// release); the data path never consults it.
static LIVE: mrkit_soft::mem::PerProcess<std::sync::Mutex<std::collections::HashSet<usize>>> =
    mrkit_soft::mem::PerProcess::new();

fn live() -> std::sync::MutexGuard<'static, std::collections::HashSet<usize>> {
    let cell = LIVE.get_or_init(Default::default);
    cell.lock().unwrap_or_else(|e| e.into_inner())
}

/// `Box::into_raw(Box::new(v))`, recorded as live for [`release_boxed`].
fn into_live<T>(v: T) -> *mut T {
    let p = Box::into_raw(Box::new(v));
    live().insert(p as usize);
    p
}

/// Whether `p` is a live object of this library (see [`LIVE`]).
pub(crate) fn is_live<T>(p: *const T) -> bool {
    live().contains(&(p as usize))
}

/// A PD's context, device handle and open context: None for a NULL PD or a closed context.
///
/// # Safety
/// `pd` NULL or a live PD of this library.
pub(crate) unsafe fn pd_parts<'a>(
    pd: *mut ibv_pd,
) -> Option<(*mut ibv_context, u32, &'a crate::device::MrkitContext)> {
    if pd.is_null() {
        return None;
    }
    // SAFETY: pd is a live PD (caller contract).
    let (ctx, handle) = unsafe { ((*pd).context, (*pd).handle) };
    // SAFETY: the PD's context is open (caller contract).
    let m = unsafe { mctx(ctx) }?;
    Some((ctx, handle, m))
}

/// The body of the release verbs whose struct this library allocated with `Box`
/// (`ibv_dealloc_pd`, `ibv_dereg_mr`, `ops.dealloc_mw`): EINVAL (errno too) for NULL, an
/// object already released (not in [`LIVE`]: never read) or a closed context; else `release(device, handle)`: on success the struct is freed and 0
/// returned, on failure the struct stays valid and the errno value is returned (and set).
///
/// # Safety
/// `obj` NULL, or a struct of type `T` this library allocated with [`into_live`] (live or
/// already released); `parts` returns its `(context, device handle)`.
unsafe fn release_boxed<T>(
    obj: *mut T,
    parts: impl FnOnce(&T) -> (*mut ibv_context, u32),
    release: impl FnOnce(&mrkit_soft::Context, u32) -> mrkit_soft::Result<()>,
) -> c_int {
    // Claim it: of two racing or repeated releases only one finds it live.
    if obj.is_null() || !live().remove(&(obj as usize)) {
        set_errno(libc::EINVAL);
        return libc::EINVAL;
    }
    let restore = || {
        live().insert(obj as usize);
    };
    // SAFETY: obj was live (found in LIVE, which only holds unfreed objects of this library).
    let (ctx, handle) = parts(unsafe { &*obj });
    // SAFETY: the object's context is a context of this library (open or closed).
    let Some(m) = (unsafe { mctx(ctx) }) else {
        restore();
        set_errno(libc::EINVAL);
        return libc::EINVAL;
    };
    let rc = guard(libc::EIO, || match release(&m.soft, handle) {
        Ok(()) => {
            // SAFETY: allocated by Box in this library (into_live) and claimed above, so freed
            // exactly once.
            drop(unsafe { Box::from_raw(obj) });
            0
        }
        Err(e) => {
            set_errno(soft_errno(&e));
            soft_errno(&e)
        }
    });
    if rc != 0 {
        restore();
    }
    rc
}

// ---------------------------------------------------------------------------------------------
// Protection domains.

/// `struct ibv_pd *ibv_alloc_pd(struct ibv_context *)`: ENOMEM at max_pd.
///
/// # Safety
/// `ctx` must be NULL or an open context.
pub(crate) unsafe extern "C" fn ibv_alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd {
    // SAFETY: caller contract.
    let Some(m) = (unsafe { mctx(ctx) }) else {
        return fail_null(libc::EINVAL);
    };
    guard(std::ptr::null_mut(), || match m.soft.alloc_pd() {
        Ok(handle) => into_live(ibv_pd {
            context: ctx,
            handle,
        }),
        Err(e) => fail_null(soft_errno(&e)),
    })
}

/// `int ibv_dealloc_pd(struct ibv_pd *)`: 0, or the errno value (EBUSY while MRs/MWs use it;
/// the PD stays valid then).
///
/// # Safety
/// `pd` must be NULL or a PD from [`ibv_alloc_pd`] not yet deallocated.
pub(crate) unsafe extern "C" fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int {
    // SAFETY: forwarded contract (allocated by Box in ibv_alloc_pd).
    unsafe { release_boxed(pd, |p| (p.context, p.handle), |s, h| s.dealloc_pd(h)) }
}

// ---------------------------------------------------------------------------------------------
// Memory regions.

/// Set once the process registered an MR (`ibv_fork_init` after that is EINVAL, as in
/// libibverbs).
static REGISTERED_ONCE: AtomicBool = AtomicBool::new(false);
/// `ibv_fork_init` was called (or RDMAV_FORK_SAFE / IBV_FORK_SAFE is set).
static FORK_INIT: AtomicBool = AtomicBool::new(false);

/// # Safety
/// `pd` must be NULL or a live PD, and `[addr, addr+len)` must stay mapped and allocated until
/// the MR is deregistered (the application's side of `ibv_reg_mr`'s contract).
unsafe fn reg_common(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: u32,
) -> *mut ibv_mr {
    // SAFETY: caller contract.
    let Some((ctx, handle, m)) = (unsafe { pd_parts(pd) }) else {
        return fail_null(libc::EINVAL);
    };
    // SAFETY: the caller keeps the range valid until `ibv_dereg_mr` (contract above).
    let mem = unsafe { UserMemory::new(addr as u64, len as u64) };
    guard(std::ptr::null_mut(), || {
        let access = AccessFlags::from_bits_retain(access);
        match m.soft.reg_mr(handle, mem, iova, access) {
            Ok(info) => {
                REGISTERED_ONCE.store(true, Ordering::Relaxed);
                into_live(ibv_mr {
                    context: ctx,
                    pd,
                    addr,
                    length: len,
                    handle: info.lkey,
                    lkey: info.lkey,
                    rkey: info.rkey,
                })
            }
            Err(e) => fail_null(soft_errno(&e)),
        }
    })
}

/// `struct ibv_mr *ibv_reg_mr(pd, void *addr, size_t length, int access)` (iova = addr).
///
/// # Safety
/// `pd` must be NULL or a live PD; `[addr, addr+length)` must stay allocated until the MR is
/// deregistered (the device and peers access it until then; it is never dereferenced through
/// a Rust reference).
pub(crate) unsafe extern "C" fn ibv_reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: forwarded contract.
    unsafe { reg_common(pd, addr, length, addr as u64, access as u32) }
}

/// `struct ibv_mr *ibv_reg_mr_iova(pd, void *addr, size_t length, uint64_t iova, int access)`.
///
/// # Safety
/// As [`ibv_reg_mr`].
pub(crate) unsafe extern "C" fn ibv_reg_mr_iova(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: forwarded contract.
    unsafe { reg_common(pd, addr, length, iova, access as u32) }
}

/// `struct ibv_mr *ibv_reg_mr_iova2(pd, void *addr, size_t length, uint64_t iova,
/// unsigned int access)`: optional-range bits (RELAXED_ORDERING ...) are ignored.
///
/// # Safety
/// As [`ibv_reg_mr`].
pub(crate) unsafe extern "C" fn ibv_reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_uint,
) -> *mut ibv_mr {
    // SAFETY: forwarded contract.
    unsafe { reg_common(pd, addr, length, iova, access) }
}

/// `int ibv_dereg_mr(struct ibv_mr *)`: 0 (the struct is freed), or the errno value (EINVAL
/// while memory windows are bound; the MR stays valid).
///
/// # Safety
/// `mr` must be NULL or a live MR from this library; it must not be used after success.
pub(crate) unsafe extern "C" fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
    // SAFETY: forwarded contract (allocated by Box in reg_common).
    unsafe { release_boxed(mr, |r| (r.context, r.lkey), |s, k| s.dereg_mr(k)) }
}

/// `int ibv_rereg_mr(struct ibv_mr *mr, int flags, struct ibv_pd *pd, void *addr,
/// size_t length, int access)`.
///
/// Library checks first (→ `IBV_REREG_MR_ERR_INPUT`, errno EINVAL, MR unchanged): unknown
/// flags, CHANGE_TRANSLATION with NULL address or length 0, access without CHANGE_ACCESS. Then
/// the device (→ `IBV_REREG_MR_ERR_CMD` with its errno: flags 0 EINVAL, access rules, unknown
/// PD, EACCES for upgrading a read-only pin to writable). On ERR_CMD the old MR is in fact still
/// valid here (mrkit-soft fails atomically) and must still be deregistered. On success the
/// struct is updated (CHANGE_TRANSLATION gives new keys; iova = the new address).
///
/// # Safety
/// `mr` NULL or a live MR; `pd` NULL or a live PD of the same context; with
/// CHANGE_TRANSLATION, `[addr, addr+length)` valid until the MR is deregistered.
pub(crate) unsafe extern "C" fn ibv_rereg_mr(
    mr: *mut ibv_mr,
    flags: c_int,
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> c_int {
    let input_err = || {
        set_errno(libc::EINVAL);
        IBV_REREG_MR_ERR_INPUT
    };
    let flags = flags as u32;
    if mr.is_null() || flags & !ReregFlags::SUPPORTED != 0 {
        return input_err();
    }
    if flags & ReregFlags::CHANGE_TRANSLATION != 0 && (addr.is_null() || length == 0) {
        return input_err();
    }
    if access != 0 && flags & ReregFlags::CHANGE_ACCESS == 0 {
        return input_err();
    }
    if !is_live(mr) {
        // Not an MR this library holds registered (deregistered, or a copy): the device knows
        // no such MR, as the kernel knows no such handle. Its memory is not read.
        set_errno(libc::EINVAL);
        return IBV_REREG_MR_ERR_CMD;
    }
    // SAFETY: mr is a live MR of this library (checked above).
    let (ctx, lkey) = unsafe { ((*mr).context, (*mr).lkey) };
    // SAFETY: the MR's context is open.
    let Some(m) = (unsafe { mctx(ctx) }) else {
        return input_err();
    };
    let new_pd = if flags & ReregFlags::CHANGE_PD != 0 {
        if pd.is_null() {
            set_errno(libc::EINVAL);
            return IBV_REREG_MR_ERR_CMD;
        }
        // SAFETY: pd is a live PD (caller contract).
        unsafe { (*pd).handle }
    } else {
        0
    };
    let mem = if flags & ReregFlags::CHANGE_TRANSLATION != 0 {
        // SAFETY: with CHANGE_TRANSLATION the application hands over `[addr, addr+length)`
        // under `ibv_reg_mr`'s contract: valid until the MR is deregistered.
        unsafe { UserMemory::new(addr as u64, length as u64) }
    } else {
        UserMemory::empty_at(addr as u64)
    };
    guard(IBV_REREG_MR_ERR_CMD, || {
        let r = m.soft.rereg_mr(
            lkey,
            flags,
            new_pd,
            mem,
            addr as u64,
            AccessFlags::from_bits_retain(access as u32),
        );
        match r {
            Ok(info) => {
                // SAFETY: mr is a live MR we own the layout of (caller contract).
                let mr = unsafe { &mut *mr };
                mr.lkey = info.lkey;
                mr.rkey = info.rkey;
                mr.handle = info.lkey;
                if flags & ReregFlags::CHANGE_PD != 0 {
                    mr.pd = pd;
                }
                if flags & ReregFlags::CHANGE_TRANSLATION != 0 {
                    mr.addr = addr;
                    mr.length = length;
                }
                0
            }
            Err(e) => {
                set_errno(soft_errno(&e));
                IBV_REREG_MR_ERR_CMD
            }
        }
    })
}

/// `verbs_context.advise_mr` (`ibv_advise_mr`): ODP prefetch through mrkit-soft.
///
/// # Safety
/// `pd` a live PD; `sg` valid for `num_sge` entries.
pub(crate) unsafe extern "C" fn vctx_advise_mr(
    pd: *mut ibv_pd,
    advice: u32,
    flags: u32,
    sg: *mut ibv_sge,
    num_sge: u32,
) -> c_int {
    if pd.is_null() || (sg.is_null() && num_sge != 0) {
        set_errno(libc::EINVAL);
        return libc::EINVAL;
    }
    // SAFETY: pd is live (caller contract).
    let (ctx, handle) = unsafe { ((*pd).context, (*pd).handle) };
    // SAFETY: the PD's context is open.
    let Some(m) = (unsafe { mctx(ctx) }) else {
        set_errno(libc::EINVAL);
        return libc::EINVAL;
    };
    let sges: Vec<(u32, u64, u32)> = if num_sge == 0 {
        Vec::new()
    } else {
        // SAFETY: sg valid for num_sge entries (caller contract).
        unsafe { std::slice::from_raw_parts(sg, num_sge as usize) }
            .iter()
            .map(|s| (s.lkey, s.addr, s.length))
            .collect()
    };
    guard(libc::EIO, || {
        match m.soft.advise_mr(handle, advice, flags, &sges) {
            Ok(()) => 0,
            Err(e) => {
                set_errno(soft_errno(&e));
                soft_errno(&e)
            }
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Memory windows (through ctx->ops, as the inline ibv_alloc_mw / ibv_dealloc_mw call them).

/// `ops.alloc_mw(pd, type)`: type 1 or 2; ENOMEM at max_mw.
///
/// # Safety
/// `pd` NULL or a live PD.
pub(crate) unsafe extern "C" fn op_alloc_mw(pd: *mut ibv_pd, ty: c_int) -> *mut ibv_mw {
    if pd.is_null() {
        return fail_null(libc::EINVAL);
    }
    let mw_type = match ty {
        1 => MwType::Type1,
        2 => MwType::Type2,
        _ => return fail_null(libc::EINVAL),
    };
    // SAFETY: caller contract.
    let Some((ctx, handle, m)) = (unsafe { pd_parts(pd) }) else {
        return fail_null(libc::EINVAL);
    };
    guard(std::ptr::null_mut(), || {
        match m.soft.alloc_mw(handle, mw_type) {
            Ok(rkey) => into_live(ibv_mw {
                context: ctx,
                pd,
                rkey,
                handle: rkey,
                type_: ty,
            }),
            Err(e) => fail_null(soft_errno(&e)),
        }
    })
}

/// `ops.dealloc_mw(mw)`: 0 (freed) or the errno value.
///
/// # Safety
/// `mw` NULL or a live MW from [`op_alloc_mw`]; not used after success.
pub(crate) unsafe extern "C" fn op_dealloc_mw(mw: *mut ibv_mw) -> c_int {
    // SAFETY: forwarded contract (allocated by Box in op_alloc_mw).
    unsafe { release_boxed(mw, |w| (w.context, w.handle), |s, h| s.dealloc_mw(h)) }
}

// ---------------------------------------------------------------------------------------------
// Fork support.

fn env_fork_safe() -> bool {
    ["RDMAV_FORK_SAFE", "IBV_FORK_SAFE"]
        .iter()
        .any(|k| std::env::var_os(k).is_some())
}

/// Whether contexts opened from now on must mark registrations MADV_DONTFORK even when
/// `MRKIT_DONTFORK=0` (ibv_fork_init was called, or RDMAV_FORK_SAFE/IBV_FORK_SAFE is set).
pub(crate) fn fork_protection_requested() -> bool {
    FORK_INIT.load(Ordering::Relaxed) || env_fork_safe()
}

fn device_dontfork_default() -> bool {
    mrkit_soft::DeviceConfig::from_env()
        .map(|c| c.uses_dontfork())
        .unwrap_or(false)
}

/// `int ibv_fork_init(void)`: turns MADV_DONTFORK marking on for the device opened from now on
/// (registrations made after that are marked; earlier ones stay unmarked, as in libibverbs).
/// Returns 0. The one EINVAL case is libibverbs' "too late" rule of kernels that share pinned
/// pages with a forked child (before 5.13): a registration was made unmarked already. On
/// kernels that copy pinned pages at fork libibverbs makes this call a no-op; mrkit still
/// honours it (marking only costs the caller who asks), while [`ibv_is_fork_initialized`]
/// answers UNNEEDED as libibverbs does.
///
/// # Safety
/// No pointers involved.
pub(crate) unsafe extern "C" fn ibv_fork_init() -> c_int {
    if device_dontfork_default()
        || FORK_INIT.load(Ordering::Relaxed)
        || mrkit_soft::mem::fork::kernel_copies_pinned_pages_on_fork()
        || !REGISTERED_ONCE.load(Ordering::Relaxed)
    {
        FORK_INIT.store(true, Ordering::Relaxed);
        return 0;
    }
    libc::EINVAL
}

/// `enum ibv_fork_status ibv_is_fork_initialized(void)`, libibverbs' answer: UNNEEDED on
/// kernels that copy pinned pages into a forked child (5.13 and later), whether or not
/// `ibv_fork_init` was called (it takes precedence); otherwise ENABLED when registrations are
/// marked DONTFORK (ibv_fork_init, RDMAV_FORK_SAFE / IBV_FORK_SAFE, MRKIT_DONTFORK=1),
/// DISABLED when not.
///
/// # Safety
/// No pointers involved.
pub(crate) unsafe extern "C" fn ibv_is_fork_initialized() -> c_int {
    if mrkit_soft::mem::fork::kernel_copies_pinned_pages_on_fork() {
        IBV_FORK_UNNEEDED
    } else if device_dontfork_default() || fork_protection_requested() {
        IBV_FORK_ENABLED
    } else {
        IBV_FORK_DISABLED
    }
}

// ---------------------------------------------------------------------------------------------
// String helpers (rdma-core's texts).

/// `table[i]`, or "unknown" outside it (or where the table has no text): rdma-core's
/// `*_str` helpers.
fn table_str(table: &'static [Option<&'static CStr>], i: c_int) -> *const c_char {
    usize::try_from(i)
        .ok()
        .and_then(|i| table.get(i).copied().flatten())
        .unwrap_or(c"unknown")
        .as_ptr()
}

/// Texts of `ibv_wc_status_str`, indexed by `enum ibv_wc_status`.
static WC_STATUS_STR: [Option<&CStr>; 24] = [
    Some(c"success"),
    Some(c"local length error"),
    Some(c"local QP operation error"),
    Some(c"local EE context operation error"),
    Some(c"local protection error"),
    Some(c"Work Request Flushed Error"),
    Some(c"memory management operation error"),
    Some(c"bad response error"),
    Some(c"local access error"),
    Some(c"remote invalid request error"),
    Some(c"remote access error"),
    Some(c"remote operation error"),
    Some(c"transport retry counter exceeded"),
    Some(c"RNR retry counter exceeded"),
    Some(c"local RDD violation error"),
    Some(c"remote invalid RD request"),
    Some(c"aborted error"),
    Some(c"invalid EE context number"),
    Some(c"invalid EE context state"),
    Some(c"fatal error"),
    Some(c"response timeout error"),
    Some(c"general error"),
    Some(c"TM error"),
    Some(c"TM software rendezvous"),
];

/// `const char *ibv_wc_status_str(enum ibv_wc_status)`.
///
/// # Safety
/// No pointers involved; returns a static string.
pub(crate) unsafe extern "C" fn ibv_wc_status_str(status: c_int) -> *const c_char {
    table_str(&WC_STATUS_STR, status)
}

/// Texts of `ibv_node_type_str`, indexed by `enum ibv_node_type`.
static NODE_TYPE_STR: [Option<&CStr>; 8] = [
    None,
    Some(c"InfiniBand channel adapter"),
    Some(c"InfiniBand switch"),
    Some(c"InfiniBand router"),
    Some(c"iWARP NIC"),
    Some(c"usNIC"),
    Some(c"usNIC UDP"),
    Some(c"unspecified"),
];

/// `const char *ibv_node_type_str(enum ibv_node_type)`.
///
/// # Safety
/// No pointers involved; returns a static string.
pub(crate) unsafe extern "C" fn ibv_node_type_str(t: c_int) -> *const c_char {
    table_str(&NODE_TYPE_STR, t)
}

/// Texts of `ibv_port_state_str`, indexed by `enum ibv_port_state`.
static PORT_STATE_STR: [Option<&CStr>; 6] = [
    Some(c"no state change (NOP)"),
    Some(c"down"),
    Some(c"init"),
    Some(c"armed"),
    Some(c"active"),
    Some(c"active defer"),
];

/// `const char *ibv_port_state_str(enum ibv_port_state)`.
///
/// # Safety
/// No pointers involved; returns a static string.
pub(crate) unsafe extern "C" fn ibv_port_state_str(s: c_int) -> *const c_char {
    table_str(&PORT_STATE_STR, s)
}

/// Texts of `ibv_event_type_str`, indexed by `enum ibv_event_type`.
static EVENT_TYPE_STR: [Option<&CStr>; 20] = [
    Some(c"CQ error"),
    Some(c"local work queue catastrophic error"),
    Some(c"invalid request local work queue error"),
    Some(c"local access violation work queue error"),
    Some(c"communication established"),
    Some(c"send queue drained"),
    Some(c"path migrated"),
    Some(c"path migration request error"),
    Some(c"local catastrophic error"),
    Some(c"port active"),
    Some(c"port error"),
    Some(c"LID change"),
    Some(c"P_Key change"),
    Some(c"SM change"),
    Some(c"SRQ catastrophic error"),
    Some(c"SRQ limit reached"),
    Some(c"last WQE reached"),
    Some(c"client reregistration"),
    Some(c"GID table change"),
    Some(c"WQ fatal"),
];

/// `const char *ibv_event_type_str(enum ibv_event_type)`.
///
/// # Safety
/// No pointers involved; returns a static string.
pub(crate) unsafe extern "C" fn ibv_event_type_str(e: c_int) -> *const c_char {
    table_str(&EVENT_TYPE_STR, e)
}
