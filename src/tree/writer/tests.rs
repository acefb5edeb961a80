use super::*;

fn ins(model: Option<&str>, text: &str, worker: WorkerId, now_ms: u64) -> Insert {
    Insert {
        model: model.map(|m| Bytes::copy_from_slice(m.as_bytes())),
        text: Bytes::copy_from_slice(text.as_bytes()),
        worker,
        now_ms,
    }
}

fn matched(h: &TreeHandle, model: Option<&str>, key: &str) -> Option<(usize, Vec<WorkerId>)> {
    let forest = h.load();
    let tree = forest.tree(model.map(str::as_bytes))?;
    let m = tree.longest_match(key);
    Some((m.matched_chars, m.workers.to_vec()))
}

/// Polls `cond` for up to 5 s (for behaviour driven by the writer's own clock).
fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    false
}

#[test]
fn insert_then_sync_is_visible() {
    let h = spawn_writer(WriterConfig::default());
    assert_eq!(matched(&h, None, "hello"), Some((0, vec![])));
    assert!(h.try_insert(ins(None, "hello world", 1, 1)));
    h.sync();
    assert_eq!(matched(&h, None, "hello there"), Some((6, vec![1])));
    assert!(h.load().epoch() >= 1);
    let s = h.stats();
    assert_eq!(s.inserts_applied(), 1);
    assert_eq!(s.dropped(), 0);
    assert_eq!(s.chars(), 11);
    assert_eq!(s.nodes(), 2);
    assert_eq!(s.epoch(), h.load().epoch());
    assert!(s.publishes() >= 1);
}

#[test]
fn full_channel_drops_and_counts() {
    let cfg = WriterConfig {
        channel_capacity: 1,
        ..WriterConfig::default()
    };
    // The writer is not running yet, so the channel fills deterministically.
    let (h, writer) = build(cfg);
    assert!(h.try_insert(ins(None, "kept", 1, 1)));
    assert!(!h.try_insert(ins(None, "dropped", 2, 2)));
    assert!(!h.try_insert(ins(None, "dropped too", 2, 3)));
    assert_eq!(h.stats().dropped(), 2);
    std::thread::spawn(move || writer.run());
    h.sync();
    assert_eq!(matched(&h, None, "kept"), Some((4, vec![1])));
    assert_eq!(matched(&h, None, "dropped"), Some((0, vec![])));
    assert_eq!(h.stats().inserts_applied(), 1);
}

#[test]
fn models_do_not_mix() {
    let h = spawn_writer(WriterConfig::default());
    h.try_insert(ins(Some("llama"), "system: be brief. user: hi", 1, 1));
    h.try_insert(ins(Some("qwen"), "system: be brief. user: hi", 2, 2));
    h.try_insert(ins(None, "system: be brief", 3, 3));
    h.sync();
    let key = "system: be brief. user: hi";
    assert_eq!(matched(&h, Some("llama"), key), Some((26, vec![1])));
    assert_eq!(matched(&h, Some("qwen"), key), Some((26, vec![2])));
    assert_eq!(matched(&h, None, key), Some((16, vec![3])));
    assert_eq!(matched(&h, Some("mistral"), key), None);
    let forest = h.load();
    let names: Vec<_> = forest
        .models()
        .map(|(m, _)| m.map(<[u8]>::to_vec))
        .collect();
    assert_eq!(
        names,
        vec![None, Some(b"llama".to_vec()), Some(b"qwen".to_vec())]
    );
}

#[test]
fn remove_worker_clears_every_model() {
    let h = spawn_writer(WriterConfig::default());
    for model in [None, Some("a"), Some("b")] {
        h.try_insert(ins(model, "shared prompt", 1, 1));
        h.try_insert(ins(model, "shared prompt, more", 2, 2));
    }
    h.sync();
    h.remove_worker(1);
    h.sync();
    let forest = h.load();
    for (_, tree) in forest.models() {
        assert_eq!(tree.worker_chars(1), 0);
        assert_eq!(tree.longest_match("shared prompt").workers, &[2]);
        tree.check_invariants().unwrap();
    }
}

#[test]
fn invalid_utf8_is_cut_at_the_last_boundary() {
    let h = spawn_writer(WriterConfig::default());
    let mut text = "abcé".as_bytes().to_vec();
    text.extend_from_slice(&[0xff, b'x']);
    h.try_insert(Insert {
        model: None,
        text: Bytes::from(text),
        worker: 1,
        now_ms: 1,
    });
    // A truncated multi-byte character at the end.
    h.try_insert(Insert {
        model: None,
        text: Bytes::copy_from_slice(&"zz中".as_bytes()[..4]),
        worker: 2,
        now_ms: 2,
    });
    h.sync();
    assert_eq!(matched(&h, None, "abcéx"), Some((4, vec![1])));
    assert_eq!(matched(&h, None, "zz中"), Some((2, vec![2])));
    assert_eq!(h.stats().chars(), 6);
}

