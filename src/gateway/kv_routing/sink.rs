//! The index's single writer on the event thread, and what it republishes for the cores.

use super::*;
use crate::base::WorkerId;
use crate::kv::index::{DropReason, IndexExport, IndexWriter, Source};
use crate::kv::intake::{EventSink, IntakeEvent, ResetReason, SourceState};
use arc_swap::ArcSwap;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// The index's single writer, on the event thread: applies batches and resets, keeps each
/// publisher's state, and publishes once per round of the thread.
pub(super) struct IndexSink {
    pub(super) writer: IndexWriter,
    pub(super) models: Arc<ArcSwap<ModelMap>>,
    pub(super) states: BTreeMap<Source, SourceState>,
    pub(super) published_exact: Arc<ArcSwap<Vec<WorkerId>>>,
    pub(super) published_states: Arc<ArcSwap<Vec<(Source, SourceState)>>>,
    pub(super) dirty: bool,
    pub(super) states_dirty: bool,
    /// The export under way (`GET /kv_index/snapshot`), a source at a time.
    pub(super) export: Option<IndexExport>,
    /// Publishers whose stores the index refused for its limits (sources, models, ranks):
    /// their workers are scored by the text tree, said once in the log, and counted in
    /// `/readiness` (at most one entry per subscribed publisher; gone when one is stored again
    /// or the publisher is unsubscribed).
    pub(super) refused: BTreeSet<Source>,
    pub(super) published_refused: Arc<ArcSwap<Vec<Source>>>,
}

impl EventSink for IndexSink {
    fn deliver(&mut self, event: IntakeEvent) {
        match event {
            IntakeEvent::Batch(b) => {
                let models = self.models.load();
                let Some(wk) = models.get(&b.key.worker) else {
                    return; // Unsubscribed meanwhile.
                };
                let model = &wk.model;
                if let Some(bs) = wk.block_size {
                    // The server's own page size: a store of another size is not believed.
                    self.writer.announce_block_size(b.key, bs as usize);
                }
                for e in &b.events {
                    // Drops are counted by the writer (radixgate_kv_index_dropped_total).
                    let applied = self.writer.apply(model, b.key, e);
                    let is_store = matches!(e, crate::kv::wire::KvEvent::BlockStored(_));
                    match applied {
                        Err(DropReason::Limits) if self.refused.insert(b.key) => {
                            crate::log!(
                                Warn,
                                "kv events: worker {} rank {}: past the index's limits \
                                 ({} sources, {} models, {} ranks a worker); scored by the text \
                                 tree",
                                wk.url,
                                b.key.dp_rank,
                                self.writer.config().max_sources,
                                self.writer.config().max_models,
                                self.writer.config().max_dp_ranks
                            );
                            self.states_dirty = true;
                        }
                        Ok(()) if is_store && self.refused.remove(&b.key) => {
                            crate::log!(
                                Info,
                                "kv events: worker {} rank {}: indexed again",
                                wk.url,
                                b.key.dp_rank
                            );
                            self.states_dirty = true;
                        }
                        _ => {}
                    }
                }
                self.dirty = true;
            }
            IntakeEvent::State { key, state } => {
                self.states_dirty |= self.states.insert(key, state) != Some(state);
            }
            IntakeEvent::Reset { key, reason } => {
                match reason {
                    ResetReason::Unsubscribed => {
                        self.writer.remove_source(key);
                        self.states_dirty |= self.states.remove(&key).is_some();
                        self.states_dirty |= self.refused.remove(&key);
                    }
                    // The index now holds less than the server (or exactly a new process's
                    // empty cache); the stream goes on from here.
                    ResetReason::Restarted | ResetReason::Gap | ResetReason::Unreadable => {
                        self.writer.reset_source(key)
                    }
                }
                self.dirty = true;
            }
        }
    }

    fn export_begin(&mut self) -> Option<Vec<Source>> {
        self.export = Some(IndexExport::default());
        Some(self.writer.export_sources())
    }

    fn export_source(&mut self, key: Source, watermark: Option<i64>) {
        let models = self.models.load();
        // Only workers this copy names by URL (a worker being removed has none any more).
        let (Some(out), Some(wk)) = (self.export.as_mut(), models.get(&key.worker)) else {
            return;
        };
        self.writer
            .export_source(key, wk.url.to_string(), watermark, out);
    }

    fn export_finish(&mut self, reply: crate::kv::intake::ExportReply) {
        let Some(copy) = self.export.take() else {
            let _ = reply.try_send(None);
            return;
        };
        // Encoding costs ~15× taking the copy: off the event thread.
        let spawned = std::thread::Builder::new()
            .name("radixgate-kv-export".into())
            .spawn({
                let reply = reply.clone();
                move || {
                    let _ = reply.try_send(Some(copy.encode()));
                }
            });
        if spawned.is_err() {
            let _ = reply.try_send(None);
        }
    }

