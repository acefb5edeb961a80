//! The queue between the reader threads and the one thread that applies their batches: each
//! reader gathers what it delivers in a round into a [`Chunk`] and hands the chunk over whole,
//! so the applying thread takes one channel message per round of a reader, not one per batch.
//!
//! **The queue is bounded in bytes** ([`QueueBound`]): a reader whose chunk would take the queue
//! past its bound waits (it reads no socket meanwhile, so the publishers' sockets and their own
//! high-water marks hold the rest, and a publisher that drops is replayed or reset by its stream
//! once the reader reads again). Decoded batches never pile up in memory behind a writer that
//! cannot keep up: the queue holds at most its bound plus one chunk per reader.

use super::{EventSink, IntakeEvent};
use crate::kv::wire::KvEvent;
use crossbeam::channel::Sender;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A chunk is handed over once it holds this many bytes, even mid-round: a round over thousands
/// of busy publishers never builds one huge chunk.
pub(super) const CHUNK_BYTES: usize = 256 << 10;

/// How long a reader sleeps between looks at a full queue.
const FULL_PAUSE: Duration = Duration::from_micros(200);

/// What one reader delivered in (part of) a round, in order.
pub(super) struct Chunk {
    /// The events, in the order the reader delivered them (in sequence order per publisher).
    pub(super) events: Vec<IntakeEvent>,
    /// Their estimated size (what the bound counts).
    pub(super) bytes: usize,
}

/// The byte bound shared by the readers and the applying thread.
#[derive(Debug)]
pub(super) struct QueueBound {
    /// Bytes queued now (chunks sent and not yet applied).
    queued: AtomicUsize,
    limit: usize,
    /// Time readers spent waiting for room, in microseconds (the lag made visible).
    waited_us: AtomicU64,
    /// The intake is stopping: waiting readers give up.
    stopping: AtomicBool,
}

impl QueueBound {
    pub(super) fn new(limit: usize) -> QueueBound {
        QueueBound {
            queued: AtomicUsize::new(0),
            limit: limit.max(1),
            waited_us: AtomicU64::new(0),
            stopping: AtomicBool::new(false),
        }
    }

    /// Bytes queued now.
    pub(super) fn queued(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    /// Microseconds readers have waited for room since the start.
    pub(super) fn waited_us(&self) -> u64 {
        self.waited_us.load(Ordering::Relaxed)
    }

    /// The applying thread took a chunk of `bytes`.
    pub(super) fn taken(&self, bytes: usize) {
        self.queued.fetch_sub(bytes, Ordering::Relaxed);
    }

    pub(super) fn stop(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }

    /// Room for `bytes` more, waiting while the queue is past its bound (an empty queue always
    /// takes a chunk, so one larger than the bound still goes). False when the intake stops.
    fn reserve(&self, bytes: usize) -> bool {
        let mut since: Option<Instant> = None;
        loop {
            let q = self.queued.load(Ordering::Relaxed);
            if q == 0 || q + bytes <= self.limit {
                // Two readers may both pass: the bound is exceeded by at most a chunk each.
                self.queued.fetch_add(bytes, Ordering::Relaxed);
                if let Some(t) = since {
                    self.waited_us
                        .fetch_add(t.elapsed().as_micros() as u64, Ordering::Relaxed);
                }
                return true;
            }
            if self.stopping.load(Ordering::Relaxed) {
                return false;
            }
            since.get_or_insert_with(Instant::now);
            std::thread::sleep(FULL_PAUSE);
        }
    }
}

/// A reader's sink: gathers the round's events into a chunk and sends it to the applying thread
/// at the end of the round (or once it is [`CHUNK_BYTES`]).
pub(super) struct ForwardSink {
    pub(super) tx: Sender<Chunk>,
    pub(super) bound: Arc<QueueBound>,
    pub(super) events: Vec<IntakeEvent>,
    pub(super) bytes: usize,
}

impl ForwardSink {
    pub(super) fn new(tx: Sender<Chunk>, bound: Arc<QueueBound>) -> ForwardSink {
        ForwardSink {
            tx,
            bound,
            events: Vec::new(),
            bytes: 0,
        }
    }

