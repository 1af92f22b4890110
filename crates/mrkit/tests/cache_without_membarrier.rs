//! The cache where the kernel refuses `membarrier` (kernels before 4.14, seccomp sandboxes):
//! the lease protocol falls back to symmetric barriers — a hit has a full fence, every
//! handle drop takes the read-modify-write path, and no record is made current (its hit
//! tests no barrier flag). This binary installs a seccomp filter that fails `membarrier`
//! with `ENOSYS` before its first cache exists (the barrier kind is decided then), and
//! checks the hit path's rules under it: warm hits stay per-thread, handles dropped on the
//! owner thread, on another thread and cloned retire a killed entry exactly when the last
//! goes, and a lookup after an invalidation never gets the old registration.
//!
//! One test function: the filter and the decision are process-wide.

mod cache_util;
mod providers_util;

use std::sync::mpsc;

use cache_util::*;
use mrkit::cache::{test_support, CacheConfig, RegCache};
use mrkit::AccessFlags;

const RW: AccessFlags = AccessFlags::LOCAL_WRITE;
const PAGE: u64 = 4096;

/// Make `membarrier` fail with `ENOSYS` on every thread of this process from now on; `false`
/// (with a note) where this kernel or sandbox lets no seccomp filter be installed.
fn deny_membarrier() -> bool {
    #[cfg(target_arch = "x86_64")]
    const ARCH: u32 = 0xC000_003E; // AUDIT_ARCH_X86_64
    #[cfg(target_arch = "aarch64")]
    const ARCH: u32 = 0xC000_00B7; // AUDIT_ARCH_AARCH64
    let stmt = |code: u32, k: u32| libc::sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    };
    let jeq = |k: u32, jt: u8, jf: u8| libc::sock_filter {
        code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
        jt,
        jf,
        k,
    };
    let load = libc::BPF_LD | libc::BPF_W | libc::BPF_ABS;
    let ret = libc::BPF_RET | libc::BPF_K;
    // struct seccomp_data: nr at offset 0, arch at 4.
    let mut prog = [
        stmt(load, 4),
        jeq(ARCH, 0, 3),
        stmt(load, 0),
        jeq(libc::SYS_membarrier as u32, 0, 1),
        stmt(ret, libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
        stmt(ret, libc::SECCOMP_RET_ALLOW),
    ];
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_mut_ptr(),
    };
    // SAFETY: plain prctl and seccomp calls; `fprog` points to `prog`, alive across the call
    // (the kernel copies the program).
    unsafe {
        assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
        let r = libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            libc::SECCOMP_FILTER_FLAG_TSYNC,
            &fprog as *const libc::sock_fprog,
        );
        if r != 0 {
            let e = std::io::Error::last_os_error();
            // A kernel without seccomp filters, or a sandbox refusing `seccomp` itself.
            if matches!(
                e.raw_os_error(),
                Some(libc::EINVAL | libc::ENOSYS | libc::EPERM | libc::EACCES)
            ) {
                eprintln!("seccomp filters unavailable here ({e}): test skipped");
                return false;
            }
            panic!("seccomp: {e}");
        }
        assert_eq!(libc::syscall(libc::SYS_membarrier, 0, 0, 0), -1);
    }
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::ENOSYS)
    );
    true
}

fn explicit(max_entries: usize) -> CacheConfig {
    CacheConfig {
        monitor: cache_util::explicit_only(),
        max_entries,
        ..CacheConfig::default()
    }
}

#[test]
fn without_membarrier_the_hit_path_keeps_every_rule() {
    if !deny_membarrier() {
        return;
    }
    let (ctx, pd) = open();
    let cache = RegCache::new(&pd, explicit(4096)).unwrap();
    assert!(
        !test_support::asymmetric_barrier(),
        "the barrier kind was decided before the filter"
    );

    // Warm hits over many buffers stay on the per-thread path, each with its own keys.
    let n = 256usize;
    let m = Map::new(n * PAGE as usize);
    let keys: Vec<u32> = (0..n as u64)
        .map(|i| cache.raw(m.addr + i * PAGE, PAGE, RW).unwrap().lkey())
        .collect();
    let s0 = cache.stats();
    for round in 0..4u64 {
        for i in 0..n as u64 {
            let i = (i * 97 + round * 31) % n as u64;
            let h = cache.raw(m.addr + i * PAGE, PAGE, RW).unwrap();
            assert_eq!(
                h.lkey(),
                keys[i as usize],
                "buffer {i}: another registration"
            );
        }
    }
    let s1 = cache.stats();
    assert_eq!(s1.misses, s0.misses, "warm lookups missed");
    assert_eq!(
        s1.fast_hits - s0.fast_hits,
        4 * n as u64,
        "hits left the thread's path"
    );

    // Killed with handles out: on this (the owner) thread, a clone of it, and one sent to
    // another thread. Each registration goes exactly with its entry's last handle.
    let own = cache.raw(m.addr, PAGE, RW).unwrap();
    let cloned = cache.raw(m.addr + PAGE, PAGE, RW).unwrap();
    let twin = cloned.clone();
    let sent = cache.raw(m.addr + 2 * PAGE, PAGE, RW).unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::scope(|s| {
        let t = s.spawn(move || {
            let h: mrkit::cache::RegHandle = rx.recv().unwrap();
            drop(h);
        });
        assert_eq!(cache.invalidate(m.addr, n as u64 * PAGE), n);
        assert_live_mrs(&ctx, 3, "after the invalidation (three entries in use)");
        for (h, a) in [
            (&own, m.addr),
            (&cloned, m.addr + PAGE),
            (&sent, m.addr + 2 * PAGE),
        ] {
            assert!(!h.is_cached());
            assert_translates(&ctx, &pd, h, a, PAGE);
        }
        let own_key = own.lkey();
        drop(own);
        assert!(!key_valid(&ctx, &pd, own_key, m.addr));
        assert_live_mrs(&ctx, 2, "after the owner thread's drop");
        drop(cloned);
        assert_live_mrs(&ctx, 2, "a clone is still out");
        drop(twin);
        assert_live_mrs(&ctx, 1, "after the clone's drop");
        let sent_key = sent.lkey();
        tx.send(sent).unwrap();
        t.join().unwrap();
        assert!(!key_valid(&ctx, &pd, sent_key, m.addr + 2 * PAGE));
        assert_live_mrs(&ctx, 0, "after the other thread's drop");
    });

    // Hits on another thread racing invalidations here: a lookup that starts after an
    // invalidation returned never gets the registration it killed.
    let n = 64usize;
    let m = Map::new(n * PAGE as usize);
    let stop = std::sync::atomic::AtomicBool::new(false);
    /// Stops the hitting thread when dropped (also when an assertion below fails).
    struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
    std::thread::scope(|s| {
        let _stop = Stop(&stop);
        let (c, base, stop) = (&cache, m.addr, &stop);
        s.spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for i in 0..n as u64 {
                    drop(c.raw(base + i * PAGE, PAGE, RW).unwrap());
                }
            }
        });
        for _ in 0..200 {
            // Only this thread invalidates: a handle taken after it is of a live entry.
            cache.invalidate(m.addr, n as u64 * PAGE);
            for i in 0..n as u64 {
                let h = cache.raw(m.addr + i * PAGE, PAGE, RW).unwrap();
                assert!(h.is_cached(), "buffer {i}: a killed registration served");
            }
        }
    });
    let s = cache.stats();
    assert_eq!(s.registrations - s.deregistrations, s.entries);
    drop(cache);
    assert_live_mrs(&ctx, 0, "after the cache's drop");
}
