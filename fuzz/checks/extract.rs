//! Routing-text extraction on arbitrary bytes, for every inference API. It must never panic;
//! the text never exceeds `MAX_ROUTING_TEXT`; borrowed text (and model) lies inside the body;
//! a body that is not valid JSON (serde_json is the oracle) or not UTF-8 is never accepted, and
//! one that serde_json reads whole is never refused as not JSON; extraction is deterministic.
//!
//! Input layout: byte 0 picks the API (mod 7), the rest is the body.
//!
//! Shared by the `extract` fuzz target and `tests/fuzz_corpus.rs`, which replays the stored
//! inputs in `cargo test`: one copy of the checks, so a stored input is held to exactly what the
//! fuzzer holds it to.

use radixgate::route::extract::{extract, Api, RoutingText, MAX_ROUTING_TEXT};
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

/// Runs the checks on one input; panics where the fuzzer would report a crash.
pub fn run(data: &[u8]) {
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
    // The converse: a body serde_json reads whole into a `Value` (every string decoded, so
    // checked as strictly as the extractor checks the strings it reads) may be refused for its
    // shape, never as not JSON. Without it a scan that lost a quote at a block edge and then
    // refused a valid body would pass.
    let reads_whole = serde_json::from_slice::<serde_json::Value>(body).is_ok();
    match &got {
        Ok(info) => {
            assert!(valid_json, "accepted a body that is not JSON");
            // serde_json's skip lets a string that is not UTF-8 through; the extractor checks
            // every string it skips too.
            assert!(
                std::str::from_utf8(body).is_ok(),
                "accepted a body that is not UTF-8"
            );
            assert!(info.text.len() <= MAX_ROUTING_TEXT);
            if let RoutingText::InBody(t) = &info.text {
                assert!(inside(body, t), "borrowed text outside the body");
            }
            if let Some(Cow::Borrowed(m)) = &info.model {
                assert!(inside(body, m), "borrowed model outside the body");
                assert!(!m.is_empty());
            }
        }
        Err(e) => {
            assert!(!e.0.is_empty());
            assert!(
                !(reads_whole && e.0.starts_with("invalid JSON")),
                "refused JSON as not JSON: {e}"
            );
        }
    }
    assert_eq!(extract(api, body), got, "not deterministic");
}
