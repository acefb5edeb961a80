//! Routing-text extraction on arbitrary bytes, for every inference API. It must never panic;
//! the text never exceeds `MAX_ROUTING_TEXT`; borrowed text (and model) lies inside the body;
//! a body that is not valid JSON is never accepted (serde_json is the oracle); extraction is
//! deterministic.
//!
//! Input layout: byte 0 picks the API (mod 7), the rest is the body.
#![no_main]

use libfuzzer_sys::fuzz_target;
use radixgate::route::extract::{extract, Api, MAX_ROUTING_TEXT};
use std::borrow::Cow;

const APIS: [Api; 7] = [
    Api::Chat,
    Api::Completions,
    Api::Generate,
    Api::Embeddings,
    Api::Rerank,
    Api::Responses,
    Api::Messages,
];

fn inside(body: &[u8], s: &str) -> bool {
    let (b, p) = (body.as_ptr() as usize, s.as_ptr() as usize);
    s.is_empty() || (p >= b && p + s.len() <= b + body.len())
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, body)) = data.split_first() else {
        return;
    };
    let api = APIS[usize::from(pick) % APIS.len()];
    let got = extract(api, body);
    // The oracle: serde_json. Its nesting limit (128) is an implementation limit, not a JSON
    // rule, and the extractor's (also 128, counted per routed field) can differ from it by a
    // few levels: a body refused only for depth is still valid JSON.
    let valid_json = match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
        Ok(_) => true,
        Err(e) => e.to_string().contains("recursion limit"),
    };
    match &got {
        Ok(info) => {
            assert!(valid_json, "accepted a body that is not JSON");
            assert!(info.text.len() <= MAX_ROUTING_TEXT);
            if let Cow::Borrowed(t) = &info.text {
                assert!(inside(body, t), "borrowed text outside the body");
            }
            if let Some(Cow::Borrowed(m)) = &info.model {
                assert!(inside(body, m), "borrowed model outside the body");
                assert!(!m.is_empty());
            }
        }
        Err(e) => assert!(!e.0.is_empty()),
    }
    assert_eq!(extract(api, body), got, "not deterministic");
});
