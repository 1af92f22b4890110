//! The provider interface: one ops table per device backend, in the shape of rdma-core's
//! `verbs_context_ops`. Optional operations default to "unsupported" (EOPNOTSUPP), so a new
//! backend compiles with the handful of mandatory ones.
//!
//! Besides memory registration the table carries the completion-queue, completion-channel and
//! queue-pair verbs that [`QueuePair`](crate::QueuePair) is built on, so a queue pair works on
//! every provider that implements them (no downcast to the embedded device).
//!
//! ```
//! use mrkit::provider::{attr_mask, QpAttr, QpInitAttr};
//! use mrkit::{Context, QpCap, QpState};
//! let ctx = Context::open(mrkit::DeviceConfig::rxe());
//! let pd = ctx.alloc_pd().unwrap();
//! let dev = ctx.provider();
//! let cq = dev.create_cq(16, None).unwrap();
//! let (qpn, _cap) = dev
//!     .create_qp(QpInitAttr { pd: pd.handle(), send_cq: cq, recv_cq: cq, cap: QpCap::default(), sq_sig_all: true })
//!     .unwrap();
//! let init = QpAttr { qp_state: QpState::Init as u32, port_num: 1, ..QpAttr::default() };
//! dev.modify_qp(qpn, &init, attr_mask::STATE | attr_mask::PKEY_INDEX | attr_mask::PORT | attr_mask::ACCESS_FLAGS)
//!     .unwrap();
//! assert_eq!(dev.query_qp(qpn).unwrap().qp_state, QpState::Init as u32);
//! dev.destroy_qp(qpn).unwrap();
//! dev.destroy_cq(cq).unwrap();
//! ```
#![forbid(unsafe_code)]

use std::os::fd::OwnedFd;
use std::time::Duration;

use mrkit_soft::mw::{BindInfo, MwInfo};
use mrkit_soft::{AccessFlags, DeviceAttr, Errno, Error, MrInfo, MwType, Result, UserMemory};

pub use mrkit_soft::cq::Wc;
pub use mrkit_soft::qp::{
    attr_mask, send_flags, AddressVector, PostError, QpAttr, QpCap, QpInitAttr, RecvWr, SendWr,
    Sge, WrOpcode,
};

fn unsupported(op: &str) -> Error {
    Error::new(
        Errno::EOPNOTSUPP,
        format!("{op} is not implemented by this provider"),
    )
}

pub use mrkit_soft::PortAttr;

