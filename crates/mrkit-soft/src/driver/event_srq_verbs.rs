//! The device's event and SRQ verbs: the asynchronous event hook, and shared receive queues
//! (create, modify, query, destroy, post).
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::Context;
use crate::error::{err, Result};
use crate::events::{AsyncEvent, AsyncEventHook};
use crate::qp::{PostError, RecvWqe, RecvWr};
use crate::srq::*;

impl Context {
    /// Deliver asynchronous events to `hook` instead of queueing them for
    /// [`Context::get_async_event`] (`None`: back to the queue). Events already queued are
    /// handed to the new hook first. The hook must not keep a clone of this `Context` (the
    /// device would then never be dropped).
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use mrkit_soft::{Context, DeviceConfig};
    /// use mrkit_soft::events::AsyncEventHook;
    ///
    /// let ctx = Context::open(DeviceConfig::rxe());
    /// let seen = Arc::new(Mutex::new(Vec::new()));
    /// let sink = seen.clone();
    /// let hook: AsyncEventHook = Arc::new(move |e| sink.lock().unwrap().push(e));
    /// ctx.set_async_event_hook(Some(hook));
    /// // ... QP/CQ/SRQ events (QP_FATAL, CQ_ERR, SRQ_LIMIT_REACHED, ...) now arrive in `seen`.
    /// assert!(seen.lock().unwrap().is_empty());
    /// ctx.set_async_event_hook(None); // back to Context::get_async_event
    /// ```
    pub fn set_async_event_hook(&self, hook: Option<AsyncEventHook>) {
        *self.dev.event_hook.0.write() = hook.clone();
        if let Some(h) = hook {
            while let Some(e) = self.get_async_event(Duration::ZERO) {
                h(e);
            }
        }
    }

    /// Raise `e`: to the hook if one is installed, else onto the device's queue.
    pub(crate) fn raise_async_event(&self, e: AsyncEvent) {
        let hook = self.dev.event_hook.0.read().clone();
        match hook {
            Some(h) => h(e),
            None => self.dev.dp.raise(e),
        }
    }
}

impl Context {
    pub(crate) fn srq(&self, srqn: u32) -> Result<Arc<SrqObject>> {
        self.dev
            .srqs
            .map
            .read()
            .get(&srqn)
            .cloned()
            .ok_or_else(|| err!(EINVAL, "SRQ {srqn} does not exist"))
    }

    /// `ibv_create_srq`: EINVAL when `max_wr` > max_srq_wr or `max_sge` > max_srq_sge or the
    /// PD is unknown; ENOMEM when max_srq SRQs exist. `srq_limit` is ignored at creation (arm
    /// it with [`Context::modify_srq`]). Returns the SRQ number and the actual attributes.
    pub fn create_srq(&self, pd: u32, attr: SrqAttr) -> Result<(u32, SrqAttr)> {
        let a = self.dev.core.config.attr();
        if attr.max_wr > a.max_srq_wr {
            return Err(err!(
                EINVAL,
                "SRQ max_wr {} exceeds max_srq_wr {}",
                attr.max_wr,
                a.max_srq_wr
            ));
        }
        if attr.max_sge > a.max_srq_sge {
            return Err(err!(
                EINVAL,
                "SRQ max_sge {} exceeds max_srq_sge {}",
                attr.max_sge,
                a.max_srq_sge
            ));
        }
        let pd = self.dev.core.pd(pd)?;
        let t = &self.dev.srqs;
        if t.map.read().len() as u32 >= a.max_srq {
            return Err(err!(ENOMEM, "max_srq ({}) SRQs exist", a.max_srq));
        }
        let srqn = t.next.fetch_add(1, Ordering::Relaxed) + 1;
        let attr = SrqAttr {
            max_wr: attr.max_wr.max(1),
            max_sge: attr.max_sge.max(1),
            srq_limit: 0,
        };
        pd.get();
        t.map.write().insert(
            srqn,
            Arc::new(SrqObject {
                srqn,
                pd,
                users: AtomicU32::new(0),
                inner: Mutex::new(SrqInner {
                    q: VecDeque::new(),
                    attr,
                }),
            }),
        );
        Ok((srqn, attr))
    }

