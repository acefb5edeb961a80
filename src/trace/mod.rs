//! OpenTelemetry tracing (`--enable-trace`): spans for each recorded request, exported over
//! OTLP/gRPC to `--otlp-traces-endpoint`.
//!
//! - `context`: W3C `traceparent` parse/format and the sampling rule (pure);
//! - `tracestate`: the caller's `tracestate`, checked and bounded as W3C says (pure);
//! - `span`: what a core records: [`span::RequestTrace`] while a request lives, then finished
//!   [`span::SpanRecord`]s;
//! - `export`: the export thread, which turns records into the SDK's spans and sends them in
//!   batches bounded in bytes through `opentelemetry-otlp`, on a small tokio runtime of its own.
//!
//! A serving core never waits for tracing: it pushes finished spans into its own queue
//! ([`Tracer::submit`]), bounded in spans and in bytes; a span that does not fit is dropped and
//! counted (`radixgate_trace_spans_dropped_total`, by reason). With tracing off the gateway
//! holds no [`Tracer`] and a request costs one `Option` test.

pub mod context;
pub mod export;
pub mod span;
pub mod tracestate;

use crossbeam::queue::ArrayQueue;
use span::{RequestTrace, SpanRecord};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// `--trace-buffer-bytes`' default: what a core's queue may hold, 16 MiB (the default 8192
/// spans of an ordinary request take about 4 MiB).
pub const DEFAULT_BUFFER_BYTES: u64 = 16 << 20;
/// `--trace-export-batch-bytes`' default: 3 MiB, under the 4 MiB a gRPC server (and the
/// OpenTelemetry Collector) accepts in one message unless configured otherwise.
pub const DEFAULT_BATCH_BYTES: u64 = 3 << 20;

/// What the tracer and its export thread are told at start.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The OTLP/gRPC collector, `host:port` or `http://host:port`.
    pub endpoint: String,
    /// Share of requests recorded, unless a trusted caller's context decides.
    pub ratio: f64,
    /// Whether a trusted caller's `sampled` flag decides whether its request is recorded
    /// (`--trace-trust-caller-sampling`; who is trusted is the exchange's call).
    pub trust_caller_sampling: bool,
    /// Finished spans each core may hold before the export thread takes them.
    pub buffer: usize,
    /// Bytes of finished spans each core may hold (as [`SpanRecord::held_bytes`] counts).
    pub buffer_bytes: usize,
    /// Most bytes of one export request, as [`export::encoded_bound`] estimates them.
    pub batch_bytes: usize,
    /// Serving cores (one queue each).
    pub cores: usize,
}

impl Default for Settings {
    /// The flags' defaults, one core.
    fn default() -> Settings {
        Settings {
            endpoint: "localhost:4317".into(),
            ratio: 1.0,
            trust_caller_sampling: false,
            buffer: 8192,
            buffer_bytes: DEFAULT_BUFFER_BYTES as usize,
            batch_bytes: DEFAULT_BATCH_BYTES as usize,
            cores: 1,
        }
    }
}

/// Why a finished span was dropped before export (the `reason` label of
/// `radixgate_trace_spans_dropped_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// The core's queue held `--trace-buffer-spans` spans.
    Spans,
    /// The span would have taken the core's queue over `--trace-buffer-bytes`.
    Bytes,
}

impl DropReason {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::Spans => "spans",
            DropReason::Bytes => "bytes",
        }
    }
}

/// One core's finished spans, each with the bytes it was counted at, and their sum.
struct Queue {
    spans: ArrayQueue<(SpanRecord, usize)>,
    /// Bytes of the spans queued (added before a push, taken off after a pop, so it is never
    /// below what the queue holds).
    bytes: AtomicUsize,
}

/// The tracing state every core shares: the per-core queues and the counters.
pub struct Tracer {
    ratio: f64,
    trust_caller_sampling: bool,
    buffer_bytes: usize,
    batch_bytes: usize,
    queues: Box<[Queue]>,
    dropped_spans: AtomicU64,
    dropped_bytes: AtomicU64,
    exported: AtomicU64,
    closed: AtomicBool,
    /// The export thread, to wake it when a queue fills up and to join it at shutdown.
    thread: OnceLock<std::thread::Thread>,
    handle: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for Tracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracer")
            .field("ratio", &self.ratio)
            .field("dropped", &self.dropped())
            .finish()
    }
}

