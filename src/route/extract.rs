//! What a request is routed on, borrowed from its JSON body without re-serialising it: the
//! `model`, the `stream` flag and the routing text, built exactly as the reference builds it
//! (chat: message contents joined by single spaces, text parts only, assistant
//! `reasoning_content` appended; completions: `prompt`, arrays joined by spaces, a token-id
//! prompt as its ids (a batch of token lists: the first list); `/generate`: `text`, else
//! `input_ids` as decimals joined by spaces; vLLM's `/inference/v1/generate`: `token_ids`;
//! Responses and Messages: see [`blocks`]). Strings without escapes stay borrowed
//! from the body, so a single-message chat or a plain prompt costs no copy; anything else is
//! written straight into one buffer, capped at [`MAX_ROUTING_TEXT`] bytes.

mod blocks;
mod json;

use self::blocks::{BlockList, Blocks};
use crate::base::text::{floor_char_boundary, SharedText};
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use std::borrow::Cow;
use std::fmt::{self, Write as _};

/// Which inference API a request uses; decides how the routing text is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Completions,
    /// `/generate`
    Generate,
    /// `/inference/v1/generate` (vLLM's token-in/token-out route: `token_ids`)
    TokenGenerate,
    /// `/v1/embeddings` (`input`)
    Embeddings,
    /// `/v1/rerank`, `/rerank` (`query`)
    Rerank,
    /// `/v1/responses` (OpenAI Responses: `instructions`, then `input`)
    Responses,
    /// `/v1/messages` (Anthropic Messages: `system`, then `messages`)
    Messages,
}

/// A request's routing text: a string of the body as it stands, or one the extractor joined
/// (several messages, unescaped text, a namespace marker), held in shared bytes so the text tree
/// and the recent-insert ring keep it without copying it again (at 16 KiB conversations that
/// second copy was 3 % of a core).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoutingText<'a> {
    /// One string of the body, borrowed as it stands (no escapes, nothing joined to it).
    InBody(&'a str),
    /// Built by the extractor: kept as it is, never copied again.
    Joined(SharedText),
}

impl<'a> From<Cow<'a, str>> for RoutingText<'a> {
    fn from(text: Cow<'a, str>) -> Self {
        match text {
            Cow::Borrowed(s) => RoutingText::InBody(s),
            Cow::Owned(s) => RoutingText::Joined(SharedText::from_string(s)),
        }
    }
}

impl std::ops::Deref for RoutingText<'_> {
    type Target = str;
    fn deref(&self) -> &str {
        match self {
            RoutingText::InBody(s) => s,
            RoutingText::Joined(t) => t.as_str(),
        }
    }
}

impl RoutingText<'_> {
    /// The text as an owned string.
    pub fn into_owned(self) -> String {
        self.to_string()
    }
}

impl PartialEq<String> for RoutingText<'_> {
    fn eq(&self, other: &String) -> bool {
        **self == **other
    }
}

impl PartialEq<&str> for RoutingText<'_> {
    fn eq(&self, other: &&str) -> bool {
        **self == **other
    }
}

/// Routing inputs borrowed from a body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingInfo<'a> {
    pub model: Option<Cow<'a, str>>,
    pub stream: bool,
    /// The routing text; for a request outside the default cache namespace it starts with the
    /// namespace's marker ([`Namespace::marker`]), so the text tree never matches it against
    /// another namespace's prompts.
    pub text: RoutingText<'a>,
    /// `text` holds the prompt's own token ids as decimals joined by spaces (`/generate`'s
    /// `input_ids`, a completions `prompt` of token ids, `/inference/v1/generate`'s
    /// `token_ids`): matched in the KV-event index without a tokenizer. A namespace's marker
    /// still leads them ([`without_marker`] takes it off).
    pub token_ids: bool,
    /// The cache namespace the request's prompt is reused in.
    pub namespace: Namespace<'a>,
    /// What pairing the request for prefill/decode needs (read in the same pass).
    pub shape: BodyShape,
}

/// The top-level fields that decide how many prompts a body holds and whether it asks for
/// input logprobs: what pairing a request for prefill/decode needs (one bootstrap room per
/// prompt), read in the same pass as the routing text. Types SGLang would refuse are left to
/// it (they read as absent here).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BodyShape {
    /// `text` is a list of this many items.
    pub text_list: Option<usize>,
    /// `input_ids` is a list of this many items, the first of them a list (a batch of token
    /// lists, not one prompt's tokens).
    pub ids_lists: Option<usize>,
    /// `prompt` is a list of this many prompts (its first item a string or a list).
    pub prompts: Option<usize>,
    /// `n` (an unsigned integer).
    pub n: Option<u64>,
    /// `/generate`'s `sampling_params.n` (an unsigned integer; of a per-item list, the largest):
    /// parallel samples of each prompt.
    pub sampling_n: Option<u64>,
    /// `return_logprob` is `true`.
    pub return_logprob: bool,
    /// `priority` (an integer): SGLang's priority scheduling reads it, and so does the
    /// gateway's admission when no `X-SMG-Priority` header is given. Under the saturation
    /// admission the class the gateway used replaces it in the body a worker gets.
    pub priority: Option<i64>,
    /// A top-level `priority` member is there and not `null`, whatever its type (a string or
    /// a float the engine might still read as an integer).
    pub priority_given: bool,
    /// A prompt of token ids (a completions `prompt` of ids or of id lists,
    /// `/inference/v1/generate`'s `token_ids`): how many ids it holds in all. Routing reads a
    /// batch's first list only; what a tenant is billed counts every prompt of it.
    pub token_count: Option<u64>,
}

/// The fields SGLang namespaces its prefix cache by: blocks are reused only between requests
/// that agree on all of them (a salt isolates a tenant, an adapter's KV differs from the base
/// model's, an extra key is the caller's own partition). Strings only (a batch's per-item list
/// is not one namespace; it routes as the default one); empty strings count as none, as SGLang
/// normalises them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Namespace<'a> {
    /// `cache_salt`.
    pub cache_salt: Option<Cow<'a, str>>,
    /// `lora_path`: the LoRA adapter's name (a `model` of `base:adapter` names one too; the
    /// KV-event path reads that against the served model names).
    pub lora_path: Option<Cow<'a, str>>,
    /// `extra_key`.
    pub extra_key: Option<Cow<'a, str>>,
}

