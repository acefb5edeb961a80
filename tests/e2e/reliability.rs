//! Reliability and security end to end: retries that avoid the failing worker, circuit
//! breakers, health checks, live worker changes, admission, timeouts, shutdown, API keys and bad
//! input. Faults come from the simulated worker's knobs.

use crate::common::*;
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A worker that answers every inference request with 500, a healthy one, and their URLs in
/// that order.
fn failing_and_good() -> (
    loadtest::sim::SimCluster,
    loadtest::sim::SimCluster,
    Vec<String>,
) {
    let bad = sim(1, |c| c.faults.fail_rate = 1.0);
    let good = sim(1, |_| {});
    let urls = vec![bad.urls()[0].clone(), good.urls()[0].clone()];
    (bad, good, urls)
}

#[test]
fn nothing_is_lost_when_one_of_four_workers_fails_20_percent() {
    // Busy: four workers and the gateway under a stream of requests, about a CPU for 5 s.
    let _busy = busy();
    let good = sim(3, |_| {});
    let flaky = sim(1, |c| c.faults.fail_rate = 0.2);
    let mut urls = good.urls();
    urls.extend(flaky.urls());
    let gw = gateway_for(
        &urls,
        &[
            "--policy",
            "round_robin",
            "--cores",
            "2",
            "--retry-initial-backoff-ms",
            "1",
        ],
    );
    let total = 10_000;
    let next = Arc::new(AtomicUsize::new(0));
    let failures = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let next = next.clone();
            let failures = failures.clone();
            let addr = gw.addr;
            std::thread::spawn(move || {
                let mut c = Conn::open(addr);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        break;
                    }
                    c.send(&raw_request("POST", "/generate", &[], &gen_body(i)));
                    match c.read_response() {
                        Ok(r) if r.status == 200 => {}
                        Ok(r) => {
                            failures.fetch_add(1, Ordering::Relaxed);
                            eprintln!("request {i}: {} {}", r.status, r.text());
                        }
                        Err(e) => {
                            failures.fetch_add(1, Ordering::Relaxed);
                            eprintln!("request {i}: {e}");
                            c = Conn::open(addr);
                        }
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(failures.load(Ordering::Relaxed), 0, "requests were lost");
}

#[test]
fn retries_exclude_the_worker_that_failed() {
    let (bad, good, urls) = failing_and_good();
    // `X-SMG-Target-Worker: 0` sends every first attempt to the failing worker (registered
    // first): a retry that did not exclude it would go straight back there, every time.
    let gw = gateway_for(
        &urls,
        &[
            "--policy",
            "consistent_hashing",
            "--retry-initial-backoff-ms",
            "1",
            "--cb-failure-threshold",
            "1000",
        ],
    );
    let n = 20;
    for i in 0..n {
        let r = request(
            gw.addr,
            "POST",
            "/v1/completions",
            &[("x-smg-target-worker", "0")],
            format!(r#"{{"prompt":"same prompt {}","max_tokens":1}}"#, i % 2).as_bytes(),
        )
        .unwrap();
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        assert_eq!(served_by(&r), good.ports()[0]);
    }
    // Each request was tried on the failing worker exactly once, then answered by the other.
    assert_eq!(
        sim_count(&bad, 0, "inference_received"),
        n,
        "the failing worker was not tried exactly once per request"
    );
    assert_eq!(sim_count(&good, 0, "inference_received"), n);

    // cache_aware: its tree points at the failing worker for a prompt it has seen there (the
    // insert happens at selection), so without exclusion a retry would often go back to it.
    // Whatever the ties, a request never reaches the failing worker twice.
    let (bad2, good2, urls) = failing_and_good();
    let gw = gateway_for(
        &urls,
        &[
            "--policy",
            "cache_aware",
            "--retry-initial-backoff-ms",
            "1",
            "--cb-failure-threshold",
            "1000",
        ],
    );
    for i in 0..n {
        let r = request(
            gw.addr,
            "POST",
            "/v1/completions",
            &[],
            format!(r#"{{"prompt":"same prompt {}","max_tokens":1}}"#, i % 2).as_bytes(),
        )
        .unwrap();
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        assert_eq!(served_by(&r), good2.ports()[0]);
        let tried = sim_count(&bad2, 0, "inference_received");
        assert!(
            tried <= i + 1,
            "request {i} reached the failing worker twice ({tried} attempts so far)"
        );
    }
    assert_eq!(sim_count(&good2, 0, "inference_received"), n);

    // With retries disabled the failure reaches the client.
    let gw = gateway_for(&[bad.urls()[0].clone()], &["--disable-retries"]);
    assert_eq!(generate(gw.addr, &gen_body(1)).status, 500);
}

#[test]
fn a_fleet_of_one_still_gets_its_retries() {
    // One worker failing 30 % of requests: once it has failed a request there is no other
    // worker to exclude it for, so the retry goes back to it (as the reference's reselection
    // does) instead of giving the client the error.
    let flaky = sim(1, |c| c.faults.fail_rate = 0.3);
    let gw = gateway_for(
        &flaky.urls(),
        &[
            "--retry-initial-backoff-ms",
            "1",
            "--cb-failure-threshold",
            "1000",
        ],
    );
    let n = 40;
    let failed = (0..n)
        .filter(|&i| generate(gw.addr, &gen_body(i)).status != 200)
        .count();
    // 5 attempts each: a request fails only if all five do (0.3^5 = 0.24 %); giving up after
    // one attempt would fail about 12 of 40.
    assert!(failed <= 1, "{failed} of {n} requests failed");
    assert!(
        sim_count(&flaky, 0, "inference_received") > n as u64,
        "no request was retried"
    );
}

#[test]
fn a_circuit_opens_half_opens_after_its_timeout_and_closes_after_successful_probes() {
    let worker = sim(1, |c| c.faults.fail_rate = 1.0);
    let url = worker.urls()[0].clone();
    let gw = gateway_for(
        &worker.urls(),
        &[
            "--cb-failure-threshold",
            "3",
            "--cb-success-threshold",
            "2",
            "--cb-timeout-duration-secs",
            "1",
            "--disable-retries",
        ],
    );
    let generate = |i: usize| generate(gw.addr, &gen_body(i)).status;
    let state = || circuit(gw.addr, &[], &url);
    let half_open_within = |limit: Duration| {
        wait_until("the circuit to half-open", limit, || {
            let s = state();
            assert_ne!(s, "closed", "the circuit closed without probes");
            (s == "half_open").then_some(())
        })
    };
    // Closed: failures reach the worker until the third opens the circuit.
    for i in 0..3 {
        assert_eq!(state(), "closed", "opened after {i} failures");
        assert_eq!(generate(i), 500);
    }
    assert_eq!(state(), "open");
    // Open: nothing reaches the worker.
    assert_eq!(generate(3), 503);
    assert_eq!(sim_count(&worker, 0, "inference_received"), 3);

    // Half-open after the open period; a failing probe reopens it.
    half_open_within(Duration::from_secs(5));
    assert_eq!(generate(4), 500);
    assert_eq!(state(), "open", "a failed probe must reopen the circuit");
    assert_eq!(sim_count(&worker, 0, "inference_received"), 4);

    // The worker recovers; the next half-open period lets probes through and closes the
    // circuit after --cb-success-threshold successes.
    set_faults(&worker, 0, serde_json::json!({"fail_rate": 0.0}));
    half_open_within(Duration::from_secs(5));
    assert_eq!(generate(5), 200);
    assert_eq!(state(), "half_open", "closed after one success of two");
    assert_eq!(generate(6), 200);
    assert_eq!(state(), "closed");
    assert_eq!(sim_count(&worker, 0, "inference_received"), 6);
    for i in 7..10 {
        assert_eq!(generate(i), 200);
    }
}

#[test]
fn a_failing_worker_opens_its_circuit_and_4xx_do_not_count() {
    let (bad, good, urls) = failing_and_good();
    let gw = gateway_for(
        &urls,
        &[
            "--policy",
            "round_robin",
            "--cb-failure-threshold",
            "3",
            "--cb-timeout-duration-secs",
            "60",
            "--retry-initial-backoff-ms",
            "1",
        ],
    );
    for i in 0..10 {
        let r = generate(gw.addr, &gen_body(i));
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
    }
    let workers = request(gw.addr, "GET", "/workers", &[], b"")
        .unwrap()
        .json();
    let states: Vec<(String, String)> = workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["url"].as_str().unwrap().to_string(),
                w["circuit"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert!(
        states.contains(&(bad.urls()[0].clone(), "open".into())),
        "{states:?}"
    );
    assert!(
        states.contains(&(good.urls()[0].clone(), "closed".into())),
        "{states:?}"
    );

    // Client errors (4xx from the worker) never open a circuit.
    let gw = gateway_for(&good.urls(), &["--cb-failure-threshold", "2"]);
    for _ in 0..5 {
        let r = generate(
            gw.addr,
            br#"{"text":"x","sampling_params":{"max_new_tokens":-5}}"#,
        );
        assert!(
            r.status >= 400 && r.status < 500,
            "sim should refuse: {} {}",
            r.status,
            r.text()
        );
    }
    let w = request(gw.addr, "GET", "/workers", &[], b"")
        .unwrap()
        .json();
    assert_eq!(w["workers"][0]["circuit"], "closed");
}

#[test]
fn unhealthy_workers_leave_selection_and_refused_connections_act_at_once() {
    let sick = sim(1, |c| c.faults.health_fail = true);
    let good = sim(1, |_| {});
    let gw = gateway(&[
        "--worker-urls",
        &sick.urls()[0],
        &good.urls()[0],
        "--policy",
        "round_robin",
        "--health-check-interval-secs",
        "1",
    ]);
    wait_ready(gw.addr, Duration::from_secs(10));
    wait_until(
        "the sick worker marked unhealthy",
        Duration::from_secs(10),
        || {
            let w = workers_json(gw.addr);
            let sick_entry = w["workers"]
                .as_array()
                .unwrap()
                .iter()
                .find(|x| x["url"] == sick.urls()[0])
                .cloned()
                .unwrap();
            (sick_entry["healthy"] == false).then_some(())
        },
    );
    for i in 0..6 {
        assert_eq!(served_by(&generate(gw.addr, &gen_body(i))), good.ports()[0]);
    }
    // Passive detection: a worker that dies is out after its first refused connection.
    let doomed = sim(1, |_| {});
    let gw = gateway_for(
        &[doomed.urls()[0].clone(), good.urls()[0].clone()],
        &["--policy", "round_robin", "--retry-initial-backoff-ms", "1"],
    );
    doomed.shutdown();
    for i in 0..6 {
        let r = generate(gw.addr, &gen_body(i));
        assert_eq!(r.status, 200);
    }
    let w = request(gw.addr, "GET", "/workers", &[], b"")
        .unwrap()
        .json();
    let dead = w["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["url"] != good.urls()[0])
        .unwrap()
        .clone();
    assert_eq!(dead["healthy"], false, "{w}");
}

#[test]
fn a_killed_worker_mid_run_loses_nothing() {
    let good = sim(2, |_| {});
    let dying = sim(1, |c| c.faults.die_after = Some(20));
    let mut urls = good.urls();
    urls.extend(dying.urls());
    let gw = gateway_for(
        &urls,
        &["--policy", "round_robin", "--retry-initial-backoff-ms", "1"],
    );
    let mut c = Conn::open(gw.addr);
    for i in 0..200 {
        c.send(&raw_request("POST", "/generate", &[], &gen_body(i)));
        let r = c.read_response().unwrap();
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
    }
}

#[test]
fn a_stalled_worker_gives_504_within_the_timeout() {
    let stalled = sim(1, |c| c.faults.stall_after = Some(0));
    let gw = gateway_for(
        &stalled.urls(),
        &["--request-timeout-secs", "1", "--disable-retries"],
    );
    let t0 = Instant::now();
    let r = generate(gw.addr, &gen_body(0));
    assert_eq!(r.status, 504, "{}", r.text());
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t0.elapsed()
    );
}

#[test]
fn a_stream_that_breaks_ends_with_an_error_event_and_a_clean_close() {
    let cutting = sim(1, |c| c.faults.close_mid_stream = true);
    let gw = gateway_for(&cutting.urls(), &[]);
    // Raw socket: the test is about the bytes after the error event (a last chunk, a close).
    let mut c = Conn::open(gw.addr);
    c.send(&raw_request(
        "POST",
        "/v1/chat/completions",
        &[],
        &chat_body(&[("user", "hi")], true, 50),
    ));
    let r = c
        .read_response()
        .expect("a complete chunked response, not a hang");
    let text = r.text();
    assert!(text.contains("\"error\""), "no error event: {text}");
    assert!(c.closed_within(Duration::from_secs(5)));
}

#[test]
fn workers_added_and_removed_under_load() {
    let a = sim(2, |_| {});
    let b = sim(1, |_| {});
    let gw = gateway_for(
        &a.urls(),
        &["--policy", "round_robin", "--retry-initial-backoff-ms", "1"],
    );
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let bad = Arc::new(AtomicUsize::new(0));
    let addr = gw.addr;
    let load = {
        let stop = stop.clone();
        let bad = bad.clone();
        std::thread::spawn(move || {
            let mut c = Conn::open(addr);
            let mut ports = std::collections::HashSet::new();
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                c.send(&raw_request("POST", "/generate", &[], &gen_body(i)));
                match c.read_response() {
                    Ok(r) if r.status == 200 => {
                        ports.insert(served_by(&r));
                    }
                    _ => {
                        bad.fetch_add(1, Ordering::Relaxed);
                        c = Conn::open(addr);
                    }
                }
                i += 1;
            }
            ports
        })
    };
    let served = |c: &loadtest::sim::SimCluster, i: usize| sim_count(c, i, "inference_received");
    wait_until("load on the first workers", Duration::from_secs(10), || {
        (served(&a, 0) + served(&a, 1) >= 5).then_some(())
    });
    let r = request(
        gw.addr,
        "POST",
        "/workers",
        &[],
        format!(r#"{{"url":"{}"}}"#, b.urls()[0]).as_bytes(),
    )
    .unwrap();
    assert_eq!(r.status, 202, "{}", r.text());
    wait_until("the added worker serving", Duration::from_secs(10), || {
        (served(&b, 0) >= 3).then_some(())
    });
    let id = r.json()["id"].as_str().unwrap().to_string();
    assert_eq!(
        request(gw.addr, "GET", &format!("/workers/{id}"), &[], b"")
            .unwrap()
            .status,
        200
    );
    let r = request(
        gw.addr,
        "DELETE",
        &format!(
            "/workers/{}",
            a.urls()[0].replace(':', "%3A").replace('/', "%2F")
        ),
        &[],
        b"",
    )
    .unwrap();
    assert_eq!(r.status, 202, "{}", r.text());
    wait_until(
        "the removed worker gone from /workers",
        Duration::from_secs(10),
        || {
            let w = workers_json(gw.addr);
            (!w.to_string().contains(&a.urls()[0])).then_some(())
        },
    );
    // Load goes on without it: the others serve more, the removed one (at most one request
    // chosen before the removal) nothing.
    let removed_before = served(&a, 0);
    let others_before = served(&a, 1) + served(&b, 0);
    wait_until("load after the removal", Duration::from_secs(10), || {
        (served(&a, 1) + served(&b, 0) >= others_before + 10).then_some(())
    });
    assert!(
        served(&a, 0) <= removed_before + 1,
        "the removed worker still gets traffic"
    );
    stop.store(true, Ordering::Relaxed);
    let ports = load.join().unwrap();
    assert_eq!(bad.load(Ordering::Relaxed), 0);
    assert!(
        ports.contains(&b.ports()[0]),
        "the added worker never served"
    );
    // Legacy endpoints answer too.
    let legacy = request(gw.addr, "GET", "/list_workers", &[], b"")
        .unwrap()
        .json();
    assert_eq!(legacy["urls"].as_array().unwrap().len(), 2);
    assert_eq!(
        request(gw.addr, "GET", "/get_loads", &[], b"")
            .unwrap()
            .status,
        200
    );
    assert_eq!(
        request(gw.addr, "POST", "/flush_cache", &[], b"")
            .unwrap()
            .status,
        200
    );
}

/// Requests the gateway is handling right now (admitted, queued, or local), as it counts them.
fn gateway_active(gw: &radixgate::runtime::Running) -> u64 {
    gw.gateway().life.active_requests()
}

#[test]
fn admission_queue_full_is_429_and_queue_timeout_is_408() {
    // The worker holds every inference request until the test releases it, so the orderings
    // below come from observed state, not from timing.
    let held = sim(1, |_| {});
    set_faults(&held, 0, serde_json::json!({"hold": true}));
    let gw = gateway_for(
        &held.urls(),
        &[
            "--max-concurrent-requests",
            "1",
            "--queue-size",
            "1",
            "--queue-timeout-secs",
            "30",
            "--rate-limit-tokens-per-second",
            "1000",
        ],
    );
    let addr = gw.addr;
    let first = std::thread::spawn(move || generate(addr, &gen_body(0)).status);
    // The first request holds the only slot: it is at the worker.
    wait_until(
        "the first request at the worker",
        Duration::from_secs(10),
        || (sim_count(&held, 0, "inference_in_progress") == 1).then_some(()),
    );
    let queued = std::thread::spawn(move || generate(addr, &gen_body(1)).status);
    // The second one is in the gateway (one core: it has reached the admission queue when it
    // is counted active, nothing in between yields) and not at the worker.
    wait_until("the second request queued", Duration::from_secs(10), || {
        (gateway_active(&gw) == 2).then_some(())
    });
    assert_eq!(sim_count(&held, 0, "inference_received"), 1);
    let refused = generate(addr, &gen_body(2));
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(sim_count(&held, 0, "inference_received"), 1);
    set_faults(&held, 0, serde_json::json!({"hold": false}));
    assert_eq!(first.join().unwrap(), 200);
    assert_eq!(queued.join().unwrap(), 200);
    assert_eq!(sim_count(&held, 0, "inference_received"), 2);

    let stalled = sim(1, |c| c.faults.stall_after = Some(0));
    let gw = gateway_for(
        &stalled.urls(),
        &[
            "--max-concurrent-requests",
            "1",
            "--queue-size",
            "5",
            "--queue-timeout-secs",
            "1",
            "--request-timeout-secs",
            "5",
            "--disable-retries",
        ],
    );
    let addr = gw.addr;
    let _hog = std::thread::spawn(move || request(addr, "POST", "/generate", &[], &gen_body(0)));
    wait_until("the hog at the worker", Duration::from_secs(10), || {
        (sim_count(&stalled, 0, "inference_in_progress") == 1).then_some(())
    });
    let t0 = Instant::now();
    let r = generate(addr, &gen_body(1));
    assert_eq!(r.status, 408, "{}", r.text());
    assert!(
        t0.elapsed() >= Duration::from_millis(900) && t0.elapsed() < Duration::from_secs(4),
        "408 after {:?}, not after the 1 s queue timeout",
        t0.elapsed()
    );
    assert_eq!(sim_count(&stalled, 0, "inference_received"), 1);
}

#[test]
fn api_keys_guard_inference_and_admin_endpoints() {
    let cluster = sim(1, |_| {});
    let gw = gateway_for(
        &cluster.urls(),
        &["--api-key", "secret", "--admin-api-key", "root"],
    );
    let r = generate(gw.addr, &gen_body(0));
    assert_eq!(r.status, 401);
    assert!(r.json()["error"]["message"].is_string());
    // (method, path, bearer key) → status.
    let status = |method: &str, path: &str, key: &str| {
        let auth = format!("Bearer {key}");
        let body = if method == "POST" {
            gen_body(0)
        } else {
            Vec::new()
        };
        request(
            gw.addr,
            method,
            path,
            &[("authorization", auth.as_str())],
            &body,
        )
        .unwrap()
        .status
    };
    assert_eq!(status("POST", "/generate", "wrong"), 401);
    assert_eq!(status("POST", "/generate", "secret"), 200);
    assert_eq!(status("GET", "/workers", "secret"), 401);
    assert_eq!(status("GET", "/workers", "root"), 200);
    // Health endpoints stay open for orchestrators.
    assert_eq!(
        request(gw.addr, "GET", "/health", &[], b"").unwrap().status,
        200
    );
}

/// Every admin endpoint (see `Endpoint::is_admin`): (method, path, body). Bodies and ids are
/// chosen so that an authorized call changes nothing (unknown ids, missing URLs).
const ADMIN_ENDPOINTS: &[(&str, &str, &str)] = &[
    ("GET", "/workers", ""),
    ("POST", "/workers", "{}"),
    ("GET", "/workers/no-such-worker", ""),
    ("DELETE", "/workers/no-such-worker", ""),
    ("POST", "/add_worker", ""),
    ("POST", "/remove_worker", ""),
    ("GET", "/list_workers", ""),
    ("POST", "/flush_cache", ""),
    ("GET", "/flush_cache", ""),
    ("GET", "/get_loads", ""),
    ("GET", "/kv_index/snapshot", ""),
];

/// Of [`ADMIN_ENDPOINTS`], those that only read: the API key opens them when no admin key is
/// set (the reference's fallback). The rest change the worker set, flush caches or copy the KV
/// index: the admin key itself, never the API key.
const READ_ENDPOINTS: &[&str] = &[
    "/workers",
    "/workers/no-such-worker",
    "/list_workers",
    "/get_loads",
];

/// Endpoints that stay open whatever keys are set.
const PUBLIC_ENDPOINTS: &[(&str, &str)] = &[
    ("GET", "/health"),
    ("GET", "/liveness"),
    ("GET", "/readiness"),
    ("GET", "/v1/models"),
    ("GET", "/get_server_info"),
    ("GET", "/server_info"),
];

/// Status of `method path` with an optional bearer key.
fn status_with_key(
    gw: std::net::SocketAddr,
    method: &str,
    path: &str,
    body: &str,
    key: Option<&str>,
) -> u16 {
    let auth = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth
        .as_deref()
        .map(|a| vec![("authorization", a)])
        .unwrap_or_default();
    let r = request(gw, method, path, &headers, body.as_bytes()).unwrap();
    if r.status == 401 {
        assert!(
            r.json()["error"]["message"].is_string(),
            "401 without an OpenAI-style error: {}",
            r.text()
        );
    }
    r.status
}

#[test]
fn every_admin_endpoint_needs_the_admin_key_and_public_ones_stay_open() {
    let cluster = sim(1, |_| {});
    let gw = gateway_for(
        &cluster.urls(),
        &["--api-key", "secret", "--admin-api-key", "root"],
    );
    for &(method, path, body) in ADMIN_ENDPOINTS {
        for key in [None, Some("secret"), Some("wrong")] {
            assert_eq!(
                status_with_key(gw.addr, method, path, body, key),
                401,
                "{method} {path} with key {key:?} must need the admin key"
            );
        }
        let s = status_with_key(gw.addr, method, path, body, Some("root"));
        assert_ne!(s, 401, "{method} {path} refused the admin key");
        assert!(s < 500, "{method} {path} with the admin key: {s}");
    }
    for &(method, path) in PUBLIC_ENDPOINTS {
        assert_eq!(
            status_with_key(gw.addr, method, path, "", None),
            200,
            "{method} {path} must stay open"
        );
    }
    // The worker is still there: no authorized call above removed it.
    assert_eq!(
        request(gw.addr, "GET", "/readiness", &[], b"")
            .unwrap()
            .status,
        200
    );
}

#[test]
fn without_an_admin_key_reads_take_the_api_key_and_control_is_refused() {
    let cluster = sim(1, |_| {});
    let gw = gateway_for_exact(&cluster.urls(), &["--api-key", "secret"]);
    for &(method, path, body) in ADMIN_ENDPOINTS {
        let read = method == "GET" && READ_ENDPOINTS.contains(&path);
        if read {
            for key in [None, Some("wrong"), Some("secre"), Some("secrett")] {
                assert_eq!(
                    status_with_key(gw.addr, method, path, body, key),
                    401,
                    "{method} {path} with key {key:?}"
                );
            }
            let s = status_with_key(gw.addr, method, path, body, Some("secret"));
            assert_ne!(
                s, 401,
                "{method} {path} refused the API key (the admin fallback)"
            );
            assert!(s < 500, "{method} {path} with the API key: {s}");
        } else {
            // No key opens these without --admin-api-key, from this host or any other.
            for key in [None, Some("secret"), Some("wrong")] {
                assert_eq!(
                    status_with_key(gw.addr, method, path, body, key),
                    403,
                    "{method} {path} with key {key:?} and no admin key configured"
                );
            }
        }
    }
    for &(method, path) in PUBLIC_ENDPOINTS {
        assert_eq!(
            status_with_key(gw.addr, method, path, "", None),
            200,
            "{method} {path} must stay open"
        );
    }
}

#[test]
fn slowloris_is_cut_off_by_the_header_timeout() {
    let cluster = sim(1, |_| {});
    let gw = gateway_for(&cluster.urls(), &["--header-timeout-secs", "1"]);
    let mut c = Conn::open(gw.addr);
    let t0 = Instant::now();
    let mut cut = false;
    for b in b"POST /generate HTTP/1.1\r\nhost: x\r\nx-slow: aaaaaaaaaaaaaaaaaaaaaaaa".iter() {
        if c.stream.write_all(&[*b]).is_err() {
            cut = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        if t0.elapsed() > Duration::from_secs(3) {
            break;
        }
    }
    let cut = cut || c.closed_within(Duration::from_secs(2));
    assert!(cut, "a trickling client was not cut off");
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert_still_serves(gw.addr);
}

#[test]
fn non_utf8_prompts_are_refused_cleanly() {
    let cluster = sim(1, |_| {});
    let gw = gateway_for(&cluster.urls(), &[]);
    let mut body = br#"{"prompt":"abc "#.to_vec();
    body.extend_from_slice(&[0xff, 0xfe, 0xc3]);
    body.extend_from_slice(br#"","max_tokens":1}"#);
    let r = request(gw.addr, "POST", "/v1/completions", &[], &body).unwrap();
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"].is_string());
    assert_still_serves(gw.addr);
}

#[test]
fn five_thousand_idle_connections_do_not_slow_normal_traffic() {
    // Serial: the figure is a median latency before and during (at most 3x + 2 ms); a timing
    // test's load arriving between the two would be read as the idle connections' cost.
    let _serial = serial();
    let cluster = sim(1, |_| {});
    let gw = gateway_for(&cluster.urls(), &["--cores", "2"]);
    let measure = || {
        let mut c = Conn::open(gw.addr);
        let mut lat = Vec::new();
        for i in 0..200 {
            let t = Instant::now();
            c.send(&raw_request("POST", "/generate", &[], &gen_body(i)));
            assert_eq!(c.read_response().unwrap().status, 200);
            lat.push(t.elapsed());
        }
        lat.sort();
        lat[lat.len() / 2]
    };
    let before = measure();
    let idle: Vec<std::net::TcpStream> = (0..5000)
        .map(|_| connect_retrying(gw.addr).expect("idle connection"))
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let during = measure();
    assert!(
        during < before * 3 + Duration::from_millis(2),
        "median latency {before:?} → {during:?} with 5000 idle connections"
    );
    drop(idle);
}

#[test]
fn graceful_shutdown_lets_a_stream_finish_and_exits_zero() {
    let cluster = sim(1, |c| {
        c.time_scale = 1.0;
        c.token_interval_ms = Some(50.0);
    });
    // Killed by PID if the test fails before the gateway exits by itself.
    let mut gw = spawn_binary(1, &cluster.urls()[0]);
    let addr = gw.addr;
    let mut c = stream_chat(addr, "stream", 20);
    // SAFETY: plain kill(2) on the child we started.
    unsafe { libc::kill(gw.id() as i32, libc::SIGTERM) };
    let r = c.read_timed_until(b"data: [DONE]", Duration::from_secs(10));
    let all: Vec<u8> = r.into_iter().flat_map(|(_, b)| b).collect();
    assert!(
        String::from_utf8_lossy(&all).contains("[DONE]"),
        "the stream was cut by shutdown"
    );
    let status = wait_with_deadline(&mut gw.child, Duration::from_secs(20));
    assert!(status.success(), "exit status {status:?}");
}

/// Wait for the child to exit; past `limit`, fail (unwinding drops `ChildGuard`, which kills
/// the child by its PID and reaps it).
fn wait_with_deadline(child: &mut ChildGuard, limit: Duration) -> std::process::ExitStatus {
    let until = Instant::now() + limit;
    loop {
        let c = child.0.as_mut().expect("child still owned");
        if let Some(status) = c.try_wait().expect("waitpid") {
            child.0 = None;
            return status;
        }
        assert!(
            Instant::now() < until,
            "the gateway did not exit within {limit:?} of SIGTERM (killing it)"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn unknown_model_names_collapse_into_one_metric_label() {
    let cluster = sim(1, |_| {});
    let gw = gateway_for(&cluster.urls(), &[]);
    let known = "meta-llama/Llama-3.1-8B-Instruct";
    let until = Instant::now() + Duration::from_secs(5);
    while gw.gateway().models.label(Some(known)) != known {
        assert!(Instant::now() < until, "served models never learned");
        std::thread::sleep(Duration::from_millis(20));
    }
    for model in [known, "made-up-model-zzz-1", "made-up-model-zzz-2"] {
        let body = serde_json::to_vec(
            &serde_json::json!({"model": model, "prompt": "hi", "max_tokens": 1}),
        )
        .unwrap();
        assert_eq!(
            request(gw.addr, "POST", "/v1/completions", &[], &body)
                .unwrap()
                .status,
            200
        );
    }
    let rendered = radixgate::metrics::install()
        .map(|h| h.render())
        .unwrap_or_default();
    assert!(
        !rendered.contains("made-up-model-zzz"),
        "client input minted a label value"
    );
    assert!(rendered.contains("model=\"other\""));
    assert!(rendered.contains(&format!("model=\"{known}\"")));
}
