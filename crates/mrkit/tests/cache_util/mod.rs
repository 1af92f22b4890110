//! Helpers shared by the pool/cache tests: anonymous mappings, device-side checks.
#![allow(dead_code)]

use std::os::unix::fs::FileExt;

use mrkit::cache::{MonitorMode, RegCache, RegHandle, Registration};
use mrkit::{
    AccessFlags, Buffer, Context, LocalSlice, MemoryRegion, ProtectionDomain, QpCap, QueuePair,
    WcStatus,
};

use crate::providers_util::KeySlice;
use mrkit_soft::mr::{AccessDenied, KeyUse, MrGuard};

pub fn open() -> (Context, ProtectionDomain) {
    let ctx = crate::providers_util::open();
    let pd = ctx.alloc_pd().unwrap();
    (ctx, pd)
}

/// The cache tests drive the raw-address lookups (`RegCache::get_raw`, `get_or_bounce_raw`)
/// on the tests' own memory.
pub trait RawGet {
    /// `RegCache::get_raw`.
    fn raw(&self, addr: u64, len: u64, access: AccessFlags) -> mrkit::Result<RegHandle>;
    /// `RegCache::get_or_bounce_raw`.
    fn raw_or_bounce(
        &self,
        addr: u64,
        len: u64,
        access: AccessFlags,
    ) -> mrkit::Result<Registration>;
}

impl RawGet for RegCache {
    fn raw(&self, addr: u64, len: u64, access: AccessFlags) -> mrkit::Result<RegHandle> {
        // SAFETY: test memory only: the tests' own anonymous mappings (`Map`) and buffers, which
        // no other Rust value uses; a test unmaps or remaps one under a cached entry only to
        // check how the cache and its monitor handle it (what the contract rules out for
        // applications is exactly what these tests exercise, on memory nothing else reads).
        unsafe { self.get_raw(addr, len, access) }
    }
    fn raw_or_bounce(
        &self,
        addr: u64,
        len: u64,
        access: AccessFlags,
    ) -> mrkit::Result<Registration> {
        // SAFETY: as `raw`.
        unsafe { self.get_or_bounce_raw(addr, len, access) }
    }
}

/// A cache of `shape` on `pd`, invalidated explicitly ([`explicit_only`]).
pub fn shaped_cache(pd: &ProtectionDomain, shape: mrkit::cache::Shape) -> RegCache {
    RegCache::new(
        pd,
        mrkit::cache::CacheConfig {
            shape,
            monitor: explicit_only(),
            ..mrkit::cache::CacheConfig::default()
        },
    )
    .unwrap()
}

/// `MonitorMode::explicit_only()` for the tests, which invalidate what they unmap (or unmap
/// only to test what the cache does without the monitor).
pub fn explicit_only() -> MonitorMode {
    // SAFETY: test memory only (see `RawGet::raw`).
    unsafe { MonitorMode::explicit_only() }
}

pub fn live_mrs(ctx: &Context) -> u64 {
    ctx.soft().unwrap().stats().mrs_live
}

/// mrkit0's count of live MRs is `want`. libibverbs cannot count a device's MRs: on the
/// rdma-core provider this check says so (`needs_native`, once per test) and is not made.
#[track_caller]
pub fn assert_live_mrs(ctx: &Context, want: u64, what: &str) {
    if crate::providers_util::needs_native("counts mrkit-soft's live MRs") {
        return;
    }
    assert_eq!(live_mrs(ctx), want, "{what}");
}

/// mrkit0's count of live MRs, or `None` on the rdma-core provider (which cannot count them:
/// said once per test, as in [`assert_live_mrs`]).
pub fn native_live_mrs(ctx: &Context) -> Option<u64> {
    if crate::providers_util::needs_native("counts mrkit-soft's live MRs") {
        return None;
    }
    Some(live_mrs(ctx))
}

/// The probing QPs and the scratch MR, kept per thread and PD while their QP is usable (a
/// failed WRITE moves it to ERR: the next probe makes a new pair).
struct Probe {
    pd: ProtectionDomain,
    q1: QueuePair<KeySlice>,
    _q2: QueuePair,
    scratch: MemoryRegion,
}

