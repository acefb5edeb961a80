use super::*;
use proptest::prelude::*;
use std::collections::{HashMap, HashSet};

pub(super) const M: &str = "m";

pub(super) fn src(worker: WorkerId, dp_rank: u32) -> Source {
    Source { worker, dp_rank }
}

pub(super) fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], bs: usize) -> KvEvent {
    KvEvent::BlockStored(crate::kv::wire::BlockStored {
        block_hashes: hashes.iter().map(|&h| EngineHash(h)).collect(),
        parent: parent.map(EngineHash),
        token_ids: tokens.to_vec(),
        block_size: bs as u32,
        lora_id: None,
        medium: None,
        cache_salt: None,
        lora_name: None,
    })
}

pub(super) fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::BlockRemoved(crate::kv::wire::BlockRemoved {
        block_hashes: hashes.iter().map(|&h| EngineHash(h)).collect(),
        medium: None,
    })
}

/// Publishes and matches, results sorted by source.
pub(super) fn matches(w: &mut IndexWriter, model: &str, tokens: &[u32]) -> Vec<(Source, u32)> {
    w.publish();
    w.check();
    let snap = w.reader().load();
    let mut scratch = MatchScratch::default();
    let mut v: Vec<_> = snap
        .match_prefix(model, crate::kv::index::ROOT_PARENT, tokens, &mut scratch)
        .iter()
        .map(|m| (m.source, m.blocks))
        .collect();
    v.sort();
    v
}

pub(super) fn seq(n: usize, start: u32) -> Vec<u32> {
    (start..start + n as u32).collect()
}

#[test]
fn store_chain_and_match_whole_blocks_only() {
    let mut w = IndexWriter::new(IndexConfig::default());
    let t = seq(12, 0);
    w.apply(M, src(1, 0), &stored(&[10, 11, 12], None, &t, 4))
        .unwrap();
    assert_eq!(matches(&mut w, M, &t), vec![(src(1, 0), 3)]);
    // A final partial block never matches; a prompt diverging in block 1 matches block 0.
    assert_eq!(matches(&mut w, M, &t[..11]), vec![(src(1, 0), 2)]);
    let mut other = t.clone();
    other[5] = 99;
    assert_eq!(matches(&mut w, M, &other), vec![(src(1, 0), 1)]);
    assert_eq!(matches(&mut w, M, &[7, 7, 7, 7]), vec![]);
    assert_eq!(matches(&mut w, M, &[]), vec![]);
    assert_eq!(matches(&mut w, "other", &t), vec![]);
    assert_eq!(w.reader().load().block_size(M), Some(4));
    assert_eq!(w.reader().load().blocks(M), 3);
}

#[test]
fn parent_chains_across_events() {
    let mut w = IndexWriter::new(IndexConfig::default());
    let t = seq(12, 100);
    w.apply(M, src(1, 0), &stored(&[1], None, &t[..4], 4))
        .unwrap();
    w.apply(M, src(1, 0), &stored(&[2, 3], Some(1), &t[4..], 4))
        .unwrap();
    assert_eq!(matches(&mut w, M, &t), vec![(src(1, 0), 3)]);
    // The same tokens stored in one event hash the same: the keys are the tokens' own hashes.
    w.apply(M, src(2, 0), &stored(&[7, 8, 9], None, &t, 4))
        .unwrap();
    assert_eq!(matches(&mut w, M, &t), vec![(src(1, 0), 3), (src(2, 0), 3)]);
    assert_eq!(w.reader().load().blocks(M), 3);
}

#[test]
fn unknown_parent_is_dropped_with_its_descendants() {
    let mut w = IndexWriter::new(IndexConfig::default());
    let t = seq(8, 0);
    let r = w.apply(M, src(1, 0), &stored(&[2], Some(1), &t[4..], 4));
    assert_eq!(r, Err(DropReason::UnknownParent));
    let r = w.apply(M, src(1, 0), &stored(&[3], Some(2), &t[..4], 4));
    assert_eq!(r, Err(DropReason::UnknownParent));
    assert_eq!(w.held(), 0);
    assert_eq!(w.stats().dropped_unknown_parent(), 2);
    // Another worker's blocks are not this worker's parents.
    w.apply(M, src(2, 0), &stored(&[1], None, &t[..4], 4))
        .unwrap();
    let r = w.apply(M, src(1, 0), &stored(&[2], Some(1), &t[4..], 4));
    assert_eq!(r, Err(DropReason::UnknownParent));
    assert_eq!(matches(&mut w, M, &t), vec![(src(2, 0), 1)]);
}

#[test]
fn remove_clear_and_reset() {
    let mut w = IndexWriter::new(IndexConfig::default());
    let t = seq(12, 0);
    for rank in 0..2 {
        w.apply(M, src(1, rank), &stored(&[1, 2, 3], None, &t, 4))
            .unwrap();
    }
    w.apply(M, src(2, 0), &stored(&[1, 2, 3], None, &t, 4))
        .unwrap();
    // Removing the tail keeps the prefix; an unknown hash is counted, not fatal.
    w.apply(M, src(1, 0), &removed(&[3, 99])).unwrap();
    assert_eq!(w.stats().removed_unknown(), 1);
    assert_eq!(
        matches(&mut w, M, &t),
        vec![(src(1, 0), 2), (src(1, 1), 3), (src(2, 0), 3)]
    );
    // Removing a middle block cuts the match there even though block 2 stays held.
    w.apply(M, src(2, 0), &removed(&[2])).unwrap();
    assert_eq!(
        matches(&mut w, M, &t),
        vec![(src(1, 0), 2), (src(1, 1), 3), (src(2, 0), 1)]
    );
    w.apply(M, src(1, 1), &KvEvent::AllBlocksCleared).unwrap();
    assert_eq!(matches(&mut w, M, &t), vec![(src(1, 0), 2), (src(2, 0), 1)]);
    w.reset_worker(1);
    assert_eq!(matches(&mut w, M, &t), vec![(src(2, 0), 1)]);
    assert_eq!(w.held(), 2);
    w.remove_worker(2);
    assert_eq!(matches(&mut w, M, &t), vec![]);
    assert_eq!(w.held(), 0);
    assert_eq!(w.reader().load().blocks(M), 0);
}

