//! End to end, in process: a simulated worker (`loadtest::sim`) on an ephemeral port and a short
//! multi-turn chat workload against it, over real sockets.

use super::*;
use crate::sim::{spawn_cluster, SimConfig, TokenizerMode};

fn cluster(workers: usize) -> crate::sim::SimCluster {
    spawn_cluster(SimConfig {
        ports: vec![0; workers],
        tokenizer: TokenizerMode::Approx,
        // Simulated GPU 10× faster than real time: the whole test stays well under 10 s.
        time_scale: 10.0,
        ..SimConfig::default()
    })
    .expect("spawn simulated worker")
}

#[test]
fn smoke_chat_against_one_worker_counts_latency_and_hits() {
    let sim = cluster(1);
    let started = std::time::Instant::now();
    let r = run_smoke(&sim.urls()[0]).expect("loadgen run");
    assert!(
        started.elapsed().as_secs_f64() < 10.0,
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(r.failed, 0, "errors: {:?}", r.error_examples);
    assert_eq!(r.sessions, 6);
    // Every session has at least two turns (no one-shot sessions in the smoke preset).
    assert!(r.ok >= 12 && r.ok == r.sent, "ok {} sent {}", r.ok, r.sent);
    assert_eq!(r.ttft.count, r.ok);
    assert!(r.ttft.p50_ms > 0.0 && r.e2e.p50_ms >= r.ttft.p50_ms);
    assert!(r.itl.count > 0, "streamed answers give inter-token gaps");
    assert!(r.completion_tokens > 0 && r.prompt_tokens > 0);
    // Later turns extend earlier prompts (and their answers), so the worker reports hits.
    let hit = r.hit_rate.expect("cached_tokens reported");
    assert!(hit > 0.3, "hit rate {hit}");
    assert_eq!(r.cache_reports, r.ok);
    assert!(r.to_markdown().contains("client-side hit rate"));
    let json = serde_json::to_string(&r).unwrap();
    let back: Report = serde_json::from_str(&json).unwrap();
    assert_eq!(back.ok, r.ok);
}

#[test]
fn every_api_with_and_without_streaming() {
    let sim = cluster(1);
    for api in [Api::Chat, Api::Completions, Api::Generate] {
        for stream in [true, false] {
            let mut cfg = LoadConfig::smoke(&sim.urls()[0]);
            cfg.api = api;
            cfg.stream = stream;
            cfg.chat.sessions = Some(2);
            let r = run(&cfg).expect("run");
            assert_eq!(
                r.failed, 0,
                "{api:?} stream={stream}: {:?}",
                r.error_examples
            );
            assert!(r.ok >= 4, "{api:?} stream={stream}: ok {}", r.ok);
            assert!(
                r.hit_rate.is_some_and(|h| h > 0.0),
                "{api:?} stream={stream}"
            );
            assert_eq!(r.itl.count > 0, stream, "{api:?} stream={stream}");
        }
    }
}

/// `/generate` with `input_ids` (tokenized as the worker tokenizes) sends the same prompts as
/// with `text`: the worker counts the same prompt tokens and still reports prefix hits.
#[test]
fn generate_with_input_ids_matches_generate_with_text() {
    let mut reports = Vec::new();
    for ids in [None, Some(InputIds::Approx)] {
        let sim = cluster(1);
        let mut cfg = LoadConfig::smoke(&sim.urls()[0]);
        cfg.api = Api::Generate;
        cfg.input_ids = ids;
        let r = run(&cfg).expect("run");
        assert_eq!(r.failed, 0, "{ids:?}: {:?}", r.error_examples);
        assert!(
            r.hit_rate.is_some_and(|h| h > 0.3),
            "{ids:?}: {:?}",
            r.hit_rate
        );
        reports.push(r);
    }
    let (text, ids) = (&reports[0], &reports[1]);
    assert_eq!(text.ok, ids.ok);
    let diff = text.prompt_tokens.abs_diff(ids.prompt_tokens) as f64;
    assert!(
        diff <= 0.01 * text.prompt_tokens as f64,
        "prompt tokens: text {} input_ids {}",
        text.prompt_tokens,
        ids.prompt_tokens
    );
    let mut cfg = LoadConfig::smoke("http://127.0.0.1:1");
    cfg.input_ids = Some(InputIds::Bpe);
    assert!(run(&cfg).is_err(), "input ids need --api generate");
}

#[test]
fn gsp_burst_and_closed_loop_and_overhead_workloads() {
    let sim = cluster(2);
    let url = &sim.urls()[1];
    let small_gsp = GspParams {
        groups: 4,
        prompts_per_group: 4,
        system_len: 256,
        question_len: 16,
        output_len: 8,
    };
    let mut cfg = LoadConfig {
        workload: WorkloadKind::Gsp,
        api: Api::Generate,
        gsp: small_gsp,
        duration_s: 5.0,
        drain_s: 5.0,
        quiet: true,
        ..LoadConfig::smoke(url)
    };
    let r = run(&cfg).unwrap();
    assert_eq!((r.ok, r.failed), (16, 0), "{:?}", r.error_examples);
    cfg.arrival = Arrival::Closed;
    cfg.concurrency = 3;
    let r = run(&cfg).unwrap();
    assert_eq!((r.ok, r.failed), (16, 0));
    let r = run(&LoadConfig {
        workload: WorkloadKind::Rate,
        rate: Some(50.0),
        duration_s: 0.5,
        time_scale: 1.0,
        ..LoadConfig::smoke(url)
    })
    .unwrap();
    assert!(
        (20..=30).contains(&r.ok) && r.failed == 0,
        "ok {} failed {}",
        r.ok,
        r.failed
    );
}

#[test]
fn failures_are_counted_and_runs_end_by_themselves() {
    // Nothing listens on this port (bound then dropped): every request fails to connect.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let r = run(&LoadConfig::smoke(&format!("http://127.0.0.1:{port}"))).unwrap();
    assert_eq!(r.ok, 0);
    assert_eq!(r.errors.get("connect"), Some(&r.sent));
    assert!(r.sent >= 6 && r.not_sent > 0);
    // A non-loopback target is refused before anything is sent.
    let e = run(&LoadConfig::smoke("http://192.0.2.1:80")).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
}
