//! Whether a worker can take another request now, from what its engine last said (queued
//! requests, KV-cache use) and what this gateway sent it since.
//!
//! The engine's figures arrive once per telemetry round (every `--saturation-poll-ms` with
//! `--saturation-admission`), and SGLang sets them only when it forms a batch (and at every
//! 40th decode step), so each is as old as the engine's last step. Between two of them, the
//! requests this copy started on the worker count as queued there: all of them when the engine
//! was queuing, else those past one prefill step of prompt tokens (`chunk_tokens`), which its
//! next step takes; and their prompt tokens count as KV in use (the worker's capacity in
//! tokens read off the same exposition: `sglang:num_used_tokens` over `sglang:token_usage`).
//! A busy engine that repeats its figures formed no batch since, so the counts go on from the
//! earlier reading. A burst, or a few long prompts, cannot pour through the gap between
//! readings.
//!
//! A worker without a reading (never read yet, or its readings failed for a few rounds in a
//! row) is not given unlimited room on a guess: it counts as saturated once this copy has more
//! requests in flight on it than its fair share, the mean over its side's eligible workers
//! (rounded up). It then takes about as much as the others do, while a fleet that cannot be
//! read at all is never saturated as a whole (the least loaded worker is never above the mean):
//! admission fails open there rather than hold traffic on nothing.
//!
//! A worker that answered backpressure (429, or SGLang's 503 "The request queue is full.") is
//! saturated for every class from then until a reading from a later telemetry round, whatever
//! its last figures said: the engine said so itself.

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
    /// Prompt tokens an engine with an empty queue takes into one prefill step (SGLang's
    /// `--chunked-prefill-size`); requests sent past that since the last reading count as
    /// queued.
    pub chunk_tokens: u64,
}

impl Thresholds {
    /// The engine queue at which a request of `class` counts a worker as saturated: with
    /// headroom, classes of priority 0 or below stop one request earlier, so a prioritized
    /// request finds at most that many ahead of it in an engine that serves first come, first
    /// served, and seldom waits in the gateway.
    pub fn queue_for(&self, class: Priority) -> u32 {
        if class > 0 || self.headroom <= 0.0 {
            self.queue_reqs
        } else {
            self.queue_reqs.saturating_sub(1).max(1)
        }
    }

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
    /// Requests this copy has sent the worker, ever (only grows).
    started: AtomicU64,
    /// `started` when the reading came.
    started_then: AtomicU64,
    /// The engine's used KV tokens at the reading (0: not given), to tell a new figure from a
    /// repeated one.
    used: AtomicU64,
    /// The worker answered backpressure: the first telemetry round whose reading clears it
    /// (0: no backpressure pending).
    pushed_back: AtomicU64,
}

const NEVER_READ: u32 = u32::MAX;

impl Reading {
    /// A slot never read.
    fn unread() -> Reading {
        Reading {
            queued: AtomicU32::new(NEVER_READ),
            usage: AtomicU32::new(0),
            own_then: AtomicU32::new(0),
            sent_then: AtomicU64::new(0),
            capacity: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            started: AtomicU64::new(0),
            started_then: AtomicU64::new(0),
            used: AtomicU64::new(0),
            pushed_back: AtomicU64::new(0),
        }
    }

    /// What this copy sent since the reading is counted from here on, with `own_now` of its
    /// requests in flight.
    fn count_from_now(&self, own_now: u32) {
        self.sent_then.store(self.sent.load(Relaxed), Relaxed);
        self.started_then.store(self.started.load(Relaxed), Relaxed);
        self.own_then.store(own_now, Relaxed);
    }

    /// Prompt tokens and requests this copy started on the worker since the reading.
    fn started_since(&self) -> (u64, u64) {
        let grown = |total: &AtomicU64, then: &AtomicU64| {
            total.load(Relaxed).saturating_sub(then.load(Relaxed))
        };
        (
            grown(&self.sent, &self.sent_then),
            grown(&self.started, &self.started_then),
        )
    }
}

/// The last reading of every worker slot, shared by the telemetry thread (writer) and the
/// serving cores (readers).
#[derive(Debug)]
pub struct Saturation {
    readings: Box<[Reading]>,
    thresholds: Thresholds,
    /// The telemetry round under way (see [`Saturation::begin_round`]).
    round: AtomicU64,
}

