//! OpenAI Responses (`/v1/responses`) and Anthropic Messages (`/v1/messages`) on the
//! simulator: their conversations become chat turns (so the prompt the radix cache sees for
//! turn 2 extends turn 1's, exactly as for chat), and results render in each API's own shapes,
//! enough for the official SDKs: Responses objects and `response.*` stream events; Messages
//! objects and `message_start` … `message_stop` stream events.

use std::fmt::Write as _;

use serde_json::{json, Value};

use super::{ApiError, Completed, Endpoint, RespMeta, Usage};

/// A conversation's turns as (role, text): Responses `instructions` then `input` items;
/// Messages `system` then `messages`.
pub(super) fn turns(endpoint: Endpoint, v: &Value) -> Result<Vec<(String, String)>, ApiError> {
    let mut out = Vec::new();
    match endpoint {
        Endpoint::Responses => {
            if let Some(i) = v.get("instructions").and_then(Value::as_str) {
                out.push(("system".to_string(), i.to_string()));
            }
            match v.get("input") {
                Some(Value::String(s)) => out.push(("user".to_string(), s.clone())),
                Some(Value::Array(items)) => {
                    for item in items {
                        let kind = item.get("type").and_then(Value::as_str);
                        if let Some(role) = item.get("role").and_then(Value::as_str) {
                            out.push((role.to_string(), text_of(item.get("content"))));
                        } else if kind == Some("function_call_output") {
                            out.push(("tool".to_string(), text_of(item.get("output"))));
                        }
                    }
                }
                None | Some(Value::Null) => {}
                Some(_) => return Err(ApiError::new("input must be a string or a list of items")),
            }
        }
        _ => {
            match v.get("system") {
                None | Some(Value::Null) => {}
                Some(s) => out.push(("system".to_string(), text_of(Some(s)))),
            }
            let msgs = v
                .get("messages")
                .and_then(Value::as_array)
                .ok_or_else(|| ApiError::new("messages: Field required"))?;
            for m in msgs {
                let role = m
                    .get("role")
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError::new("each message needs a string role"))?;
                out.push((role.to_string(), text_of(m.get("content"))));
            }
        }
    }
    Ok(out)
}

/// The text of a content value: a string, or the `text` of its parts and blocks (and the text
/// of `tool_result` contents), concatenated.
fn text_of(v: Option<&Value>) -> String {
    let mut buf = String::new();
    push_text(v, &mut buf);
    buf
}

fn push_text(v: Option<&Value>, buf: &mut String) {
    match v {
        Some(Value::String(s)) => buf.push_str(s),
        Some(Value::Array(parts)) => {
            for p in parts {
                if let Some(t) = p.get("text").and_then(Value::as_str) {
                    buf.push_str(t);
                } else if p.get("type").and_then(Value::as_str) == Some("tool_result") {
                    push_text(p.get("content"), buf);
                }
            }
        }
        _ => {}
    }
}

/// The id of the single output item / message of a response.
fn item_id(id: &str) -> String {
    format!("msg_{}", id.trim_start_matches("resp_"))
}

fn responses_usage(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// Anthropic counts cache reads apart from `input_tokens`.
fn messages_usage(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens.saturating_sub(u.cached_tokens),
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": u.completion_tokens,
    })
}

/// A Responses object: `status` is `in_progress` while streaming, else finished.
fn response_object(
    meta: &RespMeta<'_>,
    text: Option<&str>,
    usage: Option<&Usage>,
    aborted: bool,
) -> Value {
    let status = match (text, aborted) {
        (None, _) => "in_progress",
        (Some(_), false) => "completed",
        (Some(_), true) => "incomplete",
    };
    let output = match text {
        None => json!([]),
        Some(t) => json!([{
            "type": "message", "id": item_id(meta.id), "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": t, "annotations": []}],
        }]),
    };
    json!({
        "id": meta.id, "object": "response", "created_at": meta.created, "status": status,
        "model": meta.model, "output": output, "error": null,
        "incomplete_details": if aborted { json!({"reason": "cancelled"}) } else { Value::Null },
        "instructions": null, "metadata": {}, "parallel_tool_calls": true, "temperature": 1.0,
        "top_p": 1.0, "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}},
        "usage": usage.map_or(Value::Null, responses_usage),
    })
}

/// A Messages object (`stop_reason` null while streaming).
fn message_object(meta: &RespMeta<'_>, text: Option<&str>, usage: &Usage, aborted: bool) -> Value {
    let content = match text {
        None => json!([]),
        Some(t) => json!([{"type": "text", "text": t}]),
    };
    let stop = match (text, aborted) {
        (None, _) => Value::Null,
        (Some(_), false) => json!("max_tokens"),
        (Some(_), true) => json!("refusal"),
    };
    json!({
        "id": meta.id, "type": "message", "role": "assistant", "model": meta.model,
        "content": content, "stop_reason": stop, "stop_sequence": null,
        "usage": messages_usage(usage),
    })
}

