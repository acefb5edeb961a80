//! The node representation: child keys, child blooms and the edge packed in one allocation,
//! and the edits on it that keep that packing (insert a child, extend, absorb, drop).

use super::workers::Workers;
use crate::base::text::common_prefix;
use crate::base::WorkerId;
use std::sync::Arc;

/// Bytes per child key.
pub(super) const KEY_BYTES: usize = 4;

/// The first character of `s` (non-empty, starting at a character boundary) as its UTF-8 bytes
/// packed big-endian and zero-padded: distinct characters get distinct keys, ordered like bytes.
#[inline]
pub(super) fn char_key(s: &[u8]) -> u32 {
    let b = s[0];
    let len = match b {
        0..=0x7f => 1,
        0x80..=0xdf => 2,
        0xe0..=0xef => 3,
        _ => 4,
    };
    let mut k = [0u8; KEY_BYTES];
    let len = len.min(s.len());
    k[..len].copy_from_slice(&s[..len]);
    u32::from_be_bytes(k)
}

#[inline]
pub(super) fn key_at(keys: &[u8], i: usize) -> Option<u32> {
    keys.get(i * KEY_BYTES..)?
        .first_chunk::<KEY_BYTES>()
        .map(|k| u32::from_be_bytes(*k))
}

/// Bytes of per-child metadata in a node's `bytes`: the key, then (in a second array) the bloom.
pub(super) const META_BYTES: usize = 2 * KEY_BYTES;

/// The bloom bit of a worker.
#[inline]
pub(super) fn bloom_bit(worker: WorkerId) -> u32 {
    1 << (worker % 32)
}

/// Child `i`'s bloom in `bytes` laid out for `kids` children.
#[inline]
pub(super) fn bloom_in(bytes: &[u8], kids: usize, i: usize) -> u32 {
    key_at(&bytes[kids * KEY_BYTES..], i).unwrap_or(u32::MAX)
}

/// Lays out a node's bytes: the keys, the blooms, then the edge (in pieces).
pub(super) fn assemble(meta: &[(u32, u32)], edge: &[&[u8]]) -> Box<[u8]> {
    let len = meta.len() * META_BYTES + edge.iter().map(|e| e.len()).sum::<usize>();
    let mut bytes = Vec::with_capacity(len);
    for &(key, _) in meta {
        bytes.extend_from_slice(&key.to_be_bytes());
    }
    for &(_, bloom) in meta {
        bytes.extend_from_slice(&bloom.to_be_bytes());
    }
    for e in edge {
        bytes.extend_from_slice(e);
    }
    bytes.into_boxed_slice()
}

/// One node: 64 bytes, 80 with the `Arc` header (a mimalloc size class), plus the heap parts:
/// child keys and blooms + edge in one allocation, child pointers, and the worker set when more
/// than one worker holds the node.
#[derive(Clone, Default)]
pub(super) struct Node {
    /// Each child's key ([`char_key`] of its edge, 4 bytes big-endian, sorted, parallel to
    /// `kids`), then each child's worker bloom (4 bytes), then this node's edge. One allocation:
    /// lookups read the keys, then the matching child's edge.
    pub(super) bytes: Box<[u8]>,
    pub(super) kids: Box<[Arc<Node>]>,
    pub(super) workers: Workers,
    /// Characters in the edge, so full-edge matches never count characters.
    pub(super) edge_chars: u32,
}

impl Node {
    pub(super) fn leaf(edge: &[u8], edge_chars: u32, worker: WorkerId, now: u64) -> Node {
        Node {
            bytes: edge.into(),
            kids: Box::default(),
            workers: Workers::one(worker, now),
            edge_chars,
        }
    }

    #[inline]
    pub(super) fn keys(&self) -> &[u8] {
        &self.bytes[..self.kids.len() * KEY_BYTES]
    }

    #[inline]
    pub(super) fn edge(&self) -> &[u8] {
        &self.bytes[self.kids.len() * META_BYTES..]
    }

    #[inline]
    pub(super) fn bloom(&self, i: usize) -> u32 {
        bloom_in(&self.bytes, self.kids.len(), i)
    }

    /// Whether child `i` may hold `worker` (exact when the bloom says no).
    #[inline]
    pub(super) fn kid_may_hold(&self, i: usize, worker: WorkerId) -> bool {
        self.bloom(i) & bloom_bit(worker) != 0
    }

