//! userfaultfd memory monitor: the kernel tells us when a cached range is unmapped
//! (`munmap`, `brk` shrink), has its pages dropped (`madvise(MADV_DONTNEED/REMOVE)`) or is
//! moved (`mremap`), so the cache can invalidate before it ever serves a stale translation.
//!
//! # Registration mode: WP, not MISSING
//!
//! Non-cooperative events (`UFFD_FEATURE_EVENT_UNMAP | EVENT_REMOVE | EVENT_REMAP`) are
//! delivered for every VMA registered with the userfaultfd, whatever the mode. The mode only
//! decides which *page faults* are sent to us:
//!
//! * `UFFDIO_REGISTER_MODE_MISSING` (what libfabric uses) forwards every fault on a missing
//!   page: after `MADV_DONTNEED` of a cached buffer, the application's next touch would sleep
//!   until this thread answers with `UFFDIO_ZEROPAGE`/`UFFDIO_COPY` — a latency hazard, and a
//!   deadlock if the monitor is itself blocked (ofiwg/libfabric#5554).
//! * `UFFDIO_REGISTER_MODE_WP` forwards only write faults on pages *write-protected through
//!   `UFFDIO_WRITEPROTECT`*. We never write-protect anything, so **no fault ever blocks**; the
//!   mode exists here only to attach the VMA to our userfaultfd and get the events.
//!
//! Registration fails on mappings userfaultfd cannot track (some file/device mappings, or a
//! VMA already registered with another userfaultfd): the cache then returns an *uncached*
//! registration for that range and counts it (`unmonitored`), never a cached one it cannot
//! invalidate.
//!
//! # Ordering guarantee (the "unmap returns before the cache forgets" gap)
//!
//! The kernel blocks the unmapping thread until the monitor has *read* the event. The
//! monitor makes the global sequence [`seq`] odd *before* reading and even again only after
//! the ranges are queued on every subscribed cache. A lookup started after `munmap` returned
//! therefore sees an odd sequence (and waits) or a changed even one with the pending range
//! queued (and drains it first): a freed-and-remapped address never gets the old
//! registration.
//!
//! # Sticky attachment (why a miss costs no `UFFDIO_REGISTER` most of the time)
//!
//! Attaching a page range in the middle of a larger anonymous VMA splits that VMA (the range
//! gets its own userfaultfd context), and detaching it merges the pieces back: two VMA
//! rewrites under the `mmap` write lock, several microseconds per cache miss. So pages whose
//! last cache entry goes away are *not* detached at once: they stay attached in an idle set
//! of at most [`IDLE_CAP`] disjoint ranges (adjacent idle pages coalesce, so misses spread
//! over one buffer make one range; past the cap, ranges are detached in address order by a
//! clock hand; all of them at [`Monitor::release_idle`], which `RegCache::flush_idle`
//! calls), and a later miss on memory the monitor knows to be attached only counts it. The
//! first miss on a page still registers it (and splits its VMA).
//!
//! "Known to be attached" ([`Monitor::attach`]'s record) must never outlive the attachment:
//! the kernel drops it when the VMA goes (`munmap`, `mmap(MAP_FIXED)` over it, `brk`
//! shrink, `mremap` away), and a new mapping at the same address is *not* attached. Each of
//! those delivers an UNMAP or REMAP event for the attached range, which the monitor thread
//! queues on a set of its own exactly like on a cache's ([`Pending`]) before the sequence
//! goes even. An attach first waits for an even sequence and removes the queued ranges from
//! the record, so memory unmapped before the attach began is registered again, never taken
//! for attached (if the monitor stalls for a second, the attach registers unconditionally).
//! `MADV_DONTNEED`/`MADV_REMOVE` keep the VMA and its attachment, so they do not touch the
//! record. Only the exact page spans registered successfully enter the record (never a
//! wider window: the kernel accepts a register over holes, and a hole filled later would
//! not be attached).
//!
//! The cost of the idle set: an `munmap` or `MADV_DONTNEED` of an idle range waits for the
//! monitor to read its event (as it did while the range was cached) and sends each
//! cache's next lookup through its slow path once, the VMA stays split until the range is
//! released (at most two extra VMAs per idle range; a registration that fails with
//! `ENOMEM`, out of VMAs, releases every idle range and retries once), and another
//! userfaultfd cannot register it meanwhile.
//!
//! # Bridged gaps (why scattered buffers do not run the process out of VMAs)
//!
//! A page attached alone in its mapping splits it in three. Buffers scattered over one
//! mapping (allocated one by one) would each cost two VMAs, and at the default
//! `vm.max_map_count` of 65,530 about 32,000 of them exhaust the process: from then on every
//! `mmap` of the process fails, the device's own pinning included. So an attach whose range
//! has an attached neighbour at most [`MAX_BRIDGE`] below or above registers the gap between
//! them too: the gap's VMA is attached whole and merges with its neighbours, and scattered
//! buffers keep their mapping in a few pieces. The gaps are recorded apart (`bridged`): only
//! the range itself enters the record of attached pages (a hole in a gap, filled by a later
//! mapping, is not attached, so a gap is never taken for attached), and a gap is detached
//! with an idle range next to it, so `flush_idle` still merges every VMA back. The cost: an
//! `munmap` or `MADV_DONTNEED` of gap memory (not cached: the application's memory between
//! its buffers) waits for the monitor to read its event and sends each cache's next lookup
//! through the slow path once, as for an idle range. A gap this userfaultfd cannot attach
//! (a file mapping in it, another userfaultfd's memory) falls back to the range alone.
//!
//! # Deadlock rules
//!
//! The monitor thread reads events before taking any lock, never blocks on the subscriber
//! list (try-lock, retried after the next read), never registers or deregisters memory, and
//! never frees memory in its loop (buffers are reused). Pending queues are bounded and
//! coalescing ([`Pending`]).
//!
//! Its `unsafe` is raw syscalls and ioctls; the cache's other modules with `unsafe` are `lease`
//! (entry memory behind raw pointers) and `raw` (the unsafe entry points and `Registered` impls).

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use mrkit_soft::mem::range_count::RangeCounter;
use parking_lot::Mutex;

