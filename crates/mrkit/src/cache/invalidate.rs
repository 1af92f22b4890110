//! Invalidation: explicit ([`RegCache::invalidate`]) and from the userfaultfd monitor's
//! queue ([`RegCache::sync_monitor`]); dead entries leave the index under the write lock.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::entry::{retire_all, Entry};
use super::index::IntervalIndex;
use super::stats::inc;
use super::{monitor, RegCache};

impl RegCache {
    /// Invalidate every entry overlapping `[addr, addr+len)`: they leave the cache at once;
    /// entries in use are deregistered when their last handle drops. Returns how many.
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags, Context};
    /// # let pd = Context::open_default().unwrap().alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let mut v = vec![0u8; 4096];
    /// drop(cache.get_mut(&mut v, AccessFlags::LOCAL_WRITE).unwrap());
    /// assert_eq!(cache.invalidate(v.as_ptr() as u64, 4096), 1);
    /// assert!(cache.is_empty());
    /// ```
    pub fn invalidate(&self, addr: u64, len: u64) -> usize {
        let end = addr.saturating_add(len);
        let dead = {
            let mut ix = self.inner.index.write();
            self.invalidate_locked(&mut ix, &[(addr, end)])
        };
        self.finish_invalidation(dead)
    }

    /// Remove and kill every entry overlapping one of `ranges`. Runs under the write lock so
    /// a lookup never sees a range as "no longer pending" before its entries are dead.
    pub(super) fn invalidate_locked(
        &self,
        ix: &mut IntervalIndex<Arc<Entry>>,
        ranges: &[(u64, u64)],
    ) -> Vec<Arc<Entry>> {
        let mut dead = Vec::new();
        for &(addr, end) in ranges {
            let ids: Vec<(u64, u64)> = ix
                .overlapping(addr, end, false)
                .map(|(s, _, id, _)| (s, id))
                .collect();
            for (s, id) in ids {
                if let Some(x) = ix.remove(s, id) {
                    // Dead under the lock: a publisher (which checks under the lock) and every
                    // hit (which checks after taking its count) see it.
                    if x.kill() > 0 {
                        inc(&self.inner.shared.c.invalidated_in_use);
                    }
                    dead.push(x);
                }
            }
        }
        dead
    }

    /// Wake waiters; drop the index's references outside the lock (idle entries are
    /// deregistered here, entries in use at their last handle drop).
    pub(super) fn finish_invalidation(&self, dead: Vec<Arc<Entry>>) -> usize {
        let n = dead.len();
        self.inner
            .shared
            .c
            .invalidations
            .fetch_add(n as u64, Ordering::Relaxed);
        for x in &dead {
            x.wake();
        }
        self.tls_forget(&dead);
        let mut dead = dead;
        dead.append(&mut self.inner.unfenced.lock());
        retire_all(dead);
        n
    }

    /// Apply queued monitor invalidations; wait out an event being delivered. Returns the
    /// monitor sequence read before the queue was drained: every event it counts has had
    /// its entries killed once the index lock has been taken after this call (a drain by
    /// another thread applies under the write lock). Odd: an event was being delivered (do
    /// not let a thread table catch up to it).
    pub(super) fn sync_monitor(&self) -> u64 {
        if self.inner.shared.monitor.is_none() {
            return 0;
        }
        if !monitor::wait_quiescent(Duration::from_secs(1)) {
            tracing::warn!("userfaultfd monitor stalled for 1 s; dropping every cached entry");
            self.invalidate(0, u64::MAX);
        }
        let mseq = monitor::seq();
        if self.inner.pending.is_nonempty() {
            // Drain and apply under one write lock (see `invalidate_locked`).
            let dead = {
                let mut ix = self.inner.index.write();
                let ranges = self.inner.pending.drain();
                self.invalidate_locked(&mut ix, &ranges)
            };
            self.finish_invalidation(dead);
        }
        mseq
    }
}
