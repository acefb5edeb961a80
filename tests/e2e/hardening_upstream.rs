//! Hardening of the upstream side, end to end over real sockets on 127.0.0.1: circuit probes
//! that cannot leak, the gateway's own failures never blamed on a worker, HTTP/1.0 framing,
//! safe worker management, upstream framing edge cases, worker URLs kept out of client errors
//! and removed workers' series leaving `/metrics`.
//!
//! Most tests use the simulated worker. Framing edge cases a real engine never produces (stray
//! bytes after a 204, a 101, a malformed first chunk) come from a scripted worker: a plain
//! `std` listener on 127.0.0.1 that answers each request with fixed bytes.

use crate::common::*;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a scripted worker saw: connections accepted and the raw requests, in order.
#[derive(Default)]
struct Seen {
    connections: usize,
    requests: Vec<String>,
}

/// A worker that answers the n-th request (counted over all connections) with `script(n)`,
/// then closes the connection when the answer ends with `close`. Runs until the process ends
/// (its thread only blocks in accept/read on 127.0.0.1).
struct Scripted {
    url: String,
    seen: Arc<Mutex<Seen>>,
}

/// One scripted answer: the bytes, and whether the worker closes the connection after them.
struct Answer {
    bytes: Vec<u8>,
    close: bool,
}

fn answer(bytes: &[u8]) -> Answer {
    Answer {
        bytes: bytes.to_vec(),
        close: false,
    }
}

fn scripted(script: impl Fn(usize) -> Answer + Send + Sync + 'static) -> Scripted {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (seen2, script) = (seen.clone(), Arc::new(script));
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            seen2.lock().unwrap().connections += 1;
            let (seen3, script) = (seen2.clone(), script.clone());
            std::thread::spawn(move || serve_scripted(conn, &seen3, &*script));
        }
    });
    Scripted { url, seen }
}

fn serve_scripted(mut conn: TcpStream, seen: &Mutex<Seen>, script: &dyn Fn(usize) -> Answer) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    let mut buf = Vec::new();
    loop {
        // One request: head, then a Content-Length body.
        let (head_end, len) = loop {
            if let Some(bounds) = request_head_bounds(&buf) {
                break bounds;
            }
            let mut tmp = [0u8; 8192];
            match conn.read(&mut tmp) {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&tmp[..n]),
            }
        };
        while buf.len() < head_end + len {
            let mut tmp = [0u8; 8192];
            match conn.read(&mut tmp) {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&tmp[..n]),
            }
        }
        let req: Vec<u8> = buf.drain(..head_end + len).collect();
        let n = {
            let mut s = seen.lock().unwrap();
            s.requests.push(String::from_utf8_lossy(&req).into_owned());
            s.requests.len() - 1
        };
        let a = script(n);
        if conn.write_all(&a.bytes).is_err() || a.close {
            return;
        }
    }
}

impl Scripted {
    fn connections(&self) -> usize {
        self.seen.lock().unwrap().connections
    }
    fn request(&self, i: usize) -> String {
        self.seen.lock().unwrap().requests[i].to_ascii_lowercase()
    }
    fn requests(&self) -> usize {
        self.seen.lock().unwrap().requests.len()
    }
}

/// A gateway in front of scripted workers (they have no health endpoint to probe, and no
/// `/metrics` to scrape: the tests count every connection and request they get).
fn gateway_scripted(urls: &[String], extra: &[&str]) -> radixgate::runtime::Running {
    let mut args = vec![
        "--disable-health-check",
        "--worker-metrics-interval-secs",
        "0",
        "--policy",
        "round_robin",
    ];
    args.extend_from_slice(extra);
    gateway_for(urls, &args)
}

