//! Request load per worker, shared by every core, answering "least loaded" and
//! "min/max load" without a pass over all workers (the reference's O(workers) selection is what
//! collapses at thousands of workers).
//!
//! # Structure
//! * One `AtomicU64` word per worker slot: bit 63 = eligible (healthy and circuit not open),
//!   bits 32..63 = *external* load (requests the engine reports that this gateway copy did not
//!   send: other copies behind the same load balancer, direct clients; set by the telemetry
//!   thread), bits 0..32 = this copy's own in-flight count. A worker's *load*, the number every
//!   aggregate and pick uses, is own + external. Packing all three into one word gives every
//!   `inc`/`dec`/`set_external`/`set_eligible` a single linearisation point, so the aggregate
//!   updates that follow can be derived from the returned previous value alone.
//! * `levels[l]` = number of *eligible* workers whose load is `l` (the top level
//!   `top` collects every load `>= top`). Whoever changes a slot moves the worker between two
//!   levels with `fetch_add`/`fetch_sub`; those commute, so when the board is quiescent the level
//!   counts are exact, while in between they may be transiently off by the operations in flight
//!   (a count can even dip below zero for a moment: counts are signed and read as `max(0, c)`).
//! * `min_hint` / `max_hint` start the level scans near the answer. Writers only ever *widen* a
//!   hint (lower min / raise max, after publishing the level count); readers *narrow* it with a
//!   compare-exchange and then re-check the skipped levels, widening again if a writer slipped a
//!   worker in meanwhile, so a hint is never left narrower than the truth once writers stop.
//! * Least-loaded picks sample random candidates and accept one whose load equals the minimum
//!   level (rejection sampling is exactly uniform over the accepted set); the number of tries is
//!   bounded by the expected ratio, then an exact two-pass scan decides.
//!
//! Memory ordering: slot words are `Relaxed` (a count, nothing is published through it). Level
//! counts and hints use `SeqCst` so the narrow-then-recheck argument holds; on x86 a `SeqCst`
//! read-modify-write costs the same as a relaxed one and `SeqCst` loads are plain loads.
use crate::base::rng::Rng;
use crate::base::WorkerId;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering::Relaxed, Ordering::SeqCst};

/// Bit of a slot word that marks the worker eligible.
const ELIGIBLE: u64 = 1 << 63;
/// Bits of a slot word holding this copy's own in-flight count.
const OWN_MASK: u64 = u32::MAX as u64;
/// Position of the external load in a slot word.
const EXT_SHIFT: u32 = 32;
/// Largest external load a slot holds (31 bits; larger reports are clamped).
pub const MAX_EXTERNAL: u32 = (1 << 31) - 1;
/// Bits of a slot word holding the external load.
const EXT_MASK: u64 = (MAX_EXTERNAL as u64) << EXT_SHIFT;
/// Most distinct load levels a board may have.
const MAX_LEVELS: usize = 1 << 31;
/// Default number of distinct load levels; loads `>= DEFAULT_LEVELS - 1` share the top level
/// (and make `min_max` fall back to an exact scan, which only happens under extreme overload).
pub const DEFAULT_LEVELS: usize = 1024;
/// Candidate lists at most this long are always scanned exactly (cheaper than sampling).
const SMALL_SCAN: usize = 16;
/// Rejection sampling is skipped when fewer than 1 in this many eligible workers sit at the
/// minimum level (the expected number of tries would approach a scan).
const MAX_SAMPLE_RATIO: usize = 16;
/// Upper bound on sampling tries before the exact scan.
const MAX_TRIES: usize = 64;

/// An atomic alone on its cache line: the level counters and hints are written by every core.
#[repr(align(64))]
#[derive(Default)]
struct Padded<T>(T);

/// Per-worker loads (own in-flight + external) plus the aggregate structure that makes min/max and
/// least-loaded picks cheap. Slots are `WorkerId`s (dense, `< capacity`).
/// All methods take `&self` and are safe to call from any core concurrently.
///
/// Contract with the registry: a worker that is removed must be made ineligible
/// (`set_eligible(w, false)`), otherwise it stays in the aggregates.
pub struct LoadBoard {
    slots: Box<[AtomicU64]>,
    levels: Box<[Padded<AtomicI32>]>,
    /// Index of the top level (`levels.len() - 1`).
    top: u32,
    eligible: Padded<AtomicI32>,
    min_hint: Padded<AtomicU32>,
    max_hint: Padded<AtomicU32>,
}