#[test]
fn block_size_is_each_sources_own_and_the_model_goes_by_most_sources() {
    let mut w = IndexWriter::new(IndexConfig::default());
    let t = seq(16, 0);
    w.apply(M, src(1, 0), &stored(&[1], None, &t[..4], 4))
        .unwrap();
    w.apply(M, src(3, 0), &stored(&[1], None, &t[..4], 4))
        .unwrap();
    // A source that stores at another size (a lying or misconfigured one) keeps its own size
    // and breaks nobody else's: the model goes by most sources.
    w.apply(M, src(2, 0), &stored(&[5], None, &t[..8], 8))
        .unwrap();
    assert_eq!(
        w.apply(M, src(2, 0), &stored(&[6], None, &t[..4], 4)),
        Err(DropReason::BlockSizeMismatch)
    );
    assert_eq!(matches(&mut w, M, &t), vec![(src(1, 0), 1), (src(3, 0), 1)]);
    assert_eq!(w.reader().load().block_size(M), Some(4));
    // An empty store teaches nothing, not even a size.
    let empty = stored(&[], None, &[], 7);
    w.apply(M, src(4, 0), &empty).unwrap();
    w.apply(M, src(4, 0), &stored(&[1], None, &t[..4], 4))
        .unwrap();
    assert_eq!(w.reader().load().block_size(M), Some(4));
    // A size the server announced wins over what its events say.
    w.announce_block_size(src(5, 0), 4);
    assert_eq!(
        w.apply(M, src(5, 0), &stored(&[1], None, &t, 16)),
        Err(DropReason::BlockSizeMismatch)
    );
    w.apply(M, src(5, 0), &stored(&[1], None, &t[..4], 4))
        .unwrap();
    // Another model learns its own size.
    w.apply("n", src(6, 0), &stored(&[5], None, &t[..8], 8))
        .unwrap();
    assert_eq!(matches(&mut w, "n", &t), vec![(src(6, 0), 1)]);
    for worker in [1, 2, 3, 4, 5] {
        w.remove_worker(worker);
    }
    w.publish();
    assert_eq!(w.reader().load().block_size(M), None);
    w.apply(M, src(2, 0), &stored(&[5], None, &t[..8], 8))
        .unwrap();
    assert_eq!(matches(&mut w, M, &t), vec![(src(2, 0), 1)]);
}

#[test]
fn one_source_storing_the_same_block_often_holds_it_once() {
    let mut w = IndexWriter::new(IndexConfig::default());
    let t = seq(4, 0);
    // The same tokens under 1,000 engine ids: one holding in the trie, the copies counted.
    for id in 0..1_000u64 {
        w.apply(M, src(1, 0), &stored(&[id], None, &t, 4)).unwrap();
    }
    w.publish();
    w.check();
    let snap = w.reader().load();
    let chain = {
        let (mut c, mut b) = (Vec::new(), Vec::new());
        chain_hashes(&t, 4, ROOT_PARENT, usize::MAX, &mut c, &mut b);
        c
    };
    let holders = snap.models[0]
        .1
        .trie
        .get(chain[0])
        .unwrap()
        .as_slice()
        .len();
    assert_eq!(holders, 1);
    assert_eq!(w.held_by(src(1, 0)), 1_000);
    // It stays held until its last copy goes.
    for id in 0..999u64 {
        w.apply(M, src(1, 0), &removed(&[id])).unwrap();
    }
    assert_eq!(matches(&mut w, M, &t), vec![(src(1, 0), 1)]);
    w.apply(M, src(1, 0), &removed(&[999])).unwrap();
    assert_eq!(matches(&mut w, M, &t), vec![]);
}

#[test]
fn malformed_and_out_of_range_are_counted() {
    let mut w = IndexWriter::new(IndexConfig {
        max_dp_ranks: 4,
        max_models: 1,
        max_sources: 2,
        ..IndexConfig::default()
    });
    let t = seq(8, 0);
    let bad = [
        stored(&[1], None, &t, 4),
        stored(&[1], None, &t[..4], 0),
        stored(&[1, 2], None, &t[..4], 4),
        stored(&[u64::MAX], None, &t[..3], usize::MAX),
    ];
    for e in &bad {
        assert_eq!(w.apply(M, src(1, 0), e), Err(DropReason::Malformed));
    }
    assert_eq!(
        w.apply(M, src(1, 4), &stored(&[1], None, &t[..4], 4)),
        Err(DropReason::Limits)
    );
    assert_eq!(
        w.apply("n", src(1, 0), &stored(&[1], None, &t[..4], 4)),
        Err(DropReason::Limits)
    );
    w.apply(M, src(2, 0), &KvEvent::AllBlocksCleared).unwrap();
    assert_eq!(
        w.apply(M, src(3, 0), &KvEvent::AllBlocksCleared),
        Err(DropReason::Limits)
    );
    // Removing a worker frees its number for another.
    w.remove_worker(2);
    w.apply(M, src(3, 0), &KvEvent::AllBlocksCleared).unwrap();
    assert_eq!(w.stats().dropped_malformed(), 4);
    assert_eq!(w.stats().dropped_limits(), 3);
    w.check();
}

