//! The telemetry thread: what the engines themselves say, read every
//! `--worker-metrics-interval-secs` (default 5; 0: no thread) from each registered worker's
//! `GET /metrics` (and `GET /get_load` when `/metrics` has no load: SGLang serves `/metrics`
//! only with `--enable-metrics`). It runs on its own std thread with its own small monoio
//! runtime and upstream pool, never on a serving core, and does three things each round:
//!
//! * **Engine load for routing.** A worker's routing load becomes the engine's running +
//!   queued requests plus this copy's own in-flight requests started since the scrape: at each
//!   scrape the load board's *external* part is set to `max(0, running + queued − own
//!   in-flight now)`, and the board's own count keeps moving with every request. Gateway copies
//!   behind one load balancer thus see each other's load without talking to each other. A
//!   worker that cannot be scraped keeps its last external load for [`STALE_ROUNDS`] rounds,
//!   then drops to its own in-flight count only.
//! * **The achieved cache hit ratio**, per worker and for the fleet, from the increases of
//!   `sglang:cached_tokens_total` and `sglang:prompt_tokens_total` over a sliding window
//!   ([`window`]), beside the ratio the gateway predicted from its routing decisions. The
//!   engines' text format is read (and merged) by `expo`.
//! * **`GET /engine_metrics`**: the workers' expositions merged, each sample labelled with its
//!   worker, built once per round (requests serve the last one, no fan-out per request).
//!
//! Every worker is scraped concurrently within one round, each bounded by its own timeout
//! (the interval, at most [`MAX_SCRAPE_TIMEOUT`]) and answer size ([`MAX_SCRAPE_BYTES`]), so a
//! slow worker delays only the round's publication, by at most its timeout. The registry is read
//! at every round: workers added or removed at run time are picked up or dropped.

mod expo;
mod window;

pub use self::expo::{load_by_rank, load_from_json, EngineStats, Merger};
pub use self::window::{RatioWindow, MAX_SAMPLES, WINDOW};

use crate::gateway::upstream_pool;
use crate::gateway::Gateway;
use crate::http::Method;
use crate::metrics::EngineGauges;
use crate::proxy::forward;
use crate::proxy::pool::Pool;
use crate::workers::load::MAX_EXTERNAL;
use crate::workers::registry::{Worker, WorkerList};
use arc_swap::ArcSwap;
use bytes::Bytes;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Largest `/metrics` answer read from one worker (SGLang's is tens of KiB); a larger one is a
/// failed scrape.
pub const MAX_SCRAPE_BYTES: u64 = 4 << 20;
/// Shortest time a scrape is given, however short the interval.
const MIN_SCRAPE_TIMEOUT: Duration = Duration::from_millis(500);
/// Largest `/get_load` answer read.
const MAX_LOAD_BYTES: u64 = 1 << 20;
/// Largest merged `GET /engine_metrics` body (samples); workers past it are left out whole,
/// and only the expositions that fit are kept between rounds.
pub const MAX_MERGED_BYTES: usize = 16 << 20;
/// Longest a worker's scrape may take (both calls), whatever the interval.
pub const MAX_SCRAPE_TIMEOUT: Duration = Duration::from_secs(3);
/// Workers scraped at once (a round over a huge fleet runs in batches, spread over most of the
/// interval). Small, so a batch's burst of connections, answers and parsing (kernel work on the
/// CPU the thread shares with a serving core, which no scheduling class holds back) delays a
/// request by well under a millisecond: with batches of 64 over half the interval, p99 through
/// one core at 4,096 workers was 4.7-6.5 ms against 1.2-1.6 ms without scrapes.
const SCRAPE_BATCH: usize = 8;

/// Share of the interval a round's batches are spread over (the rest is slack for slow
/// workers, whose scrapes are bounded by the timeout).
const SPREAD_SHARE: f64 = 0.8;
/// Failed rounds after which a worker's last engine numbers stop counting (its external load
/// goes to 0, its gauges to 0 and its exposition leaves `/engine_metrics`).
pub const STALE_ROUNDS: u32 = 3;
/// How often the thread looks at the shutdown flag while it waits for the next round.
const TICK: Duration = Duration::from_millis(100);

/// What the last round learned about one worker.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WorkerEngine {
    /// Engine load, token usage and achieved hit ratio, as exported per worker.
    pub gauges: EngineGauges,
    /// Cached prompt tokens the worker reported within the window.
    pub cached_tokens: f64,
    /// Prompt tokens the worker reported within the window.
    pub prompt_tokens: f64,
    /// The external load set on the load board for it.
    pub external: u32,
}

