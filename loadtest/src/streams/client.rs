//! The streaming load generator (`loadgen streams`): N keep-alive connections, each in a closed
//! loop of streamed chat completions, timing every SSE event against the upstream's `sent_ns`
//! stamp (the delay a proxy adds to each event, not only to the first) and the first event
//! against the request's write (TTFT). Optionally a probe times GET /health every 10 ms while
//! the streams are open, and an idle mode holds N keep-alive connections without traffic, to
//! weigh what an idle connection costs a proxy.
//!
//! One thread, raw epoll, no runtime: it shares a CPU with the upstream. Connections open
//! gradually (at most `ramp_per_ms` a millisecond) so thousands of connects do not overflow a
//! listen backlog; one that fails is counted and opened again 50 ms later, so the level holds.
//! The thread runs SCHED_BATCH (see [`sys::batch_scheduling`]).

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddrV4;
use std::os::fd::RawFd;
use std::path::PathBuf;

use super::decode::{DecodeError, Decoder, Event, Feed};
use super::report::{Errors, HealthReport, Quantiles, StreamsReport, WatchReport};
use super::sys::{self, Epoll, Io};
use super::watch;
use crate::loadgen::Histogram;

/// What to run.
#[derive(Debug, Clone)]
pub struct StreamsConfig {
    /// The proxy (or upstream) on 127.0.0.1.
    pub addr: SocketAddrV4,
    /// `Host` header.
    pub host: String,
    /// Path of the streamed completions.
    pub path: String,
    /// Concurrent connections (streams).
    pub streams: usize,
    /// Measurement window, seconds.
    pub duration_s: f64,
    /// Seconds after the last connection opened before the window starts.
    pub warmup_s: f64,
    /// Most connections opened per millisecond.
    pub ramp_per_ms: usize,
    /// A connection with a request outstanding and no byte for this long is a timeout.
    pub stall_s: f64,
    /// Approximate request body size.
    pub prompt_bytes: usize,
    /// `max_tokens` asked for (events per stream).
    pub max_tokens: u32,
    /// `model` of the requests.
    pub model: String,
    /// Path probed with GET on a connection of its own every `health_every_ms` (None: no probe).
    pub health_path: Option<String>,
    /// Interval of the health probe, milliseconds.
    pub health_every_ms: f64,
    /// Idle mode: each connection sends one GET `idle_path` and then holds, for this long after
    /// all have answered; no streams.
    pub idle_hold_s: Option<f64>,
    /// The request of idle mode.
    pub idle_path: String,
    /// Written (one line) when the window starts, or in idle mode when all connections are idle.
    pub ready_file: Option<PathBuf>,
    /// PIDs whose CPU time and RSS are read at the window's edges.
    pub watch_pids: Vec<u32>,
    /// A progress line on stderr every second.
    pub progress: bool,
}

const RETRY_NS: u64 = 50_000_000;
const HEALTH: u64 = u64::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// No socket: waiting in the open queue.
    Down,
    Connecting,
    /// A request is outstanding (being written, or its answer being read).
    Busy,
    /// Idle mode: answered, holding.
    Idle,
}

struct Slot {
    fd: RawFd,
    gen: u32,
    phase: Phase,
    out: Vec<u8>,
    out_pos: usize,
    watching_out: bool,
    dec: Decoder,
    requests: u64,
    sent_at: u64,
    last_byte: u64,
    first_seen: bool,
    done_seen: bool,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            fd: -1,
            gen: 0,
            phase: Phase::Down,
            out: Vec::new(),
            out_pos: 0,
            watching_out: false,
            dec: Decoder::new(),
            requests: 0,
            sent_at: 0,
            last_byte: 0,
            first_seen: false,
            done_seen: false,
        }
    }
}

/// The health probe's connection.
struct Probe {
    path: String,
    every_ns: u64,
    slot: Slot,
    next_at: u64,
    hist: Histogram,
    errors: u64,
}

/// How a connection ended badly.
#[derive(Clone, Copy)]
enum Fail {
    Connect,
    Status,
    Broken,
    Timeout,
    Malformed,
}

