//! Chunked decoding on arbitrary bytes split at arbitrary points. The checks, and the input layout,
//! are in `fuzz/checks/chunked.rs`, shared with `tests/fuzz_corpus.rs`, which replays the stored
//! inputs in `cargo test`.
#![no_main]

#[path = "../checks/chunked.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::run(data));
