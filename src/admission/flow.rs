//! Flow control (`--saturation-admission`): a request goes straight to the workers while some
//! worker of its model can take it and nobody of its class or higher waits; otherwise it waits
//! in its model's room ([`WaitQueue`]) until a worker leaves saturation, and is then let in
//! onto it. Tenant limits (requests and tokens per minute) are checked first; sheddable classes
//! (below 0) are refused rather than queued when the room's expected wait passes their bound.
//!
//! Waiters live on every core; the rooms are one `Mutex` shared by all. One waiter per core
//! (the watcher, see `park`) looks at the rooms once per [`TICK`]: it lets in as many waiters as
//! there are workers with room (in the room's order, whichever core they wait on) and wakes the
//! waiters of its core that have a verdict; the others sleep until then, so a thousand waiters
//! cost what one does. An unsaturated fleet never takes the lock beyond one uncontended check
//! per request.

use super::fair::Fairness;
use super::queue::{Priority, Pushed, WaitQueue, Waiter};
use super::tenants::Tenants;
use super::TenantId;
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How often a waiter looks at the rooms.
pub const TICK: Duration = Duration::from_millis(1);
/// Window over which the rate the rooms drain at is measured (the expected-wait estimate).
const DRAIN_WINDOW: Duration = Duration::from_secs(10);
/// The shortest `Retry-After` given, in seconds.
const MIN_RETRY_AFTER: u32 = 1;

/// One model's fleet, as the admission sees it.
pub trait Fleet {
    /// How many workers of `room`'s model can take a request of `class` now (0: all
    /// saturated for it).
    fn room_for(&self, room: RoomKey, class: Priority) -> usize;
}

/// Which room a request waits in: its model's (the workers that can serve it).
pub type RoomKey = u64;

/// What a request asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    /// Its model's room.
    pub room: RoomKey,
    /// Its class, clamped to its tenant's maximum.
    pub class: Priority,
    /// Its tenant.
    pub tenant: TenantId,
    /// Its prompt tokens (or an estimate): charged to the tenant's share and token limit.
    pub tokens: u64,
    /// The generations it asks for (prompts of a batch times `n`): charged to the tenant's
    /// request limit.
    pub requests: u64,
}

/// Settings of the flow control.
#[derive(Debug, Clone, Copy)]
pub struct FlowConfig {
    /// Most requests waiting (over every room).
    pub queue_size: usize,
    /// Longest a request waits before 408.
    pub queue_timeout: Duration,
    /// A sheddable request (class below 0) is refused at once when the expected wait is
    /// longer than this.
    pub sheddable_wait: Duration,
}

/// Why a request was not let in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denied {
    /// The room is full of waiters of its class or higher (429).
    Full {
        /// Seconds after which trying again is sensible.
        retry_after: u32,
    },
    /// It waited and was pushed out by a higher class (429).
    Shed {
        /// Seconds after which trying again is sensible.
        retry_after: u32,
    },
    /// Sheddable, and the expected wait passes its bound (429).
    Overloaded {
        /// Seconds after which trying again is sensible.
        retry_after: u32,
    },
    /// Its tenant's requests or tokens per minute are used up (429).
    TenantLimit {
        /// Seconds until the tenant's limit has room again.
        retry_after: u32,
    },
    /// It asks for more requests or tokens than its tenant's whole per-minute limit (a limit
    /// of 0 allows none): it never fits, however long the client waits (429).
    OverTenantLimit,
    /// It waited `--queue-timeout-secs` (408).
    Timeout,
    /// The client left while it waited (nothing was sent upstream).
    ClientGone,
}

/// How a request was let in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Admitted {
    /// Straight through: some worker had room.
    Direct,
    /// After waiting this long; the saturated workers of its model must not be picked.
    Waited(Duration),
}

/// What a waiter finds when it looks for its verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// Let in (onto a worker of this room's fleet); not yet collected.
    Go(RoomKey),
    Shed,
}

