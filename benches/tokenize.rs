//! Tokenizer benchmarks (`cargo bench --bench tokenize`), with the simulator's cl100k vocabulary
//! converted to a HF folder (`sim-worker --write-tokenizer`, written to a temp dir here) and the
//! Llama-3 chat template: the realistic cost of `radixgate::tokenize` on one core.
//!
//! - `chat/cold_4k`: a ~4k-token chat (system prompt + 9 turns) into an empty `SegmentCache`:
//!   render + every piece encoded.
//! - `chat/warm_turn10_4k`: turn 10 of that conversation with the first 9 turns' pieces cached;
//!   only the new ~100-token user message is encoded (a fresh one per iteration).
//! - `chat/render_4k`: the template render alone (what the warm path cannot avoid).
//! - `encode/prose_4k`: `tokenizers`' encode of ~4k tokens of prose, uncached (throughput in
//!   tokens/s on one core: criterion's elements/s); beside it the same text through the
//!   simulator's tiktoken and the cl100k pre-tokenizer regex alone (where the time goes).
//! - `worst/*`: 64 KiB of one shape each (bytes/s → µs per KiB): prose, one letter repeated,
//!   letters without whitespace, digits, whitespace, CJK, random bytes as text; `a_16k` next to
//!   `a_64k` shows whether a run without whitespace costs more than linear time.
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{BatchSize, Criterion, Throughput};
use radixgate::base::rng::Rng;
use radixgate::tokenize::{Limits, SegmentCache, Tokenizer};
use serde_json::json;

/// The gateway binary's allocator: `tokenizers` allocates per word, so the allocator shows.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn words(rng: &mut Rng, tokens: usize) -> String {
    let mut s = String::new();
    loadtest::loadgen::text::push_words(
        &mut s,
        &mut loadtest::rng::Rng::new(rng.next_u64()),
        tokens,
    );
    s
}

fn body(msgs: &[(String, String)]) -> Vec<u8> {
    let m: Vec<_> = msgs
        .iter()
        .map(|(r, c)| json!({"role": r, "content": c}))
        .collect();
    json!({"model": "m", "messages": m, "max_tokens": 64})
        .to_string()
        .into_bytes()
}

