//! Exact routing against vLLM's own KV-event code, not our model of it:
//! `tests/fixtures/vllm_publisher.py` runs vLLM 0.33.0's `ZmqEventPublisher` (built by its
//! `EventPublisherFactory` from a real `KVEventsConfig`, one per DP rank) and its `BlockPool`
//! (prefills, evictions and prefix-cache resets turned into events, with vLLM's own block
//! hashing), loaded by path from the files scripts/test.sh keeps from the pinned wheel. Every
//! case: stores with hashes above 2^63 and as 32-byte digests, a branch naming its parent,
//! removals by hash alone, clears, a lost batch fetched from vLLM's replay socket, a DP rank on
//! base + 1, garbage, a restarted publisher, LoRA and salted blocks, a flood against the index's
//! per-source cap; then the whole gateway routing on them, started before or after the servers.
//!
//! The interpreter: `common::test_python`; vLLM's files: `common::test_vllm_dir`. Without
//! either the tests fail: a missing counterpart is a failure, never a skip.

use crate::common::fake_vllm::FakeVllm;
use crate::common::{reserve_run, ReservedRun};
use crossbeam::channel::{self, Receiver};
use radixgate::kv::endpoint::TcpEndpoint;
use radixgate::kv::index::{namespace_root, IndexConfig, IndexWriter, MatchScratch, ROOT_PARENT};
use radixgate::kv::intake::{
    Intake, IntakeConfig, IntakeEvent, Publisher, PublisherKey, ResetReason, SourceState,
    WorkerEvents,
};
use radixgate::kv::wire::{BlockStored, EngineHash, KvEvent, Tier};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const LIMIT: Duration = Duration::from_secs(20);
/// vLLM's block size in these tests (the simulated workers report the same page size).
const BLOCK: usize = 4;
const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

fn python() -> String {
    crate::common::test_python(&["msgspec", "zmq", "pydantic", "psutil", "cbor2", "urllib3"])
}

/// How a publisher writes block hashes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`).
#[derive(Clone, Copy, PartialEq, Debug)]
enum HashForm {
    /// 64-bit unsigned ints (vLLM's default).
    Int,
    /// 32-byte SHA-256 digests.
    Bytes,
}

/// What the fixture says a batch carried.
#[derive(Debug)]
struct Sent {
    seq: i64,
    /// One list per BlockStored, as the engine hashes radixgate must decode them to.
    stored: Vec<Vec<EngineHash>>,
    parents: Vec<Option<EngineHash>>,
    removed: Vec<EngineHash>,
    cleared: u64,
}

/// A hash as the fixture names it (an int, or a 32-byte digest's hex) turned into what the
/// decoder must make of it, by [`EngineHash`]'s documented rule.
fn engine_hash(v: &Value) -> EngineHash {
    match v {
        Value::Number(n) => EngineHash(n.as_u64().expect("a u64 hash")),
        Value::String(hex) => {
            assert_eq!(hex.len(), 64, "vLLM's byte hashes are 32-byte digests");
            let bytes: Vec<u8> = (0..32)
                .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
                .collect();
            EngineHash::from_bytes(&bytes)
        }
        other => panic!("a hash: {other}"),
    }
}

/// vLLM's publisher for `ranks` DP ranks, driven over stdin; killed (by PID) on drop.
struct Vllm {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    live: TcpEndpoint,
    replay: TcpEndpoint,
    /// The live and replay port runs, held for the publisher's life: it binds them itself, and
    /// binds them again when restarted.
    _ports: (ReservedRun, ReservedRun),
}

/// Starts of vLLM's publisher before a test gives up (one whose ports were taken before it
/// bound them exits, and is started again on other ports).
const PUBLISHER_TRIES: usize = 5;

impl Vllm {
    fn start() -> Vllm {
        Vllm::with(1, HashForm::Int, 4096)
    }

    /// `ranks` ranks on the ports vLLM derives from the bases (base + rank), bound on every
    /// interface: vLLM binds only an endpoint with `*` (its default `tcp://*:5557`) and
    /// connects to any other, so `tcp://*:PORT` it is. `blocks`: GPU blocks per rank.
    fn with(ranks: u32, form: HashForm, blocks: usize) -> Vllm {
        let n = u16::try_from(ranks).expect("a few ranks");
        let mut failures = Vec::new();
        for _ in 0..PUBLISHER_TRIES {
            let (live, replay) = (reserve_run(n), reserve_run(n));
            let cfg = json!({
                "enable_kv_cache_events": true,
                "publisher": "zmq",
                "endpoint": format!("tcp://*:{}", live.base),
                "replay_endpoint": format!("tcp://*:{}", replay.base),
                "topic": "kv-events",
            })
            .to_string();
            match Vllm::with_config(&cfg, ranks, form, blocks, (live, replay)) {
                Ok(v) => return v,
                Err(e) => failures.push(e),
            }
        }
        panic!("vLLM's publisher did not start, {PUBLISHER_TRIES} times: {failures:?}");
    }

    fn with_config(
        config: &str,
        ranks: u32,
        form: HashForm,
        blocks: usize,
        ports: (ReservedRun, ReservedRun),
    ) -> Result<Vllm, String> {
        let form = match form {
            HashForm::Int => "int",
            HashForm::Bytes => "bytes",
        };
        let mut child = Command::new(python())
            .arg(format!("{ROOT}/tests/fixtures/vllm_publisher.py"))
            .env("RADIXGATE_TEST_VLLM_DIR", crate::common::test_vllm_dir())
            .args(["--config", config, "--ranks", &ranks.to_string()])
            .args(["--block-size", &BLOCK.to_string()])
            .args(["--num-blocks", &blocks.to_string(), "--hash-form", form])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start vLLM's publisher");
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
        Ok(Vllm {
            child,
            stdin,
            lines,
            live: ep(ports_said[0]),
            replay: ep(ports_said[1]),
            _ports: ports,
        })
    }

