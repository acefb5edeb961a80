//! The single writer thread: merges inserts from every core, publishes snapshots, evicts.
//!
//! Cores never lock and never wait on the writer: they read the published [`Forest`] through
//! `ArcSwap::load` and queue inserts with a non-blocking `try_send` (a full channel drops the
//! insert and counts it; the tree is approximate anyway). The writer owns the only mutable copy
//! of the forest, applies messages with path copying, and publishes a new snapshot at most every
//! `epoch` (or right after `publish_after` messages). Publishing is O(models): the trees are
//! `Arc` roots, so a snapshot shares every node the writer has not touched since.
use super::RadixTree;
use crate::base::text::valid_prefix;
use crate::base::WorkerId;
use arc_swap::ArcSwap;
use bytes::Bytes;
use crossbeam::channel::{self, Receiver, RecvTimeoutError, Sender, TrySendError};
use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Read-only set of per-model trees, as published to the cores.
#[derive(Debug, Default, Clone)]
pub struct Forest {
    /// The tree for requests without a model.
    default: RadixTree,
    /// Per model name, sorted by name (binary search; few models, no hashing per request).
    models: Vec<(Bytes, RadixTree)>,
    epoch: u64,
}

impl Forest {
    /// The tree for `model`; `None` selects the default tree (requests without a model).
    /// Model names are compared byte for byte, exactly as the cores sent them.
    pub fn tree(&self, model: Option<&[u8]>) -> Option<&RadixTree> {
        match model {
            None => Some(&self.default),
            Some(m) => self
                .models
                .binary_search_by(|(k, _)| k.as_ref().cmp(m))
                .ok()
                .map(|i| &self.models[i].1),
        }
    }

    /// Snapshot sequence number (increments on every publish).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Every tree with its model (`None` = the default tree first, then models by name), for
    /// metrics and admin listings.
    pub fn models(&self) -> impl Iterator<Item = (Option<&[u8]>, &RadixTree)> + '_ {
        std::iter::once((None, &self.default))
            .chain(self.models.iter().map(|(k, t)| (Some(k.as_ref()), t)))
    }

    /// The writer's mutable tree for `model`, created on first use. The name is copied so the
    /// forest never pins a request body buffer.
    fn tree_mut(&mut self, model: Option<&[u8]>) -> &mut RadixTree {
        let Some(m) = model else {
            return &mut self.default;
        };
        let i = match self.models.binary_search_by(|(k, _)| k.as_ref().cmp(m)) {
            Ok(i) => i,
            Err(i) => {
                self.models
                    .insert(i, (Bytes::copy_from_slice(m), RadixTree::new()));
                i
            }
        };
        &mut self.models[i].1
    }

    /// The writer's mutable tree for `model` if it exists.
    fn existing_mut(&mut self, model: Option<&[u8]>) -> Option<&mut RadixTree> {
        match model {
            None => Some(&mut self.default),
            Some(m) => self
                .models
                .binary_search_by(|(k, _)| k.as_ref().cmp(m))
                .ok()
                .map(|i| &mut self.models[i].1),
        }
    }

    fn trees_mut(&mut self) -> impl Iterator<Item = &mut RadixTree> + '_ {
        std::iter::once(&mut self.default).chain(self.models.iter_mut().map(|(_, t)| t))
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

impl Default for WriterConfig {
    /// The reference's `--max-tree-size` (2^26, characters per worker) and
    /// `--eviction-interval` (120 s); a 10 % overflow margin; 16 Ki queued inserts (~80 ms of
    /// writer work); 1 ms epochs or 1,024 messages, whichever comes first.
    fn default() -> Self {
        WriterConfig {
            max_chars_per_worker: 1 << 26,
            eviction_interval: Duration::from_secs(120),
            overflow_margin: 0.1,
            channel_capacity: 16 * 1024,
            epoch: Duration::from_millis(1),
            publish_after: 1024,
        }
    }
}

