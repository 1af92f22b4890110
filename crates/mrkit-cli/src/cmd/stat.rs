//! `mrkit stat`: live counters of running processes that use mrkit (like `rdma stat show mr`).
//!
//! Reads the per-process files written by `mrkit::stat_export` (see its docs for the design).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use mrkit::stat_export;
use serde_json::{json, Value};

use super::human;
use crate::exit;

#[derive(Args, Debug)]
#[command(
    after_help = "Examples:\n  mrkit stat\n  mrkit stat --pid 4242 --json\n  mrkit stat --watch 1\n\nProcesses appear once they open a device (mrkit::Context::open starts the export; MRKIT_STAT=0
disables it).\nFiles live in $MRKIT_STAT_DIR, else $XDG_RUNTIME_DIR/mrkit, else /tmp/mrkit-$UID; other users'\nprocesses are visible only if their owner exported with MRKIT_STAT_SHARE=1."
)]
pub struct StatArgs {
    /// Only this process.
    #[arg(long)]
    pid: Option<u32>,
    /// Refresh every SECONDS, in place (JSON: one document per line).
    #[arg(long, value_name = "SECONDS")]
    watch: Option<f64>,
    /// Read stat files from this directory instead of the default runtime directories.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Also show files of processes that have exited.
    #[arg(long)]
    all: bool,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

/// Hidden helper for tests and demos: register some memory, export statistics, wait.
#[derive(Args, Debug)]
pub struct HoldArgs {
    /// How long to keep running.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// How many 64 KiB buffers to register.
    #[arg(long, default_value_t = 3)]
    regs: usize,
    /// Do not call `stat_export::install()`: rely on the export that opening a device starts.
    #[arg(long)]
    no_install: bool,
}

fn dirs(explicit: &Option<PathBuf>) -> Vec<PathBuf> {
    if let Some(d) = explicit {
        return vec![d.clone()];
    }
    let mut v = vec![stat_export::runtime_dir()];
    if std::env::var_os("MRKIT_STAT_DIR").is_some_and(|d| !d.is_empty()) {
        return v;
    }
    // Other users' shared exports live in /tmp/mrkit-<uid>.
    if let Ok(rd) = std::fs::read_dir("/tmp") {
        for e in rd.flatten() {
            let p = e.path();
            if p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.starts_with("mrkit-") && n[6..].chars().all(|c| c.is_ascii_digit())
            }) && !v.contains(&p)
            {
                v.push(p);
            }
        }
    }
    v
}

fn collect(a: &StatArgs) -> Vec<Value> {
    let mut targets: Vec<(PathBuf, u32)> = Vec::new();
    for d in dirs(&a.dir) {
        for pid in stat_export::list(&d) {
            if a.pid.map_or(true, |p| p == pid) {
                targets.push((d.clone(), pid));
            }
        }
    }
    // Ask everybody first so the exporters refresh in parallel.
    for (d, pid) in &targets {
        let _ = stat_export::request(d, *pid);
    }
    let mut out = Vec::new();
    for (d, pid) in targets {
        let first = stat_export::read(&d, pid);
        let alive = first.as_ref().map(stat_export::is_alive).unwrap_or(false);
        if !alive && !a.all {
            continue;
        }
        let r = if alive {
            stat_export::request_and_read(&d, pid, Duration::from_millis(2500))
        } else {
            first.map(|v| (v, false))
        };
        match r {
            Ok((mut v, fresh)) => {
                v["alive"] = json!(alive);
                v["fresh"] = json!(fresh);
                v["dir"] = json!(d.display().to_string());
                out.push(v);
            }
            Err(e) => tracing::info!(pid, error = %e, "unreadable stat file"),
        }
    }
    out
}

fn ns(v: u64) -> String {
    if v >= 1_000_000 {
        format!("{:.1} ms", v as f64 / 1e6)
    } else if v >= 1000 {
        format!("{:.1} µs", v as f64 / 1e3)
    } else {
        format!("{v} ns")
    }
}

