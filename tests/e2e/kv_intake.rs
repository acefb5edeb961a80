//! The KV-event intake against a publisher that is not ours: `tests/fixtures/kv_publisher.py`
//! (pyzmq + msgpack, libzmq's ZMTP, batches framed as SGLang's ZmqEventPublisher frames them,
//! with a ROUTER replay socket answering in SGLang 0.5.23's form or the older one), on
//! 127.0.0.1. Proves: events arrive decoded and in order (array- and map-encoded events, int
//! and bytes hashes); a skipped sequence number is filled from the replay socket in both reply
//! forms; a gap that cannot be filled, a restart (sequence back to 0) and an unreadable batch
//! each reset the worker; garbage frames are counted and skipped; subscriptions change at run
//! time; a flood beyond the publisher's queue loses nothing silently. (SGLang's own publisher
//! code is driven by `sglang_events`.)
//!
//! The interpreter: `common::test_python` (scripts/test.sh builds `.venv-test/` from the pinned
//! tests/requirements.txt). Without pyzmq and msgpack the tests fail, they never skip.

use crossbeam::channel::{self, Receiver};
use radixgate::kv::endpoint::TcpEndpoint;
use radixgate::kv::intake::{
    Intake, IntakeConfig, IntakeEvent, Publisher, PublisherKey, ResetReason, SourceState,
    WorkerEvents,
};
use radixgate::kv::wire::{BlockRemoved, BlockStored, EngineHash, KvEvent};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
/// Longest wait for anything the publisher or the intake should do (the normal case is ms).
const LIMIT: Duration = Duration::from_secs(20);

fn python() -> Option<String> {
    if std::env::var("RADIXGATE_TEST_LOG").as_deref() == Ok("debug") {
        radixgate::log::set_level(radixgate::log::Level::Debug);
    }
    Some(crate::common::test_python(&["zmq", "msgpack"]))
}

/// The Python publisher, driven line by line over stdin; killed (by PID) on drop.
struct Fixture {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    live: TcpEndpoint,
    replay: TcpEndpoint,
}

impl Fixture {
    fn start(python: &str) -> Fixture {
        Fixture::start_with(python, &[])
    }

    fn start_with(python: &str, args: &[&str]) -> Fixture {
        let mut child = Command::new(python)
            .arg(format!("{ROOT}/tests/fixtures/kv_publisher.py"))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the Python publisher");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = channel::unbounded();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut f = Fixture {
            child,
            stdin,
            lines,
            live: TcpEndpoint::parse("tcp://127.0.0.1:1").unwrap(),
            replay: TcpEndpoint::parse("tcp://127.0.0.1:1").unwrap(),
        };
        let ready = f.line();
        let ports: Vec<u16> = ready
            .strip_prefix("ready ")
            .unwrap_or_else(|| panic!("publisher said {ready}"))
            .split(' ')
            .map(|p| p.parse().unwrap())
            .collect();
        f.live.port = ports[0];
        f.replay.port = ports[1];
        f
    }

    fn line(&mut self) -> String {
        self.lines
            .recv_timeout(LIMIT)
            .expect("the publisher answers within the limit")
    }

    /// Run one command; returns the publisher's next sequence number.
    fn cmd(&mut self, json: serde_json::Value) -> i64 {
        writeln!(self.stdin, "{json}").unwrap();
        self.stdin.flush().unwrap();
        let line = self.line();
        line.strip_prefix("ok ")
            .unwrap_or_else(|| panic!("publisher said {line}"))
            .parse()
            .unwrap()
    }

    /// Publish one batch; returns its sequence number.
    fn publish(&mut self, events: serde_json::Value, form: &str, skip_live: bool) -> i64 {
        self.cmd(
            serde_json::json!({"cmd": "publish", "events": events, "form": form,
            "skip_live": skip_live}),
        ) - 1
    }

    fn publisher(&self, worker: u32, replay: bool) -> Publisher {
        Publisher {
            key: PublisherKey { worker, dp_rank: 0 },
            live: self.live.clone(),
            replay: replay.then(|| self.replay.clone()),
        }
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn stored_json(
    hashes: &[serde_json::Value],
    parent: Option<i64>,
    tokens: &[u32],
) -> serde_json::Value {
    serde_json::json!({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
        "token_ids": tokens, "block_size": 2, "lora_id": null, "medium": null})
}

/// The next batch or reset (state reports are skipped: `states` tests them).
fn next_event(rx: &Receiver<IntakeEvent>) -> IntakeEvent {
    loop {
        let e = rx
            .recv_timeout(LIMIT)
            .expect("the intake delivers within the limit");
        if !matches!(e, IntakeEvent::State { .. }) {
            return e;
        }
    }
}

/// Like [`next_event`] but waiting at most `wait` (`None`: nothing but state reports came).
fn next_event_within(rx: &Receiver<IntakeEvent>, wait: Duration) -> Option<IntakeEvent> {
    let until = Instant::now() + wait;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(IntakeEvent::State { .. }) => continue,
            Ok(e) => return Some(e),
            Err(_) => return None,
        }
    }
}

