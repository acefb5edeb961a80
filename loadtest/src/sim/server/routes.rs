//! Endpoint dispatch, the response helpers, and the info, health, load and cache endpoints.

use std::rc::Rc;
use std::time::Duration;

use radixgate::http::response::{error_response, render};
use radixgate::http::RequestHead;
use serde_json::{json, Value};

use crate::sim::api::Endpoint;
use crate::sim::kv_events::{KvPublisher, PublisherKind};
use crate::sim::tokenizer::TokenizerMode;
use crate::sim::EngineKind;

use super::conn::{write, AbortGuard, Next, Reader, WriteHalf};
use super::inference::inference;
use super::{unix_now, Server};

/// `/health_generate` gives up after this long (SGLang's `SGLANG_HEALTH_CHECK_TIMEOUT`).
const HEALTH_TIMEOUT: Duration = Duration::from_secs(20);
/// Context length advertised by `/v1/models` and `/get_server_info`.
const CONTEXT_LEN: usize = 131_072;

pub(super) async fn respond(
    sh: &Server,
    wr: &mut WriteHalf,
    keep: bool,
    status: u16,
    ctype: &str,
    body: &[u8],
) -> Next {
    let resp = render(
        status,
        ctype,
        &[("x-worker-port", &sh.port_str)],
        body,
        !keep,
    );
    match write(wr, resp).await {
        Ok(()) if keep => Next::KeepAlive,
        _ => Next::Close,
    }
}

pub(super) async fn respond_json(
    sh: &Server,
    wr: &mut WriteHalf,
    keep: bool,
    status: u16,
    v: &Value,
) -> Next {
    let body = serde_json::to_vec(v).unwrap_or_default();
    respond(sh, wr, keep, status, "application/json", &body).await
}

pub(super) async fn respond_error(
    sh: &Server,
    wr: &mut WriteHalf,
    keep: bool,
    status: u16,
    kind: &str,
    msg: &str,
) -> Next {
    let resp = error_response(status, kind, msg, &[("x-worker-port", &sh.port_str)], !keep);
    match write(wr, resp).await {
        Ok(()) if keep => Next::KeepAlive,
        _ => Next::Close,
    }
}

pub(super) async fn handle(
    sh: &Rc<Server>,
    head: &RequestHead,
    body: &[u8],
    r: &mut Reader,
    wr: &mut WriteHalf,
) -> Next {
    let keep = head.keep_alive;
    let method = head.method();
    let key = sh.cfg.api_key.as_deref();
    let check = match sh.cfg.engine {
        EngineKind::Sglang => super::auth::allowed,
        EngineKind::Vllm => super::auth::allowed_vllm,
    };
    if !check(key, method, head.path(), head.header("authorization")) {
        let body = super::auth::UNAUTHORIZED_BODY;
        return respond(sh, wr, keep, 401, "application/json", body).await;
    }
    if method == b"HEAD" {
        // Only GET/POST APIs exist; a HEAD answer must not carry a body.
        let resp = render(
            405,
            "application/json",
            &[("x-worker-port", &sh.port_str)],
            b"",
            !keep,
        );
        return match write(wr, resp).await {
            Ok(()) if keep => Next::KeepAlive,
            _ => Next::Close,
        };
    }
    let post = method == b"POST";
    let vllm = sh.cfg.engine == EngineKind::Vllm;
    let endpoint = match head.path() {
        b"/generate" if !vllm && (post || method == b"PUT") => Endpoint::Generate,
        b"/inference/v1/generate" if vllm && post => Endpoint::Tokens,
        b"/v1/chat/completions" if post => Endpoint::Chat,
        b"/v1/completions" if post => Endpoint::Completions,
        b"/v1/responses" if post => Endpoint::Responses,
        b"/v1/messages" if post => Endpoint::Messages,
        path if vllm => return super::vllm::handle_info(sh, method, path, body, keep, wr).await,
        path => return handle_info(sh, method, path, body, keep, r, wr).await,
    };
    // The DP rank that runs it (SGLang: `data_parallel_rank`; vLLM: the
    // `X-data-parallel-rank` header; else round robin).
    let rank = if vllm {
        sh.rank_for_vllm(head.header("x-data-parallel-rank"))
    } else {
        sh.rank_for(body)
    };
    match rank {
        Ok(rank) => inference(&rank, head, endpoint, body, r, wr).await,
        Err(msg) => respond_error(sh, wr, keep, 400, "BadRequestError", &msg).await,
    }
}