struct Run {
    cfg: StreamsConfig,
    epoll: Epoll,
    slots: Vec<Slot>,
    /// (not before, slot): connections to open, in order.
    opens: VecDeque<(u64, usize)>,
    initial_left: usize,
    tick_start: u64,
    opened_in_tick: usize,
    window: Option<(u64, u64)>,
    all_issued_at: Option<u64>,
    filler: String,
    readbuf: Vec<u8>,
    delay: Histogram,
    ttft: Histogram,
    events: u64,
    events_total: u64,
    completed: u64,
    sent: u64,
    errors: Errors,
    open_now: usize,
    probe: Option<Probe>,
    next_gen: u32,
}

fn in_window(w: Option<(u64, u64)>, t: u64) -> bool {
    w.is_some_and(|(a, b)| t >= a && t < b)
}

fn token(slot: usize, gen: u32) -> u64 {
    (u64::from(gen) << 32) | slot as u64
}

/// Run the load and return its report. Errors only for setup failures (descriptor limit,
/// epoll); what goes wrong on the wire is counted in the report.
pub fn run(cfg: StreamsConfig) -> io::Result<StreamsReport> {
    let limit = sys::raise_nofile_limit();
    sys::batch_scheduling();
    let need = cfg.streams as u64 + 64;
    if need > limit {
        return Err(io::Error::other(format!(
            "{} streams need about {need} descriptors; the limit is {limit} (raise the hard limit: ulimit -Hn)",
            cfg.streams
        )));
    }
    let word_text = "stream benchmark filler text about caches prefixes routers and tokens ";
    let filler: String = word_text
        .chars()
        .cycle()
        .take(cfg.prompt_bytes.saturating_sub(150))
        .collect();
    let now = sys::now_ns();
    let probe = cfg.health_path.clone().map(|path| Probe {
        path,
        every_ns: (cfg.health_every_ms.max(0.1) * 1e6) as u64,
        slot: Slot::new(),
        next_at: now,
        hist: Histogram::new(),
        errors: 0,
    });
    let mut run = Run {
        epoll: Epoll::new()?,
        slots: (0..cfg.streams).map(|_| Slot::new()).collect(),
        opens: (0..cfg.streams).map(|i| (0, i)).collect(),
        initial_left: cfg.streams,
        tick_start: now,
        opened_in_tick: 0,
        window: None,
        all_issued_at: None,
        filler,
        readbuf: vec![0; 256 << 10],
        delay: Histogram::new(),
        ttft: Histogram::new(),
        events: 0,
        events_total: 0,
        completed: 0,
        sent: 0,
        errors: Errors::default(),
        open_now: 0,
        probe,
        next_gen: 1,
        cfg,
    };
    run.go()
}

