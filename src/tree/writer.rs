//! The single writer thread: merges inserts from every core, publishes snapshots, evicts.
//!
//! Cores never lock and never wait on the writer: they read the published [`Forest`] through
//! `ArcSwap::load` and queue inserts with a non-blocking `try_send` (a full channel drops the
//! insert and counts it; the tree is approximate anyway). The writer owns the only mutable copy
//! of the forest, applies messages with path copying, and publishes a new snapshot at most every
//! `epoch` (or right after `publish_after` messages). Publishing is O(served models): the trees
//! are `Arc` roots, so a snapshot shares every node the writer has not touched since. Clients
//! cannot add trees (see [`TreeKey`]), and the queue is bounded in messages and in bytes.
use super::RadixTree;
use crate::base::text::SharedText;
use crate::base::WorkerId;
use arc_swap::ArcSwap;
use crossbeam::channel::{self, Receiver, RecvTimeoutError, Sender, TrySendError};
use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which tree of the forest a request reads and feeds. Clients choose model names freely, so a
/// name only gets a tree of its own when some worker serves it (the names come from the
/// workers' `/v1/models`, never from requests); every other name shares one tree.
#[derive(Debug, Clone, Copy, Eq)]
pub enum TreeKey {
    /// Requests that name no model.
    Default,
    /// Every model name no worker serves (made-up names, typos, names not learned yet).
    Shared,
    /// A model a worker serves (leaked once by the gateway's served-model list, so copying a
    /// key costs nothing and never pins a request body).
    Served(&'static str),
}

/// Equal names are equal keys; a served name is leaked once, so two keys of one model share
/// the pointer and compare without reading the name (the recent-insert ring compares a key for
/// every live entry on every routed request: by content that was a `memcmp` each).
impl PartialEq for TreeKey {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (TreeKey::Default, TreeKey::Default) | (TreeKey::Shared, TreeKey::Shared) => true,
            (TreeKey::Served(a), TreeKey::Served(b)) => std::ptr::eq(*a, *b) || a == b,
            _ => false,
        }
    }
}

/// Hashes what [`PartialEq`] compares: the variant and, for a served model, its name.
impl std::hash::Hash for TreeKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        std::mem::discriminant(self).hash(state);
        if let TreeKey::Served(name) = self {
            name.hash(state);
        }
    }
}

/// Read-only set of trees, as published to the cores: the default tree, the shared tree, and
/// one per served model. Bounded: at most 2 + the number of served models, each tree holding at
/// most `--max-tree-size` characters per worker.
#[derive(Debug, Default, Clone)]
pub struct Forest {
    /// The tree for requests without a model.
    default: RadixTree,
    /// The tree for model names no worker serves.
    shared: RadixTree,
    /// Per served model, sorted by name (binary search; few models, no hashing per request).
    served: Vec<(&'static str, RadixTree)>,
    epoch: u64,
}

impl Forest {
    /// The tree for `key`; a served model whose tree the writer has not created yet (or has
    /// dropped) reads the shared tree, where its inserts went meanwhile.
    pub fn tree(&self, key: TreeKey) -> &RadixTree {
        match key {
            TreeKey::Default => &self.default,
            TreeKey::Shared => &self.shared,
            TreeKey::Served(m) => match self.find(m) {
                Ok(i) => &self.served[i].1,
                Err(_) => &self.shared,
            },
        }
    }

    fn find(&self, model: &str) -> Result<usize, usize> {
        self.served.binary_search_by(|(k, _)| (*k).cmp(model))
    }

    /// Snapshot sequence number (increments on every publish).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Every tree with its key (default, shared, then served models by name), for metrics,
    /// admin listings and eviction passes.
    pub fn models(&self) -> impl Iterator<Item = (TreeKey, &RadixTree)> + '_ {
        [
            (TreeKey::Default, &self.default),
            (TreeKey::Shared, &self.shared),
        ]
        .into_iter()
        .chain(self.served.iter().map(|(k, t)| (TreeKey::Served(k), t)))
    }

    /// The writer's mutable tree for `key` (the shared tree for a model without its own).
    fn tree_mut(&mut self, key: TreeKey) -> &mut RadixTree {
        match key {
            TreeKey::Default => &mut self.default,
            TreeKey::Shared => &mut self.shared,
            TreeKey::Served(m) => match self.find(m) {
                Ok(i) => &mut self.served[i].1,
                Err(_) => &mut self.shared,
            },
        }
    }

