//! The driver: the device object and everything that makes it run. [`Context`] (the opened
//! device, `ibv_context`) with its verbs, the progress thread and its scheduler
//! ([`progress`]), the caller-thread execution of posts and polls ([`caller_thread`]), the
//! in-process loopback link ([`loopback`]), the hand-over of received packets to their QPs,
//! the held (delayed) ACKs, and the exit handler. Everything below it (engines, memory core,
//! link) is sans-IO or stateless about the device; this layer owns threads, sockets and
//! clocks.
#![deny(unsafe_code)]

#[allow(unsafe_code)] // `atexit(3)` registration
pub(crate) mod at_exit;
pub mod caller_thread;
mod cq_verbs;
mod delivery;
mod event_srq_verbs;
pub mod held_acks;
pub mod live_mrs;
pub mod loopback;
pub mod progress;
mod qp_verbs;

use std::sync::Arc;

use crate::access::AccessFlags;
use crate::device::{DeviceAttr, DeviceConfig};
use crate::error::{err, Result};
use crate::memcore::MemCore;
use crate::mr::{AccessDenied, KeyUse, MrGuard, MrInfo, MrObject};
use crate::mw::{BindInfo, MwInfo, MwType};
use crate::user_mem::UserMemory;
use crate::{events, net, srq, stats};

/// Device state shared by all handles of one opened device instance.
#[derive(Debug)]
pub struct DeviceInner {
    /// PDs, MR and MW tables, translation accounting, statistics, limits.
    pub(crate) core: MemCore,
    /// Data path: CQs, QPs, the progress engine.
    pub(crate) dp: progress::DataPath,
    /// Shared receive queues.
    pub(crate) srqs: srq::SrqTable,
    /// Threads inside a progress pass right now (`driver/caller_thread.rs`: a poller skips its pass
    /// while another thread is in one). Orders nothing else.
    pub(crate) progress_runners: std::sync::atomic::AtomicUsize,
    /// The RoCEv2 UDP port, bound on first use (query_gid, a QP with a GID address vector).
    pub(crate) udp: std::sync::OnceLock<Arc<net::udp::UdpPort>>,
    /// Serialises the first bind of `udp`.
    udp_init: parking_lot::Mutex<()>,
    /// Link counters.
    pub(crate) net_stats: net::udp::NetStats,
    /// Receive buffers of the UDP port. Whoever holds this lock receives *and* hands the
    /// packets to their QPs, so packets reach a QP in the order the socket delivered them even
    /// when the application thread and the progress thread both make progress.
    pub(crate) rx: parking_lot::Mutex<net::udp::RecvBufs>,
    /// Where asynchronous events go (`events.rs`).
    pub(crate) event_hook: events::HookSlot,
}

impl Drop for DeviceInner {
    /// The device is closed (the last [`Context`] dropped, e.g. `ibv_close_device`): ACKs an
    /// application pass held back (`held_acks::ACK_DELAY_MAX`) leave now, or a peer waiting
    /// for them would time out.
    fn drop(&mut self) {
        self.flush_held_acks();
    }
}

/// Objects alive on one device instance ([`Context::resource_counts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ResourceCounts {
    /// Protection domains.
    pub pds: u32,
    /// Memory regions.
    pub mrs: u32,
    /// Memory windows.
    pub mws: u32,
    /// Completion queues.
    pub cqs: usize,
    /// Queue pairs.
    pub qps: usize,
}

/// An opened `mrkit0` device instance (`ibv_context`). Cheap to clone; all clones share the
/// device's tables and limits.
#[derive(Debug, Clone)]
pub struct Context {
    pub(crate) dev: Arc<DeviceInner>,
}

impl Context {
    /// Open a device instance with the given limits.
    pub fn open(config: DeviceConfig) -> Context {
        let ctx = Context {
            dev: Arc::new(DeviceInner {
                dp: progress::DataPath::new(config.uses_delayed_acks()),
                srqs: srq::SrqTable::default(),
                udp: std::sync::OnceLock::new(),
                udp_init: parking_lot::Mutex::new(()),
                net_stats: net::udp::NetStats::default(),
                progress_runners: std::sync::atomic::AtomicUsize::new(0),
                rx: parking_lot::Mutex::new(net::udp::RecvBufs::default()),
                event_hook: events::HookSlot::default(),
                core: MemCore::new(config),
            }),
        };
        loopback::attach(ctx.dev.dp.node_id, &ctx.dev);
        crate::stat_export::on_device_open(&ctx.dev);
        if ctx.dev.core.config.uses_delayed_acks() {
            at_exit::register();
        }
        ctx
    }

