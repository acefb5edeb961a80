use crate::route::extract::{extract, Api, RoutingText, MAX_ROUTING_TEXT};
use serde_json::{json, Value};

fn text(api: Api, body: &Value) -> String {
    extract(api, body.to_string().as_bytes())
        .unwrap()
        .text
        .into_owned()
}

#[test]
fn responses_instructions_then_input_items() {
    let body = json!({
        "model": "m",
        "input": [
            {"role": "user", "content": "Hi"},
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "Hello", "annotations": []},
                {"type": "refusal", "refusal": "no"}
            ]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"a\":1}"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
            {"role": "user", "content": [
                {"type": "input_text", "text": "and"},
                {"type": "input_image", "image_url": "data:x"},
                {"type": "input_text", "text": "then"}
            ]}
        ],
        "instructions": "Be terse.",
        "stream": true,
        "text": {"format": {"type": "text"}},
        "reasoning": {"effort": "low"}
    });
    let body = body.to_string();
    let info = extract(Api::Responses, body.as_bytes()).unwrap();
    assert_eq!(info.text, "Be terse. Hi Hello 42 and then");
    assert_eq!(info.model.as_deref(), Some("m"));
    assert!(info.stream);
    // A string input; no instructions; no input at all.
    assert_eq!(
        text(Api::Responses, &json!({"input": "just this"})),
        "just this"
    );
    assert_eq!(
        text(Api::Responses, &json!({"instructions": "I", "input": "x"})),
        "I x"
    );
    assert_eq!(
        text(Api::Responses, &json!({"instructions": "only"})),
        "only"
    );
    assert_eq!(text(Api::Responses, &json!({"model": "m"})), "");
}

#[test]
fn messages_system_then_message_contents() {
    let body = json!({
        "max_tokens": 16,
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "Hello"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"text": "no"}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "42"}]},
                {"type": "tool_result", "tool_use_id": "t2", "content": "43"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}},
                {"type": "text", "text": "more"}
            ]}
        ],
        "model": "claude",
        "system": [{"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral"}}],
        "stream": false
    });
    let body = body.to_string();
    let info = extract(Api::Messages, body.as_bytes()).unwrap();
    assert_eq!(info.text, "Be terse. Hi Hello 42 43 more");
    assert_eq!(info.model.as_deref(), Some("claude"));
    assert!(!info.stream);
    assert_eq!(
        text(
            Api::Messages,
            &json!({"system": "S", "messages": [{"role": "user", "content": "u"}]})
        ),
        "S u"
    );
}

#[test]
fn a_lone_piece_stays_borrowed() {
    let b = br#"{"model":"m","input":"plain"}"#;
    assert!(matches!(
        extract(Api::Responses, b).unwrap().text,
        RoutingText::InBody("plain")
    ));
    let b = br#"{"messages":[{"role":"user","content":[{"type":"text","text":"plain"}]}]}"#;
    assert!(matches!(
        extract(Api::Messages, b).unwrap().text,
        RoutingText::InBody("plain")
    ));
    let b = br#"{"system":"only","messages":[]}"#;
    assert!(matches!(
        extract(Api::Messages, b).unwrap().text,
        RoutingText::InBody("only")
    ));
}

#[test]
fn bad_bodies_are_refused() {
    for api in [Api::Responses, Api::Messages] {
        assert!(extract(api, b"{not json").is_err());
        assert!(extract(api, b"[]").is_err());
        assert!(extract(api, br#"{"model":"m"} trailing"#).is_err());
    }
    let e = extract(Api::Messages, br#"{"model":"m"}"#).unwrap_err();
    assert!(e.0.contains("`messages` is required"), "{e}");
    assert!(extract(Api::Messages, br#"{"messages":null}"#).is_err());
    assert!(extract(Api::Messages, br#"{"messages":"not a list"}"#).is_err());
    let e = extract(
        Api::Messages,
        br#"{"system":"a","system":"b","messages":[]}"#,
    )
    .unwrap_err();
    assert!(e.0.contains("duplicate field `system`"), "{e}");
    let e = extract(
        Api::Responses,
        br#"{"instructions":"a","instructions":"b"}"#,
    )
    .unwrap_err();
    assert!(e.0.contains("duplicate field `instructions`"), "{e}");
    // The newer APIs' fields are unknown fields elsewhere: they may repeat.
    assert!(extract(Api::Chat, br#"{"messages":[],"system":1,"system":2}"#).is_ok());
}

#[test]
fn the_text_is_capped() {
    let long = "é".repeat(MAX_ROUTING_TEXT);
    let body = json!({"instructions": "ab", "input": long});
    let t = text(Api::Responses, &body);
    assert_eq!(t.len(), MAX_ROUTING_TEXT - 1, "'ab', ' ', then whole 'é's");
    assert!(t.starts_with("ab é"));
    let body = json!({"system": long, "messages": [{"role": "user", "content": "x"}]});
    assert_eq!(text(Api::Messages, &body).len(), MAX_ROUTING_TEXT);
}

use proptest::prelude::*;

/// A conversation's turns as (user, assistant) strings.
fn turns() -> impl Strategy<Value = (String, Vec<(String, String)>)> {
    (
        "[a-zé \\\"]{0,8}",
        proptest::collection::vec(("[a-z\\\\\n]{0,6}", "[a-z ]{0,6}"), 1..5),
    )
}

proptest! {
    /// Turn n+1 of a Responses conversation (history resent as items, reply as output_text
    /// parts) routes on a text that extends turn n's.
    #[test]
    fn responses_turns_extend_each_other((sys, conv) in turns()) {
        let mut items = Vec::new();
        let mut prev: Option<String> = None;
        for (user, reply) in &conv {
            items.push(json!({"role": "user", "content": [{"type": "input_text", "text": user}]}));
            let t = text(Api::Responses, &json!({"input": items, "instructions": sys, "model": "m"}));
            if let Some(p) = &prev {
                prop_assert!(t.starts_with(p.as_str()), "{t:?} does not extend {p:?}");
            }
            items.push(json!({"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": reply}]}));
            prev = Some(t);
        }
    }

    /// The same for Messages: string and block contents, system given as blocks.
    #[test]
    fn messages_turns_extend_each_other((sys, conv) in turns()) {
        let mut msgs = Vec::new();
        let mut prev: Option<String> = None;
        for (i, (user, reply)) in conv.iter().enumerate() {
            let content = if i % 2 == 0 { json!(user) } else { json!([{"type": "text", "text": user}]) };
            msgs.push(json!({"role": "user", "content": content}));
            let t = text(Api::Messages, &json!({"messages": msgs, "system": [{"type": "text", "text": sys}]}));
            if let Some(p) = &prev {
                prop_assert!(t.starts_with(p.as_str()), "{t:?} does not extend {p:?}");
            }
            msgs.push(json!({"role": "assistant", "content": [{"type": "text", "text": reply}]}));
            prev = Some(t);
        }
    }

    /// Whatever the JSON, extraction answers (text or a 400), never panics.
    #[test]
    fn any_json_is_answered(v in any_json()) {
        let body = v.to_string();
        let _ = extract(Api::Responses, body.as_bytes());
        let _ = extract(Api::Messages, body.as_bytes());
    }
}

fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        "[a-z]{0,4}".prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 32, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            proptest::collection::vec(
                (
                    prop_oneof![
                        Just("text".to_string()),
                        Just("content".to_string()),
                        Just("output".to_string()),
                        Just("input".to_string()),
                        Just("messages".to_string()),
                        Just("system".to_string()),
                        "[a-z]{1,3}"
                    ],
                    inner
                ),
                0..4
            )
            .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}
