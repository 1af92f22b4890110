//! When a pool's memory may go: after its last [`MrPool`](super::MrPool) handle is dropped *and*
//! its last slot is returned, without a shared reference count on the slot path.
//!
//! An owned slot does not hold a reference count on its pool (one shared counter written by
//! every allocation and every free bounces its cache line between the cores of a producer and
//! a consumer). Instead every thread counts its own allocations and frees in a [`Cell`] only it
//! writes (a plain load and store, no read-modify-write), and the number of live slots is the
//! sum over all cells. The pool's memory is held by one *keepalive* (`K`, the pool's `Arc`),
//! released by [`Life::settle`] once the pool is closing and the sum is zero.
//!
//! The race to get right: a free that counts itself just as the last handle closes the pool.
//! The freeing thread stores its count, then loads `closing` (a copy in its own cell, on the
//! line it just wrote); the closing thread stores `closing` (in every cell), then reads every
//! count. With a full barrier between the store and the load on
//! both sides (Dekker), at least one of them sees the other: the closer sees the free, or the
//! freer sees `closing` and settles itself. So the last settle in lock order sees every free,
//! and the keepalive is released exactly once, when no slot is left. The barrier is asymmetric:
//! the freeing side (the hot path) has only a compiler fence, the closing side (once per pool)
//! runs `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`, which executes a full barrier on every
//! running thread of the process. Where that command is unavailable, both sides use
//! `fence(SeqCst)`. Under loom both are a read-modify-write of one shared atomic, which orders
//! the two sides the same way.
//!
//! After its count is stored a freeing thread touches only memory it holds itself (its cell
//! and this `Life`, both kept by its magazine), never the pool: the pool may be gone by then.

use std::fmt;
use std::sync::Arc;

use crossbeam_utils::CachePadded;

use super::sync::{AtomicBool, AtomicU64, Mutex, Ordering};

/// One thread's counts for one pool. Each field is written only by its thread (a plain load +
/// store: no read-modify-write, no shared cache line on the hot path); read by [`Life`] sums.
#[derive(Debug, Default)]
pub struct Cell {
    /// Slots allocated by this thread.
    pub allocs: AtomicU64,
    /// Slots freed by this thread.
    pub frees: AtomicU64,
    /// The pool's `closing`, copied onto the line this thread writes on every free (so the
    /// check after a free reads no other line). Set under the state lock, by `close` for every
    /// registered cell (release) and by `register` for cells made after it; read (acquire) by
    /// the cell's thread after each free.
    pub closing: AtomicBool,
}

/// Add one to a counter only the calling thread writes.
#[inline(always)]
pub fn bump(c: &AtomicU64) {
    // Single writer: a plain store of load + 1 (no lock prefix). Relaxed: the value is ordered
    // for the lifetime protocol by the barriers around it (see `Life`), and read as a
    // statistic otherwise.
    c.store(c.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
}

struct State<K> {
    /// Every thread's cell (kept after the thread exits: its counts still matter).
    cells: Vec<Arc<CachePadded<Cell>>>,
    /// The pool's memory, released once (`None` afterwards).
    keep: Option<K>,
}

/// The lifetime protocol of one pool (see the module docs).
pub struct Life<K> {
    /// Set once, under the state lock, when the last handle is dropped (then copied into every
    /// cell). Release store / acquire load: a thread that sees it (here or in its cell) also
    /// sees every allocation the closer saw (no allocation happens after it).
    closing: AtomicBool,
    /// Counts of the allocations and frees made where no per-thread cell was reachable
    /// (thread-local storage already destroyed): read-modify-writes, cold.
    shared: Cell,
    state: Mutex<State<K>>,
    /// The loom model of the asymmetric barrier: one read-modify-write on this atomic on both
    /// sides (RMWs on one location are totally ordered, each acquiring the previous one).
    #[cfg(loom)]
    barrier: AtomicU64,
}

impl<K> fmt::Debug for Life<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Life")
            .field("closing", &self.closing.load(Ordering::Relaxed))
            .field("live", &self.live())
            .finish()
    }
}

