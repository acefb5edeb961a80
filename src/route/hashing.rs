//! Hash-ring policies: `consistent_hashing` (a request key such as a user or session id always
//! lands on the same worker, and adding a worker moves only ~1/(N+1) of the keys) and
//! `prefix_hash` (the prompt's first characters pick the worker, so shared prefixes meet their
//! KV cache without a tree, with a load bound so a hot prefix cannot swamp one worker).
//!
//! The ring is rebuilt on the admin path (`RingCell::rebuild`) and published through `ArcSwap`,
//! so `select` only does an atomic load, a binary search and a short clockwise walk.
use crate::base::rng::Rng;
use crate::base::text::prefix_chars;
use crate::base::WorkerId;
use crate::route::types::{Branch, Decision, RouteInput};
use crate::workers::load::LoadBoard;
use arc_swap::ArcSwap;
use std::sync::Arc;

/// Virtual nodes per worker (the reference's value): enough that each worker's share of the
/// ring is within a few percent of 1/N.
pub const VNODES: u32 = 150;

const K0: u64 = 0x9e37_79b9_7f4a_7c15;
const K1: u64 = 0xbf58_476d_1ce4_e5b9;
const K2: u64 = 0x94d0_49bb_1331_11eb;

/// 64×64→128-bit multiply folded back to 64 bits: the whole product influences every bit.
#[inline]
fn fold_mul(a: u64, b: u64) -> u64 {
    let r = (a as u128).wrapping_mul(b as u128);
    (r as u64) ^ ((r >> 64) as u64)
}

#[inline]
fn read_u64(b: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    let n = b.len().min(8);
    w[..n].copy_from_slice(&b[..n]);
    u64::from_le_bytes(w)
}

/// A fast, well-mixed, fixed-seed 64-bit hash (stable across processes and versions, unlike
/// `std`'s `RandomState`): 16 bytes per multiply-fold round, a final avalanche. Not meant to
/// resist adversarial collisions; a client choosing its key can pick its worker anyway.
pub fn hash64(bytes: &[u8]) -> u64 {
    let len = bytes.len() as u64;
    let mut h = K0 ^ len.wrapping_mul(K1);
    let mut chunks = bytes.chunks_exact(16);
    for c in &mut chunks {
        let (a, b) = c.split_at(8);
        h = (h ^ fold_mul(read_u64(a) ^ K1, read_u64(b) ^ K2))
            .rotate_left(29)
            .wrapping_mul(K0);
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let (a, b) = rest.split_at(rest.len().min(8));
        h = (h ^ fold_mul(read_u64(a) ^ K1, read_u64(b) ^ K2))
            .rotate_left(29)
            .wrapping_mul(K0);
    }
    // splitmix64-style finaliser.
    let mut z = h ^ len.rotate_left(32);
    z = (z ^ (z >> 30)).wrapping_mul(K1);
    z = (z ^ (z >> 27)).wrapping_mul(K2);
    z ^ (z >> 31)
}

/// A consistent-hash ring: `VNODES` points per worker, sorted by position. A worker's points
/// depend only on its id, so membership changes move only the keys of the workers involved.
#[derive(Debug, Default)]
pub struct Ring {
    points: Box<[(u64, WorkerId)]>,
    members: Box<[WorkerId]>,
}

impl Ring {
    /// Build the ring for `workers`, each placed by its id (admin path; 150 points per worker).
    pub fn build(workers: &[WorkerId]) -> Ring {
        let named: Vec<(WorkerId, [u8; 4])> =
            workers.iter().map(|&w| (w, w.to_le_bytes())).collect();
        let refs: Vec<(WorkerId, &[u8])> = named.iter().map(|(w, b)| (*w, &b[..])).collect();
        Ring::build_named(&refs)
    }

    /// Build the ring placing each worker by a stable name (its URL), so every gateway replica,
    /// and the same gateway after a restart, puts a key on the same worker whatever the order
    /// or ids of registration.
    pub fn build_named(workers: &[(WorkerId, &[u8])]) -> Ring {
        let mut points: Vec<(u64, WorkerId)> = Vec::with_capacity(workers.len() * VNODES as usize);
        let mut b = Vec::new();
        for &(w, name) in workers {
            for v in 0..VNODES {
                b.clear();
                b.extend_from_slice(name);
                b.push(b'#');
                b.extend_from_slice(&v.to_le_bytes());
                points.push((hash64(&b), w));
            }
        }
        points.sort_unstable();
        Ring {
            points: points.into(),
            members: workers.iter().map(|&(w, _)| w).collect(),
        }
    }

    /// Number of points on the ring.
    pub fn len(&self) -> usize {
        self.points.len()
    }

