use super::*;
use proptest::prelude::*;

/// The rule byte by byte: the oracle for the block version.
fn check_bytewise(body: &[u8]) -> Result<(), StructureError> {
    let (mut in_string, mut depth) = (false, 0i64);
    let mut i = 0;
    while i < body.len() {
        match body[i] {
            b'\\' => {
                if body.get(i + 1) == Some(&b'u') {
                    let hex = body.get(i + 2..i + 6);
                    if !hex.is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)) {
                        return Err(StructureError::BadUnicodeEscape(i));
                    }
                }
                i += 2;
                continue;
            }
            b'"' => in_string = !in_string,
            b'[' | b'{' if !in_string => {
                depth += 1;
                if depth > i64::from(MAX_NESTING) {
                    return Err(StructureError::TooDeep);
                }
            }
            b']' | b'}' if !in_string => depth -= 1,
            _ => {}
        }
        i += 1;
    }
    Ok(())
}

fn nested(depth: usize) -> String {
    format!(
        r#"{{"x":{}1{}}}"#,
        "[".repeat(depth - 1),
        "]".repeat(depth - 1)
    )
}

#[test]
fn depth_is_refused_one_past_the_limit() {
    let limit = MAX_NESTING as usize;
    assert!(check(nested(limit).as_bytes()).is_ok());
    assert_eq!(
        check(nested(limit + 1).as_bytes()),
        Err(StructureError::TooDeep)
    );
    // Closing brackets in the same block as the openings that pass the limit.
    let zigzag = format!(r#"{{"x":[{}]}}"#, "[[]".repeat(2 * limit));
    assert_eq!(check(zigzag.as_bytes()), Err(StructureError::TooDeep));
    let balanced = format!(r#"{{"x":[{}]}}"#, "[]".repeat(4 * limit));
    assert!(check(balanced.as_bytes()).is_ok());
}

#[test]
fn brackets_inside_strings_do_not_count() {
    let deep_text = format!(r#"{{"x":"{}","y":"{}"}}"#, "[{".repeat(500), "}]".repeat(3));
    assert!(check(deep_text.as_bytes()).is_ok());
    // An escaped quote does not end the string; an escaped backslash before a quote does.
    let escaped_quote = format!(r#"{{"x":"a\"{}"}}"#, "[".repeat(200));
    assert!(check(escaped_quote.as_bytes()).is_ok());
    let escaped_backslash = format!(r#"{{"x":"a\\",{}}}"#, "[".repeat(200));
    assert_eq!(
        check(escaped_backslash.as_bytes()),
        Err(StructureError::TooDeep)
    );
}

#[test]
fn escapes_across_a_block_boundary() {
    for pad in 0..140 {
        // The backslash at every offset, escaping a quote that must not end the string.
        let body = format!(r#"{{"x":"{}\"{}"}}"#, "a".repeat(pad), "[".repeat(200));
        assert!(check(body.as_bytes()).is_ok(), "pad {pad}");
        let body = format!(r#"{{"x":"{}\\"{}}}"#, "a".repeat(pad), "[".repeat(200));
        assert_eq!(
            check(body.as_bytes()),
            Err(StructureError::TooDeep),
            "pad {pad}"
        );
        let body = format!(r#"{{"x":"{}\u00e9"}}"#, "a".repeat(pad));
        assert!(check(body.as_bytes()).is_ok(), "pad {pad}");
        let body = format!(r#"{{"x":"{}\u00g9"}}"#, "a".repeat(pad));
        assert_eq!(
            check(body.as_bytes()),
            Err(StructureError::BadUnicodeEscape(pad + 6)),
            "pad {pad}"
        );
    }
}

/// Runs of backslashes of every length ending at every offset around a block boundary: an
/// odd run escapes the quote after it, an even one does not.
#[test]
fn backslash_runs_across_a_block_boundary() {
    for pad in 50..80 {
        for run in 1..7 {
            let body = format!(
                r#"{{"x":"{}{}"{}"#,
                "a".repeat(pad),
                "\\".repeat(run),
                "[".repeat(200)
            );
            let want = if run % 2 == 1 {
                Ok(())
            } else {
                Err(StructureError::TooDeep)
            };
            assert_eq!(
                check(body.as_bytes()).map(|_| ()),
                want,
                "pad {pad} run {run}"
            );
            assert_eq!(check_bytewise(body.as_bytes()), want, "pad {pad} run {run}");
        }
    }
}

#[test]
fn unicode_escapes_need_four_hex_digits() {
    for ok in [
        r#""\u0041""#,
        r#""\uABCDef""#,
        r#""\\u""#,
        r#""\ud83d\ude00""#,
    ] {
        assert!(check(ok.as_bytes()).is_ok(), "{ok}");
    }
    for bad in [
        r#""\u""#,
        r#""\u12""#,
        r#""\u12G4""#,
        r#""x\u00"#,
        r#""\u 123""#,
    ] {
        assert!(
            matches!(
                check(bad.as_bytes()),
                Err(StructureError::BadUnicodeEscape(_))
            ),
            "{bad}"
        );
    }
}

/// A megabyte of `[` is refused by counting, never by recursing.
#[test]
fn a_flood_of_brackets_is_refused_without_recursion() {
    let flood = vec![b'['; 1 << 20];
    assert_eq!(check(&flood), Err(StructureError::TooDeep));
}

/// One byte of 0x80 or above anywhere (every offset of bodies around the block size, in a
/// string or not) makes the body non-ASCII for every mask builder.
#[test]
fn one_high_byte_anywhere_is_seen() {
    for len in [0, 1, 63, 64, 65, 127, 128, 129, 200] {
        let plain = format!("{{\"t\":\"{}\"}}", "a".repeat(len));
        assert_eq!(
            check(plain.as_bytes()),
            Ok(Shape { ascii: true }),
            "len {len}"
        );
        for at in 0..plain.len() {
            let mut body = plain.clone().into_bytes();
            body[at] = 0x80 | (at as u8);
            let want = Ok(Shape { ascii: false });
            assert_eq!(check_portable(&body), want, "len {len} at {at}");
            #[cfg(target_arch = "x86_64")]
            {
                assert_eq!(x86::check_sse2(&body), want, "len {len} at {at}");
                if std::is_x86_feature_detected!("avx2") {
                    // SAFETY: AVX2 checked just above.
                    assert_eq!(unsafe { x86::check_avx2(&body) }, want, "len {len} at {at}");
                }
            }
        }
    }
}

proptest! {
    #[test]
    fn simd_and_portable_loops_agree(bytes in prop::collection::vec(
        prop_oneof![4 => Just(b'"'), 2 => Just(b'\\'), 3 => Just(b'['), 3 => Just(b']'),
            2 => Just(b'{'), 2 => Just(b'}'), 1 => Just(b'{' ^ 0x20), 1 => Just(b'}' ^ 0x20),
            1 => Just(b'u'), 30 => any::<u8>()], 0..400)) {
        let portable = check_portable(&bytes);
        #[cfg(target_arch = "x86_64")]
        {
            prop_assert_eq!(&x86::check_sse2(&bytes), &portable);
            if std::is_x86_feature_detected!("avx2") {
                // SAFETY: AVX2 checked just above.
                prop_assert_eq!(&unsafe { x86::check_avx2(&bytes) }, &portable);
            }
        }
        prop_assert_eq!(check(&bytes), portable);
    }

    #[test]
    fn blocks_agree_with_the_bytewise_rule(bytes in prop::collection::vec(
        prop_oneof![4 => Just(b'"'), 4 => Just(b'\\'), 8 => Just(b'['), 6 => Just(b']'),
            4 => Just(b'{'), 3 => Just(b'}'), 3 => Just(b'u'), 3 => Just(b'0'), 3 => Just(b'a'),
            1 => Just(b'g')], 0..600)) {
        prop_assert_eq!(check(&bytes).is_ok(), check_bytewise(&bytes).is_ok());
    }
}
