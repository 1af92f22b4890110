//! # MR pool: a few big registrations carved into fixed slots
//!
//! The fix for "one `ibv_reg_mr` per 4 KiB message": register one 64 MiB chunk once and hand
//! out 16384 slots of 4 KiB by offset. [`MrPool`] does that as a service:
//!
//! * **Chunks**: `chunk_size` bytes each (64 MiB default), clamped to the device's
//!   `max_mr_size` so no MR is ever refused or silently truncated. The pool starts with
//!   `initial_chunks` and grows by one chunk at a time, up to `max_chunks`.
//! * **Slots**: `slot_size` bytes; slot `i` lives in chunk `i / slots_per_chunk` at offset
//!   `(i % slots_per_chunk) * slot_size`. A slot carries its address and lkey as plain fields:
//!   getting a key is a load, never a lock.
//! * **Two kinds of slot, one protocol.** A [`Slot`] borrows its pool (cheapest; it cannot
//!   outlive the [`MrPool`] handle it came from). An [`OwnedSlot`] is `'static`: it may outlive
//!   every handle, and the pool's memory stays until the last slot returns. Both implement
//!   [`Registered`](crate::Registered) and [`DeviceWritable`](crate::DeviceWritable), so a work request posted through
//!   [`QueuePair`](crate::QueuePair) takes either by value and its completion hands it back:
//!   the slot cannot be touched, freed or reused while the device may write it, because the
//!   queue pair owns it until then (and destroys its QP before freeing what it still holds).
//! * **Least privilege.** Chunks are registered with local rights only ([`PoolConfig::access`]
//!   defaults to `LOCAL_WRITE`): their rkeys grant a peer nothing. A slot is made reachable
//!   from a peer with [`Slot::expose`], which binds a memory window over exactly that slot with
//!   exactly the rights asked (which [`PoolConfig::remote`] must allow); the window's rkey
//!   stops working when the exposure ends ([`Slot::unexpose`], or when the slot is freed).
//! * **Hot path without shared writes**: each thread keeps a magazine (a small `Vec` of free
//!   indices) per pool; alloc pops and free pushes locally, with no atomic read-modify-write.
//!   Empty and full magazines exchange half their capacity with a lock-free stack in one
//!   compare-and-swap. Only growth takes a mutex. Each thread counts its own allocations and
//!   frees; [`MrPool::stats`] sums them, and the same counts tell when the last owned slot of a
//!   dropped pool returned (no per-slot reference count: freeing on another thread than the
//!   allocating one shares no cache line).
//!
//! ```
//! use mrkit::pool::{MrPool, PoolConfig};
//! use mrkit::Registered;
//! let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());
//! let pd = ctx.alloc_pd().unwrap();
//! let pool = MrPool::new(&pd, PoolConfig { chunk_size: 1 << 20, ..PoolConfig::default() }).unwrap();
//! let mut s = pool.alloc().unwrap();
//! s.as_mut_slice()[0] = 42;
//! assert_eq!(Registered::len(&s), 4096);
//! let sge = s.local(0..64).unwrap(); // what a work request carries
//! assert_eq!((sge.addr, sge.len, sge.lkey), (s.addr(), 64, s.lkey()));
//! // No remote rights unless asked for:
//! assert_eq!(s.remote(0..64).unwrap_err().errno(), mrkit::Errno::EINVAL);
//! drop(s); // back to this thread's magazine
//! assert_eq!(pool.stats().in_use, 0);
//! ```
//!
//! Posting a slot: the queue pair owns it until its completion.
//!
//! ```
//! # use mrkit::{AccessFlags as A, Buffer, QpCap, QueuePair, WcStatus};
//! # use mrkit::pool::{MrPool, PoolConfig};
//! # let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());
//! # let pd = ctx.alloc_pd().unwrap();
//! # let q1 = QueuePair::new(&pd, QpCap::default()).unwrap();
//! # let q2 = QueuePair::new(&pd, QpCap::default()).unwrap();
//! # QueuePair::connect(&q1, &q2, A::REMOTE_WRITE).unwrap();
//! # let dst = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE | A::REMOTE_WRITE).unwrap();
//! let pool = MrPool::new(&pd, PoolConfig { chunk_size: 1 << 20, ..PoolConfig::default() }).unwrap();
//! let mut s = pool.alloc_owned().unwrap();
//! s.as_mut_slice().fill(7);
//! let t = q1.post_write(s, 0..4096, dst.remote(0..4096).unwrap()).unwrap();
//! let c = q1.wait_ticket(t, std::time::Duration::from_secs(10)).unwrap(); // the slot comes back
//! assert_eq!((c.wr_id(), c.status()), (t.wr_id(), WcStatus::Success));
//! assert!(dst.as_slice().iter().all(|&b| b == 7));
//! ```

