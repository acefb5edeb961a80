//! One client connection: the keep-alive loop. Reads a head (header timeout from its first
//! byte, idle timeout between requests), decides on the head alone where it goes, whether its
//! key is good and how large a body it may carry (refusals are answered at once, without
//! `100 Continue` and without reading the body), reads the body (Content-Length or chunked,
//! within a whole-body deadline), dispatches, and keeps leftover bytes so pipelined requests
//! are answered in order. Any error that ends the connection is answered with its status and a
//! lingering close; other connections never notice.
//!
//! Each connection holds a [`Slot`] in its core's `Connections` table (`connections`), which
//! sheds the longest-idle keep-alive connection first at `--max-connections-per-core`.

use super::admin::{self, Endpoint};
use super::buffer;
use super::connections::Slot;
use super::error::GatewayError;
use super::exchange::{self, Forwarding};
use super::reply::send_error;
use super::routes::{route, Route};
use super::Outcome;
use crate::gateway::{Core, Gateway};
use crate::http::{self, BodyFraming, ChunkError, ChunkedDecoder, HeadLimits, RequestHead};
use crate::proxy::io::{linger_close, read_expecting, read_into, write_all, Linger, READ_CHUNK};
use bytes::{Buf, Bytes, BytesMut};
use monoio::net::TcpStream;
use monoio::time::Instant;
use std::rc::Rc;
use std::time::Duration;

/// Lingering close after an error reply: long enough for a client to finish writing a body
/// it had already started (loopback or LAN: milliseconds), short enough that a client
/// trickling bytes holds the connection only briefly.
const ERROR_LINGER: Linger = Linger {
    total: Duration::from_secs(2),
    idle: Duration::from_millis(500),
};

/// Lingering close for a connection refused at the cap: it has sent at most a request head.
const REFUSAL_LINGER: Linger = Linger {
    total: Duration::from_millis(500),
    idle: Duration::from_millis(100),
};

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

/// Serve one accepted connection until it closes. `slot` is its place in the core's
/// [`Connections`]; the connection closes when the table sheds it while idle.
pub async fn serve(core: Rc<Core>, mut stream: TcpStream, slot: Slot) {
    let _ = stream.set_nodelay(true);
    let gw = core.gw.clone();
    crate::metrics::connection_opened();
    let limits = HeadLimits::default();
    let client = &gw.settings.client;
    let header_timeout = client.header_timeout;
    let idle_timeout = client.keepalive_timeout;
    let pace = BodyPace {
        grace: header_timeout,
        min_rate: client.min_body_rate,
        cap: client.request_timeout,
    };
    let mut buf = BytesMut::with_capacity(8 * 1024);
    let mut linger = false;
    let mut ahead = 0;
    // Read once: the keyless local mode asks where a control call comes from.
    let peer = stream.peer_addr().ok().map(|a| a.ip());
    loop {
        let waits = Waits {
            header: header_timeout,
            idle: idle_timeout,
            slot: &slot,
        };
        let head = match read_head(&mut stream, &mut buf, &limits, waits, ahead).await {
            Ok(h) => h,
            Err(fail) => {
                linger = answer(&mut stream, fail).await;
                break;
            }
        };
        let (handler, body_limit) = match decide(&gw, &head, peer) {
            Ok(d) => d,
            Err(e) => {
                let outcome = send_error(&mut stream, Some(&head), &e, None).await;
                crate::metrics::http_request(head.path(), e.status, Duration::ZERO);
                if outcome.keep_alive && !gw.life.is_shutting_down() {
                    continue;
                }
                linger = e.close;
                break;
            }
        };
        // Only a request that passed its key check keeps the core spinning for it.
        core.busy.touch();
        let body = match read_body(&mut stream, &mut buf, &head, body_limit, pace).await {
            Ok(b) => b,
            Err(fail) => {
                linger = answer(&mut stream, fail).await;
                break;
            }
        };
        ahead = buffer::read_ahead(head.buf.len() + body.len());
        // Boxed: a request's phases (several KiB of future state) live on the heap while it
        // runs, so a connection between requests holds only this loop's few hundred bytes,
        // not room for the largest request it might make (thousands of idle keep-alive
        // connections per core). One allocation a request.
        let outcome = Box::pin(dispatch(&core, &mut stream, &head, body, handler)).await;
        core.busy.touch();
        // An HTTP/1.0 client always gets the close as the end of an answer (it may not frame it).
        if !outcome.keep_alive || !head.keep_alive || head.is_http10() || gw.life.is_shutting_down()
        {
            break;
        }
    }
    if linger {
        linger_close(&mut stream, &mut buf, ERROR_LINGER).await;
    }
    crate::metrics::connection_closed();
}

