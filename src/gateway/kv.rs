//! Exact routing state from the servers (`--kv-events`): the event thread (`kv::intake`) feeds
//! the token-block index (`kv::index`) through [`IndexSink`], its single writer; the health
//! thread finds each worker's publishers ([`Discovery`]) and keeps the subscriptions in step
//! with the registry; the serving cores read the published snapshot, the workers whose events
//! are complete ("warm"), and the pending entries of what they routed themselves.

use super::Gateway;
use crate::base::WorkerId;
use crate::http::Method;
use crate::kv::endpoint::{KvEndpoints, TcpEndpoint};
use crate::kv::index::{
    namespace_root, ChainMemo, IndexConfig, IndexExport, IndexReader, IndexStats, IndexWriter,
    MatchScratch, Source,
};
use crate::kv::intake::{
    CommandError, EventSink, Intake, IntakeConfig, IntakeEvent, Publisher, ResetReason, SourceState,
};
use crate::proxy::forward;
use crate::proxy::pool::Pool;
use crate::route::extract::Namespace;
use crate::route::pending::PendingBlocks;
use crate::tokenize::{SegmentCache, Tokenizer};
use crate::workers::registry::{Worker, WorkerList};
use arc_swap::ArcSwap;
use bytes::Bytes;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use xxhash_rust::xxh3::xxh3_64;

/// How long a routed prompt counts as cached on its worker before the server's own event
/// confirms it (a prefill of a long prompt under load takes seconds; the entry only raises a
/// worker's match, so a stale one costs at most one imbalanced pick).
pub const PENDING_TTL_MS: u64 = 5_000;

/// Longest prompt hashed into blocks for a match (tokens past it are not matched): 1 Mi tokens.
pub const MAX_MATCH_TOKENS: usize = 1 << 20;

/// What discovery learnt of a worker before subscribing to it: the model its events are filed
/// under, its URL (its name in an index copy), and the page size its server announced.
#[derive(Debug, Clone)]
struct WorkerKv {
    model: Arc<str>,
    url: Arc<str>,
    block_size: Option<u32>,
}

/// Worker → what discovery learnt of it.
type ModelMap = HashMap<WorkerId, WorkerKv>;

/// The KV-event state the cores share.
pub struct KvRouting {
    intake: Intake,
    /// The published index.
    pub reader: IndexReader,
    /// What this copy routed and the servers have not confirmed yet.
    pub pending: PendingBlocks,
    /// Workers every one of whose publishers is live, sorted (republished by the sink): the
    /// index speaks for them, the text tree for the others.
    exact_workers: Arc<ArcSwap<Vec<WorkerId>>>,
    /// Every subscribed publisher's state (republished by the sink), for the per-source gauge.
    source_states: Arc<ArcSwap<Vec<(Source, SourceState)>>>,
    models: Arc<ArcSwap<ModelMap>>,
    /// The index's counters.
    pub stats: Arc<IndexStats>,
    /// Endpoints given by flags, by worker URL.
    flagged: Vec<KvEndpoints>,
    /// `--tokenizer-path`, loaded once: chat and text prompts are measured in tokens.
    tokenizer: Option<Arc<Tokenizer>>,
    /// The helper threads that encode prompts too large for a serving core (with a tokenizer).
    tokenizer_pool: Option<super::tokenizing::TokenizerPool>,
    /// `--kv-host-tier-weight`: what a block held only in host memory counts for against one
    /// on the GPU.
    host_weight: f64,
    /// `--kv-max-dp-ranks`: a worker announcing more publishers is scored by the text tree.
    max_ranks: u32,
    /// The copy from `--kv-bootstrap-peer` was taken (or failed, or none was asked for):
    /// subscriptions wait for it, so the stream resumes after its watermarks.
    bootstrapped: AtomicBool,
    /// Workers subscribed with a replay endpoint, sorted (republished by discovery after each
    /// round): the ones whose start-up replay a new copy waits for.
    replaying: ArcSwap<Vec<WorkerId>>,
    /// Discovery finished a round over the workers registered at that time.
    discovered: AtomicBool,
    /// Until when `/readiness` waits for the subscribed workers to be warm
    /// (`--kv-warm-timeout-secs` after start).
    warm_deadline: Instant,
    /// The start-up wait is over (latched: later replays, gaps or silent publishers never make
    /// a ready copy unready; their workers are scored by the text tree meanwhile).
    warmed: AtomicBool,
    /// An index copy is being made (one at a time).
    exporting: AtomicBool,
}

/// The place of the one index copy being made; freed when dropped.
pub struct ExportGuard<'a>(&'a AtomicBool);

impl Drop for ExportGuard<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// What `--kv-events` is started with (from the flags).
pub struct KvSettings {
    /// Endpoints given by `--kv-events-endpoints` / `--kv-events-replay-endpoints`.
    pub flagged: Vec<KvEndpoints>,
    /// `--kv-bootstrap-peer` is set: subscriptions wait for the sibling's copy.
    pub bootstrap: bool,
    /// `--tokenizer-path`, loaded.
    pub tokenizer: Option<Arc<Tokenizer>>,
    /// `--kv-warm-timeout-secs`.
    pub warm_timeout: Duration,
    /// `--kv-host-tier-weight`.
    pub host_weight: f64,
    /// `--kv-max-dp-ranks`.
    pub max_ranks: u32,
}