impl Namespace<'_> {
    /// Whether this is the default namespace (none of the fields set).
    pub fn is_default(&self) -> bool {
        self.cache_salt.is_none() && self.lora_path.is_none() && self.extra_key.is_none()
    }

    /// The prefix a namespaced request's routing text gets: a control character, 16 hex
    /// digits of a hash of the three fields (each with a presence byte and its length), and
    /// the control character again. Prompts of the default namespace never start with it.
    pub fn marker(&self) -> Option<String> {
        if self.is_default() {
            return None;
        }
        let mut bytes = Vec::new();
        for part in [&self.cache_salt, &self.lora_path, &self.extra_key] {
            match part {
                None => bytes.push(0),
                Some(p) => {
                    bytes.push(1);
                    bytes.extend_from_slice(&(p.len() as u64).to_le_bytes());
                    bytes.extend_from_slice(p.as_bytes());
                }
            }
        }
        let h = xxhash_rust::xxh3::xxh3_64(&bytes);
        Some(format!("\u{1}{h:016x}\u{1}"))
    }
}

/// `text` without the namespace marker ([`Namespace::marker`]) it may start with. The marker
/// goes in front of every namespaced routing text, token-id texts included, so that the text
/// tree keeps namespaces apart; readers of a token-id text (which must see decimals only) take
/// it off with this. A text without a whole marker is returned as it is.
pub fn without_marker(text: &str) -> &str {
    let b = text.as_bytes();
    let marked = b.len() >= MARKER_LEN
        && b[0] == 1
        && b[MARKER_LEN - 1] == 1
        && b[1..MARKER_LEN - 1].iter().all(u8::is_ascii_hexdigit);
    if marked {
        // Bytes 0 and 17 are ASCII, so 18 is a character boundary.
        text.get(MARKER_LEN..).unwrap_or(text)
    } else {
        text
    }
}

/// Bytes of a namespace marker: `\u{1}`, 16 hex digits, `\u{1}`.
pub const MARKER_LEN: usize = 18;

/// Why a body cannot be routed; answered with 400 and an OpenAI-style error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtractError(pub String);

impl fmt::Display for ExtractError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Longest routing text, in bytes (cut back to a character boundary): longer prompts are routed
/// on their first 128 KiB. Prefixes that agree for 128 KiB (about 32k tokens) are rare enough
/// that routing loses little, and every copy of the text (the recent-insert ring, the tree
/// writer's queue, the tree itself) stays small whatever the body size.
pub const MAX_ROUTING_TEXT: usize = 128 * 1024;

/// The longest prefix of `s` that fits in `room` bytes, on a character boundary (also caps
/// the text learned with a reply).
pub fn capped(s: &str, room: usize) -> &str {
    &s[..floor_char_boundary(s.as_bytes(), room.min(s.len()))]
}

/// The routing text of one field, built as the body is parsed: borrowed from the body while it
/// is a single unescaped piece, else one `String` that every further piece (numbers included)
/// is written straight into, never longer than [`MAX_ROUTING_TEXT`]. A sink that does not
/// `keep` only validates (fields the API does not route on).
struct Sink<'a> {
    keep: bool,
    pieces: usize,
    borrowed: Option<&'a str>,
    buf: String,
    /// A piece did not fit whole, so the text is done: a space or a shorter piece written after
    /// it would make it something other than the whole text's first [`MAX_ROUTING_TEXT`] bytes
    /// cut back to a character boundary (the cut can leave up to three bytes of room).
    cut: bool,
    /// Bytes reserved when the text first needs its own buffer: the body's length (the text
    /// cannot be longer) capped at [`MAX_ROUTING_TEXT`], so a text of many pieces is written
    /// into one allocation instead of being copied at every doubling.
    reserve: usize,
}

impl<'a> Sink<'a> {
    fn new(keep: bool, reserve: usize) -> Self {
        Sink {
            keep,
            pieces: 0,
            borrowed: None,
            buf: String::new(),
            cut: false,
            reserve: reserve.min(MAX_ROUTING_TEXT),
        }
    }

    /// Nothing more can be written: the text is not kept, or already [`MAX_ROUTING_TEXT`]
    /// long. The visitors then skip the rest of their value as JSON (validated by the parser's
    /// fast skip, never unescaped or copied), so a prompt costs a copy only of what routing reads.
    fn full(&self) -> bool {
        let len = match self.borrowed {
            Some(b) if self.pieces == 1 => b.len(),
            _ => self.buf.len(),
        };
        !self.keep || self.cut || len >= MAX_ROUTING_TEXT
    }

    /// The owned buffer, allocated at its expected size on first use.
    fn owned(&mut self) -> &mut String {
        if self.buf.capacity() == 0 {
            self.buf.reserve(self.reserve);
        }
        &mut self.buf
    }

    /// Appends what fits of `s` to the owned buffer.
    fn append(&mut self, s: &str) {
        if self.cut {
            return;
        }
        let room = MAX_ROUTING_TEXT - self.buf.len();
        let fits = capped(s, room);
        self.cut = fits.len() < s.len();
        self.owned().push_str(fits);
    }

    /// Starts a piece: pieces are joined by single spaces, so from the second one on the text
    /// is owned.
    fn begin(&mut self) {
        if self.pieces > 0 {
            if let Some(b) = self.borrowed.take() {
                self.owned().push_str(b);
            }
            if !self.cut && self.buf.len() < MAX_ROUTING_TEXT {
                self.owned().push(' ');
            }
        }
        self.pieces += 1;
    }

    /// A piece that lives in the body (stays borrowed when it is the only one).
    fn borrowed(&mut self, s: &'a str) {
        if !self.keep {
            return;
        }
        if self.pieces == 0 {
            self.pieces = 1;
            let fits = capped(s, MAX_ROUTING_TEXT);
            self.cut = fits.len() < s.len();
            self.borrowed = Some(fits);
        } else {
            self.begin();
            self.append(s);
        }
    }

    /// A piece decoded by the parser (it had escapes): copied, as far as it fits.
    fn transient(&mut self, s: &str) {
        if self.keep {
            self.begin();
            self.append(s);
        }
    }

    fn piece(&mut self, p: Cow<'a, str>) {
        match p {
            Cow::Borrowed(s) => self.borrowed(s),
            Cow::Owned(s) => self.transient(&s),
        }
    }

