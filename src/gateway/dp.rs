//! DP-aware routing (`--dp-aware`): how many attention-DP ranks a server runs, read from its
//! `/get_server_info` (`dp_size`) before it is registered, so that each rank becomes a routing
//! target of its own (`workers::registry` explains the registration; the exchange splices the
//! rank into the body with `route::bootstrap`).

use crate::config::settings::{HealthSettings, UpstreamSettings};
use crate::http::Method;
use crate::proxy::forward::{self, UpstreamError};
use crate::proxy::pool::Pool;
use crate::workers::registry::{self, RegistryError, UrlError, Worker, MAX_DP_SIZE};
use bytes::Bytes;
use std::fmt;
use std::time::{Duration, Instant};

/// Time allowed for one `/get_server_info` call.
pub const INFO_TIMEOUT: Duration = Duration::from_secs(5);

/// The endpoint a server's `dp_size` is read from.
const INFO_PATH: &str = "/get_server_info";

/// Why a server's `dp_size` could not be read: a worker added at run time is refused with its
/// text; at start the gateway asks again until the start-up timeout, then refuses to start.
#[derive(Debug)]
pub enum DpSizeError {
    /// The body is not JSON.
    NotJson(serde_json::Error),
    /// A `dp_size` that is not 1..=[`MAX_DP_SIZE`] (as the server wrote it).
    BadSize(serde_json::Value),
    /// The server answered this status.
    Status(u16),
    /// No answer came back.
    Fetch(UpstreamError),
}

impl fmt::Display for DpSizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DpSizeError::NotJson(e) => write!(f, "{INFO_PATH} is not JSON: {e}"),
            DpSizeError::BadSize(n) => {
                write!(f, "{INFO_PATH}: dp_size {n} is not 1..={MAX_DP_SIZE}")
            }
            DpSizeError::Status(404) => write!(
                f,
                "{INFO_PATH} answered 404: --dp-aware reads SGLang's dp_size; a vLLM server \
                 balances its DP ranks behind one URL itself (its KV events are still read per \
                 rank, from /kv_event_sources)"
            ),
            DpSizeError::Status(status) => write!(f, "{INFO_PATH} answered {status}"),
            DpSizeError::Fetch(e) => write!(f, "{INFO_PATH}: {}", e.message()),
        }
    }
}

impl std::error::Error for DpSizeError {}

/// Why the configured servers' `dp_size`s were not all read at start: the gateway does not
/// start (a rank it does not know of would never be routed to).
#[derive(Debug)]
pub enum DpStartError {
    /// The helper runtime the reads run on could not be built.
    Runtime(std::io::Error),
    /// A configured URL that is not a worker URL.
    Url(UrlError),
    /// A configured host that does not resolve.
    Resolve(RegistryError),
    /// A server that did not tell its `dp_size` before `--worker-startup-timeout-secs`.
    Worker {
        /// The server's URL.
        url: String,
        /// Its last failure.
        error: DpSizeError,
    },
}

impl fmt::Display for DpStartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DpStartError::Runtime(e) => write!(f, "--dp-aware: cannot build a runtime: {e}"),
            DpStartError::Url(e) => write!(f, "{e}"),
            DpStartError::Resolve(e) => write!(f, "{e}"),
            DpStartError::Worker { url, error } => {
                write!(f, "--dp-aware: worker {url}: {error}")
            }
        }
    }
}

impl std::error::Error for DpStartError {}

/// The `dp_size` a server reports in its `/get_server_info` body (SGLang puts its server
/// arguments at the top level). A server that does not report one runs a single rank.
pub fn dp_size_from_info(body: &[u8]) -> Result<u32, DpSizeError> {
    let v: serde_json::Value = serde_json::from_slice(body).map_err(DpSizeError::NotJson)?;
    match v.get("dp_size") {
        None | Some(serde_json::Value::Null) => Ok(1),
        Some(n) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .filter(|n| (1..=MAX_DP_SIZE).contains(n))
            .ok_or_else(|| DpSizeError::BadSize(n.clone())),
    }
}

/// Ask `worker`'s server for its `dp_size`.
pub async fn fetch_dp_size(pool: &Pool, worker: &Worker) -> Result<u32, DpSizeError> {
    let path = INFO_PATH;
    match forward::fetch(pool, worker, Method::Get, path, Bytes::new(), INFO_TIMEOUT).await {
        Ok((200, body)) => dp_size_from_info(&body),
        Ok((status, _)) => Err(DpSizeError::Status(status)),
        Err(e) => Err(DpSizeError::Fetch(e)),
    }
}

/// At start: the `dp_size` of each of `urls`, polling each server (1 s, 2 s, … up to
/// `--worker-startup-check-interval`) until it answers or `--worker-startup-timeout-secs` runs
/// out. Blocks the caller (start-up, before the cores serve) on a small runtime of its own.
pub fn dp_sizes_at_start(
    health: &HealthSettings,
    upstream: &UpstreamSettings,
    urls: &[String],
) -> Result<Vec<u32>, DpStartError> {
    let mut rt = monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
        .enable_timer()
        .build()
        .map_err(DpStartError::Runtime)?;
    let pool = Pool::new(
        Duration::from_secs(1),
        1,
        upstream.worker_api_key.as_deref(),
    );
    let timeout = health.startup_timeout;
    let cap = health.startup_cap;
    rt.block_on(async {
        let mut sizes = Vec::with_capacity(urls.len());
        for url in urls {
            let parsed = registry::parse_worker_url(url).map_err(DpStartError::Url)?;
            let addrs = registry::resolve(&parsed).map_err(DpStartError::Resolve)?;
            let probe = Worker::detached(url, parsed, addrs);
            let started = Instant::now();
            let mut attempt = 0u64;
            let size = loop {
                match fetch_dp_size(&pool, &probe).await {
                    Ok(n) => break n,
                    Err(error) if started.elapsed() >= timeout => {
                        return Err(DpStartError::Worker {
                            url: url.clone(),
                            error,
                        })
                    }
                    Err(e) => {
                        attempt += 1;
                        if attempt == 1 {
                            crate::log!(Info, "--dp-aware: waiting for worker {url}: {e}");
                        }
                        monoio::time::sleep(Duration::from_secs(attempt).min(cap)).await;
                    }
                }
            };
            crate::log!(Info, "--dp-aware: worker {url} runs {size} DP rank(s)");
            sizes.push(size);
        }
        Ok(sizes)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dp_size_as_sglang_reports_it() {
        assert_eq!(
            dp_size_from_info(br#"{"dp_size":4,"tp_size":8}"#).unwrap(),
            4
        );
        assert_eq!(dp_size_from_info(br#"{"model_path":"m"}"#).unwrap(), 1);
        assert_eq!(dp_size_from_info(br#"{"dp_size":null}"#).unwrap(), 1);
        for bad in [
            &br#"{"dp_size":0}"#[..],
            br#"{"dp_size":-1}"#,
            br#"{"dp_size":"2"}"#,
            br#"{"dp_size":99999}"#,
            b"nope",
        ] {
            assert!(dp_size_from_info(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_server_without_server_info_is_told_what_dp_aware_needs() {
        let e = DpSizeError::Status(404).to_string();
        assert!(e.contains("vLLM") && e.contains("/kv_event_sources"), "{e}");
        assert_eq!(
            DpSizeError::Status(503).to_string(),
            "/get_server_info answered 503"
        );
    }
}
