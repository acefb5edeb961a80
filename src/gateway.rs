//! State shared by every core (`Gateway`, behind an `Arc`) and state owned by one core (`Core`,
//! behind an `Rc`: its connection pool and random source never cross threads).

use crate::admission::Admission;
use crate::config::Config;
use crate::http::RequestHead;
use crate::metrics::Metrics;
use crate::proxy::pool::Pool;
use crate::proxy::retry::RetryPolicy;
use crate::route::policy::Policy;
use crate::route::recent::RecentInserts;
use crate::route::rng::Rng;
use crate::tree::{TreeHandle, WorkerId};
use crate::workers::breaker::{BreakerConfig, Transition};
use crate::workers::registry::{Registry, RegistryError, Worker};
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Everything the cores share. Read-mostly; mutation goes through atomics, `ArcSwap`s and
/// channels, never a lock on the request path.
pub struct Gateway {
    pub cfg: Config,
    pub registry: Registry,
    pub policy: Policy,
    /// The prefix trees and their writer (cache_aware only).
    pub tree: Option<TreeHandle>,
    pub metrics: Metrics,
    pub started: Instant,
    /// Set by SIGTERM/SIGINT (or a test): stop accepting, finish in-flight requests.
    pub shutting_down: AtomicBool,
    /// Requests currently being handled by any core (for graceful shutdown).
    pub active_requests: AtomicU64,
    /// Name of the io driver the cores run on ("io_uring" or "epoll").
    pub io_driver: &'static str,
    /// Number of serving cores.
    pub cores: usize,
    /// Concurrency limit and queue (off by default).
    pub admission: Admission,
    /// Circuit breaker settings.
    pub breaker: BreakerConfig,
    /// Retry settings.
    pub retry: RetryPolicy,
    /// Tree inserts not yet visible in the published snapshot, shared by the cores.
    pub recent: RecentInserts,
    /// Model names the workers serve (from their `/v1/models`): the only values the `model`
    /// metric label takes, so clients cannot mint series with made-up names.
    /// Names are leaked once (at most `MAX_KNOWN_MODELS`) so the hot path labels with a
    /// `&'static str` and allocates nothing.
    pub known_models: arc_swap::ArcSwap<Vec<&'static str>>,
}