const UFFD_API: u64 = 0xAA;
const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;
const UFFDIO_REGISTER: libc::c_ulong = 0xc020_aa00;
const UFFDIO_UNREGISTER: libc::c_ulong = 0x8010_aa01;
const USERFAULTFD_IOC_NEW: libc::c_ulong = 0xaa00;
const UFFD_USER_MODE_ONLY: libc::c_int = 1;

/// `UFFD_FEATURE_EVENT_REMAP`.
pub const FEATURE_EVENT_REMAP: u64 = 1 << 2;
/// `UFFD_FEATURE_EVENT_REMOVE`.
pub const FEATURE_EVENT_REMOVE: u64 = 1 << 3;
/// `UFFD_FEATURE_EVENT_UNMAP`.
pub const FEATURE_EVENT_UNMAP: u64 = 1 << 6;

const MODE_WP: u64 = 2;

const EVENT_REMAP: u8 = 0x14;
const EVENT_REMOVE: u8 = 0x15;
const EVENT_UNMAP: u8 = 0x16;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

/// `struct uffd_msg` (32 bytes, packed: the union starts at offset 8).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct UffdMsg {
    event: u8,
    _r1: u8,
    _r2: u16,
    _r3: u32,
    arg: [u64; 3],
}

/// An address-space change reported by the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// `[start, end)` unmapped.
    Unmap(u64, u64),
    /// `[start, end)` pages dropped (`MADV_DONTNEED`/`MADV_REMOVE`).
    Remove(u64, u64),
    /// `mremap`: `len` bytes moved from `from` to `to`.
    Remap {
        /// Old address.
        from: u64,
        /// New address.
        to: u64,
        /// Length.
        len: u64,
    },
}

impl Event {
    /// The range whose old translation is now invalid.
    pub fn stale_range(self) -> (u64, u64) {
        match self {
            Event::Unmap(s, e) | Event::Remove(s, e) => (s, e),
            Event::Remap { from, len, .. } => (from, from.saturating_add(len)),
        }
    }
}

/// A userfaultfd with the non-cooperative events enabled.
#[derive(Debug)]
pub struct Uffd {
    fd: OwnedFd,
}

fn last_err() -> io::Error {
    io::Error::last_os_error()
}

