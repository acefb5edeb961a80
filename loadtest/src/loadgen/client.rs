//! A small HTTP/1.1 client on monoio: keep-alive connections pooled per run, response heads and
//! chunked bodies parsed by radixgate's own `http` module, bodies fed to the SSE splitter as
//! they arrive so every token's arrival time is seen.

use std::cell::{Cell, RefCell};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Instant;

use bytes::{Buf, BytesMut};
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::TcpStream;
use radixgate::http::{parse_response_head, BodyFraming, ChunkedDecoder, HeadLimits};

use super::response::{Answer, EventKind, SseSplitter};

/// Largest response body accepted (a runaway server cannot exhaust the client's memory).
const MAX_BODY: u64 = 64 << 20;
/// Idle connections kept for reuse.
const MAX_IDLE: usize = 4096;
const READ_BUF: usize = 64 << 10;

/// Where requests go: a loopback address and an optional base path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Socket address (always loopback).
    pub addr: SocketAddr,
    /// `Host` header value.
    pub host: String,
    /// Path prefix without a trailing slash ("" for none).
    pub base_path: String,
}

impl Target {
    /// Parse `http://HOST:PORT[/base]`. Only loopback hosts are accepted — 127.0.0.1, [::1] and
    /// localhost (taken as 127.0.0.1, without DNS) — so a load test can never be pointed at a
    /// machine it should not hit.
    pub fn parse(url: &str) -> io::Result<Target> {
        let bad = |m: String| io::Error::new(io::ErrorKind::InvalidInput, m);
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| bad(format!("target {url:?}: only http:// URLs are supported")))?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (h, p) = v6
                .split_once(']')
                .ok_or_else(|| bad(format!("target {url:?}: bad IPv6 literal")))?;
            (h, p.strip_prefix(':'))
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            }
        };
        let ip: IpAddr = match host {
            "127.0.0.1" | "localhost" => IpAddr::V4(Ipv4Addr::LOCALHOST),
            "::1" => IpAddr::V6(Ipv6Addr::LOCALHOST),
            other => {
                return Err(bad(format!(
                    "target host {other:?} refused: loadgen only targets this machine (127.0.0.1, [::1] or localhost)"
                )))
            }
        };
        let port: u16 = match port {
            Some(p) => p
                .parse()
                .map_err(|_| bad(format!("target {url:?}: bad port {p:?}")))?,
            None => 80,
        };
        let addr = SocketAddr::new(ip, port);
        let host = match ip {
            IpAddr::V4(_) => format!("127.0.0.1:{port}"),
            IpAddr::V6(_) => format!("[::1]:{port}"),
        };
        Ok(Target {
            addr,
            host,
            base_path: path.to_string(),
        })
    }
}

/// Why a request failed; the variant name is the error key in the report.
#[derive(Debug)]
pub enum ReqError {
    /// Could not connect.
    Connect(io::Error),
    /// The connection failed mid-exchange.
    Io(io::Error),
    /// The response could not be parsed.
    Protocol(String),
}

impl ReqError {
    /// Key used in `Report::errors`.
    pub fn kind(&self) -> &'static str {
        match self {
            ReqError::Connect(_) => "connect",
            ReqError::Io(_) => "io",
            ReqError::Protocol(_) => "protocol",
        }
    }

    /// Human-readable detail, kept (once per kind) in the report.
    pub fn detail(&self) -> String {
        match self {
            ReqError::Connect(e) | ReqError::Io(e) => e.to_string(),
            ReqError::Protocol(m) => m.clone(),
        }
    }
}

/// A completed exchange.
#[derive(Debug)]
pub struct Exchange {
    /// HTTP status.
    pub status: u16,
    /// Parsed body.
    pub answer: Answer,
    /// First body byte.
    pub first_byte: Option<Instant>,
    /// First event with generated text (streaming), or the whole body (not streaming).
    pub first_content: Option<Instant>,
    /// Gaps between content events, microseconds.
    pub itl_us: Vec<u64>,
    /// End of the response.
    pub done: Instant,
}

/// Idle keep-alive connections (one runtime thread, so a `RefCell` suffices).
#[derive(Default)]
pub struct Pool {
    idle: RefCell<Vec<TcpStream>>,
}

impl Pool {
    fn take(&self) -> Option<TcpStream> {
        self.idle.borrow_mut().pop()
    }

    fn put(&self, c: TcpStream) {
        let mut idle = self.idle.borrow_mut();
        if idle.len() < MAX_IDLE {
            idle.push(c);
        }
    }
}

async fn connect(addr: SocketAddr) -> Result<TcpStream, ReqError> {
    let c = TcpStream::connect_addr(addr)
        .await
        .map_err(ReqError::Connect)?;
    // Small requests and SSE events must not wait for Nagle.
    let _ = c.set_nodelay(true);
    Ok(c)
}

