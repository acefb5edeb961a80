//! The gateway's side of routing by KV events (`--kv-events`): the state the cores route on,
//! kept beside the rest of the shared state. The KV subsystem itself (wire, sockets, the event
//! thread, the index) is `crate::kv`, a layer below, and knows nothing of the gateway.
//!
//! The event thread (`kv::intake`) feeds the token-block index (`kv::index`) through
//! [`IndexSink`], its single writer; the health thread finds each worker's publishers
//! ([`Discovery`]) and keeps the subscriptions in step with the registry; the serving cores read
//! the published snapshot, the workers whose events are complete ("warm"), and the pending
//! entries of what they routed themselves.

mod bootstrap;
mod discovery;
mod measure;
mod sink;
mod sources;

use sink::IndexSink;

pub use bootstrap::spawn_bootstrap;
pub use discovery::{parse_server_info, Discovery, ServerInfoError, ServerKvInfo};
pub use measure::{parse_token_ids, Fallback, KvScratch, SEGMENT_CACHE_TOKENS};
pub use sources::{parse_kv_event_sources, RankPublisher};

use crate::base::WorkerId;
use crate::kv::endpoint::KvEndpoints;
use crate::kv::index::{IndexConfig, IndexReader, IndexStats, IndexWriter, Source};
use crate::kv::intake::{CommandError, Intake, IntakeConfig, SourceState};
use crate::route::pending::PendingBlocks;
use crate::tokenize::Tokenizer;
use arc_swap::ArcSwap;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// Publishers whose stores the index refuses for its limits (republished by the sink):
    /// their workers are scored by the text tree, and `/readiness` counts them.
    refused_sources: Arc<ArcSwap<Vec<Source>>>,
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
    /// Workers whose publishers are not found yet for a reason that may clear within moments
    /// (no answer yet, the model not learnt yet), sorted (republished by discovery after each
    /// round): a new copy waits for them too.
    undiscovered: ArcSwap<Vec<WorkerId>>,
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
    /// The intake's settings (`--kv-send-timeout-secs`, `--kv-event-threads`,
    /// `--kv-queue-mib`, `--kv-max-staleness-ms`).
    pub intake: IntakeConfig,
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
            intake,
        } = settings;
        let writer = IndexWriter::new(IndexConfig::default());
        let reader = writer.reader();
        let stats = writer.stats();
        let exact_workers = Arc::new(ArcSwap::from_pointee(Vec::new()));
        let source_states = Arc::new(ArcSwap::from_pointee(Vec::new()));
        let refused_sources = Arc::new(ArcSwap::from_pointee(Vec::new()));
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
            refused: std::collections::BTreeSet::new(),
            published_refused: refused_sources.clone(),
        };
        let intake = Intake::start(intake, sink)?;
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
            refused_sources,
            models,
            stats,
            flagged,
            tokenizer,
            tokenizer_pool,
            host_weight,
            max_ranks,
            bootstrapped: AtomicBool::new(!bootstrap),
            replaying: ArcSwap::from_pointee(Vec::new()),
            undiscovered: ArcSwap::from_pointee(Vec::new()),
            discovered: AtomicBool::new(false),
            warm_deadline: Instant::now() + warm_timeout,
            warmed: AtomicBool::new(false),
            exporting: AtomicBool::new(false),
        })
    }

    /// Whether this copy is still warming up: within `--kv-warm-timeout-secs` of its start,
    /// discovery has not looked at every worker yet, a worker's publishers are not found yet
    /// for a reason that may clear within moments (its announcement unanswered, its model not
    /// learnt yet), or a worker that `eligible` says may be
    /// routed to, subscribed with a replay endpoint, has not completed its start-up replay (it
    /// would be scored by the text tree, which a new copy has empty). A publisher without a
    /// replay endpoint has nothing to catch up on, so it is not waited for. `/readiness`
    /// answers 503 meanwhile. Once over, the wait never comes back.
    pub fn warming(&self, eligible: impl Fn(WorkerId) -> bool) -> bool {
        if self.warmed.load(Ordering::Acquire) {
            return false;
        }
        if Instant::now() >= self.warm_deadline {
            self.warmed.store(true, Ordering::Release);
            return false;
        }
        if !self.discovered.load(Ordering::Acquire) {
            return true;
        }
        let warm = self.exact_workers.load();
        let cold: Vec<WorkerId> = self
            .replaying
            .load()
            .iter()
            .copied()
            .filter(|w| warm.binary_search(w).is_err())
            .chain(self.undiscovered.load().iter().copied())
            .collect();
        // Over for good only once every worker with a replay endpoint replayed and none is
        // still being found: a worker not routable yet (its first health check still to come)
        // does not hold readiness back, but it must not end the wait either, or it would be
        // routed cold the moment it is.
        if cold.is_empty() {
            self.warmed.store(true, Ordering::Release);
        }
        cold.into_iter().any(eligible)
    }

    /// The publishers whose stores the index refuses for its limits (sources, models, ranks).
    pub fn refused_sources(&self) -> arc_swap::Guard<Arc<Vec<Source>>> {
        self.refused_sources.load()
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

    /// The intake itself, for its gauges (queue, lag, per-publisher staleness).
    pub fn intake(&self) -> &Intake {
        &self.intake
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

#[cfg(test)]
mod tests {
    use super::sink::exact_workers;
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
    fn a_worker_not_routable_yet_neither_holds_readiness_back_nor_ends_the_warm_up() {
        let kv = KvRouting::start(KvSettings {
            flagged: Vec::new(),
            bootstrap: false,
            tokenizer: None,
            warm_timeout: Duration::from_secs(60),
            host_weight: 0.8,
            max_ranks: 1,
            intake: IntakeConfig::default(),
        })
        .unwrap();
        assert!(kv.warming(|_| true), "before discovery looked");
        kv.replaying.store(Arc::new(vec![3]));
        kv.discovered.store(true, Ordering::Release);
        // Worker 3 replays; before its first health check it does not hold readiness back...
        assert!(!kv.warming(|_| false));
        // ...and once routable, it still must replay first (the wait was not over for good).
        assert!(kv.warming(|_| true));
        kv.exact_workers.store(Arc::new(vec![3]));
        assert!(!kv.warming(|_| true));
        // Over for good: a worker subscribed later is not waited for.
        kv.replaying.store(Arc::new(vec![3, 4]));
        assert!(!kv.warming(|_| true));
    }

    #[test]
    fn a_worker_still_being_found_holds_readiness_until_it_is_subscribed() {
        let kv = KvRouting::start(KvSettings {
            flagged: Vec::new(),
            bootstrap: false,
            tokenizer: None,
            warm_timeout: Duration::from_secs(60),
            host_weight: 0.8,
            max_ranks: 1,
            intake: IntakeConfig::default(),
        })
        .unwrap();
        // A round looked at worker 5 but its model was not learnt yet: no publisher is
        // subscribed, and nothing replays, yet the copy is not warm.
        kv.undiscovered.store(Arc::new(vec![5]));
        kv.discovered.store(true, Ordering::Release);
        assert!(kv.warming(|_| true));
        assert!(!kv.warming(|w| w != 5), "not routable yet: not waited for");
        assert!(kv.warming(|_| true), "nor did that end the wait");
        // The next round subscribed it with a replay endpoint: now its replay is waited for.
        kv.undiscovered.store(Arc::new(Vec::new()));
        kv.replaying.store(Arc::new(vec![5]));
        assert!(kv.warming(|_| true));
        kv.exact_workers.store(Arc::new(vec![5]));
        assert!(!kv.warming(|_| true));
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
    fn marked_token_ids_at_the_cap_lose_only_the_cut_last_id() {
        use crate::route::extract::{extract, Api, MAX_ROUTING_TEXT};
        let many: Vec<String> = (0..40_000).map(|i| (1_000_000 + i).to_string()).collect();
        let body = format!(r#"{{"token_ids":[{}],"cache_salt":"s"}}"#, many.join(","));
        let t = extract(Api::TokenGenerate, body.as_bytes()).unwrap().text;
        assert_eq!(t.len(), MAX_ROUTING_TEXT);
        let mut out = Vec::new();
        parse_token_ids(&t, MAX_ROUTING_TEXT, &mut out).unwrap();
        // 18 bytes of marker, then 8 bytes an id ("1000000 "): the ids that fit whole.
        assert_eq!(out.len(), (MAX_ROUTING_TEXT - 18) / 8);
        assert!(out
            .iter()
            .enumerate()
            .all(|(i, &id)| id == 1_000_000 + i as u32));
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
