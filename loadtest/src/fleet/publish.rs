//! The fleet's ZeroMQ side: per DP rank a libzmq PUB socket (SGLang's transport) and a replay
//! ROUTER answering SGLang 0.5.23 replay requests from a bounded buffer; one generator thread
//! paces the events of every rank of the shard, one replay thread serves every ROUTER.

use std::collections::VecDeque;
use std::os::raw::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

use super::gen::{Rank, MAX_CHAIN};
use super::pace::Pacer;
use super::schedule::Schedule;
use crate::rng::Rng;
use crate::sim::kv_events::{
    encode_batch, parse_replay_request, replay_frames, EventEncoding, ReplayBuffer, ReplayForm,
    REPLAY_END_SEQ,
};
use crate::sim::radix::CacheEvent;
use crate::streams::sys::now_ns;

/// A libzmq context with `max_sockets` and `io_threads` set (the `zmq` crate sets neither), and
/// the sockets made from it.
pub struct Zctx {
    raw: *mut c_void,
}

// SAFETY: a libzmq context is thread-safe (sockets are not, and are moved, never shared).
unsafe impl Send for Zctx {}
// SAFETY: as above.
unsafe impl Sync for Zctx {}

impl Zctx {
    /// A context allowing `max_sockets` sockets, with `io_threads` I/O threads.
    pub fn new(max_sockets: usize, io_threads: usize) -> std::io::Result<Zctx> {
        // SAFETY: plain libzmq calls on the context they return.
        unsafe {
            let raw = zmq_sys::zmq_ctx_new();
            if raw.is_null() {
                return Err(std::io::Error::other("zmq_ctx_new failed"));
            }
            let n = i32::try_from(max_sockets.max(1024)).unwrap_or(i32::MAX);
            if zmq_sys::zmq_ctx_set(raw, zmq_sys::ZMQ_MAX_SOCKETS as _, n) != 0
                || zmq_sys::zmq_ctx_set(raw, zmq_sys::ZMQ_IO_THREADS as _, io_threads.max(1) as i32)
                    != 0
            {
                return Err(std::io::Error::other("zmq_ctx_set failed"));
            }
            Ok(Zctx { raw })
        }
    }

    /// A new socket of `kind` (`zmq_sys::ZMQ_PUB`, `ZMQ_ROUTER`, `ZMQ_SUB`...).
    pub fn socket(&self, kind: u32) -> std::io::Result<zmq::Socket> {
        // SAFETY: a socket of a live context; ownership goes to the returned `zmq::Socket`,
        // which closes it when dropped. The context outlives it: it is never terminated (it
        // lives as long as the process).
        unsafe {
            let s = zmq_sys::zmq_socket(self.raw, kind as i32);
            if s.is_null() {
                return Err(std::io::Error::other(format!(
                    "zmq_socket: {}",
                    zmq::Error::from_raw(zmq_sys::zmq_errno())
                )));
            }
            Ok(zmq::Socket::from_raw(s))
        }
    }
}

/// One DP rank's live side, owned by the generator thread.
pub struct RankPub {
    /// Global server index.
    pub server: usize,
    /// DP rank within the server.
    pub rank: u32,
    socket: zmq::Socket,
    seq: u64,
    buffer: Arc<Mutex<ReplayBuffer>>,
}

/// One DP rank's replay side, owned by the replay thread.
pub struct RankReplay {
    router: zmq::Socket,
    buffer: Arc<Mutex<ReplayBuffer>>,
}

/// Bind rank `rank` of server `server`: PUB on `pub_port`, ROUTER on `replay_port`.
pub fn open_rank(
    ctx: &Zctx,
    server: usize,
    rank: u32,
    pub_port: u16,
    replay_port: u16,
    buffer_steps: usize,
    buffer_bytes: usize,
) -> std::io::Result<(RankPub, RankReplay)> {
    let e = |what: &str, port: u16, err: zmq::Error| {
        std::io::Error::other(format!("{what} tcp://127.0.0.1:{port}: {err}"))
    };
    let socket = ctx.socket(zmq_sys::ZMQ_PUB)?;
    socket
        .set_sndhwm(100_000)
        .and_then(|()| socket.set_linger(0))
        .and_then(|()| socket.bind(&format!("tcp://127.0.0.1:{pub_port}")))
        .map_err(|err| e("pub", pub_port, err))?;
    let router = ctx.socket(zmq_sys::ZMQ_ROUTER)?;
    router
        .set_sndhwm(
            i32::try_from(buffer_steps + 2)
                .unwrap_or(i32::MAX)
                .max(1000),
        )
        .and_then(|()| router.set_linger(0))
        .and_then(|()| router.set_maxmsgsize(64))
        .and_then(|()| router.bind(&format!("tcp://127.0.0.1:{replay_port}")))
        .map_err(|err| e("replay", replay_port, err))?;
    let buffer = Arc::new(Mutex::new(ReplayBuffer::new(buffer_steps, buffer_bytes)));
    Ok((
        RankPub {
            server,
            rank,
            socket,
            seq: 0,
            buffer: buffer.clone(),
        },
        RankReplay { router, buffer },
    ))
}

