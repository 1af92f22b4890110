//! The safe lookups: owned ([`RegCache::get_owned`]) and borrowed ([`RegCache::get_ref`],
//! [`RegCache::get_mut`]) memory, each a per-thread hit or the miss path.

use std::ops::Range;
use std::sync::Arc;

use mrkit_soft::OwnedMemory;

use super::entry::{OwnerRange, REMOTE_RIGHTS};
use super::handle::{borrowed_rights_error, RegHandle, RegMut, RegOwned, RegRef};
use super::RegCache;
use crate::qp::registered::check_range;
use crate::{AccessFlags, Result};

impl RegCache {
    /// A registration of `range` (offsets into `mem`) over memory the cache then
    /// **co-owns**: the handle, and with remote rights the cached entry too, keep `mem` alive,
    /// so the rkey stays sound for as long as a peer can use it (until the entry is
    /// invalidated, evicted or idle-released, and its last handle is dropped). With remote
    /// rights the registration covers at most `mem`'s own bytes. `EINVAL` for a range outside
    /// `mem` or empty.
    ///
    /// Use this path for memory peers read or write (any of `REMOTE_READ`, `REMOTE_WRITE`,
    /// `REMOTE_ATOMIC`, `MW_BIND`, the flush rights). While an entry with remote rights holds
    /// `mem`, `Arc::get_mut` on it fails: peers may write it at any time, so the process gets
    /// no `&mut` to it until [`invalidate`](Self::invalidate) (or eviction) has deregistered
    /// the entry. With local rights only, the entry keeps nothing and `mem` is the caller's
    /// again once the handle is dropped.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use mrkit::cache::{CacheConfig, RegCache};
    /// use mrkit::{AccessFlags, Buffer, Context};
    /// let pd = Context::open_default().unwrap().alloc_pd().unwrap();
    /// let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let io = Arc::new(Buffer::new(64 << 10).unwrap());
    /// let all = 0..io.len() as u64;
    /// let acc = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    /// let h = cache.get_owned(&io, all.clone(), acc).unwrap();
    /// let for_peer = h.remote(0..4096).unwrap(); // hand this to the peer
    /// drop(h);
    /// // The entry keeps the buffer (and the rkey) alive; the next lookup is a hit.
    /// assert_eq!(cache.get_owned(&io, all, acc).unwrap().rkey(), for_peer.rkey);
    /// assert_eq!(Arc::strong_count(&io), 2);
    /// cache.invalidate(io.addr(), io.len() as u64);
    /// assert_eq!(Arc::strong_count(&io), 1); // deregistered: the buffer is ours alone again
    /// ```
    #[inline]
    pub fn get_owned<M: OwnedMemory>(
        &self,
        mem: &Arc<M>,
        range: Range<u64>,
        access: AccessFlags,
    ) -> Result<RegOwned<M>> {
        let (base, size) = mem.range();
        let (off, len) = check_range(&range, size, "owned memory")?;
        let addr = base + off;
        let h = match self.fast_hit(addr, len, access) {
            Some(h) => h,
            None => {
                let own = access.intersects(REMOTE_RIGHTS).then(|| OwnerRange {
                    owner: mem.clone(),
                    start: base,
                    end: base + size,
                });
                self.get_slow(addr, len, access, false, own.as_ref())
                    .map_err(|(e, _)| e)?
            }
        };
        Ok(RegOwned {
            h,
            mem: mem.clone(),
            addr,
            len,
        })
    }

