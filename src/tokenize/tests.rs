use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use proptest::prelude::*;
use serde_json::{json, Value as J};

use super::folder::{self, LLAMA3_TEMPLATE};
use super::*;

/// A fresh directory under the target dir (no tempfile crate needed).
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "radixgate-tok-{}-{}-{name}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn small() -> Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        let dir = temp_dir("small");
        folder::small_llama3_folder(&dir).unwrap();
        Arc::new(Tokenizer::from_path(&dir).unwrap())
    })
    .clone()
}

/// A folder with `tokenizer` and `config` (None: no tokenizer_config.json).
fn folder_with(name: &str, tokenizer: &J, config: Option<&J>) -> PathBuf {
    let dir = temp_dir(name);
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    if let Some(c) = config {
        std::fs::write(dir.join("tokenizer_config.json"), c.to_string()).unwrap();
    }
    dir
}

fn chat(messages: &[(&str, &str)]) -> Vec<u8> {
    let msgs: Vec<J> = messages
        .iter()
        .map(|(r, c)| json!({"role": r, "content": c}))
        .collect();
    json!({"model": "m", "messages": msgs})
        .to_string()
        .into_bytes()
}

fn chat_ids(cache: &mut SegmentCache, body: &[u8]) -> Result<Vec<u32>, TokenizeError> {
    let mut out = Vec::new();
    cache.chat_ids(body, &mut out)?;
    Ok(out)
}

const BOS: u32 = 128_000;
const START: u32 = 128_006;
const END: u32 = 128_007;
const EOT: u32 = 128_009;

#[test]
fn loads_the_small_folder_with_template_and_specials() {
    let t = small();
    assert!(t.has_chat_template());
    assert!(t.is_segment_cacheable());
    assert_eq!(t.token_to_id("<|begin_of_text|>"), Some(BOS));
    assert_eq!(t.token_to_id("<|eot_id|>"), Some(EOT));
    assert_eq!(t.affixes, Some((vec![BOS], vec![])));
    // A file path finds the config beside it.
    let dir = temp_dir("file");
    folder::small_llama3_folder(&dir).unwrap();
    let f = Tokenizer::from_path(&dir.join("tokenizer.json")).unwrap();
    assert!(f.has_chat_template());
    assert!(matches!(
        Tokenizer::from_path(&temp_dir("empty")),
        Err(LoadError::NoTokenizerJson(_))
    ));
}

#[test]
fn renders_llama3_exactly() {
    let t = small();
    let text = t
        .render_chat(&chat(&[("system", " Be brief. "), ("user", "Hi!\n")]))
        .unwrap();
    assert_eq!(
        text,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n"
    );
}

#[test]
fn chat_and_text_ids_match_a_whole_encode() {
    let t = small();
    let mut c = SegmentCache::new(t.clone(), 1 << 16);
    let body = chat(&[
        ("user", "The quick brown fox"),
        ("assistant", "jumps"),
        ("user", "over <|eot_id|> the dog"),
    ]);
    let ids = chat_ids(&mut c, &body).unwrap();
    let whole = t.encode(&t.render_chat(&body).unwrap(), false).unwrap();
    assert_eq!(ids, whole);
    assert_eq!(&ids[..2], &[BOS, START]);
    let nn = t.encode("\n\n", false).unwrap();
    assert_eq!(ids[ids.len() - 1 - nn.len()], END);
    assert_eq!(ids[ids.len() - nn.len()..], nn[..]);
    // Special-token text inside a message is a special token, as the server sees it.
    assert_eq!(ids.iter().filter(|&&x| x == EOT).count(), 4);
    let mut out = vec![7];
    c.text_ids("Hello world", &mut out).unwrap();
    assert_eq!(out[0], 7);
    assert_eq!(out[1..], t.encode("Hello world", true).unwrap()[..]);
    assert_eq!(out[1], BOS);
}

#[test]
fn turn_k_plus_1_encodes_only_its_new_messages() {
    let t = small();
    let mut c = SegmentCache::new(t.clone(), 1 << 16);
    let mut turns: Vec<(String, String)> =
        vec![("system".into(), "You are a helpful assistant.".into())];
    for k in 0..6 {
        turns.push((
            "user".into(),
            format!("Question number {k}: how are the tokens today?"),
        ));
        let msgs: Vec<(&str, &str)> = turns
            .iter()
            .map(|(r, c)| (r.as_str(), c.as_str()))
            .collect();
        let before = c.stats();
        let ids = chat_ids(&mut c, &chat(&msgs)).unwrap();
        let after = c.stats();
        assert_eq!(
            ids,
            t.encode(&t.render_chat(&chat(&msgs)).unwrap(), false)
                .unwrap()
        );
        if k > 0 {
            // New: the previous answer and this question, one piece each; the history's ids
            // came from the previous turn's text (the memo), not even looked up piece by piece.
            assert_eq!(after.misses - before.misses, 2, "turn {k}");
            assert!(after.memo_bytes > before.memo_bytes, "turn {k}");
        }
        turns.push((
            "assistant".into(),
            format!("Answer {k} is fine, thank you."),
        ));
    }
}

