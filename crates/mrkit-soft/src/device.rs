//! Device attributes, limits and profiles.
//!
//! The default profile models Linux rxe (`rxe_param.h`, see `docs/semantics.md`); the
//! `connectx5-seed` profile models the NIC of the seed documents (max_mr 1000, max_mr_size
//! 512 MiB, log_num_mtt 20). Every limit can be overridden by the builder or by `MRKIT_*`
//! environment variables, and [`DeviceConfig::sources`] tells where each value came from.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::fmt;

/// Which completion statuses the data path reports where rxe and hardware disagree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StatusModel {
    /// IBA / mlx5 hardware behaviour (default): LOC_PROT_ERR for bad gather lkeys, LOC_LEN_ERR
    /// for short receive buffers, window bounds enforced, ZERO_BASED MRs accepted.
    #[default]
    Hardware,
    /// Linux rxe's choices (LOC_QP_OP_ERR for gather failures, ZERO_BASED/HUGETLB MRs rejected
    /// with EOPNOTSUPP, ...).
    Rxe,
}

/// Where a configuration value came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The built-in default (rxe model).
    Default,
    /// A named profile.
    Profile(&'static str),
    /// An environment variable.
    Env(&'static str),
    /// Set through the Rust builder.
    Builder,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => f.write_str("default"),
            Source::Profile(p) => write!(f, "profile {p}"),
            Source::Env(v) => write!(f, "env {v}"),
            Source::Builder => f.write_str("builder"),
        }
    }
}

/// ODP general capability bits (`IBV_ODP_SUPPORT*`).
pub mod odp_caps {
    /// `IBV_ODP_SUPPORT`.
    pub const SUPPORT: u64 = 1;
    /// `IBV_ODP_SUPPORT_IMPLICIT`.
    pub const IMPLICIT: u64 = 2;
    /// Per-transport bits: SEND.
    pub const SEND: u32 = 1;
    /// RECV.
    pub const RECV: u32 = 2;
    /// WRITE.
    pub const WRITE: u32 = 4;
    /// READ.
    pub const READ: u32 = 8;
    /// ATOMIC.
    pub const ATOMIC: u32 = 16;
    /// SRQ_RECV.
    pub const SRQ_RECV: u32 = 32;
}

/// `IBV_DEVICE_*` capability flags (subset this device sets).
pub mod cap_flags {
    /// IBV_DEVICE_BAD_PKEY_CNTR
    pub const BAD_PKEY_CNTR: u64 = 1 << 1;
    /// IBV_DEVICE_BAD_QKEY_CNTR
    pub const BAD_QKEY_CNTR: u64 = 1 << 2;
    /// IBV_DEVICE_AUTO_PATH_MIG
    pub const AUTO_PATH_MIG: u64 = 1 << 4;
    /// IBV_DEVICE_CHANGE_PHY_PORT
    pub const CHANGE_PHY_PORT: u64 = 1 << 5;
    /// IBV_DEVICE_UD_AV_PORT_ENFORCE
    pub const UD_AV_PORT_ENFORCE: u64 = 1 << 6;
    /// IBV_DEVICE_PORT_ACTIVE_EVENT
    pub const PORT_ACTIVE_EVENT: u64 = 1 << 10;
    /// IBV_DEVICE_SYS_IMAGE_GUID
    pub const SYS_IMAGE_GUID: u64 = 1 << 11;
    /// IBV_DEVICE_RC_RNR_NAK_GEN
    pub const RC_RNR_NAK_GEN: u64 = 1 << 12;
    /// IBV_DEVICE_SRQ_RESIZE
    pub const SRQ_RESIZE: u64 = 1 << 13;
    /// IBV_DEVICE_MEM_WINDOW
    pub const MEM_WINDOW: u64 = 1 << 17;
    /// IBV_DEVICE_MEM_MGT_EXTENSIONS
    pub const MEM_MGT_EXTENSIONS: u64 = 1 << 21;
    /// IBV_DEVICE_MEM_WINDOW_TYPE_2A
    pub const MEM_WINDOW_TYPE_2A: u64 = 1 << 23;
    /// IBV_DEVICE_MEM_WINDOW_TYPE_2B
    pub const MEM_WINDOW_TYPE_2B: u64 = 1 << 24;
}

