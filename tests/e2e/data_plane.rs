//! End-to-end tests of the HTTP/1.1 data plane over real sockets on 127.0.0.1: a gateway
//! in-process in front of simulated SGLang workers. scripts/test.sh runs it, with the rest of
//! the e2e binary, twice: with `RADIXGATE_TEST_IO_DRIVER=uring` and with
//! `RADIXGATE_TEST_IO_DRIVER=epoll` (see `common`: every gateway then runs on, and is checked
//! to report, that driver).

use crate::common::*;
use std::time::{Duration, Instant};

#[test]
fn non_streaming_and_streaming_chat() {
    let cluster = sim(2, |_| {});
    let gw = gateway_for(&cluster.urls(), &["--policy", "round_robin"]);
    let r = request(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        &chat_body(&[("user", "hello")], false, 4),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert!(!v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .is_empty());
    assert!(r.header("x-request-id").unwrap().starts_with("chatcmpl-"));

    let r = chat(gw.addr, "hello", true, 4);
    assert_eq!(r.status, 200);
    let text = r.text();
    assert!(text.contains("data: {"), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
}

#[test]
fn sse_events_arrive_one_by_one_with_the_upstream_pacing() {
    let cluster = sim(1, |c| {
        c.time_scale = 1.0;
        c.token_interval_ms = Some(60.0);
    });
    let gw = gateway_for(&cluster.urls(), &[]);
    let mut c = stream_chat(gw.addr, "pace me", 6);
    let reads = c.read_timed_until(b"data: [DONE]", Duration::from_secs(10));
    let content_reads: Vec<Instant> = reads
        .iter()
        .filter(|(_, b)| String::from_utf8_lossy(b).contains("\"content\""))
        .map(|(t, _)| *t)
        .collect();
    assert!(
        content_reads.len() >= 5,
        "events were coalesced: {} reads",
        content_reads.len()
    );
    let gaps: Vec<Duration> = content_reads.windows(2).map(|w| w[1] - w[0]).collect();
    let paced = gaps
        .iter()
        .filter(|g| **g >= Duration::from_millis(30))
        .count();
    assert!(paced >= 3, "events not paced like the upstream: {gaps:?}");
}

#[test]
fn unknown_fields_and_custom_headers_reach_the_upstream_unchanged() {
    let cluster = sim(1, |_| {});
    let gw = gateway_for(&cluster.urls(), &[]);
    let body = br#"{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[{"role":"user","content":"x"}],"max_tokens":2,"my_unknown_field":{"nested":[1,2.50,"\u00e9"]},   "spacing" : true}"#;
    let r = request(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[
            ("x-foo", "Bar baz"),
            ("x-request-id", "my-id-1"),
            ("connection", "keep-alive"),
            ("keep-alive", "timeout=5"),
        ],
        body,
    )
    .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-request-id"), Some("my-id-1"));
    let port = cluster.ports()[0];
    let dbg = request(
        format!("127.0.0.1:{port}").parse().unwrap(),
        "GET",
        "/debug/requests",
        &[],
        b"",
    )
    .unwrap()
    .json();
    let last = dbg
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|r| r["path"] == "/v1/chat/completions")
        .expect("recorded")
        .clone();
    assert_eq!(
        last["body"].as_str().unwrap().as_bytes(),
        &body[..],
        "body bytes changed"
    );
    let headers: Vec<(String, String)> = last["headers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| {
            (
                h[0].as_str().unwrap().to_ascii_lowercase(),
                h[1].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert!(
        headers.contains(&("x-foo".into(), "Bar baz".into())),
        "{headers:?}"
    );
    assert!(
        headers.contains(&("x-request-id".into(), "my-id-1".into())),
        "{headers:?}"
    );
    assert!(
        !headers.iter().any(|(n, _)| n == "keep-alive"),
        "hop-by-hop header forwarded: {headers:?}"
    );
}

#[test]
fn bodies_of_every_size_reach_the_upstream_byte_for_byte() {
    // Head and body leave in one vectored write, never copied together: small bodies, the
    // sizes around the old copy limit, and bodies large enough for partial writes (the rest
    // of a partly written body must follow from where the write stopped).
    let cluster = sim(1, |c| c.max_total_tokens = 8_000_000);
    let gw = gateway_for(&cluster.urls(), &[]);
    for size in [40, 16 * 1024 - 1, 16 * 1024 + 1, 300 * 1024, 1200 * 1024] {
        let filler: String = (0..size).map(|i| (b'a' + (i % 26) as u8) as char).collect();
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"{filler}"}}],"max_tokens":1}}"#
        );
        let r = request(
            gw.addr,
            "POST",
            "/v1/chat/completions",
            &[],
            body.as_bytes(),
        )
        .unwrap();
        assert_eq!(r.status, 200, "{size}: {}", r.text());
        let got = sim_last_body(&cluster, 0, "/v1/chat/completions");
        let first_diff = got.bytes().zip(body.bytes()).position(|(a, b)| a != b);
        assert!(
            got == body,
            "body of {size} bytes changed on its way: {} bytes arrived, {} sent, first \
             difference at {first_diff:?}",
            got.len(),
            body.len(),
        );
    }
}