impl Gateway {
    /// Milliseconds since start: the clock of tree inserts and policy expiry.
    pub fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }
    /// Whether shutdown has begun.
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Relaxed)
    }

    /// Passive health: a worker that refused a connection leaves selection at once; the health
    /// checker re-admits it after `--health-success-threshold` good checks (probed quickly).
    pub fn on_connect_failure(&self, worker: &Worker) {
        // Unpublished inserts must not lead the next requests back to it.
        self.recent.forget_worker(worker.id);
        if self.cfg.disable_health_check {
            return;
        }
        if self.registry.set_healthy(worker, false) {
            crate::log!(
                Warn,
                "worker {} refused a connection: out of selection until healthy",
                worker.url
            );
            self.membership_changed();
        }
    }

    /// The `model` label for a request's model: a name some worker serves, else "other".
    pub fn model_label(&self, model: Option<&str>) -> &'static str {
        match model {
            None => "default",
            Some(m) => self
                .known_models
                .load()
                .iter()
                .copied()
                .find(|k| *k == m)
                .unwrap_or("other"),
        }
    }

    /// Learn model names from a worker's `/v1/models` body (health thread).
    pub fn learn_models(&self, body: &[u8]) {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) else {
            return;
        };
        let ids: Vec<&str> = v
            .get("data")
            .and_then(|d| d.as_array())
            .map(|a| a.iter().filter_map(|c| c.get("id")?.as_str()).collect())
            .unwrap_or_default();
        let cur = self.known_models.load();
        if ids.iter().all(|id| cur.contains(id)) {
            return;
        }
        let mut next: Vec<&'static str> = cur.as_ref().clone();
        for id in ids {
            if !next.contains(&id) && next.len() < MAX_KNOWN_MODELS {
                // Bounded by MAX_KNOWN_MODELS over the process lifetime: leaking is the point.
                next.push(Box::leak(id.to_string().into_boxed_str()));
            }
        }
        self.known_models.store(Arc::new(next));
    }

    /// Epoch of the currently published tree snapshot (0 without a tree).
    pub fn recent_epoch(&self) -> u64 {
        self.tree.as_ref().map_or(0, |t| t.load().epoch())
    }

    /// Tell the policy the worker set or eligibility changed (rings keyed by URL).
    pub fn membership_changed(&self) {
        let list = self.registry.load();
        let named: Vec<(WorkerId, &[u8])> = list
            .workers
            .iter()
            .map(|w| (w.id, w.url.as_bytes()))
            .collect();
        self.policy.workers_changed_named(&named);
    }

    /// Circuit state of a worker, for the management API.
    pub fn breaker_state_name(&self, worker: &Worker) -> &'static str {
        worker.breaker.state().as_str()
    }

    /// Record a request outcome on a worker's breaker; on a transition, update eligibility.
    pub fn record_outcome(&self, worker: &Worker, success: bool) {
        let t = worker.breaker.record(&self.breaker, success, self.now_ms());
        self.after_breaker(worker, t);
    }

    /// Apply a breaker transition (logs, metrics, eligibility).
    pub fn after_breaker(&self, worker: &Worker, t: Transition) {
        if t == Transition::None {
            return;
        }
        crate::log!(
            Warn,
            "worker {}: circuit {}",
            worker.url,
            worker.breaker.state().as_str()
        );
        metrics::counter!("smg_worker_cb_transitions_total", "to" => worker.breaker.state().as_str()).increment(1);
        self.registry.refresh_eligibility(worker);
        self.membership_changed();
    }

    /// Check `Authorization: Bearer <key>`: inference endpoints need `--api-key`, admin
    /// endpoints `--admin-api-key` (or `--api-key` when no admin key is set). Constant time.
    pub fn authorize(&self, head: &RequestHead, admin: bool) -> Result<(), &'static str> {
        let expected = if admin {
            self.cfg
                .admin_api_key
                .as_deref()
                .or(self.cfg.api_key.as_deref())
        } else {
            self.cfg.api_key.as_deref()
        };
        let Some(expected) = expected else {
            return Ok(());
        };
        let given = head.header("authorization").and_then(|v| {
            let v = v
                .strip_prefix(b"Bearer ")
                .or_else(|| v.strip_prefix(b"bearer "))?;
            Some(v)
        });
        match given {
            Some(g) if constant_time_eq(g, expected.as_bytes()) => Ok(()),
            Some(_) => Err("invalid API key"),
            None => Err("missing `Authorization: Bearer <key>` header"),
        }
    }

    /// The effective configuration, for `/get_server_info` (secrets redacted).
    pub fn config_json(&self) -> serde_json::Value {
        let c = &self.cfg;
        serde_json::json!({
            "host": c.host, "port": c.port, "worker_urls": c.worker_urls,
            "policy": c.policy.as_str(), "cache_threshold": c.cache_threshold,
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
            "disable_health_check": c.disable_health_check,
            "api_key": c.api_key.as_ref().map(|_| "<redacted>"),
            "io_driver": self.io_driver, "cores": self.cores,
        })
    }

    /// Register a worker at run time: probe its health endpoint once (so it is routable at once
    /// when up), then make it selectable.
    pub async fn add_worker(&self, core: &Core, url: &str) -> Result<Arc<Worker>, RegistryError> {
        let worker = self.registry.add(url, false)?;
        let healthy = if self.cfg.disable_health_check {
            true
        } else {
            let timeout = std::time::Duration::from_secs(self.cfg.health_check_timeout_secs);
            matches!(
                crate::proxy::forward::fetch(
                    core,
                    &worker,
                    "GET",
                    &self.cfg.health_check_endpoint,
                    bytes::Bytes::new(),
                    timeout
                )
                .await,
                Ok((200..=299, _))
            )
        };
        self.registry.set_healthy(&worker, healthy);
        self.membership_changed();
        crate::log!(
            Info,
            "worker {} added (id {}, healthy: {healthy})",
            worker.url,
            worker.id
        );
        Ok(worker)
    }

    /// Remove a worker: out of selection now, in-flight requests finish, and its tree entries go
    /// (on a helper thread, so no core waits on the writer's channel).
    pub fn remove_worker(&self, url_or_id: &str) -> Result<Arc<Worker>, RegistryError> {
        let worker = self.registry.remove(url_or_id)?;
        self.recent.forget_worker(worker.id);
        self.membership_changed();
        if let Some(tree) = self.tree.clone() {
            let id = worker.id;
            let _ = std::thread::Builder::new()
                .name("radixgate-remove".into())
                .spawn(move || tree.remove_worker(id));
        }
        crate::log!(Info, "worker {} removed (id {})", worker.url, worker.id);
        Ok(worker)
    }
}

/// Most distinct model names ever used as metric labels.
pub const MAX_KNOWN_MODELS: usize = 256;

/// Compare two secrets in time independent of where they differ (the length is not secret).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// One core's private state.
pub struct Core {
    pub gw: Arc<Gateway>,
    pub index: usize,
    pub pool: Pool,
    pub rng: RefCell<Rng>,
}

impl Core {
    /// A core bound to the shared gateway.
    pub fn new(gw: Arc<Gateway>, index: usize) -> Core {
        let idle = std::time::Duration::from_millis(gw.cfg.upstream_idle_timeout_ms);
        Core {
            gw,
            index,
            pool: Pool::new(idle, 64),
            rng: RefCell::new(Rng::from_entropy()),
        }
    }
}
