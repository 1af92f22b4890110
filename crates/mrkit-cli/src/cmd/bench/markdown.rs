//! The Markdown report (`report.md`), written from the raw figures.

use serde_json::Value;

use super::data_path::DP_ARENA;
use super::per_message::PerMessage;
use super::registration::{Floor, Point};
use super::SCHEMA;
use crate::cmd::human;

pub(super) fn report(raw: &Value, points: &[Point], floors: &[Floor], pm: &PerMessage) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "# mrkit bench report\n");
    let _ = writeln!(
        s,
        "Device {}, page size {} B, io_uring pinning {}, huge-page detection {}. Run took {:.1} s{}.\n",
        match raw["device_profile"].as_str() {
            Some(p) => format!("{} ({p} profile)", raw["device"].as_str().unwrap_or("mrkit0")),
            None => raw["device"].as_str().unwrap_or("?").to_string(),
        },
        raw["page_size"],
        if raw["io_uring"] == true { "available" } else { "unavailable" },
        if raw["huge_detection"] == true { "available" } else { "unavailable" },
        raw["elapsed_s"].as_f64().unwrap_or(0.0),
        if raw["quick"] == true { " (--quick)" } else { "" }
    );
    let _ = writeln!(s, "## Registration cost vs size\n");
    let _ = writeln!(s, "Median of several reg_mr / dereg_mr pairs of one resident buffer (LOCAL_WRITE). The floors pin the same buffer with the bare mechanism (mlock+munlock; io_uring fixed-buffer register+unregister) in the same run.\n");
    let _ = writeln!(
        s,
        "![registration cost](reg_cost.svg)\n\n![registration throughput](reg_throughput.svg)\n"
    );
    let _ = writeln!(s, "| size | reg 4 KiB pages | reg THP | THP page size seen | entries 4K / THP | mlock floor | io_uring floor |");
    let _ = writeln!(s, "|---:|---:|---:|---:|---:|---:|---:|");
    let t = |n: Option<u64>| {
        n.map(|n| format!("{:.1} µs", n as f64 / 1e3))
            .unwrap_or_else(|| "-".into())
    };
    for (size, ml, iu) in floors {
        let p4 = points.iter().find(|p| p.size == *size && p.page == "4k");
        let pt = points.iter().find(|p| p.size == *size && p.page == "thp");
        let cell = |p: Option<&Point>| match p {
            Some(Point {
                reg_ns: Some(n), ..
            }) => t(Some(*n)),
            Some(Point { error: Some(e), .. }) => {
                format!("failed: {}", e.split(':').next().unwrap_or(e))
            }
            _ => "-".into(),
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} / {} | {} | {} |",
            human(*size),
            cell(p4),
            cell(pt),
            pt.map(|p| human(p.page_size_seen)).unwrap_or_default(),
            p4.map(|p| p.entries).unwrap_or(0),
            pt.map(|p| p.entries).unwrap_or(0),
            ml.as_ref()
                .map(|n| t(Some(*n)))
                .unwrap_or_else(|e| format!("failed: {e}")),
            match iu {
                None => "n/a".into(),
                Some(Ok(n)) => t(Some(*n)),
                Some(Err(e)) => format!("failed: {}", e.split(':').next().unwrap_or(e)),
            }
        );
    }
    let _ = writeln!(s, "\n## Per-message registration vs one reused MR\n");
    let _ = writeln!(s, "{} messages of 4 KiB. *Per message*: ibv_reg_mr + ibv_dereg_mr around every message (the anti-pattern: one registration per message). *Reused MR*: one 1 MiB MR registered once; each message only pays the device's key lookup and range check (the floor of any reuse scheme). *MR pool*: `mrkit::pool::MrPool` alloc of a 4 KiB slot, a 4 KiB copy into it, free. *4 KiB copy*: the work the message does anyway, used for the CPU share.\n", pm.messages);
    let _ = writeln!(
        s,
        "| variant | ns / message | share of per-message CPU (vs a 4 KiB copy) |\n|---|---:|---:|"
    );
    let share = |x: f64| {
        if x + pm.copy_ns > 0.0 {
            format!("{:.1} %", 100.0 * x / (x + pm.copy_ns))
        } else {
            "-".into()
        }
    };
    let _ = writeln!(
        s,
        "| per-message reg+dereg | {:.0} | {} |",
        pm.per_message_reg_ns,
        share(pm.per_message_reg_ns)
    );
    let _ = writeln!(
        s,
        "| one MR reused (key check) | {:.0} | {} |",
        pm.reused_mr_ns,
        share(pm.reused_mr_ns)
    );
    match &pm.pool_ns {
        Ok(p) => {
            let _ = writeln!(
                s,
                "| MR pool (alloc + copy + free) | {p:.0} | includes the copy |"
            );
        }
        Err(e) => {
            let _ = writeln!(s, "| MR pool | not measured: {e} | |");
        }
    }
    let _ = writeln!(s, "| 4 KiB copy alone | {:.0} | |", pm.copy_ns);
    if pm.reused_mr_ns > 0.0 {
        let _ = writeln!(
            s,
            "\nPer-message registration costs {:.0}x the reused MR.",
            pm.per_message_reg_ns / pm.reused_mr_ns
        );
    }
    if let Some(e) = &pm.error {
        let _ = writeln!(s, "\nNote: {e}");
    }
    let _ = writeln!(s, "\n## Registration cache\n");
    let _ = writeln!(s, "`mrkit::cache::RegCache` (page-rounded entries, userfaultfd monitor), lookups of 64 KiB buffers in a scrambled order; each lookup is `get_ref` + drop of the handle.\n");
    let _ = writeln!(s, "| scenario | lookups | hit rate | hits (fast path) | misses | evictions | ns / lookup |\n|---|---:|---:|---:|---:|---:|---:|");
    for c in raw["cache"].as_array().into_iter().flatten() {
        let name = format!("{} buffers, room for {}", c["buffers"], c["max_entries"]);
        if let Some(e) = c["error"].as_str() {
            let _ = writeln!(s, "| {name} | not measured: {e} | | | | | |");
            continue;
        }
        let _ = writeln!(
            s,
            "| {name} | {} | {:.1} % | {} ({}) | {} | {} | {:.0} |",
            c["lookups"],
            c["hit_rate"].as_f64().unwrap_or(0.0) * 100.0,
            c["hits"],
            c["fast_hits"],
            c["misses"],
            c["evictions"],
            c["ns_per_lookup"].as_f64().unwrap_or(0.0)
        );
    }
    cache_hits_report(&mut s, &raw["cache_hits"]);
    data_path_report(&mut s, &raw["data_path"]);
    let _ = writeln!(s, "\n## Not measured\n");
    let notes = raw["notes"].as_array().cloned().unwrap_or_default();
    if notes.is_empty() {
        let _ = writeln!(s, "Nothing: every part of the suite ran.");
    }
    for n in notes {
        let _ = writeln!(s, "- {}", n.as_str().unwrap_or(""));
    }
    let _ = writeln!(
        s,
        "\nRaw figures: `raw.json` (schema `{SCHEMA}`, see docs/cli.md)."
    );
    s
}

