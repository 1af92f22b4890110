//! Counters and histograms, cheap enough to stay on: relaxed atomic adds on paths that already
//! make syscalls. Exported per device ([`RegStats`] in each device) and per process ([`process`]).
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::error::Errno;
use crate::mem::pin::PinPath;

/// Errnos with their own failure counter, in this order.
pub const COUNTED_ERRNOS: [Errno; 8] = [
    Errno::EINVAL,
    Errno::EFAULT,
    Errno::ENOMEM,
    Errno::EPERM,
    Errno::EOPNOTSUPP,
    Errno::EACCES,
    Errno::EBUSY,
    Errno::EOVERFLOW,
];

/// Buckets of the registration-latency histogram: bucket `i` counts latencies in
/// `[2^i, 2^(i+1))` nanoseconds; the last bucket is open-ended.
pub const LATENCY_BUCKETS: usize = 40;

/// A log2 histogram of nanoseconds. Each bucket is an independent relaxed counter.
#[derive(Debug)]
pub struct Histogram {
    /// Per-bucket counts (bucket i: [2^i, 2^(i+1)) ns).
    buckets: [AtomicU64; LATENCY_BUCKETS],
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl Histogram {
    /// Record one sample.
    pub fn record(&self, ns: u64) {
        let b = (63 - ns.max(1).leading_zeros() as usize).min(LATENCY_BUCKETS - 1);
        self.buckets[b].fetch_add(1, Relaxed);
    }
    /// Copy of the bucket counts.
    pub fn snapshot(&self) -> [u64; LATENCY_BUCKETS] {
        std::array::from_fn(|i| self.buckets[i].load(Relaxed))
    }
    /// Approximate quantile (upper bound of the bucket holding it), `q` in 0..=1.
    pub fn quantile(counts: &[u64; LATENCY_BUCKETS], q: f64) -> u64 {
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return 0;
        }
        let want = ((total as f64) * q).ceil().max(1.0) as u64;
        let mut acc = 0;
        for (i, c) in counts.iter().enumerate() {
            acc += c;
            if acc >= want {
                return 1u64 << (i + 1);
            }
        }
        1 << LATENCY_BUCKETS
    }
}

/// Registration counters. Every field is an independent relaxed counter (no cross-field
/// invariant is read atomically; snapshots are approximate while registrations run).
#[derive(Debug, Default)]
pub struct RegStats {
    /// Successful registrations.
    pub registrations: AtomicU64,
    /// Deregistrations.
    pub deregistrations: AtomicU64,
    /// Failed registrations per errno, indexed like [`COUNTED_ERRNOS`] (+1: other).
    pub failures: [AtomicU64; 9],
    /// MRs alive now.
    pub mrs_live: AtomicU64,
    /// Bytes pinned now.
    pub pinned_bytes: AtomicU64,
    /// Highest `pinned_bytes` seen.
    pub pinned_bytes_peak: AtomicU64,
    /// Translation entries in use.
    pub mtt_used: AtomicU64,
    /// Pins that went through io_uring.
    pub pins_io_uring: AtomicU64,
    /// Pins that went through mlock.
    pub pins_mlock: AtomicU64,
    /// ODP page faults served.
    pub odp_faults: AtomicU64,
    /// Registration latency (successful ones).
    pub reg_latency: Histogram,
}

/// A plain copy of [`RegStats`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Successful registrations.
    pub registrations: u64,
    /// Deregistrations.
    pub deregistrations: u64,
    /// Failures by errno name.
    pub failures: Vec<(&'static str, u64)>,
    /// MRs alive.
    pub mrs_live: u64,
    /// Bytes pinned.
    pub pinned_bytes: u64,
    /// Peak bytes pinned.
    pub pinned_bytes_peak: u64,
    /// Translation entries in use.
    pub mtt_used: u64,
    /// Pins through io_uring.
    pub pins_io_uring: u64,
    /// Pins through mlock.
    pub pins_mlock: u64,
    /// ODP faults.
    pub odp_faults: u64,
    /// Latency histogram buckets (see [`LATENCY_BUCKETS`]).
    pub reg_latency: [u64; LATENCY_BUCKETS],
}

impl Default for StatsSnapshot {
    fn default() -> Self {
        RegStats::default().snapshot()
    }
}

impl RegStats {
    /// Count a failed registration with errno `e` (the errnos of [`COUNTED_ERRNOS`] each have
    /// a counter, the rest count as "other").
    pub fn failure(&self, e: Errno) {
        let i = COUNTED_ERRNOS.iter().position(|x| *x == e).unwrap_or(8);
        self.failures[i].fetch_add(1, Relaxed);
    }

    pub(crate) fn pinned(&self, bytes: u64, path: PinPath) {
        let now = self.pinned_bytes.fetch_add(bytes, Relaxed) + bytes;
        self.pinned_bytes_peak.fetch_max(now, Relaxed);
        match path {
            PinPath::IoUring => &self.pins_io_uring,
            PinPath::Mlock => &self.pins_mlock,
        }
        .fetch_add(1, Relaxed);
    }

