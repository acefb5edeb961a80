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

/// Seconds a worker's `Retry-After` asks for: delta-seconds only (SGLang and most servers send
/// no date); anything else is no request to wait.
pub fn retry_after_secs(value: &[u8]) -> Option<u32> {
    let v = std::str::from_utf8(value).ok()?.trim();
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(v.parse::<u32>().unwrap_or(u32::MAX))
}

impl RetryPolicy {
    /// The wait before retry number `n` (see [`RetryPolicy::delay_ms`]) when the failed worker
    /// asked for `asked` seconds (`Retry-After`, counted only when the retry has to go back to
    /// a worker that asked): the longer of the two, or `None` when the worker's wait is past
    /// the longest the policy waits (give up and answer now).
    pub fn wait_ms(&self, n: u32, u: f64, asked: Option<u32>) -> Option<u64> {
        let delay = self.delay_ms(n, u);
        match asked {
            None => Some(delay),
            Some(s) => {
                let asked_ms = u64::from(s).saturating_mul(1000);
                (asked_ms <= self.max_ms).then_some(delay.max(asked_ms))
            }
        }
    }

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
    fn a_retry_after_is_waited_for_within_the_policy() {
        let p = RetryPolicy {
            max_attempts: 5,
            initial_ms: 50,
            multiplier: 1.5,
            max_ms: 30_000,
            jitter: 0.0,
        };
        assert_eq!(p.wait_ms(0, 0.5, None), Some(50));
        assert_eq!(p.wait_ms(0, 0.5, Some(0)), Some(50));
        assert_eq!(p.wait_ms(0, 0.5, Some(2)), Some(2_000));
        assert_eq!(p.wait_ms(0, 0.5, Some(30)), Some(30_000));
        assert_eq!(
            p.wait_ms(0, 0.5, Some(31)),
            None,
            "longer than the policy waits"
        );
        assert_eq!(p.wait_ms(0, 0.5, Some(u32::MAX)), None);
        assert_eq!(retry_after_secs(b" 3 "), Some(3));
        assert_eq!(retry_after_secs(b"0"), Some(0));
        assert_eq!(retry_after_secs(b"99999999999"), Some(u32::MAX));
        for bad in [
            &b""[..],
            b"-1",
            b"1.5",
            b"Wed, 21 Oct 2015 07:28:00 GMT",
            b"\xff",
        ] {
            assert_eq!(retry_after_secs(bad), None);
        }
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
