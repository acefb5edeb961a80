//! OpenTelemetry tracing end to end (`--enable-trace`): the gateway exports over OTLP/gRPC to
//! `tests/fixtures/otlp_receiver.py`, which decodes the spans with the official
//! `opentelemetry-proto` package, and the simulated worker records the `traceparent` it got.
//! Checked: span names, kinds, parent/child links and attributes; the worker's `traceparent`
//! names the attempt span of the same trace; a client's context is continued (and replaced
//! upstream, never duplicated); an unsampled client context and ratio 0 export nothing; only a
//! trusted client's sampled flag beats the ratio; a full buffer (in spans or in bytes) drops
//! spans and counts them while the request is still served; a batch larger than the
//! collector's message limit is split and arrives whole.

use crate::common::*;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

/// Longest wait for spans to arrive (the export thread sends every 200 ms).
const WAIT: Duration = Duration::from_secs(20);
/// Longest wait for the receiver to start (Python and grpcio).
const START_LIMIT: Duration = Duration::from_secs(30);

/// The OTLP receiver, killed when dropped; its spans as JSON lines.
pub(crate) struct Receiver {
    _child: ChildGuard,
    port: u16,
    spans: Arc<Mutex<Vec<Value>>>,
    /// It said it holds the first export (`--hold-first-export-until`).
    holding: Arc<AtomicBool>,
}

impl Receiver {
    pub(crate) fn start() -> Receiver {
        Receiver::start_with(&[])
    }

    /// The receiver with more options of the fixture (`--max-receive-bytes N`,
    /// `--hold-first-export-until PATH`).
    fn start_with(options: &[&str]) -> Receiver {
        let python = test_python(&[
            "grpc",
            "opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc",
        ]);
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/otlp_receiver.py"
        );
        let mut child = Command::new(&python)
            .arg(script)
            .arg("--exit-on-stdin-eof")
            .args(options)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("{python} {script}: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let guard = ChildGuard(Some(child));
        let spans = Arc::new(Mutex::new(Vec::new()));
        let holding = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let (sink, held) = (spans.clone(), holding.clone());
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let first = lines.next().and_then(Result::ok).unwrap_or_default();
            let _ = tx.send(first);
            for line in lines.map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    if v["holding"] == true {
                        held.store(true, Ordering::SeqCst);
                    } else {
                        sink.lock().unwrap().push(v);
                    }
                }
            }
        });
        let line = rx
            .recv_timeout(START_LIMIT)
            .unwrap_or_else(|_| panic!("{script} printed no port within {START_LIMIT:?}"));
        let v: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("{script} did not start ({e}): {line:?}"));
        let port = v["port"].as_u64().expect("a port") as u16;
        Receiver {
            _child: guard,
            port,
            spans,
            holding,
        }
    }

    pub(crate) fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The spans of trace `trace_id` once its server span has arrived (it is sent last).
    fn trace(&self, trace_id: &str) -> Vec<Value> {
        wait_until(
            &format!("the server span of trace {trace_id}"),
            WAIT,
            || {
                let all = self.spans.lock().unwrap();
                let of: Vec<Value> = all
                    .iter()
                    .filter(|s| s["trace_id"] == trace_id)
                    .cloned()
                    .collect();
                of.iter()
                    .any(|s| s["name"] == "radixgate.request")
                    .then_some(of)
            },
        )
    }

    /// Every span received so far.
    pub(crate) fn all(&self) -> Vec<Value> {
        self.spans.lock().unwrap().clone()
    }

    /// How many spans have arrived so far.
    pub(crate) fn count(&self) -> usize {
        self.spans.lock().unwrap().len()
    }
}

/// Find the one span named `name` among `spans`.
fn one<'a>(spans: &'a [Value], name: &str) -> &'a Value {
    let found: Vec<&Value> = spans.iter().filter(|s| s["name"] == name).collect();
    assert_eq!(found.len(), 1, "one {name} span in {spans:#?}");
    found[0]
}

