use super::*;

fn cfg() -> EngineConfig {
    EngineConfig {
        cost: CostModel {
            jitter: 0.0,
            ..CostModel::default()
        },
        ..EngineConfig::default()
    }
}

fn prompt(base: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| base + i).collect()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6
}

fn finished(events: &[Event]) -> Vec<(ReqId, FinishInfo)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Finished { id, info } => Some((*id, *info)),
            _ => None,
        })
        .collect()
}

#[test]
fn prefill_is_chunked_and_timed_by_the_formula() {
    let mut e = Engine::new(cfg());
    let id = e.submit(prompt(0, 20_000), 2, 0.0, false).unwrap();
    let m = CostModel {
        jitter: 0.0,
        ..CostModel::default()
    };
    let mut ev = Vec::new();
    let mut t = 0.0;
    for (u, c) in [(8192, 0), (8192, 8192), (3616, 16384)] {
        let f = e.plan().unwrap();
        assert_eq!(f.kind, ForwardKind::Prefill);
        assert_eq!(f.tokens, u);
        let want = m.prefill_ms(&[PrefillItem {
            uncached: u,
            context: c,
        }]);
        assert!(close(f.duration_ms, want));
        t += want;
        e.complete(&mut ev);
        assert!(close(e.now_ms(), t));
    }
    // The first token came out of the last chunk; the prefix is in the tree.
    assert_eq!(ev.len(), 1);
    assert!(matches!(ev[0], Event::Token { id: i, first: true, .. } if i == id));
    assert_eq!(e.cache().tree_tokens(), 20_000);
    let f = e.plan().unwrap();
    assert_eq!(f.kind, ForwardKind::Decode);
    assert!(close(f.duration_ms, m.decode_ms(1, 20_001)));
    e.complete(&mut ev);
    let fin = finished(&ev);
    assert_eq!(fin[0].1.completion_tokens, 2);
    assert_eq!(fin[0].1.reason, FinishReason::Length);
    assert!(e.is_idle());
    assert!(e.cache().is_idle());
    assert_eq!(
        e.cache().tree_tokens(),
        20_001,
        "(prompt + output)[:-1] inserted"
    );
    e.cache().check_invariants().unwrap();
}

#[test]
fn prefill_first_and_decode_batching() {
    let m = CostModel {
        jitter: 0.0,
        ..CostModel::default()
    };
    let mut e = Engine::new(cfg());
    let mut ev = Vec::new();
    e.submit(prompt(0, 100), 5, 0.0, false).unwrap();
    e.submit(prompt(1000, 100), 5, 0.0, false).unwrap();
    let f = e.plan().unwrap();
    assert_eq!(
        (f.kind, f.batch, f.tokens),
        (ForwardKind::Prefill, 2, 200),
        "one forward, two requests"
    );
    e.complete(&mut ev);
    let f = e.plan().unwrap();
    assert_eq!((f.kind, f.batch), (ForwardKind::Decode, 2));
    assert!(close(f.duration_ms, m.decode_ms(2, 202)));
    e.complete(&mut ev);
    // A new arrival is prefilled before the next decode step.
    e.submit(prompt(5000, 50), 5, e.now_ms(), false).unwrap();
    assert_eq!(e.plan().unwrap().kind, ForwardKind::Prefill);
    e.complete(&mut ev);
    let f = e.plan().unwrap();
    assert_eq!((f.kind, f.batch), (ForwardKind::Decode, 3));
    assert!(close(f.duration_ms, m.decode_ms(3, 102 + 102 + 51)));
    e.complete(&mut ev);
    e.run_until_idle(&mut ev);
    assert_eq!(finished(&ev).len(), 3);
    let tokens = ev
        .iter()
        .filter(|e| matches!(e, Event::Token { .. }))
        .count();
    assert_eq!(tokens, 15);
    assert_eq!(e.metrics().generation_tokens, 15);
    assert_eq!(e.metrics().ttft.count(), 3);
    assert_eq!(e.metrics().itl.count(), 12);
}

