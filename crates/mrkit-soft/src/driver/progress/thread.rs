//! The progress thread: started with a device's first QP (unless the application drives
//! progress by hand), it runs passes while there is work and, when idle, spins, parks or
//! sleeps as the device's progress policy and the application's polling say (the module docs
//! of `driver::progress`).
#![forbid(unsafe_code)]

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::registry::DataPath;
use super::sched::Sched;
use super::ProgressPolicy;
use crate::driver::{Context, DeviceInner};

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

impl DataPath {
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

impl Context {
    /// Do not start a progress thread: the application drives the device with
    /// [`Context::progress_once`] (or [`loopback::drive_until_idle`](crate::driver::loopback::drive_until_idle)). Call before creating
    /// the first QP.
    pub fn set_manual_progress(&self) {
        self.dev.dp.manual.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn progress_policy_parses() {
        assert_eq!(ProgressPolicy::parse("auto"), Some(ProgressPolicy::Auto));
        assert_eq!(ProgressPolicy::parse(" Spin "), Some(ProgressPolicy::Spin));
        assert_eq!(ProgressPolicy::parse("block"), Some(ProgressPolicy::Block));
        assert_eq!(ProgressPolicy::parse("fast"), None);
        assert_eq!(ProgressPolicy::default(), ProgressPolicy::Auto);
    }
}
