//! Persistent compressed radix tree over UTF-8 text (pure; no I/O, no clocks).
use super::WorkerId;

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
#[derive(Debug, Clone, Default)]
pub struct RadixTree {}

impl RadixTree {
    pub fn new() -> Self {
        RadixTree {}
    }
    /// Longest prefix of `key` present in the tree, with the workers that hold it.
    pub fn longest_match(&self, key: &str) -> Match<'_> {
        let _ = key;
        todo!()
    }
    /// Record that `key` was sent to `worker` at logical time `now` (larger = more recent).
    /// Path-copies shared nodes (`Arc::make_mut`).
    pub fn insert(&mut self, key: &str, worker: WorkerId, now: u64) {
        let _ = (key, worker, now);
        todo!()
    }
    /// Forget `worker` everywhere; drops nodes nobody holds and merges single-child chains.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        let _ = worker;
        todo!()
    }
    /// Characters held by `worker` (shared text counts once per worker holding it).
    pub fn worker_chars(&self, worker: WorkerId) -> u64 {
        let _ = worker;
        todo!()
    }
    /// Remove `worker`'s least recently used leaves until it holds at most `max_chars`.
    /// Returns the characters removed.
    pub fn evict_worker(&mut self, worker: WorkerId, max_chars: u64) -> u64 {
        let _ = (worker, max_chars);
        todo!()
    }
    /// Number of nodes (root included).
    pub fn node_count(&self) -> usize {
        todo!()
    }
}
