//! Hostile and unusual clients at the connection level, over real sockets on 127.0.0.1: refusals
//! decided on the head (no `100 Continue`, no body read), small bodies for non-inference
//! endpoints, a whole-body deadline for trickled bodies, the per-core connection cap, accept
//! errors logged at a bounded rate, a `/metrics` listener one client cannot block, and a
//! lingering close that lets an error reply reach a client still sending its body.

use crate::common::*;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A connection whose reads give up after `limit`.
fn open(addr: SocketAddr, limit: Duration) -> Conn {
    let c = Conn::open(addr);
    c.stream.set_read_timeout(Some(limit)).unwrap();
    c
}

/// Send `raw`, then read the first response head, interim ones included.
fn first_answer(addr: SocketAddr, raw: &[u8]) -> (Conn, radixgate::http::ResponseHead) {
    let mut c = open(addr, Duration::from_secs(3));
    c.send(raw);
    let head = c
        .read_head(true)
        .unwrap_or_else(|e| panic!("no answer within 3 s: {e}"));
    (c, head)
}

fn header<'a>(h: &'a radixgate::http::ResponseHead, name: &str) -> &'a str {
    h.header(name)
        .map(|v| std::str::from_utf8(v).unwrap())
        .unwrap_or("")
}

#[test]
fn refusals_are_decided_on_the_head_without_100_continue_or_reading_the_body() {
    let cluster = sim(1, |_| {});
    let gw = gateway_for(
        &cluster.urls(),
        &["--api-key", "k", "--admin-api-key", "adm"],
    );
    // (request head, expected status): each declares a 500 MB body and sends none of it.
    let cases: [(&str, u16); 5] = [
        (
            "POST /v1/chat/completions HTTP/1.1\r\nexpect: 100-continue\r\n",
            401,
        ),
        (
            "POST /generate HTTP/1.1\r\nauthorization: Bearer wrong\r\nexpect: 100-continue\r\n",
            401,
        ),
        ("POST /workers HTTP/1.1\r\nexpect: 100-continue\r\n", 401),
        (
            "POST /no/such/path HTTP/1.1\r\nexpect: 100-continue\r\n",
            404,
        ),
        (
            "PUT /v1/chat/completions HTTP/1.1\r\nauthorization: Bearer k\r\n",
            405,
        ),
    ];
    for (start, status) in cases {
        let raw = format!("{start}host: t\r\ncontent-length: 500000000\r\n\r\n");
        let (mut c, head) = first_answer(gw.addr, raw.as_bytes());
        assert_eq!(
            head.status, status,
            "{start:?}: the first answer must be the refusal, not 100 Continue"
        );
        assert_eq!(header(&head, "connection"), "close", "{start:?}");
        assert!(
            c.closed_within(Duration::from_secs(4)),
            "{start:?}: connection left open"
        );
    }
    // Without a body the connection stays usable after a refusal.
    let mut c = open(gw.addr, Duration::from_secs(3));
    c.send(b"GET /no/such/path HTTP/1.1\r\nhost: t\r\n\r\n");
    assert_eq!(c.read_response().unwrap().status, 404);
    c.send(b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n");
    assert_eq!(c.read_response().unwrap().status, 200);
    // Nothing reached the worker; authorised traffic still flows.
    assert_eq!(sim_count(&cluster, 0, "inference_received"), 0);
    let r = request(
        gw.addr,
        "POST",
        "/generate",
        &[("authorization", "Bearer k")],
        br#"{"text":"ok","sampling_params":{"max_new_tokens":1}}"#,
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn non_inference_endpoints_refuse_large_bodies_at_once() {
    let cluster = sim(1, |_| {});
    let gw = gateway_for(&cluster.urls(), &[]);
    // Well under --max-payload-size, far over what worker management needs; no body sent.
    let (mut c, head) = first_answer(
        gw.addr,
        b"POST /workers HTTP/1.1\r\nhost: t\r\nexpect: 100-continue\r\ncontent-length: 1000000\r\n\r\n",
    );
    assert_eq!(head.status, 413);
    assert!(c.closed_within(Duration::from_secs(4)));
    // Inference endpoints keep the full limit: a 1 MB prompt is served.
    let text = "x".repeat(1_000_000);
    let body = format!(r#"{{"text":"{text}","sampling_params":{{"max_new_tokens":1}}}}"#);
    assert_eq!(generate(gw.addr, body.as_bytes()).status, 200);
    // A worker can still be added with a normal body (202 and listed), and adding it twice is
    // the conflict it is, not a body refused for its size.
    let other = sim(1, |_| {});
    let add = |url: &str| {
        request(
            gw.addr,
            "POST",
            "/workers",
            &[],
            format!(r#"{{"url":"{url}"}}"#).as_bytes(),
        )
        .unwrap()
    };
    let r = add(&other.urls()[0]);
    assert_eq!(r.status, 202, "{}", r.text());
    assert_eq!(circuit(gw.addr, &[], &other.urls()[0]), "closed");
    let r = add(&cluster.urls()[0]);
    assert_eq!(r.status, 409, "{}", r.text());
}

/// Write `bytes` one at a time, `every` apart, until stopped or the connection fails.
fn trickle(mut s: TcpStream, bytes: Vec<u8>, every: Duration, stop: Arc<AtomicBool>) {
    std::thread::spawn(move || {
        for b in bytes {
            if stop.load(Ordering::Relaxed) || s.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(every);
        }
    });
}

#[test]
fn trickled_bodies_are_cut_off_by_the_whole_body_deadline() {
    let cluster = sim(1, |_| {});
    // Grace 1 s + 2,000 bytes at 1,000 B/s: the body must be in within 3 s; 10 bytes a second
    // never trips the 1 s per-read timeout.
    let gw = gateway_for(
        &cluster.urls(),
        &[
            "--header-timeout-secs",
            "1",
            "--min-body-bytes-per-second",
            "1000",
        ],
    );
    let framings: [(&str, Vec<u8>); 2] = [
        ("content-length: 2000\r\n", vec![b'x'; 2000]),
        (
            "transfer-encoding: chunked\r\n",
            b"1\r\nx\r\n".repeat(400).to_vec(),
        ),
    ];
    for (framing, body) in framings {
        let mut c = open(gw.addr, Duration::from_secs(8));
        c.send(format!("POST /generate HTTP/1.1\r\nhost: t\r\n{framing}\r\n").as_bytes());
        let stop = Arc::new(AtomicBool::new(false));
        let t0 = Instant::now();
        trickle(
            c.stream.try_clone().unwrap(),
            body,
            Duration::from_millis(100),
            stop.clone(),
        );
        let r = c.read_response();
        stop.store(true, Ordering::Relaxed);
        let r = r.unwrap_or_else(|e| panic!("{framing:?}: no answer in 8 s: {e}"));
        assert_eq!(r.status, 408, "{framing:?}: {}", r.text());
        assert!(
            r.text().contains("slower than 1000 bytes per second"),
            "{}",
            r.text()
        );
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }
    // A body at a normal pace is untouched.
    assert_still_serves(gw.addr);
    assert_eq!(sim_count(&cluster, 0, "inference_received"), 1);
}

#[test]
fn at_the_connection_cap_idle_connections_are_shed_first_then_new_ones_refused() {
    let cluster = sim(1, |_| {});
    let gw = gateway_for(
        &cluster.urls(),
        &["--cores", "1", "--max-connections-per-core", "3"],
    );
    let health = b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n";
    // Three keep-alive connections, idle in the order a, b, c.
    let mut idle: Vec<Conn> = (0..3)
        .map(|_| open(gw.addr, Duration::from_secs(5)))
        .collect();
    for c in idle.iter_mut() {
        c.send(health);
        assert_eq!(c.read_response().unwrap().status, 200);
    }
    // A fourth client is served; a, idle the longest, is closed for it.
    let mut d = open(gw.addr, Duration::from_secs(5));
    d.send(health);
    assert_eq!(d.read_response().unwrap().status, 200);
    assert!(
        idle[0].closed_within(Duration::from_secs(3)),
        "the longest-idle connection was not shed"
    );
    idle[1].send(health);
    assert_eq!(idle[1].read_response().unwrap().status, 200);
    // Make b, c and d busy: requests held by the worker.
    let mut busy: Vec<Conn> = idle.drain(1..).collect();
    busy.push(d);
    set_faults(&cluster, 0, serde_json::json!({"hold": true}));
    let gen = br#"{"text":"held","sampling_params":{"max_new_tokens":1}}"#;
    for c in busy.iter_mut() {
        c.send(&raw_request("POST", "/generate", &[], gen));
    }
    wait_until("three held requests", Duration::from_secs(5), || {
        (sim_count(&cluster, 0, "inference_in_progress") == 3).then_some(())
    });
    // Nobody idle: a new connection gets 503 and a close.
    let mut e = open(gw.addr, Duration::from_secs(3));
    e.send(health);
    let r = e.read_response().unwrap();
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("connection"), Some("close"));
    // The held requests are not disturbed.
    set_faults(&cluster, 0, serde_json::json!({"hold": false}));
    for c in busy.iter_mut() {
        assert_eq!(c.read_response().unwrap().status, 200);
    }
}

#[test]
fn accept_errors_are_logged_at_a_bounded_rate() {
    let cluster = sim(1, |_| {});
    // Few descriptors: the gateway runs out after a handful of clients, and every accept
    // of the rest fails with EMFILE (retried every 10 ms).
    let driver = test_driver().map_or("auto", |d| d.flag());
    let command = |ports: &[u16]| {
        let mut cmd = std::process::Command::new("sh");
        cmd.arg("-c")
            .arg(format!(
                "ulimit -n 40 && exec {} --host 127.0.0.1 --port {} --prometheus-port 0 \
                 --cores 1 --log-level warn --disable-health-check --io-driver {driver} \
                 --worker-urls {}",
                env!("CARGO_BIN_EXE_radixgate"),
                ports[0],
                cluster.urls()[0]
            ))
            .stderr(std::process::Stdio::piped());
        cmd
    };
    let ready = |ports: &[u16]| {
        request(local(ports[0]), "GET", "/readiness", &[], b"").is_ok_and(|r| r.status == 200)
    };
    let (mut child, ports) = spawn_on_ports(1, Duration::from_secs(10), command, ready);
    let stderr = child.0.as_mut().unwrap().stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<(Instant, String)>();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send((Instant::now(), line)).is_err() {
                return;
            }
        }
    });
    let addr = local(ports[0]);
    // Busy clients (a started head each), so there is no idle connection to shed.
    let mut clients = Vec::new();
    for _ in 0..60 {
        let mut s = connect_retrying(addr).expect("connect");
        s.write_all(b"POST /generate HTTP/1.1\r\n").unwrap();
        clients.push(s);
    }
    let first = wait_until("an accept failure logged", Duration::from_secs(5), || {
        rx.try_iter()
            .find(|(_, l)| l.contains("accept failed"))
            .map(|(t, _)| t)
    });
    let window = Duration::from_millis(2500);
    let mut lines = 1;
    while first.elapsed() < window {
        if let Ok((t, l)) = rx.recv_timeout(Duration::from_millis(50)) {
            if t.duration_since(first) < window && l.contains("accept failed") {
                lines += 1;
            }
        }
    }
    assert!(
        lines <= 4,
        "{lines} accept-failure lines in {window:?}: not rate-limited"
    );
    drop(clients);
    // Descriptors back: the gateway serves again.
    wait_until("the gateway serves again", Duration::from_secs(15), || {
        request(addr, "GET", "/health", &[], b"")
            .ok()
            .filter(|r| r.status == 200)
    });
}

#[test]
fn a_slow_client_cannot_block_the_metrics_listener() {
    // Serial: a scrape under 900 ms is what tells "not blocked" from "waited out the slow
    // client's 1 s deadline"; a timing test's load beside it could blur the two.
    let _serial = serial();
    let cluster = sim(1, |_| {});
    let gw = gateway_with_metrics(&cluster.urls(), &["--header-timeout-secs", "1"]);
    let metrics = gw.metrics_addr.expect("metrics listener");
    // One client that never finishes its head (a byte every 100 ms, under any per-read
    // timeout), one that connects and sends nothing.
    let slow = connect_retrying(metrics).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    trickle(
        slow.try_clone().unwrap(),
        b"GET /metrics HTTP/1.1\r\nx-slow: "
            .iter()
            .copied()
            .chain([b'a'; 200])
            .collect(),
        Duration::from_millis(100),
        stop.clone(),
    );
    let _silent = connect_retrying(metrics).unwrap();
    let t0 = Instant::now();
    let r = request(metrics, "GET", "/metrics", &[], b"").expect("GET /metrics");
    assert_eq!(r.status, 200);
    assert!(
        t0.elapsed() < Duration::from_millis(900),
        "scrape waited {:?} behind a slow client",
        t0.elapsed()
    );
    // The trickling client is cut off by the whole-head deadline (1 s), not kept alive by
    // each byte it sends.
    let mut slow = slow;
    slow.set_read_timeout(Some(Duration::from_secs(4))).unwrap();
    let mut tmp = [0u8; 64];
    let cut = matches!(slow.read(&mut tmp), Ok(0) | Err(_));
    stop.store(true, Ordering::Relaxed);
    assert!(cut, "the trickling client is still connected");
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
}

#[test]
fn an_error_reply_reaches_a_client_still_sending_its_body() {
    let cluster = sim(1, |_| {});
    let gw = gateway_for(&cluster.urls(), &["--max-payload-size", "1000"]);
    // 413 is answered on the head; the client, like most, writes its whole body before it
    // reads. Closing at once with that body unread would reset the connection.
    let size = 20_000_000;
    let mut c = open(gw.addr, Duration::from_secs(5));
    c.send(
        format!("POST /generate HTTP/1.1\r\nhost: t\r\ncontent-length: {size}\r\n\r\n").as_bytes(),
    );
    let chunk = vec![b'x'; 1 << 20];
    for _ in 0..size / chunk.len() {
        if let Err(e) = c.stream.write_all(&chunk) {
            panic!("the gateway reset the connection while the body was sent: {e}");
        }
    }
    let r = c.read_response().expect("the 413 reply");
    assert_eq!(r.status, 413);
    assert!(r.json()["error"]["message"].is_string());
    assert!(c.closed_within(Duration::from_secs(4)));
    assert_still_serves(gw.addr);
}

// ---- against the foreign upstream (aiohttp, tests/fixtures/foreign_upstream.py) -------------

#[test]
fn pipelined_client_requests_to_a_foreign_upstream_are_answered_in_order() {
    // Raw socket on purpose: three requests in one write (pipelining) is about exact bytes.
    let f = Foreign::start(&["--token-delay-ms", "3"]);
    let gw = gateway_for(&[f.url()], &[]);
    let bodies: Vec<Vec<u8>> = [
        r#"{"text":"first one","sampling_params":{"max_new_tokens":4}}"#,
        r#"{"text":"second","stream":true,"sampling_params":{"max_new_tokens":3}}"#,
        r#"{"text":"third and last","sampling_params":{"max_new_tokens":2}}"#,
    ]
    .iter()
    .map(|b| b.as_bytes().to_vec())
    .collect();
    let mut all = Vec::new();
    for b in &bodies {
        all.extend(raw_request("POST", "/generate", &[], b));
    }
    let mut c = open(gw.addr, Duration::from_secs(10));
    c.send(&all);
    let answers: Vec<String> = (0..3)
        .map(|_| c.read_response().expect("an answer").text())
        .collect();
    let written: Vec<String> = f
        .records()
        .iter()
        .filter(|r| r["path"] == "/generate")
        .map(|r| r["response"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        answers, written,
        "each answer as aiohttp wrote it, in request order"
    );
    for (a, want) in answers
        .iter()
        .zip(["first one first one", "second", "third and"])
    {
        assert!(a.contains(want), "{a}");
    }
}
