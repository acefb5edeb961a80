use super::*;
use std::collections::{HashMap, HashSet};

/// Replays events as an index would (per hash: parent, tokens) and checks every rule the
/// gateway's index relies on: a store's parent is held, token counts are blocks × size, the
/// tokens of a hash never change, removals name held leaves only.
#[derive(Default)]
struct Model {
    held: HashMap<u64, Option<u64>>,
    children: HashMap<u64, u32>,
    tokens_of: HashMap<u64, Vec<u32>>,
}

impl Model {
    fn apply(&mut self, events: &[CacheEvent], bs: usize) {
        for e in events {
            match e {
                CacheEvent::Stored {
                    hashes,
                    parent,
                    tokens,
                    ..
                } => {
                    assert_eq!(tokens.len(), hashes.len() * bs, "tokens = blocks × size");
                    if let Some(p) = parent {
                        assert!(self.held.contains_key(p), "parent {p:x} is held");
                    }
                    let mut par = *parent;
                    for (h, t) in hashes.iter().zip(tokens.chunks(bs)) {
                        assert!(
                            !self.held.contains_key(h),
                            "a held block is not stored again"
                        );
                        if let Some(old) = self.tokens_of.insert(*h, t.to_vec()) {
                            assert_eq!(old, t, "a hash always carries the same tokens");
                        }
                        self.held.insert(*h, par);
                        if let Some(p) = par {
                            *self.children.entry(p).or_default() += 1;
                        }
                        par = Some(*h);
                    }
                }
                CacheEvent::Removed { hashes, .. } => {
                    for h in hashes {
                        let parent = self.held.remove(h).expect("removed blocks are held");
                        assert_eq!(
                            self.children.get(h).copied().unwrap_or(0),
                            0,
                            "only leaves are removed"
                        );
                        if let Some(p) = parent {
                            *self.children.get_mut(&p).unwrap() -= 1;
                        }
                    }
                }
                CacheEvent::Cleared => {
                    self.held.clear();
                    self.children.clear();
                }
            }
        }
    }
}

#[test]
fn the_mix_keeps_chains_held_removals_leaves_and_the_capacity() {
    let mut rng = Rng::new(7);
    let mut r = Rank::new(16, 400);
    let mut m = Model::default();
    let (mut stored, mut removed, mut stores, mut extends) = (0u64, 0u64, 0u64, 0u64);
    for i in 0..5_000u64 {
        let p = if i % 97 == 0 {
            r.marker(4, &mut rng, i, i + 50).0
        } else {
            r.request(&mut rng, i)
        };
        for e in &p.events {
            if let CacheEvent::Stored { parent, .. } = e {
                stores += 1;
                if parent.is_some() {
                    extends += 1;
                }
            }
        }
        m.apply(&p.events, 16);
        stored += p.stored;
        removed += p.removed;
        assert_eq!(m.held.len(), r.held, "the rank's count is the blocks held");
        assert!(r.held <= r.capacity + MAX_CHAIN, "bounded: {}", r.held);
    }
    assert_eq!(stored - removed, r.held as u64);
    assert!(removed > 0, "past the capacity, leaves are removed");
    let mean = stored as f64 / 5_000.0;
    assert!((14.0..24.0).contains(&mean), "~16 blocks a request: {mean}");
    assert!(extends * 2 > stores, "most stores chain from a parent");
}

#[test]
fn pinned_seeds_and_markers_survive_eviction() {
    let mut rng = Rng::new(3);
    let mut r = Rank::new(16, 300);
    r.start(0, 10, true, &mut rng, 0);
    let seed = r.convs[0].hashes.clone();
    let (_, tokens) = r.marker(4, &mut rng, 0, 1_000);
    assert_eq!(tokens.len(), 64);
    let marker = r.convs[1].hashes.clone();
    for t in 0..500 {
        r.request(&mut rng, t);
    }
    let held: HashSet<u64> = r.convs.iter().flat_map(|c| c.hashes.clone()).collect();
    assert!(seed.iter().all(|h| held.contains(h)), "the seed is pinned");
    assert!(
        marker.iter().all(|h| held.contains(h)),
        "the marker is pinned until 1000 ms"
    );
    for t in 1_000..3_000 {
        r.request(&mut rng, t);
    }
    let held: HashSet<u64> = r.convs.iter().flat_map(|c| c.hashes.clone()).collect();
    assert!(
        !marker.iter().all(|h| held.contains(h)),
        "then it is evictable"
    );
}

#[test]
fn system_prompts_are_shared_and_prompts_rebuild() {
    let a = system_prompt(5);
    assert_eq!(a, system_prompt(5));
    assert!((2..=8).contains(&a.len()));
    assert_ne!(system_prompt(5), system_prompt(6));
    let mut rng = Rng::new(1);
    let mut r = Rank::new(8, 1000);
    let p = r.start(5, 3, false, &mut rng, 0);
    let CacheEvent::Stored { tokens, .. } = &p.events[0] else {
        panic!("first the system prompt")
    };
    assert_eq!(&r.prompt(0)[..tokens.len()], &tokens[..]);
    assert_eq!(r.prompt(0).len(), (a.len() + 3) * 8);
    assert!(tokens.iter().all(|&t| (t as u64) < VOCAB));
}
