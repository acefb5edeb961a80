//! Calibration of the simulator against the analytic oracle of the reference (§3, Jarvislabs
//! discussion): with no eviction, sessions with `S` shared system tokens, `H` history and `Q`
//! new tokens over `N` workers hit `(S + H/N)/(S+H+Q)` under round-robin and `(S+H)/(S+H+Q)`
//! when each session sticks to one worker.
//!
//! The workload is driven through the engines in-process on their virtual clocks (no sockets, no
//! sleeping), so it is deterministic and fast. Turn 1 (`S + U`, answered with `A` tokens) builds
//! each session's history `H = U + A` on its home worker; turn 2 (`S + U + answer + Q`) is the
//! measured request. Under round-robin the turn-2 requests arrive in a seeded random order (think
//! times differ), so about 1/N of them land on the worker holding their history.

use super::cost::CostModel;
use super::engine::{Engine, EngineConfig, Event, ReqId};
use crate::rng::Rng;

const N: usize = 4;
const SESSIONS: usize = 1000;
// Token shares of the reference example: S 0.56, H 0.36, Q 0.08 → 65.0 % vs 92.0 %.
const S: usize = 1400;
const U: usize = 700;
const A: usize = 200;
const Q: usize = 200;
const H: usize = U + A;

struct Outcome {
    hit_rate: f64,
    home_fraction: f64,
    mean_ttft_ms: f64,
    evicted: u64,
}

fn engines() -> Vec<Engine> {
    (0..N)
        .map(|i| {
            Engine::new(EngineConfig {
                // Room for every history on every worker: no eviction.
                max_total_tokens: 4_000_000,
                cost: CostModel::default(),
                seed: 11 + i as u64,
                ..EngineConfig::default()
            })
        })
        .collect()
}

fn range(base: u32, n: usize) -> impl Iterator<Item = u32> {
    base..base + n as u32
}

/// Run every engine until idle and collect `(server, event)`.
fn drain(engines: &mut [Engine]) -> Vec<(usize, Event)> {
    let mut all = Vec::new();
    let mut ev = Vec::new();
    for (i, e) in engines.iter_mut().enumerate() {
        ev.clear();
        e.run_until_idle(&mut ev);
        all.extend(ev.iter().map(|x| (i, *x)));
    }
    all
}

fn run(sticky: bool) -> Outcome {
    let mut engines = engines();
    let system: Vec<u32> = range(1_000_000, S).collect();
    let user = |j: usize| range(2_000_000 + (j * 10_000) as u32, U);
    let question = |j: usize| range(2_000_000 + (j * 10_000 + 5_000) as u32, Q);

    // Turn 1: global round-robin in session order; this is each session's home.
    let home = |j: usize| j % N;
    let mut turn1: Vec<(usize, ReqId)> = Vec::with_capacity(SESSIONS);
    for j in 0..SESSIONS {
        let prompt: Vec<u32> = system.iter().copied().chain(user(j)).collect();
        let e = &mut engines[home(j)];
        let now = e.now_ms();
        turn1.push((home(j), e.submit(prompt, A, now, false).expect("fits")));
    }
    let events = drain(&mut engines);
    let mut answers: Vec<Vec<u32>> = (0..SESSIONS).map(|_| Vec::with_capacity(A)).collect();
    let by_req: std::collections::HashMap<(usize, ReqId), usize> =
        turn1.iter().enumerate().map(|(j, &k)| (k, j)).collect();
    for (srv, e) in &events {
        if let Event::Token { id, token, .. } = e {
            answers[by_req[&(*srv, *id)]].push(*token);
        }
    }
    assert!(answers.iter().all(|a| a.len() == A));

    // Turn 2: sticky → home; round-robin → global counter continuing after turn 1, over a seeded
    // random arrival order.
    let mut order: Vec<usize> = (0..SESSIONS).collect();
    Rng::new(2024).shuffle(&mut order);
    let mut at_home = 0;
    let mut turn2 = std::collections::HashSet::new();
    for (k, &j) in order.iter().enumerate() {
        let server = if sticky { home(j) } else { (SESSIONS + k) % N };
        at_home += usize::from(server == home(j));
        let prompt: Vec<u32> = system
            .iter()
            .copied()
            .chain(user(j))
            .chain(answers[j].iter().copied())
            .chain(question(j))
            .collect();
        assert_eq!(prompt.len(), S + H + Q);
        let e = &mut engines[server];
        let now = e.now_ms();
        turn2.insert((server, e.submit(prompt, 16, now, false).expect("fits")));
    }
    let events = drain(&mut engines);
    let (mut cached, mut prompt, mut ttft, mut n) = (0usize, 0usize, 0.0, 0usize);
    for (srv, e) in &events {
        if let Event::Finished { id, info } = e {
            if turn2.contains(&(*srv, *id)) {
                cached += info.cached_tokens;
                prompt += info.prompt_tokens;
                ttft += info.first_token_ms.unwrap_or(info.finish_ms) - info.arrival_ms;
                n += 1;
            }
        }
    }
    assert_eq!(n, SESSIONS);
    for e in &engines {
        e.cache().check_invariants().expect("cache accounting");
    }
    Outcome {
        hit_rate: cached as f64 / prompt as f64,
        home_fraction: at_home as f64 / SESSIONS as f64,
        mean_ttft_ms: ttft / n as f64,
        evicted: engines
            .iter()
            .map(|e| e.cache().stats().evicted_tokens)
            .sum(),
    }
}

#[test]
fn hit_rates_match_the_analytic_oracle() {
    let total = (S + H + Q) as f64;
    let oracle_rr = (S as f64 + H as f64 / N as f64) / total;
    let oracle_aff = (S + H) as f64 / total;

    let rr = run(false);
    let aff = run(true);
    eprintln!(
        "calibration: rr {:.4} (oracle {:.4}, home {:.3}, ttft {:.0} ms), affinity {:.4} (oracle {:.4}, ttft {:.0} ms)",
        rr.hit_rate, oracle_rr, rr.home_fraction, rr.mean_ttft_ms, aff.hit_rate, oracle_aff, aff.mean_ttft_ms
    );
    assert_eq!(
        rr.evicted + aff.evicted,
        0,
        "the oracle assumes no eviction"
    );

    // Within 2 percentage points of the formula.
    assert!(
        (rr.hit_rate - oracle_rr).abs() < 0.02,
        "round-robin {:.4} vs oracle {:.4}",
        rr.hit_rate,
        oracle_rr
    );
    assert!(
        (aff.hit_rate - oracle_aff).abs() < 0.02,
        "affinity {:.4} vs oracle {:.4}",
        aff.hit_rate,
        oracle_aff
    );

    // Tighter: given where requests actually landed, the simulator is exact up to the one
    // generated token that has no KV (the last answer token).
    let exact = |home: f64| (S as f64 + (H - 1) as f64 * home) / total;
    assert!(
        (rr.hit_rate - exact(rr.home_fraction)).abs() < 1e-3,
        "{} vs {}",
        rr.hit_rate,
        exact(rr.home_fraction)
    );
    assert!((aff.hit_rate - exact(1.0)).abs() < 1e-9);

    // Fewer uncached tokens mean less prefill work and a shorter queue.
    assert!(
        aff.mean_ttft_ms < rr.mean_ttft_ms,
        "ttft aff {} rr {}",
        aff.mean_ttft_ms,
        rr.mean_ttft_ms
    );
}
