//! Memory registration: `reg_mr`, `reg_mr_iova`, `dereg_mr`, `rereg_mr`, `query_mr`,
//! `advise_mr`, and **the** access predicate ([`MemCore::check_access`](crate::memcore::MemCore::check_access)) that every path that
//! touches registered memory goes through.
//!
//! Validation order (first failure wins), as the kernel's uverbs REG_MR command, then the
//! driver, then `ib_umem_get` (see `docs/semantics.md` §1.2 and §2.1):
//!
//! | # | check | errno |
//! |---|---|---|
//! | 1 | `addr % PAGE != iova % PAGE` | EINVAL |
//! | 2 | REMOTE_WRITE or REMOTE_ATOMIC without LOCAL_WRITE | EINVAL |
//! | 3 | a bit outside `IB_ACCESS_SUPPORTED` (0x3ff003ff) | EINVAL |
//! | 4 | ON_DEMAND without the ODP capability | EOPNOTSUPP |
//! | 5 | FLUSH_GLOBAL / FLUSH_PERSISTENT (this device has no FLUSH) | EOPNOTSUPP |
//! | 6 | PD does not exist | EINVAL |
//! | 7 | driver: ZERO_BASED or HUGETLB under the rxe status model | EOPNOTSUPP |
//! | 8 | `length > max_mr_size` | EINVAL |
//! | 9 | `addr + length` (or its page-rounded end) wraps | EINVAL (ODP: EOVERFLOW) |
//! | 10 | RLIMIT_MEMLOCK is 0 and no CAP_IPC_LOCK | EPERM |
//! | 11 | length 0 | EINVAL |
//! | 12 | pinned_vm + pages > RLIMIT_MEMLOCK (no CAP_IPC_LOCK) | ENOMEM |
//! | 13 | pin refused: unmapped, PROT_NONE, read-only mapping with writable access | EFAULT |
//! | 14 | translation entries exhausted (2^log_num_mtt) | ENOMEM |
//! | 15 | max_mr MRs alive | ENOMEM |
//!
//! Optional-range bits (0x3ff00000, e.g. RELAXED_ORDERING) are accepted and ignored.
//!
//! Choices where the kernel, rxe and hardware differ (hardware wins by default):
//! * **length 0** is always EINVAL (the kernel accepts it for an unaligned address and pins a
//!   page for an MR nobody can use).
//! * **ZERO_BASED** is accepted (mlx5 accepts it; rxe says EOPNOTSUPP): the MR's address space
//!   starts at 0, i.e. its iova is 0 whatever iova was passed.
//! * **MW_BIND** alone is legal (as in the kernel); it makes the pin writable. Binding a window
//!   that grants remote write requires LOCAL_WRITE on the MR (checked at bind time).
//! * **max_mr** exhaustion is ENOMEM (hardware mkey allocation), not rxe's EINVAL.
//! * Keys: `lkey == rkey`, generation-tagged (see [`crate::table`]).
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::reg_timing::{Phase, RegTimer};

use parking_lot::Mutex;

use crate::access::AccessFlags;
use crate::device::StatusModel;
use crate::error::{err, Errno, Error, Result};
use crate::mem::{
    self, account::Charge, fork::DontFork, pin::Pin, pin::PinPath, translate::PageList,
};
use crate::memcore::MemCore;
use crate::odp::OdpState;
use crate::pd::PdObject;
use crate::table::Guard;
use crate::user_mem::{Owner, UserMemory};

/// How an MR holds its memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MrKind {
    /// Pages pinned at registration.
    Pinned,
    /// On-demand paging over an explicit range.
    Odp,
    /// Implicit ODP: the whole address space (addr 0, length u64::MAX).
    ImplicitOdp,
}

/// What `query_mr` reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MrInfo {
    /// Local key.
    pub lkey: u32,
    /// Remote key (equal to `lkey`).
    pub rkey: u32,
    /// Protection domain handle.
    pub pd: u32,
    /// Registered virtual address.
    pub addr: u64,
    /// Length in bytes.
    pub length: u64,
    /// First address of the MR's address space (what SGEs and RETHs carry).
    pub iova: u64,
    /// Access rights.
    pub access: AccessFlags,
    /// Pinned, ODP or implicit ODP.
    pub kind: MrKind,
    /// Pinning mechanism (pinned MRs).
    pub pin_path: Option<PinPath>,
    /// Whether the pages were pinned writable.
    pub writable: bool,
    /// Largest page size backing the MR.
    pub page_size: u64,
    /// Translation entries used.
    pub entries: u64,
    /// Bytes pinned (page-rounded; 0 for ODP).
    pub pinned_bytes: u64,
    /// Whether frame numbers were readable from pagemap.
    pub pfns_known: bool,
    /// Memory windows bound to this MR now.
    pub bound_mws: u32,
    /// How long the registration took and where the time went (measured by the device; an
    /// MR made by a translation-changing rereg has the timing of that registration).
    pub reg_timing: Option<crate::reg_timing::RegTiming>,
}

