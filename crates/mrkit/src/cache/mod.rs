//! # Registration cache: look up, or register, the MR that covers your buffer
//!
//! For memory the application owns (not a pool): [`RegCache`] returns a handle on a live
//! registration that covers the requested bytes with at least the requested rights (a *hit*),
//! or registers one (a *miss*) and keeps it for the next lookup. Registering costs
//! microseconds (pinning, translation); a hit costs nanoseconds.
//!
//! ## The caller's contract
//!
//! A cached registration outlives the handle that made it: that is the point of a cache. So
//! what keeps its memory valid is not the handle but the path it was made through:
//!
//! | path | memory | rights | valid while |
//! |---|---|---|---|
//! | [`RegCache::get_owned`] | `&Arc<M>`, `M:` [`OwnedMemory`] (e.g. [`Buffer`](crate::Buffer), `Vec<u8>`) | any | the handle lives; **with remote rights the entry co-owns `M`** until it is deregistered |
//! | [`RegCache::get_ref`] | `&'a [u8]` | local, device reads | `'a` (the handle borrows) |
//! | [`RegCache::get_mut`] | `&'a mut [u8]` | local, device may write | `'a` (the handle borrows exclusively) |
//! | `unsafe` [`RegCache::get_raw`] | an address | any | the caller promises (see its `# Safety`) |
//!
//! * **What a handle guarantees**: while it lives, its keys stay registered and translate to
//!   the pages mapped at the time of the lookup (never to an earlier mapping at the same
//!   address), even if the range is invalidated meanwhile (it is then deregistered at the
//!   last drop). Every handle implements [`Registered`] (and [`DeviceWritable`] where the
//!   device may write: owned, `&mut`-borrowed, raw), so a work request can carry it; its
//!   [`Registered::sges`] cover its own bytes only, one SGE per MR they span.
//! * **Remote rights** (`REMOTE_READ`, `REMOTE_WRITE`, `REMOTE_ATOMIC`, `MW_BIND`, the flush
//!   rights) outlive every handle: a peer that got the rkey can use it for as long as the
//!   entry is cached, at any time. Only memory the cache itself keeps alive can back that:
//!   the owned path gives the entry a clone of your `Arc` (released once the entry is
//!   deregistered: [`RegCache::invalidate`], eviction, [`RegCache::scan_idle`], dropping the
//!   cache), and registers no byte outside `M`. The borrowed paths refuse remote rights with
//!   `EINVAL` (a borrow ends while the rkey would still work).
//! * **When memory may be freed**: borrowed memory as soon as its handle is gone (the borrow
//!   checker enforces it); owned memory whenever you like (the cache holds its own `Arc`;
//!   with local rights only, the entry holds nothing and `Arc::get_mut` works again once the
//!   handles are dropped). The entry left behind over freed borrowed memory is harmless: no
//!   safe code can reach its keys without a new lookup, and the userfaultfd monitor (the
//!   default [`MonitorMode`]) drops it when the memory is unmapped, so a lookup never finds
//!   a stale translation. Without the monitor ([`MonitorMode::explicit_only`], `unsafe`) the
//!   application promises to [`invalidate`](RegCache::invalidate) before unmapping.
//! * **Which path to use**: buffers peers read or write (storage targets, one-sided
//!   protocols) → owned, e.g. `Arc<Buffer>`; a message you send or a block you read into with
//!   your own QP → borrowed; memory no Rust value owns (C callers) → raw.
//!
//! ```
//! use std::sync::Arc;
//! use mrkit::cache::{CacheConfig, RegCache};
//! use mrkit::{AccessFlags as A, Buffer, Context, Registered};
//! let pd = Context::open_default().unwrap().alloc_pd().unwrap();
//! let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
//!
//! // Borrowed: a local send buffer (the handle cannot outlive `msg`).
//! let msg = b"ping".to_vec();
//! let h = cache.get_ref(&msg, A::empty()).unwrap();
//! let mut sge = Vec::new();
//! h.sges(0..4, &mut sge).unwrap();
//! drop(h);
//!
//! // Owned: an I/O buffer a peer writes into by its rkey.
//! let io = Arc::new(Buffer::new(1 << 20).unwrap());
//! let h = cache.get_owned(&io, 0..1 << 20, A::LOCAL_WRITE | A::REMOTE_WRITE).unwrap();
//! let for_the_peer = h.remote(0..1 << 20).unwrap();
//! # let _ = for_the_peer;
//! ```
//!
//! The two programs this design rules out do not compile. An immutable `String` registered
//! for remote writes through a raw address needs `unsafe` ([`RegCache::get_raw`]; the safe
//! [`RegCache::get_ref`] refuses remote rights), and a handle cannot outlive the buffer it
//! borrows:
//!
//! ```compile_fail,E0505
//! # use mrkit::cache::{CacheConfig, RegCache};
//! # use mrkit::{AccessFlags, Buffer, Context};
//! # let pd = Context::open_default().unwrap().alloc_pd().unwrap();
//! # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
//! let buf = Buffer::new(4096).unwrap();
//! let h = cache.get_ref(buf.as_slice(), AccessFlags::empty()).unwrap();
//! drop(buf); // error: `buf` is still borrowed by `h`
//! let _use = h;
//! ```
//!
//! Nor can a shared borrow be handed to the device as a write destination:
//!
//! ```compile_fail,E0277
//! # use mrkit::cache::{CacheConfig, RegCache};
//! # use mrkit::{AccessFlags, Context, DeviceWritable};
//! # let pd = Context::open_default().unwrap().alloc_pd().unwrap();
//! # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
//! fn rdma_read_into(_dst: impl DeviceWritable) {}
//! let s = String::from("immutable");
//! rdma_read_into(cache.get_ref(s.as_bytes(), AccessFlags::empty()).unwrap());
//! ```
//!
//! `examples/storage_cache.rs` cycles owned I/O buffers through the cache and moves data by
//! RDMA into and out of them with a loopback queue pair.
//!
//! ## Internals
//!
//! * **Index**: an interval index of live entries (`index::IntervalIndex`) under a
//!   `RwLock` that is **never held across a device call**.
//! * **Hit path** (its cost does not grow with the number of entries): each thread keeps,
//!   per cache, a table of *holds* on its own *leases* (module `lease`): an open-addressing table
//!   keyed by the 4 KiB page of the request address (16-byte slots, sized to the cache's
//!   `max_entries`) plus a ring of the last 4 entries matched by range (lookups anywhere in a
//!   large entry). A hit reads the table slot, checks range and rights in the lease's own
//!   line, and takes a handle with one read-modify-write on the lease's count word; the
//!   handle drop is one compare-exchange on the same word. The lease's line belongs to the
//!   thread: a hit takes **no lock and writes no shared cache line**, so threads hitting the
//!   same entries never bounce a line. With the userfaultfd monitor, the table is valid only
//!   while the monitor's event sequence equals the one it caught up to (one load of a line
//!   written only by events); after an event the next lookup applies the queued
//!   invalidations on the slow path and the table catches up *without* being cleared (dead
//!   entries are refused hold by hold). Hit counters are per-thread, single-writer.
//!   Leases come from a contiguous slab and large tables from their own THP-advised
//!   mappings (`lease::mem`), so at tens of thousands of entries the hit's two cache
//!   misses are not also TLB misses.
//! * **Life cycle**: an entry's *memory* is an `Arc` (index, leases, waiters); its
//!   *registration* is retired (`Entry::try_retire`) once it is dead (invalidated,
//!   evicted, superseded, cache dropped) and no lease counts a handle. A kill sets a dead
//!   bit in every lease's count word under the entry's lease-list mutex; hits and releases
//!   are read-modify-writes of the same word, so either the kill counts a hit's handle or
//!   the hit sees the bit and backs out (no fences, no Dekker pairs; see the `lease` module). The MR is
//!   deregistered exactly once, and never while a handle exists; an entry invalidated while
//!   in use leaves the index at once and is retired by its last handle. Thread tables keep
//!   an entry's memory (not its registration) until the slot is replaced, the table is
//!   rebuilt, or the thread exits. Model-checked on the lease code itself in
//!   `tests/loom_cache.rs`.
//! * **Miss path**: shape the range ([`Shape`]), insert a *placeholder* entry under the
//!   write lock (concurrent misses of the same range find it and wait: single flight),
//!   register **outside any lock**, then publish under the write lock. A placeholder that was
//!   invalidated while its registration ran is thrown away and the lookup retried
//!   (`stale_rejects`): the registration may have pinned the pages of the old mapping.
//! * **Shapes**: exact, page-rounded, merge with overlapping/adjacent entries up to a cap
//!   (rights are the union; on failure — e.g. EFAULT because a neighbour needs write rights
//!   on read-only memory — retried unmerged), whole allocation (the VMA bounds from
//!   `/proc/self/maps`, capped). Ranges above `max_chunk` (default 1 GiB, never above the
//!   device's `max_mr_size`) are registered as several MRs; the handle yields the pieces.
//!   Widening never grants a peer bytes nobody agreed to expose: an owned request with
//!   remote rights is clamped to the owner's bytes and never merged (its entry holds the
//!   owner in `Entry::owner`, dropped by `Entry::retire` after the deregistration, and only
//!   once no registration over it can still be running); other requests merge only with
//!   entries of the same kind (all with remote rights: raw callers, whose contract covers
//!   the union; or all without).
//!   Local-only widening is harmless: a handle's SGEs cover only its own bytes.
//! * **Limits**: `max_entries` and `max_bytes` are enforced on every insert by evicting
//!   idle entries (approximate LRU: a handle drop sets a "touched" bit, victim = idle entry
//!   idle for longest). If the limit cannot be met because everything is in use, the new
//!   registration is returned *uncached* (private to the handle, deregistered on drop) and
//!   counted (`uncached`): limits hold for the cache at all times.
//! * **Idle release**: [`RegCache::scan_idle`] (CLOCK-style: an entry idle in two scans
//!   spanning `idle_timeout` is released) and an optional background thread
//!   ([`RegCache::start_idle_scanner`]).
//! * **Invalidation**: [`RegCache::invalidate`] (explicit) and the userfaultfd monitor
//!   (module `monitor`): overlapping entries leave the index at once (new lookups miss); entries in
//!   use are deregistered when their last handle drops. The monitor queue is bounded and
//!   coalescing.
//! * **Fallbacks**: on ENOMEM (max_mr, translation capacity, memlock) evict every idle entry
//!   and retry; a widened shape that fails is retried with the page-rounded request; then an
//!   opt-in bounce path through an [`MrPool`] ([`RegCache::get_or_bounce_raw`]). Each counted.
//!
//! ## fork
//!
//! With DONTFORK marking on (`MRKIT_DONTFORK=1`, `ibv_fork_init`; off by default, as in
//! rdma-core) the device marks every registered page `MADV_DONTFORK` with a per-page count and restores
//! `MADV_DOFORK` when the last MR over a page is deregistered (`mrkit_soft::mem::fork`), so
//! the VMA split lasts exactly as long as a registration and the kernel merges the VMAs
//! back. The cache keeps registrations page-rounded by default (DONTFORK on a partially
//! used page would hide the rest of the page from a child), and the idle scanner bounds how
//! long an unused cached range keeps its VMA split. The userfaultfd attach (WP mode) splits
//! VMAs the same way and is likewise reference counted and undone at deregistration.

mod index;
mod lease;
mod monitor;
mod sync;

/// Not API: the cache's internals, reachable for this crate's own tests only (the loom model
/// checks the real lease code; the monitor tests count its attachments). No stability promise.
#[doc(hidden)]
pub mod test_support {
    /// The lease core (see the `lease` module of the cache).
    pub mod lease {
        pub use crate::cache::lease::{lease, Handle, Hold, LeaseSet, Retire};
    }
    /// The userfaultfd monitor's counters (see the `monitor` module of the cache).
    pub mod monitor {
        pub use crate::cache::monitor::IDLE_CAP;

        /// `UFFDIO_REGISTER` calls the process-wide monitor made so far (`None` when
        /// userfaultfd is unavailable).
        pub fn registrations() -> Option<u64> {
            crate::cache::monitor::global()
                .ok()
                .map(|m| m.registrations())
        }

        /// Events (unmap, remove, remap) the monitor has read so far (`None` when userfaultfd
        /// is unavailable).
        pub fn events() -> Option<u64> {
            crate::cache::monitor::global().ok().map(|m| m.events())
        }
    }
}

use std::any::Any;
use std::cell::RefCell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};

use crate::pool::{MrPool, OwnedSlot};
use crate::qp::registered::{check_range, DeviceWritable, Registered};
use crate::verbs::{LocalSlice, ProtectionDomain, RemoteSlice};
use crate::{AccessFlags, Errno, Error, Result};
use index::IntervalIndex;
use lease::mem::Slots;
use lease::{Handle, Hold, LeaseSet, Retire};
use monitor::{Monitor, Pending};
use mrkit_soft::OwnedMemory;

