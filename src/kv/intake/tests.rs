use super::*;
use crate::kv::endpoint::TcpEndpoint;
use std::time::{Duration, Instant};

#[test]
fn a_flood_of_commands_never_blocks_the_caller() {
    let (tx, rx) = channel::unbounded();
    let intake = Intake::start(IntakeConfig::default(), tx).unwrap();
    let publisher = |worker| Publisher {
        key: PublisherKey { worker, dp_rank: 0 },
        live: TcpEndpoint::parse("tcp://127.0.0.1:9").unwrap(),
        replay: None,
    };
    let start = Instant::now();
    let (mut taken, mut busy) = (0, 0);
    for i in 0..20_000u32 {
        // The same few publishers again and again: the thread keeps at most 4 sockets.
        match intake.subscribe(publisher(i % 4)) {
            Ok(()) => taken += 1,
            Err(CommandError::Busy) => busy += 1,
            Err(CommandError::Stopped) => panic!("thread stopped"),
        }
    }
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(taken + busy, 20_000);
    assert!(taken >= COMMAND_QUEUE, "{taken}");
    intake.remove_worker(0).unwrap_or(());
    intake.stop();
    // Only resets for replaced or removed subscriptions and state reports were delivered.
    assert!(rx.try_iter().all(|e| matches!(
        e,
        IntakeEvent::Reset {
            reason: ResetReason::Unsubscribed,
            ..
        } | IntakeEvent::State { .. }
    )));
}

#[test]
fn counts_start_at_zero_and_add_up() {
    let s = Stats::default();
    s.add(BATCH, 2);
    s.add(RESET, 1);
    s.add(GAP, 0);
    s.add(CONNECT_FAILED, 3);
    let c = s.counts();
    assert_eq!((c.batches, c.resets, c.gaps), (2, 1, 0));
    assert_eq!(c.connect_failures, 3);
}

/// An applying thread on `sink`, with no reader yet: readers send to `chunks` within `bound`.
struct Applier {
    chunks: Sender<queue::Chunk>,
    bound: Arc<queue::QueueBound>,
    stats: Arc<Stats>,
    published: Arc<arc_swap::ArcSwap<Vec<(PublisherKey, f32, bool)>>>,
    thread: std::thread::JoinHandle<()>,
    /// Held open: a closed command queue stops the thread.
    _commands: Sender<apply::ApplyCommand>,
}

impl Applier {
    fn start(sink: impl EventSink, config: ApplyConfig, queue_bytes: usize) -> Applier {
        let (chunks, chunks_rx) = channel::unbounded();
        let (commands, commands_rx) = channel::bounded(4);
        let bound = Arc::new(queue::QueueBound::new(queue_bytes));
        let stats = Arc::new(Stats::default());
        let published = Arc::new(arc_swap::ArcSwap::from_pointee(Vec::new()));
        let applier = apply::ApplyThread {
            sink,
            config,
            chunks: chunks_rx,
            commands: commands_rx,
            readers: Vec::new(),
            bound: bound.clone(),
            stats: stats.clone(),
            published: published.clone(),
            picked: None,
        };
        Applier {
            chunks,
            bound,
            stats,
            published,
            thread: std::thread::spawn(move || applier.run()),
            _commands: commands,
        }
    }

    /// A reader's sink into it.
    fn reader(&self) -> queue::ForwardSink {
        queue::ForwardSink::new(self.chunks.clone(), self.bound.clone())
    }

    /// Wait for it to apply everything its readers (all dropped by now) sent.
    fn finish(self) {
        drop(self.chunks);
        self.thread.join().unwrap();
    }
}

// ---- several readers in front of one applying thread ----------------------------------------

mod pipeline {
    use super::super::queue::QueueBound;
    use super::*;
    use crate::base::rng::Rng;
    use crate::kv::index::{
        namespace_root, EngineHash, IndexConfig, IndexWriter, MatchScratch, PrefixMatch,
    };
    use crate::kv::wire::{self, BlockRemoved, BlockStored, EventBatch, Form, KvEvent};
    use proptest::prelude::*;

    const BLOCK: usize = 4;

    /// Applies batches to an index, as the gateway's sink does; hands the index back when the
    /// applying thread drops it.
    struct IndexOut {
        writer: Option<IndexWriter>,
        out: Sender<IndexWriter>,
    }

