//! The body parser (`super::json`) against serde_json's on generated bodies: the same routing inputs
//! when both accept, and the same verdict on the malformed and edge-case bodies clients send. Every
//! check runs on each kernel this CPU has (`json::Kernel`), the portable one included.

use super::json::Kernel;
use super::{extract_on, extract_serde_json, Api};
use proptest::prelude::*;
use serde_json::{json, Value};

const APIS: [Api; 8] = [
    Api::TokenGenerate,
    Api::Chat,
    Api::Completions,
    Api::Generate,
    Api::Embeddings,
    Api::Rerank,
    Api::Responses,
    Api::Messages,
];

/// Short strings with the characters that make parsers differ: escapes, quotes, non-ASCII,
/// control characters (escaped by serde_json when serialised).
fn text() -> impl Strategy<Value = String> {
    "[a-zé\\\\\"\n\t\u{1F600}/ ]{0,12}"
}

/// Any JSON value a client might put anywhere: scalars, content parts, nested arrays.
fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        text().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        // Values both parsers round exactly (serde_json's default float parsing is best-effort
        // in the last bit; ours rounds correctly).
        (-1_000_000i32..1_000_000).prop_map(|n| Value::from(f64::from(n) / 8.0)),
        any::<bool>().prop_map(Value::from),
        Just(Value::Null),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            (
                text(),
                prop_oneof![Just("text"), Just("image_url"), Just("input_text")]
            )
                .prop_map(|(t, ty)| json!({"type": ty, "text": t})),
            prop::collection::vec(("[a-z_]{1,8}", inner), 0..3)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// A request body: the routing fields of every API, each maybe present, plus unknown ones.
fn body() -> impl Strategy<Value = Value> {
    (
        prop::option::of(text()),
        prop::option::of(any::<bool>()),
        prop::collection::vec(
            (
                prop_oneof![Just("user"), Just("assistant"), Just("system")],
                value(),
                prop::option::of(text()),
            ),
            0..4,
        ),
        prop::option::of(value()),
        prop::option::of(value()),
        prop::option::of(value()),
        // Token ids: one list, or a batch of lists (completions' `prompt`, `token_ids`).
        prop::option::of((
            prop::collection::vec(prop::collection::vec(0u32..200_000, 0..5), 1..3),
            any::<bool>(),
        )),
    )
        .prop_map(|(model, stream, messages, prompt, input, extra, ids)| {
            let mut o = serde_json::Map::new();
            if let Some(m) = model {
                o.insert("model".into(), m.into());
            }
            if let Some(s) = stream {
                o.insert("stream".into(), s.into());
            }
            let msgs: Vec<Value> = messages
                .into_iter()
                .map(|(role, content, reasoning)| {
                    let mut m = json!({"role": role, "content": content});
                    if let Some(r) = reasoning {
                        m["reasoning_content"] = r.into();
                    }
                    m
                })
                .collect();
            o.insert("messages".into(), msgs.into());
            if let Some(p) = prompt {
                o.insert("prompt".into(), p.clone());
                o.insert("token_ids".into(), p.clone());
                o.insert("text".into(), p);
            }
            if let Some((lists, batch)) = ids {
                let one = json!(lists[0]);
                o.insert("token_ids".into(), one.clone());
                o.insert("prompt".into(), if batch { json!(lists) } else { one });
            }
            if let Some(i) = input {
                o.insert("input".into(), i.clone());
                o.insert("system".into(), i);
            }
            if let Some(e) = extra {
                o.insert("my_field".into(), e);
            }
            Value::Object(o)
        })
}

/// The two parsers' verdicts on `body` agree, and so do the routing inputs when both accept
/// (the text only when `text_too`: a damaged body can hold a float of 17 digits, which
/// serde_json's default parser may round one bit off where ours rounds correctly).
fn same_as(api: Api, body: &[u8], keep: bool, text_too: bool) -> Result<(), TestCaseError> {
    let oracle = extract_serde_json(api, body, keep);
    for k in Kernel::available() {
        same_on(k, api, body, keep, text_too, &oracle)?;
    }
    Ok(())
}