fn main() {
    let dir = std::env::temp_dir().join(format!("radixgate-bench-cl100k-{}", std::process::id()));
    loadtest::sim::hf_export::write_cl100k_folder(&dir).expect("write cl100k folder");
    let limits = Limits {
        max_word_bytes: 1 << 20,
        ..Limits::default()
    };
    let tok = Arc::new(Tokenizer::from_path_with(&dir, limits).expect("load cl100k folder"));
    let _ = std::fs::remove_dir_all(&dir);

    let mut rng = Rng::with_seed(42);
    // ~4k tokens: a 1,000-token system prompt and 9 turns of ~150 + ~190 tokens.
    let mut history = vec![("system".to_string(), words(&mut rng, 1000))];
    for _ in 0..9 {
        history.push(("user".into(), words(&mut rng, 150)));
        history.push(("assistant".into(), words(&mut rng, 190)));
    }
    let mut full = history.clone();
    full.push(("user".into(), words(&mut rng, 100)));
    let cold_body = body(&full);
    let mut ids = Vec::new();
    SegmentCache::new(tok.clone(), 1 << 20)
        .chat_ids(&cold_body, &mut ids)
        .unwrap();
    println!(
        "chat prompt: {} tokens, {} bytes of body",
        ids.len(),
        cold_body.len()
    );

    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();

    {
        let mut g = c.benchmark_group("chat");
        g.throughput(Throughput::Elements(ids.len() as u64));
        g.bench_function("cold_4k", |b| {
            b.iter_batched(
                || SegmentCache::new(tok.clone(), 1 << 20),
                |mut cache| {
                    let mut out = Vec::with_capacity(8192);
                    cache.chat_ids(black_box(&cold_body), &mut out).unwrap();
                    out
                },
                BatchSize::SmallInput,
            )
        });
        let mut warm = SegmentCache::new(tok.clone(), 1 << 20);
        for k in 1..=history.len() {
            let mut out = Vec::new();
            warm.chat_ids(&body(&history[..k]), &mut out).unwrap();
        }
        let mut n = 0u64;
        g.bench_function("warm_turn10_4k", |b| {
            b.iter_batched(
                || {
                    n += 1;
                    let mut m = history.clone();
                    m.push((
                        "user".into(),
                        format!("Question {n}: {}", words(&mut rng, 100)),
                    ));
                    body(&m)
                },
                |bd| {
                    let mut out = Vec::with_capacity(8192);
                    warm.chat_ids(&bd, &mut out).unwrap();
                    out
                },
                BatchSize::SmallInput,
            )
        });
        println!("warm cache after the bench: {:?}", warm.stats());
        g.bench_function("render_4k", |b| {
            b.iter(|| tok.render_chat(black_box(&cold_body)).unwrap())
        });
        g.finish();
    }

    let prose = words(&mut rng, 4000);
    let n = tok.encode(&prose, false).unwrap().len();
    {
        let mut g = c.benchmark_group("encode");
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function("one_word", |b| {
            b.iter(|| {
                tok.encode(black_box(" ten 1234567001"), false)
                    .unwrap()
                    .len()
            })
        });
        g.bench_function("prose_4k", |b| {
            b.iter(|| tok.encode(black_box(&prose), false).unwrap())
        });
        // The same text through the simulator's tiktoken, and the pre-tokenizer regex alone
        // (the cl100k spelling with possessive quantifiers, and the classic Llama-3 one).
        let sim = loadtest::sim::tokenizer::SimTokenizer::new(
            loadtest::sim::tokenizer::TokenizerMode::Bpe,
        );
        g.bench_function("prose_4k_tiktoken", |b| {
            b.iter(|| {
                let mut out = Vec::new();
                sim.encode_plain(black_box(&prose), &mut out);
                out
            })
        });
        for (name, pat) in [
            (
                "prose_4k_regex_cl100k",
                loadtest::sim::hf_export::CL100K_PATTERN,
            ),
            (
                "prose_4k_regex_classic",
                radixgate::tokenize::folder::LLAMA3_PATTERN,
            ),
        ] {
            let re = tokenizers::utils::SysRegex::new(pat).unwrap();
            g.bench_function(name, |b| b.iter(|| re.find_iter(black_box(&prose)).count()));
        }
        g.finish();
    }

    let kib64 = 64 << 10;
    let mut r = Rng::with_seed(7);
    let shapes: Vec<(&str, String)> = vec![
        ("prose_64k", {
            let mut s = words(&mut rng, 20_000);
            let cut = (0..=kib64.min(s.len()))
                .rev()
                .find(|&i| s.is_char_boundary(i))
                .unwrap_or(0);
            s.truncate(cut);
            s
        }),
        ("a_16k", "a".repeat(16 << 10)),
        ("a_64k", "a".repeat(kib64)),
        (
            "letters_64k",
            (0..kib64)
                .map(|_| (b'a' + r.below(26) as u8) as char)
                .collect(),
        ),
        (
            "digits_64k",
            (0..kib64)
                .map(|_| (b'0' + r.below(10) as u8) as char)
                .collect(),
        ),
        ("spaces_64k", " ".repeat(kib64)),
        ("newlines_64k", " \n".repeat(kib64 / 2)),
        ("cjk_64k", "日本語の文章".repeat(kib64 / 18)),
        ("punct_64k", "!?.,;:-+*/".repeat(kib64 / 10)),
        (
            "random_64k",
            String::from_utf8_lossy(&(0..kib64).map(|_| r.below(256) as u8).collect::<Vec<_>>())
                .into_owned(),
        ),
    ];
    let mut g = c.benchmark_group("worst");
    g.sample_size(10);
    for (name, text) in &shapes {
        g.throughput(Throughput::Bytes(text.len() as u64));
        g.bench_function(*name, |b| {
            b.iter(|| tok.encode(black_box(text), false).unwrap())
        });
    }
    g.finish();
    c.final_summary();
}
