//! W3C Trace Context (`traceparent`) parsing and formatting, and the sampling decision. Pure:
//! no clock, no randomness source of its own (ids come from the caller's entropy), so the
//! rules are tested alone.
//!
//! `traceparent` is `VERSION-TRACEID-PARENTID-FLAGS` in lowercase hex (2-32-16-2). Version
//! `ff` is invalid; version `00` is exactly 55 characters; a later version may append fields
//! after a `-`, and its first four fields are read as version `00`'s (the spec's forward
//! compatibility rule). All-zero trace or parent ids are invalid.

/// Length of a version-00 `traceparent` value.
pub const TRACEPARENT_LEN: usize = 55;
/// The `sampled` bit of the trace flags.
pub const FLAG_SAMPLED: u8 = 0x01;

/// A caller's trace context, as its `traceparent` header states it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    /// The trace this request belongs to.
    pub trace_id: [u8; 16],
    /// The caller's span: the parent of the gateway's server span.
    pub parent_id: [u8; 8],
    /// Trace flags (bit 0: the caller sampled this trace).
    pub flags: u8,
}

impl TraceParent {
    /// Whether the caller recorded this trace (and so wants its children recorded).
    pub fn sampled(&self) -> bool {
        self.flags & FLAG_SAMPLED != 0
    }
}

/// One lowercase hex digit's value (the spec forbids uppercase).
fn hex_digit(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    }
}

/// `out.len()` bytes from `2 * out.len()` lowercase hex digits.
fn decode_hex(text: &[u8], out: &mut [u8]) -> Option<()> {
    if text.len() != 2 * out.len() {
        return None;
    }
    for (o, pair) in out.iter_mut().zip(text.chunks_exact(2)) {
        *o = (hex_digit(pair[0])? << 4) | hex_digit(pair[1])?;
    }
    Some(())
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Lowercase hex of `bytes` into `out` (twice as long).
fn encode_hex(bytes: &[u8], out: &mut [u8]) {
    for (b, pair) in bytes.iter().zip(out.chunks_exact_mut(2)) {
        pair[0] = HEX[usize::from(b >> 4)];
        pair[1] = HEX[usize::from(b & 15)];
    }
}

/// Parse a `traceparent` header value; `None` when it is invalid (the request then starts a
/// new trace, and its `tracestate` is ignored, as the spec says).
pub fn parse_traceparent(value: &[u8]) -> Option<TraceParent> {
    let value = value.trim_ascii();
    if value.len() < TRACEPARENT_LEN {
        return None;
    }
    let mut version = [0u8; 1];
    decode_hex(&value[..2], &mut version)?;
    match version[0] {
        0xff => return None,
        0x00 if value.len() != TRACEPARENT_LEN => return None,
        // A later version: more fields may follow, after a dash.
        _ if value.len() > TRACEPARENT_LEN && value[TRACEPARENT_LEN] != b'-' => return None,
        _ => {}
    }
    if value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
        return None;
    }
    let mut tp = TraceParent {
        trace_id: [0; 16],
        parent_id: [0; 8],
        flags: 0,
    };
    decode_hex(&value[3..35], &mut tp.trace_id)?;
    decode_hex(&value[36..52], &mut tp.parent_id)?;
    let mut flags = [0u8; 1];
    decode_hex(&value[53..55], &mut flags)?;
    tp.flags = flags[0];
    if tp.trace_id == [0; 16] || tp.parent_id == [0; 8] {
        return None;
    }
    Some(tp)
}

/// The version-00 `traceparent` naming `span_id` of `trace_id` as the parent, sampled or not.
/// A fixed-size array: injecting it upstream allocates nothing.
pub fn format_traceparent(
    trace_id: &[u8; 16],
    span_id: &[u8; 8],
    sampled: bool,
) -> [u8; TRACEPARENT_LEN] {
    let mut out = [b'-'; TRACEPARENT_LEN];
    out[0] = b'0';
    out[1] = b'0';
    encode_hex(trace_id, &mut out[3..35]);
    encode_hex(span_id, &mut out[36..52]);
    out[53] = b'0';
    out[54] = if sampled { b'1' } else { b'0' };
    out
}

/// Lowercase hex of an id (for logs, tests and attributes).
pub fn hex(bytes: &[u8]) -> String {
    let mut out = vec![0u8; 2 * bytes.len()];
    encode_hex(bytes, &mut out);
    // Only ASCII hex digits were written.
    String::from_utf8(out).unwrap_or_default()
}

/// Whether a new trace (no caller context) is recorded at `ratio`: the trace id's last eight
/// bytes, read as a number, below `ratio` × 2⁶⁴, as OpenTelemetry's `TraceIdRatioBased`
/// sampler decides, so every copy of the gateway (and any other component using that sampler
/// at the same ratio) keeps the same traces. The ids are random, so about `ratio` of them.
pub fn sampled_at(trace_id: &[u8; 16], ratio: f64) -> bool {
    if ratio >= 1.0 {
        return true;
    }
    if ratio.is_nan() || ratio <= 0.0 {
        return false;
    }
    let mut low = [0u8; 8];
    low.copy_from_slice(&trace_id[8..]);
    let x = u64::from_be_bytes(low);
    // Exact for the ratios people write (0.5, 0.01): 2^64 × ratio fits an f64's mantissa
    // closely enough, and the cast saturates at u64::MAX.
    let bound = (ratio * 18_446_744_073_709_551_616.0) as u64;
    x < bound
}

