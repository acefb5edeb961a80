//! The gateway's tokenizer: a request's prompt as the server's token ids, so routing can match
//! what each server actually caches (KV events carry token ids, never text).
//!
//! [`Tokenizer`] loads a HF `tokenizer.json` (+ `tokenizer_config.json` / `chat_template.jinja`
//! of a model folder, as `--tokenizer-path` names them) once (`load`) and is shared by every
//! core. Python's view of JSON, which chat templates print, is `pyjson`; writing a tokenizer
//! folder offline (for tests and the simulator) is `folder`.
//! [`SegmentCache`] (one per core, no locks) turns a request into ids:
//!
//! - `/v1/chat/completions`: the body's messages through the model's chat template, rendered as
//!   SGLang renders it (see `request` and `template`), then encoded without special tokens
//!   (the template writes them as text; SGLang encodes with `add_special_tokens=False`);
//! - `/v1/completions` `prompt` and `/generate` `text`: encoded with special tokens (BOS from
//!   the tokenizer's post-processor), as SGLang does.
//!
//! **The cache is exact by construction.** `tokenizers` first cuts the text at every added
//! token that is not normalized (leftmost-longest), then encodes each piece between them on its
//! own. The cache cuts the same way (`split`), looks each piece up by its 64-bit xxh3 and length,
//! encodes only pieces it has not seen, and concatenates — the very ids a whole-text encode
//! gives. Chat templates put special tokens between messages, so turn k+1 of a conversation
//! encodes only its new messages; and since turn k+1's text starts with turn k's, the ids of
//! the longest prefix a recent text provably cuts alike are copied from it (`memo`), so the
//! history is not even searched or looked up again. A tokenizer whose cut this module cannot reproduce (an added
//! token with `single_word`, a `Metaspace` pre-tokenizer that prepends only to the first piece,
//! BPE dropout) is encoded whole, uncached, with the same results.
//!
//! **Bounded.** A chat body over [`Limits::max_body_bytes`], a rendered prompt or text over
//! [`Limits::max_text_bytes`], or a run of more than [`Limits::max_word_bytes`] bytes without
//! whitespace is refused with [`TokenizeError::TooLarge`] before any encoding; the template runs
//! on a fuel budget ([`Limits::template_fuel`]). The cache holds at most its configured number
//! of token ids, and its memo 16 texts of at most 128 KiB with their ids. Every refusal is a [`TokenizeError`], which sends the caller back to the text
//! tree; nothing here panics on request input.

pub mod folder;
mod load;
mod memo;
mod pyjson;
mod request;
mod split;
mod template;

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use minijinja::value::Value;
use serde_json::Value as JsonValue;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use memo::TextMemo;
use split::{Piece, Resume, Splitter};
use template::ChatTemplate;

/// Size and time bounds of one tokenization. Measured cost of `tokenizers` with a 100k
/// byte-level BPE vocabulary (the cl100k folder, `benches/tokenize.rs`, one core of a shared,
/// loaded 2-core VM): 0.35–0.5 ms per KiB of prose, 0.25–0.75 ms per KiB for runs of one letter,
/// digits, whitespace, punctuation or CJK, and the worst, random bytes, 0.8–1.8 ms per KiB;
/// linear in the length (a 64 KiB run of one letter costs 4–5× a 16 KiB one). The defaults
/// bound one request to about a second of a core in the worst case, ~0.2 s for prose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest `/v1/chat/completions` body parsed (bytes). Default 4 MiB.
    pub max_body_bytes: usize,
    /// Largest text encoded: a rendered chat prompt, a completions prompt (bytes). Default
    /// 512 KiB (≈ 130k tokens of English, a 128k context window; longer prompts are routed by
    /// the text tree).
    pub max_text_bytes: usize,
    /// Longest run without whitespace encoded (bytes). A pre-tokenizer may keep such a run as
    /// one word, and BPE merges one word in O(n log n); measured linear up to 64 KiB, prose never
    /// comes close. Default 64 KiB.
    pub max_word_bytes: usize,
    /// Instructions one chat-template render may execute (minijinja fuel). Default 20 million
    /// (a 20-message Llama-3 chat renders within 100 thousand; see the tests).
    pub template_fuel: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_body_bytes: 4 << 20,
            max_text_bytes: 512 << 10,
            max_word_bytes: 64 << 10,
            template_fuel: 20_000_000,
        }
    }
}

