use super::workers::Workers;
use super::*;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

/// Per worker, the strings it was sent. The tree's answers depend only on the prefix closure of
/// each worker's set, which is what this oracle computes naively.
#[derive(Default, Clone, Debug)]
struct Oracle {
    sets: BTreeMap<WorkerId, BTreeSet<String>>,
}

/// Common prefix of two strings in (chars, bytes).
fn common(a: &str, b: &str) -> (usize, usize) {
    let mut chars = 0;
    let mut bytes = 0;
    for (x, y) in a.chars().zip(b.chars()) {
        if x != y {
            break;
        }
        chars += 1;
        bytes += x.len_utf8();
    }
    (chars, bytes)
}

impl Oracle {
    fn insert(&mut self, key: &str, w: WorkerId) {
        self.sets.entry(w).or_default().insert(key.to_owned());
    }

    fn expected(&self, key: &str) -> (usize, usize, Vec<WorkerId>) {
        let best = self
            .sets
            .values()
            .flatten()
            .map(|s| common(s, key))
            .max()
            .unwrap_or((0, 0));
        if best.0 == 0 {
            return (0, 0, Vec::new());
        }
        let prefix = &key[..best.1];
        let workers = self
            .sets
            .iter()
            .filter(|(_, set)| set.iter().any(|s| s.starts_with(prefix)))
            .map(|(&w, _)| w)
            .collect();
        (best.0, best.1, workers)
    }

    fn chars(&self, w: WorkerId) -> u64 {
        let mut prefixes = BTreeSet::new();
        for s in self.sets.get(&w).into_iter().flatten() {
            for (i, c) in s.char_indices() {
                prefixes.insert(&s[..i + c.len_utf8()]);
            }
        }
        prefixes.len() as u64
    }
}

/// The root-to-leaf strings of `w` (nodes it holds with no child it holds): the same prefix
/// closure as whatever was inserted for `w` and survived.
fn leaf_strings(tree: &RadixTree, w: WorkerId) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    if !tree.root.workers.contains(w) {
        return out;
    }
    let mut stack: Vec<(&Node, Vec<u8>)> = vec![(&tree.root, Vec::new())];
    while let Some((node, path)) = stack.pop() {
        let mut leaf = true;
        for kid in node.kids.iter().filter(|k| k.workers.contains(w)) {
            leaf = false;
            let mut p = path.clone();
            p.extend_from_slice(kid.edge());
            stack.push((kid, p));
        }
        if leaf && !path.is_empty() {
            out.insert(String::from_utf8(path).expect("edges are whole characters"));
        }
    }
    out
}

fn check(tree: &RadixTree, oracle: &Oracle, probes: &[String]) {
    if let Err(e) = tree.check_invariants() {
        panic!("invariant: {e}");
    }
    for &w in oracle.sets.keys() {
        assert_eq!(tree.worker_chars(w), oracle.chars(w), "chars of worker {w}");
    }
    let keys = oracle.sets.values().flatten().chain(probes.iter());
    for key in keys {
        let m = tree.longest_match(key);
        let (chars, bytes, workers) = oracle.expected(key);
        assert_eq!(
            (m.matched_chars, m.matched_bytes, m.workers),
            (chars, bytes, &workers[..]),
            "match of {key:?}"
        );
    }
}

fn matched<'a>(t: &'a RadixTree, key: &str) -> (usize, &'a [WorkerId]) {
    let m = t.longest_match(key);
    (m.matched_chars, m.workers)
}

#[test]
fn empty_tree_matches_nothing() {
    let t = RadixTree::new();
    assert_eq!(matched(&t, ""), (0, &[][..]));
    assert_eq!(matched(&t, "abc"), (0, &[][..]));
    assert_eq!(t.node_count(), 1);
    assert_eq!(t.worker_chars(3), 0);
    t.check_invariants().unwrap();
}

