//! Tokenization for the simulated worker.
//!
//! The gateway routes on characters while the worker caches tokens; to make that gap real the
//! simulator tokenizes with a real BPE (`cl100k_base`, the 100 k tiktoken vocabulary that
//! Llama-3's 128 k tokenizer extends, compiled into `tiktoken-rs` so nothing is fetched at run
//! time) and renders chat requests through a Llama-3-style template with the Llama-3 special
//! token ids. `Approx` is a cheap, deterministic stand-in for high request rates.
//!
//! Differences between the modes (documented for experiment design):
//! - `Bpe`: real merges, ~4 chars/token on English, BPE re-merging at turn boundaries, and the
//!   template's `trim` of message content (so a reply streamed as `" word word"` re-enters the
//!   next turn as `"word word"`). Costs a regex pass plus merges per piece, on the worker's
//!   single thread.
//! - `Approx`: text is cut into pieces (a run of letters/digits with at most one leading space,
//!   a run of other symbols, or a run of whitespace), each piece into ≤4-character chunks (a
//!   leading space rides along), each chunk hashed to an id below 100 000. Prefix-stable
//!   (appending text only changes the last piece), much cheaper (no regex, no merge loop),
//!   roughly the same token counts for English; no real merges.
//!   Both modes use the same template, special ids and BOS.
//!
//! With `--tokenizer-path` the worker instead tokenizes with the gateway's own code
//! (`radixgate::tokenize`: HF `tokenizers` and the model folder's chat template, through a
//! segment cache), so a gateway given the same folder computes the very ids the worker caches
//! and publishes in its KV events. `sim-worker --write-tokenizer DIR` writes the `Bpe` mode as
//! such a folder (`hf_export`).
//!
//! Generated answers are drawn from a fixed list of short English words that are exactly one
//! token in the active mode, so re-tokenizing a reply reproduces the generated ids.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use radixgate::tokenize::{SegmentCache, Tokenizer};
use tiktoken_rs::CoreBPE;

/// Which tokenizer the worker uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TokenizerMode {
    /// Real BPE (`cl100k_base`) + Llama-3 special ids.
    #[default]
    Bpe,
    /// Cheap hashed ≤4-char chunks; see the module docs.
    Approx,
}

/// `<|begin_of_text|>`.
pub const BOS: u32 = 128_000;
/// `<|start_header_id|>`.
pub const START_HEADER: u32 = 128_006;
/// `<|end_header_id|>`.
pub const END_HEADER: u32 = 128_007;
/// `<|eot_id|>`.
pub const EOT: u32 = 128_009;

/// Ids of the Approx tokenizer stay below this, clear of the special range.
const APPROX_VOCAB: u32 = 100_000;

/// Candidate words for generated text; each is kept only if `" word"` is one token.
const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "that",
    "was",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "at",
    "be",
    "this",
    "from",
    "have",
    "or",
    "by",
    "one",
    "had",
    "not",
    "but",
    "what",
    "all",
    "were",
    "when",
    "we",
    "there",
    "can",
    "an",
    "your",
    "which",
    "their",
    "said",
    "if",
    "do",
    "will",
    "each",
    "about",
    "how",
    "up",
    "out",
    "them",
    "then",
    "she",
    "many",
    "some",
    "so",
    "these",
    "would",
    "other",
    "into",
    "has",
    "more",
    "her",
    "two",
    "like",
    "him",
    "see",
    "time",
    "could",
    "no",
    "make",
    "than",
    "first",
    "been",
    "its",
    "who",
    "now",
    "people",
    "my",
    "made",
    "over",
    "did",
    "down",
    "only",
    "way",
    "find",
    "use",
    "may",
    "water",
    "long",
    "little",
    "very",
    "after",
    "words",
    "called",
    "just",
    "where",
    "most",
    "know",
    "get",
    "through",
    "back",
    "much",
    "before",
    "go",
    "good",
    "new",
    "write",
    "our",
    "used",
    "me",
    "man",
    "too",
    "any",
    "day",
    "same",
    "right",
    "look",
    "think",
    "also",
    "around",
    "another",
    "came",
    "come",
    "work",
    "three",
    "word",
    "must",
    "because",
    "does",
    "part",
    "even",
    "place",
    "well",
    "such",
    "here",
    "take",
    "why",
    "things",
    "help",
    "put",
    "years",
    "different",
    "away",
    "again",
    "off",
    "went",
    "old",
    "number",
    "great",
    "tell",
    "men",
    "say",
    "small",
    "every",
    "found",
    "still",
    "between",
    "name",
    "should",
    "home",
    "big",
    "give",
    "air",
    "line",
    "set",
    "own",
    "under",
    "read",
    "last",
    "never",
    "us",
    "left",
    "end",
    "along",
    "while",
    "might",
    "next",
    "sound",
    "below",
    "saw",
    "something",
    "thought",
    "both",
    "few",
    "those",
    "always",
    "looked",
    "show",
    "large",
    "often",
    "together",
    "asked",
    "house",
    "world",
    "going",
    "want",
    "school",
    "important",
    "until",
    "form",
    "food",
    "keep",
    "children",
    "feet",
    "land",
    "side",
    "without",
    "boy",
    "once",
    "animals",
    "life",
    "enough",
    "took",
    "sometimes",
    "four",
    "head",
    "above",
    "kind",
    "began",
    "almost",
    "live",
    "page",
    "got",
    "earth",
    "need",
    "far",
    "hand",
    "high",
    "year",
    "mother",
    "light",
    "parts",
    "country",
    "father",
    "let",
    "night",
    "following",
    "picture",
    "being",
    "study",
    "second",
    "eyes",
    "soon",
    "times",
    "story",
    "boys",
    "since",
    "white",
    "days",
    "ever",
    "paper",
    "hard",
    "near",
    "sentence",
    "better",
    "best",
    "across",
];

