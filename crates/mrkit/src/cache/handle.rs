//! The handle types a lookup returns: [`RegHandle`] (a counted reference to an entry) and
//! the safe wrappers [`RegOwned`], [`RegRef`], [`RegMut`].

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use mrkit_soft::OwnedMemory;

use super::entry::{Entry, Meta, Piece, REMOTE_RIGHTS};
use super::lease::Handle;
use crate::qp::registered::check_range;
use crate::verbs::{LocalSlice, RemoteSlice};
use crate::{AccessFlags, Errno, Error, Result};

/// A counted reference to a registration. While it lives the MR stays registered (even if
/// its range is invalidated meanwhile: it is then deregistered at the last drop).
///
/// What [`RegCache::get_raw`](super::RegCache::get_raw) returns; the safe paths wrap one in [`RegOwned`], [`RegRef`]
/// or [`RegMut`]. Its [`Registered`](crate::Registered) offsets run over [`range`](Self::range).
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
    pub(super) h: Handle<Entry>,
}

impl RegHandle {
    #[inline]
    pub(super) fn e(&self) -> &Entry {
        self.h.entry()
    }
    /// The registration's range, rights and (one MR) lkey, from the lease's line: what a hit
    /// just read, so no further cache miss (the entry and its pieces are two more).
    #[inline]
    fn meta(&self) -> &Meta {
        self.h.meta()
    }
    /// The MRs, in address order (one unless the range was split).
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let buf = Buffer::new(8192).unwrap();
    /// // Registrations above `max_chunk` are split into several MRs.
    /// let cache = RegCache::new(&pd, CacheConfig { max_chunk: 4096, ..Default::default() }).unwrap();
    /// // SAFETY: `buf` outlives the handle and the cache (declared before them).
    /// let h = unsafe { cache.get_raw(buf.addr(), 8192, A::LOCAL_WRITE) }.unwrap();
    /// let p = h.pieces();
    /// assert_eq!(p.len(), 2);
    /// assert_eq!((p[0].addr, p[0].len, p[1].addr), (buf.addr(), 4096, buf.addr() + 4096));
    /// assert_ne!(p[0].lkey, p[1].lkey);
    /// ```
    pub fn pieces(&self) -> &[Piece] {
        self.e().ready().map(Vec::as_slice).unwrap_or(&[])
    }
    /// Registered range `(start, end)` (may be larger than requested: page rounding,
    /// merging).
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let buf = Buffer::new(4096).unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// // SAFETY: `buf` outlives the handle and the cache (declared before them).
    /// let h = unsafe { cache.get_raw(buf.addr() + 10, 100, A::empty()) }.unwrap();
    /// assert_eq!(h.range(), (buf.addr(), buf.addr() + 4096)); // rounded out to the page
    /// ```
    #[inline]
    pub fn range(&self) -> (u64, u64) {
        (self.meta().start, self.meta().end)
    }
    /// Rights of the registration (a superset of the requested ones).
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let buf = Buffer::new(4096).unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// // SAFETY: `buf` outlives the handles and the cache (declared before them).
    /// let w = unsafe { cache.get_raw(buf.addr(), 4096, A::LOCAL_WRITE) }.unwrap();
    /// // A lookup asking for less is served by the same registration.
    /// let r = unsafe { cache.get_raw(buf.addr(), 4096, A::empty()) }.unwrap();
    /// assert_eq!(r.lkey(), w.lkey());
    /// assert!(r.access().contains(A::LOCAL_WRITE));
    /// ```
    #[inline]
    pub fn access(&self) -> AccessFlags {
        self.meta().access
    }
    /// lkey of the piece holding `addr` (`None` outside the registration).
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let buf = Buffer::new(8192).unwrap();
    /// // Registrations above `max_chunk` are split into several MRs.
    /// let cache = RegCache::new(&pd, CacheConfig { max_chunk: 4096, ..Default::default() }).unwrap();
    /// // SAFETY: `buf` outlives the handle and the cache (declared before them).
    /// let h = unsafe { cache.get_raw(buf.addr(), 8192, A::LOCAL_WRITE) }.unwrap();
    /// assert_eq!(h.lkey_for(buf.addr() + 100), Some(h.lkey()));
    /// assert_eq!(h.lkey_for(buf.addr() + 5000), Some(h.pieces()[1].lkey)); // second MR
    /// assert_eq!(h.lkey_for(buf.addr() + 8192), None);
    /// ```
    #[inline]
    pub fn lkey_for(&self, addr: u64) -> Option<u32> {
        let m = self.meta();
        match m.lkey {
            Some(k) => (m.start <= addr && addr < m.end).then_some(k.get()),
            None => self.piece_for(addr).map(|p| p.lkey),
        }
    }
    /// rkey of the piece holding `addr` (`None` outside the registration).
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let buf = Buffer::new(8192).unwrap();
    /// // Registrations above `max_chunk` are split into several MRs.
    /// let cache = RegCache::new(&pd, CacheConfig { max_chunk: 4096, ..Default::default() }).unwrap();
    /// // SAFETY: `buf` outlives the handle and the cache (declared before them).
    /// let h = unsafe { cache.get_raw(buf.addr(), 8192, A::LOCAL_WRITE | A::REMOTE_READ) }.unwrap();
    /// assert_eq!(h.rkey_for(buf.addr()), Some(h.rkey()));
    /// assert_eq!(h.rkey_for(buf.addr() + 4096), Some(h.pieces()[1].rkey));
    /// assert_eq!(h.rkey_for(buf.addr() - 1), None);
    /// ```
    pub fn rkey_for(&self, addr: u64) -> Option<u32> {
        self.piece_for(addr).map(|p| p.rkey)
    }
    /// The lkey at `addr`, the first byte of a wrapper's own memory, which its lookup checked
    /// is inside the registration: one MR's key from the lease's line with no range check,
    /// else the piece's (0 at the end of the registration: empty memory there).
    #[inline]
    pub(super) fn own_lkey(&self, addr: u64) -> u32 {
        match self.meta().lkey {
            Some(k) => k.get(),
            None => self.piece_for(addr).map_or(0, |p| p.lkey),
        }
    }
    pub(super) fn piece_for(&self, addr: u64) -> Option<&Piece> {
        self.pieces()
            .iter()
            .find(|p| addr >= p.addr && addr - p.addr < p.len)
    }
    /// lkey (first piece; [`lkey_for`](Self::lkey_for) names the piece of an address).
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let buf = Buffer::new(4096).unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// // SAFETY: `buf` outlives the handle and the cache (declared before them).
    /// let h = unsafe { cache.get_raw(buf.addr(), 4096, A::LOCAL_WRITE) }.unwrap();
    /// assert_eq!(h.lkey(), h.pieces()[0].lkey);
    /// assert_eq!(h.sges_at(buf.addr(), 64).unwrap()[0].lkey, h.lkey());
    /// ```
    #[inline]
    pub fn lkey(&self) -> u32 {
        match self.meta().lkey {
            Some(k) => k.get(),
            None => self.pieces().first().map(|p| p.lkey).unwrap_or(0),
        }
    }
    /// rkey (first piece; [`rkey_for`](Self::rkey_for) names the piece of an address).
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let buf = Buffer::new(4096).unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// // SAFETY: `buf` outlives the handle and the cache (declared before them).
    /// let h = unsafe { cache.get_raw(buf.addr(), 4096, A::LOCAL_WRITE | A::REMOTE_WRITE) }.unwrap();
    /// let for_peer = h.remotes_at(buf.addr(), 4096).unwrap()[0];
    /// assert_eq!(for_peer.rkey, h.rkey());
    /// ```
    pub fn rkey(&self) -> u32 {
        self.pieces().first().map(|p| p.rkey).unwrap_or(0)
    }
    /// SGEs covering `[addr, addr+len)` (absolute addresses; split at piece boundaries and at
    /// 4 GiB - 1 per SGE). `None` when the range is not inside the registration. (The
    /// [`Registered::sges`](crate::Registered::sges) of a handle takes offsets from [`range`](Self::range)'s start.)
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let buf = Buffer::new(8192).unwrap();
    /// // Registrations above `max_chunk` are split into several MRs.
    /// let cache = RegCache::new(&pd, CacheConfig { max_chunk: 4096, ..Default::default() }).unwrap();
    /// // SAFETY: `buf` outlives the handle and the cache (declared before them).
    /// let h = unsafe { cache.get_raw(buf.addr(), 8192, A::LOCAL_WRITE) }.unwrap();
    /// let a = buf.addr();
    /// // 200 bytes across the split: one SGE per MR.
    /// let sges = h.sges_at(a + 4000, 200).unwrap();
    /// assert_eq!(sges.len(), 2);
    /// assert_eq!((sges[0].addr, sges[0].len, sges[0].lkey), (a + 4000, 96, h.lkey_for(a).unwrap()));
    /// assert_eq!((sges[1].addr, sges[1].len, sges[1].lkey), (a + 4096, 104, h.lkey_for(a + 4096).unwrap()));
    /// assert!(h.sges_at(a + 8000, 200).is_none()); // runs past the registration
    /// ```
    pub fn sges_at(&self, addr: u64, len: u64) -> Option<Vec<LocalSlice>> {
        let mut out = Vec::new();
        self.local_sges(addr, len, &mut out).then_some(out)
    }
    /// [`sges_at`](Self::sges_at) appended to `out`; false (`out` unchanged) when the range is
    /// not inside the registration. One MR whose key the lease holds: no access to the entry.
    #[inline]
    fn local_sges(&self, addr: u64, len: u64, out: &mut Vec<LocalSlice>) -> bool {
        let Some(lkey) = self.meta().lkey else {
            return self
                .split(addr, len, |a, l, p| LocalSlice {
                    addr: a,
                    len: l as u32,
                    lkey: p.lkey,
                })
                .map(|v| out.extend(v))
                .is_some();
        };
        let Some(end) = self.inside(addr, len) else {
            return false;
        };
        let mut a = addr;
        while a < end {
            let l = sge_len(a, end, end);
            out.push(LocalSlice {
                addr: a,
                len: l as u32,
                lkey: lkey.get(),
            });
            a += l;
        }
        true
    }
    /// Remote descriptors covering `[addr, addr+len)` (absolute addresses), one per MR they
    /// span; `None` when the range is not inside the registration.
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let buf = Buffer::new(8192).unwrap();
    /// // Registrations above `max_chunk` are split into several MRs.
    /// let cache = RegCache::new(&pd, CacheConfig { max_chunk: 4096, ..Default::default() }).unwrap();
    /// // SAFETY: `buf` outlives the handle and the cache (declared before them).
    /// let h = unsafe { cache.get_raw(buf.addr(), 8192, A::LOCAL_WRITE | A::REMOTE_READ) }.unwrap();
    /// let r = h.remotes_at(buf.addr(), 8192).unwrap();
    /// assert_eq!(r.len(), 2); // the peer needs both rkeys
    /// assert_eq!((r[0].len, r[0].rkey), (4096, h.rkey()));
    /// assert_eq!((r[1].addr, r[1].rkey), (buf.addr() + 4096, h.rkey_for(buf.addr() + 4096).unwrap()));
    /// assert!(h.remotes_at(u64::MAX, 2).is_none()); // overflow-safe
    /// ```
    pub fn remotes_at(&self, addr: u64, len: u64) -> Option<Vec<RemoteSlice>> {
        self.split(addr, len, |a, l, p| RemoteSlice {
            addr: a,
            len: l,
            rkey: p.rkey,
        })
    }
    /// The end of `[addr, addr+len)` when the range is inside the registration (overflow-safe;
    /// the lease's range, no access to the entry).
    #[inline]
    fn inside(&self, addr: u64, len: u64) -> Option<u64> {
        let m = self.meta();
        let end = addr.checked_add(len)?;
        (addr >= m.start && end <= m.end).then_some(end)
    }
    pub(super) fn split<T>(
        &self,
        addr: u64,
        len: u64,
        f: impl Fn(u64, u64, &Piece) -> T,
    ) -> Option<Vec<T>> {
        let end = self.inside(addr, len)?;
        let mut out = Vec::new();
        let mut a = addr;
        while a < end {
            let p = self.piece_for(a)?;
            let l = sge_len(a, p.addr + p.len, end);
            out.push(f(a, l, p));
            a += l;
        }
        Some(out)
    }
    /// Whether the registration is still in the cache (false after invalidation/eviction,
    /// or for an uncached registration).
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let buf = Buffer::new(4096).unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// // SAFETY: `buf` outlives the handle and the cache (declared before them).
    /// let h = unsafe { cache.get_raw(buf.addr(), 4096, A::LOCAL_WRITE) }.unwrap();
    /// assert!(h.is_cached());
    /// cache.invalidate(buf.addr(), 4096);
    /// assert!(!h.is_cached()); // still registered until `h` is dropped
    /// assert_eq!(h.sges_at(buf.addr(), 64).unwrap()[0].lkey, h.lkey());
    /// ```
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

/// Bytes of the SGE at `a`: to the end of its MR (`piece_end`) or of the range (`end`),
/// whichever comes first, and at most 4 GiB - 1 (an SGE's length is 32 bits).
#[inline]
fn sge_len(a: u64, piece_end: u64, end: u64) -> u64 {
    (piece_end.min(end) - a).min(u64::from(u32::MAX))
}

// Dropping the `Handle` gives its count back; the last release of a dead entry deregisters
// it (see [`lease`]).

impl RegHandle {
    /// Append the SGEs of `len` bytes at absolute `addr` to `out` (EINVAL, `out` unchanged,
    /// when they are not inside the registration).
    pub(super) fn push_sges(&self, addr: u64, len: u64, out: &mut Vec<LocalSlice>) -> Result<()> {
        if len == 0 || self.local_sges(addr, len, out) {
            Ok(())
        } else {
            Err(Error::new(
                Errno::EINVAL,
                format!("{len} bytes at {addr:#x} are not inside the cached registration"),
            ))
        }
    }
}

/// The error of a borrowed lookup asking for rights a borrow cannot back.
#[cold]
pub(super) fn borrowed_rights_error(access: AccessFlags, what: &str) -> Error {
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

/// A registration over memory the cache co-owns ([`RegCache::get_owned`](super::RegCache::get_owned)). Offsets in
/// [`Registered::sges`](crate::Registered::sges) and [`RegOwned::remote`] run over the range it was asked for.
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
    pub(super) h: RegHandle,
    pub(super) mem: Arc<M>,
    pub(super) addr: u64,
    pub(super) len: u64,
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
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let buf = Arc::new(Buffer::new(4096).unwrap());
    /// let h = cache.get_owned(&buf, 0..4096, A::LOCAL_WRITE | A::REMOTE_READ).unwrap();
    /// assert!(Arc::ptr_eq(h.memory(), &buf));
    /// assert_eq!(Arc::strong_count(&buf), 3); // the caller, the handle, the cached entry
    /// ```
    pub fn memory(&self) -> &Arc<M> {
        &self.mem
    }
    /// lkey of the registration (of its first MR when it was split).
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig, Registered};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let buf = Arc::new(Buffer::new(4096).unwrap());
    /// let h = cache.get_owned(&buf, 0..4096, A::LOCAL_WRITE | A::REMOTE_READ).unwrap();
    /// let mut sges = Vec::new();
    /// h.sges(0..64, &mut sges).unwrap(); // what a work request carries
    /// assert_eq!((sges[0].addr, sges[0].lkey), (buf.addr(), h.lkey()));
    /// ```
    #[inline]
    pub fn lkey(&self) -> u32 {
        self.h.own_lkey(self.addr)
    }
    /// rkey of the registration (of its first MR when it was split).
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let buf = Arc::new(Buffer::new(4096).unwrap());
    /// let h = cache.get_owned(&buf, 0..4096, A::LOCAL_WRITE | A::REMOTE_READ).unwrap();
    /// assert_eq!(h.remote(0..64).unwrap().rkey, h.rkey());
    /// ```
    pub fn rkey(&self) -> u32 {
        self.h.rkey_for(self.addr).unwrap_or(0)
    }
    /// Rights of the registration (a superset of the requested ones).
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let buf = Arc::new(Buffer::new(4096).unwrap());
    /// let h = cache.get_owned(&buf, 0..4096, A::LOCAL_WRITE | A::REMOTE_READ).unwrap();
    /// assert!(h.access().contains(A::LOCAL_WRITE | A::REMOTE_READ));
    /// ```
    pub fn access(&self) -> AccessFlags {
        self.h.access()
    }
    /// What a peer needs to reach `range` (offsets into the memory): `EINVAL` outside it or
    /// when the range spans two MRs (a registration split above `max_chunk`; see
    /// [`remotes`](Self::remotes)).
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let buf = Arc::new(Buffer::new(4096).unwrap());
    /// let h = cache.get_owned(&buf, 0..4096, A::LOCAL_WRITE | A::REMOTE_READ).unwrap();
    /// let value = h.remote(64..128).unwrap(); // send this to the peer that READs it
    /// assert_eq!((value.addr, value.len, value.rkey), (buf.addr() + 64, 64, h.rkey()));
    /// assert_eq!(h.remote(4000..4097).unwrap_err().errno(), mrkit::Errno::EINVAL);
    /// ```
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
    /// Remote descriptors for `range`, one per MR it spans (`EINVAL` outside the memory).
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// // Registrations above `max_chunk` are split into several MRs.
    /// let cache = RegCache::new(&pd, CacheConfig { max_chunk: 4096, ..Default::default() }).unwrap();
    /// let buf = Arc::new(Buffer::new(8192).unwrap());
    /// let h = cache.get_owned(&buf, 0..8192, A::LOCAL_WRITE | A::REMOTE_READ).unwrap();
    /// assert!(h.remote(0..8192).is_err()); // two MRs: one descriptor cannot name both
    /// let r = h.remotes(0..8192).unwrap();
    /// assert_eq!(r.len(), 2);
    /// assert_eq!((r[1].addr, r[1].len), (buf.addr() + 4096, 4096));
    /// assert_ne!(r[0].rkey, r[1].rkey);
    /// ```
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
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let buf = Arc::new(Buffer::new(4096).unwrap());
    /// let h = cache.get_owned(&buf, 0..4096, A::LOCAL_WRITE | A::REMOTE_READ).unwrap();
    /// assert!(h.is_cached());
    /// cache.invalidate(buf.addr(), 4096); // deregistered once `h` is dropped
    /// assert!(!h.is_cached());
    /// drop(h);
    /// assert_eq!(Arc::strong_count(&buf), 1); // the cache let go of the buffer
    /// ```
    pub fn is_cached(&self) -> bool {
        self.h.is_cached()
    }
}

