//! The KV-event decoder (`src/kv/wire.rs`) on arbitrary bytes. The checks, and the input layout,
//! are in `fuzz/checks/kv_wire.rs`, shared with `tests/fuzz_corpus.rs`, which replays the stored
//! inputs in `cargo test`.
#![no_main]

#[path = "../checks/kv_wire.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::run(data));