/// Read until the peer closes (or `limit` passes: then `None`).
fn read_to_close(stream: &mut TcpStream, limit: Duration) -> Option<Vec<u8>> {
    let until = Instant::now() + limit;
    let mut all = Vec::new();
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        stream.set_read_timeout(Some(left)).unwrap();
        let mut tmp = [0u8; 16384];
        match stream.read(&mut tmp) {
            Ok(0) => return Some(all),
            Ok(n) => all.extend_from_slice(&tmp[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Some(all),
            Err(_) => return None,
        }
    }
}

fn split_head(raw: &[u8]) -> (String, Vec<u8>) {
    let i = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no head in {:?}", String::from_utf8_lossy(raw)));
    (
        String::from_utf8_lossy(&raw[..i]).to_ascii_lowercase(),
        raw[i + 4..].to_vec(),
    )
}

// ---- item 8: half-open probes cannot leak ----------------------------------------------------

#[test]
fn probes_whose_clients_leave_are_given_back() {
    let worker = sim(1, |c| c.faults.fail_rate = 1.0);
    let url = worker.urls()[0].clone();
    let gw = gateway_for(
        &worker.urls(),
        &[
            "--cb-failure-threshold",
            "1",
            "--cb-success-threshold",
            "1",
            "--cb-timeout-duration-secs",
            "1",
            "--disable-retries",
        ],
    );
    assert_eq!(generate(gw.addr, &gen_body(0)).status, 500);
    assert_eq!(circuit(gw.addr, &[], &url), "open");
    set_faults(
        &worker,
        0,
        serde_json::json!({"fail_rate": 0.0, "hold": true}),
    );
    wait_until("the circuit to half-open", Duration::from_secs(5), || {
        (circuit(gw.addr, &[], &url) == "half_open").then_some(())
    });
    // Three probes (all the half-open slots) whose clients leave while the worker holds them.
    let mut probes: Vec<Conn> = (1..=3)
        .map(|i| {
            let mut c = Conn::open(gw.addr);
            c.send(&raw_request("POST", "/generate", &[], &gen_body(i)));
            c
        })
        .collect();
    wait_until("three probes at the worker", Duration::from_secs(5), || {
        (sim_count(&worker, 0, "inference_received") == 4).then_some(())
    });
    for c in probes.drain(..) {
        let _ = c.stream.shutdown(std::net::Shutdown::Both);
    }
    // The worker sees its three held requests go only when the gateway, having noticed its
    // clients left, closed their upstream connections.
    wait_until(
        "the gateway to drop the probes",
        Duration::from_secs(5),
        || (sim_count(&worker, 0, "inference_in_progress") == 0).then_some(()),
    );
    set_faults(&worker, 0, serde_json::json!({"hold": false}));
    // The slots come back: a new probe gets through and closes the circuit (before the fix
    // every request was refused with 503 forever).
    wait_until("a probe to get through", Duration::from_secs(10), || {
        (generate(gw.addr, &gen_body(9)).status == 200).then_some(())
    });
    wait_until("the circuit to close", Duration::from_secs(5), || {
        (circuit(gw.addr, &[], &url) == "closed").then_some(())
    });
}

// ---- item 4: the gateway's own connect failures never blame the worker ------------------------

/// The lowest file descriptor number the process `pid` has free.
fn lowest_free_fd(pid: u32) -> u32 {
    let used: std::collections::BTreeSet<u32> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("read /proc/PID/fd")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    (0..).find(|n| !used.contains(n)).unwrap_or(0)
}

fn set_fd_limit(pid: u32, soft: &str) {
    let ok = std::process::Command::new("prlimit")
        .args(["--pid", &pid.to_string(), &format!("--nofile={soft}:")])
        .status()
        .expect("prlimit runs");
    assert!(ok.success(), "prlimit --nofile={soft}");
}

#[test]
fn a_gateway_out_of_file_descriptors_does_not_blame_the_worker() {
    let worker = sim(1, |_| {});
    let url = worker.urls()[0].clone();
    let extra = [
        "--cb-failure-threshold",
        "1",
        "--health-check-interval-secs",
        "300",
        "--disable-retries",
    ];
    let child = spawn_binary_with(1, &url, &extra);
    let addr = child.addr;
    // A kept-alive client connection, accepted while descriptors were plentiful.
    let mut c = Conn::open(addr);
    c.send(&raw_request("GET", "/health", &[], b""));
    assert_eq!(c.read_response().unwrap().status, 200);
    // Now the gateway cannot open one more descriptor: connecting to the worker fails with
    // EMFILE, the gateway's own fault.
    set_fd_limit(child.id(), &lowest_free_fd(child.id()).to_string());
    c.send(&raw_request("POST", "/generate", &[], &gen_body(1)));
    let r = c.read_response().unwrap();
    set_fd_limit(child.id(), "20000");
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(
        !r.text().contains(&url[7..]),
        "worker address leaked: {}",
        r.text()
    );
    let w = workers_json(addr);
    assert_eq!(w["workers"][0]["healthy"], true, "marked unhealthy: {w}");
    assert_eq!(w["workers"][0]["circuit"], "closed", "circuit opened: {w}");
    assert_eq!(generate(addr, &gen_body(2)).status, 200);
}

// ---- item 7: HTTP/1.0 clients -----------------------------------------------------------------

fn http10_request(addr: SocketAddr, body: &[u8], keep_alive: bool) -> (String, Vec<u8>) {
    let mut s = connect_retrying(addr).unwrap();
    let mut raw = format!(
        "POST /v1/chat/completions HTTP/1.0\r\nHost: gw\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    if keep_alive {
        raw.push_str("Connection: keep-alive\r\n");
    }
    raw.push_str("\r\n");
    s.write_all(raw.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    // Well below the 75 s keep-alive timeout a chunked answer would leave the client waiting.
    let all = read_to_close(&mut s, Duration::from_secs(10))
        .expect("the gateway closes an HTTP/1.0 connection after the response");
    split_head(&all)
}

#[test]
fn http10_clients_get_a_plain_body_and_a_close() {
    let cluster = sim(1, |_| {});
    let gw = gateway_for(&cluster.urls(), &[]);
    for keep_alive in [true, false] {
        let (head, body) = http10_request(
            gw.addr,
            &chat_body(&[("user", "a 1.0 client")], true, 4),
            keep_alive,
        );
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert!(!head.contains("transfer-encoding"), "{head}");
        assert!(!head.contains("content-length"), "{head}");
        assert!(head.contains("connection: close"), "{head}");
        let text = String::from_utf8_lossy(&body);
        assert!(text.starts_with("data: "), "chunk framing leaked: {text:?}");
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text:?}");
        // Not streamed: an ordinary Content-Length answer, then the close.
        let (head, body) = http10_request(
            gw.addr,
            &chat_body(&[("user", "a 1.0 client")], false, 4),
            keep_alive,
        );
        assert!(head.contains("content-length"), "{head}");
        assert!(serde_json::from_slice::<serde_json::Value>(&body).is_ok());
    }
    // The gateway's own answers close too.
    let mut s = connect_retrying(gw.addr).unwrap();
    s.write_all(b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        .unwrap();
    let all = read_to_close(&mut s, Duration::from_secs(10)).expect("closed after /health");
    assert!(split_head(&all).0.starts_with("http/1.1 200"));
}

// ---- item 9: worker management safe by default ------------------------------------------------

/// One request from source address 127.0.0.2 (another host, as far as the gateway can tell).
fn request_from_other_host(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Response {
    let other = std::net::IpAddr::from([127, 0, 0, 2]);
    request_from(other, addr, method, path, headers, body).expect("an answer")
}

#[test]
fn without_an_admin_key_control_is_refused_unless_keyless_local_mode_is_asked_for() {
    let cluster = sim(2, |_| {});
    let urls = cluster.urls();
    let add = serde_json::json!({ "url": urls[1] }).to_string();
    // Default: no admin key, no flag: refused even from 127.0.0.1, with a message naming the
    // way out; reads stay open.
    let strict = gateway_for_exact(&urls[..1], &[]);
    for (method, path, body) in [
        ("POST", "/workers", add.as_bytes()),
        ("POST", "/flush_cache", &b""[..]),
        ("POST", "/abort_request", &br#"{"abort_all":true}"#[..]),
        ("GET", "/kv_index/snapshot", &b""[..]),
    ] {
        let r = request(strict.addr, method, path, &[], body).unwrap();
        assert_eq!(r.status, 403, "{method} {path}: {}", r.text());
        assert!(r.text().contains("--admin-api-key"), "{}", r.text());
    }
    assert_eq!(workers_json(strict.addr)["total"], 1);
    // --keyless-local-admin: the host itself, but never through a proxy on it.
    let gw = gateway_for_exact(&urls[..1], &["--keyless-local-admin"]);
    for proxy in [
        ("x-forwarded-for", "203.0.113.9"),
        ("forwarded", "for=203.0.113.9"),
        ("x-real-ip", "203.0.113.9"),
    ] {
        let r = request(gw.addr, "POST", "/workers", &[proxy], add.as_bytes()).unwrap();
        assert_eq!(r.status, 403, "{proxy:?}: {}", r.text());
    }
    // The index copy is never keyless.
    let r = request(gw.addr, "GET", "/kv_index/snapshot", &[], b"").unwrap();
    assert_eq!(r.status, 403, "{}", r.text());
    let close = [("connection", "close")];
    let r = request_from_other_host(gw.addr, "POST", "/workers", &close, add.as_bytes());
    assert_eq!(r.status, 403, "{}", r.text());
    assert!(r.text().contains("--admin-api-key"), "{}", r.text());
    let legacy = format!("/add_worker?url={}", urls[1]);
    let r = request_from_other_host(gw.addr, "POST", &legacy, &close, b"");
    assert_eq!(r.status, 403, "{}", r.text());
    let del = format!(
        "/workers/{}",
        workers_json(gw.addr)["workers"][0]["id"].as_str().unwrap()
    );
    let r = request_from_other_host(gw.addr, "DELETE", &del, &close, b"");
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(workers_json(gw.addr)["total"], 1);
    // Reads stay open, and the host itself still manages.
    let r = request_from_other_host(gw.addr, "GET", "/workers", &close, b"");
    assert_eq!(r.status, 200);
    let r = request(gw.addr, "POST", "/workers", &[], add.as_bytes()).unwrap();
    assert_eq!(r.status, 202, "{}", r.text());

    // With an admin key, another host manages with it (and the keyless mode is off).
    let gw = gateway_for(&urls[..1], &["--admin-api-key", "adm"]);
    let auth = [("authorization", "Bearer adm"), ("connection", "close")];
    let r = request_from_other_host(gw.addr, "POST", "/workers", &auth, add.as_bytes());
    assert_eq!(r.status, 202, "{}", r.text());
    let r = request_from_other_host(gw.addr, "POST", "/workers", &close, add.as_bytes());
    assert_eq!(r.status, 401, "{}", r.text());
    let r = request(gw.addr, "POST", "/workers", &[], add.as_bytes()).unwrap();
    assert_eq!(
        r.status,
        401,
        "a key set wins over the local mode: {}",
        r.text()
    );
}

#[test]
fn worker_urls_need_a_valid_host_and_a_port() {
    let cluster = sim(1, |_| {});
    let gw = gateway_for(&cluster.urls(), &[]);
    for bad in [
        "http://127.0.0.1",
        "http://evil_host:80",
        "http://a b:1",
        "http://host:0",
        "http://host:99999",
        "http://[::1",
    ] {
        let body = serde_json::json!({ "url": bad }).to_string();
        let r = request(gw.addr, "POST", "/workers", &[], body.as_bytes()).unwrap();
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
        assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    }
    assert_eq!(workers_json(gw.addr)["total"], 1);
    // A host name is fine (resolved on a helper thread, not on the serving core).
    let port = worker_addr(&cluster, 0).port();
    let named = serde_json::json!({ "url": format!("http://localhost:{port}") }).to_string();
    let r = request(gw.addr, "POST", "/workers", &[], named.as_bytes()).unwrap();
    assert_eq!(r.status, 202, "{}", r.text());
    assert_eq!(r.json()["healthy"], true, "{}", r.text());
}

#[test]
fn add_remove_cycles_do_not_use_up_worker_ids() {
    let cluster = sim(2, |_| {});
    let urls = cluster.urls();
    let gw = gateway_for(&urls[..1], &["--disable-health-check"]);
    let add = serde_json::json!({ "url": urls[1] }).to_string();
    let mut ids = std::collections::BTreeSet::new();
    for _ in 0..200 {
        let r = request(gw.addr, "POST", "/workers", &[], add.as_bytes()).unwrap();
        assert_eq!(r.status, 202, "{}", r.text());
        let id = r.json()["id"].as_str().unwrap().to_string();
        let r = request(gw.addr, "DELETE", &format!("/workers/{id}"), &[], b"").unwrap();
        assert_eq!(r.status, 202, "{}", r.text());
        ids.insert(id);
    }
    // Idle ids come back (before: 200 ids gone, and 16,384 cycles made the gateway refuse).
    // An id comes back once nothing holds its removed worker: a helper thread's round (health,
    // telemetry) may still hold one for a moment on a loaded machine, so a few are in use.
    assert!(ids.len() <= 4, "ids used: {ids:?}");
    // The worker behind a reused id is the new one.
    let r = request(gw.addr, "POST", "/workers", &[], add.as_bytes()).unwrap();
    assert_eq!(r.status, 202);
    for i in 0..4 {
        assert_eq!(generate(gw.addr, &gen_body(i)).status, 200);
    }
}

// ---- item 11: upstream framing edge cases -----------------------------------------------------

const STRAY: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nevil";

#[test]
fn an_empty_answer_followed_by_stray_bytes_is_never_reused() {
    for first in [
        &b"HTTP/1.1 204 No Content\r\n\r\n"[..],
        b"HTTP/1.1 304 Not Modified\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
    ] {
        let w = scripted(move |_| answer(&[first, STRAY].concat()));
        let gw = gateway_scripted(std::slice::from_ref(&w.url), &["--disable-retries"]);
        for i in 0..3 {
            let r = generate(gw.addr, &gen_body(i));
            assert!(r.body.is_empty(), "{:?}", r.text());
        }
        assert_eq!(
            w.connections(),
            3,
            "a connection with stray bytes went back to the pool ({})",
            String::from_utf8_lossy(first).lines().next().unwrap_or("")
        );
    }
}

#[test]
fn a_101_is_a_bad_gateway_and_its_connection_is_dropped() {
    let w = scripted(|_| answer(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: evil\r\n\r\n"));
    let gw = gateway_scripted(std::slice::from_ref(&w.url), &["--disable-retries"]);
    for i in 0..2 {
        let r = generate(gw.addr, &gen_body(i));
        assert_eq!(r.status, 502, "{}", r.text());
    }
    assert_eq!(w.connections(), 2);
}

#[test]
fn connection_named_headers_are_dropped_both_ways_and_forwarded_for_is_appended() {
    let w = scripted(|_| {
        answer(
            b"HTTP/1.1 200 OK\r\nconnection: x-internal, keep-alive\r\nx-internal: secret\r\n\
              content-length: 5\r\ntransfer-encoding: chunked\r\nx-kept: 1\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        )
    });
    let gw = gateway_scripted(std::slice::from_ref(&w.url), &[]);
    let r = request(
        gw.addr,
        "POST",
        "/generate",
        &[
            ("connection", "x-hop"),
            ("x-hop", "private"),
            ("x-forwarded-for", "10.0.0.9"),
            ("x-end", "kept"),
        ],
        &gen_body(0),
    )
    .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.body, b"hello");
    assert!(r.header("x-internal").is_none(), "{:?}", r.headers);
    assert!(r.header("content-length").is_none(), "{:?}", r.headers);
    assert_eq!(r.header("x-kept"), Some("1"));
    let req = w.request(0);
    assert!(!req.contains("x-hop"), "{req}");
    assert!(req.contains("x-end: kept"), "{req}");
    assert!(
        req.contains("x-forwarded-for: 10.0.0.9, 127.0.0.1\r\n"),
        "{req}"
    );
    let r = generate(gw.addr, &gen_body(1));
    assert_eq!(r.status, 200);
    assert!(w.request(1).contains("x-forwarded-for: 127.0.0.1\r\n"));
}

#[test]
fn a_malformed_first_chunk_is_a_retryable_bad_gateway() {
    let bad = scripted(|_| answer(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"));
    // Alone, without retries: the client gets a 502, not a 200 with no body.
    let gw = gateway_scripted(std::slice::from_ref(&bad.url), &["--disable-retries"]);
    let r = generate(gw.addr, &gen_body(0));
    assert_eq!(r.status, 502, "{}", r.text());
    // Beside a good worker: every request ends as a complete 200 from it.
    let good = sim(1, |_| {});
    let urls = vec![bad.url.clone(), good.urls()[0].clone()];
    let gw = gateway_scripted(&urls, &["--retry-initial-backoff-ms", "1"]);
    let before = bad.requests();
    for i in 0..4 {
        let r = generate(gw.addr, &gen_body(i));
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(r.json()["text"].is_string(), "{}", r.text());
    }
    assert!(
        bad.requests() > before,
        "the malformed worker was never tried"
    );
}

#[test]
fn the_stream_error_event_goes_only_into_event_streams() {
    // One whole event in the first chunk, then the worker hangs up: the break is between
    // events (an error event after half of one would fuse with it).
    let body = |ct: &str| {
        let mut a = answer(
            format!(
                "HTTP/1.1 200 OK\r\ncontent-type: {ct}\r\ntransfer-encoding: chunked\r\n\r\nf\r\ndata: {{\"a\":1}}\n\n\r\n"
            )
            .as_bytes(),
        );
        a.close = true;
        a
    };
    for (content_type, event) in [
        ("application/json", false),
        ("text/event-stream; charset=utf-8", true),
    ] {
        let w = scripted(move |_| body(content_type));
        let gw = gateway_scripted(std::slice::from_ref(&w.url), &["--disable-retries"]);
        let mut c = Conn::open(gw.addr);
        c.send(&raw_request("POST", "/generate", &[], &gen_body(0)));
        let got = c.read_timed_until(b"\r\n0\r\n\r\n", Duration::from_secs(10));
        let text: String = got
            .iter()
            .map(|(_, b)| String::from_utf8_lossy(b))
            .collect();
        assert_eq!(
            text.contains("ended the stream early"),
            event,
            "{content_type}: {text}"
        );
    }
}

// ---- item 12: worker URLs out of client errors; removed workers out of /metrics ---------------

#[test]
fn client_errors_never_name_a_worker() {
    // A worker that reads the request and hangs up without a word.
    let w = scripted(|_| Answer {
        bytes: Vec::new(),
        close: true,
    });
    let gw = gateway_scripted(std::slice::from_ref(&w.url), &["--disable-retries"]);
    let addr = &w.url["http://".len()..];
    let port = addr.rsplit(':').next().unwrap();
    let r = generate(gw.addr, &gen_body(0));
    assert_eq!(r.status, 502, "{}", r.text());
    assert!(!r.text().contains(port), "worker address in {}", r.text());

    let nobody = closed_port();
    let dead = format!("http://127.0.0.1:{}", nobody.port);
    let gw = gateway_scripted(std::slice::from_ref(&dead), &["--disable-retries"]);
    let r = generate(gw.addr, &gen_body(0));
    assert_eq!(r.status, 502, "{}", r.text());
    assert!(
        !r.text().contains(&dead[7..]),
        "worker address in {}",
        r.text()
    );
}

#[test]
fn a_removed_workers_series_leave_metrics() {
    let cluster = sim(2, |_| {});
    let urls = cluster.urls();
    let gw = gateway_with_metrics(&urls[..1], &[]);
    let metrics = gw.metrics_addr.expect("metrics listener");
    let scrape = || {
        request(metrics, "GET", "/metrics", &[], b"")
            .unwrap()
            .text()
    };
    let add = serde_json::json!({ "url": urls[1] }).to_string();
    let r = request(gw.addr, "POST", "/workers", &[], add.as_bytes()).unwrap();
    assert_eq!(r.status, 202, "{}", r.text());
    let series = format!("smg_worker_health{{worker=\"{}\"}}", urls[1]);
    let kept = format!("smg_worker_health{{worker=\"{}\"}}", urls[0]);
    let text = scrape();
    assert!(text.contains(&series), "{text}");
    let id = r.json()["id"].as_str().unwrap().to_string();
    let r = request(gw.addr, "DELETE", &format!("/workers/{id}"), &[], b"").unwrap();
    assert_eq!(r.status, 202, "{}", r.text());
    let text = scrape();
    assert!(
        !text.contains(&series),
        "removed worker still exported:\n{text}"
    );
    assert!(text.contains(&kept), "{text}");
    assert!(text.contains("smg_http_connections_active"), "{text}");
    assert!(text.contains("radixgate_io_driver"), "{text}");
    // The families stay across scrapes when nothing changes.
    let again = scrape();
    assert!(again.contains(&kept) && again.contains("smg_http_connections_active"));
}

// ---- round 2, item 15: public calls that make the gateway call workers are bounded ------------

#[test]
fn public_calls_that_reach_workers_are_bounded_and_the_rest_refused_at_once() {
    // Serial: "refused at once" is a bound (400 ms, against the worker's 500 ms) on 60 calls
    // fired together; a timing test's load beside them could push a refusal past it.
    let _serial = serial();
    // A worker that takes half a second over every answer.
    let slow = scripted(|_| {
        std::thread::sleep(Duration::from_millis(500));
        answer(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{\"data\":[]}")
    });
    let gw = gateway_scripted(std::slice::from_ref(&slow.url), &[]);
    let before = slow.requests();
    // (path, calls fired at once, most that may reach the worker)
    for (path, calls, bound) in [("/get_model_info", 40, 16), ("/v1/models", 20, 4)] {
        // Every call fires when all threads are up (spawning 40 threads on a loaded machine
        // can take longer than the worker's half second: calls started after the first ones
        // finished would be served, rightly, and the count would no longer be "at once").
        let go = std::sync::Arc::new(std::sync::Barrier::new(calls));
        let started = Instant::now();
        let answers: Vec<(u16, Duration)> = (0..calls)
            .map(|_| {
                let addr = gw.addr;
                let go = go.clone();
                std::thread::spawn(move || {
                    go.wait();
                    let t = Instant::now();
                    (
                        request(addr, "GET", path, &[], b"").unwrap().status,
                        t.elapsed(),
                    )
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        let refused: Vec<_> = answers.iter().filter(|(s, _)| *s == 503).collect();
        let served = answers.iter().filter(|(s, _)| *s == 200).count();
        assert_eq!(refused.len() + served, calls, "{path}: {answers:?}");
        assert!(
            served <= bound,
            "{path}: {served} calls reached the worker at once"
        );
        assert!(refused.len() >= calls - bound, "{path}: {answers:?}");
        // Refused at once, not queued behind the slow ones.
        assert!(
            refused.iter().all(|(_, t)| *t < Duration::from_millis(400)),
            "{path}: {refused:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(5), "{path}");
    }
    assert!(
        slow.requests() - before <= 16 + 4,
        "{} calls reached it",
        slow.requests() - before
    );
}

// ---- against the foreign upstream (aiohttp, tests/fixtures/foreign_upstream.py) -------------

#[test]
fn a_slow_foreign_upstream_is_cut_off_by_the_request_timeout() {
    // Nothing for 5 s (a long prefill): the gateway gives up after its 1 s request deadline,
    // answers 504 and drops the upstream request (aiohttp sees its client leave).
    let f = Foreign::start(&["--first-token-delay-ms", "5000"]);
    let gw = gateway_for(
        &[f.url()],
        &["--request-timeout-secs", "1", "--disable-retries"],
    );
    let started = Instant::now();
    let r = generate(gw.addr, br#"{"text":"slow prefill"}"#);
    let took = started.elapsed();
    assert_eq!(r.status, 504, "{}", r.text());
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "{took:?}"
    );
    wait_until(
        "the upstream request dropped",
        Duration::from_secs(5),
        || (f.count("cancelled") == 1).then_some(()),
    );

    // A stream that has started and then trickles: cut at the deadline too, and the client's
    // chunked body ends (with an error event) instead of hanging.
    f.knobs(serde_json::json!({"first_token_delay_ms": 0, "token_delay_ms": 300}));
    let body = br#"{"text":"slow tokens","stream":true,"sampling_params":{"max_new_tokens":50}}"#;
    let started = Instant::now();
    let mut s = Streaming::open(gw.addr, "POST", "/generate", &[], body).unwrap();
    assert_eq!(s.status, 200);
    let got = s
        .read_to_end()
        .map(|b| String::from_utf8_lossy(&b).into_owned());
    let took = started.elapsed();
    assert!(took < Duration::from_secs(3), "{took:?}");
    if let Ok(text) = &got {
        assert!(!text.contains("[DONE]"), "{text}");
    }
    wait_until(
        "the stream's upstream request dropped",
        Duration::from_secs(5),
        || (f.count("cancelled") == 2).then_some(()),
    );
}

#[test]
fn a_foreign_response_head_past_the_limit_is_a_bad_gateway_and_one_below_passes_intact() {
    let f = Foreign::start(&[]);
    let gw = gateway_for(&[f.url()], &["--disable-retries"]);
    // 60 000 bytes of header: under the gateway's 64 KiB response-head bound, relayed as is.
    f.knobs(serde_json::json!({"header_pad_bytes": 60_000}));
    let r = generate(gw.addr, br#"{"text":"big head"}"#);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-fixture-padding").map(str::len), Some(60_000));
    assert_eq!(r.text(), f.last_answer("/generate"));
    // 70 000 bytes: past the bound, a 502 in the gateway's error shape, and no worker named.
    f.knobs(serde_json::json!({"header_pad_bytes": 70_000}));
    let r = generate(gw.addr, br#"{"text":"too big a head"}"#);
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], 502, "{}", r.text());
    assert!(!r.text().contains("127.0.0.1"), "{}", r.text());
    f.knobs(serde_json::json!({"header_pad_bytes": 0}));
    let r = generate(gw.addr, br#"{"text":"normal again"}"#);
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn foreign_503s_are_retried_until_one_answers() {
    let f = Foreign::start(&[]);
    let gw = gateway_for(&[f.url()], &["--retry-initial-backoff-ms", "1"]);
    f.knobs(serde_json::json!({"fail_next": 2}));
    let r = generate(gw.addr, br#"{"text":"third time lucky"}"#);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        f.count("received"),
        3,
        "two 503s, then the answer: {}",
        f.stats()
    );
    assert_eq!(r.text(), f.last_answer("/generate"));
    // A retried answer's body is not wanted: its connection is closed, not drained and
    // pooled, so each attempt came on a new one.
    assert_eq!(f.count("inference_connections"), 3, "{}", f.stats());
}
