//! Writing HF tokenizer folders offline: a byte-level BPE `tokenizer.json` with Llama-3's
//! special tokens and post-processor, and a `tokenizer_config.json` with a Llama-3 chat
//! template. Tests build a small one ([`small_llama3_folder`]) instead of downloading a model;
//! the simulator converts its cl100k vocabulary with [`byte_level_bpe_json`] so gateway and
//! simulator can load the same realistic folder.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{json, Value};

/// Llama-3-Instruct's chat template (as its `tokenizer_config.json` ships it): BOS, then per
/// message `<|start_header_id|>{role}<|end_header_id|>\n\n{content|trim}<|eot_id|>`, then the
/// assistant header when a generation prompt is asked for.
pub const LLAMA3_TEMPLATE: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";

/// The pre-tokenizer regex of Llama-3 / GPT-4's cl100k (the classic, non-possessive spelling).
pub const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Id of `<|begin_of_text|>`; Llama-3's 256 special tokens follow from here.
pub const LLAMA3_FIRST_SPECIAL: u32 = 128_000;

/// Llama-3.1's special tokens: `(text, id)` for ids 128000..128256.
pub fn llama3_specials() -> Vec<(String, u32)> {
    let named: [(&str, u32); 8] = [
        ("<|begin_of_text|>", 0),
        ("<|end_of_text|>", 1),
        ("<|finetune_right_pad_id|>", 4),
        ("<|start_header_id|>", 6),
        ("<|end_header_id|>", 7),
        ("<|eom_id|>", 8),
        ("<|eot_id|>", 9),
        ("<|python_tag|>", 10),
    ];
    let mut out = Vec::with_capacity(256);
    let mut reserved = 0;
    for off in 0..256u32 {
        match named.iter().find(|(_, o)| *o == off) {
            Some((name, _)) => out.push((name.to_string(), LLAMA3_FIRST_SPECIAL + off)),
            None => {
                out.push((
                    format!("<|reserved_special_token_{reserved}|>"),
                    LLAMA3_FIRST_SPECIAL + off,
                ));
                reserved += 1;
            }
        }
    }
    out
}

/// GPT-2's byte → printable character table, which byte-level BPE vocabularies are written in.
pub fn byte_to_char() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(256 + extra).unwrap_or('?');
            extra += 1;
            c
        };
    }
    table
}

/// A token's bytes in the byte-level alphabet.
pub fn byte_level(bytes: &[u8], table: &[char; 256]) -> String {
    bytes.iter().map(|&b| table[b as usize]).collect()
}

/// A Llama-3-style byte-level BPE `tokenizer.json`: `vocab` (token bytes → id) and `merges`
/// (pairs of token bytes, in priority order), the pre-tokenizer regex `pattern` as a `Split`
/// followed by `ByteLevel` without its own regex, `ignore_merges` (a word that is a whole token
/// is that token, as in tiktoken), `specials` as special added tokens (also in the model
/// vocabulary, so their ids hold), and a post-processor adding `bos` to every encode with
/// special tokens.
pub fn byte_level_bpe_json(
    vocab: &[(Vec<u8>, u32)],
    merges: &[(Vec<u8>, Vec<u8>)],
    pattern: &str,
    specials: &[(String, u32)],
    bos: &str,
) -> Value {
    let table = byte_to_char();
    let mut v = serde_json::Map::with_capacity(vocab.len() + specials.len());
    for (bytes, id) in vocab {
        v.insert(byte_level(bytes, &table), json!(id));
    }
    for (text, id) in specials {
        v.insert(text.clone(), json!(id));
    }
    let merges: Vec<Value> = merges
        .iter()
        .map(|(a, b)| json!([byte_level(a, &table), byte_level(b, &table)]))
        .collect();
    let added: Vec<Value> = specials
        .iter()
        .map(|(text, id)| {
            json!({"id": id, "content": text, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let bos_id = specials.iter().find(|(t, _)| t == bos).map(|(_, id)| *id);
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]},
        "post_processor": {"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}
        ]},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": true,
                  "vocab": Value::Object(v), "merges": merges}
    })
}

