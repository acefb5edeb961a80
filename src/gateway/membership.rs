//! Changes to which workers may be chosen: a worker refusing a connection, a circuit opening or
//! closing, a worker removed. Each touches the registry, the router and the metrics together,
//! so they live here, in one place, rather than at their callers. Adding a worker at run time
//! (`register_worker`) is here too: the admin API and Kubernetes discovery add workers through
//! the same path, so a discovered worker is resolved, DP-split and probed like an added one.

use super::Gateway;
use crate::http::Method;
use crate::proxy::forward;
use crate::proxy::pool::Pool;
use crate::workers::breaker::Transition;
use crate::workers::registry::{self, CircuitSlot, RegistryError, Worker, WorkerUrl};
use crate::workers::role::Role;
use bytes::Bytes;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Longest wait for a worker's host name to resolve.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the caller's runtime looks whether the resolver thread is done.
const RESOLVE_POLL: Duration = Duration::from_millis(2);

impl Gateway {
    /// Passive health: a worker that refused a connection leaves selection at once; the health
    /// checker re-admits it after `--health-success-threshold` good checks (probed quickly).
    pub fn on_connect_failure(&self, worker: &Worker) {
        for (r, _) in self.routers() {
            r.forget_unpublished(worker.id);
        }
        if !self.settings.health.enabled {
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

    /// Tell the policies the worker set or eligibility changed (rings keyed by URL); in PD
    /// mode each side hears of its own workers only.
    pub fn membership_changed(&self) {
        let list = self.registry.load();
        for (router, side) in self.routers() {
            let named: Vec<_> = list
                .workers
                .iter()
                .filter(|w| side.takes(w.role))
                .map(|w| (w.id, w.url.as_bytes()))
                .collect();
            router.policy.workers_changed_named(&named);
        }
    }

    /// Record a request's outcome on its worker's breaker (at most once per slot); on a
    /// transition, update eligibility.
    pub fn record_outcome(&self, slot: &mut CircuitSlot, success: bool) {
        let t = slot.record(&self.breaker, success, self.life.now_ms());
        self.after_breaker(slot.worker(), t);
    }

    /// Apply a breaker transition (logs, metrics, eligibility).
    pub fn after_breaker(&self, worker: &Worker, t: Transition) {
        if t == Transition::None {
            return;
        }
        let state = worker.breaker.state().as_str();
        crate::log!(Warn, "worker {}: circuit {state}", worker.url);
        crate::metrics::circuit_transition(state);
        self.registry.refresh_eligibility(worker);
        self.membership_changed();
    }

    /// Remove a worker (with `--dp-aware`: its server, every rank): out of selection now,
    /// in-flight requests finish, and its tree entries go.
    pub fn remove_worker(&self, url_or_id: &str) -> Result<Vec<Arc<Worker>>, RegistryError> {
        let removed = self.registry.remove(url_or_id)?;
        for worker in &removed {
            for (r, _) in self.routers() {
                r.forget_worker(worker.id);
            }
            self.forget_models(worker.id);
            crate::log!(Info, "worker {} removed (id {})", worker.url, worker.id);
        }
        self.membership_changed();
        Ok(removed)
    }

    /// Register a worker at run time (admin API): resolve its host off the caller's thread,
    /// with `--dp-aware` read its `dp_size` (one target per rank), probe its health endpoint
    /// once (so it is routable at once when up), then make it selectable. A worker that does
    /// not answer stays registered, out of selection, for the health checker to admit. `pool`
    /// is the caller's own (a serving core's, or a helper thread's). Returns the targets added
    /// (the ranks, or the worker).
    pub async fn register_worker(
        &self,
        pool: &Pool,
        url: &str,
        role: Role,
    ) -> Result<Vec<Arc<Worker>>, RegistryError> {
        let found = self.prepare(pool, url).await?;
        let added =
            self.registry
                .add_server(url, found.parsed, found.addrs, false, role, found.dp_size)?;
        let Some(worker) = added.first().cloned() else {
            return Err(RegistryError::Full);
        };
        let healthy = self.probe(pool, &worker).await;
        self.registry.set_healthy(&worker, healthy);
        self.announce(&added, healthy);
        Ok(added)
    }

    /// Register a worker only once it answers (Kubernetes discovery): as
    /// [`Gateway::register_worker`], but the health endpoint is probed *before* any worker id
    /// is taken, so servers that never answer cannot fill the worker table, and `fits` is
    /// asked with the number of targets (DP ranks) first, so the caller can hold its own cap.
    pub async fn register_probed(
        &self,
        pool: &Pool,
        url: &str,
        role: Role,
        fits: &dyn Fn(usize) -> bool,
    ) -> Result<Vec<Arc<Worker>>, NotAdded> {
        let found = self.prepare(pool, url).await.map_err(NotAdded::Registry)?;
        let targets = found.dp_size.map_or(1, |n| n as usize);
        if !fits(targets) {
            return Err(NotAdded::OverCap(targets));
        }
        let probe = Worker::detached(url, found.parsed.clone(), found.addrs.clone());
        if !self.probe(pool, &probe).await {
            return Err(NotAdded::NotAnswering);
        }
        let added = self
            .registry
            .add_server(url, found.parsed, found.addrs, true, role, found.dp_size)
            .map_err(NotAdded::Registry)?;
        self.announce(&added, true);
        Ok(added)
    }

    /// Parse and resolve `url`; with `--dp-aware`, read its `dp_size`.
    async fn prepare(&self, pool: &Pool, url: &str) -> Result<Found, RegistryError> {
        let parsed = registry::parse_worker_url(url).map_err(|e| RegistryError::BadUrl(e.0))?;
        let addrs = match registry::literal_addrs(&parsed) {
            Some(a) => a,
            None => resolve_off_core(&parsed).await?,
        };
        // Every role: in PD mode each side's ranks are targets of their own (the decode body also
        // names its prefill twin's rank).
        let dp_size = if self.settings.dp_aware {
            let probe = Worker::detached(url, parsed.clone(), addrs.clone());
            let n = crate::gateway::dp::fetch_dp_size(pool, &probe)
                .await
                .map_err(|e| RegistryError::BadUrl(format!("--dp-aware: worker {url}: {e}")))?;
            Some(n)
        } else {
            None
        };
        Ok(Found {
            parsed,
            addrs,
            dp_size,
        })
    }

    /// One health probe (true with `--disable-health-check`).
    async fn probe(&self, pool: &Pool, worker: &Worker) -> bool {
        let health = &self.settings.health;
        !health.enabled || {
            let timeout = health.timeout;
            let path = &health.endpoint;
            let probe = forward::fetch(pool, worker, Method::Get, path, Bytes::new(), timeout);
            matches!(probe.await, Ok((200..=299, _)))
        }
    }

    /// Tell the policies and the log about newly registered targets.
    fn announce(&self, added: &[Arc<Worker>], healthy: bool) {
        self.membership_changed();
        if let Some(worker) = added.first() {
            crate::log!(
                Info,
                "worker {} added (id {}, {}, {} target(s), healthy: {healthy})",
                worker.server_url,
                worker.id,
                worker.role.as_str(),
                added.len()
            );
        }
    }
}

/// A worker URL made ready for registration.
struct Found {
    parsed: WorkerUrl,
    addrs: Vec<SocketAddr>,
    dp_size: Option<u32>,
}

/// Why [`Gateway::register_probed`] registered nothing.
#[derive(Debug)]
pub enum NotAdded {
    /// The registry (or resolution, or `--dp-aware`'s `/get_server_info`) refused it.
    Registry(RegistryError),
    /// Its health endpoint did not answer 2xx in time: nothing was registered.
    NotAnswering,
    /// Its targets (this many) do not fit the caller's cap.
    OverCap(usize),
}

impl std::fmt::Display for NotAdded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotAdded::Registry(e) => e.fmt(f),
            NotAdded::NotAnswering => f.write_str("its health endpoint did not answer"),
            NotAdded::OverCap(n) => write!(f, "its {n} target(s) are over the cap"),
        }
    }
}

/// Resolve a host name on a helper thread: a slow resolver must never stall a serving core
/// (every connection on it would wait). The core polls for the answer until a deadline.
async fn resolve_off_core(u: &WorkerUrl) -> Result<Vec<SocketAddr>, RegistryError> {
    type Answer = Option<Result<Vec<SocketAddr>, RegistryError>>;
    let slot: Arc<Mutex<Answer>> = Arc::new(Mutex::new(None));
    let (u2, slot2) = (u.clone(), slot.clone());
    std::thread::Builder::new()
        .name("radixgate-resolve".into())
        .spawn(move || {
            let r = registry::resolve(&u2);
            *slot2.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
        })
        .map_err(|e| RegistryError::BadUrl(format!("cannot resolve {}: {e}", u.host)))?;
    let deadline = monoio::time::Instant::now() + RESOLVE_TIMEOUT;
    loop {
        if let Some(r) = slot.lock().unwrap_or_else(|p| p.into_inner()).take() {
            return r;
        }
        if monoio::time::Instant::now() >= deadline {
            return Err(RegistryError::BadUrl(format!(
                "cannot resolve {}: timed out",
                u.host
            )));
        }
        monoio::time::sleep(RESOLVE_POLL).await;
    }
}
