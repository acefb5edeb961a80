//! Input logprobs in PD mode: the prefill worker computed the prompt, so its answer carries the
//! prompt's `meta_info.input_token_logprobs`; the decode worker's carries only what it saw.
//! For a `/generate` that asked for them (`return_logprob`), the client gets the decode answer
//! with prefill's input logprobs put in front of decode's, as the reference does: the whole
//! answer when it is not streamed, each event's `meta_info` when it is. Pure: answers in,
//! answer out.

use bytes::BytesMut;
use serde_json::Value;

/// The field merged, inside each answer's `meta_info`.
const FIELD: &str = "input_token_logprobs";

/// Put `prefill`'s input logprobs in front of `decode`'s, item by item (a batched request's
/// answer is a list). Returns the merged answer, or `None` when either answer is not JSON of
/// the expected shape (the decode answer then goes out unchanged).
pub fn merge_input_logprobs(prefill: &[u8], decode: &[u8]) -> Option<Value> {
    let p: Value = serde_json::from_slice(prefill).ok()?;
    let mut d: Value = serde_json::from_slice(decode).ok()?;
    match (&p, &mut d) {
        (Value::Array(ps), Value::Array(ds)) if ps.len() == ds.len() => {
            for (pi, di) in ps.iter().zip(ds.iter_mut()) {
                merge_one(pi, di);
            }
        }
        (Value::Object(_), Value::Object(_)) => merge_one(&p, &mut d),
        _ => return None,
    }
    Some(d)
}

fn merge_one(prefill: &Value, decode: &mut Value) {
    if let Some(from) = prefill
        .get("meta_info")
        .and_then(|m| m.get(FIELD))
        .and_then(Value::as_array)
    {
        prepend(from, decode);
    }
}

/// Put `from` in front of `decode`'s own `meta_info.input_token_logprobs` (nothing when it has
/// no `meta_info` object).
fn prepend(from: &[Value], decode: &mut Value) {
    let Some(meta) = decode.get_mut("meta_info").and_then(Value::as_object_mut) else {
        return;
    };
    let mut merged = from.to_vec();
    if let Some(Value::Array(own)) = meta.get_mut(FIELD) {
        merged.append(own);
    }
    meta.insert(FIELD.to_string(), Value::Array(merged));
}

/// The `data:` payload of one server-sent event (its bytes through the blank line that ends
/// it), when it is a JSON value.
fn event_json(event: &[u8]) -> Option<Value> {
    let text = std::str::from_utf8(event).ok()?;
    let data: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.strip_prefix(' ').unwrap_or(d))
        .collect::<Vec<_>>()
        .join("\n");
    serde_json::from_str(&data).ok()
}

/// The input logprobs a streamed prefill answer reported, per item (`index`; 0 without one):
/// the last event of each item that carries `meta_info.input_token_logprobs` (SGLang repeats
/// the whole list in an item's events). A non-streamed answer (JSON, one object or a batch's
/// list) works too.
pub fn prefill_input_logprobs(prefill: &[u8]) -> Vec<Vec<Value>> {
    let mut lists: Vec<Vec<Value>> = Vec::new();
    let mut keep = |item: &Value, default_index: usize| {
        let Some(list) = item
            .get("meta_info")
            .and_then(|m| m.get(FIELD))
            .and_then(Value::as_array)
        else {
            return;
        };
        let i = item
            .get("index")
            .and_then(Value::as_u64)
            .map_or(default_index, |i| i as usize);
        if i >= MAX_ITEMS {
            return;
        }
        if lists.len() <= i {
            lists.resize(i + 1, Vec::new());
        }
        lists[i] = list.clone();
    };
    match serde_json::from_slice::<Value>(prefill) {
        Ok(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                keep(item, i);
            }
        }
        Ok(one) => keep(&one, 0),
        Err(_) => {
            for event in prefill
                .split(|&b| b == b'\n')
                .collect::<Vec<_>>()
                .split(|l| l.is_empty())
            {
                let joined: Vec<u8> = event.join(&b'\n');
                if let Some(v) = event_json(&joined) {
                    keep(&v, 0);
                }
            }
        }
    }
    lists
}

/// Items of a batch whose input logprobs are merged (a bound on what a worker's answer can make
/// the gateway allocate).
const MAX_ITEMS: usize = 4096;

