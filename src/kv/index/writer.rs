//! The single writer: applies events, keeps each source's engine-hash records and eviction
//! order, enforces the caps, and publishes snapshots.

use super::snapshot::{IndexReader, ModelView, Snapshot};
use super::trie::{holding, SourceId, Trie, MAX_SOURCE_IDS};
use super::{block_hash, namespace_root, EngineHash, IndexConfig, IndexStats, KvEvent, Source};
use crate::base::WorkerId;
use crate::kv::wire::{BlockStored, Tier};
use arc_swap::ArcSwap;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

mod transfer;

#[cfg(test)]
pub(super) use transfer::RecordView;
pub use transfer::{ImportError, ImportSummary, ImportedSource, IndexExport};

/// Why an event was not applied (each is also counted in [`IndexStats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// `BlockStored` under a parent this source does not hold.
    UnknownParent,
    /// `BlockStored` with a block size other than the model's.
    BlockSizeMismatch,
    /// Zero block size, or token count ≠ hashes × block size.
    Malformed,
    /// Too many sources, models, or a DP rank out of range.
    Limits,
}

/// Published snapshots the writer keeps alive after replacing them, so the nodes a snapshot
/// alone still pins are freed here, not by the last reader on a core (as the text tree does).
const RETAINED_SNAPSHOTS: usize = 4;

/// The writer's record of one block a source holds, under the engine's hash.
#[derive(Debug, Clone, Copy)]
struct Rec {
    own: u64,
    /// The tiers ([`Tier::bit`]) the source holds it in; never 0 (the record goes with the last
    /// copy).
    tiers: u8,
    parent: Option<EngineHash>,
    /// Blocks of this source stored under this one and still held (may undercount after the
    /// server removed a parent before its children; never overcounts, so a leaf always exists).
    children: u32,
    /// Eviction order: the store time of this block or, once its children are gone, of its
    /// most recent child.
    stamp: u64,
}

/// One source's blocks as the writer sees them.
#[derive(Debug, Clone)]
struct SourceState {
    id: SourceId,
    model: Arc<str>,
    /// Tokens per block of this source's events (its server's page size): announced by the
    /// server, else learned from its first store of at least one block; 0 before either.
    block_size: usize,
    blocks: HashMap<EngineHash, Rec>,
    /// Blocks without children, by stamp: the eviction order.
    leaves: BTreeSet<(u64, EngineHash)>,
    /// Copies of a block (own hash, tier) this source holds under more than one engine hash,
    /// beyond the first: the trie holds each (source, tier) of a block once, so its holder
    /// lists stay bounded by the sources however often one of them stores the same tokens.
    extra: HashMap<(u64, Tier), u32>,
}

/// One model's mutable state.
#[derive(Debug)]
struct ModelState {
    name: Arc<str>,
    /// The block size most of its sources use (prompts are hashed at it): one lying source
    /// cannot set it for the others.
    block_size: usize,
    /// Sources per block size.
    sizes: BTreeMap<usize, usize>,
    trie: Trie,
    sources: usize,
}

impl ModelState {
    /// A source of this model now uses `new` instead of `old` (0: none).
    fn resize(&mut self, old: usize, new: usize) {
        if old == new {
            return;
        }
        if old != 0 {
            if let Some(n) = self.sizes.get_mut(&old) {
                *n -= 1;
                if *n == 0 {
                    self.sizes.remove(&old);
                }
            }
        }
        if new != 0 {
            *self.sizes.entry(new).or_insert(0) += 1;
        }
        // The most common size; ties to the smallest (deterministic).
        self.block_size = self
            .sizes
            .iter()
            .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))
            .map_or(0, |(&size, _)| size);
    }
}

/// Owns the index: the event thread applies every event here, then calls [`publish`] (after
/// each batch, or on its own schedule). Every mutation takes `&mut self`: one owner, one writer.
///
/// [`publish`]: IndexWriter::publish
#[derive(Debug)]
pub struct IndexWriter {
    cfg: IndexConfig,
    /// Sorted by name.
    models: Vec<ModelState>,
    sources: HashMap<Source, SourceState>,
    /// Page sizes the servers announced (their `/get_server_info`), by source.
    announced: HashMap<Source, usize>,
    ids: Vec<Option<Source>>,
    free_ids: Vec<SourceId>,
    published_ids: Arc<[Option<Source>]>,
    ids_changed: bool,
    held: usize,
    clock: u64,
    buf: Vec<u8>,
    epoch: u64,
    shared: Arc<ArcSwap<Snapshot>>,
    retired: VecDeque<Arc<Snapshot>>,
    stats: Arc<IndexStats>,
}

