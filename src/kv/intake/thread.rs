//! A reader thread's loop: commands, name lookups, connections, replays, one epoll wait over
//! every socket, and each publisher's `stream` machine fed from them. Every wait has a
//! deadline and nothing here blocks on one publisher.

use super::stream::{Purpose, Reply, Step, Stream};
use super::watch::Watch;
use super::{
    Command, EventSink, IntakeConfig, IntakeEvent, Publisher, PublisherKey, ResetReason,
    SourceState, Stats, WorkerEvents, BATCH, CONNECT_FAILED, EVENT, GAP, MALFORMED, REPLAY,
    REPLAYED, REPLAY_FAILED, RESET, SKIPPED,
};
use crate::kv::endpoint::TcpEndpoint;
use crate::kv::resolve::Resolver;
use crate::kv::socket::{Budget, Conn, ConnError, Timeouts, READ_CHUNK};
use crate::kv::wire::{self, ReplayReply, MAX_PAYLOAD_BYTES};
use crate::kv::zmtp::{Item, Limits, SocketType};
use bytes::Bytes;
use crossbeam::channel::{Receiver, TryRecvError};
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Frames one message may have: a live message 3, a replay reply 4 (SGLang 0.5.23's form).
const MAX_FRAMES: usize = 4;
/// Bytes of one command frame accepted (READY metadata, PING).
const MAX_COMMAND_BYTES: usize = 64 << 10;
/// A message is its payload plus small frames (topic, sequence number).
const MAX_MESSAGE_BYTES: usize = MAX_PAYLOAD_BYTES + (64 << 10);
/// Pause after an own failure (no descriptor, no lookup slot) before trying again.
const LOCAL_RETRY: Duration = Duration::from_millis(200);
/// State-change log lines of one publisher at the info level at most this often.
const LOG_EVERY: Duration = Duration::from_secs(10);
/// Longest between two passes over every publisher (timers, buffered messages, state reports).
const SWEEP_EVERY: Duration = Duration::from_millis(5);
/// Time given a subscription to reach the publisher before the replay that follows it is
/// asked (what the PUB sends before it arrives is dropped; the replay must cover that).
const SUBSCRIPTION_SETTLE: Duration = Duration::from_millis(50);

fn limits() -> Limits {
    Limits {
        max_frames: MAX_FRAMES,
        max_message_bytes: MAX_MESSAGE_BYTES,
        max_command_bytes: MAX_COMMAND_BYTES,
    }
}

/// How a socket is being reached.
enum Link {
    /// Not connected; try at `at`.
    Idle { at: Instant },
    /// A name lookup runs (its answer is ignored after `until`).
    Resolving { until: Instant },
    /// Connecting, greeting, or open (boxed: a connection is several times an idle link).
    Open(Box<Conn>),
}

/// The connection of a replay under way.
struct ReplayLink {
    link: Link,
    /// No answer by then: the replay failed (each reply moves it).
    deadline: Instant,
}

/// One subscription.
struct Source {
    publisher: Publisher,
    /// Tells this subscription's lookups apart from any other's (never reused).
    token: u64,
    stream: Stream,
    live: Link,
    /// Live connection failures since the last batch delivered (the reconnect backoff: a
    /// handshake alone does not restart it).
    failures: u32,
    replay: Option<ReplayLink>,
    /// Waiting in the replay queue.
    queued: bool,
    /// Its replay is not asked before this (a subscription settling).
    replay_after: Instant,
    state: Option<SourceState>,
    last_logged: Option<Instant>,
}

impl Source {
    fn live_open(&self) -> bool {
        matches!(&self.live, Link::Open(c) if c.is_ready())
    }

    fn state(&self) -> SourceState {
        if self.stream.is_replaying() {
            SourceState::Replaying
        } else if !self.live_open() {
            SourceState::Connecting
        } else if !self.stream.is_complete() {
            SourceState::Partial
        } else {
            SourceState::Live
        }
    }
}

pub(super) struct EventThread<S> {
    config: IntakeConfig,
    sink: S,
    stats: Arc<Stats>,
    commands: Receiver<Command>,
    sources: Vec<Source>,
    /// Sources whose stream wants a replay, in the order they asked.
    queue: VecDeque<u64>,
    /// Replays whose connection is up or being made.
    replays: usize,
    next_token: u64,
    resolver: Resolver,
    budget: Budget,
    scratch: Vec<u8>,
    /// Watermarks of an imported copy, for publishers not subscribed yet.
    resume: HashMap<PublisherKey, i64>,
    /// Warnings are rate-limited (a hostile publisher could otherwise flood the log).
    last_warn: Option<Instant>,
    steps: Vec<Step>,
    /// Each subscription's token, by publisher.
    by_key: HashMap<PublisherKey, u64>,
    /// Each subscription's place in `sources`, by token.
    slots: HashMap<u64, usize>,
    /// Bytes this reader counted in `Stats::held` (the readers add up there).
    held: usize,
    /// Some stream may hold messages already read (a turn ran out, or a replay ended): taken
    /// next round, not at the next sweep.
    drain_wanted: bool,
    /// The epoll set of every open socket.
    watch: Watch,
    /// Sources whose sockets may want other events than the set watches (synced before the
    /// next wait; every source is at each sweep).
    touched: Vec<usize>,
    /// Ready sockets of the last wait: (tag, events).
    ready: Vec<(u64, i16)>,
    /// The connections' budget was spent at the last sync.
    budget_over: bool,
}

/// Which socket of a source a poll entry is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Which {
    Live,
    Replay,
}

