//! In-flight request counts per worker, shared by every core, answering "least loaded" and
//! "min/max load" without a pass over all workers (the reference's O(workers) selection is what
//! collapses at thousands of workers).
use crate::tree::WorkerId;

/// Per-worker in-flight counters plus the aggregate structure that makes min/max and
/// least-loaded picks cheap. Slots are `WorkerId`s (dense, `< capacity`).
/// All methods take `&self` and are safe to call from any core concurrently.
pub struct LoadBoard {}

impl LoadBoard {
    /// `capacity`: the largest WorkerId + 1 that will ever be used.
    pub fn new(capacity: usize) -> Self {
        let _ = capacity;
        todo!()
    }
    pub fn capacity(&self) -> usize {
        todo!()
    }
    /// Make a worker selectable (healthy, circuit not open) or not. Ineligible workers keep their
    /// counts but leave every aggregate and every pick.
    pub fn set_eligible(&self, w: WorkerId, eligible: bool) {
        let _ = (w, eligible);
        todo!()
    }
    pub fn is_eligible(&self, w: WorkerId) -> bool {
        let _ = w;
        todo!()
    }
    /// A request starts on `w`.
    pub fn inc(&self, w: WorkerId) {
        let _ = w;
        todo!()
    }
    /// A request on `w` ended (any outcome).
    pub fn dec(&self, w: WorkerId) {
        let _ = w;
        todo!()
    }
    pub fn load(&self, w: WorkerId) -> u32 {
        let _ = w;
        todo!()
    }
    /// Number of eligible workers.
    pub fn eligible_count(&self) -> usize {
        todo!()
    }
    /// (min, max) in-flight over eligible workers; `None` when none is eligible.
    pub fn min_max(&self) -> Option<(u32, u32)> {
        todo!()
    }
}
