//! Who the workers are. The list is published through `ArcSwap` (cores read it per request
//! without locking); changes (startup, `/workers` admin calls, health) are rare and serialised
//! by a mutex on the admin path. Worker ids are never reused, so a stale id in a tree or a pool
//! can never point at a different worker.

use crate::base::WorkerId;
use crate::workers::breaker::Breaker;
use crate::workers::load::LoadBoard;
use arc_swap::ArcSwap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Most workers a gateway process will ever register (ids are never reused).
pub const MAX_WORKER_IDS: usize = 16_384;

/// A worker URL that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UrlError(pub String);

impl std::fmt::Display for UrlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The parts of a worker URL the proxy needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerUrl {
    /// `host:port` as written (the upstream `Host` header).
    pub authority: String,
    /// Host without brackets.
    pub host: String,
    pub port: u16,
}

/// Validate `http://host[:port][/]` (plain HTTP: the gateway talks to workers on a trusted
/// network; TLS to workers is not supported).
pub fn parse_worker_url(url: &str) -> Result<WorkerUrl, UrlError> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| UrlError(format!("worker URL `{url}` must start with http://")))?;
    let authority = rest.trim_end_matches('/');
    if authority.is_empty() || authority.contains('/') || authority.contains('@') {
        return Err(UrlError(format!(
            "worker URL `{url}` must be http://host:port without a path"
        )));
    }
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (h, after) = v6
            .split_once(']')
            .ok_or_else(|| UrlError(format!("worker URL `{url}`: unclosed [")))?;
        let port = match after.strip_prefix(':') {
            Some(p) => p
                .parse()
                .map_err(|_| UrlError(format!("worker URL `{url}`: bad port")))?,
            None if after.is_empty() => 80,
            None => return Err(UrlError(format!("worker URL `{url}`: bad authority"))),
        };
        (h.to_string(), port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (
                h.to_string(),
                p.parse()
                    .map_err(|_| UrlError(format!("worker URL `{url}`: bad port `{p}`")))?,
            ),
            None => (authority.to_string(), 80),
        }
    };
    if host.is_empty() {
        return Err(UrlError(format!("worker URL `{url}`: empty host")));
    }
    Ok(WorkerUrl {
        authority: authority.to_string(),
        host,
        port,
    })
}

/// One upstream server.
#[derive(Debug)]
pub struct Worker {
    pub id: WorkerId,
    /// Base URL as configured (no trailing slash).
    pub url: String,
    /// `host:port` for the upstream `Host` header.
    pub authority: String,
    /// Addresses resolved when the worker was added (tried in order).
    pub addrs: Vec<SocketAddr>,
    /// Last health verdict (active checks and passive connect failures).
    healthy: AtomicBool,
    /// Being removed: no new requests, in-flight ones finish.
    draining: AtomicBool,
    /// Requests that reached this worker and completed (any status).
    pub completed: AtomicU64,
    /// This worker's circuit breaker.
    pub breaker: Breaker,
}

impl Worker {
    /// Current health verdict.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }
    /// Whether the worker is being removed.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }
}

/// An immutable view of the workers, published to the cores.
#[derive(Debug, Default)]
pub struct WorkerList {
    /// Registration order.
    pub workers: Vec<Arc<Worker>>,
    /// The same order, ids only (what policies iterate).
    pub ids: Vec<WorkerId>,
    by_id: Vec<u32>,
}

impl WorkerList {
    fn build(workers: Vec<Arc<Worker>>) -> WorkerList {
        let ids: Vec<WorkerId> = workers.iter().map(|w| w.id).collect();
        let max = ids
            .iter()
            .copied()
            .max()
            .map(|m| m as usize + 1)
            .unwrap_or(0);
        let mut by_id = vec![u32::MAX; max];
        for (i, id) in ids.iter().enumerate() {
            by_id[*id as usize] = i as u32;
        }
        WorkerList {
            workers,
            ids,
            by_id,
        }
    }
    /// The worker with this id, if still registered.
    pub fn get(&self, id: WorkerId) -> Option<&Arc<Worker>> {
        let idx = *self.by_id.get(id as usize)?;
        self.workers.get(idx as usize)
    }
    /// Find by URL (admin path).
    pub fn by_url(&self, url: &str) -> Option<&Arc<Worker>> {
        let url = url.trim_end_matches('/');
        self.workers.iter().find(|w| w.url == url)
    }
    pub fn len(&self) -> usize {
        self.workers.len()
    }
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }
}

/// Why a worker could not be added or removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegistryError {
    BadUrl(String),
    Duplicate(String),
    NotFound(String),
    Full,
}

impl std::fmt::Display for RegistryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RegistryError::BadUrl(m) => f.write_str(m),
            RegistryError::Duplicate(u) => write!(f, "worker {u} is already registered"),
            RegistryError::NotFound(u) => write!(f, "worker {u} is not registered"),
            RegistryError::Full => {
                write!(f, "no worker ids left ({MAX_WORKER_IDS} ever registered)")
            }
        }
    }
}

/// The registry shared by every core.
pub struct Registry {
    list: ArcSwap<WorkerList>,
    /// In-flight counts and eligibility for every worker id.
    pub loads: LoadBoard,
    admin: Mutex<WorkerId>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Registry {
        Registry {
            list: ArcSwap::from_pointee(WorkerList::default()),
            loads: LoadBoard::new(MAX_WORKER_IDS),
            admin: Mutex::new(0),
        }
    }