/// Counters of the replay thread.
#[derive(Debug, Default)]
pub struct ReplayStats {
    /// Well-formed replay requests answered.
    pub requests: AtomicU64,
    /// Batches sent in answers.
    pub batches: AtomicU64,
    /// Malformed requests.
    pub malformed: AtomicU64,
}

/// Serve every ROUTER until `stop`: epoll over libzmq's signalling descriptors (`ZMQ_FD`, edge
/// triggered: a signalled socket is read until `ZMQ_EVENTS` says nothing more is pending), so
/// an idle fleet of thousands of sockets costs nothing (`zmq_poll` over all of them cost ~20 %
/// of a core at 1,024); a sweep of every socket each second catches a missed edge. Each request
/// is answered with the buffered batches from its start (SGLang 0.5.23's framing) and the
/// terminator.
pub fn serve_replay(ranks: Vec<RankReplay>, stop: Arc<AtomicBool>, stats: Arc<ReplayStats>) {
    use crate::streams::sys::{self, Epoll};
    let mut ep = match Epoll::new() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("kv-fleet: replay epoll: {e}");
            return;
        }
    };
    for (k, r) in ranks.iter().enumerate() {
        if let Ok(fd) = r.router.get_fd() {
            let _ = ep.add(fd, k as u64, sys::IN);
        }
    }
    let mut events = sys::event_buffer(256);
    let mut last_sweep = now_ns();
    while !stop.load(Ordering::Relaxed) {
        let n = ep.wait(&mut events, Some(100_000_000)).unwrap_or(0);
        let mut ready: Vec<usize> = events[..n].iter().map(|e| e.u64 as usize).collect();
        if now_ns() - last_sweep > 1_000_000_000 {
            last_sweep = now_ns();
            ready = (0..ranks.len()).collect();
        }
        for k in ready {
            let r = &ranks[k];
            while r.router.get_events().is_ok_and(|e| e.contains(zmq::POLLIN)) {
                let Ok(frames) = r.router.recv_multipart(zmq::DONTWAIT) else {
                    break;
                };
                answer_replay(r, &frames, &stats);
            }
        }
    }
}

/// Answer one replay request on `r`.
fn answer_replay(r: &RankReplay, frames: &[Vec<u8>], stats: &ReplayStats) {
    let Some((id, start)) = parse_replay_request(frames) else {
        stats.malformed.fetch_add(1, Ordering::Relaxed);
        return;
    };
    stats.requests.fetch_add(1, Ordering::Relaxed);
    // Copy out under the lock, send outside it.
    let batches: Vec<(u64, Vec<u8>)> = {
        let b = r.buffer.lock().unwrap_or_else(|p| p.into_inner());
        b.since(start).cloned().collect()
    };
    for (seq, payload) in &batches {
        let seq = seq.to_be_bytes();
        let f = replay_frames(ReplayForm::Topic, id, b"", &seq, payload);
        if r.router.send_multipart(f, zmq::DONTWAIT).is_ok() {
            stats.batches.fetch_add(1, Ordering::Relaxed);
        }
    }
    let end = replay_frames(ReplayForm::Topic, id, b"", &REPLAY_END_SEQ, b"");
    let _ = r.router.send_multipart(end, zmq::DONTWAIT);
}

/// A marker just published: where, what, when.
#[derive(Debug, Clone)]
pub struct Marker {
    /// Global server index holding it.
    pub server: usize,
    /// Its tokens (the probe's `input_ids`).
    pub tokens: Vec<u32>,
    /// CLOCK_MONOTONIC ns just before the send.
    pub published_ns: u64,
    /// Phase it belongs to.
    pub phase: usize,
}

/// What one shard published in one phase.
#[derive(Debug, Default, Clone)]
pub struct PhaseOut {
    /// Blocks stored (BlockStored blocks).
    pub blocks_stored: u64,
    /// Blocks removed.
    pub blocks_removed: u64,
    /// Wire events (after 0.5.23's coalescing).
    pub events: u64,
    /// Batches sent.
    pub batches: u64,
    /// Payload bytes sent.
    pub bytes: u64,
    /// Sends libzmq refused (high-water mark).
    pub send_errors: u64,
    /// Blocks the pacer gave up (the generator fell behind).
    pub skipped_blocks: u64,
    /// Markers published.
    pub markers: u64,
    /// Seconds the phase lasted as generated.
    pub seconds: f64,
    /// Generator busy fraction (time not sleeping / wall time).
    pub busy: f64,
    /// CPU % of one core per thread of this process during the phase (`fleet-gen`, libzmq's
    /// `ZMQbg/IO/0`, `fleet-http`...).
    pub threads_cpu: Vec<(String, f64)>,
    /// This process's resident memory at the phase's end, MiB (libzmq holds what the
    /// subscribers have not taken yet).
    pub rss_mib_end: f64,
}

