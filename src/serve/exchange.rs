//! One proxied request as named phases on an [`Exchange`], in the order a request lives them:
//!
//! - **admit**: auth, routing inputs from the body, request id, admission permit;
//! - **tokenize**: with KV-event routing, the prompt in the servers' token ids, once;
//! - **pick**: a policy decision, the worker's circuit, the in-flight count, the tree insert;
//! - **attempt**: one upstream round trip raced against the client leaving;
//! - **retry_after**: a failed attempt's bookkeeping, and whether another worker gets a try;
//! - **commit**: relay the answer, account the outcome, learn the reply.
//!
//! As in Pingora's `proxy_to_upstream`, a failed attempt carries its own retry decision, so the
//! loop in [`handle`] reads as the lifecycle: pick → attempt → commit, or retry_after → pick.
//! Plain methods, no trait objects: this is the hot path.
//!
//! Prefill/decode mode (`serve::pd`) is this exchange with a pair as its target: it picks each
//! side through [`Exchange::pick_on`] (the same policy call, KV-event measurement, target-worker
//! header and tree inserts), retries through [`Exchange::retry_after_on`], and relays through the
//! exchange's own relay settings; only pairing, the bootstrap fields and the logprob merge are
//! its own. The exchange's fields are private to this module.

use super::error::GatewayError;
use super::reply::{send_error, Reply};
use super::Outcome;
use crate::admission::Permit;
use crate::base::entropy::Entropy;
use crate::base::WorkerId;
use crate::gateway::kv::{Fallback, KvRouting, KvScratch};
use crate::gateway::requests::IdKey;
use crate::gateway::{Core, Gateway, Router};
use crate::http::{BodyFraming, Method, RequestHead};
use crate::proxy::capture::Capture;
use crate::proxy::forward::{self, UpstreamRequest, UpstreamResponse};
use crate::proxy::io::closed_by_peer;
use crate::proxy::relay::{self, RelayTo};
use crate::proxy::request_id::request_id;
use crate::proxy::retry::is_retryable_status;
use crate::route::bootstrap;
use crate::route::extract::{capped, extract_for, Api, RoutingInfo, MAX_ROUTING_TEXT};
use crate::route::manual::{key_too_long, MAX_ROUTING_KEY_LEN};
use crate::route::types::{Branch, Decision, ExactInput, PolicyKind, RouteInput};
use crate::trace::span::{now_ns, Leg, RequestTrace, Value};
use crate::tree::TreeKey;
use crate::workers::breaker::{is_backpressure, is_worker_failure};
use crate::workers::registry::{CircuitSlot, Worker};
use crate::workers::role::Side;
use bytes::Bytes;
use monoio::net::TcpStream;
use monoio::time::Instant;
use std::borrow::Cow;
use std::cell::RefCell;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

/// Answers quicker than this never pay for watching the client (a poll op and its cancel).
const CLIENT_WATCH_DELAY: Duration = Duration::from_millis(20);

/// How a proxied request reaches a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forwarding {
    /// An inference call: its body gives the routing text, the policy picks the worker.
    Routed(Api),
    /// An informational GET (`/get_model_info`, `/health_generate`): any selectable worker.
    PassThrough,
}

mod turn;

/// Handle a proxied request from its head and body to the last byte relayed.
pub async fn handle(
    core: &Core,
    client: &mut TcpStream,
    head: &RequestHead,
    body: Bytes,
    forwarding: Forwarding,
) -> Outcome {
    // Read once: every attempt appends it to X-Forwarded-For.
    let client_ip = client.peer_addr().ok().map(|a| a.ip());
    let mut ex = match Exchange::admit(core, head, &body, forwarding, client_ip).await {
        Ok(ex) => ex,
        Err(refused) => {
            let id = refused.request_id.as_deref();
            return send_error(client, Some(head), &refused.error, id).await;
        }
    };
    ex.tokenize().await;
    if let Some(out) = ex.wait_turn_or_answer(client).await {
        return out;
    }
    loop {
        let picked = match ex.pick() {
            Ok(p) => p,
            Err(e) => return ex.fail(client, e).await,
        };
        match ex.attempt(client, &picked).await {
            Ok(up) => return ex.commit(client, picked, up).await,
            Err(Failure::ClientGone) => {
                drop(picked);
                crate::metrics::client_gone();
                ex.traced_status(499, Some("the client left"));
                return Outcome {
                    status: 499,
                    keep_alive: false,
                };
            }
            Err(Failure::Worker(f)) => {
                if let Err(e) = ex.retry_after(picked, f).await {
                    return ex.fail(client, e).await;
                }
            }
        }
    }
}

/// A request refused before it reached a worker (with its request id once one exists).
pub(super) struct Refused {
    pub(super) error: GatewayError,
    pub(super) request_id: Option<String>,
}

/// Why an attempt did not produce a response to relay.
enum Failure {
    /// The client closed its connection while the worker worked: nothing more to send.
    ClientGone,
    /// The worker failed (no head, or a retryable status while retries remain).
    Worker(WorkerFailure),
}

/// A worker's failure, with the decisions that follow from it.
pub(super) struct WorkerFailure {
    /// What the client gets if this is the last attempt.
    pub(super) error: GatewayError,
    /// The worker could not even be reached (passive health signal).
    pub(super) connect: bool,
    /// The gateway itself failed (out of file descriptors or local ports): says nothing about
    /// the worker, so neither its health nor its circuit hears of it.
    pub(super) local: bool,
    /// The outcome counts as a success for the worker's circuit (e.g. a 429).
    pub(super) breaker_success: bool,
    /// Attempts and time remain: try another worker.
    pub(super) retry: bool,
    /// The failure in one word (`status`, `connect`, `timeout`, ...: a trace's retry reason).
    pub(super) reason: &'static str,
    /// The worker's status, when it answered one.
    pub(super) status: Option<u16>,
}