    /// Open with [`DeviceConfig::from_env`]; a malformed `MRKIT_*` variable is an EINVAL error.
    pub fn open_from_env() -> Result<Context> {
        DeviceConfig::from_env()
            .map(Context::open)
            .map_err(|e| err!(EINVAL, "{e}"))
    }

    /// The device's RoCEv2 UDP port, binding it on first use (the configured address, or a
    /// distinct 127.x.y.z address on port 4791).
    pub fn udp_port(&self) -> Result<Arc<net::udp::UdpPort>> {
        if let Some(p) = self.dev.udp.get() {
            return Ok(p.clone());
        }
        let _g = self.dev.udp_init.lock();
        if let Some(p) = self.dev.udp.get() {
            return Ok(p.clone());
        }
        let port = net::udp::UdpPort::bind(
            self.dev.core.config.configured_udp_addr(),
            self.dev.core.config.configured_faults(),
        )
        .map_err(|e| {
            err!(
                EADDRNOTAVAIL,
                "cannot bind the RoCEv2 UDP port ({e}); set MRKIT_ADDR to a free local address"
            )
        })?;
        let port = Arc::new(port);
        let _ = self.dev.udp.set(port.clone());
        self.dev.dp.wake_progress();
        Ok(port)
    }

    /// `ibv_query_port`: the values the drop-in reports for mrkit0 (one active Ethernet
    /// port; the active MTU by rxe's rule: the largest IB MTU at most the interface's MTU
    /// minus 80, 4096 on loopback, 1024 when the interface is unknown). EINVAL for a port
    /// the device does not have. Binds the UDP port, as the drop-in does.
    pub fn query_port(&self, port: u8) -> Result<crate::device::PortAttr> {
        let a = self.query_device();
        if port == 0 || port > a.phys_port_cnt {
            return Err(crate::error::Error::new(
                crate::error::Errno::EINVAL,
                format!(
                    "port {port} does not exist (the device has {})",
                    a.phys_port_cnt
                ),
            ));
        }
        let active_mtu = match self.udp_port().map(|p| p.local_addr().ip()) {
            Ok(ip) if ip.is_loopback() => crate::wire::Mtu::Mtu4096.to_enum(),
            Ok(ip) => match crate::net::sockio::netdev_mtu(ip) {
                Some(m) => crate::wire::Mtu::largest_for_netdev(m as usize)
                    .map_or(crate::wire::Mtu::Mtu256, |m| m)
                    .to_enum(),
                None => crate::wire::Mtu::Mtu1024.to_enum(),
            },
            Err(_) => crate::wire::Mtu::Mtu1024.to_enum(),
        };
        Ok(crate::device::PortAttr {
            state: 4,
            max_mtu: u32::from(crate::wire::Mtu::Mtu4096.to_enum()),
            active_mtu: u32::from(active_mtu),
            gid_tbl_len: u32::from(self.query_gid().is_ok()),
            port_cap_flags: 1 << 16, // IBV_PORT_CM_SUP
            max_msg_sz: a.max_msg_sz,
            bad_pkey_cntr: 0,
            qkey_viol_cntr: 0,
            pkey_tbl_len: 1,
            lid: 0,
            sm_lid: 0,
            lmc: 0,
            max_vl_num: 1,
            sm_sl: 0,
            subnet_timeout: 0,
            init_type_reply: 0,
            active_width: 2,  // 4X
            active_speed: 32, // EDR
            phys_state: 5,    // LinkUp
            link_layer: 2,    // Ethernet
            flags: 0,
            port_cap_flags2: 0,
        })
    }

    /// `ibv_query_gid` (index 0): the device's address as a RoCEv2 GID (IPv4-mapped for
    /// IPv4). Binds the UDP port if needed.
    pub fn query_gid(&self) -> Result<[u8; 16]> {
        Ok(net::udp::gid_of(self.udp_port()?.local_addr().ip()))
    }

    /// The bound UDP address, if the port is bound.
    pub fn udp_addr(&self) -> Option<std::net::SocketAddr> {
        self.dev.udp.get().map(|p| p.local_addr())
    }

    /// Link counters (datagrams sent/received, drops by reason).
    pub fn net_stats(&self) -> net::udp::NetStatsSnapshot {
        self.dev.net_stats.snapshot()
    }

