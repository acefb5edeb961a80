//! The one helper folder of the end-to-end tests, declared `mod common;` by the e2e binary
//! (`tests/e2e.rs`) and by `tests/docs.rs`: a gateway started in-process on 127.0.0.1 (real
//! sockets, real cores), simulated SGLang workers from `loadtest::sim`, and two clients: ureq
//! for whole requests and streams, and a raw socket ([`Conn`]) for tests that send hand-made
//! bytes and read exactly what came over the wire. `client`: the ureq helpers (an HTTP
//! implementation that is not ours); `fake_vllm`: a vLLM-shaped worker on raw TCP; `foreign`:
//! the aiohttp upstream (one that is not ours either); `hostile`: counterparts that attack the
//! gateway; `isolation`: what tests sharing one process must not share; `ports`: port numbers
//! no other test can take.

pub mod client;
pub mod fake_vllm;
pub mod foreign;
pub mod hostile;
pub mod isolation;
pub mod ports;

pub use client::{request, request_from, Streaming};
pub use foreign::Foreign;
pub use isolation::*;
pub use ports::*;

use bytes::BytesMut;
use loadtest::sim::{spawn_cluster, IoDriver, SimCluster, SimConfig};
use radixgate::config::Config;
use radixgate::http::{self, BodyFraming, ChunkedDecoder, HeadLimits};
use radixgate::runtime::{start, Running};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// The io driver the end-to-end tests must run on, from `RADIXGATE_TEST_IO_DRIVER`
/// (`uring` or `epoll`; unset or `auto`: whatever monoio picks, nothing asserted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestDriver {
    Uring,
    Epoll,
}

impl TestDriver {
    /// The `--io-driver` value that requests it.
    pub fn flag(self) -> &'static str {
        match self {
            TestDriver::Uring => "uring",
            TestDriver::Epoll => "legacy",
        }
    }
    /// What the gateway reports in `GET /get_server_info` `io_driver` when it runs on it.
    pub fn reported(self) -> &'static str {
        match self {
            TestDriver::Uring => "io_uring",
            TestDriver::Epoll => "epoll",
        }
    }
}

/// The driver requested by `RADIXGATE_TEST_IO_DRIVER`. For `epoll` this also sets
/// `MONOIO_FORCE_LEGACY_DRIVER=1` once, before any runtime of this test binary is built:
/// monoio caches its io_uring probe per process, so a gateway asking for epoll after another
/// runtime already probed would otherwise get io_uring while reporting epoll.
pub fn test_driver() -> Option<TestDriver> {
    static DRIVER: std::sync::OnceLock<Option<TestDriver>> = std::sync::OnceLock::new();
    *DRIVER.get_or_init(|| {
        let d = match std::env::var("RADIXGATE_TEST_IO_DRIVER").as_deref() {
            Err(_) | Ok("") | Ok("auto") => None,
            Ok("uring") | Ok("io_uring") => Some(TestDriver::Uring),
            Ok("epoll") | Ok("legacy") => Some(TestDriver::Epoll),
            Ok(other) => panic!("RADIXGATE_TEST_IO_DRIVER={other}: use uring, epoll or auto"),
        };
        if d == Some(TestDriver::Epoll) {
            std::env::set_var("MONOIO_FORCE_LEGACY_DRIVER", "1");
        }
        d
    })
}

/// Start a gateway with these extra flags (host 127.0.0.1, ephemeral port, metrics off,
/// one core unless the flags say otherwise). Tests manage workers from 127.0.0.1 without a
/// key, so `--keyless-local-admin` is added unless the flags set `--admin-api-key`; a test of
/// the default refusal uses [`gateway_exact`]. With `RADIXGATE_TEST_IO_DRIVER` set, the gateway
/// is started with the matching `--io-driver` (so it fails to start when that driver is
/// unavailable) and must report that driver in `/get_server_info`.
pub fn gateway(extra: &[&str]) -> Running {
    let mut flags: Vec<&str> = extra.to_vec();
    if !extra.contains(&"--admin-api-key") && !extra.contains(&"--keyless-local-admin") {
        flags.push("--keyless-local-admin");
    }
    gateway_exact(&flags)
}

