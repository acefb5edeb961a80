//! Copying the index from one gateway copy to another (`--kv-bootstrap-peer`): a new copy would
//! otherwise know nothing of what the servers cached before it subscribed. The running copy
//! exports its writer's state, per source, with the publisher's sequence watermark; the new copy
//! [imports](IndexWriter::import) it and resumes each publisher's live stream after the
//! watermark. Exporting is split so the event thread only copies the records
//! ([`IndexWriter::export_copy`]) and the work of ordering and encoding them
//! ([`IndexExport::encode`]) runs elsewhere; [`IndexWriter::export`] does both.
//!
//! **What travels.** Per source: the worker's URL and the DP rank (a `WorkerId` means nothing in
//! another copy), the model, its block size, the watermark, and every block the source holds:
//! its engine hash (later removals and parents name it), radixgate's own hash (the key: tokens
//! do not travel, and the receiver never needs them), its parent's engine hash, its children
//! count and the rank of its eviction stamp. The receiver rebuilds the same records, eviction
//! order and trie holdings, so it then applies the same events exactly as the sender does.
//!
//! **Order.** Blocks are listed in the reverse of the order the caps would evict them (the
//! writer's own eviction step, run on a copy of the source's records), so a parent comes before
//! its children (a child can come first only when its parent was removed and stored again, and
//! the parent's count no longer includes it), and the first `k` blocks are exactly what the
//! sender would keep if it were evicted down to `k`. A receiver with smaller caps therefore reads
//! a prefix and skips the rest: it never holds more than its caps, allocates for the blocks past
//! them only a 4-byte stamp each, and keeps what its own eviction would have kept. The
//! receiver's eviction stamps are the ranks, placed before its own clock.
//!
//! **Format, version 4** (storage tiers; own hashes seeded with their parent and namespace,
//! one-token blocks by a multiply-fold; a copy refuses another version's export and starts
//! from the servers' replay buffers). Integers little-endian; `varint` is LEB128 (at most 10
//! bytes).
//!
//! ```text
//! payload  magic "rgkvidx\0"  version: u32 = 4  sources: u32  source × sources
//! source   url_len: u32  url: utf-8  dp_rank: u32  model_len: u32  model: utf-8
//!          block_size: u32  watermark_tag: u8 (0 none, 1 some)  [watermark: i64]
//!          blocks: u32  block × blocks
//! block    head: varint  [more_children: varint]  [tiers: u8]  engine_hash: u64
//!          own_hash: u64  [parent_engine_hash: u64]
//!          head = zigzag(stamp_rank − previous block's stamp_rank) << 5 | tiered << 4
//!                 | min(children, 3) << 2 | parent_kind
//!          more_children = children − 3, present when min(children, 3) = 3
//!          tiers: the storage tiers' bits (device 1, host 2, beyond 4), present when
//!          tiered = 1; absent means the device only
//!          parent_kind 0: none (the block starts a sequence); 1: the previous block of this
//!          source; 2: given (parent_engine_hash follows)
//! ```
//!
//! `children` is the sender's count (it may undercount after the server removed a parent before
//! its children); the receiver keeps it, but never more than the children it is sent, so a leaf
//! always exists. A chain is listed contiguously, its stamps one rank apart and one child each,
//! so a block usually costs 17 bytes: one head byte and the two hashes. A given parent (8 bytes
//! more) is needed only where a chain branches off another, a tier byte only for a block held
//! elsewhere than on the device alone. Measured: 17.1 bytes per block on the bench's traffic
//! (16-block events, a conversation ending after 8 on average), 19.3 on short turns of 1–4
//! blocks branching off a shared system prompt with some backed up to host memory
//! (its `tests`); a full default index (4 Mi blocks) is ~72 MB before any HTTP
//! compression.
//!
//! **Untrusted input.** The payload is read twice: once to check every field, length and count
//! (a count is checked against the bytes left before anything is allocated for it), then to
//! apply. A truncated or corrupt payload is an [`ImportError`] and leaves the writer untouched.
//! A well-formed payload can still name hashes the sender made up; it can never make this copy
//! exceed [`IndexConfig`](super::IndexConfig)'s caps.

