//! Whether a worker can take another request now, from what its engine last said (queued
//! requests, KV-cache use) and what this gateway sent it since.
//!
//! The engine's figures arrive once per telemetry round (every `--saturation-poll-ms` with
//! `--saturation-admission`); between two readings every request this copy started on the
//! worker counts as queued there when the engine was queuing at the reading, and its prompt
//! tokens as KV in use (the worker's capacity in
//! tokens read off the same exposition: `sglang:num_used_tokens` over `sglang:token_usage`),
//! so a burst, or a few long prompts, cannot pour through the gap between readings. A worker
//! never read is not saturated: admission fails open rather than hold traffic on a guess.

use super::queue::Priority;
use crate::base::WorkerId;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};

/// When a worker counts as saturated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    /// Requests waiting in the engine's own queue (`sglang:num_queue_reqs`) at which it is
    /// saturated: a longer engine queue only adds to everyone's time to first token, while
    /// the gateway's queue can still reorder by priority and tenant.
    pub queue_reqs: u32,
    /// KV-cache use (`sglang:token_usage`, 0..1) at which it is saturated.
    pub kv_usage: f64,
    /// KV share kept for prioritized requests (class above 0): the others see the worker
    /// saturated this much earlier, so a batch flood cannot fill the KV an interactive class
    /// needs to start at once.
    pub headroom: f64,
}

impl Thresholds {
    /// The KV use at which a request of `class` counts a worker as saturated.
    pub fn kv_for(&self, class: Priority) -> f64 {
        if class > 0 {
            self.kv_usage
        } else {
            (self.kv_usage - self.headroom).max(0.0)
        }
    }
}

/// What a reading said; [`NEVER_READ`] in `queued` until the first.
#[derive(Debug)]
struct Reading {
    queued: AtomicU32,
    /// KV use in thousandths.
    usage: AtomicU32,
    /// This copy's in-flight requests on the worker when the reading came.
    own_then: AtomicU32,
    /// Prompt tokens this copy had sent the worker (ever) when the reading came.
    sent_then: AtomicU64,
    /// The worker's KV capacity in tokens (0: unknown, no token estimate).
    capacity: AtomicU64,
    /// Prompt tokens this copy has sent the worker, ever (only grows).
    sent: AtomicU64,
}

const NEVER_READ: u32 = u32::MAX;

/// The last reading of every worker slot, shared by the telemetry thread (writer) and the
/// serving cores (readers).
#[derive(Debug)]
pub struct Saturation {
    readings: Box<[Reading]>,
    thresholds: Thresholds,
}

impl Saturation {
    /// Room for `slots` worker ids, none read yet.
    pub fn new(slots: usize, thresholds: Thresholds) -> Saturation {
        Saturation {
            readings: (0..slots)
                .map(|_| Reading {
                    queued: AtomicU32::new(NEVER_READ),
                    usage: AtomicU32::new(0),
                    own_then: AtomicU32::new(0),
                    sent_then: AtomicU64::new(0),
                    capacity: AtomicU64::new(0),
                    sent: AtomicU64::new(0),
                })
                .collect(),
            thresholds,
        }
    }

    /// The thresholds in force.
    pub fn thresholds(&self) -> Thresholds {
        self.thresholds
    }

    /// Worker `w`'s engine reported `queued` waiting requests and KV use `usage` (and, when
    /// the exposition has it, `used` tokens in its KV cache) while this copy had `own_now`
    /// requests in flight on it.
    pub fn record(&self, w: WorkerId, queued: f64, usage: f64, used: Option<f64>, own_now: u32) {
        if let Some(r) = self.readings.get(w as usize) {
            let q = if queued.is_finite() && queued > 0.0 {
                queued.min(f64::from(NEVER_READ - 1)) as u32
            } else {
                0
            };
            let u = if usage.is_finite() {
                usage.clamp(0.0, 1.0)
            } else {
                0.0
            };
            // Capacity from the two figures of one reading; a reading that cannot tell (an
            // empty cache, a missing sample) keeps the last one learnt.
            if let Some(used) = used.filter(|t| t.is_finite() && *t >= 1.0) {
                if u >= 0.001 {
                    r.capacity.store((used / u).min(1e15) as u64, Relaxed);
                }
            }
            r.sent_then.store(r.sent.load(Relaxed), Relaxed);
            r.own_then.store(own_now, Relaxed);
            r.usage.store((u * 1000.0).round() as u32, Relaxed);
            r.queued.store(q, Relaxed);
        }
    }

