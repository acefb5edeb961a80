use super::*;
use proptest::prelude::*;
use rmp::encode as w;

/// A tiny msgpack builder for hand-made payloads (including wrong ones).
#[derive(Default)]
struct B(Vec<u8>);
impl B {
    fn w<E: std::fmt::Debug, T>(mut self, f: impl FnOnce(&mut Vec<u8>) -> Result<T, E>) -> Self {
        f(&mut self.0).unwrap();
        self
    }
    fn arr(self, n: u32) -> Self {
        self.w(|o| w::write_array_len(o, n))
    }
    fn map(self, n: u32) -> Self {
        self.w(|o| w::write_map_len(o, n))
    }
    fn s(self, v: &str) -> Self {
        self.w(|o| w::write_str(o, v))
    }
    fn u(self, v: u64) -> Self {
        self.w(|o| w::write_uint(o, v))
    }
    fn i(self, v: i64) -> Self {
        self.w(|o| w::write_sint(o, v))
    }
    fn f(self, v: f64) -> Self {
        self.w(|o| w::write_f64(o, v))
    }
    fn nil(self) -> Self {
        self.w(w::write_nil)
    }
    fn bin(self, v: &[u8]) -> Self {
        self.w(|o| w::write_bin(o, v))
    }
    fn raw(mut self, v: &[u8]) -> Self {
        self.0.extend_from_slice(v);
        self
    }
    fn ints(mut self, v: &[u64]) -> Self {
        self = self.arr(v.len() as u32);
        for &x in v {
            self = self.u(x);
        }
        self
    }
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], bs: u32) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().map(|&h| EngineHash(h)).collect(),
        parent: parent.map(EngineHash),
        token_ids: tokens.to_vec(),
        block_size: bs,
        lora_id: None,
        medium: None,
        cache_salt: None,
        lora_name: None,
    })
}

fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.iter().map(|&h| EngineHash(h)).collect(),
        medium: None,
    })
}

#[test]
fn sglang_array_batch_with_every_event() {
    let p = B::default()
        .arr(3)
        .f(1.5)
        .arr(3)
        .arr(7)
        .s("BlockStored")
        .ints(&[11, 12])
        .nil()
        .ints(&[1, 2, 3, 4])
        .u(2)
        .nil()
        .s("GPU")
        .arr(3)
        .s("BlockRemoved")
        .ints(&[11])
        .nil()
        .arr(1)
        .s("AllBlocksCleared")
        .u(2);
    let b = decode_batch(&p.0).unwrap();
    assert_eq!(b.ts, Some(1.5));
    assert_eq!(b.dp_rank, Some(2));
    assert_eq!(b.skipped, Skipped::default());
    let KvEvent::BlockStored(s) = &b.events[0] else {
        panic!("{:?}", b.events[0])
    };
    assert_eq!(s.medium.as_deref(), Some("GPU"));
    assert_eq!(
        b.events[1..],
        [removed(&[11]), KvEvent::AllBlocksCleared][..]
    );
    assert_eq!(s.token_ids, vec![1, 2, 3, 4]);
    assert_eq!(s.block_size, 2);
}

#[test]
fn older_two_element_batch_and_omitted_trailing_fields() {
    let p = B::default()
        .arr(2)
        .u(7) // an integer timestamp
        .arr(2)
        .arr(5)
        .s("BlockStored")
        .ints(&[5])
        .u(4)
        .ints(&[9, 9])
        .u(2)
        .arr(2)
        .s("BlockRemoved")
        .ints(&[5]);
    let b = decode_batch(&p.0).unwrap();
    assert_eq!((b.ts, b.dp_rank), (Some(7.0), None));
    assert_eq!(
        b.events,
        vec![stored(&[5], Some(4), &[9, 9], 2), removed(&[5])]
    );
}

