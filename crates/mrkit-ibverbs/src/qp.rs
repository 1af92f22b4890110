//! RC queue pairs: create (RC only; other types are EOPNOTSUPP), modify, query, destroy (which
//! waits for the QP's async events to be acked). Work requests are posted in `post.rs`.

use std::ffi::c_int;
use std::sync::Arc;

use mrkit_soft::qp::{QpAttr, QpCap, QpInitAttr};
use mrkit_soft::AccessFlags;

use crate::abi::*;
use crate::ah::{av_from_c, av_to_c};
use crate::cq::cq_of;
use crate::events::{Kind, ObjEvents};
use crate::ffi::{fail, fail_null, guard, soft_errno, zeroed};
use crate::obj::{finish_destroy, impl_obj, obj_ctx};
use crate::pd::pd_parts;
use crate::srq::srq_of;

const QP_MAGIC: u64 = 0x6d72_6b69_7471_7021; // "mrkitqp!"

impl_obj!(MrkitQp, qp, QP_MAGIC, events: Kind::Qp, qpn);

#[repr(C)]
pub(crate) struct MrkitQp {
    qp: ibv_qp,
    /// Room for the rest of an `ibv_qp_ex` (352 bytes), never handed out as such.
    _ex: [u64; 24],
    magic: u64,
    pub(crate) qpn: u32,
    pub(crate) cap: ibv_qp_cap,
    pub(crate) sq_sig_all: c_int,
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
    let (scq, rcq, srq) = unsafe { (cq_of(ia.send_cq), cq_of(ia.recv_cq), srq_of(ia.srq)) };
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
