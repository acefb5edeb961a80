//! Every setting a person can change: one field here, one flag, one line in `--help` and one in
//! the README's flag table. Names and defaults mirror sgl-model-gateway so that replacing
//! `python -m sglang_router.launch_router ARGS` with `radixgate ARGS` changes nothing else.
//!
//! `--config FILE` reads a TOML file whose keys are the flag names (`worker-urls = [..]`,
//! `cache-threshold = 0.5`; `_` and `-` both accepted). The file is turned into flags placed
//! *before* the command line, so the file and the command line go through the same parser and
//! validation, and flags on the command line override the file.

pub mod settings;

use crate::route::types::{AssignmentMode, PolicyKind};
use clap::{ArgAction, Parser, ValueEnum};
use std::time::Duration;

/// Which io driver each core's monoio runtime uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum IoDriver {
    /// io_uring when the kernel allows it, else epoll.
    Auto,
    /// io_uring only; refuse to start without it.
    Uring,
    /// epoll only.
    Legacy,
}

fn parse_policy(s: &str) -> Result<PolicyKind, SettingError> {
    s.parse::<PolicyKind>()
        .map_err(|e| SettingError::Value(e.to_string()))
}

fn parse_assignment(s: &str) -> Result<AssignmentMode, SettingError> {
    s.parse::<AssignmentMode>()
        .map_err(|e| SettingError::Value(e.to_string()))
}

/// A number, or what the user is told when it is not one.
fn parse_number(s: &str) -> Result<f64, SettingError> {
    s.parse()
        .map_err(|_| SettingError::Value(format!("`{s}` is not a number")))
}

fn parse_fraction(s: &str) -> Result<f64, SettingError> {
    let v = parse_number(s)?;
    if !(0.0..=1.0).contains(&v) {
        return Err(SettingError::Value(format!("{v} is not between 0 and 1")));
    }
    Ok(v)
}

fn parse_positive_f64(s: &str) -> Result<f64, SettingError> {
    let v = parse_number(s)?;
    if !(v.is_finite() && v > 0.0) {
        return Err(SettingError::Value(format!(
            "{v} must be a positive number"
        )));
    }
    Ok(v)
}

/// An OTLP/gRPC endpoint: `host:port` or `http://host:port` (TLS is not built in: a collector
/// beside the gateway takes plain gRPC and forwards over TLS).
fn parse_otlp_endpoint(s: &str) -> Result<String, SettingError> {
    let rest = match s.split_once("://") {
        Some(("http", rest)) => rest,
        Some((scheme, _)) => {
            return Err(SettingError::Value(format!(
                "`{scheme}://` is not supported: use host:port or http://host:port (no TLS)"
            )))
        }
        None => s,
    };
    let rest = rest.trim_end_matches('/');
    match rest.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
            Ok(s.trim_end_matches('/').to_string())
        }
        _ => Err(SettingError::Value(format!("`{s}` is not HOST:PORT"))),
    }
}

fn parse_worker_url(s: &str) -> Result<String, SettingError> {
    crate::workers::registry::parse_worker_url(s)
        .map(|_| s.trim_end_matches('/').to_string())
        .map_err(|e| SettingError::Value(e.to_string()))
}

/// One `KEY=VALUE` label of a pod selector, split at the first `=` (the reference's rule); the
/// key must not be empty, the value may be.
fn parse_label(s: &str) -> Result<String, SettingError> {
    match s.split_once('=') {
        Some((k, _)) if !k.trim().is_empty() => Ok(s.to_string()),
        _ => Err(SettingError::Value(format!(
            "`{s}` is not a KEY=VALUE label"
        ))),
    }
}

/// One `WORKER_URL=tcp://HOST:PORT` value: the worker URL checked like `--worker-urls`.
fn parse_kv_endpoint(s: &str) -> Result<crate::kv::endpoint::WorkerEndpoint, SettingError> {
    let mut we = crate::kv::endpoint::parse_worker_endpoint(s).map_err(SettingError::Value)?;
    we.worker_url = parse_worker_url(&we.worker_url)?;
    Ok(we)
}

/// A parsed `--cpu-list` (a newtype so clap takes the whole list as one value).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuList(pub Vec<usize>);

fn parse_cpu_list(s: &str) -> Result<CpuList, SettingError> {
    let bad_cpu = |c: &str| SettingError::Value(format!("bad CPU `{c}`"));
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if let Some((a, b)) = part.split_once('-') {
            let a: usize = a.trim().parse().map_err(|_| bad_cpu(a))?;
            let b: usize = b.trim().parse().map_err(|_| bad_cpu(b))?;
            if a > b {
                return Err(SettingError::Value(format!("bad CPU range `{part}`")));
            }
            out.extend(a..=b);
        } else {
            out.push(part.parse().map_err(|_| bad_cpu(part))?);
        }
    }
    if out.is_empty() {
        return Err(SettingError::Value("empty CPU list".into()));
    }
    out.sort_unstable();
    out.dedup();
    Ok(CpuList(out))
}

/// The gateway's command line (and, through `--config`, its config file).
#[derive(Debug, Clone, Parser)]
#[command(
    name = "radixgate",
    version,
    about = "Cache-aware LLM gateway: sends each request to the SGLang/vLLM worker that already \
             holds its prompt prefix. A drop-in replacement for sgl-model-gateway.",
    args_override_self = true,
    max_term_width = 100
)]
pub struct Config {
    // ---- listening ----
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0")]
    pub host: String,
    /// Port to listen on.
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    /// Worker base URLs (http://host:port), space separated.
    #[arg(long = "worker-urls", num_args = 0.., value_parser = parse_worker_url)]
    pub worker_urls: Vec<String>,

