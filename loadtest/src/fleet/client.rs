//! A blocking HTTP/1.1 keep-alive client for the driver (one connection, redialled on error).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// One keep-alive connection to `addr`.
pub struct Client {
    addr: SocketAddr,
    stream: Option<TcpStream>,
    buf: Vec<u8>,
    timeout: Duration,
}

impl Client {
    /// A client of `addr` (connects on first use).
    pub fn new(addr: SocketAddr, timeout: Duration) -> Self {
        Client {
            addr,
            stream: None,
            buf: Vec::with_capacity(16 << 10),
            timeout,
        }
    }

    /// `method path` with `body` (JSON when non-empty): status and body.
    pub fn request(
        &mut self,
        method: &str,
        path: &str,
        body: &[u8],
    ) -> std::io::Result<(u16, Vec<u8>)> {
        let r = self.try_request(method, path, body);
        if r.is_err() {
            self.stream = None;
        }
        r
    }

    fn try_request(
        &mut self,
        method: &str,
        path: &str,
        body: &[u8],
    ) -> std::io::Result<(u16, Vec<u8>)> {
        if self.stream.is_none() {
            let s = TcpStream::connect_timeout(&self.addr, self.timeout)?;
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(self.timeout))?;
            s.set_write_timeout(Some(self.timeout))?;
            self.stream = Some(s);
        }
        let s = self.stream.as_mut().expect("connected above");
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nhost: {}\r\ncontent-length: {}\r\n",
            self.addr,
            body.len()
        )
        .into_bytes();
        if !body.is_empty() {
            req.extend_from_slice(b"content-type: application/json\r\n");
        }
        req.extend_from_slice(b"\r\n");
        req.extend_from_slice(body);
        s.write_all(&req)?;
        self.buf.clear();
        let mut chunk = [0u8; 16 << 10];
        loop {
            if let Some((status, close, start, len)) = parse_head(&self.buf)? {
                if let Some(len) = len {
                    while self.buf.len() < start + len {
                        let n = s.read(&mut chunk)?;
                        if n == 0 {
                            return Err(std::io::ErrorKind::UnexpectedEof.into());
                        }
                        self.buf.extend_from_slice(&chunk[..n]);
                    }
                    let body = self.buf[start..start + len].to_vec();
                    if close {
                        self.stream = None;
                    }
                    return Ok((status, body));
                }
                // No length: read to the end.
                loop {
                    let n = s.read(&mut chunk)?;
                    if n == 0 {
                        break;
                    }
                    self.buf.extend_from_slice(&chunk[..n]);
                }
                self.stream = None;
                return Ok((status, self.buf[start..].to_vec()));
            }
            let n = s.read(&mut chunk)?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

/// A response head: status, connection close, body start, body length (when given).
type Head = (u16, bool, usize, Option<usize>);

/// A response head at the start of `buf` (`None` until it is all in).
fn parse_head(buf: &[u8]) -> std::io::Result<Option<Head>> {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Ok(None);
    };
    let head = String::from_utf8_lossy(&buf[..end]);
    let mut lines = head.split("\r\n");
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "bad response head");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(bad)?;
    let (mut len, mut close) = (None, false);
    for l in lines {
        if let Some((k, v)) = l.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                len = Some(v.trim().parse().map_err(|_| bad())?);
            } else if k.eq_ignore_ascii_case("connection") {
                close = v.trim().eq_ignore_ascii_case("close");
            } else if k.eq_ignore_ascii_case("transfer-encoding") {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "chunked answers are not read",
                ));
            }
        }
    }
    Ok(Some((status, close, end + 4, len)))
}

/// GET `url`'s path on `addr` with a fresh connection: status and body.
pub fn get(addr: SocketAddr, path: &str, timeout: Duration) -> std::io::Result<(u16, Vec<u8>)> {
    Client::new(addr, timeout).request("GET", path, b"")
}
