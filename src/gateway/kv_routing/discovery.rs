//! Finding each worker's publishers (flags, else its `/get_server_info`) and keeping the
//! subscriptions in step with the registry.

use super::super::Gateway;
use super::*;
use crate::base::WorkerId;
use crate::http::Method;
use crate::kv::endpoint::{KvEndpoints, TcpEndpoint};
use crate::kv::index::Source;
use crate::kv::intake::{CommandError, Publisher};
use crate::proxy::forward;
use crate::proxy::pool::Pool;
use crate::workers::registry::{Worker, WorkerList};
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a worker's `/get_server_info` says about its events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerKvInfo {
    /// The model its events are about (`served_model_name`, else `model_path`).
    pub model: Option<String>,
    /// The rank-0 publisher, on the worker's own host (None: events off).
    pub live: Option<TcpEndpoint>,
    /// The rank-0 replay socket, on the worker's own host.
    pub replay: Option<TcpEndpoint>,
    /// Publishers (DP ranks), each on port + rank.
    pub ranks: u32,
    /// The block size the server hashes its events at (its page size), when it says.
    pub block_size: Option<u32>,
}

/// Read `/get_server_info`. SGLang 0.5.23 describes its publisher under `kv_events`
/// (`endpoint_port_base`, `replay_endpoint_port_base`, `dp_size` publishers, `block_size`);
/// older servers only echo their `kv_events_config` argument (a JSON string, or an object),
/// with one publisher per attention-DP rank. Endpoints other than `tcp://` (ipc, inproc)
/// cannot be reached from another host and count as "no events". Whatever host a server names,
/// its publishers are dialled on the worker's own host: a worker cannot point the gateway's
/// connections elsewhere (only `--kv-events-endpoints` can).
pub fn parse_server_info(body: &[u8], worker_url: &str) -> Result<ServerKvInfo, String> {
    let v: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("server info is not JSON: {e}"))?;
    let model = ["served_model_name", "model_path"]
        .iter()
        .find_map(|k| v.get(*k)?.as_str().filter(|s| !s.is_empty()))
        .map(str::to_owned);
    let host = crate::kv::endpoint::url_host(worker_url)
        .ok_or_else(|| format!("worker URL {worker_url} has no host"))?;
    let at = |port: u16| TcpEndpoint {
        host: host.to_string(),
        port,
    };
    let port_of = |d: &serde_json::Value, k: &str| -> Result<Option<u16>, String> {
        match d.get(k) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(p) => p
                .as_u64()
                .and_then(|p| u16::try_from(p).ok())
                .filter(|&p| p > 0)
                .map(Some)
                .ok_or_else(|| format!("kv_events.{k} is not a port")),
        }
    };
    if let Some(d) = v.get("kv_events").filter(|d| d.is_object()) {
        let zmq = d.get("publisher").and_then(|p| p.as_str()) == Some("zmq");
        let live = if zmq {
            port_of(d, "endpoint_port_base")?.map(at)
        } else {
            None
        };
        let replay = match live {
            Some(_) => port_of(d, "replay_endpoint_port_base")?.map(at),
            None => None,
        };
        let ranks = d
            .get("dp_size")
            .and_then(|n| n.as_u64())
            .unwrap_or(1)
            .max(1);
        let block_size = d
            .get("block_size")
            .and_then(|b| b.as_u64())
            .and_then(|b| u32::try_from(b).ok())
            .filter(|&b| b > 0);
        return Ok(ServerKvInfo {
            model,
            live,
            replay,
            ranks: u32::try_from(ranks).unwrap_or(u32::MAX),
            block_size,
        });
    }
    let dp_attention = v
        .get("enable_dp_attention")
        .and_then(|b| b.as_bool())
        .unwrap_or(false);
    let dp_size = v.get("dp_size").and_then(|d| d.as_u64()).unwrap_or(1);
    let ranks = if dp_attention {
        u32::try_from(dp_size.max(1)).unwrap_or(u32::MAX)
    } else {
        1
    };
    let cfg = match v.get("kv_events_config") {
        Some(serde_json::Value::String(s)) => serde_json::from_str::<serde_json::Value>(s)
            .map_err(|e| format!("kv_events_config is not JSON: {e}"))?,
        Some(o @ serde_json::Value::Object(_)) => o.clone(),
        _ => serde_json::Value::Null,
    };
    let publisher = cfg.get("publisher").and_then(|p| p.as_str()).unwrap_or("");
    let endpoint = |k: &str| -> Result<Option<TcpEndpoint>, String> {
        match cfg.get(k).and_then(|e| e.as_str()) {
            Some(e) if e.starts_with("tcp://") => Ok(Some(at(TcpEndpoint::parse(e)?.port))),
            _ => Ok(None),
        }
    };
    let (live, replay) = if publisher == "zmq" {
        let live = endpoint("endpoint")?;
        let replay = if live.is_some() {
            endpoint("replay_endpoint")?
        } else {
            None
        };
        (live, replay)
    } else {
        (None, None)
    };
    let block_size = v
        .get("page_size")
        .and_then(|b| b.as_u64())
        .and_then(|b| u32::try_from(b).ok())
        .filter(|&b| b > 0);
    Ok(ServerKvInfo {
        model,
        live,
        replay,
        ranks,
        block_size,
    })
}

