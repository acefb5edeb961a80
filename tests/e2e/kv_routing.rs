//! Routing on the servers' own KV-cache events (`--kv-events`), end to end on 127.0.0.1:
//! simulated SGLang workers publish their radix cache's events on ZeroMQ exactly as SGLang
//! does, the gateway finds the publishers through each worker's `/get_server_info`, and
//! routes `/generate` prompts given as `input_ids` by what the servers hold — including
//! prompts this gateway never routed, which no text tree can know about.

use crate::common::*;
use loadtest::sim::kv_events::KvEventsConfig;
use loadtest::sim::{SimCluster, SimConfig};
use radixgate::runtime::Running;
use std::time::{Duration, Instant};

/// Every wait here ends by then (the normal case is milliseconds).
const LIMIT: Duration = Duration::from_secs(20);
/// The simulated workers' page size: blocks of 4 tokens.
const PAGE: usize = 4;
const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// SGLang's `--kv-events-config` for a simulated worker: PUB and replay sockets on ephemeral
/// loopback ports, plus `extra` JSON members (`,"buffer_steps":2`).
fn events_config(extra: &str) -> KvEventsConfig {
    KvEventsConfig::parse(&format!(
        r#"{{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*"{extra}}}"#
    ))
    .unwrap()
}

/// `n` workers publishing KV events (and keeping a replay buffer), pages of [`PAGE`] tokens,
/// then `tweak`.
fn kv_sim_with(n: usize, tweak: impl FnOnce(&mut SimConfig)) -> SimCluster {
    sim(n, |c| {
        c.page_size = PAGE;
        c.kv_events = Some(events_config(""));
        tweak(c);
    })
}

/// `n` workers publishing KV events, `max_total_tokens` of KV each.
fn kv_sim(n: usize, max_total_tokens: usize) -> SimCluster {
    kv_sim_with(n, |c| c.max_total_tokens = max_total_tokens)
}

fn urls(c: &SimCluster) -> Vec<String> {
    c.ports()
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect()
}

/// A prompt of `len` token ids unique to `seed`.
fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 1000 + seed * 10_000 + i).collect()
}

fn gen_ids(ids: &[u32]) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "input_ids": ids, "sampling_params": {"max_new_tokens": 1}
    }))
    .unwrap()
}

/// Prefill `ids` on worker `i` directly (the gateway does not see it).
fn prefill_directly(c: &SimCluster, i: usize, ids: &[u32]) {
    let r = generate(worker_addr(c, i), &gen_ids(ids));
    assert_eq!(r.status, 200, "{}", r.text());
}

/// The worker port that served `ids` sent through the gateway.
fn route(gw: &Running, ids: &[u32]) -> u16 {
    let r = generate(gw.addr, &gen_ids(ids));
    assert_eq!(r.status, 200, "{}", r.text());
    served_by(&r)
}

/// Blocks of `ids` the gateway's index says worker port `port` holds.
fn indexed_blocks(gw: &Running, c: &SimCluster, port: u16, ids: &[u32]) -> u32 {
    let kv = gw.gateway().kv.as_ref().expect("--kv-events on");
    let list = gw.gateway().registry.load();
    let Some(w) = list
        .workers
        .iter()
        .find(|w| w.url == format!("http://127.0.0.1:{port}"))
    else {
        panic!("worker {port} not registered ({:?})", c.ports());
    };
    let snap = kv.reader.load();
    let mut scratch = Default::default();
    snap.match_prefix(MODEL, radixgate::kv::index::ROOT_PARENT, ids, &mut scratch)
        .iter()
        .filter(|m| m.source.worker == w.id)
        .map(|m| m.blocks)
        .max()
        .unwrap_or(0)
}

/// Wait until every worker's publisher is subscribed and its start-up replay is done.
fn wait_warm(gw: &Running, n: usize) {
    let kv = gw.gateway().kv.as_ref().expect("--kv-events on");
    wait_until("every worker warm", LIMIT, || {
        (kv.exact_workers().len() == n).then_some(())
    });
}

