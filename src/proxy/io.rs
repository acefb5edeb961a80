//! Rent-style (io_uring) read helpers: monoio reads take the buffer by value, so these append
//! into a `BytesMut` and bound each read by a deadline.

use bytes::{Bytes, BytesMut};
use monoio::buf::IoBufMut;
use monoio::io::{AsyncReadRent, AsyncWriteRent, AsyncWriteRentExt};
use monoio::net::TcpStream;
use monoio::time::Instant;
use std::io;
use std::time::Duration;

/// Space a buffer grows by when a read finds too little free space in it.
pub const READ_CHUNK: usize = 16 * 1024;

/// Free space below which a buffer grows before a read: a buffer with at least this much left
/// is read into as it is (an 8 KiB head buffer is not reallocated, and copied, before its first
/// read).
const MIN_FREE: usize = 4 * 1024;

/// Append one read's worth of bytes to `buf`. `Ok(0)` is end of stream. A timeout leaves `buf`
/// empty (the buffer was owned by the cancelled read); callers close the connection then.
pub async fn read_into(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    deadline: Option<Instant>,
) -> io::Result<usize> {
    read_expecting(stream, buf, deadline, READ_CHUNK).await
}

/// [`read_into`] for a caller that expects `expected` more bytes (the rest of a body whose
/// length it knows): the buffer grows (by [`READ_CHUNK`]) only when it has less free space than
/// `min(expected, MIN_FREE)`, so a buffer reserved for the whole body is filled in place
/// instead of being reallocated (and copied) for its last bytes.
pub async fn read_expecting(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    deadline: Option<Instant>,
    expected: usize,
) -> io::Result<usize> {
    let mut owned = std::mem::take(buf);
    let min_free = expected.clamp(1, MIN_FREE);
    if owned.capacity() - owned.len() < min_free {
        owned.reserve(READ_CHUNK);
    }
    let len = owned.len();
    let fut = stream.read(owned.slice_mut(len..));
    let (res, slice) = match deadline {
        Some(d) => match monoio::time::timeout_at(d, fut).await {
            Ok(r) => r,
            Err(_) => return Err(io::Error::new(io::ErrorKind::TimedOut, "read timed out")),
        },
        None => fut.await,
    };
    *buf = slice.into_inner();
    res
}

/// Write all of `data` (any rent buffer).
pub async fn write_all<T: monoio::buf::IoBuf + 'static>(
    stream: &mut TcpStream,
    data: T,
) -> io::Result<()> {
    let (res, _) = stream.write_all(data).await;
    res.map(|_| ())
}

/// Write all of `data` with a deadline and hand the buffer back, so a caller that writes what
/// it read can read into the same allocation again.
pub async fn write_all_returning<T: monoio::buf::IoBuf + 'static>(
    stream: &mut TcpStream,
    data: T,
    deadline: Instant,
) -> io::Result<T> {
    match monoio::time::timeout_at(deadline, stream.write_all(data)).await {
        Ok((res, back)) => res.map(|_| back),
        Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, "write timed out")),
    }
}

/// Write with a deadline.
pub async fn write_all_by<T: monoio::buf::IoBuf + 'static>(
    stream: &mut TcpStream,
    data: T,
    deadline: Instant,
) -> io::Result<()> {
    write_all_returning(stream, data, deadline).await.map(drop)
}

/// Two buffers written as one: a request head and its body, sent by one `writev` instead of
/// copying the body behind the head or paying two writes. Owns both (the write needs `'static`
/// buffers); their bytes live on the heap (or in static memory), so the iovecs stay valid when
/// this value moves.
pub struct HeadAndBody {
    _bufs: [Bytes; 2],
    /// Boxed: io_uring reads the iovec array after submission, when this value may have moved.
    iov: Box<[libc::iovec; 2]>,
}

impl HeadAndBody {
    /// `head` then `body` (either may be empty).
    pub fn new(head: Bytes, body: Bytes) -> HeadAndBody {
        let iov = Box::new([
            libc::iovec {
                iov_base: head.as_ptr() as *mut libc::c_void,
                iov_len: head.len(),
            },
            libc::iovec {
                iov_base: body.as_ptr() as *mut libc::c_void,
                iov_len: body.len(),
            },
        ]);
        HeadAndBody {
            _bufs: [head, body],
            iov,
        }
    }
}

