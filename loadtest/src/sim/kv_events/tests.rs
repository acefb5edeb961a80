use super::*;
use crate::sim::radix::{Medium, Namespace};
use rmpv::Value as Mp;

fn decode(bytes: &[u8]) -> Mp {
    let mut r = bytes;
    let v = rmpv::decode::read_value(&mut r).expect("valid msgpack");
    assert!(r.is_empty(), "trailing bytes after the batch");
    v
}

fn int(v: &Mp) -> i64 {
    v.as_i64().unwrap_or_else(|| panic!("not an i64: {v:?}"))
}

fn field<'a>(m: &'a Mp, key: &str) -> Option<&'a Mp> {
    m.as_map()?
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

#[test]
fn config_defaults_and_fields() {
    let c = KvEventsConfig::parse("{}").unwrap();
    assert_eq!(c, KvEventsConfig::default());
    assert_eq!(
        c.publisher,
        PublisherKind::Null,
        "SGLang's default publisher"
    );
    assert_eq!(c.endpoint, "tcp://*:5557");
    assert_eq!(
        (c.buffer_steps, c.hwm, c.topic.as_str()),
        (10_000, 100_000, "")
    );
    assert_eq!(
        (c.encoding, c.replay_form),
        (EventEncoding::Map, ReplayForm::Topic),
        "SGLang 0.5.23's forms by default"
    );
    // The default config reads as SGLang's: no sim-only keys.
    let reported = c.to_json();
    assert!(reported.get("encoding").is_none() && reported.get("replay_form").is_none());
    let explicit = KvEventsConfig::parse(r#"{"encoding":"map","replay_form":"topic"}"#).unwrap();
    assert_eq!(explicit, c);
    let c = KvEventsConfig::parse(
        r#"{"publisher":"zmq","endpoint":"tcp://*:7000","replay_endpoint":"tcp://*:8000",
            "buffer_steps":5,"hwm":10,"max_queue_size":3,"topic":"kv","encoding":"array",
            "replay_form":"plain"}"#,
    )
    .unwrap();
    assert_eq!(c.publisher, PublisherKind::Zmq);
    assert_eq!(c.replay_endpoint.as_deref(), Some("tcp://*:8000"));
    assert_eq!((c.buffer_steps, c.hwm, c.max_queue_size), (5, 10, 3));
    assert_eq!((c.topic.as_str(), c.encoding), ("kv", EventEncoding::Array));
    assert_eq!(c.replay_form, ReplayForm::Plain);
    let reported = c.to_json();
    assert_eq!(
        (&reported["encoding"], &reported["replay_form"]),
        (&Value::from("array"), &Value::from("plain"))
    );
    // Round trip through the reported JSON.
    let back = KvEventsConfig::parse(&c.to_json().to_string()).unwrap();
    assert_eq!(back, c);
    for bad in [
        "[]",
        "nope",
        r#"{"publisher":"kafka"}"#,
        r#"{"endpoint":5557}"#,
        r#"{"endpoint":"http://x:1"}"#,
        r#"{"endpoint":"tcp://x"}"#,
        r#"{"endpoint":"tcp://x:99999"}"#,
        r#"{"buffer_steps":-1}"#,
        r#"{"buffer_steps":10000000}"#,
        r#"{"encoding":"cbor"}"#,
        r#"{"replay_form":"framed"}"#,
        r#"{"endpiont":"tcp://*:1"}"#,
    ] {
        assert!(KvEventsConfig::parse(bad).is_err(), "{bad} accepted");
    }
}

