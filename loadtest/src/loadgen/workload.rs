//! Workload generators. Each one is a deterministic stream of [`SessionPlan`]s (a request is a
//! one-turn session) with *descriptions* of the text, not the text itself: prompts are rendered
//! when sent, so an hour of trace or thousands of sessions cost kilobytes until then, and the
//! same seed always yields the same sessions whatever the timing of the run.

use std::io;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::text::push_words;
use super::trace::{render_blocks, TraceReader};
use crate::rng::{Rng, Zipf};

/// A piece of prompt text, rendered at send time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Fixed text.
    Lit(&'static str),
    /// Small formatted text (e.g. "For user 7, …").
    Text(Box<str>),
    /// About `tokens` tokens of words from the stream labelled `label` (equal labels, equal text).
    Words {
        /// Text identity; see [`label`].
        label: u64,
        /// Length in tokens.
        tokens: u32,
    },
    /// Trace blocks: each hash id a deterministic 512-token block, cut to `tokens`.
    Blocks {
        /// Mooncake hash ids.
        ids: Box<[u64]>,
        /// Prompt length in tokens.
        tokens: u32,
    },
}

impl Piece {
    /// Append the text of this piece.
    pub fn render(&self, seed: u64, out: &mut String) {
        match self {
            Piece::Lit(s) => out.push_str(s),
            Piece::Text(s) => out.push_str(s),
            Piece::Words { label, tokens } => {
                let mut rng = Rng::fork(seed, *label);
                push_words(out, &mut rng, *tokens as usize);
            }
            Piece::Blocks { ids, tokens } => render_blocks(seed, ids, *tokens, out),
        }
    }

    /// Rough token count, for reporting the intended prompt size.
    pub fn approx_tokens(&self) -> u64 {
        match self {
            Piece::Lit(s) => s.len() as u64 / 4,
            Piece::Text(s) => s.len() as u64 / 4,
            Piece::Words { tokens, .. } | Piece::Blocks { tokens, .. } => *tokens as u64,
        }
    }
}

/// Render a list of pieces into one string.
pub fn render(pieces: &[Piece], seed: u64, out: &mut String) {
    for p in pieces {
        p.render(seed, out);
    }
}

/// A text identity from a namespace and two indices. Distinct triples give distinct labels
/// (odd multipliers make each part a bijection; collisions across parts are ~2⁻⁶⁴ events).
pub fn label(ns: u64, a: u64, b: u64) -> u64 {
    ns.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ a.wrapping_mul(0xc2b2_ae3d_27d4_eb4f).rotate_left(21)
        ^ b.wrapping_mul(0x1656_67b1_9e37_79f9).rotate_left(42)
}

const NS_SYSTEM: u64 = 1;
const NS_QUESTION: u64 = 2;
const NS_CONTEXT: u64 = 3;
const NS_DOC: u64 = 4;

/// When a session's next turn is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pacing {
    /// `delay` after the previous answer completed (a user reading and typing).
    AfterAnswer,
    /// `delay` after the previous turn's intended send time, but never before its answer
    /// (vLLM multi-round QA: each user asks every `N/qps` seconds).
    FromSend,
}

/// One user turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turn {
    /// The user message.
    pub user: Vec<Piece>,
    /// Answer length (`max_tokens`; the simulated worker honours it exactly).
    pub max_tokens: u32,
    /// Wait before this turn (see [`Pacing`]); zero for the first turn. Already time-scaled.
    pub delay: Duration,
}

/// One session: a system prompt and turns whose history accumulates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionPlan {
    /// Sequence number of the session in its workload.
    pub id: u64,
    /// Sent as `X-SMG-Routing-Key` with `--session-header` (gsp: the group; chat: the session).
    pub routing_key: u64,
    /// Start offset of the workload's own schedule (already time-scaled).
    pub start: Duration,
    /// System prompt (a `system` message for the chat API, the prompt head otherwise).
    pub system: Option<Vec<Piece>>,
    /// The turns, in order.
    pub turns: Vec<Turn>,
    /// How later turns are timed.
    pub pacing: Pacing,
}

