//! The simulator's `Bpe` tokenizer as a HF tokenizer folder (`sim-worker --write-tokenizer DIR`):
//! cl100k's vocabulary (the ranks compiled into `tiktoken-rs`) as a byte-level BPE
//! `tokenizer.json`, and a `tokenizer_config.json` whose Llama-3 chat template renders what
//! `SimTokenizer::encode_chat` encodes. Gateway and simulators given this folder with
//! `--tokenizer-path` tokenize alike, offline, with a realistic 100k vocabulary.
//!
//! Merges are derived from the ranks the standard way: for each multi-byte token, run tiktoken's
//! own merge loop on its bytes allowing only lower-ranked tokens; the two parts it stops at are
//! that token's merge, ranked by the token's rank. HF's BPE then merges exactly as tiktoken does
//! (lowest rank first), and `ignore_merges` maps a pre-tokenized word that is a whole token
//! straight to it, as tiktoken does. The pre-tokenizer is cl100k's regex (the spelling
//! `tiktoken-rs` uses) as a `Split`, then `ByteLevel` without its own regex; Llama-3's special
//! tokens sit at 128000.. and a post-processor adds `<|begin_of_text|>`.
//!
//! One difference stays by design: the sim's `Bpe` mode encodes special-token text inside a
//! message as plain text (tiktoken's `encode_ordinary`), the HF tokenizer as the special token,
//! as a real server would.

use std::collections::HashMap;
use std::path::Path;

use radixgate::tokenize::folder;
use serde_json::Value;

/// cl100k's pre-tokenizer regex, exactly as `tiktoken-rs` compiles it.
pub const CL100K_PATTERN: &str = "'(?i:[sdmt]|ll|ve|re)|[^\\r\\n\\p{L}\\p{N}]?+\\p{L}++|\\p{N}{1,3}+| ?[^\\s\\p{L}\\p{N}]++[\\r\\n]*+|\\s++$|\\s*[\\r\\n]|\\s+(?!\\S)|\\s";

/// Number of ordinary cl100k tokens (ranks 0..100256).
const CL100K_TOKENS: u32 = 100_256;

/// cl100k's ranks: token bytes → rank.
fn cl100k_ranks() -> Result<HashMap<Vec<u8>, u32>, String> {
    let bpe = tiktoken_rs::cl100k_base_singleton();
    let mut ranks = HashMap::with_capacity(CL100K_TOKENS as usize);
    for r in 0..CL100K_TOKENS {
        let bytes = bpe
            .decode_bytes(&[r])
            .map_err(|e| format!("cl100k has no rank {r}: {e:?}"))?;
        ranks.insert(bytes, r);
    }
    Ok(ranks)
}

/// tiktoken's merge loop on `bytes` with ranks below `max_rank`: the parts it ends with.
fn bpe_parts(bytes: &[u8], ranks: &HashMap<Vec<u8>, u32>, max_rank: u32) -> Vec<Vec<u8>> {
    let mut parts: Vec<Vec<u8>> = bytes.iter().map(|&b| vec![b]).collect();
    loop {
        let mut best: Option<(u32, usize)> = None;
        for i in 0..parts.len().saturating_sub(1) {
            let joined = [parts[i].as_slice(), parts[i + 1].as_slice()].concat();
            if let Some(&r) = ranks.get(&joined) {
                if r < max_rank && best.is_none_or(|(b, _)| r < b) {
                    best = Some((r, i));
                }
            }
        }
        let Some((_, i)) = best else {
            return parts;
        };
        let right = parts.remove(i + 1);
        parts[i].extend_from_slice(&right);
    }
}

/// The `tokenizer.json` of cl100k with Llama-3 specials (see the module docs).
pub fn cl100k_tokenizer_json() -> Result<Value, String> {
    let ranks = cl100k_ranks()?;
    let mut vocab: Vec<(Vec<u8>, u32)> = ranks.iter().map(|(b, &r)| (b.clone(), r)).collect();
    vocab.sort_by_key(|(_, r)| *r);
    let mut merges = Vec::with_capacity(vocab.len());
    for (bytes, rank) in &vocab {
        if bytes.len() < 2 {
            continue;
        }
        let parts = bpe_parts(bytes, &ranks, *rank);
        match <[Vec<u8>; 2]>::try_from(parts) {
            Ok([a, b]) => merges.push((a, b)),
            Err(p) => {
                return Err(format!(
                    "rank {rank} does not split into two lower-ranked tokens ({} parts)",
                    p.len()
                ))
            }
        }
    }
    Ok(folder::byte_level_bpe_json(
        &vocab,
        &merges,
        CL100K_PATTERN,
        &folder::llama3_specials(),
        "<|begin_of_text|>",
    ))
}