thread_local! {
    static PROBE: std::cell::RefCell<Option<Probe>> = const { std::cell::RefCell::new(None) };
}

/// Run `f` on this thread's probe pair for `pd` with a scratch MR of at least `len` bytes
/// (made on first use or after a failed probe); `f` returns whether the pair is still usable.
fn with_probe<R>(pd: &ProtectionDomain, len: u64, f: impl FnOnce(&mut Probe) -> (R, bool)) -> R {
    let same = |p: &Probe| {
        p.pd.handle() == pd.handle()
            && std::sync::Arc::ptr_eq(p.pd.context().provider(), pd.context().provider())
            && p.scratch.info().length >= len
    };
    PROBE.with(|cell| {
        let mut cell = cell.borrow_mut();
        if !cell.as_ref().is_some_and(same) {
            *cell = None; // the old pair and scratch go first
            let q1 = QueuePair::new_typed(pd, QpCap::default()).unwrap();
            let q2 = QueuePair::new(pd, QpCap::default()).unwrap();
            QueuePair::connect(&q1, &q2, AccessFlags::REMOTE_WRITE).unwrap();
            let scratch = pd
                .register(
                    Buffer::new(len.max(64 << 10) as usize).unwrap(),
                    AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
                )
                .unwrap();
            *cell = Some(Probe {
                pd: pd.clone(),
                q1,
                _q2: q2,
                scratch,
            });
        }
        let (r, usable) = f(cell.as_mut().unwrap());
        if !usable {
            *cell = None;
        }
        r
    })
}

/// A device-side look at a key, on any provider: an RDMA WRITE whose gather list is
/// `[addr, addr+len)` under `key`, from a QP of `pd` to a scratch MR of the same PD. The device
/// checks the key as a local key (PD, range, no rights asked for) and reads the bytes through
/// its translation: `Some(bytes)` when it accepted the key, `None` when the WRITE completed
/// with an error. mrkit0 answers the same question from its key table (`check_local`).
pub fn write_through_key(pd: &ProtectionDomain, key: u32, addr: u64, len: u64) -> Option<Vec<u8>> {
    with_probe(pd, len, |p| {
        let wc =
            p.q1.write(
                &KeySlice(LocalSlice {
                    addr,
                    len: u32::try_from(len).unwrap(),
                    lkey: key,
                }),
                0..len,
                p.scratch.remote(0..len).unwrap(),
            )
            .unwrap();
        if wc.status == WcStatus::Success {
            (Some(p.scratch.as_slice()[..len as usize].to_vec()), true)
        } else {
            (None, false)
        }
    })
}

/// [`key_valid`] for each `(key, addr)`, in order. On a provider other than mrkit0 the
/// WRITEs of [`write_through_key`] are posted as one pipeline (up to the send queue's depth
/// at a time) instead of one round trip each; when one of a batch fails, the QP goes to ERR
/// and flushes the rest, so that batch is probed again one by one, on fresh pairs, to say
/// which key failed.
pub fn keys_valid(ctx: &Context, pd: &ProtectionDomain, probes: &[(u32, u64)]) -> Vec<bool> {
    if ctx.soft().is_some() {
        return probes
            .iter()
            .map(|&(k, a)| key_valid(ctx, pd, k, a))
            .collect();
    }
    let mut out = Vec::with_capacity(probes.len());
    for batch in probes.chunks(QpCap::default().max_send_wr as usize) {
        let all_ok = with_probe(pd, batch.len() as u64, |p| {
            for (i, &(key, addr)) in batch.iter().enumerate() {
                let i = i as u64;
                let remote = p.scratch.remote(i..i + 1).unwrap();
                if p.q1
                    .post_write(
                        KeySlice(LocalSlice {
                            addr,
                            len: 1,
                            lkey: key,
                        }),
                        0..1,
                        remote,
                    )
                    .is_err()
                {
                    return (false, false);
                }
            }
            let done = p.q1.wait_all(std::time::Duration::from_secs(30)).unwrap();
            let ok =
                done.len() == batch.len() && done.iter().all(|c| c.wc.status == WcStatus::Success);
            (ok, ok)
        });
        if all_ok {
            out.extend(batch.iter().map(|_| true));
        } else {
            out.extend(
                batch
                    .iter()
                    .map(|&(k, a)| write_through_key(pd, k, a, 1).is_some()),
            );
        }
    }
    out
}

