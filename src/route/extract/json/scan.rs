//! The byte-level work of the body parser, pure functions on slices: finding a string's end 32 or
//! 64 bytes at a time (a byte at a time on the portable [`Kernel`]), checking its escapes, and
//! unescaping it straight into the routing text. A chat body is mostly long strings, so this loop
//! is where the parse spends its time; the same loads also tell whether the string holds a byte of
//! 0x80 or above (only such a string needs a UTF-8 check).

use super::{Isa, Kernel};

/// A string's body (between its quotes) as the scan found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StringEnd {
    /// Offset of the closing quote.
    pub end: usize,
    /// The string holds at least one escape (it cannot be borrowed as it is).
    pub escaped: bool,
    /// Some byte in the string may be 0x80 or above (set conservatively: a check it asks for
    /// is never wrong, only sometimes unneeded).
    pub non_ascii: bool,
}

/// Why a string is not valid JSON, at a byte offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StringError {
    /// The input ends inside the string.
    Eof,
    /// A byte below 0x20 (JSON requires it escaped).
    Control(usize),
    /// A backslash followed by a byte that starts no escape.
    BadEscape(usize),
    /// `\u` not followed by four hex digits.
    BadUnicodeEscape(usize),
    /// A `\u` surrogate without its pair (only when unescaping: a skipped string is held to
    /// the hex digits, as serde_json's skip holds it).
    LoneSurrogate(usize),
}

/// Offset of the first byte at or after `from` that is `"`, `\` or below 0x20, and whether a
/// byte of 0x80 or above may lie before it.
#[inline]
pub fn find_special(b: &[u8], from: usize, kernel: Kernel) -> (Option<usize>, bool) {
    let found = find_special_packed(b, from, kernel);
    let at = found & !HIGH_SEEN;
    (
        (at != NOT_FOUND).then_some(at as usize),
        found & HIGH_SEEN != 0,
    )
}

/// The vector loops answer in one register (a pair of an option and a flag is returned
/// through memory, and reading it back after every call was a fifth of the string walk):
/// the offset in the low 63 bits, [`NOT_FOUND`] there when none, [`HIGH_SEEN`] on top.
const HIGH_SEEN: u64 = 1 << 63;
/// The offset field of an answer that found no special byte (no slice is that long).
const NOT_FOUND: u64 = HIGH_SEEN - 1;

#[inline(always)]
fn packed(at: Option<usize>, high: bool) -> u64 {
    at.map_or(NOT_FOUND, |at| at as u64) | if high { HIGH_SEEN } else { 0 }
}

