//! The QP verbs of the device: create, destroy, query and modify (the state machine with its
//! attribute masks), post send and receive; and the device's side of a QP run
//! ([`RunHost`]: timers, scheduling, events, notices) and of connecting ([`ConnectVerbs`]).
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{loopback, progress, Context};
use crate::access::AccessFlags;
use crate::error::{err, Result};
use crate::events::AsyncEvent;
use crate::memcore::MemCore;
use crate::qp::connect::ConnectVerbs;
use crate::qp::{
    attr_mask, comp, idle_for_inline, pow2, req, resp, state, validate_send, Inbox, Notice,
    PostError, QpAttr, QpCap, QpInitAttr, QpInner, QpObject, QpState, RecvWqe, RecvWr, RunHost,
    SendWr, LAST_QP,
};
use crate::stats::RxDrop;
use crate::wire::PSN_MASK;

impl RunHost for Context {
    fn mem(&self) -> &MemCore {
        &self.dev.core
    }
    fn node_id(&self) -> u64 {
        self.dev.dp.node_id
    }
    fn count_rx_drop(&self, why: RxDrop) {
        self.dev.net_stats.count(why, 1);
    }
    fn timer_key(&self, at: Instant) -> u64 {
        progress::ns_since_epoch(at)
    }
    fn tick(&self) -> Duration {
        progress::TICK_EVERY
    }
    fn arm_timer(&self, qpn: u32, key: u64) {
        self.dev.dp.arm_timer(qpn, key);
    }
    fn schedule(&self, qpn: u32) {
        self.dev.dp.schedule(qpn);
    }
    fn raise(&self, e: AsyncEvent) {
        self.raise_async_event(e);
    }
    fn notify_peer(&self, node: u64, qpn: u32, n: Notice) {
        loopback::notify(node, qpn, n);
    }
}

impl ConnectVerbs for Context {
    fn modify_qp(&self, qpn: u32, attr: &QpAttr, mask: u32) -> Result<()> {
        Context::modify_qp(self, qpn, attr, mask)
    }
    fn bind_udp_port(&self) -> Result<()> {
        self.udp_port().map(drop)
    }
    fn node_id(&self) -> u64 {
        Context::node_id(self)
    }
}

impl Context {
    /// This device instance's node id on the loopback link (put it in a peer's
    /// [`AddressVector::dest_node`](crate::qp::AddressVector::dest_node)).
    pub fn node_id(&self) -> u64 {
        self.dev.dp.node_id
    }

    fn qp(&self, qpn: u32) -> Result<Arc<QpObject>> {
        self.dev
            .dp
            .qps
            .read()
            .get(&qpn)
            .cloned()
            .ok_or_else(|| err!(EINVAL, "QP {qpn} does not exist"))
    }

    /// Run `f` on QP `qpn` through this thread's last-used QP cache (`last_used.rs`).
    fn with_qp<R>(&self, qpn: u32, f: impl FnOnce(&Arc<QpObject>) -> R) -> Result<R> {
        let dp = &self.dev.dp;
        crate::last_used::with_cached(&LAST_QP, dp.node_id, qpn, || dp.qp_object(qpn), f)
            .ok_or_else(|| err!(EINVAL, "QP {qpn} does not exist"))
    }

    /// QP `qpn` (a clone of its handle) through this thread's last-used QP cache: the
    /// receive path's lookup per packet run.
    pub(crate) fn qp_cached(&self, qpn: u32) -> Option<Arc<QpObject>> {
        let dp = &self.dev.dp;
        crate::last_used::with_cached(&LAST_QP, dp.node_id, qpn, || dp.qp_object(qpn), Arc::clone)
    }

    /// `ibv_create_qp` (RC). EINVAL for caps above the device limits (queue depth ≤ max_qp_wr,
    /// SGEs ≤ max_sge, inline ≤ 512), an unknown PD or CQ; ENOMEM when max_qp QPs exist.
    /// Returns the QP number and the actual caps.
    pub fn create_qp(&self, init: QpInitAttr) -> Result<(u32, QpCap)> {
        self.create_qp_inner(init, None)
    }