#[test]
fn the_kv_event_thread_runs_at_the_helpers_nice_value() {
    // Alone in a process: it reads every thread of the process named `kv-events-N` (readers)
    // or `kv-index` (the index's writer), and other tests start such threads of their own, from
    // threads whose nice value need not be this test thread's.
    if !alone_in_a_process(
        module_path!(),
        "the_kv_event_thread_runs_at_the_helpers_nice_value",
    ) {
        return;
    }
    let c = kv_sim(1, 400_000);
    let gw = gateway_for(&urls(&c), &["--kv-events"]);
    wait_warm(&gw, 1);
    let base = radixgate::base::priority::thread_priority();
    let want = (base + radixgate::base::priority::HELPER_NICE).min(19);
    let kv: Vec<_> = thread_nices()
        .into_iter()
        .filter(|(name, _, _)| name.starts_with("kv-events") || name == "kv-index")
        .collect();
    assert!(
        kv.iter().any(|(n, _, _)| n == "kv-index") && kv.iter().any(|(n, _, _)| n != "kv-index"),
        "the readers and the writer run: {kv:?}"
    );
    for (name, nice, policy) in kv {
        assert_eq!((nice, policy), (want, 0), "{name}");
    }
}

#[test]
fn a_prefix_cached_on_a_worker_is_routed_there_though_this_gateway_never_routed_it() {
    let c = kv_sim(2, 400_000);
    let gw = gateway_for(&urls(&c), &["--kv-events", "--policy", "cache_aware"]);
    wait_warm(&gw, 2);
    let ports = c.ports();
    // Six prompts, each prefilled on one worker by a client that bypasses the gateway: the
    // gateway learns of them only from the events. Chance would route all six right 1 in 64.
    for i in 0..6u32 {
        let holder = (i % 2) as usize;
        let ids = prompt(i, 64);
        prefill_directly(&c, holder, &ids);
        wait_until("the stored blocks reach the index", LIMIT, || {
            (indexed_blocks(&gw, &c, ports[holder], &ids) == 16).then_some(())
        });
        assert_eq!(route(&gw, &ids), ports[holder], "prompt {i}");
    }
}

#[test]
fn after_the_worker_evicts_a_prefix_the_gateway_stops_preferring_it() {
    // Worker B (1) holds 64 tokens at most: four more prompts evict the first.
    let c = kv_sim(2, 80);
    let gw = gateway_for(&urls(&c), &["--kv-events", "--policy", "cache_aware"]);
    wait_warm(&gw, 2);
    let (a, b) = (c.ports()[0], c.ports()[1]);
    let q = prompt(100, 64);
    prefill_directly(&c, 1, &q);
    // A holds three quarters of it: a match rate above the 0.5 threshold, below B's.
    prefill_directly(&c, 0, &q[..48]);
    wait_until("B's and A's blocks in the index", LIMIT, || {
        (indexed_blocks(&gw, &c, b, &q) == 16 && indexed_blocks(&gw, &c, a, &q) == 12).then_some(())
    });
    // B evicts q to make room for other prompts (BlockRemoved events).
    for i in 0..4 {
        prefill_directly(&c, 1, &prompt(200 + i, 64));
    }
    wait_until("B's eviction reaches the index", LIMIT, || {
        (indexed_blocks(&gw, &c, b, &q) == 0).then_some(())
    });
    assert_eq!(
        route(&gw, &q),
        a,
        "B no longer holds the prefix; A holds 75 %"
    );
}

#[test]
fn a_burst_follows_its_first_request_before_any_event_arrives() {
    let c = kv_sim(2, 400_000);
    let gw = gateway_for(&urls(&c), &["--kv-events", "--policy", "cache_aware"]);
    wait_warm(&gw, 2);
    // One unrelated prompt teaches the index the block size (before any event it cannot
    // measure prompts, and the text tree decides).
    let other = prompt(8, 16);
    prefill_directly(&c, 0, &other);
    wait_until("the block size learned", LIMIT, || {
        (indexed_blocks(&gw, &c, c.ports()[0], &other) == 4).then_some(())
    });
    // Both workers hold every request: nothing is prefilled, so no event can arrive.
    set_faults(&c, 0, serde_json::json!({"hold": true}));
    set_faults(&c, 1, serde_json::json!({"hold": true}));
    let ids = prompt(7, 64);
    let first = std::thread::spawn({
        let addr = gw.addr;
        let body = gen_ids(&ids);
        move || served_by(&generate(addr, &body))
    });
    let held = |i| sim_count(&c, i, "inference_in_progress");
    wait_until("the first request held on a worker", LIMIT, || {
        (held(0) + held(1) == 1).then_some(())
    });
    let first_on = if held(0) == 1 { 0 } else { 1 };
    // The second request: the index knows nothing and the other worker is less loaded; only
    // the pending entry of the first request leads it to the same worker.
    let second = std::thread::spawn({
        let addr = gw.addr;
        let body = gen_ids(&ids);
        move || served_by(&generate(addr, &body))
    });
    wait_until("the second request held", LIMIT, || {
        (held(0) + held(1) == 2).then_some(())
    });
    assert_eq!(held(first_on), 2, "the burst split across workers");
    set_faults(&c, 0, serde_json::json!({"hold": false}));
    set_faults(&c, 1, serde_json::json!({"hold": false}));
    let (p1, p2) = (first.join().unwrap(), second.join().unwrap());
    assert_eq!(p1, p2);
    assert_eq!(p1, c.ports()[first_on]);
}

