//! Leases: the reference accounting of the cache's hit path (its lock-free core).
//!
//! A cached entry's *registration* may be released (deregistered) only once the entry is
//! dead (invalidated, evicted, superseded, cache dropped) and no handle on it exists. A
//! shared reference count would make every hit write one cache line that every thread
//! writes; instead each thread takes its handles through its own **lease** on the entry: a
//! 64-byte, 64-aligned block written by that thread only on the hit path, with no locked
//! instruction (no read-modify-write) on a hit or on the drop of a handle on the same thread.
//!
//! A lease has an **owner**, the thread whose table holds it (a [`Hold`] is not `Send`):
//!
//! * `own`: handles taken through the lease on the owner thread minus handles dropped there
//!   (wrapping). Written by the owner only, with a plain load and store.
//! * `x`: handles dropped on other threads minus handles cloned on other threads, times 4,
//!   plus the `ORPHAN` bit (the owner let go of its last hold) and the `DEAD` bit (the
//!   entry was killed). Read-modify-writes (the cross-thread path).
//! * `dead`: the entry was killed (set once, never cleared; also in `x` and on the entry's
//!   set): the owner thread's copy, read by its hits and drops.
//!
//! Handles alive = `own - x / 4`, read `x` first (a drop seen in `x` has its taking in
//! `own`, by the happens-before of the hand-over), under the set's mutex (so an off-owner
//! clone is never half seen).
//!
//! The race to get right: a hit counting itself as the entry is killed. The hit stores
//! `own + 1`, then loads `dead`; the killer stores `dead` on every lease, then loads the counts
//! (Dekker). With a full barrier between the store and the load on both sides, at least one
//! sees the other: the killer counts the handle, or the hit sees `dead`, backs out and calls
//! [`LeaseSet::try_retire`]. The barrier is asymmetric, as the pool's lifetime protocol
//! (`pool::life`): the hit and the same-thread drop have a compiler fence only, the killer
//! runs `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)` (a full barrier on every running thread
//! of the process) when a lease of the entry belongs to another thread, nothing more
//! otherwise (every hit is then its own, in program order). Without that command (old
//! kernels, seccomp sandboxes: [`asymmetric`] says which, once per process) the hit uses
//! `fence(SeqCst)`, every handle drop takes the read-modify-write path (the owner's path is
//! closed: [`owner_token`]) and the killer a `fence(SeqCst)`. With it, the hit through the
//! thread's current record and the owner's drop test no flag (an [`Asymmetric`] proof).
//! If the membarrier fails, nothing may be concluded from the counts: the set is marked
//! *unsure* and the registration is released only when the entry itself goes (its last
//! lease freed), a late release, never a use after release. Under loom both barriers are a
//! read-modify-write of one atomic of the set, which orders the two sides the same way.
//!
//! * **hit** ([`Hold::get`], owner thread): `own + 1`, barrier (light), load `dead`: if set,
//!   back out (`own - 1`), [`LeaseSet::try_retire`], miss.
//! * **drop on the owner thread**: `own - 1`, barrier (light), if `dead`: `try_retire`.
//! * **drop elsewhere**: `x += 4` by compare-and-swap from a value without `DEAD` (AcqRel);
//!   no fence, and the entry is not touched. A drop and the kill's `x |= DEAD` are
//!   read-modify-writes of one word, so they are totally ordered: a drop that did not see
//!   `DEAD` comes before it, and the killer's count (which reads `x` after it) has the drop.
//!   If the old `x` has `ORPHAN` and the drop brought the handles to zero, free the lease.
//!   A drop that sees `DEAD` keeps the entry (an `Arc` clone, taken while its handle still
//!   keeps the lease alive), then `x += 4` and `try_retire`.
//! * **kill** ([`LeaseSet::kill`], under the set's mutex): mark the set and every lease dead
//!   (`dead` stored, `x |= DEAD`; leases created later are born dead), heavy barrier, sum
//!   the handles.
//! * **try_retire**: under the mutex, if the set is dead, sure, and the sum is 0, retire (the
//!   owner's [`Retire::retire`], which must be idempotent).
//! * **last hold dropped** (owner thread; table cell let go of, ring slot replaced, thread exit): the lease
//!   becomes ownerless (later drops on that thread take the shared path), `x |= ORPHAN`; if no
//!   handle is left, free the lease. A lease is freed exactly once, by whoever brings it to
//!   "orphaned and no handle" with its read-modify-write of `x`; it is unlinked from the set
//!   under the mutex first, so the killer and `try_retire` never read freed memory. A lease
//!   keeps its entry's memory (an `Arc`) alive, never its registration.
//!
//! Model-checked, as written here, by `tests/loom_cache.rs` (atomics and mutex come from the
//! cache's sync shim, loom's under `--cfg loom`).

use std::fmt;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::Arc;

use super::sync::{
    arm_owner_token, owner_token, thread_id, AtomicBool, AtomicU64, AtomicU8, Mutex, Ordering,
};
/// The table field of a lease (not part of the modelled protocol: a `std` atomic under loom
/// too, valid in zeroed memory).
use std::sync::atomic::AtomicU32 as CellTag;

pub mod table;

/// `x`: the owner dropped its last hold (set once).
const ORPHAN: u64 = 1;
/// `x`: one handle dropped off the owner thread (the count lives in bits 2..64).
const XONE: u64 = 4;
/// `x`: the entry was killed (set once, by the kill's read-modify-write, or when the lease
/// is born dead). Cross-thread drops read it in their own read-modify-write of `x`.
const DEAD: u64 = 2;
/// Handle counts are compared modulo 2^62 (the width of `x`'s count).
const COUNT_MASK: u64 = u64::MAX >> 2;

/// What the lease core needs from an entry.
pub trait Retire: Send + Sync + Sized + 'static {
    /// Immutable facts of the entry a hit checks (copied into each lease, so a hit reads
    /// the lease's line only).
    type Meta: Copy + Send + Sync + 'static;
    /// The entry's facts.
    fn meta(&self) -> Self::Meta;
    /// The entry's lease set.
    fn leases(&self) -> &LeaseSet<Self>;
    /// Release the registration. Called once the entry is dead and unused, possibly more
    /// than once (by racing releasers): must be idempotent.
    fn retire(&self);
}

