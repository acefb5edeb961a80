//! Forwarding one request to a worker, in Pingora-like phases: connect (pooled, probed, one
//! silent retry on a fresh connection), send the head and the SAME body bytes, read the response
//! head. Relaying the body back is `relay`'s job; gateway-originated calls (`fetch`) read it
//! whole here.

use crate::http::{
    self, BodyFraming, ChunkedDecoder, HeadLimits, Method, RequestHead, ResponseHead,
};
use crate::proxy::io::{read_into, write_head_and_body_by};
use crate::proxy::pool::Pool;
use crate::workers::registry::Worker;
use bytes::{Buf, Bytes, BytesMut};
use monoio::net::TcpStream;
use monoio::time::Instant;
use std::fmt::Write as _;
use std::io;
use std::time::Duration;

/// Request headers that describe one hop, not the request; never forwarded upstream (nor are
/// the headers the client's `Connection` names). `host`, `content-length`, `x-request-id` and
/// `x-forwarded-for` are re-written by the gateway.
const REQUEST_SKIP: [&str; 12] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "expect",
    "host",
    "content-length",
    "x-request-id",
    "x-forwarded-for",
];

/// Whether header `name` is in `list` (ASCII case-insensitive).
pub(super) fn skip(name: &[u8], list: &[&str]) -> bool {
    list.iter().any(|s| name.eq_ignore_ascii_case(s.as_bytes()))
}

/// Whether header `name` is listed in one of the message's `Connection` fields (RFC 9110
/// §7.6.1: such headers belong to that hop only). Scans in place: no allocation.
pub(super) fn named_by_connection<'h>(
    name: &[u8],
    mut headers: impl Iterator<Item = (&'h [u8], &'h [u8])>,
) -> bool {
    headers.any(|(n, v)| {
        n.eq_ignore_ascii_case(b"connection")
            && http::head::list_elements(v).any(|t| !t.is_empty() && t.eq_ignore_ascii_case(name))
    })
}

/// A trace context the gateway sends upstream in place of the client's (`--enable-trace`, a
/// recorded request): the worker's spans then join the gateway's trace under the attempt span.
#[derive(Debug, Clone, Copy)]
pub struct TraceHeaders<'a> {
    /// The `traceparent` value naming the gateway's span as the parent.
    pub traceparent: &'a [u8],
    /// The `tracestate` sent in place of the client's: the client's as the gateway kept it
    /// (valid, at most 512 bytes) when its trace is continued; `None` when the gateway started
    /// a new trace (the client's state belongs to no trace) or kept none.
    pub tracestate: Option<&'a [u8]>,
}

/// What the gateway changes in a client's headers on their way to a worker, decided once at
/// start: the headers that are the gateway's own business never reach a worker, and a worker
/// that needs a key gets the one configured for it rather than the caller's.
#[derive(Debug, Clone, Default)]
pub struct OwnHeaders {
    /// Client headers not forwarded (lower-case names): the priority header, the trusted
    /// tenant header, and the caller's keys when the gateway checks keys itself.
    pub drop: Vec<String>,
    /// The `authorization` value sent instead of the client's (`--worker-api-key`).
    pub authorization: Option<String>,
}

impl OwnHeaders {
    /// The headers of a gateway that reads `priority` and `tenant` (its trusted tenant header,
    /// if any), checks callers' keys itself when `authenticates` (then they stop here unless
    /// `pass_keys`), and sends `worker_key` to the workers (replacing any caller's).
    pub fn new(
        priority: &str,
        tenant: Option<&str>,
        authenticates: bool,
        pass_keys: bool,
        worker_key: Option<&str>,
    ) -> OwnHeaders {
        let mut drop: Vec<String> = std::iter::once(priority)
            .chain(tenant)
            .map(str::to_ascii_lowercase)
            .collect();
        if (authenticates && !pass_keys) || worker_key.is_some() {
            drop.push("authorization".into());
        }
        if authenticates && !pass_keys {
            drop.push("x-api-key".into());
        }
        OwnHeaders {
            drop,
            authorization: worker_key.map(|k| format!("Bearer {k}")),
        }
    }

    /// The headers of a request the gateway sends on its own (no client's headers to drop):
    /// only `worker_key`, when set, as `authorization: Bearer <key>`.
    pub fn for_own_calls(worker_key: Option<&str>) -> OwnHeaders {
        OwnHeaders {
            drop: Vec::new(),
            authorization: worker_key.map(|k| format!("Bearer {k}")),
        }
    }

