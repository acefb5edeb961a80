//! manual: sticky routing on `X-SMG-Routing-Key`, so a client can pin a conversation to one
//! worker (and its KV cache) explicitly. It exists for clients that know their sessions better
//! than any prefix match can guess (agents whose turns diverge early, tools that rewrite the
//! prompt): the key, not the text, says which requests belong together.
//!
//! * State: a 64-bit hash of the routing key → (worker, last access, requests in flight), in 16
//!   shards of `Mutex<HashMap>` chosen by that hash; a lock is held only for one lookup/update
//!   (plus a placement scan for a new key). Keys are never stored, so an entry costs the same
//!   whatever the key's length; keys longer than [`MAX_ROUTING_KEY_LEN`] are refused (400) before
//!   routing.
//! * The map holds at most `max_keys` keys (`--max-routing-keys`): a full shard first drops its
//!   least recently used eighth (keys with requests in flight are kept).
//! * A key seen for the first time is placed by the assignment mode: `random`, `min_load`
//!   (fewest in-flight requests) or `min_group` (fewest routing keys with requests in flight);
//!   ties are random.
//! * A stored worker that became ineligible, or is excluded for this request (a retry), is
//!   replaced by a fresh placement, and the map follows.
//! * Keys idle longer than `max_idle_secs` are dropped by `expire` (from `maintain`).
//! * Requests without the header are placed fresh every time and not stored.
use crate::base::rng::Rng;
use crate::base::WorkerId;
use crate::route::policy::Select;
use crate::route::ring::hash64;
use crate::route::types::{AssignmentMode, Branch, Decision, PolicyConfig, RouteInput};
use crate::tree::RadixTree;
use crate::workers::load::LoadBoard;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// Number of key-map shards (a power of two).
const SHARDS: usize = 16;

/// Longest `X-SMG-Routing-Key` accepted, in bytes; longer keys are answered 400. Conversation
/// and session ids are far shorter; the limit keeps hostile headers out of every key path.
pub const MAX_ROUTING_KEY_LEN: usize = 256;

/// The error a too-long routing key gets (400).
pub fn key_too_long(len: usize) -> String {
    format!("X-SMG-Routing-Key is {len} bytes long; the limit is {MAX_ROUTING_KEY_LEN} bytes")
}

/// What is remembered per routing key.
#[derive(Debug, Clone, Copy)]
struct Entry {
    worker: WorkerId,
    last_access_ms: u64,
    /// Requests with this key currently in flight; the key counts as an active group of
    /// `worker` while this is non-zero.
    in_flight: u32,
}

/// Key hash → entry. A 64-bit hash collides with odds of about n²/2⁶⁵ (nil at the cap), and a
/// collision only makes two keys share a worker.
type Shard = HashMap<u64, Entry>;

/// The manual policy: the key map, shared by every core.
#[derive(Debug)]
pub struct Manual {
    shards: Box<[Mutex<Shard>]>,
    mode: AssignmentMode,
    max_idle_ms: u64,
    /// Most keys per shard (the cap over all shards / `SHARDS`, at least 1).
    shard_cap: usize,
    /// Per worker id: routing keys assigned to it with requests in flight (`min_group`). Sized
    /// from the `LoadBoard` capacity on first use; only written under a shard lock.
    groups: OnceLock<Box<[AtomicU32]>>,
}

impl Manual {
    /// Empty state for the given placement mode, idle timeout and key cap (rounded up to a
    /// multiple of the shard count).
    pub fn new(mode: AssignmentMode, max_idle_secs: u64, max_keys: usize) -> Self {
        Manual {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            mode,
            max_idle_ms: max_idle_secs.saturating_mul(1000),
            shard_cap: max_keys.div_ceil(SHARDS).max(1),
            groups: OnceLock::new(),
        }
    }

    /// A key's hash and its shard's map. A poisoned lock only means another thread panicked
    /// mid-update of plain data that stays valid, so the guard is taken over.
    fn shard(&self, key: &[u8]) -> (u64, MutexGuard<'_, Shard>) {
        let h = hash64(key);
        let i = (h as usize) & (SHARDS - 1);
        let map = self.shards[i]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        (h, map)
    }