/// The worker chosen for one attempt, counted in flight until dropped; its circuit slot records
/// the outcome at most once and frees a half-open probe slot on every path.
pub(super) struct Picked<'a> {
    /// First field, so dropped first: the in-flight count is down before the last `Arc` of a
    /// removed worker goes (its id may be reused from then on).
    pub(super) _in_flight: InFlight<'a>,
    pub(super) worker: Arc<Worker>,
    pub(super) slot: CircuitSlot,
    pub(super) decision: Decision,
}

/// Keeps a worker's in-flight count raised while a request is on it, and tells the policy when
/// the request is over, on every path (success, retry, error, client gone).
/// The request id is registered as held by the worker meanwhile (`/abort_request` finds it).
pub(super) struct InFlight<'a> {
    gw: &'a Gateway,
    /// The router whose policy picked the worker (PD mode: the prefill or the decode side's).
    router: &'a Router,
    worker: WorkerId,
    routing_key: Option<&'a [u8]>,
    /// The request id's key, when the id map took it.
    id: Option<IdKey>,
}

impl<'a> InFlight<'a> {
    pub(super) fn new(
        gw: &'a Gateway,
        router: &'a Router,
        worker: WorkerId,
        routing_key: Option<&'a [u8]>,
        id: IdKey,
    ) -> Self {
        gw.registry.loads.inc(worker);
        let id = gw.in_flight_ids.insert(id, worker).then_some(id);
        InFlight {
            gw,
            router,
            worker,
            routing_key,
            id,
        }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            self.gw.in_flight_ids.remove(id);
        }
        self.gw.registry.loads.dec(self.worker);
        let now = self.gw.life.now_ms();
        self.router
            .policy
            .request_finished(self.routing_key, self.worker, now);
    }
}

/// One request's state across its attempts.
pub(super) struct Exchange<'a> {
    core: &'a Core,
    gw: &'a Gateway,
    head: &'a RequestHead,
    body: &'a Bytes,
    forwarding: Forwarding,
    info: RoutingInfo<'a>,
    request_id: String,
    /// `request_id`'s key in the gateway's in-flight id map.
    id_key: IdKey,
    started: Instant,
    deadline: Instant,
    routing_key: Option<&'a [u8]>,
    hash_key: Option<&'a [u8]>,
    /// The tree the request's model reads and feeds (served models only; see `TreeKey`).
    tree: TreeKey,
    /// Workers that already failed this request: every retry goes elsewhere (the reference
    /// retries the worker its tree points at, i.e. the failing one). In PD mode, the prefill
    /// side's.
    excluded: Vec<WorkerId>,
    /// PD mode: the decode workers that already failed this request.
    excluded_decode: Vec<WorkerId>,
    attempts: u32,
    /// What the client gets when no worker is left.
    last_error: Option<GatewayError>,
    /// The client's address, appended to `X-Forwarded-For`.
    client_ip: Option<IpAddr>,
    _permit: Permit<'a>,
    /// A pass-through call's place among those the gateway allows at once.
    _pass_slot: Option<crate::gateway::limit::CallSlot<'a>>,
    /// The prompt's token ids for KV-event routing (phase *tokenize*), or why the text tree
    /// decides; `None` when the request is not measured against the index at all.
    prompt: Option<Result<Vec<u32>, Fallback>>,
    /// Its tenant, once the saturation admission let it in (its output is charged to it).
    tenant: Option<crate::admission::TenantId>,
    /// Its prompt tokens as the saturation admission counted them (0 without it): each worker
    /// it is sent to counts them as KV in use until its next reading.
    admitted_tokens: u64,
    /// The class the saturation admission used, when it must replace the body's `priority`
    /// (see `turn`): spliced into every body sent upstream.
    engine_priority: Option<crate::admission::queue::Priority>,
    /// `--enable-trace`, a recorded request: its spans so far (ended and handed to the export
    /// thread when the exchange is dropped). `None` costs one branch per phase; boxed, so an
    /// untraced exchange is one pointer larger, not a span larger.
    trace: RefCell<Option<Box<RequestTrace>>>,
}

/// The trace ends with the exchange, whichever way the request ended.
impl Drop for Exchange<'_> {
    fn drop(&mut self) {
        if let (Some(t), Some(tracer)) = (self.trace.get_mut().take(), self.gw.trace.as_ref()) {
            tracer.submit(self.core.index, (*t).finish(now_ns()));
        }
    }
}

