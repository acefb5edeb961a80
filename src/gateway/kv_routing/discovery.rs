//! Finding each worker's publishers (flags, else what the server announces: SGLang's
//! `/get_server_info`, vLLM's `/kv_event_sources`) and keeping the subscriptions in step with
//! the registry.

use super::super::Gateway;
use super::sources::{parse_kv_event_sources, RankPublisher, SOURCES_PATH};
use super::*;
use crate::base::WorkerId;
use crate::http::Method;
use crate::kv::endpoint::TcpEndpoint;
use crate::kv::index::Source;
use crate::kv::intake::{CommandError, Publisher, SourceState};
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

/// Why a worker's `/get_server_info` could not be read: logged as the reason the worker's
/// events are not subscribed (discovery tries again later).
#[derive(Debug)]
pub enum ServerInfoError {
    /// The body is not JSON.
    NotJson(serde_json::Error),
    /// The worker's URL names no host to dial its publishers on.
    NoHost(String),
    /// A `kv_events` port field that is not a port (the field's name).
    NotAPort(&'static str),
    /// `kv_events_config` is a string that is not JSON.
    ConfigNotJson(serde_json::Error),
    /// A `tcp://` endpoint in `kv_events_config` that does not parse.
    Endpoint(String),
    /// vLLM's `/kv_event_sources` is not the object of ranks it should be (why).
    Sources(String),
    /// vLLM's `/kv_event_sources` names more ranks than `--kv-max-dp-ranks` (how many).
    TooManyRanks(usize),
}

impl std::fmt::Display for ServerInfoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServerInfoError::NotJson(e) => write!(f, "server info is not JSON: {e}"),
            ServerInfoError::NoHost(url) => write!(f, "worker URL {url} has no host"),
            ServerInfoError::NotAPort(k) => write!(f, "kv_events.{k} is not a port"),
            ServerInfoError::ConfigNotJson(e) => write!(f, "kv_events_config is not JSON: {e}"),
            ServerInfoError::Endpoint(e) => f.write_str(e),
            ServerInfoError::Sources(why) => write!(f, "kv_event_sources: {why}"),
            ServerInfoError::TooManyRanks(n) => {
                write!(
                    f,
                    "kv_event_sources names {n} ranks, over --kv-max-dp-ranks"
                )
            }
        }
    }
}

impl std::error::Error for ServerInfoError {}

/// Read `/get_server_info`. SGLang 0.5.23 describes its publisher under `kv_events`
/// (`endpoint_port_base`, `replay_endpoint_port_base`, `dp_size` publishers, `block_size`);
/// older servers only echo their `kv_events_config` argument (a JSON string, or an object),
/// with one publisher per attention-DP rank. Endpoints other than `tcp://` (ipc, inproc)
/// cannot be reached from another host and count as "no events". Whatever host a server names,
/// its publishers are dialled on the worker's own host: a worker cannot point the gateway's
/// connections elsewhere (only `--kv-events-endpoints` can).
pub fn parse_server_info(body: &[u8], worker_url: &str) -> Result<ServerKvInfo, ServerInfoError> {
    let v: serde_json::Value = serde_json::from_slice(body).map_err(ServerInfoError::NotJson)?;
    let model = ["served_model_name", "model_path"]
        .iter()
        .find_map(|k| v.get(*k)?.as_str().filter(|s| !s.is_empty()))
        .map(str::to_owned);
    let host = crate::kv::endpoint::url_host(worker_url)
        .ok_or_else(|| ServerInfoError::NoHost(worker_url.to_string()))?;
    match v.get("kv_events").filter(|d| d.is_object()) {
        Some(d) => described(d, host, model),
        None => from_arguments(&v, host, model),
    }
}

