//! One request in prefill/decode disaggregation (`--pd-disaggregation`): the request loop
//! (`exchange::serve_with`) with a *pair* of workers as its [`Target`]. What is shared (the
//! loop and the client-watch race, admission, the tokenize phase, each side's pick with
//! KV-event measurement and tree inserts, retries and their exclusions, relay settings) is the
//! exchange's; what is PD's own lives here:
//!
//! - **pick**: a prefill worker, then a decode worker, each by its own side's policy;
//! - **attempt**: the bootstrap fields (and with `--dp-aware` each side's rank, decode also its
//!   twin's) spliced into the body ([`crate::route::bootstrap`]), sent to both at once; a
//!   failure on either side ends the attempt at once (the other request is dropped, which aborts
//!   it on its worker);
//! - **retry_after**: the failing side's circuit and health, that worker excluded, a new pair;
//! - **commit**: the decode answer relayed as it arrives while the prefill answer is read to its
//!   end; both workers stay counted in flight until both are done. A `/generate` that asked for
//!   logprobs gets prefill's input logprobs merged in ([`merge`]); with
//!   `--insert-response-text` the reply is learned for the prefill worker.

mod merge;

use super::error::GatewayError;
use super::exchange::{serve_with, served, Exchange, Forwarding, Lane, Picked, Target};
use super::reply::Reply;
use super::Outcome;
use crate::gateway::Core;
use crate::http::{BodyFraming, RequestHead};
use crate::proxy::discard::discard_body;
use crate::proxy::forward::{self, UpstreamError, UpstreamRequest, UpstreamResponse};
use crate::proxy::pool::Pool;
use crate::proxy::relay;
use crate::proxy::retry::is_retryable_status;
use crate::route::bootstrap::{self, Added, Bootstrap, PdShape};
use crate::route::extract::Api;
use crate::trace::span::{now_ns, Leg, Value};
use crate::workers::registry::Worker;
use crate::workers::role::{Role, Side};
use bytes::Bytes;
use monoio::net::TcpStream;
use monoio::time::Instant;
use std::time::Duration;

/// How long a decode error waits for its prefill twin's outcome before it is blamed on the
/// decode worker (a prefill that is down is refused within this).
const PREFILL_BLAME_GRACE: Duration = Duration::from_millis(500);

/// Largest answer ever buffered for a logprob merge (prefill's, and decode's when not
/// streamed). Each request's own bound ([`merge::AnswerBound`]: what a correct answer to *it*
/// can weigh, from its prompt and logprob options) is usually far lower, and is what holds;
/// this cap covers requests that bound cannot see through.
const MAX_BUFFERED_ANSWER: u64 = 256 << 20;

/// The most bytes of an answer read for a merge: its request's bound, never above the cap.
fn buffer_limit(bound: Option<u64>) -> u64 {
    bound.map_or(MAX_BUFFERED_ANSWER, |b| b.min(MAX_BUFFERED_ANSWER))
}

/// Handle a routed request in PD mode, from its head and body to the last byte relayed.
pub async fn handle(
    core: &Core,
    client: &mut TcpStream,
    head: &RequestHead,
    body: Bytes,
    api: Api,
) -> Outcome {
    if !matches!(api, Api::Generate | Api::Chat | Api::Completions) {
        let e = GatewayError::not_implemented(
            "this endpoint is not served in prefill/decode disaggregation mode",
        );
        return super::reply::send_error(client, Some(head), &e, None).await;
    }
    let forwarding = Forwarding::Routed(api);
    serve_with(core, client, head, &body, forwarding, |ex| {
        Pairs::new(ex, api)
    })
    .await
}

/// A prefill worker and a decode worker for one attempt, both counted in flight until dropped.
struct Pair<'a> {
    prefill: Picked<'a>,
    decode: Picked<'a>,
}

