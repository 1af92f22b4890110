//! The rdma-core provider: any device of the system's `libibverbs.so.1` (mlx5, irdma, efa,
//! rxe, siw, ... or the project's own drop-in library) behind the same [`Provider`] trait as
//! the embedded `mrkit0`.
//!
//! The library is opened at run time ([`libloading`]), so mrkit builds and runs on a machine
//! without rdma-core: then [`devices`] lists none and opening one is one `ENODEV` error that
//! says why. The C structures are the shared ABI definitions ([`mrkit_verbs_abi`], checked
//! against the v44 headers); the verbs that `<infiniband/verbs.h>` implements inline
//! (`ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq`, `ibv_req_notify_cq`, `ibv_alloc_mw`,
//! `ibv_dealloc_mw`, `ibv_advise_mr`, `ibv_query_device_ex`) go through the context's ops
//! table and the `verbs_context` extension exactly as the header does. See
//! `docs/rdma-core.md`.
//!
//! Handles: PDs are `ibv_pd.handle`, MRs their lkey, windows the rkey they were allocated
//! with, CQs `ibv_cq.handle`, QPs their number, channels a number this provider assigns.
//!
//! `query_mr`: libibverbs has none; the provider answers from what it recorded at
//! registration. What only the kernel knows is marked unknown: `page_size`, `entries`,
//! `pinned_bytes` are 0, `pin_path` is `None`, `pfns_known` is false, `reg_timing` is `None`.
#![deny(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc)]

mod handles;
mod loader;
mod stats;
mod ticks;

use std::collections::HashMap;
use std::ffi::{c_int, c_void, CStr};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mrkit_soft::cq::{WcOpcode, WcStatus};
use mrkit_soft::mr::{MrKind, ReregFlags};
use mrkit_soft::mw::{BindInfo, MwInfo};
use mrkit_soft::qp::{attr_mask, send_flags};
use mrkit_soft::{AccessFlags, DeviceAttr, Errno, Error, MrInfo, MwType, Result, UserMemory};
use mrkit_verbs_abi::*;
use parking_lot::{Mutex, RwLock};

use crate::provider::{
    AddressVector, DeviceAttrEx, PortAttr, PostError, Provider, QpAttr, QpCap, QpInitAttr, RecvWr,
    SendWr, Wc, WrOpcode,
};

pub use loader::{configured_path, Library, DEFAULT_LIB, LIB_ENV};

/// The provider name in qualified device names (`rdma-core:mlx5_0`).
pub const PROVIDER: &str = "rdma-core";

/// A device the library lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaCoreDevice {
    /// `ibv_get_device_name`.
    pub name: String,
    /// `ibv_get_device_guid` (host order).
    pub node_guid: u64,
    /// `ibv_device.transport_type` (0 = IB, which RoCE devices report too).
    pub transport_type: i32,
    /// `ibv_device.node_type` (1 = CA).
    pub node_type: i32,
}

/// The library [`LIB_ENV`] names (else `libibverbs.so.1`), loaded once per process.
pub fn library() -> Result<&'static Library> {
    loader::load(&configured_path())
}

/// Load the library at `path` (once per path and process).
pub fn library_at(path: &str) -> Result<&'static Library> {
    loader::load(path)
}

/// The devices of `lib` (`ibv_get_device_list`).
pub fn devices(lib: &'static Library) -> Result<Vec<RdmaCoreDevice>> {
    let v = &lib.verbs;
    let mut n: c_int = 0;
    // SAFETY: a valid out-pointer; the list is freed below.
    let list = unsafe { (v.ibv_get_device_list)(&mut n) };
    if list.is_null() {
        return match std::io::Error::last_os_error().raw_os_error() {
            // rdma-core's answer when the kernel has no RDMA support (no ib_uverbs, no
            // /sys/class/infiniband): no devices, not a failure.
            Some(libc::ENOSYS) => Ok(Vec::new()),
            _ => Err(os_error("ibv_get_device_list")),
        };
    }
    let mut out = Vec::new();
    for i in 0..usize::try_from(n).unwrap_or(0) {
        // SAFETY: the list holds `n` valid device pointers until it is freed.
        let dev = unsafe { *list.add(i) };
        if dev.is_null() {
            break;
        }
        out.push(describe(lib, dev));
    }
    // SAFETY: the list from ibv_get_device_list, freed once.
    unsafe { (v.ibv_free_device_list)(list) };
    Ok(out)
}

fn describe(lib: &Library, dev: *mut ibv_device) -> RdmaCoreDevice {
    let v = &lib.verbs;
    // SAFETY: `dev` is a live device of the current list; the name is a NUL-terminated string
    // inside it (copied out at once).
    let name = unsafe {
        let p = (v.ibv_get_device_name)(dev);
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    // SAFETY: as above.
    let (guid, transport_type, node_type) = unsafe {
        (
            (v.ibv_get_device_guid)(dev),
            (*dev).transport_type,
            (*dev).node_type,
        )
    };
    RdmaCoreDevice {
        name,
        node_guid: u64::from_be(guid),
        transport_type,
        node_type,
    }
}

/// The errno value of the C call as an [`Errno`] (the device's own values, EIO and ENODEV
/// included; anything else the verbs API does not name becomes EIO, never a wrong value).
fn errno_of(e: i32) -> Errno {
    match e {
        libc::ENODEV => Errno::ENODEV,
        libc::EPERM
        | libc::ENOENT
        | libc::EAGAIN
        | libc::ENOMEM
        | libc::EACCES
        | libc::EFAULT
        | libc::EBUSY
        | libc::EINVAL
        | libc::EOVERFLOW
        | libc::EOPNOTSUPP
        | libc::ETIMEDOUT
        | libc::EADDRNOTAVAIL => Errno::from_raw_os(e),
        _ => Errno::EIO,
    }
}

fn errno_error(op: &str, e: i32) -> Error {
    Error::new(
        errno_of(e),
        format!(
            "{op} failed: {} (errno reported by the rdma-core device)",
            std::io::Error::from_raw_os_error(e)
        ),
    )
}

/// The error of a call that returned NULL / -1 with `errno` set.
fn os_error(op: &str) -> Error {
    let e = std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO);
    errno_error(op, if e == 0 { libc::EIO } else { e })
}

/// The error of a call returning an errno value (positive) or -1 with `errno` set.
fn ret_error(op: &str, ret: c_int) -> Error {
    if ret > 0 {
        errno_error(op, ret)
    } else {
        os_error(op)
    }
}

fn unsupported(op: &str) -> Error {
    Error::new(
        Errno::EOPNOTSUPP,
        format!("{op} is not supported by this rdma-core device"),
    )
}

/// Hashes the u32 handles of the data-path maps (QPs, CQs) with one multiplication: the
/// default SipHash costs tens of nanoseconds per lookup on every post and poll.
#[derive(Default)]
struct HandleHasher(u64);
impl std::hash::Hasher for HandleHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u32(&mut self, v: u32) {
        // Fibonacci hashing: the table uses the high bits too.
        self.0 = u64::from(v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}
type HandleMap<V> = HashMap<u32, V, std::hash::BuildHasherDefault<HandleHasher>>;

/// A pointer to a libibverbs object.
struct Ptr<T>(*mut T);
impl<T> Clone for Ptr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Ptr<T> {}
// SAFETY: libibverbs objects may be used from any thread (every verb is thread-safe, as
// rdma-core documents); the provider destroys each exactly once, after removing it from its map.
unsafe impl<T> Send for Ptr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Ptr<T> {}

/// What the provider records of an MR: the facts of [`MrInfo`] it can know, compactly (a
/// registration moves this into the table; [`MrRec::info`] builds the full answer when asked).
struct MrRec {
    mr: Ptr<ibv_mr>,
    /// The registered range (`addr`, `length`); keeps the memory's owner until deregistration.
    mem: UserMemory,
    iova: u64,
    access: AccessFlags,
    pd: u32,
    kind: MrKind,
    /// When it was registered ([`ticks::now`]), and how long `ibv_reg_mr` took in ns
    /// (`mrkit stat --mrs`).
    at: u64,
    took_ns: u64,
}

impl MrRec {
    /// The MR as [`Provider::query_mr`] reports it: keys read from the live `ibv_mr` (a
    /// re-registration may have changed them), what libibverbs cannot tell zero or `None`
    /// (see the module doc).
    fn info(&self) -> MrInfo {
        // SAFETY: a recorded MR is live (removed from the table before `ibv_dereg_mr` returns
        // success, and read only under the table's lock).
        let (lkey, rkey) = unsafe { ((*self.mr.0).lkey, (*self.mr.0).rkey) };
        MrInfo {
            lkey,
            rkey,
            pd: self.pd,
            addr: self.mem.addr(),
            length: self.mem.len(),
            iova: self.iova,
            access: self.access,
            kind: self.kind,
            pin_path: None,
            writable: self.kind == MrKind::Pinned && self.access.is_writable(),
            page_size: 0,
            entries: 0,
            pinned_bytes: 0,
            pfns_known: false,
            bound_mws: 0,
            reg_timing: None,
        }
    }
}

/// The MRs and the counters kept with them (see `stats.rs`); derefs to the map.
#[derive(Default)]
struct MrTable {
    map: HandleMap<MrRec>,
    counts: stats::Counts,
}

impl std::ops::Deref for MrTable {
    type Target = HandleMap<MrRec>;
    fn deref(&self) -> &HandleMap<MrRec> {
        &self.map
    }
}

impl std::ops::DerefMut for MrTable {
    fn deref_mut(&mut self) -> &mut HandleMap<MrRec> {
        &mut self.map
    }
}

struct MwRec {
    mw: Ptr<ibv_mw>,
    ty: MwType,
    pd: u32,
    /// What the provider's own `bind_mw` bound the window to (MR lkey, start, length,
    /// rights), after the bind completed. libibverbs cannot be asked; a type-1 window changes
    /// only through `bind_mw` (and its MR cannot be deregistered while it is bound), so this
    /// is exact for type 1. A type-2 window is bound by a work request on the caller's QP,
    /// which the provider does not follow: `None` there means "not known".
    bound: Option<(u32, u64, u64, AccessFlags)>,
}

/// An open rdma-core device.
pub struct RdmaCoreProvider {
    lib: &'static Library,
    name: String,
    ctx: Ptr<ibv_context>,
    attr: DeviceAttr,
    /// The rest of `ibv_query_device(_ex)`, queried at open.
    attr_ex: DeviceAttrEx,
    pds: Mutex<HandleMap<Ptr<ibv_pd>>>,
    /// Shared with the statistics export, which lists the live MRs when asked.
    mrs: Arc<Mutex<MrTable>>,
    /// This device's registration counters (`mrkit stat`).
    stats: Arc<stats::DeviceStats>,
    mws: Mutex<HandleMap<MwRec>>,
    channels: Mutex<HashMap<u32, Ptr<ibv_comp_channel>>>,
    /// Next channel number; only counts (Relaxed: no memory is published through it).
    next_channel: AtomicU32,
    cqs: RwLock<HandleMap<Ptr<ibv_cq>>>,
    qps: RwLock<HandleMap<Ptr<ibv_qp>>>,
    /// Lock-free data-path lookups in front of `pds`, `cqs`, `qps` (written under their
    /// locks; see `handles.rs`).
    pd_ix: handles::FastIndex,
    cq_ix: handles::FastIndex,
    qp_ix: handles::FastIndex,
    /// Per PD: the (CQ, QP) that executes type-1 window binds for [`Provider::bind_mw`].
    bind_qps: Mutex<HashMap<u32, (u32, u32)>>,
}

impl std::fmt::Debug for RdmaCoreProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaCoreProvider")
            .field("library", &self.lib.path)
            .field("name", &self.name)
            .finish()
    }
}

