//! One blocking `GET` for helper threads that run no monoio runtime (the KV index bootstrap from
//! a sibling copy): std sockets, a deadline over the whole exchange, the body capped, the
//! response framed by the same parser the proxy uses. Never called on a serving core.

use crate::http::{parse_response_head, BodyFraming, ChunkedDecoder, HeadLimits};
use bytes::BytesMut;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// `GET http://host:port/path` (with `Authorization: Bearer <bearer>` when given) → status and
/// body. Fails on a body above `max_body` bytes or when `timeout` passes.
pub fn get(
    base_url: &str,
    path: &str,
    bearer: Option<&str>,
    max_body: usize,
    timeout: Duration,
) -> Result<(u16, Vec<u8>), String> {
    let deadline = Instant::now() + timeout;
    let authority = base_url
        .strip_prefix("http://")
        .ok_or_else(|| format!("{base_url}: only http:// URLs"))?
        .trim_end_matches('/');
    if authority.contains('/') {
        return Err(format!("{base_url}: expected http://host:port"));
    }
    let addrs: Vec<SocketAddr> = authority
        .to_socket_addrs()
        .map_err(|e| format!("{authority}: {e}"))?
        .collect();
    let mut stream = None;
    let mut last = String::from("no address");
    for a in addrs {
        match TcpStream::connect_timeout(&a, left(deadline)?) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = format!("{a}: {e}"),
        }
    }
    let mut s = stream.ok_or(last)?;
    let auth = bearer
        .map(|k| format!("Authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: {authority}\r\n{auth}Connection: close\r\nAccept: */*\r\n\r\n"
    );
    s.set_write_timeout(Some(left(deadline)?))
        .map_err(|e| e.to_string())?;
    s.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
    let mut buf = BytesMut::with_capacity(64 * 1024);
    let mut chunk = vec![0u8; 64 * 1024];
    let limits = HeadLimits::default();
    let head = loop {
        if let Some(h) = parse_response_head(&mut buf, false, &limits).map_err(|e| e.to_string())? {
            if h.is_interim() {
                continue;
            }
            break h;
        }
        read_some(&mut s, &mut buf, &mut chunk, deadline)?
            .then_some(())
            .ok_or("the connection closed before the response head")?;
    };
    let mut body = BytesMut::new();
    match head.framing {
        BodyFraming::None => {}
        BodyFraming::Length(n) => {
            let n = usize::try_from(n).map_err(|_| "body too large")?;
            if n > max_body {
                return Err(format!("body of {n} bytes is over {max_body}"));
            }
            // Room for all of it at once: no doubling on the way (a copy near the cap would
            // otherwise peak at twice its size).
            buf.reserve(n.saturating_sub(buf.len()));
            while buf.len() < n {
                if !read_some(&mut s, &mut buf, &mut chunk, deadline)? {
                    return Err("the connection closed inside the body".into());
                }
            }
            body = buf.split_to(n);
        }
        BodyFraming::Chunked => {
            let mut dec = ChunkedDecoder::new(max_body as u64);
            loop {
                let used = dec.feed(&buf, &mut body).map_err(|e| e.to_string())?;
                let _ = buf.split_to(used);
                if dec.is_done() {
                    break;
                }
                if !read_some(&mut s, &mut buf, &mut chunk, deadline)? {
                    return Err("the connection closed inside the body".into());
                }
            }
        }
        BodyFraming::Close => loop {
            if buf.len() > max_body {
                return Err(format!("body over {max_body} bytes"));
            }
            if !read_some(&mut s, &mut buf, &mut chunk, deadline)? {
                body = buf;
                break;
            }
        },
    }
    // A redirect is an answer like any other (never followed: the key goes only where the
    // operator pointed it).
    Ok((head.status, Vec::from(body)))
}

/// Read what is there into `buf`; false at end of stream.
fn read_some(
    s: &mut TcpStream,
    buf: &mut BytesMut,
    chunk: &mut [u8],
    deadline: Instant,
) -> Result<bool, String> {
    s.set_read_timeout(Some(left(deadline)?))
        .map_err(|e| e.to_string())?;
    let n = s.read(chunk).map_err(|e| e.to_string())?;
    buf.extend_from_slice(&chunk[..n]);
    Ok(n > 0)
}

fn left(deadline: Instant) -> Result<Duration, String> {
    let d = deadline.saturating_duration_since(Instant::now());
    if d.is_zero() {
        return Err("timed out".into());
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
        assert!(get(&u, "/", None, 100, t).unwrap_err().contains("over 100"));
        let u = serve_once(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n200\r\n");
        assert!(get(&u, "/", None, 100, t).is_err());
        assert!(get("https://x:1", "/", None, 100, t).is_err());
        assert!(get("http://x:1/path", "/", None, 100, t).is_err());
    }
}