// SAFETY: the two iovecs point at the contents of the two `Bytes` this value owns, which are
// immutable and never move while a `Bytes` handle to them exists (heap or static storage, not
// inline in the handle); the iovec array is on the heap, so its address stays the same when
// this value moves (an io_uring submission reads it later). Both stay valid and unchanged for
// as long as the value lives; the array is read through `&self` only.
unsafe impl monoio::buf::IoVecBuf for HeadAndBody {
    fn read_iovec_ptr(&self) -> *const libc::iovec {
        self.iov.as_ptr()
    }

    fn read_iovec_len(&self) -> usize {
        self.iov.len()
    }
}

/// Write a head and a body with a deadline: one vectored write for both, which on a loopback
/// or a warm connection sends everything at once; what a partial write leaves of the body goes
/// out with the single-buffer `write_all`. (monoio 0.2.4's `write_vectored_all` is not relied
/// on: its `IoVecMeta::consume` discards the advanced base pointer of a partly written iovec.)
pub async fn write_head_and_body_by(
    stream: &mut TcpStream,
    mut head: Bytes,
    mut body: Bytes,
    deadline: Instant,
) -> io::Result<()> {
    use bytes::Buf;
    while !head.is_empty() {
        let bufs = HeadAndBody::new(head.clone(), body.clone());
        let written = match monoio::time::timeout_at(deadline, stream.writev(bufs)).await {
            Ok((res, _)) => res?,
            Err(_) => return Err(io::Error::new(io::ErrorKind::TimedOut, "write timed out")),
        };
        if written == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "the connection took no bytes",
            ));
        }
        if written < head.len() {
            head.advance(written);
        } else {
            body.advance(written - head.len());
            head = Bytes::new();
        }
    }
    if body.is_empty() {
        return Ok(());
    }
    write_all_by(stream, body, deadline).await
}

/// How long a connection lingers after an error reply that closes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Linger {
    /// Longest time spent draining in all.
    pub total: Duration,
    /// Stop once the client has sent nothing for this long.
    pub idle: Duration,
}

/// Close `stream` politely after a reply the client may not expect yet (an error answered while
/// it is still sending its body): shut down the write side, so the reply is followed by FIN,
/// then read and discard what the client still sends until it closes, falls quiet for
/// `linger.idle`, or `linger.total` has passed. Closing at once with unread bytes makes the
/// kernel send a reset, and a client still writing then sees "connection reset" instead of
/// the reply. `buf` is reused as scratch space (cleared; it does not grow beyond one read).
pub async fn linger_close(stream: &mut TcpStream, buf: &mut BytesMut, linger: Linger) {
    if stream.shutdown().await.is_err() {
        return;
    }
    let until = Instant::now() + linger.total;
    loop {
        buf.clear();
        let deadline = until.min(Instant::now() + linger.idle);
        match read_into(stream, buf, Some(deadline)).await {
            Ok(n) if n > 0 && Instant::now() < until => {}
            _ => return,
        }
    }
}

/// What a non-blocking peek at a socket finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peek {
    /// Nothing to read yet: the peer is connected and quiet.
    Quiet,
    /// Bytes are waiting.
    Data,
    /// The peer closed (EOF) or the socket failed.
    Closed,
}

/// Peek at `stream` without consuming or blocking.
pub fn peek(stream: &TcpStream) -> Peek {
    use std::os::fd::AsRawFd;
    let mut byte = 0u8;
    // SAFETY: the fd is a valid open socket owned by `stream` for the duration of this call and
    // `byte` is a valid 1-byte buffer; MSG_PEEK|MSG_DONTWAIT neither consumes data nor blocks.
    let n = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            &mut byte as *mut u8 as *mut libc::c_void,
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    match n {
        0 => Peek::Closed,
        n if n > 0 => Peek::Data,
        _ if io::Error::last_os_error().kind() == io::ErrorKind::WouldBlock => Peek::Quiet,
        _ => Peek::Closed,
    }
}

/// Resolves when the client closes its connection; pending while it stays open (also once it
/// has sent its next pipelined request, which must not be read yet). Raced against the wait
/// for a worker's answer, so a client that gives up frees the worker at once.
pub async fn closed_by_peer(stream: &TcpStream) {
    loop {
        if stream.readable(false).await.is_err() {
            return;
        }
        match peek(stream) {
            Peek::Closed => return,
            Peek::Data => std::future::pending::<()>().await,
            Peek::Quiet => monoio::time::sleep(std::time::Duration::from_millis(1)).await,
        }
    }
}
