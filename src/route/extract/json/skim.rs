//! A validating skip of a whole array or object 64 bytes a step, for the values routing never
//! reads: the chat messages past the routing cap, every message for the policies that read no
//! text, unknown fields. The string-at-a-time skip stops at every quote and backslash, and on a
//! chat body (a string every hundred bytes or so) those stops cost more than the scan between
//! them: each ends a vector loop on a branch no predictor can guess. Here each 64-byte block
//! yields bit masks of its quotes, backslashes and low bytes; which bytes are escaped and which
//! lie inside strings is worked out on the masks, and only the structure outside strings (the
//! brackets, commas and colons, and the first byte of each string, number and literal) goes
//! through a small state machine, one step a token.
//!
//! It answers only whether the value is valid and where it ends. A value it refuses, or one
//! nested deeper than it may go, is skipped again by the exact skip, which words the error, so
//! every verdict and message stays the exact skip's (checked against it in the tests below).
//! It runs on the AVX2 [`Kernel`] only: with masks built a byte at a time it measured 2 to 20 times
//! slower than the exact skip (about 0.2 GB/s against 0.6 to 4 GB/s on chat bodies, in a release
//! build), so the other kernels take the exact skip. The tests still run the walk on byte masks, on
//! every CPU, so what follows the masks (the escape carry, the string tracking across blocks, the
//! grammar) is checked on a machine without AVX2 too.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

use super::Kernel;

/// End of the array or object whose opening bracket is at `at` (the offset past its closing
/// bracket), when it is valid JSON nested at most `room` levels deep counting itself. `None`
/// when it is not, or on a kernel other than AVX2: the caller then runs the exact skip, which
/// also words the error.
pub fn skip_container(b: &[u8], at: usize, room: u32, kernel: Kernel) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    if kernel.0 == super::Isa::Avx2 {
        // SAFETY: a kernel is AVX2 only on a CPU that has AVX2 and PCLMULQDQ (`Kernel`).
        return unsafe { skip_container_avx2(b, at, room) };
    }
    let _ = (b, at, room, kernel);
    None
}

/// Whether [`skip_container`] answers on `kernel` at all (else it always defers to the exact
/// skip, and comparing it with that says nothing).
#[cfg(test)]
pub fn runs_on(kernel: Kernel) -> bool {
    #[cfg(target_arch = "x86_64")]
    if kernel.0 == super::Isa::Avx2 {
        return true;
    }
    let _ = kernel;
    false
}

/// What a block of 64 bytes holds, a bit per byte (bit `i` is byte `i` of the block).
#[cfg_attr(test, derive(Debug, PartialEq, Eq))]
struct Masks {
    quote: u64,
    backslash: u64,
    /// Bytes below 0x20: refused inside strings, whitespace or an error outside.
    control: u64,
    /// Bytes up to 0x20: the control bytes and the space.
    low: u64,
}

/// Where [`walk`] gets a block's masks: vector compares, or (in tests) a byte at a time. The
/// walk is one function over both, so the tests that run it on bytes check the state machine,
/// the escape carry and the string tracking that the vector kernel runs.
trait Blocks {
    /// A block's masks (see [`masks_avx2`] for when they are `None`); its bytes count towards
    /// [`Blocks::high_seen`].
    ///
    /// # Safety
    /// The CPU runs the implementation's instructions.
    unsafe fn masks(&mut self, block: &[u8; 64], in_text: bool) -> Option<Masks>;

    /// Bit `i` set: an odd number of bits among bits `0..=i` of `x`.
    ///
    /// # Safety
    /// As for [`Blocks::masks`].
    unsafe fn prefix_xor(&self, x: u64) -> u64;

    /// Whether a byte of 0x80 or above was in any block so far.
    ///
    /// # Safety
    /// As for [`Blocks::masks`].
    unsafe fn high_seen(&self) -> bool;
}

/// The AVX2 kernel's masks; the bytes seen OR-ed together in `high`.
#[cfg(target_arch = "x86_64")]
struct VectorBlocks {
    high: std::arch::x86_64::__m256i,
}