    fn drops(&self, name: &[u8]) -> bool {
        self.drop
            .iter()
            .any(|d| name.eq_ignore_ascii_case(d.as_bytes()))
    }
}

/// The upstream request bytes: head (and small bodies), then the body when large.
pub struct UpstreamRequest {
    pub head: Bytes,
    pub body: Bytes,
}

impl UpstreamRequest {
    /// Render the request for `worker`: the client's method and target, the end-to-end headers
    /// in order, then `host`, `content-length`, `x-request-id` and `x-forwarded-for` (the
    /// client's list with `peer` appended). With `trace`, the client's `traceparent` and
    /// `tracestate` are replaced by the gateway's (never sent twice); without it, headers pass
    /// unchanged. `own` takes out the gateway's own headers and sets the worker's key.
    #[allow(clippy::too_many_arguments)]
    pub fn build(
        method: &[u8],
        target: &[u8],
        client: Option<&RequestHead>,
        peer: Option<std::net::IpAddr>,
        authority: &str,
        request_id: &str,
        body: Bytes,
        trace: Option<TraceHeaders<'_>>,
        own: &OwnHeaders,
    ) -> UpstreamRequest {
        let mut out = BytesMut::with_capacity(256 + client.map_or(0, |h| h.buf.len()));
        out.extend_from_slice(method);
        out.extend_from_slice(b" ");
        out.extend_from_slice(target);
        out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
        out.extend_from_slice(authority.as_bytes());
        out.extend_from_slice(b"\r\n");
        if let Some(h) = client {
            for (name, value) in h.headers() {
                if skip(name, &REQUEST_SKIP)
                    || own.drops(name)
                    || named_by_connection(name, h.headers())
                {
                    continue;
                }
                if trace.is_some()
                    && (name.eq_ignore_ascii_case(b"traceparent")
                        || name.eq_ignore_ascii_case(b"tracestate"))
                {
                    continue;
                }
                out.extend_from_slice(name);
                out.extend_from_slice(b": ");
                out.extend_from_slice(value);
                out.extend_from_slice(b"\r\n");
            }
        }
        if !body.is_empty() || method != b"GET" {
            out.extend_from_slice(b"content-length: ");
            // Formatted straight into the buffer (no temporary String).
            let _ = write!(out, "{}", body.len());
            out.extend_from_slice(b"\r\n");
        }
        if let Some(a) = &own.authorization {
            out.extend_from_slice(b"authorization: ");
            out.extend_from_slice(a.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"x-request-id: ");
        out.extend_from_slice(request_id.as_bytes());
        out.extend_from_slice(b"\r\n");
        write_forwarded_for(&mut out, client, peer);
        if let Some(t) = trace {
            out.extend_from_slice(b"traceparent: ");
            out.extend_from_slice(t.traceparent);
            out.extend_from_slice(b"\r\n");
            if let Some(state) = t.tracestate {
                out.extend_from_slice(b"tracestate: ");
                out.extend_from_slice(state);
                out.extend_from_slice(b"\r\n");
            }
        }
        out.extend_from_slice(b"\r\n");
        // The body is never copied: head and body go out together in one vectored write.
        UpstreamRequest {
            head: out.freeze(),
            body,
        }
    }
}

/// `x-forwarded-for`: the client's own values (every such field, in order), then `peer`.
fn write_forwarded_for(
    out: &mut BytesMut,
    client: Option<&RequestHead>,
    peer: Option<std::net::IpAddr>,
) {
    let mut first = true;
    let mut item = |out: &mut BytesMut, v: &[u8]| {
        out.extend_from_slice(if first { b"x-forwarded-for: " } else { b", " });
        out.extend_from_slice(v);
        first = false;
    };
    for (name, value) in client.into_iter().flat_map(|h| h.headers()) {
        if name.eq_ignore_ascii_case(b"x-forwarded-for") && !value.is_empty() {
            item(out, value);
        }
    }
    if let Some(ip) = peer {
        let mut text = [0u8; 48];
        let mut cur = std::io::Cursor::new(&mut text[..]);
        let _ = std::io::Write::write_fmt(&mut cur, format_args!("{ip}"));
        let n = cur.position() as usize;
        item(out, &text[..n]);
    }
    if !first {
        out.extend_from_slice(b"\r\n");
    }
}

/// Why no response head came back from a worker.
#[derive(Debug)]
pub enum UpstreamError {
    /// TCP connect failed (refused, unreachable, timed out).
    Connect(io::Error),
    /// The gateway could not open a connection for reasons of its own (out of file
    /// descriptors, out of local ports, out of memory): says nothing about the worker.
    Local(io::Error),
    /// The whole-request deadline passed before the response head.
    Timeout,
    /// The connection broke before a complete response head.
    Io(io::Error),
    /// The worker sent something that is not an HTTP response.
    BadResponse(String),
}

impl UpstreamError {
    /// Status the client gets when this is the final outcome.
    pub fn status(&self) -> u16 {
        match self {
            UpstreamError::Timeout => 504,
            UpstreamError::Connect(e) if e.kind() == io::ErrorKind::TimedOut => 504,
            UpstreamError::Connect(_) => 502,
            UpstreamError::Local(_) => 503,
            UpstreamError::Io(_) | UpstreamError::BadResponse(_) => 502,
        }
    }
    /// A message for the JSON error body. It never names the worker (its address is internal
    /// topology); the gateway's log does.
    pub fn message(&self) -> String {
        match self {
            UpstreamError::Connect(e) => format!("cannot connect to a worker: {e}"),
            UpstreamError::Local(e) => {
                format!("the gateway cannot open a connection to a worker: {e}")
            }
            UpstreamError::Timeout => "the worker did not answer in time".to_string(),
            UpstreamError::Io(e) => format!("the connection to the worker failed: {e}"),
            UpstreamError::BadResponse(m) => format!("the worker sent an invalid response: {m}"),
        }
    }
    /// The failure in one word (a trace's `radixgate.retry_reason`, a label's value).
    pub fn kind(&self) -> &'static str {
        match self {
            UpstreamError::Connect(_) => "connect",
            UpstreamError::Local(_) => "local",
            UpstreamError::Timeout => "timeout",
            UpstreamError::Io(_) => "io",
            UpstreamError::BadResponse(_) => "bad_response",
        }
    }