#[test]
fn endpoints_offset_per_worker() {
    assert_eq!(offset_endpoint("tcp://*:5557", 0).unwrap(), "tcp://*:5557");
    assert_eq!(offset_endpoint("tcp://*:5557", 3).unwrap(), "tcp://*:5560");
    assert_eq!(
        offset_endpoint("tcp://[::1]:5557", 1).unwrap(),
        "tcp://[::1]:5558"
    );
    assert_eq!(
        offset_endpoint("tcp://127.0.0.1:*", 2).unwrap(),
        "tcp://127.0.0.1:*"
    );
    assert_eq!(
        offset_endpoint("ipc:///tmp/kv", 2).unwrap(),
        "ipc:///tmp/kv_dp2"
    );
    assert!(offset_endpoint("tcp://*:65535", 1).is_err());
    assert!(pub_binds("tcp://*:1") && pub_binds("tcp://[::]:1") && pub_binds("inproc://x"));
    assert!(!pub_binds("tcp://127.0.0.1:1"));
    assert_eq!(
        with_bound_port("tcp://*:*", "tcp://0.0.0.0:41234"),
        "tcp://*:41234"
    );
    assert_eq!(
        with_bound_port("tcp://127.0.0.1:*", "tcp://127.0.0.1:41234"),
        "tcp://127.0.0.1:41234"
    );
    let c = KvEventsConfig::parse(
        r#"{"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}"#,
    )
    .unwrap();
    let w1 = c.for_worker(1).unwrap();
    assert_eq!(
        (w1.endpoint.as_str(), w1.replay_endpoint.as_deref()),
        ("tcp://*:5558", Some("tcp://*:5559"))
    );
    // Worker 1's PUB port would be worker 0's replay port: refused with an explanation.
    let err = check_distinct(&[c.for_worker(0).unwrap(), w1]).unwrap_err();
    assert!(err.contains("further apart"), "{err}");
    let far = KvEventsConfig {
        replay_endpoint: Some("tcp://*:6557".into()),
        ..c
    };
    check_distinct(&[far.for_worker(0).unwrap(), far.for_worker(1).unwrap()]).unwrap();
}

fn sample_events() -> Vec<CacheEvent> {
    vec![
        CacheEvent::Stored {
            hashes: vec![u64::MAX - 4, 7],
            parent: None,
            tokens: vec![1, 2, 3, 4],
            medium: Medium::Gpu,
            tags: None,
        },
        CacheEvent::Removed {
            hashes: vec![7, 9],
            medium: Medium::Gpu,
        },
        CacheEvent::Cleared,
    ]
}

#[test]
fn array_encoding_matches_sglang() {
    let mut out = Vec::new();
    let n = encode_batch(
        &mut out,
        12.5,
        &sample_events(),
        2,
        Some(0),
        EventEncoding::Array,
    );
    assert_eq!(n, 4);
    let v = decode(&out);
    let b = v.as_array().unwrap();
    assert_eq!(b.len(), 3);
    assert_eq!(b[0].as_f64(), Some(12.5));
    assert_eq!(int(&b[2]), 0, "attn_dp_rank");
    let evs = b[1].as_array().unwrap();
    assert_eq!(
        evs.len(),
        4,
        "two BlockStored (one per page), BlockRemoved, cleared"
    );
    let s0 = evs[0].as_array().unwrap();
    assert_eq!(s0.len(), 7);
    assert_eq!(s0[0].as_str(), Some("BlockStored"));
    let h0 = int(&s0[1].as_array().unwrap()[0]);
    assert_eq!(h0, (u64::MAX - 4) as i64, "hashes are signed 64-bit");
    assert!(h0 < 0);
    assert!(s0[2].is_nil(), "first page has no parent");
    let toks: Vec<i64> = s0[3].as_array().unwrap().iter().map(int).collect();
    assert_eq!(toks, [1, 2]);
    assert_eq!(int(&s0[4]), 2);
    assert!(s0[5].is_nil(), "lora_id");
    assert_eq!(s0[6].as_str(), Some("GPU"));
    let s1 = evs[1].as_array().unwrap();
    assert_eq!(int(&s1[1].as_array().unwrap()[0]), 7);
    assert_eq!(int(&s1[2]), h0, "second page's parent is the first page");
    let toks: Vec<i64> = s1[3].as_array().unwrap().iter().map(int).collect();
    assert_eq!(toks, [3, 4]);
    let r = evs[2].as_array().unwrap();
    assert_eq!(r[0].as_str(), Some("BlockRemoved"));
    let rh: Vec<i64> = r[1].as_array().unwrap().iter().map(int).collect();
    assert_eq!(rh, [7, 9]);
    assert_eq!(r[2].as_str(), Some("GPU"));
    assert_eq!(evs[3], Mp::Array(vec![Mp::from("AllBlocksCleared")]));
}

