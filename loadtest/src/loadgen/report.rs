//! The result of a run: counts, rates, client-side cache hit rate and latency percentiles, as
//! JSON (for scripts and charts) and as a markdown table (for people).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::hist::LatencySummary;
use super::LoadConfig;

/// Everything one run measured. Latencies are taken from each request's *intended* send time,
/// so a stalled client or server shows up as latency, not as fewer samples.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// The configuration that produced this report.
    pub config: LoadConfig,
    /// Seconds from the start of the run to the last completed response.
    pub wall_s: f64,
    /// Sessions that sent at least one turn (a request of a single-turn workload is a session).
    pub sessions: u64,
    /// Requests written to the server.
    pub sent: u64,
    /// Requests answered 200 with a well-formed body.
    pub ok: u64,
    /// Requests that failed (see `errors`).
    pub failed: u64,
    /// Failures by kind: `http_<status>`, `connect`, `io`, `protocol`, `timeout`, `stream_error`,
    /// `deadline` (still running when the run's hard deadline hit).
    pub errors: BTreeMap<String, u64>,
    /// The first message seen for each error kind (for diagnosis).
    #[serde(default)]
    pub error_examples: BTreeMap<String, String>,
    /// Turns never sent: due after the send window, after a failed turn, or beyond
    /// `max_requests`.
    pub not_sent: u64,
    /// Open-loop requests refused because `max_inflight` were already outstanding.
    pub dropped: u64,
    /// Completed requests per second of `wall_s`.
    pub req_per_s: f64,
    /// Generated tokens per second (usage `completion_tokens`, else streamed events).
    pub output_tok_per_s: f64,
    /// Prompt tokens per second (usage `prompt_tokens`).
    pub prompt_tok_per_s: f64,
    /// Σ prompt tokens over responses that reported usage.
    pub prompt_tokens: u64,
    /// Σ cached tokens over the responses that reported `cached_tokens`.
    pub cached_tokens: u64,
    /// Σ prompt tokens over those same responses (the denominator of `hit_rate`).
    pub prompt_tokens_with_cache_info: u64,
    /// Σ generated tokens.
    pub completion_tokens: u64,
    /// Responses that reported `cached_tokens`.
    pub cache_reports: u64,
    /// Token-weighted client-side hit rate Σcached / Σprompt; `None` without any report.
    pub hit_rate: Option<f64>,
    /// Time to first generated text (first content event; first body byte when not streaming).
    pub ttft: LatencySummary,
    /// Gaps between successive content events of a stream.
    pub itl: LatencySummary,
    /// Intended send time to the end of the response.
    pub e2e: LatencySummary,
}

impl Report {
    /// A markdown section: one summary table and one latency table.
    pub fn to_markdown(&self) -> String {
        let c = &self.config;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "### loadgen `{}` via `{}` ({}) → {}\n",
            c.workload.name(),
            c.api.name(),
            if c.stream { "stream" } else { "no stream" },
            c.target
        );
        let _ = writeln!(s, "| metric | value |\n|---|---|");
        let _ = writeln!(
            s,
            "| arrival | {} (seed {}, time scale {}) |",
            c.arrival.name(),
            c.seed,
            c.time_scale
        );
        let _ = writeln!(s, "| wall time | {:.1} s |", self.wall_s);
        let _ = writeln!(s, "| sessions | {} |", self.sessions);
        let _ = writeln!(s, "| requests ok / sent | {} / {} |", self.ok, self.sent);
        if !self.errors.is_empty() {
            let e: Vec<String> = self
                .errors
                .iter()
                .map(|(k, v)| format!("{k} ×{v}"))
                .collect();
            let _ = writeln!(s, "| errors | {} |", e.join(", "));
        }
        if self.not_sent > 0 || self.dropped > 0 {
            let _ = writeln!(
                s,
                "| not sent / dropped | {} / {} |",
                self.not_sent, self.dropped
            );
        }
        let _ = writeln!(
            s,
            "| throughput | {:.2} req/s, {:.0} output tok/s, {:.0} prompt tok/s |",
            self.req_per_s, self.output_tok_per_s, self.prompt_tok_per_s
        );
        let hit = match self.hit_rate {
            Some(h) => format!(
                "{:.1} % ({} of {} prompt tokens cached)",
                h * 100.0,
                self.cached_tokens,
                self.prompt_tokens_with_cache_info
            ),
            None => "n/a (no cached_tokens in responses)".into(),
        };
        let _ = writeln!(s, "| client-side hit rate | {hit} |\n");
        let _ = writeln!(s, "| latency (ms) | n | p50 | p90 | p99 | p99.9 | mean | max |\n|---|---|---|---|---|---|---|---|");
        for (name, l) in [("TTFT", &self.ttft), ("ITL", &self.itl), ("E2E", &self.e2e)] {
            let _ = writeln!(
                s,
                "| {name} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
                l.count, l.p50_ms, l.p90_ms, l.p99_ms, l.p999_ms, l.mean_ms, l.max_ms
            );
        }
        s
    }
}
