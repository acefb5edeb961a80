//! What the servers were doing during an overload run: every worker's `/metrics` read at a
//! fixed interval on a thread of its own (plain blocking sockets, so it neither shares nor
//! slows the client's runtime), then summarised over the measurement window: mean KV use
//! (`sglang:token_usage`), mean running and queued requests, and the share of time the GPU was
//! idle (the simulator's `sglang:gpu_idle_seconds_total`; absent on a real SGLang server). A
//! vLLM-shaped worker's `vllm:kv_cache_usage_perc`, `vllm:num_requests_running`,
//! `vllm:num_requests_waiting` and `vllm:gpu_idle_seconds_total` are read the same way.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::loadgen::client::Target;

/// One worker's reading at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Reading {
    /// `sglang:token_usage` (mean over DP ranks).
    pub token_usage: Option<f64>,
    /// `sglang:num_running_reqs` (sum over DP ranks).
    pub running: Option<f64>,
    /// `sglang:num_queue_reqs` (sum over DP ranks).
    pub queued: Option<f64>,
    /// `sglang:gpu_idle_seconds_total` (mean over DP ranks; simulator only).
    pub idle_s: Option<f64>,
}

/// Read the gauges a saturation study needs out of a Prometheus text body.
pub fn parse(text: &str) -> Reading {
    // (sum, samples) per series.
    let mut acc = [(0.0f64, 0u32); 4];
    // SGLang's names, then vLLM's for the same readings (a worker speaks one of the two).
    const NAMES: [(&str, usize); 8] = [
        ("sglang:token_usage", 0),
        ("sglang:num_running_reqs", 1),
        ("sglang:num_queue_reqs", 2),
        ("sglang:gpu_idle_seconds_total", 3),
        ("vllm:kv_cache_usage_perc", 0),
        ("vllm:num_requests_running", 1),
        ("vllm:num_requests_waiting", 2),
        ("vllm:gpu_idle_seconds_total", 3),
    ];
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(i) = NAMES.iter().find_map(|&(n, i)| {
            line.strip_prefix(n)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
                .then_some(i)
        }) else {
            continue;
        };
        if let Some(v) = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite())
        {
            acc[i].0 += v;
            acc[i].1 += 1;
        }
    }
    let sum = |i: usize| (acc[i].1 > 0).then_some(acc[i].0);
    let mean = |i: usize| (acc[i].1 > 0).then(|| acc[i].0 / f64::from(acc[i].1));
    Reading {
        token_usage: mean(0),
        running: sum(1),
        queued: sum(2),
        idle_s: mean(3),
    }
}

/// One round of readings: seconds since the run started, and one reading per worker (`None`
/// when the worker did not answer).
#[derive(Debug, Clone)]
pub struct Round {
    /// Seconds since the start of the run.
    pub t: f64,
    /// Per worker, in the configured order.
    pub readings: Vec<Option<Reading>>,
}

/// A running sampler; [`Sampler::finish`] stops it and hands back its rounds.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Vec<Round>>>,
}

impl Sampler {
    /// Start reading `workers` (loopback URLs) every `interval`, times taken from `t0`. Fails
    /// on a URL that is not on this machine.
    pub fn start(workers: &[String], interval: Duration, t0: Instant) -> io::Result<Sampler> {
        let targets = workers
            .iter()
            .map(|w| Target::parse(w))
            .collect::<io::Result<Vec<_>>>()?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("overload-sampler".into())
            .spawn(move || {
                let mut rounds = Vec::new();
                let mut next = Instant::now();
                while !flag.load(Ordering::Acquire) {
                    let t = t0.elapsed().as_secs_f64();
                    let readings = targets.iter().map(|tg| read_metrics(tg).ok()).collect();
                    rounds.push(Round { t, readings });
                    next += interval;
                    // Sleep in short steps so a stop is seen promptly.
                    while !flag.load(Ordering::Acquire) && Instant::now() < next {
                        std::thread::sleep(Duration::from_millis(20).min(interval));
                    }
                }
                rounds
            })?;
        Ok(Sampler {
            stop,
            thread: Some(thread),
        })
    }