/// SGLang 0.5.23's `kv_events` descriptor: port bases, `dp_size` publishers, the block size.
fn described(
    d: &serde_json::Value,
    host: &str,
    model: Option<String>,
) -> Result<ServerKvInfo, ServerInfoError> {
    let zmq = d.get("publisher").and_then(|p| p.as_str()) == Some("zmq");
    let live = if zmq {
        port_of(d, "endpoint_port_base")?.map(|p| on_host(host, p))
    } else {
        None
    };
    let replay = match live {
        Some(_) => port_of(d, "replay_endpoint_port_base")?.map(|p| on_host(host, p)),
        None => None,
    };
    let ranks = d
        .get("dp_size")
        .and_then(|n| n.as_u64())
        .unwrap_or(1)
        .max(1);
    Ok(ServerKvInfo {
        model,
        live,
        replay,
        ranks: u32::try_from(ranks).unwrap_or(u32::MAX),
        block_size: positive_u32(d.get("block_size")),
    })
}

/// An older server's echo of its arguments: `kv_events_config`, one publisher per attention-DP
/// rank, the block size as its `page_size`.
fn from_arguments(
    v: &serde_json::Value,
    host: &str,
    model: Option<String>,
) -> Result<ServerKvInfo, ServerInfoError> {
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
        Some(serde_json::Value::String(s)) => {
            serde_json::from_str::<serde_json::Value>(s).map_err(ServerInfoError::ConfigNotJson)?
        }
        Some(o @ serde_json::Value::Object(_)) => o.clone(),
        _ => serde_json::Value::Null,
    };
    let (live, replay) = if cfg.get("publisher").and_then(|p| p.as_str()) == Some("zmq") {
        let live = config_endpoint(&cfg, "endpoint", host)?;
        let replay = if live.is_some() {
            config_endpoint(&cfg, "replay_endpoint", host)?
        } else {
            None
        };
        (live, replay)
    } else {
        (None, None)
    };
    Ok(ServerKvInfo {
        model,
        live,
        replay,
        ranks,
        block_size: positive_u32(v.get("page_size")),
    })
}

/// The port in descriptor field `k` (absent or null: none; 0 or out of range: refused).
fn port_of(d: &serde_json::Value, k: &'static str) -> Result<Option<u16>, ServerInfoError> {
    match d.get(k) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(p) => p
            .as_u64()
            .and_then(|p| u16::try_from(p).ok())
            .filter(|&p| p > 0)
            .map(Some)
            .ok_or(ServerInfoError::NotAPort(k)),
    }
}

/// The `tcp://` endpoint in `kv_events_config` field `k` (or a vLLM rank's `KVEventsConfig`),
/// moved to the worker's own host (absent, null or another scheme: none).
pub(super) fn config_endpoint(
    cfg: &serde_json::Value,
    k: &str,
    host: &str,
) -> Result<Option<TcpEndpoint>, ServerInfoError> {
    match cfg.get(k).and_then(|e| e.as_str()) {
        Some(e) if e.starts_with("tcp://") => {
            let port = TcpEndpoint::parse(e)
                .map_err(ServerInfoError::Endpoint)?
                .port;
            Ok(Some(on_host(host, port)))
        }
        _ => Ok(None),
    }
}

/// `port` on `host`: where a publisher is dialled, whatever host the server named.
fn on_host(host: &str, port: u16) -> TcpEndpoint {
    TcpEndpoint {
        host: host.to_string(),
        port,
    }
}

/// A number above 0 that fits in 32 bits (a block size), else none.
fn positive_u32(v: Option<&serde_json::Value>) -> Option<u32> {
    v.and_then(|b| b.as_u64())
        .and_then(|b| u32::try_from(b).ok())
        .filter(|&b| b > 0)
}

/// Per worker (by serial): subscribed, or when to try again.
#[derive(Debug)]
enum Found {
    /// `replay`: with a replay endpoint (its start-up replay is waited for). `announced`: what
    /// a vLLM server said at `/kv_event_sources` (its ranks and sockets change when it is
    /// restarted on `tcp://*:0` or scaled), and when it was last read.
    Subscribed {
        id: WorkerId,
        replay: bool,
        announced: Option<Arc<[RankPublisher]>>,
        read_at: Instant,
    },
    /// `holds`: the failure may clear within moments (no answer yet, the model not learnt
    /// yet), so a new copy's readiness waits for it, within `--kv-warm-timeout-secs`.
    Retry {
        id: WorkerId,
        at: Instant,
        attempts: u32,
        holds: bool,
    },
}

