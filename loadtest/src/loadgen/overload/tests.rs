//! Overload runs end to end over real sockets: against simulated workers (both tenants answered,
//! goodput and server samples measured), and against a stub that refuses one tenant and
//! ignores the other (refusals and timeouts counted per tenant).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::sim::{spawn_cluster, SimConfig, TokenizerMode};

fn short(target: &str) -> OverloadConfig {
    let mut c = OverloadConfig {
        target: target.into(),
        duration_s: 2.0,
        warmup_s: 0.2,
        drain_s: 3.0,
        sample_interval_s: 0.1,
        ..OverloadConfig::default()
    };
    c.interactive.session_rate = 4.0;
    c.interactive.think_s = (0.05, 0.1);
    c.interactive.answer_tokens = (4, 8);
    c.batch.rate = 4.0;
    c.batch.prompt_tokens = (400, 800);
    c.batch.output_tokens = (4, 8);
    c
}

#[test]
fn both_tenants_are_answered_and_measured_against_simulated_workers() {
    let sim = spawn_cluster(SimConfig {
        ports: vec![0, 0],
        tokenizer: TokenizerMode::Approx,
        time_scale: 10.0,
        ..SimConfig::default()
    })
    .expect("simulated workers");
    let mut c = short(&sim.urls()[0]);
    c.workers = sim.urls();
    c.sim_time_scale = 10.0;
    let started = Instant::now();
    let r = run(&c).expect("overload run");
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );
    for (name, t) in [("interactive", &r.interactive), ("batch", &r.batch)] {
        assert!(t.ok > 0 && t.ok == t.sent, "{name}: {t:?}");
        assert_eq!((t.refused, t.timed_out, t.unfinished), (0, 0, 0), "{name}");
        assert!(t.errors.is_empty(), "{name}: {:?}", t.error_examples);
        // Latencies of the requests sent after the warm-up only.
        assert!(
            t.ttft.count > 0 && t.ttft.count <= t.ok,
            "{name}: {:?}",
            t.ttft
        );
        assert_eq!(
            t.output_tokens_by_second.iter().sum::<u64>(),
            t.output_tokens
        );
        assert!(t.window_ok > 0 && t.output_tok_per_s > 0.0 && t.prompt_tok_per_s > 0.0);
    }
    assert!(r.interactive.sessions > 0);
    // Later turns carry the history: more requests than sessions.
    assert!(r.interactive.sent > r.interactive.sessions);
    // Batch prompts are long: hundreds of tokens each (plus the chat template).
    assert!(r.batch.prompt_tokens >= 400 * r.batch.ok);
    let sv = &r.servers;
    assert!(sv.rounds >= 5, "{sv:?}");
    assert_eq!(sv.per_worker.len(), 2);
    let idle = sv.idle_share.expect("the simulator's idle counter");
    // A lightly loaded fleet: mostly idle, never more than all of the time.
    assert!((0.3..=1.0).contains(&idle), "{idle}");
    assert!(sv.kv_usage_mean.is_some());
    let md = r.to_markdown();
    assert!(md.contains("| interactive |") && md.contains("| batch |") && md.contains("GPU idle"));
    let back: OverloadReport = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
    assert_eq!(back.batch.ok, r.batch.ok);
}

#[test]
fn closed_loop_keeps_n_batch_requests_outstanding() {
    let sim = spawn_cluster(SimConfig {
        tokenizer: TokenizerMode::Approx,
        time_scale: 20.0,
        ..SimConfig::default()
    })
    .expect("simulated worker");
    let mut c = short(&sim.urls()[0]);
    c.interactive.session_rate = 0.0;
    c.batch.concurrency = 3;
    c.batch.ramp_s = 0.1;
    c.workers = sim.urls();
    c.sim_time_scale = 20.0;
    let r = run(&c).expect("overload run");
    assert_eq!(r.interactive.sent, 0);
    assert!(r.batch.ok > 3, "{:?}", r.batch);
    // Three users back to back: never more than three requests at the worker, and some there
    // on average (how many depends on how promptly this machine runs the client).
    let running = r
        .servers
        .running_mean
        .unwrap_or_else(|| panic!("{:?}", r.servers));
    assert!(running > 0.0 && running <= 3.0, "{running}");
}

