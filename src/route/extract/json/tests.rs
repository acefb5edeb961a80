//! The parser alone, on the cases its verdicts and values hinge on; agreement with serde_json
//! over generated bodies is `parser_agreement.rs`.
use super::*;
use serde::Deserialize;

fn value(body: &str) -> Result<serde_json::Value> {
    let mut de = Deserializer::new(body.as_bytes());
    let v = serde_json::Value::deserialize(&mut de)?;
    de.end()?;
    Ok(v)
}

#[test]
fn values_read_as_serde_json_reads_them() {
    for body in [
        r#"{"a":[1,-2,3.5,true,false,null,"x\n\u00e9\ud83d\ude00"],"b":{}}"#,
        " [ ] ",
        "18446744073709551615",
        "-9223372036854775808",
        "18446744073709551616",
        "-9223372036854775809",
        "1e-400",
        "0.1e-5",
        "\"caf\u{e9}\"",
    ] {
        assert_eq!(
            value(body).unwrap(),
            serde_json::from_str::<serde_json::Value>(body).unwrap(),
            "{body}"
        );
    }
    // `-0` is the float -0.0, as in serde_json.
    assert_eq!(value("-0").unwrap().to_string(), "-0.0");
}

#[test]
fn malformed_input_is_refused_with_its_offset() {
    for (body, at) in [
        ("[1,]", 3),
        (r#"{"a":1,}"#, 7),
        (r#"{"a" 1}"#, 5),
        ("[01]", 2),
        ("[1.]", 3),
        ("[.5]", 1),
        ("[-]", 2),
        ("tru", 3),
        ("[nul]", 1),
        (r#""a\qb""#, 2),
        ("\"a\tb\"", 2),
        ("[1] 2", 4),
        ("1e400", 0),
    ] {
        let e = value(body).unwrap_err();
        assert!(e.is_syntax(), "{body}: {e}");
        assert_eq!(e.at, Some(at), "{body}: {e}");
    }
}

#[test]
fn nesting_past_the_bound_is_refused_without_recursing_further() {
    let ok = format!("{}1{}", "[".repeat(128), "]".repeat(128));
    assert!(value(&ok).is_ok());
    let deep = format!("{}1{}", "[".repeat(129), "]".repeat(129));
    let e = value(&deep).unwrap_err();
    assert!(!e.is_syntax() && e.msg.contains("nested deeper"), "{e}");
    // A skipped value too, and an unclosed one far deeper than any stack would take.
    let mut de = Deserializer::new(b"[[[[");
    de.depth = MAX_NESTING - 2;
    assert!(de::IgnoredAny::deserialize(&mut de)
        .unwrap_err()
        .msg
        .contains("nested"));
    let flood = "[".repeat(1_000_000);
    assert!(value(&flood).is_err());
}

#[test]
fn utf8_is_checked_in_every_string_that_is_not_ascii() {
    assert!(value("\"caf\u{e9}\"").is_ok());
    let e = value_bytes(b"[\"ok\",\"a\xffb\"]").unwrap_err();
    assert_eq!(e.at, Some(8));
    assert!(
        value_bytes(b"[\"a\",\xc3\xa9]").is_err(),
        "not ASCII outside a string"
    );
}

fn value_bytes(body: &[u8]) -> Result<serde_json::Value> {
    let mut de = Deserializer::new(body);
    let v = serde_json::Value::deserialize(&mut de)?;
    de.end()?;
    Ok(v)
}
