use super::*;
use crate::base::text::SharedText;
use crate::route::recent::RecentInserts;
use crate::tree::TreeKey;
use crate::workers::load::tests_support::board;

fn set_load(b: &LoadBoard, w: WorkerId, l: u32) {
    while b.load(w) < l {
        b.inc(w);
    }
    while b.load(w) > l {
        b.dec(w);
    }
}

fn m(matched: usize, total: usize, ws: &[WorkerId]) -> Option<MatchResult<'_>> {
    Some(MatchResult {
        matched_chars: matched,
        request_chars: total,
        workers: ws,
    })
}

#[test]
fn hit_above_threshold_goes_to_the_holder() {
    let (ws, b) = board(4);
    set_load(&b, 2, 5); // the holder is busier, affinity still wins
    let mut rng = Rng::with_seed(1);
    let p = Params::default();
    let d = select(&p, &ws, &[], &b, &mut rng, || m(40, 100, &[2])).unwrap();
    assert_eq!(d.worker, 2);
    assert_eq!(d.branch, Branch::CacheHit);
    assert!(d.insert_text);
    assert_eq!(d.matched_chars, 40);
}

#[test]
fn several_holders_least_loaded_wins_random_among_ties() {
    let (ws, b) = board(6);
    set_load(&b, 1, 3);
    set_load(&b, 3, 1);
    set_load(&b, 4, 1);
    set_load(&b, 5, 2);
    let mut rng = Rng::with_seed(2);
    let p = Params::default();
    let mut seen = [0u32; 6];
    for _ in 0..400 {
        let d = select(&p, &ws, &[], &b, &mut rng, || m(90, 100, &[1, 3, 4, 5])).unwrap();
        assert_eq!(d.branch, Branch::CacheHit);
        seen[d.worker as usize] += 1;
    }
    assert_eq!(seen[1] + seen[5] + seen[0] + seen[2], 0, "{seen:?}");
    assert!(seen[3] > 120 && seen[4] > 120, "{seen:?}");
}

#[test]
fn exactly_at_threshold_is_a_miss() {
    let (ws, b) = board(3);
    set_load(&b, 0, 1);
    set_load(&b, 1, 1);
    let mut rng = Rng::with_seed(3);
    let p = Params::default();
    for (matched, total) in [(3, 10), (30, 100), (300, 1000)] {
        let d = select(&p, &ws, &[], &b, &mut rng, || m(matched, total, &[0])).unwrap();
        assert_eq!(d.branch, Branch::CacheMiss, "{matched}/{total}");
        assert_eq!(d.worker, 2, "a miss goes to the least loaded");
        assert!(d.insert_text);
    }
    let d = select(&p, &ws, &[], &b, &mut rng, || m(31, 100, &[0])).unwrap();
    assert_eq!((d.worker, d.branch), (0, Branch::CacheHit));
    // Empty text: rate 0 → miss.
    let d = select(&p, &ws, &[], &b, &mut rng, || m(0, 0, &[0])).unwrap();
    assert_eq!(d.branch, Branch::CacheMiss);
}

#[test]
fn misses_spread_over_ties() {
    let (ws, b) = board(8);
    let mut rng = Rng::with_seed(4);
    let p = Params::default();
    let mut seen = [0u32; 8];
    for _ in 0..800 {
        let d = select(&p, &ws, &[], &b, &mut rng, || m(0, 50, &[])).unwrap();
        assert_eq!(d.branch, Branch::CacheMiss);
        seen[d.worker as usize] += 1;
    }
    assert!(
        seen.iter().all(|&c| c > 50),
        "not all on one worker: {seen:?}"
    );
}

