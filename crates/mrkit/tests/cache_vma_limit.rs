//! The userfaultfd monitor past `vm.max_map_count`: single-page entries scattered over one
//! mapping, more than the process has VMAs to split the mapping for, are all cached (once
//! the process is out of VMAs an attachment bridges the gap to its attached neighbours), and
//! dropped pages under cached entries are still invalidated. Alone in its own test binary
//! (= its own process): it uses up the process's VMAs.

mod cache_util;
mod providers_util;

use cache_util::*;
use mrkit::cache::{test_support::monitor, CacheConfig, RegCache};
use mrkit::AccessFlags;

const PAGE: u64 = 4096;
const RW: AccessFlags = AccessFlags::LOCAL_WRITE;

#[test]
fn scattered_entries_past_the_map_count_are_all_cached() {
    let Some(cfg) = monitored_config() else {
        return;
    };
    let limit: usize = std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    if limit > 200_000 {
        eprintln!("MRKIT-SKIP vm.max_map_count is {limit}: too many entries to reach it here");
        return;
    }
    // Every other page: each entry alone in the mapping splits it twice, so half the limit
    // (less the process's other VMAs) is where exact attachments run out.
    let n = limit / 2 + 4096;
    let (ctx, pd) = open();
    let cache = RegCache::new(
        &pd,
        CacheConfig {
            max_entries: n + 1024,
            ..cfg
        },
    )
    .unwrap();
    let m = Map::new(2 * n * PAGE as usize);
    let at = |i: usize| m.addr + 2 * i as u64 * PAGE;
    let bridges = monitor::bridges().unwrap();
    for i in 0..n {
        drop(cache.raw(at(i), PAGE, RW).unwrap());
    }
    let s = cache.stats();
    assert_eq!((s.uncached, s.unmonitored), (0, 0), "{s:?}");
    assert_eq!(s.entries, n as u64, "{s:?}");
    assert!(
        monitor::bridges().unwrap() > bridges,
        "never out of VMAs: the test does not test the limit"
    );
    // Every entry is a hit now.
    for i in (0..n).step_by(7) {
        drop(cache.raw(at(i), PAGE, RW).unwrap());
    }
    assert_eq!(cache.stats().misses, s.misses);

    // Pages dropped under entries attached by a bridge (the last ones) and under entries
    // attached exactly (the first ones): each such entry is invalidated, and the next lookup
    // registers the current pages.
    for first in [0, n - 64] {
        let (a, b) = (at(first), at(first + 32));
        let inval = cache.stats().invalidations;
        // SAFETY: the test's own mapping; the device reads it only through the registrations
        // this test checks below.
        unsafe {
            rustix::mm::madvise(
                a as *mut _,
                (b - a) as usize,
                rustix::mm::Advice::LinuxDontNeed,
            )
        }
        .unwrap();
        let misses = cache.stats().misses;
        for i in first..first + 32 {
            let h = cache.raw(at(i), PAGE, RW).unwrap();
            assert_translates(&ctx, &pd, &h, at(i), PAGE);
            assert_pfns_current(&ctx, h.lkey(), at(i), PAGE);
        }
        let s = cache.stats();
        assert_eq!(
            s.misses - misses,
            32,
            "entries {first}..+32 not invalidated: {s:?}"
        );
        assert!(s.invalidations >= inval + 32, "{s:?}");
    }
    drop(cache);
    drop(m);
}

/// A gap the monitor's userfaultfd cannot attach (a file mapping between two cached pages):
/// the bridge fails and the range is attached alone, cached and monitored as without it.
#[test]
fn a_gap_with_a_file_mapping_falls_back_to_the_range_alone() {
    let Some((ctx, pd, cache)) = monitored_cache() else {
        return;
    };
    let m = Map::new(3 * PAGE as usize);
    // `create_new` (O_EXCL): a file or symlink planted at the name fails the test instead of
    // being followed and truncated.
    let path = std::env::temp_dir().join(format!("mrkit-gap-{}", std::process::id()));
    let file = std::fs::File::options()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    file.set_len(PAGE).unwrap();
    std::fs::remove_file(&path).unwrap();
    // SAFETY: replaces the middle page of the test's own mapping (nothing borrows it) with a
    // shared mapping of the test's own file; unmapped with `m`.
    let p = unsafe {
        rustix::mm::mmap(
            (m.addr + PAGE) as *mut _,
            PAGE as usize,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::SHARED | rustix::mm::MapFlags::FIXED,
            &file,
            0,
        )
    }
    .unwrap();
    assert_eq!(p as u64, m.addr + PAGE);
    for at in [m.addr, m.addr + 2 * PAGE] {
        let h = cache.raw(at, PAGE, RW).unwrap();
        assert_translates(&ctx, &pd, &h, at, PAGE);
    }
    let s = cache.stats();
    assert_eq!((s.entries, s.uncached, s.unmonitored), (2, 0, 0), "{s:?}");
    // Both are monitored: dropping their pages invalidates them.
    m.dontneed();
    let misses = cache.stats().misses;
    for at in [m.addr, m.addr + 2 * PAGE] {
        drop(cache.raw(at, PAGE, RW).unwrap());
    }
    assert_eq!(cache.stats().misses, misses + 2, "{:?}", cache.stats());
}
