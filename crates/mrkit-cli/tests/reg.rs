//! `mrkit reg` and `mrkit demo` end to end: real registrations through the built binary.

use std::process::Command;

#[path = "../../mrkit/tests/providers_util/mod.rs"]
mod providers_util;

fn mrkit(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mrkit"));
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().expect("run mrkit");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"))
}

#[test]
fn reg_success_json() {
    let (code, out, err) = mrkit(
        &[
            "reg",
            "--size",
            "64KiB",
            "--access",
            "local-write,remote-read",
            "--json",
        ],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    let v = json(&out);
    assert_eq!(v["ok"], true);
    assert_eq!(v["length"], 65536);
    assert_eq!(v["lkey"], v["rkey"]);
    if providers_util::is_native() {
        assert_eq!(v["page_size"], 4096);
        assert_eq!(v["page_count"], 16);
        assert_eq!(v["pinned_bytes"], 65536);
        assert!(
            v["pin_path"] == "io_uring" || v["pin_path"] == "mlock",
            "{v}"
        );
    } else {
        // libibverbs has no query_mr: what only the kernel knows is reported unknown.
        assert_eq!(
            (&v["page_size"], &v["page_count"], &v["pinned_bytes"]),
            (&0.into(), &0.into(), &0.into()),
            "{v}"
        );
        assert!(v["pin_path"].is_null(), "{v}");
    }
}

#[test]
fn reg_failures_carry_errno_and_exit_1() {
    type Row<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);
    let table: &[Row] = &[
        (
            &[
                "reg",
                "--size",
                "4096",
                "--access",
                "remote-write",
                "--json",
            ],
            &[],
            "EINVAL",
        ),
        (
            &[
                "reg",
                "--size",
                "4096",
                "--access",
                "local-write",
                "--readonly",
                "--json",
            ],
            &[],
            "EFAULT",
        ),
        (
            &["reg", "--size", "8MiB", "--access", "local-write", "--json"],
            &[("MRKIT_LOG_NUM_MTT", "10")],
            "ENOMEM",
        ),
        (
            &[
                "reg",
                "--size",
                "1GiB",
                "--access",
                "local-write",
                "--odp",
                "--json",
            ],
            &[("MRKIT_MAX_MR_SIZE", "512MiB")],
            "EINVAL",
        ),
        (
            &["reg", "--size", "4096", "--odp", "--json"],
            &[("MRKIT_ODP", "0")],
            "EOPNOTSUPP",
        ),
        (
            &[
                "reg", "--size", "4096", "--offset", "8", "--iova", "0x10000", "--json",
            ],
            &[],
            "EINVAL",
        ),
    ];
    for (args, env, errno) in table {
        let (code, out, err) = mrkit(args, env);
        assert_eq!(code, 1, "{args:?}: {out} {err}");
        let v = json(&out);
        assert_eq!(v["ok"], false);
        assert_eq!(v["errno"], *errno, "{args:?}: {v}");
        assert!(!v["message"].as_str().unwrap().is_empty());
    }
}

#[test]
fn reg_readonly_without_write_access_uses_mlock() {
    let (code, out, err) = mrkit(
        &[
            "reg",
            "--size",
            "16KiB",
            "--access",
            "remote-read",
            "--readonly",
            "--json",
        ],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    // The pinning method is not in the verbs API: unknown (null) on the rdma-core provider.
    let want = if providers_util::is_native() {
        "mlock".into()
    } else {
        serde_json::Value::Null
    };
    assert_eq!(json(&out)["pin_path"], want);
}

#[test]
fn reg_odp_pins_nothing() {
    let (code, out, err) = mrkit(
        &[
            "reg",
            "--size",
            "1MiB",
            "--access",
            "local-write",
            "--odp",
            "--json",
        ],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    let v = json(&out);
    assert_eq!(v["pinned_bytes"], 0);
    assert_eq!(v["kind"], "Odp");
}

#[test]
fn reg_text_output_and_usage_errors() {
    let (code, out, _) = mrkit(&["reg", "--size", "8KiB", "--access", "local-write"], &[]);
    assert_eq!(code, 0);
    assert!(
        out.contains("lkey") && out.contains("translation entries"),
        "{out}"
    );
    let (code, _, err) = mrkit(&["reg", "--size", "8KiB", "--access", "bogus"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("unknown access flag"), "{err}");
    let (code, _, err) = mrkit(&["reg", "--size", "lots"], &[]);
    assert_eq!(code, 2, "{err}");
    // A malformed MRKIT_* variable: a usage error of mrkit0's configuration (2); on the
    // rdma-core provider the drop-in's device refuses to open, a failed verb (1).
    let (code, _, err) = mrkit(&["reg", "--size", "4096"], &[("MRKIT_MAX_MR", "many")]);
    assert_eq!(
        code,
        if providers_util::is_native() { 2 } else { 1 },
        "{err}"
    );
}

#[test]
fn demo_shows_the_classic_mistakes() {
    let (code, out, err) = mrkit(&["demo"], &[]);
    assert_eq!(code, 0, "{err}");
    // mrkit0 says why it refused; libibverbs returns the errno only, and the device's key
    // table is mrkit0's (the stale-key step says so on rdma-core).
    let (why, stale) = if providers_util::is_native() {
        (
            "EINVAL: REMOTE_WRITE requires LOCAL_WRITE",
            "refused (NoSuchKey)",
        )
    } else {
        (
            "register(REMOTE_WRITE): EINVAL: ibv_reg_mr failed",
            "completes with IBV_WC_REM_ACCESS_ERR",
        )
    };
    for needle in [
        why,
        "EFAULT",
        "EACCES",
        stale,
        "registration 1001: ENOMEM",
        "translation table full",
        "EBUSY",
        // Data between two endpoints, with the data shown.
        "WRITE 35 B A -> B: completion SUCCESS; B's memory now reads \"hello from A, written by RDMA WRITE\"",
        "READ 30 B B -> A: completion SUCCESS; A's memory now reads \"B's data, fetched by RDMA READ\"",
        "FETCH_AND_ADD(+1) on B's counter: completion SUCCESS; A received the old value 41, B's counter is now 42",
        // The data-path mistake.
        "(LOCAL_WRITE only): completion REM_ACCESS_ERR",
        // Pool vs per-message.
        "Pool vs per-message registration: 2000 messages of 4 KiB",
        "per-message reg_mr + dereg_mr:",
        "MrPool slot (alloc, copy, free):",
    ] {
        assert!(out.contains(needle), "demo output lacks `{needle}`:\n{out}");
    }
    assert!(
        out.contains("the pool is ") && out.contains("x faster"),
        "{out}"
    );
}
