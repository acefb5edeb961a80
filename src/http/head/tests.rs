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
    assert!(e.message().contains("Transfer-Encoding") && e.message().contains("Content-Length"));
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
    let h =
        resp_ok("HTTP/1.1 200 OK\r\nContent-Length: 12\r\nContent-Type: application/json\r\n\r\n");
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
    let h =
        resp_ok("HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: Chunked\r\n\r\n");
    assert_eq!(h.framing, BodyFraming::Chunked);
    // TE overrides CL.
    let h = resp_ok("HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n");
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
    let mut buf =
        BytesMut::from(&b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"[..]);
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
