//! Atomics shim: `std` atomics normally, `loom` atomics under `--cfg loom` so the lock-free
//! core ([`super::freelist::FreeStack`]) is model-checked as written.

#[cfg(loom)]
pub use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
