//! A `/v1/chat/completions` body → what SGLang hands the chat template, following its
//! `serving_chat` (`_apply_jinja_template` and the protocol models of SGLang 0.5.23, checked
//! against that release's own code by `tests/tokenizer_golden.rs`):
//!
//! - each message keeps the fields its pydantic model declares (a `user` message: `role`,
//!   `content`; any other role: `role`, `content`, `tool_call_id`, `name`, `phase`,
//!   `reasoning_content`, `tool_calls`, `tools`, `prefix`), in that order, with null fields
//!   dropped and a missing or null `content` as `""`; non-user roles are lower-cased;
//! - content-part arrays: a template that loops over `message['content']` (or mentions images,
//!   audio, video) gets the parts (`{"type":"text","text":…}`, media as `{"type":"image"}`…);
//!   any other template gets the text parts joined with a space; a `tool` message whose parts are
//!   all text is joined the same way;
//! - assistant `tool_calls[].function.arguments` given as a JSON string is parsed to an object;
//! - a final `assistant` message with string content is the prefix to continue when
//!   `continue_final_message` is set (removed from the messages; SGLang encodes its text on its
//!   own and appends those ids, see `SegmentCache::chat_ids`) and otherwise becomes a `user`
//!   message;
//! - `tools` (dropped when `tool_choice` is `"none"`, narrowed to the named function when it is
//!   an object, none when no tool is left) in pydantic's dump shape, each function's fields in
//!   the client's order (see [`tool`]); `reasoning_effort`, then `chat_template_kwargs`, as
//!   extra template variables; `add_generation_prompt` is always true (SGLang continues a final
//!   message by appending its text, not by leaving the generation prompt out).

use minijinja::value::Value;

use super::pyjson::Json;
use super::TokenizeError;

/// What the template gets and what follows its output.
pub(super) struct ChatInput {
    /// Template variables besides the tokenizer's special tokens.
    pub vars: Vec<(String, Value)>,
    /// The continued final message (`continue_final_message`), encoded after the rendered
    /// template on its own.
    pub suffix: Option<String>,
}

fn bad(msg: impl Into<String>) -> TokenizeError {
    TokenizeError::BadRequest(msg.into())
}

const GENERIC_ROLES: &[&str] = &[
    "system",
    "assistant",
    "tool",
    "function",
    "developer",
    "latest_reminder",
    "root",
];
const GENERIC_FIELDS: &[&str] = &[
    "content",
    "tool_call_id",
    "name",
    "phase",
    "reasoning_content",
    "tool_calls",
    "tools",
    "prefix",
];

/// Whether a template wants content-part arrays (SGLang's "openai" content format): it
/// mentions a media word, or loops `for … in message['content']` / `msg.content` / `m.content`.
pub(super) fn wants_content_parts(template: &str) -> bool {
    if ["image", "audio", "video", "vision"]
        .iter()
        .any(|w| template.contains(w))
    {
        return true;
    }
    let mut rest = template;
    while let Some(i) = rest.find("{%") {
        let after = &rest[i + 2..];
        let end = after.find("%}").unwrap_or(after.len());
        let tag = after[..end].trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        if let Some(f) = tag.strip_prefix("for ") {
            if let Some((_, iter)) = f.split_once(" in ") {
                let iter: String = iter.chars().filter(|c| !c.is_whitespace()).collect();
                for var in ["message", "msg", "m"] {
                    for access in [
                        format!("{var}['content']"),
                        format!("{var}[\"content\"]"),
                        format!("{var}.content"),
                    ] {
                        if iter.starts_with(&access)
                            && !iter[access.len()..]
                                .starts_with(|c: char| c.is_alphanumeric() || c == '_')
                        {
                            return true;
                        }
                    }
                }
            }
        }
        rest = &after[end..];
    }
    false
}

