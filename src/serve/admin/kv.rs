//! `GET /kv_index/snapshot`: this copy's KV-event index, for a sibling copy starting with
//! `--kv-bootstrap-peer` (binary, `kv::index` export format, with each publisher's watermark).
//! Only the admin key opens it (it tells which prompts every worker holds); one copy is made at
//! a time (503 meanwhile), taken a publisher per round of the event thread so intake goes on.

use super::super::error::GatewayError;
use super::super::reply::Reply;
use crate::gateway::Gateway;
use crossbeam::channel::TryRecvError;
use std::time::{Duration, Instant};

/// Longest wait for the event thread to take the copy (it does so between two batches).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the core looks for the answer meanwhile (it serves other connections between).
const EXPORT_POLL: Duration = Duration::from_millis(2);

/// The index as the event thread exports it.
pub async fn snapshot(gw: &Gateway) -> Result<Reply, GatewayError> {
    let Some(kv) = &gw.kv else {
        return Err(GatewayError::not_found("KV events are off (--kv-events)"));
    };
    let busy = || GatewayError::unavailable("the KV event thread is busy; try again");
    let Some(started) = kv.export() else {
        return Err(GatewayError::busy("/kv_index/snapshot"));
    };
    let (_one_at_a_time, rx) = started.map_err(|_| busy())?;
    let until = Instant::now() + EXPORT_TIMEOUT;
    loop {
        match rx.try_recv() {
            Ok(Some(bytes)) => return Ok(Reply::bytes(200, bytes)),
            Ok(None) => return Err(GatewayError::not_found("no KV index to export")),
            Err(TryRecvError::Disconnected) => return Err(busy()),
            Err(TryRecvError::Empty) if Instant::now() >= until => return Err(busy()),
            Err(TryRecvError::Empty) => monoio::time::sleep(EXPORT_POLL).await,
        }
    }
}
