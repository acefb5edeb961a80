//! Active health checks on their own thread (a small monoio runtime, never a serving core):
//! at start, each worker is polled with back-off until it first answers (`/readiness` stays 503
//! until one does); then every `--health-check-interval-secs`, `--health-failure-threshold`
//! failures make it unhealthy and `--health-success-threshold` successes healthy again. Workers
//! that are unhealthy are probed every second, so a worker that refused one connection (passive
//! detection) comes back within seconds, not minutes. With `--dp-aware` a server is probed
//! once (through its rank 0) and the verdict holds for all its ranks.

use crate::base::WorkerId;
use crate::gateway::upstream_pool;
use crate::gateway::Gateway;
use crate::http::Method;
use crate::proxy::forward;
use crate::proxy::pool::Pool;
use crate::workers::registry::{Worker, WorkerList};
use bytes::Bytes;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often the checker wakes to look for due probes and circuits to half-open.
const TICK: Duration = Duration::from_millis(100);
/// Unhealthy workers are probed at least this often, so passive removals heal quickly.
const UNHEALTHY_PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// Delay from a worker's first successful check to its first periodic one: between half and
/// one and a half intervals, by a hash of its serial, so a fleet admitted in one round is
/// checked spread over the interval afterwards (each worker keeps its phase).
fn first_periodic_delay(interval: Duration, serial: u64) -> Duration {
    let frac = (serial.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11) as f64 / (1u64 << 53) as f64;
    interval.mul_f64(0.5 + frac)
}

/// When checks come: every `interval` once a worker is up, backing off up to `startup_cap`
/// while it starts.
struct Schedule {
    interval: Duration,
    startup_cap: Duration,
}

impl Schedule {
    /// How long until the next check of a worker whose check just ended (`starting`: it had
    /// never answered before this one).
    fn next_delay(&self, p: &Probe, starting: bool, healthy: bool, serial: u64) -> Duration {
        if starting && !p.seen_up {
            // Back off 1 s, 2 s, ... up to --worker-startup-check-interval.
            std::cmp::min(Duration::from_secs(p.attempts as u64), self.startup_cap)
        } else if !healthy {
            std::cmp::min(self.interval, UNHEALTHY_PROBE_INTERVAL)
        } else if starting {
            // Just came up: workers admitted together would otherwise be checked together
            // forever after, thousands of connections in one burst every interval.
            first_periodic_delay(self.interval, serial)
        } else {
            self.interval
        }
    }
}

/// Per-worker probe bookkeeping.
#[derive(Debug, Clone)]
struct Probe {
    /// The worker incarnation this record is about.
    serial: u64,
    next: Instant,
    failures: u32,
    successes: u32,
    /// Has answered at least once (start-up phase over).
    seen_up: bool,
    first_poll: Instant,
    attempts: u32,
    /// The start-up timeout has been reported (once).
    timeout_reported: bool,
}

/// What one check result does to a worker's verdict; pure so it is tested alone.
/// Returns the new health verdict (or `None` to keep the current one).
fn verdict(
    p: &mut Probe,
    ok: bool,
    healthy: bool,
    fail_threshold: u32,
    ok_threshold: u32,
) -> Option<bool> {
    if ok {
        p.failures = 0;
        p.successes += 1;
        if !p.seen_up {
            p.seen_up = true;
            return Some(true);
        }
        if !healthy && p.successes >= ok_threshold {
            return Some(true);
        }
    } else {
        p.successes = 0;
        p.failures += 1;
        if healthy && p.failures >= fail_threshold {
            return Some(false);
        }
    }
    None
}

/// Start the checker thread. With `--disable-health-check` it only moves open circuits to
/// half-open when their time is up.
pub fn spawn(gw: Arc<Gateway>) {
    super::spawn_helper("health", super::HelperClass::Nice, move || run(gw));
}

/// The checker's state between ticks.
struct Checker {
    gw: Arc<Gateway>,
    /// The checker's own upstream connections: it never borrows a serving core's pool.
    pool: Rc<Pool>,
    interval: Duration,
    timeout: Duration,
    startup_cap: Duration,
    startup_timeout: Duration,
    probes: HashMap<WorkerId, Probe>,
    /// Workers (by serial: ids are reused) whose `/v1/models` was read (once each, for the
    /// metric label).
    models_seen: HashSet<u64>,
}

