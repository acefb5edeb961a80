//! KV events end to end: a simulated cluster publishing on 127.0.0.1, a real ZeroMQ SUB (and a
//! DEALER for replay) from the `zmq` crate — the libzmq pyzmq and SGLang use — and the msgpack
//! decoded generically with `rmpv`, independently of the encoder.

use std::time::{Duration, Instant};

use rmpv::Value as Mp;
use serde_json::Value;

use super::e2e_tests::call;
use super::kv_events::KvEventsConfig;
use super::{spawn_cluster, SimCluster, SimConfig, TokenizerMode};

/// Every wait in these tests ends by this deadline.
const DEADLINE: Duration = Duration::from_secs(10);

/// Bind both sockets of every worker on an ephemeral loopback port.
fn kv_cluster(ports: usize, extra: &str, max_total_tokens: usize) -> SimCluster {
    let json = format!(
        r#"{{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*"{extra}}}"#
    );
    spawn_cluster(SimConfig {
        ports: vec![0; ports],
        page_size: 4,
        max_total_tokens,
        tokenizer: TokenizerMode::Approx,
        time_scale: 1000.0,
        kv_events: Some(KvEventsConfig::parse(&json).unwrap()),
        ..SimConfig::default()
    })
    .expect("spawn cluster")
}

/// One received message: `(seq, payload bytes, decoded batch)`.
type Batch = (u64, Vec<u8>, Mp);

struct Sub {
    _ctx: zmq::Context,
    sock: zmq::Socket,
    /// Batches numbered below this came from the warm-up and are skipped.
    from: u64,
}

impl Sub {
    /// Subscribe to `endpoint` and make sure the subscription is live before returning: flush
    /// the worker's (empty) cache until an `AllBlocksCleared` batch arrives (ZeroMQ drops what a
    /// PUB sends before the subscription reaches it), then skip everything up to the worker's
    /// next sequence number.
    fn warm(port: u16, endpoint: &str) -> Sub {
        let ctx = zmq::Context::new();
        let sock = ctx.socket(zmq::SUB).unwrap();
        sock.set_subscribe(b"").unwrap();
        sock.set_rcvtimeo(DEADLINE.as_millis() as i32).unwrap();
        sock.connect(endpoint).unwrap();
        let t = Instant::now();
        loop {
            assert!(t.elapsed() < DEADLINE, "subscription never became live");
            assert_eq!(call(port, "POST", "/flush_cache", "").status, 200);
            if sock.poll(zmq::POLLIN, 50).unwrap() > 0 {
                break;
            }
        }
        let from = kv_stats(port)["next_seq"].as_u64().unwrap();
        Sub {
            _ctx: ctx,
            sock,
            from,
        }
    }

    /// The next batch numbered at or after `from` (panics after the deadline).
    fn next(&self) -> Batch {
        loop {
            let frames = self
                .sock
                .recv_multipart(0)
                .expect("a batch before the deadline");
            assert_eq!(frames.len(), 3, "topic, seq, payload");
            assert!(frames[0].is_empty(), "default topic is empty");
            let seq = u64::from_be_bytes(frames[1].as_slice().try_into().unwrap());
            if seq < self.from {
                continue;
            }
            let v = rmpv::decode::read_value(&mut &frames[2][..]).expect("msgpack batch");
            return (seq, frames[2].clone(), v);
        }
    }
}

fn kv_stats(port: u16) -> Value {
    call(port, "GET", "/debug/stats", "").json()["kv_events"].clone()
}

fn generate(port: u16, ids: impl Iterator<Item = u32>) {
    let ids: Vec<u32> = ids.collect();
    let body = serde_json::json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}});
    let r = call(port, "POST", "/generate", &body.to_string());
    assert_eq!(r.status, 200, "{}", r.text());
}

fn int(v: &Mp) -> i64 {
    v.as_i64()
        .unwrap_or_else(|| panic!("not an integer: {v:?}"))
}

fn ints(v: &Mp) -> Vec<i64> {
    v.as_array().unwrap().iter().map(int).collect()
}

fn field<'a>(m: &'a Mp, key: &str) -> Option<&'a Mp> {
    m.as_map()?
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

/// An event in either encoding, normalised for assertions.
#[derive(Debug, Clone, PartialEq)]
enum Ev {
    Stored {
        hash: i64,
        parent: Option<i64>,
        tokens: Vec<i64>,
        block_size: i64,
    },
    Removed(Vec<i64>),
    Cleared,
}