impl Run {
    fn go(&mut self) -> io::Result<StreamsReport> {
        let mut events = sys::event_buffer(1024);
        let pids = self.cfg.watch_pids.clone();
        let rss_before = watch::rss_kb(&pids);
        let idle = self.cfg.idle_hold_s.is_some();
        let (mut cpu0, mut watch_cpu0) = (0.0, 0.0);
        let mut rss_open_max = 0u64;
        let mut rss_samples = Vec::new();
        let mut next_sample = 0u64;
        let mut next_scan = 0u64;
        let mut next_progress = sys::now_ns() + 1_000_000_000;
        let mut last_events = 0u64;
        let started = sys::now_ns();
        let (cpu_s, watch_cpu_s, window_s) = loop {
            let now = sys::now_ns();
            // The window: set once the last initial connection is issued (and in idle mode
            // once every connection has answered).
            if self.window.is_none() {
                let ready_at = if idle {
                    (self.initial_left == 0
                        && self
                            .slots
                            .iter()
                            .all(|s| s.phase == Phase::Idle || s.phase == Phase::Down))
                    .then_some(now)
                } else {
                    self.all_issued_at
                        .map(|t| t + (self.cfg.warmup_s * 1e9) as u64)
                };
                if let Some(start) = ready_at.filter(|&t| t <= now) {
                    let len = self.cfg.idle_hold_s.unwrap_or(self.cfg.duration_s);
                    self.window = Some((start, start + (len * 1e9) as u64));
                    cpu0 = sys::cpu_seconds();
                    watch_cpu0 = watch::cpu_seconds(&pids);
                    if let Some(p) = &self.cfg.ready_file {
                        let _ = std::fs::write(p, format!("{} open\n", self.open_now));
                    }
                } else if now - started > 600_000_000_000 {
                    return Err(io::Error::other(
                        "the connections did not come up in 10 minutes",
                    ));
                }
            }
            if let Some((a, b)) = self.window {
                if now >= b {
                    let end_cpu = sys::cpu_seconds();
                    let end_watch = watch::cpu_seconds(&pids);
                    break (
                        end_cpu - cpu0,
                        end_watch - watch_cpu0,
                        (now - a) as f64 / 1e9,
                    );
                }
                if now >= next_sample && !pids.is_empty() {
                    let r = watch::rss_kb(&pids);
                    rss_open_max = rss_open_max.max(r);
                    rss_samples.push(r);
                    next_sample = now + 500_000_000;
                }
            }
            self.open_some(now);
            if now >= next_scan {
                self.scan_stalls(now);
                next_scan = now + 100_000_000;
            }
            self.probe_tick(now);
            if self.cfg.progress && now >= next_progress {
                eprintln!(
                    "loadgen streams: {} open, {} events/s, {} completed, errors {}",
                    self.open_now,
                    self.events_total - last_events,
                    self.completed,
                    self.errors.total()
                );
                last_events = self.events_total;
                next_progress = now + 1_000_000_000;
            }
            let mut wait: u64 = 100_000_000;
            if let Some(&(t, _)) = self.opens.front() {
                wait = wait.min(t.saturating_sub(now).max(1_000_000));
            }
            if let Some((_, b)) = self.window {
                wait = wait.min(b.saturating_sub(now));
            }
            if let Some(p) = &self.probe {
                if p.slot.phase != Phase::Busy {
                    wait = wait.min(p.next_at.saturating_sub(now));
                }
            }
            if self.window.is_none() {
                wait = wait.min(1_000_000);
            }
            let n = self.epoll.wait(&mut events, Some(wait))?;
            for ev in &events[..n] {
                self.on_ready(ev.u64, ev.events);
            }
        };
        let open_at_end = self.open_now;
        for s in &mut self.slots {
            if s.fd >= 0 {
                sys::close(s.fd);
                s.fd = -1;
            }
        }
        if let Some(p) = &mut self.probe {
            if p.slot.fd >= 0 {
                sys::close(p.slot.fd);
            }
        }
        rss_samples.sort_unstable();
        let summary = Quantiles::of_ns;
        Ok(StreamsReport {
            mode: if idle { "idle" } else { "streams" }.into(),
            streams: self.cfg.streams,
            open_at_end,
            window_s,
            events: self.events,
            events_per_s: if window_s > 0.0 {
                self.events as f64 / window_s
            } else {
                0.0
            },
            delay_us: summary(&self.delay),
            ttft_us: summary(&self.ttft),
            streams_completed: self.completed,
            requests_sent: self.sent,
            errors: self.errors,
            cpu_s,
            cpu_s_total: sys::cpu_seconds(),
            health: self.probe.as_ref().map(|p| HealthReport {
                path: p.path.clone(),
                count: p.hist.count(),
                p50_us: p.hist.quantile(0.5) as f64 / 1e3,
                p99_us: p.hist.quantile(0.99) as f64 / 1e3,
                max_us: p.hist.max() as f64 / 1e3,
                errors: p.errors,
            }),
            watch: (!pids.is_empty()).then(|| WatchReport {
                pids: pids.clone(),
                cpu_s: watch_cpu_s,
                rss_kb_before: rss_before,
                rss_kb_open_max: rss_open_max,
                rss_kb_open_median: rss_samples.get(rss_samples.len() / 2).copied().unwrap_or(0),
            }),
        })
    }

