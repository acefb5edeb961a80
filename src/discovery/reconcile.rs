//! Level-triggered reconcile: the desired set (from the pods) against the workers discovery
//! registered, whatever events led there. `plan` is pure (tested alone); `Reconciler` applies a
//! plan through the same registration path as the admin API, on the discovery helper thread.
//! Discovery only ever removes or holds workers it added itself: a static `--worker-urls`
//! worker or one added through the API at the same URL is left alone.

use super::pods::{Desired, Wanted};
use crate::gateway::{Gateway, NotAdded};
use crate::proxy::pool::Pool;
use crate::workers::registry::{RegistryError, Worker};
use crate::workers::role::Role;
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A worker discovery registered, as it registered it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owned {
    /// The pod it belongs to.
    pub uid: String,
    /// The role it was registered with (a relabelled pod is re-registered).
    pub role: Role,
    /// Held out of selection because its pod is not Ready.
    pub held: bool,
    /// The registry's serial of its first target: tells it apart from a worker someone else
    /// registered at the same URL after removing ours.
    pub serial: u64,
    /// Targets it holds in the worker table (its DP ranks, else 1).
    pub targets: usize,
}

/// One step of a reconcile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Remove our worker at this URL (pod gone, terminating, replaced or relabelled).
    Remove(String),
    /// Register a worker for a Ready pod.
    Add {
        url: String,
        uid: String,
        pod: String,
        role: Role,
    },
    /// Hold our worker out of selection (`true`: pod not Ready) or release it.
    Hold(String, bool),
}

/// What to do to go from `owned` to `desired`: removals first (so a replaced pod's URL is free
/// for its successor), then additions of Ready pods, then holds. A not-ready pod is never
/// added, and a not-ready pod's existing worker is held, not removed.
pub fn plan(desired: &BTreeMap<String, Desired>, owned: &BTreeMap<String, Owned>) -> Vec<Action> {
    let mut removes = Vec::new();
    let mut adds = Vec::new();
    let mut holds = Vec::new();
    for (url, have) in owned {
        match desired.get(url) {
            Some(want) if want.uid == have.uid && want.role == have.role => {
                if have.held == want.ready {
                    holds.push(Action::Hold(url.clone(), !want.ready));
                }
            }
            _ => removes.push(Action::Remove(url.clone())),
        }
    }
    for (url, want) in desired {
        let kept = owned
            .get(url)
            .is_some_and(|h| h.uid == want.uid && h.role == want.role);
        if want.ready && !kept {
            adds.push(Action::Add {
                url: url.clone(),
                uid: want.uid.clone(),
                pod: want.pod.clone(),
                role: want.role,
            });
        }
    }
    removes.extend(adds);
    removes.extend(holds);
    removes
}

/// What the reconcile thread is told to do next.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// Some addition waits out a failure ([`RETRY`]): reconcile again at this time.
    pub retry_at: Option<Instant>,
}

/// How soon a failed addition (the pod's server not answering yet) is tried again.
pub const RETRY: Duration = Duration::from_secs(5);
/// Additions under way for one pod at most: its ports are probed one at a time, so a pod whose
/// servers accept and never answer holds one slot of `--service-discovery-concurrency`, not
/// all of them.
pub const PER_POD: usize = 1;

/// The bounds `--service-discovery-*` set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// `--service-discovery-max-workers`: targets discovery may hold registered.
    pub max_workers: usize,
    /// `--service-discovery-concurrency`: additions under way at once.
    pub concurrency: usize,
}

/// Targets discovery holds: registered, plus reserved by additions under way (shared with them;
/// one thread, so a `Cell`).
struct Budget {
    used: Cell<usize>,
    max: usize,
}

impl Budget {
    /// Reserve `n` targets if they fit.
    fn take(&self, n: usize) -> bool {
        let fits = self.used.get() + n <= self.max;
        if fits {
            self.used.set(self.used.get() + n);
        }
        fits
    }

    /// Give back `n` reserved or registered targets.
    fn give(&self, n: usize) {
        self.used.set(self.used.get().saturating_sub(n));
    }
}

