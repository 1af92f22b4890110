//! # MR pool: a few big registrations carved into fixed slots
//!
//! The seed's fix for "one `ibv_reg_mr` per 4 KiB message": register one 64 MiB chunk once and
//! hand out 16384 slots of 4 KiB by offset. [`MrPool`] does that as a service:
//!
//! * **Chunks**: `chunk_size` bytes each (64 MiB default; 1 GiB for big pools), clamped to the
//!   device's `max_mr_size` so no MR is ever refused or silently truncated. The pool starts
//!   with `initial_chunks` and grows by one chunk at a time, up to `max_chunks`.
//! * **Slots**: `slot_size` bytes; slot `i` lives in chunk `i / slots_per_chunk` at offset
//!   `(i % slots_per_chunk) * slot_size`. A [`Slot`] carries its address, lkey and rkey as
//!   plain fields: getting a key is a load, never a lock.
//! * **Hot path without shared locks**: each thread keeps a magazine (a small `Vec` of free
//!   indices) per pool; alloc pops and free pushes locally, with no atomic read-modify-write.
//!   Empty and full magazines exchange half their capacity with a lock-free Treiber stack
//!   ([`freelist::FreeStack`]). Only growth takes a mutex. Statistics are per-thread counters
//!   written by their owner thread alone and summed by [`MrPool::stats`].
//! * **DMA ownership**: [`Slot::post`] moves the slot into an [`InFlight`] token (no CPU access
//!   to its bytes exists any more); only [`InFlight::complete`] with the matching work-request
//!   id gives the [`Slot`] back. Dropping an `InFlight` (lost completion: QP destroyed, error,
//!   cancelled future) sends the slot to **quarantine**, never to the free list; quarantined
//!   slots come back only through [`MrPool::reclaim_quarantined`] with a [`QpDrained`] proof.
//!
//! Remote access caveat: a [`RemoteSlice`] carries the rkey of the whole chunk MR, so a peer
//! holding it could address the whole chunk, not only the slot (bind a memory window over the
//! slot when peers are not trusted).
//!
//! ```
//! use mrkit::pool::{MrPool, PoolConfig};
//! let ctx = mrkit::Context::open_default().unwrap();
//! let pd = ctx.alloc_pd().unwrap();
//! let pool = MrPool::new(&pd, PoolConfig { chunk_size: 1 << 20, ..PoolConfig::default() }).unwrap();
//! let mut s = pool.alloc().unwrap();
//! s.as_mut_slice()[0] = 42;
//! let sge = s.local_all();
//! assert_eq!(sge.len, 4096);
//! let wr = s.post(7); // the slot is now owned by the (would-be) work request
//! let s = wr.complete(7).unwrap(); // the completion returns it
//! assert_eq!(s.as_slice()[0], 42);
//! drop(s); // back to this thread's magazine
//! assert_eq!(pool.stats().in_use, 0);
//! ```

pub mod freelist;
pub mod sync;

use std::cell::RefCell;
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use crossbeam_utils::CachePadded;
use parking_lot::Mutex;

use crate::buffer::{Buffer, BufferOptions};
use crate::verbs::{LocalSlice, MemoryRegion, ProtectionDomain, RemoteSlice};
use crate::{AccessFlags, Errno, Error, Result};
use freelist::FreeStack;

/// Pool shape and limits.
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
    /// Access rights of every chunk MR.
    pub access: AccessFlags,
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
            access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE,
            thp: true,
            magazine: 64,
        }
    }
}

/// A snapshot of the pool's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Slots in registered chunks.
    pub total: u64,
    /// Slots free (in magazines or the shared stack).
    pub free: u64,
    /// Slots held by users: owned by the CPU or posted.
    pub in_use: u64,
    /// Of `in_use`, slots posted to work requests and not completed yet.
    pub in_flight: u64,
    /// Slots in quarantine (lost completions), not reusable until reclaimed.
    pub quarantined: u64,
    /// Chunks registered.
    pub chunks: u64,
    /// Growth events (chunks added after creation).
    pub growth_events: u64,
    /// Allocations refused (pool at `max_chunks` and empty, or growth failed).
    pub alloc_failures: u64,
    /// Slots reclaimed from quarantine.
    pub reclaimed: u64,
}

