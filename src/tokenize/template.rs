//! The model's chat template, rendered as HF `transformers` renders it (the code SGLang calls):
//! Jinja2 with `trim_blocks` and `lstrip_blocks` on, a single trailing newline of the template
//! dropped, the `loopcontrols` extension, `raise_exception(msg)` and `strftime_now(fmt)` as
//! globals, and a `tojson` filter that is Python's `json.dumps(x, ensure_ascii=False, indent=…,
//! separators=…, sort_keys=…)` (Jinja's own `tojson` HTML-escapes, HF's does not). Values print
//! as Python prints them (`None`, `True`, `['a']`), `trim` / `.strip()` / `.split()` use Python's
//! whitespace, and the other Python string and dict methods come from `minijinja-contrib`.
//!
//! HF's `{% generation %}` block (which only marks assistant spans for training masks) renders
//! its body unchanged; it is rewritten to an always-true `if` before compiling.
//!
//! Rendering is bounded: the template runs on a fuel budget (minijinja counts executed
//! instructions), so a template loop over a huge request cannot run away; and everything it
//! prints, `tojson` output included, is measured as it is written, so a template cannot turn a
//! request into more than `max_bytes` of prompt (an indented `tojson` of a deeply nested value
//! multiplies it), however few instructions that takes.

use minijinja::value::{Kwargs, Rest, Value};
use minijinja::{Environment, Error, ErrorKind, State};

use super::pyjson::{self, DumpOptions};

/// The name the template is stored under in its environment.
const NAME: &str = "chat";

/// A compiled chat template.
pub(super) struct ChatTemplate {
    env: Environment<'static>,
    /// Longest rendered prompt (`Limits::max_text_bytes`).
    max_bytes: usize,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChatTemplate")
    }
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg.into())
}

/// HF's `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, its
/// output at most `max_len` bytes.
fn tojson(value: Value, kwargs: Kwargs, max_len: usize) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                let n = v
                    .as_i64()
                    .ok_or_else(|| invalid("tojson: indent must be an int or a string"))?;
                Some(" ".repeat(n.clamp(0, 64) as usize))
            }
        },
    };
    let separators: Option<Value> = kwargs.get("separators")?;
    let separators = match separators {
        Some(v) if !v.is_none() => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] => Some((
                    a.as_str().unwrap_or_default().to_string(),
                    b.as_str().unwrap_or_default().to_string(),
                )),
                _ => return Err(invalid("tojson: separators must be a pair of strings")),
            }
        }
        _ => None,
    };
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let opts = DumpOptions {
        indent,
        separators,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
        max_len,
    };
    pyjson::dumps(&value, &opts)
        .map(Value::from_safe_string)
        .map_err(invalid)
}

/// Jinja2's `trim(value, chars=None)`: Python's `str.strip`.
fn trim(value: Value, chars: Option<String>) -> Result<Value, Error> {
    // One copy, into the result (the content of every message goes through here in most
    // templates).
    if let Some(s) = value.as_str() {
        let t = strip(s, chars.as_deref(), true, true);
        if t.len() == s.len() && !value.is_safe() {
            return Ok(value); // Nothing to strip: the same string, no copy at all.
        }
        return Ok(Value::from(t));
    }
    let mut out = String::new();
    pyjson::py_str(&value, &mut out);
    Ok(Value::from(strip(&out, chars.as_deref(), true, true)))
}

fn strip<'s>(s: &'s str, chars: Option<&str>, left: bool, right: bool) -> &'s str {
    let pat = |c: char| match chars {
        Some(set) => set.contains(c),
        None => pyjson::py_space(c),
    };
    let mut out = s;
    if left {
        out = out.trim_start_matches(pat);
    }
    if right {
        out = out.trim_end_matches(pat);
    }
    out
}

/// `strftime_now(fmt)`: the current time formatted with Python's `strftime` codes, in UTC (the
/// server formats its local time; servers run in UTC as a rule, and a template that prints the
/// date changes its prompt once a day either way).
fn strftime_now(fmt: String) -> Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(Value::from(strftime(&fmt, secs)))
}

