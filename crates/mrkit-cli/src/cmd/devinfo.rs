//! `mrkit devinfo`: like `ibv_devinfo -v` for any device (same field names, same order), with
//! where every limit of `mrkit0` came from; `--list` like `ibv_devices`.

use clap::Args;
use mrkit::Context;
use mrkit_soft::device::ENV_VARS;
use mrkit_soft::{DeviceAttr, DeviceConfig, StatusModel};
use serde_json::{json, Map, Value};

use super::device::Selected;
use crate::{exit, outln};
use mrkit::{DeviceAttrEx, PortAttr};

#[derive(Args, Debug)]
#[command(
    after_help = "Examples:\n  mrkit devinfo\n  mrkit devinfo -v\n  MRKIT_MAX_MR=1000 mrkit devinfo --json | jq .attributes.max_mr\n  MRKIT_PROFILE=connectx5-seed mrkit devinfo -v\n  mrkit devinfo --list\n  mrkit devinfo -v --device rdma-core:mlx5_0"
)]
pub struct DevinfoArgs {
    /// Machine-readable output (always complete; -v only affects the text form).
    #[arg(long)]
    json: bool,
    /// List the devices of every provider (like `ibv_devices`) and exit.
    #[arg(long)]
    list: bool,
}

/// `(key, value, source key)` of every attribute, in `ibv_devinfo -v` order.
pub fn attributes(a: &DeviceAttr) -> Vec<(&'static str, Value, &'static str)> {
    vec![
        ("fw_ver", json!(a.fw_ver), "fw_ver"),
        ("node_guid", json!(guid(a.node_guid)), "node_guid"),
        (
            "sys_image_guid",
            json!(guid(a.sys_image_guid)),
            "sys_image_guid",
        ),
        ("vendor_id", json!(a.vendor_id), "vendor_id"),
        ("vendor_part_id", json!(a.vendor_part_id), "vendor_part_id"),
        ("hw_ver", json!(a.hw_ver), "hw_ver"),
        ("phys_port_cnt", json!(a.phys_port_cnt), "phys_port_cnt"),
        ("max_mr_size", json!(a.max_mr_size), "max_mr_size"),
        ("page_size_cap", json!(a.page_size_cap), "page_size_cap"),
        ("max_qp", json!(a.max_qp), "max_qp"),
        ("max_qp_wr", json!(a.max_qp_wr), "max_qp_wr"),
        (
            "device_cap_flags",
            json!(a.device_cap_flags),
            "device_cap_flags",
        ),
        ("max_sge", json!(a.max_sge), "max_sge"),
        ("max_sge_rd", json!(a.max_sge_rd), "max_sge_rd"),
        ("max_cq", json!(a.max_cq), "max_cq"),
        ("max_cqe", json!(a.max_cqe), "max_cqe"),
        ("max_mr", json!(a.max_mr), "max_mr"),
        ("max_pd", json!(a.max_pd), "max_pd"),
        ("max_qp_rd_atom", json!(a.max_qp_rd_atom), "max_qp_rd_atom"),
        (
            "max_qp_init_rd_atom",
            json!(a.max_qp_init_rd_atom),
            "max_qp_init_rd_atom",
        ),
        (
            "max_res_rd_atom",
            json!(a.max_res_rd_atom),
            "max_res_rd_atom",
        ),
        ("atomic_cap", json!(a.atomic_cap), "atomic_cap"),
        ("max_mw", json!(a.max_mw), "max_mw"),
        ("max_srq", json!(a.max_srq), "max_srq"),
        ("max_srq_wr", json!(a.max_srq_wr), "max_srq_wr"),
        ("max_srq_sge", json!(a.max_srq_sge), "max_srq_sge"),
        ("max_pkeys", json!(a.max_pkeys), "max_pkeys"),
        (
            "local_ca_ack_delay",
            json!(a.local_ca_ack_delay),
            "local_ca_ack_delay",
        ),
        (
            "max_inline_data",
            json!(a.max_inline_data),
            "max_inline_data",
        ),
        ("odp_general_caps", json!(a.odp_general_caps), "odp_caps"),
        ("odp_rc_caps", json!(a.odp_rc_caps), "odp_caps"),
        ("log_num_mtt", json!(a.log_num_mtt), "log_num_mtt"),
        ("max_mtt", json!(a.max_mtt), "log_num_mtt"),
        ("max_msg_sz", json!(a.max_msg_sz), "max_msg_sz"),
    ]
}