#[test]
fn duplicate_stores_are_idempotent_and_reused_ids_replace() {
    let mut w = IndexWriter::new(IndexConfig::default());
    let t = seq(8, 0);
    let e = stored(&[1, 2], None, &t, 4);
    w.apply(M, src(1, 0), &e).unwrap();
    w.apply(M, src(1, 0), &e).unwrap();
    assert_eq!(w.held(), 2);
    assert_eq!(w.stats().duplicate_stores(), 2);
    // The same tokens under other engine ids (another LoRA adapter): held twice, so removing one
    // copy keeps the block.
    w.apply(M, src(1, 0), &stored(&[3, 4], None, &t, 4))
        .unwrap();
    assert_eq!(w.held(), 4);
    w.apply(M, src(1, 0), &removed(&[1, 2])).unwrap();
    assert_eq!(matches(&mut w, M, &t), vec![(src(1, 0), 2)]);
    // Engine id 3 reused for other tokens: the old block goes.
    w.apply(M, src(1, 0), &stored(&[3], None, &[9, 9, 9, 9], 4))
        .unwrap();
    assert_eq!(matches(&mut w, M, &t), vec![]);
    assert_eq!(matches(&mut w, M, &[9, 9, 9, 9]), vec![(src(1, 0), 1)]);
}

#[test]
fn shared_prefix_across_workers_and_ranks() {
    let mut w = IndexWriter::new(IndexConfig::default());
    let system = seq(8, 0);
    let mut a = system.clone();
    a.extend(seq(8, 1000));
    let mut b = system.clone();
    b.extend(seq(8, 2000));
    w.apply(M, src(1, 0), &stored(&[1, 2, 3, 4], None, &a, 4))
        .unwrap();
    w.apply(M, src(1, 1), &stored(&[1, 2, 5, 6], None, &b, 4))
        .unwrap();
    w.apply(M, src(2, 0), &stored(&[1, 2], None, &system, 4))
        .unwrap();
    assert_eq!(w.reader().load().blocks(M), 0, "nothing published yet");
    assert_eq!(
        matches(&mut w, M, &a),
        vec![(src(1, 0), 4), (src(1, 1), 2), (src(2, 0), 2)]
    );
    assert_eq!(
        matches(&mut w, M, &b),
        vec![(src(1, 0), 2), (src(1, 1), 4), (src(2, 0), 2)]
    );
    assert_eq!(w.reader().load().blocks(M), 6);
}

#[test]
fn many_holders_spill_and_shrink() {
    let mut w = IndexWriter::new(IndexConfig::default());
    let t = seq(4, 0);
    for worker in 0..10 {
        w.apply(M, src(worker, 0), &stored(&[1], None, &t, 4))
            .unwrap();
    }
    assert_eq!(matches(&mut w, M, &t).len(), 10);
    for worker in 0..9 {
        w.apply(M, src(worker, 0), &removed(&[1])).unwrap();
    }
    assert_eq!(matches(&mut w, M, &t), vec![(src(9, 0), 1)]);
}

#[test]
fn a_source_moving_to_another_model_is_reset() {
    let mut w = IndexWriter::new(IndexConfig::default());
    let t = seq(4, 0);
    w.apply(M, src(1, 0), &stored(&[1], None, &t, 4)).unwrap();
    w.apply("n", src(1, 0), &stored(&[1], None, &t, 4)).unwrap();
    assert_eq!(matches(&mut w, M, &t), vec![]);
    assert_eq!(matches(&mut w, "n", &t), vec![(src(1, 0), 1)]);
}

#[test]
fn snapshots_are_isolated_from_later_writes() {
    let mut w = IndexWriter::new(IndexConfig::default());
    let t = seq(8, 0);
    w.apply(M, src(1, 0), &stored(&[1, 2], None, &t, 4))
        .unwrap();
    w.publish();
    let old = w.reader().shared.load_full();
    w.apply(M, src(1, 0), &removed(&[2])).unwrap();
    w.apply(M, src(2, 0), &stored(&[1, 2], None, &t, 4))
        .unwrap();
    w.publish();
    let mut s = MatchScratch::default();
    let got: Vec<_> = old
        .match_prefix(M, crate::kv::index::ROOT_PARENT, &t, &mut s)
        .to_vec();
    assert_eq!(
        got,
        vec![PrefixMatch {
            source: src(1, 0),
            blocks: 2,
            with_host: 2
        }]
    );
    assert!(w.reader().load().epoch() > old.epoch());
}