#[test]
fn vllm_extra_fields_are_ignored_in_both_forms() {
    // Array form with trailing lora_name, extra_keys (nested) and group_idx.
    let p = B::default()
        .arr(3)
        .f(0.0)
        .arr(2)
        .arr(10)
        .s("BlockStored")
        .ints(&[1])
        .nil()
        .ints(&[3])
        .u(1)
        .i(-1)
        .nil()
        .s("adapter")
        .arr(1)
        .arr(2)
        .s("mm")
        .u(3)
        .u(0)
        // Map form, `type` last, unknown keys with nested values, a non-string key.
        .map(6)
        .s("block_hashes")
        .ints(&[1])
        .s("extra_keys")
        .map(1)
        .s("k")
        .arr(2)
        .nil()
        .nil()
        .u(42)
        .s("not a key name")
        .s("medium")
        .s("CPU")
        .s("group_idx")
        .u(0)
        .s("type")
        .s("BlockRemoved")
        .nil();
    let b = decode_batch(&p.0).unwrap();
    assert_eq!(b.skipped, Skipped::default(), "{b:?}");
    let KvEvent::BlockStored(s) = &b.events[0] else {
        panic!()
    };
    assert_eq!(s.lora_id, Some(-1));
    assert_eq!(s.lora_name.as_deref(), Some("adapter"));
    assert_eq!(
        b.events[1],
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![EngineHash(1)],
            medium: Some("CPU".into())
        })
    );
}

#[test]
fn map_batch_with_map_events() {
    let p = B::default()
        .map(4)
        .s("data_parallel_rank")
        .u(1)
        .s("events")
        .arr(2)
        .map(5)
        .s("type")
        .s("BlockStored")
        .s("token_ids")
        .ints(&[7, 8])
        .s("block_size")
        .u(2)
        .s("block_hashes")
        .ints(&[100])
        .s("parent_block_hash")
        .u(99)
        .map(1)
        .s("type")
        .s("AllBlocksCleared")
        .s("ts")
        .f(2.0)
        .s("future")
        .arr(0);
    let b = decode_batch(&p.0).unwrap();
    assert_eq!((b.ts, b.dp_rank), (Some(2.0), Some(1)));
    assert_eq!(
        b.events,
        vec![
            stored(&[100], Some(99), &[7, 8], 2),
            KvEvent::AllBlocksCleared
        ]
    );
    let no_events = B::default().map(1).s("ts").f(1.0);
    assert!(matches!(
        decode_batch(&no_events.0),
        Err(WireError::Invalid(_))
    ));
}

#[test]
fn hashes_signed_unsigned_and_bytes_become_one_id() {
    let digest: Vec<u8> = (0..32).collect();
    let p = B::default()
        .arr(3)
        .f(0.0)
        .arr(1)
        .arr(2)
        .s("BlockRemoved")
        .arr(5)
        .i(-2)
        .u(u64::MAX)
        .i(i64::MIN)
        .bin(&digest)
        .bin(&[0, 0, 0, 0, 0, 0, 1, 2])
        .nil();
    let b = decode_batch(&p.0).unwrap();
    let KvEvent::BlockRemoved(r) = &b.events[0] else {
        panic!()
    };
    assert_eq!(
        r.block_hashes,
        vec![
            EngineHash((-2i64) as u64),
            EngineHash(u64::MAX),
            EngineHash(i64::MIN as u64),
            EngineHash::from_bytes(&digest),
            EngineHash(0x0102),
        ]
    );
    assert_ne!(
        EngineHash::from_bytes(&digest),
        EngineHash::from_bytes(&digest[1..])
    );
    // Bytes over the cap: the removal cannot be read, so the batch is lossy.
    let p = B::default()
        .arr(2)
        .f(0.0)
        .arr(1)
        .arr(2)
        .s("BlockRemoved")
        .arr(1)
        .bin(&[1; MAX_HASH_BYTES + 1]);
    let b = decode_batch(&p.0).unwrap();
    assert_eq!(b.skipped.lossy, 1);
}

#[test]
fn skipped_events_are_classified() {
    let p = B::default()
        .arr(3)
        .f(0.0)
        .arr(7)
        // unknown type, array and map form: safe to ignore
        .arr(2)
        .s("BlockPinned")
        .ints(&[1])
        .map(2)
        .s("type")
        .s("TierMoved")
        .s("block_hashes")
        .s("not a list")
        // BlockStored with a token id that is a string: the index just knows less
        .arr(5)
        .s("BlockStored")
        .ints(&[1])
        .nil()
        .arr(1)
        .s("x")
        .u(1)
        // BlockStored missing its block size
        .arr(4)
        .s("BlockStored")
        .ints(&[1])
        .nil()
        .ints(&[1])
        // BlockRemoved whose hashes are not a list: a removal is lost
        .arr(2)
        .s("BlockRemoved")
        .u(3)
        // an event that is a number, and a map without a type
        .u(5)
        .map(1)
        .s("block_hashes")
        .ints(&[1])
        .nil();
    let b = decode_batch(&p.0).unwrap();
    assert!(b.events.is_empty(), "{:?}", b.events);
    assert_eq!(
        b.skipped,
        Skipped {
            unknown_type: 2,
            stored: 2,
            lossy: 3,
            other_group: 0,
        }
    );
    assert_eq!(b.skipped.total(), 7);
}

