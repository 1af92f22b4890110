//! The device's data-path state and its progress engine.
//!
//! Every QP with work (posted WRs, packets in its inbox, timers) is put on the device's run
//! queue. A progress thread (started with the first QP, unless
//! [`Context::set_manual_progress`] was called) runs the QPs, so one-sided WRITE/READ/atomics
//! complete without the target calling any verb.
//!
//! # Who drives progress: one mechanism, chosen per workload
//!
//! On a 2-vCPU machine a blocking cross-CPU wake-up costs ~45 µs (docs/floors.md §0), so a
//! latency path must *poll*; but every spinning thread beyond the core count steals a CPU from
//! someone. Exactly one party should poll the device at a time, and which one depends on the
//! workload. The progress thread decides at every idle moment (`progress_thread`):
//!
//! * **The application drives** (it called `poll_cq` on an empty CQ within [`APP_WINDOW`];
//!   such a poll runs progress inline, `driver/caller_thread.rs`): the thread **parks** on a condition
//!   variable, *not* on the UDP socket, so datagrams the application is about to pick up do
//!   not wake it (each such wake-up is an IPI that preempts a spinning thread on the other
//!   vCPU). It re-checks when the window closes; while the application keeps polling, the
//!   re-check period backs off from [`APP_WINDOW`] to [`PARK_MAX`]. A blocking
//!   `wait_cq`/`get_cq_event` (and shutdown) unparks it at once.
//! * **Nobody polls** (the target of one-sided operations, an application that blocks, or
//!   perftest's `ib_write_lat` spinning on memory): the thread makes progress itself. What it
//!   does while idle is the device's [`ProgressPolicy`] (`MRKIT_PROGRESS`,
//!   [`DeviceConfig::progress`](crate::device::DeviceConfig::progress)):
//!   * [`ProgressPolicy::Auto`] (default): **spin adaptively**, yielding the CPU every
//!     iteration once idle for [`SPIN_NO_YIELD`]. The budget doubles (up to [`SPIN_MAX`]) when work arrived during the spin
//!     and halves (down to [`SPIN_MIN`]) when it ran out idle. A yield that took longer than
//!     [`PREEMPTED`] means another runnable thread wanted this CPU; two such yields within
//!     [`CONTENTION_CONFIRM`] mean contention (e.g. an application spinning on memory):
//!     spinning would only steal the CPU, so the thread blocks straight away for
//!     [`CONTENDED_FOR`] and lets datagrams wake it. (One preemption alone is often a daemon
//!     or a timer; reacting to it cost latency runs a blocking wake-up per packet.)
//!   * [`ProgressPolicy::Spin`]: a core is dedicated to the device: spin (yielding) for up to
//!     [`SPIN_DEDICATED`] of idleness before blocking, ignoring preemption.
//!   * [`ProgressPolicy::Block`]: an oversubscribed machine: never spin; block at once.
//! * **Blocking** is poll() on the UDP socket and the eventfd (1 ms timeout for timers), or a
//!   condvar without a UDP port.
//!
//! [`Context::progress_once`] is the synchronous entry for deterministic tests.
#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};

use super::held_acks::{AckHold, HeldAcks, ACK_DELAY_MAX};
use super::loopback;
use crate::cq::{CompChannel, CqObject};
pub use crate::device::ProgressPolicy;
use crate::driver::{Context, DeviceInner};

pub use crate::events::AsyncEvent;
use crate::pkt::Pkt;
use crate::qp::QpObject;

