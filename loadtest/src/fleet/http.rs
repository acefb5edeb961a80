//! The simulated servers' HTTP side: one thread on raw epoll answering, for every server of the
//! shard, what the gateway asks of an SGLang server at start and while routing. Inference
//! answers immediately with a tiny non-streamed answer whose text names the server (`s123`),
//! so a client can tell where the gateway routed.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use serde_json::{json, Value};

use crate::streams::sys::{self, Epoll, Io};

/// What every server of the fleet announces.
#[derive(Debug, Clone)]
pub struct ServerShape {
    /// Served model name.
    pub model: String,
    /// DP ranks (publishers) per server.
    pub dp: usize,
    /// Tokens per block (SGLang's page size).
    pub block_size: usize,
    /// Server s's HTTP port is `http_base + s`.
    pub http_base: u16,
    /// Server s's rank r publishes on `pub_base + s * dp + r`.
    pub pub_base: u16,
    /// Server s's rank r replays on `replay_base + s * dp + r`.
    pub replay_base: u16,
    /// Replay buffer depth (batches), as announced in `kv_events_config`.
    pub buffer_steps: usize,
}

impl ServerShape {
    /// Server `s`'s HTTP port.
    pub fn http_port(&self, s: usize) -> u16 {
        self.http_base + s as u16
    }
    /// Server `s` rank `r`'s PUB port.
    pub fn pub_port(&self, s: usize, r: usize) -> u16 {
        self.pub_base + (s * self.dp + r) as u16
    }
    /// Server `s` rank `r`'s replay (ROUTER) port.
    pub fn replay_port(&self, s: usize, r: usize) -> u16 {
        self.replay_base + (s * self.dp + r) as u16
    }
    /// Refuse port ranges that overlap or pass 65535 for `servers` servers.
    pub fn check(&self, servers: usize) -> Result<(), String> {
        let ranges = [
            ("http", self.http_base as usize, servers),
            ("pub", self.pub_base as usize, servers * self.dp),
            ("replay", self.replay_base as usize, servers * self.dp),
        ];
        for (n, b, len) in ranges {
            if b == 0 || b + len > 65536 {
                return Err(format!("{n} ports {b}..{} pass 65535", b + len));
            }
        }
        for (i, a) in ranges.iter().enumerate() {
            for b in &ranges[i + 1..] {
                if a.1 < b.1 + b.2 && b.1 < a.1 + a.2 {
                    return Err(format!(
                        "{} ports {}..{} overlap {} ports {}..{}",
                        a.0,
                        a.1,
                        a.1 + a.2,
                        b.0,
                        b.1,
                        b.1 + b.2
                    ));
                }
            }
        }
        Ok(())
    }
}

/// `GET /get_server_info` of server `s`: SGLang 0.5.23's `kv_events` descriptor (port bases,
/// `dp_size` publishers, `block_size`) and the `kv_events_config` argument echo older servers
/// have, both naming rank 0's ports (rank r = base + r).
pub fn server_info(shape: &ServerShape, s: usize) -> Value {
    let cfg = json!({
        "publisher": "zmq",
        "endpoint": format!("tcp://*:{}", shape.pub_port(s, 0)),
        "replay_endpoint": format!("tcp://*:{}", shape.replay_port(s, 0)),
        "buffer_steps": shape.buffer_steps, "hwm": 100_000, "max_queue_size": 100_000, "topic": "",
    });
    json!({
        "model_path": shape.model, "tokenizer_path": shape.model, "served_model_name": shape.model,
        "host": "127.0.0.1", "port": shape.http_port(s), "tp_size": shape.dp, "dp_size": shape.dp,
        "enable_dp_attention": shape.dp > 1, "pp_size": 1, "ep_size": 1,
        "page_size": shape.block_size, "max_running_requests": 256, "max_total_tokens": 1 << 20,
        "context_length": 131_072, "schedule_policy": "fcfs", "disable_radix_cache": false,
        "enable_metrics": true, "enable_cache_report": true,
        "kv_events_config": cfg.to_string(),
        "kv_events": {
            "publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": shape.pub_port(s, 0),
            "replay_endpoint_port_base": shape.replay_port(s, 0), "topic": "",
            "block_size": shape.block_size, "dp_size": shape.dp,
        },
        "version": "0.5.23-fleet",
    })
}

/// `GET /v1/models`.
pub fn models(shape: &ServerShape) -> Value {
    json!({"object": "list", "data": [{
        "id": shape.model, "object": "model", "created": 0, "owned_by": "sglang",
        "root": shape.model, "parent": null, "max_model_len": 131_072,
    }]})
}

/// `GET /get_model_info`.
pub fn model_info(shape: &ServerShape) -> Value {
    json!({
        "model_path": shape.model, "tokenizer_path": shape.model, "is_generation": true,
        "served_model_name": shape.model, "model_type": "llama",
        "architectures": ["LlamaForCausalLM"], "weight_version": "default",
    })
}