    /// `ibv_create_qp` with `srq` set: receive WQEs come from the shared receive queue `srq`
    /// (same PD required, EINVAL otherwise); `post_recv` on the QP → EINVAL; entering ERR
    /// raises `QpLastWqeReached` instead of flushing SRQ WQEs. `max_recv_wr`/`max_recv_sge`
    /// are ignored (reported as 0).
    pub fn create_qp_srq(&self, init: QpInitAttr, srq: u32) -> Result<(u32, QpCap)> {
        let s = self.srq(srq)?;
        if s.pd.handle != init.pd {
            return Err(err!(
                EINVAL,
                "SRQ {srq} belongs to PD {:#x}, the QP to PD {:#x}",
                s.pd.handle,
                init.pd
            ));
        }
        let init = QpInitAttr {
            cap: QpCap {
                max_recv_wr: 0,
                max_recv_sge: 0,
                ..init.cap
            },
            ..init
        };
        self.create_qp_inner(init, Some(s))
    }

    fn create_qp_inner(
        &self,
        init: QpInitAttr,
        srq: Option<Arc<crate::srq::SrqObject>>,
    ) -> Result<(u32, QpCap)> {
        let a = self.dev.core.config.attr();
        let c = init.cap;
        if c.max_send_wr > a.max_qp_wr || c.max_recv_wr > a.max_qp_wr {
            return Err(err!(
                EINVAL,
                "queue depth {}/{} exceeds max_qp_wr {}",
                c.max_send_wr,
                c.max_recv_wr,
                a.max_qp_wr
            ));
        }
        if c.max_send_sge > a.max_sge || c.max_recv_sge > a.max_sge {
            return Err(err!(
                EINVAL,
                "SGE count {}/{} exceeds max_sge {}",
                c.max_send_sge,
                c.max_recv_sge,
                a.max_sge
            ));
        }
        if c.max_inline_data > a.max_inline_data {
            return Err(err!(
                EINVAL,
                "max_inline_data {} exceeds the device's {}",
                c.max_inline_data,
                a.max_inline_data
            ));
        }
        let pd = self.dev.core.pd(init.pd)?;
        let send_cq = self.cq(init.send_cq)?;
        let recv_cq = self.cq(init.recv_cq)?;
        let dp = &self.dev.dp;
        if dp.qps.read().len() as u32 >= a.max_qp {
            return Err(err!(ENOMEM, "max_qp ({}) QPs exist; destroy one", a.max_qp));
        }
        let qpn = dp.alloc_qpn();
        pd.get();
        send_cq.users.fetch_add(1, Ordering::AcqRel);
        recv_cq.users.fetch_add(1, Ordering::AcqRel);
        let cap = QpCap {
            max_send_wr: c.max_send_wr.max(1),
            max_recv_wr: if srq.is_some() {
                0
            } else {
                c.max_recv_wr.max(1)
            },
            ..c
        };
        if let Some(s) = &srq {
            s.users.fetch_add(1, Ordering::AcqRel);
        }
        let attr = QpAttr {
            cap,
            ..QpAttr::default()
        };
        let obj = Arc::new(QpObject {
            qpn,
            pd,
            send_cq,
            recv_cq,
            sq_sig_all: init.sq_sig_all,
            srq,
            inbox: Inbox::default(),
            scheduled: AtomicBool::new(false),
            delay_acks: AtomicBool::new(true),
            destroyed: AtomicBool::new(false),
            delivering: std::sync::atomic::AtomicU32::new(0),
            inner: Mutex::new(QpInner {
                attr,
                state: QpState::Reset,
                sq: req::SendQueue::default(),
                rq: VecDeque::new(),
                req: req::Requester::default(),
                comp: comp::Completer::new(Instant::now()),
                resp: resp::Responder::default(),
                destroyed: false,
                sqd_notified: false,
                last_wqe_notified: false,
                send_wcs: Vec::new(),
                inbox_spare: Vec::new(),
                recv_wcs: Vec::new(),
                timer_at: None,
            }),
        });
        dp.qps.write().insert(qpn, obj);
        dp.ensure_thread(&self.dev);
        Ok((qpn, cap))
    }

