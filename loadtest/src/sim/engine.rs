//! One simulated SGLang scheduler + GPU timeline, pure and deterministic: no sockets, no real
//! clocks. The network layer (and tests) drive it with `submit` / `abort` / `plan` / `complete`;
//! `plan` decides the next forward at the current virtual time and returns its duration,
//! `complete` advances the virtual clock by that duration and applies the forward's effects.
//!
//! Semantics mirrored from SGLang (see the simulator reference §3):
//! - FCFS, prefill-first: if the head of the waiting queue is admissible, one prefill forward
//!   runs (≤ `chunked_prefill_size` new tokens, several requests per forward, at most one of
//!   them chunked and continued first in the next forward); otherwise one decode step for the
//!   whole running batch. No mixed prefill+decode.
//! - The hit is the longest cached prefix ≤ `len − 1`, page-floored, in the request's cache
//!   namespace (`extra_key` incl. LoRA adapter, `cache_salt`), taken when the request is first
//!   scheduled; it is what `cached_tokens` reports. With a host tier (HiCache), the part of it
//!   only host memory holds is loaded back at admission, charged at the load cost in the
//!   request's prefill forward, and counted as cached (`cache_source="host"` in the metrics).
//! - After each prefill (chunk) forward the computed prefix is inserted and the request's lock
//!   moves to it, so a prefix is visible to others only once its prefill has finished.
//! - On finish `(prompt + output)[:-1]` is inserted and unlocked.
//! - Admission reserves the whole remaining need (uncached prompt + `max_new − 1` decode slots),
//!   so decode never runs out of KV and nothing is ever retracted. SGLang reserves optimistically
//!   (ratio 0.7 → 0.1) and retracts on decode OOM; this model admits somewhat fewer requests with
//!   very large `max_new_tokens` but never produces retraction storms.
//! - Saturation: the running batch is bounded by KV (the reservations above) and
//!   `max_running`; everything else waits, and a waiting request's TTFT includes its time in the
//!   queue, so TTFT grows with the queue as on a real overloaded server.
//! - `--enable-priority-scheduling` ([`EngineConfig::priority_scheduling`]): the waiting queue
//!   is ordered by the request's `priority`, higher first (SGLang's default direction), FCFS
//!   within a priority; a request without one ranks below every explicit priority, as SGLang
//!   gives it the lowest value. Admission stays head-of-line. SGLang's preemption of running
//!   lower-priority requests (`--priority-scheduling-preemption-threshold`) is not modelled:
//!   nothing is ever retracted here.
//! - Idle time: the seconds the virtual GPU had no forward to run are counted
//!   ([`Engine::idle_seconds`]), so a load test can tell a starved fleet from a saturated one.

use std::collections::{HashMap, VecDeque};

use super::cost::{CostModel, PrefillItem};
use super::metrics::{Gauges, Metrics};
use super::radix::{CacheEvent, Namespace, NodeId, RadixCache, ROOT};
use crate::rng::{hash_tokens, Rng};

/// Request handle inside one engine.
pub type ReqId = u64;

/// Decode steps per throughput sample (SGLang's `decode_log_interval`).
const GEN_LOG_INTERVAL: u32 = 40;

/// The priority of a request that names none, under priority scheduling: below every explicit
/// one, as SGLang sets it to `-sys.maxsize - 1` when higher values go first.
pub const NO_PRIORITY: i64 = i64::MIN;

/// Static configuration of one engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// KV capacity in tokens (`max_total_num_tokens`).
    pub max_total_tokens: usize,
    /// Radix page size in tokens.
    pub page_size: usize,
    /// Most new tokens per prefill forward.
    pub chunked_prefill_size: usize,
    /// Most requests admitted at once.
    pub max_running: usize,
    /// Forward durations.
    pub cost: CostModel,
    /// Seeds jitter and generated answers.
    pub seed: u64,
    /// Token ids answers are drawn from (must be non-empty).
    pub output_vocab: Vec<u32>,
    /// Record KV-cache events (pages stored, evicted, flushed) for
    /// [`take_kv_events`](Engine::take_kv_events), as SGLang does under `--kv-events-config`.
    pub kv_events: bool,
    /// Host memory for KV in tokens (SGLang's HiCache); 0 = no host tier.
    pub host_cache_tokens: usize,
    /// SGLang's `--enable-priority-scheduling`: the waiting queue ordered by priority (higher
    /// first), FCFS within one. Off: priorities are ignored, as SGLang ignores them then.
    pub priority_scheduling: bool,
    /// SGLang's `--max-queued-requests`: the longest waiting queue (see
    /// [`Engine::enforce_queue_limit`]); `None`: unbounded, SGLang's default.
    pub max_queued_requests: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_total_tokens: 400_000,
            page_size: 1,
            chunked_prefill_size: 8192,
            max_running: 256,
            cost: CostModel::default(),
            seed: 0,
            output_vocab: (1000..1256).collect(),
            kv_events: false,
            host_cache_tokens: 0,
            priority_scheduling: false,
            max_queued_requests: None,
        }
    }
}

