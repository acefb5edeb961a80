//! Prometheus metrics: the `metrics` facade with the exporter's recorder (no tokio/hyper), and
//! `/metrics` served from our own tiny listener on `--prometheus-port`. Names follow the
//! reference's `smg_*` families where one exists, plus what the reference dropped (tree size,
//! cache-aware branches) under `radixgate_*`. Every series the gateway exports is emitted by a
//! function here and nowhere else, so this file is the list `tests/docs.rs` checks
//! docs/metrics.md against.
//!
//! Every family is registered with its HELP text at start-up ([`FAMILIES`]), and the retry,
//! circuit and scrape counters start at zero, so dashboards and alerts never see "no data"
//! (`promtool check metrics` passes on the exposition).
//!
//! Series of removed workers leave `/metrics`: the exporter (0.18) has no call that deletes a
//! series, but its idle sweep deletes any gauge not set since the previous render. Every gauge
//! is therefore set again before each render (per-worker ones for the workers still
//! registered, the others from the values kept here), so only a removed worker's gauges are
//! idle, and they are gone from the first scrape after the removal.

use metrics::{counter, gauge, histogram, KeyName, SharedString};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use metrics_util::MetricKindMask;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Open client connections (the gauge is set from it, so a re-set after an idle sweep is exact).
static CONNECTIONS: AtomicI64 = AtomicI64::new(0);
/// The io driver reported at start, re-set at each scrape.
static IO_DRIVER: Mutex<Option<&'static str>> = Mutex::new(None);
/// Characters of routed prompts the tree predicted the chosen worker holds, and characters of
/// the prompts routed with a prediction (cache_aware decisions): the telemetry thread turns
/// their increases into `radixgate_predicted_cache_hit_ratio`.
static PREDICTED_CHARS: AtomicU64 = AtomicU64::new(0);
static INSERTS_SKIPPED: AtomicU64 = AtomicU64::new(0);
static PREDICTED_OF_CHARS: AtomicU64 = AtomicU64::new(0);

/// What a metric family is (its HELP is registered by kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up.
    Counter,
    /// Set to a value.
    Gauge,
    /// Observations in buckets.
    Histogram,
}

