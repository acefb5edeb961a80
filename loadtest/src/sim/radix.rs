//! The simulated worker's KV cache: a token radix tree with SGLang RadixAttention semantics
//! (per-node lock refs, page-granular keys, LRU eviction of unlocked leaves) plus the KV pool
//! accounting around it (tokens held privately by running requests, free slots).
//!
//! Why a faithful model rather than a set of hashes: the routing comparison this crate exists for
//! is decided by *which tokens are still cached when the next turn arrives*, and that depends on
//! splits, lock refs (running requests pin their prefix) and the eviction order. The tree is an
//! arena of nodes addressed by `NodeId`, so request handles stay valid across splits (a split keeps
//! the lower half's id and inserts a new upper node).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::rng::hash_tokens;

/// Index of a node in the arena. `ROOT` is the empty prefix and is never evicted or locked.
pub type NodeId = u32;

/// The root node: the empty prefix.
pub const ROOT: NodeId = 0;

/// Seed of the page-hash chain (the "hash" of the empty prefix), so the first page's hash is not
/// a plain hash of its tokens.
const ROOT_HASH_SEED: u64 = 0x6b76_5f72_6f6f_7400;

/// A change to the set of cached pages, as SGLang's radix cache reports it for KV events
/// (`BlockStored` / `BlockRemoved` / `AllBlocksCleared`). Pure data: the server batches these per
/// scheduler step and [`kv_events`](crate::sim::kv_events) puts them on the wire.
///
/// Page hashes are this simulator's own stable chained 64-bit hash (page `i` hashes page `i−1`'s
/// hash with the page's tokens); like SGLang's, they are opaque ids to consumers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// Whole pages entered the tree: one radix node's run of consecutive pages.
    Stored {
        /// One hash per page, in order.
        hashes: Vec<u64>,
        /// Hash of the page before the first one; `None` when the run starts at the root.
        parent: Option<u64>,
        /// The pages' tokens, `hashes.len() × page_size` of them.
        tokens: Vec<u32>,
    },
    /// A radix node was evicted: the hashes of all its pages.
    Removed {
        /// One hash per page.
        hashes: Vec<u64>,
    },
    /// The whole cache was flushed.
    Cleared,
}

#[derive(Debug, Clone)]
struct Node {
    /// Edge label: the tokens from the parent to this node (a whole number of pages).
    key: Vec<u32>,
    /// Chained hash of each page of `key` (KV-event block ids), `key.len() / page` of them.
    hashes: Vec<u64>,
    parent: NodeId,
    /// `(first token of the child's edge, child)`. Linear scan: fan-outs in practice are small
    /// and the comparison is a single `u32` before the page check.
    children: Vec<(u32, NodeId)>,
    /// Number of live request handles whose path runs through this node.
    lock_ref: u32,
    /// Logical clock of the last match/insert through this node (LRU key).
    last_access: u64,
    live: bool,
}

/// Counters describing what the cache did, for metrics and reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Tokens removed by eviction since start (flushes not included).
    pub evicted_tokens: u64,
    /// Number of eviction passes that had to run because an allocation did not fit.
    pub evictions: u64,
}

/// Radix tree over token ids plus KV-pool accounting with a hard capacity.
///
/// Capacity invariant (checked in tests after every operation):
/// `tree_tokens + private_tokens <= capacity`.
#[derive(Debug, Clone)]
pub struct RadixCache {
    nodes: Vec<Node>,
    free_ids: Vec<NodeId>,
    page: usize,
    capacity: usize,
    tree_tokens: usize,
    evictable_tokens: usize,
    private_tokens: usize,
    tick: u64,
    stats: CacheStats,
    /// Eviction candidates `(last_access, node)`, kept across evictions so one costs what it
    /// frees, not a scan of the whole tree (the simulator's own CPU time is not the GPU time it
    /// models, and an O(tree) scan per allocation made a full cache's latency drift 3×). Lazy:
    /// an entry counts only while its node is still a live, unlocked leaf with that stamp
    /// ([`is_candidate`](Self::is_candidate)); every event that makes a node one pushes it.
    candidates: BinaryHeap<Reverse<(u64, NodeId)>>,
    /// Changes not yet taken by [`take_events`](Self::take_events); `None` while KV events are
    /// off (nothing is recorded).
    events: Option<Vec<CacheEvent>>,
}

