//! `--worker-api-key` in front of workers that demand a key (SGLang's `--api-key`, played by
//! the simulated worker): the gateway's own calls (health checks, the model cards it learns and
//! merges, `/get_server_info` for `--dp-aware`, admin fan-outs such as `/flush_cache`) carry
//! the key as the forwarded requests do; with a wrong or no key the caller gets the worker's
//! 401. Real sockets on 127.0.0.1.

use crate::common::*;
use std::net::SocketAddr;

const KEY: &str = "worker-secret";
const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
const GEN: &[u8] = br#"{"text":"hello there","sampling_params":{"max_new_tokens":2}}"#;

/// The ids `GET /v1/models` lists through the gateway at `addr`.
fn listed_models(addr: SocketAddr) -> Vec<String> {
    let r = request(addr, "GET", "/v1/models", &[], b"").unwrap();
    assert_eq!(r.status, 200, "/v1/models: {}", r.text());
    r.json()["data"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["id"].as_str().map(str::to_string))
        .collect()
}

#[test]
fn the_gateways_own_calls_carry_the_worker_key() {
    let c = sim(2, |cfg| cfg.api_key = Some(KEY.into()));
    // The workers refuse a keyless call as SGLang does, and take the key.
    let w = worker_addr(&c, 0);
    let bare = request(w, "GET", "/v1/models", &[], b"").unwrap();
    assert_eq!(
        (bare.status, bare.text()),
        (401, r#"{"error":"Unauthorized"}"#.into())
    );
    assert_eq!(request(w, "GET", "/health", &[], b"").unwrap().status, 200);
    let bearer = format!("Bearer {KEY}");
    let keyed = request(w, "GET", "/v1/models", &[("authorization", &bearer)], b"").unwrap();
    assert_eq!(keyed.status, 200, "{}", keyed.text());

    let gw = gateway_for(
        &c.urls(),
        &["--worker-api-key", KEY, "--policy", "cache_aware"],
    );
    let workers = workers_json(gw.addr);
    let list = workers["workers"].as_array().expect("a worker list");
    assert_eq!(list.len(), 2, "{workers}");
    assert!(list.iter().all(|w| w["healthy"] == true), "{workers}");
    assert_eq!(listed_models(gw.addr), vec![MODEL.to_string()]);
    let r = request(gw.addr, "POST", "/flush_cache", &[], b"").unwrap();
    assert_eq!(r.status, 200, "/flush_cache: {}", r.text());
    let flushed = r.json();
    assert_eq!(flushed["flushed"], 2, "{flushed}");
    // The health thread learned the served model from the workers' /v1/models.
    wait_model_served(&gw, MODEL);
    let r = generate(gw.addr, GEN);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.json()["text"].is_string(), "{}", r.text());
    drop(gw);
    // `--dp-aware` reads each worker's /get_server_info before it starts serving.
    let gw = gateway_for(
        &c.urls(),
        &[
            "--worker-api-key",
            KEY,
            "--dp-aware",
            "--worker-startup-timeout-secs",
            "3",
        ],
    );
    let r = generate(gw.addr, GEN);
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn a_wrong_or_missing_worker_key_gets_the_workers_401() {
    let c = sim(1, |cfg| cfg.api_key = Some(KEY.into()));
    for extra in [&["--worker-api-key", "not-the-key"][..], &[]] {
        // /health needs no key: the worker is healthy and the gateway ready either way.
        let gw = gateway_for(&c.urls(), extra);
        let r = generate(gw.addr, GEN);
        assert_eq!(r.status, 401, "{extra:?}: {}", r.text());
        assert!(r.text().contains("Unauthorized"), "{extra:?}: {}", r.text());
        assert_still_serves_health(gw.addr);
        let r = request(gw.addr, "POST", "/flush_cache", &[], b"").unwrap();
        assert_eq!(r.status, 206, "{extra:?}: {}", r.text());
        assert_eq!(r.json()["workers"][0]["status"], 401, "{}", r.text());
    }
}

/// The gateway still answers after passing the worker's refusal on.
fn assert_still_serves_health(addr: SocketAddr) {
    let r = request(addr, "GET", "/health", &[], b"").unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
}