#[test]
fn partial_edge_counts_and_stops() {
    let mut t = RadixTree::new();
    t.insert("hello world", 1, 1);
    assert_eq!(matched(&t, "hello there"), (6, &[1][..]));
    assert_eq!(matched(&t, "hello world and more"), (11, &[1][..]));
    assert_eq!(matched(&t, "x"), (0, &[][..]));
    assert_eq!(matched(&t, ""), (0, &[][..]));
    t.insert("hello there", 2, 2);
    assert_eq!(matched(&t, "hello"), (5, &[1, 2][..]));
    assert_eq!(matched(&t, "hello th"), (8, &[2][..]));
    assert_eq!(t.worker_chars(1), 11);
    assert_eq!(t.worker_chars(2), 11);
    assert_eq!(t.total_chars(), 22);
    assert_eq!(t.node_count(), 4);
    t.check_invariants().unwrap();
}

#[test]
fn splits_never_cut_a_character() {
    let mut t = RadixTree::new();
    // 'é' = C3 A9, 'è' = C3 A8: the shared byte must not become an edge of its own.
    t.insert("café", 1, 1);
    t.insert("cafè", 2, 2);
    t.check_invariants().unwrap();
    let m = t.longest_match("café au lait");
    assert_eq!(
        (m.matched_chars, m.matched_bytes, m.workers),
        (4, 5, &[1][..])
    );
    assert_eq!(matched(&t, "cafe"), (3, &[1, 2][..]));
    // 'ê' = C3 AA shares the lead byte with both edges but no whole character.
    let m = t.longest_match("cafê");
    assert_eq!(
        (m.matched_chars, m.matched_bytes, m.workers),
        (3, 3, &[1, 2][..])
    );
    // Emoji sharing three of four bytes, directly under the root.
    t.insert("😀x", 3, 3);
    t.insert("😁y", 4, 4);
    t.check_invariants().unwrap();
    assert_eq!(matched(&t, "😀"), (1, &[3][..]));
    assert_eq!(matched(&t, "😁yy"), (2, &[4][..]));
    assert_eq!(matched(&t, "😂"), (0, &[][..]));
    assert_eq!(t.worker_chars(3), 2);
}

#[test]
fn tree_stays_canonical() {
    let mut t = RadixTree::new();
    t.insert("abcdef", 1, 1);
    // Ends inside an edge worker 1 already holds: no split.
    t.insert("abc", 1, 2);
    assert_eq!(t.node_count(), 2);
    // Extending worker 1's own leaf grows the edge instead of adding a child.
    t.insert("abcdefgh", 1, 3);
    assert_eq!(t.node_count(), 2);
    assert_eq!(t.worker_chars(1), 8);
    // A second worker ending inside the edge splits it ...
    t.insert("abc", 2, 4);
    assert_eq!(t.node_count(), 3);
    // ... and merges back once it covers the rest too.
    t.insert("abcdefgh", 2, 5);
    assert_eq!(t.node_count(), 2);
    assert_eq!(matched(&t, "abcd"), (4, &[1, 2][..]));
    t.check_invariants().unwrap();
}

#[test]
fn remove_worker_drops_and_merges() {
    let mut t = RadixTree::new();
    t.insert("abcdef", 1, 1);
    t.insert("abcxyz", 2, 2);
    t.insert("q", 2, 3);
    assert_eq!(t.node_count(), 5);
    t.remove_worker(2);
    t.check_invariants().unwrap();
    assert_eq!(t.node_count(), 2);
    assert_eq!(t.worker_chars(2), 0);
    assert_eq!(matched(&t, "abcxyz"), (3, &[1][..]));
    assert_eq!(matched(&t, "q"), (0, &[][..]));
    assert_eq!(t.worker_char_counts().collect::<Vec<_>>(), vec![(1, 6)]);
    // Removing an unknown worker is a no-op.
    t.remove_worker(9);
    assert_eq!(t.node_count(), 2);
}

