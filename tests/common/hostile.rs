//! Hostile counterparts for end-to-end tests of what workers and publishers can do to the
//! gateway: the `radixgate` binary in a child process (its own `/proc` memory and descriptors,
//! its own Prometheus counters), fake workers with scripted `/get_server_info` answers, and
//! KV-event publishers written out by hand (just enough ZMTP 3.0) that flood, stall, lie or
//! break the protocol. Used by `hardening_events.rs` and the hostile soak in `soak.rs`.

use super::*;
use serde_json::json;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Every wait here ends by then (the normal case is milliseconds).
pub const LIMIT: Duration = Duration::from_secs(15);
/// The model every worker here serves.
pub const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
/// The largest payload the gateway takes (`kv::wire::MAX_PAYLOAD_BYTES`).
pub const MAX_PAYLOAD: usize = radixgate::kv::wire::MAX_PAYLOAD_BYTES;

/// The `radixgate` binary running in a child process (killed by its PID when dropped).
pub struct Gw {
    pub child: ChildGuard,
    pub addr: SocketAddr,
    pub metrics: SocketAddr,
}

/// Start the binary with `--kv-events` in front of `workers` (one core, loopback only, its
/// Prometheus port on 127.0.0.1, worker management allowed from this host), `extra` flags and
/// `env`, and wait until it answers `/health` and `/metrics`.
pub fn spawn_gateway(workers: &[&str], extra: &[&str], env: &[(&str, &str)]) -> Gw {
    let command = |ports: &[u16]| {
        let mut args: Vec<String> = [
            "--host",
            "127.0.0.1",
            "--port",
            &ports[0].to_string(),
            "--prometheus-port",
            &ports[1].to_string(),
            "--prometheus-host",
            "127.0.0.1",
            "--cores",
            "1",
            "--log-level",
            "warn",
            "--keyless-local-admin",
            "--policy",
            "round_robin",
            "--kv-events",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if let Some(d) = test_driver() {
            args.extend(["--io-driver".to_string(), d.flag().to_string()]);
        }
        if !workers.is_empty() {
            args.push("--worker-urls".into());
            args.extend(workers.iter().map(|s| s.to_string()));
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_radixgate"));
        cmd.args(&args)
            .envs(env.iter().copied())
            .stdout(Stdio::null());
        cmd
    };
    let answers = |port: u16, path: &str| {
        request(local(port), "GET", path, &[], b"").is_ok_and(|r| r.status == 200)
    };
    let ready = |ports: &[u16]| answers(ports[0], "/health") && answers(ports[1], "/metrics");
    let (child, ports) = spawn_on_ports(2, LIMIT, command, ready);
    Gw {
        child,
        addr: local(ports[0]),
        metrics: local(ports[1]),
    }
}

impl Gw {
    pub fn scrape(&self) -> String {
        let r = request(self.metrics, "GET", "/metrics", &[], b"").expect("scrape /metrics");
        assert_eq!(r.status, 200, "{}", r.text());
        r.text()
    }

    /// Several `radixgate_kv_events_total` kinds read from one scrape (counters compared with
    /// each other must be read at one moment: at hundreds a second, two scrapes apart differ).
    pub fn kvs<const N: usize>(&self, kinds: [&str; N]) -> [u64; N] {
        let text = self.scrape();
        kinds.map(|kind| {
            sample(
                &text,
                &format!("radixgate_kv_events_total{{kind=\"{kind}\"}}"),
            )
            .map_or(0, |v| v as u64)
        })
    }

    /// `radixgate_kv_events_total{kind="<kind>"}` (0 when absent).
    pub fn kv(&self, kind: &str) -> u64 {
        sample(
            &self.scrape(),
            &format!("radixgate_kv_events_total{{kind=\"{kind}\"}}"),
        )
        .map_or(0, |v| v as u64)
    }

    /// The state `radixgate_kv_source_state` shows for `worker`'s rank `rank`.
    pub fn state(&self, worker: &str, rank: u32) -> Option<String> {
        let text = self.scrape();
        let prefix =
            format!("radixgate_kv_source_state{{worker=\"{worker}\",rank=\"{rank}\",state=\"");
        text.lines().find_map(|l| {
            let rest = l.strip_prefix(&prefix)?;
            let (state, value) = rest.split_once("\"} ")?;
            (value.trim() == "1").then(|| state.to_string())
        })
    }

    /// Publishers of `worker` the gauge lists (any state).
    pub fn sources_of(&self, worker: &str) -> usize {
        let prefix = format!("radixgate_kv_source_state{{worker=\"{worker}\",");
        self.scrape()
            .lines()
            .filter(|l| l.starts_with(&prefix) && l.ends_with(" 1"))
            .count()
    }

    /// A `/proc/PID/status` field in bytes (`VmRSS`, `VmHWM`).
    pub fn status_bytes(&self, field: &str) -> u64 {
        proc_status_bytes(self.child.id(), field)
            .unwrap_or_else(|| panic!("no {field} in the gateway's /proc status"))
    }

    /// Sockets the gateway holds open (its descriptors that are sockets).
    pub fn sockets(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .expect("the gateway's /proc fd")
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|l| l.to_string_lossy().starts_with("socket:"))
            .count()
    }

    /// Add a worker at run time.
    pub fn add_worker(&self, url: &str) {
        let body = json!({ "url": url }).to_string();
        let r = request(self.addr, "POST", "/workers", &[], body.as_bytes()).unwrap();
        assert_eq!(r.status, 202, "{}", r.text());
    }
}

/// A `/proc/PID/status` field of process `pid` in bytes (`None`: no such process or field).
pub fn proc_status_bytes(pid: u32, field: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// The value of the sample line that starts with `series` (name and labels, exactly).
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let v = l.strip_prefix(series)?.strip_prefix(' ')?;
        v.trim().parse().ok()
    })
}

