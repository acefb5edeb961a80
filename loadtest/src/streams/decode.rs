//! The streaming client's response reader: an HTTP/1.1 response head, then a chunked (or
//! Content-Length) body read as SSE, fed whatever each `read` returned. Chunks, lines and
//! events may be split across reads anywhere, and one read may hold several; each `data:`
//! event is reported with the `sent_ns` stamp it carries. Incremental so a read costs only its
//! own bytes: no buffering of the whole answer, no JSON parse.

/// A head larger than this is malformed (a proxy's answer head is a few hundred bytes).
const MAX_HEAD: usize = 16 << 10;
/// An SSE line longer than this is malformed (the upstream's are ~200 bytes).
const MAX_LINE: usize = 64 << 10;

/// One SSE `data:` event, as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A data event, with its `sent_ns` stamp when it has one.
    Data(Option<u64>),
    /// `data: [DONE]`.
    Done,
}

/// What went wrong with an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeError {
    /// The status was not 200 (the body is not read).
    Status(u16),
    /// Not HTTP as expected (bad head, bad chunk size, oversized line ...).
    Malformed(&'static str),
}

/// Progress after feeding bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feed {
    /// The answer is not over yet; every byte was taken.
    More,
    /// The answer ended after this many of the bytes fed; the decoder is ready for the next.
    End(usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Head,
    /// Reading a chunk-size line (hex digits, maybe extensions).
    ChunkSize,
    /// Inside a chunk: this many data bytes left.
    ChunkData(usize),
    /// The CRLF after a chunk's data: this many bytes of it left.
    ChunkEnd(u8),
    /// After the 0 chunk: trailer lines until an empty one.
    Trailer,
    /// A Content-Length body: this many bytes left.
    Sized(usize),
}

/// Reads one answer after another from a keep-alive connection.
#[derive(Debug)]
pub struct Decoder {
    state: State,
    /// Partial head, chunk-size line or trailer line.
    pending: Vec<u8>,
    /// Partial SSE line.
    line: Vec<u8>,
    /// The current answer's status.
    status: u16,
    /// The current answer said `Connection: close`.
    close: bool,
}

impl Default for Decoder {
    fn default() -> Self {
        Self::new()
    }
}

fn parse_hex(s: &[u8]) -> Option<usize> {
    let s = match memchr::memchr(b';', s) {
        Some(i) => &s[..i],
        None => s,
    };
    let s = s.trim_ascii();
    if s.is_empty() || s.len() > 15 {
        return None;
    }
    s.iter().try_fold(0usize, |n, &b| {
        let d = (b as char).to_digit(16)?;
        Some(n * 16 + d as usize)
    })
}

/// The number after `"sent_ns":` in an event line.
fn sent_ns(line: &[u8]) -> Option<u64> {
    let key = b"\"sent_ns\":";
    let i = memchr::memmem::rfind(line, key)?;
    let rest = line[i + key.len()..].trim_ascii_start();
    let n = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    if n == 0 || n > 19 {
        return None;
    }
    rest[..n].iter().try_fold(0u64, |v, &b| {
        v.checked_mul(10)?.checked_add(u64::from(b - b'0'))
    })
}

impl Decoder {
    /// Ready for an answer's head.
    pub fn new() -> Decoder {
        Decoder {
            state: State::Head,
            pending: Vec::new(),
            line: Vec::new(),
            status: 0,
            close: false,
        }
    }

    /// Forget any partial answer (the connection was replaced).
    pub fn reset(&mut self) {
        self.state = State::Head;
        self.pending.clear();
        self.line.clear();
        self.status = 0;
        self.close = false;
    }

    /// Whether the last answer's head said `Connection: close` (the server will close after
    /// it: open a new connection, without counting an error).
    pub fn close_requested(&self) -> bool {
        self.close
    }

    /// Whether it is between answers (no byte of the next one read yet).
    pub fn idle(&self) -> bool {
        self.state == State::Head && self.pending.is_empty()
    }