/// The `traceparent` values (and `tracestate`) on the last inference request worker 0 got.
fn worker_trace_headers(cluster: &loadtest::sim::SimCluster) -> (Vec<String>, Vec<String>) {
    let all: Value = serde_json::from_str(&sim_recorded(cluster, 0)).expect("JSON");
    let last = all
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|r| r["path"] == "/v1/chat/completions")
        .unwrap_or_else(|| panic!("no chat request recorded: {all}"))
        .clone();
    let values = |name: &str| -> Vec<String> {
        last["headers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|h| h[0].as_str().unwrap().eq_ignore_ascii_case(name))
            .map(|h| h[1].as_str().unwrap().to_string())
            .collect()
    };
    (values("traceparent"), values("tracestate"))
}

fn chat_with(gw: std::net::SocketAddr, headers: &[(&str, &str)], stream: bool) -> Response {
    let body = chat_body(&[("user", "tell me about tracing")], stream, 4);
    let r = request(gw, "POST", "/v1/chat/completions", headers, &body).expect("a response");
    assert_eq!(r.status, 200, "{}", r.text());
    r
}

#[test]
fn a_requests_spans_link_up_and_the_worker_joins_under_the_attempt_span() {
    let rx = Receiver::start();
    let workers = sim(1, |c| c.record_requests = 16);
    let ep = rx.endpoint();
    let gw = gateway_for(
        &workers.urls(),
        &["--enable-trace", "--otlp-traces-endpoint", &ep],
    );
    chat_with(gw.addr, &[], true);
    let (parents, _) = worker_trace_headers(&workers);
    assert_eq!(parents.len(), 1, "one traceparent upstream: {parents:?}");
    let tp: Vec<&str> = parents[0].split('-').collect();
    assert_eq!((tp.len(), tp[0], tp[3]), (4, "00", "01"), "{parents:?}");
    let spans = rx.trace(tp[1]);

    let root = one(&spans, "radixgate.request");
    assert_eq!(root["kind"], "SPAN_KIND_SERVER");
    assert_eq!(
        root["parent_span_id"], "",
        "a new trace: the server span is its root"
    );
    assert_eq!(root["service"], "radixgate");
    assert_eq!(root["scope"], "radixgate");
    let attrs = &root["attributes"];
    assert_eq!(attrs["http.response.status_code"], 200);
    assert_eq!(attrs["http.request.method"], "POST");
    assert_eq!(attrs["url.path"], "/v1/chat/completions");
    assert_eq!(attrs["radixgate.stream"], true);
    assert!(attrs["radixgate.request_id"]
        .as_str()
        .unwrap()
        .starts_with("chatcmpl-"));
    let events = root["events"].as_array().unwrap();
    assert!(events.contains(&"first_byte".into()), "{root}");
    assert!(events.contains(&"end_of_stream".into()), "{root}");

    let root_id = root["span_id"].as_str().unwrap();
    for name in ["admit", "route", "attempt"] {
        let s = one(&spans, name);
        assert_eq!(
            s["parent_span_id"], root_id,
            "{name} is a child of the request"
        );
        assert!(s["start"].as_u64() >= root["start"].as_u64(), "{s}");
        assert!(s["end"].as_u64() <= root["end"].as_u64(), "{s}");
        assert!(s["start"].as_u64() <= s["end"].as_u64(), "{s}");
    }
    let route = one(&spans, "route");
    let url = &workers.urls()[0];
    assert_eq!(route["attributes"]["radixgate.policy"], "cache_aware");
    assert_eq!(route["attributes"]["radixgate.worker"], url.as_str());
    assert!(
        route["attributes"]["radixgate.matched_length"].is_i64(),
        "{route}"
    );
    assert!(
        route["attributes"]["radixgate.branch"].is_string(),
        "{route}"
    );
    let attempt = one(&spans, "attempt");
    assert_eq!(attempt["kind"], "SPAN_KIND_CLIENT");
    assert_eq!(attempt["attributes"]["http.response.status_code"], 200);
    assert_eq!(attempt["attributes"]["radixgate.worker"], url.as_str());
    assert_eq!(attempt["status"], "STATUS_CODE_UNSET");
    // The worker's parent is the attempt span, in the same trace.
    assert_eq!(attempt["span_id"], tp[2]);
    assert_eq!(root["trace_id"], tp[1]);
    drop(gw);
}