use super::{hold, next_victim, remove_block, IndexWriter, Rec, SourceState};
use crate::base::WorkerId;
use crate::kv::index::trie::Trie;
#[cfg(test)]
use crate::kv::index::IndexConfig;
use crate::kv::index::{DropReason, EngineHash, Source};
use crate::kv::wire::Tier;
use std::collections::HashSet;
use std::fmt;
use std::sync::atomic::Ordering::Relaxed;

const MAGIC: [u8; 8] = *b"rgkvidx\0";
/// 4: storage tiers (3 had none; 1 and 2 hashed blocks differently). A copy refuses another
/// version's export and starts cold.
const VERSION: u32 = 4;
/// The device-only tier mask (what an untiered block means).
const DEVICE_ONLY: u8 = 1;
/// Fewest bytes a block takes (one head byte and two hashes).
const MIN_BLOCK: usize = 17;
/// Fewest bytes a source takes (empty strings, no watermark, no blocks).
const MIN_SOURCE: usize = 4 + 4 + 4 + 4 + 1 + 4;

/// Parent kinds in a block's head.
const ROOT: u64 = 0;
const PREVIOUS: u64 = 1;
const GIVEN: u64 = 2;

/// Why a payload was refused as a whole (the writer is then untouched).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImportError {
    /// The bytes do not start with the export's magic: not an index export at all (a proxy's
    /// error page, say).
    NotAnExport,
    /// An export format this build cannot read (the peer runs another version).
    Version(u32),
    /// The payload ends inside a field, or counts more than its remaining bytes can hold.
    Truncated {
        /// Byte offset of the field that does not fit.
        at: usize,
    },
    /// A field holds a value no exporter writes.
    Corrupt {
        /// Byte offset of the field.
        at: usize,
        /// Which field.
        what: &'static str,
    },
}

impl fmt::Display for ImportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImportError::NotAnExport => write!(f, "not a KV index export"),
            ImportError::Version(v) => write!(f, "KV index export version {v} not supported"),
            ImportError::Truncated { at } => write!(f, "KV index export truncated at byte {at}"),
            ImportError::Corrupt { at, what } => {
                write!(f, "KV index export corrupt at byte {at}: {what}")
            }
        }
    }
}

impl std::error::Error for ImportError {}

/// What an import did, so the intake can resume each publisher after its watermark and the
/// operator can see what the peer knew that this copy could not take.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImportSummary {
    /// The sources rebuilt, in payload order.
    pub sources: Vec<ImportedSource>,
    /// Sources whose worker URL this copy does not know (`worker_of` gave `None`): skipped.
    pub unknown: usize,
    /// Sources this copy would not take, as `apply` would drop their events: a cap on sources,
    /// models or DP ranks reached, a block size other than the model's, or a source listed
    /// twice.
    pub refused: usize,
}

/// One source rebuilt by an import.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImportedSource {
    /// The source, as this copy numbers it.
    pub source: Source,
    /// The sequence number of the last batch the peer had applied from this publisher (`None`:
    /// it had applied none it could number): live batches after it are the ones still to apply.
    pub watermark: Option<i64>,
    /// Blocks the source holds now.
    pub blocks: usize,
    /// Blocks of the payload not taken: over this copy's caps (those the peer would have
    /// evicted first) or listed twice.
    pub left_out: usize,
}

/// What an export copies out of the writer: every named source's records, its names and its
/// watermark. Taking it is the only part that needs the writer (a copy of the records: 25–36 ms
/// for 1M blocks in `benches/kv_index.rs`), and it can be taken a source at a time
/// ([`IndexWriter::export_source`]) so the writer's owner applies other events in between;
/// [`encode`](IndexExport::encode), 0.5–1 s for 1M, runs on any thread.
#[derive(Debug, Default)]
pub struct IndexExport {
    sources: Vec<ExportedSource>,
}

#[derive(Debug)]
struct ExportedSource {
    url: String,
    dp_rank: u32,
    block_size: u32,
    watermark: Option<i64>,
    state: SourceState,
}

impl IndexWriter {
    /// [`export_copy`](IndexWriter::export_copy) and [`encode`](IndexExport::encode) in one
    /// call, for when stalling the event thread for the whole export is acceptable.
    pub fn export(
        &self,
        url_of: impl FnMut(WorkerId) -> Option<String>,
        watermark_of: impl FnMut(Source) -> Option<i64>,
    ) -> Vec<u8> {
        self.export_copy(url_of, watermark_of).encode()
    }