/// Device attributes as `ibv_query_device(_ex)` reports them, plus the translation capacity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Firmware version string.
    pub fw_ver: String,
    /// Node GUID.
    pub node_guid: u64,
    /// System image GUID.
    pub sys_image_guid: u64,
    /// Largest registration in bytes.
    pub max_mr_size: u64,
    /// Supported page sizes (bit n = 2^n bytes).
    pub page_size_cap: u64,
    /// IEEE OUI of the vendor (0xFFFFFF as rxe: no vendor, so tools stay on the generic path).
    pub vendor_id: u32,
    /// Vendor part id (0: generic).
    pub vendor_part_id: u32,
    /// Hardware version.
    pub hw_ver: u32,
    /// Max QPs.
    pub max_qp: u32,
    /// Max WRs per queue.
    pub max_qp_wr: u32,
    /// `IBV_DEVICE_*` flags.
    pub device_cap_flags: u64,
    /// Max SGEs per WR.
    pub max_sge: u32,
    /// Max SGEs per RDMA READ.
    pub max_sge_rd: u32,
    /// Max CQs.
    pub max_cq: u32,
    /// Max CQ entries.
    pub max_cqe: u32,
    /// Max MRs alive at once.
    pub max_mr: u32,
    /// Max PDs.
    pub max_pd: u32,
    /// Max outstanding READ/atomic per QP as responder.
    pub max_qp_rd_atom: u32,
    /// Max outstanding READ/atomic per QP as requester.
    pub max_qp_init_rd_atom: u32,
    /// Max responder resources in total.
    pub max_res_rd_atom: u32,
    /// `IBV_ATOMIC_HCA` (1).
    pub atomic_cap: u32,
    /// Max memory windows.
    pub max_mw: u32,
    /// Max SRQs.
    pub max_srq: u32,
    /// Max WRs per SRQ.
    pub max_srq_wr: u32,
    /// Max SGEs per SRQ WR.
    pub max_srq_sge: u32,
    /// P_Key table size.
    pub max_pkeys: u16,
    /// Local CA ACK delay.
    pub local_ca_ack_delay: u8,
    /// Physical ports.
    pub phys_port_cnt: u8,
    /// Max inline data per send WR.
    pub max_inline_data: u32,
    /// ODP general caps (`IBV_ODP_SUPPORT`, `IBV_ODP_SUPPORT_IMPLICIT`).
    pub odp_general_caps: u64,
    /// ODP RC transport caps.
    pub odp_rc_caps: u32,
    /// Translation entries (MTT) of the device: 2^log_num_mtt.
    pub max_mtt: u64,
    /// log2 of the translation capacity.
    pub log_num_mtt: u8,
    /// Largest message (port max_msg_sz).
    pub max_msg_sz: u32,
}

/// Builder and environment reader for the device limits.
///
/// ```
/// use mrkit_soft::DeviceConfig;
/// let cfg = DeviceConfig::rxe().max_mr(1000).log_num_mtt(20);
/// assert_eq!(cfg.attr().max_mr, 1000);
/// assert_eq!(cfg.attr().max_mtt, 1 << 20);
/// ```
#[derive(Debug, Clone)]
pub struct DeviceConfig {
    attr: DeviceAttr,
    profile: &'static str,
    status_model: StatusModel,
    dontfork: bool,
    udp_addr: Option<std::net::SocketAddr>,
    gso: bool,
    icrc_ipv4: crate::wire::Ipv4IcrcMode,
    delayed_acks: bool,
    progress: ProgressPolicy,
    faults: Option<crate::fault::FaultConfig>,
    sources: BTreeMap<&'static str, Source>,
}

