//! One progress pass: receive from the UDP link, run the QPs that received or were
//! scheduled and the timers that are due, and hand their packets to the links.
#![forbid(unsafe_code)]

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::clock::ns_since_epoch;
use super::timers::TIMER_STARVE;
use crate::driver::Context;
use crate::qp::QpObject;

/// Whether a pass's table of QPs already holds `q`.
fn holds(batch: &[Option<Arc<QpObject>>], q: &Arc<QpObject>) -> bool {
    batch.iter().flatten().any(|b| Arc::ptr_eq(b, q))
}

/// Most QPs one progress pass runs (the others wait for the next pass).
const PASS_QPS: usize = 16;

impl Context {
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
            let delivering = crate::driver::delivery::Delivering::start(&q);
            let pkts = q.run(self, now);
            self.deliver_pkts(pkts, hold.filter(|_| q.delay_acks.load(Ordering::Relaxed)));
            drop(delivering);
        }
        for (at, qpn) in due {
            let Some(q) = dp.qp_object(qpn) else {
                continue; // destroyed since
            };
            let delivering = crate::driver::delivery::Delivering::start(&q);
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
}