/// The keys of a map event, in order.
fn keys(m: &Mp) -> Vec<&str> {
    m.as_map()
        .unwrap()
        .iter()
        .map(|(k, _)| k.as_str().unwrap())
        .collect()
}

#[test]
fn map_encoding_matches_sglang_0_5_23() {
    let mut out = Vec::new();
    let n = encode_batch(&mut out, 1.0, &sample_events(), 2, None, EventEncoding::Map);
    let v = decode(&out);
    let b = v.as_array().expect("the batch stays an array");
    assert!(b[2].is_nil());
    let evs = b[1].as_array().unwrap();
    assert_eq!(
        (evs.len(), n),
        (3, 3),
        "one node's pages are one BlockStored"
    );
    let s0 = &evs[0];
    // msgspec writes the fields without a default even when None; medium is always set; the
    // optional namespace fields are omitted when None.
    assert_eq!(
        keys(s0),
        [
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium"
        ]
    );
    assert_eq!(field(s0, "type").and_then(Mp::as_str), Some("BlockStored"));
    assert!(field(s0, "parent_block_hash").unwrap().is_nil());
    assert!(field(s0, "lora_id").unwrap().is_nil());
    let hs: Vec<i64> = field(s0, "block_hashes")
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .map(int)
        .collect();
    assert_eq!(hs, [(u64::MAX - 4) as i64, 7]);
    let toks: Vec<i64> = field(s0, "token_ids")
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .map(int)
        .collect();
    assert_eq!(toks, [1, 2, 3, 4]);
    assert_eq!(field(s0, "block_size").map(int), Some(2), "one page");
    assert_eq!(field(s0, "medium").and_then(Mp::as_str), Some("GPU"));
    assert_eq!(keys(&evs[1]), ["type", "block_hashes", "medium"]);
    assert_eq!(
        field(&evs[1], "type").and_then(Mp::as_str),
        Some("BlockRemoved")
    );
    assert_eq!(field(&evs[1], "medium").and_then(Mp::as_str), Some("GPU"));
    assert_eq!(keys(&evs[2]), ["type"]);
    assert_eq!(
        field(&evs[2], "type").and_then(Mp::as_str),
        Some("AllBlocksCleared")
    );
}