/// One thread's lease on an entry (see the module doc). 64-aligned: the line is the lease's.
#[repr(align(64))]
struct Lease<T: Retire> {
    /// Handles taken minus handles dropped on the owner thread (wrapping). Written only by
    /// the owner thread (load + store): Release stores, so a reader that sees a decrement
    /// (Acquire) also sees the uses of the handle before it; ordered against `dead` by the
    /// barriers (module doc).
    own: AtomicU64,
    /// `XONE` x (handles dropped off the owner thread minus those cloned off it) | `ORPHAN`
    /// | `DEAD`. Read-modify-writes, AcqRel: the owner's final `own` is published by its
    /// `ORPHAN` RMW, the RMW that frees the lease sees every earlier one, and a cross-thread
    /// drop and the kill are ordered by their RMWs of this one word.
    x: AtomicU64,
    /// The owner thread ([`thread_id`]), 0 once the owner dropped its last hold. Written only
    /// by the owner. Relaxed where a thread compares it with its own id (which neither the
    /// old nor the new value equals); the 0 is stored with Release for the killer (Acquire).
    owner: AtomicU64,
    /// The owner's holds (the table's references: its slot, ring and in-flight clones).
    /// Owner only, Relaxed load + store.
    holds: AtomicU8,
    /// The entry was killed (set once, under the set's mutex; `DEAD` in `x` says the same to
    /// other threads). Relaxed stores and loads: ordered against the owner's count by the
    /// barriers (module doc).
    dead: AtomicBool,
    /// CLOCK bit: set by every handle drop, cleared by the eviction scan. Relaxed (a
    /// statistic).
    touched: AtomicBool,
    /// For a lease placed in a thread's [`table::LeaseTable`]: the cell's state and key in
    /// one word. Written by the table's thread only (Relaxed), and never by the lease
    /// protocol: it stays readable after the lease in the cell is freed.
    tag: CellTag,
    meta: T::Meta,
    /// Dropped when the lease is freed ([`mem::free_lease`]), the only field with drop glue.
    entry: ManuallyDrop<Arc<T>>,
}

impl<T: Retire> Lease<T> {
    /// Handles alive (read `x` first: see the module doc).
    fn handles(&self) -> u64 {
        // Acquire: a drop seen here comes with the taking of its handle (in `own`).
        let x = self.x.load(Ordering::Acquire);
        if x & ORPHAN != 0 {
            // The orphaning RMW moved the final `own` into `x` (subtracted it).
            return (x / XONE).wrapping_neg() & COUNT_MASK;
        }
        // Acquire: pairs with the owner's Release stores (the uses before a drop).
        self.own.load(Ordering::Acquire).wrapping_sub(x / XONE) & COUNT_MASK
    }

    /// Whether the calling thread owns the lease and may take the owner's path (a plain
    /// update of `own` and a compiler fence): never without the asymmetric barrier, where
    /// every drop and clone takes the read-modify-write path (see [`owner_token`]).
    #[inline(always)]
    fn mine(&self) -> bool {
        self.owner.load(Ordering::Relaxed) == owner_token()
    }

    /// The owner's plain add to `own` (no read-modify-write: only the owner writes it).
    #[inline(always)]
    fn own_add(&self, d: u64) {
        let n = self.own.load(Ordering::Relaxed);
        self.own.store(n.wrapping_add(d), Ordering::Release);
    }
}

struct Ptr<T: Retire>(NonNull<Lease<T>>);

// SAFETY: a `Ptr` is only dereferenced under the list mutex while the lease is linked (the
// freer unlinks under the same mutex before freeing); `Lease<T>` is `Sync` (atomics and an
// `Arc<T>` with `T: Send + Sync`).
unsafe impl<T: Retire> Send for Ptr<T> {}
// SAFETY: as for `Send`.
unsafe impl<T: Retire> Sync for Ptr<T> {}

struct State<T: Retire> {
    dead: bool,
    /// A lease was owned by another live thread at the kill: the counts prove something only
    /// after a heavy barrier.
    heavy: bool,
    /// The barrier after the kill ran (the counts are exact from now on). Stays false while
    /// a heavy barrier fails: then the entry's own drop retires it.
    fenced: bool,
    /// Some lease freed since the last [`LeaseSet::take_touched`] had its CLOCK bit set.
    touched: bool,
    leases: Vec<Ptr<T>>,
}

/// An entry's leases and its dead flag, under one mutex (cold paths only).
pub struct LeaseSet<T: Retire> {
    st: Mutex<State<T>>,
    /// The loom model of the asymmetric barrier: one read-modify-write of this atomic on
    /// both sides (RMWs of one location are totally ordered, each acquiring the previous).
    #[cfg(loom)]
    barrier: AtomicU64,
}

impl<T: Retire> fmt::Debug for LeaseSet<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.st.lock();
        f.debug_struct("LeaseSet")
            .field("dead", &st.dead)
            .field("leases", &st.leases.len())
            .finish()
    }
}

impl<T: Retire> Default for LeaseSet<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Retire> LeaseSet<T> {
    /// A live set without leases.
    pub fn new() -> Self {
        // Decide the barrier kind before any lease of the set exists (both sides agree).
        #[cfg(not(loom))]
        crate::pool::life::barrier::init();
        LeaseSet {
            st: Mutex::new(State {
                dead: false,
                heavy: false,
                fenced: false,
                touched: false,
                leases: Vec::new(),
            }),
            #[cfg(loom)]
            barrier: AtomicU64::new(0),
        }
    }

    /// The hot side of the barrier (hit, same-thread drop): orders the calling thread's
    /// store of `own` before its load of `dead`, given the killer's heavy barrier. A
    /// compiler fence with the asymmetric barrier, a full fence without.
    #[inline(always)]
    fn light(&self) {
        #[cfg(loom)]
        self.barrier.fetch_add(0, Ordering::AcqRel);
        #[cfg(not(loom))]
        crate::pool::life::barrier::light();
    }

    /// [`light`](Self::light) where the caller knows the process has the asymmetric barrier
    /// (the owner's drop: [`Lease::mine`] is false without it; the hit through the thread's
    /// current record, which is set only with it): a compiler fence, no flag to test.
    #[inline(always)]
    fn light_asymmetric(&self) {
        #[cfg(loom)]
        self.barrier.fetch_add(0, Ordering::AcqRel);
        #[cfg(not(loom))]
        std::sync::atomic::compiler_fence(Ordering::SeqCst);
    }

    /// The cold side: a full barrier on every thread that may own a lease of the set. False
    /// when it could not be executed.
    fn heavy(&self) -> bool {
        #[cfg(loom)]
        {
            self.barrier.fetch_add(0, Ordering::AcqRel);
            true
        }
        #[cfg(not(loom))]
        crate::pool::life::barrier::heavy()
    }

    /// Kill: no handle can be taken any more (hits back out). Returns the handles alive at
    /// the kill: exact for leases of the calling thread and ownerless ones, an estimate for
    /// leases of other threads until the heavy barrier, which the next
    /// [`try_retire`](Self::try_retire) or [`fence_all`](Self::fence_all) runs (once, for
    /// any number of entries). Follow with one of them (outside other locks).
    pub fn kill(&self) -> u64 {
        let mut st = self.st.lock();
        st.dead = true;
        let me = thread_id();
        let mut heavy = false;
        for p in &st.leases {
            // SAFETY: linked leases are alive while we hold the mutex (see `free`).
            let l = unsafe { p.0.as_ref() };
            l.dead.store(true, Ordering::Relaxed);
            // AcqRel: ordered with every cross-thread drop's read-modify-write of `x` (a drop
            // before it is in the count below, a drop after it sees `DEAD`).
            l.x.fetch_or(DEAD, Ordering::AcqRel);
            // Another live owner may be hitting right now. (0: ownerless, no hit can come;
            // its drops take the shared path, ordered with us by `x`.)
            // Acquire: reading 0 (pairs with the Release in the last hold's drop) shows
            // the owner's final `own`.
            let o = l.owner.load(Ordering::Acquire);
            heavy |= o != me && o != 0;
        }
        st.heavy |= heavy;
        if !st.heavy {
            // Every hit and owner drop is ours (program order), and the shared drops are
            // ordered with us by their read-modify-writes of `x`: the counts are exact.
            st.fenced = true;
        }
        Self::sum(&st)
    }