/// A Llama-3 `tokenizer_config.json`: BOS / EOS (BOS in the `{"content": …}` form real configs
/// use) and `template` as the chat template.
pub fn llama3_config(template: &str) -> Value {
    json!({
        "bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": false,
                      "normalized": false, "rstrip": false, "single_word": false},
        "eos_token": "<|eot_id|>",
        "chat_template": template,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast"
    })
}

/// Writes `tokenizer.json` and `tokenizer_config.json` into `dir` (created if missing).
pub fn write_folder(dir: &Path, tokenizer: &Value, config: &Value) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("tokenizer.json"), serde_json::to_vec(tokenizer)?)?;
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_vec_pretty(config)?,
    )?;
    Ok(())
}

/// English text the small test tokenizer learns its merges from.
const CORPUS: &str = "The quick brown fox jumps over the lazy dog. A cache-aware gateway sends \
every request to the server that already holds its prompt prefix. Turn five of a chat lands \
where turns one to four were prefilled, instead of being prefilled again on a server that \
never saw them. Hello world! How are you today? I am fine, thank you, and you? The weather is \
nice and the sun is shining. Tokens, tokens everywhere: the model reads tokens and writes \
tokens. 0123456789 numbers 42 and 2024. You are a helpful assistant. Please answer the \
question below with care and give a short story with a happy ending.";

/// Learns `n` BPE merges over `text` (pre-split on spaces, a leading space kept with its word),
/// most frequent pair first, ties broken by the smaller pair: deterministic.
fn train_merges(text: &str, n: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut words: HashMap<Vec<Vec<u8>>, usize> = HashMap::new();
    let mut start = 0;
    let bytes = text.as_bytes();
    for i in 1..=bytes.len() {
        if i == bytes.len() || bytes[i] == b' ' {
            let w: Vec<Vec<u8>> = bytes[start..i].iter().map(|&b| vec![b]).collect();
            *words.entry(w).or_default() += 1;
            start = i;
        }
    }
    let mut merges = Vec::with_capacity(n);
    for _ in 0..n {
        let mut counts: HashMap<(Vec<u8>, Vec<u8>), usize> = HashMap::new();
        for (w, c) in &words {
            for pair in w.windows(2) {
                *counts
                    .entry((pair[0].clone(), pair[1].clone()))
                    .or_default() += c;
            }
        }
        let Some(best) = counts
            .into_iter()
            .filter(|(_, c)| *c >= 2)
            .max_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.cmp(&a.0)))
            .map(|(p, _)| p)
        else {
            break;
        };
        let merged: Vec<u8> = [best.0.clone(), best.1.clone()].concat();
        words = words
            .into_iter()
            .map(|(w, c)| {
                let mut out = Vec::with_capacity(w.len());
                let mut i = 0;
                while i < w.len() {
                    if i + 1 < w.len() && w[i] == best.0 && w[i + 1] == best.1 {
                        out.push(merged.clone());
                        i += 2;
                    } else {
                        out.push(w[i].clone());
                        i += 1;
                    }
                }
                (out, c)
            })
            .collect();
        merges.push(best);
    }
    merges
}

/// A small Llama-3-style tokenizer for tests: 256 byte tokens plus up to 300 merges learned
/// from a paragraph of English, Llama-3's special tokens at 128000.., BOS post-processor.
pub fn small_llama3_tokenizer_json() -> Value {
    let merges = train_merges(CORPUS, 300);
    let mut vocab: Vec<(Vec<u8>, u32)> = (0..=255u8).map(|b| (vec![b], u32::from(b))).collect();
    for (a, b) in &merges {
        let t = [a.as_slice(), b.as_slice()].concat();
        if !vocab.iter().any(|(v, _)| *v == t) {
            vocab.push((t, vocab.len() as u32));
        }
    }
    byte_level_bpe_json(
        &vocab,
        &merges,
        LLAMA3_PATTERN,
        &llama3_specials(),
        "<|begin_of_text|>",
    )
}

/// Writes the small Llama-3-style tokenizer and a Llama-3 chat template config into `dir`.
pub fn small_llama3_folder(dir: &Path) -> std::io::Result<()> {
    write_folder(
        dir,
        &small_llama3_tokenizer_json(),
        &llama3_config(LLAMA3_TEMPLATE),
    )
}