#[test]
fn an_unpublished_insert_that_matches_more_wins_over_the_snapshot() {
    let (ws, b) = board(4);
    let mut rng = Rng::with_seed(9);
    let p = Params::default();
    let mut tree = RadixTree::new();
    tree.insert("shared system prompt", 1, 1);
    let text = "shared system prompt, then the first question";
    // Worker 3 took this conversation a moment ago; the snapshot does not show it yet.
    let ring = RecentInserts::new();
    ring.push(TreeKey::Default, SharedText::copy_of(&text[..30]), 3, 7);
    let recent = RecentProbe {
        ring: &ring,
        tree: TreeKey::Default,
        epoch: 7,
    };
    let d = select_with_tree(
        &p,
        Lookup {
            text,
            tree: Some(&tree),
            recent: Some(recent),
        },
        &ws,
        &[],
        &b,
        &mut rng,
    )
    .unwrap();
    assert_eq!(
        (d.worker, d.branch, d.matched_chars),
        (3, Branch::CacheHit, 30)
    );
    // A recent match no longer than the snapshot's loses to it.
    let short = RecentInserts::new();
    short.push(
        TreeKey::Default,
        SharedText::copy_of("shared system prompt"),
        3,
        7,
    );
    let d = select_with_tree(
        &p,
        Lookup {
            text,
            tree: Some(&tree),
            recent: Some(RecentProbe {
                ring: &short,
                tree: TreeKey::Default,
                epoch: 7,
            }),
        },
        &ws,
        &[],
        &b,
        &mut rng,
    )
    .unwrap();
    assert_eq!(d.worker, 1);
}

#[test]
fn no_tree_is_a_random_least_loaded_miss() {
    let (ws, b) = board(4);
    set_load(&b, 0, 2);
    let mut rng = Rng::with_seed(5);
    let p = Params::default();
    let mut seen = [0u32; 4];
    for _ in 0..300 {
        let d = select_with_tree(
            &p,
            Lookup {
                text: "hello",
                tree: None,
                recent: None,
            },
            &ws,
            &[],
            &b,
            &mut rng,
        )
        .unwrap();
        assert_eq!((d.branch, d.matched_chars), (Branch::CacheMiss, 0));
        seen[d.worker as usize] += 1;
    }
    assert_eq!(seen[0], 0);
    assert!(seen[1..].iter().all(|&c| c > 60), "{seen:?}");
}

#[test]
fn imbalance_needs_both_conditions() {
    let p = Params::default();
    // abs gap 80 > 64 but 280 > 200·1.5 = 300 fails → balanced.
    assert!(!p.is_imbalanced(200, 280));
    // rel 10 > 1·1.5 but abs gap 9 ≤ 64 → balanced.
    assert!(!p.is_imbalanced(1, 10));
    // Exactly 64 apart is not "more than 64".
    assert!(!p.is_imbalanced(0, 64));
    assert!(p.is_imbalanced(0, 65));
    assert!(p.is_imbalanced(100, 165 + 100));

    let (ws, b) = board(3);
    let mut rng = Rng::with_seed(6);
    // Only the absolute condition: the cache hit stands.
    set_load(&b, 0, 200);
    set_load(&b, 1, 280);
    set_load(&b, 2, 240);
    let d = select(&p, &ws, &[], &b, &mut rng, || m(90, 100, &[1])).unwrap();
    assert_eq!((d.worker, d.branch), (1, Branch::CacheHit));
    // Only the relative condition: the cache hit stands.
    set_load(&b, 0, 1);
    set_load(&b, 1, 10);
    set_load(&b, 2, 5);
    let d = select(&p, &ws, &[], &b, &mut rng, || m(90, 100, &[1])).unwrap();
    assert_eq!((d.worker, d.branch), (1, Branch::CacheHit));
    // Both: least loaded, text still inserted, the tree is not consulted.
    set_load(&b, 1, 70);
    let d = select(&p, &ws, &[], &b, &mut rng, || -> Option<MatchResult<'_>> {
        panic!("imbalanced without the window must not match")
    })
    .unwrap();
    assert_eq!((d.worker, d.branch), (0, Branch::Imbalanced));
    assert!(d.insert_text);
}

#[test]
fn imbalanced_ties_are_random() {
    let (ws, b) = board(4);
    set_load(&b, 3, 100);
    let mut rng = Rng::with_seed(7);
    let p = Params::default();
    let mut seen = [0u32; 4];
    for _ in 0..300 {
        let d = select(&p, &ws, &[], &b, &mut rng, || m(90, 100, &[3])).unwrap();
        assert_eq!(d.branch, Branch::Imbalanced);
        seen[d.worker as usize] += 1;
    }
    assert_eq!(seen[3], 0);
    assert!(seen[..3].iter().all(|&c| c > 60), "{seen:?}");
}

