//! The token-block index: for each model, which sources — a (worker, attention-DP rank) pair,
//! one KV cache each — hold which blocks of tokens, as the servers' `BlockStored` /
//! `BlockRemoved` / `AllBlocksCleared` events say.
//!
//! **Keys.** A block is keyed by radixgate's own chained hash ([`block_hash`]): XXH3-64 of the
//! block's token ids (u32 little-endian) seeded with the parent block's own hash (a one-token
//! block: a multiply-fold of the two, [`one_token_hash`]). Chaining makes
//! the key name the whole prefix, as a KV block's contents depend on every earlier token. The
//! engine's hash is kept only as an id (per source: engine hash → own hash) to resolve
//! `parent_block_hash` and removals; SGLang's own hash has changed at least three times and is
//! never reproduced, so the gateway hashes a prompt with the same function it applied to the
//! events' token ids and needs nothing from the engine but those ids.
//!
//! **Namespaces.** SGLang reuses a cached block only for requests of the same cache salt and
//! LoRA adapter, so the first block of a sequence chains from its namespace's root
//! ([`namespace_root`] of the event's `cache_salt` and `lora_name`), and a prompt is hashed from
//! its own request's root: salted blocks never match an unsalted prompt, an adapter's never the
//! base model's. vLLM keys its blocks the same way (salt and adapter in each block hash's extra
//! keys), but publishes the salt only in the `extra_keys` of a request's first block (the
//! decoder reads it into `cache_salt`): the request's later blocks, and later events that
//! extend it, carry it only through their parent hash. The index needs nothing more for them:
//! a block's own hash is chained from its parent's, which was chained from the salted root, so
//! a continuation inherits its namespace with no per-block record of the salt (no memory past
//! the block records the caps already bound). An adapter is named by `lora_name` on every vLLM
//! store, and requests name it by its own name in `model` (the gateway maps it to its base
//! model from the workers' `/v1/models`).
//!
//! **Tiers.** With SGLang's hierarchical cache a block lives on the GPU, in host memory or
//! beyond (disk, an external pool), and each store and removal names its tier (`medium`). A
//! source's record of a block keeps the tiers it holds it in, the trie one holding per tier
//! (`trie::holding`); a removal drops that tier's copy only, the block goes with its last copy.
//! A match reports per source the blocks it holds on the GPU and on the GPU or in host memory
//! ([`PrefixMatch`]); the caller weighs the second (`--kv-host-tier-weight`).
//!
//! **Unknown parents.** A `BlockStored` whose parent this source never stored (or already
//! removed) is dropped and counted: its own hash cannot be computed without the parent's, and
//! starting a new root chain would claim the blocks sit at the start of a prompt — false
//! matches. Its descendants are then dropped the same way. (A prompt's block i only counts on a
//! source that holds blocks 0..i anyway.)
//!
//! **Block size.** Learned per model from the first well-formed `BlockStored`; events with
//! another size are dropped and counted (they would never match prompts hashed at the learned
//! size). It is forgotten when the model's last source is removed.
//!
//! **Publication.** One writer ([`IndexWriter`], owned by the event thread) mutates the index;
//! [`IndexWriter::publish`] makes everything applied so far visible to readers ([`IndexReader`],
//! on every core) as an immutable [`Snapshot`] through `ArcSwap`: readers never lock and never
//! wait (`snapshot`). The per-model block map is a persistent hash trie (`trie`), so publishing
//! costs one `Arc` clone per model and the writer (`writer`) then copies only the trie nodes on
//! the paths it edits (≤ 11 levels, ~4 at a million blocks) — never the whole index. The
//! engine-hash maps and the eviction order are the writer's alone and are never published.
//!
//! **Hashing a prompt.** Each core keeps the block chains of its recent prompts (`memo`), so
//! turn k+1 of a conversation hashes only the tokens past turn k's prompt.
//!
//! **Bounded memory.** At most [`IndexConfig::max_blocks`] blocks held over all sources (a block
//! on two sources counts twice), at most [`IndexConfig::max_blocks_per_source`] per source, at
//! most [`IndexConfig::max_sources`] sources and [`IndexConfig::max_models`] models. A full
//! source evicts first the blocks of its least recently extended chain, tail first (leaves
//! only, so a prefix stays matchable while anything under it does); the global cap evicts the
//! same way from the largest source. In normal operation the caps sit above the servers' own
//! KV capacity and never bite: the servers' `BlockRemoved` events keep the index in step; the
//! caps bound what a faulty or hostile publisher can make the gateway hold. Cost per block held,
//! measured by `benches/kv_index.rs` (bytes requested, 1M blocks): 146 when every block is on one
//! source, 127 when each is on two (the trie entry is shared; the writer's engine-hash record and
//! eviction entry are per source) — so the default 4 Mi cap is ~600 MiB at most.
//!
//! **Copying to a new gateway copy.** A copy started with `--kv-bootstrap-peer` takes a running
//! sibling's index instead of starting empty: [`IndexWriter::export_copy`] /
//! [`IndexExport::encode`] write every source's blocks with its publisher's sequence watermark,
//! [`IndexWriter::import`] rebuilds them under this copy's caps (format and limits in
//! `writer/transfer.rs`). An export costs ~17 bytes per block (17.1 measured on the bench's
//! traffic). For 1M blocks the same bench measures 25–36 ms for the copy the event thread takes,
//! 0.5–1 s to encode it (on any thread) and ~1 s to import it (2 cores shared with other load).
//!
//! **Cost of publishing.** A publish is ~80 ns; what it really costs is that the writer's next
//! edit of each trie path copies that path's nodes, and copying a node bumps the reference count
//! of each of its child nodes. Measured (same bench, 500k blocks, every event also evicting 16):
//! a 16-block event applies in ~28 µs unpublished and ~105 µs with a publish after it, and
//! batching 16 events per publish does not lower the per-event cost (random keys touch distinct
//! lower-level nodes). ~10k events/s (160k blocks/s stored plus as many evicted) is ~25× the
//! rate a copy sees at 400k prefill tokens/s in 64-token pages.