    /// Makes room in a full shard: drops its least recently used eighth among the keys without
    /// requests in flight (one scan and one selection, so the cost per new key stays constant).
    fn make_room(map: &mut Shard, cap: usize) {
        if map.len() < cap {
            return;
        }
        let mut idle: Vec<u64> = map
            .values()
            .filter(|e| e.in_flight == 0)
            .map(|e| e.last_access_ms)
            .collect();
        if idle.is_empty() {
            return; // every key has a request in flight: bounded by concurrency
        }
        let n = (cap / 8).clamp(1, idle.len());
        let (_, &mut cutoff, _) = idle.select_nth_unstable(n - 1);
        let mut dropped = 0;
        map.retain(|_, e| {
            let drop = dropped < n && e.in_flight == 0 && e.last_access_ms <= cutoff;
            dropped += usize::from(drop);
            !drop
        });
    }

    fn groups(&self, capacity: usize) -> &[AtomicU32] {
        self.groups
            .get_or_init(|| (0..capacity).map(|_| AtomicU32::new(0)).collect())
    }

    fn group_add(&self, w: WorkerId) {
        if let Some(g) = self.groups.get().and_then(|g| g.get(w as usize)) {
            g.fetch_add(1, Relaxed);
        }
    }

    fn group_sub(&self, w: WorkerId) {
        if let Some(g) = self.groups.get().and_then(|g| g.get(w as usize)) {
            let _ = g.fetch_update(Relaxed, Relaxed, |c| c.checked_sub(1));
        }
    }

    /// Active routing keys on `w` (for tests and the admin view).
    pub fn active_groups(&self, w: WorkerId) -> u32 {
        self.groups
            .get()
            .and_then(|g| g.get(w as usize))
            .map_or(0, |g| g.load(Relaxed))
    }

    /// Routing keys remembered.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).len())
            .sum()
    }

    /// Whether no key is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A fresh placement by the assignment mode.
    fn place(
        &self,
        workers: &[WorkerId],
        exclude: &[WorkerId],
        loads: &LoadBoard,
        rng: &mut Rng,
    ) -> Option<WorkerId> {
        match self.mode {
            AssignmentMode::Random => loads.pick_random_eligible(workers, exclude, rng),
            AssignmentMode::MinLoad => loads.pick_least_loaded(workers, exclude, rng),
            AssignmentMode::MinGroup => {
                let groups = self.groups(loads.capacity());
                least_by(workers, rng, |w| {
                    loads
                        .selectable(w, exclude)
                        .then(|| groups.get(w as usize).map_or(0, |g| g.load(Relaxed)))
                })
            }
        }
    }

    /// Route one request by its key. Every `Some` returned for a `key` must be matched by one
    /// `request_finished(key, ..)` (it keeps the in-flight group counts).
    pub fn by_key(
        &self,
        key: Option<&[u8]>,
        workers: &[WorkerId],
        exclude: &[WorkerId],
        loads: &LoadBoard,
        now_ms: u64,
        rng: &mut Rng,
    ) -> Option<Decision> {
        let _ = self.groups(loads.capacity());
        let Some(key) = key else {
            let w = self.place(workers, exclude, loads, rng)?;
            return Some(Decision::plain(w, Branch::ManualNew));
        };
        let (h, mut map) = self.shard(key);
        if let Some(e) = map.get_mut(&h) {
            e.last_access_ms = now_ms;
            let branch = if loads.selectable(e.worker, exclude) {
                Branch::ManualSticky
            } else {
                let w = self.place(workers, exclude, loads, rng)?;
                if e.in_flight > 0 {
                    self.group_sub(e.worker);
                    self.group_add(w);
                }
                e.worker = w;
                Branch::ManualNew
            };
            e.in_flight += 1;
            if e.in_flight == 1 {
                self.group_add(e.worker);
            }
            return Some(Decision::plain(e.worker, branch));
        }
        let w = self.place(workers, exclude, loads, rng)?;
        Self::make_room(&mut map, self.shard_cap);
        map.insert(
            h,
            Entry {
                worker: w,
                last_access_ms: now_ms,
                in_flight: 1,
            },
        );
        self.group_add(w);
        Some(Decision::plain(w, Branch::ManualNew))
    }

    /// Forget keys idle for longer than `max_idle_secs` at `now_ms`.
    pub fn expire(&self, now_ms: u64) {
        for shard in self.shards.iter() {
            let mut map = shard.lock().unwrap_or_else(|p| p.into_inner());
            map.retain(|_, e| {
                let keep = now_ms.saturating_sub(e.last_access_ms) <= self.max_idle_ms;
                if !keep && e.in_flight > 0 {
                    self.group_sub(e.worker);
                }
                keep
            });
            if map.capacity() > 64 && map.capacity() > 4 * map.len() {
                map.shrink_to_fit();
            }
        }
    }

    /// The worker remembered for `key`, if any.
    pub fn lookup(&self, key: &[u8]) -> Option<WorkerId> {
        let (h, map) = self.shard(key);
        map.get(&h).map(|e| e.worker)
    }
}