    /// Trees for exactly `names`: trees of names still served are kept, new names get an empty
    /// tree, trees of names no longer served are dropped (their memory goes with them).
    fn serve(&mut self, mut names: Vec<&'static str>) {
        names.sort_unstable();
        names.dedup();
        let mut old = std::mem::take(&mut self.served).into_iter().peekable();
        for name in names {
            while old.next_if(|(k, _)| *k < name).is_some() {}
            let tree = old.next_if(|(k, _)| *k == name).map(|(_, t)| t);
            self.served.push((name, tree.unwrap_or_default()));
        }
    }

    fn trees_mut(&mut self) -> impl Iterator<Item = &mut RadixTree> + '_ {
        [&mut self.default, &mut self.shared]
            .into_iter()
            .chain(self.served.iter_mut().map(|(_, t)| t))
    }
}

/// One insertion request from a core. `text` is at most `MAX_ROUTING_TEXT` bytes and never a
/// slice pinning much more than itself (the core copies it out of a larger body).
#[derive(Debug, Clone)]
pub struct Insert {
    pub tree: TreeKey,
    pub text: SharedText,
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
    /// Bounded channel capacity, in messages.
    pub channel_capacity: usize,
    /// Most text bytes queued for the writer at once; inserts beyond it are dropped and
    /// counted like a full channel, so a starved writer never holds more than this.
    pub channel_bytes: usize,
    /// Longest time between an insert and its publication.
    pub epoch: Duration,
    /// Publish early after this many applied messages.
    pub publish_after: usize,
}

