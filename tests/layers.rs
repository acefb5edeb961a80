//! The module graph has no cycles: docs/architecture.md lists the layers, and every `crate::…`
//! path in `src/` may only name a module of a lower layer (or its own). A new import that points
//! upward fails here, with the file and the path that broke the order. The same page's source
//! tree names every file, and every `mod.rs` that lists its submodules in its doc lists them all.

use std::collections::HashMap;
use std::path::Path;

const ARCHITECTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/architecture.md");

fn architecture() -> String {
    std::fs::read_to_string(ARCHITECTURE).expect("docs/architecture.md")
}

/// Layers as docs/architecture.md lists them: lines `layer N: module module … | what they do`
/// inside its code block.
fn layers_from_docs() -> HashMap<String, u32> {
    let doc = architecture();
    let mut out = HashMap::new();
    for line in doc.lines() {
        let Some(rest) = line.trim().strip_prefix("layer ") else {
            continue;
        };
        let Some((n, modules)) = rest.split_once(':') else {
            continue;
        };
        let n: u32 = n.trim().parse().expect("layer number");
        let modules = modules.split('|').next().unwrap_or("");
        for m in modules.split_whitespace() {
            assert!(
                out.insert(m.to_string(), n).is_none(),
                "{m} listed twice in the layers of docs/architecture.md"
            );
        }
    }
    assert!(
        out.len() >= 10,
        "docs/architecture.md lists no layers: {out:?}"
    );
    out
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// The top-level module a file under `src/` belongs to.
fn top_module(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel
        .components()
        .next()
        .unwrap()
        .as_os_str()
        .to_string_lossy();
    first.trim_end_matches(".rs").to_string()
}

/// Top-level modules named by `crate::NAME` paths in `text`.
fn crate_paths(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("crate::") {
        let after = &rest[i + "crate::".len()..];
        let name: String = after
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        // `$crate::` in macros and the `{a, b}` group form are not module names.
        let macro_var = i > 0 && rest.as_bytes()[i - 1] == b'$';
        if !name.is_empty() && !macro_var {
            out.push(name);
        }
        rest = after;
    }
    out
}

#[test]
fn every_import_points_to_a_lower_layer() {
    let layers = layers_from_docs();
    let src = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src"));
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut violations = Vec::new();
    let mut seen_modules = std::collections::HashSet::new();
    for f in &files {
        let from = top_module(src, f);
        if from == "lib" || from == "main" {
            continue;
        }
        seen_modules.insert(from.clone());
        let Some(&from_layer) = layers.get(&from) else {
            violations.push(format!(
                "{}: module `{from}` is not in the layers of docs/architecture.md",
                f.display()
            ));
            continue;
        };
        let text = std::fs::read_to_string(f).unwrap();
        for to in crate_paths(&text) {
            if to == from {
                continue;
            }
            match layers.get(&to) {
                Some(&l) if l < from_layer => {}
                Some(&l) => violations.push(format!(
                    "{}: `{from}` (layer {from_layer}) uses crate::{to} (layer {l})",
                    f.display()
                )),
                None => violations.push(format!(
                    "{}: crate::{to} is not in the layers of docs/architecture.md",
                    f.display()
                )),
            }
        }
    }
    for m in layers.keys() {
        assert!(
            seen_modules.contains(m),
            "docs/architecture.md lists layer module `{m}` that src/ does not have"
        );
    }
    assert!(violations.is_empty(), "{}", violations.join("\n"));
}

#[test]
fn the_checker_sees_upward_imports() {
    assert_eq!(
        crate_paths("use crate::gateway::Core; $crate::log::x; crate::http::{a};"),
        vec!["gateway".to_string(), "http".to_string()]
    );
}

/// The `src/` tree of docs/architecture.md names every source file (tests aside), so the map a
/// newcomer reads cannot drift from the code.
#[test]
fn the_architecture_source_tree_names_every_file() {
    let readme = architecture();
    let src = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src"));
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let line_of = |dir: &str| {
        readme
            .lines()
            .find(|l| l.starts_with(&format!("  {dir}")))
            .unwrap_or_else(|| {
                panic!("the src/ tree of docs/architecture.md has no line for {dir}")
            })
            .to_string()
    };
    let mut missing = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(src).unwrap();
        let parts: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if parts.iter().any(|p| p == "tests.rs" || p == "tests") {
            continue;
        }
        let words = |line: &str| -> Vec<String> {
            line.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '/'))
                .map(str::to_string)
                .collect()
        };
        let ok = match parts.as_slice() {
            [file] => words(&line_of("main.rs")).contains(file),
            // A folder's own module file is the folder itself.
            [_, file] if file == "mod.rs" => true,
            [dir, file] => words(&line_of(&format!("{dir}/"))).contains(file),
            [dir, sub, file] => {
                let line = line_of(&format!("{dir}/"));
                let stem = file.trim_end_matches(".rs");
                line.contains(&format!("{sub}/")) && words(&line).iter().any(|w| w == stem)
            }
            // Deeper: the line names the path below the first folder, `sub/…/stem`.
            [dir, subs @ .., file] => {
                let line = line_of(&format!("{dir}/"));
                let stem = file.trim_end_matches(".rs");
                let inner = subs[1..].join("/");
                line.contains(&format!("{}/", subs[0]))
                    && words(&line).iter().any(|w| *w == format!("{inner}/{stem}"))
            }
            [] => false,
        };
        if !ok {
            missing.push(rel.display().to_string());
        }
    }
    assert!(
        missing.is_empty(),
        "the src/ tree of docs/architecture.md misses: {missing:?}"
    );
}

