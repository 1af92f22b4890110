//! Completion queues and completion channels.
//!
//! * A CQ holds up to `cqe` completions. A push into a full CQ is an **overflow**: the CQ is
//!   marked in error, the async event `CQ_ERR` is raised, and the QP that tried to complete
//!   moves to ERR (IBA 11.4.2.1). Completions already queued can still be polled.
//! * Arming (`req_notify_cq`) is one-shot: the next completion (or, solicited-only, the next
//!   solicited *or error* completion) posts one event on the CQ's channel and disarms.
//! * A channel is a Condvar-backed queue of CQ numbers with a blocking `get_cq_event`, and
//!   optionally an eventfd readable while the queue holds events (for `epoll`/async runtimes).
//! * **QP reset cleans the CQs**: moving a QP to RESET removes its completions still queued in
//!   its send and receive CQs (also completions of receives it took from an SRQ), as the kernel
//!   drivers do (mlx5: `mlx5_ib_cq_clean` on the RESET transition). Other QPs' completions in a
//!   shared CQ stay, in order. So a QP recycled ERR → RESET → RTS never polls the flushed
//!   completions of its previous life.
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// `enum ibv_wc_status`.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum WcStatus {
    Success = 0,
    LocLenErr = 1,
    LocQpOpErr = 2,
    LocEecOpErr = 3,
    LocProtErr = 4,
    WrFlushErr = 5,
    MwBindErr = 6,
    BadRespErr = 7,
    LocAccessErr = 8,
    RemInvReqErr = 9,
    RemAccessErr = 10,
    RemOpErr = 11,
    RetryExcErr = 12,
    RnrRetryExcErr = 13,
    LocRddViolErr = 14,
    RemInvRdReqErr = 15,
    RemAbortErr = 16,
    InvEecnErr = 17,
    InvEecStateErr = 18,
    FatalErr = 19,
    RespTimeoutErr = 20,
    GeneralErr = 21,
}

impl WcStatus {
    /// `ibv_wc_status_str`-like name.
    pub fn name(self) -> &'static str {
        use WcStatus::*;
        match self {
            Success => "SUCCESS",
            LocLenErr => "LOC_LEN_ERR",
            LocQpOpErr => "LOC_QP_OP_ERR",
            LocEecOpErr => "LOC_EEC_OP_ERR",
            LocProtErr => "LOC_PROT_ERR",
            WrFlushErr => "WR_FLUSH_ERR",
            MwBindErr => "MW_BIND_ERR",
            BadRespErr => "BAD_RESP_ERR",
            LocAccessErr => "LOC_ACCESS_ERR",
            RemInvReqErr => "REM_INV_REQ_ERR",
            RemAccessErr => "REM_ACCESS_ERR",
            RemOpErr => "REM_OP_ERR",
            RetryExcErr => "RETRY_EXC_ERR",
            RnrRetryExcErr => "RNR_RETRY_EXC_ERR",
            LocRddViolErr => "LOC_RDD_VIOL_ERR",
            RemInvRdReqErr => "REM_INV_RD_REQ_ERR",
            RemAbortErr => "REM_ABORT_ERR",
            InvEecnErr => "INV_EECN_ERR",
            InvEecStateErr => "INV_EEC_STATE_ERR",
            FatalErr => "FATAL_ERR",
            RespTimeoutErr => "RESP_TIMEOUT_ERR",
            GeneralErr => "GENERAL_ERR",
        }
    }
}

/// `enum ibv_wc_opcode`.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum WcOpcode {
    Send = 0,
    RdmaWrite = 1,
    RdmaRead = 2,
    CompSwap = 3,
    FetchAdd = 4,
    BindMw = 5,
    LocalInv = 6,
    Recv = 128,
    RecvRdmaWithImm = 129,
}

/// `IBV_WC_WITH_IMM`.
pub const WC_WITH_IMM: u32 = 2;
/// `IBV_WC_WITH_INV`.
pub const WC_WITH_INV: u32 = 8;

/// A work completion (`struct ibv_wc`). The status is data: an error completion is a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wc {
    /// The WR's id.
    pub wr_id: u64,
    /// Status.
    pub status: WcStatus,
    /// Opcode (filled on send-side errors too; meaningless on flushed receives).
    pub opcode: WcOpcode,
    /// Vendor error (0).
    pub vendor_err: u32,
    /// Bytes: send = WR total length; RECV = bytes received; RECV_RDMA_WITH_IMM = RETH length.
    pub byte_len: u32,
    /// Immediate data (valid with `WC_WITH_IMM`), or the invalidated rkey (`WC_WITH_INV`).
    pub imm_data: u32,
    /// Local QP number.
    pub qp_num: u32,
    /// Source QP (receive completions).
    pub src_qp: u32,
    /// `WC_WITH_IMM` / `WC_WITH_INV`.
    pub wc_flags: u32,
}

/// Why a push failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Overflow;

#[derive(Debug)]
struct CqState {
    q: VecDeque<Wc>,
    cap: usize,
    overflowed: bool,
    /// `Some(solicited_only)` when armed.
    armed: Option<bool>,
}

