//! vLLM 0.33's HTTP surface (`--engine vllm`) beside SGLang's: the endpoints only vLLM has
//! (`/kv_event_sources`, `/reset_prefix_cache`, `/version`, `/tokenize`, `/detokenize`, `/load`,
//! `/inference/v1/abort_requests`) and vLLM's forms of `/v1/models` and `/metrics`. SGLang's own
//! endpoints (`/generate`, `/get_server_info`, `/flush_cache`, `/get_load`, ...) are 404 here,
//! as on a real vLLM server, so a gateway that relies on them is caught by the tests.
//!
//! A vLLM server announces its KV-event publishers at `GET /kv_event_sources` rather than in a
//! server-info document: an object keyed by DP rank (JSON string keys), each value that rank's
//! `KVEventsConfig` with its endpoints already offset for the rank; `{}` when events are off.

use std::rc::Rc;

use serde_json::{json, Map, Value};

use crate::sim::api::{self, Endpoint};

use super::conn::{Next, WriteHalf};
use super::routes::{
    debug_requests, debug_stats, merge_rank_metrics, respond, respond_error, respond_json,
    set_faults,
};
use super::Server;

/// The version `/version` reports: the vLLM release whose surface the simulator reproduces.
pub(super) const VLLM_VERSION: &str = "0.33.0";
/// Context length `/v1/models` and `/tokenize` report.
const MAX_MODEL_LEN: usize = 131_072;

/// Every path a vLLM-shaped worker serves with some method: other methods get 405, other
/// paths 404.
const KNOWN_PATHS: &[&[u8]] = &[
    b"/inference/v1/generate",
    b"/inference/v1/abort_requests",
    b"/v1/chat/completions",
    b"/v1/completions",
    b"/v1/responses",
    b"/v1/messages",
    b"/health",
    b"/v1/models",
    b"/version",
    b"/load",
    b"/tokenize",
    b"/detokenize",
    b"/reset_prefix_cache",
    b"/kv_event_sources",
    b"/metrics",
    b"/debug/requests",
    b"/debug/stats",
    b"/debug/faults",
];

/// The non-inference endpoints of a vLLM-shaped worker.
pub(super) async fn handle_info(
    sh: &Rc<Server>,
    method: &[u8],
    path: &[u8],
    body: &[u8],
    keep: bool,
    wr: &mut WriteHalf,
) -> Next {
    let get = method == b"GET";
    let post = method == b"POST";
    match path {
        b"/health" if get => {
            let status = if sh.cfg.faults.health_fail { 503 } else { 200 };
            respond(sh, wr, keep, status, "application/json", b"").await
        }
        b"/v1/models" if get => respond_json(sh, wr, keep, 200, &models(sh)).await,
        b"/version" if get => {
            respond_json(sh, wr, keep, 200, &json!({"version": VLLM_VERSION})).await
        }
        b"/load" if get => {
            let load: u64 = sh.ranks().map(|r| r.in_progress.get()).sum();
            respond_json(sh, wr, keep, 200, &json!({"server_load": load})).await
        }
        b"/kv_event_sources" if get => respond_json(sh, wr, keep, 200, &kv_event_sources(sh)).await,
        b"/reset_prefix_cache" if post => {
            let mut ok = true;
            for r in sh.ranks() {
                ok &= r.engine.borrow_mut().flush_cache();
                // vLLM's scheduler publishes AllBlocksCleared with the step's events; the
                // simulator sends it at once, as a step would follow.
                r.publish_kv();
            }
            respond_json(sh, wr, keep, 200, &json!({"success": ok})).await
        }
        b"/tokenize" if post => match tokenize(sh, body) {
            Ok(v) => respond_json(sh, wr, keep, 200, &v).await,
            Err(msg) => respond_error(sh, wr, keep, 400, "BadRequestError", &msg).await,
        },
        b"/detokenize" if post => match detokenize(sh, body) {
            Ok(v) => respond_json(sh, wr, keep, 200, &v).await,
            Err(msg) => respond_error(sh, wr, keep, 400, "BadRequestError", &msg).await,
        },
        b"/inference/v1/abort_requests" if post => match abort_requests(sh, body) {
            Ok(()) => respond(sh, wr, keep, 200, "application/json", b"").await,
            Err(detail) => respond_json(sh, wr, keep, 400, &json!({ "detail": detail })).await,
        },
        b"/metrics" if get => {
            let text = metrics(sh);
            respond(
                sh,
                wr,
                keep,
                200,
                "text/plain; version=0.0.4; charset=utf-8",
                text.as_bytes(),
            )
            .await
        }
        b"/debug/requests" if get => respond_json(sh, wr, keep, 200, &debug_requests(sh)).await,
        b"/debug/stats" if get => respond_json(sh, wr, keep, 200, &debug_stats(sh)).await,
        b"/debug/faults" if post => match sh.ranks().try_for_each(|r| set_faults(r, body)) {
            Ok(()) => respond_json(sh, wr, keep, 200, &debug_stats(sh)).await,
            Err(msg) => respond_error(sh, wr, keep, 400, "BadRequestError", &msg).await,
        },
        p if KNOWN_PATHS.contains(&p) => {
            respond_json(sh, wr, keep, 405, &json!({"detail": "Method Not Allowed"})).await
        }
        _ => respond_json(sh, wr, keep, 404, &json!({"detail": "Not Found"})).await,
    }
}

