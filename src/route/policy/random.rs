//! random: uniform over the eligible workers. It exists as the baseline every other policy is
//! measured against, and for fleets where requests share nothing (no prefix worth a cache, no
//! session worth pinning), where a uniform draw spreads load with no state and no coordination
//! between cores.
use crate::base::rng::Rng;
use crate::base::WorkerId;
use crate::route::policy::Select;
use crate::route::types::{Branch, Decision, PolicyConfig, RouteInput};
use crate::tree::RadixTree;
use crate::workers::load::LoadBoard;

/// The random policy: no state, the draw comes from the caller's per-core `Rng`.
#[derive(Debug, Default)]
pub struct Random;

impl Select for Random {
    fn from_config(_: &PolicyConfig) -> Self {
        Random
    }

    fn select(
        &self,
        input: &RouteInput,
        workers: &[WorkerId],
        loads: &LoadBoard,
        _: Option<&RadixTree>,
        rng: &mut Rng,
    ) -> Option<Decision> {
        loads
            .pick_random_eligible(workers, input.exclude, rng)
            .map(|w| Decision::plain(w, Branch::Random))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workers::load::tests_support::board;

    #[test]
    fn random_is_uniform_and_skips() {
        let (ws, b) = board(5);
        b.set_eligible(4, false);
        let p = Random;
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
}
