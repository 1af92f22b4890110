//! Monitoring of programs on the drop-in library (issue 21): an unmodified perftest pair is
//! visible to the statistics reader `mrkit stat` uses (both processes, their MRs and port
//! counters); the seeds' `monitor_mr()` compiles with `mrkit/mrkit_ext.h` and runs; the
//! seeds' bpftrace latency histogram works on the device's `reg_start`/`reg_done` probes
//! (root with bpftrace only: otherwise the test prints a SKIPPED line with the reason).

mod common;

use common::{compile_c_with, lib_dir, lib_path, run_with_lib, text};
use mrkit_soft::stat_export::StatDir;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn monitor_mr_prog() -> std::path::PathBuf {
    // The header as the build installs it beside the library (target/<profile>/include),
    // linked against the drop-in itself (the system libibverbs has no mrkit_query_mr).
    let inc = common::profile_dir().join("include");
    assert!(
        inc.join("mrkit/mrkit_ext.h").exists(),
        "build.rs installs the header beside the library"
    );
    let lib = lib_path();
    compile_c_with(
        "monitor_mr.c",
        false,
        &[
            "-I",
            inc.to_str().expect("utf-8 path"),
            lib.to_str().expect("utf-8 path"),
        ],
    )
}

#[test]
fn seeds_monitor_mr_compiles_with_one_include_and_runs() {
    let prog = monitor_mr_prog();
    let o = run_with_lib(&prog, &[], &[("MRKIT_STAT", "0")]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("lkey=0x") && t.contains("size=65536"), "{t}");
    assert!(t.ends_with("OK\n"), "{t}");
}

#[test]
fn perftest_pair_is_visible_with_mrs_and_counters() {
    let prog = Path::new("/usr/bin/ib_write_bw");
    assert!(
        prog.exists(),
        "apt-get install perftest (scripts/test.sh installs it)"
    );
    let dir = common::scratch("stat-perftest");
    let _ = std::fs::remove_dir_all(&dir);
    let port = 18690u16;
    let cmd = |addr: &str, extra: &[&str]| {
        let mut c = Command::new(prog);
        c.args([
            "-d",
            "mrkit0",
            "-x",
            "0",
            "-F",
            "-D",
            "4",
            "-p",
            &port.to_string(),
        ])
        .args(extra)
        .env("LD_LIBRARY_PATH", lib_dir())
        .env("MRKIT_ADDR", addr)
        .env("MRKIT_STAT_DIR", &dir)
        .env("MRKIT_STAT_INTERVAL_MS", "50")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        c
    };
    let server = Kill(cmd("127.0.63.2", &[]).spawn().expect("spawn server"));
    std::thread::sleep(Duration::from_millis(500));
    let client = Kill(
        cmd("127.0.63.3", &["127.0.63.2"])
            .spawn()
            .expect("spawn client"),
    );
    // Both processes export once they opened mrkit0; wait until both run traffic.
    let deadline = Instant::now() + Duration::from_secs(20);
    let want = [server.0.id(), client.0.id()];
    let seen = loop {
        let mut seen = Vec::new();
        if let Ok(d) = StatDir::open(&dir, None) {
            for pid in d.list().into_iter().filter(|p| want.contains(p)) {
                if let Ok((v, true)) = d.request_and_read(pid, Duration::from_secs(2)) {
                    let sent = v["counters"]["values"]["sent_pkts"].as_u64().unwrap_or(0);
                    let rcvd = v["counters"]["values"]["rcvd_pkts"].as_u64().unwrap_or(0);
                    if sent > 0 && rcvd > 0 && v["mrs"]["total"].as_u64().unwrap_or(0) > 0 {
                        seen.push(v);
                    }
                }
            }
        }
        if seen.len() == 2 {
            break seen;
        }
        assert!(
            Instant::now() < deadline,
            "not both perftest processes visible with traffic and MRs: {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    for v in &seen {
        assert_eq!(v["comm"], "ib_write_bw", "{v}");
        let mr = &v["mrs"]["list"][0];
        assert!(
            mr["lkey"].as_u64().is_some() && mr["length"].as_u64() > Some(0),
            "{v}"
        );
        assert!(mr["reg_timing_ns"]["total"].as_u64() > Some(0), "{v}");
        let words = v["counters"]["values"]["port_xmit_data"]
            .as_u64()
            .unwrap_or(0);
        assert!(words > 0, "{v}");
    }
    drop((client, server));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Whether bpftrace can attach here; the reason when not.
fn bpftrace_unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root (uprobes/USDT need CAP_SYS_ADMIN/CAP_BPF)".into());
    }
    match Command::new("bpftrace").arg("--version").output() {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!("bpftrace --version failed: {}", text(&o))),
        Err(e) => Some(format!("no bpftrace ({e}); apt-get install bpftrace")),
    }
}