impl std::fmt::Debug for LoadBoard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadBoard")
            .field("capacity", &self.capacity())
            .field("eligible", &self.eligible_count())
            .field("min_max", &self.min_max())
            .finish()
    }
}

/// The load a slot word stands for: own in-flight + external (saturating).
#[inline]
fn load_of(word: u64) -> u32 {
    let total = (word & OWN_MASK) + ((word & EXT_MASK) >> EXT_SHIFT);
    total.min(u32::MAX as u64) as u32
}

/// This copy's own in-flight count in a slot word.
#[inline]
fn own_of(word: u64) -> u32 {
    (word & OWN_MASK) as u32
}

/// The external load in a slot word.
#[inline]
fn ext_of(word: u64) -> u32 {
    ((word & EXT_MASK) >> EXT_SHIFT) as u32
}

#[inline]
fn is_elig(word: u64) -> bool {
    word & ELIGIBLE != 0
}

impl LoadBoard {
    /// `capacity`: the largest WorkerId + 1 that will ever be used.
    pub fn new(capacity: usize) -> Self {
        Self::with_levels(capacity, DEFAULT_LEVELS)
    }

    /// A board with `levels` distinct load levels (at least 2): loads `>= levels - 1` share the
    /// top level. Small values exist for tests of the saturated path.
    pub fn with_levels(capacity: usize, levels: usize) -> Self {
        let levels = levels.clamp(2, MAX_LEVELS);
        LoadBoard {
            slots: (0..capacity).map(|_| AtomicU64::new(0)).collect(),
            levels: (0..levels).map(|_| Padded(AtomicI32::new(0))).collect(),
            top: (levels - 1) as u32,
            eligible: Padded(AtomicI32::new(0)),
            min_hint: Padded(AtomicU32::new(0)),
            max_hint: Padded(AtomicU32::new(0)),
        }
    }

    /// Number of slots (every valid `WorkerId` is below it).
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    #[inline]
    fn word(&self, w: WorkerId) -> u64 {
        self.slots.get(w as usize).map_or(0, |s| s.load(Relaxed))
    }

    #[inline]
    fn level(&self, load: u32) -> u32 {
        load.min(self.top)
    }

    #[inline]
    fn level_count(&self, l: u32) -> i32 {
        self.levels[l as usize].0.load(SeqCst)
    }

    /// Writers widen the min hint after publishing a worker at level `l`.
    #[inline]
    fn widen_min(&self, l: u32) {
        if self.min_hint.0.load(SeqCst) > l {
            self.min_hint.0.fetch_min(l, SeqCst);
        }
    }

    /// Writers widen the max hint after publishing a worker at level `l`.
    #[inline]
    fn widen_max(&self, l: u32) {
        if self.max_hint.0.load(SeqCst) < l {
            self.max_hint.0.fetch_max(l, SeqCst);
        }
    }

    /// An eligible worker's load went from `from` to `to`: move it between levels.
    #[inline]
    fn move_level(&self, from: u32, to: u32) {
        let (from, to) = (self.level(from), self.level(to));
        if from == to {
            return;
        }
        // Add first, then remove: a concurrent reader sees the worker twice rather than nowhere.
        self.levels[to as usize].0.fetch_add(1, SeqCst);
        self.levels[from as usize].0.fetch_sub(1, SeqCst);
        if to > from {
            self.widen_max(to);
        } else {
            self.widen_min(to);
        }
    }

    /// Make a worker selectable (healthy, circuit not open) or not. Ineligible workers keep their
    /// counts but leave every aggregate and every pick.
    pub fn set_eligible(&self, w: WorkerId, eligible: bool) {
        let Some(slot) = self.slots.get(w as usize) else {
            debug_assert!(false, "worker {w} out of LoadBoard capacity");
            return;
        };
        if eligible {
            let prev = slot.fetch_or(ELIGIBLE, Relaxed);
            if !is_elig(prev) {
                let l = self.level(load_of(prev));
                self.levels[l as usize].0.fetch_add(1, SeqCst);
                self.eligible.0.fetch_add(1, SeqCst);
                self.widen_min(l);
                self.widen_max(l);
            }
        } else {
            let prev = slot.fetch_and(!ELIGIBLE, Relaxed);
            if is_elig(prev) {
                let l = self.level(load_of(prev));
                self.levels[l as usize].0.fetch_sub(1, SeqCst);
                self.eligible.0.fetch_sub(1, SeqCst);
            }
        }
    }

