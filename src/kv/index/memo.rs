//! Recent prompts' block chains, one memo per core. Turn k+1 of a conversation re-sends turn
//! k's prompt as its prefix (as do retries, and agents asking many questions over one shared
//! document), and at SGLang's default one-token page a prompt's chain is one strictly
//! sequential hash per token (~8 µs for 4k tokens on the request path). So the chain of the
//! longest prefix a recent prompt shares is taken from that prompt, and only what follows is
//! hashed.
//!
//! Exact by construction: a block is reused only when every token up to its end equals the
//! remembered prompt's, and a block's chained hash depends on those tokens alone (and the block
//! size, which must match). Bounded: at most [`MEMO_ENTRIES`] prompts of at most
//! [`MEMO_ENTRY_TOKENS`] tokens each are kept, 12 bytes per token at one-token pages (4 for the
//! token, 8 for its block's hash): ≤ 24 MiB per core in the worst case, ~1.5 MiB for 32 prompts
//! of 4k tokens. A longer prompt still gets its chain, it is not remembered.

use super::extend_chain;
use crate::base::common_len as common_prefix;
use crate::base::recent::RecentSlots;

/// Prompts remembered per core.
pub const MEMO_ENTRIES: usize = 32;

/// Longest prompt remembered (tokens).
pub const MEMO_ENTRY_TOKENS: usize = 1 << 16;

/// Tokens compared before a full common-prefix scan: prompts that differ this early share
/// nothing worth a scan.
const HEAD: usize = 16;

/// Most full common-prefix scans per prompt (the most recent candidates first): many prompts
/// sharing one system prompt must not each cost a scan of it.
const MAX_SCANS: usize = 4;

#[derive(Debug, Default)]
struct Entry {
    block_size: usize,
    /// The namespace root the chain starts from.
    root: u64,
    tokens: Vec<u32>,
    chain: Vec<u64>,
}

/// Where the chain of the last prompt given to [`ChainMemo::compute`] lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Current {
    #[default]
    None,
    /// The most recent entry.
    Front,
    /// `long` (a prompt too long to remember).
    Long,
}

/// The memo (see the module doc). Not `Sync`: one per core.
#[derive(Debug)]
pub struct ChainMemo {
    entries: RecentSlots<Entry>,
    long: Vec<u64>,
    current: Current,
}

impl Default for ChainMemo {
    fn default() -> Self {
        ChainMemo::new()
    }
}

impl ChainMemo {
    /// An empty memo.
    pub fn new() -> ChainMemo {
        ChainMemo {
            entries: RecentSlots::new(MEMO_ENTRIES),
            long: Vec::new(),
            current: Current::None,
        }
    }

    /// The chain of `tokens` at `block_size` from `root` (whole blocks, at most `max_blocks`),
    /// exactly what [`super::chain_hashes`] computes, with the blocks of the longest prefix a
    /// remembered prompt of the same namespace shares copied instead of hashed; then this
    /// prompt is remembered. Readable through [`ChainMemo::chain`] until the next call. Returns
    /// the blocks reused.
    pub fn compute(
        &mut self,
        tokens: &[u32],
        block_size: usize,
        root: u64,
        max_blocks: usize,
        buf: &mut Vec<u8>,
    ) -> usize {
        self.current = Current::None;
        if block_size == 0 {
            return 0;
        }
        // The longest common prefix among the most recent candidates: (slot, tokens shared,
        // blocks reusable).
        let head = tokens.len().min(HEAD);
        let best = self.entries.best(
            MAX_SCANS,
            |e| {
                e.block_size == block_size
                    && e.root == root
                    && e.tokens.get(..head) == Some(&tokens[..head])
            },
            |slot, e| {
                let common = common_prefix(&e.tokens, tokens);
                let blocks = (common / block_size).min(e.chain.len()).min(max_blocks);
                Some((common, (slot, common, blocks)))
            },
        );
        if tokens.len() > MEMO_ENTRY_TOKENS {
            // Not remembered: the reused prefix is copied out, the rest hashed here.
            self.long.clear();
            if let Some((slot, _, k)) = best {
                self.long
                    .extend_from_slice(&self.entries.get(slot).chain[..k]);
            }
            let k = self.long.len();
            extend_chain(tokens, block_size, root, max_blocks, &mut self.long, buf);
            self.current = Current::Long;
            return k;
        }
        let (e, kept) = self
            .entries
            .claim(best.map(|(slot, common, _)| (slot, common)), |e| {
                e.tokens.len()
            });
        let k = match (kept, best) {
            (true, Some((_, _, k))) => k,
            _ => 0,
        };
        e.block_size = block_size;
        e.root = root;
        e.chain.truncate(k);
        extend_chain(tokens, block_size, root, max_blocks, &mut e.chain, buf);
        e.tokens.clear();
        e.tokens.extend_from_slice(tokens);
        self.current = Current::Front;
        k
    }

