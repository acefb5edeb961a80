//! The set of workers holding a node, with their last access times, in 24 bytes.

use super::repr::bloom_bit;
use crate::base::WorkerId;

/// The workers holding a node and their last access times. Most nodes (leaves) have one worker,
/// kept inline: no allocation and no extra cache miss. Otherwise one allocation: the sorted ids,
/// then each time as two `u32` halves (low, high). Either way the ids are contiguous, so
/// [`RadixTree::longest_match`](super::RadixTree::longest_match) returns them as a borrowed slice.
#[derive(Clone)]
pub(super) enum Workers {
    One {
        id: WorkerId,
        time: u64,
    },
    /// Zero (an empty box, no allocation) or at least two workers; never exactly one.
    Many(Box<[u32]>),
}

impl Default for Workers {
    fn default() -> Self {
        Workers::Many(Box::default())
    }
}

/// Packs two or more (id, time) entries, sorted by id.
fn pack(entries: &[(WorkerId, u64)]) -> Workers {
    let mut v = Vec::with_capacity(3 * entries.len());
    v.extend(entries.iter().map(|&(w, _)| w));
    for &(_, t) in entries {
        v.extend_from_slice(&[t as u32, (t >> 32) as u32]);
    }
    Workers::Many(v.into_boxed_slice())
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
            Workers::One { .. } => 1,
            Workers::Many(b) => b.len() / 3,
        }
    }

    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    pub(super) fn ids(&self) -> &[WorkerId] {
        match self {
            Workers::One { id, .. } => std::slice::from_ref(id),
            Workers::Many(b) => &b[..b.len() / 3],
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
            Workers::Many(_) => self.ids().binary_search(&worker),
        }
    }

    #[inline]
    pub(super) fn contains(&self, worker: WorkerId) -> bool {
        self.find(worker).is_ok()
    }

    pub(super) fn time_at(&self, i: usize) -> u64 {
        match self {
            Workers::One { time, .. } => *time,
            Workers::Many(b) => {
                let base = b.len() / 3 + 2 * i;
                u64::from(b[base]) | (u64::from(b[base + 1]) << 32)
            }
        }
    }

    pub(super) fn set_time_at(&mut self, i: usize, t: u64) {
        match self {
            Workers::One { time, .. } => *time = t,
            Workers::Many(b) => {
                let base = b.len() / 3 + 2 * i;
                b[base] = t as u32;
                b[base + 1] = (t >> 32) as u32;
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
            Workers::One { id, time } if pos == 0 => pack(&[(worker, now), (*id, *time)]),
            Workers::One { id, time } => pack(&[(*id, *time), (worker, now)]),
            Workers::Many(b) if b.is_empty() => Workers::one(worker, now),
            Workers::Many(b) => {
                let len = b.len() / 3;
                let mut v = Vec::with_capacity(3 * (len + 1));
                v.extend_from_slice(&b[..pos]);
                v.push(worker);
                v.extend_from_slice(&b[pos..len + 2 * pos]);
                v.extend_from_slice(&[now as u32, (now >> 32) as u32]);
                v.extend_from_slice(&b[len + 2 * pos..]);
                Workers::Many(v.into_boxed_slice())
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
            Workers::One { .. } => Workers::default(),
            Workers::Many(b) if b.len() == 6 => {
                let other = 1 - pos;
                Workers::one(b[other], self.time_at(other))
            }
            Workers::Many(b) => {
                let len = b.len() / 3;
                let mut v = Vec::with_capacity(3 * (len - 1));
                v.extend_from_slice(&b[..pos]);
                v.extend_from_slice(&b[pos + 1..len + 2 * pos]);
                v.extend_from_slice(&b[len + 2 * pos + 2..]);
                Workers::Many(v.into_boxed_slice())
            }
        };
        true
    }

    /// Representation invariant: `Many` holds whole entries and never exactly one.
    #[cfg(test)]
    pub(super) fn well_formed(&self) -> bool {
        match self {
            Workers::One { .. } => true,
            Workers::Many(b) => b.len() % 3 == 0 && b.len() != 3,
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
