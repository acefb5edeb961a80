//! The consistent-hash ring `consistent_hashing` and `prefix_hash` place keys on, and the
//! stable hash (`hash64`) they and `manual`'s key shards use. A ring exists so that a key lands
//! on the same worker every time and adding a worker moves only ~1/(N+1) of the keys.
//!
//! The ring is rebuilt on the admin path (`RingCell::rebuild`) and published through `ArcSwap`,
//! so a lookup only does an atomic load, a binary search and a short clockwise walk.
use crate::base::WorkerId;
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

#[cfg(test)]
mod tests;
