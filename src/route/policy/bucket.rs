//! bucket: route by prompt length, each worker owning one contiguous range of lengths, so long
//! prompts (expensive prefills) and short ones do not queue behind each other on every worker.
//! It exists for mixed traffic where a few long prompts would otherwise stall the short,
//! latency-sensitive ones everywhere; the ranges follow the traffic so each worker still gets
//! a fair share of the prefill work.
//!
//! * Lengths are in characters of the routing text. Worker `i` of the registered list owns
//!   `[cut[i-1], cut[i])` (with `cut[-1] = 0` and the last range unbounded).
//! * Initially the cuts split `[0, 4096)` evenly over the workers.
//! * Every routed length is written into a sliding window (the last `WINDOW` requests, a ring of
//!   atomics any core can write). Every `bucket_adjust_interval_secs` (`maintain`), the target
//!   cuts are the **char-weighted quantiles** of the window: the cut between range `k-1` and `k`
//!   sits where the cumulative characters of the sorted window cross `k/N` of the total, so each
//!   worker receives about the same total prompt characters (a proxy for prefill work). Each
//!   cut then moves **half way** toward its target (damping sampling noise), keeping the cuts
//!   non-decreasing.
//! * A range whose owner is ineligible or excluded falls back to the least-loaded worker.
use crate::base::rng::Rng;
use crate::base::text::char_count;
use crate::base::WorkerId;
use crate::route::policy::Select;
use crate::route::types::{Branch, Decision, PolicyConfig, RouteInput};
use crate::tree::RadixTree;
use crate::workers::load::LoadBoard;
use arc_swap::ArcSwap;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// Lengths the initial, even split covers (the last range is unbounded anyway).
pub const INITIAL_SPAN: u64 = 4096;
/// Requests remembered for the adjustment.
pub const WINDOW: usize = 4096;
/// Fewer samples than this leave the cuts where they are.
const MIN_SAMPLES: usize = 64;

/// Range owners and the cuts between them (`cuts.len() == owners.len() - 1`, non-decreasing).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Table {
    owners: Box<[WorkerId]>,
    cuts: Box<[u64]>,
}

impl Table {
    fn even(owners: &[WorkerId]) -> Table {
        let n = owners.len() as u64;
        Table {
            owners: owners.into(),
            cuts: (1..n).map(|i| INITIAL_SPAN * i / n).collect(),
        }
    }

    /// Index of the range holding `len`.
    #[inline]
    fn bucket_of(&self, len: u64) -> usize {
        self.cuts.partition_point(|&c| c <= len)
    }
}

#[repr(align(64))]
#[derive(Debug, Default)]
struct PaddedIndex(AtomicUsize);

/// The bucket policy: the ranges and the window of recent lengths, shared by every core.
#[derive(Debug)]
pub struct Bucket {
    table: ArcSwap<Table>,
    /// Recent lengths + 1 (0 = empty slot), saturated at `u32::MAX`.
    window: Box<[AtomicU32]>,
    next: PaddedIndex,
    interval_ms: u64,
    last_adjust_ms: AtomicU64,
    /// Serialises the two writers of `table` (admin `workers_changed`, `maintain`).
    write: Mutex<()>,
}

impl Bucket {
    /// No workers yet; ranges appear with the first `workers_changed`.
    pub fn new(adjust_interval_secs: u64) -> Self {
        Bucket {
            table: ArcSwap::from_pointee(Table::default()),
            window: (0..WINDOW).map(|_| AtomicU32::new(0)).collect(),
            next: PaddedIndex::default(),
            interval_ms: adjust_interval_secs.saturating_mul(1000),
            last_adjust_ms: AtomicU64::new(0),
            write: Mutex::new(()),
        }
    }

    /// The current cuts (range `i` is `[cuts[i-1], cuts[i])`), for the admin view and tests.
    pub fn boundaries(&self) -> Vec<u64> {
        self.table.load().cuts.to_vec()
    }

    fn record(&self, len: u64) {
        let i = self.next.0.fetch_add(1, Relaxed) % WINDOW;
        self.window[i].store(len.saturating_add(1).min(u32::MAX as u64) as u32, Relaxed);
    }

    /// Route one request by the character length of `text`.
    pub fn by_length(
        &self,
        text: &str,
        workers: &[WorkerId],
        exclude: &[WorkerId],
        loads: &LoadBoard,
        rng: &mut Rng,
    ) -> Option<Decision> {
        let len = char_count(text.as_bytes()) as u64;
        self.record(len);
        let owner = {
            let t = self.table.load();
            t.owners.get(t.bucket_of(len)).copied()
        };
        let w = match owner {
            Some(w) if loads.selectable(w, exclude) => w,
            _ => loads.pick_least_loaded(workers, exclude, rng)?,
        };
        Some(Decision::plain(w, Branch::Bucket))
    }

