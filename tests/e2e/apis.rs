//! End-to-end tests of the newer APIs and aborts over real sockets, against simulated SGLang
//! workers (identified by the `x-worker-port` header they set): OpenAI Responses and Anthropic
//! Messages routed by prefix (turn 2 follows turn 1) and streamed through as they arrive;
//! `POST /abort_request` reaching the worker that runs the request; a client that leaves
//! aborting its request on the worker.

use crate::common::*;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Which API a conversation speaks.
#[derive(Clone, Copy, Debug)]
enum Api {
    Responses,
    Messages,
}

impl Api {
    fn path(self) -> &'static str {
        match self {
            Api::Responses => "/v1/responses",
            Api::Messages => "/v1/messages",
        }
    }

    /// The body for a conversation so far: `history` is (role, text), the last one the user's.
    fn body(self, system: &str, history: &[(String, String)], stream: bool) -> Vec<u8> {
        let v = match self {
            Api::Responses => {
                let input: Vec<Value> = history
                    .iter()
                    .map(|(role, text)| {
                        if role == "assistant" {
                            json!({"type": "message", "role": role,
                                   "content": [{"type": "output_text", "text": text}]})
                        } else {
                            json!({"role": role, "content": [{"type": "input_text", "text": text}]})
                        }
                    })
                    .collect();
                json!({"model": "m", "input": input, "stream": stream,
                       "max_output_tokens": 4, "instructions": system})
            }
            Api::Messages => {
                let msgs: Vec<Value> = history
                    .iter()
                    .map(|(role, text)| json!({"role": role, "content": [{"type": "text", "text": text}]}))
                    .collect();
                json!({"max_tokens": 4, "messages": msgs, "model": "m", "stream": stream,
                       "system": [{"type": "text", "text": system}]})
            }
        };
        serde_json::to_vec(&v).unwrap()
    }

    /// The reply text and the prompt tokens the worker had cached, from a whole answer.
    fn reply(self, r: &Response, stream: bool) -> (String, Option<u64>) {
        if stream {
            let mut text = String::new();
            let mut cached = None;
            for line in r.text().lines() {
                let Some(data) = line.strip_prefix("data: ") else {
                    continue;
                };
                let ev: Value = serde_json::from_str(data).unwrap();
                match ev["type"].as_str().unwrap() {
                    "response.output_text.delta" => text.push_str(ev["delta"].as_str().unwrap()),
                    "content_block_delta" => text.push_str(ev["delta"]["text"].as_str().unwrap()),
                    "response.completed" => {
                        cached = ev["response"]["usage"]["input_tokens_details"]["cached_tokens"]
                            .as_u64()
                    }
                    "message_start" => {
                        cached = ev["message"]["usage"]["cache_read_input_tokens"].as_u64()
                    }
                    _ => {}
                }
            }
            return (text, cached);
        }
        let v = r.json();
        match self {
            Api::Responses => (
                v["output"][0]["content"][0]["text"]
                    .as_str()
                    .unwrap()
                    .to_string(),
                v["usage"]["input_tokens_details"]["cached_tokens"].as_u64(),
            ),
            Api::Messages => (
                v["content"][0]["text"].as_str().unwrap().to_string(),
                v["usage"]["cache_read_input_tokens"].as_u64(),
            ),
        }
    }
}