impl Tracer {
    /// Queues only, no export thread (tests and the benchmark of the record path).
    pub fn detached(s: &Settings) -> Tracer {
        Tracer {
            ratio: s.ratio,
            trust_caller_sampling: s.trust_caller_sampling,
            buffer_bytes: s.buffer_bytes,
            batch_bytes: s.batch_bytes,
            queues: (0..s.cores.max(1))
                .map(|_| Queue {
                    spans: ArrayQueue::new(s.buffer.max(1)),
                    bytes: AtomicUsize::new(0),
                })
                .collect(),
            dropped_spans: AtomicU64::new(0),
            dropped_bytes: AtomicU64::new(0),
            exported: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            thread: OnceLock::new(),
            handle: Mutex::new(None),
        }
    }

    /// The tracer for `s`, with its export thread running.
    pub fn start(s: &Settings) -> Result<Arc<Tracer>, String> {
        let tracer = Arc::new(Tracer::detached(s));
        export::spawn(&tracer, &s.endpoint)?;
        Ok(tracer)
    }

    /// Whether a trusted caller's `sampled` flag decides (`--trace-trust-caller-sampling`):
    /// the exchange then works out whether this caller is trusted.
    pub fn trusts_caller_sampling(&self) -> bool {
        self.trust_caller_sampling
    }

    /// The trace of a request whose head carried these `traceparent` / `tracestate` values,
    /// when it is recorded. A valid caller context is always continued (same trace, the
    /// caller's span as parent, its `tracestate` bounded); whether the request is recorded is
    /// the caller's `sampled` flag when `trusted` (and the gateway trusts callers at all), else
    /// the gateway's own draw at the sampling ratio, as for a new trace. `None`: nothing is
    /// recorded for it.
    pub fn begin(
        &self,
        traceparent: Option<&[u8]>,
        tracestate: Option<&[u8]>,
        trusted: bool,
        entropy: &mut crate::base::entropy::Entropy,
    ) -> Option<RequestTrace> {
        let start = span::now_ns();
        let caller = traceparent.and_then(context::parse_traceparent);
        let trusted = trusted && self.trust_caller_sampling;
        if self.ratio <= 0.0 && !(trusted && caller.is_some()) {
            // Nothing can be recorded: no id drawn.
            return None;
        }
        // A new trace's id, or (untrusted caller) the draw that decides in its place.
        let id = span::random_trace_id(entropy);
        context::should_record(caller.as_ref(), trusted, &id, self.ratio)
            .then(|| RequestTrace::begin(caller.as_ref(), id, tracestate, entropy, start))
    }

    /// Hand a finished request's spans to the export thread through core `core`'s queue;
    /// spans that do not fit (in count or in bytes) are dropped and counted, never waited for.
    pub fn submit(&self, core: usize, spans: impl Iterator<Item = SpanRecord>) {
        let q = &self.queues[core % self.queues.len()];
        let (mut over_spans, mut over_bytes) = (0u64, 0u64);
        for s in spans {
            let cost = s.held_bytes();
            // Counted before the push, so the export thread's pop never takes it below zero.
            let before = q.bytes.fetch_add(cost, Ordering::Relaxed);
            if before.saturating_add(cost) > self.buffer_bytes {
                q.bytes.fetch_sub(cost, Ordering::Relaxed);
                over_bytes += 1;
            } else if q.spans.push((s, cost)).is_err() {
                q.bytes.fetch_sub(cost, Ordering::Relaxed);
                over_spans += 1;
            }
        }
        for (n, counter, reason) in [
            (over_spans, &self.dropped_spans, DropReason::Spans),
            (over_bytes, &self.dropped_bytes, DropReason::Bytes),
        ] {
            if n > 0 {
                counter.fetch_add(n, Ordering::Relaxed);
                crate::metrics::trace_spans_dropped(reason.as_str(), n);
            }
        }
        // Half full (in spans or bytes): take them now rather than at the next tick.
        if q.spans.len() * 2 >= q.spans.capacity()
            || q.bytes.load(Ordering::Relaxed) * 2 >= self.buffer_bytes
        {
            if let Some(t) = self.thread.get() {
                t.unpark();
            }
        }
    }

