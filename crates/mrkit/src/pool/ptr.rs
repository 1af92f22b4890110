//! The pool's unsafe corner: an owned slot's pointer to its pool, and the slot bytes.

use std::ptr::NonNull;

use super::PoolInner;

/// An owned slot's reference to its pool: no reference count (see [`super::life`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct PoolPtr(NonNull<PoolInner>);

// SAFETY: `PoolInner` is `Sync` (its shared state is atomics, mutexes and once-cells), and the
// pointer is dereferenced only under `get`'s contract, from any thread.
unsafe impl Send for PoolPtr {}
// SAFETY: as above; the pointer itself is never written through.
unsafe impl Sync for PoolPtr {}

impl PoolPtr {
    /// Point at `p`.
    pub(super) fn new(p: &PoolInner) -> PoolPtr {
        PoolPtr(NonNull::from(p))
    }

    /// The pool.
    ///
    /// # Safety
    /// A slot of this pool must be live (allocated and not yet counted free) for all of `'a`:
    /// the lifetime protocol keeps the pool until the last slot is counted free.
    pub(super) unsafe fn get<'a>(self) -> &'a PoolInner {
        // SAFETY: our caller's contract keeps the `PoolInner` alive (and never mutably
        // borrowed: it is only ever shared) for `'a`.
        unsafe { self.0.as_ref() }
    }
}

/// The `len` bytes of a slot at `addr`.
///
/// # Safety
/// `[addr, addr + len)` must be a slot of a pool that stays alive for `'a`, owned by the caller
/// (no other slot value has its index) and not mutably borrowed for `'a`.
pub(super) unsafe fn bytes<'a>(addr: u64, len: usize) -> &'a [u8] {
    // SAFETY: the slot lies inside a chunk mapping the pool keeps for `'a` (our contract).
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
}

/// The `len` bytes of a slot at `addr`, mutably.
///
/// # Safety
/// As [`bytes`], and no other reference to those bytes exists for `'a`.
pub(super) unsafe fn bytes_mut<'a>(addr: u64, len: usize) -> &'a mut [u8] {
    // SAFETY: as in `bytes`; exclusivity is our contract.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
}