/// Keeps the subscriptions in step with the registry; runs on the health thread each tick.
#[derive(Debug, Default)]
pub struct Discovery {
    found: HashMap<u64, Found>,
}

/// Longest wait between attempts to read a worker's publishers.
const RETRY_MAX: Duration = Duration::from_secs(5);
/// How often a subscribed vLLM server's announcement is read again while all its publishers
/// are live (a scale-up adds ranks that nothing else would show).
const RECHECK_LIVE: Duration = Duration::from_secs(60);
/// How often while one of its publishers is not live (a server restarted on `tcp://*:0`
/// publishes on new ports; a rank scaled away never comes back).
const RECHECK_STALLED: Duration = RETRY_MAX;
/// First wait after the worker's model was not known yet: the health check that learns it
/// runs in the same tick, so the next tick usually finds it.
const MODEL_RETRY: Duration = Duration::from_millis(100);
/// Time allowed for `/get_server_info` and `/kv_event_sources`.
const INFO_TIMEOUT: Duration = Duration::from_secs(5);

impl Discovery {
    /// One round: drop the publishers of workers gone from `list`, find those of new ones.
    pub async fn round(&mut self, gw: &Gateway, kv: &KvRouting, pool: &Pool, list: &WorkerList) {
        if !kv.bootstrapped.load(Ordering::Acquire) {
            return; // Subscriptions resume after the sibling's watermarks: wait for its copy.
        }
        self.drop_gone(kv, list);
        self.recheck(kv, pool, list).await;
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
                Ok((replay, announced)) => {
                    self.found.insert(
                        w.serial,
                        Found::Subscribed {
                            id: w.id,
                            replay,
                            announced,
                            read_at: now,
                        },
                    );
                }
                Err(why) => {
                    // A model not learnt yet is the normal first look at a vLLM server (the
                    // health check learns it in the same tick): said only if it lasts.
                    let first = attempts == 1 && !matches!(why, DiscoverError::NoModel);
                    if first || attempts % 12 == 0 {
                        crate::log!(Warn, "kv events: worker {}: {why}", w.url);
                    }
                    let wait = match why {
                        DiscoverError::NoModel => MODEL_RETRY.saturating_mul(attempts),
                        _ => Duration::from_secs(u64::from(attempts)),
                    };
                    self.found.insert(
                        w.serial,
                        Found::Retry {
                            id: w.id,
                            at: now + wait.min(RETRY_MAX),
                            attempts,
                            holds: why.may_clear_soon(),
                        },
                    );
                }
            }
        }
        self.publish_waits(kv);
        kv.discovered.store(true, Ordering::Release);
    }

    /// Unsubscribe the workers gone from `list` (one the event thread is too busy for stays
    /// until the next round) and forget the retries of those gone.
    fn drop_gone(&mut self, kv: &KvRouting, list: &WorkerList) {
        let gone: Vec<(u64, WorkerId)> = self
            .found
            .iter()
            .filter(|(serial, _)| !list.workers.iter().any(|w| w.serial == **serial))
            .map(|(s, f)| match f {
                // A retry may follow a subscription that failed part-way: undone the same way.
                Found::Subscribed { id, .. } | Found::Retry { id, .. } => (*s, *id),
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
    }

    /// Read again the announcement of each subscribed vLLM server whose time has come (every
    /// [`RECHECK_LIVE`], or every [`RECHECK_STALLED`] while one of its publishers is not live),
    /// and start over with one whose ranks or sockets changed: its publishers are dropped (its
    /// blocks with them) and the next pass subscribes what it announces now, replaying each
    /// rank's buffer. An announcement that cannot be read leaves things as they are.
    async fn recheck(&mut self, kv: &KvRouting, pool: &Pool, list: &WorkerList) {
        let now = Instant::now();
        // Held across the awaits below: a full Arc, not a guard.
        let states = Arc::clone(&kv.source_states());
        for w in &list.workers {
            let Some(Found::Subscribed {
                id,
                announced: Some(before),
                read_at,
                ..
            }) = self.found.get(&w.serial)
            else {
                continue;
            };
            // Sorted by publisher: the worker's ranks are one run (thousands of workers are
            // not each a scan of every publisher).
            let from = states.partition_point(|(s, _)| s.worker < *id);
            let stalled = states[from..]
                .iter()
                .take_while(|(s, _)| s.worker == *id)
                .any(|(_, st)| !matches!(st, SourceState::Live | SourceState::Lagging));
            let wait = if stalled {
                RECHECK_STALLED
            } else {
                RECHECK_LIVE
            };
            if now < *read_at + wait {
                continue;
            }
            let (id, before) = (*id, before.clone());
            let changed = match fetch_sources(kv, pool, w).await {
                Ok(said) => *said != *before,
                Err(_) => false,
            };
            if changed {
                match kv.intake.remove_worker(id) {
                    Ok(()) | Err(CommandError::Stopped) => {
                        crate::log!(
                            Info,
                            "kv events: worker {}: its announced publishers changed; \
                             subscribing again",
                            w.url
                        );
                        kv.pending.forget_worker(id);
                        self.found.remove(&w.serial);
                        continue;
                    }
                    Err(CommandError::Busy) => {} // Next round.
                }
            }
            if let Some(Found::Subscribed { read_at, .. }) = self.found.get_mut(&w.serial) {
                *read_at = now;
            }
        }
    }

    /// Publish what a new copy's readiness waits for (when it changed): the workers whose
    /// start-up replay is awaited, and those whose publishers are not found yet for a reason
    /// that may clear within moments.
    fn publish_waits(&self, kv: &KvRouting) {
        let ids = |keep: fn(&Found) -> Option<WorkerId>| {
            let mut v: Vec<WorkerId> = self.found.values().filter_map(keep).collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        let replaying = ids(|f| match f {
            Found::Subscribed {
                id, replay: true, ..
            } => Some(*id),
            _ => None,
        });
        let undiscovered = ids(|f| match f {
            Found::Retry {
                id, holds: true, ..
            } => Some(*id),
            _ => None,
        });
        if **kv.replaying.load() != replaying {
            kv.replaying.store(Arc::new(replaying));
        }
        if **kv.undiscovered.load() != undiscovered {
            kv.undiscovered.store(Arc::new(undiscovered));
        }
    }

    /// Find `w`'s publishers (flags first, else what the server announces) and subscribe.
    /// Returns whether they have a replay endpoint, and a vLLM server's announcement when it
    /// is what was subscribed (to be read again later).
    async fn discover(
        &self,
        gw: &Gateway,
        kv: &KvRouting,
        pool: &Pool,
        w: &Arc<Worker>,
    ) -> Result<(bool, Option<Arc<[RankPublisher]>>), DiscoverError> {
        let announced = announcement(kv, pool, w).await;
        let found = publishers(gw, kv, w, announced)?;
        let ranks = found.layout.count();
        if ranks > kv.max_ranks {
            kv.intake.count_refused();
            return Err(DiscoverError::TooManyRanks {
                ranks: u64::from(ranks),
                max: kv.max_ranks,
            });
        }
        let model = found.model.unwrap_or_else(|| "default".into());
        kv.set_model(
            w.id,
            Some(WorkerKv {
                model: Arc::from(model.as_str()),
                url: Arc::from(w.url.as_str()),
                block_size: found.block_size,
            }),
        );
        let mine = own_sockets(kv, w, &found.layout)?;
        let has_replay = mine.iter().any(|(_, _, replay)| replay.is_some());
        subscribe(kv, w, mine)?;
        Ok((has_replay, found.announced))
    }
}

/// Why a worker's publishers were not subscribed: logged (the first time, then every 12th
/// retry) as the reason the worker is scored by the text tree meanwhile.
#[derive(Debug)]
enum DiscoverError {
    /// Its announcement did not read.
    Info(ServerInfoError),
    /// The announcement's path answered this status.
    Status { path: &'static str, status: u16 },
    /// The announcement got no answer.
    Fetch(forward::UpstreamError),
    /// The worker's model is not known yet (flagged publishers, or vLLM's announcement, which
    /// names none: both file the events under the model `/v1/models` reports).
    NoModel,
    /// The server publishes no events the gateway can reach.
    NoEvents,
    /// More publishers than `--kv-max-dp-ranks`.
    TooManyRanks { ranks: u64, max: u32 },
    /// A `--dp-aware` rank past the publishers the server reports.
    NoRankPublisher { rank: u32, ranks: u32 },
    /// A rank's ports do not exist (port + rank over 65535).
    Ports(String),
    /// The event thread did not take the subscription.
    EventThread(CommandError),
}

impl DiscoverError {
    /// Whether the failure may clear within moments, so that a new copy's readiness should
    /// wait for the worker: a server that has not answered yet, one that answered with a server
    /// error, a model the health check has not learnt yet, a busy event thread. What the server
    /// says about itself (no events, too many ranks, a malformed announcement) stays as it is
    /// until it restarts, and holds nothing back.
    fn may_clear_soon(&self) -> bool {
        match self {
            DiscoverError::Fetch(_) | DiscoverError::NoModel | DiscoverError::EventThread(_) => {
                true
            }
            DiscoverError::Status { status, .. } => *status >= 500,
            DiscoverError::Info(_)
            | DiscoverError::NoEvents
            | DiscoverError::TooManyRanks { .. }
            | DiscoverError::NoRankPublisher { .. }
            | DiscoverError::Ports(_) => false,
        }
    }
}

impl std::fmt::Display for DiscoverError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DiscoverError::Info(e) => write!(f, "{e}"),
            DiscoverError::Status { path, status } => write!(f, "{path} answered {status}"),
            DiscoverError::Fetch(e) => write!(f, "server info: {e:?}"),
            DiscoverError::NoModel => f.write_str("waiting for the worker's model name"),
            DiscoverError::NoEvents => f.write_str(
                "publishes no KV events (no zmq tcp endpoint in its kv-events config); \
                 scored by the text tree",
            ),
            DiscoverError::TooManyRanks { ranks, max } => write!(
                f,
                "announces {ranks} KV-event publishers (DP ranks), over --kv-max-dp-ranks {max}; \
                 scored by the text tree"
            ),
            DiscoverError::NoRankPublisher { rank, ranks } => write!(
                f,
                "DP rank {rank} has no publisher of its own (the server reports {ranks}); \
                 scored by the text tree"
            ),
            DiscoverError::Ports(e) => write!(f, "{e}; scored by the text tree"),
            DiscoverError::EventThread(e) => write!(f, "event thread {e:?}"),
        }
    }
}

