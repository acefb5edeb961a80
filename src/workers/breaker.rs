//! Per-worker circuit breaker. Opens after `--cb-failure-threshold` consecutive failures inside
//! `--cb-window-duration-secs` (failures further apart do not add up), stays open for
//! `--cb-timeout-duration-secs`, then half-opens and admits at most a few probe requests at a
//! time; `--cb-success-threshold` successes close it, any failure reopens it. Failures are 5xx,
//! connect errors and timeouts — never 4xx, which are the client's fault (the reference counts
//! them, so a burst of bad requests could open every circuit), and never backpressure (429 and
//! 503: an engine whose queue is full says "not now", not "broken"; counting it would open
//! every circuit of a busy fleet at once). Lock-free; `now` is passed in.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};

/// Breaker settings (from the `--cb-*` flags).
#[derive(Debug, Clone, Copy)]
pub struct BreakerConfig {
    pub enabled: bool,
    pub failure_threshold: u32,
    pub success_threshold: u32,
    pub open_ms: u64,
    pub window_ms: u64,
    /// Probe requests admitted at once while half-open.
    pub half_open_probes: u32,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            enabled: true,
            failure_threshold: 10,
            success_threshold: 3,
            open_ms: 60_000,
            window_ms: 120_000,
            half_open_probes: 3,
        }
    }
}

/// The three states (the `circuit` field of `GET /workers`, the `to` label of
/// `smg_worker_cb_transitions_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum BreakerState {
    Closed = 0,
    Open = 1,
    HalfOpen = 2,
}

impl BreakerState {
    /// Lower-case name for APIs and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }
}

/// What an outcome did to the breaker; the caller updates eligibility on transitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    None,
    Opened,
    HalfOpened,
    Closed,
}

/// One worker's breaker.
#[derive(Debug)]
pub struct Breaker {
    state: AtomicU8,
    failures: AtomicU32,
    successes: AtomicU32,
    last_failure_ms: AtomicU64,
    opened_at_ms: AtomicU64,
    probes: AtomicU32,
    /// Counts Open → HalfOpen moves, so a probe slot taken in one half-open period is never
    /// given back into the next one (whose count started again at zero).
    half_open_round: AtomicU32,
}

/// A request slot taken with [`Breaker::try_acquire`]. In half-open it holds one of the few
/// probe slots; hand it back with [`Breaker::release`] or [`Breaker::record`] (which consume
/// it, so a request can give its slot back and record its outcome at most once).
#[derive(Debug)]
#[must_use = "a probe slot that is dropped without release() stays taken"]
pub struct Ticket {
    /// The half-open round this probe slot belongs to; `None` when admitted while closed.
    probe_round: Option<u32>,
}

impl Default for Breaker {
    fn default() -> Self {
        Breaker {
            state: AtomicU8::new(BreakerState::Closed as u8),
            failures: AtomicU32::new(0),
            successes: AtomicU32::new(0),
            last_failure_ms: AtomicU64::new(0),
            opened_at_ms: AtomicU64::new(0),
            probes: AtomicU32::new(0),
            half_open_round: AtomicU32::new(0),
        }
    }
}

impl Breaker {
    /// Current state.
    pub fn state(&self) -> BreakerState {
        match self.state.load(Ordering::Acquire) {
            1 => BreakerState::Open,
            2 => BreakerState::HalfOpen,
            _ => BreakerState::Closed,
        }
    }

    /// Whether the worker belongs in the candidate set (open circuits leave it).
    pub fn admits(&self) -> bool {
        self.state() != BreakerState::Open
    }

    /// Take a request slot: always in Closed, one of `half_open_probes` in HalfOpen. The
    /// ticket must come back through `release` or `record` on every path.
    pub fn try_acquire(&self, cfg: &BreakerConfig) -> Option<Ticket> {
        match self.state() {
            BreakerState::Closed => Some(Ticket { probe_round: None }),
            BreakerState::Open => None,
            BreakerState::HalfOpen => {
                let round = self.half_open_round.load(Ordering::Acquire);
                let mut cur = self.probes.load(Ordering::Acquire);
                loop {
                    if cur >= cfg.half_open_probes {
                        return None;
                    }
                    match self.probes.compare_exchange_weak(
                        cur,
                        cur + 1,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    ) {
                        Ok(_) => {
                            return Some(Ticket {
                                probe_round: Some(round),
                            })
                        }
                        Err(v) => cur = v,
                    }
                }
            }
        }
    }