/// Per worker (by serial): subscribed, or when to try again.
#[derive(Debug)]
enum Found {
    /// `replay`: with a replay endpoint (its start-up replay is waited for).
    Subscribed {
        id: WorkerId,
        replay: bool,
    },
    Retry {
        at: Instant,
        attempts: u32,
    },
}

/// Keeps the subscriptions in step with the registry; runs on the health thread each tick.
#[derive(Debug, Default)]
pub struct Discovery {
    found: HashMap<u64, Found>,
}

/// Longest wait between attempts to read a worker's publishers.
const RETRY_MAX: Duration = Duration::from_secs(5);
/// Time allowed for `/get_server_info`.
const INFO_TIMEOUT: Duration = Duration::from_secs(5);

impl Discovery {
    /// One round: drop the publishers of workers gone from `list`, find those of new ones.
    pub async fn round(&mut self, gw: &Gateway, kv: &KvRouting, pool: &Pool, list: &WorkerList) {
        if !kv.bootstrapped.load(Ordering::Acquire) {
            return; // Subscriptions resume after the sibling's watermarks: wait for its copy.
        }
        let gone: Vec<(u64, WorkerId)> = self
            .found
            .iter()
            .filter(|(serial, _)| !list.workers.iter().any(|w| w.serial == **serial))
            .filter_map(|(s, f)| match f {
                Found::Subscribed { id, .. } => Some((*s, *id)),
                Found::Retry { .. } => None,
            })
            .collect();
        for (serial, id) in gone {
            match kv.intake.remove_worker(id) {
                Ok(()) | Err(CommandError::Stopped) => {
                    kv.set_model(id, None);
                    kv.pending.forget_worker(id);
                    self.found.remove(&serial);
                }
                Err(CommandError::Busy) => {} // Next round.
            }
        }
        self.found.retain(|serial, f| {
            matches!(f, Found::Subscribed { .. })
                || list.workers.iter().any(|w| w.serial == *serial)
        });
        let now = Instant::now();
        for w in &list.workers {
            let due = match self.found.get(&w.serial) {
                None => true,
                Some(Found::Retry { at, .. }) => *at <= now,
                Some(Found::Subscribed { .. }) => false,
            };
            if !due {
                continue;
            }
            let outcome = self.discover(gw, kv, pool, w).await;
            let attempts = match self.found.get(&w.serial) {
                Some(Found::Retry { attempts, .. }) => *attempts + 1,
                _ => 1,
            };
            match outcome {
                Ok(replay) => {
                    self.found
                        .insert(w.serial, Found::Subscribed { id: w.id, replay });
                }
                Err(why) => {
                    if attempts == 1 || attempts % 12 == 0 {
                        crate::log!(Warn, "kv events: worker {}: {why}", w.url);
                    }
                    let wait = Duration::from_secs(u64::from(attempts)).min(RETRY_MAX);
                    self.found.insert(
                        w.serial,
                        Found::Retry {
                            at: now + wait,
                            attempts,
                        },
                    );
                }
            }
        }
        let mut replaying: Vec<WorkerId> = self
            .found
            .values()
            .filter_map(|f| match f {
                Found::Subscribed { id, replay: true } => Some(*id),
                _ => None,
            })
            .collect();
        replaying.sort_unstable();
        replaying.dedup();
        if **kv.replaying.load() != replaying {
            kv.replaying.store(Arc::new(replaying));
        }
        kv.discovered.store(true, Ordering::Release);
    }

