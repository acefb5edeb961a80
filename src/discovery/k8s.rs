//! The Kubernetes side: a client (in-cluster service account, or a kubeconfig) and a reflector
//! over the pods the selector names, on a thread of its own with a small current-thread tokio
//! runtime (the `kube` crate needs tokio; the serving cores are monoio and never run it).
//!
//! kube's `watcher` lists, then watches from the list's `resourceVersion`, and lists again when
//! the server says the version is too old (`410 Gone`) or the stream breaks; its errors pass
//! through a backoff of 1 s doubling to 300 s (reset by the next success). A watch *refused* with
//! an HTTP 410 starts a new watcher (kube's own would retry the stale version for ever). The
//! reflector's store swaps in a re-list whole, so the reconcile never sees a half-listed set. The label selector
//! goes to the server, so only candidate pods cross the network.

use super::scope::Scope;
use super::Shared;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::reflector::store::Writer;
use kube::runtime::utils::Backoff;
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// First wait after a failed list or watch.
const BACKOFF_MIN: Duration = Duration::from_secs(1);
/// Longest wait between attempts while the API server stays unreachable.
const BACKOFF_MAX: Duration = Duration::from_secs(300);
/// How often the watch loop looks whether the gateway is shutting down.
const SHUTDOWN_POLL: Duration = Duration::from_millis(200);

/// Where and what to watch.
pub struct WatchSpec {
    /// `--kubeconfig`, else inferred (in-cluster, then `$KUBECONFIG` / `~/.kube/config`).
    pub kubeconfig: Option<PathBuf>,
    /// What decides the namespace ([`super::scope::choose`], once the client is known).
    pub scope: super::scope::Inputs,
    /// The server-side label selector.
    pub selector: String,
}

/// Doubling from [`BACKOFF_MIN`] to [`BACKOFF_MAX`], back to the start after a success (kube's
/// default tops out at 30 s; the reference waits up to 300 s on a struggling API server).
struct Doubling(Duration);

impl Iterator for Doubling {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        let now = self.0;
        self.0 = (self.0 * 2).min(BACKOFF_MAX);
        Some(now)
    }
}

impl Backoff for Doubling {
    fn reset(&mut self) {
        self.0 = BACKOFF_MIN;
    }
}

/// Start the watch thread; it ends when the gateway shuts down.
pub fn spawn(spec: WatchSpec, shared: Arc<Shared>, writer: Writer<Pod>) {
    let spawned = std::thread::Builder::new()
        .name("radixgate-k8s".into())
        .spawn(move || {
            if let Err(e) = crate::base::priority::helper_thread() {
                crate::log!(Warn, "k8s thread: cannot lower its priority: {e}");
            }
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            match rt {
                Ok(rt) => rt.block_on(run(spec, shared, writer)),
                Err(e) => crate::log!(Error, "k8s thread: cannot build its runtime: {e}"),
            }
        });
    if let Err(e) = spawned {
        crate::log!(Error, "cannot start the Kubernetes discovery thread: {e}");
    }
}

/// A client from `--kubeconfig`, or inferred.
async fn client(spec: &WatchSpec) -> Result<Client, String> {
    let config = match &spec.kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path).map_err(|e| format!("{}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .map_err(|e| format!("{}: {e}", path.display()))?
        }
        None => kube::Config::infer().await.map_err(|e| e.to_string())?,
    };
    Client::try_from(config).map_err(|e| e.to_string())
}