/// An anonymous mapping we can unmap and remap at the same address.
pub struct Map {
    pub addr: u64,
    pub len: usize,
}

impl Map {
    pub fn new(len: usize) -> Map {
        // SAFETY: fresh anonymous mapping at a kernel-chosen address.
        let p = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        }
        .unwrap();
        let m = Map {
            addr: p as u64,
            len,
        };
        m.fill(0);
        m
    }
    pub fn fill(&self, b: u8) {
        // SAFETY: our own mapping.
        unsafe { std::ptr::write_bytes(self.addr as *mut u8, b, self.len) };
    }
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: our own mapping, alive while self lives.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }
    /// Replace the mapping with fresh anonymous memory at the same address: one
    /// `mmap(MAP_FIXED)` over the old mapping, which the kernel performs as munmap + mmap
    /// (the old pages are freed, userfaultfd gets the UNMAP event, the caller blocks until
    /// the monitor has read it) without ever leaving a hole.
    ///
    /// Not `munmap` followed by `mmap(MAP_FIXED)`: between the two calls another thread of
    /// the test process (another test, the allocator, a thread stack) can be given the hole,
    /// and MAP_FIXED then silently clobbers its memory. That race made
    /// `cache_basic::vma_split_lasts_only_as_long_as_the_registration` fail with EFAULT /
    /// stray VMA splits when it ran next to the userfaultfd remap test.
    pub fn remap_fixed(&mut self) {
        // SAFETY: replaces our own mapping (same range); nothing borrows it.
        unsafe {
            let p = rustix::mm::mmap_anonymous(
                self.addr as *mut _,
                self.len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE | rustix::mm::MapFlags::FIXED,
            )
            .unwrap();
            assert_eq!(p as u64, self.addr);
        }
        self.fill(0);
    }
    pub fn dontneed(&self) {
        // SAFETY: drops the pages of our own mapping (they read back as zero).
        unsafe {
            rustix::mm::madvise(
                self.addr as *mut _,
                self.len,
                rustix::mm::Advice::LinuxDontNeed,
            )
            .unwrap()
        };
        self.fill(0);
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        let _ = unsafe { rustix::mm::munmap(self.addr as *mut _, self.len) };
    }
}

/// The device's local-key check of `key` for `[addr, addr+len)` in `pd` (no access rights
/// asked for): the guard keeps the MR and its pinned pages while it lives.
pub fn check_local(
    ctx: &Context,
    pd: &ProtectionDomain,
    key: u32,
    addr: u64,
    len: u64,
) -> Result<MrGuard, AccessDenied> {
    ctx.soft().unwrap().check_access(
        key,
        pd.handle(),
        AccessFlags::empty(),
        addr,
        len,
        KeyUse::Local,
        0,
    )
}

/// The device accepts `key` for a byte at `addr` in `pd` (mrkit0: its key table; another
/// provider: [`write_through_key`]).
pub fn key_valid(ctx: &Context, pd: &ProtectionDomain, key: u32, addr: u64) -> bool {
    if ctx.soft().is_none() {
        return write_through_key(pd, key, addr, 1).is_some();
    }
    check_local(ctx, pd, key, addr, 1).is_ok()
}

/// The device accepts `key` for `[addr, addr+len)` and reads that memory through it (mrkit0:
/// its key table, which must translate to `addr` itself; another provider: the bytes a WRITE
/// through the key carries are the bytes at `addr`).
pub fn assert_translates_key(ctx: &Context, pd: &ProtectionDomain, key: u32, addr: u64, len: u64) {
    if ctx.soft().is_none() {
        let got = write_through_key(pd, key, addr, len)
            .unwrap_or_else(|| panic!("key {key:#x} refuses {addr:#x}+{len}"));
        // SAFETY: the test's own memory, registered under `key` (the WRITE just read it).
        let here = unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) };
        assert!(
            got == here,
            "key {key:#x} at {addr:#x}+{len} reads other bytes"
        );
        return;
    }
    let g = check_local(ctx, pd, key, addr, len)
        .unwrap_or_else(|e| panic!("key {key:#x} refuses {addr:#x}+{len}: {e:?}"));
    assert_eq!(g.va, addr);
}