/// Writes the cl100k Llama-3-style folder (`tokenizer.json`, `tokenizer_config.json`) to `dir`.
pub fn write_cl100k_folder(dir: &Path) -> Result<(), String> {
    let tok = cl100k_tokenizer_json()?;
    let config = folder::llama3_config(folder::LLAMA3_TEMPLATE);
    folder::write_folder(dir, &tok, &config).map_err(|e| format!("{}: {e}", dir.display()))
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, OnceLock};

    use radixgate::tokenize::{SegmentCache, Tokenizer};
    use serde_json::json;

    use super::*;
    use crate::rng::Rng;
    use crate::sim::tokenizer::{ChatTurn, SimTokenizer, TokenizerMode, BOS};

    /// The converted folder, written once per test process.
    pub(crate) fn cl100k() -> Arc<Tokenizer> {
        static T: OnceLock<Arc<Tokenizer>> = OnceLock::new();
        T.get_or_init(|| {
            let dir = std::env::temp_dir().join(format!("radixgate-cl100k-{}", std::process::id()));
            write_cl100k_folder(&dir).unwrap();
            let t = Tokenizer::from_path(&dir).unwrap();
            let _ = std::fs::remove_dir_all(&dir);
            Arc::new(t)
        })
        .clone()
    }

    const SNIPPETS: &[&str] = &[
        "Hello",
        " world",
        "don't",
        " we'll",
        "I'M",
        " 12345678",
        "3.14159",
        "\n",
        "\n\n",
        "  ",
        "\t",
        " \n ",
        "!!!",
        "?!",
        "fn main() { println!(\"hi\"); }",
        "日本語のテキスト",
        "emoji 🎉🚀",
        "naïve café",
        "    indented",
        "a-b_c",
        "x\r\ny",
        "  trailing  ",
        "\u{a0}nbsp",
        "Ελληνικά",
        "'s",
        "...",
        "$100",
        "über",
        "https://example.com/a?b=c",
        "<b>bold</b>",
        "",
        " ",
        "ok",
    ];

    fn content(rng: &mut Rng) -> String {
        let mut s = String::new();
        for _ in 0..rng.below(8) {
            if rng.chance(0.4) {
                let n = 1 + rng.below(30);
                crate::loadgen::text::push_words(&mut s, rng, n);
            } else {
                s.push_str(SNIPPETS[rng.below(SNIPPETS.len())]);
            }
        }
        s
    }

    /// For random chats the gateway's ids with the converted folder are the sim's `Bpe` ids
    /// (template, specials, BPE merges and the cl100k regex all agree); plain prompts too.
    #[test]
    fn converted_cl100k_matches_the_sim_bpe() {
        let tok = cl100k();
        assert!(tok.is_segment_cacheable() && tok.has_chat_template());
        let sim = SimTokenizer::new(TokenizerMode::Bpe);
        let mut cache = SegmentCache::new(tok.clone(), 1 << 18);
        let mut rng = Rng::new(7);
        let roles = ["system", "user", "assistant", "user", "tool"];
        for case in 0..120 {
            let n = 1 + rng.below(6);
            let msgs: Vec<(String, String)> = (0..n)
                .map(|i| {
                    (
                        roles[(i + case) % roles.len()].to_string(),
                        content(&mut rng),
                    )
                })
                .collect();
            // A final assistant message becomes a user message server-side; keep the sim's view.
            let turns: Vec<ChatTurn<'_>> = msgs
                .iter()
                .enumerate()
                .map(|(i, (r, c))| ChatTurn {
                    role: if i + 1 == n && r == "assistant" {
                        "user"
                    } else {
                        r
                    },
                    content: c,
                })
                .collect();
            let mut want = Vec::new();
            sim.encode_chat(&turns, &mut want);
            let body = json!({"messages": msgs.iter().map(|(r, c)| json!({"role": r, "content": c})).collect::<Vec<_>>()});
            let mut got = Vec::new();
            cache
                .chat_ids(body.to_string().as_bytes(), &mut got)
                .unwrap();
            assert_eq!(got, want, "case {case}: {msgs:?}");

            let text = content(&mut rng);
            let mut want = Vec::new();
            sim.encode_prompt(&text, &mut want).unwrap();
            let mut got = Vec::new();
            cache.text_ids(&text, &mut got).unwrap();
            assert_eq!(got, want, "text {text:?}");
            assert_eq!(got[0], BOS);
        }
        assert!(cache.stats().hits > 0);
    }

    /// Each derived merge is two tokens of lower rank, so HF's BPE replays tiktoken's merges.
    #[test]
    fn merges_split_into_lower_ranks() {
        let ranks = cl100k_ranks().unwrap();
        for (bytes, &r) in ranks.iter().filter(|(b, _)| b.len() > 1).take(5000) {
            let parts = bpe_parts(bytes, &ranks, r);
            assert_eq!(parts.len(), 2, "rank {r}");
            assert!(parts.iter().all(|p| ranks[p] < r));
        }
    }
}
