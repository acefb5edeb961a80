//! `POST /abort_request` (SGLang's endpoint, body `{"rid": "..."}`): the reference answers 404
//! here (sglang #6531) and the orphaned request keeps its KV cache. radixgate forwards the body
//! to the worker that holds the request (the gateway's in-flight id map, keyed by the id it
//! echoed in `x-request-id` and by its caller: the same `Authorization` header, or the same
//! client address without one) and answers with that worker's answer; in prefill/decode mode
//! the prefill half gets it too (it may still be computing the prompt).
//!
//! SGLang's `abort_all` kills every running request, and an id the gateway does not hold for
//! this caller (it finished, was never seen, belongs to another caller, came in a `/generate`
//! body only, or was not tracked) could only be sent to every worker: both are control calls
//! (the admin key, see `gateway::auth`). Anyone else asking for an id the gateway does not hold
//! for them gets 404. The answer says where it went (`sent_to`: `holder` or `all`) and the
//! workers' statuses, never their addresses.

use super::fanout;
use crate::base::WorkerId;
use crate::gateway::{Core, Scope};
use crate::http::{Method, RequestHead};
use crate::proxy::forward::{self, UpstreamError};
use crate::serve::error::GatewayError;
use crate::serve::reply::Reply;
use crate::workers::registry::{Worker, WorkerList};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::json;
use std::borrow::Cow;
use std::net::IpAddr;
use std::rc::Rc;
use std::time::Duration;

/// Each worker's answer to an abort (SGLang answers at once; the abort itself is async).
const ABORT_TIMEOUT: Duration = Duration::from_secs(5);

/// The fields of SGLang's `AbortReq` the gateway reads (the body goes on as it came).
#[derive(Deserialize)]
struct AbortBody<'a> {
    #[serde(borrow, default)]
    rid: Option<Cow<'a, str>>,
    #[serde(default)]
    abort_all: bool,
}

/// Forward an abort to the holder of its request, or (control calls only) to every worker.
pub async fn abort(
    core: &Rc<Core>,
    head: &RequestHead,
    body: &Bytes,
    peer: Option<IpAddr>,
) -> Result<Reply, GatewayError> {
    let req: AbortBody = serde_json::from_slice(body)
        .map_err(|e| GatewayError::bad_request(format!("invalid abort_request body: {e}")))?;
    let rid = req.rid.as_deref().filter(|r| !r.is_empty());
    if rid.is_none() && !req.abort_all {
        return Err(GatewayError::bad_request(
            "`rid` (or `\"abort_all\": true`) is required",
        ));
    }
    let gw = &core.gw;
    let list = gw.registry.load();
    let holder = match (req.abort_all, rid) {
        (false, Some(rid)) => gw
            .in_flight_ids
            .holder(gw.in_flight_ids.key_for(head, peer, rid)),
        _ => None,
    };
    if let Some(holder) = holder {
        if let Some(reply) = to_holder(core, &list, holder, rid, body).await? {
            return Ok(reply);
        }
    }
    // Every worker: a control call.
    if let Err(no) = gw.auth.authorize(head, Scope::Control, peer) {
        if req.abort_all {
            // The caller passed the route's check: known, but not allowed this.
            crate::log!(Debug, "abort_all refused: {}", no.message);
            return Err(GatewayError::forbidden(
                "aborting every request needs the admin key (--admin-api-key)",
            ));
        }
        return Err(GatewayError::not_found(
            "no request with this rid is in flight for this caller",
        ));
    }
    to_every_worker(core, &list, rid, body).await
}

/// The abort sent to the worker that holds the request (`latest`), and to the one that held it
/// `before` (the prefill half of a prefill/decode request); None when the holder is no longer
/// in the worker list.
async fn to_holder(
    core: &Rc<Core>,
    list: &WorkerList,
    (latest, before): (WorkerId, Option<WorkerId>),
    rid: Option<&str>,
    body: &Bytes,
) -> Result<Option<Reply>, GatewayError> {
    let Some(w) = list.get(latest) else {
        return Ok(None);
    };
    crate::log!(Debug, "abort_request {:?} → {}", rid, w.url);
    // The worker that held it before (perhaps still computing a long prompt) gets it too; its
    // answer does not count, since after a retry it is a worker that no longer runs the
    // request.
    let earlier = before.filter(|&b| b != latest).and_then(|b| list.get(b));
    if let Some(b) = earlier {
        if let Err(e) = send_abort(core, b, body).await {
            crate::log!(Debug, "abort_request {:?} → {}: {e:?}", rid, b.url);
        }
    }
    // The answer never names the worker: its address is internal topology and this endpoint
    // needs only the inference key.
    let (status, _) = send_abort(core, w, body)
        .await
        .map_err(|e| GatewayError::upstream(&e))?;
    if status == 404 {
        return Err(no_abort_request());
    }
    Ok(Some(Reply::json(
        status,
        &json!({"rid": rid, "sent_to": "holder", "status": status}),
    )))
}

/// The abort sent to every worker (the caller is allowed control calls): 200 when any of them
/// took it, else 502.
async fn to_every_worker(
    core: &Rc<Core>,
    list: &WorkerList,
    rid: Option<&str>,
    body: &Bytes,
) -> Result<Reply, GatewayError> {
    let workers = list.workers.clone();
    if workers.is_empty() {
        return Err(GatewayError::no_workers(true));
    }
    let results = fanout::fan_out_with(
        core,
        workers,
        Method::Post,
        "/abort_request",
        body.clone(),
        ABORT_TIMEOUT,
    )
    .await;
    let ok = results
        .iter()
        .filter(|(_, r)| matches!(r, Ok((200..=299, _))))
        .count();
    if ok == 0 && results.iter().all(|(_, r)| matches!(r, Ok((404, _)))) {
        return Err(no_abort_request());
    }
    let status = if ok > 0 { 200 } else { 502 };
    Ok(Reply::json(
        status,
        &json!({"rid": rid, "sent_to": "all", "workers": results.len(), "answered": ok}),
    ))
}

/// The answer when the worker has no `/abort_request` (vLLM): its own abort takes vLLM's
/// request ids, which the gateway does not know, so sending it the rid could only pretend to
/// abort (vLLM answers 200 before it looks the ids up). 501, saying where to go instead.
fn no_abort_request() -> GatewayError {
    GatewayError::not_implemented(
        "the worker has no /abort_request (SGLang's); a vLLM server aborts a request when its \
         client disconnects, or through its own POST /inference/v1/abort_requests with vLLM's \
         request ids",
    )
}

/// One worker's `/abort_request` with the client's body as it came.
async fn send_abort(
    core: &Rc<Core>,
    worker: &Worker,
    body: &Bytes,
) -> Result<(u16, Bytes), UpstreamError> {
    forward::fetch(
        &core.pool,
        worker,
        Method::Post,
        "/abort_request",
        body.clone(),
        ABORT_TIMEOUT,
    )
    .await
}