    /// Records in child `i`'s bloom that it now holds `worker`.
    pub(super) fn add_to_bloom(&mut self, i: usize, worker: WorkerId) {
        let at = self.kids.len() * KEY_BYTES + i * KEY_BYTES;
        if let Some(b) = self.bytes.get_mut(at..at + KEY_BYTES) {
            let v = u32::from_be_bytes([b[0], b[1], b[2], b[3]]) | bloom_bit(worker);
            b.copy_from_slice(&v.to_be_bytes());
        }
    }

    /// The child whose edge starts with the first character of `rest` (non-empty), and the
    /// shared length in bytes cut back to a character boundary (at least that character).
    /// `Err(pos)` gives where a new child for `rest` would be inserted.
    #[inline]
    pub(super) fn find_child(&self, rest: &[u8]) -> Result<(usize, usize), usize> {
        let key = char_key(rest);
        let keys = self.keys();
        // Sorted keys: the count of smaller keys is the lower bound. Branch-free, vectorises.
        let i = keys
            .chunks_exact(KEY_BYTES)
            .filter(|k| u32::from_be_bytes([k[0], k[1], k[2], k[3]]) < key)
            .count();
        if key_at(keys, i) != Some(key) {
            return Err(i);
        }
        let n = common_prefix(rest, self.kids[i].edge());
        Ok((i, n))
    }

    /// Inserts `kid` at `pos` of the (sorted) child arrays.
    pub(super) fn insert_child(&mut self, pos: usize, kid: Arc<Node>) {
        // Invariant: non-root edges are non-empty.
        let key = char_key(kid.edge()).to_be_bytes();
        let bloom = kid.workers.bloom().to_be_bytes();
        let k = self.kids.len();
        let (keys, rest) = self.bytes.split_at(k * KEY_BYTES);
        let (blooms, edge) = rest.split_at(k * KEY_BYTES);
        let at = pos * KEY_BYTES;
        let mut bytes = Vec::with_capacity(self.bytes.len() + META_BYTES);
        bytes.extend_from_slice(&keys[..at]);
        bytes.extend_from_slice(&key);
        bytes.extend_from_slice(&keys[at..]);
        bytes.extend_from_slice(&blooms[..at]);
        bytes.extend_from_slice(&bloom);
        bytes.extend_from_slice(&blooms[at..]);
        bytes.extend_from_slice(edge);
        self.bytes = bytes.into_boxed_slice();
        let mut kids = std::mem::take(&mut self.kids).into_vec();
        kids.reserve_exact(1);
        kids.insert(pos, kid);
        self.kids = kids.into_boxed_slice();
    }

    /// Appends `more` (whole characters) to the edge of a node without children.
    pub(super) fn extend_edge(&mut self, more: &[u8], chars: u32) {
        debug_assert!(self.kids.is_empty());
        let mut bytes = Vec::with_capacity(self.bytes.len() + more.len());
        bytes.extend_from_slice(&self.bytes);
        bytes.extend_from_slice(more);
        self.bytes = bytes.into_boxed_slice();
        self.edge_chars += chars;
    }

    /// Merges the only child into this node: the edges concatenate, the child's children and
    /// (identical) worker set are kept with the later access times.
    pub(super) fn absorb_only_child(&mut self) {
        debug_assert_eq!(self.kids.len(), 1);
        let Some(child) = std::mem::take(&mut self.kids).into_vec().pop() else {
            return;
        };
        // `self.bytes` was `child key ++ child bloom ++ edge`; it becomes
        // `child keys ++ child blooms ++ edge ++ child edge`.
        let own_edge = &self.bytes[META_BYTES..];
        let mut bytes = Vec::with_capacity(own_edge.len() + child.bytes.len());
        bytes.extend_from_slice(&child.bytes[..child.kids.len() * META_BYTES]);
        bytes.extend_from_slice(own_edge);
        bytes.extend_from_slice(child.edge());
        self.bytes = bytes.into_boxed_slice();
        self.edge_chars += child.edge_chars;
        self.workers.merge_times_max(&child.workers);
        self.kids = match Arc::try_unwrap(child) {
            Ok(mut c) => std::mem::take(&mut c.kids),
            Err(shared) => shared.kids.clone(),
        };
    }
}

impl Drop for Node {
    /// Iterative, so freeing a deep subtree cannot overflow the stack: children this node owns
    /// alone are unwrapped and their children queued, instead of recursing.
    fn drop(&mut self) {
        if self.kids.is_empty() {
            return;
        }
        let mut stack = std::mem::take(&mut self.kids).into_vec();
        while let Some(kid) = stack.pop() {
            if let Ok(mut node) = Arc::try_unwrap(kid) {
                stack.extend(std::mem::take(&mut node.kids).into_vec());
            }
        }
    }
}