impl<'a> Exchange<'a> {
    /// Phase *admit*: auth, routing inputs, request id, admission permit.
    pub(super) async fn admit(
        core: &'a Core,
        head: &'a RequestHead,
        body: &'a Bytes,
        forwarding: Forwarding,
        client_ip: Option<IpAddr>,
    ) -> Result<Exchange<'a>, Refused> {
        let gw: &'a Gateway = &core.gw;
        let trace = gw.trace.as_ref().and_then(|t| {
            let traceparent = head.header("traceparent");
            // A caller's sampled flag counts only with --trace-trust-caller-sampling, and with
            // --api-key only from a caller presenting it (public pass-through endpoints
            // take calls without).
            let trusted = traceparent.is_some()
                && t.trusts_caller_sampling()
                && gw
                    .auth
                    .authorize(head, crate::gateway::Scope::Inference, client_ip)
                    .is_ok();
            t.begin(
                traceparent,
                head.header("tracestate"),
                trusted,
                &mut core.entropy.borrow_mut(),
            )
        });
        let Some(mut t) = trace else {
            return Self::admit_untraced(core, head, body, forwarding, client_ip).await;
        };
        let started_ns = now_ns();
        t.set(
            "http.request.method",
            String::from_utf8_lossy(head.method()).into_owned(),
        );
        t.set(
            "url.path",
            String::from_utf8_lossy(head.path()).into_owned(),
        );
        match Self::admit_untraced(core, head, body, forwarding, client_ip).await {
            Ok(mut ex) => {
                t.child(
                    &mut core.entropy.borrow_mut(),
                    "admit",
                    started_ns,
                    now_ns(),
                    vec![],
                );
                t.set("radixgate.request_id", ex.request_id.clone());
                if let Some(m) = ex.info.model.as_deref() {
                    t.set("gen_ai.request.model", m.to_string());
                }
                t.set("radixgate.stream", ex.info.stream);
                *ex.trace.get_mut() = Some(Box::new(t));
                Ok(ex)
            }
            Err(refused) => {
                t.set("http.response.status_code", i64::from(refused.error.status));
                t.fail(refused.error.message.clone());
                if let Some(tracer) = &gw.trace {
                    tracer.submit(core.index, t.finish(now_ns()));
                }
                Err(refused)
            }
        }
    }

    /// [`Exchange::admit`] once the trace (if any) has begun; a refusal carries it back.
    async fn admit_untraced(
        core: &'a Core,
        head: &'a RequestHead,
        body: &'a Bytes,
        forwarding: Forwarding,
        client_ip: Option<IpAddr>,
    ) -> Result<Exchange<'a>, Refused> {
        let gw: &'a Gateway = &core.gw;
        let started = Instant::now();
        let routing_key = head.header("x-smg-routing-key");
        let refuse = |error, request_id| Refused { error, request_id };
        let info = match forwarding {
            Forwarding::Routed(api) => {
                // The key was checked on the head (`conn::decide`), before the body was read.
                // The saturation admission bills prompts on their text, whatever the policy.
                let keep_text =
                    gw.flow.is_some() || gw.routers().any(|(r, _)| r.policy.reads_text());
                let info = extract_for(api, body, keep_text)
                    .map_err(|e| refuse(GatewayError::bad_request(e.0), None))?;
                // manual remembers keys: a hostile key length is refused, not hashed.
                if let Some(key) = routing_key.filter(|k| {
                    k.len() > MAX_ROUTING_KEY_LEN && gw.router.policy.kind() == PolicyKind::Manual
                }) {
                    return Err(refuse(
                        GatewayError::bad_request(key_too_long(key.len())),
                        None,
                    ));
                }
                crate::metrics::routed(
                    gw.models.label(info.model.as_deref()),
                    crate::metrics::path_label(head.path()),
                    info.stream,
                );
                info
            }
            Forwarding::PassThrough => RoutingInfo {
                model: None,
                stream: false,
                text: Cow::Borrowed(""),
                token_ids: false,
                namespace: Default::default(),
                shape: Default::default(),
            },
        };
        let rid = request_id(
            head,
            &gw.cfg.request_id_headers,
            head.path(),
            &mut core.entropy.borrow_mut(),
        );
        let pass_slot = match forwarding {
            Forwarding::PassThrough => match gw.pass_through.try_take() {
                Some(s) => Some(s),
                None => return Err(refuse(GatewayError::busy(head_path_label(head)), None)),
            },
            Forwarding::Routed(_) => None,
        };
        let permit = match gw.admission.acquire().await {
            Ok(p) => p,
            Err(r) => return Err(refuse(r.into(), Some(rid))),
        };
        let tree = gw.models.tree_key(info.model.as_deref());
        Ok(Exchange {
            core,
            gw,
            head,
            body,
            forwarding,
            client_ip,
            id_key: gw.in_flight_ids.key_for(head, client_ip, &rid),
            request_id: rid,
            started,
            deadline: started + gw.cfg.request_timeout(),
            routing_key,
            hash_key: routing_key
                .or_else(|| head.header("authorization"))
                .or_else(|| head.header("x-forwarded-for"))
                .or_else(|| head.header("cookie")),
            tree,
            info,
            excluded: Vec::new(),
            excluded_decode: Vec::new(),
            attempts: 0,
            last_error: None,
            _permit: permit,
            _pass_slot: pass_slot,
            prompt: None,
            tenant: None,
            admitted_tokens: 0,
            engine_priority: None,
            trace: RefCell::new(None),
        })
    }

    /// Phase *tokenize*: with `--kv-events` and the cache-aware policy, the prompt's token ids,
    /// once for every pick this request will need (encoded on this core when small, else by the
    /// tokenizer helpers within a budget; see `gateway::tokenizing`).
    pub(super) async fn tokenize(&mut self) {
        let (Forwarding::Routed(api), Some(kv)) = (self.forwarding, &self.gw.kv) else {
            return;
        };
        // The prompt is measured on the side that computes it (`gw.router`: the regular or,
        // in PD mode, the prefill side's).
        if self.gw.router.policy.kind() != PolicyKind::CacheAware {
            return;
        }
        let tokens = crate::gateway::tokenizing::prompt_tokens(
            self.core,
            kv,
            api,
            self.body,
            &self.info.text,
            self.info.token_ids,
        )
        .await;
        self.prompt = Some(tokens);
    }

    /// Phase *pick*: a worker the policy chose, whose circuit admits the request, counted in
    /// flight, the attempt counted.
    fn pick(&mut self) -> Result<Picked<'a>, GatewayError> {
        let picked = self.pick_on(Side::Any)?;
        self.attempts += 1;
        Ok(picked)
    }

    /// One worker of `side` (every worker outside PD mode; PD mode picks a prefill worker and a
    /// decode worker here, each by its own side's router): the policy's choice among that
    /// side's workers not yet failed by this request, its circuit admitting, counted in flight.
    /// The routing text is learned now, as the reference does, so requests arriving while this
    /// one is in prefill (a burst sharing a system prompt) already follow it. With KV events,
    /// the side that computes the prompt (not decode) is chosen on the measured prompt.
    pub(super) fn pick_on(&mut self, side: Side) -> Result<Picked<'a>, GatewayError> {
        let started_ns = self.trace.get_mut().is_some().then(now_ns);
        let picked = self.pick_untraced(side);
        if let (Some(start), Some(t)) = (started_ns, self.trace.get_mut().as_mut()) {
            let mut attrs: Vec<(&'static str, Value)> = Vec::with_capacity(8);
            let policy = match (side, self.gw.decode.as_ref()) {
                (Side::Decode, Some(r)) => r.policy.kind(),
                _ => self.gw.router.policy.kind(),
            };
            attrs.push(("radixgate.policy", policy.as_str().into()));
            if side != Side::Any {
                attrs.push(("radixgate.side", side.name().into()));
            }
            let error = match &picked {
                Ok(p) => {
                    let d = &p.decision;
                    attrs.push(("radixgate.branch", d.branch.as_str().into()));
                    attrs.push(("radixgate.matched_length", (d.matched_chars as i64).into()));
                    attrs.push((
                        "radixgate.predicted_length",
                        (d.predicted_chars as i64).into(),
                    ));
                    attrs.push(("radixgate.request_size", (d.request_size as i64).into()));
                    attrs.push(("radixgate.worker", p.worker.url.clone().into()));
                    None
                }
                Err(e) => Some(e.message.clone()),
            };
            let id = t.new_span_id(&mut self.core.entropy.borrow_mut());
            let kind = crate::trace::span::Kind::Internal;
            t.child_with_id(id, kind, "route", start, now_ns(), attrs, error);
        }
        picked
    }

    /// [`Exchange::pick_on`] without its span.
    fn pick_untraced(&mut self, side: Side) -> Result<Picked<'a>, GatewayError> {
        let gw = self.gw;
        let router: &'a Router = match (side, gw.decode.as_ref()) {
            (Side::Decode, Some(r)) => r,
            (Side::Decode, None) => {
                return Err(GatewayError::internal(
                    "prefill/decode mode is not configured",
                ))
            }
            _ => &gw.router,
        };
        let mut recycled = false;
        loop {
            let list = gw.registry.load_full();
            let ids = match side {
                Side::Any => &list.ids,
                Side::Prefill => &list.prefill_ids,
                Side::Decode => &list.decode_ids,
            };
            let now_ms = gw.life.now_ms();
            let (decision, epoch, measured) = self.choose(router, side, ids, now_ms);
            let Some(decision) = decision else {
                let after_a_failure = self.last_error.is_some();
                if recycle_exclusions(self.excluded_on(side), after_a_failure, &mut recycled) {
                    continue;
                }
                let none = ids.is_empty();
                return Err(self.last_error.take().unwrap_or_else(|| match side {
                    Side::Any => GatewayError::no_workers(list.is_empty()),
                    _ => GatewayError::no_workers_on(side.name(), none),
                }));
            };
            // Gone since the snapshot, or half-open with its probe slots taken: try another.
            let slot = list
                .get(decision.worker)
                .filter(|w| side.takes(w.role))
                .and_then(|w| w.admit(&gw.breaker));
            let Some(slot) = slot else {
                router
                    .policy
                    .request_finished(self.routing_key, decision.worker, now_ms);
                self.excluded_on(side).push(decision.worker);
                continue;
            };
            let worker = slot.worker().clone();
            crate::metrics::selection(router.policy.kind().as_str(), decision.branch.as_str());
            let in_flight = InFlight::new(gw, router, worker.id, self.routing_key, self.id_key);
            if let Some(fc) = &gw.flow {
                fc.saturation.sent(worker.id, self.admitted_tokens);
            }
            if decision.insert_text {
                if self.attempts == 0 && side != Side::Decode {
                    // The prediction beside the hit ratio the engines report (first try only,
                    // where the prompt is computed), in the decision's own unit: tokens when the
                    // prompt was measured against the KV-event index, else characters (counted
                    // once, by the match).
                    let size = match (decision.request_size, measured) {
                        (0, Some(tokens)) => tokens,
                        (0, None) => crate::base::text::char_count(self.info.text.as_bytes()),
                        (n, _) => n,
                    };
                    crate::metrics::predicted_hit(decision.predicted_chars, size);
                }
                let measured = measured.is_some();
                if already_held(&decision, measured) {
                    // The tree (or an unpublished insert) already has all of it under this
                    // worker: an insert would re-walk and path-copy the prompt for nothing.
                    crate::metrics::insert_skipped();
                } else {
                    let text = learned_text(self.body, &self.info.text);
                    router.learn(self.tree, text, worker.id, epoch, now_ms);
                }
                if let (true, Some(kv)) = (measured, &gw.kv) {
                    // The prompt's chain is still in this core's scratch: nothing awaited since.
                    let s = self.core.kv.borrow();
                    if !s.holds_all(worker.id) {
                        kv.pending.push(s.model_hash, worker.id, s.chain(), now_ms);
                    }
                }
            }
            return Ok(Picked {
                worker,
                slot,
                decision,
                _in_flight: in_flight,
            });
        }
    }

    /// The workers of `side` this request already failed on.
    fn excluded_on(&mut self, side: Side) -> &mut Vec<WorkerId> {
        match side {
            Side::Decode => &mut self.excluded_decode,
            _ => &mut self.excluded,
        }
    }

    /// `router`'s decision among `workers` (routed) or any selectable worker (pass-through),
    /// with the snapshot epoch it saw and, when the prompt was measured against the KV-event
    /// index, its token count (its block chain is then in this core's scratch).
    fn choose(
        &self,
        router: &Router,
        side: Side,
        workers: &[WorkerId],
        now_ms: u64,
    ) -> (Option<Decision>, u64, Option<usize>) {
        let gw = self.gw;
        let rng = &mut self.core.rng.borrow_mut();
        let exclude = match side {
            Side::Decode => &self.excluded_decode,
            _ => &self.excluded,
        };
        match self.forwarding {
            Forwarding::PassThrough => {
                let w = gw
                    .registry
                    .loads
                    .pick_random_eligible(workers, exclude, rng);
                (w.map(|w| Decision::plain(w, Branch::Random)), 0, None)
            }
            Forwarding::Routed(_) => {
                let mut scratch = self.core.kv.borrow_mut();
                let exact_workers = gw.kv.as_ref().map(|kv| kv.exact_workers());
                // The prompt is computed on this side: measure it (decode gets it handed over).
                let computes = side != Side::Decode;
                let measured = match (&gw.kv, &self.prompt) {
                    (Some(kv), Some(tokens))
                        if computes && router.policy.kind() == PolicyKind::CacheAware =>
                    {
                        self.measure(kv, tokens, &mut scratch, now_ms)
                    }
                    _ => None,
                };
                let exact = measured.map(|prompt_tokens| ExactInput {
                    prompt_tokens,
                    cached: &scratch.cached,
                    exact_workers: exact_workers.as_ref().map_or(&[][..], |w| &w[..]),
                    holders: &scratch.holders,
                });
                let input = RouteInput {
                    text: &self.info.text,
                    routing_key: self.routing_key,
                    target_worker: if computes {
                        self.head.header("x-smg-target-worker")
                    } else {
                        None
                    },
                    hash_key: self.hash_key,
                    exclude,
                    now_ms,
                    recent: None,
                    exact,
                };
                let (d, epoch) = router.choose(self.tree, input, workers, &gw.registry.loads, rng);
                (d, epoch, measured)
            }
        }
    }

    /// This prompt's tokens against the KV-event index (into `s`): its token count, or `None`
    /// when the text tree decides alone (counted by reason, per pick).
    fn measure(
        &self,
        kv: &KvRouting,
        tokens: &Result<Vec<u32>, Fallback>,
        s: &mut KvScratch,
        now_ms: u64,
    ) -> Option<usize> {
        let ns = &self.info.namespace;
        let model = self.info.model.as_deref();
        let r = match tokens {
            Ok(t) => kv.measure(model, ns, t, s, now_ms),
            Err(f) => Err(*f),
        };
        match r {
            Ok(n) => {
                let best = s.cached.iter().map(|&(_, c)| c).max().unwrap_or(0);
                crate::metrics::kv_measured(n, best);
                Some(n)
            }
            Err(f) => {
                crate::metrics::kv_fallback(f.as_str(), 1);
                None
            }
        }
    }

    /// Phase *attempt*: one round trip to the picked worker, raced against the client leaving
    /// (a client that gives up while its prompt is in prefill frees the worker at once).
    async fn attempt(
        &self,
        client: &TcpStream,
        picked: &Picked<'_>,
    ) -> Result<UpstreamResponse, Failure> {
        let worker = &picked.worker;
        let retry = self.may_retry();
        self.with_trace(|t, entropy| {
            t.start_attempt(entropy, now_ns(), self.attempt_attrs(worker));
        });
        let req = self.upstream_request(worker, self.body_for(worker)?);
        let connect_timeout = self.connect_timeout();
        let is_head = self.head.method_kind() == Method::Head;
        let pool = &self.core.pool;
        self.core.busy.touch();
        let answer = monoio::select! {
            r = forward::roundtrip(pool, worker, &req, is_head, connect_timeout, self.deadline) => Some(r),
            _ = async {
                monoio::time::sleep(CLIENT_WATCH_DELAY).await;
                closed_by_peer(client).await
            } => None,
        };
        if let Some(t) = self.trace.borrow_mut().as_mut() {
            trace_attempt(t, answer.as_ref(), retry);
        }
        match answer {
            None => Err(Failure::ClientGone),
            // Dropping `up` closes that upstream connection: its body is not wanted.
            Some(Ok(up)) if is_retryable_status(up.head.status) && retry => {
                Err(Failure::Worker(WorkerFailure {
                    error: GatewayError::worker_answer(&up.head),
                    connect: false,
                    local: false,
                    breaker_success: !is_worker_failure(up.head.status),
                    retry,
                    reason: "status",
                    status: Some(up.head.status),
                }))
            }
            Some(Ok(up)) => Ok(up),
            Some(Err(e)) => {
                crate::log!(Debug, "worker {}: {}", worker.url, e.message());
                Err(Failure::Worker(WorkerFailure {
                    error: GatewayError::upstream(&e),
                    connect: e.is_connect(),
                    local: e.is_local(),
                    breaker_success: false,
                    retry,
                    reason: e.kind(),
                    status: None,
                }))
            }
        }
    }

    /// The body `worker` gets: the client's bytes, with `--dp-aware` the target's rank spliced
    /// in as `data_parallel_rank` (a new body per attempt: a retry may go to another rank), and
    /// the saturation admission's class as `priority` when it replaces the client's.
    fn body_for(&self, worker: &Worker) -> Result<Bytes, Failure> {
        let added = bootstrap::Added {
            dp_rank: worker.dp.map(|dp| dp.rank),
            priority: self.engine_priority,
            ..bootstrap::Added::default()
        };
        match self.forwarding {
            Forwarding::Routed(_) => bootstrap::splice_routed(self.body, &added)
                .map(|b| b.map_or_else(|| self.body.clone(), Bytes::from))
                .map_err(|e| {
                    Failure::Worker(WorkerFailure {
                        error: GatewayError::bad_request(e.0),
                        connect: false,
                        local: true,
                        breaker_success: true,
                        retry: false,
                        reason: "bad_request",
                        status: None,
                    })
                }),
            _ => Ok(self.body.clone()),
        }
    }

    /// Phase *retry_after*: account a failed attempt on its worker, then either back off and
    /// let the next `pick` exclude that worker, or give up with the error the client gets.
    async fn retry_after(
        &mut self,
        picked: Picked<'a>,
        failure: WorkerFailure,
    ) -> Result<(), GatewayError> {
        self.retry_after_on(Side::Any, picked, failure).await
    }

    /// [`Exchange::retry_after`] for the worker of `side` that failed (PD mode: the pair's other
    /// worker was released by the caller, unrecorded: its request was dropped, not failed).
    pub(super) async fn retry_after_on(
        &mut self,
        side: Side,
        mut picked: Picked<'a>,
        failure: WorkerFailure,
    ) -> Result<(), GatewayError> {
        let worker = picked.worker.clone();
        if failure.connect {
            self.gw.on_connect_failure(&worker);
        }
        // A local failure leaves the circuit alone: dropping the slot gives a probe slot back.
        if !failure.local {
            self.gw
                .record_outcome(&mut picked.slot, failure.breaker_success);
        }
        if let Some(status) = failure.status {
            self.answered(&worker, status);
        }
        drop(picked);
        if !failure.retry {
            return Err(failure.error);
        }
        self.excluded_on(side).push(worker.id);
        // A worker's Retry-After is waited for only when the retry can go nowhere else.
        let asked = failure.error.retry_after.filter(|_| !self.elsewhere(side));
        let Some(until) = self.backoff_until(asked) else {
            // The wait asked for does not fit the policy or the deadline: the client hears it.
            return Err(failure.error);
        };
        self.last_error = Some(failure.error);
        crate::metrics::retry();
        monoio::time::sleep_until(until).await;
        Ok(())
    }

    /// When the next attempt may start: after the policy's delay, or after the `asked`
    /// seconds of a worker's `Retry-After` when they are longer; `None` when that wait is past
    /// the policy's longest delay or the request's deadline.
    fn backoff_until(&self, asked: Option<u32>) -> Option<Instant> {
        let u = self.core.rng.borrow_mut().unit();
        let n = self.attempts.saturating_sub(1);
        let wait = Duration::from_millis(self.gw.retry.wait_ms(n, u, asked)?);
        let at = Instant::now() + wait;
        match asked {
            Some(_) if at > self.deadline => None,
            _ => Some(std::cmp::min(at, self.deadline)),
        }
    }

    /// Whether an eligible worker of `side` has not failed this request yet (a retry can go
    /// elsewhere).
    fn elsewhere(&self, side: Side) -> bool {
        let list = self.gw.registry.load();
        let ids = match side {
            Side::Any => &list.ids,
            Side::Prefill => &list.prefill_ids,
            Side::Decode => &list.decode_ids,
        };
        let excluded = match side {
            Side::Decode => &self.excluded_decode,
            _ => &self.excluded,
        };
        let loads = &self.gw.registry.loads;
        ids.iter()
            .any(|w| loads.is_eligible(*w) && !excluded.contains(w))
    }

    /// `worker` answered `status`: backpressure (429, 503) is counted, and with
    /// `--saturation-admission` the worker is saturated until its next reading, so the
    /// gateway's own queue holds what the engine's could not.
    pub(super) fn answered(&self, worker: &Worker, status: u16) {
        if !is_backpressure(status) {
            return;
        }
        crate::metrics::worker_backpressure(&worker.url);
        if let Some(fc) = &self.gw.flow {
            fc.saturation.push_back(worker.id);
        }
    }

    /// Phase *commit*: bytes reach the client from here on, so no more retries. Relay the
    /// answer, account the outcome, and (opt-in) learn the reply.
    async fn commit(
        self,
        client: &mut TcpStream,
        picked: Picked<'a>,
        up: UpstreamResponse,
    ) -> Outcome {
        let mut picked = picked;
        let worker = picked.worker.clone();
        let status = up.head.status;
        let chunked = matches!(up.head.framing, BodyFraming::Chunked);
        let mut capture = self.capture_for(&picked, chunked);
        let how = self.relay_to(&worker);
        let relayed = relay::relay(&self.core.pool, client, up, how, capture.as_mut()).await;
        // One outcome per request, once the answer is over (a probe holds its slot until then).
        let success = !is_worker_failure(status) && !relayed.upstream_broke;
        self.record(&mut picked, success);
        self.answered(&worker, status);
        self.completed(&picked);
        drop(picked);
        self.relayed(&relayed);
        self.learn_captured(capture, relayed.complete, status, worker.id);
        self.traced_status(status, None);
        Outcome {
            status,
            keep_alive: relayed.client_keep_alive,
        }
    }

    /// Opt-in (`--insert-response-text`): learn "prompt + reply" so the next turn matches its
    /// whole history.
    fn learn_reply(&self, reply: &str, worker: WorkerId) {
        let prompt = &self.info.text;
        let reply = capped(reply, MAX_ROUTING_TEXT.saturating_sub(prompt.len() + 1));
        let mut full = String::with_capacity(prompt.len() + 1 + reply.len());
        full.push_str(prompt);
        full.push(' ');
        full.push_str(reply);
        let router = &self.gw.router;
        let now = self.gw.life.now_ms();
        router.learn(self.tree, Bytes::from(full), worker, router.epoch(), now);
    }

    /// The request to `worker` with `body`: the client's method, target and end-to-end headers,
    /// this request's id, the client appended to `X-Forwarded-For`.
    /// Traced: a `traceparent` naming the attempt span instead of
    /// the client's, so the worker's own spans join this trace.
    pub(super) fn upstream_request(&self, worker: &Worker, body: Bytes) -> UpstreamRequest {
        self.upstream_request_on(Leg::Prefill, worker, body)
    }

    /// [`Exchange::upstream_request`] for one side of a PD pair: traced, its `traceparent`
    /// names that side's attempt span.
    pub(super) fn upstream_request_on(
        &self,
        leg: Leg,
        worker: &Worker,
        body: Bytes,
    ) -> UpstreamRequest {
        let trace = self.trace.borrow();
        let ctx = trace.as_ref().map(|t| {
            (
                t.traceparent_for(t.upstream_parent_of(leg)),
                t.trace_state(),
            )
        });
        UpstreamRequest::build(
            self.head.method(),
            self.head.target(),
            Some(self.head),
            self.client_ip,
            &worker.authority,
            &self.request_id,
            body,
            ctx.as_ref().map(|(tp, state)| forward::TraceHeaders {
                traceparent: tp,
                tracestate: state.map(str::as_bytes),
            }),
            &self.gw.own_headers,
        )
    }

    /// Traced: the status the client got, and why the request failed when it did.
    pub(super) fn traced_status(&self, status: u16, error: Option<&'static str>) {
        if let Some(t) = self.trace.borrow_mut().as_mut() {
            t.set("http.response.status_code", i64::from(status));
            if let Some(e) = error {
                t.fail(e);
            }
        }
    }

    /// Traced: a phase that ran from `start_ns` until now, as a child of the server span.
    pub(super) fn traced_phase(&self, name: &'static str, start_ns: u64) {
        if let Some(t) = self.trace.borrow_mut().as_mut() {
            t.child(
                &mut self.core.entropy.borrow_mut(),
                name,
                start_ns,
                now_ns(),
                vec![],
            );
        }
    }

    /// Traced: `f` on the request's trace (with the core's entropy for new span ids); nothing
    /// when the request is not recorded.
    pub(super) fn with_trace(&self, f: impl FnOnce(&mut RequestTrace, &mut Entropy)) {
        if let Some(t) = self.trace.borrow_mut().as_mut() {
            f(t, &mut self.core.entropy.borrow_mut());
        }
    }

    /// Traced: the attributes every attempt span on `worker` starts with (a PD side adds its
    /// side).
    pub(super) fn attempt_attrs(&self, worker: &Worker) -> Vec<(&'static str, Value)> {
        let mut attrs = Vec::with_capacity(3);
        attrs.push(("radixgate.worker", Value::from(worker.url.clone())));
        attrs.push(("radixgate.attempt", Value::from(i64::from(self.attempts))));
        attrs
    }

    /// Whether this request is recorded.
    pub(super) fn traced(&self) -> bool {
        self.trace.borrow().is_some()
    }

    /// Whether a failed attempt may be followed by another (attempts and time remain).
    pub(super) fn may_retry(&self) -> bool {
        self.attempts < self.gw.retry.max_attempts && Instant::now() < self.deadline
    }

    /// Count one attempt (PD mode: one per pair).
    pub(super) fn count_attempt(&mut self) {
        self.attempts += 1;
    }

    /// How an answer from `worker` is relayed to this client.
    pub(super) fn relay_to<'w>(&'w self, worker: &'w Worker) -> RelayTo<'w> {
        RelayTo {
            worker,
            request_id: &self.request_id,
            client_keep_alive: self.head.keep_alive,
            client_http10: self.head.is_http10(),
            deadline: self.deadline,
            shutting_down: self.gw.life.is_shutting_down(),
        }
    }

    /// This core's upstream connections.
    pub(super) fn pool(&self) -> &'a crate::proxy::pool::Pool {
        &self.core.pool
    }

    /// The client's body as it came.
    pub(super) fn body(&self) -> &'a Bytes {
        self.body
    }

    /// When the whole request must be over.
    pub(super) fn deadline(&self) -> Instant {
        self.deadline
    }

    /// The class spliced into the body as `priority` (see `turn`), if any.
    pub(super) fn engine_priority(&self) -> Option<crate::admission::queue::Priority> {
        self.engine_priority
    }

    /// What pairing needs of the body (read with the routing text, in the same pass).
    pub(super) fn body_shape(&self) -> &crate::route::extract::BodyShape {
        &self.info.shape
    }

    /// The client asked for a streamed answer.
    pub(super) fn streamed(&self) -> bool {
        self.info.stream
    }

    /// How long connecting to a worker may take.
    pub(super) fn connect_timeout(&self) -> Duration {
        Duration::from_secs(self.gw.cfg.connect_timeout_secs)
    }

    /// A random number from this core's generator (bootstrap rooms).
    pub(super) fn random_u64(&self) -> u64 {
        self.core.rng.borrow_mut().next_u64()
    }

    /// Requests are about to go to workers: this core's busy-poll window opens.
    pub(super) fn touch(&self) {
        self.core.busy.touch();
    }

    /// The outcome of `picked`'s attempt, for its circuit.
    pub(super) fn record(&self, picked: &mut Picked<'_>, success: bool) {
        self.gw.record_outcome(&mut picked.slot, success);
    }

    /// `picked` served the request to its end.
    pub(super) fn completed(&self, picked: &Picked<'_>) {
        picked
            .worker
            .completed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// An answer was relayed: its time to first byte, and its output charged to its tenant.
    pub(super) fn relayed(&self, r: &relay::Relayed) {
        self.relayed_from(Leg::Prefill, r);
    }

    /// [`Exchange::relayed`] for the answer of one side of a PD pair (its attempt span gets the
    /// answer's figures; both sides' spans end, the other side's answer being read by then).
    pub(super) fn relayed_from(&self, leg: Leg, r: &relay::Relayed) {
        if let Some(t) = self.trace.borrow_mut().as_mut() {
            let now = now_ns();
            if let Some(at) = r.first_body_at {
                let ago = Instant::now().saturating_duration_since(at).as_nanos();
                t.event("first_byte", now.saturating_sub(ago as u64));
            }
            t.event("end_of_stream", now);
            t.leg_set(leg, "radixgate.body_bytes", r.body_bytes as i64);
            t.leg_set(leg, "radixgate.stream_events", r.events as i64);
            if r.upstream_broke {
                let why = Cow::Borrowed("the worker's answer broke off");
                t.end_leg(leg, now, Some(why));
            }
            t.end_attempt(now, None);
        }
        self.first_byte(r.first_body_at);
        self.charge_output(r.events, r.body_bytes);
    }

    /// The first answer byte left for the client at `at`.
    fn first_byte(&self, at: Option<Instant>) {
        if let Some(t) = at {
            crate::metrics::ttft(t.duration_since(self.started));
        }
    }

    /// With `--insert-response-text`, what records the reply from `picked` (`chunked`: its
    /// framing) so the next turn matches this one's whole history.
    pub(super) fn capture_for(&self, picked: &Picked<'_>, chunked: bool) -> Option<Capture> {
        match self.forwarding {
            Forwarding::Routed(api)
                if self.gw.cfg.insert_response_text && picked.decision.insert_text =>
            {
                Some(Capture::new(api, chunked))
            }
            _ => None,
        }
    }

    /// Learn the captured reply of a complete 2xx answer for `worker` (the side whose cache
    /// will hold the next turn's prefix: the regular worker, or PD's prefill worker).
    pub(super) fn learn_captured(
        &self,
        capture: Option<Capture>,
        complete: bool,
        status: u16,
        worker: WorkerId,
    ) {
        if complete && (200..300).contains(&status) {
            if let Some(reply) = capture.and_then(|c| c.reply()) {
                self.learn_reply(&reply, worker);
            }
        }
    }

    /// Write `reply` (a whole answer the gateway composed) with this request's id.
    pub(super) async fn send_reply(&self, client: &mut TcpStream, reply: &Reply) -> Outcome {
        super::reply::send(
            client,
            reply,
            Some(&self.request_id),
            self.head.keep_alive,
            false,
        )
        .await
    }

    /// Answer `e` with this request's id.
    pub(super) async fn fail(&self, client: &mut TcpStream, e: GatewayError) -> Outcome {
        if let Some(t) = self.trace.borrow_mut().as_mut() {
            t.set("http.response.status_code", i64::from(e.status));
            t.fail(e.message.clone());
        }
        send_error(client, Some(self.head), &e, Some(&self.request_id)).await
    }
}

