//! The network side of the simulated worker: one monoio thread serving every port, each port an
//! independent task set (accept loop, connections, one "GPU" task) around its own [`Engine`].
//!
//! The GPU task plans a forward, sleeps its virtual duration scaled to real time (to an absolute
//! deadline, so timer slack does not accumulate), then applies it and wakes the response tasks
//! of the requests it touched. Response tasks wait on per-request slots (`Rc` + local wakers: all
//! on one thread, nothing crosses threads) while keeping a read pending on the socket, so a
//! client that disconnects aborts its request at once. HTTP framing is radixgate's own pure
//! `radixgate::http` module.

//!
//! Layout: `auth` (SGLang's `--api-key` check), `wake` (single-thread wake primitives and the
//! per-request result slot), `conn`
//! (connection I/O and request framing), `routes` (endpoint dispatch and the info endpoints),
//! `inference` (inference requests, blocking and streamed); the per-port state and the cluster
//! lifecycle live here.
//!
//! `--dp-size N` (SGLang's attention data parallelism): a port runs N `Server`s, one per DP rank,
//! each with its own engine (queue, scheduler, radix cache), GPU task and KV publisher (port +
//! rank); rank 0 owns the listener, serves the info endpoints for the port (per-rank loads,
//! `dp_rank`-labelled metrics) and hands each inference request to the rank its
//! `data_parallel_rank` names (out of range: 400), else to the next rank round robin.

mod auth;
mod bootstrap;
mod conn;
mod inference;
mod routes;
mod vllm;
mod wake;

use conn::connection;
use wake::{LocalEvent, LocalNotify, Slot};

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::io;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use monoio::net::TcpListener;
use radixgate::http::RequestHead;

use super::cost::CostModel;
use super::engine::{Engine, EngineConfig, Event, ReqId};
use super::kv_events::{self, KvEventsConfig, KvPublisher, PublisherKind};
use super::radix::Namespace;
use super::tokenizer::SimTokenizer;
use super::{IoDriver, SimConfig};
use crate::rng::Rng;
/// How often the runtime thread checks for a cross-thread shutdown request (monoio without the
/// `sync` feature drops cross-thread wakes, so the flag is polled).
const STOP_POLL: Duration = Duration::from_millis(10);
/// How often a held inference request checks whether `POST /debug/faults` released it.
const HOLD_POLL: Duration = Duration::from_millis(2);

// ---------------------------------------------------------------------------------------------
// Per-port server state.

/// One raw request kept for `/debug/requests`.
struct Recorded {
    method: String,
    target: String,
    headers: Vec<(String, String)>,
    body: String,
}

