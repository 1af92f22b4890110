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
//! * **Delayed ACKs (UDP link only, on by default)**: a plain ACK produced by a progress pass
//!   that an application thread runs inline (`poll_cq` → progress) is held back for at most
//!   [`ACK_DELAY_MAX`] and leaves right *after* the application's next packets, so that a
//!   reply does not wait behind the ACK's send call: on an 8-byte SEND echo the two ACK sends
//!   (~1.5 µs each on loopback) leave the round trip's critical path. See [`ACK_DELAY_MAX`]
//!   for the bound and who enforces it.
//!
//! Both are off in manual-progress mode (tests drive the device explicitly). The engines stay
//! sans-IO: this only decides *which thread* calls `QpObject::run`.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::driver::Context;
use crate::pkt::Pkt;
use crate::qp::QpObject;

/// Longest time a plain ACK may be held back (delayed ACK) before it is sent on its own.
///
/// **A deviation from hardware**, which sends every ACK at once, and one the IBA allows: a
/// responder may coalesce acknowledgements, and nothing but the requester's timeout bounds
/// when an ACK must arrive. No status, errno or ordering seen by the application changes;
/// only a requester's send completion can come later. Only plain ACKs
/// (`Acknowledge` with an ACK syndrome) to a UDP peer, produced while an application thread
/// runs progress inline (`poll_cq` on an empty CQ), are held; NAKs, RNR NAKs, READ responses
/// and atomic ACKs never are, nor is anything the progress thread produces. A held ACK leaves:
///
/// * right after the next packets any thread sends (the application's `post_send`,
///   typically), in a separate send call so that those packets do not wait for it (the ACKs
///   of a QP that is sending READ or atomic responses go just before them instead, in PSN
///   order);
/// * at the end of any application progress pass once it is `ACK_DELAY_MAX` old, and at any
///   empty `poll_cq` that skips its pass because another thread is in one;
/// * at any progress pass of the progress thread;
/// * when the progress thread re-checks: a sleeping one (nobody drove the device) is woken
///   by the hold and sleeps at most until the deadline; a *parked* one (the application
///   polls) sends due ACKs at its next re-check, which is not brought forward: re-checking
///   every few tens of microseconds while ACKs were held gave the SEND echo p99 tails of
///   2-4.5 ms on 2 vCPUs (wake-ups migrating the spinning threads). So an application that
///   stops calling verbs *without blocking* (computes, sleeps) right after a hold has its ACK
///   sent within [`ACK_DELAY_IDLE_MAX`] instead;
/// * at once when the application blocks (`wait_cq`, `get_cq_event`), on `modify_qp` and
///   `destroy_qp`, and when the device is closed (the last `Context` dropped:
///   `ibv_close_device`).
///
/// A QP whose held ACK had to leave on its own (the application did not send within the
/// bound, as in a one-way stream whose sender waits for the ACKs) has its ACKs sent at once
/// until the application posts a send on it again (`QpObject::delay_acks`), so a one-way
/// stream pays the delay once, not per message.
///
/// On by default; `MRKIT_DELAYED_ACK=0` or
/// [`DeviceConfig::delayed_acks(false)`](crate::DeviceConfig::delayed_acks) sends every ACK
/// at once, as hardware does.
///
/// The bound is kept by threads of this process: on a machine whose CPUs are overcommitted
/// an application preempted right after its pass holds an ACK may delay it until the progress
/// thread gets a CPU (scheduling delay, not an unbounded wait).
///
/// The requester's retransmission timer is ≥ 4.096 µs × 2^timeout (67 ms at the usual 14), far
/// above this bound.
pub const ACK_DELAY_MAX: Duration = Duration::from_micros(30);

/// Bound on a held ACK's delay when the application stops calling verbs without blocking,
/// destroying its QP or closing the device (the parked progress thread's longest re-check,
/// [`PARK_MAX`](crate::driver::progress::PARK_MAX), after the application's window
/// [`APP_WINDOW`](crate::driver::progress::APP_WINDOW)), plus scheduling delays.
pub const ACK_DELAY_IDLE_MAX: Duration = crate::driver::progress::PARK_MAX
    .saturating_add(crate::driver::progress::APP_WINDOW)
    .saturating_add(Duration::from_micros(5));

/// A plain ACK to a UDP peer: the only kind of packet that may be held back.
fn delayable(p: &Pkt) -> bool {
    p.dst_ip.is_some()
        && p.bth.opcode == crate::wire::Opcode::Acknowledge
        && p.ext.aeth.is_some_and(|a| a.is_ack())
}