#[cfg(not(loom))]
mod freelist;
#[cfg(loom)]
#[doc(hidden)]
pub mod freelist;
#[cfg(not(loom))]
pub(crate) mod life;
#[cfg(loom)]
#[doc(hidden)]
pub mod life;
#[allow(unsafe_code)] // an owned slot's pointer to its pool, and the slot bytes
mod ptr;
#[allow(unsafe_code)] // slots reach their pool and their bytes through `ptr`
mod slot;
mod sync;

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use crossbeam_utils::CachePadded;
use parking_lot::Mutex;

use crate::buffer::{Buffer, BufferOptions};
use crate::qp::registered::check_range;
use crate::verbs::{LocalSlice, MemoryRegion, MemoryWindow, ProtectionDomain, RemoteSlice};
use crate::{AccessFlags, BindInfo, Errno, Error, MwType, Result};
use freelist::FreeStack;
use life::{bump, Cell, Life};
use ptr::PoolPtr;
use slot::Core;
pub use slot::{OwnedSlot, Slot};

/// The rights a memory window can grant.
const REMOTE_RIGHTS: AccessFlags = AccessFlags::REMOTE_READ
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_ATOMIC);

/// Pool shape, limits and rights.
///
/// ```
/// use mrkit::pool::PoolConfig;
/// use mrkit::AccessFlags;
/// let cfg = PoolConfig::default();
/// assert_eq!(cfg.access, AccessFlags::LOCAL_WRITE); // least privilege
/// assert!(cfg.remote.is_empty());
/// // A pool whose slots peers may write, one slot at a time:
/// let cfg = PoolConfig { remote: AccessFlags::REMOTE_WRITE, ..PoolConfig::default() };
/// # let _ = cfg;
/// ```
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Bytes per slot (power of two, >= 64).
    pub slot_size: usize,
    /// Bytes per chunk (one MR each); clamped to the device's `max_mr_size` and rounded down
    /// to a power-of-two number of slots.
    pub chunk_size: usize,
    /// Chunks registered at creation.
    pub initial_chunks: usize,
    /// Growth limit in chunks.
    pub max_chunks: usize,
    /// Rights of every chunk MR. Default `LOCAL_WRITE`: the chunk rkeys grant nothing
    /// remotely. Adding `REMOTE_*` here makes a slot's [`Slot::remote`] carry its *chunk's*
    /// rkey, with which a peer can reach every slot of the chunk: for trusted peers only;
    /// prefer [`PoolConfig::remote`].
    pub access: AccessFlags,
    /// Remote rights (`REMOTE_READ`, `REMOTE_WRITE`, `REMOTE_ATOMIC`) a slot may be exposed
    /// with through its own memory window ([`Slot::expose`]). Default empty. When not empty the
    /// chunks are registered with `MW_BIND` (not with these rights). `REMOTE_WRITE` and
    /// `REMOTE_ATOMIC` need `LOCAL_WRITE` in [`PoolConfig::access`].
    pub remote: AccessFlags,
    /// Back chunks with transparent huge pages (2 MiB aligned, `MADV_HUGEPAGE`): 512x fewer
    /// translation entries.
    pub thp: bool,
    /// Per-thread magazine capacity (free slots cached by a thread).
    pub magazine: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            slot_size: 4096,
            chunk_size: 64 << 20,
            initial_chunks: 1,
            max_chunks: 16,
            access: AccessFlags::LOCAL_WRITE,
            remote: AccessFlags::empty(),
            thp: true,
            magazine: 64,
        }
    }
}

/// A snapshot of the pool's counters.
///
/// ```
/// # use mrkit::pool::{MrPool, PoolConfig};
/// # let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());
/// # let pd = ctx.alloc_pd().unwrap();
/// let pool = MrPool::new(&pd, PoolConfig { chunk_size: 1 << 20, ..PoolConfig::default() }).unwrap();
/// let s = pool.alloc().unwrap();
/// let st = pool.stats();
/// assert_eq!((st.total, st.in_use, st.free, st.chunks), (256, 1, 255, 1));
/// # drop(s);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Slots in registered chunks.
    pub total: u64,
    /// Slots free (in magazines or the shared stack).
    pub free: u64,
    /// Slots held by users (borrowed or owned; in the CPU's hands or posted).
    pub in_use: u64,
    /// Chunks registered.
    pub chunks: u64,
    /// Growth events (chunks added after creation).
    pub growth_events: u64,
    /// Allocations refused (pool at `max_chunks` and empty, or growth failed).
    pub alloc_failures: u64,
    /// Slot exposures made ([`Slot::expose`]).
    pub exposures: u64,
}