mod memo;
mod snapshot;
mod trie;
mod writer;

#[cfg(test)]
mod tests;

pub use memo::ChainMemo;
pub use snapshot::{IndexReader, MatchScratch, PrefixMatch, Snapshot};
pub use writer::{
    DropReason, ImportError, ImportSummary, ImportedSource, IndexExport, IndexWriter,
};

use crate::base::WorkerId;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use xxhash_rust::xxh3::xxh3_64_with_seed;

pub use super::wire::{EngineHash, KvEvent};

/// One KV cache: a worker and its attention-DP rank (each rank publishes its own events).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Source {
    /// The worker (registry id, never reused).
    pub worker: WorkerId,
    /// The attention-DP rank whose publisher sent the events (port = base + rank).
    pub dp_rank: u32,
}

/// The own hash the first block of a sequence chains from (in the default namespace).
pub const ROOT_PARENT: u64 = 0x7261_6469_7867_6174; // "radixgat"

/// The own hash the first block of a sequence chains from in a namespace. SGLang shares cached
/// blocks only between requests of the same cache salt and LoRA adapter, so a block's own hash
/// names its namespace too: blocks stored under salt A never match a prompt without it. The
/// default namespace (no salt, no adapter; empty strings count as none, as SGLang normalises
/// them) chains from [`ROOT_PARENT`]; another from a hash of both parts, each with a presence
/// byte and its length, so `("a", "bc")` and `("ab", "c")` differ.
pub fn namespace_root(cache_salt: Option<&str>, adapter: Option<&str>) -> u64 {
    let salt = cache_salt.filter(|s| !s.is_empty());
    let adapter = adapter.filter(|s| !s.is_empty());
    if salt.is_none() && adapter.is_none() {
        return ROOT_PARENT;
    }
    let mut bytes = Vec::with_capacity(18 + salt.map_or(0, str::len) + adapter.map_or(0, str::len));
    for part in [salt, adapter] {
        match part {
            None => bytes.push(0),
            Some(p) => {
                bytes.push(1);
                bytes.extend_from_slice(&(p.len() as u64).to_le_bytes());
                bytes.extend_from_slice(p.as_bytes());
            }
        }
    }
    xxh3_64_with_seed(&bytes, ROOT_PARENT)
}

