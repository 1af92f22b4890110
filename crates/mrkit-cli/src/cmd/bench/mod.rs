//! `mrkit bench`: the seeds' experiments as one suite, with a Markdown report, SVG plots and
//! the raw figures as JSON.
//!
//! One file per concern: the experiments (`registration`, `per_message`, `data_path`,
//! `two_process`), the outputs (`markdown`, `svg`), the child processes (`child`); this file
//! parses the arguments, runs the suite and assembles `raw.json`.

mod child;
mod data_path;
mod markdown;
mod per_message;
mod registration;
mod svg;
mod two_process;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use mrkit_soft::mem::pin::{self, PinPath};
use mrkit_soft::DeviceConfig;
use serde_json::{json, Value};

use super::human;
use crate::exit;
use data_path::data_path_in_process;
use markdown::report;
use per_message::{cache_scenario, per_message};
use registration::{alloc, floor_point, reg_point, reps_for, Point};
use two_process::data_path_two_process;

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
        /// A tenth of the iterations and a short re-warm (every key, noisier figures; for CI).
        #[arg(long)]
        quick: bool,
    },
}

/// Schema of `raw.json` (version 2 added `data_path`).
pub const SCHEMA: &str = "mrkit-bench/2";

/// `mrkit bench`: a subcommand, or the whole suite into `--out` (the exit status).
pub fn run(a: BenchArgs, dev: &super::device::Selected) -> u8 {
    if let Some(BenchSub::PoolCache { json, quick }) = a.sub {
        // Every experiment of the pool and the cache runs through the generic API; mrkit0
        // with its built-in (rxe) limits by default, as the suite below.
        let ctx = if dev.is_embedded() {
            mrkit::Context::open(DeviceConfig::rxe())
        } else {
            match dev.open("bench pool-cache") {
                Ok(c) => c,
                Err(code) => return code,
            }
        };
        return super::bench_pool_cache::run(json, quick, &ctx);
    }
    if let Some(BenchSub::Transport { json, quick }) = a.sub {
        return super::bench_transport::run(json, quick, dev);
    }
    // The registration experiments run on the selected device through the generic API; the
    // default is mrkit0 with its built-in (rxe) limits, whatever MRKIT_* says.
    let ctx = if dev.is_embedded() {
        mrkit::Context::open(DeviceConfig::rxe())
    } else {
        match dev.open("bench") {
            Ok(c) => c,
            Err(code) => return code,
        }
    };
    let embedded = ctx.soft().is_some();
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
    let pd = match ctx.provider().alloc_pd() {
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
    let cache_fit = cache_scenario(&ctx, 32, 1024, messages);
    pb.inc(1);
    pb.set_message("registration cache: working set twice the cache");
    let cache_thrash = cache_scenario(&ctx, 32, 16, messages);
    pb.inc(1);
    pb.set_message("registration cache: hits by working-set size");
    // The hit sweep and the data path measure mrkit0's own paths.
    let mrkit0_only =
        || json!({"error": format!("measured on mrkit0 only, not on {}", dev.name())});
    let cache_hits = if !embedded {
        mrkit0_only()
    } else if a.quick {
        super::bench_pool_cache::sweep_json(&[1, 64, 4096], super::bench_pool_cache::Effort::QUICK)
    } else {
        super::bench_pool_cache::sweep_json(
            &super::bench_pool_cache::SWEEP_SIZES,
            super::bench_pool_cache::Effort::FULL,
        )
    };
    pb.inc(1);
    pb.set_message("data path in process: WRITE/READ over the loopback link");
    let dp_in = if embedded {
        data_path_in_process(a.quick)
    } else {
        mrkit0_only()
    };
    pb.inc(1);
    pb.set_message("data path between two processes: WRITE/READ over RoCEv2/UDP");
    let dp_two = if embedded {
        data_path_two_process(a.quick)
    } else {
        mrkit0_only()
    };
    pb.inc(1);
    pb.finish_and_clear();
    let elapsed = started.elapsed().as_secs_f64();

    let mut notes = svg::draw_plots(&a.out, &points, &floors, io_uring, &dp_in, &dp_two);
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

    let _ = ctx.provider().dealloc_pd(pd);
    let raw = raw_json(
        &a,
        &ctx,
        elapsed,
        io_uring,
        &points,
        &floors,
        &pm,
        [cache_fit, cache_thrash, cache_hits],
        [dp_in, dp_two],
        notes,
    );
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

/// `raw.json`: every figure of the run (schema [`SCHEMA`]).
#[allow(clippy::too_many_arguments)]
fn raw_json(
    a: &BenchArgs,
    ctx: &mrkit::Context,
    elapsed: f64,
    io_uring: bool,
    points: &[Point],
    floors: &[registration::Floor],
    pm: &per_message::PerMessage,
    [cache_fit, cache_thrash, cache_hits]: [Value; 3],
    [dp_in, dp_two]: [Value; 2],
    notes: Vec<String>,
) -> Value {
    json!({
        "schema": SCHEMA,
        "quick": a.quick,
        "elapsed_s": elapsed,
        "device": ctx.name(),
        "device_profile": ctx.soft().map(|_| "rxe"),
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
    })
}
