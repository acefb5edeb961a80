//! Who the workers are. The list is published through `ArcSwap` (cores read it per request
//! without locking); changes (startup, `/workers` admin calls, health) are rare and serialised
//! by a mutex on the admin path. A removed worker's id is reused only once nothing holds that
//! worker any more (no request in flight on it), so add/remove cycles never exhaust the ids;
//! pooled connections are keyed by the worker's never-reused `serial`, so a reused id never
//! reaches the old worker's host (a stale id left in a tree is only a routing hint).
//!
//! DP-aware routing (`--dp-aware`): a server running `dp_size` attention-DP ranks is registered
//! as one routing target per rank (`{url}@{rank}`, each with its own id, serial, in-flight count
//! and tree entries), so the policies, the trees, the load board and `/workers` see ranks
//! without knowing about them. What belongs to the *server* is shared by its ranks through one
//! `Arc`: the health verdict and the circuit breaker (a dead server takes every rank out), and
//! the server is added and removed as a whole.

use crate::base::WorkerId;
use crate::workers::breaker::{Breaker, BreakerConfig, Ticket, Transition};
use crate::workers::load::LoadBoard;
use crate::workers::role::{Role, Side};
use arc_swap::ArcSwap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Most workers registered at once (ids of removed workers are reused once they are idle).
pub const MAX_WORKER_IDS: usize = 16_384;

/// Longest host name accepted in a worker URL (DNS limit).
const MAX_HOST_LEN: usize = 255;

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

/// Validate `http://host:port[/]` (plain HTTP: the gateway talks to workers on a trusted
/// network; TLS to workers is not supported). The port is required and the host is an IP
/// literal or a name of `[A-Za-z0-9.-]{1,255}`, so nothing else reaches the resolver.
pub fn parse_worker_url(url: &str) -> Result<WorkerUrl, UrlError> {
    let bad = |why: &str| UrlError(format!("worker URL `{}`: {why}", shown(url)));
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| bad("must start with http://"))?;
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.is_empty() || authority.contains('/') || authority.contains('@') {
        return Err(bad("must be http://host:port without a path"));
    }
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (h, after) = v6.split_once(']').ok_or_else(|| bad("unclosed ["))?;
        if h.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(bad("bad IPv6 literal"));
        }
        (
            h,
            after
                .strip_prefix(':')
                .ok_or_else(|| bad("a port is required"))?,
        )
    } else {
        let (h, p) = authority
            .rsplit_once(':')
            .ok_or_else(|| bad("a port is required"))?;
        if !is_host_name(h) {
            return Err(bad(
                "the host must be an IP address or a name of letters, digits, `.` and `-`",
            ));
        }
        (h, p)
    };
    let port: u16 = match port.parse() {
        Ok(p) if p > 0 && port.bytes().all(|b| b.is_ascii_digit()) => p,
        _ => return Err(bad("bad port")),
    };
    Ok(WorkerUrl {
        authority: authority.to_string(),
        host: host.to_string(),
        port,
    })
}

/// `[A-Za-z0-9.-]{1,255}` (IPv4 literals included).
fn is_host_name(h: &str) -> bool {
    (1..=MAX_HOST_LEN).contains(&h.len())
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-')
}

/// A URL as shown in an error message: bounded, control characters replaced.
fn shown(url: &str) -> String {
    url.chars()
        .take(300)
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

/// The host's addresses without a lookup when it is an IP literal (`None` for a name).
pub fn literal_addrs(u: &WorkerUrl) -> Option<Vec<SocketAddr>> {
    let ip: std::net::IpAddr = u.host.parse().ok()?;
    Some(vec![SocketAddr::new(ip, u.port)])
}

/// Resolve a worker's host (blocking: call it off the serving cores), IPv4 first.
pub fn resolve(u: &WorkerUrl) -> Result<Vec<SocketAddr>, RegistryError> {
    if let Some(a) = literal_addrs(u) {
        return Ok(a);
    }
    let mut v: Vec<SocketAddr> = (u.host.as_str(), u.port)
        .to_socket_addrs()
        .map_err(|e| RegistryError::BadUrl(format!("cannot resolve {}: {e}", u.host)))?
        .collect();
    v.sort_by_key(|a| !a.is_ipv4());
    if v.is_empty() {
        return Err(RegistryError::BadUrl(format!(
            "{} resolves to no address",
            u.host
        )));
    }
    Ok(v)
}

/// A routing target's attention-DP rank on its server (`--dp-aware`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DpRank {
    /// The rank, `0..size`: sent as `data_parallel_rank`.
    pub rank: u32,
    /// The server's `dp_size`.
    pub size: u32,
}