    /// Open queued connections, at most `ramp_per_ms` in each millisecond.
    fn open_some(&mut self, now: u64) {
        if now - self.tick_start >= 1_000_000 {
            self.tick_start = now;
            self.opened_in_tick = 0;
        }
        while self.opened_in_tick < self.cfg.ramp_per_ms.max(1) {
            let Some(&(t, i)) = self.opens.front() else {
                break;
            };
            if t > now {
                break;
            }
            self.opens.pop_front();
            self.opened_in_tick += 1;
            if self.initial_left > 0 {
                self.initial_left -= 1;
                if self.initial_left == 0 {
                    self.all_issued_at = Some(now);
                }
            }
            self.open(i, now);
        }
    }

    fn open(&mut self, i: usize, now: u64) {
        let gen = self.next_gen;
        self.next_gen = self.next_gen.wrapping_add(1).max(1);
        let fd = match sys::connect(self.cfg.addr) {
            Ok(fd) => fd,
            Err(_) => {
                self.fail(i, Fail::Connect, now);
                return;
            }
        };
        let tok = if i == usize::MAX {
            HEALTH
        } else {
            token(i, gen)
        };
        if self.epoll.add(fd, tok, sys::OUT).is_err() {
            sys::close(fd);
            self.fail(i, Fail::Connect, now);
            return;
        }
        let s = self.slot_mut(i);
        s.fd = fd;
        s.gen = gen;
        s.phase = Phase::Connecting;
        s.last_byte = now;
        s.watching_out = true;
        s.dec.reset();
        if i != usize::MAX {
            self.open_now += 1;
        }
    }

    fn slot_mut(&mut self, i: usize) -> &mut Slot {
        if i == usize::MAX {
            &mut self
                .probe
                .as_mut()
                .expect("probe slot only with a probe")
                .slot
        } else {
            &mut self.slots[i]
        }
    }

    /// Close slot `i` after a failure (counted) and queue it to open again.
    fn fail(&mut self, i: usize, why: Fail, now: u64) {
        if i == usize::MAX {
            if let Some(p) = &mut self.probe {
                p.errors += 1;
                if p.slot.fd >= 0 {
                    sys::close(p.slot.fd);
                }
                p.slot.fd = -1;
                p.slot.phase = Phase::Down;
                p.next_at = now + RETRY_NS;
            }
            return;
        }
        match why {
            Fail::Connect => self.errors.connect += 1,
            Fail::Status => self.errors.non_200 += 1,
            Fail::Broken => self.errors.broken += 1,
            Fail::Timeout => self.errors.timeout += 1,
            Fail::Malformed => self.errors.malformed += 1,
        }
        self.drop_conn(i);
        self.opens.push_back((now + RETRY_NS, i));
    }

    fn drop_conn(&mut self, i: usize) {
        let s = &mut self.slots[i];
        if s.fd >= 0 {
            sys::close(s.fd);
            s.fd = -1;
            self.open_now -= 1;
        }
        s.phase = Phase::Down;
        s.out.clear();
        s.out_pos = 0;
    }

    fn on_ready(&mut self, tok: u64, bits: u32) {
        let now = sys::now_ns();
        let i = if tok == HEALTH {
            usize::MAX
        } else {
            let (i, gen) = ((tok & 0xffff_ffff) as usize, (tok >> 32) as u32);
            match self.slots.get(i) {
                Some(s) if s.gen == gen && s.fd >= 0 => i,
                _ => return,
            }
        };
        if i == usize::MAX && self.probe.as_ref().is_none_or(|p| p.slot.fd < 0) {
            return;
        }
        let phase = self.slot_mut(i).phase;
        if phase == Phase::Connecting {
            if bits & (sys::OUT | sys::HUP) == 0 {
                return;
            }
            let fd = self.slot_mut(i).fd;
            if sys::take_error(fd).is_some() || bits & sys::HUP != 0 && bits & sys::IN == 0 {
                self.fail(i, Fail::Connect, now);
                return;
            }
            self.slot_mut(i).phase = Phase::Busy;
            if i == usize::MAX {
                // The probe sends when its next turn comes.
                self.slot_mut(i).phase = Phase::Idle;
                self.set_out(i, false);
                return;
            }
            self.send_request(i, now);
            return;
        }
        if bits & sys::OUT != 0 {
            self.flush(i, now);
            if self.slot_mut(i).phase == Phase::Down {
                return;
            }
        }
        if bits & (sys::IN | sys::HUP) != 0 {
            self.read(i, now);
        }
    }

