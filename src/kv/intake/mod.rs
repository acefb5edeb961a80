//! The event intake: dedicated std threads (never a serving core) that subscribe to every
//! publisher's PUB socket over our own ZMTP client (`kv::zmtp`, `kv::socket`), decodes with
//! `kv::wire`, keeps each publisher's stream in order and hands the batches to an [`EventSink`]
//! (the index writer). Nothing on the request path waits for it: serving cores only read what
//! the sink publishes.
//!
//! Per publisher (a worker's attention-DP rank) a pure state machine (`stream`) decides what a
//! sequence number means, when the replay socket is asked and what its answer proves; see its
//! module doc for the rules (silence is not a gap; a replay proves who is talking; one bad
//! message never costs a worker its blocks). A reader thread runs those machines without ever
//! waiting on one publisher: every socket is nonblocking in one epoll set (`watch`), each replay
//! has its own connection and deadline, at most [`IntakeConfig::max_replays`] run at once, and
//! host names are resolved on helper threads (`kv::resolve`).
//!
//! Each publisher's state is reported to the sink as it changes ([`SourceState`]): the index
//! speaks for a worker only while every one of its publishers is [`SourceState::Live`].
//!
//! Subscriptions change at run time through [`Intake::subscribe`] / [`Intake::unsubscribe`]
//! (a bounded command channel that never blocks the caller).
//!
//! **Threads.** Reading and decoding run on [`IntakeConfig::readers`] reader threads (`thread`,
//! each publisher on one of them, so its batches stay in order); they hand their decoded batches
//! a chunk per round through one queue bounded in bytes (`queue`) to the applying thread
//! (`apply`), the only one that calls the sink: an index behind it keeps its single writer,
//! publishes per interval rather than per batch, and its staleness is measured there.

mod apply;
mod queue;
mod thread;
mod watch;

pub mod stream;

pub use apply::ApplyConfig;

use super::endpoint::TcpEndpoint;
use super::socket;
use super::wire::KvEvent;
use crate::base::WorkerId;
use apply::ApplyCommand;
use arc_swap::ArcSwap;
use crossbeam::channel::{self, Receiver, Sender, TrySendError};
use queue::QueueBound;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// One publisher: a worker's attention-DP rank (each rank publishes its own sequence). The
/// same key the token-block index files its blocks under, so events need no translation.
pub use super::index::Source as PublisherKey;

/// Where one publisher's sockets are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Publisher {
    /// Whose events these are.
    pub key: PublisherKey,
    /// The PUB socket to subscribe to (already offset for the DP rank).
    pub live: TcpEndpoint,
    /// The replay ROUTER socket, when the server runs one (gaps are filled from it).
    pub replay: Option<TcpEndpoint>,
}

/// One batch of one publisher, delivered strictly in sequence order (replayed batches included).
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerEvents {
    /// The publisher.
    pub key: PublisherKey,
    /// The batch's sequence number.
    pub seq: i64,
    /// The publisher's timestamp, when it sent one.
    pub ts: Option<f64>,
    /// The events, in order.
    pub events: Vec<KvEvent>,
    /// Whether it came from the replay socket rather than the live stream.
    pub replayed: bool,
}

/// Why a publisher's state must be dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResetReason {
    /// A new server process: its cache is new.
    Restarted,
    /// Batches were missed and could not be replayed.
    Gap,
    /// A batch (or a removal in it) could not be read.
    Unreadable,
    /// It was unsubscribed (the worker left, or its endpoint changed).
    Unsubscribed,
}

impl ResetReason {
    /// A short name for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            ResetReason::Restarted => "restarted",
            ResetReason::Gap => "gap",
            ResetReason::Unreadable => "unreadable",
            ResetReason::Unsubscribed => "unsubscribed",
        }
    }
}

/// Where a publisher's stream stands, as routing sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SourceState {
    /// Not connected (resolving, connecting, or waiting to retry after a failure).
    Connecting,
    /// A replay is running (start-up, gap fill, reconnect, restart check); the live stream
    /// waits behind it.
    Replaying,
    /// Connected and in order, but what the index holds may lack blocks (no batch seen yet
    /// from a publisher without a replay socket).
    Partial,
    /// Everything the publisher still buffers was applied and the stream is in order: the
    /// index speaks for it.
    Live,
    /// Live, but its batches reach the index later than `--kv-max-staleness-ms` (the intake
    /// cannot keep up): scored by the text tree until it catches up (see `apply`).
    Lagging,
}

