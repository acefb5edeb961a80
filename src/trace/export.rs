//! The export thread: every [`super::EXPORT_INTERVAL`] (sooner when a core's queue is half
//! full) it takes the queued span records, turns them into the SDK's `SpanData` and sends them
//! in batches through `opentelemetry-otlp`'s gRPC exporter, each batch at most 512 spans and
//! at most `--trace-export-batch-bytes` as [`encoded_bound`] reckons its protobuf size (a
//! collector refuses a whole request over its message limit, 4 MiB by default). The exporter is async (tonic), so
//! this thread owns a current-thread tokio runtime; no serving core ever touches it. A failed
//! export is logged (at most once a minute) and its spans are lost: a collector that is down
//! must not make the gateway hold memory.

use super::span::{Kind, SpanRecord, Value};
use super::{DropReason, Tracer};
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanExporter as _};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, UNIX_EPOCH};

/// Spans per export call (the reference SDK's default batch size).
const MAX_BATCH: usize = 512;
/// How long one export may take before it counts as failed.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);
/// At most one log line about failing exports per this long.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// Bytes of a varint holding `n` (protobuf's length prefixes).
fn varint_len(n: usize) -> usize {
    let bits = usize::BITS - (n | 1).leading_zeros();
    bits.div_ceil(7) as usize
}

/// A length-delimited protobuf field of `n` bytes, with a one-byte tag.
fn field(n: usize) -> usize {
    1 + varint_len(n) + n
}

/// A string or bytes field, absent when empty (protobuf omits default values).
fn text(n: usize) -> usize {
    if n == 0 {
        0
    } else {
        field(n)
    }
}

/// An attribute (`KeyValue` of `key` and an `AnyValue`) as it is encoded.
fn attribute(key: &str, value: &Value) -> usize {
    let any = match value {
        Value::Str(s) => field(s.len()),
        // A varint of at most 10 bytes, and its tag.
        Value::Int(_) => 11,
        Value::Bool(_) => 2,
    };
    field(text(key.len()) + field(any))
}

/// At least the size of `r` in an OTLP export request (`Span` inside `ScopeSpans`, protobuf),
/// and close to it: what a batch is split by. Fields as `opentelemetry-proto` encodes them:
/// ids, flags, name, kind, times, attributes, events, status and `tracestate`.
pub fn encoded_bound(r: &SpanRecord) -> usize {
    let ids = field(16) + field(8) + if r.parent_id == [0; 8] { 0 } else { field(8) };
    // flags (fixed32, a two-byte tag), kind, start and end (fixed64).
    let fixed = (2 + 4) + 2 + 9 + 9;
    let attrs: usize = r.attrs.iter().map(|(k, v)| attribute(k, v)).sum();
    let events: usize = r
        .events
        .iter()
        .map(|(name, _)| field(9 + text(name.len())))
        .sum();
    let status = field(r.error.as_ref().map_or(0, |e| text(e.len())) + 2);
    let state = r.trace_state.as_ref().map_or(0, |s| text(s.len()));
    field(ids + fixed + text(r.name.len()) + attrs + events + status + state)
}

/// At least what one export request adds to its spans: the request, resource and scope
/// envelopes with the resource's attributes (`OTEL_RESOURCE_ATTRIBUTES` can make them long)
/// and the scope's name and version, plus gRPC's 5-byte frame header.
fn request_overhead(resource: &opentelemetry_sdk::Resource) -> usize {
    let attrs: usize = resource
        .iter()
        .map(|(k, v)| field(field(k.as_str().len()) + field(field(v.as_str().len()) + 16)))
        .sum();
    // Envelopes (each a tag and a length of at most 5 bytes), schema URLs, the scope.
    256 + attrs + resource.schema_url().map_or(0, str::len) + env!("CARGO_PKG_VERSION").len()
}

/// How many of the spans whose [`encoded_bound`] are `sizes` each export request takes, in
/// order: as many as fit under `limit` bytes with `overhead`; a span too large for any request
/// goes alone (the collector decides).
pub fn batch_lengths(sizes: &[usize], overhead: usize, limit: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let (mut n, mut bytes) = (0usize, overhead);
    for &size in sizes {
        if n > 0 && bytes.saturating_add(size) > limit {
            out.push(n);
            (n, bytes) = (0, overhead);
        }
        n += 1;
        bytes = bytes.saturating_add(size);
    }
    if n > 0 {
        out.push(n);
    }
    out
}

