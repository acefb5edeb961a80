//! Inserts: walk the key down the tree, path-copying shared nodes, splitting an edge where the
//! key diverges inside it, and merging chains the new worker made indistinguishable.

use super::repr::{Kid, Node};
use super::RadixTree;
use crate::base::text::{char_count, floor_char_boundary};
use crate::base::WorkerId;
use triomphe::Arc;

/// Keys longer than this are cut (at a character boundary) so every edge length fits in `u32`.
/// Far above any request body the gateway accepts.
const MAX_KEY_BYTES: usize = u32::MAX as usize;

impl RadixTree {
    /// Record that `key` was sent to `worker` at logical time `now` (larger = more recent).
    /// Path-copies shared nodes (`Arc::make_mut`).
    pub fn insert(&mut self, key: &str, worker: WorkerId, now: u64) {
        let mut rest = key.as_bytes();
        if rest.len() > MAX_KEY_BYTES {
            rest = &rest[..floor_char_boundary(rest, MAX_KEY_BYTES)];
        }
        let mut added: u64 = 0;
        let mut new_nodes: usize = 0;
        let mut merged: usize = 0;
        let mut cur: &mut Node = Arc::make_mut(&mut self.root);
        cur.workers.touch(worker, now);
        let mut at_root = true;
        while !rest.is_empty() {
            match cur.find_child(rest) {
                Err(pos) => {
                    let chars = char_count(rest) as u32;
                    added += u64::from(chars);
                    if !at_root && cur.kids.is_empty() && cur.workers.ids() == [worker] {
                        // A lone child with the same single worker would be merged at once.
                        cur.extend_edge(rest, chars);
                    } else {
                        cur.insert_child(pos, Arc::new(Node::leaf(rest, chars, worker, now)));
                        new_nodes += 1;
                    }
                    break;
                }
                Ok((i, n)) => {
                    let edge_len = cur.kids[i].edge().len();
                    let child_has = cur.kids[i].workers.contains(worker);
                    // Split where the key diverges inside the edge, or where it ends inside an
                    // edge the worker does not hold yet (the worker covers only the first part).
                    if n < edge_len && !(n == rest.len() && child_has) {
                        split(&mut cur.kids[i].node, n);
                        new_nodes += 1;
                    }
                    let child = Arc::make_mut(&mut cur.kids[i].node);
                    if child.workers.touch(worker, now) {
                        added += u64::from(child.edge_chars);
                        cur.add_to_bloom(i, worker);
                    }
                    rest = &rest[n..];
                    if !at_root && cur.kids.len() == 1 && cur.workers.same_ids(&cur.kids[0].workers)
                    {
                        // Adding the worker made the only child indistinguishable: merge and
                        // continue from the merged node.
                        cur.absorb_only_child();
                        merged += 1;
                    } else {
                        let parent_buffer = cur.edge.buffer_id();
                        cur = Arc::make_mut(&mut cur.kids[i].node);
                        cur.compact_edge(parent_buffer);
                        at_root = false;
                    }
                }
            }
        }
        self.nodes = self.nodes + new_nodes - merged;
        let counts = Arc::make_mut(&mut self.counts);
        match counts.binary_search_by_key(&worker, |&(w, _)| w) {
            Ok(i) => counts[i].1 += added,
            Err(i) => counts.insert(i, (worker, added)),
        }
    }
}

/// Splits the edge of the node in `slot` after `n` bytes (a character boundary inside the edge):
/// `slot` then holds a new upper node with the first part of the edge and the same workers, whose
/// only child is the old node with the rest of the edge. Both parts stay ranges of one buffer.
fn split(slot: &mut Arc<Node>, n: usize) {
    let lower = Arc::make_mut(slot);
    let (head, tail) = lower.edge.split(n);
    let upper_chars = char_count(head.bytes()) as u32;
    lower.edge = tail;
    lower.edge_chars -= upper_chars;
    let upper = Node {
        kids: Box::new([Kid::new(Arc::clone(slot))]),
        edge: head,
        workers: slot.workers.clone(),
        edge_chars: upper_chars,
    };
    *slot = Arc::new(upper);
}
