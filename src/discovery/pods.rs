//! Pods → the workers they should be (pure: no client, no clock). The reconcile loop compares
//! this desired set with the workers discovery registered; keeping the rule here, on plain
//! data, lets the unit tests cover every pod state without an API server.

use crate::workers::role::Role;
use k8s_openapi::api::core::v1::Pod;
use std::collections::BTreeMap;

/// The annotation listing a pod's data ports (`8000,8001`): one worker per port, for pods that
/// run several servers (the reference's SMG name, so the same manifests work).
pub const WORKER_PORTS_ANNOTATION: &str = "smg.ai/worker-ports";

/// What discovery reads of a pod: the few fields the rule needs, copied out of the API object
/// so the rule is tested on plain values.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodView {
    /// `namespace/name`, for log lines.
    pub name: String,
    /// `metadata.uid`: a pod recreated at the same IP has a new one.
    pub uid: Option<String>,
    /// `status.podIP` (none until scheduled and networked).
    pub ip: Option<String>,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
    /// `metadata.annotations`.
    pub annotations: BTreeMap<String, String>,
    /// `metadata.deletionTimestamp` is set: the grace period has begun.
    pub terminating: bool,
    /// `status.phase` (`Pending`, `Running`, `Succeeded`, `Failed`, `Unknown`).
    pub phase: Option<String>,
    /// `status.conditions[type=Ready].status == "True"`.
    pub ready_condition: bool,
}

impl PodView {
    /// Copy the fields discovery reads out of an API pod.
    pub fn from_pod(pod: &Pod) -> PodView {
        let meta = &pod.metadata;
        let status = pod.status.as_ref();
        let ready_condition = status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        PodView {
            name: format!(
                "{}/{}",
                meta.namespace.as_deref().unwrap_or(""),
                meta.name.as_deref().unwrap_or("")
            ),
            uid: meta.uid.clone().filter(|u| !u.is_empty()),
            ip: status
                .and_then(|s| s.pod_ip.clone())
                .filter(|ip| !ip.is_empty()),
            labels: meta.labels.clone().unwrap_or_default(),
            annotations: meta.annotations.clone().unwrap_or_default(),
            terminating: meta.deletion_timestamp.is_some(),
            phase: status.and_then(|s| s.phase.clone()),
            ready_condition,
        }
    }

    /// Ready to serve: the Ready condition is true and the pod is Running (the reference's
    /// rule; a pod can report Ready while its phase lags).
    pub fn is_ready(&self) -> bool {
        self.ready_condition && self.phase.as_deref() == Some("Running")
    }

    /// A pod that will never serve again (its containers ended): it leaves like a deleted one.
    fn is_finished(&self) -> bool {
        matches!(self.phase.as_deref(), Some("Succeeded" | "Failed"))
    }
}

/// A label selector: every `key=value` pair must be among the pod's labels.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Labels(pub Vec<(String, String)>);

impl Labels {
    /// From `KEY=VALUE` strings (split at the first `=`; the flags are checked by the parser).
    pub fn parse(pairs: &[String]) -> Labels {
        Labels(
            pairs
                .iter()
                .filter_map(|p| p.split_once('='))
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                .collect(),
        )
    }

    /// Whether every pair is among `labels` (an empty selector matches nothing: the reference
    /// includes no pod rather than every pod in the cluster).
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        !self.0.is_empty()
            && self
                .0
                .iter()
                .all(|(k, v)| labels.get(k).is_some_and(|have| have == v))
    }

    /// The pairs in both selectors (what every pod of either role carries).
    fn common(&self, other: &Labels) -> Labels {
        Labels(
            self.0
                .iter()
                .filter(|p| other.0.contains(p))
                .cloned()
                .collect(),
        )
    }

    /// `k=v,k2=v2`, the API server's `labelSelector` syntax.
    fn to_query(&self) -> String {
        let pairs: Vec<String> = self.0.iter().map(|(k, v)| format!("{k}={v}")).collect();
        pairs.join(",")
    }
}

/// Which pods are workers, and in which role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// Regular workers: pods matching `--selector`.
    Regular(Labels),
    /// `--pd-disaggregation`: prefill pods match `prefill`, decode pods `decode` (first match in
    /// that order); `base` (`--selector`, may be empty) must match too when given.
    Pd {
        base: Labels,
        prefill: Labels,
        decode: Labels,
    },
}

/// A pod's role before its bootstrap port is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Regular,
    Prefill,
    Decode,
}

