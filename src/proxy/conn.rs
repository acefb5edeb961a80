//! One client connection: the keep-alive loop. Reads a head (header timeout from its first
//! byte, idle timeout between requests), reads the body (Content-Length or chunked, with
//! `100 Continue` and the payload limit), dispatches, and keeps leftover bytes so pipelined
//! requests are answered in order. Any framing error is answered with its status and a close;
//! other connections never notice.

use crate::admin;
use crate::gateway::Core;
use crate::http::{self, BodyFraming, ChunkError, ChunkedDecoder, HeadLimits, RequestHead};
use crate::proxy::inference;
use crate::proxy::io::{read_into, send_error, write_all};
use crate::route::extract::Api;
use bytes::{Buf, Bytes, BytesMut};
use monoio::net::TcpStream;
use monoio::time::Instant;
use std::rc::Rc;
use std::time::Duration;

/// Why a request could not be read; each ends the connection after an error response
/// (or silently, when the peer is gone).
enum ReadFail {
    /// Peer closed or the connection broke: nothing to answer.
    Gone,
    /// Answer this status and message, then close.
    Reply(u16, String),
}

/// Serve one accepted connection until it closes.
pub async fn serve(core: Rc<Core>, mut stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let gw = core.gw.clone();
    gw.metrics.connection_opened();
    let limits = HeadLimits::default();
    let header_timeout = Duration::from_secs(gw.cfg.header_timeout_secs);
    let idle_timeout = Duration::from_secs(gw.cfg.keepalive_timeout_secs);
    let mut buf = BytesMut::with_capacity(8 * 1024);
    loop {
        let head =
            match read_head(&mut stream, &mut buf, &limits, header_timeout, idle_timeout).await {
                Ok(h) => h,
                Err(ReadFail::Gone) => break,
                Err(ReadFail::Reply(status, msg)) => {
                    reply_error_and_close(&mut stream, status, &msg).await;
                    break;
                }
            };
        let body = match read_body(
            &mut stream,
            &mut buf,
            &head,
            gw.cfg.max_payload_size,
            header_timeout,
        )
        .await
        {
            Ok(b) => b,
            Err(ReadFail::Gone) => break,
            Err(ReadFail::Reply(status, msg)) => {
                reply_error_and_close(&mut stream, status, &msg).await;
                break;
            }
        };
        let keep_alive = dispatch(&core, &mut stream, &head, body).await;
        if !keep_alive || !head.keep_alive || gw.is_shutting_down() {
            break;
        }
    }
    gw.metrics.connection_closed();
}

async fn reply_error_and_close(stream: &mut TcpStream, status: u16, msg: &str) {
    let error_type = if status >= 500 {
        "server_error"
    } else {
        "invalid_request_error"
    };
    send_error(stream, status, error_type, msg, &[], true).await;
}