/// Why a request was refused at submission (answered with 400).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubmitError {
    /// No input tokens.
    EmptyPrompt,
    /// Prompt plus output can never fit the KV capacity.
    TooLong {
        /// Tokens the request would need.
        need: usize,
        /// KV capacity.
        capacity: usize,
    },
}

impl std::fmt::Display for SubmitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SubmitError::EmptyPrompt => f.write_str("The input is empty."),
            SubmitError::TooLong { need, capacity } => write!(
                f,
                "The request needs {need} tokens (prompt + max_new_tokens), more than the KV cache capacity {capacity}."
            ),
        }
    }
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// Generated exactly `max_new_tokens` (EOS is ignored).
    Length,
    /// Aborted (client went away).
    Abort,
}

/// Final accounting of a request, all times in virtual milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FinishInfo {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Prompt tokens served from the cache at first scheduling.
    pub cached_tokens: usize,
    /// Arrival at the scheduler.
    pub arrival_ms: f64,
    /// First token, if any was produced.
    pub first_token_ms: Option<f64>,
    /// Finish (or abort) time.
    pub finish_ms: f64,
    /// Length or abort.
    pub reason: FinishReason,
}

/// Something a waiting client should learn, produced by [`Engine::complete`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Event {
    /// One generated token.
    Token {
        /// Request.
        id: ReqId,
        /// Generated id.
        token: u32,
        /// This is the first token (end of prefill).
        first: bool,
        /// Virtual time.
        at_ms: f64,
    },
    /// The request finished; no more events for it.
    Finished {
        /// Request.
        id: ReqId,
        /// Accounting.
        info: FinishInfo,
    },
}

/// Kind of a planned forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForwardKind {
    /// Prompt computation (possibly a chunk).
    Prefill,
    /// One token for every running request.
    Decode,
}

/// A planned forward, as returned by [`Engine::plan`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ForwardInfo {
    /// Prefill or decode.
    pub kind: ForwardKind,
    /// Virtual duration in ms (jitter included).
    pub duration_ms: f64,
    /// Requests in the forward.
    pub batch: usize,
    /// New tokens computed (prefill) or generated (decode).
    pub tokens: usize,
}

#[derive(Debug)]
struct Req {
    /// Prompt followed by generated tokens.
    tokens: Vec<u32>,
    /// PD decode side: the prompt's KV cache was handed over by a prefill server, so its
    /// prefill is charged as one token over the prompt (the memory is still taken).
    transferred: bool,
    prompt_len: usize,
    max_new: usize,
    out_rng: Rng,
    internal: bool,
    arrival_ms: f64,
    first_token_ms: Option<f64>,
    last_token_ms: f64,
    admitted: bool,
    cached: usize,
    /// The part of `cached` loaded back from host memory.
    cached_host: usize,
    /// The cache namespace the request's prefix lives in.
    ns: Namespace,
    /// Its priority class under priority scheduling ([`NO_PRIORITY`] when it gave none).
    priority: i64,
    /// Locked tree node covering `tokens[..locked_len]`.
    node: NodeId,
    locked_len: usize,
    /// Tokens whose KV exists (`locked_len..kv_len` is private).
    kv_len: usize,
    /// Slots allocated for the in-flight forward, not yet in `kv_len`.
    inflight_alloc: usize,
    /// Slots still reserved for this request's future allocations.
    reserved: usize,
}

/// The prefill batch [`Engine::plan`] is assembling: items with their cost inputs, the token
/// budget left, and the new and cached prompt tokens so far (for the batch hit rate).
struct PrefillBatch<'a> {
    items: &'a mut Vec<(ReqId, usize)>,
    costs: &'a mut Vec<PrefillItem>,
    budget: usize,
    new_tokens: usize,
    hit_tokens: usize,
    /// Tokens loaded back from host memory for the batch's requests.
    loaded: usize,
}

