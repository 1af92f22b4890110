//! Device selection with rdma-core present (the drop-in library, which also calls its device
//! `mrkit0`): the list, plain and qualified names, `MRKIT_DEVICE`, and names that match
//! nothing. One test: it sets the process's environment first.
mod providers_util;

use mrkit::{Context, Errno};

#[test]
fn devices_and_names_with_the_drop_in_as_rdma_core() {
    let lib = providers_util::drop_in();
    // SAFETY: the only test of this binary, and no thread reads the environment yet: the
    // test harness runs it on its own thread, and nothing here has opened a device.
    unsafe {
        std::env::set_var(mrkit::rdma_core::LIB_ENV, lib);
        std::env::remove_var(mrkit::DEVICE_ENV);
    }

    let devs = Context::devices().unwrap();
    let names: Vec<String> = devs.iter().map(|d| d.qualified()).collect();
    assert_eq!(names, ["mrkit:mrkit0", "rdma-core:mrkit0"]);
    assert_eq!(devs[1].provider, "rdma-core");
    assert_eq!(devs[1].transport.as_deref(), Some("InfiniBand"));
    // The drop-in's device reports the same node GUID as the embedded one.
    assert_eq!(devs[1].node_guid, devs[0].node_guid);
    assert!(devs[1].node_guid.unwrap() != 0);

    // A plain name offered by both providers is the embedded device.
    assert!(Context::open_by_name("mrkit0").unwrap().soft().is_some());
    assert!(Context::open_by_name("mrkit:mrkit0")
        .unwrap()
        .soft()
        .is_some());
    let rc = Context::open_by_name("rdma-core:mrkit0").unwrap();
    assert!(rc.soft().is_none());
    assert_eq!(rc.name(), "mrkit0");
    assert_eq!(
        rc.query_device().max_mr,
        Context::open_by_name("mrkit0")
            .unwrap()
            .query_device()
            .max_mr
    );

    for bad in ["mlx5_0", "rdma-core:mlx5_0", "mrkit:mlx5_0"] {
        let e = Context::open_by_name(bad).unwrap_err();
        assert_eq!(e.errno(), Errno::ENODEV, "{bad}");
        let msg = e.to_string();
        assert!(
            msg.contains("mrkit:mrkit0") && msg.contains("rdma-core:mrkit0") && msg.contains(bad),
            "{bad}: {msg}"
        );
    }
    let e = Context::open_by_name("verbs:mrkit0").unwrap_err();
    assert_eq!(e.errno(), Errno::ENODEV);
    assert!(e.to_string().contains("unknown provider"), "{e}");

    // MRKIT_DEVICE picks the default.
    assert!(Context::open_default().unwrap().soft().is_some());
    // SAFETY: the only test of this binary (no other test thread). The devices opened so far
    // read the environment when they were opened, on this thread; their own threads
    // (progress, completion, stat export) never read it.
    unsafe { std::env::set_var(mrkit::DEVICE_ENV, "rdma-core:mrkit0") };
    let d = Context::open_default().unwrap();
    assert!(d.soft().is_none());
    let pd = d.alloc_pd().unwrap();
    let mr = pd
        .register(
            mrkit::Buffer::new(4096).unwrap(),
            mrkit::AccessFlags::LOCAL_WRITE,
        )
        .unwrap();
    assert_eq!(mr.info().length, 4096);
    // SAFETY: as above.
    unsafe { std::env::set_var(mrkit::DEVICE_ENV, "nothing0") };
    assert_eq!(Context::open_default().unwrap_err().errno(), Errno::ENODEV);
    // SAFETY: as above.
    unsafe { std::env::remove_var(mrkit::DEVICE_ENV) };
}
