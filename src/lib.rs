//! radixgate: a cache-aware LLM gateway. One request goes from socket to worker and back:
//! `runtime` (cores, listeners) → `serve::conn` (HTTP/1.1 keep-alive loop over the pure `http`
//! framing) → `serve::exchange` (admit, pick, attempt, commit) → `gateway::Router` →
//! `route` (extract, policies) against `tree` snapshots and `workers` loads → `proxy`
//! (pooled upstream, streamed relay) → `metrics`. docs/architecture.md lists the layers;
//! `tests/layers.rs` keeps imports pointing downward.

pub mod admission;
pub mod base;
pub mod config;
pub mod discovery;
pub mod gateway;
pub mod http;
pub mod kv;
pub mod log;
pub mod metrics;
pub mod metrics_server;
pub mod proxy;
pub mod route;
pub mod runtime;
pub mod serve;
pub mod tokenize;
pub mod trace;
pub mod tree;
pub mod workers;
