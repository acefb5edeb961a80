use super::*;
use proptest::prelude::*;

const BIG: u64 = 1 << 30;

/// Decode all of `input` in one feed: (decoded, consumed, done).
fn decode(input: &[u8]) -> Result<(Vec<u8>, usize, bool), ChunkError> {
    let mut d = ChunkedDecoder::new(BIG);
    let mut out = BytesMut::new();
    let n = d.feed(input, &mut out)?;
    Ok((out.to_vec(), n, d.is_done()))
}

fn decode_err(input: &[u8]) -> ChunkError {
    match decode(input) {
        Err(e) => e,
        Ok(r) => panic!(
            "expected an error for {:?}, got {r:?}",
            String::from_utf8_lossy(input)
        ),
    }
}

fn track(input: &[u8]) -> Result<Option<usize>, ChunkError> {
    ChunkTracker::new().feed(input)
}

#[test]
fn decodes_simple_body() {
    let wire = b"5\r\nhello\r\n7\r\n, world\r\n0\r\n\r\n";
    assert_eq!(
        decode(wire),
        Ok((b"hello, world".to_vec(), wire.len(), true))
    );
    assert_eq!(track(wire), Ok(Some(wire.len())));
}

#[test]
fn empty_body_and_hex_forms() {
    assert_eq!(decode(b"0\r\n\r\n"), Ok((vec![], 5, true)));
    assert_eq!(decode(b"000\r\n\r\n"), Ok((vec![], 7, true)));
    let wire = b"A\r\n0123456789\r\na\r\n0123456789\r\n0\r\n\r\n";
    assert_eq!(decode(wire).unwrap().0, b"01234567890123456789".to_vec());
    // 16 digits (leading zeros included) is the most accepted.
    let wire = b"0000000000000003\r\nabc\r\n0\r\n\r\n";
    assert_eq!(decode(wire).unwrap().0, b"abc".to_vec());
}

#[test]
fn pipelined_bytes_are_not_consumed() {
    let body = b"3\r\nabc\r\n0\r\n\r\n";
    let mut wire = body.to_vec();
    wire.extend_from_slice(b"GET /next HTTP/1.1\r\n\r\n");
    let (out, n, done) = decode(&wire).unwrap();
    assert_eq!((out.as_slice(), n, done), (&b"abc"[..], body.len(), true));
    assert_eq!(track(&wire), Ok(Some(body.len())));
}

#[test]
fn extensions_are_accepted_and_ignored() {
    for wire in [
        &b"5;foo=bar\r\nhello\r\n0\r\n\r\n"[..],
        b"5;foo\r\nhello\r\n0;last\r\n\r\n",
        b"5 ;a=b\r\nhello\r\n0\r\n\r\n",
        b"5\t; a = \"q;\\\"x\" ;b\r\nhello\r\n0\r\n\r\n",
        b"5;\xc3\xa9=1\r\nhello\r\n0\r\n\r\n",
    ] {
        assert_eq!(
            decode(wire).map(|r| r.0),
            Ok(b"hello".to_vec()),
            "{:?}",
            String::from_utf8_lossy(wire)
        );
    }
}

#[test]
fn trailers_are_consumed() {
    let wire = b"5\r\nhello\r\n0\r\nX-Checksum: abc\r\nX-Other:\r\nX-Sp: a b\tc\r\n\r\nNEXT";
    let (out, n, done) = decode(wire).unwrap();
    assert_eq!(
        (out.as_slice(), n, done),
        (&b"hello"[..], wire.len() - 4, true)
    );
    assert_eq!(track(wire), Ok(Some(wire.len() - 4)));
}