#[test]
fn a_mixed_fleet_keeps_affinity_on_workers_with_and_without_events() {
    let with = kv_sim(1, 400_000);
    let without = sim(1, |c| c.page_size = PAGE);
    let mut all = urls(&with);
    all.extend(urls(&without));
    let gw = gateway_for(&all, &["--kv-events", "--policy", "cache_aware"]);
    wait_warm(&gw, 1);
    // Each conversation's second turn follows its first, whichever kind of worker took it.
    let mut seen = std::collections::HashSet::new();
    for i in 0..12u32 {
        let turn1 = prompt(300 + i, 64);
        let first = route(&gw, &turn1);
        seen.insert(first);
        let mut turn2 = turn1.clone();
        turn2.extend(prompt(400 + i, 16));
        assert_eq!(route(&gw, &turn2), first, "conversation {i}");
    }
    assert_eq!(seen.len(), 2, "both kinds of worker served conversations");
}

#[test]
fn without_token_ids_or_a_tokenizer_the_text_tree_routes() {
    let c = kv_sim(2, 400_000);
    let gw = gateway_for(&urls(&c), &["--kv-events", "--policy", "cache_aware"]);
    wait_warm(&gw, 2);
    let first = served_by(&chat(
        gw.addr,
        "a long shared system prompt for this chat",
        false,
        4,
    ));
    for _ in 0..4 {
        let again = chat(
            gw.addr,
            "a long shared system prompt for this chat",
            false,
            4,
        );
        assert_eq!(served_by(&again), first);
    }
}

#[test]
fn a_gateway_started_late_knows_what_the_servers_cached_before_it_from_their_replay_buffers() {
    let c = kv_sim(2, 400_000);
    let ports = c.ports();
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| prompt(500 + i, 64)).collect();
    for (i, ids) in prompts.iter().enumerate() {
        prefill_directly(&c, i % 2, ids);
    }
    // Started after every event was published: only the start-up replay can tell it.
    let gw = gateway_for(&urls(&c), &["--kv-events", "--policy", "cache_aware"]);
    wait_warm(&gw, 2);
    for (i, ids) in prompts.iter().enumerate() {
        assert_eq!(indexed_blocks(&gw, &c, ports[i % 2], ids), 16, "prompt {i}");
        assert_eq!(route(&gw, ids), ports[i % 2], "prompt {i}");
    }
    let counts = gw.gateway().kv.as_ref().unwrap().intake_counts();
    assert!(counts.replayed_batches >= 6, "{counts:?}");
}

#[test]
fn workers_added_at_run_time_are_subscribed_and_removed_ones_dropped() {
    let c = kv_sim(2, 400_000);
    let all = urls(&c);
    let gw = gateway_for(&all[..1], &["--kv-events", "--policy", "cache_aware"]);
    wait_warm(&gw, 1);
    let r = request(
        gw.addr,
        "POST",
        &format!("/add_worker?url={}", all[1]),
        &[],
        b"",
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    wait_warm(&gw, 2);
    let ids = prompt(600, 64);
    prefill_directly(&c, 1, &ids);
    wait_until("the new worker's blocks in the index", LIMIT, || {
        (indexed_blocks(&gw, &c, c.ports()[1], &ids) == 16).then_some(())
    });
    assert_eq!(route(&gw, &ids), c.ports()[1]);
    remove_worker(gw.addr, &all[1]);
    let kv = gw.gateway().kv.as_ref().unwrap();
    wait_until("the removed worker's publisher dropped", LIMIT, || {
        // Worker 0 never published a block, so the index knows no source of it.
        (kv.exact_workers().len() == 1 && kv.stats.sources() == 0).then_some(())
    });
    // Its blocks are gone from the index too.
    let snap = kv.reader.load();
    let mut scratch = Default::default();
    assert!(snap
        .match_prefix(MODEL, radixgate::kv::index::ROOT_PARENT, &ids, &mut scratch)
        .iter()
        .all(|m| m.blocks == 0));
}

/// A tokenizer folder the gateway and the simulated workers share (a small Llama-3-style BPE
/// with its chat template, built here: no download).
fn tokenizer_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("radixgate-kv-tok-{name}-{}", std::process::id()));
    radixgate::tokenize::folder::small_llama3_folder(&dir).unwrap();
    dir
}

