//! The CLI on an rdma-core device: `mrkit --device rdma-core:mrkit0` over the project's drop-in
//! `libibverbs.so.1` (CLI → mrkit's rdma-core provider → C ABI → drop-in → its own mrkit0),
//! compared with ibverbs-utils' `ibv_devinfo -v` on the same library, and a smoke run of
//! `reg`, `capacity`, `doctor` and `bench --quick` through the binary.

use std::path::Path;
use std::process::{Command, Output};

/// The device address both sides of the comparison use, so that the GID lines agree. Each
/// test has its own (tests run in parallel; a device that cannot bind its UDP port reports
/// active MTU 1024, as the drop-in does).
const ADDR: &str = "127.0.91.7";

mod support;
use support::{drop_in_dir, lib, mrkit_clean, same_lines};

/// `mrkit` with a clean MRKIT_* environment, rdma-core = the drop-in, a fixed device address.
fn mrkit(dir: &Path) -> Command {
    mrkit_at(dir, ADDR)
}

/// [`mrkit`] with the device at `addr`.
fn mrkit_at(dir: &Path, addr: &str) -> Command {
    let mut c = mrkit_clean();
    c.env("MRKIT_RDMA_CORE_LIB", lib(dir))
        .env("MRKIT_ADDR", addr)
        .env("MRKIT_STAT", "0");
    c
}

fn run_ok(c: &mut Command) -> Output {
    let o = c.output().unwrap();
    assert!(
        o.status.success(),
        "{:?}: {}{}",
        c,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Issue 16's "done when": `mrkit devinfo -v` of the drop-in's device through the rdma-core
/// provider shows what `ibv_devinfo -v` shows for the same device, line by line (the GID
/// agrees because both use the same `MRKIT_ADDR`; vendor_id is rxe's 0xffffff on both).
#[test]
fn devinfo_v_on_rdma_core_is_ibv_devinfo_v() {
    let dir = drop_in_dir();
    let ours = text(&run_ok(mrkit(dir.path()).args([
        "devinfo",
        "-v",
        "--device",
        "rdma-core:mrkit0",
    ])));
    // What mrkit itself must show, with or without ibverbs-utils installed.
    for want in [
        "hca_id:\tmrkit0",
        "\tvendor_id:\t\t\t0xffffff",
        "\t\t\tstate:\t\t\tPORT_ACTIVE (4)",
        "\t\t\tactive_mtu:\t\t4096 (5)",
        "\t\t\tlink_layer:\t\tEthernet",
        "\t\t\tgid_tbl_len:\t\t1",
        "\t\t\tGID[  0]:\t\t::ffff:127.0.91.7, RoCE v2",
        "\t\t\t\t\tPORT_ACTIVE_EVENT",
    ] {
        assert!(ours.lines().any(|l| l == want), "{want:?} missing:\n{ours}");
    }
    assert!(!ours.contains("N_NOTIFY_CQ"), "{ours}");
    let tool = Path::new("/usr/bin/ibv_devinfo");
    assert!(
        tool.exists(),
        "ibverbs-utils' ibv_devinfo is needed for this comparison (apt-get install ibverbs-utils)"
    );
    let theirs = text(&run_ok(
        Command::new(tool)
            .args(["-v", "-d", "mrkit0"])
            .env("LD_LIBRARY_PATH", dir.path())
            .env("MRKIT_ADDR", ADDR)
            .env("MRKIT_STAT", "0"),
    ));
    same_lines(&ours, &theirs);
}

/// `reg`, `capacity`, `doctor` and `bench --quick` run on the rdma-core device.
#[test]
fn verbs_run_on_rdma_core() {
    let dir = drop_in_dir();
    let o = run_ok(mrkit_at(dir.path(), "127.0.91.8").args([
        "reg",
        "--size",
        "64KiB",
        "--access",
        "local-write,remote-read",
        "--device",
        "rdma-core:mrkit0",
    ]));
    let t = text(&o);
    assert!(t.contains("registered 64 KiB on mrkit0"), "{t}");
    assert!(t.contains("REMOTE_READ"), "{t}");

    let o = run_ok(mrkit_at(dir.path(), "127.0.91.8").args([
        "capacity",
        "--json",
        "--device",
        "rdma-core:mrkit0",
    ]));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(!v.to_string().is_empty());
    assert!(
        text(&o).contains("524287"),
        "max_mr from the device: {}",
        text(&o)
    );

    // doctor runs the kernel-stack checklist for an rdma-core device; the drop-in's device
    // has no kernel side, so where /dev/infiniband is absent (as here) uverbs fails, with its
    // fix, and the status is 1.
    let o = mrkit_at(dir.path(), "127.0.91.8")
        .args(["doctor", "--device", "rdma-core:mrkit0"])
        .output()
        .unwrap();
    let t = text(&o);
    assert!(t.contains("uverbs") && t.contains("memlock"), "{t}");
    if !Path::new("/dev/infiniband").exists() {
        assert_eq!(o.status.code(), Some(1), "{t}");
        assert!(t.contains("fix: load the module"), "{t}");
    }

    let out = tempfile::tempdir().unwrap();
    run_ok(
        mrkit_at(dir.path(), "127.0.91.8")
            .args(["bench", "--quick", "--device", "rdma-core:mrkit0", "--out"])
            .arg(out.path()),
    );
    let raw: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("raw.json")).unwrap())
            .unwrap();
    let pts = raw["reg_cost"].as_array().unwrap();
    assert_eq!(pts.len(), 16);
    assert!(pts.iter().all(|p| p["error"].is_null()), "{pts:?}");
    assert!(
        raw["data_path"]["in_process"]["error"]
            .as_str()
            .unwrap()
            .contains("rdma-core:mrkit0"),
        "{}",
        raw["data_path"]
    );
    assert!(out.path().join("report.md").exists());
}

/// `demo` on an rdma-core device: an unknown translation capacity is not "2^0", and the
/// closing line counts the device's own registrations with the embedded instances'.
#[test]
fn demo_on_rdma_core_counts_its_device() {
    let dir = drop_in_dir();
    let o = run_ok(
        mrkit_at(dir.path(), "127.0.91.9")
            .args(["demo", "--device", "rdma-core:mrkit0"])
            .env("MRKIT_STAT", "0"),
    );
    let t = text(&o);
    assert!(t.contains("translation entries not reported"), "{t}");
    assert!(!t.contains("translation entries 2^0"), "{t}");
    let line = t
        .lines()
        .find(|l| l.starts_with("statistics of this run:"))
        .unwrap_or_else(|| panic!("{t}"));
    assert!(
        line.contains("on rdma-core:mrkit0 and the embedded mrkit0 instances"),
        "{line}"
    );
}

/// A name that matches nothing: status 1 and the list of devices, rdma-core's included.
#[test]
fn unknown_name_lists_both_providers() {
    let dir = drop_in_dir();
    let o = mrkit_at(dir.path(), "127.0.91.9")
        .args(["devinfo", "--device", "mlx5_9"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("mlx5_9") && err.contains("mrkit:mrkit0") && err.contains("rdma-core:mrkit0"),
        "{err}"
    );
    let o = run_ok(mrkit_at(dir.path(), "127.0.91.9").args(["devinfo", "--list"]));
    assert!(text(&o).contains("rdma-core:mrkit0"), "{}", text(&o));
}