/// Why a tokenizer could not be loaded (start-up errors, shown to the operator).
#[derive(Debug)]
pub enum LoadError {
    /// A file could not be read.
    Io(PathBuf, std::io::Error),
    /// The folder has no `tokenizer.json`.
    NoTokenizerJson(PathBuf),
    /// `tokenizer.json` is not a tokenizer `tokenizers` can load.
    Tokenizer(String),
    /// `tokenizer_config.json` is not valid.
    Config(String),
    /// The chat template does not compile.
    Template(String),
}

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoadError::Io(p, e) => write!(f, "cannot read {}: {e}", p.display()),
            LoadError::NoTokenizerJson(p) => {
                write!(f, "{} holds no tokenizer.json", p.display())
            }
            LoadError::Tokenizer(e) => write!(f, "tokenizer.json: {e}"),
            LoadError::Config(e) => write!(f, "tokenizer_config.json: {e}"),
            LoadError::Template(e) => write!(f, "chat template: {e}"),
        }
    }
}

impl std::error::Error for LoadError {}

/// Why a request was not tokenized; the caller routes it by the text tree instead. Messages
/// are short and say why (they end up in logs, never in a client's answer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizeError {
    /// Over a [`Limits`] bound: body, rendered text, or a run without whitespace.
    TooLarge,
    /// A chat request, but the tokenizer has no chat template.
    NoChatTemplate,
    /// The template refused the request (`raise_exception`) or failed while rendering.
    Template(String),
    /// The body is not a chat request SGLang would accept (bad JSON, no messages, …).
    BadRequest(String),
    /// `tokenizers` failed on the text.
    Encode(String),
    /// The time budget set with [`SegmentCache::set_deadline`] passed before the prompt was
    /// encoded (what was encoded so far stays cached).
    TooSlow,
}

impl TokenizeError {
    /// A fixed label per kind, for a metric.
    pub fn kind(&self) -> &'static str {
        match self {
            TokenizeError::TooLarge => "too_large",
            TokenizeError::NoChatTemplate => "no_chat_template",
            TokenizeError::Template(_) => "template",
            TokenizeError::BadRequest(_) => "bad_request",
            TokenizeError::Encode(_) => "encode",
            TokenizeError::TooSlow => "too_slow",
        }
    }
}

impl std::fmt::Display for TokenizeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenizeError::TooLarge => f.write_str("prompt over the tokenizer's size limits"),
            TokenizeError::NoChatTemplate => f.write_str("the tokenizer has no chat template"),
            TokenizeError::Template(e) => write!(f, "chat template: {e}"),
            TokenizeError::BadRequest(e) => write!(f, "not a chat request: {e}"),
            TokenizeError::Encode(e) => write!(f, "encoding failed: {e}"),
            TokenizeError::TooSlow => f.write_str("prompt not encoded within its time budget"),
        }
    }
}

impl std::error::Error for TokenizeError {}

/// A loaded tokenizer and chat template: immutable, `Send + Sync`, loaded once and shared by
/// every core as an `Arc`.
pub struct Tokenizer {
    hf: tokenizers::Tokenizer,
    /// The added-token cut, when it reproduces `tokenizers`' exactly (else: whole-text encodes).
    splitter: Option<Splitter>,
    /// A piece may also be cut into words at every ASCII letter, space, ASCII letter (see
    /// [`word_cuts`]): the pre-tokenizer is one this module knows never joins across that point.
    word_cut: bool,
    /// Ids the post-processor puts before / after a single sequence (`add_special_tokens`),
    /// when it only adds fixed ids around it.
    affixes: Option<(Vec<u32>, Vec<u32>)>,
    template: Option<ChatTemplate>,
    /// The template iterates over content parts (SGLang's "openai" content format).
    content_parts: bool,
    /// `bos_token`, `eos_token`, … as the template sees them.
    special_vars: Vec<(String, String)>,
    /// The id of `bos_token` (SGLang drops it from the front of a continued final message).
    bos_id: Option<u32>,
    limits: Limits,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("segment_cacheable", &self.splitter.is_some())
            .field("word_cacheable", &self.word_cut)
            .field("chat_template", &self.template.is_some())
            .field("limits", &self.limits)
            .finish()
    }
}

/// Whether the post-processor only puts fixed ids around a single sequence.
fn affix_only(v: &JsonValue) -> bool {
    match v.get("type").and_then(JsonValue::as_str) {
        Some("TemplateProcessing" | "BertProcessing" | "RobertaProcessing" | "ByteLevel") => true,
        Some("Sequence") => v
            .get("processors")
            .and_then(JsonValue::as_array)
            .is_some_and(|ps| ps.iter().all(affix_only)),
        _ => false,
    }
}

/// One call into `tokenizers`, its error or panic (a malformed vocabulary can panic inside it)
/// turned into a [`TokenizeError`]: request input never unwinds through a serving core.
fn guarded(
    encode: impl FnOnce() -> tokenizers::Result<tokenizers::Encoding>,
) -> Result<tokenizers::Encoding, TokenizeError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(encode)) {
        Ok(Ok(enc)) => Ok(enc),
        Ok(Err(e)) => Err(TokenizeError::Encode(e.to_string())),
        Err(_) => Err(TokenizeError::Encode("tokenizer panicked".into())),
    }
}