/// Memory held by an MR; released (unpinned) explicitly at dereg after the drain.
#[derive(Debug)]
pub(crate) struct MrMemory {
    _pins: Vec<Pin>,
    pages: PageList,
    _dontfork: Option<DontFork>,
    _charge: Option<Charge>,
}

/// State shared by every version of an MR object (rereg PD/ACCESS replaces the object in
/// place but keeps memory, windows and ODP state).
#[derive(Debug)]
pub(crate) struct MrShared {
    memory: Mutex<Option<MrMemory>>,
    /// Memory windows currently bound to this MR. Incremented by a successful bind, decremented
    /// when a window is invalidated, rebound elsewhere or deallocated; dereg refuses while > 0.
    pub(crate) bound_mws: AtomicU32,
    pub(crate) odp: Option<OdpState>,
    entries: u64,
    pinned_bytes: u64,
    page_size: u64,
    pin_path: Option<PinPath>,
    pfns_known: bool,
    /// When the MR was registered (`mrkit stat --mrs` shows its age).
    pub(crate) created: Instant,
    /// Set once the registration finished (after the key was published).
    timing: std::sync::OnceLock<crate::reg_timing::RegTiming>,
}

/// A registered MR as the device keeps it.
#[derive(Debug, Clone)]
pub struct MrObject {
    pub(crate) pd: Arc<PdObject>,
    pub(crate) addr: u64,
    pub(crate) length: u64,
    pub(crate) iova: u64,
    pub(crate) access: AccessFlags,
    pub(crate) kind: MrKind,
    pub(crate) writable: bool,
    pub(crate) shared: Arc<MrShared>,
    /// What keeps the memory alive ([`UserMemory::owned`]): dropped with the last reference
    /// to the object, i.e. after deregistration drained every access.
    pub(crate) owner: Option<Owner>,
}

impl MrObject {
    /// Run `f` on the pins holding this MR's pages (none for ODP or released memory): the
    /// data path's slow path for a copy that faulted (`copy.rs`) reaches the pinned frames
    /// through them.
    pub(crate) fn with_pins<R>(&self, f: impl FnOnce(&[Pin]) -> R) -> R {
        let mem = self.shared.memory.lock();
        f(mem.as_ref().map_or(&[][..], |m| &m._pins[..]))
    }
    /// Protection domain handle.
    pub fn pd(&self) -> u32 {
        self.pd.handle
    }
    /// Access rights.
    pub fn access(&self) -> AccessFlags {
        self.access
    }
    /// First iova.
    pub fn iova(&self) -> u64 {
        self.iova
    }
    /// Length.
    pub fn length(&self) -> u64 {
        self.length
    }
    /// Time since the MR was registered.
    pub fn age(&self) -> std::time::Duration {
        self.shared.created.elapsed()
    }
    /// Whether the MR keeps its memory's owner alive ([`UserMemory::owned`]).
    pub fn owns_memory(&self) -> bool {
        self.owner.is_some()
    }
    /// Pinned / ODP / implicit.
    pub fn kind(&self) -> MrKind {
        self.kind
    }
    /// Frame numbers of the translation (empty when unreadable).
    pub fn pfns(&self) -> Vec<u64> {
        self.shared
            .memory
            .lock()
            .as_ref()
            .map(|m| m.pages.pfns.clone())
            .unwrap_or_default()
    }
    /// Segments of the translation.
    pub fn segments(&self) -> Vec<mem::translate::Segment> {
        self.shared
            .memory
            .lock()
            .as_ref()
            .map(|m| m.pages.segments.clone())
            .unwrap_or_default()
    }
}

/// `IBV_REREG_MR_*` flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReregFlags(pub u32);

impl ReregFlags {
    /// New address/length.
    pub const CHANGE_TRANSLATION: u32 = 0x1;
    /// New PD.
    pub const CHANGE_PD: u32 = 0x2;
    /// New access rights.
    pub const CHANGE_ACCESS: u32 = 0x4;
    /// All supported flags.
    pub const SUPPORTED: u32 = 0x7;
}

/// Whether a key is presented as an lkey (local SGE) or an rkey (from the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyUse {
    /// Local SGE.
    Local,
    /// Remote access (RETH / AtomicETH).
    Remote,
}