/// How a miss decides what to register.
///
/// ```
/// use mrkit::cache::{CacheConfig, RegCache, Shape};
/// use mrkit::{AccessFlags, Context};
/// let pd = Context::open_default().unwrap().alloc_pd().unwrap();
/// let cfg = CacheConfig { shape: Shape::Merge { cap: 1 << 20 }, ..Default::default() };
/// let cache = RegCache::new(&pd, cfg).unwrap();
/// let mut v = vec![0u8; 3 * 4096];
/// drop(cache.get_mut(&mut v[..4096], AccessFlags::LOCAL_WRITE).unwrap());
/// drop(cache.get_mut(&mut v[4096..8192], AccessFlags::LOCAL_WRITE).unwrap());
/// assert_eq!(cache.stats().merges, 1); // one registration over both
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// Exactly the requested bytes.
    Exact,
    /// The requested bytes rounded out to pages (default).
    PageRounded,
    /// Page-rounded, merged with overlapping or adjacent cached entries while the union is
    /// at most `cap` bytes.
    Merge {
        /// Largest merged registration.
        cap: u64,
    },
    /// The whole mapping (VMA) containing the range, if at most `cap` bytes.
    WholeAllocation {
        /// Largest registration.
        cap: u64,
    },
}

/// Invalidation source besides explicit [`RegCache::invalidate`].
///
/// The default, [`MonitorMode::Userfaultfd`], is what makes the safe entry points sound for
/// borrowed memory: a cached registration outlives the borrow it was made from, and the
/// monitor is what drops it when that memory is unmapped, so a later lookup at the same
/// address never gets keys that translate to the old pages. Without it the application
/// makes that promise itself, which is why [`MonitorMode::explicit_only`] is `unsafe`.
///
/// ```
/// use mrkit::cache::{CacheConfig, MonitorMode};
/// assert_eq!(CacheConfig::default().monitor, MonitorMode::Userfaultfd);
/// // SAFETY: this program calls `invalidate` before it frees or unmaps cached memory.
/// let cfg = CacheConfig { monitor: unsafe { MonitorMode::explicit_only() }, ..Default::default() };
/// assert!(matches!(cfg.monitor, MonitorMode::ExplicitOnly(_)));
/// ```
///
/// Choosing explicit invalidation without `unsafe` does not compile:
///
/// ```compile_fail,E0133
/// use mrkit::cache::MonitorMode;
/// let m = MonitorMode::explicit_only();
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MonitorMode {
    /// userfaultfd events (UNMAP, REMOVE, REMAP). [`RegCache::new`] fails loudly when
    /// userfaultfd is unavailable.
    Userfaultfd,
    /// Only explicit invalidation: the application has promised (through the `unsafe`
    /// [`MonitorMode::explicit_only`], the only way to make the token) to call
    /// [`RegCache::invalidate`] before it unmaps or `MADV_DONTNEED`s cached memory.
    ExplicitOnly(ExplicitInvalidation),
}

/// Proof that the application took on [`MonitorMode::explicit_only`]'s contract; made only by
/// that `unsafe` function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExplicitInvalidation(());

impl MonitorMode {
    /// Explicit invalidation only: no userfaultfd monitor (for processes that cannot use
    /// userfaultfd, or that free memory only through their own allocator).
    ///
    /// # Safety
    ///
    /// For every cache configured with this mode: once memory the cache has registered is
    /// unmapped, remapped (`mremap`, `MAP_FIXED`) or discarded (`MADV_DONTNEED`,
    /// `MADV_REMOVE`, `MADV_FREE`), by any code in the process (an allocator returning freed
    /// memory to the kernel included), the caller must not look up any of it again until
    /// [`RegCache::invalidate`] over it has returned (or the cache is dropped). In practice:
    /// invalidate before unmapping. A cached registration pins the pages that were mapped
    /// when it was made; a lookup that finds it hands out keys through which the device reads
    /// and writes those old pages, not the memory now at that address, and that holds for
    /// the handles of the safe entry points ([`RegCache::get_ref`], [`RegCache::get_mut`],
    /// [`RegCache::get_owned`]) too.
    ///
    /// ```
    /// use mrkit::cache::{CacheConfig, MonitorMode, RegCache};
    /// use mrkit::{AccessFlags, Context};
    /// let pd = Context::open_default().unwrap().alloc_pd().unwrap();
    /// // SAFETY: every buffer below is a `Vec` that stays alive until after `invalidate`.
    /// let cfg = CacheConfig { monitor: unsafe { MonitorMode::explicit_only() }, ..Default::default() };
    /// let cache = RegCache::new(&pd, cfg).unwrap();
    /// let mut v = vec![0u8; 8192];
    /// drop(cache.get_mut(&mut v, AccessFlags::LOCAL_WRITE).unwrap());
    /// cache.invalidate(v.as_ptr() as u64, v.len() as u64);
    /// drop(v);
    /// ```
    pub const unsafe fn explicit_only() -> MonitorMode {
        MonitorMode::ExplicitOnly(ExplicitInvalidation(()))
    }
}

/// Cache configuration.
///
/// ```
/// use std::time::Duration;
/// use mrkit::cache::{CacheConfig, RegCache};
/// use mrkit::Context;
/// let pd = Context::open_default().unwrap().alloc_pd().unwrap();
/// let cfg = CacheConfig {
///     max_entries: 4096,
///     max_bytes: 1 << 30,
///     idle_timeout: Duration::from_secs(5),
///     ..CacheConfig::default()
/// };
/// let cache = RegCache::new(&pd, cfg).unwrap();
/// assert!(cache.is_monitored()); // the default monitor: userfaultfd
/// ```
#[derive(Debug, Clone)]
pub struct CacheConfig {
    /// Registration shape.
    pub shape: Shape,
    /// Most entries cached at once.
    pub max_entries: usize,
    /// Most bytes registered by cached entries at once.
    pub max_bytes: u64,
    /// Largest single MR (clamped to the device's `max_mr_size`).
    pub max_chunk: u64,
    /// Idle time after which [`RegCache::scan_idle`] releases an entry.
    pub idle_timeout: Duration,
    /// Invalidation source.
    pub monitor: MonitorMode,
    /// Capacity of the pending-invalidation set (ranges; coalescing when full).
    pub pending_capacity: usize,
    /// Opt-in bounce path for [`RegCache::get_or_bounce_raw`].
    pub bounce: Option<MrPool>,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            shape: Shape::PageRounded,
            max_entries: 1024,
            max_bytes: 4 << 30,
            max_chunk: 1 << 30,
            idle_timeout: Duration::from_secs(30),
            monitor: MonitorMode::Userfaultfd,
            pending_capacity: 256,
            bounce: None,
        }
    }
}

/// Counters (snapshot).
///
/// ```
/// # use mrkit::cache::{CacheConfig, RegCache};
/// # use mrkit::{AccessFlags, Context};
/// # let pd = Context::open_default().unwrap().alloc_pd().unwrap();
/// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
/// let v = vec![1u8; 4096];
/// for _ in 0..3 {
///     drop(cache.get_ref(&v, AccessFlags::empty()).unwrap());
/// }
/// let st = cache.stats();
/// assert_eq!((st.misses, st.hits, st.entries), (1, 2, 1));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups served by an existing registration (per-thread fast path + shared index).
    pub hits: u64,
    /// Of `hits`, served by the per-thread cache.
    pub fast_hits: u64,
    /// Lookups that registered.
    pub misses: u64,
    /// Lookups that waited for a concurrent miss of the same range.
    pub single_flight_waits: u64,
    /// Entries absorbed by a merge.
    pub merges: u64,
    /// Registrations split into several MRs.
    pub splits: u64,
    /// Idle entries evicted for limits or ENOMEM.
    pub evictions: u64,
    /// Idle entries released by the idle scanner.
    pub idle_releases: u64,
    /// Entries invalidated (explicit or monitor).
    pub invalidations: u64,
    /// Of `invalidations`, entries that were in use (retired at their last drop).
    pub invalidated_in_use: u64,
    /// Registrations thrown away because their range was invalidated while registering, and
    /// hits refused because the entry died under them.
    pub stale_rejects: u64,
    /// MRs registered by the cache.
    pub registrations: u64,
    /// MRs deregistered by the cache.
    pub deregistrations: u64,
    /// Bytes registered now (cached and uncached entries).
    pub bytes_registered: u64,
    /// Entries in the index now.
    pub entries: u64,
    /// Registrations returned uncached (limits unreachable, monitor could not attach).
    pub uncached: u64,
    /// Of `uncached`, because the monitor could not attach the range.
    pub unmonitored: u64,
    /// Fallback: evict-all-idle then retry after ENOMEM.
    pub fallback_evict_retry: u64,
    /// Fallback: widened shape failed, retried page-rounded.
    pub fallback_shrink: u64,
    /// Fallback: served by the bounce pool.
    pub fallback_bounce: u64,
    /// Monitor events delivered to this cache.
    pub monitor_events: u64,
    /// Pending-set merges forced by its capacity.
    pub pending_overflow_merges: u64,
}

/// One MR of a registration.
///
/// ```
/// use mrkit::cache::{CacheConfig, RegCache};
/// use mrkit::{AccessFlags, Context};
/// let pd = Context::open_default().unwrap().alloc_pd().unwrap();
/// let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
/// let v = vec![0u8; 8192];
/// // SAFETY: `v` outlives the handle; local rights only.
/// let h = unsafe { cache.get_raw(v.as_ptr() as u64, 8192, AccessFlags::empty()) }.unwrap();
/// let p = h.pieces()[0];
/// assert!(p.addr <= v.as_ptr() as u64 && p.len >= 8192 && p.lkey == h.lkey());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// First address (= iova).
    pub addr: u64,
    /// Length.
    pub len: u64,
    /// Local key.
    pub lkey: u32,
    /// Remote key.
    pub rkey: u32,
}

#[derive(Debug, Default)]
struct Counters {
    hits_slow: AtomicU64,
    misses: AtomicU64,
    single_flight_waits: AtomicU64,
    merges: AtomicU64,
    splits: AtomicU64,
    evictions: AtomicU64,
    idle_releases: AtomicU64,
    invalidations: AtomicU64,
    invalidated_in_use: AtomicU64,
    stale_rejects: AtomicU64,
    registrations: AtomicU64,
    deregistrations: AtomicU64,
    bytes_registered: AtomicU64,
    uncached: AtomicU64,
    unmonitored: AtomicU64,
    fallback_evict_retry: AtomicU64,
    fallback_shrink: AtomicU64,
    fallback_bounce: AtomicU64,
}

fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// State entries need after the cache is gone (deregistration).
#[derive(Debug)]
struct Shared {
    pd: ProtectionDomain,
    monitor: Option<&'static Arc<Monitor>>,
    c: Counters,
}

/// A registration. Its memory is the `Arc` (index, leases, waiters); its MR is deregistered
/// by [`Entry::retire`] when it is dead and unused (or, at the latest, in `Drop`).
#[derive(Debug)]
struct Entry {
    /// Invalidated, evicted or superseded: never handed out again. Set under the index
    /// write lock (with the lease set's kill, which hits check).
    dead: AtomicBool,
    start: u64,
    end: u64,
    access: AccessFlags,
    id: u64,
    /// Page-rounded span (what the monitor attaches).
    span: (u64, u64),
    /// Set once at publication.
    pieces: OnceLock<Vec<Piece>>,
    /// Registration failed (waiters retry).
    failed: AtomicBool,
    /// Keys to deregister at drop.
    regs: Mutex<Vec<u32>>,
    /// In the index (false: uncached, private to its handles).
    cached: AtomicBool,
    /// Attached to the monitor.
    monitored: AtomicBool,
    /// Milliseconds (cache clock) when first seen idle.
    idle_since: AtomicU64,
    wait_mx: Mutex<()>,
    wait_cv: Condvar,
    shared: Arc<Shared>,
    /// The per-thread leases handles are counted on (see [`lease`]).
    leases: LeaseSet<Entry>,
    /// The monitor attach has been released (once, by [`Entry::retire`]; keys are taken
    /// and deregistered at every call).
    retired: AtomicBool,
    /// What keeps the memory alive while remote rights over it exist (owned path with remote
    /// rights; such entries never merge, so there is at most one): released by
    /// [`Entry::retire`] once the keys are deregistered.
    owner: Mutex<Option<Owner>>,
    /// May be merged with neighbours (false for owned entries: their range is the owner's).
    mergeable: bool,
}

/// What an owned registration keeps alive.
type Owner = Arc<dyn Any + Send + Sync>;

/// An owned request with remote rights: the owner the entry keeps, and the bytes it owns (the
/// registration never reaches past them).
struct OwnerRange {
    owner: Owner,
    start: u64,
    end: u64,
}

/// Rights that let something other than a handle's work request reach the memory: a peer
/// holding the rkey (READ, WRITE, atomics, flushes) or a memory window bound to the MR.
const REMOTE_RIGHTS: AccessFlags = AccessFlags::REMOTE
    .union(AccessFlags::MW_BIND)
    .union(AccessFlags::FLUSH_GLOBAL)
    .union(AccessFlags::FLUSH_PERSISTENT);

/// What a hit checks: `(start, end, access)`.
#[derive(Debug, Clone, Copy)]
struct Meta {
    start: u64,
    end: u64,
    access: AccessFlags,
}