fn events(batch: &Mp) -> Vec<Ev> {
    let b = batch.as_array().expect("EventBatch is an array");
    assert_eq!(b.len(), 3, "[ts, events, attn_dp_rank]");
    assert!(b[0].as_f64().is_some_and(|ts| ts > 1.6e9), "unix ts");
    assert_eq!(int(&b[2]), 0, "attn_dp_rank");
    b[1].as_array()
        .unwrap()
        .iter()
        .map(|e| match e {
            Mp::Array(a) => match a[0].as_str() {
                Some("BlockStored") => {
                    assert_eq!(a.len(), 7);
                    let hs = ints(&a[1]);
                    assert_eq!(hs.len(), 1, "one BlockStored per page");
                    assert!(a[5].is_nil());
                    assert_eq!(a[6].as_str(), Some("GPU"));
                    Ev::Stored {
                        hash: hs[0],
                        parent: (!a[2].is_nil()).then(|| int(&a[2])),
                        tokens: ints(&a[3]),
                        block_size: int(&a[4]),
                    }
                }
                Some("BlockRemoved") => Ev::Removed(ints(&a[1])),
                Some("AllBlocksCleared") => Ev::Cleared,
                other => panic!("unknown event {other:?}"),
            },
            Mp::Map(_) => match field(e, "type").and_then(Mp::as_str) {
                Some("BlockStored") => Ev::Stored {
                    hash: ints(field(e, "block_hashes").unwrap())[0],
                    parent: field(e, "parent_block_hash").map(int),
                    tokens: ints(field(e, "token_ids").unwrap()),
                    block_size: int(field(e, "block_size").unwrap()),
                },
                Some("BlockRemoved") => Ev::Removed(ints(field(e, "block_hashes").unwrap())),
                Some("AllBlocksCleared") => Ev::Cleared,
                other => panic!("unknown event {other:?}"),
            },
            other => panic!("event neither array nor map: {other:?}"),
        })
        .collect()
}

/// Ask the replay socket for every buffered batch from `start`: `(seq, payload)` pairs up to
/// the terminator, which is checked.
fn replay(endpoint: &str, start: u64) -> Vec<(u64, Vec<u8>)> {
    let ctx = zmq::Context::new();
    let d = ctx.socket(zmq::DEALER).unwrap();
    d.set_rcvtimeo(DEADLINE.as_millis() as i32).unwrap();
    d.set_linger(0).unwrap();
    d.connect(endpoint).unwrap();
    d.send_multipart([&b""[..], &start.to_be_bytes()], 0)
        .unwrap();
    let mut out = Vec::new();
    loop {
        let f = d
            .recv_multipart(0)
            .expect("replay answer before the deadline");
        assert_eq!(f.len(), 3, "[b\"\", seq, payload]");
        assert!(f[0].is_empty());
        let seq = i64::from_be_bytes(f[1].as_slice().try_into().unwrap());
        if seq == -1 {
            assert!(f[2].is_empty(), "terminator has an empty payload");
            return out;
        }
        out.push((seq as u64, f[2].clone()));
    }
}

/// Read batches until `done` holds for the events gathered, returning them all.
fn gather(sub: &Sub, mut done: impl FnMut(&[Ev]) -> bool) -> (Vec<Batch>, Vec<Ev>) {
    let (mut batches, mut evs) = (Vec::new(), Vec::new());
    while !done(&evs) {
        let b = sub.next();
        evs.extend(events(&b.2));
        batches.push(b);
    }
    (batches, evs)
}

