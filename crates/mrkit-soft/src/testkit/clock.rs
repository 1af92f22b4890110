//! The virtual clock: QP engines on a bare [`MemCore`], driven by hand.
//!
//! A [`VirtualNode`] is what the driver is to a device, minus every thread, socket and
//! real clock: it owns a memory core, CQs and RC QPs, implements the run contract the engines
//! ask of a host (timers, scheduling, events, notices) and runs its QPs only when told to
//! ([`VirtualNode::settle`]). Time moves only by [`VirtualNode::advance`]; packets leave a node
//! as the return value of a run and reach another only when the test hands them over
//! ([`VirtualNode::receive`], or [`VirtualPair`], which passes everything between two nodes).
//! The shape of quinn-proto's and smoltcp's tests: deterministic, no sleeps, and a run costs
//! no device open.
#![forbid(unsafe_code)]

use std::cell::{Cell, RefCell};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cq::{CqObject, Wc};
use crate::device::DeviceConfig;
use crate::driver::progress::TICK_EVERY;
use crate::error::{err, Result};
use crate::events::AsyncEvent;
use crate::memcore::MemCore;
use crate::net::udp::{NetStats, NetStatsSnapshot};
use crate::pkt::Pkt;
use crate::qp::connect::ConnectVerbs;
use crate::qp::{
    Notice, PostError, QpAttr, QpCap, QpInitAttr, QpObject, QpState, RecvWr, RunHost, SendWr,
};
use crate::stats::RxDrop;

/// The most QP runs one [`VirtualNode::settle`] (or [`VirtualPair::settle`]) does before it
/// declares a livelock.
pub const SETTLE_MAX_RUNS: usize = 10_000;

/// RC QPs and CQs on a bare memory core, run on a virtual clock (module docs).
pub struct VirtualNode {
    mem: MemCore,
    node: u64,
    /// Timer keys are nanoseconds since this instant.
    epoch: Instant,
    now: Cell<Instant>,
    next_num: Cell<u32>,
    qps: RefCell<BTreeMap<u32, Arc<QpObject>>>,
    cqs: RefCell<BTreeMap<u32, Arc<CqObject>>>,
    /// `(due ns, qpn)`, earliest first; stale entries are skipped by `QpObject::run_timer`.
    timers: RefCell<BinaryHeap<Reverse<(u64, u32)>>>,
    /// QPs to run, in the order they were scheduled (each at most once).
    runnable: RefCell<VecDeque<u32>>,
    events: RefCell<Vec<AsyncEvent>>,
    /// Notices for QPs of other nodes `(node, qpn, notice)` ([`VirtualPair`] hands them over).
    peer_notices: RefCell<Vec<(u64, u32, Notice)>>,
    rx: NetStats,
}

impl VirtualNode {
    /// A node with the device configuration `config` whose loopback node id is `node` (what a
    /// peer QP puts in its address vector).
    pub fn new(config: DeviceConfig, node: u64) -> VirtualNode {
        let now = Instant::now();
        VirtualNode {
            mem: MemCore::new(config),
            node,
            epoch: now,
            now: Cell::new(now),
            next_num: Cell::new(0x11),
            qps: RefCell::default(),
            cqs: RefCell::default(),
            timers: RefCell::default(),
            runnable: RefCell::default(),
            events: RefCell::default(),
            peer_notices: RefCell::default(),
            rx: NetStats::default(),
        }
    }

    /// The memory core: PDs and registration (`alloc_pd`, `reg_mr_va`, ...).
    pub fn mem(&self) -> &MemCore {
        &self.mem
    }

    /// The virtual time.
    pub fn now(&self) -> Instant {
        self.now.get()
    }

    /// Let `d` pass (runs nothing: [`settle`](Self::settle) runs the timers now due).
    pub fn advance(&self, d: Duration) {
        self.now.set(self.now.get() + d);
    }

    /// This node's id on the loopback link.
    pub fn node_id(&self) -> u64 {
        self.node
    }

    fn number(&self) -> u32 {
        let n = self.next_num.get();
        self.next_num.set(n + 1);
        n
    }

    fn qp(&self, qpn: u32) -> Result<Arc<QpObject>> {
        self.qps
            .borrow()
            .get(&qpn)
            .cloned()
            .ok_or_else(|| err!(EINVAL, "QP {qpn} does not exist"))
    }

    fn cq(&self, cqn: u32) -> Result<Arc<CqObject>> {
        self.cqs
            .borrow()
            .get(&cqn)
            .cloned()
            .ok_or_else(|| err!(EINVAL, "CQ {cqn} does not exist"))
    }