/// `GET /kv_event_sources`: each publishing rank's config under its rank (a string key, as
/// JSON has no integer keys); `{}` without `--kv-events-config`, with events disabled, or with
/// publisher "null".
pub(super) fn kv_event_sources(sh: &Rc<Server>) -> Value {
    let mut m = Map::new();
    for r in sh.ranks() {
        if let Some(kv) = &r.kv {
            m.insert(r.dp_rank.to_string(), kv.config().to_vllm_json());
        }
    }
    Value::Object(m)
}

/// One `ModelPermission` as vLLM lists it under each model.
fn permission(sh: &Server) -> Value {
    json!({
        "id": format!("modelperm-{}", sh.next_resp_id("")), "object": "model_permission",
        "created": sh.started_unix, "allow_create_engine": false, "allow_sampling": true,
        "allow_logprobs": true, "allow_search_indices": false, "allow_view": true,
        "allow_fine_tuning": false, "organization": "*", "group": null, "is_blocking": false,
    })
}

/// `GET /v1/models`: the base model, then each `--lora-modules` adapter with the base model as
/// its `parent` (vLLM's `OpenAIServingModels.show_available_models`).
fn models(sh: &Server) -> Value {
    let m = &sh.cfg.model_name;
    let mut data = vec![json!({
        "id": m, "object": "model", "created": sh.started_unix, "owned_by": "vllm",
        "root": m, "parent": null, "max_model_len": MAX_MODEL_LEN, "permission": [permission(sh)],
    })];
    for lora in &sh.cfg.lora_modules {
        data.push(json!({
            "id": lora.name, "object": "model", "created": sh.started_unix, "owned_by": "vllm",
            "root": lora.path, "parent": m, "max_model_len": null, "permission": [permission(sh)],
        }));
    }
    json!({"object": "list", "data": data})
}

/// `POST /tokenize`: `{"prompt": "..."}` (a completion prompt) or `{"messages": [...]}` (a
/// chat through the template), tokenized as the inference endpoints would.
fn tokenize(sh: &Server, body: &[u8]) -> Result<Value, String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let ep = if v.get("messages").is_some() {
        Endpoint::Chat
    } else if v.get("prompt").is_some_and(Value::is_string) {
        Endpoint::Completions
    } else {
        return Err("expected a string prompt or messages".into());
    };
    let req = api::parse_inference(ep, body, &sh.tok, 1).map_err(|e| e.message)?;
    let tokens = req.prompts.into_iter().next().unwrap_or_default();
    Ok(json!({
        "count": tokens.len(), "max_model_len": MAX_MODEL_LEN, "tokens": tokens,
        "token_strs": null,
    }))
}

/// `POST /detokenize` with `{"tokens": [...]}`: the text of the ids (the simulator knows the
/// text of the ids it generates; other ids render as nothing).
fn detokenize(sh: &Server, body: &[u8]) -> Result<Value, String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let ids: Vec<u32> = v
        .get("tokens")
        .and_then(Value::as_array)
        .and_then(|a| {
            a.iter()
                .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
                .collect()
        })
        .ok_or("tokens must be a list of token ids")?;
    Ok(json!({ "prompt": sh.tok.decode_output(&ids) }))
}

/// `POST /inference/v1/abort_requests` with `{"request_ids": [...]}`: abort each named running
/// request (by its `x-request-id`, its `request_id`, or the `generate-tokens-` id vLLM gives
/// it); 200 with an empty body either way, 400 without `request_ids`.
fn abort_requests(sh: &Rc<Server>, body: &[u8]) -> Result<(), String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("JSON decode error: {e}"))?;
    let ids = v
        .get("request_ids")
        .filter(|x| !x.is_null())
        .ok_or("Missing 'request_ids' in request body")?;
    let ids: Vec<&str> = match ids {
        Value::String(s) => vec![s.as_str()],
        Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    sh.abort_requests.set(sh.abort_requests.get() + 1);
    for id in ids {
        let prefixed = format!("{}{id}", api::TOKENS_ID_PREFIX);
        for r in sh.ranks() {
            r.abort_by_rid(id, false);
            r.abort_by_rid(&prefixed, false);
        }
    }
    Ok(())
}

/// `GET /metrics`: every rank's series, labelled `engine` = its DP rank, as one vLLM API server
/// exposes all its engines.
fn metrics(sh: &Rc<Server>) -> String {
    let created = sh.started_unix as f64;
    let texts: Vec<String> = sh
        .ranks()
        .map(|r| {
            r.engine.borrow().render_vllm_metrics(
                &r.cfg.model_name,
                r.dp_rank,
                r.held.get(),
                r.virt_now(),
                created,
            )
        })
        .collect();
    merge_rank_metrics(&texts, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_vllm_path_is_known_and_sglang_paths_are_not() {
        for p in [
            &b"/kv_event_sources"[..],
            b"/reset_prefix_cache",
            b"/inference/v1/generate",
        ] {
            assert!(KNOWN_PATHS.contains(&p));
        }
        for p in [
            &b"/generate"[..],
            b"/get_server_info",
            b"/flush_cache",
            b"/get_load",
        ] {
            assert!(!KNOWN_PATHS.contains(&p), "{}", String::from_utf8_lossy(p));
        }
    }
}