impl KvRouting {
    /// Start the event thread with an empty index.
    pub fn start(settings: KvSettings) -> std::io::Result<KvRouting> {
        let KvSettings {
            flagged,
            bootstrap,
            tokenizer,
            warm_timeout,
            host_weight,
            max_ranks,
        } = settings;
        let writer = IndexWriter::new(IndexConfig::default());
        let reader = writer.reader();
        let stats = writer.stats();
        let exact_workers = Arc::new(ArcSwap::from_pointee(Vec::new()));
        let source_states = Arc::new(ArcSwap::from_pointee(Vec::new()));
        let models: Arc<ArcSwap<ModelMap>> = Arc::default();
        let sink = IndexSink {
            writer,
            models: models.clone(),
            states: BTreeMap::new(),
            published_exact: exact_workers.clone(),
            published_states: source_states.clone(),
            dirty: false,
            states_dirty: false,
            export: None,
        };
        let intake = Intake::start(IntakeConfig::default(), sink)?;
        for f in Fallback::ALL {
            crate::metrics::kv_fallback(f.as_str(), 0);
        }
        crate::metrics::kv_measured(0, 0);
        // Half the CPUs: the helpers take what the serving cores leave (they run at a lower
        // priority), and only prompts over the inline size get there.
        let helpers = std::thread::available_parallelism().map_or(1, |n| n.get() / 2);
        let tokenizer_pool = tokenizer
            .as_ref()
            .map(|t| super::tokenizing::TokenizerPool::start(t, helpers));
        Ok(KvRouting {
            intake,
            reader,
            pending: PendingBlocks::new(PENDING_TTL_MS),
            exact_workers,
            source_states,
            models,
            stats,
            flagged,
            tokenizer,
            tokenizer_pool,
            host_weight,
            max_ranks,
            bootstrapped: AtomicBool::new(!bootstrap),
            replaying: ArcSwap::from_pointee(Vec::new()),
            discovered: AtomicBool::new(false),
            warm_deadline: Instant::now() + warm_timeout,
            warmed: AtomicBool::new(false),
            exporting: AtomicBool::new(false),
        })
    }

    /// Whether this copy is still warming up: within `--kv-warm-timeout-secs` of its start,
    /// discovery has not looked at every worker yet, or a worker that `eligible` says may be
    /// routed to, subscribed with a replay endpoint, has not completed its start-up replay (it
    /// would be scored by the text tree, which a new copy has empty). A publisher without a
    /// replay endpoint has nothing to catch up on, so it is not waited for. `/readiness`
    /// answers 503 meanwhile. Once over, the wait never comes back.
    pub fn warming(&self, eligible: impl Fn(WorkerId) -> bool) -> bool {
        if self.warmed.load(Ordering::Acquire) {
            return false;
        }
        let waiting = Instant::now() < self.warm_deadline
            && (!self.discovered.load(Ordering::Acquire) || {
                let warm = self.exact_workers.load();
                self.replaying
                    .load()
                    .iter()
                    .any(|&w| eligible(w) && warm.binary_search(&w).is_err())
            });
        if !waiting {
            self.warmed.store(true, Ordering::Release);
        }
        waiting
    }

    /// Every subscribed publisher's state, for `radixgate_kv_source_state`.
    pub fn source_states(&self) -> arc_swap::Guard<Arc<Vec<(Source, SourceState)>>> {
        self.source_states.load()
    }

    /// The `--kv-bootstrap-peer` copy is in, failed, or was never asked for.
    pub fn is_bootstrapped(&self) -> bool {
        self.bootstrapped.load(Ordering::Acquire)
    }

    /// The tokenizer, when `--tokenizer-path` gave one.
    pub fn tokenizer(&self) -> Option<&Arc<Tokenizer>> {
        self.tokenizer.as_ref()
    }

    /// The tokenizer helper threads, when `--tokenizer-path` gave a tokenizer.
    pub fn tokenizer_pool(&self) -> Option<&super::tokenizing::TokenizerPool> {
        self.tokenizer_pool.as_ref()
    }

    /// Workers whose events are complete, sorted (cheap: one `Arc` load).
    pub fn exact_workers(&self) -> arc_swap::Guard<Arc<Vec<WorkerId>>> {
        self.exact_workers.load()
    }

    /// The index model a request for `model` reads: that name when the index knows it, else
    /// the only model it knows (clients of a one-model fleet send any name, or none).
    pub fn index_model<'s>(
        snapshot: &'s crate::kv::index::Snapshot,
        model: Option<&str>,
    ) -> Option<&'s str> {
        if let Some(m) = model {
            if let Some(found) = snapshot.models().find(|k| *k == m) {
                return Some(found);
            }
        }
        let mut all = snapshot.models();
        let first = all.next()?;
        all.next().is_none().then_some(first)
    }

    /// The LoRA adapter a request's `model` names as SGLang reads it (`base:adapter`): none
    /// when it is a model the index knows by that exact name, the rest after a known model's
    /// name and a colon, else the rest after the first colon.
    pub fn model_adapter<'m>(
        snapshot: &crate::kv::index::Snapshot,
        model: Option<&'m str>,
    ) -> Option<&'m str> {
        let m = model?;
        if !m.contains(':') || snapshot.models().any(|k| k == m) {
            return None;
        }
        let rest = snapshot
            .models()
            .find_map(|k| m.strip_prefix(k)?.strip_prefix(':'))
            .or_else(|| m.split_once(':').map(|(_, a)| a))?;
        Some(rest.trim()).filter(|a| !a.is_empty())
    }

    /// Ask the event thread for a copy of the index (`GET /kv_index/snapshot`): one at a time
    /// (`None` while another is being made; the guard frees the place when dropped).
    pub fn export(
        &self,
    ) -> Option<Result<(ExportGuard<'_>, crate::kv::intake::ExportAnswer), CommandError>> {
        if self.exporting.swap(true, Ordering::AcqRel) {
            return None;
        }
        let guard = ExportGuard(&self.exporting);
        Some(self.intake.export().map(|rx| (guard, rx)))
    }

    /// The intake's counters.
    pub fn intake_counts(&self) -> crate::kv::intake::IntakeCounts {
        self.intake.counts()
    }

    fn set_model(&self, worker: WorkerId, model: Option<WorkerKv>) {
        let mut next = self.models.load().as_ref().clone();
        match model {
            Some(m) => next.insert(worker, m),
            None => next.remove(&worker),
        };
        self.models.store(Arc::new(next));
    }
}