/// What the telemetry thread publishes after each round.
#[derive(Debug, Default)]
pub struct EngineReport {
    /// Rounds completed (0: none yet); tests wait on it.
    pub round: u64,
    /// Per worker, by the worker's never-reused serial.
    pub workers: HashMap<u64, WorkerEngine>,
    /// Achieved hit ratio of the whole fleet (summed increases).
    pub fleet_hit_ratio: f64,
    /// Hit ratio the gateway's routing decisions predicted (characters), same window.
    pub predicted_hit_ratio: f64,
    /// The merged exposition `GET /engine_metrics` serves.
    pub exposition: Bytes,
}

/// The telemetry state every core and the metrics thread read.
#[derive(Debug)]
pub struct Telemetry {
    interval: Option<Duration>,
    report: ArcSwap<EngineReport>,
}

impl Telemetry {
    /// Telemetry every `interval` (None: off).
    pub fn new(interval: Option<Duration>) -> Telemetry {
        Telemetry {
            interval,
            report: ArcSwap::from_pointee(EngineReport::default()),
        }
    }

    /// Whether the thread runs (`--worker-metrics-interval-secs` above 0).
    pub fn enabled(&self) -> bool {
        self.interval.is_some()
    }

    /// The last round's report (empty before the first).
    pub fn report(&self) -> Arc<EngineReport> {
        self.report.load_full()
    }
}

/// Start the telemetry thread (nothing when it is off).
pub fn spawn(gw: Arc<Gateway>) {
    let Some(interval) = gw.telemetry.interval else {
        return;
    };
    // Admission decides on these readings: they must not starve when the CPU is busy (which
    // is when they matter), so with --saturation-admission the thread runs at the health
    // thread's nice value instead of SCHED_IDLE.
    let class = if gw.flow.is_some() {
        super::HelperClass::Nice
    } else {
        super::HelperClass::Idle
    };
    super::spawn_helper("telemetry", class, move || run(gw, interval));
}

async fn run(gw: Arc<Gateway>, interval: Duration) {
    let mut s = Scraper {
        pool: Rc::new(upstream_pool(&gw)),
        // A scrape may take a little longer than a fast (admission) interval: a worker busy
        // enough to matter answers its /metrics late, and a failed reading is worse than a
        // late one.
        timeout: interval.max(MIN_SCRAPE_TIMEOUT).min(MAX_SCRAPE_TIMEOUT),
        interval,
        workers: HashMap::new(),
        predicted: RatioWindow::default(),
        round: 0,
        gw: gw.clone(),
    };
    while !gw.life.is_shutting_down() {
        let started = Instant::now();
        s.round().await;
        let next = started + interval;
        loop {
            let now = Instant::now();
            if now >= next || gw.life.is_shutting_down() {
                break;
            }
            monoio::time::sleep(TICK.min(next - now)).await;
        }
    }
}

/// The thread's memory of one worker between rounds.
#[derive(Debug, Default)]
struct Tracked {
    hits: RatioWindow,
    gauges: EngineGauges,
    external: u32,
    /// Rounds in a row without the worker's load.
    failures: u32,
    /// The last exposition read (kept only while it fits in the merge and is not stale).
    text: Option<String>,
}