    // ---- Kubernetes service discovery ----
    /// Find workers among Kubernetes pods: every Ready and Running pod matching --selector (or,
    /// with --pd-disaggregation, --prefill-selector / --decode-selector) is added as a worker at
    /// http://POD_IP:--service-discovery-port, and removed when it terminates or goes away.
    #[arg(long = "service-discovery", action = ArgAction::SetTrue)]
    pub service_discovery: bool,
    /// Labels a pod must all carry to be a worker, KEY=VALUE (space separated); sent to the API
    /// server as the watch's label selector. Empty: no pod is included (with a warning).
    #[arg(long = "selector", num_args = 1.., value_parser = parse_label, value_name = "KEY=VALUE")]
    pub selector: Vec<String>,
    /// Port of the workers in discovered pods (pods annotated `smg.ai/worker-ports: P1,P2`
    /// give one worker per listed port instead).
    #[arg(long = "service-discovery-port", default_value_t = 80)]
    pub service_discovery_port: u16,
    /// Namespace whose pods are watched. Default: the gateway's own namespace when it runs in a
    /// pod ($POD_NAMESPACE, else the service account's namespace file), else the kubeconfig
    /// context's namespace, else `default`; never every namespace unless
    /// --service-discovery-all-namespaces says so.
    #[arg(
        long = "service-discovery-namespace",
        conflicts_with = "service_discovery_all_namespaces"
    )]
    pub service_discovery_namespace: Option<String>,
    /// Watch pods in every namespace (needs cluster-wide get/list/watch on pods): anyone who can
    /// label a pod anywhere in the cluster can then make it a worker that receives prompts.
    #[arg(long = "service-discovery-all-namespaces", action = ArgAction::SetTrue)]
    pub service_discovery_all_namespaces: bool,
    /// Most worker ports one pod may list in `smg.ai/worker-ports`; the ports past it are
    /// refused (counted and logged), so one pod cannot fill the worker table.
    #[arg(long = "service-discovery-max-ports-per-pod", default_value_t = 8,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub service_discovery_max_ports_per_pod: u32,
    /// Most workers (targets: DP ranks count one each) discovery registers; pods past it are
    /// refused (counted and logged), so discovery cannot exhaust the worker ids.
    #[arg(long = "service-discovery-max-workers", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..=8192))]
    pub service_discovery_max_workers: u32,
    /// Discovered workers probed (and registered) at once; one pod's ports are probed one at a
    /// time, so a pod whose servers never answer cannot hold up another pod.
    #[arg(long = "service-discovery-concurrency", default_value_t = 8,
          value_parser = clap::value_parser!(u32).range(1..=256))]
    pub service_discovery_concurrency: u32,
    /// PD mode: labels of prefill pods, KEY=VALUE (a pod matching both role selectors is a
    /// prefill pod).
    #[arg(long = "prefill-selector", num_args = 1.., value_parser = parse_label, value_name = "KEY=VALUE")]
    pub prefill_selector: Vec<String>,
    /// PD mode: labels of decode pods, KEY=VALUE.
    #[arg(long = "decode-selector", num_args = 1.., value_parser = parse_label, value_name = "KEY=VALUE")]
    pub decode_selector: Vec<String>,
    /// PD mode: the pod annotation holding a prefill pod's bootstrap port (one port, or a comma
    /// list aligned with `smg.ai/worker-ports`); without it the decode side uses its own.
    #[arg(
        long = "bootstrap-port-annotation",
        default_value = "sglang.ai/bootstrap-port"
    )]
    pub bootstrap_port_annotation: String,
    /// Kubeconfig file for --service-discovery (default: the in-cluster service account when
    /// running in a pod, else $KUBECONFIG or ~/.kube/config).
    #[arg(long = "kubeconfig", value_name = "FILE")]
    pub kubeconfig: Option<std::path::PathBuf>,

    // ---- routing ----
    /// Routing policy: cache_aware, random, round_robin, power_of_two, manual,
    /// consistent_hashing, prefix_hash, bucket.
    #[arg(long, default_value = "cache_aware", value_parser = parse_policy)]
    pub policy: PolicyKind,
    /// Prefill/decode disaggregation: /generate, /v1/chat/completions and /v1/completions go to
    /// a prefill worker (--prefill) and a decode worker (--decode) at once, with bootstrap fields.
    #[arg(long = "pd-disaggregation", action = ArgAction::SetTrue)]
    pub pd_disaggregation: bool,
    /// PD mode: a prefill worker, URL [BOOTSTRAP_PORT|none] (repeatable; without a port the
    /// decode server uses its own --disaggregation-bootstrap-port).
    #[arg(long = "prefill", num_args = 1.., action = ArgAction::Append,
          value_name = "URL [BOOTSTRAP_PORT|none]", requires = "pd_disaggregation")]
    pub prefill: Vec<String>,
    /// PD mode: a decode worker URL (repeatable).
    #[arg(long = "decode", num_args = 1.., action = ArgAction::Append, value_name = "URL",
          value_parser = parse_worker_url, requires = "pd_disaggregation")]
    pub decode: Vec<String>,
    /// PD mode: policy that picks the prefill worker (default: --policy); bucket is allowed.
    #[arg(long = "prefill-policy", value_parser = parse_policy)]
    pub prefill_policy: Option<PolicyKind>,
    /// PD mode: policy that picks the decode worker (default: --policy).
    #[arg(long = "decode-policy", value_parser = parse_policy)]
    pub decode_policy: Option<PolicyKind>,
    /// Route to each worker's attention-DP ranks (its dp_size, read from /get_server_info), each
    /// rank a target of its own, with "data_parallel_rank" added to the JSON body.
    #[arg(long = "dp-aware", action = ArgAction::SetTrue)]
    pub dp_aware: bool,
    /// cache_aware: match rate (matched chars / request chars) above which prefix affinity wins.
    #[arg(long = "cache-threshold", default_value_t = 0.3, value_parser = parse_fraction)]
    pub cache_threshold: f64,
    /// cache_aware: load gap (max − min in-flight) that, with the ratio test, marks imbalance.
    #[arg(long = "balance-abs-threshold", default_value_t = 64)]
    pub balance_abs_threshold: u32,
    /// cache_aware: load ratio (max > ratio × min) that, with the gap test, marks imbalance.
    #[arg(long = "balance-rel-threshold", default_value_t = 1.5, value_parser = parse_positive_f64)]
    pub balance_rel_threshold: f64,
    /// Seconds between tree eviction passes (also the manual policy's TTL sweep).
    #[arg(
        long = "eviction-interval",
        alias = "eviction-interval-secs",
        default_value_t = 120
    )]
    pub eviction_interval: u64,
    /// Characters of request text kept per worker per model tree (the reference counts
    /// characters, though its docs say nodes); least recently used leaves go first.
    #[arg(long = "max-tree-size", default_value_t = 67_108_864)]
    pub max_tree_size: u64,
    /// cache_aware (opt-in): after a completion, also insert request text + " " + the reply, so
    /// the next turn matches its whole history.
    #[arg(long = "insert-response-text", action = ArgAction::SetTrue)]
    pub insert_response_text: bool,
    /// cache_aware (opt-in): when imbalanced, still prefer the longest match among workers whose
    /// load is within --balance-abs-threshold of the minimum.
    #[arg(long = "affinity-window", action = ArgAction::SetTrue)]
    pub affinity_window: bool,
    /// cache_aware on the workers' own KV-cache events (SGLang/vLLM `--kv-events-config`,
    /// ZeroMQ): prompts matched in tokens against what each server reports it holds. Workers
    /// without events, and prompts without tokens, fall back to the text tree.
    #[arg(long = "kv-events", action = ArgAction::SetTrue)]
    pub kv_events: bool,
    /// KV-event PUB socket of each worker, WORKER_URL=tcp://HOST:PORT (DP rank r: port + r; a `*`
    /// host means the worker's host). Workers not named here are read from their
    /// /get_server_info `kv_events_config`.
    #[arg(long = "kv-events-endpoints", num_args = 1.., value_parser = parse_kv_endpoint,
          requires = "kv_events")]
    pub kv_events_endpoints: Vec<crate::kv::endpoint::WorkerEndpoint>,
    /// KV-event replay socket of each worker, WORKER_URL=tcp://HOST:PORT (its
    /// `replay_endpoint`; missed batches are fetched from it). Needs the worker's
    /// --kv-events-endpoints entry.
    #[arg(long = "kv-events-replay-endpoints", num_args = 1.., value_parser = parse_kv_endpoint,
          requires = "kv_events")]
    pub kv_events_replay_endpoints: Vec<crate::kv::endpoint::WorkerEndpoint>,
    /// With --kv-events: the model's tokenizer, a tokenizer.json file or a model folder
    /// (tokenizer.json + tokenizer_config.json with the chat template), so chat and text
    /// prompts are matched in tokens. Without it only /generate `input_ids` are.
    #[arg(long = "tokenizer-path", visible_alias = "model-path")]
    pub tokenizer_path: Option<std::path::PathBuf>,
    /// With --kv-events: copy the KV block index of this running sibling copy
    /// (http://HOST:PORT, its GET /kv_index/snapshot) before subscribing, then apply live
    /// events after its watermarks: a new copy starts warm. Needs --admin-api-key (the same
    /// key on both copies: it is sent to this URL, and only to it; redirects are not followed).
    #[arg(long = "kv-bootstrap-peer", requires_all = ["kv_events", "admin_api_key"])]
    pub kv_bootstrap_peer: Option<String>,
    /// With --kv-events: longest time after start that /readiness answers 503 (warming) while
    /// a worker that publishes events has not replayed them yet, so a load balancer sends a
    /// new copy no turn it would route cold. 0: ready without waiting.
    #[arg(long = "kv-warm-timeout-secs", default_value_t = 30)]
    pub kv_warm_timeout_secs: u64,
    /// With --kv-events: what a prompt block a server holds only in host memory (SGLang
    /// HiCache, `medium` CPU_PINNED) counts for against one on its GPU (1): loading it back
    /// costs less than computing it, more than a GPU hit. Blocks beyond host memory (disk,
    /// external pools) count 0.
    #[arg(long = "kv-host-tier-weight", default_value_t = 0.8, value_parser = parse_fraction)]
    pub kv_host_tier_weight: f64,
    /// With --kv-events: most KV-event publishers (DP ranks) one worker may announce; a worker
    /// announcing more is not subscribed (scored by the text tree), so no worker can make the
    /// gateway open hundreds of connections.
    #[arg(long = "kv-max-dp-ranks", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub kv_max_dp_ranks: u32,
    /// With --kv-events: longest a KV-event publisher may leave what the gateway sends it (the
    /// subscription, a replay request, the answer to its latest PING) unread; past it the
    /// connection is dropped, counted, and redialled with the backoff.
    #[arg(long = "kv-send-timeout-secs", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub kv_send_timeout_secs: u64,
    /// With --kv-events: threads that read the publishers' sockets and decode their batches
    /// (each publisher on one), in front of the index's one writer thread; more help when one
    /// thread cannot read the whole fleet's offer (docs/benchmarks.md measures one).
    #[arg(long = "kv-event-threads", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub kv_event_threads: u32,
    /// With --kv-events: most MiB of decoded batches waiting for the index's writer; past it the
    /// reader threads wait (publishers then buffer, drop and are replayed or reset), so memory
    /// never follows the fleet's offer.
    #[arg(long = "kv-queue-mib", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub kv_queue_mib: u32,
    /// With --kv-events: a publisher whose batches reach the index later than this is lagging:
    /// its worker is scored by the text tree (and said in the log and
    /// radixgate_kv_lagging_publishers) until it catches up.
    #[arg(long = "kv-max-staleness-ms", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(10..=600_000))]
    pub kv_max_staleness_ms: u64,
    /// manual: how a new routing key is placed: random, min_load, min_group.
    #[arg(long = "assignment-mode", default_value = "random", value_parser = parse_assignment)]
    pub assignment_mode: AssignmentMode,
    /// manual: routing keys idle longer than this many seconds expire.
    #[arg(long = "max-idle-secs", default_value_t = 14_400)]
    pub max_idle_secs: u64,
    /// manual: most routing keys remembered; beyond it the least recently used go first.
    #[arg(long = "max-routing-keys", default_value_t = 262_144)]
    pub max_routing_keys: usize,
    /// prefix_hash: characters of the prompt hashed onto the ring.
    #[arg(long = "prefix-hash-chars", default_value_t = 1024)]
    pub prefix_hash_chars: usize,
    /// bucket: seconds between adjustments of the per-worker length ranges.
    #[arg(long = "bucket-adjust-interval-secs", default_value_t = 5)]
    pub bucket_adjust_interval_secs: u64,

    // ---- requests ----
    /// Longest time a whole request may take, streamed body included (seconds).
    #[arg(long = "request-timeout-secs", default_value_t = 1800)]
    pub request_timeout_secs: u64,
    /// Largest request body accepted, in bytes (larger → 413).
    #[arg(long = "max-payload-size", default_value_t = 536_870_912)]
    pub max_payload_size: u64,
    /// Headers searched, in order, for a client-supplied request id (echoed as x-request-id).
    #[arg(
        long = "request-id-headers",
        num_args = 1..,
        default_values_t = ["x-request-id".to_string(), "x-correlation-id".to_string(),
            "x-trace-id".to_string(), "request-id".to_string()]
    )]
    pub request_id_headers: Vec<String>,
    /// Seconds a client has to send a complete request head once it started one.
    #[arg(long = "header-timeout-secs", default_value_t = 10)]
    pub header_timeout_secs: u64,
    /// Seconds an idle keep-alive client connection is kept open.
    #[arg(long = "keepalive-timeout-secs", default_value_t = 75)]
    pub keepalive_timeout_secs: u64,
    /// Slowest average rate a request body may arrive at, in bytes per second, after a grace of
    /// --header-timeout-secs; a slower body gets 408 (never more than --request-timeout-secs in
    /// all). 0: no minimum (only the per-read --header-timeout-secs).
    #[arg(long = "min-body-bytes-per-second", default_value_t = 4096)]
    pub min_body_bytes_per_second: u64,
    /// Client connections one core keeps open; at the cap the longest-idle keep-alive connection
    /// is closed for a new one, and when none is idle the new one gets 503. 0: no cap.
    #[arg(long = "max-connections-per-core", default_value_t = 8192)]
    pub max_connections_per_core: usize,
    /// Seconds to wait for a TCP connection to a worker.
    #[arg(long = "connect-timeout-secs", default_value_t = 10)]
    pub connect_timeout_secs: u64,
    /// Milliseconds an idle pooled worker connection is kept (below the engines' 5 s keep-alive).
    #[arg(long = "upstream-idle-timeout-ms", default_value_t = 4000)]
    pub upstream_idle_timeout_ms: u64,

    // ---- retries and circuit breakers ----
    /// Attempts in all for one request (first try included), on 408/429/5xx, connect errors
    /// and timeouts, while no response byte has reached the client.
    #[arg(long = "retry-max-retries", default_value_t = 5)]
    pub retry_max_retries: u32,
    /// First retry delay, milliseconds.
    #[arg(long = "retry-initial-backoff-ms", default_value_t = 50)]
    pub retry_initial_backoff_ms: u64,
    /// Delay growth per retry.
    #[arg(long = "retry-backoff-multiplier", default_value_t = 1.5, value_parser = parse_positive_f64)]
    pub retry_backoff_multiplier: f64,
    /// Longest retry delay, milliseconds.
    #[arg(long = "retry-max-backoff-ms", default_value_t = 30_000)]
    pub retry_max_backoff_ms: u64,
    /// Random spread of each delay (0.2 = ±20 %).
    #[arg(long = "retry-jitter-factor", default_value_t = 0.2, value_parser = parse_fraction)]
    pub retry_jitter_factor: f64,
    /// One attempt per request.
    #[arg(long = "disable-retries", action = ArgAction::SetTrue)]
    pub disable_retries: bool,
    /// Consecutive worker failures (5xx, connect errors, timeouts; not 4xx) that open its circuit.
    #[arg(long = "cb-failure-threshold", default_value_t = 10)]
    pub cb_failure_threshold: u32,
    /// Successful probes that close a half-open circuit.
    #[arg(long = "cb-success-threshold", default_value_t = 3)]
    pub cb_success_threshold: u32,
    /// Seconds a circuit stays open before probes are let through.
    #[arg(long = "cb-timeout-duration-secs", default_value_t = 60)]
    pub cb_timeout_duration_secs: u64,
    /// Seconds within which consecutive failures add up (a longer gap starts a new run).
    #[arg(long = "cb-window-duration-secs", default_value_t = 120)]
    pub cb_window_duration_secs: u64,
    /// Never open circuits.
    #[arg(long = "disable-circuit-breaker", action = ArgAction::SetTrue)]
    pub disable_circuit_breaker: bool,

    // ---- admission ----
    /// Requests processed at once across the gateway (-1: no limit).
    #[arg(long = "max-concurrent-requests", default_value_t = -1, allow_negative_numbers = true)]
    pub max_concurrent_requests: i64,
    /// Requests that may wait for a slot; more are refused with 429.
    #[arg(long = "queue-size", default_value_t = 100)]
    pub queue_size: u32,
    /// Seconds a request may wait for a slot before 408.
    #[arg(long = "queue-timeout-secs", default_value_t = 60)]
    pub queue_timeout_secs: u64,
    /// Requests admitted per second (token bucket; default: unlimited, or
    /// --max-concurrent-requests per second when that is set, as the reference does).
    #[arg(long = "rate-limit-tokens-per-second")]
    pub rate_limit_tokens_per_second: Option<u64>,
    /// Admit by the workers' measured saturation instead of a fixed cap: requests go straight
    /// through while some worker is below the saturation thresholds, and wait in the gateway
    /// (at most --queue-size, each at most --queue-timeout-secs) only while every worker is at
    /// them, let in by priority class (X-SMG-Priority, or the body's priority), then by
    /// token-weighted fairness across tenants ([tenants] in the config file), then arrival.
    #[arg(long = "saturation-admission", action = ArgAction::SetTrue)]
    pub saturation_admission: bool,
    /// Requests waiting in a worker's own queue (sglang:num_queue_reqs or
    /// vllm:num_requests_waiting, with the requests this gateway sent since the last reading)
    /// at which it counts as saturated.
    #[arg(long = "saturation-queue-reqs", default_value_t = 2)]
    pub saturation_queue_reqs: u32,
    /// KV-cache use (sglang:token_usage or vllm:kv_cache_usage_perc, 0 to 1) at which a worker
    /// counts as saturated.
    #[arg(long = "saturation-kv-usage", default_value_t = 0.95)]
    pub saturation_kv_usage: f64,
    /// Share of the KV cache kept for prioritized requests (priority above 0): requests of
    /// priority 0 or below count a worker as saturated at --saturation-kv-usage minus this, and
    /// at one queued request fewer than --saturation-queue-reqs (at least 1), so an interactive
    /// class finds room on a fleet a batch flood fills. 0: one threshold.
    #[arg(long = "saturation-headroom", default_value_t = 0.0)]
    pub saturation_headroom: f64,
    /// Prompt tokens a worker with an empty queue takes into one prefill step (SGLang's
    /// --chunked-prefill-size): between two readings, the requests this gateway sends a worker
    /// past that count as queued there, since the engine's queue figure is only as new as its
    /// last step.
    #[arg(long = "saturation-chunk-tokens", default_value_t = 8192)]
    pub saturation_chunk_tokens: u64,
    /// Milliseconds between readings of the workers' load with --saturation-admission (the
    /// telemetry rounds run this often instead of every --worker-metrics-interval-secs).
    #[arg(long = "saturation-poll-ms", default_value_t = 100)]
    pub saturation_poll_ms: u64,
    /// Milliseconds a sheddable request (priority below 0) may expect to wait; past it, it is
    /// refused at once with 429 and Retry-After instead of queued.
    #[arg(long = "sheddable-max-wait-ms", default_value_t = 1000)]
    pub sheddable_max_wait_ms: u64,
    /// Take the tenant from this request header instead of the API key (only behind a trusted
    /// front that authenticates clients and sets it; of several copies the last counts, the one
    /// the front appended; unknown names are the default tenant).
    #[arg(long = "tenant-header")]
    pub tenant_header: Option<String>,
    /// Tenants from the config file's [tenants.NAME] tables (keys, weight, max_priority,
    /// requests_per_minute, tokens_per_minute); not a flag.
    #[arg(skip)]
    pub tenants: Vec<(String, crate::admission::tenants::TenantSpec)>,

    // ---- health ----
    /// Seconds between active health checks of each worker.
    #[arg(long = "health-check-interval-secs", default_value_t = 60)]
    pub health_check_interval_secs: u64,
    /// Seconds a health check may take.
    #[arg(long = "health-check-timeout-secs", default_value_t = 5)]
    pub health_check_timeout_secs: u64,
    /// Consecutive failed checks that make a worker unhealthy.
    #[arg(long = "health-failure-threshold", default_value_t = 3)]
    pub health_failure_threshold: u32,
    /// Consecutive good checks that make an unhealthy worker healthy again.
    #[arg(long = "health-success-threshold", default_value_t = 2)]
    pub health_success_threshold: u32,
    /// Path probed by health checks.
    #[arg(long = "health-check-endpoint", default_value = "/health")]
    pub health_check_endpoint: String,
    /// Never check health: every worker is always selectable (circuit breakers still apply).
    #[arg(long = "disable-health-check", action = ArgAction::SetTrue)]
    pub disable_health_check: bool,
    /// Seconds to wait at start for each worker to answer its first health check.
    #[arg(long = "worker-startup-timeout-secs", default_value_t = 1800)]
    pub worker_startup_timeout_secs: u64,
    /// Longest pause, in seconds, between start-up polls of a worker that is not up yet
    /// (polls back off from 1 s up to this).
    #[arg(
        long = "worker-startup-check-interval",
        alias = "worker-startup-check-interval-secs",
        default_value_t = 30
    )]
    pub worker_startup_check_interval: u64,
    /// Seconds between scrapes of every worker's /metrics (and /get_load without metrics):
    /// engine load for routing, the achieved cache hit ratio, GET /engine_metrics. 0: off.
    #[arg(long = "worker-metrics-interval-secs", default_value_t = 5)]
    pub worker_metrics_interval_secs: u64,

    // ---- security and lifecycle ----
    /// Require `Authorization: Bearer <key>` on every inference and admin endpoint.
    #[arg(long = "api-key", env = "RADIXGATE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Key for the control calls (worker add/remove, /flush_cache, abort_all) and the KV index
    /// copy; also opens the admin reads (which take --api-key when no admin key is set).
    #[arg(
        long = "admin-api-key",
        env = "RADIXGATE_ADMIN_API_KEY",
        hide_env_values = true
    )]
    pub admin_api_key: Option<String>,
    /// Without --admin-api-key, let clients on the gateway's own host (127.0.0.1 or ::1) add
    /// and remove workers, flush caches and abort every request, when the request did not come
    /// through a proxy (no Forwarded, X-Forwarded-For or X-Real-IP header). Off: without an
    /// admin key these are refused (403).
    #[arg(long = "keyless-local-admin", action = ArgAction::SetTrue)]
    pub keyless_local_admin: bool,
    /// Key the gateway sends to the workers as `Authorization: Bearer <key>` on the requests it
    /// forwards, in place of the caller's, and on its own calls to them (health checks, model
    /// cards, /get_server_info, metrics, admin fan-outs), for workers started with their own
    /// --api-key.
    #[arg(
        long = "worker-api-key",
        env = "RADIXGATE_WORKER_API_KEY",
        hide_env_values = true
    )]
    pub worker_api_key: Option<String>,
    /// Pass the caller's `Authorization` and `x-api-key` on to the workers even though the
    /// gateway checks keys itself (--api-key or tenant keys), as the reference does. Off: a
    /// caller's key stops at the gateway (the workers get --worker-api-key, or no key).
    #[arg(long = "forward-client-authorization", action = ArgAction::SetTrue)]
    pub forward_client_authorization: bool,
    /// Seconds in-flight requests get to finish after SIGTERM/SIGINT.
    #[arg(long = "shutdown-grace-period-secs", default_value_t = 180)]
    pub shutdown_grace_period_secs: u64,

    // ---- observability ----
    /// Port of the Prometheus /metrics endpoint (0 disables it).
    #[arg(long = "prometheus-port", default_value_t = 29000)]
    pub prometheus_port: u16,
    /// Address of the Prometheus /metrics endpoint.
    #[arg(long = "prometheus-host", default_value = "0.0.0.0")]
    pub prometheus_host: String,
    /// Record OpenTelemetry spans of each request (admit, queue wait, route, each upstream
    /// attempt, first byte, end of stream) and export them over OTLP/gRPC; a `traceparent`
    /// goes to the worker so its own spans join the trace.
    #[arg(long = "enable-trace", action = ArgAction::SetTrue)]
    pub enable_trace: bool,
    /// With --enable-trace: the OTLP/gRPC collector, HOST:PORT or http://HOST:PORT (no TLS).
    #[arg(long = "otlp-traces-endpoint", default_value = "localhost:4317",
          value_parser = parse_otlp_endpoint)]
    pub otlp_traces_endpoint: String,
    /// With --enable-trace: share of requests recorded (0 to 1), a client's `traceparent`
    /// or not; only a trusted client's sampled flag decides instead
    /// (--trace-trust-caller-sampling).
    #[arg(long = "trace-sample-ratio", default_value_t = 1.0, value_parser = parse_fraction)]
    pub trace_sample_ratio: f64,
    /// With --enable-trace: a client's `traceparent` sampled flag decides whether its request
    /// is recorded, over --trace-sample-ratio; with --api-key only for clients presenting it.
    /// Off: the ratio decides (the client's trace is still continued).
    #[arg(long = "trace-trust-caller-sampling", action = ArgAction::SetTrue)]
    pub trace_trust_caller_sampling: bool,
    /// With --enable-trace: finished spans each core keeps for the export thread; more are
    /// dropped and counted (radixgate_trace_spans_dropped_total), never waited for.
    #[arg(long = "trace-buffer-spans", default_value_t = 8192,
          value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    pub trace_buffer_spans: u32,
    /// With --enable-trace: bytes of finished spans each core keeps for the export thread
    /// (at least 65536); more are dropped and counted, never waited for.
    #[arg(long = "trace-buffer-bytes", default_value_t = crate::trace::DEFAULT_BUFFER_BYTES,
          value_parser = clap::value_parser!(u64).range(65_536..=1 << 40))]
    pub trace_buffer_bytes: u64,
    /// With --enable-trace: most bytes of one OTLP export request (estimated protobuf size,
    /// at least 4096); larger batches are split. Keep it under the collector's message limit
    /// (4 MiB by default).
    #[arg(long = "trace-export-batch-bytes", default_value_t = crate::trace::DEFAULT_BATCH_BYTES,
          value_parser = clap::value_parser!(u64).range(4096..=1 << 30))]
    pub trace_export_batch_bytes: u64,
    /// Log level: trace, debug, info, warn, error.
    #[arg(long = "log-level", value_enum, default_value_t = crate::log::Level::Info)]
    pub log_level: crate::log::Level,

    // ---- runtime (radixgate's own) ----
    /// Number of cores (threads) serving requests; default: every CPU this process may use.
    #[arg(long)]
    pub cores: Option<usize>,
    /// Pin the serving threads to these CPUs (e.g. `0-3,8`); implies --cores.
    #[arg(long = "cpu-list", value_parser = parse_cpu_list)]
    pub cpu_list: Option<CpuList>,
    /// I/O driver: auto (io_uring, epoll fallback), uring, legacy (epoll).
    #[arg(long = "io-driver", value_enum, default_value_t = IoDriver::Auto)]
    pub io_driver: IoDriver,
    /// Microseconds a serving core keeps polling for I/O without sleeping after each request
    /// event (0: sleep at once). Saves waking a halted CPU (tens of µs on virtual machines) on
    /// each hop; costs CPU while requests trickle in (up to a whole core), none when idle.
    #[arg(long = "busy-poll-us", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1000))]
    pub busy_poll_us: u64,
    /// TOML file with the same keys as the flags; command-line flags override it.
    #[arg(long)]
    pub config: Option<String>,
}

