//! The settings each part of the gateway reads, built once from [`Config`] at start-up. A module
//! is handed its own group, not the whole command line, so what it depends on shows in its
//! types and a flag's meaning at run time (seconds made `Duration`s, `--disable-*` made
//! `enabled`, a floor applied) is decided here, once, instead of at every reader. `Config` stays
//! the parser: flags, defaults and TOML keys do not change with these groups.

use super::Config;
use crate::route::types::PolicyConfig;
use std::time::Duration;

/// The groups read after start-up through the shared gateway state (`Gateway::settings`): one
/// field per reader, so a module's reads stay inside its own group.
#[derive(Debug, Clone)]
pub struct Settings {
    /// For `serve::conn` (and the metrics listener's head deadline).
    pub client: ClientSettings,
    /// For `serve::exchange` and its phases.
    pub exchange: ExchangeSettings,
    /// For every upstream pool the gateway opens (`gateway::upstream_pool`).
    pub upstream: UpstreamSettings,
    /// For a serving core's own loop (`gateway::Core`, `runtime`'s accept loop).
    pub cores: CoreSettings,
    /// For the health thread and a worker's admission (`gateway::membership`).
    pub health: HealthSettings,
    /// For the routers, built from it at start-up (`gateway::Router`).
    pub routing: RoutingSettings,
    /// `--dp-aware`: `gateway::membership` asks a worker added at run time for its DP ranks.
    pub dp_aware: bool,
    /// The effective configuration `/get_server_info` shows (secrets redacted), built once: the
    /// admin endpoint answers it without reading the flags.
    pub shown: serde_json::Value,
}

impl Settings {
    /// Every group of `cfg`; `io_driver` and `cores` are what start-up chose (the page shows
    /// them beside the flags).
    pub fn new(cfg: &Config, io_driver: &str, cores: usize) -> Settings {
        Settings {
            client: ClientSettings::from(cfg),
            exchange: ExchangeSettings::from(cfg),
            upstream: UpstreamSettings::from(cfg),
            cores: CoreSettings::from(cfg),
            health: HealthSettings::from(cfg),
            routing: RoutingSettings::from(cfg),
            dp_aware: cfg.dp_aware,
            shown: shown(cfg, io_driver, cores),
        }
    }
}

/// A client connection's limits, read by `serve::conn` on every connection and request head:
/// the deadlines that keep a slow or idle client from holding a core's connection slot.
#[derive(Debug, Clone)]
pub struct ClientSettings {
    /// `--header-timeout-secs`: a whole request head must arrive within it (the metrics
    /// listener uses it too, at least 1 s).
    pub header_timeout: Duration,
    /// `--keepalive-timeout-secs`: how long an idle keep-alive connection is kept.
    pub keepalive_timeout: Duration,
    /// `--min-body-bytes-per-second`: the slowest body accepted after the head's grace (0: none).
    pub min_body_rate: u64,
    /// `--request-timeout-secs`: the body's deadline never runs past the request's.
    pub request_timeout: Duration,
    /// `--max-payload-size`: the largest body a route accepts (bytes).
    pub max_payload_size: u64,
}

impl From<&Config> for ClientSettings {
    fn from(cfg: &Config) -> ClientSettings {
        ClientSettings {
            header_timeout: Duration::from_secs(cfg.header_timeout_secs),
            keepalive_timeout: Duration::from_secs(cfg.keepalive_timeout_secs),
            min_body_rate: cfg.min_body_bytes_per_second,
            request_timeout: cfg.request_timeout(),
            max_payload_size: cfg.max_payload_size,
        }
    }
}

/// One proxied request's settings, read by `serve::exchange` as it admits, attempts and
/// commits a request.
#[derive(Debug, Clone)]
pub struct ExchangeSettings {
    /// `--request-timeout-secs`: the whole request's deadline, retries included.
    pub request_timeout: Duration,
    /// `--connect-timeout-secs`: how long connecting to a worker may take.
    pub connect_timeout: Duration,
    /// `--request-id-headers`: where a caller's own request id is looked for, in order.
    pub request_id_headers: Vec<String>,
    /// `--insert-response-text`: the reply is learned too, so a conversation's next turn matches
    /// its whole history.
    pub insert_response_text: bool,
}

impl From<&Config> for ExchangeSettings {
    fn from(cfg: &Config) -> ExchangeSettings {
        ExchangeSettings {
            request_timeout: cfg.request_timeout(),
            connect_timeout: Duration::from_secs(cfg.connect_timeout_secs),
            request_id_headers: cfg.request_id_headers.clone(),
            insert_response_text: cfg.insert_response_text,
        }
    }
}

