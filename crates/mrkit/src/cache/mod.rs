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
//! | [`RegCache::get_owned`] | `&Arc<M>`, `M:` [`OwnedMemory`](mrkit_soft::OwnedMemory) (e.g. [`Buffer`](crate::Buffer), `Vec<u8>`) | any | the handle lives; **with remote rights the entry co-owns `M`** until it is deregistered |
//! | [`RegCache::get_ref`] | `&'a [u8]` | local, device reads | `'a` (the handle borrows) |
//! | [`RegCache::get_mut`] | `&'a mut [u8]` | local, device may write | `'a` (the handle borrows exclusively) |
//! | `unsafe` [`RegCache::get_raw`] | an address | any | the caller promises (see its `# Safety`) |
//!
//! * **What a handle guarantees**: while it lives, its keys stay registered and translate to
//!   the pages mapped at the time of the lookup (never to an earlier mapping at the same
//!   address), even if the range is invalidated meanwhile (it is then deregistered at the
//!   last drop). Every handle implements [`Registered`](crate::Registered) (and [`DeviceWritable`](crate::DeviceWritable) where the
//!   device may write: owned, `&mut`-borrowed, raw), so a work request can carry it; its
//!   [`Registered::sges`](crate::Registered::sges) cover its own bytes only, one SGE per MR they span.
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
//!   per cache, a table of its own *leases* (module `lease`, `lease::table`): an
//!   open-addressing table keyed by the 4 KiB page of the request address whose slots are
//!   the 64-byte leases themselves, plus a ring of the last 4 entries matched by range
//!   (lookups anywhere in a large entry). A hit finds the lease by the page's tag, checks
//!   range and rights in the same line, and counts its handle with a plain load and store of the lease's owner-only
//!   count (no locked instruction); a handle dropped on the same thread does the same, one
//!   dropped on another thread takes a read-modify-write path. The lease's line belongs to
//!   the thread: a hit takes **no lock and writes no shared cache line**, so threads hitting
//!   the same entries never bounce a line. With the userfaultfd monitor, the table is valid only
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
//!   flag in every lease under the entry's lease-list mutex, then (once for every entry of
//!   an invalidation) runs `membarrier` when a lease belongs to another live thread, and
//!   counts; a hit counts itself, then reads the flag with only a compiler fence between
//!   (the membarrier supplies the hardware barrier), so either the kill counts a hit's
//!   handle or the hit sees the flag and backs out (an asymmetric Dekker pair, as the pool's
//!   lifetime; `fence(SeqCst)` on both sides where membarrier is unavailable; see the
//!   `lease` module). The MR is
//!   deregistered exactly once, and never while a handle exists; an entry invalidated while
//!   in use leaves the index at once and is retired by its last handle. Thread tables keep
//!   an entry's memory (not its registration) until the slot is replaced, the table is
//!   emptied when full, or the thread exits. Model-checked on the lease code itself in
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
//!   opt-in bounce path through an [`MrPool`](crate::pool::MrPool) ([`RegCache::get_or_bounce_raw`]). Each counted.
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

mod bounce;
mod config;
#[allow(unsafe_code)] // the hit's one dereference of the thread's current table
mod current;
mod entry;
mod evict;
#[allow(unsafe_code)] // one LFENCE (`floor::serialize`, the bench's isolated lookups)
mod floor;
mod gate;
mod get;
mod handle;
mod index;
mod invalidate;
#[allow(unsafe_code)] // the lease core: raw pointers to entry memory
mod lease;
mod miss;
#[allow(unsafe_code)] // userfaultfd syscalls and ioctls
mod monitor;
#[allow(unsafe_code)] // the cache's unsafe entry points, its pinning call, its `Registered` impls
mod raw;
mod shape;
mod stats;
mod sync;
mod tls;

pub use bounce::{BounceBuffer, Registration};
pub use config::{CacheConfig, ExplicitInvalidation, MonitorMode, Shape};
pub use entry::Piece;
pub use evict::IdleScanner;
pub use handle::{RegHandle, RegMut, RegOwned, RegRef};
pub use shape::vma_bounds;
pub use stats::CacheStats;

/// Not API: the cache's internals, reachable for this crate's own tests only (the loom model
/// checks the real lease code; the monitor tests count its attachments) and for `mrkit bench`
/// (the memory floor under a hit). No stability promise.
#[doc(hidden)]
pub mod test_support {
    pub use crate::cache::floor::{serialize, HitFloor};