    pub(crate) fn unpinned(&self, bytes: u64) {
        self.pinned_bytes.fetch_sub(bytes, Relaxed);
    }

    /// Copy all counters.
    pub fn snapshot(&self) -> StatsSnapshot {
        let mut failures: Vec<(&'static str, u64)> = COUNTED_ERRNOS
            .iter()
            .enumerate()
            .map(|(i, e)| (e.name(), self.failures[i].load(Relaxed)))
            .collect();
        failures.push(("other", self.failures[8].load(Relaxed)));
        StatsSnapshot {
            registrations: self.registrations.load(Relaxed),
            deregistrations: self.deregistrations.load(Relaxed),
            failures,
            mrs_live: self.mrs_live.load(Relaxed),
            pinned_bytes: self.pinned_bytes.load(Relaxed),
            pinned_bytes_peak: self.pinned_bytes_peak.load(Relaxed),
            mtt_used: self.mtt_used.load(Relaxed),
            pins_io_uring: self.pins_io_uring.load(Relaxed),
            pins_mlock: self.pins_mlock.load(Relaxed),
            odp_faults: self.odp_faults.load(Relaxed),
            reg_latency: self.reg_latency.snapshot(),
        }
    }
}

impl StatsSnapshot {
    /// Failures with a given errno.
    pub fn failures_of(&self, e: Errno) -> u64 {
        self.failures
            .iter()
            .find(|(n, _)| *n == e.name())
            .map(|(_, c)| *c)
            .unwrap_or(0)
    }
}

/// Process-wide counters (all device instances of this process).
pub fn process() -> &'static RegStats {
    static P: std::sync::OnceLock<RegStats> = std::sync::OnceLock::new();
    P.get_or_init(RegStats::default)
}

/// Why a received packet was dropped before it could act on a QP (see
/// [`crate::net::udp::NetStats`] for each kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RxDrop {
    /// Not a well-formed RoCEv2 RC packet.
    Malformed,
    /// ICRC matching no IPv4 identification (corruption).
    BadIcrc,
    /// ICRC matching a foreign IPv4 identification only.
    IcrcForeignId,
    /// ICRC matching the ID of an mrkit GSO segment received apart from its batch.
    IcrcCutRun,
    /// No QP with the destination QPN.
    UnknownQp,
    /// Source address other than the QP's remote address.
    SrcAddr,
    /// P_Key not matching the QP's.
    Pkey,
    /// QP state that does not take the packet.
    QpState,
}

impl RxDrop {
    /// Every kind, in the order [`RxDrops::snapshot`] lists them.
    pub const ALL: [RxDrop; 8] = [
        RxDrop::Malformed,
        RxDrop::BadIcrc,
        RxDrop::IcrcForeignId,
        RxDrop::IcrcCutRun,
        RxDrop::UnknownQp,
        RxDrop::SrcAddr,
        RxDrop::Pkey,
        RxDrop::QpState,
    ];

    /// The counter's name (as in `mrkit stat` and [`crate::net::udp::NetStats`]).
    pub fn name(self) -> &'static str {
        match self {
            RxDrop::Malformed => "rx_malformed",
            RxDrop::BadIcrc => "rx_bad_icrc",
            RxDrop::IcrcForeignId => "rx_icrc_foreign_id",
            RxDrop::IcrcCutRun => "rx_icrc_cut_run",
            RxDrop::UnknownQp => "rx_unknown_qp",
            RxDrop::SrcAddr => "rx_drop_src_addr",
            RxDrop::Pkey => "rx_drop_pkey",
            RxDrop::QpState => "rx_drop_qp_state",
        }
    }
}

/// Received packets dropped by every device of the process, per [`RxDrop`] kind.
/// Independent relaxed counters (drops are rare: an add per dropped packet).
#[derive(Debug, Default)]
pub struct RxDrops {
    counts: [AtomicU64; 8],
}

impl RxDrops {
    pub(crate) fn add(&self, k: RxDrop, n: u64) {
        self.counts[k as usize].fetch_add(n, Relaxed);
    }

    /// `(counter name, count)` for every kind, in [`RxDrop::ALL`] order.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        RxDrop::ALL
            .iter()
            .map(|k| (k.name(), self.counts[*k as usize].load(Relaxed)))
            .collect()
    }
}

/// Process-wide receive drop counters (all device instances of this process).
pub fn rx_drops() -> &'static RxDrops {
    static D: std::sync::OnceLock<RxDrops> = std::sync::OnceLock::new();
    D.get_or_init(RxDrops::default)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets() {
        let h = Histogram::default();
        h.record(0);
        h.record(1500);
        h.record(1500);
        let s = h.snapshot();
        assert_eq!(s[0], 1);
        assert_eq!(s[10], 2);
        assert_eq!(Histogram::quantile(&s, 0.5), 2048);
    }
}
