//! What `--enable-trace` costs a serving core per request: the spans of one request as the
//! exchange records them (server span with its attributes, admit, route with the decision's
//! attributes, one attempt whose `traceparent` goes upstream, first byte and end of stream,
//! then the push into the core's queue), against tracing off (the gateway holds no tracer: one
//! `Option` test). The export thread's work (conversion, protobuf, gRPC) is not on a core and
//! is not measured here. Also the upstream head with and without the injected `traceparent`.
//! Run: `cargo bench --bench trace -- --warm-up-time 1 --measurement-time 3`.

use bytes::{Bytes, BytesMut};
use criterion::{criterion_group, criterion_main, Criterion};
use radixgate::base::entropy::Entropy;
use radixgate::http::{parse_request_head, HeadLimits};
use radixgate::proxy::forward::{OwnHeaders, TraceHeaders, UpstreamRequest};
use radixgate::trace::span::{now_ns, Kind, Leg, Value};
use radixgate::trace::{Settings, Tracer};
use std::hint::black_box;
use std::time::{Duration, Instant};

/// Requests recorded between two drains of the queue (the export thread's job).
const BATCH: u64 = 256;

/// One request's spans, as `serve::exchange` records them.
fn one_request(tracer: &Tracer, e: &mut Entropy, traceparent: Option<&[u8]>) {
    let Some(mut t) = tracer.begin(traceparent, None, true, e) else {
        return;
    };
    let start = now_ns();
    t.set("http.request.method", String::from("POST"));
    t.set("url.path", String::from("/v1/chat/completions"));
    t.child(e, "admit", start, now_ns(), vec![]);
    t.set(
        "radixgate.request_id",
        String::from("chatcmpl-0123456789abcdefghijklmn"),
    );
    t.set("gen_ai.request.model", String::from("qwen3-8b"));
    t.set("radixgate.stream", true);
    let r0 = now_ns();
    let mut attrs: Vec<(&'static str, Value)> = Vec::with_capacity(8);
    attrs.push(("radixgate.policy", "cache_aware".into()));
    attrs.push(("radixgate.branch", "cache_hit".into()));
    attrs.push(("radixgate.matched_length", 1200i64.into()));
    attrs.push(("radixgate.predicted_length", 1200i64.into()));
    attrs.push(("radixgate.request_size", 1800i64.into()));
    attrs.push((
        "radixgate.worker",
        String::from("http://10.0.0.7:30000").into(),
    ));
    let id = t.new_span_id(e);
    t.child_with_id(id, Kind::Internal, "route", r0, now_ns(), attrs, None);
    let attrs = vec![
        (
            "radixgate.worker",
            Value::from(String::from("http://10.0.0.7:30000")),
        ),
        ("radixgate.attempt", Value::from(1i64)),
    ];
    t.start_attempt(e, now_ns(), attrs);
    black_box(t.traceparent_for(t.upstream_parent_of(Leg::Prefill)));
    t.attempt_set("http.response.status_code", 200i64);
    let end = now_ns();
    t.event("first_byte", end);
    t.event("end_of_stream", end);
    t.attempt_set("radixgate.body_bytes", 4096i64);
    t.attempt_set("radixgate.stream_events", 64i64);
    t.end_attempt(end, None);
    t.set("http.response.status_code", 200i64);
    tracer.submit(0, t.finish(now_ns()));
}

/// `iters` requests timed in batches; the queue is drained between batches, untimed.
fn timed(tracer: &Tracer, iters: u64, traceparent: Option<&[u8]>) -> Duration {
    let mut e = Entropy::default();
    let mut out = Vec::with_capacity(8192);
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(BATCH);
        let t0 = Instant::now();
        for _ in 0..n {
            one_request(tracer, &mut e, traceparent);
        }
        total += t0.elapsed();
        left -= n;
        out.clear();
        tracer.drain(&mut out, usize::MAX);
    }
    assert_eq!(tracer.dropped(), 0, "the bench must not drop");
    total
}

fn record(c: &mut Criterion) {
    let mut g = c.benchmark_group("trace");
    // Off: the gateway has no tracer; the exchange tests one Option per phase.
    let off: Option<Tracer> = None;
    g.bench_function("off", |b| {
        let mut e = Entropy::default();
        b.iter(|| {
            if let Some(t) = black_box(&off).as_ref() {
                one_request(t, &mut e, None);
            }
        })
    });
    let on = Tracer::detached(&Settings::default());
    g.bench_function("on_new_trace", |b| b.iter_custom(|n| timed(&on, n, None)));
    let parent = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    g.bench_function("on_continued_trace", |b| {
        b.iter_custom(|n| timed(&on, n, Some(parent)))
    });
    // Ratio 0.01, no caller context: what an unsampled request costs (its trace id is drawn).
    let sampled = Tracer::detached(&Settings {
        ratio: 0.01,
        ..Settings::default()
    });
    g.bench_function("ratio_0.01", |b| {
        b.iter_custom(|n| timed(&sampled, n, None))
    });
    g.finish();
}

fn upstream_head(c: &mut Criterion) {
    let raw = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw:30000\r\n\
                User-Agent: OpenAI/Python 1.82.0\r\nContent-Type: application/json\r\n\
                Authorization: Bearer sk-0123\r\nContent-Length: 2\r\n\r\n";
    let head = parse_request_head(&mut BytesMut::from(&raw[..]), &HeadLimits::default())
        .unwrap()
        .unwrap();
    let tp = *b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let build = |trace: Option<TraceHeaders<'_>>| {
        UpstreamRequest::build(
            b"POST",
            b"/v1/chat/completions",
            Some(&head),
            None,
            "10.0.0.7:30000",
            "chatcmpl-0123456789abcdefghijklmn",
            Bytes::from_static(b"{}"),
            trace,
            &OwnHeaders::default(),
        )
    };
    let mut g = c.benchmark_group("upstream_head");
    g.bench_function("plain", |b| b.iter(|| black_box(build(None))));
    g.bench_function("with_traceparent", |b| {
        b.iter(|| {
            black_box(build(Some(TraceHeaders {
                traceparent: &tp,
                tracestate: None,
            })))
        })
    });
    g.finish();
}

criterion_group!(benches, record, upstream_head);
criterion_main!(benches);