impl Context {
    /// Run one QP now on this thread (its lock `g` held by the caller) and deliver what it
    /// produced (with any held ACKs).
    pub(crate) fn run_qp_inline(
        &self,
        q: &Arc<QpObject>,
        g: parking_lot::MutexGuard<'_, crate::qp::QpInner>,
    ) {
        let pkts = q.run_locked(self, Instant::now(), g);
        self.deliver_pkts(pkts, None);
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

    /// Send the packets of one QP run. `hold = Some(now)`: the run was part of an application
    /// thread's progress pass, and if it produced nothing but plain ACKs to UDP peers they
    /// are held back (delayed ACK, [`ACK_DELAY_MAX`]). Anything that is sent takes the held
    /// ACKs along.
    pub(crate) fn deliver_pkts(&self, pkts: Vec<Pkt>, hold: Option<Instant>) {
        if pkts.is_empty() {
            return crate::pkt::recycle(pkts);
        }
        let dp = &self.dev.dp;
        if let Some(now) = hold {
            if pkts.iter().all(delayable) {
                dp.hold_acks(pkts, now);
                return;
            }
        }
        if dp.acks_held() {
            let mut held = dp.take_held_acks();
            if !held.pkts.is_empty() {
                let (first, then) = around_held(std::mem::take(&mut held.pkts), pkts);
                super::delivery::deliver(self, first);
                if !then.is_empty() {
                    super::delivery::deliver(self, then);
                }
                return;
            }
        }
        super::delivery::deliver(self, pkts);
    }

    /// Send the held ACKs: all of them (`aged_at = None`), or only if the oldest was held at
    /// least [`ACK_DELAY_MAX`] before `aged_at`.
    pub(crate) fn flush_acks(&self, aged_at: Option<Instant>) {
        let dp = &self.dev.dp;
        if !dp.acks_held() {
            return;
        }
        if let Some(now) = aged_at {
            if !dp.acks_due(now).is_some_and(|d| d.is_zero()) {
                return;
            }
        }
        let mut held = dp.take_held_acks();
        let held_pkts = std::mem::take(&mut held.pkts);
        if aged_at.is_some() {
            // These ACKs waited for nothing: the application does not answer on these QPs
            // (a one-way stream, whose sender waits for the ACKs). Send theirs at once from
            // now on, until the application posts a send on the QP again.
            for h in &held_pkts {
                if let Some(q) = dp.qp_object(h.src_qpn) {
                    q.delay_acks.store(false, Ordering::Relaxed);
                }
            }
        }
        if !held_pkts.is_empty() {
            super::delivery::deliver(self, held_pkts);
        }
        drop(held); // sent: release the flush lock
    }

    /// Run one progress pass as an application thread's `poll_cq` does (plain ACKs may be
    /// held back, [`ACK_DELAY_MAX`]), at the given time. For deterministic tests with manual
    /// progress; [`Context::progress_once`] is the progress thread's pass (it holds nothing
    /// and sends every held ACK).
    #[doc(hidden)]
    pub fn progress_once_as_app(&self, now: Instant) -> usize {
        self.progress_pass(now, true)
    }

    /// ACKs currently held back (tests).
    #[doc(hidden)]
    pub fn held_ack_count(&self) -> usize {
        self.dev.dp.held_ack_count()
    }
}

/// Order held ACKs around the packets about to be sent: returns what to send first and what
/// to send right after it, in a separate send call. The held ACKs go after the packets, so
/// that the application's message leaves without waiting for them: a loopback send costs
/// ~1.5 µs per datagram here (mostly the receiver's kernel work, run by the sender), and one
/// GSO send of the message with the ACK as its short last segment measured slower still
/// (~3.9 µs for the two, against ~1.6 µs for the message alone). Except the ACKs of a QP that
/// is also sending responses now: those go first, in the same send, to keep that QP's
/// responses in PSN order.
fn around_held(held: Vec<Pkt>, pkts: Vec<Pkt>) -> (Vec<Pkt>, Vec<Pkt>) {
    let responds = |qpn: u32| {
        pkts.iter()
            .any(|p| p.src_qpn == qpn && p.bth.opcode.info().is_response())
    };
    if !held.iter().any(|h| responds(h.src_qpn)) {
        return (pkts, held); // the common case: no partition, no allocation
    }
    let (mut first, then): (Vec<Pkt>, Vec<Pkt>) =
        held.into_iter().partition(|h| responds(h.src_qpn));
    first.extend(pkts);
    (first, then)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pkt::Payload;
    use crate::wire::{Aeth, Bth, ExtHeaders, Opcode};

    fn pkt(src_qpn: u32, opcode: Opcode, psn: u32) -> Pkt {
        let mut ext = ExtHeaders::default();
        if opcode.info().is_response() {
            ext.aeth = Some(Aeth::ack(0));
        }
        Pkt {
            dst_node: 0,
            dst_ip: Some(std::net::Ipv4Addr::LOCALHOST.into()),
            src_ip: None,
            src_node: 0,
            src_qpn,
            bth: Bth::new(opcode, 99, psn),
            ext,
            payload: Payload::Empty,
        }
    }

    fn ids(p: &[Pkt]) -> Vec<(u32, Opcode, u32)> {
        p.iter()
            .map(|p| (p.src_qpn, p.bth.opcode, p.bth.psn))
            .collect()
    }

    #[test]
    fn held_acks_leave_after_the_message_except_before_their_own_qps_responses() {
        use Opcode::*;
        // (held ACKs, packets to send) -> (first send, second send)
        let table = [
            // A reply (request) on QP 1 with QP 1's held ACK: the reply first, the ACK after.
            (
                vec![pkt(1, Acknowledge, 5)],
                vec![pkt(1, SendOnly, 7)],
                vec![(1, SendOnly, 7)],
                vec![(1, Acknowledge, 5)],
            ),
            // QP 2 sends a READ response: its held ACK (older PSN) goes first, same send; QP 3's
            // held ACK goes after.
            (
                vec![pkt(3, Acknowledge, 1), pkt(2, Acknowledge, 4)],
                vec![pkt(2, RdmaReadResponseOnly, 5)],
                vec![(2, Acknowledge, 4), (2, RdmaReadResponseOnly, 5)],
                vec![(3, Acknowledge, 1)],
            ),
        ];
        for (held, pkts, first, then) in table {
            let (f, t) = around_held(held, pkts);
            assert_eq!((ids(&f), ids(&t)), (first, then));
        }
    }
}