struct Chunk {
    mr: MemoryRegion,
    base: u64,
    lkey: u32,
    rkey: u32,
}

impl fmt::Debug for Chunk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Chunk")
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.mr.as_slice().len())
            .field("lkey", &self.lkey)
            .finish()
    }
}

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

#[derive(Debug)]
struct PoolInner {
    /// This pool itself (for magazines to hand slots back at thread exit).
    me: Weak<PoolInner>,
    id: u64,
    pd: ProtectionDomain,
    slot_size: u32,
    chunk_size: u64,
    slots_per_chunk: u32,
    /// log2(slots_per_chunk).
    spc_shift: u32,
    access: AccessFlags,
    remote: AccessFlags,
    thp: bool,
    magazine: usize,
    /// The memory windows of exposed slots, by slot index (cold: exposure changes only).
    /// Kept here, not in the slot, so a slot has no drop glue on the free path. Declared
    /// before `chunks` so that windows are unbound before the chunk MRs are deregistered.
    windows: Mutex<HashMap<u32, MemoryWindow>>,
    /// Registered chunks; each cell is set once (under `grow_lock`) before any of its slot
    /// indices is pushed on `free`, so a reader holding an index always finds its chunk.
    chunks: Box<[OnceLock<Chunk>]>,
    /// The chunk count and the statistics, shared with the exporter (see [`PoolCounters`]).
    counters: Arc<PoolCounters>,
    /// Shared free list under the magazines.
    free: FreeStack,
    /// Serialises growth (cold path only).
    grow_lock: Mutex<()>,
    /// Per-thread counts and the release of this pool's memory (see [`life`]).
    life: Arc<Life<Arc<PoolInner>>>,
}

/// What `mrkit stat` reads of a pool, in an `Arc` of its own: the exporter keeps this and the
/// pool's [`Life`], never the pool, so its snapshot can never be what holds the pool's memory
/// last (the memory would then go on the exporter's thread, after the pool's last user let go).
#[derive(Debug, Default)]
struct PoolCounters {
    /// Chunks published. Release store after the chunk cell is set (under `grow_lock`),
    /// acquire load by readers that then look at the chunks.
    nchunks: AtomicUsize,
    /// Cold-path counters (relaxed: statistics only).
    growth_events: AtomicU64,
    alloc_failures: AtomicU64,
    exposures: AtomicU64,
}

impl PoolCounters {
    /// The pool's statistics from its counters and its lifetime counts.
    fn stats(&self, slots_per_chunk: u32, life: &Life<Arc<PoolInner>>) -> PoolStats {
        let chunks = self.nchunks.load(Ordering::Acquire) as u64;
        let total = chunks * u64::from(slots_per_chunk);
        let in_use = life.live().min(total);
        PoolStats {
            total,
            free: total - in_use,
            in_use,
            chunks,
            growth_events: self.growth_events.load(Ordering::Relaxed),
            alloc_failures: self.alloc_failures.load(Ordering::Relaxed),
            exposures: self.exposures.load(Ordering::Relaxed),
        }
    }
}

/// One thread's cache of free slots for one pool.
struct Magazine {
    pool_id: u64,
    pool: Weak<PoolInner>,
    slots: Vec<u32>,
    /// This thread's counts (cache-line padded: two threads' counts never share a line).
    cell: Arc<CachePadded<Cell>>,
    /// Held here so a free can finish its protocol after the pool is gone.
    life: Arc<Life<Arc<PoolInner>>>,
}

impl Drop for Magazine {
    fn drop(&mut self) {
        // Thread exit (or dead-pool cleanup): hand cached slots back to the shared stack, through
        // the keepalive (not an upgrade of `pool`: a reference taken here while the pool is
        // being released would make this thread, at its exit, the one that frees the memory,
        // after the thread that settled has already moved on).
        self.life.with_keep(|p| p.free.push_many(&self.slots));
    }
}

thread_local! {
    static MAGAZINES: RefCell<Vec<Magazine>> = const { RefCell::new(Vec::new()) };
}

/// The last [`MrPool`] handle's drop starts the pool's release.
#[derive(Debug)]
struct Handle {
    inner: Arc<PoolInner>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        // No allocation follows; when no slot is live this hands back the keepalive, dropped
        // here while `self.inner` still holds the pool (the memory goes with `inner` below).
        drop(self.inner.life.close());
    }
}