    /// Whether the ring has no worker.
    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }

    /// The workers the ring was built from.
    pub fn members(&self) -> &[WorkerId] {
        &self.members
    }

    /// The first worker clockwise from position `h` for which `accept` holds; at most one lap.
    pub fn lookup(&self, h: u64, accept: impl Fn(WorkerId) -> bool) -> Option<WorkerId> {
        let n = self.points.len();
        if n == 0 {
            return None;
        }
        let start = self.points.partition_point(|&(p, _)| p < h);
        let mut last = None;
        for i in 0..n {
            let w = self.points[(start + i) % n].1;
            // Consecutive points of one rejected worker need no second check.
            if last == Some(w) {
                continue;
            }
            if accept(w) {
                return Some(w);
            }
            last = Some(w);
        }
        None
    }
}

/// The published ring: rebuilt by the admin path, read lock-free by every core.
#[derive(Debug, Default)]
pub struct RingCell {
    ring: ArcSwap<Ring>,
}

impl RingCell {
    /// Rebuild for a new registered list (no-op when the list is unchanged).
    pub fn rebuild(&self, workers: &[WorkerId]) {
        if self.ring.load().members() == workers {
            return;
        }
        self.ring.store(Arc::new(Ring::build(workers)));
    }

    /// Rebuild for a new registered list of (id, stable name) (no-op when unchanged).
    pub fn rebuild_named(&self, workers: &[(WorkerId, &[u8])]) {
        if self
            .ring
            .load()
            .members()
            .iter()
            .copied()
            .eq(workers.iter().map(|&(w, _)| w))
        {
            return;
        }
        self.ring.store(Arc::new(Ring::build_named(workers)));
    }

    /// The current ring (hold the guard only for the lookup).
    pub fn load(&self) -> arc_swap::Guard<Arc<Ring>> {
        self.ring.load()
    }
}

/// Parse `X-SMG-Target-Worker` as a decimal index (ASCII digits, surrounding spaces allowed).
fn parse_index(v: &[u8]) -> Option<usize> {
    let v = v.trim_ascii();
    if v.is_empty() || v.len() > 9 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(
        v.iter()
            .fold(0usize, |acc, &d| acc * 10 + (d - b'0') as usize),
    )
}

/// consistent_hashing: a valid `X-SMG-Target-Worker` index into the eligible workers (in
/// registration order) wins unless that worker is excluded; otherwise `hash_key` on the ring,
/// walking past ineligible/excluded workers; with no key, a random eligible worker.
pub fn select_consistent(
    cell: &RingCell,
    input: &RouteInput,
    workers: &[WorkerId],
    loads: &LoadBoard,
    rng: &mut Rng,
) -> Option<Decision> {
    let exclude = input.exclude;
    if let Some(i) = input.target_worker.and_then(parse_index) {
        let target = workers
            .iter()
            .copied()
            .filter(|&w| loads.is_eligible(w))
            .nth(i);
        if let Some(w) = target.filter(|w| !exclude.contains(w)) {
            return Some(Decision::plain(w, Branch::TargetWorker));
        }
    }
    if let Some(key) = input.hash_key {
        let ring = cell.load();
        if let Some(w) = ring.lookup(hash64(key), |w| loads.selectable(w, exclude)) {
            return Some(Decision::plain(w, Branch::HashRing));
        }
    }
    loads
        .pick_random_eligible(workers, exclude, rng)
        .map(|w| Decision::plain(w, Branch::Random))
}

/// Bounded-load test for prefix_hash. With `S` the in-flight sum and `N` the number of eligible
/// workers, a worker is overloaded when `load > 1.25 × (S + 1) / N`: the `+ 1` counts the
/// request being placed, so an idle fleet never trips it, and a worker may exceed the average
/// by 25 % before its prefix traffic spills. Integer form: `4·load·N > 5·(S + 1)`.
pub fn overloaded(load: u32, sum: u64, eligible: usize) -> bool {
    4 * load as u128 * eligible as u128 > 5 * (sum as u128 + 1)
}

/// prefix_hash: hash the first `prefix_chars` characters onto the ring; if that worker is
/// overloaded (see [`overloaded`]), the least-loaded eligible, non-excluded worker instead.
pub fn select_prefix(
    cell: &RingCell,
    input: &RouteInput,
    prefix_chars_n: usize,
    workers: &[WorkerId],
    loads: &LoadBoard,
    rng: &mut Rng,
) -> Option<Decision> {
    let exclude = input.exclude;
    let h = hash64(prefix_chars(input.text, prefix_chars_n).as_bytes());
    let on_ring = cell.load().lookup(h, |w| loads.selectable(w, exclude));
    if let Some(w) = on_ring {
        if !overloaded(
            loads.load(w),
            loads.eligible_load_sum(),
            loads.eligible_count(),
        ) {
            return Some(Decision::plain(w, Branch::HashRing));
        }
    }
    // Overloaded, or no ring member acceptable (a stale or empty ring).
    loads
        .pick_least_loaded(workers, exclude, rng)
        .map(|w| Decision::plain(w, Branch::HashRingOverloaded))
}

#[cfg(test)]
mod tests;