#[test]
fn fcfs_head_of_line_under_memory_pressure() {
    let mut e = Engine::new(EngineConfig {
        max_total_tokens: 1000,
        ..cfg()
    });
    let mut ev = Vec::new();
    let a = e.submit(prompt(0, 500), 300, 0.0, false).unwrap(); // needs 799
    let b = e.submit(prompt(10_000, 400), 10, 0.0, false).unwrap(); // needs 409: must wait
    let c = e.submit(prompt(20_000, 10), 2, 0.0, false).unwrap(); // small, but behind b
    let f = e.plan().unwrap();
    assert_eq!(f.batch, 1, "only the head fits");
    e.complete(&mut ev);
    assert_eq!(e.num_waiting(), 2);
    // While a decodes, b and c stay queued (FCFS: c does not jump b).
    for _ in 0..5 {
        assert_eq!(e.plan().unwrap().kind, ForwardKind::Decode);
        e.complete(&mut ev);
    }
    assert_eq!(e.num_waiting(), 2);
    e.run_until_idle(&mut ev);
    let first_tokens: Vec<ReqId> = ev
        .iter()
        .filter_map(|e| match e {
            Event::Token {
                id, first: true, ..
            } => Some(*id),
            _ => None,
        })
        .collect();
    assert_eq!(first_tokens, vec![a, b, c], "scheduled in arrival order");
    assert_eq!(finished(&ev).len(), 3);
    e.cache().check_invariants().unwrap();
    assert!(e.cache().tree_tokens() <= 1000);
}

#[test]
fn max_running_caps_admission() {
    let mut e = Engine::new(EngineConfig {
        max_running: 2,
        ..cfg()
    });
    for i in 0..3 {
        e.submit(prompt(i * 1000, 10), 3, 0.0, false).unwrap();
    }
    assert_eq!(e.plan().unwrap().batch, 2);
    let mut ev = Vec::new();
    e.complete(&mut ev);
    assert_eq!(e.num_running(), 2);
    assert_eq!(e.num_waiting(), 1);
    e.run_until_idle(&mut ev);
    assert_eq!(finished(&ev).len(), 3);
}

#[test]
fn prefix_visible_only_after_prefill() {
    let mut e = Engine::new(cfg());
    let mut ev = Vec::new();
    let p = prompt(7, 300);
    e.submit(p.clone(), 4, 0.0, false).unwrap();
    e.submit(p.clone(), 4, 0.0, false).unwrap();
    let f = e.plan().unwrap();
    assert_eq!(f.batch, 2);
    assert_eq!(e.last_hit_rate(), 0.0, "same batch: both miss");
    // Arrives while that prefill is in flight: scheduled after it, so it hits.
    e.submit(p.clone(), 4, 1.0, false).unwrap();
    e.complete(&mut ev);
    e.run_until_idle(&mut ev);
    let fin = finished(&ev);
    let cached: Vec<usize> = fin.iter().map(|(_, i)| i.cached_tokens).collect();
    assert_eq!(cached, vec![0, 0, 299], "hit = len − 1");
    // After finish, (prompt + output)[:-1] is cached: a follow-up extending the answer hits it.
    let mut next = p.clone();
    let answer: Vec<u32> = ev
        .iter()
        .filter_map(|e| match e {
            Event::Token { id, token, .. } if *id == fin[0].0 => Some(*token),
            _ => None,
        })
        .collect();
    assert_eq!(answer.len(), 4);
    next.extend(&answer);
    next.extend([1, 2, 3]);
    e.submit(next, 1, e.now_ms(), false).unwrap();
    ev.clear();
    e.run_until_idle(&mut ev);
    assert_eq!(
        finished(&ev)[0].1.cached_tokens,
        303,
        "prompt + answer minus its last token"
    );
    assert_eq!(e.metrics().cached_tokens, 299 + 303);
}