/// Every family the gateway exports, with its HELP text. Registered at start-up so every
/// family carries HELP (`promtool check metrics` flags a family without it); `tests/docs.rs`
/// checks that every family the source emits is listed here.
pub const FAMILIES: &[(&str, Kind, &str)] = &[
    ("smg_http_requests_total", Kind::Counter, "HTTP requests answered, by normalised path."),
    ("smg_http_responses_total", Kind::Counter, "HTTP responses, by status code."),
    ("smg_http_request_duration_seconds", Kind::Histogram, "Time from request head to the end of the answer, by normalised path."),
    ("smg_http_connections_active", Kind::Gauge, "Client connections open now."),
    ("smg_worker_selection_total", Kind::Counter, "Routing decisions, by policy and by the branch that made them."),
    ("smg_worker_requests_active", Kind::Gauge, "Requests this gateway has in flight on each worker."),
    ("smg_worker_health", Kind::Gauge, "1 when the worker is selectable (healthy, circuit not open), else 0."),
    ("smg_worker_pool_size", Kind::Gauge, "Workers registered."),
    ("smg_worker_retries_total", Kind::Counter, "Requests moved to another worker after a failed attempt."),
    ("radixgate_worker_backpressure_total", Kind::Counter, "Backpressure answers (429, 503) from each worker: not counted against its circuit."),
    ("smg_worker_cb_transitions_total", Kind::Counter, "Circuit breaker transitions, by the state entered."),
    ("smg_router_requests_total", Kind::Counter, "Routed requests, by model, endpoint and streaming."),
    ("radixgate_time_to_first_byte_seconds", Kind::Histogram, "Time from request start to the first response body byte sent to the client."),
    ("radixgate_upstream_connections_total", Kind::Counter, "Upstream connections used, new or reused from a pool."),
    ("radixgate_client_aborts_total", Kind::Counter, "Clients that left before the answer (the upstream request was aborted)."),
    ("radixgate_tree_nodes", Kind::Gauge, "Nodes in the prefix trees."),
    ("radixgate_tree_chars", Kind::Gauge, "Characters held by the prefix trees."),
    ("radixgate_tree_epoch", Kind::Gauge, "Prefix tree snapshots published."),
    ("radixgate_tree_inserts_dropped", Kind::Gauge, "Tree inserts dropped because the writer's queue was full."),
    ("radixgate_tree_inserts_applied", Kind::Gauge, "Tree inserts the writer applied."),
    ("radixgate_tree_inserts_skipped", Kind::Gauge, "Tree inserts not sent because the chosen worker already held the whole text."),
    ("radixgate_tree_evicted_chars", Kind::Gauge, "Characters evicted from the prefix trees."),
    ("radixgate_tree_evictions", Kind::Gauge, "Eviction runs of the tree writer: periodic passes plus immediate evictions of a worker over its limit by 10 %."),
    ("radixgate_io_driver", Kind::Gauge, "The io driver in use (1 for the kind in use)."),
    ("radixgate_kv_events_total", Kind::Counter, "KV-event intake activity, by kind."),
    ("radixgate_kv_send_dropped_total", Kind::Counter, "KV-event connections dropped because the publisher would not read what the gateway sends it, by reason."),
    ("radixgate_kv_fallback_total", Kind::Counter, "Routed requests the text tree decided although --kv-events is on, by reason."),
    ("radixgate_kv_prompt_tokens_total", Kind::Counter, "Prompt tokens measured against the KV-event index."),
    ("radixgate_kv_predicted_cached_tokens_total", Kind::Counter, "Prompt tokens the best worker holds by the KV-event index and pending entries."),
    ("radixgate_kv_index_blocks", Kind::Gauge, "Blocks the KV-event index holds, summed over workers and ranks."),
    ("radixgate_kv_index_distinct_blocks", Kind::Gauge, "Distinct blocks in the KV-event index at its last publication."),
    ("radixgate_kv_index_sources", Kind::Gauge, "Worker ranks the KV-event index holds blocks of."),
    ("radixgate_kv_warm_workers", Kind::Gauge, "Workers whose KV events are complete (scored by the index, not the text tree)."),
    ("radixgate_kv_source_state", Kind::Gauge, "State of each subscribed KV-event publisher (worker, DP rank): 1 for its current state, 0 for the others. live: routed by its events; replaying, partial, connecting: routed by the text tree."),
    ("radixgate_kv_index_dropped_total", Kind::Counter, "KV events the index dropped, by reason."),
    ("radixgate_kv_index_applied_blocks_total", Kind::Counter, "Block hashes stored or removed that the KV-event index applied (or dropped, counted by reason)."),
    ("radixgate_kv_staleness_seconds", Kind::Histogram, "From a live KV-event batch's publisher timestamp to the index publication that holds it (the smallest delay seen of each publisher counts as zero, taking out a clock offset)."),
    ("radixgate_kv_source_staleness_seconds", Kind::Gauge, "Staleness of each subscribed KV-event publisher's latest batch (worker, DP rank)."),
    ("radixgate_kv_lagging_publishers", Kind::Gauge, "KV-event publishers whose batches reach the index later than --kv-max-staleness-ms: their workers are scored by the text tree until they catch up."),
    ("radixgate_kv_queue_bytes", Kind::Gauge, "Bytes of decoded KV-event batches waiting for the index's writer (bounded by --kv-queue-mib)."),
    ("radixgate_kv_queue_wait_seconds_total", Kind::Counter, "Time the KV-event reader threads spent waiting for room in the writer's queue: it grows while the writer cannot keep up."),
    ("radixgate_trace_spans_dropped_total", Kind::Counter, "Finished spans dropped because the core's trace buffer was full, by reason: spans or bytes (--enable-trace)."),
    ("radixgate_trace_spans_exported_total", Kind::Counter, "Spans the OTLP collector accepted (--enable-trace)."),
    ("radixgate_trace_export_failures_total", Kind::Counter, "Spans lost because an OTLP export failed (--enable-trace)."),
    ("radixgate_worker_routing_load", Kind::Gauge, "Load the policies see for each worker: this gateway's in-flight requests plus the engine-reported requests it did not send."),
    ("radixgate_worker_cache_hit_ratio", Kind::Gauge, "Cache hit ratio each worker achieved: increase of sglang:cached_tokens_total over increase of sglang:prompt_tokens_total in the sliding window (0 without prompt tokens)."),
    ("radixgate_fleet_cache_hit_ratio", Kind::Gauge, "Cache hit ratio all workers achieved together: summed cached-token increases over summed prompt-token increases in the sliding window."),
    ("radixgate_predicted_cache_hit_ratio", Kind::Gauge, "Cache hit ratio the gateway predicted: prompt characters the prefix tree said the chosen worker holds over characters routed, in the same window."),
    ("radixgate_engine_running_requests", Kind::Gauge, "Requests each worker reports running (sglang:num_running_reqs)."),
    ("radixgate_engine_queued_requests", Kind::Gauge, "Requests each worker reports waiting (sglang:num_queue_reqs)."),
    ("radixgate_engine_token_usage", Kind::Gauge, "KV-cache token usage each worker reports (sglang:token_usage)."),
    ("radixgate_engine_scrape_up", Kind::Gauge, "1 when the last scrape of the worker's /metrics or /get_load gave its load, else 0."),
    ("radixgate_engine_scrapes_total", Kind::Counter, "Scrapes of worker /metrics, by result."),
    ("radixgate_admission_queue_depth", Kind::Gauge, "Requests waiting in the gateway for a worker to leave saturation (--saturation-admission), by priority class."),
    ("radixgate_admission_wait_seconds", Kind::Histogram, "Time requests waited in the gateway's admission queue, by priority class."),
    ("radixgate_admission_total", Kind::Counter, "Requests that met the saturation admission, by tenant, priority class and outcome (direct, admitted after waiting, shed, rejected, tenant_limit, timed_out, client_gone)."),
    ("radixgate_discovery_workers", Kind::Gauge, "Workers Kubernetes discovery registered (--service-discovery), by role."),
    ("radixgate_discovery_watch_restarts_total", Kind::Counter, "Kubernetes list/watch failures after which the watch was started again (with backoff), 410 Gone included."),
    ("radixgate_discovery_last_list_timestamp_seconds", Kind::Gauge, "Unix time of the last complete list of pods from the Kubernetes API server."),
    ("radixgate_discovery_refused_total", Kind::Counter, "What Kubernetes discovery refused, by reason: worker ports past --service-discovery-max-ports-per-pod (ports_per_pod), workers past --service-discovery-max-workers (max_workers)."),
    ("radixgate_worker_saturated", Kind::Gauge, "1 when the worker counts as saturated for admission (its engine queue or KV use at the thresholds, with this gateway's requests since the last reading), else 0."),
];