/// Per-thread counters. Each field is written only by the owner thread (plain load + store,
/// no read-modify-write, no shared cache line on the hot path) and read by `stats()`.
#[derive(Debug, Default)]
struct ThreadCounters {
    /// Slots allocated by this thread.
    allocs: AtomicU64,
    /// Slots freed (returned to the free list) by this thread.
    frees: AtomicU64,
    /// Slots posted by this thread.
    posts: AtomicU64,
    /// Completions (InFlight -> Slot) on this thread.
    completions: AtomicU64,
}

#[inline]
fn bump(c: &AtomicU64) {
    // Single writer: a plain store of load + 1 (no lock prefix).
    c.store(c.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
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
    thp: bool,
    magazine: usize,
    /// Registered chunks; each cell is set once (under `grow_lock`) before any of its slot
    /// indices is pushed on `free`, so a reader holding an index always finds its chunk.
    chunks: Box<[OnceLock<Chunk>]>,
    /// Chunks published (written under `grow_lock`, read by stats).
    nchunks: AtomicUsize,
    /// Shared free list under the magazines.
    free: FreeStack,
    /// Serialises growth (cold path only).
    grow_lock: Mutex<()>,
    /// Quarantined slot indices (cold path: lost completions).
    quarantine: Mutex<Vec<u32>>,
    /// Cold-path counters (growth, failures, quarantine, reclaim): written rarely.
    growth_events: AtomicU64,
    alloc_failures: AtomicU64,
    quarantined_total: AtomicU64,
    reclaimed: AtomicU64,
    /// Every thread's counters (registered once per thread, cold).
    counters: Mutex<Vec<Arc<CachePadded<ThreadCounters>>>>,
}

/// One thread's cache of free slots for one pool.
struct Magazine {
    pool_id: u64,
    pool: Weak<PoolInner>,
    slots: Vec<u32>,
    /// Cache-line padded: two threads' counters never share a line.
    counters: Arc<CachePadded<ThreadCounters>>,
}

impl Drop for Magazine {
    fn drop(&mut self) {
        // Thread exit (or dead-pool cleanup): hand cached slots back to the shared stack.
        if let Some(p) = self.pool.upgrade() {
            p.free.push_many(&self.slots);
        }
    }
}

thread_local! {
    static MAGAZINES: RefCell<Vec<Magazine>> = const { RefCell::new(Vec::new()) };
}

/// A pool of fixed-size slots carved out of a few large MRs. Cheap to share (`&MrPool` is
/// `Sync`); slots borrow the pool, so it outlives them.
#[derive(Debug, Clone)]
pub struct MrPool {
    inner: Arc<PoolInner>,
}

fn enomem(msg: String) -> Error {
    Error::new(Errno::ENOMEM, msg)
}

impl MrPool {
    /// Create a pool and register its initial chunks.
    pub fn new(pd: &ProtectionDomain, cfg: PoolConfig) -> Result<MrPool> {
        if !cfg.slot_size.is_power_of_two() || cfg.slot_size < 64 {
            return Err(Error::new(
                Errno::EINVAL,
                format!("slot_size {} must be a power of two >= 64", cfg.slot_size),
            ));
        }
        let max_mr = pd.context().query_device().max_mr_size;
        let chunk =
            (cfg.chunk_size as u64).min(max_mr) / cfg.slot_size as u64 * cfg.slot_size as u64;
        if chunk == 0 {
            return Err(Error::new(
                Errno::EINVAL,
                format!(
                    "chunk_size {} (clamped to max_mr_size {max_mr}) holds no slot of {} bytes",
                    cfg.chunk_size, cfg.slot_size
                ),
            ));
        }
        // Slots per chunk: a power of two, so slot -> (chunk, offset) is a shift and a mask.
        let spc = 1u64 << (63 - (chunk / cfg.slot_size as u64).leading_zeros());
        let chunk = spc * cfg.slot_size as u64;
        let max_chunks = cfg.max_chunks.max(cfg.initial_chunks).max(1);
        let cap = spc
            .checked_mul(max_chunks as u64)
            .filter(|c| *c < u64::from(freelist::NIL))
            .ok_or_else(|| {
                Error::new(
                    Errno::EINVAL,
                    "pool would exceed 2^32 - 1 slots; use bigger slots".to_string(),
                )
            })?;
        let inner = Arc::new_cyclic(|me| PoolInner {
            me: me.clone(),
            id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
            pd: pd.clone(),
            slot_size: cfg.slot_size as u32,
            chunk_size: chunk,
            slots_per_chunk: spc as u32,
            spc_shift: spc.trailing_zeros(),
            access: cfg.access,
            thp: cfg.thp,
            magazine: cfg.magazine.max(2),
            chunks: (0..max_chunks).map(|_| OnceLock::new()).collect(),
            nchunks: AtomicUsize::new(0),
            free: FreeStack::new(cap as u32),
            grow_lock: Mutex::new(()),
            quarantine: Mutex::new(Vec::new()),
            growth_events: AtomicU64::new(0),
            alloc_failures: AtomicU64::new(0),
            quarantined_total: AtomicU64::new(0),
            reclaimed: AtomicU64::new(0),
            counters: Mutex::new(Vec::new()),
        });
        for _ in 0..cfg.initial_chunks {
            inner.add_chunk()?;
        }
        export::add(&inner);
        Ok(MrPool { inner })
    }

    /// Process-unique id of this pool (as in the `"pool"` section of
    /// [`stat_export::snapshot`](crate::stat_export::snapshot)).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// Bytes per slot.
    pub fn slot_size(&self) -> usize {
        self.inner.slot_size as usize
    }

    /// Bytes per chunk MR (after clamping).
    pub fn chunk_size(&self) -> u64 {
        self.inner.chunk_size
    }

    /// `(base address, lkey, rkey)` of every registered chunk.
    pub fn chunks(&self) -> Vec<(u64, u32, u32)> {
        self.inner
            .chunks
            .iter()
            .filter_map(|c| c.get().map(|c| (c.base, c.lkey, c.rkey)))
            .collect()
    }

    /// Allocate a slot (zero-copy buffer for one message). Fast path: a pop from this thread's
    /// magazine. ENOMEM when the pool is at `max_chunks` and every slot is taken.
    #[inline(always)]
    pub fn alloc(&self) -> Result<Slot<'_>> {
        let inner = &*self.inner;
        let got = MAGAZINES.try_with(|m| {
            let mut m = m.borrow_mut();
            let mag = inner.magazine_in(&mut m);
            let idx = match mag.slots.pop() {
                Some(i) => Some(i),
                None => inner.refill(mag),
            };
            if idx.is_some() {
                bump(&mag.counters.allocs);
            }
            idx
        });
        let idx = match got {
            Ok(Some(i)) => i,
            Ok(None) => return Err(inner.fail()),
            // Thread-local storage already destroyed (alloc from a TLS destructor): go to
            // the shared stack directly, uncounted per thread.
            Err(_) => match inner.free.pop().or_else(|| inner.grow_and_pop()) {
                Some(i) => i,
                None => return Err(inner.fail()),
            },
        };
        Ok(inner.slot(idx))
    }

    /// Allocate a slot that owns a handle to the pool (`'static`, e.g. to keep in a
    /// long-lived structure or a bounce buffer). Costs one reference-count increment more.
    pub fn alloc_owned(&self) -> Result<OwnedSlot> {
        let s = self.alloc()?;
        let o = OwnedSlot {
            pool: self.clone(),
            idx: s.idx,
            addr: s.addr,
            lkey: s.lkey,
            rkey: s.rkey,
        };
        std::mem::forget(s);
        Ok(o)
    }

    /// Quarantine an in-flight slot whose completion will never come (same as dropping it).
    pub fn quarantine(&self, wr: InFlight<'_>) {
        drop(wr);
    }

    /// Return quarantined slots to the free list; returns how many.
    pub fn reclaim_quarantined(&self, _proof: QpDrained) -> usize {
        let v = std::mem::take(&mut *self.inner.quarantine.lock());
        self.inner.free.push_many(&v);
        self.inner
            .reclaimed
            .fetch_add(v.len() as u64, Ordering::Relaxed);
        v.len()
    }

    /// Counters.
    pub fn stats(&self) -> PoolStats {
        self.inner.stats()
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
        let counters = Arc::new(CachePadded::new(ThreadCounters::default()));
        self.counters.lock().push(counters.clone());
        let me = self.self_weak();
        mags.push(Magazine {
            pool_id: self.id,
            pool: me,
            slots: Vec::with_capacity(self.magazine),
            counters,
        });
        mags.last_mut().expect("just pushed")
    }

    fn self_weak(&self) -> Weak<PoolInner> {
        self.me.clone()
    }

    #[cold]
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
                self.growth_events.fetch_add(1, Ordering::Relaxed);
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
        let n = self.nchunks.load(Ordering::Acquire);
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
        self.nchunks.store(n + 1, Ordering::Release);
        let first = n as u32 * self.slots_per_chunk;
        let idx: Vec<u32> = (first..first + self.slots_per_chunk).rev().collect();
        self.free.push_many(&idx);
        Ok(true)
    }

    #[cold]
    fn fail(&self) -> Error {
        self.alloc_failures.fetch_add(1, Ordering::Relaxed);
        enomem(format!(
            "MR pool exhausted: {} chunks of {} bytes are in use and max_chunks is reached; \
             raise max_chunks, free slots, or reclaim quarantined slots",
            self.nchunks.load(Ordering::Relaxed),
            self.chunk_size
        ))
    }

    #[inline(always)]
    fn slot(&self, idx: u32) -> Slot<'_> {
        let (c, k) = (idx >> self.spc_shift, idx & (self.slots_per_chunk - 1));
        let chunk = self.chunks[c as usize]
            .get()
            .expect("slot index of an unpublished chunk");
        Slot {
            pool: self,
            idx,
            addr: chunk.base + u64::from(k) * u64::from(self.slot_size),
            lkey: chunk.lkey,
            rkey: chunk.rkey,
        }
    }

    #[inline(always)]
    fn release(&self, idx: u32) {
        let done = MAGAZINES.try_with(|m| {
            let mut m = m.borrow_mut();
            let mag = self.magazine_in(&mut m);
            if mag.slots.len() >= self.magazine {
                let half = mag.slots.len() / 2;
                self.free.push_many(&mag.slots[half..]);
                mag.slots.truncate(half);
            }
            mag.slots.push(idx);
            bump(&mag.counters.frees);
        });
        if done.is_err() {
            self.free.push(idx);
        }
    }

    fn count(&self, f: impl Fn(&ThreadCounters) -> &AtomicU64) -> u64 {
        self.counters
            .lock()
            .iter()
            .map(|c| f(c).load(Ordering::Relaxed))
            .sum()
    }

    fn stats(&self) -> PoolStats {
        let chunks = self.nchunks.load(Ordering::Acquire) as u64;
        let total = chunks * u64::from(self.slots_per_chunk);
        let allocs = self.count(|c| &c.allocs);
        let frees = self.count(|c| &c.frees);
        let posts = self.count(|c| &c.posts);
        let completions = self.count(|c| &c.completions);
        let qt = self.quarantined_total.load(Ordering::Relaxed);
        let reclaimed = self.reclaimed.load(Ordering::Relaxed);
        let in_use = allocs.saturating_sub(frees).saturating_sub(qt);
        let quarantined = qt.saturating_sub(reclaimed);
        PoolStats {
            total,
            free: total.saturating_sub(in_use).saturating_sub(quarantined),
            in_use,
            in_flight: posts.saturating_sub(completions).saturating_sub(qt),
            quarantined,
            chunks,
            growth_events: self.growth_events.load(Ordering::Relaxed),
            alloc_failures: self.alloc_failures.load(Ordering::Relaxed),
            reclaimed,
        }
    }

    fn counters_here(&self, f: impl FnOnce(&ThreadCounters)) {
        let _ = MAGAZINES.try_with(|m| {
            let mut m = m.borrow_mut();
            f(&self.magazine_in(&mut m).counters);
        });
    }
}

