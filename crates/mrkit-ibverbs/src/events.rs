//! Asynchronous events: from the device to `ibv_get_async_event`, and the ack accounting that
//! makes `ibv_destroy_{qp,cq,srq}` wait (rdma-core v44 semantics).
//!
//! * Every context has an [`EventQueue`]: a queue plus an eventfd (semaphore mode, the
//!   context's `async_fd`), written once per queued event, so `poll()` sees it readable and a
//!   non-blocking fd gives EAGAIN when nothing is pending.
//! * The device instance (shared by all contexts of the process) has one [`Router`], installed
//!   as mrkit-soft's async event hook. It maps `(kind, QPN/CQN/SRQN)` to the owning context's
//!   queue and the *user-visible* `ibv_qp*` / `ibv_cq*` / `ibv_srq*`; events for objects the
//!   library does not know (destroyed meanwhile) are dropped.
//! * As in the kernel (`ib_uverbs_event_read`), an object's `reported` count goes up when
//!   `ibv_get_async_event` hands one of its events out; `ibv_ack_async_event` increments the
//!   object's `events_completed` (`async_events_completed` for a CQ) under its pthread mutex
//!   and signals its cond, exactly as libibverbs does; `ibv_destroy_*` removes the object's
//!   unread events (`ib_uverbs_release_uevent`) and then waits until completed == reported
//!   (`ibv_cmd_destroy_qp`: `while (qp->events_completed != resp.events_reported)
//!   pthread_cond_wait(...)`). CQs do the same for completion events
//!   (`comp_events_completed` vs. the events `ibv_get_cq_event` returned).
//!
//! Lock order: `Router::routes` → `EventQueue::q`. The hook holds `routes` while queueing, so
//! once `unregister` has removed a route no event for that object can be queued any more.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_int;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use mrkit_soft::progress::AsyncEvent;

use crate::abi::ibv_async_event;

