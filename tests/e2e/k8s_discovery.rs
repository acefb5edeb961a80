//! Kubernetes service discovery (`--service-discovery`) end to end: a gateway watching a stub
//! Kubernetes API server (`tests/fixtures/kube_apiserver.py`, list/watch of pods with
//! resourceVersion, label selectors, 410 Gone) through a kubeconfig the test writes, with
//! simulated workers as the pods' servers (every pod's IP is 127.0.0.1; its port is
//! `--service-discovery-port` or the `smg.ai/worker-ports` annotation). The stub is checked
//! against a real client: `kubectl` (Debian's `kubernetes-client` package, installed by
//! scripts/test.sh) lists and watches through it.

use crate::common::{
    gateway, request, sim, test_python, wait_ready, wait_until, workers_json, ChildGuard,
};
use radixgate::runtime::Running;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Longest wait for the stub to print its port.
const START_LIMIT: Duration = Duration::from_secs(30);
/// Longest wait for the gateway to follow a change (coalescing 1 s, a probe, a loaded machine).
const FOLLOW: Duration = Duration::from_secs(20);

/// One stub API server, killed when dropped, with the kubeconfig file that points at it.
pub(crate) struct Stub {
    _child: ChildGuard,
    port: u16,
    kubeconfig: PathBuf,
}

impl Stub {
    pub(crate) fn start(flags: &[&str]) -> Stub {
        let python = test_python(&["aiohttp"]);
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/kube_apiserver.py"
        );
        let mut child = Command::new(&python)
            .arg(script)
            .arg("--exit-on-stdin-eof")
            .args(flags)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("{python} {script}: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let guard = ChildGuard(Some(child));
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx
            .recv_timeout(START_LIMIT)
            .unwrap_or_else(|_| panic!("{script} printed no port within {START_LIMIT:?}"));
        let v: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("{script} did not start ({e}): {line:?}"));
        let port = v["port"].as_u64().expect("port") as u16;
        let dir = std::env::temp_dir().join(format!("radixgate-k8s-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let kubeconfig = dir.join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: stub\n  cluster:\n    \
                 server: http://127.0.0.1:{port}\nusers:\n- name: test\n  user: {{}}\n\
                 contexts:\n- name: stub\n  context: {{cluster: stub, user: test, namespace: default}}\n\
                 current-context: stub\n"
            ),
        )
        .unwrap();
        Stub {
            _child: guard,
            port,
            kubeconfig,
        }
    }

    fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    fn control(&self, method: &str, path: &str, body: &Value) -> Value {
        let r = request(self.addr(), method, path, &[], body.to_string().as_bytes())
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        assert!(r.status < 300, "{method} {path}: {} {}", r.status, r.text());
        r.json()
    }

    pub(crate) fn put(&self, pod: &Value) {
        self.control("POST", "/control/pods", pod);
    }

    fn delete(&self, name: &str) {
        self.control(
            "DELETE",
            &format!("/control/pods/default/{name}"),
            &json!({}),
        );
    }

    /// The API requests the stub answered (path and query).
    fn requests(&self) -> Vec<Value> {
        let r = request(self.addr(), "GET", "/control/requests", &[], b"").unwrap();
        r.json()["requests"].as_array().cloned().unwrap_or_default()
    }

    /// Watches started so far.
    fn watches_started(&self) -> usize {
        self.requests()
            .iter()
            .filter(|r| r["query"]["watch"].is_string())
            .count()
    }

    pub(crate) fn kubeconfig(&self) -> &str {
        self.kubeconfig.to_str().unwrap()
    }
}

