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
        "rate_limit_exceeded",
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
        ("slow down".into(), "rate_limit_exceeded".into(), 429)
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