/// One simulated worker.
struct Server {
    port: u16,
    port_str: String,
    cfg: Rc<SimConfig>,
    tok: Rc<SimTokenizer>,
    engine: RefCell<Engine>,
    epoch: Instant,
    started_unix: u64,
    gpu_wake: LocalNotify,
    slots: RefCell<HashMap<ReqId, Rc<Slot>>>,
    /// Running requests by request id (`x-request-id`, `/generate`'s `rid`), for
    /// `/abort_request`.
    rids: RefCell<HashMap<String, Vec<ReqId>>>,
    /// `/abort_request` calls received, and requests they aborted (`GET /debug/stats`).
    abort_requests: Cell<u64>,
    aborted_by_rid: Cell<u64>,
    /// Requests refused by `--max-queued-requests` (`GET /debug/stats` `queue_full`).
    queue_full: Cell<u64>,
    shutdown: LocalEvent,
    /// Inference requests received / answered (fault counters).
    received: Cell<u64>,
    answered: Cell<u64>,
    fault_rng: RefCell<Rng>,
    records: RefCell<VecDeque<Recorded>>,
    next_id: Cell<u64>,
    /// Connections accepted, and those of them that carried at least one inference request
    /// (`GET /debug/stats`).
    connections: Cell<u64>,
    inference_connections: Cell<u64>,
    /// Inference requests received and not yet finished (held, delayed, stalled or generating).
    in_progress: Cell<u64>,
    /// Run-time fault knobs (`POST /debug/faults`): `fail_rate` replaces the configured one;
    /// `hold` keeps new and waiting inference requests from being handled until it is cleared.
    fail_rate_override: Cell<Option<f64>>,
    hold: Cell<bool>,
    /// Inference requests waiting on `hold` right now: reported as waiting requests
    /// (`sglang:num_queue_reqs`, `/get_load`), so a held worker looks busy to whoever asks.
    held: Cell<usize>,
    /// This worker's KV-event publisher (`--kv-events-config` with publisher "zmq").
    kv: Option<KvPublisher>,
    /// This worker's `--kv-events-config` as reported by `/get_server_info` (endpoints offset
    /// and resolved when publishing).
    kv_config: Option<KvEventsConfig>,
    /// Scratch for one step's KV events.
    kv_scratch: RefCell<Vec<super::radix::CacheEvent>>,
    /// PD prefill mode: the bootstrap rooms of the requests the port's ranks received. One book
    /// per port, shared by its DP ranks, as SGLang's one bootstrap server per prefill server
    /// knows every rank's rooms (a decode request names its prefill twin's rank).
    rooms: Rc<RefCell<super::disagg::RoomBook>>,
    /// The bootstrap fields of the last PD request (`/debug/stats` `last_bootstrap`).
    last_bootstrap: RefCell<Option<super::disagg::BootstrapFields>>,
    /// PD prefill mode: the port of this server's bootstrap listener.
    bootstrap_port: Option<u16>,
    /// This scheduler's attention-DP rank on its port (0 without `--dp-size`).
    dp_rank: usize,
    /// Rank 0 only: the port's other DP ranks (1..dp_size), each a `Server` of its own (engine,
    /// GPU task, radix cache, KV publisher); rank 0 owns the listener and dispatches to them.
    others: Vec<Rc<Server>>,
    /// Rank 0 only: the round-robin cursor for requests without `data_parallel_rank`.
    next_rank: Cell<usize>,
}

/// SGLang's message for a request refused by `--max-queued-requests` (scheduler.py,
/// `_abort_on_queued_limit`).
pub(super) const QUEUE_FULL: &str = "The request queue is full.";
/// SGLang's message for a queued request refused to make way for a higher-priority one.
pub(super) const MADE_WAY: &str = "The request is aborted by a higher priority request.";

/// Why the engine did not take a prompt.
#[derive(Debug)]
pub(super) enum Refused {
    /// The request itself is wrong (answered 400).
    Bad(String),
    /// `--max-queued-requests`: the waiting queue is full (answered 503, as SGLang does).
    QueueFull,
}

/// How the engine takes a submitted prompt.
#[derive(Debug, Clone, Copy, Default)]
struct Admit {
    /// A health probe: kept out of the metrics.
    internal: bool,
    /// PD decode side: the prompt's KV was handed over by a prefill server, so only the decode
    /// cost is charged.
    transferred: bool,
    /// The body's `priority` (used under `--enable-priority-scheduling`).
    priority: Option<i64>,
}

/// Counts an inference request as in progress while it lives.
struct InProgress<'a>(&'a Cell<u64>);

