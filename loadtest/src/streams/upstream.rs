//! The paced streaming upstream (`stream-upstream`): answers every completion request with one
//! SSE event per interval, each stamped with the CLOCK_MONOTONIC time of its write, so a load
//! generator can measure what a proxy adds to every event, not only to the first.
//!
//! One thread, raw epoll, no runtime: it shares a CPU with the load generator and must carry
//! 100k+ events/s on a fraction of it. The schedule is a min-heap of (due time, connection);
//! one wait runs to the next due time, no per-event timers. The first event of a stream is
//! written at once with the response head (TTFT ≈ the proxy's own delay); the next ones come
//! every interval at a phase of the stream's own, drawn at random when its answer starts; the
//! last one carries `data: [DONE]` and the chunked terminator.
//!
//! Why a random phase: an engine's token times are set by its decode steps, not by when a
//! request reached it. Timed from the request's arrival instead, every stream's phase is the
//! moment the proxy happened to forward its request; a proxy that forwards requests in batches
//! then pulls the streams into step with each other, until all of them send in one burst per
//! interval and the benchmark measures that burst (at 8,192 streams × 160 ms: the proxy idle
//! for 150 ms, then 8,192 events at once, p99 over 100 ms through both radixgate and nginx). Each event is one `send`; a socket
//! that would block keeps the rest of that event and the stream waits for EPOLLOUT (the next
//! event is stamped when it is really written, so the stamp never includes our own queueing).
//! Events due within a tenth of the interval (at most 1 ms) are written in one wake-up, so the
//! pacing jitters by that much while the rate stays exact (each next event is scheduled from
//! its due time); the stamp is taken at the write, so the measured delay does not include it.
//! The thread runs SCHED_BATCH (see [`sys::batch_scheduling`]).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io::{self, Write};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};

use super::request::{self, Parse};
use super::sys::{self, Epoll, Io};

/// How the upstream answers.
#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// Port on 127.0.0.1 (0: any free port).
    pub port: u16,
    /// Time between two events of a stream, nanoseconds.
    pub interval_ns: u64,
    /// Model name in `/v1/models`, `/get_model_info` and every event.
    pub model: String,
    /// Events per stream when the body names no `max_tokens`.
    pub default_max_tokens: u32,
    /// Most events per stream, whatever the body asks.
    pub max_tokens_cap: u32,
    /// Print a line of counters to stderr this often (0: never).
    pub stats_every_s: u64,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            port: 0,
            interval_ns: 20_000_000,
            model: "sim-model".into(),
            default_max_tokens: 64,
            max_tokens_cap: 1_000_000,
            stats_every_s: 0,
        }
    }
}

/// Counters of a run, for the stats line and tests.
#[derive(Debug, Default, Clone, Copy)]
pub struct Counters {
    /// Connections accepted.
    pub accepted: u64,
    /// Streams started.
    pub streams: u64,
    /// SSE events written (counted when their write starts).
    pub events: u64,
    /// Events that found their socket still busy with the previous one and waited for it.
    pub deferred: u64,
    /// Non-streaming answers (health, models, info, 404, 400).
    pub plain: u64,
}

const LISTENER: u64 = u64::MAX;
/// Bytes read per `read`: a proxy's request is a few KiB.
const READ_CHUNK: usize = 64 << 10;

struct Stream {
    id: u64,
    seq: u32,
    left: u32,
}

struct Conn {
    fd: RawFd,
    gen: u32,
    inbuf: Vec<u8>,
    /// Bytes accepted for this socket but not yet taken by the kernel (at most one event, or
    /// one plain answer plus one event).
    out: Vec<u8>,
    out_pos: usize,
    stream: Option<Stream>,
    /// An event fell due while `out` was not empty: write it once it drains.
    owed: bool,
    /// Close once `out` drains (Connection: close, or a 400).
    close_after: bool,
    watching_out: bool,
}

/// A bound upstream, ready to [`run`](Upstream::run).
pub struct Upstream {
    cfg: UpstreamConfig,
    listener: RawFd,
    port: u16,
}