fn next_batch(rx: &Receiver<IntakeEvent>) -> WorkerEvents {
    match next_event(rx) {
        IntakeEvent::Batch(b) => b,
        other => panic!("expected a batch, got {other:?}"),
    }
}

/// Publish probes until the SUB socket is connected and one arrives (a PUB drops what it sends
/// before a subscriber joins), then wait for the last probe, so the stream is in step.
fn join(f: &mut Fixture, rx: &Receiver<IntakeEvent>) -> i64 {
    let start = Instant::now();
    loop {
        assert!(start.elapsed() < LIMIT, "the intake never received a probe");
        let seq = f.publish(cleared(), "array", false);
        if let Some(first) = next_event_within(rx, Duration::from_millis(100)) {
            let IntakeEvent::Batch(mut b) = first else {
                panic!("{first:?}")
            };
            while b.seq < seq {
                b = next_batch(rx);
            }
            assert_eq!(b.seq, seq);
            return seq;
        }
    }
}

fn cleared() -> serde_json::Value {
    serde_json::json!([{"type": "AllBlocksCleared"}])
}

fn reset(worker: u32, reason: ResetReason) -> IntakeEvent {
    IntakeEvent::Reset {
        key: PublisherKey { worker, dp_rank: 0 },
        reason,
    }
}

fn hashes(v: &[u64]) -> Vec<EngineHash> {
    v.iter().map(|&h| EngineHash(h)).collect()
}

#[test]
fn sglang_framed_events_arrive_in_order_and_a_gap_fills_from_replay() {
    let Some(py) = python() else { return };
    // SGLang 0.5.23's replies ([b"", topic, seq, payload]) and the older ones ([b"", seq,
    // payload]), with a topic so the two forms differ on the wire.
    for form in ["topic", "plain"] {
        let mut f = Fixture::start_with(&py, &["--replay-form", form, "--topic", "kv"]);
        events_in_order_gap_restart_garbage(&mut f);
    }
}