/// Environment variables understood by [`DeviceConfig::from_env`], with what they set.
pub const ENV_VARS: &[(&str, &str)] = &[
    ("MRKIT_PROFILE", "rxe (default) or connectx5-seed"),
    ("MRKIT_MAX_MR", "max_mr: MRs alive at once"),
    (
        "MRKIT_MAX_MR_SIZE",
        "max_mr_size in bytes (4096, 64KiB, 1GiB ...)",
    ),
    (
        "MRKIT_LOG_NUM_MTT",
        "log2 of the translation entries (MTT) of the device",
    ),
    ("MRKIT_MAX_PD", "max_pd"),
    ("MRKIT_MAX_MW", "max_mw"),
    ("MRKIT_MAX_QP", "max_qp"),
    ("MRKIT_MAX_CQ", "max_cq"),
    ("MRKIT_MAX_CQE", "max_cqe"),
    ("MRKIT_MAX_QP_WR", "max_qp_wr"),
    (
        "MRKIT_ODP",
        "0 (no ODP), 1 (explicit ODP) or implicit (explicit + implicit, default)",
    ),
    ("MRKIT_STATUS_MODEL", "hardware (default) or rxe"),
    (
        "MRKIT_DONTFORK",
        "0 (default, as rdma-core on kernels that copy pinned pages at fork): leave registered pages to fork; 1: mark them MADV_DONTFORK",
    ),
    (
        "MRKIT_PIN",
        "auto (default), io_uring or mlock: the pinning mechanism",
    ),
    (
        "MRKIT_ADDR",
        "IP (or ip:port) of the device's RoCEv2 UDP port; default: a distinct 127.x.y.z per instance",
    ),
    (
        "MRKIT_GSO",
        "1 (default): send runs of packets as one UDP GSO buffer; 0: one datagram per packet",
    ),
    (
        "MRKIT_ICRC_IPV4",
        "exact (default): an IPv4 packet's ICRC must match the one IP ID an mrkit sender uses; solve: accept any IP ID (foreign peers, NIC GRO)",
    ),
    (
        "MRKIT_DELAYED_ACK",
        "1 (default): an ACK produced in the application's poll may wait up to 30 µs and leaves right after its next send; 0: every ACK leaves at once, as on hardware",
    ),
    (
        "MRKIT_PROGRESS",
        "auto (default), spin or block: what the progress thread does when idle and no application thread polls",
    ),
    (
        "MRKIT_FAULTS",
        "fault injection on sends: loss=0.1,dup=0.01,reorder=0.05,corrupt=0.01,delay=1ms,seed=N",
    ),
];

/// Parse sizes such as `4096`, `64KiB`, `8MiB`, `1GiB`, `2G`, `0x1000`.
///
/// ```
/// use mrkit_soft::device::parse_size;
/// assert_eq!(parse_size("64KiB"), Some(65536));
/// assert_eq!(parse_size("1GiB"), Some(1 << 30));
/// assert_eq!(parse_size("0x1000"), Some(4096));
/// assert_eq!(parse_size("-1"), None);
/// ```
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    if let Some(hex) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        return u64::from_str_radix(hex, 16).ok();
    }
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return None,
    };
    n.checked_mul(mult)
}

impl DeviceConfig {
    /// The rxe model (`rxe_param.h`, upstream 2025-2026), this device's default.
    pub fn rxe() -> DeviceConfig {
        use cap_flags::*;
        let attr = DeviceAttr {
            fw_ver: "0.1.0".into(),
            node_guid: 0x02c0_ffee_0000_0001,
            sys_image_guid: 0x02c0_ffee_0000_0001,
            max_mr_size: u64::MAX,
            page_size_cap: 0xffff_f000,
            // rxe's RXE_VENDOR_ID: not zero (pyverbs' test_device checks), not Mellanox, EFA,
            // Chelsio or Intel, so perftest stays on the generic verbs path.
            vendor_id: 0x00ff_ffff,
            vendor_part_id: 0,
            hw_ver: 0,
            max_qp: 1_048_560,
            max_qp_wr: 1 << 20,
            device_cap_flags: BAD_PKEY_CNTR
                | BAD_QKEY_CNTR
                | AUTO_PATH_MIG
                | CHANGE_PHY_PORT
                | UD_AV_PORT_ENFORCE
                | PORT_ACTIVE_EVENT
                | SYS_IMAGE_GUID
                | RC_RNR_NAK_GEN
                | SRQ_RESIZE
                | MEM_MGT_EXTENSIONS
                | MEM_WINDOW
                | MEM_WINDOW_TYPE_2B,
            max_sge: 32,
            max_sge_rd: 32,
            max_cq: 1 << 20,
            max_cqe: (1 << 15) - 1,
            max_mr: 524_287,
            max_pd: 1 << 20,
            max_qp_rd_atom: 128,
            max_qp_init_rd_atom: 128,
            max_res_rd_atom: 0x3f000,
            atomic_cap: 1,
            max_mw: 524_287,
            max_srq: 917_503,
            max_srq_wr: 1 << 20,
            max_srq_sge: 27,
            max_pkeys: 64,
            local_ca_ack_delay: 15,
            phys_port_cnt: 1,
            max_inline_data: 512,
            odp_general_caps: odp_caps::SUPPORT | odp_caps::IMPLICIT,
            odp_rc_caps: odp_caps::SEND
                | odp_caps::RECV
                | odp_caps::WRITE
                | odp_caps::READ
                | odp_caps::ATOMIC
                | odp_caps::SRQ_RECV,
            max_mtt: 1 << 30,
            log_num_mtt: 30,
            max_msg_sz: 1 << 31,
        };
        DeviceConfig {
            attr,
            profile: "rxe",
            status_model: StatusModel::Hardware,
            // rdma-core (v44) marks nothing unless ibv_fork_init / RDMAV_FORK_SAFE asks; the
            // device copies through the process's virtual addresses, so a fork never leaves a
            // registration pointing at pages the parent no longer maps.
            dontfork: false,
            udp_addr: None,
            gso: true,
            icrc_ipv4: crate::wire::Ipv4IcrcMode::Exact,
            delayed_acks: true,
            progress: ProgressPolicy::Auto,
            faults: None,
            sources: BTreeMap::new(),
        }
    }

