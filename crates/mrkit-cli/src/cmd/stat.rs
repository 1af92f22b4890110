//! `mrkit stat`: live counters of running processes that use mrkit (like `rdma stat show mr`).
//!
//! Reads the per-process files written by `mrkit::stat_export` (see its docs for the design).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use mrkit::stat_export::{self, StatDir};
use serde_json::{json, Value};

use super::human;
use crate::exit;

#[derive(Args, Debug)]
#[command(
    after_help = "Examples:\n  mrkit stat\n  mrkit stat --pid 4242 --json\n  mrkit stat --watch 1\n  mrkit stat --counters --pid 4242\n  mrkit stat --counters --watch 1\n  mrkit stat --mrs --pid 4242\n  mrkit stat --kernel                      # every MR on the kernel's RDMA devices\n  mrkit stat --kernel --device mlx5_0\n\nProcesses appear once they open mrkit0 or an rdma-core device (programs on the drop-in libibverbs, on the mrkit crate,
and mrkit's own verbs); MRKIT_STAT=0 disables it.\nFiles live in $MRKIT_STAT_DIR, else $XDG_RUNTIME_DIR/mrkit, else /tmp/mrkit-$UID; other users'\nprocesses are visible only if their owner exported with MRKIT_STAT_SHARE=1."
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
    /// Show the port counters (rxe / IB / mlx5 names, like `rdma statistic show`); with
    /// --watch, their rates per second.
    #[arg(long)]
    counters: bool,
    /// List the live MRs (like `rdma resource show mr`).
    #[arg(long)]
    mrs: bool,
    /// List every MR of every process on the kernel's RDMA devices (real NICs, rxe, siw) from
    /// the kernel's RDMA netlink resource dump, as `rdma resource show mr` does; keys need
    /// CAP_NET_ADMIN. With --device, only that device.
    #[arg(long)]
    kernel: bool,
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

/// The directories to read, each opened and checked (see [`StatDir`]); a directory that fails
/// the checks is skipped with a warning on stderr. Also returns every path looked at.
fn dirs(explicit: &Option<PathBuf>) -> (Vec<StatDir>, Vec<PathBuf>) {
    let mut looked = Vec::new();
    let mut out = Vec::new();
    let mut add = |p: PathBuf, owner: Option<u32>, quiet_if_missing: bool| {
        if looked.contains(&p) {
            return;
        }
        match StatDir::open(&p, owner) {
            Ok(d) => out.push(d),
            Err(e) if quiet_if_missing && e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => eprintln!(
                "mrkit stat: warning: skipping {}: {}",
                escape(&p.display().to_string()),
                escape(&e.to_string())
            ),
        }
        looked.push(p);
    };
    if let Some(d) = explicit {
        add(d.clone(), None, false);
        return (out, looked);
    }
    let me = rustix::process::getuid().as_raw();
    let own = stat_export::runtime_dir();
    if std::env::var_os("MRKIT_STAT_DIR").is_some_and(|d| !d.is_empty()) {
        add(own, None, true);
        return (out, looked);
    }
    add(own, Some(me), true);
    // Other users' shared exports live in /tmp/mrkit-<uid>; the directory must belong to
    // that uid.
    let mut others: Vec<(u32, PathBuf)> = std::fs::read_dir("/tmp")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name();
            let uid: u32 = name.to_str()?.strip_prefix("mrkit-")?.parse().ok()?;
            // Canonical names only ("mrkit-007" is not uid 7's directory).
            (name.to_str()? == format!("mrkit-{uid}")).then(|| (uid, e.path()))
        })
        .collect();
    others.sort();
    for (uid, p) in others {
        add(p, Some(uid), true);
    }
    (out, looked)
}