/// A finished addition, waiting to be taken in by [`Reconciler::collect`].
struct Done {
    url: String,
    uid: String,
    pod: String,
    role: Role,
    /// Targets it reserved in the [`Budget`] (kept when registered, given back otherwise).
    reserved: usize,
    result: Result<Vec<Arc<Worker>>, NotAdded>,
}

/// Applies plans to the gateway, remembering what discovery registered. Additions run as tasks
/// of their own on the discovery thread (at most `concurrency`, one per pod), so a server that
/// never answers holds up neither the removals nor other pods; a worker is registered only
/// once its probe answered, so servers that never answer take no worker id.
pub struct Reconciler {
    gw: Arc<Gateway>,
    /// This thread's own upstream connections (probes, `/get_server_info`).
    pool: Rc<Pool>,
    limits: Limits,
    owned: BTreeMap<String, Owned>,
    /// URLs registered by someone else, reported once each.
    foreign: BTreeSet<String>,
    /// Additions under way: URL → pod uid.
    pending: BTreeMap<String, String>,
    /// Additions finished since the last [`Reconciler::collect`].
    done: Rc<RefCell<Vec<Done>>>,
    budget: Rc<Budget>,
    /// URLs whose addition failed: not tried again before this time (the first failure is
    /// logged, the next ones only at debug level).
    failing: BTreeMap<String, Instant>,
    /// Pods (uids) whose ports over the cap were counted, once each.
    ports_reported: BTreeSet<String>,
    /// URLs refused by `--service-discovery-max-workers`, counted once each while refused.
    over_cap: BTreeSet<String>,
}

impl Reconciler {
    /// A reconciler that has registered nothing yet.
    pub fn new(gw: Arc<Gateway>, pool: Pool, limits: Limits) -> Reconciler {
        crate::metrics::discovery_refused_init();
        Reconciler {
            gw,
            pool: Rc::new(pool),
            limits,
            owned: BTreeMap::new(),
            foreign: BTreeSet::new(),
            pending: BTreeMap::new(),
            done: Rc::default(),
            budget: Rc::new(Budget {
                used: Cell::new(0),
                max: limits.max_workers,
            }),
            failing: BTreeMap::new(),
            ports_reported: BTreeSet::new(),
            over_cap: BTreeSet::new(),
        }
    }

    /// The workers discovery registered now, by URL.
    pub fn owned(&self) -> &BTreeMap<String, Owned> {
        &self.owned
    }

    /// Bring the registry towards `wanted`: removals and holds now, additions started (those
    /// over the caps refused and counted; those waiting out a failure, or for a free slot,
    /// left for a later reconcile).
    pub fn reconcile(&mut self, wanted: &Wanted) -> Outcome {
        let desired = &wanted.workers;
        self.forget_removed_elsewhere();
        self.report_ports(wanted);
        let list = self.gw.registry.load_full();
        self.foreign
            .retain(|u| desired.contains_key(u) && list.by_url(u).is_some());
        self.over_cap.retain(|u| desired.contains_key(u));
        self.failing.retain(|u, _| desired.contains_key(u));
        let now = Instant::now();
        let mut outcome = Outcome::default();
        let mut adds = Vec::new();
        for action in plan(desired, &self.owned) {
            match action {
                Action::Remove(url) => self.remove(&url),
                Action::Add { .. } => adds.push(action),
                Action::Hold(url, held) => self.hold(&url, held),
            }
        }
        for action in fair_order(adds) {
            let Action::Add {
                url,
                uid,
                pod,
                role,
            } = action
            else {
                continue;
            };
            if self.pending.contains_key(&url) {
                continue;
            }
            // Someone else's worker at this URL (a flag, the API): left to its owner, and not
            // probed; discovery takes the URL over only once it is free.
            if list.by_url(&url).is_some() {
                self.note_foreign(&url, &pod);
                continue;
            }
            if let Some(&at) = self.failing.get(&url) {
                if at > now {
                    outcome.retry_at = Some(outcome.retry_at.map_or(at, |t| t.min(at)));
                    continue;
                }
            }
            // Past either bound the rest wait for a finished addition (which reconciles again).
            let busy_pod = self.pending.values().filter(|u| **u == uid).count() >= PER_POD;
            if busy_pod || self.pending.len() >= self.limits.concurrency {
                continue;
            }
            if !self.budget.take(1) {
                self.refuse_over_cap(&url, &pod, 1);
                continue;
            }
            self.start_add(url, uid, pod, role);
        }
        self.publish_counts();
        outcome
    }