impl Saturation {
    /// Room for `slots` worker ids, none read yet.
    pub fn new(slots: usize, thresholds: Thresholds) -> Saturation {
        Saturation {
            readings: (0..slots).map(|_| Reading::unread()).collect(),
            thresholds,
            round: AtomicU64::new(0),
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
            let used = used.filter(|t| t.is_finite() && *t >= 0.0);
            // Capacity from the two figures of one reading; a reading that cannot tell (an
            // empty cache, a missing sample) keeps the last one learnt.
            if let Some(used) = used.filter(|t| *t >= 1.0) {
                if u >= 0.001 {
                    r.capacity.store((used / u).min(1e15) as u64, Relaxed);
                }
            }
            let usage = (u * 1000.0).round() as u32;
            let used = used.unwrap_or(0.0) as u64;
            // SGLang sets these gauges when it forms a batch (and every 40th decode step), so
            // a busy engine that repeats its figures has formed no batch since: what this copy
            // sent after the earlier reading is still not in them and keeps counting. (An idle
            // engine, no KV in use, repeats its zeros for good: it starts over.)
            let repeated = usage > 0
                && r.queued.load(Relaxed) == q
                && r.usage.load(Relaxed) == usage
                && r.used.load(Relaxed) == used;
            if !repeated {
                r.count_from_now(own_now);
            }
            r.used.store(used, Relaxed);
            r.usage.store(usage, Relaxed);
            r.queued.store(q, Relaxed);
        }
    }

    /// The telemetry thread starts a round of readings: returns its number (from 1), which
    /// [`Saturation::settle`] is given for each worker the round reads (or fails to read).
    pub fn begin_round(&self) -> u64 {
        self.round.fetch_add(1, Relaxed) + 1
    }

    /// Worker `w` answered backpressure: saturated until a round that starts after now has
    /// read it (a reading already under way may predate the answer).
    pub fn push_back(&self, w: WorkerId) {
        if let Some(r) = self.readings.get(w as usize) {
            r.pushed_back.store(self.round.load(Relaxed) + 1, Relaxed);
        }
    }

    /// Round `round` read worker `w`, or failed to: a backpressure mark from before the round
    /// began is over (a worker that cannot be read then goes by the fair-share rule).
    pub fn settle(&self, w: WorkerId, round: u64) {
        if let Some(r) = self.readings.get(w as usize) {
            let _ = r
                .pushed_back
                .fetch_update(Relaxed, Relaxed, |m| (m != 0 && round >= m).then_some(0));
        }
    }

    /// This copy sent worker `w` a request of `tokens` prompt tokens.
    pub fn sent(&self, w: WorkerId, tokens: u64) {
        if let Some(r) = self.readings.get(w as usize) {
            r.sent.fetch_add(tokens, Relaxed);
            r.started.fetch_add(1, Relaxed);
        }
    }

