//! The gateway in front of a vLLM-shaped fleet (`sim-worker --engine vllm`: vLLM 0.33's routes,
//! `vllm:` metrics, `/kv_event_sources`, no `/get_server_info`, `/generate`, `/flush_cache` or
//! `/get_load`), with nothing set per engine: the publishers are found at `/kv_event_sources`,
//! load, KV use, capacity and the achieved hit ratio come from vLLM's metric names, saturation
//! admission decides on them, and SGLang's own calls reach vLLM's equivalent or end in a clear
//! error.

use crate::common::*;
use loadtest::sim::kv_events::KvEventsConfig;
use loadtest::sim::{EngineKind, SimCluster, SimConfig};
use radixgate::runtime::Running;
use serde_json::{json, Value};
use std::time::Duration;

const PAGE: usize = 4;
const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
const LIMIT: Duration = Duration::from_secs(20);

/// `n` vLLM-shaped workers; with `events`, each publishes its KV events (and keeps a replay
/// buffer) as `--kv-events-config '{"enable_kv_cache_events": true, ...}'` asks vLLM to.
fn vllm_sims(n: usize, events: bool, tweak: impl FnOnce(&mut SimConfig)) -> SimCluster {
    sim(n, |c| {
        c.engine = EngineKind::Vllm;
        c.page_size = PAGE;
        if events {
            c.kv_events = Some(
                KvEventsConfig::parse(
                    r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*"}"#,
                )
                .unwrap(),
            );
        }
        tweak(c);
    })
}

/// `/v1/completions` of token ids (vLLM's token-in form); the index of the worker that served.
fn complete(gw: &Running, c: &SimCluster, ids: &[u32], max_tokens: u32) -> usize {
    let body = json!({"model": MODEL, "prompt": ids, "max_tokens": max_tokens});
    let r = request(
        gw.addr,
        "POST",
        "/v1/completions",
        &[("content-type", "application/json")],
        &serde_json::to_vec(&body).unwrap(),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let port = served_by(&r);
    c.ports().iter().position(|&p| p == port).unwrap()
}

fn tokens(n: usize, start: u32) -> Vec<u32> {
    (0..n as u32).map(|i| start + i).collect()
}

#[test]
fn a_vllm_fleet_is_subscribed_routed_and_read_by_vllms_own_names() {
    let c = vllm_sims(2, true, |_| {});
    let gw = gateway_for(
        &c.urls(),
        &[
            "--kv-events",
            "--policy",
            "cache_aware",
            "--worker-metrics-interval-secs",
            "1",
        ],
    );
    let kv = gw.gateway().kv.as_ref().unwrap();
    // No endpoint flag: both found at /kv_event_sources, before readiness.
    assert_eq!(kv.exact_workers().len(), 2, "subscribed when ready");
    // A prompt goes where its prefix is, by the worker's own events.
    let p = tokens(64, 1000);
    let first = complete(&gw, &c, &p, 1);
    wait_until("the prefill's events are in", LIMIT, || {
        let snap = kv.reader.load();
        let mut scratch = radixgate::kv::index::MatchScratch::default();
        let held = snap.match_prefix(MODEL, radixgate::kv::index::ROOT_PARENT, &p, &mut scratch);
        (!held.is_empty()).then_some(())
    });
    let mut ask = p.clone();
    ask.extend([5, 5, 5]);
    for _ in 0..4 {
        assert_eq!(complete(&gw, &c, &ask, 1), first);
    }
    // vLLM's gauges and counters, read by their own names: load, KV use, capacity, hit ratio.
    wait_until("the holder's achieved hit ratio", LIMIT, || {
        let report = gw.gateway().telemetry.report();
        let mine = report
            .workers
            .values()
            .find(|w| w.prompt_tokens > 0.0 && w.cached_tokens > 0.0)?;
        (mine.gauges.up && mine.gauges.hit_ratio > 0.5).then_some(())
    });
    let report = gw.gateway().telemetry.report();
    assert_eq!(report.workers.len(), 2);
    assert!(report.workers.values().all(|w| w.gauges.up), "{report:?}");
    assert!(report.fleet_hit_ratio > 0.0);
}

#[test]
fn sglangs_own_calls_reach_vllms_equivalent_or_end_in_a_clear_error() {
    let c = vllm_sims(2, true, |_| {});
    let gw = gateway_for(&c.urls(), &["--kv-events", "--policy", "cache_aware"]);
    let kv = gw.gateway().kv.as_ref().unwrap();
    let p = tokens(32, 1);
    complete(&gw, &c, &p, 1);
    wait_until("a block indexed", LIMIT, || {
        (kv.reader.load().blocks(MODEL) > 0).then_some(())
    });
    // /flush_cache: vLLM has none; its /reset_prefix_cache empties the cache, and the
    // cleared event empties the index.
    let r = request(gw.addr, "POST", "/flush_cache", &[], b"").unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(
        (v["flushed"].as_u64(), v["total"].as_u64()),
        (Some(2), Some(2))
    );
    for w in v["workers"].as_array().unwrap() {
        assert_eq!(w["path"], "/reset_prefix_cache", "{v}");
        assert_eq!(w["status"], 200);
    }
    wait_until(
        "the index emptied by the workers' own events",
        LIMIT,
        || (kv.reader.load().blocks(MODEL) == 0).then_some(()),
    );
    // /get_loads: vLLM has no /get_load; each entry says so and where its load is.
    let r = request(gw.addr, "GET", "/get_loads", &[], b"").unwrap();
    assert_eq!(r.status, 200);
    let v = r.json();
    for w in v["workers"].as_array().unwrap() {
        assert_eq!(w["load"], Value::Null);
        let e = w["error"].as_str().unwrap_or_default();
        assert!(e.contains("vllm:num_requests_waiting"), "{v}");
    }
    // /abort_request: vLLM has none, and its own abort takes ids the gateway does not know:
    // a clear 501 rather than a pretended abort.
    let r = request(
        gw.addr,
        "POST",
        "/abort_request",
        &[("content-type", "application/json")],
        br#"{"rid": "no-such-request"}"#,
    )
    .unwrap();
    assert_eq!(r.status, 501, "{}", r.text());
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("/inference/v1/abort_requests"));
    assert_still_serves_completions(&gw, &c);
}