/// `verbs_get_ctx_op`: the extended op `$op` of the context, if the library provides it.
macro_rules! vctx_op {
    ($ctx:expr, $op:ident) => {{
        let ctx: *mut ibv_context = $ctx;
        // SAFETY: `ctx` is an open context. As `verbs_get_ctx` in verbs.h: an extended
        // context says so with `abi_compat == __VERBS_ABI_IS_EXTENDED` (all ones) and then
        // sits at the end of a `verbs_context`, whose `sz` tells how many of its ops (counted
        // from the end) exist.
        unsafe {
            if (*ctx).abi_compat as usize != usize::MAX {
                None
            } else {
                let vctx = ctx
                    .cast::<u8>()
                    .sub(std::mem::offset_of!(verbs_context, context))
                    .cast::<verbs_context>();
                let need =
                    std::mem::size_of::<verbs_context>() - std::mem::offset_of!(verbs_context, $op);
                if (*vctx).sz < need {
                    None
                } else {
                    (*vctx).$op
                }
            }
        }
    }};
}

impl RdmaCoreProvider {
    /// Open the device `name` of `lib`. ENODEV (listing the library's devices) when it has
    /// none of that name.
    pub fn open(lib: &'static Library, name: &str) -> Result<RdmaCoreProvider> {
        // This process's statistics export starts here (before the library opens a device of
        // its own, which may carry a second copy of the exporter: it joins this one).
        crate::stat_export::start_for_process();
        ticks::init();
        let v = &lib.verbs;
        let mut n: c_int = 0;
        // SAFETY: a valid out-pointer; the list is freed below.
        let list = unsafe { (v.ibv_get_device_list)(&mut n) };
        if list.is_null() {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENOSYS) {
                return Err(Error::new(
                    Errno::ENODEV,
                    format!(
                        "{} has no device {name:?}: the kernel has no RDMA support \
                         (ibv_get_device_list: {e}); load ib_uverbs and the NIC's driver",
                        lib.path
                    ),
                ));
            }
            return Err(os_error("ibv_get_device_list"));
        }
        let mut found = None;
        let mut names = Vec::new();
        for i in 0..usize::try_from(n).unwrap_or(0) {
            // SAFETY: `n` valid entries until the list is freed.
            let dev = unsafe { *list.add(i) };
            if dev.is_null() {
                break;
            }
            let d = describe(lib, dev);
            if d.name == name && found.is_none() {
                // SAFETY: a device of the live list (a context stays valid after the list is
                // freed, as libibverbs specifies).
                found = Some(unsafe { (v.ibv_open_device)(dev) });
            }
            names.push(d.name);
        }
        // SAFETY: freed once; the opened context does not depend on the list.
        unsafe { (v.ibv_free_device_list)(list) };
        let ctx = match found {
            None => {
                return Err(Error::new(
                    Errno::ENODEV,
                    format!(
                        "{} has no device {name:?} (it has: {})",
                        lib.path,
                        if names.is_empty() {
                            "none".into()
                        } else {
                            names.join(", ")
                        }
                    ),
                ))
            }
            Some(c) if c.is_null() => return Err(os_error("ibv_open_device")),
            Some(c) => c,
        };
        let mut p = RdmaCoreProvider {
            lib,
            name: name.to_string(),
            ctx: Ptr(ctx),
            // Replaced just below; built first so that a failed query drops `p`, which closes
            // the device.
            attr: mrkit_soft::DeviceConfig::rxe().attr().clone(),
            attr_ex: DeviceAttrEx::default(),
            pds: Mutex::new(HandleMap::default()),
            mrs: Arc::new(Mutex::new(MrTable::default())),
            stats: Arc::new(stats::DeviceStats {
                device: format!("{PROVIDER}:{name}"),
                library: lib.path.clone(),
                ..Default::default()
            }),
            mws: Mutex::new(HandleMap::default()),
            channels: Mutex::new(HashMap::new()),
            next_channel: AtomicU32::new(1),
            cqs: RwLock::new(HandleMap::default()),
            qps: RwLock::new(HandleMap::default()),
            pd_ix: handles::FastIndex::default(),
            cq_ix: handles::FastIndex::default(),
            qp_ix: handles::FastIndex::default(),
            bind_qps: Mutex::new(HashMap::new()),
        };
        (p.attr, p.attr_ex) = p.fetch_attr()?;
        let mrs = Arc::downgrade(&p.mrs);
        stats::track(
            &p.stats,
            Box::new(move |max| {
                let mrs = mrs.upgrade()?;
                let g = mrs.lock();
                let list = g
                    .values()
                    .take(max)
                    .map(|r| stats::LiveMr {
                        info: r.info(),
                        age: Duration::from_nanos(ticks::to_ns(ticks::now().wrapping_sub(r.at))),
                        reg: Duration::from_nanos(r.took_ns),
                    })
                    .collect();
                Some((list, g.len(), g.counts))
            }),
        );
        Ok(p)
    }

    /// The library this device was opened from.
    pub fn library(&self) -> &'static Library {
        self.lib
    }

    /// The `struct ibv_context *` (for code that calls libibverbs itself; it stays valid
    /// while this provider lives).
    pub fn raw_context(&self) -> *mut c_void {
        self.ctx.0.cast()
    }

    /// The `struct ibv_pd *` of PD handle `pd` (valid until it is deallocated).
    pub fn raw_pd(&self, pd: u32) -> Option<*mut c_void> {
        self.pds.lock().get(&pd).map(|p| p.0.cast())
    }

    /// The `struct ibv_cq *` of CQ `cq` (valid until it is destroyed).
    pub fn raw_cq(&self, cq: u32) -> Option<*mut c_void> {
        self.cqs.read().get(&cq).map(|p| p.0.cast())
    }

    /// The `struct ibv_qp *` of QP `qpn` (valid until it is destroyed).
    pub fn raw_qp(&self, qpn: u32) -> Option<*mut c_void> {
        self.qps.read().get(&qpn).map(|p| p.0.cast())
    }

    fn fetch_attr(&self) -> Result<(DeviceAttr, DeviceAttrEx)> {
        let v = &self.lib.verbs;
        // SAFETY: all-zero is a valid value of these plain C structs.
        let mut a: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: open context, valid out-pointer.
        let r = unsafe { (v.ibv_query_device)(self.ctx.0, &mut a) };
        if r != 0 {
            return Err(ret_error("ibv_query_device", r));
        }
        // As the header's inline `ibv_query_device_ex`: the extended op if the context has it;
        // a missing op, EOPNOTSUPP or ENOSYS means the legacy path (the extension all zeros).
        // Any other failure is treated the same (the basic attributes above are known).
        // SAFETY: all-zero is a valid value of these plain C structs.
        let mut ex: ibv_device_attr_ex = unsafe { std::mem::zeroed() };
        let mut extended = false;
        if let Some(q) = vctx_op!(self.ctx.0, query_device_ex) {
            let input = ibv_query_device_ex_input { comp_mask: 0 };
            // SAFETY: the header's `ibv_query_device_ex`: open context, valid pointers, the
            // size of our structure.
            let r = unsafe {
                q(
                    self.ctx.0,
                    &input,
                    &mut ex,
                    std::mem::size_of::<ibv_device_attr_ex>(),
                )
            };
            if r == 0 {
                extended = true;
            } else {
                // SAFETY: all-zero is a valid value of this plain C struct.
                ex = unsafe { std::mem::zeroed() };
            }
        }
        let (odp_general, odp_rc) = (
            ex.odp_caps.general_caps,
            ex.odp_caps.per_transport_caps.rc_odp_caps,
        );
        // SAFETY: an open context (read once: libibverbs sets it at open).
        let num_comp_vectors = unsafe { (*self.ctx.0).num_comp_vectors };
        let attr_ex = DeviceAttrEx {
            max_ee_rd_atom: a.max_ee_rd_atom,
            max_ee_init_rd_atom: a.max_ee_init_rd_atom,
            max_ee: a.max_ee,
            max_rdd: a.max_rdd,
            max_raw_ipv6_qp: a.max_raw_ipv6_qp,
            max_raw_ethy_qp: a.max_raw_ethy_qp,
            max_mcast_grp: a.max_mcast_grp,
            max_mcast_qp_attach: a.max_mcast_qp_attach,
            max_total_mcast_qp_attach: a.max_total_mcast_qp_attach,
            max_ah: a.max_ah,
            max_fmr: a.max_fmr,
            max_map_per_fmr: a.max_map_per_fmr,
            extended,
            uc_odp_caps: ex.odp_caps.per_transport_caps.uc_odp_caps,
            ud_odp_caps: ex.odp_caps.per_transport_caps.ud_odp_caps,
            xrc_odp_caps: ex.xrc_odp_caps,
            completion_timestamp_mask: ex.completion_timestamp_mask,
            hca_core_clock: ex.hca_core_clock,
            device_cap_flags_ex: ex.device_cap_flags_ex,
            raw_packet_caps: ex.raw_packet_caps,
            max_tso: ex.tso_caps.max_tso,
            tso_supported_qpts: ex.tso_caps.supported_qpts,
            rss_supported_qpts: ex.rss_caps.supported_qpts,
            max_rwq_indirection_tables: ex.rss_caps.max_rwq_indirection_tables,
            max_rwq_indirection_table_size: ex.rss_caps.max_rwq_indirection_table_size,
            rx_hash_fields_mask: ex.rss_caps.rx_hash_fields_mask,
            rx_hash_function: ex.rss_caps.rx_hash_function,
            max_wq_type_rq: ex.max_wq_type_rq,
            qp_rate_limit_min: ex.packet_pacing_caps.qp_rate_limit_min,
            qp_rate_limit_max: ex.packet_pacing_caps.qp_rate_limit_max,
            packet_pacing_supported_qpts: ex.packet_pacing_caps.supported_qpts,
            tm_max_rndv_hdr_size: ex.tm_caps.max_rndv_hdr_size,
            tm_max_num_tags: ex.tm_caps.max_num_tags,
            tm_flags: ex.tm_caps.flags,
            tm_max_ops: ex.tm_caps.max_ops,
            tm_max_sge: ex.tm_caps.max_sge,
            max_cq_count: ex.cq_mod_caps.max_cq_count,
            max_cq_period: ex.cq_mod_caps.max_cq_period,
            max_dm_size: ex.max_dm_size,
            pci_atomic_fetch_add: ex.pci_atomic_caps.fetch_add,
            pci_atomic_swap: ex.pci_atomic_caps.swap,
            pci_atomic_compare_swap: ex.pci_atomic_caps.compare_swap,
            phys_port_cnt_ex: ex.phys_port_cnt_ex,
            num_comp_vectors,
        };
        // SAFETY: all-zero is a valid value of this plain C struct.
        let mut port: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the exported compat entry fills at most its 48-byte prefix of our struct.
        let max_msg_sz = if unsafe { (v.ibv_query_port)(self.ctx.0, 1, &mut port) } == 0 {
            port.max_msg_sz
        } else {
            0
        };
        let u = |x: c_int| u32::try_from(x).unwrap_or(0);
        let fw = a
            .fw_ver
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect::<Vec<_>>();
        Ok((
            DeviceAttr {
                fw_ver: String::from_utf8_lossy(&fw).into_owned(),
                node_guid: u64::from_be(a.node_guid),
                sys_image_guid: u64::from_be(a.sys_image_guid),
                max_mr_size: a.max_mr_size,
                page_size_cap: a.page_size_cap,
                vendor_id: a.vendor_id,
                vendor_part_id: a.vendor_part_id,
                hw_ver: a.hw_ver,
                max_qp: u(a.max_qp),
                max_qp_wr: u(a.max_qp_wr),
                device_cap_flags: u64::from(a.device_cap_flags),
                max_sge: u(a.max_sge),
                max_sge_rd: u(a.max_sge_rd),
                max_cq: u(a.max_cq),
                max_cqe: u(a.max_cqe),
                max_mr: u(a.max_mr),
                max_pd: u(a.max_pd),
                max_qp_rd_atom: u(a.max_qp_rd_atom),
                max_qp_init_rd_atom: u(a.max_qp_init_rd_atom),
                max_res_rd_atom: u(a.max_res_rd_atom),
                atomic_cap: u(a.atomic_cap),
                max_mw: u(a.max_mw),
                max_srq: u(a.max_srq),
                max_srq_wr: u(a.max_srq_wr),
                max_srq_sge: u(a.max_srq_sge),
                max_pkeys: a.max_pkeys,
                local_ca_ack_delay: a.local_ca_ack_delay,
                phys_port_cnt: a.phys_port_cnt,
                // libibverbs reports no device-wide inline limit (a QP's cap says it).
                max_inline_data: 0,
                odp_general_caps: odp_general,
                odp_rc_caps: odp_rc,
                // The translation capacity is not in the verbs API (0 = unknown).
                max_mtt: 0,
                log_num_mtt: 0,
                max_msg_sz,
            },
            attr_ex,
        ))
    }

    #[inline]
    fn pd(&self, pd: u32) -> Result<Ptr<ibv_pd>> {
        indexed(&self.pd_ix, pd, "protection domain", |h| {
            self.pds.lock().get(&h).copied()
        })
    }

    #[inline]
    fn cq(&self, cq: u32) -> Result<Ptr<ibv_cq>> {
        indexed(&self.cq_ix, cq, "completion queue", |h| {
            self.cqs.read().get(&h).copied()
        })
    }

    #[inline]
    fn qp(&self, qpn: u32) -> Result<Ptr<ibv_qp>> {
        indexed(&self.qp_ix, qpn, "queue pair", |h| {
            self.qps.read().get(&h).copied()
        })
    }

    fn channel(&self, ch: u32) -> Result<Ptr<ibv_comp_channel>> {
        self.channels
            .lock()
            .get(&ch)
            .copied()
            .ok_or_else(|| Error::new(Errno::EINVAL, format!("no completion channel {ch}")))
    }

    fn mw_by_rkey(&self, rkey: u32) -> Option<Ptr<ibv_mw>> {
        let g = self.mws.lock();
        if let Some(r) = g.get(&rkey) {
            return Some(r.mw);
        }
        // A bound window's rkey changed: find it by its current key.
        // SAFETY: every window in the map is live.
        g.values()
            .find(|r| unsafe { (*r.mw.0).rkey } == rkey)
            .map(|r| r.mw)
    }

    fn reg_mr_inner(
        &self,
        pd: u32,
        mem: UserMemory,
        iova: u64,
        access: AccessFlags,
    ) -> Result<MrInfo> {
        let p = self.pd(pd)?;
        let len = usize::try_from(mem.len())
            .map_err(|_| Error::new(Errno::EINVAL, "length does not fit the address space"))?;
        let at = ticks::now();
        // SAFETY: a live PD; `mem` guarantees the range stays valid until dereg (we keep it).
        let mr = unsafe {
            (self.lib.verbs.ibv_reg_mr_iova2)(
                p.0,
                mem.addr() as usize as *mut c_void,
                len,
                iova,
                access.bits(),
            )
        };
        if mr.is_null() {
            return Err(os_error("ibv_reg_mr"));
        }
        let took_ns = ticks::to_ns(ticks::now().wrapping_sub(at));
        Ok(self.record_mr(pd, mr, mem, iova, access, (at, took_ns)))
    }

    fn record_mr(
        &self,
        pd: u32,
        mr: *mut ibv_mr,
        mem: UserMemory,
        iova: u64,
        access: AccessFlags,
        (at, took_ns): (u64, u64),
    ) -> MrInfo {
        let kind = if !access.contains(AccessFlags::ON_DEMAND) {
            MrKind::Pinned
        } else if mem.addr() == 0 && mem.len() == u64::MAX {
            MrKind::ImplicitOdp
        } else {
            MrKind::Odp
        };
        let rec = MrRec {
            mr: Ptr(mr),
            mem,
            iova,
            access,
            pd,
            kind,
            at,
            took_ns,
        };
        let info = rec.info();
        let mut g = self.mrs.lock();
        g.counts.registered(info.length, took_ns);
        g.insert(info.lkey, rec);
        info
    }
}