/// Register the HELP text of every family in [`FAMILIES`] and start the counters dashboards
/// alert on (retries, circuit transitions, aborts, scrapes) at zero. Called once, when the
/// recorder is installed.
fn describe_all() {
    metrics::with_recorder(|r| {
        for &(name, kind, help) in FAMILIES {
            let (key, help) = (KeyName::from_const_str(name), SharedString::const_str(help));
            match kind {
                Kind::Counter => r.describe_counter(key, None, help),
                Kind::Gauge => r.describe_gauge(key, None, help),
                Kind::Histogram => r.describe_histogram(key, None, help),
            }
        }
    });
    counter!("smg_worker_retries_total").increment(0);
    for to in ["open", "half_open", "closed"] {
        counter!("smg_worker_cb_transitions_total", "to" => to).increment(0);
    }
    counter!("radixgate_client_aborts_total").increment(0);
    for result in ["ok", "error"] {
        counter!("radixgate_engine_scrapes_total", "result" => result).increment(0);
    }
}

/// Buckets for request durations and time to first byte (seconds).
const DURATION_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 240.0,
];

/// Install the process-wide recorder once; later calls reuse it (tests start several gateways).
pub fn install() -> Option<PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let handle = PrometheusBuilder::new()
                .set_buckets(DURATION_BUCKETS)
                .ok()?
                // Gauges not set since the previous render are deleted (see the module doc).
                .idle_timeout(MetricKindMask::GAUGE, Some(Duration::ZERO))
                .install_recorder()
                .ok()?;
            describe_all();
            Some(handle)
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
        b"/v1/responses" => "/v1/responses",
        b"/v1/messages" => "/v1/messages",
        b"/abort_request" => "/abort_request",
        b"/v1/models" => "/v1/models",
        b"/health" | b"/liveness" => "/health",
        b"/readiness" => "/readiness",
        b"/health_generate" => "/health_generate",
        b"/get_model_info" | b"/model_info" => "/get_model_info",
        b"/get_server_info" | b"/server_info" => "/get_server_info",
        b"/flush_cache" => "/flush_cache",
        b"/get_loads" => "/get_loads",
        b"/engine_metrics" => "/engine_metrics",
        p if p.starts_with(b"/workers") => "/workers",
        b"/add_worker" | b"/remove_worker" | b"/list_workers" => "/workers(legacy)",
        _ => "other",
    }
}

