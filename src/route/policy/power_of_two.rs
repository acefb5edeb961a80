//! power_of_two: two distinct random eligible workers, the one with fewer requests in flight
//! wins. It exists because a uniform draw lets queues grow unevenly while a full least-loaded
//! scan sends every core to the same idle worker at once: sampling two gets most of the
//! balancing benefit at O(1) cost, and the randomness keeps cores from herding.
use crate::base::rng::Rng;
use crate::base::WorkerId;
use crate::route::policy::Select;
use crate::route::types::{Branch, Decision, PolicyConfig, RouteInput};
use crate::tree::RadixTree;
use crate::workers::load::LoadBoard;

/// The power_of_two policy: no state beyond the load board every policy reads.
#[derive(Debug, Default)]
pub struct PowerOfTwo;

impl Select for PowerOfTwo {
    fn from_config(_: &PolicyConfig) -> Self {
        PowerOfTwo
    }

    /// The lighter of two distinct random eligible workers (the first on a tie, which is itself
    /// random). One eligible worker → that one.
    fn select(
        &self,
        input: &RouteInput,
        workers: &[WorkerId],
        loads: &LoadBoard,
        _: Option<&RadixTree>,
        rng: &mut Rng,
    ) -> Option<Decision> {
        let exclude = input.exclude;
        let a = loads.pick_random_eligible(workers, exclude, rng)?;
        let b = loads.pick_random_where(workers, rng, |w| w != a && !exclude.contains(&w));
        let w = match b {
            Some(b) if loads.load(b) < loads.load(a) => b,
            _ => a,
        };
        Some(Decision::plain(w, Branch::PowerOfTwo))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workers::load::tests_support::board;

    #[test]
    fn power_of_two_prefers_the_lighter_of_two_distinct() {
        let (ws, b) = board(2);
        for _ in 0..3 {
            b.inc(0);
        }
        let p = PowerOfTwo;
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
}