    /// Run one command; returns what follows "ok".
    fn raw(&mut self, c: Value) -> String {
        writeln!(self.stdin, "{c}").unwrap();
        self.stdin.flush().unwrap();
        let line = self
            .lines
            .recv_timeout(LIMIT)
            .expect("the publisher answers");
        line.strip_prefix("ok")
            .unwrap_or_else(|| panic!("publisher said {line} to {c}"))
            .trim()
            .to_string()
    }

    /// Run a command that publishes a batch; what it carried.
    fn cmd(&mut self, c: Value) -> Sent {
        let rest = self.raw(c);
        let (seq, summary) = rest.split_once(' ').expect("a batch went out");
        let v: Value = serde_json::from_str(summary).unwrap();
        Sent {
            seq: seq.parse().unwrap(),
            stored: v["stored"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e.as_array().unwrap().iter().map(engine_hash).collect())
                .collect(),
            parents: v["parents"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| (!p.is_null()).then(|| engine_hash(p)))
                .collect(),
            removed: v["removed"]
                .as_array()
                .unwrap()
                .iter()
                .map(engine_hash)
                .collect(),
            cleared: v["cleared"].as_u64().unwrap(),
        }
    }

    /// A prefill of `tokens` (with extra fields: rank, lora, salt), published as one batch.
    fn store(&mut self, tokens: &[u32], extra: Value) -> Sent {
        let mut c = json!({"cmd": "store", "tokens": tokens});
        if let Value::Object(m) = extra {
            c.as_object_mut().unwrap().extend(m);
        }
        self.cmd(c)
    }

    /// A command without a batch (lose_next, garbage_replay, restart, ...).
    fn control(&mut self, c: Value) {
        assert_eq!(self.raw(c), "");
    }

    fn publisher(&self, worker: u32, rank: u32) -> Publisher {
        Publisher {
            key: key(worker, rank),
            live: self.live.for_rank(rank).unwrap(),
            replay: Some(self.replay.for_rank(rank).unwrap()),
        }
    }
}