    /// The NIC of the seed documents: ConnectX-5 defaults as the seeds quote them
    /// (max_mr 1000, max_mr_size 512 MiB, log_num_mtt 20, type 2A and 2B windows).
    pub fn connectx5_seed() -> DeviceConfig {
        const P: Source = Source::Profile("connectx5-seed");
        let mut c = DeviceConfig::rxe();
        c.profile = "connectx5-seed";
        c.attr.max_mr = 1000;
        c.attr.max_mr_size = 512 << 20;
        c.attr.max_mtt = 1 << 20;
        c.attr.log_num_mtt = 20;
        c.attr.device_cap_flags |= cap_flags::MEM_WINDOW_TYPE_2A;
        c.attr.max_cqe = (1 << 22) - 1;
        for k in [
            "max_mr",
            "max_mr_size",
            "log_num_mtt",
            "device_cap_flags",
            "max_cqe",
        ] {
            c.sources.insert(k, P);
        }
        c
    }

    /// A profile by name (`rxe`, `connectx5-seed`).
    pub fn profile(name: &str) -> Option<DeviceConfig> {
        match name {
            "rxe" | "default" => Some(DeviceConfig::rxe()),
            "connectx5-seed" | "cx5" | "connectx5" => Some(DeviceConfig::connectx5_seed()),
            _ => None,
        }
    }