#[test]
fn continue_final_message_and_a_trailing_assistant() {
    let t = small();
    let base = json!({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I"}]});
    let mut cont = base.clone();
    cont["continue_final_message"] = json!(true);
    let text = t.render_chat(cont.to_string().as_bytes()).unwrap();
    assert!(
        text.ends_with("<|start_header_id|>assistant<|end_header_id|>\n\nHello, I"),
        "{text}"
    );
    // Without the flag SGLang turns the final assistant message into a user message.
    let text = t.render_chat(base.to_string().as_bytes()).unwrap();
    assert!(
        text.contains("user<|end_header_id|>\n\nHello, I<|eot_id|>"),
        "{text}"
    );
    let mut c = SegmentCache::new(t.clone(), 1 << 16);
    let ids = chat_ids(&mut c, cont.to_string().as_bytes()).unwrap();
    assert_eq!(
        ids,
        t.encode(&t.render_chat(cont.to_string().as_bytes()).unwrap(), false)
            .unwrap()
    );
}

#[test]
fn requests_the_server_would_refuse_are_errors() {
    let t = small();
    let mut c = SegmentCache::new(t.clone(), 1 << 10);
    let mut out = vec![1, 2];
    for body in [
        &b"not json"[..],
        b"[]",
        b"{}",
        b"{\"messages\": []}",
        b"{\"messages\": [1]}",
        b"{\"messages\": [{\"content\": \"x\"}]}",
        b"{\"messages\": [{\"role\": \"wizard\", \"content\": \"x\"}]}",
        b"{\"messages\": [{\"role\": \"user\", \"content\": 5}]}",
    ] {
        assert!(
            matches!(
                c.chat_ids(body, &mut out),
                Err(TokenizeError::BadRequest(_))
            ),
            "{}",
            String::from_utf8_lossy(body)
        );
        assert_eq!(out, [1, 2], "out untouched on error");
    }
    // A folder without a config has no template.
    let dir = folder_with("notemplate", &folder::small_llama3_tokenizer_json(), None);
    let nt = Arc::new(Tokenizer::from_path(&dir).unwrap());
    let mut c2 = SegmentCache::new(nt, 1 << 10);
    assert_eq!(
        c2.chat_ids(&chat(&[("user", "x")]), &mut out),
        Err(TokenizeError::NoChatTemplate)
    );
    c2.text_ids("still works", &mut out).unwrap();
}

#[test]
fn size_limits_refuse_before_encoding() {
    let dir = temp_dir("limits");
    folder::small_llama3_folder(&dir).unwrap();
    let limits = Limits {
        max_body_bytes: 4096,
        max_text_bytes: 2048,
        max_word_bytes: 300,
        template_fuel: 100_000,
    };
    let t = Arc::new(Tokenizer::from_path_with(&dir, limits).unwrap());
    let mut c = SegmentCache::new(t.clone(), 1 << 12);
    let mut out = Vec::new();
    assert_eq!(
        c.chat_ids(&chat(&[("user", &"word ".repeat(1000))]), &mut out),
        Err(TokenizeError::TooLarge)
    );
    assert_eq!(
        c.chat_ids(&chat(&[("user", &"word ".repeat(500))]), &mut out),
        Err(TokenizeError::TooLarge)
    );
    assert_eq!(
        c.chat_ids(&chat(&[("user", &"x".repeat(301))]), &mut out),
        Err(TokenizeError::TooLarge)
    );
    assert_eq!(
        c.text_ids(&"y".repeat(301), &mut out),
        Err(TokenizeError::TooLarge)
    );
    assert_eq!(
        c.text_ids(&"y ".repeat(1100), &mut out),
        Err(TokenizeError::TooLarge)
    );
    assert!(out.is_empty());
    c.chat_ids(&chat(&[("user", &"x".repeat(300))]), &mut out)
        .unwrap();
    // A 20-message chat renders well within 100k of fuel.
    let msgs: Vec<(&str, &str)> = (0..20)
        .map(|i| {
            (
                if i % 2 == 0 { "user" } else { "assistant" },
                "a few words here",
            )
        })
        .collect();
    t.render_chat(&chat(&msgs)).unwrap();
    // The fuel budget stops a template that loops forever-ish without printing (one that
    // prints is stopped sooner by the output cap, asserted below).
    let tpl = "{% for i in range(100000) %}{% for m in messages %}{% set x = m.content %}{% endfor %}{% endfor %}";
    let dir2 = folder_with(
        "fuel",
        &folder::small_llama3_tokenizer_json(),
        Some(&folder::llama3_config(tpl)),
    );
    let t2 = Tokenizer::from_path_with(&dir2, limits).unwrap();
    assert!(
        matches!(t2.render_chat(&chat(&[("user", "x")])), Err(TokenizeError::Template(m)) if m.contains("budget"))
    );
    let tpl = "{% for i in range(100000) %}{% for m in messages %}{{ m.content }}{% endfor %}{% endfor %}";
    let dir3 = folder_with(
        "printing",
        &folder::small_llama3_tokenizer_json(),
        Some(&folder::llama3_config(tpl)),
    );
    let t3 = Tokenizer::from_path_with(&dir3, limits).unwrap();
    assert_eq!(
        t3.render_chat(&chat(&[("user", "x")])),
        Err(TokenizeError::TooLarge)
    );
}

#[test]
fn eviction_keeps_the_cache_bounded_and_exact() {
    let t = small();
    let mut c = SegmentCache::new(t.clone(), 400);
    for i in 0..200 {
        let body = chat(&[(
            "user",
            &format!("message {i} with some words in it {}", i * 7),
        )]);
        assert_eq!(
            chat_ids(&mut c, &body).unwrap(),
            t.encode(&t.render_chat(&body).unwrap(), false).unwrap()
        );
        assert!(c.stats().cached_tokens <= 400);
    }
    let s = c.stats();
    assert!(s.evicted > 0 && s.entries > 0, "{s:?}");
    // The recently used pieces survive: the role names hit.
    let before = c.stats().hits;
    chat_ids(&mut c, &chat(&[("user", "fresh")])).unwrap();
    assert!(c.stats().hits > before);
}

/// The small tokenizer with extra added tokens using lstrip / rstrip / non-special / normalized.
fn flagged_tokenizer(single_word: bool) -> J {
    let mut tj = folder::small_llama3_tokenizer_json();
    let added = tj["added_tokens"].as_array_mut().unwrap();
    let mk = |id: u32, c: &str, l: bool, r: bool, n: bool, s: bool, sw: bool| json!({"id": id, "content": c, "single_word": sw, "lstrip": l, "rstrip": r, "normalized": n, "special": s});
    added.push(mk(128_256, "<L>", true, false, false, true, false));
    added.push(mk(128_257, "<R>", false, true, false, true, false));
    added.push(mk(128_258, "<LR>", true, true, false, false, false));
    added.push(mk(128_259, "tok", false, false, false, false, single_word));
    added.push(mk(128_260, "hello", false, false, true, false, false));
    tj
}

#[test]
fn flags_single_word_and_metaspace_first_fall_back_to_whole_encodes() {
    let d = folder_with(
        "sw",
        &flagged_tokenizer(true),
        Some(&folder::llama3_config(LLAMA3_TEMPLATE)),
    );
    let t = Arc::new(Tokenizer::from_path(&d).unwrap());
    assert!(!t.is_segment_cacheable());
    let mut c = SegmentCache::new(t.clone(), 1 << 12);
    let body = chat(&[("user", "a tok b xtoky <L> x")]);
    assert_eq!(
        chat_ids(&mut c, &body).unwrap(),
        t.encode(&t.render_chat(&body).unwrap(), false).unwrap()
    );
    assert_eq!(c.stats().whole_encodes, 1);
    let mut meta = folder::small_llama3_tokenizer_json();
    meta["pre_tokenizer"] =
        json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true});
    let d = folder_with("meta", &meta, None);
    assert!(!Tokenizer::from_path(&d).unwrap().is_segment_cacheable());
}