/// radixgate's own hash of a block: XXH3-64 of `tokens` (little-endian bytes) seeded with
/// `parent` (the previous block's own hash, or [`ROOT_PARENT`]); a one-token block (SGLang's
/// default page) by [`one_token_hash`] instead. Seeding chains the blocks without copying the
/// parent in front of the tokens: a block of up to [`STACK_BLOCK`] tokens is laid out on the
/// stack, a larger one in `buf`, scratch space reused across calls. (Export format 1 hashed
/// parent and tokens together, format 2 hashed one-token blocks with XXH3 too; index exports
/// say which.)
#[inline]
pub fn block_hash(parent: u64, tokens: &[u32], buf: &mut Vec<u8>) -> u64 {
    match tokens.len() {
        1 => return one_token_hash(parent, tokens[0]),
        ..=16 => return hash_on_stack::<64>(parent, tokens),
        17..=STACK_BLOCK => return hash_on_stack::<{ STACK_BLOCK * 4 }>(parent, tokens),
        _ => {}
    }
    buf.clear();
    for t in tokens {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(buf, parent)
}

/// The own hash of a one-token block: the 128-bit product of the parent and the token (each
/// offset by a constant, the token tagged so that it is never zero), folded to 64 bits. At
/// one-token pages a prompt is one block per token and its chain is strictly sequential (each
/// hash seeds the next), so the chain costs the hash's latency per token: XXH3's seeded path
/// for 4 bytes took ~26 µs for a 4k-token prompt, this multiply-fold ~8 µs (measured on this
/// machine). A 64-bit multiply-fold is the mixing step of wyhash/rapidhash; chained keys only
/// need to keep distinct prefixes apart (a collision is a wrong match, not a safety issue), and
/// reaching the one degenerate parent (`parent == PARENT_OFFSET`, where every token maps to
/// the same hash) takes a 2^64 search.
#[inline]
pub fn one_token_hash(parent: u64, token: u32) -> u64 {
    const PARENT_OFFSET: u64 = 0x9e37_79b9_7f4a_7c15;
    const TOKEN_OFFSET: u64 = 0xd6e8_feb8_6659_fd93;
    let a = parent ^ PARENT_OFFSET;
    let b = (u64::from(token) | 1 << 32) ^ TOKEN_OFFSET;
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

/// [`block_hash`] of a block whose little-endian bytes fit in `BYTES`.
#[inline]
fn hash_on_stack<const BYTES: usize>(parent: u64, tokens: &[u32]) -> u64 {
    let mut bytes = [0u8; BYTES];
    for (out, t) in bytes.chunks_exact_mut(4).zip(tokens) {
        out.copy_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(&bytes[..tokens.len() * 4], parent)
}

/// Largest block hashed from the stack (SGLang pages are 1 to 64 tokens).
const STACK_BLOCK: usize = 64;

/// The own hashes of every whole block of `tokens` at `block_size`, chained from `root` (the
/// namespace's, [`namespace_root`]), into `out` (cleared first); at most `max_blocks` of them.
/// A final partial block is left out: it never matches (the engine caches whole pages).
pub fn chain_hashes(
    tokens: &[u32],
    block_size: usize,
    root: u64,
    max_blocks: usize,
    out: &mut Vec<u64>,
    buf: &mut Vec<u8>,
) {
    out.clear();
    extend_chain(tokens, block_size, root, max_blocks, out, buf);
}

/// [`chain_hashes`] continued: `out` already holds the chain of the first `out.len()` blocks of
/// `tokens` from `root` (a remembered prefix, see [`ChainMemo`]); the rest of the whole blocks,
/// up to `max_blocks` in all, are hashed onto it.
pub fn extend_chain(
    tokens: &[u32],
    block_size: usize,
    root: u64,
    max_blocks: usize,
    out: &mut Vec<u64>,
    buf: &mut Vec<u8>,
) {
    if block_size == 0 {
        return;
    }
    let done = out.len();
    let mut parent = out.last().copied().unwrap_or(root);
    let Some(rest) = tokens.get(done * block_size..) else {
        return;
    };
    let more = max_blocks.saturating_sub(done);
    if block_size == 1 {
        // SGLang's default page: one hash per token, strictly sequential, so the loop is the
        // hash's latency alone (inlined, the output's length kept in a register).
        let rest = &rest[..rest.len().min(more)];
        out.reserve(rest.len());
        out.extend(rest.iter().map(|&t| {
            parent = one_token_hash(parent, t);
            parent
        }));
        return;
    }
    for block in rest.chunks_exact(block_size).take(more) {
        parent = block_hash(parent, block, buf);
        out.push(parent);
    }
}

/// Bounds of the index (see the module doc for what happens at each).
#[derive(Debug, Clone)]
pub struct IndexConfig {
    /// Blocks held over all sources and models.
    pub max_blocks: usize,
    /// Blocks held by one source.
    pub max_blocks_per_source: usize,
    /// Sources (worker, rank) known at once; events from more are dropped and counted.
    pub max_sources: usize,
    /// DP ranks accepted per worker (ranks at or above it are dropped and counted).
    pub max_dp_ranks: u32,
    /// Models known at once; events for more are dropped and counted.
    pub max_models: usize,
}

impl Default for IndexConfig {
    /// 4 Mi blocks (~600 MiB at the measured cost; 256 Mi tokens at 64-token pages), 1 Mi per
    /// source (more than any one GPU's KV cache at pages of 16 tokens or more), as many sources
    /// as a holding can number (16,383 worker ranks: a fleet of thousands of servers is indexed
    /// whole; a source costs nothing until it stores, and its blocks count against the global
    /// bound), 256 ranks per worker, 64 models.
    fn default() -> Self {
        IndexConfig {
            max_blocks: 4 << 20,
            max_blocks_per_source: 1 << 20,
            max_sources: trie::MAX_SOURCE_IDS,
            max_dp_ranks: 256,
            max_models: 64,
        }
    }
}

/// Counters of the writer, shared with whoever exports them (the writer stores, anyone reads).
#[derive(Debug, Default)]
pub struct IndexStats {
    events: AtomicU64,
    blocks_stored: AtomicU64,
    blocks_removed: AtomicU64,
    removed_unknown: AtomicU64,
    duplicate_stores: AtomicU64,
    evicted: AtomicU64,
    dropped_unknown_parent: AtomicU64,
    dropped_block_size: AtomicU64,
    dropped_malformed: AtomicU64,
    dropped_limits: AtomicU64,
    resets: AtomicU64,
    publishes: AtomicU64,
    held: AtomicU64,
    distinct: AtomicU64,
    sources: AtomicU64,
}

macro_rules! getters {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        impl IndexStats {
            $($(#[$doc])* pub fn $name(&self) -> u64 { self.$name.load(Relaxed) })*
        }
    };
}

getters!(
    /// Events applied or dropped.
    events,
    /// Blocks added to a source (duplicates not counted).
    blocks_stored,
    /// Blocks removed by `BlockRemoved`.
    blocks_removed,
    /// `BlockRemoved` hashes the source did not hold (already evicted by the cap, or a gap).
    removed_unknown,
    /// `BlockStored` of a block the source already held with the same tokens.
    duplicate_stores,
    /// Blocks evicted by the caps.
    evicted,
    /// `BlockStored` events dropped because the parent was unknown for that source.
    dropped_unknown_parent,
    /// `BlockStored` events dropped because their block size differs from the model's.
    dropped_block_size,
    /// Events dropped as malformed (zero block size, token count not hashes × block size).
    dropped_malformed,
    /// Events dropped because a source, rank or model cap was reached.
    dropped_limits,
    /// Sources reset (`AllBlocksCleared`, `reset_*`, removal, moving to another model).
    resets,
    /// Snapshots published.
    publishes,
    /// Blocks held over all sources (a block on two sources counts twice), now.
    held,
    /// Distinct blocks over all models, at the last publish.
    distinct,
    /// Sources known, now.
    sources,
);

impl IndexStats {
    fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Relaxed);
    }
}