/// What an attempt produced.
enum Answer {
    /// Both answered 2xx: relay decode's, read prefill's to its end.
    Both {
        prefill: UpstreamResponse,
        decode: UpstreamResponse,
    },
    /// One side's final non-2xx answer (no retry left, or not worth one): relayed as is.
    Only(Side, UpstreamResponse),
}

/// The PD target: a prefill lane and a decode lane, each with its own router and failed
/// workers, and what pairing needs of the body.
struct Pairs<'a> {
    prefill: Lane<'a>,
    decode: Lane<'a>,
    api: Api,
    shape: PdShape,
}

impl<'a> Pairs<'a> {
    /// The target of a PD request; a body pairing cannot serve is refused (400).
    fn new(ex: &Exchange<'a>, api: Api) -> Result<Pairs<'a>, GatewayError> {
        let shape =
            bootstrap::pd_shape(api, &ex.info.shape).map_err(|e| GatewayError::bad_request(e.0))?;
        let decode = ex
            .gw
            .decode
            .as_ref()
            .ok_or_else(|| GatewayError::internal("prefill/decode mode is not configured"))?;
        Ok(Pairs {
            prefill: Lane::new(Side::Prefill, &ex.gw.router),
            decode: Lane::new(Side::Decode, decode),
            api,
            shape,
        })
    }
}

impl<'a> Target<'a> for Pairs<'a> {
    type Picked = Pair<'a>;
    type Answer = Answer;

    fn computing_lane(&mut self) -> &mut Lane<'a> {
        &mut self.prefill
    }

    /// A prefill worker, then a decode worker, each by its own side's policy (the exchange's
    /// own pick: KV-event measurement, target-worker header, tree inserts).
    fn pick(&mut self, ex: &mut Exchange<'a>) -> Result<Pair<'a>, GatewayError> {
        let prefill = ex.pick_on(&mut self.prefill)?;
        let decode = ex.pick_on(&mut self.decode)?;
        Ok(Pair { prefill, decode })
    }

    /// The paired bodies to both workers at once. Either side failing ends the attempt without
    /// waiting for the other.
    async fn attempt(
        &self,
        ex: &Exchange<'a>,
        pair: &Pair<'a>,
        retry: bool,
    ) -> Result<Answer, GatewayError> {
        let (p_body, d_body) = self.paired_bodies(ex, pair)?;
        trace_start(ex, pair);
        let preq = ex.upstream_request(Leg::Prefill, &pair.prefill.worker, p_body);
        let dreq = ex.upstream_request(Leg::Decode, &pair.decode.worker, d_body);
        let r = both_heads(
            &ex.core.pool,
            [&pair.prefill.worker, &pair.decode.worker],
            [&preq, &dreq],
            ex.connect_timeout(),
            ex.deadline,
            retry,
        )
        .await;
        trace_outcome(ex, &r, retry);
        r
    }

    /// The failing side's circuit and passive health hear of it; the other side's slot is
    /// released unrecorded (its request was dropped, not failed). Then back off and let the
    /// next pick choose a new pair without the failed worker.
    async fn retry_after(
        &mut self,
        ex: &mut Exchange<'a>,
        pair: Pair<'a>,
        error: GatewayError,
    ) -> Result<(), GatewayError> {
        let Pair { prefill, decode } = pair;
        let (failed, other, lane) = match error.side {
            Side::Decode => (decode, prefill, &mut self.decode),
            _ => (prefill, decode, &mut self.prefill),
        };
        drop(other);
        ex.retry_after_on(lane, failed, error).await
    }

    /// Both workers stay in flight until both answers are over; each circuit records its own
    /// outcome. With `--insert-response-text` the reply is learned for the prefill worker
    /// (where the next turn's prompt is computed).
    async fn commit(
        self,
        ex: Exchange<'a>,
        client: &mut TcpStream,
        pair: Pair<'a>,
        answer: Answer,
    ) -> Outcome {
        let Pair {
            mut prefill,
            mut decode,
        } = pair;
        let (status, keep_alive) = match answer {
            Answer::Only(side, up) => {
                let picked = match side {
                    Side::Decode => &mut decode,
                    _ => &mut prefill,
                };
                only(&ex, client, picked, side, up).await
            }
            Answer::Both {
                prefill: pup,
                decode: dup,
            } if self.wants_stream_merge(&ex) => {
                let (status, keep, p_ok, d_ok) = self
                    .stream_merged(&ex, client, &prefill, &decode, pup, dup)
                    .await;
                ex.record(&mut prefill, p_ok);
                ex.record(&mut decode, d_ok);
                (status, keep)
            }
            Answer::Both {
                prefill: pup,
                decode: dup,
            } if self.wants_merge(&ex) => {
                let (status, keep, p_ok, d_ok) =
                    self.merged(&ex, client, &prefill, &decode, pup, dup).await;
                ex.record(&mut prefill, p_ok);
                ex.record(&mut decode, d_ok);
                (status, keep)
            }
            Answer::Both {
                prefill: pup,
                decode: dup,
            } => relay_decode(&ex, client, &mut prefill, &mut decode, pup, dup).await,
        };
        ex.completed(&prefill);
        ex.completed(&decode);
        drop(prefill);
        drop(decode);
        ex.finished(status, keep_alive)
    }
}

