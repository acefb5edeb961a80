//! What readers see: an immutable snapshot of every model's block map, and prefix matching on it.

use super::trie::{source_of, SourceId, Trie};
use super::{block_hash, Source};
use crate::kv::wire::Tier;

/// The tiers a hit is scored for: the device (as it is) and host memory (weighted by the
/// caller). Copies beyond (disk, external pools) are tracked, not scored.
const SCORED: u8 = 1 << Tier::Device as u8 | 1 << Tier::Host as u8;
const DEVICE: u8 = 1 << Tier::Device as u8;
use arc_swap::{ArcSwap, Guard};
use std::sync::Arc;

/// One model as published: its block size (0 until learned) and its block map.
#[derive(Debug, Clone, Default)]
pub(super) struct ModelView {
    pub(super) block_size: usize,
    pub(super) trie: Trie,
}

/// A read-only view of the whole index at one publish. Cheap to hold for one routing decision;
/// never hold it across an `.await` (it pins the trie nodes the writer has replaced since).
#[derive(Debug, Default)]
pub struct Snapshot {
    /// Per model, sorted by name (binary search; a handful of models).
    pub(super) models: Vec<(Arc<str>, ModelView)>,
    /// Source of each [`SourceId`] (None = free number).
    pub(super) sources: Arc<[Option<Source>]>,
    pub(super) epoch: u64,
}

/// How far one source holds a prompt, in blocks of the model's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct PrefixMatch {
    /// The worker and rank holding the prefix.
    pub source: Source,
    /// Leading blocks held on the device (GPU): used as they are.
    pub blocks: u32,
    /// Leading blocks held on the device or in host memory (at least `blocks`, at least 1):
    /// those past `blocks` are loaded back before use.
    pub with_host: u32,
}

/// Buffers one reader reuses across matches (one per core), so matching allocates nothing once
/// they have grown: the bytes of one block being hashed, the sources still matching (with their
/// device depth and whether it still grows), the result.
#[derive(Debug, Default)]
pub struct MatchScratch {
    bytes: Vec<u8>,
    active: Vec<(SourceId, u32, bool)>,
    out: Vec<PrefixMatch>,
}

impl Snapshot {
    fn model(&self, model: &str) -> Option<&ModelView> {
        let i = self
            .models
            .binary_search_by(|(k, _)| (**k).cmp(model))
            .ok()?;
        Some(&self.models[i].1)
    }

    /// Publish sequence number (increments on every publish).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The model's block size, once learned from its events: prompts are hashed in blocks of it
    /// and a final partial block never matches.
    pub fn block_size(&self, model: &str) -> Option<usize> {
        self.model(model).map(|m| m.block_size).filter(|&b| b > 0)
    }

    /// Distinct blocks of the model (a block on several sources counts once).
    pub fn blocks(&self, model: &str) -> usize {
        self.model(model).map_or(0, |m| m.trie.len())
    }

    /// Models the index knows, by name.
    pub fn models(&self) -> impl Iterator<Item = &str> + '_ {
        self.models.iter().map(|(k, _)| &**k)
    }

    /// For each source holding a prefix of `tokens` from `root` (its namespace,
    /// [`super::namespace_root`]) on the device or in host memory, how many leading blocks it
    /// holds there ([`PrefixMatch`]); sources holding none are absent, order unspecified.
    /// Hashes block by block and stops at the first block no remaining source holds, so the
    /// cost follows the longest match, not the prompt. Allocates nothing once `scratch` has
    /// grown. (The request path matches a chain hashed once, [`Snapshot::match_chain`]; this is
    /// its reference.)
    pub fn match_prefix<'s>(
        &self,
        model: &str,
        root: u64,
        tokens: &[u32],
        scratch: &'s mut MatchScratch,
    ) -> &'s [PrefixMatch] {
        let MatchScratch { bytes, active, out } = scratch;
        active.clear();
        out.clear();
        let Some(m) = self.model(model).filter(|m| m.block_size > 0) else {
            return out;
        };
        let mut parent = root;
        let mut depth = 0u32;
        for block in tokens.chunks_exact(m.block_size) {
            let h = block_hash(parent, block, bytes);
            let Some(holders) = m.trie.get(h) else {
                break;
            };
            if depth == 0 {
                for &hd in holders.as_slice() {
                    let s = source_of(hd);
                    if holders.tiers_of(s) & SCORED != 0 && !active.iter().any(|a| a.0 == s) {
                        active.push((s, 0, true));
                    }
                }
            }
            active.retain_mut(|(s, dev, open)| {
                let tiers = holders.tiers_of(*s);
                if tiers & SCORED == 0 {
                    push(out, &self.sources, *s, *dev, depth);
                    return false;
                }
                if *open && tiers & DEVICE != 0 {
                    *dev = depth + 1;
                } else {
                    *open = false;
                }
                true
            });
            if active.is_empty() {
                return out;
            }
            depth += 1;
            parent = h;
        }
        for &(s, dev, _) in active.iter() {
            push(out, &self.sources, s, dev, depth);
        }
        out
    }
}

