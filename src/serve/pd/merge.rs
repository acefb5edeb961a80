//! Input logprobs in PD mode: the prefill worker computed the prompt, so its answer carries the
//! prompt's `meta_info.input_token_logprobs`; the decode worker's carries only what it saw.
//! For a `/generate` that asked for them (`return_logprob`), the client gets the decode answer
//! with prefill's input logprobs put in front of decode's, as the reference does: the whole
//! answer when it is not streamed, each event's `meta_info` when it is. Pure: answers in,
//! answer out.
//!
//! Nothing here builds a JSON tree. A document is checked once with serde (`IgnoredAny`, which
//! allocates nothing), then a span scanner finds the list's brackets in it, and prefill's list
//! items are copied as bytes between decode's `[` and its own items: every other byte of the
//! decode answer (key order, number forms, spacing, escapes) reaches the client as the worker
//! wrote it. A streamed prefill's lists are cut out once; each decode event then costs a scan
//! of that (small) event and a copy of the bytes, never a parse or a render of the prompt's list.
//!
//! How much of each answer the gateway buffers is bounded by what a correct answer to *this*
//! request can weigh ([`AnswerBound`]), not only by the flat `MAX_BUFFERED_ANSWER`.

use crate::base::json_span::{elements, members, skip_ws, Member};
use bytes::{BufMut, Bytes, BytesMut};
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use std::fmt;

/// The field merged, inside each answer's `meta_info`.
const FIELD: &[u8] = b"input_token_logprobs";

/// The object that holds [`FIELD`] in each answer item.
const META: &[u8] = b"meta_info";

/// A streamed item's position in a batch (SGLang's `index`).
const INDEX: &[u8] = b"index";

// ---------------------------------------------------------------------------------------------
// The bound: how large a correct answer to one request can be.
// ---------------------------------------------------------------------------------------------

/// Tokens a server may add to a prompt of its own (BOS, EOS, a system prefix of special
/// tokens): allowed on top of every prompt's measured length.
const SPECIAL_TOKENS: u64 = 16;

/// Bytes of one JSON number as a server writes it: a float's shortest round-trip form is at most
/// 24 bytes (`-2.2250738585072014e-308`), an integer id at most 20 (`-9223372036854775808`),
/// `-Infinity` 9.
const NUMBER: u64 = 24;

/// Longest text of one token, in bytes: the longest tokens of common vocabularies are runs of
/// spaces, dashes or `=` of at most a few hundred bytes.
const MAX_TOKEN_TEXT: u64 = 256;

/// One token's text as a JSON string: its quotes, and every byte escaped at worst (`\u00XX`, 6
/// bytes: a control byte, or a stray byte decoded to U+FFFD by an ASCII-only writer).
const TEXT: u64 = 2 + 6 * MAX_TOKEN_TEXT;

/// `null` (the text of an entry when `return_text_in_logprobs` is off).
const NULL: u64 = 4;

/// The punctuation of one `[logprob, token_id, text]` entry written with a space after each
/// comma (Python's default separators), and the comma and space that follow it in its list.
const ENTRY_PUNCT: u64 = 8;

/// Per position, the brackets and separators of its top-logprobs and token-ids lists (or the
/// `null`s that stand for them), in the input and output families alike.
const POSITION_LISTS: u64 = 16;

/// Everything in one answer item whose size does not follow the token counts: `id`,
/// `finish_reason`, the token counters, latencies, speculative-decoding counters, weight
/// version, keys and separators of every field.
const ITEM_FIXED: u64 = 64 << 10;

/// Output tokens a prefill server makes: SGLang's computes the prompt and samples exactly one
/// token (decode generates the rest); four leave room.
const PREFILL_OUTPUT_TOKENS: u64 = 4;

/// Framing of one item: a server-sent event's `data: ` and blank line (or, in a JSON batch, the
/// comma and space between items).
const SSE_EVENT: u64 = 8;

/// Framing of the whole answer: a stream's `data: [DONE]` (and room for a keep-alive comment),
/// or a JSON batch's brackets.
const SSE_END: u64 = 64;

/// What of a `/generate` request with `return_logprob` decides how large a correct answer to it
/// can be. The gateway knows the request, so it can refuse to buffer more than a worker could
/// legitimately send for it: a prompt of 50 tokens has no business producing a 256 MiB answer.
///
/// The formula, in bytes (every product and sum saturating):
///
/// - a prompt's tokens `U` ≤ its `input_ids` count, or its text's UTF-8 bytes (a byte-level BPE
///   or a SentencePiece vocabulary with byte fallback makes at most one token per byte), plus
///   [`SPECIAL_TOKENS`];
/// - an entry `[logprob, token_id, text]`: `E = 8 + 2·24 + (1538 if return_text_in_logprobs
///   else 4)`: two numbers, a token's text escaped at worst, punctuation;
/// - a position: `P = E·(1 + top_logprobs_num + len(token_ids_logprob)) + 16` (its entry, its
///   top-logprobs list, its token-ids list);
/// - an output token: `O = P + 1538 + 26` (its logprob families, its share of `text`, its
///   `output_ids` number);
/// - an item with `out` output tokens: `I = 64 KiB + echo + (U − logprob_start_len)·P + out·O`,
///   where `echo` is the bytes of the request's `sampling_params` and `rid` (a matched stop
///   string, the id: anything of the request an answer repeats);
/// - an answer: `Σ over prompts of n · events · (I + 8) + 64` with `n` the samples per prompt
///   (`sampling_params.n`) and `events` 1 for a JSON answer, `out + 2` for a stream (SGLang
///   repeats the whole lists in every event of an item).
///
/// Prefill's answer has `out` = [`PREFILL_OUTPUT_TOKENS`]; decode's has `max_new_tokens`, and
/// none when the request sets none (its server's default is not knowable here). The entry
/// allowances are about three times what a real entry weighs, so a tokenizer whose normalizer
/// expands some rare characters still fits.
///
/// A request the formula cannot see through (images, audio, video or embeddings as the prompt,
/// any `return_*` flag besides the logprob ones, such as hidden states, fields of unexpected
/// types) has no bound of its own: [`AnswerBound::of`] says `None`, and only the flat cap holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnswerBound {
    /// An upper bound on each prompt's tokens (special tokens included).
    prompts: Vec<u64>,
    /// `logprob_start_len`: the least one given, 0 when absent or negative (the whole prompt).
    start: u64,
    /// `top_logprobs_num`: the largest one given.
    top: u64,
    /// Entries of `token_ids_logprob`: the longest list given.
    ids: u64,
    /// `return_text_in_logprobs`: every entry carries its token's text.
    text: bool,
    /// Samples per prompt (`sampling_params.n`, the largest given).
    n: u64,
    /// `sampling_params.max_new_tokens` (the largest), when every item sets it.
    max_new: Option<u64>,
    /// Bytes of the request an answer item may repeat.
    echo: u64,
}