#[test]
fn identical_prompts_get_identical_answers() {
    let mut e = Engine::new(cfg());
    let mut ev = Vec::new();
    let a = e.submit(prompt(3, 20), 8, 0.0, false).unwrap();
    let b = e.submit(prompt(3, 20), 8, 0.0, false).unwrap();
    e.run_until_idle(&mut ev);
    let toks = |want| -> Vec<u32> {
        ev.iter()
            .filter_map(|e| match e {
                Event::Token { id, token, .. } if *id == want => Some(*token),
                _ => None,
            })
            .collect()
    };
    assert_eq!(toks(a), toks(b));
    assert_eq!(toks(a).len(), 8);
}

#[test]
fn abort_releases_locks_and_kv() {
    let mut e = Engine::new(cfg());
    let mut ev = Vec::new();
    let a = e.submit(prompt(0, 100), 50, 0.0, false).unwrap();
    let b = e.submit(prompt(0, 100), 50, 0.0, false).unwrap();
    e.plan().unwrap();
    // Abort while its prefill is in flight.
    let info = e.abort(a).unwrap();
    assert_eq!(info.reason, FinishReason::Abort);
    e.complete(&mut ev);
    assert_eq!(e.num_running(), 1);
    e.plan().unwrap();
    e.complete(&mut ev);
    e.abort(b).unwrap();
    assert!(e.abort(b).is_none());
    assert_eq!(e.num_running(), 0);
    assert!(e.is_idle());
    assert!(e.cache().is_idle(), "no lock, no private KV left");
    assert_eq!(e.metrics().num_aborted, 2);
    assert_eq!(e.metrics().num_requests, 2);
    e.cache().check_invariants().unwrap();
    assert!(e.plan().is_none());
    // Aborting a waiting request.
    let c = e.submit(prompt(0, 10), 1, 0.0, false).unwrap();
    e.abort(c).unwrap();
    assert!(e.plan().is_none());
}

#[test]
fn rejects_impossible_requests_and_flush_rules() {
    let mut e = Engine::new(EngineConfig {
        max_total_tokens: 100,
        ..cfg()
    });
    assert_eq!(
        e.submit(vec![], 1, 0.0, false),
        Err(SubmitError::EmptyPrompt)
    );
    assert!(matches!(
        e.submit(prompt(0, 90), 20, 0.0, false),
        Err(SubmitError::TooLong { .. })
    ));
    let id = e.submit(prompt(0, 50), 2, 0.0, false).unwrap();
    assert!(!e.flush_cache(), "refused while a request waits");
    let mut ev = Vec::new();
    e.run_until_idle(&mut ev);
    assert!(e.cache().tree_tokens() > 0);
    assert!(e.flush_cache());
    assert_eq!(e.cache().tree_tokens(), 0);
    let _ = id;
}

#[test]
fn eviction_under_pressure_keeps_capacity() {
    let mut e = Engine::new(EngineConfig {
        max_total_tokens: 5000,
        page_size: 4,
        ..cfg()
    });
    let mut ev = Vec::new();
    let mut rng = Rng::new(9);
    for i in 0..200u32 {
        let n = 50 + rng.below(900);
        let shared = (rng.below(4) * 100_000) as u32;
        let mut p = prompt(shared, 200);
        p.extend(prompt(i * 10_000 + 500, n));
        e.submit(p, 1 + rng.below(40), e.now_ms(), false).unwrap();
        if i % 7 == 0 {
            while e.plan().is_some() {
                e.complete(&mut ev);
                e.cache().check_invariants().unwrap();
            }
        }
    }
    e.run_until_idle(&mut ev);
    assert_eq!(finished(&ev).len(), 200);
    assert!(e.cache().stats().evicted_tokens > 0);
    e.cache().check_invariants().unwrap();
    assert!(e.cache().is_idle());
}

/// Submit one request (in `ns`), run everything, and return its finish record.
fn run_one(e: &mut Engine, p: Vec<u32>, ns: Namespace) -> FinishInfo {
    let id = e.submit(p, 1, e.now_ms(), false).unwrap();
    e.set_namespace(id, ns);
    let mut ev = Vec::new();
    e.run_until_idle(&mut ev);
    finished(&ev)
        .into_iter()
        .find(|(i, _)| *i == id)
        .map(|(_, info)| info)
        .unwrap()
}

