//! The event mix of one simulated DP rank, pure: what a SGLang radix cache would publish while
//! it serves chat traffic, bounded by a capacity in blocks.
//!
//! - A **new conversation** starts from one of [`SYSTEM_PROMPTS`] shared system prompts (the
//!   same engine hashes and tokens on every rank, so the gateway's index shares them): the
//!   prompt's blocks are stored (parent nil) when the rank does not hold it yet, then the first
//!   turn's own blocks chained from its last block.
//! - A **chat turn** extends one held conversation: `BlockStored` with `parent_block_hash` =
//!   the conversation's last block.
//! - Turns are [`Rank::chain_len`] blocks long (geometric, mean [`MEAN_CHAIN`], 1..=64).
//! - **Removals**: before a store would take the rank past its capacity, the least recently
//!   touched conversation loses blocks from its tail (leaves first), as many as needed; an
//!   emptied conversation is dropped and, when it was the last one on its system prompt, the
//!   prompt's blocks go too (then leaves themselves). Pinned conversations (the seeds the
//!   background requests use, markers until their probe is over) are never evicted.
//!
//! Token ids are a function of the engine hash ([`block_tokens`]), so a block always carries
//! the same tokens and anyone holding a chain's hashes can rebuild its prompt.

use crate::rng::{mix64, Rng};
use crate::sim::radix::{CacheEvent, Medium};

/// Shared system prompts every rank draws new conversations from.
pub const SYSTEM_PROMPTS: usize = 32;
/// Mean blocks of one turn.
pub const MEAN_CHAIN: f64 = 16.0;
/// Longest turn, in blocks.
pub const MAX_CHAIN: usize = 64;
/// Chance that a request starts a new conversation (else it extends a held one).
pub const NEW_CONVERSATION: f64 = 0.3;
/// Token ids drawn below this (a Llama-3-sized vocabulary).
const VOCAB: u64 = 128_000;
/// Seed of the shared system prompts' engine hashes.
const SYSTEM_SEED: u64 = 0x5359_5354_454d_5031;

/// The `block_size` tokens of the block whose engine hash is `hash`.
pub fn block_tokens(hash: u64, block_size: usize, out: &mut Vec<u32>) {
    for i in 0..block_size as u64 {
        out.push((mix64(hash ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15)) % VOCAB) as u32);
    }
}

/// The tokens of a chain of blocks.
pub fn chain_tokens(hashes: &[u64], block_size: usize) -> Vec<u32> {
    let mut t = Vec::with_capacity(hashes.len() * block_size);
    for &h in hashes {
        block_tokens(h, block_size, &mut t);
    }
    t
}

/// The engine hashes of shared system prompt `p` (2..=8 blocks, the same on every rank).
pub fn system_prompt(p: usize) -> Vec<u64> {
    let n = 2 + (mix64(SYSTEM_SEED ^ p as u64) % 7) as usize;
    let mut h = mix64(SYSTEM_SEED.wrapping_add(p as u64));
    (0..n)
        .map(|i| {
            h = mix64(h ^ (i as u64 + 1));
            h
        })
        .collect()
}

/// One conversation a rank holds: its own blocks (after its system prompt, if any).
#[derive(Debug, Clone)]
pub struct Conv {
    /// The system prompt it starts from (`None`: a marker, stored from the root).
    pub system: Option<usize>,
    /// Its own blocks' engine hashes, in chain order.
    pub hashes: Vec<u64>,
    /// Logical clock of its last store (LRU key).
    pub touched: u64,
    /// Never evicted (a seed the background requests ask for).
    pub pinned: bool,
    /// Not evicted before this time (ms on the caller's clock): a marker being probed.
    pub pin_until_ms: u64,
}

/// What [`Rank::request`] and friends produced: the events, and the blocks stored by them.
#[derive(Debug, Default)]
pub struct Produced {
    /// Events in publication order (removals first, then the stores).
    pub events: Vec<CacheEvent>,
    /// Blocks stored.
    pub stored: u64,
    /// Blocks removed.
    pub removed: u64,
}