/// What `ibv_query_device` and `ibv_query_device_ex` report beyond [`DeviceAttr`]: every
/// other attribute `ibv_devinfo -v` prints, as the device reports it.
///
/// Where a library has no `ibv_query_device_ex` (or the device answers EOPNOTSUPP/ENOSYS),
/// libibverbs' inline `ibv_query_device_ex` falls back to `ibv_query_device` with the whole
/// extension zeroed; [`DeviceAttrEx::extended`] is then false and every extended field 0, which
/// is what `ibv_devinfo` prints for such a device.
///
/// ```
/// use mrkit::{Context, DeviceConfig};
/// let ctx = Context::open(DeviceConfig::rxe());
/// let ex = ctx.provider().query_device_ex();
/// assert_eq!((ex.max_ah, ex.max_mcast_grp, ex.num_comp_vectors), (32767, 0, 1));
/// ```
/// Registration counts of one open device ([`Provider::registration_counts`]).
///
/// ```
/// use mrkit::{AccessFlags, Buffer, Context};
/// let ctx = Context::open_default().unwrap();
/// let before = ctx.provider().registration_counts().unwrap();
/// let pd = ctx.alloc_pd().unwrap();
/// let mr = pd.register(Buffer::new(4096).unwrap(), AccessFlags::LOCAL_WRITE).unwrap();
/// let after = ctx.provider().registration_counts().unwrap();
/// assert_eq!(after.registrations - before.registrations, 1);
/// # drop(mr);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RegCounts {
    /// Successful registrations (`reg_mr`, including re-registrations that translate anew).
    pub registrations: u64,
    /// Failed registrations, any errno.
    pub failures: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct DeviceAttrEx {
    /// `max_ee_rd_atom` (`ibv_device_attr`; the C fields are `int`).
    pub max_ee_rd_atom: i32,
    /// `max_ee_init_rd_atom`.
    pub max_ee_init_rd_atom: i32,
    /// `max_ee` (end-to-end contexts).
    pub max_ee: i32,
    /// `max_rdd` (reliable datagram domains).
    pub max_rdd: i32,
    /// `max_raw_ipv6_qp`.
    pub max_raw_ipv6_qp: i32,
    /// `max_raw_ethy_qp`.
    pub max_raw_ethy_qp: i32,
    /// `max_mcast_grp`.
    pub max_mcast_grp: i32,
    /// `max_mcast_qp_attach`.
    pub max_mcast_qp_attach: i32,
    /// `max_total_mcast_qp_attach`.
    pub max_total_mcast_qp_attach: i32,
    /// `max_ah` (address handles).
    pub max_ah: i32,
    /// `max_fmr`.
    pub max_fmr: i32,
    /// `max_map_per_fmr`.
    pub max_map_per_fmr: i32,
    /// The library answered `ibv_query_device_ex` (false: every field below up to
    /// `phys_port_cnt_ex` is 0, as libibverbs' legacy fallback leaves it).
    pub extended: bool,
    /// `odp_caps.per_transport_caps.uc_odp_caps`.
    pub uc_odp_caps: u32,
    /// `odp_caps.per_transport_caps.ud_odp_caps`.
    pub ud_odp_caps: u32,
    /// `xrc_odp_caps`.
    pub xrc_odp_caps: u32,
    /// `completion_timestamp_mask` (0: no completion timestamps).
    pub completion_timestamp_mask: u64,
    /// `hca_core_clock` in kHz (0: unknown).
    pub hca_core_clock: u64,
    /// `device_cap_flags_ex` (its low 32 bits repeat `device_cap_flags`).
    pub device_cap_flags_ex: u64,
    /// `raw_packet_caps` (`IBV_RAW_PACKET_CAP_*`).
    pub raw_packet_caps: u32,
    /// `tso_caps.max_tso`.
    pub max_tso: u32,
    /// `tso_caps.supported_qpts` (bit n = QP type n).
    pub tso_supported_qpts: u32,
    /// `rss_caps.supported_qpts`.
    pub rss_supported_qpts: u32,
    /// `rss_caps.max_rwq_indirection_tables`.
    pub max_rwq_indirection_tables: u32,
    /// `rss_caps.max_rwq_indirection_table_size`.
    pub max_rwq_indirection_table_size: u32,
    /// `rss_caps.rx_hash_fields_mask`.
    pub rx_hash_fields_mask: u64,
    /// `rss_caps.rx_hash_function`.
    pub rx_hash_function: u8,
    /// `max_wq_type_rq`.
    pub max_wq_type_rq: u32,
    /// `packet_pacing_caps.qp_rate_limit_min` (kbps).
    pub qp_rate_limit_min: u32,
    /// `packet_pacing_caps.qp_rate_limit_max` (kbps).
    pub qp_rate_limit_max: u32,
    /// `packet_pacing_caps.supported_qpts`.
    pub packet_pacing_supported_qpts: u32,
    /// `tm_caps.max_rndv_hdr_size`.
    pub tm_max_rndv_hdr_size: u32,
    /// `tm_caps.max_num_tags` (0: no tag matching).
    pub tm_max_num_tags: u32,
    /// `tm_caps.flags` (`IBV_TM_CAP_RC` = 1).
    pub tm_flags: u32,
    /// `tm_caps.max_ops`.
    pub tm_max_ops: u32,
    /// `tm_caps.max_sge`.
    pub tm_max_sge: u32,
    /// `cq_mod_caps.max_cq_count`.
    pub max_cq_count: u16,
    /// `cq_mod_caps.max_cq_period` (µs).
    pub max_cq_period: u16,
    /// `max_dm_size` (device memory bytes).
    pub max_dm_size: u64,
    /// `pci_atomic_caps.fetch_add` (`IBV_PCI_ATOMIC_OPERATION_*_BYTE_SIZE_SUP` bits).
    pub pci_atomic_fetch_add: u16,
    /// `pci_atomic_caps.swap`.
    pub pci_atomic_swap: u16,
    /// `pci_atomic_caps.compare_swap`.
    pub pci_atomic_compare_swap: u16,
    /// `phys_port_cnt_ex`.
    pub phys_port_cnt_ex: u32,
    /// `ibv_context.num_comp_vectors`.
    pub num_comp_vectors: i32,
}

