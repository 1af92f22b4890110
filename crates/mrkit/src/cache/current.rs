//! The thread's current table: a pointer to the per-thread record ([`TlsCache`]) of the
//! cache this thread last hit, so that a hit reaches its table with one thread-local load
//! and a compare, without the `RefCell`, the search through the thread's records by cache
//! and the destructor-registration check of `TLS` (all on the hit path before; about a
//! quarter of its instructions, which at large working sets decide how many successive
//! lookups the CPU overlaps: see `docs/cache.md`).
//!
//! # Invariant
//!
//! While `CURRENT.id != 0`, `CURRENT.rec` points to a record that is in this thread's `TLS`
//! vector (boxed: it does not move when the vector does) and was derived from a shared
//! borrow of it after the last mutable access to the records. Every mutable access to the
//! records goes through [`tls::tables_mut`](super::tls::tables_mut), which [`clear`]s
//! `CURRENT` first; the vector's drop at thread exit clears it too. Cache ids start at 1
//! and are never reused, so a record of a dropped cache is never current for a live one.
//! A record is made current only with the proof that the process has the asymmetric barrier
//! ([`Asymmetric`]; [`set`] takes it), so the current record's hit counts without testing
//! the barrier's flag.

use std::cell::Cell;

use super::lease::Asymmetric;
use super::tls::{hit_in, Lookup, TlsCache};
use crate::AccessFlags;

#[derive(Clone, Copy)]
struct Current {
    /// The record's cache id; 0 when no record is current.
    id: u64,
    rec: *const TlsCache,
}

const NONE: Current = Current {
    id: 0,
    rec: std::ptr::null(),
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
    let c = CURRENT.with(Cell::get);
    if c.id != id {
        return None;
    }
    // SAFETY: a record is made current only with the proof of the asymmetric barrier
    // (`set`), a decision that never changes.
    let asymmetric = unsafe { Asymmetric::assume() };
    // SAFETY: by the module invariant the record is alive and no mutable reference to it
    // exists (mutable accesses clear `CURRENT` first and none is running: `hit_in` runs no
    // code that can reach `TLS`, it reads the record and takes one count on a lease).
    Some(hit_in(
        unsafe { &*c.rec },
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
        })
    });
}

/// No record is current: before any mutable access to the thread's records, and at exit.
pub(super) fn clear() {
    // `try_with` cannot fail for a const thread-local without drop glue; ignore it anyway.
    let _ = CURRENT.try_with(|c| c.set(NONE));
}