/// Requests and tokens a tenant may still use this minute (token buckets refilled per
/// second; a bucket may go below zero when output tokens are charged after the fact).
#[derive(Debug, Clone)]
struct Limit {
    per_minute: f64,
    left: f64,
    at: Instant,
}

impl Limit {
    fn new(per_minute: f64, now: Instant) -> Limit {
        Limit {
            per_minute,
            left: per_minute,
            at: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = now;
        self.left = (self.left + dt * self.per_minute / 60.0).min(self.per_minute);
    }

    /// Whether `need` is more than this limit allows in a whole minute (so it never fits).
    fn never_fits(&self, need: f64) -> bool {
        need > self.per_minute
    }

    /// Seconds until `need` (at most the whole limit) fits (0: it fits now).
    fn wait_for(&self, need: f64) -> f64 {
        if self.left >= need {
            0.0
        } else if self.per_minute > 0.0 {
            (need.min(self.per_minute) - self.left) * 60.0 / self.per_minute
        } else {
            f64::INFINITY
        }
    }
}

/// A tenant's limits.
#[derive(Debug, Clone, Default)]
struct TenantLimits {
    requests: Option<Limit>,
    tokens: Option<Limit>,
}

/// Grants out of the rooms over the last [`DRAIN_WINDOW`] (one count per second).
#[derive(Debug)]
struct Drain {
    seconds: [u32; 10],
    second: u64,
    start: Instant,
}

impl Drain {
    fn new(now: Instant) -> Drain {
        Drain {
            seconds: [0; 10],
            second: 0,
            start: now,
        }
    }

    fn advance(&mut self, now: Instant) {
        let s = now.saturating_duration_since(self.start).as_secs();
        while self.second < s {
            self.second += 1;
            self.seconds[(self.second % 10) as usize] = 0;
            if s - self.second >= 10 {
                self.seconds = [0; 10];
                self.second = s;
            }
        }
    }

    fn count(&mut self, now: Instant) {
        self.advance(now);
        self.seconds[(self.second % 10) as usize] += 1;
    }

    /// Grants per second, or None when none were made in the window.
    fn rate(&mut self, now: Instant) -> Option<f64> {
        self.advance(now);
        let n: u32 = self.seconds.iter().sum();
        (n > 0).then(|| f64::from(n) / DRAIN_WINDOW.as_secs_f64())
    }
}

struct State {
    rooms: HashMap<RoomKey, WaitQueue>,
    fair: Fairness,
    verdicts: HashMap<u64, Verdict>,
    limits: Vec<TenantLimits>,
    drain: Drain,
    waiting: usize,
}

/// The flow control shared by every core.
pub struct Flow {
    cfg: FlowConfig,
    tenants: Tenants,
    state: Mutex<State>,
    tickets: AtomicU64,
    /// Waiters now, over every room (read without the lock).
    waiting: AtomicUsize,
}

impl std::fmt::Debug for Flow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Flow").field("cfg", &self.cfg).finish()
    }
}

impl Flow {
    /// Flow control with `cfg` over the tenants of `tenants`.
    pub fn new(cfg: FlowConfig, tenants: Tenants) -> Flow {
        let now = Instant::now();
        let limits = (0..tenants.len())
            .map(|i| {
                let spec = tenants.spec(i as TenantId);
                TenantLimits {
                    requests: spec
                        .requests_per_minute
                        .map(|n| Limit::new(f64::from(n), now)),
                    tokens: spec.tokens_per_minute.map(|n| Limit::new(n as f64, now)),
                }
            })
            .collect();
        Flow {
            state: Mutex::new(State {
                rooms: HashMap::new(),
                fair: Fairness::new(tenants.weights()),
                verdicts: HashMap::new(),
                limits,
                drain: Drain::new(now),
                waiting: 0,
            }),
            cfg,
            tenants,
            tickets: AtomicU64::new(1),
            waiting: AtomicUsize::new(0),
        }
    }

    /// The tenant table.
    pub fn tenants(&self) -> &Tenants {
        &self.tenants
    }

