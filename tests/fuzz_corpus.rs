//! The fuzz targets' stored inputs, replayed rather than fuzzed: every file under
//! `fuzz/seeds/<target>/` goes through that target's own checks (`fuzz/checks/<target>.rs`, the
//! code the fuzz target runs), so a regression on an input someone found worth keeping fails
//! `cargo test` instead of waiting for the next fuzzing run. `fuzz/corpus/` (what a run grows)
//! is not tracked, so it is not replayed here.

#[path = "../fuzz/checks/chunked.rs"]
mod chunked;
#[path = "../fuzz/checks/extract.rs"]
mod extract;
#[path = "../fuzz/checks/head.rs"]
mod head;
#[path = "../fuzz/checks/kv_wire.rs"]
mod kv_wire;
#[path = "../fuzz/checks/zmtp.rs"]
mod zmtp;

use std::path::{Path, PathBuf};

fn fuzz_dir() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz"))
}

/// The stored inputs of `target`, by name.
fn seeds(target: &str) -> Vec<PathBuf> {
    let dir = fuzz_dir().join("seeds").join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

/// Runs `check` on every stored input of `target`; fails naming each input that panics.
fn replay(target: &str, check: fn(&[u8])) {
    let files = seeds(target);
    assert!(
        files.len() >= 3,
        "fuzz/seeds/{target} holds {} inputs: were they moved?",
        files.len()
    );
    let failed: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let data = std::fs::read(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            std::panic::catch_unwind(|| check(&data))
                .err()
                .map(|_| f.display().to_string())
        })
        .collect();
    assert!(
        failed.is_empty(),
        "the {target} checks fail on (see the panics above): {failed:#?}"
    );
}

#[test]
fn chunked_seeds_pass_the_fuzz_checks() {
    replay("chunked", chunked::run);
}

#[test]
fn extract_seeds_pass_the_fuzz_checks() {
    replay("extract", extract::run);
}

#[test]
fn head_seeds_pass_the_fuzz_checks() {
    replay("head", head::run);
}

#[test]
fn kv_wire_seeds_pass_the_fuzz_checks() {
    replay("kv_wire", kv_wire::run);
}

#[test]
fn zmtp_seeds_pass_the_fuzz_checks() {
    replay("zmtp", zmtp::run);
}

/// A fuzz target added without a replay here (or a replay left behind by a removed target)
/// fails, so every target's inputs stay replayed.
#[test]
fn every_fuzz_target_is_replayed() {
    let dir = fuzz_dir().join("fuzz_targets");
    let mut targets: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| {
            let p = e.expect("a directory entry").path();
            let stem = p.file_stem()?.to_str()?.to_string();
            (p.extension()? == "rs").then_some(stem)
        })
        .collect();
    targets.sort();
    assert_eq!(
        targets,
        ["chunked", "extract", "head", "kv_wire", "zmtp"],
        "tests/fuzz_corpus.rs replays these targets' seeds; add or drop the new one"
    );
}