/// One side's final answer relayed as it is (the other side's request was dropped). Returns
/// (status, keep-alive).
async fn only(
    ex: &Exchange<'_>,
    client: &mut TcpStream,
    picked: &mut Picked<'_>,
    side: Side,
    up: UpstreamResponse,
) -> (u16, bool) {
    let status = up.head.status;
    let how = ex.relay_to(&picked.worker);
    let relayed = relay::relay(&ex.core.pool, client, up, how, None).await;
    ex.record(picked, served(status, &relayed));
    ex.answered(&picked.worker, status);
    ex.relayed(legs(side).0, &relayed);
    (status, relayed.client_keep_alive)
}

/// Both answered 2xx: decode's answer relayed as it arrives while prefill's is read to its
/// end. Returns (status, keep-alive).
async fn relay_decode(
    ex: &Exchange<'_>,
    client: &mut TcpStream,
    prefill: &mut Picked<'_>,
    decode: &mut Picked<'_>,
    pup: UpstreamResponse,
    dup: UpstreamResponse,
) -> (u16, bool) {
    let status = dup.head.status;
    let chunked = matches!(dup.head.framing, BodyFraming::Chunked);
    let mut capture = ex.capture_for(prefill, chunked);
    let how = ex.relay_to(&decode.worker);
    let pool = &ex.core.pool;
    let (relayed, p_ok) = monoio::join!(
        relay::relay(pool, client, dup, how, capture.as_mut()),
        drain(pool, &prefill.worker, pup, ex.deadline)
    );
    ex.record(prefill, p_ok);
    ex.record(decode, served(status, &relayed));
    ex.answered(&decode.worker, status);
    ex.relayed(Leg::Decode, &relayed);
    ex.learn_captured(capture, relayed.complete, status, prefill.worker.id);
    (status, relayed.client_keep_alive)
}

/// Traced: one attempt span per side, open from now (each side's upstream request names its
/// own as the parent, so each worker's spans join under its side).
fn trace_start(ex: &Exchange<'_>, pair: &Pair<'_>) {
    let attrs = |worker: &Worker, side: &'static str| {
        let mut attrs = ex.attempt_attrs(worker);
        attrs.push(("radixgate.pd_side", Value::from(side)));
        attrs
    };
    ex.with_trace(|t, entropy| {
        t.start_pair_attempt(
            entropy,
            now_ns(),
            attrs(&pair.prefill.worker, "prefill"),
            attrs(&pair.decode.worker, "decode"),
        );
    });
}