/// A pool of fixed-size slots carved out of a few large MRs. Cheap to share (`&MrPool` is
/// `Sync`, clones share the pool). Its memory stays registered until the last handle is dropped
/// *and* the last slot is returned.
///
/// ```
/// use mrkit::pool::{MrPool, PoolConfig};
/// let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());
/// let pd = ctx.alloc_pd().unwrap();
/// let pool = MrPool::new(&pd, PoolConfig { chunk_size: 1 << 20, ..PoolConfig::default() }).unwrap();
/// let owned = pool.alloc_owned().unwrap();
/// drop(pool); // the owned slot keeps the pool's memory
/// assert_eq!(owned.as_slice().len(), 4096);
/// ```
#[derive(Debug, Clone)]
pub struct MrPool {
    h: Arc<Handle>,
}

/// `EINVAL` for a configuration no pool can have: a slot size that is not a power of two from
/// 64 to 2^31, remote rights other than READ/WRITE/ATOMIC, or remote writes without
/// `LOCAL_WRITE` on the chunks.
fn check_config(cfg: &PoolConfig) -> Result<()> {
    if !cfg.slot_size.is_power_of_two() || cfg.slot_size < 64 || cfg.slot_size > 1 << 31 {
        return Err(einval(format!(
            "slot_size {} must be a power of two from 64 to 2^31",
            cfg.slot_size
        )));
    }
    if !REMOTE_RIGHTS.contains(cfg.remote) {
        return Err(einval(format!(
            "PoolConfig::remote {:?} may only hold REMOTE_READ, REMOTE_WRITE and REMOTE_ATOMIC",
            cfg.remote
        )));
    }
    if cfg
        .remote
        .intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC)
        && !cfg.access.contains(AccessFlags::LOCAL_WRITE)
    {
        return Err(einval(
            "slots exposed with REMOTE_WRITE or REMOTE_ATOMIC need LOCAL_WRITE in \
             PoolConfig::access (as ibv_bind_mw requires of the MR)"
                .to_string(),
        ));
    }
    Ok(())
}

fn enomem(msg: String) -> Error {
    Error::new(Errno::ENOMEM, msg)
}

fn einval(msg: String) -> Error {
    Error::new(Errno::EINVAL, msg)
}

impl MrPool {
    /// Create a pool and register its initial chunks.
    ///
    /// EINVAL for a slot size that is not a power of two >= 64, a chunk that holds no slot,
    /// more than 2^32 - 1 slots, remote rights in [`PoolConfig::remote`] other than
    /// `REMOTE_READ`/`REMOTE_WRITE`/`REMOTE_ATOMIC`, or write rights there without
    /// `LOCAL_WRITE` in [`PoolConfig::access`]; the errno of `reg_mr` otherwise.
    ///
    /// ```
    /// use mrkit::pool::{MrPool, PoolConfig};
    /// let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());
    /// let pd = ctx.alloc_pd().unwrap();
    /// let pool = MrPool::new(&pd, PoolConfig { chunk_size: 1 << 20, ..PoolConfig::default() }).unwrap();
    /// assert_eq!(pool.chunk_size(), 1 << 20);
    /// let bad = PoolConfig { slot_size: 1000, ..PoolConfig::default() };
    /// assert_eq!(MrPool::new(&pd, bad).unwrap_err().errno(), mrkit::Errno::EINVAL);
    /// ```
    pub fn new(pd: &ProtectionDomain, cfg: PoolConfig) -> Result<MrPool> {
        check_config(&cfg)?;
        let max_mr = pd.context().query_device().max_mr_size;
        let chunk =
            (cfg.chunk_size as u64).min(max_mr) / cfg.slot_size as u64 * cfg.slot_size as u64;
        if chunk == 0 {
            return Err(einval(format!(
                "chunk_size {} (clamped to max_mr_size {max_mr}) holds no slot of {} bytes",
                cfg.chunk_size, cfg.slot_size
            )));
        }
        // Slots per chunk: a power of two, so slot -> (chunk, offset) is a shift and a mask.
        let spc = 1u64 << (63 - (chunk / cfg.slot_size as u64).leading_zeros());
        let chunk = spc * cfg.slot_size as u64;
        let max_chunks = cfg.max_chunks.max(cfg.initial_chunks).max(1);
        let cap = spc
            .checked_mul(max_chunks as u64)
            .filter(|c| *c < u64::from(freelist::NIL))
            .ok_or_else(|| {
                einval("pool would exceed 2^32 - 1 slots; use bigger slots".to_string())
            })?;
        let access = if cfg.remote.is_empty() {
            cfg.access
        } else {
            cfg.access | AccessFlags::MW_BIND
        };
        let inner = Arc::new_cyclic(|me| PoolInner {
            me: me.clone(),
            id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
            pd: pd.clone(),
            slot_size: cfg.slot_size as u32,
            chunk_size: chunk,
            slots_per_chunk: spc as u32,
            spc_shift: spc.trailing_zeros(),
            access,
            remote: cfg.remote,
            thp: cfg.thp,
            magazine: cfg.magazine.max(2),
            windows: Mutex::new(HashMap::new()),
            chunks: (0..max_chunks).map(|_| OnceLock::new()).collect(),
            counters: Arc::default(),
            free: FreeStack::new(cap as u32),
            grow_lock: Mutex::new(()),
            life: Arc::new(Life::new()),
        });
        for _ in 0..cfg.initial_chunks {
            inner.add_chunk()?;
        }
        // The slots' keepalive: released by the life protocol once the last handle is gone
        // and no slot is live (a failed creation above frees the pool right away).
        inner.life.arm(inner.clone());
        export::add(&inner);
        Ok(MrPool {
            h: Arc::new(Handle { inner }),
        })
    }