    /// A CQ of `entries` completions (EINVAL outside `1..=max_cqe`).
    pub fn create_cq(&self, entries: u32) -> Result<u32> {
        let max = self.mem.config.attr().max_cqe;
        if entries == 0 || entries > max {
            return Err(err!(EINVAL, "cqe {entries} must be in 1..={max}"));
        }
        let n = self.number();
        self.cqs
            .borrow_mut()
            .insert(n, Arc::new(CqObject::new(n, entries as usize, None)));
        Ok(n)
    }

    /// An RC QP in RESET (no SRQ). The capacities are taken as given (at least one WR per
    /// queue), like the device's `create_qp` does after its limit checks.
    pub fn create_qp(&self, init: QpInitAttr) -> Result<u32> {
        let pd = self.mem.pd(init.pd)?;
        let send_cq = self.cq(init.send_cq)?;
        let recv_cq = self.cq(init.recv_cq)?;
        pd.get();
        send_cq.users.fetch_add(1, Ordering::AcqRel);
        recv_cq.users.fetch_add(1, Ordering::AcqRel);
        let cap = QpCap {
            max_send_wr: init.cap.max_send_wr.max(1),
            max_recv_wr: init.cap.max_recv_wr.max(1),
            ..init.cap
        };
        let qpn = self.number();
        let attr = QpAttr {
            cap,
            ..QpAttr::default()
        };
        let q = QpObject::new(qpn, pd, send_cq, recv_cq, init.sq_sig_all, None, attr);
        self.qps.borrow_mut().insert(qpn, Arc::new(q));
        Ok(qpn)
    }

    /// `ibv_modify_qp` (the device's checks and effects).
    pub fn modify_qp(&self, qpn: u32, attr: &QpAttr, mask: u32) -> Result<()> {
        self.qp(qpn)?
            .modify(self.mem.config.attr(), attr, mask, self.now.get())?;
        self.schedule(qpn);
        Ok(())
    }

    /// The QP's state.
    pub fn qp_state(&self, qpn: u32) -> Result<QpState> {
        Ok(self.qp(qpn)?.inner.lock().state)
    }

    /// `ibv_post_send` (the device's post-time checks); the WRs run at the next settle.
    pub fn post_send(&self, qpn: u32, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
        let q = self
            .qp(qpn)
            .map_err(|error| PostError { bad_wr: 0, error })?;
        let res = crate::qp::post::push_sends(&mut q.inner.lock(), wrs);
        self.schedule(qpn);
        res
    }

    /// `ibv_post_recv` (the device's post-time checks).
    pub fn post_recv(&self, qpn: u32, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        let q = self
            .qp(qpn)
            .map_err(|error| PostError { bad_wr: 0, error })?;
        let (res, flushed) = crate::qp::post::push_recvs(&q, &mut q.inner.lock(), wrs);
        if flushed {
            self.schedule(qpn);
        }
        res
    }

    /// `ibv_poll_cq`: up to `max` completions appended to `out`; how many.
    pub fn poll_cq(&self, cqn: u32, out: &mut Vec<Wc>, max: usize) -> Result<usize> {
        Ok(self.cq(cqn)?.poll(out, max))
    }

    /// Every CQ's number.
    pub fn cq_numbers(&self) -> Vec<u32> {
        self.cqs.borrow().keys().copied().collect()
    }

    /// A packet arrives (from a link the test plays): it goes to its QP's inbox, and the QP
    /// runs at the next settle. A packet for no QP is dropped and counted (`rx_unknown_qp`).
    pub fn receive(&self, p: Pkt) {
        let q = self.qps.borrow().get(&p.bth.dest_qpn).cloned();
        match q {
            Some(q) => {
                q.inbox.push(p);
                self.schedule(q.qpn);
            }
            None => self.rx.count(RxDrop::UnknownQp, 1),
        }
    }

    /// Hand a notice to one of this node's QPs (the loopback link does this between nodes).
    fn notice(&self, qpn: u32, n: Notice) {
        if let Ok(q) = self.qp(qpn) {
            q.inbox.notify(n);
            self.schedule(qpn);
        }
    }

    /// One pass: the QPs scheduled so far and the timers due at the virtual time, each run
    /// once. Returns the packets the runs sent and how many runs there were.
    pub fn pass(&self) -> (Vec<Pkt>, usize) {
        let now = self.now.get();
        let mut pkts = Vec::new();
        let mut runs = 0;
        let now_ns = self.timer_key(now);
        loop {
            let due = {
                let mut t = self.timers.borrow_mut();
                match t.peek() {
                    Some(Reverse((at, _))) if *at <= now_ns => t.pop().map(|Reverse(e)| e),
                    _ => None,
                }
            };
            let Some((at, qpn)) = due else { break };
            if let Ok(q) = self.qp(qpn) {
                if let Some(mut p) = q.run_timer(self, at, now) {
                    runs += 1;
                    pkts.append(&mut p);
                }
            }
        }
        let batch: Vec<u32> = self.runnable.borrow_mut().drain(..).collect();
        for qpn in batch {
            if let Ok(q) = self.qp(qpn) {
                runs += 1;
                pkts.append(&mut q.run(self, now));
            }
        }
        (pkts, runs)
    }