impl Drop for InProgress<'_> {
    fn drop(&mut self) {
        self.0.set(self.0.get().saturating_sub(1));
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl Server {
    fn new(
        port: u16,
        index: usize,
        cfg: Rc<SimConfig>,
        tok: Rc<SimTokenizer>,
        kv: Option<KvPublisher>,
    ) -> Self {
        let cost = CostModel {
            fixed_step_ms: cfg.token_interval_ms,
            ..CostModel::default()
        };
        let seed = cfg.seed.wrapping_add(index as u64);
        let mut engine = Engine::new(EngineConfig {
            max_total_tokens: cfg.max_total_tokens,
            page_size: cfg.page_size,
            chunked_prefill_size: cfg.chunked_prefill_size,
            max_running: cfg.max_running,
            cost,
            // Answers depend on the prompt and the cluster seed only, so every worker generates
            // the same reply to the same prompt (routing does not change the conversation).
            seed: cfg.seed,
            output_vocab: tok.output_vocab(),
            kv_events: kv.is_some(),
            host_cache_tokens: cfg.host_cache_tokens,
            priority_scheduling: cfg.priority_scheduling,
            max_queued_requests: cfg.max_queued_requests,
        });
        if cfg.engine == super::EngineKind::Vllm {
            engine.use_vllm_buckets();
        }
        let kv_config = match &kv {
            Some(p) => Some(p.config().clone()),
            None => cfg
                .kv_events
                .as_ref()
                .and_then(|c| c.for_worker(index).ok()),
        };
        Server {
            port,
            port_str: port.to_string(),
            cfg,
            tok,
            engine: RefCell::new(engine),
            epoch: Instant::now(),
            started_unix: unix_now() as u64,
            gpu_wake: LocalNotify::default(),
            slots: RefCell::new(HashMap::new()),
            rids: RefCell::new(HashMap::new()),
            abort_requests: Cell::new(0),
            aborted_by_rid: Cell::new(0),
            queue_full: Cell::new(0),
            shutdown: LocalEvent::default(),
            received: Cell::new(0),
            answered: Cell::new(0),
            fault_rng: RefCell::new(Rng::new(seed ^ 0xFA11_0000)),
            records: RefCell::new(VecDeque::new()),
            next_id: Cell::new(1),
            connections: Cell::new(0),
            inference_connections: Cell::new(0),
            in_progress: Cell::new(0),
            fail_rate_override: Cell::new(None),
            hold: Cell::new(false),
            held: Cell::new(0),
            kv,
            kv_config,
            kv_scratch: RefCell::new(Vec::new()),
            rooms: Rc::default(),
            last_bootstrap: RefCell::new(None),
            bootstrap_port: None,
            dp_rank: 0,
            others: Vec::new(),
            next_rank: Cell::new(0),
        }
    }

    /// Every DP rank of this port, rank 0 (this server) first.
    fn ranks(self: &Rc<Self>) -> impl Iterator<Item = &Rc<Server>> {
        std::iter::once(self).chain(self.others.iter())
    }

    /// The rank that serves an inference request: its `data_parallel_rank` (the last one, as
    /// Python's `json` reads duplicates; out of range is an error, as SGLang's), else the next
    /// rank round robin (SGLang's default DP scheduling).
    fn rank_for(self: &Rc<Self>, body: &[u8]) -> Result<Rc<Server>, String> {
        const KEY: &[u8] = b"data_parallel_rank";
        let asked = if memchr::memmem::find(body, KEY).is_some() {
            serde_json::from_slice::<serde_json::Value>(body)
                .ok()
                .and_then(|v| v.get("data_parallel_rank").cloned())
                .filter(|v| !v.is_null())
        } else {
            None
        };
        self.rank_asked(asked)
    }

    /// vLLM's rank choice: the `X-data-parallel-rank` header (a router injects it; a value
    /// that is not an integer is ignored, as vLLM ignores it), else round robin. vLLM does not
    /// read a body field.
    fn rank_for_vllm(self: &Rc<Self>, header: Option<&[u8]>) -> Result<Rc<Server>, String> {
        let asked = header
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|v| v.trim().parse::<i64>().ok())
            .map(serde_json::Value::from);
        self.rank_asked(asked)
    }

    /// The rank `asked` names (out of range is an error), else the next one round robin.
    fn rank_asked(self: &Rc<Self>, asked: Option<serde_json::Value>) -> Result<Rc<Server>, String> {
        let n = self.others.len() + 1;
        let rank = match asked {
            None => {
                let r = self.next_rank.get() % n;
                self.next_rank.set(r + 1);
                r
            }
            Some(v) => match v.as_u64().and_then(|r| usize::try_from(r).ok()) {
                Some(r) if r < n => r,
                _ => {
                    return Err(format!(
                        "data_parallel_rank {v} is out of range: this server runs {n} DP rank(s)"
                    ))
                }
            },
        };
        Ok(match rank {
            0 => self.clone(),
            r => self.others[r - 1].clone(),
        })
    }

    /// Publish the KV events the engine recorded since the last call as one batch (SGLang
    /// publishes once per scheduler step). Never blocks: see [`kv_events`].
    fn publish_kv(&self) {
        let Some(kv) = &self.kv else { return };
        let mut evs = self.kv_scratch.borrow_mut();
        self.engine.borrow_mut().take_kv_events(&mut evs);
        if !evs.is_empty() {
            kv.publish(std::mem::take(&mut *evs), unix_now());
        }
    }

    /// The fail rate in force: the run-time override, else the configured one.
    fn fail_rate(&self) -> f64 {
        self.fail_rate_override
            .get()
            .unwrap_or(self.cfg.faults.fail_rate)
    }

    /// `spawn_cluster` validated it to be finite and positive.
    fn scale(&self) -> f64 {
        self.cfg.time_scale
    }

    /// Real time since start mapped to virtual ms.
    fn virt_now(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64() * 1000.0 * self.scale()
    }

    /// Real instant at which virtual time `ms` is reached.
    fn real_at(&self, ms: f64) -> Instant {
        self.epoch + Duration::from_secs_f64((ms / 1000.0 / self.scale()).max(0.0))
    }

    fn die(&self) {
        self.shutdown.set();
        self.gpu_wake.notify();
        for o in &self.others {
            o.die();
        }
    }

    fn next_resp_id(&self, prefix: &str) -> String {
        let n = self.next_id.get();
        self.next_id.set(n + 1);
        format!("{prefix}{:08x}{n:08x}", self.port as u32 ^ 0x5eed)
    }

    /// Queue a request, stamping its arrival on the virtual clock: now, if the GPU is idle;
    /// otherwise real time clamped into the forward in flight.
    fn submit(
        &self,
        prompt: Vec<u32>,
        max_new: usize,
        internal: bool,
    ) -> Result<(ReqId, Rc<Slot>), String> {
        self.submit_with(
            prompt,
            Namespace::default(),
            max_new,
            Admit {
                internal,
                ..Admit::default()
            },
        )
        .map_err(|r| match r {
            Refused::Bad(msg) => msg,
            Refused::QueueFull => QUEUE_FULL.to_string(),
        })
    }

    /// [`Server::submit`] in cache namespace `ns`, with the request's scheduling fields.
    fn submit_with(
        &self,
        prompt: Vec<u32>,
        ns: Namespace,
        max_new: usize,
        admit: Admit,
    ) -> Result<(ReqId, Rc<Slot>), Refused> {
        let Admit {
            internal,
            transferred,
            priority,
        } = admit;
        let mut e = self.engine.borrow_mut();
        let v = self.virt_now();
        let arrival = match e.inflight_ms() {
            None => {
                e.advance_to(v);
                e.now_ms()
            }
            Some(d) => v.clamp(e.now_ms(), e.now_ms() + d),
        };
        let id = e
            .submit(prompt, max_new, arrival, internal)
            .map_err(|err| Refused::Bad(err.to_string()))?;
        if transferred {
            e.mark_transferred(id);
        }
        if !ns.is_default() {
            e.set_namespace(id, ns);
        }
        if priority.is_some() {
            e.set_priority(id, priority);
        }
        let refused = e.enforce_queue_limit(id);
        drop(e);
        if refused.is_some() {
            self.queue_full.set(self.queue_full.get() + 1);
        }
        match refused {
            Some(r) if r == id => return Err(Refused::QueueFull),
            Some(r) => {
                // A queued request of lower priority made way: its client hears the refusal.
                if let Some(slot) = self.slots.borrow_mut().remove(&r) {
                    slot.queue_full.set(true);
                    slot.wake();
                }
            }
            None => {}
        }
        let slot = Rc::new(Slot::default());
        slot.last_at.set(arrival);
        self.slots.borrow_mut().insert(id, slot.clone());
        self.gpu_wake.notify();
        Ok((id, slot))
    }

    fn abort(&self, id: ReqId) {
        if self.slots.borrow_mut().remove(&id).is_some() {
            self.engine.borrow_mut().abort(id);
        }
    }

    /// `/abort_request`: abort the running requests with this rid (every one with
    /// `abort_all`); their handlers answer with an `abort` finish, as SGLang's do. Returns how
    /// many were aborted.
    fn abort_by_rid(&self, rid: &str, all: bool) -> usize {
        let ids: Vec<ReqId> = if all {
            self.rids.borrow().values().flatten().copied().collect()
        } else {
            self.rids.borrow().get(rid).cloned().unwrap_or_default()
        };
        let mut n = 0;
        for id in ids {
            let Some(slot) = self.slots.borrow_mut().remove(&id) else {
                continue;
            };
            if let Some(info) = self.engine.borrow_mut().abort(id) {
                slot.finish.set(Some(info));
                n += 1;
            }
            slot.wake();
        }
        self.gpu_wake.notify();
        self.aborted_by_rid
            .set(self.aborted_by_rid.get() + n as u64);
        n
    }

    fn dispatch(&self, events: &[Event]) {
        let mut slots = self.slots.borrow_mut();
        for ev in events {
            match *ev {
                Event::Token {
                    id,
                    token,
                    first,
                    at_ms,
                } => {
                    if let Some(s) = slots.get(&id) {
                        if first {
                            s.cached
                                .set(self.engine.borrow().cached_tokens(id).unwrap_or(0));
                        }
                        s.tokens.borrow_mut().push(token);
                        s.last_at.set(at_ms);
                        s.wake();
                    }
                }
                Event::Finished { id, info } => {
                    if let Some(s) = slots.remove(&id) {
                        s.cached.set(info.cached_tokens);
                        s.finish.set(Some(info));
                        s.wake();
                    }
                }
            }
        }
    }

    fn record(&self, head: &RequestHead, body: &[u8]) {
        let keep = self.cfg.record_requests;
        if keep == 0 || head.path().starts_with(b"/debug/") {
            return;
        }
        let s = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        let mut r = self.records.borrow_mut();
        while r.len() >= keep {
            r.pop_front();
        }
        r.push_back(Recorded {
            method: s(head.method()),
            target: s(head.target()),
            headers: head.headers().map(|(n, v)| (s(n), s(v))).collect(),
            body: s(body),
        });
    }
}

