//! Export and import of the writer's state between two copies (`writer/transfer.rs`).

use crate::base::rng::Rng;
use crate::kv::index::tests::{matches, op, removed, seq, src, stored, Op, M};
use crate::kv::index::*;
use proptest::prelude::*;

/// The second model of the traffic.
const N: &str = "n";
const BS: usize = 4;
/// Copy B numbers the same workers differently: `WorkerId`s are per copy.
const SHIFT: WorkerId = 100;

fn url(w: WorkerId) -> String {
    format!("http://10.0.0.{w}:30000")
}

/// Copy B's worker for a URL of [`url`].
fn worker_in_b(u: &str) -> Option<WorkerId> {
    let w: WorkerId = u
        .strip_prefix("http://10.0.0.")?
        .strip_suffix(":30000")?
        .parse()
        .ok()?;
    Some(w + SHIFT)
}

fn in_b(s: Source) -> Source {
    src(s.worker + SHIFT, s.dp_rank)
}

fn watermark(s: Source) -> Option<i64> {
    Some(i64::from(s.worker) * 1_000 + i64::from(s.dp_rank))
}

fn export(w: &IndexWriter) -> Vec<u8> {
    w.export(|wk| Some(url(wk)), watermark)
}

fn import(w: &mut IndexWriter, data: &[u8]) -> Result<ImportSummary, ImportError> {
    w.import(data, worker_in_b)
}

/// The sources of [`Traffic`]: workers 0–2 serve `M`, worker 3 serves `N`, two ranks each.
fn traffic_sources() -> Vec<(Source, &'static str)> {
    (0..4)
        .flat_map(|w| (0..2).map(move |r| (src(w, r), if w == 3 { N } else { M })))
        .collect()
}

/// One conversation on one source: its engine hashes and tokens so far.
struct Chat {
    source: usize,
    hashes: Vec<u64>,
    tokens: Vec<u32>,
}

/// Chats under a shared two-block system prompt (the same engine hashes 1, 2 on every source,
/// so later chats store them again as duplicates and block 2 has many children), growing by
/// 1–4 blocks an event; tails removed, middle blocks removed (children left under a missing
/// parent, and the system prompt re-stored later under the same ids), sources cleared.
struct Traffic {
    rng: Rng,
    next: u64,
    chats: Vec<Chat>,
    /// Every chat ever, as a prompt (matching them all covers every stored sequence).
    prompts: Vec<(&'static str, Vec<u32>)>,
}

const SYSTEM: [u32; 8] = [9, 9, 9, 9, 8, 8, 8, 8];

impl Traffic {
    fn new(seed: u64) -> Self {
        Traffic {
            rng: Rng::with_seed(seed),
            next: 1_000,
            chats: Vec::new(),
            prompts: Vec::new(),
        }
    }

    fn fresh(&mut self, blocks: usize) -> (Vec<u64>, Vec<u32>) {
        let hashes: Vec<u64> = (0..blocks as u64).map(|i| self.next + i).collect();
        self.next += blocks as u64;
        let tokens = (0..blocks * BS)
            .map(|_| self.rng.below(50) as u32)
            .collect();
        (hashes, tokens)
    }

