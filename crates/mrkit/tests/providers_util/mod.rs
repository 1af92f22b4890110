//! Both providers of the mrkit API side by side: the embedded `mrkit0` and the rdma-core
//! provider over the project's drop-in `libibverbs.so` (mrkit API → rdma-core provider → C
//! ABI → drop-in → its own mrkit0). Tests take [`both`] and run the same code on each.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use mrkit::rdma_core::{library_at, RdmaCoreProvider};
use mrkit::{Context, DeviceConfig};

/// `target/<profile>/deps/libibverbs.so`: the drop-in's cdylib, which cargo builds next to
/// the test binaries (`mrkit-ibverbs` is a dev-dependency of `mrkit` for that).
pub fn drop_in() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let so = exe.parent().expect("deps dir").join("libibverbs.so");
    assert!(
        so.exists(),
        "{} missing: cargo builds the drop-in's cdylib as a dev-dependency of mrkit",
        so.display()
    );
    so
}

/// The drop-in's `mrkit0` through the rdma-core provider.
pub fn rdma_core() -> Context {
    let lib = library_at(drop_in().to_str().unwrap()).expect("load the drop-in");
    Context::from_provider(Arc::new(
        RdmaCoreProvider::open(lib, "mrkit0").expect("open rdma-core:mrkit0"),
    ))
}

/// The embedded `mrkit0` with the default limits (the drop-in's device has the same).
pub fn native() -> Context {
    Context::open(DeviceConfig::rxe())
}

/// `("mrkit", native)`, `("rdma-core", drop-in)`.
pub fn both() -> [(&'static str, Context); 2] {
    [("mrkit", native()), ("rdma-core", rdma_core())]
}
