//! OpenTelemetry tracing (`--enable-trace`): spans for each recorded request, exported over
//! OTLP/gRPC to `--otlp-traces-endpoint`.
//!
//! - `context`: W3C `traceparent` parse/format and the sampling rule (pure);
//! - `span`: what a core records: [`span::RequestTrace`] while a request lives, then finished
//!   [`span::SpanRecord`]s;
//! - `export`: the export thread, which turns records into the SDK's spans and sends them in
//!   batches through `opentelemetry-otlp`, on a small tokio runtime of its own.
//!
//! A serving core never waits for tracing: it pushes finished spans into its own bounded queue
//! ([`Tracer::submit`]); a full queue drops the span and counts it
//! (`radixgate_trace_spans_dropped_total`). With tracing off the gateway holds no [`Tracer`]
//! and a request costs one `Option` test.

pub mod context;
pub mod export;
pub mod span;

use crossbeam::queue::ArrayQueue;
use span::{RequestTrace, SpanRecord};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// What the export thread is told at start.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The OTLP/gRPC collector, `host:port` or `http://host:port`.
    pub endpoint: String,
    /// Share of new traces recorded (a caller's context decides by its own flag).
    pub ratio: f64,
    /// Finished spans each core may hold before the export thread takes them.
    pub buffer: usize,
    /// Serving cores (one queue each).
    pub cores: usize,
}

/// The tracing state every core shares: the per-core queues and the counters.
pub struct Tracer {
    ratio: f64,
    queues: Box<[ArrayQueue<SpanRecord>]>,
    dropped: AtomicU64,
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
    pub fn detached(ratio: f64, cores: usize, buffer: usize) -> Tracer {
        Tracer {
            ratio,
            queues: (0..cores.max(1))
                .map(|_| ArrayQueue::new(buffer.max(1)))
                .collect(),
            dropped: AtomicU64::new(0),
            exported: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            thread: OnceLock::new(),
            handle: Mutex::new(None),
        }
    }

    /// The tracer for `s`, with its export thread running.
    pub fn start(s: &Settings) -> Result<Arc<Tracer>, String> {
        let tracer = Arc::new(Tracer::detached(s.ratio, s.cores, s.buffer));
        export::spawn(&tracer, &s.endpoint)?;
        Ok(tracer)
    }

    /// The trace of a request whose head carried these `traceparent` / `tracestate` values,
    /// when it is recorded: the caller's context continued (its `sampled` flag decides), else
    /// a new trace kept at the sampling ratio. `None`: nothing is recorded for it.
    pub fn begin(
        &self,
        traceparent: Option<&[u8]>,
        tracestate: Option<&[u8]>,
        entropy: &mut crate::base::entropy::Entropy,
    ) -> Option<RequestTrace> {
        let start = span::now_ns();
        match traceparent.and_then(context::parse_traceparent) {
            Some(tp) if tp.sampled() => Some(RequestTrace::begin(
                Some(&tp),
                [0; 16],
                tracestate,
                entropy,
                start,
            )),
            Some(_) => None,
            None if self.ratio <= 0.0 => None,
            None => {
                let id = span::random_trace_id(entropy);
                context::sampled_at(&id, self.ratio)
                    .then(|| RequestTrace::begin(None, id, None, entropy, start))
            }
        }
    }

    /// Hand a finished request's spans to the export thread through core `core`'s queue;
    /// spans that do not fit are dropped and counted, never waited for.
    pub fn submit(&self, core: usize, spans: impl Iterator<Item = SpanRecord>) {
        let q = &self.queues[core % self.queues.len()];
        let mut dropped = 0u64;
        for s in spans {
            if q.push(s).is_err() {
                dropped += 1;
            }
        }
        if dropped > 0 {
            self.dropped.fetch_add(dropped, Ordering::Relaxed);
            crate::metrics::trace_spans_dropped(dropped);
        }
        // Half full: take them now rather than at the next tick.
        if q.len() * 2 >= q.capacity() {
            if let Some(t) = self.thread.get() {
                t.unpark();
            }
        }
    }

    /// Spans dropped on full queues since start.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Spans the collector accepted since start.
    pub fn exported(&self) -> u64 {
        self.exported.load(Ordering::Relaxed)
    }

    /// Every span queued now, oldest first per core (the export thread's intake).
    pub fn drain(&self, out: &mut Vec<SpanRecord>, most: usize) {
        for q in self.queues.iter() {
            while out.len() < most {
                match q.pop() {
                    Some(s) => out.push(s),
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

    #[test]
    fn the_callers_flag_or_the_ratio_decides_what_is_recorded() {
        let mut e = Entropy::default();
        let all = Tracer::detached(1.0, 1, 8);
        let none = Tracer::detached(0.0, 1, 8);
        assert!(all.begin(None, None, &mut e).is_some());
        assert!(none.begin(None, None, &mut e).is_none());
        assert!(none.begin(Some(SAMPLED), None, &mut e).is_some());
        assert!(all.begin(Some(UNSAMPLED), None, &mut e).is_none());
        // An invalid context starts a new trace (kept at the ratio).
        let t = all.begin(Some(b"garbage"), Some(b"a=b"), &mut e).unwrap();
        assert_ne!(&t.trace_id()[..], &SAMPLED[3..19]);
        let half = Tracer::detached(0.5, 1, 8);
        let kept = (0..2000)
            .filter(|_| half.begin(None, None, &mut e).is_some())
            .count();
        assert!((850..1150).contains(&kept), "{kept}");
    }

    #[test]
    fn a_full_queue_drops_and_counts_without_blocking() {
        let mut e = Entropy::default();
        let tracer = Tracer::detached(1.0, 2, 3);
        let t = tracer.begin(None, None, &mut e).unwrap();
        let mut t2 = tracer.begin(None, None, &mut e).unwrap();
        for _ in 0..4 {
            t2.child(&mut e, "admit", 1, 2, vec![]);
        }
        tracer.submit(0, t.finish(5));
        tracer.submit(0, t2.finish(5));
        assert_eq!(tracer.dropped(), 3);
        let mut out = Vec::new();
        tracer.drain(&mut out, 100);
        assert_eq!(out.len(), 3);
        out.clear();
        tracer.drain(&mut out, 100);
        assert!(out.is_empty());
    }
}