#[test]
fn malformed_bodies_are_rejected() {
    for wire in [
        // Size line.
        &b"\r\nhello\r\n0\r\n\r\n"[..],
        b"g\r\n",
        b"-5\r\n",
        b"+5\r\n",
        b"0x5\r\nhello\r\n",
        b" 5\r\nhello\r\n",
        b"5 \r\nhello\r\n0\r\n\r\n",
        b"5 x\r\n",
        b"00000000000000005\r\nhello\r\n",
        b"10000000000000000\r\n",
        b"5\nhello\r\n0\r\n\r\n",
        b"5\rhello\r\n",
        b"5;a\nhello\r\n",
        b"5;a\0b\r\nhello\r\n",
        b"5;a\rb\r\nhello\r\n",
        // Data terminator.
        b"5\r\nhello\n0\r\n\r\n",
        b"5\r\nhelloX\r\n0\r\n\r\n",
        b"5\r\nhello\r0\r\n\r\n",
        b"5\r\nhello0\r\n\r\n",
        // Last chunk / trailers.
        b"0\n\r\n",
        b"0\r\n\n",
        b"0\r\n\rX",
        b"0\r\nX-A: b\n\r\n",
        b"0\r\nX-A: b\r\r\n",
        b"0\r\n folded: x\r\n\r\n",
        b"0\r\nX-A b\r\n\r\n",
        b"0\r\nX A: b\r\n\r\n",
        b"0\r\n: b\r\n\r\n",
        b"0\r\nX-A: \x01\r\n\r\n",
    ] {
        let e = decode_err(wire);
        assert!(
            matches!(e, ChunkError::Malformed(_)),
            "{:?} gave {e:?}",
            String::from_utf8_lossy(wire)
        );
        assert_eq!(e.status(), 400);
        assert!(
            track(wire).is_err(),
            "tracker accepted {:?}",
            String::from_utf8_lossy(wire)
        );
    }
}

#[test]
fn size_limit_is_checked_at_the_size_line() {
    let mut d = ChunkedDecoder::new(10);
    let mut out = BytesMut::new();
    // 11 declared bytes: refused before any data arrives.
    assert_eq!(d.feed(b"b\r\n", &mut out), Err(ChunkError::TooLarge));
    assert!(out.is_empty());
    // The limit counts across chunks.
    let mut d = ChunkedDecoder::new(10);
    assert_eq!(d.feed(b"5\r\nhello\r\n", &mut out), Ok(10));
    assert_eq!(d.declared_len(), 5);
    assert_eq!(d.feed(b"6\r\n", &mut out), Err(ChunkError::TooLarge));
    // Exactly the limit is fine.
    let mut d = ChunkedDecoder::new(10);
    let mut out = BytesMut::new();
    let wire = b"5\r\nhello\r\n5\r\nworld\r\n0\r\n\r\n";
    assert_eq!(d.feed(wire, &mut out), Ok(wire.len()));
    assert_eq!(&out[..], b"helloworld");
    // The largest 16-digit size is a clean TooLarge, not an overflow.
    assert_eq!(decode_err(b"ffffffffffffffff\r\n"), ChunkError::TooLarge);
    assert_eq!(decode_err(b"ffffffffffffffff\r\n").status(), 413);
    let mut d = ChunkedDecoder::new(u64::MAX);
    assert_eq!(
        d.feed(b"1\r\nx\r\nffffffffffffffff\r\n", &mut out),
        Err(ChunkError::TooLarge)
    );
    // The tracker has no limit.
    assert_eq!(track(b"ffffffffffffffff\r\nabc"), Ok(None));
}

#[test]
fn extension_and_trailer_bounds() {
    let ext_ok = format!("1;{}\r\nx\r\n0\r\n\r\n", "a".repeat(MAX_EXT_PER_CHUNK - 1));
    assert_eq!(decode(ext_ok.as_bytes()).unwrap().0, b"x".to_vec());
    let ext_long = format!("1;{}\r\nx\r\n0\r\n\r\n", "a".repeat(MAX_EXT_PER_CHUNK));
    assert_eq!(
        decode_err(ext_long.as_bytes()),
        ChunkError::Malformed("chunk extension too long")
    );
    // Per-message total: many chunks each under the per-chunk bound.
    let chunk = format!("1;{}\r\nx\r\n", "a".repeat(MAX_EXT_PER_CHUNK - 1));
    let many = chunk.repeat(MAX_EXT_TOTAL / MAX_EXT_PER_CHUNK + 1);
    assert_eq!(
        decode_err(many.as_bytes()),
        ChunkError::Malformed("chunk extension too long")
    );
    let fine = chunk.repeat(MAX_EXT_TOTAL / MAX_EXT_PER_CHUNK) + "0\r\n\r\n";
    assert!(decode(fine.as_bytes()).unwrap().2);

    let trailer_ok = format!("0\r\nX: {}\r\n\r\n", "v".repeat(MAX_TRAILER_BYTES - 10));
    assert!(decode(trailer_ok.as_bytes()).unwrap().2);
    let trailer_big = format!("0\r\nX: {}\r\n\r\n", "v".repeat(MAX_TRAILER_BYTES));
    assert_eq!(
        decode_err(trailer_big.as_bytes()),
        ChunkError::Malformed("trailer section too large")
    );
}