#[test]
fn caps_refuse_before_allocating() {
    // More events than the cap: the whole batch is refused.
    let mut p = B::default()
        .arr(2)
        .f(0.0)
        .arr((MAX_EVENTS_PER_BATCH + 1) as u32);
    for _ in 0..=MAX_EVENTS_PER_BATCH {
        p = p.nil();
    }
    assert!(matches!(
        decode_batch(&p.0),
        Err(WireError::TooLarge {
            what: "events per batch",
            ..
        })
    ));
    // Too many token ids: that BlockStored is skipped, the next event still decodes.
    let mut p = B::default()
        .arr(2)
        .f(0.0)
        .arr(2)
        .arr(5)
        .s("BlockStored")
        .ints(&[1])
        .nil()
        .arr((MAX_TOKENS_PER_EVENT + 1) as u32);
    for _ in 0..=MAX_TOKENS_PER_EVENT {
        p = p.u(1);
    }
    let p = p.u(1).arr(1).s("AllBlocksCleared");
    let b = decode_batch(&p.0).unwrap();
    assert_eq!(b.skipped.stored, 1);
    assert_eq!(b.events, vec![KvEvent::AllBlocksCleared]);
    // A length claim beyond the bytes left is caught before any allocation.
    let p = B::default()
        .arr(2)
        .f(0.0)
        .raw(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
    assert_eq!(decode_batch(&p.0), Err(WireError::Truncated));
    let big = vec![0x90; MAX_PAYLOAD_BYTES + 1];
    assert!(matches!(
        decode_batch(&big),
        Err(WireError::TooLarge {
            what: "payload bytes",
            ..
        })
    ));
}

#[test]
fn deep_nesting_is_skipped_without_recursion() {
    let depth = 200_000;
    let mut p = B::default()
        .arr(2)
        .f(0.0)
        .arr(1)
        .map(2)
        .s("type")
        .s("AllBlocksCleared")
        .s("deep");
    for _ in 0..depth {
        p = p.arr(1);
    }
    let p = p.nil();
    let b = decode_batch(&p.0).unwrap();
    assert_eq!(b.events, vec![KvEvent::AllBlocksCleared]);
}

#[test]
fn broken_payloads_are_errors() {
    let good = encode_batch(
        &EventBatch {
            ts: Some(1.0),
            events: vec![stored(&[1, 2], None, &[1, 2, 3, 4], 2), removed(&[1])],
            dp_rank: Some(0),
            skipped: Skipped::default(),
        },
        Form::Array,
    );
    assert!(decode_batch(&good).is_ok());
    for cut in 0..good.len() {
        assert!(decode_batch(&good[..cut]).is_err(), "prefix {cut} accepted");
    }
    let mut trailing = good.clone();
    trailing.push(0);
    assert_eq!(decode_batch(&trailing), Err(WireError::TrailingBytes(1)));
    assert!(matches!(decode_batch(&[0xc1]), Err(WireError::Invalid(_))));
    assert!(matches!(decode_batch(b"\x05"), Err(WireError::Invalid(_))));
    // A reserved byte inside an unknown field still spoils the batch (not msgpack).
    let p = B::default().arr(3).f(0.0).arr(0).raw(&[0xc1]);
    assert!(decode_batch(&p.0).is_err());
    // A one-element batch array.
    assert!(decode_batch(&B::default().arr(1).f(0.0).0).is_err());
}

#[test]
fn tolerant_batch_fields() {
    // ts as a string and a negative rank are ignored, not fatal.
    let p = B::default().arr(4).s("yesterday").arr(0).i(-3).s("extra");
    let b = decode_batch(&p.0).unwrap();
    assert_eq!((b.ts, b.dp_rank), (None, None));
}

#[test]
fn frames_split_and_sequences_parse() {
    let seq = 5i64.to_be_bytes();
    let m = split_live(&[b"kv", &seq, b"\x90"]).unwrap();
    assert_eq!((m.topic, m.seq, m.payload), (&b"kv"[..], 5, &b"\x90"[..]));
    assert_eq!(split_live(&[&seq, b"x"]), Err(WireError::Frames(2)));
    assert_eq!(
        split_live(&[b"", &seq, b"x", b"y"]),
        Err(WireError::Frames(4))
    );
    assert_eq!(
        split_live(&[b"", &seq[..7], b"x"]),
        Err(WireError::SeqLength(7))
    );
    assert_eq!(
        split_replay(&[b"", &seq, b"p"]),
        Ok(ReplayReply::Batch {
            seq: 5,
            payload: b"p"
        })
    );
    assert_eq!(
        split_replay(&[&seq, b"p"]),
        Ok(ReplayReply::Batch {
            seq: 5,
            payload: b"p"
        })
    );
    let end = (-1i64).to_be_bytes();
    assert_eq!(split_replay(&[b"", &end, b""]), Ok(ReplayReply::End));
    assert_eq!(split_replay(&[b"x", &seq, b"p"]), Err(WireError::Frames(3)));
    assert_eq!(replay_request(3), [[0, 0, 0, 0, 0, 0, 0, 3]]);
    assert_eq!(parse_seq(&u64::MAX.to_be_bytes()), Ok(-1));
}

fn arb_event() -> impl Strategy<Value = KvEvent> {
    let hash = any::<u64>().prop_map(EngineHash);
    let medium = proptest::option::of(prop_oneof![Just("GPU"), Just("CPU")].prop_map(Box::from));
    prop_oneof![
        (
            proptest::collection::vec(hash.clone(), 0..6),
            proptest::option::of(hash.clone()),
            proptest::collection::vec(any::<u32>(), 0..20),
            1u32..64,
            proptest::option::of(any::<i64>()),
            medium.clone(),
        )
            .prop_map(
                |(block_hashes, parent, token_ids, block_size, lora_id, medium)| {
                    KvEvent::BlockStored(BlockStored {
                        block_hashes,
                        parent,
                        token_ids,
                        block_size,
                        lora_id,
                        medium,
                        cache_salt: None,
                        lora_name: None,
                    })
                }
            ),
        (proptest::collection::vec(hash, 0..6), medium).prop_map(|(block_hashes, medium)| {
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes,
                medium,
            })
        }),
        Just(KvEvent::AllBlocksCleared),
    ]
}