/// Text parts of a content array (`text` / `input_text`), SGLang's "string" format.
fn joined_text(parts: &[Json]) -> Result<String, TokenizeError> {
    let mut texts = Vec::new();
    for p in parts {
        if let Some(t) = p.get("type").and_then(Json::as_str) {
            if t == "text" || t == "input_text" {
                let text = p
                    .get("text")
                    .and_then(Json::as_str)
                    .ok_or_else(|| bad("a text content part needs a string text"))?;
                texts.push(text);
            }
        }
    }
    Ok(texts.join(" "))
}

/// Content parts as SGLang normalizes them for a template that iterates over them.
fn normalized_parts(parts: &[Json]) -> Result<Json, TokenizeError> {
    let mut out = Vec::with_capacity(parts.len());
    for p in parts {
        let Json::Obj(_) = p else { continue };
        let kind = p.get("type").and_then(Json::as_str).unwrap_or("");
        let norm = match kind {
            "image_url" | "input_image" => {
                Json::Obj(vec![("type".into(), Json::Str("image".into()))])
            }
            "video_url" => Json::Obj(vec![("type".into(), Json::Str("video".into()))]),
            "audio_url" => Json::Obj(vec![("type".into(), Json::Str("audio".into()))]),
            "text" | "input_text" => {
                let text = p
                    .get("text")
                    .and_then(Json::as_str)
                    .ok_or_else(|| bad("a text content part needs a string text"))?;
                Json::Obj(vec![
                    ("type".into(), Json::Str("text".into())),
                    ("text".into(), Json::Str(text.into())),
                ])
            }
            "tool_reference" => p.clone(),
            _ => continue,
        };
        out.push(norm);
    }
    Ok(Json::Arr(out))
}

/// `tool_calls` as pydantic dumps them: `{id, index, type, function: {name, arguments}}`, with
/// string arguments parsed to the JSON object they hold.
fn tool_calls(v: &Json) -> Result<Json, TokenizeError> {
    let Json::Arr(calls) = v else {
        return Err(bad("tool_calls must be an array"));
    };
    let mut out = Vec::with_capacity(calls.len());
    for c in calls {
        if !matches!(c, Json::Obj(_)) {
            return Err(bad("each tool call must be an object"));
        }
        let f =
            Json::non_null(c.get("function")).ok_or_else(|| bad("a tool call needs a function"))?;
        let args = match Json::non_null(f.get("arguments")) {
            Some(Json::Str(s)) => {
                let parsed: Json = serde_json::from_str(s).map_err(|_| {
                    bad("Assistant tool call function.arguments must be valid JSON.")
                })?;
                if !matches!(parsed, Json::Obj(_)) {
                    return Err(bad(
                        "Assistant tool call function.arguments must be a JSON object.",
                    ));
                }
                parsed
            }
            Some(other) => other.clone(),
            None => Json::Null,
        };
        let field = |k: &str| c.get(k).cloned().unwrap_or(Json::Null);
        out.push(Json::Obj(vec![
            ("id".into(), field("id")),
            ("index".into(), field("index")),
            (
                "type".into(),
                Json::non_null(c.get("type"))
                    .cloned()
                    .unwrap_or(Json::Str("function".into())),
            ),
            (
                "function".into(),
                Json::Obj(vec![
                    ("name".into(), f.get("name").cloned().unwrap_or(Json::Null)),
                    ("arguments".into(), args),
                ]),
            ),
        ]));
    }
    Ok(Json::Arr(out))
}