/// One worker's scrape.
struct Scrape {
    worker: Arc<Worker>,
    /// The `/metrics` body, when it answered 200.
    text: Option<String>,
    stats: EngineStats,
    /// Running and queued requests, from `/metrics` or else `/get_load`.
    load: Option<(f64, f64)>,
}

/// The telemetry thread's state.
struct Scraper {
    gw: Arc<Gateway>,
    pool: Rc<Pool>,
    timeout: Duration,
    /// By worker serial (ids are reused, serials never).
    workers: HashMap<u64, Tracked>,
    predicted: RatioWindow,
    round: u64,
    /// Time between rounds: a round's batches are spread over [`SPREAD_SHARE`] of it.
    interval: Duration,
}

impl Scraper {
    /// Scrape every registered worker, apply what came back, publish a report.
    async fn round(&mut self) {
        let gw = self.gw.clone();
        let list = gw.registry.load_full();
        let live = list.serials();
        self.workers.retain(|serial, _| live.contains(serial));
        // Backpressure marks set from here on outlive this round's readings.
        let round = gw.flow.as_ref().map_or(0, |fc| fc.saturation.begin_round());
        let results = self.scrape_all(&list).await;
        let now = Instant::now();
        for s in results {
            self.apply(s, now, &list, round);
        }
        let report = self.report(&list, now);
        gw.telemetry.report.store(Arc::new(report));
    }

    /// Scrape every server of `list` (one scrape per server: with `--dp-aware` its rank 0
    /// speaks for all its ranks), [`SCRAPE_BATCH`] at a time.
    async fn scrape_all(&self, list: &WorkerList) -> Vec<Scrape> {
        let mut results = Vec::with_capacity(list.len());
        let primaries: Vec<Arc<Worker>> = list
            .workers
            .iter()
            .filter(|w| w.is_primary())
            .cloned()
            .collect();
        // A big fleet's batches are spread over most of the interval rather than run back to
        // back: a burst of thousands of scrapes takes the CPU from a serving core sharing it.
        let batches = primaries.len().div_ceil(SCRAPE_BATCH).max(1);
        let gap = self.interval.mul_f64(SPREAD_SHARE) / batches as u32;
        let started = monoio::time::Instant::now();
        for (i, batch) in primaries.chunks(SCRAPE_BATCH).enumerate() {
            // Each batch at its own slot from the round's start (a slow batch does not push
            // the rest of the round later; a late one starts at once).
            if i > 0 {
                monoio::time::sleep_until(started + gap * i as u32).await;
            }
            let handles: Vec<_> = batch
                .iter()
                .map(|w| monoio::spawn(scrape(self.pool.clone(), w.clone(), self.timeout)))
                .collect();
            for h in handles {
                results.push(h.await);
            }
        }
        results
    }

    /// The round's report from what the workers' windows hold now: hit ratios (each worker's,
    /// the fleet's, the predicted one), gauges and the merged exposition.
    fn report(&mut self, list: &WorkerList, now: Instant) -> EngineReport {
        let (predicted, routed) = crate::metrics::predicted_totals();
        self.predicted.observe(now, predicted as f64, routed as f64);
        let mut report = EngineReport {
            predicted_hit_ratio: self.predicted.ratio(),
            ..EngineReport::default()
        };
        let (mut hits, mut total) = (0.0, 0.0);
        let mut merger = Merger::new(MAX_MERGED_BYTES);
        for w in &list.workers {
            let Some(t) = self.workers.get_mut(&w.serial) else {
                continue;
            };
            let (h, p) = t.hits.increase();
            hits += h;
            total += p;
            let mut gauges = t.gauges;
            gauges.hit_ratio = window::ratio(h, p);
            report.workers.insert(
                w.serial,
                WorkerEngine {
                    gauges,
                    cached_tokens: h,
                    prompt_tokens: p,
                    external: t.external,
                },
            );
            if let Some(text) = &t.text {
                if !merger.add(&w.server_url, text) {
                    t.text = None; // not served, so not kept: memory stays bounded
                }
            }
        }
        report.fleet_hit_ratio = window::ratio(hits, total);
        if merger.left_out > 0 {
            crate::log!(
                Warn,
                "/engine_metrics: {} worker(s) left out (over {MAX_MERGED_BYTES} bytes)",
                merger.left_out
            );
        }
        report.exposition = Bytes::from(merger.finish());
        self.round += 1;
        report.round = self.round;
        report
    }

