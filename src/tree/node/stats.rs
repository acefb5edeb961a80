//! Accounting: characters per worker, nodes, stored bytes.

use super::repr::Node;
use super::RadixTree;
use crate::base::WorkerId;

impl RadixTree {
    /// Characters held by `worker` (shared text counts once per worker holding it).
    pub fn worker_chars(&self, worker: WorkerId) -> u64 {
        match self.counts.binary_search_by_key(&worker, |&(w, _)| w) {
            Ok(i) => self.counts[i].1,
            Err(_) => 0,
        }
    }

    /// Every worker present in the tree with the characters it holds, sorted by worker. Used by
    /// the writer to find workers over budget and by metrics.
    pub fn worker_char_counts(&self) -> impl ExactSizeIterator<Item = (WorkerId, u64)> + '_ {
        self.counts.iter().copied()
    }

    /// Characters summed over workers (shared text counts once per worker holding it).
    pub fn total_chars(&self) -> u64 {
        self.counts.iter().map(|&(_, c)| c).sum()
    }

    /// Number of nodes (root included).
    pub fn node_count(&self) -> usize {
        self.nodes
    }

    /// Bytes of text stored in edges (each shared prefix once, whatever the number of workers).
    /// O(nodes): for memory accounting in benches and debugging, not for the request path.
    pub fn stored_bytes(&self) -> usize {
        let mut total = 0;
        let mut stack: Vec<&Node> = vec![&self.root];
        while let Some(node) = stack.pop() {
            total += node.edge().len();
            stack.extend(node.kids.iter().map(|k| &**k));
        }
        total
    }
}