/// One DP rank's cache, as far as events go.
#[derive(Debug)]
pub struct Rank {
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks held at most (past it the LRU conversation's tail is removed first).
    pub capacity: usize,
    /// Conversations held.
    pub convs: Vec<Conv>,
    /// Per system prompt: conversations on it (its blocks are held while > 0).
    sys_refs: Vec<u32>,
    /// Blocks held now.
    pub held: usize,
    clock: u64,
}

impl Rank {
    /// An empty rank.
    pub fn new(block_size: usize, capacity: usize) -> Self {
        Rank {
            block_size: block_size.max(1),
            capacity: capacity.max(2 * MAX_CHAIN + 16),
            convs: Vec::new(),
            sys_refs: vec![0; SYSTEM_PROMPTS],
            held: 0,
            clock: 0,
        }
    }

    /// A turn's length in blocks: geometric, mean [`MEAN_CHAIN`], within 1..=[`MAX_CHAIN`].
    pub fn chain_len(rng: &mut Rng) -> usize {
        (1 + rng.geometric(MEAN_CHAIN - 1.0) as usize).min(MAX_CHAIN)
    }

    fn stored(&self, hashes: Vec<u64>, parent: Option<u64>) -> CacheEvent {
        let tokens = chain_tokens(&hashes, self.block_size);
        CacheEvent::Stored {
            hashes,
            parent,
            tokens,
            medium: Medium::Gpu,
            tags: None,
        }
    }

    /// One request's events: a new conversation or a turn of a held one.
    pub fn request(&mut self, rng: &mut Rng, now_ms: u64) -> Produced {
        let n = Self::chain_len(rng);
        let extendable = self.convs.iter().any(|c| !c.pinned && c.system.is_some());
        if extendable && !rng.chance(NEW_CONVERSATION) {
            // A random unpinned conversation (a few draws; pinned ones are few).
            for _ in 0..8 {
                let i = rng.below(self.convs.len());
                if !self.convs[i].pinned && self.convs[i].system.is_some() {
                    return self.extend(i, n, rng, now_ms);
                }
            }
        }
        self.start(rng.below(SYSTEM_PROMPTS), n, false, rng, now_ms)
    }

    /// A new conversation on system prompt `p` with `n` own blocks.
    pub fn start(
        &mut self,
        p: usize,
        n: usize,
        pinned: bool,
        rng: &mut Rng,
        now_ms: u64,
    ) -> Produced {
        let sys = system_prompt(p);
        // Decided before making room: evicting the prompt's other conversations then cannot
        // drop the prompt (this one's reference is counted first), so it stays held.
        let fresh = self.sys_refs[p] == 0;
        let need = n + if fresh { sys.len() } else { 0 };
        let mut out = Produced::default();
        self.sys_refs[p] += 1;
        self.make_room(need, now_ms, &mut out);
        if fresh {
            self.held += sys.len();
            out.stored += sys.len() as u64;
            out.events.push(self.stored(sys.clone(), None));
        }
        let mut parent = *sys.last().expect("a system prompt has blocks");
        let hashes: Vec<u64> = (0..n)
            .map(|_| {
                parent = mix64(parent ^ rng.next_u64());
                parent
            })
            .collect();
        self.held += n;
        out.stored += n as u64;
        out.events
            .push(self.stored(hashes.clone(), sys.last().copied()));
        self.clock += 1;
        self.convs.push(Conv {
            system: Some(p),
            hashes,
            touched: self.clock,
            pinned,
            pin_until_ms: 0,
        });
        out
    }

