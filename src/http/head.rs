//! Request and response heads parsed in place: httparse runs over the received bytes, and the
//! result keeps only `u32` offsets into the frozen head buffer, so no header is ever copied.
//! Framing decisions (RFC 9112 §6) and smuggling checks live here, next to the parse.

use std::mem::MaybeUninit;

use bytes::{Bytes, BytesMut};

/// A byte range inside a frozen head buffer; offsets instead of slices keep heads `'static`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Span {
    /// First byte (inclusive).
    pub start: u32,
    /// One past the last byte.
    pub end: u32,
}

impl Span {
    /// The bytes this span covers in `buf`; empty if the span does not fit (only possible for a
    /// hand-built span, never for one produced by the parser), so lookups can never panic.
    #[inline]
    pub fn slice<'a>(&self, buf: &'a [u8]) -> &'a [u8] {
        buf.get(self.start as usize..self.end as usize)
            .unwrap_or_default()
    }

    /// Length in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        self.end.saturating_sub(self.start) as usize
    }

    /// True for a zero-length span.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One header as two spans (name, value) into the head buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HeaderSpan {
    /// Field name as sent (original case).
    pub name: Span,
    /// Field value with surrounding whitespace trimmed.
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
    /// Most headers accepted. Default 100; values above [`MAX_HEADERS_CAP`] act as the cap.
    pub max_headers: usize,
}

impl Default for HeadLimits {
    fn default() -> Self {
        HeadLimits {
            max_head_bytes: 64 * 1024,
            max_headers: 100,
        }
    }
}

/// Hard upper bound on `max_headers`: the parser's header array lives on the stack, so its size
/// is fixed at compile time (128 × 32 bytes = 4 KiB of stack per parse, never zero-filled).
pub const MAX_HEADERS_CAP: usize = 128;

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
    /// The status code the server answers with. (For an upstream *response* head the proxy
    /// answers 502 instead; the code here describes the request side.)
    pub fn status(&self) -> u16 {
        match self {
            HeadError::Malformed(_) | HeadError::Framing(_) => 400,
            HeadError::TooLarge => 431,
            HeadError::Version => 505,
        }
    }

    /// A short human-readable reason, used in the JSON error body.
    pub fn message(&self) -> &'static str {
        match self {
            HeadError::Malformed(detail) | HeadError::Framing(detail) => detail,
            HeadError::TooLarge => "request header fields too large",
            HeadError::Version => "HTTP version not supported (only HTTP/1.0 and HTTP/1.1)",
        }
    }
}

impl std::fmt::Display for HeadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message(), self.status())
    }
}

impl std::error::Error for HeadError {}

/// A parsed request head. `buf` holds exactly the head bytes (through the blank line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    /// The head bytes, frozen: every span below points into this buffer.
    pub buf: Bytes,
    /// Request method token.
    pub method: Span,
    /// Request target (path + query) as sent.
    pub target: Span,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub minor_version: u8,
    /// Header fields in the order received.
    pub headers: Vec<HeaderSpan>,
    /// How the body is delimited.
    pub framing: BodyFraming,
    /// Connection persists after this exchange (1.1 default unless `Connection: close`;
    /// 1.0 only with `Connection: keep-alive`).
    pub keep_alive: bool,
    /// `Expect: 100-continue` was sent.
    pub expect_continue: bool,
}

impl RequestHead {
    /// Method token, e.g. `POST`.
    pub fn method(&self) -> &[u8] {
        self.method.slice(&self.buf)
    }

    /// Path + query.
    pub fn target(&self) -> &[u8] {
        self.target.slice(&self.buf)
    }

    /// Path without the query string.
    pub fn path(&self) -> &[u8] {
        let target = self.target();
        match memchr_byte(b'?', target) {
            Some(i) => &target[..i],
            None => target,
        }
    }

    /// Query string without the '?', if any.
    pub fn query(&self) -> Option<&[u8]> {
        let target = self.target();
        memchr_byte(b'?', target).map(|i| &target[i + 1..])
    }

    /// First header value with this name (ASCII case-insensitive).
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        find_header(&self.buf, &self.headers, name)
    }

    /// Iterate (name, value) pairs in order.
    pub fn headers(&self) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        self.headers
            .iter()
            .map(|h| (h.name.slice(&self.buf), h.value.slice(&self.buf)))
    }
}

/// Parse a request head from the front of `buf`.
/// - `Ok(None)`: incomplete, read more (but `Err(TooLarge)` once `buf` exceeds the limit without
///   a complete head).
/// - `Ok(Some(head))`: the head bytes were split off the front of `buf` (`buf.split_to(n).freeze()`),
///   leaving any body / pipelined bytes in `buf`.
///
/// On `Err` the buffer is left untouched; the caller answers `err.status()` and closes.
pub fn parse_request_head(
    buf: &mut BytesMut,
    limits: &HeadLimits,
) -> Result<Option<RequestHead>, HeadError> {
    if buf.is_empty() {
        return Ok(None);
    }
    let max_head = effective_max_head(limits);
    let window = &buf[..buf.len().min(max_head)];
    let mut storage = header_storage();
    let slots = limits.max_headers.min(MAX_HEADERS_CAP);
    let mut req = httparse::Request::new(&mut []);
    let head_len = match req.parse_with_uninit_headers(window, &mut storage[..slots]) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => {
            // The window is capped at `max_head`: a partial window of that size means the head
            // needs more than `max_head` bytes.
            return if window.len() >= max_head {
                Err(HeadError::TooLarge)
            } else {
                Ok(None)
            };
        }
        Err(e) => return Err(map_parse_error(e, window, Side::Request)),
    };
    // httparse fills all three on `Complete`; a missing one would be a parser bug, reported as
    // malformed rather than panicking.
    let (Some(method), Some(target), Some(minor)) = (req.method, req.path, req.version) else {
        return Err(HeadError::Malformed("invalid request line"));
    };
    let base = window.as_ptr() as usize;
    let method = span_of(base, method.as_bytes());
    let target = span_of(base, target.as_bytes());

    let mut facts = Facts::default();
    let mut headers = Vec::with_capacity(req.headers.len());
    for h in req.headers.iter() {
        facts.observe(h.name.as_bytes(), h.value)?;
        headers.push(HeaderSpan {
            name: span_of(base, h.name.as_bytes()),
            value: span_of(base, h.value),
        });
    }
    if facts.hosts > 1 {
        return Err(HeadError::Malformed("multiple Host headers"));
    }
    let framing = facts.request_framing(minor)?;
    let keep_alive = facts.keep_alive(minor);
    let expect_continue = minor == 1 && facts.expect_continue;

    let head = buf.split_to(head_len).freeze();
    Ok(Some(RequestHead {
        buf: head,
        method,
        target,
        minor_version: minor,
        headers,
        framing,
        keep_alive,
        expect_continue,
    }))
}

