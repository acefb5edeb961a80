//! The two tools against each other over loopback: every event arrives, stamped, and the
//! client's counts agree with the upstream's.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::client::{self, StreamsConfig};
use super::upstream::{Upstream, UpstreamConfig};

fn config(port: u16) -> StreamsConfig {
    StreamsConfig {
        addr: SocketAddrV4::new(Ipv4Addr::LOCALHOST, port),
        host: format!("127.0.0.1:{port}"),
        path: "/v1/chat/completions".into(),
        streams: 40,
        duration_s: 1.0,
        warmup_s: 0.2,
        ramp_per_ms: 8,
        stall_s: 5.0,
        prompt_bytes: 600,
        max_tokens: 8,
        model: "sim-model".into(),
        health_path: Some("/health".into()),
        health_every_ms: 10.0,
        idle_hold_s: None,
        idle_path: "/health".into(),
        ready_file: None,
        watch_pids: vec![std::process::id()],
        progress: false,
    }
}

#[test]
fn paced_streams_arrive_stamped_and_complete() {
    let up = Upstream::bind(UpstreamConfig {
        interval_ns: 5_000_000,
        ..UpstreamConfig::default()
    })
    .expect("bind");
    let port = up.port();
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    let server = std::thread::spawn(move || up.run(&s2));

    let r = client::run(config(port)).expect("run");
    // An idle run on the same upstream: connections answered once, then held.
    let idle = client::run(StreamsConfig {
        idle_hold_s: Some(0.3),
        health_path: None,
        ..config(port)
    })
    .expect("idle run");
    stop.store(true, Ordering::Relaxed);
    let counters = server.join().expect("server thread").expect("server");

    assert_eq!(r.errors.total(), 0, "{r:?}");
    // 40 streams × one event per 5 ms for ~1 s: about 8,000 events.
    assert!(r.events > 4_000, "{r:?}");
    assert_eq!(r.delay_us.count, r.events);
    assert!(r.streams_completed > 200, "{r:?}");
    assert!(r.ttft_us.count > 200 && r.ttft_us.p50 < 50_000.0, "{r:?}");
    assert!(r.delay_us.p50 < 50_000.0, "{r:?}");
    let h = r.health.as_ref().expect("probe");
    assert!(h.count > 20 && h.errors == 0, "{h:?}");
    assert!(counters.events >= r.events && counters.deferred < counters.events / 10);
    assert_eq!(idle.mode, "idle");
    assert_eq!((idle.open_at_end, idle.errors.total()), (40, 0), "{idle:?}");
}

#[test]
fn too_many_streams_for_the_descriptor_limit_is_an_error() {
    let r = client::run(StreamsConfig {
        streams: 1 << 30,
        ..config(1)
    });
    assert!(r.is_err());
}
