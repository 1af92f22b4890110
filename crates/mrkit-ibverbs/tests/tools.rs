//! Unmodified Debian tools and C programs against the library:
//! `ibv_devices`, `ibv_devinfo -v` (ibverbs-utils) and tests/c/regrules.c (the registration
//! rules through the C API, linked against the system libibverbs and run with ours).

mod common;

use common::{compile_c, compile_c_with, run_with_lib, text};
use std::path::Path;

fn tool(name: &str) -> std::path::PathBuf {
    let p = Path::new("/usr/bin").join(name);
    assert!(
        p.exists(),
        "{} missing: apt-get install ibverbs-utils (scripts/test.sh installs it)",
        p.display()
    );
    p
}

#[test]
fn ibv_devices_lists_mrkit0() {
    let o = run_with_lib(&tool("ibv_devices"), &[], &[]);
    let out = text(&o);
    assert!(o.status.success(), "ibv_devices failed:\n{out}");
    assert!(
        out.lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() == 2 && f[0] == "mrkit0" && f[1] == "02c0ffee00000001"
        }),
        "mrkit0 with its GUID not listed:\n{out}"
    );
    assert!(!out.contains("no version information"), "{out}");
}

#[test]
fn ibv_devinfo_verbose_shows_sane_attributes() {
    // The GID is the device's UDP address (MRKIT_ADDR); a loopback address → active MTU 4096.
    let o = run_with_lib(
        &tool("ibv_devinfo"),
        &["-v"],
        &[("MRKIT_ADDR", "127.0.77.5")],
    );
    let out = text(&o);
    assert!(o.status.success(), "ibv_devinfo -v failed:\n{out}");
    for want in [
        "hca_id:\tmrkit0",
        "transport:\t\t\tInfiniBand (0)",
        "vendor_id:\t\t\t0xffffff",
        "vendor_part_id:\t\t\t0",
        "phys_port_cnt:\t\t\t1",
        "ODP_SUPPORT",
        "num_comp_vectors:\t\t1",
        "state:\t\t\tPORT_ACTIVE (4)",
        "max_mtu:\t\t4096 (5)",
        "active_mtu:\t\t4096 (5)",
        "link_layer:\t\tEthernet",
        "max_msg_sz:\t\t0x80000000",
        "GID[  0]:\t\t::ffff:127.0.77.5, RoCE v2",
    ] {
        assert!(out.contains(want), "ibv_devinfo -v lacks {want:?}:\n{out}");
    }
    // Sane limits: positive max_mr / max_pd / max_qp.
    for key in [
        "max_mr:",
        "max_pd:",
        "max_qp:",
        "max_cqe:",
        "max_qp_rd_atom:",
    ] {
        let v: u64 = out
            .lines()
            .find_map(|l| l.trim().strip_prefix(key))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{key} not printed:\n{out}"));
        assert!(v > 0, "{key} {v}");
    }
    assert!(!out.contains("no version information"), "{out}");
}

#[test]
fn ibv_devinfo_honours_mrkit_env_limits() {
    let o = run_with_lib(&tool("ibv_devinfo"), &["-v"], &[("MRKIT_MAX_MR", "7")]);
    let out = text(&o);
    assert!(out.contains("max_mr:\t\t\t\t7\n"), "{out}");
}

fn regrules(args: &[&str], env: &[(&str, &str)]) {
    let prog = compile_c("regrules.c", true);
    let o = run_with_lib(&prog, args, env);
    let out = text(&o);
    println!("{out}");
    assert!(
        o.status.success() && out.contains("all checks passed"),
        "regrules {args:?} failed:\n{out}"
    );
}

#[test]
fn regrules_basic() {
    regrules(&["basic"], &[]);
}

#[test]
fn regrules_max_mr_enomem() {
    regrules(&["maxmr", "4"], &[("MRKIT_MAX_MR", "4")]);
}

#[test]
fn regrules_on_demand_without_odp() {
    regrules(&["noodp"], &[("MRKIT_ODP", "0")]);
}

#[test]
fn provider_libraries_load_on_top_of_it() {
    // perftest links libmlx5.so.1 and libefa.so.1 (ibverbs-providers, pulled in by
    // libibverbs-dev) with BIND_NOW: all their IBVERBS_PRIVATE_34 imports must bind.
    let prog = compile_c_with(
        "providers.c",
        true,
        &["-Wl,--no-as-needed", "-Wl,-z,now", "-lmlx5", "-lefa"],
    );
    let o = run_with_lib(&prog, &[], &[("LD_BIND_NOW", "1")]);
    let out = text(&o);
    assert!(o.status.success(), "providers test failed:\n{out}");
    assert!(out.contains("libmlx5 and libefa loaded"), "{out}");
    assert!(!out.contains("no version information"), "{out}");
}
