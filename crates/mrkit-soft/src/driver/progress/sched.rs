//! Scheduling: the run queue, who drives progress (an application polling, or the progress
//! thread), how the thread sleeps, parks and is woken, and the hand-over of held (delayed)
//! ACKs to whoever sends them.
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::clock::ns_since_epoch;
use super::registry::DataPath;
use super::thread::{APP_RECENT, APP_WINDOW};
use crate::driver::held_acks::{AckHold, HeldAcks, ACK_DELAY_MAX};
use crate::pkt::Pkt;
use crate::qp::QpObject;

/// The run queue and the state shared with the progress thread.
#[derive(Debug, Default)]
pub(crate) struct Sched {
    pub(super) runq: Mutex<VecDeque<Arc<QpObject>>>,
    /// `runq`'s length: written under its lock after every change, read without it by
    /// progress passes, so that a pass with nothing scheduled (every empty `poll_cq` of a
    /// spinning application) skips this lock. A stale zero defers a QP to the next pass.
    pub(super) runq_len: AtomicUsize,
    pub(super) cond: Condvar,
    /// Set by the progress thread while it sleeps (on `cond`, or in poll() on the UDP socket
    /// and `wake`); schedulers then notify `cond` and write `wake`.
    pub(super) sleeping: AtomicBool,
    /// eventfd that wakes the progress thread out of poll() (created with the UDP port).
    pub(super) wake: std::sync::OnceLock<rustix::fd::OwnedFd>,
    pub(super) shutdown: AtomicBool,
    /// When an application thread last polled an empty CQ (ns since [`epoch`]; 0: never or
    /// blocked since).
    pub(super) app_poll_ns: AtomicU64,
    /// Lock and condition variable of [`Sched::park`], apart from `runq`, so that the parked
    /// thread's re-checks never hold the lock the application's `post_recv` / `poll_cq` take.
    pub(super) park_lock: Mutex<()>,
    pub(super) park_cond: Condvar,
    /// Plain ACKs held back by application progress passes (delayed ACKs, `held_acks.rs`).
    pub(crate) acks: AckHold,
}

impl DataPath {
    pub(super) fn schedule_obj(&self, q: &Arc<QpObject>) {
        if q.scheduled.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut g = self.sched.runq.lock();
        g.push_back(q.clone());
        self.sched.runq_len.store(g.len(), Ordering::Release);
        if self.sched.sleeping.load(Ordering::Acquire) {
            self.sched.cond.notify_one();
            self.sched.kick();
        }
    }

    /// An application thread is polling an empty CQ (it drives progress itself).
    pub(crate) fn note_app_poll(&self, now: Instant) {
        self.sched
            .app_poll_ns
            .store(ns_since_epoch(now), Ordering::Relaxed);
    }

    /// An application thread is about to block: the progress thread must drive the device.
    pub(crate) fn app_blocks(&self) {
        if self.sched.app_poll_ns.swap(0, Ordering::AcqRel) != 0 {
            // Taking the lock orders this with a park() that has just checked app_poll_ns.
            drop(self.sched.park_lock.lock());
            self.sched.park_cond.notify_all();
            self.sched.cond.notify_all();
            self.sched.kick();
        }
    }

    /// Hold plain ACKs back (delayed ACK) produced at `now` by an application progress pass.
    /// A newer ACK of a QP replaces its held one (ACKs are cumulative).
    pub(crate) fn hold_acks(&self, mut pkts: Vec<Pkt>, now: Instant) {
        let s = &*self.sched;
        s.acks.hold(&mut pkts, ns_since_epoch(now));
        crate::pkt::recycle(pkts);
        // A progress thread sleeping (nobody was driving the device) is woken: it then
        // sleeps again with a timeout capped at the ACK's deadline. A *parked* thread is not
        // (the application is polling and sends the ACK itself once due; see
        // held_acks::ACK_DELAY_MAX for why the parked thread does not wake for it).
        if s.sleeping.load(Ordering::SeqCst) {
            s.cond.notify_all();
            s.kick();
        }
    }

    /// Whether any ACK is held back (one atomic load).
    pub(crate) fn acks_held(&self) -> bool {
        self.sched.acks.any()
    }

    /// With ACKs held: how long until the oldest is due (zero: due now).
    pub(crate) fn acks_due(&self, now: Instant) -> Option<std::time::Duration> {
        self.sched.acks.due(now)
    }

    /// Take every held ACK, holding the flush lock until the returned value is dropped: send
    /// them before dropping it.
    pub(crate) fn take_held_acks(&self) -> HeldAcks<'_> {
        self.sched.acks.take()
    }

    pub(crate) fn held_ack_count(&self) -> usize {
        self.sched.acks.count()
    }

    /// Wake the progress thread (e.g. after the UDP port was bound, so it starts polling it).
    pub(crate) fn wake_progress(&self) {
        let _ = self.sched.wake.get_or_init(|| {
            rustix::event::eventfd(
                0,
                rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
            )
            .expect("eventfd")
        });
        self.sched.cond.notify_all();
        self.sched.park_cond.notify_all();
        self.sched.kick();
    }
}