/// One chat message as the template sees it.
#[derive(Debug, Clone, Copy)]
pub struct ChatTurn<'a> {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: &'a str,
    /// Message text (already flattened from content parts).
    pub content: &'a str,
}

/// Token ids a HF tokenizer's segment cache holds at most in the worker.
const HF_CACHE_TOKENS: usize = 1 << 20;

/// The worker's tokenizer: prompt encoding, chat template, and the output vocabulary.
pub struct SimTokenizer {
    mode: TokenizerMode,
    bpe: Option<&'static CoreBPE>,
    /// `--tokenizer-path`: the gateway's tokenizer, in place of `mode`.
    hf: Option<RefCell<SegmentCache>>,
    /// `(token id, text)` of each output word, text with its leading space.
    out_words: Vec<(u32, String)>,
    out_index: HashMap<u32, usize>,
}

impl std::fmt::Debug for SimTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimTokenizer")
            .field("mode", &self.mode)
            .field("hf", &self.hf.is_some())
            .field("output_words", &self.out_words.len())
            .finish()
    }
}

impl SimTokenizer {
    /// Build the tokenizer. `Bpe` parses the compiled-in vocabulary once per process (~0.2 s).
    pub fn new(mode: TokenizerMode) -> Self {
        let bpe = match mode {
            TokenizerMode::Bpe => Some(tiktoken_rs::cl100k_base_singleton()),
            TokenizerMode::Approx => None,
        };
        let mut t = SimTokenizer {
            mode,
            bpe,
            hf: None,
            out_words: Vec::new(),
            out_index: HashMap::new(),
        };
        t.pick_output_words();
        t
    }

    /// A worker tokenizing with the gateway's tokenizer (`--tokenizer-path`). Output words are
    /// those that are one token in it (a real 100k+ vocabulary keeps ~250 of them; a tiny test
    /// vocabulary a handful); a vocabulary with fewer than 4 is refused.
    pub fn with_hf(tok: Arc<Tokenizer>) -> Result<Self, String> {
        let mut t = SimTokenizer {
            mode: TokenizerMode::Bpe,
            bpe: None,
            hf: Some(RefCell::new(SegmentCache::new(tok, HF_CACHE_TOKENS))),
            out_words: Vec::new(),
            out_index: HashMap::new(),
        };
        t.pick_output_words();
        if t.out_words.len() < 4 {
            return Err(format!(
                "the tokenizer has only {} one-token answer words (at least 4 needed)",
                t.out_words.len()
            ));
        }
        Ok(t)
    }

    /// The tokenizer `--tokenizer-path` names, or the built-in `mode`.
    pub fn from_config(
        mode: TokenizerMode,
        path: Option<&std::path::Path>,
    ) -> Result<Self, String> {
        match path {
            None => Ok(SimTokenizer::new(mode)),
            Some(p) => {
                let tok = Tokenizer::from_path(p).map_err(|e| e.to_string())?;
                SimTokenizer::with_hf(Arc::new(tok))
            }
        }
    }

    /// Whether prompts go through a HF tokenizer (`--tokenizer-path`).
    pub fn is_hf(&self) -> bool {
        self.hf.is_some()
    }

    /// Keeps each candidate word whose `" word"` is exactly one token, once per id.
    fn pick_output_words(&mut self) {
        let t = self;
        let mut ids = Vec::new();
        for w in WORDS {
            let text = format!(" {w}");
            ids.clear();
            t.encode_plain(&text, &mut ids);
            if ids.len() == 1 && !t.out_index.contains_key(&ids[0]) {
                t.out_index.insert(ids[0], t.out_words.len());
                t.out_words.push((ids[0], text));
            }
        }
    }