impl Upstream {
    /// Bind 127.0.0.1:`cfg.port`. Raises the descriptor limit first (every stream is one).
    pub fn bind(cfg: UpstreamConfig) -> io::Result<Upstream> {
        sys::raise_nofile_limit();
        sys::batch_scheduling();
        if cfg.interval_ns == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the interval must be above 0",
            ));
        }
        let listener = sys::listen(SocketAddrV4::new(Ipv4Addr::LOCALHOST, cfg.port))?;
        let port = sys::local_port(listener)?;
        Ok(Upstream {
            cfg,
            listener,
            port,
        })
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Serve until `stop` is set (checked at least every 100 ms). Returns the counters.
    pub fn run(self, stop: &AtomicBool) -> io::Result<Counters> {
        let mut s = Server::new(self.cfg, self.listener)?;
        let r = s.serve(stop);
        for c in s.conns.iter().flatten() {
            sys::close(c.fd);
        }
        sys::close(self.listener);
        r.map(|_| s.counters)
    }
}

struct Server {
    cfg: UpstreamConfig,
    listener: RawFd,
    epoll: Epoll,
    conns: Vec<Option<Conn>>,
    free: Vec<u32>,
    next_gen: u32,
    /// (due ns, slot, generation), earliest first.
    queue: BinaryHeap<Reverse<(u64, u32, u32)>>,
    /// Draws each stream's phase.
    rng: crate::rng::Rng,
    counters: Counters,
    /// How early an event may be written: a tenth of the interval, at most 1 ms.
    slack_ns: u64,
    /// The model name as a JSON string literal (quoted, escaped).
    model_json: String,
    created: u64,
    next_stream_id: u64,
    readbuf: Vec<u8>,
    scratch: Vec<u8>,
    payload: Vec<u8>,
}

fn token(slot: u32, gen: u32) -> u64 {
    (u64::from(gen) << 32) | u64::from(slot)
}

const HEAD_SSE: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n";

impl Server {
    fn new(cfg: UpstreamConfig, listener: RawFd) -> io::Result<Server> {
        let epoll = Epoll::new()?;
        epoll.add(listener, LISTENER, sys::IN)?;
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        Ok(Server {
            model_json: json_str(&cfg.model),
            slack_ns: (cfg.interval_ns / 10).min(1_000_000),
            cfg,
            listener,
            epoll,
            conns: Vec::new(),
            free: Vec::new(),
            next_gen: 1,
            queue: BinaryHeap::new(),
            rng: crate::rng::Rng::new(sys::now_ns()),
            counters: Counters::default(),
            created,
            next_stream_id: 1,
            readbuf: vec![0; READ_CHUNK],
            scratch: Vec::with_capacity(1024),
            payload: Vec::with_capacity(512),
        })
    }

    fn serve(&mut self, stop: &AtomicBool) -> io::Result<()> {
        let mut events = sys::event_buffer(1024);
        let mut last_stats = sys::now_ns();
        let mut last_counters = self.counters;
        while !stop.load(Ordering::Relaxed) {
            let now = sys::now_ns();
            let wait = match self.queue.peek() {
                Some(&Reverse((due, _, _))) => {
                    due.saturating_sub(now + self.slack_ns).min(100_000_000)
                }
                None => 100_000_000,
            };
            let n = self.epoll.wait(&mut events, Some(wait))?;
            for ev in &events[..n] {
                let (tok, bits) = (ev.u64, ev.events);
                if tok == LISTENER {
                    self.accept_all();
                } else {
                    self.on_ready(tok, bits);
                }
            }
            self.fire_due();
            if self.cfg.stats_every_s > 0 {
                let now = sys::now_ns();
                let span = now - last_stats;
                if span >= self.cfg.stats_every_s * 1_000_000_000 {
                    let c = self.counters;
                    let secs = span as f64 / 1e9;
                    eprintln!(
                        "stream-upstream: {:.0} events/s, {:.0} streams/s, {} open connections, {} deferred events (total {} events)",
                        (c.events - last_counters.events) as f64 / secs,
                        (c.streams - last_counters.streams) as f64 / secs,
                        self.conns.len() - self.free.len(),
                        c.deferred - last_counters.deferred,
                        c.events
                    );
                    last_stats = now;
                    last_counters = c;
                }
            }
        }
        Ok(())
    }

