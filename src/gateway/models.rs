//! Model names the workers serve, learned from their `/v1/models`. They are the only values the
//! `model` metric label takes and the only names that get a prefix tree of their own, so clients
//! cannot mint series or trees with made-up names.

use super::Gateway;
use crate::base::WorkerId;
use crate::tree::TreeKey;
use arc_swap::ArcSwap;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Most distinct model names ever used as metric labels or tree keys. Names past it are
/// labelled "other" and share the shared tree.
pub const MAX_KNOWN_MODELS: usize = 256;

/// Served model names. Names are leaked once (at most [`MAX_KNOWN_MODELS`] over the process's
/// life) so the hot path labels with a `&'static str`, picks a tree by it, and allocates nothing.
#[derive(Default)]
pub struct ServedModels {
    /// Every name ever learned (metric labels: a series, once created, keeps its label).
    names: ArcSwap<Vec<&'static str>>,
    /// Names some current worker serves, sorted: the models with a tree of their own.
    current: ArcSwap<Vec<&'static str>>,
    /// What each worker said it serves (health thread and admin paths only).
    by_worker: Mutex<HashMap<WorkerId, Vec<&'static str>>>,
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

    /// The tree a request's model reads and feeds: its own when a current worker serves it,
    /// else the one shared tree.
    pub fn tree_key(&self, model: Option<&str>) -> TreeKey {
        let Some(m) = model else {
            return TreeKey::Default;
        };
        let cur = self.current.load();
        match cur.binary_search(&m) {
            Ok(i) => TreeKey::Served(cur[i]),
            Err(_) => TreeKey::Shared,
        }
    }

    /// The names current workers serve, sorted.
    pub fn current(&self) -> Vec<&'static str> {
        self.current.load().as_ref().clone()
    }

    /// Learn what `worker` serves from its `/v1/models` body (health thread). Returns whether
    /// the set of served names changed.
    pub fn learn(&self, worker: WorkerId, body: &[u8]) -> bool {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) else {
            return false;
        };
        let ids: Vec<&str> = v
            .get("data")
            .and_then(|d| d.as_array())
            .map(|a| a.iter().filter_map(|c| c.get("id")?.as_str()).collect())
            .unwrap_or_default();
        // Interning (load, extend, store the name list) happens under the same lock, so two
        // callers can never lose each other's names or leak a name twice.
        let mut by_worker = self.by_worker.lock().unwrap_or_else(|p| p.into_inner());
        let served: Vec<&'static str> = ids.into_iter().filter_map(|id| self.intern(id)).collect();
        by_worker.insert(worker, served);
        self.recompute(&by_worker)
    }

    /// `worker` is gone: its names stop being served unless another worker serves them.
    /// Returns whether the set of served names changed.
    pub fn forget(&self, worker: WorkerId) -> bool {
        let mut by_worker = self.by_worker.lock().unwrap_or_else(|p| p.into_inner());
        by_worker.remove(&worker).is_some() && self.recompute(&by_worker)
    }

    /// The leaked label for `id`, leaking it on first sight while fewer than
    /// [`MAX_KNOWN_MODELS`] names are known.
    fn intern(&self, id: &str) -> Option<&'static str> {
        let cur = self.names.load();
        if let Some(k) = cur.iter().copied().find(|k| *k == id) {
            return Some(k);
        }
        if cur.len() >= MAX_KNOWN_MODELS {
            return None;
        }
        let mut next: Vec<&'static str> = cur.as_ref().clone();
        // Bounded by MAX_KNOWN_MODELS over the process lifetime: leaking is the point.
        let name: &'static str = Box::leak(id.to_string().into_boxed_str());
        next.push(name);
        self.names.store(Arc::new(next));
        Some(name)
    }

    fn recompute(&self, by_worker: &HashMap<WorkerId, Vec<&'static str>>) -> bool {
        let mut all: Vec<&'static str> = by_worker.values().flatten().copied().collect();
        all.sort_unstable();
        all.dedup();
        if **self.current.load() == all {
            return false;
        }
        self.current.store(Arc::new(all));
        true
    }
}

impl ServedModels {
    /// The first model `worker` said it serves, if it answered `/v1/models` yet.
    pub fn first_of(&self, worker: WorkerId) -> Option<&'static str> {
        let by_worker = self.by_worker.lock().unwrap_or_else(|p| p.into_inner());
        by_worker.get(&worker)?.first().copied()
    }
}

impl Gateway {
    /// The model `worker` serves (its first `/v1/models` entry), once known.
    pub fn models_of(&self, worker: WorkerId) -> Option<String> {
        self.models.first_of(worker).map(str::to_owned)
    }

    /// A worker's `/v1/models` answer: label its models, and give each served model its own
    /// tree (health thread).
    pub fn learn_models(&self, worker: WorkerId, body: &[u8]) {
        if self.models.learn(worker, body) {
            for (r, _) in self.routers() {
                r.serve_models(self.models.current());
            }
        }
    }

    /// A removed worker's models stop being served (their trees are dropped) unless another
    /// worker serves them.
    pub fn forget_models(&self, worker: WorkerId) {
        if self.models.forget(worker) {
            for (r, _) in self.routers() {
                r.serve_models(self.models.current());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_served_names_become_labels() {
        let m = ServedModels::default();
        assert_eq!(m.label(Some("llama")), "other");
        assert!(m.learn(0, br#"{"data":[{"id":"llama"},{"id":"qwen"}]}"#));
        assert_eq!(m.label(Some("llama")), "llama");
        assert_eq!(m.label(Some("qwen")), "qwen");
        assert_eq!(m.label(Some("made-up")), "other");
        assert_eq!(m.label(None), "default");
        assert!(!m.learn(1, b"not json"));
        assert_eq!(m.label(Some("llama")), "llama");
    }

    #[test]
    fn only_current_models_get_a_tree() {
        let m = ServedModels::default();
        assert_eq!(m.tree_key(None), TreeKey::Default);
        assert_eq!(m.tree_key(Some("llama")), TreeKey::Shared);
        m.learn(0, br#"{"data":[{"id":"llama"}]}"#);
        assert!(m.learn(1, br#"{"data":[{"id":"qwen"},{"id":"llama"}]}"#));
        assert_eq!(m.tree_key(Some("llama")), TreeKey::Served("llama"));
        assert_eq!(m.tree_key(Some("made-up")), TreeKey::Shared);
        assert_eq!(m.current(), ["llama", "qwen"]);
        // Worker 1 leaves: qwen is no longer served (its label stays: series keep labels).
        assert!(m.forget(1));
        assert_eq!(m.tree_key(Some("qwen")), TreeKey::Shared);
        assert_eq!(m.label(Some("qwen")), "qwen");
        assert!(!m.forget(1));
        assert_eq!(m.current(), ["llama"]);
    }

    #[test]
    fn names_past_the_limit_share() {
        let m = ServedModels::default();
        for i in 0..MAX_KNOWN_MODELS + 10 {
            m.learn(
                i as WorkerId,
                format!(r#"{{"data":[{{"id":"m{i}"}}]}}"#).as_bytes(),
            );
        }
        assert_eq!(m.current().len(), MAX_KNOWN_MODELS);
        assert_eq!(m.tree_key(Some("m0")), TreeKey::Served("m0"));
        assert_eq!(
            m.tree_key(Some(&format!("m{MAX_KNOWN_MODELS}"))),
            TreeKey::Shared
        );
    }
}
