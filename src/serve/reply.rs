//! The one writer of responses the gateway makes itself: local endpoints' answers and every
//! [`GatewayError`]. Each is rendered into one buffer and written with one deadline.

use super::error::GatewayError;
use super::Outcome;
use crate::http::response::{error_body, render};
use crate::http::RequestHead;
use crate::proxy::io::write_all_by;
use monoio::net::TcpStream;
use monoio::time::Instant;
use std::time::Duration;

/// How long the gateway tries to deliver one of its own responses.
pub const REPLY_WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// A complete local answer: status, content type and body.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    /// HTTP status.
    pub status: u16,
    content_type: &'static str,
    body: Vec<u8>,
    /// `Retry-After` seconds (refusals under overload).
    retry_after: Option<u32>,
}

impl Reply {
    /// A JSON answer.
    pub fn json(status: u16, body: &serde_json::Value) -> Reply {
        Reply {
            status,
            content_type: "application/json",
            // Serialising a `Value` cannot fail (its map keys are strings).
            body: serde_json::to_vec(body).unwrap_or_default(),
            retry_after: None,
        }
    }

    /// A JSON answer already rendered (a worker's body passed on unchanged).
    pub fn raw_json(status: u16, body: Vec<u8>) -> Reply {
        Reply {
            status,
            content_type: "application/json",
            body,
            retry_after: None,
        }
    }

    /// A plain-text answer.
    pub fn text(status: u16, body: &str) -> Reply {
        Reply {
            status,
            content_type: "text/plain",
            body: body.as_bytes().to_vec(),
            retry_after: None,
        }
    }

    /// A binary answer (the KV index snapshot a sibling copy downloads).
    pub fn bytes(status: u16, body: Vec<u8>) -> Reply {
        Reply {
            status,
            content_type: "application/octet-stream",
            body,
            retry_after: None,
        }
    }

    /// A Prometheus text exposition (`GET /engine_metrics`).
    pub fn exposition(body: &[u8]) -> Reply {
        Reply {
            status: 200,
            content_type: "text/plain; version=0.0.4; charset=utf-8",
            body: body.to_vec(),
            retry_after: None,
        }
    }

    /// The response bytes, with `x-request-id` when known and `connection: close` when `close`.
    pub fn render(&self, request_id: Option<&str>, close: bool) -> bytes::Bytes {
        let mut seconds = itoa::Buffer::new();
        let mut headers: [(&str, &str); 2] = [("", ""); 2];
        let mut n = 0;
        if let Some(id) = request_id {
            headers[n] = ("x-request-id", id);
            n += 1;
        }
        if let Some(s) = self.retry_after {
            headers[n] = ("retry-after", seconds.format(s));
            n += 1;
        }
        render(
            self.status,
            self.content_type,
            &headers[..n],
            &self.body,
            close,
        )
    }

    /// The OpenAI-style body of `e`.
    pub fn error(e: &GatewayError) -> Reply {
        Reply {
            status: e.status,
            content_type: "application/json",
            body: error_body(e.status, e.kind(), &e.message),
            retry_after: e.retry_after,
        }
    }
}

/// Write `reply` (with `x-request-id` when known). The connection may go on only when the
/// client wants it, `close` is not set and the write succeeded.
pub async fn send(
    stream: &mut TcpStream,
    reply: &Reply,
    request_id: Option<&str>,
    keep_alive: bool,
    close: bool,
) -> Outcome {
    let keep = keep_alive && !close;
    let bytes = reply.render(request_id, !keep);
    let written = write_all_by(stream, bytes, Instant::now() + REPLY_WRITE_TIMEOUT)
        .await
        .is_ok();
    Outcome {
        status: reply.status,
        keep_alive: written && keep,
    }
}

/// Write `e` for the request `head` (its keep-alive wish honoured unless `e` must close).
pub async fn send_error(
    stream: &mut TcpStream,
    head: Option<&RequestHead>,
    e: &GatewayError,
    request_id: Option<&str>,
) -> Outcome {
    let keep_alive = head.is_some_and(|h| h.keep_alive);
    send(stream, &Reply::error(e), request_id, keep_alive, e.close).await
}