    fn inner(&self) -> &PoolInner {
        &self.h.inner
    }

    /// Process-unique id of this pool (as in the `"pool"` section of
    /// [`stat_export::snapshot`](crate::stat_export::snapshot)).
    ///
    /// ```
    /// # use mrkit::pool::{MrPool, PoolConfig};
    /// # let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());
    /// # let pd = ctx.alloc_pd().unwrap();
    /// let cfg = PoolConfig { chunk_size: 1 << 20, ..PoolConfig::default() };
    /// let (a, b) = (MrPool::new(&pd, cfg.clone()).unwrap(), MrPool::new(&pd, cfg).unwrap());
    /// assert_ne!(a.id(), b.id());
    /// assert_eq!(a.id(), a.clone().id());
    /// ```
    pub fn id(&self) -> u64 {
        self.inner().id
    }

    /// Bytes per slot.
    ///
    /// ```
    /// # use mrkit::pool::{MrPool, PoolConfig};
    /// # let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());
    /// # let pd = ctx.alloc_pd().unwrap();
    /// let cfg = PoolConfig { slot_size: 256, chunk_size: 1 << 20, ..PoolConfig::default() };
    /// assert_eq!(MrPool::new(&pd, cfg).unwrap().slot_size(), 256);
    /// ```
    pub fn slot_size(&self) -> usize {
        self.inner().slot_size as usize
    }

    /// Bytes per chunk MR (after clamping to `max_mr_size` and rounding down to a power-of-two
    /// number of slots).
    ///
    /// ```
    /// # use mrkit::pool::{MrPool, PoolConfig};
    /// # let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());
    /// # let pd = ctx.alloc_pd().unwrap();
    /// let cfg = PoolConfig { chunk_size: 3 << 20, ..PoolConfig::default() };
    /// assert_eq!(MrPool::new(&pd, cfg).unwrap().chunk_size(), 2 << 20);
    /// ```
    pub fn chunk_size(&self) -> u64 {
        self.inner().chunk_size
    }

    /// `(base address, lkey, rkey)` of every registered chunk. The rkeys grant a peer only
    /// what [`PoolConfig::access`] holds (nothing remote by default).
    ///
    /// ```
    /// # use mrkit::pool::{MrPool, PoolConfig};
    /// # let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());
    /// # let pd = ctx.alloc_pd().unwrap();
    /// let pool = MrPool::new(&pd, PoolConfig { chunk_size: 1 << 20, ..PoolConfig::default() }).unwrap();
    /// let s = pool.alloc().unwrap();
    /// let (base, lkey, _rkey) = pool.chunks()[s.chunk() as usize];
    /// assert_eq!((s.addr(), s.lkey()), (base + s.offset(), lkey));
    /// ```
    pub fn chunks(&self) -> Vec<(u64, u32, u32)> {
        self.inner()
            .chunks
            .iter()
            .filter_map(|c| c.get().map(|c| (c.base, c.lkey, c.rkey)))
            .collect()
    }