/// Why [`MemCore::check_access`](crate::memcore::MemCore::check_access) refused an access. The data path maps each to a completion
/// status according to the device's [`StatusModel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccessDenied {
    /// No object has this exact key (unknown index, stale generation, deregistered).
    NoSuchKey,
    /// The object belongs to another protection domain.
    WrongPd,
    /// A required right is missing.
    MissingRights {
        /// Rights the access needs.
        need: AccessFlags,
        /// Rights the MR/MW has.
        have: AccessFlags,
    },
    /// The object exists but is not valid (free/unbound window, invalidated).
    NotValid,
    /// The range is outside the MR (or window), computed overflow-safely.
    OutOfRange,
    /// A window is bound to another QP (type 2B).
    WrongQp,
    /// An ODP fault could not map the pages.
    Fault,
}

/// Proof that an access was allowed: keeps the MR from being deregistered (dereg drains guards)
/// while bytes move, and gives the process address to copy at.
#[derive(Debug)]
pub struct MrGuard {
    guard: Guard<MrObject>,
    /// Process virtual address of the first byte of the checked range.
    pub va: u64,
    /// Length of the checked range.
    pub len: u64,
}

impl MrGuard {
    /// The MR.
    pub fn mr(&self) -> &MrObject {
        &self.guard
    }
    /// Its key.
    pub fn key(&self) -> u32 {
        self.guard.key()
    }
}

/// Overflow-safe `[a, a+len) ⊆ [base, base+size)`.
///
/// ```
/// use mrkit_soft::mr::range_ok;
/// assert!(range_ok(0x1000, 0x1000, 0x1000, 0x1000));
/// assert!(!range_ok(0x1000, 0x1000, 0x1001, 0x1000));
/// assert!(!range_ok(0x1000, 0x1000, u64::MAX, 2)); // would wrap
/// ```
pub fn range_ok(base: u64, size: u64, a: u64, len: u64) -> bool {
    a >= base && len <= size && a - base <= size - len
}

fn check_mr_access(ctx: &MemCore, access: AccessFlags) -> Result<()> {
    let bits = access.bits();
    if access.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC)
        && !access.contains(AccessFlags::LOCAL_WRITE)
    {
        let which = if access.contains(AccessFlags::REMOTE_WRITE) {
            "REMOTE_WRITE"
        } else {
            "REMOTE_ATOMIC"
        };
        return Err(err!(
            EINVAL,
            "{which} requires LOCAL_WRITE; add AccessFlags::LOCAL_WRITE"
        ));
    }
    if bits & !AccessFlags::SUPPORTED != 0 {
        return Err(err!(
            EINVAL,
            "unknown access bits {:#x} (outside IB_ACCESS_SUPPORTED 0x3ff003ff); remove them",
            bits & !AccessFlags::SUPPORTED
        ));
    }
    let attr = ctx.config.attr();
    if access.contains(AccessFlags::ON_DEMAND) && attr.odp_general_caps & 1 == 0 {
        return Err(err!(
            EOPNOTSUPP,
            "ON_DEMAND needs the ODP capability, which this device has disabled (MRKIT_ODP=0); \
             register pinned memory or enable ODP"
        ));
    }
    if access.intersects(AccessFlags::FLUSH_GLOBAL | AccessFlags::FLUSH_PERSISTENT) {
        return Err(err!(
            EOPNOTSUPP,
            "FLUSH_GLOBAL/FLUSH_PERSISTENT need IB_DEVICE_FLUSH_*, which mrkit0 does not offer; \
             drop the FLUSH bits"
        ));
    }
    Ok(())
}

fn check_driver_access(ctx: &MemCore, access: AccessFlags) -> Result<()> {
    if ctx.config.model() == StatusModel::Rxe
        && access.intersects(AccessFlags::ZERO_BASED | AccessFlags::HUGETLB)
    {
        return Err(err!(
            EOPNOTSUPP,
            "rxe does not support ZERO_BASED or HUGETLB MRs (status model rxe); \
             use reg_mr_iova with iova 0 instead of ZERO_BASED"
        ));
    }
    Ok(())
}

fn human(bytes: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if v.fract() == 0.0 {
        format!("{v:.0} {}", U[i])
    } else {
        format!("{v:.1} {}", U[i])
    }
}

/// io_uring caps one fixed buffer at 1 GiB: larger pins are made of several pieces.
const PIN_PIECE: u64 = 1 << 30;

impl MemCore {
    /// `ibv_reg_mr`: register `mem` with iova = its address.
    pub fn reg_mr_va(&self, pd: u32, mem: UserMemory, access: AccessFlags) -> Result<MrInfo> {
        let iova = mem.addr();
        self.reg_mr(pd, mem, iova, access)
    }