pub const MIB: u64 = 1 << 20;

/// A worker that is only an HTTP server answering what the gateway asks (`/health`,
/// `/v1/models`, `/get_model_info`, `/generate`...) and a scripted `/get_server_info`.
pub struct FakeWorker {
    pub url: String,
    /// `/get_server_info` requests answered.
    pub info_asked: Arc<AtomicUsize>,
}

pub fn fake_worker(info: serde_json::Value) -> FakeWorker {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let info_asked = Arc::new(AtomicUsize::new(0));
    let asked = info_asked.clone();
    let info = Arc::new(info.to_string());
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            let (asked, info) = (asked.clone(), info.clone());
            std::thread::spawn(move || serve_fake(conn, &asked, &info));
        }
    });
    FakeWorker { url, info_asked }
}

pub fn serve_fake(mut conn: TcpStream, asked: &AtomicUsize, info: &str) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    let mut buf = Vec::new();
    loop {
        let (head_end, len) = loop {
            if let Some(bounds) = request_head_bounds(&buf) {
                break bounds;
            }
            let mut tmp = [0u8; 8192];
            match conn.read(&mut tmp) {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&tmp[..n]),
            }
        };
        while buf.len() < head_end + len {
            let mut tmp = [0u8; 8192];
            match conn.read(&mut tmp) {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&tmp[..n]),
            }
        }
        let req: Vec<u8> = buf.drain(..head_end + len).collect();
        let line = String::from_utf8_lossy(&req[..req.len().min(200)]).into_owned();
        let path = line.split(' ').nth(1).unwrap_or("").to_string();
        let (status, body) = match path.as_str() {
            "/health" | "/health_generate" => (200, String::new()),
            "/v1/models" => (
                200,
                json!({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).to_string(),
            ),
            "/get_model_info" => (200, json!({"model_path": MODEL}).to_string()),
            "/get_server_info" | "/server_info" => {
                asked.fetch_add(1, Ordering::Relaxed);
                (200, info.to_string())
            }
            "/generate" | "/v1/completions" | "/v1/chat/completions" => (
                200,
                json!({"text": "ok", "meta_info": {"id": "fake", "prompt_tokens": 1,
                    "completion_tokens": 1, "cached_tokens": 0,
                    "finish_reason": {"type": "length", "length": 1}}})
                .to_string(),
            ),
            _ => (404, json!({"detail": "Not Found"}).to_string()),
        };
        let reply = format!(
            "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        if conn.write_all(reply.as_bytes()).is_err() {
            return;
        }
    }
}

/// SGLang 0.5.23's `kv_events` descriptor in `/get_server_info`.
pub fn descriptor(
    host: &str,
    port_base: u16,
    dp_size: u64,
    replay_base: Option<u16>,
) -> serde_json::Value {
    json!({
        "served_model_name": MODEL,
        "kv_events": {
            "publisher": "zmq", "endpoint_host": host, "endpoint_port_base": port_base,
            "topic": "kv-events", "block_size": 4, "dp_size": dp_size,
            "replay_endpoint_port_base": replay_base,
        }
    })
}

// ---- publishers written out by hand (ZMTP 3.0, NULL mechanism) --------------------------------

