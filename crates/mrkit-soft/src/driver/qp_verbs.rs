//! The QP verbs of the device: create, destroy, query and modify (the state machine with its
//! attribute masks), post send and receive; and the device's side of a QP run
//! ([`RunHost`]: timers, scheduling, events, notices) and of connecting ([`ConnectVerbs`]).
#![forbid(unsafe_code)]

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{loopback, progress, Context};
use crate::error::{err, Result};
use crate::events::AsyncEvent;
use crate::memcore::MemCore;
use crate::qp::connect::ConnectVerbs;
use crate::qp::{
    idle_for_inline, Notice, PostError, QpAttr, QpCap, QpInitAttr, QpObject, QpState, RecvWr,
    RunHost, SendWr, LAST_QP,
};
use crate::stats::RxDrop;

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
        let obj = Arc::new(QpObject::new(
            qpn,
            pd,
            send_cq,
            recv_cq,
            init.sq_sig_all,
            srq,
            attr,
        ));
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
        // Held (delayed) ACKs leave before the QP changes state (held_acks::ACK_DELAY_MAX).
        self.flush_acks(None);
        let q = self.qp(qpn)?;
        q.modify(self.dev.core.config.attr(), attr, mask, Instant::now())?;
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
        let res = crate::qp::post::push_sends(&mut g, wrs);
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
        let (res, flushed) = crate::qp::post::push_recvs(q, &mut g, wrs);
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
