//! Persistent compressed radix tree over UTF-8 text (pure; no I/O, no clocks).
//!
//! # Shape
//! Nodes live in `Arc`s and are only ever mutated through `Arc::make_mut`, so a clone of a
//! [`RadixTree`] (a published snapshot) is never affected by later mutations: the writer copies
//! exactly the nodes on the paths it touches while a snapshot still shares them, and mutates in
//! place afterwards. Cloning a tree is two reference-count increments.
//!
//! Edges hold whole UTF-8 characters: every split point is moved back to a character boundary,
//! so two siblings never share a first *character* (they may share a first *byte*, e.g. `é` and
//! `è`, or most CJK characters). Children are therefore keyed by their whole first character,
//! packed into a `u32`, which makes the lookup exact whatever the script. Next to each key the
//! parent keeps a 32-bit bloom of the child's workers (bit `w % 32`), so walks over one worker's
//! nodes (eviction, removal) skip the other workers' children without dereferencing them.
//!
//! The tree is kept *canonical*: a node exists only where text branches or where the set of
//! workers changes (some worker's text ends there). Concretely, apart from the root, no node has a
//! single child holding the same set of workers; inserts, removals and evictions all merge such
//! pairs back. This keeps the node count proportional to the distinct branch points.
//!
//! # Invariants (checked by [`RadixTree::check_invariants`])
//! - Every non-root node has a non-empty edge and a non-empty, sorted set of workers.
//! - A worker held by a node is held by all its ancestors, with an access time at least as large.
//! - A worker holds a node only if some text it was sent covers the node's whole edge; hence the
//!   workers of a node are exactly those with text extending through any point of its edge.
//! - Per-worker character counts equal the sum of `edge_chars` over the nodes the worker holds.
//!
//! Every traversal is iterative (including `Drop`): a crafted sequence of prompts can make the
//! tree as deep as the longest prompt has characters.
use super::WorkerId;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fmt;
use std::sync::Arc;

/// The result of a longest-prefix match, borrowed from a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Match<'a> {
    /// Characters (Unicode scalar values) of the key matched; never splits a character.
    pub matched_chars: usize,
    /// The same length in bytes.
    pub matched_bytes: usize,
    /// Workers holding the deepest matched position (a partially matched edge counts). Sorted,
    /// deduplicated. Empty when nothing matched.
    pub workers: &'a [WorkerId],
}

/// Keys longer than this are cut (at a character boundary) so every edge length fits in `u32`.
/// Far above any request body the gateway accepts.
const MAX_KEY_BYTES: usize = u32::MAX as usize;

/// `true` when `b` starts a UTF-8 character (is not a continuation byte `10xx_xxxx`).
#[inline(always)]
fn is_char_start(b: u8) -> bool {
    (b as i8) >= -0x40
}

/// Characters in a slice of valid UTF-8 that starts at a character boundary. Branch-free, so it
/// vectorises.
#[inline]
fn count_chars(bytes: &[u8]) -> usize {
    bytes.iter().filter(|&&b| is_char_start(b)).count()
}

