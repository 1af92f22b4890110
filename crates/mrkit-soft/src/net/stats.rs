//! Link counters of a device (datagrams sent and received, drops by reason).
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};

use super::sockio;

/// Link counters of a device. Independent relaxed counters.
///
/// Every dropped datagram is counted here and, for `mrkit stat`, in the process-wide
/// [`crate::stats::rx_drops`].
#[derive(Debug, Default)]
pub struct NetStats {
    /// Datagrams sent.
    pub tx_datagrams: AtomicU64,
    /// Send errors.
    pub send_errors: AtomicU64,
    /// Datagrams received. Written only under the device's receive lock (one writer: a
    /// load and a store, no locked read-modify-write).
    pub rx_datagrams: AtomicU64,
    /// Dropped: malformed (truncated, bad version, unknown opcode, bad pad ...).
    pub rx_malformed: AtomicU64,
    /// Dropped: the ICRC matches no IPv4 identification at all (a corrupted packet).
    pub rx_bad_icrc: AtomicU64,
    /// Dropped: the ICRC does not match the IPv4 identification expected, but another one,
    /// and not one an mrkit sender's GSO segment carries: a foreign peer's packet, which
    /// `MRKIT_ICRC_IPV4=solve` accepts (or, with probability 2^-15, a corrupted one).
    pub rx_icrc_foreign_id: AtomicU64,
    /// Dropped: the ICRC matches ID 1..63 with DF, an mrkit sender's GSO segment that
    /// reached the socket cut apart from its batch (queued while the socket's receive offload
    /// was off), whose ID the receiver cannot know; RC retransmits it.
    pub rx_icrc_cut_run: AtomicU64,
    /// Dropped: no such QP.
    pub rx_unknown_qp: AtomicU64,
    /// Dropped: the source address is not the QP's remote address.
    pub rx_drop_src_addr: AtomicU64,
    /// Dropped: the P_Key does not match the QP's (what hardware counts in the port's
    /// `bad_pkey_cntr`).
    pub rx_drop_pkey: AtomicU64,
    /// Dropped: the QP's state does not take the packet (RESET, INIT, ERR; a request before
    /// RTR, a response before RTS).
    pub rx_drop_qp_state: AtomicU64,
}

/// A copy of [`NetStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetStatsSnapshot {
    /// Datagrams sent.
    pub tx_datagrams: u64,
    /// Send errors.
    pub send_errors: u64,
    /// Datagrams received.
    pub rx_datagrams: u64,
    /// Dropped as malformed.
    pub rx_malformed: u64,
    /// Dropped for a bad ICRC (no IPv4 ID matches).
    pub rx_bad_icrc: u64,
    /// Dropped: the ICRC matches a foreign IPv4 identification.
    pub rx_icrc_foreign_id: u64,
    /// Dropped: a GSO segment cut apart from its batch.
    pub rx_icrc_cut_run: u64,
    /// Dropped for an unknown QP.
    pub rx_unknown_qp: u64,
    /// Dropped: wrong source address.
    pub rx_drop_src_addr: u64,
    /// Dropped: wrong P_Key.
    pub rx_drop_pkey: u64,
    /// Dropped: the QP's state.
    pub rx_drop_qp_state: u64,
}

/// GSO segments one send may carry on Linux: a mismatching ID below this with DF is taken
/// for an mrkit sender's cut-apart GSO segment.
const GSO_SEGMENTS_MAX: u16 = sockio::MAX_GSO_SEGMENTS as u16;

impl NetStats {
    /// Copy the counters.
    pub fn snapshot(&self) -> NetStatsSnapshot {
        use std::sync::atomic::Ordering::Relaxed;
        NetStatsSnapshot {
            tx_datagrams: self.tx_datagrams.load(Relaxed),
            send_errors: self.send_errors.load(Relaxed),
            rx_datagrams: self.rx_datagrams.load(Relaxed),
            rx_malformed: self.rx_malformed.load(Relaxed),
            rx_bad_icrc: self.rx_bad_icrc.load(Relaxed),
            rx_icrc_foreign_id: self.rx_icrc_foreign_id.load(Relaxed),
            rx_icrc_cut_run: self.rx_icrc_cut_run.load(Relaxed),
            rx_unknown_qp: self.rx_unknown_qp.load(Relaxed),
            rx_drop_src_addr: self.rx_drop_src_addr.load(Relaxed),
            rx_drop_pkey: self.rx_drop_pkey.load(Relaxed),
            rx_drop_qp_state: self.rx_drop_qp_state.load(Relaxed),
        }
    }

    /// The counter of one kind of drop.
    fn counter(&self, k: crate::stats::RxDrop) -> &AtomicU64 {
        use crate::stats::RxDrop;
        match k {
            RxDrop::Malformed => &self.rx_malformed,
            RxDrop::BadIcrc => &self.rx_bad_icrc,
            RxDrop::IcrcForeignId => &self.rx_icrc_foreign_id,
            RxDrop::IcrcCutRun => &self.rx_icrc_cut_run,
            RxDrop::UnknownQp => &self.rx_unknown_qp,
            RxDrop::SrcAddr => &self.rx_drop_src_addr,
            RxDrop::Pkey => &self.rx_drop_pkey,
            RxDrop::QpState => &self.rx_drop_qp_state,
        }
    }

    /// Count `n` packets dropped for `k`, here and process-wide.
    pub(crate) fn count(&self, k: crate::stats::RxDrop, n: u64) {
        self.counter(k).fetch_add(n, Ordering::Relaxed);
        crate::stats::rx_drops().add(k, n);
    }

    /// Count `n` datagrams the receive path dropped for `why`. Returns whether they were GSO
    /// segments cut apart from their batch (the receiver then turns GRO back on).
    pub(crate) fn dropped(&self, why: super::DatagramDrop, n: u64) -> bool {
        use super::DatagramDrop;
        use crate::stats::RxDrop;
        match why {
            DatagramDrop::Malformed => self.count(RxDrop::Malformed, n),
            DatagramDrop::BadIcrc => self.count(RxDrop::BadIcrc, n),
            DatagramDrop::IcrcIpv4Id { id, df } => {
                if df && (1..GSO_SEGMENTS_MAX).contains(&id) {
                    self.count(RxDrop::IcrcCutRun, n);
                    return true;
                }
                self.count(RxDrop::IcrcForeignId, n);
            }
            DatagramDrop::UnknownQp => self.count(RxDrop::UnknownQp, n),
        }
        false
    }
}
