use super::*;
use crate::base::rng::Rng;
use proptest::prelude::*;
use std::sync::Arc;

fn naive_min_max(b: &LoadBoard) -> Option<(u32, u32)> {
    let ls: Vec<u32> = (0..b.capacity() as u32)
        .filter(|&w| b.is_eligible(w))
        .map(|w| b.load(w))
        .collect();
    Some((*ls.iter().min()?, *ls.iter().max()?))
}

fn naive_least(b: &LoadBoard, cands: &[WorkerId], exclude: &[WorkerId]) -> Vec<WorkerId> {
    let ok: Vec<WorkerId> = cands
        .iter()
        .copied()
        .filter(|&w| b.selectable(w, exclude))
        .collect();
    let Some(min) = ok.iter().map(|&w| b.load(w)).min() else {
        return vec![];
    };
    ok.into_iter().filter(|&w| b.load(w) == min).collect()
}

#[test]
fn basic_counts_and_min_max() {
    let b = LoadBoard::new(4);
    assert_eq!(b.min_max(), None);
    assert_eq!(b.eligible_count(), 0);
    for w in 0..4 {
        b.set_eligible(w, true);
    }
    b.set_eligible(0, true); // idempotent
    assert_eq!(b.eligible_count(), 4);
    assert_eq!(b.min_max(), Some((0, 0)));
    b.inc(2);
    b.inc(2);
    b.inc(1);
    assert_eq!(b.load(2), 2);
    assert_eq!(b.min_max(), Some((0, 2)));
    assert_eq!(b.eligible_load_sum(), 3);
    b.set_eligible(2, false);
    assert_eq!(b.min_max(), Some((0, 1)));
    assert_eq!(b.eligible_load_sum(), 1);
    // Ineligible workers keep counting.
    b.inc(2);
    assert_eq!(b.load(2), 3);
    b.set_eligible(2, true);
    assert_eq!(b.min_max(), Some((0, 3)));
    b.dec(2);
    b.dec(2);
    b.dec(2);
    assert_eq!(b.min_max(), Some((0, 1)));
    b.check_quiescent();
}

#[test]
fn hints_follow_the_load_both_ways() {
    let b = LoadBoard::new(3);
    for w in 0..3 {
        b.set_eligible(w, true);
    }
    for _ in 0..50 {
        for w in 0..3 {
            b.inc(w);
        }
    }
    b.inc(1);
    assert_eq!(b.min_max(), Some((50, 51)));
    for _ in 0..50 {
        for w in 0..3 {
            b.dec(w);
        }
    }
    assert_eq!(b.min_max(), Some((0, 1)));
    b.dec(1);
    assert_eq!(b.min_max(), Some((0, 0)));
    b.check_quiescent();
}

#[test]
fn out_of_range_and_unbalanced_dec_are_harmless() {
    let b = LoadBoard::new(2);
    assert_eq!(b.load(99), 0);
    assert!(!b.is_eligible(99));
    b.set_eligible(0, true);
    // Release builds ignore a stray dec; debug builds assert, so only check the release path.
    if !cfg!(debug_assertions) {
        b.dec(0);
        b.inc(77);
    }
    assert_eq!(b.load(0), 0);
    assert_eq!(b.min_max(), Some((0, 0)));
}

#[test]
fn saturated_levels_fall_back_to_exact() {
    let b = LoadBoard::with_levels(3, 4); // levels 0,1,2,3+
    for w in 0..3 {
        b.set_eligible(w, true);
    }
    for _ in 0..10 {
        b.inc(0);
    }
    for _ in 0..7 {
        b.inc(1);
    }
    assert_eq!(b.min_max(), Some((0, 10)));
    assert_eq!(b.eligible_load_sum(), 17);
    for _ in 0..5 {
        b.inc(2);
    }
    assert_eq!(b.min_max(), Some((5, 10)));
    let mut rng = Rng::with_seed(1);
    assert_eq!(b.pick_least_loaded(&[0, 1, 2], &[], &mut rng), Some(2));
    b.check_quiescent();
}

