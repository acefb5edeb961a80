//! The event intake: one dedicated std thread (never a serving core) that subscribes to every
//! publisher's PUB socket over our own ZMTP client (`kv::zmtp`, `kv::socket`), decodes with
//! `kv::wire`, keeps each publisher's stream in order and hands the batches to an [`EventSink`]
//! (the index writer). Nothing on the request path waits for it: serving cores only read what
//! the sink publishes.
//!
//! Per publisher (a worker's attention-DP rank) a pure state machine (`stream`) decides what a
//! sequence number means, when the replay socket is asked and what its answer proves; see its
//! module doc for the rules (silence is not a gap; a replay proves who is talking; one bad
//! message never costs a worker its blocks). This thread runs those machines without ever
//! waiting on one publisher: every socket is nonblocking in one `poll(2)` loop, each replay
//! has its own connection and deadline, at most [`IntakeConfig::max_replays`] run at once, and
//! host names are resolved on helper threads (`kv::resolve`).
//!
//! Each publisher's state is reported to the sink as it changes ([`SourceState`]): the index
//! speaks for a worker only while every one of its publishers is [`SourceState::Live`].
//!
//! Subscriptions change at run time through [`Intake::subscribe`] / [`Intake::unsubscribe`]
//! (a bounded command channel that never blocks the caller). The thread's loop is `thread`.

mod thread;

pub mod stream;

use super::endpoint::TcpEndpoint;
use super::wire::KvEvent;
use crate::base::WorkerId;
use crossbeam::channel::{self, Receiver, Sender, TrySendError};
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
}

impl SourceState {
    /// Every state, for series that exist from the start.
    pub const ALL: [SourceState; 4] = [
        SourceState::Connecting,
        SourceState::Replaying,
        SourceState::Partial,
        SourceState::Live,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            SourceState::Connecting => "connecting",
            SourceState::Replaying => "replaying",
            SourceState::Partial => "partial",
            SourceState::Live => "live",
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
    /// Rounds of the event loop (a stalled thread stops counting).
    rounds: AtomicU64,
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

enum Command {
    Export(ExportReply),
    Import {
        data: Vec<u8>,
        workers: Vec<(String, WorkerId)>,
        reply: Sender<Result<usize, String>>,
    },
    Subscribe(Publisher),
    Unsubscribe(PublisherKey),
    RemoveWorker(WorkerId),
    Shutdown,
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
const COMMAND_QUEUE: usize = 1024;

/// The running intake: its thread, command queue and counters. Dropping it tells the thread to
/// stop without waiting for it (a sink blocked on a full channel whose reader is gone would
/// otherwise hang the dropper); [`Intake::stop`] waits.
pub struct Intake {
    commands: Sender<Command>,
    stats: Arc<Stats>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Intake {
    /// Start the event thread (named `kv-events`), delivering to `sink`.
    pub fn start(config: IntakeConfig, sink: impl EventSink) -> std::io::Result<Intake> {
        let (tx, rx) = channel::bounded(COMMAND_QUEUE);
        let stats = Arc::new(Stats::default());
        // Every series exists from the start, at zero.
        for kind in KINDS {
            crate::metrics::kv_events(kind, 0);
        }
        for reason in SEND_DROP_REASONS {
            crate::metrics::kv_send_dropped(reason, 0);
        }
        let worker = thread::EventThread::new(config, sink, stats.clone(), rx);
        let thread = std::thread::Builder::new()
            .name("kv-events".into())
            .spawn(move || {
                if let Err(e) = crate::base::priority::helper_thread() {
                    crate::log!(Warn, "kv-events thread: cannot lower its priority: {e}");
                }
                worker.run()
            })?;
        Ok(Intake {
            commands: tx,
            stats,
            thread: Some(thread),
        })
    }

    /// Subscribe to a publisher (replacing, with a reset, one of the same key at another
    /// endpoint; the same endpoint again changes nothing).
    pub fn subscribe(&self, publisher: Publisher) -> Result<(), CommandError> {
        self.command(Command::Subscribe(publisher))
    }

    /// Drop one publisher (its state is reset).
    pub fn unsubscribe(&self, key: PublisherKey) -> Result<(), CommandError> {
        self.command(Command::Unsubscribe(key))
    }

    /// Drop every publisher of a worker (it left the fleet).
    pub fn remove_worker(&self, worker: WorkerId) -> Result<(), CommandError> {
        self.command(Command::RemoveWorker(worker))
    }

    /// Ask the sink for a copy of what it holds ([`EventSink::export`]), taken between two
    /// batches so the watermarks are exact. The answer comes on the returned channel (the
    /// caller decides how long to wait).
    pub fn export(&self) -> Result<ExportAnswer, CommandError> {
        let (tx, rx) = channel::bounded(1);
        self.command(Command::Export(tx))?;
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
        self.command(Command::Import {
            data,
            workers,
            reply,
        })?;
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

    /// Connections dropped because their peer would not read what the intake sends it
    /// (`radixgate_kv_send_dropped_total`).
    pub fn send_dropped(&self) -> u64 {
        self.stats.send_dropped.load(Ordering::Relaxed)
    }

    /// Rounds the event loop has run (it runs at least every `poll_interval`: a count that
    /// stops moving is a stalled thread).
    pub fn rounds(&self) -> u64 {
        self.stats.rounds.load(Ordering::Relaxed)
    }

    /// Stop the thread and wait for it (its sink must keep accepting until then).
    pub fn stop(mut self) {
        self.signal_stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    fn signal_stop(&mut self) {
        // A full queue still ends the thread: it also stops when the channel disconnects.
        let _ = self.commands.try_send(Command::Shutdown);
        let (dead, _) = channel::bounded(1);
        self.commands = dead;
    }

    fn command(&self, c: Command) -> Result<(), CommandError> {
        self.commands.try_send(c).map_err(|e| match e {
            TrySendError::Full(_) => CommandError::Busy,
            TrySendError::Disconnected(_) => CommandError::Stopped,
        })
    }
}

impl Drop for Intake {
    fn drop(&mut self) {
        self.signal_stop();
    }
}

#[cfg(test)]
mod tests;
