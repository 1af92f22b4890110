//! Shared receive queues: create, modify (the limit event), query, destroy. Receives are
//! posted in `post.rs`.

use std::ffi::c_int;
use std::sync::Arc;

use mrkit_soft::srq::SrqAttr;

use crate::abi::*;
use crate::events::{Kind, ObjEvents};
use crate::ffi::{fail, fail_null, guard, soft_errno, zeroed};
use crate::obj::{finish_destroy, impl_obj, obj, obj_ctx};
use crate::pd::pd_parts;

const SRQ_MAGIC: u64 = 0x6d72_6b69_7473_7271; // "mrkitsrq"

impl_obj!(MrkitSrq, srq, SRQ_MAGIC, events: Kind::Srq, srqn);

#[repr(C)]
pub(crate) struct MrkitSrq {
    srq: ibv_srq,
    magic: u64,
    pub(crate) srqn: u32,
    /// Async events (SRQ_LIMIT_REACHED) handed out for this SRQ (`events.rs`).
    ev: Arc<ObjEvents>,
}

/// # Safety
/// `srq` NULL or a live SRQ of this library.
pub(crate) unsafe fn srq_of<'a>(srq: *mut ibv_srq) -> Option<&'a mut MrkitSrq> {
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