#[test]
fn least_loaded_is_uniform_over_ties_on_a_large_fleet() {
    let n = 200u32;
    let b = LoadBoard::new(n as usize);
    let ws: Vec<WorkerId> = (0..n).collect();
    for &w in &ws {
        b.set_eligible(w, true);
        if w % 4 != 0 {
            b.inc(w); // 50 workers at load 0, 150 at load 1
        }
    }
    let mut rng = Rng::with_seed(9);
    let mut hits = vec![0u32; n as usize];
    for _ in 0..20_000 {
        let w = b.pick_least_loaded(&ws, &[], &mut rng).unwrap();
        assert_eq!(w % 4, 0);
        hits[w as usize] += 1;
    }
    // 400 expected per tie; all 50 ties used and none wildly over-represented.
    let used: Vec<u32> = hits.iter().copied().filter(|&h| h > 0).collect();
    assert_eq!(used.len(), 50);
    assert!(used.iter().all(|&h| (250..560).contains(&h)), "{used:?}");
    // Excluding the ties still finds one, exactly.
    let exclude: Vec<WorkerId> = (0..n).filter(|w| w % 4 == 0).collect();
    let w = b.pick_least_loaded(&ws, &exclude, &mut rng).unwrap();
    assert_eq!(b.load(w), 1);
}

#[test]
fn random_eligible_skips_ineligible_and_excluded() {
    let n = 64u32;
    let b = LoadBoard::new(n as usize);
    let ws: Vec<WorkerId> = (0..n).collect();
    for &w in &ws {
        b.set_eligible(w, w % 8 == 3);
    }
    let mut rng = Rng::with_seed(3);
    let mut seen = std::collections::HashSet::new();
    for _ in 0..2_000 {
        let w = b.pick_random_eligible(&ws, &[11], &mut rng).unwrap();
        assert!(w % 8 == 3 && w != 11);
        seen.insert(w);
    }
    assert_eq!(seen.len(), 7);
    let all: Vec<WorkerId> = (0..n).filter(|w| w % 8 == 3).collect();
    assert_eq!(b.pick_random_eligible(&ws, &all, &mut rng), None);
    assert_eq!(b.pick_least_loaded(&ws, &all, &mut rng), None);
}

#[test]
fn concurrent_stress_is_exact_at_quiescence() {
    const N: usize = 48;
    let b = Arc::new(LoadBoard::with_levels(N, 8)); // small levels: exercise saturation too
    for w in 0..N as u32 {
        b.set_eligible(w, true);
    }
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let b = Arc::clone(&b);
            std::thread::spawn(move || {
                let mut rng = Rng::with_seed(100 + t);
                let ws: Vec<WorkerId> = (0..N as u32).collect();
                let mut held: Vec<WorkerId> = Vec::new();
                for i in 0..60_000 {
                    match rng.below(10) {
                        0..=4 => {
                            let w = rng.below(N) as u32;
                            b.inc(w);
                            held.push(w);
                        }
                        5..=7 if !held.is_empty() => {
                            let w = held.swap_remove(rng.below(held.len()));
                            b.dec(w);
                        }
                        8 if t == 0 => {
                            let w = rng.below(N) as u32;
                            b.set_eligible(w, i % 3 != 0);
                        }
                        _ => {
                            // Readers racing the writers must never panic or hang.
                            let _ = b.min_max();
                            let _ = b.pick_least_loaded(&ws, &[1, 2], &mut rng);
                            let _ = b.pick_random_eligible(&ws, &[], &mut rng);
                        }
                    }
                }
                held
            })
        })
        .collect();
    let mut held_all = [0u32; N];
    for t in threads {
        for w in t.join().unwrap() {
            held_all[w as usize] += 1;
        }
    }
    for w in 0..N as u32 {
        assert_eq!(b.load(w), held_all[w as usize], "worker {w}");
    }
    b.check_quiescent();
    assert_eq!(b.min_max(), naive_min_max(&b));
    let sum: u64 = (0..N as u32)
        .filter(|&w| b.is_eligible(w))
        .map(|w| b.load(w) as u64)
        .sum();
    assert_eq!(b.eligible_load_sum(), sum);
    // Release everything: back to all-zero.
    for w in 0..N as u32 {
        for _ in 0..held_all[w as usize] {
            b.dec(w);
        }
        b.set_eligible(w, true);
    }
    b.check_quiescent();
    assert_eq!(b.min_max(), Some((0, 0)));
}

