//! The applying thread (`kv-index`): the one thread that calls the sink, so a sink that applies
//! to an index is that index's single writer. The reader threads (`thread`) read sockets, run
//! the ZMTP and msgpack decoders and each publisher's stream machine, and hand this thread
//! whole chunks of decoded batches through the byte-bounded queue (`queue`).
//!
//! It applies a chunk at a time and makes what it applied visible ([`EventSink::flush`]: the
//! index publishes a snapshot) once the queue is empty, or every [`ApplyConfig::publish_max`]
//! while it is not, and never more often than every [`ApplyConfig::publish_min`]: a burst
//! costs a few publications, not one per batch, and a quiet moment shows everything at once.
//!
//! **Staleness** is measured here: each live batch's publisher timestamp against the moment the
//! publication that holds it is made (`radixgate_kv_staleness_seconds`). Clocks of other hosts
//! may be offset: the smallest delay seen of a publisher since its subscription (or reset)
//! counts as zero, so a constant offset is taken out and only queueing shows. A publisher whose
//! batches arrive later than [`ApplyConfig::max_staleness`] is **lagging**: reported to the sink
//! as [`SourceState::Lagging`] (its worker is scored by the text tree), logged, and counted,
//! until a batch of it arrives within half that, or it has been quiet that long while the queue
//! is empty.
//!
//! Copies for a sibling (export) and from one (import) are taken here too, between two chunks,
//! with each publisher's last applied sequence number as its watermark.

use super::queue::{Chunk, QueueBound};
use super::{
    Command, EventSink, ExportReply, IntakeEvent, PublisherKey, ResetReason, SourceState, Stats,
};
use crate::base::WorkerId;
use crate::kv::wire::KvEvent;
use arc_swap::ArcSwap;
use crossbeam::channel::{Receiver, Select, Sender, TryRecvError};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How often lagging publishers that went quiet are looked at, and the per-publisher staleness
/// is republished for `/metrics`.
const SWEEP_EVERY: Duration = Duration::from_millis(250);
/// Longest wait for work (commands are looked at this often).
const IDLE_WAIT: Duration = Duration::from_millis(50);
/// Lagging publishers logged at the warning level at most this often (the rest at debug).
const LOG_EVERY: Duration = Duration::from_secs(10);

/// When the applying thread publishes, and when a publisher counts as lagging.
#[derive(Debug, Clone, Copy)]
pub struct ApplyConfig {
    /// Publications at most this often.
    pub publish_min: Duration,
    /// While batches keep coming, a publication at least this often.
    pub publish_max: Duration,
    /// A publisher whose batches arrive later than this is lagging
    /// (`--kv-max-staleness-ms`).
    pub max_staleness: Duration,
}

impl Default for ApplyConfig {
    fn default() -> Self {
        ApplyConfig {
            publish_min: Duration::from_millis(1),
            // Each publication makes the writer copy again every trie node it touches next (a
            // level of 4,096 nodes of up to 2 KiB at a million blocks): under load, one per
            // 20 ms copies those nodes once per ~20k blocks instead of once per ~5k, and keeps
            // staleness well within its 50 ms goal.
            publish_max: Duration::from_millis(20),
            max_staleness: Duration::from_secs(1),
        }
    }
}

/// Commands for the applying thread.
pub(super) enum ApplyCommand {
    Export(ExportReply),
    Import {
        data: Vec<u8>,
        workers: Vec<(String, WorkerId)>,
        reply: Sender<Result<usize, String>>,
    },
    Shutdown,
}

/// What the applying thread knows of one publisher.
#[derive(Debug)]
struct Publisher {
    /// The state its reader last reported.
    state: Option<SourceState>,
    /// The state last delivered to the sink (the reader's, or `Lagging` over `Live`).
    shown: Option<SourceState>,
    /// Smallest delay (publication time minus its timestamp, seconds) seen since its
    /// subscription or last reset: the clocks' offset.
    floor: f64,
    /// Staleness of its latest batch, at the publication that held it (seconds).
    staleness: f64,
    /// When its latest live batch was applied.
    last_batch: Option<Instant>,
    lagging: bool,
}

impl Publisher {
    fn new() -> Publisher {
        Publisher {
            state: None,
            shown: None,
            floor: f64::INFINITY,
            staleness: 0.0,
            last_batch: None,
            lagging: false,
        }
    }

