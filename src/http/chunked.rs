//! Chunked transfer coding (RFC 9112 §7.1) as byte state machines: a decoder for request bodies
//! (the gateway needs the whole body to route) and a tracker for responses (passed through raw,
//! the tracker only finds where the message ends).
//!
//! Both share one state machine ([`Machine`]), so they agree byte for byte on where a message
//! ends and on what is malformed. The machine is strict where leniency enables smuggling: every
//! line must end in CRLF (a bare LF is an error), the size is 1–16 hex digits, and whitespace
//! after the size is only accepted before an extension (`BWS ";"`). Extensions and trailers are
//! syntax-checked, bounded, and discarded.

use bytes::BytesMut;

/// Most hex digits in a chunk size: 16 digits are exactly 64 bits, so the size never overflows.
const MAX_SIZE_DIGITS: u8 = 16;
/// Longest extension text (from `;` to CR) on one chunk-size line.
pub const MAX_EXT_PER_CHUNK: usize = 4 * 1024;
/// Total extension bytes over one message: extensions are never used by real clients, so a
/// stream of tiny chunks with maximal extensions must not be a cheap way to burn gateway CPU.
pub const MAX_EXT_TOTAL: usize = 64 * 1024;
/// Largest trailer section (all trailer lines plus the final CRLF).
pub const MAX_TRAILER_BYTES: usize = 16 * 1024;

/// A chunked body that cannot be decoded; answered with 400 (or 413 for `TooLarge`) and close.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChunkError {
    /// Bad chunk-size line, missing CRLF, bad trailer syntax.
    Malformed(&'static str),
    /// Decoded body exceeds the limit.
    TooLarge,
}

impl ChunkError {
    /// The status code the server answers with (400 or 413).
    pub fn status(&self) -> u16 {
        match self {
            ChunkError::Malformed(_) => 400,
            ChunkError::TooLarge => 413,
        }
    }

    /// A short human-readable reason, used in the JSON error body.
    pub fn message(&self) -> &'static str {
        match self {
            ChunkError::Malformed(detail) => detail,
            ChunkError::TooLarge => "request body too large",
        }
    }
}

impl std::fmt::Display for ChunkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message(), self.status())
    }
}

impl std::error::Error for ChunkError {}

/// Decodes a chunked request body incrementally into a contiguous buffer.
#[derive(Debug)]
pub struct ChunkedDecoder {
    machine: Machine,
}

impl ChunkedDecoder {
    /// `max_body`: largest decoded body accepted.
    pub fn new(max_body: u64) -> Self {
        ChunkedDecoder {
            machine: Machine::new(max_body),
        }
    }

    /// Feed input. Decoded data is appended to `out`. Returns the number of input bytes consumed;
    /// fewer than `input.len()` only when the body ended (the rest belongs to the next request).
    ///
    /// A chunk whose declared size would take the body past `max_body` is refused with
    /// `TooLarge` as soon as its size line is complete, before any of its data is buffered.
    /// After the end, further calls consume nothing; after an error, they repeat the error.
    pub fn feed(&mut self, input: &[u8], out: &mut BytesMut) -> Result<usize, ChunkError> {
        self.machine.run(input, |data| out.extend_from_slice(data))
    }

    /// The terminating chunk and trailers have been consumed.
    pub fn is_done(&self) -> bool {
        self.machine.state == State::Done
    }

    /// Decoded bytes so far, counting declared sizes of chunks whose data is still arriving.
    pub fn declared_len(&self) -> u64 {
        self.machine.body_len
    }
}

/// Follows a chunked response that is forwarded verbatim, to learn where it ends.
#[derive(Debug)]
pub struct ChunkTracker {
    machine: Machine,
}

impl ChunkTracker {
    /// A tracker at the start of a chunked body; no size limit (the upstream is trusted to
    /// stream as much as it likes, the client reads it as it goes).
    pub fn new() -> Self {
        ChunkTracker {
            machine: Machine::new(u64::MAX),
        }
    }

    /// Feed the next bytes of the body. Returns `Ok(Some(n))` when the message ends after the
    /// first `n` bytes of `input` (bytes past `n` are not part of this response), `Ok(None)` when
    /// more is needed. After the end, further calls return `Ok(Some(0))`.
    pub fn feed(&mut self, input: &[u8]) -> Result<Option<usize>, ChunkError> {
        let consumed = self.machine.run(input, |_| {})?;
        Ok(self.is_done().then_some(consumed))
    }

