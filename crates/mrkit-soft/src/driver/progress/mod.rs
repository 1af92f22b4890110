//! The device's data-path state and its progress engine.
//!
//! Every QP with work (posted WRs, packets in its inbox, timers) is put on the device's run
//! queue. A progress thread (started with the first QP, unless
//! [`Context::set_manual_progress`](crate::driver::Context::set_manual_progress) was called) runs the QPs, so one-sided WRITE/READ/atomics
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
//! [`Context::progress_once`](crate::driver::Context::progress_once) is the synchronous entry
//! for deterministic tests.
//!
//! One file per concern: `registry` (the device's QP, CQ and completion-channel tables and
//! its asynchronous event queue), `sched` (the run queue, who drives progress, sleeping,
//! parking and waking the thread, the held ACKs' hand-over), `timers` (the timer heap and
//! its pacing), `thread` (the progress thread and its idle policy) and `pass` (one
//! progress pass: receive, run the scheduled QPs and the due timers, deliver), over
//! `clock` (the time origin of the timestamps kept in atomics).
#![forbid(unsafe_code)]

mod clock;
mod pass;
mod registry;
mod sched;
mod thread;
mod timers;

pub use crate::device::ProgressPolicy;
pub use crate::events::AsyncEvent;
pub(crate) use clock::ns_since_epoch;
pub(crate) use registry::DataPath;
pub use thread::{
    APP_RECENT, APP_WINDOW, CONTENDED_FOR, CONTENTION_CONFIRM, PARK_MAX, PREEMPTED, SPIN_DEDICATED,
    SPIN_MAX, SPIN_MIN, SPIN_NO_YIELD,
};
pub(crate) use timers::TICK_EVERY;
pub use timers::TIMERS_PER_MS;