#[derive(Debug, Clone)]
enum Op {
    Inc(u32),
    Dec(u32),
    Elig(u32, bool),
    /// The telemetry thread sets a worker's external load.
    Ext(u32, u32),
    Check(u64, Vec<u32>),
}

fn op(n: u32) -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..n).prop_map(Op::Inc),
        4 => (0..n).prop_map(Op::Dec),
        1 => (0..n, any::<bool>()).prop_map(|(w, e)| Op::Elig(w, e)),
        2 => (0..n, prop_oneof![0u32..16, Just(0), 0u32..40]).prop_map(|(w, x)| Op::Ext(w, x)),
        2 => (any::<u64>(), proptest::collection::vec(0..n, 0..3))
            .prop_map(|(s, x)| Op::Check(s, x)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn matches_naive_scan(
        n in 1u32..40,
        levels in 2usize..12,
        ops in proptest::collection::vec(op(40), 1..400),
    ) {
        let b = LoadBoard::with_levels(n as usize, levels);
        let ws: Vec<WorkerId> = (0..n).collect();
        for o in ops {
            match o {
                Op::Inc(w) if w < n => b.inc(w),
                Op::Dec(w) if w < n && b.in_flight(w) > 0 => b.dec(w),
                Op::Elig(w, e) if w < n => b.set_eligible(w, e),
                Op::Ext(w, x) if w < n => {
                    let own = b.in_flight(w);
                    b.set_external(w, x);
                    prop_assert_eq!(b.external(w), x);
                    prop_assert_eq!(b.in_flight(w), own);
                    prop_assert_eq!(b.load(w), own + x);
                }
                Op::Check(seed, exclude) => {
                    let mut rng = Rng::with_seed(seed);
                    prop_assert_eq!(b.min_max(), naive_min_max(&b));
                    let least = naive_least(&b, &ws, &exclude);
                    let got = b.pick_least_loaded(&ws, &exclude, &mut rng);
                    match got {
                        None => prop_assert!(least.is_empty()),
                        Some(w) => prop_assert!(least.contains(&w), "{} not in {:?}", w, least),
                    }
                    // A subset (e.g. prefix holders) works the same way.
                    let sub: Vec<WorkerId> = ws.iter().copied().filter(|w| w % 2 == 1).collect();
                    let least_sub = naive_least(&b, &sub, &exclude);
                    match b.pick_least_loaded(&sub, &exclude, &mut rng) {
                        None => prop_assert!(least_sub.is_empty()),
                        Some(w) => prop_assert!(least_sub.contains(&w)),
                    }
                    let r = b.pick_random_eligible(&ws, &exclude, &mut rng);
                    let any_ok = ws.iter().any(|&w| b.selectable(w, &exclude));
                    prop_assert_eq!(r.is_some(), any_ok);
                    if let Some(w) = r {
                        prop_assert!(b.selectable(w, &exclude));
                    }
                }
                _ => {}
            }
        }
        b.check_quiescent();
        prop_assert_eq!(b.min_max(), naive_min_max(&b));
        let sum: u64 = (0..n).filter(|&w| b.is_eligible(w)).map(|w| b.load(w) as u64).sum();
        prop_assert_eq!(b.eligible_load_sum(), sum);
    }
}

#[test]
fn external_load_adds_to_own_and_moves_levels() {
    let (ws, b) = tests_support_board(3);
    b.inc(0);
    b.set_external(1, 5);
    assert_eq!((b.load(1), b.in_flight(1), b.external(1)), (5, 0, 5));
    assert_eq!(b.min_max(), Some((0, 5)));
    assert_eq!(b.eligible_load_sum(), 6);
    let mut rng = Rng::with_seed(4);
    for _ in 0..50 {
        assert_eq!(b.pick_least_loaded(&ws, &[], &mut rng), Some(2));
    }
    // Own requests on top of external load; a dec never eats into the external part.
    b.inc(1);
    assert_eq!((b.load(1), b.in_flight(1)), (6, 1));
    b.dec(1);
    if !cfg!(debug_assertions) {
        b.dec(1); // unmatched: ignored
    }
    assert_eq!((b.load(1), b.in_flight(1), b.external(1)), (5, 0, 5));
    // Lowering it moves the worker back down at once.
    b.set_external(1, 0);
    assert_eq!(b.min_max(), Some((0, 1)));
    // An ineligible worker keeps its external load out of the aggregates, and brings it back.
    b.set_external(2, 9);
    b.set_eligible(2, false);
    assert_eq!(b.min_max(), Some((0, 1)));
    b.set_eligible(2, true);
    assert_eq!(b.min_max(), Some((0, 9)));
    // Reports beyond the field are clamped, not wrapped into the eligibility bit.
    b.set_external(0, u32::MAX);
    assert_eq!(b.external(0), MAX_EXTERNAL);
    assert!(b.is_eligible(0));
    assert_eq!(b.load(0), MAX_EXTERNAL + 1);
    b.check_quiescent();
    assert_eq!(b.min_max(), naive_min_max(&b));
}

