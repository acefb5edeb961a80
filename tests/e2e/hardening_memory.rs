//! Memory fed by clients is bounded: every structure a client can grow (per-model trees, manual
//! routing keys, routing text extracted from a body, the recent-insert ring and the writer's
//! queue) has a bound, and each test here floods one of them over a real socket.
//!
//! Peak-memory checks read `VmHWM` from `/proc/self/status`, which is per process: they re-run
//! this test binary on one test (`common::run_in_child`) so nothing else shares the peak.

use crate::common::*;
use radixgate::tree::TreeKey;
use std::io::{Read, Write};
use std::time::Duration;

/// A `/proc/self/status` field in bytes (`VmHWM`, `VmRSS`); 0 when unavailable.
fn status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Runs test `name` of this module alone in a child process and returns the figure it printed
/// as `FIGURE=<n>` (the child's peak-memory growth in bytes).
fn run_child(name: &str) -> u64 {
    // Busy: the child parses 50 MB bodies in a debug build, about a CPU for 5 s.
    let _busy = busy();
    let out = run_in_child(module_path!(), name);
    out.lines()
        .find_map(|l| {
            l.split("FIGURE=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("child {name} printed no figure: {out}"))
}

/// Body of the extraction flood: `{"prompt":[0,0,…]}` of about `bytes` bytes.
fn zeros_prompt(bytes: usize) -> Vec<u8> {
    let mut body = Vec::with_capacity(bytes + 16);
    body.extend_from_slice(br#"{"prompt":[0"#);
    while body.len() + 2 < bytes {
        body.extend_from_slice(b",0");
    }
    body.extend_from_slice(b"]}");
    body
}

const FLOOD_BODY: usize = 50 * 1000 * 1000;

#[test]
fn extraction_of_a_50_mb_number_array_peaks_under_4x_the_body() {
    let grew = run_child("child_extracts_a_50_mb_number_array");
    eprintln!("extraction peak growth: {} MB", grew / 1_000_000);
    assert!(
        grew < 4 * FLOOD_BODY as u64,
        "extracting a {FLOOD_BODY}-byte body grew the peak by {grew} bytes"
    );
}

/// Child of the test above: a gateway without workers (the request is extracted, then answered
/// 503), one 50 MB body sent over a socket, the growth of the peak printed.
#[test]
fn child_extracts_a_50_mb_number_array() {
    if !is_the_child(module_path!(), "child_extracts_a_50_mb_number_array") {
        return;
    }
    let gw = gateway(&["--policy", "cache_aware"]);
    let body = zeros_prompt(FLOOD_BODY);
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    );
    let before = status_bytes("VmHWM");
    let mut s = connect_retrying(gw.addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(&body).unwrap();
    let mut reply = [0u8; 64];
    let n = s.read(&mut reply).unwrap();
    let status = String::from_utf8_lossy(&reply[..n]).to_string();
    assert!(status.starts_with("HTTP/1.1 503"), "{status}");
    let after = status_bytes("VmHWM");
    println!("FIGURE={}", after.saturating_sub(before));
}

/// The model every simulated worker serves.
const SERVED: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// A prompt of `n` words unique to `i`, so no two requests share more than a few characters.
fn unique_prompt(i: usize, n: usize) -> String {
    (0..n).map(|w| format!("w{i}x{w} ")).collect()
}

#[test]
fn made_up_model_names_share_one_bounded_tree() {
    let cluster = sim(1, |c| c.record_requests = 0);
    let limit = 20_000u64;
    let gw = gateway_for(
        &cluster.urls(),
        &[
            "--policy",
            "cache_aware",
            "--max-tree-size",
            &limit.to_string(),
        ],
    );
    wait_model_served(&gw, SERVED);
    // 300 distinct names with ~1.5 KB prompts: ~450,000 characters, over 20 times the limit.
    for i in 0..300 {
        let model = if i % 10 == 0 {
            SERVED.to_string()
        } else {
            format!("made-up-{i}")
        };
        let body =
            serde_json::json!({"model": model, "prompt": unique_prompt(i, 200), "max_tokens": 1});
        let r = request(
            gw.addr,
            "POST",
            "/v1/completions",
            &[],
            body.to_string().as_bytes(),
        )
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let tree = gw.gateway().router.tree.as_ref().unwrap();
    tree.sync();
    let info = request(gw.addr, "GET", "/get_server_info", &[], b"")
        .unwrap()
        .json();
    let chars = info["tree"]["chars"].as_u64().unwrap();
    // Two trees hold text (the served model's and the shared one), each bounded per worker
    // (immediate eviction at 10 % over the limit).
    assert!(chars <= 2 * (limit + limit / 10), "{chars} characters kept");
    let forest = tree.load();
    let keys: Vec<_> = forest.models().map(|(k, _)| k).collect();
    assert_eq!(
        keys,
        [TreeKey::Default, TreeKey::Shared, TreeKey::Served(SERVED)],
        "only served models get a tree"
    );
    drop(forest);
    // The worker leaves: its model's tree goes with it.
    remove_worker(gw.addr, &cluster.urls()[0]);
    wait_until(
        "the removed model's tree is dropped",
        Duration::from_secs(10),
        || {
            tree.sync();
            (tree.load().models().count() == 2).then_some(())
        },
    );
    assert_answers(gw.addr);
}

/// The gateway still answers on a fresh connection.
fn assert_answers(addr: std::net::SocketAddr) {
    let r = request(addr, "GET", "/health", &[], b"").unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
}

/// Large uploads whose routing text is short are not kept alive by what the gateway learned.
const BIG_BODY: usize = 40 * 1000 * 1000;
const BIG_BODIES: usize = 6;

#[test]
fn learned_text_does_not_pin_request_bodies() {
    let kept = run_child("child_sends_big_bodies_with_short_prompts");
    eprintln!(
        "resident growth after {BIG_BODIES} bodies of {BIG_BODY} bytes: {} MB",
        kept / 1_000_000
    );
    assert!(
        kept < BIG_BODY as u64 * 3 / 2,
        "{kept} bytes still resident after {BIG_BODIES} bodies of {BIG_BODY} bytes"
    );
}

/// Child of the test above: big bodies (above the allocator's mmap threshold, so freed memory
/// leaves the resident set) with short prompts through a cache_aware gateway, then the resident
/// growth once the requests are done.
#[test]
fn child_sends_big_bodies_with_short_prompts() {
    if !is_the_child(module_path!(), "child_sends_big_bodies_with_short_prompts") {
        return;
    }
    let cluster = sim(1, |c| c.record_requests = 0);
    let gw = gateway_for(&cluster.urls(), &["--policy", "cache_aware"]);
    let padding = "x".repeat(BIG_BODY);
    let body = |i: usize| {
        format!(r#"{{"prompt":"short prompt {i}","max_tokens":1,"padding":"{padding}"}}"#)
    };
    // Warm up every path once (thread stacks, pools, the first big buffers).
    let r = request(gw.addr, "POST", "/v1/completions", &[], body(0).as_bytes()).unwrap();
    assert_eq!(r.status, 200);
    let base = status_bytes("VmRSS");
    for i in 1..=BIG_BODIES {
        let r = request(gw.addr, "POST", "/v1/completions", &[], body(i).as_bytes()).unwrap();
        assert_eq!(r.status, 200);
    }
    // Connections close and buffers are freed asynchronously: the smallest growth seen within
    // a deadline.
    let until = std::time::Instant::now() + Duration::from_secs(5);
    let mut least = u64::MAX;
    while std::time::Instant::now() < until && least > BIG_BODY as u64 / 2 {
        least = least.min(status_bytes("VmRSS").saturating_sub(base));
        std::thread::sleep(Duration::from_millis(50));
    }
    println!("FIGURE={least}");
}

#[test]
fn manual_routing_keys_are_bounded_in_length_and_number() {
    let cluster = sim(2, |c| c.record_requests = 0);
    let gw = gateway_for(
        &cluster.urls(),
        &["--policy", "manual", "--max-routing-keys", "64"],
    );
    let body = br#"{"text":"hi","sampling_params":{"max_new_tokens":1}}"#;
    let send = |key: &str| {
        request(
            gw.addr,
            "POST",
            "/generate",
            &[("x-smg-routing-key", key)],
            body,
        )
        .unwrap()
    };
    // Too long: refused with a clear error, nothing remembered.
    let r = send(&"k".repeat(257));
    assert_eq!(r.status, 400, "{}", r.text());
    let msg = r.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        msg.contains("X-SMG-Routing-Key") && msg.contains("256"),
        "{msg}"
    );
    assert_eq!(send(&"k".repeat(256)).status, 200);
    // A flood of distinct keys: the map stays at its cap, and a key in use stays sticky.
    let policy = &gw.gateway().router.policy;
    let home = served_by(&send("conversation"));
    for i in 0..400 {
        assert_eq!(send(&format!("flood-{i}")).status, 200);
        if i % 4 == 0 {
            assert_eq!(served_by(&send("conversation")), home, "sticky at {i}");
        }
        assert!(policy.manual_keys() <= 64, "{} keys", policy.manual_keys());
    }
    assert_answers(gw.addr);
}
