//! What registration takes: [`UserMemory`], a range of this process's memory together with the
//! guarantee that it outlives its registration.
//!
//! Registering memory lets the device, and every peer holding the rkey, read and write it until
//! the MR is deregistered: long after `reg_mr` returned, at times the borrow checker cannot see.
//! A registration over memory the program then frees (a `Vec` dropped while its MR lives) sends
//! later WRITEs into freed heap memory or onto an unmapped page (SIGSEGV). So registration does
//! not take a bare address: a [`UserMemory`] is made either
//!
//! * safely from an owner the MR keeps alive ([`UserMemory::owned`], [`UserMemory::owned_range`]:
//!   the MR holds an `Arc` of it until deregistration has finished), or
//! * with `unsafe` [`UserMemory::new`], whose caller promises the range outlives every MR over it
//!   (the C ABI's contract for `ibv_reg_mr`; the safe `mrkit` API's `MemoryRegion`, which owns its
//!   buffer and deregisters before freeing it).
//!
//! A zero-length range ([`UserMemory::empty_at`]) is safe to make: no registration accepts it.
//!
//! ```
//! use std::sync::Arc;
//! use mrkit_soft::{AccessFlags, Context, DeviceConfig, UserMemory};
//! let ctx = Context::open(DeviceConfig::default());
//! let pd = ctx.alloc_pd().unwrap();
//! let buf = Arc::new(vec![0u8; 4096]);
//! let mr = ctx.reg_mr_va(pd, UserMemory::owned(buf), AccessFlags::LOCAL_WRITE).unwrap();
//! // `buf` is gone here, but its memory lives on inside the MR until this returns:
//! ctx.dereg_mr(mr.lkey).unwrap();
//! ```
//!
//! Registering a bare address from safe code does not compile:
//!
//! ```compile_fail
//! # use mrkit_soft::{AccessFlags, Context, DeviceConfig};
//! let ctx = Context::open(DeviceConfig::default());
//! let pd = ctx.alloc_pd().unwrap();
//! let v = vec![0u8; 4096];
//! let mr = ctx.reg_mr_va(pd, v.as_ptr() as u64, 4096, AccessFlags::LOCAL_WRITE).unwrap();
//! drop(v); // the MR would outlive the memory
//! ```
//!
//! ```compile_fail,E0133
//! # use mrkit_soft::{AccessFlags, Context, DeviceConfig, UserMemory};
//! let ctx = Context::open(DeviceConfig::default());
//! let pd = ctx.alloc_pd().unwrap();
//! let v = vec![0u8; 4096];
//! let mem = UserMemory::new(v.as_ptr() as u64, 4096); // needs `unsafe`
//! ```

use std::any::Any;
use std::sync::Arc;

/// What an MR keeps alive until it is deregistered.
pub(crate) type Owner = Arc<dyn Any + Send + Sync>;

/// Memory that stays at a fixed address for as long as the value lives, so that an MR holding
/// the value (in an `Arc`) can never outlive it.
///
/// # Safety
///
/// An implementor guarantees that, for the whole life of a value, [`OwnedMemory::range`] returns
/// the same `(addr, len)` and `[addr, addr + len)` stays mapped (writable, unless only ever
/// registered without write access) and is not freed, unmapped or reused for anything else.
/// Registered memory is written by the device and by peers at any time its access flags allow:
/// the implementor must not hand out `&mut` access reachable through a shared reference.
pub unsafe trait OwnedMemory: Send + Sync + 'static {
    /// Start address and length in bytes.
    fn range(&self) -> (u64, u64);
}

// SAFETY: through `&Vec<u8>` (all an `Arc` gives) the vector cannot grow, shrink or be freed,
// so its heap buffer stays where it is, `len` bytes long, until the vector is dropped; no `&mut`
// to the bytes is reachable. (Reading the bytes through `&` while a peer writes them races, as
// with any registered memory: read after the completion that says the write landed.)
unsafe impl OwnedMemory for Vec<u8> {
    fn range(&self) -> (u64, u64) {
        (self.as_ptr() as u64, self.len() as u64)
    }
}

// SAFETY: as for `Vec<u8>`: a boxed slice behind `&` never moves, resizes or frees.
unsafe impl OwnedMemory for Box<[u8]> {
    fn range(&self) -> (u64, u64) {
        (self.as_ptr() as u64, self.len() as u64)
    }
}

/// A range of this process's memory offered to registration (see the module docs).
#[derive(Clone)]
pub struct UserMemory {
    addr: u64,
    len: u64,
    owner: Option<Owner>,
}

impl std::fmt::Debug for UserMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserMemory")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("owned", &self.owner.is_some())
            .finish()
    }
}