/// One request tool as SGLang 0.5.23's pydantic `Tool` dumps it: `{type, function,
/// defer_loading}`, the function's fields `description`, `name`, `parameters` (null when
/// absent), then `strict` and `defer_loading` only when set (a tool-level `defer_loading` is
/// copied into a function that has none), all in the order the client wrote them, the fields it
/// left out after (its `Function` model keeps the client's key order so that a template prints
/// the schema as sent).
fn tool(t: &Json) -> Result<(Option<String>, Json), TokenizeError> {
    let f = Json::non_null(t.get("function")).ok_or_else(|| bad("each tool needs a function"))?;
    let Json::Obj(sent) = f else {
        return Err(bad("a tool function must be an object"));
    };
    let name = f
        .get("name")
        .and_then(Json::as_str)
        .ok_or_else(|| bad("a tool function needs a string name"))?;
    let tool_defer = Json::non_null(t.get("defer_loading")).cloned();
    let mut fields: Vec<(&str, Json)> = vec![
        (
            "description",
            f.get("description").cloned().unwrap_or(Json::Null),
        ),
        ("name", Json::Str(name.into())),
        (
            "parameters",
            f.get("parameters").cloned().unwrap_or(Json::Null),
        ),
    ];
    if let Some(s) = Json::non_null(f.get("strict")) {
        fields.push(("strict", s.clone()));
    }
    if let Some(d) = Json::non_null(f.get("defer_loading"))
        .cloned()
        .or(tool_defer.clone())
    {
        fields.push(("defer_loading", d));
    }
    // The client's order first (a repeated key counts where it first appears, as in a Python
    // dict), then the fields it did not send.
    let mut func = Vec::with_capacity(fields.len());
    for (k, _) in sent {
        if let Some(i) = fields.iter().position(|(f, _)| f == k) {
            let (k, v) = fields.remove(i);
            func.push((k.to_string(), v));
        }
    }
    func.extend(fields.into_iter().map(|(k, v)| (k.to_string(), v)));
    Ok((
        Some(name.to_string()),
        Json::Obj(vec![
            (
                "type".into(),
                Json::non_null(t.get("type"))
                    .cloned()
                    .unwrap_or(Json::Str("function".into())),
            ),
            ("function".into(), Json::Obj(func)),
            ("defer_loading".into(), tool_defer.unwrap_or(Json::Null)),
        ]),
    ))
}

/// The request's tools as the template sees them (`None` → the template's `tools` is none).
fn tools(req: &Json) -> Result<Option<Json>, TokenizeError> {
    let Some(list) = Json::non_null(req.get("tools")) else {
        return Ok(None);
    };
    let Json::Arr(list) = list else {
        return Err(bad("tools must be an array"));
    };
    let choice = Json::non_null(req.get("tool_choice"));
    let only = match choice {
        Some(Json::Str(s)) if s == "none" => return Ok(None),
        Some(Json::Str(_)) | None => None,
        Some(obj @ Json::Obj(_)) => Some(
            obj.get("function")
                .and_then(|f| f.get("name"))
                .and_then(Json::as_str)
                .ok_or_else(|| bad("tool_choice needs function.name"))?
                .to_string(),
        ),
        Some(_) => return Err(bad("tool_choice must be a string or an object")),
    };
    let mut out = Vec::with_capacity(list.len());
    for t in list {
        let (name, dumped) = tool(t)?;
        if only.is_none() || only == name {
            out.push(dumped);
        }
    }
    // No tool left (none sent, or none of the chosen name): the template's `tools` is none.
    Ok((!out.is_empty()).then_some(Json::Arr(out)))
}

/// One message as SGLang passes it to the template.
fn message(mut m: Json, content_parts: bool) -> Result<Json, TokenizeError> {
    if !matches!(m, Json::Obj(_)) {
        return Err(bad("each message must be an object"));
    }
    let role = m
        .get("role")
        .and_then(Json::as_str)
        .ok_or_else(|| bad("each message needs a string role"))?;
    let (role, fields): (String, &[&str]) = if role == "user" {
        (role.to_string(), &["content"])
    } else {
        let lower = role.to_lowercase();
        if !GENERIC_ROLES.contains(&lower.as_str()) {
            return Err(bad(format!("unknown message role {role:?}")));
        }
        (lower, GENERIC_FIELDS)
    };
    let mut out = vec![("role".to_string(), Json::Str(role.clone()))];
    for &f in fields {
        let v = m.take(f).filter(|v| !matches!(v, Json::Null));
        let v = match (f, v) {
            ("content", None) => Json::Str(String::new()),
            ("content", Some(s @ Json::Str(_))) => s,
            ("content", Some(Json::Arr(parts))) => {
                let c = if content_parts {
                    normalized_parts(&parts)?
                } else {
                    Json::Str(joined_text(&parts)?)
                };
                match c {
                    // SGLang then flattens a tool message whose parts are all text.
                    Json::Arr(ps)
                        if role == "tool"
                            && ps
                                .iter()
                                .all(|p| p.get("type").and_then(Json::as_str) == Some("text")) =>
                    {
                        let texts: Vec<&str> = ps
                            .iter()
                            .filter_map(|p| p.get("text").and_then(Json::as_str))
                            .collect();
                        Json::Str(texts.join(" "))
                    }
                    c => c,
                }
            }
            ("content", Some(_)) => {
                return Err(bad("message content must be a string or an array"))
            }
            ("tool_calls", Some(v)) => tool_calls(&v)?,
            ("tools", Some(Json::Arr(list))) => Json::Arr(
                list.iter()
                    .map(|t| tool(t).map(|x| x.1))
                    .collect::<Result<_, _>>()?,
            ),
            (_, Some(v)) => v,
            (_, None) => continue,
        };
        out.push((f.to_string(), v));
    }
    Ok(Json::Obj(out))
}