    /// Requests waiting now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain counters behind: still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Let `ask` in now, or after waiting its turn, or refuse it. `gone` resolves when the
    /// client leaves (the wait ends at once, nothing is sent). Dropping the future mid-wait
    /// takes the waiter out of its room.
    pub async fn admit(
        &self,
        ask: Ask,
        fleet: &impl Fleet,
        gone: impl Future<Output = ()>,
    ) -> Result<Admitted, Denied> {
        let now = Instant::now();
        let Some(ticket) = self.enter(ask, fleet, now)? else {
            return Ok(Admitted::Direct);
        };
        self.wait_queued(ask, ticket, now, fleet, gone).await
    }

    /// Under the lock: let `ask` straight in (None) while a worker has room and nobody of its
    /// class or higher waits, else queue it in its room (its ticket), or refuse it at once.
    fn enter(&self, ask: Ask, fleet: &impl Fleet, now: Instant) -> Result<Option<u64>, Denied> {
        let mut s = self.lock();
        self.check_limits(&mut s, ask, now)?;
        let room = s
            .rooms
            .entry(ask.room)
            .or_insert_with(|| WaitQueue::new(usize::MAX));
        let leads = room.would_lead(ask.class);
        if leads && Self::free(&s, ask.room, ask.class, fleet) > 0 {
            self.let_in(&mut s, ask, now);
            drop(s);
            crate::metrics::admission_outcome(self.tenants.name(ask.tenant), ask.class, "direct");
            return Ok(None);
        }
        self.queue(&mut s, ask, now).map(Some)
    }

    /// Put `ask` in its room's queue and return its ticket; refused when it is sheddable and
    /// the expected wait passes its bound, or when the room is full of its class or higher.
    fn queue(&self, s: &mut State, ask: Ask, now: Instant) -> Result<u64, Denied> {
        let ahead = s.rooms.get(&ask.room).map_or(0, |q| q.ahead_of(ask.class));
        let expected = expected_wait(ahead + 1, s.drain.rate(now));
        if ask.class < 0 && expected.is_some_and(|e| e > self.cfg.sheddable_wait) {
            crate::metrics::admission_outcome(self.tenants.name(ask.tenant), ask.class, "shed");
            return Err(Denied::Overloaded {
                retry_after: retry_after(expected),
            });
        }
        let ticket = self.tickets.fetch_add(1, Relaxed);
        let waiter = Waiter {
            ticket,
            class: ask.class,
            tenant: ask.tenant,
            tokens: ask.tokens,
            requests: ask.requests,
        };
        match self.push(s, ask.room, waiter) {
            Pushed::Refused => {
                crate::metrics::admission_outcome(
                    self.tenants.name(ask.tenant),
                    ask.class,
                    "rejected",
                );
                return Err(Denied::Full {
                    retry_after: retry_after(expected),
                });
            }
            Pushed::Queued => {}
            Pushed::QueuedShedding(out) => {
                s.verdicts.insert(out.ticket, Verdict::Shed);
            }
        }
        Ok(ticket)
    }

    /// Wait in the room for the queued `ticket`'s turn, raced against the client leaving; the
    /// waiter leaves its room however the wait ends (dropped mid-wait included).
    async fn wait_queued(
        &self,
        ask: Ask,
        ticket: u64,
        since: Instant,
        fleet: &impl Fleet,
        gone: impl Future<Output = ()>,
    ) -> Result<Admitted, Denied> {
        let mut guard = Leave {
            flow: self,
            room: ask.room,
            ticket,
            done: false,
        };
        let waited = monoio::select! {
            r = self.wait_turn(ask, ticket, since, fleet) => r,
            _ = gone => Err(Denied::ClientGone),
        };
        if waited.is_ok() || matches!(waited, Err(Denied::Shed { .. })) {
            guard.done = true; // out of the room already
        }
        let outcome = match waited {
            Ok(_) => "admitted",
            Err(Denied::Shed { .. }) => "shed",
            Err(Denied::Timeout) => "timed_out",
            Err(Denied::ClientGone) => "client_gone",
            Err(_) => "rejected",
        };
        crate::metrics::admission_outcome(self.tenants.name(ask.tenant), ask.class, outcome);
        crate::metrics::admission_wait(ask.class, since.elapsed());
        drop(guard);
        waited
    }