/// Over the per-source cap the least recently extended chain goes first, tail first; a shared
/// prefix that keeps being extended stays.
#[test]
fn eviction_takes_the_least_recently_extended_chain() {
    let mut w = IndexWriter::new(IndexConfig {
        max_blocks_per_source: 6,
        ..IndexConfig::default()
    });
    let s = src(1, 0);
    let chain = |base: u32| seq(8, base);
    // Root block (the "system prompt"), then three 2-block conversations under it, oldest first.
    w.apply(M, s, &stored(&[1], None, &[5, 5, 5, 5], 4))
        .unwrap();
    for (i, base) in [100u32, 200, 300].into_iter().enumerate() {
        let h = 10 * (i as u64 + 1);
        w.apply(M, s, &stored(&[h, h + 1], Some(1), &chain(base), 4))
            .unwrap();
    }
    assert_eq!(w.held(), 6, "7 blocks stored, cap 6");
    let prompt = |base: u32| {
        let mut p = vec![5, 5, 5, 5];
        p.extend(chain(base));
        p
    };
    // The oldest conversation lost its tail; the newer ones and the shared root are whole.
    assert_eq!(matches(&mut w, M, &prompt(100)), vec![(s, 2)]);
    assert_eq!(matches(&mut w, M, &prompt(200)), vec![(s, 3)]);
    assert_eq!(matches(&mut w, M, &prompt(300)), vec![(s, 3)]);
    // Two more blocks: the oldest conversation's head goes, then the next oldest tail.
    w.apply(M, s, &stored(&[40, 41], Some(31), &seq(8, 400), 4))
        .unwrap();
    assert_eq!(matches(&mut w, M, &prompt(100)), vec![(s, 1)]);
    assert_eq!(matches(&mut w, M, &prompt(200)), vec![(s, 2)]);
    assert_eq!(matches(&mut w, M, &prompt(300)), vec![(s, 3)]);
    assert_eq!(w.stats().evicted(), 3);
}

/// A flood of fresh chains from many sources never holds more than the caps, and the newest
/// chains stay matchable.
#[test]
fn flood_stays_within_the_caps() {
    let cfg = IndexConfig {
        max_blocks: 2_000,
        max_blocks_per_source: 700,
        max_sources: 8,
        ..IndexConfig::default()
    };
    let mut w = IndexWriter::new(cfg.clone());
    let mut last = Vec::new();
    for i in 0..3_000u32 {
        let s = src(i % 10, 0);
        let tokens = seq(64, i * 64);
        let hashes: Vec<u64> = (0..16).map(|b| (i as u64) << 8 | b).collect();
        let r = w.apply(M, s, &stored(&hashes, None, &tokens, 4));
        assert!(r.is_ok() || i % 10 >= 8);
        assert!(w.held() <= cfg.max_blocks);
        for k in 0..8 {
            assert!(w.held_by(src(k, 0)) <= cfg.max_blocks_per_source);
        }
        if i >= 2_990 && i % 10 < 8 {
            last.push((s, tokens));
        }
    }
    w.check();
    assert!(w.stats().evicted() >= 2_400 * 16 - 2_000);
    assert_eq!(w.stats().dropped_limits(), 600);
    assert!(w.trie_len(M) <= cfg.max_blocks);
    for (s, tokens) in last {
        assert_eq!(matches(&mut w, M, &tokens), vec![(s, 16)]);
    }
}

#[test]
fn publishing_copies_only_edited_paths() {
    // A published snapshot and the writer share every trie node the writer has not edited since:
    // after editing one block the old snapshot still answers for all the others.
    let mut w = IndexWriter::new(IndexConfig::default());
    for i in 0..2_000u32 {
        w.apply(M, src(1, 0), &stored(&[i as u64], None, &seq(4, i * 4), 4))
            .unwrap();
    }
    w.publish();
    let old = w.reader().shared.load_full();
    w.apply(M, src(1, 0), &removed(&[0])).unwrap();
    w.publish();
    assert_eq!(old.blocks(M), 2_000);
    assert_eq!(w.reader().load().blocks(M), 1_999);
    w.check();
}

#[test]
fn trie_matches_a_hash_map() {
    let mut t = trie::Trie::default();
    let mut oracle: HashMap<u64, Vec<u16>> = HashMap::new();
    let mut x = 0x1234_5678_u64;
    for i in 0..20_000u32 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        // Keys sharing low bits exercise deep paths and collapses.
        let key = if i % 3 == 0 {
            x & 0xFFFF_0000_0000_0FFF
        } else {
            x % 5_000
        };
        let s = (x >> 40) as u16 % 6;
        if x % 3 == 0 {
            let had = oracle.get(&key).is_some_and(|v| v.contains(&s));
            assert_eq!(t.remove(key, s), had);
            if had {
                let v = oracle.get_mut(&key).unwrap();
                let p = v.iter().position(|&y| y == s).unwrap();
                v.swap_remove(p);
                if v.is_empty() {
                    oracle.remove(&key);
                }
            }
        } else {
            assert_eq!(t.add(key, s), !oracle.contains_key(&key));
            oracle.entry(key).or_default().push(s);
        }
    }
    t.check();
    let mut got = t.entries();
    for (_, h) in got.iter_mut() {
        h.sort();
    }
    got.sort();
    let mut want: Vec<_> = oracle
        .into_iter()
        .map(|(k, mut v)| {
            v.sort();
            (k, v)
        })
        .collect();
    want.sort();
    assert_eq!(got, want);
}

// ---- property test against a naive oracle ----

/// The oracle: per source, engine hash → the whole token sequence from the start of the prompt
/// to the end of that block. A source holds a prompt's first k blocks when it holds, for every
/// j < k, a block whose whole sequence is the prompt's first (j + 1) blocks.
#[derive(Default)]
struct Oracle {
    /// Each source's block size, learned from its first non-empty store.
    sizes: HashMap<Source, usize>,
    sources: HashMap<Source, HashMap<u64, Vec<u32>>>,
}