impl PhaseOut {
    /// As JSON.
    pub fn to_json(&self) -> Value {
        json!({
            "blocks_stored": self.blocks_stored, "blocks_removed": self.blocks_removed,
            "events": self.events, "batches": self.batches, "bytes": self.bytes,
            "send_errors": self.send_errors, "skipped_blocks": self.skipped_blocks,
            "markers": self.markers, "seconds": self.seconds, "busy": self.busy,
            "rss_mib_end": self.rss_mib_end,
            "threads_cpu_pct": self.threads_cpu.iter().map(|(n, c)| (n.clone(), json!(c))).collect::<serde_json::Map<_, _>>(),
        })
    }
}

/// The generator's settings.
#[derive(Debug, Clone)]
pub struct GenConfig {
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks a rank holds at most.
    pub blocks_per_rank: usize,
    /// This shard's share of the aggregate rate (its publishers / all publishers).
    pub share: f64,
    /// Markers per second (0: none; only the driving shard publishes them).
    pub marker_rate: f64,
    /// Blocks per marker.
    pub marker_blocks: usize,
    /// Pinned seed conversations per rank (the background requests' prompts).
    pub seeds_per_rank: usize,
    /// Pacing slice.
    pub tick_us: u64,
    /// Chance per request of an `AllBlocksCleared` instead (0: never).
    pub clear_chance: f64,
    /// RNG seed.
    pub seed: u64,
}

/// A seed prompt the background requests send: server, tokens.
pub type Seed = (usize, Vec<u32>);

/// The generator: every rank's cache state and live socket.
pub struct Generator {
    cfg: GenConfig,
    ranks: Vec<Rank>,
    pubs: Vec<RankPub>,
    rng: Rng,
    payload: Vec<u8>,
    pending: Vec<Vec<CacheEvent>>,
    dirty: Vec<usize>,
    out: PhaseOut,
}

impl Generator {
    /// A generator over `pubs` (this shard's ranks).
    pub fn new(cfg: GenConfig, pubs: Vec<RankPub>) -> Self {
        let ranks = pubs
            .iter()
            .map(|_| Rank::new(cfg.block_size, cfg.blocks_per_rank))
            .collect();
        let n = pubs.len();
        Generator {
            rng: Rng::fork(cfg.seed, 0xf1ee7),
            cfg,
            ranks,
            pubs,
            payload: Vec::new(),
            pending: vec![Vec::new(); n],
            dirty: Vec::new(),
            out: PhaseOut::default(),
        }
    }

    /// Store the pinned seed conversations on every rank (published as each rank's first
    /// batch, so they sit in its replay buffer for the gateway's start-up replay), and return
    /// one prompt per seed.
    pub fn seed(&mut self) -> Vec<Seed> {
        let mut seeds = Vec::new();
        for i in 0..self.ranks.len() {
            for _ in 0..self.cfg.seeds_per_rank {
                let p = self.rng.below(super::gen::SYSTEM_PROMPTS);
                let n = Rank::chain_len(&mut self.rng).min(MAX_CHAIN);
                let produced = self.ranks[i].start(p, n, true, &mut self.rng, 0);
                self.queue(i, produced.events);
                let c = self.ranks[i].convs.len() - 1;
                seeds.push((self.pubs[i].server, self.ranks[i].prompt(c)));
            }
        }
        self.flush();
        self.out = PhaseOut::default();
        seeds
    }

    fn queue(&mut self, i: usize, events: Vec<CacheEvent>) {
        if events.is_empty() {
            return;
        }
        if self.pending[i].is_empty() {
            self.dirty.push(i);
        }
        self.pending[i].extend(events);
    }

    /// Send every rank's pending events as one batch each; returns the publish time.
    fn flush(&mut self) -> u64 {
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let t = now_ns();
        for i in std::mem::take(&mut self.dirty) {
            let events = std::mem::take(&mut self.pending[i]);
            let p = &mut self.pubs[i];
            let n = encode_batch(
                &mut self.payload,
                ts,
                &events,
                self.cfg.block_size,
                Some(p.rank),
                EventEncoding::Map,
            );
            let seq = p.seq.to_be_bytes();
            p.seq += 1;
            let frames: [&[u8]; 3] = [b"", &seq, &self.payload];
            match p.socket.send_multipart(frames, zmq::DONTWAIT) {
                Ok(()) => {
                    self.out.batches += 1;
                    self.out.events += n as u64;
                    self.out.bytes += self.payload.len() as u64;
                }
                Err(_) => self.out.send_errors += 1,
            }
            p.buffer
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(p.seq - 1, self.payload.clone());
        }
        t
    }

