//! Responses the gateway writes itself (errors, local endpoints, 100 Continue), rendered into a
//! single buffer so each is one write.

use bytes::Bytes;

/// `HTTP/1.1 100 Continue\r\n\r\n`.
pub const CONTINUE_100: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// Canonical reason phrase for a status code ("Unknown" otherwise).
pub fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        101 => "Switching Protocols",
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        203 => "Non-Authoritative Information",
        204 => "No Content",
        205 => "Reset Content",
        206 => "Partial Content",
        301 => "Moved Permanently",
        302 => "Found",
        303 => "See Other",
        304 => "Not Modified",
        307 => "Temporary Redirect",
        308 => "Permanent Redirect",
        400 => "Bad Request",
        401 => "Unauthorized",
        402 => "Payment Required",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        406 => "Not Acceptable",
        407 => "Proxy Authentication Required",
        408 => "Request Timeout",
        409 => "Conflict",
        410 => "Gone",
        411 => "Length Required",
        412 => "Precondition Failed",
        413 => "Content Too Large",
        414 => "URI Too Long",
        415 => "Unsupported Media Type",
        416 => "Range Not Satisfiable",
        417 => "Expectation Failed",
        421 => "Misdirected Request",
        422 => "Unprocessable Content",
        425 => "Too Early",
        426 => "Upgrade Required",
        428 => "Precondition Required",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        _ => "Unknown",
    }
}

/// Render a complete response: status line, `content-type`, `content-length`, each extra header
/// (name, value), `connection: close` when `close` is set, then the body.
///
/// Statuses that cannot carry a body (1xx, 204, 304) get neither body nor body headers. A
/// status outside 100..=999 is rendered as 500 rather than as an invalid status line. CR, LF
/// and NUL in header names or values are replaced by spaces, so a value echoed from elsewhere
/// can never split the response.
pub fn render(
    status: u16,
    content_type: &str,
    extra_headers: &[(&str, &str)],
    body: &[u8],
    close: bool,
) -> Bytes {
    let status = if (100..=999).contains(&status) {
        status
    } else {
        500
    };
    let bodyless = (100..200).contains(&status) || status == 204 || status == 304;
    let extras: usize = extra_headers
        .iter()
        .map(|(n, v)| n.len() + v.len() + 4)
        .sum();
    let mut out = Vec::with_capacity(96 + content_type.len() + extras + body.len());
    out.extend_from_slice(b"HTTP/1.1 ");
    push_decimal(&mut out, u64::from(status));
    out.push(b' ');
    out.extend_from_slice(reason(status).as_bytes());
    out.extend_from_slice(b"\r\n");
    if !bodyless {
        push_header(&mut out, "content-type", content_type);
        out.extend_from_slice(b"content-length: ");
        push_decimal(&mut out, body.len() as u64);
        out.extend_from_slice(b"\r\n");
    }
    for (name, value) in extra_headers {
        push_header(&mut out, name, value);
    }
    if close {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    if !bodyless {
        out.extend_from_slice(body);
    }
    Bytes::from(out)
}

/// An OpenAI-style error body: `{"error":{"message":..,"type":..,"code":status}}` (message JSON-escaped).
pub fn error_body(status: u16, error_type: &str, message: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(48 + message.len() + error_type.len());
    out.extend_from_slice(b"{\"error\":{\"message\":");
    push_json_string(&mut out, message);
    out.extend_from_slice(b",\"type\":");
    push_json_string(&mut out, error_type);
    out.extend_from_slice(b",\"code\":");
    push_decimal(&mut out, u64::from(status));
    out.extend_from_slice(b"}}");
    out
}

/// A full error response with the OpenAI-style body.
pub fn error_response(
    status: u16,
    error_type: &str,
    message: &str,
    extra_headers: &[(&str, &str)],
    close: bool,
) -> Bytes {
    let body = error_body(status, error_type, message);
    render(status, "application/json", extra_headers, &body, close)
}

/// Append `s` as a JSON string literal (RFC 8259 §7): quotes and backslashes escaped, control
/// characters as `\u00XX` (with the short forms for the common ones); everything else, including
/// non-ASCII UTF-8, copied through in runs.
pub fn push_json_string(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut run_start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let short: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x00..=0x1f => b"",
            _ => continue,
        };
        out.extend_from_slice(&bytes[run_start..i]);
        run_start = i + 1;
        if short.is_empty() {
            out.extend_from_slice(b"\\u00");
            out.push(HEX[usize::from(b >> 4)]);
            out.push(HEX[usize::from(b & 0xf)]);
        } else {
            out.extend_from_slice(short);
        }
    }
    out.extend_from_slice(&bytes[run_start..]);
    out.push(b'"');
}