proptest! {
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_batch(&bytes);
        let (a, b) = bytes.split_at(bytes.len() / 2);
        let _ = split_live(&[a, b, &bytes]);
        let _ = split_replay(&[a, b]);
    }

    #[test]
    fn mutated_batches_never_panic(
        events in proptest::collection::vec(arb_event(), 0..5),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4),
    ) {
        let batch = EventBatch { ts: Some(1.0), events, dp_rank: Some(1), skipped: Skipped::default() };
        for form in [Form::Array, Form::MapEvents, Form::Map] {
            let mut bytes = encode_batch(&batch, form);
            for &(at, v) in &flips {
                let n = bytes.len();
                bytes[at % n] = v;
            }
            let _ = decode_batch(&bytes);
        }
    }

    #[test]
    fn every_form_round_trips(
        events in proptest::collection::vec(arb_event(), 0..8),
        ts in proptest::option::of(-1e9f64..1e9),
        dp_rank in proptest::option::of(0u32..64),
    ) {
        let batch = EventBatch { ts: Some(ts.unwrap_or(0.0)), events, dp_rank, skipped: Skipped::default() };
        for form in [Form::Array, Form::MapEvents, Form::Map] {
            let decoded = decode_batch(&encode_batch(&batch, form)).unwrap();
            prop_assert_eq!(&decoded, &batch, "{:?}", form);
        }
    }
}

