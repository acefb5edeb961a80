//! Eviction and worker removal: plan which of a worker's nodes go (least recently used leaves
//! first), then prune them in one pass that rebuilds only the subtrees that change.

use super::repr::{bloom_bit, Kid, Node};
use super::RadixTree;
use crate::base::WorkerId;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use triomphe::Arc;

/// One entry of the eviction plan: a node held by the worker being evicted, in DFS preorder over
/// the nodes that worker holds (index 0 = root).
#[derive(Clone, Copy)]
struct Slot {
    time: u64,
    parent: u32,
    /// One past the last preorder index of this node's subtree.
    end: u32,
    chars: u32,
    /// Children held by the worker that are not (yet) evicted.
    live_kids: u32,
    evicted: bool,
    /// The subtree contains an evicted node, so the apply pass must descend into it.
    dirty: bool,
}

/// A node being rebuilt by [`RadixTree::prune`]: its children were taken out and are being
/// processed one by one; `keep` holds those kept (with their keys and blooms).
struct Frame {
    node: Arc<Node>,
    /// This node's key in its parent (unchanged by merges: the first character stays).
    key: u32,
    kids: std::vec::IntoIter<Kid>,
    keep: Vec<Kid>,
    remove: bool,
}

impl Frame {
    fn open(mut node: Arc<Node>, key: u32, remove: bool) -> Frame {
        let kids = std::mem::take(&mut Arc::make_mut(&mut node).kids).into_vec();
        let had = kids.len();
        Frame {
            node,
            key,
            kids: kids.into_iter(),
            keep: Vec::with_capacity(had),
            remove,
        }
    }
}