/// A client connection was accepted.
pub fn connection_opened() {
    let n = CONNECTIONS.fetch_add(1, Ordering::Relaxed) + 1;
    gauge!("smg_http_connections_active").set(n as f64);
}

/// A client connection ended.
pub fn connection_closed() {
    let n = CONNECTIONS.fetch_sub(1, Ordering::Relaxed) - 1;
    gauge!("smg_http_connections_active").set(n as f64);
}

/// Handles of the per-request series, kept per thread. Looking a series up in the recorder's
/// registry (key built, hashed, a shard locked) cost ~0.4 µs per request over the five series a
/// request touches; a cached handle is an atomic add. Safe because the recorder's idle sweep
/// deletes gauges only, never these counters and histograms. Keys are the label values, all
/// `&'static str` from fixed sets (compared by address), so a cache holds at most a few hundred
/// entries; it is emptied past [`HANDLE_CACHE_MAX`] anyway.
mod handles {
    use metrics::{Counter, Histogram};
    use std::cell::RefCell;
    use std::collections::HashMap;

    /// Entries one thread keeps before starting over (label sets are small and fixed; this
    /// only bounds a mistake).
    pub const HANDLE_CACHE_MAX: usize = 4096;

    /// Which family a cached handle belongs to, with its label values' addresses.
    #[derive(Clone, Copy, PartialEq, Eq, Hash)]
    pub enum Series {
        Requests(usize),
        Responses(usize),
        Duration(usize),
        Selection(usize, usize),
        Routed(usize, usize, bool),
        Admission(usize, usize, usize),
        Upstream(usize),
        Ttfb,
    }

    /// The address of a label value: equal strings from the same static are the same series.
    pub fn addr(s: &'static str) -> usize {
        s.as_ptr() as usize
    }

    thread_local! {
        static COUNTERS: RefCell<HashMap<Series, Counter>> = RefCell::new(HashMap::new());
        static HISTOGRAMS: RefCell<HashMap<Series, Histogram>> = RefCell::new(HashMap::new());
    }

    /// The counter of `series`, registered by `make` on first use in this thread.
    pub fn counter(series: Series, make: impl FnOnce() -> Counter) -> Counter {
        COUNTERS.with(|c| {
            let mut c = c.borrow_mut();
            if c.len() >= HANDLE_CACHE_MAX {
                c.clear();
            }
            c.entry(series).or_insert_with(make).clone()
        })
    }

    /// The histogram of `series`, registered by `make` on first use in this thread.
    pub fn histogram(series: Series, make: impl FnOnce() -> Histogram) -> Histogram {
        HISTOGRAMS.with(|c| {
            let mut c = c.borrow_mut();
            if c.len() >= HANDLE_CACHE_MAX {
                c.clear();
            }
            c.entry(series).or_insert_with(make).clone()
        })
    }
}

use handles::{addr, Series};

/// One HTTP request answered.
pub fn http_request(path: &[u8], status: u16, took: Duration) {
    let path = path_label(path);
    let status = status_label(status);
    handles::counter(
        Series::Requests(addr(path)),
        || counter!("smg_http_requests_total", "path" => path),
    )
    .increment(1);
    handles::counter(
        Series::Responses(addr(status)),
        || counter!("smg_http_responses_total", "status_code" => status),
    )
    .increment(1);
    handles::histogram(
        Series::Duration(addr(path)),
        || histogram!("smg_http_request_duration_seconds", "path" => path),
    )
    .record(took.as_secs_f64());
}

/// A policy decision, by policy and by the branch that made it.
pub fn selection(policy: &'static str, branch: &'static str) {
    handles::counter(
        Series::Selection(addr(policy), addr(branch)),
        || counter!("smg_worker_selection_total", "policy" => policy, "branch" => branch),
    )
    .increment(1);
}

/// Time from request start to the first response body byte sent to the client.
pub fn ttft(took: Duration) {
    handles::histogram(Series::Ttfb, || {
        histogram!("radixgate_time_to_first_byte_seconds")
    })
    .record(took.as_secs_f64());
}

