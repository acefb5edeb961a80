//! The vocabulary of routing, shared by every policy and their callers: which policy runs and
//! how it is tuned, what a policy may look at for one request, and what it decides. Types only:
//! the policies import this module, `policy.rs` imports the policies, and nothing here imports
//! either (the list of policies here names their modules; `policy.rs` expands it).

use crate::base::WorkerId;
use crate::route::recent::RecentProbe;
use std::fmt;
use std::str::FromStr;

/// The one list of policies, in CLI order: each entry is the kind's doc, its `PolicyKind`
/// variant and its module under `route/policy/` (named as on the CLI, defining a type named as
/// the variant). [`PolicyKind`] below and `policy.rs`'s dispatch are both written from it, so a
/// new policy is its own file (with its `mod` line in `policy.rs`) plus one entry here. Names
/// only: nothing here imports a policy.
macro_rules! each_policy {
    ($then:ident) => {
        $then! {
            /// Uniform over eligible workers.
            Random random,
            /// Global rotation over the registered list, skipping ineligible workers.
            RoundRobin round_robin,
            /// Two distinct random workers, the less loaded wins.
            PowerOfTwo power_of_two,
            /// Prefix affinity from the radix tree, with load balancing (the default).
            CacheAware cache_aware,
            /// Sticky on `X-SMG-Routing-Key`.
            Manual manual,
            /// Hash ring on a request key (routing key, authorization, forwarded-for, cookie).
            ConsistentHashing consistent_hashing,
            /// Hash ring on the prompt's first characters, with bounded load.
            PrefixHash prefix_hash,
            /// Prompt length ranges per worker, rebalanced periodically.
            Bucket bucket,
        }
    };
}
pub(crate) use each_policy;

/// Writes [`PolicyKind`] from the list in [`each_policy`].
macro_rules! policy_kind {
    ($($(#[$doc:meta])* $kind:ident $module:ident,)*) => {
        /// Which routing policy the gateway runs (`--policy`). Names match sgl-model-gateway's
        /// CLI so existing launch scripts keep working.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum PolicyKind {
            $($(#[$doc])* $kind,)*
        }

        impl PolicyKind {
            /// Every kind, in CLI order (for `--help` and error messages).
            pub const ALL: [PolicyKind; [$(PolicyKind::$kind),*].len()] = [$(PolicyKind::$kind),*];

            /// Every kind's name, in CLI order (what a wrong `--policy` is told to pick from).
            const NAMES: [&'static str; Self::ALL.len()] = [$(stringify!($module)),*];

            /// The CLI / config / metrics name.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(PolicyKind::$kind => stringify!($module),)*
                }
            }
        }
    };
}
each_policy!(policy_kind);

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A CLI/config string that names no known policy or assignment mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseNameError {
    what: &'static str,
    value: String,
    expected: &'static [&'static str],
}

impl fmt::Display for ParseNameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown {} '{}' (expected one of: {})",
            self.what,
            self.value,
            self.expected.join(", ")
        )
    }
}

impl std::error::Error for ParseNameError {}

impl FromStr for PolicyKind {
    type Err = ParseNameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| ParseNameError {
                what: "policy",
                value: s.to_owned(),
                expected: &PolicyKind::NAMES,
            })
    }
}

/// How `manual` places a routing key it has not seen (`--assignment-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum AssignmentMode {
    /// Uniform over eligible workers (the reference default).
    #[default]
    Random,
    /// Fewest in-flight requests, random among ties.
    MinLoad,
    /// Fewest routing keys with requests in flight, random among ties.
    MinGroup,
}

impl AssignmentMode {
    /// The CLI / config name.
    pub fn as_str(self) -> &'static str {
        match self {
            AssignmentMode::Random => "random",
            AssignmentMode::MinLoad => "min_load",
            AssignmentMode::MinGroup => "min_group",
        }
    }
}

