//! Memory fed by clients is bounded: every structure a client can grow (per-model trees, manual
//! routing keys, routing text extracted from a body, the recent-insert ring and the writer's
//! queue) has a bound, and each test here floods one of them over a real socket.
//!
//! Peak-memory checks read `VmHWM` from `/proc/self/status`, which is per process: they re-run
//! this test binary on one test (`RADIXGATE_MEMORY_CHILD` set) so nothing else shares the peak.

mod common;
use common::*;
use std::io::{Read, Write};
use std::time::Duration;

/// Set in the child process that runs one peak-memory measurement.
const CHILD: &str = "RADIXGATE_MEMORY_CHILD";

/// A `/proc/self/status` field in bytes (`VmHWM`, `VmRSS`); 0 when unavailable.
fn status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Runs test `name` of this binary alone in a child process and returns the figure it printed
/// as `FIGURE=<n>` (the child's peak-memory growth in bytes).
fn run_child(name: &str) -> u64 {
    let exe = std::env::current_exe().expect("test binary path");
    let out = std::process::Command::new(exe)
        .args([name, "--exact", "--nocapture", "--test-threads", "1"])
        .env(CHILD, "1")
        .output()
        .expect("run the child test");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child {name} failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .find_map(|l| {
            l.split("FIGURE=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("child {name} printed no figure: {stdout}"))
}

/// Body of the extraction flood: `{"prompt":[0,0,…]}` of about `bytes` bytes.
fn zeros_prompt(bytes: usize) -> Vec<u8> {
    let mut body = Vec::with_capacity(bytes + 16);
    body.extend_from_slice(br#"{"prompt":[0"#);
    while body.len() + 2 < bytes {
        body.extend_from_slice(b",0");
    }
    body.extend_from_slice(b"]}");
    body
}

const FLOOD_BODY: usize = 50 * 1000 * 1000;

#[test]
fn extraction_of_a_50_mb_number_array_peaks_under_4x_the_body() {
    let grew = run_child("child_extracts_a_50_mb_number_array");
    eprintln!("extraction peak growth: {} MB", grew / 1_000_000);
    assert!(
        grew < 4 * FLOOD_BODY as u64,
        "extracting a {FLOOD_BODY}-byte body grew the peak by {grew} bytes"
    );
}

/// Child of the test above: a gateway without workers (the request is extracted, then answered
/// 503), one 50 MB body sent over a socket, the growth of the peak printed.
#[test]
fn child_extracts_a_50_mb_number_array() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let gw = gateway(&["--policy", "cache_aware"]);
    let body = zeros_prompt(FLOOD_BODY);
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    );
    let before = status_bytes("VmHWM");
    let mut s = connect_retrying(gw.addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(&body).unwrap();
    let mut reply = [0u8; 64];
    let n = s.read(&mut reply).unwrap();
    let status = String::from_utf8_lossy(&reply[..n]).to_string();
    assert!(status.starts_with("HTTP/1.1 503"), "{status}");
    let after = status_bytes("VmHWM");
    println!("FIGURE={}", after.saturating_sub(before));
}
