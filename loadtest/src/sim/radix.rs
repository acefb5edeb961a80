//! The simulated worker's KV cache: a token radix tree with SGLang RadixAttention semantics
//! (per-node lock refs, page-granular keys, LRU eviction of unlocked leaves) plus the KV pool
//! accounting around it (tokens held privately by running requests, free slots).
//!
//! Why a faithful model rather than a set of hashes: the routing comparison this crate exists for
//! is decided by *which tokens are still cached when the next turn arrives*, and that depends on
//! splits, lock refs (running requests pin their prefix) and the eviction order. The tree is an
//! arena of nodes addressed by `NodeId`, so request handles stay valid across splits (a split keeps
//! the lower half's id and inserts a new upper node).
//!
//! Two SGLang features routing depends on are modelled too: cache namespaces ([`Namespace`]:
//! requests with different `(extra_key incl. LoRA adapter, cache_salt)` never share a prefix)
//! and an optional host tier (HiCache, [`host`]: pages the device evicts are backed up to host
//! memory and loaded back when a request's prefix continues into them).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;

use crate::rng::hash_tokens;

mod host;
mod namespace;

pub use host::PrefixMatch;
pub use namespace::{Namespace, NsTags};

/// Index of a node in the arena. `ROOT` is the empty prefix and is never evicted or locked.
pub type NodeId = u32;

/// The root node: the empty prefix.
pub const ROOT: NodeId = 0;

/// Where a run of pages is held, as SGLang's events name it (`medium`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Medium {
    /// Device memory: a hit costs nothing.
    Gpu,
    /// Host memory (HiCache): a hit is loaded back over PCIe.
    CpuPinned,
}

impl Medium {
    /// The `medium` string SGLang puts in the event.
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::CpuPinned => "CPU_PINNED",
        }
    }
}

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
        /// The tier the pages entered.
        medium: Medium,
        /// The namespace's salt and adapter name, for a namespace that has them.
        tags: Option<Arc<NsTags>>,
    },
    /// A radix node left a tier: the hashes of all its pages.
    Removed {
        /// One hash per page.
        hashes: Vec<u64>,
        /// The tier the pages left (a copy in another tier stays).
        medium: Medium,
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
    /// The namespace's seed: the root's children are matched only within a namespace (deeper
    /// nodes inherit their parent's).
    ns: u64,
    /// The namespace's event fields.
    tags: Option<Arc<NsTags>>,
    /// The pages are on the device (counted in `tree_tokens`). Device nodes are prefix-closed:
    /// a device node's parent is a device node or the root.
    device: bool,
    /// The pages have a copy in host memory (counted in `host_tokens`).
    host: bool,
    /// A request is loading the node back: host eviction must not take it meanwhile.
    loading: bool,
}

impl Node {
    /// The namespace and tiers of this node, for a node split off it.
    fn place(&self) -> Place {
        Place {
            ns: self.ns,
            tags: self.tags.clone(),
            device: self.device,
            host: self.host,
        }
    }
}

/// Where a new node goes: its namespace and tiers.
#[derive(Debug, Clone)]
struct Place {
    ns: u64,
    tags: Option<Arc<NsTags>>,
    device: bool,
    host: bool,
}