impl Uffd {
    /// Open a userfaultfd (syscall, then `/dev/userfaultfd`) and enable UNMAP, REMOVE and
    /// REMAP events. Fails with the reason when userfaultfd is unavailable (seccomp in
    /// containers, `vm.unprivileged_userfaultfd = 0` without privileges).
    pub fn open() -> io::Result<Uffd> {
        let fd = Self::raw_open()?;
        let want = FEATURE_EVENT_UNMAP | FEATURE_EVENT_REMOVE | FEATURE_EVENT_REMAP;
        let mut api = UffdioApi {
            api: UFFD_API,
            features: want,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_API reads and writes one `struct uffdio_api` we own.
        let rc = unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API, &mut api as *mut UffdioApi) };
        if rc != 0 {
            return Err(last_err());
        }
        Ok(Uffd { fd })
    }

    fn raw_open() -> io::Result<OwnedFd> {
        let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
        for extra in [0, UFFD_USER_MODE_ONLY] {
            // SAFETY: the userfaultfd syscall takes only flags and returns a new fd or -1.
            let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags | extra) };
            if fd >= 0 {
                // SAFETY: the kernel just returned this fd to us; we own it.
                return Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) });
            }
        }
        let dev = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/userfaultfd")?;
        // SAFETY: USERFAULTFD_IOC_NEW takes the flags by value and returns a new fd or -1.
        let fd = unsafe { libc::ioctl(dev.as_raw_fd(), USERFAULTFD_IOC_NEW, flags) };
        if fd < 0 {
            return Err(last_err());
        }
        // SAFETY: fresh fd from the kernel, owned by us.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Attach `[start, start+len)` (page aligned, mapped) in WP mode: events only, no fault
    /// is ever forwarded (nothing is write-protected). Idempotent for already attached pages.
    pub fn register(&self, start: u64, len: u64) -> io::Result<()> {
        let mut reg = UffdioRegister {
            range: UffdioRange { start, len },
            mode: MODE_WP,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_REGISTER reads/writes one struct we own; it changes only VMA flags of
        // the given range (no page contents, no mapping layout).
        let rc = unsafe {
            libc::ioctl(
                self.fd.as_raw_fd(),
                UFFDIO_REGISTER,
                &mut reg as *mut UffdioRegister,
            )
        };
        if rc != 0 {
            return Err(last_err());
        }
        Ok(())
    }

    /// Detach `[start, start+len)`. Errors (range already unmapped) are returned but harmless.
    pub fn unregister(&self, start: u64, len: u64) -> io::Result<()> {
        let r = UffdioRange { start, len };
        // SAFETY: UFFDIO_UNREGISTER reads one struct we own and clears VMA flags only.
        let rc = unsafe {
            libc::ioctl(
                self.fd.as_raw_fd(),
                UFFDIO_UNREGISTER,
                &r as *const UffdioRange,
            )
        };
        if rc != 0 {
            return Err(last_err());
        }
        Ok(())
    }

    /// Wait up to `timeout_ms` (-1: forever) for events.
    pub fn wait(&self, timeout_ms: i32) -> io::Result<bool> {
        let mut p = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd we own.
        let rc = unsafe { libc::poll(&mut p, 1, timeout_ms) };
        if rc < 0 {
            let e = last_err();
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(false);
            }
            return Err(e);
        }
        Ok(rc > 0)
    }

    /// Read every queued event without blocking; appends to `out`, returns how many.
    pub fn read_events(&self, out: &mut Vec<Event>) -> io::Result<usize> {
        let mut n = 0;
        let mut buf = [UffdMsg::default(); 32];
        loop {
            // SAFETY: reading into a buffer of `size_of_val(&buf)` bytes we own; uffd_msg is
            // plain data.
            let rc = unsafe {
                libc::read(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    std::mem::size_of_val(&buf),
                )
            };
            if rc < 0 {
                let e = last_err();
                return match e.kind() {
                    io::ErrorKind::WouldBlock => Ok(n),
                    io::ErrorKind::Interrupted => continue,
                    _ => Err(e),
                };
            }
            let k = rc as usize / std::mem::size_of::<UffdMsg>();
            for m in &buf[..k] {
                let a = m.arg;
                let ev = match m.event {
                    EVENT_UNMAP => Event::Unmap(a[0], a[1]),
                    EVENT_REMOVE => Event::Remove(a[0], a[1]),
                    EVENT_REMAP => Event::Remap {
                        from: a[0],
                        to: a[1],
                        len: a[2],
                    },
                    _ => continue,
                };
                out.push(ev);
                n += 1;
            }
            if k < buf.len() {
                return Ok(n);
            }
        }
    }
}

