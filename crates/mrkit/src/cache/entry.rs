//! A cached registration ([`Entry`]): its pieces, its life (placeholder, ready, dead,
//! retired) and what keeps it alive.

use std::any::Any;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use super::lease::{LeaseSet, Retire};
use super::Shared;
use crate::AccessFlags;

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

/// A registration. Its memory is the `Arc` (index, leases, waiters); its MR is deregistered
/// by [`Entry::retire`] when it is dead and unused (or, at the latest, in `Drop`).
#[derive(Debug)]
pub(super) struct Entry {
    /// Invalidated, evicted or superseded: never handed out again. Set under the index
    /// write lock (with the lease set's kill, which hits check).
    pub(super) dead: AtomicBool,
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) access: AccessFlags,
    pub(super) id: u64,
    /// Page-rounded span (what the monitor attaches).
    pub(super) span: (u64, u64),
    /// Set once at publication.
    pub(super) pieces: OnceLock<Vec<Piece>>,
    /// Registration failed (waiters retry).
    pub(super) failed: AtomicBool,
    /// Keys to deregister at drop.
    pub(super) regs: Mutex<Vec<u32>>,
    /// In the index (false: uncached, private to its handles).
    pub(super) cached: AtomicBool,
    /// Attached to the monitor.
    pub(super) monitored: AtomicBool,
    /// Milliseconds (cache clock) when first seen idle.
    pub(super) idle_since: AtomicU64,
    pub(super) wait_mx: Mutex<()>,
    pub(super) wait_cv: Condvar,
    pub(super) shared: Arc<Shared>,
    /// The per-thread leases handles are counted on (see [`lease`]).
    pub(super) leases: LeaseSet<Entry>,
    /// The monitor attach has been released (once, by [`Entry::retire`]; keys are taken
    /// and deregistered at every call).
    pub(super) retired: AtomicBool,
    /// What keeps the memory alive while remote rights over it exist (owned path with remote
    /// rights; such entries never merge, so there is at most one): released by
    /// [`Entry::retire`] once the keys are deregistered.
    pub(super) owner: Mutex<Option<Owner>>,
    /// May be merged with neighbours (false for owned entries: their range is the owner's).
    pub(super) mergeable: bool,
}

/// What an owned registration keeps alive.
pub(super) type Owner = Arc<dyn Any + Send + Sync>;

/// An owned request with remote rights: the owner the entry keeps, and the bytes it owns (the
/// registration never reaches past them).
pub(super) struct OwnerRange {
    pub(super) owner: Owner,
    pub(super) start: u64,
    pub(super) end: u64,
}

/// Rights that let something other than a handle's work request reach the memory: a peer
/// holding the rkey (READ, WRITE, atomics, flushes) or a memory window bound to the MR.
pub(super) const REMOTE_RIGHTS: AccessFlags = AccessFlags::REMOTE
    .union(AccessFlags::MW_BIND)
    .union(AccessFlags::FLUSH_GLOBAL)
    .union(AccessFlags::FLUSH_PERSISTENT);

/// What a hit checks, `(start, end, access)`, and what a handle's user reads next: the lkey
/// when one MR covers the whole range (`None` for a split registration, one not published
/// yet when the lease was made, or an lkey of 0: those read the entry's pieces). Copied into
/// every lease, so that a hit and the key it is for are one cache line: through the entry
/// they were two more dependent misses (the entry, then its pieces), ~100 ns per lookup at
/// 65,536 buffers, measured.
#[derive(Debug, Clone, Copy)]
pub(super) struct Meta {
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) access: AccessFlags,
    pub(super) lkey: Option<NonZeroU32>,
}

impl Meta {
    #[inline]
    pub(super) fn covers(&self, addr: u64, end: u64, access: AccessFlags) -> bool {
        self.start <= addr && end <= self.end && self.access.contains(access)
    }
}

impl Retire for Entry {
    type Meta = Meta;
    fn meta(&self) -> Meta {
        // Pieces are set once, at publication, and never change: a key copied here stays the
        // entry's for the lease's whole life.
        let lkey = match self.ready().map(Vec::as_slice) {
            Some([p]) if p.addr == self.start && p.addr.checked_add(p.len) == Some(self.end) => {
                NonZeroU32::new(p.lkey)
            }
            _ => None,
        };
        Meta {
            start: self.start,
            end: self.end,
            access: self.access,
            lkey,
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
    pub(super) fn ready(&self) -> Option<&Vec<Piece>> {
        self.pieces.get()
    }

    pub(super) fn wake(&self) {
        let _g = self.wait_mx.lock();
        self.wait_cv.notify_all();
    }

    /// Wait for publication, failure or death.
    pub(super) fn wait(&self) {
        let mut g = self.wait_mx.lock();
        while self.pieces.get().is_none()
            && !self.failed.load(Ordering::Acquire)
            && !self.dead.load(Ordering::Acquire)
        {
            self.wait_cv.wait_for(&mut g, Duration::from_millis(5));
        }
    }

    pub(super) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Handles alive (sum over the leases).
    pub(super) fn users(&self) -> u64 {
        self.leases.users()
    }

    /// Idle: no handle (callers hold the index lock).
    pub(super) fn idle_in_index(&self) -> bool {
        self.users() == 0
    }

    /// Mark dead (callers hold the index write lock or own the entry): no handle can be
    /// taken any more. Returns the handles alive. Follow with
    /// [`try_retire`](Self::try_retire) once the lock is released.
    pub(super) fn kill(&self) -> u64 {
        self.cached.store(false, Ordering::Release);
        self.dead.store(true, Ordering::Release);
        self.leases.kill()
    }

    /// Deregister now if the entry is dead and has no user. Safe to call any number of times
    /// from any thread (see [`lease`]).
    pub(super) fn try_retire(&self) {
        LeaseSet::try_retire(self);
    }

    /// Deregister the MR and detach the monitor, exactly once.
    pub(super) fn retire(&self) {
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
pub(super) fn retire_all(v: Vec<Arc<Entry>>) {
    // One barrier for all the kills (see `lease`), then each entry's count is exact.
    LeaseSet::fence_all(v.iter().map(|x| &x.leases));
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
