//! The single writer thread: merges inserts from every core, publishes snapshots, evicts.
use super::{RadixTree, WorkerId};
use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;

/// Read-only set of per-model trees, as published to the cores.
#[derive(Debug, Default)]
pub struct Forest {}

impl Forest {
    /// The tree for `model`; `None` selects the default tree (requests without a model).
    pub fn tree(&self, model: Option<&[u8]>) -> Option<&RadixTree> {
        let _ = model;
        todo!()
    }
    /// Snapshot sequence number (increments on every publish).
    pub fn epoch(&self) -> u64 {
        todo!()
    }
}

/// One insertion request from a core. `text` is usually a zero-copy slice of the request body.
#[derive(Debug, Clone)]
pub struct Insert {
    pub model: Option<Bytes>,
    pub text: Bytes,
    pub worker: WorkerId,
    /// Milliseconds since the gateway started (for LRU order).
    pub now_ms: u64,
}

/// Writer tuning; defaults mirror the reference's flags.
#[derive(Debug, Clone)]
pub struct WriterConfig {
    /// Characters kept per worker per model (`--max-tree-size`).
    pub max_chars_per_worker: u64,
    /// Periodic eviction pass (`--eviction-interval`).
    pub eviction_interval: Duration,
    /// Evict at once when a worker exceeds the limit by this fraction (e.g. 0.1 = 10 %).
    pub overflow_margin: f64,
    /// Bounded channel capacity.
    pub channel_capacity: usize,
    /// Longest time between an insert and its publication.
    pub epoch: Duration,
    /// Publish early after this many applied messages.
    pub publish_after: usize,
}

/// Counters the writer exposes (for /metrics and tests).
#[derive(Debug, Default)]
pub struct WriterStats {}

/// What cores hold: the published snapshot and the channel to the writer. Cheap to clone.
#[derive(Clone)]
pub struct TreeHandle {}

impl TreeHandle {
    /// Current snapshot. Never hold the guard across an `.await`.
    pub fn load(&self) -> arc_swap::Guard<Arc<Forest>> {
        todo!()
    }
    /// Queue an insert without blocking; `false` when the channel is full (the drop is counted).
    pub fn try_insert(&self, ins: Insert) -> bool {
        let _ = ins;
        todo!()
    }
    /// Remove a worker from every tree (admin path; may block briefly).
    pub fn remove_worker(&self, worker: WorkerId) {
        let _ = worker;
        todo!()
    }
    /// Block until every message sent before this call is applied and published (tests, admin).
    pub fn sync(&self) {
        todo!()
    }
    pub fn stats(&self) -> &WriterStats {
        todo!()
    }
}

/// Start the writer thread.
pub fn spawn_writer(cfg: WriterConfig) -> TreeHandle {
    let _ = cfg;
    todo!()
}