impl RadixCache {
    /// An empty cache of `capacity` KV slots with `page_size`-token pages (0 is treated as 1).
    pub fn new(capacity: usize, page_size: usize) -> Self {
        let mut c = RadixCache {
            nodes: Vec::new(),
            free_ids: Vec::new(),
            page: page_size.max(1),
            capacity,
            tree_tokens: 0,
            evictable_tokens: 0,
            private_tokens: 0,
            tick: 0,
            stats: CacheStats::default(),
            candidates: BinaryHeap::new(),
            events: None,
        };
        c.reset();
        c
    }

    fn reset(&mut self) {
        self.nodes.clear();
        self.free_ids.clear();
        self.nodes.push(Node {
            key: Vec::new(),
            hashes: Vec::new(),
            parent: ROOT,
            children: Vec::new(),
            lock_ref: 0,
            last_access: 0,
            live: true,
        });
        self.tree_tokens = 0;
        self.evictable_tokens = 0;
        self.candidates.clear();
    }

    /// Start recording [`CacheEvent`]s (SGLang records them only with `--kv-events-config`).
    pub fn enable_events(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    /// Move the changes recorded since the last call into `out`, oldest first (nothing while
    /// events are off). The caller drains once per scheduler step, which bounds the buffer.
    pub fn take_events(&mut self, out: &mut Vec<CacheEvent>) {
        if let Some(ev) = &mut self.events {
            out.append(ev);
        }
    }

    fn record(&mut self, ev: CacheEvent) {
        if let Some(events) = &mut self.events {
            events.push(ev);
        }
    }

    /// Page size in tokens.
    pub fn page_size(&self) -> usize {
        self.page
    }
    /// Total KV slots.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Tokens stored in the tree (locked or not).
    pub fn tree_tokens(&self) -> usize {
        self.tree_tokens
    }
    /// Tree tokens no running request pins: reclaimable by eviction.
    pub fn evictable_tokens(&self) -> usize {
        self.evictable_tokens
    }
    /// Tree tokens pinned by running requests.
    pub fn protected_tokens(&self) -> usize {
        self.tree_tokens - self.evictable_tokens
    }
    /// KV slots held by requests and not (yet) in the tree.
    pub fn private_tokens(&self) -> usize {
        self.private_tokens
    }
    /// Unused slots.
    pub fn free_tokens(&self) -> usize {
        self.capacity - self.tree_tokens - self.private_tokens
    }
    /// Slots an allocation could obtain right now (free + evictable).
    pub fn available_tokens(&self) -> usize {
        self.free_tokens() + self.evictable_tokens
    }
    /// Slots in use by live requests (SGLang's `num_used_tokens`: capacity − free − evictable).
    pub fn used_tokens(&self) -> usize {
        self.capacity - self.available_tokens()
    }
    /// Eviction counters.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }
    /// `n` floored to a whole number of pages.
    pub fn floor_page(&self, n: usize) -> usize {
        n - n % self.page
    }

    /// Whether nothing is locked and no request holds private KV, so the cache may be flushed.
    pub fn is_idle(&self) -> bool {
        self.private_tokens == 0 && self.evictable_tokens == self.tree_tokens
    }

    /// Drop every cached prefix. Returns false (and does nothing) while any request holds KV.
    pub fn flush(&mut self) -> bool {
        if !self.is_idle() {
            return false;
        }
        self.reset();
        self.record(CacheEvent::Cleared);
        true
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn alloc_node(
        &mut self,
        key: Vec<u32>,
        hashes: Vec<u64>,
        parent: NodeId,
        lock_ref: u32,
        last_access: u64,
    ) -> NodeId {
        let node = Node {
            key,
            hashes,
            parent,
            children: Vec::new(),
            lock_ref,
            last_access,
            live: true,
        };
        match self.free_ids.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as NodeId
            }
        }
    }