impl<S: EventSink> EventThread<S> {
    pub(super) fn new(
        config: IntakeConfig,
        sink: S,
        stats: Arc<Stats>,
        commands: Receiver<Command>,
    ) -> std::io::Result<Self> {
        let budget = Budget::new(config.budget_bytes);
        let watch = Watch::new()?;
        Ok(EventThread {
            config,
            sink,
            stats,
            commands,
            sources: Vec::new(),
            queue: VecDeque::new(),
            replays: 0,
            next_token: 1,
            resolver: Resolver::default(),
            budget,
            scratch: vec![0u8; READ_CHUNK],
            resume: HashMap::new(),
            last_warn: None,
            steps: Vec::new(),
            by_key: HashMap::new(),
            slots: HashMap::new(),
            held: 0,
            drain_wanted: false,
            watch,
            touched: Vec::new(),
            ready: Vec::new(),
            budget_over: false,
        })
    }

    pub(super) fn run(mut self) {
        let mut next_sweep = Instant::now();
        // Something happened since the last state report.
        let mut unreported = true;
        loop {
            if !self.take_commands() {
                break;
            }
            let now = Instant::now();
            self.lookups_answered(now);
            // Timers, buffered messages and state reports take a pass over every publisher: at
            // most every SWEEP_EVERY (their deadlines are tens of milliseconds and more), not
            // every round, which with thousands of publishers would cost more than the messages.
            let sweep = now >= next_sweep;
            if sweep {
                self.due(now);
            }
            self.start_replays(now);
            let busy = if sweep || std::mem::take(&mut self.drain_wanted) {
                self.drain_buffered()
            } else {
                false
            };
            self.drain_wanted |= busy;
            let cap = if unreported {
                next_sweep.saturating_duration_since(now)
            } else {
                self.config.poll_interval
            };
            unreported |= self.poll_round(busy || self.drain_wanted, cap) || sweep;
            if sweep {
                self.report_states();
                // Whatever changed without a socket event (timers, commands, replays) is
                // watched for at the latest now.
                self.touched.extend(0..self.sources.len());
                unreported = false;
                next_sweep = Instant::now() + SWEEP_EVERY;
            }
            self.sink.flush();
            if self.budget.take_released() {
                crate::base::memory::return_freed_pages();
            }
            let used = self.budget.used();
            if used >= self.held {
                self.stats
                    .held
                    .fetch_add((used - self.held) as u64, Ordering::Relaxed);
            } else {
                self.stats
                    .held
                    .fetch_sub((self.held - used) as u64, Ordering::Relaxed);
            }
            self.held = used;
            self.stats.rounds.fetch_add(1, Ordering::Relaxed);
        }
        let all: Vec<u64> = self.sources.iter().map(|s| s.token).collect();
        for t in all {
            self.drop_source(t, false);
        }
    }

