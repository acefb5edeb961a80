//! Chunked transfer coding (RFC 9112 §7.1) as byte state machines: a decoder for request bodies
//! (the gateway needs the whole body to route) and a tracker for responses (passed through raw,
//! the tracker only finds where the message ends).

use bytes::BytesMut;

/// A chunked body that cannot be decoded; answered with 400 (or 413 for `TooLarge`) and close.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChunkError {
    /// Bad chunk-size line, missing CRLF, bad trailer syntax.
    Malformed(&'static str),
    /// Decoded body exceeds the limit.
    TooLarge,
}

/// Decodes a chunked request body incrementally into a contiguous buffer.
#[derive(Debug)]
pub struct ChunkedDecoder {
    // private state
}

impl ChunkedDecoder {
    /// `max_body`: largest decoded body accepted.
    pub fn new(max_body: u64) -> Self {
        let _ = max_body;
        todo!()
    }
    /// Feed input. Decoded data is appended to `out`. Returns the number of input bytes consumed;
    /// fewer than `input.len()` only when the body ended (the rest belongs to the next request).
    pub fn feed(&mut self, input: &[u8], out: &mut BytesMut) -> Result<usize, ChunkError> {
        let _ = (input, out);
        todo!()
    }
    /// The terminating chunk and trailers have been consumed.
    pub fn is_done(&self) -> bool {
        todo!()
    }
}

/// Follows a chunked response that is forwarded verbatim, to learn where it ends.
#[derive(Debug)]
pub struct ChunkTracker {
    // private state
}

impl ChunkTracker {
    pub fn new() -> Self {
        todo!()
    }
    /// Feed the next bytes of the body. Returns `Ok(Some(n))` when the message ends after the
    /// first `n` bytes of `input` (bytes past `n` are not part of this response), `Ok(None)` when
    /// more is needed.
    pub fn feed(&mut self, input: &[u8]) -> Result<Option<usize>, ChunkError> {
        let _ = input;
        todo!()
    }
}

impl Default for ChunkTracker {
    fn default() -> Self {
        Self::new()
    }
}