#[cfg(target_arch = "x86_64")]
impl Blocks for VectorBlocks {
    #[inline(always)]
    unsafe fn masks(&mut self, block: &[u8; 64], in_text: bool) -> Option<Masks> {
        // SAFETY: `block` is 64 readable bytes; the caller vouches for AVX2.
        unsafe { masks_avx2(block.as_ptr(), &mut self.high, in_text) }
    }

    #[inline(always)]
    unsafe fn prefix_xor(&self, x: u64) -> u64 {
        // SAFETY: the caller vouches for PCLMULQDQ.
        unsafe { prefix_xor_clmul(x) }
    }

    #[inline(always)]
    unsafe fn high_seen(&self) -> bool {
        // SAFETY: the caller vouches for AVX2.
        unsafe { std::arch::x86_64::_mm256_movemask_epi8(self.high) != 0 }
    }
}

/// The masks a byte at a time: the reference the vector masks are held to, and what lets the
/// walk be tested on a CPU without AVX2.
#[cfg(test)]
#[derive(Default)]
struct ByteBlocks {
    high: u8,
}

#[cfg(test)]
impl Blocks for ByteBlocks {
    #[inline(always)]
    unsafe fn masks(&mut self, block: &[u8; 64], in_text: bool) -> Option<Masks> {
        let mut m = Masks {
            quote: 0,
            backslash: 0,
            control: 0,
            low: 0,
        };
        for (i, &c) in block.iter().enumerate() {
            m.quote |= u64::from(c == b'"') << i;
            m.backslash |= u64::from(c == b'\\') << i;
            m.control |= u64::from(c < 0x20) << i;
            m.low |= u64::from(c <= 0x20) << i;
            self.high |= c;
        }
        if in_text && m.quote | m.backslash | m.control == 0 {
            return None;
        }
        Some(m)
    }

    #[inline(always)]
    unsafe fn prefix_xor(&self, mut x: u64) -> u64 {
        for shift in [1, 2, 4, 8, 16, 32] {
            x ^= x << shift;
        }
        x
    }

    #[inline(always)]
    unsafe fn high_seen(&self) -> bool {
        self.high >= 0x80
    }
}

/// One block's masks, its bytes OR-ed into `high` (whose top bits then tell whether any byte
/// of 0x80 or above was seen). `None` when `in_text` (the block starts inside a string, not
/// escaped) and it holds no quote, backslash or control byte: it is the string's plain text,
/// with nothing to check, which is most blocks of a chat body, so that case costs what the
/// string scan costs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn masks_avx2(
    p: *const u8,
    high: &mut std::arch::x86_64::__m256i,
    in_text: bool,
) -> Option<Masks> {
    use std::arch::x86_64::*;
    // SAFETY: the caller hands a pointer to 64 readable bytes (unaligned loads).
    let (v0, v1) = unsafe {
        (
            _mm256_loadu_si256(p as *const __m256i),
            _mm256_loadu_si256(p.add(32) as *const __m256i),
        )
    };
    *high = _mm256_or_si256(*high, _mm256_or_si256(v0, v1));
    let bits = |lo: __m256i, hi: __m256i| {
        (_mm256_movemask_epi8(lo) as u32 as u64) | ((_mm256_movemask_epi8(hi) as u32 as u64) << 32)
    };
    let (quote, backslash) = (_mm256_set1_epi8(b'"' as i8), _mm256_set1_epi8(b'\\' as i8));
    let (control_max, low_max) = (_mm256_set1_epi8(0x1f), _mm256_set1_epi8(0x20));
    let q = (_mm256_cmpeq_epi8(v0, quote), _mm256_cmpeq_epi8(v1, quote));
    let s = (
        _mm256_cmpeq_epi8(v0, backslash),
        _mm256_cmpeq_epi8(v1, backslash),
    );
    let c = (
        _mm256_cmpeq_epi8(_mm256_max_epu8(v0, control_max), control_max),
        _mm256_cmpeq_epi8(_mm256_max_epu8(v1, control_max), control_max),
    );
    if in_text {
        let any = |q, s, c| _mm256_or_si256(_mm256_or_si256(q, s), c);
        if bits(any(q.0, s.0, c.0), any(q.1, s.1, c.1)) == 0 {
            return None;
        }
    }
    Some(Masks {
        quote: bits(q.0, q.1),
        backslash: bits(s.0, s.1),
        control: bits(c.0, c.1),
        low: bits(
            _mm256_cmpeq_epi8(_mm256_max_epu8(v0, low_max), low_max),
            _mm256_cmpeq_epi8(_mm256_max_epu8(v1, low_max), low_max),
        ),
    })
}

