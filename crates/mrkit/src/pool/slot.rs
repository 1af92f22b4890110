//! The pool's slots: [`Slot`] (borrowed from a handle) and [`OwnedSlot`] (`'static`), their
//! shared API, and the release protocol that returns a slot to its thread's magazine.

use std::ops::Range;
use std::sync::Arc;

use super::life::{bump, Life};
use super::ptr::{self, PoolPtr};
use super::{PoolInner, MAGAZINES};
use crate::qp::registered::{DeviceWritable, Registered};
use crate::verbs::{LocalSlice, RemoteSlice};
use crate::{AccessFlags, Result};

/// Put slot `idx` back on the calling thread's magazine and count it free. The pool is reached
/// through `pool` only until the count is stored: after it the pool may be gone (see
/// [`life`]), and the protocol continues on memory the magazine holds.
#[inline(always)]
pub(super) fn release(pool: PoolPtr, idx: u32) {
    let closing = MAGAZINES.try_with(|m| {
        let mut m = m.borrow_mut();
        let mag = {
            // SAFETY: slot `idx` is live until `bump` below counts it free, so the pool is.
            let p = unsafe { pool.get() };
            let mag = p.magazine_in(&mut m);
            if mag.slots.len() >= p.magazine {
                p.spill(mag);
            }
            mag
        };
        mag.slots.push(idx);
        bump(&mag.cell.frees);
        if mag.life.closing_after_free(&mag.cell) {
            Some(mag.life.clone())
        } else {
            None
        }
    });
    match closing {
        Ok(None) => {}
        // The pool is closing: maybe that was its last slot.
        Ok(Some(life)) => settle(&life),
        Err(_) => release_without_tls(pool, idx),
    }
}

/// After a free seen closing: the last slot of a closed pool frees its memory now, outside
/// any borrow of the pool.
#[cold]
#[inline(never)]
pub(super) fn settle(life: &Life<Arc<PoolInner>>) {
    drop(life.settle());
}

/// Thread-local storage destroyed (a free from a TLS destructor): the shared stack and the
/// shared count.
#[cold]
#[inline(never)]
pub(super) fn release_without_tls(pool: PoolPtr, idx: u32) {
    let life = {
        // SAFETY: slot `idx` is live until it is counted free below, so the pool is.
        let p = unsafe { pool.get() };
        p.free.push(idx);
        p.life.clone()
    };
    drop(life.count_free_shared());
}

/// What both kinds of slot carry.
#[derive(Debug)]
pub(super) struct Core {
    pub(super) idx: u32,
    pub(super) lkey: u32,
    pub(super) addr: u64,
    /// The rkey of the slot's window while it is exposed (the window is in
    /// `PoolInner::windows`).
    pub(super) window: Option<u32>,
}

