//! The text tree's one writer thread under the insert rate of 2, 8 and 32 serving cores, and its
//! ceiling (not criterion: a harness that prints a markdown table; `scripts/bench-tree-writer.sh`
//! runs it and puts the table in docs/benchmarks.md).
//!
//! Workload: chat prompts of 1–32 KiB. 32 system prompts (1–4 KiB after a common preamble,
//! skewed popularity) shared across conversations; each conversation has its own first user
//! message, and its turn k+1 extends turn k by an assistant reply and a user message; it ends at
//! a length drawn from 1–32 KiB. Each conversation stays on one of 16 workers (what cache_aware
//! does). A simulated core keeps its share of 8,192 live conversations and sends the next turn
//! of one of them at random, so the turns of one conversation are spread out in time like real
//! ones. Every prompt is a slice of its conversation's one buffer (a real core copies the text out
//! of the request body; that copy is the core's cost, not the writer's).
//!
//! - `rate`: `cores` producer threads (the simulated serving cores) offer `cores × per-core`
//!   inserts/s through `TreeHandle::try_insert` (never blocking: a full channel drops and counts),
//!   paced in bursts every ~0.5 ms, with the gateway's default writer settings. The producers and the
//!   observer are pinned to CPU 0; the writer is left to the other CPU (a gateway's serving cores
//!   and its writer share the machine the same way). The observer thread samples the channel
//!   depth (messages and bytes queued) every ~50 µs and, for one insert in 8, finds the first
//!   published snapshot in which the prompt matches in full for its worker: the *staleness* of
//!   that request's turn for its next turn (the time from the `try_insert` to the observer
//!   seeing that snapshot, so it includes up to one polling period). Writer CPU is read from
//!   `/proc/self/task/<writer>/schedstat`.
//! - `ceiling`: the same sequence of prompts queued first (a writer held before its first read,
//!   `spawn_writer_held`), then drained by the writer alone: inserts/s and writer CPU per insert
//!   over the second half (the first half builds the tree it works on). Then, by prompt size, the
//!   CPU of `RadixTree::insert` itself on the same sequence replayed directly, with a snapshot
//!   taken (and the fifth-last one freed) as often as the writer published.
//!
//! The writer lowers its own priority to nice 10 (it yields to serving cores); this bench, run as
//! root on a machine other jobs share, sets it back to 0 unless told `--writer-nice keep`.
//!
//! `cargo bench --bench tree_writer -- [--runs N] [--secs S] [--warmup S] [--cores 2,8,32]
//! [--per-core R] [--ceiling N] [--only rate|ceiling] [--writer-nice N|keep]
//! [--max-tree-chars N]`; each figure is the median of the runs.
mod words;
use words::{Rng, Words};

use radixgate::base::text::SharedText;
use radixgate::base::WorkerId;
use radixgate::tree::{spawn_writer, spawn_writer_held, Insert, RadixTree, TreeKey, WriterConfig};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The gateway binary's allocator: the writer allocates per path copy and per new edge.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

const WORKERS: u64 = 16;

/// `--max-tree-size` of the runs (`--max-tree-chars`; the gateway's default, 2^26, unless
/// told): a smaller one makes the tree reach its bound within the run, so the writer evicts
/// and reuses memory as a long-running gateway's does instead of growing into fresh memory.
static MAX_CHARS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1 << 26);

fn writer_config() -> WriterConfig {
    WriterConfig {
        max_chars_per_worker: MAX_CHARS.load(Ordering::Relaxed),
        ..WriterConfig::default()
    }
}
const LIVE_CONVERSATIONS: usize = 8192;
const SAMPLE_EVERY: u64 = 8;
const MAX_PROMPT: usize = 32 * 1024;

/// 8 MiB of pseudo-words (some non-ASCII) and the shared system prompts; conversations copy
/// random slices of it.
struct Corpus {
    text: String,
    systems: Vec<String>,
}

impl Corpus {
    fn new(seed: u64) -> Corpus {
        // The tree bench's words: the same vocabulary and skew, then its generator goes on.
        let mut words = Words::new(seed);
        let mut text = String::with_capacity(8 << 20);
        words.push(&mut text, 8 << 20);
        let mut rng = words.rng;
        let mut c = Corpus {
            text,
            systems: Vec::new(),
        };
        let preamble = format!("You are a helpful assistant. {}", c.slice(&mut rng, 300));
        c.systems = (0..32)
            .map(|_| {
                let n = rng.range(700, 3800);
                format!("{preamble}\n{}", c.slice(&mut rng, n))
            })
            .collect();
        c
    }