/// Pre-tokenizer regexes under which a pre-token never runs from an ASCII letter into a
/// following space: every alternative that can match a letter ends with a run of letters (or a
/// contraction such as `'ll`), none contains a letter followed by whitespace, and none looks
/// behind. So "letter | space letter" is always a pre-token boundary, and the text after it is
/// matched the same whether the encoder saw what came before or not. Llama-3's (= cl100k's
/// classic spelling), tiktoken's cl100k with possessive quantifiers (the simulator's), and
/// Qwen2's (one digit per number pre-token).
const WORD_CUT_PATTERNS: [&str; 3] = [
    folder::LLAMA3_PATTERN,
    r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];

/// Whether `tokenizer.json` (`raw`) encodes a piece cut at [`word_cuts`] into the same ids as
/// the whole piece: no normalizer or NFC (which composes only within a character and its marks,
/// never across an ASCII space), and a pre-tokenizer that is GPT-2's `ByteLevel` regex or a
/// `Split` on a [`WORD_CUT_PATTERNS`] regex followed by a plain `ByteLevel`, neither adding a
/// prefix space (which would be added to every word).
fn word_cut_safe(raw: &JsonValue) -> bool {
    let flag = |v: &JsonValue, name: &str| v.get(name).and_then(JsonValue::as_bool);
    let kind = |v: &JsonValue| {
        v.get("type")
            .and_then(JsonValue::as_str)
            .map(str::to_string)
    };
    let normalizer_ok = match raw.get("normalizer") {
        None | Some(JsonValue::Null) => true,
        Some(n) => kind(n).as_deref() == Some("NFC"),
    };
    let byte_level = |v: &JsonValue, use_regex: bool| {
        kind(v).as_deref() == Some("ByteLevel")
            && flag(v, "add_prefix_space") == Some(false)
            && flag(v, "use_regex").unwrap_or(true) == use_regex
    };
    let known_split = |v: &JsonValue| {
        kind(v).as_deref() == Some("Split")
            && v.get("behavior").and_then(JsonValue::as_str) == Some("Isolated")
            && flag(v, "invert") == Some(false)
            && v.get("pattern")
                .and_then(|p| p.get("Regex"))
                .and_then(JsonValue::as_str)
                .is_some_and(|r| WORD_CUT_PATTERNS.contains(&r))
    };
    let pre = raw.get("pre_tokenizer").unwrap_or(&JsonValue::Null);
    let pre_ok = byte_level(pre, true)
        || (kind(pre).as_deref() == Some("Sequence")
            && pre
                .get("pretokenizers")
                .and_then(JsonValue::as_array)
                .is_some_and(|ps| {
                    ps.len() == 2 && known_split(&ps[0]) && byte_level(&ps[1], false)
                }));
    normalizer_ok && pre_ok
}

/// The word cuts of `text`: every byte offset `k` with an ASCII letter before it, a space at it
/// and an ASCII letter after it (so the words are "Hello", " world,", " how"…). Under a
/// [`word_cut_safe`] tokenizer each word encodes alone to exactly its share of the whole
/// text's ids, so words can be cached across requests: a new message of everyday words is
/// mostly cache hits.
fn word_cuts(text: &[u8], mut cut: impl FnMut(usize)) {
    if text.len() < 3 {
        return;
    }
    for k in 1..text.len() - 1 {
        if text[k] == b' ' && text[k - 1].is_ascii_alphabetic() && text[k + 1].is_ascii_alphabetic()
        {
            cut(k);
        }
    }
}

impl Tokenizer {
    /// Loads `path`: a `tokenizer.json` file, or a model folder holding one. The chat template
    /// and special tokens come from the same folder: `chat_template.jinja` if present, else
    /// `tokenizer_config.json`'s `chat_template` (a string, or a list of `{name, template}` of
    /// which `default` is used); `bos_token` / `eos_token` / … from `tokenizer_config.json`
    /// (strings or `{"content": …}`), else `special_tokens_map.json`.
    pub fn from_path(path: &Path) -> Result<Tokenizer, LoadError> {
        Tokenizer::from_path_with(path, Limits::default())
    }