/// `enum ibv_event_type` values used here.
pub(crate) mod event_type {
    pub const CQ_ERR: i32 = 0;
    pub const QP_FATAL: i32 = 1;
    pub const QP_REQ_ERR: i32 = 2;
    pub const QP_ACCESS_ERR: i32 = 3;
    pub const COMM_EST: i32 = 4;
    pub const SQ_DRAINED: i32 = 5;
    pub const PATH_MIG: i32 = 6;
    pub const PATH_MIG_ERR: i32 = 7;
    pub const SRQ_ERR: i32 = 14;
    pub const SRQ_LIMIT_REACHED: i32 = 15;
    pub const QP_LAST_WQE_REACHED: i32 = 16;
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Per QP/CQ/SRQ: how many of its async events `ibv_get_async_event` has handed out (the
/// kernel's `events_reported`).
#[derive(Debug, Default)]
pub(crate) struct ObjEvents {
    /// Events handed out. Only incremented while the owning [`EventQueue::q`] lock is held,
    /// so after `unregister` (which purges under that lock) it no longer changes; read by
    /// `ibv_destroy_*` to know how many acks to wait for.
    reported: AtomicU32,
}

impl ObjEvents {
    pub(crate) fn reported(&self) -> u32 {
        self.reported.load(Ordering::Acquire)
    }
}

struct Queued {
    ev: ibv_async_event,
    obj: Option<Arc<ObjEvents>>,
}

/// A context's pending async events and its `async_fd`.
pub(crate) struct EventQueue {
    q: Mutex<VecDeque<Queued>>,
    fd: OwnedFd,
}

impl EventQueue {
    /// A queue with a fresh eventfd (CLOEXEC, semaphore mode); None with errno set on failure.
    pub(crate) fn new() -> Option<EventQueue> {
        // SAFETY: plain eventfd creation; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_SEMAPHORE) };
        if fd < 0 {
            return None;
        }
        Some(EventQueue {
            q: Mutex::new(VecDeque::new()),
            // SAFETY: fd is a fresh descriptor we own.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    pub(crate) fn raw_fd(&self) -> c_int {
        self.fd.as_raw_fd()
    }

    fn push_locked(&self, q: &mut VecDeque<Queued>, item: Queued) -> bool {
        q.push_back(item);
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our own eventfd.
        let r = unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        r == 8
    }

    /// Queue an event that names no tracked object (port/device events, tests).
    pub(crate) fn push_untracked(&self, ev: ibv_async_event) -> bool {
        self.push_locked(&mut lock(&self.q), Queued { ev, obj: None })
    }

    /// `ibv_get_async_event`: block on the eventfd (or fail with its errno, EAGAIN when it is
    /// non-blocking and nothing is pending), then take the oldest event. A count left behind
    /// by an event purged on destroy is skipped.
    pub(crate) fn get(&self) -> Result<ibv_async_event, ()> {
        loop {
            let mut v: u64 = 0;
            // SAFETY: reads 8 bytes into a valid u64 from our eventfd (semaphore mode: one
            // event per read).
            let r = unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
            if r != 8 {
                return Err(()); // errno from read
            }
            let mut q = lock(&self.q);
            if let Some(item) = q.pop_front() {
                if let Some(o) = &item.obj {
                    o.reported.fetch_add(1, Ordering::AcqRel);
                }
                return Ok(item.ev);
            }
        }
    }
}

/// Kinds of objects events are affiliated with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    Qp,
    Cq,
    Srq,
}

struct Route {
    queue: Arc<EventQueue>,
    /// The user-visible `ibv_qp*` / `ibv_cq*` / `ibv_srq*` (as an address).
    element: usize,
    obj: Arc<ObjEvents>,
}

/// Routes device events to the owning context (one per device instance).
#[derive(Default)]
pub(crate) struct Router {
    routes: Mutex<HashMap<(Kind, u32), Route>>,
}

fn classify(e: AsyncEvent) -> (Kind, u32, i32) {
    use event_type as t;
    match e {
        AsyncEvent::CqErr { cqn } => (Kind::Cq, cqn, t::CQ_ERR),
        AsyncEvent::QpFatal { qpn } => (Kind::Qp, qpn, t::QP_FATAL),
        AsyncEvent::QpReqErr { qpn } => (Kind::Qp, qpn, t::QP_REQ_ERR),
        AsyncEvent::QpAccessErr { qpn } => (Kind::Qp, qpn, t::QP_ACCESS_ERR),
        AsyncEvent::SqDrained { qpn } => (Kind::Qp, qpn, t::SQ_DRAINED),
        AsyncEvent::QpLastWqeReached { qpn } => (Kind::Qp, qpn, t::QP_LAST_WQE_REACHED),
        AsyncEvent::SrqLimitReached { srqn } => (Kind::Srq, srqn, t::SRQ_LIMIT_REACHED),
    }
}

impl Router {
    /// The mrkit-soft hook: queue `e` on the owning context, or drop it.
    pub(crate) fn deliver(&self, e: AsyncEvent) {
        let (kind, num, event_type) = classify(e);
        let routes = lock(&self.routes);
        if let Some(r) = routes.get(&(kind, num)) {
            let item = Queued {
                ev: ibv_async_event {
                    element: r.element as u64,
                    event_type,
                },
                obj: Some(r.obj.clone()),
            };
            r.queue.push_locked(&mut lock(&r.queue.q), item);
        }
    }

    /// A new object: its events go to `queue` with `element` as the pointer.
    pub(crate) fn register(
        &self,
        kind: Kind,
        num: u32,
        queue: &Arc<EventQueue>,
        element: usize,
        obj: &Arc<ObjEvents>,
    ) {
        lock(&self.routes).insert(
            (kind, num),
            Route {
                queue: queue.clone(),
                element,
                obj: obj.clone(),
            },
        );
    }

    /// The object is being destroyed (the device object is already gone): no more events
    /// are routed to it and its unread ones are dropped. Returns how many of its events were
    /// handed out (the count to wait for).
    pub(crate) fn unregister(&self, kind: Kind, num: u32, obj: &Arc<ObjEvents>) -> u32 {
        let route = lock(&self.routes).remove(&(kind, num));
        if let Some(r) = route {
            lock(&r.queue.q).retain(|i| !i.obj.as_ref().is_some_and(|o| Arc::ptr_eq(o, obj)));
        }
        obj.reported()
    }

    /// A context closes: forget every route into its queue.
    pub(crate) fn forget_queue(&self, queue: &Arc<EventQueue>) {
        lock(&self.routes).retain(|_, r| !Arc::ptr_eq(&r.queue, queue));
    }
}

/// Add `n` to a `*_events_completed` counter under the object's pthread mutex and signal its
/// cond (libibverbs' `ibv_ack_async_event` / `ibv_ack_cq_events`).
///
/// # Safety
/// The three pointers point into one live `ibv_qp`/`ibv_cq`/`ibv_srq` whose mutex and cond
/// are initialised.
pub(crate) unsafe fn add_completed(
    mutex: *mut libc::pthread_mutex_t,
    cond: *mut libc::pthread_cond_t,
    counter: *mut u32,
    n: u32,
) {
    // SAFETY: caller contract; the counter is only accessed under the mutex.
    unsafe {
        libc::pthread_mutex_lock(mutex);
        *counter = (*counter).wrapping_add(n);
        libc::pthread_cond_signal(cond);
        libc::pthread_mutex_unlock(mutex);
    }
}

/// Wait on the object's mutex/cond until `done()` (called with the mutex held) holds, as
/// libibverbs' `ibv_cmd_destroy_*` do.
///
/// # Safety
/// `mutex` / `cond` belong to a live object and are initialised; `done` only reads fields
/// that are written under that mutex.
pub(crate) unsafe fn wait_until(
    mutex: *mut libc::pthread_mutex_t,
    cond: *mut libc::pthread_cond_t,
    mut done: impl FnMut() -> bool,
) {
    // SAFETY: caller contract.
    unsafe {
        libc::pthread_mutex_lock(mutex);
        while !done() {
            libc::pthread_cond_wait(cond, mutex);
        }
        libc::pthread_mutex_unlock(mutex);
    }
}