#[test]
fn sglang_0_5_23_map_events_carry_tier_and_namespace() {
    // What msgspec writes for SGLang 0.5.23 (tag=True, omit_defaults): events as maps, optional
    // fields present only when set; the batch a 3-element array.
    let p = B::default()
        .arr(3)
        .f(1.5)
        .arr(3)
        .map(8)
        .s("type")
        .s("BlockStored")
        .s("block_hashes")
        .ints(&[7])
        .s("parent_block_hash")
        .nil()
        .s("token_ids")
        .ints(&[1, 2])
        .s("block_size")
        .u(2)
        .s("lora_id")
        .nil()
        .s("medium")
        .s("CPU_PINNED")
        .s("cache_salt")
        .s("tenant-a")
        .map(3)
        .s("type")
        .s("BlockRemoved")
        .s("block_hashes")
        .ints(&[7])
        .s("medium")
        .s("GPU")
        .map(2)
        .s("type")
        .s("BlockStored")
        .s("lora_name")
        .s("sql-adapter")
        .u(0);
    let b = decode_batch(&p.0).unwrap();
    assert_eq!(b.dp_rank, Some(0));
    let KvEvent::BlockStored(s) = &b.events[0] else {
        panic!("{b:?}")
    };
    assert_eq!(s.tier(), Tier::Host);
    assert_eq!(s.cache_salt.as_deref(), Some("tenant-a"));
    let KvEvent::BlockRemoved(r) = &b.events[1] else {
        panic!("{b:?}")
    };
    assert_eq!(r.tier(), Tier::Device);
    // A store missing its required fields is skipped (the index knows less), not lossy.
    assert_eq!(b.events.len(), 2);
    assert_eq!(b.skipped.stored, 1);
    for (medium, tier) in [
        (None, Tier::Device),
        (Some("GPU"), Tier::Device),
        (Some("CPU_PINNED"), Tier::Host),
        (Some("CPU"), Tier::Host),
        (Some("DISK"), Tier::Storage),
        (Some("EXTERNAL"), Tier::Storage),
        (Some("NVME_OF_THE_FUTURE"), Tier::Storage),
    ] {
        assert_eq!(Tier::of(medium), tier, "{medium:?}");
    }
}

/// A vLLM 0.33 `BlockStored` (map form, `omit_defaults`: `extra_keys` only when some block has
/// keys) of two 2-token blocks, `extra` written by `keys`.
fn vllm_stored(parent: Option<u64>, lora: Option<&str>, keys: impl FnOnce(B) -> B) -> Vec<u8> {
    let b = B::default()
        .arr(3)
        .f(1.0)
        .arr(1)
        .map(9)
        .s("type")
        .s("BlockStored")
        .s("block_hashes")
        .ints(&[u64::MAX - 1, 1 << 63])
        .s("parent_block_hash");
    let b = match parent {
        Some(p) => b.u(p),
        None => b.nil(),
    };
    let b = b
        .s("token_ids")
        .ints(&[1, 2, 3, 4])
        .s("block_size")
        .u(2)
        .s("lora_id")
        .nil()
        .s("medium")
        .s("GPU")
        .s("lora_name");
    let b = match lora {
        Some(l) => b.s(l),
        None => b.nil(),
    };
    keys(b.s("extra_keys")).nil().0
}

fn stored_of(payload: &[u8]) -> Result<BlockStored, EventBatch> {
    let b = decode_batch(payload).unwrap();
    match b.events.first() {
        Some(KvEvent::BlockStored(s)) => Ok(s.clone()),
        _ => Err(b),
    }
}