/// One routed request, by model (`label` from `ServedModels::label`: a served model name,
/// "default" or "other"), endpoint and streaming flag.
pub fn routed(model: &'static str, endpoint: &'static str, streaming: bool) {
    let series = Series::Routed(addr(model), addr(endpoint), streaming);
    handles::counter(series, || {
        let streaming = if streaming { "true" } else { "false" };
        counter!("smg_router_requests_total", "model" => model, "endpoint" => endpoint, "streaming" => streaming)
    })
    .increment(1);
}

/// A client closed its connection before the worker answered (the request was aborted).
pub fn client_gone() {
    counter!("radixgate_client_aborts_total").increment(1);
}

/// Tracing is on: its counters start at zero, so a dashboard sees them before the first drop.
pub fn trace_enabled() {
    for reason in ["spans", "bytes"] {
        counter!("radixgate_trace_spans_dropped_total", "reason" => reason).increment(0);
    }
    counter!("radixgate_trace_spans_exported_total").increment(0);
    counter!("radixgate_trace_export_failures_total").increment(0);
}

/// `n` finished spans did not fit a core's trace buffer: `reason` is `spans` (it held
/// `--trace-buffer-spans`) or `bytes` (they would have taken it over `--trace-buffer-bytes`).
pub fn trace_spans_dropped(reason: &'static str, n: u64) {
    counter!("radixgate_trace_spans_dropped_total", "reason" => reason).increment(n);
}

/// The collector accepted `n` spans.
pub fn trace_spans_exported(n: u64) {
    counter!("radixgate_trace_spans_exported_total").increment(n);
}

/// An export of `n` spans failed.
pub fn trace_export_failed(n: u64) {
    counter!("radixgate_trace_export_failures_total").increment(n);
}

/// A request moved to another worker.
pub fn retry() {
    counter!("smg_worker_retries_total").increment(1);
}

/// Worker `url` answered backpressure (429 or 503: busy, not broken).
pub fn worker_backpressure(url: &str) {
    counter!("radixgate_worker_backpressure_total", "worker" => url.to_string()).increment(1);
}

/// A worker's circuit moved to state `to` ("open", "half_open", "closed").
pub fn circuit_transition(to: &'static str) {
    counter!("smg_worker_cb_transitions_total", "to" => to).increment(1);
}

/// An upstream connection was opened (`kind` "new") or taken from a pool ("reused").
pub fn upstream_connection(kind: &'static str) {
    handles::counter(
        Series::Upstream(addr(kind)),
        || counter!("radixgate_upstream_connections_total", "kind" => kind),
    )
    .increment(1);
}

/// The io driver in use (exported at start, set again at each scrape).
pub fn io_driver(kind: &'static str) {
    *IO_DRIVER.lock().unwrap_or_else(|p| p.into_inner()) = Some(kind);
    gauge!("radixgate_io_driver", "kind" => kind).set(1.0);
}

/// One worker's in-flight requests, routing load (in-flight + engine-reported load from
/// elsewhere) and eligibility, refreshed at each scrape.
pub fn worker_state(url: &str, in_flight: u32, routing_load: u32, eligible: bool) {
    let label = url.to_string();
    gauge!("smg_worker_requests_active", "worker" => label.clone()).set(f64::from(in_flight));
    gauge!("radixgate_worker_routing_load", "worker" => label.clone()).set(f64::from(routing_load));
    gauge!("smg_worker_health", "worker" => label).set(if eligible { 1.0 } else { 0.0 });
}

/// What the telemetry thread last learned about one worker's engine (zeros before its first
/// scrape), exported per worker at each scrape.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineGauges {
    /// The last scrape gave the worker's load.
    pub up: bool,
    /// `sglang:num_running_reqs`.
    pub running: f64,
    /// `sglang:num_queue_reqs`.
    pub queued: f64,
    /// `sglang:token_usage`.
    pub token_usage: f64,
    /// Achieved cache hit ratio over the sliding window.
    pub hit_ratio: f64,
}

/// One worker's engine gauges, refreshed at each scrape.
pub fn engine_state(url: &str, e: &EngineGauges) {
    let label = url.to_string();
    let up = if e.up { 1.0 } else { 0.0 };
    gauge!("radixgate_engine_scrape_up", "worker" => label.clone()).set(up);
    gauge!("radixgate_engine_running_requests", "worker" => label.clone()).set(e.running);
    gauge!("radixgate_engine_queued_requests", "worker" => label.clone()).set(e.queued);
    gauge!("radixgate_engine_token_usage", "worker" => label.clone()).set(e.token_usage);
    gauge!("radixgate_worker_cache_hit_ratio", "worker" => label).set(e.hit_ratio);
}

