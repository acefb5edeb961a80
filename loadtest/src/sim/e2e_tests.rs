//! End-to-end tests over real sockets: `spawn_cluster`, a small blocking HTTP/1.1 client (framing
//! by radixgate's own parser), and checks of shapes, counters, recording, aborts and faults.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use radixgate::http::{parse_response_head, BodyFraming, ChunkedDecoder, HeadLimits};
use serde_json::Value;

use super::{spawn_cluster, Faults, SimCluster, SimConfig, TokenizerMode};

pub(super) struct Resp {
    pub(super) status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// The body ended properly (terminating chunk / full length).
    complete: bool,
}

impl Resp {
    pub(super) fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("bad JSON {e}: {}", String::from_utf8_lossy(&self.body)))
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub(super) fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    /// SSE `data:` payloads.
    pub(super) fn events(&self) -> Vec<String> {
        self.text()
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .map(str::to_owned)
            .collect()
    }
}

pub(super) fn connect(port: u16) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s
}

pub(super) fn send(
    s: &mut TcpStream,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) {
    s.write_all(&super::raw_request(method, path, headers, body))
        .unwrap();
}

/// Read one response; tolerates the server closing early (`complete` = false).
pub(super) fn read_resp(s: &mut TcpStream, buf: &mut BytesMut) -> Resp {
    let mut tmp = [0u8; 16 * 1024];
    let head = loop {
        if let Some(h) =
            parse_response_head(buf, false, &HeadLimits::default()).expect("valid head")
        {
            break h;
        }
        let n = s.read(&mut tmp).expect("read head");
        assert!(n > 0, "connection closed before a response head");
        buf.extend_from_slice(&tmp[..n]);
    };
    let headers = super::header_strings(&head);
    let mut body = BytesMut::new();
    let complete = match head.framing {
        BodyFraming::None => true,
        BodyFraming::Length(n) => {
            while buf.len() < n as usize {
                match s.read(&mut tmp) {
                    Ok(0) | Err(_) => break,
                    Ok(k) => buf.extend_from_slice(&tmp[..k]),
                }
            }
            let take = buf.len().min(n as usize);
            body.extend_from_slice(&buf.split_to(take));
            take == n as usize
        }
        BodyFraming::Chunked => {
            let mut dec = ChunkedDecoder::new(1 << 30);
            loop {
                let used = dec.feed(buf, &mut body).expect("valid chunking");
                let _ = buf.split_to(used);
                if dec.is_done() {
                    break true;
                }
                match s.read(&mut tmp) {
                    Ok(0) | Err(_) => break false,
                    Ok(k) => buf.extend_from_slice(&tmp[..k]),
                }
            }
        }
        BodyFraming::Close => {
            loop {
                match s.read(&mut tmp) {
                    Ok(0) | Err(_) => break,
                    Ok(k) => body.extend_from_slice(&tmp[..k]),
                }
            }
            true
        }
    };
    Resp {
        status: head.status,
        headers,
        body: body.to_vec(),
        complete,
    }
}

pub(super) fn call(port: u16, method: &str, path: &str, body: &str) -> Resp {
    let mut s = connect(port);
    send(&mut s, method, path, &[], body.as_bytes());
    read_resp(&mut s, &mut BytesMut::new())
}