impl SourceState {
    /// Every state, for series that exist from the start.
    pub const ALL: [SourceState; 5] = [
        SourceState::Connecting,
        SourceState::Replaying,
        SourceState::Partial,
        SourceState::Live,
        SourceState::Lagging,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            SourceState::Connecting => "connecting",
            SourceState::Replaying => "replaying",
            SourceState::Partial => "partial",
            SourceState::Live => "live",
            SourceState::Lagging => "lagging",
        }
    }
}

/// What the intake hands to its sink, in order per publisher.
#[derive(Debug, Clone, PartialEq)]
pub enum IntakeEvent {
    /// A batch to apply.
    Batch(WorkerEvents),
    /// The publisher's state changed (the first report follows its subscription).
    State {
        /// The publisher.
        key: PublisherKey,
        /// Its new state.
        state: SourceState,
    },
    /// Forget everything this publisher reported so far.
    Reset {
        /// The publisher.
        key: PublisherKey,
        /// Why.
        reason: ResetReason,
    },
}

/// Where decoded batches go. Called on the event thread only, so an implementation that applies
/// them to the index directly is that index's single writer.
pub trait EventSink: Send + 'static {
    /// Take one batch, reset or state change (in sequence order per publisher).
    fn deliver(&mut self, event: IntakeEvent);

    /// Called after every round of the event thread: the moment to make what was delivered
    /// visible at once (an index publishes here, so a burst of batches costs one publication,
    /// and the last batch of a burst never waits for the next one).
    fn flush(&mut self) {}

    /// An export begins (a copy of everything held, for a sibling gateway starting with
    /// `--kv-bootstrap-peer`): the publishers it will hold, in order (`None`: this sink keeps
    /// no copy). The intake then copies one publisher per round of its thread
    /// ([`EventSink::export_source`]), applying other events in between, and finishes with
    /// [`EventSink::export_finish`].
    fn export_begin(&mut self) -> Option<Vec<PublisherKey>> {
        None
    }

    /// Copy one publisher's state into the export under way, with the last batch applied of
    /// it (`None`: not subscribed): taken between two of its batches, so both agree.
    fn export_source(&mut self, key: PublisherKey, watermark: Option<i64>) {
        let _ = (key, watermark);
    }

    /// The export is complete: finish it (on another thread if it is long) and send it on
    /// `reply`.
    fn export_finish(&mut self, reply: ExportReply) {
        let _ = reply.try_send(None);
    }

    /// Take a sibling's copy (before subscribing). `workers` names this gateway's workers by URL
    /// (ids differ between copies). Returns, per publisher it covered, the last batch it
    /// includes: the stream resumes after it.
    fn import(
        &mut self,
        data: &[u8],
        workers: &[(String, WorkerId)],
    ) -> Result<Vec<(PublisherKey, i64)>, String> {
        let _ = (data, workers);
        Err("this sink keeps no copy".into())
    }
}

/// A channel sink: a bounded channel makes the event thread wait for its consumer (the
/// publishers' own queues hold the rest).
impl EventSink for Sender<IntakeEvent> {
    fn deliver(&mut self, event: IntakeEvent) {
        // A consumer that went away wants nothing more.
        let _ = self.send(event);
    }
}

/// Where an export's payload goes (`None`: the sink keeps no copy, or it failed).
pub type ExportReply = Sender<Option<Vec<u8>>>;
/// Where an export's payload arrives.
pub type ExportAnswer = Receiver<Option<Vec<u8>>>;