    /// Run the heavy barrier of a dead, unfenced set (under its mutex).
    fn fence(&self, st: &mut State<T>) {
        if st.dead && !st.fenced {
            // Unfenced after the kill: a lease of another live thread (`heavy`).
            st.fenced = self.heavy();
        }
    }

    /// The heavy barrier of every set killed and not fenced yet, once for all of them (a
    /// membarrier costs microseconds): an invalidation or eviction of many entries.
    pub fn fence_all<'a>(sets: impl Iterator<Item = &'a LeaseSet<T>> + Clone) {
        // Sets killed before this scan (by any thread) and waiting for a heavy barrier; a
        // set killed later is not fenced by the barrier below.
        let waiting: Vec<bool> = sets
            .clone()
            .map(|s| {
                let st = s.st.lock();
                st.dead && !st.fenced && st.heavy
            })
            .collect();
        if !waiting.contains(&true) {
            return;
        }
        #[cfg(not(loom))]
        let ok = crate::pool::life::barrier::heavy();
        for (s, w) in sets.zip(waiting) {
            if w {
                #[cfg(loom)]
                let ok = s.heavy();
                s.st.lock().fenced |= ok;
            }
        }
    }

    /// Whether the set was killed and its count still waits for a heavy barrier (a lease of
    /// another live thread): [`try_retire`](Self::try_retire) would run a membarrier.
    pub fn awaits_barrier(&self) -> bool {
        let st = self.st.lock();
        st.dead && !st.fenced && st.heavy
    }

    /// Whether [`kill`](Self::kill) ran.
    pub fn is_dead(&self) -> bool {
        self.st.lock().dead
    }

    /// Handles alive now (sum over the leases). Exact once the set is dead; an estimate
    /// before (a hit on another thread may be on its way).
    pub fn users(&self) -> u64 {
        Self::sum(&self.st.lock())
    }

    fn sum(st: &State<T>) -> u64 {
        st.leases
            .iter()
            // SAFETY: linked leases are alive while the mutex is held (see `free`).
            .map(|p| unsafe { p.0.as_ref() }.handles())
            .sum()
    }

    /// Whether a handle was dropped since the last call (clears the CLOCK bits).
    pub fn take_touched(&self) -> bool {
        let mut st = self.st.lock();
        let mut t = std::mem::take(&mut st.touched);
        for p in &st.leases {
            // SAFETY: linked leases are alive while the mutex is held (see `free`).
            t |= unsafe { p.0.as_ref() }
                .touched
                .swap(false, Ordering::Relaxed);
        }
        t
    }

    /// Leases alive (linked).
    pub fn live_leases(&self) -> usize {
        self.st.lock().leases.len()
    }

    /// Retire `entry` if it is dead and no handle on it exists. Any thread, any number of
    /// times.
    pub fn try_retire(entry: &T) {
        let unused = {
            let set = entry.leases();
            let mut st = set.st.lock();
            set.fence(&mut st);
            st.dead && st.fenced && Self::sum(&st) == 0
        };
        if unused {
            entry.retire();
        }
    }
}

/// Proof that the process has the asymmetric barrier (the owner's side of the lease protocol
/// is then a compiler fence): made by [`asymmetric`], or assumed by a caller that saw it.
#[derive(Clone, Copy, Debug)]
pub struct Asymmetric(());

impl Asymmetric {
    /// The proof, without asking again.
    ///
    /// # Safety
    ///
    /// [`asymmetric`] returned `Some` earlier in the process (the decision never changes).
    #[inline(always)]
    pub unsafe fn assume() -> Asymmetric {
        Asymmetric(())
    }
}

/// Whether the process has the asymmetric barrier: decided once, before the first lease set
/// (which [`LeaseSet::new`] makes sure of), never changed after. (Under loom: always, its
/// barrier being modelled as read-modify-writes on both sides.)
#[inline]
pub fn asymmetric() -> Option<Asymmetric> {
    #[cfg(loom)]
    let yes = true;
    #[cfg(not(loom))]
    let yes = crate::pool::life::barrier::asymmetric();
    yes.then_some(Asymmetric(()))
}

/// A new lease on `entry` owned by the calling thread, with one handle, held by the returned
/// [`Hold`] (the per-thread table's reference). Born dead when the entry's set is dead (the
/// handle is then private to its holder and the registration is retired at its last
/// release).
pub fn lease<T: Retire>(entry: &Arc<T>) -> (Handle<T>, Hold<T>) {
    let p = mem::new_lease(new(entry, 1, 1));
    link(p);
    (
        Handle { p },
        Hold {
            p,
            _local: PhantomData,
        },
    )
}

/// A lease owned by the calling thread with `own` handles and `holds` holds (not linked).
fn new<T: Retire>(entry: &Arc<T>, own: u64, holds: u8) -> Lease<T> {
    arm_owner_token(asymmetric().is_some());
    Lease {
        own: AtomicU64::new(own),
        x: AtomicU64::new(0),
        owner: AtomicU64::new(thread_id()),
        holds: AtomicU8::new(holds),
        dead: AtomicBool::new(false),
        touched: AtomicBool::new(false),
        tag: CellTag::new(0),
        meta: entry.meta(),
        entry: ManuallyDrop::new(entry.clone()),
    }
}

/// Link a new lease into its entry's set (born dead if the set is dead).
fn link<T: Retire>(p: NonNull<Lease<T>>) {
    // SAFETY: the lease was just written and is not shared yet.
    let l = unsafe { p.as_ref() };
    let mut st = l.entry.leases().st.lock();
    if st.dead {
        l.dead.store(true, Ordering::Relaxed);
        // AcqRel: as the kill's (the lease is not shared yet; any ordering would do).
        l.x.fetch_or(DEAD, Ordering::AcqRel);
    }
    st.leases.push(Ptr(p));
}