#[test]
fn evict_takes_least_recent_leaves_first() {
    let mut t = RadixTree::new();
    t.insert("aaaaaaaaaa", 1, 1);
    t.insert("bbbbbbbbbb", 1, 2);
    t.insert("cccccccccc", 1, 3);
    assert_eq!(t.evict_worker(1, 30), 0);
    assert_eq!(t.evict_worker(1, 25), 10);
    assert_eq!(matched(&t, "aaaaaaaaaa"), (0, &[][..]));
    assert_eq!(matched(&t, "bbbbbbbbbb"), (10, &[1][..]));
    // Touch "b" so "c" becomes the oldest.
    t.insert("bbbbbbbbbb", 1, 4);
    assert_eq!(t.evict_worker(1, 10), 10);
    assert_eq!(matched(&t, "cccccccccc"), (0, &[][..]));
    assert_eq!(matched(&t, "bbbbbbbbbb"), (10, &[1][..]));
    assert_eq!(t.worker_chars(1), 10);
    t.check_invariants().unwrap();
}

#[test]
fn evict_repushes_parents_that_become_leaves() {
    let mut t = RadixTree::new();
    t.insert("abc", 2, 0);
    t.insert("abcdef", 1, 1);
    t.insert("abcxyz", 1, 5);
    t.insert("zz", 1, 3);
    assert_eq!(t.worker_chars(1), 11);
    // Oldest first: "def" (1), then "zz" (3).
    assert_eq!(t.evict_worker(1, 7), 5);
    assert_eq!(matched(&t, "zz"), (0, &[][..]));
    assert_eq!(matched(&t, "abcdef"), (3, &[1, 2][..]));
    // "xyz" (5) goes next, which exposes "abc" (5) as worker 1's leaf ...
    assert_eq!(t.evict_worker(1, 3), 3);
    assert_eq!(matched(&t, "abcxyz"), (3, &[1, 2][..]));
    // ... which goes last, leaving worker 2's copy.
    assert_eq!(t.evict_worker(1, 0), 3);
    assert_eq!(matched(&t, "abcxyz"), (3, &[2][..]));
    assert_eq!(t.node_count(), 2);
    assert_eq!(t.worker_chars(1), 0);
    t.check_invariants().unwrap();
}

#[test]
fn merged_chains_are_evicted_as_one_unit() {
    let mut t = RadixTree::new();
    t.insert("abcdef", 1, 1);
    t.insert("abcxyz", 1, 5);
    assert_eq!(t.evict_worker(1, 7), 3);
    // "abc" and "xyz" merged back into one leaf.
    assert_eq!(t.node_count(), 2);
    assert_eq!(t.evict_worker(1, 3), 6);
    assert_eq!(t.node_count(), 1);
    t.check_invariants().unwrap();
}

#[test]
fn evict_leaves_other_workers_alone() {
    let mut t = RadixTree::new();
    t.insert("system prompt. user: hi", 1, 1);
    t.insert("system prompt. user: hello", 2, 2);
    t.insert("system prompt. user: hi", 2, 3);
    let before: Vec<_> = [
        "system prompt. user: hi",
        "system prompt. user: hello",
        "sys",
    ]
    .iter()
    .map(|k| t.longest_match(k).matched_chars)
    .collect();
    let w2 = t.worker_chars(2);
    assert_eq!(t.evict_worker(1, 0), 23);
    t.check_invariants().unwrap();
    let after: Vec<_> = [
        "system prompt. user: hi",
        "system prompt. user: hello",
        "sys",
    ]
    .iter()
    .map(|k| t.longest_match(k).matched_chars)
    .collect();
    assert_eq!(before, after);
    assert_eq!(t.worker_chars(2), w2);
    assert_eq!(matched(&t, "system prompt. user: hi").1, &[2][..]);
}

