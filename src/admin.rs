//! Endpoints the gateway answers itself: liveness/readiness, `/v1/models` merged from the
//! workers, `/get_server_info`, worker management (`/workers`, and the legacy `/add_worker`,
//! `/remove_worker`, `/list_workers` that scripts still call) and the `/flush_cache` and
//! `/get_loads` fan-outs.

use crate::gateway::Core;
use crate::http::{self, RequestHead};
use crate::proxy::forward;
use crate::proxy::inference::reply_error;
use crate::proxy::io::write_all_by;
use crate::workers::registry::{RegistryError, Worker};
use bytes::Bytes;
use monoio::net::TcpStream;
use monoio::time::Instant;
use serde_json::{json, Value};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

/// A gateway-local endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Health,
    Readiness,
    Models,
    ServerInfo,
    ListWorkers,
    AddWorker,
    GetWorker,
    DeleteWorker,
    LegacyAdd,
    LegacyRemove,
    LegacyList,
    FlushCache,
    GetLoads,
}

impl Endpoint {
    /// Worker management and cache control (need the admin key when one is set).
    pub fn is_admin(self) -> bool {
        matches!(
            self,
            Endpoint::AddWorker
                | Endpoint::DeleteWorker
                | Endpoint::LegacyAdd
                | Endpoint::LegacyRemove
                | Endpoint::FlushCache
                | Endpoint::ListWorkers
                | Endpoint::GetWorker
                | Endpoint::LegacyList
                | Endpoint::GetLoads
        )
    }
}

/// The local endpoint for a method and path: `None` when the path is not local,
/// `Some(Err(()))` when the path is local but the method is wrong.
pub fn endpoint(method: &[u8], path: &[u8]) -> Option<Result<Endpoint, ()>> {
    let m = |ok: bool, e: Endpoint| Some(if ok { Ok(e) } else { Err(()) });
    let get = method == b"GET";
    let post = method == b"POST";
    match path {
        b"/health" | b"/liveness" => m(get, Endpoint::Health),
        b"/readiness" => m(get, Endpoint::Readiness),
        b"/v1/models" => m(get, Endpoint::Models),
        b"/get_server_info" | b"/server_info" => m(get, Endpoint::ServerInfo),
        b"/workers" => match method {
            b"GET" => Some(Ok(Endpoint::ListWorkers)),
            b"POST" => Some(Ok(Endpoint::AddWorker)),
            _ => Some(Err(())),
        },
        b"/add_worker" => m(post, Endpoint::LegacyAdd),
        b"/remove_worker" => m(post || method == b"DELETE", Endpoint::LegacyRemove),
        b"/list_workers" => m(get, Endpoint::LegacyList),
        b"/flush_cache" => m(post || get, Endpoint::FlushCache),
        b"/get_loads" => m(get, Endpoint::GetLoads),
        p if p.starts_with(b"/workers/") && p.len() > b"/workers/".len() => match method {
            b"GET" => Some(Ok(Endpoint::GetWorker)),
            b"DELETE" => Some(Ok(Endpoint::DeleteWorker)),
            _ => Some(Err(())),
        },
        _ => None,
    }
}

async fn send(stream: &mut TcpStream, head: &RequestHead, status: u16, body: &Value) -> bool {
    let keep = head.keep_alive;
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    let resp = http::response::render(status, "application/json", &[], &bytes, !keep);
    write_all_by(stream, resp, Instant::now() + Duration::from_secs(30))
        .await
        .is_ok()
        && keep
}

/// Describe a worker for the management API.
pub fn worker_json(core: &Core, w: &Worker) -> Value {
    json!({
        "id": w.id.to_string(),
        "url": w.url,
        "healthy": w.is_healthy(),
        "draining": w.is_draining(),
        "circuit": core.gw.breaker_state_name(w),
        "in_flight": core.gw.registry.loads.load(w.id),
        "completed": w.completed.load(std::sync::atomic::Ordering::Relaxed),
    })
}

fn query_param(head: &RequestHead, name: &str) -> Option<String> {
    let q = head.query()?;
    for pair in q.split(|&b| b == b'&') {
        let (k, v) = match pair.iter().position(|&b| b == b'=') {
            Some(i) => (&pair[..i], &pair[i + 1..]),
            None => (pair, &b""[..]),
        };
        if k == name.as_bytes() {
            return Some(percent_decode(v));
        }
    }
    None
}

