//! rdma-core v44's own Python test suite (python3-pyverbs ships it, partly gzipped, under
//! `/usr/share/doc/rdma-core/tests`) against the library: copied and unpacked into the scratch
//! directory, run with the system `/usr/bin/python3` (`run_tests.py`, docs/cabi.md §6.1), module by
//! module with a time limit. Every listed module must pass (skips allowed: UD/UC/XRC/raw QPs,
//! device memory, dmabuf, huge pages, ...); the pass/fail/skip counts are printed.

mod common;

use common::{lib_dir, scratch};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

const SRC: &str = "/usr/share/doc/rdma-core/tests";

const MODULES: &[&str] = &[
    "test_device",
    "test_pd",
    "test_mr",
    "test_cq",
    "test_cqex",
    "test_cq_events",
    "test_qp",
    "test_odp",
    "test_atomic",
    "test_relaxed_ordering",
    "test_addr",
    "test_fork",
];

fn unpack() -> std::path::PathBuf {
    assert!(
        Path::new(SRC).join("run_tests.py").exists() && Path::new("/usr/bin/python3").exists(),
        "{SRC} missing: apt-get install python3-pyverbs (scripts/test.sh installs it)"
    );
    let root = scratch(&format!("pyverbs-{}", std::process::id()));
    let dst = root.join("tests");
    let _ = std::fs::remove_dir_all(&dst);
    let ok = Command::new("cp")
        .args(["-r", SRC])
        .arg(&dst)
        .status()
        .expect("cp")
        .success();
    assert!(ok, "cp -r {SRC}");
    for e in std::fs::read_dir(&dst).expect("read tests dir") {
        let p = e.expect("entry").path();
        if p.extension().is_some_and(|x| x == "gz") {
            let ok = Command::new("gunzip")
                .arg("-f")
                .arg(&p)
                .status()
                .expect("gunzip")
                .success();
            assert!(ok, "gunzip {}", p.display());
        }
    }
    root
}

/// (ran, failures + errors, skipped, output)
fn run_module(root: &Path, module: &str) -> (u32, u32, u32, String) {
    let child = Command::new("/usr/bin/python3")
        .arg(root.join("tests/run_tests.py"))
        .arg(format!("tests.{module}"))
        .current_dir(root)
        .env("PYTHONPATH", root)
        .env("LD_LIBRARY_PATH", lib_dir())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run python3");
    // A module that hangs is killed after two minutes; its output still counts below.
    let o = mrkit_testsupport::output_within(child, Duration::from_secs(120)).unwrap_or_else(|o| o);
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let num = |key: &str| -> u32 {
        out.lines()
            .rev()
            .find_map(|l| {
                let i = l.find(key)?;
                let rest = &l[i + key.len()..];
                rest.split(|c: char| !c.is_ascii_digit())
                    .next()?
                    .parse()
                    .ok()
            })
            .unwrap_or(0)
    };
    let ran = out
        .lines()
        .find_map(|l| {
            l.strip_prefix("Ran ")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("{module}: no 'Ran N tests' line (timed out?):\n{out}"));
    let bad = num("failures=") + num("errors=");
    (ran, bad, num("skipped="), out)
}

#[test]
fn rdma_core_v44_python_suite() {
    let root = unpack();
    let mut rows = vec![format!(
        "{:<24} {:>4} {:>5} {:>5} {:>5}",
        "module", "ran", "pass", "fail", "skip"
    )];
    let mut failed = Vec::new();
    for m in MODULES {
        let (ran, bad, skip, out) = run_module(&root, m);
        rows.push(format!(
            "{m:<24} {ran:>4} {:>5} {bad:>5} {skip:>5}",
            ran - bad - skip
        ));
        if bad > 0 || !out.contains("\nOK") {
            failed.push(format!("--- {m}:\n{out}"));
        }
    }
    eprintln!("rdma-core v44 tests against mrkit0:\n{}", rows.join("\n"));
    let _ = std::fs::remove_dir_all(&root);
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}
