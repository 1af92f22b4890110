//! Memory windows, through `ctx->ops` as the inline `ibv_alloc_mw` / `ibv_dealloc_mw` /
//! `ibv_bind_mw` of the headers call them. Binding posts a BIND_MW work request (`post.rs`).

use std::ffi::{c_int, c_void};

use mrkit_soft::MwType;

use crate::abi::*;
use crate::ffi::{fail, fail_null, guard, soft_errno, zeroed};
use crate::obj::{into_live, release_boxed};
use crate::pd::pd_parts;
use crate::post::op_post_send;

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
    wr.opcode = IBV_WR_BIND_MW;
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
