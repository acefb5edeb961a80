//! The routing front door: one `Policy` shared by every core picks a worker for each request.
//!
//! Every policy here is pure: no I/O, the clock arrives as `RouteInput::now_ms`, randomness as a
//! caller-owned `Rng` (per core, seeded in tests). Per-request work never allocates and never
//! takes a lock except `manual`'s short per-shard lock on its key map.
use crate::base::rng::Rng;
use crate::base::WorkerId;
use crate::route::types::{Branch, Decision, PolicyConfig, PolicyKind, RouteInput};
use crate::route::{bucket, cache_aware, hashing, manual};
use crate::tree::RadixTree;
use crate::workers::load::LoadBoard;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// An atomic alone on its cache line (the round-robin cursor is bumped by every core).
#[repr(align(64))]
#[derive(Debug, Default)]
struct PaddedCounter(AtomicUsize);

/// The configured policy plus whatever state it keeps. `Send + Sync`: one instance is shared by
/// every core through an `Arc`; state lives in atomics, `ArcSwap`s and short-held shard locks.
#[derive(Debug)]
pub struct Policy {
    cfg: PolicyConfig,
    cache_aware: cache_aware::Params,
    rr: PaddedCounter,
    manual: Option<manual::ManualState>,
    ring: Option<hashing::RingCell>,
    bucket: Option<bucket::BucketState>,
}

impl Policy {
    /// Build the policy and the state its kind needs (nothing for the stateless ones).
    pub fn new(cfg: PolicyConfig) -> Self {
        let kind = cfg.kind;
        Policy {
            cache_aware: cache_aware::Params::from_config(&cfg),
            rr: PaddedCounter::default(),
            manual: (kind == PolicyKind::Manual).then(|| {
                manual::ManualState::new(
                    cfg.assignment_mode,
                    cfg.max_idle_secs,
                    cfg.max_routing_keys,
                )
            }),
            ring: matches!(kind, PolicyKind::ConsistentHashing | PolicyKind::PrefixHash)
                .then(hashing::RingCell::default),
            bucket: (kind == PolicyKind::Bucket)
                .then(|| bucket::BucketState::new(cfg.bucket_adjust_interval_secs)),
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
        self.cfg.kind == PolicyKind::CacheAware
    }

    /// Whether selection reads the routing text (the prefix for cache_aware and prefix_hash,
    /// the length for bucket). The others route on loads, headers or turns, so the body scan
    /// for them only validates and finds `model` and `stream`, building no text.
    pub fn reads_text(&self) -> bool {
        matches!(
            self.cfg.kind,
            PolicyKind::CacheAware | PolicyKind::PrefixHash | PolicyKind::Bucket
        )
    }

    /// Choose a worker, or `None` when no eligible, non-excluded worker exists (→ 503).
    ///
    /// `workers`: every registered worker in registration order (eligibility comes from
    /// `loads`). `tree`: this request's model tree from the current snapshot (`None`: no tree
    /// yet for that model).
    pub fn select(
        &self,
        input: &RouteInput,
        workers: &[WorkerId],
        loads: &LoadBoard,
        tree: Option<&RadixTree>,
        rng: &mut Rng,
    ) -> Option<Decision> {
        let exclude = input.exclude;
        match self.cfg.kind {
            PolicyKind::Random => loads
                .pick_random_eligible(workers, exclude, rng)
                .map(|w| Decision::plain(w, Branch::Random)),
            PolicyKind::RoundRobin => self.round_robin(workers, exclude, loads),
            PolicyKind::PowerOfTwo => power_of_two(workers, exclude, loads, rng),
            PolicyKind::CacheAware => {
                let prefix = cache_aware::Lookup {
                    text: input.text,
                    tree,
                    recent: input.recent.as_ref(),
                };
                if let Some(exact) = input.exact {
                    return cache_aware::select_mixed(
                        &self.cache_aware,
                        exact,
                        prefix,
                        workers,
                        exclude,
                        loads,
                        rng,
                    );
                }
                cache_aware::select_with_tree(
                    &self.cache_aware,
                    prefix,
                    workers,
                    exclude,
                    loads,
                    rng,
                )
            }
            PolicyKind::Manual => self.manual.as_ref()?.select(
                input.routing_key,
                workers,
                exclude,
                loads,
                input.now_ms,
                rng,
            ),
            PolicyKind::ConsistentHashing => {
                hashing::select_consistent(self.ring.as_ref()?, input, workers, loads, rng)
            }
            PolicyKind::PrefixHash => hashing::select_prefix(
                self.ring.as_ref()?,
                input,
                self.cfg.prefix_hash_chars,
                workers,
                loads,
                rng,
            ),
            PolicyKind::Bucket => self
                .bucket
                .as_ref()?
                .select(input.text, workers, exclude, loads, rng),
        }
    }

    /// The registered worker list changed: rebuild the hash ring / bucket ranges (admin path,
    /// may allocate).
    pub fn workers_changed(&self, workers: &[WorkerId]) {
        if let Some(ring) = &self.ring {
            ring.rebuild(workers);
        }
        if let Some(b) = &self.bucket {
            b.workers_changed(workers);
        }
    }

    /// Like [`Policy::workers_changed`], with each worker's stable name (its URL) so hash rings
    /// agree across gateway replicas and restarts.
    pub fn workers_changed_named(&self, workers: &[(WorkerId, &[u8])]) {
        if let Some(ring) = &self.ring {
            ring.rebuild_named(workers);
        }
        if let Some(b) = &self.bucket {
            let ids: Vec<WorkerId> = workers.iter().map(|&(w, _)| w).collect();
            b.workers_changed(&ids);
        }
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
        if let (Some(m), Some(key)) = (&self.manual, input_routing_key) {
            m.request_finished(key, worker, now_ms);
        }
    }

    /// Periodic upkeep (~every second, one core): manual key expiry, bucket boundary moves.
    pub fn maintain(&self, now_ms: u64) {
        if let Some(m) = &self.manual {
            m.expire(now_ms);
        }
        if let Some(b) = &self.bucket {
            b.maintain(now_ms);
        }
    }

    /// Routing keys currently remembered by `manual` (0 for other policies); for metrics.
    pub fn manual_keys(&self) -> usize {
        self.manual.as_ref().map_or(0, |m| m.len())
    }

    /// Round robin over the registered list; ineligible/excluded workers are skipped, and the
    /// walk is bounded by one lap.
    fn round_robin(
        &self,
        workers: &[WorkerId],
        exclude: &[WorkerId],
        loads: &LoadBoard,
    ) -> Option<Decision> {
        let n = workers.len();
        if n == 0 {
            return None;
        }
        let start = self.rr.0.fetch_add(1, Relaxed) % n;
        (0..n)
            .map(|i| workers[(start + i) % n])
            .find(|&w| loads.selectable(w, exclude))
            .map(|w| Decision::plain(w, Branch::RoundRobin))
    }
}

/// Two distinct random eligible workers; the one with fewer in flight wins (the first on a
/// tie, which is itself random). One eligible worker → that one.
fn power_of_two(
    workers: &[WorkerId],
    exclude: &[WorkerId],
    loads: &LoadBoard,
    rng: &mut Rng,
) -> Option<Decision> {
    let a = loads.pick_random_eligible(workers, exclude, rng)?;
    let b = loads.pick_random_where(workers, rng, |w| w != a && !exclude.contains(&w));
    let w = match b {
        Some(b) if loads.load(b) < loads.load(a) => b,
        _ => a,
    };
    Some(Decision::plain(w, Branch::PowerOfTwo))
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
    fn policy_is_send_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Policy>();
        assert_send_sync::<LoadBoard>();
    }