impl IndexWriter {
    /// An empty index with `cfg`'s bounds.
    pub fn new(cfg: IndexConfig) -> Self {
        IndexWriter {
            cfg,
            models: Vec::new(),
            sources: HashMap::new(),
            announced: HashMap::new(),
            ids: Vec::new(),
            free_ids: Vec::new(),
            published_ids: Arc::from(Vec::new()),
            ids_changed: false,
            held: 0,
            clock: 0,
            buf: Vec::new(),
            epoch: 0,
            shared: Arc::default(),
            retired: VecDeque::new(),
            stats: Arc::default(),
        }
    }

    /// A handle for readers (every core); sees what was applied up to the last [`publish`].
    ///
    /// [`publish`]: IndexWriter::publish
    pub fn reader(&self) -> IndexReader {
        IndexReader {
            shared: self.shared.clone(),
        }
    }

    /// The counters (shared; export them from any thread).
    pub fn stats(&self) -> Arc<IndexStats> {
        self.stats.clone()
    }

    /// Blocks held over all sources now (a block on two sources counts twice).
    pub fn held(&self) -> usize {
        self.held
    }

    /// Blocks `source` holds now.
    pub fn held_by(&self, source: Source) -> usize {
        self.sources.get(&source).map_or(0, |s| s.blocks.len())
    }

    /// Applies one event from `source`, which serves `model` (a source moving to another model
    /// The bounds this writer enforces (for saying which one a refused source ran into).
    pub fn config(&self) -> &IndexConfig {
        &self.cfg
    }

    /// is reset first: one worker serves one model). `Err` says why it was dropped.
    pub fn apply(
        &mut self,
        model: &str,
        source: Source,
        event: &KvEvent,
    ) -> Result<(), DropReason> {
        IndexStats::add(&self.stats.events, 1);
        let r = self.apply_inner(model, source, event);
        if let Err(reason) = r {
            let c = match reason {
                DropReason::UnknownParent => &self.stats.dropped_unknown_parent,
                DropReason::BlockSizeMismatch => &self.stats.dropped_block_size,
                DropReason::Malformed => &self.stats.dropped_malformed,
                DropReason::Limits => &self.stats.dropped_limits,
            };
            IndexStats::add(c, 1);
        }
        self.stats.held.store(self.held as u64, Relaxed);
        r
    }

    fn apply_inner(
        &mut self,
        model: &str,
        source: Source,
        event: &KvEvent,
    ) -> Result<(), DropReason> {
        if source.dp_rank >= self.cfg.max_dp_ranks {
            return Err(DropReason::Limits);
        }
        let mi = self.model_index(model)?;
        self.register(source, mi)?;
        match event {
            KvEvent::BlockStored(b) => self.store(mi, source, b),
            KvEvent::BlockRemoved(r) => {
                // A removal concerns one tier: the host copy freed leaves the GPU's, and the
                // other way round; the block goes with its last copy.
                let tier = r.tier();
                let (m, s) = self.parts(mi, source);
                let (mut gone, mut known) = (0, 0);
                for &eh in &r.block_hashes {
                    match remove_tier(s, &mut m.trie, eh, tier) {
                        Removal::NotHeld => {}
                        Removal::Tier => known += 1,
                        Removal::Block => {
                            known += 1;
                            gone += 1;
                        }
                    }
                }
                self.held -= gone;
                IndexStats::add(&self.stats.blocks_removed, known as u64);
                let unknown = (r.block_hashes.len() - known) as u64;
                IndexStats::add(&self.stats.removed_unknown, unknown);
                Ok(())
            }
            KvEvent::AllBlocksCleared => {
                self.reset_source(source);
                Ok(())
            }
        }
    }

    /// The model's position, creating it (within the cap).
    fn model_index(&mut self, model: &str) -> Result<usize, DropReason> {
        match self.models.binary_search_by(|m| (*m.name).cmp(model)) {
            Ok(i) => Ok(i),
            Err(_) if self.models.len() >= self.cfg.max_models => Err(DropReason::Limits),
            Err(i) => {
                self.models.insert(
                    i,
                    ModelState {
                        name: Arc::from(model),
                        block_size: 0,
                        sizes: BTreeMap::new(),
                        trie: Trie::default(),
                        sources: 0,
                    },
                );
                Ok(i)
            }
        }
    }

