//! A cheap clock for the provider's registration-time statistics: two `Instant::now()` cost
//! 100-150 ns on a virtual machine (vDSO `clock_gettime`), more than the whole budget of the
//! binding around a registration; the time-stamp counter costs ~20 ns a read.
//!
//! On x86_64, when the kernel itself keeps time with the TSC (clocksource `tsc`: the counter
//! is then invariant and synchronised across CPUs), [`now`] reads it and [`to_ns`] converts
//! a difference with a factor calibrated once against `Instant` (2 ms, at the first device
//! open). Elsewhere [`now`] is nanoseconds since the first call, from `Instant`.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How ticks become nanoseconds: `ns = ticks * mult >> 32`, or `None` for nanosecond ticks.
struct Scale {
    mult: Option<u64>,
    base: Instant,
}

fn scale() -> &'static Scale {
    static S: OnceLock<Scale> = OnceLock::new();
    S.get_or_init(|| Scale {
        mult: calibrate(),
        base: Instant::now(),
    })
}

/// Calibrate once (call before the hot path: the first call spins for 2 ms on TSC systems).
pub(crate) fn init() {
    let _ = scale();
}

#[cfg(target_arch = "x86_64")]
fn tsc() -> u64 {
    // SAFETY: RDTSC has no preconditions and every x86_64 CPU has it; it only reads the
    // counter.
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[cfg(target_arch = "x86_64")]
fn calibrate() -> Option<u64> {
    let source =
        std::fs::read_to_string("/sys/devices/system/clocksource/clocksource0/current_clocksource")
            .ok()?;
    if source.trim() != "tsc" {
        return None;
    }
    let (t0, c0) = (Instant::now(), tsc());
    while t0.elapsed() < Duration::from_millis(2) {
        std::hint::spin_loop();
    }
    let (ns, ticks) = (t0.elapsed().as_nanos(), tsc().wrapping_sub(c0));
    if ticks == 0 {
        return None;
    }
    u64::try_from((ns << 32) / u128::from(ticks)).ok()
}

#[cfg(not(target_arch = "x86_64"))]
fn calibrate() -> Option<u64> {
    None
}

/// Now, in ticks.
#[inline]
pub(crate) fn now() -> u64 {
    let s = scale();
    #[cfg(target_arch = "x86_64")]
    if s.mult.is_some() {
        return tsc();
    }
    u64::try_from(s.base.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// The duration of `ticks` ticks (a difference of two [`now`]).
pub(crate) fn to_ns(ticks: u64) -> u64 {
    match scale().mult {
        Some(m) => u64::try_from((u128::from(ticks) * u128::from(m)) >> 32).unwrap_or(u64::MAX),
        None => ticks,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ticks_measure_a_sleep() {
        super::init();
        let t = super::now();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let ns = super::to_ns(super::now().wrapping_sub(t));
        // Bounded but tolerant: a loaded machine sleeps longer, never shorter.
        assert!((20_000_000..2_000_000_000).contains(&ns), "{ns}");
    }
}
