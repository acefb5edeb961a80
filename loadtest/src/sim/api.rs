//! SGLang's request and response shapes, pure: parse a JSON body into token ids and sampling
//! limits, and render result bodies and SSE chunks. The network layer only moves these bytes.
//!
//! Shapes follow the simulator reference §1 (SGLang 0.5.2x): `/generate` (cumulative streaming
//! text, `meta_info`), OpenAI chat and text completions (role chunk, content deltas, finish
//! chunk, optional usage chunk, `[DONE]`), with `usage.prompt_tokens_details.cached_tokens`
//! always reported (as with `--enable-cache-report`).

use std::fmt::Write as _;

use serde_json::{json, Value};

use super::engine::FinishInfo;
use super::tokenizer::{ChatTurn, SimTokenizer};

mod namespace;
mod newer;

pub use namespace::NsFields;

/// Which inference endpoint a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /generate`.
    Generate,
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/responses` (OpenAI Responses).
    Responses,
    /// `POST /v1/messages` (Anthropic Messages).
    Messages,
    /// `POST /inference/v1/generate` (vLLM's token in, token out; `--engine vllm`).
    Tokens,
}

/// What vLLM puts before a token-in/token-out request's id (`request_id`, or the
/// `x-request-id` header) in its answers.
pub const TOKENS_ID_PREFIX: &str = "generate-tokens-";

/// A client error answered with 400 and an OpenAI-style error body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// Human-readable reason.
    pub message: String,
}

impl ApiError {
    fn new(message: impl Into<String>) -> Self {
        ApiError {
            message: message.into(),
        }
    }
}

/// A parsed inference request.
#[derive(Debug, Clone, PartialEq)]
pub struct Inference {
    /// Endpoint it arrived on.
    pub endpoint: Endpoint,
    /// Token ids per prompt; more than one only for batch `/generate` / `/v1/completions`.
    pub prompts: Vec<Vec<u32>>,
    /// Tokens to generate (exactly; EOS is ignored).
    pub max_new_tokens: usize,
    /// SSE response.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// `model` from the request, echoed back (the served name when absent).
    pub model: Option<String>,
    /// `rid` for `/generate`.
    pub rid: Option<String>,
    /// `extra_key`, `cache_salt`, `lora_path`: see [`namespaces`](Self::namespaces).
    pub ns_fields: NsFields,
    /// `priority` (every endpoint's top-level field, as SGLang reads it): the request's class
    /// under `--enable-priority-scheduling`; ignored otherwise.
    pub priority: Option<i64>,
}

impl Inference {
    /// The cache namespace of each prompt (SGLang shares prefixes only within one), given the
    /// served model name (a `model` of `served:adapter` names a LoRA adapter).
    pub fn namespaces(&self, served: &str) -> Result<Vec<crate::sim::radix::Namespace>, ApiError> {
        namespace::resolve(
            self.endpoint,
            &self.ns_fields,
            self.model.as_deref(),
            served,
            self.prompts.len(),
        )
    }
}

impl Inference {
    /// The cache namespace of each prompt as vLLM keys its blocks (`--engine vllm`): the LoRA
    /// adapter a `model` names (one of `loras`; any other `model` is the base model) and
    /// `cache_salt`. SGLang's `extra_key` and `lora_path` mean nothing to vLLM.
    pub fn vllm_namespaces(
        &self,
        loras: &[crate::sim::LoraModule],
    ) -> Vec<crate::sim::radix::Namespace> {
        let lora = self
            .model
            .as_deref()
            .filter(|m| loras.iter().any(|l| l.name == *m));
        let salt = self.ns_fields.cache_salt();
        let ns = crate::sim::radix::Namespace::new(None, lora, salt);
        vec![ns; self.prompts.len()]
    }
}

fn max_tokens_field(v: &Value, names: &[&str], default: usize) -> Result<usize, ApiError> {
    for name in names {
        match v.get(*name) {
            None | Some(Value::Null) => continue,
            Some(x) => {
                return x.as_u64().map(|n| n as usize).ok_or_else(|| {
                    ApiError::new(format!("{name} must be a non-negative integer"))
                });
            }
        }
    }
    Ok(default)
}

fn token_ids(v: &Value) -> Option<Vec<u32>> {
    v.as_array()?
        .iter()
        .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect()
}

fn flatten_content(v: Option<&Value>, buf: &mut String) -> Result<(), ApiError> {
    match v {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(s)) => {
            buf.push_str(s);
            Ok(())
        }
        Some(Value::Array(parts)) => {
            for p in parts {
                if let Some(t) = p.get("text").and_then(Value::as_str) {
                    buf.push_str(t);
                } else if p.get("type").and_then(Value::as_str) != Some("text") {
                    // Images and other parts carry no text for a text-only model.
                    continue;
                }
            }
            Ok(())
        }
        Some(_) => Err(ApiError::new(
            "message content must be a string or an array of parts",
        )),
    }
}

/// Parse an inference body. `default_max` applies when no token limit is given.
pub fn parse_inference(
    endpoint: Endpoint,
    body: &[u8],
    tok: &SimTokenizer,
    default_max: usize,
) -> Result<Inference, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::new(format!("Invalid JSON body: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::new("The request body must be a JSON object"));
    }
    let stream = match v.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::new("stream must be a boolean")),
    };
    let include_usage = v
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let model = v.get("model").and_then(Value::as_str).map(str::to_owned);
    let priority = match v.get("priority") {
        None | Some(Value::Null) => None,
        Some(p) => Some(
            p.as_i64()
                .ok_or_else(|| ApiError::new("priority must be an integer"))?,
        ),
    };
    let mut rid = None;
    let (prompts, max_new_tokens) = match endpoint {
        Endpoint::Generate => {
            let sp = v.get("sampling_params").cloned().unwrap_or(Value::Null);
            let max = max_tokens_field(&sp, &["max_new_tokens"], default_max)?;
            rid = v.get("rid").and_then(Value::as_str).map(str::to_owned);
            (generate_prompts(&v, tok)?, max)
        }
        Endpoint::Chat => {
            let max = max_tokens_field(&v, &["max_completion_tokens", "max_tokens"], default_max)?;
            (vec![chat_prompt(&v, body, tok)?], max)
        }
        Endpoint::Completions => {
            let max = max_tokens_field(&v, &["max_tokens"], default_max)?;
            (completion_prompts(&v, tok)?, max)
        }
        Endpoint::Responses => {
            let max = max_tokens_field(&v, &["max_output_tokens"], default_max)?;
            (vec![conversation_prompt(endpoint, &v, tok)?], max)
        }
        Endpoint::Messages => {
            let max = max_tokens_field(&v, &["max_tokens"], default_max)?;
            (vec![conversation_prompt(endpoint, &v, tok)?], max)
        }
        Endpoint::Tokens => {
            // vLLM's `GenerateRequest`: `token_ids` (at least one) and `sampling_params`
            // (required, with `max_tokens`).
            let sp = v
                .get("sampling_params")
                .filter(|sp| sp.is_object())
                .ok_or_else(|| ApiError::new("sampling_params is required"))?;
            let max = max_tokens_field(sp, &["max_tokens"], default_max)?;
            rid = v
                .get("request_id")
                .and_then(Value::as_str)
                .map(str::to_owned);
            let ids = v
                .get("token_ids")
                .and_then(token_ids)
                .filter(|ids| !ids.is_empty())
                .ok_or_else(|| ApiError::new("token_ids must be a non-empty list of token ids"))?;
            (vec![ids], max)
        }
    };
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        return Err(ApiError::new("The input is empty."));
    }
    if stream && prompts.len() > 1 {
        return Err(ApiError::new(
            "Streaming a batch of prompts is not supported by the simulator.",
        ));
    }
    Ok(Inference {
        endpoint,
        prompts,
        max_new_tokens,
        stream,
        include_usage,
        model,
        rid,
        ns_fields: NsFields::read(&v),
        priority,
    })
}

/// The token ids of one text prompt.
fn encode(tok: &SimTokenizer, text: &str) -> Result<Vec<u32>, ApiError> {
    let mut ids = Vec::new();
    tok.encode_prompt(text, &mut ids).map_err(ApiError::new)?;
    Ok(ids)
}

/// `/generate` prompts: `text` (a string or a list of strings) or `input_ids` (a list of ids or
/// a list of lists), exactly one of the two.
fn generate_prompts(v: &Value, tok: &SimTokenizer) -> Result<Vec<Vec<u32>>, ApiError> {
    match (v.get("text"), v.get("input_ids")) {
        (Some(Value::String(s)), None) => Ok(vec![encode(tok, s)?]),
        (Some(Value::Array(list)), None) => list
            .iter()
            .map(|s| {
                s.as_str()
                    .ok_or_else(|| ApiError::new("text must be a string or a list of strings"))
                    .and_then(|s| encode(tok, s))
            })
            .collect(),
        (None, Some(ids)) => input_id_prompts(ids),
        (Some(_), Some(_)) => Err(ApiError::new(
            "Either text or input_ids should be provided, not both.",
        )),
        (Some(_), None) => Err(ApiError::new("text must be a string or a list of strings")),
        (None, None) => Err(ApiError::new(
            "Either text or input_ids should be provided.",
        )),
    }
}

/// `/generate`'s `input_ids`: one prompt of token ids, or a batch of them.
fn input_id_prompts(ids: &Value) -> Result<Vec<Vec<u32>>, ApiError> {
    if let Some(one) = token_ids(ids) {
        return Ok(vec![one]);
    }
    let Some(list) = ids.as_array() else {
        return Err(ApiError::new("input_ids must be a list of token ids"));
    };
    list.iter()
        .map(|item| {
            token_ids(item).ok_or_else(|| {
                ApiError::new("input_ids must be a list of token ids or a list of lists")
            })
        })
        .collect()
}

/// The chat prompt: `messages` (non-empty, each with a string role) through the chat template
/// (with `--tokenizer-path`: the raw body through the gateway's tokenizer and its template).
fn chat_prompt(v: &Value, body: &[u8], tok: &SimTokenizer) -> Result<Vec<u32>, ApiError> {
    let mut ids = Vec::new();
    if let Some(r) = tok.hf_chat(body, &mut ids) {
        r.map_err(ApiError::new)?;
        return Ok(ids);
    }
    let msgs = v
        .get("messages")
        .and_then(Value::as_array)
        .filter(|m| !m.is_empty())
        .ok_or_else(|| ApiError::new("messages must be a non-empty array"))?;
    let mut contents = Vec::with_capacity(msgs.len());
    for m in msgs {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::new("each message needs a string role"))?;
        let mut text = String::new();
        flatten_content(m.get("content"), &mut text)?;
        contents.push((role, text));
    }
    let turns: Vec<ChatTurn<'_>> = contents
        .iter()
        .map(|(role, c)| ChatTurn { role, content: c })
        .collect();
    tok.encode_chat(&turns, &mut ids);
    Ok(ids)
}

/// A Responses or Messages conversation through the chat template, as its chat equivalent
/// (with `--tokenizer-path`: an equivalent chat body through the HF template).
fn conversation_prompt(
    endpoint: Endpoint,
    v: &Value,
    tok: &SimTokenizer,
) -> Result<Vec<u32>, ApiError> {
    let turns = newer::turns(endpoint, v)?;
    if turns.is_empty() {
        return Err(ApiError::new("The input is empty."));
    }
    let mut ids = Vec::new();
    if tok.is_hf() {
        let msgs: Vec<Value> = turns
            .iter()
            .map(|(role, content)| json!({"role": role, "content": content}))
            .collect();
        let body = json!({ "messages": msgs }).to_string();
        if let Some(r) = tok.hf_chat(body.as_bytes(), &mut ids) {
            r.map_err(ApiError::new)?;
            return Ok(ids);
        }
    }
    let chat: Vec<ChatTurn<'_>> = turns
        .iter()
        .map(|(role, content)| ChatTurn { role, content })
        .collect();
    tok.encode_chat(&chat, &mut ids);
    Ok(ids)
}

/// `/v1/completions` prompts: a string, a list of token ids, or a list mixing strings and lists
/// of token ids (one prompt each).
fn completion_prompts(v: &Value, tok: &SimTokenizer) -> Result<Vec<Vec<u32>>, ApiError> {
    const SHAPE: &str = "prompt must be a string, a list of strings or token ids";
    match v.get("prompt") {
        Some(Value::String(s)) => Ok(vec![encode(tok, s)?]),
        Some(p @ Value::Array(list)) => {
            if let Some(one) = token_ids(p).filter(|ids| !ids.is_empty()) {
                return Ok(vec![one]);
            }
            list.iter()
                .map(|item| match item.as_str() {
                    Some(s) => encode(tok, s),
                    None => token_ids(item).ok_or_else(|| ApiError::new(SHAPE)),
                })
                .collect()
        }
        _ => Err(ApiError::new(SHAPE)),
    }
}

/// One finished (or partial, for streaming) result.
#[derive(Debug, Clone, Copy)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated so far / in total.
    pub completion_tokens: usize,
    /// Cached prompt tokens.
    pub cached_tokens: usize,
}

impl Usage {
    /// From an engine finish record.
    pub fn from_info(i: &FinishInfo) -> Self {
        Usage {
            prompt_tokens: i.prompt_tokens,
            completion_tokens: i.completion_tokens,
            cached_tokens: i.cached_tokens,
        }
    }

    fn json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": { "cached_tokens": self.cached_tokens },
            "reasoning_tokens": 0,
        })
    }
}

/// Everything needed to render one choice of a non-streaming response.
#[derive(Debug, Clone)]
pub struct Completed {
    /// Generated text.
    pub text: String,
    /// Generated ids.
    pub output_ids: Vec<u32>,
    /// Token counts.
    pub usage: Usage,
    /// Arrival to finish, virtual seconds.
    pub e2e_latency: f64,
    /// `length` (normal) or `abort`.
    pub aborted: bool,
}

/// Identity of a response: id, creation time, model.
#[derive(Debug, Clone)]
pub struct RespMeta<'a> {
    /// `chatcmpl-…` / `cmpl-…` / rid.
    pub id: &'a str,
    /// Unix seconds.
    pub created: u64,
    /// Model name echoed.
    pub model: &'a str,
}

fn generate_meta(
    meta: &RespMeta<'_>,
    usage: &Usage,
    finish: Option<(bool, usize)>,
    e2e: f64,
) -> Value {
    let finish_reason = match finish {
        None => Value::Null,
        Some((false, n)) => json!({"type": "length", "length": n}),
        Some((true, _)) => json!({"type": "abort", "message": "client disconnected"}),
    };
    json!({
        "id": meta.id,
        "finish_reason": finish_reason,
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "cached_tokens": usage.cached_tokens,
        "e2e_latency": e2e,
        "weight_version": "default",
    })
}

fn finish_str(aborted: bool) -> &'static str {
    if aborted {
        "abort"
    } else {
        "length"
    }
}

/// Non-streaming body. `metas` has one entry per choice (batch `/generate` gets an array).
pub fn render_completed(endpoint: Endpoint, meta: &RespMeta<'_>, results: &[Completed]) -> Vec<u8> {
    let v = match endpoint {
        Endpoint::Responses | Endpoint::Messages => match results.first() {
            Some(r) => newer::completed(endpoint, meta, r),
            None => Value::Null,
        },
        Endpoint::Generate => {
            let one = |r: &Completed| {
                json!({
                    "text": r.text,
                    "output_ids": r.output_ids,
                    "meta_info": generate_meta(meta, &r.usage, Some((r.aborted, r.usage.completion_tokens)), r.e2e_latency),
                })
            };
            if results.len() == 1 {
                one(&results[0])
            } else {
                Value::Array(results.iter().map(one).collect())
            }
        }
        Endpoint::Tokens => match results.first() {
            Some(r) => tokens_completed(meta, r),
            None => Value::Null,
        },
        Endpoint::Chat | Endpoint::Completions => {
            let mut total = Usage {
                prompt_tokens: 0,
                completion_tokens: 0,
                cached_tokens: 0,
            };
            let choices: Vec<Value> = results
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    total.prompt_tokens += r.usage.prompt_tokens;
                    total.completion_tokens += r.usage.completion_tokens;
                    total.cached_tokens += r.usage.cached_tokens;
                    if endpoint == Endpoint::Chat {
                        json!({
                            "index": i,
                            "message": {"role": "assistant", "content": r.text, "reasoning_content": null, "tool_calls": null},
                            "logprobs": null,
                            "finish_reason": finish_str(r.aborted),
                            "matched_stop": null,
                        })
                    } else {
                        json!({
                            "index": i,
                            "text": r.text,
                            "logprobs": null,
                            "finish_reason": finish_str(r.aborted),
                            "matched_stop": null,
                        })
                    }
                })
                .collect();
            let object = if endpoint == Endpoint::Chat {
                "chat.completion"
            } else {
                "text_completion"
            };
            json!({
                "id": meta.id,
                "object": object,
                "created": meta.created,
                "model": meta.model,
                "choices": choices,
                "usage": total.json(),
            })
        }
    };
    // Serialising a `Value` built from strings and numbers cannot fail.
    serde_json::to_vec(&v).unwrap_or_default()
}

/// The usage block of a token-in/token-out answer (vLLM's `UsageInfo`, cached tokens reported
/// as with `--enable-prompt-tokens-details`).
fn tokens_usage(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "completion_tokens": u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// One choice of a token-in/token-out answer: `token_ids` and the finish reason, the other
/// fields of vLLM's `GenerateTokensChoice` null.
fn tokens_choice(ids: &[u32], finish: Option<bool>) -> Value {
    json!({
        "index": 0, "finish_reason": finish.map(finish_str), "stop_reason": null,
        "token_ids": ids, "routed_experts": null, "sampling_mask": null,
        "weight_versions": null, "logprobs": null,
    })
}

/// vLLM's non-streaming `GenerateTokensResponse`.
fn tokens_completed(meta: &RespMeta<'_>, r: &Completed) -> Value {
    json!({
        "request_id": meta.id, "model": meta.model, "created": meta.created,
        "usage": tokens_usage(&r.usage), "prompt_logprobs": null,
        "prompt_token_id_logprobs": null, "prompt_token_ids": null, "mm_placeholders": null,
        "metrics": null, "kv_transfer_params": null, "ec_transfer_params": null,
        "output_mode": "tokens", "choices": [tokens_choice(&r.output_ids, Some(r.aborted))],
    })
}

/// One streamed `GenerateTokensStreamResponse` event.
fn tokens_event(out: &mut String, id: &str, choices: Value, usage: Option<&Usage>) {
    let mut v = json!({"request_id": id, "output_mode": "tokens", "choices": choices});
    if let Some(u) = usage {
        v["usage"] = tokens_usage(u);
    } else {
        v["usage"] = Value::Null;
    }
    out.push_str("data: ");
    out.push_str(&v.to_string());
    out.push_str("\n\n");
}

fn push_json_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// One generated token as the stream renderer needs it.
#[derive(Debug, Clone, Copy)]
pub struct TokenChunk<'a> {
    /// Generated id.
    pub token: u32,
    /// Its text.
    pub piece: &'a str,
    /// First token of the response (chat sends the role chunk before it).
    pub first: bool,
    /// Running counts.
    pub usage: Usage,
    /// Arrival to this token, virtual seconds.
    pub e2e: f64,
    /// Set on the last token: `Some(aborted)` (`/generate` carries the finish in this chunk).
    pub finish: Option<bool>,
}

/// A stream's events when SGLang 0.5.23 refuses its request with 503 after the stream began:
/// `/generate` streams the abort output (`tokenizer_manager._handle_abort_finish_reason`
/// returns it for streams, `http_server.serve_generate_request` writes it), the OpenAI APIs an
/// error chunk (`serving_base.create_streaming_error_response`, type the status' name); then
/// `[DONE]`.
pub fn refusal_event(endpoint: Endpoint, id: &str, message: &str) -> String {
    let event = match endpoint {
        Endpoint::Generate => json!({
            "text": "", "output_ids": [],
            "meta_info": {
                "id": id,
                "finish_reason": {"type": "abort", "status_code": 503, "message": message},
            },
        }),
        _ => json!({"error": {
            "object": "error", "message": message, "type": "SERVICE_UNAVAILABLE", "param": null,
            "code": 503,
        }}),
    };
    format!("data: {event}\n\ndata: [DONE]\n\n")
}

/// Renders SSE events of one streaming response into `data: …\n\n` strings. Kept per stream so
/// `/generate`'s cumulative text is built incrementally.
#[derive(Debug)]
pub struct StreamRenderer {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    text: String,
    ids: Vec<u32>,
    events: newer::Events,
    /// PD `/generate` with `return_logprob`: every event's `meta_info.input_token_logprobs`.
    input_logprobs: Option<serde_json::Value>,
}

impl StreamRenderer {
    /// Every `/generate` event carries these `meta_info.input_token_logprobs` (SGLang repeats
    /// the prompt's whole list in each event of a stream that asked for logprobs).
    pub fn with_input_logprobs(mut self, list: serde_json::Value) -> Self {
        self.input_logprobs = Some(list);
        self
    }

    /// A renderer for one stream.
    pub fn new(
        endpoint: Endpoint,
        id: String,
        created: u64,
        model: String,
        include_usage: bool,
    ) -> Self {
        StreamRenderer {
            endpoint,
            id,
            created,
            model,
            include_usage,
            text: String::new(),
            ids: Vec::new(),
            events: newer::Events::default(),
            input_logprobs: None,
        }
    }

    fn chunk_prefix(&self, out: &mut String, object: &str) {
        out.push_str("data: {\"id\":");
        push_json_str(out, &self.id);
        let _ = write!(
            out,
            ",\"object\":\"{object}\",\"created\":{},\"model\":",
            self.created
        );
        push_json_str(out, &self.model);
    }

    /// One `/generate` stream event: the cumulative text and ids so far, with `meta_info`
    /// (`finish`: `Some(aborted)` on the last event).
    fn generate_event(&self, out: &mut String, usage: &Usage, finish: Option<bool>, e2e: f64) {
        let meta = RespMeta {
            id: &self.id,
            created: self.created,
            model: &self.model,
        };
        let finish = finish.map(|a| (a, usage.completion_tokens));
        let mut v = json!({
            "text": self.text,
            "output_ids": self.ids,
            "meta_info": generate_meta(&meta, usage, finish, e2e),
        });
        if let (Some(lp), Some(m)) = (&self.input_logprobs, v["meta_info"].as_object_mut()) {
            m.insert("input_token_logprobs".into(), lp.clone());
        }
        out.push_str("data: ");
        out.push_str(&v.to_string());
        out.push_str("\n\n");
    }

    /// Events for one generated token (see [`TokenChunk`]).
    pub fn token(&mut self, out: &mut String, t: &TokenChunk<'_>) {
        let TokenChunk {
            token,
            piece,
            first,
            ref usage,
            e2e,
            finish,
        } = *t;
        match self.endpoint {
            Endpoint::Generate => {
                self.text.push_str(piece);
                self.ids.push(token);
                self.generate_event(out, usage, finish, e2e);
            }
            Endpoint::Chat => {
                if first {
                    self.chunk_prefix(out, "chat.completion.chunk");
                    out.push_str(",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n");
                }
                self.chunk_prefix(out, "chat.completion.chunk");
                out.push_str(",\"choices\":[{\"index\":0,\"delta\":{\"content\":");
                push_json_str(out, piece);
                out.push_str("},\"logprobs\":null,\"finish_reason\":null}]}\n\n");
            }
            Endpoint::Completions => {
                self.chunk_prefix(out, "text_completion");
                out.push_str(",\"choices\":[{\"index\":0,\"text\":");
                push_json_str(out, piece);
                out.push_str(",\"logprobs\":null,\"finish_reason\":null}]}\n\n");
            }
            Endpoint::Tokens => {
                // vLLM sends the finish reason in the event of the last token.
                let choice = tokens_choice(&[token], finish);
                tokens_event(out, &self.id, Value::Array(vec![choice]), None);
            }
            Endpoint::Responses | Endpoint::Messages => {
                if first {
                    let meta = RespMeta {
                        id: &self.id,
                        created: self.created,
                        model: &self.model,
                    };
                    self.events.start(self.endpoint, out, &meta, usage);
                }
                self.text.push_str(piece);
                self.events.delta(self.endpoint, out, &self.id, piece);
            }
        }
    }

    /// The stream's one event when the engine refused the request with 503 (`message`: SGLang's
    /// `--max-queued-requests` refusals): see [`refusal_event`].
    pub fn refused(&self, out: &mut String, message: &str) {
        out.push_str(&refusal_event(self.endpoint, &self.id, message));
    }

    /// Closing events: OpenAI finish chunk and optional usage chunk, then `data: [DONE]`.
    /// For `/generate` a request finishing without a token (`max_new_tokens` 0, abort) still
    /// gets one chunk with its `finish_reason`.
    pub fn finish(
        &mut self,
        out: &mut String,
        usage: &Usage,
        e2e: f64,
        aborted: bool,
        sent_tokens: usize,
    ) {
        if let Endpoint::Responses | Endpoint::Messages = self.endpoint {
            let meta = RespMeta {
                id: &self.id,
                created: self.created,
                model: &self.model,
            };
            if sent_tokens == 0 {
                self.events.start(self.endpoint, out, &meta, usage);
            }
            // These APIs end with their own events: no `[DONE]`.
            self.events
                .finish(self.endpoint, out, &meta, &self.text, usage, aborted);
            return;
        }
        match self.endpoint {
            Endpoint::Generate => {
                if sent_tokens == 0 {
                    self.generate_event(out, usage, Some(aborted), e2e);
                }
            }
            Endpoint::Tokens => {
                // A request that ends without a token (abort) still reports its finish.
                if sent_tokens == 0 {
                    let choice = tokens_choice(&[], Some(aborted));
                    tokens_event(out, &self.id, Value::Array(vec![choice]), None);
                }
                if self.include_usage {
                    tokens_event(out, &self.id, Value::Array(Vec::new()), Some(usage));
                }
            }
            _ => {
                let (object, body) = if self.endpoint == Endpoint::Chat {
                    ("chat.completion.chunk", "\"delta\":{}")
                } else {
                    ("text_completion", "\"text\":\"\"")
                };
                self.chunk_prefix(out, object);
                let _ = write!(
                    out,
                    ",\"choices\":[{{\"index\":0,{body},\"logprobs\":null,\"finish_reason\":\"{}\",\"matched_stop\":null}}]}}\n\n",
                    finish_str(aborted)
                );
                if self.include_usage {
                    self.chunk_prefix(out, object);
                    out.push_str(",\"choices\":[],\"usage\":");
                    out.push_str(&usage.json().to_string());
                    out.push_str("}\n\n");
                }
            }
        }
        out.push_str("data: [DONE]\n\n");
    }
}

#[cfg(test)]
mod tests;