    /// Take in the additions that finished; true when any did (reconcile again: a slot is
    /// free, and a worker registered for a pod that left meanwhile must go).
    pub fn collect(&mut self) -> bool {
        let done: Vec<Done> = std::mem::take(&mut *self.done.borrow_mut());
        let any = !done.is_empty();
        for d in done {
            self.pending.remove(&d.url);
            self.finish(d);
        }
        if any {
            self.publish_counts();
        }
        any
    }

    /// Start one addition as a task of its own (one target already reserved).
    fn start_add(&mut self, url: String, uid: String, pod: String, role: Role) {
        self.pending.insert(url.clone(), uid.clone());
        let (gw, pool) = (self.gw.clone(), self.pool.clone());
        let (budget, done) = (self.budget.clone(), self.done.clone());
        monoio::spawn(async move {
            let reserved = Cell::new(1usize);
            // The DP ranks past the reserved one must fit too.
            let fits = |n: usize| {
                let more = n.saturating_sub(reserved.get());
                let ok = more == 0 || budget.take(more);
                if ok {
                    reserved.set(reserved.get() + more);
                }
                ok
            };
            let result = gw.register_probed(&pool, &url, role, &fits).await;
            done.borrow_mut().push(Done {
                url,
                uid,
                pod,
                role,
                reserved: reserved.get(),
                result,
            });
        });
    }

    /// Record one finished addition.
    fn finish(&mut self, d: Done) {
        match d.result {
            Ok(added) => {
                let serial = added.first().map_or(0, |w| w.serial);
                let targets = added.len();
                // Reserved and registered counts agree; keep the budget exact anyway.
                self.budget.give(d.reserved);
                self.budget.used.set(self.budget.used.get() + targets);
                self.failing.remove(&d.url);
                self.over_cap.remove(&d.url);
                crate::log!(
                    Info,
                    "discovery: pod {} ({}) added as {}",
                    d.pod,
                    d.uid,
                    d.url
                );
                self.owned.insert(
                    d.url,
                    Owned {
                        uid: d.uid,
                        role: d.role,
                        held: false,
                        serial,
                        targets,
                    },
                );
            }
            Err(e) => {
                self.budget.give(d.reserved);
                match e {
                    NotAdded::Registry(RegistryError::Duplicate(_)) => {
                        self.note_foreign(&d.url, &d.pod)
                    }
                    NotAdded::OverCap(n) => self.refuse_over_cap(&d.url, &d.pod, n),
                    e => {
                        let first = self
                            .failing
                            .insert(d.url.clone(), Instant::now() + RETRY)
                            .is_none();
                        if first {
                            crate::log!(
                                Warn,
                                "discovery: pod {} at {} not added: {e} (tried again every \
                                 {}s)",
                                d.pod,
                                d.url,
                                RETRY.as_secs()
                            );
                        } else {
                            crate::log!(Debug, "discovery: pod {} at {}: {e}", d.pod, d.url);
                        }
                    }
                }
            }
        }
    }

    /// A pod at a URL someone else registered: logged once while it stays so.
    fn note_foreign(&mut self, url: &str, pod: &str) {
        if self.foreign.insert(url.to_string()) {
            crate::log!(
                Warn,
                "discovery: pod {pod} is at {url}, which is registered by a flag or the API: \
                 left to its owner"
            );
        }
    }

    /// A worker over `--service-discovery-max-workers`: counted and logged once per URL while
    /// it stays refused (tried again at each reconcile, in case room was made).
    fn refuse_over_cap(&mut self, url: &str, pod: &str, targets: usize) {
        if self.over_cap.insert(url.to_string()) {
            crate::metrics::discovery_refused("max_workers", 1);
            crate::log!(
                Warn,
                "discovery: pod {pod} at {url} refused: discovery holds {} of \
                 --service-discovery-max-workers {} targets, and it needs {targets}",
                self.budget.used.get(),
                self.budget.max
            );
        }
    }

