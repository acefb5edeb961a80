//! The export thread: every [`super::EXPORT_INTERVAL`] (sooner when a core's queue is half
//! full) it takes the queued span records, turns them into the SDK's `SpanData` and sends them
//! in batches through `opentelemetry-otlp`'s gRPC exporter. The exporter is async (tonic), so
//! this thread owns a current-thread tokio runtime; no serving core ever touches it. A failed
//! export is logged (at most once a minute) and its spans are lost: a collector that is down
//! must not make the gateway hold memory.

use super::span::{Kind, SpanRecord, Value};
use super::Tracer;
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
    exporter.set_resource(&resource());
    let t = tracer.clone();
    let handle = std::thread::Builder::new()
        .name("radixgate-trace".into())
        .spawn(move || {
            if let Err(e) = crate::base::priority::helper_thread() {
                crate::log!(Warn, "trace thread: cannot lower its priority: {e}");
            }
            run(&t, &rt, &exporter);
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

/// The loop: take, convert, export; until the tracer is closed or nobody else holds it.
fn run(
    tracer: &Arc<Tracer>,
    rt: &tokio::runtime::Runtime,
    exporter: &opentelemetry_otlp::SpanExporter,
) {
    let scope = InstrumentationScope::builder("radixgate")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build();
    let mut records = Vec::with_capacity(MAX_BATCH);
    let mut last_log: Option<Instant> = None;
    let mut failed_since_log = 0u64;
    loop {
        let last_round = tracer.is_closed() || Arc::strong_count(tracer) == 1;
        loop {
            records.clear();
            tracer.drain(&mut records, MAX_BATCH);
            if records.is_empty() {
                break;
            }
            let n = records.len() as u64;
            let batch: Vec<SpanData> = records.drain(..).map(|r| to_span_data(r, &scope)).collect();
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
        if last_round {
            return;
        }
        std::thread::park_timeout(super::EXPORT_INTERVAL);
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
}
