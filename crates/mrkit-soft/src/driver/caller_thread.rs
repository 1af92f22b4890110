//! Caller-thread progress (the latency fast path), kept apart from the progress thread.
//!
//! * **Inline requester**: `post_send` on an idle QP in RTS runs that QP's engines on the
//!   caller's thread (`Context::run_qp_inline`) and hands the packets to the link at once,
//!   instead of scheduling the QP and paying a cross-CPU wakeup of the progress thread.
//! * **Progress on poll**: `poll_cq` on an empty CQ runs [`Context::progress_once`] for the
//!   device inline (as user-space providers do), so a spinning application makes progress
//!   by itself; the background thread remains for applications that block or never poll.
//!
//! * A poller skips progress while another thread is inside `progress_once` (the progress
//!   thread or another poller): that thread is already moving the same QPs, and two threads
//!   contending for one QP's lock only slow both down.
//!
//! * **Delayed ACKs**: a plain ACK produced by a progress pass that an application thread runs
//!   inline is held back (`held_acks.rs`: the state, the bound
//!   [`ACK_DELAY_MAX`](super::held_acks::ACK_DELAY_MAX) and when held ACKs leave).
//!
//! Both are off in manual-progress mode (tests drive the device explicitly). The engines stay
//! sans-IO: this only decides *which thread* calls `QpObject::run`.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::driver::Context;
use crate::qp::QpObject;

impl Context {
    /// Run one QP now on this thread (its lock `g` held by the caller) and deliver what it
    /// produced (with any held ACKs).
    pub(crate) fn run_qp_inline(
        &self,
        q: &Arc<QpObject>,
        g: parking_lot::MutexGuard<'_, crate::qp::QpInner>,
    ) {
        let delivering = super::delivery::Delivering::start(q);
        let pkts = q.run_locked(self, Instant::now(), g);
        self.deliver_pkts(pkts, None);
        drop(delivering);
    }

    /// Progress-on-poll: called by `poll_cq` when the CQ was empty. Returns whether any QP ran.
    pub(crate) fn progress_on_poll(&self, now: Instant) -> bool {
        if self.dev.dp.manual() {
            return false;
        }
        // Another thread (the progress thread, another poller) is making progress right now:
        // let it, rather than contend for the same QPs. But this thread still sends its held
        // ACKs once due: that thread may be preempted in the middle of its pass for
        // milliseconds (seen on 2 vCPUs with two spinning applications: ACKs held 2-6 ms).
        if self.dev.progress_runners.load(Ordering::Acquire) > 0 {
            self.flush_acks(Some(now));
            return false;
        }
        self.progress_pass(now, true) > 0
    }

    /// Run one progress pass as an application thread's `poll_cq` does (plain ACKs may be
    /// held back, [`ACK_DELAY_MAX`]), at the given time. For deterministic tests with manual
    /// progress; [`Context::progress_once`] is the progress thread's pass (it holds nothing
    /// and sends every held ACK).
    #[doc(hidden)]
    pub fn progress_once_as_app(&self, now: Instant) -> usize {
        self.progress_pass(now, true)
    }
}

/// Counts a thread inside `progress_once` for the time it lives.
pub(crate) struct Running<'a>(&'a AtomicUsize);

impl<'a> Running<'a> {
    pub(crate) fn enter(ctx: &'a Context) -> Running<'a> {
        ctx.dev.progress_runners.fetch_add(1, Ordering::AcqRel);
        Running(&ctx.dev.progress_runners)
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}