/// A parsed upstream response head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseHead {
    /// The head bytes, frozen: every span below points into this buffer.
    pub buf: Bytes,
    /// Status code, 100..=999 (three digits; below 100 is refused as malformed).
    pub status: u16,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub minor_version: u8,
    /// Header fields in the order received.
    pub headers: Vec<HeaderSpan>,
    /// How the body is delimited.
    pub framing: BodyFraming,
    /// Upstream keeps the connection open after this response.
    pub keep_alive: bool,
}

impl ResponseHead {
    /// First header value with this name (ASCII case-insensitive).
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        find_header(&self.buf, &self.headers, name)
    }

    /// Iterate (name, value) pairs in order.
    pub fn headers(&self) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        self.headers
            .iter()
            .map(|h| (h.name.slice(&self.buf), h.value.slice(&self.buf)))
    }

    /// A 1xx interim response (other than 101): the final response follows on the same
    /// connection, so the caller forwards or skips it and parses again.
    pub fn is_interim(&self) -> bool {
        (100..200).contains(&self.status) && self.status != 101
    }
}

/// Parse an upstream response head; `request_was_head` makes the body `None`. Same contract as
/// [`parse_request_head`]. 1xx informational responses other than 101 are returned too; the
/// caller skips them.
///
/// Framing per RFC 9112 §6.3: none for HEAD / 1xx / 204 / 304; else chunked when the final
/// transfer coding is `chunked` (TE overrides CL, and a proxy must then not forward the CL);
/// close-delimited for any other TE; else Content-Length; else close-delimited. Errors here
/// mean a broken upstream: the proxy answers 502, not `status()`.
pub fn parse_response_head(
    buf: &mut BytesMut,
    request_was_head: bool,
    limits: &HeadLimits,
) -> Result<Option<ResponseHead>, HeadError> {
    if buf.is_empty() {
        return Ok(None);
    }
    let max_head = effective_max_head(limits);
    let window = &buf[..buf.len().min(max_head)];
    let mut storage = header_storage();
    let slots = limits.max_headers.min(MAX_HEADERS_CAP);
    let mut resp = httparse::Response::new(&mut []);
    let parsed = httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut resp,
        window,
        &mut storage[..slots],
    );
    let head_len = match parsed {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => {
            return if window.len() >= max_head {
                Err(HeadError::TooLarge)
            } else {
                Ok(None)
            };
        }
        Err(e) => return Err(map_parse_error(e, window, Side::Response)),
    };
    let (Some(status), Some(minor)) = (resp.code, resp.version) else {
        return Err(HeadError::Malformed("invalid status line"));
    };
    // httparse takes any three digits; 000..=099 is no status class (RFC 9110 §15) and would
    // otherwise be framed as a final response.
    if status < 100 {
        return Err(HeadError::Malformed("invalid status code"));
    }
    let base = window.as_ptr() as usize;
    let mut facts = Facts::default();
    let mut headers = Vec::with_capacity(resp.headers.len());
    for h in resp.headers.iter() {
        facts.observe(h.name.as_bytes(), h.value)?;
        headers.push(HeaderSpan {
            name: span_of(base, h.name.as_bytes()),
            value: span_of(base, h.value),
        });
    }
    let framing = facts.response_framing(minor, status, request_was_head)?;
    let keep_alive = framing != BodyFraming::Close && facts.keep_alive(minor);

    let head = buf.split_to(head_len).freeze();
    Ok(Some(ResponseHead {
        buf: head,
        status,
        minor_version: minor,
        headers,
        framing,
        keep_alive,
    }))
}

/// The parser's header slots on the stack, left uninitialised: httparse writes each slot before
/// exposing it (its `*_with_uninit_headers` API), so the 4 KiB array costs no stores per parse
/// (zero-filling `[EMPTY_HEADER; 128]` was a measurable share of a ~300 ns head parse).
#[inline]
fn header_storage<'b>() -> [MaybeUninit<httparse::Header<'b>>; MAX_HEADERS_CAP] {
    [const { MaybeUninit::uninit() }; MAX_HEADERS_CAP]
}

/// `max_head_bytes`, bounded so that every offset fits the `u32` spans.
#[inline]
fn effective_max_head(limits: &HeadLimits) -> usize {
    limits.max_head_bytes.min(u32::MAX as usize)
}

/// Offsets of `part` inside the buffer starting at `base`. httparse only hands out sub-slices of
/// its input and the input is at most `u32::MAX` bytes (see `effective_max_head`), so both
/// offsets fit; saturating arithmetic keeps a violated assumption from panicking.
#[inline]
fn span_of(base: usize, part: &[u8]) -> Span {
    let start = (part.as_ptr() as usize).saturating_sub(base);
    let end = start + part.len();
    Span {
        start: u32::try_from(start).unwrap_or(u32::MAX),
        end: u32::try_from(end).unwrap_or(u32::MAX),
    }
}

fn find_header<'a>(buf: &'a [u8], headers: &[HeaderSpan], name: &str) -> Option<&'a [u8]> {
    let name = name.as_bytes();
    headers
        .iter()
        .find(|h| h.name.len() == name.len() && h.name.slice(buf).eq_ignore_ascii_case(name))
        .map(|h| h.value.slice(buf))
}

#[inline]
fn memchr_byte(needle: u8, haystack: &[u8]) -> Option<usize> {
    haystack.iter().position(|&b| b == needle)
}

#[derive(Clone, Copy)]
enum Side {
    Request,
    Response,
}

/// Translate an httparse error into the answer the client gets.
fn map_parse_error(e: httparse::Error, window: &[u8], side: Side) -> HeadError {
    use httparse::Error as E;
    match e {
        E::TooManyHeaders => HeadError::TooLarge,
        E::Version => classify_version(window, side),
        E::HeaderName => {
            HeadError::Malformed("invalid header field line (bad name, missing colon, or folding)")
        }
        E::HeaderValue => HeadError::Malformed("invalid byte in header value"),
        E::NewLine => HeadError::Malformed("invalid line ending"),
        E::Status => HeadError::Malformed("invalid status line"),
        E::Token => HeadError::Malformed("invalid request line"),
    }
}

