use super::*;
use crate::rng::Rng;

pub(super) fn ok(c: &RadixCache) {
    c.check_invariants().unwrap();
}

#[test]
fn match_insert_split() {
    let mut c = RadixCache::new(1000, 1);
    assert_eq!(c.match_prefix(&[1, 2, 3]), (0, ROOT));
    let (existing, a) = c.insert(&[1, 2, 3, 4, 5]);
    assert_eq!(existing, 0);
    assert_eq!(c.tree_tokens(), 5);
    ok(&c);
    // Partial match splits the edge; the returned node covers exactly the match.
    let (len, n) = c.match_prefix(&[1, 2, 3, 9]);
    assert_eq!(len, 3);
    assert_ne!(n, a);
    assert_eq!(c.tree_tokens(), 5);
    ok(&c);
    // Diverging insert adds only the new suffix.
    let (existing, _) = c.insert(&[1, 2, 3, 9, 9]);
    assert_eq!(existing, 3);
    assert_eq!(c.tree_tokens(), 7);
    assert_eq!(c.peek_prefix(&[1, 2, 3, 4, 5, 6]), 5);
    assert_eq!(c.peek_prefix(&[1, 2, 3, 9, 9]), 5);
    assert_eq!(c.peek_prefix(&[1, 2, 7]), 2);
    // Inserting a prefix of an existing key adds nothing.
    assert_eq!(c.insert(&[1, 2]).0, 2);
    assert_eq!(c.tree_tokens(), 7);
    ok(&c);
    // The original leaf handle is still the full path.
    c.inc_lock(a);
    assert_eq!(c.protected_tokens(), 5);
    ok(&c);
}

#[test]
fn page_floor() {
    let mut c = RadixCache::new(1000, 4);
    let (existing, _) = c.insert(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
    assert_eq!(existing, 0);
    assert_eq!(c.tree_tokens(), 8, "key truncated to whole pages");
    // Match diverging inside the second page floors to the first page.
    assert_eq!(c.match_prefix(&[1, 2, 3, 4, 5, 6, 0, 0, 0]).0, 4);
    // Same first token, different page: a distinct child.
    assert_eq!(c.insert(&[1, 2, 3, 4, 5, 0, 0, 0]).0, 4);
    assert_eq!(c.tree_tokens(), 12);
    assert_eq!(c.peek_prefix(&[1, 2, 3, 4, 5, 0, 0, 0, 1]), 8);
    assert_eq!(c.peek_prefix(&[1, 2, 3]), 0);
    ok(&c);
}

#[test]
fn lock_prevents_eviction_and_capacity_holds() {
    let mut c = RadixCache::new(10, 1);
    let (_, a) = c.insert(&[1, 2, 3, 4]);
    let (_, b) = c.insert(&[5, 6, 7, 8]);
    c.inc_lock(a);
    assert_eq!(c.evictable_tokens(), 4);
    assert!(c.alloc(6), "2 free + 4 evictable from b");
    assert_eq!(c.peek_prefix(&[5, 6, 7, 8]), 0, "b evicted");
    assert_eq!(c.peek_prefix(&[1, 2, 3, 4]), 4, "a locked");
    assert!(!c.alloc(1), "everything is locked or private");
    ok(&c);
    c.dec_lock(a);
    assert!(c.alloc(4));
    assert_eq!(c.tree_tokens(), 0);
    assert_eq!(c.free_tokens(), 0);
    ok(&c);
    let _ = b;
}

#[test]
fn lru_order() {
    let mut c = RadixCache::new(12, 1);
    c.insert(&[1, 1, 1, 1]);
    c.insert(&[2, 2, 2, 2]);
    c.insert(&[3, 3, 3, 3]);
    c.match_prefix(&[1, 1, 1, 1]); // 1 is now most recent; 2 is the LRU
    assert!(c.alloc(4));
    assert_eq!(c.peek_prefix(&[2, 2, 2, 2]), 0);
    assert_eq!(c.peek_prefix(&[1, 1, 1, 1]), 4);
    assert_eq!(c.peek_prefix(&[3, 3, 3, 3]), 4);
    assert!(c.alloc(4));
    assert_eq!(c.peek_prefix(&[3, 3, 3, 3]), 0);
    assert_eq!(c.peek_prefix(&[1, 1, 1, 1]), 4);
    ok(&c);
}

#[test]
fn eviction_climbs_to_parents() {
    let mut c = RadixCache::new(8, 1);
    c.insert(&[1, 2, 3, 4]);
    c.insert(&[1, 2, 9, 9]);
    assert_eq!(c.tree_tokens(), 6);
    assert!(c.alloc(8), "both leaves then their shared parent go");
    assert_eq!(c.tree_tokens(), 0);
    ok(&c);
}

#[test]
fn cache_prefix_moves_and_dedups() {
    let mut c = RadixCache::new(100, 1);
    // Two requests with the same 10-token prompt each allocate privately.
    assert!(c.alloc(10));
    assert!(c.alloc(10));
    let p: Vec<u32> = (0..10).collect();
    let (n1, l1) = c.cache_prefix(&p, ROOT, 0);
    assert_eq!((c.tree_tokens(), c.private_tokens(), l1), (10, 10, 10));
    let (n2, l2) = c.cache_prefix(&p, ROOT, 0);
    assert_eq!(
        (c.tree_tokens(), c.private_tokens(), l2),
        (10, 0, 10),
        "duplicate freed"
    );
    assert_eq!(n1, n2);
    assert_eq!(c.protected_tokens(), 10);
    ok(&c);
    c.dec_lock(n1);
    c.dec_lock(n2);
    assert!(c.is_idle());
    assert!(c.flush());
    assert_eq!(c.tree_tokens(), 0);
}

/// Applies recorded events to a consumer-side model (hash → parent, page tokens, tiers) and
/// checks what a KV-event subscriber relies on: parents are known (in some tier) when a page is
/// stored, a page is removed only from a tier that holds it, a page leaving its last tier has
/// no stored children, and the model equals the tree tier by tier.
#[derive(Default)]
pub(super) struct Consumer {
    pub(super) pages: std::collections::HashMap<u64, ModelPage>,
}

/// One page as the consumer model holds it.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct ModelPage {
    parent: Option<u64>,
    tokens: Vec<u32>,
    gpu: bool,
    cpu: bool,
}

