//! Port and hardware counters with the names and meanings of rxe's `hw_counters`, the IB
//! port counters and, where rxe has none, mlx5's (`rdma statistic show` / sysfs
//! `ports/1/hw_counters`). `docs/monitoring.md` has the table: name, meaning, where counted.
//!
//! The counters are per process and per device port: every `mrkit0` instance a process opens
//! is port 1 of the one device `mrkit0`, so they add up here, as the kernel's counters add up
//! every user of a device. Each counter is an independent relaxed atomic (no cross-counter
//! invariant is read atomically); the data path pays one relaxed add per event, and the
//! per-packet counters one add per packet batch where a batch is at hand.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::cq::WcStatus;
use crate::pkt::Pkt;
use crate::stats::RxDrop;
use crate::wire::NakCode;

macro_rules! counters {
    ($($(#[$m:meta])* $v:ident = $name:literal, $family:literal;)*) => {
        /// One port counter (see the module docs).
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        #[repr(usize)]
        pub enum Hw {
            $($(#[$m])* $v,)*
        }

        impl Hw {
            /// Every counter, in the order [`snapshot`] lists them.
            pub const ALL: &'static [Hw] = &[$(Hw::$v,)*];

            /// The counter's name, as rxe, the IB port counters or mlx5 call it.
            pub fn name(self) -> &'static str {
                match self { $(Hw::$v => $name,)* }
            }

            /// Where the name comes from: `"rxe"`, `"ib"` (port counters) or `"mlx5"`.
            pub fn family(self) -> &'static str {
                match self { $(Hw::$v => $family,)* }
            }
        }
    };
}

counters! {
    /// Packets the port sent (requests, responses, ACKs; retransmissions included).
    SentPkts = "sent_pkts", "rxe";
    /// Packets a QP accepted (after the transport checks: ICRC, QP, state, source, P_Key).
    RcvdPkts = "rcvd_pkts", "rxe";
    /// Request packets the responder received with a PSN it had already seen.
    DuplicateRequest = "duplicate_request", "rxe";
    /// Out-of-sequence requests answered with a PSN sequence error NAK (one per NAK sent).
    OutOfSeqRequest = "out_of_seq_request", "rxe";
    /// RNR NAKs the requester received.
    RcvdRnrErr = "rcvd_rnr_err", "rxe";
    /// RNR NAKs the responder sent (no receive WQE posted).
    SendRnrErr = "send_rnr_err", "rxe";
    /// PSN sequence error NAKs the requester received.
    RcvdSeqErr = "rcvd_seq_err", "rxe";
    /// rxe: the completer deferred to its task because responses queued up. mrkit's
    /// completer runs on the receiving thread and never defers: stays 0.
    AckDeferred = "ack_deferred", "rxe";
    /// Send WQEs completed with RETRY_EXC_ERR (transport retries exhausted).
    RetryExceededErr = "retry_exceeded_err", "rxe";
    /// Send WQEs completed with RNR_RETRY_EXC_ERR (RNR retries exhausted).
    RetryRnrExceededErr = "retry_rnr_exceeded_err", "rxe";
    /// Retries the requester started (timeout, sequence NAK or implied NAK: go back N).
    CompleterRetryErr = "completer_retry_err", "rxe";
    /// Datagrams the port failed to send (the socket refused them).
    SendErr = "send_err", "rxe";
    /// SEND WQEs completed successfully on the requester.
    RdmaSends = "rdma_sends", "rxe";
    /// Receive WQEs completed successfully (SEND or WRITE with immediate received).
    RdmaRecvs = "rdma_recvs", "rxe";
    /// Bytes sent (BTH through ICRC, as the IB port counter) divided by 4.
    PortXmitData = "port_xmit_data", "ib";
    /// Bytes received (BTH through ICRC) of accepted packets, divided by 4.
    PortRcvData = "port_rcv_data", "ib";
    /// Packets sent.
    PortXmitPackets = "port_xmit_packets", "ib";
    /// Packets received (accepted by a QP).
    PortRcvPackets = "port_rcv_packets", "ib";
    /// Times a requester's retransmission timer expired (local ACK timeout).
    LocalAckTimeoutErr = "local_ack_timeout_err", "mlx5";
    /// RNR NAKs received while RNR retries were left.
    RnrNakRetryErr = "rnr_nak_retry_err", "mlx5";
    /// PSN sequence error NAKs received.
    PacketSeqErr = "packet_seq_err", "mlx5";
    /// Implied NAKs: a response beyond a missing READ response or atomic ACK.
    ImpliedNakSeqErr = "implied_nak_seq_err", "mlx5";
    /// Request packets received with a PSN beyond the expected one (each packet).
    OutOfSequence = "out_of_sequence", "mlx5";
    /// Remote access error NAKs the requester received.
    ReqRemoteAccessErrors = "req_remote_access_errors", "mlx5";
    /// Remote access errors the responder detected (and NAKed).
    RespRemoteAccessErrors = "resp_remote_access_errors", "mlx5";
    /// Received packets whose ICRC did not verify (dropped).
    RxIcrcEncapsulated = "rx_icrc_encapsulated", "mlx5";
}

const N: usize = Hw::ALL.len();

/// One counter on its own cache line: the sending and the receiving threads count packets at
/// the same time and must not share a line.
#[repr(align(64))]
struct Slot(AtomicU64);

struct Counters([Slot; N]);

fn counters() -> &'static Counters {
    static C: Counters = Counters([const { Slot(AtomicU64::new(0)) }; N]);
    &C
}

/// The slot holding `c`'s value: the IB packet counters are the same counts as rxe's
/// (`port_xmit_packets` = `sent_pkts`, `port_rcv_packets` = `rcvd_pkts`), kept once.
fn slot(c: Hw) -> &'static AtomicU64 {
    let c = match c {
        Hw::PortXmitPackets => Hw::SentPkts,
        Hw::PortRcvPackets => Hw::RcvdPkts,
        c => c,
    };
    &counters().0[c as usize].0
}