    /// Fault-injector counters of the UDP port (None without faults or before binding).
    pub fn fault_stats(&self) -> Option<net::fault::FaultStats> {
        self.dev.udp.get().and_then(|p| p.fault_stats())
    }

    /// `ibv_query_device`.
    pub fn query_device(&self) -> DeviceAttr {
        self.dev.core.config.attr().clone()
    }

    /// The configuration (with the source of each value).
    pub fn config(&self) -> &DeviceConfig {
        &self.dev.core.config
    }

    /// Device counters.
    pub fn stats(&self) -> stats::StatsSnapshot {
        self.dev.core.stats.snapshot()
    }

    /// Objects alive on this device instance right now (as `rdma resource show` counts them):
    /// lets a long-running program check that it tears every connection down.
    pub fn resource_counts(&self) -> ResourceCounts {
        ResourceCounts {
            pds: self.dev.core.pds.len(),
            mrs: self.dev.core.mrs.len(),
            mws: self.dev.core.mws.len(),
            cqs: self.dev.dp.cqs.read().len(),
            qps: self.dev.dp.qps.read().len(),
        }
    }

    /// The device's memory core: PDs, MR and MW tables, the access predicate.
    pub fn memory_core(&self) -> &MemCore {
        &self.dev.core
    }

    /// `ibv_alloc_pd`: ENOMEM when max_pd PDs exist.
    pub fn alloc_pd(&self) -> Result<u32> {
        self.dev.core.alloc_pd()
    }

    /// `ibv_dealloc_pd`: EBUSY while MRs, MWs, QPs or SRQs use it; EINVAL for an unknown PD.
    pub fn dealloc_pd(&self, pd: u32) -> Result<()> {
        self.dev.core.dealloc_pd(pd)
    }

    /// `ibv_reg_mr`: register `mem` with iova = its address.
    ///
    /// The device's [`MemCore::reg_mr_va`] does the work; its documentation has the full contract.
    pub fn reg_mr_va(&self, pd: u32, mem: UserMemory, access: AccessFlags) -> Result<MrInfo> {
        self.dev.core.reg_mr_va(pd, mem, access)
    }

    /// `ibv_reg_mr_iova2`: register `mem` (`[addr, addr+length)`) whose first byte has address
    /// `iova` in the MR's address space. See the module docs for the validation order.
    ///
    /// The device's [`MemCore::reg_mr`] does the work; its documentation has the full contract.
    pub fn reg_mr(
        &self,
        pd: u32,
        mem: UserMemory,
        iova: u64,
        access: AccessFlags,
    ) -> Result<MrInfo> {
        self.dev.core.reg_mr(pd, mem, iova, access)
    }

    /// `ibv_dereg_mr`. EINVAL while memory windows are bound (as rxe and the man page) or for
    /// an unknown key. Otherwise: unpublish the key (every later lookup fails), wait for
    /// in-flight accesses to finish, then unpin. **After this returns the device never touches
    /// the memory again.**
    ///
    /// The device's [`MemCore::dereg_mr`] does the work; its documentation has the full contract.
    pub fn dereg_mr(&self, lkey: u32) -> Result<()> {
        self.dev.core.dereg_mr(lkey)
    }

    /// `ibv_query_mr`-like: everything the device knows about an MR.
    ///
    /// The device's [`MemCore::query_mr`] does the work; its documentation has the full contract.
    pub fn query_mr(&self, lkey: u32) -> Result<MrInfo> {
        self.dev.core.query_mr(lkey)
    }

    /// The MR object behind a key (for inspection: segments, frame numbers).
    ///
    /// The device's [`MemCore::mr_object`] does the work; its documentation has the full contract.
    pub fn mr_object(&self, lkey: u32) -> Option<MrObject> {
        self.dev.core.mr_object(lkey)
    }