/// A bounded, coalescing set of ranges waiting to be invalidated by one cache.
///
/// Capacity is fixed at creation (no allocation or free while locked, so holding the lock
/// can never trigger an unmap event). When full, the two closest ranges are merged: the set
/// over-approximates (invalidating more is safe, forgetting a range is not).
#[derive(Debug)]
pub struct Pending {
    ranges: Mutex<Vec<(u64, u64)>>,
    cap: usize,
    /// Set (Release) after a push, cleared under the lock by the drainer; the cache's slow
    /// path checks it (Acquire) before looking anything up.
    nonempty: AtomicBool,
    /// Ranges merged because the set was full.
    pub(crate) overflow_merges: AtomicU64,
    /// Events delivered to this cache.
    pub(crate) events: AtomicU64,
}

impl Pending {
    /// Empty set of at most `cap` ranges.
    pub fn new(cap: usize) -> Pending {
        let cap = cap.max(2);
        Pending {
            ranges: Mutex::new(Vec::with_capacity(cap)),
            cap,
            nonempty: AtomicBool::new(false),
            overflow_merges: AtomicU64::new(0),
            events: AtomicU64::new(0),
        }
    }

    fn push_locked(&self, v: &mut Vec<(u64, u64)>, (s, e): (u64, u64)) {
        // Coalesce with any overlapping/adjacent range.
        let mut s = s;
        let mut e = e;
        let mut i = 0;
        while i < v.len() {
            let (a, b) = v[i];
            if a <= e && s <= b {
                s = s.min(a);
                e = e.max(b);
                v.swap_remove(i);
            } else {
                i += 1;
            }
        }
        if v.len() == self.cap {
            // Merge the closest pair (by gap) to make room; no allocation.
            v.sort_unstable();
            let mut best = 0;
            let mut gap = u64::MAX;
            for k in 0..v.len() - 1 {
                let g = v[k + 1].0.saturating_sub(v[k].1);
                if g < gap {
                    gap = g;
                    best = k;
                }
            }
            let (a, _) = v[best];
            let (_, d) = v[best + 1];
            v[best] = (a, d.max(v[best].1));
            v.remove(best + 1);
            self.overflow_merges.fetch_add(1, Ordering::Relaxed);
        }
        v.push((s, e));
    }

    /// Queue ranges (blocking lock; the holders never free memory while holding it).
    pub fn push(&self, ranges: &[(u64, u64)]) {
        let mut v = self.ranges.lock();
        for &r in ranges {
            self.push_locked(&mut v, r);
        }
        self.events
            .fetch_add(ranges.len() as u64, Ordering::Relaxed);
        self.nonempty.store(true, Ordering::Release);
    }

    /// Whether ranges are queued.
    pub fn is_nonempty(&self) -> bool {
        self.nonempty.load(Ordering::Acquire)
    }

    /// Take every queued range. The replacement buffer is allocated before locking and the
    /// old one freed after unlocking.
    pub fn drain(&self) -> Vec<(u64, u64)> {
        let fresh = Vec::with_capacity(self.cap);
        let mut v = self.ranges.lock();
        let out = std::mem::replace(&mut *v, fresh);
        self.nonempty.store(false, Ordering::Release);
        drop(v);
        out
    }
}

/// Most disjoint idle attached ranges kept (see the module docs, "Sticky attachment"). Each
/// can keep its VMA split in up to three pieces, so the cost is bounded at `2 * IDLE_CAP`
/// extra VMAs, against the default `vm.max_map_count` of 65,530.
pub const IDLE_CAP: usize = 256;

/// The widest gap an attachment bridges to a neighbouring attached range (module docs,
/// "Bridged gaps").
pub const MAX_BRIDGE: u64 = 256 << 10;

/// Disjoint, coalesced page ranges `[start, end)` (start -> end).
#[derive(Debug, Default)]
struct RangeSet(BTreeMap<u64, u64>);

impl RangeSet {
    /// Whether every address of `[s, e)` is in the set.
    fn covers(&self, s: u64, e: u64) -> bool {
        matches!(self.0.range(..=s).next_back(), Some((_, &end)) if end >= e)
    }

    /// The parts of `[s, e)` in the set.
    fn intersect(&self, s: u64, e: u64) -> Vec<(u64, u64)> {
        let first = match self.0.range(..=s).next_back() {
            Some((&a, &b)) if b > s => a,
            _ => s,
        };
        self.0
            .range(first..e)
            .map(|(&a, &b)| (a.max(s), b.min(e)))
            .filter(|&(a, b)| a < b)
            .collect()
    }

