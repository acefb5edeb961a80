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
    kv_cluster_with(ports, extra, max_total_tokens, 0)
}

/// [`kv_cluster`] with a host tier of `host_cache_tokens`.
fn kv_cluster_with(
    ports: usize,
    extra: &str,
    max_total_tokens: usize,
    host_cache_tokens: usize,
) -> SimCluster {
    let json = format!(
        r#"{{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*"{extra}}}"#
    );
    spawn_cluster(SimConfig {
        ports: vec![0; ports],
        page_size: 4,
        max_total_tokens,
        host_cache_tokens,
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
    generate_with(port, ids, serde_json::json!({}));
}

/// `/generate` of `ids` with the extra body fields in `extra`; returns its cached tokens.
fn generate_with(port: u16, ids: impl Iterator<Item = u32>, extra: Value) -> u64 {
    let ids: Vec<u32> = ids.collect();
    let mut body = serde_json::json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}});
    if let (Some(b), Some(x)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(x.clone());
    }
    let r = call(port, "POST", "/generate", &body.to_string());
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["meta_info"]["cached_tokens"].as_u64().unwrap()
}

/// The raw events of a batch (maps in the default form), for fields [`Ev`] leaves out.
fn raw_events(batch: &Mp) -> Vec<Mp> {
    batch.as_array().unwrap()[1].as_array().unwrap().clone()
}

/// `(type, medium, hashes)` of a raw map event.
fn kind(e: &Mp) -> (String, String, Vec<i64>) {
    let s = |k: &str| field(e, k).and_then(Mp::as_str).unwrap_or("").to_owned();
    let hs = field(e, "block_hashes").map(ints).unwrap_or_default();
    (s("type"), s("medium"), hs)
}

/// One sample of `/metrics` (the first line of `name` whose labels contain `labels`).
fn metric_with(port: u16, name: &str, labels: &str) -> f64 {
    let text = call(port, "GET", "/metrics", "").text();
    text.lines()
        .find(|l| l.starts_with(name) && l.contains(labels))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} with {labels} missing"))
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
        .flat_map(|e| match e {
            Mp::Array(a) => vec![match a[0].as_str() {
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
            }],
            Mp::Map(_) => map_event(e),
            other => panic!("event neither array nor map: {other:?}"),
        })
        .collect()
}

/// A map event (SGLang 0.5.23) as one [`Ev`] per page: a `BlockStored` covers a run of pages,
/// each the parent of the next.
fn map_event(e: &Mp) -> Vec<Ev> {
    match field(e, "type").and_then(Mp::as_str) {
        Some("BlockStored") => {
            assert!(
                field(e, "lora_id").is_some_and(Mp::is_nil),
                "lora_id is written"
            );
            assert_eq!(field(e, "medium").and_then(Mp::as_str), Some("GPU"));
            let parent = field(e, "parent_block_hash").expect("parent_block_hash is written");
            let mut parent = (!parent.is_nil()).then(|| int(parent));
            let block_size = int(field(e, "block_size").unwrap());
            let tokens = ints(field(e, "token_ids").unwrap());
            let hashes = ints(field(e, "block_hashes").unwrap());
            assert_eq!(tokens.len() as i64, hashes.len() as i64 * block_size);
            hashes
                .iter()
                .zip(tokens.chunks(block_size as usize))
                .map(|(&hash, page)| {
                    let ev = Ev::Stored {
                        hash,
                        parent,
                        tokens: page.to_vec(),
                        block_size,
                    };
                    parent = Some(hash);
                    ev
                })
                .collect()
        }
        Some("BlockRemoved") => {
            assert_eq!(field(e, "medium").and_then(Mp::as_str), Some("GPU"));
            vec![Ev::Removed(ints(field(e, "block_hashes").unwrap()))]
        }
        Some("AllBlocksCleared") => vec![Ev::Cleared],
        other => panic!("unknown event {other:?}"),
    }
}

/// Ask the replay socket for every buffered batch from `start`: `(seq, payload)` pairs up to
/// the terminator, which is checked. The answers are in SGLang 0.5.23's form (`b""`, topic,
/// seq, payload; the topic is empty by default).
fn replay(endpoint: &str, start: u64) -> Vec<(u64, Vec<u8>)> {
    replay_in(endpoint, start, true)
}

