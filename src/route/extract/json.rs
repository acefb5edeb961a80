//! The request body's JSON parser: a serde `Deserializer` over the borrowed body, written for
//! what routing does with a body. It makes one pass: strings are scanned 32 or 64 bytes at a
//! time ([`scan`]), handed out borrowed when they hold no escape and unescaped in the same
//! pass when they do (the scan costs more than the copy); nesting depth is counted as it
//! is entered (bounded by [`MAX_NESTING`], so the recursion is bounded on every core); UTF-8 is
//! checked only for strings that hold a byte of 0x80 or above (outside strings such a byte is
//! a syntax error anyway). Values nobody reads are validated without being built, an array or
//! object 64 bytes a step on bit masks ([`skim`]; the string-at-a-time skip is kept for the
//! exact wording of a refusal).
//!
//! Verdicts are serde_json's (checked body for body by `parser_agreement.rs`): the RFC 8259
//! grammar, integers as `u64`/`i64` when they fit and else `f64` (`-0` is the float -0.0),
//! floats correctly rounded, out-of-range numbers refused where a number is read, lone `\u`
//! surrogates refused where a string is read and skipped strings held to four hex digits.

pub(super) mod scan;
mod skim;

use self::scan::{StringEnd, StringError};
use super::MAX_NESTING;
use serde::de::{self, Visitor};
use std::fmt;

/// Why a body was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    msg: String,
    /// Byte offset the error was found at, when known.
    at: Option<usize>,
    /// The bytes are not JSON (else: JSON, but not a request body of the expected shape).
    syntax: bool,
}

impl Error {
    fn syntax(msg: impl Into<String>, at: usize) -> Error {
        Error {
            msg: msg.into(),
            at: Some(at),
            syntax: true,
        }
    }

    /// Whether the bytes are not JSON at all (a malformed body, not a wrong field).
    pub fn is_syntax(&self) -> bool {
        self.syntax
    }

    fn located(mut self, at: usize) -> Error {
        self.at.get_or_insert(at);
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.at {
            Some(at) => write!(f, "{} at byte {at}", self.msg),
            None => f.write_str(&self.msg),
        }
    }
}

impl std::error::Error for Error {}

impl de::Error for Error {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Error {
            msg: msg.to_string(),
            at: None,
            syntax: false,
        }
    }
}

/// A string error as the parser words it.
pub(super) fn string_error(e: StringError, len: usize) -> Error {
    match e {
        StringError::Eof => Error::syntax("EOF while parsing a string", len),
        StringError::Control(at) => Error::syntax("control character in a string", at),
        StringError::BadEscape(at) => Error::syntax("invalid escape", at),
        StringError::BadUnicodeEscape(at) => Error::syntax("invalid \\u escape", at),
        StringError::LoneSurrogate(at) => Error::syntax("lone surrogate in \\u escape", at),
    }
}

type Result<T> = std::result::Result<T, Error>;

/// The instructions the parser's two byte loops (the string scan, the block skip) run on:
/// chosen once per body from what the CPU has, or named by a test, so that one machine checks
/// every path it can run instead of only its best one. Only [`Kernel::detected`] and
/// [`Kernel::available`] make one, so a kernel in hand always runs on this CPU: the vector
/// paths' safety rests on that.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernel(Isa);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Isa {
    /// AVX2 with carry-less multiply: strings 64 bytes a step, skipped values on vector masks.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// SSE2, which every x86_64 has: strings 32 bytes a step, skipped values by the exact skip.
    #[cfg(target_arch = "x86_64")]
    Sse2,
    /// No vector instructions, skipped values by the exact skip: what other targets run (on
    /// x86_64, only tests pick it).
    #[cfg_attr(all(target_arch = "x86_64", not(test)), allow(dead_code))]
    Portable,
}