/// Largest index copy accepted from a sibling: a full index (4 Mi blocks at about 18 bytes
/// each, ~72 MiB) fits three times over; the download is held once, then read in place.
const MAX_BOOTSTRAP_BYTES: usize = 256 << 20;
/// Time allowed for downloading and applying a sibling's copy.
const BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(60);

/// With `--kv-bootstrap-peer`: a helper thread downloads the sibling's index and hands it to the
/// event thread before any subscription (the health thread's discovery waits for it). Any
/// failure is logged and the copy starts cold (the start-up replays still run).
pub fn spawn_bootstrap(gw: Arc<Gateway>) {
    let (Some(kv), Some(peer)) = (&gw.kv, gw.cfg.kv_bootstrap_peer.clone()) else {
        return;
    };
    if kv.bootstrapped.load(Ordering::Acquire) {
        return;
    }
    let gw2 = gw.clone();
    let spawned = std::thread::Builder::new()
        .name("radixgate-kv-bootstrap".into())
        .spawn(move || {
            let Some(kv) = &gw2.kv else { return };
            match bootstrap(&gw2, kv, &peer) {
                Ok(n) => crate::log!(
                    Info,
                    "kv events: copied the block index of {peer} ({n} publishers)"
                ),
                Err(e) => crate::log!(
                    Warn,
                    "kv events: no index copied from {peer} ({e}); starting from the servers' \
                     replay buffers"
                ),
            }
            kv.bootstrapped.store(true, Ordering::Release);
        });
    if let Err(e) = spawned {
        crate::log!(Warn, "kv events: cannot start the bootstrap thread: {e}");
        kv.bootstrapped.store(true, Ordering::Release);
    }
}

fn bootstrap(gw: &Gateway, kv: &KvRouting, peer: &str) -> Result<usize, String> {
    let (status, body) = crate::proxy::blocking::get(
        peer,
        "/kv_index/snapshot",
        gw.cfg.admin_api_key.as_deref(),
        MAX_BOOTSTRAP_BYTES,
        BOOTSTRAP_TIMEOUT,
    )?;
    if status != 200 {
        return Err(format!(
            "GET /kv_index/snapshot answered {status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        ));
    }
    let workers: Vec<(String, WorkerId)> = gw
        .registry
        .load()
        .workers
        .iter()
        .map(|w| (w.url.clone(), w.id))
        .collect();
    let rx = kv
        .intake
        .import(body, workers)
        .map_err(|e| format!("event thread {e:?}"))?;
    rx.recv_timeout(BOOTSTRAP_TIMEOUT)
        .map_err(|e| format!("event thread: {e}"))?
}

/// One core's buffers for measuring prompts against the index: reused request after request,
/// so a match allocates nothing once they have grown.
#[derive(Debug, Default)]
pub struct KvScratch {
    /// The prompt's block chain at the model's block size (see [`KvScratch::chain`]), with
    /// this core's recent prompts to take a shared prefix's chain from.
    memo: ChainMemo,
    /// Tokens of the prompt cached per worker (index ∪ pending).
    pub cached: Vec<(WorkerId, usize)>,
    /// The index model (hashed) the prompt was measured against.
    pub model_hash: u64,
    /// That model's block size.
    pub block_size: usize,
    /// This core's cache of token ids per prompt piece (created on first use).
    pub segments: Option<SegmentCache>,
    /// The winning workers of a decision (see `ExactInput::holders`).
    pub holders: std::cell::RefCell<Vec<WorkerId>>,
    buf: Vec<u8>,
    matches: MatchScratch,
    /// Pending entries' blocks per worker, before they join `cached`.
    pending: Vec<(WorkerId, usize)>,
}

/// Why a prompt was routed by the text tree although `--kv-events` is on (the label of
/// `radixgate_kv_fallback_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// No `--tokenizer-path`, and the request carries no token ids.
    NoTokenizer,
    /// The tokenizer refused the request (too large, no chat template, template error).
    Tokenize,
    /// `input_ids` that are not all integers below 2^32.
    BadTokenIds,
    /// The model has no events yet (block size unknown), or the index knows no such model.
    NoIndex,
    /// An API whose prompt the servers do not prefill into their prefix cache the same way
    /// (embeddings, rerank).
    OtherApi,
    /// A request with an `extra_key`: SGLang keeps its blocks apart, but its events do not say
    /// which blocks were stored under which key.
    Namespace,
    /// The prompt was not encoded within its time budget (see `gateway::tokenizing`).
    TokenizeBudget,
    /// The tokenizer helpers had no room for the prompt (this core's share, or their queue).
    TokenizerBusy,
}

impl Fallback {
    /// Every reason, for series that exist from the start.
    pub const ALL: [Fallback; 8] = [
        Fallback::NoTokenizer,
        Fallback::Tokenize,
        Fallback::BadTokenIds,
        Fallback::NoIndex,
        Fallback::OtherApi,
        Fallback::Namespace,
        Fallback::TokenizeBudget,
        Fallback::TokenizerBusy,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Fallback::NoTokenizer => "no_tokenizer",
            Fallback::Tokenize => "tokenize_error",
            Fallback::BadTokenIds => "bad_token_ids",
            Fallback::NoIndex => "no_index",
            Fallback::OtherApi => "other_api",
            Fallback::Namespace => "namespace",
            Fallback::TokenizeBudget => "tokenize_budget",
            Fallback::TokenizerBusy => "tokenizer_busy",
        }
    }
}

