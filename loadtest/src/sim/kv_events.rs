//! SGLang's KV-cache event publisher, for `sim-worker --kv-events-config JSON`: the simulated
//! radix cache's changes ([`CacheEvent`]) go out on SGLang's exact wire format, so the gateway's
//! event intake can be tested against simulated clusters as against real servers. With
//! `--engine vllm` the same publisher speaks vLLM 0.33's format (see below).
//!
//! vLLM (`vllm/distributed/kv_events.py`): the same three frames and sequence numbers, the same
//! per-rank port offsets and replay framing (0.33 answers a replay with a live message's frames,
//! `[id, b"", topic, seq, payload]`, then `[id, b"", b"", -1, b""]`: [`ReplayForm::Topic`]);
//! the batch is `[ts, events, data_parallel_rank]`; events are [`EventEncoding::Vllm`] maps
//! (hashes unsigned, the salt only in `extra_keys`). vLLM publishes only with
//! `"enable_kv_cache_events": true` ([`KvEventsConfig::for_vllm`]), and announces its
//! publishers at `GET /kv_event_sources` ([`KvEventsConfig::to_vllm_json`]) rather than in
//! `/get_server_info`.
//!
//! Wire format (SGLang 0.5.23 `ZmqEventPublisher`):
//! - a ZeroMQ PUB socket per worker; each message is 3 frames: topic (utf-8, may be empty),
//!   sequence (8-byte big-endian, from 0, +1 per batch), payload (msgpack `EventBatch`
//!   `[ts: float, events: [...], attn_dp_rank: int]`);
//! - events as 0.5.23 sends them ([`encode`]): tagged maps (`{"type": "BlockStored", ...}`),
//!   `medium` always set (`GPU`, or `CPU_PINNED` for the host tier), `cache_salt` and
//!   `lora_name` for namespaced blocks, chained stores coalesced; or, with the sim-only config key
//!   `"encoding": "array"`, the older array form (`["BlockStored", [hash], parent|nil,
//!   token_ids, block_size, lora_id|nil, medium]` per page, `["BlockRemoved", hashes, medium]`
//!   per node, `["AllBlocksCleared"]`), so consumers can be tested on both;
//! - with `replay_endpoint`, a ROUTER socket keeping the last `buffer_steps` batches: a request
//!   `[b"", start_seq (8-byte BE)]` is answered, as 0.5.23 does, `[id, b"", topic, seq,
//!   payload]` (a live message's frames) for every buffered `seq ≥ start`, then `[id, b"", b"",
//!   -1 (8-byte signed BE), b""]`; the sim-only key `"replay_form": "plain"` answers as older
//!   SGLang and vLLM do, `[id, b"", seq, payload]` and `[id, b"", -1, b""]`.
//!
//! Endpoints, as SGLang: a PUB endpoint containing `*` or `::` (or `ipc://`/`inproc://`) binds,
//! any other connects; the replay endpoint always binds. A `*` port (`tcp://127.0.0.1:*`) binds
//! an ephemeral port (tests), reported with the real port. **Several ports in one process**
//! (`--ports a b c`) are separate servers: the worker at index `i` (in `--ports` order) uses the
//! configured endpoint port `+ i` and the replay port `+ i` — SGLang's rule for DP rank `r` (the
//! simulator has one DP rank per worker, so the index plays the rank); `ipc`/`inproc` endpoints
//! get `_dp{i}` appended as SGLang does. Choose bases far apart (e.g. 5557 and 6557) so the
//! ranges do not overlap; overlapping bound ports are refused at start.
//!
//! Threading: one publisher thread per cluster owns every ZeroMQ socket. The monoio thread only
//! stamps a sequence number and pushes the step's raw events into a bounded channel
//! (`max_queue_size` batches per worker) and, when the thread is idle, writes one byte to a
//! socketpair the thread polls beside the replay sockets. So the event loop never blocks and never
//! encodes, and the ROUTER socket, which must be read whenever a client asks, is served without
//! hooking libzmq's edge-triggered descriptors into monoio. A full channel drops the batch after
//! its sequence number was taken: subscribers see a gap that replay cannot fill (counted).

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;

use serde_json::{json, Map, Value};

use super::radix::CacheEvent;

mod encode;

pub use encode::encode_batch;

