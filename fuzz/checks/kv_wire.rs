//! The KV-event decoder (`src/kv/wire.rs`) on arbitrary bytes. It must never panic; whatever it
//! accepts stays within the caps; an accepted batch re-encoded in every form decodes to the same
//! events (nothing invented, nothing reordered); the frame splitters never panic either.
//!
//! Input layout: the whole input is a payload; it is also cut at byte 0's value (mod len) into
//! frames for the live and replay splitters.
//!
//! Shared by the `kv_wire` fuzz target and `tests/fuzz_corpus.rs`, which replays the stored
//! inputs in `cargo test`: one copy of the checks, so a stored input is held to exactly what the
//! fuzzer holds it to.

use radixgate::kv::wire::{
    decode_batch, encode_batch, split_live, split_replay, Form, KvEvent, Skipped,
    MAX_EVENTS_PER_BATCH, MAX_HASHES_PER_EVENT, MAX_TOKENS_PER_EVENT,
};

/// Runs the checks on one input; panics where the fuzzer would report a crash.
pub fn run(data: &[u8]) {
    if let Some(&cut) = data.first() {
        let (a, b) = data.split_at(usize::from(cut) % data.len());
        let _ = split_live(&[a, b, data]);
        let _ = split_replay(&[b"", a, b]);
        let _ = split_replay(&[a, b]);
    }
    let Ok(batch) = decode_batch(data) else {
        return;
    };
    assert!(batch.events.len() <= MAX_EVENTS_PER_BATCH);
    for e in &batch.events {
        match e {
            KvEvent::BlockStored(s) => {
                assert!(s.block_hashes.len() <= MAX_HASHES_PER_EVENT);
                assert!(s.token_ids.len() <= MAX_TOKENS_PER_EVENT);
                assert!(s.block_size > 0);
            }
            KvEvent::BlockRemoved(r) => assert!(r.block_hashes.len() <= MAX_HASHES_PER_EVENT),
            KvEvent::AllBlocksCleared => {}
        }
    }
    for form in [Form::Array, Form::MapEvents, Form::Map] {
        let again = decode_batch(&encode_batch(&batch, form)).expect("re-encoded batch decodes");
        assert_eq!(again.events, batch.events, "{form:?}");
        assert_eq!(again.dp_rank, batch.dp_rank, "{form:?}");
        assert_eq!(again.skipped, Skipped::default(), "{form:?}");
    }
}
