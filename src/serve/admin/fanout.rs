//! Endpoints answered by asking every worker: `/v1/models` (merged), `/flush_cache` (vLLM's
//! `/reset_prefix_cache` where a worker has no `/flush_cache`), `/get_loads`. The calls run concurrently from the serving core, each bounded by a timeout.

use crate::gateway::Core;
use crate::http::Method;
use crate::proxy::forward::{self, UpstreamError};
use crate::serve::error::GatewayError;
use crate::serve::reply::Reply;
use crate::workers::registry::Worker;
use bytes::Bytes;
use serde_json::{json, Value};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

/// Each worker's `/v1/models` answer.
const MODELS_TIMEOUT: Duration = Duration::from_secs(5);
/// Each worker's `/flush_cache` (a flush waits for running requests on the worker).
const FLUSH_TIMEOUT: Duration = Duration::from_secs(10);
/// Each worker's `/get_load`.
const LOADS_TIMEOUT: Duration = Duration::from_secs(5);

/// One worker's answer to a fan-out call: status and body, or why there is none.
type Answer = Result<(u16, Bytes), UpstreamError>;

/// Call `path` on every given worker concurrently (from this core).
async fn fan_out(
    core: &Rc<Core>,
    workers: Vec<Arc<Worker>>,
    method: Method,
    path: &'static str,
    timeout: Duration,
) -> Vec<(Arc<Worker>, Answer)> {
    fan_out_with(core, workers, method, path, Bytes::new(), timeout).await
}

/// [`fan_out`] with a body (the same bytes to every worker).
pub(super) async fn fan_out_with(
    core: &Rc<Core>,
    workers: Vec<Arc<Worker>>,
    method: Method,
    path: &'static str,
    body: Bytes,
    timeout: Duration,
) -> Vec<(Arc<Worker>, Answer)> {
    let mut handles = Vec::with_capacity(workers.len());
    for w in workers {
        let core = core.clone();
        let body = body.clone();
        handles.push(monoio::spawn(async move {
            let r = forward::fetch(&core.pool, &w, method, path, body, timeout).await;
            (w, r)
        }));
    }
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.await);
    }
    out
}

/// How long a core answers `/v1/models` from its last merge (the cards change only with the
/// worker set): a client looping on the public endpoint costs the workers one fan-out a second
/// per core, and at most `Gateway::model_fanouts` run at once.
const MODELS_FRESH: Duration = Duration::from_secs(1);

/// `GET /v1/models`: the selectable workers' model cards, merged by id.
pub async fn models(core: &Rc<Core>) -> Result<Reply, GatewayError> {
    let cached = core.models_cache.borrow().clone();
    if let Some((at, list)) = &cached {
        if at.elapsed() < MODELS_FRESH {
            return Ok(Reply::json(200, list));
        }
    }
    let Some(_slot) = core.gw.model_fanouts.try_take() else {
        return cached
            .map(|(_, list)| Reply::json(200, &list))
            .ok_or_else(|| GatewayError::busy("/v1/models"));
    };
    let list = merge_models(core).await?;
    let reply = Reply::json(200, &list);
    *core.models_cache.borrow_mut() = Some((std::time::Instant::now(), list));
    Ok(reply)
}

/// Ask every selectable worker for its model cards and merge them by id.
async fn merge_models(core: &Rc<Core>) -> Result<Value, GatewayError> {
    let gw = &core.gw;
    let workers: Vec<Arc<Worker>> = gw
        .registry
        .load()
        .workers
        .iter()
        .filter(|w| gw.registry.loads.is_eligible(w.id))
        .cloned()
        .collect();
    let results = fan_out(core, workers, Method::Get, "/v1/models", MODELS_TIMEOUT).await;
    let mut data: Vec<Value> = Vec::new();
    let mut answered = 0;
    for (_, r) in results {
        let Ok((200, body)) = r else { continue };
        let Ok(v) = serde_json::from_slice::<Value>(&body) else {
            continue;
        };
        answered += 1;
        let cards = v
            .get("data")
            .and_then(Value::as_array)
            .into_iter()
            .flatten();
        for card in cards {
            let id = card.get("id");
            if !data.iter().any(|c| c.get("id") == id) {
                data.push(card.clone());
            }
        }
    }
    if answered == 0 && !gw.registry.load().is_empty() {
        return Err(GatewayError::unavailable("no worker answered /v1/models"));
    }
    Ok(json!({"object": "list", "data": data}))
}