/// The intake's limits.
#[derive(Debug, Clone)]
pub struct IntakeConfig {
    /// Longest a replay may go without an answer (connecting included) before it counts as
    /// failed; each reply starts the wait again.
    pub replay_timeout: Duration,
    /// Most batches one replay may deliver (SGLang buffers 10 000 by default).
    pub max_replay_batches: u64,
    /// Replays running at once; more wait their turn (their live streams wait behind them).
    pub max_replays: usize,
    /// Longest the thread sleeps in `poll` (commands are looked at this often).
    pub poll_interval: Duration,
    /// First pause before reconnecting to a publisher that is down; doubled per failure.
    pub reconnect_min: Duration,
    /// Longest pause between reconnects.
    pub reconnect_max: Duration,
    /// Messages taken from one publisher before the next gets a turn.
    pub batch_per_turn: usize,
    /// From connect to the peer's READY.
    pub handshake_timeout: Duration,
    /// From a message's first byte to its last.
    pub message_timeout: Duration,
    /// Longest a peer may leave what we send it unread (the subscription, a replay request, the
    /// answer to its latest PING) before its connection is dropped (`--kv-send-timeout-secs`).
    pub send_timeout: Duration,
    /// Bytes of unfinished messages and unsent bytes all connections may hold together (beyond
    /// it, each still reads while it holds under `kv::socket::FLOOR`, so one that hogs it
    /// stalls no other).
    pub budget_bytes: usize,
    /// Longest a host name lookup may take.
    pub resolve_timeout: Duration,
    /// Reader threads (sockets, decoding, stream machines; each publisher on one of them):
    /// `--kv-event-threads`.
    pub readers: usize,
    /// Bytes of decoded batches queued for the applying thread at most (`--kv-queue-mib`):
    /// beyond it the readers wait.
    pub queue_bytes: usize,
    /// When the applying thread publishes, and when a publisher lags.
    pub apply: ApplyConfig,
}

impl Default for IntakeConfig {
    fn default() -> Self {
        IntakeConfig {
            replay_timeout: Duration::from_secs(5),
            max_replay_batches: 100_000,
            max_replays: 8,
            poll_interval: Duration::from_millis(50),
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(5),
            batch_per_turn: 256,
            handshake_timeout: Duration::from_secs(5),
            message_timeout: Duration::from_secs(30),
            send_timeout: Duration::from_secs(10),
            budget_bytes: 256 << 20,
            resolve_timeout: Duration::from_secs(5),
            readers: 1,
            queue_bytes: 64 << 20,
            apply: ApplyConfig::default(),
        }
    }
}

/// Counters of what the intake did since it started (also exported as
/// `radixgate_kv_events_total{kind}`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IntakeCounts {
    /// Batches delivered (live and replayed).
    pub batches: u64,
    /// Events delivered.
    pub events: u64,
    /// Batches delivered from a replay socket.
    pub replayed_batches: u64,
    /// Messages, replies or batches that could not be read or were refused, and connections
    /// dropped for breaking the protocol or a cap (a frame, message or command too large, too
    /// many frames).
    pub malformed: u64,
    /// Events skipped inside readable batches.
    pub skipped_events: u64,
    /// Sequence gaps seen.
    pub gaps: u64,
    /// Resets delivered.
    pub resets: u64,
    /// Replays asked for.
    pub replays: u64,
    /// Replays that failed (no answer, refused, broken off).
    pub replay_failures: u64,
    /// Connections to a live socket that failed or dropped.
    pub connect_failures: u64,
    /// Workers not subscribed (counted per discovery attempt): more DP ranks than allowed, or
    /// ranks whose ports do not exist.
    pub refused: u64,
    /// Attempts to read a worker's publishers that failed (its `/get_server_info`); retried.
    pub discovery_failures: u64,
}

/// The counter kinds, as the metric labels them.
const KINDS: [&str; 12] = [
    "batch",
    "event",
    "replayed_batch",
    "malformed",
    "skipped_event",
    "gap",
    "reset",
    "replay",
    "replay_failed",
    "connect_failed",
    "refused",
    "discovery_failed",
];

const BATCH: usize = 0;
const EVENT: usize = 1;
const REPLAYED: usize = 2;
const MALFORMED: usize = 3;
const SKIPPED: usize = 4;
const GAP: usize = 5;
const RESET: usize = 6;
const REPLAY: usize = 7;
const REPLAY_FAILED: usize = 8;
const CONNECT_FAILED: usize = 9;
const REFUSED: usize = 10;
const DISCOVERY_FAILED: usize = 11;