/// Free a lease that is orphaned and has no handle left.
///
/// # Safety
///
/// `p` came from [`lease`] and the caller's read-modify-write of `x` made it orphaned with
/// no handle: no `Handle` or `Hold` refers to it any more, only the entry's list.
unsafe fn free<T: Retire>(p: NonNull<Lease<T>>) {
    {
        // SAFETY: alive until the free below; others reach it only through the list, under
        // the mutex we take here.
        let l = unsafe { p.as_ref() };
        let mut st = l.entry.leases().st.lock();
        if l.touched.load(Ordering::Relaxed) {
            st.touched = true;
        }
        // Cold path: a hard check that the count protocol frees each lease once.
        let i = st.leases.iter().position(|q| q.0 == p);
        assert!(i.is_some(), "lease freed twice");
        if let Some(i) = i {
            st.leases.swap_remove(i);
        }
    }
    // SAFETY: unlinked, and no handle or hold is left: we own it. It came from `new_lease`.
    unsafe { mem::free_lease(p) };
}

/// Drop one handle off the owner thread (or of an orphaned lease): the cross-thread path.
/// One read-modify-write of the lease's `x` (a compare-and-swap from a value without `DEAD`);
/// no fence, and the entry is not touched unless it was killed ([`drop_shared_dead`]).
#[cold]
fn drop_shared<T: Retire>(p: NonNull<Lease<T>>) {
    // SAFETY: the caller's handle keeps the lease alive until the read-modify-write below.
    let l = unsafe { p.as_ref() };
    // Relaxed: a guess for the compare-and-swap, which checks it.
    let mut old = l.x.load(Ordering::Relaxed);
    loop {
        if old & DEAD != 0 {
            return drop_shared_dead(p);
        }
        // AcqRel: our uses of the handle happen before a later reader of `x` (Acquire), the
        // freeing RMW sees every earlier one, and the kill's `x |= DEAD` is ordered with this
        // RMW (module doc). Relaxed on failure: the value read is only the next guess. After
        // it the lease may be gone (unless we free it): it is not touched again.
        match l.x.compare_exchange_weak(
            old,
            old.wrapping_add(XONE),
            Ordering::AcqRel,
            Ordering::Relaxed,
        ) {
            Ok(_) => break,
            Err(now) => old = now,
        }
    }
    if drop_freed(old) {
        // SAFETY: orphaned, and our RMW brought the handles to zero.
        unsafe { free(p) };
    }
}

/// Whether the cross-thread drop whose read-modify-write of `x` returned `old` brought an
/// orphaned lease to no handle (and so frees it): the count of an orphaned `x` is minus the
/// handles alive (the owner's final `own` was subtracted).
#[inline(always)]
fn drop_freed(old: u64) -> bool {
    old & ORPHAN != 0 && (old / XONE).wrapping_add(1) & COUNT_MASK == 0
}

/// A cross-thread drop that found the entry killed: keep the entry (the lease may be freed by
/// another thread right after our read-modify-write), count the drop, and retire the entry if
/// it was the last handle.
#[cold]
#[inline(never)]
fn drop_shared_dead<T: Retire>(p: NonNull<Lease<T>>) {
    // SAFETY: the caller's handle keeps the lease alive until the read-modify-write below.
    let l = unsafe { p.as_ref() };
    let e = Arc::clone(&l.entry);
    // AcqRel: as in `drop_shared`. `DEAD` is set for good: a plain add.
    if drop_freed(l.x.fetch_add(XONE, Ordering::AcqRel)) {
        // SAFETY: orphaned, and our RMW brought the handles to zero.
        unsafe { free(p) };
    }
    // The set is dead: its count (under its mutex, after our RMW) has our drop.
    LeaseSet::try_retire(&*e);
}

/// One handle: one count on a lease. While it lives the entry's registration stays.
pub struct Handle<T: Retire> {
    p: NonNull<Lease<T>>,
}

// SAFETY: the lease is shared through atomics only (a handle dropped off its lease's owner
// thread takes the read-modify-write path), and `T: Send + Sync`.
unsafe impl<T: Retire> Send for Handle<T> {}
// SAFETY: `&Handle` gives only `&T` (`T: Sync`).
unsafe impl<T: Retire> Sync for Handle<T> {}

impl<T: Retire> fmt::Debug for Handle<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handle").finish_non_exhaustive()
    }
}

impl<T: Retire> Handle<T> {
    #[inline]
    fn lease(&self) -> &Lease<T> {
        // SAFETY: this handle's count keeps the lease alive (it is freed only at zero).
        unsafe { self.p.as_ref() }
    }

    /// The entry.
    #[inline]
    pub fn entry(&self) -> &T {
        &self.lease().entry
    }

    /// The entry's facts, from the lease's own line (the line the hit just read).
    #[inline]
    pub fn meta(&self) -> &T::Meta {
        &self.lease().meta
    }
}

impl<T: Retire> Clone for Handle<T> {
    fn clone(&self) -> Self {
        // A live handle keeps the count above 0 throughout; the new handle needs no `dead`
        // check (an entry stays registered while a handle on it lives).
        let l = self.lease();
        if l.mine() {
            l.own_add(1);
        } else {
            // Under the mutex: the counts are summed under it, so no sum sees the clone's
            // drop on the owner thread without the clone itself.
            let _st = l.entry.leases().st.lock();
            // AcqRel: as any RMW of `x`. Wrapping: the count is modulo 2^62.
            l.x.fetch_sub(XONE, Ordering::AcqRel);
        }
        Handle { p: self.p }
    }
}

impl<T: Retire> Drop for Handle<T> {
    #[inline]
    fn drop(&mut self) {
        let l = self.lease();
        // CLOCK bit. A plain store, no test: the line is written by this drop anyway (`own`
        // on the owner thread, `x` elsewhere).
        l.touched.store(true, Ordering::Relaxed);
        if !l.mine() {
            drop_shared(self.p);
            return;
        }
        // Owner thread: it holds a hold (the owner field is cleared with the last one), so
        // the lease stays alive throughout. `mine` holds only with the asymmetric barrier.
        l.own_add(u64::MAX);
        l.entry.leases().light_asymmetric();
        if l.dead.load(Ordering::Relaxed) {
            retire_dead(l);
        }
    }
}

/// The last step of a handle drop that found its entry dead (out of line: see [`back_out`]).
#[cold]
#[inline(never)]
fn retire_dead<T: Retire>(l: &Lease<T>) {
    LeaseSet::try_retire(&**l.entry);
}

/// A hit that found its entry dead (after counting and backing out): dropping it runs the
/// entry's [`LeaseSet::try_retire`], which may retire the entry and so run arbitrary drop
/// code — the per-thread path drops it only after it stopped reading its table.
#[must_use = "dropping a back-out may retire the entry"]
pub struct Backout<T: Retire> {
    entry: Arc<T>,
}

impl<T: Retire> Drop for Backout<T> {
    fn drop(&mut self) {
        LeaseSet::try_retire(&*self.entry);
    }
}