    /// A JSON number, the digits the reference's `to_string` writes, `write` putting them
    /// straight into the text (no `String` of its own), cut at the text's cap.
    fn number(&mut self, write: impl FnOnce(&mut String)) {
        if !self.keep || self.cut {
            return;
        }
        self.begin();
        if self.buf.len() < MAX_ROUTING_TEXT {
            write(self.owned());
            // Only ASCII was written past the old length, so the cut is a character boundary.
            self.buf.truncate(MAX_ROUTING_TEXT);
        }
    }

    /// An integer through `itoa` (two digits per step from a table): `/generate`'s
    /// `input_ids` are thousands of them, and `core::fmt` cost ~12 ns each.
    fn integer(&mut self, n: impl itoa::Integer) {
        self.number(|s| s.push_str(itoa::Buffer::new().format(n)));
    }

    /// A string kept aside until its object ends (a content part's `text`, a message's
    /// `reasoning_content`), capped one character past the text's own cap: a string longer
    /// than the cap stays longer, so writing it still reads as a cut piece.
    fn aside(&self, s: Cow<'a, str>) -> Cow<'a, str> {
        const ASIDE: usize = MAX_ROUTING_TEXT + 4;
        match s {
            Cow::Borrowed(b) => Cow::Borrowed(capped(b, ASIDE)),
            Cow::Owned(_) if !self.keep => Cow::Borrowed(""),
            Cow::Owned(mut o) => {
                let keep = capped(&o, ASIDE).len();
                o.truncate(keep);
                Cow::Owned(o)
            }
        }
    }

    fn finish(self) -> Cow<'a, str> {
        match self.borrowed {
            Some(b) if self.pieces == 1 => Cow::Borrowed(b),
            _ => Cow::Owned(self.buf),
        }
    }
}

/// The object keys the extractor looks at, matched without copying the key.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Key {
    Model,
    Stream,
    Messages,
    Prompt,
    Text,
    InputIds,
    InputEmbeds,
    Input,
    Query,
    Content,
    ReasoningContent,
    Type,
    Instructions,
    System,
    Output,
    CacheSalt,
    LoraPath,
    Extra,
    N,
    SamplingParams,
    ReturnLogprob,
    Priority,
    TokenIds,
    Other,
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object key")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
                Ok(match v {
                    "model" => Key::Model,
                    "stream" => Key::Stream,
                    "messages" => Key::Messages,
                    "prompt" => Key::Prompt,
                    "text" => Key::Text,
                    "input_ids" => Key::InputIds,
                    "input_embeds" => Key::InputEmbeds,
                    "input" => Key::Input,
                    "query" => Key::Query,
                    "content" => Key::Content,
                    "reasoning_content" => Key::ReasoningContent,
                    "type" => Key::Type,
                    "instructions" => Key::Instructions,
                    "system" => Key::System,
                    "output" => Key::Output,
                    "cache_salt" => Key::CacheSalt,
                    "lora_path" => Key::LoraPath,
                    "extra_key" => Key::Extra,
                    "n" => Key::N,
                    "sampling_params" => Key::SamplingParams,
                    "return_logprob" => Key::ReturnLogprob,
                    "priority" => Key::Priority,
                    "token_ids" => Key::TokenIds,
                    _ => Key::Other,
                })
            }
        }
        d.deserialize_str(V)
    }
}

/// Deepest nesting of arrays and objects the extractor follows (about what serde_json allows);
/// the parser refuses a deeper body with 400 as it enters the level past it, which bounds the
/// visitors' and the parser's recursion, so the stack, on every core.
pub const MAX_NESTING: u32 = 128;

/// Stack a thread needs to run [`extract`] on any body: [`MAX_NESTING`] levels of visitor and
/// parser frames are ~17 KB each in a debug build (2.2 MB, past a default 2 MiB thread stack),
/// a fraction of that in release. The serving cores are given this much.
pub const STACK_BYTES: usize = 8 << 20;

/// A value read only to be validated and dropped: serde's `IgnoredAny`, through the parser's
/// validating skip (no string is unescaped or copied, no number converted; recursion bounded
/// by [`MAX_NESTING`] like every other read).
pub(crate) struct Skip;

impl<'de> Deserialize<'de> for Skip {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        de::IgnoredAny::deserialize(d).map(|_| Skip)
    }
}

/// A JSON string, borrowed when it has no escapes.
struct Str<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Str<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v.to_string())))
            }
        }
        d.deserialize_str(V)
    }
}

/// Whether a content part's `type` (a string or null) leaves it a text part, without copying.
struct IsText(bool);

impl<'de> Deserialize<'de> for IsText {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = IsText;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<IsText, E> {
                Ok(IsText(v == "text"))
            }
            fn visit_none<E: de::Error>(self) -> Result<IsText, E> {
                Ok(IsText(true))
            }
            fn visit_unit<E: de::Error>(self) -> Result<IsText, E> {
                Ok(IsText(true))
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<IsText, D::Error> {
                d.deserialize_str(self)
            }
        }
        d.deserialize_option(V)
    }
}

/// Text pieces of a JSON value, written into a [`Sink`]: a string, a number, or (nested)
/// arrays of them. Chat content parts (`{"type":"text","text":..}`) contribute their `text`;
/// other objects, booleans and null contribute nothing.
struct Pieces<'s, 'a>(&'s mut Sink<'a>);

impl<'de> DeserializeSeed<'de> for Pieces<'_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        if self.0.full() {
            return Skip::deserialize(d).map(|_| ());
        }
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Pieces<'_, 'de> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, a number, an array or a content part")
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<(), E> {
        self.0.borrowed(v);
        Ok(())
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        self.0.transient(v);
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        self.0.integer(v);
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        self.0.integer(v);
        Ok(())
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        self.0.number(|s| {
            // Writing to a String cannot fail.
            let _ = write!(s, "{v}");
        });
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Pieces(&mut *self.0))?.is_some() {}
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        // A chat content part: keep `text` of parts whose type is text (or untyped); the type
        // may come after the text, so the text waits for the end of the part.
        let mut text: Option<Cow<'de, str>> = None;
        let mut is_text = true;
        while let Some(k) = map.next_key::<Key>()? {
            match k {
                Key::Text => {
                    text = map
                        .next_value::<Option<Str<'de>>>()?
                        .map(|s| self.0.aside(s.0))
                }
                Key::Type => is_text = map.next_value::<IsText>()?.0,
                _ => {
                    map.next_value::<Skip>()?;
                }
            }
        }
        if let (true, Some(t)) = (is_text, text) {
            self.0.piece(t);
        }
        Ok(())
    }
}