#[test]
fn host_hits_load_back_at_the_load_cost_and_count_as_host() {
    let mut e = Engine::new(EngineConfig {
        max_total_tokens: 1000,
        host_cache_tokens: 4000,
        ..cfg()
    });
    let d = Namespace::default;
    run_one(&mut e, prompt(0, 600), d());
    // The second prompt needs the slots: the first one's 600 tokens go to host memory.
    run_one(&mut e, prompt(10_000, 600), d());
    assert_eq!(e.cache().host_tokens(), 600);
    assert_eq!(e.cache().stats().backed_up_tokens, 600);
    // The first prompt again: 599 tokens (the hit stops before the last prompt token) come
    // back over PCIe, one is computed over them.
    let id = e.submit(prompt(0, 600), 1, e.now_ms(), false).unwrap();
    let f = e.plan().unwrap();
    let m = CostModel {
        jitter: 0.0,
        ..CostModel::default()
    };
    let want = m.prefill_ms(&[PrefillItem {
        uncached: 1,
        context: 599,
    }]) + m.host_load_ms(599);
    assert!(close(f.duration_ms, want), "{} vs {want}", f.duration_ms);
    let recompute = m.prefill_ms(&[PrefillItem {
        uncached: 600,
        context: 0,
    }]);
    let base = m.prefill_base_ms;
    assert!(
        (f.duration_ms - base) * 10.0 < recompute - base,
        "loading is an order of magnitude cheaper than recomputing"
    );
    let mut ev = Vec::new();
    e.complete(&mut ev);
    e.run_until_idle(&mut ev);
    let info = finished(&ev).into_iter().find(|(i, _)| *i == id).unwrap().1;
    assert_eq!(info.cached_tokens, 599);
    assert_eq!(e.cache().stats().loaded_tokens, 599);
    let met = e.metrics();
    assert_eq!((met.cached_tokens, met.cached_tokens_host), (599, 599));
    // Once more: a device hit, counted as such.
    assert_eq!(run_one(&mut e, prompt(0, 600), d()).cached_tokens, 599);
    let text = e.render_metrics("m", 0, e.now_ms());
    for (source, n) in [("device", 599), ("host", 599), ("total", 1198)] {
        let line = format!(
            "sglang:cached_tokens_total{{model_name=\"m\",cache_source=\"{source}\"}} {n}\n"
        );
        assert!(text.contains(&line), "{line}");
    }
    e.cache().check_invariants().unwrap();
}

#[test]
fn without_a_host_tier_evicted_prefixes_are_recomputed() {
    let mut e = Engine::new(EngineConfig {
        max_total_tokens: 1000,
        ..cfg()
    });
    let d = Namespace::default;
    run_one(&mut e, prompt(0, 600), d());
    run_one(&mut e, prompt(10_000, 600), d());
    assert_eq!(run_one(&mut e, prompt(0, 600), d()).cached_tokens, 0);
    assert_eq!(e.metrics().cached_tokens_host, 0);
}

#[test]
fn namespaces_share_prefixes_only_within_themselves() {
    let mut e = Engine::new(cfg());
    let salt = |s: &str| Namespace::new(None, None, Some(s));
    assert_eq!(run_one(&mut e, prompt(0, 300), salt("a")).cached_tokens, 0);
    assert_eq!(run_one(&mut e, prompt(0, 300), salt("b")).cached_tokens, 0);
    assert_eq!(
        run_one(&mut e, prompt(0, 300), Namespace::default()).cached_tokens,
        0
    );
    assert_eq!(
        run_one(&mut e, prompt(0, 300), salt("a")).cached_tokens,
        299
    );
    let lora = Namespace::new(None, Some("adapter"), None);
    assert_eq!(
        run_one(&mut e, prompt(0, 300), lora.clone()).cached_tokens,
        0
    );
    assert_eq!(run_one(&mut e, prompt(0, 300), lora).cached_tokens, 299);
    e.cache().check_invariants().unwrap();
}