/// What a server says about its publishers.
enum Announced {
    /// SGLang's `/get_server_info`.
    Sglang(ServerKvInfo),
    /// vLLM's `/kv_event_sources` (vLLM has no `/get_server_info`).
    Vllm(Vec<RankPublisher>),
}

/// How a worker's publishers sit over its DP ranks.
#[derive(Debug)]
enum Layout {
    /// SGLang's rule, and the flags': rank r publishes on the rank-0 ports plus r.
    Offset {
        live: TcpEndpoint,
        replay: Option<TcpEndpoint>,
        ranks: u32,
    },
    /// vLLM's announcement: each ready rank with its own sockets.
    Listed(Vec<RankPublisher>),
}

impl Layout {
    /// How many publishers.
    fn count(&self) -> u32 {
        match self {
            Layout::Offset { ranks, .. } => *ranks,
            Layout::Listed(list) => u32::try_from(list.len()).unwrap_or(u32::MAX),
        }
    }
}

/// What a worker's publishers are, once found.
struct Publishers {
    layout: Layout,
    model: Option<String>,
    block_size: Option<u32>,
    /// The vLLM announcement subscribed as it stands (no flags moved its sockets).
    announced: Option<Arc<[RankPublisher]>>,
}

/// What `w` announces: SGLang's `/get_server_info`, else (a 404: vLLM has none) vLLM's
/// `/kv_event_sources`.
async fn announcement(kv: &KvRouting, pool: &Pool, w: &Worker) -> Result<Announced, DiscoverError> {
    const SERVER_INFO: &str = "/get_server_info";
    let info = forward::fetch(
        pool,
        w,
        Method::Get,
        SERVER_INFO,
        Bytes::new(),
        INFO_TIMEOUT,
    );
    match info.await {
        Ok((200, body)) => parse_server_info(&body, &w.server_url)
            .map(Announced::Sglang)
            .map_err(DiscoverError::Info),
        Ok((404, _)) => fetch_sources(kv, pool, w).await.map(Announced::Vllm),
        Ok((status, _)) => Err(DiscoverError::Status {
            path: SERVER_INFO,
            status,
        }),
        Err(e) => Err(DiscoverError::Fetch(e)),
    }
}