/// `/generate`'s `input_ids` as the extractor wrote them (decimals joined by spaces) into
/// `out`. The extractor caps its text, so when `text` is at the cap its last number may be cut:
/// it is dropped.
pub fn parse_token_ids(text: &str, capped_at: usize, out: &mut Vec<u32>) -> Result<(), Fallback> {
    out.clear();
    // One pass over the bytes (a 4k-token prompt is ~24 KB of decimals): `str::parse` per
    // split word cost ~35 µs of a request.
    let mut id: u64 = 0;
    let mut digits = false;
    for &b in text.as_bytes() {
        match b {
            b'0'..=b'9' => {
                id = id * 10 + u64::from(b - b'0');
                if id > u64::from(u32::MAX) {
                    return Err(Fallback::BadTokenIds);
                }
                digits = true;
            }
            b if b.is_ascii_whitespace() => {
                if digits {
                    out.push(id as u32);
                }
                (id, digits) = (0, false);
            }
            _ => return Err(Fallback::BadTokenIds),
        }
    }
    if digits {
        out.push(id as u32);
    }
    if text.len() + 24 >= capped_at {
        out.pop();
    }
    Ok(())
}

/// Token ids a core's segment cache keeps (about 4 MiB of ids plus ~40 bytes a piece): the
/// histories of a few thousand live conversations.
pub const SEGMENT_CACHE_TOKENS: usize = 1 << 20;

impl KvScratch {
    /// The measured prompt's block chain (empty when it was not measured).
    pub fn chain(&self) -> &[u64] {
        self.memo.chain()
    }

    /// Whether `worker` already holds every whole block of the measured prompt (by the index
    /// or a pending entry): routing it there predicts nothing new.
    pub fn holds_all(&self, worker: WorkerId) -> bool {
        let whole = self.chain().len() * self.block_size;
        self.cached.iter().any(|&(w, n)| w == worker && n >= whole)
    }
}

impl KvRouting {
    /// Measure the prompt `tokens` for a request naming `model` in cache namespace `ns`:
    /// its block chain (from the namespace's root), and per worker the tokens of its prefix the
    /// index and the pending entries put there, a block held only in host memory counting
    /// `--kv-host-tier-weight` of one on the GPU. Returns the prompt's token count, or why the
    /// text tree must decide instead.
    pub fn measure(
        &self,
        model: Option<&str>,
        ns: &Namespace<'_>,
        tokens: &[u32],
        s: &mut KvScratch,
        now_ms: u64,
    ) -> Result<usize, Fallback> {
        // Until this prompt's chain is computed, there is none (not the previous prompt's).
        s.memo.forget_current();
        if ns.extra_key.is_some() {
            return Err(Fallback::Namespace);
        }
        let snap = self.reader.load();
        let m = Self::index_model(&snap, model).ok_or(Fallback::NoIndex)?;
        let bs = snap.block_size(m).ok_or(Fallback::NoIndex)?;
        let adapter = ns
            .lora_path
            .as_deref()
            .or_else(|| Self::model_adapter(&snap, model));
        let root = namespace_root(ns.cache_salt.as_deref(), adapter);
        let KvScratch {
            memo,
            cached,
            model_hash,
            block_size,
            buf,
            matches,
            pending,
            ..
        } = s;
        *block_size = bs;
        memo.compute(tokens, bs, root, MAX_MATCH_TOKENS / bs, buf);
        let chain = memo.chain();
        cached.clear();
        for pm in snap.match_chain(m, chain, matches) {
            // In tokens: the GPU's blocks whole, the ones only in host memory weighted.
            let host_only = f64::from(pm.with_host - pm.blocks) * self.host_weight;
            let n = ((f64::from(pm.blocks) + host_only) * bs as f64).round() as usize;
            match cached.iter_mut().find(|(w, _)| *w == pm.source.worker) {
                Some((_, b)) => *b = (*b).max(n),
                None => cached.push((pm.source.worker, n)),
            }
        }
        *model_hash = xxh3_64(m.as_bytes());
        // Pending entries are prompts routed and not confirmed yet: counted as GPU blocks.
        pending.clear();
        self.pending.raise(*model_hash, chain, now_ms, pending);
        for &(w, blocks) in pending.iter() {
            let n = blocks * bs;
            match cached.iter_mut().find(|(x, _)| *x == w) {
                Some((_, b)) => *b = (*b).max(n),
                None => cached.push((w, n)),
            }
        }
        cached.retain(|&(_, n)| n > 0);
        Ok(tokens.len())
    }
}

/// The index's single writer, on the event thread: applies batches and resets, keeps each
/// publisher's state, and publishes once per round of the thread.
struct IndexSink {
    writer: IndexWriter,
    models: Arc<ArcSwap<ModelMap>>,
    states: BTreeMap<Source, SourceState>,
    published_exact: Arc<ArcSwap<Vec<WorkerId>>>,
    published_states: Arc<ArcSwap<Vec<(Source, SourceState)>>>,
    dirty: bool,
    states_dirty: bool,
    /// The export under way (`GET /kv_index/snapshot`), a source at a time.
    export: Option<IndexExport>,
}