fn guid(g: u64) -> String {
    format!(
        "{:04x}:{:04x}:{:04x}:{:04x}",
        (g >> 48) & 0xffff,
        (g >> 32) & 0xffff,
        (g >> 16) & 0xffff,
        g & 0xffff
    )
}

/// `IBV_DEVICE_*` capability bits with the names `ibv_devinfo -v` prints for them.
const CAP_NAMES: &[(u64, &str)] = &[
    (1 << 0, "RESIZE_MAX_WR"),
    (1 << 1, "BAD_PKEY_CNTR"),
    (1 << 2, "BAD_QKEY_CNTR"),
    (1 << 3, "RAW_MULTI"),
    (1 << 4, "AUTO_PATH_MIG"),
    (1 << 5, "CHANGE_PHY_PORT"),
    (1 << 6, "UD_AV_PORT_ENFORCE"),
    (1 << 7, "CURR_QP_STATE_MOD"),
    (1 << 8, "SHUTDOWN_PORT"),
    (1 << 9, "INIT_TYPE"),
    (1 << 10, "PORT_ACTIVE_EVENT"),
    (1 << 11, "SYS_IMAGE_GUID"),
    (1 << 12, "RC_RNR_NAK_GEN"),
    (1 << 13, "SRQ_RESIZE"),
    (1 << 14, "N_NOTIFY_CQ"),
    (1 << 17, "MEM_WINDOW"),
    (1 << 18, "UD_IP_CSUM"),
    (1 << 20, "XRC"),
    (1 << 21, "MEM_MGT_EXTENSIONS"),
    (1 << 23, "MEM_WINDOW_TYPE_2A"),
    (1 << 24, "MEM_WINDOW_TYPE_2B"),
    (1 << 25, "RC_IP_CSUM"),
    (1 << 26, "RAW_IP_CSUM"),
    (1 << 29, "MANAGED_FLOW_STEERING"),
];

fn cap_names(f: u64) -> Vec<&'static str> {
    CAP_NAMES
        .iter()
        .filter(|(b, _)| f & b != 0)
        .map(|(_, n)| *n)
        .collect()
}

/// The `\t\t\t\t\tNAME` lines `ibv_devinfo` prints for the bits of `bits` it knows (in table
/// order), then `Unknown flags: 0x..` for the rest (`hex` formats them as its printf does).
fn flag_lines(bits: u64, names: &[(u64, &str)], hex: impl Fn(u64) -> String) -> String {
    let mut o = String::new();
    let mut known = 0;
    for (b, n) in names {
        known |= b;
        if bits & b != 0 {
            o += &format!("\t\t\t\t\t{n}\n");
        }
    }
    if bits & !known != 0 {
        o += &format!("\t\t\t\t\tUnknown flags: 0x{}\n", hex(bits & !known));
    }
    o
}

/// `device_cap_flags_ex` bits above the 32 of `device_cap_flags`.
const CAP_EX_NAMES: &[(u64, &str)] = &[
    (1 << 34, "RAW_SCATTER_FCS"),
    (1 << 36, "PCI_WRITE_END_PADDING"),
];
/// `IBV_RAW_PACKET_CAP_*`.
const RAW_PACKET_NAMES: &[(u64, &str)] = &[
    (1, "C-VLAN stripping offload"),
    (2, "Scatter FCS offload"),
    (4, "IP csum offload"),
    (8, "Delay drop"),
];
/// QP types of the TSO / RSS / packet pacing `supported_qpts` masks (bit = QP type).
const QPT_NAMES: &[(u64, &str)] = &[(1 << 8, "SUPPORT_RAW_PACKET"), (1 << 4, "SUPPORT_UD")];