    /// Default profile overlaid with the `MRKIT_*` environment variables ([`ENV_VARS`]).
    /// Unparsable values are reported as errors rather than ignored.
    pub fn from_env() -> Result<DeviceConfig, String> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// As [`from_env`](Self::from_env) with an arbitrary variable lookup (for tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<DeviceConfig, String> {
        let mut c = match get("MRKIT_PROFILE") {
            Some(p) => DeviceConfig::profile(&p).ok_or_else(|| {
                format!("MRKIT_PROFILE={p}: unknown profile (rxe, connectx5-seed)")
            })?,
            None => DeviceConfig::rxe(),
        };
        let num = |k: &'static str| -> Result<Option<u64>, String> {
            match get(k) {
                None => Ok(None),
                Some(v) => parse_size(&v)
                    .map(Some)
                    .ok_or_else(|| format!("{k}={v}: not a number")),
            }
        };
        let u32v = |k: &'static str| -> Result<Option<u32>, String> {
            num(k)?
                .map(|v| u32::try_from(v).map_err(|_| format!("{k}={v}: larger than 2^32-1")))
                .transpose()
        };
        if let Some(v) = u32v("MRKIT_MAX_MR")? {
            c.attr.max_mr = v;
            c.sources.insert("max_mr", Source::Env("MRKIT_MAX_MR"));
        }
        if let Some(v) = num("MRKIT_MAX_MR_SIZE")? {
            c.attr.max_mr_size = v;
            c.sources
                .insert("max_mr_size", Source::Env("MRKIT_MAX_MR_SIZE"));
        }
        if let Some(v) = num("MRKIT_LOG_NUM_MTT")? {
            if v > 40 {
                return Err(format!("MRKIT_LOG_NUM_MTT={v}: must be at most 40"));
            }
            c.attr.log_num_mtt = v as u8;
            c.attr.max_mtt = 1 << v;
            c.sources
                .insert("log_num_mtt", Source::Env("MRKIT_LOG_NUM_MTT"));
        }
        for (var, key) in [
            ("MRKIT_MAX_PD", "max_pd"),
            ("MRKIT_MAX_MW", "max_mw"),
            ("MRKIT_MAX_QP", "max_qp"),
            ("MRKIT_MAX_CQ", "max_cq"),
            ("MRKIT_MAX_CQE", "max_cqe"),
            ("MRKIT_MAX_QP_WR", "max_qp_wr"),
        ] {
            if let Some(v) = u32v(var)? {
                let slot = match key {
                    "max_pd" => &mut c.attr.max_pd,
                    "max_mw" => &mut c.attr.max_mw,
                    "max_qp" => &mut c.attr.max_qp,
                    "max_cq" => &mut c.attr.max_cq,
                    "max_cqe" => &mut c.attr.max_cqe,
                    _ => &mut c.attr.max_qp_wr,
                };
                *slot = v;
                c.sources.insert(key, Source::Env(var));
            }
        }
        if let Some(v) = get("MRKIT_ODP") {
            c.attr.odp_general_caps = match v.as_str() {
                "0" | "off" | "no" => 0,
                "1" | "explicit" => odp_caps::SUPPORT,
                "implicit" | "2" => odp_caps::SUPPORT | odp_caps::IMPLICIT,
                _ => return Err(format!("MRKIT_ODP={v}: expected 0, 1 or implicit")),
            };
            c.sources.insert("odp_caps", Source::Env("MRKIT_ODP"));
        }
        if let Some(v) = get("MRKIT_STATUS_MODEL") {
            c.status_model = match v.as_str() {
                "hardware" | "mlx5" | "iba" => StatusModel::Hardware,
                "rxe" => StatusModel::Rxe,
                _ => return Err(format!("MRKIT_STATUS_MODEL={v}: expected hardware or rxe")),
            };
            c.sources
                .insert("status_model", Source::Env("MRKIT_STATUS_MODEL"));
        }
        if let Some(v) = get("MRKIT_ADDR").filter(|v| !v.trim().is_empty()) {
            c.udp_addr = Some(crate::addr::parse_addr(&v).map_err(|e| format!("MRKIT_ADDR: {e}"))?);
            c.sources.insert("udp_addr", Source::Env("MRKIT_ADDR"));
        }
        if let Some(v) = get("MRKIT_DELAYED_ACK").filter(|v| !v.trim().is_empty()) {
            c.delayed_acks = !matches!(v.trim(), "0" | "off" | "no" | "false");
            c.sources
                .insert("delayed_acks", Source::Env("MRKIT_DELAYED_ACK"));
        }
        if let Some(v) = get("MRKIT_GSO") {
            c.gso = !matches!(v.as_str(), "0" | "off" | "no" | "false");
            c.sources.insert("gso", Source::Env("MRKIT_GSO"));
        }
        if let Some(v) = get("MRKIT_ICRC_IPV4").filter(|v| !v.trim().is_empty()) {
            c.icrc_ipv4 = crate::wire::Ipv4IcrcMode::parse(&v)
                .ok_or_else(|| format!("MRKIT_ICRC_IPV4={v}: expected exact or solve"))?;
            c.sources
                .insert("icrc_ipv4", Source::Env("MRKIT_ICRC_IPV4"));
        }
        if let Some(v) = get("MRKIT_PROGRESS").filter(|v| !v.trim().is_empty()) {
            c.progress = ProgressPolicy::parse(&v)
                .ok_or_else(|| format!("MRKIT_PROGRESS={v}: expected auto, spin or block"))?;
            c.sources.insert("progress", Source::Env("MRKIT_PROGRESS"));
        }
        if let Some(v) = get("MRKIT_FAULTS").filter(|v| !v.trim().is_empty()) {
            c.faults = Some(
                crate::fault::FaultConfig::parse(&v).map_err(|e| format!("MRKIT_FAULTS: {e}"))?,
            );
            c.sources.insert("faults", Source::Env("MRKIT_FAULTS"));
        }
        if let Some(v) = get("MRKIT_DONTFORK") {
            c.dontfork = !matches!(v.as_str(), "0" | "off" | "no" | "false");
            c.sources.insert("dontfork", Source::Env("MRKIT_DONTFORK"));
        }
        Ok(c)
    }

    fn set(mut self, key: &'static str, f: impl FnOnce(&mut DeviceAttr)) -> Self {
        f(&mut self.attr);
        self.sources.insert(key, Source::Builder);
        self
    }

    /// Set max_mr (MRs alive at once; the next registration fails with ENOMEM).
    pub fn max_mr(self, n: u32) -> Self {
        self.set("max_mr", |a| a.max_mr = n)
    }
    /// Set max_mr_size (longer registrations fail with EINVAL).
    pub fn max_mr_size(self, n: u64) -> Self {
        self.set("max_mr_size", |a| a.max_mr_size = n)
    }
    /// Set the translation capacity to 2^log entries (registrations needing more: ENOMEM).
    pub fn log_num_mtt(self, log: u8) -> Self {
        let log = log.min(40);
        self.set("log_num_mtt", |a| {
            a.log_num_mtt = log;
            a.max_mtt = 1 << log;
        })
    }
    /// Set max_pd.
    pub fn max_pd(self, n: u32) -> Self {
        self.set("max_pd", |a| a.max_pd = n)
    }
    /// Set max_mw.
    pub fn max_mw(self, n: u32) -> Self {
        self.set("max_mw", |a| a.max_mw = n)
    }
    /// Set the ODP general caps (0 disables ODP: ON_DEMAND registrations get EOPNOTSUPP).
    pub fn odp_caps(self, general: u64) -> Self {
        self.set("odp_caps", |a| a.odp_general_caps = general)
    }
    /// Choose IBA/hardware or rxe completion statuses and MR flag rules.
    pub fn status_model(mut self, m: StatusModel) -> Self {
        self.status_model = m;
        self.sources.insert("status_model", Source::Builder);
        self
    }
    /// Enable or disable MADV_DONTFORK on registered ranges (default: off, as rdma-core without
    /// `ibv_fork_init`; `MRKIT_DONTFORK=1` turns it on).
    pub fn dontfork(mut self, on: bool) -> Self {
        self.dontfork = on;
        self.sources.insert("dontfork", Source::Builder);
        self
    }
    /// Bind the device's RoCEv2 UDP port to this address (port 4791 unless given).
    pub fn udp_addr(mut self, addr: std::net::SocketAddr) -> Self {
        self.udp_addr = Some(addr);
        self.sources.insert("udp_addr", Source::Builder);
        self
    }
    /// Inject faults on the UDP send path (tests; see [`crate::net::fault`]).
    pub fn faults(mut self, f: crate::fault::FaultConfig) -> Self {
        self.faults = Some(f);
        self.sources.insert("faults", Source::Builder);
        self
    }
    /// Send runs of equal packets as one UDP GSO buffer (default on; off makes every packet
    /// its own datagram on the wire, e.g. for captures on loopback).
    pub fn gso(mut self, on: bool) -> Self {
        self.gso = on;
        self.sources.insert("gso", Source::Builder);
        self
    }
    /// Whether UDP segmentation offload is used.
    pub fn uses_gso(&self) -> bool {
        self.gso
    }
    /// How received IPv4 packets' ICRCs are checked (default
    /// [`Exact`](crate::wire::Ipv4IcrcMode::Exact); `MRKIT_ICRC_IPV4`).
    pub fn icrc_ipv4_mode(mut self, mode: crate::wire::Ipv4IcrcMode) -> Self {
        self.icrc_ipv4 = mode;
        self.sources.insert("icrc_ipv4", Source::Builder);
        self
    }
    /// The IPv4 ICRC check mode.
    pub fn icrc_ipv4(&self) -> crate::wire::Ipv4IcrcMode {
        self.icrc_ipv4
    }
    /// Delayed ACKs on the UDP link (default on; `MRKIT_DELAYED_ACK=0`). On: a plain ACK
    /// produced while the application polls may wait up to
    /// [`ACK_DELAY_MAX`](crate::driver::held_acks::ACK_DELAY_MAX) and leaves right after the
    /// application's next packets, so that a reply does not wait behind the ACK's send call
    /// (IBA lets a responder coalesce ACKs; the requester's timeout is far longer). Off: every
    /// ACK leaves at once, as a hardware responder sends it. See `docs/transport.md` for the
    /// bound and its one exception.
    ///
    /// ```
    /// use mrkit_soft::DeviceConfig;
    /// assert!(DeviceConfig::rxe().uses_delayed_acks());
    /// let c = DeviceConfig::rxe().delayed_acks(false);
    /// assert!(!c.uses_delayed_acks());
    /// ```
    pub fn delayed_acks(mut self, on: bool) -> Self {
        self.delayed_acks = on;
        self.sources.insert("delayed_acks", Source::Builder);
        self
    }
    /// Whether delayed ACKs are on.
    pub fn uses_delayed_acks(&self) -> bool {
        self.delayed_acks
    }
    /// What the progress thread does while idle (see [`crate::driver::progress`]).
    pub fn progress(mut self, policy: ProgressPolicy) -> Self {
        self.progress = policy;
        self.sources.insert("progress", Source::Builder);
        self
    }
    /// The progress-thread policy.
    pub fn progress_policy(&self) -> ProgressPolicy {
        self.progress
    }
    /// Configured UDP address (None: default 127.x.y.z).
    pub fn configured_udp_addr(&self) -> Option<std::net::SocketAddr> {
        self.udp_addr
    }
    /// Configured fault injection.
    pub fn configured_faults(&self) -> Option<crate::fault::FaultConfig> {
        self.faults
    }
    /// Direct access to every attribute (for profiles the builder does not cover).
    pub fn with_attr(mut self, f: impl FnOnce(&mut DeviceAttr)) -> Self {
        f(&mut self.attr);
        self
    }

    /// The attributes `query_device` will report.
    pub fn attr(&self) -> &DeviceAttr {
        &self.attr
    }
    /// Profile name.
    pub fn profile_name(&self) -> &'static str {
        self.profile
    }
    /// Status model.
    pub fn model(&self) -> StatusModel {
        self.status_model
    }
    /// Whether registrations mark their pages MADV_DONTFORK.
    pub fn uses_dontfork(&self) -> bool {
        self.dontfork
    }
    /// Where a value came from (`max_mr`, `max_mr_size`, `log_num_mtt`, ...).
    pub fn source(&self, key: &str) -> Source {
        self.sources.get(key).copied().unwrap_or(Source::Default)
    }
    /// All non-default sources.
    pub fn sources(&self) -> impl Iterator<Item = (&'static str, Source)> + '_ {
        self.sources.iter().map(|(k, v)| (*k, *v))
    }
}

