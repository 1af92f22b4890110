//! `mrkit stat` run by root against the stat directory of a throwaway second user (created with
//! `useradd`, removed at the end even when a test fails), and that user's monitored process
//! against directories planted by somebody else.
//!
//! Needs root (`useradd`, `setpriv`, `chown`); other users get a SKIP line (a failure when
//! `MRKIT_REQUIRE_NETNS` is set, as for the other root-only tests).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[path = "../../mrkit/tests/providers_util/mod.rs"]
mod providers_util;

use serde_json::{json, Value};

/// `useradd`/`userdel` lock /etc/passwd: one user at a time.
static USERS: Mutex<()> = Mutex::new(());

const ENV_VARS: &[&str] = &[
    "MRKIT_STAT",
    "MRKIT_STAT_DIR",
    "MRKIT_STAT_SHARE",
    "MRKIT_STAT_INTERVAL_MS",
    "XDG_RUNTIME_DIR",
    "MRKIT_LOG",
];

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// A throwaway user, deleted on drop.
struct User {
    name: String,
    uid: u32,
    gid: u32,
}

impl User {
    fn new() -> User {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let name = format!("mrkit-test-{:x}", (std::process::id() << 12) ^ nanos);
        let ok = Command::new("useradd")
            .args(["-M", "-N", "-s", "/usr/sbin/nologin", &name])
            .status()
            .unwrap()
            .success();
        assert!(ok, "useradd {name}");
        let id = |flag: &str| -> u32 {
            let o = Command::new("id").args([flag, &name]).output().unwrap();
            String::from_utf8_lossy(&o.stdout).trim().parse().unwrap()
        };
        let (uid, gid) = (id("-u"), id("-g"));
        User { name, uid, gid }
    }

    /// `argv` run as this user (no supplementary groups).
    fn cmd(&self, argv: &[&str]) -> Command {
        let mut c = Command::new("setpriv");
        c.args([
            "--reuid",
            &self.uid.to_string(),
            "--regid",
            &self.gid.to_string(),
            "--clear-groups",
            "--",
        ])
        .args(argv);
        for v in ENV_VARS {
            c.env_remove(v);
        }
        c
    }
}

impl Drop for User {
    fn drop(&mut self) {
        // Its processes are killed by their guards (declared after the user, dropped first).
        let _ = Command::new("userdel").arg(&self.name).status();
    }
}