/// One decode event with prefill's input logprobs (`lists`, by item) put in front of its own, or
/// the event unchanged when it carries no JSON object with `meta_info` (`[DONE]`, comments).
pub fn merge_event(lists: &[Vec<Value>], event: &[u8], out: &mut BytesMut) {
    let merged = event_json(event).and_then(|mut v| {
        v.get("meta_info")?.as_object()?;
        let i = v.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
        prepend(lists.get(i)?, &mut v);
        serde_json::to_string(&v).ok()
    });
    match merged {
        Some(json) => {
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(json.as_bytes());
            out.extend_from_slice(b"\n\n");
        }
        None => out.extend_from_slice(event),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prefill_logprobs_go_in_front_of_decode_ones() {
        let p =
            json!({"text":"x","meta_info":{"input_token_logprobs":[[-1.0,1,null],[-2.0,2,null]]}});
        let d =
            json!({"text":"hello","meta_info":{"input_token_logprobs":[[-3.0,3,null]],"id":"r"}});
        let m = merge_input_logprobs(p.to_string().as_bytes(), d.to_string().as_bytes()).unwrap();
        assert_eq!(
            m["meta_info"]["input_token_logprobs"],
            json!([[-1.0, 1, null], [-2.0, 2, null], [-3.0, 3, null]])
        );
        assert_eq!(m["text"], "hello");
        assert_eq!(m["meta_info"]["id"], "r");
    }

    #[test]
    fn stream_events_get_the_prefill_logprobs_of_their_item() {
        let prefill = b"data: {\"text\":\"\",\"meta_info\":{\"input_token_logprobs\":[[-1.0,1,null]]}}\n\n\
            data: {\"text\":\"x\",\"meta_info\":{\"input_token_logprobs\":[[-1.0,1,null],[-2.0,2,null]]}}\n\n\
            data: [DONE]\n\n";
        let lists = prefill_input_logprobs(prefill);
        assert_eq!(
            lists,
            vec![vec![json!([-1.0, 1, null]), json!([-2.0, 2, null])]]
        );
        let mut out = BytesMut::new();
        merge_event(
            &lists,
            b"data: {\"text\":\"he\",\"meta_info\":{\"input_token_logprobs\":[],\"id\":\"r\"}}\n\n",
            &mut out,
        );
        let text = std::str::from_utf8(&out).unwrap();
        assert!(
            text.starts_with("data: ") && text.ends_with("\n\n"),
            "{text}"
        );
        let v: Value = serde_json::from_str(&text[6..]).unwrap();
        assert_eq!(
            v["meta_info"]["input_token_logprobs"],
            json!([[-1.0, 1, null], [-2.0, 2, null]])
        );
        assert_eq!(
            (v["text"].as_str(), v["meta_info"]["id"].as_str()),
            (Some("he"), Some("r"))
        );
        // The end of the stream, comments and odd events go out as they came.
        for e in [
            &b"data: [DONE]\n\n"[..],
            b": keep-alive\n\n",
            b"data: {\"x\":1}\n\n",
        ] {
            let mut out = BytesMut::new();
            merge_event(&lists, e, &mut out);
            assert_eq!(&out[..], e);
        }
        // A non-streamed prefill answer gives the same lists.
        let json = br#"{"meta_info":{"input_token_logprobs":[[-1.0,1,null],[-2.0,2,null]]}}"#;
        assert_eq!(prefill_input_logprobs(json), lists);
        assert!(prefill_input_logprobs(b"garbage").is_empty());
    }

    #[test]
    fn batches_merge_item_by_item_and_odd_shapes_are_left_alone() {
        let p = json!([{"meta_info":{"input_token_logprobs":[1]}},{"meta_info":{}}]);
        let d = json!([{"meta_info":{}},{"meta_info":{"input_token_logprobs":[2]}}]);
        let m = merge_input_logprobs(p.to_string().as_bytes(), d.to_string().as_bytes()).unwrap();
        assert_eq!(m[0]["meta_info"]["input_token_logprobs"], json!([1]));
        assert_eq!(m[1]["meta_info"]["input_token_logprobs"], json!([2]));
        assert!(merge_input_logprobs(b"[1]", b"{}").is_none());
        assert!(merge_input_logprobs(b"not json", b"{}").is_none());
    }
}