    /// One adjustment step from the current window (see the module docs).
    pub fn adjust(&self) {
        let _g = self.write.lock().unwrap_or_else(|p| p.into_inner());
        let table = self.table.load_full();
        let n = table.owners.len();
        if n < 2 {
            return;
        }
        let mut lens: Vec<u64> = self
            .window
            .iter()
            .map(|v| v.load(Relaxed))
            .filter(|&v| v != 0)
            .map(|v| v as u64 - 1)
            .collect();
        if lens.len() < MIN_SAMPLES {
            return;
        }
        lens.sort_unstable();
        let targets = weighted_cuts(&lens, n);
        if targets.is_empty() {
            return;
        }
        let mut cuts: Vec<u64> = table
            .cuts
            .iter()
            .zip(&targets)
            .map(|(&old, &target)| {
                // Half way, but always at least one step so small gaps close.
                let step = (target.abs_diff(old) / 2).max(1).min(target.abs_diff(old));
                if target >= old {
                    old + step
                } else {
                    old - step
                }
            })
            .collect();
        for i in 1..cuts.len() {
            cuts[i] = cuts[i].max(cuts[i - 1]);
        }
        self.table.store(Arc::new(Table {
            owners: table.owners.clone(),
            cuts: cuts.into(),
        }));
    }
}

impl Select for Bucket {
    fn from_config(cfg: &PolicyConfig) -> Self {
        Bucket::new(cfg.bucket_adjust_interval_secs)
    }

    fn select(
        &self,
        input: &RouteInput,
        workers: &[WorkerId],
        loads: &LoadBoard,
        _: Option<&RadixTree>,
        rng: &mut Rng,
    ) -> Option<Decision> {
        self.by_length(input.text, workers, input.exclude, loads, rng)
    }

    fn reads_text(&self) -> bool {
        true
    }

    /// New registered list: reset to the even split (kept as is when the list is unchanged).
    fn workers_changed(&self, workers: &[WorkerId]) {
        let _g = self.write.lock().unwrap_or_else(|p| p.into_inner());
        if &*self.table.load().owners != workers {
            self.table.store(Arc::new(Table::even(workers)));
        }
    }

    /// Adjust the cuts if `bucket_adjust_interval_secs` passed since the last adjustment.
    fn maintain(&self, now_ms: u64) {
        let last = self.last_adjust_ms.load(Relaxed);
        if now_ms.saturating_sub(last) < self.interval_ms {
            return;
        }
        self.last_adjust_ms.store(now_ms, Relaxed);
        self.adjust();
    }
}

