//! `--workload overload`: two tenants share one gateway, to see what admission under overload
//! does for the one that matters.
//!
//! - The **interactive** tenant: short multi-turn chats, streamed, at a steady modest rate
//!   (Poisson session starts, think times between turns), API key `interactive-key`,
//!   `X-SMG-Priority: 10`.
//! - The **batch** tenant: long prompts (4-8k tokens) whose answers nobody watches, API key
//!   `batch-key`, priority 0, either offered open loop at a fixed rate (e.g. 3× what the fleet
//!   can serve) or, to measure that capacity, as a closed loop of N users.
//!
//! Both go to `/v1/chat/completions` with the tenant's key as a bearer token, its class in
//! `X-SMG-Priority` and SGLang's `priority` body field. Latencies count from each request's
//! intended send time (open loop, no coordinated omission), over the requests sent after
//! `warmup_s`; a request that got no first token in time counts in the TTFT with the time it waited (one whose answer was cut off after its first token counts with that token's time). Each tenant is reported on its own: TTFT and E2E percentiles, requests refused
//! (429), timed out (the client's timeout, or a
//! gateway's 408/504) and unfinished at the end, and goodput — completed prompt and output
//! tokens per second over the measurement window (after `warmup_s`, up to the end of the send
//! window), so a gateway that keeps the GPUs busy on work that completes shows it. With
//! `workers`, every worker's `/metrics` is sampled during the run ([`sampler`]): mean KV use,
//! running and queued requests, and idle GPU share over the same window.
//!
//! Request bodies are drawn before the clock starts ([`plan`]); the run is bounded by the send
//! window plus `drain_s`, and only loopback targets are accepted.

pub mod cli;
pub mod plan;
pub mod report;
pub mod sampler;

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::rc::Rc;
use std::time::{Duration, Instant};

use monoio::time::{sleep, sleep_until, timeout_at};
use serde::{Deserialize, Serialize};

use super::client::{exchange_noting_first, Exchange, Pool, ReqError, Target};
use super::hist::Histogram;
use plan::{BatchRequest, Message, Session};
pub use report::{OverloadReport, TenantReport};

/// Closed loop: requests drawn per user (a saturated fleet completes one or two per user in a
/// short measuring run; the rest bound the pool's memory).
pub const CLOSED_POOL_PER_USER: u64 = 8;

/// The chat endpoint every request goes to.
const PATH: &str = "/v1/chat/completions";

/// Which tenant a request belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TenantClass {
    /// Short streamed chats.
    Interactive,
    /// Long prompts, not streamed.
    Batch,
}

/// Who a tenant is to the gateway.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Tenant {
    /// API key, sent as `Authorization: Bearer KEY` (empty: no header).
    pub api_key: String,
    /// `X-SMG-Priority` and the body's `priority`.
    pub priority: i64,
    /// Per-request timeout, seconds from the intended send time.
    pub request_timeout_s: f64,
}

/// The interactive tenant.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InteractiveParams {
    /// Key, priority and timeout.
    pub tenant: Tenant,
    /// Session starts per second (Poisson); 0 sends none.
    pub session_rate: f64,
    /// Most sessions started.
    pub max_sessions: u64,
    /// Fewest turns of a session.
    pub min_turns: u32,
    /// Most turns of a session.
    pub max_turns: u32,
    /// Shared system prompt, tokens.
    pub system_tokens: u32,
    /// Question length range, tokens.
    pub question_tokens: (u32, u32),
    /// Answer length range, tokens.
    pub answer_tokens: (u32, u32),
    /// Think time range between an answer and the next question, seconds.
    pub think_s: (f64, f64),
}

impl Default for InteractiveParams {
    fn default() -> Self {
        InteractiveParams {
            tenant: Tenant {
                api_key: "interactive-key".into(),
                priority: 10,
                request_timeout_s: 30.0,
            },
            session_rate: 1.0,
            max_sessions: 10_000,
            min_turns: 2,
            max_turns: 4,
            system_tokens: 200,
            question_tokens: (30, 150),
            answer_tokens: (32, 96),
            think_s: (1.0, 3.0),
        }
    }
}

