//! End-to-end tests of DP-aware routing (`--dp-aware`) over real sockets: a gateway in front of
//! simulated SGLang servers running several attention-DP ranks per port (`--dp-size`), each rank
//! with its own queue and radix cache, so where a request went and what its rank's cache held
//! can be read back from the servers (`/debug/stats` `dp_ranks`).

use crate::common::*;
use loadtest::sim::SimCluster;
use serde_json::json;
use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::Duration;

/// Simulated servers with `dp` DP ranks per port.
fn dp_sim(n: usize, dp: usize) -> SimCluster {
    sim(n, |c| c.dp_size = dp)
}

/// Requests received by each DP rank of worker `i`.
fn rank_received(cluster: &SimCluster, i: usize) -> Vec<u64> {
    rank_field(cluster, i, "inference_received")
}

fn rank_field(cluster: &SimCluster, i: usize, field: &str) -> Vec<u64> {
    sim_stats(cluster, i)["dp_ranks"]
        .as_array()
        .expect("dp_ranks in /debug/stats")
        .iter()
        .map(|r| r[field].as_u64().expect("a per-rank counter"))
        .collect()
}

/// Every (cluster, port index, rank) received count, flattened in order.
fn all_received(clusters: &[&SimCluster]) -> Vec<u64> {
    let mut out = Vec::new();
    for c in clusters {
        for i in 0..c.ports().len() {
            out.extend(rank_received(c, i));
        }
    }
    out
}

/// The one (port, rank) slot whose count went up by one between `before` and `after`.
fn moved(before: &[u64], after: &[u64]) -> usize {
    let changed: Vec<usize> = (0..after.len())
        .filter(|&k| after[k] != before[k])
        .collect();
    assert_eq!(
        changed.len(),
        1,
        "exactly one rank served it: {before:?} → {after:?}"
    );
    assert_eq!(after[changed[0]], before[changed[0]] + 1);
    changed[0]
}

/// A prompt of about `chars` characters, distinct per `seed`.
fn prompt(seed: usize, chars: usize) -> String {
    let mut s = format!("conversation {seed}: ");
    let mut k = 0;
    while s.len() < chars {
        s.push_str(&format!("token{} word{} ", seed * 7919 + k, k % 13));
        k += 1;
    }
    s
}