    /// Current list; never hold the guard across an `.await`.
    pub fn load(&self) -> arc_swap::Guard<Arc<WorkerList>> {
        self.list.load()
    }

    /// Full `Arc` of the current list (for holding across awaits).
    pub fn load_full(&self) -> Arc<WorkerList> {
        self.list.load_full()
    }

    /// Register a worker (resolving its host now, on the caller's thread). It starts healthy
    /// unless `healthy` is false (then it waits for a health check).
    pub fn add(&self, url: &str, healthy: bool) -> Result<Arc<Worker>, RegistryError> {
        let parsed = parse_worker_url(url).map_err(|e| RegistryError::BadUrl(e.0))?;
        let url = url.trim_end_matches('/').to_string();
        let addrs: Vec<SocketAddr> = match (parsed.host.as_str(), parsed.port).to_socket_addrs() {
            Ok(a) => {
                let mut v: Vec<SocketAddr> = a.collect();
                v.sort_by_key(|a| !a.is_ipv4());
                v
            }
            Err(e) => return Err(RegistryError::BadUrl(format!("cannot resolve {url}: {e}"))),
        };
        if addrs.is_empty() {
            return Err(RegistryError::BadUrl(format!(
                "{url} resolves to no address"
            )));
        }
        let mut next = self.admin.lock().unwrap_or_else(|p| p.into_inner());
        let cur = self.list.load_full();
        if cur.by_url(&url).is_some() {
            return Err(RegistryError::Duplicate(url));
        }
        if *next as usize >= MAX_WORKER_IDS {
            return Err(RegistryError::Full);
        }
        let id = *next;
        *next += 1;
        let worker = Arc::new(Worker {
            id,
            url,
            authority: parsed.authority,
            addrs,
            healthy: AtomicBool::new(healthy),
            draining: AtomicBool::new(false),
            completed: AtomicU64::new(0),
            breaker: Breaker::default(),
        });
        let mut workers = cur.workers.clone();
        workers.push(worker.clone());
        self.list.store(Arc::new(WorkerList::build(workers)));
        self.refresh_eligibility(&worker);
        Ok(worker)
    }

    /// Take a worker out of selection at once and out of the list; in-flight requests keep
    /// their `Arc<Worker>` and finish. Returns the removed worker.
    pub fn remove(&self, url_or_id: &str) -> Result<Arc<Worker>, RegistryError> {
        let _guard = self.admin.lock().unwrap_or_else(|p| p.into_inner());
        let cur = self.list.load_full();
        let found = cur
            .by_url(url_or_id)
            .or_else(|| {
                url_or_id
                    .parse::<WorkerId>()
                    .ok()
                    .and_then(|id| cur.get(id))
            })
            .cloned()
            .ok_or_else(|| RegistryError::NotFound(url_or_id.to_string()))?;
        found.draining.store(true, Ordering::Relaxed);
        self.refresh_eligibility(&found);
        let workers: Vec<Arc<Worker>> = cur
            .workers
            .iter()
            .filter(|w| w.id != found.id)
            .cloned()
            .collect();
        self.list.store(Arc::new(WorkerList::build(workers)));
        Ok(found)
    }

    /// Record a health verdict and update eligibility. Returns true when it changed.
    pub fn set_healthy(&self, worker: &Worker, healthy: bool) -> bool {
        let was = worker.healthy.swap(healthy, Ordering::AcqRel);
        if was != healthy {
            self.refresh_eligibility(worker);
        }
        was != healthy
    }

    /// Selectable = healthy, not draining, circuit not open. Call after any of them changes.
    pub fn refresh_eligibility(&self, worker: &Worker) {
        let eligible = worker.is_healthy() && !worker.is_draining() && worker.breaker.admits();
        if self.loads.is_eligible(worker.id) != eligible {
            self.loads.set_eligible(worker.id, eligible);
        }
    }
}

impl Default for Registry {
    fn default() -> Self {
        Registry::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_validated() {
        let u = parse_worker_url("http://127.0.0.1:30000/").unwrap();
        assert_eq!((u.host.as_str(), u.port), ("127.0.0.1", 30000));
        assert_eq!(parse_worker_url("http://[::1]:8080").unwrap().host, "::1");
        assert_eq!(parse_worker_url("http://example").unwrap().port, 80);
        for bad in [
            "https://a:1",
            "a:1",
            "http://",
            "http://a:x",
            "http://a:1/v1",
            "http://[::1",
        ] {
            assert!(parse_worker_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ids_are_never_reused_and_lookup_follows_changes() {
        let r = Registry::new();
        let a = r.add("http://127.0.0.1:1", true).unwrap();
        let b = r.add("http://127.0.0.1:2", true).unwrap();
        assert!(matches!(
            r.add("http://127.0.0.1:1/", true),
            Err(RegistryError::Duplicate(_))
        ));
        r.remove("http://127.0.0.1:1").unwrap();
        let c = r.add("http://127.0.0.1:1", true).unwrap();
        assert!(c.id != a.id && c.id != b.id);
        let list = r.load();
        assert!(list.get(a.id).is_none());
        assert_eq!(list.get(c.id).unwrap().url, "http://127.0.0.1:1");
        assert_eq!(list.ids, vec![b.id, c.id]);
        assert!(a.is_draining());
        assert!(!r.loads.is_eligible(a.id));
    }
}