    /// Spans dropped before export since start, for any reason.
    pub fn dropped(&self) -> u64 {
        self.dropped_by(DropReason::Spans) + self.dropped_by(DropReason::Bytes)
    }

    /// Spans dropped before export since start, for `reason`.
    pub fn dropped_by(&self, reason: DropReason) -> u64 {
        match reason {
            DropReason::Spans => self.dropped_spans.load(Ordering::Relaxed),
            DropReason::Bytes => self.dropped_bytes.load(Ordering::Relaxed),
        }
    }

    /// Bytes of finished spans queued now, all cores.
    pub fn queued_bytes(&self) -> usize {
        self.queues
            .iter()
            .map(|q| q.bytes.load(Ordering::Relaxed))
            .sum()
    }

    /// Spans the collector accepted since start.
    pub fn exported(&self) -> u64 {
        self.exported.load(Ordering::Relaxed)
    }

    /// Every span queued now, oldest first per core, up to `most` (the export thread's
    /// intake).
    pub fn drain(&self, out: &mut Vec<SpanRecord>, most: usize) {
        for q in self.queues.iter() {
            while out.len() < most {
                match q.spans.pop() {
                    Some((s, cost)) => {
                        q.bytes.fetch_sub(cost, Ordering::Relaxed);
                        out.push(s);
                    }
                    None => break,
                }
            }
        }
    }

    /// Stop: the export thread sends what is queued (within its export timeout) and ends.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
        let handle = self.handle.lock().ok().and_then(|mut h| h.take());
        if let Some(h) = handle {
            let _ = h.join();
        }
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}

