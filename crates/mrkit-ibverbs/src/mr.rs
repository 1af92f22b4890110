//! Memory regions: `ibv_reg_mr` (and its `_iova` / `_iova2` forms), `ibv_rereg_mr`
//! (`enum ibv_rereg_mr_err_code` with errno), `ibv_dereg_mr`, and `verbs_context.advise_mr`
//! (prefetch of ODP MRs).

use std::ffi::{c_int, c_uint, c_void};

use mrkit_soft::{AccessFlags, ReregFlags, UserMemory};

use crate::abi::*;
use crate::context::open_context;
use crate::ffi::{fail_null, guard, set_errno, soft_errno};
use crate::obj::{into_live, is_live, release_boxed};
use crate::pd::pd_parts;

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
                crate::fork::note_registration();
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
    let Some(m) = (unsafe { open_context(ctx) }) else {
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
    let Some(m) = (unsafe { open_context(ctx) }) else {
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