impl fmt::Display for AssignmentMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for AssignmentMode {
    type Err = ParseNameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [
            AssignmentMode::Random,
            AssignmentMode::MinLoad,
            AssignmentMode::MinGroup,
        ]
        .into_iter()
        .find(|m| m.as_str() == s)
        .ok_or_else(|| ParseNameError {
            what: "assignment mode",
            value: s.to_owned(),
            expected: &["random", "min_load", "min_group"],
        })
    }
}

/// Everything the policies can be tuned with; defaults mirror sgl-model-gateway's CLI.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyConfig {
    /// Which policy runs.
    pub kind: PolicyKind,
    /// cache_aware: match rate (matched chars / request chars) above which affinity wins.
    pub cache_threshold: f64,
    /// cache_aware: imbalanced needs `max − min >` this …
    pub balance_abs_threshold: u32,
    /// … and `max >` this × `min` (both strict).
    pub balance_rel_threshold: f64,
    /// cache_aware: when imbalanced, still prefer a prefix holder whose load is within
    /// `balance_abs_threshold` of the minimum (opt-in; the reference ignores affinity then).
    pub affinity_window: bool,
    /// manual: how a new routing key is placed.
    pub assignment_mode: AssignmentMode,
    /// manual: routing keys idle longer than this are forgotten.
    pub max_idle_secs: u64,
    /// manual: most routing keys remembered (least recently used out first).
    pub max_routing_keys: usize,
    /// prefix_hash: characters of the routing text hashed.
    pub prefix_hash_chars: usize,
    /// bucket: seconds between boundary adjustments.
    pub bucket_adjust_interval_secs: u64,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            kind: PolicyKind::CacheAware,
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            affinity_window: false,
            assignment_mode: AssignmentMode::Random,
            max_idle_secs: 14_400,
            max_routing_keys: 262_144,
            prefix_hash_chars: 1024,
            bucket_adjust_interval_secs: 5,
        }
    }
}

/// What a policy may look at for one request; everything is borrowed from the parsed request.
#[derive(Debug, Clone, Copy)]
pub struct RouteInput<'a> {
    /// Routing text (message contents, prompt …) as extracted from the body.
    pub text: &'a str,
    /// `X-SMG-Routing-Key`.
    pub routing_key: Option<&'a [u8]>,
    /// `X-SMG-Target-Worker` (0-based index into the eligible workers).
    pub target_worker: Option<&'a [u8]>,
    /// First present of `X-SMG-Routing-Key`, `authorization`, `x-forwarded-for`, `cookie`.
    pub hash_key: Option<&'a [u8]>,
    /// Workers that already failed this request (retries).
    pub exclude: &'a [WorkerId],
    /// Current time in milliseconds (any monotonic origin shared with `maintain`).
    pub now_ms: u64,
    /// cache_aware: the inserts (from every core) that the snapshot does not show yet, asked
    /// only for a match longer than the snapshot's.
    pub recent: Option<RecentProbe<'a>>,
    /// cache_aware with `--kv-events`: what the servers' own events (and the pending entries)
    /// say this prompt has cached where; `None` when the prompt has no tokens or the model no
    /// block size yet (the text tree alone decides).
    pub exact: Option<ExactInput<'a>>,
}

/// A prompt measured in tokens against the KV-event index.
#[derive(Debug, Clone, Copy)]
pub struct ExactInput<'a> {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Tokens of the prompt's prefix cached per worker (index ∪ pending entries); workers with
    /// none are absent. Any order.
    pub cached: &'a [(WorkerId, usize)],
    /// Workers whose events are complete (subscribed and warm), sorted: the index speaks for
    /// them; the text tree speaks only for the others (a mixed fleet).
    pub exact_workers: &'a [WorkerId],
    /// The caller's buffer for the winning workers (one per core, reused), so a decision
    /// allocates nothing once it has grown.
    pub holders: &'a std::cell::RefCell<Vec<WorkerId>>,
}

impl<'a> RouteInput<'a> {
    /// An input carrying only routing text and time (no headers, nothing excluded).
    pub fn new(text: &'a str, now_ms: u64) -> Self {
        RouteInput {
            text,
            routing_key: None,
            target_worker: None,
            hash_key: None,
            exclude: &[],
            now_ms,
            recent: None,
            exact: None,
        }
    }
}

