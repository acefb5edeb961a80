//! HTTP/1.1 framing costs on the request path: head parse (typical chat request and a
//! header-heavy one), chunked request-body decode, and the chunk tracker over an SSE-like
//! response stream. Run: `cargo bench --bench http -- --warm-up-time 1 --measurement-time 3`.

use std::hint::black_box;

use bytes::BytesMut;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use radixgate::http::{parse_request_head, ChunkTracker, ChunkedDecoder, HeadLimits};

/// What an OpenAI-SDK chat request head looks like on the wire: 8 headers.
fn chat_head() -> Vec<u8> {
    b"POST /v1/chat/completions HTTP/1.1\r\n\
      Host: gateway.internal:30000\r\n\
      User-Agent: OpenAI/Python 1.82.0\r\n\
      Accept: application/json\r\n\
      Accept-Encoding: gzip, deflate\r\n\
      Content-Type: application/json\r\n\
      Authorization: Bearer sk-0123456789abcdef0123456789abcdef\r\n\
      X-Request-Id: 6f1c2a9e-4b7d-4c1e-9a3f-2d8e5b7c1a04\r\n\
      Content-Length: 1834\r\n\r\n"
        .to_vec()
}

/// A header-heavy head (browser + tracing + proxies): 30 headers.
fn big_head() -> Vec<u8> {
    let mut v = b"POST /v1/chat/completions?trace=1 HTTP/1.1\r\nHost: gateway.internal\r\nContent-Length: 512\r\n"
        .to_vec();
    let names = [
        "User-Agent",
        "Accept",
        "Accept-Language",
        "Accept-Encoding",
        "Content-Type",
        "Authorization",
        "X-Request-Id",
        "X-Correlation-Id",
        "Traceparent",
        "Tracestate",
        "X-Forwarded-For",
        "X-Forwarded-Proto",
        "X-Forwarded-Host",
        "X-Real-Ip",
        "Cookie",
        "Origin",
        "Referer",
        "Sec-Fetch-Mode",
        "Sec-Fetch-Site",
        "Sec-Fetch-Dest",
        "Cache-Control",
        "Pragma",
        "Dnt",
        "X-Smg-Routing-Key",
        "X-Tenant",
        "X-Api-Version",
        "Baggage",
    ];
    for (i, name) in names.iter().enumerate() {
        v.extend_from_slice(format!("{name}: value-{i}-{}\r\n", "v".repeat(20 + i)).as_bytes());
    }
    v.extend_from_slice(b"\r\n");
    v
}

fn bench_heads(c: &mut Criterion) {
    let limits = HeadLimits::default();
    let mut group = c.benchmark_group("http_head");
    for (name, raw) in [
        ("parse_chat_8_headers", chat_head()),
        ("parse_30_headers", big_head()),
    ] {
        group.throughput(Throughput::Bytes(raw.len() as u64));
        // The server reads into a reused BytesMut and parses in place; copying the bytes in
        // stands in for that read, and freeing the frozen head lets the buffer be reused.
        let mut buf = BytesMut::with_capacity(16 * 1024);
        group.bench_function(name, |b| {
            b.iter(|| {
                buf.extend_from_slice(&raw);
                let head = parse_request_head(&mut buf, &limits);
                black_box(head.ok().flatten().map(|h| h.framing))
            })
        });
    }
    group.finish();
}

/// `body` as chunks of `chunk` bytes, with the terminating chunk.
fn chunked(body: &[u8], chunk: usize) -> Vec<u8> {
    let mut wire = Vec::with_capacity(body.len() + body.len() / chunk * 10 + 8);
    for part in body.chunks(chunk) {
        wire.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
        wire.extend_from_slice(part);
        wire.extend_from_slice(b"\r\n");
    }
    wire.extend_from_slice(b"0\r\n\r\n");
    wire
}

fn bench_chunked(c: &mut Criterion) {
    let mut group = c.benchmark_group("http_chunked");

    let body: Vec<u8> = (0..64 * 1024).map(|i| b'a' + (i % 26) as u8).collect();
    let wire = chunked(&body, 1024);
    group.throughput(Throughput::Bytes(wire.len() as u64));
    let mut out = BytesMut::with_capacity(body.len());
    group.bench_function("decode_64k_in_1k_chunks", |b| {
        b.iter(|| {
            out.clear();
            let mut d = ChunkedDecoder::new(32 << 20);
            // Fed in 16 KiB reads, like the server's read buffer.
            for read in wire.chunks(16 * 1024) {
                let _ = black_box(d.feed(read, &mut out));
            }
            black_box(d.is_done())
        })
    });

    // An SSE token stream: 1,000 events of ~60 bytes, each its own chunk, read a few at a time.
    let mut sse = Vec::new();
    for i in 0..1000 {
        let ev = format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"tok{i}\"}}}}]}}\n\n");
        sse.extend_from_slice(format!("{:x}\r\n{ev}\r\n", ev.len()).as_bytes());
    }
    sse.extend_from_slice(b"0\r\n\r\n");
    group.throughput(Throughput::Bytes(sse.len() as u64));
    group.bench_function("track_sse_1000_events", |b| {
        b.iter(|| {
            let mut t = ChunkTracker::new();
            let mut end = None;
            for read in sse.chunks(512) {
                if let Ok(Some(n)) = t.feed(read) {
                    end = Some(n);
                }
            }
            black_box(end)
        })
    });
    group.finish();
}

criterion_group!(benches, bench_heads, bench_chunked);
criterion_main!(benches);
