//! KV-event decoder throughput (`src/kv/wire.rs`), on batches shaped like SGLang's.
//!
//! - `decode/prefill_4k/{array,map}`: one batch with one `BlockStored` of a 4096-token prefill at
//!   page size 16 (256 block hashes, signed 64-bit like SGLang's, 4096 token ids), array- and
//!   map-encoded events.
//! - `decode/step_mix/array`: a busy scheduler step: 32 events, stores of 64-token chunks
//!   (page 16) and removals of 4 blocks, alternating.
//!
//! Throughput is in payload bytes; events/s and tokens/s follow from the shapes above.
use criterion::{Criterion, Throughput};
use radixgate::kv::wire::{
    decode_batch, encode_batch, BlockRemoved, BlockStored, EngineHash, EventBatch, Form, KvEvent,
};
use std::hint::black_box;

fn stored(first: u64, blocks: u64, page: u32) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        // SGLang's hashes are the top 64 bits of a SHA-256 as i64: large, half negative.
        block_hashes: (first..first + blocks)
            .map(|i| EngineHash(i.wrapping_mul(0x9e37_79b9_7f4a_7c15)))
            .collect(),
        parent: Some(EngineHash(first.wrapping_mul(31))),
        token_ids: (0..blocks as u32 * page)
            .map(|t| 1000 + t * 7 % 150_000)
            .collect(),
        block_size: page,
        lora_id: None,
        medium: None,
        cache_salt: None,
        lora_name: None,
    })
}

fn batch(events: Vec<KvEvent>) -> EventBatch {
    EventBatch {
        ts: Some(1.7e9),
        events,
        dp_rank: Some(0),
        ..EventBatch::default()
    }
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    let prefill = batch(vec![stored(1, 256, 16)]);
    let mix = batch(
        (0..32u64)
            .map(|i| {
                if i % 2 == 0 {
                    stored(i * 100, 4, 16)
                } else {
                    KvEvent::BlockRemoved(BlockRemoved {
                        block_hashes: (0..4).map(|k| EngineHash(i * 100 + k)).collect(),
                        medium: None,
                    })
                }
            })
            .collect(),
    );
    let mut g = c.benchmark_group("decode");
    for (name, b, form) in [
        ("prefill_4k/array", &prefill, Form::Array),
        ("prefill_4k/map", &prefill, Form::MapEvents),
        ("step_mix/array", &mix, Form::Array),
    ] {
        let bytes = encode_batch(b, form);
        g.throughput(Throughput::Bytes(bytes.len() as u64));
        g.bench_function(name, |bench| {
            bench.iter(|| decode_batch(black_box(&bytes)).unwrap())
        });
        println!("{name}: {} payload bytes", bytes.len());
    }
    g.finish();
    c.final_summary();
}