impl Meta {
    #[inline]
    fn covers(&self, addr: u64, end: u64, access: AccessFlags) -> bool {
        self.start <= addr && end <= self.end && self.access.contains(access)
    }
}

impl Retire for Entry {
    type Meta = Meta;
    fn meta(&self) -> Meta {
        Meta {
            start: self.start,
            end: self.end,
            access: self.access,
        }
    }
    fn leases(&self) -> &LeaseSet<Entry> {
        &self.leases
    }
    fn retire(&self) {
        Entry::retire(self);
    }
}

impl Entry {
    fn ready(&self) -> Option<&Vec<Piece>> {
        self.pieces.get()
    }

    fn wake(&self) {
        let _g = self.wait_mx.lock();
        self.wait_cv.notify_all();
    }

    /// Wait for publication, failure or death.
    fn wait(&self) {
        let mut g = self.wait_mx.lock();
        while self.pieces.get().is_none()
            && !self.failed.load(Ordering::Acquire)
            && !self.dead.load(Ordering::Acquire)
        {
            self.wait_cv.wait_for(&mut g, Duration::from_millis(5));
        }
    }

    fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Handles alive (sum over the leases).
    fn users(&self) -> u64 {
        self.leases.users()
    }

    /// Idle: no handle (callers hold the index lock).
    fn idle_in_index(&self) -> bool {
        self.users() == 0
    }

    /// Mark dead (callers hold the index write lock or own the entry): no handle can be
    /// taken any more. Returns the handles alive. Follow with
    /// [`try_retire`](Self::try_retire) once the lock is released.
    fn kill(&self) -> u64 {
        self.cached.store(false, Ordering::Release);
        self.dead.store(true, Ordering::Release);
        self.leases.kill()
    }

    /// Deregister now if the entry is dead and has no user. Safe to call any number of times
    /// from any thread (see [`lease`]).
    fn try_retire(&self) {
        LeaseSet::try_retire(self);
    }

    /// Deregister the MR and detach the monitor, exactly once.
    fn retire(&self) {
        // Keys are taken at every call: a dead placeholder may be retired while its
        // registration still runs; the keys it adds later go at Entry::drop.
        let keys = std::mem::take(&mut *self.regs.lock());
        let ctx = self.shared.pd.context();
        for k in &keys {
            if let Err(e) = ctx.provider().dereg_mr(*k) {
                tracing::warn!(error = %e, lkey = k, "cache dereg failed");
            }
        }
        if !keys.is_empty() {
            let c = &self.shared.c;
            c.deregistrations
                .fetch_add(keys.len() as u64, Ordering::Relaxed);
            c.bytes_registered
                .fetch_sub(self.end - self.start, Ordering::Relaxed);
        }
        if self.monitored.load(Ordering::Acquire) && !self.retired.swap(true, Ordering::AcqRel) {
            if let Some(m) = self.shared.monitor {
                m.detach(self.span.0, self.span.1 - self.span.0);
            }
        }
        // The owner goes only once no registration over its memory can appear any more: a
        // placeholder killed while its registration runs keeps it until the registration has
        // finished (published or failed; its keys then go at the next retire or in `Drop`).
        if self.ready().is_some() || self.failed.load(Ordering::Acquire) {
            let owner = self.owner.lock().take();
            drop(owner);
        }
    }
}

/// Kill-and-retire helper for entries removed from the index: deregister those without
/// users now (thread caches may still hold their memory), the others at their last release.
fn retire_all(v: Vec<Arc<Entry>>) {
    for x in &v {
        x.try_retire();
    }
    drop(v);
}

impl Drop for Entry {
    fn drop(&mut self) {
        // Last reference to the memory gone (index, leases, waiters): nobody can use the keys.
        self.retire();
    }
}

/// A counted reference to a registration. While it lives the MR stays registered (even if
/// its range is invalidated meanwhile: it is then deregistered at the last drop).
///
/// What [`RegCache::get_raw`] returns; the safe paths wrap one in [`RegOwned`], [`RegRef`]
/// or [`RegMut`]. Its [`Registered`] offsets run over [`range`](Self::range).
///
/// ```
/// use mrkit::cache::{CacheConfig, RegCache};
/// use mrkit::{AccessFlags, Context, Registered};
/// let pd = Context::open_default().unwrap().alloc_pd().unwrap();
/// let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
/// let v = vec![0u8; 4096];
/// let a = v.as_ptr() as u64;
/// // SAFETY: `v` outlives the handle; local rights only.
/// let h = unsafe { cache.get_raw(a, 4096, AccessFlags::LOCAL_WRITE) }.unwrap();
/// let (start, end) = h.range(); // page-rounded
/// assert!(start <= a && a + 4096 <= end && h.access().contains(AccessFlags::LOCAL_WRITE));
/// assert_eq!(h.lkey_for(a), Some(h.lkey()));
/// assert_eq!(h.sges_at(a, 4096).unwrap()[0].addr, a);
/// assert_eq!(h.len(), end - start);
/// assert!(h.is_cached());
/// cache.invalidate(a, 4096);
/// assert!(!h.is_cached()); // still registered until `h` is dropped
/// ```
#[derive(Debug)]
pub struct RegHandle {
    h: Handle<Entry>,
}

impl RegHandle {
    #[inline]
    fn e(&self) -> &Entry {
        self.h.entry()
    }
    /// The MRs, in address order (one unless the range was split).
    pub fn pieces(&self) -> &[Piece] {
        self.e().ready().map(Vec::as_slice).unwrap_or(&[])
    }
    /// Registered range (may be larger than requested: page rounding, merging).
    pub fn range(&self) -> (u64, u64) {
        (self.e().start, self.e().end)
    }
    /// Rights of the registration (a superset of the requested ones).
    pub fn access(&self) -> AccessFlags {
        self.e().access
    }
    /// lkey of the piece holding `addr`.
    pub fn lkey_for(&self, addr: u64) -> Option<u32> {
        self.piece_for(addr).map(|p| p.lkey)
    }
    /// rkey of the piece holding `addr`.
    pub fn rkey_for(&self, addr: u64) -> Option<u32> {
        self.piece_for(addr).map(|p| p.rkey)
    }
    fn piece_for(&self, addr: u64) -> Option<&Piece> {
        self.pieces()
            .iter()
            .find(|p| addr >= p.addr && addr - p.addr < p.len)
    }
    /// lkey (first piece).
    pub fn lkey(&self) -> u32 {
        self.pieces().first().map(|p| p.lkey).unwrap_or(0)
    }
    /// rkey (first piece).
    pub fn rkey(&self) -> u32 {
        self.pieces().first().map(|p| p.rkey).unwrap_or(0)
    }
    /// SGEs covering `[addr, addr+len)` (absolute addresses; split at piece boundaries and at
    /// 4 GiB - 1 per SGE). `None` when the range is not inside the registration. (The
    /// [`Registered::sges`] of a handle takes offsets from [`range`](Self::range)'s start.)
    pub fn sges_at(&self, addr: u64, len: u64) -> Option<Vec<LocalSlice>> {
        self.split(addr, len, |a, l, p| LocalSlice {
            addr: a,
            len: l as u32,
            lkey: p.lkey,
        })
    }
    /// Remote descriptors covering `[addr, addr+len)` (absolute addresses).
    pub fn remotes_at(&self, addr: u64, len: u64) -> Option<Vec<RemoteSlice>> {
        self.split(addr, len, |a, l, p| RemoteSlice {
            addr: a,
            len: l,
            rkey: p.rkey,
        })
    }
    fn split<T>(&self, addr: u64, len: u64, f: impl Fn(u64, u64, &Piece) -> T) -> Option<Vec<T>> {
        let end = addr.checked_add(len)?;
        if addr < self.e().start || end > self.e().end {
            return None;
        }
        let mut out = Vec::new();
        let mut a = addr;
        while a < end {
            let p = self.piece_for(a)?;
            let l = (p.addr + p.len).min(end) - a;
            let l = l.min(u64::from(u32::MAX));
            out.push(f(a, l, p));
            a += l;
        }
        Some(out)
    }
    /// Whether the registration is still in the cache (false after invalidation/eviction,
    /// or for an uncached registration).
    pub fn is_cached(&self) -> bool {
        self.e().cached.load(Ordering::Acquire) && !self.e().is_dead()
    }
}

impl Clone for RegHandle {
    fn clone(&self) -> Self {
        // Same lease: a live handle keeps its count above 0 throughout.
        RegHandle { h: self.h.clone() }
    }
}

// Dropping the `Handle` gives its count back; the last release of a dead entry deregisters
// it (see [`lease`]).

impl RegHandle {
    /// Append the SGEs of `len` bytes at absolute `addr` to `out` (EINVAL, `out` unchanged,
    /// when they are not inside the registration).
    fn push_sges(&self, addr: u64, len: u64, out: &mut Vec<LocalSlice>) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        match self.sges_at(addr, len) {
            Some(v) => {
                out.extend(v);
                Ok(())
            }
            None => Err(Error::new(
                Errno::EINVAL,
                format!("{len} bytes at {addr:#x} are not inside the cached registration"),
            )),
        }
    }
}

// SAFETY: a raw handle's memory is kept valid by `get_raw`'s contract for as long as the
// handle lives (its whole registered range, which `len`/`sges` span); the SGEs come from the
// registration's pieces, which stay registered while the handle lives.
unsafe impl Registered for RegHandle {
    fn len(&self) -> u64 {
        let (s, e) = self.range();
        e - s
    }
    fn sges(&self, range: Range<u64>, out: &mut Vec<LocalSlice>) -> Result<()> {
        let (off, len) = check_range(&range, Registered::len(self), "cache registration")?;
        self.push_sges(self.range().0 + off, len, out)
    }
}
// SAFETY: `get_raw`'s contract covers device writes (nothing else touches the bytes while a
// work request that writes them is outstanding).
unsafe impl DeviceWritable for RegHandle {}

/// The error of a borrowed lookup asking for rights a borrow cannot back.
#[cold]
fn borrowed_rights_error(access: AccessFlags, what: &str) -> Error {
    let msg = if access.intersects(REMOTE_RIGHTS) {
        format!(
            "{what} cannot grant remote rights ({access:?}): the cached registration, and the \
             rkey a peer holds, outlive the borrow, so a peer could reach the memory after it \
             is freed or while it is borrowed immutably; register memory peers may reach \
             through RegCache::get_owned (the cache then keeps it alive)"
        )
    } else {
        format!(
            "{what} cannot let the device write ({access:?}): use RegCache::get_mut with an \
             exclusive borrow"
        )
    };
    Error::new(Errno::EINVAL, msg)
}

/// A registration over memory the cache co-owns ([`RegCache::get_owned`]). Offsets in
/// [`Registered::sges`] and [`RegOwned::remote`] run over the range it was asked for.
///
/// ```
/// use std::sync::Arc;
/// use mrkit::cache::{CacheConfig, RegCache};
/// use mrkit::{AccessFlags, Buffer, Context, Registered};
/// let pd = Context::open_default().unwrap().alloc_pd().unwrap();
/// let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
/// let buf = Arc::new(Buffer::new(8192).unwrap());
/// let acc = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
/// let h = cache.get_owned(&buf, 4096..8192, acc).unwrap();
/// assert_eq!(h.len(), 4096);
/// let r = h.remote(0..4096).unwrap();
/// assert_eq!((r.addr, r.len, r.rkey), (buf.addr() + 4096, 4096, h.rkey()));
/// ```
#[derive(Debug)]
pub struct RegOwned<M> {
    h: RegHandle,
    mem: Arc<M>,
    addr: u64,
    len: u64,
}

impl<M> Clone for RegOwned<M> {
    fn clone(&self) -> Self {
        RegOwned {
            h: self.h.clone(),
            mem: self.mem.clone(),
            addr: self.addr,
            len: self.len,
        }
    }
}

impl<M: OwnedMemory> RegOwned<M> {
    /// The memory (shared with the caller and, with remote rights, the cached entry).
    pub fn memory(&self) -> &Arc<M> {
        &self.mem
    }
    /// lkey of the registration (of its first MR when it was split).
    pub fn lkey(&self) -> u32 {
        self.h.lkey_for(self.addr).unwrap_or(0)
    }
    /// rkey of the registration (of its first MR when it was split).
    pub fn rkey(&self) -> u32 {
        self.h.rkey_for(self.addr).unwrap_or(0)
    }
    /// Rights of the registration (a superset of the requested ones).
    pub fn access(&self) -> AccessFlags {
        self.h.access()
    }
    /// What a peer needs to reach `range` (offsets into the memory): `EINVAL` outside it or
    /// when the range spans two MRs (a registration split above `max_chunk`; see
    /// [`remotes`](Self::remotes)).
    pub fn remote(&self, range: Range<u64>) -> Result<RemoteSlice> {
        let mut v = self.remotes(range.clone())?;
        match v.len() {
            1 => Ok(v.remove(0)),
            0 => Ok(RemoteSlice {
                addr: self.addr + range.start,
                len: 0,
                rkey: self.rkey(),
            }),
            n => Err(Error::new(
                Errno::EINVAL,
                format!("the range spans {n} memory regions: use RegOwned::remotes"),
            )),
        }
    }
    /// Remote descriptors for `range`, one per MR it spans.
    pub fn remotes(&self, range: Range<u64>) -> Result<Vec<RemoteSlice>> {
        let (off, len) = check_range(&range, self.len, "cache handle")?;
        if len == 0 {
            return Ok(Vec::new());
        }
        self.h
            .remotes_at(self.addr + off, len)
            .ok_or_else(|| Error::new(Errno::EINVAL, "range outside the registration"))
    }
    /// Whether the registration is still cached (see [`RegHandle::is_cached`]).
    pub fn is_cached(&self) -> bool {
        self.h.is_cached()
    }
}