/// Send `request` (head and body, already serialised) and read the whole response. A reused
/// connection that fails before any response byte (the server closed it while idle) is
/// retried once on a fresh connection; the request has not been processed in that case.
pub async fn exchange(
    pool: &Pool,
    target: &Target,
    request: Vec<u8>,
    stream: bool,
) -> Result<Exchange, ReqError> {
    exchange_noting_first(pool, target, request, stream, &Cell::new(None)).await
}

/// [`exchange`], noting the first content's arrival in `first` as soon as it comes, so a
/// caller that gives up on the rest of the answer (a deadline) still knows its time to first
/// token.
pub async fn exchange_noting_first(
    pool: &Pool,
    target: &Target,
    request: Vec<u8>,
    stream: bool,
    first: &Cell<Option<Instant>>,
) -> Result<Exchange, ReqError> {
    let (conn, reused) = match pool.take() {
        Some(c) => (c, true),
        None => (connect(target.addr).await?, false),
    };
    match attempt(pool, conn, request, stream, first).await {
        Ok(x) => Ok(x),
        Err((e, Some(request))) if reused => {
            let _ = e;
            let conn = connect(target.addr).await?;
            attempt(pool, conn, request, stream, first)
                .await
                .map_err(|(e, _)| e)
        }
        Err((e, _)) => Err(e),
    }
}

/// One try on one connection. On failure before any response byte the request buffer is handed
/// back for a retry.
async fn attempt(
    pool: &Pool,
    mut conn: TcpStream,
    request: Vec<u8>,
    stream: bool,
    first: &Cell<Option<Instant>>,
) -> Result<Exchange, (ReqError, Option<Vec<u8>>)> {
    let (res, request) = conn.write_all(request).await;
    if let Err(e) = res {
        return Err((ReqError::Io(e), Some(request)));
    }
    let mut rbuf: Vec<u8> = Vec::with_capacity(READ_BUF);
    let mut pending = BytesMut::with_capacity(READ_BUF);
    let limits = HeadLimits::default();

    // Head (skipping 1xx informational responses).
    let head = loop {
        match parse_response_head(&mut pending, false, &limits) {
            Ok(Some(h)) if (100..200).contains(&h.status) && h.status != 101 => continue,
            Ok(Some(h)) => break h,
            Ok(None) => {}
            Err(e) => {
                return Err((
                    ReqError::Protocol(format!("bad response head: {e:?}")),
                    None,
                ))
            }
        }
        let (res, b) = conn.read(rbuf).await;
        rbuf = b;
        match res {
            Ok(0) if pending.is_empty() => {
                return Err((
                    ReqError::Io(io::ErrorKind::UnexpectedEof.into()),
                    Some(request),
                ))
            }
            Ok(0) => {
                return Err((
                    ReqError::Protocol("connection closed inside the response head".into()),
                    None,
                ))
            }
            Ok(n) => pending.extend_from_slice(&rbuf[..n]),
            Err(e) if pending.is_empty() => return Err((ReqError::Io(e), Some(request))),
            Err(e) => return Err((ReqError::Io(e), None)),
        }
    };
    drop(request);

    let mut body = BodyState::new(stream && head.status == 200);
    let mut clean_end = false;
    match head.framing {
        BodyFraming::None => clean_end = true,
        BodyFraming::Length(n) => {
            if n > MAX_BODY {
                return Err((
                    ReqError::Protocol(format!("response body of {n} bytes")),
                    None,
                ));
            }
            let mut left = n as usize;
            loop {
                let take = left.min(pending.len());
                if take > 0 {
                    body.feed(&pending[..take]);
                    pending.advance(take);
                    left -= take;
                    first.set(first.get().or(body.first_content));
                }
                if left == 0 {
                    clean_end = pending.is_empty();
                    break;
                }
                rbuf = read_body_more(&mut conn, rbuf, &mut pending, "the body").await?;
            }
        }
        BodyFraming::Chunked => {
            let mut dec = ChunkedDecoder::new(MAX_BODY);
            let mut decoded = BytesMut::new();
            loop {
                if !pending.is_empty() {
                    let used = dec.feed(&pending, &mut decoded).map_err(|e| {
                        (ReqError::Protocol(format!("bad chunked body: {e:?}")), None)
                    })?;
                    pending.advance(used);
                    if !decoded.is_empty() {
                        body.feed(&decoded);
                        decoded.clear();
                        first.set(first.get().or(body.first_content));
                    }
                }
                if dec.is_done() {
                    clean_end = pending.is_empty();
                    break;
                }
                rbuf = read_body_more(&mut conn, rbuf, &mut pending, "a chunked body").await?;
            }
        }
        BodyFraming::Close => {
            body.feed(&pending);
            pending.clear();
            loop {
                let (res, b) = conn.read(rbuf).await;
                rbuf = b;
                match res {
                    Ok(0) => break,
                    Ok(n) => {
                        body.feed(&rbuf[..n]);
                        first.set(first.get().or(body.first_content));
                    }
                    Err(e) => return Err((ReqError::Io(e), None)),
                }
                if body.len > MAX_BODY {
                    return Err((ReqError::Protocol("response body too large".into()), None));
                }
            }
        }
    }
    let done = Instant::now();
    if clean_end && head.keep_alive && !matches!(head.framing, BodyFraming::Close) {
        pool.put(conn);
    }
    Ok(body.finish(head.status, done))
}

