//! Where packets go: a QP run's output to the in-process loopback link or to the UDP link,
//! and a packet the link could not gather back to its QP as a notice.
#![forbid(unsafe_code)]

use super::{loopback, Context, DeviceInner};
use crate::net::udp::{self, UdpPort};
use crate::pkt::{recycle, Pkt};
use crate::qp::Notice;

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