    /// About `len` bytes from a random place (cut to character boundaries).
    fn slice(&self, rng: &mut Rng, len: usize) -> &str {
        let t = &self.text;
        let mut a = rng.below(t.len() - len - 8);
        while !t.is_char_boundary(a) {
            a += 1;
        }
        let mut b = a + len;
        while !t.is_char_boundary(b) {
            b += 1;
        }
        &t[a..b]
    }
}

/// One conversation: its whole text once, the end of each turn's prompt, its worker.
struct Conv {
    text: SharedText,
    ends: Vec<u32>,
    next: usize,
    worker: WorkerId,
}

/// Makes conversations and hands out their turns, `live` conversations at a time.
struct Gen {
    corpus: Arc<Corpus>,
    rng: Rng,
    live: Vec<Conv>,
    now_ms: u64,
}

impl Gen {
    fn new(corpus: Arc<Corpus>, seed: u64, live: usize) -> Gen {
        let mut g = Gen {
            corpus,
            rng: Rng(seed),
            live: Vec::with_capacity(live),
            now_ms: 0,
        };
        for _ in 0..live {
            let c = g.conversation();
            g.live.push(c);
        }
        g
    }

    fn conversation(&mut self) -> Conv {
        let c = &*self.corpus;
        let rng = &mut self.rng;
        // Popular system prompts: the square of a uniform favours the first ones.
        let u = rng.below(1 << 16) as u64;
        let sys = &c.systems[((u * u * c.systems.len() as u64) >> 32) as usize];
        let target = rng.range(1024, MAX_PROMPT + 1);
        let mut s = String::with_capacity(target + 4096);
        s.push_str(sys);
        s.push_str("\n\nUser: ");
        let n = rng.range(100, 1000);
        s.push_str(c.slice(rng, n));
        let mut ends = vec![s.len() as u32];
        while s.len() < target {
            s.push_str("\nAssistant: ");
            let n = rng.range(300, 2500);
            s.push_str(c.slice(rng, n));
            s.push_str("\nUser: ");
            let n = rng.range(50, 500);
            s.push_str(c.slice(rng, n));
            if s.len() > MAX_PROMPT {
                let mut cut = MAX_PROMPT;
                while !s.is_char_boundary(cut) {
                    cut -= 1;
                }
                s.truncate(cut);
            }
            ends.push(s.len() as u32);
        }
        Conv {
            text: SharedText::from_string(s),
            ends,
            next: 0,
            worker: rng.below(WORKERS as usize) as WorkerId,
        }
    }

    /// The next turn of a random live conversation (a new conversation replaces a finished one).
    fn next(&mut self) -> Insert {
        let i = self.rng.below(self.live.len());
        let c = &mut self.live[i];
        let end = c.ends[c.next] as usize;
        c.next += 1;
        let text = SharedText::within(c.text.bytes(), &c.text.as_str()[..end]);
        let worker = c.worker;
        if c.next == c.ends.len() {
            self.live[i] = self.conversation();
        }
        self.now_ms += 1;
        Insert {
            tree: TreeKey::Default,
            text,
            worker,
            now_ms: self.now_ms / 64,
        }
    }
}

// ---- measurement helpers -------------------------------------------------------------------

