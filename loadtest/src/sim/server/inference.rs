//! Inference requests: fault knobs, submission to the engine, and the blocking or streamed
//! (SSE) answer.

use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

use bytes::Bytes;
use radixgate::http::RequestHead;

use crate::sim::api::{self, Completed, Endpoint, RespMeta, StreamRenderer, TokenChunk, Usage};
use crate::sim::disagg::{self, DisaggMode, RoomState};
use crate::sim::engine::{FinishInfo, FinishReason};
use crate::sim::radix::Namespace;
use crate::sim::EngineKind;

use super::conn::{write, AbortGuard, Next, Reader, WriteHalf};
use super::routes::{answered, respond, respond_error, stall};
use super::wake::Slot;
use super::{unix_now, InProgress, Refused, Server, HOLD_POLL, MADE_WAY, QUEUE_FULL};

/// Data events written before a `close_mid_stream` fault cuts the stream.
const CUT_AFTER_EVENTS: usize = 3;

pub(super) async fn inference(
    sh: &Rc<Server>,
    head: &RequestHead,
    ep: Endpoint,
    body: &[u8],
    r: &mut Reader,
    wr: &mut WriteHalf,
) -> Next {
    let keep = head.keep_alive;
    sh.in_progress.set(sh.in_progress.get() + 1);
    let _in_progress = InProgress(&sh.in_progress);
    if let Some(next) = apply_faults(sh, keep, r, wr).await {
        return next;
    }
    let mut req = match api::parse_inference(ep, body, &sh.tok, sh.cfg.default_max_tokens) {
        Ok(req) => req,
        Err(e) => {
            let next = respond_error(sh, wr, keep, 400, "BadRequestError", &e.message).await;
            answered(sh);
            return next;
        }
    };
    if ep == Endpoint::Tokens {
        // vLLM names the request after the `x-request-id` header, else its `request_id`.
        let base = head
            .header("x-request-id")
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .or(req.rid.take())
            .unwrap_or_else(|| sh.next_resp_id(""));
        req.rid = Some(format!("{}{base}", api::TOKENS_ID_PREFIX));
    }
    let namespaces = match sh.cfg.engine {
        EngineKind::Vllm => Ok(req.vllm_namespaces(&sh.cfg.lora_modules)),
        EngineKind::Sglang => req.namespaces(&sh.cfg.model_name),
    };
    let namespaces = match namespaces {
        Ok(ns) => ns,
        Err(e) => {
            let next = respond_error(sh, wr, keep, 400, "BadRequestError", &e.message).await;
            answered(sh);
            return next;
        }
    };
    let rooms = match disaggregated(sh, body, req.prompts.len(), r).await {
        Ok(rooms) => rooms,
        Err((status, kind, msg)) => {
            let next = respond_error(sh, wr, keep, status, kind, &msg).await;
            answered(sh);
            return next;
        }
    };
    if sh.cfg.disaggregation_mode == Some(DisaggMode::Prefill) {
        // The prefill server computes the prompt and one token; decode generates the rest.
        req.max_new_tokens = 1;
    }
    let transferred = sh.cfg.disaggregation_mode == Some(DisaggMode::Decode);
    // PD `/generate` with `return_logprob`: the prompt's logprobs come from the prefill side
    // (streamed or not).
    let input_logprobs = (ep == Endpoint::Generate)
        .then(|| disagg::input_logprobs(sh.cfg.disaggregation_mode?, body, &req.prompts))
        .flatten();
    let Submitted {
        guard,
        slots,
        prompt_lens,
    } = match submit_all(
        sh,
        req.prompts,
        namespaces,
        req.max_new_tokens,
        super::Admit {
            internal: false,
            transferred,
            priority: req.priority,
        },
    ) {
        Ok(x) => x,
        Err(Refused::Bad(msg)) => {
            let next = respond_error(sh, wr, keep, 400, "BadRequestError", &msg).await;
            answered(sh);
            return next;
        }
        Err(Refused::QueueFull) => {
            let rid = req.rid.clone().unwrap_or_else(|| sh.next_resp_id(""));
            let how = Answer::to(head);
            let next = queue_full(sh, how, ep, req.stream, &rid, QUEUE_FULL, wr).await;
            answered(sh);
            return next;
        }
    };
    // `/abort_request` finds the request by the `x-request-id` the gateway sent, or by the
    // body's `rid` (`/generate`).
    let _rids = RidGuard::register(sh, head, req.rid.as_deref(), &guard.ids);
    let model = req.model.unwrap_or_else(|| sh.cfg.model_name.clone());
    let id = match ep {
        Endpoint::Chat => sh.next_resp_id("chatcmpl-"),
        Endpoint::Completions => sh.next_resp_id("cmpl-"),
        Endpoint::Responses => sh.next_resp_id("resp_"),
        Endpoint::Messages => sh.next_resp_id("msg_"),
        Endpoint::Generate | Endpoint::Tokens => req.rid.unwrap_or_else(|| sh.next_resp_id("")),
    };
    let created = unix_now() as u64;
    let next = if req.stream {
        let mut renderer = StreamRenderer::new(ep, id, created, model, req.include_usage);
        if let Some(lp) = input_logprobs.as_ref().and_then(|l| l.first()) {
            renderer = renderer.with_input_logprobs(lp.clone());
        }
        stream_response(sh, head, renderer, &slots[0], prompt_lens[0], r, wr).await
    } else {
        let meta = RespMeta {
            id: &id,
            created,
            model: &model,
        };
        let extra = input_logprobs.as_deref();
        match complete_response(sh, ep, &meta, &slots, extra, keep, r, wr).await {
            Some(next) => next,
            // The client or the server left before the results: nothing was answered.
            None => return Next::Close,
        }
    };
    // The guard aborts whatever did not finish (disconnect, cut stream); finished requests
    // already left the slot registry, so it is a no-op for them.
    drop(guard);
    // PD prefill: the rooms' KV is ready for the decode side, unless the prefill was cut short.
    let done = slots.iter().all(|s| {
        s.finish
            .get()
            .is_some_and(|i| i.reason != FinishReason::Abort)
    });
    rooms.settle(done);
    if slots.iter().all(|s| s.finish.get().is_some()) {
        answered(sh);
    }
    next
}