/// `IBV_ODP_*` general capabilities and the per-transport `IBV_ODP_SUPPORT_*` bits.
const ODP_GENERAL: &[(u64, &str)] = &[(1, "ODP_SUPPORT"), (2, "ODP_SUPPORT_IMPLICIT")];
const ODP_TRANSPORT: &[(u64, &str)] = &[
    (1, "SUPPORT_SEND"),
    (2, "SUPPORT_RECV"),
    (4, "SUPPORT_WRITE"),
    (8, "SUPPORT_READ"),
    (16, "SUPPORT_ATOMIC"),
    (32, "SUPPORT_SRQ"),
];

fn mtu_name(e: u32) -> String {
    let bytes = match e {
        1 => 256,
        2 => 512,
        3 => 1024,
        4 => 2048,
        5 => 4096,
        _ => return format!("invalid MTU ({e})"),
    };
    format!("{bytes} ({e})")
}

fn port_state_name(s: u32) -> &'static str {
    match s {
        1 => "PORT_DOWN",
        2 => "PORT_INIT",
        3 => "PORT_ARMED",
        4 => "PORT_ACTIVE",
        5 => "PORT_ACTIVE_DEFER",
        _ => "PORT_NOP",
    }
}

fn link_layer_name(l: u8) -> &'static str {
    match l {
        2 => "Ethernet",
        _ => "InfiniBand",
    }
}

fn width_name(w: u8) -> String {
    let n = match w {
        1 => "1X",
        2 => "4X",
        4 => "8X",
        8 => "12X",
        16 => "2X",
        _ => "invalid width",
    };
    format!("{n} ({w})")
}

fn speed_name(s: u8) -> String {
    let n = match s {
        1 => "2.5 Gbps",
        2 => "5.0 Gbps",
        4 | 8 => "10.0 Gbps",
        16 => "14.0 Gbps",
        32 => "25.0 Gbps",
        64 => "50.0 Gbps",
        128 => "100.0 Gbps",
        _ => "invalid speed",
    };
    format!("{n} ({s})")
}

fn phys_state_name(p: u8) -> String {
    let n = match p {
        1 => "SLEEP",
        2 => "POLLING",
        3 => "DISABLED",
        4 => "PORT_CONFIGURATION TRAINNING",
        5 => "LINK_UP",
        6 => "LINK_ERROR_RECOVERY",
        7 => "PHY TEST",
        _ => "invalid physical state",
    };
    format!("{n} ({p})")
}

/// A GID as `ibv_devinfo` prints it (`inet_ntop(AF_INET6)`: `::ffff:127.0.0.1`, `fe80::1`).
fn gid_text(g: &[u8; 16]) -> String {
    let ip = std::net::Ipv6Addr::from(*g);
    match ip.to_ipv4_mapped() {
        Some(v4) => format!("::ffff:{v4}"),
        None => ip.to_string(),
    }
}

/// Everything `devinfo` shows about one device, read through the generic API.
pub struct Info {
    /// The selected name.
    pub name: String,
    /// The provider's device name.
    pub hca_id: String,
    /// `ibv_query_device`.
    pub attr: DeviceAttr,
    /// The rest of `ibv_query_device` / `ibv_query_device_ex`, as the device reports it.
    pub ex: DeviceAttrEx,
    /// `ibv_query_port` of each port (1-based), or why it failed.
    pub ports: Vec<Result<PortAttr, String>>,
    /// The GID table of port 1 (index 0), or why it is empty.
    pub gid0: Result<[u8; 16], String>,
    /// The embedded device's configuration (sources of its limits), `None` on other devices.
    pub config: Option<DeviceConfig>,
}

impl Info {
    /// Query `ctx`.
    pub fn query(sel: &Selected, ctx: &Context) -> Info {
        let attr = ctx.query_device();
        let ports = (1..=attr.phys_port_cnt)
            .map(|p| ctx.query_port(p).map_err(|e| e.to_string()))
            .collect();
        Info {
            name: sel.name().to_string(),
            hca_id: ctx.name().to_string(),
            ports,
            gid0: ctx.provider().query_gid().map_err(|e| e.to_string()),
            config: ctx.soft().and_then(|_| DeviceConfig::from_env().ok()),
            ex: ctx.provider().query_device_ex(),
            attr,
        }
    }