#[test]
fn immediate_eviction_bounds_growth_between_passes() {
    let cfg = WriterConfig {
        max_chars_per_worker: 1_000,
        overflow_margin: 0.1,
        eviction_interval: Duration::from_secs(3600),
        ..WriterConfig::default()
    };
    let (_h, mut w) = build(cfg);
    for i in 0..500u64 {
        let text = format!("conversation {i:04}: {}", "x".repeat(40));
        for worker in [1, 2] {
            w.insert(&ins(Some("m"), &text, worker, i));
            let chars = w.forest.tree(Some(b"m")).unwrap().worker_chars(worker);
            assert!(chars <= 1_100, "worker {worker} at {chars}");
        }
    }
    assert!(w.stats.evictions() > 0);
    // The periodic pass brings everyone back under the limit proper.
    w.evict_all();
    let tree = w.forest.tree(Some(b"m")).unwrap();
    for worker in [1, 2] {
        assert!(tree.worker_chars(worker) <= 1_000);
        // The most recent conversation survived (LRU), the first did not.
        let last = format!("conversation 0499: {}", "x".repeat(40));
        assert_eq!(tree.longest_match(&last).matched_chars, last.len());
        assert!(tree.longest_match("conversation 0000").matched_chars < 17);
    }
    tree.check_invariants().unwrap();
}

#[test]
fn periodic_eviction_runs_while_inserts_flow() {
    let cfg = WriterConfig {
        max_chars_per_worker: 2_000,
        overflow_margin: 1.0,
        eviction_interval: Duration::from_millis(5),
        ..WriterConfig::default()
    };
    let h = spawn_writer(cfg);
    for i in 0..2_000u64 {
        let text = format!("prompt {i}: {}", "y".repeat(50));
        while !h.try_insert(ins(None, &text, (i % 3) as WorkerId, i)) {
            std::thread::yield_now();
        }
    }
    h.sync();
    let over_margin = |h: &TreeHandle| {
        let f = h.load();
        let t = f.tree(None).unwrap();
        (0..3).all(|w| t.worker_chars(w) <= 4_000)
    };
    assert!(over_margin(&h));
    assert!(eventually(|| {
        h.sync();
        let f = h.load();
        let t = f.tree(None).unwrap();
        (0..3).all(|w| t.worker_chars(w) <= 2_000)
    }));
    assert!(h.stats().evicted_chars() > 0);
    h.load().tree(None).unwrap().check_invariants().unwrap();
}

#[test]
fn publishes_after_enough_messages_without_waiting_for_the_epoch() {
    let cfg = WriterConfig {
        epoch: Duration::from_secs(3600),
        publish_after: 3,
        ..WriterConfig::default()
    };
    let h = spawn_writer(cfg);
    h.try_insert(ins(None, "one", 1, 1));
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(
        h.load().epoch(),
        0,
        "published before the epoch or the batch was due"
    );
    h.try_insert(ins(None, "two", 1, 2));
    h.try_insert(ins(None, "three", 1, 3));
    assert!(eventually(|| h.load().epoch() == 1));
    assert_eq!(matched(&h, None, "three"), Some((5, vec![1])));
}

#[test]
fn publishes_within_an_epoch_without_sync() {
    let h = spawn_writer(WriterConfig::default());
    h.try_insert(ins(None, "lonely", 4, 1));
    assert!(eventually(
        || matched(&h, None, "lonely") == Some((6, vec![4]))
    ));
}

#[test]
fn clock_is_monotonic_and_snapshots_are_retired_on_the_writer() {
    let (h, mut w) = build(WriterConfig::default());
    let old = h.snapshot.load_full();
    w.insert(&ins(None, "late", 1, 100));
    w.insert(&ins(None, "early", 1, 50));
    assert_eq!(w.clock, 100);
    for i in 0..10 {
        w.insert(&ins(None, &format!("p{i}"), 2, 200 + i));
        w.publish();
        assert!(w.retired.len() <= RETAINED_SNAPSHOTS);
    }
    assert_eq!(h.load().epoch(), 10);
    // A snapshot a reader still holds stays intact.
    assert_eq!(old.epoch(), 0);
    assert_eq!(old.tree(None).unwrap().node_count(), 1);
}

#[test]
fn writer_exits_when_every_handle_is_gone() {
    let (h, w) = build(WriterConfig::default());
    let h2 = h.clone();
    let (done_tx, done_rx) = channel::bounded(1);
    std::thread::spawn(move || {
        w.run();
        let _ = done_tx.send(());
    });
    h.try_insert(ins(None, "x", 1, 1));
    drop(h);
    assert!(done_rx.recv_timeout(Duration::from_millis(50)).is_err());
    drop(h2);
    assert!(done_rx.recv_timeout(Duration::from_secs(5)).is_ok());
}