/// A hit through a lease the calling thread owns: a handle, or a [`Backout`] when the entry
/// is dead. No read-modify-write.
///
/// # Safety
///
/// The calling thread owns the lease (it holds a hold on it, which keeps it alive
/// throughout); with `ASYMMETRIC`, the process has the asymmetric barrier
/// ([`asymmetric`] returned `Some`).
#[inline(always)]
unsafe fn take<T: Retire, const ASYMMETRIC: bool>(
    p: NonNull<Lease<T>>,
) -> Result<Handle<T>, Backout<T>> {
    // SAFETY: (caller) alive while the caller's hold lives.
    let l = unsafe { p.as_ref() };
    l.own_add(1);
    let set = l.entry.leases();
    // Dekker with the killer (module doc): our count before its read, or its `dead`
    // before our load. `ASYMMETRIC`: the caller knows the process has the asymmetric
    // barrier, so no flag is tested.
    if ASYMMETRIC {
        set.light_asymmetric();
    } else {
        set.light();
    }
    if l.dead.load(Ordering::Relaxed) {
        return Err(back_out(l));
    }
    Ok(Handle { p })
}

/// [`take`] found the entry dead: undo the count. Out of line, so that the hit stays short
/// (its instructions decide how many lookups the CPU overlaps at large working sets).
#[cold]
#[inline(never)]
fn back_out<T: Retire>(l: &Lease<T>) -> Backout<T> {
    l.own_add(u64::MAX);
    l.entry.leases().light();
    Backout {
        entry: Arc::clone(&l.entry),
    }
}

/// The per-thread table's reference on a lease: hits take handles through it. Not `Send`:
/// the thread holding it is the lease's owner (the only writer of its handle count).
pub struct Hold<T: Retire> {
    p: NonNull<Lease<T>>,
    _local: PhantomData<*const ()>,
}

// SAFETY: `&Hold` gives `&T` (`T: Sync`) and reads of the lease's atomics; its writes (`get`,
// `clone`, drop) need the `Hold` itself, which stays on its thread (not `Send`).
unsafe impl<T: Retire> Sync for Hold<T> {}

impl<T: Retire> Hold<T> {
    #[inline]
    fn lease(&self) -> &Lease<T> {
        // SAFETY: this hold keeps the lease alive until it drops.
        unsafe { self.p.as_ref() }
    }

    /// A hit: a handle, or `None` when the entry is dead. No read-modify-write: the holder
    /// owns the lease.
    #[inline]
    pub fn get(&self) -> Option<Handle<T>> {
        self.try_get().ok()
    }

    /// A hit that leaves the retire check of a dead entry to its caller: a handle, or a
    /// [`Backout`] to drop once nothing is borrowed (see there).
    #[inline]
    pub fn try_get(&self) -> Result<Handle<T>, Backout<T>> {
        // SAFETY: a hold is on the owner thread and keeps the lease alive.
        unsafe { take::<T, false>(self.p) }
    }

    /// [`try_get`](Self::try_get) with the proof of the asymmetric barrier (no flag tested).
    #[inline(always)]
    pub fn try_get_asymmetric(&self, _: Asymmetric) -> Result<Handle<T>, Backout<T>> {
        // SAFETY: a hold is on the owner thread and keeps the lease alive; the proof.
        unsafe { take::<T, true>(self.p) }
    }

    /// The entry.
    pub fn entry(&self) -> &T {
        &self.lease().entry
    }

    /// The entry, shared.
    pub fn entry_arc(&self) -> &Arc<T> {
        &self.lease().entry
    }

    /// The entry's facts (from the lease's own line).
    #[inline]
    pub fn meta(&self) -> &T::Meta {
        &self.lease().meta
    }
}

impl<T: Retire> Clone for Hold<T> {
    fn clone(&self) -> Self {
        let h = &self.lease().holds;
        let n = h.load(Ordering::Relaxed);
        assert!(n < u8::MAX, "lease hold count overflow");
        h.store(n + 1, Ordering::Relaxed);
        Hold {
            p: self.p,
            _local: PhantomData,
        }
    }
}

impl<T: Retire> Drop for Hold<T> {
    fn drop(&mut self) {
        let l = self.lease();
        let n = l.holds.load(Ordering::Relaxed) - 1;
        l.holds.store(n, Ordering::Relaxed);
        if n > 0 {
            return;
        }
        // Last hold: the lease has no owner from now on (this thread's later drops take the
        // shared path too); `own` is final.
        // Release: a killer that reads 0 (Acquire) sees the final `own`.
        l.owner.store(0, Ordering::Release);
        let own = l.own.load(Ordering::Relaxed);
        // Move the final `own` into `x`: set `ORPHAN` (bit 0, clear until now; bit 1 is
        // always clear, so no carry reaches the count) and subtract `own` from the count,
        // which then reads minus the handles alive. AcqRel: sees every cross-thread drop
        // before it, and the RMW that frees the lease sees it.
        let old = l.x.fetch_add(
            ORPHAN.wrapping_sub(own.wrapping_mul(XONE)),
            Ordering::AcqRel,
        );
        if own.wrapping_sub(old / XONE) & COUNT_MASK == 0 {
            // SAFETY: orphaned by us, and no handle is left.
            unsafe { free(self.p) };
        }
    }
}

/// Where leases and the per-thread tables live: memory laid out for the hit path.
///
/// With tens of thousands of entries a hit's line (the lease cell of the thread's table)
/// lands at random in a few MiB; it misses the CPU caches, and it must not also miss the
/// TLB (a page walk per access, two-dimensional under virtualisation). So:
///
/// * a thread table's cells are one **block** ([`Block`], recorded here because a lease in
///   it may be freed on any thread), and leases outside tables come from a **slab** of
///   64-byte cells in contiguous chunks, not from the heap where they would sit between the
///   entries, index nodes and MR state allocated with them;
/// * the slab's first chunk is 64 KiB, the next ones are 2 MiB; those, like blocks and
///   arrays ([`Slots`]) of 2 MiB and more, are anonymous mappings of their own, 2 MiB
///   aligned and advised for transparent huge pages (`MADV_HUGEPAGE`, through [`Buffer`]):
///   one TLB entry covers 32,768 leases. Without THP they are still contiguous.
///
/// The slab is process-wide (a lease may be freed on any thread) behind a mutex taken only
/// on the slow path (lease creation and freeing). A chunk that empties is unmapped unless
/// it is the only empty one (kept for the next lease, so a count oscillating at a chunk
/// boundary does not map and unmap). Under `--cfg loom` leases are boxed instead.
pub(crate) mod mem {
    use std::marker::PhantomData;
    use std::mem::ManuallyDrop;
    use std::ptr::NonNull;

    use crate::{Buffer, BufferOptions};

    /// Arrays and slab chunks of this size and up are mapped on their own for THP.
    pub const HUGE: usize = 2 << 20;

    /// A transparent-huge-page mapping of `bytes` (2 MiB aligned), if one can be made.
    fn huge_map(bytes: usize) -> Option<Buffer> {
        Buffer::with_options(
            bytes,
            BufferOptions {
                thp: true,
                ..BufferOptions::default()
            },
        )
        .ok()
    }

