//! UTF-8 text helpers shared by the tree, the routing policies and the writer: counting
//! characters, common prefixes that never split a character, and cutting text at character
//! boundaries. One implementation each, on bytes where the hot paths hold bytes.
//!
//! "Character" means a Unicode scalar value (what `str::chars` yields). The byte-slice helpers
//! expect valid UTF-8 that starts at a character boundary (a whole `str` or a slice of one cut at
//! boundaries); that is what every caller holds.

/// `true` when `b` starts a UTF-8 character, i.e. is not a continuation byte `10xx_xxxx`. The
/// signed compare is one instruction and lets counting loops vectorise.
#[inline(always)]
fn is_char_start(b: u8) -> bool {
    (b as i8) >= -0x40
}

/// Words summed in 8-bit lanes before they are widened: each word adds at most 1 to a lane.
const WORDS_PER_SUM: usize = 255;
/// The top bit of every byte of a word.
const HIGH_BITS: u64 = 0x8080_8080_8080_8080;
/// Every other byte of a word.
const EVEN_BYTES: u64 = 0x00ff_00ff_00ff_00ff;

/// Characters in `bytes` (valid UTF-8 starting at a boundary): the bytes that do not continue a
/// sequence. Same as `str::chars().count()`. The tree and the policies count characters of
/// every request (a 400 KiB prompt several times), so this runs at memory speed: continuation
/// bytes (`10xxxxxx`) are found eight at a time in 64-bit words and summed in byte lanes,
/// widened once every 255 words. `filter().count()` was not vectorised and ran at about
/// 2 bytes per ns (seen in a profile at 16 KiB prompts); this is about 10 times faster
/// (`cargo bench --bench select -- char_count`).
#[inline]
pub fn char_count(bytes: &[u8]) -> usize {
    let (words, tail) = bytes.split_at(bytes.len() - bytes.len() % 8);
    let mut continuing = 0usize;
    for run in words.chunks(8 * WORDS_PER_SUM) {
        let mut lanes = 0u64;
        for w in run.chunks_exact(8) {
            let w = u64::from_le_bytes(w.try_into().unwrap_or_default());
            // Bit 7 of a byte set and bit 6 clear (bit 6 shifted up by one, within the byte),
            // moved down to bit 0: 1 in each lane holding a continuation byte.
            lanes += (w & !(w << 1) & HIGH_BITS) >> 7;
        }
        // Lanes hold at most 255: pairs fit 16 bits, and the multiply adds the four pairs.
        let pairs = (lanes & EVEN_BYTES) + ((lanes >> 8) & EVEN_BYTES);
        continuing += (pairs.wrapping_mul(0x0001_0001_0001_0001) >> 48) as usize;
    }
    words.len() - continuing + tail.iter().filter(|&&b| is_char_start(b)).count()
}

/// Moves byte offset `n` back to the nearest character boundary of `s` (valid UTF-8 starting at
/// a boundary); offsets at or past the end are returned unchanged. Works on bytes because the
/// tree's keys and edges are byte slices.
#[inline]
pub fn floor_char_boundary(s: &[u8], mut n: usize) -> usize {
    while n > 0 && n < s.len() && !is_char_start(s[n]) {
        n -= 1;
    }
    n
}

/// Length in bytes of the common prefix of `a` and `b`, cut back to a character boundary of `a`,
/// so `&a[..n]` is whole characters (for valid UTF-8 `b` it is a boundary of `b` too). Prefix
/// matching of prompts (tree lookups, recent inserts) runs on every request, so the compare is
/// block-wise: see [`common_byte_prefix`].
#[inline]
pub fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    floor_char_boundary(a, common_byte_prefix(a, b))
}

/// Bytes compared by one `memcmp` (slice equality) before the block loop looks for the first
/// difference: libc's compare uses the widest vectors the CPU has (AVX2, AVX-512) where the
/// loop below is held to the SSE2 baseline: an equal prompt (routed again) is compared in
/// 36-46 % less time at 1 KiB to 400 KiB (`cargo bench --bench select -- common_prefix`); a
/// chunk that differs costs one more pass over at most this much (+8 ns at 1 KiB).
const EQUAL_CHUNK: usize = 1024;

/// Length of the common prefix of `a` and `b` in bytes (may end inside a character). Skips
/// equal [`EQUAL_CHUNK`]s with `memcmp`, then compares 32-byte blocks (constant-size array
/// equality, which LLVM lowers to vector compares), then 8-byte words (the first differing
/// byte found from the XOR), then single bytes for the tail.
#[inline]
pub fn common_byte_prefix(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut i = 0;
    while i + EQUAL_CHUNK <= n && a[i..i + EQUAL_CHUNK] == b[i..i + EQUAL_CHUNK] {
        i += EQUAL_CHUNK;
    }
    while let (Some(x), Some(y)) = (a[i..].first_chunk::<32>(), b[i..].first_chunk::<32>()) {
        if x != y {
            break;
        }
        i += 32;
    }
    while let (Some(x), Some(y)) = (a[i..].first_chunk::<8>(), b[i..].first_chunk::<8>()) {
        let diff = u64::from_le_bytes(*x) ^ u64::from_le_bytes(*y);
        if diff != 0 {
            return i + (diff.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

/// The first `n` characters of `text` (all of it when shorter). `prefix_hash` hashes a prompt's
/// first characters, so the cut must count characters, not bytes.
pub fn prefix_chars(text: &str, n: usize) -> &str {
    if text.len() <= n {
        return text; // at most n bytes, hence at most n chars
    }
    match text.char_indices().nth(n) {
        Some((i, _)) => &text[..i],
        None => text,
    }
}

/// Routing text kept beyond its request (the text tree's inserts, the recent-insert ring):
/// bytes shared without a copy that are UTF-8 by construction, so the tree's writer reads them
/// as text without validating every insert again (that check was 3.7 % of a core at 16 KiB
/// conversations), and a text the extractor joined is handed over without copying it again.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SharedText(bytes::Bytes);

impl SharedText {
    /// A joined text, moved in without a copy.
    pub fn from_string(s: String) -> Self {
        SharedText(bytes::Bytes::from(s))
    }

    /// A copy of `s`.
    pub fn copy_of(s: &str) -> Self {
        SharedText(bytes::Bytes::copy_from_slice(s.as_bytes()))
    }

    /// `s` as a slice of `body` when it lies inside it (a string the extractor borrowed), else
    /// a copy.
    pub fn within(body: &bytes::Bytes, s: &str) -> Self {
        let (start, p) = (body.as_ptr() as usize, s.as_ptr() as usize);
        if !s.is_empty() && p >= start && p + s.len() <= start + body.len() {
            // Checked above: `slice_ref` panics on a slice outside `body`.
            SharedText(body.slice_ref(s.as_bytes()))
        } else {
            Self::copy_of(s)
        }
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        // SAFETY: every constructor takes its bytes from a `str` or a `String`, and the bytes
        // are never changed after (`Bytes` is immutable).
        unsafe { std::str::from_utf8_unchecked(&self.0) }
    }

    /// The bytes, shared.
    pub fn bytes(&self) -> &bytes::Bytes {
        &self.0
    }
}

impl std::ops::Deref for SharedText {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

#[cfg(test)]
mod tests;