    /// Wait for this waiter's verdict: as its core's watcher, looking at the rooms every
    /// [`TICK`] and waking the core's other waiters whose verdicts it finds; otherwise parked
    /// until woken or until its deadline (see `park`).
    async fn wait_turn(
        &self,
        ask: Ask,
        ticket: u64,
        since: Instant,
        fleet: &impl Fleet,
    ) -> Result<Admitted, Denied> {
        let until = since + self.cfg.queue_timeout;
        let spot: park::Spot = (self as *const Flow as usize, ask.room);
        let place = park::Place::take(spot, ticket);
        loop {
            let watching = place.watching();
            if watching {
                monoio::time::sleep(TICK).await;
            } else {
                monoio::select! {
                    _ = place.woken() => {},
                    _ = monoio::time::sleep_until(until.into()) => {},
                }
            }
            let now = Instant::now();
            let mut s = self.lock();
            if watching {
                self.dispatch(&mut s, ask.room, fleet, now);
            }
            let mine = s.verdicts.remove(&ticket);
            if watching {
                park::wake(spot, s.verdicts.keys().copied());
            }
            match mine {
                Some(Verdict::Go(_)) => return Ok(Admitted::Waited(now - since)),
                Some(Verdict::Shed) => {
                    let expected = expected_wait(s.waiting, s.drain.rate(now));
                    return Err(Denied::Shed {
                        retry_after: retry_after(expected),
                    });
                }
                None if now >= until => return Err(Denied::Timeout),
                None => {}
            }
        }
    }

    /// Let in `room`'s waiters, in order, while its fleet has workers with room for the next
    /// one's class.
    fn dispatch(&self, s: &mut State, room: RoomKey, fleet: &impl Fleet, now: Instant) {
        let mut let_in = false;
        while let Some(class) = s.rooms.get(&room).and_then(WaitQueue::head_class) {
            if Self::free(s, room, class, fleet) == 0 {
                break;
            }
            let Some(q) = s.rooms.get_mut(&room) else {
                break;
            };
            let Some(w) = q.pop(&s.fair) else {
                break;
            };
            s.waiting -= 1;
            self.waiting.store(s.waiting, Relaxed);
            s.drain.count(now);
            s.verdicts.insert(w.ticket, Verdict::Go(room));
            let ask = Ask {
                room,
                class: w.class,
                tenant: w.tenant,
                tokens: w.tokens,
                requests: w.requests,
            };
            self.let_in(s, ask, now);
            let_in = true;
        }
        // Looked at every tick: the depths are published only when they changed.
        if let_in {
            self.publish_depths(s);
        }
    }

    fn push(&self, s: &mut State, room: RoomKey, w: Waiter) -> Pushed {
        let full = s.waiting >= self.cfg.queue_size;
        let State { rooms, fair, .. } = s;
        let q = rooms
            .entry(room)
            .or_insert_with(|| WaitQueue::new(usize::MAX));
        let pushed = q.push_when(w, fair, full);
        if pushed == Pushed::Queued {
            s.waiting += 1;
        }
        self.waiting.store(s.waiting, Relaxed);
        self.publish_depths(s);
        pushed
    }

    /// Workers of `room`'s fleet with room for `class`, less the waiters already let in onto
    /// them that have not reached a worker yet.
    fn free(s: &State, room: RoomKey, class: Priority, fleet: &impl Fleet) -> usize {
        let promised = s
            .verdicts
            .values()
            .filter(|v| **v == Verdict::Go(room))
            .count();
        fleet.room_for(room, class).saturating_sub(promised)
    }

    fn let_in(&self, s: &mut State, ask: Ask, now: Instant) {
        s.fair.charge(ask.tenant, ask.tokens);
        if let Some(l) = s.limits.get_mut(usize::from(ask.tenant)) {
            if let Some(r) = l.requests.as_mut() {
                r.refill(now);
                r.left -= ask.requests as f64;
            }
            if let Some(t) = l.tokens.as_mut() {
                t.refill(now);
                t.left -= ask.tokens as f64;
            }
        }
    }