    use std::hint::black_box;

    use super::{CacheConfig, RegCache};
    use crate::{AccessFlags, Buffer, Context};

    /// A cache on the default device's new PD with room for `n` 4 KiB buffers of one new
    /// mapping, all cached, and the calling thread's table warm: every buffer looked up once
    /// (a miss each), then twice as many lookups in random order; beside it the memory floor
    /// of the same buffers ([`HitFloor`]). The setup and the two timed lookups of the
    /// memory-bound hit examples (`hit_memory_bound`, `hit_cold`).
    ///
    /// ```
    /// let w = mrkit::cache::test_support::WarmCache::new(8).unwrap();
    /// assert_eq!((w.cache.stats().entries, w.len()), (8, 8));
    /// w.hit(5);
    /// w.floor_hit(5);
    /// ```
    pub struct WarmCache {
        /// The cache, every buffer in it.
        pub cache: RegCache,
        mem: Buffer,
        floor: HitFloor,
    }

    impl WarmCache {
        /// `n` buffers cached and looked up (see the type).
        pub fn new(n: usize) -> Result<WarmCache, Box<dyn std::error::Error>> {
            let pd = Context::open_default()?.alloc_pd()?;
            let cache = RegCache::new(
                &pd,
                CacheConfig {
                    max_entries: n,
                    max_bytes: u64::MAX,
                    ..CacheConfig::default()
                },
            )?;
            let mem = Buffer::new(n * 4096)?;
            let all = mem.as_slice();
            for i in (0..n as u32).chain(random_order(n, 2 * n, 7)) {
                drop(cache.get_ref(&all[i as usize * 4096..][..4096], AccessFlags::empty())?);
            }
            let floor = HitFloor::new(all.as_ptr() as u64, n);
            Ok(WarmCache { cache, mem, floor })
        }

        /// Buffers.
        pub fn len(&self) -> usize {
            self.mem.len() / 4096
        }

        /// Whether there are none.
        pub fn is_empty(&self) -> bool {
            self.len() == 0
        }

        /// Buffer `i` (panics past the last).
        #[inline(always)]
        pub fn page(&self, i: u32) -> &[u8] {
            &self.mem.as_slice()[i as usize * 4096..][..4096]
        }

        /// The cache's lookup of buffer `i`, the handle kept by reference, then dropped.
        #[inline(always)]
        pub fn hit(&self, i: u32) {
            let h = self
                .cache
                .get_ref(self.page(black_box(i)), AccessFlags::empty())
                .expect("cache get");
            black_box(&h);
        }

        /// The floor's accesses for buffer `i` in the loop the cache's lookups run in: the
        /// same slice, and a value of a handle's size kept by reference.
        #[inline(always)]
        pub fn floor_hit(&self, i: u32) {
            let mem = self.page(black_box(i));
            let hit = self.floor.hit(mem.as_ptr() as u64, mem.len() as u64);
            black_box(&(hit, mem));
        }
    }

    /// The first command-line argument as a number of buffers, `default` without one.
    pub fn buffers_arg(default: usize) -> Result<usize, Box<dyn std::error::Error>> {
        Ok(match std::env::args().nth(1) {
            Some(a) => a.parse()?,
            None => default,
        })
    }