fn events_in_order_gap_restart_garbage(f: &mut Fixture) {
    let f = &mut *f;
    let (tx, rx) = channel::bounded(1024);
    let intake = Intake::start(IntakeConfig::default(), tx).unwrap();
    intake.subscribe(f.publisher(7, true)).unwrap();
    let s0 = join(f, &rx);
    let before = intake.counts();

    // Array-encoded events (SGLang 0.5), negative and unsigned int hashes.
    let a = f.publish(
        serde_json::json!([stored_json(&[(-5).into(), 12.into()], None, &[1, 2, 3, 4])]),
        "array",
        false,
    );
    // Map-encoded events (newer SGLang / vLLM), a 32-byte bytes hash.
    let digest: String = (0..32u8).map(|b| format!("{b:02x}")).collect();
    let b = f.publish(
        serde_json::json!([
            stored_json(&[format!("b:{digest}").into()], Some(12), &[5, 6]),
            {"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"},
        ]),
        "map",
        false,
    );
    // A batch the live stream never carries (only the replay buffer has it), then a live one.
    let c = f.publish(
        serde_json::json!([{"type": "BlockRemoved", "block_hashes": [-5]}]),
        "array",
        true,
    );
    let d = f.publish(cleared(), "map", false);
    assert_eq!([a, b, c, d], [s0 + 1, s0 + 2, s0 + 3, s0 + 4]);

    // (Live, or replayed when the replay that joined the stream ran past it: both in order.)
    let got_a = next_batch(&rx);
    assert_eq!(got_a.seq, a);
    assert_eq!(
        got_a.key,
        PublisherKey {
            worker: 7,
            dp_rank: 0
        }
    );
    assert_eq!(
        got_a.events,
        vec![KvEvent::BlockStored(BlockStored {
            block_hashes: hashes(&[(-5i64) as u64, 12]),
            parent: None,
            token_ids: vec![1, 2, 3, 4],
            block_size: 2,
            lora_id: None,
            medium: None,
            cache_salt: None,
            lora_name: None,
        })]
    );
    let got_b = next_batch(&rx);
    assert_eq!(got_b.seq, b);
    let bytes: Vec<u8> = (0..32).collect();
    assert_eq!(
        got_b.events,
        vec![
            KvEvent::BlockStored(BlockStored {
                block_hashes: vec![EngineHash::from_bytes(&bytes)],
                parent: Some(EngineHash(12)),
                token_ids: vec![5, 6],
                block_size: 2,
                lora_id: None,
                medium: None,
                cache_salt: None,
                lora_name: None,
            }),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: hashes(&[12]),
                medium: Some("GPU".into()),
            }),
        ]
    );
    let got_c = next_batch(&rx);
    assert_eq!((got_c.seq, got_c.replayed), (c, true), "{got_c:?}");
    assert_eq!(
        got_c.events,
        vec![KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: hashes(&[(-5i64) as u64]),
            medium: None,
        })]
    );
    // The replay runs to the end of the buffer: d comes from it too (its live copy is then a
    // duplicate).
    let got_d = next_batch(&rx);
    assert_eq!(got_d.seq, d);
    assert_eq!(got_d.events, vec![KvEvent::AllBlocksCleared]);
    let counts = intake.counts();
    assert_eq!(
        (
            counts.gaps - before.gaps,
            counts.replayed_batches - before.replayed_batches,
            counts.resets - before.resets
        ),
        (1, 2, 0)
    );

    // The server restarts: its counter goes back to 0, its buffer is new. The replay socket
    // proves it (our last batch is not in its buffer): reset, then the new stream from its
    // buffer.
    f.cmd(serde_json::json!({"cmd": "restart"}));
    let e = f.publish(cleared(), "array", false);
    assert_eq!(e, 0);
    assert_eq!(next_event(&rx), reset(7, ResetReason::Restarted));
    assert_eq!(next_batch(&rx).seq, 0);
    let f1 = f.publish(cleared(), "array", false);
    assert_eq!(next_batch(&rx).seq, f1);

    // A live number far ahead that its publisher never sent (its buffer says so): dropped,
    // nothing reset.
    f.cmd(serde_json::json!({"cmd": "raw", "frames": ["6b76", "00000000000f4240", "930090c0"]}));
    // (Published while the replay that proves it runs: it may arrive live or replayed.)
    let f2 = f.publish(cleared(), "array", false);
    assert_eq!(next_batch(&rx).seq, f2);
    assert_eq!(
        intake.counts().resets - before.resets,
        1,
        "{:?}",
        intake.counts()
    );

    // Garbage: a lone frame, a 7-byte sequence, 4 frames: counted, skipped, stream untouched.
    for frames in [
        vec!["00"],
        vec!["", "00000000000001", "90"],
        vec!["", "0000000000000001", "90", "90"],
    ] {
        f.cmd(serde_json::json!({"cmd": "raw", "frames": frames}));
    }
    // Not msgpack, with a real sequence number: a hole in the stream, so a reset.
    f.cmd(serde_json::json!({"cmd": "raw", "frames": ["c1c1"], "with_seq": true}));
    let g = f.publish(cleared(), "array", false);
    assert_eq!(g, 4);
    assert_eq!(next_event(&rx), reset(7, ResetReason::Unreadable));
    let got_g = next_batch(&rx);
    assert_eq!((got_g.seq, got_g.replayed), (4, false));
    let counts = intake.counts();
    // The far-ahead number, three garbage messages, the unreadable batch.
    assert_eq!(counts.malformed - before.malformed, 5, "{counts:?}");
    assert_eq!(counts.resets - before.resets, 2, "{counts:?}");
    assert!(next_event_within(&rx, Duration::from_millis(200)).is_none());
}