/// A registration of borrowed bytes the device only reads ([`RegCache::get_ref`](super::RegCache::get_ref)).
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
    pub(super) h: RegHandle,
    pub(super) mem: &'a [u8],
}

impl<'a> RegRef<'a> {
    /// lkey of the registration at the first byte (the SGEs of [`Registered::sges`](crate::Registered::sges) carry
    /// the right key for every byte).
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Context, DeviceConfig, Registered};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let msg = b"ping".to_vec();
    /// let h = cache.get_ref(&msg, A::empty()).unwrap();
    /// let mut sges = Vec::new();
    /// h.sges(0..4, &mut sges).unwrap();
    /// assert_eq!((sges[0].addr, sges[0].lkey), (msg.as_ptr() as u64, h.lkey()));
    /// ```
    #[inline]
    pub fn lkey(&self) -> u32 {
        self.h.own_lkey(self.mem.as_ptr() as u64)
    }
    /// The borrowed bytes (for the whole borrow `'a`, not just the handle's life).
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let msg = String::from("hello");
    /// let h = cache.get_ref(msg.as_bytes(), A::empty()).unwrap();
    /// let bytes = h.as_slice();
    /// drop(h);
    /// assert_eq!(bytes, b"hello");
    /// ```
    pub fn as_slice(&self) -> &'a [u8] {
        self.mem
    }
    /// Rights of the registration (a superset of the requested ones; never a remote right,
    /// which a borrow cannot back).
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let msg = b"ping".to_vec();
    /// let h = cache.get_ref(&msg, A::empty()).unwrap();
    /// assert!(!h.access().intersects(A::REMOTE_READ | A::REMOTE_WRITE));
    /// // Asking a borrow for remote rights is refused.
    /// assert_eq!(cache.get_ref(&msg, A::REMOTE_READ).unwrap_err().errno(), mrkit::Errno::EINVAL);
    /// ```
    pub fn access(&self) -> AccessFlags {
        self.h.access()
    }
    /// Whether the registration is still cached (see [`RegHandle::is_cached`]).
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let msg = vec![1u8; 4096];
    /// let h = cache.get_ref(&msg, A::empty()).unwrap();
    /// assert!(h.is_cached());
    /// cache.invalidate(msg.as_ptr() as u64, 4096);
    /// assert!(!h.is_cached());
    /// ```
    pub fn is_cached(&self) -> bool {
        self.h.is_cached()
    }
}