impl AnswerBound {
    /// The bound's inputs from a `/generate` body; `None` when the body's answer cannot be
    /// bounded by it (see the type's documentation).
    pub fn of(body: &[u8]) -> Option<AnswerBound> {
        let req = serde_json::from_slice::<Req>(body).ok()?;
        if req.unbounded {
            return None;
        }
        let prompts = match (req.text, req.input_ids) {
            (Some(p), None) | (None, Some(p)) => p,
            _ => return None,
        };
        let (max_new, n) = req.sampling.unwrap_or((None, 1));
        // The body is a valid JSON object here (serde just read all of it).
        let top = skip_ws(body, 0);
        let echo = members(body, top)
            .filter(|m| m.key == b"sampling_params" || m.key == b"rid")
            .map(|m| m.end.saturating_sub(m.start) as u64)
            .sum();
        Some(AnswerBound {
            prompts: prompts
                .into_iter()
                .map(|p| p.saturating_add(SPECIAL_TOKENS))
                .collect(),
            start: req.start.map_or(0, |s| u64::try_from(s).unwrap_or(0)),
            top: req.top.unwrap_or(0),
            ids: req.ids.unwrap_or(0),
            text: req.text_in_logprobs,
            n: n.max(1),
            max_new,
            echo,
        })
    }

    /// The largest prefill answer: streamed as events, or one JSON answer.
    pub fn prefill(&self, streamed: bool) -> u64 {
        self.answer(PREFILL_OUTPUT_TOKENS, streamed)
    }

    /// The largest non-streamed decode answer; `None` without `max_new_tokens`.
    pub fn decode(&self) -> Option<u64> {
        self.max_new.map(|out| self.answer(out, false))
    }

    /// `E`: one `[logprob, token_id, text]` entry and its separator.
    fn entry(&self) -> u64 {
        ENTRY_PUNCT + 2 * NUMBER + if self.text { TEXT } else { NULL }
    }

    /// `P`: one position's entry, top-logprobs list and token-ids list.
    fn position(&self) -> u64 {
        let lists = 1u64.saturating_add(self.top).saturating_add(self.ids);
        self.entry()
            .saturating_mul(lists)
            .saturating_add(POSITION_LISTS)
    }

    /// `O`: one output token's logprob families, text and id.
    fn output_token(&self) -> u64 {
        self.position()
            .saturating_add(TEXT)
            .saturating_add(NUMBER + 2)
    }

    /// `I`: one answer item for a prompt of `tokens` tokens, with `out` output tokens.
    fn item(&self, tokens: u64, out: u64) -> u64 {
        ITEM_FIXED
            .saturating_add(self.echo)
            .saturating_add(
                tokens
                    .saturating_sub(self.start)
                    .saturating_mul(self.position()),
            )
            .saturating_add(out.saturating_mul(self.output_token()))
    }

    /// The whole answer with `out` output tokens per item.
    fn answer(&self, out: u64, streamed: bool) -> u64 {
        let events = if streamed { out.saturating_add(2) } else { 1 };
        let per_prompt = self.n.saturating_mul(events);
        self.prompts
            .iter()
            .map(|&tokens| {
                per_prompt.saturating_mul(self.item(tokens, out).saturating_add(SSE_EVENT))
            })
            .fold(SSE_END, u64::saturating_add)
    }
}

/// The fields of a `/generate` body the bound reads (everything else skipped unread).
#[derive(Default)]
struct Req {
    /// Byte lengths of the `text` prompts.
    text: Option<Vec<u64>>,
    /// Token counts of the `input_ids` prompts.
    input_ids: Option<Vec<u64>>,
    /// (`max_new_tokens` when every item sets it, largest `n`).
    sampling: Option<(Option<u64>, u64)>,
    start: Option<i64>,
    top: Option<u64>,
    ids: Option<u64>,
    text_in_logprobs: bool,
    /// A field the formula cannot account for asks for more in the answer.
    unbounded: bool,
}

/// A top-level key of a `/generate` body, as the bound sees it.
enum Key {
    Text,
    InputIds,
    SamplingParams,
    LogprobStartLen,
    TopLogprobsNum,
    TokenIdsLogprob,
    ReturnTextInLogprobs,
    ReturnLogprob,
    /// A prompt the gateway cannot count (images, audio, video, embeddings) or a `return_*`
    /// flag that adds to the answer (hidden states and the like).
    Unbounding,
    Other,
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Key, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E>(self, k: &str) -> Result<Key, E> {
                Ok(match k {
                    "text" => Key::Text,
                    "input_ids" => Key::InputIds,
                    "sampling_params" => Key::SamplingParams,
                    "logprob_start_len" => Key::LogprobStartLen,
                    "top_logprobs_num" => Key::TopLogprobsNum,
                    "token_ids_logprob" => Key::TokenIdsLogprob,
                    "return_text_in_logprobs" => Key::ReturnTextInLogprobs,
                    "return_logprob" => Key::ReturnLogprob,
                    "image_data" | "video_data" | "audio_data" | "input_embeds" => Key::Unbounding,
                    k if k.starts_with("return_") => Key::Unbounding,
                    _ => Key::Other,
                })
            }
        }
        d.deserialize_identifier(V)
    }
}

impl<'de> Deserialize<'de> for Req {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Req, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Req;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Req, A::Error> {
                let mut r = Req::default();
                while let Some(key) = map.next_key::<Key>()? {
                    match key {
                        Key::Text => r.text = map.next_value::<TextLens>()?.0,
                        Key::InputIds => r.input_ids = map.next_value::<Counts>()?.0,
                        Key::SamplingParams => {
                            r.sampling = map.next_value::<Sampling>()?.0;
                        }
                        Key::LogprobStartLen => {
                            r.start = map.next_value::<Ints>()?.0.into_iter().min();
                        }
                        Key::TopLogprobsNum => {
                            let most = map.next_value::<Ints>()?.0.into_iter().max();
                            r.top = most.map(|t| u64::try_from(t).unwrap_or(0));
                        }
                        Key::TokenIdsLogprob => {
                            r.ids = map.next_value::<Counts>()?.0.and_then(|c| {
                                // One list for all items, or one per item: the longest.
                                c.into_iter().max()
                            });
                        }
                        Key::ReturnTextInLogprobs => {
                            r.text_in_logprobs = map.next_value::<Truthy>()?.0;
                        }
                        Key::Unbounding => r.unbounded |= map.next_value::<Truthy>()?.0,
                        Key::ReturnLogprob | Key::Other => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(r)
            }
        }
        d.deserialize_map(V)
    }
}