    /// A fixed-length array: a boxed slice below [`HUGE`] bytes, else a THP-advised mapping
    /// of its own (falling back to the heap when the mapping fails).
    pub struct Slots<T> {
        ptr: NonNull<T>,
        len: usize,
        /// The mapping holding the elements, or `None` when they are a `Box<[T]>`.
        map: Option<Buffer>,
        _own: PhantomData<T>,
    }

    // SAFETY: `Slots<T>` owns its elements like a `Box<[T]>` (the mapping is owned too).
    unsafe impl<T: Send> Send for Slots<T> {}
    // SAFETY: `&Slots<T>` gives only `&[T]`.
    unsafe impl<T: Sync> Sync for Slots<T> {}

    impl<T> Default for Slots<T> {
        fn default() -> Self {
            Slots::from_box(Box::default())
        }
    }

    impl<T> Slots<T> {
        /// `len` elements made by `f`.
        pub fn new(len: usize, mut f: impl FnMut() -> T) -> Self {
            let bytes = len
                .checked_mul(size_of::<T>())
                .expect("array size overflows");
            // A mapping is page aligned: enough for any `T` the cache stores.
            if bytes >= HUGE && align_of::<T>() <= 4096 {
                if let Some(mut map) = huge_map(bytes) {
                    let ptr = NonNull::new(map.as_mut_slice().as_mut_ptr().cast::<T>())
                        .expect("mapping at address 0");
                    for i in 0..len {
                        // SAFETY: `i < len` and the mapping holds `len * size_of::<T>()`
                        // bytes, page aligned; each element is written once. (A panic in
                        // `f` leaks the elements written so far; the mapping is unmapped.)
                        unsafe { ptr.as_ptr().add(i).write(f()) };
                    }
                    return Slots {
                        ptr,
                        len,
                        map: Some(map),
                        _own: PhantomData,
                    };
                }
            }
            Slots::from_box((0..len).map(|_| f()).collect())
        }

        fn from_box(b: Box<[T]>) -> Self {
            let len = b.len();
            // SAFETY: `Box::into_raw` never returns null.
            let ptr = unsafe { NonNull::new_unchecked(Box::into_raw(b).cast::<T>()) };
            Slots {
                ptr,
                len,
                map: None,
                _own: PhantomData,
            }
        }

        /// Whether the elements are in a mapping of their own (THP advised).
        #[cfg(test)]
        pub fn is_mapped(&self) -> bool {
            self.map.is_some()
        }
    }

    impl<T> std::ops::Deref for Slots<T> {
        type Target = [T];
        #[inline]
        fn deref(&self) -> &[T] {
            // SAFETY: `len` initialised elements at `ptr`, owned by `self`.
            unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
        }
    }

    impl<T> std::ops::DerefMut for Slots<T> {
        #[inline]
        fn deref_mut(&mut self) -> &mut [T] {
            // SAFETY: as in `deref`, and `&mut self` is exclusive.
            unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
        }
    }