    /// [`Tokenizer::from_path`] with other bounds.
    pub fn from_path_with(path: &Path, limits: Limits) -> Result<Tokenizer, LoadError> {
        let (file, dir) = load::locate(path)?;
        let (raw, hf) = load::hf_tokenizer(&file)?;
        let config = load::json_file(&dir.join("tokenizer_config.json"))?;
        let template_src = load::template_source(&dir, &config)?;
        let template = template_src
            .as_deref()
            .map(|s| ChatTemplate::new(s, limits.template_fuel, limits.max_text_bytes))
            .transpose()
            .map_err(LoadError::Template)?;
        let content_parts = template_src
            .as_deref()
            .is_some_and(request::wants_content_parts);
        let special_vars = load::special_vars(&dir, &config);
        let (splitter, normalized_added) = load::added_token_cut(&hf, &raw)?;
        let word_cut = splitter.is_some() && !normalized_added && word_cut_safe(&raw);
        let bos_id = special_vars
            .iter()
            .find(|(k, _)| k == "bos_token")
            .and_then(|(_, v)| hf.token_to_id(v));
        let mut tok = Tokenizer {
            hf,
            splitter,
            word_cut,
            affixes: None,
            template,
            content_parts,
            special_vars,
            bos_id,
            limits,
        };
        if raw
            .get("post_processor")
            .is_none_or(|p| p.is_null() || affix_only(p))
        {
            tok.affixes = tok.probe_affixes();
        }
        if tok.word_cut && !tok.word_cut_agrees() {
            tok.word_cut = false;
        }
        Ok(tok)
    }

    /// The ids the post-processor adds before and after a single sequence, found by encoding
    /// probes with and without special tokens; `None` unless every probe agrees.
    fn probe_affixes(&self) -> Option<(Vec<u32>, Vec<u32>)> {
        let mut found: Option<(Vec<u32>, Vec<u32>)> = None;
        for probe in ["a", "Hello world, 123!", " x\n\ny "] {
            let with = self.hf.encode_fast(probe, true).ok()?.get_ids().to_vec();
            let without = self.hf.encode_fast(probe, false).ok()?.get_ids().to_vec();
            let extra = with.len().checked_sub(without.len())?;
            let mut this = None;
            for k in 0..=extra {
                if with[k..k + without.len()] == without[..] {
                    this = Some((with[..k].to_vec(), with[k + without.len()..].to_vec()));
                    break;
                }
            }
            let this = this?;
            match &found {
                None => found = Some(this),
                Some(f) if *f == this => {}
                Some(_) => return None,
            }
        }
        found
    }

    /// A start-up check of the word cut's premise on texts that exercise its edges
    /// (contractions, numbers, punctuation, runs of spaces, newlines, non-ASCII): each encoded
    /// whole and word by word must give the same ids, or words are not cached.
    fn word_cut_agrees(&self) -> bool {
        const PROBES: [&str; 6] = [
            "Hello world, it's a test: we'll see 12345 apples and 7 pears!",
            "a  b   c\n\nd \te f\r\ng h ",
            "don't STOP'S believing x'y z",
            "caf\u{e9} na\u{ef}ve r\u{e9}sum\u{e9} \u{4e2d}\u{6587} a b",
            "end with space a ",
            "x=1; y = foo(bar) // ok then",
        ];
        PROBES.iter().all(|p| {
            let mut cuts = vec![0];
            word_cuts(p.as_bytes(), |k| cuts.push(k));
            cuts.push(p.len());
            let words: Result<Vec<Vec<u32>>, _> = cuts
                .windows(2)
                .map(|w| self.encode_raw(&p[w[0]..w[1]], false))
                .collect();
            match (self.encode_raw(p, false), words) {
                (Ok(whole), Ok(words)) => words.concat() == whole,
                _ => false,
            }
        })
    }

    /// Whether [`SegmentCache`] also caches words of the pieces it has not seen.
    pub fn is_word_cacheable(&self) -> bool {
        self.word_cut
    }

    /// `encode_raw` without special tokens, keeping each token's byte range in `text`
    /// (`get_offsets`).
    fn encode_with_offsets(&self, text: &str) -> Result<tokenizers::Encoding, TokenizeError> {
        guarded(|| self.hf.encode(text, false))
    }

    /// Whether a chat template was found; without one, chat requests get
    /// [`TokenizeError::NoChatTemplate`].
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Whether [`SegmentCache`] caches per piece (else it encodes whole texts, uncached).
    pub fn is_segment_cacheable(&self) -> bool {
        self.splitter.is_some()
    }