fn stored(evs: &[Ev]) -> Vec<(i64, Option<i64>, Vec<i64>)> {
    evs.iter()
        .filter_map(|e| match e {
            Ev::Stored {
                hash,
                parent,
                tokens,
                block_size,
            } => {
                assert_eq!(*block_size, 4, "block size is --page-size");
                Some((*hash, *parent, tokens.clone()))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn stored_removed_cleared_and_replayed() {
    // 64 KV slots: a second 50-token prompt must evict the first one's 20 cached tokens.
    let c = kv_cluster(1, "", 64);
    let port = c.ports()[0];
    let kv = c.kv_events()[0].clone();
    let info = call(port, "GET", "/get_server_info", "").json();
    let reported: Value =
        serde_json::from_str(info["kv_events_config"].as_str().expect("a JSON string")).unwrap();
    assert_eq!(reported["endpoint"], kv.endpoint.as_str());
    assert_eq!(
        reported["replay_endpoint"],
        kv.replay_endpoint.as_deref().unwrap()
    );
    assert_eq!(reported["publisher"], "zmq");
    assert_eq!(info["kv_events"]["block_size"], 4);
    assert_ne!(kv.endpoint, "tcp://127.0.0.1:*", "ephemeral port resolved");
    let sub = Sub::warm(port, &kv.endpoint);

    // 22 prompt tokens: 5 full pages are stored; the 2-token tail is not.
    generate(port, 0..22);
    let (mut batches, evs) = gather(&sub, |e| stored(e).len() >= 5);
    let first = stored(&evs);
    assert_eq!(first.len(), 5, "{evs:?}");
    let tokens: Vec<i64> = first.iter().flat_map(|s| s.2.clone()).collect();
    assert_eq!(
        tokens,
        (0..20).collect::<Vec<i64>>(),
        "full pages, in order"
    );
    assert_eq!(first[0].1, None, "the first page starts at the root");
    for w in first.windows(2) {
        assert_eq!(w[1].1, Some(w[0].0), "parent = previous page's hash");
    }

    // A 50-token prompt needs 50 slots; 44 are free, so the first prompt's node is evicted.
    generate(port, 100..150);
    let (more, evs) = gather(&sub, |e| {
        e.iter().any(|x| matches!(x, Ev::Removed(_))) && stored(e).len() >= 12
    });
    batches.extend(more);
    let removed: Vec<i64> = evs
        .iter()
        .filter_map(|e| match e {
            Ev::Removed(h) => Some(h.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    let mut want: Vec<i64> = first.iter().map(|s| s.0).collect();
    let mut got = removed.clone();
    want.sort_unstable();
    got.sort_unstable();
    assert_eq!(got, want, "the evicted node's page hashes");
    let second = stored(&evs);
    assert_eq!(second[0].1, None);
    assert_eq!(second[0].2, vec![100, 101, 102, 103]);

    // Flush: one AllBlocksCleared batch.
    assert_eq!(call(port, "POST", "/flush_cache", "").status, 200);
    let (more, evs) = gather(&sub, |e| !e.is_empty());
    assert_eq!(evs, vec![Ev::Cleared]);
    batches.extend(more);

    // Sequence numbers: consecutive, starting where the warm-up left off.
    let seqs: Vec<u64> = batches.iter().map(|b| b.0).collect();
    let want: Vec<u64> = (sub.from..sub.from + seqs.len() as u64).collect();
    assert_eq!(seqs, want);
    let stats = kv_stats(port);
    assert_eq!(stats["next_seq"], sub.from + seqs.len() as u64);
    assert_eq!(stats["dropped_queue_full"], 0);

    // Replay from the first seq seen: byte-identical batches, then the -1 terminator.
    let replayed = replay(kv.replay_endpoint.as_deref().unwrap(), sub.from);
    let published: Vec<(u64, Vec<u8>)> = batches.iter().map(|b| (b.0, b.1.clone())).collect();
    assert_eq!(replayed, published);
    // From the very beginning: the warm-up batches too, starting at seq 0.
    let all = replay(kv.replay_endpoint.as_deref().unwrap(), 0);
    assert_eq!(all.first().map(|b| b.0), Some(0));
    assert_eq!(all.len() as u64, sub.from + seqs.len() as u64);
    // Past the end: only the terminator.
    assert!(replay(kv.replay_endpoint.as_deref().unwrap(), 1 << 40).is_empty());
    // Malformed requests are counted and ignored; a good one still works afterwards.
    let ctx = zmq::Context::new();
    let d = ctx.socket(zmq::DEALER).unwrap();
    d.set_linger(0).unwrap();
    d.connect(kv.replay_endpoint.as_deref().unwrap()).unwrap();
    d.send_multipart([&b""[..], b"short"], 0).unwrap();
    d.send_multipart([&b"x"[..], &0u64.to_be_bytes()], 0)
        .unwrap();
    let t = Instant::now();
    while kv_stats(port)["replay_malformed"].as_u64() < Some(2) {
        assert!(t.elapsed() < DEADLINE, "malformed requests not counted");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        replay(kv.replay_endpoint.as_deref().unwrap(), 0).len(),
        all.len()
    );
}

#[test]
fn map_encoding_per_worker_endpoints_and_gap_knobs() {
    let c = kv_cluster(2, r#","encoding":"map""#, 4096);
    let (p0, p1) = (c.ports()[0], c.ports()[1]);
    let (kv0, kv1) = (c.kv_events()[0].clone(), c.kv_events()[1].clone());
    assert_ne!(
        kv0.endpoint, kv1.endpoint,
        "each worker has its own endpoint"
    );
    assert_ne!(kv0.replay_endpoint, kv1.replay_endpoint);
    let reported = call(p1, "GET", "/get_server_info", "").json()["kv_events_config"].clone();
    let reported: Value = serde_json::from_str(reported.as_str().unwrap()).unwrap();
    assert_eq!(reported["endpoint"], kv1.endpoint.as_str());
    assert_eq!(reported["encoding"], "map");
    let sub = Sub::warm(p1, &kv1.endpoint);
    let replay_ep = kv1.replay_endpoint.clone().unwrap();

    generate(p1, 0..12);
    let (_, evs) = gather(&sub, |e| stored(e).len() >= 3);
    let pages = stored(&evs);
    assert_eq!(pages.len(), 3, "12 prompt tokens → 3 full pages (map form)");
    assert_eq!(pages[0].1, None, "map form omits the root's parent");
    assert_eq!(pages[2].1, Some(pages[1].0));
    // Worker 0 saw no request and no flush: it published nothing.
    assert_eq!(kv_stats(p0)["queued"], 0);

    // skip_kv_seq: the next batch never reaches the SUB but stays replayable.
    let r = call(p1, "POST", "/debug/faults", r#"{"skip_kv_seq": true}"#);
    assert_eq!(r.status, 200);
    let skipped = kv_stats(p1)["next_seq"].as_u64().unwrap();
    generate(p1, 200..212);
    generate(p1, 300..312);
    let (seq, _, batch) = sub.next();
    assert_eq!(seq, skipped + 1, "a gap at {skipped}");
    assert_eq!(stored(&events(&batch))[0].2, vec![300, 301, 302, 303]);
    let filled = replay(&replay_ep, skipped);
    assert_eq!(
        filled.iter().map(|b| b.0).collect::<Vec<_>>(),
        [skipped, skipped + 1]
    );
    let gap = rmpv::decode::read_value(&mut &filled[0].1[..]).unwrap();
    assert_eq!(stored(&events(&gap))[0].2, vec![200, 201, 202, 203]);

    // lose_kv_seq: the number is consumed with nothing published or buffered.
    call(p1, "POST", "/debug/faults", r#"{"lose_kv_seq": true}"#);
    let lost = kv_stats(p1)["next_seq"].as_u64().unwrap();
    generate(p1, 400..412);
    generate(p1, 500..512);
    let (seq, _, _) = sub.next();
    assert_eq!(seq, lost + 1);
    let after = replay(&replay_ep, lost);
    assert_eq!(
        after.first().map(|b| b.0),
        Some(lost + 1),
        "lost batch not replayable"
    );
    let stats = kv_stats(p1);
    assert_eq!(
        (stats["skipped"].as_u64(), stats["lost"].as_u64()),
        (Some(1), Some(1))
    );

    // Knobs need a publisher and a boolean.
    let r = call(p1, "POST", "/debug/faults", r#"{"skip_kv_seq": 1}"#);
    assert_eq!(r.status, 400);
}

#[test]
fn null_publisher_and_overlapping_ports() {
    // publisher "null" (SGLang's default): reported, nothing published.
    let c = spawn_cluster(SimConfig {
        kv_events: Some(KvEventsConfig::parse(r#"{"endpoint":"tcp://*:5557"}"#).unwrap()),
        ..SimConfig::default()
    })
    .unwrap();
    let port = c.ports()[0];
    assert!(c.kv_events().is_empty());
    let info = call(port, "GET", "/get_server_info", "").json();
    assert!(info["kv_events_config"]
        .as_str()
        .is_some_and(|s| s.contains("\"null\"")));
    assert!(kv_stats(port).is_null());
    let r = call(port, "POST", "/debug/faults", r#"{"skip_kv_seq": true}"#);
    assert_eq!(r.status, 400, "no publisher to skip on");
    // Without --kv-events-config the field is null, as in SGLang.
    let plain = spawn_cluster(SimConfig::default()).unwrap();
    let info = call(plain.ports()[0], "GET", "/get_server_info", "").json();
    assert!(info["kv_events_config"].is_null());

    // Two workers, endpoint base 5557 and replay base 5558: worker 1's PUB would take worker 0's
    // replay port. Refused before anything binds.
    let err = spawn_cluster(SimConfig {
        ports: vec![0, 0],
        kv_events: Some(
            KvEventsConfig::parse(
                r#"{"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}"#,
            )
            .unwrap(),
        ),
        ..SimConfig::default()
    })
    .unwrap_err();
    assert!(err.to_string().contains("further apart"), "{err}");
}
