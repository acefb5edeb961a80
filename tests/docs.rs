//! The README and docs/ must stay true to the code and stay a manual: the flag table, the metric
//! families, the example config, the links between pages, the benchmark tables' provenance, and
//! no diary (no commit hashes, tracker references, timestamps or links into `results/`).

// The end-to-end helpers (tests/common/, the e2e binary's too), for the one test that runs a
// gateway; the rest of them are unused here.
#[allow(dead_code, unused_imports)]
mod common;
use clap::CommandFactory;
use common::*;
use radixgate::config::Config;
use std::collections::BTreeSet;

fn root() -> &'static std::path::Path {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// README.md and every page of docs/, as (path, text).
fn pages() -> Vec<(String, String)> {
    let mut out = vec![("README.md".to_string(), read("README.md"))];
    let mut docs: Vec<_> = std::fs::read_dir(root().join("docs"))
        .expect("docs/")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    for p in docs {
        let rel = format!("docs/{}", p.file_name().unwrap().to_string_lossy());
        out.push((rel.clone(), read(&rel)));
    }
    assert!(out.len() >= 8, "docs/ has too few pages: {out:?}");
    out
}

#[test]
fn every_flag_is_in_the_readme_table_with_its_default() {
    let readme = read("README.md");
    let cmd = Config::command();
    let mut known = BTreeSet::new();
    for arg in cmd.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if long == "help" || long == "version" {
            continue;
        }
        known.insert(format!("--{long}"));
        let row = readme
            .lines()
            .find(|l| l.starts_with(&format!("| `--{long}` |")))
            .unwrap_or_else(|| panic!("README has no row for --{long}"));
        for d in arg.get_default_values() {
            let d = d.to_string_lossy();
            assert!(
                row.contains(d.as_ref()),
                "README row for --{long} lacks its default {d}: {row}"
            );
        }
    }
    for line in readme.lines() {
        let Some(rest) = line.strip_prefix("| `--") else {
            continue;
        };
        let flag = format!("--{}", &rest[..rest.find('`').unwrap()]);
        assert!(
            known.contains(&flag),
            "README's flag table has a row for {flag}, which radixgate does not take"
        );
    }
}

#[test]
fn the_example_config_parses() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/radixgate.toml");
    let args: Vec<String> = ["radixgate", "--config", path]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let cfg = Config::try_from_args(&args).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(cfg.worker_urls.len(), 2);
}

#[test]
fn the_kubernetes_configmap_holds_a_config_the_gateway_takes() {
    let text = read("configs/kubernetes/configmap.yaml");
    // The block scalar under `radixgate.toml: |`, indented four spaces.
    let toml: String = text
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("radixgate.toml: |"))
        .skip(1)
        .map(|l| l.strip_prefix("    ").unwrap_or(l.trim()))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(toml.contains("service-discovery = true"), "{toml}");
    let dir = std::env::temp_dir().join(format!("radixgate-k8s-cm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("radixgate.toml");
    std::fs::write(&path, &toml).unwrap();
    let args: Vec<String> = ["radixgate", "--config", path.to_str().unwrap()]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let cfg = Config::try_from_args(&args).unwrap_or_else(|e| panic!("{e}"));
    let _ = std::fs::remove_dir_all(&dir);
    assert!(cfg.service_discovery);
    assert_eq!(cfg.selector, vec!["app=sglang-worker".to_string()]);
    assert_eq!(cfg.service_discovery_namespace.as_deref(), Some("sglang"));
    assert_eq!(cfg.service_discovery_port, 30000);
    // Every manifest the docs name is there.
    let page = read("docs/kubernetes.md");
    for f in ["rbac.yaml", "configmap.yaml", "deployment.yaml"] {
        assert!(page.contains(&format!("configs/kubernetes/{f}")), "{f}");
        read(&format!("configs/kubernetes/{f}"));
    }
}

/// Every `.rs` file under `dir`, concatenated (module paths may move; names must not hide).
fn all_sources(dir: &std::path::Path, out: &mut String) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            all_sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push_str(&std::fs::read_to_string(&p).unwrap());
        }
    }
}

