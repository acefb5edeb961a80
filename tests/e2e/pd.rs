//! End-to-end tests of prefill/decode disaggregation over real sockets: a gateway in
//! `--pd-disaggregation` mode in front of simulated SGLang servers playing the prefill and the
//! decode role (`--disaggregation-mode`), which really check each other's bootstrap rooms over
//! the prefill's bootstrap port.

use crate::common::*;
use loadtest::sim::disagg::DisaggMode;
use loadtest::sim::SimCluster;
use radixgate::runtime::Running;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

fn last_bootstrap(c: &SimCluster, i: usize) -> Value {
    sim_stats(c, i)["last_bootstrap"].clone()
}

fn received(c: &SimCluster) -> Vec<u64> {
    (0..c.ports().len())
        .map(|i| sim_count(c, i, "inference_received"))
        .collect()
}

/// Both sides saw the same bootstrap fields, naming the prefill server's own bootstrap port.
fn assert_paired(prefill: &SimCluster, p: usize, decode: &SimCluster, d: usize, rooms: usize) {
    let seen_p = last_bootstrap(prefill, p);
    let seen_d = last_bootstrap(decode, d);
    assert_eq!(seen_p, seen_d, "both sides got the same fields");
    assert_eq!(seen_p["host"], "127.0.0.1");
    assert_eq!(seen_p["port"], json!(prefill.bootstrap_ports()[p]));
    let r = seen_p["rooms"].as_array().expect("rooms");
    assert_eq!(r.len(), rooms);
    for room in r {
        assert!(room.as_u64().unwrap() < 1 << 63, "63-bit rooms");
    }
}

#[test]
fn pd_round_trip_non_streaming_streaming_and_batched() {
    let prefill = pd_role(1, DisaggMode::Prefill, 0.0);
    let decode = pd_role(1, DisaggMode::Decode, 0.0);
    let gw = pd_gateway(&[&prefill], &[&decode], &[]);

    // Non-streaming: decode's answer, all the tokens asked for (prefill makes only one).
    let r = generate(
        gw.addr,
        br#"{"text":"Tell me about rivers","sampling_params":{"max_new_tokens":6}}"#,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        served_by(&r),
        decode.ports()[0],
        "the decode worker answers"
    );
    assert_eq!(r.json()["meta_info"]["completion_tokens"], 6);
    assert_paired(&prefill, 0, &decode, 0, 1);
    let first_room = last_bootstrap(&prefill, 0)["rooms"][0].clone();

    // Streaming: the decode stream, event by event, to its end.
    let r = chat(gw.addr, "stream me a story", true, 5);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r
        .header("content-type")
        .is_some_and(|t| t.starts_with("text/event-stream")));
    let text = r.text();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(text.matches("\"content\"").count() >= 5, "{text}");
    assert_paired(&prefill, 0, &decode, 0, 1);
    assert_ne!(
        last_bootstrap(&prefill, 0)["rooms"][0],
        first_room,
        "a fresh room per request"
    );

    // Batched /generate: one room per item, as a list, on both sides.
    let r = generate(
        gw.addr,
        br#"{"text":["first prompt","second prompt"],"sampling_params":{"max_new_tokens":3}}"#,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json().as_array().map(Vec::len), Some(2));
    assert_paired(&prefill, 0, &decode, 0, 2);

    // Both answers were read to their ends: one pooled connection per worker served all three.
    assert_eq!(sim_count(&prefill, 0, "inference_connections"), 1);
    assert_eq!(sim_count(&decode, 0, "inference_connections"), 1);
    // Both workers are free again once the answers are over.
    let w = workers_json(gw.addr);
    for worker in w["workers"].as_array().unwrap() {
        assert_eq!(worker["in_flight"], 0, "{worker}");
    }
}

#[test]
fn non_streaming_generate_gets_the_prefill_input_logprobs_merged_in() {
    let prefill = pd_role(1, DisaggMode::Prefill, 0.0);
    let decode = pd_role(1, DisaggMode::Decode, 0.0);
    let gw = pd_gateway(&[&prefill], &[&decode], &[]);
    let body = br#"{"input_ids":[5,6,7,8,9],"return_logprob":true,"logprob_start_len":0,"sampling_params":{"max_new_tokens":3}}"#;
    let r = generate(gw.addr, body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["meta_info"]["completion_tokens"], 3, "decode's answer");
    let lp = v["meta_info"]["input_token_logprobs"].as_array().unwrap();
    let ids: Vec<u64> = lp.iter().map(|e| e[1].as_u64().unwrap()).collect();
    assert_eq!(
        ids,
        vec![5, 6, 7, 8, 9],
        "prefill's input logprobs, in front"
    );
    assert!(r.header("x-request-id").is_some());
    // Without return_logprob the decode answer passes through untouched.
    let r = generate(
        gw.addr,
        br#"{"input_ids":[5,6,7],"sampling_params":{"max_new_tokens":2}}"#,
    );
    assert_eq!(r.status, 200);
    assert!(r.json()["meta_info"].get("input_token_logprobs").is_none());
}

/// The `data:` JSON events of an SSE body.
fn sse_events(body: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(body)
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect()
}

#[test]
fn streamed_generate_gets_the_prefill_input_logprobs_in_every_event() {
    let prefill = pd_role(1, DisaggMode::Prefill, 0.0);
    let decode = pd_role(1, DisaggMode::Decode, 0.0);
    let gw = pd_gateway(&[&prefill], &[&decode], &[]);
    let body = br#"{"input_ids":[5,6,7,8,9],"return_logprob":true,"logprob_start_len":0,"stream":true,"sampling_params":{"max_new_tokens":4}}"#;
    // The decode server's own events carry none of the prompt's logprobs (it did not compute
    // the prompt): what the client gets below comes from the prefill's answer. Through the
    // gateway, HTTP/1.1 (chunked again after the rewrite) and HTTP/1.0 (close-delimited).
    for http10 in [false, true] {
        let r = if http10 {
            let mut c = Conn::open(gw.addr);
            let head = format!(
                "POST /generate HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                body.len()
            );
            c.send(head.as_bytes());
            c.send(body);
            c.read_response()
                .expect("an HTTP/1.0 answer, ended by the close")
        } else {
            generate(gw.addr, body)
        };
        assert_eq!(r.status, 200, "{}", r.text());
        let events = sse_events(&r.body);
        assert!(events.len() >= 4, "{} events: {}", events.len(), r.text());
        for e in &events {
            let ids: Vec<u64> = e["meta_info"]["input_token_logprobs"]
                .as_array()
                .unwrap_or_else(|| panic!("{e}"))
                .iter()
                .map(|x| x[1].as_u64().unwrap())
                .collect();
            assert_eq!(
                ids,
                vec![5, 6, 7, 8, 9],
                "http10={http10}: prefill's, in every event"
            );
        }
        assert!(
            r.text().trim_end().ends_with("data: [DONE]"),
            "{}",
            r.text()
        );
        if http10 {
            assert!(r.header("transfer-encoding").is_none());
        } else {
            assert_eq!(r.header("transfer-encoding"), Some("chunked"));
        }
    }
    // Without return_logprob the stream passes through untouched.
    let r = generate(
        gw.addr,
        br#"{"input_ids":[5,6,7],"stream":true,"sampling_params":{"max_new_tokens":2}}"#,
    );
    assert_eq!(r.status, 200);
    for e in sse_events(&r.body) {
        assert!(e["meta_info"].get("input_token_logprobs").is_none(), "{e}");
    }
}

