//! Byte spans in a JSON document already known to be valid (checked by a parser first): where a
//! value, a member or an element starts and ends, without building any value. For edits that
//! must keep every other byte as the client or worker wrote it (splicing fields into a request
//! body, a list into a worker's answer). On invalid input the answers are meaningless but stay
//! in bounds: no panic, no loop.

/// The first byte at or after `i` that is not JSON whitespace.
pub fn skip_ws(doc: &[u8], mut i: usize) -> usize {
    while doc.get(i).is_some_and(u8::is_ascii_whitespace) {
        i += 1;
    }
    i
}

/// Just past the closing quote of the string whose opening quote is at `i`.
pub fn string_end(doc: &[u8], mut i: usize) -> usize {
    i += 1;
    while let Some(&c) = doc.get(i) {
        match c {
            b'\\' => i += 2,
            b'"' => return i + 1,
            _ => i += 1,
        }
    }
    doc.len()
}

/// Just past the value that starts at `i` (a valid document's value).
pub fn value_end(doc: &[u8], mut i: usize) -> usize {
    match doc.get(i) {
        Some(b'"') => string_end(doc, i),
        Some(b'{' | b'[') => {
            let mut depth = 0usize;
            while let Some(&c) = doc.get(i) {
                match c {
                    b'"' => {
                        i = string_end(doc, i);
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth = depth.saturating_sub(1);
                        if depth == 0 {
                            return i + 1;
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
            doc.len()
        }
        _ => {
            while doc
                .get(i)
                .is_some_and(|&c| !matches!(c, b',' | b']' | b'}') && !c.is_ascii_whitespace())
            {
                i += 1;
            }
            i
        }
    }
}

/// One member of an object: its key's bytes (as written, without quotes) and its value's span.
pub struct Member<'a> {
    /// Where the member starts: its key's opening quote.
    pub at: usize,
    /// The key as written, without its quotes (escapes not undone).
    pub key: &'a [u8],
    /// Where the value starts.
    pub start: usize,
    /// Just past the value.
    pub end: usize,
}

/// The members of the object at `open` (its `{`), in order; nothing when it is not an object.
pub fn members(doc: &[u8], open: usize) -> Members<'_> {
    Members {
        doc,
        i: open + 1,
        done: doc.get(open) != Some(&b'{'),
    }
}

pub struct Members<'a> {
    doc: &'a [u8],
    i: usize,
    done: bool,
}

impl<'a> Iterator for Members<'a> {
    type Item = Member<'a>;
    fn next(&mut self) -> Option<Member<'a>> {
        if self.done {
            return None;
        }
        let doc = self.doc;
        let k = skip_ws(doc, self.i);
        if doc.get(k) != Some(&b'"') {
            self.done = true;
            return None;
        }
        let key_end = string_end(doc, k);
        let key = doc
            .get(k + 1..key_end.saturating_sub(1))
            .unwrap_or_default();
        let colon = skip_ws(doc, key_end);
        let start = skip_ws(doc, colon + 1);
        let end = value_end(doc, start);
        let after = skip_ws(doc, end);
        if doc.get(after) == Some(&b',') {
            self.i = after + 1;
        } else {
            self.done = true;
        }
        Some(Member {
            at: k,
            key,
            start,
            end,
        })
    }
}

/// The start of each element of the list at `open` (its `[`).
pub fn elements(doc: &[u8], open: usize) -> Vec<usize> {
    let mut starts = Vec::new();
    let mut i = skip_ws(doc, open + 1);
    while doc.get(i).is_some_and(|&c| c != b']') {
        starts.push(i);
        i = skip_ws(doc, value_end(doc, i));
        if doc.get(i) != Some(&b',') {
            break;
        }
        i = skip_ws(doc, i + 1);
    }
    starts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_and_elements_of_valid_documents() {
        let doc = br#" { "a" : [1, {"x":"]"}] ,"b\"c":"s,}" , "d":-1.5e3,"e":{}}"#;
        let open = skip_ws(doc, 0);
        let got: Vec<(&[u8], &[u8])> = members(doc, open)
            .map(|m| (m.key, &doc[m.start..m.end]))
            .collect();
        assert_eq!(
            got,
            [
                (&b"a"[..], &br#"[1, {"x":"]"}]"#[..]),
                (br#"b\"c"#, br#""s,}""#),
                (b"d", b"-1.5e3"),
                (b"e", b"{}"),
            ]
        );
        let list = br#"[ 1 , "a]" ,[2,3], {"k":[]} ]"#;
        let starts = elements(list, 0);
        let vals: Vec<&[u8]> = starts
            .iter()
            .map(|&i| &list[i..value_end(list, i)])
            .collect();
        assert_eq!(vals, [&b"1"[..], br#""a]""#, b"[2,3]", br#"{"k":[]}"#]);
        assert!(members(b"[1]", 0).next().is_none(), "not an object");
        assert!(elements(b"[]", 0).is_empty());
    }

    #[test]
    fn garbage_stays_in_bounds() {
        for doc in [&b"{\"a"[..], b"[\"\\", b"{\"a\":", b"{{{{", b"\"", b""] {
            let _ = members(doc, 0).count();
            let _ = elements(doc, 0);
            assert!(value_end(doc, 0) <= doc.len());
        }
    }
}