    /// Makes `source` known under model `mi` (a new number, within the cap); a source that
    /// served another model is reset and moved.
    fn register(&mut self, source: Source, mi: usize) -> Result<(), DropReason> {
        if let Some(s) = self.sources.get(&source) {
            if *s.model == *self.models[mi].name {
                return Ok(());
            }
            let (old, size) = (s.model.clone(), s.block_size);
            self.reset_source(source);
            if let Some(s) = self.sources.get_mut(&source) {
                s.model = self.models[mi].name.clone();
            }
            self.models[mi].sources += 1;
            self.models[mi].resize(0, size);
            if let Ok(oi) = self.models.binary_search_by(|m| m.name.cmp(&old)) {
                self.models[oi].sources -= 1;
                self.models[oi].resize(size, 0);
            }
            return Ok(());
        }
        let cap = self.cfg.max_sources.min(MAX_SOURCE_IDS);
        if self.sources.len() >= cap {
            return Err(DropReason::Limits);
        }
        let id = match self.free_ids.pop() {
            Some(id) => id,
            None => {
                self.ids.push(None);
                (self.ids.len() - 1) as SourceId
            }
        };
        self.ids[id as usize] = Some(source);
        self.ids_changed = true;
        let block_size = self.announced.get(&source).copied().unwrap_or(0);
        self.models[mi].sources += 1;
        self.models[mi].resize(0, block_size);
        self.sources.insert(
            source,
            SourceState {
                id,
                model: self.models[mi].name.clone(),
                block_size,
                blocks: HashMap::new(),
                leaves: BTreeSet::new(),
                extra: HashMap::new(),
            },
        );
        self.stats.sources.store(self.sources.len() as u64, Relaxed);
        Ok(())
    }

    /// The model and the source state, borrowed together.
    fn parts(&mut self, mi: usize, source: Source) -> (&mut ModelState, &mut SourceState) {
        let s = self.sources.get_mut(&source).expect("registered source");
        (&mut self.models[mi], s)
    }

    fn store(&mut self, mi: usize, source: Source, b: &BlockStored) -> Result<(), DropReason> {
        let (hashes, tokens) = (&b.block_hashes, &b.token_ids);
        let block_size = b.block_size as usize;
        if block_size == 0 || Some(tokens.len()) != hashes.len().checked_mul(block_size) {
            return Err(DropReason::Malformed);
        }
        if hashes.is_empty() {
            // Stores nothing, so it teaches nothing either (not even a block size).
            return Ok(());
        }
        let tier = b.tier();
        let mut buf = std::mem::take(&mut self.buf);
        let mut clock = self.clock;
        let (m, s) = self.parts(mi, source);
        // A source's block size is its own (announced by its server, else its first store's):
        // a store of another size is dropped, and another source's sizes never matter.
        if s.block_size == 0 {
            s.block_size = block_size;
            m.resize(0, block_size);
        } else if s.block_size != block_size {
            self.buf = buf;
            return Err(DropReason::BlockSizeMismatch);
        }
        let mut parent_own = match b.parent {
            // SGLang's adapters are named (`lora_name`); vLLM's may only carry an id, which no
            // request can name: its blocks then never match one, as they must not match a
            // request for the base model.
            None => {
                let adapter = b.lora_id.map(|id| format!("\u{0}lora-id:{id}"));
                namespace_root(
                    b.cache_salt.as_deref(),
                    b.lora_name.as_deref().or(adapter.as_deref()),
                )
            }
            Some(p) => match s.blocks.get(&p) {
                Some(r) => r.own,
                None => return Err(DropReason::UnknownParent),
            },
        };
        let (mut added, mut dup, mut replaced, mut new) = (0u64, 0u64, 0usize, 0usize);
        let mut parent_eh = b.parent;
        for (&eh, block) in hashes.iter().zip(tokens.chunks_exact(block_size)) {
            let own = block_hash(parent_own, block, &mut buf);
            match s.blocks.get_mut(&eh) {
                Some(r) if r.own == own && r.tiers & tier.bit() != 0 => dup += 1,
                Some(r) if r.own == own => {
                    // Another tier's copy of a block it holds (a GPU block backed up to host).
                    r.tiers |= tier.bit();
                    hold(&mut s.extra, s.id, &mut m.trie, own, tier);
                    added += 1;
                }
                existing => {
                    if existing.is_some() {
                        // The engine reused the id for other tokens: the new store wins.
                        replaced += remove_block(s, &mut m.trie, eh) as usize;
                    }
                    clock += 1;
                    add_block(s, &mut m.trie, eh, own, parent_eh, clock, tier);
                    added += 1;
                    new += 1;
                }
            }
            parent_own = own;
            parent_eh = Some(eh);
        }
        self.clock = clock;
        self.buf = buf;
        self.held = self.held + new - replaced;
        IndexStats::add(&self.stats.blocks_stored, added);
        IndexStats::add(&self.stats.duplicate_stores, dup);
        self.enforce_caps(source);
        Ok(())
    }