/// Why connections were dropped for not reading what we send, as the metric labels them
/// (`kv::socket::ConnError::send_drop_reason`).
const SEND_DROP_REASONS: [&str; 2] = ["stalled", "full"];

#[derive(Default)]
struct Stats {
    counts: [AtomicU64; 12],
    /// Connections dropped for not reading what we send (all reasons).
    send_dropped: AtomicU64,
    /// Bytes of unfinished messages and unsent bytes held now.
    held: AtomicU64,
    /// Rounds of the reader loops (a stalled thread stops counting).
    rounds: AtomicU64,
    /// Publications the applying thread made.
    publishes: AtomicU64,
    /// Block hashes stored or removed that the applying thread handed to its sink.
    applied_blocks: AtomicU64,
    /// Publishers lagging now (see `apply`).
    lagging: AtomicU64,
}

impl Stats {
    fn add(&self, kind: usize, n: u64) {
        if n > 0 {
            self.counts[kind].fetch_add(n, Ordering::Relaxed);
            crate::metrics::kv_events(KINDS[kind], n);
        }
    }
    fn send_dropped(&self, reason: &'static str) {
        self.send_dropped.fetch_add(1, Ordering::Relaxed);
        crate::metrics::kv_send_dropped(reason, 1);
    }
    fn counts(&self) -> IntakeCounts {
        let g = |i: usize| self.counts[i].load(Ordering::Relaxed);
        IntakeCounts {
            batches: g(BATCH),
            events: g(EVENT),
            replayed_batches: g(REPLAYED),
            malformed: g(MALFORMED),
            skipped_events: g(SKIPPED),
            gaps: g(GAP),
            resets: g(RESET),
            replays: g(REPLAY),
            replay_failures: g(REPLAY_FAILED),
            connect_failures: g(CONNECT_FAILED),
            refused: g(REFUSED),
            discovery_failures: g(DISCOVERY_FAILED),
        }
    }
}

/// Commands for a reader thread.
enum Command {
    Subscribe(Publisher),
    Unsubscribe(PublisherKey),
    RemoveWorker(WorkerId),
    /// Publishers an imported copy covers, with its last batch of each: subscribed later, their
    /// streams resume after it.
    Resume(Vec<(PublisherKey, i64)>),
    Shutdown,
}

/// The reader thread a publisher's stream runs on (every command about it goes there).
fn reader_of(key: PublisherKey, readers: usize) -> usize {
    let mixed =
        (u64::from(key.worker) << 32 | u64::from(key.dp_rank)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    ((mixed >> 32) % readers.max(1) as u64) as usize
}

/// Why a command was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommandError {
    /// The command queue is full; try again later.
    Busy,
    /// The event thread has stopped.
    Stopped,
}

/// Commands queued at most (worker changes are rare; a full queue answers `Busy`, never blocks).
const COMMAND_QUEUE: usize = 4096;

