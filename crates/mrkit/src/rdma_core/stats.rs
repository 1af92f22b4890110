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
//! Cost: relaxed atomic adds and two clock reads per registration; the live-MR list is the
//! provider's own MR table, read under its lock only when a snapshot is taken.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use mrkit_soft::stats::{Histogram, RegStats};
use mrkit_soft::{Errno, MrInfo};
use serde_json::{json, Map, Value};

/// The counters of one open device.
#[derive(Debug, Default)]
pub(crate) struct DeviceStats {
    /// `rdma-core:NAME`.
    pub(crate) device: String,
    /// The library it was opened from.
    pub(crate) library: String,
    /// Registrations, deregistrations, failures, live MRs, the latency histogram.
    pub(crate) reg: RegStats,
    /// Bytes of all successful registrations.
    pub(crate) bytes_registered: AtomicU64,
    /// Bytes of the live MRs.
    pub(crate) bytes_live: AtomicU64,
}

impl DeviceStats {
    /// A successful registration of `len` bytes that took `took` in the library.
    pub(crate) fn registered(&self, len: u64, took: Duration) {
        self.reg.registrations.fetch_add(1, Relaxed);
        self.reg.mrs_live.fetch_add(1, Relaxed);
        self.bytes_registered.fetch_add(len, Relaxed);
        self.bytes_live.fetch_add(len, Relaxed);
        self.reg
            .reg_latency
            .record(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX));
    }
    /// A failed registration.
    pub(crate) fn failed(&self, e: Errno) {
        self.reg.failure(e);
    }
    /// A re-registration moved an MR from `old` to `new` bytes.
    pub(crate) fn rereg_translation(&self, old: u64, new: u64) {
        self.bytes_live.fetch_sub(old, Relaxed);
        self.bytes_live.fetch_add(new, Relaxed);
    }
    /// A deregistration of `len` bytes.
    pub(crate) fn deregistered(&self, len: u64) {
        self.reg.deregistrations.fetch_add(1, Relaxed);
        self.reg.mrs_live.fetch_sub(1, Relaxed);
        self.bytes_live.fetch_sub(len, Relaxed);
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

/// Lists a device's live MRs (at most `max`) and their number.
pub(crate) type ListFn = Box<dyn Fn(usize) -> (Vec<LiveMr>, usize) + Send + Sync>;

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
        .filter_map(|e| e.stats.upgrade().map(|s| device_json(&s, &e.list)))
        .collect();
    json!({ "devices": devices })
}

fn device_json(s: &DeviceStats, list: &ListFn) -> Value {
    let snap = s.reg.snapshot();
    let failures: Map<String, Value> = snap
        .failures
        .iter()
        .map(|(n, c)| (n.to_string(), json!(c)))
        .collect();
    let count: u64 = snap.reg_latency.iter().sum();
    let (mrs, total) = list(crate::stat_export::MAX_LISTED_MRS);
    let mrs: Vec<Value> = mrs.iter().map(mr_json).collect();
    json!({
        "device": s.device,
        "provider": super::PROVIDER,
        "library": s.library,
        "registrations": snap.registrations,
        "deregistrations": snap.deregistrations,
        "failures": failures,
        "mrs_live": snap.mrs_live,
        "bytes_registered": s.bytes_registered.load(Relaxed),
        "bytes_live": s.bytes_live.load(Relaxed),
        "latency_ns": {
            "what": "the library's ibv_reg_mr",
            "count": count,
            "p50": Histogram::quantile(&snap.reg_latency, 0.5),
            "p99": Histogram::quantile(&snap.reg_latency, 0.99),
            "buckets": snap.reg_latency.to_vec(),
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
