//! Live statistics for `mrkit stat`: a per-process file under a runtime directory.
//!
//! # Design: no cost when nobody reads
//!
//! [`install`] writes one snapshot to `<dir>/<pid>.stat` (so readers can discover the process),
//! creates the request file `<dir>/<pid>.req` and starts one background thread (`mrkit-stat`).
//! The thread wakes once per interval (default 1 s, `MRKIT_STAT_INTERVAL_MS`) and makes **one
//! `stat()` call** on the request file. Only when a reader touched (wrote) the request file within
//! the last [`ACTIVE_WINDOW`] does it take a snapshot of the counters and rewrite the stat file
//! (write to `<pid>.stat.tmp`, then `rename`, so readers never see a torn file). With nobody
//! reading, the cost is one `stat()` per second and no write; the registration path itself only
//! pays the relaxed atomic adds it already pays for [`mrkit_soft::stats`].
//!
//! A reader ([`request`] then [`read`], or `mrkit stat`) writes one byte to the request file,
//! waits until the stat file is newer than its request, and parses it. `mrkit stat --watch`
//! keeps re-touching the request file, so the exporter keeps refreshing.
//!
//! # Directory and permissions
//!
//! * `$MRKIT_STAT_DIR` if set, else `$XDG_RUNTIME_DIR/mrkit` if `XDG_RUNTIME_DIR` is set, else
//!   `/tmp/mrkit-$UID`. The directory is created with mode 0755 and must be owned by this user
//!   (a directory planted by another user is refused).
//! * Files are mode **0600**: only the owner (and root) can read the counters. The owner can allow
//!   others with `MRKIT_STAT_SHARE=1` or [`ExportOptions::share`]: the stat file becomes 0644 and
//!   the request file 0666 (so another user's reader can ask for refreshes). Note that
//!   `$XDG_RUNTIME_DIR` itself is normally 0700: to share, export into `/tmp/mrkit-$UID`
//!   (unset `XDG_RUNTIME_DIR`) or set `MRKIT_STAT_DIR`.
//! * `MRKIT_STAT=0` makes [`install`] a no-op.
//!
//! The file records the process start time (`/proc/<pid>/stat` field 22), so a reader can tell
//! a stale file of a dead process (or of a recycled pid) from a live one; [`shutdown`] removes
//! the files at a clean exit.
//!
//! # Adding counters
//!
//! Services (MR pool, registration cache, ...) add their own section with [`register_source`]:
//!
//! ```
//! mrkit::stat_export::register_source("example", || serde_json::json!({"hits": 1}));
//! let snap = mrkit::stat_export::snapshot();
//! assert_eq!(snap["sources"]["example"]["hits"], 1);
//! ```
//!
//! # File format (`schema` = `"mrkit-stat/1"`)
//!
//! One JSON object; see `docs/cli.md` ("mrkit stat") for the field list. Fields are only ever
//! added, never renamed or removed, within schema version 1.
#![forbid(unsafe_code)]

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use mrkit_soft::stats::{self, Histogram};
use serde_json::{json, Map, Value};

/// Schema identifier written into every stat file.
pub const SCHEMA: &str = "mrkit-stat/1";

/// A request younger than this keeps the exporter writing snapshots.
pub const ACTIVE_WINDOW: Duration = Duration::from_secs(5);

/// Default wake-up interval of the exporter thread.
pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(1000);

type SourceFn = fn() -> Value;

fn sources() -> &'static Mutex<Vec<(&'static str, SourceFn)>> {
    static S: OnceLock<Mutex<Vec<(&'static str, SourceFn)>>> = OnceLock::new();
    S.get_or_init(|| Mutex::new(Vec::new()))
}

/// Add (or replace) a named section of the snapshot, e.g. `"pool"` or `"cache"`. The function
/// is only called when a snapshot is taken (when somebody reads), so it may take locks.
pub fn register_source(name: &'static str, f: fn() -> Value) {
    let mut s = sources().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(slot) = s.iter_mut().find(|(n, _)| *n == name) {
        slot.1 = f;
    } else {
        s.push((name, f));
    }
}

/// Where the exporter writes.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// Runtime directory (default: [`runtime_dir`]).
    pub dir: PathBuf,
    /// Let other users read the counters (stat file 0644, request file 0666).
    pub share: bool,
    /// Wake-up interval of the exporter thread.
    pub interval: Duration,
}

