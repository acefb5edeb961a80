//! `kv-fleet`: one process hosting W simulated SGLang servers × D DP ranks, each rank a libzmq
//! PUB socket publishing SGLang 0.5.23 KV-event batches and a replay ROUTER, each server a tiny
//! HTTP/1.1 listener answering what the gateway asks (health, server info with the publisher
//! descriptor, models, metrics, and an immediate `/generate` naming the server). It paces an
//! aggregate rate of stored blocks over every publisher through a schedule of phases, and, as
//! the driving shard (`--gateway`), measures one gateway copy fed by it: markers (staleness seen
//! from outside), routed background requests (latency), the gateway's counters and its CPU and
//! memory per phase.
//!
//! A fleet too large for one process's descriptors runs as several (`--shard K/N`, disjoint
//! server ranges, one schedule started through `--start-file`).
//!
//! Files: `gen` (one rank's event mix, pure), `pace` (rate pacing, pure), `schedule` (phases),
//! `http` (the servers' HTTP side), `publish` (PUB/ROUTER sockets, the generator and replay
//! threads), `client` (blocking HTTP client), `prom` (Prometheus text), `driver` (readiness,
//! markers, background requests, /proc).

pub mod client;
pub mod driver;
pub mod gen;
pub mod http;
pub mod pace;
pub mod prom;
pub mod publish;
pub mod schedule;

#[cfg(test)]
mod e2e_tests;

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Parser;
use serde_json::{json, Value};

use crate::streams::sys::now_ns;
use http::ServerShape;
use publish::{GenConfig, Generator, Zctx};
use schedule::Schedule;

