//! Ratios of two counters' increases over a sliding window, as Prometheus's
//! `rate(a[5m]) / rate(b[5m])` would compute them: the achieved cache hit ratio of a worker
//! (`sglang:cached_tokens_total` over `sglang:prompt_tokens_total`) and the gateway's predicted
//! one. Pure: the telemetry thread feeds it one reading per scrape.
//!
//! Counter resets: a worker that restarts starts its counters from zero again. A reading below
//! the previous one (either counter) is taken as a reset, and the new reading counts whole as
//! the increase since it (what Prometheus's `rate` does). A restart that climbs past the old
//! value before the next scrape cannot be told from steady growth, by us or by Prometheus.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// How far back a ratio looks (the README's `rate(...[5m])`).
pub const WINDOW: Duration = Duration::from_secs(300);
/// Readings kept per counter pair: with short scrape intervals the window is shorter
/// (`MAX_SAMPLES − 1` intervals), so memory stays bounded per worker.
pub const MAX_SAMPLES: usize = 64;

/// Increases of a pair of counters (`hits` of `total`) over a sliding window.
#[derive(Debug, Default, Clone)]
pub struct RatioWindow {
    /// The last raw reading, to compute the next increase (`None` before the first).
    last: Option<(f64, f64)>,
    /// Increases summed since the first reading (reset-corrected), so two samples' difference
    /// is the increase between them.
    sum: (f64, f64),
    /// (when, sum) at each reading, oldest first.
    samples: VecDeque<(Instant, (f64, f64))>,
}

impl RatioWindow {
    /// Record a reading of both counters taken at `now`. The first reading is a baseline only:
    /// what the counters held before the gateway saw them does not count.
    pub fn observe(&mut self, now: Instant, hits: f64, total: f64) {
        if !(hits.is_finite() && total.is_finite()) {
            return;
        }
        if let Some((h0, t0)) = self.last {
            let (dh, dt) = if hits < h0 || total < t0 {
                (hits, total) // the worker restarted: its counters began again at zero
            } else {
                (hits - h0, total - t0)
            };
            self.sum.0 += dh.max(0.0);
            self.sum.1 += dt.max(0.0);
        }
        self.last = Some((hits, total));
        self.samples.push_back((now, self.sum));
        // Keep one sample at or before the window's start as the base of the increase.
        while self.samples.len() > MAX_SAMPLES
            || (self.samples.len() > 1
                && self
                    .samples
                    .get(1)
                    .is_some_and(|(t, _)| now.saturating_duration_since(*t) >= WINDOW))
        {
            self.samples.pop_front();
        }
    }

    /// (hits, total) increases within the window.
    pub fn increase(&self) -> (f64, f64) {
        match (self.samples.front(), self.samples.back()) {
            (Some((_, a)), Some((_, b))) => ((b.0 - a.0).max(0.0), (b.1 - a.1).max(0.0)),
            _ => (0.0, 0.0),
        }
    }

    /// hits / total increases within the window, in [0, 1]; 0 when `total` did not grow.
    pub fn ratio(&self) -> f64 {
        let (h, t) = self.increase();
        ratio(h, t)
    }
}

/// `hits / total` clamped to [0, 1]; 0 when `total` is not positive.
pub fn ratio(hits: f64, total: f64) -> f64 {
    if total > 0.0 {
        (hits / total).clamp(0.0, 1.0)
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(base: Instant, secs: u64) -> Instant {
        base + Duration::from_secs(secs)
    }

    #[test]
    fn the_first_reading_is_a_baseline() {
        let t = Instant::now();
        let mut w = RatioWindow::default();
        w.observe(t, 900.0, 1000.0);
        assert_eq!(w.increase(), (0.0, 0.0));
        assert_eq!(w.ratio(), 0.0);
        w.observe(at(t, 5), 930.0, 1100.0);
        assert_eq!(w.increase(), (30.0, 100.0));
        assert!((w.ratio() - 0.3).abs() < 1e-12);
    }

    #[test]
    fn a_counter_reset_counts_the_new_reading_whole() {
        let t = Instant::now();
        let mut w = RatioWindow::default();
        w.observe(t, 50.0, 100.0);
        w.observe(at(t, 5), 80.0, 200.0); // +30 / +100
        w.observe(at(t, 10), 10.0, 20.0); // restarted: +10 / +20
        w.observe(at(t, 15), 30.0, 60.0); // +20 / +40
        assert_eq!(w.increase(), (60.0, 160.0));
        // Only one counter going back is a reset too (never a negative increase).
        w.observe(at(t, 20), 35.0, 5.0);
        let (h, tot) = w.increase();
        assert_eq!((h, tot), (95.0, 165.0));
        assert!((0.0..=1.0).contains(&w.ratio()));
    }

    #[test]
    fn old_increases_leave_the_window() {
        let t = Instant::now();
        let mut w = RatioWindow::default();
        w.observe(t, 0.0, 0.0);
        w.observe(at(t, 10), 100.0, 100.0); // all hits, long ago
        let mut now = 10;
        let mut tot = 100.0;
        while now < 10 + WINDOW.as_secs() + 20 {
            now += 5;
            tot += 100.0; // misses only from here on
            w.observe(at(t, now), 100.0, tot);
        }
        assert_eq!(w.ratio(), 0.0, "the early hits are out of the window");
        assert!(w.samples.len() <= MAX_SAMPLES);
    }

    #[test]
    fn sample_count_is_bounded_with_short_intervals() {
        let t = Instant::now();
        let mut w = RatioWindow::default();
        for i in 0..1000u64 {
            w.observe(t + Duration::from_millis(i * 100), i as f64, 2.0 * i as f64);
        }
        assert_eq!(w.samples.len(), MAX_SAMPLES);
        assert!((w.ratio() - 0.5).abs() < 1e-12);
    }

    #[test]
    fn non_finite_readings_are_ignored() {
        let t = Instant::now();
        let mut w = RatioWindow::default();
        w.observe(t, 0.0, 0.0);
        w.observe(at(t, 1), f64::NAN, 10.0);
        w.observe(at(t, 2), 5.0, f64::INFINITY);
        w.observe(at(t, 3), 5.0, 10.0);
        assert_eq!(w.increase(), (5.0, 10.0));
    }
}
