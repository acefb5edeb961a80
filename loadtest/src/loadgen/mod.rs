//! `loadgen`: an HTTP load generator for LLM gateways and workers, measuring what a user of a
//! cache-aware router cares about — time to first token, inter-token latency, end-to-end latency,
//! throughput and the prompt-cache hit rate the servers report — under realistic workloads
//! (SGLang's generated-shared-prefix, multi-round QA, chat sessions with think times, Mooncake
//! trace replay, tiny fixed-rate requests), and two tenants on one overloaded fleet
//! ([`overload`]: an interactive tenant beside a batch tenant offered past capacity).
//!
//! Open loop by default: every request has an *intended* send time fixed by the workload (a
//! Poisson or fixed arrival, a trace timestamp, or a think time after the previous answer), and
//! latency is measured from that time, so a slow server cannot slow the client down and hide its
//! own tail (no coordinated omission). `Arrival::Closed` runs N users back to back instead.
//!
//! Every run is bounded: sessions start only inside `duration_s`, in-flight requests get
//! `drain_s` more, and at most `max_requests` are sent. Only loopback targets are accepted.

#![warn(missing_docs)]

mod client;
mod engine;
pub mod hist;
pub mod overload;
pub mod report;
pub mod response;
pub mod text;
pub mod trace;
pub mod workload;

#[cfg(test)]
mod e2e_tests;

use std::io;

use serde::{Deserialize, Serialize};

pub use client::Target;
pub use hist::{Histogram, LatencySummary};
pub use report::Report;
pub use workload::{ChatParams, GspParams, MrqaParams};

/// Which workload generator to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkloadKind {
    /// SGLang generated-shared-prefix: groups of prompts sharing a long system prompt, a burst.
    Gsp,
    /// vLLM multi-round QA: users with a shared system prompt and long private histories.
    Mrqa,
    /// Chat sessions per the reference generator spec (tenants, lognormal lengths, think times).
    Chat,
    /// Mooncake trace replay (`trace`, `trace_slowdown`).
    Trace,
    /// Tiny fixed-rate requests, to measure a gateway's own overhead.
    Rate,
}

impl WorkloadKind {
    /// The CLI spelling.
    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::Gsp => "gsp",
            WorkloadKind::Mrqa => "mrqa",
            WorkloadKind::Chat => "chat",
            WorkloadKind::Trace => "trace",
            WorkloadKind::Rate => "rate",
        }
    }
}

/// The HTTP API used for every request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// `POST /v1/chat/completions` with a messages array (system, user, assistant…).
    Chat,
    /// `POST /v1/completions` with the history flattened into one prompt.
    Completions,
    /// SGLang `POST /generate` with `text` and `sampling_params`.
    Generate,
}

impl Api {
    /// The CLI spelling.
    pub fn name(self) -> &'static str {
        match self {
            Api::Chat => "chat",
            Api::Completions => "completions",
            Api::Generate => "generate",
        }
    }

    /// Request path, relative to the target's base path.
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
            Api::Generate => "/generate",
        }
    }
}

/// How `/generate` prompts are sent as `input_ids` (see [`LoadConfig::input_ids`]): tokenized by
/// the simulator's own tokenizer in the mode the workers run (`sim-worker --tokenizer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InputIds {
    /// `sim-worker --tokenizer approx`.
    Approx,
    /// `sim-worker --tokenizer bpe` (cl100k).
    Bpe,
}

impl InputIds {
    /// The simulator's tokenizer mode.
    pub fn mode(self) -> crate::sim::TokenizerMode {
        match self {
            InputIds::Approx => crate::sim::TokenizerMode::Approx,
            InputIds::Bpe => crate::sim::TokenizerMode::Bpe,
        }
    }
}

/// How sessions (single requests are one-turn sessions) are started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arrival {
    /// The workload's own schedule: gsp a burst, mrqa staggered users, chat Poisson at `rate`,
    /// trace its timestamps, rate fixed at `rate`.
    Schedule,
    /// Poisson starts at `rate` per second (gaps × `time_scale`).
    Poisson,
    /// Evenly spaced starts at `rate` per second (gaps × `time_scale`).
    Fixed,
    /// Everything at time zero.
    Burst,
    /// `concurrency` users, each starting the next session when its previous one ends.
    Closed,
}

