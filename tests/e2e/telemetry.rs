//! The telemetry thread end to end (`--worker-metrics-interval-secs 1` against simulated
//! SGLang workers): the achieved hit ratio equals the workers' own counters, the expositions
//! pass `promtool check metrics`, engine load from outside the gateway steers routing, and
//! workers added or removed at run time are followed.

use crate::common::*;
use serde_json::{json, Value};
use std::io::Write;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(20);

fn get_text(addr: SocketAddr, path: &str) -> String {
    let r = request(addr, "GET", path, &[], b"").unwrap();
    assert_eq!(r.status, 200, "GET {path}: {}", r.text());
    r.text()
}

/// The value of the first sample line of `text` that starts with `series` (name and labels
/// exactly as rendered, e.g. `x{worker="http://…"}`).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| v.trim().parse().unwrap())
}

/// A worker's own counters from its `/metrics`: (cached tokens, prompt tokens).
fn sim_counters(cluster: &loadtest::sim::SimCluster, i: usize) -> (f64, f64) {
    let text = get_text(worker_addr(cluster, i), "/metrics");
    let find = |pred: &dyn Fn(&str) -> bool| -> f64 {
        text.lines()
            .find(|l| pred(l))
            .and_then(|l| l.rsplit(' ').next())
            .unwrap_or_else(|| panic!("no such series in:\n{text}"))
            .parse()
            .unwrap()
    };
    let cached = find(&|l| {
        l.starts_with("sglang:cached_tokens_total{") && l.contains("cache_source=\"total\"")
    });
    let prompt = find(&|l| l.starts_with("sglang:prompt_tokens_total{"));
    (cached, prompt)
}

/// `promtool check metrics` on `text`: its exit code and output, or `None` when promtool is not
/// installed and nothing asks for it. `RADIXGATE_TEST_PROMTOOL` (scripts/test.sh sets it to the
/// promtool it made sure of) names the one to run, and then a missing one fails the test;
/// without it, `promtool` from PATH runs whenever it is installed, and its absence fails under
/// CI=true and is a printed skip otherwise (a developer's plain `cargo test`).
fn promtool(text: &str) -> Option<(i32, String)> {
    let required = std::env::var_os("RADIXGATE_TEST_PROMTOOL").filter(|p| !p.is_empty());
    let program = required.clone().unwrap_or_else(|| "promtool".into());
    let child = Command::new(&program)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            assert!(
                required.is_none(),
                "RADIXGATE_TEST_PROMTOOL={program:?} does not exist (scripts/test.sh sets it \
                 after apt-get install prometheus)"
            );
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "promtool is not installed (scripts/test.sh installs it: apt-get install prometheus)"
            );
            eprintln!(
                "SKIPPED: promtool checks (promtool not installed; scripts/test.sh installs it)"
            );
            return None;
        }
        Err(e) => panic!("cannot run {program:?}: {e}"),
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    Some((out.status.code().unwrap_or(-1), said))
}