/// How the gateway's own upstream pools behave (a core's, the health and telemetry threads',
/// discovery's, the `--dp-aware` start-up probe's): one place, so every caller of the workers
/// carries the same key and idle timeout.
#[derive(Debug, Clone)]
pub struct UpstreamSettings {
    /// `--upstream-idle-timeout-ms`: an idle pooled connection is dropped before the engine's
    /// own keep-alive closes it.
    pub idle_timeout: Duration,
    /// `--worker-api-key`: what the gateway's own calls to the workers carry.
    pub worker_api_key: Option<String>,
}

impl From<&Config> for UpstreamSettings {
    fn from(cfg: &Config) -> UpstreamSettings {
        UpstreamSettings {
            idle_timeout: Duration::from_millis(cfg.upstream_idle_timeout_ms),
            worker_api_key: cfg.worker_api_key.clone(),
        }
    }
}

/// A serving core's own loop: read when a core starts (`gateway::Core::new` and the accept loop
/// in `runtime`).
#[derive(Debug, Clone)]
pub struct CoreSettings {
    /// `--busy-poll-us`: how long a core keeps polling after a request event.
    pub busy_poll: Duration,
    /// `--max-connections-per-core`: client connections one core keeps open (0: no cap).
    pub max_connections: usize,
}

impl From<&Config> for CoreSettings {
    fn from(cfg: &Config) -> CoreSettings {
        CoreSettings {
            busy_poll: Duration::from_micros(cfg.busy_poll_us),
            max_connections: cfg.max_connections_per_core,
        }
    }
}

/// How a worker's health is judged: read by the health thread (`gateway::threads::health`), by
/// `gateway::membership` (a new worker's first probe, passive health) and at start by
/// `gateway::dp` (the start-up polls' pace).
#[derive(Debug, Clone)]
pub struct HealthSettings {
    /// Not `--disable-health-check`: checks run, and a refused connection takes a worker out.
    pub enabled: bool,
    /// `--health-check-interval-secs`, at least 1 s.
    pub interval: Duration,
    /// `--health-check-timeout-secs` as given (the health thread makes it at least 1 s; a new
    /// worker's probe takes it as is).
    pub timeout: Duration,
    /// `--health-check-endpoint`: the path probed.
    pub endpoint: String,
    /// `--health-failure-threshold`: failed checks in a row that make a worker unhealthy.
    pub failure_threshold: u32,
    /// `--health-success-threshold`: good checks in a row that make it healthy again.
    pub success_threshold: u32,
    /// `--worker-startup-check-interval`, at least 1 s: the longest pause between a starting
    /// worker's polls.
    pub startup_cap: Duration,
    /// `--worker-startup-timeout-secs`: how long a worker may take to answer a first time.
    pub startup_timeout: Duration,
}

impl From<&Config> for HealthSettings {
    fn from(cfg: &Config) -> HealthSettings {
        HealthSettings {
            enabled: !cfg.disable_health_check,
            interval: Duration::from_secs(cfg.health_check_interval_secs.max(1)),
            timeout: Duration::from_secs(cfg.health_check_timeout_secs),
            endpoint: cfg.health_check_endpoint.clone(),
            failure_threshold: cfg.health_failure_threshold,
            success_threshold: cfg.health_success_threshold,
            startup_cap: Duration::from_secs(cfg.worker_startup_check_interval.max(1)),
            startup_timeout: Duration::from_secs(cfg.worker_startup_timeout_secs),
        }
    }
}

/// The routers' policies and prefix trees, read by `gateway::Router` when the gateway starts.
#[derive(Debug, Clone)]
pub struct RoutingSettings {
    /// The policy of the only router, or in PD mode of the prefill side.
    pub policy: PolicyConfig,
    /// PD mode (`--pd-disaggregation`): the decode side's policy; `None` outside PD mode.
    pub decode_policy: Option<PolicyConfig>,
    /// `--max-tree-size`: characters a tree keeps per worker.
    pub max_tree_chars: u64,
    /// `--eviction-interval`, at least 1 s: how often a tree evicts.
    pub eviction_interval: Duration,
}

impl From<&Config> for RoutingSettings {
    fn from(cfg: &Config) -> RoutingSettings {
        RoutingSettings {
            policy: cfg.policy_config(),
            decode_policy: cfg
                .pd_disaggregation
                .then(|| cfg.policy_config_for(cfg.decode_policy_kind())),
            max_tree_chars: cfg.max_tree_size,
            eviction_interval: Duration::from_secs(cfg.eviction_interval.max(1)),
        }
    }
}

