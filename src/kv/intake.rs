//! The event thread: one dedicated std thread (never a serving core) that subscribes to every
//! publisher's ZeroMQ PUB socket, decodes with [`super::wire`], keeps each publisher's sequence in
//! order and hands the batches to an [`EventSink`] (the index writer, connected at integration).
//! Nothing on the request path waits for it: serving cores only read what the sink publishes.
//!
//! Per publisher (a worker's attention-DP rank) it tracks the last sequence number:
//! - the next number: delivered;
//! - a jump forward (the SUB queue overflowed, or the connection dropped for a while): the
//!   missing batches are asked from the publisher's replay socket (a DEALER to its ROUTER:
//!   `[b"", start]`, replies `[b"", seq, payload]` until seq -1), at most
//!   [`IntakeConfig::max_replay_batches`] and within [`IntakeConfig::replay_timeout`], and
//!   delivered in order before the batch that revealed the gap. Without a replay socket, or when
//!   it cannot fill the hole, the worker is **reset** (the index drops its blocks) rather than
//!   trusted with a hole: a missed `BlockRemoved` would make it look as if the worker still held
//!   blocks it evicted;
//! - a number going back (the server restarted, its counter from 0): reset, then the new stream;
//! - a batch that cannot be read although its sequence number can (or one whose removals could
//!   not all be read, [`super::wire::Skipped::lossy`]): a hole, so a reset.
//!
//! Messages without a readable sequence number are counted as malformed and skipped with no
//! effect on the stream. After a reset the stream goes on from the batch at hand: what the index
//! then lacks only makes it under-estimate (blocks it never heard of), never over-estimate.
//!
//! Subscriptions change at run time through [`Intake::subscribe`] / [`Intake::unsubscribe`]
//! (a bounded command channel that never blocks the caller).

use super::endpoint::TcpEndpoint;
use super::wire::{self, EventBatch, KvEvent, ReplayReply};
use crate::base::WorkerId;
use crossbeam::channel::{self, Receiver, RecvTimeoutError, Sender, TryRecvError, TrySendError};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// Whether it came from the replay socket (a gap fill) rather than the live stream.
    pub replayed: bool,
}

/// Why a publisher's state must be dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResetReason {
    /// Its sequence went back: the server restarted and its cache is new.
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