impl Selection {
    /// The role a pod with these labels plays, if it is a worker at all.
    fn kind_of(&self, labels: &BTreeMap<String, String>) -> Option<Kind> {
        match self {
            Selection::Regular(sel) => sel.matches(labels).then_some(Kind::Regular),
            Selection::Pd {
                base,
                prefill,
                decode,
            } => {
                if !base.0.is_empty() && !base.matches(labels) {
                    None
                } else if prefill.matches(labels) {
                    Some(Kind::Prefill)
                } else if decode.matches(labels) {
                    Some(Kind::Decode)
                } else {
                    None
                }
            }
        }
    }

    /// The label selector sent to the API server (so it sends only candidate pods), or `None`
    /// when no pod can match (no selector given): then nothing is watched at all.
    pub fn server_selector(&self) -> Option<String> {
        match self {
            Selection::Regular(sel) if sel.0.is_empty() => None,
            Selection::Regular(sel) => Some(sel.to_query()),
            Selection::Pd {
                prefill, decode, ..
            } if prefill.0.is_empty() && decode.0.is_empty() => None,
            Selection::Pd {
                base,
                prefill,
                decode,
            } => {
                // Labels every candidate carries: the role selectors' common pairs (a role
                // without a selector has no pods, so the other's pairs all hold), and --selector.
                let mut common = match (prefill.0.is_empty(), decode.0.is_empty()) {
                    (true, _) => decode.clone(),
                    (_, true) => prefill.clone(),
                    _ => prefill.common(decode),
                };
                for p in &base.0 {
                    if !common.0.contains(p) {
                        common.0.push(p.clone());
                    }
                }
                Some(common.to_query())
            }
        }
    }
}

/// The worker a pod should be, keyed by its URL in the desired set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Desired {
    /// The pod's uid: a new uid at the same URL is a new pod (replace the worker).
    pub uid: String,
    /// `namespace/name`, for log lines.
    pub pod: String,
    /// Regular, or the PD role with the prefill pod's bootstrap port.
    pub role: Role,
    /// Ready and Running: added when not yet registered, released when held.
    pub ready: bool,
}

/// How pods become workers: which pods, on which port, with which bootstrap annotation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// Which pods, and their roles.
    pub selection: Selection,
    /// `--service-discovery-port`: the worker port of pods without the ports annotation.
    pub port: u16,
    /// `--bootstrap-port-annotation`.
    pub bootstrap_annotation: String,
    /// `--service-discovery-max-ports-per-pod`: the ports past it in the annotation are refused.
    pub max_ports: usize,
}

/// A pod that listed more worker ports than [`Rule::max_ports`]: its first ones are taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TooManyPorts {
    /// The pod's uid (reported once per pod).
    pub uid: String,
    /// `namespace/name`, for the log line.
    pub pod: String,
    /// Distinct ports left out.
    pub refused: usize,
}

/// The desired set and what the rule refused on the way.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Wanted {
    /// {url → the worker it should be}.
    pub workers: BTreeMap<String, Desired>,
    /// Pods whose ports annotation was cut at [`Rule::max_ports`].
    pub too_many_ports: Vec<TooManyPorts>,
}

impl Rule {
    /// The desired set {url → pod} for these pods: every live (not terminating, not finished)
    /// pod with a uid and an IP that the selection takes, one entry per worker port, ready or
    /// not (a not-ready pod's worker is kept but held; it is only *added* once ready). When two
    /// pods claim one URL (an IP reused before the old pod is gone), the ready one wins.
    pub fn desired<'p>(
        &self,
        pods: impl IntoIterator<Item = &'p PodView>,
    ) -> BTreeMap<String, Desired> {
        self.wanted(pods).workers
    }

    /// [`Rule::desired`], with the pods whose ports annotation was cut.
    pub fn wanted<'p>(&self, pods: impl IntoIterator<Item = &'p PodView>) -> Wanted {
        let mut out: BTreeMap<String, Desired> = BTreeMap::new();
        let mut too_many_ports = Vec::new();
        for pod in pods {
            if pod.terminating || pod.is_finished() {
                continue;
            }
            let (Some(uid), Some(ip)) = (&pod.uid, &pod.ip) else {
                continue;
            };
            let Some(kind) = self.selection.kind_of(&pod.labels) else {
                continue;
            };
            let (ports, refused) = worker_ports(pod, self.port, self.max_ports);
            if refused > 0 {
                too_many_ports.push(TooManyPorts {
                    uid: uid.clone(),
                    pod: pod.name.clone(),
                    refused,
                });
            }
            let bootstrap = bootstrap_ports(pod, &self.bootstrap_annotation);
            for (i, port) in ports.iter().enumerate() {
                let role = match kind {
                    Kind::Regular => Role::Regular,
                    Kind::Decode => Role::Decode,
                    Kind::Prefill => Role::Prefill {
                        bootstrap_port: match bootstrap.as_slice() {
                            [one] => Some(*one),
                            many => many.get(i).copied(),
                        },
                    },
                };
                let want = Desired {
                    uid: uid.clone(),
                    pod: pod.name.clone(),
                    role,
                    ready: pod.is_ready(),
                };
                let url = worker_url(ip, *port);
                match out.get(&url) {
                    Some(have) if have.ready || !want.ready => {}
                    _ => {
                        out.insert(url, want);
                    }
                }
            }
        }
        Wanted {
            workers: out,
            too_many_ports,
        }
    }
}

