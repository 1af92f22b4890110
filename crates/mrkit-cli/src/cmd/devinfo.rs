//! `mrkit devinfo`: like `ibv_devinfo -v`, with where every limit came from.

use clap::Args;
use mrkit_soft::device::{cap_flags, ENV_VARS};
use mrkit_soft::{DeviceAttr, DeviceConfig, StatusModel};
use serde_json::{json, Map, Value};

use crate::exit;

#[derive(Args, Debug)]
#[command(
    after_help = "Examples:\n  mrkit devinfo\n  mrkit devinfo -v\n  MRKIT_MAX_MR=1000 mrkit devinfo --json | jq .attributes.max_mr\n  MRKIT_PROFILE=connectx5-seed mrkit devinfo -v"
)]
pub struct DevinfoArgs {
    /// Machine-readable output (always complete; -v only affects the text form).
    #[arg(long)]
    json: bool,
}

/// Port state PORT_ACTIVE.
const PORT_ACTIVE: u32 = 4;

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

/// Link-local GID from the node GUID (EUI-64), as RoCE derives GID 0 from the MAC.
fn gid0(node_guid: u64) -> String {
    format!("fe80:0000:0000:0000:{}", guid(node_guid))
}

fn cap_names(f: u64) -> Vec<&'static str> {
    use cap_flags::*;
    [
        (BAD_PKEY_CNTR, "BAD_PKEY_CNTR"),
        (BAD_QKEY_CNTR, "BAD_QKEY_CNTR"),
        (AUTO_PATH_MIG, "AUTO_PATH_MIG"),
        (CHANGE_PHY_PORT, "CHANGE_PHY_PORT"),
        (UD_AV_PORT_ENFORCE, "UD_AV_PORT_ENFORCE"),
        (SYS_IMAGE_GUID, "SYS_IMAGE_GUID"),
        (RC_RNR_NAK_GEN, "RC_RNR_NAK_GEN"),
        (SRQ_RESIZE, "SRQ_RESIZE"),
        (PORT_ACTIVE_EVENT, "PORT_ACTIVE_EVENT"),
        (MEM_WINDOW, "MEM_WINDOW"),
        (MEM_MGT_EXTENSIONS, "MEM_MGT_EXTENSIONS"),
        (MEM_WINDOW_TYPE_2A, "MEM_WINDOW_TYPE_2A"),
        (MEM_WINDOW_TYPE_2B, "MEM_WINDOW_TYPE_2B"),
    ]
    .into_iter()
    .filter(|(b, _)| f & b != 0)
    .map(|(_, n)| n)
    .collect()
}

/// The complete JSON document (schema in docs/cli.md).
pub fn to_json(cfg: &DeviceConfig) -> Value {
    let a = cfg.attr();
    let mut attrs = Map::new();
    for (k, v, src) in attributes(a) {
        attrs.insert(
            k.to_string(),
            json!({"value": v, "source": cfg.source(src).to_string()}),
        );
    }
    json!({
        "device": mrkit_soft::DEVICE_NAME,
        "transport": "InfiniBand (0)",
        "node_type": "software RDMA device (rxe model)",
        "profile": cfg.profile_name(),
        "status_model": match cfg.model() { StatusModel::Hardware => "hardware", StatusModel::Rxe => "rxe" },
        "status_model_source": cfg.source("status_model").to_string(),
        "dontfork": cfg.uses_dontfork(),
        "dontfork_source": cfg.source("dontfork").to_string(),
        "pin_mode": format!("{:?}", mrkit_soft::mem::pin::pin_mode()).to_ascii_lowercase(),
        "device_cap_flags": cap_names(a.device_cap_flags),
        "attributes": attrs,
        "ports": [{
            "port": 1,
            "state": "PORT_ACTIVE",
            "state_value": PORT_ACTIVE,
            "max_mtu": 4096,
            "active_mtu": 1024,
            "link_layer": "Ethernet",
            "max_msg_sz": a.max_msg_sz,
            "pkey_tbl_len": 1,
            "gid_tbl_len": 1,
            "gids": [{
                "index": 0,
                "gid": gid0(a.node_guid),
                "type": "RoCE v2",
                "placeholder": true,
                "note": "derived from node_guid; no UDP transport is bound yet, so no IP-based GIDs",
            }],
        }],
        "env": ENV_VARS.iter().map(|(k, what)| json!({
            "name": k,
            "value": std::env::var(k).ok(),
            "meaning": what,
        })).collect::<Vec<_>>(),
    })
}

