//! Endpoints the gateway answers itself: liveness/readiness, `/v1/models` merged from the
//! workers, `/get_server_info`, worker management (`/workers`, and the legacy `/add_worker`,
//! `/remove_worker`, `/list_workers` that scripts still call), the `/flush_cache` and
//! `/get_loads` fan-outs, and `/engine_metrics` (the telemetry thread's last merge). Each
//! endpoint is one function returning a [`Reply`] or a [`GatewayError`]; [`handle`] checks the
//! key and writes whichever comes back.

mod abort;
mod fanout;
mod info;
mod kv;
mod workers;

pub use self::workers::worker_json;

use super::error::GatewayError;
use super::reply::{self, send_error, Reply};
use super::Outcome;
use crate::gateway::Core;
use crate::http::{Method, RequestHead};
use bytes::Bytes;
use monoio::net::TcpStream;
use std::rc::Rc;

/// A gateway-local endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `GET /health`, `/liveness`.
    Health,
    /// `GET /readiness`.
    Readiness,
    /// `GET /v1/models`.
    Models,
    /// `GET /get_server_info`, `/server_info`.
    ServerInfo,
    /// `GET /workers`.
    ListWorkers,
    /// `POST /workers`.
    AddWorker,
    /// `GET /workers/{id or url}`.
    GetWorker,
    /// `DELETE /workers/{id or url}`.
    DeleteWorker,
    /// `POST /add_worker?url=`.
    LegacyAdd,
    /// `POST|DELETE /remove_worker?url=`.
    LegacyRemove,
    /// `GET /list_workers`.
    LegacyList,
    /// `POST|GET /flush_cache`.
    FlushCache,
    /// `GET /get_loads`.
    GetLoads,
    /// `GET /kv_index/snapshot`: the KV-event index for a sibling copy (`--kv-bootstrap-peer`).
    KvSnapshot,
    /// `GET /engine_metrics`: the workers' own metrics, merged, from the last scrape.
    EngineMetrics,
    /// `POST /abort_request`: forwarded to the worker holding the request (inference key).
    AbortRequest,
}

impl Endpoint {
    /// Changes the worker set (where traffic goes): from other hosts only with
    /// `--admin-api-key` configured.
    pub fn changes_workers(self) -> bool {
        matches!(
            self,
            Endpoint::AddWorker
                | Endpoint::DeleteWorker
                | Endpoint::LegacyAdd
                | Endpoint::LegacyRemove
        )
    }

    /// Changes where traffic goes or drops what the servers cached: the admin key itself (see
    /// `gateway::auth`).
    pub fn is_control(self) -> bool {
        self.changes_workers() || self == Endpoint::FlushCache
    }

    /// Worker management, cache control, and the reads that name workers (need the admin key
    /// when one is set).
    pub fn is_admin(self) -> bool {
        self.changes_workers()
            || matches!(
                self,
                Endpoint::FlushCache
                    | Endpoint::ListWorkers
                    | Endpoint::GetWorker
                    | Endpoint::LegacyList
                    | Endpoint::GetLoads
                    | Endpoint::KvSnapshot
                    // Names every worker's address (internal topology), as /workers does.
                    | Endpoint::EngineMetrics
            )
    }
}

/// The local endpoint for a method and path: `None` when the path is not local,
/// `Some(Err(()))` when the path is local but the method is wrong.
pub fn endpoint(method: Method, path: &[u8]) -> Option<Result<Endpoint, ()>> {
    let m = |ok: bool, e: Endpoint| Some(if ok { Ok(e) } else { Err(()) });
    let get = method == Method::Get;
    let post = method == Method::Post;
    match path {
        b"/health" | b"/liveness" => m(get, Endpoint::Health),
        b"/readiness" => m(get, Endpoint::Readiness),
        b"/v1/models" => m(get, Endpoint::Models),
        b"/get_server_info" | b"/server_info" => m(get, Endpoint::ServerInfo),
        b"/workers" => match method {
            Method::Get => Some(Ok(Endpoint::ListWorkers)),
            Method::Post => Some(Ok(Endpoint::AddWorker)),
            _ => Some(Err(())),
        },
        b"/add_worker" => m(post, Endpoint::LegacyAdd),
        b"/remove_worker" => m(post || method == Method::Delete, Endpoint::LegacyRemove),
        b"/list_workers" => m(get, Endpoint::LegacyList),
        b"/flush_cache" => m(post || get, Endpoint::FlushCache),
        b"/get_loads" => m(get, Endpoint::GetLoads),
        b"/kv_index/snapshot" => m(get, Endpoint::KvSnapshot),
        b"/engine_metrics" => m(get, Endpoint::EngineMetrics),
        b"/abort_request" => m(post, Endpoint::AbortRequest),
        p if p.starts_with(b"/workers/") && p.len() > b"/workers/".len() => match method {
            Method::Get => Some(Ok(Endpoint::GetWorker)),
            Method::Delete => Some(Ok(Endpoint::DeleteWorker)),
            _ => Some(Err(())),
        },
        _ => None,
    }
}