/// Bit `i` set: an odd number of quotes among bits `0..=i` (the bytes from an opening quote up
/// to, not including, its closing one).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "pclmulqdq")]
#[inline]
unsafe fn prefix_xor_clmul(x: u64) -> u64 {
    use std::arch::x86_64::*;
    // A carry-less product with all ones XORs every bit into all the bits above it.
    let product = _mm_clmulepi64_si128(_mm_set_epi64x(0, x as i64), _mm_set1_epi8(-1), 0);
    _mm_cvtsi128_si64(product) as u64
}

/// The set bits of a mask, lowest first.
struct Bits(u64);

impl Iterator for Bits {
    type Item = u32;

    #[inline(always)]
    fn next(&mut self) -> Option<u32> {
        let i = (self.0 != 0).then(|| self.0.trailing_zeros())?;
        self.0 &= self.0 - 1;
        Some(i)
    }
}

/// The bytes of a block that a backslash escapes, from its backslashes in order (a backslash
/// that is itself escaped escapes nothing). `carry` enters as 1 when the block's first byte is
/// escaped by the previous block's last backslash and leaves as the same for the next block.
/// Backslashes are rare in a body, so a loop over them costs less than the branch-free form.
fn escaped_bytes(backslash: u64, carry: &mut u64) -> u64 {
    let mut escaped = *carry;
    *carry = 0;
    for i in Bits(backslash) {
        match (escaped >> i & 1 == 1, i) {
            (true, _) => {}
            (false, 63) => *carry = 1,
            (false, _) => escaped |= 1 << (i + 1),
        }
    }
    escaped
}

/// The bits of `mask` (a block at offset `base`) whose byte's offset `ok` refuses.
fn refused(base: usize, mask: u64, ok: impl Fn(usize) -> bool) -> u64 {
    Bits(mask)
        .filter(|&i| !ok(base + i as usize))
        .fold(0, |bad, i| bad | 1 << i)
}

/// The escaped bytes (bits of `escaped`) that start no escape, by the string scan's own rule
/// (so `\u` needs four hex digits, as the exact skip holds it). An escaped byte's backslash is
/// the byte before it.
fn bad_escapes(b: &[u8], base: usize, escaped: u64) -> u64 {
    refused(base, escaped, |at| {
        super::scan::escape_len(b, at - 1).is_ok()
    })
}

/// The control bytes outside strings (bits of `control`) that are not whitespace.
fn bad_controls(b: &[u8], base: usize, control: u64) -> u64 {
    refused(base, control, |at| {
        matches!(b.get(at), Some(b'\t' | b'\n' | b'\r'))
    })
}

/// The end of the number starting at `i` under the JSON grammar (the exact skip's rule: the
/// grammar only, no range), `None` when it breaks it.
fn number_end(b: &[u8], mut i: usize) -> Option<usize> {
    let digits = |i: &mut usize| {
        let from = *i;
        while b.get(*i).is_some_and(u8::is_ascii_digit) {
            *i += 1;
        }
        *i > from
    };
    i += (b.get(i) == Some(&b'-')) as usize;
    match b.get(i)? {
        b'0' => i += 1,
        b'1'..=b'9' => {
            digits(&mut i);
        }
        _ => return None,
    }
    if b.get(i) == Some(&b'.') {
        i += 1;
        if !digits(&mut i) {
            return None;
        }
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        i += matches!(b.get(i), Some(b'+' | b'-')) as usize;
        if !digits(&mut i) {
            return None;
        }
    }
    // A digit straight after a leading zero (`01`) is not a number's continuation.
    match b.get(i).is_some_and(u8::is_ascii_digit) {
        true => None,
        false => Some(i),
    }
}

