//! The ZMTP client codec (`src/kv/zmtp.rs`) on arbitrary bytes. The checks, and the input layout,
//! are in `fuzz/checks/zmtp.rs`, shared with `tests/fuzz_corpus.rs`, which replays the stored
//! inputs in `cargo test`.
#![no_main]

#[path = "../checks/zmtp.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::run(data));
