//! Token-block index benchmarks (`cargo bench --bench kv_index`).
//!
//! - `apply/stored_16x64`: one `BlockStored` of 16 blocks × 64 tokens (a 1,024-token prefill),
//!   extending a conversation of one of 8 sources, into an index holding ~500k blocks at its
//!   per-source cap, so every event also evicts 16 blocks (the steady state); `+publish`
//!   publishes a snapshot after every event (the most frequent publication the event thread
//!   would use), so the path copies after each publish are included. Events/s = 1 / time.
//!   `16_events_of_16x64+publish`: 16 such events then one publish (a batch of a busy step).
//! - `publish`: one publish of the ~500k-block index (an `Arc` clone per model).
//! - `match/{100k,4k}`: a 100k-token prompt (1,562 full blocks) held whole on 2 sources, its
//!   first half on 2 more, the first 100 blocks on a fifth; and a 4k-token prompt the same way.
//!   `match/miss_100k`: a 100k-token prompt whose first block no source holds.
//!
//! - `chain/turn10_4k_bs1/{hashed,memo}`: the block chain of turn 10 of a conversation (a
//!   4,096-token history plus 130 new tokens, a fresh tail each iteration) at one-token pages:
//!   hashed whole (`chain_hashes`), and through a core's [`ChainMemo`] holding the previous turn
//!   (the history's chain copied, the new tokens hashed; the prompt then remembered).
//!
//! - `transfer/export_copy_1M`, `transfer/export_1M`, `transfer/import_1M`: of an index holding
//!   1M blocks (8 sources of 128k, the traffic above), the copy the event thread takes
//!   ([`IndexWriter::export_copy`]), the whole export to bytes ([`IndexWriter::export`]), and
//!   [`IndexWriter::import`] of that payload into an empty writer (the `--kv-bootstrap-peer`
//!   start-up); the payload's size is printed.
//!
//! Memory per block held is printed first: bytes requested from the allocator (live, counted by
//! a wrapper around mimalloc) divided by blocks held, for blocks on one source each and for
//! blocks shared by two sources; mimalloc rounds requests up to its size classes (at most
//! ~25 % more for requests over 64 bytes).
use criterion::{BatchSize, Criterion};
use radixgate::base::rng::Rng;
use radixgate::kv::index::{
    chain_hashes, ChainMemo, EngineHash, IndexConfig, IndexWriter, KvEvent, MatchScratch, Source,
    ROOT_PARENT,
};
use radixgate::kv::wire::BlockStored;
use std::alloc::{GlobalAlloc, Layout};
use std::hint::black_box;
use std::sync::atomic::{AtomicIsize, Ordering::Relaxed};
use std::time::Duration;

/// mimalloc, counting live requested bytes (realloc and zeroed allocation go through these two).
struct Live;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded unchanged to mimalloc; the counter does not affect allocation.
unsafe impl GlobalAlloc for Live {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Relaxed);
        mimalloc::MiMalloc.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Relaxed);
        mimalloc::MiMalloc.dealloc(p, l)
    }
}

#[global_allocator]
static GLOBAL: Live = Live;

const MODEL: &str = "model";
const BS: usize = 64;
const PER_EVENT: usize = 16;

/// Conversations per source, each a chain of 16-block events with fresh engine ids.
struct Traffic {
    rng: Rng,
    next_hash: u64,
    /// Per source, per conversation: the engine id of its last block.
    tips: Vec<Vec<Option<EngineHash>>>,
}

impl Traffic {
    fn new(sources: usize, conversations: usize) -> Self {
        Traffic {
            rng: Rng::with_seed(7),
            next_hash: 1,
            tips: vec![vec![None; conversations]; sources],
        }
    }

    /// The next event: a random conversation of `source` grows by 16 blocks (a new one starts
    /// when it has grown 8 times, as a chat ends).
    fn event(&mut self, source: usize) -> KvEvent {
        let c = self.rng.below(self.tips[source].len());
        let parent = self.tips[source][c];
        let engine_hashes: Vec<EngineHash> = (0..PER_EVENT as u64)
            .map(|i| EngineHash(self.next_hash + i))
            .collect();
        self.next_hash += PER_EVENT as u64;
        let token_ids = (0..PER_EVENT * BS)
            .map(|_| self.rng.below(150_000) as u32)
            .collect();
        let restart = self.rng.below(8) == 0;
        self.tips[source][c] = if restart {
            None
        } else {
            engine_hashes.last().copied()
        };
        stored(engine_hashes, parent, token_ids)
    }
}

fn src(i: usize) -> Source {
    Source {
        worker: i as u32,
        dp_rank: 0,
    }
}

