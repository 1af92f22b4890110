//! The layer rule of mrkit-soft: every `crate::…` path in the library's non-test code names
//! a module of the same layer or of a layer below (docs/architecture.md, "Layers").
//!
//! The test reads `src/` as text: each file belongs to the layer of its top-level module
//! (`src/qp/req.rs` is `qp`), test code is left out (files declared `#[cfg(test)] mod x;` and
//! everything from an inline `#[cfg(test)] mod … {` on), and so are comments. A path that
//! goes up fails the test with the file, the line and both layers.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Bottom to top. A module may use its own layer and every layer before it.
const LAYERS: &[(&str, &[&str])] = &[
    (
        "leaves",
        &[
            "access",
            "addr",
            "device",
            "error",
            "events",
            "fault",
            "last_used",
            "mem",
            "stats",
            "table",
            "wire",
        ],
    ),
    (
        "memory core",
        &[
            "memcore",
            "pd",
            "mr",
            "mw",
            "odp",
            "user_mem",
            "copy",
            "probes",
            "reg_timing",
        ],
    ),
    ("engines", &["pkt", "cq", "srq", "qp", "counters"]),
    ("link", &["net"]),
    ("driver", &["driver", "stat_export"]),
    ("facade", &["lib", "fuzz", "testkit"]),
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|(_, ms)| ms.contains(&module))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The top-level module a file under `src/` belongs to (`lib` for `src/lib.rs`).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel
        .components()
        .next()
        .unwrap()
        .as_os_str()
        .to_string_lossy();
    first.trim_end_matches(".rs").to_string()
}

/// Files that are test code: `#[cfg(test)] mod name;` declares `name.rs` or `name/mod.rs`
/// beside the declaring module.
fn test_files(src: &Path, files: &[PathBuf]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(f).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for w in lines.windows(2) {
            if w[0].trim() != "#[cfg(test)]" {
                continue;
            }
            let decl = w[1].trim();
            let Some(name) = decl
                .strip_prefix("mod ")
                .or_else(|| decl.strip_prefix("pub(crate) mod "))
                .and_then(|r| r.strip_suffix(';'))
            else {
                continue;
            };
            let stem = f.file_stem().unwrap().to_string_lossy();
            let dir = if stem == "mod" || stem == "lib" {
                f.parent().unwrap().to_path_buf()
            } else {
                f.with_extension("")
            };
            out.push(dir.join(format!("{name}.rs")));
            out.push(dir.join(name).join("mod.rs"));
        }
    }
    let _ = src;
    out
}

/// The non-test, non-comment lines of a file, with their numbers.
fn code_lines(text: &str) -> Vec<(usize, String)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let t = l.trim();
        if t == "#[cfg(test)]"
            && lines
                .get(i + 1)
                .is_some_and(|n| n.trim_start().starts_with("mod ") && n.trim_end().ends_with('{'))
        {
            break; // the inline test module runs to the end of the file
        }
        let code = match l.find("//") {
            Some(k) => &l[..k],
            None => l,
        };
        out.push((i + 1, code.to_string()));
    }
    out
}

/// The top-level modules a line names through `crate::` (including `crate::{a, b::c}`).
fn crate_paths(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(k) = rest.find("crate::") {
        // `$crate::` (macro expansions) is not a path of this file.
        let before = &rest[..k];
        rest = &rest[k + "crate::".len()..];
        if before.ends_with('$') || before.ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let name: String = item
                    .trim()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    out.push(name);
                }
            }
        } else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            out.push(name);
        }
    }
    out
}

/// Items of the crate root that are re-exports of a module's item: they belong to the
/// module's layer, not to the facade.
fn root_item_module(name: &str) -> String {
    match name {
        "AccessFlags" => "access",
        "DeviceAttr" | "DeviceConfig" | "StatusModel" => "device",
        "Errno" | "Error" | "Result" => "error",
        "MemCore" => "memcore",
        "MrInfo" | "ReregFlags" => "mr",
        "MwType" => "mw",
        "OwnedMemory" | "UserMemory" => "user_mem",
        "Context" | "DeviceInner" | "ResourceCounts" | "progress" => "driver",
        "sockio" => "net",
        other => other,
    }
    .to_string()
}

#[test]
fn no_import_runs_upward() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let tests = test_files(&src, &files);
    let mut violations = Vec::new();
    let mut unknown = BTreeMap::new();
    for f in files.iter().filter(|f| !tests.contains(f)) {
        let module = module_of(&src, f);
        let Some(own) = layer_of(&module) else {
            unknown.insert(module, f.display().to_string());
            continue;
        };
        let text = std::fs::read_to_string(f).unwrap();
        for (n, line) in code_lines(&text) {
            for name in crate_paths(&line) {
                let target = root_item_module(&name);
                let Some(theirs) = layer_of(&target) else {
                    // A macro or item defined at the crate root itself (e.g. `DEVICE_NAME`).
                    continue;
                };
                if theirs > own {
                    violations.push(format!(
                        "{}:{n}: `{module}` ({}) uses `crate::{name}` ({})",
                        f.strip_prefix(&src).unwrap().display(),
                        LAYERS[own].0,
                        LAYERS[theirs].0
                    ));
                }
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "modules missing from the layer table (add them to LAYERS): {unknown:?}"
    );
    assert!(
        violations.is_empty(),
        "{} upward import(s):\n{}",
        violations.len(),
        violations.join("\n")
    );
}

/// The check itself finds an upward path, in a group and alone, and ignores comments,
/// `$crate` and test modules.
#[test]
fn the_checker_sees_paths_and_skips_comments_and_tests() {
    assert_eq!(
        crate_paths("use crate::{driver::Context, mr::MrGuard};"),
        ["driver", "mr"]
    );
    assert_eq!(crate_paths("let x = crate::net::udp::poll_rx(a);"), ["net"]);
    assert!(crate_paths("$crate::error::Error::new(e)").is_empty());
    let text = "use crate::mr::X; // crate::driver\n#[cfg(test)]\nmod tests {\n    use crate::driver::Context;\n}\n";
    let lines = code_lines(text);
    let names: Vec<String> = lines.iter().flat_map(|(_, l)| crate_paths(l)).collect();
    assert_eq!(names, ["mr"]);
    assert!(layer_of("driver") > layer_of("qp"));
}