/// The methods `Slot` and `OwnedSlot` share, with their docs and examples (`$alloc` is the
/// `MrPool` method that makes one).
macro_rules! slot_api {
    ($ty:ty, $alloc:literal) => {
        impl $ty {
            #[doc = "Slot index in the pool."]
            #[doc = ""]
            #[doc = "```"]
            #[doc = "# let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());"]
            #[doc = "# let pd = ctx.alloc_pd().unwrap();"]
            #[doc = "let pool = mrkit::pool::MrPool::new(&pd, mrkit::pool::PoolConfig { chunk_size: 1 << 20, ..Default::default() }).unwrap();"]
            #[doc = concat!("let (a, b) = (pool.", $alloc, "().unwrap(), pool.", $alloc, "().unwrap());")]
            #[doc = "assert_ne!(a.index(), b.index());"]
            #[doc = "```"]
            pub fn index(&self) -> u32 {
                self.core.idx
            }

            #[doc = "Address of the first byte (also its iova: chunks are registered with iova = address)."]
            #[doc = ""]
            #[doc = "```"]
            #[doc = "# let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());"]
            #[doc = "# let pd = ctx.alloc_pd().unwrap();"]
            #[doc = "let pool = mrkit::pool::MrPool::new(&pd, mrkit::pool::PoolConfig { chunk_size: 1 << 20, ..Default::default() }).unwrap();"]
            #[doc = concat!("let s = pool.", $alloc, "().unwrap();")]
            #[doc = "assert_eq!(s.addr(), s.as_slice().as_ptr() as u64);"]
            #[doc = "assert_eq!(s.addr() % 4096, 0);"]
            #[doc = "```"]
            pub fn addr(&self) -> u64 {
                self.core.addr
            }

            #[doc = "Bytes in the slot (the pool's slot size)."]
            #[doc = ""]
            #[doc = "```"]
            #[doc = "# let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());"]
            #[doc = "# let pd = ctx.alloc_pd().unwrap();"]
            #[doc = "let pool = mrkit::pool::MrPool::new(&pd, mrkit::pool::PoolConfig { chunk_size: 1 << 20, ..Default::default() }).unwrap();"]
            #[doc = concat!("assert_eq!(pool.", $alloc, "().unwrap().len(), 4096);")]
            #[doc = "```"]
            #[allow(clippy::len_without_is_empty)]
            pub fn len(&self) -> usize {
                self.pool().slot_size as usize
            }

            #[doc = "lkey of the chunk MR (what an SGE over the slot carries)."]
            #[doc = ""]
            #[doc = "```"]
            #[doc = "# let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());"]
            #[doc = "# let pd = ctx.alloc_pd().unwrap();"]
            #[doc = "let pool = mrkit::pool::MrPool::new(&pd, mrkit::pool::PoolConfig { chunk_size: 1 << 20, ..Default::default() }).unwrap();"]
            #[doc = concat!("let s = pool.", $alloc, "().unwrap();")]
            #[doc = "assert_eq!(s.lkey(), pool.chunks()[0].1);"]
            #[doc = "```"]
            pub fn lkey(&self) -> u32 {
                self.core.lkey
            }

            #[doc = "Chunk number."]
            #[doc = ""]
            #[doc = "```"]
            #[doc = "# let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());"]
            #[doc = "# let pd = ctx.alloc_pd().unwrap();"]
            #[doc = "let pool = mrkit::pool::MrPool::new(&pd, mrkit::pool::PoolConfig { chunk_size: 1 << 20, ..Default::default() }).unwrap();"]
            #[doc = concat!("assert_eq!(pool.", $alloc, "().unwrap().chunk(), 0);")]
            #[doc = "```"]
            pub fn chunk(&self) -> u32 {
                self.core.idx >> self.pool().spc_shift
            }

            #[doc = "Offset of the slot inside its chunk MR."]
            #[doc = ""]
            #[doc = "```"]
            #[doc = "# let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());"]
            #[doc = "# let pd = ctx.alloc_pd().unwrap();"]
            #[doc = "let pool = mrkit::pool::MrPool::new(&pd, mrkit::pool::PoolConfig { chunk_size: 1 << 20, ..Default::default() }).unwrap();"]
            #[doc = concat!("let s = pool.", $alloc, "().unwrap();")]
            #[doc = "assert_eq!(s.addr(), pool.chunks()[s.chunk() as usize].0 + s.offset());"]
            #[doc = "```"]
            pub fn offset(&self) -> u64 {
                let p = self.pool();
                u64::from(self.core.idx & (p.slots_per_chunk - 1)) * u64::from(p.slot_size)
            }

            #[doc = "A local SGE over `range` (offsets into the slot); EINVAL when the range is reversed or leaves the slot."]
            #[doc = ""]
            #[doc = "```"]
            #[doc = "# let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());"]
            #[doc = "# let pd = ctx.alloc_pd().unwrap();"]
            #[doc = "let pool = mrkit::pool::MrPool::new(&pd, mrkit::pool::PoolConfig { chunk_size: 1 << 20, ..Default::default() }).unwrap();"]
            #[doc = concat!("let s = pool.", $alloc, "().unwrap();")]
            #[doc = "let l = s.local(100..200).unwrap();"]
            #[doc = "assert_eq!((l.addr, l.len, l.lkey), (s.addr() + 100, 100, s.lkey()));"]
            #[doc = "assert_eq!(s.local(0..4097).unwrap_err().errno(), mrkit::Errno::EINVAL);"]
            #[doc = "```"]
            pub fn local(&self, range: Range<u64>) -> Result<LocalSlice> {
                self.pool().local(&self.core, range)
            }

            #[doc = "A local SGE over the whole slot."]
            #[doc = ""]
            #[doc = "```"]
            #[doc = "# let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());"]
            #[doc = "# let pd = ctx.alloc_pd().unwrap();"]
            #[doc = "let pool = mrkit::pool::MrPool::new(&pd, mrkit::pool::PoolConfig { chunk_size: 1 << 20, ..Default::default() }).unwrap();"]
            #[doc = concat!("let s = pool.", $alloc, "().unwrap();")]
            #[doc = "assert_eq!(s.local_all(), s.local(0..4096).unwrap());"]
            #[doc = "```"]
            pub fn local_all(&self) -> LocalSlice {
                LocalSlice {
                    addr: self.core.addr,
                    len: self.pool().slot_size,
                    lkey: self.core.lkey,
                }
            }

            #[doc = "What a peer needs to reach `range` of this slot (offsets into the slot): the exposure's rkey while the slot is exposed ([`Slot::expose`]), else the chunk's rkey when the chunks have remote rights ([`PoolConfig::access`](super::PoolConfig::access)). EINVAL when the range leaves the slot or the slot has no remote rights."]
            #[doc = ""]
            #[doc = "```"]
            #[doc = "use mrkit::AccessFlags as A;"]
            #[doc = "# let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());"]
            #[doc = "# let pd = ctx.alloc_pd().unwrap();"]
            #[doc = "let cfg = mrkit::pool::PoolConfig { chunk_size: 1 << 20, remote: A::REMOTE_READ, ..Default::default() };"]
            #[doc = "let pool = mrkit::pool::MrPool::new(&pd, cfg).unwrap();"]
            #[doc = concat!("let mut s = pool.", $alloc, "().unwrap();")]
            #[doc = "assert!(s.remote(0..8).is_err()); // not exposed"]
            #[doc = "let whole = s.expose(A::REMOTE_READ).unwrap();"]
            #[doc = "let part = s.remote(8..16).unwrap();"]
            #[doc = "assert_eq!((part.addr, part.len, part.rkey), (whole.addr + 8, 8, whole.rkey));"]
            #[doc = "```"]
            pub fn remote(&self, range: Range<u64>) -> Result<RemoteSlice> {
                self.pool().remote(&self.core, range)
            }

            #[doc = "Make this slot reachable by peers with `access` (remote rights that [`PoolConfig::remote`](super::PoolConfig::remote) allows), through a memory window bound over exactly this slot: the returned descriptor's rkey reaches no other byte of the chunk. A previous exposure of the slot ends first. The exposure ends with [`Slot::unexpose`] or when the slot is freed; its rkey then stops working (a peer using it gets `REM_ACCESS_ERR`). EINVAL for rights the pool does not allow; the errno of `ibv_alloc_mw` (ENOMEM at `max_mw`) or of the bind otherwise."]
            #[doc = ""]
            #[doc = "```"]
            #[doc = "use mrkit::AccessFlags as A;"]
            #[doc = "# let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());"]
            #[doc = "# let pd = ctx.alloc_pd().unwrap();"]
            #[doc = "let cfg = mrkit::pool::PoolConfig { chunk_size: 1 << 20, remote: A::REMOTE_WRITE, ..Default::default() };"]
            #[doc = "let pool = mrkit::pool::MrPool::new(&pd, cfg).unwrap();"]
            #[doc = concat!("let mut s = pool.", $alloc, "().unwrap();")]
            #[doc = "let r = s.expose(A::REMOTE_WRITE).unwrap(); // send `r` to the peer"]
            #[doc = "assert_eq!((r.addr, r.len), (s.addr(), 4096));"]
            #[doc = "assert_ne!(r.rkey, pool.chunks()[0].2);"]
            #[doc = "assert!(s.is_exposed());"]
            #[doc = "// Rights the pool does not allow:"]
            #[doc = "assert_eq!(s.expose(A::REMOTE_READ).unwrap_err().errno(), mrkit::Errno::EINVAL);"]
            #[doc = "```"]
            pub fn expose(&mut self, access: AccessFlags) -> Result<RemoteSlice> {
                let pool = self.pool_ptr();
                // SAFETY: `self` is a live slot of the pool for this call.
                unsafe { pool.get() }.expose(&mut self.core, access)
            }

            #[doc = "End the slot's exposure: its rkey stops working (the window is deallocated). Nothing happens when the slot is not exposed."]
            #[doc = ""]
            #[doc = "```"]
            #[doc = "use mrkit::AccessFlags as A;"]
            #[doc = "# let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());"]
            #[doc = "# let pd = ctx.alloc_pd().unwrap();"]
            #[doc = "let cfg = mrkit::pool::PoolConfig { chunk_size: 1 << 20, remote: A::REMOTE_READ, ..Default::default() };"]
            #[doc = "let pool = mrkit::pool::MrPool::new(&pd, cfg).unwrap();"]
            #[doc = concat!("let mut s = pool.", $alloc, "().unwrap();")]
            #[doc = "s.expose(A::REMOTE_READ).unwrap();"]
            #[doc = "s.unexpose();"]
            #[doc = "assert!(!s.is_exposed() && s.remote(0..8).is_err());"]
            #[doc = "```"]
            pub fn unexpose(&mut self) {
                let pool = self.pool_ptr();
                // SAFETY: `self` is a live slot of the pool for this call.
                unsafe { pool.get() }.unexpose(&mut self.core)
            }

            #[doc = "Whether the slot is exposed (see [`Slot::expose`])."]
            #[doc = ""]
            #[doc = "```"]
            #[doc = "# let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());"]
            #[doc = "# let pd = ctx.alloc_pd().unwrap();"]
            #[doc = "let pool = mrkit::pool::MrPool::new(&pd, mrkit::pool::PoolConfig { chunk_size: 1 << 20, ..Default::default() }).unwrap();"]
            #[doc = concat!("assert!(!pool.", $alloc, "().unwrap().is_exposed());")]
            #[doc = "```"]
            pub fn is_exposed(&self) -> bool {
                self.core.window.is_some()
            }

            #[doc = "The slot's bytes."]
            #[doc = ""]
            #[doc = "```"]
            #[doc = "# let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());"]
            #[doc = "# let pd = ctx.alloc_pd().unwrap();"]
            #[doc = "let pool = mrkit::pool::MrPool::new(&pd, mrkit::pool::PoolConfig { chunk_size: 1 << 20, ..Default::default() }).unwrap();"]
            #[doc = concat!("let s = pool.", $alloc, "().unwrap();")]
            #[doc = "assert_eq!(s.as_slice().len(), 4096);"]
            #[doc = "```"]
            pub fn as_slice(&self) -> &[u8] {
                // SAFETY: the slot is live while `self` is (the pool with it), its index is
                // owned by `self` alone (on no free list, in no other slot value), and `&self`
                // excludes a `&mut` from `as_mut_slice` for the borrow.
                unsafe { ptr::bytes(self.core.addr, self.pool().slot_size as usize) }
            }

            #[doc = "The slot's bytes, mutably (no work request can hold the slot while `&mut` is held)."]
            #[doc = ""]
            #[doc = "```"]
            #[doc = "# let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());"]
            #[doc = "# let pd = ctx.alloc_pd().unwrap();"]
            #[doc = "let pool = mrkit::pool::MrPool::new(&pd, mrkit::pool::PoolConfig { chunk_size: 1 << 20, ..Default::default() }).unwrap();"]
            #[doc = concat!("let mut s = pool.", $alloc, "().unwrap();")]
            #[doc = "s.as_mut_slice()[..5].copy_from_slice(b\"hello\");"]
            #[doc = "assert_eq!(&s.as_slice()[..5], b\"hello\");"]
            #[doc = "```"]
            pub fn as_mut_slice(&mut self) -> &mut [u8] {
                let len = self.pool().slot_size as usize;
                // SAFETY: as in `as_slice`; `&mut self` makes the access exclusive.
                unsafe { ptr::bytes_mut(self.core.addr, len) }
            }
        }

        // SAFETY: `sges` gives slices inside the slot (checked by `local`) with the chunk MR's
        // lkey; the chunk stays registered and mapped while the slot lives (a `Slot` borrows a
        // pool handle; an `OwnedSlot` keeps the pool through the lifetime protocol); the slot
        // index is owned by this value alone until it is dropped, so nothing else can reuse
        // the memory while a work request holds the value.
        unsafe impl Registered for $ty {
            fn len(&self) -> u64 {
                u64::from(self.pool().slot_size)
            }
            fn sges(&self, range: Range<u64>, out: &mut Vec<LocalSlice>) -> Result<()> {
                out.push(self.local(range)?);
                Ok(())
            }
        }

        // SAFETY: owned: no other reference to the slot's bytes exists while a work request
        // holds the value (CPU access needs the value itself).
        unsafe impl DeviceWritable for $ty {}
    };
}