    /// Copies, for a sibling copy's [`import`], the state of every source `url_of` names (a
    /// worker's URL is its only name both copies share); sources of unnamed workers (being
    /// removed, say) are left out. `watermark_of` gives each source's last applied batch: call
    /// this between batches, so the blocks and the watermarks agree.
    ///
    /// [`import`]: IndexWriter::import
    pub fn export_copy(
        &self,
        mut url_of: impl FnMut(WorkerId) -> Option<String>,
        mut watermark_of: impl FnMut(Source) -> Option<i64>,
    ) -> IndexExport {
        let mut out = IndexExport::default();
        for source in self.export_sources() {
            if let Some(url) = url_of(source.worker) {
                self.export_source(source, url, watermark_of(source), &mut out);
            }
        }
        out
    }

    /// The sources an export lists, in its order.
    pub fn export_sources(&self) -> Vec<Source> {
        let mut keys: Vec<Source> = self.sources.keys().copied().collect();
        keys.sort_unstable();
        keys
    }

    /// Copy one source into `out` (named `url`, its last applied batch `watermark`): the writer
    /// may apply other sources' events before the next one is copied, as long as this source's
    /// copy and watermark agree.
    pub fn export_source(
        &self,
        source: Source,
        url: String,
        watermark: Option<i64>,
        out: &mut IndexExport,
    ) {
        if u32::try_from(url.len()).is_err() {
            return;
        }
        let Some(state) = self.sources.get(&source) else {
            return;
        };
        out.sources.push(ExportedSource {
            url,
            dp_rank: source.dp_rank,
            block_size: u32::try_from(state.block_size).unwrap_or(0),
            watermark,
            state: state.clone(),
        });
    }
}

impl IndexExport {
    /// Sources copied so far.
    pub fn len(&self) -> usize {
        self.sources.len()
    }

    /// Nothing copied yet.
    pub fn is_empty(&self) -> bool {
        self.sources.is_empty()
    }
}

impl IndexWriter {
    /// Rebuilds the sources of a sibling's [`export`] (start-up with `--kv-bootstrap-peer`), each
    /// under the worker `worker_of` gives for its URL (sources of unknown URLs are skipped and
    /// counted). A source that already holds blocks is reset first; sources absent from the
    /// payload are untouched. Every cap holds: each source keeps at most its cap, and when the
    /// sources together exceed what the global cap leaves, the largest give up blocks first,
    /// down to a common level — in both cases the blocks the peer would have evicted first.
    ///
    /// Readers see the result after the next [`publish`]. Apply the publishers' live batches
    /// after each returned watermark on top.
    ///
    /// [`export`]: IndexWriter::export
    /// [`publish`]: IndexWriter::publish
    pub fn import(
        &mut self,
        data: &[u8],
        mut worker_of: impl FnMut(&str) -> Option<WorkerId>,
    ) -> Result<ImportSummary, ImportError> {
        let parts = parse(data)?;
        let mut summary = ImportSummary::default();
        let mut seen = HashSet::new();
        let mut accepted = Vec::new();
        for (i, part) in parts.iter().enumerate() {
            let Some(worker) = worker_of(part.url) else {
                summary.unknown += 1;
                continue;
            };
            let source = Source {
                worker,
                dp_rank: part.dp_rank,
            };
            if !seen.insert(source) || self.admit(part, source).is_err() {
                summary.refused += 1;
                continue;
            }
            accepted.push((i, source));
        }
        let room = self.cfg.max_blocks.saturating_sub(self.held);
        let wants: Vec<usize> = accepted
            .iter()
            .map(|&(i, _)| parts[i].blocks.min(self.cfg.max_blocks_per_source))
            .collect();
        let budgets = share(&wants, room);
        for (&(i, source), budget) in accepted.iter().zip(budgets) {
            let part = &parts[i];
            let blocks = self.fill(data, part, source, budget);
            summary.sources.push(ImportedSource {
                source,
                watermark: part.watermark,
                blocks,
                left_out: part.blocks - blocks,
            });
        }
        self.stats.held.store(self.held as u64, Relaxed);
        Ok(summary)
    }