/// Kubernetes service discovery's flags, handed by `runtime` to `discovery` alone: nothing else
/// reads them.
#[derive(Debug, Clone)]
pub struct DiscoverySettings {
    /// `--service-discovery`: whether the watch and reconcile threads start at all.
    pub enabled: bool,
    /// `--pd-disaggregation`: pods are prefill or decode workers, by their own selectors.
    pub pd: bool,
    /// `--selector`: the labels every watched pod has.
    pub selector: Vec<String>,
    /// `--prefill-selector`: PD mode's prefill pods.
    pub prefill_selector: Vec<String>,
    /// `--decode-selector`: PD mode's decode pods.
    pub decode_selector: Vec<String>,
    /// `--service-discovery-port`: the worker port of a pod without the ports annotation.
    pub port: u16,
    /// `--bootstrap-port-annotation`: where a prefill pod names its bootstrap port.
    pub bootstrap_annotation: String,
    /// `--service-discovery-max-ports-per-pod`.
    pub max_ports_per_pod: usize,
    /// `--kubeconfig`: the cluster, else the in-cluster or default one.
    pub kubeconfig: Option<std::path::PathBuf>,
    /// `--service-discovery-namespace`.
    pub namespace: Option<String>,
    /// `--service-discovery-all-namespaces`.
    pub all_namespaces: bool,
    /// `--service-discovery-max-workers`: workers discovery adds in all.
    pub max_workers: usize,
    /// `--service-discovery-concurrency`: additions probed at once.
    pub concurrency: usize,
}

impl From<&Config> for DiscoverySettings {
    fn from(cfg: &Config) -> DiscoverySettings {
        DiscoverySettings {
            enabled: cfg.service_discovery,
            pd: cfg.pd_disaggregation,
            selector: cfg.selector.clone(),
            prefill_selector: cfg.prefill_selector.clone(),
            decode_selector: cfg.decode_selector.clone(),
            port: cfg.service_discovery_port,
            bootstrap_annotation: cfg.bootstrap_port_annotation.clone(),
            max_ports_per_pod: cfg.service_discovery_max_ports_per_pod as usize,
            kubeconfig: cfg.kubeconfig.clone(),
            namespace: cfg.service_discovery_namespace.clone(),
            all_namespaces: cfg.service_discovery_all_namespaces,
            max_workers: cfg.service_discovery_max_workers as usize,
            concurrency: cfg.service_discovery_concurrency as usize,
        }
    }
}

/// `--kv-bootstrap-peer`: the sibling whose KV index is copied before subscribing, handed by
/// `runtime` to `gateway::kv_routing`'s bootstrap thread alone.
#[derive(Debug, Clone)]
pub struct KvBootstrapSettings {
    /// The sibling gateway's base URL.
    pub peer: String,
    /// `--admin-api-key`: the copy is an admin call on the sibling (siblings share their keys).
    pub admin_api_key: Option<String>,
}

impl KvBootstrapSettings {
    /// `None` without `--kv-bootstrap-peer`.
    pub fn from_config(cfg: &Config) -> Option<KvBootstrapSettings> {
        cfg.kv_bootstrap_peer
            .clone()
            .map(|peer| KvBootstrapSettings {
                peer,
                admin_api_key: cfg.admin_api_key.clone(),
            })
    }
}

/// The effective configuration, secrets redacted.
fn shown(c: &Config, io_driver: &str, cores: usize) -> serde_json::Value {
    serde_json::json!({
        "host": c.host, "port": c.port, "worker_urls": c.worker_urls,
        "policy": c.policy.as_str(), "dp_aware": c.dp_aware,
        "cache_threshold": c.cache_threshold,
        "balance_abs_threshold": c.balance_abs_threshold,
        "balance_rel_threshold": c.balance_rel_threshold,
        "eviction_interval": c.eviction_interval, "max_tree_size": c.max_tree_size,
        "insert_response_text": c.insert_response_text, "affinity_window": c.affinity_window,
        "assignment_mode": c.assignment_mode.as_str(), "max_idle_secs": c.max_idle_secs,
        "prefix_hash_chars": c.prefix_hash_chars,
        "bucket_adjust_interval_secs": c.bucket_adjust_interval_secs,
        "request_timeout_secs": c.request_timeout_secs, "max_payload_size": c.max_payload_size,
        "request_id_headers": c.request_id_headers,
        "prometheus_port": c.prometheus_port, "prometheus_host": c.prometheus_host,
        "health_check_interval_secs": c.health_check_interval_secs,
        "health_check_endpoint": c.health_check_endpoint,
        "worker_metrics_interval_secs": c.worker_metrics_interval_secs,
        "disable_health_check": c.disable_health_check,
        "api_key": c.api_key.as_ref().map(|_| "<redacted>"),
        "io_driver": io_driver, "cores": cores,
        "busy_poll_us": c.busy_poll_us,
    })
}