/// Traced: what each side's attempt span learnt. A side that answered gets its status (its
/// span ends with the answer, at the request's end); a failed side ends failed, with the retry
/// reason when another pair gets a try, and its twin ends then too (its request was dropped,
/// which aborts it on its worker).
fn trace_outcome(ex: &Exchange<'_>, r: &Result<Answer, GatewayError>, retry: bool) {
    ex.with_trace(|t, _| {
        let now = now_ns();
        match r {
            Ok(Answer::Both { prefill, decode }) => {
                let p = i64::from(prefill.head.status);
                t.leg_set(Leg::Prefill, "http.response.status_code", p);
                let d = i64::from(decode.head.status);
                t.leg_set(Leg::Decode, "http.response.status_code", d);
            }
            Ok(Answer::Only(side, up)) => {
                let (leg, twin) = legs(*side);
                t.leg_set(leg, "http.response.status_code", i64::from(up.head.status));
                t.leg_set(twin, "radixgate.dropped", true);
                t.end_leg(twin, now, None);
            }
            Err(e) => {
                let (leg, twin) = legs(e.side);
                if let Some(status) = e.fault.status() {
                    t.leg_set(leg, "http.response.status_code", i64::from(status));
                }
                if e.retryable && retry {
                    t.leg_set(leg, "radixgate.retry_reason", e.fault.reason());
                }
                t.end_leg(leg, now, Some(e.message.clone()));
                t.leg_set(twin, "radixgate.dropped", true);
                t.end_leg(twin, now, None);
            }
        }
    });
}