    /// Whether `w` is currently selectable (false for ids beyond capacity).
    pub fn is_eligible(&self, w: WorkerId) -> bool {
        is_elig(self.word(w))
    }

    /// A request starts on `w`.
    pub fn inc(&self, w: WorkerId) {
        let Some(slot) = self.slots.get(w as usize) else {
            debug_assert!(false, "worker {w} out of LoadBoard capacity");
            return;
        };
        // 2^32 concurrent requests on one worker cannot happen, so the count never carries into
        // the external bits.
        let prev = slot.fetch_add(1, Relaxed);
        if is_elig(prev) {
            self.move_level(load_of(prev), load_of(prev + 1));
        }
    }

    /// A request on `w` ended (any outcome). A `dec` without a matching `inc` is ignored rather
    /// than wrapping the counter.
    pub fn dec(&self, w: WorkerId) {
        let Some(slot) = self.slots.get(w as usize) else {
            debug_assert!(false, "worker {w} out of LoadBoard capacity");
            return;
        };
        let res = slot.fetch_update(Relaxed, Relaxed, |s| {
            if own_of(s) == 0 {
                None
            } else {
                Some(s - 1)
            }
        });
        match res {
            Ok(prev) if is_elig(prev) => {
                self.move_level(load_of(prev), load_of(prev - 1));
            }
            Ok(_) => {}
            Err(_) => debug_assert!(false, "dec without inc on worker {w}"),
        }
    }

    /// Set the load on `w` that this gateway copy did not send (the engine's running + queued
    /// requests minus this copy's own in-flight, from the telemetry thread). The worker moves
    /// between levels in one step, as with `inc`/`dec`, so min/max and least-loaded picks see
    /// it at once; `n` above [`MAX_EXTERNAL`] is clamped.
    pub fn set_external(&self, w: WorkerId, n: u32) {
        let Some(slot) = self.slots.get(w as usize) else {
            debug_assert!(false, "worker {w} out of LoadBoard capacity");
            return;
        };
        let ext = u64::from(n.min(MAX_EXTERNAL)) << EXT_SHIFT;
        let with = |s: u64| (s & !EXT_MASK) | ext;
        // The closure never refuses, so both arms carry the previous word.
        let prev = match slot.fetch_update(Relaxed, Relaxed, |s| Some(with(s))) {
            Ok(p) | Err(p) => p,
        };
        if is_elig(prev) {
            self.move_level(load_of(prev), load_of(with(prev)));
        }
    }

    /// Routing load of `w`: own in-flight + external (0 for ids beyond capacity). Every
    /// aggregate and pick of the board uses this number.
    pub fn load(&self, w: WorkerId) -> u32 {
        load_of(self.word(w))
    }

    /// Requests this gateway copy has in flight on `w` (the `smg_worker_requests_active` gauge).
    pub fn in_flight(&self, w: WorkerId) -> u32 {
        own_of(self.word(w))
    }

    /// The external part of `w`'s load (see [`set_external`](Self::set_external)).
    pub fn external(&self, w: WorkerId) -> u32 {
        ext_of(self.word(w))
    }

    /// Number of eligible workers.
    pub fn eligible_count(&self) -> usize {
        self.eligible.0.load(SeqCst).max(0) as usize
    }

    /// Lowest non-empty level, narrowing the hint. `None`: no level looks occupied (no eligible
    /// worker, or a transient inconsistency; callers then fall back to exact scans).
    fn min_level(&self) -> Option<u32> {
        if self.eligible_count() == 0 {
            return None;
        }
        let h = self.min_hint.0.load(SeqCst).min(self.top);
        if let Some(m) = (h..=self.top).find(|&l| self.level_count(l) > 0) {
            if m > h
                && self
                    .min_hint
                    .0
                    .compare_exchange(h, m, SeqCst, SeqCst)
                    .is_ok()
            {
                // A writer may have published a worker below `m` after we scanned past it and
                // skipped widening because it still saw `h`: re-check and widen back.
                if let Some(l) = (h..m).find(|&l| self.level_count(l) > 0) {
                    self.widen_min(l);
                    return Some(l);
                }
            }
            return Some(m);
        }
        // The hint was above every occupied level (a writer has not widened it yet).
        let l = (0..h).find(|&l| self.level_count(l) > 0)?;
        self.widen_min(l);
        Some(l)
    }

