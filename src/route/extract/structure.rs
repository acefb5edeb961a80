//! One SIMD pass over a request body before it is parsed: the two facts the parser's fast skip
//! does not establish on its own. Values routing never reads (every message under a policy that
//! reads no text, a prompt past the routing text's cap, unknown fields) are then skipped by
//! sonic-rs's validating skip instead of being unescaped string by string. On the 16 KiB chat
//! body of `scripts/bench-vs-peers.sh` (few escapes) validation without text went from 6.3 to
//! 3.1 µs, this pass 0.7 µs of it; on bodies with an escape every few words the skip itself is
//! the cost and the two ways are even (`cargo bench --bench extract`).
//!
//! - **Nesting depth.** The skip recurses once per array or object level with no limit of its
//!   own, so a body of 100k `[` would overflow a serving core's stack. Brackets outside strings
//!   are counted here and a body deeper than [`MAX_NESTING`] is refused before any recursion.
//! - **`\u` escapes.** The skip eats the four characters after `\u` without looking at them;
//!   here each must be a hex digit (what serde's `IgnoredAny` checks), so a skipped string is
//!   held to the same rule as a parsed one.
//!
//! - **ASCII.** The same loads tell whether every byte is ASCII; such a body (most prompts)
//!   is UTF-8 by construction, so the extractor's separate UTF-8 pass is skipped for it.
//!
//! String boundaries follow the parser's own rule (a backslash escapes the next byte; `\u`
//! then four hex digits), so on a valid body the depth counted is the parser's. On an invalid
//! one the two agree up to the parser's first error, which is where it stops: the depth bound
//! holds for every level the skip can enter.

use super::MAX_NESTING;

/// Why a body fails the pass; the extractor answers it with 400.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StructureError {
    /// Arrays and objects nested deeper than [`MAX_NESTING`] (the top-level value counts).
    TooDeep,
    /// A `\u` not followed by four hex digits, at this byte offset (of the backslash).
    BadUnicodeEscape(usize),
}

/// What the pass learned of a body it accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Every byte is below 0x80: the body is valid UTF-8 without a check of its own.
    pub ascii: bool,
}

const BLOCK: usize = 64;
/// Bits at even positions.
const EVEN: u64 = 0x5555_5555_5555_5555;

/// Checks `body`'s nesting depth and `\u` escapes in one pass of 64-byte blocks, and whether
/// it is all ASCII.
pub fn check(body: &[u8]) -> Result<Shape, StructureError> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { x86::check_avx2(body) };
        }
        x86::check_sse2(body)
    }
    #[cfg(not(target_arch = "x86_64"))]
    check_portable(body)
}

/// The masks built byte by byte: other targets, and the check of the SIMD versions.
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
fn check_portable(body: &[u8]) -> Result<Shape, StructureError> {
    scan_blocks(body, |block, _, non_ascii| {
        *non_ascii |= !block.is_ascii();
        Some(portable_masks(block))
    })
}

/// The block loop every mask builder shares: `masks(block, scan, non_ascii)` gives a whole
/// block's masks, or `None` when [`Scan::inside_plain`] says the block changes nothing, and
/// sets `non_ascii` when the block holds a byte of 0x80 or above; the tail is padded.
#[inline(always)]
fn scan_blocks(
    body: &[u8],
    mut masks: impl FnMut(&[u8; BLOCK], &Scan, &mut bool) -> Option<Masks>,
) -> Result<Shape, StructureError> {
    let mut scan = Scan::default();
    let mut non_ascii = false;
    let whole = body.len() / BLOCK * BLOCK;
    for (i, block) in body[..whole].chunks_exact(BLOCK).enumerate() {
        let block: &[u8; BLOCK] = block.try_into().expect("chunks_exact yields BLOCK bytes");
        if let Some(m) = masks(block, &scan, &mut non_ascii) {
            scan.block(body, i * BLOCK, m)?;
        }
    }
    scan.tail(body, whole)?;
    Ok(Shape {
        ascii: !non_ascii && body[whole..].is_ascii(),
    })
}

/// Bit `i` set where byte `i` of a block is that character.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Masks {
    backslash: u64,
    quote: u64,
    /// `[` or `{`
    open: u64,
    /// `]` or `}`
    close: u64,
    /// `u` (a `\u` escape when escaped)
    u: u64,
}