/// A PD prefill request's rooms: marked failed when dropped unsettled (the request was cut
/// short before its response), so a waiting decode server fails at once.
struct Rooms<'a> {
    sh: &'a Server,
    rooms: Vec<u64>,
}

impl Rooms<'_> {
    /// Mark every room ready (`done`) or failed.
    fn settle(mut self, done: bool) {
        self.mark(if done {
            RoomState::Ready
        } else {
            RoomState::Failed
        });
    }

    fn mark(&mut self, state: RoomState) {
        let now = std::time::Instant::now();
        let mut book = self.sh.rooms.borrow_mut();
        for room in self.rooms.drain(..) {
            book.set(room, state, now);
        }
    }
}

impl Drop for Rooms<'_> {
    fn drop(&mut self) {
        self.mark(RoomState::Failed);
    }
}

/// PD mode (`--disaggregation-mode`): a request must carry its bootstrap fields (else 400, as
/// SGLang refuses it). A prefill server registers the rooms (returned, to settle once the
/// prefill is done); a decode server waits until the named prefill server has the rooms ready
/// (else 500: the KV transfer cannot happen). Outside PD mode: nothing to do.
async fn disaggregated<'a>(
    sh: &'a Server,
    body: &[u8],
    prompts: usize,
    r: &mut Reader,
) -> Result<Rooms<'a>, (u16, &'static str, String)> {
    let none = Rooms {
        sh,
        rooms: Vec::new(),
    };
    let Some(mode) = sh.cfg.disaggregation_mode else {
        return Ok(none);
    };
    let fields = disagg::bootstrap_fields(body, prompts)
        .map_err(|e| (400, "BadRequestError", format!("{e} ({})", mode.as_str())))?;
    *sh.last_bootstrap.borrow_mut() = Some(fields.clone());
    match mode {
        DisaggMode::Prefill => {
            let now = std::time::Instant::now();
            let mut book = sh.rooms.borrow_mut();
            for &room in &fields.rooms {
                book.set(room, RoomState::Prefilling, now);
            }
            Ok(Rooms {
                sh,
                rooms: fields.rooms,
            })
        }
        DisaggMode::Decode => {
            let waited = monoio::select! {
                w = super::bootstrap::await_rooms(sh, &fields) => w,
                _ = r.disconnected() => Err("the client left".into()),
            };
            waited.map(|()| none).map_err(|e| {
                (
                    500,
                    "InternalServerError",
                    format!("KV transfer failed: {e}"),
                )
            })
        }
    }
}