/// Proof that no work request referencing quarantined slots can still complete (their QP was
/// destroyed, or moved to error and its queues fully flushed). The data path hands one out
/// when it observes that; otherwise the caller asserts it.
#[derive(Debug)]
pub struct QpDrained(());

impl QpDrained {
    /// Assert that every QP that had quarantined slots posted is destroyed or flushed.
    ///
    /// # Safety
    /// If a work request that used a quarantined slot can still execute, reclaiming lets the
    /// device write into a slot that was handed to someone else (the late-DMA corruption
    /// quarantine exists to prevent).
    pub unsafe fn assert_no_pending_work() -> QpDrained {
        QpDrained(())
    }
}

/// A slot owned by the CPU: read and write its bytes, build SGEs, or post it.
/// Dropping it returns it to the pool.
#[derive(Debug)]
pub struct Slot<'p> {
    pool: &'p PoolInner,
    idx: u32,
    addr: u64,
    lkey: u32,
    rkey: u32,
}

impl<'p> Slot<'p> {
    /// Slot index in the pool.
    pub fn index(&self) -> u32 {
        self.idx
    }
    /// Address of the first byte (also the iova: chunks are registered with iova = address).
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Bytes in the slot.
    pub fn len(&self) -> usize {
        self.pool.slot_size as usize
    }
    /// Never true (slots are at least 64 bytes).
    pub fn is_empty(&self) -> bool {
        false
    }
    /// lkey of the chunk MR.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }
    /// rkey of the chunk MR.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }
    /// Chunk number.
    pub fn chunk(&self) -> u32 {
        self.idx / self.pool.slots_per_chunk
    }
    /// Offset of the slot inside its chunk MR.
    pub fn offset(&self) -> u64 {
        u64::from(self.idx % self.pool.slots_per_chunk) * u64::from(self.pool.slot_size)
    }
    /// SGE over `range` (offsets within the slot). Panics when the range leaves the slot.
    pub fn local(&self, range: Range<u32>) -> LocalSlice {
        assert!(
            range.start <= range.end && range.end <= self.pool.slot_size,
            "range outside slot"
        );
        LocalSlice {
            addr: self.addr + u64::from(range.start),
            len: range.end - range.start,
            lkey: self.lkey,
        }
    }
    /// SGE over the whole slot.
    pub fn local_all(&self) -> LocalSlice {
        self.local(0..self.pool.slot_size)
    }
    /// Remote descriptor over `range` (offsets within the slot).
    pub fn remote(&self, range: Range<u32>) -> RemoteSlice {
        let l = self.local(range);
        RemoteSlice {
            addr: l.addr,
            len: u64::from(l.len),
            rkey: self.rkey,
        }
    }
    /// The slot's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: [addr, addr + slot_size) lies inside a chunk mapping owned by the pool, which
        // outlives `'p`; the slot index is owned exclusively by this value (it is on no free
        // list and no other Slot/InFlight has it), so no `&mut` alias exists.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len()) }
    }
    /// The slot's bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len()) }
    }
    /// Hand the slot to a work request with id `wr_id`: the CPU loses access until the
    /// completion returns it.
    pub fn post(self, wr_id: u64) -> InFlight<'p> {
        let wr = InFlight {
            pool: self.pool,
            idx: self.idx,
            addr: self.addr,
            lkey: self.lkey,
            rkey: self.rkey,
            wr_id,
        };
        self.pool.counters_here(|c| bump(&c.posts));
        std::mem::forget(self);
        wr
    }
}

