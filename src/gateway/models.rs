//! Model names the workers serve, learned from their `/v1/models`. They are the only values the
//! `model` metric label takes and the only names that get a prefix tree of their own, so clients
//! cannot mint series or trees with made-up names.
//!
//! A card with a `parent` other than its own id is a LoRA adapter of that base model (vLLM
//! lists each loaded adapter so; clients then name the adapter alone in `model`). The
//! adapter → base pairs are kept per worker and published merged, so the KV-event routing can
//! read a request for `sql-lora` as the base model's blocks in the adapter's namespace.

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
    /// Adapter → base model pairs some current worker serves, sorted by adapter (one base per
    /// adapter: the first in that order when workers disagree, a misconfiguration).
    adapters: ArcSwap<Vec<(&'static str, &'static str)>>,
    /// What each worker said it serves (health thread and admin paths only).
    by_worker: Mutex<HashMap<WorkerId, Served>>,
}

/// One worker's `/v1/models`, as interned names (bounded by [`MAX_KNOWN_MODELS`] in all: a
/// card whose name or parent cannot be interned is not kept).
#[derive(Default, Debug, Clone, PartialEq, Eq)]
struct Served {
    /// Every card's id, in the order served (base models first on vLLM).
    names: Vec<&'static str>,
    /// Adapter → base, for the cards with a `parent` other than their id.
    adapters: Vec<(&'static str, &'static str)>,
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
        let cards: Vec<(&str, Option<&str>)> = v
            .get("data")
            .and_then(|d| d.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|c| {
                        let id = c.get("id")?.as_str()?;
                        let parent = c.get("parent").and_then(|p| p.as_str());
                        Some((id, parent.filter(|p| !p.is_empty() && *p != id)))
                    })
                    .collect()
            })
            .unwrap_or_default();
        // Interning (load, extend, store the name list) happens under the same lock, so two
        // callers can never lose each other's names or leak a name twice.
        let mut by_worker = self.by_worker.lock().unwrap_or_else(|p| p.into_inner());
        let mut served = Served::default();
        for (id, parent) in cards {
            let Some(name) = self.intern(id) else {
                continue;
            };
            // A name is kept once per worker (a card repeated does not grow the lists past the
            // interned names, at most MAX_KNOWN_MODELS).
            if served.names.contains(&name) {
                continue;
            }
            served.names.push(name);
            if let Some(base) = parent.and_then(|p| self.intern(p)) {
                served.adapters.push((name, base));
            }
        }
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

    fn recompute(&self, by_worker: &HashMap<WorkerId, Served>) -> bool {
        let mut adapters: Vec<(&'static str, &'static str)> = by_worker
            .values()
            .flat_map(|s| s.adapters.iter().copied())
            .collect();
        adapters.sort_unstable();
        adapters.dedup_by_key(|(a, _)| *a);
        if **self.adapters.load() != adapters {
            self.adapters.store(Arc::new(adapters));
        }
        let mut all: Vec<&'static str> = by_worker
            .values()
            .flat_map(|s| s.names.iter().copied())
            .collect();
        all.sort_unstable();
        all.dedup();
        if **self.current.load() == all {
            return false;
        }
        self.current.store(Arc::new(all));
        true
    }

    /// The base model of `model` when a current worker lists it as a LoRA adapter (a card with
    /// a `parent`): vLLM's clients name an adapter by its own name. A binary search of the
    /// published pairs; no allocation.
    pub fn adapter_base(&self, model: &str) -> Option<&'static str> {
        let adapters = self.adapters.load();
        adapters
            .binary_search_by(|(a, _)| (*a).cmp(model))
            .ok()
            .map(|i| adapters[i].1)
    }
}

impl ServedModels {
    /// The first model `worker` said it serves that is not an adapter, if it answered
    /// `/v1/models` yet: the model its KV events are filed under (an adapter's blocks are the
    /// base model's, in the adapter's namespace).
    pub fn first_of(&self, worker: WorkerId) -> Option<&'static str> {
        let by_worker = self.by_worker.lock().unwrap_or_else(|p| p.into_inner());
        let served = by_worker.get(&worker)?;
        served
            .names
            .iter()
            .copied()
            .find(|n| !served.adapters.iter().any(|(a, _)| a == n))
            .or_else(|| served.names.first().copied())
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
    fn adapters_are_learned_with_their_base_per_worker() {
        let m = ServedModels::default();
        let vllm = br#"{"object":"list","data":[
            {"id":"llama","root":"/models/llama","parent":null},
            {"id":"sql-lora","root":"/adapters/sql","parent":"llama"},
            {"id":"self","parent":"self"},
            {"id":"empty","parent":""}]}"#;
        m.learn(0, vllm);
        assert_eq!(m.adapter_base("sql-lora"), Some("llama"));
        assert_eq!(m.adapter_base("llama"), None);
        assert_eq!(m.adapter_base("self"), None);
        assert_eq!(m.adapter_base("empty"), None);
        assert_eq!(m.adapter_base("made-up"), None);
        // The adapter is a served name too (its own label and text tree).
        assert_eq!(m.tree_key(Some("sql-lora")), TreeKey::Served("sql-lora"));
        // Events are filed under the base model even when an adapter's card comes first.
        m.learn(
            1,
            br#"{"data":[{"id":"sql-lora","parent":"llama"},{"id":"llama"}]}"#,
        );
        assert_eq!(m.first_of(1), Some("llama"));
        assert_eq!(m.first_of(0), Some("llama"));
        // Worker 0 unloads it, worker 1 still serves it; then worker 1 goes.
        m.learn(0, br#"{"data":[{"id":"llama"}]}"#);
        assert_eq!(m.adapter_base("sql-lora"), Some("llama"));
        m.forget(1);
        assert_eq!(m.adapter_base("sql-lora"), None);
        // Repeated cards are kept once.
        let many = format!(
            r#"{{"data":[{}]}}"#,
            vec![r#"{"id":"sql-lora","parent":"llama"}"#; 1000].join(",")
        );
        m.learn(3, many.as_bytes());
        assert_eq!(m.adapter_base("sql-lora"), Some("llama"));
        assert_eq!(m.by_worker.lock().unwrap()[&3].names.len(), 1);
        assert_eq!(m.by_worker.lock().unwrap()[&3].adapters.len(), 1);
        // SGLang's cards (no parent) name no adapter.
        m.learn(
            2,
            br#"{"data":[{"id":"qwen","root":"qwen","parent":null}]}"#,
        );
        assert_eq!(m.adapter_base("qwen"), None);
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
