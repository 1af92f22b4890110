//! Two copies of the device in one process (the embedded mrkit0 and the one inside the
//! drop-in library loaded by the rdma-core provider) share one statistics file name,
//! `<pid>.stat`: exactly one of them writes it, and the other joins it (its snapshot under
//! `copies`). One test: it sets the environment first.
mod providers_util;

use std::time::Duration;

use mrkit::{AccessFlags as A, Buffer, Context};

#[test]
fn one_exporter_per_process_with_two_device_copies() {
    // A directory the exporter creates, inside a private one.
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path().join("stat");
    // SAFETY: the only test of this binary, and no thread reads the environment yet: the
    // test harness runs it on its own thread, and nothing here has opened a device.
    unsafe {
        std::env::set_var("MRKIT_STAT_DIR", &dir);
        std::env::set_var("MRKIT_STAT_INTERVAL_MS", "10");
        std::env::remove_var("MRKIT_STAT");
    }
    mrkit::stat_export::register_source("copy", || serde_json::json!("native"));

    let native = Context::open(mrkit::DeviceConfig::rxe()); // starts the native exporter
    let pd = native.alloc_pd().unwrap();
    let _mrs: Vec<_> = (0..3)
        .map(|_| {
            pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE)
                .unwrap()
        })
        .collect();
    let rc = providers_util::rdma_core(); // the drop-in's copy opens its device
    let rpd = rc.alloc_pd().unwrap();
    let _rmrs: Vec<_> = (0..5)
        .map(|_| {
            rpd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE)
                .unwrap()
        })
        .collect();

    let pid = std::process::id();
    for i in 0..20 {
        let (v, fresh) =
            mrkit::stat_export::request_and_read(&dir, pid, Duration::from_secs(10)).unwrap();
        assert!(fresh, "read {i}: no fresh snapshot");
        // Every snapshot is the native copy's (its registered source is there), never the
        // other copy's overwriting it.
        assert_eq!(v["sources"]["copy"], "native", "read {i}: {v}");
        assert_eq!(v["registrations"], 3, "read {i}: {v}");
        // The other copy (the drop-in's device) joined this export: its counters are in the
        // same file under "copies" (from the second read on: it joined after the first), and
        // the provider's own counters under sources.rdma_core.
        if i > 0 {
            let copies = v["copies"].as_array().expect("copies");
            assert_eq!(copies.len(), 1, "read {i}: {v}");
            assert_eq!(copies[0]["registrations"], 5, "read {i}: {v}");
            assert!(copies[0]["sources"].get("copy").is_none(), "read {i}: {v}");
        }
        let dev = &v["sources"]["rdma_core"]["devices"][0];
        assert_eq!(dev["device"], "rdma-core:mrkit0", "read {i}: {v}");
        assert_eq!(dev["registrations"], 5, "read {i}: {v}");
        std::thread::sleep(Duration::from_millis(15));
    }
    mrkit::stat_export::shutdown();
}
