//! The published half of the index: a persistent hash trie from radixgate's own block hash to
//! the sources (worker, dp rank) holding that block.
//!
//! Keys are already uniform 64-bit hashes, so the trie uses their bits directly: 6 bits per
//! level, a 64-bit occupancy bitmap and a dense slot array per node (depth ≤ 11, ~4 levels at a
//! million blocks). Two distinct keys always part by the last level, so there are no collision
//! lists. Nodes are `Arc`s: cloning the root is the whole cost of publishing a snapshot, and the
//! writer's next edit copies only the nodes on its path that a snapshot still shares
//! (`Arc::make_mut`), so a batch of edits never copies the index.

use crate::kv::wire::Tier;
use std::sync::Arc;

/// A source's dense number inside one index (see `writer`).
pub(super) type SourceId = u16;

/// One source's copy of a block in one storage tier, packed as `source << 2 | tier` so a holder
/// list stays 2 bytes an entry (a block on the GPU and in host memory of one server is two
/// holdings of one source).
pub(super) type Holding = u16;

/// Marks an unused inline holder slot.
const NONE: Holding = Holding::MAX;

/// Largest number of sources an index can number (every holding stays below `NONE`).
pub(super) const MAX_SOURCE_IDS: usize = (NONE >> 2) as usize;

/// The holding of source `s`'s copy in `tier`.
#[inline]
pub(super) fn holding(s: SourceId, tier: Tier) -> Holding {
    s << 2 | tier as u16
}

/// The source a holding belongs to.
#[inline]
pub(super) fn source_of(h: Holding) -> SourceId {
    h >> 2
}

/// A holding's tier bit ([`Tier::bit`]).
#[inline]
fn tier_bit(h: Holding) -> u8 {
    1 << (h & 3)
}

/// The holdings of one block, as a multiset: a source that stored the same tokens under two
/// engine hashes (e.g. two LoRA adapters) holds it twice, so removing one keeps the other. Up to
/// four holdings live inline (no allocation: most blocks are on one or two workers).
#[derive(Clone, Debug)]
pub(super) enum Holders {
    Inline([Holding; 4]),
    // A thin pointer keeps `Holders` at 16 bytes, so every trie slot stays small; the extra
    // allocation is paid only by blocks on more than four sources. Kept sorted, so a holding is
    // found by binary search among thousands. Shared, not owned: copying a
    // node on the writer's path (after a publication) must not copy the holder lists of the
    // blocks beside it, which for a system prompt every server stores are thousands long; a
    // list is copied only when its own block changes, once per publication.
    #[allow(clippy::rc_buffer)]
    Heap(Arc<Vec<Holding>>),
}

impl Holders {
    fn one(h: Holding) -> Self {
        Holders::Inline([h, NONE, NONE, NONE])
    }

    /// Every holding (with repeats).
    #[inline]
    pub(super) fn as_slice(&self) -> &[Holding] {
        match self {
            Holders::Inline(a) => {
                let n = a.iter().position(|&s| s == NONE).unwrap_or(4);
                &a[..n]
            }
            Holders::Heap(v) => v,
        }
    }

    /// Whether the holding `h` (a source's copy in one tier) is there.
    #[inline]
    pub(super) fn contains(&self, h: Holding) -> bool {
        match self {
            Holders::Inline(a) => a.contains(&h),
            // Kept sorted: thousands of servers hold a system prompt's blocks.
            Holders::Heap(v) => v.binary_search(&h).is_ok(),
        }
    }

    /// The tiers ([`Tier::bit`]s) source `s` holds the block in (0: none).
    #[inline]
    pub(super) fn tiers_of(&self, s: SourceId) -> u8 {
        self.as_slice()
            .iter()
            .filter(|&&h| source_of(h) == s)
            .fold(0, |m, &h| m | tier_bit(h))
    }

    fn push(&mut self, s: Holding) {
        match self {
            Holders::Inline(a) => match a.iter().position(|&x| x == NONE) {
                Some(i) => a[i] = s,
                None => {
                    let mut v = a.to_vec();
                    v.push(s);
                    v.sort_unstable();
                    *self = Holders::Heap(Arc::new(v));
                }
            },
            Holders::Heap(v) => {
                let at = v.partition_point(|&x| x < s);
                Arc::make_mut(v).insert(at, s);
            }
        }
    }

