//! Mooncake-format request traces (`{"timestamp","input_length","output_length","hash_ids"}`
//! per line) and their text: every hash id becomes a deterministic block of
//! [`BLOCK_TOKENS`] tokens of words, so two requests sharing a hash id at the same position share
//! that block of prompt text byte for byte, and a cache sees exactly the reuse the trace encodes.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::text::{exact_chars, CHARS_PER_TOKEN};

/// Tokens one hash id stands for in the Mooncake traces.
pub const BLOCK_TOKENS: usize = 512;

/// Label namespace for block text, so trace blocks never coincide with other generated text.
const BLOCK_NS: u64 = 0x7472_6163_6500_0000;

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct TraceRecord {
    /// Send time in milliseconds since the start of the trace.
    pub timestamp: u64,
    /// Prompt length in tokens; the last block is cut so the prompt has this many.
    pub input_length: u32,
    /// Tokens to generate (sent as `max_tokens`).
    pub output_length: u32,
    /// One id per block of [`BLOCK_TOKENS`] prompt tokens; equal ids mean equal blocks.
    pub hash_ids: Vec<u64>,
}

impl TraceRecord {
    /// Append this request's prompt: the blocks of its hash ids, the whole text cut to
    /// `input_length · CHARS_PER_TOKEN` characters (never longer than its blocks).
    pub fn render_prompt(&self, seed: u64, out: &mut String) {
        render_blocks(seed, &self.hash_ids, self.input_length, out)
    }
}

/// Append the text of `hash_ids` cut to `input_tokens` tokens; see [`TraceRecord::render_prompt`].
pub fn render_blocks(seed: u64, hash_ids: &[u64], input_tokens: u32, out: &mut String) {
    let block_chars = BLOCK_TOKENS * CHARS_PER_TOKEN;
    let mut left = (input_tokens as usize * CHARS_PER_TOKEN).min(hash_ids.len() * block_chars);
    out.reserve(left);
    for &id in hash_ids {
        if left == 0 {
            break;
        }
        let n = left.min(block_chars);
        exact_chars(seed, BLOCK_NS ^ id, n, out);
        left -= n;
    }
}

/// Reads a trace line by line, so an hour-long trace is never held in memory at once.
pub struct TraceReader {
    lines: io::Lines<BufReader<Box<dyn Read + Send>>>,
    line_no: usize,
    origin: String,
}

impl TraceReader {
    /// Open a trace file.
    pub fn open(path: &Path) -> io::Result<Self> {
        let f = File::open(path).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot open trace {}: {e}", path.display()),
            )
        })?;
        Ok(Self::from_reader(Box::new(f), path.display().to_string()))
    }

    /// Read a trace from any byte source (tests use an in-memory string).
    pub fn from_reader(r: Box<dyn Read + Send>, origin: String) -> Self {
        TraceReader {
            lines: BufReader::new(r).lines(),
            line_no: 0,
            origin,
        }
    }

    /// The next record; blank lines are skipped, a malformed line is an error naming it.
    pub fn next_record(&mut self) -> io::Result<Option<TraceRecord>> {
        for line in self.lines.by_ref() {
            self.line_no += 1;
            let line = line?;
            let t = line.trim();
            if t.is_empty() {
                continue;
            }
            return serde_json::from_str(t).map(Some).map_err(|e| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{}:{}: not a trace record: {e}", self.origin, self.line_no),
                )
            });
        }
        Ok(None)
    }
}

/// Resolve `--trace`: an existing path, or a short name (`conversation`, `synthetic`) looked
/// up as `mooncake_<name>_trace.jsonl` in `$RADIXGATE_TRACES`, `../shared/traces` (from the
/// repository root) and the same folder relative to this crate's sources.
pub fn resolve(spec: &str) -> io::Result<PathBuf> {
    let direct = PathBuf::from(spec);
    if direct.is_file() {
        return Ok(direct);
    }
    let file = if spec.ends_with(".jsonl") {
        spec.to_string()
    } else {
        format!("mooncake_{spec}_trace.jsonl")
    };
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Ok(d) = std::env::var("RADIXGATE_TRACES") {
        dirs.push(PathBuf::from(d));
    }
    dirs.push(PathBuf::from("../shared/traces"));
    dirs.push(PathBuf::from("../../shared/traces"));
    dirs.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces"));
    for d in &dirs {
        let p = d.join(&file);
        if p.is_file() {
            return Ok(p);
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!("trace {spec:?} not found (tried it as a path and {file} in {dirs:?})"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"{"timestamp": 0, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]}

{"timestamp": 40, "input_length": 600, "output_length": 3, "hash_ids": [0, 5]}
"#;

    fn read_all(s: &'static str) -> io::Result<Vec<TraceRecord>> {
        let mut r = TraceReader::from_reader(Box::new(s.as_bytes()), "sample".into());
        let mut v = Vec::new();
        while let Some(rec) = r.next_record()? {
            v.push(rec);
        }
        Ok(v)
    }

    #[test]
    fn parses_records_and_skips_blank_lines() {
        let v = read_all(SAMPLE).unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(
            v[1],
            TraceRecord {
                timestamp: 40,
                input_length: 600,
                output_length: 3,
                hash_ids: vec![0, 5]
            }
        );
        let err = read_all("{\"timestamp\": 1}\n").unwrap_err();
        assert!(err.to_string().contains("sample:1"), "{err}");
    }

    #[test]
    fn blocks_are_deterministic_shared_and_cut() {
        let v = read_all(SAMPLE).unwrap();
        let (mut a, mut b) = (String::new(), String::new());
        v[0].render_prompt(1, &mut a);
        v[1].render_prompt(1, &mut b);
        assert_eq!(a.len(), 1100 * CHARS_PER_TOKEN);
        assert_eq!(b.len(), 600 * CHARS_PER_TOKEN);
        let block = BLOCK_TOKENS * CHARS_PER_TOKEN;
        // Block 0 is shared, the second blocks (ids 1 and 5) differ.
        assert_eq!(a[..block], b[..block]);
        assert_ne!(a[block..block + 64], b[block..block + 64]);
        // Same id, same text, wherever it appears; the cut block is a prefix of the whole one.
        let mut again = String::new();
        render_blocks(1, &[5], 512, &mut again);
        assert_eq!(again[..600 * CHARS_PER_TOKEN - block], b[block..]);
        // Another seed gives other text.
        let mut c = String::new();
        v[0].render_prompt(2, &mut c);
        assert_ne!(a, c);
        // Lengths beyond the blocks are capped at the blocks.
        let mut d = String::new();
        render_blocks(1, &[9], 4096, &mut d);
        assert_eq!(d.len(), block);
    }

    #[test]
    fn shipped_traces_resolve_by_name_when_present() {
        if let Ok(p) = resolve("synthetic") {
            let mut r = TraceReader::open(&p).unwrap();
            let first = r.next_record().unwrap().unwrap();
            assert_eq!(first.timestamp, 0);
            assert!(!first.hash_ids.is_empty());
        }
        assert!(resolve("no-such-trace").is_err());
    }
}