    /// Highest non-empty level, narrowing the hint (mirror of `min_level`).
    fn max_level(&self) -> Option<u32> {
        if self.eligible_count() == 0 {
            return None;
        }
        let h = self.max_hint.0.load(SeqCst).min(self.top);
        if let Some(m) = (0..=h).rev().find(|&l| self.level_count(l) > 0) {
            if m < h
                && self
                    .max_hint
                    .0
                    .compare_exchange(h, m, SeqCst, SeqCst)
                    .is_ok()
            {
                if let Some(l) = (m + 1..=h).rev().find(|&l| self.level_count(l) > 0) {
                    self.widen_max(l);
                    return Some(l);
                }
            }
            return Some(m);
        }
        let l = (h + 1..=self.top)
            .rev()
            .find(|&l| self.level_count(l) > 0)?;
        self.widen_max(l);
        Some(l)
    }

    /// Exact (min, max) over eligible slots by a full pass; the fallback when levels saturate.
    fn exact_min_max(&self) -> Option<(u32, u32)> {
        let mut out: Option<(u32, u32)> = None;
        for s in self.slots.iter() {
            let word = s.load(Relaxed);
            if is_elig(word) {
                let l = load_of(word);
                out = Some(match out {
                    None => (l, l),
                    Some((lo, hi)) => (lo.min(l), hi.max(l)),
                });
            }
        }
        out
    }

    /// (min, max) load over eligible workers; `None` when none is eligible.
    /// O(max − min) level reads in the common case; a full pass only while some eligible worker
    /// has `>= levels − 1` requests in flight (or the levels look momentarily empty).
    pub fn min_max(&self) -> Option<(u32, u32)> {
        if self.eligible_count() == 0 {
            return None;
        }
        match (self.min_level(), self.max_level()) {
            (Some(lo), Some(hi)) if lo < self.top && hi < self.top => Some((lo, hi.max(lo))),
            _ => self.exact_min_max(),
        }
    }

    /// Sum of loads over eligible workers (bounded-load hashing needs the average).
    /// Computed from the levels between min and max; exact pass when levels saturate.
    pub fn eligible_load_sum(&self) -> u64 {
        if self.eligible_count() == 0 {
            return 0;
        }
        match (self.min_level(), self.max_level()) {
            (Some(lo), Some(hi)) if hi < self.top => (lo..=hi)
                .map(|l| l as u64 * self.level_count(l).max(0) as u64)
                .sum(),
            _ => self
                .slots
                .iter()
                .map(|s| s.load(Relaxed))
                .filter(|&w| is_elig(w))
                .map(|w| load_of(w) as u64)
                .sum(),
        }
    }

    /// Whether `w` is eligible and not in `exclude`.
    #[inline]
    pub fn selectable(&self, w: WorkerId, exclude: &[WorkerId]) -> bool {
        self.is_eligible(w) && !exclude.contains(&w)
    }

    /// Rejection-sampling budget when about `at_target` of the `eligible` workers qualify.
    /// `0` means "scan instead" (sampling would cost about as much as a pass).
    #[inline]
    fn sample_budget(at_target: usize, eligible: usize) -> usize {
        if at_target == 0 || eligible == 0 {
            return 0;
        }
        let ratio = eligible.div_ceil(at_target);
        if ratio > MAX_SAMPLE_RATIO {
            return 0;
        }
        // Miss probability per try is about 1 − 1/ratio; 3 + 4·ratio tries leave a fallback
        // chance of roughly e^-4 (≈2%) at worst, far less for the usual small ratios.
        (3 + 4 * ratio).min(MAX_TRIES)
    }

    /// Uniform random among the least loaded eligible, non-excluded workers of `candidates`
    /// (the registered list, or any subset such as the holders of a prefix).
    pub fn pick_least_loaded(
        &self,
        candidates: &[WorkerId],
        exclude: &[WorkerId],
        rng: &mut Rng,
    ) -> Option<WorkerId> {
        self.pick_least_loaded_where(candidates, rng, |w| !exclude.contains(&w))
    }