    /// Makes `source` known under the part's model, as `apply` would for its first event (the
    /// same caps), takes its block size, and empties the source.
    fn admit(&mut self, part: &Part<'_>, source: Source) -> Result<(), DropReason> {
        if source.dp_rank >= self.cfg.max_dp_ranks {
            return Err(DropReason::Limits);
        }
        let mi = self.model_index(part.model)?;
        let block_size = part.block_size as usize;
        // Its server announced another page size to this copy: the peer's blocks are not ours.
        if let Some(&announced) = self.announced.get(&source) {
            if part.blocks > 0 && announced != block_size {
                return Err(DropReason::BlockSizeMismatch);
            }
        }
        self.register(source, mi)?;
        if self.held_by(source) > 0 {
            self.reset_source(source);
        }
        // Learned as the peer learned it (possibly from an event it then dropped).
        if let Some(s) = self.sources.get_mut(&source) {
            if s.block_size == 0 && block_size != 0 {
                s.block_size = block_size;
                self.models[mi].resize(0, block_size);
            }
        }
        Ok(())
    }

    /// Adds the first `budget` blocks of `part` to the (empty) `source`; returns how many it
    /// holds. The result is the peer's records as its own eviction down to `budget` would leave
    /// them (see the module doc).
    fn fill(&mut self, data: &[u8], part: &Part<'_>, source: Source, budget: usize) -> usize {
        let Ok(mi) = self.models.binary_search_by(|m| (*m.name).cmp(part.model)) else {
            return 0;
        };
        let Some(s) = self.sources.get_mut(&source) else {
            return 0;
        };
        let trie = &mut self.models[mi].trie;
        let mut r = Reader { data, pos: part.at };
        let mut blocks = BlockReader::new(part.blocks);
        s.blocks.reserve(budget);
        // Per kept block, by arrival; its `Rec::stamp` holds its position here until the end, and
        // its `Rec::children` counts the kept blocks listed after it under it.
        let mut kept: Vec<Kept> = Vec::with_capacity(budget);
        // The stamp rank of every block past the budget.
        let mut tail: Vec<u32> = Vec::new();
        // Own hashes to hold (with their tiers), added to the trie at the end in its path order.
        let mut owns: Vec<(u64, u8)> = Vec::with_capacity(budget);
        for i in 0..part.blocks {
            // Checked by `parse` already; stop rather than trust a second read blindly.
            let Ok(b) = blocks.next(&mut r) else {
                break;
            };
            if i >= budget {
                let parent = b.parent.and_then(|p| s.blocks.get(&p));
                if let Some(k) = parent.and_then(|pr| kept.get_mut(pr.stamp as usize)) {
                    k.tail += 1;
                    k.first_tail = k.first_tail.min(tail.len() as u32);
                }
                tail.push(b.rank as u32);
                continue;
            }
            if s.blocks.contains_key(&b.eh) {
                continue;
            }
            if let Some(pr) = b.parent.and_then(|p| s.blocks.get_mut(&p)) {
                pr.children += 1;
            }
            let rec = Rec {
                own: b.own,
                tiers: b.tiers,
                parent: b.parent,
                children: 0,
                stamp: kept.len() as u64,
            };
            kept.push(Kept {
                children: b.children,
                tail: 0,
                first_tail: u32::MAX,
                rank: b.rank as u32,
            });
            s.blocks.insert(b.eh, rec);
            owns.push((b.own, b.tiers));
        }
        // The trie takes 6 key bits a level, lowest first: in the order of the reversed bits,
        // consecutive keys share their path, so each insert walks nodes the last one left in
        // cache (the trie's shape depends only on its keys, not on their order).
        owns.sort_unstable_by_key(|(k, _)| k.reverse_bits());
        for (own, tiers) in owns {
            for t in Tier::ALL {
                if tiers & t.bit() != 0 {
                    hold(&mut s.extra, s.id, trie, own, t);
                }
            }
        }
        // Newest stamp from each tail position on: what a block removed there carried up.
        for j in (0..tail.len().saturating_sub(1)).rev() {
            tail[j] = tail[j].max(tail[j + 1]);
        }
        // Stamps: the ranks, all before anything this copy stores next.
        let base = self.clock + 1;
        for r in s.blocks.values_mut() {
            let Some(k) = kept.get(r.stamp as usize) else {
                continue;
            };
            // The peer's count less the children its eviction would remove, never more than the
            // children listed under it (an exporter's count never is; a forged one might be).
            let left = k.children.saturating_sub(k.tail);
            r.children = r.children.min(left);
            r.stamp = base + u64::from(k.rank);
            if k.children > 0 && left == 0 {
                // Emptied by the cut: as recent as its last child the eviction would remove
                // (exactly that child when the peer's count was exact, as it is unless the server
                // removed a block before its children).
                if let Some(&newest) = tail.get(k.first_tail as usize) {
                    r.stamp = r.stamp.max(base + u64::from(newest));
                }
            }
        }
        s.leaves = s
            .blocks
            .iter()
            .filter(|(_, r)| r.children == 0)
            .map(|(eh, r)| (r.stamp, *eh))
            .collect();
        self.clock += part.blocks as u64;
        self.held += kept.len();
        kept.len()
    }
}