    /// Run until nothing is left to do at the virtual time; the packets sent. Panics after
    /// [`SETTLE_MAX_RUNS`] runs (a livelock).
    pub fn settle(&self) -> Vec<Pkt> {
        let mut out = Vec::new();
        let mut total = 0;
        loop {
            let (mut p, runs) = self.pass();
            out.append(&mut p);
            if runs == 0 {
                return out;
            }
            total += runs;
            assert!(
                total < SETTLE_MAX_RUNS,
                "progress does not converge (livelock)"
            );
        }
    }

    /// The asynchronous events raised so far (taken).
    pub fn take_events(&self) -> Vec<AsyncEvent> {
        std::mem::take(&mut self.events.borrow_mut())
    }

    /// Receive-drop counters (the same ones as the device's `Context::net_stats`; only the
    /// drops a QP run or [`receive`](Self::receive) makes are counted here).
    pub fn net_stats(&self) -> NetStatsSnapshot {
        self.rx.snapshot()
    }

    /// Timer entries not yet due or skipped (for tests of timer pacing).
    pub fn timer_entries(&self) -> usize {
        self.timers.borrow().len()
    }
}

impl std::fmt::Debug for VirtualNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtualNode")
            .field("node", &self.node)
            .field("qps", &self.qps.borrow().len())
            .finish()
    }
}

impl RunHost for VirtualNode {
    fn mem(&self) -> &MemCore {
        &self.mem
    }
    fn node_id(&self) -> u64 {
        self.node
    }
    fn count_rx_drop(&self, why: RxDrop) {
        self.rx.count(why, 1);
    }
    fn timer_key(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX)
    }
    fn tick(&self) -> Duration {
        TICK_EVERY
    }
    fn arm_timer(&self, qpn: u32, key: u64) {
        self.timers.borrow_mut().push(Reverse((key, qpn)));
    }
    fn schedule(&self, qpn: u32) {
        let mut r = self.runnable.borrow_mut();
        if !r.contains(&qpn) {
            r.push_back(qpn);
        }
    }
    fn raise(&self, e: AsyncEvent) {
        self.events.borrow_mut().push(e);
    }
    fn notify_peer(&self, node: u64, qpn: u32, n: Notice) {
        self.peer_notices.borrow_mut().push((node, qpn, n));
    }
}

impl ConnectVerbs for VirtualNode {
    fn modify_qp(&self, qpn: u32, attr: &QpAttr, mask: u32) -> Result<()> {
        VirtualNode::modify_qp(self, qpn, attr, mask)
    }
    /// No socket: the test is the link.
    fn bind_udp_port(&self) -> Result<()> {
        Ok(())
    }
    fn node_id(&self) -> u64 {
        self.node
    }
}

/// Two [`VirtualNode`]s (node ids 1 and 2) with the packets each sends handed to the other:
/// the loopback link, played by hand, with one clock for both.
#[derive(Debug)]
pub struct VirtualPair {
    /// Node 1.
    pub a: VirtualNode,
    /// Node 2.
    pub b: VirtualNode,
}

impl VirtualPair {
    /// Two nodes with the configuration `config`.
    pub fn new(config: DeviceConfig) -> VirtualPair {
        VirtualPair {
            a: VirtualNode::new(config.clone(), 1),
            b: VirtualNode::new(config, 2),
        }
    }

    /// Let `d` pass on both nodes.
    pub fn advance(&self, d: Duration) {
        self.a.advance(d);
        self.b.advance(d);
    }

    /// Run both nodes and pass every packet (and notice) to the other one until nothing is
    /// left to do at the current time; `filter` sees each packet first and drops it by
    /// returning `false` (loss). Returns how many packets were handed over.
    pub fn settle_with(&self, mut filter: impl FnMut(&Pkt) -> bool) -> usize {
        let mut total_runs = 0;
        let mut delivered = 0;
        loop {
            let mut runs = 0;
            for (from, to) in [(&self.a, &self.b), (&self.b, &self.a)] {
                let (pkts, r) = from.pass();
                runs += r;
                for p in pkts {
                    if p.dst_node == to.node && filter(&p) {
                        delivered += 1;
                        to.receive(p);
                    }
                }
                for (node, qpn, n) in std::mem::take(&mut *from.peer_notices.borrow_mut()) {
                    if node == to.node {
                        to.notice(qpn, n);
                    }
                }
            }
            if runs == 0 {
                return delivered;
            }
            total_runs += runs;
            assert!(
                total_runs < SETTLE_MAX_RUNS,
                "progress does not converge (livelock)"
            );
        }
    }