    /// Count and log, once per pod, the ports cut by `--service-discovery-max-ports-per-pod`.
    fn report_ports(&mut self, wanted: &Wanted) {
        let now: BTreeSet<&str> = wanted
            .too_many_ports
            .iter()
            .map(|t| t.uid.as_str())
            .collect();
        self.ports_reported.retain(|u| now.contains(u.as_str()));
        for t in &wanted.too_many_ports {
            if self.ports_reported.insert(t.uid.clone()) {
                crate::metrics::discovery_refused("ports_per_pod", t.refused as u64);
                crate::log!(
                    Warn,
                    "discovery: pod {} lists {} more worker ports than \
                     --service-discovery-max-ports-per-pod: only its first ones are workers",
                    t.pod,
                    t.refused
                );
            }
        }
    }

    /// Drop our records of workers no longer registered as we registered them (removed through
    /// the admin API): the plan then adds their pods again if they are still wanted.
    fn forget_removed_elsewhere(&mut self) {
        let list = self.gw.registry.load_full();
        let budget = &self.budget;
        self.owned.retain(|url, o| {
            let ours = list.by_url(url).is_some_and(|w| w.serial == o.serial);
            if !ours {
                budget.give(o.targets);
                crate::log!(Info, "discovery: worker {url} was removed elsewhere");
            }
            ours
        });
    }

    fn remove(&mut self, url: &str) {
        let Some(o) = self.owned.remove(url) else {
            return;
        };
        self.budget.give(o.targets);
        match self.gw.remove_worker(url) {
            Ok(_) => crate::log!(Info, "discovery: pod {} left: worker {url} removed", o.uid),
            Err(e) => crate::log!(Warn, "discovery: removing {url}: {e}"),
        }
    }

    fn hold(&mut self, url: &str, held: bool) {
        let Some(o) = self.owned.get_mut(url) else {
            return;
        };
        o.held = held;
        let list = self.gw.registry.load_full();
        if let Some(w) = list.by_url(url) {
            if self.gw.registry.set_held(w, held) {
                let now = if held {
                    "not Ready: held out of selection"
                } else {
                    "Ready again"
                };
                crate::log!(Info, "discovery: pod {} at {url} {now}", o.uid);
                self.gw.membership_changed();
            }
        }
    }

    /// Discovered workers per role, for the metrics.
    fn publish_counts(&self) {
        let mut counts = [0usize; 3];
        for o in self.owned.values() {
            let i = match o.role {
                Role::Regular => 0,
                Role::Prefill { .. } => 1,
                Role::Decode => 2,
            };
            counts[i] += 1;
        }
        crate::metrics::discovery_workers(counts[0], counts[1], counts[2]);
    }
}