#[test]
fn vllm_salt_is_read_from_the_first_blocks_extra_keys() {
    // Salted, no adapter: the first block carries the salt, the second nothing.
    let p = vllm_stored(None, None, |b| b.arr(2).arr(1).s("tenant-a").nil());
    let s = stored_of(&p).unwrap();
    assert_eq!(s.cache_salt.as_deref(), Some("tenant-a"));
    assert_eq!(s.lora_name, None);
    // An adapter's name comes first in every block; the salt after it (and after any
    // multimodal pair, a list, and before a prompt-embedding digest, bytes).
    let p = vllm_stored(None, Some("sql-lora"), |b| {
        b.arr(2)
            .arr(4)
            .s("sql-lora")
            .arr(2)
            .s("img-hash")
            .u(0)
            .s("tenant-b")
            .bin(&[9; 32])
            .arr(1)
            .s("sql-lora")
    });
    let s = stored_of(&p).unwrap();
    assert_eq!(s.cache_salt.as_deref(), Some("tenant-b"));
    assert_eq!(s.lora_name.as_deref(), Some("sql-lora"));
    // The adapter's key alone is no salt.
    let p = vllm_stored(None, Some("sql-lora"), |b| {
        b.arr(2).arr(1).s("sql-lora").arr(1).s("sql-lora")
    });
    assert_eq!(stored_of(&p).unwrap().cache_salt, None);
    // Only multimodal keys, or none at all: no salt.
    let p = vllm_stored(None, None, |b| b.arr(2).arr(1).arr(2).s("img").u(3).nil());
    assert_eq!(stored_of(&p).unwrap().cache_salt, None);
    let p = vllm_stored(None, None, |b| b.nil());
    assert_eq!(stored_of(&p).unwrap().cache_salt, None);
    let p = vllm_stored(None, None, |b| b.arr(0));
    assert_eq!(stored_of(&p).unwrap().cache_salt, None);
    // A later block's strings are not the first block's (a continuation carries none: its
    // namespace is its parent's).
    let p = vllm_stored(Some(5), None, |b| b.arr(2).nil().arr(1).s("x"));
    assert_eq!(stored_of(&p).unwrap().cache_salt, None);
    // SGLang's own field wins when both came.
    let mut p = vllm_stored(None, None, |b| b.arr(1).arr(1).s("from-keys"));
    // Rewrite the event map's length (fixmap 9 → 10) and append a `cache_salt` member before
    // the batch's dp rank.
    let at = p.iter().position(|&x| x == 0x89).unwrap();
    p[at] = 0x8a;
    p.pop();
    let p = B(p).s("cache_salt").s("field").nil().0;
    assert_eq!(stored_of(&p).unwrap().cache_salt.as_deref(), Some("field"));
}

#[test]
fn vllm_extra_keys_of_another_shape_drop_the_store() {
    // It may hold a salt the decoder cannot read: dropped (the index knows less), never filed
    // in the default namespace; the batch is not lossy.
    let long = "s".repeat(MAX_NAMESPACE_BYTES + 1);
    for keys in [
        &(|b: B| b.s("tenant")) as &dyn Fn(B) -> B,
        &|b: B| b.arr(1).s("tenant"),
        &|b: B| b.arr(1).u(3),
        &|b: B| b.arr(1).arr(1).s(&long),
    ] {
        let p = vllm_stored(None, None, keys);
        let b = stored_of(&p).unwrap_err();
        assert_eq!(b.skipped.stored, 1);
        assert_eq!(b.skipped.lossy, 0);
    }
    // A long string past the first two is skipped unread.
    let p = vllm_stored(None, Some("a"), |b| {
        b.arr(1).arr(3).s("a").s("salt").s(&long)
    });
    assert_eq!(stored_of(&p).unwrap().cache_salt.as_deref(), Some("salt"));
}

#[test]
fn vllm_array_form_reads_extra_keys_after_lora_name() {
    let p = B::default()
        .arr(3)
        .f(1.0)
        .arr(1)
        .arr(10)
        .s("BlockStored")
        .ints(&[1])
        .nil()
        .ints(&[1, 2])
        .u(2)
        .nil()
        .s("GPU")
        .s("sql-lora")
        .arr(1)
        .arr(2)
        .s("sql-lora")
        .s("tenant-c")
        .u(0)
        .nil()
        .0;
    let s = stored_of(&p).unwrap();
    assert_eq!(s.cache_salt.as_deref(), Some("tenant-c"));
    assert_eq!(s.lora_name.as_deref(), Some("sql-lora"));
}

proptest! {
    /// Whatever a vLLM first block's keys hold around the salt (multimodal pairs, digests, an
    /// adapter's name first), the salt read is the one written, and an unsalted store has none.
    #[test]
    fn vllm_salt_survives_any_other_keys(
        salt in proptest::option::of("[a-z0-9]{1,12}"),
        lora in proptest::option::of("[a-z-]{1,8}"),
        mm in 0usize..3,
        digests in 0usize..2,
        later in 0usize..3,
    ) {
        let (salt2, lora2) = (salt.clone(), lora.clone());
        let p = vllm_stored(None, lora.as_deref(), move |b| {
            let n = usize::from(lora2.is_some()) + mm + usize::from(salt2.is_some()) + digests;
            let mut b = b.arr(1 + later as u32).arr(n as u32);
            if let Some(l) = &lora2 {
                b = b.s(l);
            }
            for i in 0..mm {
                b = b.arr(2).s("mm").u(i as u64);
            }
            if let Some(s) = &salt2 {
                b = b.s(s);
            }
            for _ in 0..digests {
                b = b.bin(&[1; 32]);
            }
            for _ in 0..later {
                b = b.nil();
            }
            b
        });
        let s = stored_of(&p).unwrap();
        prop_assert_eq!(s.cache_salt.as_deref(), salt.as_deref());
        prop_assert_eq!(s.lora_name.as_deref(), lora.as_deref());
    }
}

