//! Admission control, off by default: at most `--max-concurrent-requests` requests at once,
//! up to `--queue-size` more waiting (each for at most `--queue-timeout-secs`, then 408), and
//! beyond that an immediate 429; optionally a token bucket of `--rate-limit-tokens-per-second`.
//! Waiters poll (a cross-core wake-up would need a shared reactor); the poll is 2 ms.

use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Queue full → 429.
    QueueFull,
    /// Waited too long → 408.
    Timeout,
}

struct Bucket {
    tokens: f64,
    capacity: f64,
    rate: f64,
    last: Instant,
}

impl Bucket {
    fn try_take(&mut self, now: Instant) -> bool {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + dt * self.rate).min(self.capacity);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Shared by every core.
pub struct Admission {
    limit: i64,
    in_flight: AtomicI64,
    waiting: AtomicU32,
    queue_size: u32,
    queue_timeout: Duration,
    bucket: Option<Mutex<Bucket>>,
}

/// A granted slot; released on drop.
pub struct Permit<'a> {
    owner: Option<&'a Admission>,
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if let Some(a) = self.owner {
            a.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Admission {
    /// `limit < 0`: no concurrency limit. `rate`: tokens per second (None: no bucket unless a
    /// limit is set, then `limit` per second).
    pub fn new(
        limit: i64,
        queue_size: u32,
        queue_timeout: Duration,
        rate: Option<u64>,
    ) -> Admission {
        let rate = rate
            .or((limit > 0).then_some(limit as u64))
            .filter(|r| *r > 0);
        Admission {
            limit,
            in_flight: AtomicI64::new(0),
            waiting: AtomicU32::new(0),
            queue_size,
            queue_timeout,
            bucket: rate.map(|r| {
                let cap = std::cmp::max(r, limit.max(1) as u64) as f64;
                Mutex::new(Bucket {
                    tokens: cap,
                    capacity: cap,
                    rate: r as f64,
                    last: Instant::now(),
                })
            }),
        }
    }

    /// Whether admission is a no-op.
    pub fn is_unlimited(&self) -> bool {
        self.limit < 0 && self.bucket.is_none()
    }

    fn try_admit(&self) -> bool {
        if self.limit >= 0 {
            let prev = self.in_flight.fetch_add(1, Ordering::AcqRel);
            if prev >= self.limit {
                self.in_flight.fetch_sub(1, Ordering::AcqRel);
                return false;
            }
        }
        if let Some(b) = &self.bucket {
            let ok = b
                .lock()
                .map(|mut g| g.try_take(Instant::now()))
                .unwrap_or(true);
            if !ok {
                if self.limit >= 0 {
                    self.in_flight.fetch_sub(1, Ordering::AcqRel);
                }
                return false;
            }
        }
        true
    }

    /// Wait for a slot (or refuse).
    pub async fn acquire(&self) -> Result<Permit<'_>, Refusal> {
        if self.is_unlimited() {
            return Ok(Permit { owner: None });
        }
        let owner = (self.limit >= 0).then_some(self);
        if self.try_admit() {
            return Ok(Permit { owner });
        }
        let queued = self.waiting.fetch_add(1, Ordering::AcqRel);
        if queued >= self.queue_size {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(Refusal::QueueFull);
        }
        let until = Instant::now() + self.queue_timeout;
        let result = loop {
            monoio::time::sleep(Duration::from_millis(2)).await;
            if self.try_admit() {
                break Ok(Permit { owner });
            }
            if Instant::now() >= until {
                break Err(Refusal::Timeout);
            }
        };
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        result
    }

    /// Requests holding a slot.
    pub fn in_flight(&self) -> i64 {
        self.in_flight.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        monoio::RuntimeBuilder::<monoio::LegacyDriver>::new()
            .enable_timer()
            .build()
            .expect("runtime")
            .block_on(f)
    }

    #[test]
    fn limit_queue_and_timeout() {
        let a = Admission::new(1, 1, Duration::from_millis(50), Some(1_000_000));
        block_on(async {
            let p1 = a.acquire().await.expect("first admitted");
            assert_eq!(a.in_flight(), 1);
            // One may wait; it times out because p1 is held.
            let t0 = Instant::now();
            assert_eq!(a.acquire().await.err(), Some(Refusal::Timeout));
            assert!(t0.elapsed() >= Duration::from_millis(50));
            drop(p1);
            assert!(a.acquire().await.is_ok());
        });
    }

    #[test]
    fn full_queue_is_refused_at_once() {
        let a = Admission::new(0, 0, Duration::from_secs(10), Some(1_000_000));
        block_on(async {
            assert_eq!(a.acquire().await.err(), Some(Refusal::QueueFull));
        });
    }

    #[test]
    fn token_bucket_limits_rate() {
        let mut b = Bucket {
            tokens: 2.0,
            capacity: 2.0,
            rate: 10.0,
            last: Instant::now(),
        };
        let now = b.last;
        assert!(b.try_take(now));
        assert!(b.try_take(now));
        assert!(!b.try_take(now));
        assert!(b.try_take(now + Duration::from_millis(150)));
    }

    #[test]
    fn unlimited_is_free() {
        let a = Admission::new(-1, 100, Duration::from_secs(1), None);
        assert!(a.is_unlimited());
    }
}