#[test]
fn map_encoding_coalesces_chains_and_carries_tier_and_namespace() {
    let ns = Namespace::new(Some("never-published"), Some("adapter"), Some("salt"));
    let stored = |hashes: Vec<u64>, parent, medium, tags: bool| CacheEvent::Stored {
        tokens: vec![0; hashes.len() * 2],
        hashes,
        parent,
        medium,
        tags: if tags { ns.tags().cloned() } else { None },
    };
    let events = vec![
        stored(vec![1, 2], None, Medium::Gpu, true),
        stored(vec![3], Some(2), Medium::Gpu, true), // chains on: same event
        stored(vec![4], Some(2), Medium::Gpu, true), // a sibling: new event
        stored(vec![5], Some(4), Medium::CpuPinned, true), // another medium: new event
        stored(vec![6], Some(5), Medium::CpuPinned, false), // another namespace: new event
        CacheEvent::Removed {
            hashes: vec![6],
            medium: Medium::CpuPinned,
        },
        CacheEvent::Removed {
            hashes: vec![5],
            medium: Medium::CpuPinned,
        },
        CacheEvent::Removed {
            hashes: vec![4],
            medium: Medium::Gpu,
        },
    ];
    let mut out = Vec::new();
    let n = encode_batch(&mut out, 1.0, &events, 2, Some(3), EventEncoding::Map);
    let v = decode(&out);
    let evs = v.as_array().unwrap()[1].as_array().unwrap().clone();
    assert_eq!(n, evs.len());
    let hashes = |e: &Mp| -> Vec<i64> {
        field(e, "block_hashes")
            .unwrap()
            .as_array()
            .unwrap()
            .iter()
            .map(int)
            .collect()
    };
    let got: Vec<(Vec<i64>, &str)> = evs
        .iter()
        .map(|e| (hashes(e), field(e, "medium").and_then(Mp::as_str).unwrap()))
        .collect();
    assert_eq!(
        got,
        vec![
            (vec![1, 2, 3], "GPU"),
            (vec![4], "GPU"),
            (vec![5], "CPU_PINNED"),
            (vec![6], "CPU_PINNED"),
            (vec![6, 5], "CPU_PINNED"),
            (vec![4], "GPU"),
        ]
    );
    assert_eq!(
        field(&evs[0], "token_ids")
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        6
    );
    assert_eq!(field(&evs[1], "parent_block_hash").map(int), Some(2));
    // Salt and adapter name are published; a caller's extra_key is not.
    let s0 = &evs[0];
    assert_eq!(field(s0, "cache_salt").and_then(Mp::as_str), Some("salt"));
    assert_eq!(field(s0, "lora_name").and_then(Mp::as_str), Some("adapter"));
    assert!(!String::from_utf8_lossy(&out).contains("never-published"));
    assert!(field(&evs[3], "cache_salt").is_none() && field(&evs[3], "lora_name").is_none());
    // The array form stays one store per page and cannot carry the namespace.
    encode_batch(&mut out, 1.0, &events, 2, Some(3), EventEncoding::Array);
    let v = decode(&out);
    let evs = v.as_array().unwrap()[1].as_array().unwrap().clone();
    assert_eq!(evs.len(), 9);
    let media: Vec<&str> = evs
        .iter()
        .map(|e| e.as_array().unwrap().last().and_then(Mp::as_str).unwrap())
        .collect();
    assert_eq!(
        media,
        [
            "GPU",
            "GPU",
            "GPU",
            "GPU",
            "CPU_PINNED",
            "CPU_PINNED",
            "CPU_PINNED",
            "CPU_PINNED",
            "GPU"
        ]
    );
}

/// Replay answers as a client decodes them: after the identity and the empty delimiter, 0.5.23
/// repeats a live message (topic, seq, payload) and ends with an empty topic, seq -1 and an empty
/// payload; the older form has no topic frame.
#[test]
fn replay_frames_in_both_forms() {
    let seq = 41u64.to_be_bytes();
    let f = replay_frames(ReplayForm::Topic, b"id", b"kv", &seq, b"payload");
    assert_eq!(f, [&b"id"[..], b"", b"kv", &seq, b"payload"]);
    let end = replay_frames(ReplayForm::Topic, b"id", b"", &REPLAY_END_SEQ, b"");
    assert_eq!(end.len(), 5);
    assert!(end[1].is_empty() && end[2].is_empty() && end[4].is_empty());
    assert_eq!(i64::from_be_bytes(end[3].try_into().unwrap()), -1);
    let f = replay_frames(ReplayForm::Plain, b"id", b"kv", &seq, b"payload");
    assert_eq!(f, [&b"id"[..], b"", &seq, b"payload"]);
    let end = replay_frames(ReplayForm::Plain, b"id", b"", &REPLAY_END_SEQ, b"");
    assert_eq!(end.len(), 4);
    assert_eq!(i64::from_be_bytes(end[2].try_into().unwrap()), -1);
    assert!(end[3].is_empty());
}