    fn insert(&mut self, s: u64, e: u64) {
        if s >= e {
            return;
        }
        let (mut lo, mut hi) = (s, e);
        let first = match self.0.range(..=s).next_back() {
            Some((&a, &b)) if b >= s => a,
            _ => s,
        };
        let touching: Vec<(u64, u64)> = self.0.range(first..=e).map(|(&a, &b)| (a, b)).collect();
        for (a, b) in touching {
            self.0.remove(&a);
            lo = lo.min(a);
            hi = hi.max(b);
        }
        self.0.insert(lo, hi);
    }

    /// The window that joins `[s, e)` to the nearest ranges below and above it when they are
    /// at most `max_gap` away (each side on its own); `None` when neither is.
    fn bridge(&self, s: u64, e: u64, max_gap: u64) -> Option<(u64, u64)> {
        let lo = match self.0.range(..s).next_back() {
            Some((_, &b)) if b <= s && s - b <= max_gap => b,
            _ => s,
        };
        let hi = match self.0.range(e..).next() {
            Some((&a, _)) if a - e <= max_gap => a,
            _ => e,
        };
        ((lo, hi) != (s, e)).then_some((lo, hi))
    }

    /// `[s, e)` widened by the ranges of the set that end at `s` or start at `e`.
    fn around(&self, s: u64, e: u64) -> (u64, u64) {
        let lo = match self.0.range(..s).next_back() {
            Some((&a, &b)) if b == s => a,
            _ => s,
        };
        let hi = self.0.get(&e).copied().unwrap_or(e);
        (lo, hi)
    }

    fn remove(&mut self, s: u64, e: u64) {
        for (a, b) in self.intersect(s, e) {
            // `(a, b)` is the overlap; find the stored interval holding it and cut it out.
            if let Some((&ka, &kb)) = self.0.range(..=a).next_back() {
                self.0.remove(&ka);
                if ka < a {
                    self.0.insert(ka, a);
                }
                if b < kb {
                    self.0.insert(b, kb);
                }
            }
        }
    }
}

/// Attach bookkeeping, under one lock held across the ioctls.
#[derive(Debug, Default)]
struct Attached {
    /// Per-page users (cache entries).
    users: RangeCounter,
    /// Pages known attached to our userfaultfd: registered by us and not reported unmapped
    /// or moved since (a subset of what the kernel has attached).
    registered: RangeSet,
    /// Pages of `registered` with 0 users (kept attached; at most [`IDLE_CAP`] ranges).
    idle: RangeSet,
    /// Gaps attached with a neighbouring range to bridge it to another ("Bridged gaps" in
    /// the module docs): disjoint from `registered`, never taken for attached by a miss (a
    /// hole in one may be filled by a later mapping), detached with an adjacent idle range.
    bridged: RangeSet,
    /// Where the next detach of an idle range starts looking (wraps around).
    hand: u64,
}

/// Process-wide monitor: one userfaultfd (a VMA can belong to one userfaultfd only, so every
/// cache of the process shares it), one thread, per-page attach counts.
#[derive(Debug)]
pub struct Monitor {
    uffd: Uffd,
    /// Caches to notify.
    subs: Mutex<Vec<Arc<Pending>>>,
    /// Users, the record of attached pages and the idle set (module docs, "Sticky
    /// attachment").
    att: Mutex<Attached>,
    /// Ranges unmapped or moved away (UNMAP and REMAP events only), queued by the monitor
    /// thread before the sequence goes even; removed from `att.registered` at the next
    /// attach.
    gone: Pending,
    /// Events read.
    events: AtomicU64,
    /// `UFFDIO_REGISTER` calls issued (statistics and tests; Relaxed, orders nothing).
    registers: AtomicU64,
    /// Attachments that bridged a gap to a neighbouring attached range (statistics and
    /// tests; Relaxed, orders nothing).
    bridges: AtomicU64,
}

static MONITOR: OnceLock<Result<Arc<Monitor>, String>> = OnceLock::new();

/// The monitor sequence: odd while events are read but not yet queued on every subscriber.
/// Written only by the monitor thread (one per process), with AcqRel increments; a lookup
/// reads it with Acquire (see [`seq`]). A static of its own line rather than a field of the
/// monitor, so that the per-thread hit reads it with one load (no `OnceLock` state and
/// pointer to follow) and no other data written at run time shares its cache line. Stays 0
/// while no monitor runs.
#[repr(align(64))]
struct Seq(AtomicU64);
static SEQ: Seq = Seq(AtomicU64::new(0));