impl ModelPage {
    fn tier(&mut self, m: Medium) -> &mut bool {
        match m {
            Medium::Gpu => &mut self.gpu,
            Medium::CpuPinned => &mut self.cpu,
        }
    }
}

impl Consumer {
    /// Apply `evs` as a subscriber would, asserting the stream is self-consistent.
    pub(super) fn apply(&mut self, evs: &[CacheEvent], page: usize) {
        for ev in evs {
            match ev {
                CacheEvent::Stored {
                    hashes,
                    parent,
                    tokens,
                    medium,
                    ..
                } => {
                    assert_eq!(tokens.len(), hashes.len() * page);
                    if let Some(p) = parent {
                        assert!(self.pages.contains_key(p), "parent {p} not stored");
                    }
                    let mut prev = *parent;
                    for (h, toks) in hashes.iter().zip(tokens.chunks(page)) {
                        let p = self.pages.entry(*h).or_insert_with(|| ModelPage {
                            parent: prev,
                            tokens: toks.to_vec(),
                            gpu: false,
                            cpu: false,
                        });
                        assert_eq!((p.parent, &p.tokens[..]), (prev, toks), "page {h} changed");
                        let held = p.tier(*medium);
                        assert!(!*held, "page {h} stored twice in {medium:?}");
                        *held = true;
                        prev = Some(*h);
                    }
                }
                CacheEvent::Removed { hashes, medium } => {
                    let mut gone = Vec::new();
                    for h in hashes {
                        let p = self.pages.get_mut(h).expect("unknown page removed");
                        let held = p.tier(*medium);
                        assert!(
                            *held,
                            "page {h} removed from {medium:?}, which does not hold it"
                        );
                        *held = false;
                        if !p.gpu && !p.cpu {
                            self.pages.remove(h);
                            gone.push(*h);
                        }
                    }
                    // Checked after the whole event: one node's pages go together.
                    for q in self.pages.values() {
                        assert!(
                            !q.parent.is_some_and(|p| gone.contains(&p)),
                            "orphaned child of {:?}",
                            q.parent
                        );
                    }
                }
                CacheEvent::Cleared => self.pages.clear(),
            }
        }
    }