fn content_strategy() -> impl Strategy<Value = String> {
    let chunk = prop_oneof![
        4 => "[a-zA-Z ,.!?'0-9]{0,30}",
        1 => prop::sample::select(vec!["<|eot_id|>", "<|start_header_id|>", "<|begin_of_text|>", "<|reserved_special_token_7|>", "<L>", "<R>", "<LR>", "tok", "hello", "<|eot_id", "|>"]).prop_map(str::to_string),
        1 => "[ \t\n\r\u{a0}\u{1c}\u{2003}]{0,4}",
        1 => "\\PC{0,8}",
        1 => Just(String::new()),
    ];
    prop::collection::vec(chunk, 0..5).prop_map(|v| v.concat())
}

fn conversation() -> impl Strategy<Value = Vec<(String, String)>> {
    prop::collection::vec(
        (
            prop::sample::select(vec!["system", "user", "assistant", "tool"]),
            content_strategy(),
        ),
        1..8,
    )
    .prop_map(|v| v.into_iter().map(|(r, c)| (r.to_string(), c)).collect())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Cached ids equal `tokenizers`' whole-text encode, turn after turn on one cache, for the
    /// Llama-3 tokenizer and for one whose added tokens strip whitespace.
    #[test]
    fn cached_ids_equal_whole_encodes(conv in conversation(), text in content_strategy()) {
        let flagged = {
            static T: OnceLock<Arc<Tokenizer>> = OnceLock::new();
            T.get_or_init(|| {
                let d = folder_with("flags", &flagged_tokenizer(false), Some(&folder::llama3_config(LLAMA3_TEMPLATE)));
                Arc::new(Tokenizer::from_path(&d).unwrap())
            }).clone()
        };
        prop_assert!(flagged.is_segment_cacheable());
        for t in [small(), flagged] {
            let mut c = SegmentCache::new(t.clone(), 1 << 14);
            for k in 1..=conv.len() {
                let msgs: Vec<(&str, &str)> = conv[..k].iter().map(|(r, c)| (r.as_str(), c.as_str())).collect();
                let body = chat(&msgs);
                let rendered = t.render_chat(&body).unwrap();
                let whole = t.hf.encode(rendered.as_str(), false).unwrap().get_ids().to_vec();
                prop_assert_eq!(chat_ids(&mut c, &body).unwrap(), whole);
            }
            let mut out = Vec::new();
            c.text_ids(&text, &mut out).unwrap();
            prop_assert_eq!(out, t.hf.encode(text.as_str(), true).unwrap().get_ids().to_vec());
        }
    }

    /// Arbitrary JSON never panics: it is tokenized or refused with a reason.
    #[test]
    fn arbitrary_bodies_never_panic(body in arbitrary_json(), raw in prop::collection::vec(any::<u8>(), 0..64)) {
        let t = small();
        let mut c = SegmentCache::new(t, 1 << 12);
        let mut out = Vec::new();
        for b in [body.to_string().into_bytes(), json!({"messages": body}).to_string().into_bytes(), json!({"messages": [{"role": "user", "content": body}], "tools": body, "chat_template_kwargs": body}).to_string().into_bytes(), raw] {
            match c.chat_ids(&b, &mut out) {
                Ok(()) => {}
                Err(e) => prop_assert!(!e.to_string().contains("panicked"), "{e}"),
            }
        }
    }
}

