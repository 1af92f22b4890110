//! Link the cdylib as `libibverbs.so.1`: SONAME, rdma-core v44's version nodes, and a
//! `libibverbs.so.1 -> libibverbs.so` symlink in the profile directory (`target/<profile>/`) so
//! that `LD_LIBRARY_PATH=target/<profile>` finds it under the name programs were linked with.
//!
//! The per-symbol versions (`ibv_reg_mr@@IBVERBS_1.1`) come from `.symver` directives in
//! `src/exports.rs`; the version script only defines the nodes. This works with rustc's default
//! linker on x86_64/aarch64 Linux (rust-lld since Rust 1.90). GNU ld refuses to combine rustc's
//! anonymous version script with a named one ("anonymous version tag cannot be combined").
use std::path::{Path, PathBuf};

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let map = dir.join("libibverbs.map");
    println!("cargo:rerun-if-changed=libibverbs.map");
    println!("cargo:rerun-if-changed=build.rs");
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    if os != "linux" || !(arch == "x86_64" || arch == "aarch64") {
        println!("cargo:warning=mrkit-ibverbs: symbol versioning is only set up for x86_64/aarch64 Linux");
        return;
    }
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libibverbs.so.1");
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        map.display()
    );
    // OUT_DIR = <target>/<profile>/build/mrkit-ibverbs-<hash>/out
    if let Ok(out) = std::env::var("OUT_DIR") {
        if let Some(profile_dir) = Path::new(&out).ancestors().nth(3) {
            let link = profile_dir.join("libibverbs.so.1");
            if std::fs::symlink_metadata(&link).is_err() {
                // Dangling until rustc has linked libibverbs.so next to it; harmless if it fails.
                let _ = std::os::unix::fs::symlink("libibverbs.so", &link);
            }
            install_ext_header(&dir, profile_dir);
        }
    }
}

/// The extension header beside the library: `<profile>/include/mrkit/mrkit_ext.h`, so that
/// `cc -I target/<profile>/include` finds it next to `target/<profile>/libibverbs.so.1`.
fn install_ext_header(crate_dir: &Path, profile_dir: &Path) {
    let src = crate_dir.join("include/mrkit/mrkit_ext.h");
    println!("cargo:rerun-if-changed={}", src.display());
    let dst = profile_dir.join("include/mrkit");
    if std::fs::create_dir_all(&dst).is_ok() {
        let _ = std::fs::copy(&src, dst.join("mrkit_ext.h"));
    }
}