#[test]
fn a_failing_prefill_is_an_error_not_a_hang() {
    let prefill = pd_role(1, DisaggMode::Prefill, 1.0);
    let decode = pd_role(1, DisaggMode::Decode, 0.0);
    let gw = pd_gateway(
        &[&prefill],
        &[&decode],
        &[
            "--retry-initial-backoff-ms",
            "1",
            "--retry-max-retries",
            "2",
        ],
    );
    let started = Instant::now();
    let r = generate(
        gw.addr,
        br#"{"text":"doomed","sampling_params":{"max_new_tokens":4}}"#,
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "answered at once, not after the decode side gave up: {:?}",
        started.elapsed()
    );
    assert_eq!(r.status, 500, "{}", r.text());
    // The last attempt's answer is the prefill worker's own error (both attempts went to the
    // only prefill worker: a fleet of one still gets its retries).
    let err = &r.json()["error"];
    assert_eq!(err["code"], 500, "{err}");
    assert_eq!(sim_count(&prefill, 0, "inference_received"), 2);
    // The decode request was dropped with it: nothing keeps running there.
    wait_until("decode idle", Duration::from_secs(5), || {
        (sim_count(&decode, 0, "inference_in_progress") == 0).then_some(())
    });
}

#[test]
fn a_failing_decode_is_retried_on_a_new_pair() {
    let prefill = pd_role(2, DisaggMode::Prefill, 0.0);
    let bad = pd_role(1, DisaggMode::Decode, 1.0);
    let good = pd_role(1, DisaggMode::Decode, 0.0);
    let gw = pd_gateway(
        &[&prefill],
        &[&bad, &good],
        &[
            "--decode-policy",
            "round_robin",
            "--retry-initial-backoff-ms",
            "1",
        ],
    );
    let n = 6;
    for i in 0..n {
        let r = generate(gw.addr, &gen_body(i));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(served_by(&r), good.ports()[0]);
    }
    let failed = sim_count(&bad, 0, "inference_received");
    assert!(failed >= 1, "round robin sent some to the failing decode");
    let prefills: u64 = received(&prefill).iter().sum();
    assert_eq!(
        prefills,
        n as u64 + failed,
        "every attempt is a new pair: the prefill side is asked again"
    );
}

