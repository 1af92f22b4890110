//! Synchronisation shim of the cache's lock-free core ([`super::lease`]): `std` atomics and
//! `parking_lot`'s mutex normally, `loom`'s under `--cfg loom`, so `tests/loom_cache.rs`
//! model-checks the code as written.
#![forbid(unsafe_code)]

#[cfg(loom)]
pub use loom::sync::atomic::{AtomicBool, AtomicU64, Ordering};
#[cfg(not(loom))]
pub use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

#[cfg(not(loom))]
pub use parking_lot::Mutex;

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