// SAFETY: the handle holds the owner (an `Arc`), whose `OwnedMemory` contract keeps
// `[addr, addr + len)` mapped at that address while it lives; the SGEs are cut from those bytes
// and carry the pieces' lkeys, registered while the handle lives.
unsafe impl<M: OwnedMemory> Registered for RegOwned<M> {
    fn len(&self) -> u64 {
        self.len
    }
    fn sges(&self, range: Range<u64>, out: &mut Vec<LocalSlice>) -> Result<()> {
        let (off, len) = check_range(&range, self.len, "cache handle")?;
        self.h.push_sges(self.addr + off, len, out)
    }
}
// SAFETY: owned memory is device-shared by its `OwnedMemory` contract: no `&mut` to the bytes is
// reachable through the `Arc`, and reads through another clone race with the device exactly as
// they race with a peer's RDMA WRITE, which that contract already admits (read after the
// completion).
unsafe impl<M: OwnedMemory> DeviceWritable for RegOwned<M> {}

/// A registration of borrowed bytes the device only reads ([`RegCache::get_ref`]).
///
/// ```
/// # use mrkit::cache::{CacheConfig, RegCache};
/// # use mrkit::{AccessFlags, Context};
/// # let pd = Context::open_default().unwrap().alloc_pd().unwrap();
/// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
/// let msg = String::from("hello");
/// let h = cache.get_ref(msg.as_bytes(), AccessFlags::empty()).unwrap();
/// assert_eq!(h.as_slice(), b"hello");
/// assert!(h.lkey() != 0 && h.is_cached() && !h.access().contains(AccessFlags::REMOTE_READ));
/// ```
#[derive(Debug, Clone)]
pub struct RegRef<'a> {
    h: RegHandle,
    mem: &'a [u8],
}

impl<'a> RegRef<'a> {
    /// lkey of the registration at the first byte (the SGEs of [`Registered::sges`] carry
    /// the right key for every byte).
    pub fn lkey(&self) -> u32 {
        self.h.lkey_for(self.mem.as_ptr() as u64).unwrap_or(0)
    }
    /// The borrowed bytes.
    pub fn as_slice(&self) -> &'a [u8] {
        self.mem
    }
    /// Rights of the registration (a superset of the requested ones).
    pub fn access(&self) -> AccessFlags {
        self.h.access()
    }
    /// Whether the registration is still cached (see [`RegHandle::is_cached`]).
    pub fn is_cached(&self) -> bool {
        self.h.is_cached()
    }
}

// SAFETY: the handle borrows the bytes for its whole life and the SGEs are cut from them; the
// device only reads through a `RegRef` (it is not `DeviceWritable`), and no remote right was
// granted for them by this path.
unsafe impl Registered for RegRef<'_> {
    fn len(&self) -> u64 {
        self.mem.len() as u64
    }
    fn sges(&self, range: Range<u64>, out: &mut Vec<LocalSlice>) -> Result<()> {
        let (off, len) = check_range(&range, self.mem.len() as u64, "borrowed memory")?;
        self.h.push_sges(self.mem.as_ptr() as u64 + off, len, out)
    }
}

/// A registration of exclusively borrowed bytes the device may write ([`RegCache::get_mut`]).
///
/// ```
/// # use mrkit::cache::{CacheConfig, RegCache};
/// # use mrkit::{AccessFlags, Context};
/// # let pd = Context::open_default().unwrap().alloc_pd().unwrap();
/// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
/// let mut block = vec![0u8; 4096];
/// let mut h = cache.get_mut(&mut block, AccessFlags::LOCAL_WRITE).unwrap();
/// h.as_mut_slice()[0] = 9;
/// assert_eq!(h.as_slice()[0], 9);
/// assert!(h.access().contains(AccessFlags::LOCAL_WRITE) && h.lkey() != 0 && h.is_cached());
/// ```
#[derive(Debug)]
pub struct RegMut<'a> {
    h: RegHandle,
    mem: &'a mut [u8],
}

impl RegMut<'_> {
    /// lkey of the registration at the first byte (the SGEs of [`Registered::sges`] carry
    /// the right key for every byte).
    pub fn lkey(&self) -> u32 {
        self.h.lkey_for(self.mem.as_ptr() as u64).unwrap_or(0)
    }
    /// The borrowed bytes (not while a work request holds the handle: it is moved or
    /// borrowed by it).
    pub fn as_slice(&self) -> &[u8] {
        self.mem
    }
    /// The borrowed bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.mem
    }
    /// Rights of the registration (a superset of the requested ones).
    pub fn access(&self) -> AccessFlags {
        self.h.access()
    }
    /// Whether the registration is still cached (see [`RegHandle::is_cached`]).
    pub fn is_cached(&self) -> bool {
        self.h.is_cached()
    }
}

// SAFETY: as `RegRef`: the handle borrows the bytes (exclusively) for its whole life.
unsafe impl Registered for RegMut<'_> {
    fn len(&self) -> u64 {
        self.mem.len() as u64
    }
    fn sges(&self, range: Range<u64>, out: &mut Vec<LocalSlice>) -> Result<()> {
        let (off, len) = check_range(&range, self.mem.len() as u64, "borrowed memory")?;
        self.h.push_sges(self.mem.as_ptr() as u64 + off, len, out)
    }
}
// SAFETY: the borrow is exclusive: while a work request holds the handle (by value or `&mut`),
// nothing else can reach the bytes.
unsafe impl DeviceWritable for RegMut<'_> {}

/// A registration or, when registration was impossible, a bounce buffer from the pool.
///
/// ```
/// use mrkit::cache::{CacheConfig, RegCache, Registration};
/// use mrkit::pool::{MrPool, PoolConfig};
/// use mrkit::{AccessFlags, Context, DeviceConfig, Registered};
/// // A device with room for two MRs: one for the bounce pool, one for the cache.
/// let ctx = Context::open(DeviceConfig::rxe().max_mr(2));
/// let pd = ctx.alloc_pd().unwrap();
/// let pool = MrPool::new(&pd, PoolConfig { chunk_size: 64 << 10, max_chunks: 1, thp: false, ..PoolConfig::default() }).unwrap();
/// let cache = RegCache::new(&pd, CacheConfig { bounce: Some(pool), ..Default::default() }).unwrap();
/// let (a, b) = (vec![1u8; 4096], vec![2u8; 4096]);
/// // SAFETY (both lookups): the vectors outlive the handles; local rights only.
/// let ha = unsafe { cache.get_or_bounce_raw(a.as_ptr() as u64, 4096, AccessFlags::empty()) }.unwrap();
/// assert!(matches!(ha, Registration::Mr(_)));
/// // `a`'s registration is in use: `b` cannot be registered, it is bounced.
/// let hb = unsafe { cache.get_or_bounce_raw(b.as_ptr() as u64, 4096, AccessFlags::empty()) }.unwrap();
/// let Registration::Bounce(mut bb) = hb else { panic!("expected a bounce buffer") };
/// bb.copy_in(&b); // then post `bb` in place of `b`
/// assert_eq!(Registered::len(&bb), 4096);
/// let mut back = vec![0u8; 4096];
/// bb.copy_out(&mut back);
/// assert_eq!(back, b);
/// ```
#[derive(Debug)]
pub enum Registration {
    /// The memory itself is registered.
    Mr(RegHandle),
    /// Copy through these pool slots instead.
    Bounce(BounceBuffer),
}

/// Pool slots standing in for memory that could not be registered.
/// [`BounceBuffer::copy_in`] before a work request that reads it,
/// [`BounceBuffer::copy_out`] after one that wrote it (example at [`Registration`]).
#[derive(Debug)]
pub struct BounceBuffer {
    slots: Vec<OwnedSlot>,
    len: u64,
}

impl BounceBuffer {
    /// Bytes covered.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Copy `src` into the bounce slots (before a send/write).
    pub fn copy_in(&mut self, src: &[u8]) {
        let mut off = 0;
        for s in &mut self.slots {
            let n = (src.len() - off).min(s.as_slice().len());
            s.as_mut_slice()[..n].copy_from_slice(&src[off..off + n]);
            off += n;
        }
    }
    /// Copy the bounce slots out to `dst` (after a receive/read).
    pub fn copy_out(&self, dst: &mut [u8]) {
        let mut off = 0;
        for s in &self.slots {
            let n = (dst.len() - off).min(s.as_slice().len());
            dst[off..off + n].copy_from_slice(&s.as_slice()[..n]);
            off += n;
        }
    }
}

// SAFETY: the bounce buffer owns its pool slots (each keeps its registered chunk alive); the
// SGEs are cut from the slots with their lkeys, in order.
unsafe impl Registered for BounceBuffer {
    fn len(&self) -> u64 {
        self.len
    }
    fn sges(&self, range: Range<u64>, out: &mut Vec<LocalSlice>) -> Result<()> {
        check_range(&range, self.len, "bounce buffer")?;
        let mut base = 0u64;
        for s in &self.slots {
            let l = s.as_slice().len() as u64;
            let (a, b) = (range.start.max(base), range.end.min(base + l));
            if a < b {
                out.push(s.local(a - base..b - base)?);
            }
            base += l;
        }
        Ok(())
    }
}
// SAFETY: owned slots: nothing else references them while a work request holds the buffer.
unsafe impl DeviceWritable for BounceBuffer {}

// SAFETY: either variant upholds the contract itself.
unsafe impl Registered for Registration {
    fn len(&self) -> u64 {
        match self {
            Registration::Mr(h) => Registered::len(h),
            Registration::Bounce(b) => b.len,
        }
    }
    fn sges(&self, range: Range<u64>, out: &mut Vec<LocalSlice>) -> Result<()> {
        match self {
            Registration::Mr(h) => h.sges(range, out),
            Registration::Bounce(b) => b.sges(range, out),
        }
    }
}
// SAFETY: as above (a raw handle under `get_or_bounce_raw`'s contract, or owned slots).
unsafe impl DeviceWritable for Registration {}

/// Per-thread counters, written by their owner only.
#[derive(Debug, Default)]
struct ThreadStats {
    hits: AtomicU64,
}

/// A thread's holds by the 4 KiB page of request addresses: open addressing with linear
/// probing in a power-of-two array kept at most half full, 16 bytes a slot, so a lookup
/// reads one line of the table and then the lease's line. Tables of 2 MiB and more are
/// mapped on their own for transparent huge pages ([`lease::mem::Slots`]).
struct PageTable<V> {
    slots: Slots<(u64, Option<V>)>,
    len: usize,
    /// 64 - log2(slots.len()).
    shift: u32,
}

impl<V> Default for PageTable<V> {
    fn default() -> Self {
        PageTable {
            slots: Slots::default(),
            len: 0,
            shift: 0,
        }
    }
}

impl<V> PageTable<V> {
    #[inline]
    fn home(&self, key: u64) -> usize {
        // Fibonacci hashing: the top bits of the product.
        (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> self.shift) as usize
    }

    #[inline]
    fn get(&self, key: u64) -> Option<&V> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        // At most half full: an empty slot ends every probe.
        loop {
            match &self.slots[i] {
                (k, Some(h)) if *k == key => return Some(h),
                (_, None) => return None,
                _ => i = (i + 1) & mask,
            }
        }
    }

    /// Remove `key` (backward-shift deletion: no tombstones, probes stay short).
    fn remove(&mut self, key: u64) -> Option<V> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        loop {
            match &self.slots[i] {
                (k, Some(_)) if *k == key => break,
                (_, None) => return None,
                _ => i = (i + 1) & mask,
            }
        }
        let out = self.slots[i].1.take();
        self.len -= 1;
        // Shift later members of the probe run back into the hole when their home is not
        // in the cyclic range (hole, j].
        let mut hole = i;
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let h = match &self.slots[j] {
                (_, None) => break,
                (k, Some(_)) => self.home(*k),
            };
            let stays = if hole <= j {
                hole < h && h <= j
            } else {
                hole < h || h <= j
            };
            if !stays {
                self.slots.swap(hole, j);
                hole = j;
            }
        }
        out
    }

    /// Insert or replace; returns the replaced hold.
    fn insert(&mut self, key: u64, hold: V) -> Option<V> {
        if (self.len + 1) * 2 > self.slots.len() {
            self.rebuild((self.slots.len() * 2).max(16));
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        loop {
            match &mut self.slots[i] {
                (k, Some(h)) if *k == key => return Some(std::mem::replace(h, hold)),
                (k, slot @ None) => {
                    *k = key;
                    *slot = Some(hold);
                    self.len += 1;
                    return None;
                }
                _ => i = (i + 1) & mask,
            }
        }
    }

    /// Re-create (same size) keeping the holds `keep` accepts; the others are pushed to
    /// `out` (released by the caller outside the thread-local borrow).
    fn retain(&mut self, keep: impl Fn(&V) -> bool, out: &mut Vec<V>) {
        let size = self.slots.len();
        if size == 0 {
            return;
        }
        let mut old = std::mem::take(&mut self.slots);
        self.len = 0;
        self.alloc(size);
        for (k, h) in old.iter_mut() {
            if let Some(h) = h.take() {
                if keep(&h) {
                    self.insert(*k, h);
                } else {
                    out.push(h);
                }
            }
        }
    }

    /// Re-create with `size` slots (a power of two), keeping every hold.
    fn rebuild(&mut self, size: usize) {
        let mut old = std::mem::take(&mut self.slots);
        self.len = 0;
        self.alloc(size);
        for (k, h) in old.iter_mut() {
            if let Some(h) = h.take() {
                self.insert(*k, h);
            }
        }
    }

    fn alloc(&mut self, size: usize) {
        debug_assert!(size.is_power_of_two() && size >= 16);
        self.slots = Slots::new(size, || (0, None));
        self.shift = 64 - size.trailing_zeros();
    }
}