/// A completion channel (`ibv_comp_channel`).
///
/// Besides the blocking [`CompChannel::get_event`], a channel can hand out a pollable
/// descriptor ([`CompChannel::fd`]): an eventfd, created on first request, that is readable
/// exactly while events are queued (written when an event is queued, drained when the queue
/// empties). Async runtimes register it with their reactor (`epoll`).
#[derive(Debug, Default)]
pub struct CompChannel {
    events: Mutex<ChannelState>,
    cond: Condvar,
}

#[derive(Debug, Default)]
struct ChannelState {
    q: VecDeque<u32>,
    /// Non-blocking eventfd mirroring `!q.is_empty()`; only changed under the lock.
    fd: Option<rustix::fd::OwnedFd>,
}

impl ChannelState {
    fn pop(&mut self) -> Option<u32> {
        let c = self.q.pop_front();
        if c.is_some() && self.q.is_empty() {
            if let Some(fd) = &self.fd {
                // Drain the counter (EAGAIN when already zero: nothing to do).
                let _ = rustix::io::read(fd, &mut [0u8; 8]);
            }
        }
        c
    }
}

fn signal(fd: &rustix::fd::OwnedFd) {
    // Only EAGAIN (counter at its maximum, which cannot happen with +1 per queued event) can
    // fail here: the descriptor is readable either way.
    let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
}

impl CompChannel {
    fn post(&self, cqn: u32) {
        let mut g = self.events.lock();
        g.q.push_back(cqn);
        if let Some(fd) = &g.fd {
            signal(fd);
        }
        drop(g);
        self.cond.notify_all();
    }
    /// Block until an event arrives (or `timeout`; `Some(Duration::ZERO)` does not block);
    /// returns the CQ number.
    pub fn get_event(&self, timeout: Option<Duration>) -> Option<u32> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut g = self.events.lock();
        loop {
            if let Some(c) = g.pop() {
                return Some(c);
            }
            match deadline {
                Some(d) => {
                    if self.cond.wait_until(&mut g, d).timed_out() {
                        return g.pop();
                    }
                }
                None => self.cond.wait(&mut g),
            }
        }
    }
    /// A duplicate of the channel's pollable descriptor (read-only use: poll/epoll for
    /// readability; reading it is the channel's business). Readable while events are queued.
    /// The eventfd is created on the first call; the error when no descriptor is left.
    pub fn fd(&self) -> std::io::Result<rustix::fd::OwnedFd> {
        use rustix::event::EventfdFlags;
        let mut g = self.events.lock();
        if g.fd.is_none() {
            let fd = rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
            if !g.q.is_empty() {
                signal(&fd);
            }
            g.fd = Some(fd);
        }
        let fd = g.fd.as_ref().expect("created above");
        Ok(rustix::io::fcntl_dupfd_cloexec(fd, 0)?)
    }
}

/// A completion queue as the device keeps it.
#[derive(Debug)]
pub struct CqObject {
    pub(crate) cqn: u32,
    state: Mutex<CqState>,
    /// QPs whose send or receive queue completes here (destroy → EBUSY while > 0).
    pub(crate) users: AtomicU32,
    pub(crate) channel: Option<Arc<CompChannel>>,
    /// Signalled on every push (for blocking polls without a channel).
    cond: Condvar,
    /// Completions queued: written under `state`'s lock after every change of the queue, read
    /// without it by `poll` so that polling an empty CQ (what a spinning application does
    /// millions of times a second) takes no lock. A stale zero only defers a completion to the
    /// next poll; a stale non-zero takes the lock and finds the truth.
    queued: AtomicUsize,
    /// Set once by `destroy_cq` (after the CQ left the device's table): a poller that
    /// reaches this CQ through its per-thread cache (`Context::poll_cq`) goes back to the
    /// table, which no longer has it. Orders nothing else.
    pub(crate) destroyed: std::sync::atomic::AtomicBool,
}

impl crate::last_used::Cached for CqObject {
    fn number(&self) -> u32 {
        self.cqn
    }
    fn destroyed(&self) -> bool {
        self.destroyed.load(std::sync::atomic::Ordering::Acquire)
    }
}

