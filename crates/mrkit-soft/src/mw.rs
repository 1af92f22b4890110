//! Memory windows, type 1 and type 2 (2B), with the IBA rules rxe leaves out.
//!
//! * `alloc_mw` / `dealloc_mw`: a type-1 window starts VALID with length 0 (unusable until
//!   bound); a type-2 window starts FREE. Dealloc always succeeds and unbinds.
//! * [`Context::bind_mw`](crate::Context::bind_mw) executes a bind (`ibv_bind_mw` for type 1, an `IBV_WR_BIND_MW` WQE
//!   for type 2); the data path reports any failure as `IBV_WC_MW_BIND_ERR`.
//! * Checks beyond rxe (IBA semantics, documented deviations): window PD == MR PD, the MR
//!   must be valid, type-1 QP PD == MW PD, overflow-safe bind range, and on the data path the
//!   **window's** bounds are enforced (rxe only checks the parent MR's).
#![forbid(unsafe_code)]

use std::sync::atomic::Ordering;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::access::AccessFlags;
use crate::error::{err, Result};
use crate::memcore::MemCore;
use crate::mr::{check_mr, range_ok, AccessDenied, MrGuard, MrShared};
use crate::pd::PdObject;

/// `IBV_MW_TYPE_1` (1) and `IBV_MW_TYPE_2` (2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MwType {
    /// Bound through `ibv_bind_mw`; can be re-bound; cannot be invalidated.
    Type1 = 1,
    /// Bound by a BIND_MW work request to one QP (2B); invalidated by LOCAL_INV/SEND_WITH_INV.
    Type2 = 2,
}

/// Binding state of a window.
#[derive(Debug, Clone)]
struct Binding {
    mr_key: u32,
    mr_shared: Arc<MrShared>,
    /// Start of the window in the MR's iova space.
    addr: u64,
    length: u64,
    access: AccessFlags,
    zero_based: bool,
    qp_num: Option<u32>,
}

#[derive(Debug)]
struct MwState {
    rkey: u32,
    binding: Option<Binding>,
}

/// A memory window as the device keeps it.
#[derive(Debug)]
pub struct MwObject {
    pd: Arc<PdObject>,
    mw_type: MwType,
    state: Mutex<MwState>,
}

/// What a bind asks for (`struct ibv_mw_bind_info`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BindInfo {
    /// lkey of the MR to bind to (ignored when `length` is 0 for type 1: an unbind).
    pub mr_lkey: u32,
    /// Window start, in the MR's iova space.
    pub addr: u64,
    /// Window length (0 unbinds a type-1 window).
    pub length: u64,
    /// Remote rights of the window (REMOTE_READ/WRITE/ATOMIC, ZERO_BASED).
    pub access: AccessFlags,
}

/// Information about a window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MwInfo {
    /// Current rkey.
    pub rkey: u32,
    /// Type.
    pub mw_type: MwType,
    /// PD.
    pub pd: u32,
    /// Bound MR key, start, length, rights (None when unbound).
    pub bound: Option<(u32, u64, u64, AccessFlags)>,
}

impl MemCore {
    /// `ibv_alloc_mw`: ENOMEM when max_mw windows exist, EINVAL for an unknown PD.
    pub fn alloc_mw(&self, pd: u32, mw_type: MwType) -> Result<u32> {
        let pdo = self.pd(pd)?;
        let r = self.mws.reserve().map_err(|_| {
            err!(
                ENOMEM,
                "max_mw ({}) memory windows exist; deallocate one or raise MRKIT_MAX_MW",
                self.mws.limit()
            )
        })?;
        let rkey = r.key();
        pdo.get();
        r.publish(MwObject {
            pd: pdo,
            mw_type,
            state: Mutex::new(MwState {
                rkey,
                binding: None,
            }),
        });
        Ok(rkey)
    }

    /// `ibv_dealloc_mw` (by the rkey returned at allocation or its current rkey). Unbinds.
    pub fn dealloc_mw(&self, rkey: u32) -> Result<()> {
        let idx = rkey >> 8;
        let alloc_key = self
            .mws
            .get_by_index(idx)
            .filter(|g| g.state.lock().rkey >> 8 == idx)
            .map(|g| g.key())
            .ok_or_else(|| err!(EINVAL, "no memory window with rkey {rkey:#x}"))?;
        let u = self
            .mws
            .unpublish(alloc_key)
            .ok_or_else(|| err!(EINVAL, "no memory window with rkey {rkey:#x}"))?;
        let e = u.drain_entry();
        let obj = e.value();
        if let Some(b) = obj.state.lock().binding.take() {
            b.mr_shared.bound_mws.fetch_sub(1, Ordering::AcqRel);
        }
        obj.pd.put();
        Ok(())
    }