    /// This copy sent worker `w` a request of `tokens` prompt tokens.
    pub fn sent(&self, w: WorkerId, tokens: u64) {
        if let Some(r) = self.readings.get(w as usize) {
            r.sent.fetch_add(tokens, Relaxed);
        }
    }

    /// Worker `w` left or was replaced: its next owner starts unread.
    pub fn forget(&self, w: WorkerId) {
        if let Some(r) = self.readings.get(w as usize) {
            r.queued.store(NEVER_READ, Relaxed);
            r.usage.store(0, Relaxed);
            r.own_then.store(0, Relaxed);
            r.capacity.store(0, Relaxed);
            r.sent_then.store(r.sent.load(Relaxed), Relaxed);
        }
    }

    /// Worker `w`'s estimated engine queue and KV use now (None: never read), with `own_now`
    /// of this copy's requests in flight on it: the reading, plus the requests started since
    /// as queued and their prompt tokens as KV in use.
    pub fn estimate(&self, w: WorkerId, own_now: u32) -> Option<(u32, f64)> {
        let r = self.readings.get(w as usize)?;
        let queued = r.queued.load(Relaxed);
        if queued == NEVER_READ {
            return None;
        }
        let since = own_now.saturating_sub(r.own_then.load(Relaxed));
        let capacity = r.capacity.load(Relaxed);
        let tokens_since = r
            .sent
            .load(Relaxed)
            .saturating_sub(r.sent_then.load(Relaxed));
        let usage = f64::from(r.usage.load(Relaxed)) / 1000.0;
        let added = if capacity > 0 {
            tokens_since as f64 / capacity as f64
        } else {
            0.0
        };
        // Requests started since count as queued only behind an engine that was queuing at
        // the reading: one with an empty queue had room in its running batch, and counting a
        // fast worker's closed-loop clients as a queue would throttle an unloaded fleet (at 64
        // connections to one instant worker: 955 req/s instead of 55k). A burst of long
        // prompts onto an engine with room is still held back by the token estimate.
        let queued_now = if queued > 0 {
            queued.saturating_add(since)
        } else {
            0
        };
        Some((queued_now, (usage + added).min(1.0)))
    }

    /// Whether worker `w` is saturated for a request of `class`, with `own_now` of this
    /// copy's requests on it.
    pub fn is_saturated(&self, w: WorkerId, own_now: u32, class: Priority) -> bool {
        self.estimate(w, own_now)
            .is_some_and(|(q, u)| saturated(q, u, self.thresholds, class))
    }
}

