//! Exact routing against SGLang's own KV-event code, not our model of it:
//! `tests/fixtures/sglang_publisher.py` runs SGLang 0.5.23's `ZmqEventPublisher` (built by its
//! `EventPublisherFactory` from a `--kv-events-config` JSON, as its scheduler does) and its
//! `KVCacheEventRecorder` (radix nodes to events: pages, coalescing, storage tiers,
//! namespaces), installed from PyPI (`tests/requirements-no-deps.txt`). Every case the
//! exact-routing work rests on: stored / removed / cleared with every optional field, DP ranks,
//! a lost batch replayed in 0.5.23's reply form, a late subscriber replaying every buffer,
//! silence that is not a gap, a restarted publisher, storage tiers, salted and adapter
//! namespaces, garbage on both sockets; then the whole gateway routing on them.
//!
//! The interpreter: `common::test_python` (RADIXGATE_TEST_PYTHON, else `.venv-test/`, built by
//! scripts/test.sh from the pinned requirements). Without SGLang there the tests fail: a missing
//! counterpart is a failure, never a skip.

use crate::common::{reserve_run, ReservedRun};
use crossbeam::channel::{self, Receiver};
use radixgate::kv::endpoint::TcpEndpoint;
use radixgate::kv::index::{namespace_root, MatchScratch, ROOT_PARENT};
use radixgate::kv::intake::{
    Intake, IntakeConfig, IntakeEvent, Publisher, PublisherKey, ResetReason, SourceState,
    WorkerEvents,
};
use radixgate::kv::wire::{KvEvent, Tier};
use serde_json::json;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const LIMIT: Duration = Duration::from_secs(20);
const PAGE: usize = 4;
const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

fn python() -> String {
    crate::common::test_python(&["msgspec", "zmq", "pydantic", "psutil", "sglang"])
}

/// SGLang's publisher for `ranks` DP ranks, driven over stdin; killed (by PID) on drop.
struct Sglang {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    live: TcpEndpoint,
    replay: TcpEndpoint,
    /// The live and replay port runs, held for the publisher's life: it binds them itself, and
    /// binds them again when restarted.
    _ports: (ReservedRun, ReservedRun),
}

/// Starts of SGLang's publisher before a test gives up (one whose ports were taken before it
/// bound them exits, and is started again on other ports).
const PUBLISHER_TRIES: usize = 5;

impl Sglang {
    /// One rank.
    fn start() -> Sglang {
        Sglang::with_ranks(1)
    }

    /// `ranks` ranks on the ports SGLang derives from the bases (base + rank), as a DP server,
    /// bound on loopback (fixed ports: a restarted publisher binds the same ones again).
    fn with_ranks(ranks: u32) -> Sglang {
        let n = u16::try_from(ranks).expect("a few ranks");
        let mut failures = Vec::new();
        for _ in 0..PUBLISHER_TRIES {
            let (live, replay) = (reserve_run(n), reserve_run(n));
            let cfg = format!(
                r#"{{"publisher":"zmq","endpoint":"tcp://127.0.0.1:{}","bind":true,"replay_endpoint":"tcp://127.0.0.1:{}"}}"#,
                live.base, replay.base
            );
            match Sglang::with_config(&cfg, ranks, (live, replay)) {
                Ok(sg) => return sg,
                Err(e) => failures.push(e),
            }
        }
        panic!("SGLang's publisher did not start, {PUBLISHER_TRIES} times: {failures:?}");
    }