impl PrefillBatch<'_> {
    /// Adds `u` uncached tokens of request `id` over `context` tokens already in KV.
    fn push(&mut self, id: ReqId, u: usize, context: usize) {
        self.push_costed(id, u, u, context);
    }

    /// Push `u` new tokens whose compute is charged as `cost_u` tokens over `context` (a
    /// handed-over prompt is charged one token).
    fn push_costed(&mut self, id: ReqId, u: usize, cost_u: usize, context: usize) {
        self.items.push((id, u));
        self.costs.push(PrefillItem {
            uncached: cost_u,
            context,
        });
        self.budget -= u;
        self.new_tokens += u;
    }
}

#[derive(Debug)]
struct InFlight {
    kind: ForwardKind,
    duration_ms: f64,
    items: Vec<(ReqId, usize)>,
}

/// One worker's scheduler, KV cache and virtual GPU clock.
#[derive(Debug)]
pub struct Engine {
    cache: RadixCache,
    cost: CostModel,
    chunk: usize,
    max_running: usize,
    seed: u64,
    vocab: Vec<u32>,
    rng: Rng,
    now_ms: f64,
    next_id: ReqId,
    reqs: HashMap<ReqId, Req>,
    waiting: VecDeque<ReqId>,
    /// The waiting queue the last step left behind once it took what fit: what SGLang 0.5.23's
    /// scheduler reports as `sglang:num_queue_reqs` (its metrics reporter sets the gauge when a
    /// batch is formed, not when a request arrives). Arrivals since that step are not in it, so
    /// a burst an idle engine will take whole at its next step never shows as a queue. (SGLang
    /// refreshes the gauge after every prefill batch but only every 40th decode step; this
    /// engine refreshes it at every step, so its figure is never older than SGLang's.)
    queued_at_plan: usize,
    /// A request whose prompt is partly computed and continues first in the next prefill.
    chunked: Option<ReqId>,
    running: Vec<ReqId>,
    /// Order the waiting queue by priority (see [`EngineConfig::priority_scheduling`]).
    priority_scheduling: bool,
    /// The longest waiting queue (see [`EngineConfig::max_queued_requests`]).
    max_queued: Option<usize>,
    /// Virtual ms during which the GPU had nothing to run (see [`Engine::idle_seconds`]).
    idle_ms: f64,
    admitted: usize,
    reserved: usize,
    inflight: Option<InFlight>,
    items_buf: Vec<(ReqId, usize)>,
    cost_buf: Vec<PrefillItem>,
    metrics: Metrics,
    last_hit_rate: f64,
    gen_tokens: u64,
    gen_ms: f64,
    gen_steps: u32,
    gen_throughput: f64,
}

impl Engine {
    /// A fresh engine at virtual time 0.
    pub fn new(cfg: EngineConfig) -> Self {
        let vocab = if cfg.output_vocab.is_empty() {
            vec![0]
        } else {
            cfg.output_vocab
        };
        let mut cache = RadixCache::new(cfg.max_total_tokens, cfg.page_size)
            .with_host_tier(cfg.host_cache_tokens);
        if cfg.kv_events {
            cache.enable_events();
        }
        Engine {
            cache,
            cost: cfg.cost,
            chunk: cfg.chunked_prefill_size.max(1),
            max_running: cfg.max_running.max(1),
            seed: cfg.seed,
            vocab,
            rng: Rng::new(cfg.seed ^ 0xC0FF_EE00_D15E_A5E5),
            now_ms: 0.0,
            next_id: 1,
            reqs: HashMap::new(),
            waiting: VecDeque::new(),
            queued_at_plan: 0,
            chunked: None,
            running: Vec::new(),
            priority_scheduling: cfg.priority_scheduling,
            max_queued: cfg.max_queued_requests,
            idle_ms: 0.0,
            admitted: 0,
            reserved: 0,
            inflight: None,
            items_buf: Vec::new(),
            cost_buf: Vec::new(),
            metrics: Metrics::default(),
            last_hit_rate: 0.0,
            gen_tokens: 0,
            gen_ms: 0.0,
            gen_steps: 0,
            gen_throughput: 0.0,
        }
    }

    /// Current virtual time (start of the in-flight forward while one runs).
    pub fn now_ms(&self) -> f64 {
        self.now_ms
    }

    /// Move the virtual clock forward to `t` (never backwards; ignored while a forward runs).
    /// Used when the GPU was idle and real time passed: the gap is idle time, since a driver
    /// plans the next forward as soon as one completes and only waits when there is none.
    pub fn advance_to(&mut self, t: f64) {
        if self.inflight.is_none() && t > self.now_ms {
            self.idle_ms += t - self.now_ms;
            self.now_ms = t;
        }
    }

