//! The per-thread path: each thread's table of holds by page (and a ring of recent
//! entries), the lock-free hit ([`RegCache::fast_hit`]) and the table's upkeep. The record
//! of the cache a thread last hit is reached through [`current`](super::current).

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use super::entry::Entry;
use super::handle::RegHandle;
use super::lease::mem::Slots;
use super::lease::{Backout, Handle, Hold};
use super::{current, monitor, Inner, RegCache};
use crate::AccessFlags;

/// Per-thread counters, written by their owner only.
#[derive(Debug, Default)]
pub(super) struct ThreadStats {
    pub(super) hits: AtomicU64,
}

/// A thread's holds by the 4 KiB page of request addresses: open addressing with linear
/// probing in a power-of-two array kept at most half full, 16 bytes a slot, so a lookup
/// reads one line of the table and then the lease's line. Tables of 2 MiB and more are
/// mapped on their own for transparent huge pages ([`lease::mem::Slots`]).
pub(super) struct PageTable<V> {
    pub(super) slots: Slots<(u64, Option<V>)>,
    pub(super) len: usize,
    /// 64 - log2(slots.len()).
    pub(super) shift: u32,
}

impl<V> Default for PageTable<V> {
    fn default() -> Self {
        PageTable {
            slots: Slots::default(),
            len: 0,
            shift: 0,
        }
    }
}

impl<V> PageTable<V> {
    #[inline]
    pub(super) fn home(&self, key: u64) -> usize {
        // Fibonacci hashing: the top bits of the product.
        (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> self.shift) as usize
    }

    #[inline]
    pub(super) fn get(&self, key: u64) -> Option<&V> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        // At most half full: an empty slot ends every probe.
        loop {
            match &self.slots[i] {
                (k, Some(h)) if *k == key => return Some(h),
                (_, None) => return None,
                _ => i = (i + 1) & mask,
            }
        }
    }

    /// Remove `key` (backward-shift deletion: no tombstones, probes stay short).
    pub(super) fn remove(&mut self, key: u64) -> Option<V> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        loop {
            match &self.slots[i] {
                (k, Some(_)) if *k == key => break,
                (_, None) => return None,
                _ => i = (i + 1) & mask,
            }
        }
        let out = self.slots[i].1.take();
        self.len -= 1;
        // Shift later members of the probe run back into the hole when their home is not
        // in the cyclic range (hole, j].
        let mut hole = i;
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let h = match &self.slots[j] {
                (_, None) => break,
                (k, Some(_)) => self.home(*k),
            };
            let stays = if hole <= j {
                hole < h && h <= j
            } else {
                hole < h || h <= j
            };
            if !stays {
                self.slots.swap(hole, j);
                hole = j;
            }
        }
        out
    }

    /// Insert or replace; returns the replaced hold.
    pub(super) fn insert(&mut self, key: u64, hold: V) -> Option<V> {
        if (self.len + 1) * 2 > self.slots.len() {
            self.rebuild((self.slots.len() * 2).max(16));
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        loop {
            match &mut self.slots[i] {
                (k, Some(h)) if *k == key => return Some(std::mem::replace(h, hold)),
                (k, slot @ None) => {
                    *k = key;
                    *slot = Some(hold);
                    self.len += 1;
                    return None;
                }
                _ => i = (i + 1) & mask,
            }
        }
    }

    /// Re-create (same size) keeping the holds `keep` accepts; the others are pushed to
    /// `out` (released by the caller outside the thread-local borrow).
    pub(super) fn retain(&mut self, keep: impl Fn(&V) -> bool, out: &mut Vec<V>) {
        let size = self.slots.len();
        if size == 0 {
            return;
        }
        let mut old = std::mem::take(&mut self.slots);
        self.len = 0;
        self.alloc(size);
        for (k, h) in old.iter_mut() {
            if let Some(h) = h.take() {
                if keep(&h) {
                    self.insert(*k, h);
                } else {
                    out.push(h);
                }
            }
        }
    }

    /// Re-create with `size` slots (a power of two), keeping every hold.
    pub(super) fn rebuild(&mut self, size: usize) {
        let mut old = std::mem::take(&mut self.slots);
        self.len = 0;
        self.alloc(size);
        for (k, h) in old.iter_mut() {
            if let Some(h) = h.take() {
                self.insert(*k, h);
            }
        }
    }

    pub(super) fn alloc(&mut self, size: usize) {
        debug_assert!(size.is_power_of_two() && size >= 16);
        self.slots = Slots::new(size, || (0, None));
        self.shift = 64 - size.trailing_zeros();
    }
}