/// The `n - 1` char-weighted quantile cuts of `sorted` lengths: cut `k` is where the cumulative
/// characters cross `k/n` of the total; the crossing length goes to whichever side leaves the
/// cumulative sum closer to the target. Empty when the total is zero.
fn weighted_cuts(sorted: &[u64], n: usize) -> Vec<u64> {
    let total: u128 = sorted.iter().map(|&l| l as u128).sum();
    if total == 0 {
        return Vec::new();
    }
    let mut cuts = Vec::with_capacity(n - 1);
    let mut before: u128 = 0;
    let mut k = 1;
    for &l in sorted {
        let after = before + l as u128;
        while k < n && total * k as u128 / n as u128 <= after {
            let t = total * k as u128 / n as u128;
            cuts.push(if after - t <= t.saturating_sub(before) {
                l + 1
            } else {
                l
            });
            k += 1;
        }
        before = after;
    }
    // Rounding can leave the last targets unplaced: they sit past every sample.
    let last = sorted.last().map_or(0, |&l| l + 1);
    while cuts.len() < n - 1 {
        cuts.push(last);
    }
    cuts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workers::load::tests_support::board;

    /// Share of the window's characters each range receives under the current cuts.
    fn shares(s: &Bucket, lens: &[u64]) -> Vec<f64> {
        let t = s.table.load();
        let mut per = vec![0u64; t.owners.len()];
        for &l in lens {
            per[t.bucket_of(l)] += l;
        }
        let total: u64 = per.iter().sum();
        per.iter().map(|&p| p as f64 / total as f64).collect()
    }

    #[test]
    fn initial_split_is_even_and_last_range_unbounded() {
        let (ws, b) = board(4);
        let s = Bucket::new(5);
        s.workers_changed(&ws);
        assert_eq!(s.boundaries(), [1024, 2048, 3072]);
        let mut rng = Rng::with_seed(1);
        let route = |len: usize, rng: &mut Rng| {
            s.by_length(&"x".repeat(len), &ws, &[], &b, rng)
                .unwrap()
                .worker
        };
        assert_eq!(route(0, &mut rng), 0);
        assert_eq!(route(1023, &mut rng), 0);
        assert_eq!(route(1024, &mut rng), 1);
        assert_eq!(route(3071, &mut rng), 2);
        assert_eq!(route(3072, &mut rng), 3);
        assert_eq!(route(100_000, &mut rng), 3);
        // Lengths are characters, not bytes.
        assert_eq!(
            s.by_length(&"é".repeat(1000), &ws, &[], &b, &mut rng)
                .unwrap()
                .worker,
            0
        );
        // A single worker owns everything.
        s.workers_changed(&ws[..1]);
        assert!(s.boundaries().is_empty());
        assert_eq!(route(5000, &mut rng), 0);
    }

    #[test]
    fn skewed_lengths_pull_the_cuts_toward_equal_chars() {
        let (ws, b) = board(4);
        let s = Bucket::new(5);
        s.workers_changed(&ws);
        let mut rng = Rng::with_seed(2);
        // Mostly short prompts (50..550 chars): all in range 0 with the initial cuts.
        let lens: Vec<u64> = (0..WINDOW).map(|_| 50 + rng.below(500) as u64).collect();
        for &l in &lens {
            s.by_length(&"a".repeat(l as usize), &ws, &[], &b, &mut rng)
                .unwrap();
        }
        let before = shares(&s, &lens);
        assert!(before[0] > 0.99, "{before:?}");
        // Each round moves every cut toward its (fixed, since the window is unchanged) target,
        // so the cuts fall monotonically from their initial values.
        let mut prev = s.boundaries();
        for _ in 0..10 {
            s.adjust();
            let cuts = s.boundaries();
            assert!(
                cuts.iter().zip(&prev).all(|(c, p)| c <= p),
                "{cuts:?} {prev:?}"
            );
            prev = cuts;
        }
        let sh = shares(&s, &lens);
        assert!(sh.iter().all(|&x| (0.2..0.3).contains(&x)), "{sh:?}");
        let cuts = s.boundaries();
        assert!(cuts.windows(2).all(|c| c[0] <= c[1]));
        assert!(cuts[2] < 550, "{cuts:?}");
    }

    #[test]
    fn maintain_respects_the_interval_and_needs_samples() {
        let (ws, b) = board(2);
        let s = Bucket::new(5);
        s.workers_changed(&ws);
        let mut rng = Rng::with_seed(3);
        for _ in 0..10 {
            s.by_length("short", &ws, &[], &b, &mut rng).unwrap();
        }
        s.maintain(10_000);
        assert_eq!(s.boundaries(), [2048], "too few samples");
        for _ in 0..100 {
            s.by_length("short", &ws, &[], &b, &mut rng).unwrap();
        }
        s.maintain(12_000);
        assert_eq!(s.boundaries(), [2048], "interval not elapsed");
        s.maintain(15_000);
        assert!(s.boundaries()[0] < 2048);
    }

    #[test]
    fn ineligible_or_excluded_owner_falls_back_to_least_loaded() {
        let (ws, b) = board(3);
        let s = Bucket::new(5);
        s.workers_changed(&ws);
        b.inc(2);
        let mut rng = Rng::with_seed(4);
        b.set_eligible(0, false);
        let d = s.by_length("tiny", &ws, &[], &b, &mut rng).unwrap();
        assert_eq!((d.worker, d.branch), (1, Branch::Bucket));
        b.set_eligible(0, true);
        let d = s.by_length("tiny", &ws, &[0], &b, &mut rng).unwrap();
        assert_eq!(d.worker, 1);
        assert_eq!(s.by_length("tiny", &ws, &[0, 1, 2], &b, &mut rng), None);
        // No ranges yet (no workers_changed): least loaded.
        let fresh = Bucket::new(5);
        assert_eq!(
            fresh.by_length("x", &ws, &[], &b, &mut rng).unwrap().worker,
            0
        );
    }

    #[test]
    fn the_policy_routes_on_the_text_and_follows_named_membership() {
        let (ws, b) = board(2);
        let p = Bucket::from_config(&PolicyConfig::default());
        assert!(p.reads_text() && !p.needs_tree());
        p.workers_changed_named(&[(0, b"http://a:1"), (1, b"http://b:1")]);
        assert_eq!(p.boundaries(), [2048]);
        let mut rng = Rng::with_seed(5);
        let long = "x".repeat(3000);
        let d = p
            .select(&RouteInput::new(&long, 0), &ws, &b, None, &mut rng)
            .unwrap();
        assert_eq!((d.worker, d.branch), (1, Branch::Bucket));
        let d = p
            .select(&RouteInput::new("short", 0), &ws, &b, None, &mut rng)
            .unwrap();
        assert_eq!((d.worker, d.branch), (0, Branch::Bucket));
    }

    #[test]
    fn weighted_cuts_split_characters() {
        // Ten of length 10 and one of length 100: half the chars is in the single long one.
        let mut lens = vec![10u64; 10];
        lens.push(100);
        assert_eq!(weighted_cuts(&lens, 2), [11]);
        assert_eq!(weighted_cuts(&[0, 0, 0], 3), Vec::<u64>::new());
        let cuts = weighted_cuts(&[1, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_eq!(cuts.len(), 3);
        assert!(cuts.windows(2).all(|c| c[0] <= c[1]));
    }
}