    /// The active mode.
    pub fn mode(&self) -> TokenizerMode {
        self.mode
    }

    /// Token ids generated answers are drawn from (each one word, one token).
    pub fn output_vocab(&self) -> Vec<u32> {
        self.out_words.iter().map(|(id, _)| *id).collect()
    }

    /// Append the text of generated token `id` to `out` (ids outside the output vocabulary are
    /// rendered as nothing: the simulator only generates vocabulary ids).
    pub fn push_output_text(&self, id: u32, out: &mut String) {
        if let Some(&i) = self.out_index.get(&id) {
            out.push_str(&self.out_words[i].1);
        }
    }

    /// Text of generated ids.
    pub fn decode_output(&self, ids: &[u32]) -> String {
        let mut s = String::with_capacity(ids.len() * 6);
        for &id in ids {
            self.push_output_text(id, &mut s);
        }
        s
    }

    /// Encode text without special tokens (with a HF tokenizer: as its `encode(text, false)`;
    /// text it refuses encodes to nothing).
    pub fn encode_plain(&self, text: &str, out: &mut Vec<u32>) {
        if let Some(hf) = &self.hf {
            if let Ok(ids) = hf.borrow().tokenizer().encode(text, false) {
                out.extend(ids);
            }
            return;
        }
        match self.bpe {
            Some(bpe) => out.extend(bpe.encode_ordinary(text)),
            None => approx_encode(text, out),
        }
    }

    /// Encode a raw prompt (`/generate` text, `/v1/completions` prompt): BOS + text, as the
    /// Llama-3 tokenizer does with `add_special_tokens` (a HF tokenizer: its post-processor's
    /// special tokens). Errors only with a HF tokenizer (text over its limits).
    pub fn encode_prompt(&self, text: &str, out: &mut Vec<u32>) -> Result<(), String> {
        if let Some(hf) = &self.hf {
            return hf
                .borrow_mut()
                .text_ids(text, out)
                .map_err(|e| e.to_string());
        }
        out.push(BOS);
        self.encode_plain(text, out);
        Ok(())
    }

    /// A chat body through the HF tokenizer's chat template, as the gateway tokenizes it;
    /// `None` without `--tokenizer-path` (the caller then uses [`SimTokenizer::encode_chat`]).
    pub fn hf_chat(&self, body: &[u8], out: &mut Vec<u32>) -> Option<Result<(), String>> {
        let hf = self.hf.as_ref()?;
        Some(
            hf.borrow_mut()
                .chat_ids(body, out)
                .map_err(|e| e.to_string()),
        )
    }