    impl<T> Drop for Slots<T> {
        fn drop(&mut self) {
            let all = std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len);
            if self.map.is_some() {
                // SAFETY: the elements are initialised and dropped once, here; the mapping
                // is unmapped after this (field drop).
                unsafe { std::ptr::drop_in_place(all) };
            } else {
                // SAFETY: `ptr`/`len` came from `Box::into_raw` of a `Box<[T]>`.
                drop(unsafe { Box::from_raw(all) });
            }
        }
    }

    /// Bytes of a slab cell (one lease: its own cache line). (Under loom leases outside
    /// tables are boxes; the tables' blocks are the slab's in both builds, with cells large
    /// enough for loom's atomics.)
    #[cfg(not(loom))]
    pub const CELL: usize = 64;
    #[cfg(loom)]
    pub const CELL: usize = 4096;

    #[cfg(all(test, not(loom)))]
    pub use slab::{block_count, cell_count};
    #[cfg(not(loom))]
    pub use slab::{free_cell, new_cell};
    pub use slab::{new_block, Block};

    // Under loom only the tables' blocks are used (leases outside tables are boxes).
    #[cfg_attr(loom, allow(dead_code))]
    mod slab {
        use std::collections::BTreeMap;
        use std::ptr::NonNull;

        use parking_lot::Mutex;

        use super::{huge_map, CELL, HUGE};
        use crate::Buffer;

        /// Smallest chunk (the first ones: a process with a few leases maps 64 KiB).
        const FIRST: usize = 64 << 10;

        struct Chunk {
            /// Keeps the cells mapped.
            _map: Buffer,
            /// First cell.
            base: NonNull<u8>,
            cells: usize,
            /// Cells from here on were never handed out (their pages are not touched yet).
            bump: usize,
            /// Cells handed out and given back.
            free: Vec<u32>,
            /// Cells in use.
            live: usize,
        }

        // SAFETY: `base` points into `_map`, which the chunk owns; cells are handed out
        // and taken back only under the slab mutex.
        unsafe impl Send for Chunk {}

        struct Slab {
            /// By the address of the first cell.
            chunks: BTreeMap<usize, Chunk>,
            /// Bytes of all chunks.
            bytes: usize,
            /// The blocks of thread tables, by the address of the first cell.
            blocks: BTreeMap<usize, BlockState>,
        }

        static SLAB: Mutex<Slab> = Mutex::new(Slab {
            chunks: BTreeMap::new(),
            bytes: 0,
            blocks: BTreeMap::new(),
        });

        /// A thread table's array of cells ([`super::super::table`]), placed by the table:
        /// which cells hold a lease not freed yet is kept here, under the slab mutex,
        /// because a lease in a table cell may be freed by any thread.
        struct BlockState {
            /// Keeps the cells mapped (zeroed when mapped: every cell reads empty).
            _map: Buffer,
            cells: usize,
            /// Bit per cell: holds a lease not freed yet.
            leased: Vec<u64>,
            /// Bits set.
            count: usize,
            /// The table still uses the block (it is unmapped only once detached and empty).
            attached: bool,
        }

        impl BlockState {
            fn bit(&self, i: usize) -> bool {
                self.leased[i / 64] & (1 << (i % 64)) != 0
            }

            fn set(&mut self, i: usize, on: bool) {
                assert!(i < self.cells && self.bit(i) != on, "block cell {i} state");
                self.leased[i / 64] ^= 1 << (i % 64);
                if on {
                    self.count += 1;
                } else {
                    self.count -= 1;
                }
            }
        }

        /// A table's handle on its block (the table's thread only). Dropping it detaches the
        /// block: it is unmapped when its last lease is freed (at once if none is left).
        pub struct Block {
            base: NonNull<u8>,
            cells: usize,
        }

        /// A zeroed block of `cells` cells (a power of two of at least 64), THP-advised from
        /// 2 MiB.
        pub fn new_block(cells: usize) -> Block {
            assert!(
                cells.is_power_of_two() && cells >= 64,
                "block of {cells} cells"
            );
            let bytes = cells.checked_mul(CELL).expect("block size overflows");
            let map = if bytes >= HUGE { huge_map(bytes) } else { None };
            let Some(mut map) = map.or_else(|| Buffer::new(bytes).ok()) else {
                std::alloc::handle_alloc_error(
                    std::alloc::Layout::from_size_align(bytes, CELL).expect("layout"),
                );
            };
            let base = NonNull::new(map.as_mut_slice().as_mut_ptr()).expect("mapping at 0");
            SLAB.lock().blocks.insert(
                base.as_ptr() as usize,
                BlockState {
                    _map: map,
                    cells,
                    leased: vec![0; cells.div_ceil(64)],
                    count: 0,
                    attached: true,
                },
            );
            Block { base, cells }
        }

        impl Block {
            /// Cell `i` (`i < cells`).
            #[inline(always)]
            pub fn cell(&self, i: usize) -> NonNull<u8> {
                debug_assert!(i < self.cells);
                // SAFETY: `i < cells`: inside the block's mapping, which lives while the
                // block is attached (the table holds `self`).
                unsafe { NonNull::new_unchecked(self.base.as_ptr().add(i * CELL)) }
            }

            /// Cells.
            #[inline(always)]
            pub fn cells(&self) -> usize {
                self.cells
            }

            /// The first of `reusable` (cells whose lease the table let go of) whose lease is
            /// freed by now, else `empty`: marked as holding a lease and returned.
            pub fn claim(&self, reusable: &[usize], empty: Option<usize>) -> Option<usize> {
                let mut s = SLAB.lock();
                let b = s.blocks.get_mut(&(self.base.as_ptr() as usize))?;
                let i = reusable.iter().copied().find(|&i| !b.bit(i)).or(empty)?;
                b.set(i, true);
                Some(i)
            }

            /// Mark `cells` as holding leases (`true`: moved in) or vacant (`false`: their
            /// leases moved out, not freed).
            pub fn mark(&self, cells: &[usize], leased: bool) {
                let mut s = SLAB.lock();
                let b = s
                    .blocks
                    .get_mut(&(self.base.as_ptr() as usize))
                    .expect("attached block");
                for &i in cells {
                    b.set(i, leased);
                }
            }
        }

        impl Drop for Block {
            fn drop(&mut self) {
                let gone = {
                    let mut s = SLAB.lock();
                    let key = self.base.as_ptr() as usize;
                    let b = s.blocks.get_mut(&key).expect("attached block");
                    b.attached = false;
                    if b.count == 0 {
                        s.blocks.remove(&key)
                    } else {
                        None
                    }
                };
                // Unmapped outside the lock.
                drop(gone);
            }
        }

        /// Give back a cell of a table block whose lease was freed (its entry dropped):
        /// false when `p` is not in a block (under loom, where other leases are boxes;
        /// otherwise `free_cell` handles both kinds under one lock).
        #[cfg(loom)]
        pub fn free_block_cell(p: NonNull<u8>) -> bool {
            let freed = free_in_block(&mut SLAB.lock(), p.as_ptr() as usize);
            // Unmapped outside the lock.
            freed.is_some()
        }

        /// Under the slab mutex: mark the cell at `addr` of a table block vacant. `None` when
        /// `addr` is in no block; else the block if that emptied a detached one (to unmap).
        fn free_in_block(s: &mut Slab, addr: usize) -> Option<Option<BlockState>> {
            let (&base, b) = s.blocks.range_mut(..=addr).next_back()?;
            if addr >= base + b.cells * CELL {
                return None;
            }
            assert_eq!((addr - base) % CELL, 0, "lease cell not line aligned");
            b.set((addr - base) / CELL, false);
            Some(if !b.attached && b.count == 0 {
                s.blocks.remove(&base)
            } else {
                None
            })
        }

        /// Blocks mapped and cells of blocks holding leases.
        #[cfg(test)]
        pub fn block_count() -> (usize, usize) {
            let s = SLAB.lock();
            (s.blocks.len(), s.blocks.values().map(|b| b.count).sum())
        }

        /// A free 64-byte, 64-aligned cell (uninitialised).
        #[cfg(not(loom))]
        pub fn new_cell() -> NonNull<u8> {
            let mut s = SLAB.lock();
            for c in s.chunks.values_mut() {
                let i = match c.free.pop() {
                    Some(i) => i as usize,
                    None if c.bump < c.cells => {
                        c.bump += 1;
                        c.bump - 1
                    }
                    None => continue,
                };
                c.live += 1;
                // SAFETY: `i < cells`: inside the chunk's mapping.
                return unsafe { NonNull::new_unchecked(c.base.as_ptr().add(i * CELL)) };
            }
            // Full: 64 KiB first (1,024 leases), then 2 MiB chunks.
            let size = if s.bytes == 0 { FIRST } else { HUGE };
            let map = if size == HUGE { huge_map(size) } else { None };
            let Some(mut map) = map.or_else(|| Buffer::new(size).ok()) else {
                std::alloc::handle_alloc_error(
                    std::alloc::Layout::from_size_align(size, CELL).expect("layout"),
                );
            };
            let base = NonNull::new(map.as_mut_slice().as_mut_ptr()).expect("mapping at 0");
            s.bytes += size;
            s.chunks.insert(
                base.as_ptr() as usize,
                Chunk {
                    _map: map,
                    base,
                    cells: size / CELL,
                    bump: 1,
                    free: Vec::new(),
                    live: 1,
                },
            );
            base
        }

        /// Give back a cell from [`new_cell`] or of a table block (its contents already
        /// dropped).
        #[cfg(not(loom))]
        pub fn free_cell(p: NonNull<u8>) {
            let addr = p.as_ptr() as usize;
            let mut s = SLAB.lock();
            if let Some(block) = free_in_block(&mut s, addr) {
                drop(s);
                // Unmapped outside the lock.
                drop(block);
                return;
            }
            let gone = {
                let Some((&base, c)) = s.chunks.range_mut(..=addr).next_back() else {
                    panic!("lease cell {addr:#x} not from the slab");
                };
                let i = (addr - base) / CELL;
                assert!(
                    i < c.bump && (addr - base) % CELL == 0,
                    "lease cell not from the slab"
                );
                c.free.push(i as u32);
                c.live -= 1;
                let empty = c.live == 0;
                if empty && s.chunks.values().filter(|c| c.live == 0).count() > 1 {
                    let c = s.chunks.remove(&base);
                    s.bytes -= c.as_ref().map_or(0, |c| c.cells * CELL);
                    c
                } else {
                    None
                }
            };
            drop(s);
            // Unmapped outside the lock.
            drop(gone);
        }

        /// Cells in use and cells mapped.
        #[cfg(test)]
        pub fn cell_count() -> (usize, usize) {
            let s = SLAB.lock();
            (s.chunks.values().map(|c| c.live).sum(), s.bytes / CELL)
        }
    }

    /// A lease moved into a slab cell (a box under loom).
    pub(super) fn new_lease<T: super::Retire>(l: super::Lease<T>) -> NonNull<super::Lease<T>> {
        #[cfg(not(loom))]
        {
            const {
                assert!(
                    size_of::<super::Lease<T>>() <= CELL && align_of::<super::Lease<T>>() <= CELL
                )
            };
            let p = new_cell().cast::<super::Lease<T>>();
            // SAFETY: a free cell, large and aligned enough (checked above), ours alone.
            unsafe { p.as_ptr().write(l) };
            p
        }
        #[cfg(loom)]
        {
            NonNull::from(Box::leak(Box::new(l)))
        }
    }

    /// Drop a lease's entry and give its cell back (to the slab, or to its table's block,
    /// whose thread may then place another lease there).
    ///
    /// # Safety
    ///
    /// `p` came from [`new_lease`] or was placed in a table block, nothing refers to it any
    /// more (but its table, which reads only the cell's own fields) and it is freed once.
    pub(super) unsafe fn free_lease<T: super::Retire>(p: NonNull<super::Lease<T>>) {
        // SAFETY: (caller) initialised and freed once: the entry is dropped once. Only this
        // field: the cell's state and key stay valid for its table, which may be probing.
        unsafe { ManuallyDrop::drop(&mut *std::ptr::addr_of_mut!((*p.as_ptr()).entry)) };
        #[cfg(not(loom))]
        free_cell(p.cast());
        #[cfg(loom)]
        if !slab::free_block_cell(p.cast()) {
            // SAFETY: (caller) not a block's: it came from `Box::leak`, freed once (the
            // remaining fields have no drop glue that matters; the entry is gone already).
            drop(unsafe { Box::from_raw(p.as_ptr()) });
        }
    }
}

