//! Where `tokenizers` cuts a text before it encodes anything: at every occurrence of an added
//! token whose `normalized` flag is false, found leftmost-longest on the raw text. Each piece
//! between two such tokens is then normalized, pre-tokenized and encoded on its own, so
//! `encode(text) == concat(encode(piece) or [token id])` — the fact the segment cache rests on.
//! This module reproduces that first cut exactly (including `lstrip` / `rstrip`, which swallow
//! the whitespace beside the token) and nothing else; added tokens with `normalized: true` are
//! matched by `tokenizers` inside each piece, so a piece encoded alone finds them just the same.
//! Tokens with `single_word` decide by looking past a piece's edges, which a piece encoded alone
//! cannot see: a tokenizer with one of those is not cut at all (see `Splitter::new`).

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};

/// One non-normalized added token as `tokenizers` matches it.
#[derive(Debug, Clone)]
pub(super) struct Added {
    pub content: String,
    pub id: u32,
    pub lstrip: bool,
    pub rstrip: bool,
    /// Matched but then ignored (a special token while the tokenizer encodes specials as text):
    /// the match still consumes its span, as in `tokenizers`.
    pub skip: bool,
}

/// A piece of the text: plain text to encode, or an added token's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Piece<'a> {
    Text(&'a str),
    Token(u32),
}

/// Where a split can resume after an added token: its match ended at `resume` (the search goes
/// on from there) and the next piece starts at `done` (past the whitespace an `rstrip` token
/// swallowed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Resume {
    pub resume: usize,
    pub done: usize,
}

/// Leftmost-longest search over the non-normalized added tokens.
pub(super) struct Splitter {
    ac: Option<AhoCorasick>,
    tokens: Vec<Added>,
    /// Longest token (bytes): how far past a cut the search may look before it commits.
    max_len: usize,
}

impl std::fmt::Debug for Splitter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Splitter")
            .field("tokens", &self.tokens.len())
            .finish()
    }
}

/// Python's / the `regex` crate's `\s` (Unicode White_Space), which `tokenizers` uses for
/// `lstrip` / `rstrip`.
fn is_space(c: char) -> bool {
    c.is_whitespace()
}

impl Splitter {
    /// A splitter over `tokens`. Fails when the automaton cannot be built (never for sane sizes).
    pub fn new(tokens: Vec<Added>) -> Result<Splitter, String> {
        let tokens: Vec<Added> = tokens
            .into_iter()
            .filter(|t| !t.content.is_empty())
            .collect();
        let ac = if tokens.is_empty() {
            None
        } else {
            Some(
                AhoCorasickBuilder::new()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(tokens.iter().map(|t| t.content.as_bytes()))
                    .map_err(|e| e.to_string())?,
            )
        };
        let max_len = tokens.iter().map(|t| t.content.len()).max().unwrap_or(0);
        Ok(Splitter {
            ac,
            tokens,
            max_len,
        })
    }

    /// Longest added token in bytes. A cut after a token is the same in every text that
    /// agrees with this one for this many bytes past the cut's `done` (a leftmost-longest
    /// match is decided within that window, and an `rstrip` run ended before it).
    pub fn max_token_len(&self) -> usize {
        self.max_len
    }

    /// Calls `f` with each piece of `text` after `from` (the start, or a [`Resume`] this
    /// splitter reported for a text with the same bytes up to there) in order, each added token
    /// with where a split could resume after it; empty text pieces are skipped (they encode to
    /// nothing).
    pub fn split_from<'a, E>(
        &self,
        text: &'a str,
        from: Resume,
        mut f: impl FnMut(Piece<'a>, Option<Resume>) -> Result<(), E>,
    ) -> Result<(), E> {
        let Some(ac) = &self.ac else {
            if from.done < text.len() {
                f(Piece::Text(&text[from.done..]), None)?;
            }
            return Ok(());
        };
        let mut done = from.done;
        let input = aho_corasick::Input::new(text).range(from.resume..);
        for m in ac.find_iter(input) {
            let tok = &self.tokens[m.pattern().as_usize()];
            if tok.skip {
                continue;
            }
            let mut start = m.start();
            let mut stop = m.end();
            if tok.lstrip {
                let trimmed = text[..start].trim_end_matches(is_space).len();
                start = trimmed.max(done);
            }
            if tok.rstrip {
                stop += text[stop..].len() - text[stop..].trim_start_matches(is_space).len();
            }
            if done < start {
                f(Piece::Text(&text[done..start]), None)?;
            }
            let after = Resume {
                resume: m.end(),
                done: stop,
            };
            f(Piece::Token(tok.id), Some(after))?;
            done = stop;
        }
        if done < text.len() {
            f(Piece::Text(&text[done..]), None)?;
        }
        Ok(())
    }
}