    /// Worker `w` left or was replaced: its next owner starts unread.
    pub fn forget(&self, w: WorkerId) {
        if let Some(r) = self.readings.get(w as usize) {
            r.queued.store(NEVER_READ, Relaxed);
            r.usage.store(0, Relaxed);
            r.capacity.store(0, Relaxed);
            r.used.store(0, Relaxed);
            r.pushed_back.store(0, Relaxed);
            r.count_from_now(0);
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
        let (tokens_since, started_since) = r.started_since();
        let usage = f64::from(r.usage.load(Relaxed)) / 1000.0;
        let added = if capacity > 0 {
            tokens_since as f64 / capacity as f64
        } else {
            0.0
        };
        // Behind an engine that was queuing at the reading every request started since
        // waits. One with an empty queue takes a prefill step's worth of them at its next
        // step: counting all of a fast worker's closed-loop clients as a queue would throttle
        // an unloaded fleet (at 64 connections to one instant worker: 955 req/s instead of
        // 55k), while long prompts past the step do wait.
        let queued_now = if queued > 0 {
            queued.saturating_add(since)
        } else {
            since.saturating_sub(fits_one_step(
                started_since,
                tokens_since,
                self.thresholds.chunk_tokens,
            ))
        };
        Some((queued_now, (usage + added).min(1.0)))
    }

    /// Whether worker `w` is saturated for a request of `class`, with `own_now` of this
    /// copy's requests on it: it answered backpressure since its last reading, or its reading
    /// says so, or, without a reading, `own_now` is above `fair_share()` (this copy's mean
    /// in flight per eligible worker of its side; asked only for a worker without a reading).
    pub fn is_saturated(
        &self,
        w: WorkerId,
        own_now: u32,
        class: Priority,
        fair_share: impl FnOnce() -> u32,
    ) -> bool {
        if self
            .readings
            .get(w as usize)
            .is_some_and(|r| r.pushed_back.load(Relaxed) != 0)
        {
            return true;
        }
        match self.estimate(w, own_now) {
            Some((q, u)) => saturated(q, u, self.thresholds, class),
            None => own_now > fair_share(),
        }
    }
}

/// The fair share of one worker among workers with `in_flight` requests each: their mean,
/// rounded up (0 without workers). A worker without a reading above it counts as saturated.
pub fn fair_share(in_flight: impl Iterator<Item = u32>) -> u32 {
    let (sum, n) = in_flight.fold((0u64, 0u64), |(s, n), f| (s + u64::from(f), n + 1));
    if n == 0 {
        return 0;
    }
    u32::try_from(sum.div_ceil(n)).unwrap_or(u32::MAX)
}

/// How many of `started` requests of `tokens` prompt tokens in all an engine with an empty
/// queue takes into its next prefill step of `chunk` tokens: at least one, and all of them when
/// their prompts are short. The queue gauge (SGLang sets it when it forms a batch) is as old
/// as the engine's last step, so what came after it is only known to this copy.
fn fits_one_step(started: u64, tokens: u64, chunk: u64) -> u32 {
    if started == 0 || tokens == 0 {
        return u32::MAX;
    }
    let mean = tokens.div_ceil(started).max(1);
    u32::try_from((chunk / mean).max(1)).unwrap_or(u32::MAX)
}

/// The rule itself: a queue at the threshold, or KV use at the threshold of `class`.
pub fn saturated(queued: u32, usage: f64, t: Thresholds, class: Priority) -> bool {
    queued >= t.queue_for(class) || usage >= t.kv_for(class)
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Thresholds = Thresholds {
        queue_reqs: 2,
        kv_usage: 0.9,
        headroom: 0.0,
        chunk_tokens: 8192,
    };

    #[test]
    fn a_worker_without_a_reading_takes_no_more_than_its_fair_share() {
        let s = Saturation::new(4, T);
        assert_eq!(s.estimate(1, 100), None);
        // Never read: room up to the mean of its side, not without end.
        assert!(!s.is_saturated(1, 5, 0, || 5), "at its fair share");
        assert!(s.is_saturated(1, 6, 0, || 5), "past it");
        assert!(s.is_saturated(1, 100, 0, || 0), "100 in flight on a guess");
        assert!(!s.is_saturated(99, 0, 0, || 0), "an id outside the table");
        // A reading replaces the rule; forgetting it (stale readings) brings it back.
        s.record(1, 0.0, 0.1, None, 100);
        assert!(!s.is_saturated(1, 100, 0, || 0));
        s.forget(1);
        assert!(s.is_saturated(1, 100, 0, || 0));
        // The share is the mean, rounded up: a fleet nobody can read is never all saturated.
        assert_eq!(fair_share([3, 0, 0].into_iter()), 1);
        assert_eq!(fair_share([4, 4, 4].into_iter()), 4);
        assert_eq!(fair_share(std::iter::empty()), 0);
        let loads = [7u32, 2, 3];
        let fair = fair_share(loads.into_iter());
        assert!(loads.iter().any(|&l| !s.is_saturated(2, l, 0, || fair)));
    }

    #[test]
    fn backpressure_saturates_until_a_later_round_reads_the_worker() {
        let s = Saturation::new(4, T);
        s.record(1, 0.0, 0.1, None, 0);
        let round = s.begin_round();
        s.push_back(1);
        for class in [-1, 0, 5] {
            assert!(s.is_saturated(1, 0, class, || 0), "class {class}");
        }
        // The round under way may have read the worker before its answer: no news.
        s.settle(1, round);
        s.record(1, 0.0, 0.1, None, 0);
        assert!(s.is_saturated(1, 0, 0, || 0));
        // The next round's reading (or failed reading) ends it.
        let next = s.begin_round();
        s.settle(1, next);
        assert!(!s.is_saturated(1, 0, 0, || 0));
        // Also for a worker never read, which then goes by its fair share.
        s.push_back(2);
        assert!(s.is_saturated(2, 0, 0, || 10));
        s.settle(2, s.begin_round());
        assert!(!s.is_saturated(2, 0, 0, || 10));
        s.push_back(3);
        s.forget(3);
        assert!(
            !s.is_saturated(3, 0, 0, || 10),
            "a replaced worker starts afresh"
        );
    }

    #[test]
    fn requests_sent_since_the_reading_count_as_queued() {
        let s = Saturation::new(4, T);
        // An engine with an empty queue had room: what this copy started since is running.
        s.record(1, 0.0, 0.5, None, 10);
        assert_eq!(s.estimate(1, 10), Some((0, 0.5)));
        assert!(
            !s.is_saturated(1, 50, 0, || 0),
            "closed-loop clients of a fast worker"
        );
        // An engine that was queuing: each request started since waits behind it.
        s.record(1, 1.0, 0.5, None, 10);
        assert_eq!(s.estimate(1, 10), Some((1, 0.5)));
        assert!(
            s.is_saturated(1, 11, 0, || 0),
            "one started since the reading"
        );
        assert!(
            !s.is_saturated(1, 3, 0, || 0),
            "finished ones do not count below the reading"
        );
        // The same figures again: the engine formed no batch since, so the one started after
        // the first reading still waits.
        s.record(1, 1.0, 0.5, None, 11);
        assert!(
            s.is_saturated(1, 11, 0, || 0),
            "a repeated reading is no news"
        );
        s.record(1, 1.0, 0.6, None, 12);
        assert!(
            !s.is_saturated(1, 12, 0, || 0),
            "the new reading says one waits"
        );
        assert!(s.is_saturated(1, 13, 0, || 0));
        // A busy engine without a queue that repeats its figures formed no batch either: the
        // long prompts sent since go on counting past one step's worth.
        s.record(1, 0.0, 0.6, None, 12);
        s.sent(1, 6_000);
        s.sent(1, 6_000);
        s.record(1, 0.0, 0.6, None, 14);
        assert_eq!(s.estimate(1, 14), Some((1, 0.6)));
        // An idle engine repeats its zeros for good: each reading starts over.
        s.record(1, 0.0, 0.0, None, 0);
        s.sent(1, 6_000);
        s.sent(1, 6_000);
        s.record(1, 0.0, 0.0, None, 2);
        assert_eq!(s.estimate(1, 2), Some((0, 0.0)));
    }

    #[test]
    fn past_one_prefill_step_of_prompt_tokens_requests_count_as_queued_behind_an_empty_queue() {
        let s = Saturation::new(4, T);
        // The reading saw no queue: the engine's next step takes up to 8,192 prompt tokens of
        // what comes after it, and the rest waits for the step after.
        s.record(1, 0.0, 0.5, None, 10);
        for n in 1..=3u32 {
            s.sent(1, 6_000);
            let want = n.saturating_sub(1);
            assert_eq!(s.estimate(1, 10 + n), Some((want, 0.5)), "{n} long prompts");
        }
        assert!(s.is_saturated(1, 13, 0, || 0), "three 6k prompts: two wait");
        // Requests that finished meanwhile are not waiting: the estimate goes by the net.
        assert!(!s.is_saturated(1, 11, 0, || 0));
        // Short prompts: a whole step's worth fits, as with a fast worker's clients. (Each
        // reading below brings new figures: a repeated one would keep the counts going.)
        s.record(1, 0.0, 0.51, None, 10);
        for _ in 0..300 {
            s.sent(1, 20);
        }
        assert_eq!(
            s.estimate(1, 60),
            Some((0, 0.51)),
            "50 more in flight, 6,000 tokens"
        );
        s.record(1, 0.0, 0.52, None, 10);
        for _ in 0..100 {
            s.sent(1, 200);
        }
        // 40 of 200 tokens fit a step: 60 more in flight leave 20 waiting.
        assert_eq!(s.estimate(1, 70), Some((20, 0.52)));
        // A new reading starts over.
        s.record(1, 0.0, 0.53, None, 70);
        assert_eq!(s.estimate(1, 70), Some((0, 0.53)));
    }

    #[test]
    fn kv_use_alone_saturates_and_bad_figures_are_clamped() {
        let s = Saturation::new(4, T);
        s.record(2, 0.0, 0.95, None, 0);
        assert!(s.is_saturated(2, 0, 0, || 0));
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
        assert!(!s.is_saturated(1, 1, 0, || 0));
        s.sent(1, 6_000);
        assert!(
            s.is_saturated(1, 1, 0, || 0),
            "51,000 tokens since: past 0.9"
        );
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
        assert!(s.is_saturated(1, 0, 0, || 0), "class 0 stops at 0.8");
        assert!(
            s.is_saturated(1, 0, -1, || 0),
            "and so does a sheddable one"
        );
        assert!(
            !s.is_saturated(1, 0, 1, || 0),
            "a prioritized class goes on to 0.9"
        );
        s.record(1, 0.0, 0.9, None, 0);
        assert!(s.is_saturated(1, 0, 5, || 0));
        // The queue threshold is the same for every class.
        s.record(1, 2.0, 0.1, None, 0);
        assert!(s.is_saturated(1, 0, 5, || 0));
    }
}
