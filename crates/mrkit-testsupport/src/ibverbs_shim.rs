//! A test-only `libibverbs.so.1` in front of another one (the project's drop-in), compiled by
//! the test with the system's C compiler and rdma-core headers (`ibverbs_shim.c`). It forwards
//! every verb and changes one thing, chosen by [`Mode`]: a legacy library (contexts without the
//! extended ops, so `ibv_query_port` takes the compat path and `ibv_query_device_ex` the
//! legacy one), or a device whose attributes differ from mrkit0's.
//!
//! The library reads `MRKIT_SHIM_TARGET` (the library it forwards to) and `MRKIT_SHIM_MODE`
//! from the environment at each call: set them with [`Shim::env`] before loading it.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The C source.
pub const SOURCE: &str = include_str!("ibverbs_shim.c");

/// The version nodes `ibv_devinfo` (rdma-core v44) binds its imports to.
const VERSION_SCRIPT: &str = "IBVERBS_1.0 { global: ibv_read_sysfs_file; local: *; };\n\
     IBVERBS_1.1 { global: ibv_*; } IBVERBS_1.0;\n\
     IBVERBS_PRIVATE_34 { global: ibv_query_gid_type; } IBVERBS_1.1;\n";

/// What the shim changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Contexts without the extended ops (`abi_compat` is not all ones).
    Legacy,
    /// Attributes other than mrkit0's (see `ibverbs_shim.c`).
    Values,
}

impl Mode {
    /// The `MRKIT_SHIM_MODE` value.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Legacy => "legacy",
            Mode::Values => "values",
        }
    }
}

/// A built shim: `<dir>/libibverbs.so.1`.
#[derive(Debug)]
pub struct Shim {
    /// The library (named `libibverbs.so.1`, so `LD_LIBRARY_PATH=<dir>` finds it).
    pub path: PathBuf,
    /// The library it forwards to.
    pub target: PathBuf,
    /// What it changes.
    pub mode: Mode,
}

impl Shim {
    /// Compile the shim into `dir` (which must exist) in front of `target`. Panics with the
    /// compiler's message when `cc` or the rdma-core headers (`libibverbs-dev`) are missing.
    pub fn build(dir: &Path, target: &Path, mode: Mode) -> Shim {
        let src = dir.join("ibverbs_shim.c");
        let map = dir.join("ibverbs_shim.map");
        std::fs::write(&src, SOURCE).expect("write the shim source");
        std::fs::write(&map, VERSION_SCRIPT).expect("write the version script");
        let path = dir.join("libibverbs.so.1");
        let o = Command::new("cc")
            .args(["-shared", "-fPIC", "-O1", "-Wall", "-o"])
            .arg(&path)
            .arg(&src)
            .arg(format!("-Wl,--version-script={}", map.display()))
            .args(["-Wl,-soname,libibverbs.so.1", "-ldl"])
            .output()
            .expect("run cc (a C compiler is needed to build the test shim)");
        assert!(
            o.status.success(),
            "building the ibverbs shim failed (needs cc and libibverbs-dev):\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        Shim {
            path,
            target: target.to_path_buf(),
            mode,
        }
    }

    /// The environment the shim reads: `[(MRKIT_SHIM_TARGET, ..), (MRKIT_SHIM_MODE, ..)]`.
    pub fn env(&self) -> [(&'static str, String); 2] {
        [
            ("MRKIT_SHIM_TARGET", self.target.display().to_string()),
            ("MRKIT_SHIM_MODE", self.mode.name().to_string()),
        ]
    }
}