/// Removes a path (directory tree or file) on drop.
struct Rm(PathBuf);
impl Drop for Rm {
    fn drop(&mut self) {
        if self.0.is_dir() && !self.0.is_symlink() {
            let _ = std::fs::remove_dir_all(&self.0);
        } else {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

struct Kill(std::process::Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn mrkit_bin() -> &'static str {
    env!("CARGO_BIN_EXE_mrkit")
}

/// Run with a deadline (a hang is a failure, not a stuck test run). The pipes are drained
/// while the child runs: `mrkit stat` as root also lists every other root process that
/// exports to `/tmp/mrkit-0` (one with a thousand live MRs writes well over a pipe's 64 KiB).
fn run_bounded(c: &mut Command, limit: Duration) -> Output {
    let child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    mrkit_testsupport::output_within(child, limit).unwrap_or_else(|o| {
        panic!(
            "{c:?} did not finish within {limit:?} (stderr: {})",
            String::from_utf8_lossy(&o.stderr)
        )
    })
}

/// `mrkit stat ARGS` as root: own runtime directory an empty scratch directory, so only
/// `/tmp/mrkit-<uid>` directories (or `--dir`) are read. RLIMIT_DATA 128 MiB: reading a
/// 300 MiB file whole would abort it.
fn stat_as_root(xdg: &Path, args: &[&str]) -> Output {
    let mut c = Command::new("prlimit");
    c.arg(format!("--data={}", 128u64 << 20))
        .arg("--")
        .arg(mrkit_bin())
        .arg("stat")
        .args(args);
    for v in ENV_VARS {
        c.env_remove(v);
    }
    c.env("XDG_RUNTIME_DIR", xdg);
    run_bounded(&mut c, Duration::from_secs(60))
}

fn start_time(pid: u32) -> u64 {
    mrkit::stat_export::process_start_time(pid).unwrap()
}

fn write_owned(path: &Path, bytes: &[u8], uid: u32, gid: u32) {
    std::fs::write(path, bytes).unwrap();
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).unwrap();
}

fn entry(v: &Value, pid: u32) -> Option<&Value> {
    v["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == pid)
}

fn wait_for(path: &Path) {
    let t = Instant::now();
    while !path.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// As root: the tests' lock, a throwaway second user (removed on drop) and its stat directory
/// path `/tmp/mrkit-<uid>`, with nothing left there. Not root: says loudly that `test` is
/// skipped and returns `None`.
fn second_user(test: &str) -> Option<(std::sync::MutexGuard<'static, ()>, User, PathBuf)> {
    if !is_root() {
        mrkit_testsupport::skip(test, "needs root (useradd, setpriv, chown)");
        return None;
    }
    let serial = USERS.lock().unwrap_or_else(|e| e.into_inner());
    let u = User::new();
    let d = PathBuf::from(format!("/tmp/mrkit-{}", u.uid));
    let _ = std::fs::remove_dir_all(&d);
    let _ = std::fs::remove_file(&d);
    Some((serial, u, d))
}

#[test]
fn stat_as_root_trusts_nothing_in_another_users_directory() {
    if providers_util::needs_native(
        "the statistics export of mrkit processes is mrkit0's (`mrkit stat` on an rdma-core device reads the kernel's resource dump)",
    ) {
        return;
    }
    let Some((_serial, u, d)) =
        second_user("stat_as_root_trusts_nothing_in_another_users_directory")
    else {
        return;
    };
    let _rm_d = Rm(d.clone());
    let xdg = tempfile::tempdir().unwrap();
    let scratch = tempfile::tempdir().unwrap();

    // A genuine monitored process of the user: its exporter creates the directory (0700).
    let hold = Kill(
        u.cmd(&[mrkit_bin(), "__stat-hold", "--seconds", "30", "--regs", "1"])
            .env("MRKIT_STAT_INTERVAL_MS", "50")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let hold_pid = hold.0.id();
    wait_for(&d.join(format!("{hold_pid}.stat")));
    let m = std::fs::metadata(&d).unwrap();
    assert_eq!((m.uid(), m.mode() & 0o777), (u.uid, 0o700));

    // Live processes of the user whose stat files are planted.
    let sleeper = || {
        Kill(
            u.cmd(&["sleep", "30"])
                .stdout(Stdio::null())
                .spawn()
                .unwrap(),
        )
    };
    let (s1, s2) = (sleeper(), sleeper());
    let (p1, p2) = (s1.0.id(), s2.0.id());
    // setpriv execs sleep under the same pid: wait until it runs as the user.
    for p in [p1, p2] {
        let t = Instant::now();
        while std::fs::metadata(format!("/proc/{p}"))
            .map(|m| m.uid())
            .ok()
            != Some(u.uid)
        {
            assert!(t.elapsed() < Duration::from_secs(10));
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let victim = scratch.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let mk = |pid: u32, comm: &str, st: u64| {
        json!({"schema": "mrkit-stat/1", "pid": pid, "comm": comm, "starttime": st,
               "updated_unix_ms": 1, "registrations": 7, "failures": {"EVIL\u{1b}[31m": 1},
               "sources": {"x\u{7}": "y\u{1b}"}})
        .to_string()
    };
    // 1. p1: control characters in its name; its request file is a symlink to a root file.
    let evil = "evil\u{1b}]0;pwned\u{7}\n[running] fake\u{202e}";
    write_owned(
        &d.join(format!("{p1}.stat")),
        mk(p1, evil, start_time(p1)).as_bytes(),
        u.uid,
        u.gid,
    );
    let req1 = d.join(format!("{p1}.req"));
    std::os::unix::fs::symlink(&victim, &req1).unwrap();
    std::os::unix::fs::lchown(&req1, Some(u.uid), Some(u.gid)).unwrap();
    // 2. p2: the stat file is a symlink to a root-owned file (would show p2 if followed).
    let fake2 = scratch.path().join("fake2");
    std::fs::write(&fake2, mk(p2, "followed", start_time(p2))).unwrap();
    let st2 = d.join(format!("{p2}.stat"));
    std::os::unix::fs::symlink(&fake2, &st2).unwrap();
    std::os::unix::fs::lchown(&st2, Some(u.uid), Some(u.gid)).unwrap();
    // 3. FIFOs (a blocking open hangs the reader).
    for n in ["2147480001.stat", "2147480001.req"] {
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            d.join(n),
            rustix::fs::Mode::from_raw_mode(0o666),
        )
        .unwrap();
        std::os::unix::fs::chown(d.join(n), Some(u.uid), Some(u.gid)).unwrap();
    }
    // 4. 300 MiB sparse stat file.
    let big = d.join("2147480002.stat");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(300 << 20)
        .unwrap();
    std::os::unix::fs::chown(&big, Some(u.uid), Some(u.gid)).unwrap();
    // 5. Forged entries: a dead pid, and root's own process (this test) with its real start.
    let mut gone = Command::new("true").spawn().unwrap();
    let dead = gone.id();
    gone.wait().unwrap();
    write_owned(
        &d.join(format!("{dead}.stat")),
        mk(dead, "dead", 0).as_bytes(),
        u.uid,
        u.gid,
    );
    let me = std::process::id();
    write_owned(
        &d.join(format!("{me}.stat")),
        mk(me, "forged-root", start_time(me)).as_bytes(),
        u.uid,
        u.gid,
    );
    let my_req = d.join(format!("{me}.req"));
    write_owned(&my_req, b"", u.uid, u.gid);

    let o = stat_as_root(xdg.path(), &["--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let h = entry(&v, hold_pid).expect("the genuine process is listed");
    assert_eq!(
        (h["alive"].clone(), h["fresh"].clone()),
        (json!(true), json!(true))
    );
    assert_eq!(h["mrs_live"], 1);
    let e1 = entry(&v, p1).expect("p1 is the user's live process");
    assert_eq!(e1["alive"], true);
    for gone in [p2, 2147480001, 2147480002, dead, me] {
        assert!(
            entry(&v, gone).is_none(),
            "pid {gone} must not be listed: {v}"
        );
    }
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert!(std::fs::symlink_metadata(&req1).unwrap().is_symlink());
    assert_eq!(
        std::fs::read(&my_req).unwrap(),
        b"",
        "no request to root's process"
    );

    // --all shows the forged ones as exited, never as running.
    let o = stat_as_root(xdg.path(), &["--json", "--all"]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(entry(&v, dead).unwrap()["alive"], false);
    assert_eq!(entry(&v, me).unwrap()["alive"], false);
    assert!(entry(&v, p2).is_none());

    // Text: the name arrives escaped; no control character reaches the terminal.
    let o = stat_as_root(xdg.path(), &[]);
    assert!(o.status.success());
    let t = String::from_utf8(o.stdout).unwrap();
    assert!(
        !t.chars()
            .any(|c| (c.is_control() && c != '\n') || c == '\u{202e}'),
        "{t:?}"
    );
    assert!(
        t.contains(&format!(
            "pid {p1} (evil\\u{{1b}}]0;pwned\\u{{7}}\\n[running] fake\\u{{202e}}) [running]"
        )),
        "{t}"
    );
    assert!(t.contains("EVIL\\u{1b}[31m=1"), "{t}");
    assert!(
        t.contains(&format!("pid {hold_pid} (mrkit) [running]")),
        "{t}"
    );

    // Directories: owned by somebody else than the uid in the name, a symlink, world-writable.
    let n1 = 4_000_000_000u32 + (me % 100_000);
    let wrong_owner = PathBuf::from(format!("/tmp/mrkit-{n1}"));
    let _ = std::fs::remove_dir_all(&wrong_owner);
    std::fs::create_dir(&wrong_owner).unwrap();
    let _rm1 = Rm(wrong_owner.clone());
    std::fs::write(
        wrong_owner.join(format!("{me}.stat")),
        mk(me, "root-in-wrong-dir", start_time(me)),
    )
    .unwrap();
    let linked = PathBuf::from(format!("/tmp/mrkit-{}", n1 + 1));
    let _ = std::fs::remove_file(&linked);
    std::os::unix::fs::symlink(&d, &linked).unwrap();
    let _rm2 = Rm(linked.clone());
    let o = stat_as_root(xdg.path(), &["--json"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&format!("skipping {}", wrong_owner.display())) && err.contains("owned by"),
        "{err}"
    );
    assert!(
        err.contains(&format!("skipping {}", linked.display())),
        "{err}"
    );
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(entry(&v, me).is_none(), "{v}");
    let listed = v["processes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["pid"] == hold_pid)
        .count();
    assert_eq!(listed, 1, "listed once, not again through the symlink");

    let open = tempfile::tempdir().unwrap();
    std::fs::set_permissions(open.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    std::fs::write(
        open.path().join(format!("{me}.stat")),
        mk(me, "planted", start_time(me)),
    )
    .unwrap();
    let o = stat_as_root(
        xdg.path(),
        &["--json", "--dir", open.path().to_str().unwrap()],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("world-writable"), "{err}");
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["processes"], json!([]));
    drop((hold, s1, s2));
}

/// The monitored process (run as the second user) refuses a stat directory planted by
/// somebody else: a symlink, a directory owned by another user, or its own directory made
/// world-writable; nothing is written through or into it.
#[test]
fn exporter_refuses_planted_directories() {
    if providers_util::needs_native(
        "the statistics export of mrkit processes is mrkit0's (`mrkit stat` on an rdma-core device reads the kernel's resource dump)",
    ) {
        return;
    }
    let Some((_serial, u, d)) = second_user("exporter_refuses_planted_directories") else {
        return;
    };
    let scratch = tempfile::tempdir().unwrap();
    // The target of the planted symlink: writable by the user, owned by root.
    let target = scratch.path().join("target");
    std::fs::create_dir(&target).unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o1777)).unwrap();
    std::fs::set_permissions(scratch.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let hold = || {
        run_bounded(
            &mut u.cmd(&[mrkit_bin(), "__stat-hold", "--seconds", "0", "--regs", "1"]),
            Duration::from_secs(60),
        )
    };
    let refused = |o: &Output, what: &str| {
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{what}: {err}");
        assert!(err.contains("refusing to export"), "{what}: {err}");
    };

    // 1. A symlink planted by root.
    std::os::unix::fs::symlink(&target, &d).unwrap();
    let rm = Rm(d.clone());
    refused(&hold(), "symlink");
    assert!(std::fs::read_dir(&target).unwrap().next().is_none());
    drop(rm);

    // 2. A directory owned by another user (root), open to everybody.
    std::fs::create_dir(&d).unwrap();
    let rm = Rm(d.clone());
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o1777)).unwrap();
    refused(&hold(), "root's directory");
    assert!(std::fs::read_dir(&d).unwrap().next().is_none());
    drop(rm);

    // 3. The user's own directory, but group/world-writable.
    std::fs::create_dir(&d).unwrap();
    let rm = Rm(d.clone());
    std::os::unix::fs::chown(&d, Some(u.uid), Some(u.gid)).unwrap();
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
    refused(&hold(), "world-writable directory");
    assert!(std::fs::read_dir(&d).unwrap().next().is_none());
    drop(rm);

    // 4. Nothing planted: created 0700 and used.
    let rm = Rm(d.clone());
    let o = hold();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = std::fs::metadata(&d).unwrap();
    assert_eq!((m.uid(), m.mode() & 0o777), (u.uid, 0o700));
    drop(rm);
}