fn arbitrary_json() -> impl Strategy<Value = J> {
    let leaf = prop_oneof![
        Just(J::Null),
        any::<bool>().prop_map(J::from),
        any::<i64>().prop_map(J::from),
        (-1e300f64..1e300).prop_map(J::from),
        "\\PC{0,12}".prop_map(J::from),
        prop::sample::select(vec![
            "user",
            "assistant",
            "system",
            "tool",
            "content",
            "role",
            "text",
            "<|eot_id|>"
        ])
        .prop_map(J::from),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(J::Array),
            prop::collection::vec(
                (
                    prop::sample::select(vec![
                        "role",
                        "content",
                        "type",
                        "text",
                        "tool_calls",
                        "function",
                        "arguments",
                        "name",
                        "x"
                    ]),
                    inner
                ),
                0..6
            )
            .prop_map(|kv| J::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())),
        ]
    })
}

fn render_with(template: &str, body: impl ToString) -> Result<String, TokenizeError> {
    let d = folder_with(
        "tpl",
        &folder::small_llama3_tokenizer_json(),
        Some(&folder::llama3_config(template)),
    );
    Tokenizer::from_path(&d)
        .unwrap()
        .render_chat(body.to_string().as_bytes())
}

#[test]
fn template_speaks_python() {
    // Raw text: serde_json's own maps would sort the keys before the tokenizer sees them.
    let body = r#"{"messages": [{"role": "user", "content": "  hi \u001c"}],
                   "tools": [{"type": "function", "function": {"name": "f", "parameters": {"z": 1, "a": [1.5, 1e20, "é\"<"]}}}],
                   "chat_template_kwargs": {"flag": true, "n": null}}"#;
    // tojson is json.dumps(ensure_ascii=False): key order kept, Python float repr, no HTML escapes.
    // (The function as SGLang 0.5.23 dumps it: the client's keys first, then the description it
    // left out; no `strict` unless sent.)
    assert_eq!(
        render_with("{{ tools[0].function | tojson }}", body).unwrap(),
        r#"{"name": "f", "parameters": {"z": 1, "a": [1.5, 1e+20, "é\"<"]}, "description": null}"#
    );
    assert_eq!(
        render_with(
            "{{ tools[0].function.parameters | tojson(indent=2, sort_keys=true) }}",
            body
        )
        .unwrap(),
        "{\n  \"a\": [\n    1.5,\n    1e+20,\n    \"é\\\"<\"\n  ],\n  \"z\": 1\n}"
    );
    // Python printing and whitespace.
    assert_eq!(render_with("{{ flag }}|{{ n | string }}|{{ [1, 'a'] }}|{{ messages[0].content.strip() }}|{{ messages[0].content | trim }}|", body).unwrap(), "True|None|[1, 'a']|hi|hi|");
    assert_eq!(render_with("{{ 'a b  c'.split() | length }}{{ 'xx'.startswith('x') }}{% for k, v in {'a': 1}.items() %}{{ k }}{{ v }}{% endfor %}", body).unwrap(), "3Truea1");
    // trim_blocks / lstrip_blocks, loop controls, the generation block.
    assert_eq!(
        render_with(
            "{% for m in messages %}\n  {% if true %}\nX{% break %}\n  {% endif %}\n{% endfor %}\n",
            body
        )
        .unwrap(),
        "X"
    );
    assert_eq!(
        render_with("{%- generation -%} A {%- endgeneration %}", body).unwrap(),
        "A"
    );
    // raise_exception's message is the error.
    assert_eq!(
        render_with("{{ raise_exception('no tools here') }}", body),
        Err(TokenizeError::Template("no tools here".into()))
    );
    let year = render_with("{{ strftime_now('%Y') }}", body).unwrap();
    assert!(year.parse::<u32>().unwrap() >= 2024);
    // tools absent: defined and none, as HF passes it.
    assert_eq!(
        render_with(
            "{{ tools is defined }}{{ tools is none }}",
            json!({"messages": [{"role": "user", "content": "x"}]})
        )
        .unwrap(),
        "TrueTrue"
    );
}

#[test]
fn content_parts_follow_the_template_kind() {
    let body = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "b"}]},
                                   {"role": "tool", "content": [{"type": "text", "text": "c"}, {"type": "text", "text": "d"}], "tool_call_id": "1", "name": null}]});
    // A template that prints content gets the text parts joined with a space.
    assert_eq!(
        render_with(
            "{% for m in messages %}[{{ m.content }}]{% endfor %}",
            &body
        )
        .unwrap(),
        "[a b][c d]"
    );
    // One that loops over message['content'] gets the parts, media normalized.
    assert_eq!(
        render_with("{% for m in messages %}{% if m.content is string %}<{{ m.content }}>{% else %}{% for p in m['content'] %}{{ p.type }},{% endfor %}{% endif %}{% endfor %}", &body).unwrap(),
        "text,image,text,<c d>"
    );
    // Null fields are dropped, declared ones kept.
    assert_eq!(
        render_with("{{ messages[1] | tojson }}", &body).unwrap(),
        r#"{"role": "tool", "content": "c d", "tool_call_id": "1"}"#
    );
}