impl UserMemory {
    /// `[addr, addr + len)` of this process, kept valid by the caller.
    ///
    /// # Safety
    ///
    /// Until every MR registered over this range (through this value or a clone) has been
    /// deregistered (`dereg_mr` returned `Ok`, a translation-changing `rereg_mr` replaced it,
    /// or the device instance was dropped), the range must stay mapped, writable if registered
    /// with a write access, and must not be freed, unmapped or reused for other data: the
    /// device, and any peer holding the rkey, may read and write it at any time. Implicit ODP
    /// (`addr` 0, `len` `u64::MAX`) offers the whole address space under the same terms.
    pub unsafe fn new(addr: u64, len: u64) -> UserMemory {
        UserMemory {
            addr,
            len,
            owner: None,
        }
    }

    /// Zero bytes at `addr` (every registration refuses a zero length with EINVAL; a
    /// `rereg_mr` without CHANGE_TRANSLATION ignores its range).
    pub fn empty_at(addr: u64) -> UserMemory {
        UserMemory {
            addr,
            len: 0,
            owner: None,
        }
    }

    /// All of `mem`; an MR registered over it keeps `mem` alive until it is deregistered.
    pub fn owned<M: OwnedMemory>(mem: Arc<M>) -> UserMemory {
        let (addr, len) = mem.range();
        UserMemory {
            addr,
            len,
            owner: Some(mem),
        }
    }

    /// `len` bytes at `offset` of `mem` (`None` if that is not inside it); an MR registered
    /// over it keeps `mem` alive until it is deregistered.
    pub fn owned_range<M: OwnedMemory>(mem: Arc<M>, offset: u64, len: u64) -> Option<UserMemory> {
        let (base, size) = mem.range();
        if !crate::mr::range_ok(base, size, base.checked_add(offset)?, len) {
            return None;
        }
        Some(UserMemory {
            addr: base + offset,
            len,
            owner: Some(mem),
        })
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn into_owner(self) -> Option<Owner> {
        self.owner
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Page(Box<[u8]>);
    // SAFETY: the boxed slice never moves or changes length while the value lives, and no
    // `&mut` to it is reachable through `&Page`.
    unsafe impl OwnedMemory for Page {
        fn range(&self) -> (u64, u64) {
            (self.0.as_ptr() as u64, self.0.len() as u64)
        }
    }

    #[test]
    fn owned_ranges_are_bounds_checked() {
        let p = Arc::new(Page(vec![0u8; 4096].into_boxed_slice()));
        let base = p.0.as_ptr() as u64;
        let m = UserMemory::owned_range(p.clone(), 4000, 96).unwrap();
        assert_eq!((m.addr(), m.len()), (base + 4000, 96));
        assert!(UserMemory::owned_range(p.clone(), 4000, 97).is_none());
        assert!(UserMemory::owned_range(p.clone(), u64::MAX, 1).is_none());
        assert_eq!(UserMemory::owned(p).len(), 4096);
        assert!(UserMemory::empty_at(base).is_empty());
    }

    /// The MR keeps an owned buffer alive after the program dropped its handle, and releases
    /// it once deregistered; a translation-changing rereg releases the old one.
    #[test]
    fn mr_keeps_its_owner_until_deregistered() {
        use crate::{AccessFlags, Context, DeviceConfig, ReregFlags};
        let ctx = Context::open(DeviceConfig::default());
        let pd = ctx.alloc_pd().unwrap();
        let buf = Arc::new(vec![7u8; 8192]);
        let weak = Arc::downgrade(&buf);
        let mr = ctx
            .reg_mr_va(pd, UserMemory::owned(buf), AccessFlags::LOCAL_WRITE)
            .unwrap();
        assert!(ctx.mr_object(mr.lkey).unwrap().owns_memory());
        assert!(weak.upgrade().is_some(), "alive while registered");
        // Access changes keep it; a new translation releases it.
        ctx.rereg_mr(
            mr.lkey,
            ReregFlags::CHANGE_ACCESS,
            0,
            UserMemory::empty_at(0),
            0,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        )
        .unwrap();
        assert!(weak.upgrade().is_some());
        let other = Arc::new(vec![0u8; 4096]);
        let weak2 = Arc::downgrade(&other);
        let range = UserMemory::owned(other);
        let iova = range.addr();
        let mr2 = ctx
            .rereg_mr(
                mr.lkey,
                ReregFlags::CHANGE_TRANSLATION,
                0,
                range,
                iova,
                AccessFlags::empty(),
            )
            .unwrap();
        assert!(
            weak.upgrade().is_none(),
            "released with the old translation"
        );
        assert!(weak2.upgrade().is_some());
        ctx.dereg_mr(mr2.lkey).unwrap();
        assert!(weak2.upgrade().is_none(), "released by dereg");
        ctx.dealloc_pd(pd).unwrap();
    }
}
