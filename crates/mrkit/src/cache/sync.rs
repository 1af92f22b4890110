//! Synchronisation shim of the cache's lock-free core ([`super::lease`]): `std` atomics and
//! `parking_lot`'s mutex normally, `loom`'s under `--cfg loom`, so `tests/loom_cache.rs`
//! model-checks the code as written.
#![forbid(unsafe_code)]

#[cfg(loom)]
pub use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
#[cfg(not(loom))]
pub use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};

#[cfg(not(loom))]
pub use parking_lot::Mutex;

/// Ids handed out by [`thread_id`] (never reused). Relaxed: only uniqueness matters. A `std`
/// atomic under loom too (an identity, not part of the modelled protocol).
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// [`owner_token`] of a thread that owns no lease (and of every thread without the
/// asymmetric barrier): no lease's owner field ever holds it (ids count up from 1; 0 is
/// "no owner").
pub const NO_OWNER_TOKEN: u64 = u64::MAX;

#[cfg(not(loom))]
std::thread_local! {
    static ID: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    static TOKEN: std::cell::Cell<u64> = const { std::cell::Cell::new(NO_OWNER_TOKEN) };
}
#[cfg(loom)]
loom::thread_local! {
    static ID: std::cell::Cell<u64> = std::cell::Cell::new(0);
    static TOKEN: std::cell::Cell<u64> = std::cell::Cell::new(NO_OWNER_TOKEN);
}

/// What a handle drop compares its lease's owner with to take the owner's path (a plain
/// count update and a compiler fence): the thread's id once it created a lease, if the
/// process has the asymmetric barrier; else [`NO_OWNER_TOKEN`], so that every drop takes
/// the read-modify-write path (which is a full barrier). One thread-local load, no
/// initialisation check (the hot side of the lease protocol).
#[inline(always)]
pub fn owner_token() -> u64 {
    TOKEN.with(std::cell::Cell::get)
}

/// Arm [`owner_token`] for the calling thread (it is about to own a lease): its id when the
/// owner's side of the barrier may be a compiler fence (`asymmetric`), else nothing.
pub fn arm_owner_token(asymmetric: bool) {
    if asymmetric {
        let id = thread_id();
        TOKEN.with(|t| t.set(id));
    }
}

/// The calling thread's id: nonzero, unique in the process for its lifetime (a lease's owner
/// is compared with it). Usable in thread-local destructors (a `const` `Cell` has none).
#[inline]
pub fn thread_id() -> u64 {
    ID.with(|c| {
        let v = c.get();
        if v != 0 {
            return v;
        }
        let v = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        c.set(v);
        v
    })
}

/// loom's mutex with `parking_lot`'s signature (no poisoning).
#[cfg(loom)]
#[derive(Debug)]
pub struct Mutex<T>(loom::sync::Mutex<T>);

#[cfg(loom)]
impl<T> Mutex<T> {
    /// A mutex holding `v`.
    pub fn new(v: T) -> Self {
        Mutex(loom::sync::Mutex::new(v))
    }
    /// Lock.
    pub fn lock(&self) -> loom::sync::MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}
