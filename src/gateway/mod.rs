//! State shared by every core (`Gateway`, behind an `Arc`) and state owned by one core (`Core`,
//! behind an `Rc`: its connection pool and random source never cross threads).
//!
//! `Gateway` is split by concern so a reader finds each thing in one place: the workers
//! (`registry`, `models`), the routing state (`router`), the gate in front of them (`auth`,
//! `admission`), the process's life (`life`), what the engines report (`telemetry`), and the
//! settings derived from the flags (`settings`: each module reads its own group). The
//! operations that touch several of them at once (a worker leaving, a circuit opening) live in
//! `membership`.
//! `busy_poll` keeps a core polling for a short window after each request event.
//!
//! Modules: `core` (one core's own state), `auth`, `models`, `router`, `membership`,
//! `lifecycle` (the clock, shutdown and in-flight count), `requests` (in-flight ids → workers,
//! for aborts), `limit` (bounded fan-outs), `kv_routing` (the gateway's side of routing by KV
//! events: the shared state the cores read, fed by the `kv` subsystem), `tokenizing` (where and
//! how long a prompt is tokenized), `dp` (`--dp-aware`: each server's DP ranks), `busy_poll`,
//! and apart from the shared state, `threads` (the helper threads: health checks, telemetry).

mod auth;
pub mod busy_poll;
mod core;
pub mod dp;
pub mod kv_routing;
mod lifecycle;
pub mod limit;
mod membership;
pub use self::membership::NotAdded;
mod models;
pub mod requests;
mod router;
pub mod threads;
pub mod tokenizing;

pub use self::auth::{constant_time_eq, Auth, Scope};
pub use self::core::{upstream_pool, Core};
pub use self::lifecycle::{Driver, Lifecycle};
pub use self::models::{ServedModels, MAX_KNOWN_MODELS};
pub use self::router::Router;
pub use self::threads::telemetry::Telemetry;
pub use self::threads::{spawn_helper, HelperClass, HELPER_NICE};

use crate::admission::{Admission, FlowControl};
use crate::config::settings::Settings;
use crate::config::Config;
use crate::proxy::retry::RetryPolicy;
use crate::workers::breaker::BreakerConfig;
use crate::workers::registry::Registry;
use std::time::Duration;

/// Everything the cores share. Read-mostly; mutation goes through atomics, `ArcSwap`s and
/// channels, never a lock on the request path.
pub struct Gateway {
    /// The settings each module reads after start-up, by reader (the flags themselves stay
    /// with start-up: a module sees its own group only).
    pub settings: Settings,
    /// The workers, their loads, health and circuits.
    pub registry: Registry,
    /// Model names the workers serve (the only values of the `model` metric label).
    pub models: ServedModels,
    /// The policy and the prefix trees it reads (in PD mode: the prefill side's, where the
    /// prompt's cache lives).
    pub router: Router,
    /// PD mode (`--pd-disaggregation`): the decode side's policy and trees, apart from the
    /// prefill side's so each side balances its own workers.
    pub decode: Option<Router>,
    /// Who may call what (`--api-key`, `--admin-api-key`).
    pub auth: Auth,
    /// Concurrency limit and queue (off by default).
    pub admission: Admission,
    /// Admission by measured saturation (`--saturation-admission`), with priority classes and
    /// tenants; `None` when off.
    pub flow: Option<FlowControl>,
    /// Start time, shutdown flag, requests in flight, io driver.
    pub life: Lifecycle,
    /// Circuit breaker settings (from `--cb-*`).
    pub breaker: BreakerConfig,
    /// Retry settings (from `--retry-*`).
    pub retry: RetryPolicy,
    /// KV-event routing state (`--kv-events`), `None` when off or when it could not start.
    pub kv: Option<kv_routing::KvRouting>,
    /// What the engines report (load, hit ratio, expositions), from the telemetry thread.
    pub telemetry: Telemetry,
    /// Which worker holds each in-flight request (`POST /abort_request` goes there).
    pub in_flight_ids: requests::InFlightIds,
    /// `/v1/models` fan-outs in flight (each asks every worker).
    pub model_fanouts: limit::CallLimit,
    /// Pass-through calls in flight (`/health_generate` makes a worker generate).
    pub pass_through: limit::CallLimit,
    /// `--enable-trace`: the span queues and the OTLP export thread; `None` when off (a
    /// request then pays one branch for tracing).
    pub trace: Option<std::sync::Arc<crate::trace::Tracer>>,
    /// The client headers that stop at the gateway and the key the workers get instead
    /// (`--worker-api-key`, `--forward-client-authorization`).
    pub own_headers: crate::proxy::forward::OwnHeaders,
}

