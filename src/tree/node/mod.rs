//! Persistent compressed radix tree over UTF-8 text (pure; no I/O, no clocks).
//!
//! # Shape
//! Nodes live in (`triomphe`) `Arc`s and are only ever mutated through `Arc::make_mut`, so a clone of a
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
//! # Invariants (checked by `RadixTree::check_invariants` in test builds)
//! - Every non-root node has a non-empty edge and a non-empty, sorted set of workers.
//! - A worker held by a node is held by all its ancestors, with an access time at least as large.
//! - A worker holds a node only if some text it was sent covers the node's whole edge; hence the
//!   workers of a node are exactly those with text extending through any point of its edge.
//! - Per-worker character counts equal the sum of `edge_chars` over the nodes the worker holds.
//!
//! Every traversal is iterative (including `Drop`): a crafted sequence of prompts can make the
//! tree as deep as the longest prompt has characters.
//!
//! # Layout
//! - `repr`: the node (children with their keys and blooms, the edge as a range of a shared
//!   buffer) and its edits.
//! - `shared`: the edge buffers (reference-counted bytes with a 12-byte header; the writer
//!   appends to a buffer's room in place).
//! - `workers`: the compact per-node set of workers and access times.
//! - `lookup`: longest-prefix match (the request path).
//! - `insert`: inserts with path copying and node splits.
//! - `evict`: LRU eviction and worker removal (plan, then prune).
//! - `stats`: character and node accounting.
//! - `check`: the invariant checker (test builds only).

#[cfg(test)]
mod check;
mod evict;
mod insert;
mod lookup;
mod repr;
mod shared;
mod stats;
mod workers;

use crate::base::WorkerId;
use repr::Node;
use std::fmt;
use triomphe::Arc;

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
}

#[cfg(test)]
mod tests;
