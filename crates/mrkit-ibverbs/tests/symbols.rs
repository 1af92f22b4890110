//! The library exports every name of rdma-core v44's minimal set (abi/ibverbs-symbols.txt)
//! with its version (`name@@NODE`), defines all version nodes, and has SONAME libibverbs.so.1.
//! Checked with readelf on the built artifact.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

const NODES: &[&str] = &[
    "IBVERBS_1.0",
    "IBVERBS_1.1",
    "IBVERBS_1.5",
    "IBVERBS_1.6",
    "IBVERBS_1.7",
    "IBVERBS_1.8",
    "IBVERBS_1.9",
    "IBVERBS_1.10",
    "IBVERBS_1.11",
    "IBVERBS_1.12",
    "IBVERBS_1.13",
    "IBVERBS_1.14",
    "IBVERBS_PRIVATE_34",
];

fn readelf(args: &[&str]) -> String {
    let lib = common::lib_path();
    let o = Command::new("readelf")
        .args(args)
        .arg(&lib)
        .output()
        .expect("readelf (binutils) must be installed");
    assert!(o.status.success(), "readelf {args:?} failed");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Defined dynamic symbols: name -> (version, type, size).
fn defined_symbols() -> BTreeMap<String, (String, String, u64)> {
    let mut m = BTreeMap::new();
    for line in readelf(&["--dyn-syms", "-W"]).lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        // Num: Value Size Type Bind Vis Ndx Name
        if f.len() < 8 || f[6] == "UND" || !f[0].ends_with(':') || f[0] == "Num:" {
            continue;
        }
        if let Some((name, ver)) = f[7].split_once("@@") {
            let size = f[2].parse().unwrap_or(0);
            m.insert(name.to_string(), (ver.to_string(), f[3].to_string(), size));
        }
    }
    m
}

#[test]
fn soname_is_libibverbs_so_1() {
    let d = readelf(&["-d"]);
    assert!(
        d.contains("Library soname: [libibverbs.so.1]"),
        "SONAME missing:\n{d}"
    );
}

#[test]
fn every_version_node_is_defined() {
    let v = readelf(&["-V"]);
    let defs = v
        .split("Version definition section")
        .nth(1)
        .expect("no version definitions (.gnu.version_d)");
    let defs = defs.split("Version needs section").next().unwrap();
    let names: BTreeSet<&str> = defs
        .lines()
        .filter_map(|l| l.split("Name: ").nth(1))
        .map(str::trim)
        .collect();
    let missing: Vec<_> = NODES.iter().filter(|n| !names.contains(**n)).collect();
    assert!(
        missing.is_empty(),
        "missing version nodes {missing:?}; have {names:?}"
    );
    // (rust-lld does not record the parent links of the map, `} IBVERBS_1.0;`, in
    // .gnu.version_d; glibc's loader does not use them for symbol binding.)
}

#[test]
fn all_127_symbols_carry_their_versions() {
    let want = std::fs::read_to_string(common::crate_dir().join("abi/ibverbs-symbols.txt"))
        .expect("abi/ibverbs-symbols.txt");
    let want: Vec<(&str, &str)> = want
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (v, n) = l.trim().split_once(' ').expect("VERSION name");
            (n, v)
        })
        .collect();
    assert_eq!(want.len(), 127);
    let have = defined_symbols();
    let mut problems = Vec::new();
    for (name, ver) in &want {
        match have.get(*name) {
            None => problems.push(format!("{name}: not exported with a default version")),
            Some((v, _, _)) if v != ver => problems.push(format!("{name}: @@{v}, want @@{ver}")),
            _ => {}
        }
    }
    assert!(
        problems.is_empty(),
        "{} problem(s):\n{}",
        problems.len(),
        problems.join("\n")
    );
    // The data object is a 1-byte object, as in rdma-core.
    let (_, ty, size) = &have["verbs_allow_disassociate_destroy"];
    assert_eq!((ty.as_str(), *size), ("OBJECT", 1));
    // Nothing else leaks: every exported name is in EXPORTS (the 127 + 4 extra real exports).
    let listed: BTreeMap<&str, &str> = ibverbs::EXPORTS.iter().copied().collect();
    for (name, (ver, _, _)) in &have {
        assert_eq!(
            listed.get(name.as_str()),
            Some(&ver.as_str()),
            "unexpected export {name}@@{ver}"
        );
    }
    assert_eq!(have.len(), ibverbs::EXPORTS.len());
    for (n, v) in &want {
        assert_eq!(listed.get(n), Some(v), "EXPORTS lacks {n}@@{v}");
    }
}

#[test]
fn no_unversioned_or_base_exports() {
    let mut bad = Vec::new();
    for line in readelf(&["--dyn-syms", "-W"]).lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 8 || f[6] == "UND" || f[0] == "Num:" || f[4] == "LOCAL" {
            continue;
        }
        if !f[7].contains("@@") {
            bad.push(f[7].to_string());
        }
    }
    assert!(bad.is_empty(), "exported without a version: {bad:?}");
}