    /// The publisher on `config`; Err when it ends (or stays silent) before saying it is ready.
    fn with_config(
        config: &str,
        ranks: u32,
        ports: (ReservedRun, ReservedRun),
    ) -> Result<Sglang, String> {
        let mut child = Command::new(python())
            .arg(format!("{ROOT}/tests/fixtures/sglang_publisher.py"))
            .args(["--config", config, "--ranks", &ranks.to_string()])
            .args(["--page-size", &PAGE.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start SGLang's publisher");
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
        let ready = match lines.recv_timeout(Duration::from_secs(60)) {
            Ok(line) => line,
            Err(e) => {
                let _ = child.kill();
                let status = child.wait();
                return Err(format!("{config}: no ready line ({e}); {status:?}"));
            }
        };
        let ports_said: Vec<u16> = ready
            .strip_prefix("ready ")
            .unwrap_or_else(|| panic!("publisher said {ready}"))
            .split(' ')
            .map(|p| p.parse().unwrap())
            .collect();
        let ep = |port| TcpEndpoint {
            host: "127.0.0.1".into(),
            port,
        };
        Ok(Sglang {
            child,
            stdin,
            lines,
            live: ep(ports_said[0]),
            replay: ep(ports_said[1]),
            _ports: ports,
        })
    }

    /// Run one command; returns what follows "ok" (the batch's sequence number, if one went out).
    fn cmd(&mut self, c: serde_json::Value) -> Option<i64> {
        writeln!(self.stdin, "{c}").unwrap();
        self.stdin.flush().unwrap();
        let line = self
            .lines
            .recv_timeout(LIMIT)
            .expect("the publisher answers");
        let rest = line
            .strip_prefix("ok")
            .unwrap_or_else(|| panic!("publisher said {line}"));
        rest.trim().parse().ok()
    }

    /// A radix node of `tokens` under `parent` stored in `medium`, published as one batch.
    fn store(
        &mut self,
        node: u32,
        parent: Option<u32>,
        tokens: &[u32],
        extra: serde_json::Value,
    ) -> i64 {
        let mut c = json!({"cmd": "store", "node": node, "parent": parent, "tokens": tokens});
        if let serde_json::Value::Object(m) = extra {
            c.as_object_mut().unwrap().extend(m);
        }
        self.cmd(c).expect("a batch went out")
    }

    fn publisher(&self, worker: u32, rank: u32) -> Publisher {
        Publisher {
            key: PublisherKey {
                worker,
                dp_rank: rank,
            },
            live: self.live.for_rank(rank).unwrap(),
            replay: Some(self.replay.for_rank(rank).unwrap()),
        }
    }
}

impl Drop for Sglang {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tokens(n: usize, start: u32) -> Vec<u32> {
    (start..start + n as u32).collect()
}

/// Intake events with state reports kept apart.
struct Events {
    rx: Receiver<IntakeEvent>,
    states: Vec<(PublisherKey, SourceState)>,
}

impl Events {
    fn next(&mut self) -> IntakeEvent {
        self.within(LIMIT)
            .expect("the intake delivers within the limit")
    }
    fn within(&mut self, wait: Duration) -> Option<IntakeEvent> {
        let until = Instant::now() + wait;
        loop {
            match self
                .rx
                .recv_timeout(until.saturating_duration_since(Instant::now()))
            {
                Ok(IntakeEvent::State { key, state }) => self.states.push((key, state)),
                Ok(e) => return Some(e),
                Err(_) => return None,
            }
        }
    }
    fn batch(&mut self) -> WorkerEvents {
        match self.next() {
            IntakeEvent::Batch(b) => b,
            other => panic!("expected a batch, got {other:?}"),
        }
    }
    /// Batches until the one numbered `seq` (earlier ones, such as probes, are skipped).
    fn batch_numbered(&mut self, seq: i64) -> WorkerEvents {
        loop {
            let b = self.batch();
            if b.seq >= seq {
                assert_eq!(b.seq, seq);
                return b;
            }
        }
    }
    fn wait_state(&mut self, key: PublisherKey, state: SourceState) {
        let until = Instant::now() + LIMIT;
        while !self
            .states
            .iter()
            .rev()
            .find(|(k, _)| *k == key)
            .is_some_and(|(_, s)| *s == state)
        {
            assert!(Instant::now() < until, "never {state:?}: {:?}", self.states);
            let _ = self
                .within(Duration::from_millis(50))
                .map(|e| panic!("unexpected {e:?}"));
        }
    }
}

fn intake() -> (Intake, Events) {
    let (tx, rx) = channel::bounded(4096);
    let intake = Intake::start(IntakeConfig::default(), tx).unwrap();
    (
        intake,
        Events {
            rx,
            states: Vec::new(),
        },
    )
}

fn key(worker: u32, rank: u32) -> PublisherKey {
    PublisherKey {
        worker,
        dp_rank: rank,
    }
}

/// Subscribe and wait until live: the subscription is in place and the start-up replay done.
fn subscribe(i: &Intake, ev: &mut Events, p: Publisher) {
    let k = p.key;
    i.subscribe(p).unwrap();
    ev.wait_state(k, SourceState::Live);
}

#[test]
fn stored_removed_cleared_with_every_optional_field_and_tier() {
    let mut sg = Sglang::start();
    let (i, mut ev) = intake();
    subscribe(&i, &mut ev, sg.publisher(1, 0));
    let t = tokens(12, 100);
    // GPU, with a salt and a session: the recorder publishes medium GPU always.
    let s = sg.store(
        1,
        None,
        &t[..8],
        json!({"salt": "tenant-a", "session": "s-1"}),
    );
    let b = ev.batch_numbered(s);
    assert_eq!(b.key, key(1, 0));
    let KvEvent::BlockStored(st) = &b.events[0] else {
        panic!("{b:?}")
    };
    assert_eq!(st.block_size, PAGE as u32);
    assert_eq!(
        st.block_hashes.len(),
        2,
        "one hash a page, coalesced into one event"
    );
    assert_eq!(st.token_ids, t[..8]);
    assert_eq!(st.tier(), Tier::Device);
    assert_eq!(st.medium.as_deref(), Some("GPU"));
    assert_eq!(st.cache_salt.as_deref(), Some("tenant-a"));
    assert_eq!(st.parent, None);
    // A child node backed up to host memory (its parent link names the salted block).
    let s = sg.store(
        2,
        Some(1),
        &t[8..],
        json!({"medium": "CPU_PINNED", "salt": "tenant-a"}),
    );
    let b = ev.batch_numbered(s);
    let KvEvent::BlockStored(child) = &b.events[0] else {
        panic!("{b:?}")
    };
    assert_eq!(child.tier(), Tier::Host);
    assert_eq!(child.parent, st.block_hashes.last().copied());
    // An adapter's node: its public name travels.
    let s = sg.store(3, None, &t[..4], json!({"lora": "sql-adapter"}));
    let b = ev.batch_numbered(s);
    let KvEvent::BlockStored(lora) = &b.events[0] else {
        panic!("{b:?}")
    };
    assert_eq!(lora.lora_name.as_deref(), Some("sql-adapter"));
    assert_ne!(
        lora.block_hashes[0], st.block_hashes[0],
        "namespaced ids differ"
    );
    // Removal from one tier, then everything cleared.
    let s = sg
        .cmd(json!({"cmd": "remove", "node": 2, "medium": "CPU_PINNED"}))
        .unwrap();
    let b = ev.batch_numbered(s);
    let KvEvent::BlockRemoved(r) = &b.events[0] else {
        panic!("{b:?}")
    };
    assert_eq!(
        (r.tier(), r.block_hashes.clone()),
        (Tier::Host, child.block_hashes.clone())
    );
    let s = sg.cmd(json!({"cmd": "clear"})).unwrap();
    assert_eq!(ev.batch_numbered(s).events, vec![KvEvent::AllBlocksCleared]);
    let c = i.counts();
    assert_eq!(
        (c.malformed, c.skipped_events, c.resets),
        (0, 0, 0),
        "{c:?}"
    );
}

#[test]
fn each_dp_rank_publishes_its_own_stream_on_port_plus_rank() {
    let mut sg = Sglang::with_ranks(2);
    let (i, mut ev) = intake();
    subscribe(&i, &mut ev, sg.publisher(4, 0));
    subscribe(&i, &mut ev, sg.publisher(4, 1));
    let s0 = sg.store(1, None, &tokens(4, 0), json!({"rank": 0}));
    let s1 = sg.store(2, None, &tokens(4, 50), json!({"rank": 1}));
    assert_eq!((s0, s1), (0, 0), "one counter per rank");
    let mut got = [ev.batch(), ev.batch()];
    got.sort_by_key(|b| b.key.dp_rank);
    for (rank, b) in got.iter().enumerate() {
        assert_eq!(b.key, key(4, rank as u32));
        assert_eq!(b.seq, 0);
    }
    assert_eq!(i.counts().resets, 0);
}

#[test]
fn a_lost_batch_is_replayed_from_sglangs_buffer_in_its_reply_form() {
    let mut sg = Sglang::start();
    let (i, mut ev) = intake();
    subscribe(&i, &mut ev, sg.publisher(1, 0));
    let before = i.counts();
    sg.cmd(json!({"cmd": "lose_next"}));
    let lost = sg.store(1, None, &tokens(8, 0), json!({}));
    let next = sg.store(2, Some(1), &tokens(4, 8), json!({}));
    let b = ev.batch();
    assert_eq!(
        (b.seq, b.replayed),
        (lost, true),
        "the lost batch, from the replay socket"
    );
    assert_eq!(ev.batch().seq, next);
    let c = i.counts();
    assert_eq!(c.gaps - before.gaps, 1);
    assert_eq!(c.resets, 0, "{c:?}");
    assert_eq!(
        c.malformed, 0,
        "0.5.23's 4-frame replies are read, not refused: {c:?}"
    );
}

#[test]
fn a_subscriber_started_late_replays_every_buffered_batch_and_silence_is_no_gap() {
    let mut sg = Sglang::start();
    let mut parent = None;
    let mut seqs = Vec::new();
    for n in 0..6u32 {
        seqs.push(sg.store(n + 1, parent, &tokens(4, n * 4), json!({})));
        parent = Some(n + 1);
    }
    let (i, mut ev) = intake();
    i.subscribe(sg.publisher(9, 0)).unwrap();
    for &s in &seqs {
        let b = ev.batch();
        assert_eq!((b.seq, b.replayed), (s, true));
    }
    ev.wait_state(key(9, 0), SourceState::Live);
    // Five quiet seconds: no replay asked, nothing reset, still live.
    let replays = i.counts().replays;
    assert!(ev.within(Duration::from_secs(5)).is_none());
    let c = i.counts();
    assert_eq!((c.replays, c.resets, c.gaps), (replays, 0, 0), "{c:?}");
    assert_eq!(ev.states.last(), Some(&(key(9, 0), SourceState::Live)));
    // The stream goes on where it was.
    let s = sg.store(7, parent, &tokens(4, 24), json!({}));
    let b = ev.batch();
    assert_eq!((b.seq, b.replayed), (s, false));
}

#[test]
fn a_restarted_publisher_resets_its_worker_once() {
    let mut sg = Sglang::start();
    let (i, mut ev) = intake();
    subscribe(&i, &mut ev, sg.publisher(2, 0));
    for n in 0..3u32 {
        let s = sg.store(n + 1, None, &tokens(4, n * 10), json!({}));
        ev.batch_numbered(s);
    }
    sg.cmd(json!({"cmd": "restart"}));
    let s = sg.store(1, None, &tokens(4, 500), json!({}));
    assert_eq!(s, 0, "a new process counts from 0");
    // The live socket reconnects; its replay proves a new process (our last batch is not in
    // its buffer): reset once, then the new stream.
    assert_eq!(
        ev.next(),
        IntakeEvent::Reset {
            key: key(2, 0),
            reason: ResetReason::Restarted
        }
    );
    assert_eq!(ev.batch().seq, 0);
    ev.wait_state(key(2, 0), SourceState::Live);
    assert_eq!(i.counts().resets, 1);
}

#[test]
fn garbage_on_either_socket_is_counted_and_costs_no_blocks() {
    let mut sg = Sglang::start();
    let (i, mut ev) = intake();
    subscribe(&i, &mut ev, sg.publisher(3, 0));
    let s = sg.store(1, None, &tokens(4, 0), json!({}));
    ev.batch_numbered(s);
    // On the live socket: a lone frame, a short sequence number, a far-ahead number the
    // publisher never sent (its buffer proves it).
    for frames in [
        json!(["00"]),
        json!(["", "00000001", "90"]),
        json!(["", "000000000000ffff", "930090c0"]),
    ] {
        sg.cmd(json!({"cmd": "garbage_live", "frames": frames, "hold": true}));
    }
    let s = sg.store(2, Some(1), &tokens(4, 4), json!({}));
    let b = ev.batch_numbered(s);
    assert!(!b.events.is_empty());
    // (The far-ahead number is judged when the replay that proves it ends, which may come
    // after the batch above was delivered from it.)
    let c = crate::common::wait_until("three messages refused", LIMIT, || {
        let c = i.counts();
        (c.malformed >= 3).then_some(c)
    });
    assert_eq!((c.malformed, c.resets), (3, 0), "{c:?}");
    // On the replay socket: answers that are not batches. The gap they were to fill cannot
    // be filled: that worker is reset, the stream goes on.
    sg.cmd(json!({"cmd": "garbage_replay", "count": 5}));
    sg.cmd(json!({"cmd": "lose_next"}));
    sg.store(3, Some(2), &tokens(4, 8), json!({}));
    let s = sg.store(4, Some(3), &tokens(4, 12), json!({}));
    assert_eq!(
        ev.next(),
        IntakeEvent::Reset {
            key: key(3, 0),
            reason: ResetReason::Gap
        }
    );
    assert_eq!(ev.batch().seq, s);
    let c = i.counts();
    assert!(c.replay_failures >= 1 && c.malformed >= 4, "{c:?}");
}

// ---- the whole gateway on SGLang's events ---------------------------------------------------

/// Two simulated workers (HTTP only) whose events come from two SGLang publishers named by
/// flags, and a gateway routing on them.
struct Fleet {
    cluster: loadtest::sim::SimCluster,
    publishers: Vec<Sglang>,
    gw: radixgate::runtime::Running,
}

impl Fleet {
    fn start(extra: &[&str]) -> Fleet {
        // The workers report the page size the publishers hash at: the only one believed.
        let cluster = crate::common::sim(2, |cfg| cfg.page_size = PAGE);
        let urls: Vec<String> = cluster
            .ports()
            .iter()
            .map(|p| format!("http://127.0.0.1:{p}"))
            .collect();
        let publishers: Vec<Sglang> = (0..2).map(|_| Sglang::start()).collect();
        let mut args = vec![
            "--kv-events".to_string(),
            "--policy".into(),
            "cache_aware".into(),
        ];
        args.push("--kv-events-endpoints".into());
        args.extend(
            urls.iter()
                .zip(&publishers)
                .map(|(u, p)| format!("{u}={}", p.live.url())),
        );
        args.push("--kv-events-replay-endpoints".into());
        args.extend(
            urls.iter()
                .zip(&publishers)
                .map(|(u, p)| format!("{u}={}", p.replay.url())),
        );
        args.extend(extra.iter().map(|s| s.to_string()));
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let gw = crate::common::gateway_with_metrics(&urls, &refs);
        let kv = gw.gateway().kv.as_ref().unwrap();
        crate::common::wait_until("both workers routed by their events", LIMIT, || {
            (kv.exact_workers().len() == 2).then_some(())
        });
        Fleet {
            cluster,
            publishers,
            gw,
        }
    }

    /// Blocks of `prompt` in namespace `root` per worker index: (on the GPU, GPU or host).
    fn held(&self, root: u64, prompt: &[u32]) -> Vec<(usize, u32, u32)> {
        let kv = self.gw.gateway().kv.as_ref().unwrap();
        let snap = kv.reader.load();
        let mut scratch = MatchScratch::default();
        let ids = self.gw.gateway().registry.load();
        let mut v: Vec<(usize, u32, u32)> = snap
            .match_prefix(MODEL, root, prompt, &mut scratch)
            .iter()
            .map(|m| {
                let url = &ids
                    .workers
                    .iter()
                    .find(|w| w.id == m.source.worker)
                    .unwrap()
                    .url;
                let port: u16 = url.rsplit(':').next().unwrap().parse().unwrap();
                let i = self
                    .cluster
                    .ports()
                    .iter()
                    .position(|&p| p == port)
                    .unwrap();
                (i, m.blocks, m.with_host)
            })
            .collect();
        v.sort_unstable();
        v
    }

    fn wait_held(&self, root: u64, prompt: &[u32], want: &[(usize, u32, u32)]) {
        crate::common::wait_until("the index holds what was published", LIMIT, || {
            (self.held(root, prompt) == want).then_some(())
        });
    }

    /// The worker index a `/generate` of `ids` (with extra body fields) is routed to.
    fn route(&self, ids: &[u32], extra: serde_json::Value) -> usize {
        let mut body = json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}});
        if let serde_json::Value::Object(m) = extra {
            body.as_object_mut().unwrap().extend(m);
        }
        let r = crate::common::generate(self.gw.addr, &serde_json::to_vec(&body).unwrap());
        assert_eq!(r.status, 200, "{}", r.text());
        let port = crate::common::served_by(&r);
        self.cluster
            .ports()
            .iter()
            .position(|&p| p == port)
            .unwrap()
    }
}

