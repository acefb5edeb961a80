//! The KV-event subsystem: exact routing state from the servers themselves. Every SGLang/vLLM
//! worker started with `--kv-events-config` publishes its cache changes (blocks stored, removed,
//! cleared) on a ZeroMQ PUB socket; every radixgate copy subscribes to all of them, so all copies
//! hold the same view without talking to each other.
//!
//! - `wire`: the pure, tolerant decoder of the 3-frame messages and msgpack `EventBatch`es.
//! - `endpoint`: where to subscribe (flag syntax, the DP-rank port rule, wildcard hosts).
//! - `intake`: the event thread (its own std thread, never a serving core): SUB and replay
//!   sockets, sequence tracking, gap fill, resets; it hands decoded batches to an `EventSink`.
//! - `index`: the token-block index those events feed (single writer, lock-free snapshot readers
//!   on every core).
//! - `zmtp`: ZeroMQ's wire protocol (ZMTP 3.0), pure; `socket`: one nonblocking ZMTP connection
//!   driven by the event thread; `resolve`: host names resolved off the event thread.

pub mod endpoint;
pub mod index;
pub mod intake;
pub mod resolve;
pub mod socket;
pub mod wire;
pub mod zmtp;