impl ExportOptions {
    /// Options from the environment: `MRKIT_STAT_DIR`, `MRKIT_STAT_SHARE`, `MRKIT_STAT_INTERVAL_MS`.
    pub fn from_env() -> ExportOptions {
        let share = matches!(
            std::env::var("MRKIT_STAT_SHARE").as_deref(),
            Ok("1") | Ok("yes") | Ok("true") | Ok("on")
        );
        let interval = std::env::var("MRKIT_STAT_INTERVAL_MS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map(|ms| Duration::from_millis(ms.max(10)))
            .unwrap_or(DEFAULT_INTERVAL);
        ExportOptions {
            dir: runtime_dir(),
            share,
            interval,
        }
    }
}

/// This user's runtime directory for stat files (see the module docs).
pub fn runtime_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("MRKIT_STAT_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(x) = std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        return Path::new(&x).join("mrkit");
    }
    PathBuf::from(format!("/tmp/mrkit-{}", uid()))
}

fn uid() -> u32 {
    rustix::process::getuid().as_raw()
}

/// Path of the stat file of `pid` in `dir`.
pub fn stat_path(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("{pid}.stat"))
}

/// Path of the request file of `pid` in `dir`.
pub fn req_path(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("{pid}.req"))
}

struct Exporter {
    opts: ExportOptions,
    /// Set by `shutdown` while it holds the exporter lock; the thread re-checks it under the
    /// same lock before each write, so no snapshot lands after the files were removed.
    stop: AtomicBool,
}

fn exporter() -> &'static Mutex<Option<&'static Exporter>> {
    static E: OnceLock<Mutex<Option<&'static Exporter>>> = OnceLock::new();
    E.get_or_init(|| Mutex::new(None))
}

/// Start exporting with [`ExportOptions::from_env`] (no-op with `MRKIT_STAT=0`). Idempotent:
/// a second call returns the path of the running exporter. Returns the stat file path, or
/// `None` when disabled.
pub fn install() -> io::Result<Option<PathBuf>> {
    if matches!(
        std::env::var("MRKIT_STAT").as_deref(),
        Ok("0") | Ok("off") | Ok("no")
    ) {
        return Ok(None);
    }
    install_with(ExportOptions::from_env()).map(Some)
}

/// Start exporting with explicit options (idempotent; the first options win).
pub fn install_with(opts: ExportOptions) -> io::Result<PathBuf> {
    let mut g = exporter().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(e) = *g {
        if !e.stop.load(Ordering::Relaxed) {
            return Ok(stat_path(&e.opts.dir, std::process::id()));
        }
    }
    prepare_dir(&opts.dir)?;
    remove_dead(&opts.dir);
    let pid = std::process::id();
    let req = req_path(&opts.dir, pid);
    // The request file exists from the start so that readers of other users (share mode) only
    // need write permission on it, not on the directory.
    let _ = fs::remove_file(&req);
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(if opts.share { 0o666 } else { 0o600 })
        .open(&req)?;
    // create_new applies the umask: set the mode explicitly.
    fs::set_permissions(
        &req,
        fs::Permissions::from_mode(if opts.share { 0o666 } else { 0o600 }),
    )?;
    // The first snapshot, so readers can find this process.
    write_snapshot(&opts)?;
    let e: &'static Exporter = Box::leak(Box::new(Exporter {
        opts: opts.clone(),
        stop: AtomicBool::new(false),
    }));
    *g = Some(e);
    std::thread::Builder::new()
        .name("mrkit-stat".into())
        .spawn(move || run(e))?;
    tracing::debug!(dir = %opts.dir.display(), share = opts.share, "stat export installed");
    Ok(stat_path(&opts.dir, pid))
}

/// Stop the exporter thread and remove this process's files (call at a clean exit).
pub fn shutdown() {
    let mut g = exporter().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(e) = g.take() {
        e.stop.store(true, Ordering::Relaxed);
        let pid = std::process::id();
        let _ = fs::remove_file(stat_path(&e.opts.dir, pid));
        let _ = fs::remove_file(req_path(&e.opts.dir, pid));
    }
}

fn prepare_dir(dir: &Path) -> io::Result<()> {
    match fs::DirBuilder::new()
        .mode(0o755)
        .recursive(true)
        .create(dir)
    {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let m = fs::symlink_metadata(dir)?;
    if !m.is_dir() {
        return Err(io::Error::other(format!(
            "{} is not a directory",
            dir.display()
        )));
    }
    if m.uid() != uid() {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} is owned by uid {}, not by this user ({}); refusing to export there",
                dir.display(),
                m.uid(),
                uid()
            ),
        ));
    }
    Ok(())
}