/// What the next token outside strings may be.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// A value (after a `:` or an array's `,`).
    Value,
    /// A value or `]` (just after `[`).
    FirstValue,
    /// A key (after an object's `,`).
    Key,
    /// A key or `}` (just after `{`).
    FirstKey,
    Colon,
    /// `,` or the container's closing bracket (after a value).
    Comma,
}

/// The grammar outside strings: the token expected next and the open containers, a bit each
/// (set for an object), innermost lowest.
struct Grammar {
    expect: Expect,
    depth: u32,
    room: u32,
    objects: u128,
}

/// What a token did.
enum Step {
    /// Go on; tokens before this offset are inside the one just read (a number or literal).
    Next(usize),
    /// The outermost container closed.
    Done,
}

impl Grammar {
    fn new(room: u32) -> Grammar {
        Grammar {
            expect: Expect::Value,
            depth: 0,
            // 128 levels fit the bit stack; MAX_NESTING is 128.
            room: room.min(128),
            objects: 0,
        }
    }

    fn in_object(&self) -> bool {
        self.objects & 1 == 1
    }

    /// The token whose first byte is `b[at]`; `None` when the grammar has no place for it.
    #[inline(always)]
    fn step(&mut self, b: &[u8], at: usize) -> Option<Step> {
        let c = *b.get(at)?;
        match self.expect {
            Expect::FirstValue if c == b']' => self.close(),
            Expect::Value | Expect::FirstValue => self.value(b, at, c),
            Expect::Key | Expect::FirstKey if c == b'"' => {
                self.expect = Expect::Colon;
                Some(Step::Next(0))
            }
            Expect::FirstKey if c == b'}' => self.close(),
            Expect::Colon if c == b':' => {
                self.expect = Expect::Value;
                Some(Step::Next(0))
            }
            Expect::Comma => match (c, self.in_object()) {
                (b',', true) => {
                    self.expect = Expect::Key;
                    Some(Step::Next(0))
                }
                (b',', false) => {
                    self.expect = Expect::Value;
                    Some(Step::Next(0))
                }
                (b'}', true) | (b']', false) => self.close(),
                _ => None,
            },
            _ => None,
        }
    }

    fn value(&mut self, b: &[u8], at: usize, c: u8) -> Option<Step> {
        let word = |w: &[u8]| b.get(at..at + w.len()) == Some(w);
        let end = match c {
            b'"' => 0,
            b'{' | b'[' => {
                if self.depth == self.room {
                    return None;
                }
                self.depth += 1;
                self.objects = self.objects << 1 | (c == b'{') as u128;
                self.expect = match c {
                    b'{' => Expect::FirstKey,
                    _ => Expect::FirstValue,
                };
                return Some(Step::Next(0));
            }
            b't' if word(b"true") => at + 4,
            b'f' if word(b"false") => at + 5,
            b'n' if word(b"null") => at + 4,
            b'-' | b'0'..=b'9' => number_end(b, at)?,
            _ => return None,
        };
        self.expect = Expect::Comma;
        Some(Step::Next(end))
    }

    fn close(&mut self) -> Option<Step> {
        self.depth -= 1;
        self.objects >>= 1;
        self.expect = Expect::Comma;
        match self.depth {
            0 => Some(Step::Done),
            _ => Some(Step::Next(0)),
        }
    }
}

/// The skip on the AVX2 kernel: the walk with its vector masks inlined into this function,
/// which is compiled for the features they need.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,pclmulqdq")]
unsafe fn skip_container_avx2(b: &[u8], at: usize, room: u32) -> Option<usize> {
    let blocks = VectorBlocks {
        high: std::arch::x86_64::_mm256_setzero_si256(),
    };
    // SAFETY: this function is compiled for, and only called on, AVX2 and PCLMULQDQ.
    unsafe { walk(b, at, room, blocks) }
}