/// `text`: one prompt's UTF-8 length, or each prompt's of a batch; `null` is no prompt.
struct TextLens(Option<Vec<u64>>);

impl<'de> Deserialize<'de> for TextLens {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<TextLens, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TextLens;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or a list of strings")
            }
            fn visit_str<E>(self, s: &str) -> Result<TextLens, E> {
                Ok(TextLens(Some(vec![s.len() as u64])))
            }
            fn visit_unit<E>(self) -> Result<TextLens, E> {
                Ok(TextLens(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TextLens, A::Error> {
                let mut lens = Vec::new();
                while let Some(len) = seq.next_element::<StrLen>()? {
                    lens.push(len.0);
                }
                Ok(TextLens(Some(lens)))
            }
        }
        d.deserialize_any(V)
    }
}

/// The UTF-8 length of one string.
struct StrLen(u64);

impl<'de> Deserialize<'de> for StrLen {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<StrLen, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = StrLen;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E>(self, s: &str) -> Result<StrLen, E> {
                Ok(StrLen(s.len() as u64))
            }
        }
        d.deserialize_str(V)
    }
}

/// A list of numbers (one list: its length) or a list of lists (each one's length); `null` is
/// none. `input_ids` and `token_ids_logprob` have this shape.
struct Counts(Option<Vec<u64>>);

/// One element of a [`Counts`] list: a number, or a list of that many elements.
enum CountsItem {
    Number,
    List(u64),
}