/// What carries from one block into the next.
#[derive(Default)]
struct Scan {
    /// The next block's first byte is escaped (the last byte was an escaping backslash).
    escaped_carry: bool,
    /// The next block starts inside a string.
    in_string: bool,
    depth: i64,
}

impl Scan {
    /// Whether a block with these quotes and backslashes changes nothing: it lies inside one
    /// string (brackets there do not count) and escapes nothing.
    #[inline(always)]
    fn inside_plain(&self, quote: u64, backslash: u64) -> bool {
        self.in_string && !self.escaped_carry && quote | backslash == 0
    }

    /// The bytes from `at` to the end (fewer than a block), padded with spaces: no quote,
    /// backslash or bracket.
    fn tail(&mut self, body: &[u8], at: usize) -> Result<(), StructureError> {
        let rest = &body[at..];
        if rest.is_empty() {
            return Ok(());
        }
        let mut last = [b' '; BLOCK];
        last[..rest.len()].copy_from_slice(rest);
        self.block(body, at, portable_masks(&last))
    }

    /// One block at offset `at` of `body` (read past the block only for a `\u`'s digits).
    fn block(&mut self, body: &[u8], at: usize, m: Masks) -> Result<(), StructureError> {
        // Escaped bytes, found for the whole block at once: a byte is escaped when it follows
        // a run of backslashes of odd length. Adding a run's start bit to the run carries to
        // the byte just past it; the run is odd when that byte and the start differ in parity.
        let pending = u64::from(self.escaped_carry);
        // A backslash escaped by the previous block's last one starts nothing.
        let runs = m.backslash & !pending;
        let starts = runs & !(runs << 1);
        let (from_even, _) = runs.overflowing_add(starts & EVEN);
        // A run from an odd start through bit 63 is odd: it escapes the next block's first byte.
        let (from_odd, carry) = runs.overflowing_add(starts & !EVEN);
        let escaped = pending | (from_even & !runs & !EVEN) | (from_odd & !runs & EVEN);
        self.escaped_carry = carry;
        let mut unicode = escaped & m.u;
        while unicode != 0 {
            // The backslash is the byte before the `u` (in the previous block for bit 0).
            let pos = (at + unicode.trailing_zeros() as usize).saturating_sub(1);
            let hex = body.get(pos + 2..pos + 6);
            if !hex.is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)) {
                return Err(StructureError::BadUnicodeEscape(pos));
            }
            unicode &= unicode - 1;
        }
        let quotes = m.quote & !escaped;
        // Bit i set from an opening quote up to (not including) its closing quote.
        let mut inside = prefix_xor(quotes);
        if self.in_string {
            inside = !inside;
        }
        self.in_string = inside >> 63 == 1;
        let open = m.open & !inside;
        let close = m.close & !inside;
        if open == 0 && close == 0 {
            return Ok(());
        }
        let max = i64::from(MAX_NESTING);
        if close == 0 || self.depth + i64::from(open.count_ones()) <= max {
            self.depth += i64::from(open.count_ones()) - i64::from(close.count_ones());
            return if self.depth > max {
                Err(StructureError::TooDeep)
            } else {
                Ok(())
            };
        }
        let mut marks = open | close;
        while marks != 0 {
            let bit = marks & marks.wrapping_neg();
            self.depth += if open & bit != 0 { 1 } else { -1 };
            if self.depth > max {
                return Err(StructureError::TooDeep);
            }
            marks &= marks - 1;
        }
        Ok(())
    }
}

/// Bit i = parity of the set bits at or below i.
fn prefix_xor(mut x: u64) -> u64 {
    x ^= x << 1;
    x ^= x << 2;
    x ^= x << 4;
    x ^= x << 8;
    x ^= x << 16;
    x ^= x << 32;
    x
}