/// The hit sweep's table (see `bench_pool_cache::sweep_json`).
pub(super) fn cache_hits_report(s: &mut String, c: &Value) {
    use std::fmt::Write as _;
    let _ = writeln!(s, "\nHits by working set: N cached 4 KiB buffers, two threads warmed up alike, then, in {} round(s), {} lookups (`get` + drop) in a random order by each alone (*mrkit*: the mean of the two) and then by both at once, each phase after untimed lookups of its own, median of 1,000-lookup batches (ns), median over the rounds; *2 ÷ 1*: the median of the rounds' two-thread ÷ one-thread ratios; *÷ floor*: the median of the rounds' mrkit ÷ floor ratios (the floor is measured in the same rounds, right after the cache); *mrkit + lkey*: each lookup also reads its handle's lkey, as a program about to post does (UCX's lookups always read their region's key); *isolated*: the first thread alone with an `LFENCE` after every lookup (no overlap between lookups); the memory floor under a hit (its one line, the thread's lease cell, and count updates without the cache) and UCX's `ucs_rcache` (no-op registration callback) in the same shape and run.\n", c["rounds"], c["lookups"]);
    if let Some(e) = c["error"].as_str() {
        let _ = writeln!(s, "Not measured: {e}");
        return;
    }
    let f = |v: &Value| v.as_f64().map_or("—".to_string(), |x| format!("{x:.1}"));
    let f2 = |v: &Value| v.as_f64().map_or("—".to_string(), |x| format!("{x:.2}"));
    let _ = writeln!(s, "| buffers | mrkit | 2 threads | 2 ÷ 1 | mrkit + lkey | isolated | thread-path share | floor | floor 2 threads | floor 2 ÷ 1 | floor isolated | ÷ floor | UCX | UCX 2 threads | UCX isolated | mrkit ÷ UCX |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for p in c["points"].as_array().into_iter().flatten() {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {:.1} % | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            p["buffers"],
            f(&p["ns"]),
            f(&p["ns_2threads"]),
            f2(&p["two_over_one"]),
            f(&p["key_ns"]),
            f(&p["ns_isolated"]),
            p["fast_share"].as_f64().unwrap_or(0.0) * 100.0,
            f(&p["floor_ns"]),
            f(&p["floor_ns_2threads"]),
            f2(&p["floor_two_over_one"]),
            f(&p["floor_ns_isolated"]),
            f2(&p["over_floor"]),
            f(&p["ucx_ns"]),
            f(&p["ucx_ns_2threads"]),
            f(&p["ucx_ns_isolated"]),
            f2(&p["over_ucx"]),
        );
    }
    let n = c["points"]
        .as_array()
        .and_then(|p| p.last())
        .map_or(Value::Null, |p| p["buffers"].clone());
    let _ = writeln!(
        s,
        "\nMemory per entry at {n} entries (resident bytes, cache and device state): {} (UCX: {}).",
        f(&c["bytes_per_entry"]),
        f(&c["ucx_bytes_per_entry"])
    );
    if let Some(e) = c["ucx_error"].as_str() {
        let _ = writeln!(s, "\nUCX not measured: {e}");
    }
}