    fn source(&self, key: &str) -> String {
        match &self.config {
            Some(c) => c.source(key).to_string(),
            None => "device".to_string(),
        }
    }
}

fn port_json(p: &PortAttr, gid0: &Result<[u8; 16], String>) -> Value {
    json!({
        "state": port_state_name(p.state),
        "state_value": p.state,
        "max_mtu": 128u32 << p.max_mtu.min(5),
        "active_mtu": 128u32 << p.active_mtu.min(5),
        "sm_lid": p.sm_lid,
        "port_lid": p.lid,
        "port_lmc": p.lmc,
        "link_layer": link_layer_name(p.link_layer),
        "max_msg_sz": p.max_msg_sz,
        "port_cap_flags": p.port_cap_flags,
        "port_cap_flags2": p.port_cap_flags2,
        "max_vl_num": p.max_vl_num,
        "bad_pkey_cntr": p.bad_pkey_cntr,
        "qkey_viol_cntr": p.qkey_viol_cntr,
        "sm_sl": p.sm_sl,
        "pkey_tbl_len": p.pkey_tbl_len,
        "gid_tbl_len": p.gid_tbl_len,
        "subnet_timeout": p.subnet_timeout,
        "init_type_reply": p.init_type_reply,
        "active_width": p.active_width,
        "active_speed": p.active_speed,
        "phys_state": p.phys_state,
        "gids": match gid0 {
            // `placeholder` stays for JSON stability: the GID is the device's real one now.
            Ok(g) => json!([{"index": 0, "gid": gid_text(g), "type": "RoCE v2", "placeholder": false}]),
            Err(_) => json!([]),
        },
        "gid_error": gid0.as_ref().err(),
    })
}

/// The complete JSON document (schema in docs/cli.md).
pub fn to_json(i: &Info) -> Value {
    let a = &i.attr;
    let mut attrs = Map::new();
    for (k, v, src) in attributes(a) {
        attrs.insert(k.to_string(), json!({"value": v, "source": i.source(src)}));
    }
    let cfg = i.config.as_ref();
    json!({
        "device": i.hca_id,
        "selected": i.name,
        "provider": if cfg.is_some() { "mrkit" } else { "rdma-core" },
        "transport": "InfiniBand (0)",
        "node_type": if cfg.is_some() { "software RDMA device (rxe model)" } else { "RDMA device" },
        "profile": cfg.map(|c| c.profile_name()),
        "status_model": cfg.map(|c| match c.model() { StatusModel::Hardware => "hardware", StatusModel::Rxe => "rxe" }),
        "status_model_source": cfg.map(|c| c.source("status_model").to_string()),
        "dontfork": cfg.map(|c| c.uses_dontfork()),
        "dontfork_source": cfg.map(|c| c.source("dontfork").to_string()),
        "pin_mode": cfg.map(|_| format!("{:?}", mrkit_soft::mem::pin::pin_mode()).to_ascii_lowercase()),
        "device_cap_flags": cap_names(a.device_cap_flags),
        "attributes": attrs,
        // The rest of ibv_query_device(_ex), as the device reports it (fixed on mrkit0).
        "attributes_ex": serde_json::to_value(i.ex).expect("json"),
        "ports": i.ports.iter().enumerate().map(|(n, p)| match p {
            Ok(p) => {
                let mut v = port_json(p, &i.gid0);
                v["port"] = json!(n + 1);
                v
            }
            Err(e) => json!({"port": n + 1, "error": e}),
        }).collect::<Vec<_>>(),
        "env": ENV_VARS.iter().map(|(k, what)| json!({
            "name": k,
            "value": std::env::var(k).ok(),
            "meaning": what,
        })).collect::<Vec<_>>(),
    })
}