/// The virtual GPU: plan, sleep the scaled duration, apply, wake.
async fn gpu_loop(sh: Rc<Server>) {
    let mut events = Vec::new();
    while !sh.shutdown.is_set() {
        let planned = sh.engine.borrow_mut().plan();
        let Some(f) = planned else {
            monoio::select! {
                _ = sh.gpu_wake.wait() => {}
                _ = sh.shutdown.wait() => return,
            }
            continue;
        };
        let end = sh.engine.borrow().now_ms() + f.duration_ms;
        let deadline = sh.real_at(end);
        if deadline > Instant::now() {
            monoio::select! {
                _ = monoio::time::sleep_until(deadline.into()) => {}
                _ = sh.shutdown.wait() => return,
            }
        }
        events.clear();
        sh.engine.borrow_mut().complete(&mut events);
        sh.publish_kv();
        sh.dispatch(&events);
    }
}

// ---------------------------------------------------------------------------------------------
// Cluster lifecycle.

async fn accept_loop(sh: Rc<Server>, listener: TcpListener) {
    loop {
        monoio::select! {
            res = listener.accept() => match res {
                Ok((stream, _)) => {
                    monoio::spawn(connection(sh.clone(), stream));
                }
                Err(_) => {
                    // EMFILE and friends: back off instead of spinning.
                    monoio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            _ = sh.shutdown.wait() => break,
        }
    }
    // Dropping the listener closes the port: connection refused from now on.
    drop(listener);
}

/// Reports the outcome of runtime start-up (driver name, or why it failed) to `spawn_cluster`.
type Ready = std::sync::mpsc::Sender<io::Result<&'static str>>;

/// One simulated worker's listeners: its HTTP port and, in PD prefill mode, its bootstrap port.
struct PortListeners {
    http: std::net::TcpListener,
    bootstrap: Option<std::net::TcpListener>,
}

async fn serve(
    cfg: Rc<SimConfig>,
    listeners: Vec<PortListeners>,
    kv: Vec<KvPublisher>,
    stop: Arc<AtomicBool>,
    ready: Ready,
    driver: &'static str,
) {
    let mut kv = kv.into_iter();
    // Built before reporting ready, so the first request does not pay for the vocabulary.
    let tok = match SimTokenizer::from_config(cfg.tokenizer, cfg.tokenizer_path.as_deref()) {
        Ok(t) => Rc::new(t),
        Err(e) => {
            let msg = format!("tokenizer: {e}");
            let _ = ready.send(Err(io::Error::other(msg)));
            return;
        }
    };
    let mut servers = Vec::with_capacity(listeners.len());
    let mut registered = Vec::with_capacity(listeners.len());
    for pl in listeners {
        let port = pl.http.local_addr().map(|a| a.port()).unwrap_or(0);
        let boot = pl
            .bootstrap
            .map(|b| {
                let p = b.local_addr().map(|a| a.port()).unwrap_or(0);
                TcpListener::from_std(b).map(|l| (p, l))
            })
            .transpose();
        match TcpListener::from_std(pl.http).and_then(|l| boot.map(|b| (l, b))) {
            Ok((l, b)) => registered.push((port, l, b)),
            Err(e) => {
                let msg = format!("cannot register listener on port {port}: {e}");
                let _ = ready.send(Err(io::Error::new(e.kind(), msg)));
                return;
            }
        }
    }
    let dp = cfg.dp_size.max(1);
    for (i, (port, listener, boot)) in registered.into_iter().enumerate() {
        // Rank r of port i is scheduler i * dp + r: its seed and KV publisher (base + i * dp + r,
        // so each port's ranks publish on its own base + r, SGLang's rule).
        let mut server = Server::new(port, i * dp, cfg.clone(), tok.clone(), kv.next());
        server.bootstrap_port = boot.as_ref().map(|(p, _)| *p);
        for r in 1..dp {
            let mut rank = Server::new(port, i * dp + r, cfg.clone(), tok.clone(), kv.next());
            rank.dp_rank = r;
            rank.rooms = server.rooms.clone();
            let rank = Rc::new(rank);
            monoio::spawn(gpu_loop(rank.clone()));
            server.others.push(rank);
        }
        let sh = Rc::new(server);
        monoio::spawn(gpu_loop(sh.clone()));
        monoio::spawn(accept_loop(sh.clone(), listener));
        if let Some((_, b)) = boot {
            monoio::spawn(bootstrap::serve_rooms(sh.clone(), b));
        }
        servers.push(sh);
    }
    let _ = ready.send(Ok(driver));
    while !stop.load(Ordering::Acquire) {
        monoio::time::sleep(STOP_POLL).await;
    }
    for sh in &servers {
        sh.die();
    }
    // Let tasks observe the shutdown and close their sockets before the runtime drops them.
    monoio::time::sleep(Duration::from_millis(5)).await;
}

fn run_runtime(
    driver: IoDriver,
    cfg: SimConfig,
    listeners: Vec<PortListeners>,
    kv: Vec<KvPublisher>,
    stop: Arc<AtomicBool>,
    ready: Ready,
) {
    // `Auto` picks a driver exactly as monoio's `FusionDriver` does (io_uring when the kernel has
    // the ops monoio needs and `MONOIO_FORCE_LEGACY_DRIVER` is not set, else epoll), so every
    // choice ends up on one concrete driver and one code path.
    let uring = match driver {
        IoDriver::Auto => monoio::utils::detect_uring(),
        IoDriver::Uring => true,
        IoDriver::Legacy => false,
    };
    if uring {
        let rt = monoio::RuntimeBuilder::<monoio::IoUringDriver>::new()
            .enable_timer()
            .build();
        serve_on(rt, "io_uring", driver, cfg, listeners, kv, stop, ready);
    } else {
        let rt = monoio::RuntimeBuilder::<monoio::LegacyDriver>::new()
            .enable_timer()
            .build();
        serve_on(rt, "legacy", driver, cfg, listeners, kv, stop, ready);
    }
}

/// Run the workers on a freshly built runtime (`name` is the driver reported to
/// [`SimCluster`]), or report through `ready` why the `requested` driver could not start.
#[allow(clippy::too_many_arguments)]
fn serve_on<D: monoio::Driver>(
    rt: io::Result<monoio::Runtime<D>>,
    name: &'static str,
    requested: IoDriver,
    cfg: SimConfig,
    listeners: Vec<PortListeners>,
    kv: Vec<KvPublisher>,
    stop: Arc<AtomicBool>,
    ready: Ready,
) {
    match rt {
        Ok(mut rt) => rt.block_on(serve(Rc::new(cfg), listeners, kv, stop, ready, name)),
        Err(e) => {
            let msg = format!("cannot start the monoio runtime ({requested:?} driver): {e}");
            let _ = ready.send(Err(io::Error::new(e.kind(), msg)));
        }
    }
}

/// A running simulated cluster: one worker per port on a background thread. Dropping it (or
/// [`shutdown`](Self::shutdown)) stops every worker and closes the ports.
pub struct SimCluster {
    ports: Vec<u16>,
    /// PD prefill mode: each worker's bootstrap port (empty otherwise).
    bootstrap_ports: Vec<u16>,
    host: String,
    driver: &'static str,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The KV-event publisher thread; it exits once the serving thread has dropped the workers.
    kv_thread: Option<std::thread::JoinHandle<()>>,
    /// Each worker's effective `--kv-events-config` (offset endpoints, bound ports resolved).
    kv_configs: Vec<KvEventsConfig>,
}

impl std::fmt::Debug for SimCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimCluster")
            .field("host", &self.host)
            .field("ports", &self.ports)
            .field("io_driver", &self.driver)
            .finish()
    }
}