    /// The bounds this tokenizer enforces.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// The id of a token's text (`"<|eot_id|>"` → 128009), model or added vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.hf.token_to_id(token)
    }

    /// Text of `ids` (special tokens kept), for tests and the simulator's answers.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        self.hf
            .decode(ids, false)
            .map_err(|e| TokenizeError::Encode(e.to_string()))
    }

    /// The reference path: `tokenizers`' own encode of the whole text, uncached, with the same
    /// bounds. `add_special_tokens` as in HF (BOS for Llama-style post-processors).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        self.check_text(text)?;
        self.encode_raw(text, add_special_tokens)
    }

    fn encode_raw(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        let enc = guarded(|| self.hf.encode_fast(text, add_special_tokens))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Size checks before any encoding: total bytes, and the longest run without whitespace.
    fn check_text(&self, text: &str) -> Result<(), TokenizeError> {
        if text.len() > self.limits.max_text_bytes {
            return Err(TokenizeError::TooLarge);
        }
        self.check_words(text)
    }

    /// The longest run without whitespace in what one encoder call gets.
    fn check_words(&self, text: &str) -> Result<(), TokenizeError> {
        if text.len() > self.limits.max_word_bytes {
            let mut run = 0usize;
            for c in text.chars() {
                if c.is_whitespace() {
                    run = 0;
                } else {
                    run += c.len_utf8();
                    if run > self.limits.max_word_bytes {
                        return Err(TokenizeError::TooLarge);
                    }
                }
            }
        }
        Ok(())
    }

    /// The text a chat body renders to: the template's output, then the continued final
    /// message if the request asks for one (`continue_final_message`).
    pub fn render_chat(&self, body: &[u8]) -> Result<String, TokenizeError> {
        self.render_chat_split(body).map(|(text, _)| text)
    }

    /// [`Tokenizer::render_chat`], and where in the text the continued final message starts
    /// (the text's length when there is none): SGLang encodes the two parts apart.
    fn render_chat_split(&self, body: &[u8]) -> Result<(String, usize), TokenizeError> {
        if body.len() > self.limits.max_body_bytes {
            return Err(TokenizeError::TooLarge);
        }
        let template = self
            .template
            .as_ref()
            .ok_or(TokenizeError::NoChatTemplate)?;
        let input = request::chat_input(body, self.content_parts)?;
        let ctx = Value::from_pairs(
            self.special_vars
                .iter()
                .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
                .chain(input.vars),
        );
        let rendered =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| template.render(ctx)))
                .map_err(|_| TokenizeError::Template("template engine panicked".into()))?
                .map_err(|e| match e {
                    template::RenderError::TooLarge => TokenizeError::TooLarge,
                    template::RenderError::Failed(m) => TokenizeError::Template(m),
                })?;
        let mut text = rendered;
        let split = text.len();
        if let Some(s) = input.suffix {
            text.push_str(&s);
        }
        if text.len() > self.limits.max_text_bytes {
            return Err(TokenizeError::TooLarge);
        }
        Ok((text, split))
    }
}

/// Counters of one [`SegmentCache`], for metrics and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Pieces found in the cache.
    pub hits: u64,
    /// Pieces encoded (each one call into the encoder).
    pub misses: u64,
    /// Token ids held now.
    pub cached_tokens: usize,
    /// Pieces held now.
    pub entries: usize,
    /// Pieces evicted so far.
    pub evicted: u64,
    /// Texts encoded whole because the tokenizer's cut is not reproducible.
    pub whole_encodes: u64,
    /// Words of unseen pieces found in the word cache.
    pub word_hits: u64,
    /// Words of unseen pieces encoded (runs of consecutive ones in one encoder call).
    pub word_misses: u64,
    /// Words held now.
    pub word_entries: usize,
    /// Bytes of texts whose ids came from a recent text's (not split, not looked up).
    pub memo_bytes: u64,
}

/// Cache key: 64-bit xxh3 of a piece (or word), seeded per process, and its length. The seed
/// keeps clients from choosing texts whose keys fall into one bucket of the maps (the key is
/// the map's hash as it is).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    hash: u64,
    len: u32,
}

/// This process's key seed (from the kernel, once).
fn key_seed() -> u64 {
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SEED.get_or_init(|| {
        let mut e = crate::base::entropy::Entropy::default();
        (0..8).fold(0u64, |s, _| s << 8 | u64::from(e.byte()))
    })
}

impl Key {
    fn of(text: &str) -> Key {
        Key {
            hash: xxh3_64_with_seed(text.as_bytes(), key_seed()),
            len: text.len() as u32,
        }
    }
}

/// The key is already a hash: feed it through unchanged.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 ^= n;
    }
    fn write_u32(&mut self, n: u32) {
        self.0 ^= u64::from(n).rotate_left(32);
    }
}

struct Entry {
    ids: Box<[u32]>,
    /// Used since the clock hand last passed it (its second chance).
    used: bool,
}

impl Entry {
    /// What the entry counts against its cache's bound: its ids, and at least one (a piece
    /// that encodes to no id still takes a slot, so a flood of them is bounded too).
    fn weight(&self) -> usize {
        self.ids.len().max(1)
    }
}