impl Kernel {
    /// The fastest kernel this CPU runs. Both features are asked for together: the block skip
    /// needs the pair, and no CPU sold with AVX2 lacks carry-less multiply.
    pub fn detected() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("pclmulqdq") {
                return Kernel(Isa::Avx2);
            }
            Kernel(Isa::Sse2)
        }
        #[cfg(not(target_arch = "x86_64"))]
        Kernel(Isa::Portable)
    }

    /// Every kernel this CPU runs, the detected one first: what tests hold to the same answers.
    #[cfg(test)]
    pub fn available() -> Vec<Kernel> {
        let mut all = vec![Kernel::detected()];
        #[cfg(target_arch = "x86_64")]
        if all[0].0 == Isa::Avx2 {
            all.push(Kernel(Isa::Sse2));
        }
        if all[0].0 != Isa::Portable {
            all.push(Kernel(Isa::Portable));
        }
        all
    }

    /// Whether the block skip runs at all on this kernel (else every skipped value takes the
    /// exact skip).
    #[cfg(test)]
    pub fn skims(self) -> bool {
        skim::runs_on(self)
    }
}

/// A JSON number as read: what serde_json's `deserialize_any` would hand a visitor.
enum Number {
    U64(u64),
    I64(i64),
    F64(f64),
}

/// What checking a number against the grammar found: enough to build its value without a
/// second pass over an integer's digits.
#[derive(Clone, Copy)]
struct NumberScan {
    negative: bool,
    /// Where the integer part's digits start, and how many there are.
    int_start: usize,
    int_digits: usize,
    /// The integer part's value (wrapped past 19 digits, where it is not used).
    int_value: u64,
    /// A fraction or an exponent follows (the value is a float).
    float: bool,
    /// One past the number's last byte.
    end: usize,
}

/// The parser's state: the body, the offset of the next byte, the depth entered so far, a
/// scratch buffer for strings with escapes that are read as strings (object keys, names) and
/// the kernel its byte loops run on.
pub struct Deserializer<'de> {
    body: &'de [u8],
    at: usize,
    depth: u32,
    scratch: Vec<u8>,
    kernel: Kernel,
}

impl<'de> Deserializer<'de> {
    /// A parser of `body` from its first byte, on the fastest kernel this CPU runs.
    pub fn new(body: &'de [u8]) -> Self {
        Self::on(body, Kernel::detected())
    }

    /// [`Self::new`] on a given kernel.
    pub fn on(body: &'de [u8], kernel: Kernel) -> Self {
        Deserializer {
            body,
            at: 0,
            depth: 0,
            scratch: Vec::new(),
            kernel,
        }
    }

    /// Only whitespace may follow the value.
    pub fn end(&mut self) -> Result<()> {
        match self.peek() {
            None => Ok(()),
            Some(_) => Err(Error::syntax("trailing characters", self.at)),
        }
    }

    /// The next byte that is not whitespace (left unread).
    #[inline]
    fn peek(&mut self) -> Option<u8> {
        while let Some(&c) = self.body.get(self.at) {
            if !matches!(c, b' ' | b'\n' | b'\t' | b'\r') {
                return Some(c);
            }
            self.at += 1;
        }
        None
    }

    fn eof(&self, what: &str) -> Error {
        Error::syntax(format!("EOF while parsing {what}"), self.body.len())
    }

    fn expected(&self, what: &str) -> Error {
        Error::syntax(format!("expected {what}"), self.at)
    }

    /// The next value's first byte, or an EOF error.
    fn peek_value(&mut self) -> Result<u8> {
        self.peek().ok_or_else(|| self.eof("a value"))
    }

    /// Enters an array or object (its opening byte consumed), holding the depth bound.
    fn enter(&mut self) -> Result<()> {
        self.depth += 1;
        if self.depth > MAX_NESTING {
            return Err(Error {
                msg: format!("JSON nested deeper than {MAX_NESTING} levels"),
                at: Some(self.at),
                syntax: false,
            });
        }
        self.at += 1;
        Ok(())
    }

    fn leave(&mut self) {
        self.depth -= 1;
    }

    /// The closing byte of an array or object whose visitor is done with its elements.
    fn close(&mut self, byte: u8, what: &str) -> Result<()> {
        match self.peek() {
            Some(c) if c == byte => {
                self.at += 1;
                self.leave();
                Ok(())
            }
            Some(_) => Err(Error::syntax("trailing characters", self.at)),
            None => Err(self.eof(what)),
        }
    }