#[inline]
fn find_special_packed(b: &[u8], from: usize, kernel: Kernel) -> u64 {
    match kernel.0 {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if b.len() - from.min(b.len()) >= 64 => {
            // SAFETY: a kernel is AVX2 only on a CPU that has it (see `Kernel`).
            unsafe { find_special_avx2(b, from) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Sse2 => {
            // SAFETY: SSE2 is part of the x86_64 baseline.
            unsafe { find_special_sse2(b, from) }
        }
        Isa::Portable => {
            let (at, high) = find_special_portable(b, from);
            packed(at, high)
        }
    }
}

#[inline(always)]
fn is_special(c: u8) -> bool {
    c == b'"' || c == b'\\' || c < 0x20
}

/// The byte-by-byte version: other targets, the vector loops' tail, and their check in tests.
fn find_special_portable(b: &[u8], from: usize) -> (Option<usize>, bool) {
    let mut non_ascii = false;
    for (i, &c) in b.iter().enumerate().skip(from) {
        if is_special(c) {
            return (Some(i), non_ascii);
        }
        non_ascii |= c >= 0x80;
    }
    (None, non_ascii)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse2")]
unsafe fn find_special_sse2(b: &[u8], from: usize) -> u64 {
    use std::arch::x86_64::*;
    let quote = _mm_set1_epi8(b'"' as i8);
    let backslash = _mm_set1_epi8(b'\\' as i8);
    let control_max = _mm_set1_epi8(0x1f);
    let mut i = from;
    let mut high = 0i32;
    // Bit per byte that ends the run: a quote, a backslash, or a byte at most 0x1f (the
    // unsigned max with 0x1f is 0x1f exactly for those).
    let special = |v: __m128i| {
        let q = _mm_cmpeq_epi8(v, quote);
        let s = _mm_cmpeq_epi8(v, backslash);
        let c = _mm_cmpeq_epi8(_mm_max_epu8(v, control_max), control_max);
        _mm_movemask_epi8(_mm_or_si128(_mm_or_si128(q, s), c))
    };
    while i + 32 <= b.len() {
        // SAFETY: i + 32 <= len: both 16-byte loads are inside `b` (unaligned loads).
        let (v0, v1) = unsafe {
            (
                _mm_loadu_si128(b.as_ptr().add(i) as *const __m128i),
                _mm_loadu_si128(b.as_ptr().add(i + 16) as *const __m128i),
            )
        };
        let m = (special(v0) as u32) | ((special(v1) as u32) << 16);
        let h = (_mm_movemask_epi8(v0) as u32) | ((_mm_movemask_epi8(v1) as u32) << 16);
        if m != 0 {
            let at = m.trailing_zeros();
            let before = h & ((1u32 << at) - 1);
            return packed(Some(i + at as usize), high != 0 || before != 0);
        }
        high |= h as i32;
        i += 32;
    }
    let (at, tail_high) = find_special_portable(b, i);
    packed(at, high != 0 || tail_high)
}

/// [`find_special_sse2`] 64 bytes a step: long prompts are most of a chat body.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn find_special_avx2(b: &[u8], from: usize) -> u64 {
    use std::arch::x86_64::*;
    let quote = _mm256_set1_epi8(b'"' as i8);
    let backslash = _mm256_set1_epi8(b'\\' as i8);
    let control_max = _mm256_set1_epi8(0x1f);
    let mut i = from;
    let mut high = 0u64;
    while i + 64 <= b.len() {
        // SAFETY: i + 64 <= len: both 32-byte loads are inside `b` (unaligned loads).
        let (v0, v1) = unsafe {
            (
                _mm256_loadu_si256(b.as_ptr().add(i) as *const __m256i),
                _mm256_loadu_si256(b.as_ptr().add(i + 32) as *const __m256i),
            )
        };
        let special = |v: __m256i| {
            let q = _mm256_cmpeq_epi8(v, quote);
            let s = _mm256_cmpeq_epi8(v, backslash);
            let c = _mm256_cmpeq_epi8(_mm256_max_epu8(v, control_max), control_max);
            _mm256_movemask_epi8(_mm256_or_si256(_mm256_or_si256(q, s), c)) as u32 as u64
        };
        let m = special(v0) | (special(v1) << 32);
        let h = (_mm256_movemask_epi8(v0) as u32 as u64)
            | ((_mm256_movemask_epi8(v1) as u32 as u64) << 32);
        if m != 0 {
            let at = m.trailing_zeros();
            let before = h & ((1u64 << at) - 1);
            return packed(Some(i + at as usize), high != 0 || before != 0);
        }
        high |= h;
        i += 64;
    }
    // SAFETY: SSE2 is part of the x86_64 baseline.
    let tail = unsafe { find_special_sse2(b, i) };
    match high {
        0 => tail,
        _ => tail | HIGH_SEEN,
    }
}

/// Scans the string whose opening quote is just before `start`: finds its closing quote and
/// checks every escape (the `\u` escapes for four hex digits only).
pub fn scan_string(b: &[u8], start: usize, kernel: Kernel) -> Result<StringEnd, StringError> {
    walk_string(b, start, kernel, |_, at, escape| match escape {
        true => escape_len(b, at),
        false => Ok(0),
    })
}

/// The loop both readings share: `step(run, at, escape)` is told of each plain run's start and
/// end, at a backslash (`escape`, answering the escape's length) and at the closing quote of a
/// string that had escapes.
#[inline(always)]
fn walk_string(
    b: &[u8],
    start: usize,
    kernel: Kernel,
    mut step: impl FnMut(usize, usize, bool) -> Result<usize, StringError>,
) -> Result<StringEnd, StringError> {
    let mut i = start;
    let mut escaped = false;
    let mut non_ascii = false;
    loop {
        let (at, high) = find_special(b, i, kernel);
        non_ascii |= high;
        let Some(at) = at else {
            return Err(StringError::Eof);
        };
        match b[at] {
            b'"' => {
                if escaped {
                    step(i, at, false)?;
                }
                return Ok(StringEnd {
                    end: at,
                    escaped,
                    non_ascii,
                });
            }
            b'\\' => {
                escaped = true;
                i = at + step(i, at, true)?;
            }
            _ => return Err(StringError::Control(at)),
        }
    }
}

/// Length of the escape whose backslash is at `at` (2, or 6 for `\u`), checked.
pub(super) fn escape_len(b: &[u8], at: usize) -> Result<usize, StringError> {
    match b.get(at + 1) {
        None => Err(StringError::Eof),
        Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => Ok(2),
        Some(b'u') => {
            hex4(b, at)?;
            Ok(6)
        }
        Some(_) => Err(StringError::BadEscape(at)),
    }
}

/// The four hex digits after the `\u` at `at`.
fn hex4(b: &[u8], at: usize) -> Result<u16, StringError> {
    let Some(digits) = b.get(at + 2..at + 6) else {
        // Too few bytes left: a digit missing at the end of the input is an EOF, else a
        // non-digit came first.
        let rest = &b[(at + 2).min(b.len())..];
        return if rest.iter().all(u8::is_ascii_hexdigit) {
            Err(StringError::Eof)
        } else {
            Err(StringError::BadUnicodeEscape(at))
        };
    };
    let mut n = 0u16;
    for &d in digits {
        let v = match d {
            b'0'..=b'9' => d - b'0',
            b'a'..=b'f' => d - b'a' + 10,
            b'A'..=b'F' => d - b'A' + 10,
            _ => return Err(StringError::BadUnicodeEscape(at)),
        };
        n = n << 4 | v as u16;
    }
    Ok(n)
}

/// Reads the string whose opening quote is just before `start`, as [`scan_string`] does, and
/// unescapes it into `out` in the same pass when it has escapes (`out` is left alone when it
/// has none: the string is then `b[start..end]` as it is). The `\u` escapes must form whole
/// characters (a surrogate only with its pair), serde_json's rule for a string it reads.
pub fn read_string(
    b: &[u8],
    start: usize,
    out: &mut Vec<u8>,
    kernel: Kernel,
) -> Result<StringEnd, StringError> {
    walk_string(b, start, kernel, |run, at, escape| {
        out.extend_from_slice(&b[run..at]);
        if !escape {
            return Ok(0);
        }
        let (ch, len) = decode_escape(b, at)?;
        let mut utf8 = [0u8; 4];
        out.extend_from_slice(ch.encode_utf8(&mut utf8).as_bytes());
        Ok(len)
    })
}

/// The character of the escape at `at` and the escape's length; a `\u` surrogate must be
/// followed by the `\u` of its pair (serde_json's rule for a string it parses).
fn decode_escape(raw: &[u8], at: usize) -> Result<(char, usize), StringError> {
    let simple = match raw.get(at + 1) {
        Some(b'"') => '"',
        Some(b'\\') => '\\',
        Some(b'/') => '/',
        Some(b'b') => '\u{8}',
        Some(b'f') => '\u{c}',
        Some(b'n') => '\n',
        Some(b'r') => '\r',
        Some(b't') => '\t',
        Some(b'u') => return decode_unicode(raw, at),
        Some(_) => return Err(StringError::BadEscape(at)),
        None => return Err(StringError::Eof),
    };
    Ok((simple, 2))
}

fn decode_unicode(raw: &[u8], at: usize) -> Result<(char, usize), StringError> {
    let n = hex4(raw, at)?;
    match n {
        0xDC00..=0xDFFF => Err(StringError::LoneSurrogate(at)),
        0xD800..=0xDBFF => {
            if raw.get(at + 6..at + 8) != Some(b"\\u") {
                return Err(StringError::LoneSurrogate(at));
            }
            let n2 = hex4(raw, at + 6)?;
            if !(0xDC00..=0xDFFF).contains(&n2) {
                return Err(StringError::LoneSurrogate(at + 6));
            }
            let c = 0x1_0000 + (((n as u32 - 0xD800) << 10) | (n2 as u32 - 0xDC00));
            char::from_u32(c)
                .map(|c| (c, 12))
                .ok_or(StringError::LoneSurrogate(at))
        }
        _ => char::from_u32(n as u32)
            .map(|c| (c, 6))
            .ok_or(StringError::LoneSurrogate(at)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn specials_are_found_at_every_offset_and_length() {
        for k in Kernel::available() {
            for len in 0..140 {
                for at in 0..len {
                    for special in [b'"', b'\\', 0u8, 0x1f] {
                        let mut b = vec![b'a'; len];
                        b[at] = special;
                        assert_eq!(
                            find_special(&b, 0, k),
                            (Some(at), false),
                            "{k:?} {len} {at}"
                        );
                        // High bytes before and after the special one.
                        let mut h = b.clone();
                        if at > 0 {
                            h[at - 1] = 0xc3;
                            assert_eq!(
                                find_special(&h, 0, k),
                                (Some(at), true),
                                "{k:?} {len} {at}"
                            );
                        }
                    }
                }
                assert_eq!(find_special(&vec![b'a'; len], 0, k).0, None);
                assert_eq!(find_special(&vec![0x80; len], 0, k), (None, len > 0));
            }
            // 0x20 and 0x7f and high bytes are not special.
            assert_eq!(find_special(b" \x7f\xff\"", 0, k), (Some(3), true));
        }
    }

    #[test]
    fn strings_end_at_their_unescaped_quote() {
        for k in Kernel::available() {
            let b = br#"ab\"c\\"rest"#;
            assert_eq!(
                scan_string(b, 0, k),
                Ok(StringEnd {
                    end: 7,
                    escaped: true,
                    non_ascii: false
                })
            );
            let scan = |b: &[u8]| scan_string(b, 0, k);
            assert_eq!(scan(b"abc"), Err(StringError::Eof));
            assert_eq!(scan(b"a\\"), Err(StringError::Eof));
            assert_eq!(scan(b"a\tb\""), Err(StringError::Control(1)));
            assert_eq!(scan(b"a\\xb\""), Err(StringError::BadEscape(1)));
            assert_eq!(scan(b"a\\u12G4\""), Err(StringError::BadUnicodeEscape(1)));
            assert_eq!(scan(b"a\\u12"), Err(StringError::Eof));
            // A skipped lone surrogate is only held to its digits.
            assert!(scan(b"\\udc00\"").is_ok());
        }
    }

    /// A string read (quote included) from a body of one string.
    fn read(body: &[u8], k: Kernel) -> Result<Vec<u8>, StringError> {
        let mut out = Vec::new();
        let end = read_string(body, 1, &mut out, k)?;
        if !end.escaped {
            out = body[1..end.end].to_vec();
        }
        Ok(out)
    }

    #[test]
    fn reading_decodes_pairs_and_refuses_lone_surrogates() {
        for k in Kernel::available() {
            let s = read(br#""a\ud83d\ude00b\n\u00e9\/""#, k).unwrap();
            assert_eq!(String::from_utf8(s).unwrap(), "a\u{1f600}b\né/");
            assert_eq!(read(br#""plain""#, k).unwrap(), b"plain");
            for (bad, at) in [
                (&br#""x\ud800""#[..], 2),
                (br#""x\udc00""#, 2),
                (br#""x\ud800x""#, 2),
                (br#""x\ud800\n""#, 2),
                (br#""x\ud800\u0041""#, 8),
            ] {
                assert_eq!(read(bad, k), Err(StringError::LoneSurrogate(at)), "{bad:?}");
            }
            assert_eq!(read(b"\"x\\u12", k), Err(StringError::Eof));
            assert_eq!(read(b"\"x\ty\"", k), Err(StringError::Control(2)));
        }
    }

    proptest! {
        #[test]
        fn the_vector_scan_is_the_byte_scan(
            b in proptest::collection::vec(
                prop_oneof![Just(b'a'), Just(b'"'), Just(b'\\'), Just(0x05u8), Just(0xe9u8), any::<u8>()],
                0..200,
            ),
            from in 0usize..200,
        ) {
            let from = from.min(b.len());
            let (want_at, want_high) = find_special_portable(&b, from);
            for k in Kernel::available() {
                let (at, high) = find_special(&b, from, k);
                prop_assert_eq!(at, want_at, "{:?}", k);
                // A vector scan may report a high byte conservatively only when one is there.
                let high_there = b[from..].iter().any(|&c| c >= 0x80);
                prop_assert!(high == want_high || (high && !want_high && high_there));
            }
        }

        /// Any text, escaped as serde_json escapes it, reads back; the skip finds the same end.
        #[test]
        fn reading_inverts_serde_json_escaping(s in "[a-zé\\\\\"\n\t\u{1F600}\u{1}/ ]{0,40}") {
            let json = serde_json::to_string(&s).unwrap();
            for k in Kernel::available() {
                let end = scan_string(json.as_bytes(), 1, k).unwrap();
                prop_assert_eq!(end.end, json.len() - 1);
                prop_assert_eq!(read(json.as_bytes(), k).unwrap(), s.as_bytes());
            }
        }
    }
}
