//! The bounce fallback: pool slots to copy through when memory cannot be registered
//! (device limits after eviction), for [`RegCache::get_or_bounce_raw`].

use super::handle::RegHandle;
use super::stats::inc;
use super::RegCache;
use crate::pool::OwnedSlot;
use crate::{AccessFlags, Result};

/// A registration or, when registration was impossible, a bounce buffer from the pool.
///
/// ```
/// use mrkit::cache::{CacheConfig, RegCache, Registration};
/// use mrkit::pool::{MrPool, PoolConfig};
/// use mrkit::{AccessFlags, Context, DeviceConfig, Registered};
/// // A device with room for two MRs: one for the bounce pool, one for the cache.
/// let ctx = Context::open(DeviceConfig::rxe().max_mr(2));
/// let pd = ctx.alloc_pd().unwrap();
/// let pool = MrPool::new(&pd, PoolConfig { chunk_size: 64 << 10, max_chunks: 1, thp: false, ..PoolConfig::default() }).unwrap();
/// let cache = RegCache::new(&pd, CacheConfig { bounce: Some(pool), ..Default::default() }).unwrap();
/// let (a, b) = (vec![1u8; 4096], vec![2u8; 4096]);
/// // SAFETY (both lookups): the vectors outlive the handles; local rights only.
/// let ha = unsafe { cache.get_or_bounce_raw(a.as_ptr() as u64, 4096, AccessFlags::empty()) }.unwrap();
/// assert!(matches!(ha, Registration::Mr(_)));
/// // `a`'s registration is in use: `b` cannot be registered, it is bounced.
/// let hb = unsafe { cache.get_or_bounce_raw(b.as_ptr() as u64, 4096, AccessFlags::empty()) }.unwrap();
/// let Registration::Bounce(mut bb) = hb else { panic!("expected a bounce buffer") };
/// bb.copy_in(&b); // then post `bb` in place of `b`
/// assert_eq!(Registered::len(&bb), 4096);
/// let mut back = vec![0u8; 4096];
/// bb.copy_out(&mut back);
/// assert_eq!(back, b);
/// ```
#[derive(Debug)]
pub enum Registration {
    /// The memory itself is registered.
    Mr(RegHandle),
    /// Copy through these pool slots instead.
    Bounce(BounceBuffer),
}

/// Pool slots standing in for memory that could not be registered.
/// [`BounceBuffer::copy_in`] before a work request that reads it,
/// [`BounceBuffer::copy_out`] after one that wrote it (example at [`Registration`]).
#[derive(Debug)]
pub struct BounceBuffer {
    pub(super) slots: Vec<OwnedSlot>,
    pub(super) len: u64,
}

