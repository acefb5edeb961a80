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
    /// An HTTP/1.0 client: it gets no chunked framing and the connection closes after the
    /// response (the end of a body it cannot frame is the close).
    pub fn is_http10(&self) -> bool {
        self.minor_version == 0
    }

    /// Method token, e.g. `POST` (forwarded as it came).
    pub fn method(&self) -> &[u8] {
        self.method.slice(&self.buf)
    }

    /// The method, for routing decisions.
    pub fn method_kind(&self) -> super::Method {
        super::Method::parse(self.method())
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
    pub fn headers(&self) -> impl Iterator<Item = (&[u8], &[u8])> + Clone + '_ {
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
    let (window, max_head, slots) = head_window(buf, limits);
    let mut storage = header_storage();
    let mut req = httparse::Request::new(&mut []);
    let head_len = match req.parse_with_uninit_headers(window, &mut storage[..slots]) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return incomplete(window, max_head).map(|()| None),
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

/// The bytes a head may occupy (the front of `buf`, capped at the head limit), that limit, and
/// the header slots the parser may fill.
fn head_window<'b>(buf: &'b [u8], limits: &HeadLimits) -> (&'b [u8], usize, usize) {
    let max_head = effective_max_head(limits);
    let window = &buf[..buf.len().min(max_head)];
    (window, max_head, limits.max_headers.min(MAX_HEADERS_CAP))
}

/// A head not complete within `window`: wait for more bytes, unless the window is already at
/// `max_head` (it is capped there), which means the head needs more than `max_head` bytes.
fn incomplete(window: &[u8], max_head: usize) -> Result<(), HeadError> {
    if window.len() >= max_head {
        Err(HeadError::TooLarge)
    } else {
        Ok(())
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
    let (window, max_head, slots) = head_window(buf, limits);
    let mut storage = header_storage();
    let mut resp = httparse::Response::new(&mut []);
    let parsed = httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut resp,
        window,
        &mut storage[..slots],
    );
    let head_len = match parsed {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return incomplete(window, max_head).map(|()| None),
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
pub fn list_elements(value: &[u8]) -> impl Iterator<Item = &[u8]> {
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
mod tests;