    /// [`settle_with`](Self::settle_with) without loss.
    pub fn settle(&self) -> usize {
        self.settle_with(|_| true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access::AccessFlags;
    use crate::cq::WcStatus;
    use crate::qp::{rc_connect, Sge, WrOpcode};
    use crate::user_mem::UserMemory;

    /// Two connected QPs on a virtual pair, each with a PD, a CQ and 4 KiB registered.
    fn connected() -> (VirtualPair, [(u32, u32, crate::mr::MrInfo); 2]) {
        let p = VirtualPair::new(DeviceConfig::rxe());
        let mut sides = Vec::new();
        for n in [&p.a, &p.b] {
            let pd = n.mem().alloc_pd().unwrap();
            let cq = n.create_cq(64).unwrap();
            let init = QpInitAttr {
                pd,
                send_cq: cq,
                recv_cq: cq,
                cap: QpCap::default(),
                sq_sig_all: true,
            };
            let qp = n.create_qp(init).unwrap();
            let mem = UserMemory::owned(Arc::new(vec![0u8; 4096]));
            let mr = n
                .mem()
                .reg_mr_va(pd, mem, AccessFlags::LOCAL_WRITE)
                .unwrap();
            sides.push((qp, cq, mr));
        }
        rc_connect(
            &p.a,
            sides[0].0,
            &p.b,
            sides[1].0,
            AccessFlags::LOCAL_WRITE,
            3,
        )
        .unwrap();
        let b = sides.pop().unwrap();
        let a = sides.pop().unwrap();
        (p, [a, b])
    }

    fn send(node: &VirtualNode, qp: u32, mr: &crate::mr::MrInfo, id: u64) {
        let mut wr = SendWr::new(id, WrOpcode::Send);
        wr.sg_list = vec![Sge {
            addr: mr.iova,
            length: 100,
            lkey: mr.lkey,
        }];
        node.post_send(qp, &[wr]).unwrap();
    }

    fn recv(node: &VirtualNode, qp: u32, mr: &crate::mr::MrInfo, id: u64) {
        let wr = RecvWr {
            wr_id: id,
            sg_list: vec![Sge {
                addr: mr.iova,
                length: 4096,
                lkey: mr.lkey,
            }],
        };
        node.post_recv(qp, &[wr]).unwrap();
    }

    fn wcs(node: &VirtualNode, cq: u32) -> Vec<(u64, WcStatus)> {
        let mut v = Vec::new();
        node.poll_cq(cq, &mut v, 64).unwrap();
        v.iter().map(|w| (w.wr_id, w.status)).collect()
    }

    #[test]
    fn a_send_crosses_the_virtual_link() {
        let (p, [(qa, cqa, mra), (qb, cqb, mrb)]) = connected();
        recv(&p.b, qb, &mrb, 7);
        send(&p.a, qa, &mra, 1);
        assert_eq!(p.settle(), 2, "the SEND and its ACK");
        assert_eq!(wcs(&p.a, cqa), [(1, WcStatus::Success)]);
        assert_eq!(wcs(&p.b, cqb), [(7, WcStatus::Success)]);
    }

    /// Time moves only when the test says so: a lost SEND is resent when (and only when) the
    /// virtual clock passes the retransmission timeout.
    #[test]
    fn a_lost_packet_is_resent_when_virtual_time_passes_the_timeout() {
        let (p, [(qa, cqa, mra), (qb, cqb, mrb)]) = connected();
        recv(&p.b, qb, &mrb, 7);
        send(&p.a, qa, &mra, 1);
        let mut first = true;
        // The first packet (the SEND) is lost.
        assert_eq!(p.settle_with(|_| !std::mem::take(&mut first)), 0);
        assert_eq!(wcs(&p.a, cqa), []);
        // Timeout 14: 4.096 µs << 14 ≈ 67 ms. Short of it, nothing happens.
        p.advance(Duration::from_millis(30));
        assert_eq!(p.settle(), 0, "not due yet");
        p.advance(Duration::from_millis(100));
        assert_eq!(p.settle(), 2, "the retransmission and its ACK");
        assert_eq!(wcs(&p.a, cqa), [(1, WcStatus::Success)]);
        assert_eq!(wcs(&p.b, cqb), [(7, WcStatus::Success)]);
        assert!(p.a.take_events().is_empty());
    }

    #[test]
    fn a_packet_for_no_qp_is_counted() {
        let (p, [(qa, _, mra), _]) = connected();
        send(&p.a, qa, &mra, 1);
        let (pkts, runs) = p.a.pass();
        assert_eq!((pkts.len(), runs), (1, 1));
        let mut pkt = pkts.into_iter().next().unwrap();
        pkt.bth.dest_qpn = 0x999;
        p.b.receive(pkt);
        assert_eq!(p.b.net_stats().rx_unknown_qp, 1);
    }
}