/// SGLang's default PUB endpoint.
pub const DEFAULT_ENDPOINT: &str = "tcp://*:5557";
/// SGLang's default replay buffer depth, in batches.
pub const DEFAULT_BUFFER_STEPS: usize = 10_000;
/// SGLang's default PUB high-water mark, in messages.
pub const DEFAULT_HWM: i32 = 100_000;
/// SGLang's default bound on batches queued for the publisher thread.
pub const DEFAULT_MAX_QUEUE_SIZE: usize = 100_000;
/// Largest `buffer_steps` / `max_queue_size` accepted: keeps a typo from reserving gigabytes.
pub const MAX_STEPS: usize = 1_000_000;
/// Bytes of encoded batches one worker's replay buffer keeps at most, beside `buffer_steps`:
/// with page size 1 a big prefill makes ~100 kB batches, and 10 000 of them would not fit.
pub const REPLAY_BUFFER_BYTES: usize = 256 << 20;
/// Largest message the replay socket accepts (a request is 8 bytes); libzmq drops the peer of a
/// larger one, so a flood of junk costs nothing.
const MAX_REPLAY_REQUEST: i64 = 64;
/// Replay requests served per worker per wake-up, so one chatty client cannot starve
/// publishing.
const REPLAY_REQUESTS_PER_ROUND: usize = 16;
/// The publisher thread re-checks for shutdown at least this often (ms).
const POLL_TIMEOUT_MS: i64 = 500;
/// The replay terminator's sequence frame: -1 as 8-byte signed big-endian.
pub const REPLAY_END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// Which publisher `--kv-events-config` selects (SGLang: `"zmq"` or `"null"`, the default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublisherKind {
    /// Publish on ZeroMQ.
    Zmq,
    /// Record nothing, publish nothing (the config is still reported).
    Null,
}

/// How events are encoded inside the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EventEncoding {
    /// Tagged maps, as SGLang 0.5.23 and vLLM send them (`{"type": "BlockStored", ...}`).
    #[default]
    Map,
    /// Tagged arrays, older SGLang / vLLM (`["BlockStored", ...]`), one store per page.
    Array,
    /// vLLM 0.33's maps (`--engine vllm`): hashes as unsigned 64-bit ints, every
    /// `BlockStored` with `lora_name`, per-block `extra_keys` (the adapter's name on every
    /// block, `cache_salt` on a sequence's first block only), `group_idx` and
    /// `kv_cache_spec_kind`; one `BlockRemoved` per block (see [`encode`]).
    Vllm,
}

/// How the replay socket frames its answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplayForm {
    /// SGLang 0.5.23: `[id, b"", topic, seq, payload]`, ended by `[id, b"", b"", -1, b""]`.
    #[default]
    Topic,
    /// Older SGLang and vLLM: `[id, b"", seq, payload]`, ended by `[id, b"", -1, b""]`.
    Plain,
}

/// `--kv-events-config`: SGLang's fields and defaults, plus the sim-only `encoding` and
/// `replay_form`.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventsConfig {
    /// `publisher`: "zmq" or "null".
    pub publisher: PublisherKind,
    /// `endpoint` of the PUB socket.
    pub endpoint: String,
    /// `replay_endpoint` of the ROUTER socket, if replay is wanted.
    pub replay_endpoint: Option<String>,
    /// `buffer_steps`: batches kept for replay.
    pub buffer_steps: usize,
    /// `hwm`: the PUB socket's send high-water mark (messages; 0 = unlimited).
    pub hwm: i32,
    /// `max_queue_size`: batches queued for the publisher thread before new ones are dropped.
    pub max_queue_size: usize,
    /// `topic`: first frame of every message.
    pub topic: String,
    /// `encoding` (sim only): map or array events.
    pub encoding: EventEncoding,
    /// `replay_form` (sim only): how replay answers are framed.
    pub replay_form: ReplayForm,
    /// `enable_kv_cache_events` (vLLM's key; refused with `--engine sglang`): vLLM publishes
    /// only when it is true, and the publisher defaults to "zmq" then.
    pub enable_kv_cache_events: Option<bool>,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            publisher: PublisherKind::Null,
            endpoint: DEFAULT_ENDPOINT.into(),
            replay_endpoint: None,
            buffer_steps: DEFAULT_BUFFER_STEPS,
            hwm: DEFAULT_HWM,
            max_queue_size: DEFAULT_MAX_QUEUE_SIZE,
            topic: String::new(),
            encoding: EventEncoding::Map,
            replay_form: ReplayForm::Topic,
            enable_kv_cache_events: None,
        }
    }
}