    /// Feed the next bytes read; `on_event` hears every SSE event completed by them.
    pub fn feed(
        &mut self,
        mut data: &[u8],
        on_event: &mut impl FnMut(Event),
    ) -> Result<Feed, DecodeError> {
        let total = data.len();
        while !data.is_empty() {
            match self.state {
                State::Head => {
                    // Only the new bytes can complete the blank line (plus 3 carried over).
                    let from = self.pending.len().saturating_sub(3);
                    self.pending.extend_from_slice(data);
                    let Some(end) = memchr::memmem::find(&self.pending[from..], b"\r\n\r\n")
                        .map(|i| from + i + 4)
                    else {
                        if self.pending.len() > MAX_HEAD {
                            return Err(DecodeError::Malformed("answer head too large"));
                        }
                        return Ok(Feed::More);
                    };
                    let taken = data.len() - (self.pending.len() - end);
                    data = &data[taken..];
                    let next = self.head(end)?;
                    self.pending.clear();
                    self.state = next;
                    if next == State::Sized(0) {
                        self.state = State::Head;
                        return Ok(Feed::End(total - data.len()));
                    }
                }
                State::ChunkSize | State::Trailer => {
                    let Some(nl) = memchr::memchr(b'\n', data) else {
                        self.pending.extend_from_slice(data);
                        if self.pending.len() > MAX_HEAD {
                            return Err(DecodeError::Malformed("chunk-size line too long"));
                        }
                        return Ok(Feed::More);
                    };
                    self.pending.extend_from_slice(&data[..nl]);
                    data = &data[nl + 1..];
                    let line = self.pending.strip_suffix(b"\r").unwrap_or(&self.pending);
                    if self.state == State::Trailer {
                        let empty = line.is_empty();
                        self.pending.clear();
                        if empty {
                            self.state = State::Head;
                            self.end_of_body(on_event);
                            return Ok(Feed::End(total - data.len()));
                        }
                        continue;
                    }
                    let size = parse_hex(line).ok_or(DecodeError::Malformed("bad chunk size"))?;
                    self.pending.clear();
                    self.state = if size == 0 {
                        State::Trailer
                    } else {
                        State::ChunkData(size)
                    };
                }
                State::ChunkData(left) => {
                    let n = left.min(data.len());
                    self.body(&data[..n], on_event)?;
                    data = &data[n..];
                    self.state = if n == left {
                        State::ChunkEnd(2)
                    } else {
                        State::ChunkData(left - n)
                    };
                }
                State::ChunkEnd(left) => {
                    let want: &[u8] = if left == 2 { b"\r\n" } else { b"\n" };
                    let n = (left as usize).min(data.len());
                    if data[..n] != want[..n] {
                        return Err(DecodeError::Malformed("chunk not followed by CRLF"));
                    }
                    data = &data[n..];
                    self.state = if n == left as usize {
                        State::ChunkSize
                    } else {
                        State::ChunkEnd(left - n as u8)
                    };
                }
                State::Sized(left) => {
                    let n = left.min(data.len());
                    self.body(&data[..n], on_event)?;
                    data = &data[n..];
                    if n == left {
                        self.state = State::Head;
                        self.end_of_body(on_event);
                        return Ok(Feed::End(total - data.len()));
                    }
                    self.state = State::Sized(left - n);
                }
            }
        }
        Ok(Feed::More)
    }

    /// The head in `pending[..end]`: the state its body starts in.
    fn head(&mut self, end: usize) -> Result<State, DecodeError> {
        let head = &self.pending[..end - 4];
        let mut lines = head
            .split(|&b| b == b'\n')
            .map(|l| l.strip_suffix(b"\r").unwrap_or(l));
        let status_line = lines.next().unwrap_or_default();
        let mut parts = status_line.splitn(3, |&b| b == b' ');
        let version = parts.next().unwrap_or_default();
        if !version.starts_with(b"HTTP/1.") {
            return Err(DecodeError::Malformed("not an HTTP/1.x answer"));
        }
        let code = parts.next().unwrap_or_default();
        let status = std::str::from_utf8(code)
            .ok()
            .and_then(|s| s.parse::<u16>().ok())
            .ok_or(DecodeError::Malformed("bad status line"))?;
        self.status = status;
        self.close = false;
        let (mut chunked, mut length) = (false, None);
        for l in lines {
            let Some(colon) = memchr::memchr(b':', l) else {
                return Err(DecodeError::Malformed("header without a colon"));
            };
            let (name, value) = (&l[..colon], l[colon + 1..].trim_ascii());
            if name.eq_ignore_ascii_case(b"transfer-encoding") {
                chunked = value
                    .split(|&b| b == b',')
                    .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"chunked"));
            } else if name.eq_ignore_ascii_case(b"connection") {
                self.close = value
                    .split(|&b| b == b',')
                    .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"close"));
            } else if name.eq_ignore_ascii_case(b"content-length") {
                length = std::str::from_utf8(value)
                    .ok()
                    .and_then(|s| s.parse::<usize>().ok());
                if length.is_none() {
                    return Err(DecodeError::Malformed("bad Content-Length"));
                }
            }
        }
        if status != 200 {
            return Err(DecodeError::Status(status));
        }
        if chunked {
            Ok(State::ChunkSize)
        } else if let Some(n) = length {
            Ok(State::Sized(n))
        } else {
            Err(DecodeError::Malformed("neither chunked nor Content-Length"))
        }
    }

    /// Body bytes: split into SSE lines.
    fn body(
        &mut self,
        mut data: &[u8],
        on_event: &mut impl FnMut(Event),
    ) -> Result<(), DecodeError> {
        while let Some(nl) = memchr::memchr(b'\n', data) {
            if self.line.is_empty() {
                line_event(&data[..nl], on_event);
            } else {
                self.line.extend_from_slice(&data[..nl]);
                let line = std::mem::take(&mut self.line);
                line_event(&line, on_event);
                self.line = line;
                self.line.clear();
            }
            data = &data[nl + 1..];
        }
        self.line.extend_from_slice(data);
        if self.line.len() > MAX_LINE {
            return Err(DecodeError::Malformed("SSE line too long"));
        }
        Ok(())
    }

    /// The body ended: a last line without its newline still counts.
    fn end_of_body(&mut self, on_event: &mut impl FnMut(Event)) {
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            line_event(&line, on_event);
        }
    }
}