/// Stores `tokens` on `source` as one chain of 16-block events.
/// A `BlockStored` event as the decoder produces it.
fn stored(
    block_hashes: Vec<EngineHash>,
    parent: Option<EngineHash>,
    token_ids: Vec<u32>,
) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes,
        parent,
        token_ids,
        block_size: BS as u32,
        lora_id: None,
        medium: None,
        cache_salt: None,
        lora_name: None,
    })
}

fn store_prompt(w: &mut IndexWriter, source: Source, tokens: &[u32], first_id: u64) {
    let mut parent = None;
    for (i, part) in tokens.chunks(PER_EVENT * BS).enumerate() {
        let n = part.len() / BS;
        if n == 0 {
            break;
        }
        let base = first_id + (i * PER_EVENT) as u64;
        let engine_hashes: Vec<EngineHash> = (0..n as u64).map(|b| EngineHash(base + b)).collect();
        let e = stored(engine_hashes.clone(), parent, part[..n * BS].to_vec());
        w.apply(MODEL, source, &e).expect("stored");
        parent = engine_hashes.last().copied();
    }
}

fn memory_per_block() {
    for sharing in [1usize, 2] {
        let before = LIVE.load(Relaxed);
        let mut w = IndexWriter::new(IndexConfig::default());
        let mut t = Traffic::new(8, 64);
        let events = 1_000_000 / PER_EVENT / sharing;
        for i in 0..events {
            let e = t.event(i % 8);
            for k in 0..sharing {
                // Shared: the same event also on a second source (different engine ids would
                // not matter: the keys are the tokens' own hashes).
                w.apply(MODEL, src((i % 8) + 8 * k), &e).expect("stored");
            }
        }
        w.publish();
        let bytes = LIVE.load(Relaxed) - before;
        let held = w.held();
        println!(
            "kv_index memory: {held} blocks held ({} distinct, {sharing} source(s) each): \
             {:.1} bytes requested per block held",
            w.stats().distinct(),
            bytes as f64 / held as f64
        );
    }
}

fn filled_index() -> (IndexWriter, Traffic) {
    let cfg = IndexConfig {
        max_blocks_per_source: 64 * 1024,
        ..IndexConfig::default()
    };
    let mut w = IndexWriter::new(cfg);
    let mut t = Traffic::new(8, 64);
    for i in 0..(8 * 64 * 1024 / PER_EVENT) + 1_000 {
        let e = t.event(i % 8);
        w.apply(MODEL, src(i % 8), &e).expect("stored");
    }
    w.publish();
    (w, t)
}

fn bench(c: &mut Criterion) {
    memory_per_block();
    let (mut w, mut t) = filled_index();
    println!("kv_index: filled index holds {} blocks", w.held());
    let mut g = c.benchmark_group("kv_index");
    g.measurement_time(Duration::from_secs(5));
    let mut i = 0;
    g.bench_function("apply/stored_16x64", |b| {
        b.iter_batched(
            || {
                i += 1;
                (i % 8, t.event(i % 8))
            },
            |(s, e)| w.apply(MODEL, src(s), &e).is_ok(),
            BatchSize::SmallInput,
        )
    });
    g.bench_function("apply/stored_16x64+publish", |b| {
        b.iter_batched(
            || {
                i += 1;
                (i % 8, t.event(i % 8))
            },
            |(s, e)| {
                let ok = w.apply(MODEL, src(s), &e).is_ok();
                w.publish();
                ok
            },
            BatchSize::SmallInput,
        )
    });
    g.bench_function("apply/16_events_of_16x64+publish", |b| {
        b.iter_batched(
            || {
                (0..16)
                    .map(|_| {
                        i += 1;
                        (i % 8, t.event(i % 8))
                    })
                    .collect::<Vec<_>>()
            },
            |events| {
                for (s, e) in &events {
                    black_box(w.apply(MODEL, src(*s), e).is_ok());
                }
                w.publish();
                events
            },
            BatchSize::SmallInput,
        )
    });
    g.bench_function("publish", |b| b.iter(|| w.publish()));
    // Conversations live far shorter than the cap's window, so none loses its tip to eviction.
    let stats = w.stats();
    assert_eq!(
        stats.dropped_unknown_parent(),
        0,
        "a live conversation was evicted"
    );
    println!(
        "kv_index: {} events applied, {} blocks evicted at the per-source cap",
        stats.events(),
        stats.evicted()
    );

    let mut rng = Rng::with_seed(11);
    let prompt: Vec<u32> = (0..100_000).map(|_| rng.below(150_000) as u32).collect();
    let blocks = prompt.len() / BS;
    let mut id = 1 << 40;
    for (source, upto) in [
        (0, blocks),
        (1, blocks),
        (2, blocks / 2),
        (3, blocks / 2),
        (4, 100),
    ] {
        store_prompt(&mut w, src(source), &prompt[..upto * BS], id);
        id += 1 << 20;
    }
    w.publish();
    let reader = w.reader();
    let mut scratch = MatchScratch::default();
    let snap = reader.load();
    let got = snap.match_prefix(MODEL, ROOT_PARENT, &prompt, &mut scratch);
    assert_eq!(got.iter().map(|m| m.blocks).max(), Some(blocks as u32));
    assert_eq!(got.len(), 5);
    drop(snap);
    let miss: Vec<u32> = prompt.iter().map(|t| t + 1).collect();
    let cases: [(&str, &[u32]); 3] = [
        ("match/100k", &prompt),
        ("match/4k", &prompt[..4096]),
        ("match/miss_100k", &miss),
    ];
    for (name, tokens) in cases {
        g.bench_function(name, |b| {
            b.iter(|| {
                let snap = reader.load();
                let got = snap.match_prefix(MODEL, ROOT_PARENT, black_box(tokens), &mut scratch);
                black_box(got.len())
            })
        });
        // What the request path does: hash the prompt into its chain once, then match the
        // chain (binary search per holder).
        let (mut chain, mut buf) = (Vec::new(), Vec::new());
        g.bench_function(format!("chain_{name}"), |b| {
            b.iter(|| {
                chain_hashes(
                    black_box(tokens),
                    BS,
                    ROOT_PARENT,
                    usize::MAX,
                    &mut chain,
                    &mut buf,
                );
                let snap = reader.load();
                let got = snap.match_chain(MODEL, &chain, &mut scratch);
                black_box(got.len())
            })
        });
    }
    g.finish();
    chain_memo(c);
    transfer(c);
}