/// The rule itself: a queue at the threshold, or KV use at the threshold of `class`.
pub fn saturated(queued: u32, usage: f64, t: Thresholds, class: Priority) -> bool {
    queued >= t.queue_reqs || usage >= t.kv_for(class)
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Thresholds = Thresholds {
        queue_reqs: 2,
        kv_usage: 0.9,
        headroom: 0.0,
    };

    #[test]
    fn a_worker_never_read_is_not_saturated() {
        let s = Saturation::new(4, T);
        assert_eq!(s.estimate(1, 100), None);
        assert!(!s.is_saturated(1, 100, 0));
        assert!(!s.is_saturated(99, 0, 0), "an id outside the table");
    }

    #[test]
    fn requests_sent_since_the_reading_count_as_queued() {
        let s = Saturation::new(4, T);
        // An engine with an empty queue had room: what this copy started since is running.
        s.record(1, 0.0, 0.5, None, 10);
        assert_eq!(s.estimate(1, 10), Some((0, 0.5)));
        assert!(
            !s.is_saturated(1, 50, 0),
            "closed-loop clients of a fast worker"
        );
        // An engine that was queuing: each request started since waits behind it.
        s.record(1, 1.0, 0.5, None, 10);
        assert_eq!(s.estimate(1, 10), Some((1, 0.5)));
        assert!(s.is_saturated(1, 11, 0), "one started since the reading");
        assert!(
            !s.is_saturated(1, 3, 0),
            "finished ones do not count below the reading"
        );
        s.record(1, 1.0, 0.5, None, 12);
        assert!(!s.is_saturated(1, 12, 0), "the new reading says one waits");
        assert!(s.is_saturated(1, 13, 0));
    }

    #[test]
    fn kv_use_alone_saturates_and_bad_figures_are_clamped() {
        let s = Saturation::new(4, T);
        s.record(2, 0.0, 0.95, None, 0);
        assert!(s.is_saturated(2, 0, 0));
        s.record(2, f64::NAN, f64::INFINITY, None, 0);
        assert_eq!(s.estimate(2, 0), Some((0, 0.0)));
        s.record(2, 1e12, 7.0, None, 0);
        assert_eq!(s.estimate(2, 0), Some((NEVER_READ - 1, 1.0)));
        s.forget(2);
        assert_eq!(s.estimate(2, 0), None);
    }

    #[test]
    fn prompt_tokens_sent_since_the_reading_count_as_kv_in_use() {
        let s = Saturation::new(4, T);
        // 40,000 tokens used at 0.4: a capacity of 100,000.
        s.record(1, 0.0, 0.4, Some(40_000.0), 0);
        assert_eq!(s.estimate(1, 0), Some((0, 0.4)));
        s.sent(1, 45_000);
        let (_, u) = s.estimate(1, 1).unwrap();
        assert!((u - 0.85).abs() < 1e-9, "{u}");
        assert!(!s.is_saturated(1, 1, 0));
        s.sent(1, 6_000);
        assert!(s.is_saturated(1, 1, 0), "51,000 tokens since: past 0.9");
        // The next reading has them in the engine's own figure; those sent before it no
        // longer count twice.
        s.record(1, 0.0, 0.5, Some(50_000.0), 1);
        assert_eq!(s.estimate(1, 1), Some((0, 0.5)));
        // A reading that cannot tell the capacity keeps the last one learnt.
        s.record(1, 0.0, 0.0, Some(0.0), 1);
        s.sent(1, 50_000);
        assert_eq!(s.estimate(1, 1), Some((0, 0.5)));
        // Without the used-tokens figure there is no token estimate at all.
        let s = Saturation::new(4, T);
        s.record(2, 0.0, 0.4, None, 0);
        s.sent(2, 1_000_000);
        assert_eq!(s.estimate(2, 0), Some((0, 0.4)));
    }

    #[test]
    fn headroom_keeps_kv_for_prioritized_classes_only() {
        let t = Thresholds { headroom: 0.1, ..T };
        let s = Saturation::new(4, t);
        s.record(1, 0.0, 0.85, None, 0);
        assert!(s.is_saturated(1, 0, 0), "class 0 stops at 0.8");
        assert!(s.is_saturated(1, 0, -1), "and so does a sheddable one");
        assert!(
            !s.is_saturated(1, 0, 1),
            "a prioritized class goes on to 0.9"
        );
        s.record(1, 0.0, 0.9, None, 0);
        assert!(s.is_saturated(1, 0, 5));
        // The queue threshold is the same for every class.
        s.record(1, 2.0, 0.1, None, 0);
        assert!(s.is_saturated(1, 0, 5));
    }
}