    /// Describe a window by its current rkey.
    pub fn query_mw(&self, rkey: u32) -> Result<MwInfo> {
        let g = self
            .mws
            .get_by_index(rkey >> 8)
            .ok_or_else(|| err!(EINVAL, "no memory window with rkey {rkey:#x}"))?;
        let st = g.state.lock();
        Ok(MwInfo {
            rkey: st.rkey,
            mw_type: g.mw_type,
            pd: g.pd.handle,
            bound: st
                .binding
                .as_ref()
                .map(|b| (b.mr_key, b.addr, b.length, b.access)),
        })
    }

    /// Execute a bind (`docs/semantics.md` §5.2). `mw_rkey` is the window's *current* rkey (as
    /// the WR carries it), `new_key` the 8-bit key to install, `qp_pd`/`qp_num` the QP executing
    /// the bind. Returns the window's new rkey. Every failure is EINVAL with the reason; the
    /// data path reports it as `IBV_WC_MW_BIND_ERR` and moves the QP to ERR.
    pub fn bind_mw(
        &self,
        qp_pd: u32,
        qp_num: u32,
        mw_rkey: u32,
        new_key: u8,
        info: BindInfo,
    ) -> Result<u32> {
        let g = self
            .mws
            .get_by_index(mw_rkey >> 8)
            .ok_or_else(|| err!(EINVAL, "bind: no window with rkey {mw_rkey:#x}"))?;
        let mut st = g.state.lock();
        if st.rkey != mw_rkey {
            return Err(err!(
                EINVAL,
                "bind: rkey {mw_rkey:#x} is stale (window's rkey is {:#x})",
                st.rkey
            ));
        }
        if g.pd.handle != qp_pd {
            return Err(err!(EINVAL, "bind: window PD differs from the QP's PD"));
        }
        let zero_based = info.access.contains(AccessFlags::ZERO_BASED);
        match g.mw_type {
            MwType::Type1 => {
                if zero_based {
                    return Err(err!(EINVAL, "bind: type-1 windows cannot be ZERO_BASED"));
                }
            }
            MwType::Type2 => {
                if st.binding.is_some() {
                    return Err(err!(
                        EINVAL,
                        "bind: type-2 window is bound; invalidate it (LOCAL_INV) before re-binding"
                    ));
                }
                if info.length == 0 {
                    return Err(err!(EINVAL, "bind: type-2 windows need a non-zero length"));
                }
            }
        }
        let new_rkey = (mw_rkey & !0xff) | u32::from(new_key);
        if info.length == 0 {
            // Type-1 unbind: window stays valid with length 0 and never resolves.
            if let Some(b) = st.binding.take() {
                b.mr_shared.bound_mws.fetch_sub(1, Ordering::AcqRel);
            }
            st.rkey = new_rkey;
            return Ok(new_rkey);
        }
        let mr = self
            .mrs
            .get(info.mr_lkey)
            .ok_or_else(|| err!(EINVAL, "bind: no MR with lkey {:#x}", info.mr_lkey))?;
        if mr.pd.handle != g.pd.handle {
            return Err(err!(EINVAL, "bind: window PD differs from the MR's PD"));
        }
        if mr.access.contains(AccessFlags::ZERO_BASED) {
            return Err(err!(EINVAL, "bind: cannot bind to a ZERO_BASED MR"));
        }
        if !mr.access.contains(AccessFlags::MW_BIND) {
            return Err(err!(
                EINVAL,
                "bind: MR {:#x} lacks MW_BIND; register it with AccessFlags::MW_BIND",
                info.mr_lkey
            ));
        }
        if info
            .access
            .intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC)
            && !mr.access.contains(AccessFlags::LOCAL_WRITE)
        {
            return Err(err!(
                EINVAL,
                "bind: a window granting REMOTE_WRITE/ATOMIC needs LOCAL_WRITE on the MR"
            ));
        }
        let in_range = if zero_based {
            info.length <= mr.length
        } else {
            range_ok(mr.iova, mr.length, info.addr, info.length)
        };
        if !in_range {
            return Err(err!(
                EINVAL,
                "bind: window [{:#x}, +{:#x}) is outside MR [{:#x}, +{:#x})",
                info.addr,
                info.length,
                mr.iova,
                mr.length
            ));
        }
        mr.shared.bound_mws.fetch_add(1, Ordering::AcqRel);
        if let Some(old) = st.binding.take() {
            old.mr_shared.bound_mws.fetch_sub(1, Ordering::AcqRel);
        }
        st.binding = Some(Binding {
            mr_key: info.mr_lkey,
            mr_shared: mr.shared.clone(),
            addr: if zero_based { mr.iova } else { info.addr },
            length: info.length,
            access: info.access,
            zero_based,
            qp_num: (g.mw_type == MwType::Type2).then_some(qp_num),
        });
        st.rkey = new_rkey;
        Ok(new_rkey)
    }

    /// Invalidate a key (LOCAL_INV, or SEND_WITH_INV at the responder when `remote`).
    /// Type-2 windows go FREE; type-1 windows and ordinary MRs cannot be invalidated; an unbound
    /// window or a window bound to another QP is an error. EINVAL on every failure; the data
    /// path reports LOC_QP_OP_ERR (local) or REM_INV_REQ_ERR (remote).
    pub fn invalidate_rkey(&self, pd: u32, qp_num: u32, rkey: u32) -> Result<()> {
        if rkey & 0x8000_0000 == 0 {
            return Err(err!(
                EINVAL,
                "key {rkey:#x} is an ordinary MR; only fast-register MRs and type-2 windows can \
                 be invalidated"
            ));
        }
        let g = self
            .mws
            .get_by_index(rkey >> 8)
            .ok_or_else(|| err!(EINVAL, "invalidate: no window with rkey {rkey:#x}"))?;
        let mut st = g.state.lock();
        if st.rkey != rkey {
            return Err(err!(EINVAL, "invalidate: rkey {rkey:#x} is stale"));
        }
        if g.pd.handle != pd {
            return Err(err!(EINVAL, "invalidate: window belongs to another PD"));
        }
        if g.mw_type == MwType::Type1 {
            return Err(err!(
                EINVAL,
                "invalidate: type-1 windows cannot be invalidated"
            ));
        }
        let Some(b) = st.binding.as_ref() else {
            return Err(err!(EINVAL, "invalidate: window {rkey:#x} is not bound"));
        };
        if b.qp_num.is_some_and(|q| q != qp_num) {
            return Err(err!(EINVAL, "invalidate: window is bound to another QP"));
        }
        let b = st.binding.take().expect("checked");
        b.mr_shared.bound_mws.fetch_sub(1, Ordering::AcqRel);
        Ok(())
    }

    /// Window half of the access predicate (called by [`MemCore::check_access`](crate::memcore::MemCore::check_access)).
    pub(crate) fn check_window(
        &self,
        rkey: u32,
        pd: u32,
        need: AccessFlags,
        iova: u64,
        len: u64,
        qp_num: u32,
    ) -> std::result::Result<MrGuard, AccessDenied> {
        let g = self
            .mws
            .get_by_index(rkey >> 8)
            .ok_or(AccessDenied::NoSuchKey)?;
        let (mr_key, mr_iova) = {
            let st = g.state.lock();
            if st.rkey != rkey {
                return Err(AccessDenied::NoSuchKey);
            }
            if g.pd.handle != pd {
                return Err(AccessDenied::WrongPd);
            }
            let b = st.binding.as_ref().ok_or(AccessDenied::NotValid)?;
            if b.length == 0 {
                return Err(AccessDenied::NotValid);
            }
            if b.qp_num.is_some_and(|q| q != qp_num) {
                return Err(AccessDenied::WrongQp);
            }
            if !b.access.contains(need) {
                return Err(AccessDenied::MissingRights {
                    need,
                    have: b.access,
                });
            }
            let (base, off_ok) = if b.zero_based {
                (0, range_ok(0, b.length, iova, len))
            } else {
                (b.addr, range_ok(b.addr, b.length, iova, len))
            };
            if !off_ok {
                return Err(AccessDenied::OutOfRange);
            }
            (b.mr_key, b.addr + (iova - base))
        };
        let mr = self.mrs.get(mr_key).ok_or(AccessDenied::NotValid)?;
        let mr_pd = mr.pd.handle;
        // Window rights need not be on the MR: check the MR with no required bits.
        check_mr(mr, mr_pd, AccessFlags::empty(), mr_iova, len)
    }
}