impl Drop for Vllm {
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
    /// Batches until the one numbered `seq` (earlier ones are skipped).
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

/// The one BlockStored of a batch.
fn stored(b: &WorkerEvents) -> &BlockStored {
    match b.events.as_slice() {
        [KvEvent::BlockStored(st)] => st,
        other => panic!("expected one BlockStored, got {other:?}"),
    }
}

/// The hashes of a batch's BlockRemoved events, in order.
fn removed(b: &WorkerEvents) -> Vec<EngineHash> {
    b.events
        .iter()
        .flat_map(|e| match e {
            KvEvent::BlockRemoved(r) => {
                assert_eq!(r.tier(), Tier::Device, "{r:?}");
                r.block_hashes.clone()
            }
            other => panic!("expected removals only, got {other:?}"),
        })
        .collect()
}

/// Nothing refused, skipped or reset.
fn clean(i: &Intake) {
    let c = i.counts();
    assert_eq!(
        (c.malformed, c.skipped_events, c.resets),
        (0, 0, 0),
        "{c:?}"
    );
}

#[test]
fn stores_decode_vllms_int_hashes_above_2_pow_63_exactly() {
    let mut v = Vllm::start();
    let (i, mut ev) = intake();
    subscribe(&i, &mut ev, v.publisher(1, 0));
    let t = tokens(64, 100);
    let sent = v.store(&t, json!({}));
    let b = ev.batch_numbered(sent.seq);
    assert_eq!(b.key, key(1, 0));
    let st = stored(&b);
    assert_eq!(
        st.block_hashes, sent.stored[0],
        "vLLM's own hashes, bit for bit"
    );
    assert_eq!(st.block_hashes.len(), 16, "one hash a block");
    assert!(
        st.block_hashes.iter().any(|h| h.0 > 1 << 63),
        "SHA-256 truncated to 64 bits: about half are above 2^63 {:?}",
        st.block_hashes
    );
    assert_eq!(st.token_ids, t);
    assert_eq!(st.block_size, BLOCK as u32);
    assert_eq!(
        (st.tier(), st.medium.as_deref()),
        (Tier::Device, Some("GPU"))
    );
    assert_eq!(st.parent, None, "a first prefill hangs from no block");
    assert_eq!(
        (st.lora_name.as_deref(), st.cache_salt.as_deref()),
        (None, None)
    );
    // The edges of the unsigned range, in vLLM's own BlockStored class.
    let edges = [u64::MAX, 1 << 63, (1 << 63) - 1, 0];
    let sent = v.cmd(json!({
        "cmd": "raw_store", "block_hashes": edges[..2], "parent": edges[2],
        "token_ids": tokens(8, 0),
    }));
    let st = ev.batch_numbered(sent.seq);
    let st = stored(&st);
    assert_eq!(
        st.block_hashes,
        vec![EngineHash(edges[0]), EngineHash(edges[1])]
    );
    assert_eq!(st.parent, Some(EngineHash(edges[2])));
    let sent = v.cmd(json!({
        "cmd": "raw_store", "block_hashes": [edges[3]], "parent": null, "token_ids": tokens(4, 0),
    }));
    assert_eq!(
        stored(&ev.batch_numbered(sent.seq)).block_hashes,
        vec![EngineHash(0)]
    );
    clean(&i);
}

#[test]
fn stores_branches_and_removals_decode_vllms_32_byte_hashes() {
    let mut v = Vllm::with(1, HashForm::Bytes, 4096);
    let (i, mut ev) = intake();
    subscribe(&i, &mut ev, v.publisher(1, 0));
    let a = tokens(16, 500);
    let sent = v.store(&a, json!({}));
    let b = ev.batch_numbered(sent.seq);
    let st = stored(&b);
    assert_eq!(st.block_hashes, sent.stored[0]);
    assert_eq!(st.block_hashes.len(), 4);
    // A branch after two shared blocks names the second as its parent, as 32 bytes too.
    let mut branch = a[..8].to_vec();
    branch.extend(tokens(8, 9000));
    let sent = v.store(&branch, json!({}));
    let br = ev.batch_numbered(sent.seq);
    let br = stored(&br);
    assert_eq!(br.parent, Some(st.block_hashes[1]));
    assert_eq!(br.parent, sent.parents[0]);
    assert_eq!(br.block_hashes, sent.stored[0]);
    // The first prompt's last block evicted: removed by its 32-byte hash alone.
    let sent = v.cmd(json!({"cmd": "remove", "tokens": a, "last": 1}));
    assert_eq!(
        removed(&ev.batch_numbered(sent.seq)),
        vec![st.block_hashes[3]]
    );
    clean(&i);
}

#[test]
fn a_branch_names_its_parent_removals_name_hashes_alone_and_a_reset_clears() {
    let mut v = Vllm::start();
    let (i, mut ev) = intake();
    subscribe(&i, &mut ev, v.publisher(2, 0));
    let a = tokens(24, 1000);
    let first = stored(&ev.batch_numbered(v.store(&a, json!({})).seq)).clone();
    assert_eq!(first.block_hashes.len(), 6);
    // Two branches off the same prefix: only their own blocks, each under the block it
    // continues.
    for (shared, fresh) in [(4usize, 2000u32), (2, 3000)] {
        let mut p = a[..shared * BLOCK].to_vec();
        p.extend(tokens(8, fresh));
        let sent = v.store(&p, json!({}));
        let b = ev.batch_numbered(sent.seq);
        let st = stored(&b);
        assert_eq!(st.parent, Some(first.block_hashes[shared - 1]));
        assert_eq!(st.token_ids, p[shared * BLOCK..]);
        assert_eq!(st.block_hashes, sent.stored[0]);
    }
    // The same prompt again stores nothing (vLLM's cache hit): no event at all.
    let sent = v.store(&a, json!({}));
    assert!(ev.batch_numbered(sent.seq).events.is_empty());
    // Evicting the first prompt's last three blocks: one BlockRemoved per block, hash only.
    let sent = v.cmd(json!({"cmd": "remove", "tokens": a, "last": 3}));
    let mut gone = removed(&ev.batch_numbered(sent.seq));
    gone.sort();
    let mut want = first.block_hashes[3..].to_vec();
    want.sort();
    assert_eq!(gone, want);
    assert_eq!(gone, {
        let mut s = sent.removed.clone();
        s.sort();
        s
    });
    // /reset_prefix_cache: AllBlocksCleared.
    let sent = v.cmd(json!({"cmd": "clear"}));
    assert_eq!(sent.cleared, 1);
    assert_eq!(
        ev.batch_numbered(sent.seq).events,
        vec![KvEvent::AllBlocksCleared]
    );
    clean(&i);
}

#[test]
fn each_dp_rank_publishes_on_base_plus_rank_as_kv_event_sources_says() {
    let mut v = Vllm::with(2, HashForm::Int, 4096);
    // What vLLM's GET /kv_event_sources serves for this server: rank 1 on base + 1.
    let sources: Value = serde_json::from_str(&v.raw(json!({"cmd": "sources"}))).unwrap();
    for rank in 0..2u32 {
        let cfg = &sources[rank.to_string()];
        assert_eq!(
            cfg["endpoint"],
            json!(format!("tcp://*:{}", v.live.port + rank as u16))
        );
        assert_eq!(
            cfg["replay_endpoint"],
            json!(format!("tcp://*:{}", v.replay.port + rank as u16))
        );
        assert_eq!(
            (&cfg["publisher"], &cfg["topic"]),
            (&json!("zmq"), &json!("kv-events"))
        );
    }
    let (i, mut ev) = intake();
    subscribe(&i, &mut ev, v.publisher(4, 0));
    subscribe(&i, &mut ev, v.publisher(4, 1));
    let s0 = v.store(&tokens(4, 0), json!({"rank": 0}));
    let s1 = v.store(&tokens(4, 50), json!({"rank": 1}));
    assert_eq!((s0.seq, s1.seq), (0, 0), "one counter per rank");
    let mut got = [ev.batch(), ev.batch()];
    got.sort_by_key(|b| b.key.dp_rank);
    for (rank, (b, sent)) in got.iter().zip([&s0, &s1]).enumerate() {
        assert_eq!(b.key, key(4, rank as u32));
        assert_eq!(b.seq, 0);
        assert_eq!(stored(b).block_hashes, sent.stored[0]);
    }
    clean(&i);
}

#[test]
fn a_lost_batch_is_fetched_from_vllms_replay_socket() {
    let mut v = Vllm::start();
    let (i, mut ev) = intake();
    subscribe(&i, &mut ev, v.publisher(1, 0));
    let before = i.counts();
    v.control(json!({"cmd": "lose_next"}));
    let lost = v.store(&tokens(8, 0), json!({}));
    let next = v.store(&tokens(12, 0), json!({}));
    let b = ev.batch();
    assert_eq!(
        (b.seq, b.replayed),
        (lost.seq, true),
        "the lost batch, from the replay socket"
    );
    assert_eq!(stored(&b).block_hashes, lost.stored[0]);
    // The next one follows (from whichever socket delivered it first), and names the lost
    // batch's last block as its parent.
    let b = ev.batch();
    assert_eq!(b.seq, next.seq);
    assert_eq!(stored(&b).parent, lost.stored[0].last().copied());
    let c = i.counts();
    assert_eq!(c.gaps - before.gaps, 1);
    assert_eq!((c.resets, c.malformed), (0, 0), "{c:?}");
}

#[test]
fn a_restarted_publisher_resets_its_worker_once() {
    let mut v = Vllm::start();
    let (i, mut ev) = intake();
    subscribe(&i, &mut ev, v.publisher(2, 0));
    for n in 0..3u32 {
        let s = v.store(&tokens(4, n * 10), json!({}));
        ev.batch_numbered(s.seq);
    }
    v.control(json!({"cmd": "restart"}));
    let s = v.store(&tokens(4, 500), json!({}));
    assert_eq!(s.seq, 0, "a new process counts from 0");
    // The live socket reconnects; its replay proves a new process (our last batch is not in
    // its buffer): reset once, then the new stream.
    assert_eq!(
        ev.next(),
        IntakeEvent::Reset {
            key: key(2, 0),
            reason: ResetReason::Restarted
        }
    );
    let b = ev.batch();
    assert_eq!(b.seq, 0);
    assert_eq!(stored(&b).block_hashes, s.stored[0]);
    ev.wait_state(key(2, 0), SourceState::Live);
    assert_eq!(i.counts().resets, 1);
}

#[test]
fn garbage_on_the_live_socket_is_counted_without_a_reset() {
    let mut v = Vllm::start();
    let (i, mut ev) = intake();
    subscribe(&i, &mut ev, v.publisher(3, 0));
    let s = v.store(&tokens(4, 0), json!({}));
    ev.batch_numbered(s.seq);
    // A lone frame, a short sequence number, a far-ahead number vLLM never sent (its buffer
    // proves it), each before a real batch.
    for frames in [
        json!(["00"]),
        json!(["", "00000001", "90"]),
        json!(["", "000000000000ffff", "930090c0"]),
    ] {
        v.cmd(json!({"cmd": "garbage_live", "frames": frames, "hold": true}));
    }
    let s = v.store(&tokens(8, 0), json!({}));
    let b = ev.batch_numbered(s.seq);
    assert_eq!(stored(&b).block_hashes, s.stored[0]);
    let c = crate::common::wait_until("three messages refused", LIMIT, || {
        let c = i.counts();
        (c.malformed >= 3).then_some(c)
    });
    assert_eq!((c.malformed, c.resets), (3, 0), "{c:?}");
    // Garbage answering a replay: the gap it was to fill cannot be filled, so that worker is
    // reset (the one reset here), and the stream goes on.
    v.control(json!({"cmd": "garbage_replay", "count": 5}));
    v.control(json!({"cmd": "lose_next"}));
    v.store(&tokens(12, 0), json!({}));
    let s = v.store(&tokens(16, 0), json!({}));
    assert_eq!(
        ev.next(),
        IntakeEvent::Reset {
            key: key(3, 0),
            reason: ResetReason::Gap
        }
    );
    assert_eq!(ev.batch().seq, s.seq);
    let c = i.counts();
    assert!(c.replay_failures >= 1 && c.malformed >= 4, "{c:?}");
}

#[test]
fn lora_blocks_carry_their_adapter_name_and_their_own_hashes() {
    let mut v = Vllm::start();
    let (i, mut ev) = intake();
    subscribe(&i, &mut ev, v.publisher(1, 0));
    let t = tokens(16, 700);
    let base = stored(&ev.batch_numbered(v.store(&t, json!({})).seq)).clone();
    let sent = v.store(&t, json!({"lora": "sql"}));
    let b = ev.batch_numbered(sent.seq);
    let lora = stored(&b);
    assert_eq!(lora.lora_name.as_deref(), Some("sql"));
    assert_eq!(lora.block_hashes, sent.stored[0]);
    assert_ne!(
        lora.block_hashes[0], base.block_hashes[0],
        "vLLM hashes the adapter in"
    );
    clean(&i);
}

#[test]
fn a_salt_in_vllms_extra_keys_names_the_blocks_namespace() {
    let mut v = Vllm::start();
    let (i, mut ev) = intake();
    subscribe(&i, &mut ev, v.publisher(1, 0));
    let t = tokens(16, 700);
    let base = stored(&ev.batch_numbered(v.store(&t, json!({})).seq)).clone();
    // vLLM's salt is no field of its own: `generate_block_hash_extra_keys` puts it in the
    // first block's extra keys (published untagged by `to_event_extra_keys`, after the LoRA
    // name if any). Blocks hashed with it are reused only by requests with the same salt, so
    // they belong to its namespace.
    for (extra, lora) in [
        (json!({"salt": "tenant-a"}), None),
        (json!({"salt": "tenant-a", "lora": "sql"}), Some("sql")),
    ] {
        let sent = v.store(&t, extra);
        let b = ev.batch_numbered(sent.seq);
        let salted = stored(&b);
        assert_ne!(salted.block_hashes[0], base.block_hashes[0]);
        assert_eq!(salted.lora_name.as_deref(), lora);
        assert_eq!(
            salted.cache_salt.as_deref(),
            Some("tenant-a"),
            "the salt in vLLM's extra_keys is read: {salted:?}"
        );
    }
    clean(&i);
}

/// The map from a source's engine hashes to the index's blocks is bounded: a vLLM server
/// storing far more blocks than the per-source cap (and never removing one) leaves the index
/// holding at most the cap, the oldest evicted and counted, the newest still matched, and a
/// removal of an evicted hash counted as unknown rather than remembered.
#[test]
fn a_flood_of_vllm_blocks_is_bounded_by_the_per_source_cap() {
    const CAP: usize = 2048;
    const PROMPTS: usize = 24;
    const PROMPT_BLOCKS: usize = 512;
    let mut v = Vllm::with(1, HashForm::Int, PROMPTS * PROMPT_BLOCKS + 16);
    let (i, mut ev) = intake();
    subscribe(&i, &mut ev, v.publisher(7, 0));
    let mut w = IndexWriter::new(IndexConfig {
        max_blocks_per_source: CAP,
        ..IndexConfig::default()
    });
    let stats = w.stats();
    let source = key(7, 0);
    let apply = |b: &WorkerEvents, w: &mut IndexWriter| {
        for e in &b.events {
            w.apply(MODEL, b.key, e).expect("applied");
        }
        w.publish();
    };
    let mut prompts = Vec::new();
    let mut first = None;
    for n in 0..PROMPTS {
        let p = tokens(PROMPT_BLOCKS * BLOCK, 1_000_000 * (n as u32 + 1));
        let sent = v.store(&p, json!({}));
        let b = ev.batch_numbered(sent.seq);
        assert_eq!(stored(&b).block_hashes.len(), PROMPT_BLOCKS);
        first.get_or_insert_with(|| stored(&b).block_hashes.clone());
        apply(&b, &mut w);
        assert!(w.held_by(source) <= CAP, "{} held", w.held_by(source));
        prompts.push(p);
    }
    let total = (PROMPTS * PROMPT_BLOCKS) as u64;
    assert_eq!(stats.blocks_stored(), total);
    assert_eq!(w.held_by(source), CAP);
    assert_eq!(
        stats.evicted(),
        total - CAP as u64,
        "every block over the cap evicted"
    );
    let snap = w.reader().load();
    let mut s = MatchScratch::default();
    let newest = snap.match_prefix(MODEL, ROOT_PARENT, prompts.last().unwrap(), &mut s);
    assert_eq!(newest.first().map(|m| m.blocks), Some(PROMPT_BLOCKS as u32));
    assert!(
        snap.match_prefix(MODEL, ROOT_PARENT, &prompts[0], &mut s)
            .is_empty(),
        "the oldest prompt was evicted"
    );
    // vLLM evicts the first prompt's blocks: the index no longer knows their hashes.
    let sent = v.cmd(json!({"cmd": "remove", "tokens": prompts[0]}));
    let b = ev.batch_numbered(sent.seq);
    let mut gone = removed(&b);
    gone.sort();
    let mut want = first.unwrap();
    want.sort();
    assert_eq!(gone, want);
    let unknown = stats.removed_unknown();
    apply(&b, &mut w);
    assert_eq!(stats.removed_unknown() - unknown, PROMPT_BLOCKS as u64);
    assert_eq!(w.held_by(source), CAP);
    clean(&i);
}

// ---- the whole gateway on vLLM's events -----------------------------------------------------

/// Two simulated workers (HTTP only) whose events come from two vLLM publishers named by
/// flags, and a gateway routing on them.
struct Fleet {
    cluster: loadtest::sim::SimCluster,
    publishers: Vec<Vllm>,
    gw: radixgate::runtime::Running,
}

impl Fleet {
    fn start(ranks: u32, form: HashForm) -> Fleet {
        // The workers report the block size the publishers hash at: the only one believed.
        let cluster = crate::common::sim(2, |cfg| {
            cfg.page_size = BLOCK;
            cfg.dp_size = ranks as usize;
        });
        let urls: Vec<String> = cluster
            .ports()
            .iter()
            .map(|p| format!("http://127.0.0.1:{p}"))
            .collect();
        let publishers: Vec<Vllm> = (0..2).map(|_| Vllm::with(ranks, form, 4096)).collect();
        let args = flags(&urls, &publishers, &["--policy", "cache_aware"]);
        let gw =
            crate::common::gateway_for(&urls, &args.iter().map(String::as_str).collect::<Vec<_>>());
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

    /// (worker index, rank, blocks on the GPU) of every source holding `prompt` in `root`.
    fn held(&self, root: u64, prompt: &[u32]) -> Vec<(usize, u32, u32)> {
        held(&self.gw, &self.cluster, root, prompt)
    }

    fn wait_held(&self, root: u64, prompt: &[u32], want: &[(usize, u32, u32)]) {
        crate::common::wait_until("the index holds what was published", LIMIT, || {
            (self.held(root, prompt) == want).then_some(())
        });
    }

    /// The worker index a `/generate` of `ids` (with extra body fields) is routed to.
    fn route(&self, ids: &[u32], extra: Value) -> usize {
        route(&self.gw, &self.cluster, ids, extra)
    }
}

/// The gateway's flags for `publishers`, one a worker of `urls`.
fn flags(urls: &[String], publishers: &[Vllm], extra: &[&str]) -> Vec<String> {
    let mut args = vec!["--kv-events".to_string(), "--kv-events-endpoints".into()];
    args.extend(
        urls.iter()
            .zip(publishers)
            .map(|(u, p)| format!("{u}={}", p.live.url())),
    );
    args.push("--kv-events-replay-endpoints".into());
    args.extend(
        urls.iter()
            .zip(publishers)
            .map(|(u, p)| format!("{u}={}", p.replay.url())),
    );
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn held(
    gw: &radixgate::runtime::Running,
    cluster: &loadtest::sim::SimCluster,
    root: u64,
    prompt: &[u32],
) -> Vec<(usize, u32, u32)> {
    let kv = gw.gateway().kv.as_ref().unwrap();
    let snap = kv.reader.load();
    let mut scratch = MatchScratch::default();
    let ids = gw.gateway().registry.load();
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
            let i = cluster.ports().iter().position(|&p| p == port).unwrap();
            (i, m.source.dp_rank, m.blocks)
        })
        .collect();
    v.sort_unstable();
    v
}

fn route(
    gw: &radixgate::runtime::Running,
    cluster: &loadtest::sim::SimCluster,
    ids: &[u32],
    extra: Value,
) -> usize {
    let mut body = json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}});
    if let Value::Object(m) = extra {
        body.as_object_mut().unwrap().extend(m);
    }
    let r = crate::common::generate(gw.addr, &serde_json::to_vec(&body).unwrap());
    assert_eq!(r.status, 200, "{}", r.text());
    let port = crate::common::served_by(&r);
    cluster.ports().iter().position(|&p| p == port).unwrap()
}