/// Answer a request that could not be read (nothing when the peer is gone). True when an
/// answer was written: the connection then closes with a linger.
async fn answer(stream: &mut TcpStream, fail: ReadFail) -> bool {
    match fail {
        ReadFail::Gone => false,
        ReadFail::Reply(e) => {
            send_error(stream, None, &e, None).await;
            true
        }
    }
}

/// Answer a connection accepted over `--max-connections-per-core` with 503 and close it.
pub async fn refuse_over_cap(mut stream: TcpStream) {
    let e = GatewayError::framing(
        503,
        "too many connections to this gateway core; retry on a new connection",
    );
    send_error(&mut stream, None, &e, None).await;
    let mut scratch = BytesMut::new();
    linger_close(&mut stream, &mut scratch, REFUSAL_LINGER).await;
}

/// What the head alone decides: the route and the largest body it may carry, or the refusal
/// (404, 405, 401, 403) answered before any body byte is read. A refused request that declared a
/// body closes the connection (the unread body is no request boundary), so no `100 Continue`
/// is ever sent for it and nothing of its upload is buffered.
fn decide(
    gw: &Gateway,
    head: &RequestHead,
    peer: Option<std::net::IpAddr>,
) -> Result<(Handler, u64), GatewayError> {
    let refuse = |mut e: GatewayError| {
        e.close = !matches!(head.framing, BodyFraming::None | BodyFraming::Length(0));
        e
    };
    let r = route(head.method_kind(), head.path());
    let handler = match r {
        Route::Proxy(f) => Handler::Proxy(f),
        Route::Local(ep) => Handler::Local(ep),
        Route::NotFound => {
            let msg = format!("no route for {}", String::from_utf8_lossy(head.path()));
            return Err(refuse(GatewayError::not_found(msg)));
        }
        Route::MethodNotAllowed => {
            let msg = format!(
                "method {} not allowed on {}",
                String::from_utf8_lossy(head.method()),
                String::from_utf8_lossy(head.path())
            );
            return Err(refuse(GatewayError::method_not_allowed(msg)));
        }
    };
    if let Some(scope) = r.scope() {
        if let Err(no) = gw.auth.authorize(head, scope, peer) {
            return Err(refuse(GatewayError::new(no.status, no.message)));
        }
    }
    Ok((handler, r.body_limit(gw.settings.client.max_payload_size)))
}

/// Who answers a request that passed `decide`.
#[derive(Debug, Clone, Copy)]
enum Handler {
    Proxy(Forwarding),
    Local(Endpoint),
}

/// What `read_head` waits for: the head deadline, the idle keep-alive deadline, and the shed
/// signal of this connection's slot.
struct Waits<'a> {
    header: Duration,
    idle: Duration,
    slot: &'a Slot,
}