impl KvEventsConfig {
    /// Parse the JSON of `--kv-events-config`. Unknown keys are refused (SGLang's config class
    /// refuses them too), so a typo does not silently publish with defaults.
    pub fn parse(text: &str) -> Result<Self, String> {
        let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let obj = v.as_object().ok_or("expected a JSON object")?;
        let mut c = KvEventsConfig::default();
        let mut publisher_given = false;
        for (k, v) in obj {
            let s = || {
                v.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| format!("{k} must be a string"))
            };
            let n = |max: u64| {
                v.as_u64()
                    .filter(|&n| n <= max)
                    .ok_or_else(|| format!("{k} must be an integer within 0..={max}"))
            };
            match k.as_str() {
                "publisher" => {
                    publisher_given = true;
                    c.publisher = match s()?.as_str() {
                        "zmq" => PublisherKind::Zmq,
                        "null" => PublisherKind::Null,
                        p => return Err(format!("unknown publisher {p:?} (zmq or null)")),
                    }
                }
                "endpoint" => c.endpoint = s()?,
                "replay_endpoint" => {
                    c.replay_endpoint = if v.is_null() { None } else { Some(s()?) }
                }
                "buffer_steps" => c.buffer_steps = n(MAX_STEPS as u64)? as usize,
                "hwm" => c.hwm = n(i32::MAX as u64)? as i32,
                "max_queue_size" => c.max_queue_size = n(MAX_STEPS as u64)?.max(1) as usize,
                "topic" => c.topic = s()?,
                "encoding" => {
                    c.encoding = match s()?.as_str() {
                        "array" => EventEncoding::Array,
                        "map" => EventEncoding::Map,
                        "vllm" => EventEncoding::Vllm,
                        e => return Err(format!("unknown encoding {e:?} (array, map or vllm)")),
                    }
                }
                "replay_form" => {
                    c.replay_form = match s()?.as_str() {
                        "topic" => ReplayForm::Topic,
                        "plain" => ReplayForm::Plain,
                        f => return Err(format!("unknown replay_form {f:?} (topic or plain)")),
                    }
                }
                "enable_kv_cache_events" => {
                    c.enable_kv_cache_events = Some(
                        v.as_bool()
                            .ok_or("enable_kv_cache_events must be a boolean")?,
                    )
                }
                other => return Err(format!("unknown kv-events-config key {other:?}")),
            }
        }
        // vLLM's `__post_init__`: an unset publisher follows `enable_kv_cache_events`.
        if let (Some(on), false) = (c.enable_kv_cache_events, publisher_given) {
            c.publisher = if on {
                PublisherKind::Zmq
            } else {
                PublisherKind::Null
            };
        }
        check_endpoint(&c.endpoint)?;
        if let Some(r) = &c.replay_endpoint {
            check_endpoint(r)?;
        }
        Ok(c)
    }

    /// The config as SGLang's JSON (what `/get_server_info` reports as `kv_events_config`);
    /// the sim-only `encoding` and `replay_form` appear only when they are not the default, so
    /// a default config reads exactly as SGLang's.
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        let publisher = match self.publisher {
            PublisherKind::Zmq => "zmq",
            PublisherKind::Null => "null",
        };
        m.insert("publisher".into(), json!(publisher));
        m.insert("endpoint".into(), json!(self.endpoint));
        m.insert("replay_endpoint".into(), json!(self.replay_endpoint));
        m.insert("buffer_steps".into(), json!(self.buffer_steps));
        m.insert("hwm".into(), json!(self.hwm));
        m.insert("max_queue_size".into(), json!(self.max_queue_size));
        m.insert("topic".into(), json!(self.topic));
        match self.encoding {
            EventEncoding::Map => {}
            EventEncoding::Array => {
                m.insert("encoding".into(), json!("array"));
            }
            EventEncoding::Vllm => {
                m.insert("encoding".into(), json!("vllm"));
            }
        }
        if self.replay_form == ReplayForm::Plain {
            m.insert("replay_form".into(), json!("plain"));
        }
        if let Some(on) = self.enable_kv_cache_events {
            m.insert("enable_kv_cache_events".into(), json!(on));
        }
        Value::Object(m)
    }

    /// The config as configured for vLLM (`--engine vllm`): the config is vLLM's when
    /// `enable_kv_cache_events` is true and the publisher is not "null" (vLLM's factory
    /// publishes nothing otherwise, whatever the publisher says); events then go out in
    /// vLLM's encoding and replay answers in its framing.
    pub fn for_vllm(&self) -> KvEventsConfig {
        let mut c = self.clone();
        if c.enable_kv_cache_events != Some(true) {
            c.publisher = PublisherKind::Null;
        }
        c.encoding = EventEncoding::Vllm;
        c.replay_form = ReplayForm::Topic;
        c
    }

    /// One rank's entry of vLLM's `GET /kv_event_sources`: its `KVEventsConfig` as vLLM serializes it
    /// (endpoints already offset for the rank, a wildcard host kept as configured).
    pub fn to_vllm_json(&self) -> Value {
        json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "buffer_steps": self.buffer_steps,
            "hwm": self.hwm,
            "max_queue_size": self.max_queue_size,
            "topic": self.topic,
        })
    }

    /// The config of the worker at `index` in a multi-port process: endpoint and replay
    /// endpoint offset by `index` (see the module docs).
    pub fn for_worker(&self, index: usize) -> Result<KvEventsConfig, String> {
        let mut c = self.clone();
        c.endpoint = offset_endpoint(&self.endpoint, index)?;
        if let Some(r) = &self.replay_endpoint {
            c.replay_endpoint = Some(offset_endpoint(r, index)?);
        }
        Ok(c)
    }
}

