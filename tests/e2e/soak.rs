//! Bounded soaks: hostile traffic of every kind the hardening work closed, beside normal
//! traffic at a steady rate, against real gateways and simulated workers on 127.0.0.0/8.
//!
//! Round 1: hostile clients send distinct `model` names with large prompts (the model forest),
//! distinct routing keys to a `manual` gateway (the key map), bodies trickled a byte at a time,
//! HTTP/1.0 requests, and huge declared bodies without a key. Meanwhile a normal client sends
//! chat requests at a steady rate: every one must succeed, and the process's resident memory
//! must stay within [`RSS_GROWTH_BOUND_MB`] of what it was after warm-up (the round runs in a
//! child process of the test binary by itself, so that memory is the round's alone).
//!
//! Round 2 (the surface added for exact routing, PD and the new APIs), against the binary with
//! `--kv-events --tokenizer-path`: aborts of everything and of guessed ids, `tools` nested to
//! amplify the chat template, a publisher that lies, floods and breaks the protocol by turns
//! with its replay port closed, index copies asked with and without keys, worker registration
//! through a proxy, huge chats of unseen words, workers announcing 100,000 ranks or another
//! host, and a prefill/decode gateway merging input logprobs. Every normal chat is answered
//! within a second, the event thread applies batches every second, and resident memory stops
//! growing.
//!
//! Duration: `RADIXGATE_SOAK_SECS` (default 60) each; the soaks run one after the other. Every
//! loop stops by itself at the deadline.

use crate::common::*;
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
    // Serial: the soaks measure memory and delays under load they make themselves; another
    // timing test beside them would read their load as its stall, and theirs as its. Held by
    // the parent while the soak runs in its child process.
    let _serial = serial();
    // Alone in a process: the figure is this process's resident memory, which any other test's
    // gateways and workers in it would grow too.
    if !alone_in_a_process(
        module_path!(),
        "hostile_traffic_leaves_memory_bounded_and_normal_requests_served",
    ) {
        return;
    }
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

// ---- hardening round 2: the surface added for exact routing, PD and the new APIs ---------------

/// A chat template that prints the client's `tools` with `tojson(indent=4)` (as Llama 3.1's
/// does): the amplification a deeply nested `tools` body aims at.
const TOOLS_TEMPLATE: &str = "{% if tools %}{{ tools | tojson(indent=4) }}{% endif %}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

/// Resident memory the hostile soak's gateway may reach above its size after warm-up (the
/// index of the lying publisher's blocks, floods held within their budget, index copies).
const ROUND2_PEAK_GROWTH_MB: u64 = 320;
/// ...and may still gain over the soak's last third (a structure without a bound keeps growing).
const ROUND2_LATE_GROWTH_MB: u64 = 64;

/// A chat body with `tools` nested `depth` deep around `width` short strings.
fn nested_tools_chat(depth: usize, width: usize) -> Vec<u8> {
    let mut tools = serde_json::json!((0..width).map(|i| format!("t{i}")).collect::<Vec<_>>());
    for _ in 0..depth {
        tools = serde_json::json!([tools]);
    }
    serde_json::to_vec(&serde_json::json!({
        "messages": [{"role": "user", "content": "use the tools"}],
        "tools": tools,
        "max_tokens": 1,
    }))
    .unwrap()
}

/// One hostile client: `f` every `period` until `stop`; `f` says whether the gateway answered
/// as it must (a wrong answer is counted in `wrong`, with the first few kept in `seen`).
pub(crate) fn hostile(
    period: Duration,
    stop: Arc<AtomicBool>,
    wrong: Arc<AtomicU64>,
    seen: Arc<std::sync::Mutex<Vec<String>>>,
    mut f: impl FnMut(u64) -> Result<(), String> + Send + 'static,
) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut n = 0u64;
        every(period, &stop, || {
            if let Err(e) = f(n) {
                wrong.fetch_add(1, Ordering::Relaxed);
                let mut s = seen.lock().unwrap();
                if s.len() < 8 {
                    s.push(e);
                }
            }
            n += 1;
        });
        n
    })
}

/// `Ok` when `r` answered with one of `want`.
pub(crate) fn status_in(
    what: &str,
    r: std::io::Result<Response>,
    want: &[u16],
) -> Result<(), String> {
    match r {
        Ok(r) if want.contains(&r.status) => Ok(()),
        Ok(r) => Err(format!(
            "{what}: {} {}",
            r.status,
            r.text().chars().take(200).collect::<String>()
        )),
        Err(e) => Err(format!("{what}: {e}")),
    }
}