/// Text → ids, keyed by [`Key`] (pieces, and words), evicted by CLOCK (second chance): the
/// keys in insertion order form the clock; the hand evicts the first entry not used since it
/// last passed. Every step is O(1) and each insert moves the hand a bounded number of steps,
/// so no request pays for a sort of the whole map (an LRU approximation, as kernels' page
/// caches use).
#[derive(Default)]
struct IdCache {
    map: HashMap<Key, Entry, BuildHasherDefault<KeyHasher>>,
    clock: std::collections::VecDeque<Key>,
    /// Sum of the entries' weights.
    weight: usize,
}

/// Second chances one eviction step may give before it evicts regardless (a bound on a step).
const SECOND_CHANCES: usize = 64;

impl IdCache {
    fn get(&mut self, key: &Key) -> Option<&[u32]> {
        let e = self.map.get_mut(key)?;
        e.used = true;
        Some(&e.ids)
    }

    fn contains(&self, key: &Key) -> bool {
        self.map.contains_key(key)
    }

    fn insert(&mut self, key: Key, ids: Box<[u32]>) {
        let e = Entry { ids, used: false };
        self.weight += e.weight();
        if let Some(old) = self.map.insert(key, e) {
            self.weight -= old.weight();
        } else {
            self.clock.push_back(key);
        }
    }

    /// Evicts until the weight is at most `target`; returns the entries evicted.
    fn shrink_to(&mut self, target: usize) -> u64 {
        let mut evicted = 0;
        let mut chances = 0;
        while self.weight > target {
            let Some(key) = self.clock.pop_front() else {
                break;
            };
            let Some(e) = self.map.get_mut(&key) else {
                continue;
            };
            if e.used && chances < SECOND_CHANCES {
                e.used = false;
                chances += 1;
                self.clock.push_back(key);
                continue;
            }
            if let Some(e) = self.map.remove(&key) {
                self.weight -= e.weight();
                evicted += 1;
            }
        }
        evicted
    }

    fn len(&self) -> usize {
        self.map.len()
    }
}

/// A core's piece → ids cache in front of a shared [`Tokenizer`]. Bounded by the number of
/// token ids it holds: past the bound, the least recently used pieces go until it is at three
/// quarters (one sort per eviction round, so the cost per insert stays constant). Pieces larger
/// than an eighth of the bound are encoded but not kept. Not `Sync`: one per core.
pub struct SegmentCache {
    tok: Arc<Tokenizer>,
    map: IdCache,
    max_tokens: usize,
    /// Words of pieces that missed (see [`word_cuts`]), at most [`MAX_WORDS`] weight.
    words: IdCache,
    /// Word cuts of the piece being encoded, and each word's key (scratch).
    cuts: Vec<usize>,
    keys: Vec<Key>,
    /// Recent texts with their ids (see `memo`), and the cuts of the text being encoded.
    memo: TextMemo,
    text_cuts: Vec<(Resume, u32)>,
    stats: CacheStats,
    /// When the prompt being encoded must be given up (see [`SegmentCache::set_deadline`]).
    deadline: Option<std::time::Instant>,
}

/// Most bytes of unseen words encoded in one call: the deadline is looked at between calls, so
/// this bounds how far past it an encode runs (~1–2 ms of a core at the measured worst).
const MAX_RUN_BYTES: usize = 1 << 10;

/// Words a core's cache keeps (~70 bytes each with their ids: ~4.5 MiB); English prose needs a
/// few tens of thousands for nearly every word of a new message to be a hit.
const MAX_WORDS: usize = 1 << 16;

/// Longest word kept (tokens): longer runs without a word cut are rarely repeated.
const MAX_WORD_TOKENS: usize = 64;

impl std::fmt::Debug for SegmentCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentCache")
            .field("stats", &self.stats)
            .finish()
    }
}

impl SegmentCache {
    /// An empty cache holding at most `max_cached_tokens` ids (2^20 ≈ 4 MiB of ids plus about
    /// 40 bytes per piece is a sensible per-core size).
    pub fn new(tokenizer: Arc<Tokenizer>, max_cached_tokens: usize) -> SegmentCache {
        SegmentCache {
            tok: tokenizer,
            map: IdCache::default(),
            max_tokens: max_cached_tokens,
            words: IdCache::default(),
            cuts: Vec::new(),
            keys: Vec::new(),
            memo: TextMemo::default(),
            text_cuts: Vec::new(),
            stats: CacheStats::default(),
            deadline: None,
        }
    }

    /// Give up encoding (with [`TokenizeError::TooSlow`]) once `deadline` passes; `None`: no
    /// time bound beyond the size [`Limits`]. Looked at before each unseen piece and between
    /// runs of at most [`MAX_RUN_BYTES`] of unseen words, so a prompt made of cached pieces
    /// never pays for the clock. A piece the tokenizer cannot cut into words (and a tokenizer
    /// without a reproducible split) is encoded in one call, bounded by the size limits alone.
    pub fn set_deadline(&mut self, deadline: Option<std::time::Instant>) {
        self.deadline = deadline;
    }

