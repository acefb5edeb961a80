use super::*;
use crate::sim::tokenizer::TokenizerMode;

fn tok() -> SimTokenizer {
    SimTokenizer::new(TokenizerMode::Approx)
}

#[test]
fn parses_each_endpoint() {
    let t = tok();
    let g = parse_inference(
        Endpoint::Generate,
        br#"{"text":"hi there","sampling_params":{"max_new_tokens":7},"stream":true}"#,
        &t,
        128,
    )
    .unwrap();
    assert_eq!((g.max_new_tokens, g.stream, g.prompts.len()), (7, true, 1));
    assert_eq!(g.prompts[0][0], crate::sim::tokenizer::BOS);
    let g = parse_inference(Endpoint::Generate, br#"{"input_ids":[1,2,3]}"#, &t, 128).unwrap();
    assert_eq!(
        (g.prompts[0].clone(), g.max_new_tokens),
        (vec![1, 2, 3], 128)
    );
    let g = parse_inference(Endpoint::Generate, br#"{"input_ids":[[1],[2,3]]}"#, &t, 128).unwrap();
    assert_eq!(g.prompts, vec![vec![1], vec![2, 3]]);
    let c = parse_inference(
        Endpoint::Chat,
        br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"max_tokens":3,"max_completion_tokens":5,"stream":true,"stream_options":{"include_usage":true}}"#,
        &t,
        128,
    )
    .unwrap();
    assert_eq!(
        (c.max_new_tokens, c.include_usage, c.model.as_deref()),
        (5, true, Some("m"))
    );
    let p = parse_inference(
        Endpoint::Completions,
        br#"{"prompt":"abc","max_tokens":2}"#,
        &t,
        128,
    )
    .unwrap();
    assert_eq!(p.max_new_tokens, 2);
    let p = parse_inference(Endpoint::Completions, br#"{"prompt":["a","b"]}"#, &t, 128).unwrap();
    assert_eq!(p.prompts.len(), 2);
}

#[test]
fn rejects_bad_input() {
    let t = tok();
    for (ep, body) in [
        (Endpoint::Chat, &b"{not json"[..]),
        (Endpoint::Chat, br#"{"messages":[]}"#),
        (Endpoint::Chat, br#"{"messages":[{"content":"x"}]}"#),
        (
            Endpoint::Chat,
            br#"{"messages":[{"role":"user","content":"x"}],"max_tokens":-1}"#,
        ),
        (Endpoint::Generate, br#"{}"#),
        (Endpoint::Generate, br#"{"input_ids":[]}"#),
        (Endpoint::Generate, br#"{"text":"a","input_ids":[1]}"#),
        (Endpoint::Completions, br#"{"prompt":5}"#),
        (
            Endpoint::Completions,
            br#"{"prompt":["a","b"],"stream":true}"#,
        ),
        (Endpoint::Generate, br#"[1]"#),
    ] {
        assert!(
            parse_inference(ep, body, &t, 128).is_err(),
            "{}",
            String::from_utf8_lossy(body)
        );
    }
}

#[test]
fn chat_stream_shape() {
    let mut r = StreamRenderer::new(Endpoint::Chat, "chatcmpl-1".into(), 5, "m".into(), true);
    let mut out = String::new();
    let u = Usage {
        prompt_tokens: 10,
        completion_tokens: 1,
        cached_tokens: 4,
    };
    r.token(
        &mut out,
        &TokenChunk {
            token: 1,
            piece: " the",
            first: true,
            usage: u,
            e2e: 0.0,
            finish: None,
        },
    );
    r.token(
        &mut out,
        &TokenChunk {
            token: 2,
            piece: " \"q\"",
            first: false,
            usage: u,
            e2e: 0.0,
            finish: Some(false),
        },
    );
    r.finish(&mut out, &u, 0.1, false, 2);
    let events: Vec<&str> = out.split("\n\n").filter(|s| !s.is_empty()).collect();
    assert_eq!(events.len(), 6);
    let parsed: Vec<Value> = events[..5]
        .iter()
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
        .collect();
    assert_eq!(parsed[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(parsed[1]["choices"][0]["delta"]["content"], " the");
    assert_eq!(parsed[2]["choices"][0]["delta"]["content"], " \"q\"");
    assert_eq!(parsed[3]["choices"][0]["finish_reason"], "length");
    assert_eq!(parsed[4]["choices"].as_array().unwrap().len(), 0);
    assert_eq!(
        parsed[4]["usage"]["prompt_tokens_details"]["cached_tokens"],
        4
    );
    assert_eq!(events[5], "data: [DONE]");
}

#[test]
fn generate_stream_is_cumulative() {
    let mut r = StreamRenderer::new(Endpoint::Generate, "rid".into(), 5, "m".into(), false);
    let mut out = String::new();
    let u = Usage {
        prompt_tokens: 3,
        completion_tokens: 1,
        cached_tokens: 0,
    };
    r.token(
        &mut out,
        &TokenChunk {
            token: 1,
            piece: " a",
            first: true,
            usage: u,
            e2e: 0.0,
            finish: None,
        },
    );
    let u2 = Usage {
        completion_tokens: 2,
        ..u
    };
    r.token(
        &mut out,
        &TokenChunk {
            token: 2,
            piece: " b",
            first: false,
            usage: u2,
            e2e: 0.2,
            finish: Some(false),
        },
    );
    r.finish(&mut out, &u2, 0.2, false, 2);
    let events: Vec<&str> = out.split("\n\n").filter(|s| !s.is_empty()).collect();
    assert_eq!(events.len(), 3);
    let last: Value = serde_json::from_str(events[1].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(last["text"], " a b");
    assert_eq!(last["meta_info"]["finish_reason"]["type"], "length");
    assert_eq!(last["meta_info"]["completion_tokens"], 2);
    assert_eq!(events[2], "data: [DONE]");
}

#[test]
fn completed_bodies() {
    let meta = RespMeta {
        id: "cmpl-1",
        created: 1,
        model: "m",
    };
    let c = Completed {
        text: " x".into(),
        output_ids: vec![9],
        usage: Usage {
            prompt_tokens: 5,
            completion_tokens: 1,
            cached_tokens: 2,
        },
        e2e_latency: 0.5,
        aborted: false,
    };
    let v: Value = serde_json::from_slice(&render_completed(
        Endpoint::Chat,
        &meta,
        std::slice::from_ref(&c),
    ))
    .unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["content"], " x");
    assert_eq!(v["usage"]["total_tokens"], 6);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
    let v: Value = serde_json::from_slice(&render_completed(
        Endpoint::Generate,
        &meta,
        std::slice::from_ref(&c),
    ))
    .unwrap();
    assert_eq!(v["meta_info"]["finish_reason"]["length"], 1);
    assert_eq!(v["meta_info"]["cached_tokens"], 2);
    let v: Value = serde_json::from_slice(&render_completed(
        Endpoint::Completions,
        &meta,
        &[c.clone(), c],
    ))
    .unwrap();
    assert_eq!(v["choices"][1]["index"], 1);
    assert_eq!(v["usage"]["prompt_tokens"], 10);
}

#[test]
fn responses_and_messages_prompts_extend_turn_by_turn() {
    let t = tok();
    let parse =
        |ep, v: serde_json::Value| parse_inference(ep, v.to_string().as_bytes(), &t, 9).unwrap();
    let r1 = parse(
        Endpoint::Responses,
        json!({"model": "m", "instructions": "Be terse.", "input": "Hello there", "max_output_tokens": 4, "stream": true}),
    );
    assert_eq!((r1.max_new_tokens, r1.stream), (4, true));
    let r2 = parse(
        Endpoint::Responses,
        json!({"model": "m", "instructions": "Be terse.", "input": [
            {"role": "user", "content": "Hello there"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi"}]},
            {"role": "user", "content": [{"type": "input_text", "text": "More"}]}
        ]}),
    );
    assert_eq!(r2.max_new_tokens, 9);
    let gen_prompt = 5; // the assistant header that ends turn 1's prompt
    let p1 = &r1.prompts[0];
    assert!(r2.prompts[0].starts_with(&p1[..p1.len() - gen_prompt]));
    let m1 = parse(
        Endpoint::Messages,
        json!({"model": "c", "max_tokens": 3, "system": [{"type": "text", "text": "Be terse."}],
               "messages": [{"role": "user", "content": "Hello there"}]}),
    );
    // The same conversation in either API is the same prompt.
    assert_eq!(m1.prompts, r1.prompts);
    assert_eq!(m1.max_new_tokens, 3);
    let m2 = parse(
        Endpoint::Messages,
        json!({"model": "c", "max_tokens": 3, "system": "Be terse.", "messages": [
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "More"}]}
        ]}),
    );
    assert!(m2.prompts[0].starts_with(&p1[..p1.len() - gen_prompt]));
    assert!(parse_inference(Endpoint::Messages, br#"{"max_tokens":1}"#, &t, 9).is_err());
    assert!(parse_inference(Endpoint::Responses, br#"{"input":7}"#, &t, 9).is_err());
    assert!(parse_inference(Endpoint::Responses, br#"{"model":"m"}"#, &t, 9).is_err());
}

#[test]
fn responses_and_messages_render_their_shapes() {
    let usage = Usage {
        prompt_tokens: 10,
        completion_tokens: 2,
        cached_tokens: 4,
    };
    let done = Completed {
        text: "Hi you".into(),
        output_ids: vec![1, 2],
        usage,
        e2e_latency: 0.1,
        aborted: false,
    };
    let meta = RespMeta {
        id: "resp_1",
        created: 5,
        model: "m",
    };
    let v: serde_json::Value = serde_json::from_slice(&render_completed(
        Endpoint::Responses,
        &meta,
        std::slice::from_ref(&done),
    ))
    .unwrap();
    assert_eq!(v["object"], "response");
    assert_eq!(v["status"], "completed");
    assert_eq!(v["output"][0]["content"][0]["type"], "output_text");
    assert_eq!(v["output"][0]["content"][0]["text"], "Hi you");
    assert_eq!(v["usage"]["input_tokens_details"]["cached_tokens"], 4);
    let v: serde_json::Value =
        serde_json::from_slice(&render_completed(Endpoint::Messages, &meta, &[done])).unwrap();
    assert_eq!(v["type"], "message");
    assert_eq!(v["content"][0]["text"], "Hi you");
    assert_eq!(v["usage"]["cache_read_input_tokens"], 4);
    assert_eq!(v["usage"]["input_tokens"], 6);

    let names = |ep| {
        let mut r = StreamRenderer::new(ep, "resp_1".into(), 5, "m".into(), false);
        let mut out = String::new();
        for (i, piece) in ["Hi", " you"].into_iter().enumerate() {
            r.token(
                &mut out,
                &TokenChunk {
                    token: 1,
                    piece,
                    first: i == 0,
                    usage,
                    e2e: 0.0,
                    finish: None,
                },
            );
        }
        r.finish(&mut out, &usage, 0.1, false, 2);
        assert!(!out.contains("[DONE]"));
        let mut names = Vec::new();
        let mut text = String::new();
        for ev in out.split("\n\n").filter(|e| !e.is_empty()) {
            let (name, data) = ev.split_once('\n').unwrap();
            let name = name.strip_prefix("event: ").unwrap();
            let data: serde_json::Value =
                serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(data["type"], name);
            if let Some(d) = data["delta"].as_str().or(data["delta"]["text"].as_str()) {
                text.push_str(d);
            }
            names.push(name.to_string());
        }
        assert_eq!(text, "Hi you");
        names
    };
    let r = names(Endpoint::Responses);
    assert_eq!(r.first().map(String::as_str), Some("response.created"));
    assert_eq!(r.last().map(String::as_str), Some("response.completed"));
    assert_eq!(
        r.iter()
            .filter(|n| *n == "response.output_text.delta")
            .count(),
        2
    );
    let m = names(Endpoint::Messages);
    assert_eq!(
        m,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
}

#[test]
fn priority_is_read_from_every_endpoint_and_must_be_an_integer() {
    let t = tok();
    let bodies = [
        (Endpoint::Generate, r#"{"text":"hi","priority":10}"#),
        (
            Endpoint::Chat,
            r#"{"messages":[{"role":"user","content":"hi"}],"priority":10}"#,
        ),
        (Endpoint::Completions, r#"{"prompt":"hi","priority":10}"#),
    ];
    for (ep, body) in bodies {
        let r = parse_inference(ep, body.as_bytes(), &t, 8).unwrap();
        assert_eq!(r.priority, Some(10), "{body}");
    }
    let none = parse_inference(Endpoint::Completions, br#"{"prompt":"hi"}"#, &t, 8).unwrap();
    assert_eq!(none.priority, None);
    let null = parse_inference(
        Endpoint::Completions,
        br#"{"prompt":"hi","priority":null}"#,
        &t,
        8,
    )
    .unwrap();
    assert_eq!(null.priority, None);
    let neg = parse_inference(
        Endpoint::Completions,
        br#"{"prompt":"hi","priority":-3}"#,
        &t,
        8,
    )
    .unwrap();
    assert_eq!(neg.priority, Some(-3));
    for bad in [r#""high""#, "1.5"] {
        let body = format!(r#"{{"prompt":"hi","priority":{bad}}}"#);
        let e = parse_inference(Endpoint::Completions, body.as_bytes(), &t, 8).unwrap_err();
        assert!(e.message.contains("priority"), "{}", e.message);
    }
}

#[test]
fn vllm_token_in_token_out_requests() {
    let t = SimTokenizer::new(TokenizerMode::Approx);
    let g = parse_inference(
        Endpoint::Tokens,
        br#"{"token_ids":[1,2,3],"sampling_params":{"max_tokens":4},"request_id":"r1","cache_salt":"s","stream":true}"#,
        &t,
        128,
    )
    .unwrap();
    assert_eq!(g.prompts, vec![vec![1, 2, 3]]);
    assert_eq!((g.max_new_tokens, g.stream), (4, true));
    assert_eq!(g.rid.as_deref(), Some("r1"));
    let loras = [crate::sim::LoraModule::parse("ad=/p").unwrap()];
    let salted = crate::sim::radix::Namespace::new(None, None, Some("s"));
    assert_eq!(g.vllm_namespaces(&loras), vec![salted]);
    let with_model = parse_inference(
        Endpoint::Tokens,
        br#"{"token_ids":[1],"sampling_params":{},"model":"ad"}"#,
        &t,
        7,
    )
    .unwrap();
    assert_eq!(
        with_model.max_new_tokens, 7,
        "the default when max_tokens is absent"
    );
    let adapter = crate::sim::radix::Namespace::new(None, Some("ad"), None);
    assert_eq!(with_model.vllm_namespaces(&loras), vec![adapter]);
    // An unknown model is the base model (the simulator does not validate served names).
    let other = parse_inference(
        Endpoint::Tokens,
        br#"{"token_ids":[1],"sampling_params":{},"model":"m"}"#,
        &t,
        7,
    )
    .unwrap();
    assert!(other.vllm_namespaces(&loras)[0].is_default());
    for bad in [
        &br#"{"token_ids":[],"sampling_params":{}}"#[..],
        br#"{"token_ids":[1]}"#,
        br#"{"token_ids":[-1],"sampling_params":{}}"#,
        br#"{"prompt":"x","sampling_params":{}}"#,
    ] {
        assert!(
            parse_inference(Endpoint::Tokens, bad, &t, 1).is_err(),
            "{}",
            String::from_utf8_lossy(bad)
        );
    }
}

#[test]
fn vllm_token_answers() {
    let meta = RespMeta {
        id: "generate-tokens-r1",
        created: 5,
        model: "m",
    };
    let done = Completed {
        text: String::new(),
        output_ids: vec![7, 8],
        usage: Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
            cached_tokens: 1,
        },
        e2e_latency: 0.1,
        aborted: false,
    };
    let v: Value =
        serde_json::from_slice(&render_completed(Endpoint::Tokens, &meta, &[done])).unwrap();
    assert_eq!(v["request_id"], "generate-tokens-r1");
    assert_eq!(v["output_mode"], "tokens");
    assert_eq!(v["choices"][0]["token_ids"], serde_json::json!([7, 8]));
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["total_tokens"], 5);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
    let mut r = StreamRenderer::new(
        Endpoint::Tokens,
        "generate-tokens-r1".into(),
        5,
        "m".into(),
        true,
    );
    let mut out = String::new();
    let usage = Usage {
        prompt_tokens: 3,
        completion_tokens: 1,
        cached_tokens: 0,
    };
    r.token(
        &mut out,
        &TokenChunk {
            token: 7,
            piece: "x",
            first: true,
            usage,
            e2e: 0.0,
            finish: Some(false),
        },
    );
    r.finish(&mut out, &usage, 0.0, false, 1);
    let events: Vec<&str> = out
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect();
    assert_eq!(events.len(), 3, "{out}");
    let first: Value = serde_json::from_str(events[0]).unwrap();
    assert_eq!(first["choices"][0]["token_ids"], serde_json::json!([7]));
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    assert!(first["usage"].is_null());
    let last: Value = serde_json::from_str(events[1]).unwrap();
    assert_eq!(last["choices"], serde_json::json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 1);
    assert_eq!(events[2], "[DONE]");
}