impl EventSink for IndexSink {
    fn deliver(&mut self, event: IntakeEvent) {
        match event {
            IntakeEvent::Batch(b) => {
                let models = self.models.load();
                let Some(wk) = models.get(&b.key.worker) else {
                    return; // Unsubscribed meanwhile.
                };
                let model = &wk.model;
                if let Some(bs) = wk.block_size {
                    // The server's own page size: a store of another size is not believed.
                    self.writer.announce_block_size(b.key, bs as usize);
                }
                for e in &b.events {
                    // Drops are counted by the writer (radixgate_kv_index_dropped_total).
                    let _ = self.writer.apply(model, b.key, e);
                }
                self.dirty = true;
            }
            IntakeEvent::State { key, state } => {
                self.states_dirty |= self.states.insert(key, state) != Some(state);
            }
            IntakeEvent::Reset { key, reason } => {
                match reason {
                    ResetReason::Unsubscribed => {
                        self.writer.remove_source(key);
                        self.states_dirty |= self.states.remove(&key).is_some();
                    }
                    // The index now holds less than the server (or exactly a new process's
                    // empty cache); the stream goes on from here.
                    ResetReason::Restarted | ResetReason::Gap | ResetReason::Unreadable => {
                        self.writer.reset_source(key)
                    }
                }
                self.dirty = true;
            }
        }
    }

    fn export_begin(&mut self) -> Option<Vec<Source>> {
        self.export = Some(IndexExport::default());
        Some(self.writer.export_sources())
    }

    fn export_source(&mut self, key: Source, watermark: Option<i64>) {
        let models = self.models.load();
        // Only workers this copy names by URL (a worker being removed has none any more).
        let (Some(out), Some(wk)) = (self.export.as_mut(), models.get(&key.worker)) else {
            return;
        };
        self.writer
            .export_source(key, wk.url.to_string(), watermark, out);
    }

    fn export_finish(&mut self, reply: crate::kv::intake::ExportReply) {
        let Some(copy) = self.export.take() else {
            let _ = reply.try_send(None);
            return;
        };
        // Encoding costs ~15× taking the copy: off the event thread.
        let spawned = std::thread::Builder::new()
            .name("radixgate-kv-export".into())
            .spawn({
                let reply = reply.clone();
                move || {
                    let _ = reply.try_send(Some(copy.encode()));
                }
            });
        if spawned.is_err() {
            let _ = reply.try_send(None);
        }
    }

    fn import(
        &mut self,
        data: &[u8],
        workers: &[(String, WorkerId)],
    ) -> Result<Vec<(Source, i64)>, String> {
        let summary = self
            .writer
            .import(data, |url| {
                workers.iter().find(|(u, _)| u == url).map(|&(_, id)| id)
            })
            .map_err(|e| e.to_string())?;
        self.dirty = true;
        if summary.unknown > 0 || summary.refused > 0 {
            crate::log!(
                Info,
                "kv events: index copy: {} publishers of unknown workers skipped, {} refused",
                summary.unknown,
                summary.refused
            );
        }
        Ok(summary
            .sources
            .iter()
            .filter_map(|s| Some((s.source, s.watermark?)))
            .collect())
    }

    fn flush(&mut self) {
        if self.dirty {
            self.writer.publish();
            self.dirty = false;
        }
        if self.states_dirty {
            self.published_exact
                .store(Arc::new(exact_workers(&self.states)));
            self.published_states.store(Arc::new(
                self.states.iter().map(|(k, v)| (*k, *v)).collect(),
            ));
            self.states_dirty = false;
        }
    }
}

/// Workers every one of whose publishers is live, sorted (`states` is sorted by worker).
fn exact_workers(states: &BTreeMap<Source, SourceState>) -> Vec<WorkerId> {
    let mut out: Vec<WorkerId> = Vec::new();
    let mut spoilt: Option<WorkerId> = None;
    for (source, state) in states {
        let w = source.worker;
        if *state != SourceState::Live {
            spoilt = Some(w);
            if out.last() == Some(&w) {
                out.pop();
            }
        } else if spoilt != Some(w) && out.last() != Some(&w) {
            out.push(w);
        }
    }
    out
}

/// What a worker's `/get_server_info` says about its events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerKvInfo {
    /// The model its events are about (`served_model_name`, else `model_path`).
    pub model: Option<String>,
    /// The rank-0 publisher, on the worker's own host (None: events off).
    pub live: Option<TcpEndpoint>,
    /// The rank-0 replay socket, on the worker's own host.
    pub replay: Option<TcpEndpoint>,
    /// Publishers (DP ranks), each on port + rank.
    pub ranks: u32,
    /// The block size the server hashes its events at (its page size), when it says.
    pub block_size: Option<u32>,
}

