//! A prompt measured against the index on a serving core: the core's buffers, why the text tree
//! decides instead, and the match itself.

use super::*;
use crate::base::WorkerId;
use crate::kv::index::{namespace_root, ChainMemo, MatchScratch};
use crate::route::extract::Namespace;
use crate::tokenize::SegmentCache;
use xxhash_rust::xxh3::xxh3_64;

/// One core's buffers for measuring prompts against the index: reused request after request,
/// so a match allocates nothing once they have grown.
#[derive(Debug, Default)]
pub struct KvScratch {
    /// The prompt's block chain at the model's block size (see [`KvScratch::chain`]), with
    /// this core's recent prompts to take a shared prefix's chain from.
    memo: ChainMemo,
    /// Tokens of the prompt cached per worker (index ∪ pending).
    pub cached: Vec<(WorkerId, usize)>,
    /// The index model (hashed) the prompt was measured against.
    pub model_hash: u64,
    /// That model's block size.
    pub block_size: usize,
    /// This core's cache of token ids per prompt piece (created on first use).
    pub segments: Option<SegmentCache>,
    /// The winning workers of a decision (see `ExactInput::holders`).
    pub holders: std::cell::RefCell<Vec<WorkerId>>,
    buf: Vec<u8>,
    matches: MatchScratch,
    /// Pending entries' blocks per worker, before they join `cached`.
    pending: Vec<(WorkerId, usize)>,
}

/// Why a prompt was routed by the text tree although `--kv-events` is on (the label of
/// `radixgate_kv_fallback_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// No `--tokenizer-path`, and the request carries no token ids.
    NoTokenizer,
    /// The tokenizer refused the request (too large, no chat template, template error).
    Tokenize,
    /// `input_ids` that are not all integers below 2^32.
    BadTokenIds,
    /// The model has no events yet (block size unknown), or the index knows no such model.
    NoIndex,
    /// An API whose prompt the servers do not prefill into their prefix cache the same way
    /// (embeddings, rerank).
    OtherApi,
    /// A request with an `extra_key`: SGLang keeps its blocks apart, but its events do not say
    /// which blocks were stored under which key.
    Namespace,
    /// The prompt was not encoded within its time budget (see `gateway::tokenizing`).
    TokenizeBudget,
    /// The tokenizer helpers had no room for the prompt (this core's share, or their queue).
    TokenizerBusy,
}

impl Fallback {
    /// Every reason, for series that exist from the start.
    pub const ALL: [Fallback; 8] = [
        Fallback::NoTokenizer,
        Fallback::Tokenize,
        Fallback::BadTokenIds,
        Fallback::NoIndex,
        Fallback::OtherApi,
        Fallback::Namespace,
        Fallback::TokenizeBudget,
        Fallback::TokenizerBusy,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Fallback::NoTokenizer => "no_tokenizer",
            Fallback::Tokenize => "tokenize_error",
            Fallback::BadTokenIds => "bad_token_ids",
            Fallback::NoIndex => "no_index",
            Fallback::OtherApi => "other_api",
            Fallback::Namespace => "namespace",
            Fallback::TokenizeBudget => "tokenize_budget",
            Fallback::TokenizerBusy => "tokenizer_busy",
        }
    }
}

/// A token-id prompt as the extractor wrote it (decimals joined by spaces, after the
/// namespace's marker when it has one) into `out`. The extractor caps its text, marker
/// included, so when `text` is at the cap its last number may be cut: it is dropped.
pub fn parse_token_ids(text: &str, capped_at: usize, out: &mut Vec<u32>) -> Result<(), Fallback> {
    out.clear();
    // The cap counts the whole text; the ids are what follows the marker.
    let whole = text.len();
    let text = crate::route::extract::without_marker(text);
    // One pass over the bytes (a 4k-token prompt is ~24 KB of decimals): `str::parse` per
    // split word cost ~35 µs of a request.
    let mut id: u64 = 0;
    let mut digits = false;
    for &b in text.as_bytes() {
        match b {
            b'0'..=b'9' => {
                id = id * 10 + u64::from(b - b'0');
                if id > u64::from(u32::MAX) {
                    return Err(Fallback::BadTokenIds);
                }
                digits = true;
            }
            b if b.is_ascii_whitespace() => {
                if digits {
                    out.push(id as u32);
                }
                (id, digits) = (0, false);
            }
            _ => return Err(Fallback::BadTokenIds),
        }
    }
    if digits {
        out.push(id as u32);
    }
    if whole + 24 >= capped_at {
        out.pop();
    }
    Ok(())
}