/// Accept only the transports the publisher knows how to offset and report.
fn check_endpoint(ep: &str) -> Result<(), String> {
    if ep.starts_with("ipc://") || ep.starts_with("inproc://") {
        return Ok(());
    }
    let rest = ep.strip_prefix("tcp://").ok_or_else(|| {
        format!("endpoint {ep:?}: only tcp://, ipc:// and inproc:// are supported")
    })?;
    match rest.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && (port == "*" || port.parse::<u16>().is_ok()) => {
            Ok(())
        }
        _ => Err(format!("endpoint {ep:?}: expected tcp://HOST:PORT")),
    }
}

/// SGLang's per-rank endpoint rule: tcp port `+ k` (a `*` port stays ephemeral), `_dp{k}`
/// appended to ipc/inproc paths; `k = 0` leaves the endpoint unchanged.
pub fn offset_endpoint(ep: &str, k: usize) -> Result<String, String> {
    check_endpoint(ep)?;
    if k == 0 {
        return Ok(ep.to_owned());
    }
    if !ep.starts_with("tcp://") {
        return Ok(format!("{ep}_dp{k}"));
    }
    let (head, port) = ep.rsplit_once(':').unwrap_or((ep, "*"));
    if port == "*" {
        return Ok(ep.to_owned());
    }
    let p = port.parse::<u16>().map_err(|e| e.to_string())?;
    let p = u16::try_from(p as usize + k)
        .map_err(|_| format!("endpoint {ep:?} + {k} is past port 65535"))?;
    Ok(format!("{head}:{p}"))
}

/// Whether SGLang binds this PUB endpoint (else it connects to a binding subscriber).
pub fn pub_binds(ep: &str) -> bool {
    ep.starts_with("ipc://") || ep.starts_with("inproc://") || ep.contains('*') || ep.contains("::")
}

/// `ep` with its tcp port replaced by the one libzmq actually bound (`last`), host kept as
/// configured (so a `*` host stays a wildcard for consumers to replace).
fn with_bound_port(ep: &str, last: &str) -> String {
    match (ep.strip_prefix("tcp://"), last.rsplit_once(':')) {
        (Some(rest), Some((_, port))) => match rest.rsplit_once(':') {
            Some((host, _)) => format!("tcp://{host}:{port}"),
            None => ep.to_owned(),
        },
        _ => ep.to_owned(),
    }
}

/// The last published batches of one worker, for the replay socket: at most `max_batches`
/// and [`REPLAY_BUFFER_BYTES`] bytes, oldest dropped first.
#[derive(Debug)]
pub struct ReplayBuffer {
    max_batches: usize,
    max_bytes: usize,
    bytes: usize,
    items: VecDeque<(u64, Vec<u8>)>,
}

impl ReplayBuffer {
    /// An empty buffer keeping up to `max_batches` batches and `max_bytes` payload bytes.
    pub fn new(max_batches: usize, max_bytes: usize) -> Self {
        ReplayBuffer {
            max_batches,
            max_bytes,
            bytes: 0,
            items: VecDeque::new(),
        }
    }

    /// Keep `payload` as batch `seq` (sequence numbers arrive in increasing order).
    pub fn push(&mut self, seq: u64, payload: Vec<u8>) {
        if self.max_batches == 0 || payload.len() > self.max_bytes {
            return;
        }
        self.bytes += payload.len();
        self.items.push_back((seq, payload));
        while self.items.len() > self.max_batches || self.bytes > self.max_bytes {
            if let Some((_, p)) = self.items.pop_front() {
                self.bytes -= p.len();
            }
        }
    }

    /// Buffered batches with `seq ≥ start`, in order.
    pub fn since(&self, start: u64) -> impl Iterator<Item = &(u64, Vec<u8>)> {
        let first = self.items.partition_point(|(s, _)| *s < start);
        self.items.range(first..)
    }