/// The block loop with SSE2 (the x86_64 baseline) and AVX2 compares. A block inside a string
/// with no quote or backslash (most of a prompt) costs only those two compares.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{scan_blocks, Masks, Shape, StructureError};
    use std::arch::x86_64::*;

    /// 16 bytes compared with `c`, as a 16-bit mask.
    #[inline(always)]
    unsafe fn eq16(v: __m128i, c: u8) -> u64 {
        u64::from(_mm_movemask_epi8(_mm_cmpeq_epi8(v, _mm_set1_epi8(c as i8))) as u16)
    }

    pub(super) fn check_sse2(body: &[u8]) -> Result<Shape, StructureError> {
        scan_blocks(body, |block, scan, non_ascii| {
            // SAFETY: SSE2 is part of the x86_64 baseline; the four unaligned 16-byte loads
            // read bytes 0..64 of the 64-byte block.
            let v: [__m128i; 4] = std::array::from_fn(|k| unsafe {
                _mm_loadu_si128(block.as_ptr().add(16 * k).cast::<__m128i>())
            });
            // SAFETY: SSE2 baseline, registers only. A byte's top bit is set from 0x80 up.
            *non_ascii |= unsafe {
                let any = _mm_or_si128(_mm_or_si128(v[0], v[1]), _mm_or_si128(v[2], v[3]));
                _mm_movemask_epi8(any) != 0
            };
            let all = |c: u8, folded: bool| {
                let mut m = 0;
                // SAFETY: SSE2 baseline, registers only.
                unsafe {
                    for (k, v) in v.iter().enumerate() {
                        // `[` 0x5B and `{` 0x7B (`]` 0x5D and `}` 0x7D) differ only in 0x20.
                        let v = if folded {
                            _mm_or_si128(*v, _mm_set1_epi8(0x20))
                        } else {
                            *v
                        };
                        m |= eq16(v, c) << (16 * k);
                    }
                }
                m
            };
            let (quote, backslash) = (all(b'"', false), all(b'\\', false));
            (!scan.inside_plain(quote, backslash)).then(|| Masks {
                backslash,
                quote,
                open: all(b'{', true),
                close: all(b'}', true),
                u: all(b'u', false),
            })
        })
    }

    /// 32 bytes compared with `c`, as a 32-bit mask.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn eq32(v: __m256i, c: u8) -> u64 {
        u64::from(_mm256_movemask_epi8(_mm256_cmpeq_epi8(v, _mm256_set1_epi8(c as i8))) as u32)
    }

    /// [`check_sse2`] with 32-byte compares.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn check_avx2(body: &[u8]) -> Result<Shape, StructureError> {
        scan_blocks(body, |block, scan, non_ascii| {
            // SAFETY: the two unaligned 32-byte loads read bytes 0..64 of the 64-byte block;
            // AVX2 is the caller's promise (this closure inherits the function's features).
            let (lo, hi) = unsafe {
                let p = block.as_ptr();
                (
                    _mm256_loadu_si256(p.cast::<__m256i>()),
                    _mm256_loadu_si256(p.add(32).cast::<__m256i>()),
                )
            };
            // A byte's top bit is set from 0x80 up.
            *non_ascii |= _mm256_movemask_epi8(_mm256_or_si256(lo, hi)) != 0;
            let both = |c: u8| unsafe { eq32(lo, c) | eq32(hi, c) << 32 };
            let (quote, backslash) = (both(b'"'), both(b'\\'));
            if scan.inside_plain(quote, backslash) {
                return None;
            }
            // `[` 0x5B and `{` 0x7B (`]` 0x5D and `}` 0x7D) differ only in 0x20.
            let lower = _mm256_set1_epi8(0x20);
            let (flo, fhi) = (_mm256_or_si256(lo, lower), _mm256_or_si256(hi, lower));
            let folded = |c: u8| unsafe { eq32(flo, c) | eq32(fhi, c) << 32 };
            Some(Masks {
                backslash,
                quote,
                open: folded(b'{'),
                close: folded(b'}'),
                u: both(b'u'),
            })
        })
    }
}

/// The masks byte by byte: other targets, and the check of the SIMD version.
fn portable_masks(block: &[u8; BLOCK]) -> Masks {
    let mut m = Masks {
        backslash: 0,
        quote: 0,
        open: 0,
        close: 0,
        u: 0,
    };
    for (i, &b) in block.iter().enumerate() {
        let bit = |hit: bool| u64::from(hit) << i;
        m.backslash |= bit(b == b'\\');
        m.quote |= bit(b == b'"');
        m.open |= bit(b == b'[' || b == b'{');
        m.close |= bit(b == b']' || b == b'}');
        m.u |= bit(b == b'u');
    }
    m
}

#[cfg(test)]
mod tests;