    /// The median of `v` (the upper one of an even count; NaN-safe order).
    ///
    /// ```
    /// assert_eq!(mrkit::cache::test_support::median(vec![3.0, 1.0, 2.0]), 2.0);
    /// ```
    pub fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }

    /// `len` indices below `n` in a reproducible random order (xorshift64 from `seed`): the
    /// lookups of `mrkit bench pool-cache` (whose UCX program draws the same sequence), the
    /// memory-bound example and the hit-path tests.
    ///
    /// ```
    /// use mrkit::cache::test_support::random_order;
    /// let o = random_order(64, 1000, 7);
    /// assert!(o.iter().all(|&i| i < 64));
    /// assert_eq!(o, random_order(64, 1000, 7));
    /// ```
    pub fn random_order(n: usize, len: usize, mut seed: u64) -> Vec<u32> {
        (0..len)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed % n as u64) as u32
            })
            .collect()
    }

    /// Whether this process has the asymmetric barrier of the lease protocol
    /// (`membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`, decided at the first cache or pool):
    /// with it a hit and a same-thread handle drop have no fence; without it (old kernels,
    /// seccomp sandboxes) the hit has a full fence and every drop a read-modify-write.
    ///
    /// ```
    /// let pd = mrkit::Context::open_default().unwrap().alloc_pd().unwrap();
    /// let cache = mrkit::cache::RegCache::new(&pd, Default::default()).unwrap();
    /// let _either = mrkit::cache::test_support::asymmetric_barrier();
    /// ```
    pub fn asymmetric_barrier() -> bool {
        crate::cache::lease::asymmetric().is_some()
    }

    /// The lease core (see the `lease` module of the cache).
    pub mod lease {
        pub use crate::cache::lease::table::LeaseTable;
        pub use crate::cache::lease::{lease, Handle, Hold, LeaseSet, Retire};
    }
    /// The userfaultfd monitor's counters (see the `monitor` module of the cache).
    pub mod monitor {
        pub use crate::cache::monitor::IDLE_CAP;

        /// `UFFDIO_REGISTER` calls the process-wide monitor made so far (`None` when
        /// userfaultfd is unavailable).
        ///
        /// ```
        /// use mrkit::cache::{test_support::monitor, CacheConfig, RegCache};
        /// use mrkit::{AccessFlags, Buffer, Context, DeviceConfig};
        /// let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
        /// let cache = RegCache::new(&pd, CacheConfig::default()).unwrap(); // starts the monitor
        /// let before = monitor::registrations().unwrap();
        /// let buf = Buffer::new(4096).unwrap();
        /// drop(cache.get_ref(buf.as_slice(), AccessFlags::empty()).unwrap()); // attaches `buf`
        /// assert!(monitor::registrations().unwrap() > before);
        /// ```
        pub fn registrations() -> Option<u64> {
            crate::cache::monitor::global()
                .ok()
                .map(|m| m.registrations())
        }

        /// Attachments the monitor made so far that bridged a gap to a neighbouring attached
        /// range (`None` when userfaultfd is unavailable).
        ///
        /// ```
        /// # use mrkit::cache::test_support::monitor;
        /// # let _ = mrkit::cache::RegCache::new(
        /// #     &mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap(),
        /// #     Default::default(),
        /// # ).unwrap();
        /// assert!(monitor::bridges().is_some());
        /// ```
        pub fn bridges() -> Option<u64> {
            crate::cache::monitor::global().ok().map(|m| m.bridges())
        }

        /// Events (unmap, remove, remap) the monitor has read so far (`None` when userfaultfd
        /// is unavailable).
        ///
        /// ```
        /// use std::time::{Duration, Instant};
        /// use mrkit::cache::{test_support::monitor, CacheConfig, RegCache};
        /// use mrkit::{AccessFlags, Buffer, Context, DeviceConfig};
        /// let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
        /// let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
        /// let buf = Buffer::new(4096).unwrap();
        /// drop(cache.get_ref(buf.as_slice(), AccessFlags::empty()).unwrap());
        /// let before = monitor::events().unwrap();
        /// drop(buf); // munmap: an UNMAP event
        /// let end = Instant::now() + Duration::from_secs(10);
        /// while monitor::events().unwrap() == before && Instant::now() < end {
        ///     std::thread::sleep(Duration::from_millis(1));
        /// }
        /// assert!(monitor::events().unwrap() > before);
        /// ```
        pub fn events() -> Option<u64> {
            crate::cache::monitor::global().ok().map(|m| m.events())
        }
    }
}

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Mutex, RwLock};

use crate::verbs::ProtectionDomain;
use crate::{AccessFlags, Errno, Error, Result};
use entry::{retire_all, Entry};
use index::IntervalIndex;
use monitor::{Monitor, Pending};
use stats::Counters;
use tls::{ThreadStats, TlsCache};

/// State entries need after the cache is gone (deregistration).
#[derive(Debug)]
struct Shared {
    pd: ProtectionDomain,
    monitor: Option<&'static Arc<Monitor>>,
    c: Counters,
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
    /// Orders the idle scanner and the statistics exporter with the last user's drop.
    gate: Arc<gate::Gate>,
    /// Entries evicted by misses whose kill waits for a heavy barrier (a lease of another live
    /// thread): fenced and retired together ([`RegCache::retire_victims`]).
    unfenced: Mutex<Vec<Arc<Entry>>>,
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
    /// The users' share (`None` in a background pass's view, see [`gate`]). Declared first:
    /// the last user closes the gate before it lets go of `inner`.
    #[allow(dead_code)] // held for its drop
    user: Option<Arc<gate::User>>,
    inner: Arc<Inner>,
    /// `inner.id`, here too: the hit compares it with the thread's current record without
    /// first loading `inner`.
    id: u64,
}

