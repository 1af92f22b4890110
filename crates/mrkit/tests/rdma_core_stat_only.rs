//! A process whose only device is an rdma-core one (the drop-in's mrkit0 through the rdma-core
//! provider) is visible to `mrkit stat`: the provider's own counters under
//! `sources.rdma_core.devices` (device `rdma-core:mrkit0`), and the drop-in's embedded device
//! (a second copy of mrkit-soft in this process) under `copies`, with its own counters, in the
//! one stat file this process has. One test: it sets the environment first.
mod providers_util;

use std::time::Duration;

use mrkit::{AccessFlags as A, Buffer};
use serde_json::Value;

#[test]
fn rdma_core_process_lists_the_provider_and_the_drop_in_copy() {
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

    let rc = providers_util::rdma_core(); // no native context in this process
    let pd = rc.alloc_pd().unwrap();
    let mut mrs: Vec<_> = (0..5)
        .map(|_| {
            pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE)
                .unwrap()
        })
        .collect();
    drop(mrs.pop()); // one deregistration
                     // One failure: remote write without local write (EINVAL on both providers).
    assert!(pd
        .register(Buffer::new(4096).unwrap(), A::REMOTE_WRITE)
        .is_err());

    let pid = std::process::id();
    let mut last = Value::Null;
    // The joined copy answers the holder's next snapshot: a few requests at most.
    for _ in 0..50 {
        let (v, fresh) =
            mrkit::stat_export::request_and_read(&dir, pid, Duration::from_secs(10)).unwrap();
        assert!(fresh, "no fresh snapshot: {v}");
        last = v;
        if last["copies"].as_array().is_some_and(|c| !c.is_empty()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let v = last;
    // This copy (the program's mrkit) opened no mrkit0 of its own.
    assert_eq!(v["mrkit0_open"], false, "{v}");
    let devs = v["sources"]["rdma_core"]["devices"]
        .as_array()
        .expect("rdma_core devices");
    assert_eq!(devs.len(), 1, "{v}");
    let d = &devs[0];
    assert_eq!(d["device"], "rdma-core:mrkit0");
    assert_eq!(d["registrations"], 5, "{d}");
    assert_eq!(d["deregistrations"], 1, "{d}");
    assert_eq!(d["mrs_live"], 4, "{d}");
    assert_eq!(d["failures"]["EINVAL"], 1, "{d}");
    assert_eq!(d["bytes_registered"], 5 * 4096, "{d}");
    assert_eq!(d["bytes_live"], 4 * 4096, "{d}");
    assert_eq!(d["latency_ns"]["count"], 5, "{d}");
    assert_eq!(d["mrs"]["total"], 4, "{d}");
    let list = d["mrs"]["list"].as_array().unwrap();
    assert_eq!(list.len(), 4);
    for m in list {
        assert_eq!(m["length"], 4096, "{m}");
        assert!(m["reg_timing_ns"]["total"].as_u64().unwrap() > 0, "{m}");
        assert_eq!(m["page_size"], 0, "unknown through libibverbs: {m}");
    }
    let mut keys: Vec<u64> = list.iter().map(|m| m["lkey"].as_u64().unwrap()).collect();
    keys.sort_unstable();
    let mut want: Vec<u64> = mrs.iter().map(|m| u64::from(m.lkey())).collect();
    want.sort_unstable();
    assert_eq!(keys, want);

    // The drop-in's own mrkit0 (the device under the provider) is listed as before, as the
    // process's second copy: the same registrations, counted by the device itself.
    let copies = v["copies"].as_array().expect("copies");
    assert_eq!(copies.len(), 1, "{v}");
    let c = &copies[0];
    assert_eq!(c["pid"], pid);
    assert_eq!(c["mrkit0_open"], true, "{c}");
    assert_eq!(c["registrations"], 5, "{c}");
    assert_eq!(c["deregistrations"], 1, "{c}");
    assert_eq!(c["mrs_live"], 4, "{c}");
    assert_eq!(c["mrs"]["total"], 4, "{c}");
    assert_eq!(c["failures"]["EINVAL"], 1, "{c}");

    drop(mrs);
    mrkit::stat_export::shutdown();
}
