//! The index's single writer on the event thread, and what it republishes for the cores.

use super::*;
use crate::base::WorkerId;
use crate::kv::index::{IndexExport, IndexWriter, Source};
use crate::kv::intake::{EventSink, IntakeEvent, ResetReason, SourceState};
use arc_swap::ArcSwap;
use std::collections::BTreeMap;
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
                    let _ = self.writer.apply(model, b.key, e);
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
            self.published_exact
                .store(Arc::new(exact_workers(&self.states)));
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