fn print_text(procs: &[Value], dirs: &[PathBuf]) {
    if procs.is_empty() {
        crate::outln!(
            "no mrkit process exports statistics (looked in {})",
            dirs.iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
        return;
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    for p in procs {
        let u = |k: &str| p[k].as_u64().unwrap_or(0);
        let age = now.saturating_sub(u("updated_unix_ms")) as f64 / 1000.0;
        crate::outln!(
            "pid {} ({}) {}  updated {age:.1} s ago",
            u("pid"),
            p["comm"].as_str().unwrap_or("?"),
            if p["alive"] == true {
                "[running]"
            } else {
                "[exited]"
            }
        );
        let fails: Vec<String> = p["failures"]
            .as_object()
            .map(|m| {
                m.iter()
                    .filter(|(_, c)| c.as_u64().unwrap_or(0) > 0)
                    .map(|(k, c)| format!("{k}={c}"))
                    .collect()
            })
            .unwrap_or_default();
        crate::outln!(
            "  mr: live {}  registered {}  deregistered {}  failed {}",
            u("mrs_live"),
            u("registrations"),
            u("deregistrations"),
            if fails.is_empty() {
                "0".to_string()
            } else {
                fails.join(" ")
            }
        );
        crate::outln!(
            "  pinned {} (peak {})  translation entries {}  pins io_uring {} mlock {}  odp faults {}",
            human(u("pinned_bytes")),
            human(u("pinned_bytes_peak")),
            u("mtt_used"),
            u("pins_io_uring"),
            u("pins_mlock"),
            u("odp_faults")
        );
        let l = &p["latency_ns"];
        crate::outln!(
            "  reg latency p50 {} p99 {} (n={})",
            ns(l["p50"].as_u64().unwrap_or(0)),
            ns(l["p99"].as_u64().unwrap_or(0)),
            l["count"].as_u64().unwrap_or(0)
        );
        if let Some(m) = p["sources"].as_object() {
            for (k, v) in m {
                crate::outln!("  {k}: {v}");
            }
        }
    }
}

fn once(a: &StatArgs) -> (Vec<Value>, Vec<PathBuf>) {
    (collect(a), dirs(&a.dir))
}

pub fn run(a: StatArgs) -> u8 {
    if let Some(w) = a.watch {
        if !(w > 0.0 && w.is_finite()) {
            eprintln!("mrkit stat: --watch needs a positive number of seconds");
            return exit::USAGE;
        }
        loop {
            let (procs, ds) = once(&a);
            if a.json {
                crate::outln!("{}", json!({"processes": procs}));
            } else {
                crate::out!("\x1b[2J\x1b[H");
                crate::outln!("mrkit stat (every {w} s, Ctrl-C to stop)\n");
                print_text(&procs, &ds);
            }
            crate::out::flush();
            std::thread::sleep(Duration::from_secs_f64(w));
        }
    }
    let (procs, ds) = once(&a);
    if a.json {
        crate::outln!(
            "{}",
            serde_json::to_string_pretty(&json!({"processes": procs})).expect("json")
        );
    } else {
        print_text(&procs, &ds);
    }
    if a.pid.is_some() && procs.is_empty() {
        eprintln!("mrkit stat: no statistics for pid {}", a.pid.unwrap_or(0));
        return exit::VERB_FAILED;
    }
    exit::OK
}

/// `mrkit __stat-hold`: a process that registers memory and exports its statistics.
pub fn hold(a: HoldArgs) -> u8 {
    let ctx = match mrkit::Context::open_default() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("mrkit: {e}");
            return exit::USAGE;
        }
    };
    let pd = match ctx.alloc_pd() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("mrkit: {e}");
            return exit::VERB_FAILED;
        }
    };
    let mut mrs = Vec::new();
    for _ in 0..a.regs {
        let b = mrkit::Buffer::with_options(
            64 << 10,
            mrkit::BufferOptions {
                populate: true,
                ..Default::default()
            },
        )
        .expect("alloc");
        match pd.register(b, mrkit::AccessFlags::LOCAL_WRITE) {
            Ok(m) => mrs.push(m),
            Err(e) => eprintln!("mrkit: {e}"),
        }
    }
    // One deliberate failure, so the failure counters show something.
    let _ = pd.register(
        mrkit::Buffer::new(4096).expect("alloc"),
        mrkit::AccessFlags::REMOTE_WRITE,
    );
    stat_export::register_source("hold", || json!({"note": "mrkit __stat-hold test helper"}));
    let installed = if a.no_install {
        // Context::open_default above started it (unless MRKIT_STAT=0): ask where it writes.
        Ok(Some(stat_export::stat_path(
            &stat_export::runtime_dir(),
            std::process::id(),
        ))
        .filter(|p| p.exists()))
    } else {
        stat_export::install()
    };
    match installed {
        Ok(Some(p)) => crate::outln!("{}", p.display()),
        Ok(None) => crate::outln!("disabled"),
        Err(e) => {
            eprintln!("mrkit: stat export: {e}");
            return exit::VERB_FAILED;
        }
    }
    crate::out::flush();
    std::thread::sleep(Duration::from_secs_f64(a.seconds.max(0.0)));
    drop(mrs);
    stat_export::shutdown();
    exit::OK
}