/// Append a header line, neutralising bytes that would end the line early.
fn push_header(out: &mut Vec<u8>, name: &str, value: &str) {
    push_sanitized(out, name.as_bytes());
    out.extend_from_slice(b": ");
    push_sanitized(out, value.as_bytes());
    out.extend_from_slice(b"\r\n");
}

fn push_sanitized(out: &mut Vec<u8>, s: &[u8]) {
    out.extend(s.iter().map(|&b| match b {
        b'\r' | b'\n' | 0 => b' ',
        _ => b,
    }));
}

/// Append `n` in decimal without going through `fmt` (no `Result` to handle).
fn push_decimal(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse_error_body(body: &[u8]) -> (String, String, u64) {
        let v: serde_json::Value = serde_json::from_slice(body)
            .unwrap_or_else(|e| panic!("invalid JSON {:?}: {e}", String::from_utf8_lossy(body)));
        let err = &v["error"];
        (
            err["message"].as_str().unwrap().to_owned(),
            err["type"].as_str().unwrap().to_owned(),
            err["code"].as_u64().unwrap(),
        )
    }

    #[test]
    fn reasons() {
        assert_eq!(reason(200), "OK");
        assert_eq!(reason(400), "Bad Request");
        assert_eq!(reason(413), "Content Too Large");
        assert_eq!(reason(431), "Request Header Fields Too Large");
        assert_eq!(reason(502), "Bad Gateway");
        assert_eq!(reason(505), "HTTP Version Not Supported");
        assert_eq!(reason(299), "Unknown");
    }

    #[test]
    fn render_exact_bytes() {
        let r = render(200, "text/plain", &[], b"ok", false);
        assert_eq!(
            &r[..],
            &b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"[..]
        );
        let r = render(
            503,
            "application/json",
            &[("x-request-id", "abc"), ("retry-after", "1")],
            b"{}",
            true,
        );
        assert_eq!(
            &r[..],
            &b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: 2\r\nx-request-id: abc\r\nretry-after: 1\r\nconnection: close\r\n\r\n{}"[..]
        );
        let r = render(404, "text/plain", &[], b"", false);
        assert!(r.ends_with(b"content-length: 0\r\n\r\n"));
    }

    #[test]
    fn render_output_parses_back() {
        let body = vec![b'x'; 12345];
        let r = render(
            201,
            "application/json",
            &[("location", "/workers/7")],
            &body,
            false,
        );
        let mut headers = [httparse::EMPTY_HEADER; 8];
        let mut resp = httparse::Response::new(&mut headers);
        let n = match resp.parse(&r).unwrap() {
            httparse::Status::Complete(n) => n,
            httparse::Status::Partial => panic!("partial"),
        };
        assert_eq!(resp.code, Some(201));
        assert_eq!(resp.reason, Some("Created"));
        assert_eq!(r.len() - n, body.len());
        let cl = resp
            .headers
            .iter()
            .find(|h| h.name == "content-length")
            .unwrap();
        assert_eq!(cl.value, b"12345");
    }

    #[test]
    fn bodyless_statuses_have_no_body_or_length() {
        for status in [100, 101, 204, 304] {
            let r = render(status, "text/plain", &[("x-a", "b")], b"ignored", false);
            let text = std::str::from_utf8(&r).unwrap();
            assert!(
                !text.contains("content-length") && !text.contains("content-type"),
                "{text}"
            );
            assert!(text.ends_with("x-a: b\r\n\r\n"), "{text}");
        }
    }

    #[test]
    fn invalid_status_renders_as_500() {
        assert!(render(0, "text/plain", &[], b"", false)
            .starts_with(b"HTTP/1.1 500 Internal Server Error\r\n"));
        assert!(render(1000, "text/plain", &[], b"", false).starts_with(b"HTTP/1.1 500 "));
    }

    #[test]
    fn header_injection_is_neutralised() {
        let r = render(
            200,
            "text/plain\r\nx-evil: 1",
            &[("x-id", "a\r\n\r\nHTTP/1.1 200 OK"), ("x\nb", "v\0")],
            b"",
            false,
        );
        let text = std::str::from_utf8(&r).unwrap();
        // Exactly one blank line (the end of the head) and no extra header lines.
        assert_eq!(text.matches("\r\n\r\n").count(), 1);
        assert_eq!(text.matches("\r\n").count(), 6);
        assert!(text.contains("x-id: a    HTTP/1.1 200 OK\r\n"));
        assert!(!text.contains('\0'));
    }

    #[test]
    fn continue_constant() {
        assert_eq!(CONTINUE_100, b"HTTP/1.1 100 Continue\r\n\r\n");
    }

    #[test]
    fn error_body_exact_and_escaped() {
        assert_eq!(
            error_body(400, "invalid_request_error", "bad"),
            br#"{"error":{"message":"bad","type":"invalid_request_error","code":400}}"#.to_vec()
        );
        assert_eq!(
            error_body(502, "t", "a\"b\\c\nd\u{1}e\u{1f}f"),
            br#"{"error":{"message":"a\"b\\c\nd\u0001e\u001ff","type":"t","code":502}}"#.to_vec()
        );
    }

    #[test]
    fn nasty_messages_round_trip_through_serde_json() {
        let mut all_controls = String::new();
        for c in 0u8..0x20 {
            all_controls.push(char::from(c));
        }
        for msg in [
            "",
            "\"",
            "\\",
            "\\\"",
            "\"\\\"\\\\",
            "quote \" back \\ slash / solidus",
            all_controls.as_str(),
            "\u{7f} del, \u{80} and \u{9f} (C1), \u{2028}\u{2029} separators",
            "unicode: héllo wörld — 日本語 🎉",
            "}\"},\"injected\":{\"x\":\"",
            "\\u0000 literally",
            "trailing backslash \\",
        ] {
            let body = error_body(418, "type \"with\" \\ quotes\n", msg);
            let (m, t, code) = parse_error_body(&body);
            assert_eq!(m, msg);
            assert_eq!(t, "type \"with\" \\ quotes\n");
            assert_eq!(code, 418);
        }
    }

    #[test]
    fn error_response_is_complete() {
        let r = error_response(
            429,
            "rate_limit_error",
            "slow down",
            &[("retry-after", "1")],
            true,
        );
        let text = std::str::from_utf8(&r).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 429 Too Many Requests\r\n"));
        assert!(head.contains("content-type: application/json\r\n"));
        assert!(head.contains(&format!("content-length: {}\r\n", body.len())));
        assert!(head.ends_with("retry-after: 1\r\nconnection: close"));
        assert_eq!(
            parse_error_body(body.as_bytes()),
            ("slow down".into(), "rate_limit_error".into(), 429)
        );
    }

    #[test]
    fn decimal_formatting() {
        for n in [0u64, 7, 10, 99, 100, 12345, u64::MAX] {
            let mut v = Vec::new();
            push_decimal(&mut v, n);
            assert_eq!(v, n.to_string().into_bytes());
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, rng_seed: proptest::test_runner::RngSeed::Fixed(0x5eed_0003), ..ProptestConfig::default() })]

        #[test]
        fn any_message_is_valid_json(msg in any::<String>(), ty in "[ -~\\n\\t]{0,20}", status in 100u16..600) {
            let (m, t, code) = parse_error_body(&error_body(status, &ty, &msg));
            prop_assert_eq!(m, msg);
            prop_assert_eq!(t, ty);
            prop_assert_eq!(code, u64::from(status));
        }
    }
}