#[test]
fn replay_buffer_keeps_the_last_batches() {
    let mut b = ReplayBuffer::new(3, 1000);
    for seq in 0..5u64 {
        b.push(seq, vec![seq as u8; 10]);
    }
    assert_eq!(b.len(), 3);
    let seqs: Vec<u64> = b.since(0).map(|(s, _)| *s).collect();
    assert_eq!(seqs, [2, 3, 4]);
    let seqs: Vec<u64> = b.since(4).map(|(s, _)| *s).collect();
    assert_eq!(seqs, [4]);
    assert_eq!(b.since(5).count(), 0);
    // Gaps in the numbering (skipped or lost batches) are fine.
    b.push(9, vec![0; 10]);
    let seqs: Vec<u64> = b.since(5).map(|(s, _)| *s).collect();
    assert_eq!(seqs, [9]);
    assert!(ReplayBuffer::new(0, 1000).is_empty());
}

#[test]
fn replay_buffer_flood_stays_bounded() {
    let mut b = ReplayBuffer::new(DEFAULT_BUFFER_STEPS, 64 * 1024);
    for seq in 0..200_000u64 {
        b.push(seq, vec![0; 100]);
    }
    assert!(b.len() * 100 <= 64 * 1024, "byte bound holds: {}", b.len());
    assert_eq!(
        b.since(0).next().map(|(s, _)| *s),
        Some(200_000 - b.len() as u64)
    );
    let mut b = ReplayBuffer::new(10, 64);
    b.push(0, vec![0; 65]);
    assert!(
        b.is_empty(),
        "a batch larger than the byte bound is not kept"
    );
}

#[test]
fn replay_requests_parse_strictly() {
    let ok = vec![b"id".to_vec(), Vec::new(), 7u64.to_be_bytes().to_vec()];
    assert_eq!(parse_replay_request(&ok), Some((&b"id"[..], 7)));
    let bad: [Vec<Vec<u8>>; 4] = [
        vec![b"id".to_vec(), 7u64.to_be_bytes().to_vec()],
        vec![b"id".to_vec(), b"x".to_vec(), 7u64.to_be_bytes().to_vec()],
        vec![b"id".to_vec(), Vec::new(), vec![0; 7]],
        vec![b"id".to_vec(), Vec::new(), vec![0; 8], vec![]],
    ];
    for f in &bad {
        assert_eq!(parse_replay_request(f), None, "{f:?}");
    }
    assert_eq!(i64::from_be_bytes(REPLAY_END_SEQ), -1);
}

#[test]
fn full_queue_drops_and_leaves_a_gap() {
    // A publisher whose thread never drains: the bounded queue holds one batch, the rest are
    // dropped after taking their sequence numbers, and the knobs act on the next batch only.
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let (a, _b) = UnixStream::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    let p = KvPublisher {
        worker: 0,
        config: KvEventsConfig::default(),
        tx: Some(tx),
        wake: Arc::new(Wake {
            tx: a,
            pending: AtomicBool::new(false),
        }),
        next_seq: std::cell::Cell::new(0),
        skip_next: std::cell::Cell::new(false),
        lose_next: std::cell::Cell::new(false),
        stats: Arc::new(KvStats::default()),
    };
    p.publish(Vec::new(), 0.0);
    assert_eq!(p.next_seq(), 0, "empty steps publish nothing");
    for _ in 0..10_000 {
        p.publish(vec![CacheEvent::Cleared], 0.0);
    }
    assert_eq!(p.next_seq(), 10_000);
    let s = p.stats();
    assert_eq!(s.queued.load(Ordering::Relaxed), 1);
    assert_eq!(s.dropped_queue_full.load(Ordering::Relaxed), 9_999);
    let m = rx.try_recv().unwrap();
    assert!(m.publish && m.seq == 0);
    p.lose_next_batch(true);
    p.publish(vec![CacheEvent::Cleared], 0.0);
    p.skip_next_batch(true);
    p.publish(vec![CacheEvent::Cleared], 0.0);
    let m = rx.try_recv().unwrap();
    assert_eq!(
        (m.seq, m.publish),
        (10_001, false),
        "10 000 lost, 10 001 withheld"
    );
    p.publish(vec![CacheEvent::Cleared], 0.0);
    assert!(rx.try_recv().unwrap().publish, "the knob acts once");
}