fn run(e: &'static Exporter) {
    let req = req_path(&e.opts.dir, std::process::id());
    while !e.stop.load(Ordering::Relaxed) {
        std::thread::sleep(e.opts.interval);
        if e.stop.load(Ordering::Relaxed) {
            break;
        }
        // The whole idle cost: one stat() per interval.
        let wanted = fs::metadata(&req)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| {
                SystemTime::now()
                    .duration_since(t)
                    .ok()
                    .or(Some(Duration::ZERO))
            })
            .is_some_and(|age| age <= ACTIVE_WINDOW);
        if wanted {
            // Write under the exporter lock and re-check `stop` there, so a snapshot can never
            // land after `shutdown` removed the file.
            let _g = exporter().lock().unwrap_or_else(|p| p.into_inner());
            if e.stop.load(Ordering::Relaxed) {
                break;
            }
            if let Err(err) = write_snapshot(&e.opts) {
                tracing::debug!(error = %err, "stat export write failed");
            }
        }
    }
}

fn write_snapshot(opts: &ExportOptions) -> io::Result<()> {
    let pid = std::process::id();
    let path = stat_path(&opts.dir, pid);
    let tmp = opts.dir.join(format!("{pid}.stat.tmp"));
    let mode = if opts.share { 0o644 } else { 0o600 };
    let mut v = snapshot();
    v["interval_ms"] = json!(opts.interval.as_millis() as u64);
    v["shared"] = json!(opts.share);
    let _ = fs::remove_file(&tmp);
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)?;
    f.write_all(
        serde_json::to_string(&v)
            .map_err(io::Error::other)?
            .as_bytes(),
    )?;
    f.write_all(b"\n")?;
    drop(f);
    fs::set_permissions(&tmp, fs::Permissions::from_mode(mode))?;
    fs::rename(&tmp, &path)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Start time of a process in clock ticks since boot (`/proc/<pid>/stat` field 22).
