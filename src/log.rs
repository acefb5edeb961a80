//! A minimal leveled logger to stderr. The gateway logs little (startup, worker changes, errors),
//! so a global level and `eprintln!` are enough; request bodies are never logged. Log lines
//! carry strings from workers, peers and publishers (URLs, model names, error bodies, topics):
//! every line is escaped as it is written (control characters, and the Unicode ones that
//! reorder or hide text, as `\u{..}`), so no such string can forge a line or a terminal escape,
//! and capped at [`MAX_LINE_BYTES`].

use std::sync::atomic::{AtomicU8, Ordering};

/// Severity, ordered from most to least verbose (`--log-level`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Level {
    /// Everything.
    Trace = 0,
    /// Diagnostics.
    Debug = 1,
    /// Start-up, worker changes (the default).
    Info = 2,
    /// Circuits opening, workers refusing connections.
    #[value(alias = "warning")]
    Warn = 3,
    /// Only errors.
    Error = 4,
}

impl Level {
    /// Upper-case name used in log lines.
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Trace => "TRACE",
            Level::Debug => "DEBUG",
            Level::Info => "INFO",
            Level::Warn => "WARN",
            Level::Error => "ERROR",
        }
    }
}

static LEVEL: AtomicU8 = AtomicU8::new(Level::Info as u8);

/// Set the global threshold (from `--log-level`).
pub fn set_level(level: Level) {
    LEVEL.store(level as u8, Ordering::Relaxed);
}

/// Whether a message at `level` would be printed; lets callers skip formatting.
#[inline]
pub fn enabled(level: Level) -> bool {
    level as u8 >= LEVEL.load(Ordering::Relaxed)
}

/// Longest message written (bytes); the rest is cut and counted.
pub const MAX_LINE_BYTES: usize = 4096;

/// Print one line (used by the macros).
pub fn write(level: Level, args: std::fmt::Arguments<'_>) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let mut line = String::new();
    escape_line(&args.to_string(), MAX_LINE_BYTES, &mut line);
    eprintln!(
        "{}.{:03} {:5} radixgate: {}",
        now.as_secs(),
        now.subsec_millis(),
        level.as_str(),
        line
    );
}

/// `msg` as one printable line into `out`: control characters (C0, DEL, C1) and the format
/// characters that reorder or hide text (bidi overrides and isolates, zero-width characters,
/// BOM) written as `\u{..}` (`\n`, `\r`, `\t` as such), every backslash doubled so an escape
/// is never ambiguous. At most `max` bytes of `msg` are written, then how many were left out.
pub fn escape_line(msg: &str, max: usize, out: &mut String) {
    use std::fmt::Write;
    let mut taken = 0;
    for c in msg.chars() {
        if taken + c.len_utf8() > max {
            let _ = write!(out, "… ({} more bytes)", msg.len() - taken);
            return;
        }
        taken += c.len_utf8();
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if hides(c) => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
}

/// Characters a log line must not carry raw.
fn hides(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{200b}'..='\u{200f}' | '\u{2028}'..='\u{202e}' | '\u{2060}'..='\u{2069}' | '\u{feff}')
}

/// Log at a level: `log!(Info, "listening on {}", addr)`.
#[macro_export]
macro_rules! log {
    ($lvl:ident, $($arg:tt)*) => {
        if $crate::log::enabled($crate::log::Level::$lvl) {
            $crate::log::write($crate::log::Level::$lvl, format_args!($($arg)*));
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn esc(s: &str, max: usize) -> String {
        let mut out = String::new();
        escape_line(s, max, &mut out);
        out
    }

    #[test]
    fn worker_strings_cannot_forge_lines_or_escapes() {
        assert_eq!(esc("plain url http://a:1/x", 100), "plain url http://a:1/x");
        assert_eq!(
            esc("model\n1796.000 ERROR radixgate: forged", 100),
            "model\\n1796.000 ERROR radixgate: forged"
        );
        assert_eq!(esc("a\rb\tc\\d", 100), "a\\rb\\tc\\\\d");
        assert_eq!(esc("\u{1b}[31mred", 100), "\\u{1b}[31mred");
        assert_eq!(esc("x\u{202e}gpj.exe", 100), "x\\u{202e}gpj.exe");
        assert_eq!(esc("\u{85}\u{7f}\u{0}", 100), "\\u{85}\\u{7f}\\u{0}");
        // Text in other scripts stays as it is.
        assert_eq!(esc("café 東京", 100), "café 東京");
    }

    #[test]
    fn long_lines_are_cut_on_a_character_and_counted() {
        assert_eq!(esc("abcdef", 4), "abcd… (2 more bytes)");
        assert_eq!(esc("ééé", 3), "é… (4 more bytes)");
        assert_eq!(
            esc(&"x".repeat(10_000), MAX_LINE_BYTES).len(),
            MAX_LINE_BYTES + "… (5904 more bytes)".len()
        );
    }
}
