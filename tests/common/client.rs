//! The tests' HTTP client: [ureq], an HTTP/1.1 implementation radixgate did not write (its own
//! request writer, chunked decoder and keep-alive handling in `ureq-proto`; only the head
//! tokenizer, `httparse`, is a library both use). A framing bug shared by the gateway's writer
//! and its parser would pass a test whose client is the gateway's own parser; it cannot pass
//! one read by ureq. Hand-made bytes (malformed heads, pipelining, slow senders, HTTP/1.0) stay
//! on the raw socket [`Conn`](super::Conn): those tests are about the exact bytes.

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use ureq::unversioned::resolver::DefaultResolver;
use ureq::unversioned::transport::{
    Buffers, ConnectionDetails, Connector, LazyBuffers, NextTimeout, Transport,
};

use super::Response;

/// Longest wait for one read or write, as the raw client's socket timeouts.
const IO_TIMEOUT: Duration = Duration::from_secs(20);

/// The client settings every test uses: statuses are answers, not errors; no proxy from the
/// environment (everything is on 127.0.0.1); no redirects followed.
fn config() -> ureq::config::ConfigBuilder<ureq::typestate::AgentScope> {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .max_redirects(0)
        .allow_non_standard_methods(true)
        .timeout_per_read(Some(IO_TIMEOUT))
        .timeout_per_write(Some(IO_TIMEOUT))
        .timeout_connect(Some(IO_TIMEOUT))
}

/// A client whose every request opens a new connection (as the raw helpers did): one request,
/// one connection, so a test's requests never share state by accident.
fn one_shot_agent() -> ureq::Agent {
    ureq::Agent::new_with_config(config().max_idle_connections(0).build())
}

/// `io::Error` for a ureq failure (tests match on timeouts and resets).
fn io_error(e: ureq::Error) -> io::Error {
    match e {
        ureq::Error::Io(e) => e,
        ureq::Error::Timeout(t) => io::Error::new(io::ErrorKind::TimedOut, format!("{t:?}")),
        other => io::Error::new(io::ErrorKind::InvalidData, other.to_string()),
    }
}

/// The request as ureq sends it. A body goes with `Content-Length` when non-empty or when the
/// method is POST (as the raw renderer did); other methods without a body send none.
fn http_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> io::Result<ureq::http::request::Builder> {
    let mut b = ureq::http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"));
    for (n, v) in headers {
        b = b.header(*n, *v);
    }
    Ok(b)
}