/// Metric families the code registers: the first string literal of each `counter!`, `gauge!`
/// and `histogram!` call in src/.
fn families_in_source() -> BTreeSet<String> {
    let mut src = String::new();
    all_sources(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut src,
    );
    let mut names = BTreeSet::new();
    for mac in ["counter!(", "gauge!(", "histogram!("] {
        for (i, _) in src.match_indices(mac) {
            let rest = src[i + mac.len()..].trim_start();
            let Some(rest) = rest.strip_prefix('"') else {
                panic!(
                    "{mac} without a literal name: {}",
                    &rest[..rest.len().min(60)]
                );
            };
            names.insert(rest[..rest.find('"').unwrap()].to_string());
        }
    }
    assert!(names.len() > 10, "found only {names:?}");
    names
}

/// Metric families named in docs/metrics.md, in backticks (`radixgate_tree_{a,b}` expands).
fn families_in_docs() -> BTreeSet<String> {
    let section = read("docs/metrics.md");
    let mut names = BTreeSet::new();
    for quoted in section.split('`').skip(1).step_by(2) {
        if !(quoted.starts_with("smg_") || quoted.starts_with("radixgate_")) {
            continue;
        }
        let name: String = quoted
            .chars()
            .take_while(|c| {
                c.is_ascii_alphanumeric() || *c == '_' || *c == '{' || *c == ',' || *c == '}'
            })
            .collect();
        match (name.find("_{"), name.ends_with('}')) {
            (Some(open), true) => {
                for part in name[open + 2..name.len() - 1].split(',') {
                    names.insert(format!("{}_{part}", &name[..open]));
                }
            }
            _ => {
                names.insert(name.split('{').next().unwrap().to_string());
            }
        }
    }
    names
}

#[test]
fn the_metrics_page_and_the_code_name_the_same_families() {
    let code = families_in_source();
    let readme = families_in_docs();
    let undocumented: Vec<_> = code.difference(&readme).collect();
    let phantom: Vec<_> = readme.difference(&code).collect();
    assert!(
        undocumented.is_empty(),
        "exported but not in docs/metrics.md: {undocumented:?}"
    );
    assert!(
        phantom.is_empty(),
        "in docs/metrics.md but never exported: {phantom:?}"
    );
}

#[test]
fn every_family_in_the_source_has_help_text_registered() {
    let described: BTreeSet<String> = radixgate::metrics::FAMILIES
        .iter()
        .map(|(name, _, help)| {
            assert!(!help.trim().is_empty(), "{name} has empty HELP text");
            name.to_string()
        })
        .collect();
    let code = families_in_source();
    let missing: Vec<_> = code.difference(&described).collect();
    let stale: Vec<_> = described.difference(&code).collect();
    assert!(
        missing.is_empty(),
        "emitted without HELP text (add to metrics::FAMILIES): {missing:?}"
    );
    assert!(
        stale.is_empty(),
        "in metrics::FAMILIES but never emitted: {stale:?}"
    );
}