impl Default for WriterConfig {
    /// The reference's `--max-tree-size` (2^26, characters per worker) and
    /// `--eviction-interval` (120 s); a 10 % overflow margin; 16 Ki queued inserts (~80 ms of
    /// writer work) holding at most 64 MiB of text; 1 ms epochs or 1,024 messages, whichever
    /// comes first.
    fn default() -> Self {
        WriterConfig {
            max_chars_per_worker: 1 << 26,
            eviction_interval: Duration::from_secs(120),
            overflow_margin: 0.1,
            channel_capacity: 16 * 1024,
            channel_bytes: 64 << 20,
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
    trees: AtomicU64,
    queued_bytes: AtomicU64,
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
    /// Trees in the forest at the last publish (default and shared included).
    pub fn trees(&self) -> u64 {
        self.trees.load(Relaxed)
    }
    /// Text bytes queued for the writer and not applied yet.
    pub fn queued_bytes(&self) -> u64 {
        self.queued_bytes.load(Relaxed)
    }
}

/// Messages from cores and admin paths to the writer.
enum Msg {
    Insert(Insert),
    RemoveWorker(WorkerId),
    /// The models the workers serve now (each gets a tree; the rest are dropped).
    Serve(Vec<&'static str>),
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
    max_queued_bytes: u64,
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

    /// Queue an insert without blocking; `false` when the channel is full or holds its byte
    /// budget of text already (the drop is counted).
    pub fn try_insert(&self, ins: Insert) -> bool {
        let n = ins.text.len() as u64;
        let queued = &self.stats.queued_bytes;
        if queued.fetch_add(n, Relaxed) + n > self.max_queued_bytes {
            queued.fetch_sub(n, Relaxed);
            self.stats.dropped.fetch_add(1, Relaxed);
            return false;
        }
        match self.tx.try_send(Msg::Insert(ins)) {
            Ok(()) => true,
            Err(e) => {
                queued.fetch_sub(n, Relaxed);
                if let TrySendError::Full(_) = e {
                    self.stats.dropped.fetch_add(1, Relaxed);
                }
                false
            }
        }
    }

    /// The models the workers serve now: each gets its own tree, trees of models no longer
    /// served are dropped (health thread and admin paths; may block briefly).
    pub fn serve_models(&self, names: Vec<&'static str>) {
        // Fails only if the writer is gone, and then there is no tree to keep.
        let _ = self.tx.send(Msg::Serve(names));
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

    /// Messages queued for the writer and not taken by it yet.
    pub fn queued_messages(&self) -> usize {
        self.tx.len()
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
    /// One more publication is owed, an epoch after the last one that carried changes, even
    /// if nothing arrives meanwhile. The cores' recent-insert ring counts an entry for two
    /// epochs (its insert may miss the publication in flight), so without it an idle tree
    /// would keep the last burst's entries alive, and every request would compare its text
    /// with them, until the next insert.
    trailing: bool,
    /// Workers over the limit found by the last periodic pass, evicted one per loop iteration so
    /// a pass over a big forest never stalls the inserts for long.
    evict_queue: VecDeque<(TreeKey, WorkerId)>,
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
        trailing: false,
        evict_queue: VecDeque::new(),
        last_publish: now,
        next_eviction: after(now, eviction_interval),
    };
    let handle = TreeHandle {
        snapshot: published,
        tx,
        stats,
        max_queued_bytes: cfg.channel_bytes as u64,
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
    start_thread(writer, None);
    handle
}

/// A writer thread that has not read its channel yet: [`spawn_writer_held`] returns it so a
/// benchmark can fill the queue first and then time the writer alone draining it.
#[derive(Debug)]
pub struct HeldWriter {
    go: Sender<()>,
}

impl HeldWriter {
    /// Lets the writer start on what is queued.
    pub fn start(self) {
        // Fails only if the thread is gone; there is nothing to start then.
        let _ = self.go.send(());
    }
}

/// [`spawn_writer`], but the thread waits for [`HeldWriter::start`] (or for the `HeldWriter`
/// to be dropped) before it applies anything (benches: the writer's ceiling on a pre-built
/// queue).
///
/// # Panics
/// If the OS refuses to create a thread.
pub fn spawn_writer_held(cfg: WriterConfig) -> (TreeHandle, HeldWriter) {
    let (handle, writer) = build(cfg);
    let (go, wait) = channel::bounded(1);
    start_thread(writer, Some(wait));
    (handle, HeldWriter { go })
}

fn start_thread(writer: Writer, hold: Option<Receiver<()>>) {
    std::thread::Builder::new()
        .name("radixgate-tree-writer".into())
        .spawn(move || {
            if let Err(e) = crate::base::priority::helper_thread() {
                crate::log!(Warn, "tree writer thread: cannot lower its priority: {e}");
            }
            if let Some(hold) = hold {
                // A message or a dropped sender: either way, start.
                let _ = hold.recv();
            }
            writer.run()
        })
        .expect("cannot spawn the tree writer thread");
}

impl Writer {
    /// Waits for messages until the next publish or eviction deadline (no idle ticking), drains
    /// what is queued in one go, then evicts one queued worker and publishes when due.
    fn run(mut self) {
        loop {
            let deadline = if !self.evict_queue.is_empty() {
                // Eviction work is waiting: only pick up what is already queued.
                Instant::now()
            } else if self.pending > 0 || self.trailing {
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
            let epoch_over = now >= after(self.last_publish, self.epoch);
            if (self.pending > 0 && (self.pending >= self.publish_after || epoch_over))
                || (self.trailing && epoch_over)
            {
                self.publish();
            }
        }
    }

    fn apply(&mut self, msg: Msg) {
        match msg {
            Msg::Insert(ins) => {
                self.insert(&ins);
                self.stats
                    .queued_bytes
                    .fetch_sub(ins.text.len() as u64, Relaxed);
            }
            Msg::Serve(names) => {
                self.forest.serve(names);
                // Queued evictions may name a dropped tree; they would land on the shared one.
                self.evict_queue.clear();
                self.pending += 1;
            }
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
        let text = ins.text.as_str();
        self.clock = self.clock.max(ins.now_ms);
        let tree = self.forest.tree_mut(ins.tree);
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
                self.evict_queue.push_back((model, w));
            }
        }
        self.stats.evictions.fetch_add(1, Relaxed);
    }

    /// Evicts the next queued worker back to the limit (if it is still over it).
    fn evict_next(&mut self) {
        let Some((key, w)) = self.evict_queue.pop_front() else {
            return;
        };
        let tree = self.forest.tree_mut(key);
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
        self.trailing = self.pending > 0;
        self.pending = 0;
        self.last_publish = Instant::now();
        let (mut nodes, mut chars, mut trees) = (0u64, 0u64, 0u64);
        for (_, tree) in self.forest.models() {
            nodes += tree.node_count() as u64;
            chars += tree.total_chars();
            trees += 1;
        }
        let s = &self.stats;
        s.trees.store(trees, Relaxed);
        s.nodes.store(nodes, Relaxed);
        s.chars.store(chars, Relaxed);
        s.epoch.store(self.forest.epoch, Relaxed);
        s.publishes.fetch_add(1, Relaxed);
    }
}

#[cfg(test)]
mod tests;
