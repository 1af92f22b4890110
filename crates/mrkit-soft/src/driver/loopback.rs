//! In-process loopback link: delivers packets between QPs of the same or of different
//! [`Context`] instances ("hosts") in one process. Lossless and in order; a packet for an
//! unknown node or QP is dropped, as a network would.
//!
//! Every opened context is a node with a process-unique id ([`Context::node_id`]); an address
//! vector names the destination node. Delivery appends the packet to the destination QP's
//! inbox and schedules the QP on its device's progress engine.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use parking_lot::RwLock;

use crate::driver::{Context, DeviceInner};
use crate::pkt::Pkt;

static NEXT_NODE: AtomicU64 = AtomicU64::new(1);
type Nodes = RwLock<Option<HashMap<u64, Weak<DeviceInner>>>>;
/// The open devices of this process. Per process: a forked child starts with none (the parent's
/// devices, copied into the child, have no threads there and must not be reached or flushed at
/// exit), and a lock a parent thread held at `fork` cannot block the child's devices.
static NODES: crate::mem::PerProcess<Nodes> = crate::mem::PerProcess::new();

fn nodes() -> &'static Nodes {
    NODES.get_or_init(|| RwLock::new(None))
}

pub(crate) fn new_node_id() -> u64 {
    NEXT_NODE.fetch_add(1, Ordering::Relaxed)
}

pub(crate) fn attach(node: u64, dev: &Arc<DeviceInner>) {
    nodes()
        .write()
        .get_or_insert_with(HashMap::new)
        .insert(node, Arc::downgrade(dev));
}

pub(crate) fn detach(node: u64) {
    if let Some(m) = nodes().write().as_mut() {
        m.remove(&node);
    }
}

/// Send the ACKs every open device of this process holds back, after the runs still handing
/// packets to the link are done (`crate::driver::at_exit`).
pub(crate) fn flush_held_acks_of_every_device() {
    let devices: Vec<Arc<DeviceInner>> = match nodes().read().as_ref() {
        Some(m) => m.values().filter_map(|w| w.upgrade()).collect(),
        None => return,
    };
    for dev in devices {
        // Runs that pushed a completion may still be handing their packets (an ACK the
        // application's last completion implies) to the link: let them finish first.
        let qps: Vec<Arc<crate::qp::QpObject>> = dev.dp.qps.read().values().cloned().collect();
        for q in qps {
            super::delivery::wait_delivered(&q, super::delivery::DELIVERY_WAIT);
        }
        dev.flush_held_acks();
    }
}

fn lookup(node: u64) -> Option<Arc<DeviceInner>> {
    nodes().read().as_ref()?.get(&node)?.upgrade()
}

/// Give QP `qpn` of node `node` a notice about one of its packets (the receiver of a packet
/// found its bytes unreachable in the sender's memory while copying them, `qp::Notice`).
pub(crate) fn notify(node: u64, qpn: u32, n: crate::qp::Notice) {
    if let Some(dev) = lookup(node) {
        dev.dp.notify(qpn, n);
    }
}

/// Deliver packets (grouped by destination QP to schedule each QP once).
pub(crate) fn deliver(pkts: Vec<Pkt>) {
    crate::counters::tx_pkts(&pkts);
    let mut cur: Option<(u64, Arc<DeviceInner>)> = None;
    for p in pkts {
        let dev = match &cur {
            Some((n, d)) if *n == p.dst_node => d.clone(),
            _ => match lookup(p.dst_node) {
                Some(d) => {
                    cur = Some((p.dst_node, d.clone()));
                    d
                }
                None => continue,
            },
        };
        dev.dp.enqueue_packet(p);
    }
}

/// Drive several devices in manual-progress mode until none has work left (deterministic
/// tests with two "hosts"). Returns the number of QP runs performed.
pub fn drive_until_idle(ctxs: &[&Context]) -> usize {
    let mut total = 0;
    loop {
        let mut n = 0;
        for c in ctxs {
            n += c.progress_once(Instant::now());
        }
        total += n;
        if n == 0 {
            return total;
        }
    }
}