/// The batch tenant.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchParams {
    /// Key, priority and timeout.
    pub tenant: Tenant,
    /// Requests per second (Poisson), when `concurrency` is 0; 0 sends none.
    pub rate: f64,
    /// > 0: a closed loop of this many users instead of `rate`.
    pub concurrency: usize,
    /// Closed loop: the users start evenly spread over this many seconds, not all at once (a
    /// burst of long prompts fills every worker's KV together, and the batch then finishes in
    /// waves that take many periods to blur).
    #[serde(default)]
    pub ramp_s: f64,
    /// Prompt length range, tokens.
    pub prompt_tokens: (u32, u32),
    /// Output length range, tokens.
    pub output_tokens: (u32, u32),
    /// Most requests drawn (and sent).
    pub max_requests: u64,
}

impl Default for BatchParams {
    fn default() -> Self {
        BatchParams {
            tenant: Tenant {
                api_key: "batch-key".into(),
                priority: 0,
                request_timeout_s: 60.0,
            },
            rate: 0.0,
            concurrency: 0,
            ramp_s: 0.0,
            prompt_tokens: (4000, 8000),
            output_tokens: (128, 384),
            max_requests: 20_000,
        }
    }
}

/// One overload run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OverloadConfig {
    /// Gateway (or worker) base URL; loopback only.
    pub target: String,
    /// `model` of every request.
    pub model: String,
    /// Send window, seconds.
    pub duration_s: f64,
    /// Start of the measurement window (goodput, server samples), seconds.
    pub warmup_s: f64,
    /// Extra time for in-flight requests after the send window.
    pub drain_s: f64,
    /// Seeds every draw.
    pub seed: u64,
    /// Most requests outstanding at once per tenant; beyond it requests are dropped (counted).
    pub max_inflight: usize,
    /// Also send SGLang's `priority` body field.
    pub body_priority: bool,
    /// The interactive tenant.
    pub interactive: InteractiveParams,
    /// The batch tenant.
    pub batch: BatchParams,
    /// Worker base URLs whose `/metrics` are sampled (loopback only); empty: none.
    pub workers: Vec<String>,
    /// Seconds between samples.
    pub sample_interval_s: f64,
    /// The workers' virtual seconds per real second (`sim-worker --time-scale`), for the idle
    /// share.
    pub sim_time_scale: f64,
}

impl Default for OverloadConfig {
    fn default() -> Self {
        OverloadConfig {
            target: "http://127.0.0.1:30000".into(),
            model: "default".into(),
            duration_s: 60.0,
            warmup_s: 15.0,
            drain_s: 5.0,
            seed: 1,
            max_inflight: 8192,
            body_priority: true,
            interactive: InteractiveParams::default(),
            batch: BatchParams::default(),
            workers: Vec::new(),
            sample_interval_s: 1.0,
            sim_time_scale: 1.0,
        }
    }
}

impl OverloadConfig {
    /// The tenant of `class`.
    pub fn tenant(&self, class: TenantClass) -> &Tenant {
        match class {
            TenantClass::Interactive => &self.interactive.tenant,
            TenantClass::Batch => &self.batch.tenant,
        }
    }

    fn validate(&self) -> io::Result<()> {
        let bad = |m: String| Err(io::Error::new(io::ErrorKind::InvalidInput, m));
        let pos = |x: f64| x.is_finite() && x > 0.0;
        let nonneg = |x: f64| x.is_finite() && x >= 0.0;
        if !(pos(self.duration_s) && nonneg(self.drain_s) && nonneg(self.warmup_s)) {
            return bad("duration must be > 0, warm-up and drain >= 0 seconds".into());
        }
        if self.warmup_s >= self.duration_s {
            return bad(format!(
                "warm-up ({} s) must end before the send window does ({} s)",
                self.warmup_s, self.duration_s
            ));
        }
        if self.duration_s + self.drain_s > 24.0 * 3600.0 {
            return bad("duration + drain exceeds a day".into());
        }
        if !(nonneg(self.interactive.session_rate)
            && nonneg(self.batch.rate)
            && nonneg(self.batch.ramp_s))
        {
            return bad("rates and the ramp must be >= 0".into());
        }
        for t in [&self.interactive.tenant, &self.batch.tenant] {
            if !pos(t.request_timeout_s) {
                return bad("request timeouts must be > 0 seconds".into());
            }
            if t.api_key.bytes().any(|b| b.is_ascii_control() || b == b' ') {
                return bad("an API key must be one printable word".into());
            }
        }
        if !(pos(self.sample_interval_s) && pos(self.sim_time_scale)) {
            return bad("sample interval and sim time scale must be > 0".into());
        }
        if self.max_inflight == 0 {
            return bad("max in-flight must be >= 1".into());
        }
        Target::parse(&self.target)?;
        for w in &self.workers {
            Target::parse(w)?;
        }
        Ok(())
    }
}

