//! The time origin of the timestamps the progress state keeps in atomics (nanoseconds since
//! a process-wide instant).
#![forbid(unsafe_code)]

use std::time::Instant;

/// Process-wide time origin for the atomics holding timestamps.
pub(super) fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

pub(crate) fn ns_since_epoch(t: Instant) -> u64 {
    (t.saturating_duration_since(epoch()).as_nanos() as u64).max(1)
}
