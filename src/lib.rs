//! radixgate: a cache-aware LLM gateway. The module tree follows one request from socket to
//! worker and back: `runtime` (cores, listeners) → `proxy::conn` (HTTP/1.1 keep-alive loop over
//! the pure `http` framing) → `route` (extract, policies) against `tree` snapshots and `workers`
//! loads → `proxy::forward` (pooled upstream, streamed relay) → `metrics`.

pub mod admission;
pub mod base;
pub mod config;
pub mod gateway;
pub mod http;
pub mod log;
pub mod metrics;
pub mod metrics_server;
pub mod proxy;
pub mod route;
pub mod runtime;
pub mod serve;
pub mod tree;
pub mod workers;