#[test]
fn a_callers_context_is_continued_and_replaced_upstream_not_duplicated() {
    let rx = Receiver::start();
    let workers = sim(1, |c| c.record_requests = 16);
    let ep = rx.endpoint();
    // Ratio 0: only the (trusted) client's sampled flag can make a request recorded.
    let gw = gateway_for(
        &workers.urls(),
        &[
            "--enable-trace",
            "--otlp-traces-endpoint",
            &ep,
            "--trace-sample-ratio",
            "0",
            "--trace-trust-caller-sampling",
        ],
    );
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller = "00f067aa0ba902b7";
    let sent = format!("00-{trace}-{caller}-01");
    chat_with(
        gw.addr,
        &[("traceparent", &sent), ("tracestate", "vendor=abc")],
        false,
    );
    let (parents, states) = worker_trace_headers(&workers);
    assert_eq!(parents.len(), 1, "replaced, not added: {parents:?}");
    assert_eq!(states, vec!["vendor=abc".to_string()]);
    let spans = rx.trace(trace);
    let root = one(&spans, "radixgate.request");
    assert_eq!(root["parent_span_id"], caller);
    assert_eq!(root["trace_state"], "vendor=abc");
    let attempt = one(&spans, "attempt");
    assert_eq!(
        parents[0],
        format!("00-{trace}-{}-01", attempt["span_id"].as_str().unwrap())
    );

    // Unsampled by the caller: nothing recorded, and its context passes upstream untouched.
    let unsampled = format!("00-{}-{caller}-00", "a".repeat(32));
    chat_with(gw.addr, &[("traceparent", &unsampled)], false);
    let (parents, _) = worker_trace_headers(&workers);
    assert_eq!(parents, vec![unsampled.clone()]);
    // Untraced requests at ratio 0, then a sampled marker: once the marker is in, nothing
    // else arrived.
    for _ in 0..5 {
        chat_with(gw.addr, &[], false);
    }
    let marker = "5bf92f3577b34da6a3ce929d0e0e4736";
    chat_with(
        gw.addr,
        &[("traceparent", &format!("00-{marker}-{caller}-01"))],
        false,
    );
    rx.trace(marker);
    let traces: std::collections::BTreeSet<String> = rx
        .all()
        .iter()
        .map(|s| s["trace_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        traces,
        [trace.to_string(), marker.to_string()]
            .into_iter()
            .collect(),
        "ratio 0 and an unsampled caller export nothing"
    );
}

#[test]
fn a_failed_attempt_carries_its_retry_reason_and_the_retry_its_own_span() {
    let rx = Receiver::start();
    let bad = sim(1, |c| c.faults.fail_rate = 1.0);
    let good = sim(1, |c| c.record_requests = 16);
    let ep = rx.endpoint();
    let urls = [bad.urls()[0].clone(), good.urls()[0].clone()];
    let gw = gateway_for(
        &urls,
        &[
            "--enable-trace",
            "--otlp-traces-endpoint",
            &ep,
            "--policy",
            "round_robin",
            "--retry-initial-backoff-ms",
            "1",
        ],
    );
    // Round robin: one of two requests meets the failing worker first.
    for _ in 0..2 {
        chat_with(gw.addr, &[], false);
    }
    let retried = wait_until("a request with two attempts", WAIT, || {
        let all = rx.all();
        let roots: Vec<Value> = all
            .iter()
            .filter(|s| s["name"] == "radixgate.request")
            .cloned()
            .collect();
        roots.into_iter().find_map(|r| {
            let of: Vec<Value> = all
                .iter()
                .filter(|s| s["trace_id"] == r["trace_id"])
                .cloned()
                .collect();
            (of.iter().filter(|s| s["name"] == "attempt").count() == 2).then_some(of)
        })
    });
    let attempts: Vec<&Value> = retried.iter().filter(|s| s["name"] == "attempt").collect();
    let (first, second) = if attempts[0]["start"].as_u64() < attempts[1]["start"].as_u64() {
        (attempts[0], attempts[1])
    } else {
        (attempts[1], attempts[0])
    };
    assert_eq!(
        first["attributes"]["http.response.status_code"], 500,
        "{first}"
    );
    assert_eq!(
        first["attributes"]["radixgate.retry_reason"], "status",
        "{first}"
    );
    assert_eq!(first["status"], "STATUS_CODE_ERROR", "{first}");
    assert_eq!(first["attributes"]["radixgate.worker"], urls[0].as_str());
    assert_eq!(
        second["attributes"]["http.response.status_code"], 200,
        "{second}"
    );
    assert_eq!(second["attributes"]["radixgate.worker"], urls[1].as_str());
    assert!(second["attributes"]["radixgate.retry_reason"].is_null());
    assert_eq!(retried.iter().filter(|s| s["name"] == "route").count(), 2);
    // The worker that answered saw the second attempt as its parent.
    let want = format!(
        "00-{}-{}-01",
        second["trace_id"].as_str().unwrap(),
        second["span_id"].as_str().unwrap()
    );
    let recorded = sim_recorded(&good, 0);
    assert!(recorded.contains(&want), "{want} not in {recorded}");
}

#[test]
fn a_full_buffer_drops_and_counts_spans_and_the_request_is_still_served() {
    let rx = Receiver::start();
    let workers = sim(1, |_| {});
    let ep = rx.endpoint();
    let gw = gateway_with_metrics(
        &workers.urls(),
        &[
            "--enable-trace",
            "--otlp-traces-endpoint",
            &ep,
            "--trace-buffer-spans",
            "2",
        ],
    );
    // Each request finishes 4 spans at once (admit, route, attempt, request): 2 fit. The
    // export thread may drain the queue between two pushes when this core is descheduled, so
    // a few more requests (bounded) make the overflow certain on a loaded machine.
    let tracer = gw.gateway().trace.clone().expect("tracing is on");
    for _ in 0..20 {
        chat_with(gw.addr, &[], false);
        if tracer.dropped() >= 2 {
            break;
        }
    }
    assert!(tracer.dropped() >= 2, "dropped {}", tracer.dropped());
    wait_until("the spans that fit", WAIT, || {
        (rx.all().len() >= 2).then_some(())
    });
    let metrics = gw.metrics_addr.expect("metrics listener");
    let text = request(metrics, "GET", "/metrics", &[], b"")
        .unwrap()
        .text();
    let dropped: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("radixgate_trace_spans_dropped_total{reason=\"spans\"} "))
        .unwrap_or_else(|| panic!("no dropped counter in {text}"))
        .trim()
        .parse()
        .unwrap();
    assert!(dropped >= 2.0, "{dropped}");
}