    fn accept_all(&mut self) {
        loop {
            match sys::accept(self.listener) {
                Ok(Some(fd)) => {
                    let gen = self.next_gen;
                    self.next_gen = self.next_gen.wrapping_add(1).max(1);
                    let slot = match self.free.pop() {
                        Some(s) => s,
                        None => {
                            self.conns.push(None);
                            (self.conns.len() - 1) as u32
                        }
                    };
                    if self.epoll.add(fd, token(slot, gen), sys::IN).is_err() {
                        sys::close(fd);
                        self.free.push(slot);
                        continue;
                    }
                    self.conns[slot as usize] = Some(Conn {
                        fd,
                        gen,
                        inbuf: Vec::new(),
                        out: Vec::new(),
                        out_pos: 0,
                        stream: None,
                        owed: false,
                        close_after: false,
                        watching_out: false,
                    });
                    self.counters.accepted += 1;
                }
                Ok(None) => return,
                // Out of descriptors or similar: leave the rest in the backlog for now.
                Err(_) => return,
            }
        }
    }

    fn conn(&mut self, slot: u32, gen: u32) -> Option<&mut Conn> {
        self.conns
            .get_mut(slot as usize)
            .and_then(|c| c.as_mut())
            .filter(|c| c.gen == gen)
    }

    fn close(&mut self, slot: u32) {
        if let Some(c) = self.conns.get_mut(slot as usize).and_then(|c| c.take()) {
            sys::close(c.fd);
            self.free.push(slot);
        }
    }

    fn on_ready(&mut self, tok: u64, bits: u32) {
        let (slot, gen) = (tok as u32, (tok >> 32) as u32);
        if self.conn(slot, gen).is_none() {
            return;
        }
        if bits & sys::OUT != 0 && !self.flush(slot, gen) {
            return;
        }
        if bits & (sys::IN | sys::HUP) != 0 {
            let Some(c) = self.conn(slot, gen) else {
                return;
            };
            let fd = c.fd;
            match sys::read(fd, &mut self.readbuf) {
                Io::Done(n) => {
                    let Some(c) = self.conns.get_mut(slot as usize).and_then(|c| c.as_mut()) else {
                        return;
                    };
                    if c.inbuf.len() + n > request::MAX_HEAD + request::MAX_BODY {
                        self.close(slot);
                        return;
                    }
                    c.inbuf.extend_from_slice(&self.readbuf[..n]);
                    self.serve_requests(slot, gen);
                }
                Io::Again => {}
                Io::Closed | Io::Failed(_) => self.close(slot),
            }
        }
    }

    /// Write what `out` holds. Returns false when the connection was closed.
    fn flush(&mut self, slot: u32, gen: u32) -> bool {
        let Some(c) = self.conn(slot, gen) else {
            return false;
        };
        while c.out_pos < c.out.len() {
            match sys::write(c.fd, &c.out[c.out_pos..]) {
                Io::Done(n) => c.out_pos += n,
                Io::Again => break,
                Io::Closed | Io::Failed(_) => {
                    self.close(slot);
                    return false;
                }
            }
        }
        let drained = c.out_pos >= c.out.len();
        let want = if drained { sys::IN } else { sys::IN | sys::OUT };
        if drained {
            c.out.clear();
            c.out_pos = 0;
        }
        if (want & sys::OUT != 0) != c.watching_out {
            c.watching_out = want & sys::OUT != 0;
            let fd = c.fd;
            if self.epoll.modify(fd, token(slot, gen), want).is_err() {
                self.close(slot);
                return false;
            }
        }
        if !drained {
            return true;
        }
        let c = self.conn(slot, gen).expect("checked above");
        if c.close_after && c.stream.is_none() {
            self.close(slot);
            return false;
        }
        if c.owed {
            c.owed = false;
            let now = sys::now_ns();
            if !self.send_event(slot, gen, now) {
                return false;
            }
        } else if c.stream.is_none() {
            self.serve_requests(slot, gen);
        }
        self.conn(slot, gen).is_some()
    }

