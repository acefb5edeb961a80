//! Reading a response to its end without keeping it: PD mode's prefill answer, which only has
//! to finish (the client gets the decode answer). The bytes go through the response's own
//! read buffer, cleared after each read, so draining allocates nothing per request beyond what
//! the first read already took; the connection is reusable afterwards when nothing trailed it.

use super::forward::UpstreamResponse;
use super::io::read_into;
use crate::http::{BodyFraming, ChunkTracker};
use monoio::net::TcpStream;
use monoio::time::Instant;
use std::io;

/// A drained response: its status, its connection, and whether the connection may be pooled
/// (the worker keeps it alive, the body had an end of its own and nothing came after it).
pub struct Drained {
    /// The response status.
    pub status: u16,
    /// The upstream connection.
    pub stream: TcpStream,
    /// The connection may serve another request.
    pub reusable: bool,
}

/// Read `up`'s body to its end by its framing, by `deadline`.
pub async fn discard_body(up: UpstreamResponse, deadline: Instant) -> io::Result<Drained> {
    let UpstreamResponse {
        mut stream,
        head,
        leftover,
    } = up;
    let mut buf = leftover;
    let truncated = || io::Error::new(io::ErrorKind::UnexpectedEof, "truncated response");
    let stray = match head.framing {
        BodyFraming::None => !buf.is_empty(),
        BodyFraming::Length(n) => {
            let mut left = n;
            loop {
                let take = left.min(buf.len() as u64);
                left -= take;
                let stray = buf.len() as u64 > take;
                buf.clear();
                if left == 0 {
                    break stray;
                }
                if read_into(&mut stream, &mut buf, Some(deadline)).await? == 0 {
                    return Err(truncated());
                }
            }
        }
        BodyFraming::Chunked => {
            let mut t = ChunkTracker::new();
            loop {
                let fed = t
                    .feed(&buf)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{e:?}")))?;
                let len = buf.len();
                buf.clear();
                if let Some(end) = fed {
                    break end < len;
                }
                if read_into(&mut stream, &mut buf, Some(deadline)).await? == 0 {
                    return Err(truncated());
                }
            }
        }
        BodyFraming::Close => loop {
            buf.clear();
            if read_into(&mut stream, &mut buf, Some(deadline)).await? == 0 {
                break true;
            }
        },
    };
    Ok(Drained {
        status: head.status,
        stream,
        reusable: head.keep_alive && !stray,
    })
}