/// A top-level list's shape: how many items it holds (`None`: not a list) and the first one's
/// kind.
#[derive(Debug, Clone, Copy, Default)]
struct ListShape {
    len: Option<usize>,
    first: Kind,
}

/// What a value is, as far as telling a batch from one prompt goes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Kind {
    #[default]
    Other,
    List,
    Str,
    /// An integer (a completions prompt of token ids).
    Int,
}

/// A value read as [`Pieces`] reads it, its list shape noted (see [`BodyShape`]).
struct Shaped<'s, 'a> {
    sink: &'s mut Sink<'a>,
    shape: &'s mut ListShape,
}

impl<'de> DeserializeSeed<'de> for Shaped<'_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Shaped<'_, 'de> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, a number or an array")
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<(), E> {
        Pieces(self.sink).visit_borrowed_str(v)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        Pieces(self.sink).visit_str(v)
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        Pieces(self.sink).visit_u64(v)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        Pieces(self.sink).visit_i64(v)
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        Pieces(self.sink).visit_f64(v)
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        Pieces(self.sink).visit_map(map)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut len = 0usize;
        let mut first = Kind::Other;
        if seq
            .next_element_seed(FirstItem {
                sink: &mut *self.sink,
                kind: &mut first,
            })?
            .is_some()
        {
            len = 1;
            while seq.next_element_seed(Pieces(&mut *self.sink))?.is_some() {
                len += 1;
            }
        }
        *self.shape = ListShape {
            len: Some(len),
            first,
        };
        Ok(())
    }
}

/// A list's first item: read as [`Pieces`] reads it, its [`Kind`] noted.
struct FirstItem<'s, 'a> {
    sink: &'s mut Sink<'a>,
    kind: &'s mut Kind,
}

impl<'de> DeserializeSeed<'de> for FirstItem<'_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for FirstItem<'_, 'de> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, a number, an array or a content part")
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<(), E> {
        *self.kind = Kind::Str;
        Pieces(self.sink).visit_borrowed_str(v)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        *self.kind = Kind::Str;
        Pieces(self.sink).visit_str(v)
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        Pieces(self.sink).visit_u64(v)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        Pieces(self.sink).visit_i64(v)
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        Pieces(self.sink).visit_f64(v)
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<(), A::Error> {
        *self.kind = Kind::List;
        Pieces(self.sink).visit_seq(seq)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        Pieces(self.sink).visit_map(map)
    }
}

/// The refusal of token ids of another shape: a completions `prompt` that starts as token ids
/// and goes on otherwise, a `token_ids` that is not a list of them. vLLM refuses both (its
/// `prompt` is a string, a list of strings, a list of token ids or a list of token-id lists;
/// `token_ids` a list of non-negative integers), so the gateway answers 400 itself rather than
/// route a body no worker takes.
const MIXED_PROMPT: &str = "token ids must be non-negative integers below 2^32: a `prompt` of \
     token ids is a list of them or a list of such lists, `token_ids` a list of them";

/// A completions `prompt` that routes: read as [`Shaped`] reads it, except that a list whose
/// first item is an integer or a list is token ids, held to that shape (anything else in it is
/// refused, 400), and of a batch of token lists only the first list is written. A batch goes
/// to one worker, which computes every prompt of it; the index scores a worker by the leading
/// blocks of one chain it holds, and the first prompt's chain ranks workers at least as well
/// as the batch's common prefix would (a worker holding the common prefix scores the same
/// either way, one holding more of the first prompt saves that much more), costs no second
/// pass or buffer, and is what the worker will really have cached once it has run the batch.
struct Prompt<'s, 'a> {
    sink: &'s mut Sink<'a>,
    shape: &'s mut ListShape,
    /// Token ids met, over every list.
    ids: &'s mut usize,
}

impl<'de> DeserializeSeed<'de> for Prompt<'_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Prompt<'_, 'de> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, a list of strings or token ids, or a list of token-id lists")
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<(), E> {
        Pieces(self.sink).visit_borrowed_str(v)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        Pieces(self.sink).visit_str(v)
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        Pieces(self.sink).visit_u64(v)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        Pieces(self.sink).visit_i64(v)
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        Pieces(self.sink).visit_f64(v)
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        Pieces(self.sink).visit_map(map)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut first = Kind::Other;
        let mut len = 0usize;
        if seq
            .next_element_seed(FirstPrompt {
                sink: &mut *self.sink,
                kind: &mut first,
                ids: &mut *self.ids,
            })?
            .is_some()
        {
            len = 1;
            loop {
                let more = match first {
                    Kind::Int => seq.next_element_seed(TokenId(Some(&mut *self.sink)))?,
                    // Later lists of a batch are only held to their shape (and counted).
                    Kind::List => seq
                        .next_element_seed(TokenList {
                            sink: None,
                            len: &mut *self.ids,
                        })?
                        .map(|_| ()),
                    Kind::Str | Kind::Other => seq.next_element_seed(Pieces(&mut *self.sink))?,
                };
                if more.is_none() {
                    break;
                }
                len += 1;
            }
        }
        if first == Kind::Int {
            *self.ids = len;
        }
        *self.shape = ListShape {
            len: Some(len),
            first,
        };
        Ok(())
    }
}

/// A completions prompt list's first item: an integer starts a token-id prompt, a list a batch
/// of token-id lists (read as one, written), a string a list of texts; its [`Kind`] is noted.
struct FirstPrompt<'s, 'a> {
    sink: &'s mut Sink<'a>,
    kind: &'s mut Kind,
    /// Token ids of the first list, when it is one.
    ids: &'s mut usize,
}

impl<'de> DeserializeSeed<'de> for FirstPrompt<'_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for FirstPrompt<'_, 'de> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, a token id or a list of token ids")
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<(), E> {
        *self.kind = Kind::Str;
        Pieces(self.sink).visit_borrowed_str(v)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        *self.kind = Kind::Str;
        Pieces(self.sink).visit_str(v)
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        *self.kind = Kind::Int;
        TokenId(Some(self.sink)).visit_u64(v)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        *self.kind = Kind::Int;
        TokenId(Some(self.sink)).visit_i64(v)
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        Pieces(self.sink).visit_f64(v)
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<(), A::Error> {
        *self.kind = Kind::List;
        TokenList {
            sink: Some(self.sink),
            len: self.ids,
        }
        .visit_seq(seq)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        Pieces(self.sink).visit_map(map)
    }
}