    /// Between chunks (the next byte would start a chunk-size line): a proxy may append its own
    /// chunk here, e.g. an error event when the upstream breaks off.
    pub fn at_chunk_boundary(&self) -> bool {
        self.machine.state == State::SizeStart
    }

    /// The terminating chunk and trailers have been seen.
    pub fn is_done(&self) -> bool {
        self.machine.state == State::Done
    }
}

impl Default for ChunkTracker {
    fn default() -> Self {
        Self::new()
    }
}

/// Where the machine is inside `chunk-size [chunk-ext] CRLF chunk-data CRLF ... last-chunk
/// trailer-section CRLF`.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Before the first hex digit of a chunk size.
    SizeStart,
    /// Inside the hex digits.
    Size,
    /// Whitespace after the size: only `;` (an extension) may follow.
    SizeWs,
    /// Inside the extensions, up to CR.
    Ext,
    /// CR of the size line seen; LF must follow.
    SizeLf,
    /// Inside chunk data; `remaining` bytes left.
    Data,
    /// Data over; CR must follow.
    DataCr,
    /// CR after data seen; LF must follow.
    DataLf,
    /// Start of a trailer line, or the CR of the final empty line.
    TrailerStart,
    /// Inside a trailer field name.
    TrailerName,
    /// Inside a trailer field value.
    TrailerValue,
    /// CR of a trailer line seen; LF must follow.
    TrailerLf,
    /// CR of the final empty line seen; LF must follow.
    EndLf,
    /// The message is complete.
    Done,
    /// An error was reported; it is repeated on every later call.
    Failed(ChunkError),
}

/// The shared chunked state machine; `run` hands decoded data to a callback.
#[derive(Debug)]
struct Machine {
    state: State,
    /// Size being parsed, then the data bytes left in the current chunk.
    remaining: u64,
    digits: u8,
    ext_len: usize,
    ext_total: usize,
    trailer_len: usize,
    /// Sum of the declared chunk sizes so far.
    body_len: u64,
    max_body: u64,
}

/// RFC 9110 `tchar`.
#[inline]
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Field-value / extension bytes: HTAB, visible ASCII, SP and obs-text; no other controls.
#[inline]
fn is_text(b: u8) -> bool {
    b == b'\t' || (b' '..=b'~').contains(&b) || b >= 0x80
}

#[inline]
fn hex_value(b: u8) -> Option<u64> {
    match b {
        b'0'..=b'9' => Some(u64::from(b - b'0')),
        b'a'..=b'f' => Some(u64::from(b - b'a' + 10)),
        b'A'..=b'F' => Some(u64::from(b - b'A' + 10)),
        _ => None,
    }
}

impl Machine {
    fn new(max_body: u64) -> Self {
        Machine {
            state: State::SizeStart,
            remaining: 0,
            digits: 0,
            ext_len: 0,
            ext_total: 0,
            trailer_len: 0,
            body_len: 0,
            max_body,
        }
    }

    /// Consume `input` up to the end of the message (or all of it), passing chunk data to
    /// `on_data` in as few calls as the input allows. Returns the bytes consumed.
    fn run(&mut self, input: &[u8], mut on_data: impl FnMut(&[u8])) -> Result<usize, ChunkError> {
        let mut i = 0;
        while i < input.len() {
            match self.state {
                State::Done => break,
                State::Failed(ref e) => return Err(e.clone()),
                State::Data => {
                    // Bulk path: hand over as much of the chunk as this input holds.
                    let avail = (input.len() - i) as u64;
                    let take = self.remaining.min(avail) as usize;
                    on_data(&input[i..i + take]);
                    i += take;
                    self.remaining -= take as u64;
                    if self.remaining == 0 {
                        self.state = State::DataCr;
                    }
                }
                _ => {
                    if let Err(e) = self.byte(input[i]) {
                        self.state = State::Failed(e.clone());
                        return Err(e);
                    }
                    i += 1;
                }
            }
        }
        if let State::Failed(ref e) = self.state {
            return Err(e.clone());
        }
        Ok(i)
    }