impl<'de> Deserialize<'de> for CountsItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<CountsItem, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = CountsItem;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a number or a list")
            }
            fn visit_u64<E>(self, _: u64) -> Result<CountsItem, E> {
                Ok(CountsItem::Number)
            }
            fn visit_i64<E>(self, _: i64) -> Result<CountsItem, E> {
                Ok(CountsItem::Number)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<CountsItem, A::Error> {
                let mut n = 0u64;
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    n += 1;
                }
                Ok(CountsItem::List(n))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Counts {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Counts, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Counts;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of numbers or a list of lists")
            }
            fn visit_unit<E>(self) -> Result<Counts, E> {
                Ok(Counts(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Counts, A::Error> {
                let mut numbers = 0u64;
                let mut lists = Vec::new();
                while let Some(item) = seq.next_element::<CountsItem>()? {
                    match item {
                        CountsItem::Number => numbers += 1,
                        CountsItem::List(n) => lists.push(n),
                    }
                }
                match (numbers, lists.is_empty()) {
                    (_, true) => Ok(Counts(Some(vec![numbers]))),
                    (0, false) => Ok(Counts(Some(lists))),
                    _ => Err(de::Error::custom("numbers and lists mixed")),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// An integer, or a list of them (one per item); `null` is none.
struct Ints(Vec<i64>);

impl<'de> Deserialize<'de> for Ints {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Ints, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Ints;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an integer or a list of integers")
            }
            fn visit_i64<E>(self, v: i64) -> Result<Ints, E> {
                Ok(Ints(vec![v]))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Ints, E> {
                Ok(Ints(vec![i64::try_from(v).unwrap_or(i64::MAX)]))
            }
            fn visit_unit<E>(self) -> Result<Ints, E> {
                Ok(Ints(Vec::new()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Ints, A::Error> {
                let mut all = Vec::new();
                while let Some(v) = seq.next_element::<Option<i64>>()? {
                    all.extend(v);
                }
                Ok(Ints(all))
            }
        }
        d.deserialize_any(V)
    }
}

/// Whether a flag asks for something: `false`, `null`, `0` and `""` do not; anything else does.
struct Truthy(bool);

impl<'de> Deserialize<'de> for Truthy {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Truthy, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Truthy;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_bool<E>(self, v: bool) -> Result<Truthy, E> {
                Ok(Truthy(v))
            }
            fn visit_unit<E>(self) -> Result<Truthy, E> {
                Ok(Truthy(false))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Truthy, E> {
                Ok(Truthy(v != 0))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Truthy, E> {
                Ok(Truthy(v != 0))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Truthy, E> {
                Ok(Truthy(v != 0.0))
            }
            fn visit_str<E>(self, v: &str) -> Result<Truthy, E> {
                Ok(Truthy(!v.is_empty()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Truthy, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Truthy(true))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Truthy, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Truthy(true))
            }
        }
        d.deserialize_any(V)
    }
}

/// `sampling_params` (one object, or one per item): (`max_new_tokens` when every object sets
/// it as a non-negative integer, the largest `n`). `null` is `None`.
struct Sampling(Option<(Option<u64>, u64)>);

/// One `sampling_params` object.
struct OneSampling {
    max_new: Option<u64>,
    n: u64,
}

impl<'de> Deserialize<'de> for OneSampling {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<OneSampling, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = OneSampling;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_unit<E>(self) -> Result<OneSampling, E> {
                Ok(OneSampling {
                    max_new: None,
                    n: 1,
                })
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<OneSampling, A::Error> {
                let mut s = OneSampling {
                    max_new: None,
                    n: 1,
                };
                while let Some(key) = map.next_key::<SamplingKey>()? {
                    match key {
                        SamplingKey::MaxNew => {
                            s.max_new = map
                                .next_value::<Option<serde_json::Number>>()?
                                .and_then(|n| n.as_u64());
                        }
                        SamplingKey::N => {
                            s.n = map
                                .next_value::<Option<serde_json::Number>>()?
                                .and_then(|n| n.as_u64())
                                .unwrap_or(1);
                        }
                        SamplingKey::Other => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(s)
            }
        }
        d.deserialize_any(V)
    }
}

enum SamplingKey {
    MaxNew,
    N,
    Other,
}

impl<'de> Deserialize<'de> for SamplingKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<SamplingKey, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = SamplingKey;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E>(self, k: &str) -> Result<SamplingKey, E> {
                Ok(match k {
                    "max_new_tokens" => SamplingKey::MaxNew,
                    "n" => SamplingKey::N,
                    _ => SamplingKey::Other,
                })
            }
        }
        d.deserialize_identifier(V)
    }
}

impl<'de> Deserialize<'de> for Sampling {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Sampling, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Sampling;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object or a list of objects")
            }
            fn visit_unit<E>(self) -> Result<Sampling, E> {
                Ok(Sampling(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Sampling, A::Error> {
                let one = OneSampling::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(Sampling(Some((one.max_new, one.n))))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Sampling, A::Error> {
                let mut max_new = Some(0u64);
                let mut n = 1u64;
                let mut any = false;
                while let Some(one) = seq.next_element::<OneSampling>()? {
                    any = true;
                    max_new = max_new.zip(one.max_new).map(|(a, b)| a.max(b));
                    n = n.max(one.n);
                }
                Ok(Sampling(Some((max_new.filter(|_| any), n))))
            }
        }
        d.deserialize_any(V)
    }
}

// ---------------------------------------------------------------------------------------------
// Spans: where things are in a JSON document already known to be valid.
// ---------------------------------------------------------------------------------------------

/// Whether `doc` is one valid JSON value in UTF-8 (checked by serde without building it: the
/// span functions below rely on it).
fn is_json(doc: &[u8]) -> bool {
    std::str::from_utf8(doc).is_ok_and(|s| serde_json::from_str::<IgnoredAny>(s).is_ok())
}

/// The last member named `key` of the object at `open` (a JSON parser keeps the last of
/// duplicates, and so did the merge when it built values).
fn last_member<'a>(doc: &'a [u8], open: usize, key: &[u8]) -> Option<Member<'a>> {
    members(doc, open).filter(|m| m.key == key).last()
}

/// The bytes between the brackets of the list spanning `start..end`, without the whitespace at
/// either end.
fn list_items(doc: &[u8], start: usize, end: usize) -> &[u8] {
    let from = skip_ws(doc, start + 1);
    let mut to = end.saturating_sub(1).max(from);
    while to > from && doc.get(to - 1).is_some_and(u8::is_ascii_whitespace) {
        to -= 1;
    }
    doc.get(from..to).unwrap_or_default()
}

/// Where one answer item (the object at `open`) keeps its input logprobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    /// `meta_info` has the field as a list spanning `start..end`.
    List { start: usize, end: usize },
    /// `meta_info` has the field with another value (`null`) spanning `start..end`.
    Other { start: usize, end: usize },
    /// `meta_info` has no such field: its closing brace is at `close`.
    Absent { close: usize, empty: bool },
}

impl Slot {
    /// The bytes of the document this slot's rewrite replaces (empty for an insertion).
    fn range(self) -> (usize, usize) {
        match self {
            Slot::List { start, end } | Slot::Other { start, end } => (start, end),
            Slot::Absent { close, .. } => (close, close),
        }
    }
}

/// The input-logprobs slot of the item at `open`, when it is an object with a `meta_info`
/// object (the last `meta_info`, as a parser would keep).
fn slot(doc: &[u8], open: usize) -> Option<Slot> {
    let meta = last_member(doc, open, META)?;
    if doc.get(meta.start) != Some(&b'{') {
        return None;
    }
    Some(match last_member(doc, meta.start, FIELD) {
        Some(f) if doc.get(f.start) == Some(&b'[') => Slot::List {
            start: f.start,
            end: f.end,
        },
        Some(f) => Slot::Other {
            start: f.start,
            end: f.end,
        },
        None => Slot::Absent {
            close: meta.end.saturating_sub(1),
            empty: members(doc, meta.start).next().is_none(),
        },
    })
}

/// The items of the input-logprobs list of the item at `open`, when it has one.
fn own_list(doc: &[u8], open: usize) -> Option<&[u8]> {
    match slot(doc, open)? {
        Slot::List { start, end } => Some(list_items(doc, start, end)),
        _ => None,
    }
}

/// The item's `index` (its place in a streamed batch), when it is a non-negative integer.
fn item_index(doc: &[u8], open: usize) -> Option<usize> {
    let m = last_member(doc, open, INDEX)?;
    let digits = std::str::from_utf8(doc.get(m.start..m.end)?).ok()?;
    digits
        .parse::<u64>()
        .ok()
        .map(|i| usize::try_from(i).unwrap_or(usize::MAX))
}

/// Write the rewrite of `slot` in `doc`: `prefill` (list items, as bytes) in front of the list's
/// own items.
fn write_slot(out: &mut impl BufMut, doc: &[u8], slot: Slot, prefill: &[u8]) {
    match slot {
        Slot::List { start, end } => {
            let own = list_items(doc, start, end);
            out.put_u8(b'[');
            out.put_slice(prefill);
            if !prefill.is_empty() && !own.is_empty() {
                out.put_u8(b',');
            }
            out.put_slice(own);
            out.put_u8(b']');
        }
        Slot::Other { .. } => {
            out.put_u8(b'[');
            out.put_slice(prefill);
            out.put_u8(b']');
        }
        Slot::Absent { empty, .. } => {
            if !empty {
                out.put_u8(b',');
            }
            out.put_u8(b'"');
            out.put_slice(FIELD);
            out.put_slice(b"\":[");
            out.put_slice(prefill);
            out.put_u8(b']');
        }
    }
}

/// `doc` with each (slot, prefill items) rewritten, into `out`. The slots come in document
/// order; `None` (nothing usable written) if they do not.
fn write_spliced(out: &mut impl BufMut, doc: &[u8], edits: &[(Slot, &[u8])]) -> Option<()> {
    let mut at = 0;
    for &(slot, prefill) in edits {
        let (from, to) = slot.range();
        out.put_slice(doc.get(at..from)?);
        write_slot(out, doc, slot, prefill);
        at = to;
    }
    out.put_slice(doc.get(at..)?);
    Some(())
}

/// Bytes a set of rewrites may add (for one allocation of the right size).
fn spliced_capacity(doc: &[u8], edits: &[(Slot, &[u8])]) -> usize {
    let added: usize = edits.iter().map(|(_, p)| p.len() + FIELD.len() + 8).sum();
    doc.len() + added
}

// ---------------------------------------------------------------------------------------------
// The merges.
// ---------------------------------------------------------------------------------------------

/// Put `prefill`'s input logprobs in front of `decode`'s, item by item (a batched request's
/// answer is a list), as bytes. Returns the merged answer (decode's bytes but for the lists'
/// insides), or `None` when either answer is not JSON of the expected shape (the decode answer
/// then goes out unchanged).
pub fn merge_input_logprobs(prefill: &[u8], decode: &[u8]) -> Option<Vec<u8>> {
    if !is_json(prefill) || !is_json(decode) {
        return None;
    }
    let (p, d) = (skip_ws(prefill, 0), skip_ws(decode, 0));
    let pairs: Vec<(usize, usize)> = match (prefill.get(p), decode.get(d)) {
        (Some(b'['), Some(b'[')) => {
            let (ps, ds) = (elements(prefill, p), elements(decode, d));
            if ps.len() != ds.len() {
                return None;
            }
            ps.into_iter().zip(ds).collect()
        }
        (Some(b'{'), Some(b'{')) => vec![(p, d)],
        _ => return None,
    };
    let edits: Vec<(Slot, &[u8])> = pairs
        .into_iter()
        .filter_map(|(pi, di)| Some((slot(decode, di)?, own_list(prefill, pi)?)))
        .collect();
    let mut out = Vec::with_capacity(spliced_capacity(decode, &edits));
    write_spliced(&mut out, decode, &edits)?;
    Some(out)
}

/// Items of a batch whose input logprobs are merged (a bound on what a worker's answer can make
/// the gateway allocate).
const MAX_ITEMS: usize = 4096;

/// Prefill's input logprobs per item (`index`), each as the bytes between its list's brackets:
/// cut out of prefill's answer once, copied into every decode event as they are.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefillLists {
    items: Vec<Bytes>,
}

impl PrefillLists {
    /// Keep the list of the item at `open` of `doc` (`default_index` without an `index`).
    fn keep(&mut self, doc: &[u8], open: usize, default_index: usize) {
        let Some(list) = own_list(doc, open) else {
            return;
        };
        let i = item_index(doc, open).unwrap_or(default_index);
        if i >= MAX_ITEMS {
            return;
        }
        if self.items.len() <= i {
            self.items.resize(i + 1, Bytes::new());
        }
        self.items[i] = Bytes::copy_from_slice(list);
    }
}

/// The input logprobs a streamed prefill answer reported, per item (`index`; 0 without one):
/// the last event of each item that carries `meta_info.input_token_logprobs` (SGLang repeats
/// the whole list in an item's events). A non-streamed answer (JSON, one object or a batch's
/// list) works too.
pub fn prefill_input_logprobs(prefill: &[u8]) -> PrefillLists {
    let mut lists = PrefillLists::default();
    if is_json(prefill) {
        let top = skip_ws(prefill, 0);
        match prefill.get(top) {
            Some(b'[') => {
                for (i, item) in elements(prefill, top).into_iter().enumerate() {
                    lists.keep(prefill, item, i);
                }
            }
            _ => lists.keep(prefill, top, 0),
        }
        return lists;
    }
    for event in events(prefill) {
        match data_payload(event) {
            Payload::None => {}
            Payload::Line { start, end } => {
                let Some(json) = event.get(start..end) else {
                    continue;
                };
                if is_json(json) {
                    lists.keep(json, skip_ws(json, 0), 0);
                }
            }
            Payload::Joined(json) => {
                if is_json(&json) {
                    lists.keep(&json, skip_ws(&json, 0), 0);
                }
            }
        }
    }
    lists
}

/// The events of a stream: its bytes cut at blank lines (`\n\n`).
fn events(stream: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = stream;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let end = rest
            .windows(2)
            .position(|w| w == b"\n\n")
            .map_or(rest.len(), |p| p + 2);
        let (event, tail) = rest.split_at(end);
        rest = tail;
        Some(event)
    })
}

/// The lines of an event: (start, end) without the `\n` (nor a `\r` before it).
fn lines(event: &[u8]) -> impl Iterator<Item = (usize, usize)> + '_ {
    let mut at = 0;
    std::iter::from_fn(move || {
        if at >= event.len() {
            return None;
        }
        let start = at;
        let nl = event
            .get(start..)
            .unwrap_or_default()
            .iter()
            .position(|&c| c == b'\n')
            .map_or(event.len(), |p| start + p);
        at = nl + 1;
        let end = if nl > start && event.get(nl - 1) == Some(&b'\r') {
            nl - 1
        } else {
            nl
        };
        Some((start, end))
    })
}