pub fn assert_translates(ctx: &Context, pd: &ProtectionDomain, h: &RegHandle, addr: u64, len: u64) {
    for s in h.sges_at(addr, len).unwrap() {
        assert_translates_key(ctx, pd, s.lkey, s.addr, u64::from(s.len));
    }
}

/// Bytes the device reads through `key` at `addr` (the translated VA of `check_access`).
pub fn read_through_key(
    ctx: &Context,
    pd: &ProtectionDomain,
    key: u32,
    addr: u64,
    len: u64,
) -> Vec<u8> {
    if ctx.soft().is_none() {
        return write_through_key(pd, key, addr, len)
            .unwrap_or_else(|| panic!("key {key:#x} refuses {addr:#x}+{len}"));
    }
    let g = check_local(ctx, pd, key, addr, len).unwrap();
    // SAFETY: the guard keeps the MR (and its pinned pages) registered; the VA is mapped.
    unsafe { std::slice::from_raw_parts(g.va as *const u8, len as usize) }.to_vec()
}

/// Current frame numbers of the pages of `[addr, addr+len)` (empty without CAP_SYS_ADMIN).
pub fn current_pfns(addr: u64, len: u64) -> Vec<u64> {
    let f = std::fs::File::open("/proc/self/pagemap").unwrap();
    let ps = 4096u64;
    let first = addr / ps;
    let last = (addr + len - 1) / ps;
    let mut buf = vec![0u8; ((last - first + 1) * 8) as usize];
    f.read_exact_at(&mut buf, first * 8).unwrap();
    buf.chunks(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()) & ((1 << 55) - 1))
        .collect()
}

/// The MR's recorded frames equal the frames mapped now (the UCX CHECK_PFN test): a stale
/// registration pins the frames of an old mapping.
pub fn assert_pfns_current(ctx: &Context, key: u32, addr: u64, len: u64) {
    if crate::providers_util::needs_native(
        "compares an MR's recorded page frames in mrkit-soft with the mapping's",
    ) {
        return;
    }
    let mr = ctx.soft().unwrap().mr_object(key).expect("MR exists");
    let pf = mr.pfns();
    if pf.is_empty() {
        return; // frame numbers not readable (no CAP_SYS_ADMIN): key checks only
    }
    let cur = current_pfns(mr.iova(), mr.length());
    assert_eq!(
        pf, cur,
        "MR {key:#x} pins frames that are no longer mapped at {addr:#x}+{len}"
    );
}

/// The default (userfaultfd) cache configuration, or `None` with a note when userfaultfd is
/// not available here (seccomp in containers, no privilege).
pub fn monitored_config() -> Option<mrkit::cache::CacheConfig> {
    let (_ctx, pd) = open();
    match mrkit::cache::RegCache::new(&pd, mrkit::cache::CacheConfig::default()) {
        Ok(_) => Some(mrkit::cache::CacheConfig::default()),
        Err(e) => {
            eprintln!("userfaultfd unavailable, monitor part skipped: {e}");
            None
        }
    }
}

/// A device, a PD and a cache with the default (userfaultfd) monitor, or `None` with a note
/// when userfaultfd is not available here (see [`monitored_config`]).
pub fn monitored_cache() -> Option<(Context, ProtectionDomain, RegCache)> {
    let cfg = monitored_config()?;
    let (ctx, pd) = open();
    let cache = RegCache::new(&pd, cfg).unwrap();
    Some((ctx, pd, cache))
}

/// VMAs of /proc/self/maps that intersect `[a, b)`.
pub fn vmas_in(a: u64, b: u64) -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter_map(|l| {
            let (s, e) = l.split_whitespace().next()?.split_once('-')?;
            Some((
                u64::from_str_radix(s, 16).ok()?,
                u64::from_str_radix(e, 16).ok()?,
            ))
        })
        .filter(|&(s, e)| s < b && e > a)
        .count()
}