/// `w`'s `/kv_event_sources`, read (a count of ranks over the bound is counted as refused).
async fn fetch_sources(
    kv: &KvRouting,
    pool: &Pool,
    w: &Worker,
) -> Result<Vec<RankPublisher>, DiscoverError> {
    let got = forward::fetch(
        pool,
        w,
        Method::Get,
        SOURCES_PATH,
        Bytes::new(),
        INFO_TIMEOUT,
    );
    match got.await {
        Ok((200, body)) => match parse_kv_event_sources(&body, &w.server_url, kv.max_ranks) {
            Ok(ranks) => Ok(ranks),
            Err(ServerInfoError::TooManyRanks(n)) => {
                kv.intake.count_refused();
                Err(DiscoverError::TooManyRanks {
                    ranks: n as u64,
                    max: kv.max_ranks,
                })
            }
            Err(e) => Err(DiscoverError::Info(e)),
        },
        Ok((status, _)) => Err(DiscoverError::Status {
            path: SOURCES_PATH,
            status,
        }),
        Err(e) => Err(DiscoverError::Fetch(e)),
    }
}

/// `w`'s publishers: its `--kv-events-endpoints` flags when it has them (with what the server
/// says of its ranks, model and block size), else what the server announces. vLLM's
/// announcement names no model: its events are filed under the one `/v1/models` reports.
fn publishers(
    gw: &Gateway,
    kv: &KvRouting,
    w: &Worker,
    announced: Result<Announced, DiscoverError>,
) -> Result<Publishers, DiscoverError> {
    let flagged = kv.flagged.iter().find(|f| f.worker_url == w.server_url);
    let served = || gw.models_of(w.id).ok_or(DiscoverError::NoModel);
    match (flagged, announced) {
        (Some(f), Ok(Announced::Sglang(i))) => Ok(Publishers {
            layout: Layout::Offset {
                live: f.live.clone(),
                replay: f.replay.clone(),
                ranks: i.ranks,
            },
            model: i.model,
            block_size: i.block_size,
            announced: None,
        }),
        // What the server refused to be (too many ranks) the flags do not make it.
        (Some(_), Err(e @ DiscoverError::TooManyRanks { .. })) => Err(e),
        // The flags move the sockets, the announcement says which ranks are ready (their
        // ports offset from the flagged ones, as vLLM offsets its own). An announcement of no
        // rank says nothing the flags do not override: rank 0 at the flags, below.
        (Some(f), Ok(Announced::Vllm(ranks))) if !ranks.is_empty() => {
            let mut listed = Vec::with_capacity(ranks.len());
            for r in ranks {
                let replay = match &f.replay {
                    Some(e) => Some(e.for_rank(r.rank).map_err(DiscoverError::Ports)?),
                    None => None,
                };
                let live = f.live.for_rank(r.rank).map_err(DiscoverError::Ports)?;
                listed.push(RankPublisher {
                    rank: r.rank,
                    live,
                    replay,
                });
            }
            Ok(Publishers {
                layout: Layout::Listed(listed),
                model: Some(served()?),
                block_size: None,
                announced: None,
            })
        }
        // Flags need nothing from the server but its model (one rank, the served model).
        (Some(f), Err(_) | Ok(Announced::Vllm(_))) => Ok(Publishers {
            layout: Layout::Offset {
                live: f.live.clone(),
                replay: f.replay.clone(),
                ranks: 1,
            },
            model: Some(served()?),
            block_size: None,
            announced: None,
        }),
        (None, Ok(Announced::Sglang(i))) => match i.live {
            Some(live) => Ok(Publishers {
                layout: Layout::Offset {
                    live,
                    replay: i.replay,
                    ranks: i.ranks,
                },
                model: i.model,
                block_size: i.block_size,
                announced: None,
            }),
            None => Err(DiscoverError::NoEvents),
        },
        (None, Ok(Announced::Vllm(ranks))) if ranks.is_empty() => Err(DiscoverError::NoEvents),
        (None, Ok(Announced::Vllm(ranks))) => Ok(Publishers {
            model: Some(served()?),
            announced: Some(Arc::from(ranks.as_slice())),
            layout: Layout::Listed(ranks),
            block_size: None,
        }),
        // Counted once: as refused, where it was found.
        (None, Err(e @ DiscoverError::TooManyRanks { .. })) => Err(e),
        (None, Err(e)) => {
            kv.intake.count_discovery_failed();
            Err(e)
        }
    }
}

