//! The structural invariant checker (test builds only): one iterative pass over the whole tree
//! that the unit and property tests run after every operation.

use super::repr::{char_key, Node};
use super::RadixTree;
use crate::base::WorkerId;

impl RadixTree {
    /// Checks every structural invariant (see the module docs) in one iterative pass. O(nodes);
    /// for the tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        let root = &self.root;
        if !root.edge().is_empty() || root.edge_chars != 0 {
            return Err("root has an edge".into());
        }
        let mut counts: Vec<(WorkerId, u64)> = root.workers.ids().iter().map(|&w| (w, 0)).collect();
        let mut nodes = 0usize;
        let mut stack: Vec<&Node> = vec![root];
        while let Some(node) = stack.pop() {
            nodes += 1;
            if node.edge.len() > node.edge.buffer_len() {
                return Err("edge longer than its buffer".into());
            }
            if !node.workers.ids().windows(2).all(|w| w[0] < w[1]) {
                return Err("worker ids not strictly sorted".into());
            }
            if !node.workers.well_formed() {
                return Err("malformed worker set".into());
            }
            let is_root = std::ptr::eq(node, &**root);
            if !is_root {
                let edge = node.edge();
                let Ok(text) = std::str::from_utf8(edge) else {
                    return Err(format!("edge {edge:?} splits a character"));
                };
                if edge.is_empty() {
                    return Err("empty edge".into());
                }
                if text.chars().count() != node.edge_chars as usize {
                    return Err(format!("edge_chars wrong for {text:?}"));
                }
                if node.workers.is_empty() {
                    return Err(format!("node {text:?} held by nobody"));
                }
                if node.kids.len() == 1 && node.workers.same_ids(&node.kids[0].workers) {
                    return Err(format!(
                        "node {text:?} should be merged with its only child"
                    ));
                }
                for &w in node.workers.ids() {
                    match counts.binary_search_by_key(&w, |&(x, _)| x) {
                        Ok(i) => counts[i].1 += u64::from(node.edge_chars),
                        Err(_) => return Err(format!("worker {w} missing at the root")),
                    }
                }
            }
            for (i, kid) in node.kids.iter().enumerate() {
                let edge = kid.edge();
                if edge.is_empty() || kid.key != char_key(edge) {
                    return Err("child key is not the edge's first character".into());
                }
                if kid.bloom != kid.workers.bloom() {
                    return Err("child bloom does not match its workers".into());
                }
                if i > 0 && node.kids[i - 1].key >= kid.key {
                    return Err(
                        "child keys not strictly sorted (siblings share a character)".into(),
                    );
                }
                for (j, &w) in kid.workers.ids().iter().enumerate() {
                    match node.workers.time(w) {
                        None => return Err(format!("worker {w} on a child but not its parent")),
                        Some(t) if t < kid.workers.time_at(j) => {
                            return Err(format!("worker {w} newer on a child than its parent"))
                        }
                        Some(_) => {}
                    }
                }
                stack.push(kid);
            }
        }
        if nodes != self.nodes {
            return Err(format!("node count {} but {} counted", self.nodes, nodes));
        }
        if counts != *self.counts {
            return Err(format!(
                "char counts {:?} but recounted {counts:?}",
                self.counts
            ));
        }
        Ok(())
    }
}