/// Whether a request is recorded. A trusted caller's context decides by its `sampled` flag (a
/// parent that recorded expects its children, one that did not expects none). Anything else,
/// an untrusted caller's context or none, is kept at `ratio`, drawn on `draw`: a fresh random
/// id for an untrusted context, never the caller's trace id, whose low bits the caller chose
/// and could pick to pass any ratio; the new trace's own random id otherwise.
pub fn should_record(
    caller: Option<&TraceParent>,
    trusted: bool,
    draw: &[u8; 16],
    ratio: f64,
) -> bool {
    match caller {
        Some(tp) if trusted => tp.sampled(),
        _ => sampled_at(draw, ratio),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_parses_and_formats_back() {
        let tp = parse_traceparent(GOOD.as_bytes()).unwrap();
        assert_eq!(hex(&tp.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(hex(&tp.parent_id), "00f067aa0ba902b7");
        assert!(tp.sampled());
        let back = format_traceparent(&tp.trace_id, &tp.parent_id, true);
        assert_eq!(&back[..], GOOD.as_bytes());
        let unsampled = format_traceparent(&tp.trace_id, &tp.parent_id, false);
        assert!(unsampled.ends_with(b"-00"));
        // Surrounding whitespace (an OWS the header parser left) is tolerated.
        assert!(parse_traceparent(format!(" {GOOD} ").as_bytes()).is_some());
    }

    #[test]
    fn flags_other_than_sampled_are_kept_and_only_bit_zero_samples() {
        let v = GOOD.replace("-01", "-02");
        let tp = parse_traceparent(v.as_bytes()).unwrap();
        assert_eq!(tp.flags, 2);
        assert!(!tp.sampled());
        let tp = parse_traceparent(GOOD.replace("-01", "-03").as_bytes()).unwrap();
        assert!(tp.sampled());
        let tp = parse_traceparent(GOOD.replace("-01", "-00").as_bytes()).unwrap();
        assert!(!tp.sampled());
    }

    #[test]
    fn versions_follow_the_spec() {
        // Version ff is forbidden.
        assert!(parse_traceparent(GOOD.replacen("00-", "ff-", 1).as_bytes()).is_none());
        // Version 00 is exactly 55 characters.
        assert!(parse_traceparent(format!("{GOOD}-extra").as_bytes()).is_none());
        // A later version is read as 00, with more fields allowed after a dash only.
        let later = GOOD.replacen("00-", "cc-", 1);
        assert!(parse_traceparent(later.as_bytes()).is_some());
        assert!(parse_traceparent(format!("{later}-what-comes").as_bytes()).is_some());
        assert!(parse_traceparent(format!("{later}x").as_bytes()).is_none());
        // The version itself is hex.
        assert!(parse_traceparent(GOOD.replacen("00-", "0g-", 1).as_bytes()).is_none());
    }

    #[test]
    fn malformed_values_and_all_zero_ids_are_refused() {
        let zero_trace = "00-00000000000000000000000000000000-00f067aa0ba902b7-01";
        let zero_parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01";
        for bad in [
            zero_trace,
            zero_parent,
            "",
            "00",
            &GOOD[..54],
            // Uppercase hex is not allowed.
            &GOOD.to_uppercase(),
            // Wrong separators.
            &GOOD.replace('-', "_"),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0x",
            "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
        ] {
            assert!(parse_traceparent(bad.as_bytes()).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn sampling_by_ratio_follows_the_trace_ids_low_bits() {
        let mut id = [0xabu8; 16];
        assert!(sampled_at(&id, 1.0));
        assert!(!sampled_at(&id, 0.0));
        assert!(!sampled_at(&id, f64::NAN));
        id[8..].copy_from_slice(&0u64.to_be_bytes());
        assert!(sampled_at(&id, 0.001));
        id[8..].copy_from_slice(&(u64::MAX / 2 - 1).to_be_bytes());
        assert!(sampled_at(&id, 0.5));
        id[8..].copy_from_slice(&(u64::MAX / 2 + 2).to_be_bytes());
        assert!(!sampled_at(&id, 0.5));
        // About the ratio of evenly spread ids.
        let kept = (0..10_000u64)
            .filter(|i| {
                let mut t = [0u8; 16];
                t[8..].copy_from_slice(&i.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes());
                sampled_at(&t, 0.25)
            })
            .count();
        assert!((2_300..2_700).contains(&kept), "{kept}");
    }

    #[test]
    fn a_trusted_callers_flag_decides_over_the_ratio() {
        let tp = parse_traceparent(GOOD.as_bytes()).unwrap();
        let draw = [7u8; 16];
        assert!(should_record(Some(&tp), true, &draw, 0.0));
        let off = parse_traceparent(GOOD.replace("-01", "-00").as_bytes()).unwrap();
        assert!(!should_record(Some(&off), true, &draw, 1.0));
        assert!(should_record(None, false, &tp.trace_id, 1.0));
        assert!(!should_record(None, false, &tp.trace_id, 0.0));
    }

    #[test]
    fn an_untrusted_callers_flag_and_trace_id_do_not_decide() {
        // A trace id whose low bits pass any ratio, and the sampled flag: neither counts.
        let forced = "00-4bf92f3577b34da60000000000000000-00f067aa0ba902b7-01";
        let tp = parse_traceparent(forced.as_bytes()).unwrap();
        assert!(sampled_at(&tp.trace_id, 0.001));
        let high = [0xffu8; 16];
        assert!(!should_record(Some(&tp), false, &high, 0.5));
        assert!(!should_record(Some(&tp), false, &high, 0.0));
        // An unsampled caller is still recorded when the gateway's own draw says so.
        let off = parse_traceparent(GOOD.replace("-01", "-00").as_bytes()).unwrap();
        assert!(should_record(Some(&off), false, &high, 1.0));
        assert!(should_record(Some(&off), false, &[0u8; 16], 0.5));
    }
}
