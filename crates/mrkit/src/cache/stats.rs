//! Statistics: the shared counters, [`CacheStats`], and the `"cache"` section of
//! `mrkit stat`.

use std::sync::atomic::{AtomicU64, Ordering};

use super::RegCache;

/// Counters (snapshot).
///
/// ```
/// # use mrkit::cache::{CacheConfig, RegCache};
/// # use mrkit::{AccessFlags, Context};
/// # let pd = Context::open_default().unwrap().alloc_pd().unwrap();
/// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
/// let v = vec![1u8; 4096];
/// for _ in 0..3 {
///     drop(cache.get_ref(&v, AccessFlags::empty()).unwrap());
/// }
/// let st = cache.stats();
/// assert_eq!((st.misses, st.hits, st.entries), (1, 2, 1));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups served by an existing registration (per-thread fast path + shared index).
    pub hits: u64,
    /// Of `hits`, served by the per-thread cache.
    pub fast_hits: u64,
    /// Lookups that registered.
    pub misses: u64,
    /// Lookups that waited for a concurrent miss of the same range.
    pub single_flight_waits: u64,
    /// Entries absorbed by a merge.
    pub merges: u64,
    /// Registrations split into several MRs.
    pub splits: u64,
    /// Idle entries evicted for limits or ENOMEM.
    pub evictions: u64,
    /// Idle entries released by the idle scanner.
    pub idle_releases: u64,
    /// Entries invalidated (explicit or monitor).
    pub invalidations: u64,
    /// Of `invalidations`, entries that were in use (retired at their last drop).
    pub invalidated_in_use: u64,
    /// Registrations thrown away because their range was invalidated while registering, and
    /// hits refused because the entry died under them.
    pub stale_rejects: u64,
    /// MRs registered by the cache.
    pub registrations: u64,
    /// MRs deregistered by the cache.
    pub deregistrations: u64,
    /// Bytes registered now (cached and uncached entries).
    pub bytes_registered: u64,
    /// Entries in the index now.
    pub entries: u64,
    /// Registrations returned uncached (limits unreachable, monitor could not attach).
    pub uncached: u64,
    /// Of `uncached`, because the monitor could not attach the range.
    pub unmonitored: u64,
    /// Fallback: evict-all-idle then retry after ENOMEM.
    pub fallback_evict_retry: u64,
    /// Fallback: widened shape failed, retried page-rounded.
    pub fallback_shrink: u64,
    /// Fallback: served by the bounce pool.
    pub fallback_bounce: u64,
    /// Monitor events delivered to this cache.
    pub monitor_events: u64,
    /// Pending-set merges forced by its capacity.
    pub pending_overflow_merges: u64,
}

#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) hits_slow: AtomicU64,
    pub(super) misses: AtomicU64,
    pub(super) single_flight_waits: AtomicU64,
    pub(super) merges: AtomicU64,
    pub(super) splits: AtomicU64,
    pub(super) evictions: AtomicU64,
    pub(super) idle_releases: AtomicU64,
    pub(super) invalidations: AtomicU64,
    pub(super) invalidated_in_use: AtomicU64,
    pub(super) stale_rejects: AtomicU64,
    pub(super) registrations: AtomicU64,
    pub(super) deregistrations: AtomicU64,
    pub(super) bytes_registered: AtomicU64,
    pub(super) uncached: AtomicU64,
    pub(super) unmonitored: AtomicU64,
    pub(super) fallback_evict_retry: AtomicU64,
    pub(super) fallback_shrink: AtomicU64,
    pub(super) fallback_bounce: AtomicU64,
}