/// What a publisher here does once its handshake is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// Valid batches (`AllBlocksCleared`), one every 100 ms, sequence numbers 0, 1, 2...
    Honest,
    /// Valid batches every 100 ms whose sequence numbers skip one each time (0, 2, 4...): every
    /// message is a gap, so the gateway asks the replay socket each time.
    Gappy,
    /// Nothing (a quiet server).
    Quiet,
    /// One message that never ends: 1-byte frames, each with MORE set, as fast as taken.
    EndlessFrames,
    /// A frame announcing 2^40 bytes, its body trickled a byte every 10 ms.
    HugeFrame,
    /// Max-size messages (`[topic, seq, 32 MiB payload]`, the payload not msgpack), back to
    /// back as fast as taken.
    MaxMessages,
    /// One max-size message sent but for its last byte, then held.
    HoldUnfinished,
    /// Valid batches that lie, one every 5 ms for 3 s, then the connection ends: an empty store
    /// claiming a block size of 0, stores of 1,024 one-token blocks (32 sets by turns), the same
    /// block stored again and again (a holder list to inflate), removals of blocks never stored.
    Lying,
    /// PINGs (ZMTP 3.1 heartbeats, each owed a PONG) back to back as fast as taken, never a
    /// byte read (with [`small_window_listener`], what the gateway sends stays unsent).
    PingFlood,
}

/// A live message `[topic, seq, payload]` holding one lying batch (see [`Act::Lying`]).
pub fn lying_message(seq: i64) -> Vec<u8> {
    use radixgate::kv::wire::{
        encode_batch, BlockRemoved, BlockStored, EngineHash, EventBatch, Form, KvEvent,
    };
    let stored = |hashes: Vec<u64>, tokens: Vec<u32>, block_size: u32| {
        KvEvent::BlockStored(BlockStored {
            block_hashes: hashes.into_iter().map(EngineHash).collect(),
            parent: None,
            token_ids: tokens,
            block_size,
            lora_id: None,
            medium: None,
            cache_salt: None,
            lora_name: None,
        })
    };
    let event = match seq % 4 {
        0 => stored(vec![], vec![], 0),
        1 => {
            // 32 rotating sets: the blocks lie, their number stays small.
            let base = ((seq as u64 / 4) % 32) << 12;
            stored((base..base + 1024).collect(), (0..1024).collect(), 1)
        }
        2 => stored(vec![7], vec![1, 2, 3, 4], 4),
        _ => KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: (0..64).map(|i| EngineHash(u64::MAX - i)).collect(),
            medium: None,
        }),
    };
    let batch = EventBatch {
        ts: Some(1.0),
        events: vec![event],
        ..EventBatch::default()
    };
    let mut out = Vec::new();
    frame(true, b"kv-events", &mut out);
    frame(true, &seq.to_be_bytes(), &mut out);
    frame(false, &encode_batch(&batch, Form::Array), &mut out);
    out
}

/// A listener on 127.0.0.1 (any port) whose connections take at most a few KiB before their
/// sender must wait: a publisher on it that reads nothing leaves the gateway's bytes unsent.
pub fn small_window_listener() -> TcpListener {
    use socket2::{Domain, SockAddr, Socket, Type};
    let s = Socket::new(Domain::IPV4, Type::STREAM, None).expect("a socket");
    // Set before listening, so every accepted connection has it from its first segment.
    s.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    s.bind(&SockAddr::from(SocketAddr::from(([127, 0, 0, 1], 0))))
        .expect("bind a publisher");
    s.listen(16).expect("listen");
    s.into()
}

/// `n` PING commands (TTL 0, the longest context ZMTP allows, 16 bytes, counting from `first`):
/// each is owed a PONG of 23 bytes.
pub fn pings(first: u32, n: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(25 * n as usize);
    for i in 0..n {
        out.extend_from_slice(b"\x04\x17\x04PING\x00\x00");
        out.extend_from_slice(&[0; 12]);
        out.extend_from_slice(&first.wrapping_add(i).to_be_bytes());
    }
    out
}

/// Bytes a PUB opens with: greeting (ZMTP 3.0, NULL, as-server 1) and READY naming PUB.
pub fn pub_hello() -> Vec<u8> {
    let mut b = vec![0xFF, 0, 0, 0, 0, 0, 0, 0, 1, 0x7F, 3, 0];
    b.extend_from_slice(b"NULL");
    b.resize(32, 0);
    b.push(1);
    b.resize(64, 0);
    let body = b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB";
    b.extend_from_slice(&[0x04, body.len() as u8]);
    b.extend_from_slice(body);
    b
}