#[test]
fn snapshots_are_unaffected_by_later_mutations() {
    let mut t = RadixTree::new();
    let keys = [
        "shared prefix one",
        "shared prefix two",
        "other",
        "shared",
        "sha",
    ];
    for (i, k) in keys.iter().enumerate() {
        t.insert(k, i as WorkerId % 3, i as u64);
    }
    let snap = t.clone();
    let before: Vec<(usize, Vec<WorkerId>)> = keys
        .iter()
        .map(|k| {
            let m = snap.longest_match(k);
            (m.matched_chars, m.workers.to_vec())
        })
        .collect();
    t.insert("shared prefix three", 2, 10);
    t.insert("sh", 5, 11);
    t.remove_worker(0);
    t.evict_worker(1, 2);
    t.insert("other things", 1, 12);
    let after: Vec<(usize, Vec<WorkerId>)> = keys
        .iter()
        .map(|k| {
            let m = snap.longest_match(k);
            (m.matched_chars, m.workers.to_vec())
        })
        .collect();
    assert_eq!(before, after);
    snap.check_invariants().unwrap();
    t.check_invariants().unwrap();
    assert_ne!(snap.node_count(), 0);
}

#[test]
fn deep_trees_need_no_deep_stack() {
    // Keys "a"^k + "b" make a chain as deep as the longest key; every operation must be
    // iterative. A 256 KiB stack would overflow on a recursive walk of this depth.
    let h = std::thread::Builder::new()
        .stack_size(256 * 1024)
        .spawn(|| {
            const DEPTH: usize = 2_000;
            let mut t = RadixTree::new();
            let mut key = String::new();
            for k in 0..DEPTH {
                key.truncate(k);
                key.push('b');
                t.insert(&key, (k % 3) as WorkerId, k as u64);
                key.pop();
                key.push('a');
            }
            assert!(t.node_count() > DEPTH);
            t.check_invariants().unwrap();
            key.truncate(DEPTH - 1);
            key.push('b');
            assert_eq!(t.longest_match(&key).matched_chars, DEPTH);
            let snap = t.clone();
            t.remove_worker(1);
            t.evict_worker(2, 10);
            t.check_invariants().unwrap();
            drop(t);
            snap.check_invariants().unwrap();
            drop(snap);
        })
        .unwrap();
    h.join().unwrap();
}

#[test]
fn node_is_compact() {
    // 56 + triomphe's 8-byte count = 64, a mimalloc size class.
    assert_eq!(std::mem::size_of::<Node>(), 56);
    assert_eq!(std::mem::size_of::<Workers>(), 16);
    assert_eq!(std::mem::size_of::<super::repr::Edge>(), 16);
    assert_eq!(std::mem::size_of::<super::repr::Kid>(), 16);
    assert_eq!(std::mem::size_of::<RadixTree>(), 24);
}

/// The buffer behind the edge of the node reached by following first-character `path`.
fn buffer_at(t: &RadixTree, path: &[char]) -> (Option<*const u8>, usize) {
    let mut node: &Node = &t.root;
    for &c in path {
        let mut b = [0u8; 4];
        let (i, _) = node.find_child(c.encode_utf8(&mut b).as_bytes()).unwrap();
        node = &node.kids[i];
    }
    (node.edge.buffer_id(), node.edge.len())
}

#[test]
fn path_copies_and_splits_share_edge_text() {
    // A 100k-character edge, published (the clone), then extended past and split by other
    // workers: the writer's copies of that node point into the same text, never a copy of it.
    let long = "a".repeat(100_000);
    let mut t = RadixTree::new();
    t.insert(&long, 0, 1);
    let snap = t.clone();
    let (buf, len) = buffer_at(&snap, &['a']);
    assert_eq!(len, 100_000);
    t.insert(&format!("{long}b"), 1, 2);
    assert_eq!(
        buffer_at(&t, &['a']),
        (buf, 100_000),
        "path copy shares the edge"
    );
    let snap2 = t.clone();
    t.insert(&format!("{}c", &long[..40_000]), 2, 3);
    // Split at 40k: both halves are ranges of the original buffer.
    assert_eq!(buffer_at(&t, &['a']), (buf, 40_000));
    assert_eq!(buffer_at(&t, &['a', 'a']), (buf, 60_000));
    t.check_invariants().unwrap();
    snap.check_invariants().unwrap();
    snap2.check_invariants().unwrap();
    assert_eq!(snap.longest_match(&format!("{long}b")).workers, &[0][..]);
}