/// vLLM's equivalent of SGLang's `/flush_cache` (vLLM has no `/flush_cache`). It is one of
/// vLLM's development endpoints, served only with `VLLM_SERVER_DEV_MODE=1`, and answers
/// `{"success": false}` while blocks are held (running requests).
const VLLM_RESET: &str = "/reset_prefix_cache";

/// `POST /flush_cache`: flush every worker's cache; 206 when some did not flush. A worker that
/// has no `/flush_cache` (404: vLLM) is asked its `/reset_prefix_cache` instead, and counts as
/// flushed only when that says it succeeded.
pub async fn flush_cache(core: &Rc<Core>) -> Reply {
    let workers = core.gw.registry.load().workers.clone();
    let results = fan_out(core, workers, Method::Post, "/flush_cache", FLUSH_TIMEOUT).await;
    let without: Vec<Arc<Worker>> = results
        .iter()
        .filter(|(_, r)| matches!(r, Ok((404, _))))
        .map(|(w, _)| w.clone())
        .collect();
    // Answers come in the order the workers were given: the resets pair with the 404s in turn.
    let mut reset = fan_out(core, without, Method::Post, VLLM_RESET, FLUSH_TIMEOUT)
        .await
        .into_iter();
    let results: Vec<(Arc<Worker>, &str, Answer)> = results
        .into_iter()
        .map(|(w, r)| {
            let pair = if matches!(r, Ok((404, _))) {
                reset.next()
            } else {
                None
            };
            match pair {
                Some((w, r)) => (w, VLLM_RESET, r),
                None => (w, "/flush_cache", r),
            }
        })
        .collect();
    let total = results.len();
    let mut ok = 0;
    let details: Vec<Value> = results
        .iter()
        .map(|(w, path, r)| {
            let path = *path;
            match r {
                Ok((s, b)) => {
                    let flushed = match path {
                        VLLM_RESET => *s == 200 && reset_succeeded(b),
                        _ => *s == 200,
                    };
                    ok += usize::from(flushed);
                    let mut d = json!({
                        "worker": w.url, "path": path, "status": s,
                        "body": String::from_utf8_lossy(b),
                    });
                    if path == VLLM_RESET && *s == 404 {
                        d["error"] = json!(
                            "the worker has neither /flush_cache (SGLang) nor /reset_prefix_cache \
                             (vLLM serves it only with VLLM_SERVER_DEV_MODE=1)"
                        );
                    }
                    d
                }
                Err(e) => json!({"worker": w.url, "path": path, "error": e.message()}),
            }
        })
        .collect();
    let status = if ok == total { 200 } else { 206 };
    Reply::json(
        status,
        &json!({"flushed": ok, "total": total, "workers": details}),
    )
}

/// Whether vLLM's `/reset_prefix_cache` answer says the cache was reset (`{"success": true}`).
fn reset_succeeded(body: &[u8]) -> bool {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("success")?.as_bool())
        .unwrap_or(false)
}

/// `GET /get_loads`: each worker's own `/get_load` beside the gateway's in-flight count.
pub async fn loads(core: &Rc<Core>) -> Reply {
    let gw = &core.gw;
    let workers = gw.registry.load().workers.clone();
    let results = fan_out(core, workers, Method::Get, "/get_load", LOADS_TIMEOUT).await;
    let loads: Vec<Value> = results
        .iter()
        .map(|(w, r)| {
            let load = match r {
                Ok((200, b)) => serde_json::from_slice::<Value>(b).unwrap_or(Value::Null),
                _ => Value::Null,
            };
            let board = &gw.registry.loads;
            let mut entry = json!({
                "worker": w.url,
                "load": load,
                "gateway_in_flight": board.in_flight(w.id),
                "routing_load": board.load(w.id),
            });
            // vLLM has no /get_load: its load is in its metrics, which /engine_metrics relays.
            if matches!(r, Ok((404, _))) {
                entry["error"] = json!(
                    "the worker has no /get_load (vLLM): its running and waiting requests are \
                     vllm:num_requests_running and vllm:num_requests_waiting in /engine_metrics"
                );
            }
            entry
        })
        .collect();
    Reply::json(200, &json!({"workers": loads}))
}