#[test]
fn a_running_gateway_exports_only_documented_families() {
    let readme = families_in_docs();
    let cluster = sim(1, |_| {});
    let gw = gateway_with_metrics(&cluster.urls(), &["--policy", "cache_aware"]);
    for i in 0..3 {
        let r = request(
            gw.addr,
            "POST",
            "/v1/chat/completions",
            &[],
            &chat_body(&[("user", &format!("hello {i}"))], i == 1, 2),
        )
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(
        request(gw.addr, "GET", "/no/such/path", &[], b"")
            .unwrap()
            .status,
        404
    );
    let metrics = gw.metrics_addr.expect("metrics listener");
    let text = request(metrics, "GET", "/metrics", &[], b"")
        .unwrap()
        .text();
    let scraped: BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect();
    for must in [
        "smg_http_requests_total",
        "smg_http_responses_total",
        "smg_http_request_duration_seconds",
        "smg_worker_selection_total",
        "smg_router_requests_total",
        "radixgate_time_to_first_byte_seconds",
        "radixgate_io_driver",
        "radixgate_tree_nodes",
        "smg_worker_pool_size",
    ] {
        assert!(
            scraped.contains(must),
            "{must} not exported after traffic:\n{text}"
        );
    }
    let undocumented: Vec<_> = scraped.difference(&readme).collect();
    assert!(
        undocumented.is_empty(),
        "/metrics exports families docs/metrics.md does not document: {undocumented:?}"
    );
}

#[test]
fn dashboard_and_docs_name_only_metrics_the_gateway_exports() {
    let code = families_in_source();
    let mut docs = read("configs/grafana-dashboard.json");
    for (_, text) in pages() {
        docs.push_str(&text);
    }
    let mut checked = 0;
    for word in docs.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if !(word.starts_with("smg_") || word.starts_with("radixgate_")) {
            continue;
        }
        let name = word
            .trim_end_matches("_bucket")
            .trim_end_matches("_sum")
            .trim_end_matches("_count");
        // Shorthand such as radixgate_tree_{nodes,chars}: check the stem.
        let stem = name.trim_end_matches('_');
        assert!(
            code.iter()
                .any(|c| c == name || (stem != name && c.starts_with(stem))),
            "{name} is documented but not exported"
        );
        checked += 1;
    }
    assert!(checked > 10);
}

/// The README is a manual, not a diary: short, and its first screen says what the two commands
/// install.
#[test]
fn the_readme_is_short_and_says_what_the_test_command_installs() {
    let readme = read("README.md");
    let lines = readme.lines().count();
    assert!(
        lines <= 250,
        "README.md has {lines} lines (at most 250): move detail to docs/"
    );
    let first_screen: String = readme.lines().take(45).collect::<Vec<_>>().join("\n");
    for must in ["scripts/quickstart.sh", "scripts/test.sh", "apt-get", "pip"] {
        assert!(
            first_screen.contains(must),
            "the README's first screen (45 lines) does not mention {must}"
        );
    }
    let build = readme
        .find("cargo build --release")
        .expect("a build command");
    let run = readme
        .find("target/release/radixgate")
        .expect("a command that runs the binary");
    assert!(
        build < run,
        "the README runs the binary before it says how to build it"
    );
}

/// Words of `text`: maximal runs of ASCII letters and digits, with their byte offsets.
fn words(text: &str) -> impl Iterator<Item = (usize, &str)> {
    let mut out = Vec::new();
    let mut start = None;
    for (i, c) in text.char_indices() {
        match (c.is_ascii_alphanumeric(), start) {
            (true, None) => start = Some(i),
            (false, Some(s)) => {
                out.push((s, &text[s..i]));
                start = None;
            }
            _ => {}
        }
    }
    if let Some(s) = start {
        out.push((s, &text[s..]));
    }
    out.into_iter()
}