/// A deterministic stream of sessions.
pub trait SessionSource: Send {
    /// The next session in schedule order, or `None` when the workload is exhausted.
    fn next_session(&mut self) -> io::Result<Option<SessionPlan>>;
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.max(0.0))
}

/// SGLang `generated-shared-prefix` (bench_serving `--dataset-name generated-shared-prefix`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GspParams {
    /// Distinct system prompts (groups).
    pub groups: u32,
    /// Prompts per group.
    pub prompts_per_group: u32,
    /// System prompt length, tokens.
    pub system_len: u32,
    /// Question length, tokens.
    pub question_len: u32,
    /// Answer length, tokens.
    pub output_len: u32,
}

impl Default for GspParams {
    /// bench_serving's defaults: 64 × 16, 2048 / 128 / 256.
    fn default() -> Self {
        GspParams {
            groups: 64,
            prompts_per_group: 16,
            system_len: 2048,
            question_len: 128,
            output_len: 256,
        }
    }
}

/// All `groups × prompts_per_group` prompts (`system + "\n\n" + question`), shuffled, each
/// starting at 0 (a burst). The routing key is the group.
pub fn gsp(p: &GspParams, seed: u64) -> Vec<SessionPlan> {
    let mut v = Vec::with_capacity((p.groups * p.prompts_per_group) as usize);
    for g in 0..p.groups as u64 {
        for q in 0..p.prompts_per_group as u64 {
            v.push(SessionPlan {
                id: 0,
                routing_key: g,
                start: Duration::ZERO,
                system: None,
                turns: vec![Turn {
                    user: vec![
                        Piece::Words {
                            label: label(NS_SYSTEM, g, 0),
                            tokens: p.system_len,
                        },
                        Piece::Lit("\n\n"),
                        Piece::Words {
                            label: label(NS_QUESTION, g, q),
                            tokens: p.question_len,
                        },
                    ],
                    max_tokens: p.output_len,
                    delay: Duration::ZERO,
                }],
                pacing: Pacing::AfterAnswer,
            });
        }
    }
    Rng::fork(seed, 0x0067_7370).shuffle(&mut v);
    for (i, s) in v.iter_mut().enumerate() {
        s.id = i as u64;
    }
    v
}

/// vLLM production-stack multi-round QA.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MrqaParams {
    /// Users (N), all with the same shared system prompt.
    pub users: u32,
    /// Rounds per user (M).
    pub rounds: u32,
    /// Shared system prompt, tokens (S).
    pub system_len: u32,
    /// Per-user history/context in the first message, tokens (U).
    pub history_len: u32,
    /// Answer length, tokens (A).
    pub answer_len: u32,
}

impl Default for MrqaParams {
    /// The reference run scaled for CI (N 320 → 32, U 20000 → 2000).
    fn default() -> Self {
        MrqaParams {
            users: 32,
            rounds: 10,
            system_len: 1000,
            history_len: 2000,
            answer_len: 100,
        }
    }
}

/// Multi-round QA: user `u` joins at `u · gap·(M−1)/N` and asks every `gap = N/qps` seconds
/// (time-scaled), never before the previous answer. The first message carries the shared system
/// prompt and the user's own context; later messages are the numbered "new long story" question.
pub fn mrqa(p: &MrqaParams, qps: f64, time_scale: f64) -> Vec<SessionPlan> {
    let users = p.users.max(1) as u64;
    let gap = users as f64 / qps.max(1e-9) * time_scale;
    let join = gap * p.rounds.saturating_sub(1).max(1) as f64 / users as f64;
    (0..users)
        .map(|u| {
            let turns = (1..=p.rounds.max(1) as u64)
                .map(|k| {
                    let question =
                        format!(" Here's question #{k}: can you tell me a new long story with a happy ending?");
                    let user = if k == 1 {
                        vec![
                            Piece::Lit("Hi, here's some system prompt:"),
                            Piece::Words { label: label(NS_SYSTEM, 0, 0), tokens: p.system_len },
                            Piece::Text(format!("\nFor user {u}, here are some other context:").into()),
                            Piece::Words { label: label(NS_CONTEXT, u, 0), tokens: p.history_len },
                            Piece::Text(question.into()),
                        ]
                    } else {
                        vec![Piece::Text(question.trim_start().into())]
                    };
                    Turn { user, max_tokens: p.answer_len, delay: if k == 1 { Duration::ZERO } else { secs(gap) } }
                })
                .collect();
            SessionPlan {
                id: u,
                routing_key: u,
                start: secs(u as f64 * join),
                system: None,
                turns,
                pacing: Pacing::FromSend,
            }
        })
        .collect()
}

