//! VMA hygiene of cached registrations, alone in its own test binary (= its own process).
//!
//! The test reads process-global state: `/proc/self/maps`, the device's per-page DONTFORK
//! counts and the monitor's per-page attach counts, both keyed by address. Next to other
//! tests in one process it flaked (`flush_idle() == 0`, "VMA left split", EFAULT): another
//! test unmapping a cached range (its entries still alive until its cache drops) lets this
//! test's fresh `mmap` reuse the addresses, so this cache received the other test's late
//! UNMAP event (a correct, conservative invalidation of its entry) and shared page counts
//! with the other test's entries (the VMA stayed split until those dropped). None of that
//! is a cache bug, and none of it can happen in a process of its own.

mod cache_util;
mod providers_util;

use cache_util::*;
use mrkit::cache::{CacheConfig, RegCache};
use mrkit::AccessFlags;

const RW: AccessFlags = AccessFlags::LOCAL_WRITE;

fn explicit() -> CacheConfig {
    CacheConfig {
        monitor: cache_util::explicit_only(),
        ..CacheConfig::default()
    }
}

#[test]
fn vma_split_lasts_only_as_long_as_the_registration() {
    // DONTFORK (device, refcounted per page) and the userfaultfd attach (cache, refcounted
    // per page) split the VMA around a cached range; both are undone at deregistration so the
    // kernel merges the VMA back (no creeping vm.max_map_count exhaustion).
    let cfg = monitored_config().unwrap_or_else(explicit);
    let (_ctx, pd) = open();
    let cache = RegCache::new(&pd, cfg).unwrap();
    let m = Map::new(64 << 10);
    let (a, b) = (m.addr, m.addr + (64 << 10));
    assert_eq!(vmas_in(a, b), 1);
    let h = cache.raw(m.addr + 16384, 8192, RW).unwrap();
    assert_eq!(
        vmas_in(a, b),
        3,
        "cached range should carry its own VMA flags"
    );
    let h2 = cache
        .raw(m.addr + 20480, 4096, RW | AccessFlags::REMOTE_READ)
        .unwrap();
    drop(h);
    assert_eq!(cache.flush_idle(), 1);
    assert!(
        vmas_in(a, b) >= 3,
        "page still registered by the second entry"
    );
    drop(h2);
    cache.flush_idle();
    assert_eq!(
        vmas_in(a, b),
        1,
        "VMA left split after the last deregistration"
    );
}