/// Counters describing what the cache did, for metrics and reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Tokens removed by eviction since start (flushes not included).
    pub evicted_tokens: u64,
    /// Number of eviction passes that had to run because an allocation did not fit.
    pub evictions: u64,
    /// Tokens the device evicted that went to host memory instead of being dropped.
    pub backed_up_tokens: u64,
    /// Tokens dropped from host memory to make room there.
    pub host_evicted_tokens: u64,
    /// Tokens loaded back from host memory to the device.
    pub loaded_tokens: u64,
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
    /// Host memory in tokens (0: no host tier, the device drops what it evicts).
    host_capacity: usize,
    /// Tokens with a copy in host memory.
    host_tokens: usize,
    /// Host eviction candidates `(last_access, node)`, lazy like `candidates`
    /// ([`is_host_candidate`](Self::is_host_candidate)).
    host_candidates: BinaryHeap<Reverse<(u64, NodeId)>>,
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
            host_capacity: 0,
            host_tokens: 0,
            host_candidates: BinaryHeap::new(),
        };
        c.reset();
        c
    }

    /// Give the cache a host tier of `tokens` (SGLang's HiCache; 0 = none): what the device
    /// evicts is backed up there while it fits, and a later hit is loaded back.
    pub fn with_host_tier(mut self, tokens: usize) -> Self {
        self.host_capacity = tokens;
        self
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
            ns: 0,
            tags: None,
            device: true,
            host: false,
            loading: false,
        });
        self.tree_tokens = 0;
        self.evictable_tokens = 0;
        self.candidates.clear();
        self.host_tokens = 0;
        self.host_candidates.clear();
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
    /// Tokens stored in the tree on the device (locked or not).
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
    /// Host memory in tokens (0: no host tier).
    pub fn host_capacity(&self) -> usize {
        self.host_capacity
    }
    /// Tokens with a copy in host memory.
    pub fn host_tokens(&self) -> usize {
        self.host_tokens
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

    /// A new node at `place` (no children, not loading).
    fn alloc_node(
        &mut self,
        key: Vec<u32>,
        hashes: Vec<u64>,
        parent: NodeId,
        lock_ref: u32,
        last_access: u64,
        place: Place,
    ) -> NodeId {
        let node = Node {
            key,
            hashes,
            parent,
            children: Vec::new(),
            lock_ref,
            last_access,
            live: true,
            ns: place.ns,
            tags: place.tags,
            device: place.device,
            host: place.host,
            loading: false,
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

    /// The child of `node` in namespace `ns` whose edge starts with the page `page_key`.
    fn child(&self, node: NodeId, ns: u64, page_key: &[u32]) -> Option<NodeId> {
        let first = page_key[0];
        self.nodes[node as usize]
            .children
            .iter()
            .find(|&&(f, c)| {
                let c = &self.nodes[c as usize];
                f == first && c.ns == ns && c.key[..page_key.len()] == *page_key
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
        let (parent, lock_ref, last_access, upper_key, upper_hashes, place) = {
            let c = &mut self.nodes[child as usize];
            let upper: Vec<u32> = c.key.drain(..at).collect();
            let hashes: Vec<u64> = c.hashes.drain(..at / page).collect();
            (
                c.parent,
                c.lock_ref,
                c.last_access,
                upper,
                hashes,
                c.place(),
            )
        };
        let first_upper = upper_key[0];
        let lower_first = self.nodes[child as usize].key[0];
        // Both halves keep the node's tiers: a tier holds or drops a node's pages together.
        let upper = self.alloc_node(
            upper_key,
            upper_hashes,
            parent,
            lock_ref,
            last_access,
            place,
        );
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

    /// Longest prefix of `key` cached on the device, in whole pages, in the default namespace.
    /// Touches the path (LRU) and splits the last edge so that the returned node covers exactly
    /// the matched prefix. Returns `(len, node)`; `(0, ROOT)` on a miss. Callers cap `key` (e.g.
    /// to `len − 1`) before calling.
    pub fn match_prefix(&mut self, key: &[u32]) -> (usize, NodeId) {
        let m = self.match_prefix_in(&Namespace::default(), key);
        (m.device_len, m.device_node)
    }

    /// Longest cached prefix of `key` in namespace `ns`, in whole pages and in either tier:
    /// the device part, then the part only host memory holds (see [`PrefixMatch`]). Touches and
    /// splits like [`match_prefix`](Self::match_prefix).
    pub fn match_prefix_in(&mut self, ns: &Namespace, key: &[u32]) -> PrefixMatch {
        let key = &key[..self.floor_page(key.len())];
        let tick = self.next_tick();
        let (len, node) = self.walk_and_split(ns.seed(), key, tick);
        let (device_node, host_len) = self.device_ancestor(node);
        PrefixMatch {
            device_len: len - host_len,
            device_node,
            host_len,
            node,
        }
    }

    /// The nearest device node at or above `node` and the tokens between the two (the host-only
    /// tail of a path: device nodes are prefix-closed).
    fn device_ancestor(&self, mut node: NodeId) -> (NodeId, usize) {
        let mut host_len = 0;
        while !self.nodes[node as usize].device {
            host_len += self.nodes[node as usize].key.len();
            node = self.nodes[node as usize].parent;
        }
        (node, host_len)
    }

    /// The shared walk of [`match_prefix_in`](Self::match_prefix_in) and
    /// [`insert_in`](Self::insert_in): follow `key` (already page-floored) from the root within
    /// namespace `ns`, stamping every node on the path with `tick` and splitting a partially
    /// matched edge so the returned node covers exactly the matched prefix. Returns
    /// `(matched len, node)`.
    fn walk_and_split(&mut self, ns: u64, key: &[u32], tick: u64) -> (usize, NodeId) {
        let mut node = ROOT;
        let mut pos = 0;
        while pos < key.len() {
            let Some(c) = self.child(node, ns, &key[pos..pos + self.page]) else {
                break;
            };
            let edge_len = self.nodes[c as usize].key.len();
            let common = self.common_pages(&self.nodes[c as usize].key, &key[pos..]);
            let c = if common < edge_len {
                self.split(c, common)
            } else {
                c
            };
            self.nodes[c as usize].last_access = tick;
            // A host copy on the path is now more recent: its old heap entry went stale.
            self.offer_host(c);
            node = c;
            pos += common;
            if common < edge_len {
                break;
            }
        }
        // Only the path's last device node can be a device leaf (the others have the path's
        // next device node as a child); its stamp just changed.
        let (device, _) = self.device_ancestor(node);
        self.offer(device);
        (pos, node)
    }

    /// Length of the prefix of `key` cached on the device in the default namespace, in whole
    /// pages, without touching or splitting.
    pub fn peek_prefix(&self, key: &[u32]) -> usize {
        self.peek_prefix_in(&Namespace::default(), key).0
    }

    /// `(device, host)` tokens of `key`'s cached prefix in namespace `ns`, in whole pages,
    /// without touching or splitting: `device` on the device, then `host` in host memory only.
    pub fn peek_prefix_in(&self, ns: &Namespace, key: &[u32]) -> (usize, usize) {
        let key = &key[..self.floor_page(key.len())];
        let (mut node, mut pos, mut device) = (ROOT, 0, 0);
        while pos < key.len() {
            let Some(c) = self.child(node, ns.seed(), &key[pos..pos + self.page]) else {
                break;
            };
            let common = self.common_pages(&self.nodes[c as usize].key, &key[pos..]);
            pos += common;
            if self.nodes[c as usize].device {
                device = pos;
            }
            if common < self.nodes[c as usize].key.len() {
                break;
            }
            node = c;
        }
        (device, pos - device)
    }

    /// Insert `key` (floored to whole pages) in the default namespace; see
    /// [`insert_in`](Self::insert_in).
    pub fn insert(&mut self, key: &[u32]) -> (usize, NodeId) {
        self.insert_in(&Namespace::default(), key)
    }

    /// Insert `key` (floored to whole pages) in namespace `ns`. Returns `(existing, node)`: how
    /// many leading tokens were already cached, and the node covering the whole (floored) key.
    /// New tokens are counted as device tree tokens (evictable until locked); the caller
    /// accounts for where their KV came from. Nodes on the path held only in host memory take
    /// the caller's freshly computed KV and are on the device again (SGLang reuses such nodes on
    /// insert rather than recomputing twice).
    pub fn insert_in(&mut self, ns: &Namespace, key: &[u32]) -> (usize, NodeId) {
        let key = &key[..self.floor_page(key.len())];
        let tick = self.next_tick();
        let (existing, mut node) = self.walk_and_split(ns.seed(), key, tick);
        self.promote_path(node);
        if existing < key.len() {
            let rest = key[existing..].to_vec();
            let first = rest[0];
            // The node covering exactly `existing` tokens ends with the page before `rest`.
            let parent_hash = self.nodes[node as usize].hashes.last().copied();
            let mut h = parent_hash.unwrap_or(ns.seed());
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
                    medium: Medium::Gpu,
                    tags: ns.tags().cloned(),
                });
            }
            let place = Place {
                ns: ns.seed(),
                tags: ns.tags().cloned(),
                device: true,
                host: false,
            };
            let leaf = self.alloc_node(rest, hashes, node, 0, tick, place);
            self.nodes[node as usize].children.push((first, leaf));
            self.offer(leaf);
            let added = key.len() - existing;
            self.tree_tokens += added;
            self.evictable_tokens += added;
            node = leaf;
        }
        (existing, node)
    }

    /// Put the host-only tail of the path ending at `node` back on the device, top down, as
    /// unlocked tree tokens with a `BlockStored` (GPU) each. The caller has the slots.
    fn promote_path(&mut self, node: NodeId) {
        let (device, _) = self.device_ancestor(node);
        if device == node {
            return;
        }
        let mut path = Vec::new();
        let mut n = node;
        while n != device {
            path.push(n);
            n = self.nodes[n as usize].parent;
        }
        for &id in path.iter().rev() {
            let len = self.nodes[id as usize].key.len();
            self.nodes[id as usize].device = true;
            self.tree_tokens += len;
            self.evictable_tokens += len;
            self.record_store(id, Medium::Gpu);
        }
        self.offer(node);
    }

    /// Record a `BlockStored` of node `id`'s pages in `medium`.
    fn record_store(&mut self, id: NodeId, medium: Medium) {
        if self.events.is_none() {
            return;
        }
        let n = &self.nodes[id as usize];
        let ev = CacheEvent::Stored {
            hashes: n.hashes.clone(),
            parent: self.nodes[n.parent as usize].hashes.last().copied(),
            tokens: n.key.clone(),
            medium,
            tags: n.tags.clone(),
        };
        self.record(ev);
    }

    /// Record a `BlockRemoved` of node `id`'s pages from `medium`.
    fn record_remove(&mut self, id: NodeId, medium: Medium) {
        if self.events.is_some() {
            let hashes = self.nodes[id as usize].hashes.clone();
            self.record(CacheEvent::Removed { hashes, medium });
        }
    }

    /// Pin the path from `node` to the root (a running request uses it).
    pub fn inc_lock(&mut self, mut node: NodeId) {
        while node != ROOT {
            let n = &mut self.nodes[node as usize];
            debug_assert!(n.device, "a lock on a node that is not on the device");
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

    /// Whether `id` may be evicted from the device now: a live, unlocked device node none of
    /// whose children is on the device (never the root). Without a host tier every live node is
    /// on the device, so this is a plain leaf.
    fn is_evictable_leaf(&self, id: NodeId) -> bool {
        let n = &self.nodes[id as usize];
        id != ROOT
            && n.live
            && n.device
            && n.lock_ref == 0
            && n.children
                .iter()
                .all(|&(_, c)| !self.nodes[c as usize].device)
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
            freed += if self.host_capacity > 0 {
                self.demote(id)
            } else {
                self.remove_leaf(id)
            };
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

    /// Drop a device leaf with nothing below it from the tree (no host tier to keep it).
    fn remove_leaf(&mut self, id: NodeId) -> usize {
        self.record_remove(id, Medium::Gpu);
        let len = self.unlink(id);
        self.tree_tokens -= len;
        self.evictable_tokens -= len;
        len
    }

    /// Take a childless node out of the tree (its tier accounting is the caller's); returns its
    /// token count. The parent may become a host eviction candidate.
    fn unlink(&mut self, id: NodeId) -> usize {
        let (parent, len) = {
            let n = &mut self.nodes[id as usize];
            debug_assert!(n.children.is_empty(), "unlinking a node with children");
            n.live = false;
            n.device = false;
            n.host = false;
            n.tags = None;
            let len = n.key.len();
            n.key = Vec::new();
            n.hashes = Vec::new();
            (n.parent, len)
        };
        self.nodes[parent as usize]
            .children
            .retain(|&(_, c)| c != id);
        self.free_ids.push(id);
        self.offer_host(parent);
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
        self.cache_prefix_in(&Namespace::default(), tokens, old, old_len)
    }

    /// [`cache_prefix`](Self::cache_prefix) for a request of namespace `ns`.
    pub fn cache_prefix_in(
        &mut self,
        ns: &Namespace,
        tokens: &[u32],
        old: NodeId,
        old_len: usize,
    ) -> (NodeId, usize) {
        let aligned = self.floor_page(tokens.len());
        if aligned <= old_len {
            return (old, old_len);
        }
        let (_, node) = self.insert_in(ns, &tokens[..aligned]);
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
        let mut host = 0;
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
                if !n.device && !n.host {
                    return Err(format!("node {id} is in no tier"));
                }
                if n.loading {
                    return Err(format!("node {id} left marked as loading"));
                }
                if n.device {
                    total += n.key.len();
                    if n.lock_ref == 0 {
                        evictable += n.key.len();
                    }
                } else if n.lock_ref > 0 {
                    return Err(format!("host-only node {id} is locked"));
                }
                if n.host {
                    host += n.key.len();
                }
                let p = &self.nodes[n.parent as usize];
                if n.parent != ROOT && p.lock_ref < n.lock_ref {
                    return Err(format!("parent of {id} has fewer locks than child"));
                }
                if n.device && !p.device {
                    return Err(format!("device node {id} under a host-only parent"));
                }
                if n.parent != ROOT && p.ns != n.ns {
                    return Err(format!("node {id} left its parent's namespace"));
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
        if host != self.host_tokens || host > self.host_capacity {
            return Err(format!(
                "host accounting: walked {host}, counted {} of {}",
                self.host_tokens, self.host_capacity
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tier_tests;