    /// `pick_least_loaded` with an arbitrary extra filter (`allow(w)` must be cheap and pure).
    pub fn pick_least_loaded_where(
        &self,
        candidates: &[WorkerId],
        rng: &mut Rng,
        allow: impl Fn(WorkerId) -> bool,
    ) -> Option<WorkerId> {
        let n = candidates.len();
        if n == 0 {
            return None;
        }
        if n > SMALL_SCAN {
            if let Some(min) = self.min_level().filter(|&m| m < self.top) {
                let at_min = self.level_count(min).max(0) as usize;
                let tries = Self::sample_budget(at_min, self.eligible_count());
                for _ in 0..tries {
                    let w = candidates[rng.below(n)];
                    let word = self.word(w);
                    // Accepting only load == global min is exact: nobody eligible is below it, so
                    // every accepted worker is among the least loaded of any subset holding it.
                    if is_elig(word) && load_of(word) == min && allow(w) {
                        return Some(w);
                    }
                }
            }
        }
        self.exact_least(candidates, rng, &allow)
    }

    /// Two passes: find the minimum and the number of ties, then take a random tie.
    fn exact_least(
        &self,
        candidates: &[WorkerId],
        rng: &mut Rng,
        allow: &impl Fn(WorkerId) -> bool,
    ) -> Option<WorkerId> {
        let mut min = u32::MAX;
        let mut ties = 0usize;
        let mut first = None;
        for &w in candidates {
            let word = self.word(w);
            if !is_elig(word) || !allow(w) {
                continue;
            }
            let l = load_of(word);
            if l < min {
                min = l;
                ties = 1;
                first = Some(w);
            } else if l == min {
                ties += 1;
            }
        }
        let first = first?;
        if ties == 1 {
            return Some(first);
        }
        let mut k = rng.below(ties);
        for &w in candidates {
            let word = self.word(w);
            if is_elig(word) && load_of(word) == min && allow(w) {
                if k == 0 {
                    return Some(w);
                }
                k -= 1;
            }
        }
        // Loads moved between the passes; the first minimum seen is still a fine answer.
        Some(first)
    }

    /// Uniform random eligible, non-excluded worker of `candidates`.
    pub fn pick_random_eligible(
        &self,
        candidates: &[WorkerId],
        exclude: &[WorkerId],
        rng: &mut Rng,
    ) -> Option<WorkerId> {
        self.pick_random_where(candidates, rng, |w| !exclude.contains(&w))
    }

    /// `pick_random_eligible` with an arbitrary extra filter.
    pub fn pick_random_where(
        &self,
        candidates: &[WorkerId],
        rng: &mut Rng,
        allow: impl Fn(WorkerId) -> bool,
    ) -> Option<WorkerId> {
        let n = candidates.len();
        if n == 0 {
            return None;
        }
        // About min(n, eligible) of the n candidates qualify; with a healthy fleet the first
        // try succeeds, whatever the fleet size.
        let tries = Self::sample_budget(self.eligible_count().min(n), n);
        for _ in 0..tries {
            let w = candidates[rng.below(n)];
            if self.is_eligible(w) && allow(w) {
                return Some(w);
            }
        }
        let ok = |w: WorkerId| self.is_eligible(w) && allow(w);
        let count = candidates.iter().filter(|&&w| ok(w)).count();
        if count == 0 {
            return None;
        }
        let k = rng.below(count);
        candidates
            .iter()
            .copied()
            .filter(|&w| ok(w))
            .nth(k)
            // Eligibility changed between the passes: take any that qualifies now.
            .or_else(|| candidates.iter().copied().find(|&w| ok(w)))
    }

    /// Test support: level counts and eligible count recomputed from the slots must equal the
    /// maintained ones (only meaningful when the board is quiescent).
    #[cfg(test)]
    fn check_quiescent(&self) {
        let mut levels = vec![0i32; self.levels.len()];
        let mut eligible = 0;
        for s in self.slots.iter() {
            let w = s.load(SeqCst);
            if is_elig(w) {
                levels[self.level(load_of(w)) as usize] += 1;
                eligible += 1;
            }
        }
        let got: Vec<i32> = self.levels.iter().map(|l| l.0.load(SeqCst)).collect();
        assert_eq!(got, levels, "level counts");
        assert_eq!(self.eligible.0.load(SeqCst), eligible, "eligible count");
    }
}

#[cfg(test)]
mod tests;

/// Test helpers shared by the policy tests.
#[cfg(test)]
pub mod tests_support {
    use super::LoadBoard;
    use crate::base::WorkerId;

    /// `n` eligible workers with ids `0..n`, all idle.
    pub fn board(n: u32) -> (Vec<WorkerId>, LoadBoard) {
        let b = LoadBoard::new(n as usize);
        for w in 0..n {
            b.set_eligible(w, true);
        }
        ((0..n).collect(), b)
    }
}