/// One rank's sockets: (rank, live, replay).
type RankSockets = (u32, TcpEndpoint, Option<TcpEndpoint>);

/// The publishers `w` subscribes to: all of them, or with `--dp-aware` its own rank's only
/// (each rank is a routing target of its own, so the index's holders are (worker, rank)
/// targets). Every rank's ports are worked out first: a worker is subscribed whole or not at
/// all (never some ranks, then an error retried for ever).
fn own_sockets(
    kv: &KvRouting,
    w: &Worker,
    layout: &Layout,
) -> Result<Vec<RankSockets>, DiscoverError> {
    let refused = |e: DiscoverError| {
        kv.intake.count_refused();
        e
    };
    match layout {
        Layout::Offset {
            live,
            replay,
            ranks,
        } => {
            let mine = match w.dp {
                None => 0..*ranks,
                Some(d) if d.rank < *ranks => d.rank..d.rank + 1,
                Some(d) => {
                    return Err(refused(DiscoverError::NoRankPublisher {
                        rank: d.rank,
                        ranks: *ranks,
                    }))
                }
            };
            let at = |rank: u32| -> Result<RankSockets, String> {
                let replay = match replay {
                    Some(r) => Some(r.for_rank(rank)?),
                    None => None,
                };
                Ok((rank, live.for_rank(rank)?, replay))
            };
            mine.map(at)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| refused(DiscoverError::Ports(e)))
        }
        Layout::Listed(list) => {
            let mine: Vec<RankSockets> = list
                .iter()
                .filter(|r| w.dp.is_none_or(|d| d.rank == r.rank))
                .map(|r| (r.rank, r.live.clone(), r.replay.clone()))
                .collect();
            match w.dp {
                Some(d) if mine.is_empty() => Err(refused(DiscoverError::NoRankPublisher {
                    rank: d.rank,
                    ranks: layout.count(),
                })),
                _ => Ok(mine),
            }
        }
    }
}

/// Subscribe to `mine`'s publishers.
fn subscribe(kv: &KvRouting, w: &Worker, mine: Vec<RankSockets>) -> Result<(), DiscoverError> {
    for (rank, live, replay) in mine {
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
            .map_err(DiscoverError::EventThread)?;
    }
    Ok(())
}
