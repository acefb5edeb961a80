//! The module graph has no cycles: the README's architecture section lists the layers, and every
//! `crate::…` path in `src/` may only name a module of a lower layer (or its own). A new import
//! that points upward fails here, with the file and the path that broke the order.

use std::collections::HashMap;
use std::path::Path;

/// Layers as the README lists them: lines `layer N: module module … | what they do` inside the
/// architecture section's code block.
fn layers_from_readme() -> HashMap<String, u32> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    let mut out = HashMap::new();
    for line in readme.lines() {
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
                "{m} listed twice in README layers"
            );
        }
    }
    assert!(out.len() >= 10, "README lists no layers: {out:?}");
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
    let layers = layers_from_readme();
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
                "{}: module `{from}` is not in the README layers",
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
                    "{}: crate::{to} is not in the README layers",
                    f.display()
                )),
            }
        }
    }
    for m in layers.keys() {
        assert!(
            seen_modules.contains(m),
            "README lists layer module `{m}` that src/ does not have"
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

/// The README's `src/` tree names every source file (tests aside), so the map a newcomer reads
/// cannot drift from the code.
#[test]
fn the_readme_source_tree_names_every_file() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    let src = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src"));
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let line_of = |dir: &str| {
        readme
            .lines()
            .find(|l| l.starts_with(&format!("  {dir}")))
            .unwrap_or_else(|| panic!("README's src/ tree has no line for {dir}"))
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
    assert!(missing.is_empty(), "README's src/ tree misses: {missing:?}");
}