impl Config {
    /// Parse the process arguments (and `--config`), exiting with code 2 and a clear message on
    /// any bad value or unknown flag.
    pub fn from_env() -> Config {
        let args: Vec<String> = std::env::args().collect();
        match Config::try_from_args(&args) {
            Ok(c) => c,
            Err(ConfigError::Clap(e)) => e.exit(),
            Err(ConfigError::File(msg)) => {
                eprintln!("error: {msg}");
                std::process::exit(2);
            }
        }
    }

    /// Parse an argument vector (first element = program name), reading `--config` if given.
    pub fn try_from_args(args: &[String]) -> Result<Config, ConfigError> {
        let file = find_config_path(args);
        let mut argv: Vec<String> = Vec::with_capacity(args.len() + 16);
        argv.push(args.first().cloned().unwrap_or_else(|| "radixgate".into()));
        let mut tenants = Vec::new();
        if let Some(path) = file {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| ConfigError::File(format!("cannot read config file {path}: {e}")))?;
            argv.extend(
                toml_to_args(&text).map_err(|e| ConfigError::File(format!("{path}: {e}")))?,
            );
            tenants = tenants_of(&text).map_err(|e| ConfigError::File(format!("{path}: {e}")))?;
        }
        argv.extend(args.iter().skip(1).cloned());
        let mut config = Config::try_parse_from(argv).map_err(ConfigError::Clap)?;
        config.tenants = tenants;
        // Checks across flags (clap checks one value at a time), with clap's exit code 2.
        if let Err(msg) = config
            .kv_endpoints()
            .and(config.pd_checks())
            .and(config.admission_checks())
        {
            let mut cmd = <Config as clap::CommandFactory>::command();
            return Err(ConfigError::Clap(
                cmd.error(clap::error::ErrorKind::ValueValidation, msg),
            ));
        }
        Ok(config)
    }

    /// The KV-event endpoints given by flags, paired per worker (empty: read them from the
    /// workers).
    pub fn kv_endpoints(&self) -> Result<Vec<crate::kv::endpoint::KvEndpoints>, SettingError> {
        crate::kv::endpoint::pair_endpoints(
            &self.kv_events_endpoints,
            &self.kv_events_replay_endpoints,
        )
        .map_err(SettingError::Value)
    }

    /// The `--prefill` workers as (URL, bootstrap port), checked like `--worker-urls`.
    pub fn prefill_workers(&self) -> Result<Vec<(String, Option<u16>)>, SettingError> {
        let list = crate::workers::role::parse_prefill_values(&self.prefill)
            .map_err(SettingError::Value)?;
        for (url, _) in &list {
            parse_worker_url(url).map_err(|e| SettingError::Flag {
                flag: "--prefill",
                why: e.to_string(),
            })?;
        }
        Ok(list)
    }

    /// The PD flags agree with each other: valid prefill values, and no bucket on the decode
    /// side (the reference offers it for prefill only).
    /// The saturation admission's settings make sense together.
    fn admission_checks(&self) -> Result<(), SettingError> {
        let flag = |flag, why: &str| {
            Err(SettingError::Flag {
                flag,
                why: why.to_string(),
            })
        };
        if !(self.saturation_kv_usage > 0.0 && self.saturation_kv_usage <= 1.0) {
            return flag(
                "--saturation-kv-usage",
                "a share of the KV cache, above 0 and at most 1",
            );
        }
        if !(self.saturation_headroom >= 0.0 && self.saturation_headroom < self.saturation_kv_usage)
        {
            return flag(
                "--saturation-headroom",
                "a share of the KV cache, at least 0 and below --saturation-kv-usage",
            );
        }
        if self.saturation_chunk_tokens == 0 {
            return flag(
                "--saturation-chunk-tokens",
                "at least 1 (a prefill step's tokens)",
            );
        }
        if self.saturation_queue_reqs == 0 {
            return flag(
                "--saturation-queue-reqs",
                "at least 1 (0 would call every worker saturated)",
            );
        }
        if self.saturation_admission {
            if self.saturation_poll_ms == 0 {
                return Err(SettingError::Conflict(
                    "--saturation-admission needs --saturation-poll-ms above 0",
                ));
            }
            if self.max_concurrent_requests >= 0 {
                return Err(SettingError::Conflict(
                    "--saturation-admission replaces --max-concurrent-requests: give one of them",
                ));
            }
        }
        crate::admission::tenants::Tenants::new(&self.tenants)
            .map(|_| ())
            .map_err(|e| SettingError::Value(e.to_string()))
    }

    /// How often the telemetry thread reads the workers (None: never): every
    /// --worker-metrics-interval-secs, or every --saturation-poll-ms with
    /// --saturation-admission (its readings are what admission decides on).
    pub fn telemetry_interval(&self) -> Option<Duration> {
        let regular = (self.worker_metrics_interval_secs > 0)
            .then(|| Duration::from_secs(self.worker_metrics_interval_secs));
        if self.saturation_admission {
            let fast = Duration::from_millis(self.saturation_poll_ms);
            return Some(regular.map_or(fast, |r| r.min(fast)));
        }
        regular
    }

    fn pd_checks(&self) -> Result<(), SettingError> {
        self.prefill_workers()?;
        if self.decode_policy == Some(PolicyKind::Bucket) {
            return Err(SettingError::Flag {
                flag: "--decode-policy",
                why: "bucket is a prefill-side policy".into(),
            });
        }
        if self.pd_disaggregation
            && self.decode_policy.is_none()
            && self.policy == PolicyKind::Bucket
        {
            return Err(SettingError::Conflict(
                "--policy bucket in PD mode needs a --decode-policy",
            ));
        }
        Ok(())
    }

    /// The policy of the prefill side in PD mode (`--prefill-policy`, else `--policy`), and
    /// the only policy outside PD mode.
    pub fn prefill_policy_kind(&self) -> PolicyKind {
        match (self.pd_disaggregation, self.prefill_policy) {
            (true, Some(k)) => k,
            _ => self.policy,
        }
    }

    /// The policy of the decode side in PD mode (`--decode-policy`, else `--policy`).
    pub fn decode_policy_kind(&self) -> PolicyKind {
        self.decode_policy.unwrap_or(self.policy)
    }

    /// Policy settings for the routing layer (in PD mode: the prefill side's).
    pub fn policy_config(&self) -> crate::route::types::PolicyConfig {
        self.policy_config_for(self.prefill_policy_kind())
    }

    /// Policy settings for a policy of kind `kind` (PD mode's two sides differ in kind only).
    pub fn policy_config_for(&self, kind: PolicyKind) -> crate::route::types::PolicyConfig {
        crate::route::types::PolicyConfig {
            kind,
            cache_threshold: self.cache_threshold,
            balance_abs_threshold: self.balance_abs_threshold,
            balance_rel_threshold: self.balance_rel_threshold,
            affinity_window: self.affinity_window,
            assignment_mode: self.assignment_mode,
            max_idle_secs: self.max_idle_secs,
            max_routing_keys: self.max_routing_keys,
            prefix_hash_chars: self.prefix_hash_chars,
            bucket_adjust_interval_secs: self.bucket_adjust_interval_secs,
        }
    }

    /// Circuit breaker settings.
    pub fn breaker_config(&self) -> crate::workers::breaker::BreakerConfig {
        crate::workers::breaker::BreakerConfig {
            enabled: !self.disable_circuit_breaker,
            failure_threshold: self.cb_failure_threshold.max(1),
            success_threshold: self.cb_success_threshold.max(1),
            open_ms: self.cb_timeout_duration_secs * 1000,
            window_ms: self.cb_window_duration_secs * 1000,
            half_open_probes: 3,
        }
    }

    /// Retry settings.
    pub fn retry_policy(&self) -> crate::proxy::retry::RetryPolicy {
        crate::proxy::retry::RetryPolicy {
            max_attempts: if self.disable_retries {
                1
            } else {
                self.retry_max_retries.max(1)
            },
            initial_ms: self.retry_initial_backoff_ms,
            multiplier: self.retry_backoff_multiplier,
            max_ms: self.retry_max_backoff_ms,
            jitter: self.retry_jitter_factor,
        }
    }

    /// The whole-request deadline.
    pub fn request_timeout(&self) -> Duration {
        Duration::from_secs(self.request_timeout_secs)
    }
}