fn run(
    agent: &ureq::Agent,
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> io::Result<ureq::http::Response<ureq::Body>> {
    let b = http_request(addr, method, path, headers)?;
    let bad = |e: ureq::http::Error| io::Error::new(io::ErrorKind::InvalidInput, e.to_string());
    if body.is_empty() && method != "POST" {
        agent.run(b.body(()).map_err(bad)?).map_err(io_error)
    } else {
        agent.run(b.body(body).map_err(bad)?).map_err(io_error)
    }
}

/// Status and headers of a ureq response, as [`Response`] holds them.
fn head_of(r: &ureq::http::Response<ureq::Body>) -> (u16, Vec<(String, String)>) {
    let headers = r
        .headers()
        .iter()
        .map(|(n, v)| {
            (
                n.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    (r.status().as_u16(), headers)
}

/// A whole response read by ureq (framing checked and removed by it, no size limit).
fn collect(mut r: ureq::http::Response<ureq::Body>) -> io::Result<Response> {
    let (status, headers) = head_of(&r);
    let body = r
        .body_mut()
        .with_config()
        .limit(u64::MAX)
        .read_to_vec()
        .map_err(io_error)?;
    Ok(Response {
        status,
        headers,
        body,
    })
}

/// One request on a new connection, read to its end.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> io::Result<Response> {
    collect(run(&one_shot_agent(), addr, method, path, headers, body)?)
}

/// One request on a new connection whose source address is `from` (any 127.0.0.0/8 address
/// reaches a listener on 127.0.0.1: a second "client host" without a second machine).
pub fn request_from(
    from: IpAddr,
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> io::Result<Response> {
    let agent =
        ureq::Agent::with_parts(config().build(), BindFrom(from), DefaultResolver::default());
    collect(run(&agent, addr, method, path, headers, body)?)
}

/// A response whose head has arrived and whose body is read as it comes (decoded by ureq).
pub struct Streaming {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    /// When the head was in.
    pub head_at: Instant,
    body: ureq::BodyReader<'static>,
}

impl Streaming {
    /// Send a request on a new connection and wait for the response head.
    pub fn open(
        addr: SocketAddr,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> io::Result<Streaming> {
        let r = run(&one_shot_agent(), addr, method, path, headers, body)?;
        let head_at = Instant::now();
        let (status, headers) = head_of(&r);
        let body = r.into_body().into_with_config().limit(u64::MAX).reader();
        Ok(Streaming {
            status,
            headers,
            head_at,
            body,
        })
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The next body bytes as they arrive (`Ok(empty)`: the body ended cleanly).
    pub fn read_some(&mut self) -> io::Result<Vec<u8>> {
        let mut tmp = vec![0u8; 16384];
        let n = self.body.read(&mut tmp)?;
        tmp.truncate(n);
        Ok(tmp)
    }

    /// Body bytes read until `end` is among them (or the body ends, fails, or `limit`
    /// passes), each read with the time it arrived.
    pub fn read_timed_until(&mut self, end: &[u8], limit: Duration) -> Vec<(Instant, Vec<u8>)> {
        let until = Instant::now() + limit;
        let mut out = Vec::new();
        let mut all = Vec::new();
        while Instant::now() < until && !all.windows(end.len()).any(|w| w == end) {
            match self.read_some() {
                Ok(b) if b.is_empty() => break,
                Ok(b) => {
                    all.extend_from_slice(&b);
                    out.push((Instant::now(), b));
                }
                Err(_) => break,
            }
        }
        out
    }

    /// The rest of the body; `Err` when it does not end as its framing says it must.
    pub fn read_to_end(&mut self) -> io::Result<Vec<u8>> {
        let mut all = Vec::new();
        self.body.read_to_end(&mut all)?;
        Ok(all)
    }
}

/// Connects from a chosen source address (ureq's own connector binds none).
#[derive(Debug)]
struct BindFrom(IpAddr);

impl<In: Transport> Connector<In> for BindFrom {
    type Out = BoundTcp;

    fn connect(
        &self,
        details: &ConnectionDetails,
        _chained: Option<In>,
    ) -> Result<Option<BoundTcp>, ureq::Error> {
        let addr = *details
            .addrs
            .iter()
            .next()
            .ok_or(ureq::Error::HostNotFound)?;
        let s = socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::STREAM,
            None,
        )?;
        s.bind(&SocketAddr::new(self.0, 0).into())?;
        s.connect(&addr.into())?;
        let stream: TcpStream = s.into();
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(IO_TIMEOUT))?;
        stream.set_write_timeout(Some(IO_TIMEOUT))?;
        let cfg = details.config;
        Ok(Some(BoundTcp {
            stream,
            buffers: LazyBuffers::new(cfg.input_buffer_size(), cfg.output_buffer_size()),
        }))
    }
}

/// A plain TCP transport for [`BindFrom`]; socket timeouts stand in for ureq's per-call ones.
#[derive(Debug)]
struct BoundTcp {
    stream: TcpStream,
    buffers: LazyBuffers,
}

impl Transport for BoundTcp {
    fn buffers(&mut self) -> &mut dyn Buffers {
        &mut self.buffers
    }

    fn transmit_output(&mut self, amount: usize, _timeout: NextTimeout) -> Result<(), ureq::Error> {
        let out = &self.buffers.output()[..amount];
        self.stream.write_all(out)?;
        Ok(())
    }

    fn await_input(&mut self, _timeout: NextTimeout) -> Result<bool, ureq::Error> {
        let buf = self.buffers.input_append_buf();
        let n = loop {
            match self.stream.read(buf) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => break r?,
            }
        };
        self.buffers.input_appended(n);
        Ok(n > 0)
    }

    /// Never pooled: each request from another host is its own connection.
    fn is_open(&mut self) -> bool {
        false
    }
}