    /// Evicts until `source` and the whole index are within their caps.
    fn enforce_caps(&mut self, source: Source) {
        let mut evicted = self.evict_from(source, self.cfg.max_blocks_per_source);
        while self.held > self.cfg.max_blocks {
            // The largest source gives up blocks, a slice of the cap at a time so a flood does
            // not scan every source per block.
            let Some((&largest, s)) = self.sources.iter().max_by_key(|(_, s)| s.blocks.len())
            else {
                break;
            };
            let over = self.held - self.cfg.max_blocks;
            let target = s
                .blocks
                .len()
                .saturating_sub(over.max(self.cfg.max_blocks / 1024));
            let n = self.evict_from(largest, target);
            if n == 0 {
                break;
            }
            evicted += n;
        }
        IndexStats::add(&self.stats.evicted, evicted as u64);
    }

    /// Evicts `source`'s blocks, oldest leaf first, until it holds at most `keep`.
    fn evict_from(&mut self, source: Source, keep: usize) -> usize {
        let Some(s) = self.sources.get_mut(&source) else {
            return 0;
        };
        let Ok(mi) = self.models.binary_search_by(|m| m.name.cmp(&s.model)) else {
            return 0;
        };
        let trie = &mut self.models[mi].trie;
        let mut n = 0;
        while s.blocks.len() > keep {
            let Some(victim) = next_victim(s) else {
                break;
            };
            remove_block(s, trie, victim);
            n += 1;
        }
        self.held -= n;
        n
    }

    /// The page size `source`'s server announced (its `/get_server_info`): its events are
    /// hashed at it, and a store of another size from it is dropped. Idempotent; a change
    /// (the server reconfigured) resets the source.
    pub fn announce_block_size(&mut self, source: Source, block_size: usize) {
        if block_size == 0 || self.announced.insert(source, block_size) == Some(block_size) {
            return;
        }
        let Some(s) = self.sources.get(&source) else {
            return;
        };
        let (old, model) = (s.block_size, s.model.clone());
        if old == block_size {
            return;
        }
        if old != 0 {
            self.reset_source(source);
        }
        if let Some(s) = self.sources.get_mut(&source) {
            s.block_size = block_size;
        }
        if let Ok(mi) = self.models.binary_search_by(|m| m.name.cmp(&model)) {
            self.models[mi].resize(old, block_size);
        }
    }

    /// Drops every block of `source` (`AllBlocksCleared`, or the server restarted); the source
    /// stays known.
    pub fn reset_source(&mut self, source: Source) {
        let Some(s) = self.sources.get_mut(&source) else {
            return;
        };
        if let Ok(mi) = self.models.binary_search_by(|m| m.name.cmp(&s.model)) {
            let trie = &mut self.models[mi].trie;
            for r in s.blocks.values() {
                remove_holdings(&mut s.extra, s.id, trie, r);
            }
        }
        s.extra = HashMap::new();
        self.held -= s.blocks.len();
        s.blocks = HashMap::new();
        s.leaves = BTreeSet::new();
        IndexStats::add(&self.stats.resets, 1);
        self.stats.held.store(self.held as u64, Relaxed);
    }

    /// Drops every block of every rank of `worker` (the intake resets per rank with
    /// `reset_source`; this whole-worker form serves the tests).
    #[cfg(test)]
    pub fn reset_worker(&mut self, worker: WorkerId) {
        for source in self.sources_of(worker) {
            self.reset_source(source);
        }
    }

