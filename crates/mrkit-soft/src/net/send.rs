//! Sending on the device's UDP port: the serialiser that writes a run's packets straight
//! into a send buffer (headers, payload copied once from registered memory, pad, ICRC), cuts
//! them into GSO runs and sends them in one `sendmmsg` ([`send_pkts_on`]).
#![forbid(unsafe_code)]

use std::net::SocketAddr;

use super::sockio::{self, OutMsg};
use super::stats::NetStats;
use super::udp::UdpPort;
use crate::addr::ROCE_PORT;

/// The smallest path MTU (256): a READ of more bytes may be answered by several packets.
const MIN_PATH_MTU: u32 = 256;

/// A GSO send is one UDP datagram to the kernel: at most 65,507 bytes of payload in all.
const MAX_GSO_BYTES: usize = 65_507;

/// IPv4 flags word with DF set (what an unconnected `IP_PMTUDISC_PROBE` socket sends).
const IPV4_DF: u16 = 0x4000;

/// Serialise packets and send them on `port`. Consecutive packets of one QP to one
/// destination with equal length go out as one GSO send (when `gso` allows it); segment `k`
/// of such a send leaves with IPv4 identification `k` (the kernel numbers GSO segments), so
/// its ICRC is computed for that ID. A packet whose payload cannot be read from registered
/// memory is not sent: `gather_failed` hears of it (and that QP's later packets of this call
/// are dropped, as a NIC stops at the error).
pub(crate) fn send_pkts_on(
    port: &UdpPort,
    stats: &NetStats,
    gso: bool,
    gather_failed: &mut dyn FnMut(&super::Pkt),
    pkts: &[super::Pkt],
) {
    let local = port.local_addr();
    // READ responses of more than one packet come back as GSO runs: GRO must be on first.
    if pkts.iter().any(|p| {
        p.bth.opcode == crate::wire::Opcode::RdmaReadRequest
            && p.ext.reth.is_some_and(|r| r.dma_len > MIN_PATH_MTU)
    }) {
        port.hold_gro();
    }
    // With a fault injector every datagram leaves alone (ID 0), so none may be built as a
    // GSO segment: its ICRC would cover ID `k` and the receiver would drop it.
    let max_seg = if gso && port.faults.is_none() {
        port.max_gso_segments() // 1..=sockio::MAX_GSO_SEGMENTS
    } else {
        1
    };
    thread_local! {
        static SEND_BUF: std::cell::RefCell<(Vec<u8>, Vec<Run>)> = std::cell::RefCell::new(
            (Vec::with_capacity(MAX_GSO_BYTES), Vec::with_capacity(sockio::MAX_BATCH)),
        );
    }
    // At process exit (`crate::driver::at_exit`) this thread's buffer may already be destroyed.
    if SEND_BUF
        .try_with(|b| {
            let (buf, runs) = &mut *b.borrow_mut();
            send_runs(stats, gather_failed, port, local, max_seg, pkts, buf, runs)
        })
        .is_err()
    {
        send_runs(
            stats,
            gather_failed,
            port,
            local,
            max_seg,
            pkts,
            &mut Vec::new(),
            &mut Vec::new(),
        );
    }
}

/// One GSO run (or single datagram) serialised into the send buffer.
#[derive(Clone, Copy)]
struct Run {
    sport: u16,
    dst: SocketAddr,
    /// Byte range in the send buffer.
    start: usize,
    len: usize,
    /// Segment size when the run holds more than one datagram.
    seg: Option<u16>,
}

/// Serialised bytes after which the runs built so far are sent (bounds the buffer).
const FLUSH_BYTES: usize = 512 << 10;