#[cfg(all(test, not(loom)))]
pub(super) mod tests {
    use std::sync::Arc;

    use super::mem::{cell_count, Slots, CELL, HUGE};
    use super::{lease, Hold, LeaseSet, Retire};

    /// The slab is process-wide: the tests counting its cells run one at a time, and other
    /// unit tests that make leases (through a cache) take this lock too.
    pub(in crate::cache) static SERIAL: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

    struct Probe {
        leases: LeaseSet<Probe>,
    }

    impl Retire for Probe {
        type Meta = ();
        fn meta(&self) {}
        fn leases(&self) -> &LeaseSet<Probe> {
            &self.leases
        }
        fn retire(&self) {}
    }

    /// `n` entries, each allocated with a 512-byte neighbour (as the cache allocates an
    /// entry, index node and MR state around each lease), and a hold on each.
    fn holds(n: usize) -> (Vec<Hold<Probe>>, Vec<Vec<u8>>) {
        let mut hs = Vec::new();
        let mut noise = Vec::new();
        for _ in 0..n {
            let e = Arc::new(Probe {
                leases: LeaseSet::new(),
            });
            noise.push(vec![1u8; 512]);
            let (h, hold) = lease(&e);
            drop(h);
            hs.push(hold);
        }
        (hs, noise)
    }

    /// Flags of the mapping holding `addr` (`VmFlags` of `/proc/self/smaps`).
    fn vm_flags(addr: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let mut inside = false;
        for l in smaps.lines() {
            if let Some((range, _)) = l.split_once(' ') {
                if let Some((a, b)) = range.split_once('-') {
                    if let (Ok(a), Ok(b)) =
                        (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
                    {
                        inside = a <= addr && addr < b;
                        continue;
                    }
                }
            }
            if inside {
                if let Some(f) = l.strip_prefix("VmFlags:") {
                    return f.to_string();
                }
            }
        }
        String::new()
    }

    fn thp_kernel() -> bool {
        std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists()
    }

    /// Leases of entries created one after the other sit next to each other (the hit's
    /// second access stays within few pages), not between the entries' other allocations.
    #[test]
    fn leases_are_contiguous() {
        let _g = SERIAL.lock();
        let n = 4096;
        let (hs, noise) = holds(n);
        let mut pages: Vec<usize> = hs.iter().map(|h| h.p.as_ptr() as usize >> 12).collect();
        pages.sort_unstable();
        pages.dedup();
        // 64 leases a page: 64 pages when packed; interleaved with the neighbours they
        // would span about 600.
        assert!(
            pages.len() <= n * CELL / 4096 + 16,
            "{} leases over {} pages",
            n,
            pages.len()
        );
        for h in &hs {
            assert_eq!(h.p.as_ptr() as usize % CELL, 0, "lease not line aligned");
        }
        // Past the first 64 KiB chunk leases come from 2 MiB chunks advised for THP.
        let last = hs.last().expect("leases").p.as_ptr() as usize;
        if thp_kernel() {
            assert!(
                vm_flags(last).split_whitespace().any(|f| f == "hg"),
                "lease chunk not advised for huge pages: {}",
                vm_flags(last)
            );
        }
        drop(noise);
        drop(hs);
    }

    /// Freed leases give their cells back; emptied chunks are unmapped but one.
    #[test]
    fn slab_cells_come_back() {
        let _g = SERIAL.lock();
        let (live0, _) = cell_count();
        let (hs, noise) = holds(3 * HUGE / CELL);
        let (live1, mapped1) = cell_count();
        assert_eq!(live1, live0 + hs.len());
        drop(hs);
        drop(noise);
        let (live2, mapped2) = cell_count();
        assert_eq!(live2, live0, "cells leaked");
        assert!(
            mapped2 <= live0 + 2 * HUGE / CELL && mapped2 < mapped1,
            "emptied chunks kept: {mapped2} cells mapped for {live2} leases"
        );
        // Reused: the same number of leases maps nothing new.
        let (hs, noise) = holds(1000);
        assert!(cell_count().1 <= mapped2 + HUGE / CELL);
        drop((hs, noise));
    }

    /// Arrays of 2 MiB and more are mappings of their own advised for THP; smaller ones and
    /// their contents behave like boxed slices.
    #[test]
    fn large_slots_are_mapped_for_thp() {
        let counter = Arc::new(());
        let big: Slots<(u64, Option<Arc<()>>)> =
            Slots::new(HUGE / 16, || (7, Some(counter.clone())));
        assert_eq!(big.len(), HUGE / 16);
        assert_eq!(Arc::strong_count(&counter), 1 + HUGE / 16);
        assert!(big.is_mapped());
        assert_eq!(big.as_ptr() as usize % HUGE, 0);
        if thp_kernel() {
            assert!(vm_flags(big.as_ptr() as usize)
                .split_whitespace()
                .any(|f| f == "hg"));
        }
        let mut small: Slots<(u64, Option<Arc<()>>)> = Slots::new(1000, || (1, None));
        assert!(!small.is_mapped());
        small[999].1 = Some(counter.clone());
        drop(big);
        assert_eq!(
            Arc::strong_count(&counter),
            2,
            "elements of a mapped array dropped"
        );
        drop(small);
        assert_eq!(Arc::strong_count(&counter), 1);
        let empty: Slots<u64> = Slots::default();
        assert!(empty.is_empty());
    }
}