fn metric(port: u16, name: &str) -> f64 {
    let text = call(port, "GET", "/metrics", "").text();
    text.lines()
        .find(|l| {
            l.starts_with(name)
                && l[name.len()..].starts_with('{')
                // The per-tier cached-token series are parts of the `total` one.
                && (!l.contains("cache_source=") || l.contains("cache_source=\"total\""))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing"))
}

pub(super) fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn cluster(cfg: SimConfig) -> SimCluster {
    spawn_cluster(cfg).expect("spawn cluster")
}

const CHAT: &str = r#"{"model":"m","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Tell me about radix trees and prefix caching."}],"max_tokens":6}"#;

#[test]
fn chat_generate_metrics_and_recording() {
    let c = cluster(SimConfig {
        ports: vec![0, 0],
        record_requests: 16,
        ..SimConfig::default()
    });
    let port = c.ports()[0];
    assert_eq!(c.urls()[1], format!("http://127.0.0.1:{}", c.ports()[1]));

    // Non-streaming chat, twice on one keep-alive connection: the repeat hits the cache.
    let mut s = connect(port);
    let mut buf = BytesMut::new();
    send(
        &mut s,
        "POST",
        "/v1/chat/completions",
        &[("X-Test", "a  b"), ("content-type", "application/json")],
        CHAT.as_bytes(),
    );
    let first = read_resp(&mut s, &mut buf);
    assert_eq!(first.status, 200);
    assert_eq!(
        first.header("x-worker-port"),
        Some(port.to_string().as_str())
    );
    assert!(first.header("content-length").is_some());
    let v = first.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "m");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 6);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(text.split_whitespace().count(), 6, "{text:?}");
    send(&mut s, "POST", "/v1/chat/completions", &[], CHAT.as_bytes());
    let v = read_resp(&mut s, &mut buf).json();
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        prompt_tokens - 1
    );
    assert_eq!(
        v["choices"][0]["message"]["content"],
        text.as_str(),
        "deterministic answer"
    );

    // Streaming chat with usage.
    let body = CHAT.replace(
        "\"max_tokens\":6",
        "\"max_tokens\":4,\"stream\":true,\"stream_options\":{\"include_usage\":true}",
    );
    send(&mut s, "POST", "/v1/chat/completions", &[], body.as_bytes());
    let r = read_resp(&mut s, &mut buf);
    assert!(r.complete);
    assert_eq!(r.header("transfer-encoding"), Some("chunked"));
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let ev = r.events();
    assert_eq!(ev.len(), 1 + 4 + 1 + 1 + 1, "{ev:?}");
    assert_eq!(ev.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = ev[..ev.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks[1..5]
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(streamed.split_whitespace().count(), 4);
    assert_eq!(chunks[5]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[6]["usage"]["completion_tokens"], 4);
    assert!(
        chunks[6]["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );

    // /generate streaming: cumulative text.
    send(&mut s, "POST", "/generate", &[], br#"{"text":"The capital of France is","sampling_params":{"max_new_tokens":3},"stream":true}"#);
    let ev = read_resp(&mut s, &mut buf).events();
    assert_eq!(ev.len(), 4);
    let last: Value = serde_json::from_str(&ev[2]).unwrap();
    let second: Value = serde_json::from_str(&ev[1]).unwrap();
    assert!(last["text"]
        .as_str()
        .unwrap()
        .starts_with(second["text"].as_str().unwrap()));
    assert_eq!(last["meta_info"]["finish_reason"]["type"], "length");
    assert_eq!(last["output_ids"].as_array().unwrap().len(), 3);

    // Completions, non-streaming.
    let v = call(
        port,
        "POST",
        "/v1/completions",
        r#"{"prompt":"Once upon a time","max_tokens":2}"#,
    )
    .json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], 2);

    // Metrics counters: 5 inference requests (2 chat + stream chat + generate + completion).
    assert_eq!(metric(port, "sglang:num_requests_total"), 5.0);
    assert_eq!(
        metric(port, "sglang:generation_tokens_total"),
        (6 + 6 + 4 + 3 + 2) as f64
    );
    assert!(metric(port, "sglang:cached_tokens_total") >= (prompt_tokens - 1) as f64);
    assert_eq!(
        metric(port, "sglang:time_to_first_token_seconds_count"),
        5.0
    );
    assert_eq!(metric(port, "sglang:num_running_reqs"), 0.0);
    // The other worker saw nothing.
    assert_eq!(metric(c.ports()[1], "sglang:num_requests_total"), 0.0);

    // Recorded raw requests, byte for byte, headers in order.
    let rec = call(port, "GET", "/debug/requests", "").json();
    let first_rec = &rec[0];
    assert_eq!(first_rec["method"], "POST");
    assert_eq!(first_rec["path"], "/v1/chat/completions");
    assert_eq!(first_rec["body"], CHAT);
    let hdrs: Vec<(String, String)> = first_rec["headers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p[0].as_str().unwrap().to_owned(),
                p[1].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(hdrs[0], ("Host".into(), "sim".into()));
    assert_eq!(hdrs[1], ("X-Test".into(), "a  b".into()));
    assert_eq!(hdrs[2], ("content-type".into(), "application/json".into()));

    // Info endpoints and errors.
    assert_eq!(call(port, "GET", "/health", "").status, 200);
    assert_eq!(call(port, "GET", "/health_generate", "").status, 200);
    let models = call(port, "GET", "/v1/models", "").json();
    assert_eq!(models["data"][0]["id"], "meta-llama/Llama-3.1-8B-Instruct");
    let info = call(port, "GET", "/get_server_info", "").json();
    assert_eq!(info["max_total_num_tokens"], 400_000);
    assert!(info["internal_states"].is_array());
    assert_eq!(
        call(port, "GET", "/get_model_info", "").json()["is_generation"],
        true
    );
    let load = call(port, "GET", "/get_load", "").json();
    assert_eq!(load[0]["num_reqs"], 0);
    let bad = call(port, "POST", "/v1/chat/completions", "{nope");
    assert_eq!(bad.status, 400);
    assert!(bad.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("JSON"));
    assert_eq!(call(port, "GET", "/nope", "").status, 404);
    assert_eq!(call(port, "GET", "/v1/chat/completions", "").status, 405);
    let flush = call(port, "POST", "/flush_cache", "");
    assert_eq!(flush.status, 200);
    assert!(flush.text().starts_with("Cache flushed."));
    let v = call(port, "POST", "/v1/chat/completions", CHAT).json();
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "flushed"
    );

    // Chunked request body.
    let mut s = connect(port);
    let body = r#"{"input_ids":[5,6,7],"sampling_params":{"max_new_tokens":1}}"#;
    let (a, b) = body.split_at(10);
    let raw = format!("POST /generate HTTP/1.1\r\nHost: sim\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\n\r\n", a.len(), b.len());
    s.write_all(raw.as_bytes()).unwrap();
    let v = read_resp(&mut s, &mut BytesMut::new()).json();
    assert_eq!(v["meta_info"]["prompt_tokens"], 3);
    c.shutdown();
}

#[test]
fn disconnect_aborts_and_flush_refused_while_busy() {
    // 10 ms per forward: a 10 000-token answer would take 100 s.
    let c = cluster(SimConfig {
        tokenizer: TokenizerMode::Approx,
        token_interval_ms: Some(10.0),
        ..SimConfig::default()
    });
    let port = c.ports()[0];
    for stream in [true, false] {
        let mut s = connect(port);
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":"hi"}}],"max_tokens":10000,"stream":{stream}}}"#
        );
        send(&mut s, "POST", "/v1/chat/completions", &[], body.as_bytes());
        if stream {
            let mut tmp = [0u8; 1024];
            assert!(s.read(&mut tmp).unwrap() > 0, "stream started");
        }
        wait_for("running", || metric(port, "sglang:num_running_reqs") == 1.0);
        assert_eq!(call(port, "GET", "/flush_cache", "").status, 400, "busy");
        let aborted = metric(port, "sglang:num_aborted_requests_total");
        drop(s);
        wait_for("abort", || metric(port, "sglang:num_running_reqs") == 0.0);
        assert_eq!(
            metric(port, "sglang:num_aborted_requests_total"),
            aborted + 1.0
        );
        assert_eq!(
            metric(port, "sglang:num_used_tokens"),
            0.0,
            "locks and KV released"
        );
    }
    assert_eq!(call(port, "GET", "/flush_cache", "").status, 200);
}

#[test]
fn sse_pacing_follows_token_interval() {
    // 200 virtual ms per forward at 10x → 20 ms real per event.
    let c = cluster(SimConfig {
        tokenizer: TokenizerMode::Approx,
        token_interval_ms: Some(200.0),
        time_scale: 10.0,
        ..SimConfig::default()
    });
    let t = Instant::now();
    let r = call(
        c.ports()[0],
        "POST",
        "/generate",
        r#"{"input_ids":[1,2],"sampling_params":{"max_new_tokens":6},"stream":true}"#,
    );
    let real = t.elapsed();
    assert_eq!(r.events().len(), 7);
    assert!(
        real >= Duration::from_millis(115) && real < Duration::from_secs(2),
        "{real:?}"
    );
    let last: Value = serde_json::from_str(&r.events()[5]).unwrap();
    let e2e = last["meta_info"]["e2e_latency"].as_f64().unwrap();
    assert!((e2e - 1.2).abs() < 1e-6, "virtual e2e {e2e}");
}

#[test]
fn fault_knobs() {
    let approx = || SimConfig {
        tokenizer: TokenizerMode::Approx,
        ..SimConfig::default()
    };
    let gen = r#"{"input_ids":[1,2,3],"sampling_params":{"max_new_tokens":2}}"#;

    // die_after: the first request is answered, then connections are refused.
    let c = cluster(SimConfig {
        faults: Faults {
            die_after: Some(1),
            ..Faults::default()
        },
        ..approx()
    });
    let port = c.ports()[0];
    let mut idle = connect(port);
    assert_eq!(call(port, "POST", "/generate", gen).status, 200);
    wait_for("refused", || {
        TcpStream::connect(("127.0.0.1", port)).is_err()
    });
    let mut tmp = [0u8; 16];
    idle.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    match idle.read(&mut tmp) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("open connections are closed too, got {other:?}"),
    }
    drop(c);

    // fail_rate 1: every inference request fails with a JSON 500; health stays fine.
    let c = cluster(SimConfig {
        faults: Faults {
            fail_rate: 1.0,
            ..Faults::default()
        },
        ..approx()
    });
    let r = call(c.ports()[0], "POST", "/generate", gen);
    assert_eq!(r.status, 500);
    assert_eq!(r.json()["error"]["code"], 500);
    assert_eq!(call(c.ports()[0], "GET", "/health", "").status, 200);
    drop(c);

    // health_fail.
    let c = cluster(SimConfig {
        faults: Faults {
            health_fail: true,
            ..Faults::default()
        },
        ..approx()
    });
    assert_eq!(call(c.ports()[0], "GET", "/health", "").status, 503);
    assert_eq!(
        call(c.ports()[0], "GET", "/health_generate", "").status,
        503
    );
    assert_eq!(call(c.ports()[0], "POST", "/generate", gen).status, 200);
    drop(c);

    // stall_after 1: the second request is read but never answered.
    let c = cluster(SimConfig {
        faults: Faults {
            stall_after: Some(1),
            ..Faults::default()
        },
        ..approx()
    });
    let port = c.ports()[0];
    assert_eq!(call(port, "POST", "/generate", gen).status, 200);
    let mut s = connect(port);
    s.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    send(&mut s, "POST", "/generate", &[], gen.as_bytes());
    let err = s.read(&mut tmp).expect_err("no answer");
    assert!(matches!(
        err.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    ));
    drop(c);

    // latency_ms delays each inference request.
    let c = cluster(SimConfig {
        faults: Faults {
            latency_ms: 150,
            ..Faults::default()
        },
        ..approx()
    });
    let t = Instant::now();
    assert_eq!(call(c.ports()[0], "POST", "/generate", gen).status, 200);
    assert!(t.elapsed() >= Duration::from_millis(150));
    drop(c);

    // close_mid_stream: the stream stops without its terminating chunk, and the request is
    // aborted.
    let c = cluster(SimConfig {
        faults: Faults {
            close_mid_stream: true,
            ..Faults::default()
        },
        ..approx()
    });
    let port = c.ports()[0];
    let r = call(
        port,
        "POST",
        "/generate",
        r#"{"input_ids":[1],"sampling_params":{"max_new_tokens":50},"stream":true}"#,
    );
    assert!(!r.complete);
    assert!(!r.text().contains("[DONE]"));
    assert!(!r.events().is_empty());
    wait_for("cut stream aborted", || {
        metric(port, "sglang:num_aborted_requests_total") == 1.0
    });
    assert_eq!(
        call(port, "POST", "/generate", gen).status,
        200,
        "non-streaming unaffected"
    );
}