/// Token ids a core's segment cache keeps (about 4 MiB of ids plus ~40 bytes a piece): the
/// histories of a few thousand live conversations.
pub const SEGMENT_CACHE_TOKENS: usize = 1 << 20;

impl KvScratch {
    /// The measured prompt's block chain (empty when it was not measured).
    pub fn chain(&self) -> &[u64] {
        self.memo.chain()
    }

    /// Whether `worker` already holds every whole block of the measured prompt (by the index
    /// or a pending entry): routing it there predicts nothing new.
    pub fn holds_all(&self, worker: WorkerId) -> bool {
        let whole = self.chain().len() * self.block_size;
        self.cached.iter().any(|&(w, n)| w == worker && n >= whole)
    }
}

impl KvRouting {
    /// Measure the prompt `tokens` for a request naming `model` (for an adapter named by its
    /// own name: its base model, the adapter given as `adapter`) in cache namespace `ns`:
    /// its block chain (from the namespace's root), and per worker the tokens of its prefix the
    /// index and the pending entries put there, a block held only in host memory counting
    /// `--kv-host-tier-weight` of one on the GPU. Returns the prompt's token count, or why the
    /// text tree must decide instead.
    pub fn measure(
        &self,
        model: Option<&str>,
        adapter: Option<&str>,
        ns: &Namespace<'_>,
        tokens: &[u32],
        s: &mut KvScratch,
        now_ms: u64,
    ) -> Result<usize, Fallback> {
        // Until this prompt's chain is computed, there is none (not the previous prompt's).
        s.memo.forget_current();
        if ns.extra_key.is_some() {
            return Err(Fallback::Namespace);
        }
        let snap = self.reader.load();
        let m = Self::index_model(&snap, model).ok_or(Fallback::NoIndex)?;
        let bs = snap.block_size(m).ok_or(Fallback::NoIndex)?;
        // SGLang's `lora_path` first, then an adapter the workers list by name, then
        // SGLang's `base:adapter` model.
        let adapter = ns
            .lora_path
            .as_deref()
            .or(adapter)
            .or_else(|| Self::model_adapter(&snap, model));
        let root = namespace_root(ns.cache_salt.as_deref(), adapter);
        let KvScratch {
            memo,
            cached,
            model_hash,
            block_size,
            buf,
            matches,
            pending,
            ..
        } = s;
        *block_size = bs;
        memo.compute(tokens, bs, root, MAX_MATCH_TOKENS / bs, buf);
        let chain = memo.chain();
        cached.clear();
        for pm in snap.match_chain(m, chain, matches) {
            // In tokens: the GPU's blocks whole, the ones only in host memory weighted.
            let host_only = f64::from(pm.with_host - pm.blocks) * self.host_weight;
            let n = ((f64::from(pm.blocks) + host_only) * bs as f64).round() as usize;
            match cached.iter_mut().find(|(w, _)| *w == pm.source.worker) {
                Some((_, b)) => *b = (*b).max(n),
                None => cached.push((pm.source.worker, n)),
            }
        }
        *model_hash = xxh3_64(m.as_bytes());
        // Pending entries are prompts routed and not confirmed yet: counted as GPU blocks.
        pending.clear();
        self.pending.raise(*model_hash, chain, now_ms, pending);
        for &(w, blocks) in pending.iter() {
            let n = blocks * bs;
            match cached.iter_mut().find(|(x, _)| *x == w) {
                Some((_, b)) => *b = (*b).max(n),
                None => cached.push((w, n)),
            }
        }
        cached.retain(|&(_, n)| n > 0);
        Ok(tokens.len())
    }
}
