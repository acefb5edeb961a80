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
    // Token ids are marked like any text (the text tree must keep namespaces apart); the
    // marker comes off for their readers.
    let ids = extract(Api::Generate, br#"{"input_ids":[1,2],"cache_salt":"a"}"#).unwrap();
    let m = ids.namespace.marker().unwrap();
    assert_eq!(
        (ids.text.as_ref(), ids.token_ids),
        (&*format!("{m}1 2"), true)
    );
    assert_eq!(without_marker(&ids.text), "1 2");
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
    assert!(matches!(info.text, RoutingText::InBody(_)));
    assert!(info.model.is_none());
    let b = br#"{"prompt":"abc","model":"x"}"#;
    assert!(matches!(
        extract(Api::Completions, b).unwrap().text,
        RoutingText::InBody(_)
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
    assert!(matches!(t, RoutingText::InBody(_)));
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
        let got = extract(Api::Completions, body.as_bytes());
        // A list that starts with an integer is token ids: all of them ids, or refused.
        let id = |v: &serde_json::Value| v.as_u64().is_some_and(|n| n <= u64::from(u32::MAX));
        match parts.first() {
            Some(serde_json::Value::Number(_)) if !parts.iter().all(id) => {
                prop_assert!(got.is_err());
            }
            first => {
                let got = got.unwrap();
                prop_assert_eq!(got.token_ids, matches!(first, Some(serde_json::Value::Number(_))));
                prop_assert_eq!(&*got.text, want.join(" "));
            }
        }
    }
}

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

mod boundaries {
    //! The extractor against serde_json where its byte loops change step: strings of several
    //! KiB, escapes straddling a 64-byte block (counted from the body's start, the string's
    //! start and the skipped value's start, the three origins the loops count blocks from), and
    //! bodies past the routing cap, whose later messages only the block skip reads. Every body
    //! runs on each kernel this CPU has (AVX2, SSE2, portable on x86_64 with AVX2), and is held
    //! to two readings: the same visitors on serde_json's parser (`extract_serde_json`: every
    //! field, same verdict), and a plain reading of serde_json's `Value` (model, stream and
    //! routing text rebuilt from it). A body serde_json refuses must be refused, on every
    //! kernel, and so must one that is not UTF-8 (which serde_json lets through in a string it
    //! skips).

    use super::super::json::Kernel;
    use super::super::{capped, extract_on, extract_serde_json, Api, MAX_ROUTING_TEXT};
    use proptest::prelude::*;
    use serde_json::Value;
    use std::sync::OnceLock;

    /// Plain ASCII words, long enough to fill the routing text and then some; strings of any
    /// length are cut from it.
    fn filler() -> &'static str {
        static FILLER: OnceLock<String> = OnceLock::new();
        FILLER.get_or_init(|| {
            let words = [
                "prefix ", "cache ", "of ", "the ", "worker ", "routes ", "a ", "prompt ",
            ];
            let mut s = String::with_capacity(MAX_ROUTING_TEXT + 8192);
            let mut i = 0usize;
            while s.len() < MAX_ROUTING_TEXT + 8192 {
                s.push_str(words[i % words.len()]);
                i = i.wrapping_mul(5).wrapping_add(3);
            }
            s
        })
    }

    /// `len` bytes of filler from `from` (ASCII: any cut is a character boundary).
    fn run(from: usize, len: usize) -> &'static [u8] {
        &filler().as_bytes()[from..from + len]
    }

    /// Escapes as a client may write them: every short escape, `\u` of control characters, of
    /// ASCII, of BMP text and of surrogate pairs (either case), and backslash runs that end on an
    /// escaped quote.
    const ESCAPES: &[&str] = &[
        r#"\""#,
        r"\\",
        r"\/",
        r"\b",
        r"\f",
        r"\n",
        r"\r",
        r"\t",
        r"\u0000",
        r"\u001f",
        r"\u0041",
        r"\u00e9",
        r"\u20AC",
        r"\uffff",
        r"\ud83d\ude00",
        r"\uDBFF\uDFFF",
        r#"\\\""#,
        r#"\\\\\\\""#,
    ];

    /// Raw bytes a string may hold unescaped: multi-byte characters, which a cut must not split.
    const RAW: &[&str] = &["é", "€", "😀", "\u{7f}", " "];

    /// What JSON refuses in a string: bad escapes, `\u` without four hex digits, lone surrogates
    /// (refused where the string is read, allowed where it is skipped, as serde_json does), raw
    /// control bytes and bytes that are not UTF-8.
    const BROKEN: &[&[u8]] = &[
        br"\x",
        br"\u12g4",
        br"\u00",
        br"\ud800",
        br"\udc00",
        br"\ud800\u0041",
        br"\ud800x",
        b"\x01",
        b"\x1f",
        b"\n",
        b"\xff",
        b"\xc3",
        b"\xe2\x82",
        br"\",
    ];

    /// A piece of a string's contents as it stands in the body.
    fn piece() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            3 => (0usize..4096, 0usize..64).prop_map(|(len, from)| run(from, len).to_vec()),
            1 => (0usize..64, 0usize..8).prop_map(|(len, from)| run(from, len).to_vec()),
            3 => prop::sample::select(ESCAPES).prop_map(|e| e.as_bytes().to_vec()),
            1 => prop::sample::select(RAW).prop_map(|r| r.as_bytes().to_vec()),
        ]
    }

    /// One to three escapes in a row (a backslash run may cross the edge), or now and then
    /// something JSON refuses.
    fn at_the_edge() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            4 => prop::collection::vec(
                prop_oneof![
                    3 => prop::sample::select(ESCAPES).prop_map(str::as_bytes),
                    1 => prop::sample::select(RAW).prop_map(str::as_bytes),
                ],
                1..4,
            )
            .prop_map(|v| v.concat()),
            1 => prop::sample::select(BROKEN).prop_map(<[u8]>::to_vec),
        ]
    }

    /// Where the string under test stands in the body, and so which loop reads it.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Place {
        /// `prompt`: read and unescaped (the routing text).
        Prompt,
        /// The middle item of a `prompt` list (read for completions; a skipped list elsewhere).
        PromptList,
        /// `model`.
        Model,
        /// An object key.
        Key,
        /// An unknown field's string (the string scan, not unescaped).
        UnknownString,
        /// A string inside an unknown field's list (the block skip).
        UnknownList,
        /// A chat message's content.
        Chat,
        /// A chat message after one that fills the routing text (the block skip, message by
        /// message).
        PastCap,
    }

    const PLACES: [Place; 8] = [
        Place::Prompt,
        Place::PromptList,
        Place::Model,
        Place::Key,
        Place::UnknownString,
        Place::UnknownList,
        Place::Chat,
        Place::PastCap,
    ];

    /// A body with the string under test in it, built in two halves around the string's contents.
    struct Layout {
        head: Vec<u8>,
        /// Offset of the opening bracket of the value the block skip reads, when it reads one.
        container: Option<usize>,
        tail: &'static [u8],
    }

    impl Layout {
        fn new(place: Place) -> Layout {
            let (head, container, tail): (String, Option<&str>, &[u8]) = match place {
                Place::Prompt => (
                    r#"{"model":"m","prompt":""#.into(),
                    None,
                    br#"","stream":true}"#,
                ),
                Place::PromptList => (
                    r#"{"model":"m","prompt":["x",""#.into(),
                    Some("["),
                    br#"",7],"stream":false}"#,
                ),
                Place::Model => (r#"{"model":""#.into(), None, br#"","prompt":"p"}"#),
                Place::Key => (r#"{"prompt":"p",""#.into(), None, br#"":1}"#),
                Place::UnknownString => (r#"{"prompt":"p","x":""#.into(), None, br#""}"#),
                Place::UnknownList => (
                    r#"{"prompt":"p","x":[{"k":""#.into(),
                    Some("["),
                    br#""},1],"stream":true}"#,
                ),
                Place::Chat => (
                    r#"{"model":"m","messages":[{"role":"user","content":""#.into(),
                    Some("["),
                    br#""}]}"#,
                ),
                Place::PastCap => (
                    format!(
                        r#"{{"messages":[{{"role":"user","content":"{}"}},{{"role":"user","content":""#,
                        std::str::from_utf8(run(0, MAX_ROUTING_TEXT + 3)).unwrap_or_default()
                    ),
                    Some("{"),
                    br#""}],"model":"m"}"#,
                ),
            };
            let container = container.map(|c| head.rfind(c).unwrap_or(0));
            Layout {
                head: head.into_bytes(),
                container,
                tail,
            }
        }

        fn body(&self, contents: &[u8]) -> Vec<u8> {
            [&self.head[..], contents, self.tail].concat()
        }

        /// The APIs (and whether they keep the text) that read or skip the string: the one that
        /// routes on it, and one that only validates the whole body.
        fn readers(place: Place) -> &'static [(Api, bool)] {
            match place {
                Place::Chat | Place::PastCap => {
                    &[(Api::Chat, true), (Api::Chat, false), (Api::Rerank, false)]
                }
                _ => &[(Api::Completions, true), (Api::Rerank, false)],
            }
        }
    }

    /// The routing inputs rebuilt from serde_json's `Value` of the body, for the shapes built
    /// here: the model, the stream flag, and the text (a `prompt` string or list, chat contents
    /// and reasoning joined by spaces), cut at the cap on a character boundary.
    fn plain_reading(api: Api, keep: bool, v: &Value) -> (Option<String>, bool, String) {
        let model = v["model"]
            .as_str()
            .filter(|m| !m.is_empty())
            .map(str::to_string);
        let stream = v["stream"].as_bool().unwrap_or(false);
        let piece = |p: &Value| match p {
            Value::String(s) => Some(s.clone()),
            Value::Number(n) => Some(n.to_string()),
            _ => None,
        };
        let mut pieces: Vec<String> = Vec::new();
        match api {
            Api::Completions => match &v["prompt"] {
                Value::Array(items) => pieces.extend(items.iter().filter_map(piece)),
                p => pieces.extend(piece(p)),
            },
            Api::Chat => {
                for m in v["messages"].as_array().into_iter().flatten() {
                    match &m["content"] {
                        Value::Array(parts) => pieces.extend(
                            parts
                                .iter()
                                .filter(|p| p["type"] == "text")
                                .filter_map(|p| piece(&p["text"])),
                        ),
                        c => pieces.extend(piece(c)),
                    }
                    pieces.extend(m["reasoning_content"].as_str().map(str::to_string));
                }
            }
            _ => {}
        }
        let text = match keep {
            true => capped(&pieces.join(" "), MAX_ROUTING_TEXT).to_string(),
            false => String::new(),
        };
        (model, stream, text)
    }

    /// Whether serde_json refuses the bytes as JSON (its nesting limit aside: not a JSON rule).
    fn serde_json_refuses(body: &[u8]) -> bool {
        match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
            Ok(_) => false,
            Err(e) => !e.to_string().contains("recursion limit"),
        }
    }

    /// `body` read by `api` on every kernel: the same answer as the same visitors on serde_json's
    /// parser, refused where serde_json refuses it, and the plain reading of its `Value` where it
    /// is valid.
    fn check(api: Api, keep: bool, body: &[u8]) -> Result<(), TestCaseError> {
        let shown = || ends(&String::from_utf8_lossy(body), 300);
        let oracle = extract_serde_json(api, body, keep);
        let refused = serde_json_refuses(body);
        let utf8 = std::str::from_utf8(body).is_ok();
        let value = serde_json::from_slice::<Value>(body).ok();
        for k in Kernel::available() {
            let got = extract_on(api, body, keep, k);
            match (&got, &oracle) {
                (Ok(a), Ok(b)) => {
                    prop_assert_eq!(a, b, "{:?} {:?} keep={} {}", k, api, keep, shown())
                }
                (Err(_), Err(_)) => {}
                // serde_json skips an ignored string without checking its UTF-8; ours checks every
                // string (a body that is not UTF-8 is not JSON).
                (Err(_), Ok(_)) if !utf8 => {}
                _ => prop_assert!(
                    false,
                    "{:?} {:?} keep={} verdicts differ on {}: ours {:?}, serde_json's {:?}",
                    k,
                    api,
                    keep,
                    shown(),
                    got.as_ref().map(|i| i.text.len()),
                    oracle.as_ref().map(|i| i.text.len()),
                ),
            }
            prop_assert!(
                !refused || got.is_err(),
                "{:?} {:?} accepted what serde_json refuses: {}",
                k,
                api,
                shown()
            );
            // serde_json's skip lets a string that is not UTF-8 through; ours claims every byte.
            prop_assert!(
                utf8 || got.is_err(),
                "{:?} {:?} accepted a body that is not UTF-8: {}",
                k,
                api,
                shown()
            );
            // What serde_json reads whole may be refused for its shape, never as not JSON (the
            // claim the `extract` fuzz target holds every input to).
            if let (Some(_), Err(e)) = (&value, &got) {
                prop_assert!(
                    !e.0.starts_with("invalid JSON"),
                    "{:?} {:?} refused JSON as not JSON ({}): {}",
                    k,
                    api,
                    e,
                    shown()
                );
            }
            if let (Some(v), Ok(info)) = (&value, &got) {
                let want = plain_reading(api, keep, v);
                let have = (
                    info.model.as_deref().map(str::to_string),
                    info.stream,
                    info.text.to_string(),
                );
                prop_assert!(
                    have == want,
                    "{:?} {:?} keep={} read {:?}, serde_json's value says {:?}: {}",
                    k,
                    api,
                    keep,
                    short(&have),
                    short(&want),
                    shown()
                );
            }
        }
        Ok(())
    }

    /// The routing inputs with a long text shown by its ends.
    fn short(r: &(Option<String>, bool, String)) -> String {
        format!("model {:?}, stream {}, text {}", r.0, r.1, ends(&r.2, 80))
    }

    /// `s` quoted, or its first and last `n` bytes (to character boundaries) when it is longer.
    fn ends(s: &str, n: usize) -> String {
        if s.len() <= 2 * n {
            return format!("{s:?}");
        }
        let mut tail = s.len() - n;
        while !s.is_char_boundary(tail) {
            tail += 1;
        }
        format!("{:?}…{:?} ({} bytes)", capped(s, n), &s[tail..], s.len())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Strings of up to several KiB of plain runs, escapes and multi-byte characters, in every
        /// place a string stands in a body.
        #[test]
        fn long_strings_read_as_serde_json_reads_them(
            place in prop::sample::select(&PLACES[..]),
            pieces in prop::collection::vec(piece(), 0..8),
        ) {
            let layout = Layout::new(place);
            let body = layout.body(&pieces.concat());
            for &(api, keep) in Layout::readers(place) {
                check(api, keep, &body)?;
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        /// Escapes (and now and then something JSON refuses) whose backslash stands from 6 bytes
        /// before to 2 bytes after a 64-byte edge (the 64th and 128th byte), counted from the
        /// body's start, the string's start or the skipped value's opening bracket.
        #[test]
        fn escapes_at_block_edges_read_as_serde_json_reads_them(
            place in prop::sample::select(&PLACES[..]),
            origin in 0..3u8,
            edge in prop::sample::select(&[64usize, 128][..]),
            shift in -6isize..=2,
            escape in at_the_edge(),
            after in prop_oneof![Just(0usize), 1usize..4, 60usize..70, 120usize..140],
        ) {
            let layout = Layout::new(place);
            let start = layout.head.len();
            let origin = match origin {
                0 => 0,
                1 => start,
                _ => layout.container.unwrap_or(start),
            };
            // Filler before the escape puts its backslash `shift` bytes from the edge (one 64
            // bytes further on when the string starts past the edge).
            let mut pad = (origin + edge).wrapping_add_signed(shift) as isize - start as isize;
            while pad < 0 {
                pad += 64;
            }
            let contents = [run(0, pad as usize), &escape[..], run(7, after)].concat();
            let body = layout.body(&contents);
            prop_assert_eq!((start + pad as usize - origin) % 64, (64 + shift) as usize % 64);
            for &(api, keep) in Layout::readers(place) {
                check(api, keep, &body)?;
            }
        }
    }

    /// A chat message after the first, as clients send them: string or text-part content,
    /// reasoning, unknown fields; now and then broken (a bad string, a trailing comma, a missing
    /// colon, not an object).
    fn later_message() -> impl Strategy<Value = Vec<u8>> {
        let text = || prop::collection::vec(piece(), 0..4).prop_map(|p| p.concat());
        let broken = prop_oneof![
            at_the_edge()
                .prop_map(|e| [&br#"{"role":"user","content":"x"#[..], &e, br#""}"#].concat()),
            Just(br#"{"role":"user","content":"x",}"#.to_vec()),
            Just(br#"{"role":"user","content" "x"}"#.to_vec()),
            Just(br#""not an object""#.to_vec()),
            Just(br#"{"role":"user","content":["#.to_vec()),
        ];
        prop_oneof![
            4 => text().prop_map(|t| [&br#"{"role":"user","content":""#[..], &t, br#""}"#].concat()),
            2 => (text(), text()).prop_map(|(a, b)| {
                [&br#"{"role":"user","content":[{"type":"text","text":""#[..], &a,
                    br#""},{"type":"image_url","image_url":{"url":"data:x"}},{"text":""#, &b,
                    br#"","type":"text"}]}"#].concat()
            }),
            2 => (text(), text()).prop_map(|(a, r)| {
                [&br#"{"role":"assistant","reasoning_content":""#[..], &r,
                    br#"","content":""#, &a,
                    br#"","tool_calls":[{"id":"t","args":{"k":[1,2.5e3,null,true]}}]}"#].concat()
            }),
            1 => broken,
        ]
    }

    /// A string's contents after the first in a `prompt` list, now and then with something JSON
    /// refuses in it.
    fn later_text() -> impl Strategy<Value = Vec<u8>> {
        (
            prop::collection::vec(piece(), 0..4),
            prop::option::weighted(0.2, at_the_edge()),
        )
            .prop_map(|(p, e)| [p.concat(), e.unwrap_or_default()].concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Chat bodies whose first message ends just before, at or just past the routing cap: the
        /// text is cut where serde_json's reading cuts it, and the messages after it, which only
        /// the block skip reads, are held to JSON as strictly as the ones before.
        #[test]
        fn bodies_past_the_cap_read_as_serde_json_reads_them(
            first in (MAX_ROUTING_TEXT - 40)..(MAX_ROUTING_TEXT + 40),
            escape in at_the_edge(),
            later in prop::collection::vec(later_message(), 1..4),
            later_texts in prop::collection::vec(later_text(), 1..4),
            prompt_list in any::<bool>(),
        ) {
            // The first string ends in escapes, around the cap.
            let head = [run(0, first - escape.len().min(first)), &escape[..]].concat();
            let (api, body) = match prompt_list {
                false => {
                    let open = br#"{"model":"m","messages":[{"role":"user","content":""#;
                    let mut body = [&open[..], &head, br#""}"#].concat();
                    for m in &later {
                        body.push(b',');
                        body.extend_from_slice(m);
                    }
                    body.extend_from_slice(br#"],"stream":true}"#);
                    (Api::Chat, body)
                }
                // A completions `prompt` list of strings, read past the cap by the list's skip.
                true => {
                    let mut body = [&br#"{"prompt":[""#[..], &head, b"\""].concat();
                    for t in &later_texts {
                        body.extend_from_slice(b",\"");
                        body.extend_from_slice(t);
                        body.push(b'"');
                    }
                    body.extend_from_slice(br#"],"model":"m"}"#);
                    (Api::Completions, body)
                }
            };
            check(api, true, &body)?;
            check(api, false, &body)?;
            check(Api::Rerank, false, &body)?;
        }
    }
}

#[test]
fn a_completions_prompt_of_token_ids_routes_on_its_ids() {
    let one = extract(Api::Completions, br#"{"model":"m","prompt":[1,20,300]}"#).unwrap();
    assert_eq!((one.text.as_ref(), one.token_ids), ("1 20 300", true));
    // One prompt: no batch for prefill/decode pairing.
    assert_eq!(one.shape.prompts, None);
    // A batch of token lists routes on its first list; every list is held to the shape.
    let batch = extract(
        Api::Completions,
        br#"{"prompt":[[7,8,9],[7,8,10,11],[]],"cache_salt":"s"}"#,
    )
    .unwrap();
    assert!(batch.token_ids);
    assert_eq!(without_marker(&batch.text), "7 8 9");
    assert_ne!(batch.text, "7 8 9", "salted: the namespace's marker leads");
    assert_eq!(batch.shape.prompts, Some(3));
    assert_eq!(batch.namespace.cache_salt.as_deref(), Some("s"));
    // Texts are still texts.
    for body in [
        &br#"{"prompt":"1 2 3"}"#[..],
        br#"{"prompt":["a","b"]}"#,
        br#"{"prompt":[1.5,-0.25]}"#,
        br#"{"prompt":[]}"#,
    ] {
        let info = extract(Api::Completions, body).unwrap();
        assert!(!info.token_ids, "{}", String::from_utf8_lossy(body));
    }
    // Without the text kept (a policy that never reads it), the shape is still checked and
    // the ids still flagged.
    let bare = extract_for(Api::Completions, br#"{"prompt":[[1],[2]]}"#, false).unwrap();
    assert!(bare.token_ids);
    assert_eq!(bare.text, "");
    assert!(extract_for(Api::Completions, br#"{"prompt":[[1],["x"]]}"#, false).is_err());
}

#[test]
fn token_ids_of_another_shape_are_refused() {
    for body in [
        &br#"{"prompt":[1,"a"]}"#[..],
        br#"{"prompt":[1,2.5]}"#,
        br#"{"prompt":[-1,2]}"#,
        br#"{"prompt":[1,-2]}"#,
        br#"{"prompt":[4294967296]}"#,
        br#"{"prompt":[1,[2]]}"#,
        br#"{"prompt":[[1],2]}"#,
        br#"{"prompt":[[1],[2,"x"]]}"#,
        br#"{"prompt":[[1,[2]]]}"#,
        br#"{"prompt":[[1],null]}"#,
        br#"{"prompt":[1,null]}"#,
        br#"{"prompt":[[1],{"a":1}]}"#,
    ] {
        let e = extract(Api::Completions, body).unwrap_err();
        assert!(
            e.0.contains("token ids must be non-negative integers"),
            "{}: {}",
            String::from_utf8_lossy(body),
            e.0
        );
    }
    // The largest id fits.
    let top = extract(Api::Completions, br#"{"prompt":[4294967295,0]}"#).unwrap();
    assert_eq!(top.text, "4294967295 0");
    // Another API's `prompt` is validated as JSON only, as before.
    assert!(extract(
        Api::Chat,
        br#"{"messages":[{"content":"hi"}],"prompt":[1,"a"]}"#
    )
    .is_ok());
    // `/generate`'s `input_ids` keep their reading.
    let g = extract(Api::Generate, br#"{"input_ids":[[1,2],[3]]}"#).unwrap();
    assert_eq!((g.text.as_ref(), g.token_ids), ("1 2 3", true));
}

#[test]
fn vllm_token_generate_routes_on_token_ids() {
    let body = br#"{"token_ids":[5,6,7],"sampling_params":{"max_tokens":4,"n":2},
        "model":"sql-lora","stream":true,"cache_salt":"t"}"#;
    let info = extract(Api::TokenGenerate, body).unwrap();
    assert!(info.token_ids);
    let marker = info.namespace.marker().unwrap();
    assert_eq!(info.text, format!("{marker}5 6 7"));
    assert_eq!(info.model.as_deref(), Some("sql-lora"));
    assert!(info.stream);
    assert_eq!(info.namespace.cache_salt.as_deref(), Some("t"));
    assert_eq!(info.shape.sampling_n, Some(2));
    let missing = extract(Api::TokenGenerate, br#"{"sampling_params":{}}"#).unwrap_err();
    assert!(
        missing.0.contains("`token_ids` is required"),
        "{}",
        missing.0
    );
    assert!(extract(Api::TokenGenerate, br#"{"token_ids":null}"#).is_err());
    let empty = extract(Api::TokenGenerate, br#"{"token_ids":[]}"#).unwrap_err();
    assert!(empty.0.contains("must not be empty"), "{}", empty.0);
    for bad in [
        &br#"{"token_ids":"1 2"}"#[..],
        br#"{"token_ids":[1,"2"]}"#,
        br#"{"token_ids":[[1]]}"#,
        br#"{"token_ids":[-3]}"#,
        br#"{"token_ids":[1],"token_ids":[2]}"#,
    ] {
        assert!(
            extract(Api::TokenGenerate, bad).is_err(),
            "{}",
            String::from_utf8_lossy(bad)
        );
    }
    // `text` or `prompt` do not route it (only validated).
    assert!(extract(Api::TokenGenerate, br#"{"text":"a"}"#).is_err());
    // To every other API `token_ids` is an unknown field (repeats allowed, any type).
    let chat = extract(
        Api::Chat,
        br#"{"messages":[{"content":"hi"}],"token_ids":"x","token_ids":[1]}"#,
    )
    .unwrap();
    assert!(!chat.token_ids);
    // A long prompt is cut at the cap like `input_ids` (the last number dropped by the
    // reader).
    let many: Vec<String> = (0..40_000).map(|i| (1_000_000 + i).to_string()).collect();
    let body = format!(r#"{{"token_ids":[{}]}}"#, many.join(","));
    let t = extract(Api::TokenGenerate, body.as_bytes()).unwrap().text;
    assert_eq!(t.len(), MAX_ROUTING_TEXT);
}

#[test]
fn a_token_id_prompt_is_counted_whole_for_billing() {
    let count = |api, body: &[u8]| extract(api, body).unwrap().shape.token_count;
    assert_eq!(count(Api::Completions, br#"{"prompt":[1,2,3]}"#), Some(3));
    assert_eq!(
        count(Api::Completions, br#"{"prompt":[[1,2],[3,4,5],[]]}"#),
        Some(5)
    );
    assert_eq!(count(Api::Completions, br#"{"prompt":"1 2"}"#), None);
    assert_eq!(count(Api::Completions, br#"{"prompt":["a","b"]}"#), None);
    assert_eq!(
        count(Api::TokenGenerate, br#"{"token_ids":[9,9]}"#),
        Some(2)
    );
    assert_eq!(count(Api::Generate, br#"{"input_ids":[9,9]}"#), None);
    // Counted past the routing text's cap too.
    let many = vec!["123456"; 40_000].join(",");
    let body = format!(r#"{{"prompt":[[{many}],[1]]}}"#);
    assert_eq!(count(Api::Completions, body.as_bytes()), Some(40_001));
}

/// Token-id prompts of every form (`/generate`'s `input_ids`, a completions `prompt` of ids or
/// of id lists, `/inference/v1/generate`'s `token_ids`) carry their namespace's marker, so the
/// text tree never matches one salt's or adapter's ids against another's: the same ids in two
/// namespaces give two texts, in one namespace the same text, and the ids after the marker.
#[test]
fn token_id_texts_are_kept_apart_by_namespace() {
    let forms: [(Api, &str); 4] = [
        (Api::Generate, r#""input_ids":[1,2,3]"#),
        (Api::Completions, r#""prompt":[1,2,3]"#),
        (Api::Completions, r#""prompt":[[1,2,3],[4]]"#),
        (Api::TokenGenerate, r#""token_ids":[1,2,3]"#),
    ];
    let namespaces = [
        "",
        r#","cache_salt":"t1""#,
        r#","cache_salt":"t2""#,
        r#","lora_path":"sql""#,
        r#","model":"m","lora_path":"sql""#,
        r#","extra_key":"k""#,
        r#","cache_salt":"t1","lora_path":"sql""#,
    ];
    for (api, ids) in forms {
        let texts: Vec<String> = namespaces
            .iter()
            .map(|ns| {
                let body = format!("{{{ids}{ns}}}");
                let info = extract(api, body.as_bytes()).unwrap();
                assert!(info.token_ids, "{body}");
                assert_eq!(without_marker(&info.text), "1 2 3", "{body}");
                info.text.into_owned()
            })
            .collect();
        assert_eq!(texts[0], "1 2 3", "{api:?}: the default namespace is bare");
        // The same adapter with or without a model: one namespace, one text.
        assert_eq!(texts[3], texts[4], "{api:?}");
        for (i, a) in texts.iter().enumerate() {
            for (j, b) in texts.iter().enumerate() {
                if i < j && !(i == 3 && j == 4) {
                    assert_ne!(a, b, "{api:?}: {} vs {}", namespaces[i], namespaces[j]);
                    // Neither is a prefix of the other: no text-tree match at all.
                    assert!(!a.starts_with(b.as_str()) && !b.starts_with(a.as_str()));
                }
            }
        }
        // The same namespace in another request: the same text.
        let again = format!("{{{ids},\"cache_salt\":\"t1\",\"stream\":true}}");
        assert_eq!(extract(api, again.as_bytes()).unwrap().text, texts[1]);
    }
    // A marker is taken off only whole.
    assert_eq!(without_marker("\u{1}0123456789abcdef\u{1}7 8"), "7 8");
    for t in [
        "7 8",
        "\u{1}0123456789abcde\u{1}7",
        "\u{1}0123456789abcdeg\u{1}7",
        "",
    ] {
        assert_eq!(without_marker(t), t);
    }
    // At the cap the marker counts: the ids fill what the marker leaves (the reader in
    // gateway::kv_routing drops a cut last id; tested there).
    let many: Vec<String> = (0..40_000).map(|i| (1_000_000 + i).to_string()).collect();
    let body = format!(r#"{{"token_ids":[{}],"cache_salt":"s"}}"#, many.join(","));
    let t = extract(Api::TokenGenerate, body.as_bytes()).unwrap().text;
    assert_eq!(t.len(), MAX_ROUTING_TEXT);
    let ids = without_marker(&t);
    assert_eq!(ids.len(), MAX_ROUTING_TEXT - MARKER_LEN);
    assert!(ids.starts_with("1000000 1000001 "));
}