/// httparse reports any version other than exactly `HTTP/1.0` / `HTTP/1.1` as a version error.
/// Only a well-formed but unsupported version (`HTTP/2.0`, `HTTP/1.2`) deserves 505; garbage in
/// the version position is a malformed request line (400).
fn classify_version(window: &[u8], side: Side) -> HeadError {
    let start = window
        .iter()
        .position(|&b| b != b'\r' && b != b'\n')
        .unwrap_or(window.len());
    let rest = &window[start..];
    let line_end = memchr_byte(b'\n', rest).unwrap_or(rest.len());
    let mut line = &rest[..line_end];
    if let Some(stripped) = line.strip_suffix(b"\r") {
        line = stripped;
    }
    let token = match side {
        // method SP target SP version: the version is everything after the second space.
        Side::Request => {
            let mut parts = line.splitn(3, |&b| b == b' ');
            let (_, _, version) = (parts.next(), parts.next(), parts.next());
            version.unwrap_or_default()
        }
        // version SP status ...: the version is the first token.
        Side::Response => line.split(|&b| b == b' ').next().unwrap_or_default(),
    };
    // `HTTP/` DIGIT `.` DIGIT (HTTP-name is case-sensitive), or a prefix of that shape when
    // the line is still incomplete.
    let well_formed = token.len() >= 6
        && token.len() <= 8
        && token.starts_with(b"HTTP/")
        && token[5].is_ascii_digit()
        && (token.len() < 7 || token[6] == b'.')
        && (token.len() < 8 || token[7].is_ascii_digit());
    if well_formed {
        HeadError::Version
    } else {
        HeadError::Malformed("invalid HTTP version")
    }
}

/// Everything framing depends on, gathered in the single pass over the headers.
#[derive(Default)]
struct Facts {
    content_length: Option<u64>,
    /// A Transfer-Encoding field was present (even an empty one).
    te_present: bool,
    /// Non-empty codings across all Transfer-Encoding fields.
    te_codings: u32,
    /// An empty list element (`chunked,` or an empty field) was seen.
    te_empty_element: bool,
    /// The last non-empty coding so far is `chunked`.
    te_final_chunked: bool,
    conn_close: bool,
    conn_keep_alive: bool,
    expect_continue: bool,
    hosts: u32,
}

