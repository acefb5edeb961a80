//! Worker management: list, describe, add (probed once so it is routable at once), remove.

use crate::gateway::{Core, Gateway};
use crate::http::RequestHead;
use crate::serve::error::GatewayError;
use crate::serve::reply::Reply;
use crate::workers::registry::{RegistryError, Worker};
use crate::workers::role::{Role, RoleError};
use bytes::{Bytes, BytesMut};
use serde_json::{json, Value};

/// Describe a worker for the management API.
pub fn worker_json(gw: &Gateway, w: &Worker) -> Value {
    json!({
        "id": w.id.to_string(),
        "url": w.url,
        "worker_type": w.role.as_str(),
        "bootstrap_port": match w.role {
            Role::Prefill { bootstrap_port } => json!(bootstrap_port),
            _ => Value::Null,
        },
        "healthy": w.is_healthy(),
        "draining": w.is_draining(),
        "held": w.is_held(),
        "circuit": w.breaker.state().as_str(),
        "in_flight": gw.registry.loads.in_flight(w.id),
        "external_load": gw.registry.loads.external(w.id),
        "routing_load": gw.registry.loads.load(w.id),
        "completed": w.completed.load(std::sync::atomic::Ordering::Relaxed),
        "dp_rank": w.dp.map(|d| d.rank),
        "dp_size": w.dp.map(|d| d.size),
    })
}

/// `GET /workers`.
pub fn list(gw: &Gateway) -> Reply {
    let list = gw.registry.load();
    let workers: Vec<Value> = list.workers.iter().map(|w| worker_json(gw, w)).collect();
    Reply::json(200, &json!({"workers": workers, "total": list.len()}))
}

/// `GET /list_workers` (legacy): the URLs only.
pub fn legacy_list(gw: &Gateway) -> Reply {
    let list = gw.registry.load();
    let urls: Vec<&str> = list.workers.iter().map(|w| w.url.as_str()).collect();
    Reply::json(200, &json!({ "urls": urls }))
}

/// `GET /workers/{id or url}`.
pub fn get(gw: &Gateway, head: &RequestHead) -> Result<Reply, GatewayError> {
    let id = path_id(head);
    let list = gw.registry.load();
    let found = list
        .workers
        .iter()
        .find(|w| w.id.to_string() == id || w.url == id);
    match found {
        Some(w) => Ok(Reply::json(200, &worker_json(gw, w))),
        None => Err(GatewayError::not_found(format!("no worker {id}"))),
    }
}

/// What an add call asks for: the worker's URL and its role (`worker_type` and
/// `bootstrap_port`, named as the reference names them; default: a regular worker).
pub struct AddRequest {
    /// The worker's base URL.
    pub url: Option<String>,
    /// Its role, or why the role fields were refused.
    pub role: Result<Role, RoleRefused>,
}

/// Why an add call's role fields were refused: answered 400 with its text (the call names the
/// field at fault, so the operator can fix it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoleRefused {
    /// A JSON body's `bootstrap_port` that is neither a port number nor null.
    BodyPort,
    /// A `bootstrap_port` query parameter that is not a port number (as given).
    QueryPort(String),
    /// The port is a port, but the role refuses it, or `worker_type` names no role.
    Role(RoleError),
}