/// Several conversations, four turns each, streamed and not in turn: every turn goes to the
/// worker of the conversation's first turn, the worker's cache holds the earlier turns, and
/// the conversations do not all share one worker (so following is not luck). First turns are
/// misses placed at random among equally loaded workers: with 12 conversations on 3 workers
/// all landing on one has odds of 3 / 3^12 (with 6 it was 0.4 %, and it happened in CI).
fn conversations_keep_their_worker(api: Api) {
    let cluster = sim(3, |_| {});
    let gw = gateway_for(&cluster.urls(), &["--policy", "cache_aware"]);
    let mut homes = HashSet::new();
    for conv in 0..12u64 {
        let system = words(conv * 1000 + 1, 120);
        let mut history = vec![("user".to_string(), words(conv * 1000 + 2, 30))];
        let mut home = None;
        for turn in 0..4u64 {
            let stream = turn % 2 == 1;
            let body = api.body(&system, &history, stream);
            let r = request(gw.addr, "POST", api.path(), &[], &body).unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
            let port = served_by(&r);
            match home {
                None => home = Some(port),
                Some(h) => assert_eq!(h, port, "{api:?} conversation {conv} turn {turn} moved"),
            }
            let (reply, cached) = api.reply(&r, stream);
            assert!(!reply.is_empty(), "{}", r.text());
            if turn > 0 {
                let cached = cached.unwrap_or(0);
                assert!(cached > 100, "turn {turn} found {cached} tokens cached");
            }
            history.push(("assistant".into(), reply));
            history.push(("user".into(), words(conv * 1000 + 10 + turn, 20)));
            gw.gateway().router.tree.as_ref().unwrap().sync();
        }
        homes.insert(home.unwrap());
    }
    assert!(
        homes.len() >= 2,
        "every conversation on one worker: {homes:?}"
    );
}

#[test]
fn responses_conversations_keep_their_worker_turn_by_turn() {
    conversations_keep_their_worker(Api::Responses);
}

#[test]
fn messages_conversations_keep_their_worker_turn_by_turn() {
    conversations_keep_their_worker(Api::Messages);
}