    /// The model holds exactly the tree's pages, each in the tree's tiers.
    pub(super) fn check(&self, c: &RadixCache) {
        let mut live: Vec<(u64, bool, bool)> = c
            .nodes
            .iter()
            .filter(|n| n.live)
            .flat_map(|n| n.hashes.iter().map(|&h| (h, n.device, n.host)))
            .collect();
        let mut model: Vec<(u64, bool, bool)> =
            self.pages.iter().map(|(&h, p)| (h, p.gpu, p.cpu)).collect();
        live.sort_unstable();
        model.sort_unstable();
        assert_eq!(live, model, "event stream and tree disagree");
    }

    /// Tokens of the whole prefix ending at page `h`, rebuilt from parents.
    pub(super) fn prefix(&self, mut h: u64) -> Vec<u32> {
        let mut pages = Vec::new();
        loop {
            let p = &self.pages[&h];
            pages.push(p.tokens.clone());
            match p.parent {
                Some(p) => h = p,
                None => break,
            }
        }
        pages.reverse();
        pages.concat()
    }
}

pub(super) fn take(c: &mut RadixCache) -> Vec<CacheEvent> {
    let mut evs = Vec::new();
    c.take_events(&mut evs);
    evs
}

#[test]
fn events_off_by_default() {
    let mut c = RadixCache::new(100, 2);
    c.insert(&[1, 2, 3, 4]);
    assert!(take(&mut c).is_empty());
}

#[test]
fn events_store_split_evict_flush() {
    let mut c = RadixCache::new(16, 2);
    c.enable_events();
    let mut m = Consumer::default();
    c.insert(&[1, 2, 3, 4, 5, 6, 7]);
    let evs = take(&mut c);
    let [CacheEvent::Stored {
        hashes,
        parent: None,
        tokens,
        medium: Medium::Gpu,
        tags: None,
    }] = &evs[..]
    else {
        panic!("{evs:?}")
    };
    assert_eq!(hashes.len(), 3, "full pages only");
    assert_eq!(tokens, &[1, 2, 3, 4, 5, 6]);
    let hashes = hashes.clone();
    m.apply(&evs, 2);
    m.check(&c);
    // Same prefix, same hash (stable across caches); a different page, a different hash.
    let mut other = RadixCache::new(16, 2);
    other.enable_events();
    other.insert(&[1, 2, 9, 9]);
    let CacheEvent::Stored { hashes: oh, .. } = &take(&mut other)[0] else {
        panic!()
    };
    assert_eq!(oh[0], hashes[0]);
    assert_ne!(oh[1], hashes[1]);
    // A diverging insert splits the edge (no event for the split) and chains to page 2.
    c.insert(&[1, 2, 3, 4, 8, 8]);
    let evs = take(&mut c);
    let h88 = hash_tokens(hashes[1], &[8, 8]);
    assert_eq!(
        evs,
        vec![CacheEvent::Stored {
            hashes: vec![h88],
            parent: Some(hashes[1]),
            tokens: vec![8, 8],
            medium: Medium::Gpu,
            tags: None,
        }]
    );
    m.apply(&evs, 2);
    m.check(&c);
    assert_eq!(m.prefix(h88), vec![1, 2, 3, 4, 8, 8]);
    // Evicting everything: the two leaves, then their shared parent, one event per node.
    assert!(c.alloc(16));
    let evs = take(&mut c);
    assert_eq!(evs.len(), 3);
    assert!(evs.iter().all(|e| matches!(e, CacheEvent::Removed { .. })));
    m.apply(&evs, 2);
    m.check(&c);
    c.free(16);
    c.insert(&[5, 5]);
    assert!(c.flush());
    let evs = take(&mut c);
    assert_eq!(evs.last(), Some(&CacheEvent::Cleared));
    m.apply(&evs, 2);
    m.check(&c);
}

/// A key of 1..=`max_len` tokens from one of `bases` families of short periodic sequences
/// (period `period + base`), so random keys share prefixes, split edges and diverge.
pub(super) fn random_key(rng: &mut Rng, max_len: usize, bases: usize, period: u32) -> Vec<u32> {
    let len = 1 + rng.below(max_len);
    let base = rng.below(bases) as u32;
    (0..len as u32)
        .map(|i| base * 100 + (i % (period + base)))
        .collect()
}

