//! Concurrency shim: `std` atomics and `parking_lot` normally, `loom`'s under `--cfg loom`, so
//! the lock-free free list ([`super::freelist::FreeStack`]) and the pool's lifetime protocol
//! ([`super::life::Life`]) are model-checked as written.

#[cfg(loom)]
pub use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

#[cfg(not(loom))]
pub use parking_lot::Mutex;

/// `loom`'s mutex with `parking_lot`'s signature (no poisoning).
#[cfg(loom)]
#[derive(Debug)]
pub struct Mutex<T>(loom::sync::Mutex<T>);

#[cfg(loom)]
use loom::sync::MutexGuard;

#[cfg(loom)]
impl<T> Mutex<T> {
    /// A new mutex.
    pub fn new(v: T) -> Mutex<T> {
        Mutex(loom::sync::Mutex::new(v))
    }
    /// Lock it.
    pub fn lock(&self) -> MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}