fn chat_turns(turns: &[(&str, &str)]) -> Vec<u8> {
    let msgs: Vec<serde_json::Value> = turns
        .iter()
        .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
        .collect();
    serde_json::to_vec(&serde_json::json!({"model": MODEL, "messages": msgs, "max_tokens": 2}))
        .unwrap()
}

#[test]
fn chat_prompts_are_tokenized_with_the_servers_template_and_routed_by_their_events() {
    let dir = tokenizer_dir("chat");
    let c = kv_sim_with(2, |cfg| cfg.tokenizer_path = Some(dir.clone()));
    let tok = dir.display().to_string();
    let gw = gateway_for(
        &urls(&c),
        &[
            "--kv-events",
            "--policy",
            "cache_aware",
            "--tokenizer-path",
            &tok,
        ],
    );
    wait_warm(&gw, 2);
    let ports = c.ports();
    let kv = gw.gateway().kv.as_ref().unwrap();
    let mut tokens = radixgate::tokenize::SegmentCache::new(
        kv.tokenizer().expect("--tokenizer-path").clone(),
        1 << 20,
    );
    for i in 0..6usize {
        let holder = i % 2;
        let system = format!("You are assistant number {i}. Answer briefly and kindly, always.");
        let question = format!("Tell me about the weather in city {i} today, please.");
        let turn1 = chat_turns(&[("system", &system), ("user", &question)]);
        // Turn 1 is prefilled on the holder by a client that bypasses the gateway.
        let r = request(
            worker_addr(&c, holder),
            "POST",
            "/v1/chat/completions",
            &[],
            &turn1,
        )
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let answer = r.json()["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        // Wait for the holder's own blocks of turn 1 (its prompt as the gateway tokenizes it):
        // a count of stored blocks could be met by the other worker's late batch of the turn
        // before (its answer's pages), and the route would then be taken without the events.
        let mut ids = Vec::new();
        tokens.chat_ids(&turn1, &mut ids).unwrap();
        let whole = (ids.len() / PAGE) as u32;
        assert!(whole >= 4, "turn 1 spans {} tokens", ids.len());
        wait_until("the holder's turn-1 blocks in the index", LIMIT, || {
            (indexed_blocks(&gw, &c, ports[holder], &ids) == whole).then_some(())
        });
        // Turn 2 through the gateway: its tokens extend turn 1's, which only the events know.
        let turn2 = chat_turns(&[
            ("system", &system),
            ("user", &question),
            ("assistant", &answer),
            ("user", "And tomorrow?"),
        ]);
        let r = request(gw.addr, "POST", "/v1/chat/completions", &[], &turn2).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(served_by(&r), ports[holder], "conversation {i}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Words no cache has seen: each a fresh pseudo-random hex string.
fn fresh_words(seed: u64, bytes: usize) -> String {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = String::with_capacity(bytes + 24);
    while out.len() < bytes {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push_str(&format!("q{:x} ", x >> 20));
    }
    out
}

#[test]
fn a_huge_chat_is_tokenized_off_the_serving_core_and_small_requests_do_not_wait() {
    // Serial: the bounds (the core never stalls 50 ms, a small chat never waits 250 ms) are
    // stated for this test's own load on the 2 CPUs; a timing test beside it could add its own.
    let _serial = serial();
    // One serving core. A 160 KiB chat of words nobody has seen (~60k tokens) takes the
    // tokenizer over its helper budget in this (debug) build; on the serving core it would
    // hold every other connection for that long.
    // The worker counts tokens the cheap way (its own cost is not what is measured here).
    let dir = tokenizer_dir("huge");
    let c = kv_sim_with(1, |cfg| {
        cfg.tokenizer = loadtest::sim::TokenizerMode::Approx;
        cfg.max_total_tokens = 1 << 20;
    });
    let tok = dir.display().to_string();
    let gw = gateway_for(
        &urls(&c),
        &[
            "--kv-events",
            "--policy",
            "cache_aware",
            "--tokenizer-path",
            &tok,
        ],
    );
    wait_warm(&gw, 1);
    let small = chat_turns(&[("user", "hello there")]);
    assert_eq!(
        request(gw.addr, "POST", "/v1/chat/completions", &[], &small)
            .unwrap()
            .status,
        200
    );
    // A measurement during which fewer than 5 small chats ran (other test binaries took both
    // CPUs) says nothing either way: it is taken again, with a prompt nobody has seen, up to
    // three times, and the bounds below are checked on the last one.
    let mut attempt = 0;
    let (status, took, sent, worst_chat, worst_local) = loop {
        let huge = chat_turns(&[("user", &fresh_words(7 + attempt, 160 << 10))]);
        let addr = gw.addr;
        let started = Instant::now();
        let big = std::thread::spawn(move || {
            let r = request(addr, "POST", "/v1/chat/completions", &[], &huge).unwrap();
            (r.status, started.elapsed())
        });
        // Small chats one after another on the same core while the huge one is tokenized,
        // each followed by a /health (answered by the core alone: no worker's time in it).
        std::thread::sleep(Duration::from_millis(20));
        let (mut worst_chat, mut worst_local) = (Duration::ZERO, Duration::ZERO);
        let mut sent = 0;
        while !big.is_finished() && started.elapsed() < Duration::from_secs(10) {
            let t = Instant::now();
            let r = request(gw.addr, "POST", "/v1/chat/completions", &[], &small).unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
            worst_chat = worst_chat.max(t.elapsed());
            let t = Instant::now();
            assert_eq!(
                request(gw.addr, "GET", "/health", &[], b"").unwrap().status,
                200
            );
            worst_local = worst_local.max(t.elapsed());
            sent += 1;
        }
        let (status, took) = big.join().unwrap();
        eprintln!(
            "huge chat answered in {took:?}; {sent} small chats meanwhile, worst {worst_chat:?} \
             (/health: {worst_local:?})"
        );
        attempt += 1;
        if sent >= 5 || attempt == 3 {
            break (status, took, sent, worst_chat, worst_local);
        }
    };
    assert_eq!(status, 200, "the huge chat is answered (routed by text)");
    assert!(
        sent >= 5,
        "only {sent} small requests ran during the huge one ({took:?})"
    );
    // The stated figures (debug build, shared 2-core VM): the core itself never stalls 50 ms,
    // a small chat (the worker's time included) never waits 250 ms. Were the huge prompt
    // encoded on the core, both would wait for the whole encode: seconds in this build.
    assert!(
        worst_local < Duration::from_millis(50),
        "core stalled {worst_local:?}"
    );
    assert!(
        worst_chat < Duration::from_millis(250),
        "worst small chat {worst_chat:?} while the huge one took {took:?}"
    );
    // The huge one routed by text once its budget (500 ms) passed, not after its encode.
    assert!(took < Duration::from_secs(3), "{took:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_tokenizer_path_that_cannot_load_stops_the_start() {
    let args: Vec<String> = [
        "radixgate",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--prometheus-port",
        "0",
        "--kv-events",
        "--tokenizer-path",
        "/nonexistent/tokenizer",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let cfg = radixgate::config::Config::try_from_args(&args).unwrap();
    let err = radixgate::runtime::start(cfg).err().expect("refused");
    assert!(err.contains("--tokenizer-path"), "{err}");
}

#[test]
fn a_new_copy_started_with_a_bootstrap_peer_copies_its_index_and_follows_live_events() {
    // Replay buffers of two batches: a new copy cannot learn the early prompts from the
    // servers; only its sibling's copy has them.
    let c = kv_sim_with(2, |cfg| {
        cfg.kv_events = Some(events_config(r#","buffer_steps":2"#))
    });
    let ports = c.ports();
    // The snapshot needs the admin key; the new copy sends its own, the same.
    let first = gateway_for(
        &urls(&c),
        &[
            "--kv-events",
            "--policy",
            "cache_aware",
            "--admin-api-key",
            "adm",
        ],
    );
    wait_warm(&first, 2);
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| prompt(700 + i, 64)).collect();
    for (i, ids) in prompts.iter().enumerate() {
        prefill_directly(&c, i % 2, ids);
        wait_until("the first copy indexed it", LIMIT, || {
            (indexed_blocks(&first, &c, ports[i % 2], ids) == 16).then_some(())
        });
    }
    let peer = format!("http://{}", first.addr);
    let second = gateway_for(
        &urls(&c),
        &[
            "--kv-events",
            "--policy",
            "cache_aware",
            "--kv-bootstrap-peer",
            &peer,
            "--admin-api-key",
            "adm",
        ],
    );
    wait_warm(&second, 2);
    for (i, ids) in prompts.iter().enumerate() {
        assert_eq!(
            indexed_blocks(&second, &c, ports[i % 2], ids),
            16,
            "prompt {i}"
        );
        assert_eq!(route(&second, ids), ports[i % 2], "prompt {i}");
    }
    // Live events after the copy's watermarks apply on top.
    let later = prompt(800, 64);
    prefill_directly(&c, 1, &later);
    wait_until("the live event on the second copy", LIMIT, || {
        (indexed_blocks(&second, &c, ports[1], &later) == 16).then_some(())
    });
    assert_eq!(route(&second, &later), ports[1]);
}

#[test]
fn without_the_peer_a_new_copy_knows_only_what_the_replay_buffers_still_hold() {
    // The control for the test above: the same fleet, no peer.
    let c = kv_sim_with(2, |cfg| {
        cfg.kv_events = Some(events_config(r#","buffer_steps":2"#))
    });
    let ports = c.ports();
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| prompt(900 + i, 64)).collect();
    for (i, ids) in prompts.iter().enumerate() {
        prefill_directly(&c, i % 2, ids);
    }
    let gw = gateway_for(&urls(&c), &["--kv-events", "--policy", "cache_aware"]);
    wait_warm(&gw, 2);
    let known = prompts
        .iter()
        .enumerate()
        .filter(|(i, ids)| indexed_blocks(&gw, &c, ports[i % 2], ids) == 16)
        .count();
    assert!(known < prompts.len(), "the replay buffers held everything");
}

/// A gateway over `c` that copies its index from `peer` first (not waiting for readiness).
fn bootstrapping_gateway(c: &SimCluster, peer: &str) -> Running {
    let mut args = vec!["--worker-urls"];
    let all = urls(c);
    args.extend(all.iter().map(String::as_str));
    args.extend([
        "--kv-events",
        "--kv-bootstrap-peer",
        peer,
        "--admin-api-key",
        "adm",
    ]);
    gateway(&args)
}

#[test]
fn a_copy_is_not_ready_while_it_takes_its_siblings_index() {
    let c = kv_sim(1, 400_000);
    // A peer that accepts the connection and answers nothing until the test lets it go.
    let peer = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let peer_url = format!("http://{}", peer.local_addr().unwrap());
    let (release, held) = std::sync::mpsc::channel::<()>();
    let server = std::thread::spawn(move || {
        let (conn, _) = peer.accept().unwrap();
        let _ = held.recv();
        drop(conn); // The copy reads an end of stream: no index, start cold.
    });
    let gw = bootstrapping_gateway(&c, &peer_url);
    // The worker is healthy, yet the copy says it is bootstrapping.
    wait_until("the worker healthy", LIMIT, || {
        let r = request(gw.addr, "GET", "/readiness", &[], b"").unwrap();
        let v = r.json();
        (v["healthy_workers"] == 1).then_some((r.status, v["status"].clone()))
    });
    let r = request(gw.addr, "GET", "/readiness", &[], b"").unwrap();
    assert_eq!(
        (r.status, r.json()["status"].clone()),
        (503, "bootstrapping".into())
    );
    release.send(()).unwrap();
    server.join().unwrap();
    wait_ready(gw.addr, LIMIT);
    wait_warm(&gw, 1);
}

/// A sibling that answers every connection with `answer` after reading the request head; the
/// heads it read come back on the channel.
fn scripted_peer(answer: String) -> (String, std::sync::mpsc::Receiver<String>) {
    use std::io::{Read, Write};
    let peer = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", peer.local_addr().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for conn in peer.incoming() {
            let Ok(mut conn) = conn else { return };
            let mut head = Vec::new();
            let mut b = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && conn.read(&mut b).unwrap_or(0) == 1 {
                head.push(b[0]);
            }
            if tx
                .send(String::from_utf8_lossy(&head).into_owned())
                .is_err()
            {
                return;
            }
            let _ = conn.write_all(answer.as_bytes());
            // Held open: the copy must decide on the head alone.
            std::thread::sleep(Duration::from_secs(2));
        }
    });
    (url, rx)
}

#[test]
fn the_bootstrap_peer_gets_the_key_and_nobody_else_and_oversized_copies_are_refused_at_once() {
    let c = kv_sim(1, 400_000);
    // A redirect elsewhere is never followed: the key goes only to the URL the operator named.
    let (elsewhere, elsewhere_heads) = scripted_peer("HTTP/1.1 200 OK\r\n\r\n".into());
    let redirect = format!(
        "HTTP/1.1 307 Temporary Redirect\r\nlocation: {elsewhere}/kv_index/snapshot\r\n\
         content-length: 0\r\n\r\n"
    );
    // A copy over the cap (256 MiB) is refused on its Content-Length, before any byte of it.
    let huge = "HTTP/1.1 200 OK\r\ncontent-length: 300000000\r\n\r\n".to_string();
    for answer in [redirect, huge] {
        let (peer, heads) = scripted_peer(answer.clone());
        let started = Instant::now();
        let gw = bootstrapping_gateway(&c, &peer);
        let head = heads.recv_timeout(LIMIT).expect("the peer was asked");
        assert!(
            head.starts_with("GET /kv_index/snapshot HTTP/1.1\r\n"),
            "{head}"
        );
        assert!(head.contains("Authorization: Bearer adm\r\n"), "{head}");
        // Given up on the answer's head: ready well before the peer lets the connection go.
        wait_until("bootstrapped", LIMIT, || {
            gw.gateway().kv.as_ref()?.is_bootstrapped().then_some(())
        });
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{answer:?}: {:?}",
            started.elapsed()
        );
        wait_ready(gw.addr, LIMIT);
    }
    assert!(
        elsewhere_heads.try_recv().is_err(),
        "the redirect target was contacted"
    );
}

/// A worker publishing on a fixed live port whose replay endpoint (as the gateway is told it)
/// is `replay`.
fn silent_replay_gateway(c: &SimCluster, live: u16, replay: u16, warm_timeout: &str) -> Running {
    let url = urls(c)[0].clone();
    let live_flag = format!("{url}=tcp://127.0.0.1:{live}");
    let replay_flag = format!("{url}=tcp://127.0.0.1:{replay}");
    gateway(&[
        "--worker-urls",
        &url,
        "--kv-events",
        "--kv-events-endpoints",
        &live_flag,
        "--kv-events-replay-endpoints",
        &replay_flag,
        "--kv-warm-timeout-secs",
        warm_timeout,
    ])
}

fn readiness(gw: &Running) -> (u16, serde_json::Value) {
    let r = request(gw.addr, "GET", "/readiness", &[], b"").unwrap();
    let v = r.json();
    (r.status, v)
}

#[test]
fn a_new_copy_is_not_ready_until_its_workers_replayed_or_the_warm_timeout_passed() {
    let c = sim(1, |cfg| {
        cfg.page_size = PAGE;
        cfg.kv_events = Some(
            KvEventsConfig::parse(
                // `*` host: the publisher binds (a host would make it connect, as SGLang's
                // does); `*` port: on a port of its own, read back below (two gateways are
                // told it).
                r#"{"publisher":"zmq","endpoint":"tcp://*:*","replay_endpoint":"tcp://127.0.0.1:*"}"#,
            )
            .unwrap(),
        );
    });
    let live: u16 = c.kv_events()[0]
        .endpoint
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no bound port in {:?}", c.kv_events()[0].endpoint));
    // Healthy, subscribed, but its replay socket accepts and never answers: warming, not
    // ready, until the replay gives up (5 s without an answer); then the stream is taken as
    // it comes: warm, ready.
    let (silent, _held) = silent_listener();
    let started = Instant::now();
    let gw = silent_replay_gateway(&c, live, silent, "60");
    // Every answer while the worker is healthy and the replay unanswered says "warming" with
    // 503. (On a loaded machine the first health check may land after the replay gave up;
    // then none is seen, and the wait below still shows readiness held back that long.)
    let mut warming_seen = 0;
    let kv = gw.gateway().kv.as_ref().expect("--kv-events on");
    wait_until("ready once the replay gave up", LIMIT, || {
        let (status, v) = readiness(&gw);
        if status == 200 {
            return Some(());
        }
        if v["healthy_workers"] == 1 {
            assert_eq!(
                (status, v["status"].as_str()),
                (503, Some("warming")),
                "{v}"
            );
            warming_seen += 1;
        }
        None
    });
    let waited = started.elapsed();
    eprintln!("ready after {waited:?}; {warming_seen} answers said warming before");
    assert!(waited >= Duration::from_secs(4), "{waited:?}");
    assert_eq!(kv.exact_workers().len(), 1, "warm: routed by its events");
    drop(gw);
    // With --kv-warm-timeout-secs under the replay's own deadline, the wait ends there.
    let started = Instant::now();
    let gw = silent_replay_gateway(&c, live, silent, "2");
    // (Whether "warming" is seen first depends on how soon the worker is found healthy: on a
    // loaded machine that may be after the two seconds.)
    wait_until("ready after the warm timeout", LIMIT, || {
        (readiness(&gw).0 == 200).then_some(())
    });
    let waited = started.elapsed();
    assert!(waited >= Duration::from_secs(2), "{waited:?}");
    assert!(
        gw.gateway().kv.as_ref().unwrap().exact_workers().is_empty(),
        "ready at {waited:?} only once the replay gave up: the warm timeout did not end the wait"
    );
}

/// A port that accepts connections and never says a word (a replay socket that hangs); the
/// connections stay open until the returned guard is dropped.
fn silent_listener() -> (u16, std::sync::mpsc::Sender<()>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    l.set_nonblocking(true).unwrap();
    let (stop, stopped) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        while let Err(std::sync::mpsc::TryRecvError::Empty) = stopped.try_recv() {
            if let Ok((c, _)) = l.accept() {
                held.push(c);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    });
    (port, stop)
}

/// A salted text prompt is measured on its own tokens: the text tree's namespace marker in
/// front of its routing text is no part of what the server encodes (encoded with it, no id
/// would match the server's salted blocks and the pick would be a coin toss). Each prompt is
/// prefilled, salted, on one worker behind the gateway's back; the salted request extending it
/// reaches that worker, through the events alone.
#[test]
fn salted_text_prompts_are_tokenized_without_the_text_trees_marker() {
    let dir = tokenizer_dir("salted");
    let c = kv_sim_with(2, |cfg| cfg.tokenizer_path = Some(dir.clone()));
    let tok = dir.display().to_string();
    let gw = gateway_for(
        &urls(&c),
        &[
            "--kv-events",
            "--policy",
            "cache_aware",
            "--tokenizer-path",
            &tok,
        ],
    );
    wait_warm(&gw, 2);
    let ports = c.ports();
    let kv = gw.gateway().kv.as_ref().unwrap();
    let mut tokens = radixgate::tokenize::SegmentCache::new(
        kv.tokenizer().expect("--tokenizer-path").clone(),
        1 << 20,
    );
    let body = |prompt: &str, salt: &str| {
        serde_json::to_vec(&serde_json::json!({
            "model": MODEL, "prompt": prompt, "max_tokens": 1, "cache_salt": salt
        }))
        .unwrap()
    };
    for i in 0..8usize {
        let holder = i % 2;
        let salt = format!("tenant-{i}");
        let prompt = format!(
            "Report number {i}: the harbor lanterns were lit at dusk and the river ran \
             quietly past the old stone mill while the falcons circled overhead."
        );
        let r = request(
            worker_addr(&c, holder),
            "POST",
            "/v1/completions",
            &[],
            &body(&prompt, &salt),
        )
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let mut ids = Vec::new();
        tokens.text_ids(&prompt, &mut ids).unwrap();
        let whole = (ids.len() / PAGE) as u32;
        assert!(whole >= 4, "the prompt spans {} tokens", ids.len());
        let root = radixgate::kv::index::namespace_root(Some(&salt), None);
        wait_until("the holder's salted blocks in the index", LIMIT, || {
            let snap = kv.reader.load();
            let mut scratch = Default::default();
            let held = snap
                .match_prefix(MODEL, root, &ids, &mut scratch)
                .iter()
                .map(|m| m.blocks)
                .max()
                .unwrap_or(0);
            (held == whole).then_some(())
        });
        let longer = format!("{prompt} What happened next at the mill?");
        let r = request(
            gw.addr,
            "POST",
            "/v1/completions",
            &[],
            &body(&longer, &salt),
        )
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(served_by(&r), ports[holder], "prompt {i}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