impl DeviceAttrEx {
    /// What mrkit0 (and the drop-in `libibverbs.so.1` over it) reports: no EE, RDD, raw,
    /// multicast or FMR resources, 32767 address handles, no ODP but on RC, no timestamps, no
    /// TSO/RSS/pacing/tag matching/CQ moderation/device memory, one completion vector.
    pub fn mrkit0(a: &DeviceAttr) -> DeviceAttrEx {
        DeviceAttrEx {
            max_ah: 32767,
            extended: true,
            device_cap_flags_ex: a.device_cap_flags,
            phys_port_cnt_ex: u32::from(a.phys_port_cnt),
            num_comp_vectors: 1,
            ..DeviceAttrEx::default()
        }
    }
}

/// Operations a device backend provides. Handles are plain integers (PD handle, MR key), as a
/// kernel driver hands them out; the safe types in this crate own them.
pub trait Provider: Send + Sync + std::fmt::Debug + 'static {
    /// Device name (`mrkit0`).
    fn name(&self) -> &str;
    /// `ibv_query_device`.
    fn query_device(&self) -> DeviceAttr;
    /// `ibv_alloc_pd`.
    fn alloc_pd(&self) -> Result<u32>;
    /// `ibv_dealloc_pd`.
    fn dealloc_pd(&self, pd: u32) -> Result<()>;
    /// `ibv_reg_mr_iova2`. `mem` carries the guarantee that the memory outlives the MR (see
    /// [`UserMemory`]): a provider keeps `mem` (its owner, if any) until deregistration.
    fn reg_mr(&self, pd: u32, mem: UserMemory, iova: u64, access: AccessFlags) -> Result<MrInfo>;
    /// `ibv_dereg_mr`.
    fn dereg_mr(&self, lkey: u32) -> Result<()>;
    /// `ibv_rereg_mr` (`mem` is used with CHANGE_TRANSLATION only; else pass
    /// [`UserMemory::empty_at`]).
    fn rereg_mr(
        &self,
        _lkey: u32,
        _flags: u32,
        _pd: u32,
        _mem: UserMemory,
        _iova: u64,
        _access: AccessFlags,
    ) -> Result<MrInfo> {
        Err(unsupported("rereg_mr"))
    }
    /// `ibv_query_mr`.
    fn query_mr(&self, _lkey: u32) -> Result<MrInfo> {
        Err(unsupported("query_mr"))
    }
    /// `ibv_advise_mr`.
    fn advise_mr(
        &self,
        _pd: u32,
        _advice: u32,
        _flags: u32,
        _sges: &[(u32, u64, u32)],
    ) -> Result<()> {
        Err(unsupported("advise_mr"))
    }
    /// `ibv_alloc_mw`.
    fn alloc_mw(&self, _pd: u32, _ty: MwType) -> Result<u32> {
        Err(unsupported("alloc_mw"))
    }
    /// `ibv_dealloc_mw`.
    fn dealloc_mw(&self, _rkey: u32) -> Result<()> {
        Err(unsupported("dealloc_mw"))
    }
    /// Execute a window bind.
    fn bind_mw(
        &self,
        _qp_pd: u32,
        _qp_num: u32,
        _rkey: u32,
        _new_key: u8,
        _info: BindInfo,
    ) -> Result<u32> {
        Err(unsupported("bind_mw"))
    }
    /// Describe a window.
    fn query_mw(&self, _rkey: u32) -> Result<MwInfo> {
        Err(unsupported("query_mw"))
    }
    /// `ibv_create_comp_channel`: a channel number.
    fn create_comp_channel(&self) -> Result<u32> {
        Err(unsupported("create_comp_channel"))
    }
    /// `ibv_destroy_comp_channel` (EBUSY while a CQ reports to it).
    fn destroy_comp_channel(&self, _channel: u32) -> Result<()> {
        Err(unsupported("destroy_comp_channel"))
    }
    /// The channel's pollable descriptor (`ibv_comp_channel::fd`), as a duplicate the caller
    /// owns: readable while the channel holds events. Register it with `poll`/`epoll`/an async
    /// runtime; take the events with [`Provider::get_cq_event`].
    ///
    /// ```
    /// use std::time::Duration;
    /// let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());
    /// let dev = ctx.provider();
    /// let ch = dev.create_comp_channel().unwrap();
    /// let cq = dev.create_cq(8, Some(ch)).unwrap();
    /// dev.req_notify_cq(cq, false).unwrap(); // the next completion posts an event
    /// let fd = dev.comp_channel_fd(ch).unwrap(); // poll/epoll it for POLLIN
    /// assert_eq!(dev.get_cq_event(ch, Some(Duration::ZERO)).unwrap(), None); // nothing yet
    /// assert_eq!(dev.destroy_comp_channel(ch).unwrap_err().errno(), mrkit::Errno::EBUSY);
    /// dev.destroy_cq(cq).unwrap();
    /// dev.destroy_comp_channel(ch).unwrap();
    /// drop(fd);
    /// ```
    fn comp_channel_fd(&self, _channel: u32) -> Result<OwnedFd> {
        Err(unsupported("comp_channel_fd"))
    }
    /// `ibv_get_cq_event`: the number of a CQ whose armed notification fired, waiting up to
    /// `timeout` (`None`: forever; `Some(Duration::ZERO)`: do not block). `Ok(None)` when the
    /// time passed without an event.
    fn get_cq_event(&self, _channel: u32, _timeout: Option<Duration>) -> Result<Option<u32>> {
        Err(unsupported("get_cq_event"))
    }
    /// `ibv_create_cq` with `cqe` entries, reporting to `channel` when armed.
    fn create_cq(&self, _cqe: u32, _channel: Option<u32>) -> Result<u32> {
        Err(unsupported("create_cq"))
    }
    /// `ibv_destroy_cq` (EBUSY while a QP uses it).
    fn destroy_cq(&self, _cq: u32) -> Result<()> {
        Err(unsupported("destroy_cq"))
    }
    /// `ibv_poll_cq`: append up to `max` completions to `out`; how many.
    fn poll_cq(&self, _cq: u32, _out: &mut Vec<Wc>, _max: usize) -> Result<usize> {
        Err(unsupported("poll_cq"))
    }
    /// `ibv_req_notify_cq` (one-shot arm).
    fn req_notify_cq(&self, _cq: u32, _solicited_only: bool) -> Result<()> {
        Err(unsupported("req_notify_cq"))
    }
    /// `ibv_create_qp` (RC): the QP number and the capacities granted.
    fn create_qp(&self, _init: QpInitAttr) -> Result<(u32, QpCap)> {
        Err(unsupported("create_qp"))
    }
    /// `ibv_destroy_qp`. After it returns the device no longer touches the QP's WRs' memory.
    fn destroy_qp(&self, _qpn: u32) -> Result<()> {
        Err(unsupported("destroy_qp"))
    }
    /// `ibv_modify_qp` with an [`attr_mask`] of the fields of `attr` to apply. Drives the
    /// RESET → INIT → RTR → RTS sequence (and ERR, RESET); the address vector in `attr` may
    /// name the peer by GID (`dgid`) or, on the in-process link, by node
    /// ([`Provider::local_av`]).
    fn modify_qp(&self, _qpn: u32, _attr: &QpAttr, _mask: u32) -> Result<()> {
        Err(unsupported("modify_qp"))
    }
    /// `ibv_query_qp`: the QP's attributes (`qp_state` is the current state).
    fn query_qp(&self, _qpn: u32) -> Result<QpAttr> {
        Err(unsupported("query_qp"))
    }
    /// `ibv_post_send`: on failure, the index of the first WR not posted and why.
    fn post_send(&self, _qpn: u32, _wrs: &[SendWr]) -> std::result::Result<(), PostError> {
        Err(PostError {
            bad_wr: 0,
            error: unsupported("post_send"),
        })
    }
    /// `ibv_post_recv`.
    fn post_recv(&self, _qpn: u32, _wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        Err(PostError {
            bad_wr: 0,
            error: unsupported("post_recv"),
        })
    }
    /// The rest of `ibv_query_device` / `ibv_query_device_ex` ([`DeviceAttrEx`]). The default
    /// is a device without the extended query: every field 0.
    fn query_device_ex(&self) -> DeviceAttrEx {
        DeviceAttrEx::default()
    }
    /// `ibv_query_port`: EINVAL for a port the device does not have.
    fn query_port(&self, _port: u8) -> Result<PortAttr> {
        Err(unsupported("query_port"))
    }
    /// `ibv_query_gid(port 1, index 0)`: the port's RoCEv2 GID (IPv4-mapped for IPv4).
    fn query_gid(&self) -> Result<[u8; 16]> {
        Err(unsupported("query_gid"))
    }
    /// The address vector (port 1) by which a peer QP on this host reaches this device: by
    /// default its GID ([`Provider::query_gid`]); `mrkit0` answers with its in-process link
    /// node, so two contexts of one process connect without a UDP port.
    fn local_av(&self) -> Result<AddressVector> {
        let gid = self.query_gid()?;
        let ip = std::net::Ipv6Addr::from(gid);
        let ip = match ip.to_ipv4_mapped() {
            Some(v4) => std::net::IpAddr::V4(v4),
            None => std::net::IpAddr::V6(ip),
        };
        Ok(AddressVector {
            dest_node: 0,
            dgid: Some(ip),
            port_num: 1,
        })
    }
    /// Registrations this open device has counted: successful ones and failures (what
    /// `mrkit stat` shows for it). The default is `None`: the provider keeps no count.
    fn registration_counts(&self) -> Option<RegCounts> {
        None
    }
    /// The embedded software device, when this provider is one (statistics, data path).
    fn soft(&self) -> Option<&mrkit_soft::Context> {
        None
    }
}

