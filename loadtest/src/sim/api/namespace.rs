//! A request's cache namespace, as SGLang derives it: `extra_key`, `cache_salt` and the LoRA
//! adapter (`lora_path`, or on the OpenAI-style endpoints a `model` of the form
//! `base:adapter`, which takes precedence). Each may be one value for every prompt of a batch or
//! a list with one per prompt. The simulator serves any adapter name (as if every adapter were
//! loaded); it only keeps their caches apart.

use serde_json::Value;

use super::{ApiError, Endpoint};
use crate::sim::radix::Namespace;

/// The namespace fields of a request body, kept unresolved until the served model name is at
/// hand.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NsFields {
    extra_key: Option<Value>,
    cache_salt: Option<Value>,
    lora_path: Option<Value>,
}

impl NsFields {
    /// The fields of body `v` (absent and null alike are `None`).
    pub(super) fn read(v: &Value) -> Self {
        let get = |k: &str| v.get(k).filter(|x| !x.is_null()).cloned();
        NsFields {
            extra_key: get("extra_key"),
            cache_salt: get("cache_salt"),
            lora_path: get("lora_path"),
        }
    }
}

impl NsFields {
    /// `cache_salt` when it is one string (vLLM's field is a string).
    pub(super) fn cache_salt(&self) -> Option<&str> {
        self.cache_salt.as_ref().and_then(Value::as_str)
    }
}

/// One namespace per prompt (`n` of them) for a request on `endpoint` whose `model` field was
/// `model`, served as `served`.
pub(super) fn resolve(
    endpoint: Endpoint,
    f: &NsFields,
    model: Option<&str>,
    served: &str,
    n: usize,
) -> Result<Vec<Namespace>, ApiError> {
    let extra = per_prompt("extra_key", f.extra_key.as_ref(), n)?;
    let salt = per_prompt("cache_salt", f.cache_salt.as_ref(), n)?;
    let from_model = match endpoint {
        Endpoint::Generate => None,
        _ => model.and_then(|m| adapter_in_model(m, served)),
    };
    let lora = match from_model {
        Some(a) => vec![Some(a.to_owned()); n],
        None => per_prompt("lora_path", f.lora_path.as_ref(), n)?,
    };
    Ok((0..n)
        .map(|i| Namespace::new(extra[i].as_deref(), lora[i].as_deref(), salt[i].as_deref()))
        .collect())
}

/// The adapter a `model` names (SGLang's `_parse_model_parameter`): none for the served name
/// itself; after the served name and a colon when it starts so (served names may contain
/// colons); else after the first colon.
fn adapter_in_model<'m>(model: &'m str, served: &str) -> Option<&'m str> {
    if !model.contains(':') || model == served {
        return None;
    }
    let adapter = match model.strip_prefix(served).and_then(|r| r.strip_prefix(':')) {
        Some(rest) => rest,
        None => model.split_once(':').map_or("", |(_, a)| a),
    };
    Some(adapter.trim()).filter(|a| !a.is_empty())
}

/// A field that is one string for all `n` prompts or a list of `n` strings (or nulls).
fn per_prompt(name: &str, v: Option<&Value>, n: usize) -> Result<Vec<Option<String>>, ApiError> {
    let one = |x: &Value| match x {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        _ => Err(ApiError::new(format!(
            "{name} must be a string or a list of strings"
        ))),
    };
    match v {
        None => Ok(vec![None; n]),
        Some(Value::Array(items)) if items.len() == n => items.iter().map(one).collect(),
        Some(Value::Array(items)) => Err(ApiError::new(format!(
            "{name} has {} entries for {n} prompt(s)",
            items.len()
        ))),
        Some(x) => Ok(vec![one(x)?; n]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const SERVED: &str = "meta-llama/Llama-3.1-8B-Instruct";

    fn ns(v: Value, ep: Endpoint, n: usize) -> Result<Vec<Namespace>, ApiError> {
        let model = v.get("model").and_then(Value::as_str);
        resolve(ep, &NsFields::read(&v), model, SERVED, n)
    }

    #[test]
    fn fields_make_namespaces_and_the_model_names_an_adapter() {
        let d = Namespace::default();
        assert_eq!(ns(json!({}), Endpoint::Chat, 1).unwrap(), vec![d.clone()]);
        assert_eq!(
            ns(json!({"model": SERVED}), Endpoint::Chat, 1).unwrap(),
            vec![d.clone()]
        );
        let salted = Namespace::new(None, None, Some("s"));
        assert_eq!(
            ns(json!({"cache_salt": "s"}), Endpoint::Generate, 2).unwrap(),
            vec![salted.clone(), salted]
        );
        let a = Namespace::new(None, Some("a"), None);
        for body in [
            json!({"lora_path": "a"}),
            json!({"model": format!("{SERVED}:a")}),
            json!({"model": "other:a", "lora_path": "b"}),
        ] {
            assert_eq!(
                ns(body.clone(), Endpoint::Chat, 1).unwrap(),
                vec![a.clone()],
                "{body}"
            );
        }
        // /generate has no model field to read an adapter from.
        assert_eq!(
            ns(
                json!({"model": format!("{SERVED}:a")}),
                Endpoint::Generate,
                1
            )
            .unwrap(),
            vec![d.clone()]
        );
        let per = ns(
            json!({"extra_key": ["x", ""], "lora_path": [null, "a"]}),
            Endpoint::Generate,
            2,
        )
        .unwrap();
        assert_eq!(per, vec![Namespace::new(Some("x"), None, None), a]);
        assert!(ns(json!({"cache_salt": ["a"]}), Endpoint::Generate, 2).is_err());
        assert!(ns(json!({"extra_key": 3}), Endpoint::Generate, 1).is_err());
    }
}
