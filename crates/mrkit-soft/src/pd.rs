//! Protection domains.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU32, Ordering};

/// A protection domain. Objects created in it (MRs, MWs, QPs) hold a use count; deallocating
/// a PD that is still used fails with EBUSY.
#[derive(Debug)]
pub struct PdObject {
    /// PD number (the table key).
    pub(crate) handle: u32,
    /// MRs, MWs, QPs and SRQs that reference this PD. Incremented when such an object is
    /// created or moved here (rereg CHANGE_PD), decremented when it is destroyed or moved away.
    pub(crate) usecnt: AtomicU32,
}

impl PdObject {
    /// The PD handle.
    pub fn handle(&self) -> u32 {
        self.handle
    }
    /// Objects still using this PD.
    pub fn usecnt(&self) -> u32 {
        self.usecnt.load(Ordering::Acquire)
    }
    pub(crate) fn get(&self) {
        self.usecnt.fetch_add(1, Ordering::AcqRel);
    }
    pub(crate) fn put(&self) {
        self.usecnt.fetch_sub(1, Ordering::AcqRel);
    }
}