/// Additions in turns, one pod's first port, then every pod's second…, in plan (URL) order
/// within a turn: under the caps a pod with many ports comes after the other pods' first ones.
pub fn fair_order(adds: Vec<Action>) -> Vec<Action> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut turns: Vec<(usize, Action)> = adds
        .into_iter()
        .map(|a| {
            let turn = match &a {
                Action::Add { uid, .. } => {
                    let n = seen.entry(uid.clone()).or_default();
                    *n += 1;
                    *n
                }
                _ => 0,
            };
            (turn, a)
        })
        .collect();
    turns.sort_by_key(|(turn, _)| *turn);
    turns.into_iter().map(|(_, a)| a).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn want(uid: &str, ready: bool) -> Desired {
        Desired {
            uid: uid.into(),
            pod: format!("ns/{uid}"),
            role: Role::Regular,
            ready,
        }
    }

    fn have(uid: &str, held: bool) -> Owned {
        Owned {
            uid: uid.into(),
            role: Role::Regular,
            held,
            serial: 1,
            targets: 1,
        }
    }

    fn map<V: Clone>(v: &[(&str, V)]) -> BTreeMap<String, V> {
        v.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
    }

    fn add(url: &str, uid: &str) -> Action {
        Action::Add {
            url: url.into(),
            uid: uid.into(),
            pod: format!("ns/{uid}"),
            role: Role::Regular,
        }
    }

    #[test]
    fn ready_pods_are_added_and_unready_ones_wait() {
        let desired = map(&[
            ("http://a:1", want("a", true)),
            ("http://b:1", want("b", false)),
        ]);
        assert_eq!(
            plan(&desired, &BTreeMap::new()),
            vec![add("http://a:1", "a")]
        );
    }

    #[test]
    fn a_pod_that_goes_unready_is_held_and_released_not_removed() {
        let owned = map(&[("http://a:1", have("a", false))]);
        let unready = map(&[("http://a:1", want("a", false))]);
        assert_eq!(
            plan(&unready, &owned),
            vec![Action::Hold("http://a:1".into(), true)]
        );
        let held = map(&[("http://a:1", have("a", true))]);
        let ready = map(&[("http://a:1", want("a", true))]);
        assert_eq!(
            plan(&ready, &held),
            vec![Action::Hold("http://a:1".into(), false)]
        );
        // Nothing to do when the registry already agrees.
        assert!(plan(&ready, &map(&[("http://a:1", have("a", false))])).is_empty());
        assert!(plan(&unready, &held).is_empty());
    }

    #[test]
    fn gone_pods_are_removed_and_a_new_uid_replaces_the_worker() {
        let owned = map(&[
            ("http://a:1", have("a", false)),
            ("http://b:1", have("b", false)),
        ]);
        let desired = map(&[("http://a:1", want("a2", true))]);
        assert_eq!(
            plan(&desired, &owned),
            vec![
                Action::Remove("http://a:1".into()),
                Action::Remove("http://b:1".into()),
                add("http://a:1", "a2"),
            ]
        );
        // A new pod at the old IP that is not ready yet: the old worker goes, nothing comes.
        let unready = map(&[("http://a:1", want("a2", false))]);
        assert_eq!(
            plan(&unready, &owned),
            vec![
                Action::Remove("http://a:1".into()),
                Action::Remove("http://b:1".into()),
            ]
        );
    }

    #[test]
    fn additions_take_turns_across_pods() {
        let add_of = |url: &str, uid: &str| Action::Add {
            url: url.into(),
            uid: uid.into(),
            pod: format!("ns/{uid}"),
            role: Role::Regular,
        };
        let adds = vec![
            add_of("http://a:1", "big"),
            add_of("http://a:2", "big"),
            add_of("http://a:3", "big"),
            add_of("http://b:1", "ok"),
            add_of("http://c:1", "c"),
            add_of("http://c:2", "c"),
        ];
        let order: Vec<String> = fair_order(adds)
            .into_iter()
            .map(|a| match a {
                Action::Add { url, .. } => url,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            order,
            vec![
                "http://a:1",
                "http://b:1",
                "http://c:1",
                "http://a:2",
                "http://c:2",
                "http://a:3"
            ]
        );
    }

    #[test]
    fn the_budget_holds_registered_and_reserved_targets_under_the_cap() {
        let b = Budget {
            used: Cell::new(0),
            max: 3,
        };
        assert!(b.take(1) && b.take(2));
        assert!(!b.take(1), "full");
        b.give(2);
        assert!(!b.take(3) && b.take(2));
        b.give(10);
        assert_eq!(b.used.get(), 0, "never below zero");
    }

    #[test]
    fn a_relabelled_pod_is_registered_again_in_its_new_role() {
        let owned = map(&[("http://a:1", have("a", false))]);
        let mut d = want("a", true);
        d.role = Role::Decode;
        let desired = map(&[("http://a:1", d)]);
        let p = plan(&desired, &owned);
        assert_eq!(p.len(), 2);
        assert_eq!(p[0], Action::Remove("http://a:1".into()));
        assert!(matches!(
            &p[1],
            Action::Add {
                role: Role::Decode,
                ..
            }
        ));
    }
}
