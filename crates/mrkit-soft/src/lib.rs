//! # mrkit-soft: the software RDMA device `mrkit0`
//!
//! `mrkit0` plays both the RDMA NIC (HCA) and its kernel driver, in user space:
//!
//! * [`device`]: attributes, limits and profiles (rxe model by default; every limit
//!   configurable by builder or `MRKIT_*` environment variables).
//! * [`table`]: object tables with index + generation keys, two-phase publish, drain-before-free.
//! * [`mem`]: real page pinning (io_uring fixed buffers = the kernel's long-term pin, mlock
//!   fallback with per-page pin counts), RLIMIT_MEMLOCK accounting, the page walk, DONTFORK.
//! * [`mr`]: registration with the kernel's validation order and errnos; **the** access
//!   predicate every data path goes through.
//! * [`mw`]: memory windows type 1 and 2.
//! * [`odp`]: on-demand paging state.
//! * [`stats`]: counters and latency histograms.
//!
//! ```
//! use std::sync::Arc;
//! use mrkit_soft::{AccessFlags, Context, DeviceConfig, UserMemory};
//! let ctx = Context::open(DeviceConfig::rxe());
//! let pd = ctx.alloc_pd().unwrap();
//! // The MR keeps the buffer alive until it is deregistered (or use `unsafe UserMemory::new`).
//! let buf = Arc::new(vec![0u8; 8192]);
//! let mr = ctx
//!     .reg_mr_va(pd, UserMemory::owned(buf.clone()),
//!                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)
//!     .unwrap();
//! assert_eq!(mr.lkey, mr.rkey);
//! ctx.dereg_mr(mr.lkey).unwrap();
//! ctx.dealloc_pd(pd).unwrap();
//! ```

pub mod access;
mod at_exit;
mod copy;
pub mod cq;
pub mod device;
pub mod error;
pub mod events;
pub mod fastpath;
mod last_used;
pub mod mem;
pub mod mr;
pub mod mw;
pub mod net;
pub mod odp;
pub mod pd;
pub mod probes;
pub mod progress;
pub mod qp;
pub mod sockio;
pub mod srq;
pub mod stat_export;
pub mod stats;
pub mod table;
pub mod user_mem;
pub mod wire;

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

pub use access::AccessFlags;
pub use device::{DeviceAttr, DeviceConfig, StatusModel};
pub use error::{Errno, Error, Result};
pub use mr::{MrInfo, ReregFlags};
pub use mw::MwType;
pub use user_mem::{OwnedMemory, UserMemory};

use crate::error::err;
use crate::pd::PdObject;
use crate::table::KeyTable;

/// Name of the embedded device.
pub const DEVICE_NAME: &str = "mrkit0";

/// Index range of MR keys: keys below 2^31 are MRs.
pub(crate) const MR_INDEX: (u32, u32) = (1, (1 << 23) - 1);
/// Index range of MW keys: keys with bit 31 set are memory windows.
pub(crate) const MW_INDEX: (u32, u32) = (1 << 23, (1 << 24) - 1);

/// Devices this library provides (`ibv_get_device_list`).
///
/// ```
/// assert_eq!(mrkit_soft::device_list(), vec!["mrkit0"]);
/// ```
pub fn device_list() -> Vec<&'static str> {
    vec![DEVICE_NAME]
}

/// Device state shared by all handles of one opened device instance.
#[derive(Debug)]
pub struct DeviceInner {
    pub(crate) config: DeviceConfig,
    pub(crate) pds: KeyTable<Arc<PdObject>>,
    pub(crate) mrs: KeyTable<mr::MrObject>,
    pub(crate) mws: KeyTable<mw::MwObject>,
    /// Translation entries reserved by live MRs; bounded by `attr.max_mtt`
    /// (reserved with a compare-exchange loop before an MR is published).
    pub(crate) mtt_used: AtomicU64,
    pub(crate) stats: stats::RegStats,
    /// Data path: CQs, QPs, progress engine (issue 3).
    pub(crate) dp: progress::DataPath,
    /// Shared receive queues.
    pub(crate) srqs: srq::SrqTable,
    /// Threads inside a progress pass right now (`fastpath.rs`: a poller skips its pass
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
    /// application pass held back (`fastpath::ACK_DELAY_MAX`) leave now, or a peer waiting
    /// for them would time out.
    fn drop(&mut self) {
        self.flush_held_acks();
    }
}

impl DeviceInner {
    /// Send every ACK held back (device close, process exit).
    pub(crate) fn flush_held_acks(&self) {
        // No early return when none is held: taking them waits for a thread that took some
        // and is still sending them (the flush lock), which an exit must not cut short.
        let held = self.dp.take_held_acks();
        if let Some(port) = self.udp.get() {
            net::udp::send_pkts_on(self, port, &held.pkts);
        }
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
        let a = config.attr().clone();
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
                pds: KeyTable::new(1, (1 << 24) - 1, a.max_pd),
                mrs: KeyTable::new(MR_INDEX.0, MR_INDEX.1, a.max_mr),
                mws: KeyTable::new(MW_INDEX.0, MW_INDEX.1, a.max_mw),
                mtt_used: AtomicU64::new(0),
                stats: stats::RegStats::default(),
                config,
            }),
        };
        net::loopback::attach(ctx.dev.dp.node_id, &ctx.dev);
        stat_export::on_device_open(&ctx.dev);
        if ctx.dev.config.uses_delayed_acks() {
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
            self.dev.config.configured_udp_addr(),
            self.dev.config.configured_faults(),
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
        self.dev.config.attr().clone()
    }

    /// The configuration (with the source of each value).
    pub fn config(&self) -> &DeviceConfig {
        &self.dev.config
    }

    /// Device counters.
    pub fn stats(&self) -> stats::StatsSnapshot {
        self.dev.stats.snapshot()
    }

    /// Objects alive on this device instance right now (as `rdma resource show` counts them):
    /// lets a long-running program check that it tears every connection down.
    pub fn resource_counts(&self) -> ResourceCounts {
        ResourceCounts {
            pds: self.dev.pds.len(),
            mrs: self.dev.mrs.len(),
            mws: self.dev.mws.len(),
            cqs: self.dev.dp.cqs.read().len(),
            qps: self.dev.dp.qps.read().len(),
        }
    }

    /// `ibv_alloc_pd`: ENOMEM when max_pd PDs exist.
    pub fn alloc_pd(&self) -> Result<u32> {
        let r = self.dev.pds.reserve().map_err(|_| {
            err!(
                ENOMEM,
                "max_pd ({}) protection domains exist; deallocate one or raise MRKIT_MAX_PD",
                self.dev.pds.limit()
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
            .dev
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
            .dev
            .pds
            .unpublish(pd)
            .ok_or_else(|| err!(EINVAL, "PD {pd:#x} does not exist"))?;
        let _ = u.drain_entry();
        Ok(())
    }

    pub(crate) fn pd(&self, pd: u32) -> Result<Arc<PdObject>> {
        self.dev
            .pds
            .get(pd)
            .map(|g| (*g).clone())
            .ok_or_else(|| err!(EINVAL, "PD {pd:#x} does not exist"))
    }
}