/// `GET /metrics`: a minimal, valid SGLang exposition (an idle server).
pub fn metrics(shape: &ServerShape) -> String {
    let mut t = String::new();
    for (name, kind) in [
        ("num_running_reqs", "gauge"),
        ("num_queue_reqs", "gauge"),
        ("token_usage", "gauge"),
        ("cache_hit_rate", "gauge"),
    ] {
        t.push_str(&format!(
            "# HELP sglang:{name} {name}\n# TYPE sglang:{name} {kind}\n"
        ));
        for r in 0..shape.dp {
            t.push_str(&format!(
                "sglang:{name}{{dp_rank=\"{r}\",model_name=\"{}\"}} 0.0\n",
                shape.model
            ));
        }
    }
    t
}

/// The text an inference answer of server `s` carries.
pub fn name_of(s: usize) -> String {
    format!("s{s}")
}

/// `POST /generate` of server `s` (non-streamed): SGLang's shape, one token.
pub fn generate(s: usize) -> Value {
    json!({
        "text": name_of(s), "output_ids": [1],
        "meta_info": {"id": "fleet", "finish_reason": {"type": "length", "length": 1},
                      "prompt_tokens": 0, "completion_tokens": 1, "cached_tokens": 0,
                      "e2e_latency": 0.0},
    })
}

/// `POST /v1/completions` of server `s` (non-streamed).
pub fn completion(shape: &ServerShape, s: usize) -> Value {
    json!({
        "id": "cmpl-fleet", "object": "text_completion", "created": 0, "model": shape.model,
        "choices": [{"index": 0, "text": name_of(s), "logprobs": null, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1},
    })
}

/// `POST /v1/chat/completions` of server `s` (non-streamed).
pub fn chat(shape: &ServerShape, s: usize) -> Value {
    json!({
        "id": "chatcmpl-fleet", "object": "chat.completion", "created": 0, "model": shape.model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": name_of(s)},
                     "finish_reason": "length"}],
        "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1},
    })
}

/// The answer of server `s` to `method path`: status, content type, body.
pub fn answer(
    shape: &ServerShape,
    s: usize,
    method: &str,
    path: &str,
) -> (u16, &'static str, Vec<u8>) {
    const JSON: &str = "application/json";
    let path = path.split('?').next().unwrap_or(path);
    let js = |v: Value| (200, JSON, v.to_string().into_bytes());
    match (method, path) {
        ("GET", "/health" | "/health_generate") => (200, "text/plain", Vec::new()),
        ("GET", "/get_server_info" | "/server_info") => js(server_info(shape, s)),
        ("GET", "/get_model_info" | "/model_info") => js(model_info(shape)),
        ("GET", "/v1/models") => js(models(shape)),
        ("GET", "/metrics") => (
            200,
            "text/plain; version=0.0.4; charset=utf-8",
            metrics(shape).into_bytes(),
        ),
        ("GET", "/get_load") => {
            js(json!([{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]))
        }
        ("POST", "/generate") => js(generate(s)),
        ("POST", "/v1/completions") => js(completion(shape, s)),
        ("POST", "/v1/chat/completions") => js(chat(shape, s)),
        ("POST" | "GET", "/flush_cache") => (200, "text/plain", Vec::new()),
        ("POST", "/abort_request") => (200, JSON, Vec::new()),
        _ => (404, JSON, br#"{"error":"not found"}"#.to_vec()),
    }
}

/// One complete request at the start of `buf`: `(method, path, close, bytes used)`; `None`
/// until the head and its body are all in. Bodies by Content-Length or chunked.
pub fn parse_request(buf: &[u8]) -> Option<Result<(String, String, bool, usize), String>> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = match std::str::from_utf8(&buf[..end]) {
        Ok(h) => h,
        Err(_) => return Some(Err("head is not UTF-8".into())),
    };
    let mut lines = head.split("\r\n");
    let mut first = lines.next().unwrap_or("").split(' ');
    let (Some(method), Some(path)) = (first.next(), first.next()) else {
        return Some(Err("bad request line".into()));
    };
    let mut len = 0usize;
    let mut chunked = false;
    let mut close = first.next() == Some("HTTP/1.0");
    for l in lines {
        let Some((k, v)) = l.split_once(':') else {
            continue;
        };
        let v = v.trim();
        if k.eq_ignore_ascii_case("content-length") {
            match v.parse() {
                Ok(n) => len = n,
                Err(_) => return Some(Err("bad content-length".into())),
            }
        } else if k.eq_ignore_ascii_case("transfer-encoding") {
            chunked = v.eq_ignore_ascii_case("chunked");
        } else if k.eq_ignore_ascii_case("connection") {
            close = v.eq_ignore_ascii_case("close");
        }
    }
    let used = if chunked {
        let tail = buf[end..].windows(5).position(|w| w == b"0\r\n\r\n")?;
        end + tail + 5
    } else {
        if buf.len() < end + len {
            return None;
        }
        end + len
    };
    Some(Ok((method.to_owned(), path.to_owned(), close, used)))
}

/// An HTTP/1.1 response.
pub fn response(status: u16, ctype: &str, body: &[u8], close: bool, out: &mut Vec<u8>) {
    let reason = match status {
        200 => "OK",
        404 => "Not Found",
        _ => "Bad Request",
    };
    out.extend_from_slice(
        format!(
            "HTTP/1.1 {status} {reason}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\n{}\r\n",
            body.len(),
            if close { "connection: close\r\n" } else { "" }
        )
        .as_bytes(),
    );
    out.extend_from_slice(body);
}

/// Counters of the HTTP side.
#[derive(Debug, Default)]
pub struct HttpStats {
    /// Requests answered.
    pub requests: AtomicU64,
    /// Inference requests answered.
    pub inference: AtomicU64,
}

struct Conn {
    fd: RawFd,
    server: usize,
    inb: Vec<u8>,
    out: Vec<u8>,
    close: bool,
}

const LISTENER: u64 = 1 << 62;

/// Bind a listener per server of `servers` (global indices). Errors name the port.
pub fn bind(shape: &ServerShape, servers: &[usize]) -> std::io::Result<Vec<RawFd>> {
    servers
        .iter()
        .map(|&s| {
            let port = shape.http_port(s);
            sys::listen(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)).map_err(|e| {
                std::io::Error::new(e.kind(), format!("http listener 127.0.0.1:{port}: {e}"))
            })
        })
        .collect()
}