    /// Conversation `i` extended by `n` blocks.
    fn extend(&mut self, i: usize, n: usize, rng: &mut Rng, now_ms: u64) -> Produced {
        let mut out = Produced::default();
        // The conversation being extended must keep its tail: touch it first.
        self.clock += 1;
        self.convs[i].touched = self.clock;
        let id = self.convs[i].hashes.last().copied();
        self.make_room(n, now_ms, &mut out);
        // make_room may have reordered (swap_remove) the list: find it again by its tail.
        let Some(i) = self
            .convs
            .iter()
            .position(|c| c.hashes.last().copied() == id)
        else {
            return out;
        };
        let sys_last = self.convs[i]
            .system
            .and_then(|p| system_prompt(p).last().copied());
        let mut parent = self.convs[i].hashes.last().copied().or(sys_last);
        let first_parent = parent;
        let hashes: Vec<u64> = (0..n)
            .map(|_| {
                let h = mix64(parent.unwrap_or(0) ^ rng.next_u64());
                parent = Some(h);
                h
            })
            .collect();
        self.held += n;
        out.stored += n as u64;
        self.convs[i].hashes.extend_from_slice(&hashes);
        out.events.push(self.stored(hashes, first_parent));
        out
    }

    /// A marker: `n` blocks of fresh tokens stored from the root, pinned until `pin_until_ms`.
    /// Returns the events and the marker's tokens.
    pub fn marker(
        &mut self,
        n: usize,
        rng: &mut Rng,
        now_ms: u64,
        pin_until_ms: u64,
    ) -> (Produced, Vec<u32>) {
        let mut out = Produced::default();
        self.make_room(n, now_ms, &mut out);
        let mut parent = rng.next_u64();
        let hashes: Vec<u64> = (0..n)
            .map(|_| {
                parent = mix64(parent ^ rng.next_u64());
                parent
            })
            .collect();
        let tokens = chain_tokens(&hashes, self.block_size);
        self.held += n;
        out.stored += n as u64;
        out.events.push(self.stored(hashes.clone(), None));
        self.clock += 1;
        self.convs.push(Conv {
            system: None,
            hashes,
            touched: self.clock,
            pinned: false,
            pin_until_ms,
        });
        (out, tokens)
    }

    /// Remove least recently touched leaves until `need` more blocks fit the capacity (or
    /// nothing evictable is left).
    fn make_room(&mut self, need: usize, now_ms: u64, out: &mut Produced) {
        while self.held + need > self.capacity {
            let victim = self
                .convs
                .iter()
                .enumerate()
                .filter(|(_, c)| !c.pinned && c.pin_until_ms <= now_ms)
                .min_by_key(|(_, c)| c.touched)
                .map(|(i, _)| i);
            let Some(v) = victim else { return };
            let excess = self.held + need - self.capacity;
            let c = &mut self.convs[v];
            let k = excess.min(c.hashes.len());
            let tail: Vec<u64> = c.hashes.drain(c.hashes.len() - k..).rev().collect();
            self.held -= k;
            out.removed += k as u64;
            if !tail.is_empty() {
                out.events.push(CacheEvent::Removed {
                    hashes: tail,
                    medium: Medium::Gpu,
                });
            }
            if self.convs[v].hashes.is_empty() {
                let c = self.convs.swap_remove(v);
                if let Some(p) = c.system {
                    self.sys_refs[p] -= 1;
                    if self.sys_refs[p] == 0 {
                        let sys: Vec<u64> = system_prompt(p).into_iter().rev().collect();
                        self.held -= sys.len();
                        out.removed += sys.len() as u64;
                        out.events.push(CacheEvent::Removed {
                            hashes: sys,
                            medium: Medium::Gpu,
                        });
                    }
                }
            }
        }
    }

    /// The full token prompt of conversation `i` (system prompt, then its own blocks).
    pub fn prompt(&self, i: usize) -> Vec<u32> {
        let c = &self.convs[i];
        let mut hashes = c.system.map(system_prompt).unwrap_or_default();
        hashes.extend_from_slice(&c.hashes);
        chain_tokens(&hashes, self.block_size)
    }
}

#[cfg(test)]
mod tests;