    fn set_out(&mut self, i: usize, want: bool) {
        let tok = if i == usize::MAX {
            HEALTH
        } else {
            token(i, self.slots[i].gen)
        };
        let s = self.slot_mut(i);
        if s.watching_out == want {
            return;
        }
        s.watching_out = want;
        let (fd, ev) = (s.fd, if want { sys::IN | sys::OUT } else { sys::IN });
        let _ = self.epoll.modify(fd, tok, ev);
    }

    /// Build and write slot `i`'s next request.
    fn send_request(&mut self, i: usize, now: u64) {
        let idle = self.cfg.idle_hold_s.is_some();
        let s = &mut self.slots[i];
        s.requests += 1;
        s.out.clear();
        s.out_pos = 0;
        s.first_seen = false;
        s.done_seen = false;
        if idle {
            s.out.extend_from_slice(
                format!(
                    "GET {} HTTP/1.1\r\nHost: {}\r\n\r\n",
                    self.cfg.idle_path, self.cfg.host
                )
                .as_bytes(),
            );
        } else {
            let body = format!(
                "{{\"model\":{},\"stream\":true,\"max_tokens\":{},\"messages\":[{{\"role\":\"user\",\"content\":\"Stream {} request {}: {}\"}}]}}",
                serde_json::to_string(&self.cfg.model).unwrap_or_else(|_| "\"\"".into()),
                self.cfg.max_tokens,
                i,
                s.requests,
                self.filler
            );
            s.out.extend_from_slice(
                format!(
                    "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\nContent-Length: {}\r\n\r\n",
                    self.cfg.path,
                    self.cfg.host,
                    body.len()
                )
                .as_bytes(),
            );
            s.out.extend_from_slice(body.as_bytes());
        }
        s.phase = Phase::Busy;
        s.sent_at = now;
        s.last_byte = now;
        self.sent += 1;
        self.flush(i, now);
    }

    /// Write what slot `i` has queued; watch for writability while some is left.
    fn flush(&mut self, i: usize, now: u64) {
        let s = self.slot_mut(i);
        while s.out_pos < s.out.len() {
            match sys::write(s.fd, &s.out[s.out_pos..]) {
                Io::Done(n) => s.out_pos += n,
                Io::Again => break,
                Io::Closed | Io::Failed(_) => {
                    self.fail(i, Fail::Broken, now);
                    return;
                }
            }
        }
        let left = s.out_pos < s.out.len();
        self.set_out(i, left);
    }

