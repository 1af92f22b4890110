//! The userfaultfd monitor keeps ranges attached after their last cache entry goes (so a
//! repeated miss costs no `UFFDIO_REGISTER` and no VMA split + merge). These tests check
//! the invariants that makes necessary. Alone in their own test binary (= own process):
//! they count the process-wide monitor's registrations and read `/proc/self/maps`.

mod cache_util;
mod providers_util;

use cache_util::*;
use mrkit::cache::test_support::monitor;
use mrkit::AccessFlags;

const RW: AccessFlags = AccessFlags::LOCAL_WRITE;
const PAGE: u64 = 4096;

fn registrations() -> u64 {
    monitor::registrations().unwrap()
}

/// Replace one page of `m` with a fresh anonymous page (munmap + mmap in one call: the
/// kernel reports an UNMAP of that page and never leaves a hole).
fn replace_page(at: u64, fill: u8) {
    // SAFETY: `at` is a page of a test mapping nothing borrows; it is replaced in place.
    unsafe {
        let p = rustix::mm::mmap_anonymous(
            at as *mut _,
            PAGE as usize,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::PRIVATE | rustix::mm::MapFlags::FIXED,
        )
        .unwrap();
        assert_eq!(p as u64, at);
        std::ptr::write_bytes(at as *mut u8, fill, PAGE as usize);
    }
}

#[test]
fn sticky_attachment_invariants() {
    // One test function: the three parts share the process-wide monitor and its counters.
    let Some((ctx, pd, cache)) = monitored_cache() else {
        return;
    };
    assert!(cache.is_monitored());

    // 1. Repeated misses on one buffer register it with userfaultfd once.
    let m = Map::new(64 << 10);
    let r0 = registrations();
    for _ in 0..50 {
        let h = cache.raw(m.addr, PAGE, RW).unwrap();
        drop(h);
        cache.invalidate(m.addr, PAGE);
    }
    assert_eq!(cache.stats().misses, 50, "{:?}", cache.stats());
    assert_eq!(
        registrations() - r0,
        1,
        "each miss re-registered the range with userfaultfd"
    );

    // 2. A range cached inside a larger attached piece is invalidated when just its page is
    //    unmapped, and the new mapping there is attached again (the record of attached
    //    pages never outlives the attachment).
    let h = cache.raw(m.addr, 64 << 10, RW).unwrap();
    drop(h);
    cache.invalidate(m.addr, 64 << 10);
    let mid = m.addr + 4 * PAGE;
    let r1 = registrations();
    let h = cache.raw(mid, PAGE, RW).unwrap();
    assert_eq!(
        registrations(),
        r1,
        "page inside an attached piece registered again"
    );
    let mut old = h.lkey();
    drop(h);
    for round in 0..3u8 {
        let before = cache.stats().monitor_events;
        replace_page(mid, 0x60 + round);
        let h = cache.raw(mid, PAGE, RW).unwrap();
        // (Counted once delivered: the lookup above waited for that.)
        assert!(
            cache.stats().monitor_events > before,
            "round {round}: unmap of a cached page not reported"
        );
        assert_ne!(h.lkey(), old, "round {round}: stale registration served");
        assert!(
            !key_valid(&ctx, &pd, old, mid),
            "round {round}: old MR kept"
        );
        assert_pfns_current(&ctx, h.lkey(), mid, PAGE);
        assert_eq!(
            read_through_key(&ctx, &pd, h.lkey(), mid, 16),
            vec![0x60 + round; 16]
        );
        old = h.lkey();
        drop(h);
    }
    // Each replaced page was not attached any more: each miss had to register it.
    assert_eq!(registrations(), r1 + 3, "new mapping taken for attached");
    drop(m);

    // 3. Idle attachments are bounded (VMAs do not creep) and released by flush_idle.
    let n = monitor::IDLE_CAP as u64 + 64;
    let big = Map::new((2 * n * PAGE) as usize);
    let (a, b) = (big.addr, big.addr + 2 * n * PAGE);
    for i in 0..n {
        // Every other page: idle ranges never coalesce, each splits the VMA.
        let at = a + 2 * i * PAGE;
        drop(cache.raw(at, PAGE, RW).unwrap());
        cache.invalidate(at, PAGE);
    }
    let split = vmas_in(a, b);
    assert!(
        split <= 2 * monitor::IDLE_CAP + 2,
        "{split} VMAs: idle attachments not bounded"
    );
    assert!(split > 1, "idle ranges not kept attached");
    cache.flush_idle();
    assert_eq!(vmas_in(a, b), 1, "flush_idle left idle ranges attached");
}
