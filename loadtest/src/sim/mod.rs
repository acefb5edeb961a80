//! `sim-worker`: a faithful simulated SGLang server, for routing-policy comparisons (hit rate,
//! TTFT) and as the real upstream of the gateway's end-to-end tests. No GPU: each port runs a
//! simulated scheduler ([`engine`](crate::sim::engine)) over a token radix cache
//! ([`radix`](crate::sim::radix)) on its own virtual GPU clock, with the reference cost model
//! ([`cost`](crate::sim::cost)), a real BPE tokenizer and chat template
//! ([`tokenizer`](crate::sim::tokenizer)), SGLang's HTTP API and Prometheus metrics
//! ([`server`](crate::sim::server), [`api`](crate::sim::api),
//! [`metrics`](crate::sim::metrics)), SGLang's KV-cache events on ZeroMQ
//! ([`kv_events`](crate::sim::kv_events)), and fault knobs ([`Faults`](crate::sim::Faults)).
//!
//! With [`SimConfig::engine`] = [`EngineKind::Vllm`] (`sim-worker --engine vllm`) the same
//! simulated GPU plays a vLLM 0.33 server instead: vLLM's routes (`/inference/v1/generate` token
//! in/token out, `/kv_event_sources`, `/reset_prefix_cache`, `/tokenize`, ...; SGLang's
//! `/generate`, `/get_server_info`, `/flush_cache` answer 404), `vllm:` metrics labelled
//! `model_name` and `engine`, and vLLM's KV-event encoding, so a gateway can be tested against
//! either fleet.
//!
//! ```no_run
//! use loadtest::sim::{spawn_cluster, SimConfig};
//! let cluster = spawn_cluster(SimConfig { ports: vec![0, 0], ..SimConfig::default() }).unwrap();
//! println!("{:?}", cluster.urls()); // e.g. ["http://127.0.0.1:39011", "http://127.0.0.1:39012"]
//! cluster.shutdown();
//! ```

pub mod api;
pub mod cost;
pub mod disagg;
pub mod engine;
pub mod hf_export;
pub mod kv_events;
pub mod metrics;
pub mod radix;
pub mod server;
pub mod tokenizer;

pub use server::{spawn_cluster, SimCluster};
pub use tokenizer::TokenizerMode;

/// Fault injection, applied to every port of a cluster (run separate clusters for healthy and
/// faulty workers). "Inference requests" are `/generate`, `/v1/chat/completions`,
/// `/v1/completions`, `/v1/responses` and `/v1/messages`; the counters below are per port.
///
/// Tests can also change faults at run time, per port: `POST /debug/faults` with
/// `{"fail_rate": 0.0..=1.0 | null, "hold": bool}` (null restores the configured rate; `hold`
/// keeps inference requests waiting, counted as in progress and reported as waiting requests in
/// `/metrics` and `/get_load`, until it is cleared;
/// `"skip_kv_seq": true` withholds the next KV-event batch from the PUB socket but keeps it for
/// replay, a gap a subscriber can fill; `"lose_kv_seq": true` consumes the next sequence number
/// with nothing sent or buffered, a gap it cannot), and read
/// per-port counters at `GET /debug/stats` (`connections`, `inference_connections`,
/// `inference_received`, `inference_answered`, `inference_in_progress`; `aborted`: requests the
/// engine aborted, client disconnects included; `queue_full`: requests refused by
/// `--max-queued-requests`; `abort_requests` and `aborted_by_rid`: calls to
/// `POST /abort_request` and the requests they aborted; `running_rids`: the request ids
/// (`x-request-id`, `/generate`'s `rid`) running now; `dp_size`, and `dp_ranks`: per DP rank
/// `inference_received`, `inference_answered`, `prompt_tokens`, `cached_tokens` (and its
/// `cached_tokens_host` part), `host_cache` (capacity, tokens held, backed up, loaded back,
/// evicted), so a test sees which rank served what and what its own cache held).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Faults {
    /// Fraction of inference requests answered 500 with a JSON error (seeded RNG).
    pub fail_rate: f64,
    /// Extra real-time delay before handling each inference request, ms.
    pub latency_ms: u64,
    /// After this many inference requests have been answered (or when one more arrives), the
    /// server closes its listener and every connection: connection refused afterwards.
    pub die_after: Option<u64>,
    /// Inference requests beyond this many are accepted, read, and never answered.
    pub stall_after: Option<u64>,
    /// `/health` and `/health_generate` answer 503.
    pub health_fail: bool,
    /// Streams are cut (connection closed without the terminating chunk) after a few events.
    pub close_mid_stream: bool,
}