/// The ids in the order their first token came out (the order they were scheduled).
fn first_token_order(events: &[Event]) -> Vec<ReqId> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Token {
                id, first: true, ..
            } => Some(*id),
            _ => None,
        })
        .collect()
}

/// A metric sample's value in a rendered `/metrics` text.
fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no sample {name} in\n{text}"))
}

#[test]
fn overload_bounds_the_batch_by_kv_queues_the_rest_and_ttft_grows_with_the_queue() {
    // 10k tokens of KV; each request needs 1000 + 99 reserved: 9 run at once, 11 wait.
    let mut e = Engine::new(EngineConfig {
        max_total_tokens: 10_000,
        ..cfg()
    });
    let ids: Vec<ReqId> = (0..20)
        .map(|i| e.submit(prompt(i * 10_000, 1000), 100, 0.0, false).unwrap())
        .collect();
    let mut ev = Vec::new();
    // Prefill forwards until the head of the queue no longer fits: then the first decode.
    loop {
        let f = e.plan().unwrap();
        e.complete(&mut ev);
        if f.kind == ForwardKind::Decode {
            break;
        }
    }
    assert_eq!((e.num_running(), e.num_waiting()), (9, 11));
    let text = e.render_metrics("m", 0, e.now_ms());
    assert_eq!(sample(&text, "sglang:num_running_reqs"), 9.0);
    assert_eq!(sample(&text, "sglang:num_queue_reqs"), 11.0);
    let usage = sample(&text, "sglang:token_usage");
    assert!((0.85..=1.0).contains(&usage), "KV nearly full: {usage}");
    e.run_until_idle(&mut ev);
    // FCFS: scheduled in arrival order, and every later request waited at least as long.
    assert_eq!(first_token_order(&ev), ids);
    let fin = finished(&ev);
    let ttft = |id: ReqId| {
        let info = fin.iter().find(|(i, _)| *i == id).unwrap().1;
        info.first_token_ms.unwrap() - info.arrival_ms
    };
    for w in ids.windows(2) {
        assert!(ttft(w[1]) >= ttft(w[0]), "TTFT grows along the queue");
    }
    // The last one waited for two waves of nine to decode their 99 tokens (each step at least
    // the decode base cost), on top of what the first one waited.
    let two_waves = 2.0 * 99.0 * CostModel::default().decode_base_ms;
    assert!(
        ttft(ids[19]) > ttft(ids[0]) + two_waves,
        "{} vs {}",
        ttft(ids[19]),
        ttft(ids[0])
    );
    assert!(e.metrics().queue.sum() > 0.0, "queue time is recorded");
}

/// Submits a blocker that runs alone (`max_running` 1), then requests with the given priorities,
/// and returns the order the queued ones were scheduled in (indices into `priorities`).
fn scheduled_order(priority_scheduling: bool, priorities: &[Option<i64>]) -> Vec<usize> {
    let mut e = Engine::new(EngineConfig {
        max_running: 1,
        priority_scheduling,
        ..cfg()
    });
    let blocker = e.submit(prompt(0, 100), 5, 0.0, false).unwrap();
    let mut ev = Vec::new();
    e.plan().unwrap();
    e.complete(&mut ev);
    let ids: Vec<ReqId> = priorities
        .iter()
        .enumerate()
        .map(|(i, &p)| {
            let id = e
                .submit(prompt(1000 * (i as u32 + 1), 50), 2, e.now_ms(), false)
                .unwrap();
            e.set_priority(id, p);
            id
        })
        .collect();
    e.run_until_idle(&mut ev);
    let order = first_token_order(&ev);
    assert_eq!(order[0], blocker);
    order[1..]
        .iter()
        .map(|id| ids.iter().position(|x| x == id).unwrap())
        .collect()
}