/// The asymmetric barrier, shared with the registration cache's lease core.
#[cfg(not(loom))]
pub(crate) mod barrier {
    use std::sync::atomic::{compiler_fence, fence, AtomicBool, Ordering};
    use std::sync::OnceLock;

    use rustix::thread::{membarrier, membarrier_query, MembarrierCommand};

    /// Whether this process registered for `MEMBARRIER_CMD_PRIVATE_EXPEDITED`: decided once,
    /// before the first pool exists, so both sides of every pool agree.
    static ASYMMETRIC: OnceLock<bool> = OnceLock::new();
    /// A copy of a `true` decision, read by the hot side in one load. Release store by
    /// `init`, Acquire loads (plain moves on x86): a thread holding a slot or lease saw the
    /// pool's or set's creation, which ran `init`. Before it (or without the command) a
    /// `false`: a full fence on the hot side, never weaker than the heavy side expects.
    static FAST: AtomicBool = AtomicBool::new(false);

    pub(crate) fn init() {
        let asym = *ASYMMETRIC.get_or_init(|| {
            membarrier_query().contains_command(MembarrierCommand::PrivateExpedited)
                && membarrier(MembarrierCommand::RegisterPrivateExpedited).is_ok()
        });
        if asym && !FAST.load(Ordering::Relaxed) {
            FAST.store(true, Ordering::Release);
        }
    }

    #[inline(always)]
    pub(crate) fn asymmetric() -> bool {
        // `init` ran before any pool existed; a thread holding a slot saw the pool's creation.
        FAST.load(Ordering::Acquire)
    }

    /// The hot side: orders this thread's earlier stores before its later loads.
    #[inline(always)]
    pub(crate) fn light() {
        if asymmetric() {
            // The heavy side's membarrier supplies the hardware barrier; keep the compiler
            // from moving the count store after the `closing` load.
            compiler_fence(Ordering::SeqCst);
        } else {
            fence(Ordering::SeqCst);
        }
    }

    /// The cold side: a full barrier on every running thread of the process. False when it
    /// could not be executed (then nothing may be concluded from the counts).
    pub(crate) fn heavy() -> bool {
        if !asymmetric() {
            fence(Ordering::SeqCst);
            return true;
        }
        for _ in 0..8 {
            match membarrier(MembarrierCommand::PrivateExpedited) {
                Ok(()) => return true,
                Err(rustix::io::Errno::INTR) | Err(rustix::io::Errno::AGAIN) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "membarrier failed");
                    return false;
                }
            }
        }
        false
    }
}

impl<K> Life<K> {
    /// A protocol with no cells yet; [`Life::arm`] gives it the keepalive.
    pub fn new() -> Life<K> {
        #[cfg(not(loom))]
        barrier::init();
        Life {
            closing: AtomicBool::new(false),
            shared: Cell::default(),
            state: Mutex::new(State {
                cells: Vec::new(),
                keep: None,
            }),
            #[cfg(loom)]
            barrier: AtomicU64::new(0),
        }
    }

    /// Run `f` on the keepalive while the pool is not released, under the state lock (so the
    /// keepalive cannot be released meanwhile); `None` once it has been. Unlike upgrading a
    /// weak reference this takes no reference of its own: the pool's memory still goes in
    /// the thread that settles, never later in this one.
    pub fn with_keep<R>(&self, f: impl FnOnce(&K) -> R) -> Option<R> {
        self.state.lock().keep.as_ref().map(f)
    }

    /// Hand over the pool's keepalive (once, before the first slot).
    pub fn arm(&self, keep: K) {
        self.state.lock().keep = Some(keep);
    }