/// One probe's result: the worker, whether its health endpoint answered 2xx (`None` when the
/// gateway itself could not open a connection: no verdict on the worker), and its
/// `/v1/models` body when it was asked for.
type ProbeResult = (Arc<Worker>, Option<bool>, Option<Bytes>);

async fn run(gw: Arc<Gateway>) {
    let health = &gw.settings.health;
    let mut checker = Checker {
        pool: Rc::new(upstream_pool(&gw)),
        interval: health.interval,
        timeout: health.timeout.max(Duration::from_secs(1)),
        startup_cap: health.startup_cap,
        startup_timeout: health.startup_timeout,
        probes: HashMap::new(),
        models_seen: HashSet::new(),
        gw: gw.clone(),
    };
    let mut kv_discovery = crate::gateway::kv_routing::Discovery::default();
    while !gw.life.is_shutting_down() {
        let list = gw.registry.load_full();
        if let Some(kv) = &gw.kv {
            kv_discovery.round(&gw, kv, &checker.pool, &list).await;
        }
        let now_ms = gw.life.now_ms();
        for w in &list.workers {
            let t = w.breaker.tick(&gw.breaker, now_ms);
            gw.after_breaker(w, t);
        }
        if gw.settings.health.enabled {
            let due = checker.due(&list);
            let results = checker.probe(due).await;
            let mut changed = false;
            for r in results {
                changed |= checker.apply(r);
            }
            if changed {
                gw.membership_changed();
            }
        }
        monoio::time::sleep(TICK).await;
    }
}

impl Checker {
    /// Workers whose next check is due (new workers are due at once).
    fn due(&mut self, list: &WorkerList) -> Vec<Arc<Worker>> {
        // An id reused by a new worker starts a new record (the serial tells them apart).
        self.probes
            .retain(|id, p| list.get(*id).is_some_and(|w| w.serial == p.serial));
        if !self.models_seen.is_empty() {
            let live = list.serials();
            self.models_seen.retain(|s| live.contains(s));
        }
        let now = Instant::now();
        let mut due = Vec::new();
        // A server's DP ranks share its verdict (`Registry::set_healthy`): probe it once.
        for w in list.workers.iter().filter(|w| w.is_primary()) {
            let p = self.probes.entry(w.id).or_insert_with(|| Probe {
                serial: w.serial,
                next: now,
                failures: 0,
                successes: 0,
                seen_up: w.is_healthy(),
                first_poll: now,
                attempts: 0,
                timeout_reported: false,
            });
            if p.next <= now {
                due.push(w.clone());
            }
        }
        due
    }

    /// Check every due worker concurrently.
    async fn probe(&self, due: Vec<Arc<Worker>>) -> Vec<ProbeResult> {
        let mut handles = Vec::with_capacity(due.len());
        for w in due {
            let pool = self.pool.clone();
            let path = self.gw.settings.health.endpoint.clone();
            let learn = !self.models_seen.contains(&w.serial);
            let timeout = self.timeout;
            handles.push(monoio::spawn(async move {
                let ok = match forward::fetch(&pool, &w, Method::Get, &path, Bytes::new(), timeout)
                    .await
                {
                    Ok((status, _)) => Some((200..=299).contains(&status)),
                    Err(e) if e.is_local() => None,
                    Err(_) => Some(false),
                };
                // Learn the served model names once per worker (for the metric label).
                let models = if ok == Some(true) && learn {
                    let r =
                        forward::fetch(&pool, &w, Method::Get, "/v1/models", Bytes::new(), timeout);
                    match r.await {
                        Ok((200, body)) => Some(body),
                        _ => None,
                    }
                } else {
                    None
                };
                (w, ok, models)
            }));
        }
        let mut out = Vec::with_capacity(handles.len());
        for h in handles {
            out.push(h.await);
        }
        out
    }

