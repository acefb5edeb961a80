//! Routed but not yet confirmed: with KV events on, a prompt's blocks reach the index only after
//! the server has prefilled them and its event has crossed the network, tens of milliseconds to
//! seconds later. A burst of requests sharing a prefix must follow its first request meanwhile,
//! so every routed prompt leaves a short-lived *pending* entry here (Dynamo calls them predicted
//! blocks, llm-d speculative entries): its block chain and the worker it went to. Selection
//! treats a pending entry like blocks the index holds, until it expires. Lock-free, shared by
//! every core, pure (time is passed in).
//!
//! Memory: [`CAPACITY`] slots, each at most [`MAX_CHAIN`] hashes (8 bytes each): 8 MiB at most.

use crate::base::WorkerId;
use arc_swap::ArcSwapOption;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// Slots in the ring: a burst larger than this within [`PendingBlocks::ttl_ms`] loses its
/// oldest entries (then the index, which has caught up with most of them by then, answers).
pub const CAPACITY: usize = 512;

/// Blocks kept of one prompt (at 16-token pages, 32k tokens; the rest of a longer prompt is
/// not predicted, only matched in the index).
pub const MAX_CHAIN: usize = 2048;

#[derive(Debug)]
struct Entry {
    model: u64,
    worker: WorkerId,
    chain: Box<[u64]>,
    at_ms: u64,
}

/// What [`PendingBlocks::raise`] needs to pass over a slot, readable without loading its entry
/// (an `ArcSwap` load costs a hazard-pointer round; at hundreds of requests a second every slot
/// is live, so a prompt would load all [`CAPACITY`] of them). Written after the entry; a reader
/// that sees a mix of two pushes' fields only skips or re-checks a slot, it never trusts them:
/// the entry itself is checked before it counts.
#[derive(Debug, Default)]
struct SlotMeta {
    model: AtomicU64,
    first: AtomicU64,
    at_ms: AtomicU64,
    /// Worker id in the high half, chain length in the low half; 0 for an empty slot.
    worker_len: AtomicU64,
}

/// The ring of pending entries.
#[derive(Debug)]
pub struct PendingBlocks {
    slots: Box<[ArcSwapOption<Entry>]>,
    meta: Box<[SlotMeta]>,
    next: AtomicUsize,
    ttl_ms: u64,
}

impl PendingBlocks {
    /// An empty ring whose entries count for `ttl_ms` after routing.
    pub fn new(ttl_ms: u64) -> Self {
        PendingBlocks {
            slots: (0..CAPACITY).map(|_| ArcSwapOption::empty()).collect(),
            meta: (0..CAPACITY).map(|_| SlotMeta::default()).collect(),
            next: AtomicUsize::new(0),
            ttl_ms,
        }
    }

    /// How long an entry counts.
    pub fn ttl_ms(&self) -> u64 {
        self.ttl_ms
    }

    /// A prompt whose block chain is `chain` (model hashed to `model`) was routed to `worker`.
    pub fn push(&self, model: u64, worker: WorkerId, chain: &[u64], now_ms: u64) {
        if chain.is_empty() {
            return;
        }
        let chain = &chain[..chain.len().min(MAX_CHAIN)];
        let i = self.next.fetch_add(1, Ordering::Relaxed) % CAPACITY;
        self.slots[i].store(Some(Arc::new(Entry {
            model,
            worker,
            chain: chain.into(),
            at_ms: now_ms,
        })));
        let m = &self.meta[i];
        m.model.store(model, Ordering::Relaxed);
        m.first.store(chain[0], Ordering::Relaxed);
        m.at_ms.store(now_ms, Ordering::Relaxed);
        m.worker_len.store(
            u64::from(worker) << 32 | chain.len() as u64,
            Ordering::Release,
        );
    }

    /// Forget a worker's entries (removed, or refusing connections).
    pub fn forget_worker(&self, worker: WorkerId) {
        for (slot, m) in self.slots.iter().zip(self.meta.iter()) {
            if slot.load().as_ref().is_some_and(|e| e.worker == worker) {
                slot.store(None);
                m.worker_len.store(0, Ordering::Release);
            }
        }
    }

