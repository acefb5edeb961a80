use super::*;

#[test]
fn cache_namespace_fields_are_read_and_prefix_the_text() {
    let plain = extract(
        Api::Chat,
        br#"{"messages":[{"role":"user","content":"hi"}]}"#,
    )
    .unwrap();
    assert!(plain.namespace.is_default());
    assert_eq!(plain.text, "hi");
    let body = br#"{"cache_salt":"tenant-a","messages":[{"role":"user","content":"hi"}],
        "lora_path":"sql","extra_key":"k"}"#;
    let salted = extract(Api::Chat, body).unwrap();
    assert_eq!(salted.namespace.cache_salt.as_deref(), Some("tenant-a"));
    assert_eq!(salted.namespace.lora_path.as_deref(), Some("sql"));
    assert_eq!(salted.namespace.extra_key.as_deref(), Some("k"));
    let marker = salted.namespace.marker().unwrap();
    assert_eq!(salted.text, format!("{marker}hi"));
    assert_eq!(marker.len(), 18);
    assert!(marker.starts_with('\u{1}') && marker.ends_with('\u{1}'));
    // Another salt, another marker; empty strings, lists (a batch's per-item values) and
    // other shapes are no namespace and are never refused.
    let b = extract(
        Api::Completions,
        br#"{"prompt":"hi","cache_salt":"tenant-b"}"#,
    )
    .unwrap();
    assert_ne!(b.namespace.marker(), Some(marker));
    for body in [
        &br#"{"prompt":"hi","cache_salt":"","lora_path":null}"#[..],
        br#"{"prompt":"hi","lora_path":["a","b"],"extra_key":7}"#,
        br#"{"prompt":"hi","cache_salt":{"x":[1]}}"#,
    ] {
        let info = extract(Api::Completions, body).unwrap();
        assert!(
            info.namespace.is_default(),
            "{}",
            String::from_utf8_lossy(body)
        );
        assert_eq!(info.text, "hi");
    }
    // Token ids stay bare numbers (the KV index namespaces them itself).
    let ids = extract(Api::Generate, br#"{"input_ids":[1,2],"cache_salt":"a"}"#).unwrap();
    assert_eq!((ids.text.as_ref(), ids.token_ids), ("1 2", true));
    assert!(!ids.namespace.is_default());
    // A duplicate namespace field is refused like any known field.
    assert!(extract(
        Api::Completions,
        br#"{"prompt":"a","cache_salt":"x","cache_salt":"y"}"#
    )
    .is_err());
}

fn text(api: Api, body: &str) -> String {
    extract(api, body.as_bytes()).unwrap().text.into_owned()
}

/// UTF-8 is checked only for bodies that are not all ASCII, and still for every byte of
/// them, skipped fields included; a body with a UTF-8 fault and a structural one gets the
/// UTF-8 error, as when UTF-8 was checked first.
#[test]
fn utf8_is_checked_once_where_a_byte_is_not_ascii() {
    for keep in [true, false] {
        let ok = "{\"messages\":[{\"role\":\"user\",\"content\":\"caf\u{e9} \u{1f600}\"}],\"x\":\"\u{fc}\"}";
        let info = extract_for(Api::Chat, ok.as_bytes(), keep).unwrap();
        assert_eq!(info.text, if keep { "caf\u{e9} \u{1f600}" } else { "" });
        let mut bad = br#"{"messages":[{"role":"user","content":"hi"}],"x":"ab"}"#.to_vec();
        let at = bad.len() - 3;
        bad[at] = 0xff;
        let e = extract_for(Api::Chat, &bad, keep).unwrap_err();
        assert_eq!(
            e.0,
            format!("invalid JSON in request body: not UTF-8 at byte {at}")
        );
        let mut both = bad.clone();
        both.splice(1..1, b"\"deep\":".iter().copied().chain([b'['; 200]));
        let e = extract_for(Api::Chat, &both, keep).unwrap_err();
        assert!(e.0.contains("not UTF-8"), "{e}");
    }
}

#[test]
fn chat_contents_join_with_single_spaces() {
    let b = r#"{"model":"m","messages":[{"role":"system","content":"You are terse."},
        {"role":"user","content":[{"type":"text","text":"Hi"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"there"}]},
        {"role":"assistant","content":"Hello","reasoning_content":"think"},{"role":"user","content":null}],
        "stream":true,"my_unknown_field":{"a":[1,2]}}"#;
    let info = extract(Api::Chat, b.as_bytes()).unwrap();
    assert_eq!(info.text, "You are terse. Hi there Hello think");
    assert_eq!(info.model.as_deref(), Some("m"));
    assert!(info.stream);
}

#[test]
fn single_plain_string_is_borrowed_from_the_body() {
    let b = br#"{"messages":[{"role":"user","content":"plain text"}]}"#;
    let info = extract(Api::Chat, b).unwrap();
    assert!(matches!(info.text, Cow::Borrowed(_)));
    assert!(info.model.is_none());
    let b = br#"{"prompt":"abc","model":"x"}"#;
    assert!(matches!(
        extract(Api::Completions, b).unwrap().text,
        Cow::Borrowed(_)
    ));
}

