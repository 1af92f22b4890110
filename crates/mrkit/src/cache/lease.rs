//! Leases: the reference accounting of the cache's hit path (its lock-free core).
//!
//! A cached entry's *registration* may be released (deregistered) only once the entry is
//! dead (invalidated, evicted, superseded, cache dropped) and no handle on it exists. A
//! shared reference count would make every hit write one cache line that every thread
//! writes; instead each thread takes its handles through its own **lease** on the entry: a
//! 64-byte, 64-aligned block holding one word `n` that only handles of that lease write.
//!
//! `n` packs three things: the number of handles taken through the lease (low 32 bits), the
//! number of holds (the per-thread table's references, bits 32..62) and the `DEAD` bit (the
//! entry was killed). Every step of the protocol is a read-modify-write of that one word, so the
//! steps of a hit and of a kill are totally ordered without fences:
//!
//! * **hit** ([`Hold::get`]): miss at once if `DEAD` is already visible (a plain load; the
//!   bit is never cleared); else `fetch_add(1)`, and if the old value has `DEAD`, back out
//!   (a release) and miss. Otherwise the handle counts *before* the kill's `fetch_or`,
//!   which therefore sees it.
//! * **kill** ([`LeaseSet::kill`], under the entry's lease-list mutex): mark the set dead
//!   (leases created later are born `DEAD`), `fetch_or(DEAD)` on every lease, sum the
//!   handles.
//! * **release** (handle drop): while `DEAD` is clear, a compare-exchange `n -> n - 1`
//!   (nothing else to do: the killer, which comes later in `n`'s order, sees the decrement).
//!   With `DEAD` set: keep the entry alive (an `Arc` clone, dead entries only), decrement,
//!   then [`LeaseSet::try_retire`].
//! * **try_retire**: under the mutex, if the set is dead and every lease counts 0 handles,
//!   retire (the owner's [`Retire::retire`], which must be idempotent). A hit racing in
//!   after the read sees `DEAD` and backs out through its own `try_retire`.
//!
//! A lease is freed by whoever brings `n` (handles and hold, ignoring `DEAD`) to zero, like
//! an `Arc`; it is unlinked from the entry's list under the mutex first, so the killer and
//! `try_retire` (which read `n` under the mutex) never read freed memory. A lease keeps its
//! entry's memory (an `Arc`) alive, never its registration.
//!
//! Hit and release of a live entry write only the lease's line, which belongs to one thread
//! (a handle dropped on another thread writes it once). Model-checked, as written here, by
//! `tests/loom_cache.rs` (atomics and mutex come from the cache's sync shim, loom's under
//! `--cfg loom`).

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use super::sync::{AtomicBool, AtomicU64, Mutex, Ordering};

/// The entry was killed (set once, never cleared).
const DEAD: u64 = 1 << 63;
/// One hold of the per-thread table (bits 32..62 count them).
const HOLD: u64 = 1 << 32;
/// Handles taken through the lease (bits 0..32).
const HANDLES: u64 = HOLD - 1;

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
    n: AtomicU64,
    /// CLOCK bit: set by a handle drop when clear.
    touched: AtomicBool,
    meta: T::Meta,
    entry: Arc<T>,
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
    /// Some lease freed since the last [`LeaseSet::take_touched`] had its CLOCK bit set.
    touched: bool,
    leases: Vec<Ptr<T>>,
}

/// An entry's leases and its dead flag, under one mutex (cold paths only).
pub struct LeaseSet<T: Retire> {
    st: Mutex<State<T>>,
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
        LeaseSet {
            st: Mutex::new(State {
                dead: false,
                touched: false,
                leases: Vec::new(),
            }),
        }
    }

    /// Kill: no handle can be taken any more (hits back out). Returns the handles alive at
    /// the kill. Follow with [`try_retire`](Self::try_retire) (outside other locks).
    pub fn kill(&self) -> u64 {
        let mut st = self.st.lock();
        st.dead = true;
        st.leases
            .iter()
            // SAFETY: linked leases are alive while we hold the mutex (see `free`).
            .map(|p| unsafe { p.0.as_ref() }.n.fetch_or(DEAD, Ordering::AcqRel) & HANDLES)
            .sum()
    }

    /// Whether [`kill`](Self::kill) ran.
    pub fn is_dead(&self) -> bool {
        self.st.lock().dead
    }

    /// Handles alive now (sum over the leases).
    pub fn users(&self) -> u64 {
        Self::sum(&self.st.lock())
    }

    fn sum(st: &State<T>) -> u64 {
        st.leases
            .iter()
            // SAFETY: linked leases are alive while the mutex is held (see `free`).
            .map(|p| unsafe { p.0.as_ref() }.n.load(Ordering::Acquire) & HANDLES)
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
            let st = entry.leases().st.lock();
            st.dead && Self::sum(&st) == 0
        };
        if unused {
            entry.retire();
        }
    }
}

/// A new lease on `entry` with one handle, held by the returned [`Hold`] (the per-thread
/// table's reference). Born dead when the entry's set is dead (the handle is then private
/// to its holder and the registration is retired at its last release).
pub fn lease<T: Retire>(entry: &Arc<T>) -> (Handle<T>, Hold<T>) {
    let p = NonNull::from(Box::leak(Box::new(Lease {
        n: AtomicU64::new(1 | HOLD),
        touched: AtomicBool::new(false),
        meta: entry.meta(),
        entry: entry.clone(),
    })));
    {
        let mut st = entry.leases().st.lock();
        if st.dead {
            // SAFETY: the lease is not shared yet; it is alive (just allocated).
            unsafe { p.as_ref() }.n.fetch_or(DEAD, Ordering::Relaxed);
        }
        st.leases.push(Ptr(p));
    }
    (Handle { p }, Hold { p })
}