/// Why the configuration was refused.
#[derive(Debug)]
pub enum ConfigError {
    /// Bad flag or value (clap renders the message and exits with code 2).
    Clap(clap::Error),
    /// Unreadable or invalid config file.
    File(String),
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConfigError::Clap(e) => write!(f, "{e}"),
            ConfigError::File(m) => f.write_str(m),
        }
    }
}

/// A setting refused by a check clap cannot make alone: one value's shape (clap's value
/// parsers), flags that must agree, a config file's keys. Typed so a caller tells which kind of
/// refusal it holds; its `Display` is the exact line the user reads (clap puts it after the
/// flag, the config-file path before it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SettingError {
    /// A value refused, worded by the check that refused it (here, or in the module that owns
    /// the value's format); whoever shows it names the flag.
    Value(String),
    /// One flag's value refused by a check across flags: shown as `{flag}: {why}`.
    Flag {
        /// The flag, as the user typed it (`--saturation-kv-usage`).
        flag: &'static str,
        /// What a valid value is.
        why: String,
    },
    /// Flags that do not go together; the sentence names each of them.
    Conflict(&'static str),
    /// A config file refused as a whole (its TOML, a nested `config`, the tenant tables).
    File(String),
    /// One key of a config file refused: shown as `` `{key}`: {why} ``.
    Key {
        /// The key as the file spells it.
        key: String,
        /// What is wrong with its value.
        why: String,
    },
}

