//! `mrkit devinfo -v --device rdma-core:X` prints the values the device reports, not mrkit0's:
//! a test shim in front of the drop-in (`mrkit_testsupport::ibverbs_shim`) reports other
//! values for every attribute mrkit0 leaves fixed (EE, RDD, multicast, max_ah, the whole
//! `ibv_query_device_ex` extension, the completion vectors), or is a legacy library without
//! the extended ops (then `ibv_devinfo` prints the legacy path's zeros). Either way the output
//! is compared line by line with ibverbs-utils' `ibv_devinfo -v` over the same library.

use std::path::Path;
use std::process::{Command, Output};

use mrkit_testsupport::ibverbs_shim::{Mode, Shim};

mod support;
use support::{drop_in_so, mrkit_clean, same_lines};

fn run_ok(c: &mut Command) -> String {
    let o: Output = c.output().unwrap();
    assert!(
        o.status.success(),
        "{:?}: {}{}",
        c,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `mrkit devinfo -v --device rdma-core:mrkit0` and `ibv_devinfo -v -d mrkit0`, both over
/// `shim`, with the device at `addr`.
fn both(shim: &Shim, addr: &str) -> (String, String) {
    let mut c = mrkit_clean();
    c.envs(shim.env())
        .env("MRKIT_RDMA_CORE_LIB", &shim.path)
        .env("MRKIT_ADDR", addr)
        .env("MRKIT_STAT", "0")
        .args(["devinfo", "-v", "--device", "rdma-core:mrkit0"]);
    let ours = run_ok(&mut c);
    let tool = Path::new("/usr/bin/ibv_devinfo");
    assert!(
        tool.exists(),
        "ibverbs-utils' ibv_devinfo is needed for this comparison (apt-get install ibverbs-utils)"
    );
    let theirs = run_ok(
        Command::new(tool)
            .args(["-v", "-d", "mrkit0"])
            .envs(shim.env())
            .env("LD_LIBRARY_PATH", shim.path.parent().unwrap())
            .env("MRKIT_ADDR", addr)
            .env("MRKIT_STAT", "0"),
    );
    (ours, theirs)
}

#[test]
fn devinfo_shows_the_devices_own_values() {
    let dir = tempfile::tempdir().unwrap();
    let shim = Shim::build(dir.path(), &drop_in_so(), Mode::Values);
    let (ours, theirs) = both(&shim, "127.0.91.21");
    for want in [
        "\tmax_ee_rd_atom:\t\t\t1",
        "\tmax_rdd:\t\t\t4",
        "\tmax_mcast_grp:\t\t\t7",
        "\tmax_ah:\t\t\t\t12345",
        "\tmax_map_per_fmr:\t\t11",
        "\thca_core_clock:\t\t\t156250kHZ",
        "\t\tmax_tso:\t\t\t262144",
        "\tmax_num_tags:\t\t\t63",
        "\t\tmax_cq_count:\t65535",
        "\tmaximum available device memory:\t131072Bytes",
        "\tnum_comp_vectors:\t\t3",
    ] {
        assert!(ours.lines().any(|l| l == want), "{want:?} missing:\n{ours}");
    }
    same_lines(&ours, &theirs);
}

#[test]
fn devinfo_on_a_legacy_library_prints_what_ibv_devinfo_prints() {
    let dir = tempfile::tempdir().unwrap();
    let shim = Shim::build(dir.path(), &drop_in_so(), Mode::Legacy);
    let (ours, theirs) = both(&shim, "127.0.91.22");
    // No ibv_query_device_ex: the extension reads as zeros (no ODP, no extended flags).
    for want in [
        "\tdevice_cap_flags_ex:\t\t0x0",
        "\tmax_ah:\t\t\t\t32767",
        "\tnum_comp_vectors:\t\t1",
    ] {
        assert!(ours.lines().any(|l| l == want), "{want:?} missing:\n{ours}");
    }
    same_lines(&ours, &theirs);
}
