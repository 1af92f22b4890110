//! The memory core: what the engines need from the device, and nothing else.
//!
//! [`MemCore`] holds the protection domains, the MR and MW key tables, the translation-entry
//! accounting, the registration statistics and the device's limits. Its methods (here, in
//! `mr.rs` and in `mw.rs`) are the registration verbs and the three operations the sans-IO
//! engines call on the data path: [`MemCore::check_access`] (the one access predicate),
//! [`MemCore::invalidate_rkey`] and [`MemCore::bind_mw`]. It knows nothing of QPs, CQs,
//! links or threads, so an engine test or a fuzzer builds one with [`MemCore::new`] and runs
//! the engines without opening a device.
#![forbid(unsafe_code)]

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::device::DeviceConfig;
use crate::error::{err, Result};
use crate::mr::MrObject;
use crate::mw::MwObject;
use crate::pd::PdObject;
use crate::stats::RegStats;
use crate::table::KeyTable;

/// Index range of MR keys: keys below 2^31 are MRs.
pub(crate) const MR_INDEX: (u32, u32) = (1, (1 << 23) - 1);
/// Index range of MW keys: keys with bit 31 set are memory windows.
pub(crate) const MW_INDEX: (u32, u32) = (1 << 23, (1 << 24) - 1);

/// Protection domains, MR and MW tables, translation accounting and statistics of one device
/// instance (module docs).
#[derive(Debug)]
pub struct MemCore {
    pub(crate) config: DeviceConfig,
    pub(crate) pds: KeyTable<Arc<PdObject>>,
    pub(crate) mrs: KeyTable<MrObject>,
    pub(crate) mws: KeyTable<MwObject>,
    /// Translation entries reserved by live MRs; bounded by `attr.max_mtt`
    /// (reserved with a compare-exchange loop before an MR is published).
    pub(crate) mtt_used: AtomicU64,
    pub(crate) stats: RegStats,
}

impl MemCore {
    /// Empty tables with the limits of `config`.
    pub fn new(config: DeviceConfig) -> MemCore {
        let a = config.attr().clone();
        MemCore {
            pds: KeyTable::new(1, (1 << 24) - 1, a.max_pd),
            mrs: KeyTable::new(MR_INDEX.0, MR_INDEX.1, a.max_mr),
            mws: KeyTable::new(MW_INDEX.0, MW_INDEX.1, a.max_mw),
            mtt_used: AtomicU64::new(0),
            stats: RegStats::default(),
            config,
        }
    }

    /// The configuration (limits and status model).
    pub fn config(&self) -> &DeviceConfig {
        &self.config
    }

    /// `ibv_alloc_pd`: ENOMEM when max_pd PDs exist.
    pub fn alloc_pd(&self) -> Result<u32> {
        let r = self.pds.reserve().map_err(|_| {
            err!(
                ENOMEM,
                "max_pd ({}) protection domains exist; deallocate one or raise MRKIT_MAX_PD",
                self.pds.limit()
            )
        })?;
        let handle = r.key();
        Ok(r.publish(Arc::new(PdObject {
            handle,
            usecnt: Default::default(),
        })))
    }

    /// `ibv_dealloc_pd`: EBUSY while MRs, MWs, QPs or SRQs use it; EINVAL for an unknown PD.
    pub fn dealloc_pd(&self, pd: u32) -> Result<()> {
        let g = self
            .pds
            .get(pd)
            .ok_or_else(|| err!(EINVAL, "PD {pd:#x} does not exist (already deallocated?)"))?;
        let used = g.usecnt();
        if used > 0 {
            return Err(err!(
                EBUSY,
                "PD {pd:#x} is still used by {used} MR/MW/QP/SRQ object(s); destroy them first"
            ));
        }
        drop(g);
        // A racing creator may have taken a use between the check and here: re-check after
        // unpublishing and put the PD back if so.
        let u = self
            .pds
            .unpublish(pd)
            .ok_or_else(|| err!(EINVAL, "PD {pd:#x} does not exist"))?;
        let _ = u.drain_entry();
        Ok(())
    }

    pub(crate) fn pd(&self, pd: u32) -> Result<Arc<PdObject>> {
        self.pds
            .get(pd)
            .map(|g| (*g).clone())
            .ok_or_else(|| err!(EINVAL, "PD {pd:#x} does not exist"))
    }
}
