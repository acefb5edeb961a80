//! Reading what a server answers, without I/O: splitting a server-sent-events stream into
//! `data:` payloads, and pulling the generated text, token counts and `cached_tokens` out of
//! SGLang / OpenAI JSON (chat, completions and `/generate`, streamed or whole).

use std::borrow::Cow;

use serde::Deserialize;

/// Splits an SSE byte stream into event payloads (`data:` lines joined by `\n`), across reads
/// of any size; `\n` and `\r\n` line ends both work. Buffers are reused between events.
#[derive(Debug, Default)]
pub struct SseSplitter {
    buf: Vec<u8>,
    data: Vec<u8>,
    has_data: bool,
}

impl SseSplitter {
    /// Feed bytes; `on_event` is called with the payload of every event completed by them.
    pub fn feed(&mut self, input: &[u8], mut on_event: impl FnMut(&[u8])) {
        self.buf.extend_from_slice(input);
        let mut pos = 0;
        while let Some(nl) = memchr(b'\n', &self.buf[pos..]) {
            let mut line = &self.buf[pos..pos + nl];
            pos += nl + 1;
            if let [rest @ .., b'\r'] = line {
                line = rest;
            }
            if line.is_empty() {
                if self.has_data {
                    on_event(&self.data);
                }
                self.data.clear();
                self.has_data = false;
            } else if let Some(v) = line.strip_prefix(b"data:") {
                let v = v.strip_prefix(b" ").unwrap_or(v);
                if self.has_data {
                    self.data.push(b'\n');
                }
                self.data.extend_from_slice(v);
                self.has_data = true;
            }
            // Comments (":…"), `event:`, `id:` and `retry:` lines carry nothing we measure.
        }
        self.buf.drain(..pos);
    }
}

fn memchr(b: u8, s: &[u8]) -> Option<usize> {
    s.iter().position(|&c| c == b)
}

#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(default, borrow)]
    choices: Option<Vec<Choice<'a>>>,
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    meta_info: Option<MetaInfo>,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default, borrow)]
    delta: Option<Content<'a>>,
    #[serde(default, borrow)]
    message: Option<Content<'a>>,
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Content<'a> {
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<Details>,
}

#[derive(Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct MetaInfo {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    cached_tokens: Option<u64>,
}

/// What one event (or a whole non-streamed body) contributed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// New generated text arrived (counts for TTFT and inter-token latency).
    Content,
    /// Valid, but no new text (role chunk, finish chunk, usage chunk).
    Other,
    /// `[DONE]`.
    Done,
    /// An error object, or JSON we cannot read.
    Error,
}