    /// The child of `node` whose edge starts with the page `page_key`.
    fn child(&self, node: NodeId, page_key: &[u32]) -> Option<NodeId> {
        let first = page_key[0];
        self.nodes[node as usize]
            .children
            .iter()
            .find(|&&(f, c)| {
                f == first && self.nodes[c as usize].key[..page_key.len()] == *page_key
            })
            .map(|&(_, c)| c)
    }

    /// Length of the common prefix of the two slices, floored to whole pages.
    fn common_pages(&self, a: &[u32], b: &[u32]) -> usize {
        let n = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        self.floor_page(n)
    }

    /// Split `child` after `at` tokens (page-aligned, `0 < at < key.len()`): a new upper node takes
    /// the first `at` tokens and `child` keeps its id with the rest, so handles stay valid.
    fn split(&mut self, child: NodeId, at: usize) -> NodeId {
        let page = self.page;
        let (parent, lock_ref, last_access, upper_key, upper_hashes) = {
            let c = &mut self.nodes[child as usize];
            let upper: Vec<u32> = c.key.drain(..at).collect();
            let hashes: Vec<u64> = c.hashes.drain(..at / page).collect();
            (c.parent, c.lock_ref, c.last_access, upper, hashes)
        };
        let first_upper = upper_key[0];
        let lower_first = self.nodes[child as usize].key[0];
        let upper = self.alloc_node(upper_key, upper_hashes, parent, lock_ref, last_access);
        self.nodes[upper as usize]
            .children
            .push((lower_first, child));
        self.nodes[child as usize].parent = upper;
        for entry in &mut self.nodes[parent as usize].children {
            if entry.1 == child {
                *entry = (first_upper, upper);
            }
        }
        upper
    }

    /// Longest cached prefix of `key` in whole pages. Touches the path (LRU) and splits the last
    /// edge so that the returned node covers exactly the matched prefix. Returns `(len, node)`;
    /// `(0, ROOT)` on a miss. Callers cap `key` (e.g. to `len − 1`) before calling.
    pub fn match_prefix(&mut self, key: &[u32]) -> (usize, NodeId) {
        let key = &key[..self.floor_page(key.len())];
        let tick = self.next_tick();
        self.walk_and_split(key, tick)
    }

    /// The shared walk of [`match_prefix`](Self::match_prefix) and [`insert`](Self::insert):
    /// follow `key` (already page-floored) from the root, stamping every node on the path with
    /// `tick` and splitting a partially matched edge so the returned node covers exactly the
    /// matched prefix. Returns `(matched len, node)`.
    fn walk_and_split(&mut self, key: &[u32], tick: u64) -> (usize, NodeId) {
        let mut node = ROOT;
        let mut pos = 0;
        while pos < key.len() {
            let Some(c) = self.child(node, &key[pos..pos + self.page]) else {
                break;
            };
            let edge_len = self.nodes[c as usize].key.len();
            let common = self.common_pages(&self.nodes[c as usize].key, &key[pos..]);
            if common < edge_len {
                let upper = self.split(c, common);
                self.nodes[upper as usize].last_access = tick;
                node = upper;
                pos += common;
                break;
            }
            self.nodes[c as usize].last_access = tick;
            node = c;
            pos += edge_len;
        }
        // Only the last node of the path can be a leaf (the rest have the path's next node
        // as a child); its stamp just changed.
        self.offer(node);
        (pos, node)
    }

    /// Length of the cached prefix of `key` in whole pages, without touching or splitting.
    pub fn peek_prefix(&self, key: &[u32]) -> usize {
        let key = &key[..self.floor_page(key.len())];
        let mut node = ROOT;
        let mut pos = 0;
        while pos < key.len() {
            let Some(c) = self.child(node, &key[pos..pos + self.page]) else {
                break;
            };
            let common = self.common_pages(&self.nodes[c as usize].key, &key[pos..]);
            pos += common;
            if common < self.nodes[c as usize].key.len() {
                break;
            }
            node = c;
        }
        pos
    }