    /// Scans the string whose opening quote is at `self.at`; returns its body's bounds.
    fn string_bounds(&mut self) -> Result<(usize, StringEnd)> {
        let start = self.at + 1;
        let end = self.string_read(start, scan::scan_string(self.body, start, self.kernel))?;
        Ok((start, end))
    }

    /// What both string readings do once the scan is over: its error worded, UTF-8 checked
    /// where a high byte was seen, the cursor past the closing quote.
    fn string_read(
        &mut self,
        start: usize,
        scanned: std::result::Result<StringEnd, StringError>,
    ) -> Result<StringEnd> {
        let end = scanned.map_err(|e| string_error(e, self.body.len()))?;
        if end.non_ascii {
            if let Err(e) = std::str::from_utf8(&self.body[start..end.end]) {
                return Err(Error::syntax("not UTF-8", start + e.valid_up_to()));
            }
        }
        self.at = end.end + 1;
        Ok(end)
    }

    /// The string at `self.at` as text: borrowed from the body, or unescaped into the scratch
    /// buffer in the same pass that finds its end (`Err` side of the result).
    fn string(&mut self) -> Result<std::result::Result<&'de str, &str>> {
        let start = self.at + 1;
        self.scratch.clear();
        let scanned = scan::read_string(self.body, start, &mut self.scratch, self.kernel);
        let end = self.string_read(start, scanned)?;
        let raw = &self.body[start..end.end];
        if !end.escaped {
            // SAFETY: `raw` is ASCII, or was checked as UTF-8 just above (`non_ascii` is set
            // whenever a byte of 0x80 or above is in it).
            return Ok(Ok(unsafe { std::str::from_utf8_unchecked(raw) }));
        }
        // SAFETY: the plain runs of valid UTF-8 `raw` (checked above, or ASCII), cut only at
        // backslashes (ASCII), with whole encoded characters between them.
        Ok(Err(unsafe { std::str::from_utf8_unchecked(&self.scratch) }))
    }

    fn literal(&mut self, word: &'static [u8]) -> Result<()> {
        let end = self.at + word.len();
        match self.body.get(self.at..end) {
            Some(w) if w == word => {
                self.at = end;
                Ok(())
            }
            _ => {
                let have = &self.body[self.at..];
                if have.len() < word.len() && word.starts_with(have) {
                    Err(self.eof("a value"))
                } else {
                    Err(self.expected("a value"))
                }
            }
        }
    }

    /// The number at `self.at`, checked against the JSON grammar; `build` false only skips.
    /// An integer's value is gathered as its digits are scanned (`/generate`'s `input_ids`
    /// are thousands of them); only a fraction, an exponent or more than 19 digits go through
    /// the float parser.
    fn number(&mut self, build: bool) -> Result<Option<Number>> {
        let start = self.at;
        let scan = self.scan_number()?;
        self.at = scan.end;
        if !build {
            return Ok(None);
        }
        self.number_value(start, &scan).map(Some)
    }

    /// The number at `self.at` checked against the grammar (`self.at` left where it was), its
    /// integer part's value gathered on the way.
    #[inline]
    fn scan_number(&self) -> Result<NumberScan> {
        let b = self.body;
        let mut i = self.at;
        let negative = b.get(i) == Some(&b'-');
        i += negative as usize;
        let int_start = i;
        let mut n: u64 = 0;
        match b.get(i) {
            None => return Err(self.eof("a number")),
            Some(b'0') => i += 1,
            Some(b'1'..=b'9') => {
                while let Some(&d) = b.get(i) {
                    if !d.is_ascii_digit() {
                        break;
                    }
                    n = n.wrapping_mul(10).wrapping_add((d - b'0') as u64);
                    i += 1;
                }
            }
            Some(_) => return Err(Error::syntax("invalid number", i)),
        }
        let (end, float) = self.number_tail(i)?;
        Ok(NumberScan {
            negative,
            int_start,
            int_digits: i - int_start,
            int_value: n,
            float,
            end,
        })
    }

    /// The optional fraction and exponent after a number's integer part at `i`: where the
    /// number ends, and whether either was there (the value is then a float).
    #[inline]
    fn number_tail(&self, mut i: usize) -> Result<(usize, bool)> {
        let b = self.body;
        let mut float = false;
        let digits = |i: &mut usize| {
            let from = *i;
            while b.get(*i).is_some_and(u8::is_ascii_digit) {
                *i += 1;
            }
            *i - from
        };
        if b.get(i) == Some(&b'.') {
            i += 1;
            float = true;
            if digits(&mut i) == 0 {
                return Err(self.bad_number(i));
            }
        }
        if matches!(b.get(i), Some(b'e' | b'E')) {
            i += 1;
            float = true;
            if matches!(b.get(i), Some(b'+' | b'-')) {
                i += 1;
            }
            if digits(&mut i) == 0 {
                return Err(self.bad_number(i));
            }
        }
        // A digit straight after a leading zero (`01`) is not a number's continuation.
        if b.get(i).is_some_and(u8::is_ascii_digit) {
            return Err(Error::syntax("invalid number", i));
        }
        Ok((i, float))
    }

    /// The value of the number scanned from `start`: an integer from its gathered digits when
    /// it fits, anything else through the float parser.
    #[inline]
    fn number_value(&self, start: usize, scan: &NumberScan) -> Result<Number> {
        let b = self.body;
        let NumberScan {
            negative,
            int_start,
            int_digits,
            int_value: n,
            float,
            end,
        } = *scan;
        // Up to 19 digits cannot overflow a u64 (10^19 - 1 < 2^64).
        if !float && int_digits <= 19 {
            if !negative {
                return Ok(Number::U64(n));
            }
            if n == 0 {
                return Ok(Number::F64(-0.0));
            }
            if n <= i64::MAX as u64 + 1 {
                return Ok(Number::I64((n as i64).wrapping_neg()));
            }
        }
        if !float && !negative && int_digits == 20 {
            let exact = b[int_start..end].iter().try_fold(0u64, |n, &d| {
                n.checked_mul(10)?.checked_add((d - b'0') as u64)
            });
            if let Some(n) = exact {
                return Ok(Number::U64(n));
            }
        }
        // SAFETY: `scan_number`'s grammar admits only ASCII digits, signs, '.', 'e' and 'E'.
        let text = unsafe { std::str::from_utf8_unchecked(&b[start..end]) };
        match text.parse::<f64>() {
            Ok(v) if v.is_finite() => Ok(Number::F64(v)),
            _ => Err(Error::syntax("number out of range", start)),
        }
    }

    /// A fraction or exponent without digits: cut short at the end, else a wrong byte.
    fn bad_number(&self, at: usize) -> Error {
        match self.body.get(at) {
            None => self.eof("a number"),
            Some(_) => Error::syntax("invalid number", at),
        }
    }

    /// Validates the value at `self.at` without building it: an array or object in one pass
    /// of the block skip ([`skim`]), and when that refuses it, again by the exact skip, whose
    /// error it is.
    fn skip_value(&mut self) -> Result<()> {
        if let b'[' | b'{' = self.peek_value()? {
            let room = MAX_NESTING - self.depth;
            if let Some(end) = skim::skip_container(self.body, self.at, room, self.kernel) {
                self.at = end;
                return Ok(());
            }
        }
        self.skip_exact()
    }

    /// The skip a value at a time: the verdict of [`Self::skip_value`] and its wording. What
    /// it holds is skipped the same way, never by the block skip again (a value that failed
    /// it would otherwise be scanned once for each level it is nested in).
    fn skip_exact(&mut self) -> Result<()> {
        match self.peek_value()? {
            b'"' => self.string_bounds().map(|_| ()),
            b'[' => {
                self.enter()?;
                let mut first = true;
                loop {
                    match self.peek() {
                        Some(b']') => {
                            self.at += 1;
                            break;
                        }
                        Some(b',') if !first => {
                            self.at += 1;
                            self.skip_exact()?;
                        }
                        Some(_) if first => {
                            self.skip_exact()?;
                        }
                        Some(_) => return Err(self.expected("`,` or `]`")),
                        None => return Err(self.eof("a list")),
                    }
                    first = false;
                }
                self.leave();
                Ok(())
            }
            b'{' => {
                self.enter()?;
                let mut first = true;
                loop {
                    match self.peek() {
                        Some(b'}') => {
                            self.at += 1;
                            break;
                        }
                        Some(b',') if !first => {
                            self.at += 1;
                            self.skip_entry()?;
                        }
                        Some(_) if first => self.skip_entry()?,
                        Some(_) => return Err(self.expected("`,` or `}`")),
                        None => return Err(self.eof("an object")),
                    }
                    first = false;
                }
                self.leave();
                Ok(())
            }
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => self.number(false).map(|_| ()),
            _ => Err(self.expected("a value")),
        }
    }

    /// One `"key": value` of an object being skipped.
    fn skip_entry(&mut self) -> Result<()> {
        self.object_key_start()?;
        self.string_bounds()?;
        self.colon()?;
        self.skip_exact()
    }

    /// The next byte must open a key.
    fn object_key_start(&mut self) -> Result<()> {
        match self.peek() {
            Some(b'"') => Ok(()),
            Some(_) => Err(self.expected("a string key")),
            None => Err(self.eof("an object")),
        }
    }

    fn colon(&mut self) -> Result<()> {
        match self.peek() {
            Some(b':') => {
                self.at += 1;
                Ok(())
            }
            Some(_) => Err(self.expected("`:`")),
            None => Err(self.eof("an object")),
        }
    }

    /// What `deserialize_any` would say the value at `self.at` is, for type errors (reads
    /// nothing but a string's or a number's own bytes).
    fn invalid_type<V: Visitor<'de>>(&mut self, c: u8, v: &V) -> Error {
        let unexpected = match c {
            b'"' => de::Unexpected::Other("string"),
            b'[' => de::Unexpected::Seq,
            b'{' => de::Unexpected::Map,
            b't' => de::Unexpected::Bool(true),
            b'f' => de::Unexpected::Bool(false),
            b'n' => de::Unexpected::Unit,
            _ => de::Unexpected::Other("number"),
        };
        <Error as de::Error>::invalid_type(unexpected, v).located(self.at)
    }

    fn check_value_start(&mut self, c: u8) -> Result<()> {
        // Refuse a byte no value starts with as a syntax error, like serde_json, before
        // saying the type is wrong.
        match c {
            b'"' | b'[' | b'{' | b't' | b'f' | b'n' | b'-' | b'0'..=b'9' => Ok(()),
            _ => Err(self.expected("a value")),
        }
    }
}