    fn import(
        &mut self,
        data: &[u8],
        workers: &[(String, WorkerId)],
    ) -> Result<Vec<(Source, i64)>, String> {
        let summary = self
            .writer
            .import(data, |url| {
                workers.iter().find(|(u, _)| u == url).map(|&(_, id)| id)
            })
            .map_err(|e| e.to_string())?;
        self.dirty = true;
        if summary.unknown > 0 || summary.refused > 0 {
            crate::log!(
                Info,
                "kv events: index copy: {} publishers of unknown workers skipped, {} refused",
                summary.unknown,
                summary.refused
            );
        }
        Ok(summary
            .sources
            .iter()
            .filter_map(|s| Some((s.source, s.watermark?)))
            .collect())
    }

    fn flush(&mut self) {
        if self.dirty {
            self.writer.publish();
            self.dirty = false;
        }
        if self.states_dirty {
            let mut exact = exact_workers(&self.states);
            let refused: BTreeSet<WorkerId> = self.refused.iter().map(|s| s.worker).collect();
            exact.retain(|w| !refused.contains(w));
            self.published_exact.store(Arc::new(exact));
            self.published_refused
                .store(Arc::new(self.refused.iter().copied().collect()));
            self.published_states.store(Arc::new(
                self.states.iter().map(|(k, v)| (*k, *v)).collect(),
            ));
            self.states_dirty = false;
        }
    }
}

/// Workers every one of whose publishers is live, sorted (`states` is sorted by worker).
pub(super) fn exact_workers(states: &BTreeMap<Source, SourceState>) -> Vec<WorkerId> {
    let mut out: Vec<WorkerId> = Vec::new();
    let mut spoilt: Option<WorkerId> = None;
    for (source, state) in states {
        let w = source.worker;
        if *state != SourceState::Live {
            spoilt = Some(w);
            if out.last() == Some(&w) {
                out.pop();
            }
        } else if spoilt != Some(w) && out.last() != Some(&w) {
            out.push(w);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::index::{EngineHash, IndexConfig};
    use crate::kv::intake::WorkerEvents;
    use crate::kv::wire::{BlockStored, KvEvent};

    fn store(hash: u64) -> KvEvent {
        KvEvent::BlockStored(BlockStored {
            block_hashes: vec![EngineHash(hash)],
            parent: None,
            token_ids: vec![1, 2, 3, 4],
            block_size: 4,
            lora_id: None,
            medium: None,
            cache_salt: None,
            lora_name: None,
        })
    }

    fn batch(worker: WorkerId, events: Vec<KvEvent>) -> IntakeEvent {
        IntakeEvent::Batch(WorkerEvents {
            key: Source { worker, dp_rank: 0 },
            seq: 0,
            ts: None,
            events,
            replayed: false,
        })
    }

    #[test]
    fn a_publisher_past_the_index_limits_is_said_and_its_worker_scored_by_the_text_tree() {
        let published_exact = Arc::new(ArcSwap::from_pointee(Vec::new()));
        let published_refused = Arc::new(ArcSwap::from_pointee(Vec::new()));
        let models: Arc<ArcSwap<ModelMap>> = Arc::default();
        let kv = |url: &str| WorkerKv {
            model: Arc::from("m"),
            url: Arc::from(url),
            block_size: None,
        };
        models.store(Arc::new(
            [
                (1, kv("http://a:1")),
                (2, kv("http://b:1")),
                (3, kv("http://c:1")),
            ]
            .into_iter()
            .collect(),
        ));
        let mut sink = IndexSink {
            writer: IndexWriter::new(IndexConfig {
                max_sources: 2,
                ..IndexConfig::default()
            }),
            models,
            states: BTreeMap::new(),
            published_exact: published_exact.clone(),
            published_states: Arc::new(ArcSwap::from_pointee(Vec::new())),
            dirty: false,
            states_dirty: false,
            export: None,
            refused: BTreeSet::new(),
            published_refused: published_refused.clone(),
        };
        for w in 1..=3 {
            let key = Source {
                worker: w,
                dp_rank: 0,
            };
            sink.deliver(IntakeEvent::State {
                key,
                state: SourceState::Live,
            });
            sink.deliver(batch(w, vec![store(10 + u64::from(w))]));
        }
        sink.flush();
        // Worker 3 is past the 2 sources the index takes: not exact, and said.
        assert_eq!(**published_exact.load(), vec![1, 2]);
        assert_eq!(
            **published_refused.load(),
            vec![Source {
                worker: 3,
                dp_rank: 0
            }]
        );
        // Worker 1 goes; worker 3's next store is taken, and it is exact again.
        sink.deliver(IntakeEvent::Reset {
            key: Source {
                worker: 1,
                dp_rank: 0,
            },
            reason: ResetReason::Unsubscribed,
        });
        sink.deliver(batch(3, vec![store(99)]));
        sink.flush();
        assert!(published_refused.load().is_empty());
        assert_eq!(**published_exact.load(), vec![2, 3]);
    }
}