/// The gateway still answers an ordinary vLLM request.
fn assert_still_serves_completions(gw: &Running, c: &SimCluster) {
    complete(gw, c, &tokens(8, 77), 1);
}

#[test]
fn saturation_admission_reads_a_vllm_workers_queue_and_kv_use() {
    // One request runs at a time, 20 ms a token in real time: a second one waits in the
    // worker's own queue (vllm:num_requests_waiting). A small KV cache, so what runs shows in
    // vllm:kv_cache_usage_perc.
    let c = vllm_sims(1, false, |c| {
        c.max_total_tokens = 1000;
        c.max_running = 1;
        c.token_interval_ms = Some(20.0);
        c.time_scale = 1.0;
    });
    let gw = gateway_for(
        &c.urls(),
        &[
            "--saturation-admission",
            "--saturation-queue-reqs",
            "1",
            "--saturation-poll-ms",
            "50",
        ],
    );
    let addr = gw.addr;
    let long = move || {
        std::thread::spawn(move || {
            let body = json!({"model": MODEL, "prompt": tokens(16, 9), "max_tokens": 60});
            request(
                addr,
                "POST",
                "/v1/completions",
                &[("content-type", "application/json")],
                &serde_json::to_vec(&body).unwrap(),
            )
            .unwrap()
            .status
        })
    };
    let flow = gw.gateway().flow.as_ref().expect("admission on");
    let id = gw.gateway().registry.load().workers[0].id;
    // Read from vLLM's names: a reading exists, with the KV capacity from cache_config_info.
    wait_fresh_round(&gw);
    let (queued, usage) = flow
        .saturation
        .estimate(id, 0)
        .expect("a reading of vLLM's gauges");
    assert_eq!((queued, usage), (0, 0.0));
    let a = long();
    wait_until("the first runs", LIMIT, || {
        (sim_count(&c, 0, "inference_received") >= 1).then_some(())
    });
    let b = long();
    wait_until("the second waits in the worker's queue", LIMIT, || {
        (sim_count(&c, 0, "inference_received") >= 2).then_some(())
    });
    wait_fresh_round(&gw);
    let (queued, usage) = flow.saturation.estimate(id, 0).unwrap();
    assert!(queued >= 1, "vllm:num_requests_waiting read: {queued}");
    assert!(usage > 0.0, "vllm:kv_cache_usage_perc read: {usage}");
    // So a third request waits in the gateway until the worker has room, then is served.
    let started = std::time::Instant::now();
    let body = json!({"model": MODEL, "prompt": tokens(4, 3), "max_tokens": 1});
    let r = request(
        addr,
        "POST",
        "/v1/completions",
        &[("content-type", "application/json")],
        &serde_json::to_vec(&body).unwrap(),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!((a.join().unwrap(), b.join().unwrap()), (200, 200));
    assert!(
        started.elapsed() > Duration::from_millis(300),
        "it waited for room: {:?}",
        started.elapsed()
    );
}
