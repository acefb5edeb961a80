//! The routed request: extract routing inputs from the body, choose a worker with the policy
//! against the current tree snapshot, count it in flight, queue the tree insert, forward, relay,
//! and account the outcome. Everything that can go wrong before a response byte reaches the
//! client becomes a JSON error with the right status.

use crate::admission::Refusal;
use crate::gateway::{Core, Gateway};
use crate::http::{self, RequestHead};
use crate::proxy::capture::Capture;
use crate::proxy::forward::{self, UpstreamRequest};
use crate::proxy::io::{closed_by_peer, send_error};
use crate::proxy::request_id::request_id;
use crate::proxy::retry::{is_retryable_status, RetryPolicy};
use crate::route::extract::{extract, Api, RoutingInfo};
use crate::route::policy::{Branch, Decision, RouteInput};
use crate::tree::{Insert, WorkerId};
use crate::workers::breaker::is_worker_failure;
use crate::workers::registry::Worker;
use bytes::Bytes;
use monoio::net::TcpStream;
use monoio::time::Instant;
use std::borrow::Cow;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

/// Keeps a worker's in-flight count raised while a request is on it, and tells the policy when
/// the request is over, on every path (success, retry, error).
struct InFlight<'a> {
    gw: &'a Gateway,
    worker: WorkerId,
    routing_key: Option<&'a [u8]>,
}

impl<'a> InFlight<'a> {
    fn new(gw: &'a Gateway, worker: WorkerId, routing_key: Option<&'a [u8]>) -> Self {
        gw.registry.loads.inc(worker);
        InFlight {
            gw,
            worker,
            routing_key,
        }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.gw.registry.loads.dec(self.worker);
        self.gw
            .policy
            .request_finished(self.routing_key, self.worker, self.gw.now_ms());
    }
}

/// Bytes of `s` as a zero-copy slice of `body` when `s` lies inside it (borrowed by the
/// extractor), else a copy (text that had to be unescaped or joined).
pub fn as_body_slice(body: &Bytes, s: &str) -> Bytes {
    let start = body.as_ptr() as usize;
    let p = s.as_ptr() as usize;
    if !s.is_empty() && p >= start && p + s.len() <= start + body.len() {
        body.slice(p - start..p - start + s.len())
    } else {
        Bytes::copy_from_slice(s.as_bytes())
    }
}

/// Write an OpenAI-style error (with `x-request-id` when known) and report whether the
/// connection may go on.
pub async fn reply_error(
    stream: &mut TcpStream,
    head: &RequestHead,
    status: u16,
    error_type: &str,
    msg: &str,
) -> bool {
    reply_error_with(stream, head, status, error_type, msg, &[]).await
}

async fn reply_error_with_id(
    stream: &mut TcpStream,
    head: &RequestHead,
    status: u16,
    error_type: &str,
    msg: &str,
    id: &str,
) -> bool {
    reply_error_with(
        stream,
        head,
        status,
        error_type,
        msg,
        &[("x-request-id", id)],
    )
    .await
}

async fn reply_error_with(
    stream: &mut TcpStream,
    head: &RequestHead,
    status: u16,
    error_type: &str,
    msg: &str,
    extra: &[(&str, &str)],
) -> bool {
    let keep = head.keep_alive;
    send_error(stream, status, error_type, msg, extra, !keep).await && keep
}