/// One tenant's counters during the run.
#[derive(Default)]
struct Stats {
    ttft: Histogram,
    e2e: Histogram,
    sent: u64,
    ok: u64,
    refused: u64,
    timed_out: u64,
    /// Cut by the end of the run.
    unfinished: u64,
    /// TTFT samples that are the time waited by a request that got no answer.
    ttft_waited: u64,
    inflight: u64,
    dropped: u64,
    not_sent: u64,
    errors: BTreeMap<String, u64>,
    error_examples: BTreeMap<String, String>,
    window_ok: u64,
    window_prompt_tokens: u64,
    window_output_tokens: u64,
    prompt_tokens: u64,
    output_tokens: u64,
    sessions: u64,
    /// Output tokens completed in each second of the run (to see when it reached steady state).
    output_by_second: Vec<u64>,
}

impl Stats {
    fn error(&mut self, kind: &str, detail: impl FnOnce() -> String) {
        *self.errors.entry(kind.to_string()).or_insert(0) += 1;
        if !self.error_examples.contains_key(kind) {
            self.error_examples.insert(kind.to_string(), detail());
        }
    }
}

struct Ctx {
    cfg: OverloadConfig,
    target: Target,
    path: String,
    pool: Pool,
    t0: Instant,
    send_end: Instant,
    hard_end: Instant,
    window: (Instant, Instant),
    interactive: RefCell<Stats>,
    batch: RefCell<Stats>,
    system: String,
    /// Closed loop: the requests drawn before the run and not yet sent.
    batch_pool: RefCell<VecDeque<BatchRequest>>,
    /// Closed loop: draws the next requests once the pool is used up (up to `max_requests`).
    draw: RefCell<plan::BatchDraw>,
    /// Tasks (dispatchers, sessions, requests) still running.
    live: Cell<u64>,
}

impl Ctx {
    fn stats(&self, class: TenantClass) -> &RefCell<Stats> {
        match class {
            TenantClass::Interactive => &self.interactive,
            TenantClass::Batch => &self.batch,
        }
    }
}

/// Counts a task as live while it runs.
struct Live(Rc<Ctx>);

impl Live {
    fn new(ctx: &Rc<Ctx>) -> Live {
        ctx.live.set(ctx.live.get() + 1);
        Live(ctx.clone())
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        self.0.live.set(self.0.live.get() - 1);
    }
}

fn mono(t: Instant) -> monoio::time::Instant {
    monoio::time::Instant::from_std(t)
}

/// Run one overload test to completion (or its deadline) and report. Runs on a fresh thread
/// with its own single-threaded monoio runtime, as [`crate::loadgen::run`] does.
pub fn run(cfg: &OverloadConfig) -> io::Result<OverloadReport> {
    cfg.validate()?;
    let cfg = cfg.clone();
    std::thread::Builder::new()
        .name("loadgen-overload".into())
        .spawn(move || {
            let target = Target::parse(&cfg.target)?;
            let path = format!("{}{PATH}", target.base_path);
            let sessions = plan::sessions(&cfg);
            let mut draw = plan::BatchDraw::new(&cfg);
            let batch = plan::batch(&cfg, &mut draw, &target.host, &path);
            let system = plan::system_prompt(&cfg);
            let mut rt = monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
                .enable_timer()
                .build()?;
            let planned = Planned {
                system,
                sessions,
                batch,
                draw,
            };
            rt.block_on(run_async(cfg, target, path, planned))
        })?
        .join()
        .map_err(|_| io::Error::other("loadgen thread panicked"))?
}

