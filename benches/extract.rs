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

/// A chat-completion body of about `size` bytes: alternating user/assistant messages of words;
/// `rich` adds escapes (`\n`, `\"`) and non-ASCII words every few words.
fn chat_body(size: usize, rich: bool) -> Vec<u8> {
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
            if rich && i % 7 == 3 {
                out.push_str(r#"\n\"quoted\" café naïve"#);
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
        for rich in [false, true] {
            let body = chat_body(size, rich);
            assert!(extract(Api::Chat, &body).is_ok());
            g.throughput(Throughput::Bytes(body.len() as u64));
            let id = format!("{name}{}", if rich { "_escapes" } else { "" });
            g.bench_with_input(BenchmarkId::from_parameter(id), &body, |b, body| {
                b.iter(|| black_box(extract(Api::Chat, black_box(body)).unwrap().text.len()))
            });
        }
    }
    g.finish();
    // What round_robin and the other policies that never read the prompt pay: validation,
    // `model` and `stream`, no text.
    let mut g = c.benchmark_group("extract_chat_no_text");
    for (name, size) in [("16k", 16 * 1024), ("400k", 400 * 1024)] {
        let body = chat_body(size, true);
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