#[derive(Debug, Default)]
struct Sched {
    runq: Mutex<VecDeque<Arc<QpObject>>>,
    /// `runq`'s length: written under its lock after every change, read without it by
    /// progress passes, so that a pass with nothing scheduled (every empty `poll_cq` of a
    /// spinning application) skips this lock. A stale zero defers a QP to the next pass.
    runq_len: AtomicUsize,
    cond: Condvar,
    /// Set by the progress thread while it sleeps (on `cond`, or in poll() on the UDP socket
    /// and `wake`); schedulers then notify `cond` and write `wake`.
    sleeping: AtomicBool,
    /// eventfd that wakes the progress thread out of poll() (created with the UDP port).
    wake: std::sync::OnceLock<rustix::fd::OwnedFd>,
    shutdown: AtomicBool,
    /// When an application thread last polled an empty CQ (ns since [`epoch`]; 0: never or
    /// blocked since).
    app_poll_ns: AtomicU64,
    /// Lock and condition variable of [`Sched::park`], apart from `runq`, so that the parked
    /// thread's re-checks never hold the lock the application's `post_recv` / `poll_cq` take.
    park_lock: Mutex<()>,
    park_cond: Condvar,
    /// Plain ACKs held back by application progress passes (delayed ACKs, `held_acks.rs`).
    pub(crate) acks: AckHold,
}

/// Process-wide time origin for the atomics holding timestamps.
fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

pub(crate) fn ns_since_epoch(t: Instant) -> u64 {
    (t.saturating_duration_since(epoch()).as_nanos() as u64).max(1)
}

/// Hasher for the QP and CQ tables: their keys are small numbers chosen by the device (not
/// by a peer), so FxHash is enough and much cheaper than SipHash on the per-packet and
/// per-poll lookups.
type NumHash = rustc_hash::FxBuildHasher;

/// A QP whose send queue holds WQEs not sent yet but no timer (a flow limit, which a
/// response normally lifts) is run again after this long anyway.
pub(crate) const TICK_EVERY: Duration = Duration::from_millis(1);

/// Longest a receive backlog defers the QP timers (see `progress_pass`).
const TIMER_STARVE: Duration = Duration::from_millis(5);

/// Most QP timers a progress pass runs (the others stay due for the next passes).
const TIMERS_PER_PASS: usize = 64;

/// Most QP timers run per millisecond: paces retransmissions when many QPs time out at once
/// (thousands of QPs whose first packets a full receive buffer dropped together would
/// otherwise retransmit in the same instant, overflow it again, and use up their retries).
pub const TIMERS_PER_MS: u32 = 64;

/// The QPs' timers (retransmission, RNR wait): a heap of (due, QP number), due in
/// `ns_since_epoch`. A QP keeps at most a few entries (`QpInner::timer_at` is the earliest it
/// registered; an entry that does not match it when popped is stale and skipped), so a tick
/// touches only the QPs that are due, not every QP with work in flight.
#[derive(Debug, Default)]
struct Timers {
    heap: std::collections::BinaryHeap<std::cmp::Reverse<(u64, u32)>>,
    /// Start of the current pacing window and timers run in it (`TIMERS_PER_MS`). 0: no
    /// window yet (`ns_since_epoch` is at least 1), so the first window starts at the first
    /// take, also in a process whose clock origin is less than a millisecond old.
    window_ns: u64,
    in_window: u32,
}

/// Data-path state of one device instance.
#[derive(Debug)]
pub(crate) struct DataPath {
    pub node_id: u64,
    pub qps: RwLock<HashMap<u32, Arc<QpObject>, NumHash>>,
    next_qpn: AtomicU32,
    pub cqs: RwLock<HashMap<u32, Arc<CqObject>, NumHash>>,
    pub(crate) next_cqn: AtomicU32,
    pub(crate) channels: RwLock<HashMap<u32, Arc<CompChannel>>>,
    pub(crate) next_ch: AtomicU32,
    sched: Arc<Sched>,
    events: Mutex<VecDeque<AsyncEvent>>,
    ev_cond: Condvar,
    manual: AtomicBool,
    started: AtomicBool,
    timers: Mutex<Timers>,
    /// When the earliest timer is due (`ns_since_epoch`; `u64::MAX`: none), written under the
    /// `timers` lock: lets a pass skip that lock until then (the common case of a spinning
    /// poll). Read without the lock: a stale value only moves a timer to the next pass, or
    /// costs one look at the heap.
    timer_due_ns: AtomicU64,
    /// When a pass last looked at the timers (`ns_since_epoch`); a hint for `TIMER_STARVE`.
    timers_ran_ns: AtomicU64,
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