impl Arrival {
    /// The CLI spelling.
    pub fn name(self) -> &'static str {
        match self {
            Arrival::Schedule => "schedule",
            Arrival::Poisson => "poisson",
            Arrival::Fixed => "fixed",
            Arrival::Burst => "burst",
            Arrival::Closed => "closed",
        }
    }
}

/// A complete description of one run; serialisable, and echoed in the [`Report`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoadConfig {
    /// Base URL, e.g. `http://127.0.0.1:30000`; only 127.0.0.1, ::1 and localhost are accepted.
    pub target: String,
    /// Workload generator.
    pub workload: WorkloadKind,
    /// API for every request.
    pub api: Api,
    /// `Api::Generate` only: send each prompt as `input_ids` (BOS + the flattened history,
    /// tokenized as the simulated workers tokenize it) instead of `text`, so a gateway measures
    /// prompts in tokens without a tokenizer of its own. The generated words re-tokenize to the
    /// ids the worker generated, so the next turn's ids extend what the worker cached.
    #[serde(default)]
    pub input_ids: Option<InputIds>,
    /// Ask for a streamed response (SSE). Streaming chat/completions requests also ask for
    /// `stream_options.include_usage`, so `cached_tokens` arrives in the last chunk.
    pub stream: bool,
    /// Session start process.
    pub arrival: Arrival,
    /// Rate for `poisson`/`fixed` arrivals, chat session starts, mrqa qps, `rate` requests/s;
    /// `None` = 1/s (10/s for the `rate` workload). Per unscaled second (see `time_scale`).
    pub rate: Option<f64>,
    /// Users of the closed loop.
    pub concurrency: usize,
    /// Send window, seconds: nothing is sent after it.
    pub duration_s: f64,
    /// Extra time for in-flight requests after the window; then the run ends regardless.
    pub drain_s: f64,
    /// Per-request timeout, seconds, counted from the intended send time.
    pub request_timeout_s: f64,
    /// Workload size: first N gsp prompts / trace records / rate requests; a cap for others.
    pub num_requests: Option<u64>,
    /// Hard cap on requests sent (and sessions started).
    pub max_requests: u64,
    /// Open loop: most requests outstanding at once; beyond it requests are dropped (counted).
    pub max_inflight: usize,
    /// Send `X-SMG-Routing-Key: <session key>` (the oracle for sticky routing).
    pub session_header: bool,
    /// Multiplies think times and arrival gaps (and trace timestamps): 0.01 runs a 2-minute
    /// think time in 1.2 s, for CI.
    pub time_scale: f64,
    /// Seed of every random choice; the same seed sends the same prompts in the same order.
    pub seed: u64,
    /// `model` field of OpenAI requests.
    pub model: String,
    /// No progress line.
    pub quiet: bool,
    /// Trace file or name (`conversation`, `synthetic`) for the trace workload.
    pub trace: String,
    /// Multiplies trace timestamps (2.0 = half speed).
    pub trace_slowdown: f64,
    /// gsp sizes.
    pub gsp: GspParams,
    /// mrqa sizes.
    pub mrqa: MrqaParams,
    /// chat generator parameters.
    pub chat: ChatParams,
}

impl Default for LoadConfig {
    fn default() -> Self {
        LoadConfig {
            target: "http://127.0.0.1:30000".into(),
            workload: WorkloadKind::Chat,
            api: Api::Chat,
            input_ids: None,
            stream: true,
            arrival: Arrival::Schedule,
            rate: None,
            concurrency: 8,
            duration_s: 60.0,
            drain_s: 60.0,
            request_timeout_s: 120.0,
            num_requests: None,
            max_requests: 20_000,
            max_inflight: 4096,
            session_header: false,
            time_scale: 1.0,
            seed: 1,
            model: "default".into(),
            quiet: false,
            trace: "conversation".into(),
            trace_slowdown: 1.0,
            gsp: GspParams::default(),
            mrqa: MrqaParams::default(),
            chat: ChatParams::default(),
        }
    }
}

