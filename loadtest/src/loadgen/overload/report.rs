//! The result of an overload run: per tenant (interactive, batch) what was sent, answered,
//! refused and timed out, latency percentiles and goodput over the measurement window, and
//! what the servers were doing meanwhile; as JSON (for the benchmark script) and markdown.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::sampler::ServerSummary;
use super::OverloadConfig;
use crate::loadgen::hist::LatencySummary;

/// One tenant's outcome.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TenantReport {
    /// Sessions that sent a turn (interactive; 0 for batch).
    pub sessions: u64,
    /// Requests written.
    pub sent: u64,
    /// Answered 200 with a well-formed body.
    pub ok: u64,
    /// Answered 429 (refused by admission).
    pub refused: u64,
    /// Gave up by the client's own timeout, or answered 408/504 (a gateway's queue timeout).
    pub timed_out: u64,
    /// Still running when the run ended.
    pub unfinished: u64,
    /// TTFT samples that are the time a request waited without an answer (timed out or cut by
    /// the end of the run): a request that never got its first token counts with what it
    /// waited (a stream cut after its first token counts its whole wait as well).
    #[serde(default)]
    pub ttft_waited: u64,
    /// Not sent because `max_inflight` were outstanding.
    pub dropped: u64,
    /// Turns never sent (after a failed turn, or due after the send window).
    pub not_sent: u64,
    /// Other failures by kind (`http_<status>`, `connect`, `io`, `protocol`, `stream_error`).
    pub errors: BTreeMap<String, u64>,
    /// The first message of each error kind.
    pub error_examples: BTreeMap<String, String>,
    /// Σ prompt tokens of answered requests (usage).
    pub prompt_tokens: u64,
    /// Σ output tokens of answered requests.
    pub output_tokens: u64,
    /// Requests answered inside the measurement window.
    pub window_ok: u64,
    /// Their prompt tokens.
    pub window_prompt_tokens: u64,
    /// Their output tokens.
    pub window_output_tokens: u64,
    /// Output tokens of the requests completed in each second of the run, from its start (when
    /// goodput reached its steady state).
    #[serde(default)]
    pub output_tokens_by_second: Vec<u64>,
    /// `window_ok` per second of the window.
    pub req_per_s: f64,
    /// Goodput: completed prompt tokens per second of the window.
    pub prompt_tok_per_s: f64,
    /// Goodput: completed output tokens per second of the window.
    pub output_tok_per_s: f64,
    /// Time to first content (streamed) or to the whole answer (not streamed), of the requests
    /// sent inside the window.
    pub ttft: LatencySummary,
    /// Intended send time to the end of the answer, of the same requests.
    pub e2e: LatencySummary,
}

/// Everything one overload run measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OverloadReport {
    /// The configuration that produced it.
    pub config: OverloadConfig,
    /// Length of the measurement window, seconds (warm-up to the end of the send window).
    pub window_s: f64,
    /// The interactive tenant.
    pub interactive: TenantReport,
    /// The batch tenant.
    pub batch: TenantReport,
    /// The workers over the window (empty without `workers`).
    pub servers: ServerSummary,
}

fn opt(v: Option<f64>, scale: f64, digits: usize) -> String {
    v.map_or_else(|| "n/a".into(), |x| format!("{:.*}", digits, x * scale))
}

impl OverloadReport {
    /// A markdown section: per-tenant table, latency table and the servers' figures.
    pub fn to_markdown(&self) -> String {
        let c = &self.config;
        let mut s = String::new();
        let _ = writeln!(s, "### loadgen `overload` → {}\n", c.target);
        let b = &c.batch;
        let offered = if b.concurrency > 0 {
            format!("closed loop of {} users", b.concurrency)
        } else {
            format!("{} req/s Poisson", b.rate)
        };
        let _ = writeln!(
            s,
            "Send window {} s (measured from {} s: {:.0} s), seed {}. Interactive: {} sessions/s of {}-{} turns, key `{}`, priority {}. Batch: {offered}, prompts {}-{} tokens, outputs {}-{}, key `{}`, priority {}.\n",
            c.duration_s,
            c.warmup_s,
            self.window_s,
            c.seed,
            c.interactive.session_rate,
            c.interactive.min_turns,
            c.interactive.max_turns,
            c.interactive.tenant.api_key,
            c.interactive.tenant.priority,
            b.prompt_tokens.0,
            b.prompt_tokens.1,
            b.output_tokens.0,
            b.output_tokens.1,
            b.tenant.api_key,
            b.tenant.priority,
        );
        let _ = writeln!(
            s,
            "| tenant | sent | ok | 429 | timed out | unfinished | other errors | goodput out tok/s | goodput prompt tok/s | TTFT p50 ms | TTFT p99 ms | E2E p50 ms | E2E p99 ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        );
        for (name, t) in [("interactive", &self.interactive), ("batch", &self.batch)] {
            let errs: u64 = t.errors.values().sum::<u64>() + t.dropped;
            let _ = writeln!(
                s,
                "| {name} | {} | {} | {} | {} | {} | {errs} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} |",
                t.sent,
                t.ok,
                t.refused,
                t.timed_out,
                t.unfinished,
                t.output_tok_per_s,
                t.prompt_tok_per_s,
                t.ttft.p50_ms,
                t.ttft.p99_ms,
                t.e2e.p50_ms,
                t.e2e.p99_ms,
            );
        }
        for (name, t) in [("interactive", &self.interactive), ("batch", &self.batch)] {
            if t.ttft_waited > 0 {
                let _ = writeln!(
                    s,
                    "\n{name}: {} of the {} TTFT samples are the wait of a request with no first token in time.",
                    t.ttft_waited, t.ttft.count
                );
            }
            for (k, v) in &t.errors {
                let ex = t.error_examples.get(k).map_or("", String::as_str);
                let _ = writeln!(s, "\n{name} error `{k}` ×{v}: {ex}");
            }
        }
        let sv = &self.servers;
        if sv.rounds > 0 {
            let _ = writeln!(
                s,
                "\nServers over the window ({} samples): KV use {} %, running {}, queued {}, GPU idle {} %.",
                sv.rounds,
                opt(sv.kv_usage_mean, 100.0, 1),
                opt(sv.running_mean, 1.0, 1),
                opt(sv.queued_mean, 1.0, 1),
                opt(sv.idle_share, 100.0, 1),
            );
        }
        s
    }
}
