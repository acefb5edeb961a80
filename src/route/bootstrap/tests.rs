use super::*;
use crate::route::extract::extract;
use proptest::prelude::*;
use serde_json::{json, Value};

fn one(host: &str, port: Option<u16>, room: u64) -> Vec<u8> {
    let rooms = [room];
    splice_ok(
        br#"{"text":"hi","stream":true}"#,
        &Bootstrap {
            host,
            port,
            rooms: &rooms,
            batch: false,
        },
    )
}

fn splice_ok(body: &[u8], b: &Bootstrap) -> Vec<u8> {
    let out = splice(body, b).unwrap();
    assert_eq!(
        out.capacity(),
        out.len(),
        "one allocation of the exact size"
    );
    out
}

#[test]
fn fields_go_before_the_closing_brace_and_keep_every_original_byte() {
    let out = one("10.0.0.7", Some(8998), 42);
    assert_eq!(
        std::str::from_utf8(&out).unwrap(),
        r#"{"text":"hi","stream":true,"bootstrap_host":"10.0.0.7","bootstrap_port":8998,"bootstrap_room":42}"#
    );
    let out = one("p", None, u64::MAX >> 1);
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["bootstrap_port"], Value::Null);
    assert_eq!(v["bootstrap_room"], json!(u64::MAX >> 1));
}

#[test]
fn empty_objects_and_whitespace_are_handled() {
    let rooms = [7];
    let b = Bootstrap {
        host: "h",
        port: Some(1),
        rooms: &rooms,
        batch: false,
    };
    let out = splice_ok(b"  { \n }\n", &b);
    assert_eq!(
        std::str::from_utf8(&out).unwrap(),
        "  { \n \"bootstrap_host\":\"h\",\"bootstrap_port\":1,\"bootstrap_room\":7}\n"
    );
    let out = splice_ok(b"{}", &b);
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        v,
        json!({"bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":7})
    );
    for bad in [&b"[1]"[..], b"", b"  ", b"\"{}\"", b"{"] {
        assert!(
            splice(bad, &b).is_err(),
            "{:?}",
            String::from_utf8_lossy(bad)
        );
    }
}

#[test]
fn batches_get_one_room_per_item_and_client_values_lose() {
    let rooms = [1, 22, 333];
    let b = Bootstrap {
        host: "h\"x",
        port: None,
        rooms: &rooms,
        batch: true,
    };
    let out = splice_ok(br#"{"text":["a","b","c"],"bootstrap_room":9}"#, &b);
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        v["bootstrap_room"],
        json!([1, 22, 333]),
        "the last duplicate wins"
    );
    assert_eq!(v["bootstrap_host"], json!("h\"x"));
    let empty = Bootstrap {
        host: "h",
        port: None,
        rooms: &[],
        batch: true,
    };
    let v: Value = serde_json::from_slice(&splice_ok(b"{\"a\":1}", &empty)).unwrap();
    assert_eq!(v["bootstrap_room"], json!([]));
}

