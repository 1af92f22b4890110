//! Delayed ACKs, in one place: the held ACKs of a device (`AckHold`), the bound on their
//! delay ([`ACK_DELAY_MAX`]), which packets may be held, and how held ACKs leave (with the
//! next packets any thread sends, when due, when the device closes). The progress thread's
//! sleep is capped at the oldest held ACK's deadline (`progress.rs`), and the exit handler
//! sends what is still held (`at_exit.rs`).
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::progress::ns_since_epoch;
use super::{delivery, Context, DeviceInner};
use crate::pkt::Pkt;

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

/// The ACKs a device holds back.
#[derive(Debug, Default)]
pub(crate) struct AckHold {
    /// Plain ACKs held back by application progress passes.
    held: Mutex<Vec<Pkt>>,
    /// When the oldest ACK in `held` was held (ns since the progress epoch; 0: none held).
    /// Written under the `held` lock; read without it so that passes check for due ACKs
    /// cheaply. Stored SeqCst by a hold, against the progress thread's SeqCst store of its
    /// `sleeping` flag and load of this value (`progress.rs`): one of the two sides sees the
    /// other.
    held_at_ns: AtomicU64,
    /// Held from taking held ACKs until they are sent ([`HeldAcks`]): a thread that exits or
    /// closes the device right after must not find them taken but not yet sent (the exit
    /// would kill the sending thread mid-way: seen as a lost ACK in 1 of 8 runs).
    flush: Mutex<()>,
}

/// Held ACKs taken for sending; the flush lock is held until this is dropped (send first).
pub(crate) struct HeldAcks<'a> {
    _flush: parking_lot::MutexGuard<'a, ()>,
    /// The ACKs.
    pub pkts: Vec<Pkt>,
}

impl AckHold {
    /// Hold `pkts` (plain ACKs produced at `at_ns`), leaving `pkts` empty. A newer ACK of a QP
    /// replaces its held one (ACKs are cumulative). The caller then wakes a sleeping progress
    /// thread (SeqCst load of its flag after this SeqCst store).
    pub(crate) fn hold(&self, pkts: &mut Vec<Pkt>, at_ns: u64) {
        let mut g = self.held.lock();
        for p in pkts.drain(..) {
            if let Some(old) = g.iter_mut().find(|h| h.src_qpn == p.src_qpn) {
                *old = p;
            } else {
                g.push(p);
            }
        }
        if self.held_at_ns.load(Ordering::Relaxed) == 0 {
            // SeqCst with the hold's load of `sleeping`, against sleep()'s store of
            // `sleeping` and load of held_at_ns: one of the two sides sees the other.
            self.held_at_ns.store(at_ns, Ordering::SeqCst);
        }
    }

    /// Whether any ACK is held back (one atomic load).
    pub(crate) fn any(&self) -> bool {
        self.held_at_ns.load(Ordering::Acquire) != 0
    }

    /// When the oldest ACK was held (0: none), loaded SeqCst (the sleeping progress thread's
    /// side of the hold/sleep handshake).
    pub(crate) fn held_at_ns_seqcst(&self) -> u64 {
        self.held_at_ns.load(Ordering::SeqCst)
    }

    /// With ACKs held: how long until the oldest is due (zero: due now).
    pub(crate) fn due(&self, now: Instant) -> Option<Duration> {
        let at = self.held_at_ns.load(Ordering::Acquire);
        if at == 0 {
            return None;
        }
        let age = Duration::from_nanos(ns_since_epoch(now).saturating_sub(at));
        Some(ACK_DELAY_MAX.saturating_sub(age))
    }

    /// Take every held ACK, holding the flush lock until the returned value is dropped: send
    /// them before dropping it.
    pub(crate) fn take(&self) -> HeldAcks<'_> {
        let flush = self.flush.lock();
        let mut g = self.held.lock();
        self.held_at_ns.store(0, Ordering::Release);
        let pkts = std::mem::replace(&mut *g, crate::pkt::pkt_vec());
        HeldAcks {
            _flush: flush,
            pkts,
        }
    }

    /// ACKs held right now.
    pub(crate) fn count(&self) -> usize {
        self.held.lock().len()
    }
}

/// A plain ACK to a UDP peer: the only kind of packet that may be held back.
fn delayable(p: &Pkt) -> bool {
    p.dst_ip.is_some()
        && p.bth.opcode == crate::wire::Opcode::Acknowledge
        && p.ext.aeth.is_some_and(|a| a.is_ack())
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

impl Context {
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
                delivery::deliver(self, first);
                if !then.is_empty() {
                    delivery::deliver(self, then);
                }
                return;
            }
        }
        delivery::deliver(self, pkts);
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
            delivery::deliver(self, held_pkts);
        }
        drop(held); // sent: release the flush lock
    }

    /// ACKs currently held back (tests).
    #[doc(hidden)]
    pub fn held_ack_count(&self) -> usize {
        self.dev.dp.held_ack_count()
    }
}

impl DeviceInner {
    /// Send every ACK held back (device close, process exit).
    pub(crate) fn flush_held_acks(&self) {
        // No early return when none is held: taking them waits for a thread that took some
        // and is still sending them (the flush lock), which an exit must not cut short.
        let held = self.dp.take_held_acks();
        if let Some(port) = self.udp.get() {
            delivery::send_pkts_on(self, port, &held.pkts);
        }
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
