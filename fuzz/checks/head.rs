//! Request and response head parsing on arbitrary bytes. Beyond "no panic", every result must be
//! coherent: spans inside the frozen head, the head exactly the consumed prefix, the buffer left
//! untouched on `None`/`Err`, prefix-consistency (a shorter read of a parsable head is `None`),
//! and re-parsing a parsed head yields the same head.
//!
//! Input layout: byte 0 selects limits, byte 1 a split point for the prefix check, rest = bytes.
//!
//! Shared by the `head` fuzz target and `tests/fuzz_corpus.rs`, which replays the stored
//! inputs in `cargo test`: one copy of the checks, so a stored input is held to exactly what the
//! fuzzer holds it to.

use bytes::BytesMut;
use radixgate::http::{
    parse_request_head, parse_response_head, BodyFraming, HeadLimits, HeaderSpan, Span,
};

fn check_spans(len: usize, spans: impl IntoIterator<Item = Span>) {
    for s in spans {
        assert!(s.start <= s.end, "inverted span {s:?}");
        assert!(s.end as usize <= len, "span {s:?} past head of {len} bytes");
    }
}

fn header_spans(headers: &[HeaderSpan]) -> impl Iterator<Item = Span> + '_ {
    headers.iter().flat_map(|h| [h.name, h.value])
}

/// Runs the checks on one input; panics where the fuzzer would report a crash.
pub fn run(data: &[u8]) {
    let [flags, cut, input @ ..] = data else {
        return;
    };
    let limits = HeadLimits {
        max_head_bytes: if flags & 1 == 0 { 64 * 1024 } else { 256 },
        max_headers: if flags & 2 == 0 { 100 } else { 4 },
    };
    let was_head = flags & 4 != 0;

    // ---- request ----
    let mut buf = BytesMut::from(input);
    match parse_request_head(&mut buf, &limits) {
        Ok(Some(h)) => {
            let n = h.buf.len();
            assert!(n <= limits.max_head_bytes);
            assert!(h.headers.len() <= limits.max_headers);
            assert_eq!(&h.buf[..], &input[..n]);
            assert_eq!(&buf[..], &input[n..]);
            check_spans(
                n,
                [h.method, h.target]
                    .into_iter()
                    .chain(header_spans(&h.headers)),
            );
            assert!(!h.method().is_empty() && !h.target().is_empty());
            assert!(h.minor_version <= 1);
            assert_ne!(
                h.framing,
                BodyFraming::Close,
                "requests are never close-delimited"
            );
            if h.framing == BodyFraming::Chunked {
                assert_eq!(h.minor_version, 1);
                assert!(h.header("content-length").is_none());
            }
            assert!(h.path().len() <= h.target().len());
            // Prefix consistency: any shorter read is incomplete.
            let k = usize::from(*cut) * n / 256;
            let mut prefix = BytesMut::from(&input[..k]);
            assert_eq!(
                parse_request_head(&mut prefix, &limits),
                Ok(None),
                "prefix {k} of {n}"
            );
            // Idempotence: the frozen head alone parses to the same head.
            let mut again = BytesMut::from(&h.buf[..]);
            let h2 = parse_request_head(&mut again, &limits)
                .expect("re-parse")
                .expect("complete");
            assert_eq!(h2, h);
            assert!(again.is_empty());
        }
        Ok(None) => {
            assert_eq!(&buf[..], input);
            assert!(input.len() < limits.max_head_bytes);
        }
        Err(e) => {
            assert_eq!(&buf[..], input);
            assert!(matches!(e.status(), 400 | 431 | 505));
            assert!(!e.message().is_empty());
        }
    }

    // ---- response ----
    let mut buf = BytesMut::from(input);
    match parse_response_head(&mut buf, was_head, &limits) {
        Ok(Some(h)) => {
            let n = h.buf.len();
            assert!(n <= limits.max_head_bytes);
            assert_eq!(&h.buf[..], &input[..n]);
            assert_eq!(&buf[..], &input[n..]);
            check_spans(n, header_spans(&h.headers));
            assert!((100..=999).contains(&h.status));
            if h.framing == BodyFraming::Close {
                assert!(!h.keep_alive);
            }
            if was_head || h.status < 200 || h.status == 204 || h.status == 304 {
                assert_eq!(h.framing, BodyFraming::None);
            }
            let mut again = BytesMut::from(&h.buf[..]);
            let h2 = parse_response_head(&mut again, was_head, &limits)
                .expect("re-parse")
                .expect("complete");
            assert_eq!(h2, h);
        }
        Ok(None) | Err(_) => assert_eq!(&buf[..], input),
    }
}
