//! One client connection: the keep-alive loop. Reads a head (header timeout from its first
//! byte, idle timeout between requests), reads the body (Content-Length or chunked, with
//! `100 Continue` and the payload limit), dispatches, and keeps leftover bytes so pipelined
//! requests are answered in order. Any framing error is answered with its status and a close;
//! other connections never notice.

use super::error::GatewayError;
use super::reply::send_error;
use super::routes::{route, Route};
use super::{admin, exchange, Outcome};
use crate::gateway::Core;
use crate::http::{self, BodyFraming, ChunkError, ChunkedDecoder, HeadLimits, RequestHead};
use crate::proxy::io::{read_into, write_all};
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
    /// Answer this (a framing error: the connection closes after it).
    Reply(GatewayError),
}

impl ReadFail {
    fn reply(status: u16, message: impl Into<std::borrow::Cow<'static, str>>) -> ReadFail {
        ReadFail::Reply(GatewayError::framing(status, message))
    }
}

/// Serve one accepted connection until it closes.
pub async fn serve(core: Rc<Core>, mut stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let gw = core.gw.clone();
    crate::metrics::connection_opened();
    let limits = HeadLimits::default();
    let header_timeout = Duration::from_secs(gw.cfg.header_timeout_secs);
    let idle_timeout = Duration::from_secs(gw.cfg.keepalive_timeout_secs);
    let mut buf = BytesMut::with_capacity(8 * 1024);
    loop {
        let head =
            match read_head(&mut stream, &mut buf, &limits, header_timeout, idle_timeout).await {
                Ok(h) => h,
                Err(ReadFail::Gone) => break,
                Err(ReadFail::Reply(e)) => {
                    send_error(&mut stream, None, &e, None).await;
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
            Err(ReadFail::Reply(e)) => {
                send_error(&mut stream, None, &e, None).await;
                break;
            }
        };
        let outcome = dispatch(&core, &mut stream, &head, body).await;
        // An HTTP/1.0 client always gets the close as the end of an answer (it may not frame it).
        if !outcome.keep_alive || !head.keep_alive || head.is_http10() || gw.life.is_shutting_down()
        {
            break;
        }
    }
    crate::metrics::connection_closed();
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
            Err(e) => return Err(ReadFail::reply(e.status(), e.message().to_string())),
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
                    ReadFail::reply(400, "connection closed inside the request head")
                })
            }
            Ok(_) => {
                if header_deadline.is_none() {
                    header_deadline = Some(Instant::now() + header_timeout);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut && header_deadline.is_some() => {
                return Err(ReadFail::reply(408, "request head not received in time"))
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
        ReadFail::reply(
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
                        ReadFail::reply(400, format!("bad chunked body: {m}"))
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
        Ok(0) => Err(ReadFail::reply(
            400,
            "connection closed inside the request body",
        )),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
            Err(ReadFail::reply(408, "request body not received in time"))
        }
        Err(_) => Err(ReadFail::Gone),
    }
}

async fn dispatch(
    core: &Rc<Core>,
    stream: &mut TcpStream,
    head: &RequestHead,
    body: Bytes,
) -> Outcome {
    let gw = &core.gw;
    let started = Instant::now();
    let _active = gw.life.request_started();
    let outcome = match route(head.method_kind(), head.path()) {
        Route::Proxy(forwarding) => exchange::handle(core, stream, head, body, forwarding).await,
        Route::Local(ep) => admin::handle(core, stream, head, body, ep).await,
        Route::MethodNotAllowed => {
            let msg = format!(
                "method {} not allowed on {}",
                String::from_utf8_lossy(head.method()),
                String::from_utf8_lossy(head.path())
            );
            send_error(stream, Some(head), &GatewayError::new(405, msg), None).await
        }
        Route::NotFound => {
            let msg = format!("no route for {}", String::from_utf8_lossy(head.path()));
            send_error(stream, Some(head), &GatewayError::new(404, msg), None).await
        }
    };
    crate::metrics::http_request(head.path(), outcome.status, started.elapsed());
    outcome
}