/// The skip on byte masks (tests only: see the module doc).
#[cfg(test)]
fn skip_container_bytes(b: &[u8], at: usize, room: u32) -> Option<usize> {
    // SAFETY: the byte masks use no instruction past the target's baseline.
    unsafe { walk(b, at, room, ByteBlocks::default()) }
}

/// The skip itself, on `blocks`' masks.
///
/// # Safety
/// The CPU runs `blocks`' instructions.
#[inline(always)]
unsafe fn walk<B: Blocks>(b: &[u8], at: usize, room: u32, mut blocks: B) -> Option<usize> {
    let mut grammar = Grammar::new(room);
    // All ones while a string runs on from the previous block.
    let mut inside_before = 0u64;
    let mut escape_carry = 0u64;
    // Tokens before this offset belong to the number or literal read last.
    let mut resume = 0;
    // The last, short block is read from a copy padded with spaces (whitespace outside a
    // string, plain text inside one: the padding adds no token and closes nothing).
    let mut tail = [b' '; 64];
    let mut base = at;
    while base < b.len() {
        let block: &[u8; 64] = match b.get(base..base + 64).and_then(|s| s.try_into().ok()) {
            Some(block) => block,
            None => {
                let rest = &b[base..];
                tail[..rest.len()].copy_from_slice(rest);
                &tail
            }
        };
        let in_text = inside_before != 0 && escape_carry == 0;
        // SAFETY: the caller vouches for `blocks`' instructions.
        let Some(m) = (unsafe { blocks.masks(block, in_text) }) else {
            base += 64;
            continue;
        };
        let escaped = match m.backslash | escape_carry {
            0 => 0,
            _ => escaped_bytes(m.backslash, &mut escape_carry),
        };
        let quote = m.quote & !escaped;
        // SAFETY: as above.
        let inside = unsafe { blocks.prefix_xor(quote) } ^ inside_before;
        inside_before = ((inside as i64) >> 63) as u64;
        let mut bad = m.control & inside;
        if escaped != 0 {
            bad |= bad_escapes(b, base, escaped);
        }
        let control_outside = m.control & !inside;
        if control_outside != 0 {
            bad |= bad_controls(b, base, control_outside);
        }
        // Opening quotes (inside, and a quote) and bytes outside strings that are not
        // whitespace; a closing quote is both outside and a quote, so the XOR drops it.
        let mut tokens = (!m.low & !inside) ^ quote;
        if bad != 0 {
            // Only the tokens before the first bad byte: the value may end before it.
            tokens &= (bad & bad.wrapping_neg()) - 1;
        }
        for token in Bits(tokens) {
            let token = base + token as usize;
            if token < resume {
                continue;
            }
            match grammar.step(b, token)? {
                Step::Next(end) => resume = end,
                Step::Done => {
                    let end = token + 1;
                    // SAFETY: as above.
                    let any_high = unsafe { blocks.high_seen() };
                    // Outside strings a high byte is a token the grammar refused, so checking
                    // the whole value checks its strings.
                    if any_high && std::str::from_utf8(&b[at..end]).is_err() {
                        return None;
                    }
                    return Some(end);
                }
            }
        }
        if bad != 0 {
            return None;
        }
        base += 64;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route::extract::json::Deserializer;
    use proptest::prelude::*;
    use serde::Deserialize;

    /// The exact skip's verdict: the end of the value at `at`, or none.
    fn exact(b: &[u8], at: usize, depth: u32) -> Option<usize> {
        let mut de = Deserializer::new(b);
        de.at = at;
        de.depth = depth;
        de.skip_exact().ok().map(|()| de.at)
    }

    /// The block skip on every kind of masks this CPU builds: a byte at a time everywhere, and
    /// the vector masks where a kernel skims.
    fn skips(b: &[u8], at: usize, room: u32) -> Vec<(String, Option<usize>)> {
        let mut all = vec![("bytes".to_string(), skip_container_bytes(b, at, room))];
        for k in Kernel::available().into_iter().filter(|k| k.skims()) {
            all.push((format!("{k:?}"), skip_container(b, at, room, k)));
        }
        all
    }

    /// The block skip gives the exact skip's verdict on every kind of masks.
    fn agree(b: &[u8], depth: u32) -> Result<(), TestCaseError> {
        let Some(at) = b.iter().position(|c| matches!(c, b'{' | b'[')) else {
            return Ok(());
        };
        let want = exact(b, at, depth);
        for (masks, got) in skips(b, at, 128 - depth) {
            prop_assert_eq!(got, want, "{} {:?}", masks, String::from_utf8_lossy(b));
        }
        Ok(())
    }

    #[test]
    fn escapes_are_followed_across_block_edges() {
        // A string whose backslash runs end at every offset around the 64-byte edge, with an
        // escaped quote after them when the run is odd.
        for pad in 50..70 {
            for run in 1..5 {
                let body = format!("[\"{}{}\"\"x\",1]", "a".repeat(pad), "\\".repeat(run));
                agree(body.as_bytes(), 0).unwrap();
                let even = format!("[\"{}{}\",1]", "a".repeat(pad), "\\\\".repeat(run));
                assert!(exact(even.as_bytes(), 0, 0).is_some());
                agree(even.as_bytes(), 0).unwrap();
            }
        }
    }

    #[test]
    fn what_follows_the_value_does_not_count() {
        for pad in 0..70 {
            let body = format!("[{{\"a\":\"{}\"}}]\"\u{1}\\q\u{e9}", "b".repeat(pad));
            let end = body.find("}]").unwrap() + 2;
            for (masks, got) in skips(body.as_bytes(), 0, 128) {
                assert_eq!(got, Some(end), "{masks} {pad}");
            }
            agree(body.as_bytes(), 0).unwrap();
        }
    }

    #[test]
    fn refusals_match_the_exact_skip() {
        let long = "x".repeat(100);
        for body in [
            "[1,]".to_string(),
            r#"{"a":1,}"#.into(),
            r#"{"a" 1}"#.into(),
            r#"{1:2}"#.into(),
            "[01]".into(),
            "[1.]".into(),
            "[-]".into(),
            "[tru]".into(),
            "[truex]".into(),
            "[nul".into(),
            format!("[\"{long}\\q\"]"),
            format!("[\"{long}\\u12g4\"]"),
            format!("[\"{long}\\u12"),
            format!("[\"{long}\t\"]"),
            format!("[\"{long}\"\u{1}]"),
            format!("[\"{long}\" \n\t\r]"),
            format!("[\"{long}\"\\]"),
            format!("[\"{long}\u{e9}\"]"),
            "[\"a\u{e9}\",\u{e9}]".into(),
            format!("[{}1{}]", "[".repeat(127), "]".repeat(127)),
            format!("[{}1{}]", "[".repeat(128), "]".repeat(128)),
            "[[[[".into(),
            "{\"a\":[1,{\"b\":null}],\"c\":{}}".into(),
            "{}".into(),
            "[]".into(),
            "[ ]".into(),
            "{ }".into(),
            "[}".into(),
            "{]".into(),
            "[1 2]".into(),
            "[\"a\" \"b\"]".into(),
            "{\"a\":1 \"b\":2}".into(),
            "[1e5,-0.5E-3,0,true,false,null]".into(),
        ] {
            agree(body.as_bytes(), 0).unwrap();
        }
        // Invalid UTF-8 in a string and outside one.
        agree(b"[\"ok\",\"a\xffb\"]", 0).unwrap();
        agree(b"[\"ok\",\xc3\xa9]", 0).unwrap();
        // Depth already spent by the values around it.
        agree(
            format!("{}1{}", "[".repeat(3), "]".repeat(3)).as_bytes(),
            126,
        )
        .unwrap();
    }

    fn value() -> impl Strategy<Value = serde_json::Value> {
        use serde_json::Value;
        let text = "[a-zé\\\\\"\n\t\u{1}\u{1F600}/ ]{0,90}";
        let leaf = prop_oneof![
            text.prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            (-1_000_000i32..1_000_000).prop_map(|n| Value::from(f64::from(n) / 8.0)),
            any::<bool>().prop_map(Value::from),
            Just(Value::Null),
        ];
        leaf.prop_recursive(4, 40, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
                prop::collection::vec(("[a-z_\"]{0,8}", inner), 0..5)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Valid JSON, compact and pretty, whole and damaged: one byte changed, dropped or
        /// added, or cut short.
        #[test]
        fn the_block_skip_is_the_exact_skip(
            v in value(),
            pretty in any::<bool>(),
            at in any::<prop::sample::Index>(),
            byte in prop_oneof![
                Just(b'"'), Just(b'\\'), Just(b'{'), Just(b'}'), Just(b'['), Just(b']'),
                Just(b','), Just(b':'), Just(b' '), Just(b'u'), Just(1u8), Just(0xe9u8),
                any::<u8>(),
            ],
            damage in 0..5u8,
        ) {
            let v = serde_json::json!([v]);
            let mut b = match pretty {
                true => serde_json::to_vec_pretty(&v).unwrap(),
                false => serde_json::to_vec(&v).unwrap(),
            };
            let i = at.index(b.len());
            match damage {
                0 => {}
                1 => b[i] = byte,
                2 => { b.remove(i); }
                3 => b.insert(i, byte),
                _ => b.truncate(i),
            }
            agree(&b, 0)?;
        }

        #[test]
        fn numbers_end_where_the_exact_skip_ends_them(s in "[-+0-9.eE]{1,8}[,\\]]") {
            let b = format!("[{s}");
            agree(b.as_bytes(), 0)?;
        }
    }

    proptest! {
        /// The vector masks are the byte masks, block for block, and so is what each says of
        /// the bytes seen and of a prefix XOR.
        #[test]
        fn vector_masks_are_byte_masks(
            raw in any::<[u8; 64]>(),
            in_text in any::<bool>(),
            x in any::<u64>(),
        ) {
            // Mostly the bytes the masks are about, some of any value.
            const PICK: &[u8] = b"aaaa\"\"\\\\  \n\x1f\x00\xe9";
            let block = raw.map(|r| match PICK.get(usize::from(r % 24)) {
                Some(&c) => c,
                None => r,
            });
            let mut bytes = ByteBlocks::default();
            // SAFETY: byte masks need no CPU feature.
            let want = unsafe {
                (bytes.masks(&block, in_text), bytes.high_seen(), bytes.prefix_xor(x))
            };
            #[cfg(target_arch = "x86_64")]
            if Kernel::available().iter().any(|k| k.skims()) {
                let mut vector = VectorBlocks {
                    // SAFETY: a skimming kernel means the CPU has AVX2 (checked just above).
                    high: unsafe { std::arch::x86_64::_mm256_setzero_si256() },
                };
                // SAFETY: a skimming kernel means the CPU has AVX2 and PCLMULQDQ.
                let got = unsafe {
                    (vector.masks(&block, in_text), vector.high_seen(), vector.prefix_xor(x))
                };
                prop_assert_eq!(&got, &want);
            }
            // The byte prefix XOR is the definition: bit i is the parity of bits 0..=i.
            for i in 0..64 {
                let parity = (x & (u64::MAX >> (63 - i))).count_ones() % 2;
                prop_assert_eq!(want.2 >> i & 1, u64::from(parity));
            }
        }
    }

    #[test]
    fn serde_reaches_the_block_skip() {
        // An ignored container is skipped, and a damaged one still refused with the exact
        // skip's wording.
        let mut de = Deserializer::new(br#"[{"a":"b"},1]"#);
        serde::de::IgnoredAny::deserialize(&mut de).unwrap();
        assert_eq!(de.at, 13);
        let mut de = Deserializer::new(br#"[{"a":"b"},1,]"#);
        let e = serde::de::IgnoredAny::deserialize(&mut de).unwrap_err();
        assert_eq!(e.at, Some(13), "{e}");
    }
}