/// What would make a page a diary: a commit hash, a reference to our own tracker, a date or a
/// clock time (benchmarks.md's "Measured on" lines aside), or a link into `results/` (a folder
/// git ignores). Upstream reports stay allowed as "sglang #N" / "smg #N": facts about the
/// reference, not history of this project.
fn diary_marks(path: &str, text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let at = |what: &str| format!("{path}:{}: {what}: {line}", n + 1);
        let measured = path == "docs/benchmarks.md" && line.starts_with("Measured on ");
        for (i, w) in words(line) {
            let hex = (7..=40).contains(&w.len())
                && w.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
                && w.bytes().any(|b| b.is_ascii_digit())
                && w.bytes().any(|b| b.is_ascii_lowercase());
            if hex {
                found.push(at(&format!("commit-like hash {w}")));
            }
            let lower = w.to_ascii_lowercase();
            let next = line[i + w.len()..].trim_start().trim_start_matches('#');
            if (lower == "issue" || lower == "issues")
                && next.starts_with(|c: char| c.is_ascii_digit())
            {
                found.push(at("tracker reference"));
            }
            if lower == "deliverable" {
                found.push(at(&format!("the word {w:?}")));
            }
            if (lower == "session" || lower == "stop")
                && next.starts_with(|c: char| c.is_ascii_digit())
            {
                found.push(at(&format!("{w} N")));
            }
        }
        for (i, _) in line.match_indices('#') {
            let after = &line[i + 1..];
            if after.starts_with(|c: char| c.is_ascii_digit()) {
                let before = line[..i].trim_end();
                if !(before.ends_with("sglang") || before.ends_with("smg")) {
                    found.push(at("#N reference"));
                }
            }
        }
        let b = line.as_bytes();
        for i in 0..b.len().saturating_sub(9) {
            let date = b[i..i + 4].iter().all(u8::is_ascii_digit)
                && b[i + 4] == b'-'
                && b[i + 5..i + 7].iter().all(u8::is_ascii_digit)
                && b[i + 7] == b'-'
                && b[i + 8..i + 10].iter().all(u8::is_ascii_digit);
            if date && !measured {
                found.push(at("a date"));
            }
        }
        if line.contains(" UTC") {
            found.push(at("a clock time"));
        }
        if line.contains("](results") || line.contains("](./results") {
            found.push(at("a link into results/"));
        }
        if let Some(i) = line.find("results/") {
            if line[i + 8..].starts_with(|c: char| c.is_ascii_digit())
                || line[i + 8..].starts_with("bench-")
            {
                found.push(at("a results/ folder of one run"));
            }
        }
    }
    found
}

#[test]
fn readme_and_docs_name_no_commit_tracker_date_or_results_folder() {
    let mut found = Vec::new();
    for (path, text) in pages() {
        found.extend(diary_marks(&path, &text));
    }
    assert!(found.is_empty(), "diary in the docs:\n{}", found.join("\n"));
}

#[test]
fn the_diary_check_sees_what_it_should() {
    let bad = "built at a50a327\nsee issue 11\nsee #32\nrun of 2026-12-01\n21:58 UTC\n\
               [r](results/x)\n`results/bench-vs-peers-20261202`\ndeliverable 3\n";
    assert_eq!(
        diary_marks("docs/x.md", bad).len(),
        8,
        "{:?}",
        diary_marks("docs/x.md", bad)
    );
    let good = "sglang #6531 and smg #1692\n67108864 characters, 536870912 bytes\n\
                reports under `results/<stamp>/`\n[flags](#flags)\ncache_aware is fine\n";
    assert_eq!(diary_marks("docs/x.md", good), Vec::<String>::new());
    assert!(diary_marks("docs/benchmarks.md", "Measured on 2026-12-01, 2 CPUs, with").is_empty());
}

