//! Kubernetes service discovery (`--service-discovery`): pods matching the selectors become
//! workers, with the reference's flags and behaviour, so a fleet on Kubernetes needs no worker
//! list. Two helper threads, neither a serving core:
//!
//! * `k8s`: the `kube` client and a reflector (list, watch, re-list on `410 Gone`, backoff
//!   1 s → 300 s) on a small tokio runtime; it only keeps the pod store and counts changes.
//! * the reconcile thread (a monoio helper, like the health checker): a level-triggered
//!   reconcile of the desired set {url → pod uid} (`pods`) against the workers it registered
//!   (`reconcile`), [`COALESCE`] after a change and every [`RESYNC`] anyway. Workers are
//!   added through `Gateway::register_probed`, the admin API's path (DP ranks, PD roles; with
//!   `--kv-events` the health thread finds their publishers) except that a worker is
//!   registered only once its probe answered; additions run concurrently, bounded
//!   (`--service-discovery-concurrency`, one per pod), under the per-pod port and per-source
//!   worker caps.
//! * `scope` decides which namespace is watched (one by default, every one only by flag).
//!
//! While the API server is unreachable nothing is removed: the last known workers keep serving
//! (and `/readiness` with them), with a log line.

mod k8s;
pub mod pods;
pub mod reconcile;
pub mod scope;

use crate::config::settings::DiscoverySettings;
use crate::gateway::Gateway;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{self, Store};
use pods::{Labels, PodView, Rule, Selection};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Changes are gathered for this long after the first one, then applied together (a rollout's
/// burst of events is one reconcile, not hundreds).
pub const COALESCE: Duration = Duration::from_secs(1);
/// A full reconcile at least this often, events or not (level-triggered: a missed event or a
/// worker removed elsewhere is corrected within it).
pub const RESYNC: Duration = Duration::from_secs(60);
/// How often the reconcile thread looks for changes.
const TICK: Duration = Duration::from_millis(100);

/// What the watch thread and the reconcile thread share.
pub struct Shared {
    gw: Arc<Gateway>,
    /// The reflector's pods (a re-list replaces them whole, when complete).
    store: Store<Pod>,
    /// A first list completed: before it an empty store means "not known yet", not "no pods".
    listed: AtomicBool,
    /// Bumped on every change to the store.
    changes: AtomicU64,
}

/// The rule the flags describe: which pods, which roles, which port.
pub fn rule_from(settings: &DiscoverySettings) -> Rule {
    let selection = if settings.pd {
        Selection::Pd {
            base: Labels::parse(&settings.selector),
            prefill: Labels::parse(&settings.prefill_selector),
            decode: Labels::parse(&settings.decode_selector),
        }
    } else {
        Selection::Regular(Labels::parse(&settings.selector))
    };
    Rule {
        selection,
        port: settings.port,
        bootstrap_annotation: settings.bootstrap_annotation.clone(),
        max_ports: settings.max_ports_per_pod,
    }
}

/// Start discovery when `--service-discovery` is on (the watch and reconcile threads).
pub fn spawn(gw: Arc<Gateway>, settings: DiscoverySettings) {
    if !settings.enabled {
        return;
    }
    let rule = rule_from(&settings);
    let Some(selector) = rule.selection.server_selector() else {
        let which = if settings.pd {
            "--prefill-selector / --decode-selector"
        } else {
            "--selector"
        };
        crate::log!(
            Warn,
            "--service-discovery without {which}: no pod is included (an empty selector \
             would take every pod in the cluster)"
        );
        return;
    };
    let (store, writer) = reflector::store::<Pod>();
    let shared = Arc::new(Shared {
        gw: gw.clone(),
        store,
        listed: AtomicBool::new(false),
        changes: AtomicU64::new(0),
    });
    let spec = k8s::WatchSpec {
        kubeconfig: settings.kubeconfig.clone(),
        scope: scope::Inputs::read(
            settings.namespace.clone(),
            settings.all_namespaces,
            std::path::Path::new(scope::SERVICE_ACCOUNT_NAMESPACE),
        ),
        selector,
    };
    let limits = reconcile::Limits {
        max_workers: settings.max_workers,
        concurrency: settings.concurrency,
    };
    k8s::spawn(spec, shared.clone(), writer);
    crate::gateway::spawn_helper("discovery", crate::gateway::HelperClass::Nice, move || {
        run(shared, rule, limits)
    });
}

/// The reconcile loop: wait for a first list, then reconcile when changes have settled, on
/// every [`RESYNC`], when an addition finished, and when a failed one is due again.
async fn run(shared: Arc<Shared>, rule: Rule, limits: reconcile::Limits) {
    let gw = shared.gw.clone();
    let pool = crate::gateway::upstream_pool(&gw);
    let mut reconciler = reconcile::Reconciler::new(gw.clone(), pool, limits);
    let mut seen = 0u64;
    let mut pending_since: Option<Instant> = None;
    let mut next_full = Instant::now();
    let mut retry_at: Option<Instant> = None;
    while !gw.life.is_shutting_down() {
        monoio::time::sleep(TICK).await;
        if !shared.listed.load(Ordering::Acquire) {
            continue;
        }
        let finished = reconciler.collect();
        let now = Instant::now();
        let changes = shared.changes.load(Ordering::Acquire);
        if changes != seen && pending_since.is_none() {
            pending_since = Some(now);
        }
        let settled = pending_since.is_some_and(|t| now.duration_since(t) >= COALESCE);
        let due = retry_at.is_some_and(|t| now >= t);
        if !settled && !finished && !due && now < next_full {
            continue;
        }
        if settled {
            seen = changes;
            pending_since = None;
        }
        let pods: Vec<PodView> = shared
            .store
            .state()
            .iter()
            .map(|p| PodView::from_pod(p))
            .collect();
        let wanted = rule.wanted(&pods);
        retry_at = reconciler.reconcile(&wanted).retry_at;
        next_full = now + RESYNC;
    }
}