/// A slot borrowed from an [`MrPool`](crate::pool::MrPool) handle: read and write its bytes, build SGEs, post it
/// by value through a [`QueuePair`](crate::QueuePair) (which hands it back with the
/// completion), expose it to a peer. Dropping it returns it to the pool.
///
/// ```
/// # use mrkit::pool::{MrPool, PoolConfig};
/// # let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());
/// # let pd = ctx.alloc_pd().unwrap();
/// let pool = MrPool::new(&pd, PoolConfig { chunk_size: 1 << 20, ..PoolConfig::default() }).unwrap();
/// let s = pool.alloc().unwrap();
/// assert_eq!(pool.stats().in_use, 1);
/// drop(s);
/// assert_eq!(pool.stats().in_use, 0);
/// ```
///
/// It cannot outlive the handle it was borrowed from:
///
/// ```compile_fail
/// # use mrkit::pool::{MrPool, PoolConfig};
/// # let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());
/// # let pd = ctx.alloc_pd().unwrap();
/// let pool = MrPool::new(&pd, PoolConfig { chunk_size: 1 << 20, ..PoolConfig::default() }).unwrap();
/// let s = pool.alloc().unwrap();
/// drop(pool); // error: `pool` is borrowed by `s`
/// s.as_slice();
/// ```
#[derive(Debug)]
pub struct Slot<'p> {
    pub(super) pool: &'p PoolInner,
    pub(super) core: Core,
}

