//! The set of workers holding a node, with their last access times, in 16 bytes.

use super::repr::bloom_bit;
use crate::base::WorkerId;
use triomphe::{Arc, ThinArc};

/// The workers holding a node and their last access times. Most nodes (leaves) have one worker,
/// kept inline: no allocation and no extra cache miss. Otherwise one shared allocation behind a
/// thin pointer (a path copy of the node shares it until a time changes): the sorted ids, then
/// each time as two `u32` halves (low, high). Either way the ids are contiguous, so
/// [`RadixTree::longest_match`](super::RadixTree::longest_match) returns them as a borrowed slice.
#[derive(Clone, Default)]
pub(super) enum Workers {
    #[default]
    Empty,
    One {
        id: WorkerId,
        time: u64,
    },
    /// At least two workers.
    Many(ThinArc<(), u32>),
}

/// Packs two or more (id, time) entries, sorted by id.
fn pack(entries: &[(WorkerId, u64)]) -> Workers {
    let mut v = Vec::with_capacity(3 * entries.len());
    v.extend(entries.iter().map(|&(w, _)| w));
    for &(_, t) in entries {
        v.extend_from_slice(&[t as u32, (t >> 32) as u32]);
    }
    many(&v)
}

fn many(packed: &[u32]) -> Workers {
    Workers::Many(ThinArc::from_header_and_slice((), packed))
}

impl Workers {
    pub(super) fn one(worker: WorkerId, now: u64) -> Self {
        Workers::One {
            id: worker,
            time: now,
        }
    }

    #[inline]
    pub(super) fn len(&self) -> usize {
        match self {
            Workers::Empty => 0,
            Workers::One { .. } => 1,
            Workers::Many(b) => b.slice.len() / 3,
        }
    }

    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        matches!(self, Workers::Empty)
    }

    #[inline]
    pub(super) fn ids(&self) -> &[WorkerId] {
        match self {
            Workers::Empty => &[],
            Workers::One { id, .. } => std::slice::from_ref(id),
            Workers::Many(b) => &b.slice[..b.slice.len() / 3],
        }
    }

    #[inline]
    pub(super) fn find(&self, worker: WorkerId) -> Result<usize, usize> {
        match self {
            Workers::One { id, .. } => match worker.cmp(id) {
                std::cmp::Ordering::Equal => Ok(0),
                std::cmp::Ordering::Less => Err(0),
                std::cmp::Ordering::Greater => Err(1),
            },
            _ => self.ids().binary_search(&worker),
        }
    }

    #[inline]
    pub(super) fn contains(&self, worker: WorkerId) -> bool {
        self.find(worker).is_ok()
    }

    pub(super) fn time_at(&self, i: usize) -> u64 {
        match self {
            Workers::Empty => 0,
            Workers::One { time, .. } => *time,
            Workers::Many(b) => {
                let base = b.slice.len() / 3 + 2 * i;
                u64::from(b.slice[base]) | (u64::from(b.slice[base + 1]) << 32)
            }
        }
    }

    pub(super) fn set_time_at(&mut self, i: usize, t: u64) {
        match self {
            Workers::Empty => {}
            Workers::One { time, .. } => *time = t,
            Workers::Many(b) => {
                let base = b.slice.len() / 3 + 2 * i;
                let halves = [t as u32, (t >> 32) as u32];
                // In place when this node's copy is the only one; else copy on write.
                let written = b.with_arc_mut(|a| match Arc::get_mut(a) {
                    Some(p) => {
                        p.slice_mut()[base..base + 2].copy_from_slice(&halves);
                        true
                    }
                    None => false,
                });
                if !written {
                    let mut v = b.slice.to_vec();
                    v[base..base + 2].copy_from_slice(&halves);
                    *b = ThinArc::from_header_and_slice((), &v);
                }
            }
        }
    }

    pub(super) fn time(&self, worker: WorkerId) -> Option<u64> {
        self.find(worker).ok().map(|i| self.time_at(i))
    }

    /// Adds `worker` or refreshes its time (never moving it backwards). Returns `true` if added.
    pub(super) fn touch(&mut self, worker: WorkerId, now: u64) -> bool {
        let pos = match self.find(worker) {
            Ok(i) => {
                if self.time_at(i) < now {
                    self.set_time_at(i, now);
                }
                return false;
            }
            Err(pos) => pos,
        };
        *self = match self {
            Workers::Empty => Workers::one(worker, now),
            Workers::One { id, time } if pos == 0 => pack(&[(worker, now), (*id, *time)]),
            Workers::One { id, time } => pack(&[(*id, *time), (worker, now)]),
            Workers::Many(b) => {
                let b = &b.slice;
                let len = b.len() / 3;
                let mut v = Vec::with_capacity(3 * (len + 1));
                v.extend_from_slice(&b[..pos]);
                v.push(worker);
                v.extend_from_slice(&b[pos..len + 2 * pos]);
                v.extend_from_slice(&[now as u32, (now >> 32) as u32]);
                v.extend_from_slice(&b[len + 2 * pos..]);
                many(&v)
            }
        };
        true
    }

    /// Removes `worker`; returns `true` if it was present.
    pub(super) fn remove(&mut self, worker: WorkerId) -> bool {
        let Ok(pos) = self.find(worker) else {
            return false;
        };
        *self = match self {
            Workers::Empty | Workers::One { .. } => Workers::Empty,
            Workers::Many(b) if b.slice.len() == 6 => {
                let other = 1 - pos;
                Workers::one(b.slice[other], self.time_at(other))
            }
            Workers::Many(b) => {
                let b = &b.slice;
                let len = b.len() / 3;
                let mut v = Vec::with_capacity(3 * (len - 1));
                v.extend_from_slice(&b[..pos]);
                v.extend_from_slice(&b[pos + 1..len + 2 * pos]);
                v.extend_from_slice(&b[len + 2 * pos + 2..]);
                many(&v)
            }
        };
        true
    }

    /// Representation invariant: `Many` holds whole entries, at least two.
    #[cfg(test)]
    pub(super) fn well_formed(&self) -> bool {
        match self {
            Workers::Empty | Workers::One { .. } => true,
            Workers::Many(b) => b.slice.len() % 3 == 0 && b.slice.len() >= 6,
        }
    }

    pub(super) fn bloom(&self) -> u32 {
        self.ids().iter().fold(0, |acc, &w| acc | bloom_bit(w))
    }

    pub(super) fn same_ids(&self, other: &Workers) -> bool {
        self.ids() == other.ids()
    }

    /// Per worker, the later of the two times. Both sets must hold the same ids.
    pub(super) fn merge_times_max(&mut self, other: &Workers) {
        debug_assert!(self.same_ids(other));
        for i in 0..self.len().min(other.len()) {
            let t = other.time_at(i);
            if self.time_at(i) < t {
                self.set_time_at(i, t);
            }
        }
    }
}