    /// A registration of borrowed bytes the device only **reads** (SEND, RDMA WRITE source):
    /// the handle borrows `mem` for `'a`. `access` may hold no write and no remote right:
    /// `EINVAL` otherwise (see [`get_mut`](Self::get_mut) and [`get_owned`](Self::get_owned)).
    ///
    /// ```
    /// use mrkit::cache::{CacheConfig, RegCache};
    /// use mrkit::{AccessFlags, Context, Registered};
    /// let pd = Context::open_default().unwrap().alloc_pd().unwrap();
    /// let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let msg = String::from("hello");
    /// let h = cache.get_ref(msg.as_bytes(), AccessFlags::empty()).unwrap();
    /// let mut sges = Vec::new();
    /// h.sges(0..5, &mut sges).unwrap(); // what a SEND of "hello" posts
    /// assert_eq!((sges[0].addr, sges[0].len), (msg.as_ptr() as u64, 5));
    /// ```
    ///
    /// Remote rights on borrowed memory are refused: the cached registration (and the rkey a
    /// peer holds) would outlive the borrow.
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags, Context, Errno};
    /// # let pd = Context::open_default().unwrap().alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let s = String::from("immutable");
    /// let err = cache.get_ref(s.as_bytes(), AccessFlags::REMOTE_WRITE).unwrap_err();
    /// assert_eq!(err.errno(), Errno::EINVAL);
    /// ```
    #[inline(always)]
    pub fn get_ref<'a>(&self, mem: &'a [u8], access: AccessFlags) -> Result<RegRef<'a>> {
        if access.is_writable() || access.intersects(REMOTE_RIGHTS) {
            return Err(borrowed_rights_error(access, "get_ref (a shared borrow)"));
        }
        let h = self.get_slice(mem, access)?;
        Ok(RegRef { h, mem })
    }

    /// A registration of borrowed bytes the device may **write** (RDMA READ destination,
    /// receive buffer, atomic result; also readable): the handle borrows `mem` exclusively for
    /// `'a`. Ask for `LOCAL_WRITE` where the device writes (an MR without it completes such
    /// a work request with a local protection error, as on hardware). Remote rights are
    /// refused with `EINVAL`: use [`get_owned`](Self::get_owned).
    ///
    /// ```
    /// use mrkit::cache::{CacheConfig, RegCache};
    /// use mrkit::{AccessFlags, Context, DeviceWritable};
    /// let pd = Context::open_default().unwrap().alloc_pd().unwrap();
    /// let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let mut block = vec![0u8; 4096];
    /// for _ in 0..3 {
    ///     let mut h = cache.get_mut(&mut block, AccessFlags::LOCAL_WRITE).unwrap();
    ///     fn post_read_into(_dst: impl DeviceWritable) {}
    ///     h.as_mut_slice()[0] += 1; // the CPU may write too, between work requests
    ///     post_read_into(&mut h);
    /// } // each handle drop ends the borrow; the registration stays cached
    /// assert_eq!(block[0], 3);
    /// assert_eq!(cache.stats().misses, 1);
    /// ```
    ///
    /// A handle cannot outlive the memory it borrows:
    ///
    /// ```compile_fail,E0505
    /// # use mrkit::cache::{CacheConfig, RegCache};
    /// # use mrkit::{AccessFlags, Buffer, Context};
    /// # let pd = Context::open_default().unwrap().alloc_pd().unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
    /// let mut buf = Buffer::new(4096).unwrap();
    /// let h = cache.get_mut(buf.as_mut_slice(), AccessFlags::LOCAL_WRITE).unwrap();
    /// drop(buf); // error: `buf` is still borrowed by `h`
    /// let _keep = h;
    /// ```
    #[inline(always)]
    pub fn get_mut<'a>(&self, mem: &'a mut [u8], access: AccessFlags) -> Result<RegMut<'a>> {
        if access.intersects(REMOTE_RIGHTS) {
            return Err(borrowed_rights_error(access, "get_mut (a borrow)"));
        }
        let h = self.get_slice(mem, access)?;
        Ok(RegMut { h, mem })
    }

    /// A lookup of `addr..addr + len` (an unchecked address: an end that overflows goes to
    /// the slow path, which refuses it).
    #[inline(always)]
    pub(super) fn get_local(&self, addr: u64, len: u64, access: AccessFlags) -> Result<RegHandle> {
        match addr.checked_add(len) {
            Some(end) => self.get_span(addr, end, access),
            None => self
                .get_slow(addr, len, access, false, None)
                .map_err(|(e, _)| e),
        }
    }

    /// A lookup of a slice's bytes. Its end needs no overflow check: a slice lies in one
    /// allocation, whose one-past-the-end address does not wrap (`as_ptr_range`).
    #[inline(always)]
    fn get_slice(&self, mem: &[u8], access: AccessFlags) -> Result<RegHandle> {
        let span = mem.as_ptr_range();
        self.get_span(span.start as u64, span.end as u64, access)
    }

    /// A lookup of `addr..end`, `end` computed without overflow: the per-thread hit
    /// ([`fast_hit_to`](Self::fast_hit_to)), else the slow path.
    #[inline(always)]
    fn get_span(&self, addr: u64, end: u64, access: AccessFlags) -> Result<RegHandle> {
        if let Some(h) = self.fast_hit_to(addr, end, access) {
            return Ok(h);
        }
        self.get_slow(addr, end - addr, access, false, None)
            .map_err(|(e, _)| e)
    }
}