impl Slot<'_> {
    fn pool(&self) -> &PoolInner {
        self.pool
    }
    fn pool_ptr(&self) -> PoolPtr {
        PoolPtr::new(self.pool)
    }
}

impl Drop for Slot<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        // The exposure ends before the slot can be handed out again.
        if self.core.window.is_some() {
            self.pool.unexpose(&mut self.core);
        }
        release(PoolPtr::new(self.pool), self.core.idx);
    }
}

slot_api!(Slot<'_>, "alloc");

/// A slot that may outlive every [`MrPool`](crate::pool::MrPool) handle (see [`MrPool::alloc_owned`](crate::pool::MrPool::alloc_owned)): the same
/// operations as [`Slot`], `'static`, `Send` and `Sync`. Dropping it frees the slot; the last
/// slot of a pool whose handles are gone frees the pool.
///
/// ```
/// # use mrkit::pool::{MrPool, PoolConfig, OwnedSlot};
/// # let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());
/// # let pd = ctx.alloc_pd().unwrap();
/// struct Message { buf: OwnedSlot }
/// let pool = MrPool::new(&pd, PoolConfig { chunk_size: 1 << 20, ..PoolConfig::default() }).unwrap();
/// let m = Message { buf: pool.alloc_owned().unwrap() };
/// drop(pool);
/// assert_eq!(m.buf.len(), 4096);
/// ```
#[derive(Debug)]
pub struct OwnedSlot {
    pub(super) pool: PoolPtr,
    pub(super) core: Core,
}

impl OwnedSlot {
    fn pool(&self) -> &PoolInner {
        // SAFETY: `self` is a live slot of the pool for the borrow of `self`.
        unsafe { self.pool.get() }
    }
    fn pool_ptr(&self) -> PoolPtr {
        self.pool
    }
}

impl Drop for OwnedSlot {
    #[inline(always)]
    fn drop(&mut self) {
        // The exposure ends before the slot can be handed out again.
        if self.core.window.is_some() {
            // SAFETY: the slot is live until `release` below.
            unsafe { self.pool.get() }.unexpose(&mut self.core);
        }
        release(self.pool, self.core.idx);
    }
}

slot_api!(OwnedSlot, "alloc_owned");
