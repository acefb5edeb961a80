//! How a connection's read buffer is sized, between requests and for a body: pure
//! arithmetic on `BytesMut` capacity, so that a keep-alive client sending requests of one size
//! has each read in place, in the allocation the last one used, instead of copied out of a
//! buffer that turned out too small (`BytesMut::reserve` on a buffer the request head still
//! shares copies every byte read so far).

use bytes::BytesMut;

/// Largest body buffer reserved up front from a declared `Content-Length`; beyond it the
/// buffer grows as bytes arrive, so a declared size alone reserves no memory.
const BODY_RESERVE_LIMIT: usize = 1 << 20;

/// Most free space a connection's buffer is given before it reads the next head: as much as
/// its previous request took (head and body), up to this. A client that keeps sending 16 KiB
/// prompts then has each one arrive whole in the first read, where a smaller buffer would
/// take the head and part of the body and copy that part into a buffer big enough for the
/// body (a 16 KiB copy a request, seen in a profile). An idle keep-alive connection holds at
/// most this much (256 MiB for a core at `--max-connections-per-core` 8192).
const READ_AHEAD_LIMIT: usize = 32 * 1024;

/// Free space to give the buffer before reading the head that follows a request of
/// `last_request` bytes (see [`READ_AHEAD_LIMIT`]).
pub(super) fn read_ahead(last_request: usize) -> usize {
    last_request.min(READ_AHEAD_LIMIT)
}

/// Room for the head of the connection's next request, reserved beside a body too large for
/// the buffer it arrived in (heads are usually a few hundred bytes).
const NEXT_HEAD_ROOM: usize = 4 * 1024;

/// Capacity in `buf` (which starts at the body) for a body of `declared` bytes (at most
/// [`BODY_RESERVE_LIMIT`]), so the rest of it is read in place. A buffer grown here is grown
/// by [`NEXT_HEAD_ROOM`] more: the next request of the same size then fits behind its head in
/// the same allocation. Without it the next head took the front of a buffer exactly one body
/// long, the body no longer fit, and the reserve copied everything read so far (most of a
/// 400 KiB body, every request, seen in a profile as 11 % of the CPU).
pub(super) fn reserve_body(buf: &mut BytesMut, declared: usize) {
    let want = declared.min(BODY_RESERVE_LIMIT);
    if buf.capacity() < want {
        buf.reserve(want - buf.len() + NEXT_HEAD_ROOM);
    }
}

/// At least `ahead` bytes free in `buf` before the first read of a head (once: a head that
/// needs more reads grows as `read_into` grows any buffer). Usually without a copy: once the
/// previous request's head and body are dropped the allocation is reclaimed in place, and
/// what is left in it (pipelined bytes) is a few bytes at most.
pub(super) fn make_room(buf: &mut BytesMut, ahead: usize) {
    if buf.capacity() - buf.len() < ahead {
        buf.reserve(ahead);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request cycle as `serve` runs it (head and body split off the buffer, then dropped):
    /// the next head read has room for a request as large as the last, in the same
    /// allocation, so a 16 KiB prompt arrives in one read and its body is not copied.
    #[test]
    fn the_next_request_as_large_as_the_last_fits_one_read_without_a_new_buffer() {
        let (head_len, body_len) = (300, 16 * 1024);
        let mut buf = BytesMut::with_capacity(8 * 1024);
        make_room(&mut buf, read_ahead(0));
        buf.resize(head_len + body_len, b'x');
        let base = buf.as_ptr();
        for _ in 0..3 {
            let head = buf.split_to(head_len).freeze();
            let body = buf.split_to(body_len).freeze();
            let ahead = read_ahead(head.len() + body.len());
            drop((head, body));
            make_room(&mut buf, ahead);
            assert!(buf.capacity() - buf.len() >= head_len + body_len);
            assert_eq!(buf.as_ptr(), base, "the allocation is reused");
            buf.resize(head_len + body_len, b'y');
        }
        assert_eq!(
            read_ahead(usize::MAX),
            READ_AHEAD_LIMIT,
            "idle buffers stay bounded"
        );
    }

    /// Bodies too large for the buffer they arrived in: after the first, a connection sending
    /// the same size again reads each body in place, in the allocation its last one used.
    #[test]
    fn a_large_body_after_a_large_body_reuses_the_buffer() {
        let (head_len, body_len) = (300, 400 * 1024);
        let mut buf = BytesMut::with_capacity(8 * 1024);
        let mut ahead = read_ahead(0);
        let mut bases = Vec::new();
        for _ in 0..4 {
            make_room(&mut buf, ahead);
            // The first read: the head and the start of the body.
            let first = (buf.capacity() - buf.len()).min(head_len + body_len);
            buf.resize(first, b'x');
            let head = buf.split_to(head_len).freeze();
            reserve_body(&mut buf, body_len);
            assert!(buf.capacity() >= body_len);
            bases.push(buf.as_ptr() as usize - head_len);
            buf.resize(body_len, b'y');
            let body = buf.split_to(body_len).freeze();
            ahead = read_ahead(head.len() + body.len());
            drop((head, body));
        }
        assert!(
            bases[1..].windows(2).all(|w| w[0] == w[1]),
            "the head lands at the front of the same buffer: {bases:x?}"
        );
    }
}