/// Start a gateway with exactly these extra flags (besides the test defaults of [`gateway`]).
pub fn gateway_exact(extra: &[&str]) -> Running {
    let driver = test_driver();
    let mut args: Vec<String> = [
        "radixgate",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--prometheus-port",
        "0",
        "--log-level",
        "warn",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if !extra.iter().any(|a| *a == "--cores" || *a == "--cpu-list") {
        args.push("--cores".into());
        args.push("1".into());
    }
    let explicit_driver = extra.contains(&"--io-driver");
    if let (Some(d), false) = (driver, explicit_driver) {
        args.push("--io-driver".into());
        args.push(d.flag().into());
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    let cfg = Config::try_from_args(&args).expect("valid test flags");
    let running = start(cfg).unwrap_or_else(|e| panic!("gateway does not start: {e}"));
    if let (Some(d), false) = (driver, explicit_driver) {
        let info = request(running.addr, "GET", "/get_server_info", &[], b"")
            .expect("GET /get_server_info")
            .json();
        assert_eq!(
            info["io_driver"].as_str(),
            Some(d.reported()),
            "RADIXGATE_TEST_IO_DRIVER asked for {d:?}; /get_server_info says {}",
            info["io_driver"]
        );
    }
    running
}

/// Start a gateway in front of `urls` and wait until it is ready.
pub fn gateway_for(urls: &[String], extra: &[&str]) -> Running {
    let mut args: Vec<&str> = vec!["--worker-urls"];
    args.extend(urls.iter().map(String::as_str));
    args.extend_from_slice(extra);
    let gw = gateway(&args);
    wait_ready(gw.addr, Duration::from_secs(10));
    gw
}

/// [`gateway_for`] with exactly these flags (no `--keyless-local-admin` added).
pub fn gateway_for_exact(urls: &[String], extra: &[&str]) -> Running {
    let mut args: Vec<&str> = vec!["--worker-urls"];
    args.extend(urls.iter().map(String::as_str));
    args.extend_from_slice(extra);
    let gw = gateway_exact(&args);
    wait_ready(gw.addr, Duration::from_secs(10));
    gw
}

/// Poll /readiness until 200.
pub fn wait_ready(addr: SocketAddr, limit: Duration) {
    let until = Instant::now() + limit;
    while Instant::now() < until {
        if let Ok(r) = request(addr, "GET", "/readiness", &[], b"") {
            if r.status == 200 {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let last =
        request(addr, "GET", "/readiness", &[], b"").map(|r| format!("{} {}", r.status, r.text()));
    panic!("gateway at {addr} not ready within {limit:?}: {last:?}");
}

/// A simulated cluster of `n` workers with fast, deterministic defaults for tests.
pub fn sim(n: usize, tweak: impl FnOnce(&mut SimConfig)) -> SimCluster {
    let io_driver = match test_driver() {
        None => IoDriver::Auto,
        Some(TestDriver::Uring) => IoDriver::Uring,
        Some(TestDriver::Epoll) => IoDriver::Legacy,
    };
    let mut cfg = SimConfig {
        io_driver,
        ports: vec![0; n],
        time_scale: 50.0,
        tokenizer: loadtest::sim::TokenizerMode::Approx,
        default_max_tokens: 8,
        record_requests: 16,
        seed: 7,
        ..SimConfig::default()
    };
    tweak(&mut cfg);
    spawn_cluster(cfg).expect("sim cluster starts")
}

/// A response as received.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    /// Body with chunked framing removed.
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A client connection that can send raw bytes and read responses one by one.
pub struct Conn {
    pub stream: TcpStream,
    buf: BytesMut,
}

impl Conn {
    pub fn open(addr: SocketAddr) -> Conn {
        Conn::over(connect_retrying(addr).expect("connect"))
    }

    /// A connection over `stream` (20 s read timeout, no Nagle).
    fn over(stream: TcpStream) -> Conn {
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        stream.set_nodelay(true).unwrap();
        Conn {
            stream,
            buf: BytesMut::new(),
        }
    }

    pub fn send(&mut self, raw: &[u8]) {
        self.stream.write_all(raw).expect("write");
    }

    fn fill(&mut self) -> std::io::Result<usize> {
        let mut tmp = [0u8; 16384];
        let n = read_retrying(&mut self.stream, &mut tmp)?;
        self.buf.extend_from_slice(&tmp[..n]);
        Ok(n)
    }

    /// Read one response head (skipping 1xx unless `keep_1xx`).
    pub fn read_head(&mut self, keep_1xx: bool) -> std::io::Result<http::ResponseHead> {
        loop {
            if let Some(h) = http::parse_response_head(&mut self.buf, false, &HeadLimits::default())
                .map_err(|e| {
                    std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{e:?}"))
                })?
            {
                if h.status < 200 && !keep_1xx {
                    continue;
                }
                return Ok(h);
            }
            if self.fill()? == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "eof before head",
                ));
            }
        }
    }

    /// Read a whole response.
    pub fn read_response(&mut self) -> std::io::Result<Response> {
        let head = self.read_head(false)?;
        let headers = loadtest::sim::header_strings(&head);
        let mut body = BytesMut::new();
        match head.framing {
            BodyFraming::None => {}
            BodyFraming::Length(n) => {
                while (self.buf.len() as u64) < n {
                    if self.fill()? == 0 {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "eof in body",
                        ));
                    }
                }
                body = self.buf.split_to(n as usize);
            }
            BodyFraming::Chunked => {
                let mut d = ChunkedDecoder::new(1 << 30);
                loop {
                    let used = d.feed(&self.buf, &mut body).map_err(|e| {
                        std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{e:?}"))
                    })?;
                    let _ = self.buf.split_to(used);
                    if d.is_done() {
                        break;
                    }
                    if self.fill()? == 0 {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "eof in chunked body",
                        ));
                    }
                }
            }
            BodyFraming::Close => loop {
                body.extend_from_slice(&self.buf.split());
                if self.fill()? == 0 {
                    break;
                }
            },
        }
        Ok(Response {
            status: head.status,
            headers,
            body: body.to_vec(),
        })
    }

    /// Read the raw bytes that arrive until `end` is seen, noting when each read arrived.
    pub fn read_timed_until(&mut self, end: &[u8], limit: Duration) -> Vec<(Instant, Vec<u8>)> {
        let until = Instant::now() + limit;
        let mut out = Vec::new();
        let mut all = Vec::new();
        if !self.buf.is_empty() {
            let b = self.buf.split().to_vec();
            all.extend_from_slice(&b);
            out.push((Instant::now(), b));
        }
        while Instant::now() < until && !all.windows(end.len()).any(|w| w == end) {
            let mut tmp = [0u8; 16384];
            match read_retrying(&mut self.stream, &mut tmp) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    all.extend_from_slice(&tmp[..n]);
                    out.push((Instant::now(), tmp[..n].to_vec()));
                }
            }
        }
        out
    }

    /// Ok when the peer closes the connection (EOF or reset) within `limit` without sending
    /// anything more; Err describing what happened otherwise (bytes received, or timeout).
    pub fn closes_silently_within(&mut self, limit: Duration) -> Result<(), String> {
        let until = Instant::now() + limit;
        let mut extra = self.buf.split().to_vec();
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "still open after {limit:?}; received {:?}",
                    String::from_utf8_lossy(&extra)
                ));
            }
            self.stream.set_read_timeout(Some(left)).unwrap();
            let mut tmp = [0u8; 4096];
            match read_retrying(&mut self.stream, &mut tmp) {
                Ok(0) => break,
                Ok(n) => extra.extend_from_slice(&tmp[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(format!("read error {e}")),
            }
        }
        if extra.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "closed, but only after sending {:?}",
                String::from_utf8_lossy(&extra)
            ))
        }
    }

    /// True when the peer closed the connection (EOF) within `limit`.
    pub fn closed_within(&mut self, limit: Duration) -> bool {
        self.stream.set_read_timeout(Some(limit)).unwrap();
        let mut tmp = [0u8; 4096];
        loop {
            match read_retrying(&mut self.stream, &mut tmp) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) => return e.kind() == std::io::ErrorKind::ConnectionReset,
            }
        }
    }
}

