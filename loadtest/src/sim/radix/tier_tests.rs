//! The host tier and cache namespaces, checked against the tree's accounting and a consumer's
//! view of the event stream.

use super::tests::{ok, random_key, take, Consumer};
use super::*;
use crate::rng::Rng;

/// `(medium, hashes)` of each event, stores and removals alike, for order assertions.
fn media(evs: &[CacheEvent]) -> Vec<(&'static str, Medium, Vec<u64>)> {
    evs.iter()
        .map(|e| match e {
            CacheEvent::Stored { hashes, medium, .. } => ("stored", *medium, hashes.clone()),
            CacheEvent::Removed { hashes, medium } => ("removed", *medium, hashes.clone()),
            CacheEvent::Cleared => ("cleared", Medium::Gpu, Vec::new()),
        })
        .collect()
}

fn hashes_of(evs: &[CacheEvent]) -> Vec<u64> {
    evs.iter()
        .flat_map(|e| match e {
            CacheEvent::Stored { hashes, .. } => hashes.clone(),
            _ => Vec::new(),
        })
        .collect()
}

#[test]
fn device_eviction_backs_up_to_host_before_dropping_the_device_copy() {
    let mut c = RadixCache::new(8, 2).with_host_tier(8);
    c.enable_events();
    let mut m = Consumer::default();
    c.insert(&[1, 1, 1, 1]);
    c.insert(&[2, 2, 2, 2]);
    let evs = take(&mut c);
    let a = hashes_of(&evs[..1]);
    m.apply(&evs, 2);
    // 4 more slots: the least recent node (1 1 1 1) leaves the device for host memory.
    assert!(c.alloc(4));
    let evs = take(&mut c);
    assert_eq!(
        media(&evs),
        vec![
            ("stored", Medium::CpuPinned, a.clone()),
            ("removed", Medium::Gpu, a.clone()),
        ],
        "the host copy exists before the device copy goes"
    );
    let CacheEvent::Stored { parent, tokens, .. } = &evs[0] else {
        panic!("{evs:?}")
    };
    assert_eq!((*parent, &tokens[..]), (None, &[1, 1, 1, 1][..]));
    m.apply(&evs, 2);
    m.check(&c);
    assert_eq!(
        c.peek_prefix_in(&Namespace::default(), &[1, 1, 1, 1]),
        (0, 4)
    );
    assert_eq!(c.peek_prefix(&[1, 1, 1, 1]), 0, "no longer a device hit");
    assert_eq!((c.tree_tokens(), c.host_tokens()), (4, 4));
    assert_eq!(c.stats().backed_up_tokens, 4);
    ok(&c);
}

#[test]
fn host_memory_evicts_its_least_recent_copy_to_make_room() {
    let mut c = RadixCache::new(4, 2).with_host_tier(4);
    c.enable_events();
    let mut m = Consumer::default();
    c.insert(&[1, 1, 1, 1]);
    assert!(c.alloc(4), "1s go to host");
    c.free(4);
    c.insert(&[2, 2, 2, 2]);
    m.apply(&take(&mut c), 2);
    let ones = c.nodes.iter().find(|n| n.live && n.key == [1, 1, 1, 1]);
    let ones = ones.map(|n| n.hashes.clone()).unwrap();
    // The 2s must go to host too: host memory is full of 1s, the least recent copy, which go.
    assert!(c.alloc(4));
    let evs = take(&mut c);
    assert_eq!(
        media(&evs)[0],
        ("removed", Medium::CpuPinned, ones),
        "{evs:?}"
    );
    assert_eq!(media(&evs)[1].1, Medium::CpuPinned);
    assert_eq!(media(&evs)[2].1, Medium::Gpu);
    m.apply(&evs, 2);
    m.check(&c);
    let ns = Namespace::default();
    assert_eq!(c.peek_prefix_in(&ns, &[1, 1, 1, 1]), (0, 0));
    assert_eq!(c.peek_prefix_in(&ns, &[2, 2, 2, 2]), (0, 4));
    assert_eq!(c.stats().host_evicted_tokens, 4);
    ok(&c);
}