#[test]
fn achieved_hit_ratio_matches_the_workers_and_the_expositions_pass_promtool() {
    // Alone in a process: it reads series without a worker label (the fleet's and the
    // predicted hit ratio, retries, circuit transitions) from the process-wide recorder, which
    // every in-process gateway of another test would write to as well.
    if !alone_in_a_process(
        module_path!(),
        "achieved_hit_ratio_matches_the_workers_and_the_expositions_pass_promtool",
    ) {
        return;
    }
    let cluster = sim(2, |_| {});
    let urls = cluster.urls();
    let gw = gateway_with_metrics(
        &urls,
        &[
            "--worker-metrics-interval-secs",
            "1",
            "--policy",
            "cache_aware",
        ],
    );
    let metrics = gw.metrics_addr.expect("metrics listener");
    // The baseline scrape: the workers have served nothing yet.
    wait_until("every worker scraped", WAIT, || {
        let r = gw.gateway().telemetry.report();
        (r.round >= 1 && r.workers.len() == 2 && r.workers.values().all(|w| w.gauges.up))
            .then_some(())
    });
    // Before any traffic, every series a dashboard or alert reads exists, at zero.
    let text = get_text(metrics, "/metrics");
    for series in [
        "smg_worker_retries_total".to_string(),
        "smg_worker_cb_transitions_total{to=\"open\"}".to_string(),
        "radixgate_fleet_cache_hit_ratio".to_string(),
        "radixgate_predicted_cache_hit_ratio".to_string(),
        format!("radixgate_worker_cache_hit_ratio{{worker=\"{}\"}}", urls[0]),
        format!(
            "radixgate_engine_running_requests{{worker=\"{}\"}}",
            urls[1]
        ),
    ] {
        assert_eq!(sample(&text, &series), Some(0.0), "{series} in:\n{text}");
    }
    for series in [
        format!("radixgate_engine_scrape_up{{worker=\"{}\"}}", urls[0]),
        format!("radixgate_engine_scrape_up{{worker=\"{}\"}}", urls[1]),
    ] {
        assert_eq!(sample(&text, &series), Some(1.0), "{series} in:\n{text}");
    }

    // Conversations that repeat long prefixes: the workers' caches hit.
    for conv in 0..4 {
        let system = format!("conversation {conv}: ") + &"a long shared system prompt ".repeat(40);
        let mut history = system.clone();
        for turn in 0..4 {
            history.push_str(&format!(" user turn {turn} asks something new"));
            let r = chat(gw.addr, &history, false, 4);
            assert_eq!(r.status, 200, "{}", r.text());
        }
    }
    wait_fresh_round(&gw);

    let text = get_text(metrics, "/metrics");
    let (mut cached_all, mut prompt_all) = (0.0, 0.0);
    for (i, url) in urls.iter().enumerate() {
        let (cached, prompt) = sim_counters(&cluster, i);
        cached_all += cached;
        prompt_all += prompt;
        let want = if prompt > 0.0 { cached / prompt } else { 0.0 };
        let series = format!("radixgate_worker_cache_hit_ratio{{worker=\"{url}\"}}");
        let got = sample(&text, &series).unwrap_or_else(|| panic!("no {series}:\n{text}"));
        assert!(
            (got - want).abs() < 1e-9,
            "{url}: gateway says {got}, the worker's counters {cached}/{prompt} = {want}"
        );
    }
    let fleet = sample(&text, "radixgate_fleet_cache_hit_ratio").unwrap();
    assert!(prompt_all > 0.0);
    assert!(
        (fleet - cached_all / prompt_all).abs() < 1e-9,
        "fleet {fleet} vs {cached_all}/{prompt_all}"
    );
    assert!(fleet > 0.3, "repeated prefixes must hit: {fleet}");
    let predicted = sample(&text, "radixgate_predicted_cache_hit_ratio").unwrap();
    assert!(
        predicted > 0.3,
        "the tree predicted hits for the repeated prefixes: {predicted}"
    );

    // GET /engine_metrics: every worker's samples, labelled, one HELP per family.
    let engine = get_text(gw.addr, "/engine_metrics");
    for url in &urls {
        let labelled = format!("sglang:prompt_tokens_total{{worker=\"{url}\",");
        assert!(engine.contains(&labelled), "{labelled} missing:\n{engine}");
    }
    assert_eq!(
        engine
            .matches("# HELP sglang:time_to_first_token_seconds ")
            .count(),
        1
    );
    assert!(engine
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .all(|l| l.contains("{worker=\"")));

    // promtool: the gateway's own exposition is clean; the engines' merge is well formed, and
    // its only complaint may be SGLang's own names (`sglang:…`: promtool's lint dislikes ':'
    // in names, and they must keep the engine's names for existing dashboards).
    if let Some((code, said)) = promtool(&text) {
        assert_eq!(code, 0, "promtool check metrics on /metrics:\n{said}");
        assert!(said.trim().is_empty(), "promtool on /metrics said:\n{said}");
        let (code, said) = promtool(&engine).unwrap();
        assert!(code == 0 || code == 3, "promtool failed ({code}):\n{said}");
        for line in said.lines().filter(|l| !l.trim().is_empty()) {
            assert!(
                line.starts_with("sglang:")
                    && line.ends_with("metric names should not contain ':'"),
                "promtool on /engine_metrics: {line}"
            );
        }
    }

    // A worker removed at run time leaves the report, /engine_metrics and /metrics.
    remove_worker(gw.addr, &urls[1]);
    wait_fresh_round(&gw);
    let engine = get_text(gw.addr, "/engine_metrics");
    assert!(!engine.contains(&urls[1]), "removed worker still merged");
    assert!(engine.contains(&urls[0]));
    let text = get_text(metrics, "/metrics");
    assert!(!text.contains(&format!("worker=\"{}\"", urls[1])), "{text}");
    // ... and one added at run time is scraped.
    let r = request(
        gw.addr,
        "POST",
        "/workers",
        &[],
        json!({"url": urls[1]}).to_string().as_bytes(),
    )
    .unwrap();
    assert!(r.status == 200 || r.status == 202, "{}", r.text());
    wait_fresh_round(&gw);
    assert!(get_text(gw.addr, "/engine_metrics").contains(&urls[1]));
}