#[test]
fn malformed_bodies_get_an_openai_style_400() {
    let cluster = sim(1, |_| {});
    let gw = gateway_for(&cluster.urls(), &[]);
    for (path, body) in [
        ("/v1/responses", &b"{not json"[..]),
        ("/v1/messages", br#"{"model":"m","max_tokens":1}"#),
        ("/v1/messages", br#"{"messages":"not a list"}"#),
    ] {
        let r = request(gw.addr, "POST", path, &[], body).unwrap();
        assert_eq!(r.status, 400, "{path} {}", r.text());
        let e = &r.json()["error"];
        assert!(e["message"].is_string(), "{}", r.text());
        assert_eq!(e["code"], 400, "{}", r.text());
    }
    assert_eq!(sim_count(&cluster, 0, "inference_received"), 0);
}

/// Events of a slow stream reach the client one by one, as the worker writes them.
fn stream_passes_through(api: Api, last_event: &[u8]) {
    let cluster = sim(1, |c| {
        c.time_scale = 1.0;
        c.token_interval_ms = Some(60.0);
    });
    let gw = gateway_for(&cluster.urls(), &[]);
    let mut body: Value =
        serde_json::from_slice(&api.body("sys", &[("user".into(), "pace me".into())], true))
            .unwrap();
    body[match api {
        Api::Responses => "max_output_tokens",
        Api::Messages => "max_tokens",
    }] = json!(6);
    let mut c = Conn::open(gw.addr);
    c.send(&raw_request(
        "POST",
        api.path(),
        &[],
        &serde_json::to_vec(&body).unwrap(),
    ));
    let head = c.read_head(false).unwrap();
    assert_eq!(head.status, 200);
    let reads = c.read_timed_until(last_event, Duration::from_secs(10));
    let all: Vec<u8> = reads.iter().flat_map(|(_, b)| b.clone()).collect();
    assert!(
        all.windows(last_event.len()).any(|w| w == last_event),
        "{}",
        String::from_utf8_lossy(&all)
    );
    let deltas: Vec<Instant> = reads
        .iter()
        .filter(|(_, b)| String::from_utf8_lossy(b).contains("delta\""))
        .map(|(t, _)| *t)
        .collect();
    // Six tokens 60 ms apart: most reads carry one (a loaded machine may merge a few).
    assert!(
        deltas.len() >= 4,
        "events were coalesced: {} reads",
        deltas.len()
    );
    let spread = *deltas.last().unwrap() - deltas[0];
    assert!(
        spread >= Duration::from_millis(200),
        "all deltas within {spread:?}"
    );
}

#[test]
fn responses_stream_passes_through_as_it_arrives() {
    stream_passes_through(Api::Responses, b"event: response.completed");
}

#[test]
fn messages_stream_passes_through_as_it_arrives() {
    stream_passes_through(Api::Messages, b"event: message_stop");
}

/// A slow cluster: 50 ms per token in real time.
fn slow_sim(n: usize) -> loadtest::sim::SimCluster {
    sim(n, |c| {
        c.time_scale = 1.0;
        c.token_interval_ms = Some(50.0);
    })
}

/// A long streamed chat with this `x-request-id` (none: the gateway assigns one), read up to
/// its first token; returns the connection, the serving worker's port and the request id.
fn long_stream(gw: SocketAddr, rid: Option<&str>) -> (Conn, u16, String) {
    long_stream_with(gw, &[], rid)
}

/// [`long_stream`] with these extra headers.
fn long_stream_with(
    gw: SocketAddr,
    extra: &[(&str, &str)],
    rid: Option<&str>,
) -> (Conn, u16, String) {
    let mut c = Conn::open(gw);
    let mut headers: Vec<(&str, &str)> = rid.map(|r| ("x-request-id", r)).into_iter().collect();
    headers.extend_from_slice(extra);
    c.send(&raw_request(
        "POST",
        "/v1/chat/completions",
        &headers,
        &chat_body(&[("user", "a long story please")], true, 2000),
    ));
    let head = c.read_head(false).unwrap();
    assert_eq!(head.status, 200);
    let port = head.header("x-worker-port").unwrap();
    let port: u16 = std::str::from_utf8(port).unwrap().parse().unwrap();
    let id = String::from_utf8(head.header("x-request-id").unwrap().to_vec()).unwrap();
    if let Some(r) = rid {
        assert_eq!(id, r);
    }
    let _ = c.read_timed_until(b"\"content\"", Duration::from_secs(5));
    (c, port, id)
}

fn index_of(cluster: &loadtest::sim::SimCluster, port: u16) -> usize {
    cluster.ports().iter().position(|&p| p == port).unwrap()
}

#[test]
fn abort_request_reaches_the_worker_that_runs_the_request() {
    let cluster = slow_sim(2);
    let gw = gateway_for(&cluster.urls(), &["--policy", "round_robin"]);
    // One request on each worker, so the wrong target would abort nothing.
    let (mut a, port_a, rid_a) = long_stream(gw.addr, Some("client-chosen-id-1"));
    let (b, port_b, rid_b) = long_stream(gw.addr, None);
    assert_ne!(port_a, port_b);
    let (ia, ib) = (index_of(&cluster, port_a), index_of(&cluster, port_b));
    let r = request(
        gw.addr,
        "POST",
        "/abort_request",
        &[],
        json!({ "rid": rid_a }).to_string().as_bytes(),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["sent_to"], "holder", "{}", r.text());
    assert!(
        !r.text().contains("127.0.0.1"),
        "names a worker: {}",
        r.text()
    );
    // The holder aborted it; the other worker never heard of the abort.
    assert_eq!(sim_count(&cluster, ia, "aborted_by_rid"), 1);
    assert_eq!(sim_count(&cluster, ib, "abort_requests"), 0);
    // The client's stream ends with the abort, as SGLang ends it.
    let rest = a.read_timed_until(b"data: [DONE]", Duration::from_secs(5));
    let rest: Vec<u8> = rest.into_iter().flat_map(|(_, b)| b).collect();
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.contains("\"finish_reason\":\"abort\""), "{rest}");
    assert!(rest.contains("data: [DONE]"), "{rest}");
    // The gateway-assigned id works the same way.
    assert!(rid_b.starts_with("chatcmpl-"), "{rid_b}");
    let r = request(
        gw.addr,
        "POST",
        "/abort_request",
        &[],
        json!({ "rid": rid_b }).to_string().as_bytes(),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(sim_count(&cluster, ib, "aborted_by_rid"), 1);
    assert_eq!(sim_count(&cluster, ia, "abort_requests"), 1);
    drop(b);
    // Finished requests leave the gateway's map: an id it does not hold goes to every worker.
    wait_until("requests off the id map", Duration::from_secs(5), || {
        gw.gateway().in_flight_ids.is_empty().then_some(())
    });
    let r = request(
        gw.addr,
        "POST",
        "/abort_request",
        &[],
        json!({ "rid": rid_a }).to_string().as_bytes(),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["sent_to"], "all", "{}", r.text());
    assert_eq!(r.json()["answered"], 2, "{}", r.text());
    assert_eq!(sim_count(&cluster, ia, "abort_requests"), 2);
    assert_eq!(sim_count(&cluster, ib, "abort_requests"), 2);
    // A body without an id is refused.
    let r = request(gw.addr, "POST", "/abort_request", &[], b"{}").unwrap();
    assert_eq!(r.status, 400, "{}", r.text());
    let r = request(gw.addr, "POST", "/abort_request", &[], b"{nope").unwrap();
    assert_eq!(r.status, 400, "{}", r.text());
}

#[test]
fn aborting_everything_or_an_unknown_id_needs_the_admin_key() {
    let cluster = slow_sim(1);
    let gw = gateway_for(
        &cluster.urls(),
        &["--api-key", "sk-inf", "--admin-api-key", "sk-adm"],
    );
    let body = br#"{"rid":"x"}"#;
    let r = request(gw.addr, "POST", "/abort_request", &[], body).unwrap();
    assert_eq!(r.status, 401);
    let inf = [("authorization", "Bearer sk-inf")];
    let adm = [("authorization", "Bearer sk-adm")];
    // An id the gateway does not hold for this caller is not fanned out on the inference key.
    let r = request(gw.addr, "POST", "/abort_request", &inf, body).unwrap();
    assert_eq!(r.status, 404, "{}", r.text());
    assert!(r.text().contains("\"error\""), "{}", r.text());
    // Nor is SGLang's abort_all, which kills every running request.
    let all = br#"{"rid":"","abort_all":true}"#;
    let r = request(gw.addr, "POST", "/abort_request", &inf, all).unwrap();
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(
        sim_count(&cluster, 0, "abort_requests"),
        0,
        "nothing reached the worker"
    );
    // The admin key may do both.
    let r = request(gw.addr, "POST", "/abort_request", &adm, all).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["sent_to"], "all", "{}", r.text());
    let r = request(gw.addr, "POST", "/abort_request", &adm, body).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(sim_count(&cluster, 0, "abort_requests"), 2);
    // The caller's own request, under the key it was sent with, is aborted on its holder.
    let (_c, _port, rid) = long_stream_with(gw.addr, &inf, Some("trace-1"));
    let r = request(
        gw.addr,
        "POST",
        "/abort_request",
        &inf,
        json!({ "rid": rid }).to_string().as_bytes(),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["sent_to"], "holder", "{}", r.text());
    assert_eq!(sim_count(&cluster, 0, "aborted_by_rid"), 1);
}

#[test]
fn a_leaked_request_id_does_not_abort_another_clients_request() {
    // No keys: the caller is its address. A second client host is 127.0.0.2 (the loopback
    // network reaches the gateway's 127.0.0.1 from any 127/8 source).
    let cluster = slow_sim(1);
    let gw = gateway_for(&cluster.urls(), &[]);
    let (_c, _port, rid) = long_stream(gw.addr, Some("leaked-trace-id"));
    let other: std::net::IpAddr = "127.0.0.2".parse().unwrap();
    let abort = json!({ "rid": rid }).to_string();
    let r = request_from(
        other,
        gw.addr,
        "POST",
        "/abort_request",
        &[],
        abort.as_bytes(),
    )
    .unwrap();
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(
        sim_count(&cluster, 0, "abort_requests"),
        0,
        "never forwarded"
    );
    // abort_all from anyone but the gateway's own host under --keyless-local-admin: refused.
    let r = request_from(
        other,
        gw.addr,
        "POST",
        "/abort_request",
        &[],
        br#"{"abort_all":true}"#,
    )
    .unwrap();
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(sim_count(&cluster, 0, "abort_requests"), 0);
    // The client that sent it aborts it.
    let r = request(gw.addr, "POST", "/abort_request", &[], abort.as_bytes()).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["sent_to"], "holder", "{}", r.text());
    assert_eq!(sim_count(&cluster, 0, "aborted_by_rid"), 1);
}