/// `read`, retried when a signal interrupts it (EINTR is not an answer from the peer; test
/// threads that probed or built io_uring rings do get interrupted).
fn read_retrying(stream: &mut TcpStream, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        match stream.read(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

/// `connect`, retried when a signal interrupts it.
pub fn connect_retrying(addr: SocketAddr) -> std::io::Result<TcpStream> {
    let mut tries = 0;
    loop {
        match TcpStream::connect(addr) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted && tries < 10 => tries += 1,
            r => return r,
        }
    }
}

/// Render a request with a Content-Length body (the simulator's renderer: one for both crates).
pub use loadtest::sim::raw_request;

/// A chat request body.
pub fn chat_body(messages: &[(&str, &str)], stream: bool, max_tokens: u32) -> Vec<u8> {
    let msgs: Vec<serde_json::Value> = messages
        .iter()
        .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
        .collect();
    serde_json::to_vec(&serde_json::json!({"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": msgs, "stream": stream, "max_tokens": max_tokens})).unwrap()
}

/// The worker port that served a response (the sim sets x-worker-port).
pub fn served_by(r: &Response) -> u16 {
    r.header("x-worker-port")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no x-worker-port in {:?}", r.headers))
}

/// After a bad request, the gateway still serves a normal one.
pub fn assert_still_serves(addr: SocketAddr) {
    let r = request(
        addr,
        "POST",
        "/generate",
        &[],
        br#"{"text":"still fine","sampling_params":{"max_new_tokens":1}}"#,
    )
    .unwrap();
    assert_eq!(r.status, 200, "the gateway stopped serving: {}", r.text());
}

/// Poll `check` until it returns `Some`, or fail after `limit` naming `what`.
pub fn wait_until<T>(what: &str, limit: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let until = Instant::now() + limit;
    loop {
        if let Some(v) = check() {
            return v;
        }
        assert!(
            Instant::now() < until,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Rounds the gateway's telemetry thread has completed: each round reads every worker (with
/// `--saturation-admission`, the readings admission decides on, every `--saturation-poll-ms`).
pub fn telemetry_round(gw: &Running) -> u64 {
    gw.gateway().telemetry.report().round
}

/// Wait until a telemetry round that *started* after now has completed (two rounds on), so
/// what the workers reported before this call is in the gateway's readings and report. Fails
/// after 20 s, saying which round it waited for.
pub fn wait_fresh_round(gw: &Running) {
    let r0 = telemetry_round(gw);
    wait_until(
        &format!(
            "telemetry round {} (the first sure to start after the wait began, at round {r0})",
            r0 + 2
        ),
        Duration::from_secs(20),
        || (telemetry_round(gw) >= r0 + 2).then_some(()),
    );
}

/// The address of worker `i` of a simulated cluster.
pub fn worker_addr(cluster: &SimCluster, i: usize) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], cluster.ports()[i]))
}