#[test]
fn round_two_hostile_soak_answers_every_normal_request_with_memory_bounded_and_no_stall() {
    use crate::common::hostile::*;
    use loadtest::sim::kv_events::KvEventsConfig;
    // Serial: every normal chat within a second and an event batch every second, under the
    // load the soak makes itself: delays another timing test's load must not add to (the
    // gateways are child processes, so their memory is theirs alone).
    let _serial = serial();
    let secs: u64 = std::env::var("RADIXGATE_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    // The gateway's tokenizer renders the tools template; the simulated workers count tokens
    // the cheap way (their cost is not what is measured).
    let dir = std::env::temp_dir().join(format!("radixgate-soak2-tok-{}", std::process::id()));
    radixgate::tokenize::folder::write_folder(
        &dir,
        &radixgate::tokenize::folder::small_llama3_tokenizer_json(),
        &radixgate::tokenize::folder::llama3_config(TOOLS_TEMPLATE),
    )
    .unwrap();
    let events = || {
        KvEventsConfig::parse(
            r#"{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*"}"#,
        )
        .unwrap()
    };
    let honest = sim(2, |c| {
        c.page_size = 4;
        c.kv_events = Some(events());
        c.tokenizer = loadtest::sim::TokenizerMode::Approx;
        c.max_total_tokens = 400_000;
    });
    // A worker whose events (as the gateway is told) come from a hostile publisher, whose
    // replay port refuses (item 3): floods (item 4) and lies (item 9), by turns.
    let lied_about = sim(1, |c| {
        c.tokenizer = loadtest::sim::TokenizerMode::Approx;
        c.max_total_tokens = 400_000;
    });
    let acts = [
        Act::Lying,
        Act::EndlessFrames,
        Act::Lying,
        Act::HugeFrame,
        Act::Lying,
        Act::MaxMessages,
        Act::Gappy,
    ];
    let zpub = Zpub::bind([127, 0, 0, 1], 0, move |n| acts[n % acts.len()]);
    let lied_url = lied_about.urls()[0].clone();
    let live_flag = format!("{lied_url}=tcp://127.0.0.1:{}", zpub.port);
    let replay_port = closed_port();
    let replay_flag = format!("{lied_url}=tcp://127.0.0.1:{}", replay_port.port);
    let tok = dir.display().to_string();
    let mut workers: Vec<String> = honest.urls();
    workers.push(lied_url.clone());
    let worker_refs: Vec<&str> = workers.iter().map(String::as_str).collect();
    let gw = spawn_gateway(
        &worker_refs,
        &[
            "--policy",
            "cache_aware",
            "--tokenizer-path",
            &tok,
            "--api-key",
            "k",
            "--admin-api-key",
            "adm",
            "--kv-events-endpoints",
            &live_flag,
            "--kv-events-replay-endpoints",
            &replay_flag,
            "--cb-failure-threshold",
            "100000",
        ],
        &[],
    );
    // Workers whose /get_server_info describes hostile publishers (item 8): 100,000 ranks, and
    // another host (a listener there must never be dialled). Added with the admin key.
    let elsewhere = counter([127, 0, 0, 3], 0);
    let ranks_base = closed_port();
    let f_ranks = fake_worker(descriptor("127.0.0.1", ranks_base.port, 100_000, None));
    let f_host = fake_worker(descriptor("127.0.0.3", elsewhere.port, 1, None));
    for f in [&f_ranks, &f_host] {
        let body = serde_json::json!({ "url": f.url }).to_string();
        let r = request(
            gw.addr,
            "POST",
            "/workers",
            &[("authorization", "Bearer adm")],
            body.as_bytes(),
        )
        .unwrap();
        assert_eq!(r.status, 202, "{}", r.text());
    }
    // Prefill/decode (item 10): a second gateway whose normal clients ask for input logprobs.
    let prefill = sim(1, |c| {
        c.disaggregation_mode = Some(loadtest::sim::disagg::DisaggMode::Prefill);
        c.disaggregation_bootstrap_port = 0;
    });
    let decode = sim(1, |c| {
        c.disaggregation_mode = Some(loadtest::sim::disagg::DisaggMode::Decode)
    });
    let bport = prefill.bootstrap_ports()[0].to_string();
    let pd = spawn_gateway(
        &[],
        &[
            "--pd-disaggregation",
            "--prefill",
            &prefill.urls()[0],
            &bport,
            "--decode",
            &decode.urls()[0],
        ],
        &[],
    );
    wait_until("the PD gateway ready", LIMIT, || {
        (request(pd.addr, "GET", "/readiness", &[], b"").ok()?.status == 200).then_some(())
    });

    let stop = Arc::new(AtomicBool::new(false));
    let wrong = Arc::new(AtomicU64::new(0));
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let inf = || [("authorization", "Bearer k")];
    let (addr, pd_addr) = (gw.addr, pd.addr);
    let mut hostiles = Vec::new();
    let mut spawn = |period_ms: u64, f: Box<dyn FnMut(u64) -> Result<(), String> + Send>| {
        hostiles.push(hostile(
            Duration::from_millis(period_ms),
            stop.clone(),
            wrong.clone(),
            seen.clone(),
            f,
        ));
    };
    // Item 1: abort everything, abort guessed ids, with the inference key.
    spawn(
        20,
        Box::new(move |n| {
            let body = if n % 2 == 0 {
                r#"{"abort_all":true}"#.to_string()
            } else {
                format!(r#"{{"rid":"chatcmpl-{n:032x}"}}"#)
            };
            let r = request(addr, "POST", "/abort_request", &inf(), body.as_bytes());
            status_in("abort", r, &[403, 404])
        }),
    );
    // Item 2: tools nested 120 deep around 60,000 names (~0.6 MiB; ~200 MB printed).
    let amplifier = nested_tools_chat(120, 60_000);
    spawn(
        300,
        Box::new(move |_| {
            let r = request(addr, "POST", "/v1/chat/completions", &inf(), &amplifier);
            status_in("nested tools", r, &[200, 400])
        }),
    );
    // Item 5: the index copy, without a key, with the inference key, with the admin key.
    spawn(
        400,
        Box::new(move |n| {
            let (headers, want): (Vec<(&str, &str)>, &[u16]) = match n % 3 {
                0 => (vec![], &[401]),
                1 => (vec![("authorization", "Bearer k")], &[401]),
                _ => (vec![("authorization", "Bearer adm")], &[200, 503]),
            };
            status_in(
                "snapshot",
                request(addr, "GET", "/kv_index/snapshot", &headers, b""),
                want,
            )
        }),
    );
    // Item 6: registering a worker through a proxy, keyless or with the inference key.
    spawn(
        50,
        Box::new(move |n| {
            let body = br#"{"url":"http://127.0.0.1:9"}"#;
            let mut headers = vec![("x-forwarded-for", "203.0.113.7")];
            if n % 2 == 1 {
                headers.push(("authorization", "Bearer k"));
            }
            status_in(
                "control",
                request(addr, "POST", "/workers", &headers, body),
                &[401, 403],
            )
        }),
    );
    // Item 7: a 160 KiB chat of words no cache has seen, every second.
    spawn(
        1000,
        Box::new(move |n| {
            let mut x = (n + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let mut text = String::with_capacity(170 << 10);
            while text.len() < 160 << 10 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                text.push_str(&format!("q{:x} ", x >> 20));
            }
            let body = chat_body(&[("user", &text)], false, 1);
            status_in(
                "huge chat",
                request(addr, "POST", "/v1/chat/completions", &inf(), &body),
                &[200],
            )
        }),
    );
    // Item 10: PD requests asking for input logprobs, streamed and not, with long prompts.
    spawn(
        100,
        Box::new(move |n| {
            let ids: Vec<u32> = (0..2000).map(|i| (i * 7 + n as u32) % 30000).collect();
            let body = serde_json::json!({
                "input_ids": ids, "return_logprob": true, "logprob_start_len": 0,
                "top_logprobs_num": 5, "stream": n % 2 == 0,
                "sampling_params": {"max_new_tokens": 4},
            });
            let r = request(
                pd_addr,
                "POST",
                "/generate",
                &[],
                body.to_string().as_bytes(),
            );
            status_in("pd logprobs", r, &[200])
        }),
    );

    // The honest workers store new blocks every 100 ms (prompts sent to them directly): their
    // batches reach the event thread every second unless it stalls or they are starved.
    let honest_urls: Vec<std::net::SocketAddr> = (0..2).map(|i| worker_addr(&honest, i)).collect();
    spawn(
        100,
        Box::new(move |n| {
            let ids: Vec<u64> = (0..64).map(|i| 1000 + n * 64 + i).collect();
            let body =
                serde_json::json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}});
            let to = honest_urls[(n % 2) as usize];
            status_in(
                "direct prefill",
                request(to, "POST", "/generate", &[], body.to_string().as_bytes()),
                &[200],
            )
        }),
    );
    // Normal chats at a steady rate; the event thread's batches counted every second; the
    // gateway's resident memory sampled.
    let batches = |gw: &Gw| {
        sample(&gw.scrape(), "radixgate_kv_events_total{kind=\"batch\"}").unwrap_or(0.0) as u64
    };
    let started = Instant::now();
    let warm_up = Duration::from_secs((secs / 6).max(2));
    let late = Duration::from_secs(secs * 2 / 3);
    let (mut rss_warm, mut rss_late, mut rss_peak, mut pd_warm, mut pd_peak) =
        (None, None, 0, None, 0);
    let (mut normal, mut failed, mut slowest) = (0u64, Vec::new(), Duration::ZERO);
    let mut stalled_seconds = Vec::new();
    let (mut last_second, mut last_batches) = (Instant::now(), batches(&gw));
    while started.elapsed() < Duration::from_secs(secs) {
        let t = Instant::now();
        // A new prompt each time: the honest workers store blocks, so their event batches
        // arrive every second unless the event thread stalls.
        let body = chat_body(
            &[(
                "user",
                &format!("normal turn {normal}: tell me about the weather today"),
            )],
            normal % 2 == 0,
            2,
        );
        match request(addr, "POST", "/v1/chat/completions", &inf(), &body) {
            Ok(r) if r.status == 200 && !r.text().contains("\"abort\"") => {}
            other => failed.push(format!(
                "{normal}: {:?}",
                other.map(|r| (r.status, r.text()))
            )),
        }
        slowest = slowest.max(t.elapsed());
        normal += 1;
        if last_second.elapsed() >= Duration::from_secs(1) {
            let now = batches(&gw);
            if now == last_batches {
                stalled_seconds.push(started.elapsed().as_secs());
            }
            (last_second, last_batches) = (Instant::now(), now);
            let rss = gw.status_bytes("VmRSS");
            rss_peak = rss_peak.max(rss);
            pd_peak = pd_peak.max(pd.status_bytes("VmRSS"));
            if rss_warm.is_none() && started.elapsed() >= warm_up {
                rss_warm = Some(rss);
                pd_warm = Some(pd.status_bytes("VmRSS"));
            }
            if rss_late.is_none() && started.elapsed() >= late {
                rss_late = Some(rss);
            }
        }
        if let Some(rest) = Duration::from_millis(50).checked_sub(t.elapsed()) {
            std::thread::sleep(rest);
        }
    }
    stop.store(true, Ordering::Relaxed);
    let sent: Vec<u64> = hostiles.into_iter().map(|h| h.join().unwrap()).collect();
    let text = gw.scrape();
    let kind = |k: &str| {
        sample(&text, &format!("radixgate_kv_events_total{{kind=\"{k}\"}}")).unwrap_or(0.0)
    };
    let (warm, end) = (rss_warm.unwrap_or(0), gw.status_bytes("VmRSS"));
    let late_rss = rss_late.unwrap_or(end);
    eprintln!(
        "round-2 soak {secs}s: {normal} normal chats (slowest {slowest:?}), hostile calls {sent:?}, \
         hostile publisher connections {}, wrong answers {}; gateway RSS after warm-up {} MiB, peak {} MiB, at 2/3 {} MiB, end {} MiB; \
         PD gateway RSS after warm-up {} MiB, peak {} MiB; kv events malformed {} connect_failed {} \
         refused {} replay_failed {}; seconds without an event batch: {stalled_seconds:?}",
        zpub.accepted(),
        wrong.load(Ordering::Relaxed),
        warm / MIB,
        rss_peak / MIB,
        late_rss / MIB,
        end / MIB,
        pd_warm.unwrap_or(0) / MIB,
        pd_peak / MIB,
        kind("malformed"),
        kind("connect_failed"),
        kind("refused"),
        kind("replay_failed"),
    );
    assert!(
        failed.is_empty(),
        "normal requests failed: {:?}",
        &failed[..failed.len().min(5)]
    );
    assert!(
        slowest < Duration::from_secs(1),
        "a normal chat took {slowest:?}"
    );
    assert!(
        stalled_seconds.is_empty(),
        "the event thread applied nothing in seconds {stalled_seconds:?}"
    );
    assert_eq!(
        wrong.load(Ordering::Relaxed),
        0,
        "{:?}",
        seen.lock().unwrap()
    );
    assert!(
        sent.iter().all(|&n| n > 0),
        "every hostile client ran: {sent:?}"
    );
    assert!(
        rss_peak.saturating_sub(warm) / MIB <= ROUND2_PEAK_GROWTH_MB,
        "peak {} MiB over {} MiB",
        rss_peak / MIB,
        warm / MIB
    );
    assert!(
        end.saturating_sub(late_rss) / MIB <= ROUND2_LATE_GROWTH_MB,
        "still growing: {} → {} MiB",
        late_rss / MIB,
        end / MIB
    );
    assert!(
        pd_peak.saturating_sub(pd_warm.unwrap_or(0)) / MIB <= 64,
        "PD gateway peak {} MiB",
        pd_peak / MIB
    );
    // Counted where an operator sees them; never dialled elsewhere.
    assert!(kind("malformed") > 0.0 && kind("refused") > 0.0, "{text}");
    assert_eq!(
        elsewhere.count(),
        0,
        "the gateway dialled the host a worker named"
    );
    // The honest workers are still routed by their events.
    for url in honest.urls() {
        assert_eq!(gw.state(&url, 0).as_deref(), Some("live"), "{url}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