#[test]
fn the_simulator_runs_a_queue_and_cache_per_rank() {
    let c = dp_sim(1, 3);
    let addr = worker_addr(&c, 0);
    let info = request(addr, "GET", "/get_server_info", &[], b"")
        .unwrap()
        .json();
    assert_eq!(info["dp_size"], json!(3));
    assert_eq!(info["enable_dp_attention"], json!(true));
    // data_parallel_rank picks the rank; the last duplicate wins, as in Python's json.
    let r = generate(addr, br#"{"text":"hello there","data_parallel_rank":2}"#);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(rank_received(&c, 0), vec![0, 0, 1]);
    let r = generate(
        addr,
        br#"{"text":"hello","data_parallel_rank":0,"data_parallel_rank":1}"#,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(rank_received(&c, 0), vec![0, 1, 1]);
    // Out of range: 400, as SGLang answers.
    for bad in [
        &br#"{"text":"x","data_parallel_rank":3}"#[..],
        br#"{"text":"x","data_parallel_rank":-1}"#,
    ] {
        let r = generate(addr, bad);
        assert_eq!(r.status, 400, "{}", r.text());
    }
    // Without a rank: round robin over the ranks.
    for i in 0..3 {
        assert_eq!(generate(addr, &gen_body(i)).status, 200);
    }
    assert_eq!(rank_received(&c, 0), vec![1, 2, 2]);
    // Each rank has its own cache: the same prompt on another rank is a miss there.
    let long = prompt(1, 600);
    for rank in [0, 0, 1] {
        let body = json!({"text": long, "sampling_params": {"max_new_tokens": 1}, "data_parallel_rank": rank});
        assert_eq!(generate(addr, body.to_string().as_bytes()).status, 200);
    }
    let cached = rank_field(&c, 0, "cached_tokens");
    assert!(cached[0] > 50, "rank 0 hit its own cache: {cached:?}");
    assert!(cached[1] < 5, "rank 1 never saw the prompt: {cached:?}");
    let metrics = request(addr, "GET", "/metrics", &[], b"").unwrap().text();
    assert!(metrics.contains(r#"dp_rank="2""#), "per-rank series");
    // Families stay whole: one HELP each, every rank's samples right after it.
    assert_eq!(
        metrics.matches("# HELP sglang:num_running_reqs ").count(),
        1
    );
    let running: Vec<&str> = metrics
        .lines()
        .skip_while(|l| !l.starts_with("# HELP sglang:num_running_reqs "))
        .skip(2)
        .take(3)
        .collect();
    assert!(
        running
            .iter()
            .enumerate()
            .all(|(r, l)| l.starts_with(&format!("sglang:num_running_reqs{{dp_rank=\"{r}\""))),
        "{running:?}"
    );
    let loads = request(addr, "GET", "/get_load", &[], b"").unwrap().json();
    assert_eq!(loads.as_array().map(Vec::len), Some(3));
}

#[test]
fn every_rank_of_every_worker_is_a_target_and_cold_prompts_spread_over_all() {
    let c = dp_sim(2, 2);
    let gw = gateway_for(&c.urls(), &["--dp-aware", "--policy", "cache_aware"]);
    let workers = workers_json(gw.addr);
    let names: HashSet<String> = workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["url"].as_str().unwrap().to_string())
        .collect();
    let want: HashSet<String> = c
        .urls()
        .iter()
        .flat_map(|u| [format!("{u}@0"), format!("{u}@1")])
        .collect();
    assert_eq!(names, want, "one target per (worker, rank)");
    assert!(workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .all(|w| w["dp_size"] == json!(2)));
    let info = request(gw.addr, "GET", "/get_server_info", &[], b"")
        .unwrap()
        .json();
    assert_eq!(info["config"]["dp_aware"], json!(true));
    // Every rank serves its server's models (learned once per server by the health thread).
    wait_until("every rank's models", Duration::from_secs(10), || {
        let g = gw.gateway();
        let list = g.registry.load_full();
        list.workers
            .iter()
            .all(|w| g.models_of(w.id).is_some())
            .then_some(())
    });
    for i in 0..40 {
        let r = chat(gw.addr, &prompt(100 + i, 200), false, 2);
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let got = all_received(&[&c]);
    assert_eq!(got.iter().sum::<u64>(), 40);
    assert!(
        got.iter().all(|&n| n > 0),
        "every rank of every worker served: {got:?}"
    );
}

#[test]
fn a_conversation_stays_on_one_worker_rank_and_hits_that_ranks_cache() {
    let c = dp_sim(2, 2);
    let gw = gateway_for(&c.urls(), &["--dp-aware", "--policy", "cache_aware"]);
    // Other traffic first, so the ranks are not all cold.
    for i in 0..6 {
        assert_eq!(chat(gw.addr, &prompt(500 + i, 300), false, 2).status, 200);
    }
    let mut history: Vec<(String, String)> = Vec::new();
    let mut slot = None;
    let mut cached_before = 0;
    for turn in 0..4 {
        history.push(("user".into(), prompt(900 + turn, 800)));
        let msgs: Vec<(&str, &str)> = history
            .iter()
            .map(|(r, t)| (r.as_str(), t.as_str()))
            .collect();
        let before = all_received(&[&c]);
        let cached = |k: usize| -> u64 { rank_field(&c, k / 2, "cached_tokens")[k % 2] };
        let r = chat_messages(gw.addr, &msgs, &[]);
        let answer = r.json()["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("")
            .to_string();
        history.push(("assistant".into(), answer));
        let k = moved(&before, &all_received(&[&c]));
        match slot {
            None => slot = Some(k),
            Some(s) => {
                assert_eq!(k, s, "turn {turn} went to another (worker, rank)");
                let now = cached(k);
                assert!(
                    now > cached_before + 150,
                    "turn {turn} hit the rank's cache: {cached_before} → {now}"
                );
            }
        }
        cached_before = cached(k);
    }
}

#[test]
fn the_body_gets_the_rank_spliced_in_and_is_otherwise_byte_identical() {
    let c = dp_sim(1, 2);
    let gw = gateway_for(&c.urls(), &["--dp-aware", "--policy", "round_robin"]);
    // Odd spacing, key order, escapes and number formats survive; a client's own rank is
    // taken out (member and its comma) and the gateway's goes last.
    let body = b"{ \"text\" : \"caf\\u00e9  \\n x\",\"sampling_params\":{\"max_new_tokens\":1,\"temperature\":1.50},\n  \"data_parallel_rank\": 7 }\n";
    let kept = "{ \"text\" : \"caf\\u00e9  \\n x\",\"sampling_params\":{\"max_new_tokens\":1,\"temperature\":1.50} ";
    for _ in 0..2 {
        let before = rank_received(&c, 0);
        let r = generate(gw.addr, body);
        assert_eq!(r.status, 200, "{}", r.text());
        let rank = moved(&before, &rank_received(&c, 0));
        let last = sim_last_body(&c, 0, "/generate");
        let want = format!("{kept},\"data_parallel_rank\":{rank}}}\n");
        assert_eq!(last.matches("data_parallel_rank").count(), 1, "{last}");
        assert_eq!(last, want);
    }
    assert_eq!(
        rank_received(&c, 0),
        vec![1, 1],
        "round robin over the two ranks"
    );
}

#[test]
fn without_dp_aware_nothing_changes() {
    let c = dp_sim(1, 2);
    let gw = gateway_for(&c.urls(), &[]);
    assert_eq!(workers_json(gw.addr)["total"], json!(1));
    let body = br#"{"text":"plain","sampling_params":{"max_new_tokens":1}}"#;
    assert_eq!(generate(gw.addr, body).status, 200);
    let last = sim_last_body(&c, 0, "/generate");
    assert_eq!(last.as_bytes(), body);
}

#[test]
fn a_dead_server_takes_all_its_ranks_out() {
    let a = dp_sim(1, 2);
    let b = dp_sim(1, 2);
    let urls = vec![a.urls()[0].clone(), b.urls()[0].clone()];
    let gw = gateway_for(&urls, &["--dp-aware", "--policy", "round_robin"]);
    let health = |addr: SocketAddr, url: &str| -> Vec<bool> {
        workers_json(addr)["workers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|w| w["url"].as_str().unwrap().starts_with(&format!("{url}@")))
            .map(|w| w["healthy"].as_bool().unwrap())
            .collect()
    };
    assert_eq!(health(gw.addr, &urls[0]), vec![true, true]);
    let b_port = b.ports()[0];
    a.shutdown();
    for i in 0..12 {
        let r = generate(gw.addr, &gen_body(i));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(served_by(&r), b_port);
    }
    assert_eq!(
        health(gw.addr, &urls[0]),
        vec![false, false],
        "both ranks out"
    );
    assert_eq!(health(gw.addr, &urls[1]), vec![true, true]);
    let got = rank_received(&b, 0);
    assert_eq!(got.iter().sum::<u64>(), 12);
    assert!(
        got.iter().all(|&n| n > 0),
        "both of the live server's ranks serve: {got:?}"
    );
}

#[test]
fn workers_added_and_removed_at_run_time_bring_and_take_their_ranks() {
    let c = dp_sim(1, 3);
    let gw = gateway(&["--dp-aware"]);
    let url = c.urls()[0].clone();
    let body = json!({"url": url}).to_string();
    let r = request(gw.addr, "POST", "/workers", &[], body.as_bytes()).unwrap();
    assert_eq!(r.status, 202, "{}", r.text());
    let ranks: Vec<String> = (0..3).map(|k| format!("{url}@{k}")).collect();
    assert_eq!(r.json()["ranks"], json!(ranks));
    assert_eq!(workers_json(gw.addr)["total"], json!(3));
    wait_ready(gw.addr, Duration::from_secs(10));
    for i in 0..6 {
        assert_eq!(generate(gw.addr, &gen_body(i)).status, 200);
    }
    assert_eq!(rank_received(&c, 0).iter().sum::<u64>(), 6);
    remove_worker(gw.addr, &url);
    assert_eq!(
        workers_json(gw.addr)["total"],
        json!(0),
        "every rank removed"
    );
}

/// One server with `dp` ranks publishing KV events on loopback (rank 0 on an ephemeral port,
/// rank r on that port + r, SGLang's rule; the simulated worker draws again when a neighbour
/// of rank 0's port is taken), pages of 4 tokens.
fn kv_dp_sim(dp: usize) -> SimCluster {
    use loadtest::sim::kv_events::KvEventsConfig;
    let cfg = KvEventsConfig::parse(
        r#"{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*"}"#,
    )
    .unwrap();
    let mut sc = loadtest::sim::SimConfig {
        ports: vec![0],
        time_scale: 50.0,
        tokenizer: loadtest::sim::TokenizerMode::Approx,
        default_max_tokens: 8,
        seed: 7,
        page_size: 4,
        dp_size: dp,
        kv_events: Some(cfg),
        ..Default::default()
    };
    sc.io_driver = match test_driver() {
        None => loadtest::sim::IoDriver::Auto,
        Some(TestDriver::Uring) => loadtest::sim::IoDriver::Uring,
        Some(TestDriver::Epoll) => loadtest::sim::IoDriver::Legacy,
    };
    loadtest::sim::spawn_cluster(sc).expect("a DP server publishing KV events")
}

fn ids_body(ids: &[u32], rank: Option<u32>) -> Vec<u8> {
    let mut v = json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}});
    if let Some(r) = rank {
        v["data_parallel_rank"] = json!(r);
    }
    v.to_string().into_bytes()
}

#[test]
fn kv_events_are_indexed_per_rank_and_route_to_the_rank_that_holds_the_prefix() {
    let c = kv_dp_sim(2);
    let gw = gateway_for(
        &c.urls(),
        &["--dp-aware", "--kv-events", "--policy", "cache_aware"],
    );
    let kv = gw.gateway().kv.as_ref().expect("--kv-events on");
    wait_until(
        "both ranks' publishers warm",
        Duration::from_secs(20),
        || (kv.exact_workers().len() == 2).then_some(()),
    );
    let list = gw.gateway().registry.load_full();
    let rank_id = |r: u32| {
        list.workers
            .iter()
            .find(|w| w.dp.map(|d| d.rank) == Some(r))
            .map(|w| w.id)
            .expect("rank registered")
    };
    // Each prompt is prefilled on one rank by a client that bypasses the gateway: only that
    // rank's events tell the gateway where it is. Chance would route all six right 1 in 64.
    for i in 0..6u32 {
        let rank = i % 2;
        let ids: Vec<u32> = (0..64).map(|k| 1000 + i * 10_000 + k).collect();
        assert_eq!(
            generate(worker_addr(&c, 0), &ids_body(&ids, Some(rank))).status,
            200
        );
        wait_until(
            "the rank's blocks reach the index",
            Duration::from_secs(20),
            || {
                let snap = kv.reader.load();
                let mut scratch = Default::default();
                let held = snap
                    .match_prefix(
                        "meta-llama/Llama-3.1-8B-Instruct",
                        radixgate::kv::index::ROOT_PARENT,
                        &ids,
                        &mut scratch,
                    )
                    .iter()
                    .any(|m| m.source.worker == rank_id(rank) && m.blocks == 16);
                held.then_some(())
            },
        );
        let before = rank_received(&c, 0);
        assert_eq!(generate(gw.addr, &ids_body(&ids, None)).status, 200);
        assert_eq!(
            moved(&before, &rank_received(&c, 0)),
            rank as usize,
            "prompt {i}"
        );
    }
}

#[test]
fn each_rank_carries_the_load_its_server_reports_for_it() {
    let c = dp_sim(1, 2);
    let gw = gateway_for(
        &c.urls(),
        &["--dp-aware", "--worker-metrics-interval-secs", "1"],
    );
    // Three requests the gateway never sent wait on rank 1 (reported as queued there).
    set_faults(&c, 0, json!({"hold": true}));
    let addr = worker_addr(&c, 0);
    let waiting: Vec<_> = (0..3)
        .map(|i| {
            std::thread::spawn(move || {
                let body = format!(r#"{{"text":"held {i}","data_parallel_rank":1}}"#);
                generate(addr, body.as_bytes()).status
            })
        })
        .collect();
    let url = c.urls()[0].clone();
    let external = |rank: u32| -> u64 {
        workers_json(gw.addr)["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["url"] == json!(format!("{url}@{rank}")))
            .and_then(|w| w["external_load"].as_u64())
            .unwrap_or(0)
    };
    wait_until("rank 1's own load", Duration::from_secs(15), || {
        (external(1) == 3).then_some(())
    });
    assert_eq!(external(0), 0, "rank 0 is idle: the load is not spread");
    set_faults(&c, 0, json!({"hold": false}));
    for w in waiting {
        assert_eq!(w.join().unwrap(), 200);
    }
}