/// The ranks of a server whose rank-0 ports are ephemeral publish and replay on rank 0's ports
/// + rank (SGLang's rule), bound, with the ports they got reported.
#[test]
fn ephemeral_rank_zero_ports_are_offset_per_rank() {
    let port = |ep: &str| -> u16 { ep.rsplit_once(':').unwrap().1.parse().unwrap() };
    let cfg = KvEventsConfig::parse(
        r#"{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*"}"#,
    )
    .unwrap();
    let ranks = vec![
        cfg.for_worker(0).unwrap(),
        cfg.for_worker(1).unwrap(),
        cfg.for_worker(2).unwrap(),
    ];
    let ctx = zmq::Context::new();
    let (sockets, effective) = open_server(&ctx, &ranks).expect("three ranks bound");
    assert_eq!(sockets.len(), 3);
    let p0 = port(&effective[0].endpoint);
    let r0 = port(effective[0].replay_endpoint.as_deref().unwrap());
    for (rank, e) in effective.iter().enumerate() {
        assert_eq!(
            port(&e.endpoint),
            p0 + rank as u16,
            "rank {rank}'s publisher"
        );
        let replay = port(e.replay_endpoint.as_deref().unwrap());
        assert_eq!(replay, r0 + rank as u16, "rank {rank}'s replay");
        assert_eq!(sockets[rank].dp_rank, rank as u32);
    }
    // The ports are held: binding rank 1's publisher port again fails.
    assert!(std::net::TcpListener::bind(("127.0.0.1", p0 + 1)).is_err());
}

#[test]
fn vllm_encoding_matches_vllm_0_33() {
    let ns = Namespace::new(None, Some("adapter"), Some("salt"));
    let events = vec![
        CacheEvent::Stored {
            hashes: vec![u64::MAX - 4, 7],
            parent: None,
            tokens: vec![1, 2, 3, 4],
            medium: Medium::Gpu,
            tags: ns.tags().cloned(),
        },
        // Chains on: the same BlockStored, as vLLM reports a request's new blocks at once.
        CacheEvent::Stored {
            hashes: vec![9],
            parent: Some(7),
            tokens: vec![5, 6],
            medium: Medium::Gpu,
            tags: ns.tags().cloned(),
        },
        CacheEvent::Stored {
            hashes: vec![11],
            parent: Some(u64::MAX - 4),
            tokens: vec![8, 8],
            medium: Medium::CpuPinned,
            tags: None,
        },
        CacheEvent::Removed {
            hashes: vec![7, 9],
            medium: Medium::Gpu,
        },
        CacheEvent::Cleared,
    ];
    let mut out = Vec::new();
    let n = encode_batch(&mut out, 2.5, &events, 2, Some(0), EventEncoding::Vllm);
    let v = decode(&out);
    let batch = v.as_array().unwrap();
    assert_eq!(
        batch.len(),
        3,
        "EventBatch is array_like: [ts, events, rank]"
    );
    assert_eq!(batch[0].as_f64(), Some(2.5));
    assert_eq!(batch[2].as_u64(), Some(0), "rank 0 is written, not omitted");
    let evs = batch[1].as_array().unwrap();
    assert_eq!(n, evs.len());
    assert_eq!(n, 5, "two stores, one removal per block, one clear");
    let s = &evs[0];
    assert_eq!(
        keys(s),
        [
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
        ]
    );
    let hashes: Vec<u64> = field(s, "block_hashes")
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_u64().expect("unsigned, as vLLM's"))
        .collect();
    assert_eq!(hashes, [u64::MAX - 4, 7, 9]);
    // A hash above 2^63 is a msgpack uint64 (0xcf), not a negative int64 (0xd3).
    let mut big = Vec::new();
    rmp::encode::write_uint(&mut big, u64::MAX - 4).unwrap();
    assert_eq!(big[0], 0xcf);
    assert!(out.windows(big.len()).any(|w| w == big.as_slice()));
    assert!(field(s, "parent_block_hash").unwrap().is_nil());
    assert_eq!(field(s, "token_ids").unwrap().as_array().unwrap().len(), 6);
    assert_eq!(field(s, "block_size").unwrap().as_u64(), Some(2));
    assert!(field(s, "lora_id").unwrap().is_nil());
    assert_eq!(field(s, "medium").unwrap().as_str(), Some("GPU"));
    assert_eq!(field(s, "lora_name").unwrap().as_str(), Some("adapter"));
    // The salt is in the first block's extra keys only; the adapter in every block's.
    let extra = field(s, "extra_keys").unwrap().as_array().unwrap();
    let strs = |e: &Mp| -> Vec<String> {
        e.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(strs(&extra[0]), ["adapter", "salt"]);
    assert_eq!(strs(&extra[1]), ["adapter"]);
    assert_eq!(strs(&extra[2]), ["adapter"]);
    assert!(field(s, "cache_salt").is_none(), "vLLM has no salt field");
    assert_eq!(field(s, "group_idx").unwrap().as_u64(), Some(0));
    assert_eq!(
        field(s, "kv_cache_spec_kind").unwrap().as_str(),
        Some("full_attention")
    );
    // Default namespace, host tier, not at the root: no extra keys, medium CPU.
    let t = &evs[1];
    assert_eq!(field(t, "medium").unwrap().as_str(), Some("CPU"));
    assert_eq!(
        field(t, "parent_block_hash").unwrap().as_u64(),
        Some(u64::MAX - 4)
    );
    assert!(field(t, "lora_name").unwrap().is_nil());
    let extra = field(t, "extra_keys").unwrap().as_array().unwrap();
    assert_eq!(extra.len(), 1);
    assert!(extra[0].is_nil());
    for (e, h) in evs[2..4].iter().zip([7u64, 9]) {
        assert_eq!(keys(e), ["type", "block_hashes", "medium", "group_idx"]);
        assert_eq!(field(e, "type").unwrap().as_str(), Some("BlockRemoved"));
        let hs = field(e, "block_hashes").unwrap().as_array().unwrap();
        assert_eq!(hs.len(), 1, "one block per BlockRemoved");
        assert_eq!(hs[0].as_u64(), Some(h));
    }
    assert_eq!(keys(&evs[4]), ["type"]);
    assert_eq!(
        field(&evs[4], "type").unwrap().as_str(),
        Some("AllBlocksCleared")
    );
}