/// One row of a markdown table: `| a | b | … |`.
pub(super) fn md_row(s: &mut String, cells: &[String]) {
    use std::fmt::Write;
    let _ = writeln!(s, "| {} |", cells.join(" | "));
}

pub(super) fn data_path_report(s: &mut String, dp: &Value) {
    use std::fmt::Write;
    let f = |v: &Value, d: usize| {
        v.as_f64()
            .map(|x| format!("{x:.d$}"))
            .unwrap_or_else(|| "-".into())
    };
    // Cells of a row of the data-path tables.
    let op = |r: &Value| r["op"].as_str().unwrap_or("?").to_uppercase();
    let size = |r: &Value| human(r["size"].as_u64().unwrap_or(0));
    let us = |v: &Value, d: usize| format!("{} µs", f(v, d));
    let _ = writeln!(s, "\n## Data path: WRITE/READ bandwidth and latency\n");
    let _ = writeln!(s, "![bandwidth vs message size](data_bw.svg)\n");
    let dpi = &dp["in_process"];
    let _ = writeln!(s, "### In process\n");
    let _ = writeln!(s, "Two mrkit0 instances in this process on the loopback link, one RC QP each (MTU 4096), signaled WRITE/READ with up to 16 MiB in flight; offsets rotate across {} arenas (DRAM, not cache), and memcpy runs over the same arenas and rotation in the same run.\n", human(dpi["arena_bytes"].as_u64().unwrap_or(DP_ARENA as u64)));
    let _ = writeln!(
        s,
        "| op | size | GB/s | memcpy GB/s | ÷ memcpy |\n|---|---:|---:|---:|---:|"
    );
    for r in dpi["bandwidth"].as_array().into_iter().flatten() {
        let (gbps, memcpy) = (f(&r["gbps"], 2), f(&r["memcpy_gbps"], 2));
        md_row(
            s,
            &[op(r), size(r), gbps, memcpy, f(&r["ratio_to_memcpy"], 2)],
        );
    }
    let _ = writeln!(
        s,
        "\n| op | size | round trip p50 | p99 |\n|---|---:|---:|---:|"
    );
    for r in dpi["latency"].as_array().into_iter().flatten() {
        let (p50, p99) = (us(&r["lat_us_p50"], 2), us(&r["lat_us_p99"], 2));
        md_row(s, &[op(r), "8 B".into(), p50, p99]);
    }
    let _ = writeln!(s, "\nmemcpy of 8 bytes: {} ns.", f(&dpi["memcpy_8b_ns"], 1));
    if let Some(e) = dpi["error"].as_str() {
        let _ = writeln!(s, "\nIn-process run stopped: {e}");
    }
    let dpt = &dp["two_process"];
    let _ = writeln!(s, "\n### Two processes (RoCEv2 over UDP)\n");
    let _ = writeln!(s, "`mrkit perf --server` in a child process, the client in another process, on loopback addresses; data verified; RTT columns are the one-message-outstanding round trips of each point. Full run (`mrkit bench transport`): floors from the same run, raw UDP streams of 4 KiB datagrams in 60 KiB GSO sends received one datagram per slot (docs/floors.md §2) and with GRO, the GRO stream with the payload copies and ICRC a RoCE stream must do (a ceiling), a raw 8-byte UDP ping-pong, and UCX when installed.\n");
    let r = &dpt["result"];
    if r.is_null() {
        let _ = writeln!(
            s,
            "Not measured: {}",
            dpt["error"].as_str().unwrap_or("unknown error")
        );
        return;
    }
    let gso = r["raw_udp_gso_mbps"].as_f64();
    let gro = r["raw_udp_gso_gro_mbps"].as_f64();
    let ceiling = r["raw_udp_gso_gro_copy_icrc_mbps"].as_f64();
    let pp = r["raw_udp_pingpong_rtt_us"].as_f64();
    let ratio = |x: f64, floor: Option<f64>| {
        floor
            .filter(|f| *f > 0.0)
            .map(|f| format!("{:.2}", x / f))
            .unwrap_or_else(|| "-".into())
    };
    let _ = writeln!(s, "| op | size | MB/s | ÷ raw UDP GSO | ÷ raw UDP GSO+GRO | ÷ GSO+GRO with copies and ICRC | RTT p50 | RTT p99 | errors |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for x in r["mrkit"].as_array().into_iter().flatten() {
        let bw = x["bw_mbps"].as_f64().unwrap_or(0.0);
        let (p50, p99) = (us(&x["lat_us_p50"], 1), us(&x["lat_us_p99"], 1));
        let (bw_s, r_gso, r_gro) = (format!("{bw:.0}"), ratio(bw, gso), ratio(bw, gro));
        md_row(
            s,
            &[
                op(x),
                size(x),
                bw_s,
                r_gso,
                r_gro,
                ratio(bw, ceiling),
                p50,
                p99,
                x["errors"].to_string(),
            ],
        );
    }
    for (k, name) in [("write_lat", "WRITE"), ("send_lat", "SEND")] {
        let l = r[k]["lat_us_p50"].as_f64().unwrap_or(0.0);
        match pp {
            Some(pp) => {
                let _ = writeln!(
                    s,
                    "\n{name} 8 B round trip p50 {l:.1} µs = {}x the raw UDP ping-pong ({pp:.1} µs).",
                    ratio(l, Some(pp))
                );
            }
            None => {
                let _ = writeln!(s, "\n{name} 8 B round trip p50 {l:.1} µs.");
            }
        }
    }
    match (gso, gro) {
        (Some(a), Some(b)) => {
            let _ = writeln!(
                s,
                "\nRaw UDP stream floors: {a:.0} MB/s (GSO, one datagram per receive slot), {b:.0} MB/s (GSO + GRO)."
            );
        }
        _ => {
            let _ = writeln!(s, "\nFloors (raw UDP streams and ping-pong) and UCX are not run with `--quick`; `mrkit bench transport` measures them.");
            return;
        }
    }
    match (
        r["ucx_tcp_put_bw_64k_mbps"].as_f64(),
        r["ucx_tcp_am_lat_8b_us_one_way"].as_f64(),
    ) {
        (Some(bw), Some(l)) => {
            let _ = writeln!(
                s,
                "\nUCX over tcp on the same host: put_bw 64 KiB {bw:.0} MB/s, am_lat 8 B {l:.1} µs one way."
            );
        }
        _ => {
            let _ = writeln!(s, "\nUCX: `ucx_perftest` not installed or not parsable.");
        }
    }
}