impl SimCluster {
    /// PD prefill mode: each worker's bootstrap port, in configuration order (ephemeral ones
    /// resolved); empty in any other mode.
    pub fn bootstrap_ports(&self) -> &[u16] {
        &self.bootstrap_ports
    }

    /// Bound ports, in configuration order (ephemeral ones resolved).
    pub fn ports(&self) -> &[u16] {
        &self.ports
    }

    /// `http://host:port` per worker.
    pub fn urls(&self) -> Vec<String> {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        self.ports
            .iter()
            .map(|p| format!("http://{host}:{p}"))
            .collect()
    }

    /// Stop all workers and wait for the serving thread to exit (ports closed on return).
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    /// Block until the serving thread exits (after a stop requested through
    /// [`stopper`](Self::stopper)). Errors if the thread panicked.
    pub fn join(mut self) -> io::Result<()> {
        let res = match self.thread.take() {
            Some(t) => t
                .join()
                .map_err(|_| io::Error::other("sim-worker thread panicked")),
            None => Ok(()),
        };
        self.join_kv();
        res
    }

    /// Each worker's KV-event config as it publishes (endpoint `+ index`, ephemeral ports
    /// resolved), in port order; empty without `--kv-events-config` or with publisher "null"
    /// (a vLLM-shaped cluster also without `"enable_kv_cache_events": true`).
    pub fn kv_events(&self) -> &[KvEventsConfig] {
        &self.kv_configs
    }