fn percent_decode(v: &[u8]) -> String {
    let mut out = Vec::with_capacity(v.len());
    let mut i = 0;
    while i < v.len() {
        match v[i] {
            b'%' if i + 2 < v.len() => {
                let hex = std::str::from_utf8(&v[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(b) => {
                        out.push(b);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Call `path` on every given worker concurrently (from this core).
pub async fn fan_out(
    core: &Rc<Core>,
    workers: Vec<Arc<Worker>>,
    method: &'static str,
    path: &'static str,
    timeout: Duration,
) -> Vec<(Arc<Worker>, Result<(u16, Bytes), String>)> {
    let mut handles = Vec::with_capacity(workers.len());
    for w in workers {
        let core = core.clone();
        handles.push(monoio::spawn(async move {
            let r = forward::fetch(&core, &w, method, path, Bytes::new(), timeout)
                .await
                .map_err(|e| e.message(&w.url));
            (w, r)
        }));
    }
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.await);
    }
    out
}

/// Answer a local endpoint; returns (status, keep-alive).
pub async fn handle(
    core: &Rc<Core>,
    stream: &mut TcpStream,
    head: &RequestHead,
    body: Bytes,
    ep: Endpoint,
) -> (u16, bool) {
    let gw = core.gw.clone();
    // Health, readiness, models and server info stay public (orchestrators probe them);
    // worker management and cache control need the admin key.
    if ep.is_admin() {
        if let Err(msg) = gw.authorize(head, true) {
            return (
                401,
                reply_error(stream, head, 401, "authentication_error", msg).await,
            );
        }
    }
    match ep {
        Endpoint::Health => {
            let keep = head.keep_alive;
            let resp = http::response::render(200, "text/plain", &[], b"OK", !keep);
            (
                200,
                write_all_by(stream, resp, Instant::now() + Duration::from_secs(30))
                    .await
                    .is_ok()
                    && keep,
            )
        }
        Endpoint::Readiness => {
            // An owned Arc, not a guard: it lives across the response write.
            let list = gw.registry.load_full();
            let healthy = list
                .workers
                .iter()
                .filter(|w| gw.registry.loads.is_eligible(w.id))
                .count();
            let total = list.len();
            let ready = healthy > 0 && !gw.is_shutting_down();
            let status = if ready { 200 } else { 503 };
            let body = json!({
                "status": if ready { "ready" } else if gw.is_shutting_down() { "shutting_down" } else { "not_ready" },
                "healthy_workers": healthy,
                "total_workers": total,
            });
            (status, send(stream, head, status, &body).await)
        }
        Endpoint::Models => {
            let workers: Vec<Arc<Worker>> = gw
                .registry
                .load()
                .workers
                .iter()
                .filter(|w| gw.registry.loads.is_eligible(w.id))
                .cloned()
                .collect();
            let results = fan_out(core, workers, "GET", "/v1/models", Duration::from_secs(5)).await;
            let mut data: Vec<Value> = Vec::new();
            let mut answered = 0;
            for (_, r) in results {
                let Ok((200, body)) = r else { continue };
                let Ok(v) = serde_json::from_slice::<Value>(&body) else {
                    continue;
                };
                answered += 1;
                for card in v
                    .get("data")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let id = card.get("id");
                    if !data.iter().any(|c| c.get("id") == id) {
                        data.push(card.clone());
                    }
                }
            }
            if answered == 0 && !gw.registry.load().is_empty() {
                return (
                    503,
                    reply_error(
                        stream,
                        head,
                        503,
                        "service_unavailable",
                        "no worker answered /v1/models",
                    )
                    .await,
                );
            }
            (
                200,
                send(stream, head, 200, &json!({"object": "list", "data": data})).await,
            )
        }
        Endpoint::ServerInfo => {
            // An owned Arc, not a guard: it lives across the response write.
            let list = gw.registry.load_full();
            let workers: Vec<Value> = list.workers.iter().map(|w| worker_json(core, w)).collect();
            let body = json!({
                "router_manager": true,
                "gateway": "radixgate",
                "version": env!("CARGO_PKG_VERSION"),
                "io_driver": gw.io_driver,
                "cores": gw.cores,
                "config": gw.config_json(),
                "workers": workers,
                "tree": gw.tree.as_ref().map(|t| {
                    let s = t.stats();
                    json!({"nodes": s.nodes(), "chars": s.chars(), "epoch": s.epoch(), "dropped_inserts": s.dropped(), "evicted_chars": s.evicted_chars()})
                }),
            });
            (200, send(stream, head, 200, &body).await)
        }
        Endpoint::ListWorkers | Endpoint::LegacyList => {
            // An owned Arc, not a guard: it lives across the response write.
            let list = gw.registry.load_full();
            let workers: Vec<Value> = list.workers.iter().map(|w| worker_json(core, w)).collect();
            let body = if ep == Endpoint::LegacyList {
                json!({"urls": list.workers.iter().map(|w| w.url.clone()).collect::<Vec<_>>()})
            } else {
                json!({"workers": workers, "total": list.len()})
            };
            (200, send(stream, head, 200, &body).await)
        }
        Endpoint::GetWorker => {
            let id = worker_path_id(head);
            let list = gw.registry.load_full();
            let found = list
                .workers
                .iter()
                .find(|w| w.id.to_string() == id || w.url == id)
                .cloned();
            match found {
                Some(w) => (200, send(stream, head, 200, &worker_json(core, &w)).await),
                None => (
                    404,
                    reply_error(
                        stream,
                        head,
                        404,
                        "not_found_error",
                        &format!("no worker {id}"),
                    )
                    .await,
                ),
            }
        }
        Endpoint::AddWorker | Endpoint::LegacyAdd => {
            let url = if ep == Endpoint::LegacyAdd {
                query_param(head, "url")
            } else {
                serde_json::from_slice::<Value>(&body)
                    .ok()
                    .and_then(|v| v.get("url").and_then(Value::as_str).map(str::to_string))
            };
            let Some(url) = url else {
                return (
                    400,
                    reply_error(
                        stream,
                        head,
                        400,
                        "invalid_request_error",
                        "a worker `url` is required",
                    )
                    .await,
                );
            };
            match gw.add_worker(core, &url).await {
                Ok(w) => {
                    let status = if ep == Endpoint::LegacyAdd { 200 } else { 202 };
                    (
                        status,
                        send(stream, head, status, &worker_json(core, &w)).await,
                    )
                }
                Err(RegistryError::Duplicate(u)) => (
                    409,
                    reply_error(
                        stream,
                        head,
                        409,
                        "conflict",
                        &format!("worker {u} is already registered"),
                    )
                    .await,
                ),
                Err(e) => (
                    400,
                    reply_error(stream, head, 400, "invalid_request_error", &e.to_string()).await,
                ),
            }
        }
        Endpoint::DeleteWorker | Endpoint::LegacyRemove => {
            let key = if ep == Endpoint::LegacyRemove {
                query_param(head, "url").unwrap_or_default()
            } else {
                worker_path_id(head)
            };
            match gw.remove_worker(&key) {
                Ok(w) => {
                    let status = if ep == Endpoint::LegacyRemove {
                        200
                    } else {
                        202
                    };
                    (status, send(stream, head, status, &json!({"removed": w.url, "id": w.id.to_string(), "in_flight": gw.registry.loads.load(w.id)})).await)
                }
                Err(e) => (
                    404,
                    reply_error(stream, head, 404, "not_found_error", &e.to_string()).await,
                ),
            }
        }
        Endpoint::FlushCache => {
            let workers = gw.registry.load().workers.clone();
            let results = fan_out(
                core,
                workers,
                "POST",
                "/flush_cache",
                Duration::from_secs(10),
            )
            .await;
            let total = results.len();
            let ok = results
                .iter()
                .filter(|(_, r)| matches!(r, Ok((200, _))))
                .count();
            let status = if ok == total { 200 } else { 206 };
            let details: Vec<Value> = results
                .iter()
                .map(|(w, r)| match r {
                    Ok((s, b)) => {
                        json!({"worker": w.url, "status": s, "body": String::from_utf8_lossy(b)})
                    }
                    Err(e) => json!({"worker": w.url, "error": e}),
                })
                .collect();
            (
                status,
                send(
                    stream,
                    head,
                    status,
                    &json!({"flushed": ok, "total": total, "workers": details}),
                )
                .await,
            )
        }
        Endpoint::GetLoads => {
            let workers = gw.registry.load().workers.clone();
            let results = fan_out(core, workers, "GET", "/get_load", Duration::from_secs(5)).await;
            let loads: Vec<Value> = results
                .iter()
                .map(|(w, r)| {
                    let load = match r {
                        Ok((200, b)) => serde_json::from_slice::<Value>(b).unwrap_or(Value::Null),
                        _ => Value::Null,
                    };
                    json!({"worker": w.url, "load": load, "gateway_in_flight": gw.registry.loads.load(w.id)})
                })
                .collect();
            (
                200,
                send(stream, head, 200, &json!({"workers": loads})).await,
            )
        }
    }
}

fn worker_path_id(head: &RequestHead) -> String {
    let p = head.path();
    percent_decode(p.strip_prefix(b"/workers/").unwrap_or(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_and_methods() {
        assert_eq!(endpoint(b"GET", b"/health"), Some(Ok(Endpoint::Health)));
        assert_eq!(endpoint(b"POST", b"/health"), Some(Err(())));
        assert_eq!(
            endpoint(b"DELETE", b"/workers/3"),
            Some(Ok(Endpoint::DeleteWorker))
        );
        assert_eq!(endpoint(b"GET", b"/workers/"), None);
        assert_eq!(endpoint(b"GET", b"/other"), None);
    }

    #[test]
    fn percent_decoding() {
        assert_eq!(
            percent_decode(b"http%3A%2F%2F127.0.0.1%3A1"),
            "http://127.0.0.1:1"
        );
        assert_eq!(percent_decode(b"a+b%zz%"), "a b%zz%");
    }
}
