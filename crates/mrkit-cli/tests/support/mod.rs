//! What the CLI tests share: the drop-in `libibverbs.so.1` as the rdma-core library, and the
//! devices a test can run `mrkit perf` on.

#![allow(dead_code)] // each test binary uses its part

use std::path::{Path, PathBuf};
use std::process::Command;

/// The drop-in's cdylib, which cargo builds next to the test binaries (`mrkit-ibverbs` is a
/// dev-dependency of the CLI for that).
pub fn drop_in_so() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let so = exe.parent().unwrap().join("libibverbs.so");
    assert!(so.exists(), "{} missing", so.display());
    so
}

/// A directory holding `libibverbs.so.1`: a link to [`drop_in_so`].
pub fn drop_in_dir() -> tempfile::TempDir {
    let so = drop_in_so();
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(&so, dir.path().join("libibverbs.so.1")).unwrap();
    dir
}

/// The library in a [`drop_in_dir`].
pub fn lib(dir: &Path) -> PathBuf {
    dir.join("libibverbs.so.1")
}

/// Remove every `MRKIT_*` variable of the test's own environment from `c` but those in `keep`,
/// so that a developer's or CI's settings (`MRKIT_DEVICE`, `MRKIT_ADDR`, ...) cannot steer the
/// command.
pub fn clear_mrkit_env(c: &mut Command, keep: &[&str]) {
    for (k, _) in std::env::vars() {
        if k.starts_with("MRKIT_") && !keep.contains(&k.as_str()) {
            c.env_remove(k);
        }
    }
}

/// The `mrkit` binary with no `MRKIT_*` variable of the test's environment.
pub fn mrkit_clean() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mrkit"));
    clear_mrkit_env(&mut c, &[]);
    c
}

/// Where a side of a test runs: the embedded mrkit0, or the drop-in's mrkit0 reached through
/// mrkit's rdma-core provider (`--device rdma-core:mrkit0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dev {
    /// `mrkit0`, address by `--addr`.
    Native,
    /// `rdma-core:mrkit0` over the drop-in, address by `MRKIT_ADDR` (its GID).
    DropIn,
}

impl Dev {
    /// Point `c` (an `mrkit` command) at this device with RoCEv2 address `addr`; `dir` holds
    /// the drop-in (see [`drop_in_dir`]).
    pub fn apply(self, c: &mut Command, addr: &str, dir: &Path) {
        clear_mrkit_env(c, &["MRKIT_FAULTS"]);
        match self {
            Dev::Native => {
                c.args(["--addr", addr]);
            }
            Dev::DropIn => {
                c.args(["--device", "rdma-core:mrkit0"])
                    .env("MRKIT_RDMA_CORE_LIB", lib(dir))
                    .env("MRKIT_ADDR", addr);
            }
        }
    }

    /// An in-process context on this device: native mrkit0 at `addr`, or the drop-in's device
    /// through the rdma-core provider (its address is the drop-in's own, one per process).
    pub fn open(self, addr: &str, dir: &Path) -> mrkit::Context {
        match self {
            Dev::Native => {
                let cfg = mrkit::DeviceConfig::default()
                    .udp_addr(mrkit_soft::net::udp::parse_addr(addr).unwrap());
                mrkit::Context::open(cfg)
            }
            Dev::DropIn => {
                let l = mrkit::rdma_core::library_at(lib(dir).to_str().unwrap()).unwrap();
                let p = mrkit::rdma_core::RdmaCoreProvider::open(l, "mrkit0").unwrap();
                mrkit::Context::from_provider(std::sync::Arc::new(p))
            }
        }
    }
}

/// `mrkit devinfo` output `ours` and `ibv_devinfo` output `theirs` agree line for line.
pub fn same_lines(ours: &str, theirs: &str) {
    let (a, b): (Vec<&str>, Vec<&str>) = (ours.lines().collect(), theirs.lines().collect());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(
            x,
            y,
            "line {} differs\nmrkit:\n{ours}\nibv_devinfo:\n{theirs}",
            i + 1
        );
    }
    assert_eq!(a.len(), b.len(), "mrkit:\n{ours}\nibv_devinfo:\n{theirs}");
}