#[test]
fn a_node_host_memory_cannot_take_is_dropped_with_its_host_children_first() {
    // The (5 5 5 5 5 5) node is larger than the whole host tier: once its two small leaves
    // sit in host memory, evicting it drops them (deepest first) and then its device copy.
    let mut c = RadixCache::new(12, 2).with_host_tier(4);
    c.enable_events();
    let mut m = Consumer::default();
    c.insert(&[5, 5, 5, 5, 5, 5, 6, 6]);
    c.insert(&[5, 5, 5, 5, 5, 5, 7, 7]);
    m.apply(&take(&mut c), 2);
    let (_, top) = c.match_prefix(&[5, 5, 5, 5, 5, 5]);
    c.inc_lock(top);
    assert!(c.alloc(6), "both small leaves go to host");
    c.free(6);
    c.dec_lock(top);
    m.apply(&take(&mut c), 2);
    assert_eq!(c.host_tokens(), 4);
    assert!(c.alloc(12));
    let evs = take(&mut c);
    let got = media(&evs);
    assert_eq!(
        got.iter().map(|e| (e.0, e.1)).collect::<Vec<_>>(),
        vec![
            ("removed", Medium::CpuPinned),
            ("removed", Medium::CpuPinned),
            ("removed", Medium::Gpu),
        ],
        "{evs:?}"
    );
    m.apply(&evs, 2);
    m.check(&c);
    assert_eq!((c.tree_tokens(), c.host_tokens()), (0, 0));
    ok(&c);
}

#[test]
fn load_back_turns_host_pages_into_device_pages() {
    let mut c = RadixCache::new(8, 2).with_host_tier(16);
    c.enable_events();
    let mut m = Consumer::default();
    let ns = Namespace::default();
    c.insert(&[1, 1, 2, 2, 3, 3]);
    assert!(c.alloc(8), "everything goes to host");
    c.free(8);
    m.apply(&take(&mut c), 2);
    assert_eq!(c.peek_prefix_in(&ns, &[1, 1, 2, 2, 3, 3, 4]), (0, 6));
    let hm = c.match_prefix_in(&ns, &[1, 1, 2, 2, 9, 9]);
    assert_eq!((hm.device_len, hm.device_node, hm.host_len), (0, ROOT, 4));
    assert!(c.load_back(&hm));
    let evs = take(&mut c);
    assert_eq!(
        media(&evs).iter().map(|e| (e.0, e.1)).collect::<Vec<_>>(),
        vec![("stored", Medium::Gpu)],
        "one node loaded (the match split it)"
    );
    m.apply(&evs, 2);
    m.check(&c);
    assert_eq!(c.peek_prefix_in(&ns, &[1, 1, 2, 2, 3, 3]), (4, 2));
    assert_eq!((c.tree_tokens(), c.host_tokens()), (4, 6), "host copy kept");
    assert_eq!(c.stats().loaded_tokens, 4);
    // The loaded node is a plain device node: a lock pins it, and evicting it again drops
    // only its device copy (the host copy is still there).
    c.inc_lock(hm.node);
    assert_eq!(c.protected_tokens(), 4);
    c.dec_lock(hm.node);
    assert!(c.alloc(8));
    let evs = take(&mut c);
    assert_eq!(
        media(&evs).iter().map(|e| (e.0, e.1)).collect::<Vec<_>>(),
        vec![("removed", Medium::Gpu)]
    );
    m.apply(&evs, 2);
    m.check(&c);
    ok(&c);
    // No room on the device (everything is private): the load fails and changes nothing.
    let hm = c.match_prefix_in(&ns, &[1, 1, 2, 2]);
    assert!(!c.load_back(&hm));
    assert!(take(&mut c).is_empty());
    ok(&c);
}

#[test]
fn insert_reuses_host_only_nodes_on_its_path() {
    let mut c = RadixCache::new(8, 2).with_host_tier(8);
    c.enable_events();
    let mut m = Consumer::default();
    c.insert(&[1, 1, 2, 2]);
    assert!(c.alloc(8));
    c.free(8);
    m.apply(&take(&mut c), 2);
    // A request that recomputed (1 1 2 2) and more inserts it: the host node is on the
    // device again and the new page hangs below it.
    let (existing, _) = c.insert(&[1, 1, 2, 2, 3, 3]);
    assert_eq!(existing, 4);
    let evs = take(&mut c);
    assert_eq!(
        media(&evs).iter().map(|e| (e.0, e.1)).collect::<Vec<_>>(),
        vec![("stored", Medium::Gpu), ("stored", Medium::Gpu)]
    );
    m.apply(&evs, 2);
    m.check(&c);
    assert_eq!(c.peek_prefix(&[1, 1, 2, 2, 3, 3]), 6);
    ok(&c);
}

