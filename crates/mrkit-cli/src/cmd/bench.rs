//! `mrkit bench`: the seeds' experiments as one suite, with a Markdown report, SVG plots and
//! the raw figures as JSON.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use mrkit::{AccessFlags, Buffer, BufferOptions};
use mrkit_soft::mem::pin::{self, PinPath};
use mrkit_soft::mr::KeyUse;
use mrkit_soft::{Context, DeviceConfig};
use serde_json::{json, Value};

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

fn reg_point(ctx: &Context, pd: u32, buf: &Buffer, thp: bool) -> Point {
    let size = buf.len() as u64;
    let mut regs = Vec::new();
    let mut deregs = Vec::new();
    let mut info = (0, 0);
    for _ in 0..reps_for(size) {
        let t = Instant::now();
        let r = ctx.reg_mr_va(pd, buf.addr(), size, AccessFlags::LOCAL_WRITE);
        let reg = t.elapsed().as_nanos() as u64;
        match r {
            Ok(mr) => {
                info = (mr.page_size, mr.entries);
                let t = Instant::now();
                let _ = ctx.dereg_mr(mr.lkey);
                deregs.push(t.elapsed().as_nanos() as u64);
                regs.push(reg);
            }
            Err(e) => {
                return Point {
                    size,
                    page: if thp { "thp" } else { "4k" },
                    reg_ns: None,
                    dereg_ns: None,
                    page_size_seen: 0,
                    entries: 0,
                    error: Some(e.to_string()),
                }
            }
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
        .x_desc("buffer size")
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
    use mrkit::cache::{CacheConfig, MonitorMode, RegCache};
    let run = || -> Result<Value, String> {
        let ctx = mrkit::Context::open(DeviceConfig::rxe());
        let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
        let cache = RegCache::new(
            &pd,
            CacheConfig {
                max_entries,
                monitor: MonitorMode::ExplicitOnly,
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
                .get(b.addr(), 64 << 10, AccessFlags::LOCAL_WRITE)
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
        Some(b) => b,
        None => return pm_failed(n, 0.0, Some("allocation failed".into())),
    };
    let t = Instant::now();
    for i in 0..n {
        let off = (i % 256) * 4096;
        match ctx.reg_mr_va(
            pd,
            slab.addr() + off,
            4096,
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
        slab.addr(),
        1 << 20,
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
    let steps = sizes.len() as u64 * 2 + 3;
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
            let Some(buf) = alloc(size, thp) else {
                points.push(Point {
                    size,
                    page: if thp { "thp" } else { "4k" },
                    reg_ns: None,
                    dereg_ns: None,
                    page_size_seen: 0,
                    entries: 0,
                    error: Some("allocation failed".into()),
                });
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
    if let Err(e) = plot(
        &a.out.join("reg_cost.svg"),
        "registration cost vs size",
        "µs (median)",
        &lat,
    ) {
        notes.push(format!("reg_cost.svg not drawn: {e}"));
    }
    if let Err(e) = plot(
        &a.out.join("reg_throughput.svg"),
        "registration throughput",
        "GiB/s",
        &thr,
    ) {
        notes.push(format!("reg_throughput.svg not drawn: {e}"));
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
    notes.push("data path (WRITE/READ bandwidth and latency, in-process and two-process): not measured yet; mrkit0's QP \
                data path was being written when this suite was, and is not wired into it."
        .into());

    let raw = json!({
        "schema": "mrkit-bench/1",
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
        "data_path": Value::Null,
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
    println!(
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
    let _ = writeln!(s, "`mrkit::cache::RegCache` (page-rounded entries, explicit invalidation), lookups of 64 KiB buffers in a scrambled order; each lookup is `get` + drop of the handle.\n");
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
    let _ = writeln!(s, "\n## Not measured\n");
    for n in raw["notes"].as_array().into_iter().flatten() {
        let _ = writeln!(s, "- {}", n.as_str().unwrap_or(""));
    }
    let _ = writeln!(
        s,
        "\nRaw figures: `raw.json` (schema `mrkit-bench/1`, see docs/cli.md)."
    );
    s
}