impl Drop for Slot<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        self.pool.release(self.idx);
    }
}

/// A slot owned by an outstanding work request. It gives no access to the bytes. Only
/// [`complete`](Self::complete) returns the [`Slot`]; dropping it quarantines the slot.
#[derive(Debug)]
#[must_use = "dropping an in-flight slot quarantines it; complete it with its work completion"]
pub struct InFlight<'p> {
    pool: &'p PoolInner,
    idx: u32,
    addr: u64,
    lkey: u32,
    rkey: u32,
    wr_id: u64,
}

impl<'p> InFlight<'p> {
    /// Work-request id this slot was posted with.
    pub fn wr_id(&self) -> u64 {
        self.wr_id
    }
    /// Slot index.
    pub fn index(&self) -> u32 {
        self.idx
    }
    /// SGE over the whole slot (to build the work request).
    pub fn local_all(&self) -> LocalSlice {
        LocalSlice {
            addr: self.addr,
            len: self.pool.slot_size,
            lkey: self.lkey,
        }
    }
    /// Remote descriptor over the whole slot.
    pub fn remote_all(&self) -> RemoteSlice {
        RemoteSlice {
            addr: self.addr,
            len: u64::from(self.pool.slot_size),
            rkey: self.rkey,
        }
    }
    /// The completion of work request `wr_id` arrived: get the slot back. A mismatched id is
    /// refused (the token is returned in `Err`).
    pub fn complete(self, wr_id: u64) -> std::result::Result<Slot<'p>, InFlight<'p>> {
        if wr_id != self.wr_id {
            return Err(self);
        }
        let s = Slot {
            pool: self.pool,
            idx: self.idx,
            addr: self.addr,
            lkey: self.lkey,
            rkey: self.rkey,
        };
        self.pool.counters_here(|c| bump(&c.completions));
        std::mem::forget(self);
        Ok(s)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        // Lost completion: never reuse; the device may still write this slot.
        self.pool.quarantine.lock().push(self.idx);
        self.pool.quarantined_total.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(slot = self.idx, wr_id = self.wr_id, "pool slot quarantined");
    }
}