/// A prompt and the same prompt plus a tail nobody holds.
fn prompt_and_ask(n: usize, start: u32) -> (Vec<u32>, Vec<u32>) {
    let p = tokens(n, start);
    let mut ask = p.clone();
    ask.extend([7, 7, 7]);
    (p, ask)
}

#[test]
fn the_gateway_routes_to_the_worker_whose_vllm_stored_the_prefix_in_either_hash_form() {
    for form in [HashForm::Int, HashForm::Bytes] {
        let mut f = Fleet::start(1, form);
        let (a, ask_a) = prompt_and_ask(64, 1000);
        let (b, ask_b) = prompt_and_ask(64, 5000);
        f.publishers[0].store(&a, json!({}));
        f.publishers[1].store(&b, json!({}));
        f.wait_held(ROOT_PARENT, &a, &[(0, 0, 16)]);
        f.wait_held(ROOT_PARENT, &b, &[(1, 0, 16)]);
        for _ in 0..4 {
            assert_eq!(f.route(&ask_a, json!({})), 0, "{form:?}");
            assert_eq!(f.route(&ask_b, json!({})), 1, "{form:?}");
        }
        // A branch on worker 1 off worker 0's prompt: its parent is a block worker 1 never
        // stored, so the branch is not believed there; worker 1 first stores the prefix.
        let mut branch = a[..32].to_vec();
        branch.extend(tokens(32, 9000));
        f.publishers[1].store(&a[..32], json!({}));
        f.publishers[1].store(&branch, json!({}));
        f.wait_held(ROOT_PARENT, &branch, &[(0, 0, 8), (1, 0, 16)]);
        for _ in 0..4 {
            assert_eq!(f.route(&branch, json!({})), 1, "{form:?}");
        }
        // Worker 1 evicts the branch's own blocks (removals by hash alone): back to the prefix.
        f.publishers[1].cmd(json!({"cmd": "remove", "tokens": branch, "last": 8}));
        f.wait_held(ROOT_PARENT, &branch, &[(0, 0, 8), (1, 0, 8)]);
        // Worker 0 resets its prefix cache: only worker 1's copy of the prefix is left.
        f.publishers[0].cmd(json!({"cmd": "clear"}));
        f.wait_held(ROOT_PARENT, &a, &[(1, 0, 8)]);
        let kv = f.gw.gateway().kv.as_ref().unwrap();
        let c = kv.intake_counts();
        assert_eq!(
            (c.malformed, c.skipped_events, c.resets),
            (0, 0, 0),
            "{c:?}"
        );
    }
}

