//! What one connection has yet to send, held to a fixed size whatever the peer does.
//!
//! A client sends little of its own: the greeting and READY, a subscription, a replay request.
//! Those go in order and together may hold at most [`MAX_QUEUED`] bytes; one more is refused
//! ([`Full`]). The only thing a peer can make us send is a PONG, one per PING, and a PONG only
//! needs to answer the latest PING: at most one waits, and a newer PING replaces it. A PONG
//! that waits goes out once what is being written has gone (frames are never interleaved), so a
//! peer that sends PINGs and never reads makes us hold at most [`MAX_QUEUED`] bytes and two
//! PONGs.

use crate::kv::zmtp;

/// Bytes of the connection's own messages (greeting, READY, subscription, replay requests) that
/// may wait at once: several times what a connection ever sends.
pub const MAX_QUEUED: usize = 4 << 10;

/// A message was refused: it would take the outbox past [`MAX_QUEUED`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full;

/// One connection's unsent bytes (see the module doc).
#[derive(Debug, Default)]
pub struct Outbox {
    /// Whole frames in the order they go out; the first `sent` bytes are written.
    wire: Vec<u8>,
    sent: usize,
    /// The PONG waiting for `wire` to drain (empty: none).
    pong: Vec<u8>,
}

impl Outbox {
    /// An outbox holding `hello` (the connection's greeting and READY, sent first).
    pub fn new(hello: Vec<u8>) -> Outbox {
        Outbox {
            wire: hello,
            ..Outbox::default()
        }
    }

    /// Queue a message after what is queued, unless it would take the outbox past
    /// [`MAX_QUEUED`].
    pub fn push(&mut self, frames: &[&[u8]]) -> Result<(), Full> {
        if self.unsent().len() + zmtp::message_len(frames) > MAX_QUEUED {
            return Err(Full);
        }
        self.wire.drain(..self.sent);
        self.sent = 0;
        zmtp::encode_message(frames, &mut self.wire);
        Ok(())
    }

    /// Answer a PING with `context`: the PONG goes out at once when nothing else waits, else it
    /// waits for the wire, replacing any PONG that already waits.
    pub fn pong(&mut self, context: &[u8]) {
        if self.unsent().is_empty() {
            self.wire.clear();
            self.sent = 0;
            zmtp::pong(context, &mut self.wire);
        } else {
            self.pong.clear();
            zmtp::pong(context, &mut self.pong);
        }
    }

    /// The bytes to write next (empty: nothing waits).
    pub fn unsent(&self) -> &[u8] {
        &self.wire[self.sent..]
    }

    /// The socket took `n` bytes of [`Outbox::unsent`]. Once the wire is empty a waiting PONG
    /// takes its place.
    pub fn wrote(&mut self, n: usize) {
        self.sent = (self.sent + n).min(self.wire.len());
        if self.sent == self.wire.len() {
            self.wire.clear();
            self.sent = 0;
            std::mem::swap(&mut self.wire, &mut self.pong);
        }
    }

    /// Whether nothing waits (no message, no PONG).
    pub fn is_empty(&self) -> bool {
        self.unsent().is_empty() && self.pong.is_empty()
    }

    /// Bytes held: what waits, and what of the wire was written but not yet let go of (the
    /// connection counts these in the shared budget).
    pub fn held(&self) -> usize {
        self.wire.len() + self.pong.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pong_of(ctx: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        zmtp::pong(ctx, &mut v);
        v
    }

    #[test]
    fn a_pong_goes_out_at_once_when_nothing_waits() {
        let mut o = Outbox::default();
        assert!(o.is_empty());
        o.pong(b"a");
        assert_eq!(o.unsent(), pong_of(b"a"));
        o.wrote(o.unsent().len());
        assert!(o.is_empty() && o.held() == 0);
    }

    #[test]
    fn a_million_pings_unread_leave_one_pong_waiting_the_latest() {
        let mut o = Outbox::new(b"hello".to_vec());
        for i in 0..1_000_000u32 {
            o.pong(&i.to_be_bytes());
        }
        // The hello still waits (nothing was written), then only the last PING's answer.
        assert_eq!(o.unsent(), b"hello");
        assert_eq!(o.held(), 5 + pong_of(&[0; 4]).len());
        o.wrote(5);
        assert_eq!(o.unsent(), pong_of(&999_999u32.to_be_bytes()));
        o.wrote(o.unsent().len());
        assert!(o.is_empty());
    }

    #[test]
    fn a_pong_being_written_is_finished_before_a_newer_one() {
        let mut o = Outbox::default();
        o.pong(b"first");
        o.wrote(3);
        o.pong(b"second");
        o.pong(b"third");
        let first = pong_of(b"first");
        assert_eq!(
            o.unsent(),
            &first[3..],
            "never cut into a frame being written"
        );
        o.wrote(first.len() - 3);
        assert_eq!(o.unsent(), pong_of(b"third"));
    }

    #[test]
    fn messages_go_in_order_and_past_the_cap_are_refused() {
        let mut o = Outbox::new(b"hi".to_vec());
        o.push(&[b"", b"x"]).unwrap();
        let mut want = b"hi".to_vec();
        zmtp::encode_message(&[b"", b"x"], &mut want);
        assert_eq!(o.unsent(), want);
        o.wrote(2);
        // The cap counts what waits: room for a message of exactly what is left.
        let left = MAX_QUEUED - o.unsent().len();
        let body = vec![7u8; left - 9];
        assert_eq!(zmtp::message_len(&[&body]), left);
        o.push(&[&body]).unwrap();
        assert_eq!(o.unsent().len(), MAX_QUEUED);
        assert_eq!(o.push(&[b""]), Err(Full));
        assert_eq!(
            o.unsent().len(),
            MAX_QUEUED,
            "a refused message adds nothing"
        );
        // Written bytes are let go of before the next message is queued.
        o.wrote(MAX_QUEUED);
        assert!(o.is_empty());
        o.push(&[b"y"]).unwrap();
        assert_eq!(o.held(), 3);
    }
}