async fn run(spec: WatchSpec, shared: Arc<Shared>, writer: Writer<Pod>) {
    let mut wait = Doubling(BACKOFF_MIN);
    let client = loop {
        match client(&spec).await {
            Ok(c) => break c,
            Err(e) => {
                let d = wait.next().unwrap_or(BACKOFF_MAX);
                crate::log!(
                    Error,
                    "discovery: no Kubernetes client ({e}); trying again in {}s",
                    d.as_secs()
                );
                if sleep_unless_stopping(&shared, d).await {
                    return;
                }
            }
        }
    };
    let api: Api<Pod> = match super::scope::choose(&spec.scope, client.default_namespace()) {
        Scope::One(ns, why) => {
            crate::log!(
                Info,
                "discovery: watching pods with labels {} in namespace {ns} (from {})",
                spec.selector,
                why.as_str()
            );
            Api::namespaced(client, &ns)
        }
        Scope::All => {
            crate::log!(
                Warn,
                "discovery: watching pods with labels {} in every namespace \
                 (--service-discovery-all-namespaces): anyone who can label a pod anywhere in \
                 the cluster can make it a worker",
                spec.selector
            );
            Api::all(client)
        }
    };
    let config = watcher::Config::default().labels(&spec.selector);
    let mut writer = writer;
    let mut failing = false;
    // Each pass is one watcher; a new one starts from a fresh list (see `is_http_gone`).
    loop {
        let stream = watcher(api.clone(), config.clone())
            .backoff(Doubling(BACKOFF_MIN))
            .modify(|pod| pod.metadata.managed_fields = None);
        let mut stream = std::pin::pin!(stream);
        loop {
            let next = tokio::time::timeout(SHUTDOWN_POLL, stream.next());
            let item = match next.await {
                Err(_) if shared.gw.life.is_shutting_down() => return,
                Err(_) => continue,
                Ok(None) => return,
                Ok(Some(item)) => item,
            };
            match item {
                Ok(event) => {
                    if failing {
                        failing = false;
                        crate::log!(Info, "discovery: the Kubernetes API server answers again");
                    }
                    // The store buffers a re-list and swaps it in whole at `InitDone`.
                    writer.apply_watcher_event(&event);
                    if let watcher::Event::InitDone = event {
                        shared.listed.store(true, Ordering::Release);
                        crate::metrics::discovery_listed(unix_now());
                    }
                    if !matches!(event, watcher::Event::Init | watcher::Event::InitApply(_)) {
                        shared.changes.fetch_add(1, Ordering::AcqRel);
                    }
                }
                Err(e) => {
                    crate::metrics::discovery_watch_restart();
                    if !failing {
                        failing = true;
                        crate::log!(
                            Warn,
                            "discovery: Kubernetes list/watch failed ({e}); the last known \
                             workers keep serving while it is retried with backoff"
                        );
                    } else {
                        crate::log!(Debug, "discovery: list/watch failed again: {e}");
                    }
                    if is_http_gone(&e) {
                        break;
                    }
                }
            }
        }
        if sleep_unless_stopping(&shared, BACKOFF_MIN).await {
            return;
        }
    }
}

/// A watch refused with an HTTP `410 Gone` (its resourceVersion compacted away). kube's watcher
/// re-lists on a 410 inside the stream (an `ERROR` event) but retries a watch the server
/// refused with an HTTP 410 with the same version for ever; a new watcher lists afresh.
fn is_http_gone(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::WatchStartFailed(kube::Error::Api(r))
        | watcher::Error::WatchFailed(kube::Error::Api(r)) => r.code == 410,
        _ => false,
    }
}

/// Sleep `d`, in short steps; true when the gateway began shutting down meanwhile.
async fn sleep_unless_stopping(shared: &Shared, d: Duration) -> bool {
    let end = tokio::time::Instant::now() + d;
    while tokio::time::Instant::now() < end {
        if shared.gw.life.is_shutting_down() {
            return true;
        }
        tokio::time::sleep(SHUTDOWN_POLL).await;
    }
    shared.gw.life.is_shutting_down()
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_one_second_to_five_minutes_and_resets() {
        let mut b = Doubling(BACKOFF_MIN);
        let waits: Vec<u64> = (&mut b).take(11).map(|d| d.as_secs()).collect();
        assert_eq!(waits, vec![1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        b.reset();
        assert_eq!(b.next(), Some(BACKOFF_MIN));
    }

    #[test]
    fn only_an_http_410_starts_a_new_watcher() {
        let api = |code| {
            kube::Error::Api(kube::core::ErrorResponse {
                status: "Failure".into(),
                message: String::new(),
                reason: "Expired".into(),
                code,
            })
        };
        assert!(is_http_gone(&watcher::Error::WatchFailed(api(410))));
        assert!(is_http_gone(&watcher::Error::WatchStartFailed(api(410))));
        assert!(!is_http_gone(&watcher::Error::WatchFailed(api(500))));
        assert!(!is_http_gone(&watcher::Error::InitialListFailed(api(410))));
    }
}