/// An attempt's outcome on its span: the status it got, else why it failed and, when another
/// worker gets a try, the retry reason; a failed attempt's span ends here, a relayed one's when
/// its answer is over.
fn trace_attempt(
    t: &mut RequestTrace,
    answer: Option<&Result<UpstreamResponse, forward::UpstreamError>>,
    retry: bool,
) {
    let (reason, error): (&'static str, Cow<'static, str>) = match answer {
        None => ("client_gone", Cow::Borrowed("the client left")),
        Some(Ok(up)) => {
            t.attempt_set("http.response.status_code", i64::from(up.head.status));
            if !(is_retryable_status(up.head.status) && retry) {
                return;
            }
            (
                "status",
                Cow::Owned(format!("worker answered {}", up.head.status)),
            )
        }
        Some(Err(e)) => (e.kind(), Cow::Owned(e.message())),
    };
    if retry && answer.is_some() {
        t.attempt_set("radixgate.retry_reason", reason);
    }
    t.end_attempt(now_ns(), Some(error));
}

/// The pass-through endpoint a head names, for a "busy" answer (a fixed set of names).
fn head_path_label(head: &RequestHead) -> &'static str {
    match head.path() {
        b"/health_generate" => "/health_generate",
        _ => "/get_model_info",
    }
}