/// `kv-fleet` flags.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "kv-fleet",
    about = "Many simulated SGLang servers publishing KV events (ZeroMQ PUB + replay ROUTER per DP rank) in one process, and the driver that measures a gateway fed by them"
)]
pub struct FleetArgs {
    /// Servers in the whole fleet (over all shards).
    #[arg(long, default_value_t = 128)]
    pub servers: usize,
    /// DP ranks (publishers) per server.
    #[arg(long, default_value_t = 8)]
    pub dp: usize,
    /// This process hosts shard K of N (servers K·W/N .. (K+1)·W/N).
    #[arg(long, default_value = "0/1")]
    pub shard: String,
    /// Tokens per block (SGLang's page size).
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Blocks one rank holds before removing least recently stored leaves (0: 3M / publishers,
    /// at most 2,048, so the gateway's 4 Mi-block index never evicts on its own).
    #[arg(long, default_value_t = 0)]
    pub blocks_per_rank: usize,
    /// Batches each rank's replay buffer keeps.
    #[arg(long, default_value_t = 64)]
    pub replay_batches: usize,
    /// Bytes each rank's replay buffer keeps at most.
    #[arg(long, default_value_t = 1 << 20)]
    pub replay_bytes: usize,
    /// Aggregate rates of stored blocks per second, one phase each (0 = idle: nothing
    /// published, background requests only); k and M suffixes.
    #[arg(long, default_value = "0,100000")]
    pub rates: String,
    /// Seconds per phase.
    #[arg(long, default_value_t = 10.0)]
    pub duration: f64,
    /// Quiet seconds after each phase (the gateway drains; late markers are probed).
    #[arg(long, default_value_t = 6.0)]
    pub settle: f64,
    /// Markers per second during phases with a rate (driving shard only).
    #[arg(long, default_value_t = 20.0)]
    pub marker_rate: f64,
    /// Blocks per marker.
    #[arg(long, default_value_t = 4)]
    pub marker_blocks: usize,
    /// Marker probes per second at most, over all outstanding markers (each is probed every
    /// 1 ms, or less often when many are outstanding), so a far-behind gateway is not flooded.
    #[arg(long, default_value_t = 500.0)]
    pub max_probe_rate: f64,
    /// Background `/generate` requests per second in every phase (driving shard only).
    #[arg(long, default_value_t = 200.0)]
    pub bg_rate: f64,
    /// Pinned seed conversations per rank (the background requests' prompts).
    #[arg(long, default_value_t = 1)]
    pub seeds_per_rank: usize,
    /// Chance per request of an AllBlocksCleared instead (off by default).
    #[arg(long, default_value_t = 0.0)]
    pub clear_chance: f64,
    /// The gateway's listener (HOST:PORT): makes this process the driving shard.
    #[arg(long)]
    pub gateway: Option<SocketAddr>,
    /// The gateway's Prometheus listener (HOST:PORT).
    #[arg(long)]
    pub metrics: Option<SocketAddr>,
    /// The gateway's PID (its threads' CPU and memory from /proc).
    #[arg(long)]
    pub gateway_pid: Option<u32>,
    /// A file holding the gateway's PID (read once the gateway is ready), for a gateway
    /// started after the fleet.
    #[arg(long)]
    pub gateway_pid_file: Option<PathBuf>,
    /// Seconds to wait for the gateway's /readiness (then the phases run anyway).
    #[arg(long, default_value_t = 300.0)]
    pub ready_timeout: f64,
    /// File the driving shard writes the schedule's start (Unix ms) to, and other shards wait
    /// for; without it a lone process starts at once (driving: once the gateway is ready).
    #[arg(long)]
    pub start_file: Option<PathBuf>,
    /// Directory for results (`phases.jsonl` of the driver, `shard-K.jsonl` of each shard).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Server s listens for HTTP on this + s.
    #[arg(long, default_value_t = 11000)]
    pub http_base: u16,
    /// Server s rank r publishes on this + s·D + r.
    #[arg(long, default_value_t = 12100)]
    pub pub_base: u16,
    /// Server s rank r replays on this + s·D + r.
    #[arg(long, default_value_t = 20400)]
    pub replay_base: u16,
    /// libzmq I/O threads.
    #[arg(long, default_value_t = 1)]
    pub io_threads: usize,
    /// Pacing slice, µs.
    #[arg(long, default_value_t = 1000)]
    pub tick_us: u64,
    /// Served model name.
    #[arg(long, default_value = "fleet-model")]
    pub model_name: String,
    /// RNG seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Nice increment of the generator and replay threads (so libzmq's I/O thread, the HTTP side
    /// and the driver's clients, on the same CPU, run first: a saturated generator falls
    /// behind instead of starving them).
    #[arg(long, default_value_t = 10)]
    pub gen_nice: i32,
}

impl FleetArgs {
    /// `(K, N)` of `--shard`.
    pub fn shard(&self) -> Result<(usize, usize), String> {
        let (k, n) = self.shard.split_once('/').ok_or("--shard is K/N")?;
        let (k, n): (usize, usize) = (
            k.parse().map_err(|_| "--shard K/N: K")?,
            n.parse().map_err(|_| "--shard K/N: N")?,
        );
        if n == 0 || k >= n {
            return Err("--shard K/N needs K < N".into());
        }
        Ok((k, n))
    }

    /// This shard's servers.
    pub fn servers_of_shard(&self) -> Result<std::ops::Range<usize>, String> {
        let (k, n) = self.shard()?;
        Ok(k * self.servers / n..(k + 1) * self.servers / n)
    }

    /// Blocks per rank in force.
    pub fn capacity(&self) -> usize {
        match self.blocks_per_rank {
            0 => (3_000_000 / (self.servers * self.dp).max(1)).clamp(256, 2048),
            n => n,
        }
    }