/// The struct name that asks this parser for an object read in one validating pass (no
/// per-key visitor calls; the visitor hears `visit_unit`, or its type error when the value is
/// not an object). Any other deserializer (serde_json in `parser_agreement`) treats it as a
/// struct, i.e. visits the map.
pub(crate) const OPAQUE_OBJECT: &str = "$radixgate::opaque_object";

/// Gives the error the parser's position when the visitor did not set one.
macro_rules! located {
    ($self:ident, $e:expr) => {{
        let at = $self.at;
        $e.map_err(|e: Error| e.located(at))
    }};
}

impl<'de> de::Deserializer<'de> for &mut Deserializer<'de> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
        match self.peek_value()? {
            b'"' => self.deserialize_str(v),
            b'[' => self.deserialize_seq(v),
            b'{' => self.deserialize_map(v),
            b't' | b'f' => self.deserialize_bool(v),
            b'n' => self.deserialize_unit(v),
            b'-' | b'0'..=b'9' => match self.number(true)? {
                Some(Number::U64(n)) => located!(self, v.visit_u64(n)),
                Some(Number::I64(n)) => located!(self, v.visit_i64(n)),
                Some(Number::F64(n)) => located!(self, v.visit_f64(n)),
                None => Err(self.expected("a number")),
            },
            _ => Err(self.expected("a value")),
        }
    }

    fn deserialize_bool<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
        match self.peek_value()? {
            b't' => {
                self.literal(b"true")?;
                located!(self, v.visit_bool(true))
            }
            b'f' => {
                self.literal(b"false")?;
                located!(self, v.visit_bool(false))
            }
            c => {
                self.check_value_start(c)?;
                Err(self.invalid_type(c, &v))
            }
        }
    }

    fn deserialize_str<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
        match self.peek_value()? {
            b'"' => match self.string()? {
                Ok(s) => located!(self, v.visit_borrowed_str(s)),
                Err(s) => {
                    let r = v.visit_str(s);
                    located!(self, r)
                }
            },
            c => {
                self.check_value_start(c)?;
                Err(self.invalid_type(c, &v))
            }
        }
    }

    fn deserialize_string<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
        self.deserialize_str(v)
    }

    fn deserialize_identifier<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
        self.deserialize_str(v)
    }

    fn deserialize_option<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
        match self.peek_value()? {
            b'n' => {
                self.literal(b"null")?;
                located!(self, v.visit_none())
            }
            _ => v.visit_some(self),
        }
    }

    fn deserialize_unit<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
        match self.peek_value()? {
            b'n' => {
                self.literal(b"null")?;
                located!(self, v.visit_unit())
            }
            c => {
                self.check_value_start(c)?;
                Err(self.invalid_type(c, &v))
            }
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        v: V,
    ) -> Result<V::Value> {
        v.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
        match self.peek_value()? {
            b'[' => {
                self.enter()?;
                let value = located!(
                    self,
                    v.visit_seq(Seq {
                        de: self,
                        first: true
                    })
                )?;
                self.close(b']', "a list")?;
                Ok(value)
            }
            c => {
                self.check_value_start(c)?;
                Err(self.invalid_type(c, &v))
            }
        }
    }

    fn deserialize_map<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
        match self.peek_value()? {
            b'{' => {
                self.enter()?;
                let value = located!(
                    self,
                    v.visit_map(Map {
                        de: self,
                        first: true
                    })
                )?;
                self.close(b'}', "an object")?;
                Ok(value)
            }
            c => {
                self.check_value_start(c)?;
                Err(self.invalid_type(c, &v))
            }
        }
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value> {
        self.skip_value()?;
        v.visit_unit()
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        _fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value> {
        match self.peek_value()? {
            b'{' if name == OPAQUE_OBJECT => {
                self.skip_value()?;
                v.visit_unit()
            }
            // Anything else is read as a map is: the same type error when it is not one.
            _ if name == OPAQUE_OBJECT => self.deserialize_map(v),
            _ => self.deserialize_any(v),
        }
    }

    serde::forward_to_deserialize_any! {
        i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char bytes byte_buf
        unit_struct tuple tuple_struct enum
    }
}