#[test]
fn one_prefill_down_sends_traffic_to_the_others() {
    let up = pd_role(2, DisaggMode::Prefill, 0.0);
    let down = pd_role(1, DisaggMode::Prefill, 0.0);
    let decode = pd_role(1, DisaggMode::Decode, 0.0);
    let gw = pd_gateway(
        &[&up, &down],
        &[&decode],
        &[
            "--prefill-policy",
            "round_robin",
            "--retry-initial-backoff-ms",
            "1",
        ],
    );
    down.shutdown();
    for i in 0..8 {
        let r = generate(gw.addr, &gen_body(i));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let got = received(&up);
    assert_eq!(got.iter().sum::<u64>(), 8, "{got:?}");
    assert!(
        got.iter().all(|&n| n > 0),
        "both live prefills serve: {got:?}"
    );
}

#[test]
fn cache_aware_prefill_side_keeps_a_conversation_on_its_worker() {
    let prefill = pd_role(3, DisaggMode::Prefill, 0.0);
    let decode = pd_role(2, DisaggMode::Decode, 0.0);
    let gw = pd_gateway(&[&prefill], &[&decode], &["--decode-policy", "round_robin"]);
    for conv in 0..3 {
        let system = format!(
            "conversation {conv}: {}",
            "you are a careful assistant. ".repeat(40)
        );
        let mut history = vec![
            ("system".to_string(), system),
            ("user".into(), "hello".into()),
        ];
        let mut home = None;
        for turn in 0..3 {
            let before = received(&prefill);
            let msgs: Vec<(&str, &str)> = history
                .iter()
                .map(|(r, c)| (r.as_str(), c.as_str()))
                .collect();
            let r = chat_messages(gw.addr, &msgs, &[]);
            let after = received(&prefill);
            let served: Vec<usize> = (0..3).filter(|&i| after[i] > before[i]).collect();
            assert_eq!(served.len(), 1, "{before:?} → {after:?}");
            match home {
                None => home = Some(served[0]),
                Some(h) => assert_eq!(served[0], h, "turn {turn} of conversation {conv}"),
            }
            let reply = r.json()["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string();
            history.push(("assistant".into(), reply));
            history.push(("user".into(), format!("and then {turn}?")));
        }
    }
}

#[test]
fn workers_api_adds_prefill_and_decode_workers() {
    let prefill = pd_role(2, DisaggMode::Prefill, 0.0);
    let decode = pd_role(1, DisaggMode::Decode, 0.0);
    // No prefill configured: not ready, and PD requests are refused, not hung.
    let gw = gateway(&[
        "--pd-disaggregation",
        "--decode",
        &decode.urls()[0],
        "--prefill-policy",
        "round_robin",
    ]);
    let ready = wait_until("the decode worker healthy", Duration::from_secs(10), || {
        let r = request(gw.addr, "GET", "/readiness", &[], b"").unwrap();
        let v = r.json();
        (v["healthy_decode_workers"] == 1).then_some((r.status, v))
    });
    assert_eq!(ready.0, 503, "no prefill worker: not ready ({})", ready.1);
    assert_eq!(ready.1["healthy_prefill_workers"], 0);
    let r = generate(gw.addr, &gen_body(0));
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.text().contains("prefill"), "{}", r.text());

    let urls = prefill.urls();
    let boot = prefill.bootstrap_ports();
    let body = json!({"url": urls[0], "worker_type": "prefill", "bootstrap_port": boot[0]});
    let r = request(
        gw.addr,
        "POST",
        "/workers",
        &[],
        body.to_string().as_bytes(),
    )
    .unwrap();
    assert_eq!(r.status, 202, "{}", r.text());
    assert_eq!(r.json()["worker_type"], "prefill");
    let q = format!(
        "/add_worker?url={}&worker_type=prefill&bootstrap_port={}",
        urls[1], boot[1]
    );
    let r = request(gw.addr, "POST", &q, &[], b"").unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    wait_ready(gw.addr, Duration::from_secs(5));
    let bad = json!({"url": "http://127.0.0.1:1", "worker_type": "decode", "bootstrap_port": 5});
    let r = request(gw.addr, "POST", "/workers", &[], bad.to_string().as_bytes()).unwrap();
    assert_eq!(r.status, 400, "{}", r.text());

    let w = workers_json(gw.addr);
    let by_type = |t: &str| {
        w["workers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|x| x["worker_type"] == t)
            .count()
    };
    assert_eq!((by_type("prefill"), by_type("decode")), (2, 1), "{w}");
    for i in 0..4 {
        let r = generate(gw.addr, &gen_body(i));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(received(&prefill), vec![2, 2]);
    let addr: SocketAddr = gw.addr;
    assert_still_serves(addr);
}

/// A worker's `in_flight` in the gateway's `/workers`.
fn in_flight(gw: SocketAddr, url: &str) -> u64 {
    let w = workers_json(gw);
    w["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["url"] == url)
        .and_then(|x| x["in_flight"].as_u64())
        .unwrap_or_else(|| panic!("no {url} in {w}"))
}

#[test]
fn both_workers_stay_loaded_until_the_stream_ends_and_a_leaving_client_frees_them() {
    let prefill = pd_role(1, DisaggMode::Prefill, 0.0);
    // A slow decode: 40 ms of real time per token.
    let decode = sim(1, |c| {
        c.disaggregation_mode = Some(DisaggMode::Decode);
        c.token_interval_ms = Some(2000.0);
    });
    let gw = pd_gateway(&[&prefill], &[&decode], &[]);
    let (p_url, d_url) = (&prefill.urls()[0], &decode.urls()[0]);

    let mut c = stream_chat(gw.addr, "a long story please", 40);
    assert_eq!(c.status, 200);
    wait_until("the prefill answer over", Duration::from_secs(5), || {
        (sim_count(&prefill, 0, "inference_answered") == 1).then_some(())
    });
    assert_eq!(
        (in_flight(gw.addr, p_url), in_flight(gw.addr, d_url)),
        (1, 1),
        "the prefill worker is counted until the decode stream ends"
    );
    let r = c.read_timed_until(b"data: [DONE]", Duration::from_secs(10));
    assert!(!r.is_empty());
    wait_until("both free", Duration::from_secs(5), || {
        (in_flight(gw.addr, p_url) == 0 && in_flight(gw.addr, d_url) == 0).then_some(())
    });

    // A client that leaves mid-stream frees both, and the decode server stops generating.
    let c = stream_chat(gw.addr, "another long story", 50);
    assert_eq!(c.status, 200);
    wait_until("decode generating", Duration::from_secs(5), || {
        (sim_count(&decode, 0, "inference_in_progress") == 1).then_some(())
    });
    drop(c);
    wait_until(
        "decode aborted and both free",
        Duration::from_secs(5),
        || {
            (sim_count(&decode, 0, "inference_in_progress") == 0
                && in_flight(gw.addr, p_url) == 0
                && in_flight(gw.addr, d_url) == 0)
                .then_some(())
        },
    );
}

#[test]
fn other_policies_pick_pairs_too() {
    let prefill = pd_role(2, DisaggMode::Prefill, 0.0);
    let decode = pd_role(2, DisaggMode::Decode, 0.0);
    for (p, d) in [
        ("bucket", "power_of_two"),
        ("random", "cache_aware"),
        ("consistent_hashing", "round_robin"),
    ] {
        let gw = pd_gateway(
            &[&prefill],
            &[&decode],
            &["--prefill-policy", p, "--decode-policy", d],
        );
        let received = |c: &SimCluster| -> Vec<u64> {
            (0..2)
                .map(|i| sim_count(c, i, "inference_received"))
                .collect()
        };
        let (p0, d0) = (received(&prefill), received(&decode));
        for i in 0..6 {
            let r = generate(gw.addr, &gen_body(i));
            assert_eq!(r.status, 200, "{p}/{d}: {}", r.text());
        }
        let delta = |now: Vec<u64>, then: &[u64]| -> Vec<u64> {
            now.iter().zip(then).map(|(n, t)| n - t).collect()
        };
        let (dp, dd) = (
            delta(received(&prefill), &p0),
            delta(received(&decode), &d0),
        );
        // Each request went to exactly one prefill and one decode worker (a pair per request,
        // no side skipped or sent twice).
        assert_eq!(
            (dp.iter().sum::<u64>(), dd.iter().sum::<u64>()),
            (6, 6),
            "{p}/{d}: prefill {dp:?}, decode {dd:?}"
        );
        // The side on round_robin alternates its two workers.
        if d == "round_robin" {
            assert_eq!(dd, [3, 3], "{p}/{d}");
        }
    }
}

#[test]
fn a_decode_error_caused_by_its_prefill_is_blamed_on_the_prefill() {
    // The decode side fails at once (the bootstrap port it is told is dead) while the prefill
    // fails 100 ms later: the prefill is the cause, so the retry keeps the only decode worker
    // and moves to the other prefill.
    let bad = sim(1, |c| {
        c.disaggregation_mode = Some(DisaggMode::Prefill);
        c.disaggregation_bootstrap_port = 0;
        c.faults.fail_rate = 1.0;
        c.faults.latency_ms = 100;
    });
    let good = pd_role(1, DisaggMode::Prefill, 0.0);
    let decode = pd_role(1, DisaggMode::Decode, 0.0);
    let nobody = closed_port();
    let dead = nobody.port.to_string();
    let good_port = good.bootstrap_ports()[0].to_string();
    let gw = gateway(&[
        "--pd-disaggregation",
        "--prefill",
        &bad.urls()[0],
        &dead,
        "--prefill",
        &good.urls()[0],
        &good_port,
        "--decode",
        &decode.urls()[0],
        "--prefill-policy",
        "round_robin",
        "--retry-initial-backoff-ms",
        "1",
        // One failure opens a circuit: whichever worker is blamed is out at once.
        "--cb-failure-threshold",
        "1",
    ]);
    wait_ready(gw.addr, Duration::from_secs(10));
    for i in 0..4 {
        let r = generate(gw.addr, &gen_body(i));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // The pair with the bad prefill was tried, and its decode error went to the prefill: the
    // prefill's circuit is open and the decode's closed (blamed on the decode, its circuit
    // would be open and the only decode worker out).
    assert_eq!(sim_count(&bad, 0, "inference_received"), 1);
    assert_eq!(circuit(gw.addr, &[], &bad.urls()[0]), "open");
    assert_eq!(circuit(gw.addr, &[], &decode.urls()[0]), "closed");
    assert_eq!(circuit(gw.addr, &[], &good.urls()[0]), "closed");
}

#[test]
fn abort_request_reaches_both_workers_of_a_pd_request() {
    let prefill = pd_role(1, DisaggMode::Prefill, 0.0);
    let decode = sim(1, |c| {
        c.disaggregation_mode = Some(DisaggMode::Decode);
        c.token_interval_ms = Some(2000.0);
    });
    let gw = pd_gateway(&[&prefill], &[&decode], &[]);
    let mut c = Conn::open(gw.addr);
    c.send(&raw_request(
        "POST",
        "/v1/chat/completions",
        &[("x-request-id", "pd-abort-1")],
        &chat_body(&[("user", "a long story")], true, 100),
    ));
    assert_eq!(c.read_head(false).unwrap().status, 200);
    let r = request(
        gw.addr,
        "POST",
        "/abort_request",
        &[],
        json!({"rid": "pd-abort-1"}).to_string().as_bytes(),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["sent_to"], "holder", "{}", r.text());
    assert_eq!(sim_count(&decode, 0, "aborted_by_rid"), 1);
    // The prefill half hears it too (its one token is done here, so it has nothing to stop).
    assert_eq!(sim_count(&prefill, 0, "abort_requests"), 1);
    let rest = c.read_timed_until(b"data: [DONE]", Duration::from_secs(3));
    let rest: Vec<u8> = rest.into_iter().flat_map(|(_, b)| b).collect();
    assert!(
        String::from_utf8_lossy(&rest).contains("\"finish_reason\":\"abort\""),
        "the decode stream ends with the abort"
    );
}

#[test]
fn a_single_flaky_decode_server_still_gets_its_retries() {
    // One decode server failing 30 % of requests: a retry goes back to it (there is no other)
    // instead of returning its error while attempts remain.
    let prefill = pd_role(2, DisaggMode::Prefill, 0.0);
    let decode = pd_role(1, DisaggMode::Decode, 0.3);
    let gw = pd_gateway(
        &[&prefill],
        &[&decode],
        &[
            "--retry-initial-backoff-ms",
            "1",
            "--cb-failure-threshold",
            "1000",
        ],
    );
    let n = 30;
    let failed = (0..n)
        .filter(|&i| generate(gw.addr, &gen_body(i)).status != 200)
        .count();
    assert!(failed <= 1, "{failed} of {n} PD requests failed");
}

#[test]
fn a_client_that_leaves_during_the_prefill_aborts_both_halves() {
    let prefill = pd_role(1, DisaggMode::Prefill, 0.0);
    let decode = pd_role(1, DisaggMode::Decode, 0.0);
    let gw = pd_gateway(&[&prefill], &[&decode], &[]);
    // The prefill server holds its request (a long prompt still computing): the decode half
    // waits for its KV, nothing has reached the client yet.
    set_faults(&prefill, 0, json!({"hold": true}));
    let p_url = prefill.urls()[0].clone();
    let d_url = decode.urls()[0].clone();
    let reqs = |c: &SimCluster| {
        request(worker_addr(c, 0), "GET", "/get_load", &[], b"")
            .unwrap()
            .json()[0]["num_reqs"]
            .as_u64()
            .unwrap()
    };
    // Raw socket: nothing answers until the prefill is done, and the test is the client
    // leaving before any response byte (a client library would still be awaiting the head).
    let mut c = Conn::open(gw.addr);
    c.send(&raw_request(
        "POST",
        "/v1/chat/completions",
        &[],
        &chat_body(&[("user", "a prompt still being prefilled")], true, 20),
    ));
    wait_until("prefill holding it", Duration::from_secs(5), || {
        (reqs(&prefill) == 1 && in_flight(gw.addr, &d_url) == 1).then_some(())
    });
    drop(c);
    // Both upstream requests are dropped (closing their connections aborts them on SGLang):
    // the prefill server lets go of it, the decode server runs nothing, both are free.
    wait_until("both halves aborted", Duration::from_secs(5), || {
        (reqs(&prefill) == 0
            && reqs(&decode) == 0
            && in_flight(gw.addr, &p_url) == 0
            && in_flight(gw.addr, &d_url) == 0)
            .then_some(())
    });
    set_faults(&prefill, 0, json!({"hold": false}));
    assert_eq!(sim_count(&decode, 0, "inference_in_progress"), 0);
}

/// The simulated decode server refuses what SGLang's refuses, so the gateway's PD tests exercise
/// the real handshake: a decode request without bootstrap fields, or naming a room no prefill
/// server registered, fails (the latter once the room has had its grace to appear); a paired
/// request whose prefill ran first succeeds.
#[test]
fn the_simulated_decode_server_refuses_requests_without_a_live_bootstrap_room() {
    let prefill = pd_role(1, DisaggMode::Prefill, 0.0);
    let decode = pd_role(1, DisaggMode::Decode, 0.0);
    let d = worker_addr(&decode, 0);
    let generate = |body: Value| {
        request(d, "POST", "/generate", &[], body.to_string().as_bytes()).expect("decode answers")
    };
    // No bootstrap fields at all.
    let r = generate(json!({"text": "hello", "sampling_params": {"max_new_tokens": 2}}));
    assert!(r.status >= 400, "no bootstrap fields: {}", r.status);
    assert!(r.text().contains("bootstrap_room"), "{}", r.text());
    // A room on a live prefill bootstrap server that never registered it.
    let port = prefill.bootstrap_ports()[0];
    let t = Instant::now();
    let r = generate(
        json!({"text": "hello", "sampling_params": {"max_new_tokens": 2},
        "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 12345}),
    );
    assert!(r.status >= 400, "unknown room: {}", r.status);
    assert!(r.text().contains("not registered"), "{}", r.text());
    assert!(
        t.elapsed() >= loadtest::sim::disagg::UNKNOWN_ROOM_GRACE,
        "an unknown room gets its grace to appear first"
    );
    // A bootstrap server that is not there.
    let nobody = closed_port();
    let r = generate(
        json!({"text": "hello", "sampling_params": {"max_new_tokens": 2},
        "bootstrap_host": "127.0.0.1", "bootstrap_port": nobody.port, "bootstrap_room": 7}),
    );
    assert!(r.status >= 400, "dead bootstrap port: {}", r.status);
    assert!(r.text().contains("unreachable"), "{}", r.text());
    // Paired through the gateway, the same decode server answers.
    let gw = pd_gateway(&[&prefill], &[&decode], &[]);
    let body = json!({"text": "hello", "sampling_params": {"max_new_tokens": 2}});
    let r = request(
        gw.addr,
        "POST",
        "/generate",
        &[],
        body.to_string().as_bytes(),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
}

/// A worker on 127.0.0.1 that answers each `POST /generate` with the bytes `answer` makes of
/// the request's body (anything else gets an empty 404). With `hold`, the connection is kept
/// open after the bytes, without another byte, until the gateway closes it; the time it did
/// is sent on the returned channel. For answers no simulated server would give: an oversized
/// one, or exact bytes to compare the merge against.
struct ScriptedWorker {
    url: String,
    closed: std::sync::mpsc::Receiver<Instant>,
}

fn scripted_worker(
    answer: impl Fn(&str) -> (Vec<u8>, bool) + Send + Sync + 'static,
) -> ScriptedWorker {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, closed) = std::sync::mpsc::channel();
    let answer = std::sync::Arc::new(answer);
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let (answer, tx) = (answer.clone(), tx.clone());
            std::thread::spawn(move || {
                let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
                let mut buf = Vec::new();
                let mut tmp = [0u8; 16384];
                loop {
                    // One request: head, then its Content-Length body.
                    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                        match conn.read(&mut tmp) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&tmp[..n]),
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    if buf.len() < end + 4 + len {
                        match conn.read(&mut tmp) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&tmp[..n]),
                        }
                        continue;
                    }
                    let req: Vec<u8> = buf.drain(..end + 4 + len).collect();
                    let body = String::from_utf8_lossy(&req[end + 4..]).into_owned();
                    let (bytes, hold) = if head.starts_with("post /generate ") {
                        answer(&body)
                    } else {
                        (
                            b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n".to_vec(),
                            false,
                        )
                    };
                    if conn.write_all(&bytes).is_err() {
                        return;
                    }
                    if hold {
                        // Until the gateway closes (read sees EOF or a reset).
                        while matches!(conn.read(&mut tmp), Ok(n) if n > 0) {}
                        let _ = tx.send(Instant::now());
                        return;
                    }
                }
            });
        }
    });
    ScriptedWorker { url, closed }
}

/// A JSON answer with a Content-Length.
fn json_answer(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// An event stream, each event one chunk, then the last chunk.
fn sse_answer(events: &[&str]) -> Vec<u8> {
    let mut out =
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            .to_vec();
    for e in events {
        out.extend_from_slice(format!("{:x}\r\n{e}\r\n", e.len()).as_bytes());
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

/// A PD gateway in front of scripted workers (no health endpoint to probe).
fn scripted_pd_gateway(prefill: &ScriptedWorker, decode: &ScriptedWorker) -> Running {
    pd_gateway_urls(&prefill.url, &decode.url)
}

fn pd_gateway_urls(prefill: &str, decode: &str) -> Running {
    let gw = gateway(&[
        "--pd-disaggregation",
        "--prefill",
        prefill,
        "none",
        "--decode",
        decode,
        "--disable-health-check",
        "--worker-metrics-interval-secs",
        "0",
        "--request-timeout-secs",
        "8",
        "--disable-retries",
    ]);
    wait_ready(gw.addr, Duration::from_secs(10));
    gw
}

#[test]
fn merged_answers_are_decode_s_bytes_with_prefill_s_list_spliced_in() {
    // Spacing, key order, number forms and escapes that a parse-and-render merge would change.
    let prefill = scripted_worker(|body| {
        if body.contains(r#""stream":true"#) {
            (
                sse_answer(&[
                    "data: {\"text\":\"\",\"meta_info\":{\"input_token_logprobs\":[[-1.5,5,null]]}}\n\n",
                    "data: {\"text\":\"a\",\"meta_info\":{\"input_token_logprobs\":[[-1.5,5,null], [-2.25E-3, 6, null]]}}\n\n",
                    "data: [DONE]\n\n",
                ]),
                false,
            )
        } else {
            (
                json_answer(
                    r#"{"text":"a","meta_info":{"input_token_logprobs":[[-1.5,5,null], [-2.25E-3, 6, null]]}}"#,
                ),
                false,
            )
        }
    });
    let decode = scripted_worker(|body| {
        if body.contains(r#""stream":true"#) {
            (
                sse_answer(&[
                    "data: {\"text\": \"h\\u00e9\", \"meta_info\": {\"id\": \"r\", \"input_token_logprobs\": [], \"z\": 1.0e0}}\n\n",
                    "data: {\"text\": \"h\\u00e9!\", \"meta_info\": {\"id\": \"r\", \"input_token_logprobs\": [], \"z\": 1.0e0}}\n\n",
                    "data: [DONE]\n\n",
                ]),
                false,
            )
        } else {
            (
                json_answer(
                    r#"{"text": "h\u00e9!", "meta_info": {"z": 1.0e0, "input_token_logprobs": [ [-3.0, 7, null] ], "id": "r"}}"#,
                ),
                false,
            )
        }
    });
    let gw = scripted_pd_gateway(&prefill, &decode);
    let r = generate(
        gw.addr,
        br#"{"input_ids":[5,6,7],"return_logprob":true,"logprob_start_len":0,"sampling_params":{"max_new_tokens":2}}"#,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.text(),
        r#"{"text": "h\u00e9!", "meta_info": {"z": 1.0e0, "input_token_logprobs": [[-1.5,5,null], [-2.25E-3, 6, null],[-3.0, 7, null]], "id": "r"}}"#
    );
    let r = generate(
        gw.addr,
        br#"{"input_ids":[5,6,7],"return_logprob":true,"logprob_start_len":0,"stream":true,"sampling_params":{"max_new_tokens":2}}"#,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.text(),
        "data: {\"text\": \"h\\u00e9\", \"meta_info\": {\"id\": \"r\", \"input_token_logprobs\": [[-1.5,5,null], [-2.25E-3, 6, null]], \"z\": 1.0e0}}\n\n\
         data: {\"text\": \"h\\u00e9!\", \"meta_info\": {\"id\": \"r\", \"input_token_logprobs\": [[-1.5,5,null], [-2.25E-3, 6, null]], \"z\": 1.0e0}}\n\n\
         data: [DONE]\n\n"
    );
}

#[test]
fn an_answer_past_its_prompt_s_bound_is_refused_without_being_read_whole() {
    // 50 MB announced (under the flat 256 MiB cap) for a three-token prompt, then nothing:
    // a gateway that read up to the cap would wait here until the request's deadline.
    const HUGE: usize = 50_000_000;
    let prefill = scripted_worker(|body| {
        if body.contains("big-decode") {
            return (
                json_answer(r#"{"text":"a","meta_info":{"input_token_logprobs":[[-1,5,null]]}}"#),
                false,
            );
        }
        if body.contains(r#""stream":true"#) {
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n{HUGE:x}\r\ndata: {{"
            );
            return (head.into_bytes(), true);
        }
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {HUGE}\r\n\r\n{{\"meta_info\":{{\"input_token_logprobs\":["
        );
        (head.into_bytes(), true)
    });
    let decode = scripted_worker(|body| {
        if body.contains("big-decode") {
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {HUGE}\r\n\r\n{{\"text\":\""
            );
            return (head.into_bytes(), true);
        }
        if body.contains(r#""stream":true"#) {
            return (
                sse_answer(&[
                    "data: {\"text\":\"x\",\"meta_info\":{}}\n\n",
                    "data: [DONE]\n\n",
                ]),
                false,
            );
        }
        (json_answer(r#"{"text":"x","meta_info":{}}"#), false)
    });
    let gw = scripted_pd_gateway(&prefill, &decode);
    let cases: [(&[u8], &str, &ScriptedWorker); 3] = [
        (
            br#"{"input_ids":[5,6,7],"return_logprob":true,"sampling_params":{"max_new_tokens":4}}"#,
            "prefill",
            &prefill,
        ),
        (
            br#"{"input_ids":[5,6,7],"return_logprob":true,"stream":true,"sampling_params":{"max_new_tokens":4}}"#,
            "prefill",
            &prefill,
        ),
        (
            br#"{"input_ids":[5,6,7],"return_logprob":true,"rid":"big-decode","sampling_params":{"max_new_tokens":4}}"#,
            "decode",
            &decode,
        ),
    ];
    for (body, side, worker) in cases {
        let started = Instant::now();
        let r = generate(gw.addr, body);
        let took = started.elapsed();
        assert_eq!(r.status, 502, "{side}: {}", r.text());
        assert!(
            took < Duration::from_secs(3),
            "{side}: answered at once, not after {took:?}"
        );
        let err = &r.json()["error"];
        assert_eq!(err["code"], 502, "{err}");
        let msg = err["message"].as_str().unwrap();
        assert!(msg.contains(side) && msg.contains("larger than"), "{msg}");
        // The oversized answer's connection was closed, not read on.
        let closed = worker
            .closed
            .recv_timeout(Duration::from_secs(3))
            .expect("the gateway closes the oversized answer's connection");
        assert!(closed.duration_since(started) < Duration::from_secs(3));
    }
}

// ---- one pipeline: what the regular exchange does, PD mode does too -----------------------------

/// Prefill servers publishing KV events (pages of 4 tokens, a replay socket each).
fn prefill_with_events(n: usize) -> SimCluster {
    sim(n, |c| {
        c.disaggregation_mode = Some(DisaggMode::Prefill);
        c.disaggregation_bootstrap_port = 0;
        c.page_size = 4;
        c.kv_events = Some(
            loadtest::sim::kv_events::KvEventsConfig::parse(
                r#"{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*"}"#,
            )
            .unwrap(),
        );
    })
}

/// Wait until `gw` routes by every prefill server's events (each publisher live).
fn wait_events_live(gw: &Running, n: usize) {
    let kv = gw.gateway().kv.as_ref().expect("--kv-events on");
    wait_until(
        "the prefill servers' events live",
        Duration::from_secs(20),
        || (kv.exact_workers().len() >= n).then_some(()),
    );
}

#[test]
fn kv_events_route_the_prefill_side_in_pd_mode() {
    // A first gateway prefills prompts somewhere; a second one, started afterwards with an
    // empty text tree, finds each prompt's prefill server from that server's events alone.
    let prefill = prefill_with_events(2);
    let decode = pd_role(1, DisaggMode::Decode, 0.0);
    let first = pd_gateway(&[&prefill], &[&decode], &["--kv-events"]);
    wait_events_live(&first, 2);
    let prompts: Vec<String> = (0..6)
        .map(|i| {
            let ids: Vec<String> = (0..64).map(|t| (5000 + i * 100 + t).to_string()).collect();
            format!(
                r#"{{"input_ids":[{}],"sampling_params":{{"max_new_tokens":1}}}}"#,
                ids.join(",")
            )
        })
        .collect();
    let mut holders = Vec::new();
    let first_kv = first.gateway().kv.as_ref().unwrap();
    for (i, p) in prompts.iter().enumerate() {
        let before = received(&prefill);
        assert_eq!(generate(first.addr, p.as_bytes()).status, 200);
        holders.push(moved(&before, &received(&prefill)));
        // The next pick weighs what each server holds: wait until this prompt's blocks are
        // indexed, so a slow event under load cannot make both servers look empty.
        wait_until(
            "the first copy indexed the prompt",
            Duration::from_secs(20),
            || {
                let snap = first_kv.reader.load();
                (snap.models().map(|m| snap.blocks(m)).sum::<usize>() >= (i + 1) * 16).then_some(())
            },
        );
    }
    assert!(
        holders.contains(&0) && holders.contains(&1),
        "the prompts landed on one prefill server only ({holders:?}): nothing to tell apart"
    );
    let second = pd_gateway(&[&prefill], &[&decode], &["--kv-events"]);
    wait_events_live(&second, 2);
    let kv = second.gateway().kv.as_ref().unwrap();
    wait_until(
        "the second copy indexed the prompts",
        Duration::from_secs(20),
        || {
            let snap = kv.reader.load();
            (snap.models().map(|m| snap.blocks(m)).sum::<usize>() >= 6 * 16).then_some(())
        },
    );
    for (p, &holder) in prompts.iter().zip(&holders) {
        let before = received(&prefill);
        assert_eq!(generate(second.addr, p.as_bytes()).status, 200);
        assert_eq!(moved(&before, &received(&prefill)), holder, "{p}");
    }
}

/// The index of the one counter that moved between `before` and `after`.
fn moved(before: &[u64], after: &[u64]) -> usize {
    let moved: Vec<usize> = (0..before.len())
        .filter(|&i| after[i] != before[i])
        .collect();
    assert_eq!(moved.len(), 1, "{before:?} → {after:?}");
    moved[0]
}

#[test]
fn insert_response_text_learns_the_reply_for_the_prefill_worker() {
    let prefill = pd_role(2, DisaggMode::Prefill, 0.0);
    let decode = pd_role(1, DisaggMode::Decode, 0.0);
    for (flag, expect) in [(true, true), (false, false)] {
        let extra: &[&str] = if flag {
            &["--insert-response-text"]
        } else {
            &[]
        };
        let gw = pd_gateway(&[&prefill], &[&decode], extra);
        let prompt = words(40 + u64::from(flag), 50);
        let r = chat(gw.addr, &prompt, false, 6);
        assert_eq!(r.status, 200, "{}", r.text());
        let reply = r.json()["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        let full = format!("{prompt} {reply}");
        let tree = gw.gateway().router.tree.as_ref().unwrap();
        let until = Instant::now() + Duration::from_millis(if expect { 3000 } else { 300 });
        let learned = loop {
            tree.sync();
            let forest = tree.load();
            let m = forest
                .tree(radixgate::tree::TreeKey::Served(
                    "meta-llama/Llama-3.1-8B-Instruct",
                ))
                .longest_match(&full)
                .matched_chars;
            let learned = m == full.chars().count();
            if learned || Instant::now() > until {
                break learned;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(learned, expect, "--insert-response-text {flag}");
    }
}

#[test]
fn the_target_worker_header_picks_the_prefill_worker_in_pd_mode() {
    let prefill = pd_role(3, DisaggMode::Prefill, 0.0);
    let decode = pd_role(1, DisaggMode::Decode, 0.0);
    let gw = pd_gateway(
        &[&prefill],
        &[&decode],
        &[
            "--prefill-policy",
            "consistent_hashing",
            "--decode-policy",
            "round_robin",
        ],
    );
    for target in [2usize, 0, 1, 2] {
        let before = received(&prefill);
        let t = target.to_string();
        let r = request(
            gw.addr,
            "POST",
            "/generate",
            &[("x-smg-target-worker", t.as_str())],
            br#"{"text":"pick me","sampling_params":{"max_new_tokens":1}}"#,
        )
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(moved(&before, &received(&prefill)), target);
    }
}

#[test]
fn dp_ranks_are_spliced_for_both_sides_and_the_decode_side_learns_its_twins() {
    let prefill = sim(1, |c| {
        c.disaggregation_mode = Some(DisaggMode::Prefill);
        c.disaggregation_bootstrap_port = 0;
        c.dp_size = 2;
    });
    let decode = sim(1, |c| {
        c.disaggregation_mode = Some(DisaggMode::Decode);
        c.dp_size = 2;
    });
    let gw = pd_gateway(
        &[&prefill],
        &[&decode],
        &[
            "--dp-aware",
            "--prefill-policy",
            "round_robin",
            "--decode-policy",
            "round_robin",
        ],
    );
    let ranks = |c: &SimCluster| -> Vec<u64> {
        sim_stats(c, 0)["dp_ranks"]
            .as_array()
            .expect("dp_ranks in /debug/stats")
            .iter()
            .map(|r| r["inference_received"].as_u64().unwrap_or(0))
            .collect()
    };
    for _ in 0..4 {
        let t = Instant::now();
        let r = generate(
            gw.addr,
            br#"{"text":"ranks","sampling_params":{"max_new_tokens":1}}"#,
        );
        assert_eq!(r.status, 200, "{}", r.text());
        // A pair whose decode rank could not find its prefill rank's room would wait it out.
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    }
    // Each side's requests went to both of its ranks (round robin over the rank targets).
    assert_eq!(ranks(&prefill), vec![2, 2]);
    assert_eq!(ranks(&decode), vec![2, 2]);
    // The last request's two bodies (each port records what its ranks received): each side's
    // own rank, and on the decode side its prefill twin's.
    let p: Value = serde_json::from_str(&sim_last_body(&prefill, 0, "/generate")).unwrap();
    let d: Value = serde_json::from_str(&sim_last_body(&decode, 0, "/generate")).unwrap();
    assert!(p["data_parallel_rank"].is_u64(), "{p}");
    assert!(d["data_parallel_rank"].is_u64(), "{d}");
    assert!(p.get("disagg_prefill_dp_rank").is_none(), "{p}");
    assert_eq!(d["disagg_prefill_dp_rank"], p["data_parallel_rank"], "{d}");
    assert_eq!(p["bootstrap_room"], d["bootstrap_room"]);
}

// ---- against the foreign upstream (two aiohttp servers, tests/fixtures/foreign_upstream.py) --
// The prefill server registers each bootstrap room on its own bootstrap server; the decode
// server polls the one the body names: a wrong host, port or room fails the request there.

/// A PD gateway in front of one aiohttp prefill server (with its bootstrap port) and one
/// aiohttp decode server.
fn foreign_pd_gateway(prefill: &Foreign, decode: &Foreign, extra: &[&str]) -> Running {
    let boot = prefill.bootstrap_port.unwrap().to_string();
    let (p, d) = (prefill.url(), decode.url());
    let mut args = vec![
        "--pd-disaggregation",
        "--prefill",
        &p,
        &boot,
        "--decode",
        &d,
    ];
    args.extend_from_slice(extra);
    let gw = gateway(&args);
    wait_ready(gw.addr, Duration::from_secs(10));
    gw
}

/// Both servers got the same body, with the prefill's bootstrap address and `rooms` rooms
/// (a number for one prompt, a list for a batch); the body without the three fields is
/// `sent`. Returns the rooms.
fn assert_foreign_pair(
    prefill: &Foreign,
    decode: &Foreign,
    path: &str,
    sent: &[u8],
    rooms: usize,
) -> Vec<u64> {
    let (p, d) = (prefill.last_body(path), decode.last_body(path));
    assert_eq!(p, d, "the same body went to both sides");
    assert_eq!(p["bootstrap_host"], "127.0.0.1");
    assert_eq!(p["bootstrap_port"], json!(prefill.bootstrap_port.unwrap()));
    let got: Vec<u64> = match &p["bootstrap_room"] {
        Value::Array(a) => a.iter().map(|r| r.as_u64().unwrap()).collect(),
        r => vec![r.as_u64().expect("a room")],
    };
    assert_eq!(got.len(), rooms, "{p}");
    assert!(got.iter().all(|r| *r < 1 << 63), "63-bit rooms: {got:?}");
    let mut without = p.clone();
    for k in ["bootstrap_host", "bootstrap_port", "bootstrap_room"] {
        without.as_object_mut().unwrap().remove(k);
    }
    assert_eq!(
        without,
        serde_json::from_slice::<Value>(sent).unwrap(),
        "the rest unchanged"
    );
    // The prefill server's book: every room of the pair is ready (its prefill finished).
    let book = prefill.stats()["rooms"].clone();
    for r in &got {
        assert_eq!(book[r.to_string()], "ready", "{book}");
    }
    got
}

#[test]
fn pd_pairs_two_aiohttp_servers_through_a_real_bootstrap_handshake() {
    let prefill = Foreign::prefill(&["--first-token-delay-ms", "30"]);
    let decode = Foreign::decode(&["--token-delay-ms", "2"]);
    let gw = foreign_pd_gateway(&prefill, &decode, &[]);

    // Non-streamed: decode's answer, byte for byte, naming the room both sides got.
    let sent = br#"{"text":"tell me about rivers","sampling_params":{"max_new_tokens":6}}"#;
    let r = generate(gw.addr, sent);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(served_by(&r), decode.port, "the decode server answers");
    assert_eq!(r.text(), decode.last_answer("/generate"));
    let rooms = assert_foreign_pair(&prefill, &decode, "/generate", sent, 1);
    let v = r.json();
    assert_eq!(v["meta_info"]["bootstrap_room"], json!(rooms[0]));
    assert_eq!(
        v["meta_info"]["completion_tokens"], 6,
        "decode generated all of it"
    );
    let p_answer: Value = serde_json::from_str(&prefill.last_answer("/generate")).unwrap();
    assert_eq!(
        p_answer["meta_info"]["completion_tokens"], 1,
        "prefill made one token"
    );

    // Streamed chat: decode's SSE relayed byte for byte, chunked to its last chunk.
    let sent = chat_body(&[("user", "stream me a story")], true, 5);
    let mut s = Streaming::open(gw.addr, "POST", "/v1/chat/completions", &[], &sent).unwrap();
    assert_eq!(s.status, 200);
    assert_eq!(s.header("transfer-encoding"), Some("chunked"));
    let got = String::from_utf8(s.read_to_end().unwrap()).unwrap();
    assert_eq!(got, decode.last_answer("/v1/chat/completions"));
    assert!(got.ends_with("data: [DONE]\n\n"));
    let second = assert_foreign_pair(&prefill, &decode, "/v1/chat/completions", &sent, 1);
    assert_ne!(second, rooms, "a fresh room per request");

    // Batched /generate: one room per prompt, as a list, on both sides.
    let sent =
        br#"{"text":["first prompt","second prompt"],"sampling_params":{"max_new_tokens":3}}"#;
    let r = generate(gw.addr, sent);
    assert_eq!(r.status, 200, "{}", r.text());
    let items = r.json();
    let rooms = assert_foreign_pair(&prefill, &decode, "/generate", sent, 2);
    for (item, room) in items.as_array().unwrap().iter().zip(&rooms) {
        assert_eq!(item["meta_info"]["bootstrap_room"], json!(room), "{items}");
    }
    // Completions, streamed: decode's events.
    let sent = br#"{"prompt":"complete me","stream":true,"max_tokens":3}"#;
    let r = request(gw.addr, "POST", "/v1/completions", &[], sent).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.text(), decode.last_answer("/v1/completions"));
    assert_foreign_pair(&prefill, &decode, "/v1/completions", sent, 1);
    // Every answer was read to its end: one pooled connection per server served them all.
    assert_eq!(
        prefill.count("inference_connections"),
        1,
        "{}",
        prefill.stats()
    );
    assert_eq!(
        decode.count("inference_connections"),
        1,
        "{}",
        decode.stats()
    );
}

#[test]
fn pd_input_logprobs_of_an_aiohttp_prefill_are_merged_into_the_decode_answer() {
    let prefill = Foreign::prefill(&[]);
    let decode = Foreign::decode(&[]);
    let gw = foreign_pd_gateway(&prefill, &decode, &[]);
    let body = br#"{"input_ids":[5,6,7,8,9],"return_logprob":true,"logprob_start_len":1,"sampling_params":{"max_new_tokens":3}}"#;
    let r = generate(gw.addr, body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let ids: Vec<u64> = v["meta_info"]["input_token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e[1].as_u64().unwrap())
        .collect();
    assert_eq!(
        ids,
        vec![6, 7, 8, 9],
        "prefill's list, in front of decode's empty one: {v}"
    );
    let p: Value = serde_json::from_str(&prefill.last_answer("/generate")).unwrap();
    assert_eq!(
        v["meta_info"]["input_token_logprobs"],
        p["meta_info"]["input_token_logprobs"]
    );
    assert_eq!(
        v["meta_info"]["output_token_logprobs"]
            .as_array()
            .unwrap()
            .len(),
        3
    );

    // Streamed: every decode event gets prefill's list.
    let body = br#"{"input_ids":[5,6,7],"stream":true,"return_logprob":true,"logprob_start_len":0,"sampling_params":{"max_new_tokens":3}}"#;
    let r = generate(gw.addr, body);
    assert_eq!(r.status, 200, "{}", r.text());
    let text = r.text();
    let events: Vec<Value> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(events.len(), 3, "{text}");
    for e in &events {
        let ids: Vec<u64> = e["meta_info"]["input_token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x[1].as_u64().unwrap())
            .collect();
        assert_eq!(ids, vec![5, 6, 7], "{e}");
    }
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
}

#[test]
fn pd_an_aiohttp_prefill_answer_past_its_bound_is_refused() {
    let prefill = Foreign::prefill(&[]);
    let decode = Foreign::decode(&[]);
    let gw = foreign_pd_gateway(&prefill, &decode, &["--disable-retries"]);
    // 16 MiB of padding in the prefill's answer to a three-token prompt.
    prefill.knobs(json!({"body_pad_bytes": 16 << 20}));
    let body =
        br#"{"input_ids":[5,6,7],"return_logprob":true,"sampling_params":{"max_new_tokens":2}}"#;
    let r = generate(gw.addr, body);
    assert_eq!(r.status, 502, "{}", r.text());
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(
        msg.contains("prefill") && msg.contains("larger than"),
        "{msg}"
    );
    prefill.knobs(json!({"body_pad_bytes": 0}));
    let r = generate(gw.addr, body);
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn pd_a_failing_aiohttp_prefill_ends_the_pair_at_once_and_frees_its_decode_twin() {
    let prefill = Foreign::prefill(&[]);
    let decode = Foreign::decode(&[]);
    let gw = foreign_pd_gateway(&prefill, &decode, &["--disable-retries"]);
    // The prefill answers 503 without registering its room. Its decode twin, polling the
    // bootstrap server, would only fail after its 5 s grace: the gateway answers with the
    // prefill's error at once and drops the decode request.
    prefill.knobs(json!({"fail_next": 1}));
    let started = Instant::now();
    let r = generate(
        gw.addr,
        br#"{"text":"will fail","sampling_params":{"max_new_tokens":2}}"#,
    );
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(
        r.text(),
        prefill.last_answer("/generate"),
        "the prefill's error, as it wrote it"
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    wait_until("the decode half dropped", Duration::from_secs(5), || {
        (decode.count("cancelled") == 1 && decode.count("in_flight") == 0).then_some(())
    });
    let r = generate(
        gw.addr,
        br#"{"text":"works again","sampling_params":{"max_new_tokens":2}}"#,
    );
    assert_eq!(r.status, 200, "{}", r.text());
}