/// `endpoint` as tonic wants it: with a scheme (`localhost:4317` → `http://localhost:4317`).
pub fn endpoint_url(endpoint: &str) -> String {
    if endpoint.contains("://") {
        endpoint.to_string()
    } else {
        format!("http://{endpoint}")
    }
}

/// Start the export thread for `tracer`, sending to `endpoint`. Fails when the thread, its
/// runtime or the exporter cannot be built (a bad endpoint URL); an unreachable collector is
/// not an error here (the channel connects lazily, and reconnects).
pub(super) fn spawn(tracer: &Arc<Tracer>, endpoint: &str) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("tracing: cannot build the export runtime: {e}"))?;
    let url = endpoint_url(endpoint);
    let mut exporter = {
        // tonic builds its channel on the runtime's reactor.
        let _in_rt = rt.enter();
        opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(url.clone())
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| format!("tracing: cannot export to {url}: {e}"))?
    };
    let resource = resource();
    exporter.set_resource(&resource);
    let overhead = request_overhead(&resource);
    let t = tracer.clone();
    let handle = std::thread::Builder::new()
        .name("radixgate-trace".into())
        .spawn(move || {
            if let Err(e) = crate::base::priority::helper_thread() {
                crate::log!(Warn, "trace thread: cannot lower its priority: {e}");
            }
            run(&t, &rt, &exporter, overhead);
            let _ = exporter.shutdown();
        })
        .map_err(|e| format!("cannot start the trace thread: {e}"))?;
    let _ = tracer.thread.set(handle.thread().clone());
    if let Ok(mut h) = tracer.handle.lock() {
        *h = Some(handle);
    }
    crate::log!(Info, "tracing: exporting spans over OTLP/gRPC to {url}");
    Ok(())
}

/// `service.name` is `radixgate` unless `OTEL_SERVICE_NAME` says otherwise; the SDK's
/// environment detectors add `OTEL_RESOURCE_ATTRIBUTES`.
fn resource() -> opentelemetry_sdk::Resource {
    let b = opentelemetry_sdk::Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_some() {
        b.build()
    } else {
        b.with_service_name("radixgate").build()
    }
}

/// The loop: take, split by size, convert, export; until the tracer is closed or nobody else
/// holds it. `overhead`: what each export request adds to its spans ([`request_overhead`]).
fn run(
    tracer: &Arc<Tracer>,
    rt: &tokio::runtime::Runtime,
    exporter: &opentelemetry_otlp::SpanExporter,
    overhead: usize,
) {
    let scope = InstrumentationScope::builder("radixgate")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build();
    let mut records = Vec::with_capacity(MAX_BATCH);
    let mut sizes = Vec::with_capacity(MAX_BATCH);
    let mut last_log: Option<Instant> = None;
    let mut failed_since_log = 0u64;
    let mut drops = DropLog::default();
    loop {
        let last_round = tracer.is_closed() || Arc::strong_count(tracer) == 1;
        loop {
            records.clear();
            tracer.drain(&mut records, MAX_BATCH);
            if records.is_empty() {
                break;
            }
            sizes.clear();
            sizes.extend(records.iter().map(encoded_bound));
            let mut spans = records.drain(..);
            for n in batch_lengths(&sizes, overhead, tracer.batch_bytes) {
                let batch: Vec<SpanData> = spans
                    .by_ref()
                    .take(n)
                    .map(|r| to_span_data(r, &scope))
                    .collect();
                let n = batch.len() as u64;
                match rt.block_on(exporter.export(batch)) {
                    Ok(()) => {
                        tracer.exported.fetch_add(n, Ordering::Relaxed);
                        crate::metrics::trace_spans_exported(n);
                    }
                    Err(e) => {
                        crate::metrics::trace_export_failed(n);
                        failed_since_log += n;
                        if last_log.is_none_or(|t| t.elapsed() >= LOG_EVERY) {
                            crate::log!(
                                Warn,
                                "tracing: export failed, {failed_since_log} spans lost: {e}"
                            );
                            last_log = Some(Instant::now());
                            failed_since_log = 0;
                        }
                    }
                }
            }
        }
        drops.report(tracer);
        if last_round {
            return;
        }
        std::thread::park_timeout(super::EXPORT_INTERVAL);
    }
}