/// A list of token ids, each written into `sink` (when given and not full) as a decimal;
/// `len` counts them. Anything but a list of integers in `0..2^32` is refused.
struct TokenList<'s, 'a> {
    sink: Option<&'s mut Sink<'a>>,
    len: &'s mut usize,
}

impl<'de> DeserializeSeed<'de> for TokenList<'_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for TokenList<'_, 'de> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of token ids")
    }
    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        while seq
            .next_element_seed(TokenId(self.sink.as_deref_mut()))?
            .is_some()
        {
            *self.len += 1;
        }
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Err(de::Error::custom(MIXED_PROMPT))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Err(de::Error::custom(MIXED_PROMPT))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Err(de::Error::custom(MIXED_PROMPT))
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Err(de::Error::custom(MIXED_PROMPT))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Err(de::Error::custom(MIXED_PROMPT))
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Err(de::Error::custom(MIXED_PROMPT))
    }
    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        Err(de::Error::custom(MIXED_PROMPT))
    }
}

/// One token id: an integer in `0..2^32`, written into the sink when there is one with room;
/// anything else is refused.
struct TokenId<'s, 'a>(Option<&'s mut Sink<'a>>);

impl<'de> DeserializeSeed<'de> for TokenId<'_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for TokenId<'_, 'de> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a token id")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        if v > u64::from(u32::MAX) {
            return Err(de::Error::custom(MIXED_PROMPT));
        }
        if let Some(sink) = self.0.filter(|s| !s.full()) {
            sink.integer(v);
        }
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        match u64::try_from(v) {
            Ok(v) => self.visit_u64(v),
            Err(_) => Err(de::Error::custom(MIXED_PROMPT)),
        }
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Err(de::Error::custom(MIXED_PROMPT))
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Err(de::Error::custom(MIXED_PROMPT))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Err(de::Error::custom(MIXED_PROMPT))
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Err(de::Error::custom(MIXED_PROMPT))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        Err(de::Error::custom(MIXED_PROMPT))
    }
    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        Err(de::Error::custom(MIXED_PROMPT))
    }
}

/// A value of type `T` when it is one, else `None` (validated and skipped): fields the gateway
/// only consults, whose type SGLang judges.
struct Lenient<T>(Option<T>);