fn page_span(page: u64, a: u64, b: u64) -> (u64, u64) {
    (a & !(page - 1), (b + page - 1) & !(page - 1))
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
        let gate = Arc::new(gate::Gate::default());
        let id = NEXT_CACHE_ID.fetch_add(1, Ordering::Relaxed);
        let cache = RegCache {
            user: Some(Arc::new(gate::User { gate: gate.clone() })),
            id,
            inner: Arc::new(Inner {
                id,
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
                gate,
                unfenced: Mutex::new(Vec::new()),
            }),
        };
        stats::export::add(&cache.inner);
        Ok(cache)
    }

    /// Process-unique id of this cache (as in the `"cache"` section of
    /// [`stat_export::snapshot`](crate::stat_export::snapshot)).
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let other = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// assert_ne!(cache.id(), other.id());
    /// let snap = mrkit::stat_export::snapshot();
    /// let caches = snap["sources"]["cache"]["caches"].as_array().unwrap();
    /// assert!(caches.iter().any(|c| c["id"] == cache.id()));
    /// ```
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// Entries in the index (registrations the cache keeps, in use or idle).
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let (a, b) = (Buffer::new(4096).unwrap(), Buffer::new(4096).unwrap());
    /// drop(cache.get_ref(a.as_slice(), A::empty()).unwrap());
    /// drop(cache.get_ref(b.as_slice(), A::empty()).unwrap());
    /// drop(cache.get_ref(a.as_slice(), A::empty()).unwrap()); // a hit: no new entry
    /// assert_eq!(cache.len(), 2);
    /// ```
    pub fn len(&self) -> usize {
        self.inner.index.read().len()
    }

    /// True when no entry is cached.
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// assert!(cache.is_empty());
    /// let buf = Buffer::new(4096).unwrap();
    /// drop(cache.get_ref(buf.as_slice(), A::empty()).unwrap());
    /// assert!(!cache.is_empty()); // the entry outlives the handle
    /// cache.invalidate(buf.addr(), 4096);
    /// assert!(cache.is_empty());
    /// ```
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `(start, end, access, users)` of every cached entry (debug dump; `users` counts live
    /// handles).
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let mut buf = Buffer::new(4096).unwrap();
    /// let addr = buf.addr();
    /// let h = cache.get_mut(buf.as_mut_slice(), A::LOCAL_WRITE).unwrap();
    /// assert_eq!(cache.entries(), vec![(addr, addr + 4096, A::LOCAL_WRITE, 1)]);
    /// drop(h);
    /// assert_eq!(cache.entries()[0].3, 0); // idle
    /// ```
    pub fn entries(&self) -> Vec<(u64, u64, AccessFlags, u64)> {
        self.inner
            .index
            .read()
            .iter()
            .map(|(s, e, _, x)| (s, e, x.access, x.users()))
            .collect()
    }

    /// Whether a userfaultfd monitor feeds this cache ([`MonitorMode`]).
    ///
    /// ```
    /// use mrkit::cache::{CacheConfig, MonitorMode, RegCache};
    /// let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// assert!(RegCache::new(&pd, CacheConfig::default()).unwrap().is_monitored());
    /// // SAFETY: this program caches nothing, so it frees no cached memory.
    /// let explicit = CacheConfig { monitor: unsafe { MonitorMode::explicit_only() }, ..Default::default() };
    /// assert!(!RegCache::new(&pd, explicit).unwrap().is_monitored());
    /// ```
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
        let mine = tls::tables_mut(|t| {
            let (mine, rest): (Vec<Box<TlsCache>>, Vec<Box<TlsCache>>) =
                t.drain(..).partition(|r| r.cache_id == id);
            *t = rest;
            mine
        })
        .unwrap_or_default();
        drop(mine);
        // Kill every entry; idle ones are retired here (other threads' caches may still hold
        // their memory), in-use ones at their last handle drop.
        let ix = std::mem::take(&mut *self.index.write());
        let mut all: Vec<Arc<Entry>> = ix.iter().map(|(_, _, _, x)| x.clone()).collect();
        for x in &all {
            x.kill();
        }
        drop(ix);
        all.append(&mut self.unfenced.lock());
        retire_all(all);
    }
}