/// What is drawn before the clock starts.
struct Planned {
    system: String,
    sessions: Vec<Session>,
    batch: Vec<BatchRequest>,
    /// Closed loop: draws more batch requests once the drawn ones are used up.
    draw: plan::BatchDraw,
}

async fn run_async(
    cfg: OverloadConfig,
    target: Target,
    path: String,
    planned: Planned,
) -> io::Result<OverloadReport> {
    let Planned {
        system,
        sessions,
        batch,
        draw,
    } = planned;
    let t0 = Instant::now();
    let secs = Duration::from_secs_f64;
    let sampler = if cfg.workers.is_empty() {
        None
    } else {
        Some(sampler::Sampler::start(
            &cfg.workers,
            secs(cfg.sample_interval_s),
            t0,
        )?)
    };
    let send_end = t0 + secs(cfg.duration_s);
    let closed = cfg.batch.concurrency > 0;
    // Closed loop: the users take from the pool; open loop: the dispatcher sends at each time.
    let (pool, open): (VecDeque<BatchRequest>, _) = if closed {
        (batch.into(), Vec::new())
    } else {
        (VecDeque::new(), batch)
    };
    let ctx = Rc::new(Ctx {
        target,
        path,
        pool: Pool::default(),
        t0,
        send_end,
        hard_end: send_end + secs(cfg.drain_s),
        window: (t0 + secs(cfg.warmup_s), send_end),
        interactive: RefCell::default(),
        batch: RefCell::default(),
        system,
        batch_pool: RefCell::new(pool),
        draw: RefCell::new(draw),
        live: Cell::new(0),
        cfg,
    });
    monoio::spawn(dispatch_sessions(Live::new(&ctx), sessions));
    if closed {
        let users = ctx.cfg.batch.concurrency;
        for i in 0..users {
            let start = ctx.t0 + secs(ctx.cfg.batch.ramp_s * i as f64 / users as f64);
            monoio::spawn(closed_user(Live::new(&ctx), start));
        }
    } else {
        monoio::spawn(dispatch_batch(Live::new(&ctx), open));
    }
    // Every request's deadline is at the latest the run's end, so its task records it then;
    // a moment more lets the last of them do so.
    let give_up = ctx.hard_end + Duration::from_millis(500);
    loop {
        sleep(Duration::from_millis(20)).await;
        if ctx.live.get() == 0 || Instant::now() >= give_up {
            break;
        }
    }
    let rounds = sampler.map(|s| s.finish()).unwrap_or_default();
    let c = &ctx.cfg;
    let servers = sampler::summarise(
        &c.workers,
        &rounds,
        c.warmup_s,
        c.duration_s,
        c.sim_time_scale,
    );
    let window_s = c.duration_s - c.warmup_s;
    let interactive = tenant_report(&ctx.interactive.borrow(), window_s);
    let batch = tenant_report(&ctx.batch.borrow(), window_s);
    Ok(OverloadReport {
        config: ctx.cfg.clone(),
        window_s,
        interactive,
        batch,
        servers,
    })
}

fn tenant_report(s: &Stats, window_s: f64) -> TenantReport {
    TenantReport {
        sessions: s.sessions,
        sent: s.sent,
        ok: s.ok,
        refused: s.refused,
        timed_out: s.timed_out,
        unfinished: s.unfinished + s.inflight,
        ttft_waited: s.ttft_waited,
        dropped: s.dropped,
        not_sent: s.not_sent,
        errors: s.errors.clone(),
        error_examples: s.error_examples.clone(),
        prompt_tokens: s.prompt_tokens,
        output_tokens: s.output_tokens,
        window_ok: s.window_ok,
        window_prompt_tokens: s.window_prompt_tokens,
        window_output_tokens: s.window_output_tokens,
        output_tokens_by_second: s.output_by_second.clone(),
        req_per_s: s.window_ok as f64 / window_s,
        prompt_tok_per_s: s.window_prompt_tokens as f64 / window_s,
        output_tok_per_s: s.window_output_tokens as f64 / window_s,
        ttft: s.ttft.summary_ms(),
        e2e: s.e2e.summary_ms(),
    }
}