pub fn process_start_time(pid: u32) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // comm may contain spaces and parentheses: split after the last ')'.
    let rest = &s[s.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

fn comm() -> String {
    fs::read_to_string("/proc/self/comm")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The snapshot the exporter would write now (process-wide counters of every device instance
/// of this process, plus the registered sources).
pub fn snapshot() -> Value {
    let s = stats::process().snapshot();
    let failures: Map<String, Value> = s
        .failures
        .iter()
        .map(|(n, c)| (n.to_string(), json!(c)))
        .collect();
    let count: u64 = s.reg_latency.iter().sum();
    let mut srcs = Map::new();
    let list: Vec<(&'static str, SourceFn)> =
        sources().lock().unwrap_or_else(|e| e.into_inner()).clone();
    for (name, f) in list {
        srcs.insert(name.to_string(), f());
    }
    // Received packets every device of this process dropped, by reason (`mrkit stat` prints
    // sources as they are).
    let drops = stats::rx_drops().snapshot().into_iter();
    let drops: Map<String, Value> = drops.map(|(n, c)| (n.to_string(), json!(c))).collect();
    srcs.insert("rx_drops".into(), drops.into());
    let pid = std::process::id();
    json!({
        "schema": SCHEMA,
        "pid": pid,
        "comm": comm(),
        "starttime": process_start_time(pid).unwrap_or(0),
        "updated_unix_ms": now_ms(),
        "registrations": s.registrations,
        "deregistrations": s.deregistrations,
        "failures": failures,
        "mrs_live": s.mrs_live,
        "pinned_bytes": s.pinned_bytes,
        "pinned_bytes_peak": s.pinned_bytes_peak,
        "mtt_used": s.mtt_used,
        "memlock_pinned_pages": mrkit_soft::mem::account::pinned_pages(),
        "pins_io_uring": s.pins_io_uring,
        "pins_mlock": s.pins_mlock,
        "odp_faults": s.odp_faults,
        "latency_ns": {
            "count": count,
            "p50": Histogram::quantile(&s.reg_latency, 0.5),
            "p99": Histogram::quantile(&s.reg_latency, 0.99),
            "buckets": s.reg_latency.to_vec(),
        },
        "device_limits": device_limits(),
        "sources": srcs,
    })
}

fn limits_slot() -> &'static Mutex<Option<Value>> {
    static L: OnceLock<Mutex<Option<Value>>> = OnceLock::new();
    L.get_or_init(|| Mutex::new(None))
}

/// Tell readers which device limits this process runs with (default: the limits
/// `Context::open_default` would use, i.e. the `MRKIT_*` environment of the process).
pub fn set_device_limits(attr: &mrkit_soft::DeviceAttr) {
    *limits_slot().lock().unwrap_or_else(|e| e.into_inner()) = Some(json!({
        "max_mr": attr.max_mr,
        "max_mtt": attr.max_mtt,
        "max_mr_size": attr.max_mr_size,
        "source": "set_device_limits",
    }));
}

fn device_limits() -> Value {
    if let Some(v) = limits_slot()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
    {
        return v;
    }
    match mrkit_soft::DeviceConfig::from_env() {
        Ok(c) => json!({
            "max_mr": c.attr().max_mr,
            "max_mtt": c.attr().max_mtt,
            "max_mr_size": c.attr().max_mr_size,
            "source": "environment",
        }),
        Err(_) => Value::Null,
    }
}

// ---------------------------------------------------------------------------------------------
// Reader side

/// Ask the exporter of `pid` for fresh snapshots (writes one byte to its request file).
pub fn request(dir: &Path, pid: u32) -> io::Result<()> {
    let mut f = fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(req_path(dir, pid))?;
    f.write_all(b"1")
}

/// Read and parse the stat file of `pid` (whatever its age).
pub fn read(dir: &Path, pid: u32) -> io::Result<Value> {
    let s = fs::read_to_string(stat_path(dir, pid))?;
    serde_json::from_str(&s).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Request a snapshot and wait (up to `timeout`) until the stat file is newer than the request.
/// Falls back to the existing (older) file when the exporter does not answer in time.
pub fn request_and_read(dir: &Path, pid: u32, timeout: Duration) -> io::Result<(Value, bool)> {
    let asked = now_ms();
    // The request file may be unwritable (another user's process that does not share):
    // then read what is there.
    let requested = request(dir, pid).is_ok();
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let v = read(dir, pid)?;
        let fresh = v["updated_unix_ms"].as_u64().unwrap_or(0) >= asked;
        if fresh || !requested || std::time::Instant::now() >= deadline {
            return Ok((v, fresh));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Remove the files of processes that no longer exist (programs that exited without
/// `shutdown`, e.g. test binaries), so the directory does not fill up.
fn remove_dead(dir: &Path) {
    for pid in list(dir) {
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = fs::remove_file(stat_path(dir, pid));
            let _ = fs::remove_file(req_path(dir, pid));
        }
    }
}

/// Pids with a stat file in `dir`.
pub fn list(dir: &Path) -> Vec<u32> {
    let mut v: Vec<u32> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_suffix(".stat")?.parse().ok())
        .collect();
    v.sort_unstable();
    v
}

/// Whether the process that wrote `v` is still running (pid alive with the same start time).
pub fn is_alive(v: &Value) -> bool {
    let Some(pid) = v["pid"].as_u64() else {
        return false;
    };
    match (process_start_time(pid as u32), v["starttime"].as_u64()) {
        (Some(now), Some(then)) => now == then,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_has_schema_and_sources() {
        register_source("unit", || json!({"x": 2}));
        let v = snapshot();
        assert_eq!(v["schema"], SCHEMA);
        assert_eq!(v["sources"]["unit"]["x"], 2);
        assert!(v["latency_ns"]["buckets"].as_array().unwrap().len() == stats::LATENCY_BUCKETS);
        assert!(is_alive(&v));
    }

    #[test]
    fn export_request_read_roundtrip() {
        let dir = std::env::temp_dir().join(format!("mrkit-stat-test-{}", std::process::id()));
        let path = install_with(ExportOptions {
            dir: dir.clone(),
            share: false,
            interval: Duration::from_millis(20),
        })
        .unwrap();
        let mode = fs::metadata(&path).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(list(&dir), vec![std::process::id()]);
        let (v, fresh) =
            request_and_read(&dir, std::process::id(), Duration::from_secs(5)).unwrap();
        assert!(fresh);
        assert_eq!(v["pid"], std::process::id());
        shutdown();
        assert!(list(&dir).is_empty());
        let _ = fs::remove_dir_all(&dir);
    }
}