/// The worker's engine aborted `n` requests (client disconnects included).
fn wait_aborted(cluster: &loadtest::sim::SimCluster, i: usize, n: u64, limit: Duration) {
    wait_until("the worker aborts the request", limit, || {
        (sim_count(cluster, i, "aborted") >= n
            && sim_count(cluster, i, "inference_in_progress") == 0)
            .then_some(())
    });
}

#[test]
fn a_client_that_leaves_aborts_its_request_on_the_worker() {
    let cluster = slow_sim(1);
    let gw = gateway_for(&cluster.urls(), &[]);
    let mut aborted = 0;
    for api in [Api::Responses, Api::Messages] {
        for stream in [false, true] {
            let mut body: Value = serde_json::from_slice(&api.body(
                "sys",
                &[("user".into(), format!("{api:?} {stream} story"))],
                stream,
            ))
            .unwrap();
            body[match api {
                Api::Responses => "max_output_tokens",
                Api::Messages => "max_tokens",
            }] = json!(2000);
            let mut c = Conn::open(gw.addr);
            c.send(&raw_request(
                "POST",
                api.path(),
                &[],
                &serde_json::to_vec(&body).unwrap(),
            ));
            if stream {
                let _ = c.read_timed_until(b"delta", Duration::from_secs(5));
            } else {
                wait_until("the request at the worker", Duration::from_secs(5), || {
                    (sim_count(&cluster, 0, "inference_in_progress") == 1).then_some(())
                });
            }
            drop(c);
            aborted += 1;
            // 2000 tokens take 100 s: only an abort ends it this soon.
            wait_aborted(&cluster, 0, aborted, Duration::from_secs(5));
        }
    }
}