/// An imported block's data needed once all of its source's blocks are read.
struct Kept {
    /// The peer's children count.
    children: u32,
    /// Blocks past the budget listed under it.
    tail: u32,
    /// Tail position of the first of them.
    first_tail: u32,
    /// Stamp rank.
    rank: u32,
}

impl IndexExport {
    /// The payload (format in the module doc). Costs, besides the output (~17 bytes a block),
    /// a second copy of the largest source's records while its eviction order is worked out.
    pub fn encode(self) -> Vec<u8> {
        let blocks: usize = self.sources.iter().map(|s| s.state.blocks.len()).sum();
        let mut out = Vec::with_capacity(16 + self.sources.len() * 96 + blocks * 18);
        out.extend_from_slice(&MAGIC);
        put_u32(&mut out, VERSION);
        put_u32(&mut out, self.sources.len() as u32);
        for s in &self.sources {
            put_str(&mut out, &s.url);
            put_u32(&mut out, s.dp_rank);
            put_str(&mut out, &s.state.model);
            put_u32(&mut out, s.block_size);
            match s.watermark {
                None => out.push(0),
                Some(w) => {
                    out.push(1);
                    out.extend_from_slice(&w.to_le_bytes());
                }
            }
            put_blocks(&mut out, &s.state);
        }
        out
    }
}

/// Writes `s`'s block count and blocks, first to be kept first (see the module doc).
fn put_blocks(out: &mut Vec<u8>, s: &SourceState) {
    let mut order = keep_order(s);
    order.truncate(u32::MAX as usize);
    put_u32(out, order.len() as u32);
    let recs: Vec<(EngineHash, Rec)> = order
        .iter()
        .filter_map(|eh| s.blocks.get(eh).map(|r| (*eh, *r)))
        .collect();
    drop(order);
    // Stamps as ranks among the source's blocks: dense, so they cost little as deltas, and a
    // receiver can place them below its own clock without trusting their range.
    let mut by_stamp: Vec<(u64, u32)> = recs
        .iter()
        .enumerate()
        .map(|(i, (_, r))| (r.stamp, i as u32))
        .collect();
    by_stamp.sort_unstable();
    let mut rank = vec![0u32; recs.len()];
    for (k, &(_, i)) in by_stamp.iter().enumerate() {
        rank[i as usize] = k as u32;
    }
    drop(by_stamp);
    let mut prev_rank = 0i64;
    let mut prev = None;
    for ((eh, r), &rank) in recs.iter().zip(&rank) {
        let kind = match r.parent {
            None => ROOT,
            Some(p) if Some(p) == prev => PREVIOUS,
            Some(_) => GIVEN,
        };
        let children = u64::from(r.children);
        let tiered = u64::from(r.tiers != DEVICE_ONLY);
        put_varint(
            out,
            zigzag(i64::from(rank) - prev_rank) << 5 | tiered << 4 | children.min(3) << 2 | kind,
        );
        if children >= 3 {
            put_varint(out, children - 3);
        }
        if tiered == 1 {
            out.push(r.tiers);
        }
        out.extend_from_slice(&eh.0.to_le_bytes());
        out.extend_from_slice(&r.own.to_le_bytes());
        if kind == GIVEN {
            if let Some(p) = r.parent {
                out.extend_from_slice(&p.0.to_le_bytes());
            }
        }
        prev_rank = i64::from(rank);
        prev = Some(*eh);
    }
}

/// `s`'s blocks in the reverse of the order the caps would evict them, worked out on a copy by
/// the writer's own eviction step.
fn keep_order(s: &SourceState) -> Vec<EngineHash> {
    let mut sim = s.clone();
    // Nothing to remove from: the copy's holdings are not in any trie.
    let mut no_trie = Trie::default();
    let mut order = Vec::with_capacity(s.blocks.len());
    while let Some(eh) = next_victim(&sim) {
        remove_block(&mut sim, &mut no_trie, eh);
        order.push(eh);
    }
    order.reverse();
    order
}

