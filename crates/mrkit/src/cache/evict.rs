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
        let mut cands = self.idle_entries(ix);
        cands.sort_unstable(); // least recently used first
        for (_, s, id) in cands {
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

    /// The idle entries as (idle since, start, id), in no order. CLOCK: an entry used since
    /// the last look starts a new idle period now.
    fn idle_entries(&self, ix: &IntervalIndex<Arc<Entry>>) -> Vec<(u64, u64, u64)> {
        let now = self.tick(Instant::now());
        ix.iter()
            .filter(|(_, _, _, x)| evictable(x))
            .map(|(s, _, id, x)| {
                if x.leases.take_touched() {
                    x.idle_since.store(now, Ordering::Relaxed);
                }
                (x.idle_since.load(Ordering::Relaxed), s, id)
            })
            .collect()
    }

    /// Evict the idle entries `pick` selects, and retire them with earlier misses' victims
    /// still waiting for a barrier. Returns (entries evicted now, earlier victims retired).
    pub(super) fn evict(&self, pick: Pick) -> (usize, usize) {
        let mut victims = std::mem::take(&mut *self.inner.unfenced.lock());
        let earlier = victims.len();
        {
            let mut ix = self.inner.index.write();
            let chosen: Vec<(u64, u64)> = match pick {
                Pick::All => ix
                    .iter()
                    .filter(|(_, _, _, x)| evictable(x))
                    .map(|(s, _, id, _)| (s, id))
                    .collect(),
                Pick::IdleBefore(cut) => ix
                    .iter()
                    .filter(|(_, _, _, x)| {
                        evictable(x) && x.idle_since.load(Ordering::Relaxed) <= cut
                    })
                    .map(|(s, _, id, _)| (s, id))
                    .collect(),
                Pick::DeviceLimitRound(round) => {
                    let mut cands = self.idle_entries(&ix);
                    let share = match round {
                        0 => cands.len() / 64,
                        1 => cands.len() / 8,
                        _ => cands.len(),
                    }
                    .max(1);
                    oldest_first(&mut cands, share);
                    cands.truncate(share);
                    cands.into_iter().map(|(_, s, id)| (s, id)).collect()
                }
            };
            for (s, id) in chosen {
                victims.extend(take_if_idle(&mut ix, s, id));
            }
        }
        let n = victims.len() - earlier;
        let c = &self.inner.shared.c;
        let counter = match pick {
            Pick::IdleBefore(_) => &c.idle_releases,
            Pick::All | Pick::DeviceLimitRound(_) => &c.evictions,
        };
        // Relaxed: a statistic (the earlier victims were counted when evicted).
        counter.fetch_add(n as u64, Ordering::Relaxed);
        retire_all(victims);
        (n, earlier)
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
            Some(cut) => self.evict(Pick::IdleBefore(cut)).0,
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
        let (n, _) = self.evict(Pick::All);
        if let Some(m) = self.inner.shared.monitor {
            m.release_idle();
        }
        n
    }
}

/// Which idle entries a round of [`RegCache::evict`] takes.
#[derive(Clone, Copy, Debug)]
pub(super) enum Pick {
    /// Every idle entry ([`RegCache::flush_idle`]).
    All,
    /// Those idle since before this cache-clock tick (the idle scanner).
    IdleBefore(u64),
    /// After the device refused a registration for lack of resources (`ENOMEM`, `EAGAIN`:
    /// its MR limit, memlock), the least recently used idle entries, a share that grows with
    /// each round of the same lookup — 1/64 of them, then 1/8, then all (at least one) — so
    /// that a working set at the device's limit loses its oldest entries, as at
    /// `max_entries`, not all of them at once.
    DeviceLimitRound(u32),
}

/// Whether an indexed entry may be evicted: published, no handle, not killed.
fn evictable(x: &Entry) -> bool {
    x.ready().is_some() && x.idle_in_index() && !x.is_dead()
}

/// Put the `k` oldest of `cands` (by idle since, then address) first, in order.
fn oldest_first(cands: &mut [(u64, u64, u64)], k: usize) {
    if k >= cands.len() {
        cands.sort_unstable();
    } else if k > 0 {
        cands.select_nth_unstable(k - 1);
        cands[..k].sort_unstable();
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