    /// The servers' shape.
    pub fn shape(&self) -> ServerShape {
        ServerShape {
            model: self.model_name.clone(),
            dp: self.dp,
            block_size: self.block_size,
            http_base: self.http_base,
            pub_base: self.pub_base,
            replay_base: self.replay_base,
            buffer_steps: self.replay_batches,
        }
    }
}

/// Lower the calling thread's priority by `n` from the process's (best effort).
pub fn nice_this_thread(n: i32) {
    // SAFETY: getpriority/setpriority on this thread's id.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        let now = libc::getpriority(libc::PRIO_PROCESS, tid);
        libc::setpriority(libc::PRIO_PROCESS, tid, (now + n).clamp(-20, 19));
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A running shard: its servers and publishers, before the schedule.
pub struct Fleet {
    /// Flags.
    pub args: FleetArgs,
    /// Set to stop every thread.
    pub stop: Arc<AtomicBool>,
    /// The seed prompts (server, tokens) of this shard.
    pub seeds: Arc<Vec<publish::Seed>>,
    gen: Option<Generator>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// Counters of the HTTP side.
    pub http: Arc<http::HttpStats>,
    /// Counters of the replay side.
    pub replay: Arc<publish::ReplayStats>,
    _ctx: Arc<Zctx>,
}

impl Fleet {
    /// Bind every server and rank of this shard, store the seeds, start the HTTP and replay
    /// threads.
    pub fn start(args: FleetArgs) -> Result<Fleet, String> {
        let servers = args.servers_of_shard()?;
        let shape = args.shape();
        shape.check(args.servers)?;
        let publishers = servers.len() * args.dp;
        let ctx =
            Arc::new(Zctx::new(2 * publishers + 64, args.io_threads).map_err(|e| e.to_string())?);
        let stop = Arc::new(AtomicBool::new(false));
        let list: Vec<usize> = servers.clone().collect();
        let listeners = http::bind(&shape, &list).map_err(|e| e.to_string())?;
        let mut pubs = Vec::with_capacity(publishers);
        let mut replays = Vec::with_capacity(publishers);
        for s in servers.clone() {
            for r in 0..args.dp {
                let (p, rp) = publish::open_rank(
                    &ctx,
                    s,
                    r as u32,
                    shape.pub_port(s, r),
                    shape.replay_port(s, r),
                    args.replay_batches,
                    args.replay_bytes,
                )
                .map_err(|e| e.to_string())?;
                pubs.push(p);
                replays.push(rp);
            }
        }
        let total = (args.servers * args.dp).max(1);
        let (k, _) = args.shard()?;
        let cfg = GenConfig {
            block_size: args.block_size,
            blocks_per_rank: args.capacity(),
            share: publishers as f64 / total as f64,
            marker_rate: if args.gateway.is_some() {
                args.marker_rate
            } else {
                0.0
            },
            marker_blocks: args.marker_blocks.max(1),
            seeds_per_rank: args.seeds_per_rank,
            tick_us: args.tick_us,
            clear_chance: args.clear_chance,
            seed: args.seed ^ (k as u64).wrapping_mul(0x9e37_79b9),
        };
        let mut gen = Generator::new(cfg, pubs);
        let seeds = Arc::new(gen.seed());
        let http_stats = Arc::new(http::HttpStats::default());
        let replay_stats = Arc::new(publish::ReplayStats::default());
        let mut threads = Vec::new();
        {
            let (stop, st) = (stop.clone(), http_stats.clone());
            let list = list.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("fleet-http".into())
                    .spawn(move || {
                        if let Err(e) = http::serve(shape, list, listeners, stop, st) {
                            eprintln!("kv-fleet: http: {e}");
                        }
                    })
                    .map_err(|e| e.to_string())?,
            );
        }
        {
            let (stop, st, nice) = (stop.clone(), replay_stats.clone(), args.gen_nice);
            threads.push(
                std::thread::Builder::new()
                    .name("fleet-replay".into())
                    .spawn(move || {
                        nice_this_thread(nice);
                        publish::serve_replay(replays, stop, st)
                    })
                    .map_err(|e| e.to_string())?,
            );
        }
        // libzmq's I/O thread keeps the normal priority: a saturated generator must fall
        // behind (achieved < offered, reported), not starve the sends it queued.
        Ok(Fleet {
            args,
            stop,
            seeds,
            gen: Some(gen),
            threads,
            http: http_stats,
            replay: replay_stats,
            _ctx: ctx,
        })
    }

    /// Stop the threads and wait for them.
    pub fn shutdown(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }

    /// Take the generator (to run a schedule on a thread of the caller's).
    pub fn take_generator(&mut self) -> Option<Generator> {
        self.gen.take()
    }
}

/// Wait for the start file and read the Unix ms in it.
fn read_start_file(path: &PathBuf, timeout: Duration, stop: &AtomicBool) -> Option<u64> {
    let t0 = now_ns();
    while (now_ns() - t0) < timeout.as_nanos() as u64 && !stop.load(Ordering::Relaxed) {
        if let Some(ms) = std::fs::read_to_string(path)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            return Some(ms);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

fn write_start_file(path: &PathBuf, ms: u64) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, format!("{ms}\n"))?;
    std::fs::rename(tmp, path)
}

/// Unix ms → CLOCK_MONOTONIC ns.
fn mono_of_unix_ms(ms: u64) -> u64 {
    let (mono, unix) = (now_ns(), unix_ms());
    (mono as i128 + (ms as i128 - unix as i128) * 1_000_000).max(0) as u64
}

fn append_line(path: &std::path::Path, v: &Value) {
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = writeln!(f, "{v}");
    }
}