    fn check_limits(&self, s: &mut State, ask: Ask, now: Instant) -> Result<(), Denied> {
        let Some(l) = s.limits.get_mut(usize::from(ask.tenant)) else {
            return Ok(());
        };
        let (requests, tokens) = (ask.requests as f64, ask.tokens as f64);
        let never = l.requests.as_ref().is_some_and(|r| r.never_fits(requests))
            || l.tokens.as_ref().is_some_and(|t| t.never_fits(tokens));
        if never {
            crate::metrics::admission_outcome(
                self.tenants.name(ask.tenant),
                ask.class,
                "tenant_limit",
            );
            crate::log!(
                Debug,
                "tenant {}: a request of {} generations and ~{} tokens is over its whole \
                 per-minute limit: refused",
                self.tenants.name(ask.tenant),
                ask.requests,
                ask.tokens
            );
            return Err(Denied::OverTenantLimit);
        }
        let mut wait: f64 = 0.0;
        if let Some(r) = l.requests.as_mut() {
            r.refill(now);
            wait = wait.max(r.wait_for(requests));
        }
        if let Some(t) = l.tokens.as_mut() {
            t.refill(now);
            wait = wait.max(t.wait_for(tokens));
        }
        if wait > 0.0 {
            crate::metrics::admission_outcome(
                self.tenants.name(ask.tenant),
                ask.class,
                "tenant_limit",
            );
            // A float to u32 cast saturates; a debt of output tokens may take minutes.
            return Err(Denied::TenantLimit {
                retry_after: (wait.ceil() as u32).max(MIN_RETRY_AFTER),
            });
        }
        Ok(())
    }

    /// Tenant `t` was served `tokens` output tokens (fairness and its token limit).
    pub fn charge_output(&self, t: TenantId, tokens: u64) {
        if tokens == 0 {
            return;
        }
        let mut s = self.lock();
        s.fair.charge(t, tokens);
        if let Some(l) = s
            .limits
            .get_mut(usize::from(t))
            .and_then(|l| l.tokens.as_mut())
        {
            l.refill(Instant::now());
            l.left -= tokens as f64;
        }
    }

    fn publish_depths(&self, s: &State) {
        let mut depths: Vec<(Priority, usize)> = Vec::new();
        for q in s.rooms.values() {
            for (class, n) in q.depths() {
                match depths.iter_mut().find(|(c, _)| *c == class) {
                    Some(d) => d.1 += n,
                    None => depths.push((class, n)),
                }
            }
        }
        crate::metrics::admission_depths(&depths);
    }

    fn leave(&self, room: RoomKey, ticket: u64) {
        let mut s = self.lock();
        if s.verdicts.remove(&ticket).is_some() {
            return; // let in or shed meanwhile: it is out of the room already
        }
        if let Some(q) = s.rooms.get_mut(&room) {
            if q.remove(ticket).is_some() {
                s.waiting -= 1;
                self.waiting.store(s.waiting, Relaxed);
                self.publish_depths(&s);
            }
        }
    }
}

/// Takes a waiter out of its room however its wait ends (timeout, client gone, the future
/// dropped) unless it was let in or shed.
struct Leave<'a> {
    flow: &'a Flow,
    room: RoomKey,
    ticket: u64,
    done: bool,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.flow.leave(self.room, self.ticket);
        }
    }
}

/// How long `position` waiters take to drain at `rate` per second (None: no rate known yet).
fn expected_wait(position: usize, rate: Option<f64>) -> Option<Duration> {
    rate.filter(|r| *r > 0.0)
        .map(|r| Duration::from_secs_f64((position as f64 / r).min(86_400.0)))
}

/// A `Retry-After` in whole seconds from an expected wait.
fn retry_after(expected: Option<Duration>) -> u32 {
    expected.map_or(MIN_RETRY_AFTER, |e| {
        (e.as_secs_f64().ceil() as u32).max(MIN_RETRY_AFTER)
    })
}

mod park;
#[cfg(test)]
mod tests;