impl<'de> Deserialize<'de> for Lenient<u64> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Lenient<u64>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any value")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(Lenient(Some(v)))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
                Ok(Lenient(None))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
                Ok(Lenient(None))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
                Ok(Lenient(None))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
                Ok(Lenient(None))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Lenient(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<Skip>()?.is_some() {}
                Ok(Lenient(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map.next_entry::<Skip, Skip>()?.is_some() {}
                Ok(Lenient(None))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Lenient<i64> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Any other value is validated and skipped, as for `Lenient<u64>`.
        Ok(Lenient(match Lenient::<u64>::deserialize_signed(d)? {
            Signed::Pos(v) => Some(i64::try_from(v).unwrap_or(i64::MAX)),
            Signed::Neg(v) => Some(v),
            Signed::Not => None,
        }))
    }
}

/// `sampling_params`' `n`: of an object, its `n` member; of a list of objects (a batch's
/// per-item parameters), the largest. Anything else is validated and skipped.
struct SamplingN(Option<u64>);

impl<'de> Deserialize<'de> for SamplingN {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = SamplingN;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any value")
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<SamplingN, E> {
                Ok(SamplingN(None))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<SamplingN, E> {
                Ok(SamplingN(None))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<SamplingN, E> {
                Ok(SamplingN(None))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<SamplingN, E> {
                Ok(SamplingN(None))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<SamplingN, E> {
                Ok(SamplingN(None))
            }
            fn visit_unit<E: de::Error>(self) -> Result<SamplingN, E> {
                Ok(SamplingN(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<SamplingN, A::Error> {
                let mut most: Option<u64> = None;
                while let Some(SamplingN(n)) = seq.next_element::<SamplingN>()? {
                    most = most.max(n);
                }
                Ok(SamplingN(most))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<SamplingN, A::Error> {
                let mut n = None;
                while let Some(k) = map.next_key::<Key>()? {
                    if k == Key::N {
                        n = map.next_value::<Lenient<u64>>()?.0;
                    } else {
                        map.next_value::<Skip>()?;
                    }
                }
                Ok(SamplingN(n))
            }
        }
        d.deserialize_any(V)
    }
}

/// An integer of either sign, or something else.
enum Signed {
    Pos(u64),
    Neg(i64),
    Not,
}

impl Lenient<u64> {
    fn deserialize_signed<'de, D: Deserializer<'de>>(d: D) -> Result<Signed, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Signed;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any value")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Signed, E> {
                Ok(Signed::Pos(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Signed, E> {
                Ok(Signed::Neg(v))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Signed, E> {
                Ok(Signed::Not)
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Signed, E> {
                Ok(Signed::Not)
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Signed, E> {
                Ok(Signed::Not)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Signed, E> {
                Ok(Signed::Not)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Signed, A::Error> {
                while seq.next_element::<Skip>()?.is_some() {}
                Ok(Signed::Not)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Signed, A::Error> {
                while map.next_entry::<Skip, Skip>()?.is_some() {}
                Ok(Signed::Not)
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Lenient<bool> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Lenient<bool>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any value")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
                Ok(Lenient(Some(v)))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
                Ok(Lenient(None))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
                Ok(Lenient(None))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
                Ok(Lenient(None))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
                Ok(Lenient(None))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Lenient(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<Skip>()?.is_some() {}
                Ok(Lenient(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map.next_entry::<Skip, Skip>()?.is_some() {}
                Ok(Lenient(None))
            }
        }
        d.deserialize_any(V)
    }
}

/// `messages`: an array of chat messages, each contributing its content pieces, then its
/// `reasoning_content`.
struct Messages<'s, 'a>(&'s mut Sink<'a>);

impl<'de> DeserializeSeed<'de> for Messages<'_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Messages<'_, 'de> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of chat messages")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while !self.0.full() {
            if seq.next_element_seed(Message(&mut *self.0))?.is_none() {
                return Ok(());
            }
        }
        // Past the text's cap (or when no text is kept) a message adds nothing: each is only
        // held to being an object of valid JSON, in one pass of the parser's skip.
        while seq.next_element::<OpaqueMessage>()?.is_some() {}
        Ok(())
    }
}

/// A chat message that adds nothing to the routing text (past [`MAX_ROUTING_TEXT`]): checked
/// as [`Message`] checks it (an object, valid JSON), its keys never matched one by one.
struct OpaqueMessage;

impl<'de> Deserialize<'de> for OpaqueMessage {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = OpaqueMessage;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a chat message object")
            }
            fn visit_unit<E: de::Error>(self) -> Result<OpaqueMessage, E> {
                Ok(OpaqueMessage)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<OpaqueMessage, A::Error> {
                while map
                    .next_entry::<de::IgnoredAny, de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(OpaqueMessage)
            }
        }
        d.deserialize_struct(json::OPAQUE_OBJECT, &[], V)
    }
}

/// One chat message.
struct Message<'s, 'a>(&'s mut Sink<'a>);

impl<'de> DeserializeSeed<'de> for Message<'_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Message<'_, 'de> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a chat message object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut reasoning = None;
        while let Some(k) = map.next_key::<Key>()? {
            match k {
                Key::Content => map.next_value_seed(Pieces(&mut *self.0))?,
                Key::ReasoningContent if self.0.full() => {
                    map.next_value::<Skip>()?;
                }
                Key::ReasoningContent => {
                    reasoning = map
                        .next_value::<Option<Str<'de>>>()?
                        .map(|s| self.0.aside(s.0))
                }
                _ => {
                    map.next_value::<Skip>()?;
                }
            }
        }
        if let Some(r) = reasoning {
            self.0.piece(r);
        }
        Ok(())
    }
}

/// `null` or a value read by the inner seed; the result says whether the value was there.
struct Optional<S>(S);

impl<'de, S: DeserializeSeed<'de, Value = ()>> DeserializeSeed<'de> for Optional<S> {
    type Value = bool;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_option(self)
    }
}

impl<'de, S: DeserializeSeed<'de, Value = ()>> Visitor<'de> for Optional<S> {
    type Value = bool;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a value or null")
    }
    fn visit_none<E: de::Error>(self) -> Result<bool, E> {
        Ok(false)
    }
    fn visit_unit<E: de::Error>(self) -> Result<bool, E> {
        Ok(false)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        self.0.deserialize(d).map(|()| true)
    }
}

/// A string, or anything else (validated, skipped: `None`), or null.
struct MaybeStr<'a>(Option<Cow<'a, str>>);

impl<'de: 'a, 'a> Deserialize<'de> for MaybeStr<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = MaybeStr<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any value")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(MaybeStr((!v.is_empty()).then_some(Cow::Borrowed(v))))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(MaybeStr((!v.is_empty()).then(|| Cow::Owned(v.to_string()))))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(MaybeStr(None))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
                Ok(MaybeStr(None))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
                Ok(MaybeStr(None))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
                Ok(MaybeStr(None))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
                Ok(MaybeStr(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<Skip>()?.is_some() {}
                Ok(MaybeStr(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map.next_entry::<Skip, Skip>()?.is_some() {}
                Ok(MaybeStr(None))
            }
        }
        d.deserialize_any(V)
    }
}

/// What the top-level object gave: the fields each API needs, the routing text already built.
struct Parsed<'a> {
    model: Option<Cow<'a, str>>,
    namespace: Namespace<'a>,
    stream: Option<bool>,
    /// The field the API routes on was present and not null.
    present: bool,
    /// `/generate`: `input_ids` present (used when `text` is not).
    ids_present: bool,
    /// Completions: `prompt` is token ids (a list of integers, or a batch of such lists) and
    /// `text` holds them (the batch's first list).
    prompt_ids: bool,
    embeds_present: bool,
    text: Sink<'a>,
    ids: Sink<'a>,
    /// Responses' `instructions`, Messages' `system`: first in the routing text wherever
    /// they appear in the body.
    pre: Sink<'a>,
    shape: BodyShape,
}

/// The top-level object. Every known field is validated as before whatever the API; only the
/// API's own field writes routing text (`/generate` keeps `text` and `input_ids` apart: `text`
/// wins wherever it appears).
struct Top {
    api: Api,
    /// Build the routing text (else only validate the fields it comes from).
    keep_text: bool,
    /// The body's length: what the routing text's buffer reserves (see [`Sink`]).
    body_len: usize,
}

impl<'de> DeserializeSeed<'de> for Top {
    type Value = Parsed<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Parsed<'de>, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Top {
    type Value = Parsed<'de>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Parsed<'de>, A::Error> {
        let fields = Fields::of(self.api);
        let mut p = Parsed::new(&self);
        let mut discard = Sink::new(false, 0);
        let mut seen: u32 = 0;
        while let Some(k) = map.next_key::<Key>()? {
            let k = fields.key(k);
            refuse_duplicate(&mut seen, k)?;
            match k {
                Key::Messages
                | Key::Input
                | Key::Instructions
                | Key::System
                | Key::Prompt
                | Key::Text
                | Key::InputIds
                | Key::TokenIds
                | Key::Query => p.read_text_field(&mut map, k, fields, &mut discard)?,
                _ => p.read_plain_field(&mut map, k)?,
            }
        }
        Ok(p)
    }
}

/// Which top-level fields an API builds its routing text from.
#[derive(Clone, Copy)]
struct Fields {
    api: Api,
    /// The field the API routes on.
    routes_on: Key,
    /// The field whose text goes first wherever it appears (Responses' `instructions`,
    /// Messages' `system`); `Key::Other` for the APIs without one.
    pre: Key,
}

impl Fields {
    fn of(api: Api) -> Self {
        let routes_on = match api {
            Api::Chat | Api::Messages => Key::Messages,
            Api::Completions => Key::Prompt,
            Api::Generate => Key::Text,
            Api::TokenGenerate => Key::TokenIds,
            Api::Embeddings | Api::Responses => Key::Input,
            Api::Rerank => Key::Query,
        };
        let pre = match api {
            Api::Responses => Key::Instructions,
            Api::Messages => Key::System,
            _ => Key::Other,
        };
        Fields {
            api,
            routes_on,
            pre,
        }
    }

    /// A key as this API reads it: the fields only the newer APIs know are plain unknown
    /// fields to the others.
    fn key(self, k: Key) -> Key {
        match k {
            Key::Instructions | Key::System if k != self.pre => Key::Other,
            // Only vLLM's token route knows `token_ids`: to the others it is any unknown field.
            Key::TokenIds if self.api != Api::TokenGenerate => Key::Other,
            Key::Output => Key::Other,
            k => k,
        }
    }
}

/// Known top-level fields may appear once (as serde's derive insisted); others repeat. `seen`
/// has a bit per known field met so far.
fn refuse_duplicate<E: de::Error>(seen: &mut u32, k: Key) -> Result<(), E> {
    let tracked = !matches!(
        k,
        Key::Other
            | Key::Content
            | Key::ReasoningContent
            | Key::Type
            | Key::N
            | Key::SamplingParams
            | Key::ReturnLogprob
            | Key::Priority
    );
    if tracked {
        let bit = 1u32 << (k as u32);
        if *seen & bit != 0 {
            return Err(de::Error::custom(format_args!(
                "duplicate field `{}`",
                key_name(k)
            )));
        }
        *seen |= bit;
    }
    Ok(())
}

impl BodyShape {
    /// A top-level list's shape, noted under the field it was read from.
    fn note_list(&mut self, k: Key, list: ListShape) {
        let Some(len) = list.len else {
            return;
        };
        match k {
            Key::Text => self.text_list = Some(len),
            Key::InputIds if list.first == Kind::List => self.ids_lists = Some(len),
            Key::Prompt if matches!(list.first, Kind::List | Kind::Str) => self.prompts = Some(len),
            _ => {}
        }
    }
}

impl<'de> Parsed<'de> {
    /// Nothing read yet; the routing text's buffers as `top` asks.
    fn new(top: &Top) -> Self {
        Parsed {
            model: None,
            namespace: Namespace::default(),
            stream: None,
            present: false,
            ids_present: false,
            prompt_ids: false,
            embeds_present: false,
            text: Sink::new(top.keep_text, top.body_len),
            ids: Sink::new(top.keep_text && top.api == Api::Generate, top.body_len),
            pre: Sink::new(top.keep_text, 0),
            shape: BodyShape::default(),
        }
    }

    /// The value of a field routing text may come from, written into the routing text, the
    /// token ids, the text that goes first, or (another API's field) `discard`.
    fn read_text_field<A: MapAccess<'de>>(
        &mut self,
        map: &mut A,
        k: Key,
        fields: Fields,
        discard: &mut Sink<'de>,
    ) -> Result<(), A::Error> {
        let routes = k == fields.routes_on;
        let sink = if routes {
            &mut self.text
        } else if k == Key::InputIds {
            &mut self.ids
        } else if k == fields.pre {
            &mut self.pre
        } else {
            discard
        };
        match k {
            Key::Messages if fields.api == Api::Messages => {
                self.present |= map.next_value_seed(Optional(BlockList(sink)))?;
            }
            Key::Input if fields.api == Api::Responses => {
                self.present |= map.next_value_seed(Optional(Blocks(sink)))?;
            }
            Key::Instructions | Key::System => {
                map.next_value_seed(Optional(Blocks(sink)))?;
            }
            Key::Messages => {
                let there = map.next_value_seed(Optional(Messages(sink)))?;
                self.present |= there && routes;
            }
            Key::Prompt if routes && fields.api == Api::Completions => {
                let mut list = ListShape::default();
                let mut ids = 0usize;
                let there = map.next_value_seed(Optional(Prompt {
                    sink,
                    shape: &mut list,
                    ids: &mut ids,
                }))?;
                self.present |= there;
                self.prompt_ids = there && matches!(list.first, Kind::Int | Kind::List);
                if self.prompt_ids {
                    self.shape.token_count = Some(ids as u64);
                }
                self.shape.note_list(k, list);
            }
            Key::TokenIds => {
                let mut n = 0usize;
                let there = map.next_value_seed(Optional(TokenList {
                    sink: Some(sink),
                    len: &mut n,
                }))?;
                if there && n == 0 {
                    return Err(de::Error::custom("`token_ids` must not be empty"));
                }
                self.present |= there && routes;
                if there && routes {
                    self.shape.token_count = Some(n as u64);
                }
            }
            Key::Prompt | Key::Text | Key::InputIds => {
                let mut list = ListShape::default();
                let there = map.next_value_seed(Optional(Shaped {
                    sink,
                    shape: &mut list,
                }))?;
                self.present |= there && routes;
                self.ids_present |= there && k == Key::InputIds;
                self.shape.note_list(k, list);
            }
            Key::Input | Key::Query => {
                let there = map.next_value_seed(Optional(Pieces(sink)))?;
                self.present |= there && routes;
            }
            _ => {
                map.next_value::<Skip>()?;
            }
        }
        Ok(())
    }

    /// The value of any other field: the model, the cache namespace, the stream flag and what
    /// the body's shape needs are read; the rest is validated and skipped.
    fn read_plain_field<A: MapAccess<'de>>(&mut self, map: &mut A, k: Key) -> Result<(), A::Error> {
        match k {
            Key::Model => self.model = map.next_value::<Option<Str<'de>>>()?.map(|s| s.0),
            Key::CacheSalt => self.namespace.cache_salt = map.next_value::<MaybeStr<'de>>()?.0,
            Key::LoraPath => self.namespace.lora_path = map.next_value::<MaybeStr<'de>>()?.0,
            Key::Extra => self.namespace.extra_key = map.next_value::<MaybeStr<'de>>()?.0,
            Key::Stream => self.stream = map.next_value()?,
            Key::N => self.shape.n = map.next_value::<Lenient<u64>>()?.0,
            Key::SamplingParams => {
                self.shape.sampling_n = map.next_value::<SamplingN>()?.0;
            }
            Key::Priority => {
                let v = map.next_value::<Option<Lenient<i64>>>()?;
                self.shape.priority_given = v.is_some();
                self.shape.priority = v.and_then(|l| l.0);
            }
            Key::ReturnLogprob => {
                self.shape.return_logprob = map.next_value::<Lenient<bool>>()?.0 == Some(true)
            }
            Key::InputEmbeds => self.embeds_present = map.next_value::<Option<Skip>>()?.is_some(),
            _ => {
                map.next_value::<Skip>()?;
            }
        }
        Ok(())
    }
}

fn key_name(k: Key) -> &'static str {
    match k {
        Key::Model => "model",
        Key::Stream => "stream",
        Key::Messages => "messages",
        Key::Prompt => "prompt",
        Key::Text => "text",
        Key::InputIds => "input_ids",
        Key::InputEmbeds => "input_embeds",
        Key::Input => "input",
        Key::Query => "query",
        Key::Instructions => "instructions",
        Key::System => "system",
        Key::CacheSalt => "cache_salt",
        Key::LoraPath => "lora_path",
        Key::Extra => "extra_key",
        Key::N => "n",
        Key::SamplingParams => "sampling_params",
        Key::ReturnLogprob => "return_logprob",
        Key::Priority => "priority",
        Key::TokenIds => "token_ids",
        Key::Content | Key::ReasoningContent | Key::Type | Key::Output | Key::Other => "?",
    }
}