fn line_event(line: &[u8], on_event: &mut impl FnMut(Event)) {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let Some(data) = line.strip_prefix(b"data:") else {
        return;
    };
    let data = data.trim_ascii();
    if data == b"[DONE]" {
        on_event(Event::Done);
    } else {
        on_event(Event::Data(sent_ns(data)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer() -> Vec<u8> {
        let mut a = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        for (i, ns) in [11u64, 22, 33].iter().enumerate() {
            let ev = format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"t{i}\"}}}}],\"sent_ns\":{ns}}}\n\n");
            a.extend_from_slice(format!("{:x}\r\n{ev}\r\n", ev.len()).as_bytes());
        }
        a.extend_from_slice(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n");
        a
    }

    fn run(d: &mut Decoder, pieces: &[&[u8]]) -> (Vec<Event>, Option<usize>) {
        let mut events = Vec::new();
        let mut end = None;
        let mut offset = 0;
        for p in pieces {
            match d.feed(p, &mut |e| events.push(e)).expect("decodes") {
                Feed::More => assert!(end.is_none(), "bytes after the end"),
                Feed::End(n) => end = Some(offset + n),
            }
            offset += p.len();
        }
        (events, end)
    }

    fn want() -> Vec<Event> {
        vec![
            Event::Data(Some(11)),
            Event::Data(Some(22)),
            Event::Data(Some(33)),
            Event::Done,
        ]
    }

    #[test]
    fn an_answer_split_at_every_byte_pair_decodes_the_same() {
        let a = answer();
        for i in 0..a.len() {
            for j in i..a.len() {
                let mut d = Decoder::new();
                let (ev, end) = run(&mut d, &[&a[..i], &a[i..j], &a[j..]]);
                assert_eq!(ev, want(), "split at {i}, {j}");
                assert_eq!(end, Some(a.len()), "split at {i}, {j}");
                assert!(d.idle());
            }
        }
    }

    #[test]
    fn two_answers_in_one_read_end_after_the_first() {
        let a = answer();
        let mut both = a.clone();
        both.extend_from_slice(&a);
        let mut d = Decoder::new();
        let mut events = Vec::new();
        let Ok(Feed::End(n)) = d.feed(&both, &mut |e| events.push(e)) else {
            panic!("first answer not ended")
        };
        assert_eq!(n, a.len());
        assert_eq!(events, want());
        events.clear();
        assert_eq!(
            d.feed(&both[n..], &mut |e| events.push(e)),
            Ok(Feed::End(a.len()))
        );
        assert_eq!(events, want());
    }

    #[test]
    fn statuses_and_garbage_are_errors_not_panics() {
        let mut d = Decoder::new();
        assert_eq!(
            d.feed(
                b"HTTP/1.1 503 Busy\r\ncontent-length: 0\r\n\r\n",
                &mut |_| {}
            ),
            Err(DecodeError::Status(503))
        );
        for bad in [
            &b"SSH-2.0\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nabXY",
            b"HTTP/1.1 200 OK\r\n\r\n",
        ] {
            let mut d = Decoder::new();
            assert!(
                matches!(d.feed(bad, &mut |_| {}), Err(DecodeError::Malformed(_))),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        let mut d = Decoder::new();
        let mut events = Vec::new();
        let body = "data: {\"sent_ns\":5}\n\nxx";
        let sized = format!(
            "HTTP/1.1 200 OK\r\nConnection: close\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        assert_eq!(
            d.feed(sized.as_bytes(), &mut |e| events.push(e)),
            Ok(Feed::End(sized.len()))
        );
        assert!(d.close_requested());
        assert_eq!(events, vec![Event::Data(Some(5))]);
    }
}