    /// Stop sampling and return every round taken.
    pub fn finish(mut self) -> Vec<Round> {
        self.stop.store(true, Ordering::Release);
        self.thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `GET /metrics` with `Connection: close`, the body read to the end (bounded in time and
/// size).
fn read_metrics(t: &Target) -> io::Result<Reading> {
    let mut s = TcpStream::connect_timeout(&t.addr, Duration::from_secs(1))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.set_write_timeout(Some(Duration::from_secs(2)))?;
    write!(
        s,
        "GET {}/metrics HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
        t.base_path, t.host
    )?;
    let mut buf = Vec::with_capacity(16 << 10);
    s.take(4 << 20).read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| io::Error::other("no response head"))?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        return Err(io::Error::other("metrics not answered 200"));
    }
    Ok(parse(body))
}

/// The servers over the measurement window.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ServerSummary {
    /// Rounds of readings inside the window.
    pub rounds: u64,
    /// Mean `sglang:token_usage` over the window's readings of every worker.
    pub kv_usage_mean: Option<f64>,
    /// Mean over rounds of the running requests summed over workers.
    pub running_mean: Option<f64>,
    /// Mean over rounds of the queued requests summed over workers.
    pub queued_mean: Option<f64>,
    /// Idle GPU time over the window divided by the window's GPU time, over all workers
    /// (`None` without the simulator's idle counter).
    pub idle_share: Option<f64>,
    /// The same figures per worker, in the configured order.
    pub per_worker: Vec<WorkerSummary>,
}

/// One worker over the measurement window.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct WorkerSummary {
    /// Worker URL.
    pub url: String,
    /// Mean `sglang:token_usage`.
    pub kv_usage_mean: Option<f64>,
    /// Mean running requests.
    pub running_mean: Option<f64>,
    /// Mean queued requests.
    pub queued_mean: Option<f64>,
    /// Share of the window its GPU was idle.
    pub idle_share: Option<f64>,
}

fn mean(xs: impl Iterator<Item = f64>) -> Option<f64> {
    let (s, n) = xs.fold((0.0, 0u64), |(s, n), x| (s + x, n + 1));
    (n > 0).then(|| s / n as f64)
}