    /// Give a slot back without an outcome (the client left, the gateway failed locally): a
    /// probe slot of the current half-open round is free again for the next request.
    pub fn release(&self, ticket: Ticket) {
        if let Some(round) = ticket.probe_round {
            if self.state() == BreakerState::HalfOpen
                && self.half_open_round.load(Ordering::Acquire) == round
            {
                let _ = self
                    .probes
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| p.checked_sub(1));
            }
        }
    }

    /// Open → HalfOpen once the open period has passed (called by the periodic sweep).
    pub fn tick(&self, cfg: &BreakerConfig, now_ms: u64) -> Transition {
        if self.state() == BreakerState::Open
            && now_ms.saturating_sub(self.opened_at_ms.load(Ordering::Acquire)) >= cfg.open_ms
            && self
                .state
                .compare_exchange(
                    BreakerState::Open as u8,
                    BreakerState::HalfOpen as u8,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
        {
            self.half_open_round.fetch_add(1, Ordering::AcqRel);
            self.probes.store(0, Ordering::Release);
            self.successes.store(0, Ordering::Release);
            return Transition::HalfOpened;
        }
        Transition::None
    }

    /// Record a request's outcome (`success` = not a worker fault) and give its slot back.
    /// Only a request that took a probe slot frees one: an outcome never frees another's.
    pub fn record(
        &self,
        cfg: &BreakerConfig,
        ticket: Ticket,
        success: bool,
        now_ms: u64,
    ) -> Transition {
        self.release(ticket);
        if !cfg.enabled {
            return Transition::None;
        }
        let state = self.state();
        if success {
            self.failures.store(0, Ordering::Release);
            if state == BreakerState::HalfOpen {
                let s = self.successes.fetch_add(1, Ordering::AcqRel) + 1;
                if s >= cfg.success_threshold
                    && self
                        .state
                        .compare_exchange(
                            BreakerState::HalfOpen as u8,
                            BreakerState::Closed as u8,
                            Ordering::AcqRel,
                            Ordering::Acquire,
                        )
                        .is_ok()
                {
                    self.successes.store(0, Ordering::Release);
                    return Transition::Closed;
                }
            }
            return Transition::None;
        }
        match state {
            BreakerState::HalfOpen => {
                if self
                    .state
                    .compare_exchange(
                        BreakerState::HalfOpen as u8,
                        BreakerState::Open as u8,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    )
                    .is_ok()
                {
                    self.opened_at_ms.store(now_ms, Ordering::Release);
                    return Transition::Opened;
                }
                Transition::None
            }
            BreakerState::Open => Transition::None,
            BreakerState::Closed => {
                let last = self.last_failure_ms.swap(now_ms, Ordering::AcqRel);
                let run = if last != 0 && now_ms.saturating_sub(last) > cfg.window_ms {
                    self.failures.store(1, Ordering::Release);
                    1
                } else {
                    self.failures.fetch_add(1, Ordering::AcqRel) + 1
                };
                if run >= cfg.failure_threshold
                    && self
                        .state
                        .compare_exchange(
                            BreakerState::Closed as u8,
                            BreakerState::Open as u8,
                            Ordering::AcqRel,
                            Ordering::Acquire,
                        )
                        .is_ok()
                {
                    self.opened_at_ms.store(now_ms, Ordering::Release);
                    self.failures.store(0, Ordering::Release);
                    return Transition::Opened;
                }
                Transition::None
            }
        }
    }
}

/// Whether an upstream status is the worker's fault (counts against the breaker): a 5xx that
/// is not backpressure.
pub fn is_worker_failure(status: u16) -> bool {
    status >= 500 && !is_backpressure(status)
}