/// Relative links between the pages, and to files of the repository, resolve (and so do their
/// `#anchors`, as GitHub makes them from headings).
#[test]
fn links_between_the_pages_resolve() {
    fn anchors(text: &str) -> BTreeSet<String> {
        text.lines()
            .filter(|l| l.starts_with('#'))
            .map(|l| {
                l.trim_start_matches('#')
                    .trim()
                    .to_lowercase()
                    .chars()
                    .filter_map(|c| match c {
                        ' ' => Some('-'),
                        c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                        _ => None,
                    })
                    .collect()
            })
            .collect()
    }
    let mut broken = Vec::new();
    let mut checked = 0;
    for (path, text) in pages() {
        let dir = std::path::Path::new(&path).parent().unwrap().to_path_buf();
        for (i, _) in text.match_indices("](") {
            let rest = &text[i + 2..];
            let target = &rest[..rest.find(')').unwrap_or(rest.len())];
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (file, anchor) = target.split_once('#').unwrap_or((target, ""));
            let resolved = if file.is_empty() {
                std::path::PathBuf::from(&path)
            } else {
                dir.join(file)
            };
            checked += 1;
            let Ok(body) = std::fs::read_to_string(root().join(&resolved)) else {
                broken.push(format!("{path}: {target} (no such file)"));
                continue;
            };
            if !anchor.is_empty() && !anchors(&body).contains(anchor) {
                broken.push(format!("{path}: {target} (no such heading)"));
            }
        }
    }
    assert!(checked > 20, "found only {checked} links");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// docs/benchmarks.md: one section per benchmark between `<!-- bench:NAME -->` markers, each
/// saying when and where it was measured, with which command, and holding a table; and each
/// can be regenerated: its command is a script that writes the page (through
/// scripts/bench-docs.py), or a cargo bench that bench-docs.py runs itself.
#[test]
fn every_benchmark_table_says_when_where_and_how_and_can_be_regenerated() {
    let page = read("docs/benchmarks.md");
    let mut names = BTreeSet::new();
    let mut rest = page.as_str();
    while let Some(i) = rest.find("<!-- bench:") {
        let after = &rest[i + "<!-- bench:".len()..];
        let name = &after[..after.find(" -->").expect("marker end")];
        assert!(names.insert(name.to_string()), "section {name} twice");
        let end = format!("<!-- /bench:{name} -->");
        let body = &after[..after
            .find(&end)
            .unwrap_or_else(|| panic!("section {name} has no {end}"))];
        let lines: Vec<&str> = body.lines().skip(1).collect();
        let first = lines.first().copied().unwrap_or("");
        let date = first.strip_prefix("Measured on ").unwrap_or("");
        assert!(
            date.len() > 12
                && date.as_bytes()[..10]
                    .iter()
                    .enumerate()
                    .all(|(k, b)| if k == 4 || k == 7 { *b == b'-' } else { b.is_ascii_digit() })
                && date.contains("CPUs")
                && first.ends_with(", with"),
            "section {name} does not start with \"Measured on YYYY-MM-DD, <machine>, with\": {first:?}"
        );
        let command = lines
            .iter()
            .skip_while(|l| **l != "```sh")
            .nth(1)
            .unwrap_or_else(|| panic!("section {name} has no ```sh command"));
        assert!(
            lines.iter().any(|l| l.starts_with("|---")),
            "section {name} holds no table"
        );
        if let Some(script) = command
            .split_whitespace()
            .next()
            .filter(|w| w.starts_with("scripts/"))
        {
            let src = read(script);
            assert!(
                src.contains("--write-docs") && src.contains("bench-docs.py"),
                "section {name}: {script} cannot rewrite its table (no --write-docs)"
            );
        } else if let Some(bench) = command.strip_prefix("cargo bench --bench ") {
            let bench = bench.split_whitespace().next().unwrap();
            let want = if bench == "tree_memory" {
                "tree-memory".to_string()
            } else {
                format!("criterion-{}", bench.replace('_', "-"))
            };
            assert_eq!(name, want, "a cargo bench section is named after its bench");
        } else {
            panic!("section {name}: its command is neither a script nor a cargo bench: {command}");
        }
        rest = &after[after.find(&end).unwrap() + end.len()..];
    }
    assert!(names.len() >= 10, "only {names:?}");
    for must in [
        "policies-chat",
        "vs-peers-static",
        "eviction",
        "worker-scale",
        "latency",
    ] {
        assert!(
            names.contains(must),
            "docs/benchmarks.md lacks section {must}"
        );
    }
}

/// The writer the scripts share: its own test on a synthetic page and synthetic benchmark
/// output (no benchmark runs).
#[test]
fn the_benchmark_page_writer_passes_its_self_test() {
    let out = std::process::Command::new("python3")
        .arg(root().join("scripts/bench-docs.py"))
        .arg("--self-test")
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "bench-docs.py --self-test failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