    /// Queue `scratch` for the socket and write as much as it takes now. Returns false when the
    /// connection was closed.
    fn send(&mut self, slot: u32, gen: u32) -> bool {
        let Some(c) = self.conns.get_mut(slot as usize).and_then(|c| c.as_mut()) else {
            return false;
        };
        let bytes = &self.scratch[..];
        if c.out_pos < c.out.len() {
            c.out.extend_from_slice(bytes);
            return true;
        }
        match sys::write(c.fd, bytes) {
            Io::Done(n) if n == bytes.len() => true,
            Io::Done(n) => {
                c.out.clear();
                c.out.extend_from_slice(&bytes[n..]);
                c.out_pos = 0;
                self.flush(slot, gen)
            }
            Io::Again => {
                c.out.clear();
                c.out.extend_from_slice(bytes);
                c.out_pos = 0;
                self.flush(slot, gen)
            }
            Io::Closed | Io::Failed(_) => {
                self.close(slot);
                false
            }
        }
    }

    /// Answer the requests waiting in the connection's buffer, until one starts a stream (the
    /// next ones wait for its end) or the buffer holds no whole request.
    fn serve_requests(&mut self, slot: u32, gen: u32) {
        loop {
            let Some(c) = self.conn(slot, gen) else {
                return;
            };
            if c.stream.is_some() || c.close_after || c.inbuf.is_empty() {
                return;
            }
            let inbuf = std::mem::take(&mut c.inbuf);
            let (used, keep_alive, action) = match request::parse(&inbuf) {
                Parse::Partial => {
                    self.conn(slot, gen).expect("checked above").inbuf = inbuf;
                    return;
                }
                Parse::Bad(why) => {
                    self.plain(400, "text/plain", why.as_bytes(), false);
                    (inbuf.len(), false, None)
                }
                Parse::Done(req, used) => {
                    let action = self.route(&req);
                    (used, req.keep_alive, action)
                }
            };
            let c = self.conn(slot, gen).expect("checked above");
            c.inbuf = inbuf;
            c.inbuf.drain(..used);
            c.close_after = !keep_alive;
            match action {
                Some(max_tokens) => {
                    self.start_stream(slot, gen, max_tokens);
                    return;
                }
                None => {
                    self.counters.plain += 1;
                    if !self.send(slot, gen) {
                        return;
                    }
                    let c = self.conn(slot, gen).expect("send kept it open");
                    if c.close_after && c.out_pos >= c.out.len() {
                        self.close(slot);
                        return;
                    }
                }
            }
        }
    }

    /// Answer `req`: a plain answer is left in `scratch` (None), a completion request returns
    /// how many events to stream.
    fn route(&mut self, req: &request::Request<'_>) -> Option<u32> {
        let model = self.cfg.model.clone();
        match (req.method, req.path) {
            (b"GET", b"/health" | b"/health_generate" | b"/readiness" | b"/liveness") => {
                self.plain(200, "text/plain", b"", req.keep_alive)
            }
            (b"GET", b"/v1/models") => {
                let body = format!(
                    "{{\"object\":\"list\",\"data\":[{{\"id\":{m},\"object\":\"model\",\"created\":{c},\"owned_by\":\"sglang\",\"root\":{m},\"max_model_len\":131072}}]}}",
                    m = json_str(&model),
                    c = self.created
                );
                self.plain(200, "application/json", body.as_bytes(), req.keep_alive)
            }
            (b"GET", b"/get_model_info") => {
                let body = format!(
                    "{{\"model_path\":{m},\"tokenizer_path\":{m},\"is_generation\":true}}",
                    m = json_str(&model)
                );
                self.plain(200, "application/json", body.as_bytes(), req.keep_alive)
            }
            (b"GET", b"/get_server_info") => {
                let body = format!(
                    "{{\"model_path\":{m},\"served_model_name\":{m},\"dp_size\":1,\"tp_size\":1,\"version\":\"stream-upstream\",\"interval_ms\":{i}}}",
                    m = json_str(&model),
                    i = self.cfg.interval_ns as f64 / 1e6
                );
                self.plain(200, "application/json", body.as_bytes(), req.keep_alive)
            }
            (b"GET", b"/metrics") => {
                self.plain(200, "text/plain; version=0.0.4", b"", req.keep_alive)
            }
            (b"POST", b"/v1/chat/completions" | b"/v1/completions" | b"/generate") => {
                return Some(request::max_tokens(
                    req.body,
                    self.cfg.default_max_tokens,
                    self.cfg.max_tokens_cap,
                ))
            }
            _ => self.plain(404, "text/plain", b"not found", req.keep_alive),
        }
        None
    }

