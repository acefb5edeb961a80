//! When and how long to wait before trying another worker. Pure: the jitter draw is passed in.

/// Retry settings (from the `--retry-*` flags).
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    /// Attempts in all, first included.
    pub max_attempts: u32,
    pub initial_ms: u64,
    pub multiplier: f64,
    pub max_ms: u64,
    /// ± fraction of the delay.
    pub jitter: f64,
}

/// Statuses worth another worker: timeouts, throttling and server-side failures.
pub fn is_retryable_status(status: u16) -> bool {
    matches!(status, 408 | 429 | 500 | 502 | 503 | 504)
}

impl RetryPolicy {
    /// Delay before retry number `n` (0 = the first retry): `min(initial · multiplier^n, max)`
    /// scaled by `1 + jitter · (2u − 1)` for a uniform `u` in [0, 1).
    pub fn delay_ms(&self, n: u32, u: f64) -> u64 {
        let base =
            (self.initial_ms as f64 * self.multiplier.powi(n as i32)).min(self.max_ms as f64);
        let spread = 1.0 + self.jitter * (2.0 * u.clamp(0.0, 1.0) - 1.0);
        (base * spread).max(0.0).round() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_follow_the_reference_schedule() {
        let p = RetryPolicy {
            max_attempts: 5,
            initial_ms: 50,
            multiplier: 1.5,
            max_ms: 30_000,
            jitter: 0.2,
        };
        let mid: Vec<u64> = (0..4).map(|n| p.delay_ms(n, 0.5)).collect();
        assert_eq!(mid, vec![50, 75, 113, 169]);
        assert_eq!(p.delay_ms(0, 0.0), 40);
        assert_eq!(p.delay_ms(0, 0.999_999), 60);
        assert_eq!(p.delay_ms(40, 0.5), 30_000);
    }

    #[test]
    fn retryable_statuses() {
        for s in [408, 429, 500, 502, 503, 504] {
            assert!(is_retryable_status(s));
        }
        for s in [200, 400, 401, 404, 413, 501] {
            assert!(!is_retryable_status(s));
        }
    }
}