/// A slot holding its pool alive (see [`MrPool::alloc_owned`]). Dropping it frees the slot.
#[derive(Debug)]
pub struct OwnedSlot {
    pool: MrPool,
    idx: u32,
    addr: u64,
    lkey: u32,
    rkey: u32,
}

impl OwnedSlot {
    /// Address (= iova) of the first byte.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Bytes in the slot.
    pub fn len(&self) -> usize {
        self.pool.inner.slot_size as usize
    }
    /// Never true.
    pub fn is_empty(&self) -> bool {
        false
    }
    /// lkey.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }
    /// rkey.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }
    /// SGE over the first `len` bytes.
    pub fn local(&self, len: u32) -> LocalSlice {
        assert!(len <= self.pool.inner.slot_size, "range outside slot");
        LocalSlice {
            addr: self.addr,
            len,
            lkey: self.lkey,
        }
    }
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the slot lies in a chunk mapping kept alive by `self.pool`; the index is owned
        // exclusively by this value.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len()) }
    }
    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len()) }
    }
}

impl Drop for OwnedSlot {
    fn drop(&mut self) {
        self.pool.inner.release(self.idx);
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

    use super::PoolInner;

    static LIVE: Mutex<Vec<Weak<PoolInner>>> = Mutex::new(Vec::new());

    pub(super) fn add(p: &Arc<PoolInner>) {
        {
            let mut l = LIVE.lock();
            l.retain(|w| w.strong_count() > 0);
            l.push(Arc::downgrade(p));
        }
        crate::stat_export::register_source("pool", source);
    }

    fn source() -> Value {
        let live: Vec<Arc<PoolInner>> = LIVE.lock().iter().filter_map(Weak::upgrade).collect();
        let pools: Vec<Value> = live
            .iter()
            .map(|p| {
                let s = p.stats();
                json!({
                    "id": p.id,
                    "slot_size": p.slot_size,
                    "chunk_size": p.chunk_size,
                    "total": s.total,
                    "free": s.free,
                    "in_use": s.in_use,
                    "in_flight": s.in_flight,
                    "quarantined": s.quarantined,
                    "chunks": s.chunks,
                    "growth_events": s.growth_events,
                    "alloc_failures": s.alloc_failures,
                    "reclaimed": s.reclaimed,
                })
            })
            .collect();
        // A pool whose last user let go meanwhile is freed here, outside the list lock.
        drop(live);
        json!({ "pools": pools })
    }
}
