//! Routing-text extraction on arbitrary bytes, for every inference API. The checks, and the input
//! layout, are in `fuzz/checks/extract.rs`, shared with `tests/fuzz_corpus.rs`, which replays the
//! stored inputs in `cargo test`.
#![no_main]

#[path = "../checks/extract.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::run(data));