#[test]
fn tool_calls_arguments_are_parsed_and_tool_choice_filters() {
    let body = json!({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"b\": 2, \"a\": 1}"}}]}, {"role": "tool", "content": "ok"}],
                      "tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}],
                      "tool_choice": {"type": "function", "function": {"name": "g"}}});
    assert_eq!(render_with("{{ messages[1].tool_calls[0].function.arguments | tojson }}|{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}", &body).unwrap(), r#"{"b": 2, "a": 1}|g"#);
    let mut none = body.clone();
    none["tool_choice"] = json!("none");
    assert_eq!(render_with("{{ tools is none }}", &none).unwrap(), "True");
    let mut bad = body.clone();
    bad["messages"][1]["tool_calls"][0]["function"]["arguments"] = json!("{not json");
    assert!(matches!(
        render_with("x", &bad),
        Err(TokenizeError::BadRequest(_))
    ));
}

#[test]
fn python_float_repr() {
    use super::pyjson::py_float_repr as r;
    for (f, s) in [
        (1.0, "1.0"),
        (0.1, "0.1"),
        (1e16, "1e+16"),
        (1e15, "1000000000000000.0"),
        (1.5e-7, "1.5e-07"),
        (0.0001, "0.0001"),
        (-2.5, "-2.5"),
        (123.456, "123.456"),
        (0.0, "0.0"),
        (1e-5, "1e-05"),
    ] {
        assert_eq!(r(f, true), s, "{f}");
    }
    assert_eq!(r(f64::INFINITY, true), "Infinity");
}

#[test]
fn strftime_codes() {
    // 2024-07-26 13:05:09 UTC, a Friday.
    assert_eq!(
        template::strftime("%d %b %Y %H:%M:%S %A %j %%", 1_721_999_109),
        "26 Jul 2024 13:05:09 Friday 208 %"
    );
}

/// The folder helper's files load as a model folder (used by other crates' tests).
#[test]
fn folder_helper_writes_loadable_files() {
    let dir = temp_dir("helper");
    folder::small_llama3_folder(&dir).unwrap();
    assert!(Path::new(&dir.join("tokenizer_config.json")).is_file());
    let t = Tokenizer::from_path(&dir).unwrap();
    let ids = t.encode("the tokens", false).unwrap();
    assert!(ids.len() < "the tokens".len(), "merges apply: {ids:?}");
    assert_eq!(t.decode(&ids).unwrap(), "the tokens");
}

/// Loaded once and shared by every core; each core builds its own cache on its thread.
#[test]
fn tokenizer_is_shared_and_caches_move_to_their_core() {
    fn shared<T: Send + Sync>() {}
    fn movable<T: Send>() {}
    shared::<Tokenizer>();
    movable::<SegmentCache>();
}

/// The golden folder `scripts/tokenize-golden.py` renders with transformers: the small
/// tokenizer plus the golden template as `chat_template.jinja`.
fn golden_folder(dir: &Path, template: &str) {
    folder::small_llama3_folder(dir).unwrap();
    std::fs::write(dir.join("chat_template.jinja"), template).unwrap();
}

#[test]
#[ignore = "writes /tmp/radixgate-golden for scripts/tokenize-golden.py"]
fn write_golden_folder() {
    let g: J =
        serde_json::from_str(include_str!("../../tests/fixtures/tokenize_golden.json")).unwrap();
    golden_folder(
        Path::new("/tmp/radixgate-golden"),
        g["template"].as_str().unwrap(),
    );
}

/// What HF transformers renders and encodes (tests/fixtures/tokenize_golden.json) for requests
/// using tools (`tojson(indent=4)`, non-ASCII), tool calls with string arguments, a tool result
/// with Python whitespace, special-token text, content parts, a trailing assistant message,
/// Python printing of lists / None / floats, namespaces and whitespace control.
#[test]
fn matches_transformers_goldens() {
    let g: J =
        serde_json::from_str(include_str!("../../tests/fixtures/tokenize_golden.json")).unwrap();
    let dir = temp_dir("golden");
    golden_folder(&dir, g["template"].as_str().unwrap());
    let t = Arc::new(Tokenizer::from_path(&dir).unwrap());
    let mut c = SegmentCache::new(t.clone(), 1 << 16);
    for (i, case) in g["cases"].as_array().unwrap().iter().enumerate() {
        let body = case["body"].as_str().unwrap().as_bytes();
        assert_eq!(
            t.render_chat(body).unwrap(),
            case["text"].as_str().unwrap(),
            "case {i}"
        );
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(chat_ids(&mut c, body).unwrap(), want, "case {i}");
    }
    let mut ids = Vec::new();
    c.text_ids(g["prompt"].as_str().unwrap(), &mut ids).unwrap();
    assert_eq!(J::from(ids), g["prompt_ids"]);
}

/// The small tokenizer's JSON with another pre-tokenizer (and normalizer).
fn retokenized(pre: J, normalizer: J) -> Arc<Tokenizer> {
    let mut tj = folder::small_llama3_tokenizer_json();
    tj["pre_tokenizer"] = pre;
    tj["normalizer"] = normalizer;
    let d = folder_with("retok", &tj, Some(&folder::llama3_config(LLAMA3_TEMPLATE)));
    Arc::new(Tokenizer::from_path(&d).unwrap())
}

fn split_then_byte_level(pattern: &str) -> J {
    json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
    ]})
}

