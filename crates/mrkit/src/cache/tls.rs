//! The per-thread path: each thread's table of holds by page (and a ring of recent
//! entries), the lock-free hit ([`RegCache::fast_hit`]) and the table's upkeep. The record
//! of the cache a thread last hit is reached through [`current`](super::current).

use std::cell::RefCell;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Weak};

use super::current::HitFields;
use super::entry::{Entry, Meta};
use super::handle::RegHandle;
use super::lease::table::LeaseTable;
use super::lease::{self, Asymmetric, Backout, Handle, Hold};
use super::{current, monitor, Inner, RegCache};
use crate::AccessFlags;

/// Per-thread counters, written by their owner only (on every hit): a line of their own, so
/// that two threads' counters never share one (allocated apart, they may). The increment is
/// the price of exact hit statistics: 12–15 % of a hit whose lease misses the CPU caches.
/// Counting in the lease's own word instead cost as much (a wrap check between its load and
/// store) and would narrow the handle count below what leaked handles cannot wrap
/// (docs/cache.md, session 21).
#[derive(Debug, Default)]
#[repr(align(64))]
pub(super) struct ThreadStats {
    pub(super) hits: AtomicU64,
}

/// One thread's table for one cache: its leases placed by the page of a request address
/// ([`LeaseTable`]: the table's slot is the lease, one cache line per hit), and a ring of
/// the last few entries matched by range (lookups anywhere inside a large entry).
/// Validated as a whole by the monitor sequence (a caught-up table has seen every queued
/// invalidation applied), and hold by hold by the lease's dead flag.
pub(super) struct TlsCache {
    pub(super) cache_id: u64,
    pub(super) alive: Weak<Inner>,
    /// The sequence validating the table ([`monitor::seq_for`]: the monitor's, or a constant
    /// 0 for an unmonitored cache), and its value when the table last caught up.
    pub(super) seq: &'static AtomicU64,
    pub(super) mseq: u64,
    pub(super) cells: LeaseTable<Entry>,
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
    Dead(Backout<Entry>),
}

/// Drop a dead hit's back-out (it may retire the entry): out of line, off the hit's path.
#[cold]
#[inline(never)]
fn drop_backout(b: Backout<Entry>) {
    drop(b);
}

/// The hit on one record: the table's lease for `addr`, checked for coverage and rights (or
/// the ring's), then a count on it. Reads the record and writes only the lease
/// word and the thread's hit counter: it runs no drop and no code that can reach `TLS`
/// ([`current::hit`] relies on it).
///
/// `rec`: the record (a closure: the current record's path reads its address from the
/// thread's slot only where it needs it, off the table hit). `f`: what the hit reads of the
/// record, [`HitFields::of`] it (the current record's copy, kept in the thread's current
/// slot). `asymmetric`: the proof of the asymmetric barrier, if the process has it (a
/// constant `Some` on the current record's path: the count update then tests no flag).
#[inline(always)]
pub(super) fn hit_in<'a>(
    rec: impl Fn() -> &'a TlsCache,
    f: HitFields<'a>,
    addr: u64,
    end: u64,
    access: AccessFlags,
    asymmetric: Option<Asymmetric>,
) -> Lookup {
    if f.behind() {
        return Lookup::Miss;
    }
    let key = page_key(addr);
    let covers = |m: &_| Meta::covers(m, addr, end, access);
    // `rec` is called only off the table hit's path (which reaches the table through `f`):
    // on the ring's, and without the barrier.
    let got = match asymmetric {
        Some(a) => f.table_hit(key, covers, a),
        None => rec().cells.hit(key, covers),
    };
    let got = match got {
        Some(got) => got,
        None => match ring_match(&rec().ring, addr, end, access) {
            Some(h) => match asymmetric {
                Some(a) => h.try_get_asymmetric(a),
                None => h.try_get(),
            },
            None => return Lookup::Miss,
        },
    };
    match got {
        Ok(h) => {
            f.count_hit();
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
    #[inline(always)]
    pub(super) fn fast_hit(&self, addr: u64, len: u64, access: AccessFlags) -> Option<RegHandle> {
        self.fast_hit_to(addr, addr.checked_add(len)?, access)
    }

    /// [`fast_hit`](Self::fast_hit) of `addr..end`, `end` computed without overflow by the
    /// caller.
    #[inline(always)]
    pub(super) fn fast_hit_to(
        &self,
        addr: u64,
        end: u64,
        access: AccessFlags,
    ) -> Option<RegHandle> {
        let found = match current::hit(self.id, addr, end, access) {
            Some(l) => l,
            None => self.hit_other(addr, end, access),
        };
        match found {
            Lookup::Hit(h) => Some(RegHandle { h }),
            // Dead (invalidated, evicted, superseded): the back-out is dropped here, outside
            // every borrow; the slow path replaces the hold.
            Lookup::Dead(b) => {
                drop_backout(b);
                None
            }
            Lookup::Miss => None,
        }
    }

    /// The hit when this cache's record is not the current one: search the thread's records
    /// and make this cache's current.
    #[inline(never)]
    fn hit_other(&self, addr: u64, end: u64, access: AccessFlags) -> Lookup {
        let asymmetric = lease::asymmetric();
        with_record(self.inner.id, |rec| {
            // Only with the proof: the current record's hit relies on it.
            if let Some(a) = asymmetric {
                current::set(rec, a);
            }
            hit_in(|| rec, HitFields::of(rec), addr, end, access, asymmetric)
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
                        seq: monitor::seq_for(inner.shared.monitor.is_some()),
                        mseq,
                        cells: LeaseTable::default(),
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
            if rec.cells.len() >= inner.tls_cap && !rec.cells.contains(key) {
                // Full: let go of the leases of dead entries, and if that is not enough of
                // every fourth live cell (in cell order, which the hash makes a
                // pseudo-random quarter of the pages looked up), so that a working set above
                // the cap keeps 3/4 to all of the table rather than restarting from nothing
                // (until session 19 the whole table went).
                rec.cells.retain(|_, dead| !dead, &mut old);
                if rec.cells.len() > inner.tls_cap / 4 * 3 {
                    let mut nth = 0usize;
                    rec.cells.retain(
                        |_, _| {
                            nth += 1;
                            nth % 4 != 0
                        },
                        &mut old,
                    );
                }
            }
            // The table's own lease on the entry for this page, in the table's cell (the
            // table holds it alone: it moves when the table grows). The miss's lease, `hold`,
            // goes to the ring (for lookups elsewhere in the entry) unless the ring has one.
            rec.cells.insert(key, hold.entry_arc(), &mut old);
            if rec
                .ring
                .iter()
                .flatten()
                .any(|r| std::ptr::eq(r.entry(), hold.entry()))
            {
                old.push(hold);
            } else {
                let i = rec.next % RING;
                rec.next = rec.next.wrapping_add(1);
                old.extend(rec.ring[i].replace(hold));
            }
            (old, gone)
        });
        // Leases released outside the thread-local borrow.
        drop(dropped);
        self.make_current();
    }

    /// Make this cache's record (if the thread has one) the current record: only with the
    /// asymmetric barrier (the current record's hit tests no flag).
    fn make_current(&self) {
        if let Some(a) = lease::asymmetric() {
            with_record(self.inner.id, |rec| current::set(rec, a));
        }
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
                        rec.cells.remove_if(k, |x| std::ptr::eq(x, &**e), &mut gone);
                    }
                }
            }
            gone
        });
        // Leases released outside the thread-local borrow.
        drop(gone);
    }
}