/// One thread's table for one cache: holds by the page of a request address, and a ring of
/// the last few entries matched by range (lookups anywhere inside a large entry).
/// Validated as a whole by the monitor sequence (a caught-up table has seen every queued
/// invalidation applied), and hold by hold by the lease's dead bit.
struct TlsCache {
    cache_id: u64,
    alive: Weak<Inner>,
    mseq: u64,
    map: PageTable<Hold<Entry>>,
    ring: [Option<Hold<Entry>>; RING],
    next: usize,
    stats: Arc<ThreadStats>,
}

/// Range-matched holds per thread table.
const RING: usize = 4;

/// Entries of at most this many pages have their slots dropped from the invalidating
/// thread's table at once ([`RegCache::tls_forget`]).
const FORGET_PAGES: u64 = 64;

/// Key of the thread table.
#[inline]
fn page_key(addr: u64) -> u64 {
    addr >> 12
}

thread_local! {
    static TLS: RefCell<Vec<TlsCache>> = const { RefCell::new(Vec::new()) };
}

static NEXT_CACHE_ID: AtomicU64 = AtomicU64::new(1);

#[derive(Debug)]
struct Inner {
    id: u64,
    shared: Arc<Shared>,
    cfg: CacheConfig,
    max_chunk: u64,
    page: u64,
    /// Most slots of one thread's table (see [`TlsCache`]).
    tls_cap: usize,
    index: RwLock<IntervalIndex<Arc<Entry>>>,
    pending: Arc<Pending>,
    next_id: AtomicU64,
    epoch: Instant,
    threads: Mutex<Vec<Arc<ThreadStats>>>,
}

/// The registration cache. Cheap to clone (shared).
///
/// ```
/// # use mrkit::cache::{CacheConfig, RegCache};
/// # use mrkit::{AccessFlags, Context};
/// # let pd = Context::open_default().unwrap().alloc_pd().unwrap();
/// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
/// let v = vec![0u8; 4096];
/// let h = cache.get_ref(&v, AccessFlags::empty()).unwrap();
/// assert_eq!(cache.len(), 1);
/// let (start, end, _access, users) = cache.entries()[0];
/// assert!(start <= v.as_ptr() as u64 && end >= v.as_ptr() as u64 + 4096 && users == 1);
/// assert!(cache.id() > 0 && cache.is_monitored());
/// drop(h);
/// assert_eq!(cache.flush_idle(), 1); // release every idle entry now
/// assert!(cache.is_empty());
/// ```
#[derive(Debug, Clone)]
pub struct RegCache {
    inner: Arc<Inner>,
}

fn page_span(page: u64, a: u64, b: u64) -> (u64, u64) {
    (a & !(page - 1), (b + page - 1) & !(page - 1))
}

enum Lookup {
    Hit(RegHandle, Hold<Entry>),
    Wait(Arc<Entry>),
    Miss,
}

impl RegCache {
    /// A cache over `pd`.
    ///
    /// `EOPNOTSUPP` with the default [`MonitorMode::Userfaultfd`] when the process cannot use
    /// userfaultfd (the message says how to allow it).
    ///
    /// ```
    /// use mrkit::cache::{CacheConfig, RegCache};
    /// let pd = mrkit::Context::open_default().unwrap().alloc_pd().unwrap();
    /// let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// assert!(cache.is_empty());
    /// ```
    pub fn new(pd: &ProtectionDomain, cfg: CacheConfig) -> Result<RegCache> {
        let monitor = match cfg.monitor {
            MonitorMode::Userfaultfd => Some(monitor::global().map_err(|e| {
                Error::new(
                    Errno::EOPNOTSUPP,
                    format!(
                        "{e}; the cache cannot see munmap/madvise without it. Allow userfaultfd \
                         (root, CAP_SYS_PTRACE, vm.unprivileged_userfaultfd=1 or access to \
                         /dev/userfaultfd) or choose the unsafe MonitorMode::explicit_only() \
                         and call invalidate() before freeing cached memory"
                    ),
                )
            })?),
            MonitorMode::ExplicitOnly(_) => None,
        };
        let page = rustix::param::page_size() as u64;
        let max_mr = pd.context().query_device().max_mr_size;
        let max_chunk = (cfg.max_chunk.min(max_mr) & !(page - 1)).max(page);
        let pending = Arc::new(Pending::new(cfg.pending_capacity));
        // Room for every entry looked up at a few addresses, bounded.
        let cfg_tls_cap = cfg.max_entries.saturating_mul(4).clamp(1024, 1 << 20);
        if let Some(m) = monitor {
            m.subscribe(pending.clone());
        }
        let cache = RegCache {
            inner: Arc::new(Inner {
                id: NEXT_CACHE_ID.fetch_add(1, Ordering::Relaxed),
                shared: Arc::new(Shared {
                    pd: pd.clone(),
                    monitor,
                    c: Counters::default(),
                }),
                cfg,
                max_chunk,
                page,
                tls_cap: cfg_tls_cap,
                index: RwLock::new(IntervalIndex::default()),
                pending,
                next_id: AtomicU64::new(1),
                epoch: Instant::now(),
                threads: Mutex::new(Vec::new()),
            }),
        };
        export::add(&cache.inner);
        Ok(cache)
    }

    /// Process-unique id of this cache (as in the `"cache"` section of
    /// [`stat_export::snapshot`](crate::stat_export::snapshot)).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// A registration of `range` (offsets into `mem`) over memory the cache then
    /// **co-owns**: the handle, and with remote rights the cached entry too, keep `mem` alive,
    /// so the rkey stays sound for as long as a peer can use it (until the entry is
    /// invalidated, evicted or idle-released, and its last handle is dropped). With remote
    /// rights the registration covers at most `mem`'s own bytes. `EINVAL` for a range outside
    /// `mem` or empty.
    ///
    /// Use this path for memory peers read or write (any of `REMOTE_READ`, `REMOTE_WRITE`,
    /// `REMOTE_ATOMIC`, `MW_BIND`, the flush rights). While an entry with remote rights holds
    /// `mem`, `Arc::get_mut` on it fails: peers may write it at any time, so the process gets
    /// no `&mut` to it until [`invalidate`](Self::invalidate) (or eviction) has deregistered
    /// the entry. With local rights only, the entry keeps nothing and `mem` is the caller's
    /// again once the handle is dropped.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use mrkit::cache::{CacheConfig, RegCache};
    /// use mrkit::{AccessFlags, Buffer, Context};
    /// let pd = Context::open_default().unwrap().alloc_pd().unwrap();
    /// let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let io = Arc::new(Buffer::new(64 << 10).unwrap());
    /// let all = 0..io.len() as u64;
    /// let acc = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    /// let h = cache.get_owned(&io, all.clone(), acc).unwrap();
    /// let for_peer = h.remote(0..4096).unwrap(); // hand this to the peer
    /// drop(h);
    /// // The entry keeps the buffer (and the rkey) alive; the next lookup is a hit.
    /// assert_eq!(cache.get_owned(&io, all, acc).unwrap().rkey(), for_peer.rkey);
    /// assert_eq!(Arc::strong_count(&io), 2);
    /// cache.invalidate(io.addr(), io.len() as u64);
    /// assert_eq!(Arc::strong_count(&io), 1); // deregistered: the buffer is ours alone again
    /// ```
    #[inline]
    pub fn get_owned<M: OwnedMemory>(
        &self,
        mem: &Arc<M>,
        range: Range<u64>,
        access: AccessFlags,
    ) -> Result<RegOwned<M>> {
        let (base, size) = mem.range();
        let (off, len) = check_range(&range, size, "owned memory")?;
        let addr = base + off;
        let h = match self.fast_hit(addr, len, access) {
            Some(h) => h,
            None => {
                let own = access.intersects(REMOTE_RIGHTS).then(|| OwnerRange {
                    owner: mem.clone(),
                    start: base,
                    end: base + size,
                });
                self.get_slow(addr, len, access, false, own.as_ref())
                    .map_err(|(e, _)| e)?
            }
        };
        Ok(RegOwned {
            h,
            mem: mem.clone(),
            addr,
            len,
        })
    }