    /// Forgets `worker` (removed from the fleet): its blocks, its ranks' numbers, and any model
    /// no source serves any more (with its learned block size).
    pub fn remove_worker(&mut self, worker: WorkerId) {
        for source in self.sources_of(worker) {
            self.remove_source(source);
        }
    }

    /// Forgets one source (unsubscribed): its blocks, its number, its announced block size,
    /// and its model when no other source serves it.
    pub fn remove_source(&mut self, source: Source) {
        self.reset_source(source);
        self.announced.remove(&source);
        if let Some(s) = self.sources.remove(&source) {
            self.ids[s.id as usize] = None;
            self.free_ids.push(s.id);
            self.ids_changed = true;
            if let Ok(mi) = self.models.binary_search_by(|m| m.name.cmp(&s.model)) {
                self.models[mi].resize(s.block_size, 0);
                self.models[mi].sources -= 1;
                if self.models[mi].sources == 0 {
                    self.models.remove(mi);
                }
            }
        }
        self.stats.sources.store(self.sources.len() as u64, Relaxed);
    }

    fn sources_of(&self, worker: WorkerId) -> Vec<Source> {
        let mut v: Vec<Source> = self
            .sources
            .keys()
            .filter(|s| s.worker == worker)
            .copied()
            .collect();
        v.sort_unstable();
        v
    }

    /// Makes everything applied so far visible to readers. Costs one `Arc` clone per model (and
    /// a copy of the source table when sources came or went), never a copy of the blocks.
    pub fn publish(&mut self) {
        if self.ids_changed {
            self.published_ids = Arc::from(self.ids.clone());
            self.ids_changed = false;
        }
        self.epoch += 1;
        let snap = Snapshot {
            models: self
                .models
                .iter()
                .map(|m| {
                    let view = ModelView {
                        block_size: m.block_size,
                        trie: m.trie.clone(),
                    };
                    (m.name.clone(), view)
                })
                .collect(),
            sources: self.published_ids.clone(),
            epoch: self.epoch,
        };
        let distinct: usize = self.models.iter().map(|m| m.trie.len()).sum();
        self.stats.distinct.store(distinct as u64, Relaxed);
        let old = self.shared.swap(Arc::new(snap));
        self.retired.push_back(old);
        if self.retired.len() > RETAINED_SNAPSHOTS {
            self.retired.pop_front();
        }
        IndexStats::add(&self.stats.publishes, 1);
    }

    /// Checks every internal invariant (tests).
    #[cfg(test)]
    pub(super) fn check(&self) {
        let mut held = 0;
        let mut held_copies = 0;
        for (src, s) in &self.sources {
            assert_eq!(self.ids[s.id as usize], Some(*src));
            held += s.blocks.len();
            let leaves: BTreeSet<_> = s
                .blocks
                .iter()
                .filter(|(_, r)| r.children == 0)
                .map(|(eh, r)| (r.stamp, *eh))
                .collect();
            assert_eq!(leaves, s.leaves, "leaf set of {src:?}");
            assert!(s.blocks.len() <= self.cfg.max_blocks_per_source);
            let m = self
                .models
                .iter()
                .find(|m| m.name == s.model)
                .expect("model");
            for r in s.blocks.values() {
                assert_ne!(r.tiers, 0, "a record without a copy");
                let in_trie = m.trie.get(r.own).map_or(0, |h| h.tiers_of(s.id));
                assert_eq!(in_trie & r.tiers, r.tiers, "{src:?}: tiers {:b}", r.tiers);
                held_copies += r.tiers.count_ones() as usize;
            }
            held_copies -= s.extra.values().map(|&n| n as usize).sum::<usize>();
            assert!(s.block_size == 0 || m.sizes.contains_key(&s.block_size));
        }
        assert_eq!(held, self.held);
        assert!(self.held <= self.cfg.max_blocks);
        let mut in_tries = 0;
        for m in &self.models {
            m.trie.check();
            for (_, holders) in m.trie.entries() {
                in_tries += holders.len();
            }
            let n = self.sources.values().filter(|s| s.model == m.name).count();
            assert_eq!(n, m.sources);
        }
        assert_eq!(in_tries, held_copies, "trie holdings vs records' copies");
    }

    /// The tries themselves (tests).
    #[cfg(test)]
    pub(super) fn trie_len(&self, model: &str) -> usize {
        self.models
            .iter()
            .find(|m| &*m.name == model)
            .map_or(0, |m| m.trie.len())
    }
}