#[test]
fn done_consumes_nothing_and_errors_repeat() {
    let mut d = ChunkedDecoder::new(BIG);
    let mut out = BytesMut::new();
    assert_eq!(d.feed(b"0\r\n\r\n", &mut out), Ok(5));
    assert!(d.is_done());
    assert_eq!(d.feed(b"more", &mut out), Ok(0));
    assert_eq!(d.feed(b"", &mut out), Ok(0));

    let mut d = ChunkedDecoder::new(BIG);
    let e = d.feed(b"zz", &mut out).unwrap_err();
    assert_eq!(d.feed(b"0\r\n\r\n", &mut out), Err(e.clone()));
    assert!(!d.is_done());

    let mut t = ChunkTracker::default();
    assert_eq!(t.feed(b"0\r\n"), Ok(None));
    assert_eq!(t.feed(b"\r\nXY"), Ok(Some(2)));
    assert!(t.is_done());
    assert_eq!(t.feed(b"XY"), Ok(Some(0)));
    let mut t = ChunkTracker::new();
    assert!(t.feed(b"5\nabc").is_err());
    assert!(t.feed(b"0\r\n\r\n").is_err());
}

#[test]
fn empty_feeds_are_harmless() {
    let mut d = ChunkedDecoder::new(BIG);
    let mut out = BytesMut::new();
    for piece in [
        &b""[..],
        b"3\r",
        b"",
        b"\nab",
        b"",
        b"c\r\n0\r\n",
        b"",
        b"\r\n",
    ] {
        assert_eq!(d.feed(piece, &mut out), Ok(piece.len()));
    }
    assert!(d.is_done());
    assert_eq!(&out[..], b"abc");
}

#[test]
fn tracker_follows_an_sse_stream_one_read_at_a_time() {
    let events = [
        "data: {\"token\":\"Hel\"}\n\n",
        "data: {\"token\":\"lo\"}\n\n",
        "data: [DONE]\n\n",
    ];
    let mut t = ChunkTracker::new();
    for ev in events {
        let read = format!("{:x}\r\n{ev}\r\n", ev.len());
        assert_eq!(t.feed(read.as_bytes()), Ok(None));
    }
    assert_eq!(t.feed(b"0\r\n\r\n"), Ok(Some(5)));
}

#[test]
fn tracker_knows_whether_the_data_so_far_ends_between_events() {
    let mut t = ChunkTracker::new();
    assert!(t.at_event_boundary(), "nothing sent yet");
    // One event split over two chunks, the blank line itself split over two reads.
    assert_eq!(t.feed(b"9\r\ndata: {\"a\r\n"), Ok(None));
    assert!(t.at_chunk_boundary() && !t.at_event_boundary());
    assert_eq!(t.feed(b"4\r\n\":1}\r\n2\r\n\n"), Ok(None));
    assert!(!t.at_event_boundary(), "one newline of the two");
    assert_eq!(t.feed(b"\n\r\n"), Ok(None));
    assert!(t.at_chunk_boundary() && t.at_event_boundary());
    // A one-byte chunk keeps the byte before it in view.
    assert_eq!(t.feed(b"1\r\nx\r\n"), Ok(None));
    assert!(!t.at_event_boundary());
}

#[test]
fn error_status_and_messages() {
    assert_eq!(ChunkError::TooLarge.status(), 413);
    assert_eq!(ChunkError::Malformed("x").status(), 400);
    assert_eq!(ChunkError::Malformed("x").message(), "x");
    assert!(ChunkError::TooLarge.message().contains("too large"));
}

// ---- properties ----

const EXTENSIONS: &[&str] = &["", ";a", ";a=b", " ;name=\"q;uoted\"", "\t;x=1;y=2", ";"];
const TRAILERS: &[&str] = &["", "X-Sum: 1\r\n", "a:\r\nB: c d\r\n"];

#[derive(Debug, Clone)]
struct Encoded {
    body: Vec<u8>,
    wire: Vec<u8>,
    /// Where the chunked message ends inside `wire`.
    end: usize,
}