    /// The next event, on which source of [`traffic_sources`].
    fn event(&mut self) -> (usize, KvEvent) {
        let sources = traffic_sources().len();
        let roll = self.rng.below(1_000);
        if self.chats.is_empty() || roll < 200 {
            let source = self.rng.below(sources);
            let n = 1 + self.rng.below(4);
            let (mut hashes, mut tokens) = self.fresh(n);
            hashes.splice(0..0, [1, 2]);
            tokens.splice(0..0, SYSTEM);
            let e = stored(&hashes, None, &tokens, BS);
            self.chats.push(Chat {
                source,
                hashes,
                tokens,
            });
            return (source, e);
        }
        let c = self.rng.below(self.chats.len());
        let source = self.chats[c].source;
        match roll {
            200..=749 => {
                let n = 1 + self.rng.below(4);
                let (hashes, tokens) = self.fresh(n);
                let chat = &mut self.chats[c];
                let e = stored(&hashes, chat.hashes.last().copied(), &tokens, BS);
                chat.hashes.extend(&hashes);
                chat.tokens.extend(&tokens);
                (source, e)
            }
            750..=899 => {
                let chat = &mut self.chats[c];
                let tail = chat.hashes.pop().unwrap_or(0);
                chat.tokens.truncate(chat.hashes.len() * BS);
                if chat.hashes.is_empty() {
                    self.chats.swap_remove(c);
                }
                (source, removed(&[tail]))
            }
            900..=929 => {
                // HiCache backs the conversation up to host memory...
                let chat = &self.chats[c];
                let e = with_medium(stored(&chat.hashes, None, &chat.tokens, BS), "CPU_PINNED");
                (source, e)
            }
            930..=944 => {
                // ...and frees one tier's copy of its tail.
                let tail = *self.chats[c].hashes.last().unwrap_or(&0);
                let medium = if self.rng.below(2) == 0 {
                    "CPU_PINNED"
                } else {
                    "GPU"
                };
                (source, with_medium(removed(&[tail]), medium))
            }
            945..=994 => {
                let i = self.rng.below(self.chats[c].hashes.len());
                (source, removed(&[self.chats[c].hashes[i]]))
            }
            _ => {
                self.chats.retain(|ch| ch.source != source);
                (source, KvEvent::AllBlocksCleared)
            }
        }
    }

