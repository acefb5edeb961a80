//! The overload workload's requests, drawn before the clock starts: the batch tenant's whole
//! request bytes (long prompts are the bulk of what the client sends, and rendering them during
//! the run would steal CPU from the client on a machine the gateway and workers share), and
//! the interactive sessions' texts and think times (their bodies also carry the answers, so
//! they are serialised when sent; they are small).

use std::io::Write as _;
use std::time::Duration;

use serde::Serialize;

use super::{OverloadConfig, TenantClass};
use crate::loadgen::text::words;
use crate::loadgen::workload::label;
use crate::rng::Rng;

/// Text namespaces (see [`label`]), apart from the other workloads' so no prompt is shared
/// with theirs by accident.
const NS_SYSTEM: u64 = 0x0F_0001;
const NS_QUESTION: u64 = 0x0F_0002;
const NS_BATCH: u64 = 0x0F_0003;

/// One batch request, ready to write.
#[derive(Debug, Clone)]
pub struct BatchRequest {
    /// Intended send time from the start of the run (zero for the closed loop).
    pub at: Duration,
    /// The whole HTTP request.
    pub bytes: Vec<u8>,
    /// Prompt length asked for, tokens.
    pub prompt_tokens: u32,
}

/// One turn of an interactive session.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    /// The user message.
    pub question: String,
    /// `max_tokens` (the simulated worker generates exactly this many).
    pub max_tokens: u32,
    /// Think time after the previous answer (zero for the first turn).
    pub think: Duration,
}

/// One interactive session: a start time and its turns.
#[derive(Debug, Clone, PartialEq)]
pub struct Session {
    /// Start offset from the start of the run.
    pub at: Duration,
    /// The turns, in order.
    pub turns: Vec<Turn>,
}

/// A uniform draw from an inclusive range (`lo` when the range is empty or reversed).
fn between(rng: &mut Rng, (lo, hi): (u32, u32)) -> u32 {
    if hi <= lo {
        return lo;
    }
    lo + rng.below((hi - lo + 1) as usize) as u32
}

fn between_s(rng: &mut Rng, (lo, hi): (f64, f64)) -> f64 {
    if hi <= lo {
        return lo.max(0.0);
    }
    lo + (hi - lo) * rng.next_f64()
}

/// Poisson arrival offsets at `rate` per second within `duration_s`, at most `max`.
fn poisson(rng: &mut Rng, rate: f64, duration_s: f64, max: u64) -> Vec<Duration> {
    let mut out = Vec::new();
    if rate.is_nan() || rate <= 0.0 {
        return out;
    }
    let mut t = rng.exponential(1.0 / rate);
    while t < duration_s && (out.len() as u64) < max {
        out.push(Duration::from_secs_f64(t));
        t += rng.exponential(1.0 / rate);
    }
    out
}

/// The shared system prompt of the interactive tenant (one product, one system prompt).
pub fn system_prompt(cfg: &OverloadConfig) -> String {
    words(
        cfg.seed,
        label(NS_SYSTEM, 0, 0),
        cfg.interactive.system_tokens as usize,
    )
}

/// The interactive sessions of a run: Poisson starts within the send window, each with
/// `min_turns..=max_turns` turns of fresh questions.
pub fn sessions(cfg: &OverloadConfig) -> Vec<Session> {
    let p = &cfg.interactive;
    let mut rng = Rng::fork(cfg.seed, label(NS_QUESTION, 1, 0));
    let starts = poisson(&mut rng, p.session_rate, cfg.duration_s, p.max_sessions);
    starts
        .into_iter()
        .enumerate()
        .map(|(s, at)| {
            let n = between(&mut rng, (p.min_turns.max(1), p.max_turns.max(1)));
            let turns = (0..n)
                .map(|k| Turn {
                    question: words(
                        cfg.seed,
                        label(NS_QUESTION, s as u64, u64::from(k)),
                        between(&mut rng, p.question_tokens) as usize,
                    ),
                    max_tokens: between(&mut rng, p.answer_tokens).max(1),
                    think: if k == 0 {
                        Duration::ZERO
                    } else {
                        Duration::from_secs_f64(between_s(&mut rng, p.think_s))
                    },
                })
                .collect();
            Session { at, turns }
        })
        .collect()
}

/// Draws the batch tenant's requests one after another, each with a prompt of its own; the
/// same seed draws the same sequence.
pub struct BatchDraw {
    rng: Rng,
    next: u64,
}

impl BatchDraw {
    /// The first draw of a run.
    pub fn new(cfg: &OverloadConfig) -> BatchDraw {
        BatchDraw {
            rng: Rng::fork(cfg.seed, label(NS_BATCH, 2, 0)),
            next: 0,
        }
    }