/// Adds a record for a block not held under `eh` (its copy in `tier`), under `parent` if the
/// source holds it.
fn add_block(
    s: &mut SourceState,
    trie: &mut Trie,
    eh: EngineHash,
    own: u64,
    parent: Option<EngineHash>,
    stamp: u64,
    tier: Tier,
) {
    if let Some(p) = parent {
        if let Some(pr) = s.blocks.get_mut(&p) {
            pr.children += 1;
            if pr.children == 1 {
                s.leaves.remove(&(pr.stamp, p));
            }
        }
    }
    s.blocks.insert(
        eh,
        Rec {
            own,
            tiers: tier.bit(),
            parent,
            children: 0,
            stamp,
        },
    );
    s.leaves.insert((stamp, eh));
    hold(&mut s.extra, s.id, trie, own, tier);
}

/// Source `id` holds `own` in `tier` once more: the trie's holding at the first copy, a count
/// in `extra` beyond it.
fn hold(
    extra: &mut HashMap<(u64, Tier), u32>,
    id: SourceId,
    trie: &mut Trie,
    own: u64,
    tier: Tier,
) {
    let h = holding(id, tier);
    if trie.get(own).is_some_and(|hs| hs.contains(h)) {
        *extra.entry((own, tier)).or_insert(0) += 1;
    } else {
        trie.add(own, h);
    }
}

/// Source `id` holds `own` in `tier` once less (the trie's holding goes with the last copy).
fn unhold(
    extra: &mut HashMap<(u64, Tier), u32>,
    id: SourceId,
    trie: &mut Trie,
    own: u64,
    tier: Tier,
) {
    if let Some(n) = extra.get_mut(&(own, tier)) {
        *n -= 1;
        if *n == 0 {
            extra.remove(&(own, tier));
        }
        return;
    }
    trie.remove(own, holding(id, tier));
}

/// Every copy of `r` (one per tier it is held in) by source `id`.
fn remove_holdings(extra: &mut HashMap<(u64, Tier), u32>, id: SourceId, trie: &mut Trie, r: &Rec) {
    for t in Tier::ALL {
        if r.tiers & t.bit() != 0 {
            unhold(extra, id, trie, r.own, t);
        }
    }
}

/// The block the caps evict next from `s`: its oldest leaf (shared with the export, which lists
/// blocks in this order so an importer with smaller caps keeps what eviction would keep).
fn next_victim(s: &SourceState) -> Option<EngineHash> {
    match s.leaves.first() {
        Some(&(_, eh)) => Some(eh),
        // Unreachable while the leaf invariant holds; never loop forever on it.
        None => s.blocks.keys().next().copied(),
    }
}

/// What a one-tier removal did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Removal {
    /// The source did not hold the block in that tier.
    NotHeld,
    /// That copy went; another tier's stays.
    Tier,
    /// That was the last copy: the block went.
    Block,
}

/// Removes `eh`'s copy in `tier` (the whole record when it was the last copy).
fn remove_tier(s: &mut SourceState, trie: &mut Trie, eh: EngineHash, tier: Tier) -> Removal {
    let Some(r) = s.blocks.get_mut(&eh) else {
        return Removal::NotHeld;
    };
    if r.tiers & tier.bit() == 0 {
        return Removal::NotHeld;
    }
    if r.tiers != tier.bit() {
        r.tiers &= !tier.bit();
        let own = r.own;
        unhold(&mut s.extra, s.id, trie, own, tier);
        return Removal::Tier;
    }
    remove_block(s, trie, eh);
    Removal::Block
}

/// Removes `eh`'s record and every copy; false when the source does not hold `eh`. A parent
/// left without children becomes a leaf, as recent as the child it lost.
fn remove_block(s: &mut SourceState, trie: &mut Trie, eh: EngineHash) -> bool {
    let Some(r) = s.blocks.remove(&eh) else {
        return false;
    };
    if r.children == 0 {
        s.leaves.remove(&(r.stamp, eh));
    }
    remove_holdings(&mut s.extra, s.id, trie, &r);
    if let Some(p) = r.parent {
        if let Some(pr) = s.blocks.get_mut(&p) {
            if pr.children > 0 {
                pr.children -= 1;
                if pr.children == 0 {
                    pr.stamp = pr.stamp.max(r.stamp);
                    s.leaves.insert((pr.stamp, p));
                }
            }
        }
    }
    true
}