/// `first` then `then`, joined by a space (as pieces are): borrowed when only one has text.
fn joined<'a>(first: Sink<'a>, then: Sink<'a>) -> Cow<'a, str> {
    if first.pieces == 0 {
        return then.finish();
    }
    if then.pieces == 0 || first.cut {
        return first.finish();
    }
    let (a, b) = (first.finish(), then.finish());
    let mut out = String::with_capacity((a.len() + 1 + b.len()).min(MAX_ROUTING_TEXT));
    out.push_str(&a);
    out.push_str(capped(" ", MAX_ROUTING_TEXT - out.len()));
    out.push_str(capped(&b, MAX_ROUTING_TEXT - out.len()));
    Cow::Owned(out)
}

/// Parse `body` as JSON and borrow the routing inputs for `api`. Memory is the body plus at
/// most [`MAX_ROUTING_TEXT`] bytes of text (and the model name when it has escapes), whatever
/// the body holds.
pub fn extract(api: Api, body: &[u8]) -> Result<RoutingInfo<'_>, ExtractError> {
    extract_for(api, body, true)
}

/// [`extract`], building the routing text only when `keep_text` (the policy reads it): without
/// it the body is validated exactly as much and `text` is empty, so policies that never look at
/// the prompt pay no copy of it.
pub fn extract_for(
    api: Api,
    body: &[u8],
    keep_text: bool,
) -> Result<RoutingInfo<'_>, ExtractError> {
    extract_on(api, body, keep_text, json::Kernel::detected())
}

