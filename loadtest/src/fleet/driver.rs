//! The driving shard's measurements: waits for the gateway to be ready, probes markers
//! (staleness seen from outside), sends routed background requests (latency), and reads the
//! gateway's Prometheus counters and /proc figures at each phase's edges.

use crate::streams::watch::{stat_ticks, status_kb};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

use super::client::{get, Client};
use super::prom;
use super::publish::{Marker, Seed};
use crate::rng::Rng;
use crate::streams::sys::now_ns;

/// A marker is "never routed" after this long.
pub const MARKER_GIVE_UP_NS: u64 = 5_000_000_000;
/// Each outstanding marker is probed at most this often.
pub const PROBE_EVERY_NS: u64 = 1_000_000;

/// The `/generate` body for `tokens`, one new token.
pub fn generate_body(tokens: &[u32]) -> Vec<u8> {
    let mut b = String::with_capacity(tokens.len() * 7 + 64);
    b.push_str("{\"input_ids\":[");
    for (i, t) in tokens.iter().enumerate() {
        if i > 0 {
            b.push(',');
        }
        b.push_str(&t.to_string());
    }
    b.push_str("],\"sampling_params\":{\"max_new_tokens\":1}}");
    b.into_bytes()
}

/// The server an answer names (`"text":"s123"` → 123).
pub fn answered_by(body: &[u8]) -> Option<usize> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let t = v
        .get("text")
        .or_else(|| v.pointer("/choices/0/text"))?
        .as_str()?;
    t.strip_prefix('s')?.parse().ok()
}

