//! mrkit extensions of the drop-in library, declared in `include/mrkit/mrkit_ext.h`:
//! `mrkit_query_mr` (an `ibv_query_mr`-style query rdma-core does not have).

use std::os::raw::c_int;

use crate::abi::ibv_mr;

/// `struct mrkit_mr_attr` of `mrkit_ext.h` (160 bytes).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MrkitMrAttr {
    /// Registered virtual address.
    pub addr: u64,
    /// Bytes.
    pub length: u64,
    /// First address of the MR's address space.
    pub iova: u64,
    /// Local key.
    pub lkey: u32,
    /// Remote key.
    pub rkey: u32,
    /// `enum ibv_access_flags`.
    pub access: u32,
    /// Device PD handle.
    pub pd_handle: u32,
    /// Largest page size backing the MR.
    pub page_size: u64,
    /// Translation entries.
    pub page_count: u64,
    /// Bytes pinned (0 on demand).
    pub pinned_bytes: u64,
    /// 0 pinned, 1 ODP, 2 implicit ODP.
    pub kind: u32,
    /// Memory windows bound now.
    pub bound_mws: u32,
    /// Time since registration.
    pub age_ns: u64,
    /// Registration time.
    pub reg_total_ns: u64,
    /// Checks and memory-lock accounting.
    pub reg_accounting_ns: u64,
    /// Pinning.
    pub reg_pin_ns: u64,
    /// Page walk.
    pub reg_walk_ns: u64,
    /// DONTFORK and translation entries.
    pub reg_translation_ns: u64,
    /// Key and publication.
    pub reg_key_ns: u64,
    /// Zero.
    pub reserved: [u64; 4],
}

/// `int mrkit_query_mr(struct ibv_mr *mr, struct mrkit_mr_attr *attr)`: 0, or EINVAL (NULL
/// argument, not a live MR of this library, key unknown to its device), ENODEV (its context
/// was closed). The errno value is returned and also stored in `errno`.
///
/// # Safety
/// `mr` must be NULL or an MR returned by this library (a freed one is refused; one freed
/// concurrently by another thread is not allowed, as for every verb); `attr` must be NULL
/// or point to writable memory for one `struct mrkit_mr_attr`.
pub(crate) unsafe extern "C" fn mrkit_query_mr(mr: *mut ibv_mr, attr: *mut MrkitMrAttr) -> c_int {
    let fail = |e: c_int| {
        crate::ffi::set_errno(e);
        e
    };
    if mr.is_null() || attr.is_null() || !crate::obj::is_live(mr) {
        return fail(libc::EINVAL);
    }
    // SAFETY: `mr` is a live MR of this library (checked above; the caller does not free it
    // concurrently); only plain fields are copied out.
    let (ctx, lkey) = unsafe { ((*mr).context, (*mr).lkey) };
    // SAFETY: an MR's context is a context of this library (open or closed).
    let Some(m) = (unsafe { crate::context::open_context(ctx) }) else {
        return fail(libc::ENODEV);
    };
    let Some(obj) = m.soft.mr_object(lkey) else {
        return fail(libc::EINVAL);
    };
    let Ok(i) = m.soft.query_mr(lkey) else {
        return fail(libc::EINVAL);
    };
    let t = i.reg_timing.unwrap_or_default();
    let out = MrkitMrAttr {
        addr: i.addr,
        length: i.length,
        iova: i.iova,
        lkey: i.lkey,
        rkey: i.rkey,
        access: i.access.bits(),
        pd_handle: i.pd,
        page_size: i.page_size,
        page_count: i.entries,
        pinned_bytes: i.pinned_bytes,
        kind: match i.kind {
            mrkit_soft::mr::MrKind::Pinned => 0,
            mrkit_soft::mr::MrKind::Odp => 1,
            mrkit_soft::mr::MrKind::ImplicitOdp => 2,
        },
        bound_mws: i.bound_mws,
        age_ns: obj.age().as_nanos() as u64,
        reg_total_ns: t.total_ns,
        reg_accounting_ns: t.accounting_ns,
        reg_pin_ns: t.pin_ns,
        reg_walk_ns: t.walk_ns,
        reg_translation_ns: t.translation_ns,
        reg_key_ns: t.key_ns,
        reserved: [0; 4],
    };
    // SAFETY: the caller provides writable memory for one struct; an unaligned pointer is
    // tolerated.
    unsafe { attr.write_unaligned(out) };
    0
}

#[cfg(test)]
mod tests {
    #[test]
    fn attr_is_160_bytes() {
        assert_eq!(std::mem::size_of::<super::MrkitMrAttr>(), 160);
    }
}