fn same_on(
    k: Kernel,
    api: Api,
    body: &[u8],
    keep: bool,
    text_too: bool,
    oracle: &Result<super::RoutingInfo<'_>, super::ExtractError>,
) -> Result<(), TestCaseError> {
    let fast = extract_on(api, body, keep, k);
    let oracle = oracle.clone();
    match (&fast, &oracle) {
        (Ok(a), Ok(b)) if !text_too => {
            prop_assert_eq!((&a.model, a.stream), (&b.model, b.stream));
        }
        (Ok(a), Ok(b)) => prop_assert_eq!(a, b, "{:?} {}", api, String::from_utf8_lossy(body)),
        (Err(_), Err(_)) => {}
        // serde_json skips ignored strings without checking their UTF-8; ours checks every
        // string, skipped or read. A body that is not UTF-8 is not JSON (RFC 8259), so refusing it
        // is the better verdict.
        (Err(_), Ok(_)) if std::str::from_utf8(body).is_err() => {}
        _ => prop_assert!(
            false,
            "{:?} {:?} keep={} verdicts differ on {}: ours {:?}, serde_json {:?}",
            k,
            api,
            keep,
            String::from_utf8_lossy(body),
            fast.map(|i| i.text.into_owned()),
            oracle.map(|i| i.text.into_owned())
        ),
    }
    Ok(())
}

fn same(api: Api, body: &[u8], keep: bool) -> Result<(), TestCaseError> {
    same_as(api, body, keep, true)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Well-formed bodies of every shape: the same model, stream flag and routing text.
    #[test]
    fn both_parsers_read_the_same_routing_inputs(b in body()) {
        let bytes = serde_json::to_vec(&b).unwrap();
        for api in APIS {
            same(api, &bytes, true)?;
            same(api, &bytes, false)?;
        }
    }

    /// Bodies cut short or with one byte changed: the same verdict, and the same inputs when
    /// both still accept.
    #[test]
    fn both_parsers_agree_on_damaged_bodies(
        b in body(),
        cut in any::<prop::sample::Index>(),
        at in any::<prop::sample::Index>(),
        byte in prop_oneof![Just(b'"'), Just(b'\\'), Just(b','), Just(b'}'), Just(b']'),
            Just(b':'), Just(0u8), Just(0xff), Just(b'1'), Just(b'e'), Just(b' ')],
    ) {
        let bytes = serde_json::to_vec(&b).unwrap();
        let cut_short = &bytes[..cut.index(bytes.len())];
        let mut changed = bytes.clone();
        let i = at.index(changed.len());
        changed[i] = byte;
        for api in [Api::Chat, Api::Completions, Api::Responses] {
            same_as(api, cut_short, true, true)?;
            same_as(api, &changed, true, false)?;
            same_as(api, &changed, false, false)?;
        }
    }
}

