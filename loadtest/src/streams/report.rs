//! What `loadgen streams` reports: one JSON line for scripts (`--json`) and a short human
//! summary. Latencies are in microseconds with fractions, because a loopback proxy adds tens of
//! microseconds per event and whole microseconds would hide the difference between proxies.

use serde::Serialize;

use crate::loadgen::Histogram;

/// Quantiles of a latency histogram recorded in nanoseconds, in microseconds.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Quantiles {
    /// Values recorded.
    pub count: u64,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Largest.
    pub max: f64,
    /// Mean.
    pub mean: f64,
}

impl Quantiles {
    /// From a histogram of nanoseconds.
    pub fn of_ns(h: &Histogram) -> Quantiles {
        let us = |v: u64| v as f64 / 1e3;
        Quantiles {
            count: h.count(),
            p50: us(h.quantile(0.5)),
            p99: us(h.quantile(0.99)),
            p999: us(h.quantile(0.999)),
            max: us(h.max()),
            mean: h.mean() / 1e3,
        }
    }
}

/// Failed connections and answers, by kind, over the whole run (warm-up included: a failure
/// is never hidden by when it happened).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Errors {
    /// A connect that failed or was refused.
    pub connect: u64,
    /// An answer whose status was not 200.
    pub non_200: u64,
    /// The connection closed or reset with a request outstanding.
    pub broken: u64,
    /// No byte for `--stall-secs` with a request outstanding.
    pub timeout: u64,
    /// Not the HTTP/SSE expected (bad framing, no `[DONE]`, bytes nobody asked for).
    pub malformed: u64,
}

impl Errors {
    /// All of them.
    pub fn total(&self) -> u64 {
        self.connect + self.non_200 + self.broken + self.timeout + self.malformed
    }
}

/// The health probe's latencies during the window.
#[derive(Debug, Clone, Serialize)]
pub struct HealthReport {
    /// The path probed.
    pub path: String,
    /// Answers timed.
    pub count: u64,
    /// Median, µs.
    pub p50_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// Slowest, µs.
    pub max_us: f64,
    /// Failed probes (whole run).
    pub errors: u64,
}

/// The watched processes (the proxy) during the window.
#[derive(Debug, Clone, Serialize)]
pub struct WatchReport {
    /// The PIDs summed.
    pub pids: Vec<u32>,
    /// utime + stime over the window, seconds.
    pub cpu_s: f64,
    /// VmRSS before any connection was opened, KiB.
    pub rss_kb_before: u64,
    /// Largest VmRSS sampled in the window (every 0.5 s), KiB.
    pub rss_kb_open_max: u64,
    /// Median of those samples, KiB.
    pub rss_kb_open_median: u64,
}

/// One run of `loadgen streams`.
#[derive(Debug, Clone, Serialize)]
pub struct StreamsReport {
    /// `streams`, or `idle` (connections held without traffic).
    pub mode: String,
    /// Connections asked for.
    pub streams: usize,
    /// Connections open when the window closed.
    pub open_at_end: usize,
    /// Length of the window, seconds.
    pub window_s: f64,
    /// SSE data events received in the window.
    pub events: u64,
    /// `events` / `window_s`.
    pub events_per_s: f64,
    /// Event delay (receipt − the upstream's `sent_ns`), µs.
    pub delay_us: Quantiles,
    /// Time to first event (first event − request written), µs.
    pub ttft_us: Quantiles,
    /// Streams that ended (`[DONE]` and the final chunk) in the window.
    pub streams_completed: u64,
    /// Requests written, whole run.
    pub requests_sent: u64,
    /// Failures, whole run.
    pub errors: Errors,
    /// This process's CPU seconds in the window.
    pub cpu_s: f64,
    /// This process's CPU seconds, whole run.
    pub cpu_s_total: f64,
    /// The `/health` probe, when asked for.
    pub health: Option<HealthReport>,
    /// The watched PIDs, when given.
    pub watch: Option<WatchReport>,
}

impl StreamsReport {
    /// A few lines for a person.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        let e = &self.errors;
        if self.mode == "idle" {
            s += &format!(
                "idle: {} keep-alive connections asked, {} open at the end, held {:.1} s\n",
                self.streams, self.open_at_end, self.window_s
            );
        } else {
            let (d, t) = (&self.delay_us, &self.ttft_us);
            s += &format!(
                "streams: {} ({} open at the end), window {:.1} s\n\
                 events: {} ({:.0}/s), streams completed {}, requests sent {}\n\
                 event delay µs: p50 {:.1}, p99 {:.1}, p99.9 {:.1}, max {:.1}\n\
                 TTFT µs: p50 {:.1}, p99 {:.1}\n",
                self.streams,
                self.open_at_end,
                self.window_s,
                self.events,
                self.events_per_s,
                self.streams_completed,
                self.requests_sent,
                d.p50,
                d.p99,
                d.p999,
                d.max,
                t.p50,
                t.p99
            );
        }
        s += &format!(
            "errors: connect {}, non-200 {}, broken {}, timeout {}, malformed {}\n\
             loadgen CPU: {:.2} s in the window ({:.2} s in all)\n",
            e.connect, e.non_200, e.broken, e.timeout, e.malformed, self.cpu_s, self.cpu_s_total
        );
        if let Some(h) = &self.health {
            s += &format!(
                "GET {}: {} probes, p50 {:.0} µs, p99 {:.0} µs, max {:.0} µs, {} errors\n",
                h.path, h.count, h.p50_us, h.p99_us, h.max_us, h.errors
            );
        }
        if let Some(w) = &self.watch {
            s += &format!(
                "watched PIDs {:?}: {:.2} CPU-s in the window; RSS {} KiB before, {} KiB max while open\n",
                w.pids, w.cpu_s, w.rss_kb_before, w.rss_kb_open_max
            );
        }
        s
    }
}