/// Every `traceparent` worker `i` got on `path`.
fn traceparents_on(cluster: &loadtest::sim::SimCluster, i: usize, path: &str) -> Vec<String> {
    let all: Value = serde_json::from_str(&sim_recorded(cluster, i)).expect("JSON");
    all.as_array()
        .unwrap()
        .iter()
        .filter(|r| r["path"] == path)
        .flat_map(|r| r["headers"].as_array().unwrap().clone())
        .filter(|h| h[0].as_str().unwrap().eq_ignore_ascii_case("traceparent"))
        .map(|h| h[1].as_str().unwrap().to_string())
        .collect()
}

/// The `traceparent` naming span `s` as the parent.
fn names(s: &Value) -> String {
    format!(
        "00-{}-{}-01",
        s["trace_id"].as_str().unwrap(),
        s["span_id"].as_str().unwrap()
    )
}

#[test]
fn pd_each_side_has_its_attempt_span_and_a_failed_side_its_retry_reason() {
    use loadtest::sim::disagg::DisaggMode;
    let rx = Receiver::start();
    let bad = pd_role(1, DisaggMode::Prefill, 1.0);
    let good = pd_role(1, DisaggMode::Prefill, 0.0);
    let decode = pd_role(1, DisaggMode::Decode, 0.0);
    let ep = rx.endpoint();
    let gw = pd_gateway(
        &[&bad, &good],
        &[&decode],
        &[
            "--prefill-policy",
            "round_robin",
            "--retry-initial-backoff-ms",
            "1",
            // One failure opens the bad prefill's circuit: the next request meets only good ones.
            "--cb-failure-threshold",
            "1",
            "--enable-trace",
            "--otlp-traces-endpoint",
            &ep,
        ],
    );
    // Round robin: the first request meets the failing prefill, the second does not.
    for i in 0..2 {
        let r = generate(gw.addr, &gen_body(i));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let traces = wait_until("two PD traces", WAIT, || {
        let all = rx.all();
        let roots: Vec<&Value> = all
            .iter()
            .filter(|s| s["name"] == "radixgate.request")
            .collect();
        (roots.len() == 2).then(|| {
            roots
                .iter()
                .map(|r| {
                    all.iter()
                        .filter(|s| s["trace_id"] == r["trace_id"])
                        .cloned()
                        .collect::<Vec<Value>>()
                })
                .collect::<Vec<_>>()
        })
    });
    let attempts = |t: &[Value], n: i64, side: &str| -> Value {
        one(
            &t.iter()
                .filter(|s| {
                    s["name"] == "attempt"
                        && s["attributes"]["radixgate.attempt"] == n
                        && s["attributes"]["radixgate.pd_side"] == side
                })
                .cloned()
                .collect::<Vec<_>>(),
            "attempt",
        )
        .clone()
    };
    let (retried, clean): (Vec<_>, Vec<_>) = traces
        .into_iter()
        .partition(|t| t.iter().filter(|s| s["name"] == "attempt").count() == 4);
    assert_eq!((retried.len(), clean.len()), (1, 1), "one request retried");
    let (retried, clean) = (&retried[0], &clean[0]);

    // Each attempt is a pair of client spans under the request span.
    for t in [retried, clean] {
        let root = one(t, "radixgate.request");
        for s in t.iter().filter(|s| s["name"] == "attempt") {
            assert_eq!(s["parent_span_id"], root["span_id"], "{s}");
            assert_eq!(s["kind"], "SPAN_KIND_CLIENT", "{s}");
        }
    }
    // The failed pair: the prefill side failed with its status and the retry reason; its
    // decode twin was dropped, not failed.
    let failed = attempts(retried, 1, "prefill");
    assert_eq!(
        failed["attributes"]["radixgate.worker"],
        bad.urls()[0].as_str()
    );
    assert_eq!(failed["attributes"]["http.response.status_code"], 500);
    assert_eq!(failed["attributes"]["radixgate.retry_reason"], "status");
    assert_eq!(failed["status"], "STATUS_CODE_ERROR", "{failed}");
    let twin = attempts(retried, 1, "decode");
    assert_eq!(twin["attributes"]["radixgate.dropped"], true, "{twin}");
    assert_eq!(twin["status"], "STATUS_CODE_UNSET", "{twin}");
    assert!(twin["end"].as_u64() <= failed["end"].as_u64().map(|e| e + 1_000_000));
    // The answered pairs: both sides 200, decode's relayed answer on its own span.
    for (t, n) in [(retried, 2), (clean, 1)] {
        let p = attempts(t, n, "prefill");
        let d = attempts(t, n, "decode");
        assert_eq!(p["attributes"]["radixgate.worker"], good.urls()[0].as_str());
        assert_eq!(
            d["attributes"]["radixgate.worker"],
            decode.urls()[0].as_str()
        );
        assert_eq!(p["attributes"]["http.response.status_code"], 200, "{p}");
        assert_eq!(d["attributes"]["http.response.status_code"], 200, "{d}");
        assert!(
            d["attributes"]["radixgate.body_bytes"].as_i64() > Some(0),
            "{d}"
        );
        assert!(p["attributes"]["radixgate.retry_reason"].is_null(), "{p}");
        // Each worker joined the trace under its own side's span.
        assert!(
            traceparents_on(&good, 0, "/generate").contains(&names(&p)),
            "{p}"
        );
        assert!(
            traceparents_on(&decode, 0, "/generate").contains(&names(&d)),
            "{d}"
        );
    }
    assert!(traceparents_on(&bad, 0, "/generate").contains(&names(&failed)));
    assert!(traceparents_on(&decode, 0, "/generate").contains(&names(&twin)));
}

/// A chat request with these headers, its status checked; `path` any routed or pass-through
/// endpoint.
fn get_with(gw: std::net::SocketAddr, path: &str, headers: &[(&str, &str)]) -> Response {
    let r = request(gw, "GET", path, headers, b"").expect("a response");
    assert_eq!(r.status, 200, "{}", r.text());
    r
}

#[test]
fn a_callers_sampled_flag_decides_only_when_the_caller_is_trusted() {
    let rx = Receiver::start();
    let workers = sim(1, |c| c.record_requests = 64);
    let ep = rx.endpoint();
    let caller = "00f067aa0ba902b7";
    // Trust off (the default), ratio 0: a sampled context records nothing; it reaches the
    // worker as the client sent it.
    let gw = gateway_for(
        &workers.urls(),
        &[
            "--enable-trace",
            "--otlp-traces-endpoint",
            &ep,
            "--trace-sample-ratio",
            "0",
        ],
    );
    let forced = format!("00-{}-{caller}-01", "1".repeat(32));
    chat_with(gw.addr, &[("traceparent", &forced)], false);
    let (parents, _) = worker_trace_headers(&workers);
    assert_eq!(
        parents,
        vec![forced.clone()],
        "not recorded: passed unchanged"
    );
    drop(gw);

    // Trust off, ratio 1: an unsampled context is recorded anyway, in the caller's trace
    // under the caller's span, with its tracestate.
    let gw = gateway_for(
        &workers.urls(),
        &["--enable-trace", "--otlp-traces-endpoint", &ep],
    );
    let trace = "2".repeat(32);
    let unsampled = format!("00-{trace}-{caller}-00");
    chat_with(
        gw.addr,
        &[("traceparent", &unsampled), ("tracestate", "vendor=abc")],
        false,
    );
    let (parents, states) = worker_trace_headers(&workers);
    let root = one(&rx.trace(&trace), "radixgate.request").clone();
    assert_eq!(root["parent_span_id"], caller);
    assert_eq!(root["trace_state"], "vendor=abc");
    let attempt = one(&rx.trace(&trace), "attempt").clone();
    assert_eq!(parents, vec![names(&attempt)]);
    assert_eq!(states, vec!["vendor=abc".to_string()]);
    drop(gw);

    // Trust on with --api-key, ratio 0: a caller presenting the key decides; a keyless call
    // to a public pass-through endpoint does not.
    let gw = gateway_for(
        &workers.urls(),
        &[
            "--enable-trace",
            "--otlp-traces-endpoint",
            &ep,
            "--trace-sample-ratio",
            "0",
            "--trace-trust-caller-sampling",
            "--api-key",
            "sk-trace",
        ],
    );
    let keyless = format!("00-{}-{caller}-01", "3".repeat(32));
    get_with(gw.addr, "/get_model_info", &[("traceparent", &keyless)]);
    assert_eq!(
        traceparents_on(&workers, 0, "/get_model_info"),
        vec![keyless.clone()],
        "a keyless caller is not trusted"
    );
    let trusted = "4".repeat(32);
    chat_with(
        gw.addr,
        &[
            ("traceparent", &format!("00-{trusted}-{caller}-01")),
            ("authorization", "Bearer sk-trace"),
        ],
        false,
    );
    let spans = rx.trace(&trusted);
    let (parents, _) = worker_trace_headers(&workers);
    assert_eq!(parents, vec![names(one(&spans, "attempt"))]);
    // Nothing of the forced and keyless traces ever arrived.
    let traces: std::collections::BTreeSet<String> = rx
        .all()
        .iter()
        .map(|s| s["trace_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        traces,
        [trace, trusted].into_iter().collect(),
        "only the ratio's and the trusted caller's traces"
    );
}

#[test]
fn a_batch_over_the_collectors_message_limit_is_split_and_arrives_whole() {
    // The collector takes at most 64 KiB a request; the gateway splits at 32 KiB.
    let hold = std::env::temp_dir().join(format!(
        "radixgate-otlp-hold-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_file(&hold);
    let hold_arg = hold.to_string_lossy().into_owned();
    let rx = Receiver::start_with(&[
        "--max-receive-bytes",
        "65536",
        "--hold-first-export-until",
        &hold_arg,
    ]);
    let workers = sim(1, |_| {});
    let ep = rx.endpoint();
    let gw = gateway_for(
        &workers.urls(),
        &[
            "--enable-trace",
            "--otlp-traces-endpoint",
            &ep,
            "--trace-export-batch-bytes",
            "32768",
        ],
    );
    let tp = |i: usize| format!("00-{i:032x}-00f067aa0ba902b7-01");
    // The first request's export is held by the collector: what follows piles up.
    chat_with(gw.addr, &[("traceparent", &tp(0xffff))], false);
    wait_until("the collector to hold the first export", WAIT, || {
        rx.holding.load(Ordering::SeqCst).then_some(())
    });
    // 100 requests, each with a 400-byte tracestate: over 100 KiB of spans, which the export
    // thread takes at once (at most 512 spans) when the collector answers.
    let state: String = (0..10)
        .map(|i| format!("v{i}={}", "x".repeat(36)))
        .collect::<Vec<_>>()
        .join(",");
    for i in 1..=100 {
        chat_with(
            gw.addr,
            &[("traceparent", &tp(i)), ("tracestate", &state)],
            false,
        );
    }
    std::fs::write(&hold, b"").expect("release the collector");
    let held = &tp(0xffff)[3..35];
    let roots = wait_until("every request's server span", WAIT, || {
        let all = rx.all();
        let n = all
            .iter()
            .filter(|s| s["name"] == "radixgate.request" && s["trace_id"] != held)
            .count();
        (n >= 100).then_some(n)
    });
    let _ = std::fs::remove_file(&hold);
    assert_eq!(roots, 100);
    // Every span of them (a request's other spans go in the same batch as its server span,
    // or an earlier one), each server span with its tracestate.
    let all = rx.all();
    let theirs: Vec<&Value> = all.iter().filter(|s| s["trace_id"] != held).collect();
    assert_eq!(
        theirs.len(),
        400,
        "admit, route, attempt and request of each"
    );
    assert!(theirs
        .iter()
        .filter(|s| s["name"] == "radixgate.request")
        .all(|s| s["trace_state"] == state.as_str()));
}

#[test]
fn spans_over_the_buffers_bytes_are_dropped_and_counted_and_requests_still_served() {
    let hold = std::env::temp_dir().join(format!(
        "radixgate-otlp-hold-bytes-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_file(&hold);
    let hold_arg = hold.to_string_lossy().into_owned();
    let rx = Receiver::start_with(&["--hold-first-export-until", &hold_arg]);
    let workers = sim(1, |_| {});
    let ep = rx.endpoint();
    // 64 KiB of spans per core, and room for 8192 of them.
    let gw = gateway_with_metrics(
        &workers.urls(),
        &[
            "--enable-trace",
            "--otlp-traces-endpoint",
            &ep,
            "--trace-buffer-bytes",
            "65536",
        ],
    );
    chat_with(gw.addr, &[], false);
    wait_until("the collector to hold the first export", WAIT, || {
        rx.holding.load(Ordering::SeqCst).then_some(())
    });
    // While the export thread waits, requests whose server spans carry a 16 KiB model name:
    // a few fill the 64 KiB, the rest are dropped, every request answered.
    let model = "m".repeat(16 << 10);
    let body = serde_json::to_vec(&serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    }))
    .unwrap();
    let tracer = gw.gateway().trace.clone().expect("tracing is on");
    for _ in 0..20 {
        let r = request(gw.addr, "POST", "/v1/chat/completions", &[], &body).expect("answer");
        assert_eq!(r.status, 200, "{}", r.text());
        // One core, 64 KiB (a span being counted in may sit on top of it for an instant).
        assert!(
            tracer.queued_bytes() <= 2 * 65536,
            "{}",
            tracer.queued_bytes()
        );
    }
    std::fs::write(&hold, b"").expect("release the collector");
    let by_bytes = tracer.dropped_by(radixgate::trace::DropReason::Bytes);
    let _ = std::fs::remove_file(&hold);
    // At most three such server spans fit a core's 64 KiB.
    assert!(by_bytes >= 8, "dropped over the bytes: {by_bytes}");
    let metrics = gw.metrics_addr.expect("metrics listener");
    let text = request(metrics, "GET", "/metrics", &[], b"")
        .unwrap()
        .text();
    let counted: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("radixgate_trace_spans_dropped_total{reason=\"bytes\"} "))
        .unwrap_or_else(|| panic!("no bytes drop counter in {text}"))
        .trim()
        .parse()
        .unwrap();
    assert!(counted >= by_bytes as f64, "{counted} < {by_bytes}");
}