/// A vLLM map-form store of `hashes` (4 tokens each, from the root) by KV-cache group `group`.
fn grouped_store(b: B, hashes: &[u64], group: Option<u64>, medium: Option<&str>) -> B {
    let n = 5 + u32::from(group.is_some()) + u32::from(medium.is_some());
    let mut b = b
        .map(n)
        .s("type")
        .s("BlockStored")
        .s("block_hashes")
        .ints(hashes)
        .s("parent_block_hash")
        .nil()
        .s("token_ids")
        .ints(&vec![7; hashes.len() * 4])
        .s("block_size")
        .u(4);
    if let Some(g) = group {
        b = b.s("group_idx").u(g);
    }
    if let Some(m) = medium {
        b = b.s("medium").s(m);
    }
    b
}

/// A vLLM map-form removal of `hashes` by KV-cache group `group`.
fn grouped_removal(b: B, hashes: &[u64], group: Option<u64>, medium: Option<&str>) -> B {
    let n = 2 + u32::from(group.is_some()) + u32::from(medium.is_some());
    let mut b = b
        .map(n)
        .s("type")
        .s("BlockRemoved")
        .s("block_hashes")
        .ints(hashes);
    if let Some(g) = group {
        b = b.s("group_idx").u(g);
    }
    if let Some(m) = medium {
        b = b.s("medium").s(m);
    }
    b
}

/// Hashes of the events a batch kept, as ("S"|"R", hashes).
fn kept(b: &EventBatch) -> Vec<(&'static str, Vec<u64>)> {
    b.events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored(s) => ("S", s.block_hashes.iter().map(|h| h.0).collect()),
            KvEvent::BlockRemoved(r) => ("R", r.block_hashes.iter().map(|h| h.0).collect()),
            KvEvent::AllBlocksCleared => ("C", vec![]),
        })
        .collect()
}

fn batch_of(events: u32, f: impl FnOnce(B) -> B) -> Vec<u8> {
    f(B::default().arr(2).f(1.0).arr(events)).0
}

/// vLLM 0.33 files every block once per KV-cache group (`group_idx`) under the same hash: a
/// hybrid model's sliding-window group evicting a block the full-attention group still holds
/// must not drop it, whichever group number each kind has; the last group's removal does.
#[test]
fn vllm_kv_cache_groups_keep_a_block_while_any_group_holds_it() {
    for (first, second) in [(0, 1), (1, 0), (0, 5)] {
        let mut groups = Groups::default();
        // Both groups store H1, H2 in one step; the second group's store adds nothing.
        let p = batch_of(2, |b| {
            let b = grouped_store(b, &[11, 12], Some(first), None);
            grouped_store(b, &[11, 12], Some(second), None)
        });
        let b = decode_batch_in(&p, &mut groups).unwrap();
        assert_eq!(kept(&b), [("S", vec![11, 12])], "{first}/{second}");
        assert_eq!(b.skipped.other_group, 1);
        assert_eq!(b.skipped.lossy, 0);
        // The second group evicts both: the first still holds them, nothing is removed.
        let p = batch_of(1, |b| grouped_removal(b, &[11, 12], Some(second), None));
        let b = decode_batch_in(&p, &mut groups).unwrap();
        assert_eq!(kept(&b), []);
        assert_eq!(b.skipped.other_group, 1);
        // The first group's eviction of H1 is its last copy: removed; H2 stays.
        let p = batch_of(1, |b| grouped_removal(b, &[11], Some(first), None));
        let b = decode_batch_in(&p, &mut groups).unwrap();
        assert_eq!(kept(&b), [("R", vec![11])]);
        assert_eq!(b.skipped.other_group, 0);
        // A removal naming a held and an untracked block is thinned to what leaves.
        let p = batch_of(2, |b| {
            let b = grouped_store(b, &[13], Some(second), None);
            grouped_removal(b, &[12, 13, 99], Some(second), None)
        });
        let b = decode_batch_in(&p, &mut groups).unwrap();
        assert_eq!(kept(&b), [("S", vec![13]), ("R", vec![13, 99])]);
        assert_eq!(b.skipped.other_group, 1, "H2 is still the first group's");
        // A group storing a block again after its own eviction re-adds it only if no group
        // held it.
        let p = batch_of(1, |b| grouped_store(b, &[11, 12], Some(second), None));
        let b = decode_batch_in(&p, &mut groups).unwrap();
        assert_eq!(kept(&b), [("S", vec![11, 12])]);
    }
}