    /// A whole answer with a Content-Length, into `scratch`.
    fn plain(&mut self, status: u16, ctype: &str, body: &[u8], keep_alive: bool) {
        let reason = match status {
            200 => "OK",
            400 => "Bad Request",
            _ => "Not Found",
        };
        self.scratch.clear();
        let _ =
            write!(
            self.scratch,
            "HTTP/1.1 {status} {reason}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\n{}\r\n",
            body.len(),
            if keep_alive { "" } else { "connection: close\r\n" }
        );
        self.scratch.extend_from_slice(body);
    }

    fn start_stream(&mut self, slot: u32, gen: u32, max_tokens: u32) {
        let id = self.next_stream_id;
        self.next_stream_id += 1;
        self.counters.streams += 1;
        let c = self.conn(slot, gen).expect("caller checked");
        c.stream = Some(Stream {
            id,
            seq: 0,
            left: max_tokens,
        });
        let now = sys::now_ns();
        if c.out_pos < c.out.len() {
            // Still writing an earlier plain answer: the head and first event follow it.
            c.owed = true;
            return;
        }
        self.send_event(slot, gen, now);
    }

    /// Write the stream's next event now (with the response head when it is the first, with
    /// `[DONE]` and the terminator when it is the last) and schedule the one after it. Returns
    /// false when the connection was closed.
    fn send_event(&mut self, slot: u32, gen: u32, now: u64) -> bool {
        let model = &self.model_json;
        let Some(c) = self.conns.get_mut(slot as usize).and_then(|c| c.as_mut()) else {
            return false;
        };
        let Some(st) = c.stream.as_mut() else {
            return true;
        };
        self.scratch.clear();
        let first = st.seq == 0;
        if first {
            self.scratch.extend_from_slice(HEAD_SSE);
        }
        let last = st.left <= 1;
        if st.left > 0 {
            self.payload.clear();
            let sent_ns = sys::now_ns();
            let _ = write!(
                self.payload,
                "data: {{\"id\":\"chatcmpl-{:x}\",\"object\":\"chat.completion.chunk\",\"created\":{},\"model\":{},\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" tok{}\"}},\"finish_reason\":{}}}],\"sent_ns\":{}}}\n\n",
                st.id,
                self.created,
                model,
                st.seq,
                if last { "\"length\"" } else { "null" },
                sent_ns
            );
            let _ = write!(self.scratch, "{:x}\r\n", self.payload.len());
            self.scratch.extend_from_slice(&self.payload);
            self.scratch.extend_from_slice(b"\r\n");
            self.counters.events += 1;
            st.seq += 1;
            st.left -= 1;
        }
        if last {
            self.scratch
                .extend_from_slice(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n");
            c.stream = None;
        }
        if !self.send(slot, gen) {
            return false;
        }
        if last {
            let c = self.conn(slot, gen).expect("send kept it open");
            if c.out_pos >= c.out.len() {
                if c.close_after {
                    self.close(slot);
                    return false;
                }
                self.serve_requests(slot, gen);
            }
        } else {
            let mut due = now + self.cfg.interval_ns;
            if first {
                due += self.rng.next_u64() % self.cfg.interval_ns;
            }
            self.queue.push(Reverse((due, slot, gen)));
        }
        self.conn(slot, gen).is_some()
    }

    /// Write every event that is due, or due within the slack: one wake-up then writes a batch
    /// of events instead of one (a wake-up per event would cost more than the event's write).
    fn fire_due(&mut self) {
        let now = sys::now_ns();
        let horizon = now + self.slack_ns;
        while let Some(&Reverse((due, slot, gen))) = self.queue.peek() {
            if due > horizon {
                break;
            }
            self.queue.pop();
            let Some(c) = self.conn(slot, gen) else {
                continue;
            };
            if c.stream.is_none() {
                continue;
            }
            if c.out_pos < c.out.len() {
                c.owed = true;
                self.counters.deferred += 1;
                continue;
            }
            // Scheduled from its due time, not from now: a late wake-up does not slow the
            // stream's rate.
            self.send_event(slot, gen, due);
        }
    }
}

/// `s` as a JSON string literal.
fn json_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}