/// Read more of a length-delimited or chunked body into `pending`, handing the read buffer back
/// (monoio reads take ownership of it). End of stream here means the body was cut short:
/// `inside` names what was being read in the protocol error. Failures are past the response
/// head, so the request is never handed back for a retry.
async fn read_body_more(
    conn: &mut TcpStream,
    rbuf: Vec<u8>,
    pending: &mut BytesMut,
    inside: &str,
) -> Result<Vec<u8>, (ReqError, Option<Vec<u8>>)> {
    let (res, rbuf) = conn.read(rbuf).await;
    match res {
        Ok(0) => Err((
            ReqError::Protocol(format!("connection closed inside {inside}")),
            None,
        )),
        Ok(n) => {
            pending.extend_from_slice(&rbuf[..n]);
            Ok(rbuf)
        }
        Err(e) => Err((ReqError::Io(e), None)),
    }
}

/// Accumulates a body: a streamed 200 goes through the SSE splitter event by event, anything
/// else is collected and parsed whole at the end.
struct BodyState {
    stream: bool,
    sse: SseSplitter,
    whole: Vec<u8>,
    answer: Answer,
    first_byte: Option<Instant>,
    first_content: Option<Instant>,
    last_content: Option<Instant>,
    itl_us: Vec<u64>,
    len: u64,
}

impl BodyState {
    fn new(stream: bool) -> Self {
        BodyState {
            stream,
            sse: SseSplitter::default(),
            whole: Vec::new(),
            answer: Answer::default(),
            first_byte: None,
            first_content: None,
            last_content: None,
            itl_us: Vec::new(),
            len: 0,
        }
    }

    fn feed(&mut self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        let now = Instant::now();
        self.first_byte.get_or_insert(now);
        self.len += bytes.len() as u64;
        if !self.stream {
            if self.len <= MAX_BODY {
                self.whole.extend_from_slice(bytes);
            }
            return;
        }
        let BodyState {
            sse,
            answer,
            first_content,
            last_content,
            itl_us,
            ..
        } = self;
        sse.feed(bytes, |ev| {
            if answer.on_event(ev) == EventKind::Content {
                if let Some(prev) = *last_content {
                    itl_us.push(now.duration_since(prev).as_micros() as u64);
                }
                first_content.get_or_insert(now);
                *last_content = Some(now);
            }
        });
    }

    fn finish(mut self, status: u16, done: Instant) -> Exchange {
        if status != 200 {
            // Keep the start of an error body for the report.
            let end = self.whole.len().min(300);
            self.answer.error = Some(String::from_utf8_lossy(&self.whole[..end]).into_owned());
        } else if !self.stream {
            self.answer.on_body(&self.whole);
            if !self.answer.text.is_empty() {
                self.first_content = self.first_byte;
            }
        }
        Exchange {
            status,
            answer: self.answer,
            first_byte: self.first_byte,
            first_content: self.first_content,
            itl_us: self.itl_us,
            done,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_loopback_only() {
        let t = Target::parse("http://127.0.0.1:30000").unwrap();
        assert_eq!(t.addr, "127.0.0.1:30000".parse().unwrap());
        assert_eq!(
            (t.host.as_str(), t.base_path.as_str()),
            ("127.0.0.1:30000", "")
        );
        let t = Target::parse("http://[::1]:8080/api/").unwrap();
        assert_eq!(t.addr, "[::1]:8080".parse().unwrap());
        assert_eq!(t.base_path, "/api");
        assert_eq!(
            Target::parse("http://localhost:1").unwrap().addr.ip(),
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        );
        for bad in [
            "http://10.0.0.1:80",
            "http://example.com:80",
            "https://127.0.0.1:1",
            "http://127.0.0.2:1",
            "http://127.0.0.1:x",
        ] {
            let e = Target::parse(bad).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{bad}");
        }
        assert!(Target::parse("http://10.1.1.1:80")
            .unwrap_err()
            .to_string()
            .contains("only targets this machine"));
    }
}
