//! Pacing an aggregate rate in small time slices, pure: how many blocks are due by now.

/// Emits `rate` units per second from `start_ns`: [`Pacer::due`] says how many are owed at a
/// given time; a sender more than `max_lag_s` behind forgets the excess (counted as
/// [`Pacer::skipped`]), so a saturated fleet reports its achieved rate instead of bursting.
#[derive(Debug, Clone)]
pub struct Pacer {
    rate: f64,
    start_ns: u64,
    emitted: u64,
    skipped: u64,
    max_lag_s: f64,
}

impl Pacer {
    /// A pacer of `rate` per second from `start_ns`.
    pub fn new(rate: f64, start_ns: u64, max_lag_s: f64) -> Self {
        Pacer {
            rate: rate.max(0.0),
            start_ns,
            emitted: 0,
            skipped: 0,
            max_lag_s,
        }
    }

    /// Units owed at `now_ns` (0 before the start).
    pub fn due(&mut self, now_ns: u64) -> u64 {
        let elapsed = now_ns.saturating_sub(self.start_ns) as f64 / 1e9;
        let target = (self.rate * elapsed) as u64;
        let owed = target.saturating_sub(self.emitted + self.skipped);
        let max_owed = (self.rate * self.max_lag_s).max(1.0) as u64;
        if owed > max_owed {
            self.skipped += owed - max_owed;
            return max_owed;
        }
        owed
    }

    /// `n` units were sent (may exceed what was due: a request's blocks come whole).
    pub fn sent(&mut self, n: u64) {
        self.emitted += n;
    }

    /// Units sent so far.
    pub fn emitted(&self) -> u64 {
        self.emitted
    }

    /// Units given up because the sender fell more than the allowed lag behind.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owes_the_rate_times_the_elapsed_time() {
        let mut p = Pacer::new(1000.0, 1_000_000_000, 1.0);
        assert_eq!(p.due(0), 0, "nothing before the start");
        assert_eq!(p.due(1_001_000_000), 1, "1 ms at 1000/s");
        p.sent(1);
        assert_eq!(p.due(1_001_000_000), 0);
        assert_eq!(p.due(1_010_000_000), 9);
        // Over-sending (a whole request) is paid back by owing less later.
        p.sent(20);
        assert_eq!(p.due(1_015_000_000), 0);
        assert_eq!(p.due(1_030_000_000), 9);
    }

    #[test]
    fn a_sender_far_behind_skips_the_excess() {
        let mut p = Pacer::new(1000.0, 0, 0.1);
        assert_eq!(p.due(10_000_000_000), 100, "at most 0.1 s of the rate owed");
        assert_eq!(p.skipped(), 9_900);
        p.sent(100);
        assert_eq!(p.due(10_000_000_000), 0);
        assert_eq!(p.due(10_001_000_000), 1);
    }

    #[test]
    fn zero_rate_owes_nothing() {
        let mut p = Pacer::new(0.0, 0, 1.0);
        assert_eq!(p.due(5_000_000_000), 0);
    }
}