    /// `ibv_reg_mr_iova2`: register `mem` (`[addr, addr+length)`) whose first byte has address
    /// `iova` in the MR's address space. See the module docs for the validation order.
    ///
    /// `mem` either owns its memory (the MR keeps it alive until deregistration finished) or
    /// was made with `unsafe` [`UserMemory::new`], whose caller promised the same: safe code
    /// cannot register memory it may free while the MR lives.
    pub fn reg_mr(
        &self,
        pd: u32,
        mem: UserMemory,
        iova: u64,
        access: AccessFlags,
    ) -> Result<MrInfo> {
        let (addr, length) = (mem.addr(), mem.len());
        crate::probes::reg_start(addr, length, access.bits());
        let mut tm = RegTimer::start();
        let r = self.reg_mr_inner(pd, addr, length, iova, access, mem.into_owner(), &mut tm);
        let done = match &r {
            Ok(i) => i.reg_timing.map_or(0, |t| t.total_ns),
            Err(_) => tm.elapsed_ns(),
        };
        let (errno, lkey) = r
            .as_ref()
            .map_or_else(|e| (e.errno().raw(), 0), |i| (0, i.lkey));
        crate::probes::reg_done(addr, length, access.bits(), errno, lkey, done);
        let s = &self.stats;
        let p = crate::stats::process();
        match &r {
            Ok(_) => {
                let ns = done;
                for st in [s, p] {
                    st.registrations.fetch_add(1, Ordering::Relaxed);
                    st.mrs_live.fetch_add(1, Ordering::Relaxed);
                    st.reg_latency.record(ns);
                }
            }
            Err(e) => {
                s.failure(e.errno());
                p.failure(e.errno());
                tracing::debug!(error = %e, addr, length, "reg_mr failed");
            }
        }
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn reg_mr_inner(
        &self,
        pd: u32,
        addr: u64,
        length: u64,
        iova: u64,
        access: AccessFlags,
        owner: Option<Owner>,
        tm: &mut RegTimer,
    ) -> Result<MrInfo> {
        let ps = mem::page_size() as u64;
        let implicit = access.contains(AccessFlags::ON_DEMAND) && addr == 0 && length == u64::MAX;
        // 1. in-page offsets of addr and iova must match.
        if !implicit && addr % ps != iova % ps {
            return Err(err!(
                EINVAL,
                "addr {addr:#x} and iova {iova:#x} have different offsets within the page; \
                 pass an iova with the same low {} bits",
                ps.trailing_zeros()
            ));
        }
        // 2-5. access rules.
        check_mr_access(self, access)?;
        // 6. PD.
        let pdo = self.pd(pd)?;
        // 7. driver-supported bits.
        check_driver_access(self, access)?;
        let attr = self.config.attr();
        if implicit {
            tm.mark(Phase::Accounting, 0);
            return self.reg_implicit(pdo, iova, access, owner, tm);
        }
        // 8. size limit.
        if length > attr.max_mr_size {
            return Err(err!(
                EINVAL,
                "length {} exceeds max_mr_size {}; split the buffer into several MRs of at \
                 most {} each (the registration cache does this for you) or raise \
                 MRKIT_MAX_MR_SIZE",
                human(length),
                human(attr.max_mr_size),
                human(attr.max_mr_size.min(1 << 30))
            ));
        }
        let odp = access.contains(AccessFlags::ON_DEMAND);
        // 9. overflow.
        let Some((start, span)) = mem::page_span(addr, length) else {
            return Err(if odp {
                err!(
                    EOVERFLOW,
                    "addr {addr:#x} + length {length:#x} wraps the address space"
                )
            } else {
                err!(
                    EINVAL,
                    "addr {addr:#x} + length {length:#x} wraps the address space"
                )
            });
        };
        // 10. may this process pin at all?
        if !odp && !mem::account::can_do_mlock() {
            return Err(err!(
                EPERM,
                "RLIMIT_MEMLOCK is 0 and the process lacks CAP_IPC_LOCK, so it may not pin memory; \
                 raise `ulimit -l` (e.g. unlimited) or grant CAP_IPC_LOCK"
            ));
        }
        // 11. zero length.
        if length == 0 {
            return Err(err!(EINVAL, "length 0: an MR must cover at least one byte"));
        }
        let npages = span / ps;
        let writable = access.is_writable();
        let (memory, shared_extra) = if odp {
            (None, (0, 0, ps, None, false))
        } else {
            // 12. memlock budget.
            let charge = mem::account::charge(npages)?;
            tm.mark(Phase::Accounting, span);
            // 13. pin.
            let pins = pin_range(start, span, writable)?;
            tm.mark(Phase::Pin, span);
            let path = pins.first().map(|p| p.path());
            let pages = mem::translate::walk(start, span)?;
            tm.mark(Phase::Walk, span);
            let dontfork = if self.config.uses_dontfork() {
                Some(mem::fork::dontfork(start, span)?)
            } else {
                None
            };
            let entries = pages.entries();
            let page_size = pages.max_page_size().max(ps);
            let pfns = pages.has_pfns();
            (
                Some(MrMemory {
                    _pins: pins,
                    pages,
                    _dontfork: dontfork,
                    _charge: Some(charge),
                }),
                (entries, span, page_size, path, pfns),
            )
        };
        let (entries, pinned_bytes, page_size, pin_path, pfns_known) = shared_extra;
        let entries = if odp { npages } else { entries };
        if odp {
            tm.mark(Phase::Accounting, 0);
        }
        // 14. translation capacity.
        self.reserve_mtt(entries, page_size)?;
        tm.mark(Phase::Translation, entries);
        // 15. key.
        let res = match self.mrs.reserve() {
            Ok(r) => r,
            Err(_) => {
                self.release_mtt(entries);
                return Err(err!(
                    ENOMEM,
                    "max_mr ({}) MRs are registered; deregister some, use an MR pool or cache, \
                     or raise MRKIT_MAX_MR",
                    self.mrs.limit()
                ));
            }
        };
        let key = res.key();
        if let Some(path) = pin_path {
            self.stats.pinned(pinned_bytes, path);
            crate::stats::process().pinned(pinned_bytes, path);
        }
        pdo.get();
        let zero_based = access.contains(AccessFlags::ZERO_BASED);
        let obj = MrObject {
            pd: pdo,
            addr,
            length,
            iova: if zero_based { 0 } else { iova },
            access,
            kind: if odp { MrKind::Odp } else { MrKind::Pinned },
            writable,
            shared: Arc::new(MrShared {
                memory: Mutex::new(memory),
                bound_mws: AtomicU32::new(0),
                odp: odp.then(|| OdpState::snapshot(start, span)),
                entries,
                pinned_bytes,
                page_size,
                pin_path,
                pfns_known,
                created: Instant::now(),
                timing: Default::default(),
            }),
            owner,
        };
        let mut info = info_of(key, &obj);
        let shared = obj.shared.clone();
        res.publish(obj);
        tm.mark(Phase::Key, pinned_bytes);
        info.reg_timing = Some(*shared.timing.get_or_init(|| tm.finish()));
        Ok(info)
    }

    fn reg_implicit(
        &self,
        pdo: Arc<PdObject>,
        iova: u64,
        access: AccessFlags,
        owner: Option<Owner>,
        tm: &mut RegTimer,
    ) -> Result<MrInfo> {
        let attr = self.config.attr();
        if attr.odp_general_caps & crate::device::odp_caps::IMPLICIT == 0 {
            return Err(err!(
                EINVAL,
                "implicit ODP (addr 0, length SIZE_MAX) needs IBV_ODP_SUPPORT_IMPLICIT, which \
                 this device does not advertise; register an explicit ODP range"
            ));
        }
        if iova != 0 {
            return Err(err!(
                EINVAL,
                "implicit ODP MRs must have iova 0 (got {iova:#x})"
            ));
        }
        let res = self.mrs.reserve().map_err(|_| {
            err!(
                ENOMEM,
                "max_mr ({}) MRs are registered; deregister some or raise MRKIT_MAX_MR",
                self.mrs.limit()
            )
        })?;
        let key = res.key();
        pdo.get();
        let obj = MrObject {
            pd: pdo,
            addr: 0,
            length: u64::MAX,
            iova: 0,
            access,
            kind: MrKind::ImplicitOdp,
            writable: access.is_writable(),
            shared: Arc::new(MrShared {
                memory: Mutex::new(None),
                bound_mws: AtomicU32::new(0),
                odp: Some(OdpState::default()),
                entries: 0,
                pinned_bytes: 0,
                page_size: mem::page_size() as u64,
                pin_path: None,
                pfns_known: false,
                created: Instant::now(),
                timing: Default::default(),
            }),
            owner,
        };
        let mut info = info_of(key, &obj);
        let shared = obj.shared.clone();
        res.publish(obj);
        tm.mark(Phase::Key, 0);
        info.reg_timing = Some(*shared.timing.get_or_init(|| tm.finish()));
        Ok(info)
    }

    fn reserve_mtt(&self, entries: u64, page_size: u64) -> Result<()> {
        let max = self.config.attr().max_mtt;
        self.mtt_used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(entries).filter(|n| *n <= max)
            })
            .map_err(|used| {
                err!(
                    ENOMEM,
                    "translation table full: this MR needs {entries} entries of {} but only {} of \
                     2^{} are free; back the buffer with huge pages (THP: madvise(MADV_HUGEPAGE) \
                     needs 512x fewer entries), deregister MRs, or raise MRKIT_LOG_NUM_MTT",
                    human(page_size),
                    max.saturating_sub(used),
                    self.config.attr().log_num_mtt
                )
            })?;
        self.stats.mtt_used.fetch_add(entries, Ordering::Relaxed);
        crate::stats::process()
            .mtt_used
            .fetch_add(entries, Ordering::Relaxed);
        Ok(())
    }

    fn release_mtt(&self, entries: u64) {
        self.mtt_used.fetch_sub(entries, Ordering::AcqRel);
        self.stats.mtt_used.fetch_sub(entries, Ordering::Relaxed);
        crate::stats::process()
            .mtt_used
            .fetch_sub(entries, Ordering::Relaxed);
    }

    /// `ibv_dereg_mr`. EINVAL while memory windows are bound (as rxe and the man page) or for
    /// an unknown key. Otherwise: unpublish the key (every later lookup fails), wait for
    /// in-flight accesses to finish, then unpin. **After this returns the device never touches
    /// the memory again.**
    pub fn dereg_mr(&self, lkey: u32) -> Result<()> {
        let r = self.dereg_mr_inner(lkey);
        crate::probes::dereg(
            lkey,
            r.as_ref().map_or(0, |l| *l),
            r.as_ref().err().map_or(0, |e| e.errno().raw()),
        );
        r.map(drop)
    }

    /// [`Context::dereg_mr`]; returns the MR's length.
    fn dereg_mr_inner(&self, lkey: u32) -> Result<u64> {
        let g = self
            .mrs
            .get(lkey)
            .ok_or_else(|| err!(EINVAL, "no MR with key {lkey:#x} (already deregistered?)"))?;
        let bound = g.shared.bound_mws.load(Ordering::Acquire);
        if bound > 0 {
            return Err(err!(
                EINVAL,
                "MR {lkey:#x} has {bound} memory window(s) bound; invalidate or deallocate them \
                 first"
            ));
        }
        drop(g);
        let u = self
            .mrs
            .unpublish(lkey)
            .ok_or_else(|| err!(EINVAL, "no MR with key {lkey:#x}"))?;
        let entry = u.drain_entry();
        self.release_object(entry.value());
        Ok(entry.value().length)
    }

    fn release_object(&self, obj: &MrObject) {
        let mem = obj.shared.memory.lock().take();
        drop(mem); // unpin, DOFORK, uncharge
        self.release_mtt(obj.shared.entries);
        obj.pd.put();
        for st in [&self.stats, crate::stats::process()] {
            st.deregistrations.fetch_add(1, Ordering::Relaxed);
            st.mrs_live.fetch_sub(1, Ordering::Relaxed);
            if obj.shared.pinned_bytes > 0 {
                st.unpinned(obj.shared.pinned_bytes);
            }
        }
    }

    /// `ibv_query_mr`-like: everything the device knows about an MR.
    pub fn query_mr(&self, lkey: u32) -> Result<MrInfo> {
        let g = self
            .mrs
            .get(lkey)
            .ok_or_else(|| err!(EINVAL, "no MR with key {lkey:#x}"))?;
        Ok(info_of(lkey, &g))
    }

    /// The MR object behind a key (for inspection: segments, frame numbers).
    pub fn mr_object(&self, lkey: u32) -> Option<MrObject> {
        self.mrs.get(lkey).map(|g| (*g).clone())
    }

    /// `ibv_rereg_mr`. `flags` is a combination of [`ReregFlags`] constants. Errors follow the
    /// library checks, then the kernel's (`docs/semantics.md` §4): flags 0 → EINVAL, unknown
    /// flags → EINVAL (libibverbs refuses them before the kernel, whose own check would say
    /// EOPNOTSUPP, is reached: what every libibverbs user on a ConnectX sees, and what the
    /// drop-in library answers), `access` without CHANGE_ACCESS → EINVAL, TRANSLATION with length 0 or
    /// address 0 → EINVAL, page-offset mismatch → EINVAL, access rules as reg_mr, unknown PD →
    /// EINVAL, upgrading a read-only pin to writable without a new translation → **EACCES**
    /// (CVE-2026-52908). PD/ACCESS changes keep the keys; TRANSLATION makes a new MR with new
    /// keys (returned). On error the old MR stays valid.
    #[allow(clippy::too_many_arguments)]
    pub fn rereg_mr(
        &self,
        lkey: u32,
        flags: u32,
        pd: u32,
        mem: UserMemory,
        iova: u64,
        access: AccessFlags,
    ) -> Result<MrInfo> {
        use ReregFlags as F;
        let (addr, length) = (mem.addr(), mem.len());
        if flags == 0 {
            return Err(err!(
                EINVAL,
                "rereg_mr with no flags changes nothing; pass CHANGE_*"
            ));
        }
        if flags & !F::SUPPORTED != 0 {
            return Err(err!(
                EINVAL,
                "unknown rereg flags {:#x}; only CHANGE_TRANSLATION|CHANGE_PD|CHANGE_ACCESS exist",
                flags & !F::SUPPORTED
            ));
        }
        let translation = flags & F::CHANGE_TRANSLATION != 0;
        let change_pd = flags & F::CHANGE_PD != 0;
        let change_access = flags & F::CHANGE_ACCESS != 0;
        if !change_access && !access.is_empty() {
            return Err(err!(
                EINVAL,
                "access given without CHANGE_ACCESS; add the flag or pass 0"
            ));
        }
        if translation && (length == 0 || addr == 0) {
            return Err(err!(
                EINVAL,
                "CHANGE_TRANSLATION needs a non-zero address and length"
            ));
        }
        let ps = mem::page_size() as u64;
        if translation && addr % ps != iova % ps {
            return Err(err!(
                EINVAL,
                "addr {addr:#x} and iova {iova:#x} have different offsets within the page"
            ));
        }
        let cur = self
            .mrs
            .get(lkey)
            .ok_or_else(|| err!(EINVAL, "no MR with key {lkey:#x}"))?;
        let new_access = if change_access { access } else { cur.access };
        if change_access {
            check_mr_access(self, new_access)?;
            check_driver_access(self, new_access)?;
        }
        let new_pd = if change_pd {
            self.pd(pd)?
        } else {
            cur.pd.clone()
        };
        if translation {
            let bound = cur.shared.bound_mws.load(Ordering::Acquire);
            if bound > 0 {
                return Err(err!(
                    EINVAL,
                    "MR {lkey:#x} has {bound} window(s) bound; unbind them before changing its \
                     translation"
                ));
            }
            drop(cur);
            let info = self.reg_mr(new_pd.handle, mem, iova, new_access)?;
            self.dereg_mr(lkey)?;
            return Ok(info);
        }
        if new_access.is_writable() && !cur.writable && cur.kind == MrKind::Pinned {
            return Err(err!(
                EACCES,
                "MR {lkey:#x} was pinned read-only; making it writable needs a new translation \
                 (CHANGE_TRANSLATION) or a new registration"
            ));
        }
        let mut obj = (*cur).clone();
        drop(cur);
        if change_pd && obj.pd.handle != new_pd.handle {
            new_pd.get();
            obj.pd.put();
            obj.pd = new_pd;
        }
        obj.access = new_access;
        if new_access.is_writable() {
            obj.writable = true;
        }
        let info = info_of(lkey, &obj);
        self.mrs
            .replace(lkey, obj)
            .map_err(|_| err!(EINVAL, "MR {lkey:#x} was deregistered concurrently"))?;
        Ok(info)
    }

    /// **The** access predicate. Every path that touches registered memory calls this: local
    /// SGEs (lkey), RETH/AtomicETH (rkey, MRs and windows), ODP faults, the C ABI.
    ///
    /// Checks, in order: exact key (index *and* generation), PD equality, every `need` bit
    /// present, object valid, `[iova, iova+len)` inside the MR (overflow-safe). Windows (keys
    /// with bit 31 set, remote use only) are checked by their own bounds and rights, then their
    /// parent MR. ODP MRs are faulted in here. Zero-length accesses are not checked (IBA
    /// C9-88; callers skip them).
    #[allow(clippy::too_many_arguments)]
    pub fn check_access(
        &self,
        key: u32,
        pd: u32,
        need: AccessFlags,
        iova: u64,
        len: u64,
        key_use: KeyUse,
        qp_num: u32,
    ) -> std::result::Result<MrGuard, AccessDenied> {
        let r = self.check_access_inner(key, pd, need, iova, len, key_use, qp_num);
        if let Err(d) = &r {
            crate::probes::access_denied(key, d, iova, len);
        }
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn check_access_inner(
        &self,
        key: u32,
        pd: u32,
        need: AccessFlags,
        iova: u64,
        len: u64,
        key_use: KeyUse,
        qp_num: u32,
    ) -> std::result::Result<MrGuard, AccessDenied> {
        if key & 0x8000_0000 != 0 {
            if key_use == KeyUse::Local {
                return Err(AccessDenied::NoSuchKey);
            }
            return self.check_window(key, pd, need, iova, len, qp_num);
        }
        let g = self.mrs.get(key).ok_or(AccessDenied::NoSuchKey)?;
        check_mr(g, pd, need, iova, len)
    }

    /// `ibv_advise_mr`: advice 0 = PREFETCH (read), 1 = PREFETCH_WRITE, 2 = PREFETCH_NO_FAULT;
    /// flag 1 = FLUSH (synchronous). Each SGE is `(lkey, addr, length)`. Unlike rxe (which needs
    /// LOCAL_WRITE even for a read prefetch), PREFETCH needs no right and PREFETCH_WRITE needs
    /// a writable MR (EPERM otherwise, the man page rule); a non-ODP MR is EINVAL (mlx5).
    pub fn advise_mr(
        &self,
        pd: u32,
        advice: u32,
        flags: u32,
        sges: &[(u32, u64, u32)],
    ) -> Result<()> {
        if advice > 2 {
            return Err(err!(
                EOPNOTSUPP,
                "unknown advice {advice}; use PREFETCH(_WRITE/_NO_FAULT)"
            ));
        }
        if flags & !1 != 0 {
            return Err(err!(EOPNOTSUPP, "unknown advise flags {:#x}", flags & !1));
        }
        let mut faults = 0;
        for &(lkey, addr, length) in sges {
            let g = self
                .mrs
                .get(lkey)
                .filter(|g| g.pd.handle == pd)
                .ok_or_else(|| err!(EINVAL, "advise_mr: no MR {lkey:#x} in PD {pd:#x}"))?;
            let Some(odp) = g.shared.odp.as_ref() else {
                return Err(err!(EINVAL, "advise_mr: MR {lkey:#x} is not an ODP MR"));
            };
            if advice == 1 && !g.writable {
                return Err(err!(EPERM, "PREFETCH_WRITE on read-only ODP MR {lkey:#x}"));
            }
            if !range_ok(g.iova, g.length, addr, u64::from(length)) {
                return Err(err!(EFAULT, "advise_mr: range outside MR {lkey:#x}"));
            }
            let va = g.addr + (addr - g.iova);
            match advice {
                2 => odp.record_present(va, u64::from(length)),
                _ => {
                    faults += odp.ensure(va, u64::from(length), advice == 1)?;
                }
            }
        }
        self.stats.odp_faults.fetch_add(faults, Ordering::Relaxed);
        Ok(())
    }

    /// Invalidate ODP translations covering `[va, va+len)` in every ODP MR of this device
    /// (what the kernel's MMU notifier does on munmap/madvise(DONTNEED)).
    pub fn odp_invalidate(&self, va: u64, len: u64) {
        for k in self.mrs.keys() {
            if let Some(g) = self.mrs.get(k) {
                if let Some(odp) = g.shared.odp.as_ref() {
                    odp.invalidate(va, len);
                }
            }
        }
    }
}