    /// Removes one occurrence of `s`; false when `s` was not there.
    fn remove_one(&mut self, s: Holding) -> bool {
        match self {
            Holders::Inline(a) => {
                let n = a.iter().position(|&x| x == NONE).unwrap_or(4);
                let Some(i) = a[..n].iter().position(|&x| x == s) else {
                    return false;
                };
                a.copy_within(i + 1..n, i);
                a[n - 1] = NONE;
                true
            }
            Holders::Heap(v) => {
                let Ok(i) = v.binary_search(&s) else {
                    return false;
                };
                let v = Arc::make_mut(v);
                v.remove(i);
                if v.len() <= 4 {
                    let mut a = [NONE; 4];
                    a[..v.len()].copy_from_slice(v);
                    *self = Holders::Inline(a);
                }
                true
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }
}

/// Bits of the key consumed per level.
const BITS: u32 = 6;

#[derive(Clone, Debug)]
enum Slot {
    Leaf(u64, Holders),
    Sub(Arc<Node>),
}

/// One trie node: which of the 64 children exist, and those children in index order.
#[derive(Clone, Debug, Default)]
struct Node {
    bitmap: u64,
    slots: Vec<Slot>,
}

/// The bitmap bit of `key`'s child at the level that starts at bit `shift`.
#[inline]
fn chunk(key: u64, shift: u32) -> u64 {
    1u64 << ((key >> shift) & 63)
}

impl Node {
    /// Position of the child for `bit` among the present children.
    #[inline]
    fn pos(&self, bit: u64) -> usize {
        (self.bitmap & (bit - 1)).count_ones() as usize
    }

    /// A node holding two leaves whose keys agree below `shift`.
    fn pair(a: (u64, Holders), b: (u64, Holders), shift: u32) -> Node {
        let ba = chunk(a.0, shift);
        let bb = chunk(b.0, shift);
        if ba == bb {
            // Keys differ somewhere above this level (they are distinct and 6 × 11 ≥ 64).
            let sub = Node::pair(a, b, shift + BITS);
            return Node {
                bitmap: ba,
                slots: vec![Slot::Sub(Arc::new(sub))],
            };
        }
        let (first, second) = if ba < bb { (a, b) } else { (b, a) };
        Node {
            bitmap: ba | bb,
            slots: vec![Slot::Leaf(first.0, first.1), Slot::Leaf(second.0, second.1)],
        }
    }
}

/// The persistent map itself. `Clone` is one reference-count increment.
#[derive(Clone, Debug, Default)]
pub(super) struct Trie {
    root: Arc<Node>,
    /// Distinct keys.
    len: usize,
}

impl Trie {
    /// Distinct blocks in the trie.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The holders of `key`.
    #[inline]
    pub(super) fn get(&self, key: u64) -> Option<&Holders> {
        let mut node: &Node = &self.root;
        let mut shift = 0;
        loop {
            let bit = chunk(key, shift);
            if node.bitmap & bit == 0 {
                return None;
            }
            match &node.slots[node.pos(bit)] {
                Slot::Leaf(k, h) => return (*k == key).then_some(h),
                Slot::Sub(n) => node = n,
            }
            shift += BITS;
        }
    }

    /// Adds the holding `s` of `key`; true when `key` is new.
    pub(super) fn add(&mut self, key: u64, s: Holding) -> bool {
        let new = add(&mut self.root, key, s, 0);
        self.len += new as usize;
        new
    }

    /// Removes the holding `s` of `key` (the key goes when no holding is left); false when it
    /// was not there. Copies no node when there is nothing to remove.
    pub(super) fn remove(&mut self, key: u64, s: Holding) -> bool {
        if !self.get(key).is_some_and(|h| h.contains(s)) {
            return false;
        }
        if remove(&mut self.root, key, s, 0) == Removed::Key {
            self.len -= 1;
        }
        true
    }

    /// Nodes and slots (for the memory figure and the structure check in tests).
    #[cfg(test)]
    pub(super) fn check(&self) -> usize {
        fn walk(n: &Node, shift: u32, prefix: u64, is_root: bool) -> usize {
            assert_eq!(n.bitmap.count_ones() as usize, n.slots.len());
            assert!(is_root || !n.slots.is_empty(), "empty inner node");
            if !is_root && n.slots.len() == 1 {
                assert!(
                    matches!(n.slots[0], Slot::Sub(_)),
                    "uncollapsed single leaf"
                );
            }
            let mut keys = 0;
            let mut bits = n.bitmap;
            for slot in &n.slots {
                let idx = bits.trailing_zeros() as u64;
                bits &= bits - 1;
                let p = prefix | (idx << shift);
                match slot {
                    Slot::Leaf(k, h) => {
                        let mask = if shift + BITS >= 64 {
                            u64::MAX
                        } else {
                            (1u64 << (shift + BITS)) - 1
                        };
                        assert_eq!(k & mask, p, "leaf under the wrong path");
                        assert!(!h.is_empty(), "leaf without holders");
                        keys += 1;
                    }
                    Slot::Sub(c) => keys += walk(c, shift + BITS, p, false),
                }
            }
            keys
        }
        let keys = walk(&self.root, 0, 0, true);
        assert_eq!(keys, self.len);
        keys
    }

    /// Every key with its holders, in no particular order (tests).
    #[cfg(test)]
    pub(super) fn entries(&self) -> Vec<(u64, Vec<Holding>)> {
        fn walk(n: &Node, out: &mut Vec<(u64, Vec<Holding>)>) {
            for s in &n.slots {
                match s {
                    Slot::Leaf(k, h) => out.push((*k, h.as_slice().to_vec())),
                    Slot::Sub(c) => walk(c, out),
                }
            }
        }
        let mut out = Vec::new();
        walk(&self.root, &mut out);
        out
    }
}

fn add(node: &mut Arc<Node>, key: u64, s: Holding, shift: u32) -> bool {
    let n = Arc::make_mut(node);
    let bit = chunk(key, shift);
    let pos = n.pos(bit);
    if n.bitmap & bit == 0 {
        n.bitmap |= bit;
        // Exact growth: a node's slot array has no spare capacity (memory per block).
        n.slots.reserve_exact(1);
        n.slots.insert(pos, Slot::Leaf(key, Holders::one(s)));
        return true;
    }
    match &mut n.slots[pos] {
        Slot::Leaf(k, h) if *k == key => {
            h.push(s);
            false
        }
        Slot::Leaf(k, h) => {
            let old = (*k, std::mem::replace(h, Holders::one(NONE)));
            let pair = Node::pair(old, (key, Holders::one(s)), shift + BITS);
            n.slots[pos] = Slot::Sub(Arc::new(pair));
            true
        }
        Slot::Sub(c) => add(c, key, s, shift + BITS),
    }
}

#[derive(PartialEq)]
enum Removed {
    Holding,
    Key,
}

/// Removes one holding known to exist. Empty inner nodes are dropped and a node left with a
/// single leaf is folded into its parent, so the shape depends only on the keys present.
fn remove(node: &mut Arc<Node>, key: u64, s: Holding, shift: u32) -> Removed {
    let n = Arc::make_mut(node);
    let bit = chunk(key, shift);
    let pos = n.pos(bit);
    let drop_slot = match &mut n.slots[pos] {
        Slot::Leaf(_, h) => {
            h.remove_one(s);
            if !h.is_empty() {
                return Removed::Holding;
            }
            true
        }
        Slot::Sub(c) => {
            if remove(c, key, s, shift + BITS) == Removed::Holding {
                return Removed::Holding;
            }
            let child = Arc::make_mut(c);
            if child.slots.is_empty() {
                true
            } else {
                if child.slots.len() == 1 && matches!(child.slots[0], Slot::Leaf(..)) {
                    let leaf = child.slots.pop().expect("one slot");
                    n.slots[pos] = leaf;
                }
                false
            }
        }
    };
    if drop_slot {
        n.slots.remove(pos);
        n.bitmap &= !bit;
    }
    Removed::Key
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The holder list of `key`, when it is on the heap.
    fn list(t: &Trie, key: u64) -> Option<&Arc<Vec<Holding>>> {
        match t.get(key)? {
            Holders::Heap(v) => Some(v),
            Holders::Inline(_) => None,
        }
    }

    #[test]
    fn a_published_copy_shares_long_holder_lists_until_their_own_block_changes() {
        let mut t = Trie::default();
        // A block every server stores (a system prompt), and blocks beside it in the same node.
        let popular = 0x40;
        for s in 0..1_000u16 {
            t.add(popular, holding(s, Tier::Device));
        }
        t.add(0x41, holding(1, Tier::Device));
        let published = t.clone();
        // Another block of the same leaf node changes: the node is copied, the long list not.
        t.add(0x42, holding(2, Tier::Device));
        let (a, b) = (
            list(&published, popular).unwrap(),
            list(&t, popular).unwrap(),
        );
        assert!(
            Arc::ptr_eq(a, b),
            "the holder list was copied with its node"
        );
        // Its own block changes: copied once, the published copy untouched.
        t.add(popular, holding(1_000, Tier::Device));
        let (a, b) = (
            list(&published, popular).unwrap(),
            list(&t, popular).unwrap(),
        );
        assert!(!Arc::ptr_eq(a, b));
        assert_eq!((a.len(), b.len()), (1_000, 1_001));
        assert!(t.remove(popular, holding(0, Tier::Device)));
        assert_eq!(list(&published, popular).unwrap().len(), 1_000);
        assert_eq!(list(&t, popular).unwrap().len(), 1_000);
    }
}