async fn read_head(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    limits: &HeadLimits,
    header_timeout: Duration,
    idle_timeout: Duration,
) -> Result<RequestHead, ReadFail> {
    // The header deadline runs from the first byte of this head, so a client trickling one
    // byte a second is cut off, while an idle keep-alive connection gets the idle timeout.
    let mut header_deadline = (!buf.is_empty()).then(|| Instant::now() + header_timeout);
    loop {
        match http::parse_request_head(buf, limits) {
            Ok(Some(head)) => return Ok(head),
            Ok(None) => {}
            Err(e) => return Err(ReadFail::Reply(e.status(), e.message().to_string())),
        }
        let deadline = match header_deadline {
            Some(d) => d,
            None => Instant::now() + idle_timeout,
        };
        match read_into(stream, buf, Some(deadline)).await {
            Ok(0) => {
                return Err(if buf.is_empty() {
                    ReadFail::Gone
                } else {
                    ReadFail::Reply(400, "connection closed inside the request head".into())
                })
            }
            Ok(_) => {
                if header_deadline.is_none() {
                    header_deadline = Some(Instant::now() + header_timeout);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut && header_deadline.is_some() => {
                return Err(ReadFail::Reply(
                    408,
                    "request head not received in time".into(),
                ))
            }
            Err(_) => return Err(ReadFail::Gone),
        }
    }
}

async fn read_body(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    head: &RequestHead,
    max_payload: u64,
    read_timeout: Duration,
) -> Result<Bytes, ReadFail> {
    let too_large = || {
        ReadFail::Reply(
            413,
            format!("request body exceeds the limit of {max_payload} bytes"),
        )
    };
    match head.framing {
        BodyFraming::None | BodyFraming::Close => Ok(Bytes::new()),
        BodyFraming::Length(n) => {
            if n > max_payload {
                return Err(too_large());
            }
            let n = n as usize;
            if head.expect_continue && buf.len() < n {
                write_all(stream, http::response::CONTINUE_100)
                    .await
                    .map_err(|_| ReadFail::Gone)?;
            }
            if buf.capacity() - buf.len() < n.saturating_sub(buf.len()) {
                buf.reserve(n - buf.len());
            }
            while buf.len() < n {
                read_body_bytes(stream, buf, read_timeout).await?;
            }
            Ok(buf.split_to(n).freeze())
        }
        BodyFraming::Chunked => {
            if head.expect_continue && buf.is_empty() {
                write_all(stream, http::response::CONTINUE_100)
                    .await
                    .map_err(|_| ReadFail::Gone)?;
            }
            let mut decoder = ChunkedDecoder::new(max_payload);
            let mut body = BytesMut::new();
            loop {
                let used = decoder.feed(buf, &mut body).map_err(|e| match e {
                    ChunkError::TooLarge => too_large(),
                    ChunkError::Malformed(m) => {
                        ReadFail::Reply(400, format!("bad chunked body: {m}"))
                    }
                })?;
                buf.advance(used);
                if decoder.is_done() {
                    return Ok(body.freeze());
                }
                read_body_bytes(stream, buf, read_timeout).await?;
            }
        }
    }
}

/// One read of request-body bytes: EOF → 400, no bytes within `read_timeout` → 408.
async fn read_body_bytes(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    read_timeout: Duration,
) -> Result<(), ReadFail> {
    match read_into(stream, buf, Some(Instant::now() + read_timeout)).await {
        Ok(0) => Err(ReadFail::Reply(
            400,
            "connection closed inside the request body".into(),
        )),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => Err(ReadFail::Reply(
            408,
            "request body not received in time".into(),
        )),
        Err(_) => Err(ReadFail::Gone),
    }
}

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Routed by the policy and proxied.
    Inference(Api),
    /// Proxied to one selectable worker, no routing text.
    PassThrough,
    /// Answered by the gateway itself.
    Local(admin::Endpoint),
    /// Known path, wrong method.
    MethodNotAllowed,
    NotFound,
}

/// Map method and path to a route.
pub fn route(method: &[u8], path: &[u8]) -> Route {
    let post = method == b"POST";
    let get = method == b"GET";
    let inference = |api| {
        if post {
            Route::Inference(api)
        } else {
            Route::MethodNotAllowed
        }
    };
    match path {
        b"/generate" => inference(Api::Generate),
        b"/v1/chat/completions" => inference(Api::Chat),
        b"/v1/completions" => inference(Api::Completions),
        b"/v1/embeddings" => inference(Api::Embeddings),
        b"/v1/rerank" | b"/rerank" => inference(Api::Rerank),
        b"/get_model_info" | b"/model_info" | b"/health_generate" => {
            if get {
                Route::PassThrough
            } else {
                Route::MethodNotAllowed
            }
        }
        _ => match admin::endpoint(method, path) {
            Some(Ok(e)) => Route::Local(e),
            Some(Err(())) => Route::MethodNotAllowed,
            None => Route::NotFound,
        },
    }
}

async fn dispatch(
    core: &Rc<Core>,
    stream: &mut TcpStream,
    head: &RequestHead,
    body: Bytes,
) -> bool {
    let gw = &core.gw;
    let started = Instant::now();
    gw.active_requests
        .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    let (status, keep) = match route(head.method(), head.path()) {
        Route::Inference(api) => inference::handle(core, stream, head, body, Some(api)).await,
        Route::PassThrough => inference::handle(core, stream, head, body, None).await,
        Route::Local(ep) => admin::handle(core, stream, head, body, ep).await,
        Route::MethodNotAllowed => {
            let msg = format!(
                "method {} not allowed on {}",
                String::from_utf8_lossy(head.method()),
                String::from_utf8_lossy(head.path())
            );
            (
                405,
                inference::reply_error(stream, head, 405, "invalid_request_error", &msg).await,
            )
        }
        Route::NotFound => {
            let msg = format!("no route for {}", String::from_utf8_lossy(head.path()));
            (
                404,
                inference::reply_error(stream, head, 404, "not_found_error", &msg).await,
            )
        }
    };
    gw.active_requests
        .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    gw.metrics
        .http_request(head.path(), status, started.elapsed());
    keep
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        assert_eq!(
            route(b"POST", b"/v1/chat/completions"),
            Route::Inference(Api::Chat)
        );
        assert_eq!(
            route(b"GET", b"/v1/chat/completions"),
            Route::MethodNotAllowed
        );
        assert_eq!(route(b"POST", b"/rerank"), Route::Inference(Api::Rerank));
        assert_eq!(route(b"GET", b"/get_model_info"), Route::PassThrough);
        assert_eq!(route(b"GET", b"/nope"), Route::NotFound);
        assert!(matches!(route(b"GET", b"/health"), Route::Local(_)));
    }
}