    fn effective(&self) -> Option<SourceState> {
        match self.state {
            Some(SourceState::Live) if self.lagging => Some(SourceState::Lagging),
            s => s,
        }
    }
}

pub(super) struct ApplyThread<S> {
    pub(super) sink: S,
    pub(super) config: ApplyConfig,
    pub(super) chunks: Receiver<Chunk>,
    pub(super) commands: Receiver<ApplyCommand>,
    /// The readers' command queues (an import's watermarks go to the publisher's reader).
    pub(super) readers: Vec<Sender<Command>>,
    pub(super) bound: Arc<QueueBound>,
    pub(super) stats: Arc<Stats>,
    /// Per-publisher staleness (seconds) and whether it lags, republished every
    /// [`SWEEP_EVERY`] for `/metrics`.
    pub(super) published: Arc<ArcSwap<Vec<(PublisherKey, f32, bool)>>>,
    /// A command `wait` took from the channel, handled by the next `take_commands`.
    pub(super) picked: Option<ApplyCommand>,
}

/// The loop's own state.
struct Run {
    publishers: HashMap<PublisherKey, Publisher>,
    /// Last applied sequence number of each publisher (an export's watermarks).
    marks: HashMap<PublisherKey, i64>,
    /// Live batches applied since the last publication: (publisher, timestamp).
    pending: Vec<(PublisherKey, f64)>,
    /// Block hashes stored or removed since the last publication.
    blocks: u64,
    dirty: bool,
    last_publish: Instant,
    last_sweep: Instant,
    last_warn: Option<Instant>,
    export: Option<(VecDeque<PublisherKey>, ExportReply)>,
    staleness: metrics::Histogram,
}

impl<S: EventSink> ApplyThread<S> {
    pub(super) fn run(mut self) {
        let now = Instant::now();
        let mut run = Run {
            publishers: HashMap::new(),
            marks: HashMap::new(),
            pending: Vec::new(),
            blocks: 0,
            dirty: false,
            last_publish: now,
            last_sweep: now,
            last_warn: None,
            export: None,
            staleness: crate::metrics::kv_staleness(),
        };
        loop {
            let now = Instant::now();
            // With something to publish, wait no longer than the next allowed publication.
            let wait = if run.dirty {
                (run.last_publish + self.config.publish_min).saturating_duration_since(now)
            } else if run.export.is_some() {
                Duration::ZERO
            } else {
                IDLE_WAIT
            };
            match self.wait(wait) {
                Woke::Chunk(c) => self.take(&mut run, c),
                Woke::Command => {}
                Woke::Timeout => {}
                Woke::Stopped => break,
            }
            // Take what else is queued, up to the longest a publication may wait.
            while run.last_publish.elapsed() < self.config.publish_max {
                match self.chunks.try_recv() {
                    Ok(c) => self.take(&mut run, c),
                    Err(_) => break,
                }
            }
            if !self.take_commands(&mut run) {
                break;
            }
            self.export_step(&mut run);
            let now = Instant::now();
            let due = now.duration_since(run.last_publish);
            if run.dirty
                && due >= self.config.publish_min
                && (self.chunks.is_empty() || due >= self.config.publish_max)
            {
                self.publish(&mut run, now);
            }
            if now.duration_since(run.last_sweep) >= SWEEP_EVERY {
                run.last_sweep = now;
                self.sweep(&mut run, now);
            }
        }
        if run.dirty {
            self.publish(&mut run, Instant::now());
        }
    }

    fn wait(&mut self, wait: Duration) -> Woke {
        if !self.commands.is_empty() {
            return Woke::Command;
        }
        let mut sel = Select::new();
        let chunks = sel.recv(&self.chunks);
        let commands = sel.recv(&self.commands);
        let Ok(op) = sel.select_timeout(wait) else {
            return Woke::Timeout;
        };
        match op.index() {
            i if i == chunks => match op.recv(&self.chunks) {
                Ok(c) => Woke::Chunk(c),
                // Every reader is gone: nothing more will come.
                Err(_) => Woke::Stopped,
            },
            // `select` picked it: the operation must be completed here.
            i if i == commands => match op.recv(&self.commands) {
                Ok(ApplyCommand::Shutdown) | Err(_) => Woke::Stopped,
                Ok(c) => {
                    self.picked = Some(c);
                    Woke::Command
                }
            },
            _ => Woke::Timeout,
        }
    }

