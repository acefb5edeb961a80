//! prefix_hash: the prompt's first characters pick the worker on a hash ring, so requests that
//! share a prefix (a system prompt, a few-shot preamble) meet their KV cache without the gateway
//! keeping a radix tree; a load bound keeps one hot prefix from swamping its worker.
use crate::base::rng::Rng;
use crate::base::text::prefix_chars;
use crate::base::WorkerId;
use crate::route::policy::Select;
use crate::route::ring::{hash64, RingCell};
use crate::route::types::{Branch, Decision, PolicyConfig, RouteInput};
use crate::tree::RadixTree;
use crate::workers::load::LoadBoard;

/// The prefix_hash policy: the ring of the registered workers and how much of the prompt it
/// hashes.
#[derive(Debug)]
pub struct PrefixHash {
    ring: RingCell,
    /// Characters of the routing text hashed (`--prefix-hash-chars`).
    chars: usize,
}

/// Bounded-load test for prefix_hash. With `S` the in-flight sum and `N` the number of eligible
/// workers, a worker is overloaded when `load > 1.25 × (S + 1) / N`: the `+ 1` counts the
/// request being placed, so an idle fleet never trips it, and a worker may exceed the average
/// by 25 % before its prefix traffic spills. Integer form: `4·load·N > 5·(S + 1)`.
pub fn overloaded(load: u32, sum: u64, eligible: usize) -> bool {
    4 * load as u128 * eligible as u128 > 5 * (sum as u128 + 1)
}

impl Select for PrefixHash {
    fn from_config(cfg: &PolicyConfig) -> Self {
        PrefixHash {
            ring: RingCell::default(),
            chars: cfg.prefix_hash_chars,
        }
    }

    /// Hash the first `chars` characters onto the ring; if that worker is overloaded (see
    /// [`overloaded`]), the least-loaded eligible, non-excluded worker instead.
    fn select(
        &self,
        input: &RouteInput,
        workers: &[WorkerId],
        loads: &LoadBoard,
        _: Option<&RadixTree>,
        rng: &mut Rng,
    ) -> Option<Decision> {
        let exclude = input.exclude;
        let h = hash64(prefix_chars(input.text, self.chars).as_bytes());
        let on_ring = self.ring.load().lookup(h, |w| loads.selectable(w, exclude));
        if let Some(w) = on_ring {
            if !overloaded(
                loads.load(w),
                loads.eligible_load_sum(),
                loads.eligible_count(),
            ) {
                return Some(Decision::plain(w, Branch::HashRing));
            }
        }
        // Overloaded, or no ring member acceptable (a stale or empty ring).
        loads
            .pick_least_loaded(workers, exclude, rng)
            .map(|w| Decision::plain(w, Branch::HashRingOverloaded))
    }

    fn reads_text(&self) -> bool {
        true
    }

    fn workers_changed(&self, workers: &[WorkerId]) {
        self.ring.rebuild(workers);
    }

    fn workers_changed_named(&self, workers: &[(WorkerId, &[u8])]) {
        self.ring.rebuild_named(workers);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workers::load::tests_support::board;

    fn policy(ws: &[WorkerId], chars: usize) -> PrefixHash {
        let p = PrefixHash::from_config(&PolicyConfig {
            prefix_hash_chars: chars,
            ..PolicyConfig::default()
        });
        p.workers_changed(ws);
        p
    }

    #[test]
    fn overload_bound_is_precise() {
        // Idle fleet: never overloaded, whatever its size.
        assert!(!overloaded(0, 0, 1));
        assert!(!overloaded(0, 0, 1000));
        // Two workers: 1 vs 0 is fine (4·1·2 = 8 ≤ 5·2 = 10); 2 vs 0 spills (16 > 15).
        assert!(!overloaded(1, 1, 2));
        assert!(overloaded(2, 2, 2));
        // Single worker: never overloaded (4·l ≤ 5·(l + 1)).
        assert!(!overloaded(1000, 1000, 1));
        // Even fleet of 8 at 10 each: the ring worker at 10 is fine; at 14 (sum 84) it spills
        // (4·14·8 = 448 > 5·85 = 425), at 13 (sum 83) not yet (416 ≤ 420).
        assert!(!overloaded(10, 80, 8));
        assert!(!overloaded(13, 83, 8));
        assert!(overloaded(14, 84, 8));
        // Four workers, one request on the ring worker, the rest idle: 16 > 10 → spills.
        assert!(overloaded(1, 1, 4));
    }

    #[test]
    fn prefix_hash_sticks_then_spills_when_overloaded() {
        let (ws, b) = board(4);
        let p = policy(&ws, 64);
        let mut rng = Rng::with_seed(3);
        let sys = "You are a helpful assistant. ".repeat(10);
        let t1 = format!("{sys}question one");
        let t2 = format!("{sys}another question");
        let i1 = RouteInput::new(&t1, 0);
        let i2 = RouteInput::new(&t2, 0);
        let d1 = p.select(&i1, &ws, &b, None, &mut rng).unwrap();
        let d2 = p.select(&i2, &ws, &b, None, &mut rng).unwrap();
        assert_eq!(d1.branch, Branch::HashRing);
        assert_eq!(d1.worker, d2.worker, "same first 64 chars, same worker");
        let w = d1.worker;
        // One request on the ring worker while three are idle: 4·1·4 = 16 > 5·2 = 10 → spill
        // to an idle worker.
        b.inc(w);
        let d = p.select(&i1, &ws, &b, None, &mut rng).unwrap();
        assert_eq!(d.branch, Branch::HashRingOverloaded);
        assert_ne!(d.worker, w);
        assert_eq!(b.load(d.worker), 0);
        // The rest catch up (all at 1, 16 ≤ 25): the ring worker is acceptable again.
        for o in ws.iter().copied().filter(|&o| o != w) {
            b.inc(o);
        }
        let d = p.select(&i1, &ws, &b, None, &mut rng).unwrap();
        assert_eq!((d.worker, d.branch), (w, Branch::HashRing));
        // One more on it (2 vs 1,1,1: 32 > 30) → spill again.
        b.inc(w);
        let d = p.select(&i1, &ws, &b, None, &mut rng).unwrap();
        assert_eq!(d.branch, Branch::HashRingOverloaded);
        assert_eq!(b.load(d.worker), 1);
    }

    #[test]
    fn empty_ring_falls_back_to_least_loaded() {
        let (ws, b) = board(3);
        let p = policy(&[], 8);
        let mut rng = Rng::with_seed(4);
        let d = p
            .select(&RouteInput::new("abc", 0), &ws, &b, None, &mut rng)
            .unwrap();
        assert_eq!(d.branch, Branch::HashRingOverloaded);
    }
}