/// `/v1/models` fan-outs at once (a cached answer serves the rest; see `serve::admin`).
const MODEL_FANOUTS: usize = 4;
/// Pass-through calls at once (`/get_model_info`, `/health_generate`): public, and each makes a
/// worker work.
const PASS_THROUGH_CALLS: usize = 16;

impl Gateway {
    /// The routers and the role of the workers each one picks: the regular router alone, or in
    /// PD mode the prefill router (`router`) and the decode router.
    pub fn routers(&self) -> impl Iterator<Item = (&Router, crate::workers::role::Side)> {
        use crate::workers::role::Side;
        let first = if self.decode.is_some() {
            Side::Prefill
        } else {
            Side::Any
        };
        std::iter::once((&self.router, first))
            .chain(self.decode.as_ref().map(|d| (d, Side::Decode)))
    }

    /// The shared state for `cfg`, serving `registry`'s workers on `cores` cores with the io
    /// driver `io_driver`. Starts the tree writer when the policy needs one.
    pub fn new(cfg: &Config, registry: Registry, io_driver: Driver, cores: usize) -> Gateway {
        let settings = Settings::new(cfg, io_driver.as_str(), cores);
        let routing = &settings.routing;
        let router = Router::new(routing.policy.clone(), routing);
        let decode = (routing.decode_policy.clone()).map(|p| Router::new(p, routing));
        let admission = Admission::new(
            cfg.max_concurrent_requests,
            cfg.queue_size,
            Duration::from_secs(cfg.queue_timeout_secs),
            cfg.rate_limit_tokens_per_second,
        );
        let auth = Auth::new(
            cfg.api_key.clone(),
            cfg.admin_api_key.clone(),
            cfg.keyless_local_admin,
        )
        .with_tenant_keys(cfg.tenants.iter().flat_map(|(_, t)| t.keys.iter().cloned()));
        let own_headers = crate::proxy::forward::OwnHeaders::new(
            crate::admission::PRIORITY_HEADER,
            cfg.tenant_header.as_deref(),
            auth.authenticates_callers(),
            cfg.forward_client_authorization,
            cfg.worker_api_key.as_deref(),
        );
        let gw = Gateway {
            registry,
            models: ServedModels::default(),
            router,
            decode,
            auth,
            admission,
            life: Lifecycle::new(io_driver, cores),
            breaker: cfg.breaker_config(),
            retry: cfg.retry_policy(),
            kv: start_kv(cfg),
            telemetry: Telemetry::new(cfg.telemetry_interval()),
            flow: flow_control(cfg),
            in_flight_ids: requests::InFlightIds::new(requests::MAX_TRACKED),
            model_fanouts: limit::CallLimit::new(MODEL_FANOUTS),
            pass_through: limit::CallLimit::new(PASS_THROUGH_CALLS),
            trace: start_trace(cfg, cores),
            own_headers,
            settings,
        };
        gw.membership_changed();
        gw
    }
}