impl Default for DeviceConfig {
    fn default() -> Self {
        DeviceConfig::rxe()
    }
}

/// What the progress thread does while idle and no application thread polls the device
/// (the `progress` module docs). `MRKIT_PROGRESS=auto|spin|block`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProgressPolicy {
    /// Spin adaptively and yield; block when preempted (shared CPUs). The default.
    #[default]
    Auto,
    /// Spin up to `progress::SPIN_DEDICATED` of idleness, even when preempted (a dedicated core).
    Spin,
    /// Block at once when idle (oversubscribed CPUs; every wake-up then costs a context switch).
    Block,
}

impl ProgressPolicy {
    /// Parse `auto`, `spin` or `block`.
    pub fn parse(s: &str) -> Option<ProgressPolicy> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "adaptive" => Some(ProgressPolicy::Auto),
            "spin" | "poll" => Some(ProgressPolicy::Spin),
            "block" | "sleep" => Some(ProgressPolicy::Block),
            _ => None,
        }
    }
}

/// Port attributes, the fields of `struct ibv_port_attr` as `ibv_query_port` reports them
/// (enums as their `IBV_*` numbers).
///
/// ```
/// let ctx = mrkit_soft::Context::open(mrkit_soft::DeviceConfig::rxe());
/// let p = ctx.query_port(1).unwrap();
/// assert_eq!((p.state, p.link_layer, p.max_mtu), (4, 2, 5)); // ACTIVE, Ethernet, 4096
/// assert_eq!(ctx.query_port(2).unwrap_err().errno(), mrkit_soft::Errno::EINVAL);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PortAttr {
    /// `enum ibv_port_state` (4: ACTIVE).
    pub state: u32,
    /// `enum ibv_mtu` (5: 4096).
    pub max_mtu: u32,
    /// `enum ibv_mtu` of the active MTU.
    pub active_mtu: u32,
    /// GID table length.
    pub gid_tbl_len: u32,
    /// `IBV_PORT_*_SUP` capability bits.
    pub port_cap_flags: u32,
    /// Largest message in bytes.
    pub max_msg_sz: u32,
    /// Bad P_Key counter.
    pub bad_pkey_cntr: u32,
    /// Q_Key violation counter.
    pub qkey_viol_cntr: u32,
    /// P_Key table length.
    pub pkey_tbl_len: u16,
    /// LID (0 on Ethernet).
    pub lid: u16,
    /// SM LID.
    pub sm_lid: u16,
    /// LMC.
    pub lmc: u8,
    /// Number of VLs.
    pub max_vl_num: u8,
    /// SM SL.
    pub sm_sl: u8,
    /// Subnet timeout.
    pub subnet_timeout: u8,
    /// InitTypeReply.
    pub init_type_reply: u8,
    /// Width (`1`: 1X, `2`: 4X, `4`: 8X, `8`: 12X, `16`: 2X).
    pub active_width: u8,
    /// Speed (`32`: EDR, 25 Gb/s per lane, ...).
    pub active_speed: u8,
    /// Physical state (5: LinkUp).
    pub phys_state: u8,
    /// `IBV_LINK_LAYER_*` (1: InfiniBand, 2: Ethernet).
    pub link_layer: u8,
    /// `IBV_QPF_*`-style port flags (`ibv_port_attr.flags`).
    pub flags: u8,
    /// Second capability word (`IBV_PORT_*2_SUP`).
    pub port_cap_flags2: u16,
}