    /// A new cell for the calling thread (cold: once per thread and pool).
    pub fn register(&self) -> Arc<CachePadded<Cell>> {
        let c = Arc::new(CachePadded::new(Cell::default()));
        let mut st = self.state.lock();
        // Relaxed: `close` sets `closing` under this lock, which orders both accesses.
        if self.closing.load(Ordering::Relaxed) {
            c.closing.store(true, Ordering::Relaxed);
        }
        st.cells.push(c.clone());
        c
    }

    /// Count an allocation made without a cell (read-modify-write, cold).
    pub fn count_alloc_shared(&self) {
        // Relaxed: as `bump`.
        self.shared.allocs.fetch_add(1, Ordering::Relaxed);
    }

    /// Count a free made without a cell, then as [`Life::after_free`].
    pub fn count_free_shared(&self) -> Option<K> {
        // Relaxed: ordered against `closing` by the barrier in `after_free`.
        self.shared.frees.fetch_add(1, Ordering::Relaxed);
        self.after_free()
    }

    #[inline(always)]
    fn light_barrier(&self) {
        #[cfg(loom)]
        self.barrier.fetch_add(0, Ordering::AcqRel);
        #[cfg(not(loom))]
        barrier::light();
    }

    fn heavy_barrier(&self) -> bool {
        #[cfg(loom)]
        {
            self.barrier.fetch_add(0, Ordering::AcqRel);
            true
        }
        #[cfg(not(loom))]
        barrier::heavy()
    }

    /// Called right after a free was counted in the shared cell: the keepalive when the pool
    /// is closing and that was its last slot (drop it outside any pool borrow), else `None`.
    pub fn after_free(&self) -> Option<K> {
        self.light_barrier();
        // Acquire: pairs with the release store in `close` (see the field).
        if self.closing.load(Ordering::Acquire) {
            self.settle()
        } else {
            None
        }
    }

    /// Called by a thread right after it counted a free in its `cell`: whether the pool is
    /// closing (then [`Life::settle`] must follow, outside any pool borrow).
    #[inline(always)]
    pub fn closing_after_free(&self, cell: &Cell) -> bool {
        self.light_barrier();
        // Acquire: pairs with the release store in `close` (see `Cell::closing`).
        cell.closing.load(Ordering::Acquire)
    }

    /// The last handle is gone: no allocation follows. The keepalive when no slot is live.
    pub fn close(&self) -> Option<K> {
        {
            let st = self.state.lock();
            // Release: see the fields.
            self.closing.store(true, Ordering::Release);
            for c in &st.cells {
                c.closing.store(true, Ordering::Release);
            }
        }
        if !self.heavy_barrier() {
            // Without the barrier a free may be invisible here *and* have missed `closing`:
            // keep the pool (a leak, never a use after free).
            return None;
        }
        self.settle()
    }

    /// The keepalive when the pool is closing, it was not released yet and no slot is live.
    #[cold]
    pub fn settle(&self) -> Option<K> {
        let mut st = self.state.lock();
        if st.keep.is_none() || Self::live_in(&st, &self.shared) != 0 {
            return None;
        }
        st.keep.take()
    }

    fn live_in(st: &State<K>, shared: &Cell) -> u64 {
        let (mut a, mut f) = (
            shared.allocs.load(Ordering::Relaxed),
            shared.frees.load(Ordering::Relaxed),
        );
        for c in &st.cells {
            // Relaxed: see `bump`; a stale (smaller) free count only delays the release to a
            // later settle, which sees it (module docs).
            a = a.wrapping_add(c.allocs.load(Ordering::Relaxed));
            f = f.wrapping_add(c.frees.load(Ordering::Relaxed));
        }
        a.wrapping_sub(f)
    }

    /// Slots allocated and not freed (exact when no thread is allocating or freeing).
    pub fn live(&self) -> u64 {
        let st = self.state.lock();
        let l = Self::live_in(&st, &self.shared);
        // A free counted on one thread may be seen before the matching allocation on another.
        if l > u64::MAX / 2 {
            0
        } else {
            l
        }
    }
}

impl<K> Default for Life<K> {
    fn default() -> Self {
        Life::new()
    }
}