#[test]
fn affinity_window_keeps_a_close_holder() {
    let (ws, b) = board(3);
    let p = Params {
        affinity_window: true,
        ..Params::default()
    };
    let mut rng = Rng::with_seed(8);
    set_load(&b, 0, 0);
    set_load(&b, 1, 60); // within 0 + 64
    set_load(&b, 2, 100); // makes the fleet imbalanced
    assert!(p.is_imbalanced(0, 100));
    let d = select(&p, &ws, &[], &b, &mut rng, || m(80, 100, &[1])).unwrap();
    assert_eq!(
        (d.worker, d.branch, d.matched_chars),
        (1, Branch::AffinityWindow, 80)
    );
    // Holder outside the window → least loaded.
    let d = select(&p, &ws, &[], &b, &mut rng, || m(80, 100, &[2])).unwrap();
    assert_eq!((d.worker, d.branch), (0, Branch::Imbalanced));
    // Low match rate → least loaded even if the holder is close.
    let d = select(&p, &ws, &[], &b, &mut rng, || m(10, 100, &[1])).unwrap();
    assert_eq!((d.worker, d.branch), (0, Branch::Imbalanced));
    // Without the option the close holder is ignored.
    let d = select(&Params::default(), &ws, &[], &b, &mut rng, || {
        m(80, 100, &[1])
    })
    .unwrap();
    assert_eq!((d.worker, d.branch), (0, Branch::Imbalanced));
}

#[test]
fn ineligible_or_excluded_holders_make_a_miss() {
    let (ws, b) = board(4);
    set_load(&b, 0, 3);
    set_load(&b, 1, 3);
    set_load(&b, 2, 3);
    let mut rng = Rng::with_seed(9);
    let p = Params::default();
    b.set_eligible(1, false);
    let d = select(&p, &ws, &[2], &b, &mut rng, || m(90, 100, &[1, 2])).unwrap();
    assert_eq!(
        (d.worker, d.branch, d.matched_chars),
        (3, Branch::CacheMiss, 90)
    );
    // One holder left: it wins even though another is lighter.
    let d = select(&p, &ws, &[2], &b, &mut rng, || m(90, 100, &[0, 1, 2])).unwrap();
    assert_eq!((d.worker, d.branch), (0, Branch::CacheHit));
}

#[test]
fn exclusions_shape_the_balance_check() {
    let (ws, b) = board(3);
    set_load(&b, 0, 0);
    set_load(&b, 1, 100);
    set_load(&b, 2, 90);
    let mut rng = Rng::with_seed(10);
    let p = Params::default();
    // With worker 0 excluded the remaining loads (90, 100) are balanced → hit on 1.
    let d = select(&p, &ws, &[0], &b, &mut rng, || m(90, 100, &[1])).unwrap();
    assert_eq!((d.worker, d.branch), (1, Branch::CacheHit));
    // Without the exclusion the fleet is imbalanced.
    let d = select(&p, &ws, &[], &b, &mut rng, || m(90, 100, &[1])).unwrap();
    assert_eq!((d.worker, d.branch), (0, Branch::Imbalanced));
}

#[test]
fn nothing_eligible_is_none() {
    let (ws, b) = board(3);
    let mut rng = Rng::with_seed(11);
    let p = Params::default();
    assert_eq!(
        select(&p, &ws, &[0, 1, 2], &b, &mut rng, || m(90, 100, &[1])),
        None
    );
    for w in 0..3 {
        b.set_eligible(w, false);
    }
    assert_eq!(
        select(&p, &ws, &[], &b, &mut rng, || m(90, 100, &[1])),
        None
    );
    assert_eq!(
        select_with_tree(
            &p,
            Lookup {
                text: "x",
                tree: None,
                recent: None
            },
            &ws,
            &[],
            &b,
            &mut rng
        ),
        None
    );
}

fn exact<'a>(
    prompt: usize,
    cached: &'a [(WorkerId, usize)],
    warm: &'a [WorkerId],
) -> ExactInput<'a> {
    ExactInput {
        prompt_tokens: prompt,
        cached,
        exact_workers: warm,
        holders: Box::leak(Box::default()),
    }
}