#[test]
fn gaps_that_cannot_be_filled_reset_the_worker() {
    let Some(py) = python() else { return };
    let mut f = Fixture::start(&py);
    let (tx, rx) = channel::bounded(1024);
    let intake = Intake::start(IntakeConfig::default(), tx).unwrap();
    intake.subscribe(f.publisher(1, true)).unwrap();
    join(&mut f, &rx);

    // The replay buffer no longer has the missing batch (nor our last one): reset, then what
    // the buffer holds (the live batch) rebuilds the worker.
    f.publish(cleared(), "array", true);
    f.cmd(serde_json::json!({"cmd": "forget"}));
    let live = f.publish(cleared(), "array", false);
    assert_eq!(next_event(&rx), reset(1, ResetReason::Gap));
    assert_eq!(next_batch(&rx).seq, live);

    // A publisher subscribed without a replay endpoint cannot fill any gap: reset, then the
    // stream from the batch at hand.
    intake.subscribe(f.publisher(1, false)).unwrap();
    assert_eq!(next_event(&rx), reset(1, ResetReason::Unsubscribed));
    join(&mut f, &rx);
    f.publish(cleared(), "array", true);
    let live = f.publish(cleared(), "array", false);
    assert_eq!(next_event(&rx), reset(1, ResetReason::Gap));
    let b = next_batch(&rx);
    assert_eq!((b.seq, b.replayed), (live, false));

    // A replay endpoint nobody listens on: refused at once, reset, the stream goes on.
    let nobody = crate::common::closed_port();
    let mut closed = f.publisher(1, true);
    closed.replay = Some(TcpEndpoint::parse(&format!("tcp://127.0.0.1:{}", nobody.port)).unwrap());
    intake.subscribe(closed).unwrap();
    assert_eq!(next_event(&rx), reset(1, ResetReason::Unsubscribed));
    join(&mut f, &rx);
    let start = Instant::now();
    f.publish(cleared(), "array", true);
    let live = f.publish(cleared(), "array", false);
    assert_eq!(next_event(&rx), reset(1, ResetReason::Gap));
    assert_eq!(next_batch(&rx).seq, live);
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    let c = intake.counts();
    assert!(c.replay_failures >= 1, "{c:?}");
}

#[test]
fn subscriptions_change_at_run_time() {
    let Some(py) = python() else { return };
    let mut one = Fixture::start(&py);
    let mut two = Fixture::start(&py);
    let (tx, rx) = channel::bounded(1024);
    let intake = Intake::start(IntakeConfig::default(), tx).unwrap();
    intake.subscribe(one.publisher(1, true)).unwrap();
    join(&mut one, &rx);
    intake.subscribe(two.publisher(2, true)).unwrap();
    join(&mut two, &rx);

    intake.remove_worker(1).unwrap();
    assert_eq!(next_event(&rx), reset(1, ResetReason::Unsubscribed));
    // Worker 1's socket is closed before its next batch is sent: only worker 2's arrives.
    one.publish(cleared(), "array", false);
    let s = two.publish(cleared(), "array", false);
    let b = next_batch(&rx);
    assert_eq!((b.key.worker, b.seq), (2, s));
    // Nothing else but state reports (they come with the reader's next sweep).
    std::thread::sleep(Duration::from_millis(50));
    let rest: Vec<IntakeEvent> = rx.try_iter().collect();
    assert!(
        rest.iter()
            .all(|e| matches!(e, IntakeEvent::State { key, .. } if key.worker == 2)),
        "{rest:?}"
    );
}

