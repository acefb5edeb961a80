//! Relaying a worker's response to the client as it arrives: every upstream read is written to
//! the client at once (SSE tokens are never held), and the client write is the backpressure. A
//! client that goes away aborts the upstream request by closing it; a worker that breaks an
//! event stream off gets the client an explicit error event and a clean end. An HTTP/1.0
//! client gets the body without chunked framing (decoded here) and the close as its end.

use super::capture::Capture;
use super::forward::{named_by_connection, skip, UpstreamResponse};
use super::io::{read_expecting, write_all_by, write_all_returning};
use super::pool::Pool;
use crate::http::{self, BodyFraming, ChunkError, ChunkTracker, ChunkedDecoder, ResponseHead};
use crate::workers::registry::Worker;
use bytes::BytesMut;
use monoio::net::TcpStream;
use monoio::time::Instant;
use std::fmt::Write as _;

/// Response headers of the upstream hop that the gateway replaces.
const RESPONSE_SKIP: [&str; 3] = ["connection", "keep-alive", "proxy-connection"];

/// The SSE event a client gets when the worker ends a chunked stream early.
const BROKEN_STREAM_EVENT: &[u8] = b"data: {\"error\":{\"message\":\"the worker ended the stream early\",\"type\":\"upstream_error\",\"code\":502}}\n\n";

/// How a relayed response ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Relayed {
    /// The client connection may serve another request.
    pub client_keep_alive: bool,
    /// The whole response reached the client.
    pub complete: bool,
    /// When the first body byte was written to the client (time to first token for streams).
    pub first_body_at: Option<Instant>,
    /// Body bytes relayed.
    pub body_bytes: u64,
    /// Server-sent events relayed (`data:` lines of an event stream; a token each, or a few,
    /// for an LLM stream): what a tenant's output is counted in.
    pub events: u64,
    /// The worker broke the response off (error, EOF or timeout mid-body): counts against it.
    pub upstream_broke: bool,
}

/// Where and how a response is relayed.
#[derive(Clone, Copy)]
pub struct RelayTo<'a> {
    /// The worker the response comes from (its pool gets the connection back).
    pub worker: &'a Worker,
    /// Echoed as `x-request-id` when the worker did not set one.
    pub request_id: &'a str,
    /// The client asked to keep its connection.
    pub client_keep_alive: bool,
    /// The client spoke HTTP/1.0: no chunked framing, close after the response.
    pub client_http10: bool,
    /// The whole-request deadline.
    pub deadline: Instant,
    /// The gateway is shutting down: close the client connection after this response.
    pub shutting_down: bool,
}

/// `data:` fields in a piece of an event stream (one split over two pieces is missed: an
/// estimate, and a close one).
fn count_data_lines(piece: &[u8]) -> u64 {
    piece.windows(5).filter(|w| *w == b"data:").count() as u64
}