    /// Take one worker's scrape (of saturation round `round`) into account: its hit-ratio
    /// window, gauges, exposition and external load on the board.
    fn apply(&mut self, s: Scrape, now: Instant, list: &WorkerList, round: u64) {
        let gw = &self.gw;
        let w = &s.worker;
        if let Some(fc) = &gw.flow {
            // Read or not, the worker has been looked at since any backpressure before the
            // round: its reading, or the rule for a worker without one, decides from now on.
            for r in list.same_server(w) {
                fc.saturation.settle(r.id, round);
            }
        }
        let t = self.workers.entry(w.serial).or_default();
        crate::metrics::engine_scrape(s.load.is_some());
        if let (Some(c), Some(p)) = (s.stats.cached_tokens, s.stats.prompt_tokens) {
            t.hits.observe(now, c, p);
        }
        // Per-rank gauges, read before the exposition is kept (DP-aware servers only).
        let per_rank =
            w.dp.and_then(|d| load_by_rank(s.text.as_deref()?, d.size as usize));
        if s.text.is_some() {
            t.text = s.text;
        }
        match s.load {
            Some((running, queued)) => {
                t.failures = 0;
                t.gauges = EngineGauges {
                    up: true,
                    running,
                    queued,
                    token_usage: s.stats.token_usage.unwrap_or(0.0),
                    hit_ratio: 0.0,
                };
                if w.dp.is_none() {
                    t.external = external_load(running + queued, gw.registry.loads.in_flight(w.id));
                    gw.registry.set_external_load(w, t.external);
                } else {
                    t.external = spread_over_ranks(gw, list, w, per_rank, running + queued);
                }
                if let Some(fc) = &gw.flow {
                    let (usage, used) = (t.gauges.token_usage, s.stats.used_tokens);
                    saturation_reading(gw, fc, list, w, queued, usage, used);
                }
            }
            None => {
                t.failures = t.failures.saturating_add(1);
                t.gauges.up = false;
                if t.failures >= STALE_ROUNDS {
                    if let Some(fc) = &gw.flow {
                        for r in list.same_server(w) {
                            fc.saturation.forget(r.id);
                        }
                    }
                    t.gauges = EngineGauges::default();
                    t.text = None;
                    t.external = 0;
                    for r in list.same_server(w) {
                        gw.registry.set_external_load(r, 0);
                    }
                }
            }
        }
    }
}

/// A reading for the saturation admission: the engine's queue and KV tokens in use (shared
/// evenly by a DP server's ranks, which the gateway routes to one by one) and KV use, beside
/// this copy's own requests on each worker now.
fn saturation_reading(
    gw: &Gateway,
    fc: &crate::admission::FlowControl,
    list: &WorkerList,
    w: &Worker,
    queued: f64,
    usage: f64,
    used: Option<f64>,
) {
    let ranks: Vec<&Arc<Worker>> = list.same_server(w).collect();
    let n = ranks.len().max(1) as f64;
    let share = queued / n;
    let used = used.map(|t| t / n);
    for r in ranks {
        let own = gw.registry.loads.in_flight(r.id);
        fc.saturation.record(r.id, share, usage, used, own);
        // For the default class (prioritized classes may still have headroom).
        // (A reading was just recorded: the fair share of a worker without one is not asked.)
        let saturated = fc.saturation.is_saturated(r.id, own, 0, || u32::MAX);
        crate::metrics::worker_saturated(&r.url, saturated);
    }
}