    /// Insert `key` (floored to whole pages). Returns `(existing, node)`: how many leading tokens
    /// were already cached, and the node covering the whole (floored) key. New tokens are counted
    /// as tree tokens (evictable until locked); the caller accounts for where their KV came from.
    pub fn insert(&mut self, key: &[u32]) -> (usize, NodeId) {
        let key = &key[..self.floor_page(key.len())];
        let tick = self.next_tick();
        let (existing, mut node) = self.walk_and_split(key, tick);
        if existing < key.len() {
            let rest = key[existing..].to_vec();
            let first = rest[0];
            // The node covering exactly `existing` tokens ends with the page before `rest`.
            let parent_hash = self.nodes[node as usize].hashes.last().copied();
            let mut h = parent_hash.unwrap_or(ROOT_HASH_SEED);
            let hashes: Vec<u64> = rest
                .chunks(self.page)
                .map(|p| {
                    h = hash_tokens(h, p);
                    h
                })
                .collect();
            if self.events.is_some() {
                self.record(CacheEvent::Stored {
                    hashes: hashes.clone(),
                    parent: parent_hash,
                    tokens: rest.clone(),
                });
            }
            let leaf = self.alloc_node(rest, hashes, node, 0, tick);
            self.nodes[node as usize].children.push((first, leaf));
            self.offer(leaf);
            let added = key.len() - existing;
            self.tree_tokens += added;
            self.evictable_tokens += added;
            node = leaf;
        }
        (existing, node)
    }

    /// Pin the path from `node` to the root (a running request uses it).
    pub fn inc_lock(&mut self, mut node: NodeId) {
        while node != ROOT {
            let n = &mut self.nodes[node as usize];
            if n.lock_ref == 0 {
                self.evictable_tokens -= n.key.len();
            }
            n.lock_ref += 1;
            node = n.parent;
        }
    }

    /// Release a pin taken by [`inc_lock`](Self::inc_lock).
    pub fn dec_lock(&mut self, mut node: NodeId) {
        while node != ROOT {
            let n = &mut self.nodes[node as usize];
            debug_assert!(n.lock_ref > 0, "dec_lock on an unlocked node");
            n.lock_ref = n.lock_ref.saturating_sub(1);
            let unlocked = n.lock_ref == 0;
            if unlocked {
                self.evictable_tokens += n.key.len();
            }
            let parent = n.parent;
            if unlocked {
                self.offer(node);
            }
            node = parent;
        }
    }

    /// Whether `id` may be evicted now: a live, unlocked leaf (never the root).
    fn is_evictable_leaf(&self, id: NodeId) -> bool {
        let n = &self.nodes[id as usize];
        id != ROOT && n.live && n.children.is_empty() && n.lock_ref == 0
    }

    /// Whether a candidate entry still stands for its node: an evictable leaf whose LRU stamp
    /// is still the one the entry was pushed with.
    fn is_candidate(&self, (stamp, id): (u64, NodeId)) -> bool {
        self.is_evictable_leaf(id) && self.nodes[id as usize].last_access == stamp
    }

    /// Records `id` as an eviction candidate with its current stamp if it is an evictable
    /// leaf. Called wherever a node may have become one (new leaf, last child removed, last
    /// lock released) or a leaf's stamp changed.
    fn offer(&mut self, id: NodeId) {
        if self.is_evictable_leaf(id) {
            self.candidates
                .push(Reverse((self.nodes[id as usize].last_access, id)));
            // Stale entries are dropped when popped; without evictions they would pile up, so
            // past twice the live nodes the heap is rebuilt from the tree (amortised O(1)).
            if self.candidates.len() > 2 * self.nodes.len() + 1024 {
                self.rebuild_candidates();
            }
        }
    }