    #[test]
    fn random_is_uniform_and_skips() {
        let (ws, b) = board(5);
        b.set_eligible(4, false);
        let p = policy(PolicyKind::Random);
        let mut rng = Rng::with_seed(1);
        let mut seen = [0u32; 5];
        let exclude = [0];
        let mut input = RouteInput::new("x", 0);
        input.exclude = &exclude;
        for _ in 0..3_000 {
            let d = p.select(&input, &ws, &b, None, &mut rng).unwrap();
            assert_eq!(d.branch, Branch::Random);
            assert!(!d.insert_text);
            seen[d.worker as usize] += 1;
        }
        assert_eq!((seen[0], seen[4]), (0, 0));
        assert!(seen[1..4].iter().all(|&c| c > 850), "{seen:?}");
    }

    #[test]
    fn round_robin_rotates_and_skips_within_one_lap() {
        let (ws, b) = board(4);
        let p = policy(PolicyKind::RoundRobin);
        let mut rng = Rng::with_seed(1);
        let input = RouteInput::new("", 0);
        let got: Vec<WorkerId> = (0..8)
            .map(|_| p.select(&input, &ws, &b, None, &mut rng).unwrap().worker)
            .collect();
        assert_eq!(got, [0, 1, 2, 3, 0, 1, 2, 3]);
        b.set_eligible(1, false);
        let exclude = [2];
        let input = RouteInput {
            exclude: &exclude,
            ..input
        };
        let got: Vec<WorkerId> = (0..4)
            .map(|_| p.select(&input, &ws, &b, None, &mut rng).unwrap().worker)
            .collect();
        // Cursor 8..12 → starts 0,1,2,3; 1 is ineligible and 2 excluded, so both walk on to 3.
        assert_eq!(got, [0, 3, 3, 3]);
        b.set_eligible(0, false);
        b.set_eligible(3, false);
        assert_eq!(p.select(&input, &ws, &b, None, &mut rng), None);
        assert_eq!(p.select(&input, &[], &b, None, &mut rng), None);
    }

    #[test]
    fn power_of_two_prefers_the_lighter_of_two_distinct() {
        let (ws, b) = board(2);
        for _ in 0..3 {
            b.inc(0);
        }
        let p = policy(PolicyKind::PowerOfTwo);
        let mut rng = Rng::with_seed(5);
        let input = RouteInput::new("", 0);
        // With two workers both are always sampled, so the lighter always wins.
        for _ in 0..100 {
            let d = p.select(&input, &ws, &b, None, &mut rng).unwrap();
            assert_eq!((d.worker, d.branch), (1, Branch::PowerOfTwo));
        }
        // One eligible (the other excluded) → it, even though it is heavier.
        let exclude = [1];
        let input2 = RouteInput {
            exclude: &exclude,
            ..input
        };
        assert_eq!(
            p.select(&input2, &ws, &b, None, &mut rng).unwrap().worker,
            0
        );
        b.set_eligible(0, false);
        assert_eq!(p.select(&input2, &ws, &b, None, &mut rng), None);
        // Many workers: never the single heaviest unless it is the only choice.
        let (ws, b) = board(10);
        for _ in 0..5 {
            b.inc(7);
        }
        for _ in 0..500 {
            assert_ne!(p.select(&input, &ws, &b, None, &mut rng).unwrap().worker, 7);
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
