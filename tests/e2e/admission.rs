//! Admission under overload (`--saturation-admission`) end to end: a simulated worker that
//! runs one request at a time (so a second one waits in its own queue, and the worker reads
//! saturated), the gateway in front of it, and clients on real sockets. Ordering by class,
//! clamping to the tenant's maximum, shedding with `Retry-After`, the queue timeout, a client
//! that leaves while queued, and tenant limits.

use crate::common::*;
use radixgate::runtime::Running;
use serde_json::json;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One worker running one request at a time, 20 ms a token in real time (a 100-token answer
/// holds it 2 s: long enough for the waits below to be decided while it is busy).
fn one_slot_worker() -> loadtest::sim::SimCluster {
    sim(1, |c| {
        c.max_running = 1;
        c.token_interval_ms = Some(20.0);
        c.time_scale = 1.0;
    })
}

/// A config file with three tenants: `metered` (two requests a minute), `capped` (priority at
/// most 0) and `vip` (no bound on its priority; callers without a key are held to 0).
fn tenants_file(dir: &std::path::Path) -> String {
    let path = dir.join("tenants.toml");
    std::fs::write(
        &path,
        r#"
[tenants.metered]
keys = ["k-metered"]
requests_per_minute = 2

[tenants.capped]
keys = ["k-capped"]
max_priority = 0

[tenants.vip]
keys = ["k-vip"]
"#,
    )
    .unwrap();
    path.to_string_lossy().into_owned()
}

fn admission_gateway(worker: &loadtest::sim::SimCluster, extra: &[&str]) -> Running {
    let dir = std::env::temp_dir().join(format!(
        "radixgate-admission-{}-{}",
        std::process::id(),
        worker.ports()[0]
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let config = tenants_file(&dir);
    let mut args = vec![
        "--config",
        &config,
        "--saturation-admission",
        "--saturation-queue-reqs",
        "1",
        "--saturation-poll-ms",
        "50",
    ];
    args.extend_from_slice(extra);
    gateway_for(&worker.urls(), &args)
}

fn gen(tokens: u32, priority: Option<i64>) -> Vec<u8> {
    let mut b = json!({"text": "tell me something", "sampling_params": {"max_new_tokens": tokens}});
    if let Some(p) = priority {
        b["priority"] = json!(p);
    }
    b.to_string().into_bytes()
}

fn post(addr: SocketAddr, headers: &[(&str, &str)], body: &[u8]) -> Response {
    request(addr, "POST", "/generate", headers, body).expect("an answer")
}

/// Answers as they came: (name, status, Retry-After, when).
type Answers = Arc<Mutex<Vec<(&'static str, u16, Option<String>, Instant)>>>;

/// Start `body` on its own thread; the answer and when it came, in `done`.
fn send_later(
    addr: SocketAddr,
    name: &'static str,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
    done: &Answers,
) -> std::thread::JoinHandle<()> {
    let done = done.clone();
    std::thread::spawn(move || {
        let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let r = post(addr, &h, &body);
        let retry = r.header("retry-after").map(str::to_owned);
        done.lock()
            .unwrap()
            .push((name, r.status, retry, Instant::now()));
    })
}

/// Wait until the worker has received `n` requests (the long ones: running, or queued in its
/// own queue), and until a reading of the worker taken since then (every 50 ms) is the one
/// admission decides on.
fn worker_holds(gw: &Running, c: &loadtest::sim::SimCluster, n: u64) {
    wait_until(
        &format!("the worker holds {n}"),
        Duration::from_secs(5),
        || (sim_count(c, 0, "inference_received") >= n).then_some(()),
    );
    wait_fresh_round(gw);
}

#[test]
fn under_saturation_the_higher_class_goes_first_claims_are_clamped_and_a_full_queue_sheds_the_lowest(
) {
    let c = one_slot_worker();
    let gw = admission_gateway(&c, &["--queue-size", "2"]);
    let done: Answers = Arc::new(Mutex::new(Vec::new()));
    let mut threads = Vec::new();
    // Two long requests fill the worker: one runs, one waits in the worker's own queue.
    threads.push(send_later(gw.addr, "long-1", vec![], gen(100, None), &done));
    worker_holds(&gw, &c, 1);
    threads.push(send_later(gw.addr, "long-2", vec![], gen(100, None), &done));
    worker_holds(&gw, &c, 2);
    // Now the fleet is saturated: these wait in the gateway. `low` class 0; `mid` class 5 from
    // the body's priority field.
    let vip = || ("authorization", "Bearer k-vip".to_string());
    threads.push(send_later(gw.addr, "low", vec![], gen(1, None), &done));
    std::thread::sleep(Duration::from_millis(100));
    threads.push(send_later(
        gw.addr,
        "mid",
        vec![vip()],
        gen(1, Some(5)),
        &done,
    ));
    std::thread::sleep(Duration::from_millis(100));
    assert!(done.lock().unwrap().is_empty(), "nobody answered yet");
    // The queue (2) is full of class 0 and 5: another class 0 is refused with Retry-After.
    let r = post(gw.addr, &[], &gen(1, None));
    assert_eq!(r.status, 429, "{}", r.text());
    let retry: u32 = r
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .unwrap();
    assert!(retry >= 1);
    assert_eq!(r.json()["error"]["code"], 429);
    // A tenant capped at 0 claiming 9 is a class-0 request: refused too, nobody shed.
    let r = post(
        gw.addr,
        &[
            ("authorization", "Bearer k-capped"),
            ("x-smg-priority", "9"),
        ],
        &gen(1, None),
    );
    assert_eq!(
        r.status,
        429,
        "clamped to 0, it cannot shed a class-0 waiter: {}",
        r.text()
    );
    // So is a caller without a key (the default tenant), whatever it claims.
    let r = post(
        gw.addr,
        &[("x-smg-priority", "2147483647")],
        &gen(1, Some(2147483647)),
    );
    assert_eq!(r.status, 429, "anonymous, it is class 0: {}", r.text());
    // An uncapped class 9 takes the place of the lowest waiter, which is shed with Retry-After.
    threads.push(send_later(
        gw.addr,
        "high",
        vec![("x-smg-priority", "9".to_string()), vip()],
        gen(1, None),
        &done,
    ));
    wait_until("low shed", Duration::from_secs(3), || {
        done.lock().unwrap().iter().find(|d| d.0 == "low").cloned()
    });
    // A header that is not an integer is refused, not demoted.
    let r = post(gw.addr, &[("x-smg-priority", "urgent")], &gen(1, None));
    assert_eq!(r.status, 400, "{}", r.text());
    for t in threads {
        t.join().unwrap();
    }
    let done = done.lock().unwrap();
    let get = |n: &str| done.iter().find(|d| d.0 == n).cloned().unwrap();
    let low = get("low");
    assert_eq!(low.1, 429);
    assert!(low.2.is_some(), "a shed request is told when to come back");
    for n in ["long-1", "long-2", "high", "mid"] {
        assert_eq!(get(n).1, 200, "{n}");
    }
    // Let in by class as the worker freed up: high (9) before mid (5).
    assert!(get("high").3 < get("mid").3, "{done:?}");
    assert!(get("long-2").3 < get("mid").3);
}

#[test]
fn a_request_waits_at_most_the_queue_timeout_and_a_client_that_leaves_frees_its_place() {
    let c = one_slot_worker();
    let gw = admission_gateway(&c, &["--queue-timeout-secs", "1"]);
    let done: Answers = Arc::new(Mutex::new(Vec::new()));
    let long1 = send_later(gw.addr, "long-1", vec![], gen(150, None), &done);
    worker_holds(&gw, &c, 1);
    let long2 = send_later(gw.addr, "long-2", vec![], gen(150, None), &done);
    worker_holds(&gw, &c, 2);
    let received = sim_count(&c, 0, "inference_received");
    // A client that sends its request and leaves while it waits.
    let mut gone = Conn::open(gw.addr);
    gone.send(&raw_request("POST", "/generate", &[], &gen(1, None)));
    std::thread::sleep(Duration::from_millis(200));
    drop(gone);
    // One that stays waits its second and gets 408.
    let t0 = Instant::now();
    let r = post(gw.addr, &[], &gen(1, None));
    assert_eq!(r.status, 408, "{}", r.text());
    assert!(
        t0.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t0.elapsed()
    );
    long1.join().unwrap();
    long2.join().unwrap();
    // The worker is free now; a fresh request goes straight through.
    let r = post(gw.addr, &[], &gen(1, None));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        sim_count(&c, 0, "inference_received"),
        received + 1,
        "neither the request whose client left nor the timed-out one reached the worker"
    );
}

#[test]
fn a_tenants_requests_per_minute_answer_429_with_the_time_until_there_is_room() {
    let c = sim(1, |_| {});
    let gw = admission_gateway(&c, &[]);
    let metered = [("authorization", "Bearer k-metered")];
    for _ in 0..2 {
        assert_eq!(post(gw.addr, &metered, &gen(1, None)).status, 200);
    }
    let r = post(gw.addr, &metered, &gen(1, None));
    assert_eq!(r.status, 429, "{}", r.text());
    let retry: u32 = r
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .unwrap();
    assert!((25..=31).contains(&retry), "{retry}");
    // Another tenant, and the default one, are not held to it.
    assert_eq!(post(gw.addr, &[], &gen(1, None)).status, 200);
    assert_eq!(
        post(gw.addr, &[("x-api-key", "k-capped")], &gen(1, None)).status,
        200
    );
}