#[test]
fn evicting_most_of_a_buffer_frees_it() {
    // Worker 1 shares 100 characters of worker 0's 100k-character edge; once worker 0 is gone
    // the short node must not keep the whole buffer alive.
    let long = "x".repeat(100_000);
    let mut t = RadixTree::new();
    t.insert(&long, 0, 1);
    t.insert(&format!("{}y", &long[..100]), 1, 2);
    t.insert(&format!("{}z", &long[..100]), 1, 3);
    let (buf, _) = buffer_at(&t, &['x']);
    let snap = t.clone();
    t.remove_worker(0);
    t.check_invariants().unwrap();
    let (after, len) = buffer_at(&t, &['x']);
    assert_eq!(len, 100);
    assert_ne!(after, buf, "a 100-byte edge holds a 100 kB buffer");
    assert!(t.root.kids[0].edge.buffer_len() <= 200);
    assert_eq!(
        buffer_at(&snap, &['x']),
        (buf, 100),
        "the snapshot keeps its own"
    );
}

#[test]
fn a_walk_through_a_node_left_with_little_of_its_buffer_compacts_it() {
    let long = "x".repeat(100_000);
    let mut t = RadixTree::new();
    t.insert(&long, 0, 1);
    t.insert(&format!("{}y", &long[..100]), 1, 2);
    // Worker 0 extends its leaf: the leaf gets a new buffer, the 100-character node above it
    // is left as the only user of the first one.
    t.insert(&format!("{long}more"), 0, 3);
    let (buf, _) = buffer_at(&t, &['x']);
    assert_eq!(t.root.kids[0].edge.buffer_len(), 100_000);
    t.insert(&format!("{}w", &long[..100]), 1, 4);
    t.check_invariants().unwrap();
    assert_ne!(buffer_at(&t, &['x']).0, buf);
    assert_eq!(t.root.kids[0].edge.buffer_len(), 100);
    // A split's halves are never compacted apart: each uses its share of one buffer.
    let mut u = RadixTree::new();
    u.insert(&long, 0, 1);
    u.insert(&format!("{}y", &long[..100]), 1, 2);
    u.insert(&format!("{}w", &long[..100]), 1, 3);
    assert_eq!(u.root.kids[0].edge.buffer_len(), 100_000);
}

#[test]
fn a_split_undone_joins_the_ranges_without_a_copy() {
    let long = "z".repeat(10_000);
    let mut t = RadixTree::new();
    t.insert(&long, 0, 1);
    let (buf, _) = buffer_at(&t, &['z']);
    // Worker 1 splits it at 5k; evicting worker 1 merges the halves back.
    t.insert(&format!("{}q", &long[..5_000]), 1, 2);
    t.remove_worker(1);
    t.check_invariants().unwrap();
    assert_eq!(buffer_at(&t, &['z']), (buf, 10_000));
}

#[derive(Debug, Clone)]
enum Op {
    Insert(WorkerId, String),
    Remove(WorkerId),
    Evict(WorkerId, u64),
    Match(String),
}

/// Short strings over an alphabet whose characters share leading bytes (é/è/ä, 中/丁, 😀/😁),
/// so splits land inside characters unless moved back.
fn text() -> impl Strategy<Value = String> {
    let alphabet = vec!['a', 'b', 'é', 'è', 'ä', '中', '丁', '😀', '😁'];
    prop::collection::vec(prop::sample::select(alphabet), 0..9)
        .prop_map(|v| v.into_iter().collect())
}