#[test]
fn a_flood_past_the_queue_is_replayed_or_reset_never_silently_lost() {
    let Some(py) = python() else { return };
    // A tiny queue on the publisher's side and a consumer that does not read during the flood
    // (the event thread then stops reading, so the socket fills and PUB drops).
    let mut f = Fixture::start_with(&py, &["--hwm", "8"]);
    let (tx, rx) = channel::bounded(8);
    let intake = Intake::start(IntakeConfig::default(), tx).unwrap();
    intake.subscribe(f.publisher(3, true)).unwrap();
    let first = join(&mut f, &rx);
    // ~24 KB a batch, ~24 MB in all: more than loopback TCP buffers hold, so PUB drops.
    let n = 1000i64;
    f.cmd(serde_json::json!({"cmd": "flood", "count": n, "tokens": 8000}));
    // The publisher goes on after the flood, as a server does: silence is not a gap, so flood
    // batches the PUB dropped while the subscriber replayed are known missing only once a later
    // batch arrives. A batch is published whenever nothing came for a while.
    let mut nudges = 0;
    let mut next_or_nudge = |f: &mut Fixture| {
        let until = Instant::now() + LIMIT;
        loop {
            if let Some(e) = next_event_within(&rx, Duration::from_millis(500)) {
                return e;
            }
            assert!(
                Instant::now() < until,
                "the intake delivers within the limit"
            );
            f.publish(cleared(), "array", false);
            nudges += 1;
        }
    };
    // Every batch arrives once, in order, each live or replayed; or a reset marks a hole.
    let mut next = first + 1;
    let mut resets = 0;
    while next <= first + n {
        match next_or_nudge(&mut f) {
            IntakeEvent::Batch(b) => {
                if b.seq != next {
                    panic!("expected {next}, got {} (replayed {})", b.seq, b.replayed);
                }
                let KvEvent::BlockStored(s) = &b.events[0] else {
                    panic!()
                };
                assert_eq!(s.block_hashes, vec![EngineHash((next - first - 1) as u64)]);
                next += 1;
            }
            IntakeEvent::Reset { reason, .. } => {
                assert_eq!(reason, ResetReason::Gap);
                resets += 1;
                // After a reset the stream restarts at whatever arrives next.
                let IntakeEvent::Batch(b) = next_or_nudge(&mut f) else {
                    panic!("a batch after the reset")
                };
                assert!(b.seq > next, "{} after a reset at {next}", b.seq);
                next = b.seq + 1;
            }
            IntakeEvent::State { .. } => {}
        }
    }
    eprintln!("{nudges} batches published after the flood");
    let c = intake.counts();
    eprintln!(
        "flood of {n} batches (~24 KB each) into queues of 8: {} gaps, {} batches replayed, \
         {resets} resets",
        c.gaps, c.replayed_batches
    );
    assert_eq!(c.resets, resets);
    assert!(
        c.replayed_batches > 0 || resets > 0,
        "the flood should have overflowed the queues: {c:?}"
    );
    assert!(c.gaps > 0, "{c:?}");
}