    /// Whether the worker could not even be reached (passive health signal).
    pub fn is_connect(&self) -> bool {
        matches!(self, UpstreamError::Connect(_))
    }
    /// The gateway's own failure: neither the worker's health nor its circuit hears of it.
    pub fn is_local(&self) -> bool {
        matches!(self, UpstreamError::Local(_))
    }
}

/// A connect error that is the gateway's own fault: out of descriptors (EMFILE, ENFILE), of
/// local addresses or ports (EADDRNOTAVAIL, EADDRINUSE), or of kernel memory (ENOBUFS, ENOMEM).
pub fn is_local_error(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(
            libc::EMFILE
                | libc::ENFILE
                | libc::EADDRNOTAVAIL
                | libc::EADDRINUSE
                | libc::ENOBUFS
                | libc::ENOMEM
        )
    )
}

/// A response head from a worker, with the connection and any body bytes already read.
pub struct UpstreamResponse {
    pub stream: TcpStream,
    pub head: ResponseHead,
    pub leftover: BytesMut,
}

/// Open a TCP connection to `worker` (addresses in order) within `connect_timeout`.
pub async fn connect(
    worker: &Worker,
    connect_timeout: Duration,
    deadline: Instant,
) -> Result<TcpStream, UpstreamError> {
    let limit = std::cmp::min(Instant::now() + connect_timeout, deadline);
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
    for addr in &worker.addrs {
        match monoio::time::timeout_at(limit, TcpStream::connect_addr(*addr)).await {
            Ok(Ok(s)) => {
                let _ = s.set_nodelay(true);
                crate::metrics::upstream_connection("new");
                return Ok(s);
            }
            Ok(Err(e)) if is_local_error(&e) => return Err(UpstreamError::Local(e)),
            Ok(Err(e)) => last = e,
            Err(_) => last = io::Error::new(io::ErrorKind::TimedOut, "connect timed out"),
        }
    }
    Err(UpstreamError::Connect(last))
}

enum ExchangeError {
    /// Nothing came back: a reused connection may simply have been closed by the worker.
    NothingBack(io::Error),
    Other(UpstreamError),
}