    /// Advance over one framing byte (never called in `Data`, `Done` or `Failed`).
    fn byte(&mut self, b: u8) -> Result<(), ChunkError> {
        use ChunkError::Malformed;
        match self.state {
            State::SizeStart => {
                let v = hex_value(b).ok_or(Malformed("chunk size is not a hex number"))?;
                self.remaining = v;
                self.digits = 1;
                self.ext_len = 0;
                self.state = State::Size;
            }
            State::Size => match b {
                b'\r' => self.state = State::SizeLf,
                b';' => self.begin_ext()?,
                b' ' | b'\t' => self.state = State::SizeWs,
                b'\n' => return Err(Malformed("bare LF after chunk size")),
                _ => {
                    let v = hex_value(b).ok_or(Malformed("invalid byte in chunk size"))?;
                    if self.digits >= MAX_SIZE_DIGITS {
                        return Err(Malformed("chunk size has too many digits"));
                    }
                    self.digits += 1;
                    // At most 15 digits (60 bits) are shifted here, so nothing is lost.
                    self.remaining = (self.remaining << 4) | v;
                }
            },
            State::SizeWs => match b {
                b' ' | b'\t' => {}
                b';' => self.begin_ext()?,
                _ => return Err(Malformed("whitespace after chunk size")),
            },
            State::Ext => match b {
                b'\r' => self.state = State::SizeLf,
                b'\n' => return Err(Malformed("bare LF after chunk extension")),
                _ if is_text(b) => self.count_ext()?,
                _ => return Err(Malformed("control byte in chunk extension")),
            },
            State::SizeLf => {
                if b != b'\n' {
                    return Err(Malformed("chunk size line not terminated by CRLF"));
                }
                if self.remaining == 0 {
                    self.state = State::TrailerStart;
                } else {
                    self.body_len = self
                        .body_len
                        .checked_add(self.remaining)
                        .filter(|&n| n <= self.max_body)
                        .ok_or(ChunkError::TooLarge)?;
                    self.state = State::Data;
                }
            }
            State::DataCr => {
                if b != b'\r' {
                    return Err(Malformed("chunk data not followed by CRLF"));
                }
                self.state = State::DataLf;
            }
            State::DataLf => {
                if b != b'\n' {
                    return Err(Malformed("chunk data not followed by CRLF"));
                }
                self.state = State::SizeStart;
            }
            State::TrailerStart => {
                self.count_trailer()?;
                match b {
                    b'\r' => self.state = State::EndLf,
                    _ if is_tchar(b) => self.state = State::TrailerName,
                    _ => return Err(Malformed("invalid trailer field")),
                }
            }
            State::TrailerName => {
                self.count_trailer()?;
                match b {
                    b':' => self.state = State::TrailerValue,
                    _ if is_tchar(b) => {}
                    _ => return Err(Malformed("invalid trailer field name")),
                }
            }
            State::TrailerValue => {
                self.count_trailer()?;
                match b {
                    b'\r' => self.state = State::TrailerLf,
                    _ if is_text(b) => {}
                    _ => return Err(Malformed("invalid byte in trailer field value")),
                }
            }
            State::TrailerLf => {
                self.count_trailer()?;
                if b != b'\n' {
                    return Err(Malformed("trailer line not terminated by CRLF"));
                }
                self.state = State::TrailerStart;
            }
            State::EndLf => {
                if b != b'\n' {
                    return Err(Malformed("chunked body not terminated by CRLF"));
                }
                self.state = State::Done;
            }
            // `run` handles these without calling `byte`.
            State::Data | State::Done | State::Failed(_) => {}
        }
        Ok(())
    }

    fn begin_ext(&mut self) -> Result<(), ChunkError> {
        self.state = State::Ext;
        self.count_ext()
    }

    fn count_ext(&mut self) -> Result<(), ChunkError> {
        self.ext_len += 1;
        self.ext_total += 1;
        if self.ext_len > MAX_EXT_PER_CHUNK || self.ext_total > MAX_EXT_TOTAL {
            return Err(ChunkError::Malformed("chunk extension too long"));
        }
        Ok(())
    }

    fn count_trailer(&mut self) -> Result<(), ChunkError> {
        self.trailer_len += 1;
        if self.trailer_len > MAX_TRAILER_BYTES {
            return Err(ChunkError::Malformed("trailer section too large"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
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
}