    fn take(&mut self, run: &mut Run, chunk: Chunk) {
        self.bound.taken(chunk.bytes);
        for event in chunk.events {
            self.deliver(run, event);
        }
    }

    fn deliver(&mut self, run: &mut Run, event: IntakeEvent) {
        run.dirty = true;
        match event {
            IntakeEvent::Batch(b) => {
                run.marks.insert(b.key, b.seq);
                for e in &b.events {
                    run.blocks += match e {
                        KvEvent::BlockStored(s) => s.block_hashes.len() as u64,
                        KvEvent::BlockRemoved(r) => r.block_hashes.len() as u64,
                        KvEvent::AllBlocksCleared => 0,
                    };
                }
                if let (Some(ts), false) = (b.ts, b.replayed) {
                    run.pending.push((b.key, ts));
                }
                self.sink.deliver(IntakeEvent::Batch(b));
            }
            IntakeEvent::State { key, state } => {
                let p = run.publishers.entry(key).or_insert_with(Publisher::new);
                p.state = Some(state);
                Self::show(&mut self.sink, p, key);
            }
            IntakeEvent::Reset { key, reason } => {
                run.marks.remove(&key);
                if reason == ResetReason::Unsubscribed {
                    if let Some(p) = run.publishers.remove(&key) {
                        if p.lagging {
                            self.stats.lagging.fetch_sub(1, Ordering::Relaxed);
                        }
                    }
                } else if let Some(p) = run.publishers.get_mut(&key) {
                    // A new process (or lost batches): its clock and backlog start again.
                    p.floor = f64::INFINITY;
                }
                self.sink.deliver(IntakeEvent::Reset { key, reason });
            }
        }
    }

    /// Make what was applied visible. The staleness of the batches it holds is taken first, so
    /// a publisher found lagging is shown so in the same publication.
    fn publish(&mut self, run: &mut Run, now: Instant) {
        self.measure(run, now);
        self.sink.flush();
        run.dirty = false;
        run.last_publish = now;
        self.stats.publishes.fetch_add(1, Ordering::Relaxed);
        if run.blocks > 0 {
            self.stats
                .applied_blocks
                .fetch_add(run.blocks, Ordering::Relaxed);
            crate::metrics::kv_applied_blocks(run.blocks);
            run.blocks = 0;
        }
    }

    /// Each batch's staleness at the publication about to be made; publishers that pass the
    /// bound lag, those back within half of it catch up.
    fn measure(&mut self, run: &mut Run, now: Instant) {
        if run.pending.is_empty() {
            return;
        }
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let limit = self.config.max_staleness.as_secs_f64();
        for (key, ts) in run.pending.drain(..) {
            let Some(p) = run.publishers.get_mut(&key) else {
                continue;
            };
            let delay = wall - ts;
            if !delay.is_finite() {
                continue;
            }
            p.floor = p.floor.min(delay);
            let staleness = (delay - p.floor).max(0.0);
            p.staleness = staleness;
            p.last_batch = Some(now);
            run.staleness.record(staleness);
            if !p.lagging && staleness > limit {
                p.lagging = true;
                self.stats.lagging.fetch_add(1, Ordering::Relaxed);
                let loud = run
                    .last_warn
                    .is_none_or(|t| now.duration_since(t) >= LOG_EVERY);
                if loud {
                    run.last_warn = Some(now);
                }
                let line = format!(
                    "kv events: worker {} rank {}: lagging ({:.0} ms behind its publisher, \
                     over {} ms; {} publishers lag, {} KiB queued): scored by the text tree \
                     until it catches up",
                    key.worker,
                    key.dp_rank,
                    staleness * 1e3,
                    self.config.max_staleness.as_millis(),
                    self.stats.lagging.load(Ordering::Relaxed),
                    self.bound.queued() >> 10,
                );
                if loud {
                    crate::log!(Warn, "{line}");
                } else {
                    crate::log!(Debug, "{line}");
                }
                Self::show(&mut self.sink, p, key);
            } else if p.lagging && staleness <= limit / 2.0 {
                self.caught_up(p, key);
            }
        }
    }