async fn exchange_head(
    stream: &mut TcpStream,
    req: &UpstreamRequest,
    request_was_head: bool,
    deadline: Instant,
) -> Result<(ResponseHead, BytesMut), ExchangeError> {
    let timeout = |e: io::Error| {
        if e.kind() == io::ErrorKind::TimedOut {
            ExchangeError::Other(UpstreamError::Timeout)
        } else {
            ExchangeError::NothingBack(e)
        }
    };
    write_head_and_body_by(stream, req.head.clone(), req.body.clone(), deadline)
        .await
        .map_err(timeout)?;
    let mut buf = BytesMut::with_capacity(8 * 1024);
    let limits = HeadLimits::default();
    let mut received_any = false;
    loop {
        match http::parse_response_head(&mut buf, request_was_head, &limits) {
            Ok(Some(head)) => {
                if head.is_interim() {
                    continue; // informational; the real head follows
                }
                // The gateway forwards no `Upgrade`, so a switch of protocols is a broken
                // worker; its connection is dropped (never pooled).
                if head.status == 101 {
                    return Err(ExchangeError::Other(UpstreamError::BadResponse(
                        "unexpected 101 Switching Protocols".to_string(),
                    )));
                }
                return Ok((head, buf));
            }
            Ok(None) => {}
            Err(e) => {
                return Err(ExchangeError::Other(UpstreamError::BadResponse(
                    e.message().to_string(),
                )))
            }
        }
        match read_into(stream, &mut buf, Some(deadline)).await {
            Ok(0) if !received_any => {
                return Err(ExchangeError::NothingBack(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed before any response byte",
                )))
            }
            Ok(0) => {
                return Err(ExchangeError::Other(UpstreamError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed inside the response head",
                ))))
            }
            Ok(_) => received_any = true,
            Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                return Err(ExchangeError::Other(UpstreamError::Timeout))
            }
            Err(e) if !received_any => return Err(ExchangeError::NothingBack(e)),
            Err(e) => return Err(ExchangeError::Other(UpstreamError::Io(e))),
        }
    }
}

/// Longest first chunk-size line (with extensions) waited for before the head is relayed.
const FIRST_CHUNK_LINE_MAX: usize = 4096;

/// For a chunked answer, read until its first chunk-size line is complete and check it: a
/// malformed start is a broken worker (a retryable 502), not a 200 with no body.
async fn check_first_chunk(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    deadline: Instant,
) -> Result<(), UpstreamError> {
    loop {
        let mut tracker = http::ChunkTracker::new();
        if let Err(e) = tracker.feed(buf) {
            return Err(UpstreamError::BadResponse(format!(
                "bad chunked body: {e:?}"
            )));
        }
        if buf.contains(&b'\n') {
            return Ok(());
        }
        if buf.len() > FIRST_CHUNK_LINE_MAX {
            return Err(UpstreamError::BadResponse(
                "chunk-size line too long".to_string(),
            ));
        }
        match read_into(stream, buf, Some(deadline)).await {
            Ok(0) => {
                return Err(UpstreamError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed before the first chunk",
                )))
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::TimedOut => return Err(UpstreamError::Timeout),
            Err(e) => return Err(UpstreamError::Io(e)),
        }
    }
}

/// Send `req` to `worker` and read the response head (and, for a chunked answer, its first
/// chunk-size line). A pooled connection that fails before any response byte is replaced once
/// by a fresh one (the body is still in memory).
///
/// Why this replay is kept although it cannot be proven that the worker did not process the
/// request: a worker that closes an idle keep-alive connection just as it is reused looks
/// exactly like one that read the request and died, and the first is by far the likelier (the
/// pool keeps connections idle for less than the engines' keep-alive and probes each before
/// reuse, so only that race remains). The cost of the rare wrong guess is one duplicated
/// generation, the same as the retry on another worker that the retry policy makes anyway;
/// refusing the replay would instead turn every such race into an error or a retry elsewhere.
pub async fn roundtrip(
    pool: &Pool,
    worker: &Worker,
    req: &UpstreamRequest,
    request_was_head: bool,
    connect_timeout: Duration,
    deadline: Instant,
) -> Result<UpstreamResponse, UpstreamError> {
    let mut allow_pooled = true;
    loop {
        let pooled = if allow_pooled {
            pool.take(worker)
        } else {
            None
        };
        let reused = pooled.is_some();
        let mut stream = match pooled {
            Some(s) => s,
            None => connect(worker, connect_timeout, deadline).await?,
        };
        match exchange_head(&mut stream, req, request_was_head, deadline).await {
            Ok((head, mut leftover)) => {
                if head.framing == BodyFraming::Chunked {
                    check_first_chunk(&mut stream, &mut leftover, deadline).await?;
                }
                return Ok(UpstreamResponse {
                    stream,
                    head,
                    leftover,
                });
            }
            Err(ExchangeError::NothingBack(_)) if reused => {
                allow_pooled = false;
                continue;
            }
            Err(ExchangeError::NothingBack(e)) => return Err(UpstreamError::Io(e)),
            Err(ExchangeError::Other(e)) => return Err(e),
        }
    }
}