/// One thread's table for one cache: holds by the page of a request address, and a ring of
/// the last few entries matched by range (lookups anywhere inside a large entry).
/// Validated as a whole by the monitor sequence (a caught-up table has seen every queued
/// invalidation applied), and hold by hold by the lease's dead flag.
pub(super) struct TlsCache {
    pub(super) cache_id: u64,
    pub(super) alive: Weak<Inner>,
    /// The cache has a monitor (its sequence validates the table).
    pub(super) monitored: bool,
    pub(super) mseq: u64,
    pub(super) map: PageTable<Hold<Entry>>,
    pub(super) ring: [Option<Hold<Entry>>; RING],
    pub(super) next: usize,
    pub(super) stats: Arc<ThreadStats>,
}

/// Range-matched holds per thread table.
pub(super) const RING: usize = 4;

/// Entries of at most this many pages have their slots dropped from the invalidating
/// thread's table at once ([`RegCache::tls_forget`]).
pub(super) const FORGET_PAGES: u64 = 64;

/// Key of the thread table.
#[inline]
pub(super) fn page_key(addr: u64) -> u64 {
    addr >> 12
}

/// A thread's records, one per cache it looked up through. Boxed: the current record's
/// pointer ([`current`]) stays valid when the vector grows.
#[allow(clippy::vec_box)] // the boxes are the point: records must not move with the vector
pub(super) struct Tables(Vec<Box<TlsCache>>);

impl Drop for Tables {
    fn drop(&mut self) {
        // Thread exit: the records go; nothing may point to them.
        current::clear();
    }
}

thread_local! {
    static TLS: RefCell<Tables> = const { RefCell::new(Tables(Vec::new())) };
}

/// Mutable access to this thread's records (`None` once they are gone at thread exit).
/// Clears the current record first ([`current`]'s invariant).
pub(super) fn tables_mut<R>(f: impl FnOnce(&mut Vec<Box<TlsCache>>) -> R) -> Option<R> {
    current::clear();
    TLS.try_with(|t| f(&mut t.borrow_mut().0)).ok()
}

/// Run `f` on this thread's record of cache `id` (shared borrow); `None` without one, during
/// a mutable access to the records, or once they are gone at thread exit.
fn with_record<R>(id: u64, f: impl FnOnce(&TlsCache) -> R) -> Option<R> {
    TLS.try_with(|t| {
        let t = t.try_borrow().ok()?;
        t.0.iter().rev().find(|r| r.cache_id == id).map(|r| f(r))
    })
    .ok()
    .flatten()
}