/// Keeps a request's ids in the server's rid map while it runs.
struct RidGuard<'a> {
    sh: &'a Server,
    rids: Vec<String>,
}

impl<'a> RidGuard<'a> {
    fn register(
        sh: &'a Server,
        head: &RequestHead,
        body_rid: Option<&str>,
        ids: &[crate::sim::engine::ReqId],
    ) -> RidGuard<'a> {
        let header = head
            .header("x-request-id")
            .map(|v| String::from_utf8_lossy(v).into_owned());
        let rids: Vec<String> = header
            .into_iter()
            .chain(body_rid.map(str::to_owned))
            .collect();
        let mut map = sh.rids.borrow_mut();
        for rid in &rids {
            map.entry(rid.clone()).or_default().extend_from_slice(ids);
        }
        RidGuard { sh, rids }
    }
}

impl Drop for RidGuard<'_> {
    fn drop(&mut self) {
        let mut map = self.sh.rids.borrow_mut();
        for rid in &self.rids {
            map.remove(rid);
        }
    }
}

/// Counts a request as held while it waits on the `hold` knob.
struct Held<'a>(&'a Cell<usize>);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.set(self.0.get().saturating_sub(1));
    }
}

/// The fault knobs that act before an inference request is parsed: die, stall, delay, fail.
/// `Some` is the outcome when a fault answered (or dropped) the request.
async fn apply_faults(
    sh: &Rc<Server>,
    keep: bool,
    r: &mut Reader,
    wr: &mut WriteHalf,
) -> Option<Next> {
    let faults = &sh.cfg.faults;
    let count = sh.received.get() + 1;
    sh.received.set(count);
    if sh.hold.get() {
        sh.held.set(sh.held.get() + 1);
        let _held = Held(&sh.held);
        while sh.hold.get() {
            monoio::select! {
                _ = monoio::time::sleep(HOLD_POLL) => {}
                _ = r.disconnected() => return Some(Next::Close),
                _ = sh.shutdown.wait() => return Some(Next::Close),
            }
        }
    }
    if faults.die_after.is_some_and(|n| count > n) {
        sh.die();
        return Some(Next::Close);
    }
    if faults.stall_after.is_some_and(|n| count > n) {
        stall(sh, r).await;
        return Some(Next::Close);
    }
    if faults.latency_ms > 0 {
        monoio::select! {
            _ = monoio::time::sleep(Duration::from_millis(faults.latency_ms)) => {}
            _ = r.disconnected() => return Some(Next::Close),
            _ = sh.shutdown.wait() => return Some(Next::Close),
        }
    }
    let fail_rate = sh.fail_rate();
    if fail_rate > 0.0 && sh.fault_rng.borrow_mut().chance(fail_rate) {
        let next = respond_error(
            sh,
            wr,
            keep,
            500,
            "InternalServerError",
            "simulated worker failure (fail_rate)",
        )
        .await;
        answered(sh);
        return Some(next);
    }
    None
}

/// The prompts of one request, submitted to the engine.
struct Submitted {
    /// Aborts the requests that did not finish when dropped.
    guard: AbortGuard,
    /// One result slot per prompt.
    slots: Vec<Rc<Slot>>,
    /// Prompt lengths in tokens, parallel to `slots`.
    prompt_lens: Vec<usize>,
}

/// Submit every prompt of a request: the guard that aborts them if the client leaves, their
/// result slots and prompt lengths. On a refused prompt the ones already submitted are aborted
/// before the error is returned.
fn submit_all(
    sh: &Rc<Server>,
    prompts: Vec<Vec<u32>>,
    namespaces: Vec<Namespace>,
    max_new_tokens: usize,
    admit: super::Admit,
) -> Result<Submitted, Refused> {
    let mut guard = AbortGuard {
        sh: sh.clone(),
        ids: Vec::with_capacity(prompts.len()),
    };
    let mut slots = Vec::with_capacity(prompts.len());
    let mut prompt_lens = Vec::with_capacity(prompts.len());
    for (p, ns) in prompts.into_iter().zip(namespaces) {
        prompt_lens.push(p.len());
        let (id, slot) = sh.submit_with(p, ns, max_new_tokens, admit)?;
        guard.ids.push(id);
        slots.push(slot);
    }
    Ok(Submitted {
        guard,
        slots,
        prompt_lens,
    })
}