/// Render the client-facing response head from the worker's. `dechunk`: the body goes out
/// decoded and close-delimited (an HTTP/1.0 client), so no framing header is forwarded.
pub fn client_head(up: &ResponseHead, request_id: &str, close: bool, dechunk: bool) -> BytesMut {
    let mut out = BytesMut::with_capacity(up.buf.len() + 96);
    out.extend_from_slice(b"HTTP/1.1 ");
    let _ = write!(out, "{}", up.status);
    out.extend_from_slice(b" ");
    out.extend_from_slice(http::response::reason(up.status).as_bytes());
    out.extend_from_slice(b"\r\n");
    let mut has_id = false;
    // RFC 9112 §6.3: beside a Transfer-Encoding a Content-Length must not be forwarded.
    let has_te = up.header("transfer-encoding").is_some();
    for (name, value) in up.headers() {
        if skip(name, &RESPONSE_SKIP) || named_by_connection(name, up.headers()) {
            continue;
        }
        if (has_te || dechunk) && name.eq_ignore_ascii_case(b"content-length") {
            continue;
        }
        if dechunk && name.eq_ignore_ascii_case(b"transfer-encoding") {
            continue;
        }
        if name.eq_ignore_ascii_case(b"x-request-id") {
            has_id = true;
        }
        out.extend_from_slice(name);
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    if !has_id {
        out.extend_from_slice(b"x-request-id: ");
        out.extend_from_slice(request_id.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if close {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out
}

/// Whether the response is a server-sent event stream (the only kind an error event is
/// appended to: in any other body it would be garbage).
fn is_event_stream(up: &ResponseHead) -> bool {
    up.header("content-type").is_some_and(|v| {
        let mime = v.split(|&b| b == b';').next().unwrap_or_default();
        mime.trim_ascii().eq_ignore_ascii_case(b"text/event-stream")
    })
}

/// Where the body ends, as it is relayed.
enum BodyEnd {
    Done,
    Remaining(u64),
    Chunked(ChunkTracker),
    /// Chunked upstream, decoded for an HTTP/1.0 client.
    Dechunk(ChunkedDecoder),
    UntilClose,
}

impl BodyEnd {
    fn for_framing(framing: BodyFraming, dechunk: bool) -> BodyEnd {
        match framing {
            BodyFraming::None | BodyFraming::Length(0) => BodyEnd::Done,
            BodyFraming::Length(n) => BodyEnd::Remaining(n),
            BodyFraming::Chunked if dechunk => BodyEnd::Dechunk(ChunkedDecoder::new(u64::MAX)),
            BodyFraming::Chunked => BodyEnd::Chunked(ChunkTracker::new()),
            BodyFraming::Close => BodyEnd::UntilClose,
        }
    }

    /// Consume up to the end of the body from `data`; returns (bytes that belong to the body,
    /// finished). A decoding end appends what the client gets to `decoded`. A body that breaks
    /// its chunked framing fails with the framing error (the relay stops there).
    fn advance(
        &mut self,
        data: &[u8],
        decoded: &mut BytesMut,
    ) -> Result<(usize, bool), ChunkError> {
        match self {
            BodyEnd::Dechunk(d) => {
                let used = d.feed(data, decoded)?;
                Ok((used, d.is_done()))
            }
            BodyEnd::Done => Ok((0, true)),
            BodyEnd::Remaining(n) => {
                let take = std::cmp::min(*n, data.len() as u64);
                *n -= take;
                Ok((take as usize, *n == 0))
            }
            BodyEnd::Chunked(t) => match t.feed(data)? {
                Some(end) => Ok((end, true)),
                None => Ok((data.len(), false)),
            },
            BodyEnd::UntilClose => Ok((data.len(), false)),
        }
    }
}

/// Why relaying stopped before the body's end.
struct Stopped;

/// Rewrites one complete server-sent event (its bytes up to and including the blank line that
/// ends it) into `out`. Only PD streams that asked for input logprobs take this path.
pub type EventRewrite<'k> = &'k mut dyn FnMut(&[u8], &mut BytesMut);

/// An event stream relayed event by event through an [`EventRewrite`]: the worker's chunked body
/// is decoded, split at event boundaries, each whole event rewritten, and the result framed
/// again (chunked for HTTP/1.1 clients, close-delimited for HTTP/1.0 ones). A partial event
/// waits in `pending` for its end, so the client only ever sees whole events.
struct Rewriting<'k> {
    rewrite: EventRewrite<'k>,
    pending: BytesMut,
    rechunk: bool,
}

impl Rewriting<'_> {
    /// `decoded` body bytes in; what the client gets of them out (`done`: the body ended, so
    /// what is pending goes out as it is, and the chunked body is closed).
    fn shape(&mut self, decoded: &[u8], done: bool, out: &mut BytesMut) {
        self.pending.extend_from_slice(decoded);
        let mut events = BytesMut::new();
        while let Some(end) = self.pending.windows(2).position(|w| w == b"\n\n") {
            let event = self.pending.split_to(end + 2);
            (self.rewrite)(&event, &mut events);
        }
        // The end, or an "event" longer than any real one (no blank line in a megabyte: a
        // worker that does not frame events): what is pending goes out as it is.
        if done || self.pending.len() > MAX_PENDING_EVENT {
            events.extend_from_slice(&self.pending.split());
        }
        if !self.rechunk {
            out.extend_from_slice(&events);
            return;
        }
        if !events.is_empty() {
            let _ = write!(out, "{:x}\r\n", events.len());
            out.extend_from_slice(&events);
            out.extend_from_slice(b"\r\n");
        }
        if done {
            out.extend_from_slice(b"0\r\n\r\n");
        }
    }
}

/// A relay's first read buffer: an SSE token is a few hundred bytes, and thousands of streams
/// may be open on one core.
const RELAY_BUFFER_START: usize = 4 * 1024;

/// Largest read buffer a relay grows to while reads fill it (a large non-streamed body).
const RELAY_BUFFER_MAX: usize = 64 * 1024;

/// Longest event held back for rewriting; longer pending bytes are passed on unchanged, so a
/// stream that never ends an event cannot grow the gateway's memory.
const MAX_PENDING_EVENT: usize = 1 << 20;

/// One response on its way to the client.
struct Relay<'c, 'k> {
    client: &'c mut TcpStream,
    capture: Option<&'k mut Capture>,
    /// Events rewritten on their way (see [`relay_rewriting_events`]).
    rewriting: Option<Rewriting<'k>>,
    end: BodyEnd,
    deadline: Instant,
    relayed: Relayed,
    /// No byte past the response was seen: the upstream connection may be reused.
    upstream_clean: bool,
    /// An error event may be appended if the worker breaks off (an event stream).
    event_stream: bool,
    /// Decoded bytes for a de-chunking relay (reused across reads).
    decoded: BytesMut,
    /// The decoded body so far ends between two events (`\n\n`), or nothing was written.
    at_event_boundary: bool,
}

/// Relay the response to the client. The upstream connection goes back to `pool` when the
/// response was complete and reusable; otherwise it is dropped (closing it, which also aborts
/// the work on the worker when the client went away).
pub async fn relay(
    pool: &Pool,
    client: &mut TcpStream,
    up: UpstreamResponse,
    how: RelayTo<'_>,
    capture: Option<&mut Capture>,
) -> Relayed {
    relay_with(pool, client, up, how, capture, None).await
}

/// [`relay`] for an event stream whose every event goes through `rewrite` (PD: prefill's input
/// logprobs put into each decode event). Only a chunked body is rewritten (an event stream is
/// one); any other body is relayed as it is.
pub async fn relay_rewriting_events(
    pool: &Pool,
    client: &mut TcpStream,
    up: UpstreamResponse,
    how: RelayTo<'_>,
    rewrite: EventRewrite<'_>,
) -> Relayed {
    relay_with(pool, client, up, how, None, Some(rewrite)).await
}

async fn relay_with<'k>(
    pool: &Pool,
    client: &mut TcpStream,
    up: UpstreamResponse,
    how: RelayTo<'_>,
    capture: Option<&'k mut Capture>,
    rewrite: Option<EventRewrite<'k>>,
) -> Relayed {
    let UpstreamResponse {
        mut stream,
        head,
        leftover,
    } = up;
    let close_client = !how.client_keep_alive
        || how.client_http10
        || matches!(head.framing, BodyFraming::Close)
        || how.shutting_down;
    let chunked = head.framing == BodyFraming::Chunked;
    let rewriting = rewrite.filter(|_| chunked).map(|rewrite| Rewriting {
        rewrite,
        pending: BytesMut::new(),
        rechunk: !how.client_http10,
    });
    // The client gets a decoded body when it speaks HTTP/1.0; a rewritten body is decoded too
    // (and chunked again for HTTP/1.1), but its head keeps the chunked framing.
    let dechunk = how.client_http10 && chunked;
    let decode = dechunk || rewriting.is_some();
    let mut r = Relay {
        client,
        capture,
        rewriting,
        end: BodyEnd::for_framing(head.framing, decode),
        deadline: how.deadline,
        relayed: Relayed {
            client_keep_alive: !close_client,
            complete: false,
            first_body_at: None,
            body_bytes: 0,
            events: 0,
            upstream_broke: false,
        },
        upstream_clean: true,
        event_stream: is_event_stream(&head),
        decoded: BytesMut::new(),
        at_event_boundary: true,
    };
    let out = client_head(&head, how.request_id, close_client, dechunk);
    // The head's buffer (and the leftover, which shares it) is let go once the head is out: a
    // stream that stays open for minutes keeps only its relay buffer.
    let upstream_keep_alive = head.keep_alive;
    drop(head);
    let Ok(finished) = r.send_head(out, leftover).await else {
        return r.relayed;
    };
    if !finished && r.pump(&mut stream).await.is_err() {
        return r.relayed;
    }
    r.relayed.complete = true;
    // Any byte past the response: never reused (a 101 never gets here: `roundtrip` refuses it).
    if upstream_keep_alive && r.upstream_clean && !matches!(r.end, BodyEnd::UntilClose) {
        pool.put(how.worker, stream);
    }
    r.relayed
}

impl Relay<'_, '_> {
    /// The head and whatever body bytes came with it go out in one write. Returns whether the
    /// body is already complete.
    async fn send_head(&mut self, mut out: BytesMut, leftover: BytesMut) -> Result<bool, Stopped> {
        let mut finished = matches!(self.end, BodyEnd::Done);
        if finished && !leftover.is_empty() {
            // e.g. a 204 or `Content-Length: 0` followed by stray bytes.
            self.upstream_clean = false;
        }
        if !finished && !leftover.is_empty() {
            let mut decoded = std::mem::take(&mut self.decoded);
            let Ok((n, done)) = self.end.advance(&leftover, &mut decoded) else {
                self.relayed.client_keep_alive = false;
                let _ = write_all_by(self.client, out.freeze(), self.deadline).await;
                return Err(Stopped);
            };
            self.take_body(&leftover, n);
            if let Some(rw) = self.rewriting.as_mut() {
                rw.shape(&decoded, done, &mut out);
                decoded.clear();
            } else if matches!(self.end, BodyEnd::Dechunk(_)) {
                self.note_decoded(&decoded);
                out.extend_from_slice(&decoded);
                decoded.clear();
            } else {
                out.extend_from_slice(&leftover[..n]);
            }
            self.decoded = decoded;
            finished = done;
        }
        drop(leftover);
        let had_body = self.relayed.body_bytes > 0;
        if write_all_by(self.client, out.freeze(), self.deadline)
            .await
            .is_err()
        {
            self.relayed.client_keep_alive = false;
            return Err(Stopped);
        }
        if had_body {
            self.relayed.first_body_at = Some(Instant::now());
        }
        Ok(finished)
    }

    /// Read the rest of the body from the worker and write each read to the client at once.
    ///
    /// A body relayed as it is (the common case: every SSE token of every stream) goes through
    /// one buffer owned by this relay alone: it is moved into the client write and handed back
    /// by it, then cleared, so every read lands at the front of the same allocation. No read
    /// allocates, shares or copies anything, and an open stream keeps one small buffer whose
    /// few cache lines are the ones its next token is read into: with thousands of streams
    /// open, a split-off chunk per read walked each stream's read position through a 16 KiB
    /// buffer (16 KiB resident per stream, a fresh cache line per token). The buffer starts at
    /// [`RELAY_BUFFER_START`] and doubles, up to [`RELAY_BUFFER_MAX`], while reads fill it (a
    /// large non-streamed body).
    async fn pump(&mut self, stream: &mut TcpStream) -> Result<(), Stopped> {
        let mut buf = BytesMut::with_capacity(RELAY_BUFFER_START);
        loop {
            buf.clear();
            let n = match read_expecting(stream, &mut buf, Some(self.deadline), 1).await {
                Ok(n) => n,
                // Upstream broke or the deadline passed mid-body: the client cannot get a
                // complete response, so end it cleanly rather than leave it hanging.
                Err(_) => return Err(self.upstream_broke().await),
            };
            if n == 0 {
                if !matches!(self.end, BodyEnd::UntilClose) {
                    return Err(self.upstream_broke().await);
                }
                self.relayed.complete = true;
                self.relayed.client_keep_alive = false;
                return Err(Stopped);
            }
            let filled = n == buf.capacity();
            let mut decoded = std::mem::take(&mut self.decoded);
            let Ok((take, done)) = self.end.advance(&buf, &mut decoded) else {
                self.relayed.client_keep_alive = false;
                return Err(Stopped);
            };
            self.take_body(&buf, take);
            let written = if let Some(rw) = self.rewriting.as_mut() {
                let mut out = BytesMut::new();
                rw.shape(&decoded, done, &mut out);
                decoded.clear();
                self.decoded = decoded;
                self.write_unless_empty(out, done).await.map(drop)
            } else if matches!(self.end, BodyEnd::Dechunk(_)) {
                self.note_decoded(&decoded);
                let out = decoded.split();
                self.decoded = decoded;
                self.write_unless_empty(out, done).await.map(drop)
            } else {
                self.decoded = decoded;
                // Bytes past the response are dropped (the connection is not reused).
                buf.truncate(take);
                match self.write_unless_empty(buf, done).await {
                    Ok(back) => {
                        buf = back;
                        Ok(())
                    }
                    Err(stopped) => {
                        self.relayed.client_keep_alive = false;
                        return Err(stopped);
                    }
                }
            };
            if written.is_err() {
                // The client went away: dropping the upstream stream closes it, which makes
                // the engine abort the request and free its GPU work.
                self.relayed.client_keep_alive = false;
                return Err(Stopped);
            }
            if done {
                return Ok(());
            }
            if filled && buf.capacity() < RELAY_BUFFER_MAX {
                buf = BytesMut::with_capacity((buf.capacity() * 2).min(RELAY_BUFFER_MAX));
            }
        }
    }

    /// Write `out` to the client (nothing when it is empty and the body goes on), noting the
    /// first body byte's time; hands the buffer back for reuse.
    async fn write_unless_empty(&mut self, out: BytesMut, done: bool) -> Result<BytesMut, Stopped> {
        if out.is_empty() && !done {
            return Ok(out);
        }
        let back = write_all_returning(self.client, out, self.deadline)
            .await
            .map_err(|_| Stopped)?;
        if self.relayed.first_body_at.is_none() {
            self.relayed.first_body_at = Some(Instant::now());
        }
        Ok(back)
    }

    /// Account `n` body bytes at the start of `data` (the rest belongs to no response).
    fn take_body(&mut self, data: &[u8], n: usize) {
        if n < data.len() {
            self.upstream_clean = false; // bytes past the response: never reuse
        }
        if let Some(c) = self.capture.as_deref_mut() {
            c.feed(&data[..n]);
        }
        self.relayed.body_bytes += n as u64;
        if self.event_stream {
            self.relayed.events += count_data_lines(&data[..n]);
        }
    }

    /// Remember whether the decoded body written so far ends between two events.
    fn note_decoded(&mut self, decoded: &[u8]) {
        if !decoded.is_empty() {
            self.at_event_boundary = decoded.ends_with(b"\n\n");
        }
    }

    /// The worker broke the body off: an event stream that broke between events (and, when
    /// chunked, between chunks) gets an SSE error event (and, when chunked, a proper last
    /// chunk), so clients see an explicit error and a clean end, never a hang or a torn frame.
    /// Any other body only ends (an event in it would be garbage, or fuse with the half event
    /// before it).
    async fn upstream_broke(&mut self) -> Stopped {
        self.relayed.upstream_broke = true;
        self.relayed.client_keep_alive = false;
        if !self.event_stream {
            return Stopped;
        }
        let mut out = BytesMut::with_capacity(BROKEN_STREAM_EVENT.len() + 16);
        if let Some(rw) = self.rewriting.as_mut() {
            // Only whole events went out (a partial one is still pending): the client is at an
            // event boundary; the error event gets this relay's own framing.
            rw.pending.clear();
            rw.shape(BROKEN_STREAM_EVENT, true, &mut out);
            let _ = write_all_by(self.client, out.freeze(), self.deadline).await;
            return Stopped;
        }
        match &self.end {
            BodyEnd::Chunked(t) if t.at_chunk_boundary() && t.at_event_boundary() => {
                let _ = write!(out, "{:x}\r\n", BROKEN_STREAM_EVENT.len());
                out.extend_from_slice(BROKEN_STREAM_EVENT);
                out.extend_from_slice(b"\r\n0\r\n\r\n");
            }
            BodyEnd::Dechunk(_) if self.at_event_boundary => {
                out.extend_from_slice(BROKEN_STREAM_EVENT);
            }
            _ => return Stopped,
        }
        let _ = write_all_by(self.client, out.freeze(), self.deadline).await;
        Stopped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rewrite that upper-cases each event and counts them.
    fn upper(count: &mut usize) -> impl FnMut(&[u8], &mut BytesMut) + '_ {
        move |event: &[u8], out: &mut BytesMut| {
            *count += 1;
            out.extend_from_slice(&event.to_ascii_uppercase());
        }
    }

    #[test]
    fn rewritten_events_go_out_whole_and_chunked_again() {
        let mut n = 0;
        let mut f = upper(&mut n);
        let mut rw = Rewriting {
            rewrite: &mut f,
            pending: BytesMut::new(),
            rechunk: true,
        };
        let mut out = BytesMut::new();
        // An event split across reads waits for its end.
        rw.shape(b"data: a\n\ndata: b", false, &mut out);
        assert_eq!(&out[..], b"9\r\nDATA: A\n\n\r\n");
        out.clear();
        rw.shape(b"c\n\n", false, &mut out);
        assert_eq!(&out[..], b"a\r\nDATA: BC\n\n\r\n");
        out.clear();
        // Nothing whole yet: nothing goes out (no empty chunk, which would end the body).
        rw.shape(b"data: d", false, &mut out);
        assert!(out.is_empty());
        // The end: what is pending goes out as it is, and the body is closed.
        rw.shape(b"", true, &mut out);
        assert_eq!(&out[..], b"7\r\ndata: d\r\n0\r\n\r\n");
        drop(rw);
        drop(f);
        assert_eq!(n, 2);
    }

    #[test]
    fn a_stream_that_never_ends_an_event_is_passed_on_not_held() {
        let mut n = 0;
        let mut f = upper(&mut n);
        let mut rw = Rewriting {
            rewrite: &mut f,
            pending: BytesMut::new(),
            rechunk: false,
        };
        let mut out = BytesMut::new();
        let piece = vec![b'x'; 64 * 1024];
        for _ in 0..20 {
            rw.shape(&piece, false, &mut out);
        }
        assert!(
            rw.pending.len() <= MAX_PENDING_EVENT,
            "{}",
            rw.pending.len()
        );
        assert_eq!(
            out.len() + rw.pending.len(),
            20 * piece.len(),
            "nothing lost"
        );
        assert!(out.iter().all(|&b| b == b'x'), "passed on unchanged");
    }

    #[test]
    fn for_http10_clients_rewritten_events_go_out_unframed() {
        let mut n = 0;
        let mut f = upper(&mut n);
        let mut rw = Rewriting {
            rewrite: &mut f,
            pending: BytesMut::new(),
            rechunk: false,
        };
        let mut out = BytesMut::new();
        rw.shape(b"data: a\n\ndata: [DONE]\n\n", true, &mut out);
        assert_eq!(&out[..], b"DATA: A\n\nDATA: [DONE]\n\n");
    }
}
