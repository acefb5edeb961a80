//! End-to-end tests of routing over real sockets: cache_aware affinity, spreading, imbalance,
//! the other policies, per-model trees and eviction. Deterministic seeds; workers are the
//! simulated SGLang servers, identified by the `x-worker-port` header they set.

use crate::common::*;
use radixgate::tree::TreeKey;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

#[test]
fn a_conversation_keeps_its_worker_turn_by_turn() {
    let cluster = sim(4, |_| {});
    let gw = gateway_for(&cluster.urls(), &["--policy", "cache_aware"]);
    let system = words(1, 300);
    let mut history: Vec<(String, String)> =
        vec![("system".into(), system), ("user".into(), words(2, 40))];
    let mut first = None;
    for turn in 0..6 {
        let msgs: Vec<(&str, &str)> = history
            .iter()
            .map(|(r, c)| (r.as_str(), c.as_str()))
            .collect();
        let r = chat_messages(gw.addr, &msgs, &[]);
        let port = served_by(&r);
        match first {
            None => first = Some(port),
            Some(p) => assert_eq!(p, port, "turn {turn} moved to another worker"),
        }
        let reply = r.json()["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        history.push(("assistant".into(), reply));
        history.push(("user".into(), words(100 + turn, 30)));
        gw.gateway().router.tree.as_ref().unwrap().sync();
    }
}

#[test]
fn distinct_cold_prompts_spread_over_workers() {
    let cluster = sim(4, |_| {});
    let gw = gateway_for(&cluster.urls(), &["--policy", "cache_aware"]);
    let mut seen = HashSet::new();
    for i in 0..16 {
        // Sequential: every load is 0, so the reference would send all of these to one worker.
        let r = chat_messages(
            gw.addr,
            &[("user", &format!("{i} {}", words(1000 + i, 50)))],
            &[],
        );
        seen.insert(served_by(&r));
    }
    assert!(seen.len() >= 3, "cold prompts piled on {seen:?}");
}

#[test]
fn imbalance_sends_to_the_least_loaded_worker() {
    let cluster = sim(2, |c| {
        c.time_scale = 1.0;
        c.token_interval_ms = Some(100.0);
    });
    let gw = gateway_for(
        &cluster.urls(),
        &[
            "--policy",
            "cache_aware",
            "--balance-abs-threshold",
            "2",
            "--balance-rel-threshold",
            "1.5",
        ],
    );
    let prompt = words(7, 200);
    let r = crate::common::chat(gw.addr, &prompt, false, 1);
    let home = served_by(&r);
    gw.gateway().router.tree.as_ref().unwrap().sync();
    // Hold 4 slow streams with the same prefix: they all stick to `home` (balanced so far:
    // the gap must exceed 2 before the policy reacts).
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut c = Conn::open(gw.addr);
        c.send(&raw_request(
            "POST",
            "/v1/chat/completions",
            &[],
            &chat_body(&[("user", &prompt)], true, 200),
        ));
        let h = c.read_head(false).unwrap();
        assert_eq!(
            h.header("x-worker-port")
                .map(|p| String::from_utf8_lossy(p).parse::<u16>().unwrap()),
            Some(home)
        );
        held.push(c);
    }
    // home has 3 in flight, the other 0: 3 − 0 > 2 and 3 > 1.5 × 0 → imbalanced.
    let r = chat_messages(gw.addr, &[("user", &prompt)], &[]);
    assert_ne!(
        served_by(&r),
        home,
        "imbalance must override the prefix match"
    );
    drop(held);
}

#[test]
fn manual_policy_is_sticky_per_key_and_keys_expire() {
    let cluster = sim(4, |_| {});
    let gw = gateway_for(
        &cluster.urls(),
        &[
            "--policy",
            "manual",
            "--max-idle-secs",
            "1",
            "--eviction-interval",
            "1",
        ],
    );
    let mut placed = HashMap::new();
    for round in 0..3 {
        for key in ["alice", "bob", "carol", "dave", "erin"] {
            let r = chat_messages(
                gw.addr,
                &[("user", &words(round * 10 + key.len() as u64, 5))],
                &[("x-smg-routing-key", key)],
            );
            let port = served_by(&r);
            assert_eq!(*placed.entry(key).or_insert(port), port, "key {key} moved");
        }
    }
    assert_eq!(gw.gateway().router.policy.manual_keys(), 5);
    // Idle keys expire (the sweep runs on core 0 about every 0.5 s).
    let until = Instant::now() + Duration::from_secs(6);
    while gw.gateway().router.policy.manual_keys() > 0 {
        assert!(Instant::now() < until, "keys did not expire");
        std::thread::sleep(Duration::from_millis(100));
    }
    // A request without the header is placed fresh and not remembered.
    chat_messages(gw.addr, &[("user", "no key")], &[]);
    assert_eq!(gw.gateway().router.policy.manual_keys(), 0);
}