/// Add `n` to counter `c` (relaxed: an independent event count).
pub(crate) fn add(c: Hw, n: u64) {
    slot(c).fetch_add(n, Relaxed);
}

/// Count one event.
pub(crate) fn inc(c: Hw) {
    add(c, 1);
}

/// The value of one counter.
pub fn get(c: Hw) -> u64 {
    match c {
        // ICRC failures are counted once, where the receive path drops them
        // (`stats::rx_drops`): every kind of ICRC drop is an mlx5 `rx_icrc_encapsulated`.
        Hw::RxIcrcEncapsulated => {
            let drops = crate::stats::rx_drops().snapshot();
            let icrc = [RxDrop::BadIcrc, RxDrop::IcrcForeignId, RxDrop::IcrcCutRun];
            drops
                .iter()
                .filter(|(name, _)| icrc.iter().any(|k| k.name() == *name))
                .map(|(_, n)| n)
                .sum()
        }
        c => slot(c).load(Relaxed),
    }
}

/// `(name, value)` of every counter, in [`Hw::ALL`] order.
pub fn snapshot() -> Vec<(&'static str, u64)> {
    Hw::ALL.iter().map(|c| (c.name(), get(*c))).collect()
}

fn wire_bytes(p: &Pkt) -> u64 {
    crate::wire::wire_len(p.bth.opcode, p.payload.len()) as u64
}

/// Packets handed to the in-process link.
pub(crate) fn tx_pkts(pkts: &[Pkt]) {
    let bytes: u64 = pkts.iter().map(wire_bytes).sum();
    tx_done(pkts.len() as u64, bytes);
}

fn tx_done(pkts: u64, bytes: u64) {
    if pkts == 0 {
        return;
    }
    add(Hw::SentPkts, pkts); // also port_xmit_packets
    add(Hw::PortXmitData, bytes / 4);
}

/// A UDP send of `total` datagrams carrying `bytes` (BTH..ICRC) of which `sent` left;
/// `failed`: the socket refused the rest. The bytes of a partly sent batch are counted in
/// proportion to the datagrams that left (segments of one run have one size).
pub(crate) fn tx_datagrams(sent: usize, total: usize, bytes: u64, failed: bool) {
    let (sent, total) = (sent as u64, total.max(1) as u64);
    let bytes = if sent >= total {
        bytes
    } else {
        bytes.saturating_mul(sent) / total
    };
    tx_done(sent, bytes);
    if failed {
        add(Hw::SendErr, total.saturating_sub(sent).max(1));
    }
}