/// Which server the simulated worker plays: the scheduler, radix cache and cost model are the
/// same; the HTTP routes, metric names, KV-event encoding and the way KV-event publishers are
/// announced follow the engine named, so a gateway can be tested against either fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineKind {
    /// SGLang: `/generate`, `/get_server_info`, `/flush_cache`, `sglang:` metrics, SGLang's
    /// event encoding.
    #[default]
    Sglang,
    /// vLLM: `/inference/v1/generate` (token in, token out) and no `/generate`,
    /// `/kv_event_sources` and no `/get_server_info`, `/reset_prefix_cache`, `vllm:` metrics,
    /// vLLM's event encoding (see [`kv_events`]).
    Vllm,
}

impl EngineKind {
    /// Parse `--engine`: `sglang` or `vllm`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "sglang" => Ok(EngineKind::Sglang),
            "vllm" => Ok(EngineKind::Vllm),
            other => Err(format!("unknown engine {other:?} (sglang or vllm)")),
        }
    }

    /// The flag value.
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Sglang => "sglang",
            EngineKind::Vllm => "vllm",
        }
    }
}

/// A LoRA adapter a vLLM-shaped worker serves (`--lora-modules NAME=PATH`): clients name it in
/// `model`, and `/v1/models` lists it with the base model as `parent`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraModule {
    /// The adapter's name (what `model` says).
    pub name: String,
    /// Where it would be loaded from (reported as `root`).
    pub path: String,
}

impl LoraModule {
    /// `NAME=PATH`, or a bare `NAME` (the path is then the name).
    pub fn parse(s: &str) -> Result<Self, String> {
        let (name, path) = s.split_once('=').unwrap_or((s, s));
        let (name, path) = (name.trim(), path.trim());
        if name.is_empty() || path.is_empty() {
            return Err(format!("lora module {s:?}: expected NAME=PATH"));
        }
        Ok(LoraModule {
            name: name.to_owned(),
            path: path.to_owned(),
        })
    }
}

/// Which monoio driver the server thread runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoDriver {
    /// io_uring if the kernel allows it, else epoll; `MONOIO_FORCE_LEGACY_DRIVER=1` forces epoll.
    #[default]
    Auto,
    /// io_uring only (fails to start where it is unavailable).
    Uring,
    /// epoll only.
    Legacy,
}