/// A non-streaming answer: wait for every prompt of the request, then render all the results
/// in one body. `None` when the client leaves (or the server stops) first.
#[allow(clippy::too_many_arguments)]
async fn complete_response(
    sh: &Rc<Server>,
    ep: Endpoint,
    meta: &RespMeta<'_>,
    slots: &[Rc<Slot>],
    input_logprobs: Option<&[serde_json::Value]>,
    keep: bool,
    r: &mut Reader,
    wr: &mut WriteHalf,
) -> Option<Next> {
    for slot in slots {
        loop {
            if slot.finish.get().is_some() {
                break;
            }
            if slot.queue_full.get() {
                // Refused to make way for a higher-priority request.
                let how = Answer {
                    keep,
                    chunked: true,
                };
                return Some(queue_full(sh, how, ep, false, meta.id, MADE_WAY, wr).await);
            }
            let seen = slot.tokens.borrow().len();
            monoio::select! {
                _ = slot.changed(seen) => {}
                _ = r.disconnected() => return None,
                _ = sh.shutdown.wait() => return None,
            }
        }
    }
    let results: Vec<Completed> = slots
        .iter()
        .filter_map(|s| s.finish.get().map(|info| (s, info)))
        .map(|(s, info)| {
            let ids = s.tokens.borrow().clone();
            Completed {
                text: sh.tok.decode_output(&ids),
                output_ids: ids,
                usage: Usage::from_info(&info),
                e2e_latency: (info.finish_ms - info.arrival_ms) / 1000.0,
                aborted: info.reason == FinishReason::Abort,
            }
        })
        .collect();
    let mut body = api::render_completed(ep, meta, &results);
    if let Some(lp) = input_logprobs {
        body = disagg::with_input_logprobs(&body, lp).unwrap_or(body);
    }
    Some(respond(sh, wr, keep, 200, "application/json", &body).await)
}

/// How an answer goes to its client: the connection kept alive after it, chunked coding
/// (HTTP/1.1) for a stream.
#[derive(Clone, Copy)]
struct Answer {
    keep: bool,
    chunked: bool,
}

impl Answer {
    fn to(head: &RequestHead) -> Answer {
        Answer {
            keep: head.keep_alive,
            chunked: head.minor_version >= 1,
        }
    }
}

/// SGLang's answer to a request refused by `--max-queued-requests` (`message`: the queue was
/// full, or the request made way for a higher-priority one). Not streamed: 503 with the
/// `ErrorResponse` body its HTTP exception handler writes (`http_server.py`,
/// `validation_exception_handler`; `/v1/messages` gets the Anthropic envelope, which never
/// echoes a 5xx message). Streamed: the stream has begun (200), and the refusal is its one
/// event ([`api::refusal_event`]).
async fn queue_full(
    sh: &Server,
    how: Answer,
    ep: Endpoint,
    stream: bool,
    id: &str,
    message: &str,
    wr: &mut WriteHalf,
) -> Next {
    let Answer { keep, chunked } = how;
    if !stream {
        let body = match ep {
            Endpoint::Messages => serde_json::json!({
                "type": "error",
                "error": {"type": "overloaded_error", "message": "Internal server error"},
            }),
            _ => serde_json::json!({
                "object": "error", "message": message, "type": "503", "param": null, "code": 503,
            }),
        };
        let body = body.to_string();
        return respond(sh, wr, keep, 503, "application/json", body.as_bytes()).await;
    }
    let text = api::refusal_event(ep, id, message);
    let mut out = stream_head(sh, chunked, keep).to_vec();
    out.extend_from_slice(&stream_frame(&text, chunked, true));
    match write(wr, Bytes::from(out)).await {
        Ok(()) if chunked && keep => Next::KeepAlive,
        _ => Next::Close,
    }
}