#[test]
fn a_stream_that_leaves_while_queued_is_aborted_at_once() {
    // One running slot: the second stream waits in the queue, its head sent, no token coming.
    let cluster = sim(1, |c| {
        c.time_scale = 1.0;
        c.token_interval_ms = Some(50.0);
        c.max_running = 1;
    });
    let gw = gateway_for(&cluster.urls(), &[]);
    let (first, _, _) = long_stream(gw.addr, None);
    let mut queued = Conn::open(gw.addr);
    queued.send(&raw_request(
        "POST",
        "/v1/chat/completions",
        &[],
        &chat_body(&[("user", "waiting in line")], true, 10),
    ));
    wait_until(
        "the queued request at the worker",
        Duration::from_secs(5),
        || (sim_count(&cluster, 0, "inference_in_progress") == 2).then_some(()),
    );
    std::thread::sleep(Duration::from_millis(100));
    drop(queued);
    // The first stream runs for 100 s: the queued one is aborted without a token to write
    // (the gateway waits for a stream's first chunk before answering, watching the client).
    wait_aborted_queued(&cluster);
    drop(first);
}

fn wait_aborted_queued(cluster: &loadtest::sim::SimCluster) {
    wait_until("the queued request aborted", Duration::from_secs(3), || {
        (sim_count(cluster, 0, "aborted") == 1
            && sim_count(cluster, 0, "inference_in_progress") == 1)
            .then_some(())
    });
}