/// What the intake hands to its sink, in order per publisher.
#[derive(Debug, Clone, PartialEq)]
pub enum IntakeEvent {
    /// A batch to apply.
    Batch(WorkerEvents),
    /// With [`IntakeConfig::warm_start`]: the publisher's stream is now complete from what it
    /// still buffers (the start-up replay finished), or from its first live batch when it has
    /// no replay socket or its replay did not answer. Until then, what the sink holds for it
    /// is partial; after a `Reset` for a gap or an unreadable batch it is partial again until
    /// the next `Warm`.
    Warm {
        /// The publisher.
        key: PublisherKey,
        /// Batches the start-up replay delivered.
        replayed: u64,
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
    /// Take one batch or reset (in sequence order per publisher).
    fn deliver(&mut self, event: IntakeEvent);

    /// Called after every round of the event thread (each poll wake-up, each idle timeout):
    /// the moment to make what was delivered visible at once (an index publishes here, so a
    /// burst of batches costs one publication, and the last batch of a burst never waits for
    /// the next one).
    fn flush(&mut self) {}

    /// A copy of everything held, for a sibling gateway starting up (`--kv-bootstrap-peer`),
    /// with the last batch applied of each publisher, sent on `reply` (`None` when this sink
    /// keeps no copy). The sink may finish it on another thread: only taking the copy has to
    /// happen here, between two batches.
    fn export(&mut self, watermarks: &[(PublisherKey, i64)], reply: Sender<Option<Vec<u8>>>) {
        let _ = (watermarks, reply.try_send(None));
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

/// A channel sink: a bounded channel makes the event thread wait for its consumer (events then
/// queue in libzmq up to the high-water mark, and what overflows comes back through replay).
impl EventSink for Sender<IntakeEvent> {
    fn deliver(&mut self, event: IntakeEvent) {
        // A consumer that went away wants nothing more.
        let _ = self.send(event);
    }
}

/// The intake's limits.
#[derive(Debug, Clone)]
pub struct IntakeConfig {
    /// Longest a whole gap fill may take (the event thread waits for it; other publishers'
    /// messages queue in libzmq meanwhile).
    pub replay_timeout: Duration,
    /// Largest gap asked from a replay socket; a larger one resets (SGLang buffers 10 000).
    pub max_replay_batches: u64,
    /// Messages libzmq queues per SUB socket before it drops (then replay fills the gap).
    pub rcv_hwm: i32,
    /// How often an idle thread looks at its commands.
    pub poll_interval: Duration,
    /// Longest pause between reconnects to a publisher that is down.
    pub reconnect_max: Duration,
    /// Messages taken from one publisher before the next gets a turn.
    pub batch_per_turn: usize,
    /// Silence after which a publisher's replay socket is asked once for anything newer than
    /// the last batch: a loss at the end of a burst shows no gap until the next batch, which
    /// may be long in coming.
    pub idle_catch_up: Duration,
    /// Start every subscription with a replay of everything the publisher still buffers
    /// (`[b"", 0]`: SGLang answers from its oldest buffered batch), so a new gateway copy
    /// knows the blocks cached before it started, and report [`IntakeEvent::Warm`].
    pub warm_start: bool,
}

impl Default for IntakeConfig {
    fn default() -> Self {
        IntakeConfig {
            replay_timeout: Duration::from_secs(5),
            max_replay_batches: 10_000,
            rcv_hwm: 100_000,
            poll_interval: Duration::from_millis(50),
            reconnect_max: Duration::from_secs(5),
            batch_per_turn: 256,
            idle_catch_up: Duration::from_secs(1),
            warm_start: false,
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
    /// Messages or batches that could not be read.
    pub malformed: u64,
    /// Events skipped inside readable batches.
    pub skipped_events: u64,
    /// Sequence gaps seen.
    pub gaps: u64,
    /// Resets delivered.
    pub resets: u64,
}

/// The counter kinds, as the metric labels them.
const KINDS: [&str; 7] = [
    "batch",
    "event",
    "replayed_batch",
    "malformed",
    "skipped_event",
    "gap",
    "reset",
];

#[derive(Default)]
struct Stats([AtomicU64; 7]);

impl Stats {
    fn add(&self, kind: usize, n: u64) {
        if n > 0 {
            self.0[kind].fetch_add(n, Ordering::Relaxed);
            crate::metrics::kv_events(KINDS[kind], n);
        }
    }
    fn counts(&self) -> IntakeCounts {
        let g = |i: usize| self.0[i].load(Ordering::Relaxed);
        IntakeCounts {
            batches: g(BATCH),
            events: g(EVENT),
            replayed_batches: g(REPLAYED),
            malformed: g(MALFORMED),
            skipped_events: g(SKIPPED),
            gaps: g(GAP),
            resets: g(RESET),
        }
    }
}

const BATCH: usize = 0;
const EVENT: usize = 1;
const REPLAYED: usize = 2;
const MALFORMED: usize = 3;
const SKIPPED: usize = 4;
const GAP: usize = 5;
const RESET: usize = 6;

/// What one sequence number means for a publisher's stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqStep {
    /// The first batch seen since subscribing: the stream starts here.
    First,
    /// The next batch.
    Next,
    /// Batches `from..to` (to exclusive: the batch at hand) were missed.
    Gap {
        /// First missing sequence number.
        from: i64,
        /// The batch at hand.
        to: i64,
    },
    /// A live batch already delivered from the replay socket (an idle catch-up read ahead of
    /// the live queue): drop it.
    Duplicate,
    /// The number went back (or repeated) past anything replayed: a new server process.
    Restart,
}

/// The last sequence numbers accepted from one publisher (pure, so the rules test alone).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SeqTracker {
    /// Last delivered, live or replayed.
    last: Option<i64>,
    /// Last delivered from the live stream: live numbers in `(live, last]` were replayed
    /// already; a number at or below `live` can only come from a restarted server.
    live: Option<i64>,
}

impl SeqTracker {
    /// Classify a live `seq` against what was delivered.
    pub fn step(&self, seq: i64) -> SeqStep {
        match self.last {
            None => SeqStep::First,
            Some(last) if seq == last.saturating_add(1) => SeqStep::Next,
            Some(last) if seq > last => SeqStep::Gap {
                from: last + 1,
                to: seq,
            },
            Some(_) if self.live.is_some_and(|l| seq > l) => SeqStep::Duplicate,
            Some(_) => SeqStep::Restart,
        }
    }

    /// A live `seq` was delivered (or made the new start after a reset).
    pub fn accept(&mut self, seq: i64) {
        self.last = Some(seq);
        self.live = Some(seq);
    }

    /// A replayed `seq` was delivered.
    pub fn accept_replayed(&mut self, seq: i64) {
        self.last = Some(seq);
    }

    /// A start-up replay delivered `first..=last`: the live stream continues after `last`, and
    /// live numbers in `first..=last` queued meanwhile are duplicates, not a restart.
    pub fn warm_started(&mut self, first: i64, last: i64) {
        self.last = Some(last);
        self.live = Some(first.saturating_sub(1));
    }

    /// The last delivered number.
    pub fn last(&self) -> Option<i64> {
        self.last
    }
}

/// Why a replay exchange stopped short.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ReplayError {
    /// The server did not answer in time (down, or not running a replay socket): no evidence
    /// of a hole by itself.
    Silent(String),
    /// Batches that were published are no longer buffered, or could not be read: a hole.
    Hole(String),
}

enum Command {
    Export(Sender<Option<Vec<u8>>>),
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
    /// The command queue is full (the thread is busy, e.g. in a long replay); try again later.
    Busy,
    /// The event thread has stopped.
    Stopped,
}

/// Commands queued at most (worker changes are rare; a full queue answers `Busy`, never blocks).
const COMMAND_QUEUE: usize = 1024;
/// Frames kept of one message: a live message has 3, a replay reply 3; a 4th marks "too many"
/// (the rest are received and dropped, so a many-frame message cannot grow memory).
const MAX_FRAMES: usize = 4;

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
        let worker = EventThread {
            ctx: zmq::Context::new(),
            config,
            sink,
            stats: stats.clone(),
            subs: Vec::new(),
            commands: rx,
            resume: std::collections::HashMap::new(),
            last_warn: None,
        };
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
    /// event thread may be busy; the caller decides how long to wait).
    pub fn export(&self) -> Result<Receiver<Option<Vec<u8>>>, CommandError> {
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

    /// What the intake has done so far.
    pub fn counts(&self) -> IntakeCounts {
        self.stats.counts()
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

/// One subscription's sockets and stream state.
struct Sub {
    publisher: Publisher,
    live: zmq::Socket,
    /// Connected ahead of need; replaced after every use, so replies to an abandoned request
    /// (sent to the old identity) are dropped by the server instead of read as new ones.
    replay: Option<zmq::Socket>,
    seq: SeqTracker,
    /// When the last live message arrived, and whether the idle catch-up has run since.
    last_live: Instant,
    caught_up: bool,
    /// With `warm_start`: `Warm` not reported since the subscription or the last lossy reset.
    cold: bool,
    /// A start-up replay is due (at subscription, and again after a lossy reset).
    rewarm: bool,
    /// The stream resumes after an imported copy's watermark: the start-up replay asks for
    /// what follows it, not for the whole buffer.
    resumed: bool,
}

struct EventThread<S> {
    ctx: zmq::Context,
    config: IntakeConfig,
    sink: S,
    stats: Arc<Stats>,
    subs: Vec<Sub>,
    commands: Receiver<Command>,
    /// Watermarks of an imported copy, for publishers not subscribed yet.
    resume: std::collections::HashMap<PublisherKey, i64>,
    /// Warnings are rate-limited (a hostile publisher could otherwise flood the log).
    last_warn: Option<Instant>,
}

impl<S: EventSink> EventThread<S> {
    fn run(mut self) {
        let poll_ms = self.config.poll_interval.as_millis().max(1) as i64;
        loop {
            loop {
                match self.commands.try_recv() {
                    Ok(Command::Shutdown) | Err(TryRecvError::Disconnected) => return,
                    Ok(c) => self.apply(c),
                    Err(TryRecvError::Empty) => break,
                }
            }
            if self.subs.is_empty() {
                match self.commands.recv_timeout(self.config.poll_interval) {
                    Ok(Command::Shutdown) | Err(RecvTimeoutError::Disconnected) => return,
                    Ok(c) => self.apply(c),
                    Err(RecvTimeoutError::Timeout) => {}
                }
                self.sink.flush();
                continue;
            }
            let ready: Vec<usize> = {
                let mut items: Vec<zmq::PollItem> = self
                    .subs
                    .iter()
                    .map(|s| s.live.as_poll_item(zmq::POLLIN))
                    .collect();
                if let Err(e) = zmq::poll(&mut items, poll_ms) {
                    self.warn(format_args!("kv events: poll failed: {e}"));
                    std::thread::sleep(self.config.poll_interval);
                    continue;
                }
                (0..items.len())
                    .filter(|&i| items[i].is_readable())
                    .collect()
            };
            for i in ready {
                self.drain(i);
            }
            self.catch_up_idle();
            self.sink.flush();
        }
    }

    fn apply(&mut self, c: Command) {
        match c {
            Command::Subscribe(p) => {
                if let Some(i) = self.subs.iter().position(|s| s.publisher.key == p.key) {
                    if self.subs[i].publisher == p {
                        return;
                    }
                    self.drop_sub(i);
                }
                match self.open(p.clone()) {
                    Ok(sub) => {
                        crate::log!(
                            Info,
                            "kv events: worker {} rank {} subscribed to {}{}",
                            p.key.worker,
                            p.key.dp_rank,
                            p.live.url(),
                            p.replay
                                .as_ref()
                                .map(|r| format!(" (replay {})", r.url()))
                                .unwrap_or_default()
                        );
                        self.subs.push(sub);
                        if self.config.warm_start {
                            self.warm_up(self.subs.len() - 1);
                        }
                    }
                    Err(e) => self.warn(format_args!(
                        "kv events: cannot subscribe to {}: {e}",
                        p.live.url()
                    )),
                }
            }
            Command::Unsubscribe(key) => {
                if let Some(i) = self.subs.iter().position(|s| s.publisher.key == key) {
                    self.drop_sub(i);
                }
            }
            Command::RemoveWorker(w) => {
                while let Some(i) = self.subs.iter().position(|s| s.publisher.key.worker == w) {
                    self.drop_sub(i);
                }
            }
            Command::Export(reply) => {
                let marks: Vec<(PublisherKey, i64)> = self
                    .subs
                    .iter()
                    .filter_map(|s| Some((s.publisher.key, s.seq.last()?)))
                    .collect();
                self.sink.export(&marks, reply);
            }
            Command::Import {
                data,
                workers,
                reply,
            } => {
                let r = self.sink.import(&data, &workers).map(|marks| {
                    let n = marks.len();
                    for (key, seq) in marks {
                        match self.subs.iter().position(|s| s.publisher.key == key) {
                            // Already streaming: what it applied and the copy overlap; the
                            // stream goes on as it was.
                            Some(_) => {}
                            None => {
                                self.resume.insert(key, seq);
                            }
                        }
                    }
                    n
                });
                let _ = reply.try_send(r);
            }
            Command::Shutdown => {}
        }
    }

    fn drop_sub(&mut self, i: usize) {
        let sub = self.subs.swap_remove(i);
        self.reset(sub.publisher.key, ResetReason::Unsubscribed);
    }

    fn open(&mut self, p: Publisher) -> zmq::Result<Sub> {
        let mut seq = SeqTracker::default();
        let resumed = match self.resume.remove(&p.key) {
            Some(after) => {
                seq.accept(after);
                true
            }
            None => false,
        };
        let live = self.ctx.socket(zmq::SUB)?;
        self.prepare(&live, &p.live)?;
        live.set_rcvhwm(self.config.rcv_hwm)?;
        live.set_subscribe(b"")?;
        live.connect(&p.live.url())?;
        let replay = match &p.replay {
            Some(r) => Some(self.dealer(r)?),
            None => None,
        };
        Ok(Sub {
            publisher: p,
            live,
            replay,
            seq,
            last_live: Instant::now(),
            caught_up: true,
            cold: self.config.warm_start,
            rewarm: false,
            resumed,
        })
    }

    /// Options both socket kinds share: no linger on close, the payload cap enforced by libzmq
    /// (a larger frame drops the connection before it is buffered), reconnect backoff, and TCP
    /// keepalive so a peer that vanished without a FIN is noticed and redialled (about 25 s).
    ///
    /// Not ZMTP heartbeats (`ZMQ_HEARTBEAT_IVL`): with them, a SUB whose queue is full (input
    /// stopped by the high-water mark) misses the PINGs, drops a healthy connection, and libzmq
    /// 4.3.4 then aborts the process on `Assertion failed: _input_stopped`
    /// (stream_engine_base.cpp; libzmq issues #3937, #4767). The flood test hit exactly that.
    fn prepare(&self, s: &zmq::Socket, ep: &TcpEndpoint) -> zmq::Result<()> {
        s.set_linger(0)?;
        s.set_maxmsgsize(wire::MAX_PAYLOAD_BYTES as i64)?;
        s.set_reconnect_ivl(100)?;
        s.set_reconnect_ivl_max(self.config.reconnect_max.as_millis().min(i32::MAX as u128) as i32)?;
        s.set_tcp_keepalive(1)?;
        s.set_tcp_keepalive_idle(10)?;
        s.set_tcp_keepalive_intvl(5)?;
        s.set_tcp_keepalive_cnt(3)?;
        if ep.is_ipv6() {
            s.set_ipv6(true)?;
        }
        Ok(())
    }

    fn dealer(&self, ep: &TcpEndpoint) -> zmq::Result<zmq::Socket> {
        let s = self.ctx.socket(zmq::DEALER)?;
        self.prepare(&s, ep)?;
        s.set_sndhwm(16)?;
        s.connect(&ep.url())?;
        Ok(s)
    }

    /// Take up to `batch_per_turn` waiting messages of subscription `i`.
    fn drain(&mut self, i: usize) {
        for _ in 0..self.config.batch_per_turn {
            match recv_frames(&self.subs[i].live, zmq::DONTWAIT) {
                Ok(Some(frames)) => self.on_live(i, &frames),
                Ok(None) => return,
                Err(e) => {
                    self.warn(format_args!("kv events: receive failed: {e}"));
                    return;
                }
            }
        }
    }

    fn on_live(&mut self, i: usize, frames: &[zmq::Message]) {
        let refs: Vec<&[u8]> = frames.iter().map(|m| &m[..]).collect();
        let key = self.subs[i].publisher.key;
        self.subs[i].last_live = Instant::now();
        self.subs[i].caught_up = false;
        let msg = match wire::split_live(&refs) {
            Ok(m) if m.seq >= 0 => m,
            Ok(m) => return self.malformed(key, &format!("negative sequence {}", m.seq)),
            Err(e) => return self.malformed(key, &e.to_string()),
        };
        let decoded = wire::decode_batch(msg.payload);
        match self.subs[i].seq.step(msg.seq) {
            SeqStep::First | SeqStep::Next => {}
            SeqStep::Gap { from, to } => self.fill_gap(i, from, to),
            SeqStep::Duplicate => return,
            SeqStep::Restart => self.reset(key, ResetReason::Restarted),
        }
        self.subs[i].seq.accept(msg.seq);
        match decoded {
            Ok(batch) => {
                self.deliver(key, msg.seq, batch, false);
                if self.subs[i].cold && !self.subs[i].rewarm {
                    // No replay to wait for: the stream is complete from here on.
                    self.mark_warm(i, 0);
                }
            }
            Err(e) => {
                self.malformed(key, &e.to_string());
                self.reset(key, ResetReason::Unreadable);
            }
        }
    }

    /// Batches `from..to` are missing: replay them, or reset the publisher.
    fn fill_gap(&mut self, i: usize, from: i64, to: i64) {
        self.stats.add(GAP, 1);
        let key = self.subs[i].publisher.key;
        let outcome = if self.subs[i].publisher.replay.is_none() {
            Err("no replay endpoint".to_string())
        } else if (to - from) as u64 > self.config.max_replay_batches {
            Err(format!(
                "{} batches missing, over the replay limit",
                to - from
            ))
        } else {
            match self.replay(i, from, Some(to)) {
                Ok(_) => Ok(()),
                Err(ReplayError::Silent(why) | ReplayError::Hole(why)) => Err(why),
            }
        };
        if let Err(why) = outcome {
            self.warn(format_args!(
                "kv events: worker {} rank {}: batches {from}..{to} missed ({why}); resetting",
                key.worker, key.dp_rank
            ));
            self.reset(key, ResetReason::Gap);
        }
    }

    /// Publishers silent for `idle_catch_up` since their last live batch are asked once for
    /// anything after it (batches lost at the end of a burst).
    fn catch_up_idle(&mut self) {
        let now = Instant::now();
        for i in 0..self.subs.len() {
            if self.subs[i].rewarm
                && now.duration_since(self.subs[i].last_live) >= self.config.idle_catch_up
            {
                self.warm_up(i);
                continue;
            }
            let sub = &self.subs[i];
            if sub.caught_up
                || sub.replay.is_none()
                || now.duration_since(sub.last_live) < self.config.idle_catch_up
            {
                continue;
            }
            self.subs[i].caught_up = true;
            let Some(last) = self.subs[i].seq.last() else {
                continue;
            };
            let key = self.subs[i].publisher.key;
            match self.replay(i, last + 1, None) {
                Ok(0) => {}
                Ok(n) => {
                    crate::log!(
                        Debug,
                        "kv events: worker {} rank {}: {n} batches lost at the end of a burst, \
                         replayed",
                        key.worker,
                        key.dp_rank
                    );
                }
                // No answer is no evidence of a hole (the live stream will show one if any).
                Err(ReplayError::Silent(why)) => crate::log!(
                    Debug,
                    "kv events: worker {} rank {}: idle catch-up: {why}",
                    key.worker,
                    key.dp_rank
                ),
                Err(ReplayError::Hole(why)) => {
                    self.warn(format_args!(
                        "kv events: worker {} rank {}: batches after {last} missed ({why}); \
                         resetting",
                        key.worker, key.dp_rank
                    ));
                    self.reset(key, ResetReason::Gap);
                }
            }
        }
    }

    /// Ask the replay socket for every batch from `from` on and deliver them in order as they
    /// arrive: up to `to` (exclusive) for a gap, or up to the end marker when `to` is `None`
    /// (at most `max_replay_batches`). Returns how many were delivered. An error after some
    /// were delivered is fine: the caller resets, which drops them too. The socket is replaced
    /// afterwards, so replies still in flight go to a dead identity instead of the next
    /// request.
    fn replay(&mut self, i: usize, from: i64, to: Option<i64>) -> Result<u64, ReplayError> {
        let result = self.replay_on_socket(i, from, to, false);
        self.fresh_dealer(i);
        result
    }

    /// Replace subscription `i`'s replay socket (see [`Self::replay`]).
    fn fresh_dealer(&mut self, i: usize) {
        let fresh = match &self.subs[i].publisher.replay {
            Some(ep) => self.dealer(ep).ok(),
            None => None,
        };
        self.subs[i].replay = fresh;
    }

    /// The start-up replay of subscription `i`: everything its publisher still buffers, from
    /// whichever batch the buffer starts at. A replay that does not answer leaves the
    /// subscription cold until its first live batch; one that breaks off resets and tries
    /// again after the next quiet `idle_catch_up`.
    fn warm_up(&mut self, i: usize) {
        let key = self.subs[i].publisher.key;
        self.subs[i].rewarm = false;
        self.subs[i].caught_up = true;
        if self.subs[i].replay.is_none() {
            return; // Warm with the first live batch.
        }
        let resumed = std::mem::take(&mut self.subs[i].resumed);
        let from = match self.subs[i].seq.last() {
            Some(l) if resumed => l + 1,
            _ => 0,
        };
        let result = self.replay_on_socket(i, from, None, !resumed);
        self.fresh_dealer(i);
        match result {
            Ok(n) => {
                if n > 0 && !resumed {
                    if let Some(last) = self.subs[i].seq.last() {
                        self.subs[i].seq.warm_started(last - n as i64 + 1, last);
                    }
                }
                self.mark_warm(i, n);
            }
            Err(ReplayError::Silent(why)) => crate::log!(
                Debug,
                "kv events: worker {} rank {}: start-up replay from {from}: {why}",
                key.worker,
                key.dp_rank
            ),
            Err(ReplayError::Hole(why)) => {
                self.warn(format_args!(
                    "kv events: worker {} rank {}: start-up replay broke off ({why}); resetting",
                    key.worker, key.dp_rank
                ));
                self.reset(key, ResetReason::Gap);
            }
        }
    }

    fn mark_warm(&mut self, i: usize, replayed: u64) {
        if !self.subs[i].cold {
            return;
        }
        self.subs[i].cold = false;
        let key = self.subs[i].publisher.key;
        self.sink.deliver(IntakeEvent::Warm { key, replayed });
    }

    /// `anywhere`: the first batch may come later than `from` (a start-up replay takes the
    /// buffer from wherever it starts).
    fn replay_on_socket(
        &mut self,
        i: usize,
        from: i64,
        to: Option<i64>,
        anywhere: bool,
    ) -> Result<u64, ReplayError> {
        use ReplayError::{Hole, Silent};
        let key = self.subs[i].publisher.key;
        let deadline = Instant::now() + self.config.replay_timeout;
        let limit = self.config.max_replay_batches;
        {
            let Some(sock) = self.subs[i].replay.as_ref() else {
                return Err(Silent("replay socket unavailable".into()));
            };
            let [start] = wire::replay_request(from);
            sock.send(&b""[..], zmq::SNDMORE | zmq::DONTWAIT)
                .and_then(|_| sock.send(&start[..], zmq::DONTWAIT))
                .map_err(|e| Silent(format!("replay request not sent: {e}")))?;
        }
        let mut next = from;
        let mut delivered = 0u64;
        // A catch-up (no `to`) finds a gap only when something comes back: count it then,
        // before the first batch is handed on.
        let found = |this: &Self, delivered: u64| {
            if to.is_none() && delivered == 0 {
                this.stats.add(GAP, 1);
            }
        };
        while to.is_none_or(|to| next < to) && delivered < limit {
            let left = deadline.saturating_duration_since(Instant::now());
            let sock = self.subs[i].replay.as_ref().expect("checked above");
            let ready = sock
                .poll(zmq::POLLIN, left.as_millis() as i64)
                .map_err(|e| Silent(format!("replay poll: {e}")))?;
            if ready == 0 {
                return Err(Silent(format!("replay timed out waiting for {next}")));
            }
            let frames = match recv_frames(sock, zmq::DONTWAIT) {
                Ok(Some(f)) => f,
                Ok(None) => continue,
                Err(e) => return Err(Silent(format!("replay receive: {e}"))),
            };
            let refs: Vec<&[u8]> = frames.iter().map(|m| &m[..]).collect();
            match wire::split_replay(&refs) {
                Err(e) => {
                    found(self, delivered);
                    self.malformed(key, &e.to_string());
                    return Err(Hole(format!("malformed replay reply: {e}")));
                }
                Ok(ReplayReply::End) if to.is_none() => break,
                Ok(ReplayReply::End) => {
                    return Err(Hole(format!("the replay buffer ended before {next}")));
                }
                Ok(ReplayReply::Batch { seq, .. }) if seq < next => {}
                Ok(ReplayReply::Batch { seq, .. })
                    if seq > next && !(anywhere && delivered == 0) =>
                {
                    found(self, delivered);
                    return Err(Hole(format!(
                        "{next} is no longer buffered (replay starts at {seq})"
                    )));
                }
                Ok(ReplayReply::Batch { seq, payload }) => {
                    if !anywhere {
                        found(self, delivered);
                    }
                    next = seq;
                    match wire::decode_batch(payload) {
                        Ok(batch) if batch.skipped.lossy == 0 => {
                            self.deliver(key, seq, batch, true);
                            self.subs[i].seq.accept_replayed(seq);
                            next += 1;
                            delivered += 1;
                        }
                        Ok(_) => return Err(Hole(format!("replayed batch {seq} lost a removal"))),
                        Err(e) => {
                            self.malformed(key, &e.to_string());
                            return Err(Hole(format!("replayed batch {seq}: {e}")));
                        }
                    }
                }
            }
        }
        Ok(delivered)
    }

    fn deliver(&mut self, key: PublisherKey, seq: i64, batch: EventBatch, replayed: bool) {
        let skipped = batch.skipped;
        self.stats.add(SKIPPED, u64::from(skipped.total()));
        if skipped.lossy > 0 {
            // A removal may be missing: what the index holds for this worker is no longer true.
            self.reset(key, ResetReason::Unreadable);
            return;
        }
        self.stats.add(BATCH, 1);
        self.stats.add(EVENT, batch.events.len() as u64);
        if replayed {
            self.stats.add(REPLAYED, 1);
        }
        self.sink.deliver(IntakeEvent::Batch(WorkerEvents {
            key,
            seq,
            ts: batch.ts,
            events: batch.events,
            replayed,
        }));
    }

    fn reset(&mut self, key: PublisherKey, reason: ResetReason) {
        self.stats.add(RESET, 1);
        if self.config.warm_start && matches!(reason, ResetReason::Gap | ResetReason::Unreadable) {
            // What the sink held is gone: rebuild it from the replay buffer once things calm.
            if let Some(sub) = self.subs.iter_mut().find(|s| s.publisher.key == key) {
                sub.cold = true;
                sub.rewarm = sub.replay.is_some();
            }
        }
        if reason != ResetReason::Unsubscribed {
            self.warn(format_args!(
                "kv events: worker {} rank {} reset ({})",
                key.worker,
                key.dp_rank,
                reason.as_str()
            ));
        }
        self.sink.deliver(IntakeEvent::Reset { key, reason });
    }

    fn malformed(&mut self, key: PublisherKey, why: &str) {
        self.stats.add(MALFORMED, 1);
        self.warn(format_args!(
            "kv events: worker {} rank {}: malformed message skipped: {why}",
            key.worker, key.dp_rank
        ));
    }

    /// At most one warning a second; the rest go to the debug level.
    fn warn(&mut self, args: std::fmt::Arguments<'_>) {
        let now = Instant::now();
        if self
            .last_warn
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1))
        {
            self.last_warn = Some(now);
            crate::log!(Warn, "{args}");
        } else {
            crate::log!(Debug, "{args}");
        }
    }
}

/// Receive one whole message (`None`: nothing waiting). At most [`MAX_FRAMES`] frames are kept;
/// further frames of the same message are received and dropped.
fn recv_frames(sock: &zmq::Socket, flags: i32) -> zmq::Result<Option<Vec<zmq::Message>>> {
    let mut first = zmq::Message::new();
    match sock.recv(&mut first, flags) {
        Ok(()) => {}
        Err(zmq::Error::EAGAIN) => return Ok(None),
        Err(e) => return Err(e),
    }
    let mut frames = vec![first];
    while sock.get_rcvmore()? {
        // The rest of a multipart message has arrived with its first frame.
        let mut m = zmq::Message::new();
        sock.recv(&mut m, 0)?;
        if frames.len() < MAX_FRAMES {
            frames.push(m);
        }
    }
    Ok(Some(frames))
}

#[cfg(test)]
mod tests;
