//! The routing front door: one `Policy` shared by every core picks a worker for each request.
//!
//! Each policy lives in its own file under `route/policy/` and implements [`Select`]; the list
//! of them is `types::each_policy`, from which `Active` (an enum with one variant per policy)
//! and its dispatch are written, so a call is one `match`: no allocation and no vtable on the
//! request path.
//!
//! Every policy is pure: no I/O, the clock arrives as `RouteInput::now_ms`, randomness as a
//! caller-owned `Rng` (per core, seeded in tests). Per-request work never allocates and never
//! takes a lock except `manual`'s short per-shard lock on its key map.
pub mod bucket;
pub mod cache_aware;
pub mod consistent_hashing;
pub mod manual;
pub mod power_of_two;
pub mod prefix_hash;
pub mod random;
pub mod round_robin;

use crate::base::rng::Rng;
use crate::base::WorkerId;
use crate::route::types::{each_policy, Decision, PolicyConfig, PolicyKind, RouteInput};
use crate::tree::RadixTree;
use crate::workers::load::LoadBoard;

/// What a policy is to the front door, so the gateway routes, keeps membership and runs upkeep
/// the same way whichever policy is configured. Only `from_config` and `select` are required:
/// the hooks default to doing nothing, for policies without state. `Send + Sync`: one instance
/// is shared by every core; state lives in atomics, `ArcSwap`s and short-held shard locks.
pub trait Select: Send + Sync + Sized {
    /// Built once at start-up from the configuration (its own knobs only).
    fn from_config(cfg: &PolicyConfig) -> Self;

    /// Choose a worker, or `None` when no eligible, non-excluded worker exists (→ 503).
    ///
    /// `workers`: every registered worker in registration order (eligibility comes from
    /// `loads`). `tree`: this request's model tree from the current snapshot (`None`: no tree
    /// yet for that model).
    fn select(
        &self,
        input: &RouteInput,
        workers: &[WorkerId],
        loads: &LoadBoard,
        tree: Option<&RadixTree>,
        rng: &mut Rng,
    ) -> Option<Decision>;

    /// Whether `select` reads the radix tree, so the gateway keeps one (and inserts into it)
    /// only for a policy that does.
    fn needs_tree(&self) -> bool {
        false
    }

    /// Whether `select` reads the routing text, so the body scan builds none for a policy
    /// that routes on loads, headers or turns.
    fn reads_text(&self) -> bool {
        false
    }

    /// The registered worker list changed (admin path, may allocate), by id: tests and benches
    /// name workers this way.
    fn workers_changed(&self, workers: &[WorkerId]) {
        let _ = workers;
    }

    /// The registered list changed, with each worker's stable name (its URL) so state placed by
    /// name (hash rings) agrees across gateway replicas and restarts. Others see the ids.
    fn workers_changed_named(&self, workers: &[(WorkerId, &[u8])]) {
        let ids: Vec<WorkerId> = workers.iter().map(|&(w, _)| w).collect();
        self.workers_changed(&ids);
    }

    /// A request routed with a routing key ended on `worker`, for a policy that counts keys in
    /// flight.
    fn request_finished(&self, key: &[u8], worker: WorkerId, now_ms: u64) {
        let _ = (key, worker, now_ms);
    }

    /// Periodic upkeep (~every second, one core), for a policy whose state ages or adapts.
    fn maintain(&self, now_ms: u64) {
        let _ = now_ms;
    }
}