/// A packet a QP accepted.
pub(crate) fn rx_pkt(p: &Pkt) {
    inc(Hw::RcvdPkts); // also port_rcv_packets
    add(Hw::PortRcvData, wire_bytes(p) / 4);
}

/// The responder got a request beyond the expected PSN; `nak`: it answers this one with a
/// sequence error NAK (the first of a run of out-of-sequence packets).
pub(crate) fn out_of_seq(nak: bool) {
    inc(Hw::OutOfSequence);
    if nak {
        inc(Hw::OutOfSeqRequest);
    }
}

/// The requester of QP `qpn` got an RNR NAK for `psn`; `exhausted`: no RNR retry is left.
pub(crate) fn rnr_nak_rcvd(qpn: u32, psn: u32, exhausted: bool) {
    crate::probes::retransmit(qpn, psn, crate::probes::RetryCause::RnrNak);
    inc(Hw::RcvdRnrErr);
    if !exhausted {
        inc(Hw::RnrNakRetryErr);
    }
}

/// The requester of QP `qpn` got a (not stale) PSN sequence error NAK for `psn`.
pub(crate) fn seq_nak_rcvd(qpn: u32, psn: u32) {
    crate::probes::retransmit(qpn, psn, crate::probes::RetryCause::SeqNak);
    inc(Hw::RcvdSeqErr);
    inc(Hw::PacketSeqErr);
}

/// The requester of QP `qpn` found the response for `psn` missing (implied NAK).
pub(crate) fn implied_nak(qpn: u32, psn: u32) {
    crate::probes::retransmit(qpn, psn, crate::probes::RetryCause::ImpliedNak);
    inc(Hw::ImpliedNakSeqErr);
}

/// The retransmission timer of QP `qpn` expired; it goes back to `psn`.
pub(crate) fn ack_timeout(qpn: u32, psn: u32) {
    crate::probes::retransmit(qpn, psn, crate::probes::RetryCause::Timeout);
    inc(Hw::LocalAckTimeoutErr);
}

/// The requester got a NAK other than a sequence error.
pub(crate) fn nak_rcvd(code: NakCode) {
    if code == NakCode::RemoteAccessError {
        inc(Hw::ReqRemoteAccessErrors);
    }
}

/// The responder sent a NAK other than a sequence error (an error NAK).
pub(crate) fn nak_sent(code: NakCode) {
    if code == NakCode::RemoteAccessError {
        inc(Hw::RespRemoteAccessErrors);
    }
}

/// A send WQE was finished with `status` by the completer (`send`: a SEND opcode).
pub(crate) fn send_wqe_done(send: bool, status: WcStatus) {
    match status {
        WcStatus::Success if send => inc(Hw::RdmaSends),
        WcStatus::RetryExcErr => inc(Hw::RetryExceededErr),
        WcStatus::RnrRetryExcErr => inc(Hw::RetryRnrExceededErr),
        _ => {}
    }
}

/// The responder built a receive completion with `status`.
pub(crate) fn recv_done(status: WcStatus) {
    if status == WcStatus::Success {
        inc(Hw::RdmaRecvs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_ordered() {
        let mut names: Vec<_> = Hw::ALL.iter().map(|c| c.name()).collect();
        assert_eq!(names.len(), N);
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), N);
        for (i, c) in Hw::ALL.iter().enumerate() {
            assert_eq!(*c as usize, i);
        }
    }

    #[test]
    fn icrc_drops_count_as_icrc_errors() {
        use crate::stats::{rx_drops, RxDrop};
        let before = get(Hw::RxIcrcEncapsulated);
        rx_drops().add(RxDrop::BadIcrc, 2);
        rx_drops().add(RxDrop::IcrcForeignId, 1);
        rx_drops().add(RxDrop::UnknownQp, 5);
        assert!(get(Hw::RxIcrcEncapsulated) - before >= 3);
        assert_eq!(get(Hw::PortXmitPackets), get(Hw::SentPkts));
    }

    #[test]
    fn partial_send_counts_bytes_in_proportion() {
        let before = (get(Hw::PortXmitData), get(Hw::SendErr));
        tx_datagrams(1, 4, 4096, true);
        assert!(get(Hw::PortXmitData) - before.0 >= 256);
        assert!(get(Hw::SendErr) - before.1 >= 3);
    }
}