#[test]
fn namespaces_never_share_a_prefix_and_hash_apart() {
    let mut c = RadixCache::new(100, 2);
    c.enable_events();
    let a = Namespace::new(None, None, Some("salt-a"));
    let b = Namespace::new(None, None, Some("salt-b"));
    let lora = Namespace::new(None, Some("adapter"), None);
    let key = [1, 2, 3, 4, 5, 6];
    c.insert_in(&a, &key);
    assert_eq!(c.peek_prefix_in(&a, &key), (6, 0), "same salt hits");
    assert_eq!(c.peek_prefix_in(&b, &key), (0, 0), "another salt misses");
    assert_eq!(c.peek_prefix(&key), 0, "no salt misses");
    assert_eq!(c.peek_prefix_in(&lora, &key), (0, 0), "an adapter misses");
    let m = c.match_prefix_in(&b, &key);
    assert_eq!((m.device_len, m.host_len), (0, 0));
    c.insert_in(&b, &key);
    c.insert(&key);
    c.insert_in(&lora, &key);
    assert_eq!(c.tree_tokens(), 24, "four copies of the same tokens");
    let evs = take(&mut c);
    let mut all: Vec<u64> = hashes_of(&evs);
    assert_eq!(all.len(), 12);
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), 12, "every namespace hashes its pages apart");
    let tags: Vec<Option<(Option<&str>, Option<&str>)>> = evs
        .iter()
        .map(|e| match e {
            CacheEvent::Stored { tags, .. } => tags
                .as_ref()
                .map(|t| (t.cache_salt.as_deref(), t.lora_name.as_deref())),
            _ => panic!("{e:?}"),
        })
        .collect();
    assert_eq!(
        tags,
        vec![
            Some((Some("salt-a"), None)),
            Some((Some("salt-b"), None)),
            None,
            Some((None, Some("adapter"))),
        ]
    );
    // A split inside a namespace keeps the namespace (and its tags) on both halves.
    c.insert_in(&a, &[1, 2, 9, 9]);
    let evs = take(&mut c);
    let CacheEvent::Stored { tags, parent, .. } = &evs[0] else {
        panic!("{evs:?}")
    };
    assert_eq!(
        tags.as_ref().and_then(|t| t.cache_salt.as_deref()),
        Some("salt-a")
    );
    assert!(parent.is_some());
    assert_eq!(c.peek_prefix_in(&a, &[1, 2, 9, 9]), (4, 0));
    ok(&c);
}

#[test]
fn random_ops_with_a_host_tier_and_namespaces_keep_every_invariant() {
    let mut rng = Rng::new(11);
    let spaces = [
        Namespace::default(),
        Namespace::new(None, None, Some("s")),
        Namespace::new(Some("k"), Some("l"), None),
    ];
    for (page, host) in [(1usize, 60usize), (3, 90), (2, 7)] {
        let mut c = RadixCache::new(150, page).with_host_tier(host);
        c.enable_events();
        let mut m = Consumer::default();
        let mut held: Vec<NodeId> = Vec::new();
        let mut loads = 0;
        for step in 0..3000 {
            let ns = &spaces[rng.below(spaces.len())];
            let key = random_key(&mut rng, 40, 5, 2);
            match rng.below(6) {
                0 | 1 => {
                    if c.free_tokens() >= key.len() {
                        let (_, node) = c.insert_in(ns, &key);
                        if rng.chance(0.3) {
                            c.inc_lock(node);
                            held.push(node);
                        }
                    }
                }
                2 => {
                    if let Some(n) = held.pop() {
                        c.dec_lock(n);
                    }
                }
                3 => {
                    let n = rng.below(90);
                    if c.alloc(n) {
                        c.free(n);
                    }
                }
                4 => {
                    let hm = c.match_prefix_in(ns, &key);
                    if hm.host_len > 0 && c.load_back(&hm) {
                        loads += 1;
                        c.inc_lock(hm.node);
                        held.push(hm.node);
                    }
                }
                _ => {
                    if step % 211 == 0 && held.is_empty() {
                        c.flush();
                    } else {
                        c.match_prefix_in(ns, &key);
                    }
                }
            }
            m.apply(&take(&mut c), page);
            m.check(&c);
            c.check_invariants().unwrap();
        }
        assert!(
            c.stats().backed_up_tokens > 0,
            "page {page}: nothing backed up"
        );
        assert!(loads > 10, "page {page}: only {loads} loads");
        for &h in m.pages.keys() {
            let p = m.prefix(h);
            let (d, hst) = spaces
                .iter()
                .map(|ns| c.peek_prefix_in(ns, &p))
                .max_by_key(|&(d, h)| d + h)
                .unwrap();
            assert_eq!(d + hst, p.len(), "a stored chain the tree does not hold");
        }
    }
}