impl Drop for Stub {
    fn drop(&mut self) {
        if let Some(dir) = self.kubeconfig.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A pod on 127.0.0.1 whose worker listens on `port` (through the ports annotation).
pub(crate) fn pod(name: &str, uid: &str, port: u16, labels: Value, ready: bool) -> Value {
    json!({
        "metadata": {
            "name": name, "namespace": "default", "uid": uid, "labels": labels,
            "annotations": {"smg.ai/worker-ports": port.to_string()}
        },
        "status": {
            "phase": "Running", "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]
        }
    })
}

fn url(port: u16) -> String {
    format!("http://127.0.0.1:{port}")
}

/// A gateway discovering pods through `stub` with these extra flags.
fn discovering(stub: &Stub, extra: &[&str]) -> Running {
    let mut flags = vec![
        "--service-discovery",
        "--kubeconfig",
        stub.kubeconfig(),
        "--service-discovery-namespace",
        "default",
    ];
    flags.extend_from_slice(extra);
    gateway(&flags)
}

/// The registered workers, by URL.
fn workers(gw: &Running) -> Vec<Value> {
    workers_json(gw.addr)["workers"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn urls(gw: &Running) -> Vec<String> {
    let mut v: Vec<String> = workers(gw)
        .iter()
        .filter_map(|w| w["url"].as_str().map(str::to_string))
        .collect();
    v.sort();
    v
}

fn worker(gw: &Running, u: &str) -> Option<Value> {
    workers(gw).into_iter().find(|w| w["url"] == u)
}

/// Wait until the registered URLs are exactly `want`.
fn wait_urls(gw: &Running, want: &[String], what: &str) {
    let mut want = want.to_vec();
    want.sort();
    let mut last = Vec::new();
    let end = Instant::now() + FOLLOW;
    while Instant::now() < end {
        last = urls(gw);
        if last == want {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{what}: workers {last:?}, wanted {want:?}");
}

fn readiness(gw: &Running) -> u16 {
    request(gw.addr, "GET", "/readiness", &[], b"").map_or(0, |r| r.status)
}

/// Which worker port served one `/generate`.
fn served_port(gw: &Running) -> u16 {
    let r = request(
        gw.addr,
        "POST",
        "/generate",
        &[],
        br#"{"text":"hello","sampling_params":{"max_new_tokens":1}}"#,
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    crate::common::served_by(&r)
}

/// The stub is a Kubernetes API server as far as the real client can tell: `kubectl` lists
/// pods through it with a label selector, and watches them (a pod added during the watch
/// arrives; one that does not match never does).
#[test]
fn k8s_stub_answers_kubectl_list_and_watch() {
    let stub = Stub::start(&[]);
    stub.put(&pod("a", "u-a", 1, json!({"app": "x"}), true));
    stub.put(&pod("b", "u-b", 2, json!({"app": "y"}), true));
    let out = Command::new("kubectl")
        .args(["--kubeconfig", stub.kubeconfig(), "--request-timeout=20s"])
        .args(["get", "pods", "-l", "app=x", "-o", "json"])
        .output()
        .expect("kubectl is installed (scripts/test.sh installs Debian's kubernetes-client)");
    assert!(
        out.status.success(),
        "kubectl get: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list: Value = serde_json::from_slice(&out.stdout).expect("kubectl printed JSON");
    let names: Vec<&str> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["metadata"]["name"].as_str())
        .collect();
    assert_eq!(names, vec!["a"]);
    assert_eq!(list["items"][0]["metadata"]["uid"], "u-a");

    // A bounded watch: `timeout` ends kubectl whatever happens.
    let mut child = Command::new("timeout")
        .args(["20", "kubectl", "--kubeconfig", stub.kubeconfig()])
        .args(["get", "pods", "-l", "app=x", "--watch", "-o", "name"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("timeout + kubectl");
    let stdout = child.stdout.take().unwrap();
    let guard = ChildGuard(Some(child));
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let first = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("a listed pod");
    assert_eq!(first, "pod/a");
    wait_until("kubectl's watch to start", FOLLOW, || {
        (stub.watches_started() > 0).then_some(())
    });
    stub.put(&pod("c", "u-c", 3, json!({"app": "y"}), true));
    stub.put(&pod("d", "u-d", 4, json!({"app": "x"}), true));
    let next = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("a watched pod");
    assert_eq!(next, "pod/d", "the watch sends matching pods only");
    drop(guard);
    // kubectl sent its selector to the server.
    assert!(stub
        .requests()
        .iter()
        .all(|r| r["query"]["labelSelector"] == "app=x"));
}

/// Pods added, made ready, unready, terminating and deleted: only Ready pods are added, a
/// not-ready pod stays registered but gets no requests, a terminating pod leaves at once, a
/// deleted one too; the label selector went to the server.
#[test]
fn k8s_pods_join_and_leave_with_their_state() {
    let cluster = sim(2, |_| {});
    let (p0, p1) = (cluster.ports()[0], cluster.ports()[1]);
    let stub = Stub::start(&[]);
    stub.put(&pod("w0", "u0", p0, json!({"app": "sgl"}), true));
    stub.put(&pod("w1", "u1", p1, json!({"app": "sgl"}), false));
    stub.put(&pod("other", "u9", p1, json!({"app": "other"}), true));
    let gw = discovering(&stub, &["--selector", "app=sgl"]);
    wait_urls(
        &gw,
        &[url(p0)],
        "a Ready pod is added, a not-ready one is not",
    );
    wait_ready(gw.addr, FOLLOW);
    let sent = stub.requests();
    assert!(
        !sent.is_empty()
            && sent.iter().all(|r| r["query"]["labelSelector"] == "app=sgl"
                && r["path"] == "/api/v1/namespaces/default/pods"),
        "the selector is sent to the server: {sent:?}"
    );

    // Made ready: added.
    stub.put(&pod("w1", "u1", p1, json!({"app": "sgl"}), true));
    wait_urls(&gw, &[url(p0), url(p1)], "a pod made Ready is added");
    wait_until("w1 healthy", FOLLOW, || {
        worker(&gw, &url(p1)).filter(|w| w["healthy"] == true)
    });

    // Unready: stays registered, held out of selection; every request goes to w0.
    stub.put(&pod("w0", "u0", p0, json!({"app": "sgl"}), false));
    wait_until("w0 held", FOLLOW, || {
        worker(&gw, &url(p0)).filter(|w| w["held"] == true)
    });
    for _ in 0..8 {
        assert_eq!(served_port(&gw), p1, "a not-ready pod gets no requests");
    }
    let mut both = vec![url(p0), url(p1)];
    both.sort();
    assert_eq!(
        urls(&gw),
        both,
        "the not-ready pod's worker stays registered"
    );
    // Ready again: released.
    stub.put(&pod("w0", "u0", p0, json!({"app": "sgl"}), true));
    wait_until("w0 released", FOLLOW, || {
        worker(&gw, &url(p0)).filter(|w| w["held"] == false)
    });

    // Terminating (deletionTimestamp set, the pod still listed): leaves at once.
    let mut t = pod("w1", "u1", p1, json!({"app": "sgl"}), true);
    t["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    t["metadata"]["deletionGracePeriodSeconds"] = json!(30);
    stub.put(&t);
    wait_urls(
        &gw,
        &[url(p0)],
        "a terminating pod leaves at the start of its grace",
    );

    // Deleted.
    stub.delete("w0");
    wait_urls(&gw, &[], "a deleted pod leaves");
    stub.delete("w1");
}

/// The same IP with a new uid is a new pod: the old worker goes even before the new pod is
/// Ready, and the new one comes once it is.
#[test]
fn k8s_an_ip_reused_by_a_new_pod_replaces_the_worker() {
    let cluster = sim(1, |_| {});
    let p0 = cluster.ports()[0];
    let stub = Stub::start(&[]);
    stub.put(&pod("old", "u-old", p0, json!({"app": "sgl"}), true));
    let gw = discovering(&stub, &["--selector", "app=sgl"]);
    wait_urls(&gw, &[url(p0)], "the first pod");
    let first = worker(&gw, &url(p0)).unwrap();
    stub.delete("old");
    stub.put(&pod("new", "u-new", p0, json!({"app": "sgl"}), false));
    wait_urls(
        &gw,
        &[],
        "the old pod's worker leaves (its successor is not Ready)",
    );
    stub.put(&pod("new", "u-new", p0, json!({"app": "sgl"}), true));
    wait_urls(&gw, &[url(p0)], "the new pod's worker");
    let second = worker(&gw, &url(p0)).unwrap();
    assert_eq!(first["url"], second["url"]);
    assert_eq!(served_port(&gw), p0);
}

/// A watch that breaks mid-stream (after a BOOKMARK) is resumed from its resourceVersion (a
/// pod added while it was down arrives); a `410 Gone`, as a watch ERROR event and as an HTTP
/// answer, forces a re-list, and a pod deleted while no watch saw it leaves.
#[test]
fn k8s_broken_watch_and_410_relist() {
    for mode in ["event", "http"] {
        let cluster = sim(3, |_| {});
        let p = cluster.ports();
        let stub = Stub::start(&["--gone-mode", mode]);
        stub.put(&pod("a", "ua", p[0], json!({"app": "sgl"}), true));
        stub.put(&pod("b", "ub", p[1], json!({"app": "sgl"}), true));
        let gw = discovering(&stub, &["--selector", "app=sgl"]);
        wait_urls(&gw, &[url(p[0]), url(p[1])], "two pods");
        wait_until("a watch", FOLLOW, || {
            (stub.watches_started() > 0).then_some(())
        });

        // A bookmark moves the watch's resourceVersion on without an object change.
        let marked = stub.control("POST", "/control/bookmark", &json!({}));
        assert!(marked["watches"].as_u64() >= Some(1), "{marked}");
        stub.control("POST", "/control/break", &json!({}));
        stub.put(&pod("c", "uc", p[2], json!({"app": "sgl"}), true));
        wait_urls(
            &gw,
            &[url(p[0]), url(p[1]), url(p[2])],
            "a pod added across a broken watch",
        );

        let lists_before = stub
            .requests()
            .iter()
            .filter(|r| !r["query"]["watch"].is_string())
            .count();
        stub.control("POST", "/control/expire", &json!({"delete": ["default/b"]}));
        wait_urls(
            &gw,
            &[url(p[0]), url(p[2])],
            &format!("410 ({mode}) → re-list: the pod gone meanwhile leaves"),
        );
        let lists_after = stub
            .requests()
            .iter()
            .filter(|r| !r["query"]["watch"].is_string())
            .count();
        assert!(lists_after > lists_before, "a 410 makes a new list");
    }
}

/// The API server unreachable for 10 s: the workers stay, `/readiness` stays 200 and requests
/// are served; once it is back, changes are followed again.
#[test]
fn k8s_api_server_down_keeps_the_last_known_workers() {
    let cluster = sim(2, |_| {});
    let p = cluster.ports();
    let stub = Stub::start(&[]);
    stub.put(&pod("a", "ua", p[0], json!({"app": "sgl"}), true));
    let gw = discovering(&stub, &["--selector", "app=sgl"]);
    wait_urls(&gw, &[url(p[0])], "one pod");
    wait_ready(gw.addr, FOLLOW);
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    stub.control("POST", "/control/down", &json!({}));
    let end = Instant::now() + Duration::from_secs(10);
    while Instant::now() < end {
        assert_eq!(readiness(&gw), 200, "ready while the API server is down");
        assert_eq!(urls(&gw), vec![url(p[0])], "the last known worker stays");
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(served_port(&gw), p[0]);
    stub.control("POST", "/control/up", &json!({}));
    stub.put(&pod("b", "ub", p[1], json!({"app": "sgl"}), true));
    // Backoff is at most 8 s after 10 s of failures (1, 2, 4, 8).
    let mut want = vec![url(p[0]), url(p[1])];
    want.sort();
    let end = Instant::now() + Duration::from_secs(40);
    while urls(&gw) != want {
        assert!(Instant::now() < end, "changes followed after the outage");
        std::thread::sleep(Duration::from_millis(100));
    }
    // The failures were counted and a list completed after the outage (process-wide metrics:
    // other tests may add to them, never take away).
    let text = radixgate::metrics::install()
        .map(|h| h.render())
        .unwrap_or_default();
    let sample = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no {name} in the metrics"))
    };
    assert!(sample("radixgate_discovery_watch_restarts_total") >= 1.0);
    assert!(sample("radixgate_discovery_last_list_timestamp_seconds") >= started);
}

/// `smg.ai/worker-ports` gives one worker per listed port; `--service-discovery-port` is the
/// port of pods without it.
#[test]
fn k8s_multi_port_annotation_and_default_port() {
    let cluster = sim(3, |_| {});
    let p = cluster.ports();
    let stub = Stub::start(&[]);
    let mut multi = pod("multi", "um", 0, json!({"app": "sgl"}), true);
    multi["metadata"]["annotations"]["smg.ai/worker-ports"] = json!(format!("{},{}", p[0], p[1]));
    stub.put(&multi);
    let mut plain = pod("plain", "up", 0, json!({"app": "sgl"}), true);
    plain["metadata"]["annotations"] = json!({});
    stub.put(&plain);
    let port = p[2].to_string();
    let gw = discovering(
        &stub,
        &["--selector", "app=sgl", "--service-discovery-port", &port],
    );
    wait_urls(
        &gw,
        &[url(p[0]), url(p[1]), url(p[2])],
        "one worker per annotated port, the default port for the plain pod",
    );
}

/// PD mode: roles by the first matching selector (prefill, then decode), the prefill pod's
/// bootstrap port from `--bootstrap-port-annotation`; a pod of neither role is not added.
#[test]
fn k8s_pd_roles_with_the_bootstrap_annotation() {
    let cluster = sim(3, |_| {});
    let p = cluster.ports();
    let stub = Stub::start(&[]);
    let mut prefill = pod(
        "p",
        "up",
        p[0],
        json!({"app": "sgl", "role": "prefill"}),
        true,
    );
    prefill["metadata"]["annotations"]["example.com/boot"] = json!("8998");
    stub.put(&prefill);
    stub.put(&pod(
        "d",
        "ud",
        p[1],
        json!({"app": "sgl", "role": "decode"}),
        true,
    ));
    stub.put(&pod("n", "un", p[2], json!({"app": "sgl"}), true));
    let gw = discovering(
        &stub,
        &[
            "--pd-disaggregation",
            "--prefill-selector",
            "app=sgl",
            "role=prefill",
            "--decode-selector",
            "app=sgl",
            "role=decode",
            "--bootstrap-port-annotation",
            "example.com/boot",
        ],
    );
    wait_urls(
        &gw,
        &[url(p[0]), url(p[1])],
        "a prefill and a decode worker",
    );
    let pw = worker(&gw, &url(p[0])).unwrap();
    assert_eq!(pw["worker_type"], "prefill");
    assert_eq!(pw["bootstrap_port"], 8998);
    let dw = worker(&gw, &url(p[1])).unwrap();
    assert_eq!(dw["worker_type"], "decode");
    assert!(dw["bootstrap_port"].is_null());
    // The labels common to both roles went to the server.
    assert!(stub
        .requests()
        .iter()
        .all(|r| r["query"]["labelSelector"] == "app=sgl"));
}

/// A selector that matches no pod adds nothing (and watches, so a pod that comes to match
/// later is added). With no namespace flag, outside a pod, only the kubeconfig context's
/// namespace is watched: a matching pod in another namespace is never a worker; every
/// namespace only with `--service-discovery-all-namespaces`.
#[test]
fn k8s_only_the_own_namespace_by_default() {
    let cluster = sim(2, |_| {});
    let (p0, p1) = (cluster.ports()[0], cluster.ports()[1]);
    let stub = Stub::start(&[]);
    stub.put(&pod("a", "ua", p0, json!({"app": "sgl"}), true));
    let mut foreign = pod("f", "uf", p1, json!({"app": "nothing"}), true);
    foreign["metadata"]["namespace"] = json!("elsewhere");
    stub.put(&foreign);
    let gw = gateway(&[
        "--service-discovery",
        "--kubeconfig",
        stub.kubeconfig(),
        "--selector",
        "app=nothing",
    ]);
    wait_until("a watch", FOLLOW, || {
        (stub.watches_started() > 0).then_some(())
    });
    // A matching pod in the watched namespace arrives; the foreign one never does.
    stub.put(&pod("b", "ub", p0, json!({"app": "nothing"}), true));
    wait_urls(&gw, &[url(p0)], "a matching pod in the context's namespace");
    let sent = stub.requests();
    assert!(
        sent.iter()
            .all(|r| r["path"] == "/api/v1/namespaces/default/pods"),
        "only the kubeconfig context's namespace is asked for: {sent:?}"
    );
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        urls(&gw),
        vec![url(p0)],
        "the other namespace's pod is not a worker"
    );
    drop(gw);

    // Asked for: every namespace.
    let gw = gateway(&[
        "--service-discovery",
        "--kubeconfig",
        stub.kubeconfig(),
        "--service-discovery-all-namespaces",
        "--selector",
        "app=nothing",
    ]);
    wait_urls(&gw, &[url(p0), url(p1)], "every namespace when asked");
    assert!(stub.requests().iter().any(|r| r["path"] == "/api/v1/pods"));
}

/// One sample of a process-wide metric series (`name{labels}` as rendered), 0 when absent.
fn metric(series: &str) -> f64 {
    let text = radixgate::metrics::install()
        .map(|h| h.render())
        .unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0)
}

const REFUSED_PORTS: &str = r#"radixgate_discovery_refused_total{reason="ports_per_pod"}"#;
const REFUSED_WORKERS: &str = r#"radixgate_discovery_refused_total{reason="max_workers"}"#;

/// A pod listing 16,384 ports (a 98 KB annotation) gets at most
/// `--service-discovery-max-ports-per-pod` (8) workers, and only those that answer their probe
/// take a worker id; the rest are counted. An honest pod added after it is registered and
/// `/readiness` stays ready.
#[test]
fn k8s_a_huge_ports_annotation_does_not_take_the_worker_table() {
    let cluster = sim(1, |_| {});
    let p0 = cluster.ports()[0];
    let stub = Stub::start(&[]);
    // Ports 1 to 8 first (nothing listens there: they refuse), then the top of the range, the
    // honest pod's port left out: 16,384 ports, 98 KB.
    let ports: Vec<String> = (1..=8u32)
        .chain(49_152..=65_535)
        .filter(|&p| p != u32::from(p0))
        .take(16_384)
        .map(|p| p.to_string())
        .collect();
    let annotation = ports.join(",");
    assert!(annotation.len() > 95_000, "{}", annotation.len());
    let mut big = pod("big", "u-big", 0, json!({"app": "sgl"}), true);
    big["metadata"]["annotations"]["smg.ai/worker-ports"] = json!(annotation);
    stub.put(&big);
    let refused_before = metric(REFUSED_PORTS);
    let gw = discovering(&stub, &["--selector", "app=sgl"]);
    wait_until("the refused ports counted", FOLLOW, || {
        (metric(REFUSED_PORTS) >= refused_before + 16_376.0).then_some(())
    });
    let put_at = Instant::now();
    stub.put(&pod("honest", "u-honest", p0, json!({"app": "sgl"}), true));
    let end = Instant::now() + FOLLOW;
    loop {
        let now = workers(&gw);
        let honest = now
            .iter()
            .any(|w| w["url"] == url(p0).as_str() && w["healthy"] == true);
        if honest {
            break;
        }
        assert!(
            Instant::now() < end,
            "the honest pod was not registered; {} workers registered",
            now.len()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "honest pod routable {:?} after it was created, beside a pod of 16,384 ports",
        put_at.elapsed()
    );
    wait_ready(gw.addr, FOLLOW);
    assert_eq!(readiness(&gw), 200);
    assert_eq!(
        urls(&gw),
        vec![url(p0)],
        "ports that do not answer take no worker id"
    );
    assert_eq!(served_port(&gw), p0);
}

/// Probes of servers not registered yet never share a connection: after an honest pod's probe
/// succeeded, a pod whose ports refuse every connection registers nothing (a pooled
/// connection to the honest server once answered those probes).
#[test]
fn k8s_a_probe_never_reuses_another_servers_connection() {
    let cluster = sim(1, |_| {});
    let p0 = cluster.ports()[0];
    let stub = Stub::start(&[]);
    stub.put(&pod("honest", "u-honest", p0, json!({"app": "sgl"}), true));
    let gw = discovering(&stub, &["--selector", "app=sgl"]);
    wait_urls(&gw, &[url(p0)], "the honest pod");
    // Nothing listens on these (bound, then closed): every probe is refused.
    let refusing: Vec<String> = (0..8)
        .map(|_| {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port().to_string()
        })
        .collect();
    let mut bad = pod("refusing", "u-refusing", 0, json!({"app": "sgl"}), true);
    bad["metadata"]["annotations"]["smg.ai/worker-ports"] = json!(refusing.join(","));
    stub.put(&bad);
    // Long enough for every port's probe to have run (8 at once, each refused at once).
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(urls(&gw), vec![url(p0)], "a refusing port was registered");
}

/// A pod whose 8 ports accept TCP connections and never answer (each probe waits out its 5 s)
/// does not hold up another pod: the honest pod is routable within a small bound.
#[test]
fn k8s_a_pod_that_never_answers_does_not_hold_up_another() {
    let cluster = sim(1, |_| {});
    let p0 = cluster.ports()[0];
    // Listening but never accepting: the kernel completes the handshake, nothing answers.
    let hung: Vec<std::net::TcpListener> = (0..8)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let list: Vec<String> = hung
        .iter()
        .map(|l| l.local_addr().unwrap().port().to_string())
        .collect();
    for l in &hung {
        l.set_nonblocking(true).unwrap();
    }
    let stub = Stub::start(&[]);
    let mut bad = pod("hung", "u-hung", 0, json!({"app": "sgl"}), true);
    bad["metadata"]["annotations"]["smg.ai/worker-ports"] = json!(list.join(","));
    stub.put(&bad);
    let gw = discovering(
        &stub,
        &["--selector", "app=sgl", "--health-check-timeout-secs", "5"],
    );
    // Accepted (and held open, unanswered) so the probe is known to be under way.
    let mut held = Vec::new();
    wait_until("a probe of the hung pod", FOLLOW, || {
        for l in &hung {
            if let Ok((s, _)) = l.accept() {
                held.push(s);
            }
        }
        (!held.is_empty()).then_some(())
    });
    let put_at = Instant::now();
    stub.put(&pod("honest", "u-honest", p0, json!({"app": "sgl"}), true));
    // Bounded by far more than the old sequential probes (8 × 5 s), to measure them.
    let end = put_at + Duration::from_secs(60);
    while worker(&gw, &url(p0)).is_none_or(|w| w["healthy"] != true) {
        assert!(Instant::now() < end, "the honest pod never registered");
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = put_at.elapsed();
    eprintln!("honest pod routable {took:?} after it was created");
    assert!(
        took < Duration::from_secs(4),
        "the honest pod waited {took:?} behind probes that never answer"
    );
    assert_eq!(served_port(&gw), p0);
    assert_eq!(
        urls(&gw),
        vec![url(p0)],
        "unanswered probes register nothing"
    );
    drop(held);
}

/// `--service-discovery-max-workers`: past the cap pods are refused and counted; when a
/// registered pod leaves, a refused one takes its place.
#[test]
fn k8s_the_worker_cap_per_source() {
    let cluster = sim(3, |_| {});
    let p = cluster.ports();
    let stub = Stub::start(&[]);
    for (i, port) in p.iter().enumerate() {
        stub.put(&pod(
            &format!("w{i}"),
            &format!("u{i}"),
            *port,
            json!({"app": "sgl"}),
            true,
        ));
    }
    let before = metric(REFUSED_WORKERS);
    let gw = discovering(
        &stub,
        &[
            "--selector",
            "app=sgl",
            "--service-discovery-max-workers",
            "2",
        ],
    );
    wait_until("a refusal counted", FOLLOW, || {
        (metric(REFUSED_WORKERS) > before).then_some(())
    });
    wait_until("two workers", FOLLOW, || {
        (urls(&gw).len() == 2).then_some(())
    });
    std::thread::sleep(Duration::from_millis(1500));
    let first = urls(&gw);
    assert_eq!(first.len(), 2, "never more than the cap: {first:?}");
    let gone = first[0].clone();
    let gone_i = p.iter().position(|port| url(*port) == gone).unwrap();
    stub.delete(&format!("w{gone_i}"));
    let rest: Vec<String> = p
        .iter()
        .filter(|port| url(**port) != gone)
        .map(|port| url(*port))
        .collect();
    wait_urls(&gw, &rest, "the refused pod takes the freed place");
}

/// Discovery never removes what it did not add: a static `--worker-urls` worker and an
/// API-added one at a pod's URL stay when the pods go.
#[test]
fn k8s_static_and_api_workers_are_never_removed() {
    let cluster = sim(3, |_| {});
    let p = cluster.ports();
    let stub = Stub::start(&[]);
    let static_url = url(p[0]);
    let kc = stub.kubeconfig().to_string();
    let gw = gateway(&[
        "--worker-urls",
        &static_url,
        "--service-discovery",
        "--kubeconfig",
        &kc,
        "--service-discovery-namespace",
        "default",
        "--selector",
        "app=sgl",
    ]);
    let added = request(
        gw.addr,
        "POST",
        "/workers",
        &[],
        json!({"url": url(p[1])}).to_string().as_bytes(),
    )
    .unwrap();
    assert!(added.status < 300, "{}", added.text());
    stub.put(&pod("s", "us", p[0], json!({"app": "sgl"}), true));
    stub.put(&pod("a", "ua", p[1], json!({"app": "sgl"}), true));
    stub.put(&pod("d", "ud", p[2], json!({"app": "sgl"}), true));
    wait_urls(
        &gw,
        &[url(p[0]), url(p[1]), url(p[2])],
        "the discovered pod joins",
    );
    for name in ["s", "a", "d"] {
        stub.delete(name);
    }
    wait_urls(
        &gw,
        &[url(p[0]), url(p[1])],
        "only the worker discovery added leaves",
    );
    // And they stay through later reconciles.
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(urls(&gw).len(), 2);
}

/// `--dp-aware`: a discovered server's DP ranks are targets of their own, as for a static
/// worker; a not-ready pod holds every rank, and its deletion removes them all.
#[test]
fn k8s_dp_ranks_of_a_discovered_server() {
    let cluster = sim(1, |c| c.dp_size = 2);
    let p0 = cluster.ports()[0];
    let stub = Stub::start(&[]);
    stub.put(&pod("dp", "udp", p0, json!({"app": "sgl"}), true));
    let gw = discovering(&stub, &["--selector", "app=sgl", "--dp-aware"]);
    let ranks = [format!("{}@0", url(p0)), format!("{}@1", url(p0))];
    wait_urls(&gw, &ranks, "one target per DP rank");
    stub.put(&pod("dp", "udp", p0, json!({"app": "sgl"}), false));
    wait_until("every rank held", FOLLOW, || {
        workers(&gw).iter().all(|w| w["held"] == true).then_some(())
    });
    stub.delete("dp");
    wait_urls(&gw, &[], "the server leaves with all its ranks");
}

/// `--kv-events`: a discovered worker's event publishers are found like a static worker's
/// (registration is the same path): an SGLang server's from its `/get_server_info`, a vLLM
/// server's from its `/kv_event_sources`; its events are followed.
#[test]
fn k8s_discovered_workers_publish_kv_events() {
    use loadtest::sim::EngineKind;
    for (engine, config) in [
        (
            EngineKind::Sglang,
            r#"{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*"}"#,
        ),
        (
            EngineKind::Vllm,
            r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*"}"#,
        ),
    ] {
        let cluster = sim(1, |c| {
            c.engine = engine;
            c.page_size = 4;
            c.kv_events = Some(loadtest::sim::kv_events::KvEventsConfig::parse(config).unwrap());
        });
        let p0 = cluster.ports()[0];
        let stub = Stub::start(&[]);
        stub.put(&pod("kv", "ukv", p0, json!({"app": "sgl"}), true));
        let gw = discovering(&stub, &["--selector", "app=sgl", "--kv-events"]);
        wait_urls(&gw, &[url(p0)], "the discovered worker");
        let kv = gw.gateway().kv.as_ref().expect("--kv-events on");
        let id: u32 = worker(&gw, &url(p0)).unwrap()["id"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .expect("a worker id");
        wait_until(
            &format!("the discovered {engine:?} worker's events are followed"),
            FOLLOW,
            || kv.exact_workers().contains(&id).then_some(()),
        );
    }
}