/// Length of the common prefix of `a` and `b`, in bytes. Compares 32-byte blocks (constant-size
/// array equality, which LLVM lowers to vector compares), then 8-byte words (the first differing
/// byte found from the XOR), then single bytes for the tail.
#[inline]
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut i = 0;
    while let (Some(x), Some(y)) = (a[i..].first_chunk::<32>(), b[i..].first_chunk::<32>()) {
        if x != y {
            break;
        }
        i += 32;
    }
    while let (Some(x), Some(y)) = (a[i..].first_chunk::<8>(), b[i..].first_chunk::<8>()) {
        let diff = u64::from_le_bytes(*x) ^ u64::from_le_bytes(*y);
        if diff != 0 {
            return i + (diff.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

/// Bytes per child key.
const KEY_BYTES: usize = 4;

/// The first character of `s` (non-empty, starting at a character boundary) as its UTF-8 bytes
/// packed big-endian and zero-padded: distinct characters get distinct keys, ordered like bytes.
#[inline]
fn char_key(s: &[u8]) -> u32 {
    let b = s[0];
    let len = match b {
        0..=0x7f => 1,
        0x80..=0xdf => 2,
        0xe0..=0xef => 3,
        _ => 4,
    };
    let mut k = [0u8; KEY_BYTES];
    let len = len.min(s.len());
    k[..len].copy_from_slice(&s[..len]);
    u32::from_be_bytes(k)
}

#[inline]
fn key_at(keys: &[u8], i: usize) -> Option<u32> {
    keys.get(i * KEY_BYTES..)?
        .first_chunk::<KEY_BYTES>()
        .map(|k| u32::from_be_bytes(*k))
}

/// Bytes of per-child metadata in a node's `bytes`: the key, then (in a second array) the bloom.
const META_BYTES: usize = 2 * KEY_BYTES;

/// The bloom bit of a worker.
#[inline]
fn bloom_bit(worker: WorkerId) -> u32 {
    1 << (worker % 32)
}

/// Child `i`'s bloom in `bytes` laid out for `kids` children.
#[inline]
fn bloom_in(bytes: &[u8], kids: usize, i: usize) -> u32 {
    key_at(&bytes[kids * KEY_BYTES..], i).unwrap_or(u32::MAX)
}

/// Lays out a node's bytes: the keys, the blooms, then the edge (in pieces).
fn assemble(meta: &[(u32, u32)], edge: &[&[u8]]) -> Box<[u8]> {
    let len = meta.len() * META_BYTES + edge.iter().map(|e| e.len()).sum::<usize>();
    let mut bytes = Vec::with_capacity(len);
    for &(key, _) in meta {
        bytes.extend_from_slice(&key.to_be_bytes());
    }
    for &(_, bloom) in meta {
        bytes.extend_from_slice(&bloom.to_be_bytes());
    }
    for e in edge {
        bytes.extend_from_slice(e);
    }
    bytes.into_boxed_slice()
}

/// Moves `n` back to the nearest character boundary of `s` (valid UTF-8 starting at a boundary).
#[inline]
fn floor_char_boundary(s: &[u8], mut n: usize) -> usize {
    while n > 0 && n < s.len() && !is_char_start(s[n]) {
        n -= 1;
    }
    n
}

/// The workers holding a node and their last access times. Most nodes (leaves) have one worker,
/// kept inline: no allocation and no extra cache miss. Otherwise one allocation: the sorted ids,
/// then each time as two `u32` halves (low, high). Either way the ids are contiguous, so
/// [`RadixTree::longest_match`] returns them as a borrowed slice.
#[derive(Clone)]
enum Workers {
    One {
        id: WorkerId,
        time: u64,
    },
    /// Zero (an empty box, no allocation) or at least two workers; never exactly one.
    Many(Box<[u32]>),
}

impl Default for Workers {
    fn default() -> Self {
        Workers::Many(Box::default())
    }
}

/// Packs two or more (id, time) entries, sorted by id.
fn pack(entries: &[(WorkerId, u64)]) -> Workers {
    let mut v = Vec::with_capacity(3 * entries.len());
    v.extend(entries.iter().map(|&(w, _)| w));
    for &(_, t) in entries {
        v.extend_from_slice(&[t as u32, (t >> 32) as u32]);
    }
    Workers::Many(v.into_boxed_slice())
}

impl Workers {
    fn one(worker: WorkerId, now: u64) -> Self {
        Workers::One {
            id: worker,
            time: now,
        }
    }

    #[inline]
    fn len(&self) -> usize {
        match self {
            Workers::One { .. } => 1,
            Workers::Many(b) => b.len() / 3,
        }
    }

    #[inline]
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    fn ids(&self) -> &[WorkerId] {
        match self {
            Workers::One { id, .. } => std::slice::from_ref(id),
            Workers::Many(b) => &b[..b.len() / 3],
        }
    }

    #[inline]
    fn find(&self, worker: WorkerId) -> Result<usize, usize> {
        match self {
            Workers::One { id, .. } => match worker.cmp(id) {
                std::cmp::Ordering::Equal => Ok(0),
                std::cmp::Ordering::Less => Err(0),
                std::cmp::Ordering::Greater => Err(1),
            },
            Workers::Many(_) => self.ids().binary_search(&worker),
        }
    }

    #[inline]
    fn contains(&self, worker: WorkerId) -> bool {
        self.find(worker).is_ok()
    }

    fn time_at(&self, i: usize) -> u64 {
        match self {
            Workers::One { time, .. } => *time,
            Workers::Many(b) => {
                let base = b.len() / 3 + 2 * i;
                u64::from(b[base]) | (u64::from(b[base + 1]) << 32)
            }
        }
    }

    fn set_time_at(&mut self, i: usize, t: u64) {
        match self {
            Workers::One { time, .. } => *time = t,
            Workers::Many(b) => {
                let base = b.len() / 3 + 2 * i;
                b[base] = t as u32;
                b[base + 1] = (t >> 32) as u32;
            }
        }
    }

    fn time(&self, worker: WorkerId) -> Option<u64> {
        self.find(worker).ok().map(|i| self.time_at(i))
    }

    /// Adds `worker` or refreshes its time (never moving it backwards). Returns `true` if added.
    fn touch(&mut self, worker: WorkerId, now: u64) -> bool {
        let pos = match self.find(worker) {
            Ok(i) => {
                if self.time_at(i) < now {
                    self.set_time_at(i, now);
                }
                return false;
            }
            Err(pos) => pos,
        };
        *self = match self {
            Workers::One { id, time } if pos == 0 => pack(&[(worker, now), (*id, *time)]),
            Workers::One { id, time } => pack(&[(*id, *time), (worker, now)]),
            Workers::Many(b) if b.is_empty() => Workers::one(worker, now),
            Workers::Many(b) => {
                let len = b.len() / 3;
                let mut v = Vec::with_capacity(3 * (len + 1));
                v.extend_from_slice(&b[..pos]);
                v.push(worker);
                v.extend_from_slice(&b[pos..len + 2 * pos]);
                v.extend_from_slice(&[now as u32, (now >> 32) as u32]);
                v.extend_from_slice(&b[len + 2 * pos..]);
                Workers::Many(v.into_boxed_slice())
            }
        };
        true
    }

    /// Removes `worker`; returns `true` if it was present.
    fn remove(&mut self, worker: WorkerId) -> bool {
        let Ok(pos) = self.find(worker) else {
            return false;
        };
        *self = match self {
            Workers::One { .. } => Workers::default(),
            Workers::Many(b) if b.len() == 6 => {
                let other = 1 - pos;
                Workers::one(b[other], self.time_at(other))
            }
            Workers::Many(b) => {
                let len = b.len() / 3;
                let mut v = Vec::with_capacity(3 * (len - 1));
                v.extend_from_slice(&b[..pos]);
                v.extend_from_slice(&b[pos + 1..len + 2 * pos]);
                v.extend_from_slice(&b[len + 2 * pos + 2..]);
                Workers::Many(v.into_boxed_slice())
            }
        };
        true
    }

    /// Representation invariant: `Many` holds whole entries and never exactly one.
    fn well_formed(&self) -> bool {
        match self {
            Workers::One { .. } => true,
            Workers::Many(b) => b.len() % 3 == 0 && b.len() != 3,
        }
    }

    fn bloom(&self) -> u32 {
        self.ids().iter().fold(0, |acc, &w| acc | bloom_bit(w))
    }

    fn same_ids(&self, other: &Workers) -> bool {
        self.ids() == other.ids()
    }

    /// Per worker, the later of the two times. Both sets must hold the same ids.
    fn merge_times_max(&mut self, other: &Workers) {
        debug_assert!(self.same_ids(other));
        for i in 0..self.len().min(other.len()) {
            let t = other.time_at(i);
            if self.time_at(i) < t {
                self.set_time_at(i, t);
            }
        }
    }
}

/// One node: 64 bytes, 80 with the `Arc` header (a mimalloc size class), plus the heap parts:
/// child keys and blooms + edge in one allocation, child pointers, and the worker set when more
/// than one worker holds the node.
#[derive(Clone, Default)]
struct Node {
    /// Each child's key ([`char_key`] of its edge, 4 bytes big-endian, sorted, parallel to
    /// `kids`), then each child's worker bloom (4 bytes), then this node's edge. One allocation:
    /// lookups read the keys, then the matching child's edge.
    bytes: Box<[u8]>,
    kids: Box<[Arc<Node>]>,
    workers: Workers,
    /// Characters in the edge, so full-edge matches never count characters.
    edge_chars: u32,
}

impl Node {
    fn leaf(edge: &[u8], edge_chars: u32, worker: WorkerId, now: u64) -> Node {
        Node {
            bytes: edge.into(),
            kids: Box::default(),
            workers: Workers::one(worker, now),
            edge_chars,
        }
    }

    #[inline]
    fn keys(&self) -> &[u8] {
        &self.bytes[..self.kids.len() * KEY_BYTES]
    }

    #[inline]
    fn edge(&self) -> &[u8] {
        &self.bytes[self.kids.len() * META_BYTES..]
    }

    #[inline]
    fn bloom(&self, i: usize) -> u32 {
        bloom_in(&self.bytes, self.kids.len(), i)
    }

    /// Whether child `i` may hold `worker` (exact when the bloom says no).
    #[inline]
    fn kid_may_hold(&self, i: usize, worker: WorkerId) -> bool {
        self.bloom(i) & bloom_bit(worker) != 0
    }

    /// Records in child `i`'s bloom that it now holds `worker`.
    fn add_to_bloom(&mut self, i: usize, worker: WorkerId) {
        let at = self.kids.len() * KEY_BYTES + i * KEY_BYTES;
        if let Some(b) = self.bytes.get_mut(at..at + KEY_BYTES) {
            let v = u32::from_be_bytes([b[0], b[1], b[2], b[3]]) | bloom_bit(worker);
            b.copy_from_slice(&v.to_be_bytes());
        }
    }

    /// The child whose edge starts with the first character of `rest` (non-empty), and the
    /// shared length in bytes cut back to a character boundary (at least that character).
    /// `Err(pos)` gives where a new child for `rest` would be inserted.
    #[inline]
    fn find_child(&self, rest: &[u8]) -> Result<(usize, usize), usize> {
        let key = char_key(rest);
        let keys = self.keys();
        // Sorted keys: the count of smaller keys is the lower bound. Branch-free, vectorises.
        let i = keys
            .chunks_exact(KEY_BYTES)
            .filter(|k| u32::from_be_bytes([k[0], k[1], k[2], k[3]]) < key)
            .count();
        if key_at(keys, i) != Some(key) {
            return Err(i);
        }
        let n = floor_char_boundary(rest, common_prefix(self.kids[i].edge(), rest));
        Ok((i, n))
    }

    /// Inserts `kid` at `pos` of the (sorted) child arrays.
    fn insert_child(&mut self, pos: usize, kid: Arc<Node>) {
        // Invariant: non-root edges are non-empty.
        let key = char_key(kid.edge()).to_be_bytes();
        let bloom = kid.workers.bloom().to_be_bytes();
        let k = self.kids.len();
        let (keys, rest) = self.bytes.split_at(k * KEY_BYTES);
        let (blooms, edge) = rest.split_at(k * KEY_BYTES);
        let at = pos * KEY_BYTES;
        let mut bytes = Vec::with_capacity(self.bytes.len() + META_BYTES);
        bytes.extend_from_slice(&keys[..at]);
        bytes.extend_from_slice(&key);
        bytes.extend_from_slice(&keys[at..]);
        bytes.extend_from_slice(&blooms[..at]);
        bytes.extend_from_slice(&bloom);
        bytes.extend_from_slice(&blooms[at..]);
        bytes.extend_from_slice(edge);
        self.bytes = bytes.into_boxed_slice();
        let mut kids = std::mem::take(&mut self.kids).into_vec();
        kids.reserve_exact(1);
        kids.insert(pos, kid);
        self.kids = kids.into_boxed_slice();
    }

    /// Appends `more` (whole characters) to the edge of a node without children.
    fn extend_edge(&mut self, more: &[u8], chars: u32) {
        debug_assert!(self.kids.is_empty());
        let mut bytes = Vec::with_capacity(self.bytes.len() + more.len());
        bytes.extend_from_slice(&self.bytes);
        bytes.extend_from_slice(more);
        self.bytes = bytes.into_boxed_slice();
        self.edge_chars += chars;
    }

    /// Merges the only child into this node: the edges concatenate, the child's children and
    /// (identical) worker set are kept with the later access times.
    fn absorb_only_child(&mut self) {
        debug_assert_eq!(self.kids.len(), 1);
        let Some(child) = std::mem::take(&mut self.kids).into_vec().pop() else {
            return;
        };
        // `self.bytes` was `child key ++ child bloom ++ edge`; it becomes
        // `child keys ++ child blooms ++ edge ++ child edge`.
        let own_edge = &self.bytes[META_BYTES..];
        let mut bytes = Vec::with_capacity(own_edge.len() + child.bytes.len());
        bytes.extend_from_slice(&child.bytes[..child.kids.len() * META_BYTES]);
        bytes.extend_from_slice(own_edge);
        bytes.extend_from_slice(child.edge());
        self.bytes = bytes.into_boxed_slice();
        self.edge_chars += child.edge_chars;
        self.workers.merge_times_max(&child.workers);
        self.kids = match Arc::try_unwrap(child) {
            Ok(mut c) => std::mem::take(&mut c.kids),
            Err(shared) => shared.kids.clone(),
        };
    }
}

/// Splits the edge of the node in `slot` after `n` bytes (a character boundary inside the edge):
/// `slot` then holds a new upper node with the first part of the edge and the same workers, whose
/// only child is the old node with the rest of the edge.
fn split(slot: &mut Arc<Node>, n: usize) {
    let lower = Arc::make_mut(slot);
    let meta_len = lower.kids.len() * META_BYTES;
    let edge = &lower.bytes[meta_len..];
    debug_assert!(n > 0 && n < edge.len());
    let upper_chars = count_chars(&edge[..n]) as u32;
    let upper_bytes = assemble(
        &[(char_key(&edge[n..]), lower.workers.bloom())],
        &[&edge[..n]],
    );
    let mut lower_bytes = Vec::with_capacity(lower.bytes.len() - n);
    lower_bytes.extend_from_slice(&lower.bytes[..meta_len]);
    lower_bytes.extend_from_slice(&edge[n..]);
    lower.bytes = lower_bytes.into_boxed_slice();
    lower.edge_chars -= upper_chars;
    let upper = Node {
        bytes: upper_bytes,
        kids: Box::new([Arc::clone(slot)]),
        workers: slot.workers.clone(),
        edge_chars: upper_chars,
    };
    *slot = Arc::new(upper);
}

impl Drop for Node {
    /// Iterative, so freeing a deep subtree cannot overflow the stack: children this node owns
    /// alone are unwrapped and their children queued, instead of recursing.
    fn drop(&mut self) {
        if self.kids.is_empty() {
            return;
        }
        let mut stack = std::mem::take(&mut self.kids).into_vec();
        while let Some(kid) = stack.pop() {
            if let Ok(mut node) = Arc::try_unwrap(kid) {
                stack.extend(std::mem::take(&mut node.kids).into_vec());
            }
        }
    }
}

/// One entry of the eviction plan: a node held by the worker being evicted, in DFS preorder over
/// the nodes that worker holds (index 0 = root).
#[derive(Clone, Copy)]
struct Slot {
    time: u64,
    parent: u32,
    /// One past the last preorder index of this node's subtree.
    end: u32,
    chars: u32,
    /// Children held by the worker that are not (yet) evicted.
    live_kids: u32,
    evicted: bool,
    /// The subtree contains an evicted node, so the apply pass must descend into it.
    dirty: bool,
}

/// A node being rebuilt by [`RadixTree::prune`]: its children were taken out and are being
/// processed one by one; `meta` holds the (key, bloom) of each child kept.
struct Frame {
    node: Arc<Node>,
    /// This node's key in its parent (unchanged by merges: the first character stays).
    key: u32,
    kids: std::vec::IntoIter<Arc<Node>>,
    /// Index of the next child `kids` yields.
    next: usize,
    had: usize,
    keep: Vec<Arc<Node>>,
    meta: Vec<(u32, u32)>,
    remove: bool,
}

impl Frame {
    fn open(mut node: Arc<Node>, key: u32, remove: bool) -> Frame {
        let kids = std::mem::take(&mut Arc::make_mut(&mut node).kids).into_vec();
        let had = kids.len();
        Frame {
            node,
            key,
            kids: kids.into_iter(),
            next: 0,
            had,
            keep: Vec::with_capacity(had),
            meta: Vec::with_capacity(had),
            remove,
        }
    }
}

/// One model's tree. Cloning is O(1) (shares the root `Arc`).
#[derive(Clone)]
pub struct RadixTree {
    root: Arc<Node>,
    /// Characters held per worker, sorted by worker. Its keys are exactly the root's workers.
    counts: Arc<Vec<(WorkerId, u64)>>,
    nodes: usize,
}

impl Default for RadixTree {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for RadixTree {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RadixTree")
            .field("nodes", &self.nodes)
            .field("workers", &self.counts.len())
            .field("total_chars", &self.total_chars())
            .finish()
    }
}

impl RadixTree {
    /// An empty tree (just the root).
    pub fn new() -> Self {
        RadixTree {
            root: Arc::new(Node::default()),
            counts: Arc::new(Vec::new()),
            nodes: 1,
        }
    }

    /// Longest prefix of `key` present in the tree, with the workers that hold it.
    pub fn longest_match(&self, key: &str) -> Match<'_> {
        let bytes = key.as_bytes();
        let mut node: &Node = &self.root;
        let mut matched_bytes = 0;
        let mut matched_chars = 0;
        let mut workers: &[WorkerId] = &[];
        while matched_bytes < bytes.len() {
            let rest = &bytes[matched_bytes..];
            let Ok((i, n)) = node.find_child(rest) else {
                break;
            };
            let child = &node.kids[i];
            workers = child.workers.ids();
            if n == child.edge().len() {
                matched_bytes += n;
                matched_chars += child.edge_chars as usize;
                node = child;
            } else {
                // Partial edge: count characters only here.
                matched_bytes += n;
                matched_chars += count_chars(&rest[..n]);
                break;
            }
        }
        Match {
            matched_chars,
            matched_bytes,
            workers,
        }
    }

    /// Record that `key` was sent to `worker` at logical time `now` (larger = more recent).
    /// Path-copies shared nodes (`Arc::make_mut`).
    pub fn insert(&mut self, key: &str, worker: WorkerId, now: u64) {
        let mut rest = key.as_bytes();
        if rest.len() > MAX_KEY_BYTES {
            rest = &rest[..floor_char_boundary(rest, MAX_KEY_BYTES)];
        }
        let mut added: u64 = 0;
        let mut new_nodes: usize = 0;
        let mut merged: usize = 0;
        let mut cur: &mut Node = Arc::make_mut(&mut self.root);
        cur.workers.touch(worker, now);
        let mut at_root = true;
        while !rest.is_empty() {
            match cur.find_child(rest) {
                Err(pos) => {
                    let chars = count_chars(rest) as u32;
                    added += u64::from(chars);
                    if !at_root && cur.kids.is_empty() && cur.workers.ids() == [worker] {
                        // A lone child with the same single worker would be merged at once.
                        cur.extend_edge(rest, chars);
                    } else {
                        cur.insert_child(pos, Arc::new(Node::leaf(rest, chars, worker, now)));
                        new_nodes += 1;
                    }
                    break;
                }
                Ok((i, n)) => {
                    let edge_len = cur.kids[i].edge().len();
                    let child_has = cur.kids[i].workers.contains(worker);
                    // Split where the key diverges inside the edge, or where it ends inside an
                    // edge the worker does not hold yet (the worker covers only the first part).
                    if n < edge_len && !(n == rest.len() && child_has) {
                        split(&mut cur.kids[i], n);
                        new_nodes += 1;
                    }
                    let child = Arc::make_mut(&mut cur.kids[i]);
                    if child.workers.touch(worker, now) {
                        added += u64::from(child.edge_chars);
                        cur.add_to_bloom(i, worker);
                    }
                    rest = &rest[n..];
                    if !at_root && cur.kids.len() == 1 && cur.workers.same_ids(&cur.kids[0].workers)
                    {
                        // Adding the worker made the only child indistinguishable: merge and
                        // continue from the merged node.
                        cur.absorb_only_child();
                        merged += 1;
                    } else {
                        cur = Arc::make_mut(&mut cur.kids[i]);
                        at_root = false;
                    }
                }
            }
        }
        self.nodes = self.nodes + new_nodes - merged;
        let counts = Arc::make_mut(&mut self.counts);
        match counts.binary_search_by_key(&worker, |&(w, _)| w) {
            Ok(i) => counts[i].1 += added,
            Err(i) => counts.insert(i, (worker, added)),
        }
    }

    /// Forget `worker` everywhere; drops nodes nobody holds and merges single-child chains.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        if !self.root.workers.contains(worker) {
            return;
        }
        self.prune(worker, None);
        let counts = Arc::make_mut(&mut self.counts);
        if let Ok(i) = counts.binary_search_by_key(&worker, |&(w, _)| w) {
            counts.remove(i);
        }
    }

    /// Characters held by `worker` (shared text counts once per worker holding it).
    pub fn worker_chars(&self, worker: WorkerId) -> u64 {
        match self.counts.binary_search_by_key(&worker, |&(w, _)| w) {
            Ok(i) => self.counts[i].1,
            Err(_) => 0,
        }
    }

    /// Every worker present in the tree with the characters it holds, sorted by worker. Used by
    /// the writer to find workers over budget and by metrics.
    pub fn worker_char_counts(&self) -> impl ExactSizeIterator<Item = (WorkerId, u64)> + '_ {
        self.counts.iter().copied()
    }

    /// Characters summed over workers (shared text counts once per worker holding it).
    pub fn total_chars(&self) -> u64 {
        self.counts.iter().map(|&(_, c)| c).sum()
    }

    /// Remove `worker`'s least recently used leaves until it holds at most `max_chars`.
    /// Returns the characters removed.
    ///
    /// A leaf *for the worker* is a node it holds with no child it holds; removing one can make
    /// its parent such a leaf, which then competes by its own access time. Nodes other workers
    /// still hold only lose this worker; nodes left empty are dropped and chains merged.
    pub fn evict_worker(&mut self, worker: WorkerId, max_chars: u64) -> u64 {
        let count = self.worker_chars(worker);
        if count <= max_chars {
            return 0;
        }
        let mut slots = self.plan_slots(worker);
        let mut heap: BinaryHeap<Reverse<(u64, u32)>> = slots
            .iter()
            .enumerate()
            .skip(1)
            .filter(|(_, s)| s.live_kids == 0)
            .map(|(i, s)| Reverse((s.time, i as u32)))
            .collect();
        let mut left = count;
        while left > max_chars {
            let Some(Reverse((_, idx))) = heap.pop() else {
                break;
            };
            let idx = idx as usize;
            let slot = &mut slots[idx];
            slot.evicted = true;
            left -= u64::from(slot.chars);
            let parent = slot.parent as usize;
            // Mark the path up to the root so the apply pass descends to this node.
            let mut up = idx;
            while !slots[up].dirty {
                slots[up].dirty = true;
                if up == 0 {
                    break;
                }
                up = slots[up].parent as usize;
            }
            let p = &mut slots[parent];
            p.live_kids -= 1;
            if p.live_kids == 0 && parent != 0 {
                heap.push(Reverse((p.time, parent as u32)));
            }
        }
        drop(heap);
        self.prune(worker, Some(&slots));
        let removed = count - left;
        let counts = Arc::make_mut(&mut self.counts);
        if let Ok(i) = counts.binary_search_by_key(&worker, |&(w, _)| w) {
            counts[i].1 = left;
        }
        removed
    }

    /// Number of nodes (root included).
    pub fn node_count(&self) -> usize {
        self.nodes
    }

    /// Bytes of text stored in edges (each shared prefix once, whatever the number of workers).
    /// O(nodes): for memory accounting in benches and debugging, not for the request path.
    pub fn stored_bytes(&self) -> usize {
        let mut total = 0;
        let mut stack: Vec<&Node> = vec![&self.root];
        while let Some(node) = stack.pop() {
            total += node.edge().len();
            stack.extend(node.kids.iter().map(|k| &**k));
        }
        total
    }

    /// The nodes `worker` holds, in DFS preorder (children in key order, only those it holds).
    fn plan_slots(&self, worker: WorkerId) -> Vec<Slot> {
        let root_time = self.root.workers.time(worker).unwrap_or(0);
        let mut slots = vec![Slot {
            time: root_time,
            parent: u32::MAX,
            end: 0,
            chars: 0,
            live_kids: 0,
            evicted: false,
            dirty: false,
        }];
        // (node, its slot, next child to look at)
        let mut stack: Vec<(&Node, usize, usize)> = vec![(&self.root, 0, 0)];
        while let Some(top) = stack.last_mut() {
            let (node, idx, next) = *top;
            let Some(kid) = node.kids.get(next) else {
                slots[idx].end = slots.len() as u32;
                stack.pop();
                continue;
            };
            top.2 += 1;
            if !node.kid_may_hold(next, worker) {
                continue;
            }
            let Some(time) = kid.workers.time(worker) else {
                continue;
            };
            slots[idx].live_kids += 1;
            let kid_idx = slots.len();
            slots.push(Slot {
                time,
                parent: idx as u32,
                end: 0,
                chars: kid.edge_chars,
                live_kids: 0,
                evicted: false,
                dirty: false,
            });
            stack.push((kid, kid_idx, 0));
        }
        slots
    }

    /// Removes `worker` from the nodes the plan marks evicted (every node it holds, root
    /// included, when `plan` is `None`), dropping nodes left empty and merging single-child
    /// chains. Descends only into subtrees that change; everything else stays shared.
    fn prune(&mut self, worker: WorkerId, plan: Option<&[Slot]>) {
        let root = std::mem::replace(&mut self.root, Arc::new(Node::default()));
        let mut stack = vec![Frame::open(root, 0, plan.is_none())];
        let mut idx = 0usize;
        let mut gone = 0usize;
        loop {
            // Invariant: the loop returns when it pops the root frame, so the stack is non-empty.
            let Some(top) = stack.last_mut() else {
                return;
            };
            if let Some(kid) = top.kids.next() {
                let i = top.next;
                top.next += 1;
                // The frame's node still holds its original keys and blooms.
                let key = key_at(&top.node.bytes, i).unwrap_or(0);
                let bloom = bloom_in(&top.node.bytes, top.had, i);
                if bloom & bloom_bit(worker) == 0 || !kid.workers.contains(worker) {
                    top.keep.push(kid);
                    top.meta.push((key, bloom));
                    continue;
                }
                idx += 1;
                let remove = match plan {
                    None => true,
                    Some(slots) => {
                        let s = &slots[idx];
                        if !s.dirty {
                            top.keep.push(kid);
                            top.meta.push((key, bloom));
                            idx = s.end as usize - 1;
                            continue;
                        }
                        s.evicted
                    }
                };
                stack.push(Frame::open(kid, key, remove));
                continue;
            }
            let Some(frame) = stack.pop() else {
                return;
            };
            let is_root = stack.is_empty();
            let Frame {
                mut node,
                key,
                had,
                keep,
                meta,
                remove,
                ..
            } = frame;
            // Unique already: `Frame::open` made it so and nothing cloned it since.
            let n = Arc::make_mut(&mut node);
            if remove {
                n.workers.remove(worker);
            }
            n.bytes = assemble(&meta, &[&n.bytes[had * META_BYTES..]]);
            n.kids = keep.into_boxed_slice();
            if is_root {
                self.root = node;
                self.nodes -= gone;
                return;
            }
            if n.workers.is_empty() {
                // Nobody holds it, so (subset invariant) nobody held its children either: they
                // were dropped before it.
                debug_assert!(n.kids.is_empty());
                gone += 1;
                continue;
            }
            if n.kids.len() == 1 && n.workers.same_ids(&n.kids[0].workers) {
                n.absorb_only_child();
                gone += 1;
            }
            let bloom = n.workers.bloom();
            if let Some(parent) = stack.last_mut() {
                parent.keep.push(node);
                parent.meta.push((key, bloom));
            }
        }
    }

    /// Checks every structural invariant (see the module docs) in one iterative pass. O(nodes);
    /// for tests and debugging.
    pub fn check_invariants(&self) -> Result<(), String> {
        let root = &self.root;
        if !root.edge().is_empty() || root.edge_chars != 0 {
            return Err("root has an edge".into());
        }
        let mut counts: Vec<(WorkerId, u64)> = root.workers.ids().iter().map(|&w| (w, 0)).collect();
        let mut nodes = 0usize;
        let mut stack: Vec<&Node> = vec![root];
        while let Some(node) = stack.pop() {
            nodes += 1;
            if node.bytes.len() < node.kids.len() * META_BYTES {
                return Err("key bytes and children disagree".into());
            }
            let keys = node.keys();
            if !node.workers.ids().windows(2).all(|w| w[0] < w[1]) {
                return Err("worker ids not strictly sorted".into());
            }
            if !node.workers.well_formed() {
                return Err("malformed worker set".into());
            }
            let is_root = std::ptr::eq(node, &**root);
            if !is_root {
                let edge = node.edge();
                let Ok(text) = std::str::from_utf8(edge) else {
                    return Err(format!("edge {edge:?} splits a character"));
                };
                if edge.is_empty() {
                    return Err("empty edge".into());
                }
                if text.chars().count() != node.edge_chars as usize {
                    return Err(format!("edge_chars wrong for {text:?}"));
                }
                if node.workers.is_empty() {
                    return Err(format!("node {text:?} held by nobody"));
                }
                if node.kids.len() == 1 && node.workers.same_ids(&node.kids[0].workers) {
                    return Err(format!(
                        "node {text:?} should be merged with its only child"
                    ));
                }
                for &w in node.workers.ids() {
                    match counts.binary_search_by_key(&w, |&(x, _)| x) {
                        Ok(i) => counts[i].1 += u64::from(node.edge_chars),
                        Err(_) => return Err(format!("worker {w} missing at the root")),
                    }
                }
            }
            for (i, kid) in node.kids.iter().enumerate() {
                let edge = kid.edge();
                if edge.is_empty() || key_at(keys, i) != Some(char_key(edge)) {
                    return Err("child key is not the edge's first character".into());
                }
                if node.bloom(i) != kid.workers.bloom() {
                    return Err("child bloom does not match its workers".into());
                }
                if i > 0 && key_at(keys, i - 1) >= key_at(keys, i) {
                    return Err(
                        "child keys not strictly sorted (siblings share a character)".into(),
                    );
                }
                for (j, &w) in kid.workers.ids().iter().enumerate() {
                    match node.workers.time(w) {
                        None => return Err(format!("worker {w} on a child but not its parent")),
                        Some(t) if t < kid.workers.time_at(j) => {
                            return Err(format!("worker {w} newer on a child than its parent"))
                        }
                        Some(_) => {}
                    }
                }
                stack.push(kid);
            }
        }
        if nodes != self.nodes {
            return Err(format!("node count {} but {} counted", self.nodes, nodes));
        }
        if counts != *self.counts {
            return Err(format!(
                "char counts {:?} but recounted {counts:?}",
                self.counts
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
