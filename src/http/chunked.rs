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
    /// Only the tests read it: callers count the bytes they forward.
    #[cfg(test)]
    pub fn declared_len(&self) -> u64 {
        self.machine.body_len
    }
}

/// Follows a chunked response that is forwarded verbatim, to learn where it ends.
#[derive(Debug)]
pub struct ChunkTracker {
    machine: Machine,
    /// The last two data bytes seen (a blank line before any data: a stream that has sent
    /// nothing is between events).
    tail: [u8; 2],
}

impl ChunkTracker {
    /// A tracker at the start of a chunked body; no size limit (the upstream is trusted to
    /// stream as much as it likes, the client reads it as it goes).
    pub fn new() -> Self {
        ChunkTracker {
            machine: Machine::new(u64::MAX),
            tail: *b"\n\n",
        }
    }

    /// Feed the next bytes of the body. Returns `Ok(Some(n))` when the message ends after the
    /// first `n` bytes of `input` (bytes past `n` are not part of this response), `Ok(None)` when
    /// more is needed. After the end, further calls return `Ok(Some(0))`.
    pub fn feed(&mut self, input: &[u8]) -> Result<Option<usize>, ChunkError> {
        let tail = &mut self.tail;
        let consumed = self.machine.run(input, |data| match data {
            [] => {}
            [b] => *tail = [tail[1], *b],
            [.., a, b] => *tail = [*a, *b],
        })?;
        Ok(self.is_done().then_some(consumed))
    }

    /// Between chunks (the next byte would start a chunk-size line): a proxy may append its own
    /// chunk here, e.g. an error event when the upstream breaks off.
    pub fn at_chunk_boundary(&self) -> bool {
        self.machine.state == State::SizeStart
    }

    /// The data so far ends with a blank line (or there is none yet): in a server-sent event
    /// stream, between two events. A chunk boundary alone is not one: a server may split an
    /// event over two chunks (aiohttp frames every write as a chunk), and an event appended
    /// after half of one would fuse with it.
    pub fn at_event_boundary(&self) -> bool {
        self.tail == *b"\n\n"
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
        match self.state {
            State::SizeStart | State::Size | State::SizeWs | State::Ext | State::SizeLf => {
                self.size_line_byte(b)
            }
            State::DataCr | State::DataLf => self.data_end_byte(b),
            State::TrailerStart
            | State::TrailerName
            | State::TrailerValue
            | State::TrailerLf
            | State::EndLf => self.trailer_byte(b),
            // `run` handles these without calling `byte`.
            State::Data | State::Done | State::Failed(_) => Ok(()),
        }
    }

    /// A byte of a chunk-size line: hex digits, optional whitespace and extensions, CRLF.
    fn size_line_byte(&mut self, b: u8) -> Result<(), ChunkError> {
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
            _ => {}
        }
        Ok(())
    }

    /// The CRLF after a chunk's data.
    fn data_end_byte(&mut self, b: u8) -> Result<(), ChunkError> {
        use ChunkError::Malformed;
        match self.state {
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
            _ => {}
        }
        Ok(())
    }

    /// A byte of the trailer section and the final CRLF.
    fn trailer_byte(&mut self, b: u8) -> Result<(), ChunkError> {
        use ChunkError::Malformed;
        match self.state {
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
            _ => {}
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
mod tests;