#[test]
fn the_gateway_follows_a_dp_rank_on_base_plus_one_and_a_lost_batch() {
    let mut f = Fleet::start(2, HashForm::Int);
    let (p, ask) = prompt_and_ask(64, 2000);
    // Worker 0's rank 1 (ports base + 1) holds the prompt, and its batch is lost on the way:
    // the gateway fetches it from that rank's replay socket.
    f.publishers[0].control(json!({"cmd": "lose_next", "rank": 1}));
    f.publishers[0].store(&p, json!({"rank": 1}));
    // The gap shows with the next batch of that rank.
    f.publishers[0].store(&tokens(8, 77_000), json!({"rank": 1}));
    f.wait_held(ROOT_PARENT, &p, &[(0, 1, 16)]);
    for _ in 0..4 {
        assert_eq!(f.route(&ask, json!({})), 0);
    }
    let kv = f.gw.gateway().kv.as_ref().unwrap();
    let c = kv.intake_counts();
    assert!(c.gaps >= 1 && c.replayed_batches >= 1, "{c:?}");
    assert_eq!((c.resets, c.malformed), (0, 0), "{c:?}");
}

#[test]
fn the_gateway_counts_garbage_from_vllm_without_dropping_its_blocks() {
    let mut f = Fleet::start(1, HashForm::Int);
    let (p, ask) = prompt_and_ask(64, 3000);
    f.publishers[0].store(&p, json!({}));
    f.wait_held(ROOT_PARENT, &p, &[(0, 0, 16)]);
    for frames in [json!(["00"]), json!(["", "00000001", "90"])] {
        f.publishers[0].cmd(json!({"cmd": "garbage_live", "frames": frames, "hold": true}));
    }
    let kv = f.gw.gateway().kv.as_ref().unwrap();
    let c = crate::common::wait_until("the garbage counted", LIMIT, || {
        let c = kv.intake_counts();
        (c.malformed >= 2).then_some(c)
    });
    assert_eq!((c.malformed, c.resets), (2, 0), "{c:?}");
    assert_eq!(f.held(ROOT_PARENT, &p), vec![(0, 0, 16)]);
    for _ in 0..4 {
        assert_eq!(f.route(&ask, json!({})), 0);
    }
}