/// The process monitor, started on first use. `Err` says why userfaultfd is unavailable.
pub fn global() -> Result<&'static Arc<Monitor>, String> {
    MONITOR
        .get_or_init(|| {
            let uffd = Uffd::open().map_err(|e| format!("userfaultfd unavailable: {e}"))?;
            let m = Arc::new(Monitor {
                uffd,
                subs: Mutex::new(Vec::new()),
                att: Mutex::new(Attached::default()),
                gone: Pending::new(256),
                events: AtomicU64::new(0),
                registers: AtomicU64::new(0),
                bridges: AtomicU64::new(0),
            });
            let t = m.clone();
            std::thread::Builder::new()
                .name("mrkit-uffd".into())
                .spawn(move || t.run())
                .map_err(|e| format!("cannot start the monitor thread: {e}"))?;
            Ok(m)
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// The monitor sequence (odd while events are being delivered). Constant 0 without monitor.
#[inline]
pub fn seq() -> u64 {
    SEQ.0.load(Ordering::Acquire)
}

/// The sequence a thread table of a cache checks on every hit: the monitor's ([`seq`]) for
/// a monitored cache, else a constant 0 (what `sync_monitor` returns for an unmonitored
/// cache), so that the hit compares without first testing whether the cache is monitored.
pub fn seq_for(monitored: bool) -> &'static AtomicU64 {
    /// Never written: the sequence of an unmonitored cache.
    static UNMONITORED: AtomicU64 = AtomicU64::new(0);
    if monitored {
        &SEQ.0
    } else {
        &UNMONITORED
    }
}

/// Wait until no event is being delivered (bounded by `limit`); `false` on timeout.
pub fn wait_quiescent(limit: Duration) -> bool {
    let t0 = std::time::Instant::now();
    let mut spins = 0u32;
    while seq() & 1 == 1 {
        if t0.elapsed() > limit {
            return false;
        }
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
    true
}

impl Monitor {
    /// Subscribe a cache's pending set.
    pub fn subscribe(&self, p: Arc<Pending>) {
        self.subs.lock().push(p);
    }

    /// Unsubscribe (the removed `Arc` is dropped after unlocking).
    pub fn unsubscribe(&self, p: &Arc<Pending>) {
        let removed = {
            let mut s = self.subs.lock();
            s.iter()
                .position(|x| Arc::ptr_eq(x, p))
                .map(|i| s.swap_remove(i))
        };
        drop(removed);
    }

    /// Attach a page-aligned range (counted): `UFFDIO_REGISTER` unless every page of it is
    /// known to be attached already (module docs, "Sticky attachment").
    pub fn attach(&self, start: u64, len: u64) -> io::Result<()> {
        let end = start
            .checked_add(len)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        let mut a = self.att.lock();
        let trusted = self.forget_gone(&mut a, true);
        if !(trusted && a.registered.covers(start, end)) {
            // Attach the gaps to attached neighbours close by too, so that the VMA our
            // attachments split there merges back instead of splitting again ("Bridged
            // gaps" in the module docs). Only `[start, end)` enters the record. Returns the
            // window when the gaps were attached too; computed from the record as it is at
            // each attempt (the retry below may have detached a neighbour).
            let attach = |a: &Attached| -> io::Result<Option<(u64, u64)>> {
                let window = a.registered.bridge(start, end, MAX_BRIDGE);
                if let Some((ws, we)) = window.filter(|_| trusted) {
                    self.registers.fetch_add(1, Ordering::Relaxed);
                    if self.uffd.register(ws, we - ws).is_ok() {
                        return Ok(Some((ws, we)));
                    }
                    // A gap this userfaultfd cannot attach (a file mapping, another
                    // userfaultfd's memory): the range alone.
                }
                self.registers.fetch_add(1, Ordering::Relaxed);
                self.uffd.register(start, len).map(|()| None)
            };
            let mut r = attach(&a);
            if matches!(&r, Err(e) if e.raw_os_error() == Some(libc::ENOMEM))
                && trusted
                && !a.idle.0.is_empty()
            {
                // Out of VMAs (`vm.max_map_count`), maybe partly because of our idle splits:
                // detach them (their VMAs merge back) and try once more.
                while let Some((&s, &e)) = a.idle.0.iter().next() {
                    self.release(&mut a, s, e);
                }
                r = attach(&a);
            }
            if let Some((ws, we)) = r? {
                self.bridges.fetch_add(1, Ordering::Relaxed);
                a.bridged.insert(ws, start);
                a.bridged.insert(end, we);
            }
            a.registered.insert(start, end);
            a.bridged.remove(start, end);
        }
        a.idle.remove(start, end);
        let _ = a.users.inc(start, end);
        Ok(())
    }

    /// Drop one attach count over the range. Pages that reach 0 users stay attached in the
    /// idle set; idle ranges are detached while it holds more than [`IDLE_CAP`].
    pub fn detach(&self, start: u64, len: u64) {
        let end = start.saturating_add(len);
        let mut a = self.att.lock();
        for (s, e) in a.users.dec(start, end) {
            for (rs, re) in a.registered.intersect(s, e) {
                a.idle.insert(rs, re);
            }
        }
        // Never wait here (this runs on handle drops): with an event in flight the record may
        // still hold a range that is no longer ours, so the trimming waits for the next call.
        while a.idle.0.len() > IDLE_CAP && self.forget_gone(&mut a, false) {
            let next = a
                .idle
                .0
                .range(a.hand..)
                .next()
                .or_else(|| a.idle.0.iter().next())
                .map(|(&s, &e)| (s, e));
            let Some((s, e)) = next else { break };
            a.hand = e;
            self.release(&mut a, s, e);
        }
    }

    /// Detach every idle range (ranges in use stay attached). Waits at most a second for an
    /// event being delivered; on timeout, releases nothing.
    pub fn release_idle(&self) {
        let mut a = self.att.lock();
        if !self.forget_gone(&mut a, true) {
            return;
        }
        while let Some((&s, &e)) = a.idle.0.iter().next() {
            self.release(&mut a, s, e);
        }
    }

    /// `UFFDIO_REGISTER` calls issued so far (a miss on a range known to be attached issues
    /// none).
    pub fn registrations(&self) -> u64 {
        self.registers.load(Ordering::Relaxed)
    }

    /// Attachments so far that bridged a gap to a neighbouring attached range.
    pub fn bridges(&self) -> u64 {
        self.bridges.load(Ordering::Relaxed)
    }

    /// Unregister idle range `[s, e)` (no users, still ours: the idle set is kept a subset
    /// of both).
    fn release(&self, a: &mut Attached, s: u64, e: u64) {
        // With the bridged gaps next to it, so that the VMA merges back.
        let (ws, we) = a.bridged.around(s, e);
        let _ = self.uffd.unregister(ws, we - ws);
        a.bridged.remove(ws, we);
        a.idle.remove(s, e);
        a.registered.remove(s, e);
    }

    /// Remove from the record the ranges reported unmapped or moved. With `wait`, first
    /// waits (at most a second) until no event is being delivered; without, gives up if one
    /// is. Returns whether the record is now trustworthy: it then lacks every range whose
    /// unmap returned before this call (the monitor queues it on `gone` before the sequence
    /// goes even).
    fn forget_gone(&self, a: &mut Attached, wait: bool) -> bool {
        let quiet = if wait {
            wait_quiescent(Duration::from_secs(1))
        } else {
            seq() & 1 == 0
        };
        if !quiet {
            return false;
        }
        if self.gone.is_nonempty() {
            for (s, e) in self.gone.drain() {
                a.registered.remove(s, e);
                a.idle.remove(s, e);
                a.bridged.remove(s, e);
            }
        }
        true
    }

    /// Events read so far.
    pub fn events(&self) -> u64 {
        self.events.load(Ordering::Relaxed)
    }

    fn run(&self) {
        let mut evs: Vec<Event> = Vec::with_capacity(256);
        let mut ranges: Vec<(u64, u64)> = Vec::with_capacity(256);
        let mut gone: Vec<(u64, u64)> = Vec::with_capacity(256);
        loop {
            let timeout = if ranges.is_empty() { -1 } else { 1 };
            match self.uffd.wait(timeout) {
                Ok(_) => {}
                Err(e) => {
                    tracing::error!(error = %e, "userfaultfd poll failed; monitor stops");
                    return;
                }
            }
            // Odd before reading: the unmapping thread is released by the read below, and
            // any lookup after that sees odd (waits) until the range is queued.
            if SEQ.0.load(Ordering::Relaxed) & 1 == 0 {
                SEQ.0.fetch_add(1, Ordering::AcqRel);
            }
            evs.clear();
            match self.uffd.read_events(&mut evs) {
                Ok(n) => {
                    self.events.fetch_add(n as u64, Ordering::Relaxed);
                }
                Err(e) => tracing::warn!(error = %e, "userfaultfd read failed"),
            }
            for ev in &evs {
                let r = ev.stale_range();
                push_bounded(&mut ranges, r);
                if !matches!(ev, Event::Remove(..)) {
                    // The VMA is gone from here: so is its attachment.
                    push_bounded(&mut gone, r);
                }
            }
            // Before the sequence can go even (see `forget_gone`). `Pending::push` does not
            // allocate and its lock is held by nobody who waits for this thread.
            if !gone.is_empty() {
                self.gone.push(&gone);
                gone.clear();
            }
            if ranges.is_empty() {
                if SEQ.0.load(Ordering::Relaxed) & 1 == 1 {
                    SEQ.0.fetch_add(1, Ordering::AcqRel);
                }
                continue;
            }
            // Never block on the subscriber list: a holder might be waiting for us to read.
            if let Some(subs) = self.subs.try_lock() {
                for p in subs.iter() {
                    p.push(&ranges);
                }
                drop(subs);
                ranges.clear();
                // Even: every subscriber has the ranges queued (Release pairs with seq()).
                SEQ.0.fetch_add(1, Ordering::AcqRel);
            }
        }
    }
}

/// Append `r` to a buffer that never grows past its capacity: when full, the last range is
/// widened to cover `r` instead (over-approximating is safe).
fn push_bounded(v: &mut Vec<(u64, u64)>, r: (u64, u64)) {
    if v.len() == v.capacity() {
        let last = v.len() - 1;
        v[last] = (v[last].0.min(r.0), v[last].1.max(r.1));
    } else {
        v.push(r);
    }
}

#[cfg(test)]
mod tests {
    use super::RangeSet;

    fn all(s: &RangeSet) -> Vec<(u64, u64)> {
        s.0.iter().map(|(&a, &b)| (a, b)).collect()
    }

    /// `bridge` joins a range to neighbours at most `max_gap` away, each side on its own;
    /// `around` widens a range by set ranges that touch it.
    #[test]
    fn range_set_bridge_and_around() {
        let mut s = RangeSet::default();
        s.insert(100, 110);
        s.insert(200, 210);
        // (range, max gap) -> window
        for ((a, b), gap, want) in [
            ((150, 160), 50, Some((110, 200))),
            ((150, 160), 40, Some((110, 200))),
            ((140, 150), 30, Some((110, 150))),
            ((165, 170), 30, Some((165, 200))),
            ((150, 160), 39, None),
            ((120, 130), 10, Some((110, 130))),
            ((50, 60), 40, Some((50, 100))),
            ((300, 310), 89, None),
            ((300, 310), 90, Some((210, 310))),
            ((110, 200), 0, None),
        ] {
            assert_eq!(s.bridge(a, b, gap), want, "[{a}, {b}) gap {gap}");
        }
        let mut g = RangeSet::default();
        g.insert(110, 150);
        g.insert(160, 200);
        assert_eq!(g.around(150, 160), (110, 200));
        assert_eq!(g.around(140, 160), (140, 200));
        assert_eq!(g.around(150, 170), (110, 170));
        assert_eq!(g.around(0, 10), (0, 10));
    }

    #[test]
    fn range_set_insert_coalesces_and_remove_cuts() {
        let mut s = RangeSet::default();
        s.insert(10, 20);
        s.insert(30, 40);
        s.insert(20, 30);
        assert_eq!(all(&s), vec![(10, 40)]);
        assert!(s.covers(10, 40) && s.covers(15, 25) && !s.covers(5, 15) && !s.covers(35, 45));
        s.remove(15, 25);
        assert_eq!(all(&s), vec![(10, 15), (25, 40)]);
        assert!(!s.covers(14, 16));
        assert_eq!(s.intersect(0, 30), vec![(10, 15), (25, 30)]);
        s.insert(50, 60);
        s.remove(0, 100);
        assert!(all(&s).is_empty());
        s.insert(5, 5);
        assert!(all(&s).is_empty());
    }
}