/// The tracer when `--enable-trace` is on. One that cannot start (no thread, a bad endpoint)
/// is logged and the gateway serves untraced: tracing must never keep it from serving.
fn start_trace(cfg: &Config, cores: usize) -> Option<std::sync::Arc<crate::trace::Tracer>> {
    if !cfg.enable_trace {
        return None;
    }
    let settings = crate::trace::Settings {
        endpoint: cfg.otlp_traces_endpoint.clone(),
        ratio: cfg.trace_sample_ratio,
        trust_caller_sampling: cfg.trace_trust_caller_sampling,
        buffer: cfg.trace_buffer_spans as usize,
        buffer_bytes: usize::try_from(cfg.trace_buffer_bytes).unwrap_or(usize::MAX),
        batch_bytes: usize::try_from(cfg.trace_export_batch_bytes).unwrap_or(usize::MAX),
        cores,
    };
    match crate::trace::Tracer::start(&settings) {
        Ok(t) => {
            crate::metrics::trace_enabled();
            Some(t)
        }
        Err(e) => {
            crate::log!(Error, "{e}; serving without tracing");
            None
        }
    }
}

/// The saturation admission when `--saturation-admission` is on (its settings, tenants included,
/// were checked when the configuration was parsed).
fn flow_control(cfg: &Config) -> Option<FlowControl> {
    use crate::admission::{flow, saturation, tenants::Tenants};
    if !cfg.saturation_admission {
        return None;
    }
    let tenants = match Tenants::new(&cfg.tenants) {
        Ok(t) => t,
        Err(e) => {
            crate::log!(
                Error,
                "--saturation-admission is off: the tenant table is refused: {e}"
            );
            return None;
        }
    };
    let config = flow::FlowConfig {
        queue_size: cfg.queue_size as usize,
        queue_timeout: Duration::from_secs(cfg.queue_timeout_secs),
        sheddable_wait: Duration::from_millis(cfg.sheddable_max_wait_ms),
    };
    let thresholds = saturation::Thresholds {
        queue_reqs: cfg.saturation_queue_reqs,
        kv_usage: cfg.saturation_kv_usage,
        headroom: cfg.saturation_headroom,
        chunk_tokens: cfg.saturation_chunk_tokens,
    };
    Some(FlowControl {
        flow: flow::Flow::new(config, tenants),
        saturation: saturation::Saturation::new(
            crate::workers::registry::MAX_WORKER_IDS,
            thresholds,
        ),
        tenant_header: cfg.tenant_header.clone(),
    })
}

/// The KV-event subsystem when `--kv-events` is on (the flags' endpoints were validated when the
/// configuration was parsed). A failure to start its thread is logged and leaves the text tree
/// in charge: the gateway serves either way.
fn start_kv(cfg: &Config) -> Option<kv_routing::KvRouting> {
    if !cfg.kv_events {
        return None;
    }
    let flagged = match cfg.kv_endpoints() {
        Ok(f) => f,
        Err(e) => {
            crate::log!(Error, "kv events off: {e}");
            return None;
        }
    };
    let tokenizer = match &cfg.tokenizer_path {
        None => None,
        Some(p) => match crate::tokenize::Tokenizer::from_path(p) {
            Ok(t) => Some(std::sync::Arc::new(t)),
            Err(e) => {
                // `runtime::start` refuses to go on without it.
                crate::log!(Error, "--tokenizer-path: {e}");
                None
            }
        },
    };
    match kv_routing::KvRouting::start(kv_routing::KvSettings {
        flagged,
        bootstrap: cfg.kv_bootstrap_peer.is_some(),
        tokenizer,
        warm_timeout: Duration::from_secs(cfg.kv_warm_timeout_secs),
        host_weight: cfg.kv_host_tier_weight,
        max_ranks: cfg.kv_max_dp_ranks,
        intake: crate::kv::intake::IntakeConfig {
            send_timeout: Duration::from_secs(cfg.kv_send_timeout_secs),
            readers: cfg.kv_event_threads as usize,
            queue_bytes: (cfg.kv_queue_mib as usize) << 20,
            apply: crate::kv::intake::ApplyConfig {
                max_staleness: Duration::from_millis(cfg.kv_max_staleness_ms),
                ..Default::default()
            },
            ..Default::default()
        },
    }) {
        Ok(k) => Some(k),
        Err(e) => {
            crate::log!(Error, "kv events off: cannot start the event thread: {e}");
            None
        }
    }
}
