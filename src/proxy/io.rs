//! Rent-style (io_uring) read helpers: monoio reads take the buffer by value, so these append
//! into a `BytesMut` and bound each read by a deadline.

use bytes::BytesMut;
use monoio::buf::IoBufMut;
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::TcpStream;
use monoio::time::Instant;
use std::io;

/// Smallest free space offered to a read.
pub const READ_CHUNK: usize = 16 * 1024;

/// Append one read's worth of bytes to `buf`. `Ok(0)` is end of stream. A timeout leaves `buf`
/// empty (the buffer was owned by the cancelled read); callers close the connection then.
pub async fn read_into(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    deadline: Option<Instant>,
) -> io::Result<usize> {
    let mut owned = std::mem::take(buf);
    owned.reserve(READ_CHUNK);
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

/// Write with a deadline.
pub async fn write_all_by<T: monoio::buf::IoBuf + 'static>(
    stream: &mut TcpStream,
    data: T,
    deadline: Instant,
) -> io::Result<()> {
    match monoio::time::timeout_at(deadline, stream.write_all(data)).await {
        Ok((res, _)) => res.map(|_| ()),
        Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, "write timed out")),
    }
}