    /// Apply one result: learn models, update the verdict, schedule the next check. Returns
    /// whether the worker's health changed.
    fn apply(&mut self, (w, ok, models): ProbeResult) -> bool {
        let gw = &self.gw;
        if let Some(body) = models {
            gw.learn_models(w.id, &body);
            if w.dp.is_some() {
                // The server's other DP ranks serve the same models.
                let list = gw.registry.load_full();
                for r in list.same_server(&w).filter(|r| r.id != w.id) {
                    gw.learn_models(r.id, &body);
                }
            }
            self.models_seen.insert(w.serial);
        }
        let Some(p) = self.probes.get_mut(&w.id).filter(|p| p.serial == w.serial) else {
            return false;
        };
        let Some(ok) = ok else {
            // The gateway's own failure (out of descriptors): check again soon, no verdict.
            p.next = Instant::now() + UNHEALTHY_PROBE_INTERVAL;
            return false;
        };
        p.attempts += 1;
        let starting = !p.seen_up;
        let health = &gw.settings.health;
        let mut changed = false;
        let fail_threshold = health.failure_threshold;
        if let Some(v) = verdict(
            p,
            ok,
            w.is_healthy(),
            fail_threshold,
            health.success_threshold,
        ) {
            if gw.registry.set_healthy(&w, v) {
                changed = true;
                let now_is = if v { "healthy" } else { "unhealthy" };
                crate::log!(Info, "worker {} is now {now_is}", w.url);
            }
        }
        let now = Instant::now();
        if starting
            && !p.seen_up
            && !p.timeout_reported
            && now.duration_since(p.first_poll) > self.startup_timeout
        {
            p.timeout_reported = true;
            crate::log!(
                Error,
                "worker {} did not come up within --worker-startup-timeout-secs",
                w.url
            );
        }
        let schedule = Schedule {
            interval: self.interval,
            startup_cap: self.startup_cap,
        };
        p.next = now + schedule.next_delay(p, starting, w.is_healthy(), w.serial);
        changed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(seen_up: bool) -> Probe {
        let now = Instant::now();
        Probe {
            serial: 1,
            next: now,
            failures: 0,
            successes: 0,
            seen_up,
            first_poll: now,
            attempts: 0,
            timeout_reported: false,
        }
    }

    #[test]
    fn a_fleet_admitted_together_is_checked_spread_over_the_interval() {
        let interval = Duration::from_secs(60);
        let mut buckets = [0usize; 16];
        for serial in 1..=4096u64 {
            let d = first_periodic_delay(interval, serial);
            assert!(d >= interval / 2 && d < interval * 3 / 2, "{d:?}");
            let b = ((d - interval / 2).as_secs_f64() / interval.as_secs_f64() * 16.0) as usize;
            buckets[b.min(15)] += 1;
        }
        // 256 a bucket if even; a burst would put thousands in one.
        assert!(
            buckets.iter().all(|&n| (192..=320).contains(&n)),
            "{buckets:?}"
        );
    }

    #[test]
    fn checks_of_a_worker_that_just_came_up_start_at_its_own_phase() {
        let s = Schedule {
            interval: Duration::from_secs(60),
            startup_cap: Duration::from_secs(10),
        };
        let up = probe(true);
        let delays: HashSet<Duration> = (1..=64u64)
            .map(|serial| s.next_delay(&up, true, true, serial))
            .collect();
        assert!(
            delays.len() > 60,
            "first periodic checks spread, not all at one time"
        );
        // Afterwards each keeps the interval; still starting: back off; down: soon.
        assert_eq!(s.next_delay(&up, false, true, 7), s.interval);
        let mut starting = probe(false);
        starting.attempts = 3;
        assert_eq!(
            s.next_delay(&starting, true, false, 7),
            Duration::from_secs(3)
        );
        assert_eq!(s.next_delay(&up, false, false, 7), UNHEALTHY_PROBE_INTERVAL);
    }

    #[test]
    fn first_success_admits_at_start() {
        let mut p = probe(false);
        assert_eq!(verdict(&mut p, false, false, 3, 2), None);
        assert_eq!(verdict(&mut p, true, false, 3, 2), Some(true));
    }

    #[test]
    fn thresholds_are_consecutive() {
        let mut p = probe(true);
        assert_eq!(verdict(&mut p, false, true, 3, 2), None);
        assert_eq!(verdict(&mut p, false, true, 3, 2), None);
        assert_eq!(verdict(&mut p, true, true, 3, 2), None); // resets the failure run
        assert_eq!(verdict(&mut p, false, true, 3, 2), None);
        assert_eq!(verdict(&mut p, false, true, 3, 2), None);
        assert_eq!(verdict(&mut p, false, true, 3, 2), Some(false));
        assert_eq!(verdict(&mut p, true, false, 3, 2), None);
        assert_eq!(verdict(&mut p, true, false, 3, 2), Some(true));
    }
}