/// Every path the simulator serves (with some method): other methods get 405, other paths 404.
const KNOWN_PATHS: &[&[u8]] = &[
    b"/generate",
    b"/v1/chat/completions",
    b"/v1/completions",
    b"/v1/responses",
    b"/v1/messages",
    b"/abort_request",
    b"/health",
    b"/health_generate",
    b"/v1/models",
    b"/get_model_info",
    b"/model_info",
    b"/get_server_info",
    b"/server_info",
    b"/get_load",
    b"/v1/loads",
    b"/flush_cache",
    b"/metrics",
    b"/debug/requests",
    b"/debug/stats",
    b"/debug/faults",
];

/// The non-inference endpoints (health, info, load, cache, metrics, recorded requests), and the
/// 405/404 answers for everything else.
async fn handle_info(
    sh: &Rc<Server>,
    method: &[u8],
    path: &[u8],
    body: &[u8],
    keep: bool,
    r: &mut Reader,
    wr: &mut WriteHalf,
) -> Next {
    let get = method == b"GET";
    let post = method == b"POST";
    match path {
        b"/health" if get => {
            if sh.cfg.faults.health_fail {
                respond(sh, wr, keep, 503, "text/plain", b"").await
            } else {
                respond(sh, wr, keep, 200, "text/plain", b"").await
            }
        }
        b"/health_generate" if get => health_generate(sh, keep, r, wr).await,
        b"/v1/models" if get => respond_json(sh, wr, keep, 200, &models(sh)).await,
        b"/get_model_info" | b"/model_info" if get => {
            respond_json(sh, wr, keep, 200, &model_info(sh)).await
        }
        b"/get_server_info" | b"/server_info" if get => {
            respond_json(sh, wr, keep, 200, &server_info(sh)).await
        }
        b"/get_load" if get => respond_json(sh, wr, keep, 200, &get_load(sh)).await,
        b"/v1/loads" if get => respond_json(sh, wr, keep, 200, &loads(sh)).await,
        b"/flush_cache" if get || post => flush_cache(sh, keep, wr).await,
        b"/abort_request" if post => match abort_request(sh, body) {
            Ok(()) => respond(sh, wr, keep, 200, "application/json", b"").await,
            Err(msg) => respond_error(sh, wr, keep, 400, "BadRequestError", &msg).await,
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

/// `/abort_request` with `{"rid": "...", "abort_all": bool}`: SGLang answers 200 with an
/// empty body whether or not it ran the request.
fn abort_request(sh: &Rc<Server>, body: &[u8]) -> Result<(), String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let rid = v.get("rid").and_then(Value::as_str).unwrap_or("");
    let all = v.get("abort_all").and_then(Value::as_bool).unwrap_or(false);
    sh.abort_requests.set(sh.abort_requests.get() + 1);
    for r in sh.ranks() {
        r.abort_by_rid(rid, all);
    }
    Ok(())
}

/// `/metrics`: the port's one scheduler, or with `--dp-size` every rank's series, each sample
/// labelled `dp_rank` (SGLang's schedulers label theirs so), families kept together.
fn metrics(sh: &Rc<Server>) -> String {
    let render = |r: &Server| {
        r.engine
            .borrow()
            .render_metrics(&r.cfg.model_name, r.held.get(), r.virt_now())
    };
    if sh.others.is_empty() {
        return render(sh);
    }
    let texts: Vec<String> = sh.ranks().map(|r| render(r)).collect();
    merge_rank_metrics(&texts, true)
}

/// The expositions of a port's DP ranks (`texts[r]` is rank r's) as one: each family's HELP
/// and TYPE once, then every rank's samples; with `relabel` each sample gets `dp_rank` as its
/// first label (SGLang's schedulers label theirs so; vLLM's already carry `engine`).
pub(super) fn merge_rank_metrics(texts: &[String], relabel: bool) -> String {
    if texts.len() == 1 {
        return texts[0].clone();
    }
    // Split each rank's text into families (a family starts at its `# HELP` line); every rank
    // renders the same families in the same order.
    let families = |t: &str| -> Vec<Vec<String>> {
        let mut out: Vec<Vec<String>> = Vec::new();
        for line in t.lines() {
            if line.starts_with("# HELP") || out.is_empty() {
                out.push(Vec::new());
            }
            if let Some(f) = out.last_mut() {
                f.push(line.to_string());
            }
        }
        out
    };
    let split: Vec<Vec<Vec<String>>> = texts.iter().map(|t| families(t)).collect();
    let mut out = String::new();
    for (i, fam) in split[0].iter().enumerate() {
        for line in fam.iter().filter(|l| l.starts_with('#')) {
            out.push_str(line);
            out.push('\n');
        }
        for (rank, fams) in split.iter().enumerate() {
            let Some(f) = fams.get(i) else { continue };
            for line in f.iter().filter(|l| !l.starts_with('#') && !l.is_empty()) {
                if relabel {
                    out.push_str(&with_dp_rank(line, rank));
                } else {
                    out.push_str(line);
                }
                out.push('\n');
            }
        }
    }
    out
}

/// One sample line with `dp_rank="rank"` as its first label.
fn with_dp_rank(line: &str, rank: usize) -> String {
    match line.find(['{', ' ']) {
        Some(i) if line.as_bytes()[i] == b'{' => {
            let rest = &line[i + 1..];
            let sep = if rest.starts_with('}') { "" } else { "," };
            format!("{}{{dp_rank=\"{rank}\"{sep}{rest}", &line[..i])
        }
        Some(i) => format!("{}{{dp_rank=\"{rank}\"}}{}", &line[..i], &line[i..]),
        None => line.to_string(),
    }
}

/// `/flush_cache`: SGLang's text answer, 400 when requests are in flight.
async fn flush_cache(sh: &Rc<Server>, keep: bool, wr: &mut WriteHalf) -> Next {
    let mut ok = true;
    for r in sh.ranks() {
        ok &= r.engine.borrow_mut().flush_cache();
        // SGLang publishes AllBlocksCleared right away, not at the next scheduler step.
        r.publish_kv();
    }
    let text = "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n";
    respond(
        sh,
        wr,
        keep,
        if ok { 200 } else { 400 },
        "text/plain; charset=utf-8",
        text.as_bytes(),
    )
    .await
}

fn models(sh: &Server) -> Value {
    let m = &sh.cfg.model_name;
    json!({"object": "list", "data": [{
        "id": m, "object": "model", "created": sh.started_unix, "owned_by": "sglang",
        "root": m, "parent": null, "max_model_len": CONTEXT_LEN,
    }]})
}

fn model_info(sh: &Server) -> Value {
    let m = &sh.cfg.model_name;
    json!({
        "model_path": m, "tokenizer_path": m, "is_generation": true,
        "preferred_sampling_params": null, "weight_version": "default",
        "served_model_name": m, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
    })
}

fn server_info(sh: &Rc<Server>) -> Value {
    let c = &sh.cfg;
    let dp = sh.others.len() + 1;
    let internal_states: Vec<Value> = sh
        .ranks()
        .map(|r| {
            let e = r.engine.borrow();
            json!({
                "dp_rank": r.dp_rank,
                "last_gen_throughput": e.gen_throughput(),
                "num_running_reqs": e.num_running(),
                "num_waiting_reqs": e.num_waiting(),
                "token_usage": e.cache().used_tokens() as f64 / c.max_total_tokens.max(1) as f64,
                "cache_hit_rate": e.last_hit_rate(),
                "memory_usage": {"kvcache_tokens": e.cache().tree_tokens() + e.cache().private_tokens()},
            })
        })
        .collect();
    let tokenizer = match (c.tokenizer_path.is_some(), c.tokenizer) {
        (true, _) => "hf",
        (false, TokenizerMode::Bpe) => "bpe",
        (false, TokenizerMode::Approx) => "approx",
    };
    let tokenizer_path = match &c.tokenizer_path {
        Some(p) => p.display().to_string(),
        None => c.model_name.clone(),
    };
    json!({
        "model_path": c.model_name, "tokenizer_path": tokenizer_path, "served_model_name": c.model_name,
        "host": c.host, "port": sh.port, "tp_size": dp, "dp_size": dp, "enable_dp_attention": dp > 1, "pp_size": 1, "ep_size": 1,
        "page_size": c.page_size, "chunked_prefill_size": c.chunked_prefill_size,
        "max_prefill_tokens": 16384, "max_running_requests": c.max_running,
        "max_total_tokens": c.max_total_tokens, "schedule_policy": "fcfs",
        "enable_priority_scheduling": c.priority_scheduling, "schedule_low_priority_values_first": false,
        "max_queued_requests": c.max_queued_requests,
        "radix_eviction_policy": "lru", "disable_radix_cache": false, "enable_metrics": true,
        "enable_hierarchical_cache": c.host_cache_tokens > 0,
        "enable_cache_report": true, "context_length": CONTEXT_LEN, "stream_interval": 1,
        "random_seed": c.seed, "kv_cache_dtype": "auto", "dtype": "bfloat16",
        "max_total_num_tokens": c.max_total_tokens,
        "max_req_input_len": c.max_total_tokens.saturating_sub(1).min(CONTEXT_LEN),
        "internal_states": internal_states,
        "kv_events_config": kv_events_config(sh),
        "kv_events": kv_events_descriptor(sh),
        "version": "0.5.2-sim",
        "simulator": {
            "time_scale": c.time_scale, "tokenizer": tokenizer,
            "token_interval_ms": c.token_interval_ms, "default_max_tokens": c.default_max_tokens,
            "host_cache_tokens": c.host_cache_tokens,
        },
    })
}

/// `kv_events_config` as SGLang reports it: the server argument, a JSON string (null without
/// `--kv-events-config`). Each simulated worker reports its own endpoints (base + index, bound
/// ephemeral ports resolved), so a gateway reads them exactly as from a real server.
fn kv_events_config(sh: &Server) -> Value {
    match &sh.kv_config {
        Some(c) => Value::String(c.to_json().to_string()),
        None => Value::Null,
    }
}

/// The publisher descriptor SGLang 0.5.23 adds as `kv_events` (`describe_kv_events_publisher`):
/// where to subscribe without parsing the config string. Exactly its keys: `publisher`,
/// `endpoint_host` (as configured, possibly a wildcard the consumer replaces with the worker's
/// host), `endpoint_port_base` (rank r publishes on base + r), `topic`, `block_size` (the page
/// size), `dp_size` (publishers), and `replay_endpoint_port_base` only for a tcp replay
/// endpoint. Null when nothing is published: no config, publisher "null", or an endpoint that
/// is not tcp://HOST:PORT.
fn kv_events_descriptor(sh: &Server) -> Value {
    let Some(c) = sh
        .kv_config
        .as_ref()
        .filter(|c| c.publisher == PublisherKind::Zmq)
    else {
        return Value::Null;
    };
    let Some((host, port)) = tcp_host_port(&c.endpoint) else {
        return Value::Null;
    };
    let mut d = json!({
        "publisher": "zmq", "endpoint_host": host, "endpoint_port_base": port,
        "topic": c.topic, "block_size": sh.cfg.page_size, "dp_size": sh.others.len() + 1,
    });
    if let Some((_, replay)) = c.replay_endpoint.as_deref().and_then(tcp_host_port) {
        d["replay_endpoint_port_base"] = json!(replay);
    }
    d
}

/// `(host, port)` of a `tcp://HOST:PORT` endpoint with a real port (IPv6 hosts keep their
/// brackets, so a consumer can splice `tcp://{host}:{port}`); `None` otherwise.
fn tcp_host_port(ep: &str) -> Option<(&str, u16)> {
    let (host, port) = ep.strip_prefix("tcp://")?.rsplit_once(':')?;
    let port = port.parse::<u16>().ok().filter(|&p| p > 0)?;
    Some((host, port)).filter(|(h, _)| !h.is_empty())
}

fn get_load(sh: &Rc<Server>) -> Value {
    let per_rank = |sh: &Server| {
        let e = sh.engine.borrow();
        json!({
            "dp_rank": sh.dp_rank,
            "num_reqs": e.num_running() + e.num_waiting() + sh.held.get(),
            "num_waiting_reqs": e.num_waiting() + sh.held.get(),
            "num_tokens": e.cache().used_tokens(),
            "num_pending_tokens": e.waiting_tokens(),
            "ts_tic": unix_now(),
        })
    };
    Value::Array(sh.ranks().map(|r| per_rank(r)).collect())
}

fn loads(sh: &Rc<Server>) -> Value {
    let loads: Vec<Value> = sh.ranks().map(|r| rank_load(r)).collect();
    json!({
        "timestamp": unix_now(), "version": "0.5.2-sim", "accelerator": "sim",
        "num_accelerators": loads.len(), "loads": loads,
    })
}

fn rank_load(sh: &Server) -> Value {
    let e = sh.engine.borrow();
    let cap = sh.cfg.max_total_tokens.max(1);
    let used = e.cache().used_tokens();
    {
        json!({
            "dp_rank": sh.dp_rank, "num_running_reqs": e.num_running(),
            "num_waiting_reqs": e.num_waiting() + sh.held.get(),
            "num_waiting_uncached_tokens": e.waiting_tokens(), "num_used_tokens": used,
            "num_total_tokens": e.cache().tree_tokens() + e.cache().private_tokens(),
            "max_total_num_tokens": cap, "token_usage": used as f64 / cap as f64,
            "gen_throughput": e.gen_throughput(), "cache_hit_rate": e.last_hit_rate(),
            "utilization": if e.is_idle() { 0.0 } else { 1.0 },
        })
    }
}

pub(super) fn debug_stats(sh: &Rc<Server>) -> Value {
    let ranks: Vec<Value> = sh
        .ranks()
        .map(|r| {
            let e = r.engine.borrow();
            let (m, cache) = (e.metrics(), e.cache());
            let st = cache.stats();
            json!({
                "dp_rank": r.dp_rank,
                "inference_received": r.received.get(),
                "inference_answered": r.answered.get(),
                "prompt_tokens": m.prompt_tokens,
                "cached_tokens": m.cached_tokens,
                "cached_tokens_host": m.cached_tokens_host,
                "num_requests": m.num_requests,
                "host_cache": {
                    "capacity": cache.host_capacity(), "tokens": cache.host_tokens(),
                    "backed_up_tokens": st.backed_up_tokens, "loaded_tokens": st.loaded_tokens,
                    "evicted_tokens": st.host_evicted_tokens,
                },
            })
        })
        .collect();
    let sum = |f: fn(&Server) -> u64| sh.ranks().map(|r| f(r)).sum::<u64>();
    json!({
        "dp_size": ranks.len(),
        "dp_ranks": ranks,
        "port": sh.port,
        "connections": sh.connections.get(),
        "inference_connections": sh.inference_connections.get(),
        "inference_received": sum(|r| r.received.get()),
        "inference_answered": sum(|r| r.answered.get()),
        "inference_in_progress": sum(|r| r.in_progress.get()),
        "aborted": sum(|r| r.engine.borrow().metrics().num_aborted),
        "abort_requests": sh.abort_requests.get(),
        "aborted_by_rid": sum(|r| r.aborted_by_rid.get()),
        "queue_full": sum(|r| r.queue_full.get()),
        "running_rids": sh.ranks().flat_map(|r| r.rids.borrow().keys().cloned().collect::<Vec<_>>()).collect::<Vec<_>>(),
        "fail_rate": sh.fail_rate(),
        "hold": sh.hold.get(),
        "disaggregation_mode": sh.cfg.disaggregation_mode.map(|m| m.as_str()),
        "bootstrap_port": sh.bootstrap_port,
        "last_bootstrap": sh.last_bootstrap.borrow().as_ref().map(|f| f.to_json()),
        "kv_events": sh.kv.as_ref().map(|kv| {
            let mut v = kv.stats().to_json();
            v["next_seq"] = json!(kv.next_seq());
            v
        }),
    })
}

/// `POST /debug/faults` with `{"fail_rate": 0.0..=1.0 | null, "hold": bool, "skip_kv_seq":
/// bool, "lose_kv_seq": bool}` (each optional; `fail_rate: null` restores the configured rate;
/// the KV knobs act on the next published batch, see [`Faults`](crate::sim::Faults)).
pub(super) fn set_faults(sh: &Server, body: &[u8]) -> Result<(), String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let Some(obj) = v.as_object() else {
        return Err("expected a JSON object".into());
    };
    if let Some(f) = obj.get("fail_rate") {
        let rate = match f {
            Value::Null => None,
            v => match v.as_f64() {
                Some(r) if (0.0..=1.0).contains(&r) => Some(r),
                _ => return Err("fail_rate must be within [0, 1] or null".into()),
            },
        };
        sh.fail_rate_override.set(rate);
    }
    if let Some(h) = obj.get("hold") {
        sh.hold
            .set(h.as_bool().ok_or("hold must be true or false")?);
    }
    for (key, act) in [
        (
            "skip_kv_seq",
            KvPublisher::skip_next_batch as fn(&KvPublisher, bool),
        ),
        ("lose_kv_seq", KvPublisher::lose_next_batch),
    ] {
        if let Some(v) = obj.get(key) {
            let on = v.as_bool().ok_or(format!("{key} must be true or false"))?;
            let kv = sh
                .kv
                .as_ref()
                .ok_or("KV events are not published (no --kv-events-config)")?;
            act(kv, on);
        }
    }
    Ok(())
}

pub(super) fn debug_requests(sh: &Server) -> Value {
    Value::Array(
        sh.records
            .borrow()
            .iter()
            .map(|r| {
                json!({
                    "method": r.method,
                    "path": r.target,
                    "headers": r.headers.iter().map(|(n, v)| json!([n, v])).collect::<Vec<_>>(),
                    "body": r.body,
                })
            })
            .collect(),
    )
}

async fn health_generate(sh: &Rc<Server>, keep: bool, r: &mut Reader, wr: &mut WriteHalf) -> Next {
    if sh.cfg.faults.health_fail {
        return respond(sh, wr, keep, 503, "text/plain", b"").await;
    }
    if sh
        .cfg
        .faults
        .stall_after
        .is_some_and(|n| sh.received.get() > n)
    {
        // A wedged scheduler never produces the probe's token either.
        stall(sh, r).await;
        return Next::Close;
    }
    let (id, slot) = match sh.submit(vec![0], 1, true) {
        Ok(x) => x,
        Err(_) => return respond(sh, wr, keep, 503, "text/plain", b"").await,
    };
    let _guard = AbortGuard {
        sh: sh.clone(),
        ids: vec![id],
    };
    let ok = monoio::select! {
        res = monoio::time::timeout(HEALTH_TIMEOUT, slot.changed(0)) => res.is_ok(),
        _ = r.disconnected() => return Next::Close,
        _ = sh.shutdown.wait() => return Next::Close,
    };
    respond(sh, wr, keep, if ok { 200 } else { 503 }, "text/plain", b"").await
}

/// Hold a request forever (until the client leaves or the server stops).
pub(super) async fn stall(sh: &Server, r: &mut Reader) {
    monoio::select! {
        _ = r.disconnected() => {}
        _ = sh.shutdown.wait() => {}
    }
}

/// Count an answered inference request; the `die_after`-th one kills the server.
pub(super) fn answered(sh: &Server) {
    let n = sh.answered.get() + 1;
    sh.answered.set(n);
    if sh.cfg.faults.die_after.is_some_and(|limit| n >= limit) {
        sh.die();
    }
}

#[cfg(test)]
mod tests {
    use super::{tcp_host_port, with_dp_rank};

    #[test]
    fn descriptor_endpoints_split_as_sglang_advertises_them() {
        assert_eq!(tcp_host_port("tcp://*:5557"), Some(("*", 5557)));
        assert_eq!(tcp_host_port("tcp://[::1]:5558"), Some(("[::1]", 5558)));
        assert_eq!(
            tcp_host_port("tcp://127.0.0.1:*"),
            None,
            "an unbound ephemeral port"
        );
        assert_eq!(tcp_host_port("ipc:///tmp/kv"), None);
        assert_eq!(tcp_host_port("tcp://h:0"), None);
    }

    #[test]
    fn a_sample_gets_dp_rank_as_its_first_label() {
        assert_eq!(
            with_dp_rank("sglang:num_running_reqs{model_name=\"m\"} 3", 1),
            "sglang:num_running_reqs{dp_rank=\"1\",model_name=\"m\"} 3"
        );
        assert_eq!(with_dp_rank("x{} 1", 0), "x{dp_rank=\"0\"} 1");
        assert_eq!(with_dp_rank("x 1", 2), "x{dp_rank=\"2\"} 1");
        assert_eq!(with_dp_rank("x", 2), "x");
    }
}