    /// Number of batches held.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

/// A replay request as the ROUTER socket receives it — `[identity, b"", start (8-byte BE)]` —
/// to `(identity, start)`; anything else is `None` (counted and ignored).
pub fn parse_replay_request(frames: &[Vec<u8>]) -> Option<(&[u8], u64)> {
    match frames {
        [id, empty, start] if empty.is_empty() => {
            let start: [u8; 8] = start.as_slice().try_into().ok()?;
            Some((id, u64::from_be_bytes(start)))
        }
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------------
// The publisher thread.

/// Counters of one worker's publisher (shown under `kv_events` in `GET /debug/stats`).
#[derive(Debug, Default)]
pub struct KvStats {
    /// Batches handed to the publisher thread.
    pub queued: AtomicU64,
    /// Batches sent on the PUB socket.
    pub sent: AtomicU64,
    /// Wire events in the sent batches.
    pub events: AtomicU64,
    /// Batches dropped because the queue was full (their sequence numbers are gaps).
    pub dropped_queue_full: AtomicU64,
    /// Batches withheld from PUB by the `skip_kv_seq` knob (still buffered for replay).
    pub skipped: AtomicU64,
    /// Sequence numbers consumed by the `lose_kv_seq` knob (nothing sent, nothing buffered).
    pub lost: AtomicU64,
    /// PUB sends libzmq refused.
    pub send_errors: AtomicU64,
    /// Well-formed replay requests served.
    pub replay_requests: AtomicU64,
    /// Replay messages that were not `[b"", 8-byte seq]`.
    pub replay_malformed: AtomicU64,
    /// Batches sent in replay answers.
    pub replayed: AtomicU64,
}

impl KvStats {
    /// Snapshot as JSON.
    pub fn to_json(&self) -> Value {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        json!({
            "queued": g(&self.queued), "sent": g(&self.sent), "events": g(&self.events),
            "dropped_queue_full": g(&self.dropped_queue_full), "skipped": g(&self.skipped),
            "lost": g(&self.lost), "send_errors": g(&self.send_errors),
            "replay_requests": g(&self.replay_requests),
            "replay_malformed": g(&self.replay_malformed), "replayed": g(&self.replayed),
        })
    }
}

/// One batch on its way to the publisher thread.
struct Msg {
    worker: usize,
    seq: u64,
    ts: f64,
    events: Vec<CacheEvent>,
    /// False: withheld from PUB (the `skip_kv_seq` knob), buffered for replay only.
    publish: bool,
}

/// Wakes the publisher thread from `zmq::poll`: one byte on a socketpair, written only when the
/// thread is not already due to wake.
#[derive(Debug)]
struct Wake {
    tx: UnixStream,
    pending: AtomicBool,
}

impl Wake {
    fn notify(&self) {
        if !self.pending.swap(true, Ordering::AcqRel) {
            // Non-blocking: a full socketpair already guarantees a wake-up.
            let _ = (&self.tx).write(&[1]);
        }
    }
}

/// One worker's side of the publisher (lives on the monoio thread): numbers the scheduler
/// steps' event batches and queues them for the publisher thread without blocking.
#[derive(Debug)]
pub struct KvPublisher {
    worker: usize,
    config: KvEventsConfig,
    tx: Option<SyncSender<Msg>>,
    wake: Arc<Wake>,
    next_seq: std::cell::Cell<u64>,
    skip_next: std::cell::Cell<bool>,
    lose_next: std::cell::Cell<bool>,
    stats: Arc<KvStats>,
}

impl KvPublisher {
    /// Publish one scheduler step's events as the next batch (nothing when `events` is empty,
    /// as SGLang publishes only non-empty batches). `ts` is Unix time in seconds.
    pub fn publish(&self, events: Vec<CacheEvent>, ts: f64) {
        if events.is_empty() {
            return;
        }
        let seq = self.next_seq.get();
        self.next_seq.set(seq + 1);
        if self.lose_next.replace(false) {
            self.stats.lost.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let publish = !self.skip_next.replace(false);
        let Some(tx) = &self.tx else { return };
        let msg = Msg {
            worker: self.worker,
            seq,
            ts,
            events,
            publish,
        };
        match tx.try_send(msg) {
            Ok(()) => {
                self.stats.queued.fetch_add(1, Ordering::Relaxed);
                self.wake.notify();
            }
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.stats
                    .dropped_queue_full
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Gap-test knob: the next batch is not sent on PUB but is kept for replay, as a message
    /// dropped at the high-water mark would be, so a subscriber sees a gap it can fill
    /// (`false` cancels a pending skip).
    pub fn skip_next_batch(&self, on: bool) {
        self.skip_next.set(on);
    }

    /// Gap-test knob: the next batch's sequence number is consumed with nothing sent and nothing
    /// buffered, as after a queue overflow: a gap replay cannot fill (`false` cancels).
    pub fn lose_next_batch(&self, on: bool) {
        self.lose_next.set(on);
    }

    /// The sequence number the next batch will carry.
    pub fn next_seq(&self) -> u64 {
        self.next_seq.get()
    }

    /// This worker's effective config (offset endpoints, bound ports resolved).
    pub fn config(&self) -> &KvEventsConfig {
        &self.config
    }

    /// Counters.
    pub fn stats(&self) -> &KvStats {
        &self.stats
    }
}

impl Drop for KvPublisher {
    fn drop(&mut self) {
        // Drop the sender first, so the thread sees the channel disconnect when it wakes.
        self.tx = None;
        self.wake.notify();
    }
}

/// One worker's sockets and replay buffer, owned by the publisher thread.
struct WorkerSockets {
    publisher: zmq::Socket,
    replay: Option<zmq::Socket>,
    buffer: ReplayBuffer,
    topic: Vec<u8>,
    encoding: EventEncoding,
    replay_form: ReplayForm,
    stats: Arc<KvStats>,
    /// The attention-DP rank this publisher speaks for (the batches' `attn_dp_rank`).
    dp_rank: u32,
}

/// Binds of one server's ranks tried before giving up: an ephemeral rank-0 port whose
/// neighbours are taken (Linux hands connect() the even ports next to bind()'s odd ones, so a
/// busy host often holds rank 0's port + 1) is dropped and another one drawn.
const EPHEMERAL_SERVER_ATTEMPTS: usize = 32;

/// Open the publishers of one server's attention-DP ranks (`ranks[r]` is rank r's config).
/// Rank r publishes on rank 0's port + r (SGLang's rule), also when rank 0's port is ephemeral
/// (`*`): the other ranks then bind the port rank 0 got + r, and if one of those is taken the
/// whole server is reopened on a fresh ephemeral port instead of failing.
fn open_server(
    ctx: &zmq::Context,
    ranks: &[KvEventsConfig],
) -> io::Result<(Vec<WorkerSockets>, Vec<KvEventsConfig>)> {
    let derived = ranks.len() > 1 && ranks.first().is_some_and(|r| is_ephemeral(&r.endpoint));
    let mut attempt = 1;
    loop {
        match open_ranks(ctx, ranks, derived) {
            // This attempt's sockets are dropped (linger 0), which releases their ports.
            Err(e) if derived && e.kind() == io::ErrorKind::AddrInUse => {
                if attempt == EPHEMERAL_SERVER_ATTEMPTS {
                    return Err(e);
                }
                attempt += 1;
            }
            opened => return opened,
        }
    }
}

/// One try of [`open_server`]: rank 0 as configured, then each other rank on its own config or,
/// when `derived`, on rank 0's bound ports + rank (bound, not connected, like rank 0's).
fn open_ranks(
    ctx: &zmq::Context,
    ranks: &[KvEventsConfig],
    derived: bool,
) -> io::Result<(Vec<WorkerSockets>, Vec<KvEventsConfig>)> {
    let mut sockets = Vec::with_capacity(ranks.len());
    let mut effective: Vec<KvEventsConfig> = Vec::with_capacity(ranks.len());
    for (rank, c) in ranks.iter().enumerate() {
        let (s, e) = match effective.first() {
            Some(base) if derived => {
                let mut own = c.clone();
                own.endpoint = offset_endpoint(&base.endpoint, rank).map_err(invalid_input)?;
                if let (Some(r), Some(b)) = (&c.replay_endpoint, &base.replay_endpoint) {
                    if is_ephemeral(r) {
                        own.replay_endpoint =
                            Some(offset_endpoint(b, rank).map_err(invalid_input)?);
                    }
                }
                open_worker(ctx, &own, true, rank as u32)?
            }
            _ => open_worker(ctx, c, false, rank as u32)?,
        };
        sockets.push(s);
        effective.push(e);
    }
    Ok((sockets, effective))
}

/// A tcp endpoint whose port is left to the kernel (`tcp://HOST:*`).
fn is_ephemeral(ep: &str) -> bool {
    ep.starts_with("tcp://") && ep.ends_with(":*")
}

/// A configuration the publisher cannot open, as an I/O error of its own kind (not retried).
fn invalid_input(m: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, m)
}

/// Create, configure and bind (or connect) one worker's sockets; returns them with the
/// effective config (bound ports filled in).
fn open_worker(
    ctx: &zmq::Context,
    cfg: &KvEventsConfig,
    force_bind: bool,
    dp_rank: u32,
) -> io::Result<(WorkerSockets, KvEventsConfig)> {
    let zerr = |what: &str, ep: &str, e: zmq::Error| {
        io::Error::new(
            io::ErrorKind::AddrInUse,
            format!("kv events {what} {ep}: {e}"),
        )
    };
    let mut eff = cfg.clone();
    let publisher = ctx
        .socket(zmq::PUB)
        .map_err(|e| zerr("socket", &cfg.endpoint, e))?;
    publisher
        .set_sndhwm(cfg.hwm)
        .and_then(|()| publisher.set_linger(0))
        .map_err(|e| zerr("options", &cfg.endpoint, e))?;
    if force_bind || pub_binds(&cfg.endpoint) {
        publisher
            .bind(&cfg.endpoint)
            .map_err(|e| zerr("bind", &cfg.endpoint, e))?;
        if let Ok(Ok(last)) = publisher.get_last_endpoint() {
            eff.endpoint = with_bound_port(&cfg.endpoint, &last);
        }
    } else {
        publisher
            .connect(&cfg.endpoint)
            .map_err(|e| zerr("connect", &cfg.endpoint, e))?;
    }
    let replay = match &cfg.replay_endpoint {
        None => None,
        Some(ep) => {
            let r = ctx.socket(zmq::ROUTER).map_err(|e| zerr("socket", ep, e))?;
            // A full answer (buffer_steps batches + terminator) must fit the send queue, or
            // ROUTER would drop its tail silently.
            let hwm = i32::try_from(cfg.buffer_steps + 2)
                .unwrap_or(i32::MAX)
                .max(1000);
            r.set_sndhwm(hwm)
                .and_then(|()| r.set_linger(0))
                .and_then(|()| r.set_maxmsgsize(MAX_REPLAY_REQUEST))
                .map_err(|e| zerr("options", ep, e))?;
            r.bind(ep).map_err(|e| zerr("bind", ep, e))?;
            if let Ok(Ok(last)) = r.get_last_endpoint() {
                eff.replay_endpoint = Some(with_bound_port(ep, &last));
            }
            Some(r)
        }
    };
    Ok((
        WorkerSockets {
            publisher,
            replay,
            buffer: ReplayBuffer::new(cfg.buffer_steps, REPLAY_BUFFER_BYTES),
            topic: cfg.topic.as_bytes().to_vec(),
            encoding: cfg.encoding,
            replay_form: cfg.replay_form,
            stats: Arc::new(KvStats::default()),
            dp_rank,
        },
        eff,
    ))
}

/// Refuse configurations whose workers would bind the same tcp port (endpoint ranges of
/// consecutive workers overlapping the replay range, for example).
fn check_distinct(configs: &[KvEventsConfig]) -> Result<(), String> {
    let mut seen: Vec<(String, &str)> = Vec::new();
    for c in configs {
        let mut eps: Vec<&str> = Vec::new();
        if pub_binds(&c.endpoint) {
            eps.push(&c.endpoint);
        }
        eps.extend(c.replay_endpoint.as_deref());
        for ep in eps {
            let key = match ep.strip_prefix("tcp://").and_then(|r| r.rsplit_once(':')) {
                Some((_, "*")) => continue,
                Some((_, port)) => port.to_owned(),
                None => ep.to_owned(),
            };
            if let Some((_, other)) = seen.iter().find(|(k, _)| *k == key) {
                return Err(format!(
                    "kv events endpoints {other} and {ep} use the same port: with several \
                     --ports, worker i binds base + i, so choose endpoint and replay bases \
                     further apart"
                ));
            }
            seen.push((key, ep));
        }
    }
    Ok(())
}

/// The publisher of a whole cluster: one [`KvPublisher`] per worker (hand each to its worker)
/// and the thread that owns the sockets. The thread exits once every `KvPublisher` is dropped.
pub struct KvPublishers {
    /// Per worker, in port order.
    pub workers: Vec<KvPublisher>,
    /// The publisher thread.
    pub thread: JoinHandle<()>,
}

/// Open every worker's sockets (errors, such as a port in use, are returned here) and start
/// the publisher thread. `block_size` is the page size.
pub fn start(cfg: &KvEventsConfig, workers: usize, block_size: usize) -> io::Result<KvPublishers> {
    start_ranks(cfg, workers, 1, block_size)
}

/// [`start`] for `workers` schedulers that are `dp` attention-DP ranks per server (scheduler j is
/// rank j % dp): each rank publishes on its server's rank-0 port + rank (SGLang's rule), also
/// when rank 0's port is ephemeral (`*`): the other ranks then bind the port rank 0 got + rank.
pub fn start_ranks(
    cfg: &KvEventsConfig,
    workers: usize,
    dp: usize,
    block_size: usize,
) -> io::Result<KvPublishers> {
    let dp = dp.max(1);
    let configs = (0..workers)
        .map(|i| cfg.for_worker(i))
        .collect::<Result<Vec<_>, _>>()
        .map_err(invalid_input)?;
    check_distinct(&configs).map_err(invalid_input)?;
    let ctx = zmq::Context::new();
    let mut sockets = Vec::with_capacity(workers);
    let mut effective = Vec::with_capacity(workers);
    for group in configs.chunks(dp) {
        let (s, e) = open_server(&ctx, group)?;
        sockets.extend(s);
        effective.extend(e);
    }
    let (wake_tx, wake_rx) = UnixStream::pair()?;
    wake_tx.set_nonblocking(true)?;
    wake_rx.set_nonblocking(true)?;
    let wake = Arc::new(Wake {
        tx: wake_tx,
        pending: AtomicBool::new(false),
    });
    let cap = cfg.max_queue_size.saturating_mul(workers.max(1));
    let (tx, rx) = std::sync::mpsc::sync_channel(cap);
    let publishers = effective
        .into_iter()
        .zip(&sockets)
        .enumerate()
        .map(|(i, (config, s))| KvPublisher {
            worker: i,
            config,
            tx: Some(tx.clone()),
            wake: wake.clone(),
            next_seq: std::cell::Cell::new(0),
            skip_next: std::cell::Cell::new(false),
            lose_next: std::cell::Cell::new(false),
            stats: s.stats.clone(),
        })
        .collect();
    drop(tx);
    let wake2 = wake.clone();
    let thread = std::thread::Builder::new()
        .name("sim-kv-events".into())
        .spawn(move || run(ctx, sockets, rx, wake_rx, wake2, block_size))?;
    Ok(KvPublishers {
        workers: publishers,
        thread,
    })
}

/// The publisher thread: wait on the wake socketpair and the replay sockets; encode and send
/// queued batches; answer replay requests; exit when every sender is gone.
fn run(
    _ctx: zmq::Context,
    mut workers: Vec<WorkerSockets>,
    rx: Receiver<Msg>,
    mut wake_rx: UnixStream,
    wake: Arc<Wake>,
    block_size: usize,
) {
    let mut payload = Vec::new();
    let mut drain = [0u8; 64];
    loop {
        {
            let mut items = Vec::with_capacity(1 + workers.len());
            items.push(zmq::PollItem::from_fd(wake_rx.as_raw_fd(), zmq::POLLIN));
            items.extend(
                workers
                    .iter()
                    .filter_map(|w| w.replay.as_ref())
                    .map(|r| r.as_poll_item(zmq::POLLIN)),
            );
            let _ = zmq::poll(&mut items, POLL_TIMEOUT_MS);
        }
        while matches!(wake_rx.read(&mut drain), Ok(n) if n > 0) {}
        // Cleared before draining: a batch queued after this point writes a new wake byte.
        wake.pending.store(false, Ordering::Release);
        loop {
            match rx.try_recv() {
                Ok(m) => publish(&mut workers, m, block_size, &mut payload),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return,
            }
        }
        for w in &mut workers {
            serve_replay(w);
        }
    }
}

fn publish(workers: &mut [WorkerSockets], m: Msg, block_size: usize, payload: &mut Vec<u8>) {
    let Some(w) = workers.get_mut(m.worker) else {
        return;
    };
    let events = encode_batch(
        payload,
        m.ts,
        &m.events,
        block_size,
        Some(w.dp_rank),
        w.encoding,
    );
    let seq = m.seq.to_be_bytes();
    if m.publish {
        let frames: [&[u8]; 3] = [&w.topic, &seq, payload];
        match w.publisher.send_multipart(frames, zmq::DONTWAIT) {
            Ok(()) => {
                w.stats.sent.fetch_add(1, Ordering::Relaxed);
                w.stats.events.fetch_add(events as u64, Ordering::Relaxed);
            }
            Err(_) => {
                w.stats.send_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    } else {
        w.stats.skipped.fetch_add(1, Ordering::Relaxed);
    }
    w.buffer.push(m.seq, payload.clone());
}

/// Answer the pending replay requests of one worker (a bounded number per round).
fn serve_replay(w: &mut WorkerSockets) {
    let Some(r) = &w.replay else { return };
    for _ in 0..REPLAY_REQUESTS_PER_ROUND {
        let frames = match r.recv_multipart(zmq::DONTWAIT) {
            Ok(f) => f,
            Err(_) => return,
        };
        let Some((id, start)) = parse_replay_request(&frames) else {
            w.stats.replay_malformed.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        w.stats.replay_requests.fetch_add(1, Ordering::Relaxed);
        for (seq, payload) in w.buffer.since(start) {
            let seq = seq.to_be_bytes();
            let frames = replay_frames(w.replay_form, id, &w.topic, &seq, payload);
            if r.send_multipart(frames, zmq::DONTWAIT).is_ok() {
                w.stats.replayed.fetch_add(1, Ordering::Relaxed);
            }
        }
        let end = replay_frames(w.replay_form, id, b"", &REPLAY_END_SEQ, b"");
        let _ = r.send_multipart(end, zmq::DONTWAIT);
    }
}

/// One replay answer message in `form`: after the identity and the empty delimiter, 0.5.23
/// repeats a live message's frames (topic, seq, payload); older publishers leave the topic out.
/// The terminator is the same with an empty topic, seq -1 and an empty payload.
pub fn replay_frames<'a>(
    form: ReplayForm,
    id: &'a [u8],
    topic: &'a [u8],
    seq: &'a [u8],
    payload: &'a [u8],
) -> Vec<&'a [u8]> {
    match form {
        ReplayForm::Topic => vec![id, b"", topic, seq, payload],
        ReplayForm::Plain => vec![id, b"", seq, payload],
    }
}

#[cfg(test)]
mod tests;