/// Most DP ranks one server may register (SGLang fleets run at most a few dozen).
pub const MAX_DP_SIZE: u32 = 1024;

/// One routing target: a server, or with `--dp-aware` one DP rank of a server.
#[derive(Debug)]
pub struct Worker {
    pub id: WorkerId,
    /// Never reused (ids are): what pooled connections are keyed by.
    pub serial: u64,
    /// Name of the target: the base URL as configured (no trailing slash), or
    /// `{server_url}@{rank}` for a DP rank (the reference's name for it).
    pub url: String,
    /// The server's base URL (equal to `url` outside DP-aware mode).
    pub server_url: String,
    /// The DP rank this target sends requests to (`--dp-aware`), else `None`.
    pub dp: Option<DpRank>,
    /// `host:port` for the upstream `Host` header.
    pub authority: String,
    /// The URL's host without brackets (a prefill worker's `bootstrap_host`).
    pub host: String,
    /// Regular, prefill or decode (`--pd-disaggregation`): which side's policy may pick it.
    pub role: Role,
    /// Addresses resolved when the worker was added (tried in order).
    pub addrs: Vec<SocketAddr>,
    /// Last health verdict (active checks and passive connect failures); shared by the ranks of
    /// one server.
    healthy: Arc<AtomicBool>,
    /// Being removed: no new requests, in-flight ones finish.
    draining: AtomicBool,
    /// Held out of selection by its orchestrator (Kubernetes discovery: the pod is registered
    /// but not Ready); apart from `healthy`, which the health checks would set back. Shared by
    /// the ranks of one server.
    held: Arc<AtomicBool>,
    /// Requests that reached this worker and completed (any status).
    pub completed: AtomicU64,
    /// The server's circuit breaker (shared by its DP ranks).
    pub breaker: Arc<Breaker>,
}

impl Worker {
    /// A worker outside any registry, for a one-off call (`/get_server_info` before the server
    /// is registered): its id is never a registered one, and the pool never keeps its connections.
    pub fn detached(url: &str, parsed: WorkerUrl, addrs: Vec<SocketAddr>) -> Worker {
        let url = url.trim_end_matches('/').to_string();
        Worker {
            id: MAX_WORKER_IDS as WorkerId,
            serial: 0,
            server_url: url.clone(),
            url,
            dp: None,
            authority: parsed.authority,
            host: parsed.host,
            role: Role::Regular,
            addrs,
            healthy: Arc::new(AtomicBool::new(false)),
            draining: AtomicBool::new(false),
            held: Arc::default(),
            completed: AtomicU64::new(0),
            breaker: Arc::default(),
        }
    }

    /// A worker built by [`Worker::detached`] (not in the registry): every such worker has the
    /// same id and serial, so nothing may be shared between them by id.
    pub fn is_detached(&self) -> bool {
        self.id as usize == MAX_WORKER_IDS
    }

    /// Whether `other` is a target on the same server (DP ranks share their server's state).
    pub fn same_server(&self, other: &Worker) -> bool {
        Arc::ptr_eq(&self.breaker, &other.breaker)
    }
    /// The target that speaks for its server in per-server work (health checks, scrapes): every
    /// worker outside DP-aware mode, rank 0 within it.
    pub fn is_primary(&self) -> bool {
        self.dp.is_none_or(|d| d.rank == 0)
    }
    /// Current health verdict.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }
    /// Whether the worker is being removed.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }
    /// Whether its orchestrator holds it out of selection (a registered pod not Ready).
    pub fn is_held(&self) -> bool {
        self.held.load(Ordering::Relaxed)
    }

