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