/// The `data:` payload of one event.
enum Payload {
    /// No `data:` line.
    None,
    /// One `data:` line (the usual case): the payload's span within the event.
    Line { start: usize, end: usize },
    /// Several `data:` lines, joined with `\n` (SSE's own rule).
    Joined(Vec<u8>),
}

/// Where the payload of the `data:` line spanning `start..end` begins (after `data:` and one
/// optional space), when it is one.
fn data_start(event: &[u8], start: usize, end: usize) -> Option<usize> {
    let line = event.get(start..end)?;
    let rest = line.strip_prefix(b"data:")?;
    let skip = usize::from(rest.first() == Some(&b' '));
    Some(end - rest.len() + skip)
}

fn data_payload(event: &[u8]) -> Payload {
    let mut data = lines(event).filter_map(|(s, e)| Some((data_start(event, s, e)?, e)));
    let Some(first) = data.next() else {
        return Payload::None;
    };
    let Some(second) = data.next() else {
        return Payload::Line {
            start: first.0,
            end: first.1,
        };
    };
    let mut joined = Vec::new();
    for (i, (s, e)) in [first, second].into_iter().chain(data).enumerate() {
        if i > 0 {
            joined.push(b'\n');
        }
        joined.extend_from_slice(event.get(s..e).unwrap_or_default());
    }
    Payload::Joined(joined)
}

/// The rewrite of one event's JSON payload, when it is an object with a `meta_info` object
/// whose item (`index`, 0 without one) prefill reported a list for.
fn payload_edit<'l>(lists: &'l PrefillLists, json: &[u8]) -> Option<(Slot, &'l [u8])> {
    if !is_json(json) {
        return None;
    }
    let open = skip_ws(json, 0);
    let slot = slot(json, open)?;
    let i = item_index(json, open).unwrap_or(0);
    Some((slot, lists.items.get(i)?))
}