#[test]
fn a_warm_start_replays_what_the_publisher_buffered_before_the_subscription() {
    let Some(py) = python() else { return };
    let mut f = Fixture::start(&py);
    // Published before anyone subscribed: the live stream lost them, the buffer has them.
    let early: Vec<i64> = (0..3u64)
        .map(|i| {
            f.publish(
                serde_json::json!([stored_json(&[(i as i64).into()], None, &[1, 2])]),
                "array",
                false,
            )
        })
        .collect();
    let (tx, rx) = channel::bounded(1024);
    let intake = Intake::start(IntakeConfig::default(), tx).unwrap();
    intake.subscribe(f.publisher(3, true)).unwrap();
    let key = PublisherKey {
        worker: 3,
        dp_rank: 0,
    };
    // Reported connecting, replaying once subscribed, then the replayed batches, then live.
    let mut states = Vec::new();
    let mut replayed = Vec::new();
    while states.last() != Some(&SourceState::Live) {
        match rx.recv_timeout(LIMIT).expect("the intake reports") {
            IntakeEvent::State { key: k, state } => {
                assert_eq!(k, key);
                states.push(state);
            }
            IntakeEvent::Batch(b) => {
                assert!(b.replayed);
                replayed.push(b.seq);
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(replayed, early);
    assert_eq!(
        states,
        [
            SourceState::Connecting,
            SourceState::Replaying,
            SourceState::Live
        ]
    );
    // The live stream goes on after the replayed part: no reset, no duplicate.
    let start = Instant::now();
    let mut last = *early.last().unwrap();
    loop {
        assert!(start.elapsed() < LIMIT, "live batches never arrived");
        let seq = f.publish(cleared(), "map", false);
        if let Some(ev) = next_event_within(&rx, Duration::from_millis(100)) {
            let IntakeEvent::Batch(b) = ev else {
                panic!("expected a batch, got {ev:?}")
            };
            // Whatever the SUB socket missed while connecting comes from replay, in order.
            assert_eq!(b.seq, last + 1);
            last = b.seq;
            while last < seq {
                let b = next_batch(&rx);
                assert_eq!(b.seq, last + 1);
                last = b.seq;
            }
            break;
        }
    }
    assert_eq!(intake.counts().resets, 0);
}

/// The whole gateway against the Python publisher, endpoints given by flags
/// (`--kv-events-endpoints`, `--kv-events-replay-endpoints`) for a simulated worker that
/// publishes nothing itself: the publisher's batches reach the index (array and map forms), a
/// batch the live stream never carried is fetched from the replay socket (without it the last
/// batch's parent would be unknown and dropped), and the prompt is routed to that worker.
#[test]
fn the_gateway_routes_on_a_foreign_publisher_named_by_flags_and_fills_its_gap() {
    let Some(py) = python() else { return };
    let mut f = Fixture::start(&py);
    // The worker reports the page size the publisher's events use (4): a size a server
    // announces is the only one its events are believed in.
    let cluster = crate::common::sim(2, |cfg| cfg.page_size = 4);
    let urls: Vec<String> = cluster
        .ports()
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    let live = format!("{}={}", urls[1], f.live.url());
    let replay = format!("{}={}", urls[1], f.replay.url());
    let gw = crate::common::gateway_for(
        &urls,
        &[
            "--kv-events",
            "--policy",
            "cache_aware",
            "--kv-events-endpoints",
            &live,
            "--kv-events-replay-endpoints",
            &replay,
        ],
    );
    let kv = gw.gateway().kv.as_ref().unwrap();
    crate::common::wait_until("the publisher subscribed and warm", LIMIT, || {
        (kv.exact_workers().len() == 1).then_some(())
    });
    // The live subscription may still be joining: probe until a batch is applied.
    let start = Instant::now();
    while kv.intake_counts().batches == 0 {
        assert!(start.elapsed() < LIMIT, "no batch reached the gateway");
        f.publish(cleared(), "array", false);
        std::thread::sleep(Duration::from_millis(20));
    }
    let tokens: Vec<u32> = (0..64).map(|i| 7000 + i).collect();
    let stored = |hashes: std::ops::Range<i64>, parent: Option<i64>| {
        let toks = &tokens[hashes.start as usize * 4..hashes.end as usize * 4];
        serde_json::json!({"type": "BlockStored",
            "block_hashes": hashes.map(serde_json::Value::from).collect::<Vec<_>>(),
            "parent_block_hash": parent, "token_ids": toks, "block_size": 4,
            "lora_id": null, "medium": null})
    };
    f.publish(serde_json::json!([stored(0..8, None)]), "array", false);
    f.publish(serde_json::json!([stored(8..12, Some(7))]), "map", true);
    f.publish(
        serde_json::json!([stored(12..16, Some(11))]),
        "array",
        false,
    );
    let model = "meta-llama/Llama-3.1-8B-Instruct";
    crate::common::wait_until("all 16 blocks in the index", LIMIT, || {
        let snap = kv.reader.load();
        let mut scratch = Default::default();
        let m = snap.match_prefix(
            model,
            radixgate::kv::index::ROOT_PARENT,
            &tokens,
            &mut scratch,
        );
        (m.len() == 1 && m[0].blocks == 16).then_some(())
    });
    assert!(kv.intake_counts().replayed_batches >= 1);
    let body = serde_json::to_vec(&serde_json::json!({
        "input_ids": tokens, "sampling_params": {"max_new_tokens": 1}
    }))
    .unwrap();
    for _ in 0..5 {
        let r = crate::common::generate(gw.addr, &body);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(crate::common::served_by(&r), cluster.ports()[1]);
    }
}

/// One worker announcing 256 DP ranks whose replay socket accepts and never answers (or
/// refuses): their replays wait their turn (8 at a time, 5 s each without an answer), and
/// another worker's events keep arriving within a second throughout.
#[test]
fn replays_that_hang_never_hold_up_other_publishers() {
    // Serial: every batch of the normal worker within a second for 8 s while 256 replays wait:
    // a delay figure, which a timing test's load beside it would add to.
    let _serial = crate::common::serial();
    let Some(py) = python() else { return };
    let mut normal = Fixture::start(&py);
    let many = Fixture::start(&py);
    let (tx, rx) = channel::bounded(1 << 16);
    let intake = Intake::start(IntakeConfig::default(), tx).unwrap();
    intake.subscribe(normal.publisher(1, true)).unwrap();
    join(&mut normal, &rx);
    // A listener that accepts every connection and says nothing.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_port = silent.local_addr().unwrap().port();
    silent.set_nonblocking(true).unwrap();
    let (stop, stopped) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        let mut held = Vec::new();
        while stopped.try_recv().is_err() {
            if let Ok((c, _)) = silent.accept() {
                held.push(c);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        held.len()
    });
    let closed = crate::common::closed_port();
    for rank in 0..256u32 {
        // Half hang, half are refused.
        let port = if rank % 2 == 0 {
            silent_port
        } else {
            closed.port
        };
        let replay = TcpEndpoint::parse(&format!("tcp://127.0.0.1:{port}")).unwrap();
        intake
            .subscribe(Publisher {
                key: PublisherKey {
                    worker: 2,
                    dp_rank: rank,
                },
                live: many.live.clone(),
                replay: Some(replay),
            })
            .unwrap();
    }
    // For 8 s, a batch from the normal worker every 200 ms: each must arrive within 1 s.
    let start = Instant::now();
    let mut worst = Duration::ZERO;
    while start.elapsed() < Duration::from_secs(8) {
        let sent = Instant::now();
        let seq = normal.publish(cleared(), "array", false);
        loop {
            match next_event_within(&rx, Duration::from_secs(1)) {
                Some(IntakeEvent::Batch(b)) if b.key.worker == 1 && b.seq == seq => break,
                Some(_) => {}
                None => panic!("batch {seq} not applied within 1 s of being published"),
            }
            assert!(
                sent.elapsed() < Duration::from_secs(1),
                "batch {seq} later than 1 s"
            );
        }
        worst = worst.max(sent.elapsed());
        std::thread::sleep(Duration::from_millis(200));
    }
    let c = intake.counts();
    eprintln!(
        "256 ranks with hanging or refused replays: worst delay of the other worker's batches \
         {worst:?}; {} replays asked, {} failed so far",
        c.replays, c.replay_failures
    );
    // Eight at a time: the hanging ones hold their places for 5 s each, the refused ones give
    // theirs up at once.
    assert!(c.replays >= 16 && c.replay_failures >= 8, "{c:?}");
    stop.send(()).unwrap();
    holder.join().unwrap();
}
