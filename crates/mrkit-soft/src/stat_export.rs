//! Live statistics for `mrkit stat`: a per-process file under a runtime directory.
//!
//! # One exporter per process, started by the device
//!
//! The device starts the exporter (`on_device_open`) when a process opens its first
//! `mrkit0` context, whatever it is built on: a C program on the drop-in `libibverbs.so.1`,
//! a program on the `mrkit` crate (which re-exports this module as `mrkit::stat_export`),
//! or the CLI's own verbs (`mrkit perf`, `bench`, `demo`); mrkit's rdma-core provider starts it
//! too ([`start_for_process`]). A forked child that opens a device is a new process and gets
//! its own files (the exporter remembers the pid it was started in). `MRKIT_STAT=0` disables
//! it.
//!
//! A process can hold two copies of this code (a program on the `mrkit` crate that loads the
//! drop-in `libibverbs.so.1`): the first to export writes the file, the other joins it and is
//! listed under `copies` (see `claim_process`).
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
//! pays the relaxed atomic adds it already pays for [`crate::stats`].
//!
//! A reader ([`request`] then [`read`], or `mrkit stat`) writes one byte to the request file,
//! waits until the stat file is newer than its request, and parses it. `mrkit stat --watch`
//! keeps re-touching the request file, so the exporter keeps refreshing.
//!
//! # Directory and permissions
//!
//! * `$MRKIT_STAT_DIR` if set, else `$XDG_RUNTIME_DIR/mrkit` if `XDG_RUNTIME_DIR` is set, else
//!   `/tmp/mrkit-$UID`. The exporter creates the directory with mode 0700 (0755 in share mode),
//!   opens it with `O_DIRECTORY|O_NOFOLLOW` and refuses it unless this user owns it and it is
//!   neither group- nor world-writable (a symlink, or a directory planted by another user, is
//!   refused). Every file operation afterwards is relative to that directory descriptor
//!   (`openat`, `renameat`, `unlinkat`): a path swapped after the check cannot redirect a write.
//! * The exporter creates its files with `O_CREAT|O_EXCL|O_NOFOLLOW` (a stale or planted file of
//!   the same name is unlinked first, never opened), writes snapshots to a temp file and renames
//!   it over `<pid>.stat` inside the directory.
//! * Files are mode **0600**: only the owner (and root) can read the counters. The owner can allow
//!   others with `MRKIT_STAT_SHARE=1` or [`ExportOptions::share`]: the stat file becomes 0644 and
//!   the request file 0666 (so another user's reader can ask for refreshes). Note that
//!   `$XDG_RUNTIME_DIR` itself is normally 0700: to share, export into `/tmp/mrkit-$UID`
//!   (unset `XDG_RUNTIME_DIR`) or set `MRKIT_STAT_DIR`.
//! * `MRKIT_STAT=0` makes [`install`] a no-op.
//!
//! Readers ([`StatDir`]) trust nothing in a directory: the directory must be owned by the uid it
//! is named after (for `/tmp/mrkit-<uid>`) and not group/world-writable; a file is opened only
//! if it is a regular file owned by the directory's owner, at most [`MAX_STAT_FILE`] bytes,
//! with `O_NOFOLLOW|O_NONBLOCK` (no symlink followed, no FIFO waited on); the request file is
//! never created or truncated by a reader, only written in place, and only for a process that
//! is alive, owned by the directory's owner and started when the file says.
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
//! mrkit_soft::stat_export::register_source("example", || serde_json::json!({"hits": 1}));
//! let snap = mrkit_soft::stat_export::snapshot();
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
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::stats::{self, Histogram};
use rustix::fs::{AtFlags, FileType, Mode, OFlags, Stat, CWD};
use serde_json::{json, Map, Value};

/// Schema identifier written into every stat file.
pub const SCHEMA: &str = "mrkit-stat/1";

/// A request younger than this keeps the exporter writing snapshots.
pub const ACTIVE_WINDOW: Duration = Duration::from_secs(5);

/// Default wake-up interval of the exporter thread.
pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(1000);

/// Largest stat file a reader opens (a snapshot is a few KiB; a larger file is refused
/// without being read).
pub const MAX_STAT_FILE: u64 = 1 << 20;

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

fn stat_name(pid: u32) -> String {
    format!("{pid}.stat")
}

fn req_name(pid: u32) -> String {
    format!("{pid}.req")
}

fn denied(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, msg)
}

// ---------------------------------------------------------------------------------------------
// The checked directory

/// A stat directory opened with `O_DIRECTORY|O_NOFOLLOW`, its owner and mode checked; every
/// access to its files goes through this descriptor (see the module docs for the rules).
#[derive(Debug)]
pub struct StatDir {
    fd: OwnedFd,
    path: PathBuf,
    uid: u32,
}