/// One frame (`more`: not the message's last).
pub fn frame(more: bool, body: &[u8], out: &mut Vec<u8>) {
    let flag = u8::from(more);
    if body.len() > 255 {
        out.push(flag | 0x02);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(flag);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
}

/// A live message `[topic, seq, payload]` holding one `AllBlocksCleared` batch.
pub fn cleared_message(seq: i64) -> Vec<u8> {
    let mut payload = vec![0x93, 0xcb];
    payload.extend_from_slice(&1.0f64.to_be_bytes());
    payload.extend_from_slice(&[0x91, 0x91, 0xb0]);
    payload.extend_from_slice(b"AllBlocksCleared");
    payload.push(0x00);
    let mut out = Vec::new();
    frame(true, b"kv-events", &mut out);
    frame(true, &seq.to_be_bytes(), &mut out);
    frame(false, &payload, &mut out);
    out
}

/// A listening publisher: every connection is greeted as a PUB, then acts as `act(n)` says for
/// the n-th connection (from 0) once `go` is set. Stops (listener closed, connections ended)
/// when dropped.
pub struct Zpub {
    pub port: u16,
    /// When each connection was accepted.
    pub accepted: Arc<Mutex<Vec<Instant>>>,
    /// Connections whose peer sent a SUB's greeting and READY.
    pub subscribers: Arc<AtomicUsize>,
    pub go: Arc<AtomicBool>,
    pub stop: Arc<AtomicBool>,
}

impl Zpub {
    pub fn bind(ip: [u8; 4], port: u16, act: impl Fn(usize) -> Act + Send + 'static) -> Zpub {
        let listener = TcpListener::bind(SocketAddr::from((ip, port))).expect("bind a publisher");
        Zpub::on(listener, act)
    }

    /// A publisher on a listener bound by the caller (a port of a run, or of a pair).
    pub fn on(listener: TcpListener, act: impl Fn(usize) -> Act + Send + 'static) -> Zpub {
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(Mutex::new(Vec::new()));
        let subscribers = Arc::new(AtomicUsize::new(0));
        let go = Arc::new(AtomicBool::new(true));
        let stop = Arc::new(AtomicBool::new(false));
        let (acc, subs, go2, stop2) = (
            accepted.clone(),
            subscribers.clone(),
            go.clone(),
            stop.clone(),
        );
        std::thread::spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((s, _)) => {
                        let n = {
                            let mut a = acc.lock().unwrap();
                            a.push(Instant::now());
                            a.len() - 1
                        };
                        let what = act(n);
                        let (subs, go, stop) = (subs.clone(), go2.clone(), stop2.clone());
                        std::thread::spawn(move || serve_pub(s, what, &subs, &go, &stop));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        Zpub {
            port,
            accepted,
            subscribers,
            go,
            stop,
        }
    }

    /// A publisher whose connections wait, greeted, until [`Zpub::arm`].
    pub fn bind_unarmed(
        ip: [u8; 4],
        port: u16,
        act: impl Fn(usize) -> Act + Send + 'static,
    ) -> Zpub {
        let z = Zpub::bind(ip, port, act);
        z.go.store(false, Ordering::Relaxed);
        z
    }

    pub fn arm(&self) {
        self.go.store(true, Ordering::Relaxed);
    }

    /// Close the listener and end every connection.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    pub fn accepted(&self) -> usize {
        self.accepted.lock().unwrap().len()
    }

    pub fn times(&self) -> Vec<Instant> {
        self.accepted.lock().unwrap().clone()
    }
}

impl Drop for Zpub {
    fn drop(&mut self) {
        Zpub::stop(self);
    }
}

/// Whether the peer has closed (or reset) the connection.
pub fn peer_closed(s: &mut TcpStream) -> bool {
    let _ = s.set_nonblocking(true);
    let mut b = [0u8; 4096];
    let closed = loop {
        match s.read(&mut b) {
            Ok(0) => break true,
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::WouldBlock => break false,
            Err(_) => break true,
        }
    };
    let _ = s.set_nonblocking(false);
    closed
}

pub fn serve_pub(
    mut s: TcpStream,
    act: Act,
    subs: &AtomicUsize,
    go: &AtomicBool,
    stop: &AtomicBool,
) {
    let _ = s.set_nodelay(true);
    if s.write_all(&pub_hello()).is_err() {
        return;
    }
    // The subscriber's greeting and READY.
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let mut greeting = [0u8; 64];
    let mut head = [0u8; 2];
    if s.read_exact(&mut greeting).is_err() || s.read_exact(&mut head).is_err() {
        return;
    }
    let mut ready = vec![0u8; usize::from(head[1])];
    if s.read_exact(&mut ready).is_err() || !ready.ends_with(b"SUB") {
        return;
    }
    subs.fetch_add(1, Ordering::Relaxed);
    while !go.load(Ordering::Relaxed) {
        if stop.load(Ordering::Relaxed) || peer_closed(&mut s) {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = s.set_write_timeout(Some(Duration::from_millis(100)));
    // Write `bytes` whole unless told to stop or the peer goes away.
    let send = |s: &mut TcpStream, mut bytes: &[u8]| -> bool {
        while !bytes.is_empty() {
            if stop.load(Ordering::Relaxed) {
                return false;
            }
            match s.write(bytes) {
                Ok(0) => return false,
                Ok(n) => bytes = &bytes[n..],
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return false,
            }
        }
        true
    };
    match act {
        Act::Honest | Act::Gappy => {
            let step = if act == Act::Gappy { 2 } else { 1 };
            let mut seq = 0i64;
            while send(&mut s, &cleared_message(seq)) {
                seq += step;
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Act::Lying => {
            // Three seconds of lies, then the connection ends (the next one may act otherwise).
            let until = Instant::now() + Duration::from_secs(3);
            let mut seq = 0i64;
            while Instant::now() < until && send(&mut s, &lying_message(seq)) {
                seq += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        Act::Quiet => {
            while !stop.load(Ordering::Relaxed) && !peer_closed(&mut s) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Act::EndlessFrames => {
            let chunk: Vec<u8> = [0x01u8, 0x01, 0x00].repeat(20_000);
            while send(&mut s, &chunk) {}
        }
        Act::HugeFrame => {
            let mut head = vec![0x02];
            head.extend_from_slice(&(1u64 << 40).to_be_bytes());
            let mut ok = send(&mut s, &head);
            while ok {
                ok = send(&mut s, &[0]);
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        Act::MaxMessages => {
            let payload = vec![0xc1u8; MAX_PAYLOAD];
            let mut seq = 0i64;
            loop {
                let mut head = Vec::new();
                frame(true, b"", &mut head);
                frame(true, &seq.to_be_bytes(), &mut head);
                head.push(0x02);
                head.extend_from_slice(&(payload.len() as u64).to_be_bytes());
                if !send(&mut s, &head) || !send(&mut s, &payload) {
                    break;
                }
                seq += 1;
            }
        }
        Act::PingFlood => {
            let mut n = 0u32;
            while send(&mut s, &pings(n, 4096)) {
                n = n.wrapping_add(4096);
            }
        }
        Act::HoldUnfinished => {
            let mut msg = Vec::new();
            frame(true, b"", &mut msg);
            frame(true, &0i64.to_be_bytes(), &mut msg);
            msg.push(0x02);
            msg.extend_from_slice(&(MAX_PAYLOAD as u64).to_be_bytes());
            msg.resize(msg.len() + MAX_PAYLOAD - 1, 0xc1);
            if send(&mut s, &msg) {
                while !stop.load(Ordering::Relaxed) && !peer_closed(&mut s) {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }
}

/// `n` publishers on consecutive ports of `ip` (a DP-rank run), each acting as `act`.
pub fn zpub_run(ip: [u8; 4], n: u16, act: Act, armed: bool) -> Vec<Zpub> {
    listener_run(ip, n)
        .into_iter()
        .map(|l| {
            let z = Zpub::on(l, move |_| act);
            if !armed {
                z.go.store(false, Ordering::Relaxed);
            }
            z
        })
        .collect()
}

/// A plain listener counting the connections it is offered (accepted and closed at once).
pub struct Counter {
    /// The port it listens on.
    pub port: u16,
    pub count: Arc<AtomicUsize>,
    pub stop: Arc<AtomicBool>,
}

pub fn counter(ip: [u8; 4], port: u16) -> Counter {
    counter_on(TcpListener::bind(SocketAddr::from((ip, port))).expect("bind a counting listener"))
}

/// [`counter`] on a listener bound by the caller.
pub fn counter_on(l: TcpListener) -> Counter {
    l.set_nonblocking(true).unwrap();
    let port = l.local_addr().unwrap().port();
    let count = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let (c, s) = (count.clone(), stop.clone());
    std::thread::spawn(move || {
        while !s.load(Ordering::Relaxed) {
            match l.accept() {
                Ok(_) => {
                    c.fetch_add(1, Ordering::Relaxed);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(2)),
            }
        }
    });
    Counter { port, count, stop }
}

impl Counter {
    pub fn count(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }
}

impl Drop for Counter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
