//! The run itself: one monoio thread, a dispatcher task starting sessions at their intended
//! times (or N closed-loop users), one task per live session, and a supervisor that prints
//! progress and enforces the deadline.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::io::{self, IsTerminal, Write as _};
use std::rc::Rc;
use std::time::{Duration, Instant};

use monoio::time::{sleep, sleep_until, timeout_at};
use serde::Serialize;

use super::client::{exchange, Exchange, Pool, ReqError, Target};
use super::hist::Histogram;
use super::report::Report;
use super::trace;
use super::workload::{self, render, Pacing, SessionPlan, SessionSource, Turn};
use super::{Api, Arrival, LoadConfig, WorkloadKind};
use crate::rng::Rng;
use crate::sim::tokenizer::SimTokenizer;

/// Build the runtime and run to completion (called on the loadgen thread).
pub fn run_blocking(cfg: LoadConfig) -> io::Result<Report> {
    let source = make_source(&cfg)?;
    let mut rt = monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
        .enable_timer()
        .build()?;
    rt.block_on(run_async(cfg, source))
}

fn make_source(cfg: &LoadConfig) -> io::Result<Box<dyn SessionSource>> {
    let rate = cfg.effective_rate();
    let limit = cfg.num_requests.unwrap_or(u64::MAX).min(cfg.max_requests);
    Ok(match cfg.workload {
        WorkloadKind::Gsp => {
            let mut v = workload::gsp(&cfg.gsp, cfg.seed);
            v.truncate(limit.min(v.len() as u64) as usize);
            Box::new(workload::ListSource::new(v))
        }
        WorkloadKind::Mrqa => Box::new(workload::ListSource::new(workload::mrqa(
            &cfg.mrqa,
            rate,
            cfg.time_scale,
        ))),
        WorkloadKind::Chat => Box::new(workload::ChatSource::new(
            cfg.chat.clone(),
            cfg.seed,
            rate,
            cfg.time_scale,
        )),
        WorkloadKind::Trace => {
            let path = trace::resolve(&cfg.trace)?;
            Box::new(workload::TraceSource::open(
                &path,
                cfg.trace_slowdown,
                cfg.time_scale,
                limit,
            )?)
        }
        WorkloadKind::Rate => {
            let n = cfg
                .num_requests
                .unwrap_or((rate * cfg.duration_s / cfg.time_scale.max(1e-9)).ceil() as u64 + 1);
            Box::new(workload::RateSource::new(
                rate,
                cfg.time_scale,
                n.min(cfg.max_requests),
            ))
        }
    })
}

#[derive(Default)]
struct Stats {
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    sessions: u64,
    sessions_live: u64,
    sent: u64,
    ok: u64,
    failed: u64,
    inflight: u64,
    errors: BTreeMap<String, u64>,
    error_examples: BTreeMap<String, String>,
    not_sent: u64,
    dropped: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
    prompt_tokens_with_cache_info: u64,
    cache_reports: u64,
    completion_tokens: u64,
    last_done: Option<Instant>,
}

impl Stats {
    fn error(&mut self, kind: &str, detail: impl FnOnce() -> String) {
        self.failed += 1;
        *self.errors.entry(kind.to_string()).or_insert(0) += 1;
        if !self.error_examples.contains_key(kind) {
            self.error_examples.insert(kind.to_string(), detail());
        }
    }
}

struct Ctx {
    cfg: LoadConfig,
    target: Target,
    path: String,
    pool: Pool,
    t0: Instant,
    send_end: Instant,
    hard_end: Instant,
    stats: RefCell<Stats>,
    source: RefCell<Box<dyn SessionSource>>,
    fatal: RefCell<Option<io::Error>>,
    dispatching: Cell<bool>,
    /// The simulator's tokenizer when prompts go out as `input_ids`.
    tokenizer: Option<SimTokenizer>,
}

impl Ctx {
    fn next_session(&self) -> Option<SessionPlan> {
        if self.fatal.borrow().is_some() {
            return None;
        }
        match self.source.borrow_mut().next_session() {
            Ok(s) => s,
            Err(e) => {
                *self.fatal.borrow_mut() = Some(e);
                None
            }
        }
    }
}

