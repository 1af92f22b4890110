//! `mrkit bench transport` on a device other than mrkit0: the drop-in's mrkit0 through the
//! rdma-core provider (`--device rdma-core:mrkit0`). The `mrkit perf` runs measure that
//! device; the experiments that describe mrkit0's software transport (raw UDP floors, the
//! copy-and-ICRC ceiling, the ratios to them, UCX over TCP) say `"mrkit0 only: <reason>"`.

mod support;
use support::{drop_in_dir, lib, mrkit_clean};

#[test]
fn bench_transport_on_rdma_core() {
    let dir = drop_in_dir();
    let mut c = mrkit_clean();
    let o = c
        .args(["bench", "transport", "--quick", "--json"])
        .args(["--device", "rdma-core:mrkit0"])
        .env("MRKIT_RDMA_CORE_LIB", lib(dir.path()))
        .env("MRKIT_STAT", "0")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["device"], "rdma-core:mrkit0");
    // Every perf run of the device: WRITE and READ at three sizes, verified data.
    let rows = v["mrkit"].as_array().unwrap();
    assert_eq!(rows.len(), 6, "{v}");
    for r in rows {
        assert_eq!(r["errors"], 0, "{r}");
        assert!(r["bw_mbps"].as_f64().unwrap() > 0.0, "{r}");
    }
    for k in ["write_lat", "send_lat"] {
        assert!(v[k]["lat_us_p50"].as_f64().unwrap() > 0.0, "{k}: {v}");
        assert_eq!(v[k]["errors"], 0, "{k}: {v}");
        let ratio = v[k]["ratio_to_floor_median"].as_str().unwrap();
        assert!(ratio.starts_with("mrkit0 only: "), "{ratio}");
    }
    // What describes mrkit0's software transport is not measured, with the reason.
    for k in [
        "raw_udp_gso_mbps",
        "raw_udp_gso_gro_mbps",
        "raw_udp_gso_gro_copy_icrc_mbps",
        "raw_udp_pingpong_rtt_us",
        "raw_udp_pingpong_connected_rtt_us",
        "ucx_tcp_put_bw_64k_mbps",
        "ucx_tcp_am_lat_8b_us_one_way",
    ] {
        let why = v[k].as_str().unwrap_or_else(|| panic!("{k}: {}", v[k]));
        assert!(
            why.starts_with("mrkit0 only: ") && why.len() > 40,
            "{k}: {why}"
        );
    }
    let rounds = v["latency_rounds"].as_array().unwrap();
    assert!(rounds.iter().all(|r| r.get("floor_us").is_none()), "{v}");
}

/// Key `k` of the JSON object `v` is a number above zero.
fn assert_positive(v: &serde_json::Value, k: &str) {
    let x = v[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {v}"));
    assert!(x > 0.0, "{k}: {x}");
}

/// `bench pool-cache` runs every experiment on the drop-in's device through the generic API.
#[test]
fn bench_pool_cache_on_rdma_core() {
    let dir = drop_in_dir();
    let mut c = mrkit_clean();
    let o = c
        .args(["bench", "pool-cache", "--quick", "--json"])
        .args(["--device", "rdma-core:mrkit0"])
        .env("MRKIT_RDMA_CORE_LIB", lib(dir.path()))
        .env("MRKIT_STAT", "0")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    for k in [
        "pool_alloc_free_ns",
        "owned_slot_cross_thread_ns",
        "cache_hit_ns_p50",
        "cache_hit_ns_p50_n65536",
        "cache_hit_ns_p50_n65536_scattered",
        "hit_floor_ns_n65536_scattered",
        "cache_hit_key_ns_p50_n64",
        "cache_cross_thread_drop_ns_n64",
        "cache_cross_thread_drop_ns_n65536",
        "cache_hit_key_ns_p50_n65536_2threads",
        "cache_two_over_one_n64",
        "hit_floor_two_over_one_n64",
        "cache_two_over_one_n65536",
        "hit_floor_two_over_one_n65536",
        "cache_two_over_one_n65536_scattered",
        "hit_floor_two_over_one_n65536_scattered",
        "per_message_reg_ns",
        "pooled_ns",
        "per_message_over_pooled",
    ] {
        assert_positive(&v, k);
    }
    assert!(v["cache_miss_overhead_ns"].is_number(), "{v}");
    // UCX's rcache beside it in the same run, contiguous and scattered, when installed.
    if std::path::Path::new("/usr/include/ucs/memory/rcache.h").exists() {
        for k in [
            "ucx_rcache_hit_ns_p50_n65536",
            "cache_over_ucx_n65536",
            "cache_key_over_ucx_n65536",
            "ucx_rcache_cross_thread_drop_ns_n64",
            "cache_cross_thread_drop_over_ucx_n65536",
            "ucx_rcache_hit_ns_p50_n65536_scattered",
            "cache_over_ucx_n65536_scattered",
            "cache_over_ucx_n65536_scattered_2threads",
        ] {
            assert_positive(&v, k);
        }
    } else {
        eprintln!("MRKIT-SKIP the UCX rcache keys: libucx-dev is not installed");
    }
}