impl CqObject {
    pub(crate) fn new(cqn: u32, cap: usize, channel: Option<Arc<CompChannel>>) -> CqObject {
        CqObject {
            cqn,
            state: Mutex::new(CqState {
                q: VecDeque::with_capacity(cap.min(4096)),
                cap,
                overflowed: false,
                armed: None,
            }),
            users: AtomicU32::new(0),
            channel,
            cond: Condvar::new(),
            queued: AtomicUsize::new(0),
            destroyed: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Push one completion. `solicited`: the completion is a receive of a solicited message.
    pub(crate) fn push(&self, wc: Wc, solicited: bool) -> Result<(), Overflow> {
        let mut s = self.state.lock();
        if s.overflowed || s.q.len() >= s.cap {
            s.overflowed = true;
            return Err(Overflow);
        }
        s.q.push_back(wc);
        self.queued.store(s.q.len(), Ordering::Release);
        let fire = match s.armed {
            Some(sol_only) => !sol_only || solicited || wc.status != WcStatus::Success,
            None => false,
        };
        if fire {
            s.armed = None;
        }
        drop(s);
        self.cond.notify_all();
        if fire {
            if let Some(ch) = &self.channel {
                ch.post(self.cqn);
            }
        }
        Ok(())
    }

    pub(crate) fn poll(&self, out: &mut Vec<Wc>, max: usize) -> usize {
        if self.queued.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let mut s = self.state.lock();
        let n = max.min(s.q.len());
        out.extend(s.q.drain(..n));
        self.queued.store(s.q.len(), Ordering::Release);
        n
    }

    pub(crate) fn wait_nonempty(&self, deadline: Instant) -> bool {
        let mut s = self.state.lock();
        while s.q.is_empty() {
            if self.cond.wait_until(&mut s, deadline).timed_out() {
                return !s.q.is_empty();
            }
        }
        true
    }

    pub(crate) fn arm(&self, solicited_only: bool) {
        let mut s = self.state.lock();
        // A second arm without solicited-only widens the condition.
        s.armed = Some(match s.armed {
            Some(prev) => prev && solicited_only,
            None => solicited_only,
        });
    }

    pub(crate) fn len_cap(&self) -> (usize, usize) {
        let s = self.state.lock();
        (s.q.len(), s.cap)
    }

    pub(crate) fn overflowed(&self) -> bool {
        self.state.lock().overflowed
    }

    /// Remove every completion of QP `qpn` (the QP moved to RESET); the other QPs'
    /// completions keep their order. Returns how many were removed.
    pub(crate) fn clean_qp(&self, qpn: u32) -> usize {
        let mut s = self.state.lock();
        let before = s.q.len();
        s.q.retain(|w| w.qp_num != qpn);
        self.queued.store(s.q.len(), Ordering::Release);
        before - s.q.len()
    }

    pub(crate) fn resize(&self, cap: usize) -> Result<(), usize> {
        let mut s = self.state.lock();
        if cap < s.q.len() {
            return Err(s.q.len());
        }
        s.cap = cap;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wc(id: u64) -> Wc {
        Wc {
            wr_id: id,
            status: WcStatus::Success,
            opcode: WcOpcode::Send,
            vendor_err: 0,
            byte_len: 0,
            imm_data: 0,
            qp_num: 1,
            src_qp: 0,
            wc_flags: 0,
        }
    }

    fn readable(fd: &rustix::fd::OwnedFd) -> bool {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        let mut fds = [PollFd::new(fd, PollFlags::IN)];
        let zero = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        poll(&mut fds, Some(&zero)).unwrap() == 1
    }

    /// The channel's descriptor is readable exactly while events are queued: an event queued
    /// before the descriptor existed shows, each new event makes it readable, and taking the
    /// last one makes it quiet again.
    #[test]
    fn channel_descriptor_is_readable_while_events_are_queued() {
        let ch = Arc::new(CompChannel::default());
        ch.post(7);
        let fd = ch.fd().unwrap();
        assert!(readable(&fd), "an event queued before the fd existed");
        let cq = CqObject::new(3, 8, Some(ch.clone()));
        cq.arm(false);
        cq.push(wc(1), false).unwrap();
        assert!(readable(&fd));
        assert_eq!(ch.get_event(Some(Duration::ZERO)), Some(7));
        assert!(readable(&fd), "one event left");
        assert_eq!(ch.get_event(Some(Duration::ZERO)), Some(3));
        assert!(!readable(&fd), "drained");
        assert_eq!(ch.get_event(Some(Duration::ZERO)), None);
        // Not armed: a completion posts no event.
        cq.push(wc(2), false).unwrap();
        assert!(!readable(&fd));
        cq.arm(false);
        cq.push(wc(3), false).unwrap();
        let other = ch.fd().unwrap();
        assert!(readable(&fd) && readable(&other), "every duplicate sees it");
        assert_eq!(ch.get_event(None), Some(3));
        assert!(!readable(&other));
    }

    /// The lock-free empty check (`queued`) never loses a completion: a consumer polling
    /// while a producer pushes gets every completion exactly once, in order.
    #[test]
    fn polling_beside_a_pusher_gets_every_completion_in_order() {
        const N: u64 = 20_000;
        let cq = Arc::new(CqObject::new(1, N as usize, None));
        let producer = {
            let cq = cq.clone();
            std::thread::spawn(move || {
                for i in 0..N {
                    cq.push(wc(i), false).unwrap();
                }
            })
        };
        let mut got = Vec::with_capacity(N as usize);
        let end = Instant::now() + Duration::from_secs(20);
        while (got.len() as u64) < N && Instant::now() < end {
            cq.poll(&mut got, 7);
        }
        producer.join().unwrap();
        let ids: Vec<u64> = got.iter().map(|w| w.wr_id).collect();
        assert_eq!(ids, (0..N).collect::<Vec<_>>());
        assert_eq!(cq.poll(&mut got, 1), 0, "nothing left over");
    }
}