/// The held worker's `external_load` as `GET /workers` reports it.
fn external_load(gw: SocketAddr, url: &str) -> u64 {
    let w = workers_json(gw);
    w["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["url"] == url)
        .unwrap_or_else(|| panic!("{url} not in {w}"))["external_load"]
        .as_u64()
        .unwrap()
}

#[test]
fn engine_load_from_another_client_steers_routing_away() {
    let cluster = sim(2, |_| {});
    let urls = cluster.urls();
    let gw = gateway_for(
        &urls,
        &[
            "--worker-metrics-interval-secs",
            "1",
            "--policy",
            "power_of_two",
        ],
    );
    // Another client (another gateway copy, say) keeps worker 0 busy, straight to the worker.
    set_faults(&cluster, 0, json!({"hold": true}));
    let direct = worker_addr(&cluster, 0);
    let held: Vec<Conn> = (0..5)
        .map(|i| {
            let mut c = Conn::open(direct);
            c.send(&raw_request("POST", "/generate", &[], &gen_body(i)));
            c
        })
        .collect();
    wait_until("five held requests on worker 0", WAIT, || {
        (sim_count(&cluster, 0, "inference_in_progress") == 5).then_some(())
    });
    // One scrape later the gateway counts them in worker 0's load, though it sent none.
    wait_until("the engine's load on the board", WAIT, || {
        (external_load(gw.addr, &urls[0]) == 5).then_some(())
    });
    let loads = request(gw.addr, "GET", "/get_loads", &[], b"")
        .unwrap()
        .json();
    let w0 = loads["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["worker"] == urls[0].as_str())
        .cloned()
        .unwrap_or(Value::Null);
    assert_eq!(w0["routing_load"], 5, "{loads}");
    assert_eq!(w0["gateway_in_flight"], 0, "{loads}");
    // power_of_two now always prefers the idle worker.
    let port1 = cluster.ports()[1];
    for i in 0..12 {
        let r = generate(gw.addr, &gen_body(100 + i));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(served_by(&r), port1, "request {i} went to the busy worker");
    }
    // The engine drains: the external load goes back to 0 at the next scrape.
    set_faults(&cluster, 0, json!({"hold": false}));
    for mut c in held {
        assert_eq!(c.read_response().unwrap().status, 200);
    }
    wait_until("the drained load", WAIT, || {
        (external_load(gw.addr, &urls[0]) == 0).then_some(())
    });
}

#[test]
fn engine_metrics_needs_the_admin_key_and_the_thread() {
    let cluster = sim(1, |_| {});
    let urls = cluster.urls();
    let gw = gateway_for(
        &urls,
        &[
            "--worker-metrics-interval-secs",
            "1",
            "--admin-api-key",
            "adm",
        ],
    );
    let r = request(gw.addr, "GET", "/engine_metrics", &[], b"").unwrap();
    assert_eq!(r.status, 401, "{}", r.text());
    wait_until("a round", WAIT, || {
        (telemetry_round(&gw) >= 1).then_some(())
    });
    let auth = [("authorization", "Bearer adm")];
    let r = request(gw.addr, "GET", "/engine_metrics", &auth, b"").unwrap();
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/plain"));
    assert!(r.text().contains("sglang:num_running_reqs{worker="));
    // Off: no thread, no engine series, and the endpoint says why.
    let off = gateway_for(&urls, &["--worker-metrics-interval-secs", "0"]);
    let r = request(off.addr, "GET", "/engine_metrics", &[], b"").unwrap();
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.text().contains("--worker-metrics-interval-secs"));
    assert_eq!(telemetry_round(&off), 0);
}

#[test]
fn a_worker_that_never_answers_delays_no_round_for_long() {
    let cluster = sim(1, |_| {});
    // Accepts connections (the kernel's backlog) and never answers a byte.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_url = format!("http://{}", silent.local_addr().unwrap());
    let urls = vec![cluster.urls()[0].clone(), silent_url.clone()];
    let gw = gateway_for(
        &urls,
        &[
            "--worker-metrics-interval-secs",
            "1",
            "--disable-health-check",
        ],
    );
    let started = std::time::Instant::now();
    wait_until("four rounds", WAIT, || {
        (telemetry_round(&gw) >= 4).then_some(())
    });
    // Each round waits for the silent worker at most its timeout (here the 1 s interval).
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "four rounds took {:?}",
        started.elapsed()
    );
    let report = gw.gateway().telemetry.report();
    let list = gw.gateway().registry.load();
    let up = |url: &str| report.workers[&list.by_url(url).unwrap().serial].gauges.up;
    assert!(up(&urls[0]), "the answering worker is read every round");
    assert!(!up(&silent_url));
    drop(silent);
}