/// The tokenizers the word cut is allowed for, each different in its pre-tokenizer: Llama-3's
/// regex (the small folder), tiktoken's possessive cl100k, Qwen2's one-digit regex with NFC,
/// and GPT-2's own ByteLevel regex.
fn word_cut_tokenizers() -> Vec<Arc<Tokenizer>> {
    static T: OnceLock<Vec<Arc<Tokenizer>>> = OnceLock::new();
    T.get_or_init(|| {
        vec![
            small(),
            retokenized(split_then_byte_level(WORD_CUT_PATTERNS[1]), J::Null),
            retokenized(
                split_then_byte_level(WORD_CUT_PATTERNS[2]),
                json!({"type": "NFC"}),
            ),
            retokenized(
                json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}),
                J::Null,
            ),
        ]
    })
    .clone()
}

#[test]
fn word_cut_only_for_pre_tokenizers_known_to_split_there() {
    for t in word_cut_tokenizers() {
        assert!(t.is_word_cacheable(), "{t:?}");
    }
    let prefix_space = retokenized(
        json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
        J::Null,
    );
    let other_regex = retokenized(split_then_byte_level(r"\S+\s*"), J::Null);
    let lowercase = retokenized(
        split_then_byte_level(folder::LLAMA3_PATTERN),
        json!({"type": "Lowercase"}),
    );
    for t in [prefix_space, other_regex, lowercase] {
        assert!(!t.is_word_cacheable(), "{t:?}");
        assert!(t.is_segment_cacheable());
    }
    // A normalized added token could span a word cut: no word cache.
    let d = folder_with(
        "flags-words",
        &flagged_tokenizer(false),
        Some(&folder::llama3_config(LLAMA3_TEMPLATE)),
    );
    assert!(!Tokenizer::from_path(&d).unwrap().is_word_cacheable());
}

#[test]
fn a_new_message_of_known_words_encodes_only_its_new_words() {
    let t = small();
    let mut c = SegmentCache::new(t.clone(), 1 << 16);
    let mut out = Vec::new();
    let first = "the quick brown fox jumps over the lazy dog while the cat sleeps";
    c.text_ids(first, &mut out).unwrap();
    let before = c.stats();
    assert!(before.word_entries >= 10, "{before:?}");
    out.clear();
    let second = "the lazy cat jumps over the quick dog zebra";
    c.text_ids(second, &mut out).unwrap();
    assert_eq!(out, t.hf.encode(second, true).unwrap().get_ids().to_vec());
    let after = c.stats();
    // Every word but " zebra" was seen in the first text.
    assert_eq!(after.word_misses - before.word_misses, 1, "{after:?}");
    assert_eq!(after.word_hits - before.word_hits, 8, "{after:?}");
}

#[test]
fn the_word_cache_is_bounded() {
    let t = small();
    let mut c = SegmentCache::new(t, 1 << 22);
    let mut out = Vec::new();
    // Distinct words, a few thousand per text, well past MAX_WORDS in all.
    let mut n = 0u64;
    for _ in 0..40 {
        let text: String = (0..3000)
            .map(|_| {
                n += 1;
                let w: String = format!("{n:x}")
                    .bytes()
                    .map(|b| char::from(b'a' + (b % 26)))
                    .collect();
                format!("w{w} ")
            })
            .collect::<String>()
            + "end";
        out.clear();
        c.text_ids(&text, &mut out).unwrap();
        assert!(c.stats().word_entries <= MAX_WORDS, "{:?}", c.stats());
    }
    assert!(c.stats().word_entries > MAX_WORDS / 2);
}

fn wordy_text() -> impl Strategy<Value = String> {
    let word = prop_oneof![
        6 => prop::sample::select(vec!["the", "The", "cat", "sat", "on", "a", "mat", "it's", "we'll", "don't", "I", "x", "zebra", "naïve", "中文", "end"]).prop_map(str::to_string),
        1 => "[a-zA-Z]{1,6}",
        1 => "[0-9]{1,5}",
        1 => "[,.!?;:'\"()\\-]{1,3}",
        1 => "\\PC{1,3}",
    ];
    let sep = prop_oneof![
        8 => Just(" ".to_string()),
        1 => Just("  ".to_string()),
        1 => Just("\n".to_string()),
        1 => Just(" \n\n".to_string()),
        1 => Just("\t".to_string()),
        1 => Just(String::new()),
    ];
    prop::collection::vec((word, sep), 0..40)
        .prop_map(|v| v.into_iter().map(|(w, s)| w + &s).collect())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Texts of repeated words through one cache (so later texts are mostly word hits) give
    /// `tokenizers`' whole encode, for every pre-tokenizer the word cut is allowed for.
    #[test]
    fn word_cached_ids_equal_whole_encodes(texts in prop::collection::vec(wordy_text(), 1..6)) {
        for t in word_cut_tokenizers() {
            let mut c = SegmentCache::new(t.clone(), 1 << 14);
            for text in &texts {
                let mut out = Vec::new();
                c.text_ids(text, &mut out).unwrap();
                prop_assert_eq!(&out, &t.hf.encode(text.as_str(), true).unwrap().get_ids().to_vec(), "{:?}", text);
                let body = chat(&[("user", text.as_str())]);
                let rendered = t.render_chat(&body).unwrap();
                let whole = t.hf.encode(rendered.as_str(), false).unwrap().get_ids().to_vec();
                prop_assert_eq!(chat_ids(&mut c, &body).unwrap(), whole);
            }
        }
    }
}