impl Pairs<'_> {
    /// The bodies for this pair: the client's bytes with the prefill worker's bootstrap fields
    /// and fresh rooms spliced in, and with `--dp-aware` each side's rank (decode also learns
    /// its twin's, `disagg_prefill_dp_rank`, so the two ranks pair up). One body for both when
    /// no rank differs. A body that cannot take them is the client's fault (400).
    fn paired_bodies(
        &self,
        ex: &Exchange<'_>,
        pair: &Pair<'_>,
    ) -> Result<(Bytes, Bytes), GatewayError> {
        let prefill = &pair.prefill.worker;
        let port = match prefill.role {
            Role::Prefill { bootstrap_port } => bootstrap_port,
            _ => None,
        };
        let mut one = [0u64; 1];
        let many: Vec<u64>;
        let room = || bootstrap::room(ex.core.rng.borrow_mut().next_u64());
        let rooms: &[u64] = match self.shape.batch {
            Some(n) => {
                many = (0..n).map(|_| room()).collect();
                &many
            }
            None => {
                one[0] = room();
                &one
            }
        };
        let b = Bootstrap {
            host: &prefill.host,
            port,
            rooms,
            batch: self.shape.batch.is_some(),
        };
        let p_rank = prefill.dp.map(|d| d.rank);
        let d_rank = pair.decode.worker.dp.map(|d| d.rank);
        let splice = |dp_rank, prefill_dp_rank| {
            let added = Added {
                bootstrap: Some(b),
                dp_rank,
                prefill_dp_rank,
                priority: ex.engine_priority,
            };
            bootstrap::splice_fields(ex.body, &added)
                .map(Bytes::from)
                .map_err(|e| GatewayError {
                    side: Side::Prefill,
                    ..GatewayError::unsendable(e.0)
                })
        };
        let p_body = splice(p_rank, None)?;
        let d_body = if p_rank.is_none() && d_rank.is_none() {
            p_body.clone()
        } else {
            splice(d_rank, p_rank)?
        };
        Ok((p_body, d_body))
    }

    /// Whether this answer gets prefill's input logprobs merged in whole: a non-streaming
    /// `/generate` with `return_logprob`.
    fn wants_merge(&self, ex: &Exchange<'_>) -> bool {
        self.api == Api::Generate && self.shape.return_logprob && !ex.info.stream
    }

    /// Whether each event of this streamed answer gets prefill's input logprobs merged in: a
    /// streaming `/generate` with `return_logprob`.
    fn wants_stream_merge(&self, ex: &Exchange<'_>) -> bool {
        self.api == Api::Generate && self.shape.return_logprob && ex.info.stream
    }

    /// A streamed `/generate` with input logprobs: prefill's answer is read first (it is over
    /// before decode's first token, which needs the prefill's KV), then decode's stream is
    /// relayed event by event with prefill's input logprobs put in front of each event's own.
    /// Returns (status, keep-alive, prefill ok, decode ok).
    async fn stream_merged(
        &self,
        ex: &Exchange<'_>,
        client: &mut TcpStream,
        prefill: &Picked<'_>,
        decode: &Picked<'_>,
        pup: UpstreamResponse,
        dup: UpstreamResponse,
    ) -> (u16, bool, bool, bool) {
        let pool = &ex.core.pool;
        let bound = merge::AnswerBound::of(ex.body);
        let limit = buffer_limit(bound.as_ref().map(|b| b.prefill(true)));
        let p = read_whole(pool, &prefill.worker, pup, ex.deadline, limit).await;
        let lists = match &p {
            Ok((_, body)) => merge::prefill_input_logprobs(body),
            // Nothing has reached the client yet: the decode request is dropped (aborted on
            // its server) and the client gets the error, as for any failure before the head.
            Err(Unread::Refused) => {
                drop(dup);
                let (status, keep) = refuse_merge(ex, client, Side::Prefill, limit).await;
                return (status, keep, false, true);
            }
            // A prefill that broke off: decode's stream goes out without prompt logprobs.
            Err(Unread::Broke) => merge::PrefillLists::default(),
        };
        let status = dup.head.status;
        let how = ex.relay_to(&decode.worker);
        let mut rewrite = |event: &[u8], out: &mut bytes::BytesMut| {
            merge::merge_event(&lists, event, out);
        };
        let relayed = relay::relay_rewriting_events(pool, client, dup, how, &mut rewrite).await;
        ex.relayed(Leg::Decode, &relayed);
        let d_ok = served(status, &relayed);
        (status, relayed.client_keep_alive, p.is_ok(), d_ok)
    }

    /// Both answers read whole (each no larger than a correct answer to this request can be),
    /// prefill's input logprobs put in front of decode's as bytes, the result written as one
    /// JSON answer. An answer past its bound is not read on: the client gets a 502 at once and
    /// the other side's request is dropped. Returns (status, keep-alive, prefill ok, decode ok).
    async fn merged(
        &self,
        ex: &Exchange<'_>,
        client: &mut TcpStream,
        prefill: &Picked<'_>,
        decode: &Picked<'_>,
        pup: UpstreamResponse,
        dup: UpstreamResponse,
    ) -> (u16, bool, bool, bool) {
        let pool = &ex.core.pool;
        let deadline = ex.deadline;
        let bound = merge::AnswerBound::of(ex.body);
        let p_limit = buffer_limit(bound.as_ref().map(|b| b.prefill(false)));
        let d_limit = buffer_limit(bound.as_ref().and_then(merge::AnswerBound::decode));
        let p = read_whole(pool, &prefill.worker, pup, deadline, p_limit);
        let d = read_whole(pool, &decode.worker, dup, deadline, d_limit);
        let mut p = std::pin::pin!(p);
        let mut d = std::pin::pin!(d);
        // Whichever side is refused first ends the merge without waiting for the other.
        let (p, d) = monoio::select! {
            pr = &mut p => {
                if matches!(pr, Err(Unread::Refused)) {
                    let (status, keep) = refuse_merge(ex, client, Side::Prefill, p_limit).await;
                    return (status, keep, false, true);
                }
                (pr, d.await)
            }
            dr = &mut d => {
                if matches!(dr, Err(Unread::Refused)) {
                    let (status, keep) = refuse_merge(ex, client, Side::Decode, d_limit).await;
                    return (status, keep, true, false);
                }
                (p.await, dr)
            }
        };
        if matches!(p, Err(Unread::Refused)) {
            let (status, keep) = refuse_merge(ex, client, Side::Prefill, p_limit).await;
            return (status, keep, false, true);
        }
        let (d_status, d_body) = match d {
            Ok(d) => d,
            Err(Unread::Refused) => {
                let (status, keep) = refuse_merge(ex, client, Side::Decode, d_limit).await;
                return (status, keep, p.is_ok(), false);
            }
            Err(Unread::Broke) => {
                let e = GatewayError::bad_gateway("the decode worker's answer broke off");
                let out = ex.send_reply(client, &Reply::error(&e)).await;
                return (out.status, out.keep_alive, p.is_ok(), false);
            }
        };
        // A prefill that broke off: decode's answer goes out without prompt logprobs.
        let merged = p
            .as_ref()
            .ok()
            .and_then(|(_, pb)| merge::merge_input_logprobs(pb, &d_body));
        let body = merged.unwrap_or_else(|| d_body.to_vec());
        let out = ex
            .send_reply(client, &Reply::raw_json(d_status, body))
            .await;
        (out.status, out.keep_alive, p.is_ok(), true)
    }
}

