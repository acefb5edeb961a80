//! `--engine vllm` end to end over real sockets: vLLM's routes (and SGLang's answered 404),
//! token-id prompts, vLLM's metric names, `/kv_event_sources` per DP rank, and vLLM's KV
//! events read with a real ZeroMQ SUB and DEALER and decoded generically with `rmpv`.

use std::time::{Duration, Instant};

use bytes::BytesMut;
use rmpv::Value as Mp;
use serde_json::{json, Value};

use super::e2e_tests::{call, connect, read_resp, send, wait_for};
use super::kv_events::KvEventsConfig;
use super::{spawn_cluster, EngineKind, LoraModule, SimCluster, SimConfig, TokenizerMode};

/// Every wait on a socket in these tests ends by this deadline.
const DEADLINE: Duration = Duration::from_secs(10);
const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

fn vllm_cluster(ports: usize, dp: usize, kv: Option<&str>, max_total_tokens: usize) -> SimCluster {
    spawn_cluster(SimConfig {
        ports: vec![0; ports],
        dp_size: dp,
        page_size: 4,
        max_total_tokens,
        tokenizer: TokenizerMode::Approx,
        time_scale: 1000.0,
        engine: EngineKind::Vllm,
        lora_modules: vec![LoraModule::parse("ad1=/adapters/ad1").unwrap()],
        kv_events: kv.map(|k| KvEventsConfig::parse(k).unwrap()),
        ..SimConfig::default()
    })
    .expect("spawn cluster")
}

fn post(port: u16, path: &str, body: Value) -> super::e2e_tests::Resp {
    call(port, "POST", path, &body.to_string())
}