/// Everything measured from one response body.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The generated text, which becomes the assistant turn in the session history.
    pub text: String,
    /// `usage.prompt_tokens` / `meta_info.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.completion_tokens` / `meta_info.completion_tokens`.
    pub completion_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens` / `meta_info.cached_tokens`.
    pub cached_tokens: Option<u64>,
    /// Number of events that carried new text.
    pub content_events: u32,
    /// The first error message seen, if any.
    pub error: Option<String>,
    /// `[DONE]` was seen.
    pub done: bool,
}

impl Answer {
    /// Take one streamed event payload. `/generate` streams carry the cumulative text by default
    /// (SGLang) and deltas with `--incremental-streaming-output`; both are accepted: a payload
    /// that extends the text so far replaces it, anything else is appended.
    pub fn on_event(&mut self, payload: &[u8]) -> EventKind {
        let trimmed = payload.trim_ascii();
        if trimmed == b"[DONE]" {
            self.done = true;
            return EventKind::Done;
        }
        let chunk = match self.read_chunk(trimmed, "event") {
            Ok(c) => c,
            Err(kind) => return kind,
        };
        let before = self.text.len();
        if let Some(c) = chunk.choices.as_ref().and_then(|c| c.first()) {
            if let Some(s) = c
                .delta
                .as_ref()
                .and_then(|d| d.content.as_deref())
                .or(c.text.as_deref())
            {
                self.text.push_str(s);
            }
        } else if let Some(t) = chunk.text.as_deref() {
            if t.len() >= self.text.len() && t.starts_with(self.text.as_str()) {
                self.text.replace_range(.., t);
            } else {
                self.text.push_str(t);
            }
        }
        if self.text.len() > before {
            self.content_events += 1;
            EventKind::Content
        } else {
            EventKind::Other
        }
    }

    /// Take a whole (non-streamed) JSON body.
    pub fn on_body(&mut self, body: &[u8]) -> EventKind {
        let chunk = match self.read_chunk(body, "response") {
            Ok(c) => c,
            Err(kind) => return kind,
        };
        let text = match chunk.choices.as_ref().and_then(|c| c.first()) {
            Some(c) => c
                .message
                .as_ref()
                .and_then(|m| m.content.as_deref())
                .or(c.text.as_deref()),
            None => chunk.text.as_deref(),
        };
        self.text.push_str(text.unwrap_or(""));
        if self.text.is_empty() {
            EventKind::Other
        } else {
            self.content_events = 1;
            EventKind::Content
        }
    }

    /// Parse one JSON object (an event payload or a whole body, `what` in the message) and take
    /// its token counts. Unreadable JSON or an error object yields `Err(EventKind::Error)`, with
    /// the first error message kept in [`Answer::error`].
    fn read_chunk<'b>(&mut self, json: &'b [u8], what: &str) -> Result<Chunk<'b>, EventKind> {
        let chunk: Chunk = match serde_json::from_slice(json) {
            Ok(c) => c,
            Err(e) => {
                self.error
                    .get_or_insert_with(|| format!("bad {what} JSON: {e}"));
                return Err(EventKind::Error);
            }
        };
        self.take_counts(&chunk);
        if let Some(err) = &chunk.error {
            self.error.get_or_insert_with(|| err.to_string());
            return Err(EventKind::Error);
        }
        Ok(chunk)
    }

    fn take_counts(&mut self, chunk: &Chunk) {
        if let Some(u) = &chunk.usage {
            self.prompt_tokens = u.prompt_tokens.or(self.prompt_tokens);
            self.completion_tokens = u.completion_tokens.or(self.completion_tokens);
            if let Some(c) = u
                .prompt_tokens_details
                .as_ref()
                .and_then(|d| d.cached_tokens)
            {
                self.cached_tokens = Some(c);
            }
        }
        if let Some(m) = &chunk.meta_info {
            self.prompt_tokens = m.prompt_tokens.or(self.prompt_tokens);
            self.completion_tokens = m.completion_tokens.or(self.completion_tokens);
            self.cached_tokens = m.cached_tokens.or(self.cached_tokens);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(stream: &[u8], split_every: usize) -> Vec<Vec<u8>> {
        let mut s = SseSplitter::default();
        let mut out = Vec::new();
        for part in stream.chunks(split_every) {
            s.feed(part, |e| out.push(e.to_vec()));
        }
        out
    }

    #[test]
    fn sse_splits_across_any_read_size() {
        let stream = b": comment\r\ndata: {\"a\":1}\r\n\r\nevent: x\ndata: one\ndata: two\n\ndata:[DONE]\n\n";
        for n in [1, 2, 3, 7, 100] {
            let ev = events(stream, n);
            assert_eq!(
                ev,
                vec![
                    b"{\"a\":1}".to_vec(),
                    b"one\ntwo".to_vec(),
                    b"[DONE]".to_vec()
                ],
                "split {n}"
            );
        }
        assert!(events(b"data: partial", 4).is_empty());
    }

    #[test]
    fn chat_stream_with_usage() {
        let mut a = Answer::default();
        let kinds: Vec<EventKind> = [
            &br#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#[..],
            br#"{"choices":[{"index":0,"delta":{"content":"Hello"}}]}"#,
            br#"{"choices":[{"index":0,"delta":{"content":" world"},"finish_reason":null}]}"#,
            br#"{"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}"#,
            br#"{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":2,"total_tokens":12,"prompt_tokens_details":{"cached_tokens":7}}}"#,
            b"[DONE]",
        ]
        .iter()
        .map(|p| a.on_event(p))
        .collect();
        use EventKind::*;
        assert_eq!(kinds, vec![Other, Content, Content, Other, Other, Done]);
        assert_eq!(a.text, "Hello world");
        assert_eq!(
            (a.prompt_tokens, a.completion_tokens, a.cached_tokens),
            (Some(10), Some(2), Some(7))
        );
        assert!(a.done && a.error.is_none());
        assert_eq!(a.content_events, 2);
    }

    #[test]
    fn completions_and_generate_streams() {
        let mut c = Answer::default();
        c.on_event(br#"{"choices":[{"index":0,"text":"ab"}]}"#);
        c.on_event(br#"{"choices":[{"index":0,"text":"cd"}],"usage":null}"#);
        assert_eq!(c.text, "abcd");
        // /generate: cumulative text, meta_info on every chunk.
        let mut g = Answer::default();
        assert_eq!(
            g.on_event(br#"{"text":"The","meta_info":{"prompt_tokens":5,"cached_tokens":0}}"#),
            EventKind::Content
        );
        assert_eq!(g.on_event(br#"{"text":"The cat","meta_info":{"prompt_tokens":5,"completion_tokens":2,"cached_tokens":3}}"#), EventKind::Content);
        assert_eq!(
            g.on_event(br#"{"text":"The cat","meta_info":{"completion_tokens":2}}"#),
            EventKind::Other
        );
        assert_eq!(g.text, "The cat");
        assert_eq!(
            (g.prompt_tokens, g.completion_tokens, g.cached_tokens),
            (Some(5), Some(2), Some(3))
        );
        // Incremental mode appends.
        let mut d = Answer::default();
        d.on_event(br#"{"text":"one"}"#);
        d.on_event(br#"{"text":" two"}"#);
        assert_eq!(d.text, "one two");
    }

    #[test]
    fn whole_bodies_and_errors() {
        let mut a = Answer::default();
        a.on_body(br#"{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":"hi there"}}],"usage":{"prompt_tokens":4,"completion_tokens":2,"prompt_tokens_details":null}}"#);
        assert_eq!(a.text, "hi there");
        assert_eq!((a.prompt_tokens, a.cached_tokens), (Some(4), None));
        let mut g = Answer::default();
        g.on_body(br#"{"text":"ok","output_ids":[1],"meta_info":{"prompt_tokens":9,"completion_tokens":1,"cached_tokens":8}}"#);
        assert_eq!((g.text.as_str(), g.cached_tokens), ("ok", Some(8)));
        let mut e = Answer::default();
        assert_eq!(
            e.on_event(br#"{"error":{"message":"boom"}}"#),
            EventKind::Error
        );
        assert!(e.error.as_deref().unwrap().contains("boom"));
        assert_eq!(Answer::default().on_body(b"not json"), EventKind::Error);
    }
}