/// [`replay`] for either reply form: `topic` (0.5.23) or the older one without a topic frame.
fn replay_in(endpoint: &str, start: u64, topic: bool) -> Vec<(u64, Vec<u8>)> {
    let ctx = zmq::Context::new();
    let d = ctx.socket(zmq::DEALER).unwrap();
    d.set_rcvtimeo(DEADLINE.as_millis() as i32).unwrap();
    d.set_linger(0).unwrap();
    d.connect(endpoint).unwrap();
    d.send_multipart([&b""[..], &start.to_be_bytes()], 0)
        .unwrap();
    let mut out = Vec::new();
    loop {
        let mut f = d
            .recv_multipart(0)
            .expect("replay answer before the deadline");
        if topic {
            assert_eq!(f.len(), 4, "[b\"\", topic, seq, payload]");
            assert!(f.remove(1).is_empty(), "the topic (empty, as configured)");
        } else {
            assert_eq!(f.len(), 3, "[b\"\", seq, payload]");
        }
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
    assert!(
        reported.get("encoding").is_none(),
        "default config reads as SGLang's"
    );
    // SGLang 0.5.23's descriptor, exactly: the bound ports as bases, one publisher.
    let port_of = |ep: &str| -> u16 { ep.rsplit_once(':').unwrap().1.parse().unwrap() };
    assert_eq!(
        info["kv_events"],
        serde_json::json!({
            "publisher": "zmq", "endpoint_host": "127.0.0.1",
            "endpoint_port_base": port_of(&kv.endpoint), "topic": "", "block_size": 4,
            "dp_size": 1,
            "replay_endpoint_port_base": port_of(kv.replay_endpoint.as_deref().unwrap()),
        })
    );
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
fn array_encoding_plain_replay_per_worker_endpoints_and_gap_knobs() {
    let c = kv_cluster(2, r#","encoding":"array","replay_form":"plain""#, 4096);
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
    assert_eq!(reported["encoding"], "array");
    assert_eq!(reported["replay_form"], "plain");
    let sub = Sub::warm(p1, &kv1.endpoint);
    let replay_ep = kv1.replay_endpoint.clone().unwrap();

    generate(p1, 0..12);
    let (_, evs) = gather(&sub, |e| stored(e).len() >= 3);
    let pages = stored(&evs);
    assert_eq!(
        pages.len(),
        3,
        "12 prompt tokens → 3 full pages (array form)"
    );
    assert_eq!(pages[0].1, None, "the first page's parent is nil");
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
    let filled = replay_in(&replay_ep, skipped, false);
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
    let after = replay_in(&replay_ep, lost, false);
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
    assert!(
        info["kv_events"].is_null(),
        "SGLang describes no null publisher"
    );
    let r = call(port, "POST", "/debug/faults", r#"{"skip_kv_seq": true}"#);
    assert_eq!(r.status, 400, "no publisher to skip on");
    // Without --kv-events-config the field is null, as in SGLang.
    let plain = spawn_cluster(SimConfig::default()).unwrap();
    let info = call(plain.ports()[0], "GET", "/get_server_info", "").json();
    assert!(info["kv_events_config"].is_null());
    assert!(info["kv_events"].is_null());

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

#[test]
fn namespaces_keep_caches_apart_and_events_name_salt_and_adapter() {
    let c = kv_cluster(1, "", 4096);
    let port = c.ports()[0];
    let sub = Sub::warm(port, &c.kv_events()[0].endpoint);
    let salt = |s: &str| serde_json::json!({ "cache_salt": s });
    // 13 tokens: the hit is capped at 12, whole pages of 4.
    assert_eq!(generate_with(port, 0..13, salt("A")), 0);
    assert_eq!(
        generate_with(port, 0..13, salt("B")),
        0,
        "another salt misses"
    );
    assert_eq!(
        generate_with(port, 0..13, serde_json::json!({})),
        0,
        "no salt misses"
    );
    assert_eq!(
        generate_with(port, 0..13, salt("A")),
        12,
        "the same salt hits"
    );
    let key = serde_json::json!({ "extra_key": "k" });
    assert_eq!(
        generate_with(port, 0..13, key.clone()),
        0,
        "an extra key misses"
    );
    assert_eq!(generate_with(port, 0..13, key), 12);
    // An adapter named by the model field, then by lora_path: the same namespace.
    let model = format!("{}:my-adapter", SimConfig::default().model_name);
    let body = serde_json::json!({"model": model, "prompt": (0..13).collect::<Vec<u32>>(), "max_tokens": 1});
    let r = call(port, "POST", "/v1/completions", &body.to_string());
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    let lora = serde_json::json!({ "lora_path": "my-adapter" });
    assert_eq!(
        generate_with(port, 0..13, lora),
        12,
        "lora_path names the same adapter"
    );

    // Five namespaces stored the same tokens: five chains, told apart by their hashes and
    // fields (the extra key is not published).
    let (batches, _) = gather(&sub, |e| stored(e).len() >= 5 * 3);
    let evs: Vec<Mp> = batches.iter().flat_map(|b| raw_events(&b.2)).collect();
    let firsts: Vec<&Mp> = evs
        .iter()
        .filter(|e| field(e, "parent_block_hash").is_some_and(Mp::is_nil))
        .collect();
    assert_eq!(firsts.len(), 5, "{evs:?}");
    let tag = |e: &Mp, k: &str| field(e, k).and_then(Mp::as_str).map(str::to_owned);
    let tags: Vec<(Option<String>, Option<String>)> = firsts
        .iter()
        .map(|e| (tag(e, "cache_salt"), tag(e, "lora_name")))
        .collect();
    let s = |x: &str| Some(x.to_owned());
    assert_eq!(
        tags,
        vec![
            (s("A"), None),
            (s("B"), None),
            (None, None),
            (None, None),
            (None, s("my-adapter")),
        ]
    );
    let mut roots: Vec<i64> = firsts.iter().map(|e| kind(e).2[0]).collect();
    roots.sort_unstable();
    roots.dedup();
    assert_eq!(roots.len(), 5, "same tokens, five different block hashes");
}

#[test]
fn host_tier_backs_up_evictions_loads_them_back_and_counts_host_hits() {
    // 64 device slots and 256 host slots: the second prompt pushes the first to host memory,
    // and asking for the first again loads it back instead of recomputing it.
    let c = kv_cluster_with(1, "", 64, 256);
    let port = c.ports()[0];
    let sub = Sub::warm(port, &c.kv_events()[0].endpoint);
    assert_eq!(generate_with(port, 0..22, serde_json::json!({})), 0);
    let (batches, _) = gather(&sub, |e| stored(e).len() >= 5);
    let first: Vec<i64> = batches
        .iter()
        .flat_map(|b| raw_events(&b.2))
        .flat_map(|e| kind(&e).2)
        .collect();
    assert_eq!(first.len(), 5);
    assert_eq!(generate_with(port, 100..150, serde_json::json!({})), 0);
    let mut seen: Vec<(String, String, Vec<i64>)> = Vec::new();
    while !seen.iter().any(|k| k.0 == "BlockRemoved") {
        seen.extend(raw_events(&sub.next().2).iter().map(kind));
    }
    let backup = seen
        .iter()
        .position(|k| k.0 == "BlockStored" && k.1 == "CPU_PINNED")
        .expect("a host BlockStored");
    let demote = seen
        .iter()
        .position(|k| k.0 == "BlockRemoved" && k.1 == "GPU")
        .unwrap();
    assert!(
        backup < demote,
        "host copy before the device copy goes: {seen:?}"
    );
    assert_eq!(
        seen[backup].2, first,
        "the evicted pages, under the same hashes"
    );
    assert_eq!(seen[demote].2, first);
    assert_eq!(
        metric_with(port, "sglang:cached_tokens_total", "\"host\""),
        0.0
    );

    // The first prompt again: its 20 cached tokens come back from host memory.
    assert_eq!(generate_with(port, 0..22, serde_json::json!({})), 20);
    let mut seen: Vec<(String, String, Vec<i64>)> = Vec::new();
    while !seen
        .iter()
        .any(|k| k.0 == "BlockStored" && k.1 == "GPU" && k.2 == first)
    {
        seen.extend(raw_events(&sub.next().2).iter().map(kind));
    }
    assert_eq!(
        metric_with(port, "sglang:cached_tokens_total", "\"host\""),
        20.0
    );
    assert_eq!(
        metric_with(port, "sglang:cached_tokens_total", "\"device\""),
        0.0
    );
    assert_eq!(
        metric_with(port, "sglang:cached_tokens_total", "\"total\""),
        20.0
    );
    // And once more: now a device hit.
    assert_eq!(generate_with(port, 0..22, serde_json::json!({})), 20);
    assert_eq!(
        metric_with(port, "sglang:cached_tokens_total", "\"device\""),
        20.0
    );
    assert_eq!(
        metric_with(port, "sglang:cached_tokens_total", "\"total\""),
        40.0
    );
    let rank = call(port, "GET", "/debug/stats", "").json()["dp_ranks"][0].clone();
    assert_eq!(rank["cached_tokens_host"], 20);
    assert_eq!(rank["host_cache"]["loaded_tokens"], 20);
    assert_eq!(rank["host_cache"]["capacity"], 256);
    let info = call(port, "GET", "/get_server_info", "").json();
    assert_eq!(info["enable_hierarchical_cache"], true);
}