#[test]
fn explicit_legacy_driver_and_config_validation() {
    let c = cluster(SimConfig {
        tokenizer: TokenizerMode::Approx,
        io_driver: super::IoDriver::Legacy,
        ..SimConfig::default()
    });
    assert_eq!(c.io_driver(), "legacy");
    assert_eq!(call(c.ports()[0], "GET", "/health", "").status, 200);
    let port = c.ports()[0];
    c.shutdown();
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_err(),
        "port closed on shutdown"
    );
    assert!(spawn_cluster(SimConfig {
        time_scale: 0.0,
        ..SimConfig::default()
    })
    .is_err());
    assert!(spawn_cluster(SimConfig {
        ports: vec![],
        ..SimConfig::default()
    })
    .is_err());
}

/// `--tokenizer-path`: the worker tokenizes with the gateway's own code, so the prompt tokens it
/// reports for a chat are the gateway's `chat_ids`, and its answers re-tokenize to what it
/// generated.
#[test]
fn tokenizer_path_agrees_with_the_gateway() {
    use radixgate::tokenize::{folder, SegmentCache, Tokenizer};
    use std::sync::Arc;

    let dir = std::env::temp_dir().join(format!("radixgate-sim-tok-{}", std::process::id()));
    folder::small_llama3_folder(&dir).unwrap();
    let c = cluster(SimConfig {
        tokenizer_path: Some(dir.clone()),
        token_interval_ms: Some(1.0),
        ..SimConfig::default()
    });
    let port = c.ports()[0];
    let gw = Arc::new(Tokenizer::from_path(&dir).unwrap());
    let mut cache = SegmentCache::new(gw.clone(), 1 << 16);
    let body = serde_json::json!({"messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello there <|eot_id|> how are you?"},
        {"role": "assistant", "content": "Fine, thank you."},
        {"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "a story."}]}
    ], "max_tokens": 12})
    .to_string();
    let v = call(port, "POST", "/v1/chat/completions", &body).json();
    let mut ids = Vec::new();
    cache.chat_ids(body.as_bytes(), &mut ids).unwrap();
    assert_eq!(v["usage"]["prompt_tokens"], ids.len(), "{v}");
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(gw.encode(answer, false).unwrap().len(), 12, "{answer:?}");

    let prompt = "Once upon a time, the tokens were cached.";
    let v = call(
        port,
        "POST",
        "/v1/completions",
        &serde_json::json!({"prompt": prompt, "max_tokens": 2}).to_string(),
    )
    .json();
    let mut ids = Vec::new();
    cache.text_ids(prompt, &mut ids).unwrap();
    assert_eq!(v["usage"]["prompt_tokens"], ids.len(), "{v}");
    assert_eq!(ids[0], folder::LLAMA3_FIRST_SPECIAL);

    let info = call(port, "GET", "/get_server_info", "").json();
    assert_eq!(info["simulator"]["tokenizer"], "hf");
    assert_eq!(info["tokenizer_path"], dir.display().to_string());
    let bad = call(
        port,
        "POST",
        "/v1/chat/completions",
        r#"{"messages":[{"role":"wizard","content":"x"}]}"#,
    );
    assert_eq!(bad.status, 400);
    c.shutdown();

    let missing = spawn_cluster(SimConfig {
        tokenizer_path: Some(dir.join("nope")),
        ..SimConfig::default()
    });
    assert!(missing.is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn priority_scheduling_over_http_and_the_idle_counter() {
    // 100 virtual ms per forward at 10x: 10 ms real; one request runs at a time.
    let c = cluster(SimConfig {
        tokenizer: TokenizerMode::Approx,
        token_interval_ms: Some(100.0),
        time_scale: 10.0,
        max_running: 1,
        priority_scheduling: true,
        ..SimConfig::default()
    });
    let port = c.ports()[0];
    let info = call(port, "GET", "/get_server_info", "").json();
    assert_eq!(info["enable_priority_scheduling"], true);
    // Idle since start: 30 ms real is 0.3 virtual s at least.
    std::thread::sleep(Duration::from_millis(30));
    let idle = metric(port, "sglang:gpu_idle_seconds_total");
    assert!(idle >= 0.3, "{idle}");
    let waiting = || call(port, "GET", "/get_load", "").json()[0]["num_waiting_reqs"].as_u64();
    let send = |body: &'static str| {
        std::thread::spawn(move || {
            let r = call(port, "POST", "/generate", body);
            assert_eq!(r.status, 200, "{}", r.text());
            Instant::now()
        })
    };
    let blocker = send(r#"{"input_ids":[1,2],"sampling_params":{"max_new_tokens":30}}"#);
    wait_for("the blocker to run", || {
        call(port, "GET", "/get_load", "").json()[0]["num_reqs"].as_u64() == Some(1)
            && waiting() == Some(0)
    });
    let low = send(r#"{"input_ids":[3,4],"sampling_params":{"max_new_tokens":2},"priority":0}"#);
    wait_for("the low-priority request to queue", || waiting() == Some(1));
    let high = send(r#"{"input_ids":[5,6],"sampling_params":{"max_new_tokens":2},"priority":10}"#);
    wait_for("both to queue", || waiting() == Some(2));
    let (high_done, low_done) = (high.join().unwrap(), low.join().unwrap());
    blocker.join().unwrap();
    assert!(
        high_done < low_done,
        "the later, higher-priority request ran first"
    );
    // A priority that is not an integer is refused, as SGLang's request model refuses it.
    let r = call(
        port,
        "POST",
        "/generate",
        r#"{"input_ids":[1],"priority":"high"}"#,
    );
    assert_eq!(r.status, 400, "{}", r.text());
}

#[test]
fn max_queued_requests_answers_as_sglang_does() {
    // One request runs at a time, one may wait; 100 virtual ms per forward at 10x.
    let c = cluster(SimConfig {
        tokenizer: TokenizerMode::Approx,
        token_interval_ms: Some(100.0),
        time_scale: 10.0,
        max_running: 1,
        max_queued_requests: Some(1),
        priority_scheduling: true,
        ..SimConfig::default()
    });
    let port = c.ports()[0];
    assert_eq!(
        call(port, "GET", "/get_server_info", "").json()["max_queued_requests"],
        1
    );
    let load = |key: &str| call(port, "GET", "/get_load", "").json()[0][key].as_u64();
    let send =
        |body: &'static str| std::thread::spawn(move || call(port, "POST", "/generate", body));
    let blocker = send(r#"{"input_ids":[1,2],"sampling_params":{"max_new_tokens":30}}"#);
    wait_for("the blocker to run", || {
        load("num_reqs") == Some(1) && load("num_waiting_reqs") == Some(0)
    });
    let low = send(r#"{"input_ids":[3,4],"sampling_params":{"max_new_tokens":2},"priority":0}"#);
    wait_for("one to wait", || load("num_waiting_reqs") == Some(1));
    // The queue is full: a request of no higher priority is refused at once, not queued.
    let r = call(
        port,
        "POST",
        "/v1/completions",
        r#"{"prompt":"x","max_tokens":2,"priority":0}"#,
    );
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(
        r.json(),
        serde_json::json!({"object": "error", "message": "The request queue is full.",
            "type": "503", "param": null, "code": 503})
    );
    // Streamed, the refusal is the stream's one event.
    let r = call(
        port,
        "POST",
        "/generate",
        r#"{"input_ids":[5],"stream":true,"sampling_params":{"max_new_tokens":2}}"#,
    );
    assert_eq!(r.status, 200);
    let events = r.events();
    assert_eq!(events.len(), 2, "{events:?}");
    let ev: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(
        ev["meta_info"]["finish_reason"],
        serde_json::json!({"type": "abort", "status_code": 503,
            "message": "The request queue is full."})
    );
    assert_eq!(events[1], "[DONE]");
    // A strictly higher priority takes the queued request's place: that one gets the 503.
    let high = send(r#"{"input_ids":[6,7],"sampling_params":{"max_new_tokens":2},"priority":5}"#);
    let low = low.join().unwrap();
    assert_eq!(low.status, 503, "{}", low.text());
    assert_eq!(
        low.json()["message"],
        "The request is aborted by a higher priority request."
    );
    assert_eq!(high.join().unwrap().status, 200);
    assert_eq!(blocker.join().unwrap().status, 200);
    let stats = call(port, "GET", "/debug/stats", "").json();
    assert_eq!(stats["queue_full"], 3, "{stats}");
}