    /// Apply every queued command; false on shutdown.
    fn take_commands(&mut self) -> bool {
        loop {
            match self.commands.try_recv() {
                Ok(Command::Shutdown) | Err(TryRecvError::Disconnected) => return false,
                Ok(c) => self.apply(c),
                Err(TryRecvError::Empty) => return true,
            }
        }
    }

    fn apply(&mut self, c: Command) {
        match c {
            Command::Subscribe(p) => {
                if let Some(&t) = self.by_key.get(&p.key) {
                    if self
                        .index_of(t)
                        .is_some_and(|i| self.sources[i].publisher == p)
                    {
                        return;
                    }
                    self.drop_source(t, true);
                }
                self.add_source(p);
            }
            Command::Unsubscribe(key) => {
                if let Some(&t) = self.by_key.get(&key) {
                    self.drop_source(t, true);
                }
            }
            Command::RemoveWorker(w) => {
                let gone: Vec<u64> = self
                    .sources
                    .iter()
                    .filter(|s| s.publisher.key.worker == w)
                    .map(|s| s.token)
                    .collect();
                for t in gone {
                    self.drop_source(t, true);
                }
            }
            Command::Resume(marks) => {
                for (key, seq) in marks {
                    // A publisher already streaming goes on as it was (what it applied and the
                    // copy overlap).
                    if !self.by_key.contains_key(&key) {
                        self.resume.insert(key, seq);
                    }
                }
            }
            Command::Shutdown => {}
        }
    }

    fn index_of(&self, token: u64) -> Option<usize> {
        self.slots.get(&token).copied()
    }

    fn add_source(&mut self, p: Publisher) {
        let resume = self.resume.remove(&p.key);
        let stream = Stream::new(p.replay.is_some(), resume, self.config.max_replay_batches);
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
        let token = self.next_token;
        self.next_token += 1;
        self.by_key.insert(p.key, token);
        self.slots.insert(token, self.sources.len());
        self.sources.push(Source {
            publisher: p,
            token,
            stream,
            live: Link::Idle { at: Instant::now() },
            failures: 0,
            replay: None,
            queued: false,
            replay_after: Instant::now(),
            state: None,
            last_logged: None,
        });
        self.queue_if_wanted(self.sources.len() - 1);
    }

    /// Close a subscription's sockets and forget it (`reset`: tell the sink its blocks go).
    fn drop_source(&mut self, token: u64, reset: bool) {
        let Some(i) = self.index_of(token) else {
            return;
        };
        let s = self.sources.swap_remove(i);
        self.slots.remove(&token);
        self.by_key.remove(&s.publisher.key);
        if let Some(moved) = self.sources.get(i) {
            self.slots.insert(moved.token, i);
        }
        if let Link::Open(c) = s.live {
            c.close(&mut self.budget);
        }
        if let Some(r) = s.replay {
            self.replays -= 1;
            if let Link::Open(c) = r.link {
                c.close(&mut self.budget);
            }
        }
        self.queue.retain(|&t| t != token);
        if reset {
            self.stats.add(RESET, 1);
            self.sink.deliver(IntakeEvent::Reset {
                key: s.publisher.key,
                reason: ResetReason::Unsubscribed,
            });
        }
    }