/// How often the export thread takes the queued spans (sooner when a queue is half full).
pub const EXPORT_INTERVAL: Duration = Duration::from_millis(200);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::entropy::Entropy;

    const SAMPLED: &[u8] = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    const UNSAMPLED: &[u8] = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";

    fn tracer(ratio: f64, trust: bool) -> Tracer {
        Tracer::detached(&Settings {
            ratio,
            trust_caller_sampling: trust,
            buffer: 8,
            ..Settings::default()
        })
    }

    #[test]
    fn a_trusted_callers_flag_or_the_ratio_decides_what_is_recorded() {
        let mut e = Entropy::default();
        let all = tracer(1.0, true);
        let none = tracer(0.0, true);
        assert!(all.begin(None, None, true, &mut e).is_some());
        assert!(none.begin(None, None, true, &mut e).is_none());
        assert!(none.begin(Some(SAMPLED), None, true, &mut e).is_some());
        assert!(all.begin(Some(UNSAMPLED), None, true, &mut e).is_none());
        // An invalid context starts a new trace (kept at the ratio).
        let t = all
            .begin(Some(b"garbage"), Some(b"a=b"), true, &mut e)
            .unwrap();
        assert_ne!(&t.trace_id()[..], &SAMPLED[3..19]);
        let half = tracer(0.5, true);
        let kept = (0..2000)
            .filter(|_| half.begin(None, None, true, &mut e).is_some())
            .count();
        assert!((850..1150).contains(&kept), "{kept}");
    }

    #[test]
    fn an_untrusted_callers_flag_does_not_decide_but_its_trace_is_continued() {
        let mut e = Entropy::default();
        // Trust off: the caller's sampled flag does not beat ratio 0, even when the request
        // is one the exchange would trust.
        let none = tracer(0.0, false);
        assert!(none.begin(Some(SAMPLED), None, true, &mut e).is_none());
        // Trust on, but this caller not trusted (no valid key).
        let none = tracer(0.0, true);
        assert!(none.begin(Some(SAMPLED), None, false, &mut e).is_none());
        // Ratio 1: recorded though the caller did not sample, in the caller's trace.
        let all = tracer(1.0, false);
        let t = all
            .begin(Some(UNSAMPLED), Some(b"k=v"), true, &mut e)
            .unwrap();
        assert_eq!(
            context::hex(t.trace_id()),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert!(t.continued());
        assert_eq!(t.trace_state(), Some("k=v"));
        // At ratio 0.5 the caller's choice of trace id does not decide either: about half of
        // one fixed, sampled context is kept.
        let half = tracer(0.5, false);
        let kept = (0..2000)
            .filter(|_| half.begin(Some(SAMPLED), None, true, &mut e).is_some())
            .count();
        assert!((850..1150).contains(&kept), "{kept}");
    }

    #[test]
    fn a_full_queue_drops_and_counts_without_blocking() {
        let mut e = Entropy::default();
        let tracer = Tracer::detached(&Settings {
            buffer: 3,
            cores: 2,
            ..Settings::default()
        });
        let t = tracer.begin(None, None, false, &mut e).unwrap();
        let mut t2 = tracer.begin(None, None, false, &mut e).unwrap();
        for _ in 0..4 {
            t2.child(&mut e, "admit", 1, 2, vec![]);
        }
        tracer.submit(0, t.finish(5));
        tracer.submit(0, t2.finish(5));
        assert_eq!(tracer.dropped(), 3);
        assert_eq!(tracer.dropped_by(DropReason::Spans), 3);
        let mut out = Vec::new();
        tracer.drain(&mut out, 100);
        assert_eq!(out.len(), 3);
        out.clear();
        tracer.drain(&mut out, 100);
        assert!(out.is_empty());
        assert_eq!(tracer.queued_bytes(), 0);
    }

    /// A request whose server span carries `path` as its `url.path` (what a client controls).
    fn big_request(tracer: &Tracer, e: &mut Entropy, path: usize) -> Vec<SpanRecord> {
        let mut t = tracer.begin(None, None, false, e).unwrap();
        t.set("url.path", "p".repeat(path));
        t.child(e, "admit", 1, 2, vec![]);
        t.finish(3).collect()
    }

    #[test]
    fn a_queue_holds_at_most_its_bytes_and_drops_the_rest_by_reason() {
        let mut e = Entropy::default();
        let tracer = Tracer::detached(&Settings {
            buffer: 8192,
            buffer_bytes: 1 << 20,
            ..Settings::default()
        });
        // 64 KiB paths: 8192 spans would be 256 MiB; 1 MiB holds about 15 of them.
        for _ in 0..100 {
            tracer.submit(0, big_request(&tracer, &mut e, 64 << 10).into_iter());
        }
        assert!(
            tracer.queued_bytes() <= 1 << 20,
            "{}",
            tracer.queued_bytes()
        );
        let over = tracer.dropped_by(DropReason::Bytes);
        assert!((80..=90).contains(&over), "{over}");
        assert_eq!(tracer.dropped_by(DropReason::Spans), 0);
        // Small spans still fit beside them until the bytes run out.
        let mut out = Vec::new();
        tracer.drain(&mut out, usize::MAX);
        assert_eq!(out.len() as u64, 200 - over);
        assert_eq!(tracer.queued_bytes(), 0);
        // Drained: the room is back.
        tracer.submit(0, big_request(&tracer, &mut e, 64 << 10).into_iter());
        assert_eq!(tracer.dropped_by(DropReason::Bytes), over);
    }

    #[test]
    fn a_caller_cannot_fill_the_queue_with_tracestate() {
        // Before the bound a 64 KiB tracestate rode on every server span: 8192 of them held
        // 512 MiB. Now each holds at most 512 bytes of it, and the default byte cap holds.
        let mut e = Entropy::default();
        let tracer = tracer(1.0, true);
        let state: Vec<String> = (0..2100)
            .map(|i| format!("k{i}=vvvvvvvvvvvvvvvvvvvvvvvvv"))
            .collect();
        let state = state.join(",");
        assert!(state.len() >= 60 << 10);
        let t = tracer
            .begin(Some(SAMPLED), Some(state.as_bytes()), true, &mut e)
            .unwrap();
        let spans: Vec<SpanRecord> = t.finish(1).collect();
        let root = spans.last().unwrap();
        assert!(root.trace_state.as_deref().unwrap().len() <= tracestate::MAX_BYTES);
        assert!(root.held_bytes() < 2048, "{}", root.held_bytes());
    }
}