impl Facts {
    fn observe(&mut self, name: &[u8], value: &[u8]) -> Result<(), HeadError> {
        // Dispatch on length first: most headers are rejected by one integer compare.
        match name.len() {
            4 if name.eq_ignore_ascii_case(b"host") => self.hosts += 1,
            6 if name.eq_ignore_ascii_case(b"expect")
                && list_elements(value).any(|e| e.eq_ignore_ascii_case(b"100-continue")) =>
            {
                self.expect_continue = true;
            }
            10 if name.eq_ignore_ascii_case(b"connection") => {
                for token in list_elements(value) {
                    if token.eq_ignore_ascii_case(b"close") {
                        self.conn_close = true;
                    } else if token.eq_ignore_ascii_case(b"keep-alive") {
                        self.conn_keep_alive = true;
                    }
                }
            }
            14 if name.eq_ignore_ascii_case(b"content-length") => {
                for element in list_elements(value) {
                    let n = parse_content_length(element)
                        .ok_or(HeadError::Framing("invalid Content-Length"))?;
                    match self.content_length {
                        Some(prev) if prev != n => {
                            return Err(HeadError::Framing("conflicting Content-Length values"))
                        }
                        _ => self.content_length = Some(n),
                    }
                }
            }
            17 if name.eq_ignore_ascii_case(b"transfer-encoding") => {
                self.te_present = true;
                for coding in list_elements(value) {
                    if coding.is_empty() {
                        self.te_empty_element = true;
                        continue;
                    }
                    self.te_codings += 1;
                    self.te_final_chunked = coding.eq_ignore_ascii_case(b"chunked");
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// RFC 9112 §6.3 for requests, strict: the gateway decodes the body itself, so only a
    /// single `chunked` coding is understood, and every ambiguous shape is refused.
    fn request_framing(&self, minor: u8) -> Result<BodyFraming, HeadError> {
        if self.te_present {
            if self.content_length.is_some() {
                return Err(HeadError::Framing(
                    "both Transfer-Encoding and Content-Length present",
                ));
            }
            if minor == 0 {
                return Err(HeadError::Framing(
                    "Transfer-Encoding in an HTTP/1.0 request",
                ));
            }
            if self.te_codings != 1 || self.te_empty_element || !self.te_final_chunked {
                return Err(HeadError::Framing(
                    "unsupported Transfer-Encoding (only a single \"chunked\" is accepted)",
                ));
            }
            return Ok(BodyFraming::Chunked);
        }
        Ok(match self.content_length {
            Some(n) => BodyFraming::Length(n),
            None => BodyFraming::None,
        })
    }

    fn response_framing(
        &self,
        minor: u8,
        status: u16,
        request_was_head: bool,
    ) -> Result<BodyFraming, HeadError> {
        if request_was_head || (100..200).contains(&status) || status == 204 || status == 304 {
            return Ok(BodyFraming::None);
        }
        if self.te_present {
            // RFC 9112 §6.1: TE in an HTTP/1.0 message means the framing is faulty.
            if minor == 0 {
                return Err(HeadError::Framing(
                    "Transfer-Encoding in an HTTP/1.0 response",
                ));
            }
            return Ok(if self.te_final_chunked {
                BodyFraming::Chunked
            } else {
                BodyFraming::Close
            });
        }
        Ok(match self.content_length {
            Some(n) => BodyFraming::Length(n),
            None => BodyFraming::Close,
        })
    }

    fn keep_alive(&self, minor: u8) -> bool {
        if self.conn_close {
            false
        } else if minor == 0 {
            self.conn_keep_alive
        } else {
            true
        }
    }
}

/// Elements of a comma-separated field value (RFC 9110 §5.6.1) with optional whitespace
/// trimmed; empty elements (including a wholly empty value) are yielded as empty slices so
/// callers can decide about them.
fn list_elements(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value.split(|&b| b == b',').map(trim_ows)
}

fn trim_ows(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

/// `1*DIGIT` into a u64; `None` for empty, signs, non-digits and overflow.
fn parse_content_length(s: &[u8]) -> Option<u64> {
    if s.is_empty() {
        return None;
    }
    let mut n: u64 = 0;
    for &b in s {
        if !b.is_ascii_digit() {
            return None;
        }
        n = n.checked_mul(10)?.checked_add(u64::from(b - b'0'))?;
    }
    Some(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(raw: &[u8]) -> Result<Option<RequestHead>, HeadError> {
        let mut buf = BytesMut::from(raw);
        parse_request_head(&mut buf, &HeadLimits::default())
    }

    fn head(raw: &[u8]) -> RequestHead {
        match parse(raw) {
            Ok(Some(h)) => h,
            other => panic!(
                "expected a head for {:?}, got {other:?}",
                String::from_utf8_lossy(raw)
            ),
        }
    }

    fn err(raw: &[u8]) -> HeadError {
        match parse(raw) {
            Err(e) => e,
            other => panic!(
                "expected an error for {:?}, got {other:?}",
                String::from_utf8_lossy(raw)
            ),
        }
    }

    fn framing_of(extra: &str) -> Result<BodyFraming, HeadError> {
        let raw = format!("POST /x HTTP/1.1\r\nHost: a\r\n{extra}\r\n");
        parse(raw.as_bytes()).map(|h| h.map(|h| h.framing).unwrap_or(BodyFraming::Close))
    }

    fn resp(raw: &[u8], was_head: bool) -> Result<Option<ResponseHead>, HeadError> {
        let mut buf = BytesMut::from(raw);
        parse_response_head(&mut buf, was_head, &HeadLimits::default())
    }

    fn resp_ok(raw: &str) -> ResponseHead {
        match resp(raw.as_bytes(), false) {
            Ok(Some(h)) => h,
            other => panic!("expected a response head for {raw:?}, got {other:?}"),
        }
    }

    #[test]
    fn parses_simple_get_in_place() {
        let raw = b"GET /v1/models?limit=3&x=y HTTP/1.1\r\nHost: gw\r\nX-Request-Id: abc\r\nAccept:   */*  \r\n\r\n";
        let mut buf = BytesMut::from(&raw[..]);
        let h = parse_request_head(&mut buf, &HeadLimits::default())
            .unwrap()
            .unwrap();
        assert!(buf.is_empty());
        assert_eq!(&h.buf[..], &raw[..]);
        assert_eq!(h.method(), b"GET");
        assert_eq!(h.target(), b"/v1/models?limit=3&x=y");
        assert_eq!(h.path(), b"/v1/models");
        assert_eq!(h.query(), Some(&b"limit=3&x=y"[..]));
        assert_eq!(h.minor_version, 1);
        assert_eq!(h.header("host"), Some(&b"gw"[..]));
        assert_eq!(h.header("x-request-id"), Some(&b"abc"[..]));
        assert_eq!(h.header("ACCEPT"), Some(&b"*/*"[..]), "value trimmed");
        assert_eq!(h.header("missing"), None);
        let names: Vec<&[u8]> = h.headers().map(|(n, _)| n).collect();
        assert_eq!(names, vec![&b"Host"[..], b"X-Request-Id", b"Accept"]);
        assert_eq!(h.framing, BodyFraming::None);
        assert!(h.keep_alive);
        assert!(!h.expect_continue);
    }

    #[test]
    fn header_returns_first_of_duplicates_and_empty_values() {
        let h = head(b"GET / HTTP/1.1\r\nX-A: one\r\nx-a: two\r\nX-Empty:\r\nX-Sp:   \r\n\r\n");
        assert_eq!(h.header("x-a"), Some(&b"one"[..]));
        assert_eq!(h.header("x-empty"), Some(&b""[..]));
        assert_eq!(h.header("x-sp"), Some(&b""[..]));
        assert_eq!(h.headers().count(), 4);
        assert_eq!(h.query(), None);
        assert_eq!(h.path(), b"/");
    }

    #[test]
    fn empty_query_is_some_empty() {
        let h = head(b"GET /a? HTTP/1.1\r\n\r\n");
        assert_eq!(h.path(), b"/a");
        assert_eq!(h.query(), Some(&b""[..]));
    }

    #[test]
    fn leading_empty_lines_are_skipped_with_correct_spans() {
        let h = head(b"\r\n\r\nPOST /generate HTTP/1.1\r\nContent-Length: 2\r\n\r\n");
        assert_eq!(h.method(), b"POST");
        assert_eq!(h.target(), b"/generate");
        assert_eq!(h.framing, BodyFraming::Length(2));
    }

    #[test]
    fn body_and_pipelined_requests_stay_in_the_buffer() {
        let raw = b"POST /generate HTTP/1.1\r\nContent-Length: 5\r\n\r\nhelloGET /health HTTP/1.1\r\n\r\nGET /b HTTP/1.1\r\n";
        let mut buf = BytesMut::from(&raw[..]);
        let limits = HeadLimits::default();
        let first = parse_request_head(&mut buf, &limits).unwrap().unwrap();
        assert_eq!(first.framing, BodyFraming::Length(5));
        assert_eq!(
            &buf[..],
            &b"helloGET /health HTTP/1.1\r\n\r\nGET /b HTTP/1.1\r\n"[..]
        );
        let _body = buf.split_to(5);
        let second = parse_request_head(&mut buf, &limits).unwrap().unwrap();
        assert_eq!(second.target(), b"/health");
        assert_eq!(&buf[..], &b"GET /b HTTP/1.1\r\n"[..]);
        // The third head is incomplete: Ok(None) and nothing consumed.
        assert!(parse_request_head(&mut buf, &limits).unwrap().is_none());
        assert_eq!(&buf[..], &b"GET /b HTTP/1.1\r\n"[..]);
        // Spans of the first head stay valid after the buffer moved on.
        assert_eq!(first.target(), b"/generate");
    }

    #[test]
    fn incomplete_head_is_none_and_untouched() {
        for raw in [
            &b""[..],
            b"G",
            b"GET / HTTP/1.1\r\n",
            b"GET / HTTP/1.1\r\nHost: a\r\n\r",
        ] {
            let mut buf = BytesMut::from(raw);
            assert_eq!(
                parse_request_head(&mut buf, &HeadLimits::default()),
                Ok(None)
            );
            assert_eq!(&buf[..], raw);
        }
    }

    fn head_of_len(total: usize) -> Vec<u8> {
        // "GET / HTTP/1.1\r\nX: " + padding + "\r\n\r\n"
        let fixed = b"GET / HTTP/1.1\r\nX: ".len() + 4;
        let mut v = b"GET / HTTP/1.1\r\nX: ".to_vec();
        v.extend(std::iter::repeat_n(b'a', total - fixed));
        v.extend_from_slice(b"\r\n\r\n");
        assert_eq!(v.len(), total);
        v
    }

    #[test]
    fn head_size_limit_complete_and_incomplete() {
        let limits = HeadLimits {
            max_head_bytes: 1024,
            max_headers: 100,
        };
        // Exactly at the limit: accepted, even with more bytes behind it.
        let mut buf = BytesMut::from(&head_of_len(1024)[..]);
        buf.extend_from_slice(b"trailing body bytes");
        assert!(parse_request_head(&mut buf, &limits).unwrap().is_some());
        assert_eq!(&buf[..], b"trailing body bytes");
        // One byte over, complete: 431.
        let mut buf = BytesMut::from(&head_of_len(1025)[..]);
        assert_eq!(
            parse_request_head(&mut buf, &limits),
            Err(HeadError::TooLarge)
        );
        // Incomplete and already at the limit: 431 without waiting for more.
        let raw = head_of_len(4096);
        let mut buf = BytesMut::from(&raw[..1024]);
        assert_eq!(
            parse_request_head(&mut buf, &limits),
            Err(HeadError::TooLarge)
        );
        // Incomplete and under the limit: keep reading.
        let mut buf = BytesMut::from(&raw[..1023]);
        assert_eq!(parse_request_head(&mut buf, &limits), Ok(None));
        // The default limit is 64 KiB.
        assert_eq!(err(&head_of_len(64 * 1024 + 1)), HeadError::TooLarge);
        assert!(parse(&head_of_len(64 * 1024)).unwrap().is_some());
        // An endless stream of empty lines cannot sneak past the limit either.
        let mut buf = BytesMut::from(&b"\r\n".repeat(600)[..]);
        assert_eq!(
            parse_request_head(&mut buf, &limits),
            Err(HeadError::TooLarge)
        );
    }

    fn with_headers(n: usize) -> Vec<u8> {
        let mut v = b"GET / HTTP/1.1\r\n".to_vec();
        for i in 0..n {
            v.extend_from_slice(format!("X-H{i}: v\r\n").as_bytes());
        }
        v.extend_from_slice(b"\r\n");
        v
    }

    #[test]
    fn header_count_limit() {
        assert_eq!(head(&with_headers(100)).headers.len(), 100);
        assert_eq!(err(&with_headers(101)), HeadError::TooLarge);
        assert_eq!(err(&with_headers(101)).status(), 431);
        let five = HeadLimits {
            max_head_bytes: 65536,
            max_headers: 5,
        };
        let mut buf = BytesMut::from(&with_headers(5)[..]);
        assert!(parse_request_head(&mut buf, &five).unwrap().is_some());
        let mut buf = BytesMut::from(&with_headers(6)[..]);
        assert_eq!(
            parse_request_head(&mut buf, &five),
            Err(HeadError::TooLarge)
        );
        // Limits above the compile-time cap act as the cap.
        let huge = HeadLimits {
            max_head_bytes: 65536,
            max_headers: 10_000,
        };
        let mut buf = BytesMut::from(&with_headers(MAX_HEADERS_CAP)[..]);
        assert!(parse_request_head(&mut buf, &huge).unwrap().is_some());
        let mut buf = BytesMut::from(&with_headers(MAX_HEADERS_CAP + 1)[..]);
        assert_eq!(
            parse_request_head(&mut buf, &huge),
            Err(HeadError::TooLarge)
        );
    }

    #[test]
    fn content_length_framing() {
        assert_eq!(
            framing_of("Content-Length: 42\r\n"),
            Ok(BodyFraming::Length(42))
        );
        assert_eq!(
            framing_of("Content-Length: 0\r\n"),
            Ok(BodyFraming::Length(0))
        );
        assert_eq!(
            framing_of("Content-Length: 007\r\n"),
            Ok(BodyFraming::Length(7))
        );
        assert_eq!(framing_of(""), Ok(BodyFraming::None));
        assert_eq!(
            framing_of("Content-Length: 18446744073709551615\r\n"),
            Ok(BodyFraming::Length(u64::MAX))
        );
        // Identical duplicates, as separate fields or a list, are one value.
        assert_eq!(
            framing_of("Content-Length: 5\r\ncontent-length: 5\r\n"),
            Ok(BodyFraming::Length(5))
        );
        assert_eq!(
            framing_of("Content-Length: 5, 5\r\n"),
            Ok(BodyFraming::Length(5))
        );
        assert_eq!(
            framing_of("Content-Length: 5 ,5,5\r\n"),
            Ok(BodyFraming::Length(5))
        );
    }

    #[test]
    fn content_length_smuggling_shapes_are_400() {
        for bad in [
            "Content-Length: 5\r\nContent-Length: 6\r\n",
            "Content-Length: 5, 6\r\n",
            "Content-Length: 5\r\nContent-Length: 5, 7\r\n",
            "Content-Length: -1\r\n",
            "Content-Length: +5\r\n",
            "Content-Length: 5a\r\n",
            "Content-Length: abc\r\n",
            "Content-Length: 0x10\r\n",
            "Content-Length: 5 5\r\n",
            "Content-Length: 1.0\r\n",
            "Content-Length: \r\n",
            "Content-Length: 5,\r\n",
            "Content-Length: ,5\r\n",
            "Content-Length: 18446744073709551616\r\n",
            "Content-Length: 99999999999999999999999\r\n",
        ] {
            let e = framing_of(bad).unwrap_err();
            assert!(matches!(e, HeadError::Framing(_)), "{bad:?} gave {e:?}");
            assert_eq!(e.status(), 400, "{bad:?}");
        }
    }

    #[test]
    fn transfer_encoding_framing() {
        assert_eq!(
            framing_of("Transfer-Encoding: chunked\r\n"),
            Ok(BodyFraming::Chunked)
        );
        assert_eq!(
            framing_of("transfer-encoding: ChUnKeD\r\n"),
            Ok(BodyFraming::Chunked)
        );
        assert_eq!(
            framing_of("Transfer-Encoding:   chunked   \r\n"),
            Ok(BodyFraming::Chunked)
        );
    }

    #[test]
    fn transfer_encoding_smuggling_shapes_are_400() {
        for bad in [
            // CL + TE, in both orders and with a valid-looking CL.
            "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
            "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
            "Content-Length: 0\r\nTransfer-Encoding: chunked\r\n",
            // Final coding is not exactly a single chunked.
            "Transfer-Encoding: gzip, chunked\r\n",
            "Transfer-Encoding: chunked, gzip\r\n",
            "Transfer-Encoding: chunked, chunked\r\n",
            "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
            "Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n",
            "Transfer-Encoding: identity\r\n",
            "Transfer-Encoding: gzip\r\n",
            "Transfer-Encoding: chunked,\r\n",
            "Transfer-Encoding: ,chunked\r\n",
            "Transfer-Encoding: \r\n",
            "Transfer-Encoding: chunked\r\nTransfer-Encoding: \r\n",
            "Transfer-Encoding: chunkedx\r\n",
            "Transfer-Encoding: chunked;q=1\r\n",
            "Transfer-Encoding: \"chunked\"\r\n",
            "Transfer-Encoding: xchunked\r\n",
        ] {
            let e = framing_of(bad).unwrap_err();
            assert!(matches!(e, HeadError::Framing(_)), "{bad:?} gave {e:?}");
            assert_eq!(e.status(), 400, "{bad:?}");
        }
    }

    #[test]
    fn http10_with_transfer_encoding_is_400() {
        let e = err(b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert!(matches!(e, HeadError::Framing(_)));
        // HTTP/1.0 with Content-Length is fine.
        let h = head(b"POST / HTTP/1.0\r\nContent-Length: 3\r\n\r\n");
        assert_eq!(h.framing, BodyFraming::Length(3));
        assert_eq!(h.minor_version, 0);
    }

    #[test]
    fn keep_alive_rules() {
        let ka = |raw: &str| head(raw.as_bytes()).keep_alive;
        assert!(ka("GET / HTTP/1.1\r\n\r\n"));
        assert!(ka("GET / HTTP/1.1\r\nConnection: keep-alive\r\n\r\n"));
        assert!(!ka("GET / HTTP/1.1\r\nConnection: close\r\n\r\n"));
        assert!(!ka("GET / HTTP/1.1\r\nConnection: CLOSE\r\n\r\n"));
        assert!(!ka(
            "GET / HTTP/1.1\r\nConnection: upgrade,  Close \r\n\r\n"
        ));
        assert!(!ka(
            "GET / HTTP/1.1\r\nConnection: keep-alive\r\nConnection: close\r\n\r\n"
        ));
        assert!(
            ka("GET / HTTP/1.1\r\nConnection: closed\r\n\r\n"),
            "token, not substring"
        );
        assert!(!ka("GET / HTTP/1.0\r\n\r\n"));
        assert!(ka("GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"));
        assert!(ka("GET / HTTP/1.0\r\nconnection: foo, Keep-Alive\r\n\r\n"));
        assert!(!ka(
            "GET / HTTP/1.0\r\nConnection: keep-alive, close\r\n\r\n"
        ));
        assert!(!ka("GET / HTTP/1.0\r\nKeep-Alive: timeout=5\r\n\r\n"));
    }

    #[test]
    fn expect_continue_rules() {
        let ec = |raw: &str| head(raw.as_bytes()).expect_continue;
        assert!(ec(
            "POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n"
        ));
        assert!(ec("POST / HTTP/1.1\r\nexpect: 100-Continue\r\n\r\n"));
        assert!(!ec("POST / HTTP/1.1\r\n\r\n"));
        assert!(!ec("POST / HTTP/1.1\r\nExpect: 200-ok\r\n\r\n"));
        // RFC 9110 §10.1.1: ignored in HTTP/1.0 requests.
        assert!(!ec("POST / HTTP/1.0\r\nExpect: 100-continue\r\n\r\n"));
    }

    #[test]
    fn unsupported_versions_are_505_garbage_is_400() {
        for raw in [
            &b"GET / HTTP/2.0\r\n\r\n"[..],
            b"GET / HTTP/1.2\r\n\r\n",
            b"GET / HTTP/0.9\r\n\r\n",
            b"GET / HTTP/3.0\r\nHost: a\r\n\r\n",
            b"GET / HTTP/2",
        ] {
            let e = err(raw);
            assert_eq!(e, HeadError::Version, "{:?}", String::from_utf8_lossy(raw));
            assert_eq!(e.status(), 505);
        }
        for raw in [
            &b"GET / FOO/1.1\r\n\r\n"[..],
            b"GET / http/1.1\r\n\r\n",
            b"GET / HTTP/1.1x\r\n\r\n",
            b"GET / HTTP/11\r\n\r\n",
            b"GET /a b HTTP/1.1\r\n\r\n",
        ] {
            let e = err(raw);
            assert!(
                matches!(e, HeadError::Malformed(_)),
                "{:?} gave {e:?}",
                String::from_utf8_lossy(raw)
            );
            assert_eq!(e.status(), 400);
        }
    }

    #[test]
    fn malformed_heads_are_400() {
        for raw in [
            // Space between field name and colon (RFC 9112 §5.1).
            &b"GET / HTTP/1.1\r\nHost : a\r\n\r\n"[..],
            b"GET / HTTP/1.1\r\nHost\t: a\r\n\r\n",
            // Missing colon.
            b"GET / HTTP/1.1\r\nHost a\r\n\r\n",
            b"GET / HTTP/1.1\r\nHosta\r\n\r\n",
            // Obsolete line folding.
            b"GET / HTTP/1.1\r\nX-A: a\r\n b\r\n\r\n",
            b"GET / HTTP/1.1\r\nX-A: a\r\n\tb\r\n\r\n",
            // Whitespace before the first header.
            b"GET / HTTP/1.1\r\n Host: a\r\n\r\n",
            // Bad request lines.
            b"GET\r\n\r\n",
            b"GET /\r\n\r\n",
            b"GET  / HTTP/1.1\r\n\r\n",
            b" GET / HTTP/1.1\r\n\r\n",
            b"G(T / HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1 \r\n\r\n",
            // Control bytes and bare CR.
            b"GET / HTTP/1.1\r\nX-A: a\0b\r\n\r\n",
            b"GET / HTTP/1.1\r\nX-A: a\rb\r\n\r\n",
            b"GET / HTTP/1.1\rHost: a\r\n\r\n",
            b"GET / HTTP/1.1\r\nX-A: a\r\r\n\r\n",
            // Empty header name.
            b"GET / HTTP/1.1\r\n: a\r\n\r\n",
            // Multiple Host fields.
            b"GET / HTTP/1.1\r\nHost: a\r\nhost: b\r\n\r\n",
        ] {
            let e = err(raw);
            assert!(
                matches!(e, HeadError::Malformed(_)),
                "{:?} gave {e:?}",
                String::from_utf8_lossy(raw)
            );
            assert_eq!(e.status(), 400);
        }
    }

    #[test]
    fn error_status_and_messages() {
        assert_eq!(HeadError::Malformed("x").status(), 400);
        assert_eq!(HeadError::Framing("y").status(), 400);
        assert_eq!(HeadError::TooLarge.status(), 431);
        assert_eq!(HeadError::Version.status(), 505);
        assert_eq!(HeadError::Malformed("bad name").message(), "bad name");
        assert_eq!(HeadError::Framing("two lengths").message(), "two lengths");
        assert!(HeadError::TooLarge.message().contains("too large"));
        assert!(HeadError::Version.message().contains("version"));
        let e = framing_of("Content-Length: 1\r\nTransfer-Encoding: chunked\r\n").unwrap_err();
        assert!(
            e.message().contains("Transfer-Encoding") && e.message().contains("Content-Length")
        );
        assert_eq!(e.to_string(), format!("{} (400)", e.message()));
    }

    #[test]
    fn hand_built_spans_never_panic() {
        let h = RequestHead {
            buf: Bytes::from_static(b"GET / HTTP/1.1\r\n\r\n"),
            method: Span {
                start: 100,
                end: 200,
            },
            target: Span { start: 5, end: 1 },
            minor_version: 1,
            headers: vec![HeaderSpan {
                name: Span { start: 0, end: 999 },
                value: Span::default(),
            }],
            framing: BodyFraming::None,
            keep_alive: true,
            expect_continue: false,
        };
        assert_eq!(h.method(), b"");
        assert_eq!(h.target(), b"");
        assert_eq!(h.path(), b"");
        assert_eq!(h.header("x"), None);
        assert_eq!(h.headers().count(), 1);
    }

    // ---- responses ----

    #[test]
    fn response_framing_by_length_chunked_close() {
        let h = resp_ok(
            "HTTP/1.1 200 OK\r\nContent-Length: 12\r\nContent-Type: application/json\r\n\r\n",
        );
        assert_eq!(
            (h.status, h.framing, h.keep_alive),
            (200, BodyFraming::Length(12), true)
        );
        assert_eq!(h.header("content-type"), Some(&b"application/json"[..]));
        assert_eq!(h.headers().count(), 2);

        let h = resp_ok("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert_eq!((h.framing, h.keep_alive), (BodyFraming::Chunked, true));
        let h = resp_ok("HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n");
        assert_eq!(h.framing, BodyFraming::Chunked);
        let h = resp_ok(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: Chunked\r\n\r\n",
        );
        assert_eq!(h.framing, BodyFraming::Chunked);
        // TE overrides CL.
        let h =
            resp_ok("HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert_eq!(h.framing, BodyFraming::Chunked);
        // Final coding not chunked: read until close, so the connection cannot be reused.
        let h = resp_ok("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n");
        assert_eq!((h.framing, h.keep_alive), (BodyFraming::Close, false));
        // No length at all: close-delimited.
        let h = resp_ok("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n");
        assert_eq!((h.framing, h.keep_alive), (BodyFraming::Close, false));
        // No reason phrase.
        let h = resp_ok("HTTP/1.1 404\r\nContent-Length: 0\r\n\r\n");
        assert_eq!((h.status, h.framing), (404, BodyFraming::Length(0)));
    }

    #[test]
    fn response_without_body() {
        for status in [
            "204 No Content",
            "304 Not Modified",
            "100 Continue",
            "101 Switching Protocols",
            "103 Early Hints",
        ] {
            let h = resp_ok(&format!("HTTP/1.1 {status}\r\nContent-Length: 10\r\n\r\n"));
            assert_eq!(h.framing, BodyFraming::None, "{status}");
            assert!(h.keep_alive);
        }
        // Response to HEAD: no body whatever the headers say.
        for extra in [
            "Content-Length: 10\r\n",
            "Transfer-Encoding: chunked\r\n",
            "",
        ] {
            let raw = format!("HTTP/1.1 200 OK\r\n{extra}\r\n");
            let h = resp(raw.as_bytes(), true).unwrap().unwrap();
            assert_eq!(h.framing, BodyFraming::None, "{extra:?}");
            assert!(h.keep_alive);
        }
        assert!(resp_ok("HTTP/1.1 100 Continue\r\n\r\n").is_interim());
        assert!(resp_ok("HTTP/1.1 103 Early Hints\r\n\r\n").is_interim());
        assert!(!resp_ok("HTTP/1.1 101 Switching Protocols\r\n\r\n").is_interim());
        assert!(!resp_ok("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n").is_interim());
    }

    #[test]
    fn response_keep_alive_rules() {
        let ka = |raw: &str| resp_ok(raw).keep_alive;
        assert!(!ka(
            "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\n"
        ));
        assert!(!ka("HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\n"));
        assert!(ka(
            "HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\nContent-Length: 1\r\n\r\n"
        ));
        // Close-delimited never keeps the connection, whatever it says.
        assert!(!ka("HTTP/1.0 200 OK\r\nConnection: keep-alive\r\n\r\n"));
        assert!(!ka("HTTP/1.1 200 OK\r\nConnection: keep-alive\r\n\r\n"));
    }

    #[test]
    fn response_errors() {
        assert!(matches!(
            resp(
                b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
                false
            ),
            Err(HeadError::Framing(_))
        ));
        assert!(matches!(
            resp(b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", false),
            Err(HeadError::Framing(_))
        ));
        assert!(matches!(
            resp(
                b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                false
            ),
            Err(HeadError::Framing(_))
        ));
        assert_eq!(
            resp(b"HTTP/2.0 200 OK\r\n\r\n", false),
            Err(HeadError::Version)
        );
        assert!(matches!(
            resp(b"HTTP/1.1 2x0 OK\r\n\r\n", false),
            Err(HeadError::Malformed(_))
        ));
        assert!(matches!(
            resp(b"HTTP/1.1 200 OK\r\nX : y\r\n\r\n", false),
            Err(HeadError::Malformed(_))
        ));
        assert!(matches!(
            resp(b"HTTX/1.1 200 OK\r\n\r\n", false),
            Err(HeadError::Malformed(_))
        ));
        assert_eq!(resp(b"HTTP/1.1 200 OK\r\nContent-Le", false), Ok(None));
        let limits = HeadLimits {
            max_head_bytes: 64,
            max_headers: 100,
        };
        let mut buf = BytesMut::from(&b"HTTP/1.1 200 OK\r\nX-Long: "[..]);
        buf.extend_from_slice(&[b'a'; 64]);
        assert_eq!(
            parse_response_head(&mut buf, false, &limits),
            Err(HeadError::TooLarge)
        );
    }

    /// Fuzz regression (fuzz/artifacts/head/crash-93fab5ce…): httparse accepts status `024`.
    #[test]
    fn response_status_below_100_is_malformed() {
        for raw in [
            &b"HTTP/1.0 024 No Content\r\nContent-Length: 10\r\n\r\n"[..],
            b"HTTP/1.1 000 X\r\n\r\n",
            b"HTTP/1.1 099\r\n\r\n",
        ] {
            assert_eq!(
                resp(raw, false),
                Err(HeadError::Malformed("invalid status code"))
            );
        }
        assert_eq!(resp_ok("HTTP/1.1 100 Continue\r\n\r\n").status, 100);
        assert_eq!(
            resp_ok("HTTP/1.1 999 Custom\r\nContent-Length: 0\r\n\r\n").status,
            999
        );
    }

    #[test]
    fn response_body_bytes_stay_in_buffer() {
        let mut buf = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"[..],
        );
        let h = parse_response_head(&mut buf, false, &HeadLimits::default())
            .unwrap()
            .unwrap();
        assert_eq!(h.framing, BodyFraming::Chunked);
        assert_eq!(&buf[..], b"5\r\nhello\r\n");
        assert!(h.buf.ends_with(b"\r\n\r\n"));
    }

    // ---- properties ----

    const METHODS: &[&str] = &["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"];

    #[derive(Debug, Clone)]
    struct GenRequest {
        method: &'static str,
        target: String,
        minor: u8,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
        trailing: Vec<u8>,
    }

    fn gen_request() -> impl Strategy<Value = GenRequest> {
        (
            prop::sample::select(METHODS),
            "/[a-zA-Z0-9._~/-]{0,40}(\\?[a-z0-9=&%]{0,20})?",
            0u8..=1,
            prop::collection::vec(("x-[a-z0-9-]{1,16}", "([!-~]([ -~]{0,40}[!-~])?)?"), 0..30),
            prop::collection::vec(any::<u8>(), 0..200),
            prop::collection::vec(any::<u8>(), 0..50),
        )
            .prop_map(
                |(method, target, minor, headers, body, trailing)| GenRequest {
                    method,
                    target,
                    minor,
                    headers,
                    body,
                    trailing,
                },
            )
    }

    fn serialise(r: &GenRequest) -> (Vec<u8>, usize) {
        let mut v = format!(
            "{} {} HTTP/1.{}\r\nHost: example\r\n",
            r.method, r.target, r.minor
        )
        .into_bytes();
        for (n, val) in &r.headers {
            v.extend_from_slice(format!("{n}: {val}\r\n").as_bytes());
        }
        v.extend_from_slice(format!("Content-Length: {}\r\n\r\n", r.body.len()).as_bytes());
        let head_len = v.len();
        v.extend_from_slice(&r.body);
        v.extend_from_slice(&r.trailing);
        (v, head_len)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, rng_seed: proptest::test_runner::RngSeed::Fixed(0x5eed_0001), ..ProptestConfig::default() })]

        #[test]
        fn round_trip_with_random_splits(
            r in gen_request(),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8),
        ) {
            let (wire, head_len) = serialise(&r);
            let mut points: Vec<usize> = cuts.iter().map(|c| c.index(wire.len() + 1)).collect();
            points.push(wire.len());
            points.sort_unstable();
            let limits = HeadLimits::default();
            let mut buf = BytesMut::new();
            let mut fed = 0;
            let mut parsed = None;
            for p in points {
                buf.extend_from_slice(&wire[fed..p]);
                fed = p;
                match parse_request_head(&mut buf, &limits) {
                    Ok(None) => {
                        prop_assert!(fed < head_len, "complete head reported incomplete");
                        prop_assert_eq!(&buf[..], &wire[..fed]);
                    }
                    Ok(Some(h)) => {
                        prop_assert!(fed >= head_len);
                        parsed = Some(h);
                        break;
                    }
                    Err(e) => prop_assert!(false, "valid request refused: {:?}", e),
                }
            }
            let h = parsed.expect("the whole request was fed");
            prop_assert_eq!(&h.buf[..], &wire[..head_len]);
            prop_assert_eq!(&buf[..], &wire[head_len..fed]);
            prop_assert_eq!(h.method(), r.method.as_bytes());
            prop_assert_eq!(h.target(), r.target.as_bytes());
            prop_assert_eq!(h.minor_version, r.minor);
            prop_assert_eq!(h.framing, BodyFraming::Length(r.body.len() as u64));
            prop_assert_eq!(h.keep_alive, r.minor == 1);
            prop_assert_eq!(h.headers.len(), r.headers.len() + 2);
            for ((n, v), (gn, gv)) in h.headers().skip(1).zip(r.headers.iter()) {
                prop_assert_eq!(n, gn.as_bytes());
                prop_assert_eq!(v, gv.as_bytes());
            }
            let q = r.target.find('?');
            prop_assert_eq!(h.path(), &r.target.as_bytes()[..q.unwrap_or(r.target.len())]);
            prop_assert_eq!(h.query(), q.map(|i| &r.target.as_bytes()[i + 1..]));
        }

        #[test]
        fn never_panics_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..1024), was_head: bool) {
            check_invariants(&bytes, was_head);
        }

        #[test]
        fn never_panics_on_head_like_bytes(parts in prop::collection::vec(prop::sample::select(FRAGMENTS), 0..40), was_head: bool) {
            let bytes: Vec<u8> = parts.concat();
            check_invariants(&bytes, was_head);
        }
    }

    const FRAGMENTS: &[&[u8]] = &[
        b"GET ",
        b"POST ",
        b"/",
        b"/a?b=c",
        b" ",
        b"HTTP/1.1",
        b"HTTP/1.0",
        b"HTTP/2.0",
        b"\r\n",
        b"\n",
        b"\r",
        b"Host: a",
        b"Content-Length: ",
        b"Transfer-Encoding: ",
        b"chunked",
        b"gzip",
        b", ",
        b",",
        b"5",
        b"18446744073709551616",
        b"-1",
        b"Connection: ",
        b"close",
        b"keep-alive",
        b"Expect: 100-continue",
        b":",
        b"\t",
        b"\0",
        b"\xff",
        b"200 OK",
        b"204",
        b"HTTP/1.1 ",
    ];

    /// What every parse result must satisfy, whatever the input.
    fn check_invariants(bytes: &[u8], was_head: bool) {
        let limits = HeadLimits {
            max_head_bytes: 512,
            max_headers: 16,
        };
        let mut buf = BytesMut::from(bytes);
        match parse_request_head(&mut buf, &limits) {
            Ok(Some(h)) => {
                assert!(h.buf.len() <= 512);
                assert_eq!(h.buf.len() + buf.len(), bytes.len());
                assert_eq!(&h.buf[..], &bytes[..h.buf.len()]);
                assert!(h.headers.len() <= 16);
                for s in [h.method, h.target]
                    .iter()
                    .chain(h.headers.iter().flat_map(|x| [&x.name, &x.value]))
                {
                    assert!(s.start <= s.end && s.end as usize <= h.buf.len());
                }
                assert!(!h.method().is_empty() && !h.target().is_empty());
                assert_ne!(h.framing, BodyFraming::Close);
                if h.framing == BodyFraming::Chunked {
                    assert_eq!(h.minor_version, 1);
                }
            }
            Ok(None) => {
                assert_eq!(&buf[..], bytes);
                assert!(bytes.len() < 512);
            }
            Err(e) => {
                assert_eq!(&buf[..], bytes);
                assert!(matches!(e.status(), 400 | 431 | 505));
            }
        }
        let mut buf = BytesMut::from(bytes);
        match parse_response_head(&mut buf, was_head, &limits) {
            Ok(Some(h)) => {
                assert_eq!(h.buf.len() + buf.len(), bytes.len());
                for s in h.headers.iter().flat_map(|x| [&x.name, &x.value]) {
                    assert!(s.start <= s.end && s.end as usize <= h.buf.len());
                }
                assert!((100..=999).contains(&h.status));
                if h.framing == BodyFraming::Close {
                    assert!(!h.keep_alive);
                }
                if was_head {
                    assert_eq!(h.framing, BodyFraming::None);
                }
            }
            Ok(None) => assert_eq!(&buf[..], bytes),
            Err(_) => assert_eq!(&buf[..], bytes),
        }
    }
}
