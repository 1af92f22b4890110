//! Device listing, opening by name and port attributes: a thin private shim standing in for
//! the names `h/rdmacore` adds to the `mrkit` crate (`mrkit::Context::devices()`,
//! `mrkit::DeviceEntry`, `mrkit::Context::open_by_name()`, `MRKIT_DEVICE` in
//! `Context::open_default()`, and the provider's `query_port`).
//!
//! At merge, every item here is swapped for the `mrkit` one of the same name; the CLI uses
//! nothing else from this file. Until then the shim knows one provider, the embedded `mrkit0`
//! (`provider` "mrkit"); a name qualified by `rdma-core:` fails with the reason that the
//! rdma-core provider is not part of this build.

use mrkit::{Context, Errno, Error, Result};

/// The environment variable naming the default device.
pub const DEVICE_ENV: &str = "MRKIT_DEVICE";

/// The device opened when neither `--device` nor `MRKIT_DEVICE` names one.
pub const DEFAULT_DEVICE: &str = "mrkit0";

/// One device a provider offers (stand-in for `mrkit::DeviceEntry`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceEntry {
    /// The device name (`mrkit0`, `mlx5_0`, ...).
    pub name: String,
    /// The provider: `mrkit` (the embedded device) or `rdma-core`.
    pub provider: String,
}

impl DeviceEntry {
    /// `provider:name`, the spelling that picks exactly one device.
    pub fn qualified(&self) -> String {
        format!("{}:{}", self.provider, self.name)
    }
}

/// Every device there is (stand-in for `mrkit::Context::devices()`).
pub fn devices() -> Result<Vec<DeviceEntry>> {
    Ok(vec![DeviceEntry {
        name: mrkit_soft::DEVICE_NAME.to_string(),
        provider: "mrkit".to_string(),
    }])
}

/// Open a device by plain or qualified name (stand-in for `mrkit::Context::open_by_name()`).
pub fn open_by_name(name: &str) -> Result<Context> {
    let (provider, dev) = match name.split_once(':') {
        Some((p, d)) => (Some(p), d),
        None => (None, name),
    };
    if provider == Some("rdma-core") {
        return Err(Error::new(
            Errno::EOPNOTSUPP,
            format!(
                "{name}: the rdma-core provider is not available in this build of mrkit \
                 (libibverbs.so.1 is never loaded), so no rdma-core device can be opened"
            ),
        ));
    }
    let list = devices()?;
    if let Some(e) = list
        .iter()
        .find(|e| e.name == dev && provider.map_or(true, |p| p == e.provider))
    {
        if e.provider == "mrkit" {
            return Context::open_default();
        }
    }
    Err(Error::new(
        Errno::ENOENT,
        format!(
            "no RDMA device named `{name}`; the devices are: {}",
            list.iter()
                .map(|e| format!("{} ({})", e.name, e.qualified()))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    ))
}

/// Port attributes, as `ibv_query_port` reports them (stand-in for the provider's
/// `query_port`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortAttr {
    /// `IBV_PORT_*` state (4: ACTIVE).
    pub state: u32,
    /// `IBV_MTU_*` enum (5: 4096).
    pub max_mtu: u32,
    /// `IBV_MTU_*` enum.
    pub active_mtu: u32,
    /// GID table length.
    pub gid_tbl_len: u32,
    /// `IBV_PORT_*_SUP` capability bits.
    pub port_cap_flags: u32,
    /// Largest message.
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
    /// Width enum (2: 4X).
    pub active_width: u8,
    /// Speed enum (32: 25 Gb/s per lane).
    pub active_speed: u8,
    /// Physical state (5: LinkUp).
    pub phys_state: u8,
    /// `IBV_LINK_LAYER_*` (2: Ethernet).
    pub link_layer: u8,
    /// Second capability word.
    pub port_cap_flags2: u16,
}

/// `ibv_query_port` (stand-in for the provider op). On `mrkit0` the values are the ones its
/// drop-in `libibverbs.so.1` reports: one active Ethernet port, MTU 4096, a loopback address
/// gives active MTU 4096 (rxe's rule: the largest IB MTU at most the netdev MTU minus 80). On
/// another address the shim says 1024 where the drop-in applies the rule to the interface's
/// MTU (deviation until the provider op replaces this).
pub fn query_port(ctx: &Context, port: u8) -> Result<PortAttr> {
    let a = ctx.query_device();
    if port == 0 || port > a.phys_port_cnt {
        return Err(Error::new(
            Errno::EINVAL,
            format!(
                "port {port} does not exist (the device has {})",
                a.phys_port_cnt
            ),
        ));
    }
    let Some(soft) = ctx.soft() else {
        return Err(Error::new(
            Errno::EOPNOTSUPP,
            "query_port is not implemented by this provider",
        ));
    };
    let loopback = soft
        .udp_port()
        .map(|p| p.local_addr().ip().is_loopback())
        .unwrap_or(false);
    Ok(PortAttr {
        state: 4,
        max_mtu: 5,
        active_mtu: if loopback { 5 } else { 3 },
        gid_tbl_len: 1,
        port_cap_flags: 0x0001_0000, // IBV_PORT_CM_SUP
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
        active_width: 2,
        active_speed: 32,
        phys_state: 5,
        link_layer: 2,
        port_cap_flags2: 0,
    })
}