fn one() -> u32 {
    1
}

/// The chat generator of the reference spec (§4, "Recommended generator spec").
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChatParams {
    /// Number of sessions; `None`: as many as start within the run's duration.
    pub sessions: Option<u64>,
    /// Distinct tenants (system prompts).
    pub tenants: u32,
    /// Zipf exponent of tenant popularity; 0 = uniform.
    pub tenant_zipf: f64,
    /// Median system prompt length, tokens (lognormal σ 0.6, within [256, 8192]).
    pub system_median: f64,
    /// Mean number of turns after the first (geometric).
    pub extra_turns_mean: f64,
    /// Fewest turns of a session that is not one-shot (1 in the spec; tests raise it).
    #[serde(default = "one")]
    pub min_turns: u32,
    /// Most turns in a session.
    pub max_turns: u32,
    /// Fraction of one-shot sessions (a single turn).
    pub one_shot_frac: f64,
    /// Fraction of sessions whose first turn carries a document from a shared pool.
    pub doc_frac: f64,
    /// Size of that document pool.
    pub docs: u32,
    /// Fraction of (the other) sessions whose first turn carries private context.
    pub context_frac: f64,
    /// Median context/document length, tokens (lognormal σ 1.0, within [0, 32768]).
    pub context_median: f64,
    /// Median user message, tokens (lognormal σ 0.8, within [8, 4096]).
    pub question_median: f64,
    /// Median answer, tokens (lognormal σ 0.7, within [16, 2048]).
    pub answer_median: f64,
    /// Median think time between an answer and the next turn, seconds before `--time-scale`
    /// (lognormal σ 1.07, within [1 s, 1 h]; Mooncake p10/p50/p90 ≈ 31/123/480 s).
    pub think_median_s: f64,
}

impl Default for ChatParams {
    /// The values of the reference spec.
    fn default() -> Self {
        ChatParams {
            sessions: None,
            tenants: 8,
            tenant_zipf: 1.0,
            system_median: 1500.0,
            extra_turns_mean: 2.5,
            min_turns: 1,
            max_turns: 20,
            one_shot_frac: 0.3,
            doc_frac: 0.2,
            docs: 16,
            context_frac: 0.3,
            context_median: 2000.0,
            question_median: 120.0,
            answer_median: 250.0,
            think_median_s: 120.0,
        }
    }
}

/// Chat sessions: Poisson starts at `rate` sessions/s (gaps × `time_scale`), tenants by Zipf,
/// lognormal lengths and think times. Deterministic per seed; unbounded unless `sessions` is set
/// (the run's window stops it).
pub struct ChatSource {
    p: ChatParams,
    rng: Rng,
    zipf: Zipf,
    tenant_len: Vec<u32>,
    doc_len: Vec<u32>,
    mean_gap: f64,
    time_scale: f64,
    clock: f64,
    next_id: u64,
}

impl ChatSource {
    /// A new stream; `rate` is session starts per (unscaled) second.
    pub fn new(p: ChatParams, seed: u64, rate: f64, time_scale: f64) -> Self {
        let mut trng = Rng::fork(seed, 0x7465_6e61_6e74);
        let tenant_len = (0..p.tenants.max(1))
            .map(|_| trng.lognormal(p.system_median, 0.6, 256.0, 8192.0) as u32)
            .collect();
        let doc_len = (0..p.docs.max(1))
            .map(|_| trng.lognormal(p.context_median, 1.0, 0.0, 32768.0) as u32)
            .collect();
        ChatSource {
            zipf: Zipf::new(p.tenants.max(1) as usize, p.tenant_zipf),
            rng: Rng::fork(seed, 0x6368_6174),
            tenant_len,
            doc_len,
            mean_gap: time_scale / rate.max(1e-9),
            time_scale,
            clock: 0.0,
            next_id: 0,
            p,
        }
    }
}