fn mono(t: Instant) -> monoio::time::Instant {
    monoio::time::Instant::from_std(t)
}

async fn run_async(cfg: LoadConfig, source: Box<dyn SessionSource>) -> io::Result<Report> {
    let target = Target::parse(&cfg.target)?;
    let t0 = Instant::now();
    let send_end = t0 + Duration::from_secs_f64(cfg.duration_s);
    let hard_end = send_end + Duration::from_secs_f64(cfg.drain_s);
    let ctx = Rc::new(Ctx {
        path: format!("{}{}", target.base_path, cfg.api.path()),
        target,
        pool: Pool::default(),
        t0,
        send_end,
        hard_end,
        stats: RefCell::new(Stats::default()),
        source: RefCell::new(source),
        fatal: RefCell::new(None),
        dispatching: Cell::new(true),
        tokenizer: cfg.input_ids.map(|m| SimTokenizer::new(m.mode())),
        cfg,
    });

    if ctx.cfg.arrival == Arrival::Closed {
        let users = Rc::new(Cell::new(ctx.cfg.concurrency));
        for _ in 0..ctx.cfg.concurrency {
            let (ctx, users) = (ctx.clone(), users.clone());
            monoio::spawn(async move {
                closed_user(&ctx).await;
                users.set(users.get() - 1);
                if users.get() == 0 {
                    ctx.dispatching.set(false);
                }
            });
        }
    } else {
        monoio::spawn(dispatch(ctx.clone()));
    }

    let progress = !ctx.cfg.quiet && io::stderr().is_terminal();
    let mut last_print = Instant::now();
    loop {
        sleep(Duration::from_millis(20)).await;
        let now = Instant::now();
        let finished = {
            let s = ctx.stats.borrow();
            !ctx.dispatching.get() && s.sessions_live == 0
        };
        if progress && (finished || now.duration_since(last_print) >= Duration::from_millis(500)) {
            last_print = now;
            let s = ctx.stats.borrow();
            let mut err = io::stderr().lock();
            let _ = write!(
                err,
                "\r{:>7.1}s  sessions {:>6}  sent {:>7}  ok {:>7}  failed {:>5}  in flight {:>5}   ",
                now.duration_since(ctx.t0).as_secs_f64(),
                s.sessions,
                s.sent,
                s.ok,
                s.failed,
                s.inflight
            );
            let _ = err.flush();
        }
        if finished || now >= ctx.hard_end {
            break;
        }
    }
    if progress {
        eprintln!();
    }
    if let Some(e) = ctx.fatal.borrow_mut().take() {
        return Err(e);
    }
    let mut s = ctx.stats.borrow_mut();
    // Whatever is still running missed the deadline.
    let late = s.inflight;
    if late > 0 {
        s.failed += late;
        *s.errors.entry("deadline".into()).or_insert(0) += late;
    }
    Ok(make_report(&ctx.cfg, &s, ctx.t0))
}

fn make_report(cfg: &LoadConfig, s: &Stats, t0: Instant) -> Report {
    let wall = s
        .last_done
        .map_or(0.0, |t| t.duration_since(t0).as_secs_f64());
    let per_s = |x: u64| if wall > 0.0 { x as f64 / wall } else { 0.0 };
    Report {
        config: cfg.clone(),
        wall_s: wall,
        sessions: s.sessions,
        sent: s.sent,
        ok: s.ok,
        failed: s.failed,
        errors: s.errors.clone(),
        error_examples: s.error_examples.clone(),
        not_sent: s.not_sent,
        dropped: s.dropped,
        req_per_s: per_s(s.ok),
        output_tok_per_s: per_s(s.completion_tokens),
        prompt_tok_per_s: per_s(s.prompt_tokens),
        prompt_tokens: s.prompt_tokens,
        cached_tokens: s.cached_tokens,
        prompt_tokens_with_cache_info: s.prompt_tokens_with_cache_info,
        completion_tokens: s.completion_tokens,
        cache_reports: s.cache_reports,
        hit_rate: (s.prompt_tokens_with_cache_info > 0)
            .then(|| s.cached_tokens as f64 / s.prompt_tokens_with_cache_info as f64),
        ttft: s.ttft.summary_ms(),
        itl: s.itl.summary_ms(),
        e2e: s.e2e.summary_ms(),
    }
}

