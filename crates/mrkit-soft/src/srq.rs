//! Shared receive queues (`ibv_create_srq` & co.).
//!
//! * An SRQ holds receive WQEs for every RC QP created with it
//!   ([`Context::create_qp_srq`]); such a QP has no receive queue of its own
//!   (`post_recv` on it → EINVAL, as the kernel path).
//! * The responder takes a WQE from the SRQ only when a message that needs one arrives
//!   in sequence (an empty SRQ → RNR NAK, exactly like an empty RQ).
//! * **Limit event**: `modify_srq(IBV_SRQ_LIMIT)` arms the SRQ with a limit; the first time a
//!   WQE is taken and fewer than `srq_limit` WQEs remain, `IBV_EVENT_SRQ_LIMIT_REACHED` is
//!   raised once and the SRQ disarms (`query_srq` then reports limit 0), as rxe does.
//! * A QP attached to an SRQ that moves to ERR does **not** flush SRQ WQEs (only the one it was
//!   using for a message in progress completes); it raises `IBV_EVENT_QP_LAST_WQE_REACHED`.
//! * `destroy_srq` → EBUSY while QPs use it.
//!
//! Checks follow rxe (`rxe_srq_chk_init` / `rxe_srq_chk_attr`): `max_wr` > max_srq_wr or
//! `max_sge` > max_srq_sge → EINVAL; `max_wr` 0 means 1; limit above `max_wr` → EINVAL;
//! shrinking below the queued WQEs or below the armed limit → EINVAL.
#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use crate::error::{err, Result};
use crate::events::AsyncEvent;
use crate::pd::PdObject;
use crate::qp::RecvWqe;
use crate::qp::{PostError, RecvWr};
use crate::Context;

/// `enum ibv_srq_attr_mask`.
pub mod srq_attr_mask {
    /// IBV_SRQ_MAX_WR: resize.
    pub const MAX_WR: u32 = 1;
    /// IBV_SRQ_LIMIT: arm the limit event.
    pub const LIMIT: u32 = 2;
}

/// `struct ibv_srq_attr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SrqAttr {
    /// Queue depth.
    pub max_wr: u32,
    /// SGEs per WR.
    pub max_sge: u32,
    /// Armed limit (0 = not armed).
    pub srq_limit: u32,
}

#[derive(Debug)]
struct SrqInner {
    q: VecDeque<RecvWqe>,
    attr: SrqAttr,
}

/// An SRQ as the device keeps it.
#[derive(Debug)]
pub(crate) struct SrqObject {
    pub srqn: u32,
    pub pd: Arc<PdObject>,
    /// QPs attached (destroy → EBUSY while > 0).
    pub users: AtomicU32,
    inner: Mutex<SrqInner>,
}

impl SrqObject {
    /// Take one WQE for a message. Returns the WQE and whether the limit event fires.
    pub(crate) fn take(&self) -> Option<(RecvWqe, Option<AsyncEvent>)> {
        let mut g = self.inner.lock();
        let w = g.q.pop_front()?;
        let lim = g.attr.srq_limit;
        let ev = if lim != 0 && (g.q.len() as u32) < lim {
            g.attr.srq_limit = 0;
            Some(AsyncEvent::SrqLimitReached { srqn: self.srqn })
        } else {
            None
        };
        Some((w, ev))
    }

    /// Give back WQEs a QP took but never used (they go to the front, in order).
    pub(crate) fn give_back(&self, wqes: impl DoubleEndedIterator<Item = RecvWqe>) {
        let mut g = self.inner.lock();
        for w in wqes.rev() {
            g.q.push_front(w);
        }
    }
}

/// The device's SRQ table.
#[derive(Debug, Default)]
pub(crate) struct SrqTable {
    map: RwLock<HashMap<u32, Arc<SrqObject>>>,
    next: AtomicU32,
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