impl StatDir {
    /// Open `path` (never through a symlink in its last component) and check it: a directory,
    /// owned by `owner` (any owner if `None`), neither group- nor world-writable.
    pub fn open(path: &Path, owner: Option<u32>) -> io::Result<StatDir> {
        let fd = rustix::fs::openat(
            CWD,
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| match e {
            // O_NOFOLLOW on a symlink: ELOOP; O_DIRECTORY on something else: ENOTDIR.
            rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR => denied(format!(
                "{} is a symlink or not a directory",
                path.display()
            )),
            e => io::Error::from(e),
        })?;
        let st = rustix::fs::fstat(&fd)?;
        if let Some(want) = owner {
            if st.st_uid != want {
                return Err(denied(format!(
                    "{} is owned by uid {}, not by uid {want}",
                    path.display(),
                    st.st_uid
                )));
            }
        }
        if st.st_mode & 0o022 != 0 {
            return Err(denied(format!(
                "{} is group- or world-writable (mode {:o}); others could plant files there",
                path.display(),
                st.st_mode & 0o7777
            )));
        }
        Ok(StatDir {
            fd,
            path: path.to_path_buf(),
            uid: st.st_uid,
        })
    }

    /// The path the directory was opened at.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Owner of the directory: every file it holds must have the same owner.
    pub fn uid(&self) -> u32 {
        self.uid
    }

