//! Caller-thread progress (the latency fast path), kept apart from the progress thread.
//!
//! * **Inline requester**: `post_send` on an idle QP in RTS runs that QP's engines on the
//!   caller's thread ([`Context::run_qp_inline`]) and hands the packets to the link at once,
//!   instead of scheduling the QP and paying a cross-CPU wakeup of the progress thread.
//! * **Progress on poll**: `poll_cq` on an empty CQ runs [`Context::progress_once`] for the
//!   device inline (as user-space providers do), so a spinning application makes progress
//!   by itself; the background thread remains for applications that block or never poll.
//!
//! * A poller skips progress while another thread is inside `progress_once` (the progress
//!   thread or another poller): that thread is already moving the same QPs, and two threads
//!   contending for one QP's lock only slow both down.
//!
//! Both are off in manual-progress mode (tests drive the device explicitly). The engines stay
//! sans-IO: this only decides *which thread* calls `QpObject::run`.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::qp::QpObject;
use crate::Context;

impl Context {
    /// Run one QP now on this thread and deliver what it produced.
    pub(crate) fn run_qp_inline(&self, q: &Arc<QpObject>) {
        let (pkts, needs_tick) = q.run(self, Instant::now());
        self.set_ticking(q.qpn, needs_tick);
        crate::net::deliver(self, pkts);
    }

    /// Progress-on-poll: called by `poll_cq` when the CQ was empty. Returns whether any QP ran.
    pub(crate) fn progress_on_poll(&self, now: Instant) -> bool {
        // Another thread (the progress thread, another poller) is making progress right now:
        // let it, rather than contend for the same QPs.
        if self.dev.dp.manual() || self.dev.progress_runners.load(Ordering::Acquire) > 0 {
            return false;
        }
        self.progress_once(now) > 0
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