    /// A request slot on this worker's circuit (`None` when open or out of probe slots).
    pub fn admit(self: &Arc<Self>, cfg: &BreakerConfig) -> Option<CircuitSlot> {
        let ticket = self.breaker.try_acquire(cfg)?;
        Some(CircuitSlot {
            worker: self.clone(),
            ticket: Some(ticket),
        })
    }
}

/// One request's place on a worker's circuit: it records the request's outcome at most once,
/// and gives a half-open probe slot back on every path (dropped without an outcome when the
/// client left or the gateway failed locally), so probes cannot leak and wedge the worker.
#[derive(Debug)]
pub struct CircuitSlot {
    worker: Arc<Worker>,
    ticket: Option<Ticket>,
}

impl CircuitSlot {
    /// The worker this slot is on.
    pub fn worker(&self) -> &Arc<Worker> {
        &self.worker
    }

    /// Record the outcome; every call after the first does nothing.
    pub fn record(&mut self, cfg: &BreakerConfig, success: bool, now_ms: u64) -> Transition {
        match self.ticket.take() {
            Some(t) => self.worker.breaker.record(cfg, t, success, now_ms),
            None => Transition::None,
        }
    }
}

impl Drop for CircuitSlot {
    fn drop(&mut self) {
        if let Some(t) = self.ticket.take() {
            self.worker.breaker.release(t);
        }
    }
}

/// An immutable view of the workers, published to the cores.
#[derive(Debug, Default)]
pub struct WorkerList {
    /// Registration order.
    pub workers: Vec<Arc<Worker>>,
    /// The same order, ids only (what policies iterate).
    pub ids: Vec<WorkerId>,
    /// Ids of the prefill workers, in registration order (PD mode's prefill candidates).
    pub prefill_ids: Vec<WorkerId>,
    /// Ids of the decode workers, in registration order (PD mode's decode candidates).
    pub decode_ids: Vec<WorkerId>,
    by_id: Vec<u32>,
}

impl WorkerList {
    /// The serials of the workers listed, for forgetting per-worker state of workers gone in
    /// O(workers) (a scan of the list per remembered worker was O(workers²): at 4,096 workers,
    /// 16.7 M comparisons on every health tick).
    pub fn serials(&self) -> std::collections::HashSet<u64> {
        self.workers.iter().map(|w| w.serial).collect()
    }

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
        let with_role = |keep: fn(Role) -> bool| -> Vec<WorkerId> {
            workers
                .iter()
                .filter(|w| keep(w.role))
                .map(|w| w.id)
                .collect()
        };
        let prefill_ids = with_role(Role::is_prefill);
        let decode_ids = with_role(|r| r == Role::Decode);
        WorkerList {
            workers,
            ids,
            prefill_ids,
            decode_ids,
            by_id,
        }
    }
    /// The ids a request picks from on `side`: every worker, or one role's in PD mode.
    pub fn ids_on(&self, side: Side) -> &[WorkerId] {
        match side {
            Side::Any => &self.ids,
            Side::Prefill => &self.prefill_ids,
            Side::Decode => &self.decode_ids,
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
        self.workers
            .iter()
            .find(|w| w.url == url || w.server_url == url)
    }
    /// Every target on `w`'s server (its DP ranks; `w` alone outside DP-aware mode).
    pub fn same_server<'s>(&'s self, w: &'s Worker) -> impl Iterator<Item = &'s Arc<Worker>> {
        self.workers.iter().filter(move |o| o.same_server(w))
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
                write!(
                    f,
                    "no worker ids left ({MAX_WORKER_IDS} workers registered or busy)"
                )
            }
        }
    }
}

/// Id bookkeeping, behind the admin mutex.
#[derive(Default)]
struct Ids {
    /// Next never-used id.
    next: WorkerId,
    /// Next serial (never reused).
    serial: u64,
    /// Removed workers; an id comes back once nothing else holds its worker.
    retired: Vec<Arc<Worker>>,
    /// Ids taken and given back unused (a multi-rank add that ran out of ids).
    free: Vec<WorkerId>,
}