    /// The chain of the last prompt given to [`ChainMemo::compute`] (empty before the first,
    /// and after [`ChainMemo::forget_current`]).
    pub fn chain(&self) -> &[u64] {
        match self.current {
            Current::None => &[],
            Current::Front if self.entries.is_empty() => &[],
            Current::Front => &self.entries.get(0).chain,
            Current::Long => &self.long,
        }
    }

    /// The current prompt was not measured (the text tree decided): [`ChainMemo::chain`] is
    /// empty until the next [`ChainMemo::compute`]; the remembered prompts stay.
    pub fn forget_current(&mut self) {
        self.current = Current::None;
    }

    /// Prompts remembered and the tokens they hold (for the memory bound's test).
    #[cfg(test)]
    fn held(&self) -> (usize, usize) {
        (
            self.entries.len(),
            self.entries.iter().map(|e| e.tokens.len()).sum(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::index::{chain_hashes, ROOT_PARENT};

    /// A memo that counts blocks reused (returned by `compute`) and hashed (the rest).
    #[derive(Default)]
    struct Counted {
        memo: ChainMemo,
        reused: u64,
        hashed: u64,
    }

    impl Counted {
        fn compute(&mut self, tokens: &[u32], bs: usize, max: usize, buf: &mut Vec<u8>) -> usize {
            let k = self.memo.compute(tokens, bs, ROOT_PARENT, max, buf);
            self.reused += k as u64;
            self.hashed += (self.memo.chain().len() - k) as u64;
            k
        }
        fn chain(&self) -> &[u64] {
            self.memo.chain()
        }
        fn counts(&self) -> (u64, u64) {
            (self.reused, self.hashed)
        }
    }

    fn reference(tokens: &[u32], bs: usize, max: usize) -> Vec<u64> {
        let (mut out, mut buf) = (Vec::new(), Vec::new());
        chain_hashes(tokens, bs, ROOT_PARENT, max, &mut out, &mut buf);
        out
    }

    #[test]
    fn prompts_of_another_namespace_share_nothing() {
        let mut memo = ChainMemo::new();
        let mut buf = Vec::new();
        let tokens: Vec<u32> = (0..64).collect();
        let salted = crate::kv::index::namespace_root(Some("tenant-a"), None);
        assert_eq!(memo.compute(&tokens, 4, ROOT_PARENT, 100, &mut buf), 0);
        assert_eq!(
            memo.compute(&tokens, 4, salted, 100, &mut buf),
            0,
            "no reuse across roots"
        );
        let mut want = Vec::new();
        chain_hashes(&tokens, 4, salted, 100, &mut want, &mut buf);
        assert_eq!(memo.chain(), &want[..]);
        assert_ne!(want, reference(&tokens, 4, 100));
        assert_eq!(
            memo.compute(&tokens, 4, salted, 100, &mut buf),
            16,
            "same root reuses"
        );
    }

    /// A small deterministic generator (xorshift), so failures reproduce.
    struct Gen(u64);
    impl Gen {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    #[test]
    fn a_conversation_reuses_its_previous_turn_and_stays_exact() {
        let mut memo = Counted::default();
        let mut buf = Vec::new();
        for bs in [1, 2, 16, 64] {
            let mut prompt: Vec<u32> = (0..300).collect();
            for turn in 0..10u32 {
                let before = memo.counts();
                let reused = memo.compute(&prompt, bs, usize::MAX, &mut buf);
                assert_eq!(memo.chain(), &reference(&prompt, bs, usize::MAX)[..]);
                if turn > 0 {
                    // Everything but the new turn's tokens (in whole blocks) came from the memo.
                    assert!(
                        reused >= (prompt.len() - 150) / bs - 1,
                        "bs {bs} turn {turn}"
                    );
                }
                let after = memo.counts();
                assert_eq!(
                    (after.0 - before.0) + (after.1 - before.1),
                    (prompt.len() / bs) as u64
                );
                prompt.extend((0..150).map(|i| 1000 * (turn + 1) + i));
            }
        }
    }

    /// Five random 2,000-token prompts the tests cut and extend.
    fn shared_bases(g: &mut Gen) -> Vec<Vec<u32>> {
        (0..5)
            .map(|_| (0..2000).map(|_| g.below(50) as u32).collect())
            .collect()
    }

    #[test]
    fn random_prompts_get_the_reference_chain() {
        // Prompts built from a few shared prefixes, cut and extended at random, at random
        // block sizes and caps: the memo's chain is always chain_hashes' chain.
        let mut g = Gen(0x1234_5678_9abc_def1);
        let bases = shared_bases(&mut g);
        let mut memo = ChainMemo::new();
        let mut buf = Vec::new();
        for _ in 0..3000 {
            let base = &bases[g.below(5) as usize];
            let cut = g.below(base.len() as u64 + 1) as usize;
            let mut p = base[..cut].to_vec();
            for _ in 0..g.below(40) {
                p.push(g.below(50) as u32);
            }
            let bs = [1, 1, 3, 16][g.below(4) as usize];
            let max = [usize::MAX, 100, 7][g.below(3) as usize];
            memo.compute(&p, bs, ROOT_PARENT, max, &mut buf);
            assert_eq!(memo.chain(), &reference(&p, bs, max)[..]);
        }
    }

    #[test]
    fn prompts_sharing_prefixes_mostly_reuse() {
        // The gateway's cap is fixed (its block size per model too): then a prompt reuses
        // the longest prefix any of the recent prompts of its base shares with it.
        let mut g = Gen(7);
        let bases = shared_bases(&mut g);
        let mut memo = Counted::default();
        let mut buf = Vec::new();
        for _ in 0..2000 {
            let base = &bases[g.below(5) as usize];
            let cut = 1000 + g.below(1001) as usize;
            let mut p = base[..cut].to_vec();
            p.extend((0..g.below(40)).map(|_| g.below(50) as u32));
            memo.compute(&p, 1, usize::MAX, &mut buf);
        }
        let (reused, hashed) = memo.counts();
        assert!(reused > 4 * hashed, "reused {reused}, hashed {hashed}");
    }

    #[test]
    fn a_block_size_change_is_never_reused() {
        let mut memo = ChainMemo::new();
        let mut buf = Vec::new();
        let p: Vec<u32> = (0..256).collect();
        memo.compute(&p, 16, ROOT_PARENT, usize::MAX, &mut buf);
        assert_eq!(memo.compute(&p, 1, ROOT_PARENT, usize::MAX, &mut buf), 0);
        assert_eq!(memo.chain(), &reference(&p, 1, usize::MAX)[..]);
        assert_eq!(memo.compute(&p, 16, ROOT_PARENT, usize::MAX, &mut buf), 16);
    }

    #[test]
    fn a_flood_of_distinct_and_huge_prompts_stays_bounded() {
        let mut memo = ChainMemo::new();
        let mut buf = Vec::new();
        let mut g = Gen(99);
        for i in 0..500u32 {
            let len = if i % 50 == 0 {
                MEMO_ENTRY_TOKENS + 1
            } else {
                g.below(5000) as usize
            };
            let p: Vec<u32> = (0..len).map(|j| i.wrapping_mul(7919) ^ j as u32).collect();
            memo.compute(&p, 1, ROOT_PARENT, usize::MAX, &mut buf);
            assert_eq!(memo.chain().len(), p.len());
            let (entries, tokens) = memo.held();
            assert!(entries <= MEMO_ENTRIES);
            assert!(tokens <= MEMO_ENTRIES * MEMO_ENTRY_TOKENS);
        }
        // The huge prompt's chain was right too, and was not remembered.
        let p: Vec<u32> = (0..MEMO_ENTRY_TOKENS as u32 + 5).collect();
        memo.compute(&p, 1, ROOT_PARENT, usize::MAX, &mut buf);
        assert_eq!(memo.chain(), &reference(&p, 1, usize::MAX)[..]);
        assert!(memo.held().1 <= MEMO_ENTRIES * 5000);
    }

    #[test]
    fn forgetting_the_current_prompt_keeps_the_memo() {
        let mut memo = ChainMemo::new();
        let mut buf = Vec::new();
        let p: Vec<u32> = (0..100).collect();
        memo.compute(&p, 1, ROOT_PARENT, usize::MAX, &mut buf);
        memo.forget_current();
        assert!(memo.chain().is_empty());
        assert_eq!(memo.compute(&p, 1, ROOT_PARENT, usize::MAX, &mut buf), 100);
    }
}