/// Run `kv-fleet` to the end of its schedule.
pub fn run(args: FleetArgs) -> Result<(), String> {
    let (k, n) = args.shard()?;
    let phases = schedule::parse_rates(&args.rates, args.duration)?;
    let servers = args.servers_of_shard()?;
    eprintln!(
        "kv-fleet: shard {k}/{n}: servers {}..{} × {} ranks = {} publishers (fleet {}), {} blocks per rank, HTTP {}.., PUB {}.., replay {}..",
        servers.start,
        servers.end,
        args.dp,
        servers.len() * args.dp,
        args.servers * args.dp,
        args.capacity(),
        args.shape().http_port(servers.start),
        args.shape().pub_port(servers.start, 0),
        args.shape().replay_port(servers.start, 0),
    );
    let mut fleet = Fleet::start(args.clone())?;
    let stop = fleet.stop.clone();
    // SIGTERM/SIGINT end the run early (results so far are still written).
    crate::signals::stop_on_signal(stop.clone());
    if let Some(out) = &args.out {
        let _ = std::fs::create_dir_all(out);
    }
    eprintln!(
        "kv-fleet: shard {k}/{n} listening; {} seed prompts",
        fleet.seeds.len()
    );
    // The start of phase 0.
    let mut ready_info = json!(null);
    let start_ms = if let Some(gw) = args.gateway {
        let (ready, secs, body) = wait_ready(gw, &args, &stop);
        let samples = driver::scrape(args.metrics);
        let warm = prom::sum(&samples, "radixgate_kv_warm_workers", &[]);
        let sources = prom::sum(&samples, "radixgate_kv_index_sources", &[]);
        eprintln!(
            "kv-fleet: gateway ready={ready} after {secs:.1}s; warm workers {warm:?}, index sources {sources:?}; {body}"
        );
        ready_info = json!({"ready": ready, "seconds": secs, "body": body,
                            "warm_workers": warm, "index_sources": sources});
        let ms = unix_ms() + 500;
        if let Some(f) = &args.start_file {
            write_start_file(f, ms).map_err(|e| format!("start file: {e}"))?;
        }
        ms
    } else if let Some(f) = &args.start_file {
        read_start_file(
            f,
            Duration::from_secs_f64(args.ready_timeout + 120.0),
            &stop,
        )
        .ok_or("no start time in --start-file")?
    } else {
        unix_ms() + 200
    };
    let sched = Schedule {
        start_ns: mono_of_unix_ms(start_ms),
        phases: phases.clone(),
        settle_s: args.settle,
    };
    // The generator on its own (niced) thread; the driver measures on this one.
    let mut gen = fleet.take_generator().ok_or("no generator")?;
    let (mtx, mrx) = std::sync::mpsc::channel();
    let markers_on = args.gateway.is_some();
    let gen_thread = {
        let (sched, stop, nice) = (sched.clone(), stop.clone(), args.gen_nice);
        std::thread::Builder::new()
            .name("fleet-gen".into())
            .spawn(move || {
                nice_this_thread(nice);
                let out = gen.run(&sched, markers_on.then_some(mtx), &stop);
                (out, gen)
            })
            .map_err(|e| e.to_string())?
    };
    let driven = match args.gateway {
        Some(gw) => Some(drive(&args, gw, &sched, &fleet, mrx, &stop)),
        None => {
            drop(mrx);
            None
        }
    };
    let (outs, _gen) = gen_thread.join().map_err(|_| "generator panicked")?;
    // Non-driving shards keep serving (HTTP, replay) a while after the schedule, so the
    // driver's late probes and final scrapes find every server.
    if args.gateway.is_none() {
        publish::sleep_until(sched.end_ns() + 8_000_000_000, &stop);
    }
    for (i, o) in outs.iter().enumerate() {
        let mut v = o.to_json();
        v["phase"] = json!(i);
        v["rate"] = json!(phases[i].rate);
        v["shard"] = json!(k);
        v["publishers"] = json!(servers.len() * args.dp);
        eprintln!("kv-fleet: shard {k} phase {i}: {v}");
        if let Some(out) = &args.out {
            append_line(&out.join(format!("shard-{k}.jsonl")), &v);
        }
    }
    if let (Some(out), Some(rows)) = (&args.out, driven) {
        append_line(&out.join("ready.json"), &ready_info);
        for r in rows {
            append_line(&out.join("phases.jsonl"), &r);
        }
    }
    fleet.shutdown();
    Ok(())
}