    fn queue_if_wanted(&mut self, i: usize) {
        let s = &mut self.sources[i];
        if s.stream.wanted().is_some() && s.replay.is_none() && !s.queued {
            s.queued = true;
            self.queue.push_back(s.token);
        }
    }

    // ---- name lookups and (re)connects ------------------------------------------------------

    fn lookups_answered(&mut self, now: Instant) {
        for a in self.resolver.answers() {
            let which = if a.token & 1 == 0 {
                Which::Live
            } else {
                Which::Replay
            };
            let Some(i) = self.index_of(a.token >> 1) else {
                continue;
            };
            let waiting = match which {
                Which::Live => matches!(self.sources[i].live, Link::Resolving { .. }),
                Which::Replay => matches!(
                    self.sources[i].replay.as_ref().map(|r| &r.link),
                    Some(Link::Resolving { .. })
                ),
            };
            if !waiting {
                continue;
            }
            match a.result {
                Ok(addr) => self.connect(i, which, addr, now),
                Err(e) => self.link_failed(i, which, format!("cannot resolve: {e}"), now),
            }
        }
    }

    /// Start reaching `which` of source `i` (a lookup, or a connect for an IP literal).
    fn dial(&mut self, i: usize, which: Which, now: Instant) {
        let s = &self.sources[i];
        let ep: &TcpEndpoint = match which {
            Which::Live => &s.publisher.live,
            Which::Replay => match &s.publisher.replay {
                Some(r) => r,
                None => return,
            },
        };
        let token = s.token << 1 | u64::from(which == Which::Replay);
        let (host, port) = (ep.host.clone(), ep.port);
        match self.resolver.lookup(token, &host, port) {
            Ok(Some(addr)) => self.connect(i, which, addr, now),
            Ok(None) => {
                let until = now + self.config.resolve_timeout;
                self.set_link(i, which, Link::Resolving { until });
            }
            Err(_busy) => self.set_link(
                i,
                which,
                Link::Idle {
                    at: now + LOCAL_RETRY,
                },
            ),
        }
    }

    fn connect(&mut self, i: usize, which: Which, addr: SocketAddr, now: Instant) {
        let kind = match which {
            Which::Live => SocketType::Sub,
            Which::Replay => SocketType::Dealer,
        };
        let timeouts = Timeouts {
            handshake: self.config.handshake_timeout,
            message: self.config.message_timeout,
            send: self.config.send_timeout,
        };
        match Conn::connect(addr, kind, limits(), timeouts, &mut self.budget, now) {
            Ok(c) => self.set_link(i, which, Link::Open(Box::new(c))),
            Err(e) => self.link_failed(i, which, format!("cannot connect to {addr}: {e}"), now),
        }
    }

    fn set_link(&mut self, i: usize, which: Which, link: Link) {
        self.touched.push(i);
        let s = &mut self.sources[i];
        match which {
            Which::Live => s.live = link,
            Which::Replay => {
                if let Some(r) = &mut s.replay {
                    r.link = link;
                }
            }
        }
    }

    /// A connection of source `i` failed; a peer that broke the protocol or a cap is also
    /// counted as malformed, and one that would not read what we send as dropped for it (an
    /// operator tells a hostile publisher from one that is down).
    fn conn_failed(&mut self, i: usize, which: Which, e: &ConnError, now: Instant) {
        if let ConnError::Zmtp(_) = e {
            self.stats.add(MALFORMED, 1);
        }
        if let Some(reason) = e.send_drop_reason() {
            self.stats.send_dropped(reason);
        }
        self.link_failed(i, which, describe(e), now);
    }