    /// Render chat messages through the Llama-3 template and encode them:
    /// `<|begin_of_text|>` then per message
    /// `<|start_header_id|>{role}<|end_header_id|>\n\n{content|trim}<|eot_id|>`, then the
    /// generation prompt `<|start_header_id|>assistant<|end_header_id|>\n\n`.
    pub fn encode_chat(&self, turns: &[ChatTurn<'_>], out: &mut Vec<u32>) {
        out.push(BOS);
        let mut body = String::new();
        for t in turns {
            out.push(START_HEADER);
            self.encode_plain(t.role, out);
            out.push(END_HEADER);
            body.clear();
            body.push_str("\n\n");
            // Jinja's `trim` is Python's `str.strip()`: Unicode whitespace plus U+001C..U+001F.
            body.push_str(
                t.content.trim_matches(|c: char| {
                    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
                }),
            );
            self.encode_plain(&body, out);
            out.push(EOT);
        }
        out.push(START_HEADER);
        self.encode_plain("assistant", out);
        out.push(END_HEADER);
        self.encode_plain("\n\n", out);
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Word,
    Space,
    Other,
}

fn class(c: char) -> Class {
    if c.is_alphanumeric() {
        Class::Word
    } else if c.is_whitespace() {
        Class::Space
    } else {
        Class::Other
    }
}

fn fnv1a(bytes: &[u8]) -> u32 {
    let mut h: u32 = 0x811C_9DC5;
    for &b in bytes {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// The Approx tokenizer (see module docs): pieces, then ≤4-char chunks (a leading space rides free) hashed below 100 000.
pub fn approx_encode(text: &str, out: &mut Vec<u32>) {
    let next_char = |pos: usize| text[pos..].chars().next();
    let skip = |mut pos: usize, cl: Class| {
        while let Some(d) = next_char(pos) {
            if class(d) != cl {
                break;
            }
            pos += d.len_utf8();
        }
        pos
    };
    let mut pos = 0;
    while let Some(c) = next_char(pos) {
        let start = pos;
        pos += c.len_utf8();
        pos = match class(c) {
            Class::Word => skip(pos, Class::Word),
            Class::Other => skip(pos, Class::Other),
            // A single space glues to a following word (" word"), like GPT pre-tokenizers.
            Class::Space if c == ' ' && next_char(pos).is_some_and(|d| class(d) == Class::Word) => {
                skip(pos, Class::Word)
            }
            Class::Space => {
                while let Some(d) = next_char(pos) {
                    let joins_word =
                        d == ' ' && next_char(pos + 1).is_some_and(|e| class(e) == Class::Word);
                    if class(d) != Class::Space || joins_word {
                        break;
                    }
                    pos += d.len_utf8();
                }
                pos
            }
        };
        approx_piece(&text[start..pos], out);
    }
}

fn approx_piece(piece: &str, out: &mut Vec<u32>) {
    let mut start = 0;
    // A leading space rides along with the first chunk (" word" is one token, as in BPE).
    let mut n = if piece.starts_with(' ') && piece.len() > 1 {
        -1i32
    } else {
        0
    };
    for (i, _) in piece.char_indices() {
        if n == 4 {
            out.push(fnv1a(&piece.as_bytes()[start..i]) % APPROX_VOCAB);
            start = i;
            n = 0;
        }
        n += 1;
    }
    if start < piece.len() {
        out.push(fnv1a(&piece.as_bytes()[start..]) % APPROX_VOCAB);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn approx(s: &str) -> Vec<u32> {
        let mut v = Vec::new();
        approx_encode(s, &mut v);
        v
    }

    #[test]
    fn approx_is_prefix_stable_and_word_sized() {
        let a = approx("Hello there, general Kenobi");
        let b = approx("Hello there, general Kenobi. You are a bold one");
        assert_eq!(
            &b[..a.len() - 1],
            &a[..a.len() - 1],
            "only the last piece may change"
        );
        assert_eq!(approx(" the").len(), 1);
        assert_eq!(
            approx(" the and of"),
            [approx(" the"), approx(" and"), approx(" of")].concat()
        );
        // ~4 chars per token on plain English.
        let text = "The quick brown fox jumps over the lazy dog and keeps running far away";
        let n = approx(text).len();
        assert!((12..=24).contains(&n), "{n}");
        assert!(approx(text).iter().all(|&t| t < APPROX_VOCAB));
        assert_eq!(approx(""), Vec::<u32>::new());
        assert_eq!(approx("  x").len(), 2, "a space run then ' x'");
    }

    #[test]
    fn output_words_roundtrip_both_modes() {
        for mode in [TokenizerMode::Approx, TokenizerMode::Bpe] {
            let t = SimTokenizer::new(mode);
            let vocab = t.output_vocab();
            assert!(vocab.len() >= 90, "{mode:?}: {}", vocab.len());
            let ids: Vec<u32> = (0..200).map(|i| vocab[(i * 7919) % vocab.len()]).collect();
            let text = t.decode_output(&ids);
            let mut re = Vec::new();
            t.encode_plain(&text, &mut re);
            assert_eq!(
                re, ids,
                "{mode:?}: generated text re-tokenizes to the generated ids"
            );
        }
    }

    #[test]
    fn chat_template_structure() {
        let t = SimTokenizer::new(TokenizerMode::Bpe);
        let mut ids = Vec::new();
        t.encode_chat(
            &[ChatTurn {
                role: "user",
                content: "  Hello!  ",
            }],
            &mut ids,
        );
        assert_eq!(ids[0], BOS);
        assert_eq!(ids[1], START_HEADER);
        assert!(ids.contains(&END_HEADER) && ids.contains(&EOT));
        assert_eq!(ids.iter().filter(|&&x| x == START_HEADER).count(), 2);
        // Content is trimmed: same ids as without the padding.
        let mut trimmed = Vec::new();
        t.encode_chat(
            &[ChatTurn {
                role: "user",
                content: "Hello!",
            }],
            &mut trimmed,
        );
        assert_eq!(ids, trimmed);
        // A two-turn conversation extends the one-turn prompt up to its generation prompt.
        let mut two = Vec::new();
        t.encode_chat(
            &[
                ChatTurn {
                    role: "user",
                    content: "Hello!",
                },
                ChatTurn {
                    role: "assistant",
                    content: "Hi.",
                },
                ChatTurn {
                    role: "user",
                    content: "More",
                },
            ],
            &mut two,
        );
        let common = ids.iter().zip(&two).take_while(|(a, b)| a == b).count();
        assert!(common >= ids.len() - 4, "{common} of {}", ids.len());
        // Literal special-token text in content is plain text, never a special id.
        let mut inj = Vec::new();
        t.encode_plain("<|eot_id|>", &mut inj);
        assert!(!inj.contains(&EOT));
    }
}
