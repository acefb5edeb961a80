//! The README's flag table, the example config and `--help` must stay true to the code.

mod common;
use clap::CommandFactory;
use common::*;
use radixgate::config::Config;
use std::collections::BTreeSet;

#[test]
fn every_flag_is_in_the_readme_table_with_its_default() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let cmd = Config::command();
    for arg in cmd.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if long == "help" || long == "version" {
            continue;
        }
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

/// Metric families named in README's "## Metrics" section (`radixgate_tree_{a,b}` expands).
fn families_in_readme() -> BTreeSet<String> {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let start = readme
        .find("\n## Metrics")
        .expect("README has a Metrics section");
    let section = &readme[start + 1..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
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
fn readme_metrics_section_and_the_code_name_the_same_families() {
    let code = families_in_source();
    let readme = families_in_readme();
    let undocumented: Vec<_> = code.difference(&readme).collect();
    let phantom: Vec<_> = readme.difference(&code).collect();
    assert!(
        undocumented.is_empty(),
        "exported but not in README's Metrics section: {undocumented:?}"
    );
    assert!(
        phantom.is_empty(),
        "in README's Metrics section but never exported: {phantom:?}"
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
    let readme = families_in_readme();
    let cluster = sim(1, |_| {});
    let port = free_port().to_string();
    let gw = gateway_for(
        &cluster.urls(),
        &[
            "--prometheus-port",
            &port,
            "--prometheus-host",
            "127.0.0.1",
            "--policy",
            "cache_aware",
        ],
    );
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
        "/metrics exports families README does not document: {undocumented:?}"
    );
}

#[test]
fn dashboard_and_readme_name_only_metrics_the_gateway_exports() {
    let root = env!("CARGO_MANIFEST_DIR");
    let code = families_in_source();
    let docs = std::fs::read_to_string(format!("{root}/configs/grafana-dashboard.json")).unwrap()
        + &std::fs::read_to_string(format!("{root}/README.md")).unwrap();
    let mut checked = 0;
    for word in docs.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if !(word.starts_with("smg_") || word.starts_with("radixgate_")) {
            continue;
        }
        let name = word
            .trim_end_matches("_bucket")
            .trim_end_matches("_sum")
            .trim_end_matches("_count");
        // README shorthand such as radixgate_tree_{nodes,chars}: check the stem.
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