/// Turn 10's chain hashed whole against the same through a memo holding the previous turn.
fn chain_memo(c: &mut Criterion) {
    let mut rng = Rng::with_seed(5);
    let history: Vec<u32> = (0..4096).map(|_| rng.below(150_000) as u32).collect();
    let turn = |rng: &mut Rng| {
        let mut p = history.clone();
        p.extend((0..130).map(|_| rng.below(150_000) as u32));
        p
    };
    let mut g = c.benchmark_group("chain");
    let (mut chain, mut buf) = (Vec::new(), Vec::new());
    g.bench_function("turn10_4k_bs1/hashed", |b| {
        b.iter_batched(
            || turn(&mut rng),
            |p| {
                chain_hashes(
                    black_box(&p),
                    1,
                    ROOT_PARENT,
                    usize::MAX,
                    &mut chain,
                    &mut buf,
                );
                chain.len()
            },
            BatchSize::SmallInput,
        )
    });
    let mut memo = ChainMemo::new();
    memo.compute(&turn(&mut rng), 1, ROOT_PARENT, usize::MAX, &mut buf);
    g.bench_function("turn10_4k_bs1/memo", |b| {
        b.iter_batched(
            || turn(&mut rng),
            |p| {
                memo.compute(black_box(&p), 1, ROOT_PARENT, usize::MAX, &mut buf);
                memo.chain().len()
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

/// Export and import of a 1M-block index.
fn transfer(c: &mut Criterion) {
    let mut w = IndexWriter::new(IndexConfig::default());
    let mut t = Traffic::new(8, 64);
    for i in 0..1_000_000 / PER_EVENT {
        let e = t.event(i % 8);
        w.apply(MODEL, src(i % 8), &e).expect("stored");
    }
    let url_of = |worker: u32| Some(format!("http://10.0.0.{worker}:30000"));
    let worker_of = |url: &str| {
        url.strip_prefix("http://10.0.0.")?
            .strip_suffix(":30000")?
            .parse()
            .ok()
    };
    let data = w.export(url_of, |_| Some(0));
    println!(
        "kv_index transfer: {} blocks exported in {} bytes, {:.2} bytes per block",
        w.held(),
        data.len(),
        data.len() as f64 / w.held() as f64
    );
    let mut g = c.benchmark_group("kv_index");
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(10));
    g.bench_function("transfer/export_copy_1M", |b| {
        b.iter_batched(
            || (),
            |()| w.export_copy(url_of, |_| Some(0)),
            BatchSize::PerIteration,
        )
    });
    g.bench_function("transfer/export_1M", |b| {
        b.iter(|| w.export(url_of, |_| Some(0)).len())
    });
    g.bench_function("transfer/import_1M", |b| {
        b.iter_batched(
            || IndexWriter::new(IndexConfig::default()),
            |mut into| {
                let summary = into.import(&data, worker_of).expect("import");
                assert_eq!(into.held(), w.held(), "{summary:?}");
                into
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}