/// Read `/get_server_info`. SGLang 0.5.23 describes its publisher under `kv_events`
/// (`endpoint_port_base`, `replay_endpoint_port_base`, `dp_size` publishers, `block_size`);
/// older servers only echo their `kv_events_config` argument (a JSON string, or an object),
/// with one publisher per attention-DP rank. Endpoints other than `tcp://` (ipc, inproc)
/// cannot be reached from another host and count as "no events". Whatever host a server names,
/// its publishers are dialled on the worker's own host: a worker cannot point the gateway's
/// connections elsewhere (only `--kv-events-endpoints` can).
pub fn parse_server_info(body: &[u8], worker_url: &str) -> Result<ServerKvInfo, String> {
    let v: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("server info is not JSON: {e}"))?;
    let model = ["served_model_name", "model_path"]
        .iter()
        .find_map(|k| v.get(*k)?.as_str().filter(|s| !s.is_empty()))
        .map(str::to_owned);
    let host = crate::kv::endpoint::url_host(worker_url)
        .ok_or_else(|| format!("worker URL {worker_url} has no host"))?;
    let at = |port: u16| TcpEndpoint {
        host: host.to_string(),
        port,
    };
    let port_of = |d: &serde_json::Value, k: &str| -> Result<Option<u16>, String> {
        match d.get(k) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(p) => p
                .as_u64()
                .and_then(|p| u16::try_from(p).ok())
                .filter(|&p| p > 0)
                .map(Some)
                .ok_or_else(|| format!("kv_events.{k} is not a port")),
        }
    };
    if let Some(d) = v.get("kv_events").filter(|d| d.is_object()) {
        let zmq = d.get("publisher").and_then(|p| p.as_str()) == Some("zmq");
        let live = if zmq {
            port_of(d, "endpoint_port_base")?.map(at)
        } else {
            None
        };
        let replay = match live {
            Some(_) => port_of(d, "replay_endpoint_port_base")?.map(at),
            None => None,
        };
        let ranks = d
            .get("dp_size")
            .and_then(|n| n.as_u64())
            .unwrap_or(1)
            .max(1);
        let block_size = d
            .get("block_size")
            .and_then(|b| b.as_u64())
            .and_then(|b| u32::try_from(b).ok())
            .filter(|&b| b > 0);
        return Ok(ServerKvInfo {
            model,
            live,
            replay,
            ranks: u32::try_from(ranks).unwrap_or(u32::MAX),
            block_size,
        });
    }
    let dp_attention = v
        .get("enable_dp_attention")
        .and_then(|b| b.as_bool())
        .unwrap_or(false);
    let dp_size = v.get("dp_size").and_then(|d| d.as_u64()).unwrap_or(1);
    let ranks = if dp_attention {
        u32::try_from(dp_size.max(1)).unwrap_or(u32::MAX)
    } else {
        1
    };
    let cfg = match v.get("kv_events_config") {
        Some(serde_json::Value::String(s)) => serde_json::from_str::<serde_json::Value>(s)
            .map_err(|e| format!("kv_events_config is not JSON: {e}"))?,
        Some(o @ serde_json::Value::Object(_)) => o.clone(),
        _ => serde_json::Value::Null,
    };
    let publisher = cfg.get("publisher").and_then(|p| p.as_str()).unwrap_or("");
    let endpoint = |k: &str| -> Result<Option<TcpEndpoint>, String> {
        match cfg.get(k).and_then(|e| e.as_str()) {
            Some(e) if e.starts_with("tcp://") => Ok(Some(at(TcpEndpoint::parse(e)?.port))),
            _ => Ok(None),
        }
    };
    let (live, replay) = if publisher == "zmq" {
        let live = endpoint("endpoint")?;
        let replay = if live.is_some() {
            endpoint("replay_endpoint")?
        } else {
            None
        };
        (live, replay)
    } else {
        (None, None)
    };
    let block_size = v
        .get("page_size")
        .and_then(|b| b.as_u64())
        .and_then(|b| u32::try_from(b).ok())
        .filter(|&b| b > 0);
    Ok(ServerKvInfo {
        model,
        live,
        replay,
        ranks,
        block_size,
    })
}

/// Per worker (by serial): subscribed, or when to try again.
#[derive(Debug)]
enum Found {
    /// `replay`: with a replay endpoint (its start-up replay is waited for).
    Subscribed {
        id: WorkerId,
        replay: bool,
    },
    Retry {
        at: Instant,
        attempts: u32,
    },
}

/// Keeps the subscriptions in step with the registry; runs on the health thread each tick.
#[derive(Debug, Default)]
pub struct Discovery {
    found: HashMap<u64, Found>,
}

/// Longest wait between attempts to read a worker's publishers.
const RETRY_MAX: Duration = Duration::from_secs(5);
/// Time allowed for `/get_server_info`.
const INFO_TIMEOUT: Duration = Duration::from_secs(5);

impl Discovery {
    /// One round: drop the publishers of workers gone from `list`, find those of new ones.
    pub async fn round(&mut self, gw: &Gateway, kv: &KvRouting, pool: &Pool, list: &WorkerList) {
        if !kv.bootstrapped.load(Ordering::Acquire) {
            return; // Subscriptions resume after the sibling's watermarks: wait for its copy.
        }
        let gone: Vec<(u64, WorkerId)> = self
            .found
            .iter()
            .filter(|(serial, _)| !list.workers.iter().any(|w| w.serial == **serial))
            .filter_map(|(s, f)| match f {
                Found::Subscribed { id, .. } => Some((*s, *id)),
                Found::Retry { .. } => None,
            })
            .collect();
        for (serial, id) in gone {
            match kv.intake.remove_worker(id) {
                Ok(()) | Err(CommandError::Stopped) => {
                    kv.set_model(id, None);
                    kv.pending.forget_worker(id);
                    self.found.remove(&serial);
                }
                Err(CommandError::Busy) => {} // Next round.
            }
        }
        self.found.retain(|serial, f| {
            matches!(f, Found::Subscribed { .. })
                || list.workers.iter().any(|w| w.serial == *serial)
        });
        let now = Instant::now();
        for w in &list.workers {
            let due = match self.found.get(&w.serial) {
                None => true,
                Some(Found::Retry { at, .. }) => *at <= now,
                Some(Found::Subscribed { .. }) => false,
            };
            if !due {
                continue;
            }
            let outcome = self.discover(gw, kv, pool, w).await;
            let attempts = match self.found.get(&w.serial) {
                Some(Found::Retry { attempts, .. }) => *attempts + 1,
                _ => 1,
            };
            match outcome {
                Ok(replay) => {
                    self.found
                        .insert(w.serial, Found::Subscribed { id: w.id, replay });
                }
                Err(why) => {
                    if attempts == 1 || attempts % 12 == 0 {
                        crate::log!(Warn, "kv events: worker {}: {why}", w.url);
                    }
                    let wait = Duration::from_secs(u64::from(attempts)).min(RETRY_MAX);
                    self.found.insert(
                        w.serial,
                        Found::Retry {
                            at: now + wait,
                            attempts,
                        },
                    );
                }
            }
        }
        let mut replaying: Vec<WorkerId> = self
            .found
            .values()
            .filter_map(|f| match f {
                Found::Subscribed { id, replay: true } => Some(*id),
                _ => None,
            })
            .collect();
        replaying.sort_unstable();
        replaying.dedup();
        if **kv.replaying.load() != replaying {
            kv.replaying.store(Arc::new(replaying));
        }
        kv.discovered.store(true, Ordering::Release);
    }

