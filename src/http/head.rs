//! Request and response heads parsed in place: httparse runs over the received bytes, and the
//! result keeps only `u32` offsets into the frozen head buffer, so no header is ever copied.
//! Framing decisions (RFC 9112 §6) and smuggling checks live here, next to the parse.

use bytes::{Bytes, BytesMut};

/// A byte range inside a frozen head buffer; offsets instead of slices keep heads `'static`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Span {
    pub start: u32,
    pub end: u32,
}

/// One header as two spans (name, value) into the head buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HeaderSpan {
    pub name: Span,
    pub value: Span,
}

/// How a message body is delimited (RFC 9112 §6.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFraming {
    /// No body (requests without CL/TE; HEAD, 1xx, 204, 304 responses).
    None,
    /// Exactly this many bytes.
    Length(u64),
    /// Transfer-Encoding: chunked.
    Chunked,
    /// Responses only: body runs until the upstream closes.
    Close,
}

/// Limits enforced while parsing a head; exceeding them is the client's fault (431 / 413).
#[derive(Debug, Clone, Copy)]
pub struct HeadLimits {
    /// Largest head in bytes (request line + headers + CRLFCRLF). Default 64 KiB.
    pub max_head_bytes: usize,
    /// Most headers accepted. Default 100.
    pub max_headers: usize,
}

impl Default for HeadLimits {
    fn default() -> Self {
        HeadLimits { max_head_bytes: 64 * 1024, max_headers: 100 }
    }
}

/// Why a head was refused; each maps to one status code the server answers before closing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeadError {
    /// Malformed request line, header syntax, or version → 400.
    Malformed(&'static str),
    /// Head longer than `max_head_bytes` or more than `max_headers` headers → 431.
    TooLarge,
    /// Smuggling shapes: CL+TE, differing duplicate CL, TE other than chunked, bad CL → 400.
    Framing(&'static str),
    /// HTTP version other than 1.0 / 1.1 → 505.
    Version,
}

impl HeadError {
    /// The status code the server answers with.
    pub fn status(&self) -> u16 {
        todo!()
    }
    /// A short human-readable reason, used in the JSON error body.
    pub fn message(&self) -> &'static str {
        todo!()
    }
}

/// A parsed request head. `buf` holds exactly the head bytes (through the blank line).
#[derive(Debug, Clone)]
pub struct RequestHead {
    pub buf: Bytes,
    pub method: Span,
    /// Request target (path + query) as sent.
    pub target: Span,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub minor_version: u8,
    pub headers: Vec<HeaderSpan>,
    pub framing: BodyFraming,
    /// Connection persists after this exchange (1.1 default unless `Connection: close`;
    /// 1.0 only with `Connection: keep-alive`).
    pub keep_alive: bool,
    /// `Expect: 100-continue` was sent.
    pub expect_continue: bool,
}

impl RequestHead {
    pub fn method(&self) -> &[u8] {
        todo!()
    }
    /// Path + query.
    pub fn target(&self) -> &[u8] {
        todo!()
    }
    /// Path without the query string.
    pub fn path(&self) -> &[u8] {
        todo!()
    }
    /// Query string without the '?', if any.
    pub fn query(&self) -> Option<&[u8]> {
        todo!()
    }
    /// First header value with this name (ASCII case-insensitive).
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        todo!()
    }
    /// Iterate (name, value) pairs in order.
    pub fn headers(&self) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        self.headers.iter().map(|h| {
            (
                &self.buf[h.name.start as usize..h.name.end as usize],
                &self.buf[h.value.start as usize..h.value.end as usize],
            )
        })
    }
}

/// Parse a request head from the front of `buf`.
/// - `Ok(None)`: incomplete, read more (but `Err(TooLarge)` once `buf` exceeds the limit without
///   a complete head).
/// - `Ok(Some(head))`: the head bytes were split off the front of `buf` (`buf.split_to(n).freeze()`),
///   leaving any body / pipelined bytes in `buf`.
pub fn parse_request_head(buf: &mut BytesMut, limits: &HeadLimits) -> Result<Option<RequestHead>, HeadError> {
    let _ = (buf, limits);
    todo!()
}

/// A parsed upstream response head.
#[derive(Debug, Clone)]
pub struct ResponseHead {
    pub buf: Bytes,
    pub status: u16,
    pub minor_version: u8,
    pub headers: Vec<HeaderSpan>,
    pub framing: BodyFraming,
    /// Upstream keeps the connection open after this response.
    pub keep_alive: bool,
}

impl ResponseHead {
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        todo!()
    }
    pub fn headers(&self) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        self.headers.iter().map(|h| {
            (
                &self.buf[h.name.start as usize..h.name.end as usize],
                &self.buf[h.value.start as usize..h.value.end as usize],
            )
        })
    }
}

/// Parse an upstream response head; `request_was_head` makes the body `None`. Same contract as
/// [`parse_request_head`]. 1xx informational responses other than 101 are returned too; the
/// caller skips them.
pub fn parse_response_head(
    buf: &mut BytesMut,
    request_was_head: bool,
    limits: &HeadLimits,
) -> Result<Option<ResponseHead>, HeadError> {
    let _ = (buf, request_was_head, limits);
    todo!()
}