    /// Applies `events` events to every writer given (each under its own numbering).
    fn run(&mut self, events: usize, writers: &mut [(&mut IndexWriter, WorkerId)]) {
        let sources = traffic_sources();
        for _ in 0..events {
            let (i, e) = self.event();
            let (s, model) = sources[i];
            for (w, shift) in writers.iter_mut() {
                let _ = w.apply(model, src(s.worker + *shift, s.dp_rank), &e);
            }
        }
        self.prompts = self
            .chats
            .iter()
            .map(|ch| (sources[ch.source].1, ch.tokens.clone()))
            .collect();
    }
}

/// A peer that applied `events` events of [`Traffic`] from `seed`, every source known.
/// `e` concerning the storage tier `medium`.
fn with_medium(mut e: KvEvent, medium: &str) -> KvEvent {
    match &mut e {
        KvEvent::BlockStored(s) => s.medium = Some(medium.into()),
        KvEvent::BlockRemoved(r) => r.medium = Some(medium.into()),
        KvEvent::AllBlocksCleared => {}
    }
    e
}

fn peer(seed: u64, events: usize) -> (IndexWriter, Traffic) {
    let mut a = IndexWriter::new(IndexConfig::default());
    let mut t = Traffic::new(seed);
    t.run(events, &mut [(&mut a, 0)]);
    assert_eq!(a.stats().sources(), 8);
    (a, t)
}

/// `b` (numbered as copy B) answers every prompt as `a` does and holds the same records.
fn assert_same(a: &mut IndexWriter, b: &mut IndexWriter, prompts: &[(&str, Vec<u32>)]) {
    a.publish();
    b.publish();
    let (sa, sb) = (a.reader().shared.load_full(), b.reader().shared.load_full());
    let mut scratch = MatchScratch::default();
    for (model, p) in prompts {
        let mut want: Vec<_> = sa
            .match_prefix(model, crate::kv::index::ROOT_PARENT, p, &mut scratch)
            .iter()
            .map(|m| (in_b(m.source), m.blocks, m.with_host))
            .collect();
        want.sort();
        let mut got: Vec<_> = sb
            .match_prefix(model, crate::kv::index::ROOT_PARENT, p, &mut scratch)
            .iter()
            .map(|m| (m.source, m.blocks, m.with_host))
            .collect();
        got.sort();
        assert_eq!(got, want, "prompt {p:?}");
    }
    for (s, _) in traffic_sources() {
        assert_eq!(a.held_by(s), b.held_by(in_b(s)), "{s:?}");
        assert_eq!(a.records(s), b.records(in_b(s)), "records of {s:?}");
    }
    assert_eq!(a.held(), b.held());
    a.check();
    b.check();
}

#[test]
fn round_trip_is_exact_and_stays_exact_under_further_events() {
    // Unbounded, and at a per-source cap that evicts before and after the copy (the copy must
    // then evict the same blocks as the original: same eviction order).
    for cap in [usize::MAX, 150] {
        let cfg = IndexConfig {
            max_blocks_per_source: cap,
            ..IndexConfig::default()
        };
        let mut a = IndexWriter::new(cfg.clone());
        let mut t = Traffic::new(1);
        t.run(3_000, &mut [(&mut a, 0)]);
        assert!(a.held() > 600, "{}", a.held());
        let data = export(&a);
        let mut b = IndexWriter::new(cfg);
        let summary = import(&mut b, &data).unwrap();
        assert_eq!((summary.unknown, summary.refused), (0, 0));
        let mut want: Vec<_> = traffic_sources()
            .into_iter()
            .map(|(s, _)| ImportedSource {
                source: in_b(s),
                watermark: watermark(s),
                blocks: a.held_by(s),
                left_out: 0,
            })
            .collect();
        want.sort_by_key(|s| s.source);
        assert_eq!(summary.sources, want);
        let prompts = t.prompts.clone();
        assert_same(&mut a, &mut b, &prompts);
        // Live events after the watermark, on both: stores under imported parents, removals of
        // imported blocks, clears, and (at the cap) evictions.
        for _ in 0..10 {
            t.run(200, &mut [(&mut a, 0), (&mut b, SHIFT)]);
            let prompts = t.prompts.clone();
            assert_same(&mut a, &mut b, &prompts);
        }
        assert!(a.stats().evicted() > 0 || cap == usize::MAX);
    }
}

#[test]
fn smaller_caps_keep_what_the_peers_eviction_would_keep() {
    let (mut a, mut t) = peer(2, 3_000);
    let data = export(&a);
    let cap = 60;
    let mut b = IndexWriter::new(IndexConfig {
        max_blocks_per_source: cap,
        ..IndexConfig::default()
    });
    let summary = import(&mut b, &data).unwrap();
    for (s, _) in traffic_sources() {
        let got = summary
            .sources
            .iter()
            .find(|i| i.source == in_b(s))
            .unwrap();
        assert_eq!(got.blocks, a.held_by(s).min(cap));
        assert_eq!(got.left_out, a.held_by(s).saturating_sub(cap));
        a.evict_to(s, cap);
    }
    // The same records, stamps included: what remains of the chains the peer would evict
    // first is as old in the copy as in the peer.
    let prompts = t.prompts.clone();
    assert_same(&mut a, &mut b, &prompts);
    // With the peer at the same cap from here on, both evict the same blocks.
    a.set_config(b.config().clone());
    for _ in 0..5 {
        t.run(200, &mut [(&mut a, 0), (&mut b, SHIFT)]);
        let prompts = t.prompts.clone();
        assert_same(&mut a, &mut b, &prompts);
    }
    let evicted = a.stats().evicted();
    assert!(evicted > 200, "{evicted}");
}

#[test]
fn the_global_cap_trims_the_largest_sources_to_a_common_level() {
    let mut a = IndexWriter::new(IndexConfig::default());
    // Four sources holding 10, 40, 200 and 300 single-block chains.
    for (w, n) in [(0u32, 10u32), (1, 40), (2, 200), (3, 300)] {
        for i in 0..n {
            let eh = u64::from(w) << 32 | u64::from(i);
            a.apply(M, src(w, 0), &stored(&[eh], None, &seq(4, i * 4), 4))
                .unwrap();
        }
    }
    let data = export(&a);
    // 7 blocks already held by a source the payload does not name.
    let mut b = IndexWriter::new(IndexConfig {
        max_blocks: 308,
        ..IndexConfig::default()
    });
    b.apply(
        M,
        src(7, 0),
        &stored(&[1, 2, 3, 4, 5, 6, 7], None, &seq(28, 10_000), 4),
    )
    .unwrap();
    let summary = import(&mut b, &data).unwrap();
    let held: Vec<_> = summary.sources.iter().map(|s| s.blocks).collect();
    // 301 left: 10 and 40 whole, 251 shared by the other two (126 + 125).
    assert_eq!(held, vec![10, 40, 126, 125]);
    assert_eq!(b.held(), 308);
    assert_eq!(b.held_by(src(7, 0)), 7);
    b.check();
    // The newest blocks stayed (single-block chains: the oldest are evicted first).
    let newest = seq(4, 299 * 4);
    assert_eq!(matches(&mut b, M, &newest), vec![(src(3 + SHIFT, 0), 1)]);
    assert_eq!(
        matches(&mut b, M, &seq(4, 0)),
        vec![(src(SHIFT, 0), 1), (src(1 + SHIFT, 0), 1)]
    );
}

#[test]
fn unknown_and_refused_sources_are_skipped_and_counted() {
    let (a, _) = peer(3, 500);
    let data = export(&a);
    // Worker 1 unknown here; rank 1 beyond this copy's ranks; one model only (`M` comes first
    // in the payload, so worker 3's `N` is refused).
    let mut b = IndexWriter::new(IndexConfig {
        max_dp_ranks: 1,
        max_models: 1,
        ..IndexConfig::default()
    });
    let summary = b
        .import(&data, |u| worker_in_b(u).filter(|&w| w != 1 + SHIFT))
        .unwrap();
    assert_eq!(summary.unknown, 2);
    assert_eq!(
        summary.refused, 4,
        "ranks 1 of workers 0, 2, 3; worker 3's model"
    );
    let got: Vec<_> = summary.sources.iter().map(|s| s.source).collect();
    assert_eq!(got, vec![in_b(src(0, 0)), in_b(src(2, 0))]);
    assert_eq!(b.held(), a.held_by(src(0, 0)) + a.held_by(src(2, 0)));
    b.check();
    // A block size other than the one a source's server announced to this copy: refused like
    // its events would be.
    let mut c = IndexWriter::new(IndexConfig::default());
    for (s, model) in traffic_sources() {
        if model == M {
            c.announce_block_size(in_b(s), BS * 2);
        }
    }
    let summary = import(&mut c, &data).unwrap();
    let with_blocks = (0..3)
        .flat_map(|w| [src(w, 0), src(w, 1)])
        .filter(|&s| a.held_by(s) > 0)
        .count();
    assert!(with_blocks >= 4);
    assert_eq!(summary.refused, with_blocks);
    assert_eq!(summary.sources.len(), 8 - with_blocks);
    // A cap on sources.
    let mut d = IndexWriter::new(IndexConfig {
        max_sources: 3,
        ..IndexConfig::default()
    });
    let summary = import(&mut d, &data).unwrap();
    assert_eq!((summary.sources.len(), summary.refused), (3, 5));
    d.check();
}

#[test]
fn import_resets_the_sources_it_names_and_leaves_the_others() {
    let (a, _) = peer(4, 500);
    let data = export(&a);
    let mut b = IndexWriter::new(IndexConfig::default());
    let other = seq(12, 500);
    // What B already held for a named source, a source the payload does not name, and a named
    // source B had under the other model.
    b.apply(M, in_b(src(0, 0)), &stored(&[1, 2, 3], None, &other, 4))
        .unwrap();
    b.apply(M, src(60, 0), &stored(&[1, 2, 3], None, &other, 4))
        .unwrap();
    b.apply(M, in_b(src(3, 1)), &stored(&[1, 2, 3], None, &other, 4))
        .unwrap();
    import(&mut b, &data).unwrap();
    assert_eq!(matches(&mut b, M, &other), vec![(src(60, 0), 3)]);
    assert_eq!(b.stats().resets(), 2);
    let mut same = IndexWriter::new(IndexConfig::default());
    import(&mut same, &data).unwrap();
    for (s, _) in traffic_sources() {
        assert_eq!(b.records(in_b(s)), same.records(in_b(s)));
    }
    b.check();
}

#[test]
fn sources_without_blocks_travel_with_their_watermarks() {
    let mut a = IndexWriter::new(IndexConfig::default());
    a.apply(M, src(1, 0), &KvEvent::AllBlocksCleared).unwrap();
    a.apply(M, src(2, 0), &stored(&[5], None, &seq(4, 0), 4))
        .unwrap();
    // Worker 2 has no URL (being removed, say): left out.
    let data = a.export(|w| (w != 2).then(|| url(w)), |_| None);
    let mut b = IndexWriter::new(IndexConfig::default());
    let summary = import(&mut b, &data).unwrap();
    assert_eq!(
        summary.sources,
        vec![ImportedSource {
            source: in_b(src(1, 0)),
            watermark: None,
            blocks: 0,
            left_out: 0,
        }]
    );
    // Known without blocks: its events apply from here (the source counts against the caps).
    assert_eq!(b.stats().sources(), 1);
    // An empty index round-trips as nothing.
    let empty = IndexWriter::new(IndexConfig::default()).export(|w| Some(url(w)), watermark);
    assert_eq!(empty.len(), 16);
    assert_eq!(import(&mut b, &empty).unwrap(), ImportSummary::default());
    b.check();
}

/// Everything a reader or the writer's next step could see, to show a failed import changed
/// nothing.
fn state(w: &mut IndexWriter) -> Vec<Vec<writer::RecordView>> {
    w.check();
    let mut v: Vec<_> = (0..4)
        .flat_map(|wk| (0..2).map(move |r| src(wk + SHIFT, r)))
        .map(|s| w.records(s))
        .collect();
    v.push(vec![(w.held() as u64, w.stats().sources(), None, 0, 0, 0)]);
    v
}

#[test]
fn malformed_payloads_are_refused_and_change_nothing() {
    let (a, _) = peer(5, 300);
    assert!(a.held_by(src(0, 0)) > 0);
    let data = export(&a);
    let mut b = IndexWriter::new(IndexConfig::default());
    b.apply(M, in_b(src(0, 0)), &stored(&[1], None, &seq(4, 0), 4))
        .unwrap();
    let before = state(&mut b);
    let mut bad = |payload: &[u8]| {
        let e = import(&mut b, payload).unwrap_err();
        assert_eq!(state(&mut b), before, "{e}");
        e
    };
    assert_eq!(bad(b""), ImportError::NotAnExport);
    assert_eq!(
        bad(b"<html>502 Bad Gateway</html>"),
        ImportError::NotAnExport
    );
    // Another version's export (1 and 2: other own hashes; 3: no tiers) is refused, not
    // misread.
    for version in [1u8, 2, 3, 5] {
        let mut other = data.clone();
        other[8] = version;
        assert_eq!(bad(&other), ImportError::Version(u32::from(version)));
    }
    for cut in [9, 12, 16, 20, 40, data.len() / 2, data.len() - 1] {
        assert!(matches!(
            bad(&data[..cut]),
            ImportError::Truncated { .. } | ImportError::Corrupt { .. }
        ));
    }
    let mut trailing = data.clone();
    trailing.push(0);
    assert!(matches!(bad(&trailing), ImportError::Corrupt { .. }));
    // A source count no payload of this size could hold is refused before anything is
    // allocated for it.
    let mut huge = data.clone();
    huge[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(bad(&huge), ImportError::Truncated { at: 12 });
    // Same for a block count: the first source's count sits after its strings.
    let mut huge = data.clone();
    let url_len = u32::from_le_bytes(data[16..20].try_into().unwrap()) as usize;
    let model_at = 16 + 4 + url_len + 4;
    let model_len = u32::from_le_bytes(data[model_at..model_at + 4].try_into().unwrap()) as usize;
    let watermark_at = model_at + 4 + model_len + 4;
    assert_eq!(data[watermark_at], 1);
    let count_at = watermark_at + 9;
    huge[count_at..count_at + 4].copy_from_slice(&(u32::MAX / 2).to_le_bytes());
    assert_eq!(bad(&huge), ImportError::Truncated { at: count_at });
    // Corrupt at the first block: an unknown parent kind (3).
    let mut kind = data.clone();
    kind[count_at + 4] |= 3;
    assert!(matches!(bad(&kind), ImportError::Corrupt { .. }));
}

/// Random damage to a real export: refused without a change, or imported within the caps.
fn damaged_import(data: &[u8], damage: &[(usize, u8)], cut: Option<usize>, cfg: IndexConfig) {
    let mut d = data.to_vec();
    for &(at, x) in damage {
        let i = at % d.len();
        d[i] ^= x;
    }
    if let Some(cut) = cut {
        d.truncate(cut % (d.len() + 1));
    }
    let mut b = IndexWriter::new(cfg.clone());
    let _ = b.apply(M, in_b(src(0, 0)), &stored(&[1, 2], None, &seq(8, 0), 4));
    let _ = b.apply(M, src(60, 0), &stored(&[1, 2], None, &seq(8, 0), 4));
    let before = state(&mut b);
    match import(&mut b, &d) {
        Err(_) => assert_eq!(state(&mut b), before),
        Ok(summary) => {
            b.check();
            assert!(b.held() <= cfg.max_blocks);
            assert!(b.stats().sources() as usize <= cfg.max_sources);
            for s in &summary.sources {
                assert!(b.held_by(s.source) <= cfg.max_blocks_per_source);
                assert_eq!(b.held_by(s.source), s.blocks);
            }
        }
    }
    // Whatever was imported, the writer keeps working.
    let _ = b.apply(M, in_b(src(0, 0)), &stored(&[3], Some(2), &seq(4, 8), 4));
    b.publish();
    b.check();
}

fn small_caps() -> impl Strategy<Value = IndexConfig> {
    (1usize..400, 1usize..150, 1usize..10, 1u32..3, 1usize..3).prop_map(
        |(max_blocks, max_blocks_per_source, max_sources, max_dp_ranks, max_models)| IndexConfig {
            max_blocks,
            max_blocks_per_source,
            max_sources,
            max_dp_ranks,
            max_models,
        },
    )
}

/// Applies `ops` to `w`, workers numbered `shift` up; collects the prompts worth matching.
fn run_ops(w: &mut IndexWriter, ops: &[Op], shift: WorkerId, prompts: &mut Vec<(&str, Vec<u32>)>) {
    let at = |s: &Source| src(s.worker + shift, s.dp_rank);
    for op in ops {
        match op {
            Op::Store {
                s,
                hashes,
                parent,
                tokens,
                bs,
            } => {
                prompts.push((M, tokens.clone()));
                let _ = w.apply(M, at(s), &stored(hashes, *parent, tokens, *bs));
            }
            Op::Remove(s, h) => {
                let _ = w.apply(M, at(s), &removed(h));
            }
            Op::Clear(s) => {
                let _ = w.apply(M, at(s), &KvEvent::AllBlocksCleared);
            }
            Op::Reset(worker) => w.reset_worker(worker + shift),
            Op::RemoveWorker(worker) => w.remove_worker(worker + shift),
            Op::Match(tokens) => prompts.push((M, tokens.clone())),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Any history of events (parents removed before children, engine ids reused for other
    /// tokens, the same tokens under two ids, sources cleared and removed) copies exactly, and
    /// the two copies stay identical under the same further events.
    #[test]
    fn any_history_round_trips_exactly(
        before in prop::collection::vec(op(), 1..60),
        after in prop::collection::vec(op(), 1..40),
    ) {
        let mut a = IndexWriter::new(IndexConfig::default());
        let mut prompts = Vec::new();
        run_ops(&mut a, &before, 0, &mut prompts);
        let data = export(&a);
        let mut b = IndexWriter::new(IndexConfig::default());
        import(&mut b, &data).unwrap();
        assert_same(&mut a, &mut b, &prompts);
        run_ops(&mut a, &after, 0, &mut prompts);
        run_ops(&mut b, &after, SHIFT, &mut Vec::new());
        assert_same(&mut a, &mut b, &prompts);
    }

    /// Whatever the history, a copy with a smaller per-source cap holds what the peer would
    /// after evicting down to that cap, stamps included.
    #[test]
    fn any_history_cut_to_a_smaller_cap_is_the_peers_eviction(
        ops in prop::collection::vec(op(), 1..80),
        cap in 0usize..8,
    ) {
        let mut a = IndexWriter::new(IndexConfig::default());
        let mut prompts = Vec::new();
        run_ops(&mut a, &ops, 0, &mut prompts);
        let data = export(&a);
        let mut b = IndexWriter::new(IndexConfig {
            max_blocks_per_source: cap,
            ..IndexConfig::default()
        });
        import(&mut b, &data).unwrap();
        for (s, _) in traffic_sources() {
            a.evict_to(s, cap);
        }
        assert_same(&mut a, &mut b, &prompts);
    }

    /// Damage to an export (bytes flipped, the end cut off) is refused without a change, or
    /// imports within the caps; never a panic.
    #[test]
    fn damaged_exports_never_panic(
        ops in prop::collection::vec(op(), 1..60),
        damage in prop::collection::vec((any::<usize>(), 1u8..), 0..4),
        cut in prop::option::of(any::<usize>()),
        cfg in small_caps(),
    ) {
        let mut a = IndexWriter::new(IndexConfig::default());
        run_ops(&mut a, &ops, 0, &mut Vec::new());
        damaged_import(&export(&a), &damage, cut, cfg);
    }
}

#[test]
fn damage_to_a_large_export_is_refused_or_harmless() {
    let (a, _) = peer(6, 1_000);
    let data = export(&a);
    let mut rng = Rng::with_seed(9);
    for i in 0..300 {
        let damage: Vec<(usize, u8)> = (0..1 + rng.below(3))
            .map(|_| (rng.below(data.len()), 1 + rng.below(255) as u8))
            .collect();
        let cut = (i % 4 == 0).then(|| rng.below(data.len()));
        let cfg = IndexConfig {
            max_blocks: 50 + rng.below(2_000),
            max_blocks_per_source: 10 + rng.below(500),
            max_sources: 1 + rng.below(10),
            ..IndexConfig::default()
        };
        damaged_import(&data, &damage, cut, cfg);
    }
}

/// The size the module doc states: 17.1 bytes per block on the bench's traffic (16-block events
/// extending conversations of ~8 events), 18.7 on this file's short turns.
#[test]
fn an_export_costs_about_17_bytes_a_block() {
    let mut a = IndexWriter::new(IndexConfig::default());
    let mut rng = Rng::with_seed(8);
    let mut tips = vec![vec![None; 64]; 8];
    let mut next = 1u64;
    for i in 0..4_000 {
        let s = i % 8;
        let c = rng.below(64);
        let hashes: Vec<u64> = (next..next + 16).collect();
        next += 16;
        let tokens: Vec<u32> = (0..16 * BS).map(|_| rng.below(150_000) as u32).collect();
        a.apply(
            M,
            src(s as u32, 0),
            &stored(&hashes, tips[s][c], &tokens, BS),
        )
        .unwrap();
        tips[s][c] = (rng.below(8) != 0).then_some(next - 1);
    }
    let per_block = export(&a).len() as f64 / a.held() as f64;
    assert!((17.0..17.3).contains(&per_block), "{per_block}");
    let mut a = IndexWriter::new(IndexConfig::default());
    Traffic::new(7).run(5_000, &mut [(&mut a, 0)]);
    // Short turns off a shared system prompt, a few blocks backed up to host memory (a tier
    // byte each).
    let per_block = export(&a).len() as f64 / a.held() as f64;
    assert!((18.9..19.6).contains(&per_block), "{per_block}");
}

/// The event thread takes the copy; encoding it runs on another thread.
#[test]
fn an_export_copy_can_be_encoded_on_another_thread() {
    let mut a = IndexWriter::new(IndexConfig::default());
    Traffic::new(10).run(200, &mut [(&mut a, 0)]);
    let copy = a.export_copy(|w| Some(url(w)), watermark);
    let data = std::thread::spawn(move || copy.encode()).join().unwrap();
    assert_eq!(data, export(&a));
}

/// The peer learns a model's block size from its first well-formed `BlockStored`, even one it
/// then drops (unknown parent): the copy must learn the same, or it would accept events the
/// peer drops.
#[test]
fn a_block_size_learned_without_blocks_travels() {
    let mut a = IndexWriter::new(IndexConfig::default());
    let orphan = stored(&[2], Some(1), &seq(3, 0), 3);
    assert_eq!(
        a.apply(M, src(0, 0), &orphan),
        Err(DropReason::UnknownParent)
    );
    let mut b = IndexWriter::new(IndexConfig::default());
    import(&mut b, &export(&a)).unwrap();
    let other_size = stored(&[1], None, &seq(2, 0), 2);
    assert_eq!(
        b.apply(M, in_b(src(0, 0)), &other_size),
        a.apply(M, src(0, 0), &other_size)
    );
    b.publish();
    assert_eq!(b.reader().load().block_size(M), Some(3));
}