/// The flagged tokenizer (lstrip / rstrip / non-special added tokens), loaded once.
fn flagged() -> Arc<Tokenizer> {
    static T: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    T.get_or_init(|| {
        let d = folder_with(
            "flags-memo",
            &flagged_tokenizer(false),
            Some(&folder::llama3_config(LLAMA3_TEMPLATE)),
        );
        Arc::new(Tokenizer::from_path(&d).unwrap())
    })
    .clone()
}

#[test]
fn a_retry_and_a_fan_out_reuse_the_shared_text_exactly() {
    for t in [small(), flagged()] {
        let mut c = SegmentCache::new(t.clone(), 1 << 16);
        let history: Vec<(String, String)> = (0..6)
            .map(|i| {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                (
                    role.to_string(),
                    format!("Message {i} <R>  with some words in it."),
                )
            })
            .collect();
        for q in ["Why?", "  How <L> so?", "<LR>When", "tok tok"] {
            let mut m: Vec<(&str, &str)> = history
                .iter()
                .map(|(r, c)| (r.as_str(), c.as_str()))
                .collect();
            m.push(("user", q));
            let body = chat(&m);
            let before = c.stats().memo_bytes;
            let whole = t.encode(&t.render_chat(&body).unwrap(), false).unwrap();
            assert_eq!(chat_ids(&mut c, &body).unwrap(), whole, "{q}");
            if q != "Why?" {
                // The history (all but the last message) came from the previous question's text.
                assert!(c.stats().memo_bytes - before > 100, "{q}");
            }
        }
    }
}

#[test]
fn the_text_memo_is_bounded() {
    let t = small();
    let mut c = SegmentCache::new(t.clone(), 1 << 16);
    let mut out = Vec::new();
    for i in 0..200 {
        // Distinct texts, some over the size a text is remembered at.
        let len = if i % 20 == 0 {
            memo::MEMO_TEXT_BYTES + 10
        } else {
            3000
        };
        let text: String = format!("{i} <|eot_id|>")
            .chars()
            .chain("abc de ".chars().cycle())
            .take(len)
            .collect();
        out.clear();
        c.text_ids(&text, &mut out).unwrap();
        assert_eq!(out, t.encode(&text, true).unwrap());
        let (texts, bytes) = c.memo.held();
        assert!(texts <= memo::MEMO_TEXTS);
        assert!(bytes <= memo::MEMO_TEXTS * 3000);
    }
}

