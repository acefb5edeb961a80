//! A core's recent rendered prompts with their token ids, cut after each added token. Turn
//! k+1 of a chat renders turn k's text again as its prefix (so do retries, and agents asking
//! many questions over one document); the segment cache already skips encoding the history's
//! pieces, but still searches all of it for added tokens and hashes and looks up each piece.
//! With the memo the ids of the longest shared prefix, up to the last cut that the two texts
//! provably cut alike, are copied, and only the rest is split and encoded.
//!
//! Exact: a cut is taken only when the texts agree for [`super::split::Splitter::max_token_len`]
//! bytes past it (see there), so splitting the new text from the cut gives the pieces a split
//! from the start gives; the ids before the cut are the remembered text's, which were computed
//! from the same bytes. Bounded: [`MEMO_TEXTS`] texts of at most [`MEMO_TEXT_BYTES`] each with
//! their ids (≤ 4 bytes of ids per byte of text): ≤ 10 MiB per core, ~0.6 MiB for 16 chats of
//! 4k tokens.

use super::split::Resume;
use crate::base::recent::RecentSlots;
use crate::base::text::common_byte_prefix as common_prefix;

/// Texts remembered per core.
pub const MEMO_TEXTS: usize = 16;

/// Longest text remembered (bytes; ~32k tokens of English).
pub const MEMO_TEXT_BYTES: usize = 128 << 10;

/// Bytes compared before a full scan of a candidate.
const HEAD: usize = 64;

/// Full scans per text (the most recent candidates first).
const MAX_SCANS: usize = 4;

#[derive(Debug, Default)]
struct Entry {
    text: String,
    ids: Vec<u32>,
    /// After each added token: where a split resumes, and the ids before it.
    cuts: Vec<(Resume, u32)>,
}

/// What a new text takes from a remembered one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Reuse {
    /// The entry (index, most recent first).
    pub slot: usize,
    /// Bytes the two texts share.
    pub common: usize,
    /// Cuts taken (the last one is `from`).
    pub cuts: usize,
    /// Where the split of the new text resumes.
    pub from: Resume,
    /// Ids before `from`.
    pub ids: usize,
}

/// The memo (see the module doc). Not `Sync`: one per core.
#[derive(Debug)]
pub(super) struct TextMemo {
    entries: RecentSlots<Entry>,
}

impl Default for TextMemo {
    fn default() -> Self {
        TextMemo {
            entries: RecentSlots::new(MEMO_TEXTS),
        }
    }
}

impl TextMemo {
    /// The best reuse for `text`, whose cuts must be followed by `window` agreeing bytes.
    pub fn find(&self, text: &str, window: usize) -> Option<Reuse> {
        let t = text.as_bytes();
        let head = &t[..t.len().min(HEAD)];
        self.entries.best(
            MAX_SCANS,
            |e| e.text.as_bytes().get(..head.len()) == Some(head),
            |slot, e| {
                let common = common_prefix(e.text.as_bytes(), t);
                // The last cut whose window lies inside the shared bytes (`done` ≥ `resume`).
                let cuts = e.cuts.partition_point(|(r, _)| r.done + window < common);
                let (from, ids) = *e.cuts.get(cuts.checked_sub(1)?)?;
                let reuse = Reuse {
                    slot,
                    common,
                    cuts,
                    from,
                    ids: ids as usize,
                };
                Some((from.done, reuse))
            },
        )
    }

    /// The remembered ids and cuts of `slot`.
    pub fn entry(&self, slot: usize) -> (&[u32], &[(Resume, u32)]) {
        let e = self.entries.get(slot);
        (&e.ids, &e.cuts)
    }

    /// Remembers `text` (its `ids`, its `cuts`, swapped in), over the entry it reused or
    /// another (see [`RecentSlots::claim`]). Texts over [`MEMO_TEXT_BYTES`] are not kept.
    pub fn store(
        &mut self,
        reused: Option<Reuse>,
        text: &str,
        ids: &[u32],
        cuts: &mut Vec<(Resume, u32)>,
    ) {
        if text.len() > MEMO_TEXT_BYTES {
            return;
        }
        let (e, _) = self
            .entries
            .claim(reused.map(|r| (r.slot, r.common)), |e| e.text.len());
        e.text.clear();
        e.text.push_str(text);
        e.ids.clear();
        e.ids.extend_from_slice(ids);
        std::mem::swap(&mut e.cuts, cuts);
    }

    /// Texts held and their bytes (for the bound's test).
    #[cfg(test)]
    pub fn held(&self) -> (usize, usize) {
        (
            self.entries.len(),
            self.entries.iter().map(|e| e.text.len()).sum(),
        )
    }
}