pub(super) fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl RegCache {
    /// A snapshot of the counters ([`CacheStats`]; also the `"cache"` section of
    /// `mrkit stat`).
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let buf = Buffer::new(4096).unwrap();
    /// drop(cache.get_ref(buf.as_slice(), A::empty()).unwrap()); // a miss: registers
    /// drop(cache.get_ref(buf.as_slice(), A::empty()).unwrap()); // a hit
    /// let s = cache.stats();
    /// assert_eq!((s.misses, s.hits, s.registrations), (1, 1, 1));
    /// assert_eq!((s.entries, s.bytes_registered), (1, 4096));
    /// ```
    pub fn stats(&self) -> CacheStats {
        // Evicted entries waiting for a shared membarrier are retired first: the figures
        // then count them as deregistered.
        self.flush_unfenced();
        let c = &self.inner.shared.c;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let fast: u64 = self.inner.threads.lock().iter().map(|t| l(&t.hits)).sum();
        let ix = self.inner.index.read();
        CacheStats {
            hits: fast + l(&c.hits_slow),
            fast_hits: fast,
            misses: l(&c.misses),
            single_flight_waits: l(&c.single_flight_waits),
            merges: l(&c.merges),
            splits: l(&c.splits),
            evictions: l(&c.evictions),
            idle_releases: l(&c.idle_releases),
            invalidations: l(&c.invalidations),
            invalidated_in_use: l(&c.invalidated_in_use),
            stale_rejects: l(&c.stale_rejects),
            registrations: l(&c.registrations),
            deregistrations: l(&c.deregistrations),
            bytes_registered: l(&c.bytes_registered),
            entries: ix.len() as u64,
            uncached: l(&c.uncached),
            unmonitored: l(&c.unmonitored),
            fallback_evict_retry: l(&c.fallback_evict_retry),
            fallback_shrink: l(&c.fallback_shrink),
            fallback_bounce: l(&c.fallback_bounce),
            monitor_events: l(&self.inner.pending.events),
            pending_overflow_merges: l(&self.inner.pending.overflow_merges),
        }
    }
}

/// `mrkit stat` section `"cache"`: `{"caches": [{"id", "monitored", <CacheStats fields>},
/// ...]}` for every live cache of the process, listed through weak references and read
/// through the cache's gate (the exporter never keeps a cache, or its registrations, alive,
/// and a cache dropped during a snapshot is torn down on the thread that dropped it).
pub(super) mod export {
    use std::sync::{Arc, Weak};

    use parking_lot::Mutex;
    use serde_json::{json, Value};

    use super::super::gate::Gate;
    use super::super::Inner;

    type Listed = (Weak<Inner>, Arc<Gate>);

    static LIVE: Mutex<Vec<Listed>> = Mutex::new(Vec::new());

    pub(in crate::cache) fn add(c: &Arc<Inner>) {
        {
            let mut l = LIVE.lock();
            l.retain(|(w, g)| w.strong_count() > 0 && !g.is_closed());
            l.push((Arc::downgrade(c), c.gate.clone()));
        }
        crate::stat_export::register_source("cache", source);
    }

    pub(super) fn source() -> Value {
        // Listed outside the list lock: a pass may wait for a cache's last user.
        let listed: Vec<Listed> = LIVE.lock().clone();
        let caches: Vec<Value> = listed
            .iter()
            .filter_map(|(w, g)| g.with(w, |c| (c.inner.id, c.is_monitored(), c.stats())))
            .map(|(id, monitored, s)| {
                json!({
                    "id": id,
                    "monitored": monitored,
                    "hits": s.hits,
                    "fast_hits": s.fast_hits,
                    "misses": s.misses,
                    "single_flight_waits": s.single_flight_waits,
                    "merges": s.merges,
                    "splits": s.splits,
                    "evictions": s.evictions,
                    "idle_releases": s.idle_releases,
                    "invalidations": s.invalidations,
                    "invalidated_in_use": s.invalidated_in_use,
                    "stale_rejects": s.stale_rejects,
                    "registrations": s.registrations,
                    "deregistrations": s.deregistrations,
                    "bytes_registered": s.bytes_registered,
                    "entries": s.entries,
                    "uncached": s.uncached,
                    "unmonitored": s.unmonitored,
                    "fallback_evict_retry": s.fallback_evict_retry,
                    "fallback_shrink": s.fallback_shrink,
                    "fallback_bounce": s.fallback_bounce,
                    "monitor_events": s.monitor_events,
                    "pending_overflow_merges": s.pending_overflow_merges,
                })
            })
            .collect();
        json!({ "caches": caches })
    }
}
