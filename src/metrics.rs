//! Prometheus metrics: the `metrics` facade with the exporter's recorder (no tokio/hyper), and
//! `/metrics` served from our own tiny listener on `--prometheus-port`. Names follow the
//! reference's `smg_*` families where one exists, plus what the reference dropped (tree size,
//! cache-aware branches) under `radixgate_*`.

use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;
use std::time::Duration;

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Buckets for request durations and time to first byte (seconds).
const DURATION_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 240.0,
];

/// Install the process-wide recorder once; later calls reuse it (tests start several gateways).
pub fn install() -> Option<PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            PrometheusBuilder::new()
                .set_buckets(DURATION_BUCKETS)
                .ok()?
                .install_recorder()
                .ok()
        })
        .clone()
}

/// Normalise a path into a bounded label set (client input must not mint label values).
pub fn path_label(path: &[u8]) -> &'static str {
    match path {
        b"/generate" => "/generate",
        b"/v1/chat/completions" => "/v1/chat/completions",
        b"/v1/completions" => "/v1/completions",
        b"/v1/embeddings" => "/v1/embeddings",
        b"/v1/rerank" | b"/rerank" => "/v1/rerank",
        b"/v1/models" => "/v1/models",
        b"/health" | b"/liveness" => "/health",
        b"/readiness" => "/readiness",
        b"/health_generate" => "/health_generate",
        b"/get_model_info" | b"/model_info" => "/get_model_info",
        b"/get_server_info" | b"/server_info" => "/get_server_info",
        b"/flush_cache" => "/flush_cache",
        b"/get_loads" => "/get_loads",
        p if p.starts_with(b"/workers") => "/workers",
        b"/add_worker" | b"/remove_worker" | b"/list_workers" => "/workers(legacy)",
        _ => "other",
    }
}

/// The gateway's metric emitters.
#[derive(Debug, Default)]
pub struct Metrics {}

impl Metrics {
    /// Emitters bound to the global recorder.
    pub fn new() -> Metrics {
        Metrics {}
    }
    /// A client connection was accepted.
    pub fn connection_opened(&self) {
        gauge!("smg_http_connections_active").increment(1.0);
    }
    /// A client connection ended.
    pub fn connection_closed(&self) {
        gauge!("smg_http_connections_active").decrement(1.0);
    }
    /// One HTTP request answered.
    pub fn http_request(&self, path: &[u8], status: u16, took: Duration) {
        let path = path_label(path);
        counter!("smg_http_requests_total", "path" => path).increment(1);
        counter!("smg_http_responses_total", "status_code" => status_label(status)).increment(1);
        histogram!("smg_http_request_duration_seconds", "path" => path).record(took.as_secs_f64());
    }
    /// A policy decision.
    pub fn selection(&self, policy: &'static str, branch: &'static str) {
        counter!("smg_worker_selection_total", "policy" => policy, "branch" => branch).increment(1);
    }
    /// Time from request start to the first response body byte sent to the client.
    pub fn ttft(&self, took: Duration) {
        histogram!("radixgate_time_to_first_byte_seconds").record(took.as_secs_f64());
    }
    /// One routed request, by model (`label` from `Gateway::model_label`: a served model name,
    /// "default" or "other"), endpoint and streaming flag.
    pub fn routed(&self, model: &'static str, endpoint: &'static str, streaming: bool) {
        counter!("smg_router_requests_total", "model" => model, "endpoint" => endpoint, "streaming" => if streaming { "true" } else { "false" }).increment(1);
    }
    /// A client closed its connection before the worker answered (the request was aborted).
    pub fn client_gone(&self) {
        counter!("radixgate_client_aborts_total").increment(1);
    }
    /// A request moved to another worker.
    pub fn retry(&self) {
        counter!("smg_worker_retries_total").increment(1);
    }
    /// The io driver in use (exported once at start).
    pub fn io_driver(&self, kind: &'static str) {
        gauge!("radixgate_io_driver", "kind" => kind).set(1.0);
    }
}

fn status_label(status: u16) -> &'static str {
    match status {
        200 => "200",
        201 => "201",
        202 => "202",
        206 => "206",
        400 => "400",
        401 => "401",
        404 => "404",
        405 => "405",
        408 => "408",
        413 => "413",
        499 => "499",
        429 => "429",
        431 => "431",
        500 => "500",
        502 => "502",
        503 => "503",
        504 => "504",
        s if s < 300 => "2xx",
        s if s < 400 => "3xx",
        s if s < 500 => "4xx",
        _ => "5xx",
    }
}
