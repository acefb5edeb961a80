//! One proxied request as named phases on an [`Exchange`], in the order a request lives them:
//!
//! - **admit**: auth, routing inputs from the body, request id, admission permit;
//! - **tokenize**: with KV-event routing, the prompt in the servers' token ids, once;
//! - **wait turn** (`turn`): with `--saturation-admission`, the gateway's own queue;
//! - **pick**: a policy decision, the worker's circuit, the in-flight count, the tree insert;
//! - **attempt**: one upstream round trip raced against the client leaving;
//! - **retry_after**: a failed attempt's bookkeeping, and whether another worker gets a try;
//! - **commit**: relay the answer, account the outcome, learn the reply.
//!
//! As in Pingora's `proxy_to_upstream`, one loop ([`serve_with`]) drives every request through
//! these phases and a failed attempt carries its own retry decision (a [`GatewayError`]), so the
//! loop reads as the lifecycle: pick → attempt → commit, or retry_after → pick. What a request is
//! sent to is a [`Target`] the loop is generic over (statically dispatched: this is the hot
//! path): one worker ([`single::OneWorker`]) or a prefill/decode pair (`serve::pd`). Each target
//! picks on one or two [`Lane`]s (a side of the fleet with its router and the workers that
//! already failed the request), with the exchange's own pick, retry and relay steps.

use super::error::GatewayError;
use super::reply::send_error;
use super::Outcome;
use crate::admission::Permit;
use crate::gateway::kv_routing::Fallback;
use crate::gateway::requests::IdKey;
use crate::gateway::{Core, Gateway};
use crate::http::RequestHead;
use crate::proxy::io::closed_by_peer;
use crate::proxy::request_id::request_id;
use crate::route::extract::{extract_for, Api, RoutingInfo, RoutingText};
use crate::route::policy::manual::{key_too_long, MAX_ROUTING_KEY_LEN};
use crate::route::types::PolicyKind;
use crate::trace::span::{now_ns, RequestTrace};
use crate::tree::TreeKey;
use bytes::Bytes;
use monoio::net::TcpStream;
use monoio::time::Instant;
use std::cell::RefCell;
use std::future::Future;
use std::net::IpAddr;
use std::time::Duration;

mod commit;
mod pick;
mod retry;
pub(super) mod single;
mod trace;
mod turn;

pub(super) use commit::served;
pub(super) use pick::{Lane, Picked};

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

/// What one attempt of a request is sent to: a single worker, or a prefill/decode pair. The
/// loop in [`serve_with`] owns the order of the phases, the client-watch race, the 499 path and
/// the answer to a failure; a target supplies what differs.
pub(super) trait Target<'a>: Sized {
    /// The workers one attempt holds, counted in flight until dropped.
    type Picked;
    /// What an attempt that reached a final answer brings back.
    type Answer;

    /// The lane whose workers compute the prompt: the saturation admission's fleet, and where
    /// the workers it finds full are excluded.
    fn computing_lane(&mut self) -> &mut Lane<'a>;

    /// Phase *pick*.
    fn pick(&mut self, ex: &mut Exchange<'a>) -> Result<Self::Picked, GatewayError>;

    /// Phase *attempt*: one round trip (the loop races it against the client leaving). `retry`:
    /// another attempt may follow, so a retryable status is a failure rather than the answer.
    fn attempt(
        &self,
        ex: &Exchange<'a>,
        picked: &Self::Picked,
        retry: bool,
    ) -> impl Future<Output = Result<Self::Answer, GatewayError>>;

    /// Phase *retry_after*: the failed worker's bookkeeping, then a back-off before the next
    /// pick, or the error the client gets.
    fn retry_after(
        &mut self,
        ex: &mut Exchange<'a>,
        picked: Self::Picked,
        error: GatewayError,
    ) -> impl Future<Output = Result<(), GatewayError>>;

    /// Phase *commit*: bytes reach the client from here on.
    fn commit(
        self,
        ex: Exchange<'a>,
        client: &mut TcpStream,
        picked: Self::Picked,
        answer: Self::Answer,
    ) -> impl Future<Output = Outcome>;
}

/// Handle a proxied request on one worker, from its head and body to the last byte relayed.
pub async fn handle(
    core: &Core,
    client: &mut TcpStream,
    head: &RequestHead,
    body: Bytes,
    forwarding: Forwarding,
) -> Outcome {
    serve_with(core, client, head, &body, forwarding, |ex| {
        Ok(single::OneWorker::new(ex))
    })
    .await
}