    /// Allocate a slot borrowed from this handle (zero-copy buffer for one message). Fast
    /// path: a pop from this thread's magazine. ENOMEM when the pool is at `max_chunks` and
    /// every slot is taken.
    ///
    /// ```
    /// # use mrkit::pool::{MrPool, PoolConfig};
    /// # let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());
    /// # let pd = ctx.alloc_pd().unwrap();
    /// let cfg = PoolConfig { chunk_size: 8192, max_chunks: 1, ..PoolConfig::default() };
    /// let pool = MrPool::new(&pd, cfg).unwrap();
    /// let (a, b) = (pool.alloc().unwrap(), pool.alloc().unwrap());
    /// assert_ne!(a.addr(), b.addr());
    /// assert_eq!(pool.alloc().unwrap_err().errno(), mrkit::Errno::ENOMEM);
    /// ```
    #[inline(always)]
    pub fn alloc(&self) -> Result<Slot<'_>> {
        let inner = self.inner();
        let idx = inner.take()?;
        Ok(Slot {
            pool: inner,
            core: inner.core(idx),
        })
    }

    /// Allocate a slot that may outlive every handle (`'static`: to keep in a long-lived
    /// structure, hand to another thread or post through a `QueuePair` of any lifetime). It
    /// costs what [`MrPool::alloc`] costs: it holds no reference count; the pool's memory is
    /// kept until the last slot returns (see the module docs).
    ///
    /// ```
    /// # use mrkit::pool::{MrPool, PoolConfig};
    /// # let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());
    /// # let pd = ctx.alloc_pd().unwrap();
    /// let pool = MrPool::new(&pd, PoolConfig { chunk_size: 1 << 20, ..PoolConfig::default() }).unwrap();
    /// let mut s = pool.alloc_owned().unwrap();
    /// let t = std::thread::spawn(move || {
    ///     s.as_mut_slice()[0] = 1;
    ///     drop(s); // freed on another thread
    /// });
    /// t.join().unwrap();
    /// assert_eq!(pool.stats().in_use, 0);
    /// ```
    #[inline(always)]
    pub fn alloc_owned(&self) -> Result<OwnedSlot> {
        let inner = self.inner();
        let idx = inner.take()?;
        Ok(OwnedSlot {
            pool: PoolPtr::new(inner),
            core: inner.core(idx),
        })
    }

    /// Counters.
    ///
    /// ```
    /// # use mrkit::pool::{MrPool, PoolConfig};
    /// # let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());
    /// # let pd = ctx.alloc_pd().unwrap();
    /// let pool = MrPool::new(&pd, PoolConfig { chunk_size: 1 << 20, ..PoolConfig::default() }).unwrap();
    /// let held: Vec<_> = (0..3).map(|_| pool.alloc_owned().unwrap()).collect();
    /// assert_eq!(pool.stats().in_use, 3);
    /// drop(held);
    /// assert_eq!(pool.stats().in_use, 0);
    /// ```
    pub fn stats(&self) -> PoolStats {
        self.inner().stats()
    }
}