impl RdmaCoreProvider {
    /// The QP of `pd` that executes binds: an RC QP connected to itself (RTS), created on
    /// first use. A type-1 window is bound by `ibv_bind_mw` on a QP of the window's PD, which
    /// posts the bind on that QP's send queue; mrkit0 binds directly.
    fn bind_qp(&self, pd: u32) -> Result<(u32, u32)> {
        let cq = self.create_cq(4, None)?;
        let made = self.create_qp(QpInitAttr {
            pd,
            send_cq: cq,
            recv_cq: cq,
            cap: QpCap {
                max_send_wr: 4,
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            sq_sig_all: false,
        });
        let qpn = match made {
            Ok((qpn, _)) => qpn,
            Err(e) => {
                let _ = self.destroy_cq(cq);
                return Err(e);
            }
        };
        let up = || -> Result<()> {
            use mrkit_soft::qp::QpState;
            let init = QpAttr {
                qp_state: QpState::Init as u32,
                port_num: 1,
                ..QpAttr::default()
            };
            self.modify_qp(
                qpn,
                &init,
                attr_mask::STATE
                    | attr_mask::PKEY_INDEX
                    | attr_mask::PORT
                    | attr_mask::ACCESS_FLAGS,
            )?;
            let rtr = QpAttr {
                qp_state: QpState::Rtr as u32,
                ah_attr: self.local_av()?,
                path_mtu: 3,
                dest_qp_num: qpn,
                rq_psn: 0,
                max_dest_rd_atomic: 1,
                min_rnr_timer: 12,
                ..QpAttr::default()
            };
            self.modify_qp(
                qpn,
                &rtr,
                attr_mask::STATE
                    | attr_mask::AV
                    | attr_mask::PATH_MTU
                    | attr_mask::DEST_QPN
                    | attr_mask::RQ_PSN
                    | attr_mask::MAX_DEST_RD_ATOMIC
                    | attr_mask::MIN_RNR_TIMER,
            )?;
            let rts = QpAttr {
                qp_state: QpState::Rts as u32,
                timeout: 14,
                retry_cnt: 7,
                rnr_retry: 7,
                sq_psn: 0,
                max_rd_atomic: 1,
                ..QpAttr::default()
            };
            self.modify_qp(
                qpn,
                &rts,
                attr_mask::STATE
                    | attr_mask::TIMEOUT
                    | attr_mask::RETRY_CNT
                    | attr_mask::RNR_RETRY
                    | attr_mask::SQ_PSN
                    | attr_mask::MAX_QP_RD_ATOMIC,
            )
        };
        if let Err(e) = up() {
            let _ = self.destroy_qp(qpn);
            let _ = self.destroy_cq(cq);
            return Err(e);
        }
        Ok((cq, qpn))
    }

    /// Destroy `pd`'s bind QP, if it has one.
    fn drop_bind_qp(&self, g: &mut HashMap<u32, (u32, u32)>, pd: u32) {
        if let Some((cq, qpn)) = g.remove(&pd) {
            if let Err(e) = self.destroy_qp(qpn).and_then(|()| self.destroy_cq(cq)) {
                tracing::warn!(error = %e, "could not destroy a window-bind QP");
            }
        }
    }
}

fn wc_status(s: u32) -> WcStatus {
    use WcStatus::*;
    match s {
        0 => Success,
        1 => LocLenErr,
        2 => LocQpOpErr,
        3 => LocEecOpErr,
        4 => LocProtErr,
        5 => WrFlushErr,
        6 => MwBindErr,
        7 => BadRespErr,
        8 => LocAccessErr,
        9 => RemInvReqErr,
        10 => RemAccessErr,
        11 => RemOpErr,
        12 => RetryExcErr,
        13 => RnrRetryExcErr,
        14 => LocRddViolErr,
        15 => RemInvRdReqErr,
        16 => RemAbortErr,
        17 => InvEecnErr,
        18 => InvEecStateErr,
        19 => FatalErr,
        20 => RespTimeoutErr,
        _ => GeneralErr,
    }
}

/// `enum ibv_wc_opcode` → [`WcOpcode`]. Opcodes `WcOpcode` has no name for (TSO, FLUSH,
/// ATOMIC_WRITE, driver-private) read as `Send`; RC work requests of this API never produce
/// them.
fn wc_opcode(o: u32) -> WcOpcode {
    use WcOpcode::*;
    match o {
        1 => RdmaWrite,
        2 => RdmaRead,
        3 => CompSwap,
        4 => FetchAdd,
        5 => BindMw,
        6 => LocalInv,
        128 => Recv,
        129 => RecvRdmaWithImm,
        _ => Send,
    }
}

fn wc_from_c(w: &ibv_wc) -> Wc {
    let with_imm = w.wc_flags & mrkit_soft::cq::WC_WITH_IMM != 0;
    Wc {
        wr_id: w.wr_id,
        status: wc_status(w.status),
        opcode: wc_opcode(w.opcode),
        vendor_err: w.vendor_err,
        byte_len: w.byte_len,
        // `imm_data` is big-endian on the C side, host order in `Wc`; an invalidated rkey is
        // host order on both.
        imm_data: if with_imm {
            u32::from_be(w.imm_data)
        } else {
            w.imm_data
        },
        qp_num: w.qp_num,
        src_qp: w.src_qp,
        wc_flags: w.wc_flags,
    }
}

fn av_to_c(av: &AddressVector) -> Result<ibv_ah_attr> {
    let Some(ip) = av.dgid else {
        return Err(Error::new(
            Errno::EINVAL,
            "an rdma-core device reaches its peers by GID: the address vector has none \
             (mrkit0's in-process node addresses do not exist there)",
        ));
    };
    Ok(ibv_ah_attr {
        grh: ibv_global_route {
            dgid: ibv_gid {
                raw: mrkit_soft::net::udp::gid_of(ip),
            },
            hop_limit: 1,
            ..Default::default()
        },
        is_global: 1,
        port_num: av.port_num,
        ..Default::default()
    })
}

fn cap_to_c(c: &QpCap) -> ibv_qp_cap {
    ibv_qp_cap {
        max_send_wr: c.max_send_wr,
        max_recv_wr: c.max_recv_wr,
        max_send_sge: c.max_send_sge,
        max_recv_sge: c.max_recv_sge,
        max_inline_data: c.max_inline_data,
    }
}

fn cap_from_c(c: &ibv_qp_cap) -> QpCap {
    QpCap {
        max_send_wr: c.max_send_wr,
        max_recv_wr: c.max_recv_wr,
        max_send_sge: c.max_send_sge,
        max_recv_sge: c.max_recv_sge,
        max_inline_data: c.max_inline_data,
    }
}

/// SGEs of one post kept on the stack up to this many (then the heap).
const STACK_SGES: usize = 8;

impl RdmaCoreProvider {
    /// Translate `w` into `c` (its gather list in `sges`, which must not move until posted).
    #[inline]
    fn send_wr_to_c(&self, w: &SendWr, c: &mut ibv_send_wr, sges: &mut [ibv_sge]) -> Result<()> {
        let inline = w.flags & send_flags::INLINE != 0;
        let n = if inline && w.inline_data.is_empty() {
            0 // an empty inline message: the gather list is ignored, as on mrkit0
        } else if inline {
            // INLINE: the message is `inline_data` (the gather list is ignored); the library
            // copies the bytes at post time from the gather list it is given.
            sges[0] = ibv_sge {
                addr: w.inline_data.as_ptr() as u64,
                length: u32::try_from(w.inline_data.len())
                    .map_err(|_| Error::new(Errno::EINVAL, "inline data too long"))?,
                lkey: 0,
            };
            1
        } else {
            for (d, s) in sges.iter_mut().zip(&w.sg_list) {
                *d = ibv_sge {
                    addr: s.addr,
                    length: s.length,
                    lkey: s.lkey,
                };
            }
            w.sg_list.len()
        };
        c.wr_id = w.wr_id;
        c.next = std::ptr::null_mut();
        c.sg_list = if n == 0 {
            std::ptr::null_mut()
        } else {
            sges.as_mut_ptr()
        };
        c.num_sge = c_int::try_from(n).map_err(|_| Error::new(Errno::EINVAL, "too many SGEs"))?;
        c.opcode = w.opcode as u32;
        c.send_flags = w.flags;
        (c.imm_data, c.wr) = send_wr_words(w);
        c.bind_mw = [0; 6];
        if w.opcode == WrOpcode::BindMw {
            let b = w
                .bind
                .as_ref()
                .ok_or_else(|| Error::new(Errno::EINVAL, "BIND_MW without a bind"))?;
            let mw = self
                .mw_by_rkey(b.mw_rkey)
                .ok_or_else(|| Error::new(Errno::EINVAL, "BIND_MW of an unknown window"))?;
            let mr = if b.info.length == 0 {
                std::ptr::null_mut()
            } else {
                self.mrs
                    .lock()
                    .get(&b.info.mr_lkey)
                    .map_or(std::ptr::null_mut(), |r| r.mr.0)
            };
            // SAFETY: a live window of this provider.
            let cur = unsafe { (*mw.0).rkey };
            c.bind_mw = [
                mw.0 as u64,
                u64::from((cur & !0xff) | u32::from(b.new_key)),
                mr as u64,
                b.info.addr,
                b.info.length,
                u64::from(b.info.access.bits()),
            ];
        }
        Ok(())
    }
}

/// The object of handle `h`: from the lock-free index, else (a slot shared with another
/// handle) from the provider's map through `map`, the authority; EINVAL naming `what` when
/// neither has it.
#[inline]
fn indexed<T>(
    ix: &handles::FastIndex,
    h: u32,
    what: &str,
    map: impl FnOnce(u32) -> Option<Ptr<T>>,
) -> Result<Ptr<T>> {
    match ix.get(h) {
        Some(a) => Ok(Ptr(a as *mut T)),
        None => not_indexed(h, what, map),
    }
}

#[cold]
fn not_indexed<T>(h: u32, what: &str, map: impl FnOnce(u32) -> Option<Ptr<T>>) -> Result<Ptr<T>> {
    map(h).ok_or_else(|| Error::new(Errno::EINVAL, format!("no {what} {h}")))
}

/// `ibv_send_wr`'s `imm_data` (immediate data in network order, or the rkey to invalidate)
/// and its `wr` union for RDMA and atomic requests (zero for the others).
#[inline]
fn send_wr_words(w: &SendWr) -> (u32, [u64; 4]) {
    let imm = match w.opcode {
        WrOpcode::RdmaWriteWithImm | WrOpcode::SendWithImm => w.imm_data.to_be(),
        WrOpcode::SendWithInv | WrOpcode::LocalInv => w.invalidate_rkey,
        _ => 0,
    };
    let words = match w.opcode {
        WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm | WrOpcode::RdmaRead => {
            [w.remote_addr, u64::from(w.rkey), 0, 0]
        }
        WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => {
            [w.remote_addr, w.compare_add, w.swap, u64::from(w.rkey)]
        }
        _ => [0; 4],
    };
    (imm, words)
}

fn empty_send_wr() -> ibv_send_wr {
    ibv_send_wr {
        wr_id: 0,
        next: std::ptr::null_mut(),
        sg_list: std::ptr::null_mut(),
        num_sge: 0,
        opcode: 0,
        send_flags: 0,
        imm_data: 0,
        wr: [0; 4],
        qp_type: 0,
        _pad: 0,
        bind_mw: [0; 6],
    }
}

const ZERO_SGE: ibv_sge = ibv_sge {
    addr: 0,
    length: 0,
    lkey: 0,
};

impl Provider for RdmaCoreProvider {
    fn registration_counts(&self) -> Option<crate::provider::RegCounts> {
        let registrations = self.mrs.lock().counts.registrations;
        let failures = self
            .stats
            .failures
            .snapshot()
            .failures
            .iter()
            .map(|(_, n)| n)
            .sum();
        Some(crate::provider::RegCounts {
            registrations,
            failures,
        })
    }
    fn name(&self) -> &str {
        &self.name
    }
    fn query_device(&self) -> DeviceAttr {
        self.attr.clone()
    }
    fn query_device_ex(&self) -> DeviceAttrEx {
        self.attr_ex
    }
    fn alloc_pd(&self) -> Result<u32> {
        // SAFETY: open context.
        let pd = unsafe { (self.lib.verbs.ibv_alloc_pd)(self.ctx.0) };
        if pd.is_null() {
            return Err(os_error("ibv_alloc_pd"));
        }
        // SAFETY: a live PD.
        let h = unsafe { (*pd).handle };
        let mut g = self.pds.lock();
        g.insert(h, Ptr(pd));
        self.pd_ix.insert(h, pd as usize);
        Ok(h)
    }
    fn dealloc_pd(&self, pd: u32) -> Result<()> {
        self.drop_bind_qp(&mut self.bind_qps.lock(), pd);
        let mut g = self.pds.lock();
        let p = *g
            .get(&pd)
            .ok_or_else(|| Error::new(Errno::EINVAL, format!("no protection domain {pd}")))?;
        self.pd_ix.remove(pd);
        // SAFETY: a live PD of this provider (removed from the map only on success).
        let r = unsafe { (self.lib.verbs.ibv_dealloc_pd)(p.0) };
        if r != 0 {
            self.pd_ix.insert(pd, p.0 as usize);
            return Err(ret_error("ibv_dealloc_pd", r));
        }
        g.remove(&pd);
        Ok(())
    }
    fn reg_mr(&self, pd: u32, mem: UserMemory, iova: u64, access: AccessFlags) -> Result<MrInfo> {
        let r = self.reg_mr_inner(pd, mem, iova, access);
        if let Err(e) = &r {
            self.stats.failed(e.errno());
        }
        r
    }
    fn dereg_mr(&self, lkey: u32) -> Result<()> {
        let mut g = self.mrs.lock();
        // Taken out first (one lookup), filed back if the library refuses.
        let rec = g
            .remove(&lkey)
            .ok_or_else(|| Error::new(Errno::EINVAL, format!("no memory region {lkey:#x}")))?;
        // SAFETY: a live MR of this provider (forgotten only on success).
        let r = unsafe { (self.lib.verbs.ibv_dereg_mr)(rec.mr.0) };
        if r != 0 {
            g.insert(lkey, rec);
            return Err(ret_error("ibv_dereg_mr", r));
        }
        g.counts.deregistered(rec.mem.len());
        // The memory's owner is released after the lock.
        drop(g);
        drop(rec);
        Ok(())
    }
    fn rereg_mr(
        &self,
        lkey: u32,
        flags: u32,
        pd: u32,
        mem: UserMemory,
        iova: u64,
        access: AccessFlags,
    ) -> Result<MrInfo> {
        let mut g = self.mrs.lock();
        let mut rec = g
            .remove(&lkey)
            .ok_or_else(|| Error::new(Errno::EINVAL, format!("no memory region {lkey:#x}")))?;
        let new_pd = if flags & ReregFlags::CHANGE_PD != 0 {
            match self.pd(pd) {
                Ok(p) => p.0,
                Err(e) => {
                    g.insert(lkey, rec);
                    return Err(e);
                }
            }
        } else {
            std::ptr::null_mut()
        };
        let translate = flags & ReregFlags::CHANGE_TRANSLATION != 0;
        let len = usize::try_from(mem.len()).unwrap_or(usize::MAX);
        // SAFETY: a live MR and PD; with CHANGE_TRANSLATION `mem` guarantees the new range
        // (kept below on success).
        let r = unsafe {
            (self.lib.verbs.ibv_rereg_mr)(
                rec.mr.0,
                flags as c_int,
                new_pd,
                mem.addr() as usize as *mut c_void,
                len,
                access.bits() as c_int,
            )
        };
        if r != 0 {
            let e = os_error("ibv_rereg_mr");
            // IBV_REREG_MR_ERR_CMD_AND_DO_FORK_NEW and similar leave the MR unusable; every
            // other failure leaves the old MR as it was.
            g.insert(lkey, rec);
            return Err(e);
        }
        if flags & ReregFlags::CHANGE_PD != 0 {
            rec.pd = pd;
        }
        if flags & ReregFlags::CHANGE_ACCESS != 0 {
            rec.access = access;
        }
        if translate {
            g.counts.rereg_translation(rec.mem.len(), mem.len());
            rec.mem = mem;
            rec.iova = iova;
        }
        // Keys may have changed: the record is filed under the new lkey.
        let info = rec.info();
        g.insert(info.lkey, rec);
        Ok(info)
    }
    fn query_mr(&self, lkey: u32) -> Result<MrInfo> {
        self.mrs
            .lock()
            .get(&lkey)
            .map(MrRec::info)
            .ok_or_else(|| Error::new(Errno::EINVAL, format!("no memory region {lkey:#x}")))
    }
    fn advise_mr(&self, pd: u32, advice: u32, flags: u32, sges: &[(u32, u64, u32)]) -> Result<()> {
        let p = self.pd(pd)?;
        let Some(op) = vctx_op!(self.ctx.0, advise_mr) else {
            return Err(unsupported("ibv_advise_mr"));
        };
        let mut list: Vec<ibv_sge> = sges
            .iter()
            .map(|&(lkey, addr, length)| ibv_sge { addr, length, lkey })
            .collect();
        let n =
            u32::try_from(list.len()).map_err(|_| Error::new(Errno::EINVAL, "too many SGEs"))?;
        // SAFETY: a live PD; `list` valid for `n` entries during the call.
        let r = unsafe { op(p.0, advice, flags, list.as_mut_ptr(), n) };
        if r != 0 {
            return Err(ret_error("ibv_advise_mr", r));
        }
        Ok(())
    }
    fn alloc_mw(&self, pd: u32, ty: MwType) -> Result<u32> {
        let p = self.pd(pd)?;
        // SAFETY: open context; reading its ops table as the header's inline ibv_alloc_mw.
        let Some(op) = (unsafe { (*self.ctx.0).ops.alloc_mw }) else {
            return Err(unsupported("ibv_alloc_mw"));
        };
        let t = match ty {
            MwType::Type1 => 1,
            MwType::Type2 => 2,
        };
        // SAFETY: a live PD.
        let mw = unsafe { op(p.0, t) };
        if mw.is_null() {
            return Err(os_error("ibv_alloc_mw"));
        }
        // SAFETY: a live window.
        let rkey = unsafe { (*mw).rkey };
        self.mws.lock().insert(
            rkey,
            MwRec {
                mw: Ptr(mw),
                ty,
                pd,
                bound: None,
            },
        );
        Ok(rkey)
    }
    fn dealloc_mw(&self, rkey: u32) -> Result<()> {
        let mut g = self.mws.lock();
        let rec = g
            .get(&rkey)
            .ok_or_else(|| Error::new(Errno::EINVAL, format!("no memory window {rkey:#x}")))?;
        // SAFETY: open context; its ops table as the header's inline ibv_dealloc_mw.
        let Some(op) = (unsafe { (*self.ctx.0).ops.dealloc_mw }) else {
            return Err(unsupported("ibv_dealloc_mw"));
        };
        // SAFETY: a live window (forgotten only on success).
        let r = unsafe { op(rec.mw.0) };
        if r != 0 {
            return Err(ret_error("ibv_dealloc_mw", r));
        }
        g.remove(&rkey);
        Ok(())
    }
    fn query_mw(&self, rkey: u32) -> Result<MwInfo> {
        let g = self.mws.lock();
        // By the rkey it was allocated with, or by its current one (as mrkit0 answers: a
        // bound window's key is the one its users hold).
        let rec = g
            .get(&rkey)
            // SAFETY: every window in the map is live.
            .or_else(|| g.values().find(|r| unsafe { (*r.mw.0).rkey } == rkey))
            .ok_or_else(|| Error::new(Errno::EINVAL, format!("no memory window {rkey:#x}")))?;
        // SAFETY: a live window.
        let cur = unsafe { (*rec.mw.0).rkey };
        // libibverbs does not say what a window is bound to: the provider's own record.
        Ok(MwInfo {
            rkey: cur,
            mw_type: rec.ty,
            pd: rec.pd,
            bound: rec.bound,
        })
    }
    fn bind_mw(
        &self,
        qp_pd: u32,
        _qp_num: u32,
        rkey: u32,
        _new_key: u8,
        info: BindInfo,
    ) -> Result<u32> {
        // A type-1 bind through `ibv_bind_mw` on the PD's own bind QP, waited for. The new
        // key is the library's (`ibv_inc_rkey`), not `_new_key`: libibverbs picks it.
        let mw = self
            .mw_by_rkey(rkey)
            .ok_or_else(|| Error::new(Errno::EINVAL, format!("no memory window {rkey:#x}")))?;
        let mr = if info.length == 0 {
            std::ptr::null_mut()
        } else {
            self.mrs
                .lock()
                .get(&info.mr_lkey)
                .map(|r| r.mr.0)
                .ok_or_else(|| {
                    Error::new(
                        Errno::EINVAL,
                        format!("no memory region {:#x}", info.mr_lkey),
                    )
                })?
        };
        // SAFETY: open context; its ops table as the header's inline ibv_bind_mw.
        let Some(op) = (unsafe { (*self.ctx.0).ops.bind_mw }) else {
            return Err(unsupported("ibv_bind_mw"));
        };
        let mut g = self.bind_qps.lock();
        let (cq, qpn) = match g.get(&qp_pd) {
            Some(&v) => v,
            None => {
                let v = self.bind_qp(qp_pd)?;
                g.insert(qp_pd, v);
                v
            }
        };
        let qp = self.qp(qpn)?;
        let mut bind = ibv_mw_bind {
            wr_id: u64::from(rkey),
            send_flags: send_flags::SIGNALED,
            mr,
            addr: info.addr,
            length: info.length,
            mw_access_flags: info.access.bits(),
        };
        // SAFETY: live QP, window and MR (or NULL to unbind); `bind` valid for the call.
        let r = unsafe { op(qp.0.cast(), mw.0, (&mut bind as *mut ibv_mw_bind).cast()) };
        if r != 0 {
            return Err(ret_error("ibv_bind_mw", r));
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut wcs = Vec::with_capacity(1);
        while wcs.is_empty() {
            self.poll_cq(cq, &mut wcs, 1)?;
            if wcs.is_empty() {
                if std::time::Instant::now() >= deadline {
                    // The QP's state is unknown now: start over with a fresh one next time.
                    self.drop_bind_qp(&mut g, qp_pd);
                    return Err(Error::new(
                        Errno::ETIMEDOUT,
                        "the window bind did not complete within 10 s",
                    ));
                }
                std::thread::yield_now();
            }
        }
        if wcs[0].status != WcStatus::Success {
            // A failed bind moved the QP to ERR.
            self.drop_bind_qp(&mut g, qp_pd);
            return Err(Error::new(
                Errno::EINVAL,
                format!("the window bind failed: {}", wcs[0].status.name()),
            ));
        }
        let bound =
            (info.length != 0).then_some((info.mr_lkey, info.addr, info.length, info.access));
        if let Some(rec) = self.mws.lock().values_mut().find(|r| r.mw.0 == mw.0) {
            rec.bound = bound;
        }
        // SAFETY: a live window; the library set its new rkey when the bind was posted.
        Ok(unsafe { (*mw.0).rkey })
    }
    fn create_comp_channel(&self) -> Result<u32> {
        // SAFETY: open context.
        let ch = unsafe { (self.lib.verbs.ibv_create_comp_channel)(self.ctx.0) };
        if ch.is_null() {
            return Err(os_error("ibv_create_comp_channel"));
        }
        let n = self.next_channel.fetch_add(1, Ordering::Relaxed);
        self.channels.lock().insert(n, Ptr(ch));
        Ok(n)
    }
    fn destroy_comp_channel(&self, channel: u32) -> Result<()> {
        let mut g = self.channels.lock();
        let ch = *g
            .get(&channel)
            .ok_or_else(|| Error::new(Errno::EINVAL, format!("no completion channel {channel}")))?;
        // SAFETY: a live channel (forgotten only on success).
        let r = unsafe { (self.lib.verbs.ibv_destroy_comp_channel)(ch.0) };
        if r != 0 {
            return Err(ret_error("ibv_destroy_comp_channel", r));
        }
        g.remove(&channel);
        Ok(())
    }
    fn comp_channel_fd(&self, channel: u32) -> Result<OwnedFd> {
        let ch = self.channel(channel)?;
        // SAFETY: a live channel; its fd stays open while the channel exists, and we only
        // duplicate it here.
        let fd = unsafe { BorrowedFd::borrow_raw((*ch.0).fd) };
        fd.try_clone_to_owned()
            .map_err(|e| errno_error("dup", e.raw_os_error().unwrap_or(libc::EIO)))
    }
    fn get_cq_event(&self, channel: u32, timeout: Option<Duration>) -> Result<Option<u32>> {
        let ch = self.channel(channel)?;
        // SAFETY: a live channel's fd (borrowed for the poll only).
        let fd = unsafe { BorrowedFd::borrow_raw((*ch.0).fd) };
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        loop {
            let ms = match deadline {
                None => -1,
                Some(d) => {
                    let left = d.saturating_duration_since(std::time::Instant::now());
                    // Rounded up, so a short wait is not a busy loop.
                    i32::try_from(left.as_nanos().div_ceil(1_000_000)).unwrap_or(i32::MAX)
                }
            };
            let mut pfd = [rustix::event::PollFd::new(
                &fd,
                rustix::event::PollFlags::IN,
            )];
            let ts = if ms < 0 {
                None
            } else {
                Some(rustix::event::Timespec {
                    tv_sec: i64::from(ms / 1000),
                    tv_nsec: i64::from(ms % 1000) * 1_000_000,
                })
            };
            match rustix::event::poll(&mut pfd, ts.as_ref()) {
                Ok(0) => {
                    if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                        return Ok(None);
                    }
                    continue;
                }
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(errno_error("poll", e.raw_os_error())),
            }
            let mut cq: *mut ibv_cq = std::ptr::null_mut();
            let mut cq_ctx: *mut c_void = std::ptr::null_mut();
            // SAFETY: a live channel; valid out-pointers. The fd is readable, so this does
            // not block (unless another thread took the event: then it waits for the next).
            let r = unsafe { (self.lib.verbs.ibv_get_cq_event)(ch.0, &mut cq, &mut cq_ctx) };
            if r != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EAGAIN) {
                    continue;
                }
                return Err(os_error("ibv_get_cq_event"));
            }
            // SAFETY: the CQ the event is for is live (destroying it waits for acks).
            let h = unsafe {
                let h = (*cq).handle;
                (self.lib.verbs.ibv_ack_cq_events)(cq, 1);
                h
            };
            return Ok(Some(h));
        }
    }
    fn create_cq(&self, cqe: u32, channel: Option<u32>) -> Result<u32> {
        let ch = match channel {
            Some(c) => self.channel(c)?.0,
            None => std::ptr::null_mut(),
        };
        let n = c_int::try_from(cqe).map_err(|_| Error::new(Errno::EINVAL, "too many CQEs"))?;
        // SAFETY: open context; a live channel or NULL.
        let cq =
            unsafe { (self.lib.verbs.ibv_create_cq)(self.ctx.0, n, std::ptr::null_mut(), ch, 0) };
        if cq.is_null() {
            return Err(os_error("ibv_create_cq"));
        }
        // SAFETY: a live CQ.
        let h = unsafe { (*cq).handle };
        let mut g = self.cqs.write();
        g.insert(h, Ptr(cq));
        self.cq_ix.insert(h, cq as usize);
        Ok(h)
    }
    fn destroy_cq(&self, cq: u32) -> Result<()> {
        let mut g = self.cqs.write();
        let p = *g
            .get(&cq)
            .ok_or_else(|| Error::new(Errno::EINVAL, format!("no completion queue {cq}")))?;
        self.cq_ix.remove(cq);
        // SAFETY: a live CQ (forgotten only on success).
        let r = unsafe { (self.lib.verbs.ibv_destroy_cq)(p.0) };
        if r != 0 {
            self.cq_ix.insert(cq, p.0 as usize);
            return Err(ret_error("ibv_destroy_cq", r));
        }
        g.remove(&cq);
        Ok(())
    }
    fn poll_cq(&self, cq: u32, out: &mut Vec<Wc>, max: usize) -> Result<usize> {
        let p = self.cq(cq)?;
        // SAFETY: a live CQ; its context's ops table as the header's inline ibv_poll_cq.
        let Some(op) = (unsafe { (*(*p.0).context).ops.poll_cq }) else {
            return Err(unsupported("ibv_poll_cq"));
        };
        const BATCH: usize = 16;
        // Not initialised: the library writes the first `n` entries, and only those are read
        // (saves clearing 768 bytes on every poll, most of which find nothing).
        let mut buf = std::mem::MaybeUninit::<[ibv_wc; BATCH]>::uninit();
        let mut total = 0;
        while total < max {
            let want = (max - total).min(BATCH);
            // SAFETY: a live CQ; `buf` has room for `want` entries.
            let n = unsafe { op(p.0.cast(), want as c_int, buf.as_mut_ptr().cast()) };
            if n < 0 {
                return Err(os_error("ibv_poll_cq"));
            }
            let n = (n as usize).min(want);
            // SAFETY: `ibv_poll_cq` wrote its first `n` entries (n <= want <= BATCH); `ibv_wc`
            // is plain data, valid for any bytes the library wrote.
            let done = unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<ibv_wc>(), n) };
            out.extend(done.iter().map(wc_from_c));
            total += n;
            if n < want {
                break;
            }
        }
        Ok(total)
    }
    fn req_notify_cq(&self, cq: u32, solicited_only: bool) -> Result<()> {
        let p = self.cq(cq)?;
        // SAFETY: a live CQ; its context's ops table as the header's ibv_req_notify_cq.
        let Some(op) = (unsafe { (*(*p.0).context).ops.req_notify_cq }) else {
            return Err(unsupported("ibv_req_notify_cq"));
        };
        // SAFETY: a live CQ.
        let r = unsafe { op(p.0.cast(), c_int::from(solicited_only)) };
        if r != 0 {
            return Err(ret_error("ibv_req_notify_cq", r));
        }
        Ok(())
    }
    fn create_qp(&self, init: QpInitAttr) -> Result<(u32, QpCap)> {
        let pd = self.pd(init.pd)?;
        let scq = self.cq(init.send_cq)?;
        let rcq = self.cq(init.recv_cq)?;
        let mut a = ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: scq.0,
            recv_cq: rcq.0,
            srq: std::ptr::null_mut(),
            cap: cap_to_c(&init.cap),
            qp_type: IBV_QPT_RC,
            sq_sig_all: c_int::from(init.sq_sig_all),
        };
        // SAFETY: live PD and CQs; `a` valid (the library writes the granted caps back).
        let qp = unsafe { (self.lib.verbs.ibv_create_qp)(pd.0, &mut a) };
        if qp.is_null() {
            return Err(os_error("ibv_create_qp"));
        }
        // SAFETY: a live QP.
        let qpn = unsafe { (*qp).qp_num };
        let mut g = self.qps.write();
        g.insert(qpn, Ptr(qp));
        self.qp_ix.insert(qpn, qp as usize);
        drop(g);
        Ok((qpn, cap_from_c(&a.cap)))
    }
    fn destroy_qp(&self, qpn: u32) -> Result<()> {
        let mut g = self.qps.write();
        let p = *g
            .get(&qpn)
            .ok_or_else(|| Error::new(Errno::EINVAL, format!("no queue pair {qpn}")))?;
        self.qp_ix.remove(qpn);
        // SAFETY: a live QP (forgotten only on success).
        let r = unsafe { (self.lib.verbs.ibv_destroy_qp)(p.0) };
        if r != 0 {
            self.qp_ix.insert(qpn, p.0 as usize);
            return Err(ret_error("ibv_destroy_qp", r));
        }
        g.remove(&qpn);
        Ok(())
    }
    fn modify_qp(&self, qpn: u32, attr: &QpAttr, mask: u32) -> Result<()> {
        let p = self.qp(qpn)?;
        let ah_attr = if mask & attr_mask::AV != 0 {
            av_to_c(&attr.ah_attr)?
        } else {
            ibv_ah_attr::default()
        };
        let sat = |x: u32| x.min(255) as u8;
        let mut a = ibv_qp_attr {
            qp_state: attr.qp_state,
            cur_qp_state: attr.cur_qp_state,
            path_mtu: u32::from(attr.path_mtu),
            path_mig_state: 0,
            qkey: 0,
            rq_psn: attr.rq_psn,
            sq_psn: attr.sq_psn,
            dest_qp_num: attr.dest_qp_num,
            qp_access_flags: attr.qp_access_flags.bits(),
            cap: cap_to_c(&attr.cap),
            ah_attr,
            alt_ah_attr: ibv_ah_attr::default(),
            pkey_index: attr.pkey_index,
            alt_pkey_index: 0,
            en_sqd_async_notify: u8::from(attr.en_sqd_async_notify),
            sq_draining: 0,
            max_rd_atomic: sat(attr.max_rd_atomic),
            max_dest_rd_atomic: sat(attr.max_dest_rd_atomic),
            min_rnr_timer: attr.min_rnr_timer,
            port_num: attr.port_num,
            timeout: attr.timeout,
            retry_cnt: attr.retry_cnt,
            rnr_retry: attr.rnr_retry,
            alt_port_num: 0,
            alt_timeout: 0,
            rate_limit: 0,
        };
        // SAFETY: a live QP; `a` valid for the call.
        let r = unsafe { (self.lib.verbs.ibv_modify_qp)(p.0, &mut a, mask as c_int) };
        if r != 0 {
            return Err(ret_error("ibv_modify_qp", r));
        }
        Ok(())
    }
    fn query_qp(&self, qpn: u32) -> Result<QpAttr> {
        let p = self.qp(qpn)?;
        let mut a = ibv_qp_attr::default();
        // SAFETY: all-zero is a valid value of this plain C struct.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: a live QP; valid out-pointers.
        let r = unsafe { (self.lib.verbs.ibv_query_qp)(p.0, &mut a, !0, &mut init) };
        if r != 0 {
            return Err(ret_error("ibv_query_qp", r));
        }
        let av = if a.ah_attr.is_global != 0 {
            AddressVector {
                dest_node: 0,
                dgid: Some(mrkit_soft::net::udp::ip_of_gid(a.ah_attr.grh.dgid.raw)),
                port_num: a.ah_attr.port_num,
            }
        } else {
            AddressVector {
                dest_node: 0,
                dgid: None,
                port_num: a.ah_attr.port_num,
            }
        };
        Ok(QpAttr {
            qp_state: a.qp_state,
            cur_qp_state: a.cur_qp_state,
            en_sqd_async_notify: a.en_sqd_async_notify != 0,
            qp_access_flags: AccessFlags::from_bits_retain(a.qp_access_flags),
            pkey_index: a.pkey_index,
            port_num: a.port_num,
            ah_attr: av,
            path_mtu: a.path_mtu.min(255) as u8,
            timeout: a.timeout,
            retry_cnt: a.retry_cnt,
            rnr_retry: a.rnr_retry,
            rq_psn: a.rq_psn,
            max_rd_atomic: u32::from(a.max_rd_atomic),
            min_rnr_timer: a.min_rnr_timer,
            sq_psn: a.sq_psn,
            max_dest_rd_atomic: u32::from(a.max_dest_rd_atomic),
            dest_qp_num: a.dest_qp_num,
            cap: cap_from_c(&a.cap),
        })
    }
    fn post_send(&self, qpn: u32, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
        let p = self
            .qp(qpn)
            .map_err(|error| PostError { bad_wr: 0, error })?;
        if wrs.is_empty() {
            return Ok(());
        }
        // SAFETY: a live QP; its context's ops table as the header's inline ibv_post_send.
        let Some(op) = (unsafe { (*(*p.0).context).ops.post_send }) else {
            return Err(PostError {
                bad_wr: 0,
                error: unsupported("ibv_post_send"),
            });
        };
        // The common post, one request with at most one SGE (not inline, not a bind), is
        // built in one struct literal: no stack arrays to clear, no chain to link.
        if let [w] = wrs {
            if w.sg_list.len() <= 1
                && w.flags & send_flags::INLINE == 0
                && w.opcode != WrOpcode::BindMw
            {
                let mut sge = w.sg_list.first().map_or(ZERO_SGE, |s| ibv_sge {
                    addr: s.addr,
                    length: s.length,
                    lkey: s.lkey,
                });
                let (imm_data, words) = send_wr_words(w);
                let mut c = ibv_send_wr {
                    wr_id: w.wr_id,
                    next: std::ptr::null_mut(),
                    sg_list: if w.sg_list.is_empty() {
                        std::ptr::null_mut()
                    } else {
                        &mut sge
                    },
                    num_sge: w.sg_list.len() as c_int, // 0 or 1
                    opcode: w.opcode as u32,
                    send_flags: w.flags,
                    imm_data,
                    wr: words,
                    qp_type: 0,
                    _pad: 0,
                    bind_mw: [0; 6],
                };
                let mut bad: *mut c_void = std::ptr::null_mut();
                // SAFETY: a live QP; `c` and its SGE live until the call returns.
                let r = unsafe { op(p.0.cast(), (&mut c as *mut ibv_send_wr).cast(), &mut bad) };
                return if r == 0 {
                    Ok(())
                } else {
                    Err(PostError {
                        bad_wr: 0,
                        error: ret_error("ibv_post_send", r),
                    })
                };
            }
        }
        let nsge = match wrs {
            [w] => w.sg_list.len().max(1),
            _ => wrs.iter().map(|w| w.sg_list.len().max(1)).sum::<usize>(),
        };
        let mut stack_wr = [empty_send_wr()];
        let mut stack_sge = [ZERO_SGE; STACK_SGES];
        let (mut heap_wr, mut heap_sge);
        let (cw, cs): (&mut [ibv_send_wr], &mut [ibv_sge]) = if wrs.len() == 1 && nsge <= STACK_SGES
        {
            (&mut stack_wr, &mut stack_sge)
        } else {
            heap_wr = vec![empty_send_wr(); wrs.len()];
            heap_sge = vec![ZERO_SGE; nsge];
            (&mut heap_wr, &mut heap_sge)
        };
        let mut off = 0;
        for (i, w) in wrs.iter().enumerate() {
            let k = w.sg_list.len().max(1);
            self.send_wr_to_c(w, &mut cw[i], &mut cs[off..off + k])
                .map_err(|error| PostError { bad_wr: i, error })?;
            off += k;
        }
        let base = cw.as_mut_ptr();
        for i in 1..cw.len() {
            // SAFETY: `i - 1` and `i` are in bounds of `cw`.
            unsafe { (*base.add(i - 1)).next = base.add(i) };
        }
        let mut bad: *mut c_void = std::ptr::null_mut();
        // SAFETY: a live QP; a valid chain whose SGE arrays live until the call returns.
        let r = unsafe { op(p.0.cast(), base.cast(), &mut bad) };
        if r != 0 {
            let i = if bad.is_null() {
                0
            } else {
                ((bad as usize).wrapping_sub(base as usize) / std::mem::size_of::<ibv_send_wr>())
                    .min(wrs.len() - 1)
            };
            return Err(PostError {
                bad_wr: i,
                error: ret_error("ibv_post_send", r),
            });
        }
        Ok(())
    }
    fn post_recv(&self, qpn: u32, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        let p = self
            .qp(qpn)
            .map_err(|error| PostError { bad_wr: 0, error })?;
        if wrs.is_empty() {
            return Ok(());
        }
        // SAFETY: a live QP; its context's ops table as the header's inline ibv_post_recv.
        let Some(op) = (unsafe { (*(*p.0).context).ops.post_recv }) else {
            return Err(PostError {
                bad_wr: 0,
                error: unsupported("ibv_post_recv"),
            });
        };
        let mut sges: Vec<ibv_sge> = wrs
            .iter()
            .flat_map(|w| w.sg_list.iter())
            .map(|s| ibv_sge {
                addr: s.addr,
                length: s.length,
                lkey: s.lkey,
            })
            .collect();
        let mut cw: Vec<ibv_recv_wr> = Vec::with_capacity(wrs.len());
        let mut off = 0;
        for (i, w) in wrs.iter().enumerate() {
            let n = w.sg_list.len();
            let num_sge = c_int::try_from(n).map_err(|_| PostError {
                bad_wr: i,
                error: Error::new(Errno::EINVAL, "too many SGEs"),
            })?;
            cw.push(ibv_recv_wr {
                wr_id: w.wr_id,
                next: std::ptr::null_mut(),
                // In bounds: `off + n <= sges.len()` (the SGEs are laid out in order).
                sg_list: if n == 0 {
                    std::ptr::null_mut()
                } else {
                    sges.as_mut_ptr().wrapping_add(off)
                },
                num_sge,
            });
            off += n;
        }
        let base = cw.as_mut_ptr();
        for i in 1..cw.len() {
            // SAFETY: in bounds of `cw`.
            unsafe { (*base.add(i - 1)).next = base.add(i) };
        }
        let mut bad: *mut c_void = std::ptr::null_mut();
        // SAFETY: a live QP; a valid chain whose SGEs live until the call returns.
        let r = unsafe { op(p.0.cast(), base.cast(), &mut bad) };
        if r != 0 {
            let i = if bad.is_null() {
                0
            } else {
                ((bad as usize).wrapping_sub(base as usize) / std::mem::size_of::<ibv_recv_wr>())
                    .min(wrs.len() - 1)
            };
            return Err(PostError {
                bad_wr: i,
                error: ret_error("ibv_post_recv", r),
            });
        }
        Ok(())
    }
    fn query_gid(&self) -> Result<[u8; 16]> {
        let mut g = ibv_gid::default();
        // SAFETY: open context; valid out-pointer.
        let r = unsafe { (self.lib.verbs.ibv_query_gid)(self.ctx.0, 1, 0, &mut g) };
        if r != 0 {
            return Err(ret_error("ibv_query_gid", r));
        }
        if g.raw == [0; 16] {
            return Err(Error::new(
                Errno::EADDRNOTAVAIL,
                format!(
                    "{}: port 1 has no GID at index 0 (is the link up?)",
                    self.name
                ),
            ));
        }
        Ok(g.raw)
    }
    /// verbs.h's inline `ibv_query_port` (`___ibv_query_port`): the context's extended
    /// `query_port` op with the whole 52-byte `ibv_port_attr` when the library has it, else
    /// the exported compat symbol `ibv_query_port@IBVERBS_1.1`, which fills only the 48-byte
    /// prefix of a zeroed struct (then `port_cap_flags2` reads 0).
    fn query_port(&self, port: u8) -> Result<PortAttr> {
        let mut a = ibv_port_attr::default();
        let r = match vctx_op!(self.ctx.0, query_port) {
            // SAFETY: the header's call: open context, a valid out-pointer of the size passed.
            Some(op) => unsafe {
                op(
                    self.ctx.0,
                    port,
                    &mut a,
                    std::mem::size_of::<ibv_port_attr>(),
                )
            },
            // SAFETY: open context; the compat entry writes at most 48 bytes of our 52.
            None => unsafe { (self.lib.verbs.ibv_query_port)(self.ctx.0, port, &mut a) },
        };
        if r != 0 {
            return Err(ret_error("ibv_query_port", r));
        }
        Ok(PortAttr {
            state: a.state,
            max_mtu: a.max_mtu,
            active_mtu: a.active_mtu,
            gid_tbl_len: u32::try_from(a.gid_tbl_len).unwrap_or(0),
            port_cap_flags: a.port_cap_flags,
            max_msg_sz: a.max_msg_sz,
            bad_pkey_cntr: a.bad_pkey_cntr,
            qkey_viol_cntr: a.qkey_viol_cntr,
            pkey_tbl_len: a.pkey_tbl_len,
            lid: a.lid,
            sm_lid: a.sm_lid,
            lmc: a.lmc,
            max_vl_num: a.max_vl_num,
            sm_sl: a.sm_sl,
            subnet_timeout: a.subnet_timeout,
            init_type_reply: a.init_type_reply,
            active_width: a.active_width,
            active_speed: a.active_speed,
            phys_state: a.phys_state,
            link_layer: a.link_layer,
            flags: a.flags,
            port_cap_flags2: a.port_cap_flags2,
        })
    }
}