impl SessionSource for ChatSource {
    fn next_session(&mut self) -> io::Result<Option<SessionPlan>> {
        if self.p.sessions.is_some_and(|n| self.next_id >= n) {
            return Ok(None);
        }
        let id = self.next_id;
        self.next_id += 1;
        let (p, r) = (&self.p, &mut self.rng);
        if id > 0 {
            self.clock += r.exponential(self.mean_gap);
        }
        let tenant = self.zipf.sample(r) as u64;
        let n_turns = if r.chance(p.one_shot_frac) {
            1
        } else {
            (1 + r.geometric(p.extra_turns_mean))
                .max(p.min_turns)
                .min(p.max_turns.max(1))
        };
        let mut first: Vec<Piece> = Vec::with_capacity(3);
        if r.chance(p.doc_frac) {
            let d = r.below(self.doc_len.len());
            first.push(Piece::Words {
                label: label(NS_DOC, d as u64, 0),
                tokens: self.doc_len[d],
            });
            first.push(Piece::Lit("\n\n"));
        } else if r.chance(p.context_frac) {
            let len = r.lognormal(p.context_median, 1.0, 0.0, 32768.0) as u32;
            first.push(Piece::Words {
                label: label(NS_CONTEXT, id, 0),
                tokens: len,
            });
            first.push(Piece::Lit("\n\n"));
        }
        let mut turns = Vec::with_capacity(n_turns as usize);
        for k in 0..n_turns as u64 {
            let q = r.lognormal(p.question_median, 0.8, 8.0, 4096.0) as u32;
            let a = r.lognormal(p.answer_median, 0.7, 16.0, 2048.0) as u32;
            let think = if k == 0 {
                0.0
            } else {
                r.lognormal(p.think_median_s, 1.07, 1.0, 3600.0) * self.time_scale
            };
            let mut user = if k == 0 {
                std::mem::take(&mut first)
            } else {
                Vec::with_capacity(1)
            };
            user.push(Piece::Words {
                label: label(NS_QUESTION, id, k),
                tokens: q,
            });
            turns.push(Turn {
                user,
                max_tokens: a,
                delay: secs(think),
            });
        }
        Ok(Some(SessionPlan {
            id,
            routing_key: id,
            start: secs(self.clock),
            system: Some(vec![Piece::Words {
                label: label(NS_SYSTEM, tenant, 1),
                tokens: self.tenant_len[tenant as usize],
            }]),
            turns,
            pacing: Pacing::AfterAnswer,
        }))
    }
}

/// Trace replay: one request per record at `timestamp · slowdown · time_scale`; the routing key
/// is the second hash id (the first block is a system prompt every request shares, the second
/// identifies a conversation chain in the Mooncake traces).
pub struct TraceSource {
    reader: TraceReader,
    scale: f64,
    limit: u64,
    next_id: u64,
}

impl TraceSource {
    /// Replay `reader`, at most `limit` records.
    pub fn new(reader: TraceReader, slowdown: f64, time_scale: f64, limit: u64) -> Self {
        TraceSource {
            reader,
            scale: slowdown * time_scale,
            limit,
            next_id: 0,
        }
    }

    /// Open a trace file.
    pub fn open(path: &Path, slowdown: f64, time_scale: f64, limit: u64) -> io::Result<Self> {
        Ok(Self::new(
            TraceReader::open(path)?,
            slowdown,
            time_scale,
            limit,
        ))
    }
}

impl SessionSource for TraceSource {
    fn next_session(&mut self) -> io::Result<Option<SessionPlan>> {
        if self.next_id >= self.limit {
            return Ok(None);
        }
        let Some(rec) = self.reader.next_record()? else {
            return Ok(None);
        };
        let id = self.next_id;
        self.next_id += 1;
        let key = rec
            .hash_ids
            .get(1)
            .or(rec.hash_ids.first())
            .copied()
            .unwrap_or(id);
        Ok(Some(SessionPlan {
            id,
            routing_key: key,
            start: secs(rec.timestamp as f64 / 1000.0 * self.scale),
            system: None,
            turns: vec![Turn {
                user: vec![Piece::Blocks {
                    ids: rec.hash_ids.into_boxed_slice(),
                    tokens: rec.input_length,
                }],
                max_tokens: rec.output_length.max(1),
                delay: Duration::ZERO,
            }],
            pacing: Pacing::AfterAnswer,
        }))
    }
}