#[test]
fn escapes_are_decoded() {
    assert_eq!(
        text(Api::Completions, r#"{"prompt":"a\nb \u00e9"}"#),
        "a\nb é"
    );
}

#[test]
fn completions_generate_embeddings_rerank() {
    assert_eq!(text(Api::Completions, r#"{"prompt":["a","b"]}"#), "a b");
    assert_eq!(text(Api::Generate, r#"{"text":"hello"}"#), "hello");
    assert_eq!(
        text(Api::Generate, r#"{"input_ids":[1,20,300]}"#),
        "1 20 300"
    );
    assert_eq!(text(Api::Embeddings, r#"{"input":["x","y"]}"#), "x y");
    assert_eq!(text(Api::Rerank, r#"{"query":"q","documents":["d"]}"#), "q");
}

/// Integers are written through `itoa`, not `core::fmt`: the same digits as `to_string`
/// at every edge.
#[test]
fn integers_are_written_as_to_string_writes_them() {
    let values: [i128; 9] = [
        0,
        7,
        10,
        4_294_967_295,
        -1,
        -10,
        i64::MIN as i128,
        i64::MAX as i128,
        u64::MAX as i128,
    ];
    let list: Vec<String> = values.iter().map(|v| v.to_string()).collect();
    let body = format!(r#"{{"input_ids":[{}]}}"#, list.join(","));
    assert_eq!(text(Api::Generate, &body), list.join(" "));
    assert_eq!(
        text(Api::Completions, r#"{"prompt":[1.5,-0.25]}"#),
        "1.5 -0.25"
    );
}

#[test]
fn bad_bodies_are_refused() {
    assert!(extract(Api::Chat, b"{not json").is_err());
    assert!(extract(Api::Chat, br#"{"model":"m"}"#)
        .unwrap_err()
        .0
        .contains("messages"));
    assert!(extract(Api::Completions, br#"{}"#).is_err());
    assert!(extract(Api::Generate, br#"{"sampling_params":{}}"#).is_err());
    assert!(extract(Api::Chat, br#"{"messages":"nope"}"#).is_err());
    assert!(extract(Api::Chat, br#"[1,2]"#).is_err());
    assert!(extract(Api::Generate, br#"{"input_embeds":[[0.1]]}"#).is_ok());
    assert!(extract(Api::Completions, br#"{"prompt":null}"#).is_err());
    assert!(extract(Api::Completions, br#"{"prompt":"a","prompt":"b"}"#)
        .unwrap_err()
        .0
        .contains("duplicate field `prompt`"));
    assert!(extract(Api::Completions, br#"{"prompt":"a"} x"#).is_err());
    // Fields the API does not route on are still validated.
    assert!(extract(Api::Completions, br#"{"prompt":"a","messages":"x"}"#).is_err());
    assert!(extract(Api::Chat, br#"{"messages":[1]}"#).is_err());
    // Unknown fields may repeat.
    assert!(extract(Api::Completions, br#"{"prompt":"a","type":1,"type":2}"#).is_ok());
}

#[test]
fn order_inside_objects_does_not_matter() {
    // `text` wins over `input_ids` wherever they appear.
    assert_eq!(
        text(Api::Generate, r#"{"input_ids":[1,2],"text":"t"}"#),
        "t"
    );
    // A part's type may follow its text; reasoning follows the content.
    assert_eq!(
        text(
            Api::Chat,
            r#"{"messages":[{"reasoning_content":"r","content":[{"text":"a","type":"text"},
            {"text":"img","type":"image_url"}]},{"content":"b"}]}"#
        ),
        "a r b"
    );
    assert_eq!(text(Api::Completions, r#"{"prompt":["","b"]}"#), " b");
    assert_eq!(
        text(Api::Completions, r#"{"prompt":[1.5,-2,[3,"x\"y"]]}"#),
        "1.5 -2 3 x\"y"
    );
}

#[test]
fn text_is_capped_on_a_character_boundary() {
    let long = "é".repeat(MAX_ROUTING_TEXT); // two bytes each
    let body = format!(r#"{{"prompt":"{long}"}}"#);
    let t = extract(Api::Completions, body.as_bytes()).unwrap().text;
    assert!(matches!(t, Cow::Borrowed(_)));
    assert_eq!(t.len(), MAX_ROUTING_TEXT);
    let body = format!(r#"{{"prompt":["ab","{long}"]}}"#);
    let t = extract(Api::Completions, body.as_bytes()).unwrap().text;
    assert_eq!(t.len(), MAX_ROUTING_TEXT - 1, "'ab', ' ', then whole 'é's");
    assert!(t.starts_with("ab é"));
    let mut ids = String::from(r#"{"input_ids":[0"#);
    for i in 0..100_000 {
        ids.push_str(&format!(",{i}"));
    }
    ids.push_str("]}");
    let t = extract(Api::Generate, ids.as_bytes()).unwrap().text;
    assert_eq!(t.len(), MAX_ROUTING_TEXT);
    assert!(t.starts_with("0 0 1 2 3"));
}

/// A piece cut short at the cap ends the text: what follows it (a space, a number, another
/// piece) is not written into the bytes the cut left, so the text stays the first
/// [`MAX_ROUTING_TEXT`] bytes of the whole text cut back to a character boundary.
#[test]
fn nothing_is_written_after_a_cut_piece() {
    let cut = format!("{}é", "a".repeat(MAX_ROUTING_TEXT - 1));
    let want = "a".repeat(MAX_ROUTING_TEXT - 1);
    let chat = format!(
        r#"{{"messages":[{{"role":"user","content":"{cut}"}},{{"role":"user","content":"x"}}]}}"#
    );
    assert_eq!(text(Api::Chat, &chat), want);
    let escaped = format!(
        r#"{{"messages":[{{"content":"\u0041{}"}},{{"content":"x"}}]}}"#,
        &cut[1..]
    );
    assert_eq!(text(Api::Chat, &escaped), format!("A{}", &want[1..]));
    assert_eq!(
        text(Api::Completions, &format!(r#"{{"prompt":["{cut}",5]}}"#)),
        want
    );
    assert_eq!(
        text(Api::Completions, &format!(r#"{{"prompt":["{cut}","x"]}}"#)),
        want
    );
    let responses = format!(r#"{{"instructions":"{cut}","input":"x"}}"#);
    assert_eq!(text(Api::Responses, &responses), want);
    // Reasoning kept aside until its message ends, longer than the cap.
    let reasoning = format!("a{}", "é".repeat(MAX_ROUTING_TEXT / 2));
    let body =
        format!(r#"{{"messages":[{{"reasoning_content":"{reasoning}"}},{{"content":"x"}}]}}"#);
    assert_eq!(text(Api::Chat, &body), capped(&reasoning, MAX_ROUTING_TEXT));
}

#[test]
fn messages_past_the_cap_are_still_checked() {
    let long = "a".repeat(MAX_ROUTING_TEXT);
    let first = format!(r#"{{"role":"user","content":"{long}"}}"#);
    let chat = |rest: &str| format!(r#"{{"messages":[{first},{rest}]}}"#);
    // Past the cap a message adds nothing, wherever its text would have gone.
    let body = chat(r#"{"role":"assistant","content":"more","reasoning_content":"why"}"#);
    let t = extract(Api::Chat, body.as_bytes()).unwrap().text;
    assert_eq!(t, long.as_str());
    // ...but is refused, as before the cap, when it is not an object or not valid JSON.
    for (rest, want) in [
        ("\"hi\"", "expected a chat message object"),
        ("[1]", "expected a chat message object"),
        (r#"{"content":"a\qb"}"#, "escape"),
        (r#"{"content":"x",}"#, "invalid JSON"),
        (r#"{"content" "x"}"#, "`:`"),
        ("{\"content\":\"a\u{1}b\"}", "control character"),
    ] {
        for keep_text in [true, false] {
            let e = extract_for(Api::Chat, chat(rest).as_bytes(), keep_text).unwrap_err();
            assert!(e.0.contains(want), "{rest}: {e}");
        }
    }
}

use proptest::prelude::*;

proptest! {
    /// Same text as a plain reading of the parsed JSON value (the reference's rules), cut
    /// at the cap.
    #[test]
    fn matches_a_plain_reading_of_the_value(
        parts in proptest::collection::vec(
            prop_oneof![
                "[a-zé\\\"]{0,6}".prop_map(serde_json::Value::from),
                proptest::num::i64::ANY.prop_map(serde_json::Value::from),
                proptest::strategy::Just(serde_json::Value::Null),
            ],
            0..6,
        )
    ) {
        let body = serde_json::json!({"prompt": parts}).to_string();
        let want: Vec<String> = parts
            .iter()
            .filter_map(|v| match v {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Number(n) => Some(n.to_string()),
                _ => None,
            })
            .collect();
        let got = extract(Api::Completions, body.as_bytes()).unwrap().text;
        prop_assert_eq!(got.as_ref(), want.join(" "));
    }
}

mod boundaries;

#[test]
fn a_priority_member_of_any_type_is_noticed_and_only_an_integer_is_read() {
    for (body, value, given) in [
        (&br#"{"text":"hi","priority":7}"#[..], Some(7), true),
        (br#"{"text":"hi","priority":-3}"#, Some(-3), true),
        (br#"{"text":"hi","priority":"1000000"}"#, None, true),
        (br#"{"text":"hi","priority":1e6}"#, None, true),
        (br#"{"text":"hi","priority":[1,2]}"#, None, true),
        (br#"{"text":"hi","priority":null}"#, None, false),
        (br#"{"text":"hi"}"#, None, false),
    ] {
        let info = extract(Api::Generate, body).unwrap();
        let b = String::from_utf8_lossy(body);
        assert_eq!(info.shape.priority, value, "{b}");
        assert_eq!(info.shape.priority_given, given, "{b}");
    }
}