    /// Find `w`'s publishers (flags first, else its `/get_server_info`) and subscribe. Returns
    /// whether they have a replay endpoint.
    async fn discover(
        &self,
        gw: &Gateway,
        kv: &KvRouting,
        pool: &Pool,
        w: &Arc<Worker>,
    ) -> Result<bool, String> {
        let info = forward::fetch(
            pool,
            w,
            Method::Get,
            "/get_server_info",
            Bytes::new(),
            INFO_TIMEOUT,
        )
        .await;
        let info = match info {
            Ok((200, body)) => parse_server_info(&body, &w.server_url),
            Ok((status, _)) => Err(format!("/get_server_info answered {status}")),
            Err(e) => Err(format!("/get_server_info: {e:?}")),
        };
        let flagged = kv.flagged.iter().find(|f| f.worker_url == w.server_url);
        let (live, replay, ranks, model, block_size) = match (flagged, info) {
            (Some(f), Ok(i)) => (
                f.live.clone(),
                f.replay.clone(),
                i.ranks,
                i.model,
                i.block_size,
            ),
            // Flags need nothing from the server but its model (one rank, the served model).
            (Some(f), Err(_)) => {
                let served = gw.models_of(w.id);
                if served.is_none() {
                    return Err("waiting for the worker's model name".into());
                }
                (f.live.clone(), f.replay.clone(), 1, served, None)
            }
            (None, Ok(i)) => match i.live {
                Some(live) => (live, i.replay, i.ranks, i.model, i.block_size),
                None => {
                    return Err(
                        "publishes no KV events (no zmq tcp endpoint in kv_events_config); \
                         scored by the text tree"
                            .into(),
                    )
                }
            },
            (None, Err(e)) => {
                kv.intake.count_discovery_failed();
                return Err(e);
            }
        };
        if ranks > kv.max_ranks {
            kv.intake.count_refused();
            return Err(format!(
                "announces {ranks} KV-event publishers (DP ranks), over --kv-max-dp-ranks {}; \
                 scored by the text tree",
                kv.max_ranks
            ));
        }
        let model: Arc<str> = Arc::from(model.unwrap_or_else(|| "default".into()).as_str());
        kv.set_model(
            w.id,
            Some(WorkerKv {
                model,
                url: Arc::from(w.url.as_str()),
                block_size,
            }),
        );
        let has_replay = replay.is_some();
        let endpoints = KvEndpoints {
            worker_url: w.server_url.clone(),
            live,
            replay,
        };
        // With `--dp-aware` each rank is a routing target of its own: it subscribes to its own
        // rank's publisher only, so the index's holders are (worker, rank) targets.
        let mine = match w.dp {
            None => 0..ranks,
            Some(d) if d.rank < ranks => d.rank..d.rank + 1,
            Some(d) => {
                kv.intake.count_refused();
                return Err(format!(
                    "DP rank {} has no publisher of its own (the server reports {ranks}); \
                     scored by the text tree",
                    d.rank
                ));
            }
        };
        // Every rank's ports first: a worker is subscribed whole or not at all (never some
        // ranks, then an error retried for ever).
        let mut sockets = Vec::with_capacity(mine.len());
        for rank in mine {
            match endpoints.for_rank(rank) {
                Ok(s) => sockets.push((rank, s)),
                Err(e) => {
                    kv.intake.count_refused();
                    return Err(format!("{e}; scored by the text tree"));
                }
            }
        }
        for (rank, (live, replay)) in sockets {
            let publisher = Publisher {
                key: Source {
                    worker: w.id,
                    dp_rank: rank,
                },
                live,
                replay,
            };
            kv.intake
                .subscribe(publisher)
                .map_err(|e| format!("event thread {e:?}"))?;
        }
        Ok(has_replay)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_name_can_carry_an_adapter_as_sglang_reads_it() {
        let mut w = IndexWriter::new(IndexConfig::default());
        let store = crate::kv::wire::KvEvent::BlockStored(crate::kv::wire::BlockStored {
            block_hashes: vec![crate::kv::wire::EngineHash(1)],
            parent: None,
            token_ids: vec![1],
            block_size: 1,
            lora_id: None,
            medium: None,
            cache_salt: None,
            lora_name: None,
        });
        for (i, m) in ["base", "org/model:v2"].iter().enumerate() {
            let source = Source {
                worker: i as WorkerId,
                dp_rank: 0,
            };
            w.apply(m, source, &store).unwrap();
        }
        w.publish();
        let snap = w.reader().load();
        let adapter = |m| KvRouting::model_adapter(&snap, m);
        assert_eq!(adapter(None), None);
        assert_eq!(adapter(Some("base")), None);
        assert_eq!(adapter(Some("base:sql")), Some("sql"));
        assert_eq!(
            adapter(Some("org/model:v2")),
            None,
            "a served name with a colon"
        );
        assert_eq!(adapter(Some("org/model:v2:sql")), Some("sql"));
        assert_eq!(adapter(Some("unknown:x")), Some("x"));
        assert_eq!(adapter(Some("base:")), None);
    }

    #[test]
    fn a_worker_is_exact_only_while_every_rank_is_live() {
        let k = |worker, dp_rank| Source { worker, dp_rank };
        let states: BTreeMap<Source, SourceState> = [
            (k(1, 0), SourceState::Live),
            (k(1, 1), SourceState::Live),
            (k(2, 0), SourceState::Live),
            (k(2, 1), SourceState::Replaying),
            (k(3, 0), SourceState::Partial),
            (k(3, 1), SourceState::Live),
            (k(4, 0), SourceState::Connecting),
            (k(5, 0), SourceState::Live),
        ]
        .into_iter()
        .collect();
        assert_eq!(exact_workers(&states), vec![1, 5]);
    }

    #[test]
    fn token_ids_from_the_extracted_text() {
        let mut out = Vec::new();
        parse_token_ids("1 20 300", 1000, &mut out).unwrap();
        assert_eq!(out, [1, 20, 300]);
        // At the cap the last number may be cut: dropped.
        parse_token_ids("1 20 30", 30, &mut out).unwrap();
        assert_eq!(out, [1, 20]);
        assert_eq!(
            parse_token_ids("1 -2", 1000, &mut out),
            Err(Fallback::BadTokenIds)
        );
        assert_eq!(
            parse_token_ids("1 99999999999", 1000, &mut out),
            Err(Fallback::BadTokenIds)
        );
        parse_token_ids("4294967295  0\n7 ", 1000, &mut out).unwrap();
        assert_eq!(out, [u32::MAX, 0, 7]);
        for bad in ["4294967296", "1.5", "1 +2", "x", "1e3"] {
            assert_eq!(
                parse_token_ids(bad, 1000, &mut out),
                Err(Fallback::BadTokenIds),
                "{bad}"
            );
        }
        parse_token_ids("", 1000, &mut out).unwrap();
        assert!(out.is_empty());
    }

    #[test]
    fn server_info_as_sglang_reports_it() {
        let body = br#"{"served_model_name":"m","dp_size":2,"enable_dp_attention":true,
            "kv_events_config":"{\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5557\",\"replay_endpoint\":\"tcp://*:5558\"}"}"#;
        let i = parse_server_info(body, "http://10.0.0.7:30000").unwrap();
        assert_eq!(i.model.as_deref(), Some("m"));
        assert_eq!(i.ranks, 2);
        assert_eq!(i.live.unwrap().url(), "tcp://10.0.0.7:5557");
        assert_eq!(i.replay.unwrap().url(), "tcp://10.0.0.7:5558");
        // A host the server names is not where the gateway dials: the worker's own host is.
        let body = br#"{"page_size":16,"kv_events_config":{"publisher":"zmq",
            "endpoint":"tcp://169.254.169.254:5557","replay_endpoint":"tcp://evil.example:5558"}}"#;
        let i = parse_server_info(body, "http://gpu-3:30000").unwrap();
        assert_eq!(i.live.unwrap().url(), "tcp://gpu-3:5557");
        assert_eq!(i.replay.unwrap().url(), "tcp://gpu-3:5558");
        assert_eq!(i.block_size, Some(16));
    }

    #[test]
    fn server_info_as_sglang_0_5_23_describes_its_publisher() {
        // `describe_kv_events_publisher`: a wildcard host, port bases, dp_size publishers (pure
        // DP included), the block size.
        let body = br#"{"served_model_name":"m","dp_size":4,"enable_dp_attention":false,
            "kv_events_config":"{\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:6000\"}",
            "kv_events":{"publisher":"zmq","endpoint_host":"*","endpoint_port_base":5557,
            "topic":"","block_size":32,"dp_size":4,"replay_endpoint_port_base":5600}}"#;
        let i = parse_server_info(body, "http://[fd00::7]:30000").unwrap();
        assert_eq!(i.ranks, 4);
        assert_eq!(i.block_size, Some(32));
        assert_eq!(
            i.live.unwrap().url(),
            "tcp://[fd00::7]:5557",
            "the descriptor wins"
        );
        assert_eq!(i.replay.unwrap().url(), "tcp://[fd00::7]:5600");
        // No replay port: none; publishing off: nothing.
        let body = br#"{"kv_events":{"publisher":"zmq","endpoint_port_base":5557,"dp_size":1}}"#;
        let i = parse_server_info(body, "http://h:1").unwrap();
        assert_eq!(
            (i.live.is_some(), i.replay, i.block_size),
            (true, None, None)
        );
        let i = parse_server_info(br#"{"kv_events":null}"#, "http://h:1").unwrap();
        assert_eq!(i.live, None);
        assert!(parse_server_info(
            br#"{"kv_events":{"publisher":"zmq","endpoint_port_base":70000}}"#,
            "http://h:1"
        )
        .is_err());
    }

    #[test]
    fn server_info_without_events_or_with_unreachable_endpoints() {
        for body in [
            &br#"{"model_path":"p","kv_events_config":null}"#[..],
            br#"{"kv_events_config":"{\"publisher\":\"null\"}"}"#,
            br#"{"kv_events_config":{"publisher":"zmq","endpoint":"ipc:///tmp/x"}}"#,
            br#"{}"#,
        ] {
            let i = parse_server_info(body, "http://h:1").unwrap();
            assert_eq!(i.live, None, "{}", String::from_utf8_lossy(body));
            assert_eq!(i.ranks, 1);
        }
        let i = parse_server_info(br#"{"model_path":"p","dp_size":4}"#, "http://h:1").unwrap();
        assert_eq!(i.model.as_deref(), Some("p"));
        assert_eq!(i.ranks, 1, "DP without DP attention: one publisher");
        assert!(parse_server_info(b"not json", "http://h:1").is_err());
        assert!(parse_server_info(br#"{"kv_events_config":"{"}"#, "http://h:1").is_err());
    }
}
