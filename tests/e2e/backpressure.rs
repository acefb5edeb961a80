//! Engine backpressure end to end: simulated SGLang workers started with a small
//! `--max-queued-requests` answer 503 "The request queue is full." past it, as SGLang does. A
//! flood through the gateway must find the room the fleet has: the 503s are retried on other
//! workers, no circuit opens on them, and the gateway never answers its own "no available
//! workers" while the engines have room.

use crate::common::hostile::sample;
use crate::common::*;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Concurrent clients of the flood, and requests each sends one after another.
const CLIENTS: usize = 24;
const PER_CLIENT: usize = 12;

/// Four workers with room for 2 running and 2 queued requests each (16 in all, for the flood's
/// 24 clients); each answer takes 16 forwards of 100 virtual ms (about 35 ms real at 50x).
fn small_queue_fleet() -> loadtest::sim::SimCluster {
    sim(4, |c| {
        c.max_running = 2;
        c.max_queued_requests = Some(2);
        c.token_interval_ms = Some(100.0);
    })
}

/// What the clients of a flood got: per answer its completion time, status and body.
type Answers = Vec<(Instant, u16, String)>;

/// `CLIENTS` threads, each sending `PER_CLIENT` `/generate` calls in a row.
fn flood(addr: std::net::SocketAddr) -> Answers {
    let answers = Arc::new(Mutex::new(Vec::new()));
    let threads: Vec<_> = (0..CLIENTS)
        .map(|t| {
            let answers = answers.clone();
            std::thread::spawn(move || {
                for i in 0..PER_CLIENT {
                    let body = format!(
                        r#"{{"text":"client {t} asks question {i} of the flood","sampling_params":{{"max_new_tokens":16}}}}"#
                    );
                    let (status, text) = match request(addr, "POST", "/generate", &[], body.as_bytes())
                    {
                        Ok(r) => (r.status, r.text()),
                        Err(e) => (0, e.to_string()),
                    };
                    answers.lock().unwrap().push((Instant::now(), status, text));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let mut out = std::mem::take(&mut *answers.lock().unwrap());
    out.sort_by_key(|a| a.0);
    out
}

/// The circuit of every worker, as `GET /workers` shows it.
fn circuits(addr: std::net::SocketAddr) -> Vec<String> {
    let w = request(addr, "GET", "/workers", &[], b"").unwrap().json();
    w["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["circuit"].as_str().unwrap().to_string())
        .collect()
}

/// Floods a gateway with `flags` in front of a small-queue fleet and checks what the clients,
/// the workers and the gateway saw.
fn flood_finds_the_room_the_fleet_has(flags: &[&str]) {
    let fleet = small_queue_fleet();
    let urls = fleet.urls();
    // Three breaker failures in a row open a circuit: without backpressure handling, a few
    // queue-full answers would take each worker out for the whole test.
    let mut args = vec![
        "--cb-failure-threshold",
        "3",
        "--cb-timeout-duration-secs",
        "120",
    ];
    args.extend_from_slice(flags);
    let gw = gateway_with_metrics(&urls, &args);
    let answers = flood(gw.addr);
    let refused: u64 = (0..4).map(|i| sim_count(&fleet, i, "queue_full")).sum();
    let ok = answers.iter().filter(|a| a.1 == 200).count();
    let client_503s: Vec<&(Instant, u16, String)> = answers.iter().filter(|a| a.1 != 200).collect();
    eprintln!(
        "{flags:?}: {ok} of {} answered 200, {} not; the engines refused {refused}",
        answers.len(),
        client_503s.len()
    );
    assert!(
        refused > 0,
        "the flood never went past --max-queued-requests: the test proves nothing"
    );
    // No circuit opened on backpressure.
    assert!(
        circuits(gw.addr).iter().all(|c| c == "closed"),
        "{:?}",
        circuits(gw.addr)
    );
    // A client got a 503 only as an engine's own answer, never the gateway's "no available
    // workers" (every engine had room again a few ms later).
    for (_, status, body) in &client_503s {
        assert!(
            !body.contains("no available workers"),
            "the gateway answered its own {status}: {body}"
        );
        assert_eq!(*status, 503, "{body}");
        assert!(body.contains("The request queue is full."), "{body}");
    }
    // The refusals were retried elsewhere: far more of them than answers the clients got.
    assert!(
        (client_503s.len() as u64) < refused,
        "{} 503s relayed of {refused} refusals: nothing was retried",
        client_503s.len()
    );
    // Goodput went on: most requests were served, to the end of the flood.
    assert!(
        ok * 10 >= answers.len() * 9,
        "{ok} of {} served",
        answers.len()
    );
    let last: Vec<u16> = answers.iter().rev().take(CLIENTS).map(|a| a.1).collect();
    assert!(
        last.contains(&200),
        "the flood's end was not served: {last:?}"
    );
    // After the flood every worker serves at once (no circuit held any of them out).
    for i in 0..8 {
        let body =
            format!(r#"{{"text":"after the flood {i}","sampling_params":{{"max_new_tokens":1}}}}"#);
        let r = request(gw.addr, "POST", "/generate", &[], body.as_bytes()).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // Every refusal the gateway saw is counted against its worker, and only there.
    let metrics = gw.metrics_addr.expect("metrics listener");
    let text = request(metrics, "GET", "/metrics", &[], b"")
        .unwrap()
        .text();
    let counted: f64 = urls
        .iter()
        .map(|u| {
            sample(
                &text,
                &format!("radixgate_worker_backpressure_total{{worker=\"{u}\"}}"),
            )
            .unwrap_or(0.0)
        })
        .sum();
    assert_eq!(counted as u64, refused, "backpressure counted per worker");
}

#[test]
fn queue_full_answers_are_retried_elsewhere_and_open_no_circuit() {
    // Busy: 24 clients, four workers and the gateway for a few seconds.
    let _busy = busy();
    flood_finds_the_room_the_fleet_has(&[]);
}

#[test]
fn queue_full_answers_saturate_the_worker_for_admission() {
    // Busy: as above, with the workers read every 50 ms.
    let _busy = busy();
    flood_finds_the_room_the_fleet_has(&["--saturation-admission", "--saturation-poll-ms", "50"]);
}

#[test]
fn a_worker_s_retry_after_is_waited_for_only_where_it_fits() {
    // One worker: a retry has nowhere else to go, so its Retry-After decides the wait.
    let f = Foreign::start(&[]);
    let gw = gateway_for(
        &[f.url()],
        &[
            "--retry-initial-backoff-ms",
            "1",
            "--retry-max-backoff-ms",
            "3000",
            "--cb-failure-threshold",
            "2",
        ],
    );
    // A wait that fits the policy: the retry comes after it, and is answered.
    f.knobs(serde_json::json!({"fail_next": 1, "fail_status": 503, "fail_retry_after": "1"}));
    let t = Instant::now();
    let r = generate(gw.addr, br#"{"text":"after a second"}"#);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        t.elapsed() >= std::time::Duration::from_millis(950),
        "retried after {:?}, before the second the worker asked for",
        t.elapsed()
    );
    assert_eq!(f.count("received"), 2);
    // A wait past --retry-max-backoff-ms: the client hears it at once, Retry-After included,
    // instead of the gateway hammering the worker or sleeping on it.
    f.knobs(serde_json::json!({"fail_next": 1, "fail_status": 429, "fail_retry_after": "60"}));
    let t = Instant::now();
    let r = generate(gw.addr, br#"{"text":"not now"}"#);
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("60"));
    assert!(
        t.elapsed() < std::time::Duration::from_secs(2),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(f.count("received"), 3, "no retry within the minute asked");
    // Without Retry-After, backpressure is retried at the policy's pace, and neither kind
    // opened the circuit (two failures in a row would have).
    f.knobs(serde_json::json!({"fail_next": 3, "fail_status": 503, "fail_retry_after": null}));
    let r = generate(gw.addr, br#"{"text":"third time"}"#);
    assert_eq!(r.status, 200, "{}", r.text());
    let w = request(gw.addr, "GET", "/workers", &[], b"")
        .unwrap()
        .json();
    assert_eq!(w["workers"][0]["circuit"], "closed", "{w}");
}
