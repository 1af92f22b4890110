//! Struct layouts: `offsetof`/`sizeof` printed by tests/c/layout.c, compiled against the system
//! rdma-core headers (libibverbs-dev), must equal the Rust side (`ibverbs::abi::layout_table`).

mod common;

use std::collections::BTreeMap;

#[test]
fn rust_layout_matches_system_headers() {
    let prog = common::compile_c("layout.c", false);
    let o = std::process::Command::new(&prog)
        .output()
        .expect("run layout");
    assert!(o.status.success(), "layout program failed");
    let c: BTreeMap<String, (usize, usize)> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), 3, "bad line {l:?}");
            (
                f[0].to_string(),
                (f[1].parse().unwrap(), f[2].parse().unwrap()),
            )
        })
        .collect();
    let rust = ibverbs::abi::layout_table();
    let mut diffs = Vec::new();
    for (name, a, b) in &rust {
        match c.get(name) {
            None => diffs.push(format!("{name}: not printed by layout.c")),
            Some(&(ca, cb)) if (ca, cb) != (*a, *b) => {
                diffs.push(format!("{name}: C ({ca}, {cb}) vs Rust ({a}, {b})"))
            }
            _ => {}
        }
    }
    assert_eq!(c.len(), rust.len(), "row count differs");
    assert!(
        diffs.is_empty(),
        "layout differences:\n{}",
        diffs.join("\n")
    );
}

#[test]
fn layout_matches_the_v44_reference_numbers() {
    // A few anchors from docs/cabi.md Appendix A (docs/cabi.md §2.2), independent of the local headers.
    let t: BTreeMap<String, (usize, usize)> = ibverbs::abi::layout_table()
        .into_iter()
        .map(|(n, a, b)| (n, (a, b)))
        .collect();
    for (name, want) in [
        ("ibv_device", 664),
        ("ibv_context", 328),
        ("verbs_context", 648),
        ("verbs_context.sz", 312),
        ("verbs_context.context", 320),
        ("verbs_context.query_device_ex", 216),
        ("ibv_context_ops.poll_cq", 88),
        ("ibv_context_ops.post_send", 200),
        ("ibv_context_ops.post_recv", 208),
        ("ibv_context_ops.post_srq_recv", 160),
        ("ibv_context.abi_compat", 320),
        ("ibv_mr", 48),
        ("ibv_mr.lkey", 36),
        ("ibv_mr.rkey", 40),
        ("ibv_device_attr", 232),
        ("ibv_device_attr.phys_port_cnt", 227),
        ("ibv_device_attr_ex", 400),
        ("ibv_device_attr_ex.odp_caps", 240),
        ("ibv_port_attr", 52),
        ("ibv_port_attr.port_cap_flags2", 48),
        ("ibv_gid_entry.gid_type", 24),
    ] {
        assert_eq!(t[name].0, want, "{name}");
    }
}