/// One decode event with prefill's input logprobs (`lists`, by item) put in front of its own, or
/// the event unchanged when it carries no JSON object with `meta_info` (`[DONE]`, comments).
/// Only the event's bytes are scanned; prefill's lists are copied as they are.
pub fn merge_event(lists: &PrefillLists, event: &[u8], out: &mut BytesMut) {
    let before = out.len();
    let merged = match data_payload(event) {
        Payload::None => None,
        Payload::Line { start, end } => event.get(start..end).and_then(|json| {
            let edit = payload_edit(lists, json)?;
            out.reserve(spliced_capacity(event, &[edit]));
            out.put_slice(event.get(..start)?);
            write_spliced(out, json, &[edit])?;
            out.put_slice(event.get(end..)?);
            Some(())
        }),
        Payload::Joined(json) => payload_edit(lists, &json).and_then(|edit| {
            // The other lines (`event:`, `id:`, comments) first, then the payload's lines.
            for (s, e) in lines(event) {
                if s < e && data_start(event, s, e).is_none() {
                    out.put_slice(event.get(s..e)?);
                    out.put_u8(b'\n');
                }
            }
            let mut spliced = Vec::with_capacity(spliced_capacity(&json, &[edit]));
            write_spliced(&mut spliced, &json, &[edit])?;
            for line in spliced.split(|&c| c == b'\n') {
                out.put_slice(b"data: ");
                out.put_slice(line);
                out.put_u8(b'\n');
            }
            out.put_u8(b'\n');
            Some(())
        }),
    };
    if merged.is_none() {
        out.truncate(before);
        out.extend_from_slice(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn merged(p: &str, d: &str) -> Option<String> {
        merge_input_logprobs(p.as_bytes(), d.as_bytes()).map(|m| String::from_utf8(m).unwrap())
    }

    #[test]
    fn prefill_items_are_spliced_in_front_and_every_other_byte_is_decode_s() {
        let p = r#"{"text":"x","meta_info":{"input_token_logprobs":[ [-1.0,1,null], [-2.5e-3, 2, null] ]}}"#;
        // Spacing, key order, number forms and escapes a re-render would change.
        let d = r#"{"text": "h\u00e9llo", "meta_info": {"id": "r", "input_token_logprobs": [ [-3.0, 3, null] ], "z": 1.50E+0}}"#;
        assert_eq!(
            merged(p, d).unwrap(),
            r#"{"text": "h\u00e9llo", "meta_info": {"id": "r", "input_token_logprobs": [[-1.0,1,null], [-2.5e-3, 2, null],[-3.0, 3, null]], "z": 1.50E+0}}"#
        );
        // Decode's list empty, null, absent, or meta_info empty.
        let cases = [
            (
                r#"{"meta_info":{"input_token_logprobs":[]}}"#,
                r#"{"meta_info":{"input_token_logprobs":[[-1.0,1,null], [-2.5e-3, 2, null]]}}"#,
            ),
            (
                r#"{"meta_info":{"input_token_logprobs": null,"k":1}}"#,
                r#"{"meta_info":{"input_token_logprobs": [[-1.0,1,null], [-2.5e-3, 2, null]],"k":1}}"#,
            ),
            (
                r#"{"meta_info":{"k":1} }"#,
                r#"{"meta_info":{"k":1,"input_token_logprobs":[[-1.0,1,null], [-2.5e-3, 2, null]]} }"#,
            ),
            (
                r#"{"meta_info":{ }}"#,
                r#"{"meta_info":{ "input_token_logprobs":[[-1.0,1,null], [-2.5e-3, 2, null]]}}"#,
            ),
        ];
        for (d, want) in cases {
            assert_eq!(merged(p, d).unwrap(), want, "{d}");
        }
        // An empty prefill list leaves decode's list as it is.
        let empty = r#"{"meta_info":{"input_token_logprobs":[ ]}}"#;
        let d = r#"{"meta_info":{"input_token_logprobs":[[-3.0,3,null]]}}"#;
        assert_eq!(merged(empty, d).unwrap(), d);
    }

    #[test]
    fn the_merge_is_what_the_value_merge_was() {
        // The merge as it was done on values, for comparison on the same inputs.
        fn by_values(p: &Value, d: &Value) -> Value {
            let mut d = d.clone();
            let from = p["meta_info"]["input_token_logprobs"].as_array().unwrap();
            let meta = d["meta_info"].as_object_mut().unwrap();
            let mut all = from.clone();
            if let Some(Value::Array(own)) = meta.get_mut("input_token_logprobs") {
                all.append(own);
            }
            meta.insert("input_token_logprobs".into(), Value::Array(all));
            d
        }
        let p = json!({"meta_info":{"input_token_logprobs":[[-1.0,1,null],[-2.0,2,"tok"]]}});
        for d in [
            json!({"text":"hello","meta_info":{"input_token_logprobs":[[-3.0,3,null]],"id":"r"}}),
            json!({"text":"hello","meta_info":{"id":"r"}}),
            json!({"text":"hello","meta_info":{"input_token_logprobs":null}}),
        ] {
            let m = merged(&p.to_string(), &d.to_string()).unwrap();
            let got: Value = serde_json::from_str(&m).unwrap();
            assert_eq!(got, by_values(&p, &d), "{m}");
        }
    }

    #[test]
    fn batches_merge_item_by_item_and_odd_shapes_are_left_alone() {
        let p = r#"[{"meta_info":{"input_token_logprobs":[1]}},{"meta_info":{}},{"meta_info":{"input_token_logprobs":[3]}}]"#;
        let d = r#"[ {"meta_info":{}}, {"meta_info":{"input_token_logprobs":[2]}}, {"text":"no meta"} ]"#;
        assert_eq!(
            merged(p, d).unwrap(),
            r#"[ {"meta_info":{"input_token_logprobs":[1]}}, {"meta_info":{"input_token_logprobs":[2]}}, {"text":"no meta"} ]"#
        );
        // Nothing to merge: decode's bytes as they came.
        let plain = r#"{"text":"t", "meta_info":{"id":"x"}}"#;
        assert_eq!(merged(r#"{"meta_info":{}}"#, plain).unwrap(), plain);
        assert_eq!(merged(r#"{"text":"p"}"#, plain).unwrap(), plain);
        let no_meta = r#"{"text":"t","meta_info":"odd"}"#;
        assert_eq!(
            merged(r#"{"meta_info":{"input_token_logprobs":[1]}}"#, no_meta).unwrap(),
            no_meta
        );
        // Shapes that do not pair, and garbage: no merge at all.
        assert!(merged("[1]", "{}").is_none());
        assert!(merged("[{},{}]", "[{}]").is_none());
        assert!(merged("not json", "{}").is_none());
        assert!(merged("{}", r#"{"meta_info":{"input_token_logprobs":[1,]}}"#).is_none());
        assert!(merged("{}", "{} trailing").is_none());
        assert!(merged(r#"{"meta_info":{"input_token_logprobs":[1]}}"#, "[1, 2").is_none());
        assert!(
            merge_input_logprobs(b"{}", b"{\"t\":\"\xff\"}").is_none(),
            "not UTF-8"
        );
    }

    #[test]
    fn strings_escapes_and_duplicate_keys_do_not_fool_the_scanner() {
        // Keys and brackets inside strings, escaped quotes, and a duplicate meta_info (a parser
        // keeps the last one, so the merge goes there).
        let p = r#"{"text":"\"meta_info\":{\"input_token_logprobs\":[9]}","meta_info":{"note":"]}[{","input_token_logprobs":[[-1,1,"a\"]b"]]}}"#;
        let d = r#"{"meta_info":{"input_token_logprobs":[0]},"text":"{\"meta_info\":[","meta_info":{"input_token_logprobs":[[-2,2,"\\"]]}}"#;
        assert_eq!(
            merged(p, d).unwrap(),
            r#"{"meta_info":{"input_token_logprobs":[0]},"text":"{\"meta_info\":[","meta_info":{"input_token_logprobs":[[-1,1,"a\"]b"],[-2,2,"\\"]]}}"#
        );
    }

    #[test]
    fn stream_events_get_the_prefill_logprobs_of_their_item_as_bytes() {
        let prefill = b"data: {\"text\":\"\",\"meta_info\":{\"input_token_logprobs\":[[-1.0,1,null]]}}\n\n\
            data: {\"text\":\"x\",\"meta_info\":{\"input_token_logprobs\":[[-1.0,1,null], [-2.0,2,null]]}}\n\n\
            data: {\"index\":2,\"meta_info\":{\"input_token_logprobs\":[[-7.0,7,null]]}}\n\n\
            data: [DONE]\n\n";
        let lists = prefill_input_logprobs(prefill);
        assert_eq!(
            lists.items,
            vec![
                Bytes::from_static(b"[-1.0,1,null], [-2.0,2,null]"),
                Bytes::new(),
                Bytes::from_static(b"[-7.0,7,null]"),
            ]
        );
        let event = |e: &[u8]| {
            let mut out = BytesMut::new();
            merge_event(&lists, e, &mut out);
            String::from_utf8(out.to_vec()).unwrap()
        };
        assert_eq!(
            event(b"data: {\"text\":\"he\", \"meta_info\":{\"input_token_logprobs\":[],\"id\":\"r\"}}\n\n"),
            "data: {\"text\":\"he\", \"meta_info\":{\"input_token_logprobs\":[[-1.0,1,null], [-2.0,2,null]],\"id\":\"r\"}}\n\n"
        );
        // Other fields of the event stay where they were; the item's index picks its list.
        assert_eq!(
            event(b"id: 4\r\ndata:{\"index\":2,\"meta_info\":{\"input_token_logprobs\":[[-8.0,8,null]]}}\r\n\n"),
            "id: 4\r\ndata:{\"index\":2,\"meta_info\":{\"input_token_logprobs\":[[-7.0,7,null],[-8.0,8,null]]}}\r\n\n"
        );
        // An item prefill reported nothing for, below the last reported one: an empty list.
        assert_eq!(
            event(b"data: {\"index\":1,\"meta_info\":{}}\n\n"),
            "data: {\"index\":1,\"meta_info\":{\"input_token_logprobs\":[]}}\n\n"
        );
        // A payload over several data: lines (SSE joins them with newlines).
        assert_eq!(
            event(b"event: x\ndata: {\"meta_info\":\ndata: {\"input_token_logprobs\":[]}}\n\n"),
            "event: x\ndata: {\"meta_info\":\ndata: {\"input_token_logprobs\":[[-1.0,1,null], [-2.0,2,null]]}}\n\n"
        );
        // The end of the stream, comments and odd events go out as they came.
        for e in [
            &b"data: [DONE]\n\n"[..],
            b": keep-alive\n\n",
            b"data: {\"x\":1}\n\n",
            b"data: {\"index\":3,\"meta_info\":{}}\n\n",
            b"data: {\"meta_info\":{\"input_token_logprobs\":[1,]}}\n\n",
            b"data: {\"meta_info\":[]}\n\n",
            b"\n\n",
        ] {
            let mut out = BytesMut::from(&b"before"[..]);
            merge_event(&lists, e, &mut out);
            assert_eq!(&out[6..], e, "{}", String::from_utf8_lossy(e));
            assert_eq!(&out[..6], b"before");
        }
        // A non-streamed prefill answer gives the same lists; a batch's by position.
        let json = br#"{"meta_info":{"input_token_logprobs":[[-1.0,1,null], [-2.0,2,null]]}}"#;
        assert_eq!(prefill_input_logprobs(json).items, lists.items[..1]);
        let batch = br#"[{"meta_info":{"input_token_logprobs":[1]}},{"meta_info":{"input_token_logprobs":[2]}}]"#;
        assert_eq!(
            prefill_input_logprobs(batch).items,
            vec![Bytes::from_static(b"1"), Bytes::from_static(b"2")]
        );
        assert!(prefill_input_logprobs(b"garbage").items.is_empty());
        assert!(prefill_input_logprobs(
            b"data: {\"index\":99999,\"meta_info\":{\"input_token_logprobs\":[1]}}\n\n"
        )
        .items
        .is_empty());
    }

    #[test]
    fn the_event_path_copies_prefill_lists_without_parsing_them() {
        // Bytes no JSON parser would take: an event path that parsed or re-rendered prefill's
        // list would fail on them; the splice copies them as they are.
        let lists = PrefillLists {
            items: vec![Bytes::from_static(b"@not json, never parsed@")],
        };
        let mut out = BytesMut::new();
        merge_event(
            &lists,
            b"data: {\"meta_info\":{\"input_token_logprobs\":[[-3.0,3,null]]}}\n\n",
            &mut out,
        );
        assert_eq!(
            &out[..],
            b"data: {\"meta_info\":{\"input_token_logprobs\":[@not json, never parsed@,[-3.0,3,null]]}}\n\n"
        );
    }

    fn bound(body: &str) -> AnswerBound {
        AnswerBound::of(body.as_bytes()).unwrap_or_else(|| panic!("bounded: {body}"))
    }

    #[test]
    fn the_bound_follows_the_prompt_and_the_logprob_options() {
        let ids = |n: usize| {
            let ids: Vec<usize> = (0..n).collect();
            format!(
                r#"{{"input_ids":{ids:?},"return_logprob":true,"sampling_params":{{"max_new_tokens":8}}}}"#
            )
        };
        let (small, large) = (bound(&ids(5)), bound(&ids(5000)));
        // The formula, spelled out for the small one: 5 + 16 tokens, entries of 8 + 48 + 4 bytes.
        let echo = r#"{"max_new_tokens":8}"#.len() as u64;
        let position = 60 + 16;
        let item = (64 << 10) + echo + 21 * position + 4 * (position + 1538 + 26);
        assert_eq!(small.prefill(false), item + 8 + 64);
        assert_eq!(small.prefill(true), 6 * (item + 8) + 64);
        assert!(
            small.prefill(false) < 100 << 10,
            "a few tokens: ~100 KiB, not 256 MiB"
        );
        assert_eq!(large.prefill(false) - small.prefill(false), 4995 * position);
        assert_eq!(
            small.decode(),
            Some((64 << 10) + echo + 21 * position + 8 * (position + 1538 + 26) + 8 + 64)
        );
        // A text prompt counts its UTF-8 bytes (escapes undone); a batch sums its prompts.
        let text = bound(r#"{"text":"h\u00e9llo","return_logprob":true}"#);
        assert_eq!(text.prompts, vec![6 + 16]);
        let batch = bound(r#"{"text":["ab","abcd"],"return_logprob":true}"#);
        assert_eq!(batch.prompts, vec![2 + 16, 4 + 16]);
        let ids_batch = bound(r#"{"input_ids":[[1,2,3],[4]],"return_logprob":true}"#);
        assert_eq!(ids_batch.prompts, vec![3 + 16, 1 + 16]);
        // logprob_start_len shrinks it; text in logprobs, top logprobs, token-id logprobs and
        // parallel samples grow it.
        let base = bound(r#"{"input_ids":[1,2,3,4,5,6,7,8],"return_logprob":true}"#);
        let grown = |extra: &str| {
            bound(&format!(
                r#"{{"input_ids":[1,2,3,4,5,6,7,8],"return_logprob":true,{extra}}}"#
            ))
            .prefill(false)
        };
        assert!(grown(r#""logprob_start_len":6"#) < base.prefill(false));
        assert_eq!(grown(r#""logprob_start_len":-1"#), base.prefill(false));
        assert!(grown(r#""return_text_in_logprobs":true"#) > base.prefill(false));
        assert!(grown(r#""top_logprobs_num":5"#) > grown(r#""top_logprobs_num":1"#));
        assert!(grown(r#""token_ids_logprob":[1,2,3]"#) > base.prefill(false));
        assert!(grown(r#""sampling_params":{"n":3}"#) > 2 * grown(r#""sampling_params":{"n":1}"#));
        assert!(base.prefill(true) > base.prefill(false));
        // Decode's answer has no bound without max_new_tokens (its server's default rules).
        assert_eq!(base.decode(), None);
        assert_eq!(
            bound(r#"{"text":["a","b"],"sampling_params":[{"max_new_tokens":2},{}]}"#).decode(),
            None
        );
        assert!(
            bound(r#"{"text":"a","sampling_params":{"max_new_tokens":1000000}}"#)
                .decode()
                .is_some()
        );
        // Absurd requests saturate rather than wrap.
        let huge = bound(
            r#"{"text":"a","top_logprobs_num":18446744073709551615,"sampling_params":{"max_new_tokens":18446744073709551615,"n":18446744073709551615}}"#,
        );
        assert_eq!(huge.decode(), Some(u64::MAX));
    }

    #[test]
    fn requests_the_formula_cannot_see_through_have_no_bound() {
        for body in [
            r#"{"text":"look","image_data":"http://x/cat.png"}"#,
            r#"{"input_embeds":[[0.1,0.2]]}"#,
            r#"{"text":"a","return_hidden_states":true}"#,
            r#"{"text":"a","return_routed_experts":1}"#,
            r#"{"text":"a","input_ids":[1]}"#,
            r#"{"return_logprob":true}"#,
            r#"{"text":5}"#,
            r#"{"input_ids":[1,[2]]}"#,
            r#"{"text":"a","text":null}"#,
            r#"[{"text":"a"}]"#,
            "not json",
        ] {
            assert_eq!(AnswerBound::of(body.as_bytes()), None, "{body}");
        }
        for body in [
            r#"{"text":"a","image_data":null,"return_hidden_states":false,"return_logprob":true}"#,
            r#"{"text":"a","input_ids":null}"#,
        ] {
            assert!(AnswerBound::of(body.as_bytes()).is_some(), "{body}");
        }
    }

    /// A JSON string of `n` bytes of token text, every byte escaped (the worst case).
    fn worst_text(n: usize) -> String {
        format!("\"{}\"", "\\u0001".repeat(n))
    }

    /// A worst-case entry: the longest numbers, the text (or null), Python's separators.
    fn worst_entry(text: bool) -> String {
        let t = if text { worst_text(256) } else { "null".into() };
        format!("[-2.2250738585072014e-308, -9223372036854775808, {t}]")
    }

    fn list(items: impl Iterator<Item = String>) -> String {
        format!("[{}]", items.collect::<Vec<_>>().join(", "))
    }

    #[test]
    fn a_worst_case_answer_fits_its_bound() {
        for (text, top) in [(false, 0), (true, 0), (false, 3), (true, 2)] {
            let tokens = 40;
            let body = format!(
                r#"{{"input_ids":{:?},"return_logprob":true,"return_text_in_logprobs":{text},"top_logprobs_num":{top},"logprob_start_len":0,"sampling_params":{{"max_new_tokens":4}},"rid":"req-1"}}"#,
                vec![7; tokens]
            );
            let b = bound(&body);
            let positions = |n: usize| list((0..n).map(|_| worst_entry(text)));
            let tops = |n: usize| list((0..n).map(|_| list((0..top).map(|_| worst_entry(text)))));
            // Every token of the prompt (and the special tokens a server may add) and four
            // output tokens, each with its text, and every list of both families.
            let all_tokens = tokens + 16;
            let answer = format!(
                r#"{{"text": {}, "output_ids": {}, "meta_info": {{"id": "req-1", "finish_reason": {{"type": "length", "length": 4}}, "prompt_tokens": {all_tokens}, "completion_tokens": 4, "cached_tokens": 0, "e2e_latency": 0.123456789, "input_token_logprobs": {}, "output_token_logprobs": {}, "input_top_logprobs": {}, "output_top_logprobs": {}, "input_token_ids_logprobs": null, "output_token_ids_logprobs": null}}}}"#,
                worst_text(4 * 256),
                list((0..4).map(|_| "-9223372036854775808".to_string())),
                positions(all_tokens),
                positions(4),
                tops(all_tokens),
                tops(4),
            );
            assert!(serde_json::from_str::<Value>(&answer).is_ok());
            let real = answer.len() as u64;
            assert!(
                real <= b.prefill(false),
                "text={text} top={top}: {real} > {}",
                b.prefill(false)
            );
            let events = format!("data: {answer}\n\n").repeat(6) + "data: [DONE]\n\n";
            assert!(events.len() as u64 <= b.prefill(true));
            // The bound is generous, not absurd: within a few times the worst real answer
            // (the fixed 64 KiB per item aside).
            let variable = b.prefill(false) - (64 << 10);
            assert!(
                variable < 4 * real,
                "text={text} top={top}: {variable} vs {real}"
            );
        }
    }
}
