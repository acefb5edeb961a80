//! Loading a tokenizer folder as SGLang (transformers) loads it: where the files are, the
//! `tokenizers` model (never truncating or padding), the chat template (a `.jinja` file, else
//! the config's string or its `default` entry), the special tokens the template may print, and
//! whether prompts can be cut at added tokens and encoded piece by piece.

use super::split::{Added, Splitter};
use super::LoadError;
use serde_json::Value as JsonValue;
use std::path::{Path, PathBuf};

/// The `tokenizer.json` file and the folder its companions are looked for in (`path` is either).
pub(super) fn locate(path: &Path) -> Result<(PathBuf, PathBuf), LoadError> {
    if path.is_dir() {
        let f = path.join("tokenizer.json");
        if !f.is_file() {
            return Err(LoadError::NoTokenizerJson(path.to_path_buf()));
        }
        return Ok((f, path.to_path_buf()));
    }
    let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    Ok((path.to_path_buf(), dir))
}

/// `tokenizer.json` as JSON (its pre-tokenizer and post-processor are read from it) and as the
/// `tokenizers` model, set never to truncate or pad (SGLang encodes prompts whole).
pub(super) fn hf_tokenizer(file: &Path) -> Result<(JsonValue, tokenizers::Tokenizer), LoadError> {
    let bytes = read(file)?;
    let raw: JsonValue =
        serde_json::from_slice(&bytes).map_err(|e| LoadError::Tokenizer(e.to_string()))?;
    let mut hf = tokenizers::Tokenizer::from_bytes(&bytes)
        .map_err(|e| LoadError::Tokenizer(e.to_string()))?;
    hf.with_truncation(None)
        .map_err(|e| LoadError::Tokenizer(e.to_string()))?;
    hf.with_padding(None);
    Ok((raw, hf))
}

/// A JSON file of the folder, `null` when there is none.
pub(super) fn json_file(path: &Path) -> Result<JsonValue, LoadError> {
    match read(path) {
        Ok(b) => serde_json::from_slice(&b).map_err(|e| LoadError::Config(e.to_string())),
        Err(LoadError::Io(_, e)) if e.kind() == std::io::ErrorKind::NotFound => Ok(JsonValue::Null),
        Err(e) => Err(e),
    }
}

/// The chat template's source: `chat_template.jinja`, else the config's `chat_template` (a
/// string, or a list whose `default` entry is taken).
pub(super) fn template_source(dir: &Path, config: &JsonValue) -> Result<Option<String>, LoadError> {
    match read(&dir.join("chat_template.jinja")) {
        Ok(b) => String::from_utf8(b)
            .map(Some)
            .map_err(|_| LoadError::Template("chat_template.jinja is not UTF-8".into())),
        Err(LoadError::Io(_, e)) if e.kind() == std::io::ErrorKind::NotFound => {
            match config.get("chat_template") {
                None | Some(JsonValue::Null) => Ok(None),
                Some(JsonValue::String(s)) => Ok(Some(s.clone())),
                Some(JsonValue::Array(list)) => Ok(list
                    .iter()
                    .find(|t| t.get("name").and_then(JsonValue::as_str) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(JsonValue::as_str)
                    .map(str::to_string)),
                Some(_) => Err(LoadError::Config(
                    "chat_template must be a string or a list".into(),
                )),
            }
        }
        Err(e) => Err(e),
    }
}

/// The special tokens a template may print (`bos_token`...), from the config, else from
/// `special_tokens_map.json`.
pub(super) fn special_vars(dir: &Path, config: &JsonValue) -> Vec<(String, String)> {
    let special_map = read(&dir.join("special_tokens_map.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<JsonValue>(&b).ok())
        .unwrap_or(JsonValue::Null);
    [
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
    ]
    .into_iter()
    .filter_map(|name| {
        let v = config
            .get(name)
            .and_then(token_text)
            .or_else(|| special_map.get(name).and_then(token_text))?;
        Some((name.to_string(), v))
    })
    .collect()
}

/// The added-token cut (see `split`): a splitter when prompts can be cut at added tokens and
/// encoded piece by piece with the same result, which they can unless a non-normalized added
/// token uses `single_word`, a Metaspace prepends to the first piece only, or BPE drops out;
/// and whether some added token is normalized (matched inside pieces: it could span a word cut).
pub(super) fn added_token_cut(
    hf: &tokenizers::Tokenizer,
    raw: &JsonValue,
) -> Result<(Option<Splitter>, bool), LoadError> {
    let encode_specials = hf.get_encode_special_tokens();
    let mut added = Vec::new();
    let mut reproducible =
        !has_first_only_metaspace(raw.get("pre_tokenizer").unwrap_or(&JsonValue::Null))
            && raw
                .get("model")
                .and_then(|m| m.get("dropout"))
                .is_none_or(|d| d.is_null() || d.as_f64() == Some(0.0));
    let mut decoder: Vec<(u32, tokenizers::AddedToken)> =
        hf.get_added_tokens_decoder().into_iter().collect();
    decoder.sort_by_key(|(id, _)| *id);
    let mut normalized_added = false;
    for (id, t) in decoder {
        if t.normalized {
            normalized_added = true;
            continue;
        }
        if t.single_word {
            reproducible = false;
        }
        added.push(Added {
            content: t.content,
            id,
            lstrip: t.lstrip,
            rstrip: t.rstrip,
            skip: encode_specials && t.special,
        });
    }
    let splitter = if reproducible {
        Some(Splitter::new(added).map_err(LoadError::Tokenizer)?)
    } else {
        None
    };
    Ok((splitter, normalized_added))
}

fn read(path: &Path) -> Result<Vec<u8>, LoadError> {
    std::fs::read(path).map_err(|e| LoadError::Io(path.to_path_buf(), e))
}

/// A special token in `tokenizer_config.json`: a string, or an added-token object.
fn token_text(v: &JsonValue) -> Option<String> {
    match v {
        JsonValue::String(s) => Some(s.clone()),
        JsonValue::Object(o) => o
            .get("content")
            .and_then(JsonValue::as_str)
            .map(str::to_string),
        _ => None,
    }
}

/// Whether any pre-tokenizer in `v` is a `Metaspace` that prepends only to the first piece
/// (it looks at the piece's offset in the whole text, which a piece encoded alone lacks).
fn has_first_only_metaspace(v: &JsonValue) -> bool {
    match v {
        JsonValue::Object(o) => {
            let first = o.get("type").and_then(JsonValue::as_str) == Some("Metaspace")
                && o.get("prepend_scheme").and_then(JsonValue::as_str) == Some("first");
            first || o.values().any(has_first_only_metaspace)
        }
        JsonValue::Array(a) => a.iter().any(has_first_only_metaspace),
        _ => false,
    }
}