impl Ids {
    /// A free id: a retired one that nothing holds any more (lowest first), else a new one.
    fn take(&mut self) -> Option<WorkerId> {
        if let Some(id) = self.free.pop() {
            return Some(id);
        }
        let idle = self
            .retired
            .iter()
            .enumerate()
            .filter(|(_, w)| Arc::strong_count(w) == 1)
            .min_by_key(|(_, w)| w.id)
            .map(|(i, _)| i);
        if let Some(i) = idle {
            return Some(self.retired.swap_remove(i).id);
        }
        if (self.next as usize) < MAX_WORKER_IDS {
            self.next += 1;
            return Some(self.next - 1);
        }
        None
    }
}

/// The registry shared by every core.
pub struct Registry {
    list: ArcSwap<WorkerList>,
    /// In-flight counts and eligibility for every worker id.
    pub loads: LoadBoard,
    admin: Mutex<Ids>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Registry {
        Registry {
            list: ArcSwap::from_pointee(WorkerList::default()),
            loads: LoadBoard::new(MAX_WORKER_IDS),
            admin: Mutex::new(Ids::default()),
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

    /// Register a worker (resolving its host now, on the caller's thread: never call it on a
    /// serving core with a host name, see [`resolve`]). It starts healthy unless `healthy` is
    /// false (then it waits for a health check).
    pub fn add(&self, url: &str, healthy: bool) -> Result<Arc<Worker>, RegistryError> {
        self.add_with_role(url, healthy, Role::Regular)
    }

    /// [`Registry::add`] for a worker with a PD role (prefill or decode).
    pub fn add_with_role(
        &self,
        url: &str,
        healthy: bool,
        role: Role,
    ) -> Result<Arc<Worker>, RegistryError> {
        let parsed = parse_worker_url(url).map_err(|e| RegistryError::BadUrl(e.0))?;
        let addrs = resolve(&parsed)?;
        self.add_resolved(url, parsed, addrs, healthy, role)
    }

    /// Register a worker whose addresses are already known.
    pub fn add_resolved(
        &self,
        url: &str,
        parsed: WorkerUrl,
        addrs: Vec<SocketAddr>,
        healthy: bool,
        role: Role,
    ) -> Result<Arc<Worker>, RegistryError> {
        let mut added = self.add_server(url, parsed, addrs, healthy, role, None)?;
        added.pop().ok_or(RegistryError::Full)
    }

    /// Register a server: one worker, or with `dp_size` (`--dp-aware`) one routing target per
    /// DP rank, `{url}@{rank}`, sharing the server's health and circuit. All or nothing.
    pub fn add_server(
        &self,
        url: &str,
        parsed: WorkerUrl,
        addrs: Vec<SocketAddr>,
        healthy: bool,
        role: Role,
        dp_size: Option<u32>,
    ) -> Result<Vec<Arc<Worker>>, RegistryError> {
        let url = url.trim_end_matches('/').to_string();
        if dp_size.is_some_and(|n| n == 0 || n > MAX_DP_SIZE) {
            return Err(RegistryError::BadUrl(format!(
                "worker {url}: dp_size must be 1..={MAX_DP_SIZE}"
            )));
        }
        let mut ids = self.admin.lock().unwrap_or_else(|p| p.into_inner());
        let cur = self.list.load_full();
        if cur.by_url(&url).is_some() {
            return Err(RegistryError::Duplicate(url));
        }
        let ranks: Vec<Option<DpRank>> = match dp_size {
            None => vec![None],
            Some(size) => (0..size).map(|rank| Some(DpRank { rank, size })).collect(),
        };
        let mut taken = Vec::with_capacity(ranks.len());
        for _ in &ranks {
            match ids.take() {
                Some(id) => taken.push(id),
                None => {
                    ids.free.extend(taken);
                    return Err(RegistryError::Full);
                }
            }
        }
        let healthy = Arc::new(AtomicBool::new(healthy));
        let breaker: Arc<Breaker> = Arc::default();
        let held: Arc<AtomicBool> = Arc::default();
        let mut added = Vec::with_capacity(ranks.len());
        for (id, dp) in taken.into_iter().zip(ranks) {
            ids.serial += 1;
            added.push(Arc::new(Worker {
                id,
                serial: ids.serial,
                url: match dp {
                    Some(d) => format!("{url}@{}", d.rank),
                    None => url.clone(),
                },
                server_url: url.clone(),
                dp,
                authority: parsed.authority.clone(),
                host: parsed.host.clone(),
                role,
                addrs: addrs.clone(),
                healthy: healthy.clone(),
                draining: AtomicBool::new(false),
                held: held.clone(),
                completed: AtomicU64::new(0),
                breaker: breaker.clone(),
            }));
        }
        let mut workers = cur.workers.clone();
        workers.extend(added.iter().cloned());
        self.list.store(Arc::new(WorkerList::build(workers)));
        for w in &added {
            self.refresh_one(w);
        }
        Ok(added)
    }

    /// Take a server (every DP rank of it) out of selection at once and out of the list;
    /// in-flight requests keep their `Arc<Worker>` and finish. `url_or_id` names the server's
    /// URL, a rank's `{url}@{rank}` or any of its ids. Returns the removed targets.
    pub fn remove(&self, url_or_id: &str) -> Result<Vec<Arc<Worker>>, RegistryError> {
        let mut ids = self.admin.lock().unwrap_or_else(|p| p.into_inner());
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
        let gone: Vec<Arc<Worker>> = cur.same_server(&found).cloned().collect();
        for w in &gone {
            w.draining.store(true, Ordering::Relaxed);
            self.refresh_one(w);
            // The id may be reused: whoever gets it starts without this worker's engine load.
            self.loads.set_external(w.id, 0);
        }
        let workers: Vec<Arc<Worker>> = cur
            .workers
            .iter()
            .filter(|w| !w.same_server(&found))
            .cloned()
            .collect();
        self.list.store(Arc::new(WorkerList::build(workers)));
        ids.retired.extend(gone.iter().cloned());
        Ok(gone)
    }

    /// Set `worker`'s external load (engine-reported requests this copy did not send) on the
    /// load board, unless it was removed meanwhile: the check and the write happen under the
    /// admin lock, so a scrape that finishes after a removal can never charge its load to a
    /// new worker that reused the id. Returns whether it was set.
    pub fn set_external_load(&self, worker: &Worker, n: u32) -> bool {
        let _ids = self.admin.lock().unwrap_or_else(|p| p.into_inner());
        let current = self.list.load();
        if current
            .get(worker.id)
            .is_some_and(|w| w.serial == worker.serial)
        {
            self.loads.set_external(worker.id, n);
            true
        } else {
            false
        }
    }

    /// Record a health verdict (for the whole server: every DP rank shares it) and update
    /// eligibility. Returns true when it changed.
    pub fn set_healthy(&self, worker: &Worker, healthy: bool) -> bool {
        let was = worker.healthy.swap(healthy, Ordering::AcqRel);
        if was != healthy {
            self.refresh_eligibility(worker);
        }
        was != healthy
    }

    /// Hold a server (every DP rank) out of selection, or release it, for its orchestrator
    /// (Kubernetes discovery: a registered pod that is not Ready stays registered, unroutable).
    /// Returns true when it changed.
    pub fn set_held(&self, worker: &Worker, held: bool) -> bool {
        let was = worker.held.swap(held, Ordering::AcqRel);
        if was != held {
            self.refresh_eligibility(worker);
        }
        was != held
    }

    /// Selectable = healthy, not draining, not held, circuit not open. Call after any of them changes;
    /// health and circuit belong to the server, so every DP rank of it is refreshed.
    pub fn refresh_eligibility(&self, worker: &Worker) {
        self.refresh_one(worker);
        if worker.dp.is_some() {
            for w in self.list.load().same_server(worker) {
                self.refresh_one(w);
            }
        }
    }

    /// [`Registry::refresh_eligibility`] of one target.
    fn refresh_one(&self, worker: &Worker) {
        let eligible = worker.is_healthy()
            && !worker.is_draining()
            && !worker.is_held()
            && worker.breaker.admits();
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
        assert_eq!(parse_worker_url("http://gpu-1.lan:80").unwrap().port, 80);
        let long = format!("http://{}:1", "a".repeat(256));
        for bad in [
            "https://a:1",
            "a:1",
            "http://",
            "http://a:x",
            "http://a:1/v1",
            "http://[::1",
            "http://example",
            "http://[::1]",
            "http://a:0",
            "http://a:+1",
            "http://a b:1",
            "http://a_b:1",
            "http://a%00:1",
            "http://:1",
            "http://[zz]:1",
            "http://a:1//",
            long.as_str(),
        ] {
            assert!(parse_worker_url(bad).is_err(), "{bad}");
        }
        assert!(parse_worker_url(&format!("http://{}:1", "a".repeat(255))).is_ok());
    }

    #[test]
    fn serials_name_exactly_the_listed_workers() {
        let r = Registry::new();
        let a = r.add("http://127.0.0.1:1", true).unwrap();
        let b = r.add("http://127.0.0.1:2", true).unwrap();
        let gone = r.add("http://127.0.0.1:3", true).unwrap();
        r.remove(&gone.id.to_string()).unwrap();
        let live = r.load().serials();
        assert_eq!(live.len(), 2);
        assert!(live.contains(&a.serial) && live.contains(&b.serial));
        assert!(!live.contains(&gone.serial));
    }

    #[test]
    fn roles_split_the_candidate_lists() {
        let r = Registry::new();
        let p = r
            .add_with_role(
                "http://127.0.0.1:1",
                true,
                Role::Prefill {
                    bootstrap_port: Some(9),
                },
            )
            .unwrap();
        let d = r
            .add_with_role("http://127.0.0.1:2", true, Role::Decode)
            .unwrap();
        let g = r.add("http://127.0.0.1:3", true).unwrap();
        let list = r.load();
        assert_eq!(list.prefill_ids, vec![p.id]);
        assert_eq!(list.decode_ids, vec![d.id]);
        assert_eq!(list.ids, vec![p.id, d.id, g.id]);
        assert_eq!(p.host, "127.0.0.1");
    }

    #[test]
    fn ip_literals_need_no_lookup() {
        let u = parse_worker_url("http://[::1]:9").unwrap();
        assert_eq!(literal_addrs(&u), Some(vec!["[::1]:9".parse().unwrap()]));
        assert!(literal_addrs(&parse_worker_url("http://localhost:9").unwrap()).is_none());
    }

    #[test]
    fn ids_come_back_only_once_nothing_holds_the_worker() {
        let r = Registry::new();
        let a = r.add("http://127.0.0.1:1", true).unwrap();
        let b = r.add("http://127.0.0.1:2", true).unwrap();
        assert!(matches!(
            r.add("http://127.0.0.1:1/", true),
            Err(RegistryError::Duplicate(_))
        ));
        r.remove("http://127.0.0.1:1").unwrap();
        // `a` is still held (a request in flight): its id is not handed out.
        let c = r.add("http://127.0.0.1:3", true).unwrap();
        assert!(c.id != a.id && c.id != b.id);
        let list = r.load();
        assert!(list.get(a.id).is_none());
        assert_eq!(list.get(c.id).unwrap().url, "http://127.0.0.1:3");
        assert_eq!(list.ids, vec![b.id, c.id]);
        assert!(a.is_draining());
        assert!(!r.loads.is_eligible(a.id));
        drop(list);
        let (old_id, old_serial) = (a.id, a.serial);
        drop(a);
        let d = r.add("http://127.0.0.1:1", true).unwrap();
        assert_eq!(d.id, old_id, "an idle retired id is reused");
        assert!(d.serial > old_serial, "serials never repeat");
        for i in 0..(2 * MAX_WORKER_IDS) {
            let w = r.add(&format!("http://127.0.0.1:{}", 10 + i % 50_000), true);
            let w = w.expect("add/remove cycles never exhaust the ids");
            r.remove(&w.url).unwrap();
        }
    }

    #[test]
    fn a_slot_records_once_and_frees_its_probe_when_dropped() {
        let r = Registry::new();
        let w = r.add("http://127.0.0.1:1", true).unwrap();
        let cfg = BreakerConfig {
            failure_threshold: 1,
            open_ms: 0,
            half_open_probes: 1,
            ..BreakerConfig::default()
        };
        let mut s = w.admit(&cfg).unwrap();
        assert_eq!(s.record(&cfg, false, 1), Transition::Opened);
        assert_eq!(s.record(&cfg, false, 2), Transition::None, "recorded once");
        drop(s);
        w.breaker.tick(&cfg, 10);
        let probe = w.admit(&cfg).unwrap();
        assert!(w.admit(&cfg).is_none());
        drop(probe); // the client left: the slot comes back
        assert!(w.admit(&cfg).is_some());
    }

    #[test]
    fn external_load_never_reaches_a_worker_that_reused_the_id() {
        let r = Registry::new();
        let a = r.add("http://127.0.0.1:1", true).unwrap();
        assert!(r.set_external_load(&a, 7));
        assert_eq!(r.loads.load(a.id), 7);
        r.remove(&a.url).unwrap();
        assert_eq!(r.loads.external(a.id), 0, "cleared on removal");
        // A scrape of the removed worker that finishes late is refused.
        assert!(!r.set_external_load(&a, 9));
        assert_eq!(r.loads.external(a.id), 0);
        let id = a.id;
        drop(a);
        let b = r.add("http://127.0.0.1:2", true).unwrap();
        assert_eq!(b.id, id, "the id is reused");
        assert_eq!(r.loads.load(b.id), 0);
        assert!(r.set_external_load(&b, 3));
        assert_eq!(r.loads.load(b.id), 3);
    }

    #[test]
    fn dp_ranks_are_targets_that_share_their_servers_health_and_circuit() {
        let r = Registry::new();
        let plain = r.add("http://127.0.0.1:9", true).unwrap();
        let url = "http://127.0.0.1:1";
        let parsed = parse_worker_url(url).unwrap();
        let addrs = literal_addrs(&parsed).unwrap();
        let ranks = r
            .add_server(
                url,
                parsed.clone(),
                addrs.clone(),
                true,
                Role::Regular,
                Some(3),
            )
            .unwrap();
        let names: Vec<&str> = ranks.iter().map(|w| w.url.as_str()).collect();
        assert_eq!(
            names,
            [
                "http://127.0.0.1:1@0",
                "http://127.0.0.1:1@1",
                "http://127.0.0.1:1@2"
            ]
        );
        assert_eq!(ranks[2].dp, Some(DpRank { rank: 2, size: 3 }));
        assert!(ranks
            .iter()
            .all(|w| w.server_url == url && r.loads.is_eligible(w.id)));
        assert!(ranks[0].is_primary() && !ranks[1].is_primary() && plain.is_primary());
        assert_eq!(r.load().ids.len(), 4, "each rank is its own target");
        assert!(matches!(
            r.add_server(url, parsed, addrs, true, Role::Regular, Some(2)),
            Err(RegistryError::Duplicate(_))
        ));
        // One verdict, through any rank, takes the whole server out (and back in).
        assert!(r.set_healthy(&ranks[1], false));
        assert!(ranks
            .iter()
            .all(|w| !w.is_healthy() && !r.loads.is_eligible(w.id)));
        assert!(r.loads.is_eligible(plain.id), "other servers are untouched");
        r.set_healthy(&ranks[0], true);
        assert!(ranks.iter().all(|w| r.loads.is_eligible(w.id)));
        // One circuit: opened through rank 2, every rank leaves selection.
        let cfg = BreakerConfig {
            failure_threshold: 1,
            ..BreakerConfig::default()
        };
        let mut slot = ranks[2].admit(&cfg).unwrap();
        assert_eq!(slot.record(&cfg, false, 1), Transition::Opened);
        r.refresh_eligibility(&ranks[2]);
        assert!(ranks.iter().all(|w| !r.loads.is_eligible(w.id)));
        assert!(ranks[0].admit(&cfg).is_none());
        // Removing by the server URL (or one rank's name) removes every rank.
        let gone = r.remove("http://127.0.0.1:1@1").unwrap();
        assert_eq!(gone.len(), 3);
        assert_eq!(r.load().ids, vec![plain.id]);
        assert!(r
            .add_server(
                url,
                parse_worker_url(url).unwrap(),
                vec![],
                true,
                Role::Regular,
                Some(0)
            )
            .is_err());
    }
}