/// Whether an upstream status says the worker is too busy now (429, or 503 as SGLang answers
/// when its waiting queue is past `--max-queued-requests`): the request belongs on another
/// worker, and the worker is saturated until its next reading, but nothing is broken.
pub fn is_backpressure(status: u16) -> bool {
    matches!(status, 429 | 503)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Record an outcome for a request admitted while closed.
    fn out(b: &Breaker, c: &BreakerConfig, ok: bool, now: u64) -> Transition {
        let t = b.try_acquire(c).unwrap_or(Ticket { probe_round: None });
        b.record(c, t, ok, now)
    }

    fn cfg() -> BreakerConfig {
        BreakerConfig {
            enabled: true,
            failure_threshold: 3,
            success_threshold: 2,
            open_ms: 1000,
            window_ms: 500,
            half_open_probes: 1,
        }
    }

    #[test]
    fn opens_after_consecutive_failures_and_recovers_through_half_open() {
        let b = Breaker::default();
        let c = cfg();
        assert_eq!(out(&b, &c, false, 10), Transition::None);
        assert_eq!(out(&b, &c, false, 20), Transition::None);
        assert_eq!(out(&b, &c, false, 30), Transition::Opened);
        assert!(!b.admits());
        assert!(b.try_acquire(&c).is_none());
        assert_eq!(b.tick(&c, 500), Transition::None);
        assert_eq!(b.tick(&c, 1030), Transition::HalfOpened);
        let probe = b.try_acquire(&c).expect("a probe slot");
        assert!(
            b.try_acquire(&c).is_none(),
            "half-open admits a limited number of probes"
        );
        assert_eq!(b.record(&c, probe, true, 1100), Transition::None);
        let probe = b.try_acquire(&c).expect("the slot came back");
        assert_eq!(b.record(&c, probe, true, 1200), Transition::Closed);
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[test]
    fn a_success_resets_the_run_and_old_failures_fall_out_of_the_window() {
        let b = Breaker::default();
        let c = cfg();
        out(&b, &c, false, 10);
        out(&b, &c, false, 20);
        out(&b, &c, true, 30);
        out(&b, &c, false, 40);
        out(&b, &c, false, 50);
        assert_eq!(b.state(), BreakerState::Closed);
        // 2000 ms later: the earlier run is outside the 500 ms window.
        assert_eq!(out(&b, &c, false, 2050), Transition::None);
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[test]
    fn a_failed_probe_reopens() {
        let b = Breaker::default();
        let c = cfg();
        for t in 0..3 {
            out(&b, &c, false, t);
        }
        b.tick(&c, 2000);
        let probe = b.try_acquire(&c).expect("a probe slot");
        assert_eq!(b.record(&c, probe, false, 2001), Transition::Opened);
    }

    #[test]
    fn released_probes_free_their_slot_and_only_their_own() {
        let b = Breaker::default();
        let c = BreakerConfig {
            half_open_probes: 3,
            ..cfg()
        };
        let early = b.try_acquire(&c).expect("closed admits");
        for t in 0..3 {
            out(&b, &c, false, t);
        }
        b.tick(&c, 2000);
        // Three probes whose clients leave: each slot comes back, none stays wedged.
        for _ in 0..10 {
            let probes: Vec<Ticket> = (0..3).filter_map(|_| b.try_acquire(&c)).collect();
            assert_eq!(probes.len(), 3);
            assert!(b.try_acquire(&c).is_none());
            probes.into_iter().for_each(|p| b.release(p));
        }
        // A request admitted while closed frees no probe slot when it finishes now.
        let probes: Vec<Ticket> = (0..3).filter_map(|_| b.try_acquire(&c)).collect();
        b.release(early);
        assert!(b.try_acquire(&c).is_none());
        // A slot of an earlier half-open round is not given back into the next round.
        let mut old = probes.into_iter();
        let p = old.next().expect("three probes");
        assert_eq!(b.record(&c, p, false, 2100), Transition::Opened);
        b.tick(&c, 4000);
        let fresh: Vec<Ticket> = (0..3).filter_map(|_| b.try_acquire(&c)).collect();
        assert_eq!(fresh.len(), 3);
        old.for_each(|p| b.release(p));
        assert!(b.try_acquire(&c).is_none(), "old slots freed nothing");
        fresh.into_iter().for_each(|p| b.release(p));
    }

    #[test]
    fn client_errors_are_not_worker_failures() {
        assert!(!is_worker_failure(400));
        assert!(!is_worker_failure(429));
        assert!(is_worker_failure(500));
    }

    #[test]
    fn backpressure_is_not_a_worker_failure_but_other_5xx_are() {
        for s in [429, 503] {
            assert!(is_backpressure(s), "{s}");
            assert!(
                !is_worker_failure(s),
                "{s} must not count against the circuit"
            );
        }
        for s in [500, 501, 502, 504, 599] {
            assert!(!is_backpressure(s), "{s}");
            assert!(is_worker_failure(s), "{s} still counts");
        }
        // A flood of queue-full answers leaves the circuit closed.
        let b = Breaker::default();
        let c = cfg();
        for t in 0..50 {
            out(&b, &c, !is_worker_failure(503), t);
        }
        assert_eq!(b.state(), BreakerState::Closed);
        for t in 50..53 {
            out(&b, &c, !is_worker_failure(502), t);
        }
        assert_eq!(b.state(), BreakerState::Open, "502s still open it");
    }

    #[test]
    fn disabled_breaker_never_opens() {
        let b = Breaker::default();
        let c = BreakerConfig {
            enabled: false,
            ..cfg()
        };
        for t in 0..100 {
            out(&b, &c, false, t);
        }
        assert!(b.admits());
    }
}