    /// Requests drawn so far.
    pub fn drawn(&self) -> u64 {
        self.next
    }

    /// The next request, to be sent at `at`.
    pub fn draw(
        &mut self,
        cfg: &OverloadConfig,
        host: &str,
        path: &str,
        at: Duration,
    ) -> BatchRequest {
        let p = &cfg.batch;
        let prompt_tokens = between(&mut self.rng, p.prompt_tokens);
        let max_tokens = between(&mut self.rng, p.output_tokens).max(1);
        let text = words(
            cfg.seed,
            label(NS_BATCH, self.next, 0),
            prompt_tokens as usize,
        );
        self.next += 1;
        let messages = [Message {
            role: "user",
            content: &text,
        }];
        let body = body(cfg, TenantClass::Batch, &messages, max_tokens);
        BatchRequest {
            at,
            bytes: request(cfg, TenantClass::Batch, host, path, &body),
            prompt_tokens,
        }
    }
}

/// The batch tenant's requests drawn before the run: Poisson arrivals at `rate` within the send
/// window, or (closed loop) the first `concurrency × CLOSED_POOL_PER_USER` requests (a closed
/// loop that runs through them draws more as it goes, from the same [`BatchDraw`]).
pub fn batch(
    cfg: &OverloadConfig,
    draw: &mut BatchDraw,
    host: &str,
    path: &str,
) -> Vec<BatchRequest> {
    let p = &cfg.batch;
    let times: Vec<Duration> = if p.concurrency > 0 {
        let n = (p.concurrency as u64 * super::CLOSED_POOL_PER_USER).min(p.max_requests);
        vec![Duration::ZERO; n as usize]
    } else {
        let mut rng = Rng::fork(cfg.seed, label(NS_BATCH, 1, 0));
        poisson(&mut rng, p.rate, cfg.duration_s, p.max_requests)
    };
    times
        .into_iter()
        .map(|at| draw.draw(cfg, host, path, at))
        .collect()
}

/// A chat message.
#[derive(Serialize)]
pub struct Message<'a> {
    /// `system`, `user` or `assistant`.
    pub role: &'a str,
    /// Its text.
    pub content: &'a str,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

/// `/v1/chat/completions` body: SGLang's `priority` rides in it as well as in the header, so
/// a gateway that forwards bodies untouched still tells priority-scheduling workers the class.
#[derive(Serialize)]
struct ChatBody<'a> {
    model: &'a str,
    messages: &'a [Message<'a>],
    max_tokens: u32,
    temperature: f32,
    ignore_eos: bool,
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<StreamOptions>,
    #[serde(skip_serializing_if = "Option::is_none")]
    priority: Option<i64>,
}