/// The elements of an array being visited.
struct Seq<'a, 'de> {
    de: &'a mut Deserializer<'de>,
    first: bool,
}

impl<'de> de::SeqAccess<'de> for Seq<'_, 'de> {
    type Error = Error;

    fn next_element_seed<T: de::DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>> {
        match self.de.peek() {
            Some(b']') => return Ok(None),
            Some(b',') if !self.first => self.de.at += 1,
            Some(_) if self.first => {}
            Some(_) => return Err(self.de.expected("`,` or `]`")),
            None => return Err(self.de.eof("a list")),
        }
        if self.first {
            self.first = false;
        } else if self.de.peek() == Some(b']') {
            return Err(Error::syntax("trailing comma", self.de.at));
        }
        seed.deserialize(&mut *self.de).map(Some)
    }
}

/// The entries of an object being visited.
struct Map<'a, 'de> {
    de: &'a mut Deserializer<'de>,
    first: bool,
}

impl<'de> de::MapAccess<'de> for Map<'_, 'de> {
    type Error = Error;

    fn next_key_seed<K: de::DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>> {
        match self.de.peek() {
            Some(b'}') => return Ok(None),
            Some(b',') if !self.first => {
                self.de.at += 1;
                match self.de.peek() {
                    Some(b'"') => {}
                    Some(b'}') => return Err(Error::syntax("trailing comma", self.de.at)),
                    Some(_) => return Err(self.de.expected("a string key")),
                    None => return Err(self.de.eof("an object")),
                }
            }
            Some(b'"') if self.first => {}
            Some(_) if self.first => return Err(self.de.expected("a string key")),
            Some(_) => return Err(self.de.expected("`,` or `}`")),
            None => return Err(self.de.eof("an object")),
        }
        self.first = false;
        seed.deserialize(&mut *self.de).map(Some)
    }

    fn next_value_seed<V: de::DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value> {
        self.de.colon()?;
        seed.deserialize(&mut *self.de)
    }
}

#[cfg(test)]
mod tests;
