//! The paced upstream's HTTP/1.1 request reader: just enough for what a proxy sends (a request
//! line, headers, a Content-Length body; keep-alive and pipelining), from a buffer that may hold
//! a partial request or several. Bad input is an answer (`Bad`), never a panic.

/// Largest request head accepted: a proxy's headers are a few hundred bytes.
pub const MAX_HEAD: usize = 64 << 10;
/// Largest request body accepted.
pub const MAX_BODY: usize = 16 << 20;

/// What the routes need from one request.
#[derive(Debug, PartialEq, Eq)]
pub struct Request<'a> {
    /// `GET`, `POST`, ...
    pub method: &'a [u8],
    /// The path without its query string.
    pub path: &'a [u8],
    /// The body (empty without Content-Length).
    pub body: &'a [u8],
    /// Whether the connection stays open after the answer (HTTP/1.1 unless `Connection:
    /// close`; HTTP/1.0 only with `Connection: keep-alive`).
    pub keep_alive: bool,
}

/// Outcome of looking at the front of a connection's buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Parse<'a> {
    /// A whole request, and how many bytes of the buffer it took.
    Done(Request<'a>, usize),
    /// Not all of it has arrived.
    Partial,
    /// Not a request this server can read: answer 400 and close.
    Bad(&'static str),
}

fn trim(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

fn parse_usize(s: &[u8]) -> Option<usize> {
    if s.is_empty() || s.len() > 12 {
        return None;
    }
    s.iter().try_fold(0usize, |n, &b| {
        b.is_ascii_digit().then(|| n * 10 + (b - b'0') as usize)
    })
}

/// Read the request at the front of `buf`.
pub fn parse(buf: &[u8]) -> Parse<'_> {
    let Some(head_end) = memchr::memmem::find(buf, b"\r\n\r\n") else {
        return if buf.len() > MAX_HEAD {
            Parse::Bad("request head too large")
        } else {
            Parse::Partial
        };
    };
    if head_end > MAX_HEAD {
        return Parse::Bad("request head too large");
    }
    let head = &buf[..head_end];
    let mut lines = head
        .split(|&b| b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l));
    let line = lines.next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ').filter(|p| !p.is_empty());
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Parse::Bad("bad request line");
    };
    let http11 = match version {
        b"HTTP/1.1" => true,
        b"HTTP/1.0" => false,
        _ => return Parse::Bad("not HTTP/1.x"),
    };
    let path = match memchr::memchr(b'?', target) {
        Some(i) => &target[..i],
        None => target,
    };
    let mut length = 0usize;
    let mut keep_alive = http11;
    for line in lines {
        let Some(colon) = memchr::memchr(b':', line) else {
            return Parse::Bad("header without a colon");
        };
        let (name, value) = (&line[..colon], trim(&line[colon + 1..]));
        if name.eq_ignore_ascii_case(b"content-length") {
            match parse_usize(value) {
                Some(n) if n <= MAX_BODY => length = n,
                Some(_) => return Parse::Bad("body too large"),
                None => return Parse::Bad("bad Content-Length"),
            }
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            return Parse::Bad("chunked request bodies are not supported");
        } else if name.eq_ignore_ascii_case(b"connection") {
            for token in value.split(|&b| b == b',').map(trim) {
                if token.eq_ignore_ascii_case(b"close") {
                    keep_alive = false;
                } else if token.eq_ignore_ascii_case(b"keep-alive") {
                    keep_alive = true;
                }
            }
        }
    }
    let start = head_end + 4;
    if buf.len() - start < length {
        return Parse::Partial;
    }
    Parse::Done(
        Request {
            method,
            path,
            body: &buf[start..start + length],
            keep_alive,
        },
        start + length,
    )
}

/// How many events to stream: the body's `max_tokens` (OpenAI) or `max_new_tokens` (SGLang's
/// `/generate`), found by a byte search rather than a JSON parse; `default` when absent,
/// capped at `cap`.
pub fn max_tokens(body: &[u8], default: u32, cap: u32) -> u32 {
    for key in [
        &b"\"max_tokens\""[..],
        b"\"max_completion_tokens\"",
        b"\"max_new_tokens\"",
    ] {
        let Some(i) = memchr::memmem::find(body, key) else {
            continue;
        };
        let rest = &body[i + key.len()..];
        let rest = trim_start(rest);
        let Some(rest) = rest.strip_prefix(b":") else {
            continue;
        };
        let rest = trim_start(rest);
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        if let Some(n) = parse_usize(&rest[..digits]) {
            return n.min(cap as usize) as u32;
        }
    }
    default.min(cap)
}

fn trim_start(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t' | b'\r' | b'\n', rest @ ..] = s {
        s = rest;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const POST: &[u8] = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 26\r\n\r\n{\"max_tokens\": 5,\"a\":\"b\"} ";

    #[test]
    fn a_request_arriving_in_pieces_parses_only_when_whole() {
        for cut in 0..POST.len() {
            assert_eq!(parse(&POST[..cut]), Parse::Partial, "cut at {cut}");
        }
        let Parse::Done(r, used) = parse(POST) else {
            panic!("whole request not parsed")
        };
        assert_eq!(used, POST.len());
        assert_eq!(r.method, b"POST");
        assert_eq!(r.path, b"/v1/chat/completions");
        assert_eq!(r.body.len(), 26);
        assert!(r.keep_alive);
        assert_eq!(max_tokens(r.body, 64, 1000), 5);
    }

    #[test]
    fn pipelined_requests_parse_one_after_another() {
        let mut buf = POST.to_vec();
        buf.extend_from_slice(
            b"GET /health?x=1 HTTP/1.1\r\nConnection: close\r\n\r\nGET /v1/models HTTP/1.0\r\n\r\n",
        );
        let Parse::Done(_, a) = parse(&buf) else {
            panic!()
        };
        let Parse::Done(r, b) = parse(&buf[a..]) else {
            panic!()
        };
        assert_eq!(
            (r.method, r.path, r.keep_alive),
            (&b"GET"[..], &b"/health"[..], false)
        );
        let Parse::Done(r, c) = parse(&buf[a + b..]) else {
            panic!()
        };
        assert_eq!((r.path, r.keep_alive), (&b"/v1/models"[..], false));
        assert_eq!(a + b + c, buf.len());
    }

    #[test]
    fn bad_requests_are_refused_not_panicked_on() {
        for bad in [
            &b"GARBAGE\r\n\r\n"[..],
            b"GET / HTTP/2\r\n\r\n",
            b"GET / HTTP/1.1\r\nno colon\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: 999999999999\r\n\r\n",
            b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
        ] {
            assert!(
                matches!(parse(bad), Parse::Bad(_)),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        assert!(matches!(parse(&vec![b'a'; MAX_HEAD + 1]), Parse::Bad(_)));
    }

    #[test]
    fn max_tokens_is_found_by_a_byte_search() {
        assert_eq!(max_tokens(b"{\"max_tokens\" :\n 12}", 64, 100), 12);
        assert_eq!(
            max_tokens(b"{\"sampling_params\":{\"max_new_tokens\":7}}", 64, 100),
            7
        );
        assert_eq!(max_tokens(b"{\"max_tokens\":null}", 64, 100), 64);
        assert_eq!(max_tokens(b"{}", 64, 100), 64);
        assert_eq!(max_tokens(b"{\"max_tokens\":5000}", 64, 100), 100);
    }
}