impl std::fmt::Display for SettingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SettingError::Value(m) | SettingError::File(m) => f.write_str(m),
            SettingError::Flag { flag, why } => write!(f, "{flag}: {why}"),
            SettingError::Conflict(m) => f.write_str(m),
            SettingError::Key { key, why } => write!(f, "`{key}`: {why}"),
        }
    }
}

impl std::error::Error for SettingError {}

fn find_config_path(args: &[String]) -> Option<String> {
    let mut it = args.iter().skip(1);
    let mut found = None;
    while let Some(a) = it.next() {
        if a == "--config" {
            found = it.next().cloned();
        } else if let Some(v) = a.strip_prefix("--config=") {
            found = Some(v.to_string());
        }
    }
    found
}

/// The `[tenants]` tables of a config file (not flags: a table per tenant).
fn tenants_of(
    text: &str,
) -> Result<Vec<(String, crate::admission::tenants::TenantSpec)>, SettingError> {
    let table = toml_table(text)?;
    crate::admission::tenants::from_toml(&table).map_err(|e| SettingError::File(e.to_string()))
}

/// A config file's text as a TOML table.
fn toml_table(text: &str) -> Result<toml::Table, SettingError> {
    text.parse()
        .map_err(|e: toml::de::Error| SettingError::File(e.to_string()))
}