/// When every eligible worker has failed this request once (the policy finds none outside the
/// exclusions) and attempts remain, the exclusions are forgotten and the policy chooses among
/// all of them again, as the reference reselects on every attempt: excluding failed workers
/// steers retries elsewhere while there is an elsewhere, and a fleet of one or two (a single
/// decode server) still gets its retries. Once per pick, so workers the pick itself skipped
/// (half-open circuits with their probe slots taken) cannot make it loop.
pub(super) fn recycle_exclusions(
    excluded: &mut Vec<WorkerId>,
    after_a_failure: bool,
    recycled: &mut bool,
) -> bool {
    if *recycled || !after_a_failure || excluded.is_empty() {
        return false;
    }
    *recycled = true;
    excluded.clear();
    true
}

/// Whether the chosen worker already holds the whole routing text in the text tree (or an
/// unpublished insert), so learning it again would change nothing but access times. Only a
/// text-tree decision says so in characters (with KV events the sizes may count tokens). The
/// access time is not refreshed: if the text tree's LRU later evicts a prompt still in use,
/// the next request inserts it again.
fn already_held(decision: &Decision, measured: bool) -> bool {
    !measured && decision.request_size > 0 && decision.predicted_chars == decision.request_size
}

/// The routing text as the tree and the recent-insert ring keep it: a zero-copy slice of the
/// body when the body is not much larger than the text (the common case: the prompt is most of
/// the body), else a copy, so a kept text never pins a large upload (at most twice its size
/// plus 4 KiB).
pub(super) fn learned_text(body: &Bytes, text: &str) -> Bytes {
    if body.len() <= 2 * text.len() + 4096 {
        as_body_slice(body, text)
    } else {
        Bytes::copy_from_slice(text.as_bytes())
    }
}

/// Bytes of `s` as a zero-copy slice of `body` when `s` lies inside it (borrowed by the
/// extractor), else a copy (text that had to be unescaped or joined).
fn as_body_slice(body: &Bytes, s: &str) -> Bytes {
    let start = body.as_ptr() as usize;
    let p = s.as_ptr() as usize;
    if !s.is_empty() && p >= start && p + s.len() <= start + body.len() {
        body.slice(p - start..p - start + s.len())
    } else {
        Bytes::copy_from_slice(s.as_bytes())
    }
}