    /// Pids with a stat file in the directory (by name only; nothing is opened).
    pub fn list(&self) -> Vec<u32> {
        let mut v: Vec<u32> = Vec::new();
        if let Ok(dir) = rustix::fs::Dir::read_from(&self.fd) {
            for e in dir.flatten() {
                let Ok(name) = e.file_name().to_str() else {
                    continue;
                };
                if let Some(pid) = name.strip_suffix(".stat").and_then(parse_pid) {
                    v.push(pid);
                }
            }
        }
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Open `name` only if it is a regular file owned by the directory's owner and at most
    /// [`MAX_STAT_FILE`] bytes: checked by name without following a symlink, opened with
    /// `O_NOFOLLOW|O_NONBLOCK`, then checked again on the descriptor (same inode). A file
    /// replaced between the check and the open (the exporter replaces its stat file by an
    /// atomic rename at every update) is checked and opened again, a few times at most.
    fn open_checked(&self, name: &str, access: OFlags) -> io::Result<OwnedFd> {
        const ATTEMPTS: usize = 8;
        for _ in 0..ATTEMPTS {
            let before = rustix::fs::statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW)?;
            self.check_file(name, &before)?;
            let fd = rustix::fs::openat(
                &self.fd,
                name,
                access | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY,
                Mode::empty(),
            )?;
            let st = rustix::fs::fstat(&fd)?;
            if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino) {
                continue;
            }
            self.check_file(name, &st)?;
            return Ok(fd);
        }
        Err(denied(format!(
            "{name} was replaced while being opened, {ATTEMPTS} times in a row"
        )))
    }

    fn check_file(&self, name: &str, st: &Stat) -> io::Result<()> {
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            return Err(denied(format!(
                "{name} in {} is not a regular file",
                self.path.display()
            )));
        }
        if st.st_uid != self.uid {
            return Err(denied(format!(
                "{name} in {} is owned by uid {}, not by the directory's owner {}",
                self.path.display(),
                st.st_uid,
                self.uid
            )));
        }
        if st.st_size < 0 || st.st_size as u64 > MAX_STAT_FILE {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{name} in {} has {} bytes, more than a stat file ({MAX_STAT_FILE})",
                    self.path.display(),
                    st.st_size
                ),
            ));
        }
        Ok(())
    }

    /// Read and parse the stat file of `pid` (whatever its age). Refuses a file that is not a
    /// checked regular file (see [`StatDir`]) or that describes another pid than its name.
    pub fn read(&self, pid: u32) -> io::Result<Value> {
        let fd = self.open_checked(&stat_name(pid), OFlags::RDONLY)?;
        let mut buf = Vec::with_capacity(4096);
        let mut chunk = [0u8; 8192];
        loop {
            let n = match rustix::io::read(&fd, &mut chunk) {
                Ok(n) => n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            };
            if n == 0 {
                break;
            }
            // The file may grow after the size check: never hold more than the bound.
            if buf.len() as u64 + n as u64 > MAX_STAT_FILE {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{} grew beyond {MAX_STAT_FILE} bytes", stat_name(pid)),
                ));
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        let v: Value = serde_json::from_slice(&buf)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        if v["pid"].as_u64() != Some(u64::from(pid)) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{} describes pid {}, not {pid}",
                    stat_name(pid),
                    v["pid"].as_u64().map_or("?".into(), |p| p.to_string())
                ),
            ));
        }
        Ok(v)
    }

    /// Whether the process a stat file `v` describes is running: the pid exists (`kill(pid, 0)`
    /// does not answer ESRCH), `/proc/<pid>` is owned by the directory's owner, and it started
    /// when the file says (not a recycled pid).
    pub fn is_running(&self, v: &Value) -> bool {
        let Some(pid) = v["pid"].as_u64().and_then(|p| u32::try_from(p).ok()) else {
            return false;
        };
        pid_exists(pid) && process_owner(pid) == Some(self.uid) && is_alive(v)
    }

    /// Ask the exporter of `pid` for fresh snapshots: one byte written in place at offset 0 of
    /// its request file (never created, truncated or followed through a symlink). Only for a
    /// process [`StatDir::is_running`] accepts (the caller read its stat file first).
    pub fn request(&self, pid: u32) -> io::Result<()> {
        let fd = self.open_checked(&req_name(pid), OFlags::WRONLY)?;
        rustix::io::pwrite(&fd, b"1", 0)?;
        Ok(())
    }

    /// Request a snapshot of a running process and wait (up to `timeout`) until the stat file
    /// is newer than the request. Returns the file and whether it is fresh; a process that is
    /// not running (or whose request file is unwritable) gets its existing file, not fresh.
    pub fn request_and_read(&self, pid: u32, timeout: Duration) -> io::Result<(Value, bool)> {
        let asked = now_ms();
        let v = self.read(pid)?;
        let requested = self.is_running(&v) && self.request(pid).is_ok();
        if !requested {
            return Ok((v, false));
        }
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let v = self.read(pid)?;
            let fresh = v["updated_unix_ms"].as_u64().unwrap_or(0) >= asked;
            if fresh || std::time::Instant::now() >= deadline {
                return Ok((v, fresh));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Remove a file of the directory (not following a symlink; missing is fine).
    fn remove(&self, name: &str) -> io::Result<()> {
        match rustix::fs::unlinkat(&self.fd, name, AtFlags::empty()) {
            Ok(()) | Err(rustix::io::Errno::NOENT) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Create `name` afresh (`O_CREAT|O_EXCL|O_NOFOLLOW`, whatever had the name is unlinked
    /// first, never opened) with exactly `mode`.
    fn create(&self, name: &str, mode: u32) -> io::Result<fs::File> {
        self.remove(name)?;
        let fd = rustix::fs::openat(
            &self.fd,
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(mode),
        )?;
        // O_CREAT applies the umask: set the mode explicitly.
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode))?;
        Ok(fs::File::from(fd))
    }

    /// Modification time of `name` (not following a symlink).
    fn mtime(&self, name: &str) -> Option<SystemTime> {
        let st = rustix::fs::statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW).ok()?;
        let secs = u64::try_from(st.st_mtime).ok()?;
        let nanos = u32::try_from(st.st_mtime_nsec).ok()?.min(999_999_999);
        UNIX_EPOCH.checked_add(Duration::new(secs, nanos))
    }
}

/// A file-name pid: decimal digits only, canonical (no sign, no leading zero), in
/// `1..=i32::MAX` (a pid `kill` accepts as one process).
fn parse_pid(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || s.starts_with('0') {
        return None;
    }
    let p: u32 = s.parse().ok()?;
    (p <= i32::MAX as u32).then_some(p)
}

/// `kill(pid, 0)` semantics: the process exists (success or EPERM), not ESRCH.
fn pid_exists(pid: u32) -> bool {
    let Some(p) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    else {
        return false;
    };
    !matches!(
        rustix::process::test_kill_process(p),
        Err(rustix::io::Errno::SRCH)
    )
}

/// Owner of `/proc/<pid>` (the process's effective uid).
fn process_owner(pid: u32) -> Option<u32> {
    rustix::fs::stat(format!("/proc/{pid}"))
        .ok()
        .map(|st| st.st_uid)
}

// ---------------------------------------------------------------------------------------------
// Exporter

struct Exporter {
    /// The process the exporter was started in: a forked child (another pid) has no exporter
    /// thread and starts its own.
    pid: u32,
    opts: ExportOptions,
    dir: StatDir,
    /// Set by `shutdown` while it holds the exporter lock; the thread re-checks it under the
    /// same lock before each write, so no snapshot lands after the files were removed. Relaxed:
    /// the lock orders the store and the load that matter.
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

/// The exporter lock, waiting at most [`LOCK_WAIT`]: it is only held for a snapshot write, but
/// a child forked while its parent's exporter thread held it inherits it locked forever, and
/// must then not hang (it gives up exporting instead).
fn lock_exporter() -> io::Result<std::sync::MutexGuard<'static, Option<&'static Exporter>>> {
    let deadline = std::time::Instant::now() + LOCK_WAIT;
    loop {
        match exporter().try_lock() {
            Ok(g) => return Ok(g),
            Err(std::sync::TryLockError::Poisoned(p)) => return Ok(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => {
                if std::time::Instant::now() >= deadline {
                    return Err(io::Error::new(
                        io::ErrorKind::WouldBlock,
                        "the statistics exporter lock stays held (a child forked while its \
                         parent wrote a snapshot?); not exporting",
                    ));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

/// Longest wait for the exporter lock (see [`lock_exporter`]).
const LOCK_WAIT: Duration = Duration::from_secs(2);

/// Whether this copy of the code opened an mrkit0 device (the snapshot's `mrkit0_open`: a
/// process that only uses other devices, e.g. through mrkit's rdma-core provider, exports
/// mrkit0's counters as zeros, and readers leave them out). Relaxed: a flag read by snapshots.
static MRKIT0_OPENED: AtomicBool = AtomicBool::new(false);

/// The pid whose exporter [`on_device_open`] started (0: none yet). Relaxed: it only saves
/// the exporter lock on later opens; [`install_with`] decides under that lock.
static STARTED_FOR: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Called by the device each time a context opens: starts the exporter once per process
/// (again in a forked child, which is a new process). Errors are logged at debug level; a
/// process whose runtime directory is refused simply does not export.
pub(crate) fn on_device_open(dev: &std::sync::Arc<crate::DeviceInner>) {
    crate::driver::live_mrs::track(dev);
    MRKIT0_OPENED.store(true, Ordering::Relaxed);
    if cfg!(test) {
        return; // unit tests start exporters with their own options
    }
    start_for_process();
}

/// Start this process's export once (again in a forked child), as opening an mrkit0 context
/// does: for a device of another provider (mrkit's rdma-core provider calls it when it opens a
/// device). The files are removed at a normal exit. A no-op with `MRKIT_STAT=0`; errors are
/// logged at debug level.
pub fn start_for_process() {
    let pid = std::process::id();
    if STARTED_FOR.load(Ordering::Relaxed) == pid {
        return;
    }
    STARTED_FOR.store(pid, Ordering::Relaxed);
    // A normal exit removes the files (C programs on the drop-in call no shutdown).
    crate::driver::at_exit::register();
    if let Err(e) = install() {
        tracing::debug!(error = %e, "statistics export not started");
    }
}

/// Start exporting with explicit options (idempotent; the first options win).
pub fn install_with(opts: ExportOptions) -> io::Result<PathBuf> {
    let mut g = lock_exporter()?;
    if let Some(e) = *g {
        if !e.stop.load(Ordering::Relaxed) && e.pid == std::process::id() {
            return Ok(stat_path(&e.opts.dir, std::process::id()));
        }
    }
    let pid = std::process::id();
    if JOINED_FOR.load(Ordering::Relaxed) == pid {
        // This copy already serves its snapshots to the copy that writes the file.
        return Ok(stat_path(&opts.dir, pid));
    }
    if let Claim::Joined(conn) = claim_process(pid)? {
        JOINED_FOR.store(pid, Ordering::Relaxed);
        std::thread::Builder::new()
            .name("mrkit-stat-copy".into())
            .spawn(move || serve_holder(conn))?;
        tracing::debug!("stat export: joined the copy of mrkit that exports this process");
        return Ok(stat_path(&opts.dir, pid));
    }
    let dir = prepare_dir(&opts.dir, opts.share)?;
    remove_dead(&dir);
    // The request file exists from the start so that readers of other users (share mode) only
    // need write permission on it, not on the directory.
    create_req(&dir, pid, opts.share)?;
    // The first snapshot, so readers can find this process.
    write_snapshot(&dir, &opts)?;
    let e: &'static Exporter = Box::leak(Box::new(Exporter {
        pid,
        opts: opts.clone(),
        dir,
        stop: AtomicBool::new(false),
    }));
    *g = Some(e);
    std::thread::Builder::new()
        .name("mrkit-stat".into())
        .spawn(move || run(e))?;
    tracing::debug!(dir = %opts.dir.display(), share = opts.share, "stat export installed");
    Ok(stat_path(&opts.dir, pid))
}

/// The process-wide claim on `<pid>.stat` (the pid it was made for, and the socket bound to
/// the claim's name): see [`claim_process`].
static CLAIM: Mutex<Option<(u32, OwnedFd)>> = Mutex::new(None);

/// The pid in which this copy joined another copy's export (0: never): see [`Claim::Joined`].
/// Relaxed: it only makes a second `install` return early; the join itself happens once under
/// the exporter lock.
static JOINED_FOR: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// The outcome of [`claim_process`].
enum Claim {
    /// This copy holds the claim and writes `<pid>.stat`.
    Holder,
    /// Another copy of this code in this process holds it: the connection to its claim socket,
    /// over which this copy hands it a snapshot whenever asked ([`serve_holder`]).
    Joined(OwnedFd),
}

/// Claim this process's statistics files for this copy of the device. A process can hold two
/// copies of this code with separate statics (a program on the `mrkit` crate that also loads
/// the drop-in `libibverbs.so.1`, e.g. through mrkit's rdma-core provider); both would write
/// `<pid>.stat`, each with its own counters. The claim is the abstract Unix socket name
/// `mrkit-stat/<pid>`, which the kernel gives to one socket at a time: the first copy to
/// export binds it, listens on it and keeps it, and writes the file. A later copy finds the
/// name taken by its own process and *joins*: it stays connected to the holder's socket and
/// answers each snapshot request with its own snapshot, which the holder lists under
/// `"copies"` in the one file. The holder accepts a connection only when `SO_PEERCRED` says it
/// comes from this process. The name goes away with the socket (at the latest when the process
/// ends); a forked child (a new pid) claims its own name. Idempotent within a copy.
///
/// Abstract names carry no permissions: another local user can bind `mrkit-stat/<pid>` for a
/// pid it expects this process to get. So a taken name counts only when its holder is this
/// process: the name is connected to and the listener's credentials (`SO_PEERCRED`) compared
/// with our pid. A squatter (another process, or a socket that does not listen) is logged and
/// ignored, and this copy exports.
fn claim_process(pid: u32) -> io::Result<Claim> {
    use rustix::net::{self, AddressFamily, SocketFlags, SocketType};
    let mut g = CLAIM.lock().unwrap_or_else(|e| e.into_inner());
    if matches!(&*g, Some((p, _)) if *p == pid) {
        return Ok(Claim::Holder);
    }
    let stream = || {
        net::socket_with(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::CLOEXEC,
            None,
        )
    };
    let sock = stream()?;
    let name = net::SocketAddrUnix::new_abstract_name(format!("mrkit-stat/{pid}").as_bytes())?;
    match net::bind(&sock, &name).and_then(|()| net::listen(&sock, 8)) {
        Ok(()) => {
            // Joining copies are accepted while a snapshot is written: never wait there.
            rustix::io::ioctl_fionbio(&sock, true)?;
            // Replaces (closes) a claim inherited from the parent of a forked child.
            *g = Some((pid, sock));
            Ok(Claim::Holder)
        }
        Err(rustix::io::Errno::ADDRINUSE) => {
            let probe = stream()?;
            let holder = net::connect(&probe, &name)
                .and_then(|()| net::sockopt::socket_peercred(&probe))
                .map(|cred| cred.pid.as_raw_nonzero().get() as u32);
            match holder {
                Ok(p) if p == pid => {
                    // The holder answers within its own timeout; ours bounds a holder that
                    // stops reading (a request is one byte, a snapshot at most the file bound).
                    net::sockopt::set_socket_timeout(
                        &probe,
                        net::sockopt::Timeout::Send,
                        Some(PEER_TIMEOUT),
                    )?;
                    Ok(Claim::Joined(probe))
                }
                other => {
                    tracing::warn!(
                        holder = ?other,
                        "the statistics claim name of this process is held by someone else: \
                         exporting without it"
                    );
                    Ok(Claim::Holder)
                }
            }
        }
        Err(e) => Err(e.into()),
    }
}

/// How long the holder waits for a joined copy's snapshot (and a joined copy for the holder to
/// take it) before giving up on that copy.
const PEER_TIMEOUT: Duration = Duration::from_secs(1);

/// A joined copy's side ([`Claim::Joined`]): for every request byte the holder sends, one
/// snapshot of this copy (`u32` little-endian length, then the JSON). Ends when the holder
/// closes the connection (or the process ends).
fn serve_holder(conn: OwnedFd) {
    let mut req = [0u8; 1];
    loop {
        match rustix::io::read(&conn, &mut req) {
            Ok(0) => return,
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(_) => return,
        }
        let Ok(body) = serde_json::to_vec(&snapshot()) else {
            return;
        };
        let Ok(len) = u32::try_from(body.len()) else {
            return;
        };
        let mut msg = len.to_le_bytes().to_vec();
        msg.extend_from_slice(&body);
        if write_all_fd(&conn, &msg).is_err() {
            return;
        }
    }
}

fn write_all_fd(fd: &OwnedFd, mut b: &[u8]) -> io::Result<()> {
    while !b.is_empty() {
        match rustix::io::write(fd, b) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => b = &b[n..],
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

fn read_exact_fd(fd: &OwnedFd, mut b: &mut [u8]) -> io::Result<()> {
    while !b.is_empty() {
        match rustix::io::read(fd, &mut *b) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => b = &mut b[n..],
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Connections a holder accepts per snapshot at most.
const MAX_ACCEPTS: usize = 16;

/// The copies that joined this holder (the pid they joined in: a forked child drops its
/// parent's, whose other ends belong to the parent).
static PEERS: Mutex<Option<(u32, Vec<OwnedFd>)>> = Mutex::new(None);

/// The holder's side: accept the copies that joined since the last snapshot (only from this
/// process), then ask each for its snapshot. A copy that does not answer within
/// [`PEER_TIMEOUT`], or answers with something else than a bounded JSON object, is dropped.
fn copies_json() -> Vec<Value> {
    use rustix::net::{self, sockopt};
    let pid = std::process::id();
    let mut peers = PEERS.lock().unwrap_or_else(|e| e.into_inner());
    if !matches!(&*peers, Some((p, _)) if *p == pid) {
        *peers = Some((pid, Vec::new()));
    }
    let Some((_, list)) = peers.as_mut() else {
        return Vec::new();
    };
    let claim = CLAIM.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, listener)) = claim.as_ref().filter(|(p, _)| *p == pid) {
        // Bounded: another local user can connect too (and is turned away below), but cannot
        // keep this loop going.
        for _ in 0..MAX_ACCEPTS {
            let Ok(c) = net::accept_with(listener, net::SocketFlags::CLOEXEC) else {
                break; // EAGAIN: nobody else waiting
            };
            let ours = sockopt::socket_peercred(&c)
                .is_ok_and(|cred| cred.pid.as_raw_nonzero().get() as u32 == pid);
            let timed = sockopt::set_socket_timeout(&c, sockopt::Timeout::Recv, Some(PEER_TIMEOUT))
                .and_then(|()| {
                    sockopt::set_socket_timeout(&c, sockopt::Timeout::Send, Some(PEER_TIMEOUT))
                });
            if ours && timed.is_ok() {
                list.push(c);
            }
        }
    }
    let ask = |c: &OwnedFd| -> io::Result<Value> {
        write_all_fd(c, b"?")?;
        let mut len = [0u8; 4];
        read_exact_fd(c, &mut len)?;
        let len = u64::from(u32::from_le_bytes(len));
        if len > MAX_STAT_FILE {
            return Err(io::ErrorKind::InvalidData.into());
        }
        let mut body = vec![0u8; len as usize];
        read_exact_fd(c, &mut body)?;
        let v: Value = serde_json::from_slice(&body).map_err(io::Error::other)?;
        if !v.is_object() {
            return Err(io::ErrorKind::InvalidData.into());
        }
        Ok(v)
    };
    let mut out = Vec::new();
    list.retain(|c| match ask(c) {
        Ok(mut v) => {
            // A copy's own copies list is empty (it never holds the claim): keep the file flat.
            if let Some(o) = v.as_object_mut() {
                o.remove("copies");
            }
            out.push(v);
            true
        }
        Err(e) => {
            tracing::debug!(error = %e, "a joined statistics copy stopped answering");
            false
        }
    });
    out
}

/// Stop the exporter thread and remove this process's files (call at a clean exit).
pub fn shutdown() {
    let Ok(mut g) = lock_exporter() else {
        return;
    };
    if let Some(e) = g.take() {
        e.stop.store(true, Ordering::Relaxed);
        if e.pid != std::process::id() {
            return; // a forked child: the files are its parent's
        }
        let pid = std::process::id();
        let _ = e.dir.remove(&stat_name(pid));
        let _ = e.dir.remove(&req_name(pid));
    }
}

/// Create (mode 0700, 0755 to share) or open this user's stat directory, refusing a symlink,
/// a non-directory, a directory owned by somebody else or one others can write to.
fn prepare_dir(dir: &Path, share: bool) -> io::Result<StatDir> {
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        if !parent.exists() {
            fs::create_dir_all(parent)?;
        }
    }
    let mode = if share { 0o755 } else { 0o700 };
    match rustix::fs::mkdirat(CWD, dir, Mode::from_raw_mode(mode)) {
        Ok(()) | Err(rustix::io::Errno::EXIST) => {}
        Err(e) => return Err(e.into()),
    }
    let me = rustix::process::geteuid().as_raw();
    let d = StatDir::open(dir, Some(me))
        .map_err(|e| denied(format!("{e}; refusing to export statistics there")))?;
    if share {
        // Readers of other users need to traverse the directory (our own, checked above).
        let st = rustix::fs::fstat(&d.fd)?;
        if st.st_mode & 0o055 != 0o055 {
            rustix::fs::fchmod(&d.fd, Mode::from_raw_mode((st.st_mode & 0o7777) | 0o055))?;
        }
    }
    Ok(d)
}

fn create_req(dir: &StatDir, pid: u32, share: bool) -> io::Result<()> {
    dir.create(&req_name(pid), if share { 0o666 } else { 0o600 })
        .map(drop)
}

fn run(e: &'static Exporter) {
    let req = req_name(e.pid);
    while !e.stop.load(Ordering::Relaxed) {
        std::thread::sleep(e.opts.interval);
        if e.stop.load(Ordering::Relaxed) {
            break;
        }
        // The whole idle cost: one stat() per interval.
        let wanted = e
            .dir
            .mtime(&req)
            .map(|t| {
                SystemTime::now()
                    .duration_since(t)
                    .unwrap_or(Duration::ZERO)
            })
            .is_some_and(|age| age <= ACTIVE_WINDOW);
        if wanted {
            // Write under the exporter lock and re-check `stop` there, so a snapshot can never
            // land after `shutdown` removed the file.
            let _g = exporter().lock().unwrap_or_else(|p| p.into_inner());
            if e.stop.load(Ordering::Relaxed) {
                break;
            }
            if let Err(err) = write_snapshot(&e.dir, &e.opts) {
                tracing::debug!(error = %err, "stat export write failed");
            }
        }
    }
}

/// Write a snapshot to a fresh temp file and rename it over `<pid>.stat`, both inside the
/// checked directory.
fn write_snapshot(dir: &StatDir, opts: &ExportOptions) -> io::Result<()> {
    let pid = std::process::id();
    let tmp = format!("{pid}.stat.tmp");
    let mode = if opts.share { 0o644 } else { 0o600 };
    let mut v = snapshot();
    v["copies"] = Value::Array(copies_json());
    v["interval_ms"] = json!(opts.interval.as_millis() as u64);
    v["shared"] = json!(opts.share);
    let mut f = dir.create(&tmp, mode)?;
    let mut line = serde_json::to_vec(&v).map_err(io::Error::other)?;
    line.push(b'\n');
    f.write_all(&line)?;
    drop(f);
    rustix::fs::renameat(
        dir.fd.as_fd(),
        tmp.as_str(),
        dir.fd.as_fd(),
        stat_name(pid).as_str(),
    )?;
    Ok(())
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
        "memlock_pinned_pages": crate::mem::account::pinned_pages(),
        "pins_io_uring": s.pins_io_uring,
        "pins_mlock": s.pins_mlock,
        "odp_faults": s.odp_faults,
        "latency_ns": {
            "count": count,
            "p50": Histogram::quantile(&s.reg_latency, 0.5),
            "p99": Histogram::quantile(&s.reg_latency, 0.99),
            "buckets": s.reg_latency.to_vec(),
        },
        "mrkit0_open": MRKIT0_OPENED.load(Ordering::Relaxed),
        "device_limits": device_limits(),
        "sources": srcs,
        "counters": counters_json(),
        "mrs": mrs_json(),
    })
}

/// Live MRs a snapshot lists at most (the file stays far below [`MAX_STAT_FILE`]);
/// `mrs.total` says how many there are.
pub const MAX_LISTED_MRS: usize = 1000;

/// The port counters ([`crate::counters`]): `{"device": "mrkit0", "port": 1, "values": {...}}`.
pub fn counters_json() -> Value {
    let values: Map<String, Value> = crate::counters::snapshot()
        .into_iter()
        .map(|(n, c)| (n.to_string(), json!(c)))
        .collect();
    json!({"device": crate::DEVICE_NAME, "port": 1, "values": values})
}

/// The live MRs ([`crate::driver::live_mrs::live`]): `{"total": N, "list": [...]}`.
pub fn mrs_json() -> Value {
    let (list, total) = crate::driver::live_mrs::live(MAX_LISTED_MRS);
    let list: Vec<Value> = list.iter().map(mr_json).collect();
    json!({"total": total, "list": list})
}

/// One live MR as `mrkit stat --mrs` shows it.
pub fn mr_json(m: &crate::driver::live_mrs::LiveMr) -> Value {
    let i = &m.info;
    json!({
        "instance": m.instance,
        "lkey": i.lkey,
        "rkey": i.rkey,
        "pd": i.pd,
        "addr": i.addr,
        "length": i.length,
        "iova": i.iova,
        "access": i.access.names(),
        "access_bits": i.access.bits(),
        "kind": format!("{:?}", i.kind),
        "page_size": i.page_size,
        "page_count": i.entries,
        "pinned_bytes": i.pinned_bytes,
        "bound_mws": i.bound_mws,
        "age_ms": m.age.as_millis() as u64,
        "reg_timing_ns": i.reg_timing.map(timing_json),
    })
}

/// A registration's timing record as JSON (nanoseconds).
pub fn timing_json(t: crate::reg_timing::RegTiming) -> Value {
    json!({
        "total": t.total_ns,
        "accounting": t.accounting_ns,
        "pin": t.pin_ns,
        "walk": t.walk_ns,
        "translation": t.translation_ns,
        "key": t.key_ns,
    })
}

fn limits_slot() -> &'static Mutex<Option<Value>> {
    static L: OnceLock<Mutex<Option<Value>>> = OnceLock::new();
    L.get_or_init(|| Mutex::new(None))
}

/// Tell readers which device limits this process runs with (default: the limits
/// `Context::open_default` would use, i.e. the `MRKIT_*` environment of the process).
pub fn set_device_limits(attr: &crate::DeviceAttr) {
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
    match crate::DeviceConfig::from_env() {
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
// Reader side (path-based conveniences over [`StatDir`])

/// Ask the exporter of `pid` in `dir` for fresh snapshots (see [`StatDir::request`]; the
/// directory is checked as [`StatDir::open`] with any owner).
pub fn request(dir: &Path, pid: u32) -> io::Result<()> {
    StatDir::open(dir, None)?.request(pid)
}

/// Read and parse the stat file of `pid` (whatever its age; see [`StatDir::read`]).
pub fn read(dir: &Path, pid: u32) -> io::Result<Value> {
    StatDir::open(dir, None)?.read(pid)
}

/// Request a snapshot and wait (up to `timeout`) until the stat file is newer than the request
/// (see [`StatDir::request_and_read`]).
pub fn request_and_read(dir: &Path, pid: u32, timeout: Duration) -> io::Result<(Value, bool)> {
    StatDir::open(dir, None)?.request_and_read(pid, timeout)
}

/// Remove the files of processes that no longer exist (programs that exited without
/// `shutdown`, e.g. test binaries), so the directory does not fill up.
fn remove_dead(dir: &StatDir) {
    for pid in dir.list() {
        if !pid_exists(pid) {
            let _ = dir.remove(&stat_name(pid));
            let _ = dir.remove(&req_name(pid));
        }
    }
}

/// Pids with a stat file in `dir` (empty if the directory fails [`StatDir::open`]'s checks).
pub fn list(dir: &Path) -> Vec<u32> {
    StatDir::open(dir, None)
        .map(|d| d.list())
        .unwrap_or_default()
}

/// Whether the process that wrote `v` is still running (pid alive with the same start time).
/// [`StatDir::is_running`] also checks the process's owner.
pub fn is_alive(v: &Value) -> bool {
    let Some(pid) = v["pid"].as_u64().and_then(|p| u32::try_from(p).ok()) else {
        return false;
    };
    match (process_start_time(pid), v["starttime"].as_u64()) {
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

    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "mrkit-stat-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir(&d).unwrap();
        fs::set_permissions(&d, fs::Permissions::from_mode(0o700)).unwrap();
        d
    }

    fn opts(dir: &Path) -> ExportOptions {
        ExportOptions {
            dir: dir.to_path_buf(),
            share: false,
            interval: DEFAULT_INTERVAL,
        }
    }

    /// The exporter's own files: a planted symlink (or FIFO) under any of its names is replaced,
    /// never followed or opened; the victim keeps its bytes.
    #[test]
    fn writer_replaces_planted_files_without_following_them() {
        let d = scratch("plant");
        let victim = d.with_extension("victim");
        fs::write(&victim, b"precious").unwrap();
        let pid = std::process::id();
        for name in [req_name(pid), stat_name(pid), format!("{pid}.stat.tmp")] {
            std::os::unix::fs::symlink(&victim, d.join(&name)).unwrap();
        }
        let dir = prepare_dir(&d, false).unwrap();
        create_req(&dir, pid, false).unwrap();
        write_snapshot(&dir, &opts(&d)).unwrap();
        assert_eq!(fs::read(&victim).unwrap(), b"precious");
        for name in [req_name(pid), stat_name(pid)] {
            let m = fs::symlink_metadata(d.join(&name)).unwrap();
            assert!(m.file_type().is_file(), "{name} is a regular file now");
            assert_eq!(m.mode() & 0o777, 0o600);
        }
        assert_eq!(dir.read(pid).unwrap()["pid"], pid);
        // A FIFO under the temp name does not block the writer.
        rustix::fs::mkfifoat(
            CWD,
            d.join(format!("{pid}.stat.tmp")),
            Mode::from_raw_mode(0o600),
        )
        .unwrap();
        write_snapshot(&dir, &opts(&d)).unwrap();
        let _ = fs::remove_dir_all(&d);
        let _ = fs::remove_file(&victim);
    }

    /// The exporter refuses a symlinked directory and one others can write to.
    #[test]
    fn writer_refuses_symlinked_or_writable_dir() {
        let d = scratch("dirs");
        let link = d.with_extension("link");
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&d, &link).unwrap();
        let e = prepare_dir(&link, false).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
        fs::set_permissions(&d, fs::Permissions::from_mode(0o777)).unwrap();
        let e = prepare_dir(&d, false).unwrap_err();
        assert!(e.to_string().contains("world-writable"), "{e}");
        fs::set_permissions(&d, fs::Permissions::from_mode(0o700)).unwrap();
        assert!(
            fs::read_dir(&d).unwrap().next().is_none(),
            "nothing written"
        );
        // Created afresh: 0700.
        let fresh = d.join("sub");
        prepare_dir(&fresh, false).unwrap();
        assert_eq!(fs::metadata(&fresh).unwrap().mode() & 0o777, 0o700);
        let _ = fs::remove_file(&link);
        let _ = fs::remove_dir_all(&d);
    }

    /// Readers: a FIFO does not block, a huge sparse file is not read, a symlink is not
    /// followed, a file naming another pid is refused, the request file is never created or
    /// truncated.
    #[test]
    fn reader_refuses_hostile_files() {
        let d = scratch("read");
        let dir = StatDir::open(&d, None).unwrap();
        // FIFO (a blocking open would hang here forever).
        rustix::fs::mkfifoat(CWD, d.join("11.stat"), Mode::from_raw_mode(0o600)).unwrap();
        rustix::fs::mkfifoat(CWD, d.join("11.req"), Mode::from_raw_mode(0o600)).unwrap();
        assert!(dir.read(11).is_err());
        assert!(dir.request(11).is_err());
        // 300 MiB sparse file.
        let f = fs::File::create(d.join("12.stat")).unwrap();
        f.set_len(300 << 20).unwrap();
        let e = dir.read(12).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        // Symlinks to a readable JSON file and to a victim request file.
        let victim = d.with_extension("victim");
        fs::write(&victim, format!("{{\"pid\":13,\"schema\":\"{SCHEMA}\"}}")).unwrap();
        std::os::unix::fs::symlink(&victim, d.join("13.stat")).unwrap();
        std::os::unix::fs::symlink(&victim, d.join("13.req")).unwrap();
        assert!(dir.read(13).is_err());
        assert!(dir.request(13).is_err());
        assert!(fs::read(&victim).unwrap().starts_with(b"{\"pid\":13"));
        // A file whose content claims another pid.
        fs::write(d.join("14.stat"), b"{\"pid\":1}").unwrap();
        assert!(dir.read(14).is_err());
        // No request file: none is created.
        fs::write(d.join("15.stat"), b"{\"pid\":15}").unwrap();
        assert!(dir.request(15).is_err());
        assert!(!d.join("15.req").exists());
        // An existing request file is written in place, not truncated.
        fs::write(d.join("15.req"), b"0abc").unwrap();
        dir.request(15).unwrap();
        assert_eq!(fs::read(d.join("15.req")).unwrap(), b"1abc");
        // Names that are not canonical pids are not listed.
        for n in [
            "0.stat",
            "007.stat",
            "+5.stat",
            "4294967296.stat",
            "2147483648.stat",
        ] {
            fs::write(d.join(n), b"{}").unwrap();
        }
        assert_eq!(dir.list(), vec![11, 12, 13, 14, 15]);
        let _ = fs::remove_dir_all(&d);
        let _ = fs::remove_file(&victim);
    }

    /// A forged file naming a dead pid, or a live process of another owner, is not running.
    #[test]
    fn forged_entries_are_not_running() {
        let d = scratch("forged");
        let dir = StatDir::open(&d, None).unwrap();
        let me = std::process::id();
        let mine = json!({"pid": me, "starttime": process_start_time(me).unwrap()});
        assert!(dir.is_running(&mine));
        let wrong_start = json!({"pid": me, "starttime": 1});
        assert!(!dir.is_running(&wrong_start));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        assert!(!dir.is_running(&json!({"pid": dead, "starttime": 0})));
        assert!(!dir.is_running(&json!({"pid": -1})));
        assert!(!dir.is_running(&json!({"pid": u64::from(u32::MAX)})));
        // Pid 1 belongs to root: running only in a root-owned directory.
        if let Some(st) = process_start_time(1) {
            let init = json!({"pid": 1, "starttime": st});
            assert_eq!(dir.is_running(&init), dir.uid() == 0);
        }
        let _ = fs::remove_dir_all(&d);
    }
}