/// Counters the writer exposes (for /metrics and tests).
#[derive(Debug, Default)]
pub struct WriterStats {
    inserts_applied: AtomicU64,
    dropped: AtomicU64,
    publishes: AtomicU64,
    evictions: AtomicU64,
    evicted_chars: AtomicU64,
    nodes: AtomicU64,
    chars: AtomicU64,
    epoch: AtomicU64,
}

impl WriterStats {
    /// Inserts applied to the writer's forest.
    pub fn inserts_applied(&self) -> u64 {
        self.inserts_applied.load(Relaxed)
    }
    /// Inserts dropped because the channel was full (cores never block on the writer).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Relaxed)
    }
    /// Snapshots published.
    pub fn publishes(&self) -> u64 {
        self.publishes.load(Relaxed)
    }
    /// Eviction runs: periodic passes plus immediate evictions of a worker over its margin.
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Relaxed)
    }
    /// Characters removed by eviction (per worker, as counted against the limit).
    pub fn evicted_chars(&self) -> u64 {
        self.evicted_chars.load(Relaxed)
    }
    /// Nodes over all trees (roots included) at the last publish.
    pub fn nodes(&self) -> u64 {
        self.nodes.load(Relaxed)
    }
    /// Characters over all trees and workers (shared text once per worker) at the last publish.
    pub fn chars(&self) -> u64 {
        self.chars.load(Relaxed)
    }
    /// Epoch of the last published snapshot.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Relaxed)
    }
}

/// Messages from cores and admin paths to the writer.
enum Msg {
    Insert(Insert),
    RemoveWorker(WorkerId),
    /// Publish everything applied so far, then reply.
    Sync(Sender<()>),
}

/// How long [`TreeHandle::sync`] waits for the writer before giving up (it must not hang forever
/// if the writer died).
const SYNC_TIMEOUT: Duration = Duration::from_secs(30);

/// Published snapshots the writer keeps alive after replacing them. A reader may still hold the
/// replaced snapshot; if its guard were the last reference, dropping it would free every node the
/// writer path-copied since — on a core, on the request path. Keeping the last few lets the
/// readers finish (a guard lives for one routing decision, microseconds) so the writer frees
/// them instead; only a reader stalled for several epochs could still end up freeing one.
const RETAINED_SNAPSHOTS: usize = 4;

/// What cores hold: the published snapshot and the channel to the writer. Cheap to clone.
#[derive(Clone)]
pub struct TreeHandle {
    snapshot: Arc<ArcSwap<Forest>>,
    tx: Sender<Msg>,
    stats: Arc<WriterStats>,
}

impl fmt::Debug for TreeHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TreeHandle")
            .field("queued", &self.tx.len())
            .field("stats", &self.stats)
            .finish()
    }
}

impl TreeHandle {
    /// Current snapshot. Never hold the guard across an `.await`.
    pub fn load(&self) -> arc_swap::Guard<Arc<Forest>> {
        self.snapshot.load()
    }

    /// Queue an insert without blocking; `false` when the channel is full (the drop is counted).
    pub fn try_insert(&self, ins: Insert) -> bool {
        match self.tx.try_send(Msg::Insert(ins)) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) => {
                self.stats.dropped.fetch_add(1, Relaxed);
                false
            }
            Err(TrySendError::Disconnected(_)) => false,
        }
    }

    /// Remove a worker from every tree (admin path; may block briefly).
    pub fn remove_worker(&self, worker: WorkerId) {
        // Fails only if the writer is gone, and then there is no tree left to clean.
        let _ = self.tx.send(Msg::RemoveWorker(worker));
    }

    /// Block until every message sent before this call is applied and published (tests, admin).
    /// Gives up after 30 s if the writer does not answer.
    pub fn sync(&self) {
        let (tx, rx) = channel::bounded(1);
        if self.tx.send(Msg::Sync(tx)).is_ok() {
            let _ = rx.recv_timeout(SYNC_TIMEOUT);
        }
    }

    /// The writer's counters.
    pub fn stats(&self) -> &WriterStats {
        &self.stats
    }
}

