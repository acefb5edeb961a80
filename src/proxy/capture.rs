//! Assembles the assistant's reply from a response as it streams past (opt-in
//! `--insert-response-text`), so the tree can learn "prompt + reply" and the next turn of the
//! conversation matches its whole history. Bounded: replies past the cap are not learned.

use crate::http::ChunkedDecoder;
use crate::route::extract::Api;
use bytes::BytesMut;

/// Largest response body captured.
const CAP: usize = 4 << 20;

/// Collects (dechunked) response bytes and extracts the reply text at the end.
pub struct Capture {
    api: Api,
    decoder: Option<ChunkedDecoder>,
    body: BytesMut,
    overflow: bool,
}

impl Capture {
    /// Capture a response body that is chunked (`chunked`) or not.
    pub fn new(api: Api, chunked: bool) -> Capture {
        Capture {
            api,
            decoder: chunked.then(|| ChunkedDecoder::new(CAP as u64)),
            body: BytesMut::new(),
            overflow: false,
        }
    }

    /// Feed raw response body bytes as relayed.
    pub fn feed(&mut self, raw: &[u8]) {
        if self.overflow {
            return;
        }
        match &mut self.decoder {
            Some(d) => {
                if d.feed(raw, &mut self.body).is_err() {
                    self.overflow = true;
                }
            }
            None => {
                if self.body.len() + raw.len() > CAP {
                    self.overflow = true;
                } else {
                    self.body.extend_from_slice(raw);
                }
            }
        }
    }

    /// The assistant's reply, if the body was a complete, recognisable response.
    pub fn reply(&self) -> Option<String> {
        if self.overflow {
            return None;
        }
        let body = &self.body[..];
        let trimmed = body
            .iter()
            .position(|b| !b.is_ascii_whitespace())
            .map(|i| &body[i..])?;
        if trimmed.starts_with(b"data:") || trimmed.starts_with(b"event:") {
            sse_reply(self.api, trimmed)
        } else {
            let v: serde_json::Value = serde_json::from_slice(trimmed).ok()?;
            json_reply(self.api, &v, false)
        }
    }
}

fn json_reply(api: Api, v: &serde_json::Value, delta: bool) -> Option<String> {
    match api {
        Api::Chat => {
            let choice = v.get("choices")?.get(0)?;
            let msg = if delta {
                choice.get("delta")?
            } else {
                choice.get("message")?
            };
            msg.get("content")?.as_str().map(str::to_string)
        }
        Api::Completions => v
            .get("choices")?
            .get(0)?
            .get("text")?
            .as_str()
            .map(str::to_string),
        Api::Generate => v.get("text")?.as_str().map(str::to_string),
        Api::Responses if delta => match v.get("type")?.as_str()? {
            "response.output_text.delta" => v.get("delta")?.as_str().map(str::to_string),
            _ => None,
        },
        // `output`: message items whose content parts carry `text` (output_text).
        Api::Responses => Some(joined_texts(
            v.get("output")?
                .as_array()?
                .iter()
                .filter_map(|item| item.get("content")?.as_array())
                .flatten(),
        )),
        Api::Messages if delta => match v.get("type")?.as_str()? {
            "content_block_delta" => v.get("delta")?.get("text")?.as_str().map(str::to_string),
            _ => None,
        },
        Api::Messages => Some(joined_texts(v.get("content")?.as_array()?.iter())),
        // Its reply is token ids (text only with `output_mode: text`): nothing is learned.
        Api::TokenGenerate | Api::Embeddings | Api::Rerank => None,
    }
}

/// The `text` strings of these parts or blocks, concatenated.
fn joined_texts<'v>(parts: impl Iterator<Item = &'v serde_json::Value>) -> String {
    parts
        .filter_map(|p| p.get("text")?.as_str())
        .collect::<Vec<_>>()
        .concat()
}

fn sse_reply(api: Api, body: &[u8]) -> Option<String> {
    let mut out = String::new();
    for line in body.split(|&b| b == b'\n') {
        let Some(data) = line.strip_prefix(b"data:") else {
            continue;
        };
        let data = data.trim_ascii();
        if data == b"[DONE]" || data.is_empty() {
            continue;
        }
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else {
            continue;
        };
        if let Some(piece) = json_reply(api, &v, true) {
            if api == Api::Generate {
                // SGLang streams the cumulative text: the last event holds the whole reply.
                out = piece;
            } else {
                out.push_str(&piece);
            }
        }
    }
    (!out.is_empty()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_and_messages_replies() {
        let mut c = Capture::new(Api::Responses, false);
        c.feed(br#"{"output":[{"type":"reasoning","summary":[]},{"type":"message","content":[{"type":"output_text","text":"Hi"},{"type":"output_text","text":" there"}]}]}"#);
        assert_eq!(c.reply().as_deref(), Some("Hi there"));
        let mut c = Capture::new(Api::Responses, false);
        c.feed(b"event: response.created\ndata: {\"type\":\"response.created\"}\n\nevent: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi\"}\n\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\" you\"}\n\ndata: {\"type\":\"response.completed\",\"response\":{\"output\":[]}}\n\n");
        assert_eq!(c.reply().as_deref(), Some("Hi you"));
        let mut c = Capture::new(Api::Messages, false);
        c.feed(br#"{"content":[{"type":"thinking","thinking":"x"},{"type":"text","text":"Yo"}]}"#);
        assert_eq!(c.reply().as_deref(), Some("Yo"));
        let mut c = Capture::new(Api::Messages, false);
        c.feed(b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"content\":[]}}\n\nevent: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Yo\"}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
        assert_eq!(c.reply().as_deref(), Some("Yo"));
    }

    #[test]
    fn chat_json_and_sse() {
        let mut c = Capture::new(Api::Chat, false);
        c.feed(br#"{"choices":[{"message":{"role":"assistant","content":"Hello there"}}]}"#);
        assert_eq!(c.reply().as_deref(), Some("Hello there"));

        let mut c = Capture::new(Api::Chat, true);
        let events =
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n\
                      data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n\
                      data: {\"choices\":[{\"delta\":{\"content\":\"lo\"}}]}\n\ndata: [DONE]\n\n";
        let chunked = format!("{:x}\r\n{}\r\n0\r\n\r\n", events.len(), events);
        for piece in chunked.as_bytes().chunks(7) {
            c.feed(piece);
        }
        assert_eq!(c.reply().as_deref(), Some("Hello"));
    }

    #[test]
    fn generate_stream_is_cumulative() {
        let mut c = Capture::new(Api::Generate, false);
        c.feed(b"data: {\"text\":\"a\"}\n\ndata: {\"text\":\"a b\"}\n\ndata: [DONE]\n\n");
        assert_eq!(c.reply().as_deref(), Some("a b"));
    }

    #[test]
    fn garbage_gives_nothing() {
        let mut c = Capture::new(Api::Completions, false);
        c.feed(b"<html>");
        assert_eq!(c.reply(), None);
    }
}