    /// Virtual seconds the GPU had no forward to run, up to virtual time `now_ms` (a driver's
    /// clock, which runs ahead of the engine's while it idles; the gap counts as idle then).
    /// A load test reads its growth to tell GPUs starved by an over-cautious gateway from
    /// saturated ones.
    pub fn idle_seconds(&self, now_ms: f64) -> f64 {
        let pending = if self.inflight.is_none() {
            (now_ms - self.now_ms).max(0.0)
        } else {
            0.0
        };
        (self.idle_ms + pending) / 1000.0
    }

    /// Duration of the forward in flight, if any.
    pub fn inflight_ms(&self) -> Option<f64> {
        self.inflight.as_ref().map(|f| f.duration_ms)
    }

    /// The KV cache (read-only view for stats and tests).
    pub fn cache(&self) -> &RadixCache {
        &self.cache
    }

    /// Move the KV-cache changes since the last call into `out` (empty unless
    /// [`EngineConfig::kv_events`]). The server calls it once per scheduler step, so one call's
    /// events form one published `EventBatch`, as in SGLang.
    pub fn take_kv_events(&mut self, out: &mut Vec<CacheEvent>) {
        self.cache.take_events(out);
    }

    /// Counters and histograms.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Requests admitted and not finished (decoding or mid-prefill).
    pub fn num_running(&self) -> usize {
        self.admitted
    }

    /// Cached prompt tokens of a scheduled request (`None` if unknown or not yet scheduled).
    pub fn cached_tokens(&self, id: ReqId) -> Option<usize> {
        self.reqs.get(&id).filter(|r| r.admitted).map(|r| r.cached)
    }

    /// Requests not yet scheduled.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Prompt tokens of waiting requests (upper bound on pending prefill work).
    pub fn waiting_tokens(&self) -> usize {
        self.waiting
            .iter()
            .filter_map(|id| self.reqs.get(id))
            .map(|r| r.prompt_len)
            .sum()
    }

    /// No request is waiting, running or in flight.
    pub fn is_idle(&self) -> bool {
        self.reqs.is_empty() && self.inflight.is_none()
    }

    /// Hit rate of the last prefill forward (`sglang:cache_hit_rate`).
    pub fn last_hit_rate(&self) -> f64 {
        self.last_hit_rate
    }

    /// Decode throughput over the last logging window, tokens/s.
    pub fn gen_throughput(&self) -> f64 {
        self.gen_throughput
    }

    /// Gauges for `/metrics`.
    pub fn gauges(&self) -> Gauges {
        Gauges {
            running: self.num_running(),
            queued: self.queued_at_plan,
            used_tokens: self.cache.used_tokens(),
            capacity: self.cache.capacity(),
            evictable_tokens: self.cache.evictable_tokens(),
            cache_hit_rate: self.last_hit_rate,
            gen_throughput: self.gen_throughput,
            evicted_tokens: self.cache.stats().evicted_tokens,
            idle_seconds: self.idle_ms / 1000.0,
        }
    }

    /// Render `/metrics` at virtual time `now_ms` (the driver's clock, for the idle counter);
    /// `held` requests the server holds before the engine (the `hold` fault) count as waiting,
    /// as a stalled scheduler's queue would.
    pub fn render_metrics(&self, model: &str, held: usize, now_ms: f64) -> String {
        let mut g = self.gauges();
        g.queued += held;
        g.idle_seconds = self.idle_seconds(now_ms);
        self.metrics.render(model, &g)
    }

    /// Record latencies in vLLM's histogram buckets (`--engine vllm`); call before any
    /// request.
    pub fn use_vllm_buckets(&mut self) {
        self.metrics = Metrics::vllm();
    }

    /// [`render_metrics`](Self::render_metrics) in vLLM's names, as engine (DP rank)
    /// `engine`, its series created at Unix time `created`.
    pub fn render_vllm_metrics(
        &self,
        model: &str,
        engine: usize,
        held: usize,
        now_ms: f64,
        created: f64,
    ) -> String {
        let mut g = self.gauges();
        g.queued += held;
        g.idle_seconds = self.idle_seconds(now_ms);
        self.metrics
            .render_vllm(model, engine, &g, created, self.cache.page_size())
    }

