//! The W3C `tracestate` a caller sends, as the gateway keeps and passes it on: checked against
//! the specification's grammar and bounded by its limits (32 list members, 512 bytes, members
//! removed whole by its truncation rule). Pure, so the rules are tested alone.
//!
//! `tracestate` is a list of `key=value` members separated by commas with optional spaces and
//! tabs around them; keys are `simple-key` or `tenant@system`, values printable ASCII without
//! `,` and `=`.

/// Most bytes of `tracestate` kept (the W3C limit a participant must propagate; members are
/// removed whole to get under it).
pub const MAX_BYTES: usize = 512;
/// Most list members of `tracestate` (the W3C limit).
pub const MAX_MEMBERS: usize = 32;
/// Members longer than this are the first removed when the list is over
/// [`MAX_BYTES`] (the W3C truncation rule).
pub const LONG_MEMBER: usize = 128;

/// Whether `b` may appear in a `tracestate` key after its first character.
fn key_char(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-' | b'*' | b'/')
}

/// A `tracestate` key: `simple-key` (a lowercase letter, then at most 255 key characters) or
/// `tenant@system` (tenant: a lowercase letter or digit then at most 240 more; system: a
/// lowercase letter then at most 13 more).
fn valid_key(key: &[u8]) -> bool {
    let part = |p: &[u8], first: fn(&u8) -> bool, most: usize| {
        matches!(p.first(), Some(c) if first(c))
            && p.len() <= most
            && p[1..].iter().all(|&b| key_char(b))
    };
    match key.iter().position(|&b| b == b'@') {
        None => part(key, u8::is_ascii_lowercase, 256),
        Some(at) => {
            part(
                &key[..at],
                |c| c.is_ascii_lowercase() || c.is_ascii_digit(),
                241,
            ) && part(&key[at + 1..], u8::is_ascii_lowercase, 14)
        }
    }
}

/// A `tracestate` value: 1 to 256 printable ASCII characters other than `,` and `=`, spaces
/// allowed except at the end.
fn valid_value(value: &[u8]) -> bool {
    !value.is_empty()
        && value.len() <= 256
        && value
            .iter()
            .all(|&b| (0x20..=0x7e).contains(&b) && b != b',' && b != b'=')
        && value.last() != Some(&b' ')
}