impl Snapshot {
    /// [`Snapshot::match_prefix`] on a prompt already hashed into its block chain
    /// ([`super::chain_hashes`] at this model's block size): the request path hashes a prompt
    /// once and matches the chain here and against the routed-but-unconfirmed entries.
    ///
    /// Logarithmic in the prompt: the servers' caches are prefix-closed (a radix cache evicts
    /// leaves, and so does this index's own cap), so a source holding block `d` of a chain holds
    /// blocks `0..d` too, and each holder's depth is found by binary search — ~12 lookups per
    /// holder for a 4k-block prompt instead of one per block (at SGLang's default page size of
    /// one token, a block per prompt token). Where a server broke that order, the answer can
    /// only name a deeper block that it does hold. Depths are counted on the device and over
    /// the device and host memory together ([`PrefixMatch`]).
    pub fn match_chain<'s>(
        &self,
        model: &str,
        chain: &[u64],
        scratch: &'s mut MatchScratch,
    ) -> &'s [PrefixMatch] {
        let MatchScratch { active, out, .. } = scratch;
        active.clear();
        out.clear();
        let Some(m) = self.model(model).filter(|m| m.block_size > 0) else {
            return out;
        };
        let Some(first) = chain.first().and_then(|&h| m.trie.get(h)) else {
            return out;
        };
        for &hd in first.as_slice() {
            let s = source_of(hd);
            let tiers = first.tiers_of(s);
            if tiers & SCORED != 0 && !active.iter().any(|a| a.0 == s) {
                active.push((s, 0, tiers & DEVICE != 0));
            }
        }
        // Largest d in 1..=hi with chain[d-1] held by s in one of `tiers` (d = 1 is known).
        let deepest = |s: SourceId, tiers: u8, hi: usize| {
            let (mut lo, mut hi) = (1usize, hi);
            while lo < hi {
                let mid = lo + (hi - lo).div_ceil(2);
                if m.trie
                    .get(chain[mid - 1])
                    .is_some_and(|h| h.tiers_of(s) & tiers != 0)
                {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
            lo
        };
        for &(s, _, on_device) in active.iter() {
            // Each tier's copies are prefix-closed (a radix cache evicts leaves), and so is
            // their union: both depths are found by binary search.
            let with_host = deepest(s, SCORED, chain.len());
            let device = if on_device {
                deepest(s, DEVICE, with_host)
            } else {
                0
            };
            push(out, &self.sources, s, device as u32, with_host as u32);
        }
        out
    }
}

fn push(
    out: &mut Vec<PrefixMatch>,
    sources: &[Option<Source>],
    s: SourceId,
    blocks: u32,
    with_host: u32,
) {
    if let Some(Some(source)) = sources.get(s as usize) {
        out.push(PrefixMatch {
            source: *source,
            blocks,
            with_host,
        });
    }
}

/// What every core holds: the published snapshot. Cheap to clone.
#[derive(Debug, Clone)]
pub struct IndexReader {
    pub(super) shared: Arc<ArcSwap<Snapshot>>,
}

impl IndexReader {
    /// The current snapshot (lock-free). Drop the guard before any `.await`.
    pub fn load(&self) -> Guard<Arc<Snapshot>> {
        self.shared.load()
    }
}

#[cfg(test)]
mod tests {
    use super::super::{chain_hashes, IndexConfig, IndexWriter, KvEvent, Source, ROOT_PARENT};
    use super::MatchScratch;
    use crate::kv::wire::{BlockStored, EngineHash};

    #[test]
    fn matching_a_hashed_chain_equals_matching_the_tokens() {
        let mut w = IndexWriter::new(IndexConfig::default());
        let tokens: Vec<u32> = (0..40).collect();
        // Worker 3 has 7 blocks in host memory and the first 3 of them on the GPU too; worker
        // 4 has 5 in host memory only.
        for (worker, blocks, medium) in [
            (1u32, 10usize, None),
            (2, 4, Some("GPU")),
            (3, 7, Some("CPU_PINNED")),
            (3, 3, Some("GPU")),
            (4, 5, Some("CPU_PINNED")),
            (5, 6, Some("DISK")),
        ] {
            let stored = BlockStored {
                block_hashes: (0..blocks as u64).map(EngineHash).collect(),
                parent: None,
                token_ids: tokens[..blocks * 4].to_vec(),
                block_size: 4,
                lora_id: None,
                medium: medium.map(Into::into),
                cache_salt: None,
                lora_name: None,
            };
            let source = Source { worker, dp_rank: 0 };
            w.apply("m", source, &KvEvent::BlockStored(stored)).unwrap();
        }
        w.check();
        w.publish();
        let snap = w.reader().load();
        let (mut a, mut b) = (MatchScratch::default(), MatchScratch::default());
        let (mut chain, mut buf) = (Vec::new(), Vec::new());
        for len in [0, 3, 4, 15, 16, 17, 40] {
            chain_hashes(
                &tokens[..len],
                4,
                ROOT_PARENT,
                usize::MAX,
                &mut chain,
                &mut buf,
            );
            assert_eq!(chain.len(), len / 4);
            let mut x = snap
                .match_prefix("m", ROOT_PARENT, &tokens[..len], &mut a)
                .to_vec();
            let mut y = snap.match_chain("m", &chain, &mut b).to_vec();
            x.sort_unstable();
            y.sort_unstable();
            assert_eq!(x, y, "{len} tokens");
        }
        let found: Vec<(u32, u32, u32)> = {
            let mut v: Vec<_> = snap
                .match_chain("m", &chain, &mut b)
                .iter()
                .map(|m| (m.source.worker, m.blocks, m.with_host))
                .collect();
            v.sort_unstable();
            v
        };
        // Beyond-host copies (DISK) are not scored: worker 5 is absent.
        assert_eq!(found, [(1, 10, 10), (2, 4, 4), (3, 3, 7), (4, 0, 5)]);
        chain_hashes(&tokens, 4, ROOT_PARENT, 3, &mut chain, &mut buf);
        assert_eq!(chain.len(), 3, "capped");
    }
}
