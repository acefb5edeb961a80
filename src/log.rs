//! A minimal leveled logger to stderr. The gateway logs little (startup, worker changes, errors),
//! so a global level and `eprintln!` are enough; request bodies are never logged.

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

/// Print one line (used by the macros).
pub fn write(level: Level, args: std::fmt::Arguments<'_>) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    eprintln!(
        "{}.{:03} {:5} radixgate: {}",
        now.as_secs(),
        now.subsec_millis(),
        level.as_str(),
        args
    );
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
