//! One blocking `GET` for helper threads that run no monoio runtime (the KV index bootstrap from
//! a sibling copy): std sockets, a deadline over the whole exchange, the body capped, the
//! response framed by the same parser the proxy uses. Never called on a serving core.

use crate::http::{
    parse_response_head, BodyFraming, ChunkError, ChunkedDecoder, HeadError, HeadLimits,
    ResponseHead,
};
use bytes::BytesMut;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Why a blocking `GET` brought back no answer: the caller logs it (its text is the log line's
/// reason), and a caller that retries can tell a bad URL from a slow peer.
#[derive(Debug)]
pub enum GetError {
    /// The base URL is not `http://host:port`.
    Url {
        /// The base URL as given.
        url: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The host did not resolve.
    Resolve {
        /// The `host:port` looked up.
        authority: String,
        /// The resolver's error.
        error: io::Error,
    },
    /// No address took the connection: the last one tried and its error (None: the host
    /// resolved to no address).
    Connect(Option<(SocketAddr, io::Error)>),
    /// A read or a write on the connection failed.
    Io(io::Error),
    /// The response head did not parse.
    Head(HeadError),
    /// The chunked body did not decode (or passed the cap).
    Chunked(ChunkError),
    /// The peer closed the connection before the response ended; says where.
    Closed(&'static str),
    /// The declared body length does not fit in memory's address space.
    LengthTooLarge,
    /// The body is over the cap (`length`: what the peer declared, when it did).
    OverCap {
        /// The declared `Content-Length`, when there is one.
        length: Option<usize>,
        /// The cap.
        max: usize,
    },
    /// The deadline passed.
    TimedOut,
}

impl fmt::Display for GetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GetError::Url { url, why } => write!(f, "{url}: {why}"),
            GetError::Resolve { authority, error } => write!(f, "{authority}: {error}"),
            GetError::Connect(None) => f.write_str("no address"),
            GetError::Connect(Some((a, e))) => write!(f, "{a}: {e}"),
            GetError::Io(e) => write!(f, "{e}"),
            GetError::Head(e) => write!(f, "{e}"),
            GetError::Chunked(e) => write!(f, "{e}"),
            GetError::Closed(when) => write!(f, "the connection closed {when}"),
            GetError::LengthTooLarge => f.write_str("body too large"),
            GetError::OverCap {
                length: Some(n),
                max,
            } => write!(f, "body of {n} bytes is over {max}"),
            GetError::OverCap { length: None, max } => write!(f, "body over {max} bytes"),
            GetError::TimedOut => f.write_str("timed out"),
        }
    }
}

impl std::error::Error for GetError {}

impl From<io::Error> for GetError {
    fn from(e: io::Error) -> Self {
        GetError::Io(e)
    }
}

/// `GET http://host:port/path` (with `Authorization: Bearer <bearer>` when given) → status and
/// body. Fails on a body above `max_body` bytes or when `timeout` passes.
pub fn get(
    base_url: &str,
    path: &str,
    bearer: Option<&str>,
    max_body: usize,
    timeout: Duration,
) -> Result<(u16, Vec<u8>), GetError> {
    let deadline = Instant::now() + timeout;
    let authority = authority_of(base_url)?;
    let mut conn = Conn::open(authority, deadline)?;
    conn.send_get(path, authority, bearer)?;
    let head = conn.read_head()?;
    let body = match head.framing {
        BodyFraming::None => BytesMut::new(),
        BodyFraming::Length(n) => conn.read_length(n, max_body)?,
        BodyFraming::Chunked => conn.read_chunked(max_body)?,
        BodyFraming::Close => conn.read_until_close(max_body)?,
    };
    // A redirect is an answer like any other (never followed: the key goes only where the
    // operator pointed it).
    Ok((head.status, Vec::from(body)))
}

/// The `host:port` of an `http://host:port` base URL.
fn authority_of(base_url: &str) -> Result<&str, GetError> {
    let bad = |why| GetError::Url {
        url: base_url.to_string(),
        why,
    };
    let authority = base_url
        .strip_prefix("http://")
        .ok_or_else(|| bad("only http:// URLs"))?
        .trim_end_matches('/');
    if authority.contains('/') {
        return Err(bad("expected http://host:port"));
    }
    Ok(authority)
}

/// One exchange's connection: the socket, what was read and not yet used, and the deadline.
struct Conn {
    s: TcpStream,
    buf: BytesMut,
    chunk: Vec<u8>,
    deadline: Instant,
}

impl Conn {
    /// Connect to the first of `authority`'s addresses that answers before `deadline`.
    fn open(authority: &str, deadline: Instant) -> Result<Conn, GetError> {
        let addrs: Vec<SocketAddr> = authority
            .to_socket_addrs()
            .map_err(|error| GetError::Resolve {
                authority: authority.to_string(),
                error,
            })?
            .collect();
        let mut last = None;
        for a in addrs {
            match TcpStream::connect_timeout(&a, left(deadline)?) {
                Ok(s) => {
                    return Ok(Conn {
                        s,
                        buf: BytesMut::with_capacity(64 * 1024),
                        chunk: vec![0u8; 64 * 1024],
                        deadline,
                    })
                }
                Err(e) => last = Some((a, e)),
            }
        }
        Err(GetError::Connect(last))
    }