    /// `ibv_destroy_qp`: outstanding WRs are discarded without completions; after this
    /// returns the device never processes the QP again.
    pub fn destroy_qp(&self, qpn: u32) -> Result<()> {
        // Held (delayed) ACKs leave now: the application may exit right after this.
        self.flush_acks(None);
        let q = self
            .dev
            .dp
            .qps
            .write()
            .remove(&qpn)
            .ok_or_else(|| err!(EINVAL, "QP {qpn} does not exist"))?;
        q.destroyed.store(true, Ordering::Release);
        {
            let mut g = q.inner.lock();
            g.destroyed = true;
            g.sq.q.clear();
            g.rq.clear();
            g.resp.reset(0);
            // Its timer entries are skipped: the QP is out of the table (and a new QP with
            // the same number has its own `timer_at`).
        }
        q.inbox.clear();
        // A run that finished before the lock above may still be handing its packets (the
        // ACK of the message whose completion the application just saw) to the link.
        super::delivery::wait_delivered(&q, super::delivery::DELIVERY_WAIT);
        q.send_cq.users.fetch_sub(1, Ordering::AcqRel);
        q.recv_cq.users.fetch_sub(1, Ordering::AcqRel);
        if let Some(s) = &q.srq {
            s.users.fetch_sub(1, Ordering::AcqRel);
        }
        q.pd.put();
        Ok(())
    }

    /// `ibv_query_qp`: the attributes and the current state (in `qp_state`/`cur_qp_state`).
    pub fn query_qp(&self, qpn: u32) -> Result<QpAttr> {
        let q = self.qp(qpn)?;
        let g = q.inner.lock();
        let mut a = g.attr;
        a.qp_state = g.state as u32;
        a.cur_qp_state = g.state as u32;
        Ok(a)
    }

    /// Current state.
    pub fn qp_state(&self, qpn: u32) -> Result<QpState> {
        Ok(self.qp(qpn)?.inner.lock().state)
    }

