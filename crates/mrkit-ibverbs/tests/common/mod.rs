//! Shared helpers of the integration tests: where the library is, how to compile the C
//! programs.
//!
//! The tests use the `libibverbs.so` of the profile they were built with (`cargo test` → debug,
//! `cargo test --release` → release): cargo compiles the crate's cdylib together with the rlib
//! the integration tests link, into `target/<profile>/deps/`, which is next to the test binary,
//! so this works with or without `CARGO_TARGET_DIR` and needs no nested `cargo build`.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Mutex;

/// `target/<profile>/`.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let deps = exe.parent().expect("deps dir");
    deps.parent().expect("profile dir").to_path_buf()
}

/// The directory to put in `LD_LIBRARY_PATH`: `target/<profile>/mrkit-ibverbs-tests/lib/`,
/// holding `libibverbs.so.1 -> target/<profile>/deps/libibverbs.so`, the cdylib cargo built
/// together with the rlib these tests link (it is only copied up to `target/<profile>/` by
/// `cargo build`, not by `cargo test`).
pub fn lib_dir() -> PathBuf {
    let so = profile_dir().join("deps").join("libibverbs.so");
    assert!(
        so.exists(),
        "{} missing: cargo builds the cdylib with the crate's rlib",
        so.display()
    );
    let dir = scratch("lib");
    let link = dir.join("libibverbs.so.1");
    if std::fs::read_link(&link).ok().as_deref() != Some(so.as_path()) {
        // Atomic replace: tests run in parallel threads.
        let tmp = dir.join(format!(
            ".libibverbs.so.1.{}.{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&so, &tmp).expect("symlink libibverbs.so.1");
        std::fs::rename(&tmp, &link).expect("rename symlink");
    }
    dir
}

/// The library file (`target/<profile>/libibverbs.so.1`).
pub fn lib_path() -> PathBuf {
    lib_dir().join("libibverbs.so.1")
}

pub fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A scratch directory for compiled C programs.
pub fn scratch(name: &str) -> PathBuf {
    let d = profile_dir().join("mrkit-ibverbs-tests").join(name);
    std::fs::create_dir_all(&d).expect("scratch dir");
    d
}

/// `verbs.h` is there (libibverbs-dev); fail with the fix otherwise.
pub fn require_headers() {
    assert!(
        Path::new("/usr/include/infiniband/verbs.h").exists(),
        "/usr/include/infiniband/verbs.h missing: apt-get install libibverbs-dev \
         (scripts/test.sh installs it)"
    );
}

/// Compile `tests/c/<src>` into the scratch dir; `link_verbs` links against the system
/// libibverbs (so the program carries rdma-core's symbol versions).
pub fn compile_c(src: &str, link_verbs: bool) -> PathBuf {
    compile_c_with(src, link_verbs, &[])
}

/// As [`compile_c`] with extra compiler/linker arguments. Compiled once per test process
/// (tests run in parallel threads) and moved into place atomically.
pub fn compile_c_with(src: &str, link_verbs: bool, extra: &[&str]) -> PathBuf {
    static BUILT: Mutex<BTreeMap<String, PathBuf>> = Mutex::new(BTreeMap::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = built.get(src) {
        return p.clone();
    }
    require_headers();
    let out = scratch("c").join(src.trim_end_matches(".c"));
    let tmp = out.with_extension(format!("tmp{}", std::process::id()));
    let mut cmd = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()));
    cmd.args(["-O1", "-g", "-Wall", "-Werror", "-o"])
        .arg(&tmp)
        .arg(crate_dir().join("tests/c").join(src));
    cmd.args(extra);
    if link_verbs {
        cmd.arg("-libverbs");
    }
    let o = cmd.output().expect("run cc");
    assert!(
        o.status.success(),
        "cc {src} failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    std::fs::rename(&tmp, &out).expect("move the compiled program into place");
    built.insert(src.to_string(), out.clone());
    out
}

/// Run `prog args` against our library, with extra environment variables.
pub fn run_with_lib(prog: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(prog);
    cmd.args(args).env("LD_LIBRARY_PATH", lib_dir());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", prog.display()))
}

pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}