impl Oracle {
    fn apply(&mut self, s: Source, e: &KvEvent) -> Result<(), DropReason> {
        self.sources.entry(s).or_default();
        match e {
            KvEvent::BlockStored(b) => {
                let (engine_hashes, parent, token_ids) = (&b.block_hashes, &b.parent, &b.token_ids);
                let bs = b.block_size as usize;
                if bs == 0 || token_ids.len() != engine_hashes.len() * bs {
                    return Err(DropReason::Malformed);
                }
                if engine_hashes.is_empty() {
                    return Ok(());
                }
                if *self.sizes.entry(s).or_insert(bs) != bs {
                    return Err(DropReason::BlockSizeMismatch);
                }
                let blocks = self.sources.get_mut(&s).unwrap();
                let mut prefix = match parent {
                    None => Vec::new(),
                    Some(p) => blocks.get(&p.0).cloned().ok_or(DropReason::UnknownParent)?,
                };
                for (eh, chunk) in engine_hashes.iter().zip(token_ids.chunks(bs)) {
                    prefix.extend_from_slice(chunk);
                    blocks.insert(eh.0, prefix.clone());
                }
            }
            KvEvent::BlockRemoved(r) => {
                let blocks = self.sources.get_mut(&s).unwrap();
                for eh in &r.block_hashes {
                    blocks.remove(&eh.0);
                }
            }
            KvEvent::AllBlocksCleared => self.sources.get_mut(&s).unwrap().clear(),
        }
        Ok(())
    }

    fn remove_worker(&mut self, worker: WorkerId) {
        self.sources.retain(|s, _| s.worker != worker);
        self.sizes.retain(|s, _| s.worker != worker);
    }

    /// The size most sources use (ties: the smallest).
    fn block_size(&self) -> Option<usize> {
        let mut count: HashMap<usize, usize> = HashMap::new();
        for &b in self.sizes.values() {
            *count.entry(b).or_default() += 1;
        }
        count
            .into_iter()
            .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)))
            .map(|(b, _)| b)
    }

    fn matches(&self, tokens: &[u32]) -> Vec<(Source, u32)> {
        let Some(bs) = self.block_size() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (s, blocks) in &self.sources {
            if self.sizes.get(s) != Some(&bs) {
                continue;
            }
            let held: HashSet<&[u32]> = blocks.values().map(|v| v.as_slice()).collect();
            let mut k = 0;
            while (k + 1) * bs <= tokens.len() && held.contains(&tokens[..(k + 1) * bs]) {
                k += 1;
            }
            if k > 0 {
                out.push((*s, k as u32));
            }
        }
        out.sort();
        out
    }
}

#[derive(Debug, Clone)]
pub(super) enum Op {
    Store {
        s: Source,
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
        bs: usize,
    },
    Remove(Source, Vec<u64>),
    Clear(Source),
    Reset(WorkerId),
    RemoveWorker(WorkerId),
    Match(Vec<u32>),
}