impl Drop for RdmaCoreProvider {
    fn drop(&mut self) {
        let v = self.lib.verbs;
        // Whatever the safe types did not free (they hold the provider alive, so normally
        // nothing): children before parents, then the context.
        // SAFETY: each pointer is a live object of this context, destroyed once.
        unsafe {
            for (_, q) in self.qps.get_mut().drain() {
                (v.ibv_destroy_qp)(q.0);
            }
            for (_, m) in self.mws.get_mut().drain() {
                if let Some(op) = (*self.ctx.0).ops.dealloc_mw {
                    op(m.mw.0);
                }
            }
            for (_, m) in self.mrs.lock().drain() {
                if (v.ibv_dereg_mr)(m.mr.0) != 0 {
                    // Still registered: keep its memory (and owner) forever rather than free
                    // memory the device may still write.
                    std::mem::forget(m);
                }
            }
            for (_, c) in self.cqs.get_mut().drain() {
                (v.ibv_destroy_cq)(c.0);
            }
            for (_, c) in self.channels.get_mut().drain() {
                (v.ibv_destroy_comp_channel)(c.0);
            }
            for (_, p) in self.pds.get_mut().drain() {
                (v.ibv_dealloc_pd)(p.0);
            }
            (v.ibv_close_device)(self.ctx.0);
        }
    }
}