/// Serve the listeners (`listeners[i]` is server `servers[i]`'s) until `stop`.
pub fn serve(
    shape: ServerShape,
    servers: Vec<usize>,
    listeners: Vec<RawFd>,
    stop: Arc<AtomicBool>,
    stats: Arc<HttpStats>,
) -> std::io::Result<()> {
    let mut ep = Epoll::new()?;
    for (i, &fd) in listeners.iter().enumerate() {
        ep.add(fd, LISTENER | i as u64, sys::IN)?;
    }
    let mut conns: Vec<Option<Conn>> = Vec::new();
    let mut free: Vec<usize> = Vec::new();
    let mut events = sys::event_buffer(256);
    let mut buf = vec![0u8; 64 << 10];
    while !stop.load(Ordering::Relaxed) {
        let n = ep.wait(&mut events, Some(100_000_000))?;
        for e in &events[..n] {
            let (token, ev) = (e.u64, e.events);
            if token & LISTENER != 0 {
                let i = (token & !LISTENER) as usize;
                while let Ok(Some(fd)) = sys::accept(listeners[i]) {
                    let slot = free.pop().unwrap_or_else(|| {
                        conns.push(None);
                        conns.len() - 1
                    });
                    if ep.add(fd, slot as u64, sys::IN).is_err() {
                        sys::close(fd);
                        free.push(slot);
                        continue;
                    }
                    conns[slot] = Some(Conn {
                        fd,
                        server: servers[i],
                        inb: Vec::new(),
                        out: Vec::new(),
                        close: false,
                    });
                }
                continue;
            }
            let slot = token as usize;
            let Some(c) = conns.get_mut(slot).and_then(|c| c.as_mut()) else {
                continue;
            };
            let mut dead = false;
            if ev & sys::IN != 0 || ev & sys::HUP != 0 {
                loop {
                    match sys::read(c.fd, &mut buf) {
                        Io::Done(k) => c.inb.extend_from_slice(&buf[..k]),
                        Io::Again => break,
                        Io::Closed | Io::Failed(_) => {
                            dead = true;
                            break;
                        }
                    }
                }
                while let Some(p) = parse_request(&c.inb) {
                    match p {
                        Ok((method, path, close, used)) => {
                            let (st, ct, body) = answer(&shape, c.server, &method, &path);
                            response(st, ct, &body, close, &mut c.out);
                            stats.requests.fetch_add(1, Ordering::Relaxed);
                            if method == "POST" {
                                stats.inference.fetch_add(1, Ordering::Relaxed);
                            }
                            c.inb.drain(..used);
                            c.close |= close;
                        }
                        Err(_) => {
                            response(400, "text/plain", b"", true, &mut c.out);
                            c.inb.clear();
                            c.close = true;
                        }
                    }
                    if c.close {
                        break;
                    }
                }
            }
            if !c.out.is_empty() {
                loop {
                    match sys::write(c.fd, &c.out) {
                        Io::Done(k) => {
                            c.out.drain(..k);
                            if c.out.is_empty() {
                                break;
                            }
                        }
                        Io::Again => break,
                        Io::Closed | Io::Failed(_) => {
                            dead = true;
                            break;
                        }
                    }
                }
                let want = if c.out.is_empty() {
                    sys::IN
                } else {
                    sys::IN | sys::OUT
                };
                let _ = ep.modify(c.fd, slot as u64, want);
            }
            if dead || (c.close && c.out.is_empty()) {
                sys::close(c.fd);
                conns[slot] = None;
                free.push(slot);
            }
        }
    }
    for c in conns.into_iter().flatten() {
        sys::close(c.fd);
    }
    for fd in listeners {
        sys::close(fd);
    }
    Ok(())
}

#[cfg(test)]
mod tests;