#[test]
fn mixed_exact_tokens_decide_for_warm_workers() {
    let mut h = Vec::new();
    // Worker 1 holds 80 of 100 tokens, worker 2 holds 40: worker 1's rate.
    let r = mixed_holders(exact(100, &[(1, 80), (2, 40)], &[1, 2]), None, &mut h);
    assert_eq!((r, h.clone()), (Some((80, 100)), vec![1]));
    // Ties in tokens: every holder of the best count.
    mixed_holders(exact(100, &[(1, 80), (2, 80)], &[1, 2]), None, &mut h);
    h.sort_unstable();
    assert_eq!(h, vec![1, 2]);
}

#[test]
fn mixed_the_text_tree_speaks_only_for_workers_without_complete_events() {
    let mut h = Vec::new();
    // The tree says worker 1 (warm) holds 90 %: ignored, the events know better (nothing).
    let r = mixed_holders(exact(100, &[], &[1]), m(90, 100, &[1]), &mut h);
    assert_eq!((r, h.is_empty()), (Some((0, 100)), true));
    // The tree says worker 3 (no events) holds 90 %, the events say worker 1 holds 50 %.
    let r = mixed_holders(exact(100, &[(1, 50)], &[1]), m(90, 100, &[3]), &mut h);
    assert_eq!((r, h.clone()), (Some((90, 100)), vec![3]));
    // Equal rates: both sides' holders.
    let r = mixed_holders(exact(100, &[(1, 50)], &[1]), m(50, 100, &[3, 1]), &mut h);
    h.sort_unstable();
    assert_eq!((r, h.clone()), (Some((50, 100)), vec![1, 3]));
    // The events' rate is better.
    let r = mixed_holders(exact(100, &[(1, 95)], &[1]), m(50, 100, &[3]), &mut h);
    assert_eq!((r, h.clone()), (Some((95, 100)), vec![1]));
}

#[test]
fn mixed_selection_applies_the_seed_threshold_and_balance() {
    let (ws, b) = board(3);
    let mut rng = Rng::with_seed(5);
    let p = Params::default(); // cache_threshold 0.3
    let no_text = Lookup {
        text: "",
        tree: None,
        recent: None,
    };
    let d = select_mixed(
        &p,
        exact(100, &[(2, 40)], &[0, 1, 2]),
        no_text,
        &ws,
        &[],
        &b,
        &mut rng,
    )
    .unwrap();
    assert_eq!((d.worker, d.branch), (2, Branch::CacheHit));
    // The prediction and the prompt's size are both in tokens (the metric divides one by the
    // other: characters under tokens read 4x too low).
    assert_eq!((d.predicted_chars, d.request_size), (40, 100));
    // 20 % is below the threshold: least loaded (worker 2 is busy, so never it).
    b.inc(2);
    for _ in 0..20 {
        let d = select_mixed(
            &p,
            exact(100, &[(2, 20)], &[0, 1, 2]),
            no_text,
            &ws,
            &[],
            &b,
            &mut rng,
        )
        .unwrap();
        assert_eq!(d.branch, Branch::CacheMiss);
        assert_ne!(d.worker, 2);
    }
}

#[test]
fn the_prediction_counts_only_what_the_chosen_worker_holds() {
    let (ws, b) = board(3);
    let mut rng = Rng::with_seed(11);
    let p = Params::default();
    // A hit: the holder is chosen, and all of the match is predicted to hit.
    let d = select(&p, &ws, &[], &b, &mut rng, || m(40, 100, &[2])).unwrap();
    assert_eq!((d.branch, d.predicted_chars), (Branch::CacheHit, 40));
    assert_eq!(
        d.request_size, 100,
        "the prompt's size comes with the match"
    );
    // A miss below the threshold that lands elsewhere predicts nothing.
    set_load(&b, 2, 1);
    let d = select(&p, &ws, &[], &b, &mut rng, || m(20, 100, &[2])).unwrap();
    assert_eq!(d.branch, Branch::CacheMiss);
    assert_ne!(d.worker, 2);
    assert_eq!((d.matched_chars, d.predicted_chars), (20, 0));
    // A miss whose least-loaded pick happens to hold the prefix predicts the match.
    set_load(&b, 2, 0);
    set_load(&b, 0, 1);
    set_load(&b, 1, 1);
    let d = select(&p, &ws, &[], &b, &mut rng, || m(20, 100, &[2])).unwrap();
    assert_eq!((d.worker, d.predicted_chars), (2, 20));
}