#[test]
fn priority_scheduling_runs_higher_priorities_first_and_fcfs_within_one() {
    let prios = [
        Some(0),
        Some(10),
        None,
        Some(10),
        Some(0),
        Some(-5),
        Some(i64::MAX),
    ];
    // Highest first; equal priorities in arrival order; no priority after every explicit one.
    assert_eq!(scheduled_order(true, &prios), vec![6, 1, 3, 0, 4, 5, 2]);
}

#[test]
fn priorities_are_ignored_without_priority_scheduling() {
    let prios = [Some(0), Some(10), None, Some(10), Some(-5)];
    assert_eq!(scheduled_order(false, &prios), vec![0, 1, 2, 3, 4]);
}

#[test]
fn priority_is_fixed_once_scheduled_and_aborts_leave_the_order_intact() {
    let mut e = Engine::new(EngineConfig {
        max_running: 1,
        priority_scheduling: true,
        ..cfg()
    });
    let a = e.submit(prompt(0, 100), 3, 0.0, false).unwrap();
    e.set_priority(a, Some(1));
    let mut ev = Vec::new();
    e.plan().unwrap();
    e.complete(&mut ev);
    // Running now: a later priority cannot move it back into the queue.
    e.set_priority(a, Some(-100));
    assert_eq!((e.num_running(), e.num_waiting()), (1, 0));
    let b = e.submit(prompt(1000, 50), 2, 0.0, false).unwrap();
    let c = e.submit(prompt(2000, 50), 2, 0.0, false).unwrap();
    let d = e.submit(prompt(3000, 50), 2, 0.0, false).unwrap();
    e.set_priority(c, Some(5));
    e.set_priority(d, Some(5));
    e.abort(c);
    e.run_until_idle(&mut ev);
    assert_eq!(first_token_order(&ev), vec![a, d, b]);
}

#[test]
fn idle_time_counts_the_gaps_with_no_forward_to_run() {
    let mut e = Engine::new(cfg());
    assert_eq!(e.idle_seconds(0.0), 0.0);
    // Nothing to run for 1.5 s, seen before and after the clock is moved.
    assert!(close(e.idle_seconds(1500.0), 1.5));
    e.advance_to(1500.0);
    assert!(close(e.idle_seconds(1500.0), 1.5));
    e.submit(prompt(0, 3000), 4, 1500.0, false).unwrap();
    let f = e.plan().unwrap();
    // A forward in flight is busy time, whatever the driver's clock says.
    e.advance_to(1600.0);
    assert!(close(e.idle_seconds(1500.0 + f.duration_ms), 1.5));
    let mut ev = Vec::new();
    e.complete(&mut ev);
    e.run_until_idle(&mut ev);
    let busy_until = e.now_ms();
    assert!(close(e.idle_seconds(busy_until), 1.5));
    // Idle again: 250 ms more until the next arrival.
    e.advance_to(busy_until + 250.0);
    assert!(close(e.idle_seconds(busy_until + 250.0), 1.75));
    let text = e.render_metrics("m", 0, busy_until + 1250.0);
    assert!(close(sample(&text, "sglang:gpu_idle_seconds_total"), 2.75));
    assert!(text.contains("# TYPE sglang:gpu_idle_seconds_total counter"));
}

#[test]
fn the_queue_gauge_counts_what_the_last_step_left_waiting_not_arrivals_since() {
    // SGLang sets sglang:num_queue_reqs when it forms a batch; /get_load reads the live queue.
    let mut e = Engine::new(EngineConfig {
        max_running: 2,
        ..cfg()
    });
    let mut ev = Vec::new();
    for i in 0..3 {
        e.submit(prompt(i * 1000, 10), 50, 0.0, false).unwrap();
    }
    // `held`: requests the `hold` fault keeps back, which count as waiting.
    let gauge_with = |e: &Engine, held| {
        sample(
            &e.render_metrics("m", held, e.now_ms()),
            "sglang:num_queue_reqs",
        )
    };
    let gauge = |e: &Engine| gauge_with(e, 0);
    // Nothing planned yet: an idle engine's arrivals are no queue until a step leaves them.
    assert_eq!((e.num_waiting(), gauge(&e)), (3, 0.0));
    e.plan().unwrap();
    e.complete(&mut ev);
    assert_eq!(
        (e.num_waiting(), gauge(&e)),
        (1, 1.0),
        "the step took two of three"
    );
    // Two more arrive mid-decode: the live queue has three, the gauge still the step's one.
    for i in 3..5 {
        e.submit(prompt(i * 1000, 10), 50, e.now_ms(), false)
            .unwrap();
    }
    assert_eq!((e.num_waiting(), gauge(&e)), (3, 1.0));
    // The next step takes none of them (the batch is full) and reports all three.
    e.plan().unwrap();
    assert_eq!(gauge(&e), 3.0);
    e.complete(&mut ev);
    e.run_until_idle(&mut ev);
    assert_eq!(gauge(&e), 0.0, "the last step left nothing waiting");
    // A held request (the `hold` fault) still counts as waiting.
    assert_eq!(gauge_with(&e, 2), 2.0);
}

