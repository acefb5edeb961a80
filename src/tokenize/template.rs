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
//! instructions), so a template loop over a huge request cannot run away.

use minijinja::value::{Kwargs, Rest, Value};
use minijinja::{Environment, Error, ErrorKind, State};

use super::pyjson::{self, DumpOptions};

/// The name the template is stored under in its environment.
const NAME: &str = "chat";

/// A compiled chat template.
pub(super) struct ChatTemplate {
    env: Environment<'static>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChatTemplate")
    }
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg.into())
}

/// HF's `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
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
    /// Compiles `source` in an HF-like environment; `fuel` bounds each render.
    pub fn new(source: &str, fuel: u64) -> Result<ChatTemplate, String> {
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
        env.add_filter("tojson", tojson);
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
        Ok(ChatTemplate { env })
    }

    /// Renders with `ctx` (a map: `messages`, `tools`, `add_generation_prompt`, special
    /// tokens, request kwargs). Errors carry the template's own message (`raise_exception`).
    pub fn render(&self, ctx: Value) -> Result<String, String> {
        let tmpl = self.env.get_template(NAME).map_err(|e| e.to_string())?;
        tmpl.render(ctx).map_err(|e| match e.kind() {
            ErrorKind::InvalidOperation => e.detail().unwrap_or("template error").to_string(),
            ErrorKind::OutOfFuel => "chat template ran out of its time budget".to_string(),
            _ => {
                let mut s = e.to_string();
                s.truncate(300);
                s
            }
        })
    }
}