#[cfg(test)]
mod tests {
    /// The `IBV_DEVICE_*` bits as rdma-core's `enum ibv_device_cap_flags` numbers them
    /// (PORT_ACTIVE_EVENT is bit 10; bit 14 is N_NOTIFY_CQ, which this device does not set).
    #[test]
    fn cap_flag_bits_match_verbs_h() {
        use super::cap_flags::*;
        assert_eq!(PORT_ACTIVE_EVENT, 1 << 10);
        assert_eq!(SYS_IMAGE_GUID, 1 << 11);
        let caps = super::DeviceConfig::rxe().attr().device_cap_flags;
        assert_ne!(caps & (1 << 10), 0, "PORT_ACTIVE_EVENT set");
        assert_eq!(caps & (1 << 14), 0, "N_NOTIFY_CQ is not claimed");
    }

    use super::*;

    #[test]
    fn env_overrides_and_sources() {
        let env = |k: &str| match k {
            "MRKIT_MAX_MR" => Some("1000".to_string()),
            "MRKIT_MAX_MR_SIZE" => Some("512MiB".to_string()),
            "MRKIT_LOG_NUM_MTT" => Some("20".to_string()),
            _ => None,
        };
        let c = DeviceConfig::from_lookup(env).unwrap();
        assert_eq!(c.attr().max_mr, 1000);
        assert_eq!(c.attr().max_mr_size, 512 << 20);
        assert_eq!(c.attr().max_mtt, 1 << 20);
        assert_eq!(c.source("max_mr"), Source::Env("MRKIT_MAX_MR"));
        assert_eq!(c.source("max_pd"), Source::Default);
    }