#[test]
fn consistent_hashing_moves_few_keys_when_a_worker_joins() {
    let cluster = sim(5, |_| {});
    let urls = cluster.urls();
    let gw = gateway_for(&urls[..4], &["--policy", "consistent_hashing"]);
    let keys: Vec<String> = (0..60).map(|i| format!("user-{i}")).collect();
    // The worker each key lands on right now.
    let placement = |keys: &[String]| -> Vec<u16> {
        keys.iter()
            .map(|k| {
                served_by(&chat_messages(
                    gw.addr,
                    &[("user", "x")],
                    &[("x-smg-routing-key", k)],
                ))
            })
            .collect()
    };
    let before = placement(&keys);
    // Same key, same worker.
    for (k, p) in keys.iter().zip(&before).take(10) {
        assert_eq!(
            served_by(&chat_messages(
                gw.addr,
                &[("user", "y")],
                &[("x-smg-routing-key", k)]
            )),
            *p
        );
    }
    let add = request(
        gw.addr,
        "POST",
        "/workers",
        &[],
        format!(r#"{{"url":"{}"}}"#, urls[4]).as_bytes(),
    )
    .unwrap();
    assert!(add.status == 202 || add.status == 200, "{}", add.text());
    let new_port = cluster.ports()[4];
    let after = placement(&keys);
    let moved: Vec<usize> = (0..keys.len()).filter(|&i| before[i] != after[i]).collect();
    assert!(
        moved.iter().all(|&i| after[i] == new_port),
        "keys moved between old workers"
    );
    assert!(
        !moved.is_empty() && moved.len() <= keys.len() * 2 / 5,
        "moved {} of {}",
        moved.len(),
        keys.len()
    );
    // The target-worker header wins.
    let r = chat_messages(gw.addr, &[("user", "x")], &[("x-smg-target-worker", "0")]);
    assert_eq!(served_by(&r), cluster.ports()[0]);
}

#[test]
fn prefix_hash_bucket_random_round_robin_power_of_two_answer_200() {
    let cluster = sim(3, |_| {});
    for policy in [
        "prefix_hash",
        "bucket",
        "random",
        "round_robin",
        "power_of_two",
    ] {
        let gw = gateway_for(&cluster.urls(), &["--policy", policy]);
        let mut seen = HashSet::new();
        for i in 0..9 {
            let r = chat_messages(gw.addr, &[("user", &words(i, 20 + i as usize * 30))], &[]);
            assert_eq!(r.status, 200, "{policy}: {}", r.text());
            seen.insert(served_by(&r));
        }
        // Nine varied prompts over three workers: every policy spreads them (none sends all
        // to one worker); round_robin visits each.
        if policy == "round_robin" {
            assert_eq!(seen.len(), 3, "round_robin must visit every worker");
        } else {
            assert!(seen.len() >= 2, "{policy}: every prompt to {seen:?}");
        }
        if policy == "prefix_hash" {
            // Same prefix, same worker.
            let p = words(99, 400);
            let a = served_by(&chat_messages(gw.addr, &[("user", &p)], &[]));
            let b = served_by(&chat_messages(
                gw.addr,
                &[("user", &format!("{p} more"))],
                &[],
            ));
            assert_eq!(a, b);
        }
    }
}

#[test]
fn per_model_trees_do_not_mix() {
    let a_worker = sim(1, |c| c.model_name = "model-a".into());
    let b_worker = sim(1, |c| c.model_name = "model-b".into());
    let urls = [a_worker.urls()[0].clone(), b_worker.urls()[0].clone()];
    let gw = gateway_for(&urls, &["--policy", "cache_aware"]);
    wait_model_served(&gw, "model-a");
    wait_model_served(&gw, "model-b");
    let text = words(5, 100);
    for model in ["model-a", "model-b", "made-up"] {
        let body = serde_json::to_vec(&serde_json::json!({"model": model, "prompt": format!("{model}: {text}"), "max_tokens": 1})).unwrap();
        assert_eq!(
            request(gw.addr, "POST", "/v1/completions", &[], &body)
                .unwrap()
                .status,
            200
        );
    }
    let tree = gw.gateway().router.tree.as_ref().unwrap();
    tree.sync();
    let forest = tree.load();
    let a = forest.tree(TreeKey::Served("model-a"));
    let b = forest.tree(TreeKey::Served("model-b"));
    assert!(a.longest_match(&format!("model-a: {text}")).matched_chars > 100);
    assert_eq!(
        a.longest_match(&format!("model-b: {text}")).matched_chars,
        "model-".len()
    );
    assert!(b.longest_match(&format!("model-b: {text}")).matched_chars > 100);
    assert_eq!(
        forest
            .tree(TreeKey::Default)
            .longest_match(&format!("model-a: {text}"))
            .matched_chars,
        0
    );
    // A name no worker serves feeds the shared tree, not a tree of its own.
    let shared = forest.tree(TreeKey::Shared);
    assert!(
        shared
            .longest_match(&format!("made-up: {text}"))
            .matched_chars
            > 100
    );
    assert_eq!(
        forest.models().count(),
        4,
        "default, shared, model-a, model-b"
    );
}

#[test]
fn eviction_keeps_each_worker_under_the_limit_while_requests_flow() {
    let cluster = sim(2, |_| {});
    let limit = 3000u64;
    let gw = gateway_for(
        &cluster.urls(),
        &[
            "--policy",
            "cache_aware",
            "--max-tree-size",
            &limit.to_string(),
            "--eviction-interval",
            "1",
        ],
    );
    let tree = gw.gateway().router.tree.as_ref().unwrap();
    for i in 0..60 {
        chat_messages(
            gw.addr,
            &[("user", &format!("{i} {}", words(500 + i, 80)))],
            &[],
        );
        if i % 10 == 9 {
            tree.sync();
            let forest = tree.load();
            for (_, t) in forest.models() {
                for (w, chars) in t.worker_char_counts() {
                    // Between passes growth is bounded by the overflow margin (10 %).
                    assert!(
                        chars as f64 <= limit as f64 * 1.1 + 600.0,
                        "worker {w} holds {chars} chars"
                    );
                }
            }
        }
    }
    // The next eviction pass (every second) brings every worker under the limit.
    wait_until("an eviction pass", Duration::from_secs(10), || {
        tree.sync();
        tree.load()
            .models()
            .all(|(_, t)| t.worker_char_counts().all(|(_, chars)| chars <= limit))
            .then_some(())
    });
    tree.sync();
    for (_, t) in tree.load().models() {
        for (w, chars) in t.worker_char_counts() {
            assert!(
                chars <= limit,
                "after a pass worker {w} still holds {chars} chars"
            );
        }
    }
    assert!(tree.stats().evicted_chars() > 0);
}

#[test]
fn removing_a_worker_takes_it_out_of_routing_and_the_tree() {
    let cluster = sim(2, |_| {});
    let gw = gateway_for(&cluster.urls(), &["--policy", "cache_aware"]);
    let prompt = words(3, 200);
    let home = served_by(&chat_messages(gw.addr, &[("user", &prompt)], &[]));
    let url = format!("http://127.0.0.1:{home}");
    remove_worker(gw.addr, &url);
    for _ in 0..5 {
        assert_ne!(
            served_by(&chat_messages(gw.addr, &[("user", &prompt)], &[])),
            home
        );
    }
    let list = request(gw.addr, "GET", "/list_workers", &[], b"")
        .unwrap()
        .json();
    assert_eq!(list["urls"].as_array().unwrap().len(), 1);
}

#[test]
fn insert_response_text_teaches_the_tree_the_reply() {
    let cluster = sim(2, |_| {});
    for (flag, expect_reply) in [(true, true), (false, false)] {
        let mut args = vec!["--policy", "cache_aware"];
        if flag {
            args.push("--insert-response-text");
        }
        let gw = gateway_for(&cluster.urls(), &args);
        wait_model_served(&gw, "meta-llama/Llama-3.1-8B-Instruct");
        for stream in [false, true] {
            // A fresh prompt per case, so the streamed case cannot pass on what the other learned.
            let prompt = words(11 + stream as u64, 60);
            let r = crate::common::chat(gw.addr, &prompt, stream, 6);
            assert_eq!(r.status, 200);
            let reply: String = if stream {
                r.text()
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .filter(|d| *d != "[DONE]")
                    .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
                    .filter_map(|v| {
                        v["choices"][0]["delta"]["content"]
                            .as_str()
                            .map(str::to_string)
                    })
                    .collect()
            } else {
                r.json()["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap()
                    .to_string()
            };
            // The reply is learned after the last byte went to the client: poll briefly.
            let tree = gw.gateway().router.tree.as_ref().unwrap();
            let full = format!("{prompt} {reply}");
            let until =
                Instant::now() + Duration::from_millis(if expect_reply { 3000 } else { 300 });
            let (learned, m) = loop {
                tree.sync();
                let forest = tree.load();
                let m = forest
                    .tree(TreeKey::Served("meta-llama/Llama-3.1-8B-Instruct"))
                    .longest_match(&full)
                    .matched_chars;
                let learned = m == full.chars().count();
                if learned || Instant::now() > until {
                    break (learned, m);
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            assert_eq!(
                learned,
                expect_reply,
                "flag {flag}, stream {stream}: matched {m} of {}",
                full.chars().count()
            );
        }
    }
}

#[test]
fn a_prompt_the_chosen_worker_already_holds_sends_no_insert() {
    let cluster = sim(2, |_| {});
    let gw = gateway_for(&cluster.urls(), &["--policy", "cache_aware"]);
    let tree = gw.gateway().router.tree.clone().unwrap();
    let prompt = words(7, 200);
    let first = served_by(&chat_messages(gw.addr, &[("user", &prompt)], &[]));
    tree.sync();
    let applied = tree.stats().inserts_applied();
    assert!(applied >= 1, "the first request is learned");
    // The same prompt again and again: each lands where it is held and changes nothing.
    for _ in 0..20 {
        assert_eq!(
            served_by(&chat_messages(gw.addr, &[("user", &prompt)], &[])),
            first
        );
    }
    tree.sync();
    assert_eq!(
        tree.stats().inserts_applied(),
        applied,
        "a held prompt was inserted again"
    );
    // A longer prompt (a new turn) on the same worker is still learned.
    let longer = format!("{prompt} {}", words(8, 40));
    assert_eq!(
        served_by(&chat_messages(gw.addr, &[("user", &longer)], &[])),
        first
    );
    tree.sync();
    assert_eq!(tree.stats().inserts_applied(), applied + 1);
}

/// Without `--kv-events` the text tree alone decides, so a token-id prompt must carry its
/// namespace there as any text does: the same ids under another `cache_salt` or adapter are
/// blocks the engine cannot reuse. The worker holding the unsalted ids is kept busy by one slow
/// stream, so a namespaced request that matched those ids (a false hit) goes to it, and one
/// that misses goes to the idle worker: deterministic either way. Every token-id form the
/// simulator serves is asked (completions ids and id lists, `/generate` `input_ids`).
#[test]
fn token_id_prompts_of_other_namespaces_miss_the_unsalted_holder() {
    const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
    let cluster = sim(2, |c| {
        c.time_scale = 1.0;
        c.token_interval_ms = Some(100.0);
    });
    let gw = gateway_for(&cluster.urls(), &["--policy", "cache_aware"]);
    wait_model_served(&gw, MODEL);
    let ids: Vec<u32> = (0..200).map(|i| 1000 + i * 7).collect();
    let completion = |extra: serde_json::Value| {
        let mut body = serde_json::json!({"model": MODEL, "prompt": ids, "max_tokens": 1});
        if let serde_json::Value::Object(m) = extra {
            body.as_object_mut().unwrap().extend(m);
        }
        let b = serde_json::to_vec(&body).unwrap();
        let r = request(gw.addr, "POST", "/v1/completions", &[], &b).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        served_by(&r)
    };
    let home = completion(serde_json::json!({}));
    let tree = gw.gateway().router.tree.clone().unwrap();
    tree.sync();
    // One slow unsalted stream holds `home` busy (1 in flight against 0: no imbalance).
    let mut held = Conn::open(gw.addr);
    let stream =
        serde_json::json!({"model": MODEL, "prompt": ids, "max_tokens": 200, "stream": true});
    held.send(&raw_request(
        "POST",
        "/v1/completions",
        &[],
        &serde_json::to_vec(&stream).unwrap(),
    ));
    let h = held.read_head(false).unwrap();
    assert_eq!(
        h.header("x-worker-port")
            .map(|p| String::from_utf8_lossy(p).parse::<u16>().unwrap()),
        Some(home),
        "the unsalted ids stay with their holder"
    );
    let batch = serde_json::json!([ids, [1, 2, 3]]);
    for (what, extra) in [
        ("salt t1", serde_json::json!({"cache_salt": "t1"})),
        ("salt t1 again", serde_json::json!({"cache_salt": "t1"})),
        ("salt t2", serde_json::json!({"cache_salt": "t2"})),
        ("adapter", serde_json::json!({"lora_path": "sql"})),
        ("extra key", serde_json::json!({"extra_key": "k"})),
        (
            "salted batch",
            serde_json::json!({"cache_salt": "t3", "prompt": batch}),
        ),
    ] {
        assert_ne!(
            completion(extra),
            home,
            "{what}: the unsalted holder's text-tree entry is no prefix of it"
        );
    }
    // `/generate`'s `input_ids` under the same model share the tree with the completions.
    let body = serde_json::json!({"model": MODEL, "input_ids": ids, "cache_salt": "t4",
        "sampling_params": {"max_new_tokens": 1}});
    let r = generate(gw.addr, &serde_json::to_vec(&body).unwrap());
    assert_eq!(r.status, 200, "{}", r.text());
    assert_ne!(served_by(&r), home, "salted input_ids");
    // The unsalted ids still go to their holder, busy as it is.
    assert_eq!(completion(serde_json::json!({})), home);
    drop(held);
}
