//! `mrkit bench`: the seeds' experiments as one suite, with a Markdown report, SVG plots and
//! the raw figures as JSON.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use mrkit::{AccessFlags, Buffer, BufferOptions};
use mrkit_soft::mem::pin::{self, PinPath};
use mrkit_soft::mr::KeyUse;
use mrkit_soft::{Context, DeviceConfig, UserMemory};
use serde_json::{json, Value};
use std::sync::Arc;

use super::human;
use crate::exit;

#[derive(Args, Debug)]
#[command(
    args_conflicts_with_subcommands = true,
    after_help = "Examples:\n  mrkit bench --quick\n  mrkit bench --out /tmp/mrkit-bench\n  mrkit bench pool-cache --json\n\nWrites DIR/report.md, DIR/reg_cost.svg, DIR/reg_throughput.svg and DIR/raw.json.\n--quick stops at 64 MiB and fewer messages (under a minute, for CI)."
)]
pub struct BenchArgs {
    #[command(subcommand)]
    sub: Option<BenchSub>,
    /// Small sizes and counts only (under a minute).
    #[arg(long)]
    quick: bool,
    /// Output directory.
    #[arg(long, default_value = "mrkit-bench")]
    out: PathBuf,
}

#[derive(Subcommand, Debug)]
enum BenchSub {
    /// Two-process RoCEv2/UDP bandwidth and latency beside raw UDP (and UCX when installed).
    Transport {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// Fewer iterations.
        #[arg(long)]
        quick: bool,
    },
    /// MR pool and registration cache benchmark (the registration services).
    PoolCache {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
}

/// Schema of `raw.json` (version 2 added `data_path`).
pub const SCHEMA: &str = "mrkit-bench/2";

fn median(v: &mut [u64]) -> u64 {
    if v.is_empty() {
        return 0;
    }
    v.sort_unstable();
    v[v.len() / 2]
}

fn reps_for(size: u64) -> usize {
    ((1u64 << 30) / size).clamp(5, 200) as usize
}

struct Point {
    size: u64,
    page: &'static str,
    reg_ns: Option<u64>,
    dereg_ns: Option<u64>,
    page_size_seen: u64,
    entries: u64,
    error: Option<String>,
}

impl Point {
    /// A point of `size` bytes (4 KiB pages or THP) that could not be measured.
    fn failed(size: u64, thp: bool, error: String) -> Point {
        Point {
            size,
            page: if thp { "thp" } else { "4k" },
            reg_ns: None,
            dereg_ns: None,
            page_size_seen: 0,
            entries: 0,
            error: Some(error),
        }
    }
}

fn alloc(size: u64, thp: bool) -> Option<Buffer> {
    Buffer::with_options(
        size as usize,
        BufferOptions {
            thp,
            populate: true,
            offset: 0,
        },
    )
    .ok()
}

fn reg_point(ctx: &Context, pd: u32, buf: &Arc<Buffer>, thp: bool) -> Point {
    let size = buf.len() as u64;
    let mut regs = Vec::new();
    let mut deregs = Vec::new();
    let mut info = (0, 0);
    for _ in 0..reps_for(size) {
        // The MR holds a reference to the buffer until it is deregistered.
        let mem = UserMemory::owned(buf.clone());
        let t = Instant::now();
        let r = ctx.reg_mr_va(pd, mem, AccessFlags::LOCAL_WRITE);
        let reg = t.elapsed().as_nanos() as u64;
        match r {
            Ok(mr) => {
                info = (mr.page_size, mr.entries);
                let t = Instant::now();
                let _ = ctx.dereg_mr(mr.lkey);
                deregs.push(t.elapsed().as_nanos() as u64);
                regs.push(reg);
            }
            Err(e) => return Point::failed(size, thp, e.to_string()),
        }
    }
    Point {
        size,
        page: if thp { "thp" } else { "4k" },
        reg_ns: Some(median(&mut regs)),
        dereg_ns: Some(median(&mut deregs)),
        page_size_seen: info.0,
        entries: info.1,
        error: None,
    }
}

fn floor_point(path: PinPath, buf: &Buffer) -> Result<u64, String> {
    let size = buf.len() as u64;
    let mut v = Vec::new();
    for _ in 0..reps_for(size) {
        let t = Instant::now();
        let p = pin::pin_via(path, buf.addr(), size, true).map_err(|e| e.to_string())?;
        drop(p);
        v.push(t.elapsed().as_nanos() as u64);
    }
    Ok(median(&mut v))
}

fn plot(
    path: &Path,
    title: &str,
    xlabel: &str,
    ylabel: &str,
    series: &[(&str, Vec<(u64, f64)>)],
) -> Result<(), String> {
    use plotters::prelude::*;
    let pts: Vec<(u64, f64)> = series.iter().flat_map(|(_, v)| v.iter().copied()).collect();
    if pts.is_empty() {
        return Err("no data".into());
    }
    let xmin = pts.iter().map(|p| p.0).min().unwrap_or(4096) as f64;
    let xmax = pts.iter().map(|p| p.0).max().unwrap_or(4096) as f64 * 1.5;
    let ymin = pts.iter().map(|p| p.1).fold(f64::MAX, f64::min).max(1e-3) / 1.5;
    let ymax = pts.iter().map(|p| p.1).fold(0.0, f64::max) * 1.5;
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((xmin..xmax).log_scale(), (ymin..ymax).log_scale())
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc(xlabel)
        .y_desc(ylabel)
        .x_label_formatter(&|x| human(*x as u64))
        .draw()
        .map_err(|e| e.to_string())?;
    let colors = [RED, BLUE, GREEN, MAGENTA, BLACK];
    for (i, (name, v)) in series.iter().enumerate() {
        let c = colors[i % colors.len()];
        chart
            .draw_series(LineSeries::new(
                v.iter().map(|(x, y)| (*x as f64, *y)),
                c.stroke_width(2),
            ))
            .map_err(|e| e.to_string())?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
        chart
            .draw_series(
                v.iter()
                    .map(|(x, y)| Circle::new((*x as f64, *y), 3, c.filled())),
            )
            .map_err(|e| e.to_string())?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

struct PerMessage {
    messages: u64,
    per_message_reg_ns: f64,
    reused_mr_ns: f64,
    error: Option<String>,
    /// ns per message through `mrkit::pool::MrPool` (alloc + free of a 4 KiB slot).
    pool_ns: Result<f64, String>,
    /// ns to copy 4 KiB (the work a message does anyway), for the CPU-share estimate.
    copy_ns: f64,
}

/// Per-message cost through the MR pool: allocate a 4 KiB slot, write the message, free it.
fn pool_per_message(n: u64) -> Result<f64, String> {
    use mrkit::pool::{MrPool, PoolConfig};
    let ctx = mrkit::Context::open(DeviceConfig::rxe());
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let pool = MrPool::new(
        &pd,
        PoolConfig {
            chunk_size: 4 << 20,
            ..PoolConfig::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let msg = [0x5au8; 4096];
    // Warm the thread's magazine.
    drop(pool.alloc().map_err(|e| e.to_string())?);
    let t = Instant::now();
    for _ in 0..n {
        let mut s = pool.alloc().map_err(|e| e.to_string())?;
        s.as_mut_slice()[..4096].copy_from_slice(&msg);
        std::hint::black_box(s.lkey());
    }
    let total = t.elapsed().as_nanos() as f64 / n as f64;
    Ok(total)
}

/// One registration-cache scenario: `lookups` gets over `buffers` buffers of 64 KiB with room
/// for `max_entries` entries.
fn cache_scenario(buffers: usize, max_entries: usize, lookups: u64) -> Value {
    use mrkit::cache::{CacheConfig, RegCache};
    let run = || -> Result<Value, String> {
        let ctx = mrkit::Context::open(DeviceConfig::rxe());
        let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
        let cache = RegCache::new(
            &pd,
            CacheConfig {
                max_entries,
                ..CacheConfig::default()
            },
        )
        .map_err(|e| e.to_string())?;
        let bufs: Vec<Buffer> = (0..buffers)
            .map(|_| alloc(64 << 10, false).ok_or_else(|| "allocation failed".to_string()))
            .collect::<Result<_, _>>()?;
        let t = Instant::now();
        for i in 0..lookups {
            // A strided walk over the working set (every buffer, in a scrambled order).
            let b = &bufs[(i as usize * 7 + i as usize / buffers) % buffers];
            let h = cache
                .get_ref(b.as_slice(), AccessFlags::empty())
                .map_err(|e| e.to_string())?;
            std::hint::black_box(h.lkey());
        }
        let ns = t.elapsed().as_nanos() as f64 / lookups as f64;
        let st = cache.stats();
        let total = (st.hits + st.misses).max(1);
        Ok(json!({
            "buffers": buffers,
            "buffer_size": 64 << 10,
            "max_entries": max_entries,
            "lookups": lookups,
            "ns_per_lookup": ns,
            "hits": st.hits,
            "fast_hits": st.fast_hits,
            "misses": st.misses,
            "evictions": st.evictions,
            "hit_rate": st.hits as f64 / total as f64,
            "error": null,
        }))
    };
    run().unwrap_or_else(
        |e| json!({"buffers": buffers, "max_entries": max_entries, "lookups": lookups, "error": e}),
    )
}

fn pm_failed(n: u64, per: f64, error: Option<String>) -> PerMessage {
    PerMessage {
        messages: n,
        per_message_reg_ns: per,
        reused_mr_ns: 0.0,
        error,
        pool_ns: Err("not run".into()),
        copy_ns: 0.0,
    }
}

fn copy_cost(n: u64) -> f64 {
    let src = vec![0x5au8; 4096];
    let mut dst = vec![0u8; 4096];
    let t = Instant::now();
    for _ in 0..n {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    t.elapsed().as_nanos() as f64 / n as f64
}

/// Per-message registration vs one big MR reused (what a pool does, without the pool's own
/// bookkeeping): registering and deregistering 4 KiB for every message vs a key lookup and
/// range check against one registered 1 MiB slab.
fn per_message(ctx: &Context, pd: u32, n: u64) -> PerMessage {
    let slab = match alloc(1 << 20, false) {
        Some(b) => Arc::new(b),
        None => return pm_failed(n, 0.0, Some("allocation failed".into())),
    };
    let t = Instant::now();
    for i in 0..n {
        let off = (i % 256) * 4096;
        let Some(mem) = UserMemory::owned_range(slab.clone(), off, 4096) else {
            return pm_failed(n, 0.0, Some("slab too small".into()));
        };
        match ctx.reg_mr_va(
            pd,
            mem,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        ) {
            Ok(mr) => {
                let _ = ctx.dereg_mr(mr.lkey);
            }
            Err(e) => return pm_failed(n, 0.0, Some(e.to_string())),
        }
    }
    let per = t.elapsed().as_nanos() as f64 / n as f64;
    let big = match ctx.reg_mr_va(
        pd,
        UserMemory::owned(slab),
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
    ) {
        Ok(m) => m,
        Err(e) => return pm_failed(n, per, Some(e.to_string())),
    };
    let t = Instant::now();
    let mut ok = 0u64;
    for i in 0..n {
        let off = (i % 256) * 4096;
        if ctx
            .check_access(
                big.rkey,
                pd,
                AccessFlags::REMOTE_WRITE,
                big.iova + off,
                4096,
                KeyUse::Remote,
                0,
            )
            .is_ok()
        {
            ok += 1;
        }
    }
    let reused = t.elapsed().as_nanos() as f64 / n as f64;
    let _ = ctx.dereg_mr(big.lkey);
    PerMessage {
        messages: n,
        per_message_reg_ns: per,
        reused_mr_ns: reused,
        error: (ok != n).then(|| format!("{} of {n} accesses refused", n - ok)),
        pool_ns: pool_per_message(n),
        copy_ns: copy_cost(n),
    }
}

pub fn run(a: BenchArgs) -> u8 {
    if let Some(BenchSub::PoolCache { json }) = a.sub {
        return super::bench_pool_cache::run(json);
    }
    if let Some(BenchSub::Transport { json, quick }) = a.sub {
        return super::bench_transport::run(json, quick);
    }
    if let Err(e) = std::fs::create_dir_all(&a.out) {
        eprintln!("mrkit bench: cannot create {}: {e}", a.out.display());
        return exit::USAGE;
    }
    let max = if a.quick { 64u64 << 20 } else { 1 << 30 };
    let sizes: Vec<u64> = std::iter::successors(Some(4096u64), |s| Some(s * 4))
        .take_while(|s| *s <= max)
        .collect();
    let messages: u64 = if a.quick { 2000 } else { 20000 };
    let io_uring = pin::io_uring_available();
    let steps = sizes.len() as u64 * 2 + 6;
    let pb = ProgressBar::new(steps);
    pb.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let started = Instant::now();
    let ctx = Context::open(DeviceConfig::rxe());
    let pd = match ctx.alloc_pd() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("mrkit bench: {e}");
            return exit::VERB_FAILED;
        }
    };
    let mut points = Vec::new();
    let mut floors = Vec::new();
    for &size in &sizes {
        for thp in [false, true] {
            pb.set_message(format!(
                "register {} ({})",
                human(size),
                if thp { "THP" } else { "4 KiB pages" }
            ));
            let Some(buf) = alloc(size, thp).map(Arc::new) else {
                points.push(Point::failed(size, thp, "allocation failed".into()));
                pb.inc(1);
                continue;
            };
            points.push(reg_point(&ctx, pd, &buf, thp));
            if !thp {
                let ml = floor_point(PinPath::Mlock, &buf);
                let iu = if io_uring {
                    Some(floor_point(PinPath::IoUring, &buf))
                } else {
                    None
                };
                floors.push((size, ml, iu));
            }
            pb.inc(1);
        }
    }
    pb.set_message("per-message registration vs one reused MR");
    let pm = per_message(&ctx, pd, messages);
    pb.inc(1);
    pb.set_message("registration cache: working set fits");
    let cache_fit = cache_scenario(32, 1024, messages);
    pb.inc(1);
    pb.set_message("registration cache: working set twice the cache");
    let cache_thrash = cache_scenario(32, 16, messages);
    pb.inc(1);
    pb.set_message("registration cache: hits by working-set size");
    let cache_hits = if a.quick {
        super::bench_pool_cache::sweep_json(&[1, 64, 4096], 20_000)
    } else {
        super::bench_pool_cache::sweep_json(&super::bench_pool_cache::SWEEP_SIZES, 200_000)
    };
    pb.inc(1);
    pb.set_message("data path in process: WRITE/READ over the loopback link");
    let dp_in = data_path_in_process(a.quick);
    pb.inc(1);
    pb.set_message("data path between two processes: WRITE/READ over RoCEv2/UDP");
    let dp_two = data_path_two_process(a.quick);
    pb.inc(1);
    pb.finish_and_clear();
    let elapsed = started.elapsed().as_secs_f64();

    // Plots.
    let us = |v: Option<u64>| v.map(|n| n as f64 / 1e3);
    let series_of = |page: &str| -> Vec<(u64, f64)> {
        points
            .iter()
            .filter(|p| p.page == page)
            .filter_map(|p| us(p.reg_ns).map(|y| (p.size, y)))
            .collect()
    };
    let mut lat: Vec<(&str, Vec<(u64, f64)>)> = vec![
        ("reg_mr, 4 KiB pages", series_of("4k")),
        ("reg_mr, THP", series_of("thp")),
        (
            "mlock+munlock floor",
            floors
                .iter()
                .filter_map(|(s, m, _)| m.as_ref().ok().map(|n| (*s, *n as f64 / 1e3)))
                .collect(),
        ),
    ];
    if io_uring {
        lat.push((
            "io_uring pin floor",
            floors
                .iter()
                .filter_map(|(s, _, i)| {
                    i.as_ref()
                        .and_then(|r| r.as_ref().ok())
                        .map(|n| (*s, *n as f64 / 1e3))
                })
                .collect(),
        ));
    }
    let thr: Vec<(&str, Vec<(u64, f64)>)> = lat
        .iter()
        .map(|(n, v)| {
            (
                *n,
                v.iter()
                    .map(|(s, t)| (*s, *s as f64 / (1u64 << 30) as f64 / (t / 1e6)))
                    .collect(),
            )
        })
        .collect();
    let mut notes: Vec<String> = Vec::new();
    let dp_series = data_path_series(&dp_in, &dp_two);
    // (file, title, x label, y label, series)
    let plots = [
        (
            "reg_cost.svg",
            "registration cost vs size",
            "buffer size",
            "µs (median)",
            &lat,
        ),
        (
            "reg_throughput.svg",
            "registration throughput",
            "buffer size",
            "GiB/s",
            &thr,
        ),
        (
            "data_bw.svg",
            "WRITE/READ bandwidth vs message size",
            "message size",
            "GB/s (10^9 B/s)",
            &dp_series,
        ),
    ];
    for (file, title, x, y, series) in plots {
        if let Err(e) = plot(&a.out.join(file), title, x, y, series) {
            notes.push(format!("{file} not drawn: {e}"));
        }
    }
    if let Some(e) = dp_in["error"].as_str() {
        notes.push(format!("in-process data path: not (fully) measured ({e})"));
    }
    if let Some(e) = dp_two["error"].as_str() {
        notes.push(format!("two-process data path: not measured ({e})"));
    } else if !a.quick && dp_two["result"]["ucx_tcp_put_bw_64k_mbps"].is_null() {
        notes.push(
            "UCX comparison: not measured (ucx_perftest not installed or not parsable)".into(),
        );
    }
    if !io_uring {
        notes.push(format!(
            "io_uring pin floor not measured: {}",
            pin::io_uring_unavailable_reason().unwrap_or_default()
        ));
    }
    if let Err(e) = &pm.pool_ns {
        notes.push(format!("MR pool: not measured ({e})"));
    }

    let raw = json!({
        "schema": SCHEMA,
        "quick": a.quick,
        "elapsed_s": elapsed,
        "device_profile": "rxe",
        "page_size": mrkit_soft::mem::page_size(),
        "io_uring": io_uring,
        "huge_detection": mrkit_soft::mem::translate::huge_detection_available(),
        "reg_cost": points.iter().map(|p| json!({
            "size": p.size,
            "page": p.page,
            "reps": reps_for(p.size),
            "reg_ns_median": p.reg_ns,
            "dereg_ns_median": p.dereg_ns,
            "page_size_seen": p.page_size_seen,
            "entries": p.entries,
            "error": p.error,
        })).collect::<Vec<_>>(),
        "floors": floors.iter().map(|(s, m, i)| json!({
            "size": s,
            "mlock_ns_median": m.as_ref().ok(),
            "mlock_error": m.as_ref().err(),
            "io_uring_ns_median": i.as_ref().and_then(|r| r.as_ref().ok()),
            "io_uring_error": i.as_ref().and_then(|r| r.as_ref().err()),
        })).collect::<Vec<_>>(),
        "per_message": {
            "messages": pm.messages,
            "message_size": 4096,
            "per_message_reg_dereg_ns": pm.per_message_reg_ns,
            "reused_mr_ns": pm.reused_mr_ns,
            "pool_ns": pm.pool_ns.as_ref().ok(),
            "pool_error": pm.pool_ns.as_ref().err(),
            "copy_4k_ns": pm.copy_ns,
            "error": pm.error,
        },
        "pool": Value::Null,
        "cache": [cache_fit, cache_thrash],
        "cache_hits": cache_hits,
        "data_path": {
            "in_process": dp_in,
            "two_process": dp_two,
        },
        "notes": notes,
    });
    if let Err(e) = std::fs::write(
        a.out.join("raw.json"),
        serde_json::to_string_pretty(&raw).expect("json") + "\n",
    ) {
        eprintln!("mrkit bench: cannot write raw.json: {e}");
        return exit::VERB_FAILED;
    }
    let md = report(&raw, &points, &floors, &pm);
    if let Err(e) = std::fs::write(a.out.join("report.md"), md) {
        eprintln!("mrkit bench: cannot write report.md: {e}");
        return exit::VERB_FAILED;
    }
    crate::outln!(
        "mrkit bench: {elapsed:.1} s; wrote {}/report.md, raw.json and SVG plots",
        a.out.display()
    );
    exit::OK
}

type Floor = (u64, Result<u64, String>, Option<Result<u64, String>>);

fn report(raw: &Value, points: &[Point], floors: &[Floor], pm: &PerMessage) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "# mrkit bench report\n");
    let _ = writeln!(
        s,
        "Device mrkit0 (rxe profile), page size {} B, io_uring pinning {}, huge-page detection {}. Run took {:.1} s{}.\n",
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
    let _ = writeln!(s, "{} messages of 4 KiB. *Per message*: ibv_reg_mr + ibv_dereg_mr around every message (seed 001 §4.5.2, the anti-pattern). *Reused MR*: one 1 MiB MR registered once; each message only pays the device's key lookup and range check (the floor of any reuse scheme). *MR pool*: `mrkit::pool::MrPool` alloc of a 4 KiB slot, a 4 KiB copy into it, free. *4 KiB copy*: the work the message does anyway, used for the CPU share.\n", pm.messages);
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
fn cache_hits_report(s: &mut String, c: &Value) {
    use std::fmt::Write as _;
    let _ = writeln!(s, "\nHits by working set: N cached 4 KiB buffers, warmed up, then {} lookups (`get` + drop) per thread in a random order, median of 1,000-lookup batches (ns); UCX's `ucs_rcache` in the same shape and run (no-op registration callback).\n", c["lookups"]);
    if let Some(e) = c["error"].as_str() {
        let _ = writeln!(s, "Not measured: {e}");
        return;
    }
    let f = |v: &Value| v.as_f64().map_or("—".to_string(), |x| format!("{x:.1}"));
    let _ = writeln!(s, "| buffers | mrkit | 2 threads | thread-path share | UCX | UCX 2 threads | mrkit ÷ UCX |\n|---:|---:|---:|---:|---:|---:|---:|");
    for p in c["points"].as_array().into_iter().flatten() {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.1} % | {} | {} | {} |",
            p["buffers"],
            f(&p["ns"]),
            f(&p["ns_2threads"]),
            p["fast_share"].as_f64().unwrap_or(0.0) * 100.0,
            f(&p["ucx_ns"]),
            f(&p["ucx_ns_2threads"]),
            p["over_ucx"]
                .as_f64()
                .map_or("—".to_string(), |x| format!("{x:.2}")),
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

// ---------------------------------------------------------------------------------------------
// Data path: in-process (loopback link) and two-process (RoCEv2/UDP) WRITE/READ.

/// Sizes of the data-path bandwidth points.
const DP_SIZES: [usize; 3] = [4096, 65536, 1 << 20];
/// DRAM-resident arenas: offsets rotate across this many bytes, far beyond the LLC.
const DP_ARENA: usize = 64 << 20;

/// One side of the in-process pair: its device, CQ and QP.
struct DpSide {
    ctx: Context,
    cq: u32,
    qp: u32,
    pd: u32,
}

fn dp_side(sig_all: bool) -> Result<DpSide, String> {
    use mrkit_soft::qp::{QpCap, QpInitAttr};
    let ctx = Context::open(DeviceConfig::rxe());
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let cq = ctx.create_cq(4096, None).map_err(|e| e.to_string())?;
    let (qp, _) = ctx
        .create_qp(QpInitAttr {
            pd,
            send_cq: cq,
            recv_cq: cq,
            cap: QpCap {
                max_send_wr: 512,
                ..QpCap::default()
            },
            sq_sig_all: sig_all,
        })
        .map_err(|e| e.to_string())?;
    Ok(DpSide { ctx, cq, qp, pd })
}

/// Wait for `want` completions on `side`'s CQ (error on a failed completion or after 10 s).
fn dp_reap(side: &DpSide, wcs: &mut Vec<mrkit_soft::cq::Wc>, max: usize) -> Result<usize, String> {
    wcs.clear();
    let k = side
        .ctx
        .poll_cq(side.cq, wcs, max)
        .map_err(|e| e.to_string())?;
    for w in wcs.iter() {
        if w.status != mrkit_soft::cq::WcStatus::Success {
            return Err(format!("completion {:?}", w.status));
        }
    }
    Ok(k)
}

/// Bandwidth (GB/s, 10^9 B/s) of `op` at `size`, `total` bytes, rotating over the arenas.
fn dp_bw(
    a: &DpSide,
    op: mrkit_soft::qp::WrOpcode,
    local: &mrkit_soft::MrInfo,
    remote: &mrkit_soft::MrInfo,
    size: usize,
    total: usize,
) -> Result<f64, String> {
    use mrkit_soft::qp::SendWr;
    let slots = DP_ARENA / size;
    let n = (total / size).max(64);
    let depth = ((16usize << 20) / size).clamp(4, 256);
    let mut wcs = Vec::with_capacity(256);
    let (mut posted, mut done, mut outstanding) = (0usize, 0usize, 0usize);
    let t = Instant::now();
    let deadline = t + std::time::Duration::from_secs(30);
    while done < n {
        while posted < n && outstanding < depth {
            let off = ((posted * 7919) % slots * size) as u64;
            let wr = SendWr::new(posted as u64, op)
                .sge(local.iova + off, size as u32, local.lkey)
                .remote(remote.iova + off, remote.rkey);
            a.ctx
                .post_send(a.qp, &[wr])
                .map_err(|e| format!("post_send: {e:?}"))?;
            posted += 1;
            outstanding += 1;
        }
        let k = dp_reap(a, &mut wcs, 256)?;
        done += k;
        outstanding -= k;
        if k == 0 {
            if Instant::now() > deadline {
                return Err("timed out waiting for completions".into());
            }
            let _ = a.ctx.wait_cq(a.cq, std::time::Duration::from_millis(1));
        }
    }
    Ok((n * size) as f64 / t.elapsed().as_secs_f64() / 1e9)
}

/// Round trips of one 8-byte `op` at a time (post, spin on the CQ): (p50, p99) in µs.
fn dp_lat(
    a: &DpSide,
    op: mrkit_soft::qp::WrOpcode,
    local: &mrkit_soft::MrInfo,
    remote: &mrkit_soft::MrInfo,
    iters: usize,
) -> Result<(f64, f64), String> {
    use mrkit_soft::qp::SendWr;
    let mut wcs = Vec::with_capacity(4);
    let mut v = Vec::with_capacity(iters);
    for i in 0..iters {
        let off = ((i * 4096) % (DP_ARENA - 8)) as u64;
        let wr = SendWr::new(i as u64, op)
            .sge(local.iova + off, 8, local.lkey)
            .remote(remote.iova + off, remote.rkey);
        let t = Instant::now();
        a.ctx
            .post_send(a.qp, &[wr])
            .map_err(|e| format!("post_send: {e:?}"))?;
        while dp_reap(a, &mut wcs, 1)? == 0 {
            if t.elapsed() > std::time::Duration::from_secs(5) {
                return Err("timed out waiting for a completion".into());
            }
            std::hint::spin_loop();
        }
        v.push(t.elapsed().as_nanos() as u64);
    }
    v.sort_unstable();
    let q = |p: f64| v[((v.len() - 1) as f64 * p) as usize] as f64 / 1e3;
    Ok((q(0.5), q(0.99)))
}

/// memcpy of `size` over the same arenas and rotation (GB/s).
fn dp_memcpy(src: &[u8], dst: &mut [u8], size: usize, total: usize) -> f64 {
    let slots = DP_ARENA / size;
    let n = (total / size).max(64);
    let t = Instant::now();
    for i in 0..n {
        let off = ((i * 7919) % slots) * size;
        dst[off..off + size].copy_from_slice(std::hint::black_box(&src[off..off + size]));
    }
    std::hint::black_box(&dst);
    (n * size) as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// In-process WRITE/READ: two mrkit0 instances on the loopback link, one RC QP each, beside
/// memcpy over the same DRAM-resident arenas in the same run.
fn data_path_in_process(quick: bool) -> Value {
    use mrkit_soft::qp::{rc_connect, WrOpcode};
    let run = || -> Result<Value, String> {
        let a = dp_side(true)?;
        let b = dp_side(false)?;
        let full = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        rc_connect(&a.ctx, a.qp, &b.ctx, b.qp, full, 5).map_err(|e| e.to_string())?;
        // The MRs own the arenas (kept alive until deregistered); the memcpy baseline copies
        // from the local arena into an unregistered one of the same size (both DRAM-resident).
        let la = Arc::new(vec![0x5au8; DP_ARENA]);
        let mut rb = vec![0u8; DP_ARENA];
        let ml = a
            .ctx
            .reg_mr_va(a.pd, UserMemory::owned(la.clone()), full)
            .map_err(|e| e.to_string())?;
        let mr = b
            .ctx
            .reg_mr_va(b.pd, UserMemory::owned(Arc::new(vec![0u8; DP_ARENA])), full)
            .map_err(|e| e.to_string())?;
        let total = if quick { 64usize << 20 } else { 512 << 20 };
        let iters = if quick { 2000 } else { 20000 };
        let mut bw = Vec::new();
        let mut result = Ok(());
        for &size in &DP_SIZES {
            let mc = dp_memcpy(&la, &mut rb, size, total);
            for (name, op) in [("write", WrOpcode::RdmaWrite), ("read", WrOpcode::RdmaRead)] {
                match dp_bw(&a, op, &ml, &mr, size, total) {
                    Ok(g) => bw.push(json!({
                        "op": name, "size": size, "bytes": (total / size).max(64) * size,
                        "gbps": g, "memcpy_gbps": mc, "ratio_to_memcpy": g / mc,
                    })),
                    Err(e) => {
                        result = Err(format!("{name} {size} B: {e}"));
                        break;
                    }
                }
            }
            if result.is_err() {
                break;
            }
        }
        let mut lat = Vec::new();
        if result.is_ok() {
            for (name, op) in [("write", WrOpcode::RdmaWrite), ("read", WrOpcode::RdmaRead)] {
                match dp_lat(&a, op, &ml, &mr, iters) {
                    Ok((p50, p99)) => lat.push(json!({
                        "op": name, "size": 8, "iters": iters, "lat_us_p50": p50, "lat_us_p99": p99,
                    })),
                    Err(e) => {
                        result = Err(format!("{name} 8 B latency: {e}"));
                        break;
                    }
                }
            }
        }
        let t = Instant::now();
        for i in 0..iters {
            let off = (i * 4096) % (DP_ARENA - 8);
            rb[off..off + 8].copy_from_slice(std::hint::black_box(&la[off..off + 8]));
        }
        let memcpy_8b_ns = t.elapsed().as_nanos() as f64 / iters as f64;
        let _ = a.ctx.dereg_mr(ml.lkey);
        let _ = b.ctx.dereg_mr(mr.lkey);
        drop((a, b));
        Ok(json!({
            "link": "loopback (two mrkit0 instances in this process, one RC QP each, MTU 4096)",
            "arena_bytes": DP_ARENA,
            "bandwidth": bw,
            "latency": lat,
            "memcpy_8b_ns": memcpy_8b_ns,
            "error": result.err(),
        }))
    };
    run().unwrap_or_else(|e| json!({"bandwidth": [], "latency": [], "error": e}))
}

/// Two-process WRITE/READ over RoCEv2/UDP.
///
/// Full run: `mrkit bench transport --json` in a child process (which runs `mrkit perf --server`
/// in a grandchild and the clients itself, beside raw UDP floors and UCX). `--quick`: the same
/// server with this process as the client and fewer messages per point (`bench transport
/// --quick` alone takes about 30 s, mostly in its one-outstanding latency passes).
fn data_path_two_process(quick: bool) -> Value {
    use std::process::Stdio;
    let full = || -> Result<Value, String> {
        let mut c = helper_command(&["bench", "transport", "--json"])?;
        if quick {
            c.arg("--quick");
        }
        let mut child = c
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start `mrkit bench transport`: {e}"))?;
        let mut so = child.stdout.take().ok_or("no stdout")?;
        let mut se = child.stderr.take().ok_or("no stderr")?;
        let ro = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = std::io::Read::read_to_string(&mut so, &mut s);
            s
        });
        let re = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = std::io::Read::read_to_string(&mut se, &mut s);
            s
        });
        let limit = std::time::Duration::from_secs(if quick { 45 } else { 600 });
        let t = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().map_err(|e| e.to_string())? {
                break Some(s);
            }
            if t.elapsed() > limit {
                kill_group(&mut child);
                break None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let out = ro.join().unwrap_or_default();
        let err = re.join().unwrap_or_default();
        match status {
            None => Err(format!("timed out after {} s", limit.as_secs())),
            Some(s) if !s.success() => Err(format!(
                "`mrkit bench transport` failed ({s}): {}",
                err.trim()
            )),
            Some(_) => serde_json::from_str::<Value>(&out)
                .map_err(|e| format!("unparsable `mrkit bench transport --json` output: {e}")),
        }
    };
    let (client, result) = if quick {
        ("this process as the client", two_process_light())
    } else {
        ("a client", full())
    };
    match result {
        Ok(v) => json!({
            "transport": format!("RoCEv2/UDP between two processes (`mrkit perf --server` and {client}), loopback addresses"),
            "result": v,
            "error": null,
        }),
        Err(e) => {
            json!({"transport": "RoCEv2/UDP between two processes", "result": null, "error": e})
        }
    }
}

/// Bandwidth series for `data_bw.svg` (GB/s).
fn data_path_series<'a>(dp_in: &Value, dp_two: &Value) -> Vec<(&'a str, Vec<(u64, f64)>)> {
    let pick = |rows: &Value, op: &str, key: &str, scale: f64| -> Vec<(u64, f64)> {
        rows.as_array()
            .into_iter()
            .flatten()
            .filter(|r| r["op"] == op)
            .filter_map(|r| Some((r["size"].as_u64()?, r[key].as_f64()? * scale)))
            .filter(|(_, y)| *y > 0.0)
            .collect()
    };
    let bw = &dp_in["bandwidth"];
    let two = &dp_two["result"]["mrkit"];
    vec![
        ("in-process WRITE", pick(bw, "write", "gbps", 1.0)),
        ("in-process READ", pick(bw, "read", "gbps", 1.0)),
        (
            "memcpy (same arenas)",
            pick(bw, "write", "memcpy_gbps", 1.0),
        ),
        (
            "two-process WRITE (RoCEv2/UDP)",
            pick(two, "write", "bw_mbps", 1e-3),
        ),
        (
            "two-process READ (RoCEv2/UDP)",
            pick(two, "read", "bw_mbps", 1e-3),
        ),
    ]
    .into_iter()
    .filter(|(_, v)| !v.is_empty())
    .collect()
}

/// One row of a markdown table: `| a | b | … |`.
fn md_row(s: &mut String, cells: &[String]) {
    use std::fmt::Write;
    let _ = writeln!(s, "| {} |", cells.join(" | "));
}

fn data_path_report(s: &mut String, dp: &Value) {
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

/// `mrkit <args>` (this executable) as a helper child: in its own process group, so that
/// [`kill_group`] also stops what it starts (a perf server); short-lived, so no statistics
/// files left behind; stdin closed.
fn helper_command(args: &[&str]) -> Result<std::process::Command, String> {
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut c = std::process::Command::new(exe);
    c.args(args)
        .process_group(0)
        .env("MRKIT_STAT", "0")
        .stdin(std::process::Stdio::null());
    Ok(c)
}

/// Kill the process group of a [`helper_command`] child and the child itself, and reap it.
fn kill_group(child: &mut std::process::Child) {
    if let Some(pg) = rustix::process::Pid::from_raw(child.id() as i32) {
        let _ = rustix::process::kill_process_group(pg, rustix::process::Signal::KILL);
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// `--quick` two-process run: `mrkit perf --server` in a child, the clients here.
fn two_process_light() -> Result<Value, String> {
    use super::perf::{run_client_with, Op};
    use std::process::Stdio;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let server_addr = "127.79.0.1";
    // Each bandwidth point, two latency runs, the start-up probe and the warm-up.
    let runs = DP_SIZES.len() * 2 + 2 + 2;
    let server = helper_command(&["perf", "--server", "--addr", server_addr, "--port"])?
        .arg(port.to_string())
        .args(["--count", &runs.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start `mrkit perf --server`: {e}"))?;
    struct Reap(std::process::Child);
    impl Drop for Reap {
        fn drop(&mut self) {
            kill_group(&mut self.0);
        }
    }
    let _server = Reap(server);
    let end = Instant::now() + std::time::Duration::from_secs(10);
    while std::net::TcpStream::connect(std::net::SocketAddr::from(([127, 79, 0, 1], port))).is_err()
    {
        if Instant::now() > end {
            return Err("perf server did not start".into());
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let next = std::cell::Cell::new(2u8);
    let one = |op: Op, size: u64, iters: u32| -> Result<Value, String> {
        let ip = format!("127.79.0.{}", next.get());
        next.set(next.get() + 1);
        let r = run_client_with(server_addr, port, Some(&ip), op, size, iters, 32)
            .map_err(|e| format!("{op:?} {size} B: {e:#}"))?;
        serde_json::to_value(r).map_err(|e| e.to_string())
    };
    let _ = one(Op::Write, 8, 20); // warm-up (and the connection the probe consumed)
    let mut rows = Vec::new();
    for op in [Op::Write, Op::Read] {
        for &size in &DP_SIZES {
            let iters = ((16u64 << 20) / size as u64).clamp(200, 2000) as u32;
            rows.push(one(op, size as u64, iters)?);
        }
    }
    let wlat = one(Op::Write, 8, 500)?;
    let slat = one(Op::Send, 8, 500)?;
    Ok(json!({
        "raw_udp_gso_mbps": null,
        "raw_udp_gso_gro_mbps": null,
        "raw_udp_gso_gro_copy_icrc_mbps": null,
        "raw_udp_pingpong_rtt_us": null,
        "mrkit": rows,
        "write_lat": wlat,
        "send_lat": slat,
        "ucx_tcp_put_bw_64k_mbps": null,
        "ucx_tcp_am_lat_8b_us_one_way": null,
    }))
}
