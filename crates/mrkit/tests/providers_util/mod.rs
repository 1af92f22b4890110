//! Both providers of the mrkit API: the embedded `mrkit0` and the rdma-core provider over the
//! project's drop-in `libibverbs.so` (mrkit API → rdma-core provider → C ABI → drop-in → its
//! own mrkit0).
//!
//! Two ways to use them:
//! * side by side in one test: [`both`] runs the same code on each (the rule tables);
//! * the whole suite on one provider: the tests open their device with [`open`], which follows
//!   `MRKIT_DEVICE` (unset or `mrkit0`: the embedded device with the default limits;
//!   `rdma-core:mrkit0`: the drop-in through the rdma-core provider, the library
//!   `MRKIT_RDMA_CORE_LIB` names). `scripts/test.sh` runs the suites a second time with
//!   `MRKIT_DEVICE=rdma-core:mrkit0`. A test that cannot run on the rdma-core provider says
//!   why with [`needs_native`], which prints a loud line the script counts.
#![allow(dead_code)]

use std::io::Write;
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

/// Whether this run's device (`MRKIT_DEVICE`) is the embedded `mrkit0`: unset, empty, `mrkit0`
/// or `mrkit:...`. Anything else is opened through [`Context::open_default`] (the rdma-core
/// provider for `rdma-core:NAME` or a plain rdma-core device name).
pub fn is_native() -> bool {
    match std::env::var(mrkit::DEVICE_ENV) {
        Err(_) => true,
        Ok(v) => {
            let v = v.trim();
            v.is_empty() || v == "mrkit0" || v.starts_with("mrkit:")
        }
    }
}

/// The provider this run's tests use: `"mrkit"` or `"rdma-core"`.
pub fn provider() -> &'static str {
    if is_native() {
        "mrkit"
    } else {
        "rdma-core"
    }
}

/// The device under test: the embedded `mrkit0` with the default (rxe) limits, or the device
/// `MRKIT_DEVICE` names (see the module doc). The drop-in's device takes its limits from the
/// `MRKIT_*` variables at its first open, the rxe defaults when they are unset, so both
/// devices have the same limits.
pub fn open() -> Context {
    if is_native() {
        native()
    } else {
        let ctx = Context::open_default().unwrap_or_else(|e| {
            panic!(
                "open MRKIT_DEVICE={:?}: {e}",
                std::env::var(mrkit::DEVICE_ENV)
            )
        });
        assert!(
            ctx.soft().is_none(),
            "MRKIT_DEVICE must name an rdma-core device here"
        );
        ctx
    }
}

/// [`open_with`] a device of at most `max_mr` MRs (the native config and the drop-in's
/// `MRKIT_MAX_MR` alike).
pub fn open_with_max_mr(max_mr: u32) -> Option<Context> {
    open_with(
        mrkit::DeviceConfig::rxe().max_mr(max_mr),
        &[("MRKIT_MAX_MR", &max_mr.to_string())],
    )
}

/// The device under test with `cfg`'s limits. On mrkit0: `cfg` itself. On the rdma-core
/// provider libibverbs has no way to set a device's limits, but the drop-in's device (one per
/// process) reads them from the `MRKIT_*` variables when it opens: so the calling test runs
/// again in a child process (this test binary, `--exact` the test's name) with `env` (the
/// same settings as `cfg`, as variables), which opens the device with them; the parent checks
/// that the child passed and gets `None` (the caller returns).
pub fn open_with(cfg: mrkit::DeviceConfig, env: &[(&str, &str)]) -> Option<Context> {
    const CHILD: &str = "MRKIT_TEST_LIMITS_CHILD";
    if is_native() {
        return Some(Context::open(cfg));
    }
    if std::env::var_os(CHILD).is_some() {
        return Some(open());
    }
    let test = std::thread::current()
        .name()
        .expect("a test thread")
        .to_string();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([test.as_str(), "--exact", "--test-threads=1", "--nocapture"])
        .env(CHILD, "1")
        .envs(env.iter().copied())
        .output()
        .expect("run the test again in a child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{test} with {env:?} in a child:\n{stdout}\n{stderr}"
    );
    None
}

/// The calling test cannot run on the rdma-core provider: `true` (the caller returns at once)
/// when this run's device is not the embedded `mrkit0`, after a loud line on stderr naming the
/// test and `reason` (written past the test harness's output capture, so it shows in every
/// run; `scripts/test.sh` counts these lines per test binary). `false` on mrkit0.
pub fn needs_native(reason: &str) -> bool {
    if is_native() {
        return false;
    }
    let test = std::thread::current()
        .name()
        .unwrap_or("<unnamed thread>")
        .to_string();
    let bin = std::env::current_exe()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_default();
    let bin = bin.rsplit_once('-').map_or(bin.as_str(), |(b, _)| b);
    // Once per test and reason (a property test asks in every case).
    static SAID: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());
    {
        let mut said = SAID.lock().unwrap_or_else(|e| e.into_inner());
        let key = (test.clone(), reason.to_string());
        if said.contains(&key) {
            return true;
        }
        said.push(key);
    }
    // `io::stderr()` directly, not `eprintln!`: libtest captures the print macros only.
    let _ = writeln!(
        std::io::stderr(),
        "MRKIT-SKIP [{bin}] {test}: SKIPPED on {}: needs the native mrkit0: {reason}",
        std::env::var(mrkit::DEVICE_ENV).unwrap_or_default()
    );
    true
}

/// Give a child process this run's device: `MRKIT_DEVICE` and `MRKIT_RDMA_CORE_LIB` as the
/// test runs with them (for a command whose environment a test cleaned first; `mrkit` CLI
/// verbs open the device `MRKIT_DEVICE` names, as with `--device`). Nothing on mrkit0.
pub fn pass_device(c: &mut std::process::Command) {
    if is_native() {
        return;
    }
    for v in [mrkit::DEVICE_ENV, "MRKIT_RDMA_CORE_LIB"] {
        if let Some(val) = std::env::var_os(v) {
            c.env(v, val);
        }
    }
}

/// A buffer of `len` bytes with its pages populated (registration rules that need present
/// pages).
pub fn populated(len: usize) -> mrkit::Buffer {
    mrkit::Buffer::with_options(
        len,
        mrkit::BufferOptions {
            populate: true,
            ..Default::default()
        },
    )
    .unwrap()
}

/// One gather entry under a key the test chose, posted as is: a probe through a live key of
/// the test's own memory, or a check that a dead key is refused.
pub struct KeySlice(pub mrkit::LocalSlice);

// SAFETY: the device reads only `[addr, addr+len)` through the key, and only if the key is a
// live registration of that memory (the tests keep their memory mapped while they post); a
// dead or wrong key fails the work request before anything is read.
unsafe impl mrkit::Registered for KeySlice {
    fn len(&self) -> u64 {
        u64::from(self.0.len)
    }
    fn sges(
        &self,
        range: std::ops::Range<u64>,
        out: &mut Vec<mrkit::LocalSlice>,
    ) -> mrkit::Result<()> {
        out.push(mrkit::LocalSlice {
            addr: self.0.addr + range.start,
            len: u32::try_from(range.end - range.start).unwrap(),
            lkey: self.0.lkey,
        });
        Ok(())
    }
}