/// Summarise `rounds` over `[from, to]` seconds. `gpu_scale` is the workers' virtual seconds per
/// real second (their idle counter runs on the virtual clock).
pub fn summarise(
    workers: &[String],
    rounds: &[Round],
    from: f64,
    to: f64,
    gpu_scale: f64,
) -> ServerSummary {
    let inside: Vec<&Round> = rounds.iter().filter(|r| r.t >= from && r.t <= to).collect();
    let col = |w: usize, f: fn(&Reading) -> Option<f64>| {
        inside
            .iter()
            .filter_map(move |r| r.readings.get(w).copied().flatten().as_ref().and_then(f))
    };
    let per_worker: Vec<WorkerSummary> = workers
        .iter()
        .enumerate()
        .map(|(w, url)| {
            // Idle share from the first and last readings of the counter inside the window.
            let idle: Vec<(f64, f64)> = inside
                .iter()
                .filter_map(|r| Some((r.t, r.readings.get(w).copied().flatten()?.idle_s?)))
                .collect();
            let idle_share = match (idle.first(), idle.last()) {
                (Some(&(t0, i0)), Some(&(t1, i1))) if t1 > t0 => {
                    Some(((i1 - i0) / ((t1 - t0) * gpu_scale)).clamp(0.0, 1.0))
                }
                _ => None,
            };
            WorkerSummary {
                url: url.clone(),
                kv_usage_mean: mean(col(w, |r| r.token_usage)),
                running_mean: mean(col(w, |r| r.running)),
                queued_mean: mean(col(w, |r| r.queued)),
                idle_share,
            }
        })
        .collect();
    // Fleet sums per round, over the rounds where every worker answered.
    let fleet = |f: fn(&Reading) -> Option<f64>| {
        mean(inside.iter().filter_map(|r| {
            r.readings
                .iter()
                .map(|x| x.as_ref().and_then(f))
                .sum::<Option<f64>>()
        }))
    };
    ServerSummary {
        rounds: inside.len() as u64,
        kv_usage_mean: mean(
            (0..workers.len()).flat_map(|w| col(w, |r| r.token_usage).collect::<Vec<_>>()),
        ),
        running_mean: fleet(|r| r.running),
        queued_mean: fleet(|r| r.queued),
        idle_share: mean(per_worker.iter().filter_map(|w| w.idle_share)),
        per_worker,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP sglang:num_running_reqs The number of running requests.\n\
        # TYPE sglang:num_running_reqs gauge\n\
        sglang:num_running_reqs{dp_rank=\"0\",model_name=\"m\"} 3\n\
        sglang:num_running_reqs{dp_rank=\"1\",model_name=\"m\"} 4\n\
        sglang:num_queue_reqs{model_name=\"m\"} 7\n\
        sglang:token_usage{dp_rank=\"0\",model_name=\"m\"} 0.5\n\
        sglang:token_usage{dp_rank=\"1\",model_name=\"m\"} 0.7\n\
        sglang:token_usage_other{model_name=\"m\"} 9\n\
        sglang:gpu_idle_seconds_total 1.25\n";

    #[test]
    fn parse_sums_counts_and_averages_shares_over_ranks() {
        let r = parse(TEXT);
        assert_eq!(r.running, Some(7.0));
        assert_eq!(r.queued, Some(7.0));
        assert!((r.token_usage.unwrap() - 0.6).abs() < 1e-12);
        assert_eq!(r.idle_s, Some(1.25));
        assert_eq!(parse("nothing here\n"), Reading::default());
    }

    #[test]
    fn parse_reads_vllm_names_too() {
        let text = "# TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 4.0\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0\n\
            vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5\n\
            vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.7\n\
            vllm:kv_cache_usage_perc_created{engine=\"1\",model_name=\"m\"} 9.0\n\
            vllm:gpu_idle_seconds_total{engine=\"0\",model_name=\"m\"} 1.5\n";
        let r = parse(text);
        assert_eq!((r.running, r.queued), (Some(7.0), Some(2.0)));
        assert!((r.token_usage.unwrap() - 0.6).abs() < 1e-12);
        assert_eq!(r.idle_s, Some(1.5));
    }

    #[test]
    fn summary_covers_the_window_and_idle_is_a_share_of_gpu_time() {
        let reading = |usage: f64, idle: f64| {
            Some(Reading {
                token_usage: Some(usage),
                running: Some(10.0),
                queued: Some(2.0),
                idle_s: Some(idle),
            })
        };
        let rounds = vec![
            // Before the window: ignored.
            Round {
                t: 1.0,
                readings: vec![reading(0.0, 0.0), reading(0.0, 0.0)],
            },
            Round {
                t: 10.0,
                readings: vec![reading(0.8, 5.0), reading(0.6, 1.0)],
            },
            Round {
                t: 15.0,
                readings: vec![reading(1.0, 5.0), None],
            },
            Round {
                t: 20.0,
                readings: vec![reading(0.9, 5.0), reading(0.4, 6.0)],
            },
        ];
        let urls = vec!["a".to_string(), "b".to_string()];
        let s = summarise(&urls, &rounds, 5.0, 20.0, 1.0);
        assert_eq!(s.rounds, 3);
        assert!((s.per_worker[0].kv_usage_mean.unwrap() - 0.9).abs() < 1e-12);
        assert!((s.per_worker[1].kv_usage_mean.unwrap() - 0.5).abs() < 1e-12);
        // Mean of every reading: (0.8 + 1.0 + 0.9 + 0.6 + 0.4) / 5.
        assert!((s.kv_usage_mean.unwrap() - 0.74).abs() < 1e-12);
        // Fleet sums only over rounds where every worker answered.
        assert_eq!(s.running_mean, Some(20.0));
        assert_eq!(s.per_worker[0].idle_share, Some(0.0));
        assert_eq!(s.per_worker[1].idle_share, Some(0.5));
        assert_eq!(s.idle_share, Some(0.25));
        // A GPU running 10x real time has 10x the GPU seconds to be idle in.
        let fast = summarise(&urls, &rounds, 5.0, 20.0, 10.0);
        assert_eq!(fast.per_worker[1].idle_share, Some(0.05));
        // No readings in the window: nothing to say.
        let empty = summarise(&urls, &rounds, 30.0, 40.0, 1.0);
        assert_eq!((empty.rounds, empty.kv_usage_mean), (0, None));
    }
}