#[test]
fn helper_threads_yield_the_cpu_to_serving_cores() {
    // Alone in a process: it reads every thread of the process by name, and other tests'
    // gateways name theirs alike with other settings (with --saturation-admission the
    // telemetry thread is not SCHED_IDLE).
    if !alone_in_a_process(
        module_path!(),
        "helper_threads_yield_the_cpu_to_serving_cores",
    ) {
        return;
    }
    let c = sim(1, |_| {});
    let gw = gateway_for(&c.urls(), &[]);
    let base = radixgate::base::priority::thread_priority();
    let want = (base + radixgate::gateway::HELPER_NICE).min(19);
    let nices = wait_until(
        "health and telemetry threads running",
        Duration::from_secs(10),
        || {
            let n = thread_nices();
            let has = |p: &str| n.iter().any(|(name, _, _)| name.starts_with(p));
            let all = [
                "radixgate-healt",
                "radixgate-telem",
                "radixgate-core",
                "radixgate-tree-",
            ];
            all.iter().all(|p| has(p)).then_some(n)
        },
    );
    const SCHED_IDLE: u32 = 5;
    for (name, nice, policy) in &nices {
        if name.starts_with("radixgate-healt") || name.starts_with("radixgate-tree-") {
            assert_eq!(
                (*nice, *policy),
                (want, 0),
                "{name}: nice 10, never starved"
            );
        }
        if name.starts_with("radixgate-telem") {
            assert_eq!(
                *policy, SCHED_IDLE,
                "{name}: only the CPU nobody else wants"
            );
        }
        if name.starts_with("radixgate-core") {
            assert_eq!((*nice, *policy), (base, 0), "{name}");
        }
    }
    drop(gw);
}