    /// Tell the sink the publisher's state as routing should see it, if that changed.
    fn show(sink: &mut S, p: &mut Publisher, key: PublisherKey) {
        let now = p.effective();
        if now != p.shown {
            p.shown = now;
            if let Some(state) = now {
                sink.deliver(IntakeEvent::State { key, state });
            }
        }
    }

    fn caught_up(&mut self, p: &mut Publisher, key: PublisherKey) {
        p.lagging = false;
        self.stats.lagging.fetch_sub(1, Ordering::Relaxed);
        crate::log!(
            Info,
            "kv events: worker {} rank {}: caught up ({:.0} ms behind)",
            key.worker,
            key.dp_rank,
            p.staleness * 1e3
        );
        Self::show(&mut self.sink, p, key);
    }

    /// Clear lagging publishers that went quiet while the queue is empty (nothing of theirs is
    /// waiting), and republish the per-publisher figures.
    fn sweep(&mut self, run: &mut Run, now: Instant) {
        if self.stats.lagging.load(Ordering::Relaxed) > 0 && self.bound.queued() == 0 {
            let quiet = self.config.max_staleness;
            for (&key, p) in run.publishers.iter_mut() {
                if p.lagging && p.last_batch.is_none_or(|t| now.duration_since(t) >= quiet) {
                    p.staleness = 0.0;
                    self.caught_up(p, key);
                    run.dirty = true;
                }
            }
        }
        let mut figures: Vec<(PublisherKey, f32, bool)> = run
            .publishers
            .iter()
            .map(|(k, p)| (*k, p.staleness as f32, p.lagging))
            .collect();
        figures.sort_unstable_by_key(|f| f.0);
        self.published.store(Arc::new(figures));
    }

    /// Apply every queued command; false on shutdown.
    fn take_commands(&mut self, run: &mut Run) -> bool {
        loop {
            let c = match self.picked.take() {
                Some(c) => c,
                None => match self.commands.try_recv() {
                    Ok(c) => c,
                    Err(TryRecvError::Empty) => return true,
                    Err(TryRecvError::Disconnected) => return false,
                },
            };
            match c {
                ApplyCommand::Shutdown => return false,
                ApplyCommand::Export(reply) => {
                    if run.export.is_some() {
                        // One at a time (the caller also guards this).
                        let _ = reply.try_send(None);
                        continue;
                    }
                    match self.sink.export_begin() {
                        Some(keys) => run.export = Some((keys.into(), reply)),
                        None => {
                            let _ = reply.try_send(None);
                        }
                    }
                }
                ApplyCommand::Import {
                    data,
                    workers,
                    reply,
                } => {
                    let r = self.sink.import(&data, &workers).map(|marks| {
                        let n = marks.len();
                        let mut per_reader: Vec<Vec<(PublisherKey, i64)>> =
                            vec![Vec::new(); self.readers.len()];
                        for (key, seq) in marks {
                            // A publisher already streaming goes on as it was (what it applied
                            // and the copy overlap).
                            if run.publishers.contains_key(&key) {
                                continue;
                            }
                            run.marks.insert(key, seq);
                            per_reader[super::reader_of(key, self.readers.len())].push((key, seq));
                        }
                        for (tx, marks) in self.readers.iter().zip(per_reader) {
                            if !marks.is_empty() {
                                // A full queue loses only the head start: the stream then
                                // replays from the beginning.
                                let _ = tx.try_send(Command::Resume(marks));
                            }
                        }
                        n
                    });
                    run.dirty = true;
                    let _ = reply.try_send(r);
                }
            }
        }
    }

    /// Copy the next publisher of the export under way, or finish it.
    fn export_step(&mut self, run: &mut Run) {
        let Some((keys, _)) = &mut run.export else {
            return;
        };
        match keys.pop_front() {
            Some(key) => {
                let watermark = run.marks.get(&key).copied();
                self.sink.export_source(key, watermark);
            }
            None => {
                if let Some((_, reply)) = run.export.take() {
                    self.sink.export_finish(reply);
                }
            }
        }
    }
}

enum Woke {
    Chunk(Chunk),
    Command,
    Timeout,
    Stopped,
}