/// Wait until `GET /readiness` answers 200, at most `timeout`: (ready, seconds, last body).
pub fn wait_ready(gw: SocketAddr, timeout: Duration, stop: &AtomicBool) -> (bool, f64, String) {
    let t0 = now_ns();
    let mut last = String::new();
    while (now_ns() - t0) < timeout.as_nanos() as u64 && !stop.load(Ordering::Relaxed) {
        match get(gw, "/readiness", Duration::from_secs(2)) {
            Ok((200, b)) => {
                return (
                    true,
                    (now_ns() - t0) as f64 / 1e9,
                    String::from_utf8_lossy(&b).into(),
                )
            }
            Ok((_, b)) => last = String::from_utf8_lossy(&b).into(),
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    (false, (now_ns() - t0) as f64 / 1e9, last)
}

/// Per-phase results of the marker probe.
#[derive(Debug, Default, Clone)]
pub struct MarkerStats {
    /// Staleness of each routed marker (ms).
    pub staleness_ms: Vec<f64>,
    /// Markers never routed within 5 s.
    pub never: u64,
    /// Probes sent.
    pub probes: u64,
    /// Probes that failed (no answer, not 200).
    pub errors: u64,
}

/// Probe markers as they arrive: each outstanding one is sent as `/generate` at most every
/// [`PROBE_EVERY_NS`], all of them together at most `max_probe_rate` per second (round robin
/// over one keep-alive connection) until the answer names its
/// server (staleness = that probe's send time − publish time) or 5 s pass (never routed).
pub fn probe_markers(
    gw: SocketAddr,
    rx: Receiver<Marker>,
    phases: usize,
    results: Arc<Mutex<Vec<MarkerStats>>>,
    max_probe_rate: f64,
) {
    let min_gap = (1e9 / max_probe_rate.max(1.0)) as u64;
    let mut client = Client::new(gw, Duration::from_secs(5));
    let mut outstanding: Vec<(Marker, Vec<u8>, u64)> = Vec::new();
    {
        let mut r = results.lock().unwrap_or_else(|e| e.into_inner());
        r.resize(phases, MarkerStats::default());
    }
    let mut open = true;
    while open || !outstanding.is_empty() {
        // Take new markers: block when nothing is outstanding.
        loop {
            let m = if outstanding.is_empty() && open {
                match rx.recv_timeout(Duration::from_millis(100)) {
                    Ok(m) => m,
                    Err(RecvTimeoutError::Timeout) => break,
                    Err(RecvTimeoutError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            } else {
                match rx.try_recv() {
                    Ok(m) => m,
                    Err(std::sync::mpsc::TryRecvError::Empty) => break,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            };
            let body = generate_body(&m.tokens);
            outstanding.push((m, body, 0));
        }
        if outstanding.is_empty() {
            continue;
        }
        // Each marker's probe interval: 1 ms, stretched so all of them together stay within
        // the probe rate.
        let every = PROBE_EVERY_NS.max(min_gap * outstanding.len() as u64);
        let mut i = 0;
        let mut next_due = u64::MAX;
        while i < outstanding.len() {
            let now = now_ns();
            let (m, body, last) = &mut outstanding[i];
            if now - m.published_ns > MARKER_GIVE_UP_NS {
                let mut r = results.lock().unwrap_or_else(|e| e.into_inner());
                r[m.phase].never += 1;
                outstanding.swap_remove(i);
                continue;
            }
            if now < *last + every {
                next_due = next_due.min(*last + every);
                i += 1;
                continue;
            }
            *last = now;
            let res = client.request("POST", "/generate", body);
            let mut r = results.lock().unwrap_or_else(|e| e.into_inner());
            r[m.phase].probes += 1;
            match res {
                Ok((200, b)) if answered_by(&b) == Some(m.server) => {
                    r[m.phase]
                        .staleness_ms
                        .push(now.saturating_sub(m.published_ns) as f64 / 1e6);
                    outstanding.swap_remove(i);
                    continue;
                }
                Ok((200, _)) => {}
                _ => r[m.phase].errors += 1,
            }
            next_due = next_due.min(now + every);
            i += 1;
        }
        let now = now_ns();
        if next_due != u64::MAX && next_due > now {
            std::thread::sleep(Duration::from_nanos((next_due - now).min(1_000_000)));
        }
    }
}

/// Per-phase results of the background requests.
#[derive(Debug, Default, Clone)]
pub struct BgStats {
    /// Latency of each answered request (µs).
    pub latency_us: Vec<u64>,
    /// Answers from the server holding the prompt.
    pub to_holder: u64,
    /// Failed requests.
    pub errors: u64,
}

#[allow(clippy::too_many_arguments)]
/// Send the seeds' prompts as `/generate` at `rate` per second while a phase runs (`phase` ≥
/// 0), recording each answer's latency under that phase.
pub fn background(
    gw: SocketAddr,
    seeds: Arc<Vec<Seed>>,
    rate: f64,
    phase: Arc<AtomicI64>,
    phases: usize,
    results: Arc<Mutex<Vec<BgStats>>>,
    stop: Arc<AtomicBool>,
    seed: u64,
) {
    {
        let mut r = results.lock().unwrap_or_else(|e| e.into_inner());
        r.resize(phases, BgStats::default());
    }
    if rate <= 0.0 || seeds.is_empty() {
        return;
    }
    let bodies: Vec<(usize, Vec<u8>)> = seeds.iter().map(|(s, t)| (*s, generate_body(t))).collect();
    let mut client = Client::new(gw, Duration::from_secs(5));
    let mut rng = Rng::fork(seed, 0xb6);
    let interval = (1e9 / rate) as u64;
    let mut next = now_ns();
    while !stop.load(Ordering::Relaxed) {
        let p = phase.load(Ordering::Relaxed);
        if p < 0 {
            std::thread::sleep(Duration::from_millis(5));
            next = now_ns();
            continue;
        }
        let (server, body) = &bodies[rng.below(bodies.len())];
        let t0 = now_ns();
        let res = client.request("POST", "/generate", body);
        let dt = (now_ns() - t0) / 1000;
        {
            let mut r = results.lock().unwrap_or_else(|e| e.into_inner());
            let st = &mut r[p as usize];
            match res {
                Ok((200, b)) => {
                    st.latency_us.push(dt);
                    if answered_by(&b) == Some(*server) {
                        st.to_holder += 1;
                    }
                }
                _ => st.errors += 1,
            }
        }
        next += interval;
        let now = now_ns();
        if next > now {
            std::thread::sleep(Duration::from_nanos(next - now));
        } else if now - next > 100 * interval {
            next = now;
        }
    }
}

/// The gateway process as /proc shows it.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcSample {
    /// CLOCK_MONOTONIC ns of the reading.
    pub at_ns: u64,
    /// utime+stime ticks of the threads whose name starts with `kv-`.
    pub kv_ticks: u64,
    /// utime+stime ticks of the whole process.
    pub all_ticks: u64,
    /// VmRSS, kB.
    pub rss_kb: u64,
    /// VmHWM, kB.
    pub hwm_kb: u64,
}

/// Read `pid`'s threads' CPU time and memory (zeros when it is gone or not given).
pub fn read_proc(pid: Option<u32>) -> ProcSample {
    let mut s = ProcSample {
        at_ns: now_ns(),
        ..Default::default()
    };
    let Some(pid) = pid else { return s };
    let ticks = |stat: &str| stat_ticks(stat).unwrap_or(0);
    if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        s.all_ticks = ticks(&stat);
    }
    if let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in dir.flatten() {
            let p = t.path();
            let comm = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
            if comm.starts_with("kv-") {
                if let Ok(stat) = std::fs::read_to_string(p.join("stat")) {
                    s.kv_ticks += ticks(&stat);
                }
            }
        }
    }
    if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
        s.rss_kb = status_kb(&status, "VmRSS").unwrap_or(0);
        s.hwm_kb = status_kb(&status, "VmHWM").unwrap_or(0);
    }
    s
}

/// utime+stime ticks of this process's threads, by name (`fleet-gen`, `ZMQbg/IO/0`...).
pub fn own_thread_ticks() -> Vec<(String, u64)> {
    let mut out: Vec<(String, u64)> = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for t in dir.flatten() {
        let p = t.path();
        let comm = std::fs::read_to_string(p.join("comm"))
            .unwrap_or_default()
            .trim()
            .to_owned();
        let Ok(stat) = std::fs::read_to_string(p.join("stat")) else {
            continue;
        };
        let ticks = stat_ticks(&stat).unwrap_or(0);
        match out.iter_mut().find(|(n, _)| *n == comm) {
            Some((_, v)) => *v += ticks,
            None => out.push((comm, ticks)),
        }
    }
    out
}

/// Bytes waiting in loopback TCP buffers on the publishers' connections (`/proc/net/tcp`,
/// IPv4): `(gateway side: received, not yet read; fleet side: not yet sent or acknowledged;
/// gateway connections with unread bytes)`. Ports `lo..hi` are the PUB ports. Unread bytes on
/// the gateway's side mean its intake is behind; none there while the fleet holds its sends
/// back means the fleet (libzmq on CPU 0) limited the offer.
pub fn tcp_queues(lo: u16, hi: u16) -> (u64, u64, u64) {
    let Ok(text) = std::fs::read_to_string("/proc/net/tcp") else {
        return (0, 0, 0);
    };
    let (mut gw_rx, mut fleet_tx, mut behind) = (0u64, 0u64, 0u64);
    let port = |a: &str| {
        a.rsplit_once(':')
            .and_then(|(_, p)| u16::from_str_radix(p, 16).ok())
    };
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (Some(local), Some(remote), Some(q)) = (f.get(1), f.get(2), f.get(4)) else {
            continue;
        };
        let Some((tx, rx)) = q.split_once(':') else {
            continue;
        };
        let tx = u64::from_str_radix(tx, 16).unwrap_or(0);
        let rx = u64::from_str_radix(rx, 16).unwrap_or(0);
        let (Some(l), Some(r)) = (port(local), port(remote)) else {
            continue;
        };
        if (lo..hi).contains(&r) {
            gw_rx += rx;
            behind += u64::from(rx > 0);
        } else if (lo..hi).contains(&l) {
            fleet_tx += tx;
        }
    }
    (gw_rx, fleet_tx, behind)
}

