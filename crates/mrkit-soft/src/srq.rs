//! Shared receive queues (`ibv_create_srq` & co.).
//!
//! * An SRQ holds receive WQEs for every RC QP created with it
//!   ([`Context::create_qp_srq`](crate::Context::create_qp_srq)); such a QP has no receive queue of its own
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
use std::sync::atomic::AtomicU32;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use crate::events::AsyncEvent;
use crate::pd::PdObject;
use crate::qp::RecvWqe;

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

/// An SRQ's queue and attributes (under `SrqObject::inner`).
#[derive(Debug)]
pub(crate) struct SrqInner {
    pub q: VecDeque<RecvWqe>,
    pub attr: SrqAttr,
}

/// An SRQ as the device keeps it.
#[derive(Debug)]
pub(crate) struct SrqObject {
    pub srqn: u32,
    pub pd: Arc<PdObject>,
    /// QPs attached (destroy → EBUSY while > 0).
    pub users: AtomicU32,
    pub inner: Mutex<SrqInner>,
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
    pub map: RwLock<HashMap<u32, Arc<SrqObject>>>,
    pub next: AtomicU32,
}
