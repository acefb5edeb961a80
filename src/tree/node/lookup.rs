//! Longest-prefix match: the only tree operation on the request path, read-only on a snapshot.

use super::repr::Node;
use super::{Match, RadixTree};
use crate::base::text::char_count;
use crate::base::WorkerId;

impl RadixTree {
    /// Longest prefix of `key` present in the tree, with the workers that hold it.
    pub fn longest_match(&self, key: &str) -> Match<'_> {
        let bytes = key.as_bytes();
        let mut node: &Node = &self.root;
        let mut matched_bytes = 0;
        let mut matched_chars = 0;
        let mut workers: &[WorkerId] = &[];
        while matched_bytes < bytes.len() {
            let rest = &bytes[matched_bytes..];
            let Ok((i, n)) = node.find_child(rest) else {
                break;
            };
            let child: &Node = &node.kids[i];
            workers = child.workers.ids();
            if n == child.edge().len() {
                matched_bytes += n;
                matched_chars += child.edge_chars as usize;
                node = child;
            } else {
                // Partial edge: count characters only here.
                matched_bytes += n;
                matched_chars += char_count(&rest[..n]);
                break;
            }
        }
        Match {
            matched_chars,
            matched_bytes,
            workers,
        }
    }
}
