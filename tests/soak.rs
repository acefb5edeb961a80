//! A bounded soak: hostile traffic of every kind the hardening work closed, beside normal
//! traffic at a steady rate, against real gateways and simulated workers on 127.0.0.1.
//!
//! Hostile clients send distinct `model` names with large prompts (the model forest), distinct
//! routing keys to a `manual` gateway (the key map), bodies trickled a byte at a time, HTTP/1.0
//! requests, and huge declared bodies without a key. Meanwhile a normal client sends chat
//! requests at a steady rate: every one must succeed, and the process's resident memory must
//! stay within [`RSS_GROWTH_BOUND_MB`] of what it was after warm-up.
//!
//! Duration: `RADIXGATE_SOAK_SECS` (default 60). Every loop stops by itself at the deadline.

mod common;
use common::*;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Resident memory the whole test process (two gateways and their workers) may gain between
/// the end of warm-up and the end of the soak. Unbounded structures fed by the hostile clients
/// grow by far more than this within a minute (about 1.6 MB/s of distinct prompt text alone).
const RSS_GROWTH_BOUND_MB: u64 = 64;

const KEY: &str = "soak-key";

fn rss_kb() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// A small deterministic generator (the test must not depend on the clock for content).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 16
    }
    fn text(&mut self, bytes: usize) -> String {
        let mut s = String::with_capacity(bytes + 8);
        while s.len() < bytes {
            s.push_str(&format!("w{} ", self.next() % 100_000));
        }
        s
    }
}

fn auth() -> (&'static str, String) {
    ("authorization", format!("Bearer {KEY}"))
}

/// Run `f` repeatedly until `stop`, at most every `period`.
fn every(period: Duration, stop: &AtomicBool, mut f: impl FnMut()) {
    while !stop.load(Ordering::Relaxed) {
        let t = Instant::now();
        f();
        if let Some(rest) = period.checked_sub(t.elapsed()) {
            std::thread::sleep(rest);
        }
    }
}

fn hostile_models(addr: SocketAddr, stop: &AtomicBool, sent: &AtomicU64) {
    let mut rng = Lcg(1);
    let (k, v) = auth();
    every(Duration::from_millis(10), stop, || {
        let body = serde_json::json!({
            "model": format!("made-up-{}", rng.next()),
            "prompt": rng.text(16 * 1024),
            "max_tokens": 1,
        });
        let body = serde_json::to_vec(&body).unwrap();
        let _ = request(addr, "POST", "/v1/completions", &[(k, &v)], &body);
        sent.fetch_add(1, Ordering::Relaxed);
    });
}

fn hostile_routing_keys(addr: SocketAddr, stop: &AtomicBool, sent: &AtomicU64) {
    let mut rng = Lcg(2);
    let (k, v) = auth();
    every(Duration::from_millis(10), stop, || {
        let key = format!("{}-{}", rng.next(), "k".repeat(200));
        let body = chat_body(&[("user", "hi")], false, 1);
        let headers = [(k, v.as_str()), ("x-smg-routing-key", key.as_str())];
        let _ = request(addr, "POST", "/v1/chat/completions", &headers, &body);
        sent.fetch_add(1, Ordering::Relaxed);
    });
}

/// Declares a body and trickles it one byte every 200 ms; the gateway must cut it off (or the
/// soak ends) without it hurting anyone else.
fn trickler(addr: SocketAddr, stop: &AtomicBool, sent: &AtomicU64) {
    let (k, v) = auth();
    let mut left_open = Vec::new();
    every(Duration::from_millis(500), stop, || {
        let Ok(mut s) = TcpStream::connect(addr) else {
            return;
        };
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: soak\r\n{k}: {v}\r\ncontent-length: 100000\r\n\r\n"
        );
        if s.write_all(head.as_bytes()).is_err() {
            return;
        }
        sent.fetch_add(1, Ordering::Relaxed);
        for _ in 0..5 {
            if stop.load(Ordering::Relaxed) || s.write_all(b"{").is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        // Left open until the soak ends: the gateway's deadlines must reclaim it.
        left_open.push(s);
    });
}

/// HTTP/1.0 requests, streaming and not, with and without `Connection: keep-alive`: each must
/// end (the server closes) within a few seconds.
fn http10_client(addr: SocketAddr, stop: &AtomicBool, failures: &AtomicU64) {
    let (k, v) = auth();
    let mut i = 0u32;
    every(Duration::from_millis(50), stop, || {
        i += 1;
        let body = chat_body(&[("user", "one point oh")], i % 2 == 0, 2);
        let keep = if i % 3 == 0 {
            "connection: keep-alive\r\n"
        } else {
            ""
        };
        let head = format!(
            "POST /v1/chat/completions HTTP/1.0\r\nhost: soak\r\n{k}: {v}\r\n{keep}content-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        let ok = (|| {
            let mut s = TcpStream::connect(addr).ok()?;
            s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
            s.write_all(head.as_bytes()).ok()?;
            s.write_all(&body).ok()?;
            let mut out = Vec::new();
            s.read_to_end(&mut out).ok()?;
            let text = String::from_utf8_lossy(&out).to_ascii_lowercase();
            (text.starts_with("http/1.") && !text.contains("transfer-encoding: chunked"))
                .then_some(())
        })();
        if ok.is_none() {
            failures.fetch_add(1, Ordering::Relaxed);
        }
    });
}