fn collect(a: &StatArgs, dirs: &[StatDir]) -> Vec<Value> {
    // Read every file first (bounded, checked opens), then ask the running ones to refresh so
    // their exporters work in parallel, then wait for each.
    let mut found: Vec<(&StatDir, u32, Value, bool)> = Vec::new();
    for d in dirs {
        for pid in d.list() {
            if a.pid.is_some_and(|p| p != pid) {
                continue;
            }
            match d.read(pid) {
                Ok(v) => {
                    let alive = d.is_running(&v);
                    if alive || a.all {
                        found.push((d, pid, v, alive));
                    }
                }
                Err(e) => tracing::info!(
                    pid,
                    dir = %escape(&d.path().display().to_string()),
                    error = %escape(&e.to_string()),
                    "unreadable stat file"
                ),
            }
        }
    }
    let asked = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let requested: Vec<bool> = found
        .iter()
        .map(|(d, pid, _, alive)| *alive && d.request(*pid).is_ok())
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_millis(2500);
    let mut out = Vec::new();
    for ((d, pid, first, alive), requested) in found.into_iter().zip(requested) {
        let mut v = first;
        let mut fresh = false;
        if requested {
            loop {
                match d.read(pid) {
                    Ok(now) => v = now,
                    Err(e) => {
                        tracing::info!(pid, error = %escape(&e.to_string()), "stat file vanished");
                        break;
                    }
                }
                fresh = v["updated_unix_ms"].as_u64().unwrap_or(0) >= asked;
                if fresh || std::time::Instant::now() >= deadline {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        v["alive"] = json!(alive);
        v["fresh"] = json!(fresh);
        v["dir"] = json!(d.path().display().to_string());
        out.push(v);
    }
    out
}

/// `s` with control characters (and the bidirectional-text controls that reorder what a
/// terminal shows) escaped, so a process name or path can never drive the terminal.
pub(crate) fn escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        let bidi = matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        if c.is_control() || bidi {
            o.extend(c.escape_default());
        } else {
            o.push(c);
        }
    }
    o
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

/// The devices a process's file describes, as `(name, section)`: the exporting copy's
/// mrkit0 (the file's top level; left out when that copy opened no mrkit0 and has other
/// devices), the rdma-core provider's devices (`sources.rdma_core.devices`, named
/// `rdma-core:NAME`), and the same for every other copy of mrkit in the process that joined
/// the export (`copies`: e.g. the drop-in libibverbs' own mrkit0 inside an mrkit program).
fn sections(p: &Value) -> Vec<(String, &Value)> {
    fn one<'a>(v: &'a Value, copy: bool, out: &mut Vec<(String, &'a Value)>) {
        let rc: Vec<&Value> = v["sources"]["rdma_core"]["devices"]
            .as_array()
            .map(|a| a.iter().collect())
            .unwrap_or_default();
        if v["mrkit0_open"] != false || (rc.is_empty() && !copy) {
            let name = if copy {
                "mrkit0 (second copy of mrkit in this process)"
            } else {
                "mrkit0"
            };
            out.push((name.to_string(), v));
        }
        for d in rc {
            out.push((d["device"].as_str().unwrap_or("rdma-core:?").to_string(), d));
        }
    }
    let mut out = Vec::new();
    one(p, false, &mut out);
    for c in p["copies"].as_array().into_iter().flatten() {
        one(c, true, &mut out);
    }
    out
}

/// Print one line of text output, escaped (stat files are written by other processes).
macro_rules! say {
    ($($arg:tt)*) => {
        crate::outln!("{}", escape(&format!($($arg)*)))
    };
}

/// `rdma statistic show` style: `link mrkit0/1 pid P (comm) name value ...`, with rates
/// (per second, against `prev`) when watching.
fn print_counters(procs: &[Value], prev: Option<&[Value]>, dt: f64) {
    for p in procs {
        let copies: Vec<&Value> = sections(p)
            .into_iter()
            .filter(|(n, _)| n.starts_with("mrkit0"))
            .map(|(_, v)| v)
            .collect();
        for (k, c) in copies.iter().enumerate() {
            let prev_copy = prev.map(|ps| {
                ps.iter()
                    .filter(|q| q["pid"] == p["pid"])
                    .filter_map(|q| {
                        sections(q)
                            .into_iter()
                            .filter(|(n, _)| n.starts_with("mrkit0"))
                            .nth(k)
                            .map(|(_, v)| v.clone())
                    })
                    .collect::<Vec<Value>>()
            });
            print_counters_of(p, c, prev_copy.as_deref(), dt);
        }
    }
}

/// The counter line of one copy's mrkit0 (`c`) of process `p`.
fn print_counters_of(p: &Value, c: &Value, prev: Option<&[Value]>, dt: f64) {
    {
        let old = prev.and_then(|o| o.first());
        let c = &c["counters"];
        let Some(vals) = c["values"].as_object() else {
            say!("pid {}: no counters (an older mrkit)", p["pid"]);
            return;
        };
        let mut line = format!(
            "link {}/{} pid {} ({})",
            c["device"].as_str().unwrap_or("mrkit0"),
            c["port"].as_u64().unwrap_or(1),
            p["pid"],
            p["comm"].as_str().unwrap_or("?")
        );
        for (k, v) in vals {
            let now = v.as_u64().unwrap_or(0);
            match old.and_then(|o| o["counters"]["values"][k].as_u64()) {
                Some(before) if dt > 0.0 => {
                    let rate = now.saturating_sub(before) as f64 / dt;
                    line.push_str(&format!(" {k} {rate:.0}/s"));
                }
                _ => line.push_str(&format!(" {k} {now}")),
            }
        }
        say!("{line}");
    }
}

/// `rdma resource show mr` style, one line per MR.
fn print_mrs(procs: &[Value]) {
    for p in procs {
        for (dev, s) in sections(p) {
            print_mrs_of(p, &dev, s);
        }
    }
}

/// The MR lines of one device section `s` (named `dev`) of process `p`.
fn print_mrs_of(p: &Value, dev: &str, s: &Value) {
    let dev = dev.split(' ').next().unwrap_or(dev);
    {
        let m = &s["mrs"];
        let list = m["list"].as_array().cloned().unwrap_or_default();
        for mr in &list {
            let t = &mr["reg_timing_ns"];
            say!(
                "dev {dev} pid {} comm {} lkey {:#x} rkey {:#x} pdn {} iova {:#x} mrlen {} access {} page_size {} pinned {} kind {} age {:.1}s reg {}",
                p["pid"],
                p["comm"].as_str().unwrap_or("?"),
                mr["lkey"].as_u64().unwrap_or(0),
                mr["rkey"].as_u64().unwrap_or(0),
                mr["pd"].as_u64().unwrap_or(0),
                mr["iova"].as_u64().unwrap_or(0),
                mr["length"].as_u64().unwrap_or(0),
                mr["access"]
                    .as_array()
                    .map(|a| a.iter().filter_map(|s| s.as_str()).collect::<Vec<_>>().join(","))
                    .unwrap_or_default(),
                human(mr["page_size"].as_u64().unwrap_or(0)),
                human(mr["pinned_bytes"].as_u64().unwrap_or(0)),
                mr["kind"].as_str().unwrap_or("?"),
                mr["age_ms"].as_u64().unwrap_or(0) as f64 / 1000.0,
                t["total"].as_u64().map_or("?".to_string(), ns)
            );
        }
        let total = m["total"].as_u64().unwrap_or(0);
        if total > list.len() as u64 {
            say!(
                "pid {} dev {dev}: {} more MRs not listed",
                p["pid"],
                total - list.len() as u64
            );
        }
    }
}

fn print_selected(
    a: &StatArgs,
    procs: &[Value],
    dirs: &[PathBuf],
    prev: Option<&[Value]>,
    dt: f64,
) {
    if !(a.counters || a.mrs) || procs.is_empty() {
        print_text(procs, dirs);
        return;
    }
    if a.counters {
        print_counters(procs, prev, dt);
    }
    if a.mrs {
        print_mrs(procs);
    }
}

fn print_text(procs: &[Value], dirs: &[PathBuf]) {
    if procs.is_empty() {
        say!(
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
        say!(
            "pid {} ({}) {}  updated {age:.1} s ago",
            u("pid"),
            p["comm"].as_str().unwrap_or("?"),
            if p["alive"] == true {
                "[running]"
            } else {
                "[exited]"
            }
        );
        // The exporting copy's mrkit0 keeps the lines it always had; every other device gets
        // a `device NAME` header and its lines indented under it.
        let mut top_sources = true;
        for (k, (dev, sec)) in sections(p).into_iter().enumerate() {
            if dev.starts_with("mrkit0") {
                if k == 0 && dev == "mrkit0" {
                    print_mrkit0(sec, "  ");
                    print_sources(sec, "  ");
                    top_sources = false;
                } else {
                    say!("  device {dev}:");
                    print_mrkit0(sec, "    ");
                    print_sources(sec, "    ");
                }
            } else {
                print_rdma_core(&dev, sec);
            }
        }
        if top_sources {
            print_sources(p, "  ");
        }
        if let Some(h) = foreign_id_hint(p) {
            say!("  hint: {h}");
        }
    }
}

/// The text lines of one copy's mrkit0 (`v`: a file's top level or one of its `copies`).
fn print_mrkit0(v: &Value, ind: &str) {
    let u = |k: &str| v[k].as_u64().unwrap_or(0);
    say!(
        "{ind}mr: live {}  registered {}  deregistered {}  failed {}",
        u("mrs_live"),
        u("registrations"),
        u("deregistrations"),
        failures_text(v)
    );
    say!(
        "{ind}pinned {} (peak {})  translation entries {}  pins io_uring {} mlock {}  odp faults {}",
        human(u("pinned_bytes")),
        human(u("pinned_bytes_peak")),
        u("mtt_used"),
        u("pins_io_uring"),
        u("pins_mlock"),
        u("odp_faults")
    );
    let l = &v["latency_ns"];
    say!(
        "{ind}reg latency p50 {} p99 {} (n={})",
        ns(l["p50"].as_u64().unwrap_or(0)),
        ns(l["p99"].as_u64().unwrap_or(0)),
        l["count"].as_u64().unwrap_or(0)
    );
}

/// The sections a copy registered (`sources`), but the rdma-core devices (shown as devices).
fn print_sources(v: &Value, ind: &str) {
    if let Some(m) = v["sources"].as_object() {
        for (k, v) in m.iter().filter(|(k, _)| *k != "rdma_core") {
            say!("{ind}{k}: {v}");
        }
    }
}

/// The text lines of one rdma-core device section (`sources.rdma_core.devices[i]`).
fn print_rdma_core(dev: &str, d: &Value) {
    let u = |k: &str| d[k].as_u64().unwrap_or(0);
    say!("  device {dev} ({}):", d["library"].as_str().unwrap_or("?"));
    say!(
        "    mr: live {}  registered {}  deregistered {}  failed {}",
        u("mrs_live"),
        u("registrations"),
        u("deregistrations"),
        failures_text(d)
    );
    say!(
        "    bytes registered {} (live {})",
        human(u("bytes_registered")),
        human(u("bytes_live"))
    );
    let l = &d["latency_ns"];
    say!(
        "    ibv_reg_mr latency p50 {} p99 {} (n={})",
        ns(l["p50"].as_u64().unwrap_or(0)),
        ns(l["p99"].as_u64().unwrap_or(0)),
        l["count"].as_u64().unwrap_or(0)
    );
}

/// `EINVAL=1 ENOMEM=2`, or `0`.
fn failures_text(v: &Value) -> String {
    let fails: Vec<String> = v["failures"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter(|(_, c)| c.as_u64().unwrap_or(0) > 0)
                .map(|(k, c)| format!("{k}={c}"))
                .collect()
        })
        .unwrap_or_default();
    if fails.is_empty() {
        "0".to_string()
    } else {
        fails.join(" ")
    }
}

/// A hint for a process whose devices dropped packets whose IPv4 ICRC matches only a foreign
/// IP identification: a non-mrkit RoCE peer (rxe, a NIC), or a path that re-batches datagrams,
/// which the default exact ICRC check refuses.
fn foreign_id_hint(p: &Value) -> Option<String> {
    let n = p["sources"]["rx_drops"]["rx_icrc_foreign_id"].as_u64()?;
    (n > 0).then(|| {
        format!(
            "{n} packets carried an IPv4 ID no mrkit sender uses (a foreign RoCE peer such as \
             rxe or a NIC, or a path whose NIC re-batches datagrams): run this process with \
             MRKIT_ICRC_IPV4=solve to accept them (a weaker check, see docs/transport.md)"
        )
    })
}

fn once(a: &StatArgs) -> (Vec<Value>, Vec<PathBuf>) {
    let (ds, looked) = dirs(&a.dir);
    (collect(a, &ds), looked)
}

fn kernel(a: &StatArgs, dev: &super::device::Selected, explicit_device: bool) -> u8 {
    let mrs = match super::nldev::kernel_mrs() {
        Ok(m) => m,
        Err(e) => {
            eprintln!("mrkit stat --kernel: {e}");
            return exit::VERB_FAILED;
        }
    };
    let mrs: Vec<_> = mrs
        .into_iter()
        .filter(|m| !explicit_device || m.dev == dev.device())
        .filter(|m| a.pid.is_none_or(|p| m.pid == Some(p)))
        .collect();
    if a.json {
        let v: Vec<Value> = mrs
            .iter()
            .map(|m| json!({"dev": m.dev, "pid": m.pid, "kern_name": m.kern_name, "length": m.length,
                             "lkey": m.lkey, "rkey": m.rkey, "iova": m.iova, "mrn": m.mrn, "pdn": m.pdn}))
            .collect();
        crate::outln!(
            "{}",
            serde_json::to_string_pretty(&json!({"kernel_mrs": v})).expect("json")
        );
        return exit::OK;
    }
    let hex = |k: Option<u32>| k.map_or("-".to_string(), |k| format!("{k:#x}"));
    for m in &mrs {
        let comm = m
            .pid
            .and_then(|p| std::fs::read_to_string(format!("/proc/{p}/comm")).ok())
            .map(|c| c.trim().to_string())
            .or_else(|| m.kern_name.clone())
            .unwrap_or_else(|| "?".into());
        say!(
            "dev {} mrn {} rkey {} lkey {} mrlen {} pdn {} pid {} comm {}",
            m.dev,
            m.mrn.map_or("-".into(), |v| v.to_string()),
            hex(m.rkey),
            hex(m.lkey),
            m.length.map_or("-".into(), |v| v.to_string()),
            m.pdn.map_or("-".into(), |v| v.to_string()),
            m.pid.map_or("[kernel]".into(), |v| v.to_string()),
            comm
        );
    }
    if mrs.is_empty() {
        say!("no MRs on the kernel's RDMA devices");
    }
    exit::OK
}

pub fn run(a: StatArgs, dev: &super::device::Selected) -> u8 {
    if a.kernel || !dev.is_embedded() {
        // A kernel device's MRs come from the kernel; mrkit0's from the processes' exports.
        return kernel(&a, dev, !dev.is_embedded());
    }
    if let Some(w) = a.watch {
        if !(w > 0.0 && w.is_finite()) {
            eprintln!("mrkit stat: --watch needs a positive number of seconds");
            return exit::USAGE;
        }
        let mut prev: Option<(Vec<Value>, std::time::Instant)> = None;
        loop {
            let (procs, ds) = once(&a);
            let now = std::time::Instant::now();
            if a.json {
                crate::outln!("{}", json!({"processes": procs}));
            } else {
                crate::out!("\x1b[2J\x1b[H");
                crate::outln!("mrkit stat (every {w} s, Ctrl-C to stop)\n");
                let dt = prev
                    .as_ref()
                    .map_or(0.0, |(_, t)| now.duration_since(*t).as_secs_f64());
                print_selected(&a, &procs, &ds, prev.as_ref().map(|(p, _)| &p[..]), dt);
            }
            crate::out::flush();
            prev = Some((procs, now));
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
        print_selected(&a, &procs, &ds, None, 0.0);
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

#[cfg(test)]
mod hint_tests {
    use super::foreign_id_hint;
    use serde_json::json;

    #[test]
    fn foreign_ids_get_a_hint_and_nothing_else_does() {
        let with =
            |n: u64| json!({"sources": {"rx_drops": {"rx_icrc_foreign_id": n, "rx_bad_icrc": 9}}});
        let h = foreign_id_hint(&with(3)).expect("a hint");
        assert!(
            h.starts_with("3 packets") && h.contains("MRKIT_ICRC_IPV4=solve"),
            "{h}"
        );
        assert_eq!(foreign_id_hint(&with(0)), None);
        assert_eq!(foreign_id_hint(&json!({"sources": {}})), None);
        assert_eq!(foreign_id_hint(&json!({})), None);
    }
}
