//! Python's view of JSON, for chat templates: request JSON parsed with its key order kept (Python
//! dicts keep insertion order, and templates print tools with `tojson`), turned into template
//! values, and written back the way Python writes them — `json.dumps` for the `tojson` filter
//! (HF's version: `ensure_ascii=False`, no HTML escaping) and `str()` / `repr()` for `{{ x }}`
//! (`None`, `True`, `['a', 1]`). `serde_json`'s own map sorts keys unless a crate-wide feature
//! is switched on, which would change every other JSON the gateway writes; this keeps it local.

use std::fmt::{self, Write as _};

use minijinja::value::{Value, ValueKind};
use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

/// A JSON value with object keys in document order.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Json {
    Null,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

impl Json {
    /// The field `key` of an object (the last one when a key repeats, as Python's `json` does).
    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Obj(fields) => fields.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// Moves the field `key` out (the last one, as [`Json::get`] reads it), leaving null in
    /// its place: the request's strings go to the template without a copy.
    pub fn take(&mut self, key: &str) -> Option<Json> {
        match self {
            Json::Obj(fields) => fields
                .iter_mut()
                .rev()
                .find(|(k, _)| k == key)
                .map(|(_, v)| std::mem::replace(v, Json::Null)),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::Str(s) => Some(s),
            _ => None,
        }
    }

    /// `None` for JSON null and for an absent field alike (pydantic's `Optional` fields).
    pub fn non_null(v: Option<&Json>) -> Option<&Json> {
        v.filter(|v| !matches!(v, Json::Null))
    }