    /// Drop the whole cache; refused (false) while any request is waiting or running.
    pub fn flush_cache(&mut self) -> bool {
        // A forward still in flight can only hold aborted requests here; it touches nothing
        // when it completes.
        if !self.reqs.is_empty() {
            return false;
        }
        self.cache.flush()
    }

    /// Queue a request arriving at virtual time `arrival_ms`. `internal` requests (health
    /// probes) are excluded from metrics.
    pub fn submit(
        &mut self,
        prompt: Vec<u32>,
        max_new_tokens: usize,
        arrival_ms: f64,
        internal: bool,
    ) -> Result<ReqId, SubmitError> {
        if prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        let need = prompt.len() + max_new_tokens.saturating_sub(1);
        if need > self.cache.capacity() {
            return Err(SubmitError::TooLong {
                need,
                capacity: self.cache.capacity(),
            });
        }
        let id = self.next_id;
        self.next_id += 1;
        let out_rng = Rng::new(hash_tokens(self.seed, &prompt));
        let prompt_len = prompt.len();
        let mut tokens = prompt;
        tokens.reserve(max_new_tokens);
        self.reqs.insert(
            id,
            Req {
                tokens,
                transferred: false,
                prompt_len,
                max_new: max_new_tokens,
                out_rng,
                internal,
                arrival_ms,
                first_token_ms: None,
                last_token_ms: arrival_ms,
                admitted: false,
                cached: 0,
                cached_host: 0,
                ns: Namespace::default(),
                priority: NO_PRIORITY,
                node: ROOT,
                locked_len: 0,
                kv_len: 0,
                inflight_alloc: 0,
                reserved: 0,
            },
        );
        self.waiting.push_back(id);
        Ok(id)
    }

    /// Mark a queued request's prompt as handed over by a prefill server (PD decode side): its
    /// prefill costs one token over the prompt, as the KV arrived by transfer.
    pub fn mark_transferred(&mut self, id: ReqId) {
        if let Some(r) = self.reqs.get_mut(&id) {
            r.transferred = true;
        }
    }

    /// Put a queued request in cache namespace `ns` (its `extra_key`, LoRA adapter and
    /// `cache_salt`): it shares prefixes only with requests of the same namespace. Must come
    /// before the request is scheduled, as it is when the server submits.
    pub fn set_namespace(&mut self, id: ReqId, ns: Namespace) {
        if let Some(r) = self.reqs.get_mut(&id).filter(|r| !r.admitted) {
            r.ns = ns;
        }
    }

    /// Give a queued request its `priority` (the body's field; `None`: it named none). Under
    /// priority scheduling it moves to its place in the waiting queue: behind every request of
    /// its priority or higher, ahead of lower ones (FCFS within a priority, as SGLang sorts by
    /// priority, then queue entry time). Without priority scheduling nothing changes. Must come
    /// before the request is scheduled, as it is when the server submits.
    pub fn set_priority(&mut self, id: ReqId, priority: Option<i64>) {
        let p = priority.unwrap_or(NO_PRIORITY);
        let Some(r) = self.reqs.get_mut(&id).filter(|r| !r.admitted) else {
            return;
        };
        r.priority = p;
        if !self.priority_scheduling {
            return;
        }
        let Some(pos) = self.waiting.iter().position(|&w| w == id) else {
            return;
        };
        self.waiting.remove(pos);
        let reqs = &self.reqs;
        let prio = |w: &ReqId| reqs.get(w).map_or(NO_PRIORITY, |r| r.priority);
        // After the last request that ranks at least as high (arrival order within a class).
        let at = self
            .waiting
            .iter()
            .rposition(|w| prio(w) >= p)
            .map_or(0, |i| i + 1);
        self.waiting.insert(at, id);
    }

    /// SGLang's `--max-queued-requests` for request `id`, just submitted (with its priority
    /// set): when the waiting queue was already full, one request is refused and leaves the
    /// engine, and its client gets 503 "The request queue is full.". That is `id` itself, or,
    /// under priority scheduling, the least preferred queued request (lowest priority, the
    /// newest among equals) when `id` ranks strictly above it. Mirrors SGLang 0.5.23's
    /// `Scheduler._abort_on_queued_limit` (python/sglang/srt/managers/scheduler.py, line 3552,
    /// called from `_add_request_to_queue` before the request joins `waiting_queue`: refused
    /// when `len(waiting_queue) + 1 > max_queued_requests`). Returns the refused request.
    pub fn enforce_queue_limit(&mut self, id: ReqId) -> Option<ReqId> {
        let max = self.max_queued?;
        // `id` already waits here; SGLang checks before appending it.
        let before = self.waiting.iter().filter(|&&w| w != id).count();
        if before < max {
            return None;
        }
        let prio = |w: ReqId| self.reqs.get(&w).map_or(NO_PRIORITY, |r| r.priority);
        let mut refused = id;
        if self.priority_scheduling {
            // The queue is in priority order, FCFS within one: the last other request is the
            // least preferred.
            if let Some(&last) = self.waiting.iter().rev().find(|&&w| w != id) {
                if prio(id) > prio(last) {
                    refused = last;
                }
            }
        }
        self.abort(refused);
        Some(refused)
    }