    /// `ibv_rereg_mr`. `flags` is a combination of [`ReregFlags`](crate::ReregFlags) constants. Errors follow the
    /// library checks, then the kernel's (`docs/semantics.md` §4): flags 0 → EINVAL, unknown
    /// flags → EOPNOTSUPP, `access` without CHANGE_ACCESS → EINVAL, TRANSLATION with length 0 or
    /// address 0 → EINVAL, page-offset mismatch → EINVAL, access rules as reg_mr, unknown PD →
    /// EINVAL, upgrading a read-only pin to writable without a new translation → **EACCES**
    /// (CVE-2026-52908). PD/ACCESS changes keep the keys; TRANSLATION makes a new MR with new
    /// keys (returned). On error the old MR stays valid.
    ///
    /// The device's [`MemCore::rereg_mr`] does the work; its documentation has the full contract.
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
        self.dev.core.rereg_mr(lkey, flags, pd, mem, iova, access)
    }

    /// **The** access predicate. Every path that touches registered memory calls this: local
    /// SGEs (lkey), RETH/AtomicETH (rkey, MRs and windows), ODP faults, the C ABI.
    ///
    /// The device's [`MemCore::check_access`] does the work; its documentation has the full contract.
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
        self.dev
            .core
            .check_access(key, pd, need, iova, len, key_use, qp_num)
    }

    /// `ibv_advise_mr`: advice 0 = PREFETCH (read), 1 = PREFETCH_WRITE, 2 = PREFETCH_NO_FAULT;
    /// flag 1 = FLUSH (synchronous). Each SGE is `(lkey, addr, length)`. Unlike rxe (which needs
    /// LOCAL_WRITE even for a read prefetch), PREFETCH needs no right and PREFETCH_WRITE needs
    /// a writable MR (EPERM otherwise, the man page rule); a non-ODP MR is EINVAL (mlx5).
    ///
    /// The device's [`MemCore::advise_mr`] does the work; its documentation has the full contract.
    pub fn advise_mr(
        &self,
        pd: u32,
        advice: u32,
        flags: u32,
        sges: &[(u32, u64, u32)],
    ) -> Result<()> {
        self.dev.core.advise_mr(pd, advice, flags, sges)
    }

    /// Invalidate ODP translations covering `[va, va+len)` in every ODP MR of this device
    /// (what the kernel's MMU notifier does on munmap/madvise(DONTNEED)).
    ///
    /// The device's [`MemCore::odp_invalidate`] does the work; its documentation has the full contract.
    pub fn odp_invalidate(&self, va: u64, len: u64) {
        self.dev.core.odp_invalidate(va, len)
    }

    /// `ibv_alloc_mw`: ENOMEM when max_mw windows exist, EINVAL for an unknown PD.
    ///
    /// The device's [`MemCore::alloc_mw`] does the work; its documentation has the full contract.
    pub fn alloc_mw(&self, pd: u32, mw_type: MwType) -> Result<u32> {
        self.dev.core.alloc_mw(pd, mw_type)
    }

    /// `ibv_dealloc_mw` (by the rkey returned at allocation or its current rkey). Unbinds.
    ///
    /// The device's [`MemCore::dealloc_mw`] does the work; its documentation has the full contract.
    pub fn dealloc_mw(&self, rkey: u32) -> Result<()> {
        self.dev.core.dealloc_mw(rkey)
    }

    /// Describe a window by its current rkey.
    ///
    /// The device's [`MemCore::query_mw`] does the work; its documentation has the full contract.
    pub fn query_mw(&self, rkey: u32) -> Result<MwInfo> {
        self.dev.core.query_mw(rkey)
    }

    /// Execute a bind (`docs/semantics.md` §5.2). `mw_rkey` is the window's *current* rkey (as
    /// the WR carries it), `new_key` the 8-bit key to install, `qp_pd`/`qp_num` the QP executing
    /// the bind. Returns the window's new rkey. Every failure is EINVAL with the reason; the
    /// data path reports it as `IBV_WC_MW_BIND_ERR` and moves the QP to ERR.
    ///
    /// The device's [`MemCore::bind_mw`] does the work; its documentation has the full contract.
    pub fn bind_mw(
        &self,
        qp_pd: u32,
        qp_num: u32,
        mw_rkey: u32,
        new_key: u8,
        info: BindInfo,
    ) -> Result<u32> {
        self.dev.core.bind_mw(qp_pd, qp_num, mw_rkey, new_key, info)
    }

    /// Invalidate a key (LOCAL_INV, or SEND_WITH_INV at the responder when `remote`).
    /// Type-2 windows go FREE; type-1 windows and ordinary MRs cannot be invalidated; an unbound
    /// window or a window bound to another QP is an error. EINVAL on every failure; the data
    /// path reports LOC_QP_OP_ERR (local) or REM_INV_REQ_ERR (remote).
    ///
    /// The device's [`MemCore::invalidate_rkey`] does the work; its documentation has the full contract.
    pub fn invalidate_rkey(&self, pd: u32, qp_num: u32, rkey: u32) -> Result<()> {
        self.dev.core.invalidate_rkey(pd, qp_num, rkey)
    }
}
