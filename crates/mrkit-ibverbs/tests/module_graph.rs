//! The crate's modules form layers: no import cycle between them (a cycle means two files that
//! can only be understood, and changed, together). `lib.rs` and `exports.rs` sit on top and may
//! name every module; everything else names only modules below it.
//!
//! The check reads `src/`: a module is a file `src/NAME.rs` or a folder `src/NAME/`; it depends
//! on every module it names as `crate::NAME` (also inside `use crate::{A, B}` groups), comments
//! left out, test code included (a test in a low module must not reach up either).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The source text without `//` comments (a `//` inside a string literal cuts the rest of that
/// line too, which can only hide names, never invent them).
fn strip_comments(src: &str) -> String {
    src.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn ident_at(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The top-level modules `src` names through `crate::`.
fn crate_refs(src: &str) -> BTreeSet<String> {
    let text = strip_comments(src);
    let mut out = BTreeSet::new();
    let mut rest = text.as_str();
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().next_back();
        rest = &rest[i + "crate::".len()..];
        // `$crate::` (macros) and `mycrate::` are not this crate's paths.
        if matches!(before, Some(c) if c.is_ascii_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        let rest_trim = rest.trim_start();
        if let Some(group) = rest_trim.strip_prefix('{') {
            // `crate::{a::X, b, c::{Y, Z}}`: the first segment of each top-level item.
            let mut depth = 0usize;
            let mut item_start = true;
            for (pos, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => item_start = true,
                    c if c.is_whitespace() => {}
                    _ if item_start && depth == 0 => {
                        let name = ident_at(&group[pos..]);
                        if !name.is_empty() {
                            out.insert(name.to_string());
                        }
                        item_start = false;
                    }
                    _ => {}
                }
            }
        } else {
            let name = ident_at(rest_trim);
            if !name.is_empty() {
                out.insert(name.to_string());
            }
        }
    }
    out
}

fn read_tree(dir: &Path, out: &mut String) {
    for entry in std::fs::read_dir(dir).expect("read_dir") {
        let p = entry.expect("dir entry").path();
        if p.is_dir() {
            read_tree(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push_str(&std::fs::read_to_string(&p).expect("read source"));
            out.push('\n');
        }
    }
}

/// Module name → the modules it names (roots and unknown names left out).
fn module_graph(src_dir: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut sources = BTreeMap::new();
    for entry in std::fs::read_dir(src_dir).expect("read src/") {
        let p = entry.expect("dir entry").path();
        let name = p.file_stem().unwrap().to_string_lossy().into_owned();
        let mut text = String::new();
        if p.is_dir() {
            read_tree(&p, &mut text);
        } else if p.extension().is_some_and(|e| e == "rs") {
            text = std::fs::read_to_string(&p).expect("read source");
        } else {
            continue;
        }
        if name == "lib" || name == "main" {
            continue;
        }
        sources.insert(name, text);
    }
    let names: BTreeSet<String> = sources.keys().cloned().collect();
    sources
        .iter()
        .map(|(name, text)| {
            let deps = crate_refs(text)
                .into_iter()
                .filter(|d| d != name && names.contains(d))
                .collect();
            (name.clone(), deps)
        })
        .collect()
}

/// Every cycle's modules (strongly connected components of two or more), Tarjan's algorithm.
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct State<'a> {
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        s.index.insert(v, s.next);
        s.low.insert(v, s.next);
        s.next += 1;
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in &s.graph[v] {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.out.push(comp);
            }
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

#[test]
fn the_parser_finds_paths_and_groups() {
    let refs = crate_refs(
        "use crate::abi::*;\nuse crate::{ffi::guard, obj::{Obj, obj}, events};\n\
         // crate::commented\nlet x = crate::ops::table(); $crate::macro_only!(); mycrate::no;",
    );
    let want: BTreeSet<String> = ["abi", "ffi", "obj", "events", "ops"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(refs, want);
}

#[test]
fn the_cycle_finder_finds_a_cycle() {
    let mut g = BTreeMap::new();
    let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    g.insert("a".to_string(), set(&["b"]));
    g.insert("b".to_string(), set(&["c"]));
    g.insert("c".to_string(), set(&["a"]));
    g.insert("d".to_string(), set(&["a"]));
    assert_eq!(cycles(&g), vec![vec!["a", "b", "c"]]);
    g.insert("c".to_string(), set(&[]));
    assert!(cycles(&g).is_empty());
}

#[test]
fn modules_have_no_import_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = module_graph(&src);
    assert!(
        graph.len() > 5,
        "read too few modules from {src:?}: {graph:?}"
    );
    let found = cycles(&graph);
    assert!(
        found.is_empty(),
        "import cycles between the modules of mrkit-ibverbs: {found:?}\nthe graph: {graph:#?}"
    );
}
