//! The rdma-core provider's `ibv_query_port` fallback, for real: over a legacy library (a test
//! shim in front of the drop-in whose contexts have no extended ops, built by this test), the
//! provider finds no `query_port` op and calls the exported compat `ibv_query_port` (the
//! 48-byte struct), as the header's inline `___ibv_query_port` does. Its answer must equal the
//! extended path's on the same device (the drop-in opened directly). The same library also
//! has no `ibv_query_device_ex`: the provider takes libibverbs' legacy path there too.
//! One test per binary: the shim reads its mode from the environment.
mod providers_util;

use std::sync::Arc;

use mrkit::rdma_core::{library_at, RdmaCoreProvider};
use mrkit::{Context, Errno};
use mrkit_testsupport::ibverbs_shim::{Mode, Shim};

#[test]
fn compat_query_port_answers_what_the_extended_path_answers() {
    // The shim library is built, then loaded, from a private directory: from a predictable
    // name under /tmp another user could swap it in between.
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path();
    let shim = Shim::build(dir, &providers_util::drop_in(), Mode::Legacy);
    for (k, v) in shim.env() {
        // SAFETY: the only test of this binary, and no thread reads the environment yet: the
        // test harness runs it on its own thread, and nothing here has opened a device.
        unsafe { std::env::set_var(k, v) };
    }
    let legacy_lib = library_at(shim.path.to_str().unwrap()).expect("load the shim");
    let legacy = Context::from_provider(Arc::new(
        RdmaCoreProvider::open(legacy_lib, "mrkit0").expect("open mrkit0 through the shim"),
    ));
    // The same device, opened directly: its contexts have the extended query_port op.
    let extended = providers_util::rdma_core();
    let raw = legacy.provider().query_device_ex();
    assert!(!raw.extended, "the shim's contexts must not be extended");
    assert!(extended.provider().query_device_ex().extended);

    let old = legacy.query_port(1).unwrap();
    let new = extended.query_port(1).unwrap();
    assert_eq!(old, new);
    // Not a zeroed answer: the port is mrkit0's active RoCE port.
    assert_eq!((old.state, old.link_layer, old.gid_tbl_len), (4, 2, 1));
    assert!(old.max_msg_sz > 0 && old.active_mtu > 0);
    // The compat struct ends before port_cap_flags2: it reads 0 (mrkit0's value is 0 too).
    assert_eq!(old.port_cap_flags2, 0);
    for port in [0, 2, 255] {
        let e = legacy.query_port(port).unwrap_err();
        assert_eq!(e.errno(), Errno::EINVAL, "port {port}: {e}");
    }
    // Without ibv_query_device_ex: the basic attributes are the device's, the extension 0
    // (so no ODP), as libibverbs' legacy ibv_query_device_ex leaves it.
    let (a, b) = (legacy.query_device(), extended.query_device());
    assert_eq!(
        (a.max_mr, a.max_qp, a.max_msg_sz),
        (b.max_mr, b.max_qp, b.max_msg_sz)
    );
    assert_eq!((a.odp_general_caps, a.odp_rc_caps), (0, 0));
    assert_eq!(raw.device_cap_flags_ex, 0);
    assert_eq!(raw.max_ah, extended.provider().query_device_ex().max_ah);
    // The library stays loaded (a provider never unloads one); its file can go.
}