/// Tiers are apart per group too, `AllBlocksCleared` forgets every group, and a publisher
/// whose events name group 0 only (one group) or none (SGLang) is not touched at all.
#[test]
fn kv_cache_groups_leave_tiers_sglang_and_single_group_servers_alone() {
    let mut groups = Groups::default();
    let p = batch_of(3, |b| {
        let b = grouped_store(b, &[21], Some(0), None);
        let b = grouped_store(b, &[21], Some(1), None);
        grouped_store(b, &[21], Some(1), Some("CPU"))
    });
    let b = decode_batch_in(&p, &mut groups).unwrap();
    assert_eq!(
        kept(&b),
        [("S", vec![21]), ("S", vec![21])],
        "another tier is new"
    );
    // The host copy's only group lets it go: removed, the device copy untouched.
    let p = batch_of(1, |b| grouped_removal(b, &[21], Some(1), Some("CPU")));
    assert_eq!(
        kept(&decode_batch_in(&p, &mut groups).unwrap()),
        [("R", vec![21])]
    );
    // Cleared: the next removal of any group is applied as it comes.
    let p = batch_of(2, |b| {
        let b = b.map(1).s("type").s("AllBlocksCleared");
        grouped_removal(b, &[21], Some(1), None)
    });
    let b = decode_batch_in(&p, &mut groups).unwrap();
    assert_eq!(kept(&b), [("C", vec![]), ("R", vec![21])]);
    // One group (vLLM with a single group) or none (SGLang): every event as it came, a
    // repeated store included.
    for group in [Some(0), None] {
        let mut groups = Groups::default();
        let p = batch_of(3, |b| {
            let b = grouped_store(b, &[31], group, None);
            let b = grouped_store(b, &[31], group, None);
            grouped_removal(b, &[31], group, None)
        });
        let b = decode_batch_in(&p, &mut groups).unwrap();
        assert_eq!(
            kept(&b),
            [("S", vec![31]), ("S", vec![31]), ("R", vec![31])],
            "{group:?}"
        );
        assert_eq!(b.skipped, Skipped::default());
    }
    // A group of another type (a string) is no group.
    let mut groups = Groups::default();
    let p = batch_of(3, |b| {
        let b = grouped_store(b, &[41], Some(0), None);
        let b = b
            .map(6)
            .s("type")
            .s("BlockStored")
            .s("block_hashes")
            .ints(&[41])
            .s("parent_block_hash")
            .nil()
            .s("token_ids")
            .ints(&[7; 4])
            .s("block_size")
            .u(4)
            .s("group_idx")
            .s("one");
        grouped_removal(b, &[41], Some(1), None)
    });
    let b = decode_batch_in(&p, &mut groups).unwrap();
    // The unnamed store passes as it came; group 0 still holds the block group 1 lets go.
    assert_eq!(kept(&b), [("S", vec![41]), ("S", vec![41])]);
    assert_eq!(b.skipped.other_group, 1);
}

/// vLLM's array form: `group_idx` follows `extra_keys` in a store and `medium` in a removal.
#[test]
fn vllm_array_form_reads_group_idx_in_place() {
    let store = |b: B, g: u64| {
        b.arr(10)
            .s("BlockStored")
            .ints(&[51])
            .nil()
            .ints(&[7; 4])
            .u(4)
            .nil()
            .s("GPU")
            .nil()
            .nil()
            .u(g)
    };
    let mut groups = Groups::default();
    let p = batch_of(3, |b| {
        let b = store(b, 0);
        let b = store(b, 1);
        b.arr(4).s("BlockRemoved").ints(&[51]).s("GPU").u(1)
    });
    let b = decode_batch_in(&p, &mut groups).unwrap();
    assert_eq!(kept(&b), [("S", vec![51])]);
    assert_eq!(b.skipped.other_group, 2);
}
