//! The device's data-path tables: QPs, CQs and completion channels by number, QP number
//! allocation, scheduling a QP by number, and the asynchronous event queue.
#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};

use super::sched::Sched;
use super::timers::Timers;
use super::AsyncEvent;
use crate::cq::{CompChannel, CqObject};
use crate::driver::{loopback, Context};
use crate::pkt::Pkt;
use crate::qp::QpObject;

/// Hasher for the QP and CQ tables: their keys are small numbers chosen by the device (not
/// by a peer), so FxHash is enough and much cheaper than SipHash on the per-packet and
/// per-poll lookups.
pub(super) type NumHash = rustc_hash::FxBuildHasher;

/// Data-path state of one device instance.
#[derive(Debug)]
pub(crate) struct DataPath {
    pub node_id: u64,
    pub qps: RwLock<HashMap<u32, Arc<QpObject>, NumHash>>,
    pub(super) next_qpn: AtomicU32,
    pub cqs: RwLock<HashMap<u32, Arc<CqObject>, NumHash>>,
    pub(crate) next_cqn: AtomicU32,
    pub(crate) channels: RwLock<HashMap<u32, Arc<CompChannel>>>,
    pub(crate) next_ch: AtomicU32,
    pub(super) sched: Arc<Sched>,
    pub(super) events: Mutex<VecDeque<AsyncEvent>>,
    pub(super) ev_cond: Condvar,
    pub(super) manual: AtomicBool,
    pub(super) started: AtomicBool,
    pub(super) timers: Mutex<Timers>,
    /// When the earliest timer is due (`ns_since_epoch`; `u64::MAX`: none), written under the
    /// `timers` lock: lets a pass skip that lock until then (the common case of a spinning
    /// poll). Read without the lock: a stale value only moves a timer to the next pass, or
    /// costs one look at the heap.
    pub(super) timer_due_ns: AtomicU64,
    /// When a pass last looked at the timers (`ns_since_epoch`); a hint for `TIMER_STARVE`.
    pub(super) timers_ran_ns: AtomicU64,
    /// Delayed ACKs allowed (`held_acks::ACK_DELAY_MAX`; `DeviceConfig::delayed_acks`, on by
    /// default).
    pub delayed_acks: bool,
    /// An application posted a send since the UDP receiver last found data: the traffic is
    /// request/response, not a burst (`net::udp::RecvBufs::single`). A hint only: set by
    /// `post_send`, taken by the receiver; no other data is ordered by it.
    pub answered: AtomicBool,
}

impl DataPath {
    pub(crate) fn new(delayed_acks: bool) -> DataPath {
        DataPath {
            node_id: loopback::new_node_id(),
            qps: RwLock::new(HashMap::default()),
            next_qpn: AtomicU32::new(16),
            cqs: RwLock::new(HashMap::default()),
            next_cqn: AtomicU32::new(1),
            channels: RwLock::new(HashMap::new()),
            next_ch: AtomicU32::new(1),
            sched: Arc::default(),
            events: Mutex::new(VecDeque::new()),
            ev_cond: Condvar::new(),
            manual: AtomicBool::new(false),
            started: AtomicBool::new(false),
            timers: Mutex::new(Timers::default()),
            timer_due_ns: AtomicU64::new(u64::MAX),
            timers_ran_ns: AtomicU64::new(0),
            delayed_acks,
            answered: AtomicBool::new(false),
        }
    }

    pub(crate) fn alloc_qpn(&self) -> u32 {
        loop {
            let n = self.next_qpn.fetch_add(1, Ordering::Relaxed) & crate::wire::QPN_MASK;
            if n >= 16 && n != crate::wire::QPN_MASK && !self.qps.read().contains_key(&n) {
                return n;
            }
        }
    }

    pub(crate) fn raise(&self, e: AsyncEvent) {
        self.events.lock().push_back(e);
        self.ev_cond.notify_all();
    }

    /// Whether the application drives progress itself ([`Context::set_manual_progress`]).
    pub(crate) fn manual(&self) -> bool {
        self.manual.load(Ordering::Acquire)
    }

    pub(crate) fn schedule(&self, qpn: u32) {
        let q = self.qps.read().get(&qpn).cloned();
        if let Some(q) = q {
            self.schedule_obj(&q);
        }
    }

    /// The QP object with number `qpn`, if it exists.
    pub(crate) fn qp_object(&self, qpn: u32) -> Option<Arc<QpObject>> {
        self.qps.read().get(&qpn).cloned()
    }

    /// Give QP `qpn` a notice about one of its own packets for its next run (and schedule it).
    pub(crate) fn notify(&self, qpn: u32, n: crate::qp::Notice) {
        if let Some(q) = self.qp_object(qpn) {
            q.inbox.notify(n);
            self.schedule_obj(&q);
        }
    }

    pub(crate) fn enqueue_packet(&self, p: Pkt) {
        let q = self.qps.read().get(&p.bth.dest_qpn).cloned();
        if let Some(q) = q {
            q.inbox.push(p);
            self.schedule_obj(&q);
        }
    }
}

impl Drop for DataPath {
    fn drop(&mut self) {
        self.sched.shutdown.store(true, Ordering::Release);
        self.sched.cond.notify_all();
        self.sched.park_cond.notify_all();
        self.sched.kick();
        loopback::detach(self.node_id);
    }
}

impl Context {
    /// Next asynchronous event, waiting up to `timeout`.
    pub fn get_async_event(&self, timeout: Duration) -> Option<AsyncEvent> {
        let dp = &self.dev.dp;
        let deadline = Instant::now() + timeout;
        let mut g = dp.events.lock();
        loop {
            if let Some(e) = g.pop_front() {
                return Some(e);
            }
            if dp.ev_cond.wait_until(&mut g, deadline).timed_out() {
                return g.pop_front();
            }
        }
    }
}