/// Tiny requests at a fixed rate, to measure the gateway's own overhead: an 8-token prompt and
/// one output token.
pub struct RateSource {
    gap: f64,
    limit: u64,
    next_id: u64,
}

impl RateSource {
    /// `limit` requests, `rate` per (unscaled) second.
    pub fn new(rate: f64, time_scale: f64, limit: u64) -> Self {
        RateSource {
            gap: time_scale / rate.max(1e-9),
            limit,
            next_id: 0,
        }
    }
}

impl SessionSource for RateSource {
    fn next_session(&mut self) -> io::Result<Option<SessionPlan>> {
        if self.next_id >= self.limit {
            return Ok(None);
        }
        let id = self.next_id;
        self.next_id += 1;
        Ok(Some(SessionPlan {
            id,
            routing_key: id,
            start: secs(id as f64 * self.gap),
            system: None,
            turns: vec![Turn {
                user: vec![Piece::Text(format!("ping {id}: are you there?").into())],
                max_tokens: 1,
                delay: Duration::ZERO,
            }],
            pacing: Pacing::AfterAnswer,
        }))
    }
}

/// A finite list of sessions as a source (gsp, mrqa).
pub struct ListSource(std::vec::IntoIter<SessionPlan>);

impl ListSource {
    /// Serve `v` in order.
    pub fn new(v: Vec<SessionPlan>) -> Self {
        ListSource(v.into_iter())
    }
}