impl std::fmt::Display for RoleRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RoleRefused::BodyPort => f.write_str("`bootstrap_port` must be a port number or null"),
            RoleRefused::QueryPort(p) => write!(f, "bootstrap_port `{p}` is not a port number"),
            RoleRefused::Role(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for RoleRefused {}

/// `POST /workers` (`created` 202) and `POST /add_worker?url=` (`created` 200).
pub async fn add(core: &Core, req: AddRequest, created: u16) -> Result<Reply, GatewayError> {
    let url = req
        .url
        .ok_or_else(|| GatewayError::bad_request("a worker `url` is required"))?;
    let role = req
        .role
        .map_err(|e| GatewayError::bad_request(e.to_string()))?;
    match core.gw.register_worker(&core.pool, &url, role).await {
        Ok(added) => {
            let Some(w) = added.first() else {
                return Err(GatewayError::internal("no worker was added"));
            };
            let mut body = worker_json(&core.gw, w);
            if w.dp.is_some() {
                body["ranks"] = json!(added.iter().map(|w| w.url.as_str()).collect::<Vec<_>>());
            }
            Ok(Reply::json(created, &body))
        }
        Err(RegistryError::Duplicate(u)) => Err(GatewayError::conflict(format!(
            "worker {u} is already registered"
        ))),
        Err(e) => Err(GatewayError::bad_request(e.to_string())),
    }
}

/// `DELETE /workers/{id or url}` (`removed` 202) and `/remove_worker?url=` (`removed` 200).
pub fn remove(gw: &Gateway, key: &str, removed: u16) -> Result<Reply, GatewayError> {
    let gone = gw
        .remove_worker(key)
        .map_err(|e| GatewayError::not_found(e.to_string()))?;
    let Some(w) = gone.first() else {
        return Err(GatewayError::not_found(format!("no worker {key}")));
    };
    let in_flight: u32 = gone.iter().map(|w| gw.registry.loads.in_flight(w.id)).sum();
    let mut body = json!({"removed": w.server_url, "id": w.id.to_string(), "in_flight": in_flight});
    if w.dp.is_some() {
        body["ranks"] = json!(gone.iter().map(|w| w.url.as_str()).collect::<Vec<_>>());
    }
    Ok(Reply::json(removed, &body))
}

/// The `url`, `worker_type` and `bootstrap_port` fields of a JSON body.
pub fn add_from_json(body: &Bytes) -> AddRequest {
    let v = serde_json::from_slice::<Value>(body).unwrap_or(Value::Null);
    let url = v.get("url").and_then(Value::as_str).map(str::to_string);
    let kind = v.get("worker_type").and_then(Value::as_str);
    let port = match v.get("bootstrap_port") {
        None | Some(Value::Null) => Ok(None),
        Some(p) => p
            .as_u64()
            .and_then(|n| u16::try_from(n).ok())
            .filter(|&n| n > 0)
            .map(Some)
            .ok_or(RoleRefused::BodyPort),
    };
    AddRequest {
        url,
        role: port
            .and_then(|p| Role::parse(kind.unwrap_or("regular"), p).map_err(RoleRefused::Role)),
    }
}

/// The `url`, `worker_type` and `bootstrap_port` query parameters (legacy calls).
pub fn add_from_query(head: &RequestHead) -> AddRequest {
    let kind = query_param(head, "worker_type");
    let port = match query_param(head, "bootstrap_port").as_deref() {
        None | Some("") | Some("none") | Some("null") => Ok(None),
        Some(p) => p
            .parse::<u16>()
            .ok()
            .filter(|&n| n > 0)
            .map(Some)
            .ok_or_else(|| RoleRefused::QueryPort(p.to_string())),
    };
    AddRequest {
        url: url_from_query(head),
        role: port.and_then(|p| {
            Role::parse(kind.as_deref().unwrap_or("regular"), p).map_err(RoleRefused::Role)
        }),
    }
}

/// The `url` query parameter (legacy calls).
pub fn url_from_query(head: &RequestHead) -> Option<String> {
    query_param(head, "url")
}

/// The `{id or url}` of `/workers/{…}`, percent-decoded.
pub fn path_id(head: &RequestHead) -> String {
    let p = head.path();
    percent_decode(p.strip_prefix(b"/workers/").unwrap_or(p))
}

fn query_param(head: &RequestHead, name: &str) -> Option<String> {
    let q = head.query()?;
    q.split(|&b| b == b'&').find_map(|pair| {
        let (k, v) = match pair.iter().position(|&b| b == b'=') {
            Some(i) => (&pair[..i], &pair[i + 1..]),
            None => (pair, &b""[..]),
        };
        (k == name.as_bytes()).then(|| percent_decode(v))
    })
}

fn percent_decode(v: &[u8]) -> String {
    let mut out = BytesMut::with_capacity(v.len());
    let mut i = 0;
    while i < v.len() {
        let hex = (v[i] == b'%' && i + 2 < v.len())
            .then(|| std::str::from_utf8(&v[i + 1..i + 3]).ok())
            .flatten()
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (v[i], hex) {
            (_, Some(b)) => {
                out.extend_from_slice(&[b]);
                i += 3;
                continue;
            }
            (b'+', None) => out.extend_from_slice(b" "),
            (b, None) => out.extend_from_slice(&[b]),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_decoding() {
        assert_eq!(
            percent_decode(b"http%3A%2F%2F127.0.0.1%3A1"),
            "http://127.0.0.1:1"
        );
        assert_eq!(percent_decode(b"a+b%zz%"), "a b%zz%");
        assert_eq!(percent_decode(b"%41%"), "A%");
    }
}