    fn schedule_obj(&self, q: &Arc<QpObject>) {
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

    /// Register a timer of QP `qpn` due at `due_ns` (`ns_since_epoch`).
    pub(crate) fn arm_timer(&self, qpn: u32, due_ns: u64) {
        let mut t = self.timers.lock();
        t.heap.push(std::cmp::Reverse((due_ns, qpn)));
        if due_ns < self.timer_due_ns.load(Ordering::Relaxed) {
            self.timer_due_ns.store(due_ns, Ordering::Relaxed);
        }
    }

    /// The timers due at `now_ns`, at most `TIMERS_PER_PASS` and within the
    /// `TIMERS_PER_MS` pacing.
    fn take_due_timers(&self, now_ns: u64) -> Vec<(u64, u32)> {
        if now_ns < self.timer_due_ns.load(Ordering::Relaxed) {
            return Vec::new();
        }
        let mut t = self.timers.lock();
        if t.window_ns == 0 || now_ns.saturating_sub(t.window_ns) >= 1_000_000 {
            t.window_ns = now_ns;
            t.in_window = 0;
        }
        let allowed = (TIMERS_PER_MS - t.in_window).min(TIMERS_PER_PASS as u32) as usize;
        let mut due = Vec::new();
        while due.len() < allowed {
            match t.heap.peek() {
                Some(std::cmp::Reverse((at, _))) if *at <= now_ns => {
                    let std::cmp::Reverse(e) = t.heap.pop().expect("peeked");
                    due.push(e);
                }
                _ => break,
            }
        }
        t.in_window += due.len() as u32;
        let next = t.heap.peek().map_or(u64::MAX, |r| r.0 .0);
        // Out of budget with timers still due: look again when the window ends.
        let next = if t.in_window >= TIMERS_PER_MS && next <= now_ns {
            t.window_ns + 1_000_000
        } else {
            next
        };
        self.timer_due_ns.store(next, Ordering::Relaxed);
        due
    }

    /// Timer entries registered (tests).
    #[cfg(test)]
    pub(crate) fn timer_entries(&self) -> usize {
        self.timers.lock().heap.len()
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

    pub(crate) fn ensure_thread(&self, dev: &Arc<DeviceInner>) {
        if self.manual.load(Ordering::Acquire) || self.started.swap(true, Ordering::AcqRel) {
            return;
        }
        let weak: Weak<DeviceInner> = Arc::downgrade(dev);
        let sched = self.sched.clone();
        let _ = std::thread::Builder::new()
            .name(format!("mrkit0-progress-{}", self.node_id))
            .spawn(move || progress_thread(weak, sched));
    }
}

impl Sched {
    /// Write the eventfd so a poll() in the progress thread returns.
    fn kick(&self) {
        if let Some(fd) = self.wake.get() {
            let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
        }
    }

    /// Sleep until work is scheduled, a datagram arrives on `udp`, or `timeout` passes.
    fn sleep(&self, udp: Option<&crate::net::udp::UdpPort>, timeout: Duration) {
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
    fn park(&self, timeout: Duration) {
        let mut g = self.park_lock.lock();
        // Checked under the lock that app_blocks takes before notifying: no lost wake-up.
        if self.app_poll_ns.load(Ordering::Acquire) == 0 || self.shutdown.load(Ordering::Acquire) {
            return;
        }
        self.park_cond.wait_for(&mut g, timeout);
    }

    /// `timeout`, shortened to the deadline of the oldest held ACK if there is one. Called
    /// after publishing that this thread sleeps (SeqCst, see `hold_acks`).
    fn cap_to_held_ack(&self, now: Instant, timeout: Duration) -> Duration {
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
    fn acks_due(&self, now: Instant) -> Option<Duration> {
        self.acks.due(now)
    }
}

impl Sched {
    /// Whether an application thread polled within [`APP_WINDOW`] of `now`; if so, how long
    /// until that window closes.
    fn app_driving(&self, now: Instant) -> Option<Duration> {
        let age = self.app_poll_age(now)?;
        APP_WINDOW.checked_sub(age).filter(|d| !d.is_zero())
    }

    /// Whether an application thread polled within [`APP_RECENT`] of `now`.
    fn app_polled_recently(&self, now: Instant) -> bool {
        self.app_poll_age(now).is_some_and(|age| age < APP_RECENT)
    }

    /// How long ago an application thread last polled an empty CQ (`None`: never, or it
    /// blocked since).
    fn app_poll_age(&self, now: Instant) -> Option<Duration> {
        let at = self.app_poll_ns.load(Ordering::Relaxed);
        (at != 0).then(|| Duration::from_nanos(ns_since_epoch(now).saturating_sub(at)))
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

/// Whether a pass's table of QPs already holds `q`.
fn holds(batch: &[Option<Arc<QpObject>>], q: &Arc<QpObject>) -> bool {
    batch.iter().flatten().any(|b| Arc::ptr_eq(b, q))
}

/// Most QPs one progress pass runs (the others wait for the next pass).
const PASS_QPS: usize = 16;

/// An application that polled an empty CQ this recently is driving progress itself.
pub const APP_WINDOW: Duration = Duration::from_micros(50);
/// An application that polled this recently polls between other work (perftest's
/// `ib_write_lat` polls for its send completion, then spins on memory): the progress thread,
/// which then runs only in the gaps and may park after any pass, takes full receive batches.
pub const APP_RECENT: Duration = Duration::from_millis(10);
/// Longest park while the application keeps polling (the re-check period backs off to it).
pub const PARK_MAX: Duration = Duration::from_millis(2);
/// Adaptive spin budget bounds (and the initial budget).
pub const SPIN_MIN: Duration = Duration::from_micros(10);
/// Largest spin budget.
pub const SPIN_MAX: Duration = Duration::from_micros(200);
const SPIN_INIT: Duration = Duration::from_micros(50);
/// A spin polls without yielding for this long before it starts yielding every iteration.
pub const SPIN_NO_YIELD: Duration = Duration::from_micros(20);
/// Idle spin of [`ProgressPolicy::Spin`] before blocking.
pub const SPIN_DEDICATED: Duration = Duration::from_millis(10);
/// A yield that took this long means another thread holds the CPU.
pub const PREEMPTED: Duration = Duration::from_micros(100);
/// Two preemptions within this interval mean the CPU is contended.
pub const CONTENTION_CONFIRM: Duration = Duration::from_millis(10);
/// How long to block instead of spinning once the CPU is found contended.
pub const CONTENDED_FOR: Duration = Duration::from_millis(20);

fn progress_thread(weak: Weak<DeviceInner>, sched: Arc<Sched>) {
    let policy = match weak.upgrade() {
        Some(d) => d.core.config.progress_policy(),
        None => return,
    };
    let mut idle_since: Option<Instant> = None;
    let mut budget = SPIN_INIT;
    let mut contended_until: Option<Instant> = None;
    let mut preempted_at: Option<Instant> = None;
    let mut park_for = APP_WINDOW;
    loop {
        if sched.shutdown.load(Ordering::Acquire) {
            return;
        }
        // One clock read per idle iteration (they are not cheap in a VM); the pass and the
        // idle bookkeeping below share it.
        let now = Instant::now();
        if let Some(left) = sched.app_driving(now) {
            // The application polls and runs progress inline: stay out of its way (do not
            // even run a pass: that would take packets from under it) until it stops;
            // checked again when its window closes, less often the longer it drives.
            idle_since = None;
            // Delayed ACKs (held_acks::ACK_DELAY_MAX): the application's held ACKs that are due
            // leave at this re-check. The park is *not* shortened for them: re-checking every
            // few tens of microseconds cost the SEND echo p99 tails of 2-4.5 ms on 2 vCPUs.
            if sched.acks_due(now).is_some_and(|d| d.is_zero()) {
                if let Some(dev) = weak.upgrade() {
                    Context { dev }.flush_acks(Some(now));
                }
            }
            sched.park(left.max(park_for) + Duration::from_micros(5));
            park_for = (park_for * 2).min(PARK_MAX);
            continue;
        }
        park_for = APP_WINDOW;
        let Some(dev) = weak.upgrade() else { return };
        let ctx = Context { dev };
        let n = ctx.progress_once(now);
        drop(ctx);
        if n > 0 {
            if idle_since.take().is_some() {
                // Work arrived while spinning: spinning pays, spin longer next time.
                budget = (budget * 2).min(SPIN_MAX);
            }
            continue;
        }
        let contended = contended_until.is_some_and(|t| now < t);
        let since = *idle_since.get_or_insert(now);
        let spin_for = match policy {
            ProgressPolicy::Auto if !contended => budget,
            ProgressPolicy::Spin => SPIN_DEDICATED,
            _ => Duration::ZERO,
        };
        let idle = now.duration_since(since);
        if idle < spin_for {
            std::hint::spin_loop();
            // The first microseconds of a spin poll without yielding (a reply is usually
            // that close); after that every iteration yields, so a runnable thread that
            // wants this CPU gets it and the preemption check below can see it.
            if idle >= SPIN_NO_YIELD && sched.runq.lock().is_empty() {
                std::thread::yield_now();
                if policy == ProgressPolicy::Auto && now.elapsed() >= PREEMPTED {
                    // Someone else wants this CPU (e.g. an application spinning on memory):
                    // block and let a packet wake us instead. Once is chance (a daemon, a
                    // timer): only a second preemption soon after makes it contention.
                    let t = Instant::now();
                    if preempted_at.is_some_and(|p| t.duration_since(p) < CONTENTION_CONFIRM) {
                        contended_until = Some(t + CONTENDED_FOR);
                        preempted_at = None;
                    } else {
                        preempted_at = Some(t);
                    }
                }
            }
            continue;
        }
        if idle_since.take().is_some() && policy == ProgressPolicy::Auto && !contended {
            budget = (budget / 2).max(SPIN_MIN);
        }
        let udp = weak.upgrade().and_then(|d| d.udp.get().cloned());
        sched.sleep(udp.as_deref(), Duration::from_millis(1));
    }
}

impl Context {
    /// Do not start a progress thread: the application drives the device with
    /// [`Context::progress_once`] (or [`loopback::drive_until_idle`]). Call before creating
    /// the first QP.
    pub fn set_manual_progress(&self) {
        self.dev.dp.manual.store(true, Ordering::Release);
    }

    /// Run every QP that has work once (and the QPs whose timers are due, `TIMERS_PER_MS`). Returns the number of QP runs that did something. Sends every ACK an
    /// application pass held back (`held_acks::ACK_DELAY_MAX`).
    pub fn progress_once(&self, now: Instant) -> usize {
        self.progress_pass(now, false)
    }

    /// One pass; `app`: run by an application thread (progress on poll), which may hold
    /// plain ACKs back and sends them once due.
    pub(crate) fn progress_pass(&self, now: Instant, app: bool) -> usize {
        let dp = &self.dev.dp;
        let _running = crate::driver::caller_thread::Running::enter(self);
        let hold = (app && dp.delayed_acks).then_some(now);
        if !app {
            self.flush_acks(None);
        }
        // The QPs this pass runs: first those that just received packets (handed over here
        // rather than through the run queue: no scheduling flag, no run-queue lock twice),
        // then up to PASS_QPS in all from the run queue.
        let mut batch: [Option<Arc<QpObject>>; PASS_QPS] = Default::default();
        let mut received = 0;
        let mut rx_datagrams = 0;
        if let Some(port) = self.dev.udp.get() {
            // One receiver at a time keeps the socket's order (see DeviceInner::rx). A progress
            // thread that finds it taken still runs the run queue (a stream's sends go out
            // from the other CPU while the application receives: ib_send_bw lost ~25 % when
            // the whole pass was one lock).
            if let Some(mut bufs) = self.dev.rx.try_lock() {
                // One datagram at a time suits request/response traffic that someone polls for
                // continuously: an application's own pass, or the progress thread when no
                // application polls (a passive WRITE target). A progress thread running in the
                // gaps of an application's polls may park after its pass, and a datagram left
                // queued (the peer's WRITE behind its ACK) then waits for the next poll or
                // re-check: perftest's ib_write_lat went from ~5 µs to 70-170 µs typical that
                // way. That thread takes full batches. (Always full batches for the progress
                // thread cost a passive WRITE target ~0.4 µs per round trip.)
                let one_ok = app || !dp.sched.app_polled_recently(now);
                // Demultiplexing: each run of packets for one QP goes to its inbox, and the QP
                // into this pass's table (or, when the table is full, onto the run queue).
                rx_datagrams = crate::net::udp::poll_rx(
                    port,
                    &mut bufs,
                    one_ok,
                    dp.node_id,
                    self.dev.core.config.icrc_ipv4(),
                    &self.dev.net_stats,
                    &dp.answered,
                    |qpn| self.qp_cached(qpn),
                    |q, pkts| {
                        q.inbox.append(pkts);
                        if holds(&batch[..received], &q) {
                            return;
                        }
                        if received < PASS_QPS {
                            batch[received] = Some(q);
                            received += 1;
                        } else {
                            dp.schedule_obj(&q);
                        }
                    },
                );
            }
            let _ = port.tick(now);
        }
        // Scheduled QPs, moved out under one lock into the local table (taking the whole
        // queue would hand its buffer away and make the next scheduling allocate a new one);
        // the rest run in the next pass.
        let mut work = received;
        if work < PASS_QPS && dp.sched.runq_len.load(Ordering::Acquire) > 0 {
            let mut g = dp.sched.runq.lock();
            while work < PASS_QPS {
                match g.pop_front() {
                    // Already running in this pass (it received packets): off the queue.
                    Some(q) if holds(&batch[..received], &q) => {
                        q.scheduled.store(false, Ordering::Release);
                    }
                    Some(q) => {
                        batch[work] = Some(q);
                        work += 1;
                    }
                    None => break,
                }
            }
            dp.sched.runq_len.store(g.len(), Ordering::Release);
        }
        // Timers wait while received datagrams queue up (a full batch this pass): the
        // responses a timer would give up on may be in that queue. Retransmitting instead of
        // reading them turned a backlog of 20,000 QPs' ACKs into a retransmission storm that
        // used up every retry. At most `TIMER_STARVE` without timers, so a QP whose
        // responses stopped still times out beside a stream.
        let now_ns = ns_since_epoch(now);
        let rx_backlog = rx_datagrams >= crate::net::udp::RX_SLOTS_PER_PASS
            && now_ns.saturating_sub(dp.timers_ran_ns.load(Ordering::Relaxed))
                < TIMER_STARVE.as_nanos() as u64;
        let due = if rx_backlog {
            Vec::new()
        } else {
            dp.timers_ran_ns.store(now_ns, Ordering::Relaxed);
            dp.take_due_timers(now_ns)
        };
        for (i, q) in batch.into_iter().enumerate() {
            let Some(q) = q else { break };
            if i >= received {
                q.scheduled.store(false, Ordering::Release); // taken off the run queue
            }
            let delivering = super::delivery::Delivering::start(&q);
            let pkts = q.run(self, now);
            self.deliver_pkts(pkts, hold.filter(|_| q.delay_acks.load(Ordering::Relaxed)));
            drop(delivering);
        }
        for (at, qpn) in due {
            let Some(q) = dp.qp_object(qpn) else {
                continue; // destroyed since
            };
            let delivering = super::delivery::Delivering::start(&q);
            let Some(pkts) = q.run_timer(self, at, now) else {
                continue; // a stale entry: the QP registered another since
            };
            if !pkts.is_empty() {
                work += 1;
            }
            self.deliver_pkts(pkts, hold.filter(|_| q.delay_acks.load(Ordering::Relaxed)));
            drop(delivering);
        }
        if app {
            self.flush_acks(Some(now));
        }
        work
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_response_traffic_arms_a_timer_once_per_timeout_not_per_message() {
        use crate::qp::{rc_connect, RecvWr, SendWr, WrOpcode};
        let (c, _, cq, q1) = crate::fuzz::manual_rc_host(16, false);
        let (d, _, dcq, q2) = crate::fuzz::manual_rc_host(16, false);
        rc_connect(&c, q1, &d, q2, crate::AccessFlags::LOCAL_WRITE, 3).unwrap();
        let dp = &c.dev.dp;
        let t0 = Instant::now();
        let mut out = Vec::new();
        for i in 0..5u64 {
            let now = t0 + Duration::from_micros(10 * i);
            let recv = RecvWr {
                wr_id: i,
                sg_list: vec![],
            };
            d.post_recv(q2, &[recv]).unwrap();
            c.post_send(q1, &[SendWr::new(i, WrOpcode::Send)]).unwrap();
            while c.progress_once(now) + d.progress_once(now) > 0 {}
            out.clear();
            assert_eq!(c.poll_cq(cq, &mut out, 4).unwrap(), 1, "the send completed");
            assert_eq!(
                d.poll_cq(dcq, &mut out, 4).unwrap(),
                1,
                "the receive completed"
            );
            // The first message registered the retransmission timer; later ones only move
            // the deadline later, which registers nothing.
            assert_eq!(dp.timer_entries(), 1, "message {i}");
        }
        // The entry comes due, finds the QP idle (everything acknowledged) and is gone.
        let later = t0 + Duration::from_secs(1);
        c.progress_once(later);
        assert_eq!(dp.timer_entries(), 0, "an idle QP keeps no timer");
        assert_eq!(dp.timer_due_ns.load(Ordering::Relaxed), u64::MAX);
    }

    #[test]
    fn due_timers_are_paced_per_millisecond() {
        let dp = DataPath::new(false);
        let _ = epoch();
        let now = ns_since_epoch(Instant::now());
        for q in 0..1000u32 {
            dp.arm_timer(16 + q, now - 1);
        }
        let mut taken = 0;
        loop {
            let due = dp.take_due_timers(now);
            if due.is_empty() {
                break;
            }
            assert!(due.len() <= TIMERS_PER_PASS);
            taken += due.len();
        }
        assert_eq!(taken, TIMERS_PER_MS as usize, "one millisecond's budget");
        assert_eq!(
            dp.timer_due_ns.load(Ordering::Relaxed),
            now + 1_000_000,
            "the rest waits for the next window"
        );
        let mut taken = 0;
        while !dp.take_due_timers(now + 1_000_000).is_empty() {
            taken += 1;
        }
        assert!(taken > 0, "the next window runs more");
    }

    #[test]
    fn progress_policy_parses() {
        assert_eq!(ProgressPolicy::parse("auto"), Some(ProgressPolicy::Auto));
        assert_eq!(ProgressPolicy::parse(" Spin "), Some(ProgressPolicy::Spin));
        assert_eq!(ProgressPolicy::parse("block"), Some(ProgressPolicy::Block));
        assert_eq!(ProgressPolicy::parse("fast"), None);
        assert_eq!(ProgressPolicy::default(), ProgressPolicy::Auto);
    }

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