impl BounceBuffer {
    /// Bytes covered: the length the lookup asked for (the slots behind it may hold more).
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, Registration, RegCache};
    /// # use mrkit::pool::{MrPool, PoolConfig};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe().max_mr(2)).alloc_pd().unwrap();
    /// # let pool = MrPool::new(&pd, PoolConfig { chunk_size: 64 << 10, max_chunks: 1, thp: false, ..PoolConfig::default() }).unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig { bounce: Some(pool), ..Default::default() }).unwrap();
    /// # let _last_mr = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap(); // the device is full
    /// let msg = b"hello".to_vec();
    /// // SAFETY: `msg` outlives the bounce buffer; local rights only.
    /// let r = unsafe { cache.get_or_bounce_raw(msg.as_ptr() as u64, 5, A::empty()) }.unwrap();
    /// let Registration::Bounce(bb) = r else { panic!("the device has no MR left") };
    /// assert_eq!(bb.len(), 5);
    /// ```
    pub fn len(&self) -> u64 {
        self.len
    }
    /// True when empty.
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, Registration, RegCache};
    /// # use mrkit::pool::{MrPool, PoolConfig};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe().max_mr(2)).alloc_pd().unwrap();
    /// # let pool = MrPool::new(&pd, PoolConfig { chunk_size: 64 << 10, max_chunks: 1, thp: false, ..PoolConfig::default() }).unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig { bounce: Some(pool), ..Default::default() }).unwrap();
    /// # let _last_mr = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap(); // the device is full
    /// let msg = b"hello".to_vec();
    /// // SAFETY: `msg` outlives the bounce buffer; local rights only.
    /// let r = unsafe { cache.get_or_bounce_raw(msg.as_ptr() as u64, 5, A::empty()) }.unwrap();
    /// let Registration::Bounce(bb) = r else { panic!("the device has no MR left") };
    /// assert!(!bb.is_empty());
    /// ```
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Copy `src` into the bounce slots (before a send/write). Bytes past the slots'
    /// capacity (at least [`len`](Self::len)) are not copied.
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, Registration, RegCache};
    /// # use mrkit::pool::{MrPool, PoolConfig};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe().max_mr(2)).alloc_pd().unwrap();
    /// # let pool = MrPool::new(&pd, PoolConfig { chunk_size: 64 << 10, max_chunks: 1, thp: false, ..PoolConfig::default() }).unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig { bounce: Some(pool), ..Default::default() }).unwrap();
    /// # let _last_mr = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap(); // the device is full
    /// let msg = b"hello".to_vec();
    /// // SAFETY: `msg` outlives the bounce buffer; local rights only.
    /// let r = unsafe { cache.get_or_bounce_raw(msg.as_ptr() as u64, 5, A::empty()) }.unwrap();
    /// let Registration::Bounce(mut bb) = r else { panic!("the device has no MR left") };
    /// bb.copy_in(&msg); // then post `bb` where `msg` would have gone
    /// let mut sent = [0u8; 5];
    /// bb.copy_out(&mut sent);
    /// assert_eq!(&sent, b"hello");
    /// ```
    pub fn copy_in(&mut self, src: &[u8]) {
        let mut off = 0;
        for s in &mut self.slots {
            let n = (src.len() - off).min(s.as_slice().len());
            s.as_mut_slice()[..n].copy_from_slice(&src[off..off + n]);
            off += n;
        }
    }
    /// Copy the bounce slots out to `dst` (after a receive/read). Copies
    /// `dst.len()` bytes, at most the slots' capacity (at least [`len`](Self::len)).
    ///
    /// ```
    /// # use mrkit::cache::{CacheConfig, Registration, RegCache};
    /// # use mrkit::pool::{MrPool, PoolConfig};
    /// # use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig};
    /// # let pd = Context::open(DeviceConfig::rxe().max_mr(2)).alloc_pd().unwrap();
    /// # let pool = MrPool::new(&pd, PoolConfig { chunk_size: 64 << 10, max_chunks: 1, thp: false, ..PoolConfig::default() }).unwrap();
    /// # let cache = RegCache::new(&pd, CacheConfig { bounce: Some(pool), ..Default::default() }).unwrap();
    /// # let _last_mr = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap(); // the device is full
    /// let msg = b"hello".to_vec();
    /// // SAFETY: `msg` outlives the bounce buffer; local rights only.
    /// let r = unsafe { cache.get_or_bounce_raw(msg.as_ptr() as u64, 5, A::empty()) }.unwrap();
    /// let Registration::Bounce(mut bb) = r else { panic!("the device has no MR left") };
    /// # bb.copy_in(&msg); // stands in for an RDMA READ or a receive into `bb`
    /// let mut landed = vec![0u8; 5];
    /// bb.copy_out(&mut landed);
    /// assert_eq!(landed, msg);
    /// ```
    pub fn copy_out(&self, dst: &mut [u8]) {
        let mut off = 0;
        for s in &self.slots {
            let n = (dst.len() - off).min(s.as_slice().len());
            dst[off..off + n].copy_from_slice(&s.as_slice()[..n]);
            off += n;
        }
    }
}

impl RegCache {
    /// [`RegCache::get_or_bounce_raw`]'s work: a registration, else (after a device limit,
    /// with a bounce pool configured) pool slots covering `len` bytes.
    pub(super) fn get_or_bounce(
        &self,
        addr: u64,
        len: u64,
        access: AccessFlags,
    ) -> Result<Registration> {
        if let Some(h) = self.fast_hit(addr, len, access) {
            return Ok(Registration::Mr(h));
        }
        match self.get_slow(addr, len, access, false, None) {
            Ok(h) => Ok(Registration::Mr(h)),
            Err((e, device_limit)) => {
                let Some(pool) = self.inner.cfg.bounce.as_ref().filter(|_| device_limit) else {
                    return Err(e);
                };
                let n = len.div_ceil(pool.slot_size() as u64);
                let mut slots = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    slots.push(pool.alloc_owned()?);
                }
                inc(&self.inner.shared.c.fallback_bounce);
                Ok(Registration::Bounce(BounceBuffer { slots, len }))
            }
        }
    }
}