    impl EventSink for IndexOut {
        fn deliver(&mut self, event: IntakeEvent) {
            let Some(w) = self.writer.as_mut() else {
                return;
            };
            match event {
                IntakeEvent::Batch(b) => {
                    for e in &b.events {
                        let _ = w.apply("m", b.key, e);
                    }
                }
                IntakeEvent::Reset { key, .. } => w.reset_source(key),
                IntakeEvent::State { .. } => {}
            }
        }
        fn flush(&mut self) {
            if let Some(w) = self.writer.as_mut() {
                w.publish();
            }
        }
    }

    impl Drop for IndexOut {
        fn drop(&mut self) {
            if let Some(w) = self.writer.take() {
                let _ = self.out.send(w);
            }
        }
    }

    /// Per publisher, its batches encoded as SGLang sends them: chains from the root or from a
    /// block it holds (tokens from a small alphabet, so publishers share prefixes), removals of
    /// blocks it holds, now and then a clear. Also the prompts each chain stands for.
    fn fleet(
        seed: u64,
        sources: &[PublisherKey],
        batches: usize,
    ) -> (Vec<Vec<Vec<u8>>>, Vec<Vec<u32>>) {
        let mut rng = Rng::with_seed(seed);
        let mut next_hash = 1u64;
        let mut prompts = Vec::new();
        let mut all = Vec::new();
        for key in sources {
            // Held blocks: (engine hash, the tokens from the root to it).
            let mut held: Vec<(u64, Vec<u32>)> = Vec::new();
            let mut out = Vec::new();
            for _ in 0..batches {
                let mut events = Vec::new();
                for _ in 0..1 + rng.below(3) {
                    match rng.below(10) {
                        0..=6 => {
                            let from = if held.is_empty() || rng.below(3) == 0 {
                                None
                            } else {
                                Some(held[rng.below(held.len())].clone())
                            };
                            let n = 1 + rng.below(3);
                            let mut path = from.as_ref().map_or(Vec::new(), |f| f.1.clone());
                            let mut hashes = Vec::new();
                            let mut tokens = Vec::new();
                            for _ in 0..n {
                                let block: Vec<u32> =
                                    (0..BLOCK).map(|_| rng.below(3) as u32).collect();
                                path.extend_from_slice(&block);
                                tokens.extend_from_slice(&block);
                                next_hash += 1;
                                hashes.push(EngineHash(next_hash));
                                held.push((next_hash, path.clone()));
                            }
                            prompts.push(path);
                            events.push(KvEvent::BlockStored(BlockStored {
                                block_hashes: hashes,
                                parent: from.map(|f| EngineHash(f.0)),
                                token_ids: tokens,
                                block_size: BLOCK as u32,
                                lora_id: None,
                                medium: None,
                                cache_salt: None,
                                lora_name: None,
                            }));
                        }
                        7..=8 if !held.is_empty() => {
                            let i = rng.below(held.len());
                            let (h, _) = held.swap_remove(i);
                            events.push(KvEvent::BlockRemoved(BlockRemoved {
                                block_hashes: vec![EngineHash(h)],
                                medium: None,
                            }));
                        }
                        9 if rng.below(8) == 0 => {
                            held.clear();
                            events.push(KvEvent::AllBlocksCleared);
                        }
                        _ => {}
                    }
                }
                let batch = EventBatch {
                    ts: Some(1.0e9),
                    events,
                    dp_rank: Some(key.dp_rank),
                    skipped: Default::default(),
                };
                out.push(wire::encode_batch(&batch, Form::MapEvents));
            }
            all.push(out);
        }
        (all, prompts)
    }

    fn answers(w: &IndexWriter, prompts: &[Vec<u32>]) -> Vec<Vec<PrefixMatch>> {
        let reader = w.reader();
        let snap = reader.load();
        let mut scratch = MatchScratch::default();
        let root = namespace_root(None, None);
        prompts
            .iter()
            .map(|p| {
                let mut m = snap.match_prefix("m", root, p, &mut scratch).to_vec();
                m.sort();
                m
            })
            .collect()
    }

    fn sources() -> Vec<PublisherKey> {
        (1..=4)
            .flat_map(|worker| (0..2).map(move |dp_rank| PublisherKey { worker, dp_rank }))
            .collect()
    }

