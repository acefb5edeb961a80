use super::*;
use proptest::prelude::*;

/// The oracle for common prefixes: whole equal characters, in bytes.
fn common_by_chars(a: &str, b: &str) -> usize {
    a.chars()
        .zip(b.chars())
        .take_while(|(x, y)| x == y)
        .map(|(x, _)| x.len_utf8())
        .sum()
}

const SAMPLES: [&str; 7] = [
    "",
    "abc",
    "héllo wörld",
    "日本語テキスト",
    "🦀🦀 x",
    "a\u{0}b",
    "naïve é",
];

#[test]
fn char_count_matches_chars() {
    for s in SAMPLES {
        assert_eq!(char_count(s.as_bytes()), s.chars().count(), "{s:?}");
    }
}

#[test]
fn common_prefix_stops_before_a_shared_lead_byte() {
    // 'é' (C3 A9) and 'è' (C3 A8) share their first byte.
    assert_eq!(common_prefix("naïve é".as_bytes(), "naïve è".as_bytes()), 7);
    assert_eq!(common_prefix(b"abc", b"abd"), 2);
    assert_eq!(common_prefix(b"abc", b"abc and more"), 3);
    assert_eq!(common_prefix(b"", b"abc"), 0);
    let long = "x".repeat(100);
    assert_eq!(common_prefix(long.as_bytes(), long.as_bytes()), 100);
}

/// A difference at every offset around the memcmp chunks (and texts of every length there)
/// is found where the byte loop finds it.
#[test]
fn common_byte_prefix_across_equal_chunks() {
    let a: Vec<u8> = (0..3 * 1024 + 70).map(|i| (i % 251) as u8).collect();
    for at in (0..a.len()).filter(|i| i % 1024 < 40 || i % 1024 > 990) {
        let mut b = a.clone();
        b[at] ^= 0x40;
        assert_eq!(common_byte_prefix(&a, &b), at, "differs at {at}");
        assert_eq!(common_byte_prefix(&a[..at], &b), at, "shorter at {at}");
        assert_eq!(common_byte_prefix(&a, &a[..at]), at, "prefix of {at}");
    }
}

#[test]
fn floor_char_boundary_moves_back_only_inside_a_character() {
    let s = "a日b".as_bytes(); // a, E6 97 A5, b
    let floors: Vec<usize> = (0..=6).map(|n| floor_char_boundary(s, n)).collect();
    assert_eq!(floors, [0, 1, 1, 1, 4, 5, 6]);
    assert_eq!(floor_char_boundary(s, 99), 99);
}

#[test]
fn prefix_chars_counts_characters() {
    assert_eq!(prefix_chars("héllo", 2), "hé");
    assert_eq!(prefix_chars("日本語", 2), "日本");
    assert_eq!(prefix_chars("abc", 10), "abc");
    assert_eq!(prefix_chars("abc", 0), "");
    assert_eq!(prefix_chars("日本語", 3), "日本語");
}

/// Mostly characters that share lead bytes, so mismatches land inside characters.
fn text() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop::sample::select(vec![
            'a', 'b', 'é', 'è', 'ï', '日', '本', '🦀', '🦁', '\u{0}',
        ]),
        0..80,
    )
    .prop_map(|v| v.into_iter().collect())
}

proptest! {
    #[test]
    fn agrees_with_str_chars(a in text(), b in text(), n in 0usize..100) {
        prop_assert_eq!(char_count(a.as_bytes()), a.chars().count());
        // A shared prefix makes long block-wise matches likely.
        let b = format!("{a}{b}");
        for (x, y) in [(&a, &b), (&b, &a)] {
            let got = common_prefix(x.as_bytes(), y.as_bytes());
            prop_assert_eq!(got, common_by_chars(x, y));
            prop_assert!(x.is_char_boundary(got));
        }
        let floor = floor_char_boundary(b.as_bytes(), n);
        let want = (0..=n.min(b.len())).rev().find(|&i| b.is_char_boundary(i)).unwrap_or(0);
        prop_assert_eq!(floor, if n > b.len() { n } else { want });
        let cut = prefix_chars(&b, n);
        prop_assert_eq!(cut, b.chars().take(n).collect::<String>());
        let kept = SharedText::copy_of(&b);
        prop_assert_eq!(kept.as_str(), &b[..]);
    }

    #[test]
    fn common_prefix_of_unrelated_texts(a in text(), b in text()) {
        prop_assert_eq!(common_prefix(a.as_bytes(), b.as_bytes()), common_by_chars(&a, &b));
    }
}

proptest! {
    /// Long texts take every path of the block counter: whole 255-block groups, whole 32-byte
    /// blocks and the byte tail, with multi-byte characters straddling every boundary.
    #[test]
    fn char_count_of_long_texts(piece in text(), reps in 1usize..400, tail in text()) {
        let s = format!("{}{tail}", piece.repeat(reps));
        prop_assert_eq!(char_count(s.as_bytes()), s.chars().count());
    }
}

#[test]
fn char_count_at_block_and_group_edges() {
    for len in [
        31,
        32,
        33,
        63 * 32 - 1,
        63 * 32,
        63 * 32 + 1,
        2 * 63 * 32 + 45,
        255 * 32 + 7,
    ] {
        // All-continuation heavy text: 4-byte characters padded with ASCII to `len` bytes.
        let mut s = "🦀".repeat(len / 4);
        s.push_str(&"a".repeat(len - s.len()));
        assert_eq!(char_count(s.as_bytes()), s.chars().count(), "len {len}");
    }
}

/// A kept text shares what it can: a joined string moves in, a string inside the body is a
/// slice of it, anything else is copied; each reads back as the same text.
#[test]
fn shared_text_shares_the_body_or_the_joined_string() {
    let body = bytes::Bytes::from_static("{\"prompt\":\"héllo\"}".as_bytes());
    let inside = std::str::from_utf8(&body[11..17]).unwrap();
    let t = SharedText::within(&body, inside);
    assert_eq!((t.as_str(), t.bytes().as_ptr()), ("héllo", inside.as_ptr()));
    let elsewhere = String::from("héllo");
    let t = SharedText::within(&body, &elsewhere);
    assert_eq!(&*t, "héllo");
    assert_ne!(t.bytes().as_ptr(), elsewhere.as_ptr());
    let joined = String::from("a joined text");
    let at = joined.as_ptr();
    let t = SharedText::from_string(joined);
    assert_eq!((t.as_str(), t.bytes().as_ptr()), ("a joined text", at));
}