pub(super) fn op() -> impl Strategy<Value = Op> {
    let source = (0u32..3, 0u32..2).prop_map(|(w, r)| src(w, r));
    // Small hash and token alphabets: engine ids and block contents collide often, so parents,
    // duplicates, replacements and sharing across sources all happen.
    let store = (
        source.clone(),
        prop::collection::vec(0u64..12, 1..4),
        prop::option::weighted(0.7, 0u64..12),
        prop::sample::select(vec![2usize, 2, 2, 2, 3]),
        prop::collection::vec(0u32..2, 12),
    )
        .prop_map(|(s, hashes, parent, bs, pool)| {
            let tokens = pool[..hashes.len() * bs].to_vec();
            Op::Store {
                s,
                hashes,
                parent,
                tokens,
                bs,
            }
        });
    prop_oneof![
        6 => store,
        2 => (source.clone(), prop::collection::vec(0u64..12, 1..3))
            .prop_map(|(s, h)| Op::Remove(s, h)),
        1 => source.prop_map(Op::Clear),
        1 => (0u32..3).prop_map(Op::Reset),
        1 => (0u32..3).prop_map(Op::RemoveWorker),
        4 => prop::collection::vec(0u32..2, 0..13).prop_map(Op::Match),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn index_matches_the_oracle(ops in prop::collection::vec(op(), 1..60)) {
        let mut w = IndexWriter::new(IndexConfig::default());
        let mut o = Oracle::default();
        for op in ops {
            match op {
                Op::Store { s, hashes, parent, tokens, bs } => {
                    let e = stored(&hashes, parent, &tokens, bs);
                    prop_assert_eq!(w.apply(M, s, &e), o.apply(s, &e));
                }
                Op::Remove(s, h) => {
                    let e = removed(&h);
                    prop_assert_eq!(w.apply(M, s, &e), o.apply(s, &e));
                }
                Op::Clear(s) => {
                    let e = KvEvent::AllBlocksCleared;
                    prop_assert_eq!(w.apply(M, s, &e), o.apply(s, &e));
                }
                Op::Reset(worker) => {
                    w.reset_worker(worker);
                    for (s, b) in o.sources.iter_mut() {
                        if s.worker == worker {
                            b.clear();
                        }
                    }
                }
                Op::RemoveWorker(worker) => {
                    w.remove_worker(worker);
                    o.remove_worker(worker);
                }
                Op::Match(tokens) => {
                    prop_assert_eq!(matches(&mut w, M, &tokens), o.matches(&tokens));
                }
            }
        }
        // Every stored sequence, as a prompt.
        let prompts: Vec<Vec<u32>> =
            o.sources.values().flat_map(|b| b.values().cloned()).collect();
        for p in prompts {
            prop_assert_eq!(matches(&mut w, M, &p), o.matches(&p));
        }
    }
}

/// Steady state at the per-source cap: conversations keep growing, finished ones stay behind
/// until evicted. Only finished chains are evicted (a live conversation's next event always
/// finds its parent), and the index never leaves its bounds or breaks an invariant.
#[test]
fn steady_conversations_at_the_cap_evict_only_finished_chains() {
    let cap = 4096;
    let mut w = IndexWriter::new(IndexConfig {
        max_blocks_per_source: cap,
        ..IndexConfig::default()
    });
    let mut rng = crate::base::rng::Rng::with_seed(7);
    let mut next = 1u64;
    // Four live conversations per source, each ending after 8 events on average.
    let mut tips = vec![vec![None; 4]; 8];
    for i in 0..20_000usize {
        let s = i % 8;
        let c = rng.below(4);
        let hashes: Vec<u64> = (0..16).map(|k| next + k).collect();
        next += 16;
        let tokens: Vec<u32> = (0..16 * 4).map(|_| rng.below(150_000) as u32).collect();
        let e = stored(&hashes, tips[s][c], &tokens, 4);
        assert_eq!(w.apply(M, src(s as u32, 0), &e), Ok(()), "event {i}");
        assert!(w.held_by(src(s as u32, 0)) <= cap);
        tips[s][c] = if rng.below(8) == 0 {
            None
        } else {
            hashes.last().copied()
        };
        if i % 1000 == 0 {
            w.check();
        }
    }
    assert!(w.stats().evicted() > 250_000);
    w.check();
}

/// Every size branch of `block_hash` from two tokens up hashes the same bytes: the tokens
/// little-endian, seeded with the parent (the export format's definition), so an index copied
/// from a sibling built on other branches still matches; one token is the pinned multiply-fold.
#[test]
fn block_hash_is_xxh3_of_the_tokens_le_bytes_seeded_with_the_parent() {
    let mut buf = Vec::new();
    for n in [2usize, 15, 16, 17, 63, 64, 65, 200] {
        let tokens: Vec<u32> = (0..n as u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        for parent in [ROOT_PARENT, 7, u64::MAX] {
            assert_eq!(
                block_hash(parent, &tokens, &mut buf),
                xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, parent),
                "{n} tokens"
            );
        }
    }
    // One token: the multiply-fold, pinned (a change would need a new export version).
    assert_eq!(
        block_hash(ROOT_PARENT, &[1], &mut buf),
        one_token_hash(ROOT_PARENT, 1)
    );
    assert_eq!(one_token_hash(0, 0), 0x4886_f8a6_3511_5a1c);
}

/// One-token blocks chain without collisions over a whole vocabulary at several parents, and
/// every output bit flips about half the time when the token or the parent changes by one bit.
#[test]
fn one_token_hashes_keep_tokens_and_parents_apart() {
    for parent in [ROOT_PARENT, 0, 1, u64::MAX, one_token_hash(ROOT_PARENT, 42)] {
        let mut seen: HashSet<u64> = HashSet::new();
        for t in 0..300_000u32 {
            assert!(seen.insert(one_token_hash(parent, t)), "token {t} collides");
        }
    }
    let mut flips = [0u32; 64];
    let mut trials = 0;
    for i in 0..2_000u64 {
        let parent = one_token_hash(i, 7);
        let token = (i as u32).wrapping_mul(2_654_435_761);
        let h = one_token_hash(parent, token);
        for bit in 0..32 {
            let d = h ^ one_token_hash(parent, token ^ 1 << bit);
            let e = h ^ one_token_hash(parent ^ 1 << bit, token);
            for (o, f) in flips.iter_mut().enumerate() {
                *f += (d >> o & 1) as u32 + (e >> o & 1) as u32;
            }
            trials += 2;
        }
    }
    for (o, &f) in flips.iter().enumerate() {
        let rate = f64::from(f) / f64::from(trials);
        assert!(
            (0.3..0.7).contains(&rate),
            "output bit {o} flips at {rate:.3}"
        );
    }
}

/// The prompt side's chain (one-token fast path included) is the block-by-block chain the
/// event side builds, at every block size and cap.
#[test]
fn chain_hashes_is_the_block_by_block_chain() {
    let tokens: Vec<u32> = (0..300u32)
        .map(|i| i.wrapping_mul(2_654_435_761) >> 7)
        .collect();
    let mut buf = Vec::new();
    let mut chain = vec![1, 2, 3];
    for bs in [1usize, 2, 16, 64] {
        for max in [0usize, 1, 7, usize::MAX] {
            chain_hashes(&tokens, bs, ROOT_PARENT, max, &mut chain, &mut buf);
            let mut parent = ROOT_PARENT;
            let expected: Vec<u64> = tokens
                .chunks_exact(bs)
                .take(max)
                .map(|b| {
                    parent = block_hash(parent, b, &mut buf);
                    parent
                })
                .collect();
            assert_eq!(chain, expected, "block size {bs}, at most {max}");
        }
    }
}

/// `e` concerning the storage tier `medium`.
fn in_tier(mut e: KvEvent, medium: &str) -> KvEvent {
    match &mut e {
        KvEvent::BlockStored(s) => s.medium = Some(medium.into()),
        KvEvent::BlockRemoved(r) => r.medium = Some(medium.into()),
        KvEvent::AllBlocksCleared => {}
    }
    e
}

/// Publishes and matches with tiers: (source, blocks on the GPU, blocks on the GPU or host).
fn tiered(w: &mut IndexWriter, root: u64, tokens: &[u32]) -> Vec<(Source, u32, u32)> {
    w.publish();
    w.check();
    let snap = w.reader().load();
    let mut scratch = MatchScratch::default();
    let mut v: Vec<_> = snap
        .match_prefix(M, root, tokens, &mut scratch)
        .iter()
        .map(|m| (m.source, m.blocks, m.with_host))
        .collect();
    v.sort();
    v
}

#[test]
fn each_tier_is_stored_and_removed_on_its_own() {
    let mut w = IndexWriter::new(IndexConfig::default());
    let t = seq(16, 0);
    let s = src(1, 0);
    // On the GPU, then backed up to host memory.
    w.apply(M, s, &stored(&[10, 11, 12, 13], None, &t, 4))
        .unwrap();
    w.apply(
        M,
        s,
        &in_tier(stored(&[10, 11, 12, 13], None, &t, 4), "CPU_PINNED"),
    )
    .unwrap();
    assert_eq!(tiered(&mut w, ROOT_PARENT, &t), vec![(s, 4, 4)]);
    assert_eq!(w.held(), 4, "a block in two tiers is one block held");
    // The host copy of the tail freed: the GPU's stays.
    w.apply(M, s, &in_tier(removed(&[13]), "CPU_PINNED"))
        .unwrap();
    assert_eq!(tiered(&mut w, ROOT_PARENT, &t), vec![(s, 4, 4)]);
    // The GPU evicts blocks 2 and 3: block 2's host copy remains, block 3 had none left.
    w.apply(M, s, &in_tier(removed(&[12, 13]), "GPU")).unwrap();
    assert_eq!(tiered(&mut w, ROOT_PARENT, &t), vec![(s, 2, 3)]);
    assert_eq!(w.held(), 3);
    // A removal from a tier that holds no copy changes nothing.
    w.apply(M, s, &in_tier(removed(&[12]), "GPU")).unwrap();
    assert_eq!(tiered(&mut w, ROOT_PARENT, &t), vec![(s, 2, 3)]);
    // Stored in host memory only (written back after the GPU evicted): no GPU hit at all.
    let u = seq(8, 100);
    let other = src(2, 0);
    w.apply(
        M,
        other,
        &in_tier(stored(&[20, 21], None, &u, 4), "CPU_PINNED"),
    )
    .unwrap();
    assert_eq!(tiered(&mut w, ROOT_PARENT, &u), vec![(other, 0, 2)]);
    // Disk and external pools are tracked, not scored; their removal touches nothing else.
    w.apply(M, other, &in_tier(stored(&[20, 21], None, &u, 4), "DISK"))
        .unwrap();
    w.apply(M, other, &in_tier(removed(&[20, 21]), "CPU_PINNED"))
        .unwrap();
    assert_eq!(tiered(&mut w, ROOT_PARENT, &u), vec![]);
    assert_eq!(w.held_by(other), 2, "still held on disk");
    w.apply(M, other, &in_tier(removed(&[20, 21]), "DISK"))
        .unwrap();
    assert_eq!(w.held_by(other), 0);
    // Clearing drops every tier.
    w.apply(M, s, &KvEvent::AllBlocksCleared).unwrap();
    assert_eq!(tiered(&mut w, ROOT_PARENT, &t), vec![]);
    w.check();
}

#[test]
fn blocks_of_a_namespace_match_only_its_prompts() {
    let mut w = IndexWriter::new(IndexConfig::default());
    let t = seq(8, 0);
    let salted = |hashes: &[u64], salt: &str| {
        let KvEvent::BlockStored(mut b) = stored(hashes, None, &t, 4) else {
            unreachable!()
        };
        b.cache_salt = Some(salt.into());
        KvEvent::BlockStored(b)
    };
    w.apply(M, src(1, 0), &salted(&[1, 2], "tenant-a")).unwrap();
    let KvEvent::BlockStored(mut adapter) = stored(&[3, 4], None, &t, 4) else {
        unreachable!()
    };
    adapter.lora_name = Some("sql".into());
    w.apply(M, src(2, 0), &KvEvent::BlockStored(adapter))
        .unwrap();
    let KvEvent::BlockStored(mut by_id) = stored(&[5, 6], None, &t, 4) else {
        unreachable!()
    };
    by_id.lora_id = Some(7);
    w.apply(M, src(3, 0), &KvEvent::BlockStored(by_id)).unwrap();
    // The same tokens in four namespaces: each prompt finds only its own.
    assert_eq!(tiered(&mut w, ROOT_PARENT, &t), vec![]);
    let a = namespace_root(Some("tenant-a"), None);
    assert_eq!(tiered(&mut w, a, &t), vec![(src(1, 0), 2, 2)]);
    assert_eq!(
        tiered(&mut w, namespace_root(Some("tenant-b"), None), &t),
        vec![]
    );
    let sql = namespace_root(None, Some("sql"));
    assert_eq!(tiered(&mut w, sql, &t), vec![(src(2, 0), 2, 2)]);
    assert_eq!(
        tiered(&mut w, namespace_root(Some("tenant-a"), Some("sql")), &t),
        vec![]
    );
    // A child stored under a salted parent stays in the parent's namespace.
    let more = seq(4, 8);
    let mut whole = t.clone();
    whole.extend(&more);
    w.apply(M, src(1, 0), &stored(&[9], Some(2), &more, 4))
        .unwrap();
    assert_eq!(tiered(&mut w, a, &whole), vec![(src(1, 0), 3, 3)]);
    // Empty strings are no namespace, as SGLang normalises them; the parts are length-framed.
    assert_eq!(namespace_root(Some(""), Some("")), ROOT_PARENT);
    assert_ne!(
        namespace_root(Some("ab"), Some("c")),
        namespace_root(Some("a"), Some("bc"))
    );
    assert_ne!(
        namespace_root(Some("x"), None),
        namespace_root(None, Some("x"))
    );
}

/// A store as vLLM 0.33 publishes it, decoded: its salt travels only in the first block's
/// `extra_keys` (see `wire::Form::Vllm`).
fn vllm_decoded(
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u32],
    salt: Option<&str>,
    lora: Option<&str>,
) -> KvEvent {
    let KvEvent::BlockStored(mut b) = stored(hashes, parent, tokens, 4) else {
        unreachable!()
    };
    b.cache_salt = salt.map(Into::into);
    b.lora_name = lora.map(Into::into);
    let batch = crate::kv::wire::EventBatch {
        ts: None,
        events: vec![KvEvent::BlockStored(b)],
        dp_rank: None,
        skipped: Default::default(),
    };
    let bytes = crate::kv::wire::encode_batch(&batch, crate::kv::wire::Form::Vllm);
    let mut got = crate::kv::wire::decode_batch(&bytes).unwrap();
    assert_eq!(got.events.len(), 1, "{got:?}");
    got.events.remove(0)
}