/// `GET /debug/stats` of worker `i`: per-port counters (`connections`, `inference_connections`,
/// `inference_received`, `inference_answered`, `inference_in_progress`).
pub fn sim_stats(cluster: &SimCluster, i: usize) -> serde_json::Value {
    let r = request(worker_addr(cluster, i), "GET", "/debug/stats", &[], b"")
        .expect("GET /debug/stats");
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

/// One counter of `sim_stats`.
pub fn sim_count(cluster: &SimCluster, i: usize, name: &str) -> u64 {
    sim_stats(cluster, i)[name]
        .as_u64()
        .unwrap_or_else(|| panic!("no counter {name} in /debug/stats"))
}

/// Change worker `i`'s fault knobs at run time (`{"fail_rate": .., "hold": ..}`).
pub fn set_faults(cluster: &SimCluster, i: usize, knobs: serde_json::Value) {
    let r = request(
        worker_addr(cluster, i),
        "POST",
        "/debug/faults",
        &[],
        &serde_json::to_vec(&knobs).unwrap(),
    )
    .expect("POST /debug/faults");
    assert_eq!(r.status, 200, "{}", r.text());
}

/// The raw requests worker `i` recorded (`record_requests` must be on), as JSON text.
pub fn sim_recorded(cluster: &SimCluster, i: usize) -> String {
    let r = request(worker_addr(cluster, i), "GET", "/debug/requests", &[], b"")
        .expect("GET /debug/requests");
    assert_eq!(r.status, 200, "{}", r.text());
    r.text()
}

/// The body of the last request worker `i` received on `path`: the gateway's own health
/// checks, scrapes and info calls are recorded too, so "the last recorded" is not enough.
pub fn sim_last_body(cluster: &SimCluster, i: usize, path: &str) -> String {
    let all: serde_json::Value =
        serde_json::from_str(&sim_recorded(cluster, i)).expect("/debug/requests is JSON");
    all.as_array()
        .expect("/debug/requests is an array")
        .iter()
        .rev()
        .find(|r| r["path"] == path)
        .unwrap_or_else(|| panic!("worker {i} recorded no {path}: {all}"))["body"]
        .as_str()
        .expect("body is a string")
        .to_string()
}

/// The circuit state ("closed", "open", "half_open") the gateway reports for `url`.
pub fn circuit(gw: SocketAddr, headers: &[(&str, &str)], url: &str) -> String {
    let w = request(gw, "GET", "/workers", headers, b"").unwrap().json();
    w["workers"]
        .as_array()
        .unwrap_or_else(|| panic!("GET /workers: {w}"))
        .iter()
        .find(|x| x["url"] == url)
        .unwrap_or_else(|| panic!("{url} not in {w}"))["circuit"]
        .as_str()
        .unwrap()
        .to_string()
}

/// The Python interpreter the counterpart fixtures run on, when it imports every module in
/// `modules` (a dotted name is looked up without importing its package): RADIXGATE_TEST_PYTHON
/// (scripts/test.sh points it at `.venv-test/`, built from the pinned tests/requirements*.txt),
/// else `.venv-test/`. A missing counterpart fails the test, it never skips: the code we did
/// not write is the only judge of the protocol.
pub fn test_python(modules: &[&str]) -> String {
    let root = env!("CARGO_MANIFEST_DIR");
    let p = std::env::var("RADIXGATE_TEST_PYTHON")
        .unwrap_or_else(|_| format!("{root}/.venv-test/bin/python"));
    let check = format!(
        "import importlib.util as u, sys; sys.exit(0 if all(u.find_spec(m) for m in {modules:?}) else 1)"
    );
    let ok = std::process::Command::new(&p)
        .args(["-c", &check])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "{p} cannot import {modules:?}: run scripts/test.sh, which installs \
         tests/requirements*.txt into .venv-test/"
    );
    p
}