/// Answer a local endpoint.
pub async fn handle(
    core: &Rc<Core>,
    stream: &mut TcpStream,
    head: &RequestHead,
    body: Bytes,
    ep: Endpoint,
) -> Outcome {
    let peer = stream.peer_addr().ok().map(|a| a.ip());
    match answer(core, head, &body, ep, peer).await {
        Ok(r) => reply::send(stream, &r, None, head.keep_alive, false).await,
        Err(e) => send_error(stream, Some(head), &e, None).await,
    }
}

async fn answer(
    core: &Rc<Core>,
    head: &RequestHead,
    body: &Bytes,
    ep: Endpoint,
    peer: Option<std::net::IpAddr>,
) -> Result<Reply, GatewayError> {
    let gw = &core.gw;
    // Keys (and the keyless local mode) were checked on the head (`conn::decide`,
    // `Route::scope`).
    match ep {
        Endpoint::Health => Ok(info::health()),
        Endpoint::Readiness => Ok(info::readiness(gw)),
        Endpoint::ServerInfo => Ok(info::server_info(gw)),
        Endpoint::Models => fanout::models(core).await,
        Endpoint::FlushCache => Ok(fanout::flush_cache(core).await),
        Endpoint::GetLoads => Ok(fanout::loads(core).await),
        Endpoint::KvSnapshot => kv::snapshot(gw).await,
        Endpoint::EngineMetrics => info::engine_metrics(gw),
        Endpoint::AbortRequest => abort::abort(core, head, body, peer).await,
        Endpoint::ListWorkers => Ok(workers::list(gw)),
        Endpoint::LegacyList => Ok(workers::legacy_list(gw)),
        Endpoint::GetWorker => workers::get(gw, head),
        Endpoint::AddWorker => workers::add(core, workers::add_from_json(body), 202).await,
        Endpoint::LegacyAdd => workers::add(core, workers::add_from_query(head), 200).await,
        Endpoint::DeleteWorker => workers::remove(gw, &workers::path_id(head), 202),
        Endpoint::LegacyRemove => {
            let key = workers::url_from_query(head).unwrap_or_default();
            workers::remove(gw, &key, 200)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_and_methods() {
        assert_eq!(
            endpoint(Method::Get, b"/health"),
            Some(Ok(Endpoint::Health))
        );
        assert_eq!(endpoint(Method::Post, b"/health"), Some(Err(())));
        assert_eq!(
            endpoint(Method::Delete, b"/workers/3"),
            Some(Ok(Endpoint::DeleteWorker))
        );
        assert_eq!(endpoint(Method::Get, b"/workers/"), None);
        assert_eq!(endpoint(Method::Get, b"/other"), None);
    }

    #[test]
    fn the_admin_list_is_exactly_management_and_cache_control() {
        let admin = [
            Endpoint::ListWorkers,
            Endpoint::AddWorker,
            Endpoint::GetWorker,
            Endpoint::DeleteWorker,
            Endpoint::LegacyAdd,
            Endpoint::LegacyRemove,
            Endpoint::LegacyList,
            Endpoint::FlushCache,
            Endpoint::GetLoads,
            Endpoint::KvSnapshot,
            Endpoint::EngineMetrics,
        ];
        let public = [
            Endpoint::Health,
            Endpoint::Readiness,
            Endpoint::Models,
            Endpoint::ServerInfo,
        ];
        assert!(admin.iter().all(|e| e.is_admin()));
        assert!(public.iter().all(|e| !e.is_admin()));
    }
}