/// A registration of exclusively borrowed bytes the device may write ([`RegCache::get_mut`](super::RegCache::get_mut)).
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
    pub(super) h: RegHandle,
    pub(super) mem: &'a mut [u8],
}

impl RegMut<'_> {
    /// lkey of the registration at the first byte (the SGEs of [`Registered::sges`](crate::Registered::sges) carry
    /// the right key for every byte).
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Context, DeviceConfig, Registered};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let mut block = vec![0u8; 512];
    /// let h = cache.get_mut(&mut block, A::LOCAL_WRITE).unwrap();
    /// let mut sges = Vec::new();
    /// h.sges(0..512, &mut sges).unwrap();
    /// assert_eq!(sges[0].lkey, h.lkey());
    /// ```
    #[inline]
    pub fn lkey(&self) -> u32 {
        self.h.own_lkey(self.mem.as_ptr() as u64)
    }
    /// The borrowed bytes (not while a work request holds the handle: it is moved or
    /// borrowed by it).
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig, QueuePair};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// # let (q1, q2) = (QueuePair::new(&pd, Default::default()).unwrap(), QueuePair::new(&pd, Default::default()).unwrap());
    /// # QueuePair::connect(&q1, &q2, A::REMOTE_READ).unwrap();
    /// # let mut b = Buffer::new(64).unwrap();
    /// # b.as_mut_slice().fill(7);
    /// # let src = pd.register(b, A::REMOTE_READ).unwrap();
    /// let mut block = vec![0u8; 64];
    /// let mut h = cache.get_mut(&mut block, A::LOCAL_WRITE).unwrap();
    /// q1.read(&mut h, 0..64, src.remote(0..64).unwrap()).unwrap(); // RDMA READ into `block`
    /// assert_eq!(h.as_slice(), [7u8; 64]);
    /// ```
    pub fn as_slice(&self) -> &[u8] {
        self.mem
    }
    /// The borrowed bytes, mutably (e.g. to fill a block before posting it).
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let mut block = vec![0u8; 64];
    /// let mut h = cache.get_mut(&mut block, A::LOCAL_WRITE).unwrap();
    /// h.as_mut_slice()[..5].copy_from_slice(b"hello");
    /// drop(h);
    /// assert_eq!(&block[..5], b"hello");
    /// ```
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.mem
    }
    /// Rights of the registration (a superset of the requested ones; never a remote right,
    /// which a borrow cannot back).
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let mut block = vec![0u8; 64];
    /// let h = cache.get_mut(&mut block, A::LOCAL_WRITE).unwrap();
    /// assert!(h.access().contains(A::LOCAL_WRITE));
    /// assert!(!h.access().contains(A::REMOTE_WRITE));
    /// ```
    pub fn access(&self) -> AccessFlags {
        self.h.access()
    }
    /// Whether the registration is still cached (see [`RegHandle::is_cached`]).
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags as A, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let mut block = vec![0u8; 4096];
    /// let addr = block.as_ptr() as u64;
    /// let h = cache.get_mut(&mut block, A::LOCAL_WRITE).unwrap();
    /// assert!(h.is_cached());
    /// cache.invalidate(addr, 4096);
    /// assert!(!h.is_cached());
    /// ```
    pub fn is_cached(&self) -> bool {
        self.h.is_cached()
    }
}