#[test]
fn vllm_config_follows_enable_kv_cache_events() {
    let on = KvEventsConfig::parse(
        r#"{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","topic":"kv"}"#,
    )
    .unwrap();
    assert_eq!(on.publisher, PublisherKind::Zmq, "vLLM: enabled means zmq");
    let v = on.for_vllm();
    assert_eq!(
        (v.publisher, v.encoding, v.replay_form),
        (PublisherKind::Zmq, EventEncoding::Vllm, ReplayForm::Topic)
    );
    // Rank 1's entry: ports offset, the wildcard host kept.
    let rank1 = v.for_worker(1).unwrap().to_vllm_json();
    assert_eq!(
        rank1,
        json!({
            "enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5558",
            "replay_endpoint": "tcp://*:5559", "buffer_steps": 10000, "hwm": 100000,
            "max_queue_size": 100000, "topic": "kv",
        })
    );
    // vLLM publishes nothing unless enabled, whatever the publisher says.
    for text in [
        r#"{"publisher":"zmq"}"#,
        r#"{"enable_kv_cache_events":false}"#,
        r#"{"enable_kv_cache_events":true,"publisher":"null"}"#,
    ] {
        let c = KvEventsConfig::parse(text).unwrap().for_vllm();
        assert_eq!(c.publisher, PublisherKind::Null, "{text}");
    }
    assert!(KvEventsConfig::parse(r#"{"enable_kv_cache_events":1}"#).is_err());
    // The key survives the reported JSON, so the config round-trips, vLLM's encoding too.
    assert_eq!(
        KvEventsConfig::parse(&on.to_json().to_string()).unwrap(),
        on
    );
    assert_eq!(KvEventsConfig::parse(&v.to_json().to_string()).unwrap(), v);
}