/// Configuration of a simulated cluster: one simulated worker per port, all alike.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Ports to listen on; 0 picks an ephemeral port (see [`SimCluster::ports`]).
    pub ports: Vec<u16>,
    /// Bind address.
    pub host: String,
    /// Served model name (`/v1/models`, responses, the `model_name` metric label).
    pub model_name: String,
    /// KV capacity in tokens per worker (`max_total_num_tokens`).
    pub max_total_tokens: usize,
    /// Radix cache page size.
    pub page_size: usize,
    /// Most new tokens per prefill forward.
    pub chunked_prefill_size: usize,
    /// Most requests running at once per worker.
    pub max_running: usize,
    /// Virtual seconds per real second: 10 runs the simulated GPU 10× faster than real time
    /// (a 1 s prefill answers after 0.1 s). Latencies reported by the worker (metrics,
    /// `e2e_latency`) are virtual, i.e. what a real GPU would show.
    pub time_scale: f64,
    /// Real BPE or the cheap approximation.
    pub tokenizer: TokenizerMode,
    /// `--tokenizer-path`: a HF tokenizer file or model folder, tokenized with the gateway's
    /// own code (`radixgate::tokenize`); replaces `tokenizer` when set.
    pub tokenizer_path: Option<std::path::PathBuf>,
    /// Fixed duration of every forward in virtual ms, replacing the cost model (SSE pacing
    /// tests).
    pub token_interval_ms: Option<f64>,
    /// `max_new_tokens` / `max_tokens` when the request gives none.
    pub default_max_tokens: usize,
    /// Seeds jitter, generated answers and fault draws.
    pub seed: u64,
    /// Fault injection.
    pub faults: Faults,
    /// Keep the last N raw requests for `GET /debug/requests` (0 = off).
    pub record_requests: usize,
    /// monoio driver selection.
    pub io_driver: IoDriver,
    /// `--kv-events-config`: publish SGLang's KV-cache events (see [`kv_events`]).
    pub kv_events: Option<kv_events::KvEventsConfig>,
    /// `--disaggregation-mode`: play a PD prefill or decode server (see [`disagg`]); `None`
    /// serves whole requests.
    pub disaggregation_mode: Option<disagg::DisaggMode>,
    /// `--disaggregation-bootstrap-port`: a prefill server's bootstrap listener (port `i` of the
    /// cluster listens on this + i; 0 picks ephemeral ports, see
    /// [`SimCluster::bootstrap_ports`]); a decode server's default when a request's
    /// `bootstrap_port` is null.
    pub disaggregation_bootstrap_port: u16,
    /// `--dp-size`: attention-DP ranks per port, each with its own scheduler, queue and radix
    /// cache (see [`server`]); a request's `data_parallel_rank` picks one, else round robin.
    pub dp_size: usize,
    /// `--host-cache-tokens`: host memory for KV per scheduler, in tokens (SGLang's HiCache:
    /// the device's evictions are backed up there and loaded back on a hit, see
    /// [`radix`]); 0 = none.
    pub host_cache_tokens: usize,
    /// `--enable-priority-scheduling`: each scheduler orders its waiting queue by the
    /// requests' `priority` field, higher first, FCFS within one (see [`engine`]).
    pub priority_scheduling: bool,
    /// `--max-queued-requests`: each scheduler refuses a request with 503 "The request queue
    /// is full." while its waiting queue is full, as SGLang does (see
    /// [`engine::Engine::enforce_queue_limit`]); `None`: unbounded.
    pub max_queued_requests: Option<usize>,
    /// `--api-key`: every request needs `Authorization: Bearer <key>` except OPTIONS and paths
    /// starting with `/health`, `/ready` or `/metrics`, else 401, as SGLang's middleware (see
    /// `server::auth`; with [`EngineKind::Vllm`] only vLLM's guarded prefixes `/v1`, `/v2`,
    /// `/inference`, `/cohere`); `None`: no key asked.
    pub api_key: Option<String>,
    /// `--engine`: which server's API, metrics and KV-event format the worker speaks.
    pub engine: EngineKind,
    /// `--lora-modules` (vLLM only): adapters a request may name in `model`; any other
    /// `model` than the served name or these is answered 404, as vLLM does.
    pub lora_modules: Vec<LoraModule>,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            ports: vec![0],
            host: "127.0.0.1".into(),
            model_name: "meta-llama/Llama-3.1-8B-Instruct".into(),
            max_total_tokens: 400_000,
            page_size: 1,
            chunked_prefill_size: 8192,
            max_running: 256,
            time_scale: 1.0,
            tokenizer: TokenizerMode::Bpe,
            tokenizer_path: None,
            token_interval_ms: None,
            default_max_tokens: 128,
            seed: 0,
            faults: Faults::default(),
            record_requests: 0,
            io_driver: IoDriver::Auto,
            kv_events: None,
            disaggregation_mode: None,
            disaggregation_bootstrap_port: disagg::DEFAULT_BOOTSTRAP_PORT,
            dp_size: 1,
            host_cache_tokens: 0,
            priority_scheduling: false,
            max_queued_requests: None,
            api_key: None,
            engine: EngineKind::Sglang,
            lora_modules: Vec::new(),
        }
    }
}

#[cfg(test)]
mod calibration_tests;
#[cfg(test)]
mod e2e_tests;
#[cfg(test)]
mod kv_events_e2e_tests;
#[cfg(test)]
mod vllm_e2e_tests;

/// A raw HTTP/1.1 request (`Host: sim`, the headers in order, `Content-Length` for any body or
/// POST) for tests that speak to a worker or a gateway byte by byte.
pub fn raw_request(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: sim\r\n");
    for (n, v) in headers {
        req.push_str(&format!("{n}: {v}\r\n"));
    }
    if !body.is_empty() || method == "POST" {
        req.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    req.push_str("\r\n");
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

/// A response head's headers as owned (name, value) strings, in order (tests compare them).
pub fn header_strings(head: &radixgate::http::ResponseHead) -> Vec<(String, String)> {
    head.headers()
        .map(|(n, v)| {
            (
                String::from_utf8_lossy(n).into_owned(),
                String::from_utf8_lossy(v).into_owned(),
            )
        })
        .collect()
}