async fn stream_response(
    sh: &Rc<Server>,
    head: &RequestHead,
    mut renderer: StreamRenderer,
    slot: &Slot,
    prompt_len: usize,
    r: &mut Reader,
    wr: &mut WriteHalf,
) -> Next {
    // HTTP/1.0 has no chunked coding: the stream is delimited by closing the connection.
    let chunked = head.minor_version >= 1;
    if write(wr, stream_head(sh, chunked, head.keep_alive))
        .await
        .is_err()
    {
        return Next::Close;
    }
    let arrival = slot.last_at.get();
    let mut seen = 0;
    let mut events_sent = 0;
    let mut text = String::with_capacity(4096);
    let mut piece = String::with_capacity(32);
    loop {
        text.clear();
        if slot.queue_full.get() {
            // Refused while queued, to make way for a higher-priority request.
            renderer.refused(&mut text, MADE_WAY);
            let out = stream_frame(&text, chunked, true);
            let ok = write(wr, Bytes::from(out)).await.is_ok();
            return if ok && chunked && head.keep_alive {
                Next::KeepAlive
            } else {
                Next::Close
            };
        }
        let finish = slot.finish.get();
        let tokens = TokenRun {
            slot,
            prompt_len,
            arrival,
            finish,
        };
        events_sent += tokens.render(sh, &mut renderer, &mut seen, &mut text, &mut piece);
        if let Some(info) = finish {
            let aborted = info.reason == FinishReason::Abort;
            renderer.finish(
                &mut text,
                &Usage::from_info(&info),
                (info.finish_ms - info.arrival_ms) / 1000.0,
                aborted,
                seen,
            );
        }
        let cut = sh.cfg.faults.close_mid_stream && events_sent >= CUT_AFTER_EVENTS;
        if !text.is_empty() {
            let out = stream_frame(&text, chunked, finish.is_some() && !cut);
            if write(wr, Bytes::from(out)).await.is_err() {
                return Next::Close;
            }
        }
        if cut {
            // Fault: drop the connection without the terminating chunk.
            return Next::Close;
        }
        if finish.is_some() {
            return if chunked && head.keep_alive {
                Next::KeepAlive
            } else {
                Next::Close
            };
        }
        monoio::select! {
            _ = slot.changed(seen) => {}
            _ = r.disconnected() => return Next::Close,
            _ = sh.shutdown.wait() => return Next::Close,
        }
    }
}

/// The head of an SSE response: chunked on HTTP/1.1, close-delimited on HTTP/1.0.
fn stream_head(sh: &Server, chunked: bool, keep_alive: bool) -> Bytes {
    let mut h = String::with_capacity(192);
    h.push_str("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ncache-control: no-cache\r\nx-worker-port: ");
    h.push_str(&sh.port_str);
    h.push_str(if chunked {
        "\r\ntransfer-encoding: chunked\r\n"
    } else {
        "\r\nconnection: close\r\n"
    });
    if chunked && !keep_alive {
        h.push_str("connection: close\r\n");
    }
    h.push_str("\r\n");
    Bytes::from(h.into_bytes())
}

/// `text` framed for the wire: one chunk (plus the terminating chunk when `last`) when
/// `chunked`, else as is.
fn stream_frame(text: &str, chunked: bool, last: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len() + 16);
    if chunked {
        out.extend_from_slice(format!("{:x}\r\n", text.len()).as_bytes());
        out.extend_from_slice(text.as_bytes());
        out.extend_from_slice(b"\r\n");
        if last {
            out.extend_from_slice(b"0\r\n\r\n");
        }
    } else {
        out.extend_from_slice(text.as_bytes());
    }
    out
}

/// What a streamed response needs to render the tokens a slot produced since the last wake-up.
struct TokenRun<'a> {
    slot: &'a Slot,
    prompt_len: usize,
    /// When the request's first output was recorded (for the per-token e2e latency).
    arrival: f64,
    /// The request's finish, if it finished: the last token then carries the finish reason.
    finish: Option<FinishInfo>,
}

impl TokenRun<'_> {
    /// Renders the tokens after the first `seen` into `text` (advancing `seen`); returns the
    /// number of events rendered.
    pub(super) fn render(
        &self,
        sh: &Server,
        renderer: &mut StreamRenderer,
        seen: &mut usize,
        text: &mut String,
        piece: &mut String,
    ) -> usize {
        let tokens = self.slot.tokens.borrow();
        let at = self.slot.last_at.get();
        let mut events = 0;
        while *seen < tokens.len() {
            let token = tokens[*seen];
            *seen += 1;
            piece.clear();
            sh.tok.push_output_text(token, piece);
            let usage = Usage {
                prompt_tokens: self.prompt_len,
                completion_tokens: *seen,
                cached_tokens: self.slot.cached.get(),
            };
            let last = self.finish.is_some() && *seen == tokens.len();
            let fin = if last {
                self.finish.map(|i| i.reason == FinishReason::Abort)
            } else {
                None
            };
            renderer.token(
                text,
                &TokenChunk {
                    token,
                    piece,
                    first: *seen == 1,
                    usage,
                    e2e: (at - self.arrival) / 1000.0,
                    finish: fin,
                },
            );
            events += 1;
        }
        events
    }
}