#[test]
fn events_follow_random_ops() {
    let mut rng = Rng::new(7);
    for page in [1usize, 3] {
        let mut c = RadixCache::new(300, page);
        c.enable_events();
        let mut m = Consumer::default();
        let mut held: Vec<NodeId> = Vec::new();
        for step in 0..2000 {
            let key = random_key(&mut rng, 40, 5, 2);
            match rng.below(5) {
                0 | 1 => {
                    let (_, node) = c.insert(&key);
                    if rng.chance(0.3) {
                        c.inc_lock(node);
                        held.push(node);
                    }
                }
                2 => {
                    if let Some(n) = held.pop() {
                        c.dec_lock(n);
                    }
                }
                3 => {
                    let n = rng.below(120);
                    if c.alloc(n) {
                        c.free(n);
                    }
                }
                _ => {
                    if step % 97 == 0 && held.is_empty() {
                        c.flush();
                    } else {
                        c.match_prefix(&key);
                    }
                }
            }
            m.apply(&take(&mut c), page);
            m.check(&c);
            c.check_invariants().unwrap();
        }
        // Every stored page's chain rebuilds a prefix the tree really caches.
        for &h in m.pages.keys() {
            let p = m.prefix(h);
            assert_eq!(c.peek_prefix(&p), p.len());
        }
    }
}

/// The kept candidate heap evicts exactly what a scan of the whole tree would: at every
/// eviction the least recently used evictable leaf, over random matches, locks, inserts,
/// splits and releases.
#[test]
fn eviction_takes_the_least_recent_leaf_a_full_scan_would() {
    let mut rng = Rng::new(7);
    for page in [1usize, 4] {
        let mut c = RadixCache::new(400, page);
        let mut held: Vec<NodeId> = Vec::new();
        let mut checked = 0;
        for _ in 0..4000 {
            let key = random_key(&mut rng, 40, 6, 3);
            match rng.below(5) {
                0 => {
                    let (_, node) = c.match_prefix(&key);
                    c.inc_lock(node);
                    held.push(node);
                }
                1 => {
                    if !held.is_empty() {
                        let n = held.swap_remove(rng.below(held.len()));
                        c.dec_lock(n);
                    }
                }
                2 | 3 => {
                    if c.free_tokens() >= key.len() {
                        c.insert(&key);
                    }
                }
                _ => {
                    let scan = c
                        .evictable_leaves()
                        .min_by_key(|&id| (c.nodes[id as usize].last_access, id));
                    let before = c.stats().evicted_tokens;
                    c.evict(1);
                    match scan {
                        Some(id) => {
                            assert!(!c.nodes[id as usize].live, "leaf {id} not evicted");
                            checked += 1;
                        }
                        None => {
                            assert_eq!(c.stats().evicted_tokens, before, "nothing was evictable")
                        }
                    }
                }
            }
            c.check_invariants().unwrap();
        }
        assert!(checked > 100, "only {checked} evictions checked");
    }
}

#[test]
fn random_ops_never_exceed_capacity() {
    let mut rng = Rng::new(42);
    for page in [1usize, 4] {
        let mut c = RadixCache::new(500, page);
        let mut held: Vec<(NodeId, usize)> = Vec::new();
        for _ in 0..3000 {
            let key = random_key(&mut rng, 60, 6, 3);
            let len = key.len();
            match rng.below(4) {
                0 => {
                    let (hit, node) = c.match_prefix(&key[..len - 1]);
                    let need = len - hit;
                    c.inc_lock(node);
                    if c.alloc(need) {
                        // cache_prefix moves the handle (lock) from `node` to `n`.
                        let (n, l) = c.cache_prefix(&key, node, hit);
                        c.free(len - l);
                        held.push((n, l));
                    } else {
                        c.dec_lock(node);
                    }
                }
                1 => {
                    if let Some((n, _)) = held.pop() {
                        c.dec_lock(n);
                    }
                }
                2 => {
                    c.insert(&key);
                }
                _ => {
                    let n = rng.below(50);
                    if c.alloc(n) {
                        c.free(n);
                    }
                }
            }
            c.check_invariants().unwrap();
        }
    }
}
