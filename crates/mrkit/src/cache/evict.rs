//! Limits, eviction and idle release: room for a new entry under `max_entries` /
//! `max_bytes` (approximate LRU), the idle scanner, and [`RegCache::flush_idle`].

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::entry::{retire_all, Entry};
use super::index::IntervalIndex;
use super::stats::inc;
use super::RegCache;

impl RegCache {
    pub(super) fn tick(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.inner.epoch).as_millis() as u64
    }

    /// Evict idle entries (LRU first) until `extra` more bytes and one more entry fit.
    /// Returns whether they fit. Caller holds the write lock; victims are deregistered by the
    /// caller after unlocking.
    pub(super) fn make_room(
        &self,
        ix: &mut IntervalIndex<Arc<Entry>>,
        extra: u64,
        victims: &mut Vec<Arc<Entry>>,
    ) -> bool {
        let cfg = &self.inner.cfg;
        let fits = |ix: &IntervalIndex<Arc<Entry>>| {
            ix.len() < cfg.max_entries && ix.bytes() + extra <= cfg.max_bytes
        };
        if fits(ix) {
            return true;
        }
        if extra > cfg.max_bytes || cfg.max_entries == 0 {
            return false;
        }
        for (_, s, id) in self.idle_by_age(ix, usize::MAX) {
            if fits(ix) {
                break;
            }
            if let Some(x) = take_if_idle(ix, s, id) {
                inc(&self.inner.shared.c.evictions);
                victims.push(x);
            }
        }
        fits(ix)
    }

    /// The idle entries (idle since, start, id), least recently used first (CLOCK: an entry
    /// used since the last look starts a new idle period now), at least the `oldest` of them
    /// in order (all with `usize::MAX`; the rest follow in no order).
    fn idle_by_age(&self, ix: &IntervalIndex<Arc<Entry>>, oldest: usize) -> Vec<(u64, u64, u64)> {
        let now = self.tick(Instant::now());
        let mut cands: Vec<(u64, u64, u64)> = ix
            .iter()
            .filter(|(_, _, _, x)| x.ready().is_some() && x.idle_in_index() && !x.is_dead())
            .map(|(s, _, id, x)| {
                if x.leases.take_touched() {
                    x.idle_since.store(now, Ordering::Relaxed);
                }
                (x.idle_since.load(Ordering::Relaxed), s, id)
            })
            .collect();
        if oldest >= cands.len() {
            cands.sort_unstable();
        } else if oldest > 0 {
            cands.select_nth_unstable(oldest - 1);
            cands[..oldest].sort_unstable();
        }
        cands
    }

    /// The device refused a registration for lack of resources (`ENOMEM`, `EAGAIN`: its MR
    /// limit, memlock): evict the least recently used idle entries, a share that grows with
    /// each `round` of the same lookup — 1/64 of them, then 1/8, then all (at least one) —
    /// so that a working set at the device's limit loses its oldest entries, as at
    /// `max_entries`, not all of them at once. Earlier misses' victims still waiting for a
    /// barrier go too. Returns how many registrations were let go of (both kinds).
    pub(super) fn evict_for_device_limit(&self, round: u32) -> usize {
        let mut victims = std::mem::take(&mut *self.inner.unfenced.lock());
        let earlier = victims.len();
        {
            let mut ix = self.inner.index.write();
            let idle = ix
                .iter()
                .filter(|(_, _, _, x)| x.ready().is_some() && x.idle_in_index() && !x.is_dead())
                .count();
            let share = match round {
                0 => idle / 64,
                1 => idle / 8,
                _ => idle,
            }
            .max(1);
            for (_, s, id) in self.idle_by_age(&ix, share).into_iter().take(share) {
                victims.extend(take_if_idle(&mut ix, s, id));
            }
        }
        let all = victims.len();
        // Relaxed: a statistic (the earlier victims were counted when evicted).
        self.inner
            .shared
            .c
            .evictions
            .fetch_add((all - earlier) as u64, Ordering::Relaxed);
        retire_all(victims);
        all
    }

    /// Evict up to `max` idle entries (all with `usize::MAX`); with `older_than`, only those
    /// idle since before that cache-clock tick (the idle scanner). Returns how many.
    pub(super) fn evict_idle(&self, max: usize, older_than: Option<u64>) -> usize {
        // Earlier misses' victims go too (the ENOMEM fallback and the idle scanner come here).
        let mut victims = std::mem::take(&mut *self.inner.unfenced.lock());
        let earlier = victims.len();
        {
            let mut ix = self.inner.index.write();
            let cand: Vec<(u64, u64)> = ix
                .iter()
                .filter(|(_, _, _, x)| x.ready().is_some() && x.idle_in_index() && !x.is_dead())
                .filter(|(_, _, _, x)| match older_than {
                    None => true,
                    Some(cut) => x.idle_since.load(Ordering::Relaxed) <= cut,
                })
                .map(|(s, _, id, _)| (s, id))
                .take(max)
                .collect();
            for (s, id) in cand {
                victims.extend(take_if_idle(&mut ix, s, id));
            }
        }
        let n = victims.len() - earlier;
        let c = &self.inner.shared.c;
        let counter = if older_than.is_some() {
            &c.idle_releases
        } else {
            &c.evictions
        };
        counter.fetch_add(n as u64, Ordering::Relaxed);
        retire_all(victims);
        n
    }

    /// Release entries idle for longer than the configured `idle_timeout` at `now`
    /// (CLOCK-style: an entry used since the previous scan starts a new idle period).
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use mrkit::cache::{CacheConfig, RegCache};
    /// use mrkit::{AccessFlags, Context};
    /// let pd = Context::open_default().unwrap().alloc_pd().unwrap();
    /// let cfg = CacheConfig { idle_timeout: Duration::from_millis(10), ..Default::default() };
    /// let cache = RegCache::new(&pd, cfg).unwrap();
    /// let v = vec![0u8; 4096];
    /// drop(cache.get_ref(&v, AccessFlags::empty()).unwrap());
    /// cache.scan_idle(Instant::now()); // used since the last scan: a new idle period starts
    /// assert_eq!(cache.scan_idle(Instant::now() + Duration::from_secs(1)), 1);
    /// ```
    pub fn scan_idle(&self, now: Instant) -> usize {
        let t = self.tick(now);
        {
            let ix = self.inner.index.read();
            for (_, _, _, x) in ix.iter() {
                if x.leases.take_touched() {
                    x.idle_since.store(t, Ordering::Relaxed);
                }
            }
        }
        let timeout = self.inner.cfg.idle_timeout.as_millis() as u64;
        match t.checked_sub(timeout) {
            Some(cut) => self.evict_idle(usize::MAX, Some(cut)),
            None => 0,
        }
    }

    /// Start a background thread calling [`scan_idle`](Self::scan_idle) every `interval`; it
    /// stops when the returned guard or the cache is dropped.
    ///
    /// ```
    /// use std::time::Duration;
    /// use mrkit::cache::{CacheConfig, RegCache};
    /// let pd = mrkit::Context::open_default().unwrap().alloc_pd().unwrap();
    /// let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let scanner = cache.start_idle_scanner(Duration::from_secs(10));
    /// drop(scanner); // stops and joins the thread
    /// ```
    pub fn start_idle_scanner(&self, interval: Duration) -> IdleScanner {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let weak = Arc::downgrade(&self.inner);
        let gate = self.inner.gate.clone();
        let th = std::thread::Builder::new()
            .name("mrkit-cache-idle".into())
            .spawn(move || loop {
                match rx.recv_timeout(interval) {
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                    _ => return,
                }
                // A pass never holds the cache past its last user (see `gate`).
                if gate.with(&weak, |c| c.scan_idle(Instant::now())).is_none() {
                    return;
                }
            })
            .expect("spawn idle scanner");
        IdleScanner {
            stop: Some(tx),
            thread: Some(th),
        }
    }

    /// Retire the entries a miss evicted (killed under the index lock). One whose kill waits
    /// for a membarrier (a lease of another live thread; a few microseconds on a VM) is kept
    /// for later, so that up to [`UNFENCED_BATCH`] evictions share one: its registration
    /// stays until then (or until the next invalidation, eviction round, idle scan, `stats`
    /// or cache drop), beyond the limits by at most that many entries.
    pub(super) fn retire_victims(&self, victims: Vec<Arc<Entry>>) {
        let (later, now): (Vec<_>, Vec<_>) =
            victims.into_iter().partition(|x| x.leases.awaits_barrier());
        retire_all(now);
        if later.is_empty() {
            return;
        }
        let batch = {
            let mut u = self.inner.unfenced.lock();
            u.extend(later);
            if u.len() >= UNFENCED_BATCH {
                std::mem::take(&mut *u)
            } else {
                Vec::new()
            }
        };
        retire_all(batch);
    }

    /// Retire every evicted entry kept for a shared membarrier ([`Self::retire_victims`]).
    pub(super) fn flush_unfenced(&self) {
        let v = std::mem::take(&mut *self.inner.unfenced.lock());
        retire_all(v);
    }

    /// Evict every idle entry now, and detach from the userfaultfd monitor every page range
    /// no cache uses any more (kept attached to make later misses cheap; see the module docs).
    /// Returns how many entries it evicted; entries with a live handle stay.
    ///
    /// ```
    /// use mrkit::cache::{CacheConfig, RegCache};
    /// use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let (a, b) = (Buffer::new(4096).unwrap(), Buffer::new(4096).unwrap());
    /// let in_use = cache.get_ref(a.as_slice(), A::empty()).unwrap();
    /// drop(cache.get_ref(b.as_slice(), A::empty()).unwrap());
    /// assert_eq!(cache.flush_idle(), 1); // `b`'s entry; `a`'s has a handle
    /// assert_eq!(cache.len(), 1);
    /// drop(in_use);
    /// assert_eq!(cache.flush_idle(), 1);
    /// assert!(cache.is_empty());
    /// ```
    pub fn flush_idle(&self) -> usize {
        let n = self.evict_idle(usize::MAX, None);
        if let Some(m) = self.inner.shared.monitor {
            m.release_idle();
        }
        n
    }
}

/// Evictions by misses that share one membarrier (see [`RegCache::retire_victims`]).
pub(super) const UNFENCED_BATCH: usize = 32;

/// Stops the idle scanner thread on drop.
/// (Example at [`RegCache::start_idle_scanner`].)
#[derive(Debug)]
pub struct IdleScanner {
    pub(super) stop: Option<std::sync::mpsc::Sender<()>>,
    pub(super) thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for IdleScanner {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Remove entry `id` (starting at `s`) from the index and kill it, if it is still there and
/// still idle (only the index holds it): the eviction step shared by the capacity evictor and
/// the idle scanner.
pub(super) fn take_if_idle(
    ix: &mut IntervalIndex<Arc<Entry>>,
    s: u64,
    id: u64,
) -> Option<Arc<Entry>> {
    let idle = ix
        .containing(s, s)
        .find(|(_, _, i, _)| *i == id)
        .is_some_and(|(_, _, _, x)| x.idle_in_index());
    if !idle {
        return None;
    }
    let x = ix.remove(s, id)?;
    x.kill();
    Some(x)
}