/// Handle a proxied request (`api` None: pass-through GET with no routing text). Returns the
/// status sent and whether the client connection may serve another request.
pub async fn handle(
    core: &Rc<Core>,
    client: &mut TcpStream,
    head: &RequestHead,
    body: Bytes,
    api: Option<Api>,
) -> (u16, bool) {
    let gw = core.gw.clone();
    // Inference needs the key; the proxied informational GETs (/get_model_info,
    // /health_generate) are public like the reference's.
    if let (Some(_), Err(msg)) = (api, gw.authorize(head, false)) {
        return (
            401,
            reply_error(client, head, 401, "authentication_error", msg).await,
        );
    }
    let started = Instant::now();
    let deadline = started + gw.cfg.request_timeout();
    let info = match api {
        Some(api) => match extract(api, &body) {
            Ok(i) => i,
            Err(e) => {
                return (
                    400,
                    reply_error(client, head, 400, "invalid_request_error", &e.0).await,
                )
            }
        },
        None => RoutingInfo {
            model: None,
            stream: false,
            text: Cow::Borrowed(""),
        },
    };
    if api.is_some() {
        gw.metrics.routed(
            gw.model_label(info.model.as_deref()),
            crate::metrics::path_label(head.path()),
            info.stream,
        );
    }
    let rid = request_id(
        head,
        &gw.cfg.request_id_headers,
        head.path(),
        &mut core.rng.borrow_mut(),
    );
    let _permit = match gw.admission.acquire().await {
        Ok(p) => p,
        Err(Refusal::QueueFull) => {
            return (
                429,
                reply_error_with_id(
                    client,
                    head,
                    429,
                    "rate_limit_exceeded",
                    "too many requests: the admission queue is full",
                    &rid,
                )
                .await,
            )
        }
        Err(Refusal::Timeout) => {
            return (
                408,
                reply_error_with_id(
                    client,
                    head,
                    408,
                    "timeout",
                    "timed out waiting in the admission queue",
                    &rid,
                )
                .await,
            )
        }
    };
    let routing_key = head.header("x-smg-routing-key");
    let hash_key = routing_key
        .or_else(|| head.header("authorization"))
        .or_else(|| head.header("x-forwarded-for"))
        .or_else(|| head.header("cookie"));
    // Only the tree needs the model as bytes.
    let model_bytes = info
        .model
        .as_ref()
        .filter(|_| gw.tree.is_some())
        .map(|m| as_body_slice(&body, m));
    let req_head_is_head = head.method() == b"HEAD";
    let retry = gw.retry;
    // Workers that already failed this request: every retry goes elsewhere (the reference
    // retries the worker its tree points at, i.e. the failing one).
    let mut excluded: Vec<WorkerId> = Vec::new();
    let mut attempt: u32 = 0;
    let mut last_error: Option<(u16, String)> = None;
    loop {
        let list = gw.registry.load_full();
        let now_ms = gw.now_ms();
        let input = RouteInput {
            text: &info.text,
            routing_key,
            target_worker: head.header("x-smg-target-worker"),
            hash_key,
            exclude: &excluded,
            now_ms,
            recent: None,
        };
        let (decision, epoch) =
            choose(core, api.is_some(), info.model.as_deref(), input, &list.ids);
        let Some(decision) = decision else {
            let (status, msg) = last_error.unwrap_or_else(|| {
                let msg = if list.is_empty() {
                    "no workers are registered"
                } else {
                    "no available workers (all unhealthy or circuits open)"
                };
                (503, msg.to_string())
            });
            let error_type = if status == 504 {
                "timeout"
            } else {
                "service_unavailable"
            };
            return (
                status,
                reply_error_with_id(client, head, status, error_type, &msg, &rid).await,
            );
        };
        let Some(worker): Option<Arc<Worker>> = list.get(decision.worker).cloned() else {
            gw.policy
                .request_finished(routing_key, decision.worker, now_ms);
            excluded.push(decision.worker);
            continue;
        };
        if !worker.breaker.try_acquire(&gw.breaker) {
            // Half-open and its probe slots are taken: try someone else.
            gw.policy.request_finished(routing_key, worker.id, now_ms);
            excluded.push(worker.id);
            continue;
        }
        attempt += 1;
        gw.metrics
            .selection(gw.policy.kind().as_str(), decision.branch.as_str());
        let in_flight = InFlight::new(&gw, worker.id, routing_key);
        // Insert now, as the reference does: requests that arrive while this one is still in
        // prefill (a burst sharing a system prompt) then already follow it to this worker. If
        // the attempt fails, the retry excludes this worker whatever the tree says.
        if decision.insert_text {
            let text = as_body_slice(&body, &info.text);
            learn(&gw, model_bytes.clone(), text, worker.id, epoch, now_ms);
        }
        let req = UpstreamRequest::build(
            head.method(),
            head.target(),
            Some(head),
            &worker.authority,
            &rid,
            body.clone(),
        );
        // Race the worker's answer against the client leaving: a client that gives up while its
        // prompt is in prefill or its reply is being generated frees the worker at once.
        let outcome = monoio::select! {
            r = forward::roundtrip(core, &worker, &req, req_head_is_head, deadline) => Some(r),
            _ = async {
                // Quick answers never pay for the watch (a poll op and its cancellation).
                monoio::time::sleep(Duration::from_millis(20)).await;
                closed_by_peer(client).await
            } => None,
        };
        let Some(outcome) = outcome else {
            drop(in_flight);
            gw.metrics.client_gone();
            return (499, false);
        };
        let can_retry = attempt < retry.max_attempts && Instant::now() < deadline;
        let up = match outcome {
            Ok(up) if is_retryable_status(up.head.status) && can_retry => {
                gw.record_outcome(&worker, !is_worker_failure(up.head.status));
                last_error = Some((
                    up.head.status,
                    format!("worker {} answered {}", worker.url, up.head.status),
                ));
                drop(up); // closes that upstream connection; its body is not wanted
                drop(in_flight);
                excluded.push(worker.id);
                gw.metrics.retry();
                backoff(core, &retry, attempt, deadline).await;
                continue;
            }
            Ok(up) => up,
            Err(e) => {
                if e.is_connect() {
                    gw.on_connect_failure(&worker);
                }
                gw.record_outcome(&worker, false);
                drop(in_flight);
                last_error = Some((e.status(), e.message(&worker.url)));
                if can_retry {
                    excluded.push(worker.id);
                    gw.metrics.retry();
                    backoff(core, &retry, attempt, deadline).await;
                    continue;
                }
                let (status, msg) = last_error.unwrap_or((502, String::new()));
                let error_type = if status == 504 {
                    "timeout"
                } else {
                    "bad_gateway"
                };
                return (
                    status,
                    reply_error_with_id(client, head, status, error_type, &msg, &rid).await,
                );
            }
        };
        // Committed to this worker: from here on bytes reach the client, so no more retries.
        let status = up.head.status;
        gw.record_outcome(&worker, !is_worker_failure(status));
        let chunked = matches!(up.head.framing, http::BodyFraming::Chunked);
        let mut capture = api
            .filter(|_| gw.cfg.insert_response_text && decision.insert_text)
            .map(|a| Capture::new(a, chunked));
        let how = forward::RelayTo {
            worker: &worker,
            request_id: &rid,
            client_keep_alive: head.keep_alive,
            deadline,
        };
        let relayed = forward::relay(core, client, up, how, capture.as_mut()).await;
        drop(in_flight);
        worker
            .completed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if relayed.upstream_broke {
            gw.record_outcome(&worker, false);
        }
        if let Some(t) = relayed.first_body_at {
            gw.metrics.ttft(t.duration_since(started));
        }
        if relayed.complete && (200..300).contains(&status) {
            // Opt-in: learn "prompt + reply" so the next turn matches its whole history.
            if let Some(reply) = capture.and_then(|c| c.reply()) {
                let mut full = String::with_capacity(info.text.len() + 1 + reply.len());
                full.push_str(&info.text);
                full.push(' ');
                full.push_str(&reply);
                let now = gw.now_ms();
                learn(
                    &gw,
                    model_bytes,
                    Bytes::from(full),
                    worker.id,
                    gw.recent_epoch(),
                    now,
                );
            }
        }
        return (status, relayed.client_keep_alive);
    }
}