    /// One thread decodes every batch in a round-robin order over the publishers and applies
    /// it: the reference.
    fn in_order(payloads: &[Vec<Vec<u8>>], keys: &[PublisherKey]) -> IndexWriter {
        let mut w = IndexWriter::new(IndexConfig::default());
        let longest = payloads.iter().map(Vec::len).max().unwrap_or(0);
        for i in 0..longest {
            for (key, batches) in keys.iter().zip(payloads) {
                if let Some(p) = batches.get(i) {
                    let b = wire::decode_batch(p).unwrap();
                    for e in &b.events {
                        let _ = w.apply("m", *key, e);
                    }
                }
            }
        }
        w.publish();
        w
    }

    /// `readers` threads each decode their publishers' batches (chosen as the intake chooses)
    /// and hand them through a queue of `queue_bytes` to one applying thread.
    fn through_readers(
        payloads: &[Vec<Vec<u8>>],
        keys: &[PublisherKey],
        readers: usize,
        queue_bytes: usize,
        seed: u64,
    ) -> (IndexWriter, Arc<QueueBound>) {
        let (out_tx, out_rx) = channel::bounded(1);
        let sink = IndexOut {
            writer: Some(IndexWriter::new(IndexConfig::default())),
            out: out_tx,
        };
        let applier = Applier::start(sink, ApplyConfig::default(), queue_bytes);
        let mut threads = Vec::new();
        for r in 0..readers {
            let mine: Vec<(PublisherKey, Vec<Vec<u8>>)> = keys
                .iter()
                .zip(payloads)
                .filter(|(k, _)| reader_of(**k, readers) == r)
                .map(|(k, p)| (*k, p.clone()))
                .collect();
            let mut sink = applier.reader();
            threads.push(std::thread::spawn(move || {
                let mut rng = Rng::with_seed(seed ^ (r as u64 + 1) << 20);
                let longest = mine.iter().map(|m| m.1.len()).max().unwrap_or(0);
                for i in 0..longest {
                    for (key, batches) in &mine {
                        if let Some(p) = batches.get(i) {
                            let b = wire::decode_batch(p).unwrap();
                            sink.deliver(IntakeEvent::Batch(WorkerEvents {
                                key: *key,
                                seq: i as i64,
                                ts: b.ts,
                                events: b.events,
                                replayed: false,
                            }));
                        }
                        // Rounds of any length.
                        if rng.below(4) == 0 {
                            sink.flush();
                        }
                    }
                }
                sink.flush();
            }));
        }
        for t in threads {
            t.join().unwrap();
        }
        let bound = applier.bound.clone();
        applier.finish();
        (out_rx.recv().unwrap(), bound)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn several_readers_give_the_index_and_answers_of_one_reader_in_order(
            seed in any::<u64>(),
            readers in 1usize..5,
            queue_kib in 1usize..64,
        ) {
            let keys = sources();
            let (payloads, prompts) = fleet(seed, &keys, 40);
            let reference = in_order(&payloads, &keys);
            let (sharded, bound) =
                through_readers(&payloads, &keys, readers, queue_kib << 10, seed);
            for k in &keys {
                prop_assert_eq!(reference.held_by(*k), sharded.held_by(*k), "{:?}", k);
            }
            prop_assert_eq!(reference.held(), sharded.held());
            prop_assert_eq!(answers(&reference, &prompts), answers(&sharded, &prompts));
            prop_assert_eq!(bound.queued(), 0);
        }
    }