/// `http://IP:PORT` (IPv6 in brackets).
pub fn worker_url(ip: &str, port: u16) -> String {
    if ip.contains(':') {
        format!("http://[{ip}]:{port}")
    } else {
        format!("http://{ip}:{port}")
    }
}

/// A comma list of port numbers; entries that are not ports are left out.
fn port_list(v: &str) -> Vec<u16> {
    v.split(',')
        .filter_map(|p| p.trim().parse::<u16>().ok())
        .filter(|&p| p > 0)
        .collect()
}

/// The pod's worker ports: the first `max` distinct ports of the `smg.ai/worker-ports` list,
/// else the default port; with the number of distinct ports left out.
fn worker_ports(pod: &PodView, default: u16, max: usize) -> (Vec<u16>, usize) {
    let mut ports = Vec::new();
    let mut refused = 0;
    if let Some(v) = pod.annotations.get(WORKER_PORTS_ANNOTATION) {
        let mut seen = std::collections::BTreeSet::new();
        for p in port_list(v) {
            if !seen.insert(p) {
                continue;
            }
            if ports.len() < max {
                ports.push(p);
            } else {
                refused += 1;
            }
        }
    }
    if ports.is_empty() {
        ports.push(default);
    }
    (ports, refused)
}

/// A prefill pod's bootstrap port(s): one for all its workers, or one per worker port.
fn bootstrap_ports(pod: &PodView, annotation: &str) -> Vec<u16> {
    pod.annotations
        .get(annotation)
        .map(|v| port_list(v))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, ip: &str, labels: &[(&str, &str)]) -> PodView {
        PodView {
            name: format!("ns/{name}"),
            uid: Some(format!("uid-{name}")),
            ip: Some(ip.to_string()),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            annotations: BTreeMap::new(),
            terminating: false,
            phase: Some("Running".into()),
            ready_condition: true,
        }
    }

    fn regular(sel: &[&str]) -> Rule {
        let pairs: Vec<String> = sel.iter().map(|s| s.to_string()).collect();
        Rule {
            selection: Selection::Regular(Labels::parse(&pairs)),
            port: 8000,
            bootstrap_annotation: "sglang.ai/bootstrap-port".into(),
            max_ports: 8,
        }
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn only_live_pods_with_a_uid_and_an_ip_that_match_are_wanted() {
        let rule = regular(&["app=sglang"]);
        let ok = pod("a", "10.0.0.1", &[("app", "sglang"), ("x", "y")]);
        let other = pod("b", "10.0.0.2", &[("app", "other")]);
        let mut no_ip = pod("c", "10.0.0.3", &[("app", "sglang")]);
        no_ip.ip = None;
        let mut no_uid = pod("d", "10.0.0.4", &[("app", "sglang")]);
        no_uid.uid = None;
        let mut terminating = pod("e", "10.0.0.5", &[("app", "sglang")]);
        terminating.terminating = true;
        let mut failed = pod("f", "10.0.0.6", &[("app", "sglang")]);
        failed.phase = Some("Failed".into());
        let mut succeeded = pod("g", "10.0.0.7", &[("app", "sglang")]);
        succeeded.phase = Some("Succeeded".into());
        let d = rule.desired([
            &ok,
            &other,
            &no_ip,
            &no_uid,
            &terminating,
            &failed,
            &succeeded,
        ]);
        assert_eq!(d.keys().collect::<Vec<_>>(), vec!["http://10.0.0.1:8000"]);
        let w = &d["http://10.0.0.1:8000"];
        assert_eq!(
            (w.uid.as_str(), w.role, w.ready),
            ("uid-a", Role::Regular, true)
        );
    }

    #[test]
    fn readiness_needs_the_ready_condition_and_the_running_phase() {
        let rule = regular(&["app=sglang"]);
        let mut unready = pod("a", "10.0.0.1", &[("app", "sglang")]);
        unready.ready_condition = false;
        let mut pending = pod("b", "10.0.0.2", &[("app", "sglang")]);
        pending.phase = Some("Pending".into());
        let mut unknown = pod("c", "10.0.0.3", &[("app", "sglang")]);
        unknown.phase = None;
        let d = rule.desired([&unready, &pending, &unknown]);
        assert_eq!(
            d.len(),
            3,
            "not-ready pods stay in the set (held, not removed)"
        );
        assert!(d.values().all(|w| !w.ready));
    }

    #[test]
    fn all_selector_pairs_must_match_and_an_empty_selector_matches_nothing() {
        let two = regular(&["app=sglang", "tier=gpu"]);
        let both = pod("a", "10.0.0.1", &[("app", "sglang"), ("tier", "gpu")]);
        let one = pod("b", "10.0.0.2", &[("app", "sglang")]);
        assert_eq!(two.desired([&both, &one]).len(), 1);
        let empty = regular(&[]);
        assert!(empty.desired([&both, &one]).is_empty());
        assert_eq!(empty.selection.server_selector(), None);
        assert_eq!(
            two.selection.server_selector().as_deref(),
            Some("app=sglang,tier=gpu")
        );
        // Split at the first `=`: the value may hold one.
        let eq = regular(&["k=a=b"]);
        assert!(eq.desired([&pod("c", "10.0.0.3", &[("k", "a=b")])]).len() == 1);
    }

    #[test]
    fn the_ports_annotation_gives_one_worker_per_port() {
        let rule = regular(&["app=sglang"]);
        let mut p = pod("a", "10.0.0.1", &[("app", "sglang")]);
        p.annotations.insert(
            WORKER_PORTS_ANNOTATION.into(),
            "30000, 30001,x,0,30001".into(),
        );
        let d = rule.desired([&p]);
        assert_eq!(
            d.keys().collect::<Vec<_>>(),
            vec!["http://10.0.0.1:30000", "http://10.0.0.1:30001"]
        );
        assert!(rule.wanted([&p]).too_many_ports.is_empty());
        // IPv6 pods get brackets.
        let v6 = pod("b", "fd00::1", &[("app", "sglang")]);
        assert!(rule.desired([&v6]).contains_key("http://[fd00::1]:8000"));
    }

    #[test]
    fn a_pod_gets_at_most_max_ports_workers_and_the_rest_is_reported() {
        let rule = regular(&["app=sglang"]);
        let mut big = pod("big", "10.0.0.1", &[("app", "sglang")]);
        // 98 KB of ports, the first one repeated: 16,383 distinct ports.
        let list: Vec<String> = (1..=16_384u32)
            .map(|p| (p % 16_383 + 1).to_string())
            .collect();
        big.annotations
            .insert(WORKER_PORTS_ANNOTATION.into(), list.join(","));
        let honest = pod("ok", "10.0.0.2", &[("app", "sglang")]);
        let w = rule.wanted([&big, &honest]);
        let big_urls: Vec<&String> = w
            .workers
            .keys()
            .filter(|u| u.starts_with("http://10.0.0.1:"))
            .collect();
        assert_eq!(big_urls.len(), 8, "the first 8 distinct ports");
        for p in 2..=9 {
            assert!(
                w.workers.contains_key(&format!("http://10.0.0.1:{p}")),
                "{p}"
            );
        }
        assert!(w.workers.contains_key("http://10.0.0.2:8000"));
        assert_eq!(
            w.too_many_ports,
            vec![TooManyPorts {
                uid: "uid-big".into(),
                pod: "ns/big".into(),
                refused: 16_383 - 8,
            }]
        );
        // A pod listing exactly the cap is not reported.
        let mut eight = pod("eight", "10.0.0.3", &[("app", "sglang")]);
        eight
            .annotations
            .insert(WORKER_PORTS_ANNOTATION.into(), "1,2,3,4,5,6,7,8,8".into());
        let w = rule.wanted([&eight]);
        assert_eq!(w.workers.len(), 8);
        assert!(w.too_many_ports.is_empty());
    }

    #[test]
    fn pd_roles_come_from_the_first_matching_selector_with_the_bootstrap_annotation() {
        let rule = Rule {
            selection: Selection::Pd {
                base: Labels::default(),
                prefill: Labels::parse(&strings(&["app=sgl", "role=prefill"])),
                decode: Labels::parse(&strings(&["app=sgl", "role=decode"])),
            },
            port: 8000,
            bootstrap_annotation: "sglang.ai/bootstrap-port".into(),
            max_ports: 8,
        };
        assert_eq!(rule.selection.server_selector().as_deref(), Some("app=sgl"));
        let mut p = pod("p", "10.0.0.1", &[("app", "sgl"), ("role", "prefill")]);
        p.annotations
            .insert("sglang.ai/bootstrap-port".into(), "8998".into());
        let mut multi = pod("m", "10.0.0.2", &[("app", "sgl"), ("role", "prefill")]);
        multi
            .annotations
            .insert(WORKER_PORTS_ANNOTATION.into(), "8000,8001".into());
        multi
            .annotations
            .insert("sglang.ai/bootstrap-port".into(), "9000,9001".into());
        let bare = pod("b", "10.0.0.3", &[("app", "sgl"), ("role", "prefill")]);
        let d_pod = pod("d", "10.0.0.4", &[("app", "sgl"), ("role", "decode")]);
        let neither = pod("n", "10.0.0.5", &[("app", "sgl")]);
        let d = rule.desired([&p, &multi, &bare, &d_pod, &neither]);
        let role = |u: &str| d[u].role;
        let prefill = |bp| Role::Prefill { bootstrap_port: bp };
        assert_eq!(role("http://10.0.0.1:8000"), prefill(Some(8998)));
        assert_eq!(role("http://10.0.0.2:8000"), prefill(Some(9000)));
        assert_eq!(role("http://10.0.0.2:8001"), prefill(Some(9001)));
        assert_eq!(role("http://10.0.0.3:8000"), prefill(None));
        assert_eq!(role("http://10.0.0.4:8000"), Role::Decode);
        assert_eq!(d.len(), 5, "a pod of neither role is not a worker");
        // A decode pod's bootstrap annotation means nothing.
        let mut d2 = d_pod.clone();
        d2.annotations
            .insert("sglang.ai/bootstrap-port".into(), "1".into());
        assert_eq!(
            rule.desired([&d2])["http://10.0.0.4:8000"].role,
            Role::Decode
        );
        // --selector narrows the PD pods and joins the server-side selector.
        let narrowed = Rule {
            selection: Selection::Pd {
                base: Labels::parse(&strings(&["zone=a"])),
                prefill: Labels::parse(&strings(&["role=prefill"])),
                decode: Labels::default(),
            },
            ..rule.clone()
        };
        assert_eq!(
            narrowed.selection.server_selector().as_deref(),
            Some("role=prefill,zone=a")
        );
        assert!(narrowed.desired([&p]).is_empty());
    }

    #[test]
    fn a_reused_ip_goes_to_the_ready_pod() {
        let rule = regular(&["app=sglang"]);
        let old = pod("old", "10.0.0.1", &[("app", "sglang")]);
        let mut new = pod("new", "10.0.0.1", &[("app", "sglang")]);
        new.ready_condition = false;
        assert_eq!(
            rule.desired([&old, &new])["http://10.0.0.1:8000"].uid,
            "uid-old"
        );
        assert_eq!(
            rule.desired([&new, &old])["http://10.0.0.1:8000"].uid,
            "uid-old"
        );
    }

    #[test]
    fn api_pods_are_read_field_by_field() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "w", "namespace": "ns", "uid": "u1",
                          "labels": {"app": "x"}, "annotations": {"a": "b"},
                          "deletionTimestamp": "2026-01-01T00:00:00Z"},
            "status": {"phase": "Running", "podIP": "10.1.2.3",
                       "conditions": [{"type": "PodScheduled", "status": "True"},
                                      {"type": "Ready", "status": "True"}]}
        }))
        .unwrap();
        let v = PodView::from_pod(&pod);
        assert_eq!(v.name, "ns/w");
        assert_eq!(v.uid.as_deref(), Some("u1"));
        assert_eq!(v.ip.as_deref(), Some("10.1.2.3"));
        assert!(v.terminating && v.is_ready());
        assert_eq!(v.labels["app"], "x");
        let bare: Pod =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "w"}})).unwrap();
        let v = PodView::from_pod(&bare);
        assert!(v.uid.is_none() && v.ip.is_none() && !v.is_ready() && !v.terminating);
    }
}