/// The submodules a module file declares (`mod x;`, `pub mod x;`, `pub(crate) mod x;`), test
/// modules aside.
fn declared_submodules(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        let rest = line
            .strip_prefix("pub(crate) mod ")
            .or_else(|| line.strip_prefix("pub(super) mod "))
            .or_else(|| line.strip_prefix("pub mod "))
            .or_else(|| line.strip_prefix("mod "));
        let Some(name) = rest.and_then(|r| r.strip_suffix(';')) else {
            continue;
        };
        if name == "tests" {
            continue;
        }
        out.push(name.to_string());
    }
    out
}

/// The spans a module doc (`//!` lines) quotes in backticks.
fn quoted_in_module_doc(text: &str) -> Vec<String> {
    let doc: String = text
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("//!"))
        .collect::<Vec<_>>()
        .join("\n");
    doc.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// Whether a doc's quoted spans name module `m`: `m` itself, a path into it (`m::x`, `m/x.rs`),
/// or a path ending in it (`kv::m`).
fn names_module(quoted: &[String], m: &str) -> bool {
    quoted.iter().any(|q| {
        q == m
            || q.starts_with(&format!("{m}::"))
            || q.starts_with(&format!("{m}/"))
            || q.ends_with(&format!("::{m}"))
    })
}

/// A `mod.rs` whose doc lists its submodules (names at least one in backticks) lists them all,
/// so the list a reader trusts cannot fall behind a new module.
#[test]
fn every_mod_rs_doc_list_names_every_submodule() {
    let src = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src"));
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut lists = 0;
    let mut missing = Vec::new();
    for f in files.iter().filter(|f| f.ends_with("mod.rs")) {
        let text = std::fs::read_to_string(f).unwrap();
        let subs = declared_submodules(&text);
        let quoted = quoted_in_module_doc(&text);
        if !subs.iter().any(|m| names_module(&quoted, m)) {
            continue;
        }
        lists += 1;
        for m in subs.iter().filter(|m| !names_module(&quoted, m)) {
            missing.push(format!("{}: `{m}`", f.strip_prefix(src).unwrap().display()));
        }
    }
    assert!(lists >= 10, "found only {lists} mod.rs doc lists");
    assert!(
        missing.is_empty(),
        "mod.rs docs that list their submodules miss these (name each in backticks): {missing:?}"
    );
}

#[test]
fn the_doc_list_check_reads_paths_and_skips_tests() {
    let text =
        "//! The parts: `wire`, `kv::zmtp` and [`trie::holding`].\npub mod wire;\nmod zmtp;\n\
                mod trie;\nmod memo;\n#[cfg(test)]\nmod tests;\n";
    assert_eq!(
        declared_submodules(text),
        vec!["wire", "zmtp", "trie", "memo"]
    );
    let quoted = quoted_in_module_doc(text);
    assert!(names_module(&quoted, "wire") && names_module(&quoted, "zmtp"));
    assert!(names_module(&quoted, "trie") && !names_module(&quoted, "memo"));
}

/// Unit tests have one shape (docs/architecture.md, "Tests"): a module's tests are its `tests`
/// module, inline (`mod tests { … }`) or, when long, the sibling file `tests.rs` (`mod tests;`).
/// No `*_tests.rs` file and no test module of another `*_tests` name, so a module's tests are
/// found in one place.
#[test]
fn unit_tests_are_each_modules_tests_module() {
    let src = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src"));
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut odd = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(src).unwrap().display().to_string();
        if f.file_stem()
            .is_some_and(|s| s.to_string_lossy().ends_with("_tests"))
        {
            odd.push(format!("{rel}: a `*_tests.rs` file"));
        }
        let text = std::fs::read_to_string(f).unwrap();
        for (i, line) in text.lines().enumerate() {
            let name = line
                .trim()
                .trim_start_matches("pub(crate) ")
                .trim_start_matches("pub(super) ")
                .trim_start_matches("pub ")
                .strip_prefix("mod ")
                .and_then(|r| {
                    r.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                        .next()
                });
            if name.is_some_and(|n| n.ends_with("_tests")) {
                odd.push(format!("{rel}:{}: {}", i + 1, line.trim()));
            }
        }
    }
    assert!(
        odd.is_empty(),
        "unit tests go in the module's `tests` (inline, or tests.rs beside it): {odd:?}"
    );
}