    fn read(&mut self, i: usize, now: u64) {
        let fd = self.slot_mut(i).fd;
        let n = match sys::read(fd, &mut self.readbuf) {
            Io::Done(n) => n,
            Io::Again => return,
            Io::Closed | Io::Failed(_) => {
                self.fail(i, Fail::Broken, now);
                return;
            }
        };
        if i == usize::MAX {
            self.probe_read(n, now);
            return;
        }
        let window = self.window;
        let counting = in_window(window, now);
        let s = &mut self.slots[i];
        s.last_byte = now;
        if s.phase != Phase::Busy {
            // Bytes nobody asked for.
            self.fail(i, Fail::Malformed, now);
            return;
        }
        let (mut events, mut first, mut done) = (0u64, false, false);
        let first_seen = s.first_seen;
        let (delay, ttft) = (&mut self.delay, &mut self.ttft);
        let sent_at = s.sent_at;
        let r = s.dec.feed(&self.readbuf[..n], &mut |e| match e {
            Event::Data(stamp) => {
                events += 1;
                if !first_seen && !first {
                    first = true;
                    if counting {
                        ttft.record(now.saturating_sub(sent_at));
                    }
                }
                if let (Some(t), true) = (stamp, counting) {
                    delay.record(now.saturating_sub(t));
                }
            }
            Event::Done => done = true,
        });
        s.first_seen |= first;
        s.done_seen |= done;
        self.events_total += events;
        if counting {
            self.events += events;
        }
        match r {
            Ok(Feed::More) => {}
            Ok(Feed::End(used)) => {
                let s = &mut self.slots[i];
                if used != n {
                    self.fail(i, Fail::Malformed, now);
                    return;
                }
                if self.cfg.idle_hold_s.is_some() {
                    s.phase = Phase::Idle;
                    return;
                }
                if !s.done_seen {
                    self.fail(i, Fail::Malformed, now);
                    return;
                }
                if counting {
                    self.completed += 1;
                }
                if s.dec.close_requested() {
                    // The proxy asked to close (its keep-alive limit): not an error.
                    self.drop_conn(i);
                    self.opens.push_back((now, i));
                    return;
                }
                self.send_request(i, now);
            }
            Err(DecodeError::Status(_)) => self.fail(i, Fail::Status, now),
            Err(DecodeError::Malformed(_)) => self.fail(i, Fail::Malformed, now),
        }
    }

    /// A timeout is a connection with something outstanding and no byte for `stall_s`.
    fn scan_stalls(&mut self, now: u64) {
        let limit = (self.cfg.stall_s * 1e9) as u64;
        for i in 0..self.slots.len() {
            let s = &self.slots[i];
            if matches!(s.phase, Phase::Busy | Phase::Connecting)
                && now.saturating_sub(s.last_byte) > limit
            {
                self.fail(i, Fail::Timeout, now);
            }
        }
        if let Some(p) = &self.probe {
            if matches!(p.slot.phase, Phase::Busy | Phase::Connecting)
                && now.saturating_sub(p.slot.last_byte) > limit
            {
                self.fail(usize::MAX, Fail::Timeout, now);
            }
        }
    }

    /// Send the next health request when it is due.
    fn probe_tick(&mut self, now: u64) {
        let Some(p) = &mut self.probe else {
            return;
        };
        match p.slot.phase {
            Phase::Down if now >= p.next_at => self.open(usize::MAX, now),
            Phase::Idle if now >= p.next_at => {
                let host = &self.cfg.host;
                p.slot.out.clear();
                p.slot.out_pos = 0;
                p.slot.out.extend_from_slice(
                    format!("GET {} HTTP/1.1\r\nHost: {host}\r\n\r\n", p.path).as_bytes(),
                );
                p.slot.phase = Phase::Busy;
                p.slot.sent_at = now;
                p.slot.last_byte = now;
                p.next_at = now + p.every_ns;
                self.flush(usize::MAX, now);
            }
            _ => {}
        }
    }

    fn probe_read(&mut self, n: usize, now: u64) {
        let counting = in_window(self.window, now);
        let Some(p) = &mut self.probe else {
            return;
        };
        p.slot.last_byte = now;
        if p.slot.phase != Phase::Busy {
            self.fail(usize::MAX, Fail::Malformed, now);
            return;
        }
        match p.slot.dec.feed(&self.readbuf[..n], &mut |_| {}) {
            Ok(Feed::More) => {}
            Ok(Feed::End(used)) if used == n => {
                if counting {
                    p.hist.record(now.saturating_sub(p.slot.sent_at));
                }
                p.slot.phase = Phase::Idle;
                if p.slot.dec.close_requested() {
                    sys::close(p.slot.fd);
                    p.slot.fd = -1;
                    p.slot.phase = Phase::Down;
                }
            }
            _ => self.fail(usize::MAX, Fail::Malformed, now),
        }
    }
}
