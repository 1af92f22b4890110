//! `Context::query_port` on both providers: the embedded mrkit0 answers what the drop-in
//! `libibverbs.so.1` reports for the same device through the rdma-core provider.
mod providers_util;

use mrkit::Errno;

#[test]
fn query_port_agrees_on_both_providers() {
    let [(_, native), (_, rc)] = providers_util::both();
    let a = native.query_port(1).unwrap();
    let b = rc.query_port(1).unwrap();
    // Both devices sit on a loopback address: rxe's rule gives 4096 there.
    assert_eq!(a, b);
    assert_eq!((a.state, a.phys_state, a.link_layer), (4, 5, 2));
    assert_eq!((a.max_mtu, a.active_mtu), (5, 5));
    assert_eq!((a.gid_tbl_len, a.pkey_tbl_len), (1, 1));
    assert_eq!(a.port_cap_flags, 1 << 16); // IBV_PORT_CM_SUP
    assert_eq!(a.max_msg_sz, native.query_device().max_msg_sz);
    for (name, ctx) in [("mrkit", &native), ("rdma-core", &rc)] {
        for port in [0, 2, 255] {
            let e = ctx.query_port(port).unwrap_err();
            assert_eq!(e.errno(), Errno::EINVAL, "{name} port {port}: {e}");
        }
    }
}