/// The non-streaming body of one result.
pub(super) fn completed(endpoint: Endpoint, meta: &RespMeta<'_>, r: &Completed) -> Value {
    match endpoint {
        Endpoint::Responses => response_object(meta, Some(&r.text), Some(&r.usage), r.aborted),
        _ => message_object(meta, Some(&r.text), &r.usage, r.aborted),
    }
}

/// Writes one named SSE event.
fn event(out: &mut String, name: &str, data: &Value) {
    let _ = write!(out, "event: {name}\ndata: {data}\n\n");
}

/// The stream state the events need beyond the renderer's: Responses' sequence numbers.
#[derive(Debug, Default)]
pub(super) struct Events {
    seq: u64,
}

impl Events {
    fn next(&mut self) -> u64 {
        self.seq += 1;
        self.seq - 1
    }

    /// Opening events, before the first delta.
    pub(super) fn start(
        &mut self,
        endpoint: Endpoint,
        out: &mut String,
        meta: &RespMeta<'_>,
        usage: &Usage,
    ) {
        let item = item_id(meta.id);
        match endpoint {
            Endpoint::Responses => {
                let r = response_object(meta, None, None, false);
                let s = self.next();
                event(
                    out,
                    "response.created",
                    &json!({"type": "response.created", "sequence_number": s, "response": r}),
                );
                let s = self.next();
                event(
                    out,
                    "response.in_progress",
                    &json!({"type": "response.in_progress", "sequence_number": s, "response": r}),
                );
                let s = self.next();
                event(
                    out,
                    "response.output_item.added",
                    &json!({
                        "type": "response.output_item.added", "sequence_number": s, "output_index": 0,
                        "item": {"type": "message", "id": item, "status": "in_progress", "role": "assistant", "content": []},
                    }),
                );
                let s = self.next();
                event(
                    out,
                    "response.content_part.added",
                    &json!({
                        "type": "response.content_part.added", "sequence_number": s, "item_id": item,
                        "output_index": 0, "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": []},
                    }),
                );
            }
            _ => {
                let m = message_object(meta, None, usage, false);
                event(
                    out,
                    "message_start",
                    &json!({"type": "message_start", "message": m}),
                );
                event(
                    out,
                    "content_block_start",
                    &json!({
                        "type": "content_block_start", "index": 0,
                        "content_block": {"type": "text", "text": ""},
                    }),
                );
            }
        }
    }

    /// One text delta.
    pub(super) fn delta(&mut self, endpoint: Endpoint, out: &mut String, id: &str, piece: &str) {
        match endpoint {
            Endpoint::Responses => {
                let s = self.next();
                event(
                    out,
                    "response.output_text.delta",
                    &json!({
                        "type": "response.output_text.delta", "sequence_number": s,
                        "item_id": item_id(id), "output_index": 0, "content_index": 0,
                        "delta": piece, "logprobs": [],
                    }),
                );
            }
            _ => event(
                out,
                "content_block_delta",
                &json!({
                    "type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": piece},
                }),
            ),
        }
    }

    /// Closing events, with the whole text and the final usage.
    pub(super) fn finish(
        &mut self,
        endpoint: Endpoint,
        out: &mut String,
        meta: &RespMeta<'_>,
        text: &str,
        usage: &Usage,
        aborted: bool,
    ) {
        let item = item_id(meta.id);
        match endpoint {
            Endpoint::Responses => {
                let part = json!({"type": "output_text", "text": text, "annotations": []});
                let s = self.next();
                event(
                    out,
                    "response.output_text.done",
                    &json!({
                        "type": "response.output_text.done", "sequence_number": s, "item_id": item,
                        "output_index": 0, "content_index": 0, "text": text, "logprobs": [],
                    }),
                );
                let s = self.next();
                event(
                    out,
                    "response.content_part.done",
                    &json!({
                        "type": "response.content_part.done", "sequence_number": s, "item_id": item,
                        "output_index": 0, "content_index": 0, "part": part,
                    }),
                );
                let s = self.next();
                event(
                    out,
                    "response.output_item.done",
                    &json!({
                        "type": "response.output_item.done", "sequence_number": s, "output_index": 0,
                        "item": {"type": "message", "id": item, "status": "completed", "role": "assistant", "content": [part]},
                    }),
                );
                let r = response_object(meta, Some(text), Some(usage), aborted);
                let (name, s) = if aborted {
                    ("response.incomplete", self.next())
                } else {
                    ("response.completed", self.next())
                };
                event(
                    out,
                    name,
                    &json!({"type": name, "sequence_number": s, "response": r}),
                );
            }
            _ => {
                event(
                    out,
                    "content_block_stop",
                    &json!({"type": "content_block_stop", "index": 0}),
                );
                let stop = if aborted { "refusal" } else { "max_tokens" };
                event(
                    out,
                    "message_delta",
                    &json!({
                        "type": "message_delta",
                        "delta": {"stop_reason": stop, "stop_sequence": null},
                        "usage": messages_usage(usage),
                    }),
                );
                event(out, "message_stop", &json!({"type": "message_stop"}));
            }
        }
    }
}