    /// `ibv_modify_qp` with the RC table and attribute rules of `docs/semantics.md` §8.
    /// A transition to RESET empties the queues and removes the QP's completions from its send
    /// and receive CQs (other QPs' completions stay; see `cq.rs`).
    pub fn modify_qp(&self, qpn: u32, attr: &QpAttr, mask: u32) -> Result<()> {
        use attr_mask as m;
        // Held (delayed) ACKs leave before the QP changes state (held_acks::ACK_DELAY_MAX).
        self.flush_acks(None);
        let q = self.qp(qpn)?;
        let mut g = q.inner.lock();
        let cur = g.state;
        let to = state::check_modify(cur, mask, attr.qp_state)?;
        let dev = self.dev.core.config.attr();
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
                g.comp = comp::Completer::new(Instant::now());
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
                g.comp.start(
                    a.sq_psn,
                    a.retry_cnt,
                    a.rnr_retry,
                    a.timeout,
                    Instant::now(),
                );
            }
            QpState::Sqd => g.sqd_notified = false,
            _ => {}
        }
        g.comp.set_limits(a.retry_cnt, a.rnr_retry, a.timeout);
        drop(g);
        self.dev.dp.schedule(qpn);
        Ok(())
    }

    /// `ibv_post_send`. Post-time checks of `docs/semantics.md` §6.2: state RESET/INIT/RTR →
    /// EINVAL; too many SGEs, bad atomic length/alignment, inline too long or on an opcode
    /// that cannot be inline, BIND_MW with SGEs/imm, message > 2^31 → EINVAL; SQ full → ENOMEM.
    /// Keys are not checked here. WRs before `bad_wr` are posted. In ERR every WR completes
    /// with WR_FLUSH_ERR.
    pub fn post_send(&self, qpn: u32, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
        self.post_on(qpn, |q| self.post_send_to(q, wrs))
    }

    /// Run a post on QP `qpn` (an unknown QP fails the first WR with EINVAL).
    fn post_on(
        &self,
        qpn: u32,
        post: impl FnOnce(&Arc<QpObject>) -> std::result::Result<(), PostError>,
    ) -> std::result::Result<(), PostError> {
        self.with_qp(qpn, post)
            .map_err(|error| PostError { bad_wr: 0, error })?
    }

    fn post_send_to(
        &self,
        q: &Arc<QpObject>,
        wrs: &[SendWr],
    ) -> std::result::Result<(), PostError> {
        let mut g = q.inner.lock();
        // Inline requester (docs/datapath.md "Latency"): an idle QP in RTS generates and
        // delivers its packets on the caller's thread instead of waking the progress thread.
        let inline = g.state == QpState::Rts && idle_for_inline(&g.sq) && !self.dev.dp.manual();
        let res = (|| {
            for (i, wr) in wrs.iter().enumerate() {
                let fail = |error| PostError { bad_wr: i, error };
                if matches!(g.state, QpState::Reset | QpState::Init | QpState::Rtr) {
                    return Err(fail(err!(
                        EINVAL,
                        "post_send on a QP in {:?}; move it to RTS first",
                        g.state
                    )));
                }
                let wqe = validate_send(wr, &g.attr.cap).map_err(fail)?;
                if g.sq.q.len() as u32 >= g.attr.cap.max_send_wr {
                    return Err(fail(err!(
                        ENOMEM,
                        "send queue full ({} WRs outstanding); poll the CQ or raise max_send_wr",
                        g.attr.cap.max_send_wr
                    )));
                }
                g.sq.q.push_back(wqe);
            }
            Ok(())
        })();
        q.delay_acks.store(true, Ordering::Relaxed);
        self.dev.dp.answered.store(true, Ordering::Relaxed);
        if inline {
            self.run_qp_inline(q, g);
        } else {
            drop(g);
            self.dev.dp.schedule(q.qpn);
        }
        res
    }

    /// `ibv_post_recv`: RESET → EINVAL, too many SGEs → EINVAL, RQ full → ENOMEM.
    pub fn post_recv(&self, qpn: u32, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        self.post_on(qpn, |q| self.post_recv_to(q, wrs))
    }

    fn post_recv_to(
        &self,
        q: &Arc<QpObject>,
        wrs: &[RecvWr],
    ) -> std::result::Result<(), PostError> {
        let qpn = q.qpn;
        let mut g = q.inner.lock();
        let mut flushed = false;
        let res = (|| {
            for (i, wr) in wrs.iter().enumerate() {
                let fail = |error| PostError { bad_wr: i, error };
                if q.srq.is_some() {
                    return Err(fail(err!(
                        EINVAL,
                        "QP {qpn} takes receives from an SRQ; use post_srq_recv"
                    )));
                }
                if g.state == QpState::Reset {
                    return Err(fail(err!(
                        EINVAL,
                        "post_recv on a QP in RESET; move it to INIT first"
                    )));
                }
                if wr.sg_list.len() as u32 > g.attr.cap.max_recv_sge {
                    return Err(fail(err!(
                        EINVAL,
                        "{} SGEs > max_recv_sge {}",
                        wr.sg_list.len(),
                        g.attr.cap.max_recv_sge
                    )));
                }
                if g.rq.len() as u32 >= g.attr.cap.max_recv_wr {
                    return Err(fail(err!(
                        ENOMEM,
                        "receive queue full ({})",
                        g.attr.cap.max_recv_wr
                    )));
                }
                g.rq.push_back(RecvWqe {
                    wr_id: wr.wr_id,
                    sges: wr.sg_list.clone(),
                });
                flushed |= g.state == QpState::Err;
            }
            Ok(())
        })();
        drop(g);
        if flushed {
            // A receive posted in ERR completes at once with WR_FLUSH_ERR (the next run
            // flushes it). In any other state nothing waits for it: a SEND that found no
            // receive was RNR-NAKed and its retry arrives as a new packet.
            self.dev.dp.schedule(qpn);
        }
        res
    }
}