    /// Abort a request (client disconnected): it leaves the queue or batch at once and its locks
    /// and KV are released. Returns its accounting, or `None` if it had already finished.
    pub fn abort(&mut self, id: ReqId) -> Option<FinishInfo> {
        if !self.reqs.contains_key(&id) {
            return None;
        }
        if let Some(pos) = self.waiting.iter().position(|&w| w == id) {
            self.waiting.remove(pos);
        }
        self.running.retain(|&r| r != id);
        if self.chunked == Some(id) {
            self.chunked = None;
        }
        self.finish(id, FinishReason::Abort)
    }

    /// Decide the next forward at the current virtual time. Returns `None` when there is nothing
    /// to do. Must be followed by [`complete`](Self::complete) before the next `plan`.
    pub fn plan(&mut self) -> Option<ForwardInfo> {
        if let Some(f) = &self.inflight {
            debug_assert!(false, "plan() while a forward is in flight");
            return Some(ForwardInfo {
                kind: f.kind,
                duration_ms: f.duration_ms,
                batch: f.items.len(),
                tokens: 0,
            });
        }
        let mut items = std::mem::take(&mut self.items_buf);
        let mut costs = std::mem::take(&mut self.cost_buf);
        items.clear();
        costs.clear();
        let mut batch = PrefillBatch {
            items: &mut items,
            costs: &mut costs,
            budget: self.chunk,
            new_tokens: 0,
            hit_tokens: 0,
            loaded: 0,
        };
        self.continue_chunked(&mut batch);
        self.admit_waiting(&mut batch);
        self.queued_at_plan = self.waiting.len();
        let (new_tokens, hit_tokens, loaded) = (batch.new_tokens, batch.hit_tokens, batch.loaded);
        let info = if !items.is_empty() {
            self.prefill_forward(&items, &costs, new_tokens, hit_tokens, loaded)
        } else if !self.running.is_empty() {
            self.decode_forward(&mut items)
        } else {
            self.items_buf = items;
            self.cost_buf = costs;
            return None;
        };
        self.cost_buf = costs;
        self.inflight = Some(InFlight {
            kind: info.kind,
            duration_ms: info.duration_ms,
            items,
        });
        Some(info)
    }

    /// Continue a chunked prefill first: it takes what it needs of the budget.
    fn continue_chunked(&mut self, batch: &mut PrefillBatch<'_>) {
        if let Some(id) = self.chunked.take() {
            if let Some(r) = self.reqs.get(&id) {
                let u = batch.budget.min(r.prompt_len - r.kv_len);
                if r.transferred {
                    batch.push_costed(id, u, u.min(1), r.kv_len + u.saturating_sub(1));
                } else {
                    batch.push(id, u, r.kv_len);
                }
            }
        }
    }