/// The writer's state; `run` is the thread body.
struct Writer {
    rx: Receiver<Msg>,
    forest: Forest,
    published: Arc<ArcSwap<Forest>>,
    retired: VecDeque<Arc<Forest>>,
    stats: Arc<WriterStats>,
    max_chars: u64,
    /// `max_chars * (1 + overflow_margin)`: above this an insert triggers eviction at once.
    hard_limit: u64,
    eviction_interval: Duration,
    epoch: Duration,
    publish_after: usize,
    /// The LRU clock: the largest `now_ms` seen, so time never goes backwards.
    clock: u64,
    /// Messages applied since the last publish that changed something.
    pending: usize,
    /// Workers over the limit found by the last periodic pass, evicted one per loop iteration so
    /// a pass over a big forest never stalls the inserts for long.
    evict_queue: VecDeque<(Option<Bytes>, WorkerId)>,
    last_publish: Instant,
    next_eviction: Instant,
}

/// `t + d`, or far in the future when that overflows (a "never" interval).
fn after(t: Instant, d: Duration) -> Instant {
    t.checked_add(d)
        .or_else(|| t.checked_add(Duration::from_secs(365 * 24 * 3600)))
        .unwrap_or(t)
}

/// Builds the handle and the writer without starting the thread (tests drive it by hand).
fn build(cfg: WriterConfig) -> (TreeHandle, Writer) {
    let (tx, rx) = channel::bounded(cfg.channel_capacity.max(1));
    let published = Arc::new(ArcSwap::from_pointee(Forest::default()));
    let stats = Arc::new(WriterStats::default());
    let margin = if cfg.overflow_margin.is_finite() {
        cfg.overflow_margin.max(0.0)
    } else {
        0.0
    };
    // `as` saturates for floats: an enormous limit just means "never evict early".
    let hard_limit = (cfg.max_chars_per_worker as f64 * (1.0 + margin)) as u64;
    // A zero interval would spin; a millisecond is already far more often than useful.
    let eviction_interval = cfg.eviction_interval.max(Duration::from_millis(1));
    let now = Instant::now();
    let writer = Writer {
        rx,
        forest: Forest::default(),
        published: Arc::clone(&published),
        retired: VecDeque::with_capacity(RETAINED_SNAPSHOTS + 1),
        stats: Arc::clone(&stats),
        max_chars: cfg.max_chars_per_worker,
        hard_limit: hard_limit.max(cfg.max_chars_per_worker),
        eviction_interval,
        epoch: cfg.epoch,
        publish_after: cfg.publish_after.max(1),
        clock: 0,
        pending: 0,
        evict_queue: VecDeque::new(),
        last_publish: now,
        next_eviction: after(now, eviction_interval),
    };
    let handle = TreeHandle {
        snapshot: published,
        tx,
        stats,
    };
    (handle, writer)
}

/// Start the writer thread (named `radixgate-tree-writer`). It runs until every [`TreeHandle`]
/// clone is dropped.
///
/// # Panics
/// If the OS refuses to create a thread (startup only).
pub fn spawn_writer(cfg: WriterConfig) -> TreeHandle {
    let (handle, writer) = build(cfg);
    std::thread::Builder::new()
        .name("radixgate-tree-writer".into())
        .spawn(move || writer.run())
        .expect("cannot spawn the tree writer thread");
    handle
}