fn wait_ready(gw: SocketAddr, args: &FleetArgs, stop: &AtomicBool) -> (bool, f64, String) {
    driver::wait_ready(gw, Duration::from_secs_f64(args.ready_timeout), stop)
}

/// The driving shard's side of the schedule: background requests and marker probes on their
/// threads; per phase, the gateway's counters and /proc at its edges. Returns one JSON row per
/// phase.
fn drive(
    args: &FleetArgs,
    gw: SocketAddr,
    sched: &Schedule,
    fleet: &Fleet,
    markers: std::sync::mpsc::Receiver<publish::Marker>,
    stop: &Arc<AtomicBool>,
) -> Vec<Value> {
    let np = sched.phases.len();
    let phase = Arc::new(AtomicI64::new(-1));
    let mres = Arc::new(Mutex::new(Vec::new()));
    let bres = Arc::new(Mutex::new(Vec::new()));
    let probe = {
        let r = mres.clone();
        let max_probe = args.max_probe_rate;
        std::thread::Builder::new()
            .name("fleet-probe".into())
            .spawn(move || driver::probe_markers(gw, markers, np, r, max_probe))
            .expect("spawn probe")
    };
    let bg = {
        let (r, seeds, ph, stop) = (
            bres.clone(),
            fleet.seeds.clone(),
            phase.clone(),
            stop.clone(),
        );
        let (rate, seed) = (args.bg_rate, args.seed);
        std::thread::Builder::new()
            .name("fleet-bg".into())
            .spawn(move || driver::background(gw, seeds, rate, ph, np, r, stop, seed))
            .expect("spawn bg")
    };
    let pid = args.gateway_pid.or_else(|| {
        let f = args.gateway_pid_file.as_ref()?;
        std::fs::read_to_string(f).ok()?.trim().parse().ok()
    });
    let mut edges = Vec::new();
    for (i, p) in sched.phases.iter().enumerate() {
        let (start, end) = sched.window(i);
        publish::sleep_until(start, stop);
        let loadavg = std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok());
        let a = driver::scrape(args.metrics);
        let pa = driver::read_proc(pid);
        phase.store(i as i64, Ordering::Relaxed);
        let mut peak = pa.rss_kb;
        while now_ns() < end && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(200));
            peak = peak.max(driver::read_proc(pid).rss_kb);
        }
        phase.store(-1, Ordering::Relaxed);
        let (pub_lo, pub_hi) = (
            args.pub_base,
            args.pub_base
                .saturating_add((args.servers * args.dp) as u16),
        );
        let queues = driver::tcp_queues(pub_lo, pub_hi);
        let pb = driver::read_proc(pid);
        let b = driver::scrape(args.metrics);
        publish::sleep_until(end + (args.settle * 1e9) as u64 - 300_000_000, stop);
        let queues_settled = driver::tcp_queues(pub_lo, pub_hi);
        let pc = driver::read_proc(pid);
        let c = driver::scrape(args.metrics);
        let secs = (pb.at_ns - pa.at_ns) as f64 / 1e9;
        let settle_secs = (pc.at_ns - pb.at_ns) as f64 / 1e9;
        let mut row = json!({
            "phase": i, "rate": p.rate, "secs": secs,
            "publishers": args.servers * args.dp, "servers": args.servers, "dp": args.dp,
            "blocks_per_rank": args.capacity(), "block_size": args.block_size,
            "gateway": driver::gateway_figures(&a, &b, &c, secs),
            "kv_cpu_pct": driver::cpu_pct(pa.kv_ticks, pb.kv_ticks, secs),
            "gw_cpu_pct": driver::cpu_pct(pa.all_ticks, pb.all_ticks, secs),
            "kv_cpu_pct_settle": driver::cpu_pct(pb.kv_ticks, pc.kv_ticks, settle_secs),
            "rss_mib_start": pa.rss_kb as f64 / 1024.0,
            "rss_mib_peak": peak.max(pb.rss_kb) as f64 / 1024.0,
            "rss_mib_end": pb.rss_kb as f64 / 1024.0,
            "rss_mib_after_settle": pc.rss_kb as f64 / 1024.0,
            "hwm_mib": pc.hwm_kb as f64 / 1024.0,
            "loadavg_start": loadavg,
            "tcp_end": {"gateway_unread_mib": queues.0 as f64 / 1048576.0,
                        "fleet_unsent_mib": queues.1 as f64 / 1048576.0,
                        "gateway_connections_behind": queues.2},
            "tcp_after_settle": {"gateway_unread_mib": queues_settled.0 as f64 / 1048576.0,
                                 "fleet_unsent_mib": queues_settled.1 as f64 / 1048576.0,
                                 "gateway_connections_behind": queues_settled.2},
        });
        eprintln!(
            "kv-fleet: phase {i} (rate {}) gateway: {}",
            p.rate, row["gateway"]
        );
        edges.push(row.take());
    }
    // The background thread checks the phase flag; it ends with the fleet's stop flag, set
    // only at shutdown, so it is left to finish with the process.
    drop(bg);
    // Markers of the last phase get their 5 s.
    let _ = probe.join();
    let m = mres.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let b = bres.lock().unwrap_or_else(|e| e.into_inner()).clone();
    for (i, row) in edges.iter_mut().enumerate() {
        if let Some(ms) = m.get(i) {
            let mut s = ms.staleness_ms.clone();
            s.sort_by(|x, y| x.total_cmp(y));
            row["markers"] = json!({
                "published": s.len() as u64 + ms.never, "routed": s.len(), "never": ms.never,
                "p50_ms": driver::pct(&s, 0.5), "p99_ms": driver::pct(&s, 0.99),
                "max_ms": s.last(), "probes": ms.probes, "probe_errors": ms.errors,
            });
        }
        if let Some(bs) = b.get(i) {
            let mut l = bs.latency_us.clone();
            l.sort_unstable();
            let f = |q| driver::pct(&l.iter().map(|&x| x as f64).collect::<Vec<_>>(), q);
            row["background"] = json!({
                "answered": l.len(), "errors": bs.errors, "to_holder": bs.to_holder,
                "p50_us": f(0.5), "p99_us": f(0.99), "max_us": l.last(),
            });
        }
    }
    edges
}