/// A merge refused because `side`'s answer is larger than any correct answer to this
/// request (more than `limit` bytes) or not framed: a 502 in the OpenAI error shape.
/// Returns (status, keep-alive).
async fn refuse_merge(
    ex: &Exchange<'_>,
    client: &mut TcpStream,
    side: Side,
    limit: u64,
) -> (u16, bool) {
    let e = GatewayError::bad_gateway(format!(
        "the {} worker's answer is malformed or larger than any answer to this request \
             can be ({limit} bytes)",
        side.name()
    ));
    let out = ex.send_reply(client, &Reply::error(&e)).await;
    (out.status, out.keep_alive)
}

/// Send both requests at once and wait for both heads, unless one side fails first: a prefill
/// that fails or answers non-2xx, or a decode that fails or answers non-2xx, ends the wait (the
/// other request is dropped, closing its connection, which aborts it on its worker).
async fn both_heads(
    pool: &Pool,
    workers: [&Worker; 2],
    reqs: [&UpstreamRequest; 2],
    connect_timeout: Duration,
    deadline: Instant,
    retry: bool,
) -> Result<Answer, GatewayError> {
    let [pw, dw] = workers;
    let [preq, dreq] = reqs;
    let p = forward::roundtrip(pool, pw, preq, false, connect_timeout, deadline);
    let d = forward::roundtrip(pool, dw, dreq, false, connect_timeout, deadline);
    let mut p = std::pin::pin!(p);
    let mut d = std::pin::pin!(d);
    let first = monoio::select! {
        r = &mut p => (Side::Prefill, r),
        r = &mut d => (Side::Decode, r),
    };
    let (side, r) = first;
    if side == Side::Decode && r.as_ref().is_ok_and(|up| !is_success(up)) {
        // A decode server that answers an error while its prefill twin is still out may fail
        // *because of* the prefill (the KV never came: the prefill is down or failed). Give
        // the prefill a moment to fail too, so the blame, and the exclusion, go to it.
        if let Ok(pr) = monoio::time::timeout(PREFILL_BLAME_GRACE, &mut p).await {
            if let Judged::Final(pup) = judge(Side::Prefill, pw, dw, pr, retry)? {
                return Ok(Answer::Only(Side::Prefill, pup));
            }
        }
    }
    let up = judge(side, pw, dw, r, retry)?;
    let (prefill, decode) = match up {
        Judged::Final(up) => return Ok(Answer::Only(side, up)),
        Judged::Good(up) => match side {
            Side::Prefill => {
                let other = judge(Side::Decode, pw, dw, d.await, retry)?;
                match other {
                    Judged::Final(dup) => return Ok(Answer::Only(Side::Decode, dup)),
                    Judged::Good(dup) => (up, dup),
                }
            }
            _ => {
                let other = judge(Side::Prefill, pw, dw, p.await, retry)?;
                match other {
                    Judged::Final(pup) => return Ok(Answer::Only(Side::Prefill, pup)),
                    Judged::Good(pup) => (pup, up),
                }
            }
        },
    };
    Ok(Answer::Both { prefill, decode })
}