/// Ask the policy for a worker against the current snapshot (and the unpublished inserts);
/// pass-through GETs (`routed` false) take any selectable worker. Returns the decision and the
/// snapshot epoch it saw.
fn choose(
    core: &Core,
    routed: bool,
    model: Option<&str>,
    mut input: RouteInput<'_>,
    workers: &[WorkerId],
) -> (Option<Decision>, u64) {
    let gw = &core.gw;
    let rng = &mut core.rng.borrow_mut();
    if !routed {
        let d = gw
            .registry
            .loads
            .pick_random_eligible(workers, input.exclude, rng);
        return (d.map(|w| Decision::plain(w, Branch::Random)), 0);
    }
    let forest = gw.tree.as_ref().map(|t| t.load());
    let model = model.map(str::as_bytes);
    let tree = forest.as_ref().and_then(|f| f.tree(model));
    let epoch = forest.as_ref().map_or(0, |f| f.epoch());
    if forest.is_some() {
        input.recent = gw.recent.longest(model, input.text, epoch);
    }
    (
        gw.policy
            .select(&input, workers, &gw.registry.loads, tree, rng),
        epoch,
    )
}

/// Record that `text` now lives on `worker`: in the shared ring at once, in the tree through
/// the writer (never blocking: a full channel drops the insert and counts it).
fn learn(
    gw: &Gateway,
    model: Option<Bytes>,
    text: Bytes,
    worker: WorkerId,
    epoch: u64,
    now_ms: u64,
) {
    if let Some(tree) = &gw.tree {
        gw.recent.push(model.clone(), text.clone(), worker, epoch);
        tree.try_insert(Insert {
            model,
            text,
            worker,
            now_ms,
        });
    }
}

async fn backoff(core: &Core, retry: &RetryPolicy, attempt: u32, deadline: Instant) {
    let u = core.rng.borrow_mut().unit();
    let delay = Duration::from_millis(retry.delay_ms(attempt.saturating_sub(1), u));
    let until = std::cmp::min(Instant::now() + delay, deadline);
    monoio::time::sleep_until(until).await;
}
