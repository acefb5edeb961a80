//! round_robin: a global rotation over the registered list. It exists for equal workers and
//! equal requests, where taking turns gives each worker the same count with no randomness (a
//! deterministic spread is easier to reason about in tests and capacity plans); ineligible or
//! excluded workers are skipped, within one lap.
use crate::base::rng::Rng;
use crate::base::WorkerId;
use crate::route::policy::Select;
use crate::route::types::{Branch, Decision, PolicyConfig, RouteInput};
use crate::tree::RadixTree;
use crate::workers::load::LoadBoard;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// An atomic alone on its cache line (the round-robin cursor is bumped by every core).
#[repr(align(64))]
#[derive(Debug, Default)]
struct PaddedCounter(AtomicUsize);

/// The round_robin policy: one cursor shared by every core, so the rotation is global.
#[derive(Debug, Default)]
pub struct RoundRobin {
    cursor: PaddedCounter,
}

impl Select for RoundRobin {
    fn from_config(_: &PolicyConfig) -> Self {
        RoundRobin::default()
    }

    /// The cursor's next turn, or the first selectable worker after it; the walk is bounded by
    /// one lap.
    fn select(
        &self,
        input: &RouteInput,
        workers: &[WorkerId],
        loads: &LoadBoard,
        _: Option<&RadixTree>,
        _: &mut Rng,
    ) -> Option<Decision> {
        let n = workers.len();
        if n == 0 {
            return None;
        }
        let start = self.cursor.0.fetch_add(1, Relaxed) % n;
        (0..n)
            .map(|i| workers[(start + i) % n])
            .find(|&w| loads.selectable(w, input.exclude))
            .map(|w| Decision::plain(w, Branch::RoundRobin))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workers::load::tests_support::board;

    #[test]
    fn round_robin_rotates_and_skips_within_one_lap() {
        let (ws, b) = board(4);
        let p = RoundRobin::default();
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
}