    /// Past the deadline: stop.
    fn check_time(&self) -> Result<(), TokenizeError> {
        match self.deadline {
            Some(d) if std::time::Instant::now() >= d => Err(TokenizeError::TooSlow),
            _ => Ok(()),
        }
    }

    /// The tokenizer this cache serves.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tok
    }

    /// /v1/chat/completions body (the raw JSON bytes) → prompt token ids appended to `out`.
    /// On error `out` is left as it was. A continued final message (`continue_final_message`)
    /// is encoded on its own, as a plain prompt less a leading BOS, its ids after the
    /// template's: SGLang 0.5.23 does so (`_append_assistant_prefix_to_prompt_ids`), and the
    /// ids differ from one encode of the joined text where the message starts with whitespace
    /// the template's last piece would take (a newline after `assistant\n`).
    pub fn chat_ids(&mut self, body: &[u8], out: &mut Vec<u32>) -> Result<(), TokenizeError> {
        let (text, split) = self.tok.render_chat_split(body)?;
        let start = out.len();
        self.encode_pieces(&text[..split], out)?;
        if split < text.len() {
            let from = out.len();
            if let Err(e) = self.text_ids(&text[split..], out) {
                out.truncate(start);
                return Err(e);
            }
            if self.tok.bos_id.is_some() && out.get(from).copied() == self.tok.bos_id {
                out.remove(from);
            }
        }
        Ok(())
    }

    /// A plain prompt (completions `prompt` string, generate `text`) → ids appended to `out`,
    /// with the tokenizer's special tokens (BOS) as SGLang adds them. On error `out` is left as
    /// it was.
    pub fn text_ids(&mut self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizeError> {
        let tok = Arc::clone(&self.tok);
        match &tok.affixes {
            Some((before, after)) if tok.splitter.is_some() && !text.is_empty() => {
                let start = out.len();
                out.extend_from_slice(before);
                if let Err(e) = self.encode_pieces(text, out) {
                    out.truncate(start);
                    return Err(e);
                }
                out.extend_from_slice(after);
                Ok(())
            }
            _ => {
                tok.check_text(text)?;
                self.stats.whole_encodes += 1;
                out.extend(tok.encode_raw(text, true)?);
                Ok(())
            }
        }
    }

    /// Counters (hits, misses, what is held).
    pub fn stats(&self) -> CacheStats {
        let mut s = self.stats;
        s.entries = self.map.len();
        s.word_entries = self.words.len();
        s
    }

    /// Encodes `text` without special tokens: piece by piece through the cache when the cut is
    /// reproducible, else whole.
    fn encode_pieces(&mut self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizeError> {
        let tok = Arc::clone(&self.tok);
        if text.len() > tok.limits.max_text_bytes {
            return Err(TokenizeError::TooLarge);
        }
        let Some(splitter) = &tok.splitter else {
            tok.check_words(text)?;
            self.stats.whole_encodes += 1;
            out.extend(tok.encode_raw(text, false)?);
            return Ok(());
        };
        if text.is_empty() {
            // `tokenizers` still runs the normalizer on an empty text; let it decide.
            out.extend(tok.encode_raw(text, false)?);
            return Ok(());
        }
        let start = out.len();
        // The longest prefix a recent text provably cuts alike: its ids copied, the split
        // resumed after it.
        let reuse = self.memo.find(text, splitter.max_token_len());
        let mut cuts = std::mem::take(&mut self.text_cuts);
        cuts.clear();
        let from = match reuse {
            Some(r) => {
                let (ids, kept) = self.memo.entry(r.slot);
                out.extend_from_slice(&ids[..r.ids]);
                cuts.extend_from_slice(&kept[..r.cuts]);
                self.stats.memo_bytes += r.from.done as u64;
                r.from
            }
            None => Resume::default(),
        };
        let r = splitter.split_from(text, from, |piece, after| {
            match piece {
                Piece::Token(id) => out.push(id),
                Piece::Text(t) => self.piece(&tok, t, out)?,
            }
            if let Some(after) = after {
                cuts.push((after, (out.len() - start) as u32));
            }
            Ok(())
        });
        match r {
            Ok(()) => self.memo.store(reuse, text, &out[start..], &mut cuts),
            Err(_) => out.truncate(start),
        }
        self.text_cuts = cuts;
        r
    }

    /// One piece through the cache.
    fn piece(
        &mut self,
        tok: &Tokenizer,
        piece: &str,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizeError> {
        let key = Key::of(piece);
        if let Some(ids) = self.map.get(&key) {
            out.extend_from_slice(ids);
            self.stats.hits += 1;
            return Ok(());
        }
        tok.check_words(piece)?;
        self.check_time()?;
        self.stats.misses += 1;
        let ids = if tok.word_cut {
            let start = out.len();
            self.encode_words(tok, piece, out)?;
            out[start..].to_vec()
        } else {
            let ids = tok.encode_raw(piece, false)?;
            out.extend_from_slice(&ids);
            ids
        };
        if ids.len() <= self.max_tokens / 8 {
            self.map.insert(key, ids.into_boxed_slice());
            if self.map.weight > self.max_tokens {
                self.stats.evicted += self.map.shrink_to(self.max_tokens / 4 * 3);
            }
            self.stats.cached_tokens = self.map.weight;
        }
        Ok(())
    }

    /// An unseen piece word by word: words in the word cache are copied, each run of
    /// consecutive unknown words is encoded in one call (with token offsets, to learn each
    /// word's ids). A word cut is a pre-token boundary (see [`word_cut_safe`]), so the result is
    /// the piece's whole encode. On error `out` may hold part of the piece (the caller
    /// truncates).
    fn encode_words(
        &mut self,
        tok: &Tokenizer,
        piece: &str,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizeError> {
        let mut cuts = std::mem::take(&mut self.cuts);
        let mut keys = std::mem::take(&mut self.keys);
        cuts.clear();
        cuts.push(0);
        word_cuts(piece.as_bytes(), |k| cuts.push(k));
        cuts.push(piece.len());
        keys.clear();
        keys.extend(cuts.windows(2).map(|c| Key::of(&piece[c[0]..c[1]])));
        let mut run_from: Option<usize> = None;
        let mut r = Ok(());
        for (w, key) in keys.iter().enumerate() {
            if self.words.contains(key) {
                if let Some(from) = run_from.take() {
                    r = self.encode_run(tok, piece, &cuts[from..=w], &keys[from..w], out);
                    if r.is_err() {
                        break;
                    }
                }
                // (The run's words may have pushed this one out: then it is a miss after all.)
                if let Some(ids) = self.words.get(key) {
                    out.extend_from_slice(ids);
                    self.stats.word_hits += 1;
                    continue;
                }
            }
            self.stats.word_misses += 1;
            let from = *run_from.get_or_insert(w);
            // A long run of unseen words goes in parts, the clock looked at between them.
            if cuts[w + 1] - cuts[from] >= MAX_RUN_BYTES {
                r = self
                    .encode_run(tok, piece, &cuts[from..=w + 1], &keys[from..=w], out)
                    .and_then(|()| self.check_time());
                run_from = None;
                if r.is_err() {
                    break;
                }
            }
        }
        if let (Ok(()), Some(from)) = (&r, run_from) {
            r = self.encode_run(tok, piece, &cuts[from..], &keys[from..], out);
        }
        self.cuts = cuts;
        self.keys = keys;
        r
    }

    /// Encodes `piece[cuts[0]..cuts[last]]` (consecutive words, `keys` theirs) into `out` and
    /// keeps each word's ids, found by the tokens' offsets (a token outside its word would mean
    /// the cut was not a boundary: then nothing is kept).
    fn encode_run(
        &mut self,
        tok: &Tokenizer,
        piece: &str,
        cuts: &[usize],
        keys: &[Key],
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizeError> {
        let (from, to) = (cuts[0], cuts[cuts.len() - 1]);
        if let [key] = keys {
            // One word: its ids are the whole encode, no offsets needed.
            let ids = tok.encode_raw(&piece[from..to], false)?;
            out.extend_from_slice(&ids);
            self.keep_word(*key, &ids);
            return Ok(());
        }
        let enc = tok.encode_with_offsets(&piece[from..to])?;
        let (ids, offsets) = (enc.get_ids(), enc.get_offsets());
        out.extend_from_slice(ids);
        // Every token must end inside the word its start falls in; then each word's ids are the
        // tokens starting before its end.
        let mut w = 0;
        for &(start, end) in offsets {
            while w < keys.len() && cuts[w + 1] - from <= start {
                w += 1;
            }
            if w == keys.len() || end > cuts[w + 1] - from {
                return Ok(());
            }
        }
        let mut first = 0;
        for (w, key) in keys.iter().enumerate() {
            let end = cuts[w + 1] - from;
            let last = first + offsets[first..].partition_point(|o| o.0 < end);
            self.keep_word(*key, &ids[first..last]);
            first = last;
        }
        Ok(())
    }

    /// Keeps one word's ids (unless empty or longer than [`MAX_WORD_TOKENS`]).
    fn keep_word(&mut self, key: Key, ids: &[u32]) {
        if ids.is_empty() || ids.len() > MAX_WORD_TOKENS {
            return;
        }
        self.words.insert(key, ids.into());
        if self.words.len() > MAX_WORDS {
            self.words.shrink_to(self.words.weight / 4 * 3);
        }
    }
}

#[cfg(test)]
mod tests;
