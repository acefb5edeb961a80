//! Reliability and security end to end: retries that avoid the failing worker, circuit
//! breakers, health checks, live worker changes, admission, timeouts, shutdown, API keys and bad
//! input. Faults come from the simulated worker's knobs.

mod common;
use common::*;
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn gen(i: usize) -> Vec<u8> {
    format!(r#"{{"text":"request {i}","sampling_params":{{"max_new_tokens":1}}}}"#).into_bytes()
}

#[test]
fn nothing_is_lost_when_one_of_four_workers_fails_20_percent() {
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
                    c.send(&raw_request("POST", "/generate", &[], &gen(i)));
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
    let good = sim(1, |_| {});
    let bad = sim(1, |c| c.faults.fail_rate = 1.0);
    let urls = vec![bad.urls()[0].clone(), good.urls()[0].clone()];
    // cache_aware would send the same prompt back to the failing worker every time if retries
    // did not exclude it (its tree points there).
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
    for i in 0..20 {
        let r = request(
            gw.addr,
            "POST",
            "/v1/completions",
            &[],
            format!(r#"{{"prompt":"same prompt {}","max_tokens":1}}"#, i % 2).as_bytes(),
        )
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(served_by(&r), good.ports()[0]);
    }
    // With retries disabled the failure reaches the client.
    let gw = gateway_for(&[bad.urls()[0].clone()], &["--disable-retries"]);
    assert_eq!(
        request(gw.addr, "POST", "/generate", &[], &gen(1))
            .unwrap()
            .status,
        500
    );
}

#[test]
fn a_failing_worker_opens_its_circuit_and_4xx_do_not_count() {
    let bad = sim(1, |c| c.faults.fail_rate = 1.0);
    let good = sim(1, |_| {});
    let gw = gateway_for(
        &[bad.urls()[0].clone(), good.urls()[0].clone()],
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
        assert_eq!(
            request(gw.addr, "POST", "/generate", &[], &gen(i))
                .unwrap()
                .status,
            200
        );
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
        let r = request(
            gw.addr,
            "POST",
            "/generate",
            &[],
            br#"{"text":"x","sampling_params":{"max_new_tokens":-5}}"#,
        )
        .unwrap();
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
    std::thread::sleep(Duration::from_millis(300));
    for i in 0..6 {
        assert_eq!(
            served_by(&request(gw.addr, "POST", "/generate", &[], &gen(i)).unwrap()),
            good.ports()[0]
        );
    }
    // Passive detection: a worker that dies is out after its first refused connection.
    let doomed = sim(1, |_| {});
    let gw = gateway_for(
        &[doomed.urls()[0].clone(), good.urls()[0].clone()],
        &["--policy", "round_robin", "--retry-initial-backoff-ms", "1"],
    );
    doomed.shutdown();
    for i in 0..6 {
        let r = request(gw.addr, "POST", "/generate", &[], &gen(i)).unwrap();
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
        c.send(&raw_request("POST", "/generate", &[], &gen(i)));
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
    let r = request(gw.addr, "POST", "/generate", &[], &gen(0)).unwrap();
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
                c.send(&raw_request("POST", "/generate", &[], &gen(i)));
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
    std::thread::sleep(Duration::from_millis(200));
    let r = request(
        gw.addr,
        "POST",
        "/workers",
        &[],
        format!(r#"{{"url":"{}"}}"#, b.urls()[0]).as_bytes(),
    )
    .unwrap();
    assert_eq!(r.status, 202, "{}", r.text());
    std::thread::sleep(Duration::from_millis(200));
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
    std::thread::sleep(Duration::from_millis(200));
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

#[test]
fn admission_queue_full_is_429_and_queue_timeout_is_408() {
    let slow = sim(1, |c| c.faults.latency_ms = 600);
    let gw = gateway_for(
        &slow.urls(),
        &[
            "--max-concurrent-requests",
            "1",
            "--queue-size",
            "1",
            "--queue-timeout-secs",
            "1",
            "--rate-limit-tokens-per-second",
            "1000",
        ],
    );
    let addr = gw.addr;
    let first = std::thread::spawn(move || {
        request(addr, "POST", "/generate", &[], &gen(0))
            .unwrap()
            .status
    });
    std::thread::sleep(Duration::from_millis(100));
    let queued = std::thread::spawn(move || {
        request(addr, "POST", "/generate", &[], &gen(1))
            .unwrap()
            .status
    });
    std::thread::sleep(Duration::from_millis(100));
    let refused = request(addr, "POST", "/generate", &[], &gen(2)).unwrap();
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(first.join().unwrap(), 200);
    assert_eq!(queued.join().unwrap(), 200);

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
    let _hog = std::thread::spawn(move || request(addr, "POST", "/generate", &[], &gen(0)));
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        request(addr, "POST", "/generate", &[], &gen(1))
            .unwrap()
            .status,
        408
    );
}

#[test]
fn api_keys_guard_inference_and_admin_endpoints() {
    let cluster = sim(1, |_| {});
    let gw = gateway_for(
        &cluster.urls(),
        &["--api-key", "secret", "--admin-api-key", "root"],
    );
    let r = request(gw.addr, "POST", "/generate", &[], &gen(0)).unwrap();
    assert_eq!(r.status, 401);
    assert!(r.json()["error"]["message"].is_string());
    // (method, path, bearer key) → status.
    let status = |method: &str, path: &str, key: &str| {
        let auth = format!("Bearer {key}");
        let body = if method == "POST" { gen(0) } else { Vec::new() };
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
    let cluster = sim(1, |_| {});
    let gw = gateway_for(&cluster.urls(), &["--cores", "2"]);
    let measure = || {
        let mut c = Conn::open(gw.addr);
        let mut lat = Vec::new();
        for i in 0..200 {
            let t = Instant::now();
            c.send(&raw_request("POST", "/generate", &[], &gen(i)));
            assert_eq!(c.read_response().unwrap().status, 200);
            lat.push(t.elapsed());
        }
        lat.sort();
        lat[lat.len() / 2]
    };
    let before = measure();
    let idle: Vec<std::net::TcpStream> = (0..5000)
        .map(|_| std::net::TcpStream::connect(gw.addr).expect("idle connection"))
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
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_radixgate"))
        .args([
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--prometheus-port",
            "0",
            "--cores",
            "1",
            "--log-level",
            "warn",
            "--worker-urls",
            &cluster.urls()[0],
        ])
        .spawn()
        .expect("start radixgate");
    // Killed by PID if the test fails before the gateway exits by itself.
    let mut child = KillOnDrop(Some(child));
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_ready(addr, Duration::from_secs(20));
    let mut c = Conn::open(addr);
    c.send(&raw_request(
        "POST",
        "/v1/chat/completions",
        &[],
        &chat_body(&[("user", "stream")], true, 20),
    ));
    let _ = c.read_head(false).unwrap();
    // SAFETY: plain kill(2) on the child we started.
    unsafe { libc::kill(child.0.as_ref().unwrap().id() as i32, libc::SIGTERM) };
    let r = c.read_timed_until(b"data: [DONE]", Duration::from_secs(10));
    let all: Vec<u8> = r.into_iter().flat_map(|(_, b)| b).collect();
    assert!(
        String::from_utf8_lossy(&all).contains("[DONE]"),
        "the stream was cut by shutdown"
    );
    let status = child.0.take().unwrap().wait().unwrap();
    assert!(status.success(), "exit status {status:?}");
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

struct KillOnDrop(Option<std::process::Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
