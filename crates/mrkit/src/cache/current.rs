//! The thread's current table: a pointer to the per-thread record ([`TlsCache`]) of the
//! cache this thread last hit, with a copy of what its hit reads of the record
//! ([`HitFields`]: the table's cells, the monitor sequence, the hit counter), all in one
//! thread-local cache line, so that a hit reaches its table cell with thread-local loads
//! and a compare, without the `RefCell`, the search through the thread's records by cache
//! and the destructor-registration check of `TLS` (all on the hit path before; about a
//! quarter of its instructions, which at large working sets decide how many successive
//! lookups the CPU overlaps: see `docs/cache.md`).
//!
//! # Invariant
//!
//! While `CURRENT.id != 0`, `CURRENT.rec` points to a record that is in this thread's `TLS`
//! vector (boxed: it does not move when the vector does) and was derived from a shared
//! borrow of it after the last mutable access to the records, and `CURRENT.fields` was
//! copied from that record then (its table keeps the block the view points into until a
//! mutable access). Every mutable access to the
//! records goes through [`tls::tables_mut`](super::tls::tables_mut), which [`clear`]s
//! `CURRENT` first; the vector's drop at thread exit clears it too. Cache ids start at 1
//! and are never reused, so a record of a dropped cache is never current for a live one.
//! A record is made current only with the proof that the process has the asymmetric barrier
//! ([`Asymmetric`]; [`set`] takes it), so the current record's hit counts without testing
//! the barrier's flag.

use std::cell::Cell;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use super::entry::{Entry, Meta};
use super::lease::table::TableView;
use super::lease::{Asymmetric, Backout, Handle};
use super::tls::{hit_in, Lookup, TlsCache};
use crate::AccessFlags;

/// What a hit reads of its record before the table cell: the monitor sequence and the
/// table's value of it, the table's cells and the thread's hit counter. The current
/// record's copy lives in the thread's current slot, so that its hit reads one thread-local
/// line and follows no pointer to the record (whose lines, when the VM's other work evicts
/// them from the core's caches, delay the cell's load: see docs/cache.md).
///
/// Made only from a shared borrow of the record ([`of`](Self::of)), and valid for as long
/// as it: the record's table keeps its block and its statistics until a mutable access.
/// (A record is not `Sync`: its table is not, so the fields are made on its thread.)
#[derive(Clone, Copy)]
pub(super) struct HitFields<'a> {
    seq: &'static AtomicU64,
    mseq: u64,
    table: TableView<Entry>,
    /// The record's `stats.hits` (the record keeps its `Arc`).
    hits: NonNull<AtomicU64>,
    _rec: PhantomData<&'a TlsCache>,
}

/// The monitor sequence of [`HitFields::NONE`] (never read).
static NO_SEQ: AtomicU64 = AtomicU64::new(0);

impl HitFields<'static> {
    /// The fields of no record: a placeholder in the current slot while no record is
    /// current, never used (the slot's id, 0, matches no cache).
    const NONE: Self = HitFields {
        seq: &NO_SEQ,
        mseq: 1,
        table: TableView::NONE,
        hits: NonNull::dangling(),
        _rec: PhantomData,
    };
}

impl<'a> HitFields<'a> {
    /// The fields of `rec` as they are now.
    #[inline(always)]
    pub(super) fn of(rec: &'a TlsCache) -> Self {
        HitFields {
            seq: rec.seq,
            mseq: rec.mseq,
            table: rec.cells.view(),
            hits: NonNull::from(&rec.stats.hits),
            _rec: PhantomData,
        }
    }

    /// Whether a monitor event arrived since the table caught up (its queued invalidations
    /// are then applied by the slow path first).
    #[inline(always)]
    pub(super) fn behind(self) -> bool {
        // Acquire: as `monitor::seq`.
        self.mseq != self.seq.load(Ordering::Acquire)
    }