#[test]
fn batch_shapes_follow_the_api() {
    let of = |api, body: &str| pd_shape(api, &extract(api, body.as_bytes()).unwrap().shape);
    let shape = |api, body: &str| of(api, body).unwrap().batch;
    assert_eq!(shape(Api::Generate, r#"{"text":"a"}"#), None);
    assert_eq!(shape(Api::Generate, r#"{"text":["a","b"]}"#), Some(2));
    assert_eq!(shape(Api::Generate, r#"{"input_ids":[1,2,3]}"#), None);
    assert_eq!(
        shape(Api::Generate, r#"{"input_ids":[[1],[2],[3]]}"#),
        Some(3)
    );
    assert_eq!(shape(Api::Completions, r#"{"prompt":"a"}"#), None);
    assert_eq!(shape(Api::Completions, r#"{"prompt":[1,2]}"#), None);
    assert_eq!(shape(Api::Completions, r#"{"prompt":["a","b"]}"#), Some(2));
    assert_eq!(shape(Api::Completions, r#"{"prompt":[[1],[2]]}"#), Some(2));
    assert_eq!(shape(Api::Chat, r#"{"messages":[],"n":1}"#), None);
    assert_eq!(shape(Api::Chat, r#"{"messages":[],"n":3}"#), Some(3));
    assert_eq!(
        shape(Api::Chat, r#"{"messages":[],"n":"x"}"#),
        None,
        "lenient"
    );
    assert!(of(Api::Chat, r#"{"messages":[],"n":100000}"#).is_err());
    assert_eq!(shape(Api::Generate, r#"{"text":[]}"#), Some(0));
    assert_eq!(
        shape(Api::Generate, r#"{"text":"a","input_ids":[[1],[2]]}"#),
        Some(2),
        "a batch of token lists beside one text"
    );
    // A batch past the routing text's cap is still counted whole.
    let many: Vec<String> = (0..3000)
        .map(|i| format!("\"prompt number {i} {}\"", "x".repeat(60)))
        .collect();
    let body = format!(r#"{{"prompt":[{}]}}"#, many.join(","));
    assert_eq!(shape(Api::Completions, &body), Some(3000));
    let lp = |body: &str| of(Api::Generate, body).unwrap().return_logprob;
    assert!(
        !lp(r#"{"text":"a","return_logprob":1}"#),
        "lenient: not a bool"
    );
    assert!(lp(
        r#"{"text":"a","return_logprob":true,"logprob_start_len":0}"#
    ));
    assert!(!lp(r#"{"text":"a"}"#));
}

#[test]
fn rooms_fit_63_bits() {
    assert_eq!(room(u64::MAX), u64::MAX >> 1);
    assert_eq!(room(5), 5);
}

/// Arbitrary JSON values, a few levels deep.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        ".{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(".{0,6}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    /// For any JSON object, the spliced body parses, keeps every original field, and carries
    /// the three new ones.
    #[test]
    fn spliced_bodies_parse_with_original_fields_and_the_new_ones(
        fields in prop::collection::btree_map("[a-z_]{0,8}", json_value(), 0..6),
        pretty in any::<bool>(),
        host in "[a-z0-9.-]{1,20}",
        port in prop::option::of(1u16..),
        rooms in prop::collection::vec(any::<u64>().prop_map(room), 1..5),
        batch in any::<bool>(),
    ) {
        let original: serde_json::Map<String, Value> = fields
            .into_iter()
            .filter(|(k, _)| !k.starts_with("bootstrap_"))
            .collect();
        let obj = Value::Object(original.clone());
        let body = if pretty {
            serde_json::to_vec_pretty(&obj).unwrap()
        } else {
            serde_json::to_vec(&obj).unwrap()
        };
        let b = Bootstrap { host: &host, port, rooms: &rooms, batch };
        let out = splice(&body, &b).unwrap();
        prop_assert_eq!(out.capacity(), out.len());
        // Compared as the same parser reads the original (float text round trips are its own).
        let original = match serde_json::from_slice::<Value>(&body).unwrap() {
            Value::Object(m) => m,
            _ => unreachable!(),
        };
        let v: Value = serde_json::from_slice(&out).unwrap();
        let m = v.as_object().unwrap();
        for (k, val) in &original {
            prop_assert_eq!(m.get(k), Some(val));
        }
        prop_assert_eq!(m.len(), original.len() + 3);
        prop_assert_eq!(&m["bootstrap_host"], &json!(host));
        prop_assert_eq!(&m["bootstrap_port"], &json!(port));
        let want = if batch { json!(rooms) } else { json!(rooms[0]) };
        prop_assert_eq!(&m["bootstrap_room"], &want);
        // Every original byte is still there, in order, before the new members.
        let close = body.iter().rposition(|&c| c == b'}').unwrap();
        prop_assert_eq!(&out[..close], &body[..close]);
    }
}

#[test]
fn the_dp_rank_is_spliced_last_and_replaces_the_clients() {
    let body = br#"{"text":"hi", "stream":true}"#;
    let out = splice_dp_rank(body, 3).unwrap();
    assert_eq!(
        out.capacity(),
        out.len(),
        "one allocation of the exact size"
    );
    let body = br#"{"text":"hi", "data_parallel_rank": 7 ,"stream":true}"#;
    let out = splice_dp_rank(body, 3).unwrap();
    assert_eq!(
        out,
        br#"{"text":"hi", "stream":true,"data_parallel_rank":3}"#
    );
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["data_parallel_rank"], json!(3), "the last duplicate wins");
    assert_eq!(
        splice_dp_rank(b" {\n} ", 12).unwrap(),
        b" {\n\"data_parallel_rank\":12} "
    );
    for bad in [&b"[1]"[..], b"", b"  ", b"{", b"\"x\""] {
        assert!(splice_dp_rank(bad, 0).is_err());
    }
}

#[test]
fn bootstrap_fields_and_the_dp_rank_go_in_together() {
    let rooms = [5];
    let b = Bootstrap {
        host: "h",
        port: None,
        rooms: &rooms,
        batch: false,
    };
    let added = Added {
        bootstrap: Some(b),
        dp_rank: Some(1),
        prefill_dp_rank: None,
        priority: None,
    };
    let out = splice_fields(br#"{"a":1}"#, &added).unwrap();
    assert_eq!(out.capacity(), out.len());
    assert_eq!(
        out,
        br#"{"a":1,"bootstrap_host":"h","bootstrap_port":null,"bootstrap_room":5,"data_parallel_rank":1}"#
    );
    let none = splice_fields(br#"{"a":1}"#, &Added::default()).unwrap();
    assert_eq!(none, br#"{"a":1}"#, "nothing added: the body as it was");
}

proptest! {
    /// For any JSON object and rank, the spliced body parses, keeps every original field and
    /// carries the rank; its bytes are the original's up to the closing brace.
    #[test]
    fn dp_rank_splices_keep_every_field(
        fields in prop::collection::btree_map("[a-z_]{0,8}", json_value(), 0..6),
        pretty in any::<bool>(),
        rank in any::<u32>(),
    ) {
        let obj = Value::Object(fields.into_iter().filter(|(k, _)| k != "data_parallel_rank").collect());
        let body = if pretty { serde_json::to_vec_pretty(&obj).unwrap() } else { serde_json::to_vec(&obj).unwrap() };
        let out = splice_dp_rank(&body, rank).unwrap();
        prop_assert_eq!(out.capacity(), out.len());
        let original = serde_json::from_slice::<Value>(&body).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        let m = v.as_object().unwrap();
        for (k, val) in original.as_object().unwrap() {
            prop_assert_eq!(m.get(k), Some(val));
        }
        prop_assert_eq!(&m["data_parallel_rank"], &json!(rank));
        let close = body.iter().rposition(|&c| c == b'}').unwrap();
        prop_assert_eq!(&out[..close], &body[..close]);
    }
}

#[test]
fn a_clients_own_gateway_fields_are_replaced_not_duplicated() {
    let added = Added {
        bootstrap: None,
        dp_rank: Some(3),
        prefill_dp_rank: None,
        priority: None,
    };
    for (body, want) in [
        (
            r#"{"data_parallel_rank":9,"prompt":"a"}"#,
            r#"{"prompt":"a","data_parallel_rank":3}"#,
        ),
        (
            r#"{"prompt":"a", "data_parallel_rank" : [1, {"x":"}"}] }"#,
            r#"{"prompt":"a" ,"data_parallel_rank":3}"#,
        ),
        (
            r#"{ "data_parallel_rank":null }"#,
            r#"{  "data_parallel_rank":3}"#,
        ),
        (
            r#"{"a":"\"data_parallel_rank\"","data_parallel_rank":1,"b":2}"#,
            r#"{"a":"\"data_parallel_rank\"","b":2,"data_parallel_rank":3}"#,
        ),
        (
            r#"{"prompt":"data_parallel_rank"}"#,
            r#"{"prompt":"data_parallel_rank","data_parallel_rank":3}"#,
        ),
        (
            r#"{"nested":{"data_parallel_rank":1},"p":1}"#,
            r#"{"nested":{"data_parallel_rank":1},"p":1,"data_parallel_rank":3}"#,
        ),
        // A run of the gateway's keys ending the object: the comma before the run goes too.
        (
            r#"{"p":1, "data_parallel_rank":1,"bootstrap_room":2 }"#,
            r#"{"p":1 ,"data_parallel_rank":3}"#,
        ),
        (
            r#"{"data_parallel_rank":1, "bootstrap_host":"h","p":1}"#,
            r#"{"p":1,"data_parallel_rank":3}"#,
        ),
        (
            r#"{"bootstrap_port":1,"data_parallel_rank":2}"#,
            r#"{"data_parallel_rank":3}"#,
        ),
    ] {
        let out = splice_fields(body.as_bytes(), &added).unwrap();
        let out = String::from_utf8(out).unwrap();
        assert_eq!(out, want, "{body}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["data_parallel_rank"], 3);
    }
    // All four PD fields at once, sent by the client in the middle of the object.
    let b = Bootstrap {
        host: "10.0.0.1",
        port: Some(8998),
        rooms: &[7],
        batch: false,
    };
    let body = r#"{"bootstrap_room":1,"bootstrap_host":"evil","x":1,"bootstrap_port":2}"#;
    let out = String::from_utf8(splice(body.as_bytes(), &b).unwrap()).unwrap();
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["bootstrap_host"], "10.0.0.1");
    assert_eq!(v["bootstrap_room"], 7);
    assert_eq!(out.matches("bootstrap_host").count(), 1, "{out}");
    assert_eq!(out.matches("bootstrap_room").count(), 1, "{out}");
    assert_eq!(out.matches("bootstrap_port").count(), 1, "{out}");
}

#[test]
fn the_decode_side_learns_its_prefill_twins_rank() {
    let b = Bootstrap {
        host: "10.0.0.1",
        port: Some(8998),
        rooms: &[5],
        batch: false,
    };
    let added = Added {
        bootstrap: Some(b),
        dp_rank: Some(2),
        prefill_dp_rank: Some(7),
        priority: None,
    };
    let body = br#"{"text":"hi","disagg_prefill_dp_rank":1,"data_parallel_rank":0}"#;
    let out = splice_fields(body, &added).unwrap();
    assert_eq!(
        out.capacity(),
        out.len(),
        "one allocation of the exact size"
    );
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["data_parallel_rank"], 2);
    assert_eq!(v["disagg_prefill_dp_rank"], 7);
    assert_eq!(v["bootstrap_room"], 5);
    let text = String::from_utf8(out).unwrap();
    assert_eq!(text.matches("disagg_prefill_dp_rank").count(), 1, "{text}");
    // Only the prefill twin's rank, without a bootstrap (never sent so, but well formed).
    let only = Added {
        prefill_dp_rank: Some(3),
        ..Added::default()
    };
    let out = splice_fields(br#"{}"#, &only).unwrap();
    assert_eq!(out, br#"{"disagg_prefill_dp_rank":3}"#);
}

#[test]
fn the_gateways_priority_replaces_the_clients_of_any_type_and_only_when_given() {
    for body in [
        &br#"{"text":"hi","priority":1000000}"#[..],
        br#"{"priority":"1000000","text":"hi"}"#,
        br#"{"text":"hi","priority":1e6,"n":2}"#,
        br#"{"text":"hi"}"#,
    ] {
        let added = Added {
            priority: Some(-4),
            ..Added::default()
        };
        let out = splice_fields(body, &added).unwrap();
        assert_eq!(out.capacity(), out.len());
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.matches("priority").count(), 1, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["priority"], -4, "{text}");
        assert_eq!(v["text"], "hi");
    }
    // With a rank as well, both go in.
    let both = Added {
        dp_rank: Some(1),
        priority: Some(0),
        ..Added::default()
    };
    let out = splice_fields(br#"{"priority":9,"text":"x"}"#, &both).unwrap();
    assert_eq!(out, br#"{"text":"x","data_parallel_rank":1,"priority":0}"#);
    // Without a class, a client's priority stays as it is (a rank alone is spliced).
    let rank = Added {
        dp_rank: Some(2),
        ..Added::default()
    };
    let out = splice_fields(br#"{"priority":9}"#, &rank).unwrap();
    assert_eq!(out, br#"{"priority":9,"data_parallel_rank":2}"#);
    assert_eq!(
        splice_routed(br#"{"priority":9}"#, &Added::default()),
        Ok(None)
    );
    for p in [i32::MIN, i32::MAX, 0, -1, 10] {
        let a = Added {
            priority: Some(p),
            ..Added::default()
        };
        let out = splice_fields(br#"{}"#, &a).unwrap();
        assert_eq!(out.capacity(), out.len(), "{p}");
        assert_eq!(
            String::from_utf8(out).unwrap(),
            format!(r#"{{"priority":{p}}}"#)
        );
    }
}