/// A side's attempt span, and its twin's.
fn legs(side: Side) -> (Leg, Leg) {
    match side {
        Side::Decode => (Leg::Decode, Leg::Prefill),
        _ => (Leg::Prefill, Leg::Decode),
    }
}

/// A 2xx answer.
fn is_success(up: &UpstreamResponse) -> bool {
    (200..300).contains(&up.head.status)
}

/// One side's head, judged.
enum Judged {
    /// 2xx: the pair goes on.
    Good(UpstreamResponse),
    /// A non-2xx answer with no retry to try: it is what the client gets.
    Final(UpstreamResponse),
}

fn judge(
    side: Side,
    pw: &Worker,
    dw: &Worker,
    r: Result<UpstreamResponse, UpstreamError>,
    retry: bool,
) -> Result<Judged, GatewayError> {
    let worker = if side == Side::Prefill { pw } else { dw };
    match r {
        Ok(up) if is_success(&up) => Ok(Judged::Good(up)),
        Ok(up) if is_retryable_status(up.head.status) && retry => {
            let status = up.head.status;
            crate::log!(
                Debug,
                "{} worker {} answered {status}",
                side.name(),
                worker.url
            );
            Err(GatewayError::worker_answer(&up.head).on_side(side))
        }
        Ok(up) => Ok(Judged::Final(up)),
        Err(e) => {
            crate::log!(
                Debug,
                "{} worker {}: {}",
                side.name(),
                worker.url,
                e.message()
            );
            Err(GatewayError::upstream(&e).on_side(side))
        }
    }
}

/// Read the prefill answer to its end without keeping it (its connection goes back to the
/// pool when clean). Returns whether it counts as a success for the prefill worker's circuit.
async fn drain(pool: &Pool, worker: &Worker, up: UpstreamResponse, deadline: Instant) -> bool {
    match discard_body(up, deadline).await {
        Ok(d) => {
            if d.reusable {
                pool.put(worker, d.stream);
            }
            true
        }
        Err(e) => {
            crate::log!(
                Debug,
                "prefill worker {}: answer broke off: {e}",
                worker.url
            );
            false
        }
    }
}

/// Why an answer read for a merge is not there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unread {
    /// It broke off or timed out.
    Broke,
    /// It is larger than the limit (refused as soon as its length or a chunk size says so,
    /// without reading it) or its framing is malformed.
    Refused,
}

/// A whole answer (status, body) of at most `max` bytes; its connection back to `pool` when
/// reusable.
async fn read_whole(
    pool: &Pool,
    worker: &Worker,
    up: UpstreamResponse,
    deadline: Instant,
    max: u64,
) -> Result<(u16, Bytes), Unread> {
    let reusable = up.head.keep_alive && !matches!(up.head.framing, BodyFraming::Close);
    match forward::read_full_body(up, deadline, max).await {
        Ok(full) => {
            if reusable && !full.stray {
                pool.put(worker, full.stream);
            }
            Ok((full.head.status, full.body))
        }
        // `read_full_body` says InvalidData for a body past `max` and for broken chunk framing.
        Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
            crate::log!(
                Debug,
                "worker {}: answer refused for a merge (limit {max} bytes): {e}",
                worker.url
            );
            Err(Unread::Refused)
        }
        Err(e) => {
            crate::log!(Debug, "worker {}: answer broke off: {e}", worker.url);
            Err(Unread::Broke)
        }
    }
}