impl Select for Manual {
    fn from_config(cfg: &PolicyConfig) -> Self {
        Manual::new(cfg.assignment_mode, cfg.max_idle_secs, cfg.max_routing_keys)
    }

    fn select(
        &self,
        input: &RouteInput,
        workers: &[WorkerId],
        loads: &LoadBoard,
        _: Option<&RadixTree>,
        rng: &mut Rng,
    ) -> Option<Decision> {
        let (key, exclude) = (input.routing_key, input.exclude);
        self.by_key(key, workers, exclude, loads, input.now_ms, rng)
    }

    /// A request with `key` ended. The in-flight count is kept per key (the key's current worker
    /// owns the group even if an earlier attempt ran elsewhere), so `worker` is informational.
    fn request_finished(&self, key: &[u8], worker: WorkerId, now_ms: u64) {
        let _ = worker;
        let (h, mut map) = self.shard(key);
        if let Some(e) = map.get_mut(&h) {
            e.last_access_ms = e.last_access_ms.max(now_ms);
            if e.in_flight > 0 {
                e.in_flight -= 1;
                if e.in_flight == 0 {
                    self.group_sub(e.worker);
                }
            }
        }
    }

    fn maintain(&self, now_ms: u64) {
        self.expire(now_ms);
    }
}

/// Uniform random among the candidates with the smallest `score` (`None` = not a candidate).
/// Two passes, no allocation.
fn least_by(
    candidates: &[WorkerId],
    rng: &mut Rng,
    score: impl Fn(WorkerId) -> Option<u32>,
) -> Option<WorkerId> {
    let mut min = u32::MAX;
    let mut ties = 0usize;
    let mut first = None;
    for &w in candidates {
        if let Some(s) = score(w) {
            if s < min {
                (min, ties, first) = (s, 1, Some(w));
            } else if s == min {
                ties += 1;
            }
        }
    }
    let first = first?;
    let k = rng.below(ties);
    Some(
        candidates
            .iter()
            .copied()
            .filter(|&w| score(w) == Some(min))
            .nth(k)
            .unwrap_or(first),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workers::load::tests_support::board;

    #[test]
    fn sticky_until_ineligible_then_replaced() {
        let (ws, b) = board(8);
        let m = Manual::new(AssignmentMode::Random, 100, 1 << 20);
        let mut rng = Rng::with_seed(1);
        let d = m
            .by_key(Some(b"conv-1"), &ws, &[], &b, 0, &mut rng)
            .unwrap();
        assert_eq!(d.branch, Branch::ManualNew);
        let w = d.worker;
        for t in 1..50 {
            let d = m
                .by_key(Some(b"conv-1"), &ws, &[], &b, t, &mut rng)
                .unwrap();
            assert_eq!((d.worker, d.branch), (w, Branch::ManualSticky));
            m.request_finished(b"conv-1", w, t);
        }
        b.set_eligible(w, false);
        let d = m
            .by_key(Some(b"conv-1"), &ws, &[], &b, 60, &mut rng)
            .unwrap();
        assert_ne!(d.worker, w);
        assert_eq!(d.branch, Branch::ManualNew);
        let w2 = d.worker;
        // The map follows the new worker, even after the old one comes back.
        b.set_eligible(w, true);
        assert_eq!(m.lookup(b"conv-1"), Some(w2));
        let d = m
            .by_key(Some(b"conv-1"), &ws, &[], &b, 61, &mut rng)
            .unwrap();
        assert_eq!((d.worker, d.branch), (w2, Branch::ManualSticky));
        // Excluded (a retry) → re-placed elsewhere.
        let d = m
            .by_key(Some(b"conv-1"), &ws, &[w2], &b, 62, &mut rng)
            .unwrap();
        assert_ne!(d.worker, w2);
        assert_eq!(m.lookup(b"conv-1"), Some(d.worker));
        assert_eq!(m.len(), 1);
    }

    #[test]
    fn the_policy_routes_on_the_routing_key_and_forgets_it_in_upkeep() {
        let (ws, b) = board(4);
        let m = Manual::from_config(&PolicyConfig {
            max_idle_secs: 10,
            ..PolicyConfig::default()
        });
        let mut rng = Rng::with_seed(9);
        let input = RouteInput {
            routing_key: Some(b"conv"),
            ..RouteInput::new("", 0)
        };
        let d = m.select(&input, &ws, &b, None, &mut rng).unwrap();
        assert_eq!(d.branch, Branch::ManualNew);
        let again = m.select(&input, &ws, &b, None, &mut rng).unwrap();
        assert_eq!(
            (again.worker, again.branch),
            (d.worker, Branch::ManualSticky)
        );
        m.request_finished(b"conv", d.worker, 0);
        m.request_finished(b"conv", d.worker, 0);
        assert_eq!(m.active_groups(d.worker), 0);
        m.maintain(10_000);
        assert_eq!(m.len(), 1);
        m.maintain(10_001);
        assert!(m.is_empty());
    }

    #[test]
    fn keys_expire_after_max_idle() {
        let (ws, b) = board(4);
        let m = Manual::new(AssignmentMode::Random, 10, 1 << 20);
        let mut rng = Rng::with_seed(2);
        m.by_key(Some(b"a"), &ws, &[], &b, 0, &mut rng).unwrap();
        m.request_finished(b"a", 0, 0);
        m.by_key(Some(b"b"), &ws, &[], &b, 5_000, &mut rng).unwrap();
        m.request_finished(b"b", 0, 5_000);
        m.expire(10_000);
        assert_eq!(m.len(), 2, "idle exactly max_idle is kept");
        m.expire(10_001);
        assert_eq!(m.lookup(b"a"), None);
        assert!(m.lookup(b"b").is_some());
        m.expire(15_001);
        assert!(m.is_empty());
    }

    #[test]
    fn min_load_places_on_the_least_loaded() {
        let (ws, b) = board(4);
        for w in [0, 1, 3] {
            b.inc(w);
        }
        let m = Manual::new(AssignmentMode::MinLoad, 100, 1 << 20);
        let mut rng = Rng::with_seed(3);
        let d = m.by_key(Some(b"k"), &ws, &[], &b, 0, &mut rng).unwrap();
        assert_eq!(d.worker, 2);
        // Random among ties.
        let (ws, b) = board(4);
        let mut seen = [0u32; 4];
        for i in 0..400u32 {
            let key = i.to_le_bytes();
            seen[m
                .by_key(Some(&key), &ws, &[], &b, 0, &mut rng)
                .unwrap()
                .worker as usize] += 1;
        }
        assert!(seen.iter().all(|&c| c > 60), "{seen:?}");
    }

    #[test]
    fn min_group_balances_active_keys() {
        let (ws, b) = board(3);
        let m = Manual::new(AssignmentMode::MinGroup, 100, 1 << 20);
        let mut rng = Rng::with_seed(4);
        // Six keys with requests in flight: two per worker.
        for i in 0..6u8 {
            m.by_key(Some(&[i]), &ws, &[], &b, 0, &mut rng).unwrap();
        }
        assert_eq!(
            (0..3).map(|w| m.active_groups(w)).collect::<Vec<_>>(),
            [2, 2, 2]
        );
        // A second request on a key does not make it a second group.
        let w0 = m.lookup(&[0]).unwrap();
        m.by_key(Some(&[0]), &ws, &[], &b, 0, &mut rng).unwrap();
        assert_eq!(m.active_groups(w0), 2);
        // Finish both requests of key 0: its worker now has the fewest active keys.
        m.request_finished(&[0], w0, 1);
        assert_eq!(m.active_groups(w0), 2);
        m.request_finished(&[0], w0, 1);
        assert_eq!(m.active_groups(w0), 1);
        let d = m.by_key(Some(b"new"), &ws, &[], &b, 2, &mut rng).unwrap();
        assert_eq!(d.worker, w0);
        // Expiry of a key with requests in flight releases its group.
        m.expire(1_000_000);
        assert!(m.is_empty());
        assert_eq!((0..3).map(|w| m.active_groups(w)).sum::<u32>(), 0);
    }

    #[test]
    fn no_header_is_placed_fresh_and_not_stored() {
        let (ws, b) = board(4);
        let m = Manual::new(AssignmentMode::Random, 100, 1 << 20);
        let mut rng = Rng::with_seed(5);
        let mut seen = [0u32; 4];
        for _ in 0..400 {
            let d = m.by_key(None, &ws, &[3], &b, 0, &mut rng).unwrap();
            assert_eq!(d.branch, Branch::ManualNew);
            seen[d.worker as usize] += 1;
        }
        assert!(m.is_empty());
        assert_eq!(seen[3], 0);
        assert!(seen[..3].iter().all(|&c| c > 80), "{seen:?}");
    }

    #[test]
    fn nothing_eligible_keeps_the_entry() {
        let (ws, b) = board(2);
        let m = Manual::new(AssignmentMode::Random, 100, 1 << 20);
        let mut rng = Rng::with_seed(6);
        let w = m
            .by_key(Some(b"k"), &ws, &[], &b, 0, &mut rng)
            .unwrap()
            .worker;
        m.request_finished(b"k", w, 0);
        assert_eq!(m.by_key(Some(b"k"), &ws, &[0, 1], &b, 1, &mut rng), None);
        assert_eq!(m.lookup(b"k"), Some(w));
    }

    #[test]
    fn the_map_is_capped_least_recently_used_out_first() {
        let (ws, b) = board(4);
        let m = Manual::new(AssignmentMode::Random, 1_000_000, 160);
        let mut rng = Rng::with_seed(7);
        // A key kept busy, and one with a request in flight that never ends.
        let hot = b"hot".as_slice();
        let w_hot = m
            .by_key(Some(hot), &ws, &[], &b, 0, &mut rng)
            .unwrap()
            .worker;
        m.request_finished(hot, w_hot, 0);
        m.by_key(Some(b"busy"), &ws, &[], &b, 0, &mut rng).unwrap();
        for i in 1..=10_000u64 {
            let key = format!("flood-{i}");
            let d = m
                .by_key(Some(key.as_bytes()), &ws, &[], &b, i, &mut rng)
                .unwrap();
            m.request_finished(key.as_bytes(), d.worker, i);
            // Every 10 new keys (about one per shard in 16): well within a shard's LRU window.
            if i % 10 == 0 {
                let d = m.by_key(Some(hot), &ws, &[], &b, i, &mut rng).unwrap();
                assert_eq!(d.worker, w_hot, "at {i}");
                m.request_finished(hot, w_hot, i);
            }
            assert!(m.len() <= 160 + 1, "{} keys at {i}", m.len());
        }
        assert_eq!(m.lookup(hot), Some(w_hot), "recently used keys stay");
        assert!(m.lookup(b"busy").is_some(), "keys in flight stay");
        assert_eq!(m.lookup(b"flood-1"), None, "the oldest went first");
        assert!(m.lookup(b"flood-10000").is_some());
    }

    #[test]
    fn long_keys_cost_the_same_as_short_ones() {
        let (ws, b) = board(2);
        let m = Manual::new(AssignmentMode::Random, 100, 1 << 20);
        let mut rng = Rng::with_seed(8);
        let long = vec![b'k'; 100_000];
        let w = m
            .by_key(Some(&long), &ws, &[], &b, 0, &mut rng)
            .unwrap()
            .worker;
        assert_eq!(m.lookup(&long), Some(w));
        assert_eq!(m.len(), 1);
        assert!(key_too_long(257).contains("256"));
    }
}