impl LoadConfig {
    /// A tiny multi-turn chat workload (6 sessions of 2–4 short turns, think times of a few
    /// hundred ms, ≤ 10 s): the end-to-end smoke test, against a worker or through a gateway.
    pub fn smoke(target: &str) -> Self {
        LoadConfig {
            target: target.into(),
            workload: WorkloadKind::Chat,
            rate: Some(2.0),
            duration_s: 6.0,
            drain_s: 4.0,
            request_timeout_s: 8.0,
            max_requests: 200,
            time_scale: 0.002,
            quiet: true,
            chat: ChatParams {
                sessions: Some(6),
                tenants: 2,
                system_median: 300.0,
                extra_turns_mean: 1.5,
                min_turns: 2,
                max_turns: 4,
                one_shot_frac: 0.0,
                doc_frac: 0.0,
                context_frac: 0.0,
                question_median: 40.0,
                answer_median: 24.0,
                ..ChatParams::default()
            },
            ..LoadConfig::default()
        }
    }

    /// The rate used by this workload (see [`LoadConfig::rate`]).
    pub fn effective_rate(&self) -> f64 {
        self.rate.unwrap_or(if self.workload == WorkloadKind::Rate {
            10.0
        } else {
            1.0
        })
    }

    fn validate(&self) -> io::Result<()> {
        let nonneg_scale = |x: f64| x.is_finite() && x >= 0.0;
        let bad = |m: String| Err(io::Error::new(io::ErrorKind::InvalidInput, m));
        let pos = |x: f64| x.is_finite() && x > 0.0;
        if !pos(self.effective_rate()) {
            return bad(format!("rate must be > 0, got {}", self.effective_rate()));
        }
        if !nonneg_scale(self.time_scale) {
            return bad(format!("time scale must be >= 0, got {}", self.time_scale));
        }
        let nonneg = |x: f64| x.is_finite() && x >= 0.0;
        if !(pos(self.duration_s) && nonneg(self.drain_s) && pos(self.request_timeout_s)) {
            return bad("duration, drain and request timeout must be positive seconds".into());
        }
        if self.duration_s + self.drain_s > 7.0 * 24.0 * 3600.0 {
            return bad("duration + drain exceeds a week".into());
        }
        if !pos(self.trace_slowdown) {
            return bad(format!(
                "trace slowdown must be > 0, got {}",
                self.trace_slowdown
            ));
        }
        if self.arrival == Arrival::Closed && self.concurrency == 0 {
            return bad("closed loop needs --concurrency >= 1".into());
        }
        if self.input_ids.is_some() && self.api != Api::Generate {
            return bad("input ids need --api generate".into());
        }
        if self.max_requests == 0 || self.max_inflight == 0 {
            return bad("max requests and max in-flight must be >= 1".into());
        }
        Target::parse(&self.target).map(|_| ())
    }
}

/// Run one load test to completion (or its deadline) and report. Runs on a fresh thread with
/// its own single-threaded monoio runtime (io_uring, or epoll with
/// `MONOIO_FORCE_LEGACY_DRIVER=1`), so it can be called from tests and from inside other
/// runtimes alike.
pub fn run(cfg: &LoadConfig) -> io::Result<Report> {
    cfg.validate()?;
    let cfg = cfg.clone();
    std::thread::Builder::new()
        .name("loadgen".into())
        .spawn(move || engine::run_blocking(cfg))?
        .join()
        .map_err(|_| io::Error::other("loadgen thread panicked"))?
}

/// Run [`LoadConfig::smoke`] against `target`: a short multi-turn chat workload for CI checks
/// (e.g. through the gateway). Returns the report; callers assert on `ok`, `ttft` and
/// `hit_rate`.
pub fn run_smoke(target: &str) -> io::Result<Report> {
    run(&LoadConfig::smoke(target))
}