/// A whole response read by [`read_full_body`].
pub struct FullResponse {
    pub head: ResponseHead,
    pub body: Bytes,
    pub stream: TcpStream,
    /// Bytes came after the response: the connection must not be reused.
    pub stray: bool,
}

/// Read a whole response body (for gateway-side fan-out calls such as `/v1/models`).
pub async fn read_full_body(
    up: UpstreamResponse,
    deadline: Instant,
    max: u64,
) -> io::Result<FullResponse> {
    let UpstreamResponse {
        mut stream,
        head,
        leftover,
    } = up;
    let mut raw = leftover;
    let mut body = BytesMut::new();
    match head.framing {
        BodyFraming::None => {}
        BodyFraming::Length(n) => {
            if n > max {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "response too large",
                ));
            }
            while (raw.len() as u64) < n {
                if read_into(&mut stream, &mut raw, Some(deadline)).await? == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "truncated response",
                    ));
                }
            }
            body = raw.split_to(n as usize);
        }
        BodyFraming::Chunked => {
            let mut dec = ChunkedDecoder::new(max);
            loop {
                let used = dec
                    .feed(&raw, &mut body)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{e:?}")))?;
                raw.advance(used);
                if dec.is_done() {
                    break;
                }
                if read_into(&mut stream, &mut raw, Some(deadline)).await? == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "truncated response",
                    ));
                }
            }
        }
        BodyFraming::Close => loop {
            body.extend_from_slice(&raw);
            raw.clear();
            if body.len() as u64 > max {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "response too large",
                ));
            }
            if read_into(&mut stream, &mut raw, Some(deadline)).await? == 0 {
                break;
            }
        },
    }
    Ok(FullResponse {
        head,
        body: body.freeze(),
        stream,
        stray: !raw.is_empty(),
    })
}

/// Largest body a gateway-originated call reads (model cards, loads, flush answers).
const FETCH_MAX_BODY: u64 = 64 << 20;

/// One complete gateway-originated request to a worker (admin fan-out, /v1/models, health):
/// returns status and body; the connection goes back to `pool` when reusable. `timeout`
/// bounds the whole call, connecting included. The request carries the pool's own-call
/// headers (the worker key, when configured) and never anything of a caller's.
pub async fn fetch(
    pool: &Pool,
    worker: &Worker,
    method: Method,
    path: &str,
    body: Bytes,
    timeout: Duration,
) -> Result<(u16, Bytes), UpstreamError> {
    fetch_capped(pool, worker, method, path, body, timeout, FETCH_MAX_BODY).await
}

