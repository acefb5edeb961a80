//! The node representation: children (key, bloom and pointer side by side), the edge as a range
//! of a shared text buffer, and the edits on them.
//!
//! Edges share buffers so that copying a node (the writer's path copy after a publish) copies
//! pointers, never text: a clone of a node costs its children array and a few reference counts,
//! whatever the length of its edge. Splitting an edge makes two ranges of one buffer; only
//! appending to an edge or merging two edges from different buffers writes a new one.

use super::shared::SharedBytes;
use super::workers::Workers;
use crate::base::text::common_prefix;
use crate::base::WorkerId;
use std::ops::Deref;
use triomphe::Arc;

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
    let mut k = [0u8; 4];
    let len = len.min(s.len());
    k[..len].copy_from_slice(&s[..len]);
    u32::from_be_bytes(k)
}

/// The bloom bit of a worker.
#[inline]
pub(super) fn bloom_bit(worker: WorkerId) -> u32 {
    1 << (worker % 32)
}

/// Buffers at most this long are never compacted: copying them saves less than it costs.
const COMPACT_MIN_BYTES: usize = 64;

/// Room left after an edge that had to move to a new buffer to grow: as much as the edge
/// holds, at most this much. A leaf grows when its conversation's next turn arrives; with room
/// the next few turns are appended in place (O(turn)) instead of copying the whole edge
/// (O(conversation)) each time. Only edges that grew get room, so it costs at most this much
/// per growing leaf (never more than its edge), and the copy is still amortised: a copy of `n`
/// bytes buys room for `min(n, 8 KiB)` more.
const GROWTH_ROOM_MAX: usize = 8 << 10;

/// A node's edge: `len` bytes at `start` of an immutable buffer that other nodes (the other
/// halves of earlier splits, and copies of this node in published snapshots) may share.
/// 16 bytes; the empty edge (the root's) holds no buffer.
#[derive(Clone, Default)]
pub(super) struct Edge {
    buf: Option<SharedBytes>,
    start: u32,
    len: u32,
}

impl Edge {
    /// A new buffer holding the concatenation of `parts` (whole characters, ≤ `u32::MAX` bytes
    /// in total, which `insert` guarantees by cutting keys).
    pub(super) fn new(parts: &[&[u8]]) -> Edge {
        let buf = SharedBytes::new(parts);
        let len = buf.as_ref().map_or(0, |b| b.written() as u32);
        Edge { buf, start: 0, len }
    }

    #[inline]
    pub(super) fn bytes(&self) -> &[u8] {
        match &self.buf {
            Some(b) => b.range(self.start as usize, self.len as usize),
            None => &[],
        }
    }

    /// Appends `more` (whole characters; the total stays ≤ `u32::MAX`, which `insert`
    /// guarantees by cutting keys): in place when this edge ends where its buffer's bytes end
    /// and the buffer has room, else into a new buffer with room to grow again.
    pub(super) fn append(&mut self, more: &[u8]) {
        let end = self.start as usize + self.len();
        if let Some(b) = &self.buf {
            if b.try_append(end, more) {
                self.len += more.len() as u32;
                return;
            }
        }
        let len = self.len() + more.len();
        let buf = SharedBytes::with_room(&[self.bytes(), more], len.min(GROWTH_ROOM_MAX));
        let len = buf.as_ref().map_or(0, |b| b.written() as u32);
        *self = Edge { buf, start: 0, len };
    }

    #[inline]
    pub(super) fn len(&self) -> usize {
        self.len as usize
    }

    /// The first `n` bytes and the rest, both ranges of this edge's buffer (no copy).
    pub(super) fn split(&self, n: usize) -> (Edge, Edge) {
        debug_assert!(n > 0 && n < self.len());
        let n = n as u32;
        let head = Edge {
            buf: self.buf.clone(),
            start: self.start,
            len: n,
        };
        let tail = Edge {
            buf: self.buf.clone(),
            start: self.start + n,
            len: self.len - n,
        };
        (head, tail)
    }

    /// This edge followed by `next`: the same buffer with a longer range when `next` is the
    /// range right after this one (an earlier split being undone), else a new buffer.
    pub(super) fn join(&self, next: &Edge) -> Edge {
        if let (Some(a), Some(b)) = (&self.buf, &next.buf) {
            if a.id() == b.id() && self.start + self.len == next.start {
                return Edge {
                    buf: self.buf.clone(),
                    start: self.start,
                    len: self.len + next.len,
                };
            }
        }
        Edge::new(&[self.bytes(), next.bytes()])
    }

    /// Bytes of the buffer this edge keeps alive, room included (0 for the empty edge).
    pub(super) fn buffer_len(&self) -> usize {
        self.buf.as_ref().map_or(0, SharedBytes::capacity)
    }

    /// The buffer's address, to tell buffers apart.
    #[inline]
    pub(super) fn buffer_id(&self) -> Option<*const u8> {
        self.buf.as_ref().map(SharedBytes::id)
    }

    /// Uses less than half of a buffer larger than [`COMPACT_MIN_BYTES`].
    #[inline]
    fn wasteful(&self) -> bool {
        let buf = self.buffer_len();
        buf > COMPACT_MIN_BYTES && self.len() * 2 < buf
    }
}