#[test]
fn salted_and_adapter_blocks_match_only_their_namespace() {
    let mut f = Fleet::start(&[]);
    let prompt = tokens(64, 1000);
    // Worker 0 holds the prompt under salt "tenant-a", worker 1 the same tokens unsalted.
    f.publishers[0].store(1, None, &prompt, json!({"salt": "tenant-a"}));
    f.publishers[1].store(1, None, &prompt, json!({}));
    let salted = namespace_root(Some("tenant-a"), None);
    f.wait_held(salted, &prompt, &[(0, 16, 16)]);
    f.wait_held(ROOT_PARENT, &prompt, &[(1, 16, 16)]);
    let mut ask = prompt.clone();
    ask.extend([7, 7, 7]);
    for _ in 0..4 {
        assert_eq!(f.route(&ask, json!({"cache_salt": "tenant-a"})), 0);
        assert_eq!(f.route(&ask, json!({})), 1);
    }
    // An adapter's blocks, on worker 1: named by lora_path or by model "base:adapter".
    let other = tokens(64, 5000);
    f.publishers[1].store(2, None, &other, json!({"lora": "sql"}));
    f.wait_held(namespace_root(None, Some("sql")), &other, &[(1, 16, 16)]);
    for _ in 0..4 {
        assert_eq!(f.route(&other, json!({"lora_path": "sql"})), 1);
        assert_eq!(f.route(&other, json!({"model": format!("{MODEL}:sql")})), 1);
    }
    assert_eq!(
        f.held(ROOT_PARENT, &other),
        vec![],
        "base requests see none of it"
    );
}