/// Python `strftime` over a UTC unix time, for the codes chat templates use.
pub(super) fn strftime(fmt: &str, unix: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix.div_euclid(86_400);
    let rem = unix.rem_euclid(86_400);
    let (h, mi, s) = (rem / 3600, (rem / 60) % 60, rem % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let d = doy_mar - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday (index 3)
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    const CUM: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = CUM[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let month = MONTHS[(m - 1) as usize];
    let day = DAYS[weekday];
    let mut out = String::with_capacity(fmt.len() + 16);
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('I') => out.push_str(&format!("{:02}", if h % 12 == 0 { 12 } else { h % 12 })),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{mi:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('B') => out.push_str(month),
            Some('b') | Some('h') => out.push_str(&month[..3]),
            Some('A') => out.push_str(day),
            Some('a') => out.push_str(&day[..3]),
            Some('w') => out.push_str(&((weekday + 1) % 7).to_string()),
            Some('u') => out.push_str(&(weekday + 1).to_string()),
            Some('F') => out.push_str(&format!("{y}-{m:02}-{d:02}")),
            Some('T') => out.push_str(&format!("{h:02}:{mi:02}:{s:02}")),
            Some('Z') => out.push_str("UTC"),
            Some('z') => out.push_str("+0000"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Python string methods where Python's whitespace differs from Rust's, then `pycompat`.
fn methods(state: &mut State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        let chars = match args {
            [] => Some(None),
            [a] if a.is_none() => Some(None),
            [a] => a.as_str().map(Some),
            _ => None,
        };
        match (method, chars) {
            ("strip", Some(c)) => return Ok(Value::from(strip(s, c, true, true))),
            ("lstrip", Some(c)) => return Ok(Value::from(strip(s, c, true, false))),
            ("rstrip", Some(c)) => return Ok(Value::from(strip(s, c, false, true))),
            ("split", _) if args.is_empty() => {
                return Ok(Value::from(
                    s.split(pyjson::py_space)
                        .filter(|p| !p.is_empty())
                        .map(Value::from)
                        .collect::<Vec<_>>(),
                ))
            }
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Rewrites HF's `{% generation %}` / `{% endgeneration %}` (whitespace markers kept) to
/// `{% if true %}` / `{% endif %}`, which render their body the same way.
fn rewrite_generation_blocks(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(i) = rest.find("{%") {
        out.push_str(&rest[..i]);
        let tag = &rest[i..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (lead, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, trail) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[b.len()..]),
            None => (body, ""),
        };
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                out.push_str("{%");
                out.push_str(lead);
                out.push(' ');
                out.push_str(r);
                out.push(' ');
                out.push_str(trail);
                out.push_str("%}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

impl ChatTemplate {
    /// Compiles `source` in an HF-like environment; `fuel` bounds each render's instructions,
    /// `max_bytes` what it prints.
    pub fn new(source: &str, fuel: u64, max_bytes: usize) -> Result<ChatTemplate, String> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| e.to_string())?;
        env.set_syntax(syntax);
        env.set_fuel(Some(fuel));
        env.set_unknown_method_callback(methods);
        env.set_formatter(|out, _state, value| {
            // A string prints as itself (Python's `str`): written straight from the value,
            // not through a copy (a chat's messages are most of what a template prints).
            if let Some(s) = value.as_str() {
                return out.write_str(s).map_err(|_| invalid("write failed"));
            }
            let mut s = String::new();
            pyjson::py_str(value, &mut s);
            out.write_str(&s).map_err(|_| invalid("write failed"))
        });
        env.add_filter("tojson", move |v: Value, kw: Kwargs| {
            tojson(v, kw, max_bytes)
        });
        env.add_filter("trim", trim);
        env.add_filter("string", |v: Value| {
            let mut s = String::new();
            pyjson::py_str(&v, &mut s);
            Value::from(s)
        });
        env.add_function(
            "raise_exception",
            |msg: Rest<Value>| -> Result<Value, Error> {
                let mut text = String::new();
                if let Some(m) = msg.first() {
                    pyjson::py_str(m, &mut text);
                }
                Err(Error::new(ErrorKind::InvalidOperation, text))
            },
        );
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(NAME, rewrite_generation_blocks(source))
            .map_err(|e| format!("chat template does not compile: {e}"))?;
        Ok(ChatTemplate { env, max_bytes })
    }

    /// Renders with `ctx` (a map: `messages`, `tools`, `add_generation_prompt`, special
    /// tokens, request kwargs). Errors carry the template's own message (`raise_exception`).
    pub fn render(&self, ctx: Value) -> Result<String, RenderError> {
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| RenderError::Failed(e.to_string()))?;
        let mut out = Capped {
            out: Vec::new(),
            max: self.max_bytes,
        };
        let rendered = tmpl.render_captured_to(ctx, &mut out).map(drop);
        if out.out.len() > self.max_bytes {
            return Err(RenderError::TooLarge);
        }
        rendered.map_err(|e| match e.kind() {
            ErrorKind::InvalidOperation => match e.detail() {
                Some(d) if d.starts_with(TOJSON_OVER) => RenderError::TooLarge,
                d => RenderError::Failed(d.unwrap_or("template error").to_string()),
            },
            ErrorKind::OutOfFuel => {
                RenderError::Failed("chat template ran out of its time budget".to_string())
            }
            _ => {
                let mut s = e.to_string();
                s.truncate(300);
                RenderError::Failed(s)
            }
        })?;
        // Everything written is from the template's strings and values: UTF-8.
        String::from_utf8(out.out)
            .map_err(|_| RenderError::Failed("rendered prompt is not UTF-8".to_string()))
    }
}

/// Why a render gave no prompt: over the size cap (the request then routes by text, like any
/// prompt over the limits) or the template itself failed.
#[derive(Debug, PartialEq)]
pub enum RenderError {
    /// The output (or one `tojson` inside it) passed the cap; rendering stopped there.
    TooLarge,
    /// The template raised, ran out of fuel or could not run.
    Failed(String),
}

/// How [`pyjson::dumps`] says it stopped at its cap (told apart from a template's own errors).
const TOJSON_OVER: &str = "tojson: output over";

/// What a render writes, refused past `max` bytes (the render then stops with a write error).
struct Capped {
    out: Vec<u8>,
    max: usize,
}

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.out.len() + buf.len() > self.max {
            // Past the cap: keep the length over it (the caller tells this apart), drop bytes.
            self.out.resize(self.max + 1, 0);
            return Err(std::io::Error::other("rendered prompt over the cap"));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A render context of one name.
    fn ctx(name: &str, v: Value) -> Value {
        let mut m = std::collections::BTreeMap::new();
        m.insert(name.to_string(), v);
        Value::from(m)
    }

    /// `tools` nested `depth` levels deep around a list of `width` short strings.
    fn nested(depth: usize, width: usize) -> Value {
        let mut v: Value = Value::from((0..width).map(|i| format!("x{i}")).collect::<Vec<_>>());
        for _ in 0..depth {
            v = Value::from(vec![v]);
        }
        v
    }

    #[test]
    fn an_indented_tojson_of_a_deep_body_stops_at_the_cap_quickly() {
        // ~120 levels around ~400k items: printed with indent=4 each item's line repeats 480
        // spaces (~200 MB); capped at 512 KiB it stops after writing about that.
        let max = 512 << 10;
        let t = ChatTemplate::new("{{ tools | tojson(indent=4) }}", 20_000_000, max).unwrap();
        let start = std::time::Instant::now();
        let r = t.render(ctx("tools", nested(120, 400_000)));
        assert_eq!(r, Err(RenderError::TooLarge));
        assert!(
            start.elapsed() < std::time::Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
        // What a template prints straight is capped too (a message printed over and over).
        let t = ChatTemplate::new(
            "{% for i in range(100000) %}{{ m }}{% endfor %}",
            20_000_000,
            max,
        )
        .unwrap();
        let err = t
            .render(ctx("m", Value::from("y".repeat(4096))))
            .unwrap_err();
        assert_eq!(err, RenderError::TooLarge);
        // Under the cap, the same template renders.
        let t = ChatTemplate::new("{{ tools | tojson(indent=4) }}", 20_000_000, max).unwrap();
        let ok = t.render(ctx("tools", nested(3, 10))).unwrap();
        assert!(ok.starts_with("[\n    [") && ok.len() < 2_000);
    }
}