impl PoolInner {
    #[inline(always)]
    fn magazine_in<'m>(&self, mags: &'m mut Vec<Magazine>) -> &'m mut Magazine {
        // Most recently created magazine first; a thread rarely uses more than a few pools.
        if let Some(pos) = mags.iter().rposition(|m| m.pool_id == self.id) {
            return &mut mags[pos];
        }
        self.new_magazine(mags)
    }

    #[cold]
    fn new_magazine<'m>(&self, mags: &'m mut Vec<Magazine>) -> &'m mut Magazine {
        // Drop magazines of pools that are gone.
        mags.retain(|m| m.pool.strong_count() > 0);
        mags.push(Magazine {
            pool_id: self.id,
            pool: self.me.clone(),
            slots: Vec::with_capacity(self.magazine),
            cell: self.life.register(),
            life: self.life.clone(),
        });
        mags.last_mut().expect("just pushed")
    }

    /// A free slot index, counted as allocated.
    #[inline(always)]
    fn take(&self) -> Result<u32> {
        let got = MAGAZINES.try_with(|m| {
            let mut m = m.borrow_mut();
            let mag = self.magazine_in(&mut m);
            let idx = match mag.slots.pop() {
                Some(i) => Some(i),
                None => self.refill(mag),
            };
            if idx.is_some() {
                bump(&mag.cell.allocs);
            }
            idx
        });
        match got {
            Ok(Some(i)) => Ok(i),
            Ok(None) => Err(self.fail()),
            // Thread-local storage already destroyed (alloc from a TLS destructor): go to
            // the shared stack directly, counted in the shared cell.
            Err(_) => match self.free.pop().or_else(|| self.grow_and_pop()) {
                Some(i) => {
                    self.life.count_alloc_shared();
                    Ok(i)
                }
                None => Err(self.fail()),
            },
        }
    }

    /// A full magazine gives half its slots to the shared stack.
    #[cold]
    #[inline(never)]
    fn spill(&self, mag: &mut Magazine) {
        let half = mag.slots.len() / 2;
        self.free.push_many(&mag.slots[half..]);
        mag.slots.truncate(half);
    }

    #[cold]
    #[inline(never)]
    fn refill(&self, mag: &mut Magazine) -> Option<u32> {
        let n = self.free.pop_many(self.magazine / 2, &mut mag.slots);
        if n > 0 {
            return mag.slots.pop();
        }
        self.grow_and_pop()
    }

    #[cold]
    fn grow_and_pop(&self) -> Option<u32> {
        let _g = self.grow_lock.lock();
        // Someone else may have grown (or freed) while we waited.
        if let Some(i) = self.free.pop() {
            return Some(i);
        }
        match self.add_chunk_locked() {
            Ok(true) => {
                self.counters.growth_events.fetch_add(1, Ordering::Relaxed);
                self.free.pop()
            }
            Ok(false) => None,
            Err(e) => {
                tracing::warn!(error = %e, "MR pool growth failed");
                None
            }
        }
    }

    fn add_chunk(&self) -> Result<bool> {
        let _g = self.grow_lock.lock();
        self.add_chunk_locked()
    }

    /// Register one more chunk; `Ok(false)` at `max_chunks`. Caller holds `grow_lock`.
    fn add_chunk_locked(&self) -> Result<bool> {
        let n = self.counters.nchunks.load(Ordering::Acquire);
        if n >= self.chunks.len() {
            return Ok(false);
        }
        let buf = Buffer::with_options(
            self.chunk_size as usize,
            BufferOptions {
                thp: self.thp,
                populate: false,
                offset: 0,
            },
        )
        .map_err(|e| {
            enomem(format!(
                "cannot map a {} byte pool chunk: {e}",
                self.chunk_size
            ))
        })?;
        let mr = self.pd.register(buf, self.access)?;
        let base = mr.as_slice().as_ptr() as u64;
        let (lkey, rkey) = (mr.lkey(), mr.rkey());
        self.chunks[n]
            .set(Chunk {
                mr,
                base,
                lkey,
                rkey,
            })
            .map_err(|_| enomem("pool chunk published twice".to_string()))?;
        // Release: the chunk is visible before any of its indices can be popped.
        self.counters.nchunks.store(n + 1, Ordering::Release);
        let first = n as u32 * self.slots_per_chunk;
        let idx: Vec<u32> = (first..first + self.slots_per_chunk).rev().collect();
        self.free.push_many(&idx);
        Ok(true)
    }

    #[cold]
    fn fail(&self) -> Error {
        self.counters.alloc_failures.fetch_add(1, Ordering::Relaxed);
        enomem(format!(
            "MR pool exhausted: {} chunks of {} bytes are in use and max_chunks is reached; \
             raise max_chunks or free slots",
            self.counters.nchunks.load(Ordering::Relaxed),
            self.chunk_size
        ))
    }

    #[inline(always)]
    fn chunk_of(&self, idx: u32) -> &Chunk {
        self.chunks[(idx >> self.spc_shift) as usize]
            .get()
            .expect("slot index of an unpublished chunk")
    }

    #[inline(always)]
    fn core(&self, idx: u32) -> Core {
        let k = idx & (self.slots_per_chunk - 1);
        let chunk = self.chunk_of(idx);
        Core {
            idx,
            lkey: chunk.lkey,
            addr: chunk.base + u64::from(k) * u64::from(self.slot_size),
            window: None,
        }
    }

    fn stats(&self) -> PoolStats {
        self.counters.stats(self.slots_per_chunk, &self.life)
    }

    // --- slot operations shared by `Slot` and `OwnedSlot` ---

    fn local(&self, c: &Core, range: Range<u64>) -> Result<LocalSlice> {
        let (start, len) = check_range(&range, u64::from(self.slot_size), "pool slot")?;
        Ok(LocalSlice {
            addr: c.addr + start,
            // A slot is at most 2^31 bytes.
            len: len as u32,
            lkey: c.lkey,
        })
    }

    fn remote(&self, c: &Core, range: Range<u64>) -> Result<RemoteSlice> {
        let (start, len) = check_range(&range, u64::from(self.slot_size), "pool slot")?;
        let rkey = match c.window {
            Some(rkey) => rkey,
            None if self.access.intersects(REMOTE_RIGHTS) => self.chunk_of(c.idx).rkey,
            None => {
                return Err(einval(
                    "the slot has no remote rights: expose it (Slot::expose, with rights \
                     PoolConfig::remote allows) or give the chunks remote rights \
                     (PoolConfig::access, trusted peers only)"
                        .to_string(),
                ))
            }
        };
        Ok(RemoteSlice {
            addr: c.addr + start,
            len,
            rkey,
        })
    }

    /// Bind a fresh window over slot `c` (whose previous exposure, if any, ended).
    #[cold]
    fn expose(&self, c: &mut Core, access: AccessFlags) -> Result<RemoteSlice> {
        self.unexpose(c);
        if access.is_empty() || !REMOTE_RIGHTS.contains(access) {
            return Err(einval(format!(
                "expose takes remote rights (REMOTE_READ, REMOTE_WRITE, REMOTE_ATOMIC), not {access:?}"
            )));
        }
        if !self.remote.contains(access) {
            return Err(einval(format!(
                "this pool allows exposing slots with {:?} (PoolConfig::remote), not {access:?}",
                self.remote
            )));
        }
        // A type-1 window: a type-2 window is bound by a work request on the QP the peer
        // comes through, which the pool does not have. mrkit0 executes the type-1 bind
        // directly for the window's PD (on mlx5 `ibv_bind_mw` posts it on a QP's send queue).
        // A fresh window per exposure: its rkey is the device's next key for the window
        // table, so an ended exposure's rkey is not reused until the table has cycled through
        // every index 256 times.
        let mw = self.pd.alloc_mw(MwType::Type1)?;
        let rkey0 = mw.rkey();
        let rkey = self.pd.context().provider().bind_mw(
            self.pd.handle(),
            0,
            rkey0,
            rkey0 as u8,
            BindInfo {
                mr_lkey: c.lkey,
                addr: c.addr,
                length: u64::from(self.slot_size),
                access,
            },
        )?;
        self.counters.exposures.fetch_add(1, Ordering::Relaxed);
        self.windows.lock().insert(c.idx, mw);
        c.window = Some(rkey);
        Ok(RemoteSlice {
            addr: c.addr,
            len: u64::from(self.slot_size),
            rkey,
        })
    }

    /// End slot `c`'s exposure: its window is deallocated (unbound), its rkey dead.
    #[cold]
    fn unexpose(&self, c: &mut Core) {
        if c.window.take().is_some() {
            let mw = self.windows.lock().remove(&c.idx);
            drop(mw);
        }
    }
}