/// Start each interactive session at its time.
async fn dispatch_sessions(live: Live, sessions: Vec<Session>) {
    let ctx = live.0.clone();
    for s in sessions {
        let at = ctx.t0 + s.at;
        if at > ctx.send_end {
            break;
        }
        if at > Instant::now() {
            sleep_until(mono(at)).await;
        }
        monoio::spawn(run_session(Live::new(&ctx), s, at));
    }
    drop(live);
}

/// One interactive session: each turn after the previous answer and a think time; the history
/// (system prompt, questions, answers) is sent whole every turn, as a chat client does.
async fn run_session(live: Live, session: Session, start: Instant) {
    let ctx = live.0.clone();
    let class = TenantClass::Interactive;
    let mut history: Vec<(&'static str, String)> = Vec::with_capacity(session.turns.len() * 2);
    let mut intended = start;
    let mut counted = false;
    let n = session.turns.len() as u64;
    for (k, turn) in session.turns.into_iter().enumerate() {
        if k > 0 {
            intended = Instant::now() + turn.think;
        }
        if intended > ctx.send_end {
            ctx.interactive.borrow_mut().not_sent += n - k as u64;
            break;
        }
        if intended > Instant::now() {
            sleep_until(mono(intended)).await;
        }
        if !admit(&ctx, class, n - k as u64 - 1) {
            break;
        }
        if !counted {
            ctx.interactive.borrow_mut().sessions += 1;
            counted = true;
        }
        history.push(("user", turn.question));
        let mut messages = Vec::with_capacity(history.len() + 1);
        messages.push(Message {
            role: "system",
            content: &ctx.system,
        });
        messages.extend(history.iter().map(|(role, content)| Message {
            role,
            content: content.as_str(),
        }));
        let body = plan::body(&ctx.cfg, class, &messages, turn.max_tokens);
        drop(messages);
        let req = plan::request(&ctx.cfg, class, &ctx.target.host, &ctx.path, &body);
        match send(&ctx, class, intended, req, true).await {
            Some(answer) => history.push(("assistant", answer)),
            None => {
                ctx.interactive.borrow_mut().not_sent += n - k as u64 - 1;
                break;
            }
        }
    }
    drop(live);
}

/// Open loop: send each batch request at its time, whatever the server is doing.
async fn dispatch_batch(live: Live, batch: Vec<BatchRequest>) {
    let ctx = live.0.clone();
    for r in batch {
        let at = ctx.t0 + r.at;
        if at > ctx.send_end {
            break;
        }
        if at > Instant::now() {
            sleep_until(mono(at)).await;
        }
        if !admit(&ctx, TenantClass::Batch, 0) {
            continue;
        }
        let ctx2 = ctx.clone();
        let task = Live::new(&ctx);
        monoio::spawn(async move {
            send(&ctx2, TenantClass::Batch, at, r.bytes, false).await;
            drop(task);
        });
    }
    drop(live);
}

/// Closed loop: one batch user, from `start` on sending the next request when the previous one
/// is done.
async fn closed_user(live: Live, start: Instant) {
    let ctx = live.0.clone();
    if start > Instant::now() {
        sleep_until(mono(start)).await;
    }
    while Instant::now() < ctx.send_end {
        let next = ctx.batch_pool.borrow_mut().pop_front();
        let r = match next {
            Some(r) => r,
            None => {
                let mut d = ctx.draw.borrow_mut();
                if d.drawn() >= ctx.cfg.batch.max_requests {
                    break;
                }
                d.draw(&ctx.cfg, &ctx.target.host, &ctx.path, Duration::ZERO)
            }
        };
        if !admit(&ctx, TenantClass::Batch, 0) {
            break;
        }
        send(&ctx, TenantClass::Batch, Instant::now(), r.bytes, false).await;
    }
    drop(live);
}

/// Count a request as sent unless `max_inflight` are already outstanding (then it and the
/// `later` turns behind it are dropped).
fn admit(ctx: &Ctx, class: TenantClass, later: u64) -> bool {
    let mut s = ctx.stats(class).borrow_mut();
    if s.inflight >= ctx.cfg.max_inflight as u64 {
        s.dropped += 1;
        s.not_sent += later;
        return false;
    }
    s.sent += 1;
    s.inflight += 1;
    true
}

/// Send one request and account for it; the answer's text on success.
async fn send(
    ctx: &Ctx,
    class: TenantClass,
    intended: Instant,
    req: Vec<u8>,
    stream: bool,
) -> Option<String> {
    let timeout = Duration::from_secs_f64(ctx.cfg.tenant(class).request_timeout_s);
    let deadline = (intended + timeout).min(ctx.hard_end);
    let first = std::cell::Cell::new(None);
    let result = timeout_at(
        mono(deadline),
        exchange_noting_first(&ctx.pool, &ctx.target, req, stream, &first),
    )
    .await;
    let mut s = ctx.stats(class).borrow_mut();
    s.inflight -= 1;
    let Ok(result) = result else {
        // No whole answer in time. Its first token, when one came, is its TTFT; otherwise what
        // it waited counts in the TTFT, or an overloaded gateway's percentiles would only
        // describe the lucky requests that got through.
        if intended >= ctx.window.0 {
            let ttft = match first.get() {
                Some(at) => at.saturating_duration_since(intended),
                None => {
                    s.ttft_waited += 1;
                    intended.elapsed()
                }
            };
            s.ttft
                .record(ttft.as_micros().try_into().unwrap_or(u64::MAX));
        }
        if Instant::now() >= ctx.hard_end {
            s.unfinished += 1;
        } else {
            s.timed_out += 1;
        }
        return None;
    };
    record(&mut s, ctx.t0, ctx.window, intended, result)
}

/// Account for one finished (or failed) request; the answer text on success.
fn record(
    s: &mut Stats,
    t0: Instant,
    window: (Instant, Instant),
    intended: Instant,
    result: Result<Exchange, ReqError>,
) -> Option<String> {
    let x = match result {
        Err(e) => {
            s.error(e.kind(), || e.detail());
            return None;
        }
        Ok(x) => x,
    };
    match x.status {
        200 => {}
        429 => {
            s.refused += 1;
            return None;
        }
        // A gateway's queue timeout (408, the reference's) or an upstream timeout (504).
        408 | 504 => {
            s.timed_out += 1;
            return None;
        }
        status => {
            let body = x.answer.error.clone().unwrap_or_default();
            s.error(&format!("http_{status}"), || body);
            return None;
        }
    }
    if let Some(msg) = x.answer.error.clone() {
        s.error("stream_error", || msg);
        return None;
    }
    // Latencies of the requests sent inside the window: the ones sent while the fleet was still
    // filling up would flatter a gateway that lets a backlog build.
    if intended >= window.0 {
        let us = |t: Instant| t.saturating_duration_since(intended).as_micros() as u64;
        if let Some(t) = x.first_content.or(x.first_byte) {
            s.ttft.record(us(t));
        }
        s.e2e.record(us(x.done));
    }
    s.ok += 1;
    let a = &x.answer;
    let out = a.completion_tokens.unwrap_or(u64::from(a.content_events));
    let prompt = a.prompt_tokens.unwrap_or(0);
    s.output_tokens += out;
    s.prompt_tokens += prompt;
    let second = x.done.saturating_duration_since(t0).as_secs() as usize;
    if s.output_by_second.len() <= second {
        s.output_by_second.resize(second + 1, 0);
    }
    s.output_by_second[second] += out;
    if x.done >= window.0 && x.done <= window.1 {
        s.window_ok += 1;
        s.window_output_tokens += out;
        s.window_prompt_tokens += prompt;
    }
    Some(x.answer.text)
}

#[cfg(test)]
mod tests;
