//! Level-triggered reconcile: the desired set (from the pods) against the workers discovery
//! registered, whatever events led there. `plan` is pure (tested alone); `Reconciler` applies a
//! plan through the same registration path as the admin API, on the discovery helper thread.
//! Discovery only ever removes or holds workers it added itself: a static `--worker-urls`
//! worker or one added through the API at the same URL is left alone.

use super::pods::Desired;
use crate::gateway::Gateway;
use crate::proxy::pool::Pool;
use crate::workers::registry::RegistryError;
use crate::workers::role::Role;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

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

/// How one reconcile went.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// An addition failed for a reason that may pass (the pod's server not answering yet):
    /// reconcile again soon rather than at the next periodic round.
    pub retry_soon: bool,
}

/// Applies plans to the gateway, remembering what discovery registered.
pub struct Reconciler {
    gw: Arc<Gateway>,
    /// This thread's own upstream connections (probes, `/get_server_info`).
    pool: Pool,
    owned: BTreeMap<String, Owned>,
    /// URLs registered by someone else, reported once each.
    foreign: BTreeSet<String>,
}

impl Reconciler {
    /// A reconciler that has registered nothing yet.
    pub fn new(gw: Arc<Gateway>, pool: Pool) -> Reconciler {
        Reconciler {
            gw,
            pool,
            owned: BTreeMap::new(),
            foreign: BTreeSet::new(),
        }
    }

    /// The workers discovery registered now, by URL.
    pub fn owned(&self) -> &BTreeMap<String, Owned> {
        &self.owned
    }

    /// Bring the registry to `desired`.
    pub async fn reconcile(&mut self, desired: &BTreeMap<String, Desired>) -> Outcome {
        self.forget_removed_elsewhere();
        self.foreign.retain(|u| desired.contains_key(u));
        let mut outcome = Outcome::default();
        for action in plan(desired, &self.owned) {
            match action {
                Action::Remove(url) => self.remove(&url),
                Action::Add {
                    url,
                    uid,
                    pod,
                    role,
                } => {
                    if !self.add(url, uid, &pod, role).await {
                        outcome.retry_soon = true;
                    }
                }
                Action::Hold(url, held) => self.hold(&url, held),
            }
        }
        self.publish_counts();
        outcome
    }

    /// Drop our records of workers no longer registered as we registered them (removed through
    /// the admin API): the plan then adds their pods again if they are still wanted.
    fn forget_removed_elsewhere(&mut self) {
        let list = self.gw.registry.load_full();
        self.owned.retain(|url, o| {
            let ours = list.by_url(url).is_some_and(|w| w.serial == o.serial);
            if !ours {
                crate::log!(Info, "discovery: worker {url} was removed elsewhere");
            }
            ours
        });
    }

    fn remove(&mut self, url: &str) {
        let Some(o) = self.owned.remove(url) else {
            return;
        };
        match self.gw.remove_worker(url) {
            Ok(_) => crate::log!(Info, "discovery: pod {} left: worker {url} removed", o.uid),
            Err(e) => crate::log!(Warn, "discovery: removing {url}: {e}"),
        }
    }

    /// Register a Ready pod's worker; false when it failed in a way worth retrying soon.
    async fn add(&mut self, url: String, uid: String, pod: &str, role: Role) -> bool {
        match self.gw.register_worker(&self.pool, &url, role).await {
            Ok(added) => {
                let serial = added.first().map_or(0, |w| w.serial);
                crate::log!(Info, "discovery: pod {pod} ({uid}) added as {url}");
                self.owned.insert(
                    url,
                    Owned {
                        uid,
                        role,
                        held: false,
                        serial,
                    },
                );
                true
            }
            Err(RegistryError::Duplicate(_)) => {
                if self.foreign.insert(url.clone()) {
                    crate::log!(
                        Warn,
                        "discovery: pod {pod} is at {url}, which is registered by a flag or \
                         the API: left to its owner"
                    );
                }
                true
            }
            Err(e) => {
                crate::log!(Warn, "discovery: pod {pod} at {url} not added: {e}");
                false
            }
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
