//! Where packets go: a QP run's output to the in-process loopback link or to the UDP link,
//! and a packet the link could not gather back to its QP as a notice.
#![forbid(unsafe_code)]

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{loopback, Context, DeviceInner};
use crate::net::udp::{self, UdpPort};
use crate::pkt::{recycle, Pkt};
use crate::qp::{Notice, QpObject};

/// Longest wait of `destroy_qp` or the exit handler for runs still handing packets to the
/// link (a hand-over takes microseconds; the bound only matters if a driver thread is stuck).
pub(crate) const DELIVERY_WAIT: Duration = Duration::from_millis(200);

/// One run of `qp` whose packets are on their way to the link: counted in
/// `QpObject::delivering` from its creation (before or under the QP lock, so before the run
/// pushes any completion) until it is dropped, after the packets were delivered.
pub(crate) struct Delivering<'a>(&'a QpObject);

impl<'a> Delivering<'a> {
    pub(crate) fn start(qp: &'a QpObject) -> Delivering<'a> {
        // Relaxed: the QP lock the run takes next (or holds) orders this before its
        // completions; a waiter reads the count after taking that lock itself.
        qp.delivering.fetch_add(1, Ordering::Relaxed);
        Delivering(qp)
    }
}

impl Drop for Delivering<'_> {
    fn drop(&mut self) {
        // Release: the packets were handed to the link before a waiter sees the decrement.
        self.0.delivering.fetch_sub(1, Ordering::Release);
    }
}

/// Wait (yielding, at most `bound`) until no run of `qp` is still delivering packets.
pub(crate) fn wait_delivered(qp: &QpObject, bound: Duration) {
    let deadline = Instant::now() + bound;
    // Acquire: pairs with the Release of `Delivering::drop`.
    while qp.delivering.load(Ordering::Acquire) != 0 {
        if Instant::now() >= deadline {
            tracing::warn!(
                qpn = qp.qpn,
                "a run is still delivering packets after {bound:?}"
            );
            return;
        }
        std::thread::yield_now();
    }
}

/// Send packets: over the in-process loopback link, or as RoCEv2 datagrams over UDP when the
/// packet names an IP destination.
pub(crate) fn deliver(ctx: &Context, pkts: Vec<Pkt>) {
    if pkts.iter().all(|p| p.dst_ip.is_none()) {
        return loopback::deliver(pkts);
    }
    if pkts.iter().all(|p| p.dst_ip.is_some()) {
        return send_pkts(ctx, pkts);
    }
    let mut local = Vec::new();
    let mut wire = Vec::new();
    for p in pkts {
        if p.dst_ip.is_some() {
            wire.push(p);
        } else {
            local.push(p);
        }
    }
    if !local.is_empty() {
        loopback::deliver(local);
    }
    send_pkts(ctx, wire);
}

/// Serialise packets and send them over the device's UDP port. Consecutive packets of one QP
/// to one destination with equal length go out as one GSO send; segment `k` of such a send
/// leaves with IPv4 identification `k` (the kernel numbers GSO segments), so its ICRC is
/// computed for that ID. Packets for a device whose port cannot be bound are dropped and
/// counted (the RC retry machinery then reports RETRY_EXC_ERR, as a dead link would).
pub(crate) fn send_pkts(ctx: &Context, pkts: Vec<Pkt>) {
    // Bound already (the common case): no reference count taken per send.
    if let Some(port) = ctx.dev.udp.get() {
        send_pkts_on(&ctx.dev, port, &pkts);
        return recycle(pkts);
    }
    let port = match ctx.udp_port() {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(error = %e, "UDP port unavailable; dropping packets");
            return;
        }
    };
    send_pkts_on(&ctx.dev, &port, &pkts);
}

/// Send packets on the device's bound `port` (also used while the device is being dropped).
pub(crate) fn send_pkts_on(dev: &DeviceInner, port: &UdpPort, pkts: &[Pkt]) {
    udp::send_pkts_on(
        port,
        &dev.net_stats,
        dev.core.config.uses_gso(),
        &mut |p| gather_failed(dev, p),
        pkts,
    );
}

/// The payload of `p`, one of this device's packets, could not be read from registered memory:
/// tell its QP (a READ response: the responder NAKs it; a request: the requester fails it).
fn gather_failed(dev: &DeviceInner, p: &Pkt) {
    use crate::wire::Opcode::*;
    let psn = p.bth.psn;
    let n = match p.bth.opcode {
        RdmaReadResponseFirst
        | RdmaReadResponseMiddle
        | RdmaReadResponseLast
        | RdmaReadResponseOnly => Notice::ReadSourceFault { psn },
        _ => Notice::GatherFault { psn },
    };
    dev.dp.notify(p.src_qpn, n);
}