    /// The table's hit at page `key` ([`TableView::hit_asymmetric`]).
    #[inline(always)]
    pub(super) fn table_hit(
        self,
        key: u64,
        covers: impl FnOnce(&Meta) -> bool,
        a: Asymmetric,
    ) -> Option<Result<Handle<Entry>, Backout<Entry>>> {
        // SAFETY: the view of the borrowed record's table, unchanged while the borrow lives,
        // on the record's thread (see the type's doc).
        unsafe { self.table.hit_asymmetric(key, covers, a) }
    }

    /// Count a hit in the thread's counter (written by this thread only: a plain load and
    /// store, Relaxed: a statistic).
    #[inline(always)]
    pub(super) fn count_hit(self) {
        // SAFETY: the record's counter, alive while the borrowed record is (it keeps the
        // `Arc`).
        let n = unsafe { self.hits.as_ref() };
        n.store(n.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }
}

/// One line: the id compared first, then the copied fields the hit reads.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Current {
    /// The record's cache id; 0 when no record is current.
    id: u64,
    rec: *const TlsCache,
    /// `rec`'s [`HitFields`], their borrow of the record kept by the module invariant
    /// ([`HitFields::NONE`] when no record is current: never read then).
    fields: HitFields<'static>,
}

const NONE: Current = Current {
    id: 0,
    rec: std::ptr::null(),
    fields: HitFields::NONE,
};

thread_local! {
    // A `const` thread-local without drop glue: reading it is one load relative to the
    // thread pointer (no lazy initialisation, no destructor registration), and it stays
    // readable during thread exit.
    static CURRENT: Cell<Current> = const { Cell::new(NONE) };
}

/// The hit on this thread's current record if it is cache `id`'s, else `None` (the caller
/// looks the record up in `TLS`).
#[inline(always)]
pub(super) fn hit(id: u64, addr: u64, end: u64, access: AccessFlags) -> Option<Lookup> {
    // Through the slot's address, field by field: a copy of the whole slot (`Cell::get`)
    // comes back through `with`'s `Result`, whose error the compiler encodes in a field's
    // niche and tests on every hit (two instructions), and loads the record's address even
    // where the hit does not need it.
    let c: *const Current = CURRENT.with(Cell::as_ptr);
    // SAFETY: this thread's slot, written only by `set` and `clear` on this thread, neither
    // of which runs during this function (it calls no code that can reach them).
    let c = unsafe { &*c };
    if c.id != id {
        return None;
    }
    // Set with the id (`set`): a current id has its record's fields.
    let f = c.fields;
    // SAFETY: a record is made current only with the proof of the asymmetric barrier
    // (`set`), a decision that never changes.
    let asymmetric = unsafe { Asymmetric::assume() };
    // SAFETY: by the module invariant the record is alive and no mutable reference to it
    // exists (mutable accesses clear `CURRENT` first and none is running: `hit_in` runs no
    // code that can reach `TLS`, it reads the record and takes one count on a lease).
    Some(hit_in(
        || unsafe { &*c.rec },
        f,
        addr,
        end,
        access,
        Some(asymmetric),
    ))
}

/// Make `rec` (borrowed from this thread's `TLS`, shared) the current record. Only with the
/// asymmetric barrier: [`hit`] assumes it.
pub(super) fn set(rec: &TlsCache, _: Asymmetric) {
    CURRENT.with(|c| {
        c.set(Current {
            id: rec.cache_id,
            rec,
            // SAFETY: the borrow is kept for as long as the record is current (module
            // invariant: it stops being current before any mutable access or its drop).
            fields: unsafe {
                std::mem::transmute::<HitFields<'_>, HitFields<'static>>(HitFields::of(rec))
            },
        })
    });
}

/// No record is current: before any mutable access to the thread's records, and at exit.
pub(super) fn clear() {
    // `try_with` cannot fail for a const thread-local without drop glue; ignore it anyway.
    let _ = CURRENT.try_with(|c| c.set(NONE));
}