/// What a record's hit found.
pub(super) enum Lookup {
    /// No live hold covers the request, or the table is behind the monitor: the slow path.
    Miss,
    /// A handle.
    Hit(Handle<Entry>),
    /// The hold's entry was killed as the hit counted: dropping this releases the count
    /// (it may retire the entry), so it is dropped only once no record is borrowed.
    Dead(#[allow(dead_code)] Backout<Entry>),
}

/// The hit on one record: the table slot for `addr`, checked for coverage and rights (or
/// the ring), then a count on the slot's lease. Reads the record and writes only the lease
/// word and the thread's hit counter: it runs no drop and no code that can reach `TLS`
/// ([`current::hit`] relies on it).
#[inline(always)]
pub(super) fn hit_in(rec: &TlsCache, addr: u64, end: u64, access: AccessFlags) -> Lookup {
    if rec.monitored && rec.mseq != monitor::seq() {
        return Lookup::Miss;
    }
    let hold = match rec.map.get(page_key(addr)) {
        Some(h) if h.meta().covers(addr, end, access) => h,
        _ => match ring_match(&rec.ring, addr, end, access) {
            Some(h) => h,
            None => return Lookup::Miss,
        },
    };
    match hold.try_get() {
        Ok(h) => {
            let n = &rec.stats.hits;
            n.store(n.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
            Lookup::Hit(h)
        }
        Err(b) => Lookup::Dead(b),
    }
}

/// The ring's hold covering `addr..end` with `access`, if any: lookups inside a large entry
/// at a page the table does not hold yet. Out of line, so that the table hit (the common case)
/// stays small enough to be inlined into the lookups.
#[inline(never)]
fn ring_match(
    ring: &[Option<Hold<Entry>>; RING],
    addr: u64,
    end: u64,
    access: AccessFlags,
) -> Option<&Hold<Entry>> {
    ring.iter()
        .flatten()
        .find(|h| h.meta().covers(addr, end, access))
}

impl RegCache {
    /// The per-thread path: the thread's table slot for `addr`, checked for coverage and
    /// rights, then a handle through the slot's lease (no lock, no shared write; see
    /// [`lease`]). The table is valid only while no monitor event arrived since it caught up
    /// (`mseq`): queued invalidations are applied by the slow path first. The current
    /// record ([`current`]) is tried first, then the thread's other records.
    #[inline]
    pub(super) fn fast_hit(&self, addr: u64, len: u64, access: AccessFlags) -> Option<RegHandle> {
        let end = addr.checked_add(len)?;
        let found = match current::hit(self.inner.id, addr, end, access) {
            Some(l) => l,
            None => self.hit_other(addr, end, access),
        };
        match found {
            Lookup::Hit(h) => Some(RegHandle { h }),
            // Dead (invalidated, evicted, superseded): the back-out is dropped here, outside
            // every borrow; the slow path replaces the hold.
            Lookup::Dead(_) | Lookup::Miss => None,
        }
    }

    /// The hit when this cache's record is not the current one: search the thread's records
    /// and make this cache's current.
    #[inline(never)]
    fn hit_other(&self, addr: u64, end: u64, access: AccessFlags) -> Lookup {
        with_record(self.inner.id, |rec| {
            current::set(rec);
            hit_in(rec, addr, end, access)
        })
        .unwrap_or(Lookup::Miss)
    }

    /// Remember `hold` for lookups at `addr` in this thread's table; `mseq` is the monitor
    /// sequence read *before* the pending invalidations were applied (so every event it
    /// counts has killed its entries by now).
    pub(super) fn tls_insert(&self, addr: u64, hold: Hold<Entry>, mseq: u64) {
        let inner = &self.inner;
        let dropped = tables_mut(|t| {
            // Tables of dropped caches hold entry memory (never registrations): let go of
            // them at this thread's next slow path.
            let gone: Vec<Box<TlsCache>> = if t.iter().any(|r| r.alive.strong_count() == 0) {
                let (live, gone) = std::mem::take(&mut *t)
                    .into_iter()
                    .partition(|r| r.alive.strong_count() > 0);
                *t = live;
                gone
            } else {
                Vec::new()
            };
            let pos = match t.iter().rposition(|r| r.cache_id == inner.id) {
                Some(p) => p,
                None => {
                    let stats = Arc::new(ThreadStats::default());
                    inner.threads.lock().push(stats.clone());
                    t.push(Box::new(TlsCache {
                        cache_id: inner.id,
                        alive: Arc::downgrade(inner),
                        monitored: inner.shared.monitor.is_some(),
                        mseq,
                        map: PageTable::default(),
                        ring: Default::default(),
                        next: 0,
                        stats,
                    }));
                    t.len() - 1
                }
            };
            let rec = &mut t[pos];
            rec.mseq = mseq;
            let key = page_key(addr);
            let mut old: Vec<Hold<Entry>> = Vec::new();
            if !rec.ring.iter().flatten().any(|r| r.same(&hold)) {
                let i = rec.next % RING;
                rec.next = rec.next.wrapping_add(1);
                old.extend(rec.ring[i].replace(hold.clone()));
            }
            if rec.map.len >= inner.tls_cap && rec.map.get(key).is_none() {
                // Full: drop the holds of dead entries, and everything if that is not enough.
                rec.map.retain(|h| !h.is_dead(), &mut old);
                if rec.map.len >= inner.tls_cap / 2 {
                    rec.map.retain(|_| false, &mut old);
                }
            }
            old.extend(rec.map.insert(key, hold));
            (old, gone)
        });
        // Leases released outside the thread-local borrow.
        drop(dropped);
        self.make_current();
    }

    /// Make this cache's record (if the thread has one) the current record.
    fn make_current(&self) {
        with_record(self.inner.id, current::set);
    }

    /// A handle and a hold through this thread's ring slot on `e`, if any and alive.
    pub(super) fn tls_reuse(&self, e: &Arc<Entry>) -> Option<(Handle<Entry>, Hold<Entry>)> {
        let (got, hold) = with_record(self.inner.id, |rec| {
            let hold = rec
                .ring
                .iter()
                .flatten()
                .find(|h| std::ptr::eq(h.entry(), &**e))?;
            Some((hold.try_get(), hold.clone()))
        })
        .flatten()?;
        // Outside the borrow: a dead entry's back-out (and this hold's drop) may retire it
        // and so run drop code that looks something up in this cache.
        Some((got.ok()?, hold))
    }

    /// Drop this thread's holds on `dead` entries now, while their memory is warm (other
    /// threads' tables let go when they look the address up again or rebuild).
    pub(super) fn tls_forget(&self, dead: &[Arc<Entry>]) {
        let id = self.inner.id;
        let gone = tables_mut(|t| {
            let mut gone: Vec<Hold<Entry>> = Vec::new();
            let Some(rec) = t.iter_mut().rev().find(|r| r.cache_id == id) else {
                return gone;
            };
            for e in dead {
                for slot in &mut rec.ring {
                    if slot.as_ref().is_some_and(|h| std::ptr::eq(h.entry(), &**e)) {
                        gone.extend(slot.take());
                    }
                }
                // Small entries: their pages are the likely keys.
                let (first, last) = (page_key(e.start), page_key(e.end - 1));
                if last - first < FORGET_PAGES {
                    for k in first..=last {
                        if rec
                            .map
                            .get(k)
                            .is_some_and(|h| std::ptr::eq(h.entry(), &**e))
                        {
                            gone.extend(rec.map.remove(k));
                        }
                    }
                }
            }
            gone
        });
        // Leases released outside the thread-local borrow.
        drop(gone);
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::PageTable;
    use std::collections::HashMap;

    /// The thread table against a `HashMap`: inserts, replacements, backward-shift
    /// removals and rebuilds over colliding keys.
    #[test]
    pub(super) fn page_table_matches_a_map() {
        let mut t: PageTable<u64> = PageTable::default();
        let mut m: HashMap<u64, u64> = HashMap::new();
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        for step in 0..200_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Few distinct keys (long probe runs, many replacements and removals).
            let key = x % 3000;
            match (x >> 32) % 8 {
                0..=3 => assert_eq!(t.insert(key, step), m.insert(key, step)),
                4..=5 => assert_eq!(t.remove(key), m.remove(&key)),
                6 if step % 512 == 0 => {
                    let mut out = Vec::new();
                    t.retain(|v| v % 2 == 0, &mut out);
                    let before = m.len();
                    m.retain(|_, v| *v % 2 == 0);
                    assert_eq!(out.len(), before - m.len());
                }
                _ => {}
            }
            assert_eq!(t.get(key), m.get(&key));
            assert_eq!(t.len, m.len());
        }
        for (k, v) in &m {
            assert_eq!(t.get(*k), Some(v));
        }
    }
}
