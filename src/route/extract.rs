//! What a request is routed on, borrowed from its JSON body without re-serialising it: the
//! `model`, the `stream` flag and the routing text, built exactly as the reference builds it
//! (chat: message contents joined by single spaces, text parts only, assistant
//! `reasoning_content` appended; completions: `prompt`, arrays joined by spaces; `/generate`:
//! `text`, else `input_ids` as decimals joined by spaces). Strings without escapes stay borrowed
//! from the body, so a single-message chat or a plain prompt costs no copy.

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use std::borrow::Cow;
use std::fmt;

/// Which inference API a request uses; decides how the routing text is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Completions,
    /// `/generate`
    Generate,
    /// `/v1/embeddings` (`input`)
    Embeddings,
    /// `/v1/rerank`, `/rerank` (`query`)
    Rerank,
}

/// Routing inputs borrowed from a body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingInfo<'a> {
    pub model: Option<Cow<'a, str>>,
    pub stream: bool,
    pub text: Cow<'a, str>,
}

/// Why a body cannot be routed; answered with 400 and an OpenAI-style error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtractError(pub String);

impl fmt::Display for ExtractError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Accumulates text pieces, staying borrowed while there is only one piece.
#[derive(Default)]
struct Joiner<'a> {
    text: Option<Cow<'a, str>>,
}

impl<'a> Joiner<'a> {
    fn push(&mut self, piece: Cow<'a, str>) {
        match self.text.take() {
            None => self.text = Some(piece),
            Some(prev) => {
                let mut s = prev.into_owned();
                s.reserve(piece.len() + 1);
                s.push(' ');
                s.push_str(&piece);
                self.text = Some(Cow::Owned(s));
            }
        }
    }
    fn push_number(&mut self, n: &str) {
        self.push(Cow::Owned(n.to_string()));
    }
    fn finish(self) -> Cow<'a, str> {
        self.text.unwrap_or(Cow::Borrowed(""))
    }
}

/// A JSON string, borrowed when it has no escapes.
struct Str<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Str<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v.to_string())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

/// Text pieces of a JSON value: a string, a number, or (nested) arrays of them. Chat content
/// parts (`{"type":"text","text":..}`) contribute their `text`; other objects contribute nothing.
struct Pieces<'a>(Vec<Cow<'a, str>>);

impl<'de: 'a, 'a> Deserialize<'de> for Pieces<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Pieces<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, a number, an array or a content part")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Pieces(vec![Cow::Borrowed(v)]))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Pieces(vec![Cow::Owned(v.to_string())]))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Pieces(vec![Cow::Owned(v)]))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(Pieces(vec![Cow::Owned(v.to_string())]))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Ok(Pieces(vec![Cow::Owned(v.to_string())]))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
                Ok(Pieces(vec![Cow::Owned(v.to_string())]))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Pieces(Vec::new()))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
                Ok(Pieces(Vec::new()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(p) = seq.next_element::<Pieces<'de>>()? {
                    out.extend(p.0);
                }
                Ok(Pieces(out))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                // A chat content part: keep `text` of parts whose type is text (or untyped).
                let mut text: Option<Cow<'de, str>> = None;
                let mut is_text = true;
                while let Some(k) = map.next_key::<Str<'de>>()? {
                    match k.0.as_ref() {
                        "text" => match map.next_value::<Option<Str<'de>>>()? {
                            Some(s) => text = Some(s.0),
                            None => text = None,
                        },
                        "type" => {
                            let t = map.next_value::<Option<Str<'de>>>()?;
                            is_text = t.map(|t| t.0 == "text").unwrap_or(true);
                        }
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(Pieces(match (is_text, text) {
                    (true, Some(t)) => vec![t],
                    _ => Vec::new(),
                }))
            }
        }
        d.deserialize_any(V)
    }
}

/// One chat message: its content pieces and optional reasoning.
struct Message<'a> {
    pieces: Vec<Cow<'a, str>>,
}

impl<'de: 'a, 'a> Deserialize<'de> for Message<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Message<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a chat message object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut content = Vec::new();
                let mut reasoning = None;
                while let Some(k) = map.next_key::<Str<'de>>()? {
                    match k.0.as_ref() {
                        "content" => content = map.next_value::<Pieces<'de>>()?.0,
                        "reasoning_content" => {
                            reasoning = map.next_value::<Option<Str<'de>>>()?.map(|s| s.0)
                        }
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                content.extend(reasoning);
                Ok(Message { pieces: content })
            }
        }
        d.deserialize_map(V)
    }
}

#[derive(Deserialize)]
struct Body<'a> {
    #[serde(borrow, default)]
    model: Option<Str<'a>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(borrow, default)]
    prompt: Option<Pieces<'a>>,
    #[serde(borrow, default)]
    text: Option<Pieces<'a>>,
    #[serde(borrow, default)]
    input_ids: Option<Pieces<'a>>,
    #[serde(default)]
    input_embeds: Option<IgnoredAny>,
    #[serde(borrow, default)]
    input: Option<Pieces<'a>>,
    #[serde(borrow, default)]
    query: Option<Pieces<'a>>,
}