/// The log line about spans the cores dropped (written here, not on a core, at most once a
/// minute: how often spans are dropped is up to the clients).
#[derive(Default)]
struct DropLog {
    /// Drops already logged, by reason.
    logged: [u64; 2],
    last: Option<Instant>,
}

impl DropLog {
    fn report(&mut self, tracer: &Tracer) {
        let now = [
            tracer.dropped_by(DropReason::Spans),
            tracer.dropped_by(DropReason::Bytes),
        ];
        if now == self.logged || self.last.is_some_and(|t| t.elapsed() < LOG_EVERY) {
            return;
        }
        crate::log!(
            Warn,
            "tracing: {} spans dropped on full buffers (--trace-buffer-spans), {} over \
             --trace-buffer-bytes, since the last report",
            now[0] - self.logged[0],
            now[1] - self.logged[1]
        );
        self.logged = now;
        self.last = Some(Instant::now());
    }
}

/// One record as the SDK's exportable span.
fn to_span_data(r: SpanRecord, scope: &InstrumentationScope) -> SpanData {
    let trace_state = r
        .trace_state
        .as_deref()
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    let mut events = SpanEvents::default();
    events.events = r
        .events
        .iter()
        .map(|&(name, at)| {
            opentelemetry::trace::Event::new(name, UNIX_EPOCH + Duration::from_nanos(at), vec![], 0)
        })
        .collect();
    SpanData {
        span_context: SpanContext::new(
            TraceId::from_bytes(r.trace_id),
            SpanId::from_bytes(r.span_id),
            TraceFlags::SAMPLED,
            false,
            trace_state,
        ),
        parent_span_id: SpanId::from_bytes(r.parent_id),
        parent_span_is_remote: r.parent_remote,
        span_kind: match r.kind {
            Kind::Server => SpanKind::Server,
            Kind::Internal => SpanKind::Internal,
            Kind::Client => SpanKind::Client,
        },
        name: r.name.into(),
        start_time: UNIX_EPOCH + Duration::from_nanos(r.start_ns),
        end_time: UNIX_EPOCH + Duration::from_nanos(r.end_ns),
        attributes: r
            .attrs
            .into_iter()
            .map(|(k, v)| match v {
                Value::Str(s) => KeyValue::new(k, s),
                Value::Int(i) => KeyValue::new(k, i),
                Value::Bool(b) => KeyValue::new(k, b),
            })
            .collect(),
        dropped_attributes_count: 0,
        events,
        links: Default::default(),
        status: match r.error {
            Some(description) => Status::Error { description },
            None => Status::Unset,
        },
        instrumentation_scope: scope.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_get_a_scheme_when_they_have_none() {
        assert_eq!(endpoint_url("localhost:4317"), "http://localhost:4317");
        assert_eq!(endpoint_url("http://c:4317"), "http://c:4317");
    }

    #[test]
    fn records_become_sdk_spans_with_ids_kinds_and_attributes() {
        let r = SpanRecord {
            trace_id: [1; 16],
            span_id: [2; 8],
            parent_id: [3; 8],
            parent_remote: true,
            kind: Kind::Client,
            name: "attempt",
            start_ns: 1_000,
            end_ns: 2_000,
            attrs: vec![("http.response.status_code", Value::Int(200))],
            events: vec![("first_byte", 1_500)],
            error: Some("boom".into()),
            trace_state: Some("k=v".into()),
        };
        let scope = InstrumentationScope::builder("radixgate").build();
        let d = to_span_data(r, &scope);
        assert_eq!(d.span_context.trace_id(), TraceId::from_bytes([1; 16]));
        assert_eq!(d.parent_span_id, SpanId::from_bytes([3; 8]));
        assert_eq!(d.span_kind, SpanKind::Client);
        assert_eq!(d.span_context.trace_state().header(), "k=v");
        assert_eq!(d.attributes.len(), 1);
        assert_eq!(d.events.len(), 1);
        assert!(matches!(d.status, Status::Error { .. }));
    }

    /// Spans of every shape the gateway records, small and large.
    fn samples() -> Vec<SpanRecord> {
        let base = SpanRecord {
            trace_id: [1; 16],
            span_id: [2; 8],
            parent_id: [0; 8],
            parent_remote: false,
            kind: Kind::Server,
            name: "radixgate.request",
            start_ns: 1_700_000_000_000_000_000,
            end_ns: 1_700_000_000_500_000_000,
            attrs: vec![],
            events: vec![],
            error: None,
            trace_state: None,
        };
        let mut out = vec![base.clone()];
        for len in [0usize, 1, 127, 128, 300, 16_383, 16_384, 70_000, 2_100_000] {
            let mut r = base.clone();
            r.parent_id = [3; 8];
            r.attrs = vec![
                ("url.path", Value::Str("p".repeat(len).into())),
                ("http.response.status_code", Value::Int(-1)),
                ("radixgate.stream", Value::Bool(true)),
                ("radixgate.matched_length", Value::Int(i64::MAX)),
            ];
            r.events = vec![("first_byte", 1), ("end_of_stream", u64::MAX)];
            r.error = Some("e".repeat(len % 1000).into());
            r.trace_state = Some(format!("k={}", "v".repeat(len.min(200) + 1)).into());
            out.push(r);
        }
        out
    }

    /// What `opentelemetry-proto` (the exporter's own encoding) makes of a whole request.
    fn encoded_request(records: &[SpanRecord], resource: &opentelemetry_sdk::Resource) -> usize {
        use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
        use opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema;
        use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;
        use prost::Message;
        let scope = InstrumentationScope::builder("radixgate")
            .with_version(env!("CARGO_PKG_VERSION"))
            .build();
        let spans = records
            .iter()
            .cloned()
            .map(|r| to_span_data(r, &scope))
            .collect();
        let resource_spans =
            group_spans_by_resource_and_scope(spans, &ResourceAttributesWithSchema::from(resource));
        ExportTraceServiceRequest { resource_spans }.encoded_len() + 5
    }

    #[test]
    fn the_size_bound_covers_the_real_encoding_and_stays_close_to_it() {
        let resource = resource();
        let overhead = request_overhead(&resource);
        let empty = encoded_request(&[], &resource);
        assert!(empty <= overhead, "{empty} > {overhead}");
        let all = samples();
        let scope = InstrumentationScope::builder("radixgate").build();
        for r in &all {
            use prost::Message;
            let span =
                opentelemetry_proto::tonic::trace::v1::Span::from(to_span_data(r.clone(), &scope));
            // The span as a field of its ScopeSpans.
            let real = field(span.encoded_len());
            let bound = encoded_bound(r);
            assert!(real <= bound, "{real} bytes encoded, bound {bound}");
            assert!(bound <= real + 32, "bound {bound} far above {real}");
            // One span alone in a request: within the overhead and its bound.
            let request = encoded_request(std::slice::from_ref(r), &resource);
            assert!(
                request <= overhead + bound,
                "{request} > {overhead} + {bound}"
            );
        }
        // A whole batch: never more than the bounds and the overhead.
        let real = encoded_request(&all, &resource);
        let bound: usize = overhead + all.iter().map(encoded_bound).sum::<usize>();
        assert!(real <= bound, "{real} > {bound}");
        // A long OTEL_RESOURCE_ATTRIBUTES is in the overhead too.
        let big = opentelemetry_sdk::Resource::builder_empty()
            .with_attributes((0..50).map(|i| KeyValue::new(format!("attr.{i}"), "x".repeat(500))))
            .build();
        let empty = encoded_request(&[], &big);
        assert!(empty <= request_overhead(&big), "{empty}");
    }

    #[test]
    fn batches_are_split_under_the_byte_limit_in_order() {
        assert_eq!(batch_lengths(&[], 100, 1000), Vec::<usize>::new());
        assert_eq!(batch_lengths(&[300, 300, 300], 100, 1000), vec![3]);
        assert_eq!(batch_lengths(&[300, 300, 300, 1], 100, 1000), vec![3, 1]);
        assert_eq!(batch_lengths(&[500, 500, 500], 100, 1000), vec![1, 1, 1]);
        // Too large for any request: alone, and the others around it still batched.
        assert_eq!(batch_lengths(&[10, 5000, 10, 10], 100, 1000), vec![1, 1, 2]);
        // 762 spans of 8 KiB (over 6 MiB in all) under the default 3 MiB: each request fits.
        let sizes = vec![8 << 10; 762];
        let lengths = batch_lengths(&sizes, 1024, super::super::DEFAULT_BATCH_BYTES as usize);
        assert_eq!(lengths.iter().sum::<usize>(), 762);
        assert!(
            lengths.iter().all(|&n| 1024 + n * (8 << 10) <= 3 << 20),
            "{lengths:?}"
        );
    }
}