/// The fleet's achieved and the gateway's predicted cache hit ratios, refreshed at each scrape.
pub fn hit_ratios(fleet: f64, predicted: f64) {
    gauge!("radixgate_fleet_cache_hit_ratio").set(fleet);
    gauge!("radixgate_predicted_cache_hit_ratio").set(predicted);
}

/// One scrape of a worker's engine metrics ended (`ok`: its load was read).
pub fn engine_scrape(ok: bool) {
    let result = if ok { "ok" } else { "error" };
    counter!("radixgate_engine_scrapes_total", "result" => result).increment(1);
}

/// A routing decision predicted `predicted_chars` of a `request_chars`-character prompt to be
/// cached on the chosen worker (two relaxed adds on the request path).
pub fn predicted_hit(predicted_chars: usize, request_chars: usize) {
    PREDICTED_CHARS.fetch_add(predicted_chars as u64, Ordering::Relaxed);
    PREDICTED_OF_CHARS.fetch_add(request_chars as u64, Ordering::Relaxed);
}

/// (predicted characters, characters routed with a prediction) since start.
pub fn predicted_totals() -> (u64, u64) {
    (
        PREDICTED_CHARS.load(Ordering::Relaxed),
        PREDICTED_OF_CHARS.load(Ordering::Relaxed),
    )
}

/// Priority classes as metric labels: -10..=10 by value, the rest folded into the ends, so a
/// client cannot grow the label set.
fn class_label(class: i32) -> &'static str {
    const LABELS: [&str; 21] = [
        "-10", "-9", "-8", "-7", "-6", "-5", "-4", "-3", "-2", "-1", "0", "1", "2", "3", "4", "5",
        "6", "7", "8", "9", "10",
    ];
    LABELS[(class.clamp(-10, 10) + 10) as usize]
}