/// `/inference/v1/generate` of `ids` on DP rank `rank` (vLLM's `X-data-parallel-rank`
/// header) with the extra body fields in `extra`; returns the answer (checked 200).
fn tokens(port: u16, ids: &[u32], rank: usize, extra: Value) -> Value {
    let r = tokens_on(port, ids, &rank.to_string(), extra);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

/// [`tokens`] with any `X-data-parallel-rank` value, unchecked.
fn tokens_on(port: u16, ids: &[u32], rank: &str, extra: Value) -> super::e2e_tests::Resp {
    let mut body = json!({"token_ids": ids, "sampling_params": {"max_tokens": 1}});
    if let (Some(b), Some(x)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(x.clone());
    }
    let mut s = connect(port);
    let body = body.to_string();
    let headers = [("x-data-parallel-rank", rank)];
    send(
        &mut s,
        "POST",
        "/inference/v1/generate",
        &headers,
        body.as_bytes(),
    );
    read_resp(&mut s, &mut BytesMut::new())
}

/// The value of the sample line that starts with `prefix` (name and labels).
fn sample(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{prefix} missing in\n{text}"))
}

#[test]
fn vllm_routes_token_prompts_and_metrics() {
    let c = vllm_cluster(1, 2, None, 400_000);
    let port = c.ports()[0];
    // SGLang's own endpoints do not exist on a vLLM server.
    for (method, path) in [
        ("POST", "/generate"),
        ("GET", "/get_server_info"),
        ("GET", "/server_info"),
        ("POST", "/flush_cache"),
        ("GET", "/get_load"),
        ("GET", "/v1/loads"),
        ("GET", "/get_model_info"),
        ("GET", "/health_generate"),
        ("POST", "/abort_request"),
    ] {
        let r = call(port, method, path, "{}");
        assert_eq!(r.status, 404, "{method} {path}: {}", r.text());
        assert_eq!(r.json(), json!({"detail": "Not Found"}));
    }
    assert_eq!(call(port, "GET", "/health", "").status, 200);
    assert_eq!(
        call(port, "GET", "/version", "").json()["version"],
        "0.33.0"
    );
    assert_eq!(call(port, "GET", "/load", "").json()["server_load"], 0);
    assert_eq!(call(port, "GET", "/kv_event_sources", "").json(), json!({}));
    assert_eq!(call(port, "GET", "/reset_prefix_cache", "").status, 405);
    assert_eq!(call(port, "GET", "/inference/v1/generate", "").status, 405);
    let models = call(port, "GET", "/v1/models", "").json();
    let data = models["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    assert_eq!(
        (&data[0]["id"], &data[0]["parent"]),
        (&json!(MODEL), &Value::Null)
    );
    assert_eq!(data[0]["owned_by"], "vllm");
    assert_eq!(
        (&data[1]["id"], &data[1]["parent"], &data[1]["root"]),
        (&json!("ad1"), &json!(MODEL), &json!("/adapters/ad1"))
    );

    // Token in, token out: the answer names the request after its request_id.
    let ids: Vec<u32> = (1..=40).collect();
    let v = tokens(
        port,
        &ids,
        0,
        json!({"request_id": "r1", "sampling_params": {"max_tokens": 3}}),
    );
    assert_eq!(v["request_id"], "generate-tokens-r1");
    assert_eq!(v["output_mode"], "tokens");
    assert_eq!(v["choices"][0]["token_ids"].as_array().unwrap().len(), 3);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], 40);
    // The same prompt on the same rank hits its cache (whole pages, the last token recomputed).
    let again = tokens(port, &ids, 0, json!({}));
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 36, "cached {cached}");
    // Streamed, with usage: one event per token, the last with the finish, then usage, [DONE].
    let mut s = connect(port);
    let body = json!({
        "token_ids": ids, "sampling_params": {"max_tokens": 2}, "stream": true,
        "stream_options": {"include_usage": true},
    })
    .to_string();
    send(
        &mut s,
        "POST",
        "/inference/v1/generate",
        &[("x-request-id", "hdr")],
        body.as_bytes(),
    );
    let r = read_resp(&mut s, &mut BytesMut::new());
    assert_eq!(r.status, 200);
    let events = r.events();
    assert_eq!(events.len(), 4, "{events:?}");
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(
        first["request_id"], "generate-tokens-hdr",
        "x-request-id names it"
    );
    assert!(first["choices"][0]["finish_reason"].is_null());
    let second: Value = serde_json::from_str(&events[1]).unwrap();
    assert_eq!(second["choices"][0]["finish_reason"], "length");
    let usage: Value = serde_json::from_str(&events[2]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 2);
    assert_eq!(events[3], "[DONE]");
    let bad = post(port, "/inference/v1/generate", json!({"token_ids": []}));
    assert_eq!(bad.status, 400);
    // Two ranks: rank 2 does not exist; a header that is not a number is ignored.
    assert_eq!(tokens_on(port, &ids, "2", json!({})).status, 400);
    assert_eq!(tokens_on(port, &ids, "x", json!({})).status, 200);

    // /v1/completions takes a string, a list of strings, token ids, or a list of lists.
    for (prompt, n) in [
        (json!("hello there"), 1),
        (json!(["a b", "c d e"]), 2),
        (json!([5, 6, 7]), 1),
        (json!([[5, 6], [7, 8, 9], [10]]), 3),
    ] {
        let r = post(
            port,
            "/v1/completions",
            json!({"model": "ad1", "prompt": prompt, "max_tokens": 2}),
        );
        assert_eq!(r.status, 200, "{prompt}: {}", r.text());
        assert_eq!(r.json()["choices"].as_array().unwrap().len(), n, "{prompt}");
    }
    let chat = post(
        port,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    );
    assert_eq!(chat.status, 200);

    // /tokenize as the inference endpoints tokenize; /detokenize of generated ids.
    let t = post(port, "/tokenize", json!({"prompt": "hello world"})).json();
    assert_eq!(t["count"], t["tokens"].as_array().unwrap().len());
    let m = post(
        port,
        "/tokenize",
        json!({"messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(m.status, 200);
    let out = v["choices"][0]["token_ids"].clone();
    let d = post(port, "/detokenize", json!({ "tokens": out })).json();
    assert!(!d["prompt"].as_str().unwrap().is_empty());

    // vLLM's metric names, one `engine` per DP rank, nothing of SGLang's.
    let text = call(port, "GET", "/metrics", "").text();
    assert!(!text.contains("sglang:"));
    let l0 = format!("{{engine=\"0\",model_name=\"{MODEL}\"}}");
    let l1 = format!("{{engine=\"1\",model_name=\"{MODEL}\"}}");
    assert!(sample(&text, &format!("vllm:prefix_cache_queries_total{l0}")) >= 80.0);
    assert!(sample(&text, &format!("vllm:prefix_cache_hits_total{l0}")) >= 36.0);
    assert!(sample(&text, &format!("vllm:prompt_tokens_total{l0}")) >= 80.0);
    assert!(sample(&text, &format!("vllm:generation_tokens_total{l0}")) >= 4.0);
    assert_eq!(
        sample(&text, &format!("vllm:num_requests_running{l1}")),
        0.0
    );
    assert_eq!(
        sample(&text, &format!("vllm:num_requests_waiting{l0}")),
        0.0
    );
    assert_eq!(sample(&text, &format!("vllm:kv_cache_usage_perc{l0}")), 0.0);
    assert_eq!(
        sample(&text, &format!("vllm:num_preemptions_total{l0}")),
        0.0
    );
    for name in [
        "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.001\"",
        "vllm:inter_token_latency_seconds_count{engine=\"0\"",
        "vllm:request_queue_time_seconds_sum{engine=\"1\"",
    ] {
        assert!(text.contains(name), "{name}");
    }
    assert_eq!(
        text.matches("# TYPE vllm:num_requests_running gauge")
            .count(),
        1
    );
    // /reset_prefix_cache empties the cache: the prompt is computed again.
    let reset = post(port, "/reset_prefix_cache", json!({}));
    assert_eq!(reset.json(), json!({"success": true}));
    let cold = tokens(port, &ids, 0, json!({}));
    assert_eq!(cold["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
}

#[test]
fn vllm_abort_requests_by_id() {
    let c = spawn_cluster(SimConfig {
        tokenizer: TokenizerMode::Approx,
        token_interval_ms: Some(20.0),
        engine: EngineKind::Vllm,
        ..SimConfig::default()
    })
    .expect("spawn cluster");
    let port = c.ports()[0];
    let streamer = std::thread::spawn(move || {
        let mut s = connect(port);
        let body = json!({
            "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2000}, "stream": true,
            "request_id": "long",
        })
        .to_string();
        send(
            &mut s,
            "POST",
            "/inference/v1/generate",
            &[],
            body.as_bytes(),
        );
        read_resp(&mut s, &mut BytesMut::new())
    });
    wait_for("the request to run", || {
        call(port, "GET", "/debug/stats", "").json()["running_rids"]
            .as_array()
            .is_some_and(|a| !a.is_empty())
    });
    // Named by its request_id (vLLM's engine knows it with the generate-tokens- prefix).
    let r = post(
        port,
        "/inference/v1/abort_requests",
        json!({"request_ids": ["long"]}),
    );
    assert_eq!(r.status, 200);
    let resp = streamer.join().unwrap();
    let events = resp.events();
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "abort", "{events:?}");
    assert_eq!(events.last().unwrap(), "[DONE]");
    assert_eq!(
        call(port, "GET", "/debug/stats", "").json()["aborted_by_rid"],
        1
    );
    let missing = post(port, "/inference/v1/abort_requests", json!({}));
    assert_eq!(missing.status, 400);
    assert!(missing.text().contains("request_ids"));
}

#[test]
fn vllm_config_checks() {
    let events_off = vllm_cluster(1, 1, Some(r#"{"enable_kv_cache_events":false}"#), 1000);
    assert!(
        events_off.kv_events().is_empty(),
        "disabled: nothing published"
    );
    let port = events_off.ports()[0];
    assert_eq!(call(port, "GET", "/kv_event_sources", "").json(), json!({}));
    // vLLM's key and flag mean nothing to SGLang: refused rather than ignored.
    for cfg in [
        SimConfig {
            kv_events: Some(KvEventsConfig::parse(r#"{"enable_kv_cache_events":true}"#).unwrap()),
            ..SimConfig::default()
        },
        SimConfig {
            lora_modules: vec![LoraModule::parse("a").unwrap()],
            ..SimConfig::default()
        },
    ] {
        assert!(spawn_cluster(cfg).is_err());
    }
}

/// A SUB socket on `endpoint` whose subscription is live: reset the (empty) cache of `port`
/// until a batch arrives (ZeroMQ drops what a PUB sends before the subscription reaches it),
/// then skip everything sent so far.
fn warm_sub(ctx: &zmq::Context, port: u16, endpoint: &str) -> (zmq::Socket, u64) {
    let sock = ctx.socket(zmq::SUB).unwrap();
    sock.set_subscribe(b"").unwrap();
    sock.set_rcvtimeo(DEADLINE.as_millis() as i32).unwrap();
    sock.connect(endpoint).unwrap();
    let t = Instant::now();
    loop {
        assert!(t.elapsed() < DEADLINE, "subscription never became live");
        assert_eq!(post(port, "/reset_prefix_cache", json!({})).status, 200);
        if sock.poll(zmq::POLLIN, 50).unwrap() > 0 {
            break;
        }
    }
    let stats = call(port, "GET", "/debug/stats", "").json();
    (sock, stats["kv_events"]["next_seq"].as_u64().unwrap())
}

/// The next batch numbered at or after `from`: `(seq, decoded [ts, events, rank])`.
fn next_batch(sock: &zmq::Socket, from: u64) -> (u64, Vec<Mp>) {
    loop {
        let f = sock.recv_multipart(0).expect("a batch before the deadline");
        assert_eq!(f.len(), 3, "topic, seq, payload");
        let seq = u64::from_be_bytes(f[1].as_slice().try_into().unwrap());
        if seq < from {
            continue;
        }
        let v = rmpv::decode::read_value(&mut &f[2][..]).expect("msgpack");
        return (seq, v.as_array().expect("array_like EventBatch").clone());
    }
}

fn field<'a>(m: &'a Mp, key: &str) -> &'a Mp {
    m.as_map()
        .and_then(|m| m.iter().find(|(k, _)| k.as_str() == Some(key)))
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no {key} in {m}"))
}

fn ev_type(e: &Mp) -> &str {
    field(e, "type").as_str().unwrap()
}

#[test]
fn vllm_kv_event_sources_and_events() {
    // Two servers of two DP ranks; the PUB endpoint on a wildcard host, the replay on loopback.
    let c = vllm_cluster(
        2,
        2,
        Some(
            r#"{"enable_kv_cache_events":true,"endpoint":"tcp://*:*","replay_endpoint":"tcp://127.0.0.1:*"}"#,
        ),
        48,
    );
    let port = c.ports()[0];
    let sources = call(port, "GET", "/kv_event_sources", "").json();
    let obj = sources.as_object().unwrap();
    assert_eq!(
        obj.keys().collect::<Vec<_>>(),
        ["0", "1"],
        "keyed by DP rank"
    );
    let port_of = |ep: &Value| -> u16 {
        ep.as_str()
            .unwrap()
            .rsplit(':')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    for rank in ["0", "1"] {
        let s = &sources[rank];
        assert_eq!(s["enable_kv_cache_events"], true);
        assert_eq!(s["publisher"], "zmq");
        assert!(
            s["endpoint"].as_str().unwrap().starts_with("tcp://*:"),
            "wildcard kept: {s}"
        );
        assert!(s["replay_endpoint"]
            .as_str()
            .unwrap()
            .starts_with("tcp://127.0.0.1:"));
        assert_eq!(
            (&s["buffer_steps"], &s["topic"]),
            (&json!(10000), &json!(""))
        );
    }
    assert_eq!(
        port_of(&sources["1"]["endpoint"]),
        port_of(&sources["0"]["endpoint"]) + 1
    );
    assert_eq!(
        port_of(&sources["1"]["replay_endpoint"]),
        port_of(&sources["0"]["replay_endpoint"]) + 1
    );
    // The second server announces its own ranks.
    let other = call(c.ports()[1], "GET", "/kv_event_sources", "").json();
    assert_ne!(other["0"]["endpoint"], sources["0"]["endpoint"]);

    let ctx = zmq::Context::new();
    let ep0 = sources["0"]["endpoint"]
        .as_str()
        .unwrap()
        .replace('*', "127.0.0.1");
    let (sub, from) = warm_sub(&ctx, port, &ep0);
    // A salted prompt through an adapter: 3 full pages of 4 tokens.
    let ids: Vec<u32> = (100..112).collect();
    tokens(port, &ids, 0, json!({"model": "ad1", "cache_salt": "s1"}));
    let (seq, batch) = next_batch(&sub, from);
    assert!(seq >= from);
    assert_eq!(batch.len(), 3, "[ts, events, data_parallel_rank]");
    assert!(batch[0].as_f64().unwrap() > 1.0e9, "a Unix time");
    assert_eq!(batch[2].as_u64(), Some(0));
    let evs = batch[1].as_array().unwrap();
    let stored = evs
        .iter()
        .find(|e| ev_type(e) == "BlockStored")
        .expect("a store");
    let hashes = field(stored, "block_hashes").as_array().unwrap();
    assert_eq!(hashes.len(), 3);
    assert!(
        hashes.iter().all(|h| h.as_u64().is_some()),
        "unsigned hashes: {hashes:?}"
    );
    assert!(field(stored, "parent_block_hash").is_nil());
    let toks: Vec<u64> = field(stored, "token_ids")
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert_eq!(toks, (100..112).collect::<Vec<u64>>());
    assert_eq!(field(stored, "block_size").as_u64(), Some(4));
    assert_eq!(field(stored, "medium").as_str(), Some("GPU"));
    assert_eq!(field(stored, "lora_name").as_str(), Some("ad1"));
    assert!(field(stored, "lora_id").is_nil());
    let extra = field(stored, "extra_keys").as_array().unwrap();
    assert_eq!(extra.len(), 3, "one entry per block");
    assert_eq!(extra[0], Mp::Array(vec!["ad1".into(), "s1".into()]));
    assert_eq!(extra[1], Mp::Array(vec!["ad1".into()]));
    assert_eq!(field(stored, "group_idx").as_u64(), Some(0));
    assert_eq!(
        field(stored, "kv_cache_spec_kind").as_str(),
        Some("full_attention")
    );
    let first = hashes[0].as_u64().unwrap();

    // Fill the 48-token cache with other prompts: evictions are one BlockRemoved per block.
    let mut removed = Vec::new();
    for k in 0..4u32 {
        let other: Vec<u32> = (0..16).map(|i| 1000 * (k + 1) + i).collect();
        tokens(port, &other, 0, json!({}));
    }
    let t = Instant::now();
    while !removed.contains(&first) {
        assert!(
            t.elapsed() < DEADLINE,
            "the salted prompt's first block was never evicted"
        );
        let (_, batch) = next_batch(&sub, from);
        for e in batch[1].as_array().unwrap() {
            if ev_type(e) == "BlockRemoved" {
                let hs = field(e, "block_hashes").as_array().unwrap();
                assert_eq!(hs.len(), 1, "one block per removal");
                assert_eq!(field(e, "medium").as_str(), Some("GPU"));
                removed.push(hs[0].as_u64().unwrap());
            }
        }
    }

    // Rank 1 publishes on its own socket, its batches carrying its rank.
    let ep1 = sources["1"]["endpoint"]
        .as_str()
        .unwrap()
        .replace('*', "127.0.0.1");
    let sub1 = ctx.socket(zmq::SUB).unwrap();
    sub1.set_subscribe(b"").unwrap();
    sub1.set_rcvtimeo(DEADLINE.as_millis() as i32).unwrap();
    sub1.connect(&ep1).unwrap();
    let t = Instant::now();
    let mut k = 0u32;
    let batch1 = loop {
        assert!(t.elapsed() < DEADLINE, "rank 1 never published");
        k += 1;
        tokens(
            port,
            &(0..8).map(|i| 50_000 + 10 * k + i).collect::<Vec<_>>(),
            1,
            json!({}),
        );
        if sub1.poll(zmq::POLLIN, 50).unwrap() > 0 {
            break next_batch(&sub1, 0).1;
        }
    };
    assert_eq!(batch1[2].as_u64(), Some(1));

    // Replay from rank 0's ROUTER: vLLM 0.33 answers [b"", topic, seq, payload] per batch, then
    // [b"", b"", -1, b""].
    let d = ctx.socket(zmq::DEALER).unwrap();
    d.set_rcvtimeo(DEADLINE.as_millis() as i32).unwrap();
    d.set_linger(0).unwrap();
    d.connect(sources["0"]["replay_endpoint"].as_str().unwrap())
        .unwrap();
    d.send_multipart([&b""[..], &seq.to_be_bytes()], 0).unwrap();
    let mut replayed = Vec::new();
    loop {
        let f = d.recv_multipart(0).expect("a replay answer");
        assert_eq!(f.len(), 4, "[b\"\", topic, seq, payload]");
        assert!(f[0].is_empty() && f[1].is_empty());
        let s = i64::from_be_bytes(f[2].as_slice().try_into().unwrap());
        if s == -1 {
            assert!(f[3].is_empty());
            break;
        }
        replayed.push(s as u64);
    }
    assert_eq!(
        replayed.first(),
        Some(&seq),
        "from the asked sequence number"
    );
    assert!(replayed.windows(2).all(|w| w[1] == w[0] + 1));
}