async fn read_head(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    limits: &HeadLimits,
    waits: Waits<'_>,
    ahead: usize,
) -> Result<RequestHead, ReadFail> {
    // The header deadline runs from the first byte of this head, so a client trickling one
    // byte a second is cut off, while an idle keep-alive connection gets the idle timeout.
    let mut header_deadline = (!buf.is_empty()).then(|| Instant::now() + waits.header);
    buffer::make_room(buf, ahead);
    loop {
        match http::parse_request_head(buf, limits) {
            Ok(Some(head)) => {
                waits.slot.busy();
                return Ok(head);
            }
            Ok(None) => {}
            Err(e) => return Err(ReadFail::reply(e.status(), e.message().to_string())),
        }
        let read = match header_deadline {
            Some(d) => read_into(stream, buf, Some(d)).await,
            None => {
                // Idle: no byte of the next request yet. The core may shed this connection
                // for a new one (it is the one whose loss costs nobody a request).
                waits.slot.idle();
                let deadline = Instant::now() + waits.idle;
                monoio::select! {
                    r = read_into(stream, buf, Some(deadline)) => r,
                    _ = waits.slot.shed() => return Err(ReadFail::Gone),
                }
            }
        };
        match read {
            Ok(0) => {
                return Err(if buf.is_empty() {
                    ReadFail::Gone
                } else {
                    ReadFail::reply(400, "connection closed inside the request head")
                })
            }
            Ok(_) => {
                if header_deadline.is_none() {
                    waits.slot.busy();
                    header_deadline = Some(Instant::now() + waits.header);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut && header_deadline.is_some() => {
                return Err(ReadFail::reply(408, "request head not received in time"))
            }
            Err(_) => return Err(ReadFail::Gone),
        }
    }
}

/// How long a request body may take: `grace` (`--header-timeout-secs`) plus one second per
/// `min_rate` (`--min-body-bytes-per-second`) bytes, never more than `cap`
/// (`--request-timeout-secs`). A per-read timeout alone lets a client trickling one byte just
/// inside it hold a connection for days.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BodyPace {
    /// Time allowed on top of the transfer at `min_rate` (and the longest pause between reads).
    grace: Duration,
    /// Slowest acceptable average rate, bytes per second (0: no minimum).
    min_rate: u64,
    /// Longest time any body may take.
    cap: Duration,
}

impl BodyPace {
    /// Time allowed, from the end of the head, for the first `bytes` bytes of a body.
    pub fn allowance(&self, bytes: u64) -> Duration {
        if self.min_rate == 0 {
            return self.cap;
        }
        let millis = bytes.saturating_mul(1000) / self.min_rate;
        self.grace
            .saturating_add(Duration::from_millis(millis))
            .min(self.cap)
    }
}

async fn read_body(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    head: &RequestHead,
    max_payload: u64,
    pace: BodyPace,
) -> Result<Bytes, ReadFail> {
    let too_large = || {
        ReadFail::reply(
            413,
            format!("request body exceeds the limit of {max_payload} bytes for this endpoint"),
        )
    };
    let started = Instant::now();
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
            buffer::reserve_body(buf, n);
            let whole = started + pace.allowance(n as u64);
            while buf.len() < n {
                read_body_bytes(stream, buf, pace, whole, n - buf.len()).await?;
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
            // Wire bytes so far: the length is unknown, so the deadline grows with what came.
            let mut received = buf.len() as u64;
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
                let whole = started + pace.allowance(received);
                received += read_body_bytes(stream, buf, pace, whole, READ_CHUNK).await? as u64;
            }
        }
    }
}

/// One read of request-body bytes (`expected` more to come): EOF → 400; nothing within
/// `pace.grace`, or `whole` (the body's deadline) passed → 408.
async fn read_body_bytes(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    pace: BodyPace,
    whole: Instant,
    expected: usize,
) -> Result<usize, ReadFail> {
    let pause = Instant::now() + pace.grace;
    match read_expecting(stream, buf, Some(pause.min(whole)), expected).await {
        Ok(0) => Err(ReadFail::reply(
            400,
            "connection closed inside the request body",
        )),
        Ok(n) => Ok(n),
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => Err(if whole < pause {
            ReadFail::reply(
                408,
                format!(
                    "request body arrived slower than {} bytes per second",
                    pace.min_rate
                ),
            )
        } else {
            ReadFail::reply(408, "request body not received in time")
        }),
        Err(_) => Err(ReadFail::Gone),
    }
}

async fn dispatch(
    core: &Rc<Core>,
    stream: &mut TcpStream,
    head: &RequestHead,
    body: Bytes,
    handler: Handler,
) -> Outcome {
    let gw = &core.gw;
    let started = Instant::now();
    let _active = gw.life.request_started();
    let outcome = match handler {
        Handler::Proxy(Forwarding::Routed(api)) if gw.decode.is_some() => {
            super::pd::handle(core, stream, head, body, api).await
        }
        Handler::Proxy(forwarding) => exchange::handle(core, stream, head, body, forwarding).await,
        Handler::Local(ep) => admin::handle(core, stream, head, body, ep).await,
    };
    crate::metrics::http_request(head.path(), outcome.status, started.elapsed());
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_deadline_is_grace_plus_rate_capped_by_the_request_timeout() {
        let pace = BodyPace {
            grace: Duration::from_secs(10),
            min_rate: 1000,
            cap: Duration::from_secs(60),
        };
        assert_eq!(pace.allowance(0), Duration::from_secs(10));
        assert_eq!(pace.allowance(5_000), Duration::from_secs(15));
        assert_eq!(pace.allowance(1500), Duration::from_millis(11_500));
        assert_eq!(pace.allowance(u64::MAX), Duration::from_secs(60));
        let no_minimum = BodyPace {
            min_rate: 0,
            ..pace
        };
        assert_eq!(no_minimum.allowance(1), Duration::from_secs(60));
    }
}
