//! A vLLM-shaped worker on raw TCP for tests whose counterpart is vLLM's HTTP surface rather than
//! the simulator's: no `/get_server_info` and no `/generate` (404, as vLLM 0.33), `/v1/models`
//! with adapter cards, `/kv_event_sources` announcing publishers (in tests, vLLM's own, run by
//! `tests/fixtures/vllm_publisher.py`), `/inference/v1/generate`.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

/// What a fake vLLM worker was asked: (path, body).
type Asked = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

/// A vLLM-shaped worker on raw TCP: `/health`, `/v1/models` (the given cards),
/// `/kv_event_sources` (the given body: what vLLM's own publishers say they are),
/// `/v1/completions` and `/inference/v1/generate` (JSON, or SSE when the body asks to
/// stream), each answer naming its port in `x-worker-port`; everything else 404, as vLLM has
/// no `/get_server_info`.
pub struct FakeVllm {
    /// Where it listens on 127.0.0.1.
    pub port: u16,
    asked: Asked,
    says: Arc<Says>,
}

impl FakeVllm {
    /// Serve `cards` as its `/v1/models` data and `sources` as its `/kv_event_sources`.
    pub fn start(cards: Value, sources: Value) -> FakeVllm {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let asked: Asked = Arc::default();
        let log = asked.clone();
        let says = Arc::new(Says {
            models: json!({"object": "list", "data": cards}).to_string(),
            sources: Mutex::new(sources.to_string()),
        });
        let serving = says.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { break };
                let (log, says) = (log.clone(), serving.clone());
                std::thread::spawn(move || serve_fake(conn, port, &log, &says));
            }
        });
        FakeVllm { port, asked, says }
    }

    /// From now on announce `sources` at `/kv_event_sources` (a server restarted with other
    /// publishers).
    pub fn announce(&self, sources: Value) {
        *self.says.sources.lock().unwrap() = sources.to_string();
    }

    /// The URL the gateway is given.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The bodies of the requests it was sent on `path`, in order.
    pub fn asked(&self, path: &str) -> Vec<Vec<u8>> {
        let a = self.asked.lock().unwrap();
        a.iter()
            .filter(|(p, _)| p == path)
            .map(|(_, b)| b.clone())
            .collect()
    }
}

/// What a [`FakeVllm`] answers about itself.
struct Says {
    models: String,
    sources: Mutex<String>,
}

/// One keep-alive connection of a [`FakeVllm`].
fn serve_fake(conn: TcpStream, port: u16, asked: &Asked, says: &Says) {
    let mut r = BufReader::new(conn.try_clone().unwrap());
    let mut w = conn;
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut parts = line.split_whitespace();
        let (method, path) = (
            parts.next().unwrap_or("").to_string(),
            parts.next().unwrap_or("").to_string(),
        );
        let mut len = 0usize;
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            if h == "\r\n" {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    len = v.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut body = vec![0; len];
        if r.read_exact(&mut body).is_err() {
            return;
        }
        asked.lock().unwrap().push((path.clone(), body.clone()));
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or(json!({}));
        let stream = v["stream"].as_bool() == Some(true);
        let (status, kind, answer) = match (method.as_str(), path.as_str()) {
            ("GET", "/health") => (200, "application/json", "{}".to_string()),
            ("GET", "/v1/models") => (200, "application/json", says.models.clone()),
            ("GET", "/kv_event_sources") => (
                200,
                "application/json",
                says.sources.lock().unwrap().clone(),
            ),
            ("POST", "/inference/v1/generate") if stream => (
                200,
                "text/event-stream",
                format!(
                    "data: {}\n\ndata: {}\n\ndata: [DONE]\n\n",
                    json!({"request_id": "r", "choices": [{"index": 0, "token_ids": [11]}]}),
                    json!({"request_id": "r", "choices": [{"index": 0, "token_ids": [12],
                        "finish_reason": "length"}]})
                ),
            ),
            ("POST", "/inference/v1/generate") => (
                200,
                "application/json",
                json!({"request_id": "r", "choices": [{"index": 0, "token_ids": [11, 12],
                    "finish_reason": "length"}]})
                .to_string(),
            ),
            ("POST", "/v1/completions") => (
                200,
                "application/json",
                json!({"id": "c", "object": "text_completion", "model": v["model"],
                    "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
                .to_string(),
            ),
            _ => (
                404,
                "application/json",
                r#"{"detail":"Not Found"}"#.to_string(),
            ),
        };
        let head = format!(
            "HTTP/1.1 {status} X\r\ncontent-type: {kind}\r\ncontent-length: {}\r\n\
             x-worker-port: {port}\r\n\r\n",
            answer.len()
        );
        if w.write_all(head.as_bytes()).is_err() || w.write_all(answer.as_bytes()).is_err() {
            return;
        }
    }
}