impl Writer {
    /// Waits for messages until the next publish or eviction deadline (no idle ticking), drains
    /// what is queued in one go, then evicts one queued worker and publishes when due.
    fn run(mut self) {
        loop {
            let deadline = if !self.evict_queue.is_empty() {
                // Eviction work is waiting: only pick up what is already queued.
                Instant::now()
            } else if self.pending > 0 {
                after(self.last_publish, self.epoch).min(self.next_eviction)
            } else {
                self.next_eviction
            };
            match self.rx.recv_deadline(deadline) {
                Ok(msg) => {
                    self.apply(msg);
                    while self.pending < self.publish_after {
                        match self.rx.try_recv() {
                            Ok(msg) => self.apply(msg),
                            Err(_) => break,
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            let now = Instant::now();
            if now >= self.next_eviction {
                self.queue_evictions();
                self.next_eviction = after(now, self.eviction_interval);
            }
            self.evict_next();
            if self.pending > 0
                && (self.pending >= self.publish_after
                    || now >= after(self.last_publish, self.epoch))
            {
                self.publish();
            }
        }
    }

    fn apply(&mut self, msg: Msg) {
        match msg {
            Msg::Insert(ins) => self.insert(&ins),
            Msg::RemoveWorker(w) => {
                for tree in self.forest.trees_mut() {
                    tree.remove_worker(w);
                }
                self.pending += 1;
            }
            Msg::Sync(reply) => {
                if self.pending > 0 {
                    self.publish();
                }
                // The caller may have given up waiting; nothing to do then.
                let _ = reply.try_send(());
            }
        }
    }

    fn insert(&mut self, ins: &Insert) {
        // Invalid UTF-8 is cut at the last valid boundary: routing text is text.
        let text = valid_prefix(&ins.text);
        self.clock = self.clock.max(ins.now_ms);
        let tree = self.forest.tree_mut(ins.model.as_deref());
        tree.insert(text, ins.worker, self.clock);
        if tree.worker_chars(ins.worker) > self.hard_limit {
            let removed = tree.evict_worker(ins.worker, self.max_chars);
            self.stats.evictions.fetch_add(1, Relaxed);
            self.stats.evicted_chars.fetch_add(removed, Relaxed);
        }
        self.stats.inserts_applied.fetch_add(1, Relaxed);
        self.pending += 1;
    }

    /// Starts a periodic pass: queues every (model, worker) over the limit.
    fn queue_evictions(&mut self) {
        let max = self.max_chars;
        for (model, tree) in self.forest.models() {
            for (w, _) in tree.worker_char_counts().filter(|&(_, c)| c > max) {
                self.evict_queue
                    .push_back((model.map(Bytes::copy_from_slice), w));
            }
        }
        self.stats.evictions.fetch_add(1, Relaxed);
    }

    /// Evicts the next queued worker back to the limit (if it is still over it).
    fn evict_next(&mut self) {
        let Some((model, w)) = self.evict_queue.pop_front() else {
            return;
        };
        let Some(tree) = self.forest.existing_mut(model.as_deref()) else {
            return;
        };
        let removed = tree.evict_worker(w, self.max_chars);
        if removed > 0 {
            self.stats.evicted_chars.fetch_add(removed, Relaxed);
            self.pending += 1;
        }
    }

    /// A whole periodic pass at once (tests).
    #[cfg(test)]
    fn evict_all(&mut self) {
        self.queue_evictions();
        while !self.evict_queue.is_empty() {
            self.evict_next();
        }
    }

    /// Publishes a snapshot of the forest: O(models), the trees are shared `Arc` roots.
    fn publish(&mut self) {
        self.forest.epoch += 1;
        let old = self.published.swap(Arc::new(self.forest.clone()));
        self.retired.push_back(old);
        while self.retired.len() > RETAINED_SNAPSHOTS {
            // Usually the last reference: the nodes replaced since are freed here, not on a core.
            drop(self.retired.pop_front());
        }
        self.pending = 0;
        self.last_publish = Instant::now();
        let (mut nodes, mut chars) = (0u64, 0u64);
        for (_, tree) in self.forest.models() {
            nodes += tree.node_count() as u64;
            chars += tree.total_chars();
        }
        let s = &self.stats;
        s.nodes.store(nodes, Relaxed);
        s.chars.store(chars, Relaxed);
        s.epoch.store(self.forest.epoch, Relaxed);
        s.publishes.fetch_add(1, Relaxed);
    }
}

#[cfg(test)]
mod tests;