/// Waiters per class at the last change (re-set at every scrape).
static ADMISSION_DEPTHS: Mutex<Vec<(&'static str, f64)>> = Mutex::new(Vec::new());

/// The admission queue's depth per class changed to `depths`.
pub fn admission_depths(depths: &[(i32, usize)]) {
    let mut d = ADMISSION_DEPTHS.lock().unwrap_or_else(|p| p.into_inner());
    for (_, n) in d.iter_mut() {
        *n = 0.0;
    }
    for &(class, n) in depths {
        let label = class_label(class);
        match d.iter_mut().find(|(l, _)| *l == label) {
            Some(e) => e.1 += n as f64,
            None => d.push((label, n as f64)),
        }
    }
    for &(label, n) in d.iter() {
        gauge!("radixgate_admission_queue_depth", "class" => label).set(n);
    }
}

/// A request left the admission queue after `waited`.
pub fn admission_wait(class: i32, waited: Duration) {
    histogram!("radixgate_admission_wait_seconds", "class" => class_label(class))
        .record(waited.as_secs_f64());
}

/// One admission outcome of tenant `tenant` (a configured tenant's name: a bounded set).
pub fn admission_outcome(tenant: &'static str, class: i32, outcome: &'static str) {
    let class = class_label(class);
    let series = Series::Admission(addr(tenant), addr(class), addr(outcome));
    handles::counter(series, || {
        counter!("radixgate_admission_total", "tenant" => tenant, "class" => class, "outcome" => outcome)
    })
    .increment(1);
}

/// Whether worker `url` counts as saturated now (refreshed at each scrape).
pub fn worker_saturated(url: &str, saturated: bool) {
    gauge!("radixgate_worker_saturated", "worker" => url.to_string()).set(if saturated {
        1.0
    } else {
        0.0
    });
}

/// Discovered workers by role and the last complete pod list (re-set at every scrape; `None`
/// until discovery reports, so a gateway without it exports neither).
static DISCOVERY: Mutex<Option<([usize; 3], f64)>> = Mutex::new(None);

/// Kubernetes discovery registered this many regular, prefill and decode workers.
pub fn discovery_workers(regular: usize, prefill: usize, decode: usize) {
    let mut d = DISCOVERY.lock().unwrap_or_else(|p| p.into_inner());
    let listed = d.map_or(0.0, |(_, t)| t);
    *d = Some(([regular, prefill, decode], listed));
    set_discovery_gauges(&d);
}

/// Kubernetes discovery completed a list of pods at `unix_secs`.
pub fn discovery_listed(unix_secs: f64) {
    let mut d = DISCOVERY.lock().unwrap_or_else(|p| p.into_inner());
    let counts = d.map_or([0; 3], |(c, _)| c);
    *d = Some((counts, unix_secs));
    set_discovery_gauges(&d);
}

/// Kubernetes discovery's list or watch failed and is started again after a backoff.
pub fn discovery_watch_restart() {
    counter!("radixgate_discovery_watch_restarts_total").increment(1);
}

/// What discovery refuses, by reason (`ports_per_pod`: ports past the per-pod cap;
/// `max_workers`: workers past the per-source cap).
const DISCOVERY_REFUSALS: [&str; 2] = ["ports_per_pod", "max_workers"];

/// Discovery refused `n` of something, for `reason` (one of [`DISCOVERY_REFUSALS`]).
pub fn discovery_refused(reason: &'static str, n: u64) {
    counter!("radixgate_discovery_refused_total", "reason" => reason).increment(n);
}

/// Every refusal reason at zero from discovery's start.
pub fn discovery_refused_init() {
    for reason in DISCOVERY_REFUSALS {
        discovery_refused(reason, 0);
    }
}

fn set_discovery_gauges(d: &Option<([usize; 3], f64)>) {
    let Some((counts, listed)) = d else {
        return;
    };
    for (role, n) in ["regular", "prefill", "decode"].iter().zip(counts) {
        gauge!("radixgate_discovery_workers", "role" => *role).set(*n as f64);
    }
    gauge!("radixgate_discovery_last_list_timestamp_seconds").set(*listed);
}

/// The gauges that belong to the whole process (registered workers, open connections, the io
/// driver), set again at the start of every scrape so the idle sweep only ever removes removed
/// workers' series (see the module doc).
pub fn refresh_process_gauges(workers: usize) {
    gauge!("smg_worker_pool_size").set(workers as f64);
    let conns = CONNECTIONS.load(Ordering::Relaxed);
    gauge!("smg_http_connections_active").set(conns as f64);
    if let Some(kind) = *IO_DRIVER.lock().unwrap_or_else(|p| p.into_inner()) {
        gauge!("radixgate_io_driver", "kind" => kind).set(1.0);
    }
    set_discovery_gauges(&DISCOVERY.lock().unwrap_or_else(|p| p.into_inner()));
    for &(label, n) in ADMISSION_DEPTHS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
    {
        gauge!("radixgate_admission_queue_depth", "class" => label).set(n);
    }
}

/// A routed request whose chosen worker already held its whole text: no insert was sent (one
/// relaxed add on the request path; exported at each scrape).
pub fn insert_skipped() {
    INSERTS_SKIPPED.fetch_add(1, Ordering::Relaxed);
}

/// The writer's counters for [`tree_stats`].
#[derive(Debug, Clone, Copy, Default)]
pub struct TreeStats {
    /// Nodes in the trees.
    pub nodes: u64,
    /// Characters held.
    pub chars: u64,
    /// Snapshots published.
    pub epoch: u64,
    /// Inserts dropped on a full queue.
    pub dropped: u64,
    /// Inserts applied.
    pub applied: u64,
    /// Characters evicted.
    pub evicted_chars: u64,
    /// Eviction runs (periodic passes and immediate evictions).
    pub evictions: u64,
}

/// The prefix trees' size and the writer's counters, refreshed at each scrape.
pub fn tree_stats(t: TreeStats) {
    gauge!("radixgate_tree_nodes").set(t.nodes as f64);
    gauge!("radixgate_tree_chars").set(t.chars as f64);
    gauge!("radixgate_tree_epoch").set(t.epoch as f64);
    gauge!("radixgate_tree_inserts_dropped").set(t.dropped as f64);
    gauge!("radixgate_tree_inserts_applied").set(t.applied as f64);
    gauge!("radixgate_tree_inserts_skipped").set(INSERTS_SKIPPED.load(Ordering::Relaxed) as f64);
    gauge!("radixgate_tree_evicted_chars").set(t.evicted_chars as f64);
    gauge!("radixgate_tree_evictions").set(t.evictions as f64);
}

/// A routed request decided by the text tree although `--kv-events` is on, by reason.
pub fn kv_fallback(reason: &'static str, n: u64) {
    counter!("radixgate_kv_fallback_total", "reason" => reason).increment(n);
}

/// A routed request measured against the KV-event index (tokens matched / prompt tokens).
pub fn kv_measured(prompt_tokens: usize, matched_tokens: usize) {
    counter!("radixgate_kv_prompt_tokens_total").increment(prompt_tokens as u64);
    counter!("radixgate_kv_predicted_cached_tokens_total").increment(matched_tokens as u64);
}

/// The KV-event index now: blocks held (per source, summed), distinct blocks, sources, and
/// workers whose events are complete.
pub fn kv_index_stats(held: u64, distinct: u64, sources: u64, warm_workers: usize) {
    gauge!("radixgate_kv_index_blocks").set(held as f64);
    gauge!("radixgate_kv_index_distinct_blocks").set(distinct as f64);
    gauge!("radixgate_kv_index_sources").set(sources as f64);
    gauge!("radixgate_kv_warm_workers").set(warm_workers as f64);
}

/// The staleness histogram's handle (the applying thread records one value per live batch, so
/// it looks the series up once).
pub fn kv_staleness() -> metrics::Histogram {
    histogram!("radixgate_kv_staleness_seconds")
}

/// Block hashes the KV-event index applied since the last call.
pub fn kv_applied_blocks(n: u64) {
    counter!("radixgate_kv_index_applied_blocks_total").increment(n);
}

/// The queue in front of the index's writer and the lagging publishers, now.
pub fn kv_queue(queued_bytes: u64, waited: Duration, lagging: u64) {
    gauge!("radixgate_kv_queue_bytes").set(queued_bytes as f64);
    counter!("radixgate_kv_queue_wait_seconds_total").absolute(waited.as_secs());
    gauge!("radixgate_kv_lagging_publishers").set(lagging as f64);
}

/// One subscribed publisher's staleness at its latest batch, refreshed at each scrape.
pub fn kv_source_staleness(url: &str, rank: u32, seconds: f32) {
    gauge!("radixgate_kv_source_staleness_seconds", "worker" => url.to_string(), "rank" => rank.to_string())
        .set(f64::from(seconds));
}

/// Events the index dropped since start, by reason (counter totals mirrored from the writer).
pub fn kv_index_dropped(reason: &'static str, total: u64) {
    counter!("radixgate_kv_index_dropped_total", "reason" => reason).absolute(total);
}

/// KV-event intake activity by `kind`: `batch` and `event` delivered, `replayed_batch` (from a
/// replay socket), `malformed` (a message, reply or batch refused, or a connection dropped for
/// breaking the protocol), `skipped_event` (inside a readable batch), `gap`, `reset` (a
/// worker's event state dropped), `replay` (asked), `replay_failed`, `connect_failed` (a live
/// socket that failed or dropped), `refused` (a worker announcing more publishers than
/// `--kv-max-dp-ranks`, or rank ports past 65535), `discovery_failed` (its `/get_server_info`
/// could not be read).
pub fn kv_events(kind: &'static str, n: u64) {
    counter!("radixgate_kv_events_total", "kind" => kind).increment(n);
}

/// A KV-event connection dropped because its publisher would not read what the gateway sends
/// (a subscription, a replay request, the answer to its latest PING), by `reason`: `stalled`
/// (unsent bytes waited past `--kv-send-timeout-secs`), `full` (a message would pass the send
/// queue's cap). Such a peer is redialled with the usual backoff.
pub fn kv_send_dropped(reason: &'static str, n: u64) {
    counter!("radixgate_kv_send_dropped_total", "reason" => reason).increment(n);
}

/// One subscribed publisher's state as a one-hot set over `all` (the states' names), refreshed
/// at each scrape (a removed publisher's series leave with the idle sweep).
pub fn kv_source_state(url: &str, rank: u32, current: &'static str, all: &[&'static str]) {
    let rank = rank.to_string();
    for &state in all {
        let v = if state == current { 1.0 } else { 0.0 };
        gauge!("radixgate_kv_source_state", "worker" => url.to_string(), "rank" => rank.clone(), "state" => state)
            .set(v);
    }
}

/// `v` escaped for a Prometheus label value (backslash, double quote, newline): the one
/// escaper for every exposition radixgate writes (and the simulator's).
pub fn escape_label_value(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            _ => out.push(c),
        }
    }
    out
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