/// The writer thread's id (the only thread named `radixgate-tree-*` alive).
fn writer_tid() -> Option<u32> {
    for _ in 0..1000 {
        if let Ok(dir) = std::fs::read_dir("/proc/self/task") {
            for e in dir.flatten() {
                let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
                if comm.starts_with("radixgate-tree") {
                    return e.file_name().to_str().and_then(|s| s.parse().ok());
                }
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    None
}

/// CPU time of a thread of this process, in ns (0 once it is gone).
fn thread_cpu_ns(tid: Option<u32>) -> u64 {
    let Some(tid) = tid else { return 0 };
    std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

/// CPU time of the calling thread, in ns (CPU, not wall: this machine's other load preempts).
fn thread_cpu_now() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write; the clock id is a constant the kernel knows.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Waits until the writer thread has exited (it frees the tree on its way out).
fn wait_gone(tid: Option<u32>) {
    let Some(tid) = tid else { return };
    let path = format!("/proc/self/task/{tid}");
    let t = Instant::now();
    while std::path::Path::new(&path).exists() && t.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn pin_to_cpu0() {
    if let Some(ids) = core_affinity::get_core_ids() {
        if let Some(id) = ids.first() {
            core_affinity::set_for_current(*id);
        }
    }
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i]
}

fn median(mut v: Vec<f64>) -> f64 {
    percentile(&mut v, 0.5)
}

// ---- rate runs -----------------------------------------------------------------------------

struct Sample {
    text: SharedText,
    worker: WorkerId,
    sent: Instant,
}

#[derive(Default, Clone)]
struct RateRun {
    offered: f64,
    applied: f64,
    dropped: f64,
    depth_msgs_p99: f64,
    depth_msgs_max: f64,
    depth_mib_p99: f64,
    depth_mib_max: f64,
    stale_p50_ms: f64,
    stale_p99_ms: f64,
    stale_max_ms: f64,
    unseen: f64,
    writer_cpu: f64,
    ns_per_insert: f64,
    publishes: f64,
}

fn visible(tree: &RadixTree, s: &Sample) -> bool {
    let m = tree.longest_match(s.text.as_str());
    m.matched_bytes == s.text.len() && m.workers.binary_search(&s.worker).is_ok()
}

/// Sets a thread's nice value (the writer lowers its own to 10; as root the bench may set it
/// back, so that this shared machine's other load does not starve it).
fn renice(tid: Option<u32>, nice: Option<i32>) {
    if let (Some(tid), Some(nice)) = (tid, nice) {
        // SAFETY: plain integers; a failure only leaves the priority as it was.
        let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) };
        if r != 0 {
            eprintln!(
                "tree_writer: cannot set the writer's nice value to {nice}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

fn rate_run(
    corpus: &Arc<Corpus>,
    cores: usize,
    per_core: f64,
    warmup: f64,
    secs: f64,
    seed: u64,
    nice: Option<i32>,
) -> RateRun {
    let h = spawn_writer(writer_config());
    let tid = writer_tid();
    // The writer lowers its priority as it starts: wait for that before setting ours.
    std::thread::sleep(Duration::from_millis(20));
    renice(tid, nice);
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let measure_from = t0 + Duration::from_secs_f64(warmup);
    let end = measure_from + Duration::from_secs_f64(secs);
    let mut senders = Vec::new();
    let mut producers = Vec::new();
    for c in 0..cores {
        let (stx, srx) = crossbeam::channel::unbounded::<Sample>();
        senders.push(srx);
        let h = h.clone();
        let stop = Arc::clone(&stop);
        let mut gen = Gen::new(
            Arc::clone(corpus),
            seed * 1000 + c as u64,
            LIVE_CONVERSATIONS / cores,
        );
        producers.push(std::thread::spawn(move || {
            pin_to_cpu0();
            let mut sent: u64 = 0;
            let mut tried: u64 = 0;
            while !stop.load(Ordering::Relaxed) {
                let due = (t0.elapsed().as_secs_f64() * per_core) as u64;
                while tried < due {
                    let ins = gen.next();
                    tried += 1;
                    let sample = tried % SAMPLE_EVERY == 0;
                    let (text, worker) = (ins.text.clone(), ins.worker);
                    let at = Instant::now();
                    if h.try_insert(ins) {
                        sent += 1;
                        if sample {
                            let _ = stx.send(Sample {
                                text,
                                worker,
                                sent: at,
                            });
                        }
                    }
                }
                // A core's inserts leave in small bursts (a core handles what its ring
                // completed, then the next batch): 32 threads waking for every insert would
                // spend CPU 0 on context switches.
                std::thread::sleep(Duration::from_micros(500));
            }
            (tried, sent)
        }));
    }
    // The observer, on this thread.
    pin_to_cpu0();
    let mut queues: Vec<VecDeque<Sample>> = (0..cores).map(|_| VecDeque::new()).collect();
    let (mut depth_msgs, mut depth_bytes, mut stale) = (Vec::new(), Vec::new(), Vec::new());
    let mut unseen = 0u64;
    let mut last_epoch = u64::MAX;
    let mut at_start = None;
    let stats = h.stats();
    loop {
        let now = Instant::now();
        if now >= end {
            break;
        }
        if now >= measure_from && at_start.is_none() {
            at_start = Some((
                now,
                stats.inserts_applied(),
                stats.dropped(),
                stats.publishes(),
                thread_cpu_ns(tid),
            ));
        }
        if at_start.is_some() {
            depth_msgs.push(h.queued_messages() as f64);
            depth_bytes.push(stats.queued_bytes() as f64);
        }
        let snap = h.load();
        let tree = snap.tree(TreeKey::Default);
        let epoch_changed = snap.epoch() != last_epoch;
        last_epoch = snap.epoch();
        for (q, rx) in queues.iter_mut().zip(&senders) {
            // Samples that arrived since: they may already be in this snapshot.
            let old = q.len();
            q.extend(rx.try_iter());
            let from = if epoch_changed { 0 } else { old };
            let i = from;
            while i < q.len() {
                if visible(tree, &q[i]) {
                    // In this snapshot; every earlier one of this core was checked first (FIFO).
                    let s = q.remove(i).unwrap();
                    if s.sent >= measure_from {
                        stale.push(now.duration_since(s.sent).as_secs_f64() * 1e3);
                    }
                } else if now.duration_since(q[i].sent) > Duration::from_secs(2) {
                    let s = q.remove(i).unwrap();
                    if s.sent >= measure_from {
                        unseen += 1;
                    }
                } else {
                    // A core's inserts are applied in order: later ones are not in it either.
                    break;
                }
            }
        }
        drop(snap);
        std::thread::sleep(Duration::from_micros(50));
    }
    let t_end = Instant::now();
    let (applied1, dropped1, pub1, cpu1) = (
        stats.inserts_applied(),
        stats.dropped(),
        stats.publishes(),
        thread_cpu_ns(tid),
    );
    stop.store(true, Ordering::Relaxed);
    for p in producers {
        let _ = p.join();
    }
    for q in &queues {
        unseen += q.iter().filter(|s| s.sent >= measure_from).count() as u64;
    }
    let (ts, applied0, dropped0, pub0, cpu0) = at_start.expect("measured");
    let wall = t_end.duration_since(ts).as_secs_f64();
    drop(senders);
    drop(h);
    wait_gone(tid);
    let applied = (applied1 - applied0) as f64;
    RateRun {
        offered: cores as f64 * per_core,
        applied: applied / wall,
        dropped: (dropped1 - dropped0) as f64,
        depth_msgs_p99: percentile(&mut depth_msgs, 0.99),
        depth_msgs_max: depth_msgs.iter().copied().fold(0.0, f64::max),
        depth_mib_p99: percentile(&mut depth_bytes, 0.99) / (1 << 20) as f64,
        depth_mib_max: depth_bytes.iter().copied().fold(0.0, f64::max) / (1 << 20) as f64,
        stale_p50_ms: percentile(&mut stale, 0.5),
        stale_p99_ms: percentile(&mut stale, 0.99),
        stale_max_ms: stale.iter().copied().fold(0.0, f64::max),
        unseen: unseen as f64,
        writer_cpu: (cpu1 - cpu0) as f64 / 1e9 / wall,
        ns_per_insert: (cpu1 - cpu0) as f64 / applied.max(1.0),
        publishes: (pub1 - pub0) as f64 / wall,
    }
}

// ---- ceiling -------------------------------------------------------------------------------

struct Ceiling {
    inserts_per_s: f64,
    ns_per_insert: f64,
    inserts_per_publish: f64,
}

fn sequence(corpus: &Arc<Corpus>, n: usize, seed: u64) -> Vec<Insert> {
    let mut g = Gen::new(Arc::clone(corpus), seed, LIVE_CONVERSATIONS);
    (0..n).map(|_| g.next()).collect()
}

fn ceiling_run(seq: &[Insert], nice: Option<i32>) -> Ceiling {
    let (h, held) = spawn_writer_held(WriterConfig {
        channel_capacity: seq.len() + 1,
        channel_bytes: usize::MAX / 2,
        ..writer_config()
    });
    let tid = writer_tid();
    std::thread::sleep(Duration::from_millis(20));
    renice(tid, nice);
    for ins in seq {
        assert!(
            h.try_insert(ins.clone()),
            "the pre-built queue must take every insert"
        );
    }
    let half = (seq.len() / 2) as u64;
    held.start();
    // The first half builds the tree; time the second half.
    while h.stats().inserts_applied() < half {
        std::thread::sleep(Duration::from_micros(20));
    }
    let (t0, cpu0, a0, p0) = (
        Instant::now(),
        thread_cpu_ns(tid),
        h.stats().inserts_applied(),
        h.stats().publishes(),
    );
    h.sync();
    let (wall, cpu1, a1, p1) = (
        t0.elapsed().as_secs_f64(),
        thread_cpu_ns(tid),
        h.stats().inserts_applied(),
        h.stats().publishes(),
    );
    drop(h);
    wait_gone(tid);
    let n = (a1 - a0) as f64;
    Ceiling {
        inserts_per_s: n / wall,
        ns_per_insert: (cpu1 - cpu0) as f64 / n,
        inserts_per_publish: n / (p1 - p0).max(1) as f64,
    }
}

const BUCKETS: [(usize, &str); 5] = [
    (2 << 10, "1–2 KiB"),
    (4 << 10, "2–4 KiB"),
    (8 << 10, "4–8 KiB"),
    (16 << 10, "8–16 KiB"),
    (usize::MAX, "16–32 KiB"),
];

/// Per size bucket: (count, mean ns, p99 ns) of thread CPU time in `RadixTree::insert` (with
/// the writer's immediate eviction; the clock read itself adds ~0.1-0.3 µs) over the second half of `seq`, a snapshot every `every` inserts.
fn by_size(seq: &[Insert], every: usize) -> Vec<(usize, f64, f64)> {
    let cfg = writer_config();
    let hard = (cfg.max_chars_per_worker as f64 * (1.0 + cfg.overflow_margin)) as u64;
    let mut tree = RadixTree::new();
    let mut retired = VecDeque::new();
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); BUCKETS.len()];
    for (i, ins) in seq.iter().enumerate() {
        let t = thread_cpu_now();
        tree.insert(ins.text.as_str(), ins.worker, ins.now_ms);
        if tree.worker_chars(ins.worker) > hard {
            tree.evict_worker(ins.worker, cfg.max_chars_per_worker);
        }
        let dt = thread_cpu_now().saturating_sub(t) as f64;
        if i >= seq.len() / 2 {
            let b = BUCKETS
                .iter()
                .position(|&(hi, _)| ins.text.len() < hi)
                .unwrap_or(4);
            times[b].push(dt);
        }
        if i % every.max(1) == 0 {
            retired.push_back(tree.clone());
            if retired.len() > 4 {
                retired.pop_front();
            }
        }
    }
    times
        .into_iter()
        .map(|mut v| {
            let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
            (v.len(), mean, percentile(&mut v, 0.99))
        })
        .collect()
}

// ---- main ----------------------------------------------------------------------------------

struct Args {
    runs: usize,
    secs: f64,
    warmup: f64,
    cores: Vec<usize>,
    per_core: f64,
    ceiling: usize,
    rate: bool,
    ceil: bool,
    /// The writer's nice value for the run (`None`: as the gateway sets it, 10).
    nice: Option<i32>,
}

fn args() -> Args {
    let mut a = Args {
        runs: 3,
        secs: 3.0,
        warmup: 1.0,
        cores: vec![2, 8, 32],
        per_core: 3125.0,
        ceiling: 200_000,
        rate: true,
        ceil: true,
        nice: Some(0),
    };
    let v: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < v.len() {
        let val = v.get(i + 1).cloned().unwrap_or_default();
        match v[i].as_str() {
            "--runs" => a.runs = val.parse().expect("--runs N"),
            "--secs" => a.secs = val.parse().expect("--secs S"),
            "--warmup" => a.warmup = val.parse().expect("--warmup S"),
            "--per-core" => a.per_core = val.parse().expect("--per-core R"),
            "--ceiling" => a.ceiling = val.parse().expect("--ceiling N"),
            "--cores" => {
                a.cores = val
                    .split(',')
                    .map(|c| c.parse().expect("--cores 2,8,32"))
                    .collect()
            }
            "--max-tree-chars" => {
                MAX_CHARS.store(val.parse().expect("--max-tree-chars N"), Ordering::Relaxed)
            }
            "--writer-nice" => {
                a.nice = if val == "keep" {
                    None
                } else {
                    Some(val.parse().expect("--writer-nice N|keep"))
                }
            }
            "--only" => {
                a.rate = val == "rate";
                a.ceil = val == "ceiling";
            }
            _ => {
                // `cargo bench` passes `--bench`; anything else unknown is ignored too.
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    a
}

fn fmt_n(x: f64) -> String {
    if x.is_nan() {
        return "–".into();
    }
    let n = x.round() as u64;
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

fn main() {
    let a = args();
    let corpus = Arc::new(Corpus::new(7));
    let mut out = String::new();
    if a.rate {
        out.push_str(
            "| cores (offered inserts/s) | applied inserts/s | dropped | channel depth p99 / peak: messages | MiB | previous-turn staleness p50 / p99 / max | never seen | writer CPU | writer ns/insert | publishes/s |\n\
             |---|---|---|---|---|---|---|---|---|---|\n"
        );
        for &cores in &a.cores {
            let runs: Vec<RateRun> = (0..a.runs)
                .map(|r| {
                    let run = rate_run(&corpus, cores, a.per_core, a.warmup, a.secs, 1 + r as u64, a.nice);
                    eprintln!(
                        "tree_writer rate cores={cores} run={r}: offered {:.0}/s applied {:.0}/s dropped {} depth p99/max {}/{} msgs {:.1}/{:.1} MiB staleness p50/p99/max {:.2}/{:.2}/{:.2} ms unseen {} writer cpu {:.2} ns/insert {:.0} publishes/s {:.0}",
                        run.offered, run.applied, run.dropped, run.depth_msgs_p99, run.depth_msgs_max,
                        run.depth_mib_p99, run.depth_mib_max, run.stale_p50_ms, run.stale_p99_ms,
                        run.stale_max_ms, run.unseen, run.writer_cpu, run.ns_per_insert, run.publishes
                    );
                    run
                })
                .collect();
            let m = |f: fn(&RateRun) -> f64| median(runs.iter().map(f).collect());
            out.push_str(&format!(
                "| {cores} ({}) | {} | {} | {} / {} | {:.1} / {:.1} | {:.2} / {:.2} / {:.2} ms | {} | {:.0} % | {} | {} |\n",
                fmt_n(m(|r| r.offered)),
                fmt_n(m(|r| r.applied)),
                fmt_n(m(|r| r.dropped)),
                fmt_n(m(|r| r.depth_msgs_p99)),
                fmt_n(m(|r| r.depth_msgs_max)),
                m(|r| r.depth_mib_p99),
                m(|r| r.depth_mib_max),
                m(|r| r.stale_p50_ms),
                m(|r| r.stale_p99_ms),
                m(|r| r.stale_max_ms),
                fmt_n(m(|r| r.unseen)),
                m(|r| r.writer_cpu) * 100.0,
                fmt_n(m(|r| r.ns_per_insert)),
                fmt_n(m(|r| r.publishes)),
            ));
        }
        out.push('\n');
    }
    if a.ceil {
        let seq = sequence(&corpus, a.ceiling, 99);
        let runs: Vec<Ceiling> = (0..a.runs)
            .map(|r| {
                let c = ceiling_run(&seq, a.nice);
                eprintln!(
                    "tree_writer ceiling run={r}: {:.0} inserts/s, {:.0} ns/insert writer CPU, {:.0} inserts/publish",
                    c.inserts_per_s, c.ns_per_insert, c.inserts_per_publish
                );
                c
            })
            .collect();
        let every = median(runs.iter().map(|c| c.inserts_per_publish).collect());
        let sizes: Vec<Vec<(usize, f64, f64)>> =
            (0..a.runs).map(|_| by_size(&seq, every as usize)).collect();
        let mean_len = seq.iter().map(|i| i.text.len()).sum::<usize>() as f64 / seq.len() as f64;
        out.push_str(&format!(
            "| writer alone on a pre-built queue of {} prompts (mean {:.1} KiB), second half | value |\n|---|---|\n",
            fmt_n(seq.len() as f64),
            mean_len / 1024.0
        ));
        out.push_str(&format!(
            "| ceiling | **{} inserts/s** |\n| writer CPU per insert (all of it: channel, insert, publish, frees) | {} ns |\n| inserts per publication | {} |\n",
            fmt_n(median(runs.iter().map(|c| c.inserts_per_s).collect())),
            fmt_n(median(runs.iter().map(|c| c.ns_per_insert).collect())),
            fmt_n(every)
        ));
        for (b, (_, name)) in BUCKETS.iter().enumerate() {
            let count = sizes[0][b].0;
            out.push_str(&format!(
                "| `RadixTree::insert` {name} ({} prompts): mean / p99 | {} / {} ns |\n",
                fmt_n(count as f64),
                fmt_n(median(sizes.iter().map(|s| s[b].1).collect())),
                fmt_n(median(sizes.iter().map(|s| s[b].2).collect())),
            ));
        }
    }
    println!("{out}");
}