#[test]
fn host_tier_copies_count_below_gpu_copies_and_removals_touch_one_tier() {
    let mut f = Fleet::start(&[]);
    let prompt = tokens(64, 2000);
    // Worker 0: on the GPU and backed up to host; worker 1: in host memory only.
    f.publishers[0].store(1, None, &prompt, json!({}));
    f.publishers[0].store(1, None, &prompt, json!({"medium": "CPU_PINNED"}));
    f.publishers[1].store(1, None, &prompt, json!({"medium": "CPU_PINNED"}));
    f.wait_held(ROOT_PARENT, &prompt, &[(0, 16, 16), (1, 0, 16)]);
    for _ in 0..4 {
        assert_eq!(f.route(&prompt, json!({})), 0, "a GPU hit beats a host hit");
    }
    // Worker 0's host copy freed: its GPU copy stays.
    f.publishers[0].cmd(json!({"cmd": "remove", "node": 1, "medium": "CPU_PINNED"}));
    f.wait_held(ROOT_PARENT, &prompt, &[(0, 16, 16), (1, 0, 16)]);
    // Worker 0's GPU evicts it: gone from worker 0; worker 1's host copy still wins over a
    // miss (weight 0.8 is over the 0.3 threshold).
    f.publishers[0].cmd(json!({"cmd": "remove", "node": 1, "medium": "GPU"}));
    f.wait_held(ROOT_PARENT, &prompt, &[(1, 0, 16)]);
    for _ in 0..4 {
        assert_eq!(f.route(&prompt, json!({})), 1);
    }
}