/// Why a worker was chosen, for the per-branch routing metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Branch {
    /// `random` policy, or a keyless fallback to a random worker.
    Random,
    /// `round_robin`.
    RoundRobin,
    /// `power_of_two`.
    PowerOfTwo,
    /// cache_aware: match rate above threshold, sent to a prefix holder.
    CacheHit,
    /// cache_aware: low match (or no tree, or no eligible holder): least loaded.
    CacheMiss,
    /// cache_aware: load imbalance overrode affinity: least loaded.
    Imbalanced,
    /// cache_aware: imbalanced, but a prefix holder was within the window of the minimum.
    AffinityWindow,
    /// manual: the key's stored worker.
    ManualSticky,
    /// manual: a new (or re-placed, or keyless) assignment.
    ManualNew,
    /// consistent_hashing: `X-SMG-Target-Worker`.
    TargetWorker,
    /// consistent_hashing / prefix_hash: the ring's worker.
    HashRing,
    /// prefix_hash: the ring's worker was over the load bound; least loaded instead.
    HashRingOverloaded,
    /// bucket: the prompt length's range owner (or the least-loaded stand-in).
    Bucket,
}

impl Branch {
    /// The metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            Branch::Random => "random",
            Branch::RoundRobin => "round_robin",
            Branch::PowerOfTwo => "power_of_two",
            Branch::CacheHit => "cache_hit",
            Branch::CacheMiss => "cache_miss",
            Branch::Imbalanced => "imbalanced",
            Branch::AffinityWindow => "affinity_window",
            Branch::ManualSticky => "manual_sticky",
            Branch::ManualNew => "manual_new",
            Branch::TargetWorker => "target_worker",
            Branch::HashRing => "hash_ring",
            Branch::HashRingOverloaded => "hash_ring_overloaded",
            Branch::Bucket => "bucket",
        }
    }
}

impl fmt::Display for Branch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A routing decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// The chosen worker.
    pub worker: WorkerId,
    /// Why (metrics).
    pub branch: Branch,
    /// cache_aware: insert the request text under `worker` afterwards.
    pub insert_text: bool,
    /// cache_aware: characters of the text found in the tree (0 when not looked up).
    pub matched_chars: usize,
    /// cache_aware: characters of the text the tree says the *chosen* worker already holds
    /// (`matched_chars` when it is among the deepest match's holders, else 0): the gateway's
    /// prediction of that worker's cache hit, set beside the hit ratio the engines report.
    /// With KV events the exact side may decide: both then count tokens.
    pub predicted_chars: usize,
    /// cache_aware: the prompt's size in the unit of `matched_chars` and `predicted_chars`
    /// (characters of the text, or the prompt's tokens when the KV-event side decided); 0 when
    /// nothing was looked up.
    pub request_size: usize,
}

impl Decision {
    /// A decision that records nothing in the tree.
    pub fn plain(worker: WorkerId, branch: Branch) -> Self {
        Decision {
            worker,
            branch,
            insert_text: false,
            matched_chars: 0,
            predicted_chars: 0,
            request_size: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for k in PolicyKind::ALL {
            assert_eq!(k.as_str().parse::<PolicyKind>(), Ok(k));
            assert_eq!(k.to_string(), k.as_str());
        }
        let err = "cache-aware".parse::<PolicyKind>().unwrap_err().to_string();
        assert_eq!(
            err,
            "unknown policy 'cache-aware' (expected one of: random, round_robin, power_of_two, \
             cache_aware, manual, consistent_hashing, prefix_hash, bucket)"
        );
        let err = "minload".parse::<AssignmentMode>().unwrap_err().to_string();
        assert_eq!(
            err,
            "unknown assignment mode 'minload' (expected one of: random, min_load, min_group)"
        );
        for m in ["random", "min_load", "min_group"] {
            assert_eq!(m.parse::<AssignmentMode>().unwrap().as_str(), m);
        }
        assert_eq!(Branch::HashRingOverloaded.as_str(), "hash_ring_overloaded");
    }
}
