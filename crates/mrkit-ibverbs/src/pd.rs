//! Protection domains. PDs, like MRs and MWs, are plain `ibv_*` structs recorded as live
//! (`obj.rs`), so a second `ibv_dealloc_pd` is EINVAL instead of a read of freed memory.
//!
//! errno values are mrkit-soft's (the kernel's): NULL + errno for constructors, the errno value
//! as the return code for the release verbs, as libibverbs reports them.

use std::ffi::c_int;

use crate::abi::*;
use crate::context::{open_context, MrkitContext};
use crate::ffi::{fail_null, guard, soft_errno};
use crate::obj::{into_live, release_boxed};

/// A PD's context, device handle and open context: None for a NULL PD or a closed context.
///
/// # Safety
/// `pd` NULL or a live PD of this library.
pub(crate) unsafe fn pd_parts<'a>(
    pd: *mut ibv_pd,
) -> Option<(*mut ibv_context, u32, &'a MrkitContext)> {
    if pd.is_null() {
        return None;
    }
    // SAFETY: pd is a live PD (caller contract).
    let (ctx, handle) = unsafe { ((*pd).context, (*pd).handle) };
    // SAFETY: the PD's context is open (caller contract).
    let m = unsafe { open_context(ctx) }?;
    Some((ctx, handle, m))
}

// ---------------------------------------------------------------------------------------------
// Protection domains.

/// `struct ibv_pd *ibv_alloc_pd(struct ibv_context *)`: ENOMEM at max_pd.
///
/// # Safety
/// `ctx` must be NULL or an open context.
pub(crate) unsafe extern "C" fn ibv_alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd {
    // SAFETY: caller contract.
    let Some(m) = (unsafe { open_context(ctx) }) else {
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