#[test]
fn the_gateway_routes_lora_blocks_by_lora_path_or_base_colon_adapter() {
    let mut f = Fleet::start(1, HashForm::Int);
    let (p, ask) = prompt_and_ask(64, 4000);
    // Worker 1 holds the prompt under adapter "sql", worker 0 the same tokens on the base.
    f.publishers[1].store(&p, json!({"lora": "sql"}));
    f.publishers[0].store(&p, json!({}));
    f.wait_held(namespace_root(None, Some("sql")), &p, &[(1, 0, 16)]);
    f.wait_held(ROOT_PARENT, &p, &[(0, 0, 16)]);
    for _ in 0..4 {
        assert_eq!(f.route(&ask, json!({"lora_path": "sql"})), 1);
        assert_eq!(f.route(&ask, json!({"model": format!("{MODEL}:sql")})), 1);
        assert_eq!(f.route(&ask, json!({})), 0, "base requests see none of it");
    }
}

#[test]
fn the_gateway_keeps_vllm_salted_blocks_in_their_salts_namespace() {
    let mut f = Fleet::start(1, HashForm::Int);
    let (p, ask) = prompt_and_ask(64, 6000);
    // Worker 0 holds the prompt under salt "tenant-a" (in vLLM's extra_keys), worker 1 the
    // same tokens unsalted.
    f.publishers[0].store(&p, json!({"salt": "tenant-a"}));
    f.publishers[1].store(&p, json!({}));
    f.wait_held(namespace_root(Some("tenant-a"), None), &p, &[(0, 0, 16)]);
    f.wait_held(ROOT_PARENT, &p, &[(1, 0, 16)]);
    for _ in 0..4 {
        assert_eq!(f.route(&ask, json!({"cache_salt": "tenant-a"})), 0);
        assert_eq!(f.route(&ask, json!({})), 1);
    }
}