    /// For each worker with a live entry sharing a prefix with `chain`, the most leading blocks
    /// shared, raised into `out` (`(worker, blocks)`; an existing pair for the worker keeps the
    /// larger count, a new worker is appended). Expired entries met are dropped.
    pub fn raise(&self, model: u64, chain: &[u64], now_ms: u64, out: &mut Vec<(WorkerId, usize)>) {
        let Some(&first) = chain.first() else {
            return;
        };
        for (slot, m) in self.slots.iter().zip(self.meta.iter()) {
            // The slot's summary first: most slots are passed over without loading the entry.
            let worker_len = m.worker_len.load(Ordering::Acquire);
            if worker_len == 0 {
                continue;
            }
            let expired = now_ms.saturating_sub(m.at_ms.load(Ordering::Relaxed)) > self.ttl_ms;
            let (worker, len) = ((worker_len >> 32) as WorkerId, worker_len as u32 as usize);
            let known = out.iter().position(|(w, _)| *w == worker);
            let have = known.map_or(0, |i| out[i].1);
            if !expired
                && (m.model.load(Ordering::Relaxed) != model
                    || m.first.load(Ordering::Relaxed) != first
                    || have >= len.min(chain.len()))
            {
                continue; // Another prompt, or nothing this entry could add.
            }
            let guard = slot.load();
            let Some(e) = guard.as_ref() else { continue };
            if now_ms.saturating_sub(e.at_ms) > self.ttl_ms {
                // Expired: emptied once, by whichever reader meets it first.
                let _ = slot.compare_and_swap(&guard, None);
                let _ = m.worker_len.compare_exchange(
                    worker_len,
                    0,
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                );
                continue;
            }
            // The entry is the truth: a push may have replaced it since the summary was read.
            if expired || e.worker != worker || e.model != model || e.chain[0] != first {
                continue;
            }
            let most = e.chain.len().min(chain.len());
            if have >= most {
                continue;
            }
            let n = common_blocks(&e.chain[..most], &chain[..most]);
            match known {
                Some(i) => out[i].1 = have.max(n),
                None => out.push((e.worker, n)),
            }
        }
    }

    /// Entries still counting at `now_ms`.
    pub fn live(&self, now_ms: u64) -> usize {
        self.slots
            .iter()
            .filter(|s| {
                s.load()
                    .as_ref()
                    .is_some_and(|e| now_ms.saturating_sub(e.at_ms) <= self.ttl_ms)
            })
            .count()
    }
}

/// Leading blocks two chains of equal length share. Chained hashes name the whole prefix, so
/// equal at `i` means equal at every `j < i`: a binary search, not a scan.
fn common_blocks(a: &[u64], b: &[u64]) -> usize {
    let (mut lo, mut hi) = (0usize, a.len());
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if a[mid - 1] == b[mid - 1] {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raised(p: &PendingBlocks, model: u64, chain: &[u64], now: u64) -> Vec<(WorkerId, usize)> {
        let mut out = Vec::new();
        p.raise(model, chain, now, &mut out);
        out.sort_unstable();
        out
    }

    #[test]
    fn a_routed_prefix_counts_until_it_expires() {
        let p = PendingBlocks::new(1000);
        p.push(7, 2, &[1, 2, 3, 4], 100);
        assert_eq!(raised(&p, 7, &[1, 2, 3, 9, 9], 500), vec![(2, 3)]);
        // Another model, another first block: nothing.
        assert!(raised(&p, 8, &[1, 2, 3], 500).is_empty());
        assert!(raised(&p, 7, &[5, 2, 3], 500).is_empty());
        // Expired: gone, and the slot is emptied.
        assert!(raised(&p, 7, &[1, 2, 3], 1101).is_empty());
        assert_eq!(p.live(0), 0);
    }

    #[test]
    fn the_longest_entry_per_worker_wins_and_existing_counts_are_only_raised() {
        let p = PendingBlocks::new(1000);
        p.push(1, 3, &[1, 2], 0);
        p.push(1, 3, &[1, 2, 3, 4], 0);
        p.push(1, 4, &[1], 0);
        let mut out = vec![(4, 5)];
        p.raise(1, &[1, 2, 3, 4, 5], 10, &mut out);
        out.sort_unstable();
        assert_eq!(out, vec![(3, 4), (4, 5)]);
    }

    #[test]
    fn common_blocks_of_chains() {
        assert_eq!(common_blocks(&[], &[]), 0);
        assert_eq!(common_blocks(&[1, 2, 3], &[1, 2, 3]), 3);
        assert_eq!(common_blocks(&[1, 2, 3], &[1, 2, 4]), 2);
        assert_eq!(common_blocks(&[1, 2, 3], &[5, 6, 7]), 0);
        for n in 0..40u64 {
            let a: Vec<u64> = (0..40).collect();
            let b: Vec<u64> = (0..40).map(|i| if i < n { i } else { 1000 + i }).collect();
            assert_eq!(common_blocks(&a, &b), n as usize);
        }
    }

    #[test]
    fn forgetting_a_worker_and_the_caps() {
        let p = PendingBlocks::new(1000);
        p.push(1, 3, &[1, 2], 0);
        p.forget_worker(3);
        assert!(raised(&p, 1, &[1, 2], 0).is_empty());
        let long: Vec<u64> = (1..=(MAX_CHAIN as u64 + 10)).collect();
        p.push(1, 5, &long, 0);
        assert_eq!(raised(&p, 1, &long, 0), vec![(5, MAX_CHAIN)]);
        for i in 0..CAPACITY as u64 + 5 {
            p.push(1, 6, &[100 + i], 0);
        }
        assert_eq!(p.live(0), CAPACITY);
        p.push(1, 7, &[], 0);
        assert_eq!(p.live(0), CAPACITY);
    }
}