/// The one request loop: admit, build the target (`target` may refuse the request), tokenize,
/// wait turn, then pick → attempt → commit, or retry_after → pick.
pub(super) async fn serve_with<'a, T: Target<'a>>(
    core: &'a Core,
    client: &mut TcpStream,
    head: &'a RequestHead,
    body: &'a Bytes,
    forwarding: Forwarding,
    target: impl FnOnce(&Exchange<'a>) -> Result<T, GatewayError>,
) -> Outcome {
    // Read once: every attempt appends it to X-Forwarded-For.
    let client_ip = client.peer_addr().ok().map(|a| a.ip());
    let mut ex = match Exchange::admit(core, head, body, forwarding, client_ip).await {
        Ok(ex) => ex,
        Err(refused) => {
            let id = refused.request_id.as_deref();
            return send_error(client, Some(head), &refused.error, id).await;
        }
    };
    let mut target = match target(&ex) {
        Ok(t) => t,
        Err(e) => return ex.fail(client, e).await,
    };
    ex.tokenize().await;
    if let Some(out) = ex
        .wait_turn_or_answer(client, target.computing_lane())
        .await
    {
        return out;
    }
    loop {
        let picked = match target.pick(&mut ex) {
            Ok(p) => p,
            Err(e) => return ex.fail(client, e).await,
        };
        ex.attempts += 1;
        let retry = ex.may_retry();
        core.busy.touch();
        let answer = monoio::select! {
            r = target.attempt(&ex, &picked, retry) => Some(r),
            _ = async {
                monoio::time::sleep(CLIENT_WATCH_DELAY).await;
                closed_by_peer(client).await
            } => None,
        };
        match answer {
            Some(Ok(answer)) => return target.commit(ex, client, picked, answer).await,
            Some(Err(mut e)) => {
                e.retryable &= retry;
                if let Err(e) = target.retry_after(&mut ex, picked, e).await {
                    return ex.fail(client, e).await;
                }
            }
            None => {
                drop(picked);
                ex.with_trace(|t, _| t.end_attempt(now_ns(), Some("the client left".into())));
                return ex.client_gone("the client left");
            }
        }
    }
}

/// A request refused before it reached a worker (with its request id once one exists).
pub(super) struct Refused {
    pub(super) error: GatewayError,
    pub(super) request_id: Option<String>,
}

/// One request's state across its attempts. The targets read its fields; only this module
/// and its phases change them.
pub(super) struct Exchange<'a> {
    pub(super) core: &'a Core,
    pub(super) gw: &'a Gateway,
    head: &'a RequestHead,
    /// The client's body as it came.
    pub(super) body: &'a Bytes,
    forwarding: Forwarding,
    /// Routing text, model, streaming and what pairing needs of the body, read in one pass.
    pub(super) info: RoutingInfo<'a>,
    request_id: String,
    /// `request_id`'s key in the gateway's in-flight id map.
    id_key: IdKey,
    started: Instant,
    /// When the whole request must be over.
    pub(super) deadline: Instant,
    routing_key: Option<&'a [u8]>,
    hash_key: Option<&'a [u8]>,
    /// The tree the request's model reads and feeds (served models only; see `TreeKey`).
    tree: TreeKey,
    /// Attempts so far (a PD pair counts once).
    pub(super) attempts: u32,
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
    pub(super) engine_priority: Option<crate::admission::queue::Priority>,
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
    async fn admit(
        core: &'a Core,
        head: &'a RequestHead,
        body: &'a Bytes,
        forwarding: Forwarding,
        client_ip: Option<IpAddr>,
    ) -> Result<Exchange<'a>, Refused> {
        let gw: &'a Gateway = &core.gw;
        let Some(mut t) = trace::begin(core, head, client_ip) else {
            return Self::admit_untraced(core, head, body, forwarding, client_ip).await;
        };
        let started_ns = now_ns();
        match Self::admit_untraced(core, head, body, forwarding, client_ip).await {
            Ok(mut ex) => {
                trace::admitted(&mut t, &ex, started_ns);
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
        let info =
            routing_info(gw, head, body, forwarding, routing_key).map_err(|e| refuse(e, None))?;
        let rid = request_id(
            head,
            &gw.settings.exchange.request_id_headers,
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
            deadline: started + gw.settings.exchange.request_timeout,
            routing_key,
            hash_key: routing_key
                .or_else(|| head.header("authorization"))
                .or_else(|| head.header("x-forwarded-for"))
                .or_else(|| head.header("cookie")),
            tree: gw.models.tree_key(info.model.as_deref()),
            info,
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
    async fn tokenize(&mut self) {
        let (Forwarding::Routed(api), Some(kv)) = (self.forwarding, &self.gw.kv) else {
            return;
        };
        // The prompt is measured on the side that computes it (`gw.router`: the regular or,
        // in PD mode, the prefill side's).
        if self.gw.router.policy.kind() != PolicyKind::CacheAware {
            return;
        }
        // A namespaced text starts with the text tree's marker, which is no part of the prompt
        // the server encodes: encoded with it, the ids would never match the server's blocks
        // (the namespace is hashed into the chain's root instead). Token-id texts keep it: their
        // reader takes it off and counts the cap on the whole text.
        let text: &str = &self.info.text;
        let text = if self.info.token_ids || self.info.namespace.is_default() {
            text
        } else {
            crate::route::extract::without_marker(text)
        };
        let tokens = crate::gateway::tokenizing::prompt_tokens(
            self.core,
            kv,
            api,
            self.body,
            text,
            self.info.token_ids,
        )
        .await;
        self.prompt = Some(tokens);
    }

    /// Whether a failed attempt may be followed by another (attempts and time remain).
    fn may_retry(&self) -> bool {
        self.attempts < self.gw.retry.max_attempts && Instant::now() < self.deadline
    }

    /// How long connecting to a worker may take.
    pub(super) fn connect_timeout(&self) -> Duration {
        self.gw.settings.exchange.connect_timeout
    }

    /// Answer `e` with this request's id.
    pub(super) async fn fail(&self, client: &mut TcpStream, e: GatewayError) -> Outcome {
        if let Some(t) = self.trace.borrow_mut().as_mut() {
            t.set("http.response.status_code", i64::from(e.status));
            t.fail(e.message.clone());
        }
        send_error(client, Some(self.head), &e, Some(&self.request_id)).await
    }

    /// The client left (`why`, for the trace): nothing more is sent, the connection closes.
    fn client_gone(&self, why: &'static str) -> Outcome {
        crate::metrics::client_gone();
        self.traced_status(499, Some(why));
        Outcome {
            status: 499,
            keep_alive: false,
        }
    }
}

/// Phase *admit*'s routing inputs: a routed call's body read once for its text, model and
/// shape (a bad body, or a hostile `manual` key, is refused); nothing for a pass-through.
fn routing_info<'a>(
    gw: &Gateway,
    head: &RequestHead,
    body: &'a Bytes,
    forwarding: Forwarding,
    routing_key: Option<&[u8]>,
) -> Result<RoutingInfo<'a>, GatewayError> {
    let Forwarding::Routed(api) = forwarding else {
        return Ok(RoutingInfo {
            model: None,
            stream: false,
            text: RoutingText::InBody(""),
            token_ids: false,
            namespace: Default::default(),
            shape: Default::default(),
        });
    };
    // The key was checked on the head (`conn::decide`), before the body was read.
    // The saturation admission bills prompts on their text, whatever the policy.
    let keep_text = gw.flow.is_some() || gw.routers().any(|(r, _)| r.policy.reads_text());
    let info = extract_for(api, body, keep_text).map_err(|e| GatewayError::bad_request(e.0))?;
    // manual remembers keys: a hostile key length is refused, not hashed.
    if let Some(key) = routing_key
        .filter(|k| k.len() > MAX_ROUTING_KEY_LEN && gw.router.policy.kind() == PolicyKind::Manual)
    {
        return Err(GatewayError::bad_request(key_too_long(key.len())));
    }
    crate::metrics::routed(
        gw.models.label(info.model.as_deref()),
        crate::metrics::path_label(head.path()),
        info.stream,
    );
    Ok(info)
}

/// The pass-through endpoint a head names, for a "busy" answer (a fixed set of names).
fn head_path_label(head: &RequestHead) -> &'static str {
    match head.path() {
        b"/health_generate" => "/health_generate",
        _ => "/get_model_info",
    }
}