/// The folder holding the vLLM files tests/fixtures/vllm_publisher.py loads by path
/// (RADIXGATE_TEST_VLLM_DIR, else `.venv-test/vllm-0.33.0/`, kept there by scripts/test.sh from
/// the pinned wheel: vLLM is not pip-installed, its wheel is the GPU stack). Missing files fail
/// the test, as a missing Python module does in [`test_python`]: never a skip.
pub fn test_vllm_dir() -> String {
    let root = env!("CARGO_MANIFEST_DIR");
    let dir = std::env::var("RADIXGATE_TEST_VLLM_DIR")
        .unwrap_or_else(|_| format!("{root}/.venv-test/vllm-0.33.0"));
    let kv_events = std::path::Path::new(&dir).join("vllm/distributed/kv_events.py");
    assert!(
        kv_events.is_file(),
        "{} is missing: run scripts/test.sh, which fetches vLLM 0.33.0's wheel and keeps the \
         files its KV-event publisher needs in .venv-test/vllm-0.33.0/",
        kv_events.display()
    );
    dir
}

/// Starts of a child process that binds its own ports before a test gives up.
const SPAWN_TRIES: usize = 5;

/// Start a child process that binds the `n` ports it is given (the `radixgate` binary, a shell
/// around it): `command(&ports)` builds it for ports [`reserve`]d here, and it is up once
/// `ready(&ports)`, within `limit`. A child that exits before it is up, most likely because a
/// port was taken before it bound it ("already in use"), is started again on other ports, at
/// most [`SPAWN_TRIES`] times. Returns the child (killed by PID when dropped) and its ports.
pub fn spawn_on_ports(
    n: usize,
    limit: Duration,
    mut command: impl FnMut(&[u16]) -> std::process::Command,
    ready: impl Fn(&[u16]) -> bool,
) -> (ChildGuard, Vec<u16>) {
    let mut exits = Vec::new();
    for _ in 0..SPAWN_TRIES {
        let held: Vec<Reserved> = (0..n).map(|_| reserve()).collect();
        let ports: Vec<u16> = held.iter().map(|r| r.port).collect();
        let mut child = ChildGuard(Some(command(&ports).spawn().expect("start the child")));
        let until = Instant::now() + limit;
        let exited = loop {
            let c = child.0.as_mut().expect("child still owned");
            if let Some(status) = c.try_wait().expect("waitpid") {
                child.0 = None;
                break status;
            }
            // Up, and still the child answering (not someone else on a port it failed to bind).
            if ready(&ports) && c.try_wait().expect("waitpid").is_none() {
                return (child, ports);
            }
            assert!(
                Instant::now() < until,
                "the child on ports {ports:?} is not up within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        exits.push(format!("{exited} on ports {ports:?}"));
    }
    panic!("the child exited before it was up, {SPAWN_TRIES} times: {exits:?}");
}

/// The real `radixgate` binary in a child process, up (`/readiness` 200) on 127.0.0.1.
pub struct Spawned {
    pub child: ChildGuard,
    pub addr: SocketAddr,
}

impl Spawned {
    /// The child's PID.
    pub fn id(&self) -> u32 {
        self.child.id()
    }
}

/// Start the real `radixgate` binary on 127.0.0.1 with `cores` cores in front of `worker_url`
/// (and on the driver `RADIXGATE_TEST_IO_DRIVER` asks for), and wait until it is ready. The
/// guard kills it by PID and reaps it however the test ends.
pub fn spawn_binary(cores: u32, worker_url: &str) -> Spawned {
    spawn_binary_with(cores, worker_url, &[])
}

/// [`spawn_binary`] with extra flags (none of the ones it already sets).
pub fn spawn_binary_with(cores: u32, worker_url: &str, extra: &[&str]) -> Spawned {
    let command = |ports: &[u16]| {
        let mut args: Vec<String> = [
            "--host",
            "127.0.0.1",
            "--port",
            &ports[0].to_string(),
            "--prometheus-port",
            "0",
            "--cores",
            &cores.to_string(),
            "--log-level",
            "warn",
            "--worker-urls",
            worker_url,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if let Some(d) = test_driver() {
            args.extend(["--io-driver".to_string(), d.flag().to_string()]);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_radixgate"));
        cmd.args(&args);
        cmd
    };
    let ready = |ports: &[u16]| {
        request(local(ports[0]), "GET", "/readiness", &[], b"").is_ok_and(|r| r.status == 200)
    };
    let (child, ports) = spawn_on_ports(1, Duration::from_secs(20), command, ready);
    Spawned {
        child,
        addr: local(ports[0]),
    }
}

/// 127.0.0.1:`port`.
pub fn local(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// [`gateway_for`] with its Prometheus listener on 127.0.0.1 (`Running::metrics_addr`). The
/// gateway binds the port number it is given, so the number is [`reserve`]d until it has.
pub fn gateway_with_metrics(urls: &[String], extra: &[&str]) -> Running {
    let held = reserve();
    let port = held.port.to_string();
    let mut args = vec!["--prometheus-port", &port, "--prometheus-host", "127.0.0.1"];
    args.extend_from_slice(extra);
    gateway_for(urls, &args)
}

/// A child process killed by its PID (and reaped) when dropped, unless already waited for.
pub struct ChildGuard(pub Option<std::process::Child>);

impl ChildGuard {
    /// The child's PID.
    pub fn id(&self) -> u32 {
        self.0.as_ref().map_or(0, |c| c.id())
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A streamed chat request for `text` (`max_tokens` tokens) on a new connection, its head in.
pub fn stream_chat(addr: SocketAddr, text: &str, max_tokens: u32) -> Streaming {
    let body = chat_body(&[("user", text)], true, max_tokens);
    Streaming::open(addr, "POST", "/v1/chat/completions", &[], &body).expect("a response head")
}

/// `GET /workers` as JSON.
pub fn workers_json(addr: SocketAddr) -> serde_json::Value {
    request(addr, "GET", "/workers", &[], b"").unwrap().json()
}

/// One chat completion for `text` (streamed or not, `max_tokens` tokens), read to the end.
pub fn chat(addr: SocketAddr, text: &str, stream: bool, max_tokens: u32) -> Response {
    let body = chat_body(&[("user", text)], stream, max_tokens);
    request(addr, "POST", "/v1/chat/completions", &[], &body).unwrap()
}

/// One `/generate` call with this JSON body, read to the end.
pub fn generate(addr: SocketAddr, body: &[u8]) -> Response {
    request(addr, "POST", "/generate", &[], body).unwrap()
}

/// Wait until the health thread has learned `model` from the workers' `/v1/models` and the tree
/// writer has given it a tree of its own (requests sent from now on feed that tree).
pub fn wait_model_served(gw: &Running, model: &str) {
    let tree = gw
        .gateway()
        .router
        .tree
        .as_ref()
        .expect("a policy with a tree");
    wait_until("the model's own tree", Duration::from_secs(10), || {
        tree.sync();
        let forest = tree.load();
        let served = forest
            .models()
            .any(|(k, _)| matches!(k, radixgate::tree::TreeKey::Served(m) if m == model));
        served.then_some(())
    });
}

/// `POST /remove_worker?url=…`, asserting it succeeded.
pub fn remove_worker(addr: SocketAddr, url: &str) {
    let r = request(addr, "POST", &format!("/remove_worker?url={url}"), &[], b"").unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
}

/// A one-token `/generate` body that names request `i` (distinct prompts, tiny answers).
pub fn gen_body(i: usize) -> Vec<u8> {
    format!(r#"{{"text":"request {i}","sampling_params":{{"max_new_tokens":1}}}}"#).into_bytes()
}

/// `n` words from a small vocabulary, the same for the same seed: prompts that differ by
/// seed and share nothing by accident.
pub fn words(seed: u64, n: usize) -> String {
    let vocab = [
        "alpha", "river", "stone", "cloud", "maple", "quartz", "ember", "lantern", "harbor",
        "meadow", "cipher", "falcon",
    ];
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            vocab[(x % vocab.len() as u64) as usize]
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A non-streamed chat turn with these messages (and extra headers); it must answer 200.
pub fn chat_messages(
    gw: std::net::SocketAddr,
    msgs: &[(&str, &str)],
    extra_headers: &[(&str, &str)],
) -> Response {
    let r = request(
        gw,
        "POST",
        "/v1/chat/completions",
        extra_headers,
        &chat_body(msgs, false, 4),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    r
}

/// The fields of a `/proc/.../stat` line from field 3 (state) on: `fields[n - 3]` is field
/// `n`. Split after the parenthesised name, which may itself hold spaces and parentheses.
pub fn stat_fields(stat: &str) -> Vec<&str> {
    stat[stat.rfind(')').unwrap() + 2..].split(' ').collect()
}

/// CPU ticks (user + system, fields 14 and 15) process `pid` has used so far.
pub fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let f = stat_fields(&stat);
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// (thread name, nice value, scheduling policy) of every thread of this process.
pub fn thread_nices() -> Vec<(String, i32, u32)> {
    let mut out = Vec::new();
    for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
            continue; // the thread ended meanwhile
        };
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        // Field 19 (nice).
        let fields = stat_fields(&stat);
        let nice: i32 = fields[16].parse().unwrap();
        // Field 41 (policy): 0 SCHED_OTHER, 5 SCHED_IDLE.
        let policy: u32 = fields[38].parse().unwrap();
        out.push((comm.trim().to_string(), nice, policy));
    }
    out
}

/// Simulated servers in one PD role (bootstrap ports ephemeral).
pub fn pd_role(n: usize, mode: loadtest::sim::disagg::DisaggMode, fail_rate: f64) -> SimCluster {
    sim(n, |c| {
        c.disaggregation_mode = Some(mode);
        c.disaggregation_bootstrap_port = 0;
        c.faults.fail_rate = fail_rate;
    })
}

/// A PD gateway in front of these prefill and decode clusters (each prefill with its bootstrap
/// port), with `extra` flags.
pub fn pd_gateway(prefill: &[&SimCluster], decode: &[&SimCluster], extra: &[&str]) -> Running {
    let mut args: Vec<String> = vec!["--pd-disaggregation".into()];
    for c in prefill {
        for (url, port) in c.urls().into_iter().zip(c.bootstrap_ports()) {
            args.extend(["--prefill".into(), url, port.to_string()]);
        }
    }
    for c in decode {
        for url in c.urls() {
            args.extend(["--decode".into(), url]);
        }
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let gw = gateway(&refs);
    wait_ready(gw.addr, Duration::from_secs(10));
    gw
}

/// Where a buffered request's head ends and how long its `Content-Length` body is, once the
/// whole head is in `buf`: the one head parse of the raw upstreams the suites write.
pub fn request_head_bounds(buf: &[u8]) -> Option<(usize, usize)> {
    let i = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&buf[..i]).to_ascii_lowercase();
    let len = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    Some((i + 4, len))
}