    /// A socket of source `i` failed: the live one is retried after a backoff, a replay fails.
    fn link_failed(&mut self, i: usize, which: Which, why: String, now: Instant) {
        match which {
            Which::Live => {
                let s = &mut self.sources[i];
                if let Link::Open(c) = std::mem::replace(&mut s.live, Link::Idle { at: now }) {
                    c.close(&mut self.budget);
                }
                let s = &mut self.sources[i];
                s.failures = s.failures.saturating_add(1);
                let backoff = self
                    .config
                    .reconnect_min
                    .saturating_mul(1 << (s.failures - 1).min(16))
                    .min(self.config.reconnect_max);
                s.live = Link::Idle { at: now + backoff };
                let key = s.publisher.key;
                let url = s.publisher.live.url();
                self.stats.add(CONNECT_FAILED, 1);
                self.warn(format_args!(
                    "kv events: worker {} rank {}: {url}: {why}; retrying in {} ms",
                    key.worker,
                    key.dp_rank,
                    backoff.as_millis()
                ));
            }
            Which::Replay => {
                let mut steps = std::mem::take(&mut self.steps);
                self.sources[i].stream.failed(why, &mut steps);
                self.run_steps(i, &mut steps);
                self.steps = steps;
            }
        }
    }

    /// Reconnects that are due, lookups and replays past their deadline, slow connections.
    fn due(&mut self, now: Instant) {
        let mut i = 0;
        while i < self.sources.len() {
            let token = self.sources[i].token;
            let replaying = self.sources[i].stream.is_replaying();
            match &mut self.sources[i].live {
                Link::Idle { at } if *at <= now => self.dial(i, Which::Live, now),
                Link::Resolving { until } if *until <= now => {
                    self.link_failed(i, Which::Live, "name lookup timed out".into(), now)
                }
                Link::Open(c) => {
                    // A stream waiting behind its replay is not read on purpose: only what is
                    // sent to it is held to its deadline.
                    let checked = if replaying {
                        c.check_send(now)
                    } else {
                        c.check(now)
                    };
                    if let Err(e) = checked {
                        self.conn_failed(i, Which::Live, &e, now);
                    }
                }
                _ => {}
            }
            // The step above may have dropped nothing; the source is still at `i`.
            debug_assert_eq!(self.sources[i].token, token);
            if let Some(r) = &mut self.sources[i].replay {
                match &mut r.link {
                    _ if r.deadline <= now => {
                        self.link_failed(i, Which::Replay, "no answer in time".into(), now)
                    }
                    Link::Open(c) => {
                        if let Err(e) = c.check(now) {
                            self.conn_failed(i, Which::Replay, &e, now);
                        }
                    }
                    Link::Idle { at } if *at <= now => self.dial(i, Which::Replay, now),
                    _ => {}
                }
            }
            i += 1;
        }
    }

    // ---- replays ------------------------------------------------------------------------------

    fn start_replays(&mut self, now: Instant) {
        for _ in 0..self.queue.len() {
            if self.replays >= self.config.max_replays.max(1) {
                return;
            }
            let Some(token) = self.queue.pop_front() else {
                return;
            };
            let Some(i) = self.index_of(token) else {
                continue;
            };
            if self.sources[i].replay_after > now {
                self.queue.push_back(token);
                continue;
            }
            self.sources[i].queued = false;
            if self.sources[i].replay.is_some() || self.sources[i].stream.wanted().is_none() {
                continue;
            }
            self.replays += 1;
            self.stats.add(REPLAY, 1);
            self.sources[i].replay = Some(ReplayLink {
                link: Link::Idle { at: now },
                deadline: now + self.config.replay_timeout,
            });
            self.dial(i, Which::Replay, now);
        }
    }

    /// Close source `i`'s replay connection (its replay ended or failed).
    fn end_replay(&mut self, i: usize) {
        // Its live messages waited behind the replay.
        self.drain_wanted = true;
        if let Some(r) = self.sources[i].replay.take() {
            self.replays -= 1;
            if let Link::Open(c) = r.link {
                c.close(&mut self.budget);
            }
        }
    }

    // ---- I/O ----------------------------------------------------------------------------------