    #[test]
    fn bad_env_is_an_error() {
        let env = |k: &str| (k == "MRKIT_MAX_MR").then(|| "lots".to_string());
        assert!(DeviceConfig::from_lookup(env).is_err());
        let env = |k: &str| (k == "MRKIT_PROFILE").then(|| "nope".to_string());
        assert!(DeviceConfig::from_lookup(env).is_err());
    }

    /// DONTFORK marking is opt-in, as rdma-core's (ibv_fork_init / RDMAV_FORK_SAFE there,
    /// MRKIT_DONTFORK=1 here).
    #[test]
    fn dontfork_is_opt_in() {
        assert!(!DeviceConfig::rxe().uses_dontfork());
        let c = DeviceConfig::from_lookup(|_| None).unwrap();
        assert!(!c.uses_dontfork());
        assert_eq!(c.source("dontfork"), Source::Default);
        let on = |k: &str| (k == "MRKIT_DONTFORK").then(|| "1".to_string());
        let c = DeviceConfig::from_lookup(on).unwrap();
        assert!(c.uses_dontfork());
        assert_eq!(c.source("dontfork"), Source::Env("MRKIT_DONTFORK"));
        let off = |k: &str| (k == "MRKIT_DONTFORK").then(|| "0".to_string());
        assert!(!DeviceConfig::from_lookup(off).unwrap().uses_dontfork());
    }

    #[test]
    fn seed_profile() {
        let c = DeviceConfig::profile("connectx5-seed").unwrap();
        assert_eq!(c.attr().max_mr, 1000);
        assert_eq!(c.source("max_mr"), Source::Profile("connectx5-seed"));
    }
}