/// Parses a chat body into the template's variables (see the module docs).
pub(super) fn chat_input(body: &[u8], content_parts: bool) -> Result<ChatInput, TokenizeError> {
    let mut req: Json =
        serde_json::from_slice(body).map_err(|e| bad(format!("request body is not JSON: {e}")))?;
    if !matches!(req, Json::Obj(_)) {
        return Err(bad("request body must be a JSON object"));
    }
    let msgs = match req.take("messages") {
        Some(Json::Arr(m)) if !m.is_empty() => m,
        _ => return Err(bad("messages must be a non-empty array")),
    };
    let mut messages = msgs
        .into_iter()
        .map(|m| message(m, content_parts))
        .collect::<Result<Vec<Json>, _>>()?;
    let continue_final = matches!(req.get("continue_final_message"), Some(Json::Bool(true)));
    let mut suffix = None;
    if let Some(last) = messages.last_mut() {
        if last.get("role").and_then(Json::as_str) == Some("assistant") {
            if let Some(Json::Str(text)) = last.get("content") {
                let text = text.clone();
                if continue_final {
                    suffix = Some(text);
                    messages.pop();
                } else {
                    *last = Json::Obj(vec![
                        ("role".into(), Json::Str("user".into())),
                        ("content".into(), Json::Str(text)),
                    ]);
                }
            }
        }
    }
    let tools = tools(&req)?;
    let mut kwargs: Vec<(String, Json)> = match Json::non_null(req.get("chat_template_kwargs")) {
        None => Vec::new(),
        Some(Json::Obj(fields)) => fields.clone(),
        Some(_) => return Err(bad("chat_template_kwargs must be an object")),
    };
    // SGLang pops `reasoning_effort` out of the kwargs into the request field.
    let mut effort = Json::non_null(req.get("reasoning_effort")).cloned();
    if let Some(i) = kwargs.iter().rposition(|(k, _)| k == "reasoning_effort") {
        let (_, v) = kwargs.remove(i);
        kwargs.retain(|(k, _)| k != "reasoning_effort");
        if !matches!(v, Json::Null) {
            effort = Some(v);
        }
    }
    let mut vars: Vec<(String, Value)> = Vec::with_capacity(8 + kwargs.len());
    vars.push((
        "messages".into(),
        Value::from(messages.iter().map(Json::to_value).collect::<Vec<_>>()),
    ));
    vars.push((
        "tools".into(),
        tools
            .as_ref()
            .map(Json::to_value)
            .unwrap_or(Value::from(())),
    ));
    vars.push(("documents".into(), Value::from(())));
    vars.push(("add_generation_prompt".into(), Value::from(true)));
    if let Some(e) = effort {
        vars.push(("reasoning_effort".into(), e.to_value()));
    }
    for (k, v) in &kwargs {
        vars.push((k.clone(), v.to_value()));
    }
    Ok(ChatInput { vars, suffix })
}