    fn send(&mut self) {
        if self.events.is_empty() {
            return;
        }
        let chunk = Chunk {
            events: std::mem::take(&mut self.events),
            bytes: std::mem::take(&mut self.bytes),
        };
        if !self.bound.reserve(chunk.bytes) {
            return;
        }
        let bytes = chunk.bytes;
        if self.tx.send(chunk).is_err() {
            // The applying thread is gone (stopping): nothing waits for these bytes.
            self.bound.taken(bytes);
        }
    }
}

impl EventSink for ForwardSink {
    fn deliver(&mut self, event: IntakeEvent) {
        self.bytes += event_bytes(&event);
        self.events.push(event);
        if self.bytes >= CHUNK_BYTES {
            self.send();
        }
    }

    fn flush(&mut self) {
        self.send();
    }
}

/// What an event holds in memory, near enough to bound a queue of them.
pub(super) fn event_bytes(e: &IntakeEvent) -> usize {
    let base = std::mem::size_of::<IntakeEvent>();
    match e {
        IntakeEvent::Batch(b) => {
            base + b
                .events
                .iter()
                .map(|e| {
                    std::mem::size_of::<KvEvent>()
                        + match e {
                            KvEvent::BlockStored(s) => {
                                s.block_hashes.len() * 8
                                    + s.token_ids.len() * 4
                                    + s.medium.as_ref().map_or(0, |m| m.len())
                                    + s.cache_salt.as_ref().map_or(0, |m| m.len())
                                    + s.lora_name.as_ref().map_or(0, |m| m.len())
                            }
                            KvEvent::BlockRemoved(r) => {
                                r.block_hashes.len() * 8 + r.medium.as_ref().map_or(0, |m| m.len())
                            }
                            KvEvent::AllBlocksCleared => 0,
                        }
                })
                .sum::<usize>()
        }
        IntakeEvent::State { .. } | IntakeEvent::Reset { .. } => base,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::index::{EngineHash, Source};
    use crate::kv::intake::WorkerEvents;
    use crate::kv::wire::BlockStored;
    use crossbeam::channel;

    fn batch(tokens: usize) -> IntakeEvent {
        IntakeEvent::Batch(WorkerEvents {
            key: Source {
                worker: 1,
                dp_rank: 0,
            },
            seq: 0,
            ts: None,
            events: vec![KvEvent::BlockStored(BlockStored {
                block_hashes: vec![EngineHash(1)],
                parent: None,
                token_ids: vec![7; tokens],
                block_size: tokens as u32,
                lora_id: None,
                medium: None,
                cache_salt: None,
                lora_name: None,
            })],
            replayed: false,
        })
    }

    #[test]
    fn a_batch_is_counted_by_what_it_holds() {
        assert!(event_bytes(&batch(1_000)) >= 4_000);
        assert!(event_bytes(&batch(1_000)) < event_bytes(&batch(2_000)));
    }

    #[test]
    fn a_reader_waits_while_the_queue_is_past_its_bound_and_goes_on_once_it_is_taken() {
        let (tx, rx) = channel::unbounded();
        let bound = Arc::new(QueueBound::new(10_000));
        let mut sink = ForwardSink::new(tx, bound.clone());
        sink.deliver(batch(2_000));
        sink.flush();
        assert_eq!(rx.len(), 1);
        let first = bound.queued();
        assert!(first > 8_000, "{first}");
        // The next chunk does not fit: the reader waits until the first is taken.
        let reader = std::thread::spawn(move || {
            sink.deliver(batch(2_000));
            sink.flush();
            sink
        });
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(rx.len(), 1, "sent past the bound");
        let c = rx.recv().unwrap();
        bound.taken(c.bytes);
        let _sink = reader.join().unwrap();
        assert_eq!(rx.len(), 1);
        assert_eq!(bound.queued(), first);
        assert!(bound.waited_us() >= 40_000, "{}", bound.waited_us());
    }

    #[test]
    fn a_chunk_is_sent_mid_round_once_it_is_large() {
        let (tx, rx) = channel::unbounded();
        let mut sink = ForwardSink::new(tx, Arc::new(QueueBound::new(usize::MAX)));
        for _ in 0..CHUNK_BYTES / 4_000 + 1 {
            sink.deliver(batch(1_000));
        }
        assert_eq!(rx.len(), 1);
    }

    #[test]
    fn a_waiting_reader_gives_up_when_the_intake_stops() {
        let (tx, _rx) = channel::unbounded();
        let bound = Arc::new(QueueBound::new(1));
        let mut sink = ForwardSink::new(tx, bound.clone());
        sink.deliver(batch(10));
        sink.flush();
        let reader = std::thread::spawn(move || {
            sink.deliver(batch(10));
            sink.flush();
        });
        std::thread::sleep(Duration::from_millis(20));
        bound.stop();
        reader.join().unwrap();
    }
}