#[test]
fn external_load_on_saturated_levels_stays_exact() {
    let b = LoadBoard::with_levels(3, 4); // levels 0,1,2,3+
    for w in 0..3 {
        b.set_eligible(w, true);
    }
    b.set_external(0, 100);
    b.inc(1);
    assert_eq!(b.min_max(), Some((0, 100)));
    b.set_external(0, 2);
    assert_eq!(b.min_max(), Some((0, 2)));
    assert_eq!(b.eligible_load_sum(), 3);
    b.check_quiescent();
}

/// Requests start and end on every core while the telemetry thread rewrites external loads:
/// at quiescence the levels, min/max and sums are exact and each worker's load is exactly its
/// own held count plus the last external value written.
#[test]
fn concurrent_external_updates_are_exact_at_quiescence() {
    const N: usize = 24;
    let b = Arc::new(LoadBoard::with_levels(N, 16));
    for w in 0..N as u32 {
        b.set_eligible(w, true);
    }
    let writers: Vec<_> = (0..3u64)
        .map(|t| {
            let b = Arc::clone(&b);
            std::thread::spawn(move || {
                let mut rng = Rng::with_seed(500 + t);
                let ws: Vec<WorkerId> = (0..N as u32).collect();
                let mut held: Vec<WorkerId> = Vec::new();
                for _ in 0..40_000 {
                    match rng.below(8) {
                        0..=3 => {
                            let w = rng.below(N) as u32;
                            b.inc(w);
                            held.push(w);
                        }
                        4..=6 if !held.is_empty() => {
                            let w = held.swap_remove(rng.below(held.len()));
                            b.dec(w);
                        }
                        _ => {
                            let _ = b.min_max();
                            let _ = b.pick_least_loaded(&ws, &[], &mut rng);
                        }
                    }
                }
                held
            })
        })
        .collect();
    // The telemetry side: one thread (as in the gateway) rewriting every worker's external
    // load, sometimes to zero, sometimes past the top level.
    let telemetry = {
        let b = Arc::clone(&b);
        std::thread::spawn(move || {
            let mut rng = Rng::with_seed(77);
            let mut last = [0u32; N];
            for i in 0..30_000 {
                let w = rng.below(N);
                let x = match i % 5 {
                    0 => 0,
                    1 => 40,
                    _ => rng.below(12) as u32,
                };
                b.set_external(w as u32, x);
                last[w] = x;
            }
            last
        })
    };
    let last = telemetry.join().unwrap();
    let mut held_all = [0u32; N];
    for t in writers {
        for w in t.join().unwrap() {
            held_all[w as usize] += 1;
        }
    }
    for w in 0..N {
        assert_eq!(b.in_flight(w as u32), held_all[w], "own, worker {w}");
        assert_eq!(b.external(w as u32), last[w], "external, worker {w}");
        assert_eq!(b.load(w as u32), held_all[w] + last[w], "worker {w}");
    }
    b.check_quiescent();
    assert_eq!(b.min_max(), naive_min_max(&b));
    let sum: u64 = (0..N as u32).map(|w| b.load(w) as u64).sum();
    assert_eq!(b.eligible_load_sum(), sum);
    // Clearing every external load leaves exactly the own counts.
    for w in 0..N as u32 {
        b.set_external(w, 0);
    }
    b.check_quiescent();
    let own: Vec<u32> = held_all.to_vec();
    assert_eq!(
        b.min_max(),
        Some((*own.iter().min().unwrap(), *own.iter().max().unwrap()))
    );
}

fn tests_support_board(n: u32) -> (Vec<WorkerId>, LoadBoard) {
    super::tests_support::board(n)
}