/// One child: its key ([`char_key`] of its edge) and worker bloom beside the pointer, so a
/// lookup finds the child and a walk over one worker's nodes skips the others' children
/// without touching them. 16 bytes.
#[derive(Clone)]
pub(super) struct Kid {
    pub(super) key: u32,
    pub(super) bloom: u32,
    pub(super) node: Arc<Node>,
}

impl Kid {
    pub(super) fn new(node: Arc<Node>) -> Kid {
        Kid {
            // Invariant: non-root edges are non-empty.
            key: node
                .edge
                .bytes()
                .first()
                .map_or(0, |_| char_key(node.edge.bytes())),
            bloom: node.workers.bloom(),
            node,
        }
    }
}

impl Deref for Kid {
    type Target = Node;
    #[inline]
    fn deref(&self) -> &Node {
        &self.node
    }
}

/// One node: 56 bytes, 64 with the reference count (a mimalloc size class), plus the children
/// array (16 bytes per child) when it has children, the worker set's allocation when more than
/// one worker holds it, and its share of an edge buffer.
#[derive(Clone, Default)]
pub(super) struct Node {
    /// Sorted by key.
    pub(super) kids: Box<[Kid]>,
    pub(super) edge: Edge,
    pub(super) workers: Workers,
    /// Characters in the edge, so full-edge matches never count characters.
    pub(super) edge_chars: u32,
}

impl Node {
    pub(super) fn leaf(edge: &[u8], edge_chars: u32, worker: WorkerId, now: u64) -> Node {
        Node {
            kids: Box::default(),
            edge: Edge::new(&[edge]),
            workers: Workers::one(worker, now),
            edge_chars,
        }
    }

    #[inline]
    pub(super) fn edge(&self) -> &[u8] {
        self.edge.bytes()
    }

    /// Whether child `i` may hold `worker` (exact when the bloom says no).
    #[inline]
    pub(super) fn kid_may_hold(&self, i: usize, worker: WorkerId) -> bool {
        self.kids
            .get(i)
            .is_some_and(|k| k.bloom & bloom_bit(worker) != 0)
    }

    /// Records in child `i`'s bloom that it now holds `worker`.
    pub(super) fn add_to_bloom(&mut self, i: usize, worker: WorkerId) {
        if let Some(k) = self.kids.get_mut(i) {
            k.bloom |= bloom_bit(worker);
        }
    }

    /// The child whose edge starts with the first character of `rest` (non-empty), and the
    /// shared length in bytes cut back to a character boundary (at least that character).
    /// `Err(pos)` gives where a new child for `rest` would be inserted.
    #[inline]
    pub(super) fn find_child(&self, rest: &[u8]) -> Result<(usize, usize), usize> {
        let key = char_key(rest);
        let i = self.kids.binary_search_by_key(&key, |k| k.key)?;
        let n = common_prefix(rest, self.kids[i].edge());
        Ok((i, n))
    }

    /// Inserts `kid` at `pos` of the (sorted) children.
    pub(super) fn insert_child(&mut self, pos: usize, kid: Arc<Node>) {
        let mut kids = std::mem::take(&mut self.kids).into_vec();
        kids.reserve_exact(1);
        kids.insert(pos, Kid::new(kid));
        self.kids = kids.into_boxed_slice();
    }

    /// Copies the edge into a buffer of its own when it uses less than half of a larger one
    /// that neither its parent (whose buffer is `parent_buffer`) nor a child uses. Splits make
    /// the only sharing, along a chain, so the rest of such a buffer was another node's text,
    /// since evicted, extended or merged away, and would otherwise stay allocated as long as
    /// this node lives. The writer calls it on every node it walks through or rebuilds.
    pub(super) fn compact_edge(&mut self, parent_buffer: Option<*const u8>) {
        if !self.edge.wasteful() {
            return;
        }
        let own = self.edge.buffer_id();
        if own == parent_buffer || self.kids.iter().any(|k| k.edge.buffer_id() == own) {
            return;
        }
        self.edge = Edge::new(&[self.edge.bytes()]);
    }

    /// Appends `more` (whole characters) to the edge of a node without children (in place in
    /// its buffer when it can: see [`Edge::append`]).
    pub(super) fn extend_edge(&mut self, more: &[u8], chars: u32) {
        debug_assert!(self.kids.is_empty());
        self.edge.append(more);
        self.edge_chars += chars;
    }

    /// Merges the only child into this node: the edges join, the child's children and
    /// (identical) worker set are kept with the later access times.
    pub(super) fn absorb_only_child(&mut self) {
        debug_assert_eq!(self.kids.len(), 1);
        let Some(child) = std::mem::take(&mut self.kids).into_vec().pop() else {
            return;
        };
        self.edge = self.edge.join(&child.edge);
        self.edge_chars += child.edge_chars;
        self.workers.merge_times_max(&child.workers);
        self.kids = match Arc::try_unwrap(child.node) {
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
            if let Ok(mut node) = Arc::try_unwrap(kid.node) {
                stack.extend(std::mem::take(&mut node.kids).into_vec());
            }
        }
    }
}