pub fn run(a: DevinfoArgs, verbose: bool) -> u8 {
    let cfg = match DeviceConfig::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("mrkit devinfo: {e}");
            return exit::USAGE;
        }
    };
    tracing::info!(profile = cfg.profile_name(), "device configuration read");
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&to_json(&cfg)).expect("json")
        );
        return exit::OK;
    }
    let at = cfg.attr();
    let src = |k: &str| {
        let s = cfg.source(k);
        if matches!(s, mrkit_soft::device::Source::Default) {
            String::new()
        } else {
            format!("    ({s})")
        }
    };
    println!("hca_id:\t{}", mrkit_soft::DEVICE_NAME);
    println!("\ttransport:\t\t\tInfiniBand (0)");
    println!("\tfw_ver:\t\t\t\t{}", at.fw_ver);
    println!("\tnode_guid:\t\t\t{}", guid(at.node_guid));
    println!("\tsys_image_guid:\t\t\t{}", guid(at.sys_image_guid));
    println!("\tvendor_id:\t\t\t{:#06x}", at.vendor_id);
    println!("\tvendor_part_id:\t\t\t{}", at.vendor_part_id);
    println!("\thw_ver:\t\t\t\t{:#x}", at.hw_ver);
    println!("\tphys_port_cnt:\t\t\t{}", at.phys_port_cnt);
    println!("\tprofile:\t\t\t{}", cfg.profile_name());
    if verbose {
        for (k, v, s) in attributes(at).into_iter().skip(7) {
            let shown = match (k, &v) {
                (
                    "max_mr_size" | "page_size_cap" | "device_cap_flags" | "max_msg_sz",
                    Value::Number(n),
                ) => {
                    format!("{:#x}", n.as_u64().unwrap_or(0))
                }
                _ => v.to_string(),
            };
            let tabs = match k.len() {
                0..=6 => "\t\t\t\t",
                7..=14 => "\t\t\t",
                _ => "\t\t",
            };
            println!("\t{k}:{tabs}{shown}{}", src(s));
            if k == "device_cap_flags" {
                for n in cap_names(at.device_cap_flags) {
                    println!("\t\t\t\t\t{n}");
                }
            }
        }
        println!(
            "\tstatus_model:\t\t\t{}{}",
            match cfg.model() {
                StatusModel::Hardware => "hardware",
                StatusModel::Rxe => "rxe",
            },
            src("status_model")
        );
        println!(
            "\tdontfork:\t\t\t{}{}",
            cfg.uses_dontfork(),
            src("dontfork")
        );
        println!(
            "\tpin_mode:\t\t\t{}",
            format!("{:?}", mrkit_soft::mem::pin::pin_mode()).to_ascii_lowercase()
        );
    }
    println!("\t\tport:\t1");
    println!("\t\t\tstate:\t\t\tPORT_ACTIVE ({PORT_ACTIVE})");
    println!("\t\t\tmax_mtu:\t\t4096 (5)");
    println!("\t\t\tactive_mtu:\t\t1024 (3)");
    println!("\t\t\tsm_lid:\t\t\t0");
    println!("\t\t\tport_lid:\t\t0");
    println!("\t\t\tport_lmc:\t\t0x00");
    println!("\t\t\tlink_layer:\t\tEthernet");
    if verbose {
        println!("\t\t\tmax_msg_sz:\t\t{:#x}", at.max_msg_sz);
        println!("\t\t\tpkey_tbl_len:\t\t1");
        println!("\t\t\tgid_tbl_len:\t\t1");
    }
    println!(
        "\t\t\tGID[  0]:\t\t{}, RoCE v2 (placeholder: no UDP transport bound yet)",
        gid0(at.node_guid)
    );
    if verbose {
        println!("\nenvironment (MRKIT_*):");
        for (k, what) in ENV_VARS {
            match std::env::var(k) {
                Ok(v) => println!("  {k}={v}\t{what}"),
                Err(_) => println!("  {k} (unset)\t{what}"),
            }
        }
    }
    exit::OK
}