#[test]
fn a_publisher_whose_batches_arrive_late_is_scored_by_the_text_tree_until_it_catches_up() {
    let mut f = Fleet::start(&["--kv-max-staleness-ms", "8000"]);
    let metrics = f.gw.metrics_addr.expect("metrics listener");
    let kv = f.gw.gateway().kv.as_ref().unwrap();
    // On time: its delay is the floor.
    f.publishers[0].store(1, None, &tokens(2 * PAGE, 1), json!({}));
    f.publishers[1].store(1, None, &tokens(2 * PAGE, 1), json!({}));
    // Thirty seconds late (it waited behind a consumer that could not keep up): lagging, its
    // worker scored by the text tree, said in the metrics; its blocks are still applied.
    f.publishers[0].store(2, None, &tokens(2 * PAGE, 500), json!({"late": 30.0}));
    crate::common::wait_until("worker 0 lagging", LIMIT, || {
        (kv.intake().lagging() == 1 && kv.exact_workers().len() == 1).then_some(())
    });
    // The per-publisher figures are republished a few times a second.
    let text = crate::common::wait_until("its staleness in /metrics", LIMIT, || {
        let r = crate::common::request(metrics, "GET", "/metrics", &[], b"").unwrap();
        let text = r.text();
        text.lines()
            .filter(|l| l.starts_with("radixgate_kv_source_staleness_seconds{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .any(|s| s > 29.0)
            .then_some(text)
    });
    assert!(text.contains("radixgate_kv_lagging_publishers 1"), "{text}");
    let lagging: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("radixgate_kv_source_state{") && l.ends_with(" 1"))
        .filter(|l| l.contains("state=\"lagging\""))
        .collect();
    assert_eq!(lagging.len(), 1, "{text}");
    assert_eq!(f.held(ROOT_PARENT, &tokens(2 * PAGE, 500)), vec![(0, 2, 2)]);
    // On time again: caught up, routed by its events.
    f.publishers[0].store(3, None, &tokens(2 * PAGE, 900), json!({}));
    crate::common::wait_until("worker 0 caught up", LIMIT, || {
        (kv.intake().lagging() == 0 && kv.exact_workers().len() == 2).then_some(())
    });
}

#[test]
fn a_gateway_started_after_the_servers_is_warm_and_stays_ready_through_silence_and_restarts() {
    // The servers cache before the gateway exists.
    let cluster = crate::common::sim(1, |cfg| cfg.page_size = PAGE);
    let url = format!("http://127.0.0.1:{}", cluster.ports()[0]);
    let mut sg = Sglang::start();
    let prompt = tokens(64, 3000);
    sg.store(1, None, &prompt, json!({}));
    let live = format!("{url}={}", sg.live.url());
    let replay = format!("{url}={}", sg.replay.url());
    let gw = crate::common::gateway_for(
        std::slice::from_ref(&url),
        &[
            "--kv-events",
            "--kv-events-endpoints",
            &live,
            "--kv-events-replay-endpoints",
            &replay,
        ],
    );
    let kv = gw.gateway().kv.as_ref().unwrap();
    let held = || {
        let snap = kv.reader.load();
        let mut s = MatchScratch::default();
        snap.match_prefix(MODEL, ROOT_PARENT, &prompt, &mut s)
            .first()
            .map_or(0, |m| m.blocks)
    };
    crate::common::wait_until("the buffered prompt replayed", LIMIT, || {
        (held() == 16).then_some(())
    });
    let ready = || {
        crate::common::request(gw.addr, "GET", "/readiness", &[], b"")
            .map(|r| r.status)
            .unwrap_or(0)
    };
    // Five quiet seconds: every block kept, ready all along.
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        assert_eq!((ready(), held()), (200, 16));
        std::thread::sleep(Duration::from_millis(250));
    }
    assert_eq!(kv.intake_counts().resets, 0);
    // The server restarts: its blocks go, the copy stays ready, and the new process's stream
    // is followed.
    sg.cmd(json!({"cmd": "restart"}));
    let fresh = tokens(32, 9000);
    let seen = |p: &[u32]| {
        let snap = kv.reader.load();
        let mut s = MatchScratch::default();
        snap.match_prefix(MODEL, ROOT_PARENT, p, &mut s)
            .first()
            .map_or(0, |m| m.blocks)
    };
    let start = Instant::now();
    let mut node = 10;
    while seen(&fresh) == 0 {
        assert!(
            start.elapsed() < LIMIT,
            "the new process's events never arrived"
        );
        assert_eq!(ready(), 200);
        node += 1;
        sg.store(node, None, &fresh, json!({}));
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(held(), 0, "the old process's blocks are gone");
    assert_eq!(ready(), 200);
}