/// The running intake: its reader threads, the applying thread, their command queues and
/// counters. Dropping it tells the threads to stop without waiting for them (a sink blocked on a
/// full channel whose reader is gone would otherwise hang the dropper); [`Intake::stop`] waits.
pub struct Intake {
    /// One command queue per reader thread; a publisher's commands go to its reader.
    readers: Vec<Sender<Command>>,
    apply: Sender<ApplyCommand>,
    stats: Arc<Stats>,
    bound: Arc<QueueBound>,
    /// Per-publisher staleness and lagging flag, republished by the applying thread.
    lag: Arc<ArcSwap<Vec<(PublisherKey, f32, bool)>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Intake {
    /// Start the reader threads (named `kv-events-N`) and the applying thread (`kv-index`),
    /// delivering to `sink` on the applying thread.
    pub fn start(config: IntakeConfig, sink: impl EventSink) -> std::io::Result<Intake> {
        let stats = Arc::new(Stats::default());
        // Every series exists from the start, at zero.
        for kind in KINDS {
            crate::metrics::kv_events(kind, 0);
        }
        for reason in SEND_DROP_REASONS {
            crate::metrics::kv_send_dropped(reason, 0);
        }
        crate::metrics::kv_applied_blocks(0);
        let n = config.readers.max(1);
        let bound = Arc::new(QueueBound::new(config.queue_bytes));
        let (chunks_tx, chunks_rx) = channel::unbounded();
        let lag = Arc::new(ArcSwap::from_pointee(Vec::new()));
        let mut reader_config = config.clone();
        // The connections' budget is shared out.
        reader_config.budget_bytes = (config.budget_bytes / n).max(socket::FLOOR);
        let (apply_tx, apply_rx) = channel::bounded(COMMAND_QUEUE);
        // Threads are recorded as they start: on an error, dropping `intake` stops those
        // already running.
        let mut intake = Intake {
            readers: Vec::with_capacity(n),
            apply: apply_tx,
            stats: stats.clone(),
            bound: bound.clone(),
            lag: lag.clone(),
            threads: Vec::with_capacity(n + 1),
        };
        for i in 0..n {
            let (tx, rx) = channel::bounded(COMMAND_QUEUE);
            let forward = queue::ForwardSink::new(chunks_tx.clone(), bound.clone());
            let reader =
                thread::EventThread::new(reader_config.clone(), forward, stats.clone(), rx)?;
            let t = std::thread::Builder::new()
                .name(format!("kv-events-{i}"))
                .spawn(move || {
                    if let Err(e) = crate::base::priority::helper_thread() {
                        crate::log!(Warn, "kv-events thread: cannot lower its priority: {e}");
                    }
                    reader.run()
                })?;
            intake.readers.push(tx);
            intake.threads.push(t);
        }
        drop(chunks_tx);
        let applier = apply::ApplyThread {
            sink,
            config: config.apply,
            chunks: chunks_rx,
            commands: apply_rx,
            readers: intake.readers.clone(),
            bound: bound.clone(),
            stats: stats.clone(),
            published: lag,
            picked: None,
        };
        let t = std::thread::Builder::new()
            .name("kv-index".into())
            .spawn(move || {
                if let Err(e) = crate::base::priority::helper_thread() {
                    crate::log!(Warn, "kv-index thread: cannot lower its priority: {e}");
                }
                applier.run()
            })?;
        intake.threads.push(t);
        Ok(intake)
    }

    /// Subscribe to a publisher (replacing, with a reset, one of the same key at another
    /// endpoint; the same endpoint again changes nothing).
    pub fn subscribe(&self, publisher: Publisher) -> Result<(), CommandError> {
        let r = reader_of(publisher.key, self.readers.len());
        command(&self.readers[r], Command::Subscribe(publisher))
    }

    /// Drop one publisher (its state is reset).
    pub fn unsubscribe(&self, key: PublisherKey) -> Result<(), CommandError> {
        let r = reader_of(key, self.readers.len());
        command(&self.readers[r], Command::Unsubscribe(key))
    }

    /// Drop every publisher of a worker (it left the fleet).
    pub fn remove_worker(&self, worker: WorkerId) -> Result<(), CommandError> {
        // Its ranks may be on any reader. A reader whose queue is full answers `Busy` and the
        // caller tries again; the readers that took it drop their share meanwhile (dropping
        // twice is harmless).
        let mut result = Ok(());
        for tx in &self.readers {
            if let Err(e) = command(tx, Command::RemoveWorker(worker)) {
                result = Err(e);
            }
        }
        result
    }

    /// Ask the sink for a copy of what it holds ([`EventSink::export_begin`]), taken between
    /// two chunks so the watermarks are exact. The answer comes on the returned channel (the
    /// caller decides how long to wait).
    pub fn export(&self) -> Result<ExportAnswer, CommandError> {
        let (tx, rx) = channel::bounded(1);
        command(&self.apply, ApplyCommand::Export(tx))?;
        Ok(rx)
    }

    /// Hand the sink a sibling's copy ([`EventSink::import`]); publishers subscribed later
    /// resume after the copy's watermark (the replay socket fills what happened since). Answers
    /// how many publishers the copy covered.
    pub fn import(
        &self,
        data: Vec<u8>,
        workers: Vec<(String, WorkerId)>,
    ) -> Result<Receiver<Result<usize, String>>, CommandError> {
        let (reply, rx) = channel::bounded(1);
        command(
            &self.apply,
            ApplyCommand::Import {
                data,
                workers,
                reply,
            },
        )?;
        Ok(rx)
    }

    /// Count a worker whose publishers discovery would not subscribe (more DP ranks than
    /// allowed, or ranks whose ports do not exist): `radixgate_kv_events_total{kind="refused"}`,
    /// so an operator sees a worker scored by the text tree for that reason.
    pub fn count_refused(&self) {
        self.stats.add(REFUSED, 1);
    }

    /// Count a failed attempt to read a worker's publishers (it is retried with a backoff):
    /// `radixgate_kv_events_total{kind="discovery_failed"}`.
    pub fn count_discovery_failed(&self) {
        self.stats.add(DISCOVERY_FAILED, 1);
    }

    /// What the intake has done so far.
    pub fn counts(&self) -> IntakeCounts {
        self.stats.counts()
    }

    /// Bytes of unfinished messages and unsent bytes the connections hold now (bounded by
    /// [`IntakeConfig::budget_bytes`] plus, per connection, `kv::socket::FLOOR`, one read and
    /// its outbox).
    pub fn held_bytes(&self) -> u64 {
        self.stats.held.load(Ordering::Relaxed)
    }

    /// Bytes of decoded batches waiting for the applying thread (bounded by
    /// [`IntakeConfig::queue_bytes`] plus one chunk per reader).
    pub fn queued_bytes(&self) -> u64 {
        self.bound.queued() as u64
    }

    /// Time the readers spent waiting for room in the queue since the start: it grows while
    /// the applying thread cannot keep up.
    pub fn queue_wait(&self) -> Duration {
        Duration::from_micros(self.bound.waited_us())
    }

    /// Publishers lagging now (their batches arrive later than
    /// [`ApplyConfig::max_staleness`]).
    pub fn lagging(&self) -> u64 {
        self.stats.lagging.load(Ordering::Relaxed)
    }

    /// Each subscribed publisher's staleness at its latest batch (seconds) and whether it lags,
    /// sorted by publisher (republished a few times a second).
    pub fn staleness(&self) -> arc_swap::Guard<Arc<Vec<(PublisherKey, f32, bool)>>> {
        self.lag.load()
    }

    /// Block hashes stored or removed that were applied since the start.
    pub fn applied_blocks(&self) -> u64 {
        self.stats.applied_blocks.load(Ordering::Relaxed)
    }

    /// Publications made since the start.
    pub fn publishes(&self) -> u64 {
        self.stats.publishes.load(Ordering::Relaxed)
    }

    /// Connections dropped because their peer would not read what the intake sends it
    /// (`radixgate_kv_send_dropped_total`).
    pub fn send_dropped(&self) -> u64 {
        self.stats.send_dropped.load(Ordering::Relaxed)
    }

    /// Rounds the reader loops have run (each runs at least every `poll_interval`: a count
    /// that stops moving is a stalled thread).
    pub fn rounds(&self) -> u64 {
        self.stats.rounds.load(Ordering::Relaxed)
    }

    /// Stop the threads and wait for them (the sink must keep accepting until then).
    pub fn stop(mut self) {
        self.signal_stop();
        for t in std::mem::take(&mut self.threads) {
            let _ = t.join();
        }
    }

    fn signal_stop(&mut self) {
        // A full queue still ends a thread: it also stops when its channel disconnects.
        for tx in &self.readers {
            let _ = tx.try_send(Command::Shutdown);
        }
        let _ = self.apply.try_send(ApplyCommand::Shutdown);
        self.bound.stop();
        self.readers.clear();
        let (dead, _) = channel::bounded(1);
        self.apply = dead;
    }
}

fn command<C>(tx: &Sender<C>, c: C) -> Result<(), CommandError> {
    tx.try_send(c).map_err(|e| match e {
        TrySendError::Full(_) => CommandError::Busy,
        TrySendError::Disconnected(_) => CommandError::Stopped,
    })
}

impl Drop for Intake {
    fn drop(&mut self) {
        self.signal_stop();
    }
}

#[cfg(test)]
mod tests;
