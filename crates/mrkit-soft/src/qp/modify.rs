//! `ibv_modify_qp` on one QP object: the RC transition table, the attribute checks against
//! the device limits and what each transition does to the engines. The driver's
//! `Context::modify_qp` (and the test kit's virtual-clock nodes) call it; scheduling the QP
//! afterwards is the caller's.
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Instant;

use super::{attr_mask, comp, pow2, req, resp, state, QpAttr, QpObject, QpState};
use crate::access::AccessFlags;
use crate::device::DeviceAttr;
use crate::error::{err, Result};
use crate::wire::PSN_MASK;

impl QpObject {
    /// Apply `attr` under `mask` (the checks and effects of `ibv_modify_qp`; `dev` holds the
    /// limits, `now` is the time the transition happens at: the completer's timers start
    /// there). A transition to RESET empties the queues and removes the QP's completions
    /// from its send and receive CQs.
    pub(crate) fn modify(
        &self,
        dev: &DeviceAttr,
        attr: &QpAttr,
        mask: u32,
        now: Instant,
    ) -> Result<()> {
        use attr_mask as m;
        let q = self;
        let qpn = self.qpn;
        let mut g = q.inner.lock();
        let cur = g.state;
        let to = state::check_modify(cur, mask, attr.qp_state)?;
        if mask & m::CUR_STATE != 0 && attr.cur_qp_state != cur as u32 {
            return Err(err!(
                EINVAL,
                "cur_qp_state {} does not match the QP's state {:?}",
                attr.cur_qp_state,
                cur
            ));
        }
        if mask & m::PORT != 0 && attr.port_num != 1 {
            return Err(err!(
                EINVAL,
                "port {} does not exist (mrkit0 has port 1)",
                attr.port_num
            ));
        }
        if mask & m::AV != 0 && attr.ah_attr.port_num > 1 {
            return Err(err!(
                EINVAL,
                "address vector names port {}",
                attr.ah_attr.port_num
            ));
        }
        if mask & m::PKEY_INDEX != 0 && attr.pkey_index >= dev.max_pkeys {
            return Err(err!(
                EINVAL,
                "pkey_index {} >= max_pkeys {}",
                attr.pkey_index,
                dev.max_pkeys
            ));
        }
        if mask & m::ACCESS_FLAGS != 0 && attr.qp_access_flags.bits() & !AccessFlags::SUPPORTED != 0
        {
            return Err(err!(
                EINVAL,
                "unknown QP access bits {:#x}",
                attr.qp_access_flags.bits()
            ));
        }
        if mask & m::PATH_MTU != 0 && !(1..=5).contains(&attr.path_mtu) {
            return Err(err!(
                EINVAL,
                "path_mtu {} is not IBV_MTU_256..IBV_MTU_4096",
                attr.path_mtu
            ));
        }
        if mask & m::MAX_QP_RD_ATOMIC != 0 && attr.max_rd_atomic > dev.max_qp_init_rd_atom {
            return Err(err!(
                EINVAL,
                "max_rd_atomic {} > {}",
                attr.max_rd_atomic,
                dev.max_qp_init_rd_atom
            ));
        }
        if mask & m::MAX_DEST_RD_ATOMIC != 0 && attr.max_dest_rd_atomic > dev.max_qp_rd_atom {
            return Err(err!(
                EINVAL,
                "max_dest_rd_atomic {} > {}",
                attr.max_dest_rd_atomic,
                dev.max_qp_rd_atom
            ));
        }
        if mask & m::TIMEOUT != 0 && attr.timeout > 31 {
            return Err(err!(EINVAL, "timeout {} > 31", attr.timeout));
        }
        if mask & m::RETRY_CNT != 0 && attr.retry_cnt > 7 {
            return Err(err!(EINVAL, "retry_cnt {} > 7", attr.retry_cnt));
        }
        if mask & m::RNR_RETRY != 0 && attr.rnr_retry > 7 {
            return Err(err!(EINVAL, "rnr_retry {} > 7", attr.rnr_retry));
        }
        if mask & m::MIN_RNR_TIMER != 0 && attr.min_rnr_timer > 31 {
            return Err(err!(EINVAL, "min_rnr_timer {} > 31", attr.min_rnr_timer));
        }
        if mask & m::CAP != 0 {
            let c = attr.cap;
            if c.max_send_wr > dev.max_qp_wr
                || c.max_recv_wr > dev.max_qp_wr
                || c.max_send_sge > dev.max_sge
                || c.max_recv_sge > dev.max_sge
                || c.max_inline_data > dev.max_inline_data
            {
                return Err(err!(EINVAL, "IBV_QP_CAP exceeds the device limits"));
            }
        }
        // Apply.
        let a = &mut g.attr;
        if mask & m::EN_SQD_ASYNC_NOTIFY != 0 {
            a.en_sqd_async_notify = attr.en_sqd_async_notify;
        }
        if mask & m::ACCESS_FLAGS != 0 {
            a.qp_access_flags = attr.qp_access_flags;
        }
        if mask & m::PKEY_INDEX != 0 {
            a.pkey_index = attr.pkey_index;
        }
        if mask & m::PORT != 0 {
            a.port_num = attr.port_num;
        }
        if mask & m::AV != 0 {
            a.ah_attr = attr.ah_attr;
        }
        if mask & m::PATH_MTU != 0 {
            a.path_mtu = attr.path_mtu;
        }
        if mask & m::TIMEOUT != 0 {
            a.timeout = attr.timeout;
        }
        if mask & m::RETRY_CNT != 0 {
            a.retry_cnt = attr.retry_cnt;
        }
        if mask & m::RNR_RETRY != 0 {
            a.rnr_retry = attr.rnr_retry;
        }
        if mask & m::RQ_PSN != 0 {
            a.rq_psn = attr.rq_psn & PSN_MASK;
        }
        if mask & m::MAX_QP_RD_ATOMIC != 0 {
            a.max_rd_atomic = pow2(attr.max_rd_atomic);
        }
        if mask & m::MIN_RNR_TIMER != 0 {
            a.min_rnr_timer = attr.min_rnr_timer;
        }
        if mask & m::SQ_PSN != 0 {
            a.sq_psn = attr.sq_psn & PSN_MASK;
        }
        if mask & m::MAX_DEST_RD_ATOMIC != 0 {
            a.max_dest_rd_atomic = pow2(attr.max_dest_rd_atomic);
        }
        if mask & m::DEST_QPN != 0 {
            a.dest_qp_num = attr.dest_qp_num & crate::wire::QPN_MASK;
        }
        if mask & m::CAP != 0 {
            a.cap = attr.cap;
        }
        let a = *a;
        g.state = to;
        match to {
            QpState::Reset if cur != QpState::Reset => {
                g.sq = req::SendQueue::default();
                if let Some(s) = &q.srq {
                    s.give_back(g.rq.drain(..));
                }
                g.rq.clear();
                g.last_wqe_notified = false;
                g.req = req::Requester::default();
                g.comp = comp::Completer::new(now);
                g.resp = resp::Responder::default();
                q.inbox.clear();
                // CQ clean (cq.rs): under the QP lock, so no completion of this QP can be
                // pushed between the clean and the state change becoming visible.
                q.send_cq.clean_qp(qpn);
                if !Arc::ptr_eq(&q.send_cq, &q.recv_cq) {
                    q.recv_cq.clean_qp(qpn);
                }
            }
            QpState::Rtr if cur == QpState::Init => g.resp.reset(a.rq_psn),
            QpState::Rts if cur == QpState::Rtr => {
                g.req.start(a.sq_psn);
                g.comp
                    .start(a.sq_psn, a.retry_cnt, a.rnr_retry, a.timeout, now);
            }
            QpState::Sqd => g.sqd_notified = false,
            _ => {}
        }
        g.comp.set_limits(a.retry_cnt, a.rnr_retry, a.timeout);
        Ok(())
    }
}