#[test]
fn a_gateway_started_after_the_vllm_servers_rebuilds_their_state_from_replay() {
    // The servers cache before the gateway exists: stores, a branch, a removal, a reset.
    let cluster = crate::common::sim(2, |cfg| cfg.page_size = BLOCK);
    let urls: Vec<String> = cluster
        .ports()
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    let mut publishers: Vec<Vllm> = (0..2).map(|_| Vllm::start()).collect();
    let (a, ask_a) = prompt_and_ask(64, 10_000);
    let (b, ask_b) = prompt_and_ask(64, 20_000);
    let (gone, _) = prompt_and_ask(64, 30_000);
    publishers[0].store(&gone, json!({}));
    publishers[0].cmd(json!({"cmd": "clear"}));
    publishers[0].store(&a, json!({}));
    publishers[1].store(&b[..32], json!({}));
    publishers[1].store(&b, json!({}));
    publishers[1].cmd(json!({"cmd": "remove", "tokens": b, "last": 4}));
    let args = flags(&urls, &publishers, &["--policy", "cache_aware"]);
    let gw =
        crate::common::gateway_for(&urls, &args.iter().map(String::as_str).collect::<Vec<_>>());
    let kv = gw.gateway().kv.as_ref().unwrap();
    crate::common::wait_until("both servers' buffers replayed", LIMIT, || {
        (held(&gw, &cluster, ROOT_PARENT, &a) == [(0, 0, 16)]
            && held(&gw, &cluster, ROOT_PARENT, &b) == [(1, 0, 12)])
        .then_some(())
    });
    assert_eq!(held(&gw, &cluster, ROOT_PARENT, &gone), vec![]);
    for _ in 0..4 {
        assert_eq!(route(&gw, &cluster, &ask_a, json!({})), 0);
        assert_eq!(route(&gw, &cluster, &ask_b, json!({})), 1);
    }
    let c = kv.intake_counts();
    assert!(c.replayed_batches >= 6, "{c:?}");
    assert_eq!((c.resets, c.malformed, c.gaps), (0, 0, 0), "{c:?}");
    // A server restarts: its blocks go, and the new process's stream is followed.
    publishers[1].control(json!({"cmd": "restart"}));
    let fresh = tokens(32, 40_000);
    let start = Instant::now();
    while held(&gw, &cluster, ROOT_PARENT, &fresh).is_empty() {
        assert!(
            start.elapsed() < LIMIT,
            "the new process's events never arrived"
        );
        publishers[1].store(&fresh, json!({}));
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(held(&gw, &cluster, ROOT_PARENT, &b), vec![]);
    assert_eq!(held(&gw, &cluster, ROOT_PARENT, &a), vec![(0, 0, 16)]);
}

/// A gateway (re)started in front of vLLM servers, given nothing but their URLs: it finds every
/// publisher in their `GET /kv_event_sources` (vLLM's own `KVEventsConfig` per DP rank, with
/// wildcard hosts and ports offset by the rank), answers ready only once their replay buffers
/// are in, and routes its very first request by what they hold.
#[test]
fn a_gateway_restarted_in_front_of_vllm_servers_finds_their_publishers_and_routes_its_first_request_warm(
) {
    // Server 0 runs two DP ranks, server 1 one.
    let mut pubs = [
        Vllm::with(2, HashForm::Int, 4096),
        Vllm::with(1, HashForm::Int, 4096),
    ];
    let cards = json!([{"id": MODEL, "object": "model", "root": MODEL, "parent": null}]);
    let servers: Vec<FakeVllm> = pubs
        .iter_mut()
        .map(|p| {
            let sources: Value = serde_json::from_str(&p.raw(json!({"cmd": "sources"}))).unwrap();
            FakeVllm::start(cards.clone(), sources)
        })
        .collect();
    let urls: Vec<String> = servers.iter().map(FakeVllm::url).collect();
    let args = ["--kv-events", "--policy", "cache_aware"];
    let complete = |gw: &radixgate::runtime::Running, ids: &[u32]| -> usize {
        let mut prompt = ids.to_vec();
        prompt.extend([7, 7, 7]);
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1});
        let r = crate::common::request(
            gw.addr,
            "POST",
            "/v1/completions",
            &[("content-type", "application/json")],
            &serde_json::to_vec(&body).unwrap(),
        )
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let port = crate::common::served_by(&r);
        servers.iter().position(|s| s.port == port).unwrap()
    };
    // Before any gateway runs, server 0's rank 1 prefills a prompt (only its replay buffer
    // has it).
    let first = tokens(64, 100);
    pubs[0].store(&first, json!({"rank": 1}));
    let gw = crate::common::gateway_for(&urls, &args);
    let kv = gw.gateway().kv.as_ref().unwrap();
    // Ready means warm: both servers' every rank live before anything was routed.
    assert_eq!(kv.exact_workers().len(), 2, "exact on both at readiness");
    assert_eq!(
        complete(&gw, &first),
        0,
        "the first request after readiness"
    );
    let mut sources: Vec<(usize, u32)> = kv
        .source_states()
        .iter()
        .map(|(s, _)| {
            let w = gw.gateway().registry.load();
            let url = &w.workers.iter().find(|x| x.id == s.worker).unwrap().url;
            (urls.iter().position(|u| u == url).unwrap(), s.dp_rank)
        })
        .collect();
    sources.sort_unstable();
    assert_eq!(sources, [(0, 0), (0, 1), (1, 0)], "every announced rank");
    drop(gw);
    // While no gateway runs, server 1 prefills another; then a new gateway starts.
    let second = tokens(64, 5000);
    pubs[1].store(&second, json!({"rank": 0}));
    let gw = crate::common::gateway_for(&urls, &args);
    assert_eq!(gw.gateway().kv.as_ref().unwrap().exact_workers().len(), 2);
    assert_eq!(
        complete(&gw, &second),
        1,
        "the first request after readiness"
    );
    assert_eq!(complete(&gw, &first), 0);
    for s in &servers {
        assert!(!s.asked("/kv_event_sources").is_empty());
    }
}