/// Turn a TOML table into `--flag value` arguments (arrays become several values; `true`
/// becomes a bare flag; `false` is omitted).
pub fn toml_to_args(text: &str) -> Result<Vec<String>, SettingError> {
    let table = toml_table(text)?;
    let mut out = Vec::new();
    for (key, value) in table {
        if key == "tenants" {
            continue; // tables of their own (`tenants_of`)
        }
        let flag = format!("--{}", key.replace('_', "-"));
        if flag == "--config" {
            return Err(SettingError::File(
                "a config file cannot name another config file".into(),
            ));
        }
        match value {
            toml::Value::Boolean(true) => out.push(flag),
            toml::Value::Boolean(false) => {}
            // `selector = { app = "sglang" }`: a label table, as KEY=VALUE values.
            toml::Value::Table(labels) => {
                out.push(flag);
                for (k, v) in labels {
                    out.push(format!("{k}={}", scalar_to_string(&key, &v)?));
                }
            }
            toml::Value::Array(items) => {
                out.push(flag);
                for item in items {
                    // `prefill = [["http://p:1", 8998], ["http://q:2"]]`: one worker per item.
                    if let toml::Value::Array(inner) = item {
                        for v in inner {
                            out.push(scalar_to_string(&key, &v)?);
                        }
                    } else {
                        out.push(scalar_to_string(&key, &item)?);
                    }
                }
            }
            other => {
                out.push(flag);
                out.push(scalar_to_string(&key, &other)?);
            }
        }
    }
    Ok(out)
}