/// Parse `body` as JSON and borrow the routing inputs for `api`.
pub fn extract(api: Api, body: &[u8]) -> Result<RoutingInfo<'_>, ExtractError> {
    let parsed: Body<'_> = serde_json::from_slice(body).map_err(|e| {
        ExtractError(if e.is_data() {
            format!("invalid request body: {e}")
        } else {
            format!("invalid JSON in request body: {e}")
        })
    })?;
    let mut joiner = Joiner::default();
    match api {
        Api::Chat => {
            let messages = parsed
                .messages
                .ok_or_else(|| ExtractError("`messages` is required".into()))?;
            for m in messages {
                for p in m.pieces {
                    joiner.push(p);
                }
            }
        }
        Api::Completions => {
            let prompt = parsed
                .prompt
                .ok_or_else(|| ExtractError("`prompt` is required".into()))?;
            prompt.0.into_iter().for_each(|p| joiner.push(p));
        }
        Api::Generate => {
            if let Some(t) = parsed.text {
                t.0.into_iter().for_each(|p| joiner.push(p));
            } else if let Some(ids) = parsed.input_ids {
                ids.0.iter().for_each(|p| joiner.push_number(p));
            } else if parsed.input_embeds.is_none() {
                return Err(ExtractError(
                    "one of `text`, `input_ids` or `input_embeds` is required".into(),
                ));
            }
        }
        Api::Embeddings => {
            if let Some(i) = parsed.input {
                i.0.into_iter().for_each(|p| joiner.push(p));
            }
        }
        Api::Rerank => {
            if let Some(q) = parsed.query {
                q.0.into_iter().for_each(|p| joiner.push(p));
            }
        }
    }
    Ok(RoutingInfo {
        // An empty model name means "no model": one default tree, as when the field is absent.
        model: parsed.model.map(|m| m.0).filter(|m| !m.is_empty()),
        stream: parsed.stream.unwrap_or(false),
        text: joiner.finish(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(api: Api, body: &str) -> String {
        extract(api, body.as_bytes()).unwrap().text.into_owned()
    }

    #[test]
    fn chat_contents_join_with_single_spaces() {
        let b = r#"{"model":"m","messages":[{"role":"system","content":"You are terse."},
            {"role":"user","content":[{"type":"text","text":"Hi"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"there"}]},
            {"role":"assistant","content":"Hello","reasoning_content":"think"},{"role":"user","content":null}],
            "stream":true,"my_unknown_field":{"a":[1,2]}}"#;
        let info = extract(Api::Chat, b.as_bytes()).unwrap();
        assert_eq!(info.text, "You are terse. Hi there Hello think");
        assert_eq!(info.model.as_deref(), Some("m"));
        assert!(info.stream);
    }

    #[test]
    fn single_plain_string_is_borrowed_from_the_body() {
        let b = br#"{"messages":[{"role":"user","content":"plain text"}]}"#;
        let info = extract(Api::Chat, b).unwrap();
        assert!(matches!(info.text, Cow::Borrowed(_)));
        assert!(info.model.is_none());
        let b = br#"{"prompt":"abc","model":"x"}"#;
        assert!(matches!(
            extract(Api::Completions, b).unwrap().text,
            Cow::Borrowed(_)
        ));
    }

    #[test]
    fn escapes_are_decoded() {
        assert_eq!(
            text(Api::Completions, r#"{"prompt":"a\nb \u00e9"}"#),
            "a\nb é"
        );
    }

    #[test]
    fn completions_generate_embeddings_rerank() {
        assert_eq!(text(Api::Completions, r#"{"prompt":["a","b"]}"#), "a b");
        assert_eq!(text(Api::Generate, r#"{"text":"hello"}"#), "hello");
        assert_eq!(
            text(Api::Generate, r#"{"input_ids":[1,20,300]}"#),
            "1 20 300"
        );
        assert_eq!(text(Api::Embeddings, r#"{"input":["x","y"]}"#), "x y");
        assert_eq!(text(Api::Rerank, r#"{"query":"q","documents":["d"]}"#), "q");
    }

    #[test]
    fn bad_bodies_are_refused() {
        assert!(extract(Api::Chat, b"{not json").is_err());
        assert!(extract(Api::Chat, br#"{"model":"m"}"#)
            .unwrap_err()
            .0
            .contains("messages"));
        assert!(extract(Api::Completions, br#"{}"#).is_err());
        assert!(extract(Api::Generate, br#"{"sampling_params":{}}"#).is_err());
        assert!(extract(Api::Chat, br#"{"messages":"nope"}"#).is_err());
        assert!(extract(Api::Chat, br#"[1,2]"#).is_err());
        assert!(extract(Api::Generate, br#"{"input_embeds":[[0.1]]}"#).is_ok());
    }
}
