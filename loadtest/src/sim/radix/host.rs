//! The host tier (SGLang's HiCache): a node the device evicts is backed up to host memory when
//! it fits there (the least recently used host copies are dropped to make room), and a request
//! whose prefix continues into host-only pages loads them back to the device instead of
//! recomputing them.
//!
//! Events follow SGLang's write-back order, so a consumer's parent chains never break: the host
//! copy is stored (`BlockStored`, `CPU_PINNED`) before the device copy goes (`BlockRemoved`,
//! `GPU`), so a node's hash is held in some tier for as long as it has children; host eviction
//! takes only nodes with nothing below them (or frees just the host copy of a node still on the
//! device), so a host `BlockStored`'s parent is always a block stored in some tier, or the root.

use std::cmp::Reverse;

use super::{Medium, NodeId, RadixCache, ROOT};

/// A prefix match split by tier, as [`RadixCache::match_prefix_in`] returns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Tokens matched on the device: a hit that costs nothing.
    pub device_len: usize,
    /// The node covering exactly the device part (`ROOT` when there is none).
    pub device_node: NodeId,
    /// Tokens matched past the device part that only host memory holds (0 without a host
    /// tier): a hit once loaded back.
    pub host_len: usize,
    /// The node covering the whole match (`device_node` when `host_len` is 0).
    pub node: NodeId,
}

impl RadixCache {
    /// Whether a host-heap entry still stands for its node: a host copy that may go now (the
    /// node is still on the device, or nothing hangs below it), not being loaded, and with the
    /// stamp the entry was pushed with.
    fn is_host_candidate(&self, (stamp, id): (u64, NodeId)) -> bool {
        let n = &self.nodes[id as usize];
        id != ROOT
            && n.live
            && n.host
            && !n.loading
            && (n.device || n.children.is_empty())
            && n.last_access == stamp
    }

    /// Record `id` as a host eviction candidate if it is one now. Called wherever a host copy
    /// may have become one (copy made, last child gone, load finished) or its stamp changed.
    pub(super) fn offer_host(&mut self, id: NodeId) {
        if self.host_capacity == 0 {
            return;
        }
        let entry = (self.nodes[id as usize].last_access, id);
        if self.is_host_candidate(entry) {
            self.host_candidates.push(Reverse(entry));
            // Stale entries pile up without host evictions: rebuild past twice the nodes.
            if self.host_candidates.len() > 2 * self.nodes.len() + 1024 {
                self.host_candidates = (1..self.nodes.len() as NodeId)
                    .map(|id| (self.nodes[id as usize].last_access, id))
                    .filter(|&e| self.is_host_candidate(e))
                    .map(Reverse)
                    .collect();
            }
        }
    }

    /// Device eviction of `id` with a host tier: back it up to host memory (unless it already
    /// has a copy there) and drop the device copy; when host memory cannot take it, drop it and
    /// the host-only nodes below it. Returns the device tokens freed.
    pub(super) fn demote(&mut self, id: NodeId) -> usize {
        let len = self.nodes[id as usize].key.len();
        if !self.nodes[id as usize].host && self.make_host_room(len) {
            self.nodes[id as usize].host = true;
            self.host_tokens += len;
            self.stats.backed_up_tokens += len as u64;
            self.record_store(id, Medium::CpuPinned);
        }
        if !self.nodes[id as usize].host {
            return self.drop_subtree(id);
        }
        self.record_remove(id, Medium::Gpu);
        self.nodes[id as usize].device = false;
        self.tree_tokens -= len;
        self.evictable_tokens -= len;
        self.offer_host(id);
        len
    }

    /// Drop host copies, least recently used first, until `need` tokens fit in host memory.
    /// False (nothing more dropped) when they cannot.
    fn make_host_room(&mut self, need: usize) -> bool {
        if need > self.host_capacity {
            return false;
        }
        while self.host_tokens + need > self.host_capacity {
            let Some(Reverse(entry)) = self.host_candidates.pop() else {
                return false;
            };
            if self.is_host_candidate(entry) {
                self.evict_host(entry.1);
            }
        }
        true
    }

    /// Drop `id`'s host copy (`BlockRemoved`, `CPU_PINNED`); a node held nowhere else leaves
    /// the tree.
    fn evict_host(&mut self, id: NodeId) {
        let len = self.nodes[id as usize].key.len();
        self.record_remove(id, Medium::CpuPinned);
        self.host_tokens -= len;
        self.stats.host_evicted_tokens += len as u64;
        if self.nodes[id as usize].device {
            self.nodes[id as usize].host = false;
        } else {
            self.unlink(id);
        }
    }

    /// A device leaf host memory cannot take: the host-only nodes below it go first, deepest
    /// first (a consumer never holds a child whose parent it dropped), then the node itself.
    /// Returns the device tokens freed.
    fn drop_subtree(&mut self, id: NodeId) -> usize {
        let mut order = Vec::new();
        let mut stack: Vec<NodeId> = self.nodes[id as usize]
            .children
            .iter()
            .map(|&(_, c)| c)
            .collect();
        while let Some(n) = stack.pop() {
            order.push(n);
            stack.extend(self.nodes[n as usize].children.iter().map(|&(_, c)| c));
        }
        // Pre-order reversed: every node comes after all of its descendants.
        for &n in order.iter().rev() {
            debug_assert!(
                !self.nodes[n as usize].device,
                "device node below a device leaf"
            );
            let len = self.nodes[n as usize].key.len();
            self.record_remove(n, Medium::CpuPinned);
            self.host_tokens -= len;
            self.stats.host_evicted_tokens += len as u64;
            self.unlink(n);
        }
        self.remove_leaf(id)
    }

    /// Load the host-only part of `m` back to the device (SGLang's load-back at admission):
    /// evict device pages for it (the matched device prefix and the loading path are pinned
    /// meanwhile), then the path's nodes are device pages again, unlocked, with a `BlockStored`
    /// (GPU) each. Returns false, changing nothing but what eviction did, when the device cannot
    /// make room; the request then recomputes those tokens.
    pub fn load_back(&mut self, m: &PrefixMatch) -> bool {
        if m.host_len == 0 {
            return true;
        }
        let mut path = Vec::new();
        let mut n = m.node;
        while n != m.device_node {
            path.push(n);
            n = self.nodes[n as usize].parent;
        }
        for &id in &path {
            self.nodes[id as usize].loading = true;
        }
        self.inc_lock(m.device_node);
        let free = self.free_tokens();
        if free < m.host_len {
            self.evict(m.host_len - free);
        }
        let ok = self.free_tokens() >= m.host_len;
        self.dec_lock(m.device_node);
        for &id in &path {
            self.nodes[id as usize].loading = false;
            self.offer_host(id);
        }
        if ok {
            self.promote_path(m.node);
            self.stats.loaded_tokens += m.host_len as u64;
        }
        ok
    }
}
