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