    #[test]
    fn a_writer_slower_than_its_readers_holds_the_queue_at_its_bound() {
        // The sink takes 1 ms a batch; four readers offer far more. The queue never holds more
        // than its bound plus a chunk per reader, the readers wait, and nothing is lost.
        struct Slow {
            seen: Arc<AtomicU64>,
        }
        impl EventSink for Slow {
            fn deliver(&mut self, event: IntakeEvent) {
                if let IntakeEvent::Batch(_) = event {
                    std::thread::sleep(Duration::from_micros(300));
                    self.seen.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        let limit = 64 << 10;
        let seen = Arc::new(AtomicU64::new(0));
        let applier = Applier::start(Slow { seen: seen.clone() }, ApplyConfig::default(), limit);
        let bound = applier.bound.clone();
        let batch = |seq| {
            IntakeEvent::Batch(WorkerEvents {
                key: PublisherKey {
                    worker: 1,
                    dp_rank: 0,
                },
                seq,
                ts: None,
                events: vec![KvEvent::BlockStored(BlockStored {
                    block_hashes: vec![EngineHash(seq as u64)],
                    parent: None,
                    token_ids: vec![1; 256],
                    block_size: 256,
                    lora_id: None,
                    medium: None,
                    cache_salt: None,
                    lora_name: None,
                })],
                replayed: false,
            })
        };
        let per_reader = 500;
        let readers: Vec<_> = (0..4)
            .map(|_| {
                let mut sink = applier.reader();
                std::thread::spawn(move || {
                    for seq in 0..per_reader {
                        sink.deliver(batch(seq));
                        if seq % 8 == 7 {
                            sink.flush();
                        }
                    }
                    sink.flush();
                })
            })
            .collect();
        let one = super::super::queue::event_bytes(&batch(0));
        let mut peak = 0;
        while readers.iter().any(|t| !t.is_finished()) {
            peak = peak.max(bound.queued());
            std::thread::sleep(Duration::from_micros(200));
        }
        for t in readers {
            t.join().unwrap();
        }
        applier.finish();
        assert_eq!(seen.load(Ordering::Relaxed), 4 * per_reader as u64);
        assert!(peak <= limit + 4 * 8 * one, "peak {peak}, bound {limit}");
        assert!(
            peak >= limit / 2,
            "the flood never reached the bound: {peak}"
        );
        assert!(bound.waited_us() > 0);
    }
}

mod lagging {
    use super::super::queue::ForwardSink;
    use super::*;
    use std::time::{SystemTime, UNIX_EPOCH};

    fn now() -> f64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
    }

    #[test]
    fn a_publisher_whose_batches_arrive_late_is_lagging_until_it_catches_up() {
        let (out_tx, out_rx) = channel::unbounded();
        let config = ApplyConfig {
            max_staleness: Duration::from_secs(1),
            ..ApplyConfig::default()
        };
        let applier = Applier::start(out_tx, config, 1 << 20);
        let mut sink = applier.reader();
        let key = PublisherKey {
            worker: 7,
            dp_rank: 1,
        };
        let other = PublisherKey {
            worker: 8,
            dp_rank: 0,
        };
        let mut seq = 0;
        let mut send = |sink: &mut ForwardSink, key, ts: f64| {
            seq += 1;
            sink.deliver(IntakeEvent::Batch(WorkerEvents {
                key,
                seq,
                ts: Some(ts),
                events: Vec::new(),
                replayed: false,
            }));
            sink.flush();
        };
        let states = |rx: &Receiver<IntakeEvent>, wait: Duration| -> Vec<(u32, SourceState)> {
            let end = Instant::now() + wait;
            let mut out = Vec::new();
            while let Ok(e) = rx.recv_deadline(end) {
                if let IntakeEvent::State { key, state } = e {
                    out.push((key.worker, state));
                }
            }
            out
        };
        for k in [key, other] {
            sink.deliver(IntakeEvent::State {
                key: k,
                state: SourceState::Live,
            });
        }
        // A clock 30 s ahead of ours is an offset, not lag: the first delay sets the floor.
        send(&mut sink, key, now() + 30.0);
        send(&mut sink, other, now());
        let mut seen = states(&out_rx, Duration::from_millis(300));
        seen.sort_by_key(|s| s.0);
        assert_eq!(seen, vec![(7, SourceState::Live), (8, SourceState::Live)]);
        // Its next batch is 2 s older than the clocks' offset: lagging, the other not.
        send(&mut sink, key, now() + 28.0);
        send(&mut sink, other, now());
        assert_eq!(
            states(&out_rx, Duration::from_millis(300)),
            vec![(7, SourceState::Lagging)]
        );
        assert_eq!(applier.stats.lagging.load(Ordering::Relaxed), 1);
        std::thread::sleep(Duration::from_millis(300));
        let figures = applier.published.load();
        let mine = figures.iter().find(|f| f.0 == key).unwrap();
        assert!(mine.1 > 1.5 && mine.2, "{figures:?}");
        // Within half the bound again: caught up, live.
        send(&mut sink, key, now() + 30.0);
        assert_eq!(
            states(&out_rx, Duration::from_millis(300)),
            vec![(7, SourceState::Live)]
        );
        assert_eq!(applier.stats.lagging.load(Ordering::Relaxed), 0);
        // Late again, then quiet: once the queue is empty and it has been quiet past the bound,
        // it is live again without another batch.
        send(&mut sink, key, now() + 27.0);
        assert_eq!(
            states(&out_rx, Duration::from_millis(300)),
            vec![(7, SourceState::Lagging)]
        );
        assert_eq!(
            states(&out_rx, Duration::from_millis(1_600)),
            vec![(7, SourceState::Live)]
        );
        drop(sink);
        applier.finish();
    }
}