    /// A registration of borrowed bytes the device only **reads** (SEND, RDMA WRITE source):
    /// the handle borrows `mem` for `'a`. `access` may hold no write and no remote right:
    /// `EINVAL` otherwise (see [`get_mut`](Self::get_mut) and [`get_owned`](Self::get_owned)).
    ///
    /// ```
    /// use mrkit::cache::{CacheConfig, RegCache};
    /// use mrkit::{AccessFlags, Context, Registered};
    /// let pd = Context::open_default().unwrap().alloc_pd().unwrap();
    /// let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let msg = String::from("hello");
    /// let h = cache.get_ref(msg.as_bytes(), AccessFlags::empty()).unwrap();
    /// let mut sges = Vec::new();
    /// h.sges(0..5, &mut sges).unwrap(); // what a SEND of "hello" posts
    /// assert_eq!((sges[0].addr, sges[0].len), (msg.as_ptr() as u64, 5));
    /// ```
    ///
    /// Remote rights on borrowed memory are refused: the cached registration (and the rkey a
    /// peer holds) would outlive the borrow.
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags, Context, Errno};
    /// # let pd = Context::open_default().unwrap().alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let s = String::from("immutable");
    /// let err = cache.get_ref(s.as_bytes(), AccessFlags::REMOTE_WRITE).unwrap_err();
    /// assert_eq!(err.errno(), Errno::EINVAL);
    /// ```
    #[inline]
    pub fn get_ref<'a>(&self, mem: &'a [u8], access: AccessFlags) -> Result<RegRef<'a>> {
        if access.is_writable() || access.intersects(REMOTE_RIGHTS) {
            return Err(borrowed_rights_error(access, "get_ref (a shared borrow)"));
        }
        let h = self.get_local(mem.as_ptr() as u64, mem.len() as u64, access)?;
        Ok(RegRef { h, mem })
    }

    /// A registration of borrowed bytes the device may **write** (RDMA READ destination,
    /// receive buffer, atomic result; also readable): the handle borrows `mem` exclusively for
    /// `'a`. Ask for `LOCAL_WRITE` where the device writes (an MR without it completes such
    /// a work request with a local protection error, as on hardware). Remote rights are
    /// refused with `EINVAL`: use [`get_owned`](Self::get_owned).
    ///
    /// ```
    /// use mrkit::cache::{CacheConfig, RegCache};
    /// use mrkit::{AccessFlags, Context, DeviceWritable};
    /// let pd = Context::open_default().unwrap().alloc_pd().unwrap();
    /// let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let mut block = vec![0u8; 4096];
    /// for _ in 0..3 {
    ///     let mut h = cache.get_mut(&mut block, AccessFlags::LOCAL_WRITE).unwrap();
    ///     fn post_read_into(_dst: impl DeviceWritable) {}
    ///     h.as_mut_slice()[0] += 1; // the CPU may write too, between work requests
    ///     post_read_into(&mut h);
    /// } // each handle drop ends the borrow; the registration stays cached
    /// assert_eq!(block[0], 3);
    /// assert_eq!(cache.stats().misses, 1);
    /// ```
    ///
    /// A handle cannot outlive the memory it borrows:
    ///
    /// ```compile_fail,E0505
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags, Buffer, Context};
    /// # let pd = Context::open_default().unwrap().alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let mut buf = Buffer::new(4096).unwrap();
    /// let h = cache.get_mut(buf.as_mut_slice(), AccessFlags::LOCAL_WRITE).unwrap();
    /// drop(buf); // error: `buf` is still borrowed by `h`
    /// let _keep = h;
    /// ```
    #[inline]
    pub fn get_mut<'a>(&self, mem: &'a mut [u8], access: AccessFlags) -> Result<RegMut<'a>> {
        if access.intersects(REMOTE_RIGHTS) {
            return Err(borrowed_rights_error(access, "get_mut (a borrow)"));
        }
        let h = self.get_local(mem.as_ptr() as u64, mem.len() as u64, access)?;
        Ok(RegMut { h, mem })
    }

    #[inline]
    fn get_local(&self, addr: u64, len: u64, access: AccessFlags) -> Result<RegHandle> {
        if let Some(h) = self.fast_hit(addr, len, access) {
            return Ok(h);
        }
        self.get_slow(addr, len, access, false, None)
            .map_err(|(e, _)| e)
    }

    /// A registration covering `[addr, addr+len)` with at least `access`, on a raw address.
    ///
    /// The cache guarantees the returned keys translate to the pages mapped at the time of
    /// the call (not to pages of an earlier mapping at the same address). Prefer the safe
    /// entry points ([`get_owned`](Self::get_owned), [`get_ref`](Self::get_ref),
    /// [`get_mut`](Self::get_mut)); this one is for memory no Rust value owns (a C caller's,
    /// a custom allocator's).
    ///
    /// # Safety
    ///
    /// The registration may cover more than the requested bytes: the whole pages around them,
    /// with [`Shape::Merge`] the neighbouring raw registrations of the same kind (rights are
    /// the union), with [`Shape::WholeAllocation`] the whole mapping; [`RegHandle::range`]
    /// says which. For all of those bytes the caller guarantees:
    ///
    /// * they stay mapped, and are not freed or reused for data the device must not touch,
    ///   for as long as any handle from this call (or a clone) lives; where a work request
    ///   lets the device write them, nothing else reads or writes them until it completes;
    /// * with remote rights (`REMOTE_*`, `MW_BIND`, flushes), for as long as the entry stays
    ///   registered, which outlives the handles: until [`invalidate`](Self::invalidate) over
    ///   them has returned (or the entry was evicted or idle-released) and every handle has
    ///   been dropped. Peers holding the rkey may read and write them at any time until then.
    ///   The userfaultfd monitor does not shorten this: it drops an entry at the first
    ///   lookup after the unmap, not at the unmap;
    /// * with local rights only and [`MonitorMode::explicit_only`], the contract of that
    ///   mode (invalidate before unmapping).
    ///
    /// ```
    /// use mrkit::cache::{CacheConfig, RegCache};
    /// use mrkit::{AccessFlags, Context};
    /// let pd = Context::open_default().unwrap().alloc_pd().unwrap();
    /// let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let v = vec![0u8; 1 << 16];
    /// // SAFETY: `v` outlives the handle and the entry (invalidated before `v` is dropped);
    /// // the local rights let nothing but this handle's work requests reach it.
    /// let h = unsafe { cache.get_raw(v.as_ptr() as u64, v.len() as u64, AccessFlags::empty()) }.unwrap();
    /// assert!(h.range().0 <= v.as_ptr() as u64);
    /// drop(h);
    /// cache.invalidate(v.as_ptr() as u64, v.len() as u64);
    /// ```
    ///
    /// Registering a raw address without `unsafe` does not compile (the issue this closes: a
    /// safe lookup on an immutable `String`, changed by a loopback RDMA WRITE through the
    /// rkey):
    ///
    /// ```compile_fail,E0133
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags, Context};
    /// # let pd = Context::open_default().unwrap().alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let s = String::from("immutable");
    /// let h = cache.get_raw(s.as_ptr() as u64, s.len() as u64, AccessFlags::REMOTE_WRITE);
    /// ```
    #[inline]
    pub unsafe fn get_raw(&self, addr: u64, len: u64, access: AccessFlags) -> Result<RegHandle> {
        if let Some(h) = self.fast_hit(addr, len, access) {
            return Ok(h);
        }
        self.get_slow(addr, len, access, false, None)
            .map_err(|(e, _)| e)
    }

    /// Like [`get_raw`](Self::get_raw), but when the memory cannot be registered (device
    /// limits after eviction) and a bounce pool is configured ([`CacheConfig::bounce`]),
    /// return pool slots to copy through instead.
    ///
    /// # Safety
    ///
    /// As [`get_raw`](Self::get_raw).
    ///
    /// ```
    /// use mrkit::cache::{CacheConfig, RegCache, Registration};
    /// use mrkit::{AccessFlags, Context};
    /// let pd = Context::open_default().unwrap().alloc_pd().unwrap();
    /// let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let v = vec![7u8; 4096];
    /// // SAFETY: `v` outlives the handle; local rights only.
    /// match unsafe { cache.get_or_bounce_raw(v.as_ptr() as u64, 4096, AccessFlags::empty()) }.unwrap() {
    ///     Registration::Mr(h) => assert!(h.lkey() != 0),
    ///     Registration::Bounce(mut b) => b.copy_in(&v), // post `b` instead of `v`
    /// }
    /// ```
    pub unsafe fn get_or_bounce_raw(
        &self,
        addr: u64,
        len: u64,
        access: AccessFlags,
    ) -> Result<Registration> {
        if let Some(h) = self.fast_hit(addr, len, access) {
            return Ok(Registration::Mr(h));
        }
        match self.get_slow(addr, len, access, false, None) {
            Ok(h) => Ok(Registration::Mr(h)),
            Err((e, device_limit)) => {
                let Some(pool) = self.inner.cfg.bounce.as_ref().filter(|_| device_limit) else {
                    return Err(e);
                };
                let n = len.div_ceil(pool.slot_size() as u64);
                let mut slots = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    slots.push(pool.alloc_owned()?);
                }
                inc(&self.inner.shared.c.fallback_bounce);
                Ok(Registration::Bounce(BounceBuffer { slots, len }))
            }
        }
    }

    /// The per-thread path: the thread's table slot for `addr`, checked for coverage and
    /// rights, then a handle through the slot's lease (no lock, no shared write; see
    /// [`lease`]). The table is valid only while no monitor event arrived since it caught up
    /// (`mseq`): queued invalidations are applied by the slow path first.
    #[inline]
    fn fast_hit(&self, addr: u64, len: u64, access: AccessFlags) -> Option<RegHandle> {
        let inner = &*self.inner;
        let end = addr.checked_add(len)?;
        TLS.try_with(|t| {
            let t = t.borrow();
            let rec = t.iter().rev().find(|r| r.cache_id == inner.id)?;
            if inner.shared.monitor.is_some() && rec.mseq != monitor::seq() {
                return None;
            }
            let hold = match rec.map.get(page_key(addr)) {
                Some(h) if h.meta().covers(addr, end, access) => h,
                _ => rec
                    .ring
                    .iter()
                    .flatten()
                    .find(|h| h.meta().covers(addr, end, access))?,
            };
            // Dead (invalidated, evicted, superseded): miss; the slow path replaces the hold.
            let h = hold.get()?;
            let n = &rec.stats.hits;
            n.store(n.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
            Some(RegHandle { h })
        })
        .ok()
        .flatten()
    }

    /// Remember `hold` for lookups at `addr` in this thread's table; `mseq` is the monitor
    /// sequence read *before* the pending invalidations were applied (so every event it
    /// counts has killed its entries by now).
    fn tls_insert(&self, addr: u64, hold: Hold<Entry>, mseq: u64) {
        let inner = &self.inner;
        let dropped = TLS.try_with(|t| {
            let mut t = t.borrow_mut();
            // Tables of dropped caches hold entry memory (never registrations): let go of
            // them at this thread's next slow path.
            let gone: Vec<TlsCache> = if t.iter().any(|r| r.alive.strong_count() == 0) {
                let (live, gone) = std::mem::take(&mut *t)
                    .into_iter()
                    .partition(|r| r.alive.strong_count() > 0);
                *t = live;
                gone
            } else {
                Vec::new()
            };
            let pos = match t.iter().rposition(|r| r.cache_id == inner.id) {
                Some(p) => p,
                None => {
                    let stats = Arc::new(ThreadStats::default());
                    inner.threads.lock().push(stats.clone());
                    t.push(TlsCache {
                        cache_id: inner.id,
                        alive: Arc::downgrade(inner),
                        mseq,
                        map: PageTable::default(),
                        ring: Default::default(),
                        next: 0,
                        stats,
                    });
                    t.len() - 1
                }
            };
            let rec = &mut t[pos];
            rec.mseq = mseq;
            let key = page_key(addr);
            let mut old: Vec<Hold<Entry>> = Vec::new();
            if !rec.ring.iter().flatten().any(|r| r.same(&hold)) {
                let i = rec.next % RING;
                rec.next = rec.next.wrapping_add(1);
                old.extend(rec.ring[i].replace(hold.clone()));
            }
            if rec.map.len >= inner.tls_cap && rec.map.get(key).is_none() {
                // Full: drop the holds of dead entries, and everything if that is not enough.
                rec.map.retain(|h| !h.is_dead(), &mut old);
                if rec.map.len >= inner.tls_cap / 2 {
                    rec.map.retain(|_| false, &mut old);
                }
            }
            old.extend(rec.map.insert(key, hold));
            (old, gone)
        });
        // Leases released outside the thread-local borrow.
        drop(dropped);
    }

    /// A handle and a hold through this thread's ring slot on `e`, if any and alive.
    fn tls_reuse(&self, e: &Arc<Entry>) -> Option<(Handle<Entry>, Hold<Entry>)> {
        let id = self.inner.id;
        TLS.try_with(|t| {
            let t = t.borrow();
            let rec = t.iter().rev().find(|r| r.cache_id == id)?;
            let hold = rec
                .ring
                .iter()
                .flatten()
                .find(|h| std::ptr::eq(h.entry(), &**e))?;
            Some((hold.get()?, hold.clone()))
        })
        .ok()
        .flatten()
    }

    fn tick(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.inner.epoch).as_millis() as u64
    }

    /// Apply queued monitor invalidations; wait out an event being delivered. Returns the
    /// monitor sequence read before the queue was drained: every event it counts has had
    /// its entries killed once the index lock has been taken after this call (a drain by
    /// another thread applies under the write lock). Odd: an event was being delivered (do
    /// not let a thread table catch up to it).
    fn sync_monitor(&self) -> u64 {
        if self.inner.shared.monitor.is_none() {
            return 0;
        }
        if !monitor::wait_quiescent(Duration::from_secs(1)) {
            tracing::warn!("userfaultfd monitor stalled for 1 s; dropping every cached entry");
            self.invalidate(0, u64::MAX);
        }
        let mseq = monitor::seq();
        if self.inner.pending.is_nonempty() {
            // Drain and apply under one write lock (see `invalidate_locked`).
            let dead = {
                let mut ix = self.inner.index.write();
                let ranges = self.inner.pending.drain();
                self.invalidate_locked(&mut ix, &ranges)
            };
            self.finish_invalidation(dead);
        }
        mseq
    }

    fn lookup(&self, addr: u64, end: u64, access: AccessFlags) -> Lookup {
        let ix = self.inner.index.read();
        let mut wait = None;
        for (_, _, _, e) in ix.containing(addr, end) {
            if !e.access.contains(access) || e.is_dead() || e.failed.load(Ordering::Acquire) {
                continue;
            }
            if e.ready().is_some() {
                // In the index under the read lock: not dead (death is set under the write lock).
                // This thread's lease on the entry if its ring has one (one lease per thread
                // and entry for lookups all over a large entry), else a new one.
                let (h, hold) = self.tls_reuse(e).unwrap_or_else(|| lease::lease(e));
                return Lookup::Hit(RegHandle { h }, hold);
            } else if wait.is_none() {
                wait = Some(e.clone());
            }
        }
        match wait {
            Some(e) => Lookup::Wait(e),
            None => Lookup::Miss,
        }
    }

    /// Err carries whether the failure was a device/resource limit (bounce candidate).
    fn get_slow(
        &self,
        addr: u64,
        len: u64,
        access: AccessFlags,
        mut no_widen: bool,
        own: Option<&OwnerRange>,
    ) -> std::result::Result<RegHandle, (Error, bool)> {
        let inner = &*self.inner;
        let c = &inner.shared.c;
        if len == 0 {
            return Err((
                Error::new(Errno::EINVAL, "length 0: nothing to register"),
                false,
            ));
        }
        let end = addr
            .checked_add(len)
            .filter(|e| *e <= u64::MAX - inner.page)
            .ok_or_else(|| {
                (
                    Error::new(Errno::EINVAL, "addr + len wraps the address space"),
                    false,
                )
            })?;
        let mut evicted_for_enomem = false;
        for _attempt in 0..64 {
            let mseq = self.sync_monitor();
            match self.lookup(addr, end, access) {
                Lookup::Hit(h, hold) => {
                    inc(&c.hits_slow);
                    if mseq & 1 == 0 {
                        self.tls_insert(addr, hold, mseq);
                    }
                    return Ok(h);
                }
                Lookup::Wait(e) => {
                    inc(&c.single_flight_waits);
                    e.wait();
                    continue;
                }
                Lookup::Miss => {}
            }
            // --- miss: shape outside the lock ---
            let (mut s, mut e) = self.shape(addr, end, no_widen);
            if let Some(o) = own {
                // Peers may reach every byte of the registration: only the owner's.
                s = s.max(o.start);
                e = e.min(o.end);
            }
            let mut acc = access;
            // Merge only with entries of the same kind: with remote rights the union would
            // expose every member's bytes to peers, which only members that asked for remote
            // rights themselves (raw callers, under their contract) have agreed to.
            let remote = access.intersects(REMOTE_RIGHTS);
            let joins = |x: &Entry| {
                x.ready().is_some()
                    && !x.is_dead()
                    && x.mergeable
                    && x.access.intersects(REMOTE_RIGHTS) == remote
            };
            let placeholder;
            let mut superseded: Vec<Arc<Entry>> = Vec::new();
            let mut victims: Vec<Arc<Entry>> = Vec::new();
            {
                let mut ix = inner.index.write();
                // Someone may have inserted a covering entry (or placeholder) meanwhile.
                if ix.containing(addr, end).any(|(_, _, _, x)| {
                    x.access.contains(access) && !x.is_dead() && !x.failed.load(Ordering::Acquire)
                }) {
                    continue;
                }
                if let (Shape::Merge { cap }, false, None) = (inner.cfg.shape, no_widen, own) {
                    for _ in 0..3 {
                        let near: Vec<(u64, u64, AccessFlags)> = ix
                            .overlapping(s, e, true)
                            .filter(|(_, _, _, x)| joins(x))
                            .map(|(a, b, _, x)| (a, b, x.access))
                            .collect();
                        let ns = near.iter().map(|n| n.0).min().unwrap_or(s).min(s);
                        let ne = near.iter().map(|n| n.1).max().unwrap_or(e).max(e);
                        if (ns, ne) == (s, e) || ne - ns > cap {
                            break;
                        }
                        s = ns;
                        e = ne;
                        for n in &near {
                            acc |= n.2;
                        }
                    }
                    // Supersede every ready entry inside the merged range.
                    let ids: Vec<(u64, u64)> = ix
                        .overlapping(s, e, false)
                        .filter(|(a, b, _, x)| *a >= s && *b <= e && joins(x))
                        .map(|(a, _, id, _)| (a, id))
                        .collect();
                    for (a, id) in ids {
                        if let Some(x) = ix.remove(a, id) {
                            x.kill();
                            inc(&c.merges);
                            superseded.push(x);
                        }
                    }
                }
                // Limits: evict idle entries (approximate LRU) until the new one fits.
                let fits = self.make_room(&mut ix, e - s, &mut victims);
                placeholder = Arc::new(Entry {
                    id: inner.next_id.fetch_add(1, Ordering::Relaxed),
                    start: s,
                    end: e,
                    span: page_span(inner.page, s, e),
                    access: acc,
                    dead: AtomicBool::new(false),
                    pieces: OnceLock::new(),
                    failed: AtomicBool::new(false),
                    regs: Mutex::new(Vec::new()),
                    cached: AtomicBool::new(fits),
                    monitored: AtomicBool::new(false),
                    idle_since: AtomicU64::new(self.tick(Instant::now())),
                    wait_mx: Mutex::new(()),
                    wait_cv: Condvar::new(),
                    shared: inner.shared.clone(),
                    leases: LeaseSet::new(),
                    retired: AtomicBool::new(false),
                    owner: Mutex::new(own.map(|o| o.owner.clone())),
                    mergeable: own.is_none(),
                });
                if fits {
                    ix.insert(s, e, placeholder.id, placeholder.clone());
                } else {
                    // Private to its handles: leases are born dead, the last release retires.
                    placeholder.leases.kill();
                    inc(&c.uncached);
                }
            }
            inc(&c.misses);
            // Superseded and evicted entries were marked dead under the lock; each is
            // deregistered when its last reference (maybe this one) goes.
            retire_all(superseded);
            retire_all(victims);
            // --- attach to the monitor BEFORE pinning (see monitor docs) ---
            if let Some(m) = inner.shared.monitor {
                if placeholder.cached.load(Ordering::Acquire) {
                    let (ps, pe) = placeholder.span;
                    match m.attach(ps, pe - ps) {
                        Ok(()) => placeholder.monitored.store(true, Ordering::Release),
                        Err(err) => {
                            tracing::debug!(error = %err, "monitor cannot attach; registration uncached");
                            self.unindex(&placeholder);
                            placeholder.cached.store(false, Ordering::Release);
                            placeholder.leases.kill();
                            inc(&c.uncached);
                            inc(&c.unmonitored);
                        }
                    }
                }
            }
            // --- register outside any lock ---
            match self.register_pieces(s, e, acc) {
                Ok(pieces) => {
                    if pieces.len() > 1 {
                        inc(&c.splits);
                    }
                    // Owned by the entry from now on: deregistered when its last reference goes.
                    placeholder
                        .regs
                        .lock()
                        .extend(pieces.iter().map(|p| p.lkey));
                    // Publish: first apply invalidations that arrived while we registered.
                    let mseq = self.sync_monitor();
                    // The handle's lease is counted under the same lock: an invalidation after
                    // publication then finds a user and leaves the MR to our last release.
                    let published = {
                        let _ix = inner.index.write();
                        if placeholder.is_dead() {
                            None
                        } else {
                            let _ = placeholder.pieces.set(pieces);
                            Some(lease::lease(&placeholder))
                        }
                    };
                    placeholder.wake();
                    let Some((h, hold)) = published else {
                        // Invalidated while we pinned: the pages may be those of the old mapping.
                        inc(&c.stale_rejects);
                        placeholder.failed.store(true, Ordering::Release);
                        self.unindex(&placeholder);
                        continue;
                    };
                    if placeholder.cached.load(Ordering::Acquire) && mseq & 1 == 0 {
                        self.tls_insert(addr, hold, mseq);
                    }
                    return Ok(RegHandle { h });
                }
                Err(err) => {
                    placeholder.failed.store(true, Ordering::Release);
                    self.unindex(&placeholder);
                    placeholder.wake();
                    drop(placeholder);
                    let limit = matches!(err.errno(), Errno::ENOMEM | Errno::EAGAIN);
                    if limit && !evicted_for_enomem {
                        evicted_for_enomem = true;
                        inc(&c.fallback_evict_retry);
                        self.evict_idle(usize::MAX, None);
                        continue;
                    }
                    let (rs, re) = page_span(inner.page, addr, end);
                    if !no_widen && (s, e) != (rs, re) && (s, e) != (addr, end) {
                        no_widen = true;
                        inc(&c.fallback_shrink);
                        continue;
                    }
                    return Err((err, limit));
                }
            }
        }
        Err((
            Error::new(
                Errno::EAGAIN,
                "the range kept being invalidated while it was registered (64 attempts); the \
                 application is unmapping it concurrently",
            ),
            false,
        ))
    }

    fn unindex(&self, e: &Arc<Entry>) {
        let mut ix = self.inner.index.write();
        ix.remove(e.start, e.id);
    }

    fn shape(&self, addr: u64, end: u64, no_widen: bool) -> (u64, u64) {
        let page = self.inner.page;
        let rounded = page_span(page, addr, end);
        match self.inner.cfg.shape {
            Shape::Exact => (addr, end),
            Shape::PageRounded | Shape::Merge { .. } => rounded,
            Shape::WholeAllocation { cap } => {
                if no_widen {
                    return rounded;
                }
                match vma_bounds(addr, end) {
                    Some((s, e)) if e - s <= cap => (s, e),
                    _ => rounded,
                }
            }
        }
    }

    fn register_pieces(&self, s: u64, e: u64, access: AccessFlags) -> Result<Vec<Piece>> {
        let sh = &self.inner.shared;
        let ctx = sh.pd.context();
        let mut out: Vec<Piece> = Vec::new();
        let mut a = s;
        while a < e {
            let l = (e - a).min(self.inner.max_chunk);
            // SAFETY: the memory is valid for as long as the device can reach it through this
            // MR, by the path that asked (module docs, "The caller's contract"): an owned
            // lookup holds the owner during this call and in its handles, and with remote
            // rights in the entry until after deregistration (`Entry::retire`), and the range is
            // clamped to the owner; a borrowed lookup holds the borrow during this call and in
            // its handles, and gets local rights only, so after the borrow ends no work request
            // can name these keys without a new lookup, which the monitor (or the `unsafe`
            // explicit-invalidation promise) keeps from finding a stale translation; a raw
            // lookup has `get_raw`'s contract. Widening past the request (rounding, merging,
            // whole allocation) is local-only or among raw remote entries (see `Shape`).
            let mem = unsafe { mrkit_soft::UserMemory::new(a, l) };
            match ctx.provider().reg_mr(sh.pd.handle(), mem, a, access) {
                Ok(info) => out.push(Piece {
                    addr: a,
                    len: l,
                    lkey: info.lkey,
                    rkey: info.rkey,
                }),
                Err(err) => {
                    for p in &out {
                        let _ = ctx.provider().dereg_mr(p.lkey);
                    }
                    return Err(err);
                }
            }
            a += l;
        }
        sh.c.registrations
            .fetch_add(out.len() as u64, Ordering::Relaxed);
        sh.c.bytes_registered.fetch_add(e - s, Ordering::Relaxed);
        Ok(out)
    }

    /// Evict idle entries (LRU first) until `extra` more bytes and one more entry fit.
    /// Returns whether they fit. Caller holds the write lock; victims are deregistered by the
    /// caller after unlocking.
    fn make_room(
        &self,
        ix: &mut IntervalIndex<Arc<Entry>>,
        extra: u64,
        victims: &mut Vec<Arc<Entry>>,
    ) -> bool {
        let cfg = &self.inner.cfg;
        let fits = |ix: &IntervalIndex<Arc<Entry>>| {
            ix.len() < cfg.max_entries && ix.bytes() + extra <= cfg.max_bytes
        };
        if fits(ix) {
            return true;
        }
        if extra > cfg.max_bytes || cfg.max_entries == 0 {
            return false;
        }
        let now = self.tick(Instant::now());
        let mut cands: Vec<(u64, u64, u64)> = ix
            .iter()
            .filter(|(_, _, _, x)| x.ready().is_some() && x.idle_in_index() && !x.is_dead())
            .map(|(s, _, id, x)| {
                if x.leases.take_touched() {
                    x.idle_since.store(now, Ordering::Relaxed);
                }
                (x.idle_since.load(Ordering::Relaxed), s, id)
            })
            .collect();
        cands.sort_unstable();
        for (_, s, id) in cands {
            if fits(ix) {
                break;
            }
            if let Some(x) = take_if_idle(ix, s, id) {
                inc(&self.inner.shared.c.evictions);
                victims.push(x);
            }
        }
        fits(ix)
    }

    /// Evict up to `max` idle entries (all with `usize::MAX`); with `older_than`, only those
    /// idle since before that cache-clock tick (the idle scanner). Returns how many.
    fn evict_idle(&self, max: usize, older_than: Option<u64>) -> usize {
        let mut victims = Vec::new();
        {
            let mut ix = self.inner.index.write();
            let cand: Vec<(u64, u64)> = ix
                .iter()
                .filter(|(_, _, _, x)| x.ready().is_some() && x.idle_in_index() && !x.is_dead())
                .filter(|(_, _, _, x)| match older_than {
                    None => true,
                    Some(cut) => x.idle_since.load(Ordering::Relaxed) <= cut,
                })
                .map(|(s, _, id, _)| (s, id))
                .take(max)
                .collect();
            for (s, id) in cand {
                victims.extend(take_if_idle(&mut ix, s, id));
            }
        }
        let n = victims.len();
        let c = &self.inner.shared.c;
        let counter = if older_than.is_some() {
            &c.idle_releases
        } else {
            &c.evictions
        };
        counter.fetch_add(n as u64, Ordering::Relaxed);
        retire_all(victims);
        n
    }

    /// Invalidate every entry overlapping `[addr, addr+len)`: they leave the cache at once;
    /// entries in use are deregistered when their last handle drops. Returns how many.
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags, Context};
    /// # let pd = Context::open_default().unwrap().alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let mut v = vec![0u8; 4096];
    /// drop(cache.get_mut(&mut v, AccessFlags::LOCAL_WRITE).unwrap());
    /// assert_eq!(cache.invalidate(v.as_ptr() as u64, 4096), 1);
    /// assert!(cache.is_empty());
    /// ```
    pub fn invalidate(&self, addr: u64, len: u64) -> usize {
        let end = addr.saturating_add(len);
        let dead = {
            let mut ix = self.inner.index.write();
            self.invalidate_locked(&mut ix, &[(addr, end)])
        };
        self.finish_invalidation(dead)
    }

    /// Remove and kill every entry overlapping one of `ranges`. Runs under the write lock so
    /// a lookup never sees a range as "no longer pending" before its entries are dead.
    fn invalidate_locked(
        &self,
        ix: &mut IntervalIndex<Arc<Entry>>,
        ranges: &[(u64, u64)],
    ) -> Vec<Arc<Entry>> {
        let mut dead = Vec::new();
        for &(addr, end) in ranges {
            let ids: Vec<(u64, u64)> = ix
                .overlapping(addr, end, false)
                .map(|(s, _, id, _)| (s, id))
                .collect();
            for (s, id) in ids {
                if let Some(x) = ix.remove(s, id) {
                    // Dead under the lock: a publisher (which checks under the lock) and every
                    // hit (which checks after taking its count) see it.
                    if x.kill() > 0 {
                        inc(&self.inner.shared.c.invalidated_in_use);
                    }
                    dead.push(x);
                }
            }
        }
        dead
    }

    /// Wake waiters; drop the index's references outside the lock (idle entries are
    /// deregistered here, entries in use at their last handle drop).
    fn finish_invalidation(&self, dead: Vec<Arc<Entry>>) -> usize {
        let n = dead.len();
        self.inner
            .shared
            .c
            .invalidations
            .fetch_add(n as u64, Ordering::Relaxed);
        for x in &dead {
            x.wake();
        }
        self.tls_forget(&dead);
        retire_all(dead);
        n
    }

    /// Drop this thread's holds on `dead` entries now, while their memory is warm (other
    /// threads' tables let go when they look the address up again or rebuild).
    fn tls_forget(&self, dead: &[Arc<Entry>]) {
        let id = self.inner.id;
        let gone = TLS.try_with(|t| {
            let mut t = t.borrow_mut();
            let mut gone: Vec<Hold<Entry>> = Vec::new();
            let Some(rec) = t.iter_mut().rev().find(|r| r.cache_id == id) else {
                return gone;
            };
            for e in dead {
                for slot in &mut rec.ring {
                    if slot.as_ref().is_some_and(|h| std::ptr::eq(h.entry(), &**e)) {
                        gone.extend(slot.take());
                    }
                }
                // Small entries: their pages are the likely keys.
                let (first, last) = (page_key(e.start), page_key(e.end - 1));
                if last - first < FORGET_PAGES {
                    for k in first..=last {
                        if rec
                            .map
                            .get(k)
                            .is_some_and(|h| std::ptr::eq(h.entry(), &**e))
                        {
                            gone.extend(rec.map.remove(k));
                        }
                    }
                }
            }
            gone
        });
        // Leases released outside the thread-local borrow.
        drop(gone);
    }

    /// Release entries idle for longer than the configured `idle_timeout` at `now`
    /// (CLOCK-style: an entry used since the previous scan starts a new idle period).
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use mrkit::cache::{CacheConfig, RegCache};
    /// use mrkit::{AccessFlags, Context};
    /// let pd = Context::open_default().unwrap().alloc_pd().unwrap();
    /// let cfg = CacheConfig { idle_timeout: Duration::from_millis(10), ..Default::default() };
    /// let cache = RegCache::new(&pd, cfg).unwrap();
    /// let v = vec![0u8; 4096];
    /// drop(cache.get_ref(&v, AccessFlags::empty()).unwrap());
    /// cache.scan_idle(Instant::now()); // used since the last scan: a new idle period starts
    /// assert_eq!(cache.scan_idle(Instant::now() + Duration::from_secs(1)), 1);
    /// ```
    pub fn scan_idle(&self, now: Instant) -> usize {
        let t = self.tick(now);
        {
            let ix = self.inner.index.read();
            for (_, _, _, x) in ix.iter() {
                if x.leases.take_touched() {
                    x.idle_since.store(t, Ordering::Relaxed);
                }
            }
        }
        let timeout = self.inner.cfg.idle_timeout.as_millis() as u64;
        match t.checked_sub(timeout) {
            Some(cut) => self.evict_idle(usize::MAX, Some(cut)),
            None => 0,
        }
    }

    /// Start a background thread calling [`scan_idle`](Self::scan_idle) every `interval`; it
    /// stops when the returned guard or the cache is dropped.
    ///
    /// ```
    /// use std::time::Duration;
    /// use mrkit::cache::{CacheConfig, RegCache};
    /// let pd = mrkit::Context::open_default().unwrap().alloc_pd().unwrap();
    /// let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let scanner = cache.start_idle_scanner(Duration::from_secs(10));
    /// drop(scanner); // stops and joins the thread
    /// ```
    pub fn start_idle_scanner(&self, interval: Duration) -> IdleScanner {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let weak = Arc::downgrade(&self.inner);
        let th = std::thread::Builder::new()
            .name("mrkit-cache-idle".into())
            .spawn(move || loop {
                match rx.recv_timeout(interval) {
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                    _ => return,
                }
                let Some(inner) = weak.upgrade() else { return };
                RegCache { inner }.scan_idle(Instant::now());
            })
            .expect("spawn idle scanner");
        IdleScanner {
            stop: Some(tx),
            thread: Some(th),
        }
    }

    /// Evict every idle entry now, and detach from the userfaultfd monitor every page range
    /// no cache uses any more (kept attached to make later misses cheap; see the module docs).
    pub fn flush_idle(&self) -> usize {
        let n = self.evict_idle(usize::MAX, None);
        if let Some(m) = self.inner.shared.monitor {
            m.release_idle();
        }
        n
    }

    /// Entries in the index.
    pub fn len(&self) -> usize {
        self.inner.index.read().len()
    }

    /// True when no entry is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `(start, end, access, users)` of every cached entry (debug dump).
    pub fn entries(&self) -> Vec<(u64, u64, AccessFlags, u64)> {
        self.inner
            .index
            .read()
            .iter()
            .map(|(s, e, _, x)| (s, e, x.access, x.users()))
            .collect()
    }

    /// Counters.
    pub fn stats(&self) -> CacheStats {
        let c = &self.inner.shared.c;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let fast: u64 = self.inner.threads.lock().iter().map(|t| l(&t.hits)).sum();
        let ix = self.inner.index.read();
        CacheStats {
            hits: fast + l(&c.hits_slow),
            fast_hits: fast,
            misses: l(&c.misses),
            single_flight_waits: l(&c.single_flight_waits),
            merges: l(&c.merges),
            splits: l(&c.splits),
            evictions: l(&c.evictions),
            idle_releases: l(&c.idle_releases),
            invalidations: l(&c.invalidations),
            invalidated_in_use: l(&c.invalidated_in_use),
            stale_rejects: l(&c.stale_rejects),
            registrations: l(&c.registrations),
            deregistrations: l(&c.deregistrations),
            bytes_registered: l(&c.bytes_registered),
            entries: ix.len() as u64,
            uncached: l(&c.uncached),
            unmonitored: l(&c.unmonitored),
            fallback_evict_retry: l(&c.fallback_evict_retry),
            fallback_shrink: l(&c.fallback_shrink),
            fallback_bounce: l(&c.fallback_bounce),
            monitor_events: l(&self.inner.pending.events),
            pending_overflow_merges: l(&self.inner.pending.overflow_merges),
        }
    }

    /// Whether a userfaultfd monitor feeds this cache.
    pub fn is_monitored(&self) -> bool {
        self.inner.shared.monitor.is_some()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(m) = self.shared.monitor {
            m.unsubscribe(&self.pending);
        }
        // This thread's cache records: their leases hold entry memory (and, through it, the
        // PD). Other threads' records go at their next slow-path lookup or exit (never
        // registrations: those are retired below or at their last handle drop).
        let id = self.id;
        let mine = TLS
            .try_with(|t| {
                let mut t = t.borrow_mut();
                let (mine, rest): (Vec<TlsCache>, Vec<TlsCache>) =
                    t.drain(..).partition(|r| r.cache_id == id);
                *t = rest;
                mine
            })
            .unwrap_or_default();
        drop(mine);
        // Kill every entry; idle ones are retired here (other threads' caches may still hold
        // their memory), in-use ones at their last handle drop.
        let ix = std::mem::take(&mut *self.index.write());
        let all: Vec<Arc<Entry>> = ix.iter().map(|(_, _, _, x)| x.clone()).collect();
        for x in &all {
            x.kill();
        }
        drop(ix);
        retire_all(all);
    }
}