/// Open loop: start each session at its intended time, whatever the server is doing.
async fn dispatch(ctx: Rc<Ctx>) {
    let cfg = &ctx.cfg;
    let mut rng = Rng::fork(cfg.seed, 0x0061_7272_6976_616c);
    let mean_gap = cfg.time_scale / cfg.effective_rate();
    let mut clock = 0.0f64;
    let mut started = 0u64;
    while started < cfg.max_requests {
        let Some(plan) = ctx.next_session() else {
            break;
        };
        let offset = match cfg.arrival {
            Arrival::Schedule | Arrival::Closed => plan.start.as_secs_f64(),
            Arrival::Burst => 0.0,
            Arrival::Poisson | Arrival::Fixed => {
                let t = clock;
                clock += if cfg.arrival == Arrival::Poisson {
                    rng.exponential(mean_gap)
                } else {
                    mean_gap
                };
                t
            }
        };
        let at = ctx.t0 + Duration::from_secs_f64(offset);
        if at > ctx.send_end || ctx.stats.borrow().sent >= cfg.max_requests {
            break;
        }
        if at > Instant::now() {
            sleep_until(mono(at)).await;
        }
        started += 1;
        ctx.stats.borrow_mut().sessions_live += 1;
        monoio::spawn(run_session(ctx.clone(), plan, at));
    }
    ctx.dispatching.set(false);
}

/// Closed loop: one user running sessions back to back until the window closes.
async fn closed_user(ctx: &Rc<Ctx>) {
    while Instant::now() < ctx.send_end && ctx.stats.borrow().sent < ctx.cfg.max_requests {
        let Some(plan) = ctx.next_session() else {
            break;
        };
        ctx.stats.borrow_mut().sessions_live += 1;
        run_session(ctx.clone(), plan, Instant::now()).await;
    }
}

async fn run_session(ctx: Rc<Ctx>, plan: SessionPlan, start: Instant) {
    let mut conv = Conversation::new(&plan, ctx.cfg.api, ctx.cfg.seed);
    let closed = ctx.cfg.arrival == Arrival::Closed;
    let mut intended = start;
    let mut last_done = start;
    let mut counted = false;
    for (k, turn) in plan.turns.iter().enumerate() {
        if k > 0 {
            intended = match plan.pacing {
                Pacing::AfterAnswer => last_done + turn.delay,
                Pacing::FromSend => (intended + turn.delay).max(last_done),
            };
        }
        let refused = {
            let s = ctx.stats.borrow();
            intended > ctx.send_end || s.sent >= ctx.cfg.max_requests
        };
        if refused {
            ctx.stats.borrow_mut().not_sent += (plan.turns.len() - k) as u64;
            break;
        }
        if intended > Instant::now() {
            sleep_until(mono(intended)).await;
        }
        {
            let mut s = ctx.stats.borrow_mut();
            if !closed && s.inflight >= ctx.cfg.max_inflight as u64 {
                s.dropped += 1;
                s.not_sent += (plan.turns.len() - k - 1) as u64;
                break;
            }
            if !counted {
                s.sessions += 1;
                counted = true;
            }
            s.sent += 1;
            s.inflight += 1;
        }
        conv.push_user(turn, ctx.cfg.seed);
        let request = conv.request(&ctx, &plan, turn);
        let deadline =
            (intended + Duration::from_secs_f64(ctx.cfg.request_timeout_s)).min(ctx.hard_end);
        let result = timeout_at(
            mono(deadline),
            exchange(&ctx.pool, &ctx.target, request, ctx.cfg.stream),
        )
        .await;
        let answer = record(&ctx, intended, result);
        match answer {
            Some(text) => {
                conv.push_assistant(text);
                last_done = Instant::now();
            }
            None => {
                ctx.stats.borrow_mut().not_sent += (plan.turns.len() - k - 1) as u64;
                break;
            }
        }
    }
    ctx.stats.borrow_mut().sessions_live -= 1;
}