/// An engine with `--max-queued-requests 2` whose one running slot is taken, so every later
/// request waits.
fn full_queue_engine(priority_scheduling: bool) -> Engine {
    let mut e = Engine::new(EngineConfig {
        max_running: 1,
        priority_scheduling,
        max_queued_requests: Some(2),
        ..cfg()
    });
    let blocker = e.submit(prompt(0, 100), 50, 0.0, false).unwrap();
    assert_eq!(e.enforce_queue_limit(blocker), None);
    let mut ev = Vec::new();
    e.plan().unwrap();
    e.complete(&mut ev);
    e
}

#[test]
fn max_queued_requests_refuses_the_arrival_once_the_waiting_queue_is_full() {
    let mut e = full_queue_engine(false);
    let a = e.submit(prompt(1000, 50), 2, e.now_ms(), false).unwrap();
    assert_eq!(e.enforce_queue_limit(a), None);
    let b = e.submit(prompt(2000, 50), 2, e.now_ms(), false).unwrap();
    e.set_priority(b, Some(100));
    assert_eq!(e.enforce_queue_limit(b), None, "two may wait");
    let c = e.submit(prompt(3000, 50), 2, e.now_ms(), false).unwrap();
    e.set_priority(c, Some(1000));
    assert_eq!(
        e.enforce_queue_limit(c),
        Some(c),
        "the third is refused, whatever its priority, without priority scheduling"
    );
    assert_eq!(e.num_waiting(), 2);
    // Without a limit nothing is ever refused.
    let mut e = Engine::new(cfg());
    for i in 0..100 {
        let id = e.submit(prompt(10 * i, 5), 2, 0.0, false).unwrap();
        assert_eq!(e.enforce_queue_limit(id), None);
    }
}

#[test]
fn under_priority_scheduling_a_higher_arrival_displaces_the_least_preferred_queued_request() {
    let mut e = full_queue_engine(true);
    let ids: Vec<ReqId> = [Some(5), Some(5)]
        .iter()
        .enumerate()
        .map(|(i, &p)| {
            let id = e
                .submit(prompt(1000 * (i as u32 + 1), 50), 2, e.now_ms(), false)
                .unwrap();
            e.set_priority(id, p);
            assert_eq!(e.enforce_queue_limit(id), None);
            id
        })
        .collect();
    // Not strictly higher: the arrival is refused.
    let same = e.submit(prompt(7000, 50), 2, e.now_ms(), false).unwrap();
    e.set_priority(same, Some(5));
    assert_eq!(e.enforce_queue_limit(same), Some(same));
    // Strictly higher: the newest of the lowest makes way.
    let high = e.submit(prompt(8000, 50), 2, e.now_ms(), false).unwrap();
    e.set_priority(high, Some(9));
    assert_eq!(e.enforce_queue_limit(high), Some(ids[1]));
    assert_eq!(e.num_waiting(), 2);
    // A request without a priority ranks below every explicit one.
    let none = e.submit(prompt(9000, 50), 2, e.now_ms(), false).unwrap();
    assert_eq!(e.enforce_queue_limit(none), Some(none));
}