impl RadixTree {
    /// Forget `worker` everywhere; drops nodes nobody holds and merges single-child chains.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        if !self.root.workers.contains(worker) {
            return;
        }
        self.prune(worker, None);
        let counts = Arc::make_mut(&mut self.counts);
        if let Ok(i) = counts.binary_search_by_key(&worker, |&(w, _)| w) {
            counts.remove(i);
        }
    }

    /// Remove `worker`'s least recently used leaves until it holds at most `max_chars`.
    /// Returns the characters removed.
    ///
    /// A leaf *for the worker* is a node it holds with no child it holds; removing one can make
    /// its parent such a leaf, which then competes by its own access time. Nodes other workers
    /// still hold only lose this worker; nodes left empty are dropped and chains merged.
    pub fn evict_worker(&mut self, worker: WorkerId, max_chars: u64) -> u64 {
        let count = self.worker_chars(worker);
        if count <= max_chars {
            return 0;
        }
        let mut slots = self.plan_slots(worker);
        let mut heap: BinaryHeap<Reverse<(u64, u32)>> = slots
            .iter()
            .enumerate()
            .skip(1)
            .filter(|(_, s)| s.live_kids == 0)
            .map(|(i, s)| Reverse((s.time, i as u32)))
            .collect();
        let mut left = count;
        while left > max_chars {
            let Some(Reverse((_, idx))) = heap.pop() else {
                break;
            };
            let idx = idx as usize;
            let slot = &mut slots[idx];
            slot.evicted = true;
            left -= u64::from(slot.chars);
            let parent = slot.parent as usize;
            // Mark the path up to the root so the apply pass descends to this node.
            let mut up = idx;
            while !slots[up].dirty {
                slots[up].dirty = true;
                if up == 0 {
                    break;
                }
                up = slots[up].parent as usize;
            }
            let p = &mut slots[parent];
            p.live_kids -= 1;
            if p.live_kids == 0 && parent != 0 {
                heap.push(Reverse((p.time, parent as u32)));
            }
        }
        drop(heap);
        self.prune(worker, Some(&slots));
        let removed = count - left;
        let counts = Arc::make_mut(&mut self.counts);
        if let Ok(i) = counts.binary_search_by_key(&worker, |&(w, _)| w) {
            counts[i].1 = left;
        }
        removed
    }

    /// The nodes `worker` holds, in DFS preorder (children in key order, only those it holds).
    fn plan_slots(&self, worker: WorkerId) -> Vec<Slot> {
        let root_time = self.root.workers.time(worker).unwrap_or(0);
        let mut slots = vec![Slot {
            time: root_time,
            parent: u32::MAX,
            end: 0,
            chars: 0,
            live_kids: 0,
            evicted: false,
            dirty: false,
        }];
        // (node, its slot, next child to look at)
        let mut stack: Vec<(&Node, usize, usize)> = vec![(&self.root, 0, 0)];
        while let Some(top) = stack.last_mut() {
            let (node, idx, next) = *top;
            let Some(kid) = node.kids.get(next) else {
                slots[idx].end = slots.len() as u32;
                stack.pop();
                continue;
            };
            top.2 += 1;
            if !node.kid_may_hold(next, worker) {
                continue;
            }
            let Some(time) = kid.workers.time(worker) else {
                continue;
            };
            slots[idx].live_kids += 1;
            let kid_idx = slots.len();
            slots.push(Slot {
                time,
                parent: idx as u32,
                end: 0,
                chars: kid.edge_chars,
                live_kids: 0,
                evicted: false,
                dirty: false,
            });
            stack.push((kid, kid_idx, 0));
        }
        slots
    }

    /// Removes `worker` from the nodes the plan marks evicted (every node it holds, root
    /// included, when `plan` is `None`), dropping nodes left empty and merging single-child
    /// chains. Descends only into subtrees that change; everything else stays shared.
    fn prune(&mut self, worker: WorkerId, plan: Option<&[Slot]>) {
        let root = std::mem::replace(&mut self.root, Arc::new(Node::default()));
        let mut stack = vec![Frame::open(root, 0, plan.is_none())];
        let mut idx = 0usize;
        let mut gone = 0usize;
        loop {
            // Invariant: the loop returns when it pops the root frame, so the stack is non-empty.
            let Some(top) = stack.last_mut() else {
                return;
            };
            if let Some(kid) = top.kids.next() {
                if kid.bloom & bloom_bit(worker) == 0 || !kid.workers.contains(worker) {
                    top.keep.push(kid);
                    continue;
                }
                idx += 1;
                let remove = match plan {
                    None => true,
                    Some(slots) => {
                        let s = &slots[idx];
                        if !s.dirty {
                            top.keep.push(kid);
                            idx = s.end as usize - 1;
                            continue;
                        }
                        s.evicted
                    }
                };
                stack.push(Frame::open(kid.node, kid.key, remove));
                continue;
            }
            let Some(frame) = stack.pop() else {
                return;
            };
            let is_root = stack.is_empty();
            let Frame {
                mut node,
                key,
                keep,
                remove,
                ..
            } = frame;
            // Unique already: `Frame::open` made it so and nothing cloned it since.
            let n = Arc::make_mut(&mut node);
            if remove {
                n.workers.remove(worker);
            }
            n.kids = keep.into_boxed_slice();
            if is_root {
                self.root = node;
                self.nodes -= gone;
                return;
            }
            if n.workers.is_empty() {
                // Nobody holds it, so (subset invariant) nobody held its children either: they
                // were dropped before it.
                debug_assert!(n.kids.is_empty());
                gone += 1;
                continue;
            }
            if n.kids.len() == 1 && n.workers.same_ids(&n.kids[0].workers) {
                n.absorb_only_child();
                gone += 1;
            }
            let bloom = n.workers.bloom();
            if let Some(parent) = stack.last_mut() {
                // Nodes sharing a buffer form a chain, so when part of one is evicted the nodes
                // still using the rest are on this pass's path.
                n.compact_edge(parent.node.edge.buffer_id());
                parent.keep.push(Kid { key, bloom, node });
            }
        }
    }
}