    /// Admit waiting requests FCFS while the budget, the batch cap and memory allow; a request
    /// whose prefill does not fit the budget is chunked and ends the batch.
    fn admit_waiting(&mut self, batch: &mut PrefillBatch<'_>) {
        let mut partial = batch.items.first().is_some_and(|&(id, u)| {
            self.reqs
                .get(&id)
                .is_some_and(|r| r.kv_len + u < r.prompt_len)
        });
        while batch.budget > 0 && !partial && self.admitted < self.max_running {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let Some(r) = self.reqs.get_mut(&id) else {
                self.waiting.pop_front();
                continue;
            };
            let m = self
                .cache
                .match_prefix_in(&r.ns, &r.tokens[..r.prompt_len - 1]);
            self.cache.inc_lock(m.device_node);
            // Loading host pages back takes as many device slots as recomputing them would.
            let need = r.prompt_len - m.device_len + r.max_new.saturating_sub(1);
            if self.cache.available_tokens() < self.reserved + need {
                self.cache.dec_lock(m.device_node);
                break; // head-of-line: FCFS does not skip ahead
            }
            let (hit, node, loaded) = if self.cache.load_back(&m) {
                // The loaded pages are device tree pages now: the lock moves down onto them.
                self.cache.inc_lock(m.node);
                self.cache.dec_lock(m.device_node);
                (m.device_len + m.host_len, m.node, m.host_len)
            } else {
                (m.device_len, m.device_node, 0)
            };
            let need = r.prompt_len - hit + r.max_new.saturating_sub(1);
            self.waiting.pop_front();
            r.admitted = true;
            r.cached = hit;
            r.cached_host = loaded;
            batch.loaded += loaded;
            r.node = node;
            r.locked_len = hit;
            r.kv_len = hit;
            r.reserved = need;
            self.reserved += need;
            self.admitted += 1;
            if !r.internal {
                self.metrics
                    .queue
                    .observe((self.now_ms - r.arrival_ms).max(0.0) / 1000.0);
            }
            let u = batch.budget.min(r.prompt_len - hit);
            if r.transferred {
                batch.push_costed(id, u, u.min(1), hit + u.saturating_sub(1));
            } else {
                batch.push(id, u, hit);
            }
            batch.hit_tokens += hit;
            partial = u < r.prompt_len - hit;
        }
    }

    /// A prefill forward over `items`: allocates their slots, records the batch hit rate and
    /// times it with the cost model.
    fn prefill_forward(
        &mut self,
        items: &[(ReqId, usize)],
        costs: &[PrefillItem],
        new_tokens: usize,
        hit_tokens: usize,
        loaded: usize,
    ) -> ForwardInfo {
        for &(id, u) in items {
            self.allocate(id, u);
        }
        self.last_hit_rate = if new_tokens + hit_tokens == 0 {
            0.0
        } else {
            hit_tokens as f64 / (new_tokens + hit_tokens) as f64
        };
        // Host pages are copied back before (and overlapping) the forward that needs them.
        let ms = self.cost.prefill_ms(costs) + self.cost.host_load_ms(loaded);
        let d = self.cost.jitter(ms, &mut self.rng);
        ForwardInfo {
            kind: ForwardKind::Prefill,
            duration_ms: d,
            batch: items.len(),
            tokens: new_tokens,
        }
    }

    /// A decode forward: one token for every running request, pushed onto `items`.
    fn decode_forward(&mut self, items: &mut Vec<(ReqId, usize)>) -> ForwardInfo {
        let mut ctx = 0;
        for i in 0..self.running.len() {
            let id = self.running[i];
            items.push((id, 1));
            self.allocate(id, 1);
            ctx += self.reqs.get(&id).map_or(0, |r| r.tokens.len());
        }
        let d = self
            .cost
            .jitter(self.cost.decode_ms(items.len(), ctx), &mut self.rng);
        ForwardInfo {
            kind: ForwardKind::Decode,
            duration_ms: d,
            batch: items.len(),
            tokens: items.len(),
        }
    }

    /// Take `n` reserved slots for request `id`'s in-flight forward.
    fn allocate(&mut self, id: ReqId, n: usize) {
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        // Admission reserved these slots, and available tokens never drop below the
        // outstanding reservations (locks only grow at admission, which re-checks), so this
        // cannot fail; if it ever did, the request would be over-committing KV.
        let ok = self.cache.alloc(n);
        debug_assert!(ok, "reserved KV allocation failed");
        if ok {
            r.inflight_alloc += n;
        }
        let take = n.min(r.reserved);
        r.reserved -= take;
        self.reserved -= take;
    }