/// Writes `Active` and its [`Select`] dispatch from the list in `types::each_policy`.
macro_rules! active_policy {
    ($($(#[$doc:meta])* $kind:ident $module:ident,)*) => {
        /// The configured policy with its state: one variant per policy.
        #[derive(Debug)]
        enum Active {
            $($(#[$doc])* $kind($module::$kind),)*
        }

        impl Select for Active {
            fn from_config(cfg: &PolicyConfig) -> Self {
                match cfg.kind {
                    $(PolicyKind::$kind => Active::$kind(<$module::$kind as Select>::from_config(cfg)),)*
                }
            }

            #[inline]
            fn select(
                &self,
                input: &RouteInput,
                workers: &[WorkerId],
                loads: &LoadBoard,
                tree: Option<&RadixTree>,
                rng: &mut Rng,
            ) -> Option<Decision> {
                match self {
                    $(Active::$kind(p) => Select::select(p, input, workers, loads, tree, rng),)*
                }
            }

            fn needs_tree(&self) -> bool {
                match self {
                    $(Active::$kind(p) => Select::needs_tree(p),)*
                }
            }

            fn reads_text(&self) -> bool {
                match self {
                    $(Active::$kind(p) => Select::reads_text(p),)*
                }
            }

            fn workers_changed(&self, workers: &[WorkerId]) {
                match self {
                    $(Active::$kind(p) => Select::workers_changed(p, workers),)*
                }
            }

            fn workers_changed_named(&self, workers: &[(WorkerId, &[u8])]) {
                match self {
                    $(Active::$kind(p) => Select::workers_changed_named(p, workers),)*
                }
            }

            fn request_finished(&self, key: &[u8], worker: WorkerId, now_ms: u64) {
                match self {
                    $(Active::$kind(p) => Select::request_finished(p, key, worker, now_ms),)*
                }
            }

            fn maintain(&self, now_ms: u64) {
                match self {
                    $(Active::$kind(p) => Select::maintain(p, now_ms),)*
                }
            }
        }
    };
}
each_policy!(active_policy);

/// The configured policy plus whatever state it keeps, behind the calls the gateway makes.
/// `Send + Sync`: one instance is shared by every core through an `Arc`.
#[derive(Debug)]
pub struct Policy {
    cfg: PolicyConfig,
    active: Active,
}

impl Policy {
    /// Build the policy and the state its kind needs (nothing for the stateless ones).
    pub fn new(cfg: PolicyConfig) -> Self {
        Policy {
            active: Active::from_config(&cfg),
            cfg,
        }
    }

    /// The configured kind.
    pub fn kind(&self) -> PolicyKind {
        self.cfg.kind
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &PolicyConfig {
        &self.cfg
    }

    /// Only cache_aware reads the radix tree (and asks for inserts); others skip the lookup.
    pub fn needs_tree(&self) -> bool {
        self.active.needs_tree()
    }

    /// Whether selection reads the routing text (the prefix for cache_aware and prefix_hash,
    /// the length for bucket). The others route on loads, headers or turns, so the body scan
    /// for them only validates and finds `model` and `stream`, building no text.
    pub fn reads_text(&self) -> bool {
        self.active.reads_text()
    }

    /// Choose a worker, or `None` when no eligible, non-excluded worker exists (→ 503). See
    /// [`Select::select`].
    #[inline]
    pub fn select(
        &self,
        input: &RouteInput,
        workers: &[WorkerId],
        loads: &LoadBoard,
        tree: Option<&RadixTree>,
        rng: &mut Rng,
    ) -> Option<Decision> {
        self.active.select(input, workers, loads, tree, rng)
    }

    /// The registered worker list changed: rebuild the hash ring / bucket ranges (admin path,
    /// may allocate).
    pub fn workers_changed(&self, workers: &[WorkerId]) {
        self.active.workers_changed(workers);
    }

    /// Like [`Policy::workers_changed`], with each worker's stable name (its URL) so hash rings
    /// agree across gateway replicas and restarts.
    pub fn workers_changed_named(&self, workers: &[(WorkerId, &[u8])]) {
        self.active.workers_changed_named(workers);
    }

    /// A request routed with `select` ended on `worker` (any outcome). Must be called once per
    /// decision made for an input with a routing key (retries included) so `manual`'s
    /// "keys in flight" counts stay right; other policies ignore it.
    pub fn request_finished(
        &self,
        input_routing_key: Option<&[u8]>,
        worker: WorkerId,
        now_ms: u64,
    ) {
        if let Some(key) = input_routing_key {
            self.active.request_finished(key, worker, now_ms);
        }
    }

    /// Periodic upkeep (~every second, one core): manual key expiry, bucket boundary moves.
    pub fn maintain(&self, now_ms: u64) {
        self.active.maintain(now_ms);
    }

    /// Routing keys currently remembered by `manual` (0 for other policies); for metrics.
    pub fn manual_keys(&self) -> usize {
        match &self.active {
            Active::Manual(m) => m.len(),
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route::types::AssignmentMode;
    use crate::workers::load::tests_support::board;

    fn policy(kind: PolicyKind) -> Policy {
        Policy::new(PolicyConfig {
            kind,
            ..PolicyConfig::default()
        })
    }

    #[test]
    fn defaults_mirror_the_reference() {
        let c = PolicyConfig::default();
        assert_eq!(c.kind, PolicyKind::CacheAware);
        assert_eq!(c.cache_threshold, 0.3);
        assert_eq!(c.balance_abs_threshold, 64);
        assert_eq!(c.balance_rel_threshold, 1.5);
        assert!(!c.affinity_window);
        assert_eq!(c.assignment_mode, AssignmentMode::Random);
        assert_eq!(c.max_idle_secs, 14_400);
        assert_eq!(c.prefix_hash_chars, 1024);
        assert_eq!(c.bucket_adjust_interval_secs, 5);
        assert!(policy(PolicyKind::CacheAware).needs_tree());
        assert!(!policy(PolicyKind::Manual).needs_tree());
    }

    #[test]
    fn each_kind_builds_its_own_policy_and_says_what_it_reads() {
        for k in PolicyKind::ALL {
            let p = policy(k);
            assert_eq!(p.kind(), k);
            assert_eq!(p.config().kind, k);
            assert_eq!(p.needs_tree(), k == PolicyKind::CacheAware, "{k}");
            let text = [
                PolicyKind::CacheAware,
                PolicyKind::PrefixHash,
                PolicyKind::Bucket,
            ];
            assert_eq!(p.reads_text(), text.contains(&k), "{k}");
        }
    }

    #[test]
    fn policy_is_send_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Policy>();
        assert_send_sync::<LoadBoard>();
    }

    #[test]
    fn only_manual_counts_keys_and_only_with_a_key() {
        let (ws, b) = board(2);
        let mut rng = Rng::with_seed(3);
        let key = b"k".as_slice();
        let input = RouteInput {
            routing_key: Some(key),
            ..RouteInput::new("", 0)
        };
        for k in PolicyKind::ALL {
            let p = policy(k);
            p.workers_changed(&ws);
            let d = p.select(&input, &ws, &b, None, &mut rng).unwrap();
            assert_eq!(p.manual_keys(), usize::from(k == PolicyKind::Manual), "{k}");
            p.request_finished(None, d.worker, 0);
            p.request_finished(Some(key), d.worker, 0);
            p.maintain(u64::MAX);
            assert_eq!(p.manual_keys(), 0, "{k}");
        }
    }

    #[test]
    fn no_eligible_worker_is_none_for_every_policy() {
        let ws: Vec<WorkerId> = (0..4).collect();
        let b = LoadBoard::new(4);
        let mut rng = Rng::with_seed(1);
        let key = b"k".as_slice();
        let input = RouteInput {
            routing_key: Some(key),
            hash_key: Some(key),
            target_worker: Some(b"0"),
            ..RouteInput::new("hello world", 0)
        };
        for k in PolicyKind::ALL {
            let p = policy(k);
            p.workers_changed(&ws);
            assert_eq!(p.select(&input, &ws, &b, None, &mut rng), None, "{k}");
        }
    }

    #[test]
    fn excluded_workers_are_skipped_by_every_policy() {
        let (ws, b) = board(3);
        let mut rng = Rng::with_seed(11);
        let key = b"user-42".as_slice();
        let exclude = [0, 2];
        let text = "a".repeat(5000);
        let input = RouteInput {
            routing_key: Some(key),
            hash_key: Some(key),
            target_worker: Some(b"2"),
            exclude: &exclude,
            ..RouteInput::new(&text, 0)
        };
        for k in PolicyKind::ALL {
            let p = policy(k);
            p.workers_changed(&ws);
            for _ in 0..50 {
                let d = p.select(&input, &ws, &b, None, &mut rng).unwrap();
                assert_eq!(d.worker, 1, "{k}: {d:?}");
                p.request_finished(Some(key), d.worker, 0);
            }
        }
    }
}