/// Shares `room` blocks among sources wanting `wants`: all they want when it fits, otherwise
/// the smallest get theirs and the rest a common level (the remainder one block each to the
/// first of them), as the global cap's eviction trims the largest source first.
fn share(wants: &[usize], room: usize) -> Vec<usize> {
    if wants.iter().fold(0usize, |a, &w| a.saturating_add(w)) <= room {
        return wants.to_vec();
    }
    let mut order: Vec<usize> = (0..wants.len()).collect();
    order.sort_by_key(|&i| wants[i]);
    let mut got = vec![0; wants.len()];
    let mut left = room;
    for (k, &i) in order.iter().enumerate() {
        let rest = wants.len() - k;
        let level = left / rest;
        if wants[i] <= level {
            got[i] = wants[i];
            left -= wants[i];
            continue;
        }
        let extra = left % rest;
        for (j, &i) in order[k..].iter().enumerate() {
            got[i] = level + usize::from(j < extra);
        }
        break;
    }
    got
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_u32(out, s.len() as u32);
    out.extend_from_slice(s.as_bytes());
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    (v >> 1) as i64 ^ -((v & 1) as i64)
}

/// One source of a checked payload; its blocks are read again from `at`.
#[derive(Debug)]
struct Part<'a> {
    url: &'a str,
    dp_rank: u32,
    model: &'a str,
    block_size: u32,
    watermark: Option<i64>,
    blocks: usize,
    at: usize,
}

/// Checks the whole payload; the sources, with where their blocks start.
fn parse(data: &[u8]) -> Result<Vec<Part<'_>>, ImportError> {
    if data.get(..MAGIC.len()) != Some(&MAGIC[..]) {
        return Err(ImportError::NotAnExport);
    }
    let mut r = Reader {
        data,
        pos: MAGIC.len(),
    };
    let version = r.u32()?;
    if version != VERSION {
        return Err(ImportError::Version(version));
    }
    let count = r.count(MIN_SOURCE)?;
    let mut parts = Vec::with_capacity(count);
    for _ in 0..count {
        let url = r.str()?;
        let dp_rank = r.u32()?;
        let model = r.str()?;
        let block_size_at = r.pos;
        let block_size = r.u32()?;
        let watermark = match r.u8()? {
            0 => None,
            1 => Some(i64::from_le_bytes(r.array()?)),
            _ => return Err(r.corrupt(r.pos - 1, "watermark tag")),
        };
        let blocks = r.count(MIN_BLOCK)?;
        if blocks > 0 && block_size == 0 {
            return Err(r.corrupt(block_size_at, "zero block size"));
        }
        let at = r.pos;
        let mut b = BlockReader::new(blocks);
        for _ in 0..blocks {
            b.next(&mut r)?;
        }
        parts.push(Part {
            url,
            dp_rank,
            model,
            block_size,
            watermark,
            blocks,
            at,
        });
    }
    if r.pos != data.len() {
        return Err(r.corrupt(r.pos, "bytes after the last source"));
    }
    Ok(parts)
}

/// One block as read.
struct Block {
    eh: EngineHash,
    own: u64,
    tiers: u8,
    parent: Option<EngineHash>,
    children: u32,
    rank: u64,
}

/// Reads one source's blocks in order (each refers to the one before).
struct BlockReader {
    blocks: u64,
    rank: u64,
    prev: Option<EngineHash>,
}

impl BlockReader {
    fn new(blocks: usize) -> Self {
        BlockReader {
            blocks: blocks as u64,
            rank: 0,
            prev: None,
        }
    }

