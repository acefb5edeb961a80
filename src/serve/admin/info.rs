//! What the gateway says about itself: liveness, readiness, `/get_server_info`, and what the
//! engines said at the last scrape (`/engine_metrics`).

use super::workers::worker_json;
use crate::gateway::Gateway;
use crate::serve::error::GatewayError;
use crate::serve::reply::Reply;
use serde_json::{json, Value};

/// `GET /health`: 200 while the process runs.
pub fn health() -> Reply {
    Reply::text(200, "OK")
}

/// `GET /readiness`: 200 once a worker is selectable; 503 before, while shutting down, and with
/// KV events while this copy bootstraps or warms up.
pub fn readiness(gw: &Gateway) -> Reply {
    let list = gw.registry.load();
    let healthy = list
        .workers
        .iter()
        .filter(|w| gw.registry.loads.is_eligible(w.id))
        .count();
    let shutting_down = gw.life.is_shutting_down();
    // A copy started with --kv-bootstrap-peer takes traffic only once its sibling's index copy
    // is in (or failed): a load balancer then never sends it a turn it would route cold.
    let bootstrapping = gw.kv.as_ref().is_some_and(|kv| !kv.is_bootstrapped());
    // With KV events, a new copy also waits (bounded by --kv-warm-timeout-secs) until the
    // workers it subscribed to have replayed what they buffer: before that it would route
    // every turn by an empty text tree.
    let warming = !bootstrapping
        && gw
            .kv
            .as_ref()
            .is_some_and(|kv| kv.warming(|w| gw.registry.loads.is_eligible(w)));
    // PD mode serves nothing without both sides: a selectable prefill and a selectable decode.
    let selectable = |ids: &[crate::base::WorkerId]| {
        ids.iter()
            .filter(|&&id| gw.registry.loads.is_eligible(id))
            .count()
    };
    let pd = gw
        .decode
        .is_some()
        .then(|| (selectable(&list.prefill_ids), selectable(&list.decode_ids)));
    let serving = match pd {
        Some((p, d)) => p > 0 && d > 0,
        None => healthy > 0,
    };
    let ready = serving && !shutting_down && !bootstrapping && !warming;
    let status = match (ready, shutting_down, bootstrapping, warming) {
        (true, ..) => "ready",
        (false, true, ..) => "shutting_down",
        (false, false, true, _) => "bootstrapping",
        (false, false, false, true) if serving => "warming",
        (false, false, false, _) => "not_ready",
    };
    let mut body = json!({
        "status": status,
        "healthy_workers": healthy,
        "total_workers": list.len(),
    });
    if let Some((p, d)) = pd {
        body["healthy_prefill_workers"] = json!(p);
        body["healthy_decode_workers"] = json!(d);
    }
    // Publishers past the KV index's limits: their workers serve, scored by the text tree.
    if let Some(n) = gw.kv.as_ref().map(|kv| kv.refused_sources().len()) {
        if n > 0 {
            body["kv_publishers_over_index_limits"] = json!(n);
        }
    }
    Reply::json(if ready { 200 } else { 503 }, &body)
}

/// `GET /get_server_info`: version, io driver, effective configuration, workers, tree stats.
pub fn server_info(gw: &Gateway) -> Reply {
    let list = gw.registry.load();
    let workers: Vec<Value> = list.workers.iter().map(|w| worker_json(gw, w)).collect();
    let tree = gw.router.tree.as_ref().map(|t| {
        let s = t.stats();
        json!({"nodes": s.nodes(), "chars": s.chars(), "epoch": s.epoch(),
               "dropped_inserts": s.dropped(), "evicted_chars": s.evicted_chars()})
    });
    let body = json!({
        "router_manager": true,
        "gateway": "radixgate",
        "version": env!("CARGO_PKG_VERSION"),
        "io_driver": gw.life.io_driver.as_str(),
        "cores": gw.life.cores,
        "config": config_json(gw),
        "workers": workers,
        "tree": tree,
    });
    Reply::json(200, &body)
}

/// `GET /engine_metrics`: every worker's `/metrics` from the telemetry thread's last round,
/// merged with a `worker` label on each sample (no call to the workers per request); 503 when
/// the thread is off (`--worker-metrics-interval-secs 0`).
pub fn engine_metrics(gw: &Gateway) -> Result<Reply, GatewayError> {
    if !gw.telemetry.enabled() {
        return Err(GatewayError::unavailable(
            "engine metrics are not collected (--worker-metrics-interval-secs 0)",
        ));
    }
    Ok(Reply::exposition(&gw.telemetry.report().exposition))
}

/// The effective configuration (secrets redacted), built once at start-up.
fn config_json(gw: &Gateway) -> Value {
    gw.settings.shown.clone()
}