#[test]
fn request_id_is_generated_when_absent_and_taken_from_configured_headers() {
    let cluster = sim(1, |_| {});
    let gw = gateway_for(&cluster.urls(), &[]);
    let r = generate(
        gw.addr,
        br#"{"text":"hi","sampling_params":{"max_new_tokens":2}}"#,
    );
    let id = r.header("x-request-id").unwrap();
    assert!(id.starts_with("gnt-") && id.len() == 4 + 24, "{id}");
    let r = request(
        gw.addr,
        "POST",
        "/generate",
        &[("x-correlation-id", "corr-7")],
        br#"{"text":"hi","sampling_params":{"max_new_tokens":2}}"#,
    )
    .unwrap();
    assert_eq!(r.header("x-request-id"), Some("corr-7"));
}

#[test]
fn keep_alive_connections_serve_many_requests_and_reuse_upstreams() {
    // Measured on this test's own worker (the gateway's metrics are process-wide, shared with
    // the tests running beside it): how many connections carried inference requests.
    let cluster = sim(1, |_| {});
    let gw = gateway_for(&cluster.urls(), &[]);
    let n = 10;
    let mut c = Conn::open(gw.addr);
    for i in 0..n {
        c.send(&raw_request(
            "POST",
            "/generate",
            &[],
            format!(r#"{{"text":"req {i}","sampling_params":{{"max_new_tokens":2}}}}"#).as_bytes(),
        ));
        let r = c.read_response().unwrap();
        assert_eq!(r.status, 200, "request {i}");
    }
    // Fresh client connections reuse the same upstream connections too.
    for i in 0..n {
        let r = request(
            gw.addr,
            "POST",
            "/generate",
            &[],
            format!(r#"{{"text":"fresh {i}","sampling_params":{{"max_new_tokens":2}}}}"#)
                .as_bytes(),
        )
        .unwrap();
        assert_eq!(r.status, 200, "request {i}");
    }
    let stats = sim_stats(&cluster, 0);
    assert_eq!(stats["inference_received"], 2 * n, "{stats}");
    let upstream = stats["inference_connections"].as_u64().unwrap();
    assert!(
        upstream <= 2,
        "{} sequential requests used {upstream} upstream connections: not reused ({stats})",
        2 * n
    );
}

#[test]
fn pipelined_requests_are_answered_in_order() {
    let cluster = sim(1, |_| {});
    let gw = gateway_for(&cluster.urls(), &[]);
    let mut c = Conn::open(gw.addr);
    let mut all = Vec::new();
    all.extend(raw_request(
        "POST",
        "/generate",
        &[("x-request-id", "first")],
        br#"{"text":"one","sampling_params":{"max_new_tokens":3}}"#,
    ));
    all.extend(raw_request(
        "GET",
        "/health",
        &[("x-request-id", "second")],
        b"",
    ));
    all.extend(raw_request(
        "POST",
        "/generate",
        &[("x-request-id", "third")],
        br#"{"text":"three","sampling_params":{"max_new_tokens":1}}"#,
    ));
    c.send(&all);
    let a = c.read_response().unwrap();
    let b = c.read_response().unwrap();
    let d = c.read_response().unwrap();
    assert_eq!(a.header("x-request-id"), Some("first"));
    assert_eq!(b.text(), "OK");
    assert_eq!(d.header("x-request-id"), Some("third"));
}

#[test]
fn chunked_request_body_and_100_continue() {
    let cluster = sim(1, |_| {});
    let gw = gateway_for(&cluster.urls(), &[]);
    let body = br#"{"text":"chunked body","sampling_params":{"max_new_tokens":2}}"#;
    let mut raw =
        b"POST /generate HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    for part in body.chunks(10) {
        raw.extend(format!("{:x};ext=1\r\n", part.len()).as_bytes());
        raw.extend(part);
        raw.extend(b"\r\n");
    }
    raw.extend(b"0\r\ntrailer: x\r\n\r\n");
    let mut c = Conn::open(gw.addr);
    c.send(&raw);
    assert_eq!(c.read_response().unwrap().status, 200);

    let mut c = Conn::open(gw.addr);
    c.send(format!("POST /generate HTTP/1.1\r\nhost: t\r\nexpect: 100-continue\r\ncontent-length: {}\r\n\r\n", body.len()).as_bytes());
    let interim = c.read_head(true).unwrap();
    assert_eq!(interim.status, 100);
    c.send(body);
    assert_eq!(c.read_response().unwrap().status, 200);
}

#[test]
fn oversized_and_malformed_requests_get_their_status_and_the_gateway_keeps_serving() {
    let cluster = sim(1, |_| {});
    let gw = gateway_for(&cluster.urls(), &["--max-payload-size", "1000"]);
    let cases: Vec<(Vec<u8>, u16)> = vec![
        (raw_request("POST", "/generate", &[], &vec![b'x'; 2000]), 413),
        ([b"GET / HTTP/1.1\r\nhost: t\r\nx-big: ".to_vec(), vec![b'a'; 70 * 1024], b"\r\n\r\n".to_vec()].concat(), 431),
        (b"POST /generate HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n".to_vec(), 400),
        (b"POST /generate HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello".to_vec(), 400),
        (b"POST /generate HTTP/1.1\r\nhost: t\r\ntransfer-encoding: gzip\r\n\r\n".to_vec(), 400),
        (b"POST /generate HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n".to_vec(), 400),
        (b"POST /generate HTTP/1.1\r\nhost: t\r\ncontent-length: -1\r\n\r\n".to_vec(), 400),
        (b"GARBAGE\r\n\r\n".to_vec(), 400),
        (b"GET / HTTP/1.1\r\nhost t\r\n\r\n".to_vec(), 400),
        (raw_request("POST", "/v1/chat/completions", &[], b"{not json"), 400),
        (raw_request("POST", "/v1/chat/completions", &[], br#"{"model":"m"}"#), 400),
        (raw_request("GET", "/no/such/path", &[], b""), 404),
    ];
    for (raw, want) in cases {
        let mut c = Conn::open(gw.addr);
        c.send(&raw);
        let r = c.read_response().unwrap_or_else(|e| {
            panic!(
                "no response to {:?}: {e}",
                String::from_utf8_lossy(&raw[..raw.len().min(80)])
            )
        });
        assert_eq!(
            r.status,
            want,
            "for {:?}: {}",
            String::from_utf8_lossy(&raw[..raw.len().min(80)]),
            r.text()
        );
        let v = r.json();
        assert!(
            v["error"]["message"].is_string(),
            "not an OpenAI-style error: {v}"
        );
        assert_still_serves(gw.addr);
    }
}

#[test]
fn smuggling_attempts_get_400_the_connection_closes_and_the_tail_never_reaches_a_worker() {
    let cluster = sim(1, |c| c.record_requests = 256);
    let gw = gateway_for(&cluster.urls(), &[]);
    // Each attempt is followed, on the same connection, by a smuggled request that must never
    // be parsed as a request of its own nor reach the worker inside a body.
    let tail = raw_request(
        "POST",
        "/generate",
        &[("x-smuggled", "yes")],
        br#"{"text":"SMUGGLED-TAIL","sampling_params":{"max_new_tokens":1}}"#,
    );
    let attempts: Vec<(&str, Vec<u8>)> = vec![
        ("content-length and transfer-encoding", b"POST /generate HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n".to_vec()),
        ("transfer-encoding and content-length", b"POST /generate HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\ncontent-length: 40\r\n\r\n0\r\n\r\n".to_vec()),
        ("two differing content-lengths", b"POST /generate HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello".to_vec()),
        ("a content-length list", b"POST /generate HTTP/1.1\r\nhost: t\r\ncontent-length: 5, 6\r\n\r\nhello".to_vec()),
        ("an unknown transfer-encoding", b"POST /generate HTTP/1.1\r\nhost: t\r\ntransfer-encoding: gzip\r\n\r\n".to_vec()),
        ("chunked not last", b"POST /generate HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked, identity\r\n\r\n0\r\n\r\n".to_vec()),
        ("a bad chunk size", b"POST /generate HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n".to_vec()),
        ("a negative content-length", b"POST /generate HTTP/1.1\r\nhost: t\r\ncontent-length: -1\r\n\r\n".to_vec()),
        ("a space before the colon", b"POST /generate HTTP/1.1\r\nhost: t\r\ncontent-length : 5\r\n\r\nhello".to_vec()),
        ("an obs-fold", b"POST /generate HTTP/1.1\r\nhost: t\r\ntransfer-encoding:\r\n chunked\r\n\r\n0\r\n\r\n".to_vec()),
    ];
    for (what, attempt) in attempts {
        let mut c = Conn::open(gw.addr);
        c.send(&[attempt, tail.clone()].concat());
        let r = c
            .read_response()
            .unwrap_or_else(|e| panic!("{what}: no response: {e}"));
        assert_eq!(r.status, 400, "{what}: {}", r.text());
        assert!(
            r.json()["error"]["message"].is_string(),
            "{what}: not an OpenAI-style error"
        );
        if let Err(e) = c.closes_silently_within(Duration::from_secs(5)) {
            panic!("{what}: after the 400 the connection must close: {e}");
        }
        let seen = sim_recorded(&cluster, 0);
        assert!(
            !seen.contains("SMUGGLED-TAIL") && !seen.contains("x-smuggled"),
            "{what}: the smuggled request reached the worker: {seen}"
        );
    }
    assert_eq!(
        sim_count(&cluster, 0, "inference_received"),
        0,
        "a smuggling attempt reached the worker"
    );
    assert_still_serves(gw.addr);
}

#[test]
fn the_gateway_process_runs_on_the_io_driver_it_reports() {
    // The in-process gateways share one process with the sims; a child process shows its own
    // driver through its file descriptors: io_uring instances are `anon_inode:[io_uring]`.
    let cluster = sim(1, |_| {});
    let child = spawn_binary(2, &cluster.urls()[0]);
    let addr = child.addr;
    let info = request(addr, "GET", "/get_server_info", &[], b"")
        .unwrap()
        .json();
    let reported = info["io_driver"].as_str().unwrap().to_string();
    if let Some(d) = test_driver() {
        assert_eq!(reported, d.reported(), "RADIXGATE_TEST_IO_DRIVER={d:?}");
    }
    let pid = child.id();
    let fds: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let rings = fds.iter().filter(|f| f.contains("io_uring")).count();
    match reported.as_str() {
        "io_uring" => assert!(
            rings >= 2,
            "reports io_uring but has {rings} rings for 2 cores: {fds:?}"
        ),
        "epoll" => {
            assert_eq!(rings, 0, "reports epoll but has io_uring rings: {fds:?}");
            assert!(
                fds.iter().any(|f| f.contains("eventpoll")),
                "reports epoll but has no epoll fd: {fds:?}"
            );
        }
        other => panic!("unknown io_driver {other}"),
    }
}

#[test]
fn upstream_down_gives_a_json_gateway_error() {
    // A port with nothing listening (held, so nothing starts listening there meanwhile).
    let dead = closed_port();
    let url = format!("http://127.0.0.1:{}", dead.port);
    let gw = gateway(&["--worker-urls", &url, "--disable-health-check"]);
    let r = generate(gw.addr, br#"{"text":"x"}"#);
    assert!(r.status == 502 || r.status == 503, "status {}", r.status);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("connect"));
    assert!(r.header("x-request-id").is_some());
}

#[test]
fn readiness_is_503_until_a_worker_answers() {
    let dead = closed_port();
    let url = format!("http://127.0.0.1:{}", dead.port);
    let gw = gateway(&["--worker-urls", &url]);
    let r = request(gw.addr, "GET", "/readiness", &[], b"").unwrap();
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["healthy_workers"], 0);
    assert_eq!(
        request(gw.addr, "GET", "/liveness", &[], b"")
            .unwrap()
            .status,
        200
    );
    let none = gateway(&[]);
    assert_eq!(
        request(none.addr, "GET", "/readiness", &[], b"")
            .unwrap()
            .status,
        503
    );
}

#[test]
fn client_disconnect_mid_stream_frees_the_upstream() {
    // The gateway notices when its next write to the client fails.
    client_leaves_and_the_upstream_is_freed(true);
}

#[test]
fn client_leaving_before_the_answer_aborts_the_upstream_request() {
    // Non-streaming: nothing comes back for 10 s, so only watching the client socket can tell.
    client_leaves_and_the_upstream_is_freed(false);
}

fn client_leaves_and_the_upstream_is_freed(stream: bool) {
    let cluster = sim(1, |c| {
        c.time_scale = 1.0;
        c.token_interval_ms = Some(50.0);
    });
    let gw = gateway_for(&cluster.urls(), &[]);
    let worker = format!("127.0.0.1:{}", cluster.ports()[0]).parse().unwrap();
    let mut c = Conn::open(gw.addr);
    c.send(&raw_request(
        "POST",
        "/v1/chat/completions",
        &[],
        &chat_body(&[("user", "long story")], stream, 200),
    ));
    if stream {
        let _ = c.read_timed_until(b"\"content\"", Duration::from_secs(5));
    } else {
        wait_until("the request at the worker", Duration::from_secs(5), || {
            (sim_count(&cluster, 0, "inference_in_progress") == 1).then_some(())
        });
    }
    drop(c);
    wait_for_upstream_abort(worker, Duration::from_secs(5));
    // And the gateway's in-flight count for that worker is back to zero.
    let list = gw.gateway().registry.load_full();
    let until = Instant::now() + Duration::from_secs(2);
    while gw.gateway().registry.loads.load(list.ids[0]) != 0 {
        assert!(Instant::now() < until, "in-flight count not released");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn models_are_merged_and_server_info_describes_the_gateway() {
    let cluster = sim(2, |_| {});
    let gw = gateway_for(&cluster.urls(), &[]);
    let m = request(gw.addr, "GET", "/v1/models", &[], b"").unwrap();
    assert_eq!(m.status, 200);
    let data = m.json()["data"].as_array().unwrap().clone();
    assert_eq!(data.len(), 1, "identical model cards are merged: {data:?}");
    let info = request(gw.addr, "GET", "/get_server_info", &[], b"")
        .unwrap()
        .json();
    assert_eq!(info["config"]["policy"], "cache_aware");
    assert_eq!(info["workers"].as_array().unwrap().len(), 2);
    let mi = request(gw.addr, "GET", "/get_model_info", &[], b"").unwrap();
    assert_eq!(mi.status, 200);
    assert!(mi.json()["model_path"].is_string());
}

#[test]
fn a_second_gateway_on_the_same_port_refuses_to_start() {
    let first = gateway(&[]);
    let port = first.addr.port().to_string();
    let cfg = radixgate::config::Config::try_from_args(
        &[
            "radixgate",
            "--host",
            "127.0.0.1",
            "--port",
            &port,
            "--prometheus-port",
            "0",
        ]
        .map(String::from),
    )
    .unwrap();
    let err = radixgate::runtime::start(cfg)
        .err()
        .expect("second gateway must refuse");
    assert!(err.contains("already in use"), "{err}");
}

/// Wait until the simulated worker counts an aborted request (the gateway closed the upstream).
fn wait_for_upstream_abort(worker: std::net::SocketAddr, limit: Duration) {
    let until = Instant::now() + limit;
    loop {
        let m = request(worker, "GET", "/metrics", &[], b"").unwrap().text();
        if m.lines().any(|l| {
            l.starts_with("sglang:num_aborted_requests_total") && !l.trim_end().ends_with(" 0")
        }) {
            return;
        }
        assert!(
            Instant::now() < until,
            "upstream request not aborted within {limit:?}:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `--busy-poll-us`: a core polls without sleeping only in the window after each request
/// event. Requests paced 0.3 ms apart keep a 1 ms window (the flag's cap) open, so the gateway spends far more CPU
/// on them than one that sleeps at once, and still answers every one; before and after the
/// traffic the core sleeps (an idle gateway spends nothing).
#[test]
fn busy_polling_spends_cpu_only_in_its_window() {
    // Serial: the figures are CPU shares of the child gateway (idle under 0.1 CPU-s, polling
    // over 0.3 of a CPU); a timing test beside it on the 2 CPUs would take the CPU the polling
    // core needs, and add wake-ups to the idle one.
    let _serial = serial();
    let cluster = sim(1, |_| {});
    let url = &cluster.urls()[0];
    let clk = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let mut paced_share = Vec::new();
    for window in ["1000", "0"] {
        let child = spawn_binary_with(1, url, &["--busy-poll-us", window]);
        let addr = child.addr;
        let info = request(addr, "GET", "/get_server_info", &[], b"")
            .unwrap()
            .json();
        assert_eq!(
            info["config"]["busy_poll_us"].as_u64().unwrap().to_string(),
            window
        );
        assert_eq!(chat(addr, "warm up", false, 1).status, 200);
        let idle = |what: &str| {
            std::thread::sleep(Duration::from_millis(100));
            let t0 = cpu_ticks(child.id());
            std::thread::sleep(Duration::from_millis(500));
            let used = (cpu_ticks(child.id()) - t0) as f64 / clk;
            assert!(
                used < 0.1,
                "--busy-poll-us {window}, {what}: {used:.2} CPU-s in 0.5 s of idleness"
            );
        };
        idle("before the traffic");
        let mut conn = Conn::open(addr);
        let body = chat_body(&[("user", "paced")], false, 1);
        let mut raw = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        raw.extend_from_slice(&body);
        let t0 = cpu_ticks(child.id());
        let started = Instant::now();
        let mut answered = 0;
        while started.elapsed() < Duration::from_millis(1500) {
            conn.send(&raw);
            let r = conn.read_response().expect("answer");
            assert_eq!(r.status, 200, "{}", r.text());
            answered += 1;
            std::thread::sleep(Duration::from_micros(300));
        }
        let share = (cpu_ticks(child.id()) - t0) as f64 / clk / started.elapsed().as_secs_f64();
        assert!(answered > 100, "{answered} paced requests answered");
        paced_share.push(share);
        idle("after the traffic");
    }
    let (polling, sleeping) = (paced_share[0], paced_share[1]);
    assert!(
        polling > 0.3 && polling > 2.0 * sleeping,
        "paced traffic: {polling:.2} of a CPU with a 1 ms window, {sleeping:.2} without"
    );
}

// ---- against the foreign upstream (aiohttp, tests/fixtures/foreign_upstream.py) -------------
// The upstream's HTTP is aiohttp's and the client's is ureq's: nothing on the wire between
// them was written or parsed by radixgate's code except the gateway itself.

/// `path` through the gateway: 200, served by `f`, and the body byte for byte what `f` wrote.
fn relayed_exactly(
    gw: std::net::SocketAddr,
    f: &Foreign,
    method: &str,
    path: &str,
    body: &[u8],
) -> Response {
    let r = request(
        gw,
        method,
        path,
        &[("content-type", "application/json")],
        body,
    )
    .unwrap();
    assert_eq!(r.status, 200, "{path}: {}", r.text());
    assert_eq!(served_by(&r), f.port, "{path}");
    assert_eq!(
        r.text(),
        f.last_answer(path),
        "{path}: the body as aiohttp's server wrote it"
    );
    r
}

#[test]
fn foreign_upstream_every_sglang_endpoint_is_proxied_byte_exact() {
    let f = Foreign::start(&[]);
    let gw = gateway_for(&[f.url()], &[]);
    // Health checks reached it (readiness needs one).
    assert!(f.records().iter().any(|r| r["path"] == "/health"));

    relayed_exactly(gw.addr, &f, "GET", "/get_model_info", b"");
    relayed_exactly(gw.addr, &f, "GET", "/health_generate", b"");
    let cases: [(&str, &[u8]); 6] = [
        ("/generate", br#"{"text":"the quick brown fox","sampling_params":{"max_new_tokens":5},"rid":"r-1"}"#),
        ("/generate", br#"{"input_ids":[[11,12,13],[14,15]],"sampling_params":{"max_new_tokens":3}}"#),
        ("/generate", br#"{"input_ids":[1,2,3],"return_logprob":true,"logprob_start_len":0,"sampling_params":{"max_new_tokens":2},"unknown_field":{"kept":[1,2]}}"#),
        ("/v1/chat/completions", &chat_body(&[("system", "be brief"), ("user", "tell me a story")], false, 4)),
        ("/v1/completions", br#"{"model":"m","prompt":["one two","three four five"],"max_tokens":3}"#),
        ("/v1/completions", br#"{"prompt":[7,8,9],"max_tokens":2}"#),
    ];
    for (path, body) in cases {
        let r = relayed_exactly(gw.addr, &f, "POST", path, body);
        assert!(r
            .header("content-type")
            .is_some_and(|t| t.starts_with("application/json")));
        // The request body reached it unchanged.
        assert_eq!(
            f.last(path)["body"].as_str().unwrap().as_bytes(),
            body,
            "{path}"
        );
    }
    let v = relayed_exactly(
        gw.addr,
        &f,
        "POST",
        "/generate",
        br#"{"text":"a b c","sampling_params":{"max_new_tokens":4}}"#,
    )
    .json();
    assert_eq!(v["text"], "a b c a");
    assert_eq!(v["meta_info"]["prompt_tokens"], 3);
    assert_eq!(v["meta_info"]["completion_tokens"], 4);

    // What the gateway answers itself from what the upstream told it.
    let models = request(gw.addr, "GET", "/v1/models", &[], b"")
        .unwrap()
        .json();
    assert_eq!(
        models["data"][0]["id"], "meta-llama/Llama-3.1-8B-Instruct",
        "{models}"
    );
    // Fan-outs: /flush_cache reaches it and the SGLang text comes back in the summary.
    let r = request(gw.addr, "POST", "/flush_cache", &[], b"").unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(f.count("flushes"), 1);
    // An upstream error answer (SGLang's shape, status 400) is passed through as is.
    let r = request(gw.addr, "POST", "/generate", &[], br#"{"input_ids":[]}"#).unwrap();
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.text(), f.last_answer("/generate"));
}

#[test]
fn foreign_upstream_sse_streams_are_relayed_byte_exact_with_chunked_framing() {
    let f = Foreign::start(&["--token-delay-ms", "2"]);
    let gw = gateway_for(&[f.url()], &[]);
    let streams: [(&str, Vec<u8>); 4] = [
        ("/generate", br#"{"text":"stream me some words","stream":true,"sampling_params":{"max_new_tokens":6}}"#.to_vec()),
        ("/generate", br#"{"input_ids":[3,4,5],"stream":true,"return_logprob":true,"logprob_start_len":1,"sampling_params":{"max_new_tokens":3}}"#.to_vec()),
        ("/v1/chat/completions", br#"{"messages":[{"role":"user","content":"caf\u00e9 \"quoted\" words"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":5}"#.to_vec()),
        ("/v1/completions", br#"{"prompt":"complete this","stream":true,"max_tokens":4}"#.to_vec()),
    ];
    // Each event in one chunk, then each event split across two chunks (an event boundary is
    // not a chunk boundary).
    for split in [false, true] {
        f.knobs(serde_json::json!({ "split_events": split }));
        for (path, body) in &streams {
            let mut s = Streaming::open(gw.addr, "POST", path, &[], body).unwrap();
            assert_eq!(s.status, 200, "{path}");
            assert_eq!(
                s.header("transfer-encoding"),
                Some("chunked"),
                "{path}: {:?}",
                s.headers
            );
            assert!(s.header("content-length").is_none(), "{path}");
            assert!(s
                .header("content-type")
                .is_some_and(|t| t.starts_with("text/event-stream")));
            assert_eq!(s.header("x-worker-port"), Some(f.port.to_string().as_str()));
            // ureq decodes the chunked body and fails on a missing or malformed last chunk.
            let got = s
                .read_to_end()
                .unwrap_or_else(|e| panic!("{path} (split {split}): {e}"));
            let want = f.last_answer(path);
            assert_eq!(
                String::from_utf8(got).unwrap(),
                want,
                "{path} (split {split})"
            );
            assert!(want.ends_with("data: [DONE]\n\n"), "{want}");
        }
    }
}

#[test]
fn foreign_upstream_events_reach_the_client_as_they_are_written() {
    // Its figures are delays between events: not beside another test's load.
    let _serial = serial();
    let f = Foreign::start(&["--token-delay-ms", "80"]);
    let gw = gateway_for(&[f.url()], &[]);
    let mut s = stream_chat(gw.addr, "pace me now please", 6);
    let reads = s.read_timed_until(b"data: [DONE]", Duration::from_secs(10));
    let content: Vec<Instant> = reads
        .iter()
        .filter(|(_, b)| String::from_utf8_lossy(b).contains("\"content\""))
        .map(|(t, _)| *t)
        .collect();
    assert!(
        content.len() >= 5,
        "events were held back and coalesced: {} reads",
        content.len()
    );
    let gaps: Vec<Duration> = content.windows(2).map(|w| w[1] - w[0]).collect();
    let paced = gaps
        .iter()
        .filter(|g| **g >= Duration::from_millis(40))
        .count();
    assert!(paced >= 3, "events not paced like the upstream: {gaps:?}");
    // The first event came long before the last one was written.
    assert!(
        content[0] - s.head_at < Duration::from_millis(200),
        "first event late"
    );
}

#[test]
fn foreign_upstream_connections_are_kept_alive_and_reused() {
    let f = Foreign::start(&[]);
    let gw = gateway_for(&[f.url()], &[]);
    for i in 0..8 {
        let stream = i % 2 == 1;
        let r = chat(gw.addr, &format!("request number {i}"), stream, 3);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.text(), f.last_answer("/v1/chat/completions"));
    }
    assert_eq!(f.count("received"), 8);
    assert_eq!(
        f.count("inference_connections"),
        1,
        "every request after the first reused the pooled connection: {}",
        f.stats()
    );
}

#[test]
fn foreign_upstream_closing_an_idle_connection_is_not_a_failed_request() {
    // aiohttp closes idle keep-alive connections after 0.3 s, long before the gateway's pool
    // lets go of them (4 s): the next request finds its pooled connection closed.
    let f = Foreign::start(&["--keepalive-timeout-s", "0.3"]);
    let gw = gateway_for(&[f.url()], &["--disable-retries"]);
    for i in 0..3 {
        let r = generate(gw.addr, format!(r#"{{"text":"turn {i}"}}"#).as_bytes());
        assert_eq!(r.status, 200, "turn {i}: {}", r.text());
        std::thread::sleep(Duration::from_millis(700));
    }
    assert_eq!(f.count("received"), 3, "{}", f.stats());
    assert_eq!(
        f.count("inference_connections"),
        3,
        "a new connection after each idle close"
    );
}

#[test]
fn foreign_upstream_closing_mid_stream_ends_the_client_stream_with_an_error_event() {
    let f = Foreign::start(&["--token-delay-ms", "5"]);
    let gw = gateway_for(&[f.url()], &[]);
    f.knobs(serde_json::json!({"close_after_events": 2}));
    let body = br#"{"text":"a b c d e f","stream":true,"sampling_params":{"max_new_tokens":10}}"#;
    let mut s = Streaming::open(gw.addr, "POST", "/generate", &[], body).unwrap();
    assert_eq!(s.status, 200);
    let got = String::from_utf8(s.read_to_end().expect("a cleanly ended chunked body")).unwrap();
    let written = f.last_answer("/generate");
    assert_eq!(written.matches("data: ").count(), 2, "{written}");
    assert!(
        got.starts_with(&written),
        "the two events, as written: {got}"
    );
    let rest = &got[written.len()..];
    assert!(
        rest.contains("\"error\""),
        "an error event after them: {rest}"
    );
    assert!(!got.contains("[DONE]"), "the stream did not end: {got}");
    assert_eq!(f.count("cut_streams"), 1);
    // The broken connection is not reused; the next request is served on a new one.
    f.knobs(serde_json::json!({"close_after_events": null}));
    let r = generate(gw.addr, br#"{"text":"after the cut"}"#);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(f.count("inference_connections"), 2, "{}", f.stats());
}

#[test]
fn foreign_upstream_abort_request_ends_its_running_stream() {
    let f = Foreign::start(&["--token-delay-ms", "50"]);
    let gw = gateway_for(&[f.url()], &[]);
    let body = br#"{"text":"a long answer","rid":"foreign-rid-1","stream":true,"sampling_params":{"max_new_tokens":200}}"#;
    let mut s = Streaming::open(gw.addr, "POST", "/generate", &[], body).unwrap();
    let _ = s.read_timed_until(b"\n\n", Duration::from_secs(5));
    let r = request(
        gw.addr,
        "POST",
        "/abort_request",
        &[],
        br#"{"rid":"foreign-rid-1"}"#,
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let rest = String::from_utf8(s.read_to_end().unwrap()).unwrap();
    assert!(
        rest.contains(r#""finish_reason":{"type":"abort""#),
        "{rest}"
    );
    assert!(rest.ends_with("data: [DONE]\n\n"), "{rest}");
    assert_eq!(f.count("aborted"), 1);
    assert_eq!(f.count("abort_requests"), 1);
}

#[test]
fn a_client_leaving_mid_stream_cancels_the_foreign_upstream_request() {
    let f = Foreign::start(&["--token-delay-ms", "50"]);
    let gw = gateway_for(&[f.url()], &[]);
    let mut s = stream_chat(gw.addr, "a long story", 500);
    let _ = s.read_timed_until(b"\"content\"", Duration::from_secs(5));
    assert_eq!(f.count("in_flight"), 1);
    drop(s);
    wait_until(
        "aiohttp cancelled the request",
        Duration::from_secs(5),
        || (f.count("cancelled") == 1 && f.count("in_flight") == 0).then_some(()),
    );
    let w = workers_json(gw.addr);
    assert_eq!(w["workers"][0]["in_flight"], 0, "{w}");
}

#[test]
fn a_large_foreign_body_is_relayed_byte_exact() {
    let f = Foreign::start(&[]);
    let gw = gateway_for(&[f.url()], &[]);
    f.knobs(serde_json::json!({"body_pad_bytes": 8 << 20}));
    let r = relayed_exactly(gw.addr, &f, "POST", "/generate", br#"{"text":"pad me"}"#);
    assert_eq!(r.body.len(), f.last_answer("/generate").len());
    assert!(r.body.len() > 8 << 20);
}

#[test]
fn foreign_upstream_breaking_off_inside_an_event_never_tears_the_client_s_events() {
    // aiohttp frames each write as one chunk; this upstream's last chunk holds half an event
    // when it closes. Every event the client sees end must be whole: the half one may arrive
    // (it was relayed as it came) but nothing may complete it, and the body then must not
    // end cleanly.
    let f = Foreign::start(&[]);
    let gw = gateway_for(&[f.url()], &[]);
    f.knobs(serde_json::json!({"close_after_events": 2, "cut_mid_event": true}));
    let body = br#"{"text":"a b c d e f","stream":true,"sampling_params":{"max_new_tokens":10}}"#;
    let mut s = Streaming::open(gw.addr, "POST", "/generate", &[], body).unwrap();
    let mut got = Vec::new();
    let clean_end = loop {
        match s.read_some() {
            Ok(b) if b.is_empty() => break true,
            Ok(b) => got.extend_from_slice(&b),
            Err(_) => break false,
        }
    };
    let got = String::from_utf8(got).unwrap();
    let (ended, rest) = match got.rfind("\n\n") {
        Some(i) => got.split_at(i + 2),
        None => ("", got.as_str()),
    };
    let events: Vec<&str> = ended.split_terminator("\n\n").collect();
    assert!(events.len() >= 2, "the two whole events: {got:?}");
    for e in &events {
        let json = e
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("not an event: {e:?}"));
        serde_json::from_str::<serde_json::Value>(json)
            .unwrap_or_else(|err| panic!("a torn event ({err}): {json:?} in {got:?}"));
    }
    assert!(
        rest.is_empty() || !clean_end,
        "a half event, then a clean end: {got:?}"
    );
}