/// Workers 1, 33 and 65 share a bloom bit, so false positives of the bloom are exercised.
fn worker() -> impl Strategy<Value = WorkerId> {
    prop::sample::select(vec![0u32, 1, 33, 65])
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (worker(), text()).prop_map(|(w, s)| Op::Insert(w, s)),
        1 => worker().prop_map(Op::Remove),
        2 => (worker(), 0..20u64).prop_map(|(w, m)| Op::Evict(w, m)),
        2 => text().prop_map(Op::Match),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn behaves_like_the_oracle(ops in prop::collection::vec(op(), 1..40),
                               probes in prop::collection::vec(text(), 0..6)) {
        let mut t = RadixTree::new();
        let mut oracle = Oracle::default();
        let mut snapshots: Vec<(RadixTree, Oracle)> = Vec::new();
        for (now, op) in ops.into_iter().enumerate() {
            if now % 7 == 0 {
                snapshots.push((t.clone(), oracle.clone()));
            }
            match op {
                Op::Insert(w, s) => {
                    t.insert(&s, w, now as u64);
                    oracle.insert(&s, w);
                }
                Op::Remove(w) => {
                    t.remove_worker(w);
                    oracle.sets.remove(&w);
                }
                Op::Evict(w, max) => {
                    let before = t.worker_chars(w);
                    let others: Vec<_> = oracle.sets.keys().filter(|&&x| x != w)
                        .map(|&x| (x, t.worker_chars(x))).collect();
                    let removed = t.evict_worker(w, max);
                    let after = t.worker_chars(w);
                    prop_assert!(after <= max);
                    prop_assert_eq!(removed, before - after);
                    if before <= max {
                        prop_assert_eq!(removed, 0);
                    }
                    for (x, c) in others {
                        prop_assert_eq!(t.worker_chars(x), c);
                    }
                    if let Some(set) = oracle.sets.get_mut(&w) {
                        let left = leaf_strings(&t, w);
                        for s in &left {
                            prop_assert!(set.iter().any(|o| o.starts_with(s.as_str())),
                                "{s:?} was never inserted for {w}");
                        }
                        *set = left;
                    }
                }
                Op::Match(s) => {
                    let m = t.longest_match(&s);
                    let (chars, bytes, workers) = oracle.expected(&s);
                    prop_assert_eq!((m.matched_chars, m.matched_bytes, m.workers),
                                    (chars, bytes, &workers[..]));
                }
            }
            check(&t, &oracle, &probes);
        }
        for (snap, o) in &snapshots {
            check(snap, o, &probes);
        }
    }
}

#[test]
fn a_growing_conversation_appends_in_place_and_snapshots_keep_their_turn() {
    let turn1 = format!("system {}", "a".repeat(1000));
    let turn2 = format!("{turn1} {}", "b".repeat(300));
    let turn3 = format!("{turn2} {}", "c".repeat(300));
    let mut t = RadixTree::new();
    t.insert(&turn1, 0, 1);
    t.insert(&turn2, 0, 2); // moves to a buffer with room
    let (buf, _) = buffer_at(&t, &['s']);
    let snap = t.clone();
    t.insert(&turn3, 0, 3); // appended in place, after the snapshot's bytes
    assert_eq!(buffer_at(&t, &['s']), (buf, turn3.len()));
    assert_eq!(buffer_at(&snap, &['s']), (buf, turn2.len()));
    assert_eq!(snap.longest_match(&turn3).matched_bytes, turn2.len());
    // The snapshot's copy grows differently: its end is taken, so it moves to a new buffer.
    let mut other = snap.clone();
    let fork = format!("{turn2} {}", "d".repeat(300));
    other.insert(&fork, 0, 4);
    assert_ne!(buffer_at(&other, &['s']).0, buf);
    for (tree, text) in [(&t, &turn3), (&other, &fork), (&snap, &turn2)] {
        let m = tree.longest_match(text);
        assert_eq!((m.matched_bytes, m.workers), (text.len(), &[0][..]));
        tree.check_invariants().unwrap();
    }
    assert_eq!(t.longest_match(&fork).matched_bytes, turn2.len() + 1);
    assert_eq!(other.longest_match(&turn3).matched_bytes, turn2.len() + 1);
}
