//! Without rdma-core (the provider pointed at a library that does not exist, or at one that
//! is not libibverbs): one clear ENODEV from the rdma-core provider, mrkit0 unaffected. One
//! test: it sets the process's environment first.
use mrkit::{AccessFlags as A, Buffer, Context, Errno};

#[test]
fn no_rdma_core_is_one_clear_error_and_mrkit0_works() {
    let missing = "/nonexistent/mrkit-test/libibverbs.so.1";
    // SAFETY: the only test of this binary, and no thread reads the environment yet: the
    // test harness runs it on its own thread, and nothing here has opened a device.
    unsafe {
        std::env::set_var(mrkit::rdma_core::LIB_ENV, missing);
        std::env::remove_var(mrkit::DEVICE_ENV);
    }

    let devs = Context::devices().unwrap();
    assert_eq!(
        devs.iter().map(|d| d.qualified()).collect::<Vec<_>>(),
        ["mrkit:mrkit0"]
    );

    let e = Context::open_by_name("rdma-core:mrkit0").unwrap_err();
    assert_eq!(e.errno(), Errno::ENODEV);
    let msg = e.to_string();
    assert!(
        msg.contains("rdma-core is not available") && msg.contains(missing),
        "{msg}"
    );
    assert!(msg.contains(mrkit::rdma_core::LIB_ENV), "{msg}");
    // A plain name that rdma-core would have to offer: the list of what there is.
    let e = Context::open_by_name("mlx5_0").unwrap_err();
    assert_eq!(e.errno(), Errno::ENODEV);
    assert!(e.to_string().contains("mrkit:mrkit0"), "{e}");
    // Asked through MRKIT_DEVICE: the same error.
    // SAFETY: the only test of this binary (no other test thread). The devices opened so far
    // read the environment when they were opened, on this thread; their own threads
    // (progress, completion, stat export) never read it.
    unsafe { std::env::set_var(mrkit::DEVICE_ENV, "rdma-core:mlx5_0") };
    assert_eq!(Context::open_default().unwrap_err().errno(), Errno::ENODEV);
    // SAFETY: as above.
    unsafe { std::env::remove_var(mrkit::DEVICE_ENV) };

    // A library that is not libibverbs: the missing symbol is named.
    let e = mrkit::rdma_core::library_at("libc.so.6").unwrap_err();
    assert_eq!(e.errno(), Errno::ENODEV);
    assert!(e.to_string().contains("ibv_"), "{e}");

    // The system's rdma-core, where installed (by path: under cargo the loader's search
    // path finds the drop-in's `libibverbs.so.1` first): without kernel RDMA support (as on
    // the test machines) its device list is empty (ibv_get_device_list's ENOSYS), not an
    // error.
    let system = [
        "/lib/x86_64-linux-gnu",
        "/usr/lib/x86_64-linux-gnu",
        "/lib/aarch64-linux-gnu",
        "/usr/lib64",
    ]
    .iter()
    .map(|d| format!("{d}/libibverbs.so.1"))
    .find(|p| std::path::Path::new(p).exists());
    if let Some(path) = system {
        let lib = mrkit::rdma_core::library_at(&path).unwrap();
        let devs = mrkit::rdma_core::devices(lib).unwrap();
        if !std::path::Path::new("/sys/class/infiniband").exists() {
            assert!(devs.is_empty(), "{devs:?}");
        }
    }

    // mrkit0 as before.
    let ctx = Context::open_by_name("mrkit0").unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd
        .register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE)
        .unwrap();
    assert_eq!(mr.info().length, 4096);
    assert!(Context::open_default().unwrap().soft().is_some());
}