    /// Finish the planned forward: advance the virtual clock by its duration, apply its effects
    /// (cache insertions, generated tokens, finishes) and append the resulting events.
    pub fn complete(&mut self, events: &mut Vec<Event>) {
        let Some(f) = self.inflight.take() else {
            return;
        };
        self.now_ms += f.duration_ms;
        let now = self.now_ms;
        match f.kind {
            ForwardKind::Prefill => {
                for &(id, u) in &f.items {
                    let Some(r) = self.reqs.get_mut(&id) else {
                        continue;
                    };
                    r.inflight_alloc = 0;
                    r.kv_len += u;
                    let (node, len) = self.cache.cache_prefix_in(
                        &r.ns,
                        &r.tokens[..r.kv_len],
                        r.node,
                        r.locked_len,
                    );
                    r.node = node;
                    r.locked_len = len;
                    if r.kv_len < r.prompt_len {
                        self.chunked = Some(id);
                        continue;
                    }
                    if r.max_new == 0 {
                        self.finish_into(id, FinishReason::Length, events);
                        continue;
                    }
                    if self.emit_token(id, now, events) {
                        self.finish_into(id, FinishReason::Length, events);
                    } else {
                        self.running.push(id);
                    }
                }
            }
            ForwardKind::Decode => {
                let mut done = 0;
                for &(id, _) in &f.items {
                    let Some(r) = self.reqs.get_mut(&id) else {
                        continue;
                    };
                    r.inflight_alloc = 0;
                    r.kv_len += 1;
                    if self.emit_token(id, now, events) {
                        self.finish_into(id, FinishReason::Length, events);
                        done += 1;
                    }
                }
                if done > 0 {
                    let reqs = &self.reqs;
                    self.running.retain(|id| reqs.contains_key(id));
                }
                self.gen_tokens += f.items.len() as u64;
                self.gen_ms += f.duration_ms;
                self.gen_steps += 1;
                if self.gen_steps >= GEN_LOG_INTERVAL {
                    self.gen_throughput = self.gen_tokens as f64 / (self.gen_ms / 1000.0);
                    self.gen_tokens = 0;
                    self.gen_ms = 0.0;
                    self.gen_steps = 0;
                }
            }
        }
        self.items_buf = f.items;
    }

    /// Plan and complete forwards until nothing is left (offline driving for tests/sweeps).
    pub fn run_until_idle(&mut self, events: &mut Vec<Event>) {
        while self.plan().is_some() {
            self.complete(events);
        }
    }

    /// Generate the next token of `id`; returns true when it reached `max_new`.
    fn emit_token(&mut self, id: ReqId, now: f64, events: &mut Vec<Event>) -> bool {
        let Some(r) = self.reqs.get_mut(&id) else {
            return false;
        };
        let token = self.vocab[r.out_rng.below(self.vocab.len())];
        r.tokens.push(token);
        let first = r.first_token_ms.is_none();
        if !r.internal {
            if first {
                self.metrics.ttft.observe((now - r.arrival_ms) / 1000.0);
            } else {
                self.metrics.itl.observe((now - r.last_token_ms) / 1000.0);
            }
        }
        if first {
            r.first_token_ms = Some(now);
        }
        r.last_token_ms = now;
        events.push(Event::Token {
            id,
            token,
            first,
            at_ms: now,
        });
        r.tokens.len() - r.prompt_len >= r.max_new
    }

    fn finish_into(&mut self, id: ReqId, reason: FinishReason, events: &mut Vec<Event>) {
        if let Some(info) = self.finish(id, reason) {
            events.push(Event::Finished { id, info });
        }
    }

    /// Release everything a request holds and account for it.
    fn finish(&mut self, id: ReqId, reason: FinishReason) -> Option<FinishInfo> {
        let r = self.reqs.remove(&id)?;
        if r.admitted {
            self.admitted -= 1;
            self.reserved -= r.reserved;
            let (node, locked) = if reason == FinishReason::Length {
                // (prompt + output)[:-1]: the last token was never fed back, it has no KV.
                let keep = r.kv_len.min(r.tokens.len() - 1);
                self.cache
                    .cache_prefix_in(&r.ns, &r.tokens[..keep], r.node, r.locked_len)
            } else {
                (r.node, r.locked_len)
            };
            if node != ROOT {
                self.cache.dec_lock(node);
            }
            self.cache.free(r.kv_len - locked + r.inflight_alloc);
        }
        let info = FinishInfo {
            prompt_tokens: r.prompt_len,
            completion_tokens: r.tokens.len() - r.prompt_len,
            cached_tokens: r.cached,
            arrival_ms: r.arrival_ms,
            first_token_ms: r.first_token_ms,
            finish_ms: self.now_ms,
            reason,
        };
        if !r.internal {
            let m = &mut self.metrics;
            m.num_requests += 1;
            match reason {
                FinishReason::Length => {
                    m.prompt_tokens += info.prompt_tokens as u64;
                    m.generation_tokens += info.completion_tokens as u64;
                    m.cached_tokens += info.cached_tokens as u64;
                    m.cached_tokens_host += r.cached_host as u64;
                    m.e2e.observe((info.finish_ms - info.arrival_ms) / 1000.0);
                }
                FinishReason::Abort => m.num_aborted += 1,
            }
        }
        Some(info)
    }
}

#[cfg(test)]
mod tests;