#[test]
fn seeds_bpftrace_histogram_on_the_registration_probes() {
    if let Some(why) = bpftrace_unavailable() {
        println!("SKIPPED seeds_bpftrace_histogram_on_the_registration_probes: {why}");
        eprintln!("SKIPPED seeds_bpftrace_histogram_on_the_registration_probes: {why}");
        return;
    }
    let prog = monitor_mr_prog();
    let lib = std::fs::canonicalize(lib_path()).expect("the library");
    let lib = lib.to_str().expect("utf-8 path");
    // The seeds' kprobe:mlx5_ib_reg_user_mr histogram, on the device's probes instead.
    let script = format!(
        "usdt:{lib}:mrkit:reg_start {{ @start[tid] = nsecs; }} \
         usdt:{lib}:mrkit:reg_done /@start[tid]/ {{ @ns = hist(nsecs - @start[tid]); \
         @n = count(); delete(@start[tid]); }}"
    );
    // Attached system-wide, then the program runs (bpftrace 0.17's `-c` fails to find the
    // location of a probe in a shared library the child has not loaded yet).
    let bt = Command::new("bpftrace")
        .args(["-e", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn bpftrace");
    let mut bt = Kill(bt);
    let mut out = bt.0.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        use std::io::Read;
        let mut all = Vec::new();
        let mut chunk = [0u8; 4096];
        while let Ok(n) = out.read(&mut chunk) {
            if n == 0 {
                break;
            }
            all.extend_from_slice(&chunk[..n]);
            if String::from_utf8_lossy(&all).contains("Attaching") {
                let _ = tx.send(());
            }
        }
        String::from_utf8_lossy(&all).into_owned()
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("bpftrace did not attach within 60 s");
    std::thread::sleep(Duration::from_secs(2)); // "Attaching" is printed before the attach
    let o = run_with_lib(&prog, &["50"], &[("MRKIT_STAT", "0")]);
    assert!(o.status.success(), "{}", text(&o));
    // SAFETY: kill has no memory preconditions; the pid is our own live child.
    unsafe { libc::kill(bt.0.id() as i32, libc::SIGINT) };
    let deadline = Instant::now() + Duration::from_secs(30);
    while bt.0.try_wait().expect("wait").is_none() {
        assert!(Instant::now() < deadline, "bpftrace did not stop on SIGINT");
        std::thread::sleep(Duration::from_millis(20));
    }
    let t = reader.join().expect("reader");
    // At least the program's 51 registrations (its first MR and 50 more); the probes are
    // system-wide, so registrations of tests running in parallel may add to them.
    let n: u64 = t
        .lines()
        .find_map(|l| l.strip_prefix("@n: "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    assert!(n >= 51, "registrations seen by the probes: {n}\n{t}");
    assert!(t.contains("@ns:") && t.contains('|'), "no histogram:\n{t}");
    println!("{t}");
}

#[test]
fn a_forked_child_that_opens_the_device_exports_its_own_file() {
    let prog = compile_c_with("fork_stat.c", true, &[]);
    let dir = common::scratch("stat-fork");
    let _ = std::fs::remove_dir_all(&dir);
    let mut c = Command::new(&prog);
    c.arg("3000")
        .env("LD_LIBRARY_PATH", lib_dir())
        .env("MRKIT_STAT_DIR", &dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut p = Kill(c.spawn().expect("spawn"));
    let mut line = String::new();
    // check.h reports each CHECK on stdout: skip to the program's own line. The pipe stays
    // open until the end (a closed one would kill the child with SIGPIPE).
    let out = p.0.stdout.take().expect("stdout");
    let mut r = std::io::BufReader::new(out);
    while !line.starts_with("parent ") {
        use std::io::BufRead;
        line.clear();
        assert!(r.read_line(&mut line).expect("read") > 0, "no pid line");
    }
    let pids: Vec<u32> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert_eq!(pids.len(), 2, "{line}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let d = StatDir::open(&dir, None).expect("stat dir");
        let listed = d.list();
        if pids.iter().all(|p| listed.contains(p)) {
            for pid in &pids {
                let (v, _) = d
                    .request_and_read(*pid, Duration::from_secs(2))
                    .expect("read");
                assert_eq!(v["pid"].as_u64(), Some(u64::from(*pid)), "{v}");
                assert!(d.is_running(&v), "{v}");
            }
            break;
        }
        assert!(Instant::now() < deadline, "files for {pids:?}: {listed:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::io::copy(&mut r, &mut std::io::sink()).expect("drain stdout");
    let st = p.0.wait().expect("wait");
    assert!(st.success());
    // The parent exited normally: its exit handler removed its files (the child left by
    // `_exit`, which runs no handler: its file stays, and readers see it is not running).
    let parent = pids[0];
    assert!(
        !dir.join(format!("{parent}.stat")).exists(),
        "parent's file left behind"
    );
    assert!(
        !dir.join(format!("{parent}.req")).exists(),
        "parent's request file left behind"
    );
    let d = StatDir::open(&dir, None).expect("stat dir");
    if let Ok(v) = d.read(pids[1]) {
        assert!(!d.is_running(&v), "{v}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
