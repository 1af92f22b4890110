//! The QPs' timers (retransmission, RNR wait, the send-queue tick): a heap of due times, paced
//! per millisecond.
#![forbid(unsafe_code)]

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::registry::DataPath;

/// A QP whose send queue holds WQEs not sent yet but no timer (a flow limit, which a
/// response normally lifts) is run again after this long anyway.
pub(crate) const TICK_EVERY: Duration = Duration::from_millis(1);

/// Longest a receive backlog defers the QP timers (see `progress_pass`).
pub(super) const TIMER_STARVE: Duration = Duration::from_millis(5);

/// Most QP timers a progress pass runs (the others stay due for the next passes).
pub(super) const TIMERS_PER_PASS: usize = 64;

/// Most QP timers run per millisecond: paces retransmissions when many QPs time out at once
/// (thousands of QPs whose first packets a full receive buffer dropped together would
/// otherwise retransmit in the same instant, overflow it again, and use up their retries).
pub const TIMERS_PER_MS: u32 = 64;

/// The QPs' timers (retransmission, RNR wait): a heap of (due, QP number), due in
/// `ns_since_epoch`. A QP keeps at most a few entries (`QpInner::timer_at` is the earliest it
/// registered; an entry that does not match it when popped is stale and skipped), so a tick
/// touches only the QPs that are due, not every QP with work in flight.
#[derive(Debug, Default)]
pub(crate) struct Timers {
    pub(super) heap: std::collections::BinaryHeap<std::cmp::Reverse<(u64, u32)>>,
    /// Start of the current pacing window and timers run in it (`TIMERS_PER_MS`). 0: no
    /// window yet (`ns_since_epoch` is at least 1), so the first window starts at the first
    /// take, also in a process whose clock origin is less than a millisecond old.
    pub(super) window_ns: u64,
    pub(super) in_window: u32,
}

impl DataPath {
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
    pub(super) fn take_due_timers(&self, now_ns: u64) -> Vec<(u64, u32)> {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::progress::clock::{epoch, ns_since_epoch};
    use std::time::Instant;
    #[test]
    fn request_response_traffic_arms_a_timer_once_per_timeout_not_per_message() {
        use crate::qp::{rc_connect, RecvWr, SendWr, WrOpcode};
        let (c, _, cq, q1) = crate::testkit::host::manual_rc_host(16, false);
        let (d, _, dcq, q2) = crate::testkit::host::manual_rc_host(16, false);
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
}