/// Tabs after `key:` so values line up as in `ibv_devinfo` (a tab stop every 8 columns, value at
/// column 32 for device attributes).
fn tabs(key: &str) -> &'static str {
    match key.len() + 1 {
        0..=7 => "\t\t\t\t",
        8..=15 => "\t\t\t",
        16..=23 => "\t\t",
        _ => "\t",
    }
}

/// Same for port attributes (value at column 40, key at 24).
fn port_tabs(key: &str) -> &'static str {
    match key.len() + 1 {
        0..=7 => "\t\t\t",
        8..=15 => "\t\t",
        _ => "\t",
    }
}

/// The text of `ibv_devinfo [-v]` for one device: the same fields in the same order; values of
/// the embedded device carry their source when it is not the default.
pub fn text(i: &Info, verbose: bool) -> String {
    use std::fmt::Write;
    let a = &i.attr;
    let mut o = String::new();
    let src = |k: &str| match &i.config {
        Some(c) if !matches!(c.source(k), mrkit_soft::device::Source::Default) => {
            format!("    ({})", c.source(k))
        }
        _ => String::new(),
    };
    let line = |k: &str, v: String, s: &str| format!("\t{k}:{}{v}{}\n", tabs(k), src(s));
    let x = &i.ex;
    let _ = writeln!(o, "hca_id:\t{}", i.hca_id);
    let _ = writeln!(o, "\ttransport:\t\t\tInfiniBand (0)");
    o += &line("fw_ver", a.fw_ver.clone(), "fw_ver");
    o += &line("node_guid", guid(a.node_guid), "node_guid");
    o += &line("sys_image_guid", guid(a.sys_image_guid), "sys_image_guid");
    o += &line("vendor_id", format!("{:#06x}", a.vendor_id), "vendor_id");
    o += &line(
        "vendor_part_id",
        a.vendor_part_id.to_string(),
        "vendor_part_id",
    );
    o += &line("hw_ver", format!("{:#x}", a.hw_ver), "hw_ver");
    o += &line(
        "phys_port_cnt",
        a.phys_port_cnt.to_string(),
        "phys_port_cnt",
    );
    if verbose {
        o += &line(
            "max_mr_size",
            format!("{:#x}", a.max_mr_size),
            "max_mr_size",
        );
        o += &line(
            "page_size_cap",
            format!("{:#x}", a.page_size_cap),
            "page_size_cap",
        );
        o += &line("max_qp", a.max_qp.to_string(), "max_qp");
        o += &line("max_qp_wr", a.max_qp_wr.to_string(), "max_qp_wr");
        o += &line(
            "device_cap_flags",
            format!("{:#010x}", a.device_cap_flags as u32),
            "device_cap_flags",
        );
        o += &flag_lines(a.device_cap_flags & 0xffff_ffff, CAP_NAMES, |v| {
            format!("{v:X}")
        });
        o += &line("max_sge", a.max_sge.to_string(), "max_sge");
        o += &line("max_sge_rd", a.max_sge_rd.to_string(), "max_sge_rd");
        o += &line("max_cq", a.max_cq.to_string(), "max_cq");
        o += &line("max_cqe", a.max_cqe.to_string(), "max_cqe");
        o += &line("max_mr", a.max_mr.to_string(), "max_mr");
        o += &line("max_pd", a.max_pd.to_string(), "max_pd");
        o += &line(
            "max_qp_rd_atom",
            a.max_qp_rd_atom.to_string(),
            "max_qp_rd_atom",
        );
        o += &line("max_ee_rd_atom", x.max_ee_rd_atom.to_string(), "");
        o += &line(
            "max_res_rd_atom",
            a.max_res_rd_atom.to_string(),
            "max_res_rd_atom",
        );
        o += &line(
            "max_qp_init_rd_atom",
            a.max_qp_init_rd_atom.to_string(),
            "max_qp_init_rd_atom",
        );
        o += &line("max_ee_init_rd_atom", x.max_ee_init_rd_atom.to_string(), "");
        o += &line(
            "atomic_cap",
            match a.atomic_cap {
                0 => "ATOMIC_NONE (0)".to_string(),
                1 => "ATOMIC_HCA (1)".to_string(),
                2 => "ATOMIC_GLOB (2)".to_string(),
                n => format!("invalid atomic capability ({n})"),
            },
            "atomic_cap",
        );
        o += &line("max_ee", x.max_ee.to_string(), "");
        o += &line("max_rdd", x.max_rdd.to_string(), "");
        o += &line("max_mw", a.max_mw.to_string(), "max_mw");
        o += &line("max_raw_ipv6_qp", x.max_raw_ipv6_qp.to_string(), "");
        o += &line("max_raw_ethy_qp", x.max_raw_ethy_qp.to_string(), "");
        o += &line("max_mcast_grp", x.max_mcast_grp.to_string(), "");
        o += &line("max_mcast_qp_attach", x.max_mcast_qp_attach.to_string(), "");
        o += &line(
            "max_total_mcast_qp_attach",
            x.max_total_mcast_qp_attach.to_string(),
            "",
        );
        o += &line("max_ah", x.max_ah.to_string(), "");
        o += &line("max_fmr", x.max_fmr.to_string(), "");
        if x.max_fmr != 0 {
            o += &line("max_map_per_fmr", x.max_map_per_fmr.to_string(), "");
        }
        o += &line("max_srq", a.max_srq.to_string(), "max_srq");
        if a.max_srq != 0 {
            o += &line("max_srq_wr", a.max_srq_wr.to_string(), "max_srq_wr");
            o += &line("max_srq_sge", a.max_srq_sge.to_string(), "max_srq_sge");
        }
        o += &line("max_pkeys", a.max_pkeys.to_string(), "max_pkeys");
        o += &line(
            "local_ca_ack_delay",
            a.local_ca_ack_delay.to_string(),
            "local_ca_ack_delay",
        );
        let hex32 = |v: u64| format!("{v:X}");
        let _ = writeln!(o, "\tgeneral_odp_caps:{}", src("odp_caps"));
        o += &flag_lines(a.odp_general_caps, ODP_GENERAL, hex32);
        let transport = |o: &mut String, k: &str, bits: u32| {
            let _ = writeln!(o, "\t{k}:{}", src("odp_caps"));
            if bits == 0 {
                let _ = writeln!(o, "\t\t\t\t\tNO SUPPORT");
            } else {
                *o += &flag_lines(u64::from(bits), ODP_TRANSPORT, hex32);
            }
        };
        // mrkit0 reports its RC caps only with ODP on (the drop-in does the same).
        let rc = if a.odp_general_caps != 0 || i.config.is_none() {
            a.odp_rc_caps
        } else {
            0
        };
        transport(&mut o, "rc_odp_caps", rc);
        transport(&mut o, "uc_odp_caps", x.uc_odp_caps);
        transport(&mut o, "ud_odp_caps", x.ud_odp_caps);
        transport(&mut o, "xrc_odp_caps", x.xrc_odp_caps);
        if x.completion_timestamp_mask != 0 {
            let _ = writeln!(
                o,
                "\tcompletion timestamp_mask:\t\t\t0x{:016x}",
                x.completion_timestamp_mask
            );
        } else {
            let _ = writeln!(o, "\tcompletion_timestamp_mask not supported");
        }
        if x.hca_core_clock != 0 {
            let _ = writeln!(o, "\thca_core_clock:\t\t\t{}kHZ", x.hca_core_clock);
        } else {
            let _ = writeln!(o, "\tcore clock not supported");
        }
        if x.raw_packet_caps != 0 {
            let _ = writeln!(o, "\traw packet caps:");
            for (b, n) in RAW_PACKET_NAMES {
                if u64::from(x.raw_packet_caps) & b != 0 {
                    let _ = writeln!(o, "\t\t\t\t\t{n}");
                }
            }
        }
        let _ = writeln!(o, "\tdevice_cap_flags_ex:\t\t0x{:X}", x.device_cap_flags_ex);
        o += &flag_lines(x.device_cap_flags_ex & !0xffff_ffff, CAP_EX_NAMES, hex32);
        let qpts = |o: &mut String, bits: u32| {
            let _ = writeln!(o, "\t\tsupported_qp:");
            *o += &flag_lines(u64::from(bits), QPT_NAMES, hex32);
        };
        let _ = writeln!(o, "\ttso_caps:\n\t\tmax_tso:\t\t\t{}", x.max_tso as i32);
        if x.max_tso != 0 {
            qpts(&mut o, x.tso_supported_qpts);
        }
        let _ = writeln!(
            o,
            "\trss_caps:\n\t\tmax_rwq_indirection_tables:\t\t\t{}\n\t\tmax_rwq_indirection_table_size:\t\t\t{}\n\t\trx_hash_function:\t\t\t\t0x{:x}\n\t\trx_hash_fields_mask:\t\t\t\t0x{:X}",
            x.max_rwq_indirection_tables,
            x.max_rwq_indirection_table_size,
            x.rx_hash_function,
            x.rx_hash_fields_mask
        );
        if x.rss_supported_qpts != 0 {
            qpts(&mut o, x.rss_supported_qpts);
        }
        let _ = writeln!(o, "\tmax_wq_type_rq:\t\t\t{}", x.max_wq_type_rq);
        let _ = writeln!(
            o,
            "\tpacket_pacing_caps:\n\t\tqp_rate_limit_min:\t{}kbps\n\t\tqp_rate_limit_max:\t{}kbps",
            x.qp_rate_limit_min, x.qp_rate_limit_max
        );
        if x.qp_rate_limit_max != 0 {
            qpts(&mut o, x.packet_pacing_supported_qpts);
        }
        if x.tm_max_num_tags != 0 {
            let _ = writeln!(o, "\tmax_rndv_hdr_size:\t\t{}", x.tm_max_rndv_hdr_size);
            let _ = writeln!(o, "\tmax_num_tags:\t\t\t{}", x.tm_max_num_tags);
            let _ = writeln!(o, "\tmax_ops:\t\t\t{}", x.tm_max_ops);
            let _ = writeln!(o, "\tmax_sge:\t\t\t{}", x.tm_max_sge);
            let _ = writeln!(o, "\tflags:");
            if x.tm_flags & 1 != 0 {
                let _ = writeln!(o, "\t\t\t\t\tIBV_TM_CAP_RC");
            }
        } else {
            let _ = writeln!(o, "\ttag matching not supported");
        }
        if x.max_cq_count != 0 && x.max_cq_period != 0 {
            let _ = writeln!(
                o,
                "\n\tcq moderation caps:\n\t\tmax_cq_count:\t{}\n\t\tmax_cq_period:\t{} us\n",
                x.max_cq_count, x.max_cq_period
            );
        }
        if x.max_dm_size != 0 {
            let _ = writeln!(
                o,
                "\tmaximum available device memory:\t{}Bytes\n",
                x.max_dm_size
            );
        }
        let _ = writeln!(o, "\tnum_comp_vectors:\t\t{}", x.num_comp_vectors);
    }
    for (n, p) in i.ports.iter().enumerate() {
        let _ = writeln!(o, "\t\tport:\t{}", n + 1);
        let p = match p {
            Ok(p) => p,
            Err(e) => {
                let _ = writeln!(o, "\t\t\tquery_port failed: {e}");
                continue;
            }
        };
        let pl = |k: &str, v: String| format!("\t\t\t{k}:{}{v}\n", port_tabs(k));
        o += &pl(
            "state",
            format!("{} ({})", port_state_name(p.state), p.state),
        );
        o += &pl("max_mtu", mtu_name(p.max_mtu));
        o += &pl("active_mtu", mtu_name(p.active_mtu));
        o += &pl("sm_lid", p.sm_lid.to_string());
        o += &pl("port_lid", p.lid.to_string());
        o += &pl("port_lmc", format!("0x{:02x}", p.lmc));
        o += &pl("link_layer", link_layer_name(p.link_layer).to_string());
        if verbose {
            o += &pl("max_msg_sz", format!("{:#x}", p.max_msg_sz));
            o += &pl("port_cap_flags", format!("0x{:08x}", p.port_cap_flags));
            o += &pl("port_cap_flags2", format!("0x{:04x}", p.port_cap_flags2));
            o += &pl("max_vl_num", format!("{} ({})", p.max_vl_num, p.max_vl_num));
            o += &pl("bad_pkey_cntr", format!("{:#x}", p.bad_pkey_cntr));
            o += &pl("qkey_viol_cntr", format!("{:#x}", p.qkey_viol_cntr));
            o += &pl("sm_sl", p.sm_sl.to_string());
            o += &pl("pkey_tbl_len", p.pkey_tbl_len.to_string());
            o += &pl("gid_tbl_len", p.gid_tbl_len.to_string());
            o += &pl("subnet_timeout", p.subnet_timeout.to_string());
            o += &pl("init_type_reply", p.init_type_reply.to_string());
            o += &pl("active_width", width_name(p.active_width));
            o += &pl("active_speed", speed_name(p.active_speed));
            o += &pl("phys_state", phys_state_name(p.phys_state));
        }
        match (&i.gid0, n) {
            (Ok(g), 0) => {
                let _ = writeln!(o, "\t\t\tGID[  0]:\t\t{}, RoCE v2", gid_text(g));
            }
            (Err(e), 0) => {
                let _ = writeln!(o, "\t\t\tno GID: {e}");
            }
            _ => {}
        }
    }
    let _ = writeln!(o);
    if verbose {
        if let Some(c) = &i.config {
            let _ = writeln!(o, "mrkit0:");
            let _ = writeln!(o, "\tprofile:\t\t\t{}", c.profile_name());
            let _ = writeln!(
                o,
                "\tstatus_model:\t\t\t{}{}",
                match c.model() {
                    StatusModel::Hardware => "hardware",
                    StatusModel::Rxe => "rxe",
                },
                src("status_model")
            );
            let _ = writeln!(
                o,
                "\tdontfork:\t\t\t{}{}",
                c.uses_dontfork(),
                src("dontfork")
            );
            let _ = writeln!(
                o,
                "\tpin_mode:\t\t\t{}",
                format!("{:?}", mrkit_soft::mem::pin::pin_mode()).to_ascii_lowercase()
            );
            let _ = writeln!(
                o,
                "\tlog_num_mtt:\t\t\t{}{}",
                a.log_num_mtt,
                src("log_num_mtt")
            );
            let _ = writeln!(o, "\tmax_mtt:\t\t\t{}{}", a.max_mtt, src("log_num_mtt"));
            let _ = writeln!(o, "\tmax_inline_data:\t\t{}", a.max_inline_data);
            let _ = writeln!(o, "\nenvironment (MRKIT_*):");
            for (k, what) in ENV_VARS {
                match std::env::var(k) {
                    Ok(v) => {
                        let _ = writeln!(o, "  {k}={v}\t{what}");
                    }
                    Err(_) => {
                        let _ = writeln!(o, "  {k} (unset)\t{what}");
                    }
                }
            }
        }
    } else if let Some(c) = &i.config {
        let _ = writeln!(o, "mrkit0 profile: {}", c.profile_name());
    }
    o
}

fn list() -> u8 {
    match Context::devices() {
        Ok(list) => {
            outln!("    {:<16}\t{:<10}\tqualified name", "device", "provider");
            outln!("    {:<16}\t{:<10}\t--------------", "------", "--------");
            for e in list {
                outln!("    {:<16}\t{:<10}\t{}", e.name, e.provider, e.qualified());
            }
            exit::OK
        }
        Err(e) => {
            eprintln!("mrkit devinfo: {e}");
            exit::VERB_FAILED
        }
    }
}

pub fn run(a: DevinfoArgs, verbose: bool, dev: &Selected) -> u8 {
    if a.list {
        return list();
    }
    let ctx = match dev.open("devinfo") {
        Ok(c) => c,
        Err(code) => return code,
    };
    let info = Info::query(dev, &ctx);
    if a.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&to_json(&info)).expect("json")
        );
        return exit::OK;
    }
    crate::out!("{}", text(&info, verbose));
    exit::OK
}