    /// Messages already read but not yet taken (a stream that was waiting for a replay):
    /// taken now, since their socket may have nothing new to wake the poll. Returns whether
    /// some source still has more than one turn's worth.
    fn drain_buffered(&mut self) -> bool {
        let mut busy = false;
        for i in 0..self.sources.len() {
            if self.sources[i].stream.is_replaying() {
                continue;
            }
            busy |= self.take_live(i);
        }
        busy
    }

    /// Make the epoll set watch what source `i`'s open sockets want now: reading the live one
    /// unless its stream waits behind a replay or the budget says no, writing while bytes wait.
    fn sync(&mut self, i: usize) {
        let Some(s) = self.sources.get_mut(i) else {
            return;
        };
        let budget = &self.budget;
        let replaying = s.stream.is_replaying();
        let mut failed = None;
        if let Link::Open(c) = &mut s.live {
            let want = c.events(c.may_read(budget) && !replaying);
            if let Err(e) = self.watch.set(c, want, s.token << 1) {
                failed = Some((Which::Live, e));
            }
        }
        if let Some(ReplayLink {
            link: Link::Open(c),
            ..
        }) = &mut s.replay
        {
            let want = c.events(c.may_read(budget));
            if let Err(e) = self.watch.set(c, want, s.token << 1 | 1) {
                failed = Some((Which::Replay, e));
            }
        }
        if let Some((which, e)) = failed {
            let now = Instant::now();
            self.link_failed(i, which, format!("cannot watch the socket: {e}"), now);
        }
    }

    /// Wait for ready sockets (not at all when `busy`, else at most `cap` and the poll
    /// interval) and take what each has; whether any was ready. The sockets touched since the
    /// last round are watched for what they want first.
    fn poll_round(&mut self, busy: bool, cap: Duration) -> bool {
        let over = self.budget.spent();
        let mut touched = std::mem::take(&mut self.touched);
        if over != self.budget_over {
            // The budget's verdict changed for every connection at once.
            self.budget_over = over;
            touched.clear();
            touched.extend(0..self.sources.len());
        }
        for &i in &touched {
            self.sync(i);
        }
        touched.clear();
        self.touched = touched;
        let wait = if busy {
            0
        } else {
            // Rounded up: a wait of less than a millisecond is one.
            let ms = cap
                .min(self.config.poll_interval)
                .as_micros()
                .div_ceil(1000);
            ms.clamp(1, 1000) as i32
        };
        let mut ready = std::mem::take(&mut self.ready);
        ready.clear();
        ready.extend(self.watch.wait(wait));
        if ready.is_empty() {
            self.ready = ready;
            return false;
        }
        let now = Instant::now();
        for &(tag, revents) in &ready {
            let Some(i) = self.index_of(tag >> 1) else {
                continue;
            };
            let which = if tag & 1 == 1 {
                Which::Replay
            } else {
                Which::Live
            };
            self.on_io(i, which, revents, now);
            self.touched.push(i);
        }
        self.ready = ready;
        true
    }