/// Account for one finished (or failed) request; returns the answer text on success.
fn record(
    ctx: &Ctx,
    intended: Instant,
    result: Result<Result<Exchange, ReqError>, monoio::time::error::Elapsed>,
) -> Option<String> {
    let mut s = ctx.stats.borrow_mut();
    s.inflight -= 1;
    let x = match result {
        Err(_) => {
            s.error("timeout", || {
                "no complete response before the request deadline".into()
            });
            return None;
        }
        Ok(Err(e)) => {
            s.error(e.kind(), || e.detail());
            return None;
        }
        Ok(Ok(x)) => x,
    };
    if x.status != 200 {
        let body = x.answer.error.clone().unwrap_or_default();
        s.error(&format!("http_{}", x.status), || body);
        return None;
    }
    if x.answer.error.is_some() {
        let msg = x.answer.error.clone().unwrap_or_default();
        s.error("stream_error", || msg);
        return None;
    }
    let us = |t: Instant| t.saturating_duration_since(intended).as_micros() as u64;
    if let Some(t) = x.first_content.or(x.first_byte) {
        s.ttft.record(us(t));
    }
    for &gap in &x.itl_us {
        s.itl.record(gap);
    }
    s.e2e.record(us(x.done));
    s.ok += 1;
    s.last_done = Some(x.done);
    let a = &x.answer;
    s.completion_tokens += a.completion_tokens.unwrap_or(a.content_events as u64);
    if let Some(p) = a.prompt_tokens {
        s.prompt_tokens += p;
        if let Some(c) = a.cached_tokens {
            s.cached_tokens += c;
            s.prompt_tokens_with_cache_info += p;
            s.cache_reports += 1;
        }
    }
    Some(x.answer.text)
}

/// A session's history in the shape its API needs: a messages array for chat, one growing
/// prompt (`system`, then turns separated by blank lines) for completions and /generate.
struct Conversation {
    api: Api,
    messages: Vec<(&'static str, String)>,
    flat: String,
}

impl Conversation {
    fn new(plan: &SessionPlan, api: Api, seed: u64) -> Self {
        let mut c = Conversation {
            api,
            messages: Vec::new(),
            flat: String::new(),
        };
        if let Some(sys) = &plan.system {
            let mut s = String::new();
            render(sys, seed, &mut s);
            match api {
                Api::Chat => c.messages.push(("system", s)),
                _ => c.flat = s,
            }
        }
        c
    }

    fn push_user(&mut self, turn: &Turn, seed: u64) {
        match self.api {
            Api::Chat => {
                let mut s = String::new();
                render(&turn.user, seed, &mut s);
                self.messages.push(("user", s));
            }
            _ => {
                if !self.flat.is_empty() {
                    self.flat.push_str("\n\n");
                }
                render(&turn.user, seed, &mut self.flat);
            }
        }
    }

    fn push_assistant(&mut self, text: String) {
        match self.api {
            Api::Chat => self.messages.push(("assistant", text)),
            _ => {
                self.flat.push_str("\n\n");
                self.flat.push_str(&text);
            }
        }
    }

