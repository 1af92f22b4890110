//! The cache's `unsafe` surface, in one place: the entry points whose callers make promises
//! (`get_raw`, `get_or_bounce_raw`, `MonitorMode::explicit_only`), the one pinning call that
//! relies on them ([`RegCache::register_pieces`]), and the `Registered` / `DeviceWritable`
//! impls of the cache's handle types.

use std::ops::Range;
use std::sync::atomic::Ordering;

use mrkit_soft::OwnedMemory;

use super::bounce::{BounceBuffer, Registration};
use super::config::{ExplicitInvalidation, MonitorMode};
use super::entry::Piece;
use super::handle::{RegHandle, RegMut, RegOwned, RegRef};
use super::RegCache;
use crate::qp::registered::{check_range, DeviceWritable, Registered};
use crate::verbs::LocalSlice;
use crate::{AccessFlags, Result};

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

impl RegCache {
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
    /// with [`Shape::Merge`](super::Shape::Merge) the neighbouring raw registrations of the same kind (rights are
    /// the union), with [`Shape::WholeAllocation`](super::Shape::WholeAllocation) the whole mapping (with local rights
    /// only: a request with remote rights gets the pages around its bytes); [`RegHandle::range`]
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
        self.get_local(addr, len, access)
    }

    /// Like [`get_raw`](Self::get_raw), but when the memory cannot be registered (device
    /// limits after eviction) and a bounce pool is configured ([`CacheConfig::bounce`](super::CacheConfig::bounce)),
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
        self.get_or_bounce(addr, len, access)
    }

    pub(super) fn register_pieces(
        &self,
        s: u64,
        e: u64,
        access: AccessFlags,
    ) -> Result<Vec<Piece>> {
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