    fn on_io(&mut self, i: usize, which: Which, revents: i16, now: Instant) {
        let s = &mut self.sources[i];
        let conn = match which {
            Which::Live => match &mut s.live {
                Link::Open(c) => c,
                _ => return,
            },
            Which::Replay => match s.replay.as_mut().map(|r| &mut r.link) {
                Some(Link::Open(c)) => c,
                _ => return,
            },
        };
        let mut r = Ok(());
        if revents & (libc::POLLOUT | libc::POLLERR | libc::POLLHUP) != 0 {
            r = conn.writable(&mut self.budget);
        }
        if r.is_ok() && revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
            r = conn.fill(&mut self.budget, &mut self.scratch);
        }
        // What was read before an error (a peer that sent its last batch and closed) is taken
        // first.
        match which {
            Which::Live => {
                // More than a turn's worth: the rest next round.
                if self.take_live(i) {
                    self.drain_wanted = true;
                }
            }
            Which::Replay => self.take_replay(i, now),
        }
        if let Err(e) = r {
            let still_open = match which {
                Which::Live => matches!(self.sources.get(i).map(|s| &s.live), Some(Link::Open(_))),
                Which::Replay => matches!(
                    self.sources.get(i).and_then(|s| s.replay.as_ref()),
                    Some(ReplayLink {
                        link: Link::Open(_),
                        ..
                    })
                ),
            };
            if still_open {
                self.conn_failed(i, which, &e, now);
            }
        }
    }

    /// Take up to one turn of messages from source `i`'s live socket; true when more wait.
    fn take_live(&mut self, i: usize) -> bool {
        let now = Instant::now();
        for _ in 0..self.config.batch_per_turn {
            let s = &mut self.sources[i];
            if s.stream.is_replaying() {
                return false;
            }
            let Link::Open(c) = &mut s.live else {
                return false;
            };
            match c.next(&mut self.budget, now) {
                Ok(Some(Item::Ready)) => {
                    // Subscribed: the start-up or reconnect replay follows, once the
                    // subscription has had time to reach the publisher. (The reconnect backoff
                    // starts again only with a batch that reads: a peer that greets and then
                    // breaks the protocol is redialled ever more slowly, not every 100 ms.)
                    s.stream.subscribed();
                    s.replay_after = now + SUBSCRIPTION_SETTLE;
                    self.queue_if_wanted(i);
                }
                Ok(Some(Item::Message(frames))) => self.on_live(i, frames),
                // Answered by the connection; what follows it is taken in this turn too.
                Ok(Some(Item::Ping(_))) => {}
                Ok(None) => return false,
                Err(e) => {
                    self.conn_failed(i, Which::Live, &e, now);
                    return false;
                }
            }
        }
        true
    }

    fn on_live(&mut self, i: usize, frames: Vec<Bytes>) {
        let key = self.sources[i].publisher.key;
        let (seq, payload) = match split_live(&frames) {
            Ok(m) => m,
            Err(why) => return self.malformed(key, &why),
        };
        let mut steps = std::mem::take(&mut self.steps);
        self.sources[i].stream.live(seq, payload, &mut steps);
        self.run_steps(i, &mut steps);
        self.steps = steps;
    }

    fn take_replay(&mut self, i: usize, now: Instant) {
        loop {
            let wanted = self.sources[i].stream.wanted();
            let Some(ReplayLink {
                link: Link::Open(c),
                deadline,
            }) = self.sources[i].replay.as_mut()
            else {
                return;
            };
            let item = match c.next(&mut self.budget, now) {
                Ok(Some(item)) => item,
                Ok(None) => return,
                Err(e) => return self.conn_failed(i, Which::Replay, &e, now),
            };
            *deadline = now + self.config.replay_timeout;
            let mut steps = std::mem::take(&mut self.steps);
            match item {
                Item::Ready => {
                    // Connected: ask from where the stream wants it.
                    let sent = wanted.map(|(_, from)| {
                        let [start] = wire::replay_request(from);
                        c.send(&[b"", &start], &mut self.budget)
                    });
                    match sent {
                        Some(Ok(())) => self.sources[i].stream.sent(),
                        Some(Err(e)) => {
                            self.steps = steps;
                            return self.conn_failed(i, Which::Replay, &e, now);
                        }
                        None => {}
                    }
                }
                Item::Message(frames) => match split_replay(&frames) {
                    Ok(reply) => self.sources[i].stream.reply(reply, &mut steps),
                    Err(why) => {
                        let key = self.sources[i].publisher.key;
                        self.malformed(key, &format!("replay reply: {why}"));
                        self.sources[i]
                            .stream
                            .failed(format!("malformed reply: {why}"), &mut steps);
                    }
                },
                Item::Ping(_) => {}
            }
            self.run_steps(i, &mut steps);
            self.steps = steps;
        }
    }

    // ---- what the streams decided ---------------------------------------------------------------

    fn run_steps(&mut self, i: usize, steps: &mut Vec<Step>) {
        let key = self.sources[i].publisher.key;
        for step in steps.drain(..) {
            match step {
                Step::Deliver {
                    seq,
                    batch,
                    replayed,
                } => {
                    self.sources[i].failures = 0;
                    self.stats.add(SKIPPED, u64::from(batch.skipped.total()));
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
                Step::Reset(reason) => {
                    self.stats.add(RESET, 1);
                    self.warn(format_args!(
                        "kv events: worker {} rank {} reset ({})",
                        key.worker,
                        key.dp_rank,
                        reason.as_str()
                    ));
                    self.sink.deliver(IntakeEvent::Reset { key, reason });
                }
                Step::Gap => self.stats.add(GAP, 1),
                Step::Malformed(why) => self.malformed(key, &why),
                Step::ReplayDone { failed } => {
                    if let Some(why) = failed {
                        self.stats.add(REPLAY_FAILED, 1);
                        crate::log!(
                            Debug,
                            "kv events: worker {} rank {}: replay failed: {why}",
                            key.worker,
                            key.dp_rank
                        );
                    }
                    self.end_replay(i);
                }
            }
        }
        self.queue_if_wanted(i);
    }

    /// Report every source whose state changed (to the sink, and a log line).
    fn report_states(&mut self) {
        let now = Instant::now();
        for i in 0..self.sources.len() {
            let state = self.sources[i].state();
            let s = &mut self.sources[i];
            if s.state == Some(state) {
                continue;
            }
            let before = s.state.replace(state);
            let key = s.publisher.key;
            let purpose = s.stream.wanted().map(|(p, _)| p);
            let loud = s
                .last_logged
                .is_none_or(|t| now.duration_since(t) >= LOG_EVERY);
            if loud {
                s.last_logged = Some(now);
            }
            let line = format!(
                "kv events: worker {} rank {}: {} -> {}{}",
                key.worker,
                key.dp_rank,
                before.map_or("new", SourceState::as_str),
                state.as_str(),
                match (state, purpose) {
                    (SourceState::Replaying, Some(p)) => format!(" ({})", p.as_str()),
                    (SourceState::Replaying, None) => format!(" ({})", Purpose::Warm.as_str()),
                    (SourceState::Live, _) => " (routed by its events)".to_string(),
                    _ => " (routed by the text tree)".to_string(),
                }
            );
            if loud {
                crate::log!(Info, "{line}");
            } else {
                crate::log!(Debug, "{line}");
            }
            self.sink.deliver(IntakeEvent::State { key, state });
        }
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

fn describe(e: &ConnError) -> String {
    e.to_string()
}

/// A live message's sequence number and payload: exactly `[topic, seq, payload]`, the number
/// not negative.
fn split_live(frames: &[Bytes]) -> Result<(i64, Bytes), String> {
    let [_, seq, payload] = frames else {
        return Err(wire::WireError::Frames(frames.len()).to_string());
    };
    let seq = wire::parse_seq(seq).map_err(|e| e.to_string())?;
    if seq < 0 {
        return Err(format!("negative sequence {seq}"));
    }
    Ok((seq, payload.clone()))
}

/// A replay reply in either form (see `wire::split_replay`), its payload kept as `Bytes`.
fn split_replay(frames: &[Bytes]) -> Result<Reply, String> {
    let refs: Vec<&[u8]> = frames.iter().map(|f| &f[..]).collect();
    match wire::split_replay(&refs).map_err(|e| e.to_string())? {
        ReplayReply::End => Ok(Reply::End),
        ReplayReply::Batch { seq, .. } if seq < 0 => Err(format!("negative sequence {seq}")),
        ReplayReply::Batch { seq, .. } => Ok(Reply::Batch {
            seq,
            // The payload is always the last frame.
            payload: frames.last().cloned().unwrap_or_default(),
        }),
    }
}