/// CPU % of one core between two readings.
pub fn cpu_pct(a: u64, b: u64, secs: f64) -> f64 {
    // USER_HZ is 100 on Linux.
    (b.saturating_sub(a)) as f64 / 100.0 / secs.max(1e-9) * 100.0
}

/// The gateway's metrics text (empty on failure).
pub fn scrape(metrics: Option<SocketAddr>) -> Vec<prom::Sample> {
    let Some(m) = metrics else { return Vec::new() };
    match get(m, "/metrics", Duration::from_secs(10)) {
        Ok((200, b)) => prom::parse(&String::from_utf8_lossy(&b)),
        _ => Vec::new(),
    }
}

/// Percentile `q` (0..=1) of sorted values.
pub fn pct<T: Copy + Into<f64>>(sorted: &[T], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    Some(sorted[i.min(sorted.len() - 1)].into())
}

/// The gateway-side figures of one phase, from scrapes at its start (`a`), end (`b`) and after
/// its settle (`c`).
pub fn gateway_figures(
    a: &[prom::Sample],
    b: &[prom::Sample],
    c: &[prom::Sample],
    secs: f64,
) -> Value {
    let d = |x: &[prom::Sample], y: &[prom::Sample], name: &str, f: &[(&str, &str)]| match (
        prom::sum(x, name, f),
        prom::sum(y, name, f),
    ) {
        (Some(p), Some(q)) => Some(q - p),
        _ => None,
    };
    let ev = "radixgate_kv_events_total";
    let applied = "radixgate_kv_index_applied_blocks_total";
    let stale = "radixgate_kv_staleness_seconds";
    let sh = prom::delta(&prom::buckets(a, stale), &prom::buckets(c, stale));
    let q = |p: f64| prom::quantile(&sh, p).map(|s| s * 1000.0);
    let mut dropped = serde_json::Map::new();
    for s in c
        .iter()
        .filter(|s| s.name == "radixgate_kv_index_dropped_total")
    {
        if let Some((_, r)) = s.labels.iter().find(|(k, _)| k == "reason") {
            let before = prom::sum(a, &s.name, &[("reason", r)]).unwrap_or(0.0);
            dropped.insert(r.clone(), json!(s.value - before));
        }
    }
    json!({
        "scraped": !a.is_empty() && !b.is_empty(),
        "applied_blocks": d(a, b, applied, &[]),
        "applied_blocks_incl_settle": d(a, c, applied, &[]),
        "applied_blocks_per_s": d(a, b, applied, &[]).map(|x| x / secs),
        "events": d(a, b, ev, &[("kind", "event")]),
        "events_incl_settle": d(a, c, ev, &[("kind", "event")]),
        "events_per_s": d(a, b, ev, &[("kind", "event")]).map(|x| x / secs),
        "batches": d(a, b, ev, &[("kind", "batch")]),
        "gaps": d(a, c, ev, &[("kind", "gap")]),
        "resets": d(a, c, ev, &[("kind", "reset")]),
        "replays": d(a, c, ev, &[("kind", "replay")]),
        "malformed": d(a, c, ev, &[("kind", "malformed")]),
        "connect_failed": d(a, c, ev, &[("kind", "connect_failed")]),
        "dropped": dropped,
        "staleness_ms_p50": q(0.5), "staleness_ms_p99": q(0.99), "staleness_ms_max_bucket": q(1.0),
        "queue_bytes_end": prom::sum(b, "radixgate_kv_queue_bytes", &[]),
        "lagging_publishers_end": prom::sum(b, "radixgate_kv_lagging_publishers", &[]),
        "warm_workers_end": prom::sum(b, "radixgate_kv_warm_workers", &[]),
        "index_sources_end": prom::sum(b, "radixgate_kv_index_sources", &[]),
        "index_blocks_end": prom::sum(b, "radixgate_kv_index_blocks", &[]),
        "live_publishers_end": prom::sum(b, "radixgate_kv_source_state", &[("state", "live")]),
        "fallback_no_index": d(a, b, "radixgate_kv_fallback_total", &[("reason", "no_index")]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_and_answers() {
        let b = generate_body(&[1, 22, 333]);
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["input_ids"], json!([1, 22, 333]));
        assert_eq!(v["sampling_params"]["max_new_tokens"], 1);
        let g = super::super::http::generate(17).to_string();
        assert_eq!(answered_by(g.as_bytes()), Some(17));
        assert_eq!(answered_by(br#"{"text":"hello"}"#), None);
        assert_eq!(super::super::http::name_of(3), "s3");
    }

    #[test]
    fn percentiles() {
        let v = [1u32, 2, 3, 4, 5, 6, 7, 8, 9, 10];
        assert_eq!(pct(&v, 0.0), Some(1.0));
        assert_eq!(pct(&v, 0.5), Some(6.0));
        assert_eq!(pct(&v, 1.0), Some(10.0));
        assert_eq!(pct::<u32>(&[], 0.5), None);
        assert!((cpu_pct(100, 150, 1.0) - 50.0).abs() < 1e-9);
    }
}