    fn next(&mut self, r: &mut Reader<'_>) -> Result<Block, ImportError> {
        let at = r.pos;
        let head = r.varint()?;
        let (rank_delta, has_tiers) = (head >> 5, head >> 4 & 1 == 1);
        let rank = i64::try_from(self.rank)
            .ok()
            .and_then(|p| p.checked_add(unzigzag(rank_delta)))
            .and_then(|v| u64::try_from(v).ok())
            .filter(|&v| v < self.blocks)
            .ok_or(r.corrupt(at, "stamp rank"))?;
        let mut children = (head >> 2) & 3;
        if children == 3 {
            children = r.varint()?.saturating_add(3);
        }
        // Fewer than the blocks listed: each child is another of them.
        let children = u32::try_from(children)
            .ok()
            .filter(|&c| u64::from(c) < self.blocks)
            .ok_or(r.corrupt(at, "children count"))?;
        let tiers = if has_tiers {
            let t = r.u8()?;
            if t == 0 || t >= 1 << Tier::ALL.len() {
                return Err(r.corrupt(at, "tiers"));
            }
            t
        } else {
            DEVICE_ONLY
        };
        let eh = EngineHash(u64::from_le_bytes(r.array()?));
        let own = u64::from_le_bytes(r.array()?);
        let parent = match head & 3 {
            ROOT => None,
            PREVIOUS => Some(self.prev.ok_or(r.corrupt(at, "first block's parent"))?),
            GIVEN => Some(EngineHash(u64::from_le_bytes(r.array()?))),
            _ => return Err(r.corrupt(at, "parent kind")),
        };
        self.rank = rank;
        self.prev = Some(eh);
        Ok(Block {
            eh,
            own,
            tiers,
            parent,
            children,
            rank,
        })
    }
}

/// A cursor over the payload; every read checks the bytes left.
struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ImportError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or(ImportError::Truncated { at: self.pos })?;
        let b = &self.data[self.pos..end];
        self.pos = end;
        Ok(b)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], ImportError> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8, ImportError> {
        Ok(self.array::<1>()?[0])
    }

    fn u32(&mut self) -> Result<u32, ImportError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    /// A `u32` count of items at least `min` bytes each, refused unless the rest can hold them.
    fn count(&mut self, min: usize) -> Result<usize, ImportError> {
        let at = self.pos;
        let n = self.u32()? as usize;
        let left = self.data.len() - self.pos;
        if n.checked_mul(min).is_none_or(|b| b > left) {
            return Err(ImportError::Truncated { at });
        }
        Ok(n)
    }

    fn str(&mut self) -> Result<&'a str, ImportError> {
        let at = self.pos;
        let len = self.u32()? as usize;
        std::str::from_utf8(self.take(len)?).map_err(|_| self.corrupt(at, "text not utf-8"))
    }

    fn varint(&mut self) -> Result<u64, ImportError> {
        let at = self.pos;
        let mut v = 0u64;
        for i in 0..10 {
            let b = self.u8()?;
            if i == 9 && b > 1 {
                break;
            }
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(self.corrupt(at, "varint over 64 bits"))
    }

    fn corrupt(&self, at: usize, what: &'static str) -> ImportError {
        ImportError::Corrupt { at, what }
    }
}

/// One record as tests compare it: `(engine hash, own hash, parent, children, stamp rank,
/// tiers)`.
#[cfg(test)]
pub(in crate::kv::index) type RecordView = (u64, u64, Option<u64>, u32, usize, u8);

/// Test helpers: one source's records in a form two copies can be compared by, and eviction to
/// a given size (what an importer with that cap should end up with).
#[cfg(test)]
impl IndexWriter {
    /// `(engine hash, own hash, parent, children, stamp rank)` sorted by engine hash; stamps as
    /// ranks among the source's records (ties by engine hash), since two copies' clocks differ.
    pub(in crate::kv::index) fn records(&self, source: Source) -> Vec<RecordView> {
        let Some(s) = self.sources.get(&source) else {
            return Vec::new();
        };
        let mut by_stamp: Vec<(u64, EngineHash)> =
            s.blocks.iter().map(|(eh, r)| (r.stamp, *eh)).collect();
        by_stamp.sort_unstable();
        let mut v: Vec<_> = by_stamp
            .iter()
            .enumerate()
            .map(|(rank, (_, eh))| {
                let r = s.blocks[eh];
                (
                    eh.0,
                    r.own,
                    r.parent.map(|p| p.0),
                    r.children,
                    rank,
                    r.tiers,
                )
            })
            .collect();
        v.sort_unstable();
        v
    }

    /// Evicts `source` down to `keep` blocks, as its cap would.
    pub(in crate::kv::index) fn evict_to(&mut self, source: Source, keep: usize) {
        self.evict_from(source, keep);
    }

    /// New caps, applied from the next event on.
    pub(in crate::kv::index) fn set_config(&mut self, cfg: IndexConfig) {
        self.cfg = cfg;
    }
}

#[cfg(test)]
mod tests;