#[test]
fn vllm_salted_blocks_match_only_their_salt_and_continuations_inherit_it() {
    let mut w = IndexWriter::new(IndexConfig::default());
    let (t, more) = (seq(8, 0), seq(4, 8));
    let whole: Vec<u32> = t.iter().chain(&more).copied().collect();
    // Worker 1 holds the prompt salted, worker 2 unsalted, worker 3 under adapter `sql-lora`
    // salted: the same tokens, and vLLM's continuation events carry no salt.
    for (worker, salt, lora) in [
        (1, Some("tenant-a"), None),
        (2, None, None),
        (3, Some("tenant-a"), Some("sql-lora")),
    ] {
        let base = u64::from(worker) * 100;
        w.apply(
            M,
            src(worker, 0),
            &vllm_decoded(&[base, base + 1], None, &t, salt, lora),
        )
        .unwrap();
        w.apply(
            M,
            src(worker, 0),
            &vllm_decoded(&[base + 2], Some(base + 1), &more, None, lora),
        )
        .unwrap();
    }
    let a = namespace_root(Some("tenant-a"), None);
    assert_eq!(tiered(&mut w, a, &whole), vec![(src(1, 0), 3, 3)]);
    assert_eq!(tiered(&mut w, ROOT_PARENT, &whole), vec![(src(2, 0), 3, 3)]);
    let sql_a = namespace_root(Some("tenant-a"), Some("sql-lora"));
    assert_eq!(tiered(&mut w, sql_a, &whole), vec![(src(3, 0), 3, 3)]);
    for other in [
        namespace_root(Some("tenant-b"), None),
        namespace_root(None, Some("sql-lora")),
    ] {
        assert_eq!(tiered(&mut w, other, &whole), vec![]);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    /// Sources holding the same tokens under vLLM stores of random salts and adapters (each a
    /// first store and an unsalted continuation, as vLLM publishes them): a prompt of each
    /// namespace matches exactly the sources of that namespace, whole.
    #[test]
    fn vllm_namespaces_partition_the_same_tokens(
        spaces in proptest::collection::vec(
            (proptest::option::of(0u8..3), proptest::option::of(0u8..2)),
            1..6,
        ),
        split in 1usize..3,
    ) {
        let salt = |s: Option<u8>| s.map(|s| format!("salt-{s}"));
        let lora = |l: Option<u8>| l.map(|l| format!("lora-{l}"));
        let tokens = seq(12, 40);
        let mut w = IndexWriter::new(IndexConfig::default());
        for (i, &(s, l)) in spaces.iter().enumerate() {
            let (s, l) = (salt(s), lora(l));
            let base = i as u64 * 10;
            let first: Vec<u64> = (0..split as u64).map(|b| base + b).collect();
            let rest: Vec<u64> = (split as u64..3).map(|b| base + b).collect();
            let source = src(i as WorkerId, 0);
            let cut = split * 4;
            w.apply(M, source, &vllm_decoded(&first, None, &tokens[..cut], s.as_deref(), l.as_deref()))
                .unwrap();
            w.apply(
                M,
                source,
                &vllm_decoded(&rest, first.last().copied(), &tokens[cut..], None, l.as_deref()),
            )
            .unwrap();
        }
        for s in [None, Some(0), Some(1), Some(2)] {
            for l in [None, Some(0), Some(1)] {
                let root = namespace_root(salt(s).as_deref(), lora(l).as_deref());
                let want: Vec<_> = spaces
                    .iter()
                    .enumerate()
                    .filter(|(_, &ns)| ns == (s, l))
                    .map(|(i, _)| (src(i as WorkerId, 0), 3, 3))
                    .collect();
                prop_assert_eq!(tiered(&mut w, root, &tokens), want);
            }
        }
    }
}

#[test]
fn a_fleet_of_8192_servers_is_indexed_whole() {
    // Every server stores the shared prefix and a block of its own: none is dropped for the
    // index's limits, and the shared prefix is matched on all of them.
    let mut w = IndexWriter::new(IndexConfig::default());
    let shared = seq(4, 0);
    for worker in 0..8192u32 {
        let mut t = shared.clone();
        t.extend(seq(4, 100 + 4 * worker));
        let own = 1_000_000 + u64::from(worker);
        w.apply(M, src(worker, 0), &stored(&[7, own], None, &t, 4))
            .unwrap();
    }
    assert_eq!(w.stats().dropped_limits(), 0);
    assert_eq!(w.stats().sources(), 8192);
    let all = matches(&mut w, M, &shared);
    assert_eq!(all.len(), 8192);
    assert!(all.iter().all(|&(_, blocks)| blocks == 1));
    let mut t = shared.clone();
    t.extend(seq(4, 100 + 4 * 5000));
    assert!(matches(&mut w, M, &t).contains(&(src(5000, 0), 2)));
}