/// Edge cases named one by one: numbers, escapes, nesting, whitespace and trailing bytes.
#[test]
fn both_parsers_agree_on_edge_cases() {
    let cases: &[&str] = &[
        r#"{"prompt":"a\ud83d\ude00b"}"#,
        r#"{"prompt":"\ud800"}"#,
        r#"{"prompt":"x","other":"\ud800"}"#,
        r#"{"prompt":"\u00e9\/\b\f\r"}"#,
        r#"{"prompt":"bad \x escape"}"#,
        r#"{"prompt":[1e400]}"#,
        // `-0` is the float -0.0 in both.
        r#"{"prompt":[-0,-0.0,0]}"#,
        r#"{"prompt":[0.1e-5,1E+2,123456789012345678901234567890]}"#,
        r#"{"prompt":[01]}"#,
        r#"{"prompt":[1.]}"#,
        r#"{"prompt":[.5]}"#,
        r#"{"prompt":"a"}   "#,
        " \t\n{\"prompt\":\"a\"}\n",
        r#"{"prompt":"a",}"#,
        r#"{"prompt":"a" "x":1}"#,
        r#"{"prompt":"tab	inside"}"#,
        r#"{"prompt":"a","x":[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]}"#,
        r#"{"prompt":"a","x":tru}"#,
        r#"{"prompt":"a","x":nul}"#,
        r#"{"prompt":"a","x":{"y":}}"#,
        r#"{"model":null,"prompt":"a","stream":null}"#,
        r#"{"model":5,"prompt":"a"}"#,
        r#"{"stream":"yes","prompt":"a"}"#,
        r#"{"prompt":"a","model":"m","model":"n"}"#,
        r#"{"messages":[{"content":[{"type":5,"text":"x"}]}]}"#,
        r#"{"messages":[{"content":"a","reasoning_content":5}]}"#,
        "{\"prompt\":\"caf\u{e9}\"}",
        r#"{"prompt":"a\u12G4"}"#,
        r#"{"prompt":"a","x":"b\u12G4"}"#,
        r#"{"prompt":"a","x":"b\u"}"#,
        r#"{"prompt":"a","x":["\u00"]}"#,
        // Skipped values (the parsers' validating skips).
        r#"{"prompt":"a","x":1e400}"#,
        r#"{"prompt":"a","x":[01]}"#,
        r#"{"prompt":"a","x":[-]}"#,
        r#"{"prompt":"a","x":"\udc00"}"#,
        r#"{"prompt":"a","x":"bad \q escape"}"#,
        "{\"prompt\":\"a\",\"x\":\"tab\tinside\"}",
        r#"{"prompt":"a","x":{"k":[1,2,{"z":"]]]\"[["}]}}"#,
        r#"{"prompt":"a","x":{"k" 1}}"#,
        r#"{"prompt":"a","x":[1,]}"#,
    ];
    for c in cases {
        for api in APIS {
            for keep in [true, false] {
                let oracle =
                    extract_serde_json(api, c.as_bytes(), keep).map(|i| i.text.into_owned());
                for k in Kernel::available() {
                    let fast = extract_on(api, c.as_bytes(), keep, k).map(|i| i.text.into_owned());
                    assert_eq!(
                        fast.is_ok(),
                        oracle.is_ok(),
                        "{k:?} {api:?} keep={keep} {c}: ours {fast:?} serde_json {oracle:?}"
                    );
                    if let (Ok(a), Ok(b)) = (fast, &oracle) {
                        assert_eq!(&a, b, "{k:?} {api:?} {c}");
                    }
                }
            }
        }
    }
    // Invalid UTF-8 inside the routed string, inside a skipped one, and after the object.
    for c in [
        &b"{\"prompt\":\"a\xff\"}"[..],
        &b"{\"prompt\":\"a\",\"x\":\"\xff\"}"[..],
        &b"{\"input\":\"a\",\"prompt\":\"\xc3\"}"[..],
        &b"{\"prompt\":\"a\"}\xff"[..],
    ] {
        for (api, k) in APIS
            .into_iter()
            .flat_map(|a| Kernel::available().into_iter().map(move |k| (a, k)))
        {
            assert!(extract_on(api, c, true, k).is_err(), "{k:?} {api:?} {c:?}");
            assert!(extract_on(api, c, false, k).is_err(), "{k:?} {api:?} {c:?}");
        }
    }
}

/// Nesting deeper than [`super::MAX_NESTING`] is refused, in the routed field and in any
/// other, never a stack overflow; at the limit both parsers accept.
#[test]
fn deep_nesting_is_refused() {
    // On a stack as large as a serving core's (a debug build's frames are ~17 KB a level).
    std::thread::Builder::new()
        .stack_size(super::STACK_BYTES)
        .spawn(deep_nesting_cases)
        .unwrap()
        .join()
        .unwrap();
}

fn deep_nesting_cases() {
    for k in Kernel::available() {
        deep_nesting_on(k);
    }
}

fn deep_nesting_on(k: Kernel) {
    let ok = format!(
        r#"{{"prompt":"a","x":{}1{}}}"#,
        "[".repeat(100),
        "]".repeat(100)
    );
    assert!(extract_on(Api::Completions, ok.as_bytes(), true, k).is_ok());
    assert!(extract_serde_json(Api::Completions, ok.as_bytes(), true).is_ok());
    for depth in [130usize, 300, 100_000] {
        let prompt = format!(
            r#"{{"prompt":{}"a"{}}}"#,
            "[".repeat(depth),
            "]".repeat(depth)
        );
        assert!(extract_on(Api::Completions, prompt.as_bytes(), true, k).is_err());
        let input = format!(
            r#"{{"input":{}"a"{}}}"#,
            "[".repeat(depth),
            "]".repeat(depth)
        );
        assert!(extract_on(Api::Responses, input.as_bytes(), true, k).is_err());
        let body = format!(
            r#"{{"prompt":"a","x":{}1{}}}"#,
            "[".repeat(depth),
            "]".repeat(depth)
        );
        for api in APIS {
            assert!(extract_on(api, body.as_bytes(), true, k).is_err());
            assert!(extract_serde_json(api, body.as_bytes(), true).is_err());
        }
    }
}