fn cut_at_char(s: &str, at: usize) -> &str {
    let mut at = at.min(s.len());
    while !s.is_char_boundary(at) {
        at -= 1;
    }
    &s[..at]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Texts sharing a prefix cut anywhere (inside an added token, inside the whitespace an
    /// `rstrip` token swallows, right before an `lstrip` one), one cache after another text:
    /// the ids through the memo equal `tokenizers`' whole encode.
    #[test]
    fn memo_reuse_equals_whole_encodes(
        base in prop::collection::vec(content_strategy(), 1..6),
        tails in prop::collection::vec((0usize..400, content_strategy()), 1..6),
    ) {
        let base = base.concat();
        for t in [small(), flagged()] {
            let mut c = SegmentCache::new(t.clone(), 1 << 14);
            let mut out = Vec::new();
            for (cut, tail) in &tails {
                let text = format!("{}{}", cut_at_char(&base, *cut), tail);
                out.clear();
                c.text_ids(&text, &mut out).unwrap();
                prop_assert_eq!(&out, &t.hf.encode(text.as_str(), true).unwrap().get_ids().to_vec(), "{:?}", text);
            }
        }
    }
}

#[test]
fn the_piece_cache_counts_empty_entries_and_evicts_in_bounded_steps() {
    // Pieces that encode to no id at all still count (a flood of them stays bounded).
    let mut c = IdCache::default();
    for i in 0..100_000u32 {
        c.insert(Key::of(&format!("p{i}")), Box::new([]));
        if c.weight > 1_000 {
            c.shrink_to(750);
        }
    }
    assert!(c.len() <= 1_000 && c.weight <= 1_000, "{} entries", c.len());
    // A used entry gets a second chance; an unused one goes first.
    let mut c = IdCache::default();
    let (a, b) = (Key::of("a"), Key::of("b"));
    c.insert(a, Box::new([1, 2]));
    c.insert(b, Box::new([3, 4]));
    assert_eq!(c.get(&a), Some(&[1u32, 2][..]));
    assert_eq!(c.shrink_to(2), 1);
    assert!(c.contains(&a) && !c.contains(&b));
    // Keys are seeded: not the plain XXH3 of the text (clients cannot aim at buckets).
    assert_ne!(Key::of("a").hash, xxhash_rust::xxh3::xxh3_64(b"a"));
}

#[test]
fn a_deadline_stops_unseen_text_but_never_cached_pieces() {
    let t = small();
    let mut warm = SegmentCache::new(t.clone(), 1 << 20);
    // Many distinct words: runs of unseen words are encoded in parts, the clock between them.
    let long: String = (0..3000).map(|i| format!("w{i}x ")).collect();
    let body = chat(&[("user", &long)]);
    let want = chat_ids(&mut warm, &body).unwrap();
    // Encoded in parts, exactly as in one call.
    let whole = t.encode_raw(&t.render_chat(&body).unwrap(), false).unwrap();
    assert_eq!(want, whole);
    assert!(long.len() > 10 * MAX_RUN_BYTES);
    // Past its deadline, a cold cache gives up on the unseen text, leaving `out` untouched...
    let mut cold = SegmentCache::new(t.clone(), 1 << 20);
    cold.set_deadline(Some(std::time::Instant::now()));
    let mut out = vec![7];
    assert_eq!(cold.chat_ids(&body, &mut out), Err(TokenizeError::TooSlow));
    assert_eq!(out, [7]);
    // ...and the warm one answers from its pieces without looking at the clock.
    warm.set_deadline(Some(std::time::Instant::now()));
    assert_eq!(chat_ids(&mut warm, &body).unwrap(), want);
    // A deadline in the future changes nothing; after a give-up, the cache still encodes right.
    cold.set_deadline(Some(
        std::time::Instant::now() + std::time::Duration::from_secs(60),
    ));
    assert_eq!(chat_ids(&mut cold, &body).unwrap(), want);
}

/// Tools reach the template as SGLang 0.5.23's pydantic models dump them (checked against
/// SGLang's own code in tests/tokenizer_golden.rs): each function's keys in the order the client
/// sent them, the fields it left out after them, `strict` only when sent, a tool-level
/// `defer_loading` copied into the function; no tool left means `tools` is none.
#[test]
fn tools_are_dumped_as_sglang_0_5_23_dumps_them() {
    let body = r#"{"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"function": {"parameters": {"b": 1, "a": 2}, "name": "f", "extra": 0}, "type": "function"},
        {"type": "function", "defer_loading": true,
         "function": {"description": "d", "strict": true, "name": "g", "strict": null}},
        {"type": "function", "function": {"strict": false, "name": "h", "description": null}}]}"#;
    assert_eq!(
        render_with("{% for t in tools %}{{ t | tojson }}\n{% endfor %}", body).unwrap(),
        concat!(
            r#"{"type": "function", "function": {"parameters": {"b": 1, "a": 2}, "name": "f", "description": null}, "defer_loading": null}"#,
            "\n",
            r#"{"type": "function", "function": {"description": "d", "name": "g", "parameters": null, "defer_loading": true}, "defer_loading": true}"#,
            "\n",
            r#"{"type": "function", "function": {"strict": false, "name": "h", "description": null, "parameters": null}, "defer_loading": null}"#,
            "\n",
        )
    );
    // No tool left: none, as SGLang passes `tools=None`.
    let none = |extra: &str| {
        render_with(
            "{{ tools is none }}",
            format!(r#"{{"messages": [{{"role": "user", "content": "hi"}}]{extra}}}"#),
        )
        .unwrap()
    };
    assert_eq!(none(r#", "tools": []"#), "True");
    assert_eq!(
        none(
            r#", "tools": [{"type": "function", "function": {"name": "f"}}],
               "tool_choice": {"type": "function", "function": {"name": "other"}}"#
        ),
        "True"
    );
    assert_eq!(
        none(r#", "tools": [{"type": "function", "function": {"name": "f"}}]"#),
        "False"
    );
    // The fields SGLang 0.5.23 declares for a non-user message, `phase` and `prefix` among them,
    // and its `root` role.
    assert_eq!(
        render_with(
            "{% for m in messages %}{{ m | tojson }}{% endfor %}",
            r#"{"messages": [{"role": "Root", "prefix": true, "phase": "commentary", "content": "x", "bogus": 1}, {"role": "user", "content": "y"}]}"#
        )
        .unwrap(),
        r#"{"role": "root", "content": "x", "phase": "commentary", "prefix": true}{"role": "user", "content": "y"}"#
    );
}

/// A continued final message is encoded on its own, as SGLang 0.5.23 does
/// (`_append_assistant_prefix_to_prompt_ids`): the template's ids, then the message's as a
/// plain prompt with its leading BOS dropped. (One encode of the joined text differs where the
/// message starts with whitespace the template's last piece would take: a newline after
/// `assistant\n` in Qwen's vocabulary, tests/tokenizer_golden.rs.)
#[test]
fn a_continued_final_message_is_encoded_on_its_own() {
    let t = small();
    let body = br#"{"messages": [{"role": "user", "content": "Say hi"},
                   {"role": "assistant", "content": "\n\nHello there"}], "continue_final_message": true}"#;
    let text = t.render_chat(body).unwrap();
    let (head, tail) = text.split_at(text.len() - "\n\nHello there".len());
    assert_eq!(tail, "\n\nHello there");
    let tail_ids = t.encode(tail, true).unwrap();
    assert_eq!(
        tail_ids[0], BOS,
        "the small tokenizer adds BOS to a plain prompt"
    );
    let mut want = t.encode(head, false).unwrap();
    want.extend_from_slice(&tail_ids[1..]);
    let mut c = SegmentCache::new(t.clone(), 1 << 16);
    assert_eq!(chat_ids(&mut c, body).unwrap(), want);
    assert_eq!(chat_ids(&mut c, body).unwrap(), want, "cached");
    // An empty continued message adds nothing.
    let empty = br#"{"messages": [{"role": "user", "content": "Say hi"},
                   {"role": "assistant", "content": ""}], "continue_final_message": true}"#;
    let rendered = t.render_chat(empty).unwrap();
    assert_eq!(
        chat_ids(&mut c, empty).unwrap(),
        t.encode(&rendered, false).unwrap()
    );
}