    fn join_kv(&mut self) {
        if let Some(t) = self.kv_thread.take() {
            let _ = t.join();
        }
    }

    /// The monoio driver in use: `"io_uring"` or `"legacy"` (epoll).
    pub fn io_driver(&self) -> &'static str {
        self.driver
    }

    /// A handle that stops the cluster from another thread (signal handlers, tests).
    pub fn stopper(&self) -> Arc<AtomicBool> {
        self.stop.clone()
    }

    fn stop_and_join(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.join_kv();
    }
}

impl Drop for SimCluster {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// Bind every port (so clients can connect as soon as this returns), then serve them all on one
/// background monoio thread.
pub fn spawn_cluster(cfg: SimConfig) -> io::Result<SimCluster> {
    let invalid = |msg: &str| Err(io::Error::new(io::ErrorKind::InvalidInput, msg.to_owned()));
    if cfg.ports.is_empty() {
        return invalid("no ports configured");
    }
    if !(cfg.time_scale.is_finite() && cfg.time_scale > 0.0) {
        return invalid("time_scale must be a positive number");
    }
    if cfg
        .token_interval_ms
        .is_some_and(|ms| !(ms.is_finite() && ms >= 0.0))
    {
        return invalid("token_interval_ms must be a non-negative number");
    }
    if !(1..=256).contains(&cfg.dp_size) {
        return invalid("dp_size must be within 1..=256");
    }
    if !(0.0..=1.0).contains(&cfg.faults.fail_rate) {
        return invalid("fail_rate must be within [0, 1]");
    }
    let mut cfg = cfg;
    match cfg.engine {
        // vLLM publishes only with `enable_kv_cache_events`, in its own encoding.
        super::EngineKind::Vllm => cfg.kv_events = cfg.kv_events.map(|k| k.for_vllm()),
        super::EngineKind::Sglang => {
            if cfg
                .kv_events
                .as_ref()
                .is_some_and(|k| k.enable_kv_cache_events.is_some())
            {
                return invalid("enable_kv_cache_events is vLLM's key (use --engine vllm)");
            }
            if !cfg.lora_modules.is_empty() {
                return invalid("lora_modules is vLLM's (use --engine vllm)");
            }
        }
    }
    let mut listeners = Vec::with_capacity(cfg.ports.len());
    let mut ports = Vec::with_capacity(cfg.ports.len());
    let mut bootstrap_ports = Vec::new();
    let bind = |p: u16| -> io::Result<std::net::TcpListener> {
        // Names ("localhost") and bare IPv6 literals resolve through ToSocketAddrs.
        let l = std::net::TcpListener::bind((cfg.host.as_str(), p))
            .map_err(|e| io::Error::new(e.kind(), format!("bind {}:{p}: {e}", cfg.host)))?;
        l.set_nonblocking(true)?;
        Ok(l)
    };
    for (i, &p) in cfg.ports.iter().enumerate() {
        let l = bind(p)?;
        ports.push(l.local_addr()?.port());
        let bootstrap = match cfg.disaggregation_mode {
            Some(super::disagg::DisaggMode::Prefill) => {
                let base = cfg.disaggregation_bootstrap_port;
                let bp = if base == 0 {
                    0
                } else {
                    u16::try_from(usize::from(base) + i).map_err(|_| {
                        io::Error::new(io::ErrorKind::InvalidInput, "bootstrap port out of range")
                    })?
                };
                let b = bind(bp)?;
                bootstrap_ports.push(b.local_addr()?.port());
                Some(b)
            }
            _ => None,
        };
        listeners.push(PortListeners { http: l, bootstrap });
    }
    let (kv, kv_thread) = match &cfg.kv_events {
        Some(k) if k.publisher == PublisherKind::Zmq => {
            let dp = cfg.dp_size.max(1);
            let p = kv_events::start_ranks(k, ports.len() * dp, dp, cfg.page_size)?;
            (p.workers, Some(p.thread))
        }
        _ => (Vec::new(), None),
    };
    // Each port reports its rank 0's publisher (its ranks add their rank to the port).
    let kv_configs: Vec<KvEventsConfig> = kv
        .iter()
        .step_by(cfg.dp_size.max(1))
        .map(|p| p.config().clone())
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let driver = cfg.io_driver;
    let host = cfg.host.clone();
    let stop2 = stop.clone();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("sim-worker".into())
        .spawn(move || run_runtime(driver, cfg, listeners, kv, stop2, ready_tx))?;
    // Wait until the runtime runs and every listener is registered, so a failure (io_uring not
    // permitted, ...) is reported here rather than as refused connections later.
    let started = ready_rx
        .recv()
        .unwrap_or_else(|_| Err(io::Error::other("sim-worker thread exited during start-up")));
    match started {
        Ok(driver) => Ok(SimCluster {
            ports,
            bootstrap_ports,
            host,
            driver,
            stop,
            thread: Some(thread),
            kv_thread,
            kv_configs,
        }),
        Err(e) => {
            let _ = thread.join();
            if let Some(t) = kv_thread {
                let _ = t.join();
            }
            Err(e)
        }
    }
}