impl SessionSource for ListSource {
    fn next_session(&mut self) -> io::Result<Option<SessionPlan>> {
        Ok(self.0.next())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take(src: &mut dyn SessionSource, n: usize) -> Vec<SessionPlan> {
        (0..n).map_while(|_| src.next_session().unwrap()).collect()
    }

    #[test]
    fn gsp_shape_is_64_by_16_and_deterministic() {
        let p = GspParams::default();
        let v = gsp(&p, 1);
        assert_eq!(v.len(), 64 * 16);
        assert_eq!(v, gsp(&p, 1));
        assert_ne!(v, gsp(&p, 2), "the shuffle depends on the seed");
        let mut per_group = [0u32; 64];
        for s in &v {
            per_group[s.routing_key as usize] += 1;
            assert_eq!(s.turns.len(), 1);
            assert_eq!(s.turns[0].max_tokens, 256);
            assert_eq!(s.start, Duration::ZERO);
        }
        assert!(per_group.iter().all(|&c| c == 16));
        // Same group: same system prompt, different question; different groups differ at once.
        let mut by_group: Vec<&SessionPlan> = v.iter().filter(|s| s.routing_key == 5).collect();
        by_group.truncate(2);
        let other = v.iter().find(|s| s.routing_key == 6).unwrap();
        let text = |s: &SessionPlan| {
            let mut out = String::new();
            render(&s.turns[0].user, 9, &mut out);
            out
        };
        let (a, b, c) = (text(by_group[0]), text(by_group[1]), text(other));
        let sys = a.find("\n\n").unwrap();
        assert!(
            (2048 * 4..2048 * 4 + 8).contains(&sys),
            "system prompt is {sys} chars"
        );
        assert_eq!(a[..sys], b[..sys]);
        assert_ne!(a[sys..], b[sys..]);
        assert_ne!(a[..64], c[..64]);
        // The simulated tokenizer's budget: ~2176 prompt tokens at 4 chars a token.
        assert!(((2048 + 128) * 4..(2048 + 128) * 4 + 20).contains(&a.len()));
    }

    #[test]
    fn mrqa_schedule_and_history_shape() {
        let p = MrqaParams {
            users: 4,
            rounds: 3,
            ..MrqaParams::default()
        };
        let v = mrqa(&p, 2.0, 1.0);
        assert_eq!(v.len(), 4);
        // gap = N/qps = 2 s; users join every gap·(M−1)/N = 1 s.
        assert_eq!(v[3].start, Duration::from_secs(3));
        assert_eq!(v[0].turns[1].delay, Duration::from_secs(2));
        assert_eq!(v[0].pacing, Pacing::FromSend);
        let (mut a, mut b) = (String::new(), String::new());
        render(&v[0].turns[0].user, 1, &mut a);
        render(&v[1].turns[0].user, 1, &mut b);
        let shared = a.find("\nFor user").unwrap();
        assert_eq!(a[..shared], b[..shared], "shared system prompt");
        assert!(a.len() > (1000 + 2000) * 4);
        assert_eq!(
            v[2].turns[2].user,
            vec![Piece::Text(
                "Here's question #3: can you tell me a new long story with a happy ending?".into()
            )]
        );
    }

    #[test]
    fn chat_is_deterministic_and_follows_the_spec() {
        let mk = |seed| ChatSource::new(ChatParams::default(), seed, 0.5, 0.1);
        let a = take(&mut mk(3), 400);
        assert_eq!(a, take(&mut mk(3), 400));
        assert_ne!(a, take(&mut mk(4), 400));
        assert!(a.windows(2).all(|w| w[0].start <= w[1].start));
        // Mean gap 0.1/0.5 = 0.2 s → ~80 s for 400 sessions.
        let last = a.last().unwrap().start.as_secs_f64();
        assert!((60.0..100.0).contains(&last), "{last}");
        let one_shot = a.iter().filter(|s| s.turns.len() == 1).count() as f64 / 400.0;
        assert!((0.3..0.55).contains(&one_shot), "{one_shot}"); // 0.3 one-shot + geometric zeros
        assert!(a
            .iter()
            .all(|s| s.turns.len() <= 20 && s.turns[0].delay.is_zero()));
        let mean_turns = a.iter().map(|s| s.turns.len()).sum::<usize>() as f64 / 400.0;
        assert!((2.0..3.4).contains(&mean_turns), "{mean_turns}");
        // Think times are scaled: median 120 s × 0.1.
        let mut thinks: Vec<f64> = a
            .iter()
            .flat_map(|s| s.turns.iter().skip(1))
            .map(|t| t.delay.as_secs_f64())
            .collect();
        thinks.sort_by(f64::total_cmp);
        let med = thinks[thinks.len() / 2];
        assert!((8.0..16.0).contains(&med), "median think {med}");
        // Zipf: tenant 0's system prompt is the most common.
        let sys0 = Piece::Words {
            label: label(NS_SYSTEM, 0, 1),
            tokens: mk(3).tenant_len[0],
        };
        let n0 = a
            .iter()
            .filter(|s| s.system.as_deref() == Some(std::slice::from_ref(&sys0)))
            .count();
        assert!(n0 > 400 / 8, "{n0}");
        let bounded = ChatSource::new(
            ChatParams {
                sessions: Some(5),
                ..ChatParams::default()
            },
            1,
            1.0,
            1.0,
        );
        assert_eq!(take(&mut { bounded }, 100).len(), 5);
    }

    #[test]
    fn trace_and_rate_sources() {
        let data = "{\"timestamp\": 1500, \"input_length\": 700, \"output_length\": 0, \"hash_ids\": [0, 42]}\n\
                    {\"timestamp\": 2000, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [3]}\n";
        let reader = TraceReader::from_reader(Box::new(data.as_bytes()), "t".into());
        let v = take(&mut TraceSource::new(reader, 2.0, 0.5, 10), 10);
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].start, Duration::from_millis(1500));
        assert_eq!((v[0].routing_key, v[1].routing_key), (42, 3));
        assert_eq!(
            v[0].turns[0].max_tokens, 1,
            "zero-length outputs still ask for one token"
        );
        let mut s = String::new();
        render(&v[0].turns[0].user, 0, &mut s);
        assert_eq!(s.len(), 2800);
        let r = take(&mut RateSource::new(4.0, 1.0, 3), 10);
        assert_eq!(r.len(), 3);
        assert_eq!(r[2].start, Duration::from_millis(500));
    }

    #[test]
    fn labels_are_distinct() {
        let mut seen = std::collections::HashSet::new();
        for ns in 1..5 {
            for a in 0..50 {
                for b in 0..20 {
                    assert!(seen.insert(label(ns, a, b)));
                }
            }
        }
    }
}