fn encoded() -> impl Strategy<Value = Encoded> {
    (
        prop::collection::vec(any::<u8>(), 0..3000),
        prop::collection::vec(
            (
                1usize..400,
                prop::sample::select(EXTENSIONS),
                0usize..3,
                any::<bool>(),
            ),
            1..40,
        ),
        prop::sample::select(EXTENSIONS),
        prop::sample::select(TRAILERS),
        prop::collection::vec(any::<u8>(), 0..40),
    )
        .prop_map(|(body, chunks, last_ext, trailers, pipelined)| {
            let mut wire = Vec::new();
            let mut at = 0;
            let mut specs = chunks.iter().cycle();
            while at < body.len() {
                // `chunks` is non-empty, so the cycle never ends.
                let &(size, ext, zeros, upper) = specs.next().unwrap();
                let n = size.min(body.len() - at);
                let hex = if upper {
                    format!("{n:X}")
                } else {
                    format!("{n:x}")
                };
                wire.extend_from_slice("0".repeat(zeros).as_bytes());
                wire.extend_from_slice(format!("{hex}{ext}\r\n").as_bytes());
                wire.extend_from_slice(&body[at..at + n]);
                wire.extend_from_slice(b"\r\n");
                at += n;
            }
            wire.extend_from_slice(format!("0{last_ext}\r\n{trailers}\r\n").as_bytes());
            let end = wire.len();
            wire.extend_from_slice(&pipelined);
            Encoded { body, wire, end }
        })
}

fn split(wire: &[u8], cuts: &[prop::sample::Index]) -> Vec<std::ops::Range<usize>> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c.index(wire.len() + 1)).collect();
    points.push(0);
    points.push(wire.len());
    points.sort_unstable();
    points.windows(2).map(|w| w[0]..w[1]).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, rng_seed: proptest::test_runner::RngSeed::Fixed(0x5eed_0002), ..ProptestConfig::default() })]

    #[test]
    fn decoder_round_trip_with_random_splits(
        enc in encoded(),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..60),
    ) {
        let mut d = ChunkedDecoder::new(enc.body.len() as u64);
        let mut out = BytesMut::new();
        let mut end = None;
        for range in split(&enc.wire, &cuts) {
            let piece = &enc.wire[range.clone()];
            let n = d.feed(piece, &mut out).expect("valid body refused");
            if end.is_none() {
                if d.is_done() {
                    end = Some(range.start + n);
                } else {
                    prop_assert_eq!(n, piece.len(), "consumed less without being done");
                }
            } else {
                prop_assert_eq!(n, 0);
            }
        }
        prop_assert_eq!(end, Some(enc.end));
        prop_assert_eq!(&out[..], &enc.body[..]);
    }

    #[test]
    fn tracker_finds_the_end_with_random_splits(
        enc in encoded(),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..60),
    ) {
        let mut t = ChunkTracker::new();
        let mut end = None;
        for range in split(&enc.wire, &cuts) {
            match t.feed(&enc.wire[range.clone()]).expect("valid body refused") {
                Some(n) if end.is_none() => end = Some(range.start + n),
                Some(n) => prop_assert_eq!(n, 0),
                None => prop_assert!(end.is_none()),
            }
        }
        prop_assert_eq!(end, Some(enc.end));
    }

    #[test]
    fn decoder_and_tracker_agree_on_arbitrary_bytes(
        bytes in prop::collection::vec(prop::sample::select(&b"0123456789abcdefABCDEFxyz;= \t\r\n:\"\0"[..]), 0..300),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..10),
    ) {
        prop_assert_eq!(outcome_decoder(&bytes, &cuts), outcome_tracker(&bytes, &cuts));
    }

    #[test]
    fn never_panics_on_arbitrary_bytes(
        bytes in prop::collection::vec(any::<u8>(), 0..300),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..10),
    ) {
        prop_assert_eq!(outcome_decoder(&bytes, &cuts), outcome_tracker(&bytes, &cuts));
    }
}

/// Ok(Some(end)) | Ok(None) (needs more) | Err(malformed) for a decoder fed in pieces.
fn outcome_decoder(
    bytes: &[u8],
    cuts: &[prop::sample::Index],
) -> Result<Option<usize>, ChunkError> {
    let mut d = ChunkedDecoder::new(u64::MAX);
    let mut out = BytesMut::new();
    for range in split(bytes, cuts) {
        let n = d.feed(&bytes[range.clone()], &mut out)?;
        assert!(out.len() <= bytes.len());
        if d.is_done() {
            return Ok(Some(range.start + n));
        }
        assert_eq!(n, range.len());
    }
    Ok(None)
}

fn outcome_tracker(
    bytes: &[u8],
    cuts: &[prop::sample::Index],
) -> Result<Option<usize>, ChunkError> {
    let mut t = ChunkTracker::new();
    for range in split(bytes, cuts) {
        if let Some(n) = t.feed(&bytes[range.clone()])? {
            return Ok(Some(range.start + n));
        }
    }
    Ok(None)
}