#[test]
fn engine_reported_load_makes_the_fleet_imbalanced() {
    let (ws, b) = board(2);
    let mut rng = Rng::with_seed(12);
    let p = Params::default();
    // The prefix holder is busy with requests another gateway copy sent: the engine says 100.
    b.set_external(1, 100);
    let d = select(&p, &ws, &[], &b, &mut rng, || m(90, 100, &[1])).unwrap();
    assert_eq!((d.worker, d.branch), (0, Branch::Imbalanced));
    assert_eq!(d.predicted_chars, 0);
    // Once the engine drains, affinity wins again.
    b.set_external(1, 0);
    let d = select(&p, &ws, &[], &b, &mut rng, || m(90, 100, &[1])).unwrap();
    assert_eq!((d.worker, d.branch), (1, Branch::CacheHit));
}

#[test]
fn request_size_counts_every_character_whatever_matched() {
    let (ws, b) = board(4);
    let mut rng = Rng::with_seed(5);
    let p = Params::default();
    let text = "héllo wörld, ünïcode ✓ then ascii and 日本語 at the end";
    let chars = text.chars().count();
    let boundaries: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
    for &cut in boundaries.iter().step_by(3).chain([text.len()].iter()) {
        let mut tree = RadixTree::new();
        tree.insert(&text[..cut], 1, 1);
        let lookup = |recent| Lookup {
            text,
            tree: Some(&tree),
            recent,
        };
        let d = select_with_tree(&p, lookup(None), &ws, &[], &b, &mut rng).unwrap();
        assert_eq!(d.request_size, chars, "tree holding {cut} bytes");
        let k = text[..cut].chars().count();
        if k == chars {
            continue;
        }
        // An unpublished insert one character longer than the tree's match.
        let longer = boundaries.get(k + 1).copied().unwrap_or(text.len());
        let ring = RecentInserts::new();
        ring.push(TreeKey::Default, SharedText::copy_of(&text[..longer]), 2, 0);
        let recent = RecentProbe {
            ring: &ring,
            tree: TreeKey::Default,
            epoch: 0,
        };
        let d = select_with_tree(&p, lookup(Some(recent)), &ws, &[], &b, &mut rng).unwrap();
        assert_eq!(
            d.matched_chars,
            k + 1,
            "the insert past {cut} bytes counted"
        );
        assert_eq!(d.request_size, chars, "recent insert past {cut} bytes");
    }
}

#[test]
fn the_policy_reads_the_tree_then_the_servers_tokens_when_it_has_them() {
    let (ws, b) = board(3);
    let mut rng = Rng::with_seed(13);
    let p = CacheAware::from_config(&PolicyConfig::default());
    assert!(p.needs_tree() && p.reads_text());
    let text = "a shared system prompt, then the question";
    let mut tree = RadixTree::new();
    tree.insert(text, 1, 1);
    // The text tree alone: worker 1 holds the whole prompt.
    let input = RouteInput::new(text, 0);
    let d = p.select(&input, &ws, &b, Some(&tree), &mut rng).unwrap();
    assert_eq!((d.worker, d.branch), (1, Branch::CacheHit));
    assert!(d.insert_text);
    // No tree for the model: a miss.
    let d = p.select(&input, &ws, &b, None, &mut rng).unwrap();
    assert_eq!(d.branch, Branch::CacheMiss);
    // With KV events for every worker the servers' tokens decide: worker 2 holds 80 of 100.
    let input = RouteInput {
        exact: Some(exact(100, &[(2, 80)], &[0, 1, 2])),
        ..input
    };
    let d = p.select(&input, &ws, &b, Some(&tree), &mut rng).unwrap();
    assert_eq!((d.worker, d.branch), (2, Branch::CacheHit));
    assert_eq!((d.matched_chars, d.request_size), (80, 100));
}