/// A stub gateway: answers 429 to the batch tenant's requests and never answers anyone else's,
/// until `stop`.
fn stub(stop: Arc<AtomicBool>) -> (u16, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.set_nonblocking(true).unwrap();
    let port = l.local_addr().unwrap().port();
    let h = std::thread::spawn(move || {
        let mut conns = Vec::new();
        while !stop.load(Ordering::Acquire) {
            match l.accept() {
                Ok((s, _)) => {
                    let stop = stop.clone();
                    conns.push(std::thread::spawn(move || serve(s, &stop)));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
        for c in conns {
            let _ = c.join();
        }
    });
    (port, h)
}

fn serve(mut s: TcpStream, stop: &AtomicBool) {
    s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let mut buf = Vec::new();
    let mut tmp = [0u8; 64 << 10];
    while !stop.load(Ordering::Acquire) {
        match s.read(&mut tmp) {
            Ok(0) => return,
            Ok(n) => buf.extend_from_slice(&tmp[..n]),
            Err(_) => continue,
        }
        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        if buf.len() < end + 4 + len {
            continue;
        }
        if head.contains("bearer batch-key") {
            let body = r#"{"error":{"message":"shed"}}"#;
            let _ = write!(
                s,
                "HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            buf.drain(..end + 4 + len);
        } else {
            // Hold the request unanswered until the client gives up or the stub stops.
            buf.clear();
        }
    }
}

#[test]
fn refusals_and_timeouts_are_counted_per_tenant() {
    let stop = Arc::new(AtomicBool::new(false));
    let (port, h) = stub(stop.clone());
    let mut c = short(&format!("http://127.0.0.1:{port}"));
    c.duration_s = 1.0;
    c.warmup_s = 0.0;
    c.drain_s = 1.0;
    c.interactive.tenant.request_timeout_s = 0.3;
    c.interactive.session_rate = 5.0;
    c.batch.rate = 10.0;
    let r = run(&c).expect("overload run");
    stop.store(true, Ordering::Release);
    h.join().unwrap();
    assert!(r.batch.sent > 0);
    assert_eq!(r.batch.refused, r.batch.sent, "{:?}", r.batch);
    assert_eq!(r.batch.ok, 0);
    assert!(r.interactive.sent > 0);
    // Each session's first turn timed out (those sent near the end may be cut by the run's
    // end instead); no later turn was sent.
    assert_eq!(
        r.interactive.timed_out + r.interactive.unfinished,
        r.interactive.sent,
        "{:?}",
        r.interactive
    );
    assert!(r.interactive.timed_out > 0);
    assert_eq!(r.interactive.sent, r.interactive.sessions);
    // What the unanswered waited is their TTFT (at least the timeout, or what was left).
    assert_eq!(r.interactive.ttft.count, r.interactive.sent);
    assert_eq!(r.interactive.ttft_waited, r.interactive.sent);
    assert!(
        r.interactive.ttft.max_ms >= 290.0,
        "{:?}",
        r.interactive.ttft
    );
}

#[test]
fn refuses_bad_configurations_and_remote_targets() {
    let mut c = short("http://127.0.0.1:9");
    c.warmup_s = 5.0;
    assert!(run(&c).is_err(), "warm-up past the send window");
    let mut c = short("http://10.0.0.1:9");
    assert!(run(&c).is_err(), "not loopback");
    c = short("http://127.0.0.1:9");
    c.workers = vec!["http://192.168.1.1:9".into()];
    assert!(run(&c).is_err(), "sampled worker not loopback");
    c = short("http://127.0.0.1:9");
    c.batch.tenant.api_key = "two words".into();
    assert!(run(&c).is_err(), "key with a space");
}

#[test]
fn an_answer_cut_off_after_its_first_token_counts_that_tokens_time() {
    // Tokens 250 ms apart: every interactive answer (4-8 tokens, streamed, the first after one
    // interval) outlasts its 0.7 s timeout, but its first token comes well before it.
    let sim = spawn_cluster(SimConfig {
        tokenizer: TokenizerMode::Approx,
        token_interval_ms: Some(250.0),
        ..SimConfig::default()
    })
    .expect("simulated worker");
    let mut c = short(&sim.urls()[0]);
    c.duration_s = 1.0;
    c.warmup_s = 0.0;
    c.drain_s = 1.0;
    c.interactive.tenant.request_timeout_s = 0.7;
    c.batch.rate = 0.5;
    let r = run(&c).expect("overload run");
    let t = &r.interactive;
    assert!(t.sent > 0 && t.ok == 0, "{t:?}");
    assert_eq!(t.timed_out + t.unfinished, t.sent, "{t:?}");
    // Their TTFT is the first token's, not the 0.7 s they were given.
    assert_eq!(t.ttft_waited, 0, "{t:?}");
    assert_eq!(t.ttft.count, t.sent);
    assert!(t.ttft.max_ms < 650.0, "{:?}", t.ttft);
}