/// Stops the idle scanner thread on drop.
/// (Example at [`RegCache::start_idle_scanner`].)
#[derive(Debug)]
pub struct IdleScanner {
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for IdleScanner {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Bounds of the mapping(s) containing `[a, b)` from `/proc/self/maps` (contiguous VMAs
/// with equal permissions), or `None`.
///
/// ```
/// let b = mrkit::Buffer::new(3 * 4096).unwrap();
/// let (s, e) = mrkit::cache::vma_bounds(b.addr() + 10, b.addr() + 20).unwrap();
/// assert!(s <= b.addr() && b.addr() + 3 * 4096 <= e);
/// ```
///
/// A read of `/proc/self/maps` is not atomic: while another thread maps or unmaps, the
/// kernel can skip a VMA between two `read` chunks. A miss is therefore retried a few
/// times before the caller falls back to the page-rounded shape.
pub fn vma_bounds(a: u64, b: u64) -> Option<(u64, u64)> {
    (0..4).find_map(|_| vma_bounds_once(a, b))
}

fn vma_bounds_once(a: u64, b: u64) -> Option<(u64, u64)> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let mut vmas = maps.lines().filter_map(|l| {
        let mut it = l.split_whitespace();
        let range = it.next()?;
        let perms = it.next()?.to_string();
        let (s, e) = range.split_once('-')?;
        Some((
            u64::from_str_radix(s, 16).ok()?,
            u64::from_str_radix(e, 16).ok()?,
            perms,
        ))
    });
    let (s, mut e, perms) = vmas.by_ref().find(|(s, e, _)| *s <= a && a < *e)?;
    while e < b {
        let (ns, ne, np) = vmas.next()?;
        if ns != e || np != perms {
            return None;
        }
        e = ne;
    }
    Some((s, e))
}

/// `mrkit stat` section `"cache"`: `{"caches": [{"id", "monitored", <CacheStats fields>},
/// ...]}` for every live cache of the process, listed through weak references (the exporter
/// never keeps a cache, or its registrations, alive).
mod export {
    use std::sync::{Arc, Weak};

    use parking_lot::Mutex;
    use serde_json::{json, Value};

    use super::{Inner, RegCache};

    static LIVE: Mutex<Vec<Weak<Inner>>> = Mutex::new(Vec::new());

    pub(super) fn add(c: &Arc<Inner>) {
        {
            let mut l = LIVE.lock();
            l.retain(|w| w.strong_count() > 0);
            l.push(Arc::downgrade(c));
        }
        crate::stat_export::register_source("cache", source);
    }

    fn source() -> Value {
        let live: Vec<RegCache> = LIVE
            .lock()
            .iter()
            .filter_map(Weak::upgrade)
            .map(|inner| RegCache { inner })
            .collect();
        let caches: Vec<Value> = live
            .iter()
            .map(|c| {
                let s = c.stats();
                json!({
                    "id": c.inner.id,
                    "monitored": c.is_monitored(),
                    "hits": s.hits,
                    "fast_hits": s.fast_hits,
                    "misses": s.misses,
                    "single_flight_waits": s.single_flight_waits,
                    "merges": s.merges,
                    "splits": s.splits,
                    "evictions": s.evictions,
                    "idle_releases": s.idle_releases,
                    "invalidations": s.invalidations,
                    "invalidated_in_use": s.invalidated_in_use,
                    "stale_rejects": s.stale_rejects,
                    "registrations": s.registrations,
                    "deregistrations": s.deregistrations,
                    "bytes_registered": s.bytes_registered,
                    "entries": s.entries,
                    "uncached": s.uncached,
                    "unmonitored": s.unmonitored,
                    "fallback_evict_retry": s.fallback_evict_retry,
                    "fallback_shrink": s.fallback_shrink,
                    "fallback_bounce": s.fallback_bounce,
                    "monitor_events": s.monitor_events,
                    "pending_overflow_merges": s.pending_overflow_merges,
                })
            })
            .collect();
        // A cache whose last user let go meanwhile is dropped here, outside the list lock.
        drop(live);
        json!({ "caches": caches })
    }
}

/// Remove entry `id` (starting at `s`) from the index and kill it, if it is still there and
/// still idle (only the index holds it): the eviction step shared by the capacity evictor and
/// the idle scanner.
fn take_if_idle(ix: &mut IntervalIndex<Arc<Entry>>, s: u64, id: u64) -> Option<Arc<Entry>> {
    let idle = ix
        .containing(s, s)
        .find(|(_, _, i, _)| *i == id)
        .is_some_and(|(_, _, _, x)| x.idle_in_index());
    if !idle {
        return None;
    }
    let x = ix.remove(s, id)?;
    x.kill();
    Some(x)
}

#[cfg(test)]
mod tests {
    use super::PageTable;
    use std::collections::HashMap;

    /// The thread table against a `HashMap`: inserts, replacements, backward-shift
    /// removals and rebuilds over colliding keys.
    #[test]
    fn page_table_matches_a_map() {
        let mut t: PageTable<u64> = PageTable::default();
        let mut m: HashMap<u64, u64> = HashMap::new();
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        for step in 0..200_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Few distinct keys (long probe runs, many replacements and removals).
            let key = x % 3000;
            match (x >> 32) % 8 {
                0..=3 => assert_eq!(t.insert(key, step), m.insert(key, step)),
                4..=5 => assert_eq!(t.remove(key), m.remove(&key)),
                6 if step % 512 == 0 => {
                    let mut out = Vec::new();
                    t.retain(|v| v % 2 == 0, &mut out);
                    let before = m.len();
                    m.retain(|_, v| *v % 2 == 0);
                    assert_eq!(out.len(), before - m.len());
                }
                _ => {}
            }
            assert_eq!(t.get(key), m.get(&key));
            assert_eq!(t.len, m.len());
        }
        for (k, v) in &m {
            assert_eq!(t.get(*k), Some(v));
        }
    }
}