/// Free a lease whose count (handles and hold) reached zero.
///
/// # Safety
///
/// `p` came from [`lease`] and the caller's read-modify-write brought its handles and hold
/// to zero: no `Handle` or `Hold` refers to it any more, only the entry's list.
unsafe fn free<T: Retire>(p: NonNull<Lease<T>>) {
    {
        // SAFETY: alive until the Box below; others reach it only through the list, under
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
    // SAFETY: unlinked, and no handle or hold is left: we own it. It came from Box::leak.
    drop(unsafe { Box::from_raw(p.as_ptr()) });
}

/// Release one handle of a dead lease (the caller owns one count on `p`).
fn release_dead<T: Retire>(p: NonNull<Lease<T>>) {
    // SAFETY: the caller's count keeps the lease alive until the fetch_sub.
    let l = unsafe { p.as_ref() };
    // The entry outlives the lease, which another releaser may free after our decrement.
    let e = l.entry.clone();
    let old = l.n.fetch_sub(1, Ordering::AcqRel);
    if (old - 1) & !DEAD == 0 {
        // SAFETY: our decrement brought handles and hold to zero.
        unsafe { free(p) };
    }
    LeaseSet::try_retire(&*e);
}

/// One handle: one count on a lease. While it lives the entry's registration stays.
pub struct Handle<T: Retire> {
    p: NonNull<Lease<T>>,
}

// SAFETY: the lease is shared through atomics only, and `T: Send + Sync`.
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
}

impl<T: Retire> Clone for Handle<T> {
    fn clone(&self) -> Self {
        // A live handle keeps the count above 0 throughout; the new count is ordered with a
        // kill like any other (it is seen, or the entry is dead and stays registered until
        // this handle's release).
        let old = self.lease().n.fetch_add(1, Ordering::Relaxed);
        assert!(old & HANDLES < HANDLES - 1, "lease handle count overflow");
        Handle { p: self.p }
    }
}

impl<T: Retire> Drop for Handle<T> {
    #[inline]
    fn drop(&mut self) {
        let l = self.lease();
        // CLOCK bit: written only when clear (once per scan period).
        if !l.touched.load(Ordering::Relaxed) {
            l.touched.store(true, Ordering::Relaxed);
        }
        let mut cur = l.n.load(Ordering::Relaxed);
        while cur & DEAD == 0 {
            // AcqRel: the handle's uses happen before a later retire (which reads `n` with
            // Acquire) and, when this brings `n` to zero, before the free.
            match l
                .n
                .compare_exchange_weak(cur, cur - 1, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => {
                    if cur - 1 == 0 {
                        // SAFETY: our decrement brought handles and hold to zero.
                        unsafe { free(self.p) };
                    }
                    return;
                }
                Err(v) => cur = v,
            }
        }
        release_dead(self.p);
    }
}

/// The per-thread table's reference on a lease: hits take handles through it.
pub struct Hold<T: Retire> {
    p: NonNull<Lease<T>>,
}

// SAFETY: as for `Handle`.
unsafe impl<T: Retire> Send for Hold<T> {}
// SAFETY: as for `Handle`.
unsafe impl<T: Retire> Sync for Hold<T> {}

impl<T: Retire> Hold<T> {
    #[inline]
    fn lease(&self) -> &Lease<T> {
        // SAFETY: this hold's count keeps the lease alive until it drops.
        unsafe { self.p.as_ref() }
    }

    /// A hit: a handle, or `None` when the entry is dead.
    #[inline]
    pub fn get(&self) -> Option<Handle<T>> {
        let n = &self.lease().n;
        // Already dead: miss without writing (the bit is never cleared).
        if n.load(Ordering::Relaxed) & DEAD != 0 {
            return None;
        }
        // AcqRel: ordered with the kill's fetch_or on the same word (one of the two sees
        // the other).
        let old = n.fetch_add(1, Ordering::AcqRel);
        if old & DEAD != 0 {
            release_dead(self.p);
            return None;
        }
        Some(Handle { p: self.p })
    }

    /// Whether both hold the same lease.
    pub fn same(&self, other: &Hold<T>) -> bool {
        self.p == other.p
    }

    /// Whether the entry was killed.
    pub fn is_dead(&self) -> bool {
        self.lease().n.load(Ordering::Relaxed) & DEAD != 0
    }

    /// The entry.
    pub fn entry(&self) -> &T {
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
        let old = self.lease().n.fetch_add(HOLD, Ordering::Relaxed);
        assert!(old & !DEAD < !DEAD - HOLD, "lease hold count overflow");
        Hold { p: self.p }
    }
}

impl<T: Retire> Drop for Hold<T> {
    fn drop(&mut self) {
        let old = self.lease().n.fetch_sub(HOLD, Ordering::AcqRel);
        if (old - HOLD) & !DEAD == 0 {
            // SAFETY: our decrement brought handles and hold to zero.
            unsafe { free(self.p) };
        }
    }
}