/// DP ranks (`--dp-aware`): each rank's external load from the server's per-rank gauges
/// (`per_rank`, from the `dp_rank` label), or, when the exposition has none, the server's load
/// less this copy's requests on any of its ranks, spread evenly. Returns the server's external
/// load.
fn spread_over_ranks(
    gw: &Gateway,
    list: &WorkerList,
    w: &Worker,
    per_rank: Option<Vec<f64>>,
    engine: f64,
) -> u32 {
    let mut ranks: Vec<&Arc<Worker>> = list.same_server(w).collect();
    ranks.sort_by_key(|r| r.dp.map(|d| d.rank));
    let in_flight = |r: &Worker| gw.registry.loads.in_flight(r.id);
    if let Some(per) = per_rank {
        let mut total = 0u32;
        for (r, engine) in ranks.iter().zip(per) {
            let ext = external_load(engine, in_flight(r));
            gw.registry.set_external_load(r, ext);
            total = total.saturating_add(ext);
        }
        return total;
    }
    let own: u32 = ranks.iter().map(|r| in_flight(r)).sum();
    let total = external_load(engine, own);
    let n = u32::try_from(ranks.len()).unwrap_or(u32::MAX).max(1);
    for r in ranks {
        gw.registry.set_external_load(r, total.div_ceil(n));
    }
    total
}

/// The load on a worker this copy did not send: what the engine reports minus this copy's own
/// in-flight requests (at least 0; requests this copy sent that the engine has not seen yet,
/// or that it finished before the gateway noticed, make the difference slightly off for a
/// moment, never negative).
pub fn external_load(engine: f64, own_in_flight: u32) -> u32 {
    if !engine.is_finite() || engine <= 0.0 {
        return 0;
    }
    let engine = engine.round().min(f64::from(MAX_EXTERNAL)) as u32;
    engine.saturating_sub(own_in_flight)
}

/// One worker's `/metrics` (and `/get_load` when `/metrics` has no load), within `timeout` in
/// all.
async fn scrape(pool: Rc<Pool>, worker: Arc<Worker>, timeout: Duration) -> Scrape {
    let deadline = Instant::now() + timeout;
    let metrics = forward::fetch_capped(
        &pool,
        &worker,
        Method::Get,
        "/metrics",
        Bytes::new(),
        timeout,
        MAX_SCRAPE_BYTES,
    )
    .await;
    let text = match metrics {
        Ok((200, body)) => Some(String::from_utf8_lossy(&body).into_owned()),
        _ => None,
    };
    let stats = text
        .as_deref()
        .map(EngineStats::from_text)
        .unwrap_or_default();
    let mut load = stats.load();
    let left = deadline.saturating_duration_since(Instant::now());
    if load.is_none() && !left.is_zero() {
        let r = forward::fetch_capped(
            &pool,
            &worker,
            Method::Get,
            "/get_load",
            Bytes::new(),
            left,
            MAX_LOAD_BYTES,
        )
        .await;
        if let Ok((200, body)) = r {
            load = serde_json::from_slice(&body)
                .ok()
                .and_then(|v| load_from_json(&v));
        }
    }
    Scrape {
        worker,
        text,
        stats,
        load,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn external_load_is_what_this_copy_did_not_send() {
        assert_eq!(external_load(10.0, 3), 7);
        assert_eq!(external_load(2.0, 3), 0, "never negative");
        assert_eq!(external_load(0.0, 0), 0);
        assert_eq!(external_load(f64::NAN, 0), 0);
        assert_eq!(external_load(-5.0, 0), 0);
        assert_eq!(external_load(1e12, 0), MAX_EXTERNAL);
        assert_eq!(external_load(4.6, 0), 5);
    }
}