/// A vLLM server restarted behind the same URL with publishers on other ports (as one bound to
/// `tcp://*:0` is): the gateway reads its `/kv_event_sources` again once the old publisher has
/// gone quiet, subscribes the new one and routes by it.
#[test]
fn a_vllm_server_restarted_on_new_ports_is_subscribed_again() {
    let mut pubs = [Vllm::start(), Vllm::start()];
    let cards = json!([{"id": MODEL, "object": "model", "root": MODEL, "parent": null}]);
    let sources = |v: &mut Vllm| -> Value {
        serde_json::from_str(&v.raw(json!({"cmd": "sources"}))).unwrap()
    };
    let servers: Vec<FakeVllm> = pubs
        .iter_mut()
        .map(|p| FakeVllm::start(cards.clone(), sources(p)))
        .collect();
    let urls: Vec<String> = servers.iter().map(FakeVllm::url).collect();
    let gw = crate::common::gateway_for(&urls, &["--kv-events", "--policy", "cache_aware"]);
    let kv = gw.gateway().kv.as_ref().unwrap();
    assert_eq!(kv.exact_workers().len(), 2);
    // Server 0 restarts: its old publisher is gone, the new one is elsewhere.
    let mut restarted = Vllm::start();
    servers[0].announce(sources(&mut restarted));
    drop(std::mem::replace(&mut pubs[0], restarted));
    let p = tokens(64, 700);
    pubs[0].store(&p, json!({}));
    crate::common::wait_until(
        "the restarted server's new publisher is followed",
        Duration::from_secs(30),
        || (held_by_port(&gw, &p) == [servers[0].port]).then_some(()),
    );
    let mut ask = p.clone();
    ask.extend([7, 7, 7]);
    let body =
        serde_json::to_vec(&json!({"model": MODEL, "prompt": ask, "max_tokens": 1})).unwrap();
    for _ in 0..4 {
        let r = crate::common::request(
            gw.addr,
            "POST",
            "/v1/completions",
            &[("content-type", "application/json")],
            &body,
        )
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(crate::common::served_by(&r), servers[0].port);
    }
}

/// The ports of the workers the index says hold `prompt` (unsalted).
fn held_by_port(gw: &radixgate::runtime::Running, prompt: &[u32]) -> Vec<u16> {
    let kv = gw.gateway().kv.as_ref().unwrap();
    let snap = kv.reader.load();
    let mut scratch = MatchScratch::default();
    let reg = gw.gateway().registry.load();
    let mut v: Vec<u16> = snap
        .match_prefix(MODEL, ROOT_PARENT, prompt, &mut scratch)
        .iter()
        .filter_map(|m| {
            let w = reg.workers.iter().find(|w| w.id == m.source.worker)?;
            w.url.rsplit(':').next()?.parse().ok()
        })
        .collect();
    v.sort_unstable();
    v
}

/// A hybrid model (full attention plus sliding window: Gemma-3, gpt-oss) has one KV-cache group
/// per kind in vLLM's `BlockPool`, each caching the prefill under the same hashes and saying
/// its `group_idx`; a sliding-window group's blocks leave first. Here group 0 plays the
/// sliding window (the kind of those models' first layer, so their group 0) and group 1 the
/// full attention: group 0 evicting the prompt leaves the worker holding it, and routed to;
/// only the last group's eviction takes it out.
#[test]
fn a_block_one_kv_cache_group_evicts_stays_while_another_group_holds_it() {
    let mut f = Fleet::start(1, HashForm::Int);
    let (p, ask) = prompt_and_ask(64, 40_000);
    // One scheduler step caches the prefill in both groups: one batch, two stores.
    f.publishers[0].control(json!({"cmd": "store", "tokens": p, "group": 0, "hold": true}));
    let sent = f.publishers[0].store(&p, json!({"group": 1}));
    assert_eq!(sent.stored.len(), 2, "one store per group");
    assert_eq!(
        sent.stored[0], sent.stored[1],
        "the same hashes in every group"
    );
    f.wait_held(ROOT_PARENT, &p, &[(0, 0, 16)]);
    // The sliding-window group evicts the whole prompt: 16 removals by hash alone.
    let gone = f.publishers[0].cmd(json!({"cmd": "remove", "tokens": p, "group": 0}));
    assert_eq!(gone.removed.len(), 16);
    // A later batch of the same publisher: once it is in, so is the removal before it.
    let (later, _) = prompt_and_ask(8, 49_000);
    f.publishers[0].store(&later, json!({}));
    f.wait_held(ROOT_PARENT, &later, &[(0, 0, 2)]);
    assert_eq!(
        f.held(ROOT_PARENT, &p),
        [(0, 0, 16)],
        "the full-attention group still holds the prompt"
    );
    for _ in 0..4 {
        assert_eq!(f.route(&ask, json!({})), 0);
    }
    // The full-attention group lets it go too: now it has left the worker.
    let gone = f.publishers[0].cmd(json!({"cmd": "remove", "tokens": p, "group": 1}));
    assert_eq!(gone.removed.len(), 16);
    f.wait_held(ROOT_PARENT, &p, &[]);
}
