//! Input logprobs in PD mode: the prefill worker computed the prompt, so its answer carries the
//! prompt's `meta_info.input_token_logprobs`; the decode worker's carries only what it saw.
//! For a non-streaming `/generate` that asked for them (`return_logprob`), the client gets the
//! decode answer with prefill's input logprobs put in front of decode's, as the reference does.
//! Pure: answers in, answer out.

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
    let Some(from) = prefill
        .get("meta_info")
        .and_then(|m| m.get(FIELD))
        .and_then(Value::as_array)
    else {
        return;
    };
    let Some(meta) = decode.get_mut("meta_info").and_then(Value::as_object_mut) else {
        return;
    };
    let mut merged = from.clone();
    if let Some(Value::Array(own)) = meta.get_mut(FIELD) {
        merged.append(own);
    }
    meta.insert(FIELD.to_string(), Value::Array(merged));
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