/// [`fetch`] with a smaller bound on the answer's body: a larger answer is an error (the
/// telemetry thread reads every worker's `/metrics` each interval and keeps it bounded).
pub async fn fetch_capped(
    pool: &Pool,
    worker: &Worker,
    method: Method,
    path: &str,
    body: Bytes,
    timeout: Duration,
    max_body: u64,
) -> Result<(u16, Bytes), UpstreamError> {
    static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let deadline = Instant::now() + timeout;
    let id = format!(
        "gw-{}",
        NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let req = UpstreamRequest::build(
        method.as_str().as_bytes(),
        path.as_bytes(),
        None,
        None,
        &worker.authority,
        &id,
        body,
        None,
        pool.own_calls(),
    );
    let up = roundtrip(
        pool,
        worker,
        &req,
        method == Method::Head,
        timeout,
        deadline,
    )
    .await?;
    let reusable = up.head.keep_alive && !matches!(up.head.framing, BodyFraming::Close);
    let full = read_full_body(up, deadline, max_body.min(FETCH_MAX_BODY))
        .await
        .map_err(UpstreamError::Io)?;
    if reusable && !full.stray {
        pool.put(worker, full.stream);
    }
    Ok((full.head.status, full.body))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::parse_request_head;

    fn head(extra: &str) -> RequestHead {
        let raw = format!("POST /generate HTTP/1.1\r\nhost: h\r\n{extra}\r\n");
        let mut buf = BytesMut::from(raw.as_bytes());
        parse_request_head(&mut buf, &HeadLimits::default())
            .unwrap()
            .unwrap()
    }

    fn build(h: &RequestHead, trace: Option<TraceHeaders<'_>>) -> String {
        build_with(h, trace, &OwnHeaders::default())
    }

    fn build_with(h: &RequestHead, trace: Option<TraceHeaders<'_>>, own: &OwnHeaders) -> String {
        let req = UpstreamRequest::build(
            b"POST",
            b"/generate",
            Some(h),
            None,
            "w:1",
            "id-1",
            Bytes::from_static(b"{}"),
            trace,
            own,
        );
        String::from_utf8(req.head.to_vec()).unwrap()
    }

    #[test]
    fn the_gateways_own_headers_and_a_checked_callers_key_stay_here() {
        let h = head(
            "authorization: Bearer caller\r\nx-api-key: caller\r\nX-SMG-Priority: 9\r\n\
             x-tenant: a\r\nx-tenant: b\r\nx-other: 1\r\n",
        );
        let has = |s: &str, what: &str| s.to_ascii_lowercase().contains(what);
        // A gateway that checks keys: the caller's key, the priority and tenant headers stop.
        let own = OwnHeaders::new("x-smg-priority", Some("X-Tenant"), true, false, None);
        let out = build_with(&h, None, &own);
        for gone in ["authorization", "x-api-key", "x-smg-priority", "x-tenant"] {
            assert!(!has(&out, gone), "{gone}: {out}");
        }
        assert!(out.contains("x-other: 1\r\n"));
        // With a worker key, that key and only it.
        let own = OwnHeaders::new("x-smg-priority", None, true, false, Some("wk"));
        let out = build_with(&h, None, &own);
        assert_eq!(out.matches("authorization").count(), 1, "{out}");
        assert!(out.contains("authorization: Bearer wk\r\n"), "{out}");
        // Pass-through kept on request, and a gateway that checks no keys passes them too.
        for own in [
            OwnHeaders::new("x-smg-priority", None, true, true, None),
            OwnHeaders::new("x-smg-priority", None, false, false, None),
        ] {
            let out = build_with(&h, None, &own);
            assert!(out.contains("authorization: Bearer caller\r\n"), "{out}");
            assert!(out.contains("x-api-key: caller\r\n"), "{out}");
            assert!(!has(&out, "x-smg-priority"), "{out}");
        }
        // A worker key replaces the caller's even when keys are passed through.
        let own = OwnHeaders::new("x-smg-priority", None, true, true, Some("wk"));
        let out = build_with(&h, None, &own);
        assert!(out.contains("authorization: Bearer wk\r\n") && !out.contains("Bearer caller"));
        assert_eq!(out.matches("authorization").count(), 1, "{out}");
    }

    #[test]
    fn the_gateways_own_calls_carry_the_pools_worker_key() {
        for (key, want) in [(Some("wk"), 1), (None, 0)] {
            let pool = crate::proxy::pool::Pool::new(Duration::from_secs(1), 1, key);
            let req = UpstreamRequest::build(
                b"GET",
                b"/flush_cache",
                None,
                None,
                "w:1",
                "gw-1",
                Bytes::new(),
                None,
                pool.own_calls(),
            );
            let out = String::from_utf8(req.head.to_vec()).unwrap();
            assert_eq!(out.matches("authorization").count(), want, "{out}");
            assert_eq!(
                out.contains("authorization: Bearer wk\r\n"),
                want == 1,
                "{out}"
            );
        }
    }

    #[test]
    fn the_gateways_traceparent_replaces_the_clients() {
        let h = head("traceparent: 00-aa-bb-01\r\ntracestate: k=v, ,x=y\r\nx-other: 1\r\n");
        let mine = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        // Continued: the tracestate the gateway kept (bounded, cleaned) in place of the
        // client's.
        let continued = build(
            &h,
            Some(TraceHeaders {
                traceparent: mine,
                tracestate: Some(b"k=v,x=y"),
            }),
        );
        assert_eq!(continued.matches("traceparent").count(), 1, "{continued}");
        assert_eq!(continued.matches("tracestate").count(), 1, "{continued}");
        assert!(continued
            .contains("traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\r\n"));
        assert!(continued.contains("tracestate: k=v,x=y\r\n"), "{continued}");
        assert!(continued.contains("x-other: 1\r\n") && continued.ends_with("\r\n\r\n"));
        // A new trace: the client's tracestate belonged to no trace the worker will see.
        let fresh = build(
            &h,
            Some(TraceHeaders {
                traceparent: mine,
                tracestate: None,
            }),
        );
        assert!(!fresh.contains("tracestate"), "{fresh}");
        // Untraced: both pass unchanged.
        let plain = build(&h, None);
        assert!(
            plain.contains("traceparent: 00-aa-bb-01\r\n")
                && plain.contains("tracestate: k=v, ,x=y")
        );
    }
}