    /// Run the schedule (phases start at `sched.start_ns`); markers go to `markers`. Returns
    /// what was published in each phase.
    pub fn run(
        &mut self,
        sched: &Schedule,
        markers: Option<Sender<Marker>>,
        stop: &AtomicBool,
    ) -> Vec<PhaseOut> {
        let mut results = Vec::new();
        let tick = self.cfg.tick_us.max(100) * 1000;
        for (pi, phase) in sched.phases.iter().enumerate() {
            let (start, end) = sched.window(pi);
            sleep_until(start, stop);
            let rate = phase.rate * self.cfg.share;
            let mut pacer = Pacer::new(rate, start, 0.25);
            let mut mpacer = Pacer::new(
                if phase.rate > 0.0 {
                    self.cfg.marker_rate
                } else {
                    0.0
                },
                start,
                0.25,
            );
            let mut busy_ns = 0u64;
            self.out = PhaseOut::default();
            let ticks0 = super::driver::own_thread_ticks();
            let mut next = start;
            let n = self.ranks.len();
            while !stop.load(Ordering::Relaxed) {
                let now = now_ns();
                if now >= end {
                    break;
                }
                let now_ms = now / 1_000_000;
                let due = pacer.due(now);
                let mut made = 0u64;
                while made < due && n > 0 {
                    let i = self.rng.below(n);
                    let p = if self.cfg.clear_chance > 0.0 && self.rng.chance(self.cfg.clear_chance)
                    {
                        self.ranks[i] = Rank::new(self.cfg.block_size, self.cfg.blocks_per_rank);
                        super::gen::Produced {
                            events: vec![CacheEvent::Cleared],
                            stored: 0,
                            removed: 0,
                        }
                    } else {
                        self.ranks[i].request(&mut self.rng, now_ms)
                    };
                    // At least one, so a run of clears still advances.
                    made += p.stored.max(1);
                    self.out.blocks_stored += p.stored;
                    self.out.blocks_removed += p.removed;
                    self.queue(i, p.events);
                }
                pacer.sent(made);
                let mut new_markers = Vec::new();
                for _ in 0..mpacer.due(now) {
                    let i = self.rng.below(n.max(1));
                    if n == 0 {
                        break;
                    }
                    let (p, tokens) = self.ranks[i].marker(
                        self.cfg.marker_blocks,
                        &mut self.rng,
                        now_ms,
                        now_ms + 10_000,
                    );
                    mpacer.sent(1);
                    self.out.blocks_stored += p.stored;
                    self.out.blocks_removed += p.removed;
                    self.out.markers += 1;
                    self.queue(i, p.events);
                    new_markers.push((self.pubs[i].server, tokens));
                }
                let published = self.flush();
                if let Some(tx) = &markers {
                    for (server, tokens) in new_markers {
                        let _ = tx.send(Marker {
                            server,
                            tokens,
                            published_ns: published,
                            phase: pi,
                        });
                    }
                }
                let after = now_ns();
                busy_ns += after - now;
                next += tick;
                if next > after {
                    sleep_until(next, stop);
                } else {
                    next = after;
                }
            }
            self.out.skipped_blocks = pacer.skipped();
            self.out.seconds = (now_ns().min(end) - start) as f64 / 1e9;
            self.out.busy = busy_ns as f64 / 1e9 / self.out.seconds.max(1e-9);
            let secs = self.out.seconds;
            self.out.threads_cpu = super::driver::own_thread_ticks()
                .into_iter()
                .map(|(n, t)| {
                    let t0 = ticks0.iter().find(|(m, _)| *m == n).map_or(0, |x| x.1);
                    (n, super::driver::cpu_pct(t0, t, secs))
                })
                .filter(|(_, c)| *c > 0.5)
                .collect();
            self.out.rss_mib_end =
                super::driver::read_proc(Some(std::process::id())).rss_kb as f64 / 1024.0;
            results.push(std::mem::take(&mut self.out));
            if stop.load(Ordering::Relaxed) {
                break;
            }
        }
        results
    }

    /// Ranks of this generator (tests).
    pub fn ranks(&self) -> &[Rank] {
        &self.ranks
    }
}

/// Sleep until CLOCK_MONOTONIC `t_ns` (or `stop`), in slices of at most 100 ms.
pub fn sleep_until(t_ns: u64, stop: &AtomicBool) {
    loop {
        let now = now_ns();
        if now >= t_ns || stop.load(Ordering::Relaxed) {
            return;
        }
        std::thread::sleep(std::time::Duration::from_nanos(
            (t_ns - now).min(100_000_000),
        ));
    }
}

/// Markers in flight, oldest first (for the probe).
pub type MarkerQueue = VecDeque<Marker>;