    /// Write the request head (the connection closes after the response).
    fn send_get(
        &mut self,
        path: &str,
        authority: &str,
        bearer: Option<&str>,
    ) -> Result<(), GetError> {
        let auth = bearer
            .map(|k| format!("Authorization: Bearer {k}\r\n"))
            .unwrap_or_default();
        let req = format!(
            "GET {path} HTTP/1.1\r\nHost: {authority}\r\n{auth}Connection: close\r\nAccept: */*\r\n\r\n"
        );
        self.s.set_write_timeout(Some(left(self.deadline)?))?;
        self.s.write_all(req.as_bytes())?;
        Ok(())
    }

    /// The final response head (interim 1xx heads skipped).
    fn read_head(&mut self) -> Result<ResponseHead, GetError> {
        let limits = HeadLimits::default();
        loop {
            if let Some(h) =
                parse_response_head(&mut self.buf, false, &limits).map_err(GetError::Head)?
            {
                if h.is_interim() {
                    continue;
                }
                return Ok(h);
            }
            if !self.read_some()? {
                return Err(GetError::Closed("before the response head"));
            }
        }
    }

    /// A body of `Content-Length: n`.
    fn read_length(&mut self, n: u64, max_body: usize) -> Result<BytesMut, GetError> {
        let n = usize::try_from(n).map_err(|_| GetError::LengthTooLarge)?;
        if n > max_body {
            return Err(GetError::OverCap {
                length: Some(n),
                max: max_body,
            });
        }
        // Room for all of it at once: no doubling on the way (a copy near the cap would
        // otherwise peak at twice its size).
        self.buf.reserve(n.saturating_sub(self.buf.len()));
        while self.buf.len() < n {
            if !self.read_some()? {
                return Err(GetError::Closed("inside the body"));
            }
        }
        Ok(self.buf.split_to(n))
    }

    /// A chunked body, decoded.
    fn read_chunked(&mut self, max_body: usize) -> Result<BytesMut, GetError> {
        let mut body = BytesMut::new();
        let mut dec = ChunkedDecoder::new(max_body as u64);
        loop {
            let used = dec.feed(&self.buf, &mut body).map_err(GetError::Chunked)?;
            let _ = self.buf.split_to(used);
            if dec.is_done() {
                return Ok(body);
            }
            if !self.read_some()? {
                return Err(GetError::Closed("inside the body"));
            }
        }
    }

    /// A body that ends when the peer closes.
    fn read_until_close(&mut self, max_body: usize) -> Result<BytesMut, GetError> {
        loop {
            if self.buf.len() > max_body {
                return Err(GetError::OverCap {
                    length: None,
                    max: max_body,
                });
            }
            if !self.read_some()? {
                return Ok(std::mem::take(&mut self.buf));
            }
        }
    }

    /// Read what is there into `buf`; false at end of stream.
    fn read_some(&mut self) -> Result<bool, GetError> {
        self.s.set_read_timeout(Some(left(self.deadline)?))?;
        let n = self.s.read(&mut self.chunk)?;
        self.buf.extend_from_slice(&self.chunk[..n]);
        Ok(n > 0)
    }
}

/// Time left before `deadline`; an error once it has passed (a zero timeout would mean "none"
/// to the socket calls).
fn left(deadline: Instant) -> Result<Duration, GetError> {
    let d = deadline.saturating_duration_since(Instant::now());
    if d.is_zero() {
        return Err(GetError::TimedOut);
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn serve_once(reply: &'static [u8]) -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            let mut req = [0u8; 1024];
            let _ = c.read(&mut req);
            let _ = c.write_all(reply);
        });
        format!("http://127.0.0.1:{port}")
    }

    #[test]
    fn length_chunked_and_close_delimited_bodies() {
        let t = Duration::from_secs(5);
        let u = serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello");
        assert_eq!(
            get(&u, "/", None, 100, t).unwrap(),
            (200, b"hello".to_vec())
        );
        let u = serve_once(
            b"HTTP/1.1 404 No\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        );
        assert_eq!(get(&u, "/", None, 100, t).unwrap(), (404, b"abc".to_vec()));
        let u = serve_once(b"HTTP/1.1 200 OK\r\n\r\nuntil close");
        assert_eq!(
            get(&u, "/", None, 100, t).unwrap(),
            (200, b"until close".to_vec())
        );
    }

    #[test]
    fn bodies_over_the_cap_and_bad_urls_fail() {
        let t = Duration::from_secs(5);
        let u = serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n");
        assert!(get(&u, "/", None, 100, t)
            .unwrap_err()
            .to_string()
            .contains("over 100"));
        let u = serve_once(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n200\r\n");
        assert!(get(&u, "/", None, 100, t).is_err());
        assert!(get("https://x:1", "/", None, 100, t).is_err());
        assert!(get("http://x:1/path", "/", None, 100, t).is_err());
    }
}