    /// Every evictable leaf, by a scan of the whole arena.
    fn evictable_leaves(&self) -> impl Iterator<Item = NodeId> + '_ {
        (1..self.nodes.len() as NodeId).filter(|&id| self.is_evictable_leaf(id))
    }

    /// The candidates from a scan of the whole tree: every evictable leaf, once.
    fn rebuild_candidates(&mut self) {
        let heap = self
            .evictable_leaves()
            .map(|id| Reverse((self.nodes[id as usize].last_access, id)))
            .collect();
        self.candidates = heap;
    }

    /// Evict unlocked leaves in LRU order until at least `tokens` are freed or nothing is
    /// evictable. Returns the number of tokens freed.
    pub fn evict(&mut self, tokens: usize) -> usize {
        if tokens == 0 {
            return 0;
        }
        self.stats.evictions += 1;
        let mut freed = 0;
        while freed < tokens {
            let Some(Reverse(entry)) = self.candidates.pop() else {
                break;
            };
            if !self.is_candidate(entry) {
                continue;
            }
            let id = entry.1;
            let parent = self.nodes[id as usize].parent;
            freed += self.remove_leaf(id);
            self.offer(parent);
        }
        // Every way a node becomes an evictable leaf offers it, so an empty heap means nothing
        // is evictable; tests prove it against a scan.
        debug_assert!(
            freed >= tokens || self.evictable_leaves().next().is_none(),
            "an evictable leaf was never offered"
        );
        self.stats.evicted_tokens += freed as u64;
        freed
    }

    fn remove_leaf(&mut self, id: NodeId) -> usize {
        let (parent, len, hashes) = {
            let n = &mut self.nodes[id as usize];
            n.live = false;
            let len = n.key.len();
            n.key = Vec::new();
            let hashes = std::mem::take(&mut n.hashes);
            (n.parent, len, hashes)
        };
        self.record(CacheEvent::Removed { hashes });
        self.nodes[parent as usize]
            .children
            .retain(|&(_, c)| c != id);
        self.free_ids.push(id);
        self.tree_tokens -= len;
        self.evictable_tokens -= len;
        len
    }

    /// Reserve `n` private KV slots for a request, evicting LRU leaves if the free slots do not
    /// suffice. Returns false (and allocates nothing) if even eviction cannot make room.
    pub fn alloc(&mut self, n: usize) -> bool {
        if n > self.available_tokens() {
            return false;
        }
        let free = self.free_tokens();
        if free < n {
            self.evict(n - free);
        }
        if self.free_tokens() < n {
            return false;
        }
        self.private_tokens += n;
        true
    }

    /// Return `n` private slots to the pool.
    pub fn free(&mut self, n: usize) {
        debug_assert!(
            n <= self.private_tokens,
            "freeing more private KV than allocated"
        );
        self.private_tokens -= n.min(self.private_tokens);
    }

    /// Move a request's computed tokens into the tree (SGLang `cache_unfinished_req`).
    ///
    /// `tokens` are all tokens whose KV the request holds; `old` / `old_len` its current handle
    /// (the locked node covering `tokens[..old_len]`, `ROOT`/0 for none). The page-aligned part of
    /// `tokens` is inserted; KV that duplicates what another request inserted meanwhile is freed;
    /// the handle moves to the new node. Returns the new handle `(node, locked_len)`; the
    /// unaligned tail stays private to the request.
    pub fn cache_prefix(&mut self, tokens: &[u32], old: NodeId, old_len: usize) -> (NodeId, usize) {
        let aligned = self.floor_page(tokens.len());
        if aligned <= old_len {
            return (old, old_len);
        }
        let (_, node) = self.insert(&tokens[..aligned]);
        // Slots [old_len, aligned) were private; they are now either new tree nodes (insert
        // counted them) or duplicates of nodes someone else inserted (freed).
        self.free(aligned - old_len);
        self.inc_lock(node);
        if old != ROOT {
            self.dec_lock(old);
        }
        (node, aligned)
    }

    /// Verify the accounting by walking the tree (tests and debug assertions).
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut total = 0;
        let mut evictable = 0;
        let mut stack = vec![ROOT];
        while let Some(id) = stack.pop() {
            let n = &self.nodes[id as usize];
            if !n.live {
                return Err(format!("dead node {id} reachable"));
            }
            if id != ROOT {
                if n.key.is_empty() || !n.key.len().is_multiple_of(self.page) {
                    return Err(format!("node {id} key len {} not whole pages", n.key.len()));
                }
                if n.hashes.len() * self.page != n.key.len() {
                    return Err(format!("node {id} has {} page hashes", n.hashes.len()));
                }
                total += n.key.len();
                if n.lock_ref == 0 {
                    evictable += n.key.len();
                }
                let p = &self.nodes[n.parent as usize];
                if n.parent != ROOT && p.lock_ref < n.lock_ref {
                    return Err(format!("parent of {id} has fewer locks than child"));
                }
            }
            for &(first, c) in &n.children {
                let child = &self.nodes[c as usize];
                if child.parent != id || child.key.first() != Some(&first) {
                    return Err(format!("bad child link {id}->{c}"));
                }
                stack.push(c);
            }
        }
        if total != self.tree_tokens || evictable != self.evictable_tokens {
            return Err(format!(
                "accounting: walked {total}/{evictable}, counted {}/{}",
                self.tree_tokens, self.evictable_tokens
            ));
        }
        if self.tree_tokens + self.private_tokens > self.capacity {
            return Err("capacity exceeded".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    fn ok(c: &RadixCache) {
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

    /// Applies recorded events to a consumer-side model (hash → (parent, page tokens)) and
    /// checks what a KV-event subscriber relies on: parents are known when a page is stored,
    /// removed pages were stored and have no stored children, and the model equals the tree.
    #[derive(Default)]
    struct Consumer {
        pages: std::collections::HashMap<u64, (Option<u64>, Vec<u32>)>,
    }

    impl Consumer {
        /// Apply `evs` as a subscriber would, asserting the stream is self-consistent.
        fn apply(&mut self, evs: &[CacheEvent], page: usize) {
            for ev in evs {
                match ev {
                    CacheEvent::Stored {
                        hashes,
                        parent,
                        tokens,
                    } => {
                        assert_eq!(tokens.len(), hashes.len() * page);
                        if let Some(p) = parent {
                            assert!(self.pages.contains_key(p), "parent {p} not stored");
                        }
                        let mut prev = *parent;
                        for (h, toks) in hashes.iter().zip(tokens.chunks(page)) {
                            let old = self.pages.insert(*h, (prev, toks.to_vec()));
                            assert!(old.is_none(), "page {h} stored twice");
                            prev = Some(*h);
                        }
                    }
                    CacheEvent::Removed { hashes } => {
                        for h in hashes {
                            assert!(self.pages.remove(h).is_some(), "unknown page {h} removed");
                        }
                        for (p, _) in self.pages.values() {
                            assert!(!p.is_some_and(|p| hashes.contains(&p)), "orphaned child");
                        }
                    }
                    CacheEvent::Cleared => self.pages.clear(),
                }
            }
        }

        /// The model holds exactly the tree's pages.
        fn check(&self, c: &RadixCache) {
            let mut live: Vec<u64> = c
                .nodes
                .iter()
                .filter(|n| n.live)
                .flat_map(|n| n.hashes.iter().copied())
                .collect();
            let mut model: Vec<u64> = self.pages.keys().copied().collect();
            live.sort_unstable();
            model.sort_unstable();
            assert_eq!(live, model, "event stream and tree disagree");
        }

        /// Tokens of the whole prefix ending at page `h`, rebuilt from parents.
        fn prefix(&self, mut h: u64) -> Vec<u32> {
            let mut pages = Vec::new();
            loop {
                let (parent, toks) = &self.pages[&h];
                pages.push(toks.clone());
                match parent {
                    Some(p) => h = *p,
                    None => break,
                }
            }
            pages.reverse();
            pages.concat()
        }
    }

    fn take(c: &mut RadixCache) -> Vec<CacheEvent> {
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
    fn random_key(rng: &mut Rng, max_len: usize, bases: usize, period: u32) -> Vec<u32> {
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
                            None => assert_eq!(
                                c.stats().evicted_tokens,
                                before,
                                "nothing was evictable"
                            ),
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
}