/// The caller's `tracestate` as the gateway keeps it (on its server span) and passes it on:
/// at most [`MAX_MEMBERS`] members and [`MAX_BYTES`] bytes, members
/// removed whole as the W3C specification says (over the byte limit, members longer than
/// [`LONG_MEMBER`] go first, then members from the end; over the member limit,
/// members from the end). `None`: nothing to keep, because the value is empty, or malformed
/// (a member that is not `key=value` by the specification's grammar), which the specification
/// forbids passing on. Reads the whole header once; allocates only the kept value.
pub fn bound_tracestate(raw: &[u8]) -> Option<String> {
    // (start, end) in `raw` of each member kept so far: a header of up to 64 KiB can name
    // thousands, but only the first MAX_MEMBERS are ever kept (on the stack).
    let mut slots = [(0usize, 0usize); MAX_MEMBERS];
    let mut kept = 0;
    let mut start = 0;
    for piece in raw.split(|&b| b == b',') {
        let at = start;
        start += piece.len() + 1;
        let lead = piece
            .iter()
            .take_while(|&&b| b == b' ' || b == b'\t')
            .count();
        let trail = piece[lead..]
            .iter()
            .rev()
            .take_while(|&&b| b == b' ' || b == b'\t')
            .count();
        let member = &piece[lead..piece.len() - trail];
        if member.is_empty() {
            continue;
        }
        let eq = member.iter().position(|&b| b == b'=')?;
        if !valid_key(&member[..eq]) || !valid_value(&member[eq + 1..]) {
            return None;
        }
        if kept < MAX_MEMBERS {
            slots[kept] = (at + lead, at + lead + member.len());
            kept += 1;
        }
    }
    let joined = |m: &[(usize, usize)]| -> usize {
        m.iter().map(|(s, e)| e - s).sum::<usize>() + m.len().saturating_sub(1)
    };
    if joined(&slots[..kept]) > MAX_BYTES {
        // Long members go first (kept in order), then members from the end.
        let mut short = 0;
        for i in 0..kept {
            let (s, e) = slots[i];
            if e - s <= LONG_MEMBER {
                slots[short] = (s, e);
                short += 1;
            }
        }
        kept = short;
        while joined(&slots[..kept]) > MAX_BYTES {
            kept -= 1;
        }
    }
    let members = &slots[..kept];
    if members.is_empty() {
        return None;
    }
    let mut out = String::with_capacity(joined(members));
    for (i, &(s, e)) in members.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        // Every kept byte is printable ASCII (checked above).
        out.extend(raw[s..e].iter().map(|&b| char::from(b)));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bound(s: &str) -> Option<String> {
        bound_tracestate(s.as_bytes())
    }

    #[test]
    fn a_short_valid_tracestate_is_kept_with_its_order_and_without_blank_members() {
        assert_eq!(bound("vendor=abc").as_deref(), Some("vendor=abc"));
        assert_eq!(
            bound(" rojo=00f067aa0ba902b7 ,\t, congo=t61rcWkgMzE,, a1@b-x=v v").as_deref(),
            Some("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE,a1@b-x=v v")
        );
        assert_eq!(bound(""), None);
        assert_eq!(bound(" , ,"), None);
    }

    #[test]
    fn a_malformed_tracestate_is_dropped_whole() {
        for bad in [
            "novalue",
            "k=",
            "=v",
            "Upper=v",
            "1digitfirst=v",
            "k=a=b",
            "k=tab\there",
            "k=\u{e9}",
            "ok=1,bad key=2",
            "t@=v",
            "t@Sys=v",
            "t@system-too-long=v",
            &format!("{}=v", "k".repeat(257)),
            &format!("k={}", "v".repeat(257)),
        ] {
            assert_eq!(bound(bad), None, "{bad:?}");
        }
        // The limits of the grammar itself are accepted.
        let key = format!("{}=v", "k".repeat(256));
        assert_eq!(bound(&key).as_deref(), Some(key.as_str()));
        assert!(bound(&format!("{}@abcdefghijklmn=v", "t".repeat(241))).is_some());
    }

    #[test]
    fn more_than_32_members_keeps_the_first_32() {
        let all: Vec<String> = (0..40).map(|i| format!("k{i}=v")).collect();
        let kept = bound(&all.join(",")).unwrap();
        assert_eq!(kept, all[..MAX_MEMBERS].join(","));
    }

    #[test]
    fn over_512_bytes_long_members_go_first_then_members_from_the_end() {
        // Ten members of 40 bytes and one of 200 (long): 611 bytes with commas.
        let short: Vec<String> = (0..10)
            .map(|i| format!("s{i}={}", "x".repeat(37)))
            .collect();
        let long = format!("long={}", "y".repeat(195));
        let mut all = short.clone();
        all.insert(3, long);
        let kept = bound(&all.join(",")).unwrap();
        assert_eq!(kept, short.join(","), "the long member went, the rest fit");
        // Twenty short members (819 bytes): members from the end go until it fits.
        let many: Vec<String> = (0..20)
            .map(|i| format!("m{i:02}={}", "z".repeat(36)))
            .collect();
        let kept = bound(&many.join(",")).unwrap();
        assert!(kept.len() <= MAX_BYTES, "{}", kept.len());
        assert_eq!(kept, many[..12].join(","));
        // A member longer than the whole limit is removed whole, never cut.
        let huge = format!("{}={}", "k".repeat(256), "v".repeat(256));
        assert_eq!(bound(&huge), None);
    }

    #[test]
    fn a_64_kib_tracestate_is_bounded() {
        let raw: Vec<String> = (0..2000)
            .map(|i| format!("k{i}={}", "v".repeat(25)))
            .collect();
        let raw = raw.join(",");
        assert!(raw.len() > 60_000);
        let kept = bound(&raw).unwrap();
        assert!(kept.len() <= MAX_BYTES);
        assert!(kept.split(',').count() <= MAX_MEMBERS);
        assert!(kept.starts_with("k0="));
    }
}
