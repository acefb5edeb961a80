//! Routing inputs from a request body (`route::extract`): the JSON scan every routed request
//! pays, at the body sizes `scripts/bench-vs-peers.sh` sends (1 KiB, 16 KiB, 400 KiB of
//! multi-turn chat), plain ASCII and with the escapes and non-ASCII text real chats carry.
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use radixgate::route::extract::{extract, extract_for, Api};
use std::hint::black_box;

const WORDS: [&str; 16] = [
    "the", "cache", "prefix", "server", "token", "routing", "model", "answer", "gateway",
    "request", "history", "prompt", "turn", "worker", "latency", "batch",
];

/// How often a chat body's messages carry escapes.
#[derive(Clone, Copy, PartialEq)]
enum Escapes {
    /// None: every string stays borrowed from the body.
    None,
    /// A paragraph break (`\n\n`) every 40 words, as in `scripts/bench-vs-peers.sh`'s bodies:
    /// every message is unescaped, but in long plain runs.
    Paragraphs,
    /// `\n`, `\"` and non-ASCII words every few words.
    Dense,
}

/// A chat-completion body of about `size` bytes: alternating user/assistant messages of words,
/// with `escapes`.
fn chat_body(size: usize, escapes: Escapes) -> Vec<u8> {
    let mut out = String::from(r#"{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":["#);
    let mut i = 0usize;
    let mut turn = 0;
    while out.len() < size {
        if turn > 0 {
            out.push(',');
        }
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        out.push_str(&format!(r#"{{"role":"{role}","content":""#));
        for w in 0..120 {
            if w > 0 {
                out.push(' ');
            }
            out.push_str(WORDS[i % WORDS.len()]);
            if escapes == Escapes::Dense && i % 7 == 3 {
                out.push_str(r#"\n\"quoted\" café naïve"#);
            }
            if escapes == Escapes::Paragraphs && w % 40 == 39 {
                out.push_str(r#".\n\nThe"#);
            }
            i = i.wrapping_mul(31).wrapping_add(17) % 1009;
        }
        out.push_str(r#""}"#);
        turn += 1;
    }
    out.push_str(r#"],"max_tokens":1,"stream":false}"#);
    out.into_bytes()
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("extract_chat");
    for (name, size) in [("1k", 1024), ("16k", 16 * 1024), ("400k", 400 * 1024)] {
        for (escapes, kind) in [
            (Escapes::None, ""),
            (Escapes::Paragraphs, "_paragraphs"),
            (Escapes::Dense, "_escapes"),
        ] {
            let body = chat_body(size, escapes);
            assert!(extract(Api::Chat, &body).is_ok());
            g.throughput(Throughput::Bytes(body.len() as u64));
            let id = format!("{name}{kind}");
            g.bench_with_input(BenchmarkId::from_parameter(id), &body, |b, body| {
                b.iter(|| black_box(extract(Api::Chat, black_box(body)).unwrap().text.len()))
            });
        }
    }
    g.finish();
    // What round_robin and the other policies that never read the prompt pay: validation,
    // `model` and `stream`, no text.
    let mut g = c.benchmark_group("extract_chat_no_text");
    for (name, size, escapes) in [
        ("16k", 16 * 1024, Escapes::None),
        ("16k_paragraphs", 16 * 1024, Escapes::Paragraphs),
        ("16k_escapes", 16 * 1024, Escapes::Dense),
        ("400k_escapes", 400 * 1024, Escapes::Dense),
    ] {
        let body = chat_body(size, escapes);
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_with_input(BenchmarkId::from_parameter(name), &body, |b, body| {
            b.iter(|| {
                black_box(
                    extract_for(Api::Chat, black_box(body), false)
                        .unwrap()
                        .stream,
                )
            })
        });
    }
    g.finish();
    // SGLang's native `/generate` with token ids (RL frameworks send these): the ids become the
    // routing text as decimals joined by spaces.
    let mut g = c.benchmark_group("extract_generate_ids");
    let ids: Vec<String> = (0..4000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) % 128_000).to_string())
        .collect();
    let body = format!(
        r#"{{"input_ids":[{}],"sampling_params":{{"max_new_tokens":1}}}}"#,
        ids.join(",")
    );
    g.throughput(Throughput::Elements(ids.len() as u64));
    g.bench_function("4k", |b| {
        b.iter(|| {
            black_box(
                extract(Api::Generate, black_box(body.as_bytes()))
                    .unwrap()
                    .text
                    .len(),
            )
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
