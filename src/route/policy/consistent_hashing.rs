//! consistent_hashing: a request key (the routing key, else `Authorization`, `X-Forwarded-For`
//! or `Cookie`) always lands on the same worker, so a user's or session's requests meet the KV
//! cache their earlier turns left there without the gateway remembering anything; adding a
//! worker moves only ~1/(N+1) of the keys. `X-SMG-Target-Worker` lets a client name the worker
//! outright.
use crate::base::rng::Rng;
use crate::base::WorkerId;
use crate::route::policy::Select;
use crate::route::ring::{hash64, RingCell};
use crate::route::types::{Branch, Decision, PolicyConfig, RouteInput};
use crate::tree::RadixTree;
use crate::workers::load::LoadBoard;

/// The consistent_hashing policy: the ring of the registered workers, placed by name.
#[derive(Debug, Default)]
pub struct ConsistentHashing {
    ring: RingCell,
}

/// Parse `X-SMG-Target-Worker` as a decimal index (ASCII digits, surrounding spaces allowed).
fn parse_index(v: &[u8]) -> Option<usize> {
    let v = v.trim_ascii();
    if v.is_empty() || v.len() > 9 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(
        v.iter()
            .fold(0usize, |acc, &d| acc * 10 + (d - b'0') as usize),
    )
}

impl Select for ConsistentHashing {
    fn from_config(_: &PolicyConfig) -> Self {
        ConsistentHashing::default()
    }

    /// A valid `X-SMG-Target-Worker` index into the eligible workers (in registration order)
    /// wins unless that worker is excluded; otherwise `hash_key` on the ring, walking past
    /// ineligible/excluded workers; with no key, a random eligible worker.
    fn select(
        &self,
        input: &RouteInput,
        workers: &[WorkerId],
        loads: &LoadBoard,
        _: Option<&RadixTree>,
        rng: &mut Rng,
    ) -> Option<Decision> {
        let exclude = input.exclude;
        if let Some(i) = input.target_worker.and_then(parse_index) {
            let target = workers
                .iter()
                .copied()
                .filter(|&w| loads.is_eligible(w))
                .nth(i);
            if let Some(w) = target.filter(|w| !exclude.contains(w)) {
                return Some(Decision::plain(w, Branch::TargetWorker));
            }
        }
        if let Some(key) = input.hash_key {
            let ring = self.ring.load();
            if let Some(w) = ring.lookup(hash64(key), |w| loads.selectable(w, exclude)) {
                return Some(Decision::plain(w, Branch::HashRing));
            }
        }
        loads
            .pick_random_eligible(workers, exclude, rng)
            .map(|w| Decision::plain(w, Branch::Random))
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

    fn policy(ws: &[WorkerId]) -> ConsistentHashing {
        let p = ConsistentHashing::default();
        p.workers_changed(ws);
        p
    }

    #[test]
    fn target_worker_is_an_index_into_the_eligible_list() {
        let (ws, b) = board(4);
        let p = policy(&ws);
        let mut rng = Rng::with_seed(1);
        let mut input = RouteInput::new("", 0);
        input.target_worker = Some(b"1");
        let d = p.select(&input, &ws, &b, None, &mut rng).unwrap();
        assert_eq!((d.worker, d.branch), (1, Branch::TargetWorker));
        b.set_eligible(0, false);
        let d = p.select(&input, &ws, &b, None, &mut rng).unwrap();
        assert_eq!((d.worker, d.branch), (2, Branch::TargetWorker));
        // Out of range, garbage, or excluded → the key / random path.
        input.hash_key = Some(b"alice");
        for t in [&b"3"[..], b"99", b"-1", b"x", b"", b"1 2"] {
            input.target_worker = Some(t);
            let d = p.select(&input, &ws, &b, None, &mut rng).unwrap();
            assert_eq!(d.branch, Branch::HashRing, "{:?}", t);
        }
        input.target_worker = Some(b" 0 ");
        let d = p.select(&input, &ws, &b, None, &mut rng).unwrap();
        assert_eq!((d.worker, d.branch), (1, Branch::TargetWorker));
        let exclude = [1];
        input.exclude = &exclude;
        let d = p.select(&input, &ws, &b, None, &mut rng).unwrap();
        assert_eq!(d.branch, Branch::HashRing);
        assert_ne!(d.worker, 1);
    }

    #[test]
    fn keyed_requests_stick_and_keyless_spread() {
        let (ws, b) = board(5);
        let p = policy(&ws);
        let mut rng = Rng::with_seed(2);
        let mut input = RouteInput::new("", 0);
        input.hash_key = Some(b"Bearer abc");
        let first = p.select(&input, &ws, &b, None, &mut rng).unwrap().worker;
        for _ in 0..20 {
            let d = p.select(&input, &ws, &b, None, &mut rng).unwrap();
            assert_eq!((d.worker, d.branch), (first, Branch::HashRing));
        }
        // Excluded on retry → the next worker clockwise, deterministically.
        let exclude = [first];
        input.exclude = &exclude;
        let second = p.select(&input, &ws, &b, None, &mut rng).unwrap().worker;
        assert_ne!(second, first);
        assert_eq!(
            p.select(&input, &ws, &b, None, &mut rng).unwrap().worker,
            second
        );
        let input = RouteInput::new("", 0);
        let mut seen = [0u32; 5];
        for _ in 0..500 {
            let d = p.select(&input, &ws, &b, None, &mut rng).unwrap();
            assert_eq!(d.branch, Branch::Random);
            seen[d.worker as usize] += 1;
        }
        assert!(seen.iter().all(|&s| s > 50), "{seen:?}");
    }

    #[test]
    fn empty_ring_falls_back_to_random() {
        let (ws, b) = board(3);
        let p = ConsistentHashing::default();
        let mut rng = Rng::with_seed(4);
        let mut input = RouteInput::new("abc", 0);
        input.hash_key = Some(b"k");
        let d = p.select(&input, &ws, &b, None, &mut rng).unwrap();
        assert_eq!(d.branch, Branch::Random);
    }

    #[test]
    fn named_workers_are_placed_by_name() {
        let (ws, b) = board(3);
        let (by_name, reordered) = (ConsistentHashing::default(), ConsistentHashing::default());
        by_name.workers_changed_named(&[
            (0, b"http://a:1"),
            (1, b"http://b:1"),
            (2, b"http://c:1"),
        ]);
        reordered.workers_changed_named(&[
            (2, b"http://a:1"),
            (0, b"http://b:1"),
            (1, b"http://c:1"),
        ]);
        let mut rng = Rng::with_seed(5);
        for i in 0..200u32 {
            let key = i.to_le_bytes();
            let input = RouteInput {
                hash_key: Some(&key),
                ..RouteInput::new("", 0)
            };
            let a = by_name
                .select(&input, &ws, &b, None, &mut rng)
                .unwrap()
                .worker;
            let r = reordered
                .select(&input, &ws, &b, None, &mut rng)
                .unwrap()
                .worker;
            // a's worker `w` is named like reordered's worker `(w + 2) % 3`.
            assert_eq!(r, (a + 2) % 3, "key {i}");
        }
    }
}