impl Sched {
    /// Write the eventfd so a poll() in the progress thread returns.
    pub(super) fn kick(&self) {
        if let Some(fd) = self.wake.get() {
            let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
        }
    }

    /// Sleep until work is scheduled, a datagram arrives on `udp`, or `timeout` passes.
    pub(super) fn sleep(&self, udp: Option<&crate::net::udp::UdpPort>, timeout: Duration) {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        let mut g = self.runq.lock();
        if !g.is_empty() {
            return;
        }
        // SeqCst: pairs with hold_acks (it stores held_at_ns, then loads `sleeping`).
        self.sleeping.store(true, Ordering::SeqCst);
        let timeout = self.cap_to_held_ack(Instant::now(), timeout);
        match (udp, self.wake.get()) {
            (Some(port), Some(wake)) => {
                drop(g);
                let mut fds = [
                    PollFd::new(port.rx_socket(), PollFlags::IN),
                    PollFd::new(wake, PollFlags::IN),
                ];
                let ts = Timespec {
                    tv_sec: timeout.as_secs() as i64,
                    tv_nsec: i64::from(timeout.subsec_nanos()),
                };
                if self.runq.lock().is_empty() {
                    let _ = poll(&mut fds, Some(&ts));
                }
                let mut buf = [0u8; 8];
                let _ = rustix::io::read(wake, &mut buf);
            }
            _ => {
                self.cond.wait_for(&mut g, timeout);
            }
        }
        self.sleeping.store(false, Ordering::Release);
    }

    /// The application drives progress: sleep for `timeout` on the condition variable only.
    /// Neither datagrams nor scheduled QPs wake this thread (the application's polls handle
    /// them); [`DataPath::app_blocks`], shutdown and the timeout do.
    pub(super) fn park(&self, timeout: Duration) {
        let mut g = self.park_lock.lock();
        // Checked under the lock that app_blocks takes before notifying: no lost wake-up.
        if self.app_poll_ns.load(Ordering::Acquire) == 0 || self.shutdown.load(Ordering::Acquire) {
            return;
        }
        self.park_cond.wait_for(&mut g, timeout);
    }

    /// `timeout`, shortened to the deadline of the oldest held ACK if there is one. Called
    /// after publishing that this thread sleeps (SeqCst, see `hold_acks`).
    pub(super) fn cap_to_held_ack(&self, now: Instant, timeout: Duration) -> Duration {
        let held = self.acks.held_at_ns_seqcst();
        if held == 0 {
            return timeout;
        }
        let deadline = held + ACK_DELAY_MAX.as_nanos() as u64;
        timeout.min(Duration::from_nanos(
            deadline.saturating_sub(ns_since_epoch(now)),
        ))
    }

    /// With ACKs held: how long until the oldest is due (zero: due now).
    pub(super) fn acks_due(&self, now: Instant) -> Option<Duration> {
        self.acks.due(now)
    }

    /// Whether an application thread polled within [`APP_WINDOW`] of `now`; if so, how long
    /// until that window closes.
    pub(super) fn app_driving(&self, now: Instant) -> Option<Duration> {
        let age = self.app_poll_age(now)?;
        APP_WINDOW.checked_sub(age).filter(|d| !d.is_zero())
    }

    /// Whether an application thread polled within [`APP_RECENT`] of `now`.
    pub(super) fn app_polled_recently(&self, now: Instant) -> bool {
        self.app_poll_age(now).is_some_and(|age| age < APP_RECENT)
    }

    /// How long ago an application thread last polled an empty CQ (`None`: never, or it
    /// blocked since).
    pub(super) fn app_poll_age(&self, now: Instant) -> Option<Duration> {
        let at = self.app_poll_ns.load(Ordering::Relaxed);
        (at != 0).then(|| Duration::from_nanos(ns_since_epoch(now).saturating_sub(at)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::progress::clock::epoch;
    #[test]
    fn app_window_and_park() {
        let s = Sched::default();
        let _ = epoch(); // the time origin precedes `now`
        let now = Instant::now();
        assert!(s.app_driving(now).is_none(), "nobody polled yet");
        s.app_poll_ns.store(ns_since_epoch(now), Ordering::Relaxed);
        assert!(s.app_driving(now).is_some());
        let later = now + APP_WINDOW + Duration::from_micros(1);
        assert!(s.app_driving(later).is_none(), "window closed");
        // park() returns at once when the application has blocked since (app_poll_ns 0).
        s.app_poll_ns.store(0, Ordering::Relaxed);
        let t = Instant::now();
        s.park(Duration::from_secs(5));
        assert!(t.elapsed() < Duration::from_secs(1));
    }
}