#[allow(clippy::too_many_arguments)]
fn send_runs(
    stats: &NetStats,
    gather_failed: &mut dyn FnMut(&super::Pkt),
    port: &UdpPort,
    local: SocketAddr,
    max_seg: usize,
    pkts: &[super::Pkt],
    buf: &mut Vec<u8>,
    runs: &mut Vec<Run>,
) {
    // The runs built so far (this thread's table: no allocation or initialisation per send).
    runs.clear();
    // `buf[..used]` holds the runs built so far. The buffer only ever grows (zeroed once):
    // zeroing 64 KiB per message before overwriting it cost ~3 % of a bandwidth sender.
    let mut used = 0;
    let mut i = 0;
    // A QP one of whose packets could not be gathered (its registered memory is unreachable):
    // its later packets in this send are dropped, as a NIC stops at the error.
    let mut failed_qpn: Option<u32> = None;
    while i < pkts.len() {
        let first = &pkts[i];
        let Some(dst_ip) = first.dst_ip else {
            i += 1;
            continue;
        };
        if failed_qpn == Some(first.src_qpn) {
            i += 1;
            continue;
        }
        let dst = SocketAddr::new(dst_ip, ROCE_PORT);
        let sport = port.sport_for(first.src_qpn);
        let src = SocketAddr::new(local.ip(), sport);
        let base = crate::wire::IcrcInputs::from_socket_addrs(src, dst);
        if runs.len() == sockio::MAX_BATCH
            || used >= FLUSH_BYTES
            || runs.last().is_some_and(|r| r.sport != sport)
        {
            flush_runs(stats, port, runs, buf);
            runs.clear();
            used = 0;
        }
        let run_start = used;
        let mut seg_len = 0;
        let mut n = 0;
        let same_flow = |p: &super::Pkt| p.dst_ip == Some(dst_ip) && p.src_qpn == first.src_qpn;
        while i < pkts.len() && n < max_seg {
            let p = &pkts[i];
            if !same_flow(p) {
                break;
            }
            if n > 0 && !pkts.get(i + 1).is_some_and(same_flow) {
                // The flow's last packet of this send leaves alone, with ID 0, which every
                // receiver can check. A receiver whose GRO is off gets a GSO run cut into
                // datagrams whose IDs it cannot know and drops all but the first; this
                // packet, arriving right behind them, then shows the PSN gap and the
                // responder NAKs at once instead of the requester waiting for its timer.
                break;
            }
            let inputs = if base.is_ipv4() {
                base.with_ipv4_id(n as u16, IPV4_DF)
            } else {
                base
            };
            // Serialise straight into the send buffer: headers, payload copied once from
            // registered memory (or the inline bytes), pad, ICRC.
            let at = used;
            let plen = p.payload.len();
            let room = at + crate::wire::wire_len(p.bth.opcode, plen);
            if buf.len() < room {
                buf.resize(room, 0);
            }
            let frame = &mut buf[at..room];
            let built = crate::wire::emit_headers(frame, &p.bth, &p.ext, plen).and_then(|layout| {
                p.payload
                    .read(0, &mut frame[layout.payload_range()])
                    .map_err(|_| crate::wire::WireError::PayloadUnreachable)?;
                crate::wire::finish(frame, &layout, &inputs)
            });
            let dlen = match built {
                Ok(l) => l,
                Err(crate::wire::WireError::PayloadUnreachable) => {
                    // Not sent; the QP turns it into the error a NIC's failed gather gives.
                    gather_failed(p);
                    failed_qpn = Some(p.src_qpn);
                    i += 1;
                    break;
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot serialise packet");
                    i += 1;
                    continue;
                }
            };
            if n > 0 && (dlen > seg_len || at + dlen - run_start > MAX_GSO_BYTES) {
                // Only the last segment may be shorter, and one send stays below 64 KiB:
                // leave this packet for the next run.
                break;
            }
            used = at + dlen;
            let shorter = n > 0 && dlen < seg_len;
            if n == 0 {
                seg_len = dlen;
            }
            n += 1;
            i += 1;
            if shorter {
                break;
            }
        }
        if n == 0 {
            continue;
        }
        runs.push(Run {
            sport,
            dst,
            start: run_start,
            len: used - run_start,
            // seg_len ≤ one datagram < 64 KiB
            seg: (n > 1).then_some(seg_len as u16),
        });
    }
    flush_runs(stats, port, runs, buf);
}

/// Send the runs (all from one source port) built in `buf`, and count them.
fn flush_runs(stats: &NetStats, port: &UdpPort, runs: &[Run], buf: &[u8]) {
    let Some(first) = runs.first() else {
        return;
    };
    let msg = |r: &Run| OutMsg {
        dst: r.dst,
        bytes: &buf[r.start..r.start + r.len],
        segment: r.seg,
    };
    let (sent, err) = if let [only] = runs {
        // One run (a request, a reply, an ACK): no table of messages to fill.
        port.send_msgs(first.sport, &[msg(only)])
    } else {
        let msgs: [OutMsg<'_>; sockio::MAX_BATCH] =
            std::array::from_fn(|i| msg(runs.get(i).unwrap_or(first)));
        port.send_msgs(first.sport, &msgs[..runs.len()])
    };
    crate::counters::tx_datagrams(
        sent,
        runs.iter()
            .map(|r| super::udp::datagram_count(&msg(r)))
            .sum(),
        runs.iter().map(|r| r.len as u64).sum(),
        err.is_some(),
    );
    if let Some(e) = err {
        stats
            .send_errors
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::debug!(error = %e, dst = %first.dst, "UDP send failed");
    }
    stats
        .tx_datagrams
        .fetch_add(sent as u64, std::sync::atomic::Ordering::Relaxed);
}