    /// `ibv_modify_srq`. [`srq_attr_mask::MAX_WR`]: resize (EINVAL for 0, above max_srq_wr,
    /// below the queued WQEs or below the armed limit). [`srq_attr_mask::LIMIT`]: arm the limit
    /// event (EINVAL when the limit exceeds `max_wr`; 0 disarms).
    pub fn modify_srq(&self, srqn: u32, attr: SrqAttr, mask: u32) -> Result<()> {
        use srq_attr_mask as m;
        if mask & !(m::MAX_WR | m::LIMIT) != 0 {
            return Err(err!(EINVAL, "unknown SRQ attribute mask bits {mask:#x}"));
        }
        let s = self.srq(srqn)?;
        let mut g = s.inner.lock();
        let mut new = g.attr;
        if mask & m::MAX_WR != 0 {
            let max = self.dev.core.config.attr().max_srq_wr;
            if attr.max_wr == 0 || attr.max_wr > max {
                return Err(err!(
                    EINVAL,
                    "SRQ max_wr {} must be in 1..={max}",
                    attr.max_wr
                ));
            }
            if (attr.max_wr as usize) < g.q.len() {
                return Err(err!(
                    EINVAL,
                    "SRQ holds {} WQEs; cannot shrink to {}",
                    g.q.len(),
                    attr.max_wr
                ));
            }
            new.max_wr = attr.max_wr;
        }
        if mask & m::LIMIT != 0 {
            new.srq_limit = attr.srq_limit;
        }
        if new.srq_limit > new.max_wr {
            return Err(err!(
                EINVAL,
                "srq_limit {} exceeds max_wr {}",
                new.srq_limit,
                new.max_wr
            ));
        }
        g.attr = new;
        Ok(())
    }

    /// `ibv_query_srq`: current attributes (`srq_limit` 0 once the limit event fired).
    pub fn query_srq(&self, srqn: u32) -> Result<SrqAttr> {
        Ok(self.srq(srqn)?.inner.lock().attr)
    }

    /// WQEs queued on the SRQ.
    pub fn srq_len(&self, srqn: u32) -> Result<usize> {
        Ok(self.srq(srqn)?.inner.lock().q.len())
    }

    /// `ibv_destroy_srq`: EBUSY while a QP uses it; queued WQEs are discarded.
    pub fn destroy_srq(&self, srqn: u32) -> Result<()> {
        let mut m = self.dev.srqs.map.write();
        let s = m
            .get(&srqn)
            .ok_or_else(|| err!(EINVAL, "SRQ {srqn} does not exist"))?;
        let users = s.users.load(Ordering::Acquire);
        if users > 0 {
            return Err(err!(
                EBUSY,
                "SRQ {srqn} is used by {users} QP(s); destroy them first"
            ));
        }
        let s = m.remove(&srqn).expect("present");
        s.pd.put();
        Ok(())
    }

    /// `ibv_post_srq_recv`: too many SGEs → EINVAL, SRQ full → ENOMEM. WRs before `bad_wr`
    /// are posted.
    pub fn post_srq_recv(&self, srqn: u32, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        let s = self
            .srq(srqn)
            .map_err(|error| PostError { bad_wr: 0, error })?;
        let mut g = s.inner.lock();
        for (i, wr) in wrs.iter().enumerate() {
            let fail = |error| PostError { bad_wr: i, error };
            if wr.sg_list.len() as u32 > g.attr.max_sge {
                return Err(fail(err!(
                    EINVAL,
                    "{} SGEs > SRQ max_sge {}",
                    wr.sg_list.len(),
                    g.attr.max_sge
                )));
            }
            if g.q.len() as u32 >= g.attr.max_wr {
                return Err(fail(err!(
                    ENOMEM,
                    "SRQ full ({} WRs); raise max_wr or wait for messages",
                    g.attr.max_wr
                )));
            }
            g.q.push_back(RecvWqe {
                wr_id: wr.wr_id,
                sges: wr.sg_list.clone(),
            });
        }
        Ok(())
    }
}