/// [`extract_for`] on a given kernel: the tests run every kernel this CPU has on the same
/// bodies, so the portable path is checked on a machine whose best path is a vector one.
fn extract_on(
    api: Api,
    body: &[u8],
    keep_text: bool,
    kernel: json::Kernel,
) -> Result<RoutingInfo<'_>, ExtractError> {
    let mut de = json::Deserializer::on(body, kernel);
    let top = Top {
        api,
        keep_text,
        body_len: body.len(),
    };
    let parsed = top
        .deserialize(&mut de)
        .and_then(|p| de.end().map(|()| p))
        .map_err(|e| refusal(body, e))?;
    finish(api, parsed)
}

/// The answer to a refused body. A body that is not UTF-8 is told so whatever else is wrong
/// with it (the parser checks UTF-8 only in the strings it reaches, and stops at the first
/// fault), so the whole body is checked here, on the error path only.
fn refusal(body: &[u8], e: json::Error) -> ExtractError {
    if let Err(u) = std::str::from_utf8(body) {
        return ExtractError(format!(
            "invalid JSON in request body: not UTF-8 at byte {}",
            u.valid_up_to()
        ));
    }
    ExtractError(if e.is_syntax() {
        format!("invalid JSON in request body: {e}")
    } else {
        format!("invalid request body: {e}")
    })
}

/// The routing inputs from what the top-level object gave (any JSON parser's `Parsed`).
fn finish(api: Api, parsed: Parsed<'_>) -> Result<RoutingInfo<'_>, ExtractError> {
    let required = |what: &str| Err(ExtractError(format!("`{what}` is required")));
    let token_ids = match api {
        Api::Generate => !parsed.present && parsed.ids_present,
        Api::Completions => parsed.prompt_ids,
        Api::TokenGenerate => true,
        _ => false,
    };
    let text = match api {
        Api::TokenGenerate if !parsed.present => return required("token_ids"),
        Api::Chat | Api::Messages if !parsed.present => return required("messages"),
        Api::Completions if !parsed.present => return required("prompt"),
        Api::Generate if !parsed.present => {
            if parsed.ids_present {
                parsed.ids.finish()
            } else if parsed.embeds_present {
                Cow::Borrowed("")
            } else {
                return Err(ExtractError(
                    "one of `text`, `input_ids` or `input_embeds` is required".into(),
                ));
            }
        }
        Api::Responses | Api::Messages => joined(parsed.pre, parsed.text),
        _ => parsed.text.finish(),
    };
    // Token-id texts are marked too: the KV-event index namespaces their ids by itself, but
    // the text tree (a fallback, or the only tree without `--kv-events`) would otherwise match
    // one tenant's or adapter's ids against another's, blocks no engine shares between them.
    // Readers of the ids take the marker off ([`without_marker`]).
    let text = match parsed.namespace.marker() {
        Some(mut m) if !text.is_empty() => {
            m.push_str(capped(&text, MAX_ROUTING_TEXT.saturating_sub(m.len())));
            Cow::Owned(m)
        }
        _ => text,
    };
    Ok(RoutingInfo {
        // An empty model name means "no model": one default tree, as when the field is absent.
        model: parsed.model.filter(|m| !m.is_empty()),
        stream: parsed.stream.unwrap_or(false),
        text: text.into(),
        token_ids,
        namespace: parsed.namespace,
        shape: parsed.shape,
    })
}

#[cfg(test)]
mod tests;

/// The same extraction on serde_json's parser: the oracle the body parser ([`json`]) is checked
/// against, body for body.
#[cfg(test)]
pub(crate) fn extract_serde_json(
    api: Api,
    body: &[u8],
    keep_text: bool,
) -> Result<RoutingInfo<'_>, ExtractError> {
    // serde_json's skip does not bound its recursion: the oracle counts depth itself first.
    if nesting_depth(body) > MAX_NESTING as usize {
        return Err(ExtractError("nested too deep".into()));
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let top = Top {
        api,
        keep_text,
        body_len: body.len(),
    };
    let parsed = top
        .deserialize(&mut de)
        .map_err(|e| ExtractError(e.to_string()))?;
    de.end().map_err(|e| ExtractError(e.to_string()))?;
    finish(api, parsed)
}

/// Deepest nesting of brackets outside strings, byte by byte (the oracle's own bound).
#[cfg(test)]
fn nesting_depth(body: &[u8]) -> usize {
    let (mut depth, mut deepest, mut in_string, mut escaped) = (0usize, 0, false, false);
    for &c in body {
        if in_string {
            match c {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

#[cfg(test)]
mod parser_agreement;
