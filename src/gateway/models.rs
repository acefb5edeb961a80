//! Model names the workers serve, learned from their `/v1/models`. They are the only values the
//! `model` metric label takes, so clients cannot mint series with made-up names.

use arc_swap::ArcSwap;
use std::sync::Arc;

/// Most distinct model names ever used as metric labels.
pub const MAX_KNOWN_MODELS: usize = 256;

/// Served model names. Names are leaked once (at most [`MAX_KNOWN_MODELS`] over the process's
/// life) so the hot path labels with a `&'static str` and allocates nothing.
#[derive(Default)]
pub struct ServedModels {
    names: ArcSwap<Vec<&'static str>>,
}

impl ServedModels {
    /// The `model` label for a request's model: a name some worker serves, else "other"
    /// ("default" when the request named none).
    pub fn label(&self, model: Option<&str>) -> &'static str {
        match model {
            None => "default",
            Some(m) => self
                .names
                .load()
                .iter()
                .copied()
                .find(|k| *k == m)
                .unwrap_or("other"),
        }
    }

    /// Learn model names from a worker's `/v1/models` body (health thread).
    pub fn learn(&self, body: &[u8]) {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) else {
            return;
        };
        let ids: Vec<&str> = v
            .get("data")
            .and_then(|d| d.as_array())
            .map(|a| a.iter().filter_map(|c| c.get("id")?.as_str()).collect())
            .unwrap_or_default();
        let cur = self.names.load();
        if ids.iter().all(|id| cur.contains(id)) {
            return;
        }
        let mut next: Vec<&'static str> = cur.as_ref().clone();
        for id in ids {
            if !next.contains(&id) && next.len() < MAX_KNOWN_MODELS {
                // Bounded by MAX_KNOWN_MODELS over the process lifetime: leaking is the point.
                next.push(Box::leak(id.to_string().into_boxed_str()));
            }
        }
        self.names.store(Arc::new(next));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_served_names_become_labels() {
        let m = ServedModels::default();
        assert_eq!(m.label(Some("llama")), "other");
        m.learn(br#"{"data":[{"id":"llama"},{"id":"qwen"}]}"#);
        assert_eq!(m.label(Some("llama")), "llama");
        assert_eq!(m.label(Some("qwen")), "qwen");
        assert_eq!(m.label(Some("made-up")), "other");
        assert_eq!(m.label(None), "default");
        m.learn(b"not json");
        assert_eq!(m.label(Some("llama")), "llama");
    }
}
