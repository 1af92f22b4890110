//! Statistics of the rdma-core provider's devices, exported with the process's other mrkit
//! statistics (the one exporter of [`crate::stat_export`], section `rdma_core` of the
//! snapshot; `mrkit stat` lists each device as `rdma-core:NAME`).
//!
//! Per device: registrations, deregistrations, failures by errno, bytes registered (in total
//! and live), a histogram of the time the library's `ibv_reg_mr` took, and the live MRs with
//! what the provider recorded at registration. libibverbs cannot say more: page size, pinned
//! bytes, pinning method and the registration's phases are the kernel driver's (listed under
//! `unknown` in every device section).
//!
//! Cost: relaxed atomic adds and two reads of a cheap clock (`ticks.rs`) per registration; the live-MR list is the
//! provider's own MR table, read under its lock only when a snapshot is taken.
#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use mrkit_soft::stats::{Histogram, RegStats, LATENCY_BUCKETS};
use mrkit_soft::{Errno, MrInfo};
use serde_json::{json, Map, Value};

/// What one open device's counters are kept in.
///
/// The counters of successful registrations and deregistrations ([`Counts`]) live with the
/// provider's MR table, under the lock that the table takes anyway on those paths: plain
/// additions, no atomic read-modify-write per counter. Failures (off the fast path) are relaxed
/// atomics here.
#[derive(Debug, Default)]
pub(crate) struct DeviceStats {
    /// `rdma-core:NAME`.
    pub(crate) device: String,
    /// The library it was opened from.
    pub(crate) library: String,
    /// Failed registrations by errno (only the failure counters of [`RegStats`] are used).
    pub(crate) failures: RegStats,
}

impl DeviceStats {
    /// A failed registration.
    pub(crate) fn failed(&self, e: Errno) {
        self.failures.failure(e);
    }
}

/// Counters kept under the MR table's lock (see [`DeviceStats`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Counts {
    pub(crate) registrations: u64,
    pub(crate) deregistrations: u64,
    /// Bytes of every successful registration (a re-registration that changes the range
    /// counts its new length here and its old one in `bytes_deregistered`).
    pub(crate) bytes_registered: u64,
    pub(crate) bytes_deregistered: u64,
    /// log2 histogram of the library's `ibv_reg_mr` time (ns), as mrkit0's.
    pub(crate) latency: [u64; LATENCY_BUCKETS],
}

impl Default for Counts {
    fn default() -> Self {
        Counts {
            registrations: 0,
            deregistrations: 0,
            bytes_registered: 0,
            bytes_deregistered: 0,
            latency: [0; LATENCY_BUCKETS],
        }
    }
}

impl Counts {
    /// A successful registration of `len` bytes that took `took_ns` in the library.
    #[inline]
    pub(crate) fn registered(&mut self, len: u64, took_ns: u64) {
        self.registrations += 1;
        self.bytes_registered = self.bytes_registered.wrapping_add(len);
        let b = (63 - took_ns.max(1).leading_zeros() as usize).min(LATENCY_BUCKETS - 1);
        self.latency[b] += 1;
    }
    /// A deregistration of `len` bytes.
    #[inline]
    pub(crate) fn deregistered(&mut self, len: u64) {
        self.deregistrations += 1;
        self.bytes_deregistered = self.bytes_deregistered.wrapping_add(len);
    }
    /// A re-registration moved an MR from `old` to `new` bytes.
    pub(crate) fn rereg_translation(&mut self, old: u64, new: u64) {
        self.bytes_deregistered = self.bytes_deregistered.wrapping_add(old);
        self.bytes_registered = self.bytes_registered.wrapping_add(new);
    }
}

/// One live MR as the provider recorded it.
#[derive(Debug, Clone)]
pub(crate) struct LiveMr {
    pub(crate) info: MrInfo,
    pub(crate) age: Duration,
    /// How long `ibv_reg_mr` took.
    pub(crate) reg: Duration,
}

/// A device's live MRs (at most `max`), their number and the counters, read under the MR
/// table's lock (`None` once the device is closed).
pub(crate) type ListFn = Box<dyn Fn(usize) -> Option<(Vec<LiveMr>, usize, Counts)> + Send + Sync>;

struct Entry {
    stats: Weak<DeviceStats>,
    list: ListFn,
}

fn registry() -> &'static Mutex<Vec<Entry>> {
    static R: OnceLock<Mutex<Vec<Entry>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(Vec::new()))
}

/// Add a device (its entry goes when `stats` is dropped with the provider) and make sure the
/// section is in the snapshot and the process exports.
pub(crate) fn track(stats: &Arc<DeviceStats>, list: ListFn) {
    let mut g = registry().lock().unwrap_or_else(|e| e.into_inner());
    g.retain(|e| e.stats.strong_count() > 0);
    g.push(Entry {
        stats: Arc::downgrade(stats),
        list,
    });
    drop(g);
    crate::stat_export::register_source("rdma_core", section);
}

/// The `rdma_core` section: `{"devices": [...]}`, one entry per open device.
fn section() -> Value {
    let g = registry().lock().unwrap_or_else(|e| e.into_inner());
    let devices: Vec<Value> = g
        .iter()
        .filter_map(|e| {
            let s = e.stats.upgrade()?;
            let (mrs, total, counts) = (e.list)(crate::stat_export::MAX_LISTED_MRS)?;
            Some(device_json(&s, &mrs, total, &counts))
        })
        .collect();
    json!({ "devices": devices })
}

fn device_json(s: &DeviceStats, mrs: &[LiveMr], total: usize, c: &Counts) -> Value {
    let failures: Map<String, Value> = s
        .failures
        .snapshot()
        .failures
        .iter()
        .map(|(n, c)| (n.to_string(), json!(c)))
        .collect();
    let count: u64 = c.latency.iter().sum();
    let mrs: Vec<Value> = mrs.iter().map(mr_json).collect();
    json!({
        "device": s.device,
        "provider": super::PROVIDER,
        "library": s.library,
        "registrations": c.registrations,
        "deregistrations": c.deregistrations,
        "failures": failures,
        "mrs_live": total,
        "bytes_registered": c.bytes_registered,
        "bytes_live": c.bytes_registered.wrapping_sub(c.bytes_deregistered),
        "latency_ns": {
            "what": "the library's ibv_reg_mr",
            "count": count,
            "p50": Histogram::quantile(&c.latency, 0.5),
            "p99": Histogram::quantile(&c.latency, 0.99),
            "buckets": c.latency.to_vec(),
        },
        "mrs": {"total": total, "list": mrs},
        "unknown": ["page_size", "page_count", "pinned_bytes", "pin_path", "reg_phases"],
    })
}

/// One live MR with the keys of mrkit0's (`mrkit stat --mrs`); what libibverbs does not say is
/// 0 (`page_size`, `page_count`, `pinned_bytes`) and the timing has only `total`.
fn mr_json(m: &LiveMr) -> Value {
    let i = &m.info;
    json!({
        "lkey": i.lkey,
        "rkey": i.rkey,
        "pd": i.pd,
        "addr": i.addr,
        "length": i.length,
        "iova": i.iova,
        "access": i.access.names(),
        "access_bits": i.access.bits(),
        "kind": format!("{:?}", i.kind),
        "page_size": 0,
        "page_count": 0,
        "pinned_bytes": 0,
        "bound_mws": i.bound_mws,
        "age_ms": m.age.as_millis() as u64,
        "reg_timing_ns": {"total": m.reg.as_nanos() as u64},
    })
}