impl Provider for mrkit_soft::Context {
    fn name(&self) -> &str {
        mrkit_soft::DEVICE_NAME
    }
    fn query_device(&self) -> DeviceAttr {
        mrkit_soft::Context::query_device(self)
    }
    fn query_device_ex(&self) -> DeviceAttrEx {
        DeviceAttrEx::mrkit0(&mrkit_soft::Context::query_device(self))
    }
    fn alloc_pd(&self) -> Result<u32> {
        mrkit_soft::Context::alloc_pd(self)
    }
    fn dealloc_pd(&self, pd: u32) -> Result<()> {
        mrkit_soft::Context::dealloc_pd(self, pd)
    }
    fn reg_mr(&self, pd: u32, mem: UserMemory, iova: u64, access: AccessFlags) -> Result<MrInfo> {
        mrkit_soft::Context::reg_mr(self, pd, mem, iova, access)
    }
    fn dereg_mr(&self, lkey: u32) -> Result<()> {
        mrkit_soft::Context::dereg_mr(self, lkey)
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
        mrkit_soft::Context::rereg_mr(self, lkey, flags, pd, mem, iova, access)
    }
    fn query_mr(&self, lkey: u32) -> Result<MrInfo> {
        mrkit_soft::Context::query_mr(self, lkey)
    }
    fn advise_mr(&self, pd: u32, advice: u32, flags: u32, sges: &[(u32, u64, u32)]) -> Result<()> {
        mrkit_soft::Context::advise_mr(self, pd, advice, flags, sges)
    }
    fn alloc_mw(&self, pd: u32, ty: MwType) -> Result<u32> {
        mrkit_soft::Context::alloc_mw(self, pd, ty)
    }
    fn dealloc_mw(&self, rkey: u32) -> Result<()> {
        mrkit_soft::Context::dealloc_mw(self, rkey)
    }
    fn bind_mw(
        &self,
        qp_pd: u32,
        qp_num: u32,
        rkey: u32,
        new_key: u8,
        info: BindInfo,
    ) -> Result<u32> {
        mrkit_soft::Context::bind_mw(self, qp_pd, qp_num, rkey, new_key, info)
    }
    fn query_mw(&self, rkey: u32) -> Result<MwInfo> {
        mrkit_soft::Context::query_mw(self, rkey)
    }
    fn create_comp_channel(&self) -> Result<u32> {
        Ok(mrkit_soft::Context::create_comp_channel(self))
    }
    fn destroy_comp_channel(&self, channel: u32) -> Result<()> {
        mrkit_soft::Context::destroy_comp_channel(self, channel)
    }
    fn comp_channel_fd(&self, channel: u32) -> Result<OwnedFd> {
        mrkit_soft::Context::comp_channel_fd(self, channel)
    }
    fn get_cq_event(&self, channel: u32, timeout: Option<Duration>) -> Result<Option<u32>> {
        mrkit_soft::Context::get_cq_event(self, channel, timeout)
    }
    fn create_cq(&self, cqe: u32, channel: Option<u32>) -> Result<u32> {
        mrkit_soft::Context::create_cq(self, cqe, channel)
    }
    fn destroy_cq(&self, cq: u32) -> Result<()> {
        mrkit_soft::Context::destroy_cq(self, cq)
    }
    fn poll_cq(&self, cq: u32, out: &mut Vec<Wc>, max: usize) -> Result<usize> {
        mrkit_soft::Context::poll_cq(self, cq, out, max)
    }
    fn req_notify_cq(&self, cq: u32, solicited_only: bool) -> Result<()> {
        mrkit_soft::Context::req_notify_cq(self, cq, solicited_only)
    }
    fn create_qp(&self, init: QpInitAttr) -> Result<(u32, QpCap)> {
        mrkit_soft::Context::create_qp(self, init)
    }
    fn destroy_qp(&self, qpn: u32) -> Result<()> {
        mrkit_soft::Context::destroy_qp(self, qpn)
    }
    fn modify_qp(&self, qpn: u32, attr: &QpAttr, mask: u32) -> Result<()> {
        if mask & attr_mask::AV != 0 && attr.ah_attr.dgid.is_some() {
            // A peer named by GID talks over UDP: bind the port before its traffic can arrive
            // (what `mrkit_soft::qp::connect::connect_qp` does first).
            self.udp_port()?;
        }
        mrkit_soft::Context::modify_qp(self, qpn, attr, mask)
    }
    fn query_qp(&self, qpn: u32) -> Result<QpAttr> {
        mrkit_soft::Context::query_qp(self, qpn)
    }
    fn post_send(&self, qpn: u32, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
        mrkit_soft::Context::post_send(self, qpn, wrs)
    }
    fn post_recv(&self, qpn: u32, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        mrkit_soft::Context::post_recv(self, qpn, wrs)
    }
    fn query_gid(&self) -> Result<[u8; 16]> {
        mrkit_soft::Context::query_gid(self)
    }
    /// The values the drop-in `libibverbs.so.1` reports for the same device: one ACTIVE
    /// Ethernet port, max MTU 4096, 4X EDR, LinkUp, CM supported, one GID and one P_Key. The
    /// active MTU follows rxe: the largest IB MTU at most the network interface's MTU minus
    /// 80 bytes of RoCEv2 headers (4096 on a loopback address); 1024 when the device has no
    /// UDP address or the interface is unknown. Asking binds the device's UDP port, as the
    /// drop-in does.
    fn query_port(&self, port: u8) -> Result<PortAttr> {
        mrkit_soft::Context::query_port(self, port)
    }
    fn local_av(&self) -> Result<AddressVector> {
        Ok(AddressVector {
            dest_node: self.node_id(),
            dgid: None,
            port_num: 1,
        })
    }
    fn registration_counts(&self) -> Option<RegCounts> {
        let st = self.stats();
        Some(RegCounts {
            registrations: st.registrations,
            failures: st.failures.iter().map(|(_, n)| n).sum(),
        })
    }
    fn soft(&self) -> Option<&mrkit_soft::Context> {
        Some(self)
    }
}