/// The JSON body of one request of tenant `class`.
pub fn body(
    cfg: &OverloadConfig,
    class: TenantClass,
    messages: &[Message<'_>],
    max_tokens: u32,
) -> Vec<u8> {
    let t = cfg.tenant(class);
    let stream = class == TenantClass::Interactive;
    let b = ChatBody {
        model: &cfg.model,
        messages,
        max_tokens,
        temperature: 0.0,
        ignore_eos: true,
        stream,
        stream_options: stream.then_some(StreamOptions {
            include_usage: true,
        }),
        priority: cfg.body_priority.then_some(t.priority),
    };
    // Plain strings and numbers always serialise.
    serde_json::to_vec(&b).unwrap_or_default()
}

/// The whole HTTP request of tenant `class`: its API key as a bearer token (the tenant) and
/// its class in `X-SMG-Priority`.
pub fn request(
    cfg: &OverloadConfig,
    class: TenantClass,
    host: &str,
    path: &str,
    body: &[u8],
) -> Vec<u8> {
    let t = cfg.tenant(class);
    let stream = class == TenantClass::Interactive;
    let mut req = Vec::with_capacity(body.len() + 320);
    let _ = write!(
        req,
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nAccept: {}\r\n",
        body.len(),
        if stream { "text/event-stream" } else { "application/json" }
    );
    if !t.api_key.is_empty() {
        let _ = write!(req, "Authorization: Bearer {}\r\n", t.api_key);
    }
    let _ = write!(req, "X-SMG-Priority: {}\r\n\r\n", t.priority);
    req.extend_from_slice(body);
    req
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loadgen::text::CHARS_PER_TOKEN;

    fn cfg() -> OverloadConfig {
        let mut c = OverloadConfig {
            duration_s: 20.0,
            ..OverloadConfig::default()
        };
        c.batch.rate = 5.0;
        c.interactive.session_rate = 1.0;
        c
    }

    #[test]
    fn batch_requests_carry_the_tenant_and_a_long_prompt_of_their_own() {
        let c = cfg();
        let reqs = batch(
            &c,
            &mut BatchDraw::new(&c),
            "127.0.0.1:1",
            "/v1/chat/completions",
        );
        // Poisson at 5/s over 20 s: about 100.
        assert!((60..=140).contains(&reqs.len()), "{}", reqs.len());
        assert!(reqs.windows(2).all(|w| w[0].at <= w[1].at));
        assert!(reqs.iter().all(|r| r.at < Duration::from_secs(20)));
        let text = String::from_utf8(reqs[0].bytes.clone()).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("POST /v1/chat/completions HTTP/1.1\r\n"));
        assert!(head.contains("\r\nAuthorization: Bearer batch-key\r\n"));
        assert!(head.contains("\r\nX-SMG-Priority: 0"));
        assert!(head.contains(&format!("\r\nContent-Length: {}\r\n", body.len())));
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["stream"], false);
        assert_eq!(v["priority"], 0);
        let content = v["messages"][0]["content"].as_str().unwrap();
        let (lo, hi) = c.batch.prompt_tokens;
        let chars = content.len() / CHARS_PER_TOKEN;
        assert!(
            (lo as usize..=hi as usize + 2).contains(&chars),
            "{chars} tokens"
        );
        let other = String::from_utf8(reqs[1].bytes.clone()).unwrap();
        let other: serde_json::Value =
            serde_json::from_str(other.split_once("\r\n\r\n").unwrap().1).unwrap();
        let other = other["messages"][0]["content"].as_str().unwrap();
        assert_ne!(content[..100], other[..100], "every prompt is its own");
        // The same seed draws the same requests.
        let again = batch(
            &c,
            &mut BatchDraw::new(&c),
            "127.0.0.1:1",
            "/v1/chat/completions",
        );
        assert_eq!(again.len(), reqs.len());
        assert_eq!(again[3].bytes, reqs[3].bytes);
    }

    #[test]
    fn closed_loop_pool_is_bounded_and_drawing_goes_on() {
        let mut c = cfg();
        c.batch.concurrency = 3;
        let mut draw = BatchDraw::new(&c);
        let n = batch(&c, &mut draw, "h", "/p").len() as u64;
        assert_eq!(n, 3 * super::super::CLOSED_POOL_PER_USER);
        assert_eq!(draw.drawn(), n);
        // Drawing on goes on with new prompts.
        let more = draw.draw(&c, "h", "/p", Duration::ZERO);
        assert_eq!(draw.drawn(), n + 1);
        let first = batch(&c, &mut BatchDraw::new(&c), "h", "/p");
        assert!(first.iter().all(|r| r.bytes != more.bytes));
        c.batch.max_requests = 5;
        assert_eq!(batch(&c, &mut BatchDraw::new(&c), "h", "/p").len(), 5);
    }

    #[test]
    fn interactive_sessions_are_multi_turn_streamed_and_high_priority() {
        let c = cfg();
        let s = sessions(&c);
        assert!((8..=35).contains(&s.len()), "{}", s.len());
        let p = &c.interactive;
        for sess in &s {
            assert!((p.min_turns..=p.max_turns).contains(&(sess.turns.len() as u32)));
            assert_eq!(sess.turns[0].think, Duration::ZERO);
            for t in &sess.turns[1..] {
                assert!(
                    t.think.as_secs_f64() >= p.think_s.0 && t.think.as_secs_f64() <= p.think_s.1
                );
            }
        }
        assert_ne!(s[0].turns[0].question, s[1].turns[0].question);
        let sys = system_prompt(&c);
        let messages = [
            Message {
                role: "system",
                content: &sys,
            },
            Message {
                role: "user",
                content: &s[0].turns[0].question,
            },
        ];
        let b = body(&c, TenantClass::Interactive, &messages, 7);
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["stream"], true);
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["priority"], 10);
        assert_eq!(v["max_tokens"], 7);
        let r = request(&c, TenantClass::Interactive, "h", "/p", &b);
        let head = String::from_utf8_lossy(&r[..r.len() - b.len()]).into_owned();
        assert!(head.contains("Authorization: Bearer interactive-key\r\n"));
        assert!(head.contains("X-SMG-Priority: 10\r\n"));
        assert!(head.contains("Accept: text/event-stream\r\n"));
    }

    #[test]
    fn a_tenant_at_rate_zero_sends_nothing_and_body_priority_is_optional() {
        let mut c = cfg();
        c.batch.rate = 0.0;
        c.interactive.session_rate = 0.0;
        assert!(batch(&c, &mut BatchDraw::new(&c), "h", "/p").is_empty());
        assert!(sessions(&c).is_empty());
        c.body_priority = false;
        let b = body(&c, TenantClass::Batch, &[], 1);
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert!(v.get("priority").is_none());
    }
}