/// `mrkit stat` section `"pool"`: `{"pools": [{"id", "slot_size", "chunk_size", <PoolStats
/// fields>}, ...]}` for every live pool of the process. Pools are listed through weak
/// references (the exporter never keeps a pool alive); the list is touched only at creation
/// and when a snapshot is taken.
mod export {
    use std::sync::{Arc, Weak};

    use parking_lot::Mutex;
    use serde_json::{json, Value};

    use super::{Life, PoolCounters, PoolInner};

    /// A listed pool: what the snapshot reads, without the pool itself.
    struct Listed {
        pool: Weak<PoolInner>,
        id: u64,
        slot_size: u32,
        chunk_size: u64,
        slots_per_chunk: u32,
        counters: Arc<PoolCounters>,
        life: Arc<Life<Arc<PoolInner>>>,
    }

    static LIVE: Mutex<Vec<Listed>> = Mutex::new(Vec::new());

    pub(super) fn add(p: &Arc<PoolInner>) {
        {
            let mut l = LIVE.lock();
            l.retain(|w| w.pool.strong_count() > 0);
            l.push(Listed {
                pool: Arc::downgrade(p),
                id: p.id,
                slot_size: p.slot_size,
                chunk_size: p.chunk_size,
                slots_per_chunk: p.slots_per_chunk,
                counters: p.counters.clone(),
                life: p.life.clone(),
            });
        }
        crate::stat_export::register_source("pool", source);
    }

    fn source() -> Value {
        // Never an upgrade of a pool: its memory must go on the thread of its last user.
        // Dropping a `Listed` here drops a `Life` only after the pool released its keepalive
        // (a pool holds its `Life` until then).
        let pools: Vec<Value> = LIVE
            .lock()
            .iter()
            .filter(|l| l.pool.strong_count() > 0)
            .map(|l| {
                let s = l.counters.stats(l.slots_per_chunk, &l.life);
                json!({
                    "id": l.id,
                    "slot_size": l.slot_size,
                    "chunk_size": l.chunk_size,
                    "total": s.total,
                    "free": s.free,
                    "in_use": s.in_use,
                    "chunks": s.chunks,
                    "growth_events": s.growth_events,
                    "alloc_failures": s.alloc_failures,
                    "exposures": s.exposures,
                })
            })
            .collect();
        json!({ "pools": pools })
    }
}