    /// The full HTTP request: head and JSON body.
    fn request(&self, ctx: &Ctx, plan: &SessionPlan, turn: &Turn) -> Vec<u8> {
        let cfg = &ctx.cfg;
        let stream_options = (cfg.stream && self.api != Api::Generate).then_some(StreamOptions {
            include_usage: true,
        });
        // Borrowed views of the chat history (empty, so no allocation, for the other APIs).
        let messages: Vec<Message> = match self.api {
            Api::Chat => self
                .messages
                .iter()
                .map(|(role, content)| Message { role, content })
                .collect(),
            _ => Vec::new(),
        };
        let input = match self.api {
            Api::Chat => Some(OpenAiInput::Messages(&messages)),
            Api::Completions => Some(OpenAiInput::Prompt(&self.flat)),
            Api::Generate => None,
        };
        let body = match input {
            Some(input) => serde_json::to_vec(&OpenAiBody {
                model: &cfg.model,
                input,
                max_tokens: turn.max_tokens,
                temperature: 0.0,
                ignore_eos: true,
                stream: cfg.stream,
                stream_options,
            }),
            None => match &ctx.tokenizer {
                Some(t) => {
                    let mut ids = Vec::with_capacity(self.flat.len() / 3 + 1);
                    let sampling_params = SamplingParams {
                        max_new_tokens: turn.max_tokens,
                        temperature: 0.0,
                        ignore_eos: true,
                    };
                    match t.encode_prompt(&self.flat, &mut ids) {
                        Ok(()) => serde_json::to_vec(&GenerateIdsBody {
                            input_ids: &ids,
                            sampling_params,
                            stream: cfg.stream,
                        }),
                        // A prompt the tokenizer refuses goes as text: the worker encodes it.
                        Err(_) => serde_json::to_vec(&GenerateBody {
                            text: &self.flat,
                            sampling_params,
                            stream: cfg.stream,
                        }),
                    }
                }
                None => serde_json::to_vec(&GenerateBody {
                    text: &self.flat,
                    sampling_params: SamplingParams {
                        max_new_tokens: turn.max_tokens,
                        temperature: 0.0,
                        ignore_eos: true,
                    },
                    stream: cfg.stream,
                }),
            },
        };
        // Serialising plain strings and numbers cannot fail.
        let body = body.unwrap_or_default();
        let mut req = Vec::with_capacity(body.len() + 256);
        let _ = write!(
            req,
            "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nAccept: {}\r\n",
            ctx.path,
            ctx.target.host,
            body.len(),
            if cfg.stream { "text/event-stream" } else { "application/json" }
        );
        if cfg.session_header {
            let _ = write!(
                req,
                "X-SMG-Routing-Key: {}-{}\r\n",
                cfg.workload.name(),
                plan.routing_key
            );
        }
        req.extend_from_slice(b"\r\n");
        req.extend_from_slice(&body);
        req
    }
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'a str,
    content: &'a str,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

/// The body of `/v1/chat/completions` and `/v1/completions`: the same sampling fields around one
/// API-specific input field.
#[derive(Serialize)]
struct OpenAiBody<'a> {
    model: &'a str,
    /// Serialised as a single `"messages"` or `"prompt"` field, in this position.
    #[serde(flatten)]
    input: OpenAiInput<'a>,
    max_tokens: u32,
    temperature: f32,
    ignore_eos: bool,
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<StreamOptions>,
}

/// The input of an [`OpenAiBody`]: a chat messages array, or one flat completions prompt.
#[derive(Serialize)]
#[serde(rename_all = "lowercase")]
enum OpenAiInput<'a> {
    Messages(&'a [Message<'a>]),
    Prompt(&'a str),
}

#[derive(Serialize)]
struct SamplingParams {
    max_new_tokens: u32,
    temperature: f32,
    ignore_eos: bool,
}

#[derive(Serialize)]
struct GenerateBody<'a> {
    text: &'a str,
    sampling_params: SamplingParams,
    stream: bool,
}

/// `/generate` with the prompt as token ids (`LoadConfig::input_ids`).
#[derive(Serialize)]
struct GenerateIdsBody<'a> {
    input_ids: &'a [u32],
    sampling_params: SamplingParams,
    stream: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wire format of both OpenAI bodies, field for field and in order.
    #[test]
    fn openai_bodies_serialise_exactly() {
        let messages = [Message {
            role: "user",
            content: "hi",
        }];
        let body = |input, stream_options| {
            let b = OpenAiBody {
                model: "m",
                input,
                max_tokens: 5,
                temperature: 0.0,
                ignore_eos: true,
                stream: true,
                stream_options,
            };
            String::from_utf8(serde_json::to_vec(&b).unwrap()).unwrap()
        };
        assert_eq!(
            body(
                OpenAiInput::Messages(&messages),
                Some(StreamOptions {
                    include_usage: true
                })
            ),
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"temperature":0.0,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}"#
        );
        assert_eq!(
            body(OpenAiInput::Prompt("a\n\nb"), None),
            r#"{"model":"m","prompt":"a\n\nb","max_tokens":5,"temperature":0.0,"ignore_eos":true,"stream":true}"#
        );
    }
}