/// The MR half of the predicate (also used for a window's parent MR).
pub(crate) fn check_mr(
    g: Guard<MrObject>,
    pd: u32,
    need: AccessFlags,
    iova: u64,
    len: u64,
) -> std::result::Result<MrGuard, AccessDenied> {
    if g.pd.handle != pd {
        return Err(AccessDenied::WrongPd);
    }
    if !g.access.contains(need) {
        return Err(AccessDenied::MissingRights {
            need,
            have: g.access,
        });
    }
    if g.shared.memory.lock().is_none() && g.kind == MrKind::Pinned {
        return Err(AccessDenied::NotValid);
    }
    if !range_ok(g.iova, g.length, iova, len) {
        return Err(AccessDenied::OutOfRange);
    }
    let va = g.addr.wrapping_add(iova - g.iova);
    if let Some(odp) = g.shared.odp.as_ref() {
        let write = need.is_writable();
        let _ = odp
            .ensure(va, len, write)
            .map_err(|_| AccessDenied::Fault)?;
    }
    Ok(MrGuard { guard: g, va, len })
}

pub(crate) fn info_of(key: u32, o: &MrObject) -> MrInfo {
    MrInfo {
        lkey: key,
        rkey: key,
        pd: o.pd.handle,
        addr: o.addr,
        length: o.length,
        iova: o.iova,
        access: o.access,
        kind: o.kind,
        pin_path: o.shared.pin_path,
        writable: o.writable,
        page_size: o.shared.page_size,
        entries: o.shared.entries,
        pinned_bytes: o.shared.pinned_bytes,
        pfns_known: o.shared.pfns_known,
        bound_mws: o.shared.bound_mws.load(Ordering::Relaxed),
        reg_timing: o.shared.timing.get().copied(),
    }
}

fn pin_range(start: u64, span: u64, writable: bool) -> Result<Vec<Pin>> {
    let mut pins = Vec::with_capacity(1);
    let mut off = 0;
    while off < span {
        let n = (span - off).min(PIN_PIECE);
        pins.push(mem::pin::pin(start + off, n, writable).map_err(|e| pin_error(e, writable))?);
        off += n;
    }
    Ok(pins)
}

fn pin_error(e: Error, writable: bool) -> Error {
    if e.errno() == Errno::EFAULT && writable && !e.cause().contains("read-only") {
        Error::new(
            Errno::EFAULT,
            format!(
                "{}; if the mapping is read-only (PROT_READ or a read-only file), register it \
                 without LOCAL_WRITE/REMOTE_WRITE/REMOTE_ATOMIC/MW_BIND",
                e.cause()
            ),
        )
    } else {
        e
    }
}
