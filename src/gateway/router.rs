//! The routing state every core reads: the policy, the prefix trees (cache_aware only) behind
//! their single writer, and the ring of inserts the writer has not published yet. Cores choose
//! against a snapshot and learn by message; nothing here takes a lock on the request path.

use crate::base::rng::Rng;
use crate::base::text::SharedText;
use crate::base::WorkerId;
use crate::config::settings::RoutingSettings;
use crate::route::policy::Policy;
use crate::route::recent::{RecentInserts, RecentProbe};
use crate::route::types::{Decision, RouteInput};
use crate::tree::{spawn_writer, Insert, TreeHandle, TreeKey, WriterConfig};
use crate::workers::load::LoadBoard;
use std::time::Duration;

/// Tree inserts a starved writer may have queued: each keeps its text alive, so the backlog is
/// bounded in messages and in bytes.
const INSERT_BACKLOG: usize = 16_384;

/// Most routing-text bytes queued for the tree writer (beyond it inserts are dropped and
/// counted, like a full queue).
const INSERT_BACKLOG_BYTES: usize = 64 << 20;

/// Fleets up to this size are checked worker by worker for complete events; larger ones always
/// consult the text tree too (the check would cost more than it saves).
const ALL_EXACT_CHECK: usize = 256;

/// Every worker's events are complete (`exact` is sorted).
fn all_exact(workers: &[WorkerId], exact: &[WorkerId]) -> bool {
    workers.len() <= ALL_EXACT_CHECK
        && exact.len() >= workers.len()
        && workers.iter().all(|w| exact.binary_search(w).is_ok())
}

/// Policy, trees and unpublished inserts.
pub struct Router {
    /// The configured policy.
    pub policy: Policy,
    /// The prefix trees and their writer (cache_aware only).
    pub tree: Option<TreeHandle>,
    /// Tree inserts not yet visible in the published snapshot, shared by the cores.
    pub recent: RecentInserts,
}

impl Router {
    /// A router for `policy` (PD mode's prefill and decode sides each have their own), with
    /// `routing`'s tree settings; starts the tree writer thread when the policy reads a tree.
    pub fn new(policy: crate::route::types::PolicyConfig, routing: &RoutingSettings) -> Router {
        let policy = Policy::new(policy);
        let tree = policy.needs_tree().then(|| {
            spawn_writer(WriterConfig {
                max_chars_per_worker: routing.max_tree_chars,
                eviction_interval: routing.eviction_interval,
                overflow_margin: 0.1,
                channel_capacity: INSERT_BACKLOG,
                channel_bytes: INSERT_BACKLOG_BYTES,
                epoch: Duration::from_millis(1),
                publish_after: 1024,
            })
        });
        Router {
            policy,
            tree,
            recent: RecentInserts::default(),
        }
    }

    /// Ask the policy for a worker against the current snapshot of the request's tree (see
    /// `ServedModels::tree_key`) and the unpublished inserts. Returns the decision and the
    /// snapshot epoch it saw.
    pub fn choose<'a>(
        &'a self,
        key: TreeKey,
        mut input: RouteInput<'a>,
        workers: &[WorkerId],
        loads: &LoadBoard,
        rng: &mut Rng,
    ) -> (Option<Decision>, u64) {
        let forest = self.tree.as_ref().map(|t| t.load());
        let epoch = forest.as_ref().map_or(0, |f| f.epoch());
        // With KV events complete for every worker the text tree has no say: skip its match
        // and the scan of the unpublished inserts (it still learns, for when events stop).
        let tree_speaks = !input
            .exact
            .is_some_and(|e| all_exact(workers, e.exact_workers));
        let tree = forest.as_ref().filter(|_| tree_speaks).map(|f| f.tree(key));
        if tree.is_some() {
            input.recent = Some(RecentProbe {
                ring: &self.recent,
                tree: key,
                epoch,
            });
        }
        (self.policy.select(&input, workers, loads, tree, rng), epoch)
    }

    /// Epoch of the currently published tree snapshot (0 without a tree).
    pub fn epoch(&self) -> u64 {
        self.tree.as_ref().map_or(0, |t| t.load().epoch())
    }

    /// Record that `text` now lives on `worker`: in the shared ring at once, in the tree through
    /// the writer (never blocking: a full channel drops the insert and counts it). Both keep
    /// `text` alive, so it must not pin a whole request body (see `serve::exchange`).
    pub fn learn(&self, key: TreeKey, text: SharedText, worker: WorkerId, epoch: u64, now_ms: u64) {
        if let Some(tree) = &self.tree {
            self.recent.push(key, text.clone(), worker, epoch);
            tree.try_insert(Insert {
                tree: key,
                text,
                worker,
                now_ms,
            });
        }
    }

    /// The models the workers serve now: each gets a tree, trees of models gone are dropped.
    pub fn serve_models(&self, names: Vec<&'static str>) {
        if let Some(tree) = &self.tree {
            tree.serve_models(names);
        }
    }

    /// Unpublished inserts on `worker` must not lead the next requests back to it.
    pub fn forget_unpublished(&self, worker: WorkerId) {
        self.recent.forget_worker(worker);
    }

    /// `worker` is gone: forget its unpublished inserts, and drop its tree entries on a helper
    /// thread so no core waits on the writer's channel.
    pub fn forget_worker(&self, worker: WorkerId) {
        self.recent.forget_worker(worker);
        if let Some(tree) = self.tree.clone() {
            let spawned = std::thread::Builder::new()
                .name("radixgate-remove".into())
                .spawn(move || tree.remove_worker(worker));
            if let Err(e) = spawned {
                crate::log!(
                    Warn,
                    "cannot start the tree clean-up for worker {worker}: {e}"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn only_when_every_worker_has_complete_events() {
        assert!(all_exact(&[2, 0, 1], &[0, 1, 2, 5]));
        assert!(!all_exact(&[2, 0, 1], &[0, 2, 5]));
        assert!(!all_exact(&[0], &[]));
        let many: Vec<u32> = (0..300).collect();
        assert!(!all_exact(&many, &many), "large fleets always ask the tree");
    }

    #[test]
    fn unpublished_inserts_expire_when_no_insert_follows() {
        let cfg = <crate::config::Config as clap::Parser>::try_parse_from([
            "radixgate",
            "--policy",
            "cache_aware",
        ])
        .expect("default flags parse");
        let routing = RoutingSettings::from(&cfg);
        let r = Router::new(routing.policy.clone(), &routing);
        let text = "one prompt, routed once, then the tree idles";
        r.learn(TreeKey::Default, SharedText::copy_of(text), 3, r.epoch(), 1);
        // The writer publishes the insert and one epoch more, so the ring's entry stops
        // counting (and costing every request a compare) while nothing else is inserted.
        let until = Instant::now() + Duration::from_secs(5);
        while r
            .recent
            .longest(TreeKey::Default, text, r.epoch())
            .is_some()
        {
            assert!(Instant::now() < until, "the recent entry never expired");
            std::thread::sleep(Duration::from_millis(2));
        }
        let forest = r.tree.as_ref().expect("cache_aware has a tree").load();
        let m = forest.tree(TreeKey::Default).longest_match(text);
        assert_eq!((m.matched_bytes, m.workers), (text.len(), &[3][..]));
    }
}