    /// Find `w`'s publishers (flags first, else its `/get_server_info`) and subscribe. Returns
    /// whether they have a replay endpoint.
    async fn discover(
        &self,
        gw: &Gateway,
        kv: &KvRouting,
        pool: &Pool,
        w: &Arc<Worker>,
    ) -> Result<bool, String> {
        let info = forward::fetch(
            pool,
            w,
            Method::Get,
            "/get_server_info",
            Bytes::new(),
            INFO_TIMEOUT,
        )
        .await;
        let info = match info {
            Ok((200, body)) => parse_server_info(&body, &w.server_url),
            Ok((status, _)) => Err(format!("/get_server_info answered {status}")),
            Err(e) => Err(format!("/get_server_info: {e:?}")),
        };
        let flagged = kv.flagged.iter().find(|f| f.worker_url == w.server_url);
        let (live, replay, ranks, model, block_size) = match (flagged, info) {
            (Some(f), Ok(i)) => (
                f.live.clone(),
                f.replay.clone(),
                i.ranks,
                i.model,
                i.block_size,
            ),
            // Flags need nothing from the server but its model (one rank, the served model).
            (Some(f), Err(_)) => {
                let served = gw.models_of(w.id);
                if served.is_none() {
                    return Err("waiting for the worker's model name".into());
                }
                (f.live.clone(), f.replay.clone(), 1, served, None)
            }
            (None, Ok(i)) => match i.live {
                Some(live) => (live, i.replay, i.ranks, i.model, i.block_size),
                None => {
                    return Err(
                        "publishes no KV events (no zmq tcp endpoint in kv_events_config); \
                         scored by the text tree"
                            .into(),
                    )
                }
            },
            (None, Err(e)) => {
                kv.intake.count_discovery_failed();
                return Err(e);
            }
        };
        if ranks > kv.max_ranks {
            kv.intake.count_refused();
            return Err(format!(
                "announces {ranks} KV-event publishers (DP ranks), over --kv-max-dp-ranks {}; \
                 scored by the text tree",
                kv.max_ranks
            ));
        }
        let model: Arc<str> = Arc::from(model.unwrap_or_else(|| "default".into()).as_str());
        kv.set_model(
            w.id,
            Some(WorkerKv {
                model,
                url: Arc::from(w.url.as_str()),
                block_size,
            }),
        );
        let has_replay = replay.is_some();
        let endpoints = KvEndpoints {
            worker_url: w.server_url.clone(),
            live,
            replay,
        };
        // With `--dp-aware` each rank is a routing target of its own: it subscribes to its own
        // rank's publisher only, so the index's holders are (worker, rank) targets.
        let mine = match w.dp {
            None => 0..ranks,
            Some(d) if d.rank < ranks => d.rank..d.rank + 1,
            Some(d) => {
                kv.intake.count_refused();
                return Err(format!(
                    "DP rank {} has no publisher of its own (the server reports {ranks}); \
                     scored by the text tree",
                    d.rank
                ));
            }
        };
        // Every rank's ports first: a worker is subscribed whole or not at all (never some
        // ranks, then an error retried for ever).
        let mut sockets = Vec::with_capacity(mine.len());
        for rank in mine {
            match endpoints.for_rank(rank) {
                Ok(s) => sockets.push((rank, s)),
                Err(e) => {
                    kv.intake.count_refused();
                    return Err(format!("{e}; scored by the text tree"));
                }
            }
        }
        for (rank, (live, replay)) in sockets {
            let publisher = Publisher {
                key: Source {
                    worker: w.id,
                    dp_rank: rank,
                },
                live,
                replay,
            };
            kv.intake
                .subscribe(publisher)
                .map_err(|e| format!("event thread {e:?}"))?;
        }
        Ok(has_replay)
    }
}