    /// The template value.
    pub fn to_value(&self) -> Value {
        match self {
            Json::Null => Value::from(()),
            Json::Bool(b) => Value::from(*b),
            Json::Int(i) => Value::from(*i),
            Json::UInt(u) => Value::from(*u),
            Json::Float(f) => Value::from(*f),
            Json::Str(s) => Value::from(s.as_str()),
            Json::Arr(items) => Value::from(items.iter().map(Json::to_value).collect::<Vec<_>>()),
            // A repeated key keeps its first position and its last value, like Python's dict.
            Json::Obj(fields) => Value::from_pairs(
                fields
                    .iter()
                    .map(|(k, v)| (Value::from(k.as_str()), v.to_value())),
            ),
        }
    }
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Json, D::Error> {
        d.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_unit<E: de::Error>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }
    fn visit_none<E: de::Error>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Json, E> {
        Ok(Json::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Json, E> {
        Ok(Json::Int(v))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Json, E> {
        Ok(match i64::try_from(v) {
            Ok(i) => Json::Int(i),
            Err(_) => Json::UInt(v),
        })
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Json, E> {
        Ok(Json::Float(v))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Json, E> {
        Ok(Json::Str(v.to_owned()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Json, E> {
        Ok(Json::Str(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        while let Some(v) = seq.next_element()? {
            out.push(v);
        }
        Ok(Json::Arr(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut out = Vec::with_capacity(map.size_hint().unwrap_or(0).min(1024));
        while let Some((k, v)) = map.next_entry::<String, Json>()? {
            out.push((k, v));
        }
        Ok(Json::Obj(out))
    }
}

/// `json.dumps` options HF's `tojson` filter passes through.
#[derive(Debug, Clone, Default)]
pub(super) struct DumpOptions {
    /// `indent`: `None` → one line with `", "` / `": "`; otherwise newline + this string per level.
    pub indent: Option<String>,
    /// `separators=(item, key)`.
    pub separators: Option<(String, String)>,
    pub sort_keys: bool,
    pub ensure_ascii: bool,
    /// Longest output: past it the dump stops with an error. An indent multiplies what a deeply
    /// nested value prints (each line repeats it once per level: ~120 levels of a 4 MiB body
    /// printed ~1 GB), so the output is measured as it grows, not after.
    pub max_len: usize,
}

/// Python's `json.dumps(value, ...)` of a template value. Undefined values and non-string keys
/// Python cannot encode are errors, as they are in Python.
pub(super) fn dumps(value: &Value, opts: &DumpOptions) -> Result<String, String> {
    let (item_sep, key_sep) = match &opts.separators {
        Some((i, k)) => (i.as_str(), k.as_str()),
        None if opts.indent.is_some() => (",", ": "),
        None => (", ", ": "),
    };
    let mut out = String::new();
    dump(value, opts, item_sep, key_sep, 0, &mut out)?;
    Ok(out)
}

fn newline(opts: &DumpOptions, level: usize, out: &mut String) -> Result<(), String> {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
    within(opts, out)
}

/// The output so far is within `max_len`.
fn within(opts: &DumpOptions, out: &str) -> Result<(), String> {
    if out.len() > opts.max_len {
        return Err(format!("tojson: output over {} bytes", opts.max_len));
    }
    Ok(())
}

fn dump(
    v: &Value,
    opts: &DumpOptions,
    item_sep: &str,
    key_sep: &str,
    level: usize,
    out: &mut String,
) -> Result<(), String> {
    if level > 256 {
        return Err("tojson: value nested too deeply".into());
    }
    match v.kind() {
        ValueKind::Undefined => {
            return Err("Object of type Undefined is not JSON serializable".into())
        }
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(v, out),
        ValueKind::String => write_json_str(v.as_str().unwrap_or(""), opts.ensure_ascii, out),
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter().map_err(|e| e.to_string())?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(opts, level + 1, out)?;
                match k.kind() {
                    ValueKind::String => {
                        write_json_str(k.as_str().unwrap_or(""), opts.ensure_ascii, out)
                    }
                    ValueKind::None => out.push_str("\"null\""),
                    ValueKind::Bool => {
                        out.push_str(if k.is_true() { "\"true\"" } else { "\"false\"" })
                    }
                    ValueKind::Number => {
                        out.push('"');
                        write_number(k, out);
                        out.push('"');
                    }
                    _ => {
                        return Err(format!(
                            "keys must be str, int, float, bool or None, not {}",
                            k.kind()
                        ))
                    }
                }
                out.push_str(key_sep);
                let item = v.get_item(k).map_err(|e| e.to_string())?;
                dump(&item, opts, item_sep, key_sep, level + 1, out)?;
            }
            newline(opts, level, out)?;
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter().map_err(|e| e.to_string())?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(opts, level + 1, out)?;
                dump(item, opts, item_sep, key_sep, level + 1, out)?;
            }
            newline(opts, level, out)?;
            out.push(']');
        }
        other => return Err(format!("Object of type {other} is not JSON serializable")),
    }
    within(opts, out)
}

/// A JSON string literal as Python's `json` encoder writes it.
fn write_json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// An integer as digits, a float as Python's `repr` (`1.0`, `1e+16`, `1.5e-07`, `inf` → JSON's
/// `Infinity`).
fn write_number(v: &Value, out: &mut String) {
    if v.is_integer() {
        let _ = write!(out, "{v}");
        return;
    }
    match f64::try_from(v.clone()) {
        Ok(f) => out.push_str(&py_float_repr(f, true)),
        Err(_) => {
            let _ = write!(out, "{v}");
        }
    }
}

/// Python's `repr(float)`: shortest round-trip digits, scientific below 1e-4 and from 1e16.
/// `json` spells the non-finite values `NaN` / `Infinity`, `repr` spells them `nan` / `inf`.
pub(super) fn py_float_repr(f: f64, json: bool) -> String {
    if f.is_nan() {
        return if json { "NaN" } else { "nan" }.into();
    }
    if f.is_infinite() {
        let s = if json { "Infinity" } else { "inf" };
        return if f < 0.0 { format!("-{s}") } else { s.into() };
    }
    // `{:e}` gives the shortest round-trip digits: "1.5e-7", "-1e16", "0e0".
    let sci = format!("{f:e}");
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let neg = mant.starts_with('-');
    let digits: String = mant.chars().filter(char::is_ascii_digit).collect();
    let mut out = String::new();
    if neg {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        // Positional, with at least one digit after the point.
        let point = exp + 1; // digits before the decimal point
        if point <= 0 {
            out.push_str("0.");
            for _ in 0..(-point) {
                out.push('0');
            }
            out.push_str(&digits);
        } else {
            let point = point as usize;
            if digits.len() <= point {
                out.push_str(&digits);
                for _ in digits.len()..point {
                    out.push('0');
                }
                out.push_str(".0");
            } else {
                out.push_str(&digits[..point]);
                out.push('.');
                out.push_str(&digits[point..]);
            }
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    out
}

/// Python's whitespace for `str.strip()` / `split()` and Jinja's `trim`: Unicode White_Space
/// plus the four ASCII separators U+001C..U+001F (Rust's `trim` keeps those).
pub(super) fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// `str(value)` as Jinja2 prints `{{ value }}`: strings as they are, `None` / `True` / `False`,
/// floats as `repr`, lists and dicts as Python's `repr` of them; undefined prints nothing.
pub(super) fn py_str(v: &Value, out: &mut String) {
    match v.kind() {
        ValueKind::Undefined => {}
        ValueKind::String => out.push_str(v.as_str().unwrap_or("")),
        _ => py_repr(v, out, 0),
    }
}

fn py_repr(v: &Value, out: &mut String, level: usize) {
    if level > 256 {
        out.push_str("...");
        return;
    }
    match v.kind() {
        ValueKind::Undefined => out.push_str("Undefined"),
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number => {
            if v.is_integer() {
                let _ = write!(out, "{v}");
            } else if let Ok(f) = f64::try_from(v.clone()) {
                out.push_str(&py_float_repr(f, false));
            } else {
                let _ = write!(out, "{v}");
            }
        }
        ValueKind::String => py_str_repr(v.as_str().unwrap_or(""), out),
        ValueKind::Map => {
            out.push('{');
            if let Ok(keys) = v.try_iter() {
                for (i, k) in keys.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_repr(&k, out, level + 1);
                    out.push_str(": ");
                    let item = v.get_item(&k).unwrap_or_default();
                    py_repr(&item, out, level + 1);
                }
            }
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            if let Ok(items) = v.try_iter() {
                for (i, item) in items.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_repr(&item, out, level + 1);
                }
            }
            out.push(']');
        }
        _ => {
            let _ = write!(out, "{v}");
        }
    }
}

/// Python's `repr(str)`: single quotes unless the text has a `'` and no `"`.
fn py_str_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}