/// Unauthenticated requests declaring 512 MiB bodies: answered 401 at once, nothing uploaded.
fn oversized_unauthenticated(addr: SocketAddr, stop: &AtomicBool, failures: &AtomicU64) {
    every(Duration::from_millis(20), stop, || {
        let head = "POST /v1/completions HTTP/1.1\r\nhost: soak\r\nexpect: 100-continue\r\ncontent-length: 536870912\r\n\r\n";
        let ok = (|| {
            let mut s = TcpStream::connect(addr).ok()?;
            s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
            s.write_all(head.as_bytes()).ok()?;
            let mut out = [0u8; 512];
            let n = s.read(&mut out).ok()?;
            out[..n].starts_with(b"HTTP/1.1 401").then_some(())
        })();
        if ok.is_none() {
            failures.fetch_add(1, Ordering::Relaxed);
        }
    });
}

#[test]
fn hostile_traffic_leaves_memory_bounded_and_normal_requests_served() {
    let secs: u64 = std::env::var("RADIXGATE_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let cluster = sim(2, |c| c.max_total_tokens = 50_000);
    let common = [
        "--api-key",
        KEY,
        "--max-tree-size",
        "1000000",
        "--eviction-interval",
        "1",
        "--cb-failure-threshold",
        "100000",
    ];
    let mut ca_args = vec!["--policy", "cache_aware"];
    ca_args.extend_from_slice(&common);
    let mut manual_args = vec!["--policy", "manual"];
    manual_args.extend_from_slice(&common);
    let cache_aware = gateway_for(&cluster.urls(), &ca_args);
    let manual = gateway_for(&cluster.urls(), &manual_args);
    let (ca, mg) = (cache_aware.addr, manual.addr);

    let stop = Arc::new(AtomicBool::new(false));
    let counters: Arc<[AtomicU64; 6]> = Arc::new(Default::default());
    let mut threads = Vec::new();
    let spawn = |threads: &mut Vec<std::thread::JoinHandle<()>>,
                 f: fn(SocketAddr, &AtomicBool, &AtomicU64),
                 addr: SocketAddr,
                 slot: usize| {
        let (stop, counters) = (stop.clone(), counters.clone());
        threads.push(std::thread::spawn(move || f(addr, &stop, &counters[slot])));
    };
    spawn(&mut threads, hostile_models, ca, 0);
    spawn(&mut threads, hostile_routing_keys, mg, 1);
    spawn(&mut threads, trickler, ca, 2);
    spawn(&mut threads, http10_client, ca, 3);
    spawn(&mut threads, oversized_unauthenticated, ca, 4);

    // Normal traffic at a steady rate, on both gateways; every request must succeed.
    let (k, v) = auth();
    let mut normal = 0u64;
    let mut failed = Vec::new();
    let started = Instant::now();
    let warm_up = Duration::from_secs((secs / 6).max(2));
    let mut rss_after_warm_up = None;
    let mut rss_peak = 0;
    while started.elapsed() < Duration::from_secs(secs) {
        let t = Instant::now();
        for addr in [ca, mg] {
            let body = chat_body(
                &[("user", &format!("normal turn {normal}"))],
                normal % 2 == 0,
                2,
            );
            let key = format!("user-{}", normal % 8);
            let headers = [(k, v.as_str()), ("x-smg-routing-key", key.as_str())];
            match request(addr, "POST", "/v1/chat/completions", &headers, &body) {
                Ok(r) if r.status == 200 => {}
                other => failed.push(format!("{normal}: {:?}", other.map(|r| r.status))),
            }
            normal += 1;
        }
        if rss_after_warm_up.is_none() && started.elapsed() >= warm_up {
            rss_after_warm_up = Some(rss_kb());
        }
        rss_peak = rss_peak.max(rss_kb());
        if let Some(rest) = Duration::from_millis(50).checked_sub(t.elapsed()) {
            std::thread::sleep(rest);
        }
    }
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().expect("hostile client thread");
    }
    let base = rss_after_warm_up.unwrap_or(0);
    let end = rss_kb();
    let growth_mb = end.saturating_sub(base) / 1024;
    eprintln!(
        "soak {secs}s: {normal} normal requests, hostile sent: models {} keys {} trickles {}; \
         1.0 failures {} unauthenticated failures {}; RSS after warm-up {} MB, peak {} MB, end {} MB",
        counters[0].load(Ordering::Relaxed),
        counters[1].load(Ordering::Relaxed),
        counters[2].load(Ordering::Relaxed),
        counters[3].load(Ordering::Relaxed),
        counters[4].load(Ordering::Relaxed),
        base / 1024,
        rss_peak / 1024,
        end / 1024
    );
    assert!(failed.is_empty(), "normal requests failed: {failed:?}");
    assert_eq!(
        counters[3].load(Ordering::Relaxed),
        0,
        "HTTP/1.0 requests did not get HTTP/1.0 framing or did not end"
    );
    assert_eq!(
        counters[4].load(Ordering::Relaxed),
        0,
        "unauthenticated oversized requests were not refused at once"
    );
    assert!(
        growth_mb <= RSS_GROWTH_BOUND_MB,
        "resident memory grew by {growth_mb} MB (bound {RSS_GROWTH_BOUND_MB} MB)"
    );
    for addr in [ca, mg] {
        let body = br#"{"text":"still fine","sampling_params":{"max_new_tokens":1}}"#;
        let r = request(addr, "POST", "/generate", &[(k, &v)], body).unwrap();
        assert_eq!(r.status, 200, "the gateway stopped serving: {}", r.text());
    }
}
