//! The README's flag table, the example config and `--help` must stay true to the code.

use clap::CommandFactory;
use radixgate::config::Config;

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

#[test]
fn dashboard_and_readme_name_only_metrics_the_gateway_exports() {
    let root = env!("CARGO_MANIFEST_DIR");
    // Every series is emitted by a function in src/metrics.rs and nowhere else.
    let src = std::fs::read_to_string(format!("{root}/src/metrics.rs")).unwrap();
    let docs = std::fs::read_to_string(format!("{root}/configs/grafana-dashboard.json")).unwrap()
        + &std::fs::read_to_string(format!("{root}/README.md")).unwrap();
    let mut checked = 0;
    for word in docs.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if !(word.starts_with("smg_") || word.starts_with("radixgate_")) {
            continue;
        }
        let name = word.trim_end_matches("_bucket");
        // README shorthand such as radixgate_tree_{nodes,chars}: check the stem.
        let name = name.trim_end_matches('_');
        assert!(src.contains(name), "{name} is documented but not exported");
        checked += 1;
    }
    assert!(checked > 10);
}