fn scalar_to_string(key: &str, v: &toml::Value) -> Result<String, SettingError> {
    match v {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(i) => Ok(i.to_string()),
        toml::Value::Float(f) => Ok(f.to_string()),
        toml::Value::Boolean(b) => Ok(b.to_string()),
        _ => Err(SettingError::Key {
            key: key.to_string(),
            why: format!("unsupported value {v}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, ConfigError> {
        let v: Vec<String> = std::iter::once("radixgate")
            .chain(args.iter().copied())
            .map(String::from)
            .collect();
        Config::try_from_args(&v)
    }

    #[test]
    fn defaults_mirror_the_reference() {
        let c = parse(&[]).unwrap();
        assert_eq!(c.host, "0.0.0.0");
        assert_eq!(c.port, 30000);
        assert_eq!(c.policy, PolicyKind::CacheAware);
        assert_eq!(c.cache_threshold, 0.3);
        assert_eq!(c.balance_abs_threshold, 64);
        assert_eq!(c.balance_rel_threshold, 1.5);
        assert_eq!(c.eviction_interval, 120);
        assert_eq!(c.max_tree_size, 67_108_864);
        assert_eq!(c.prometheus_port, 29000);
        assert_eq!(c.request_timeout_secs, 1800);
        assert_eq!(c.max_payload_size, 536_870_912);
        assert_eq!(c.request_id_headers.len(), 4);
        assert_eq!(c.io_driver, IoDriver::Auto);
        // Admission's own defaults: SGLang's --chunked-prefill-size for the prefill step.
        assert_eq!(
            (
                c.saturation_queue_reqs,
                c.saturation_kv_usage,
                c.saturation_chunk_tokens
            ),
            (2, 0.95, 8192)
        );
    }

    #[test]
    fn reference_command_line_is_accepted() {
        let c = parse(&[
            "--worker-urls",
            "http://127.0.0.1:30000",
            "http://127.0.0.1:30001",
            "--policy",
            "cache_aware",
        ])
        .unwrap();
        assert_eq!(c.worker_urls.len(), 2);
        let c = parse(&["--eviction-interval-secs", "60"]).unwrap();
        assert_eq!(c.eviction_interval, 60);
    }

    #[test]
    fn bad_values_and_unknown_flags_are_refused_with_exit_code_2() {
        for bad in [
            &["--policy", "fastest"][..],
            &["--cache-threshold", "1.5"],
            &["--port", "70000"],
            &["--no-such-flag"],
            &["--worker-urls", "ftp://x"],
            &["--io-driver", "kqueue"],
            // A spinning core past a millisecond starves the helper threads.
            &["--busy-poll-us", "1001"],
            &["--kv-max-dp-ranks", "0"],
            // A send deadline of 0 would drop every publisher the first time a write waits.
            &["--kv-send-timeout-secs", "0"],
            // Admission thresholds checked across flags.
            &["--saturation-queue-reqs", "0"],
            &["--saturation-chunk-tokens", "0"],
            &["--saturation-headroom", "0.95"],
            &["--saturation-kv-usage", "1.2"],
        ] {
            match parse(bad) {
                Err(ConfigError::Clap(e)) => assert_eq!(e.exit_code(), 2, "{bad:?}"),
                other => panic!("{bad:?} accepted: {other:?}"),
            }
        }
    }

    #[test]
    fn trace_flags_have_the_references_names_and_defaults() {
        let c = parse(&[]).unwrap();
        assert!(!c.enable_trace);
        assert_eq!(c.otlp_traces_endpoint, "localhost:4317");
        assert_eq!(c.trace_sample_ratio, 1.0);
        assert_eq!(c.trace_buffer_spans, 8192);
        assert!(!c.trace_trust_caller_sampling);
        assert_eq!(c.trace_buffer_bytes, 16 << 20);
        assert_eq!(c.trace_export_batch_bytes, 3 << 20);
        let c = parse(&[
            "--trace-trust-caller-sampling",
            "--trace-buffer-bytes",
            "65536",
            "--trace-export-batch-bytes",
            "4096",
        ])
        .unwrap();
        assert!(c.trace_trust_caller_sampling);
        assert_eq!(
            (c.trace_buffer_bytes, c.trace_export_batch_bytes),
            (65536, 4096)
        );
        let c = parse(&[
            "--enable-trace",
            "--otlp-traces-endpoint",
            "http://collector:4317/",
            "--trace-sample-ratio",
            "0.25",
        ])
        .unwrap();
        assert!(c.enable_trace);
        assert_eq!(c.otlp_traces_endpoint, "http://collector:4317");
        assert_eq!(c.trace_sample_ratio, 0.25);
        let from_file = toml_to_args(
            "enable-trace = true\notlp_traces_endpoint = \"otel:4317\"\ntrace-sample-ratio = 0.5\n\
             trace-trust-caller-sampling = true\ntrace-buffer-bytes = 1048576\n\
             trace-export-batch-bytes = 1000000\n",
        )
        .unwrap();
        let mut args = vec!["radixgate".to_string()];
        args.extend(from_file);
        let c = Config::try_from_args(&args).unwrap();
        assert!(c.enable_trace);
        assert_eq!(c.otlp_traces_endpoint, "otel:4317");
        assert_eq!(c.trace_sample_ratio, 0.5);
        assert!(c.trace_trust_caller_sampling);
        assert_eq!(
            (c.trace_buffer_bytes, c.trace_export_batch_bytes),
            (1 << 20, 1_000_000)
        );
        for bad in [
            &["--otlp-traces-endpoint", "https://c:4317"][..],
            &["--otlp-traces-endpoint", "collector"],
            &["--otlp-traces-endpoint", "c:99999"],
            &["--trace-sample-ratio", "1.5"],
            &["--trace-buffer-spans", "0"],
            &["--trace-buffer-bytes", "65535"],
            &["--trace-export-batch-bytes", "4095"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn pd_flags_parse_as_the_reference_spells_them() {
        let c = parse(&[
            "--pd-disaggregation",
            "--prefill",
            "http://127.0.0.1:1",
            "8998",
            "--prefill",
            "http://127.0.0.1:2",
            "--prefill",
            "http://127.0.0.1:3/",
            "none",
            "--decode",
            "http://127.0.0.1:4",
            "--decode",
            "http://127.0.0.1:5",
            "--prefill-policy",
            "bucket",
            "--policy",
            "round_robin",
        ])
        .unwrap();
        assert!(c.pd_disaggregation);
        assert_eq!(
            c.prefill_workers().unwrap(),
            vec![
                ("http://127.0.0.1:1".to_string(), Some(8998)),
                ("http://127.0.0.1:2".to_string(), None),
                ("http://127.0.0.1:3".to_string(), None),
            ]
        );
        assert_eq!(c.decode.len(), 2);
        assert_eq!(c.prefill_policy_kind(), PolicyKind::Bucket);
        assert_eq!(
            c.decode_policy_kind(),
            PolicyKind::RoundRobin,
            "falls back to --policy"
        );
        assert_eq!(c.policy_config().kind, PolicyKind::Bucket);
        let plain = parse(&["--pd-disaggregation", "--decode", "http://127.0.0.1:4"]).unwrap();
        assert_eq!(plain.prefill_policy_kind(), PolicyKind::CacheAware);
        assert_eq!(plain.decode_policy_kind(), PolicyKind::CacheAware);
        // Refused: PD flags without PD mode, bad ports, a bucket decode side, bad URLs.
        for bad in [
            &["--prefill", "http://127.0.0.1:1"][..],
            &[
                "--pd-disaggregation",
                "--prefill",
                "http://127.0.0.1:1",
                "x",
            ],
            &["--pd-disaggregation", "--prefill", "8998"],
            &["--pd-disaggregation", "--prefill", "http://a", "1"],
            &["--pd-disaggregation", "--decode", "ftp://a:1"],
            &["--pd-disaggregation", "--decode-policy", "bucket"],
            &["--pd-disaggregation", "--policy", "bucket"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn pd_workers_come_from_the_config_file() {
        let args = toml_to_args(
            "pd-disaggregation = true\nprefill = [[\"http://127.0.0.1:1\", 8998], [\"http://127.0.0.1:2\"]]\n\
             decode = [\"http://127.0.0.1:3\"]\n",
        )
        .unwrap();
        let mut argv = vec!["radixgate".to_string()];
        argv.extend(args);
        let c = Config::try_from_args(&argv).unwrap();
        assert_eq!(
            c.prefill_workers().unwrap(),
            vec![
                ("http://127.0.0.1:1".to_string(), Some(8998)),
                ("http://127.0.0.1:2".to_string(), None),
            ]
        );
        assert_eq!(c.decode, vec!["http://127.0.0.1:3".to_string()]);
    }

    #[test]
    fn config_file_is_overridden_by_flags() {
        let dir = std::env::temp_dir().join(format!("radixgate-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("gw.toml");
        std::fs::write(
            &path,
            "port = 31000\ncache_threshold = 0.5\nworker-urls = [\"http://127.0.0.1:1\"]\n\
             affinity-window = true\npolicy = \"round_robin\"\n",
        )
        .unwrap();
        let p = path.to_str().unwrap();
        let c = parse(&["--config", p, "--port", "32000"]).unwrap();
        assert_eq!(c.port, 32000);
        assert_eq!(c.cache_threshold, 0.5);
        assert_eq!(c.worker_urls, vec!["http://127.0.0.1:1".to_string()]);
        assert!(c.affinity_window);
        assert_eq!(c.policy, PolicyKind::RoundRobin);
        std::fs::write(&path, "no_such_key = 1\n").unwrap();
        assert!(parse(&["--config", p]).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn kv_event_flags_parse_pair_and_refuse() {
        let c = parse(&[]).unwrap();
        assert!(!c.kv_events);
        assert!(c.kv_endpoints().unwrap().is_empty());
        let c = parse(&[
            "--kv-events",
            "--kv-events-endpoints",
            "http://10.0.0.1:30000=tcp://*:5557",
            "http://10.0.0.2:30000/=tcp://10.0.0.2:6000",
            "--kv-events-replay-endpoints",
            "http://10.0.0.1:30000=tcp://10.0.0.1:5558",
        ])
        .unwrap();
        assert!(c.kv_events);
        let eps = c.kv_endpoints().unwrap();
        assert_eq!(eps.len(), 2);
        assert_eq!(eps[0].worker_url, "http://10.0.0.1:30000");
        assert_eq!(eps[0].live.url(), "tcp://10.0.0.1:5557");
        assert_eq!(eps[0].replay.as_ref().unwrap().url(), "tcp://10.0.0.1:5558");
        assert_eq!(eps[1].worker_url, "http://10.0.0.2:30000");
        assert_eq!(eps[1].replay, None);
        let (live, replay) = eps[0].for_rank(2).unwrap();
        assert_eq!((live.port, replay.unwrap().port), (5559, 5560));

        for bad in [
            // endpoints without the switch
            &["--kv-events-endpoints", "http://a:1=tcp://a:5557"][..],
            &["--kv-events", "--kv-events-endpoints", "http://a:1"],
            &[
                "--kv-events",
                "--kv-events-endpoints",
                "ftp://a:1=tcp://a:5557",
            ],
            &[
                "--kv-events",
                "--kv-events-endpoints",
                "http://a:1=udp://a:5557",
            ],
            &[
                "--kv-events",
                "--kv-events-endpoints",
                "http://a:1=tcp://a:0",
            ],
            // a replay endpoint for a worker with no live endpoint
            &[
                "--kv-events",
                "--kv-events-replay-endpoints",
                "http://a:1=tcp://a:5558",
            ],
            // a worker named twice
            &[
                "--kv-events",
                "--kv-events-endpoints",
                "http://a:1=tcp://a:5557",
                "http://a:1=tcp://a:6557",
            ],
            // a bootstrap peer without the admin key its snapshot needs
            &["--kv-events", "--kv-bootstrap-peer", "http://a:1"],
        ] {
            match parse(bad) {
                Err(ConfigError::Clap(e)) => assert_eq!(e.exit_code(), 2, "{bad:?}"),
                other => panic!("{bad:?} accepted: {other:?}"),
            }
        }
    }

    #[test]
    fn service_discovery_flags_mirror_the_reference() {
        let c = parse(&[]).unwrap();
        assert!(!c.service_discovery);
        assert_eq!(c.service_discovery_port, 80, "the reference's CLI default");
        assert_eq!(c.bootstrap_port_annotation, "sglang.ai/bootstrap-port");
        assert!(c.selector.is_empty() && c.service_discovery_namespace.is_none());
        assert!(
            !c.service_discovery_all_namespaces,
            "one namespace unless asked"
        );
        assert_eq!(c.service_discovery_max_ports_per_pod, 8);
        assert_eq!(c.service_discovery_max_workers, 1024);
        assert_eq!(c.service_discovery_concurrency, 8);
        let all = parse(&["--service-discovery-all-namespaces"]).unwrap();
        assert!(all.service_discovery_all_namespaces);
        for bad in [
            &[
                "--service-discovery-all-namespaces",
                "--service-discovery-namespace",
                "ml",
            ][..],
            &["--service-discovery-max-ports-per-pod", "0"],
            &["--service-discovery-max-workers", "16384"],
            &["--service-discovery-concurrency", "0"],
        ] {
            match parse(bad) {
                Err(ConfigError::Clap(e)) => assert_eq!(e.exit_code(), 2, "{bad:?}"),
                other => panic!("{bad:?} accepted: {other:?}"),
            }
        }
        let c = parse(&[
            "--service-discovery",
            "--selector",
            "app=sglang",
            "tier=a=b",
            "--service-discovery-port",
            "30000",
            "--service-discovery-namespace",
            "ml",
            "--pd-disaggregation",
            "--prefill-selector",
            "role=prefill",
            "--decode-selector",
            "role=decode",
            "--bootstrap-port-annotation",
            "x/boot",
            "--kubeconfig",
            "/tmp/kc",
        ])
        .unwrap();
        assert!(c.service_discovery);
        assert_eq!(c.selector, vec!["app=sglang", "tier=a=b"]);
        assert_eq!(c.service_discovery_port, 30000);
        assert_eq!(c.service_discovery_namespace.as_deref(), Some("ml"));
        assert_eq!(c.prefill_selector, vec!["role=prefill"]);
        assert_eq!(c.decode_selector, vec!["role=decode"]);
        assert_eq!(c.bootstrap_port_annotation, "x/boot");
        for bad in [&["--selector", "app"][..], &["--selector", "=x"]] {
            match parse(bad) {
                Err(ConfigError::Clap(e)) => assert_eq!(e.exit_code(), 2, "{bad:?}"),
                other => panic!("{bad:?} accepted: {other:?}"),
            }
        }
        // The config file takes a label table or a list.
        for text in [
            "service-discovery = true\nselector = { app = \"sglang\", tier = \"gpu\" }\n",
            "service-discovery = true\nselector = [\"app=sglang\", \"tier=gpu\"]\n",
        ] {
            let mut argv = vec!["radixgate".to_string()];
            argv.extend(toml_to_args(text).unwrap());
            let c = Config::try_from_args(&argv).unwrap();
            assert!(c.service_discovery);
            assert_eq!(c.selector, vec!["app=sglang", "tier=gpu"], "{text}");
        }
    }

    #[test]
    fn cpu_list_parses_ranges() {
        assert_eq!(parse_cpu_list("0-2,5,1").unwrap().0, vec![0, 1, 2, 5]);
        let c = parse(&["--cpu-list", "0,1"]).unwrap();
        assert_eq!(c.cpu_list, Some(CpuList(vec![0, 1])));
        assert!(parse_cpu_list("3-1").is_err());
    }
}
