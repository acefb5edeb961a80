//! Radix tree and tree-writer benchmarks.
//!
//! - `match/{10k,1M}/{len}` and `insert/{10k,1M}/{len}`: prompts of 100 to 100k characters on
//!   trees of ~10k and ~1M nodes built from shared-prefix chat traffic (system prompts with a
//!   common preamble, single-shot questions, multi-turn chats that sometimes move to another
//!   worker, long agent sessions and long shared documents). `insert` inserts into a fresh clone
//!   of the tree, so every node on the path is path-copied (the first touch after a publish, the
//!   worst case); `insert_owned` inserts into a tree the writer already owns.
//! - `writer/2k_prompts`: inserts per second through the real channel and writer thread.
//! - `evict/pass`: one eviction pass (every worker to 90 % of its characters) over the 1M-node
//!   tree (well over 10M characters).
//!
//! Memory per node is printed after the tree benchmarks (requested bytes, and rounded up to
//! mimalloc's size classes, the allocator the gateway runs on).
use criterion::{BatchSize, BenchmarkId, Criterion, Throughput};
use radixgate::base::WorkerId;
use radixgate::tree::{spawn_writer, Insert, RadixTree, WriterConfig};
use std::hint::black_box;
use std::time::{Duration, Instant};

mod common;

mod words;
use words::{Rng, Words};

/// Exactly `n` characters of `s` (or all of it).
fn take_chars(s: &str, n: usize) -> &str {
    match s.char_indices().nth(n) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

const WORKERS: usize = 16;

/// A tree plus texts known to be in it, to build probes from.
struct Built {
    tree: RadixTree,
    /// Chat texts as inserted (mostly 1-3k characters).
    chats: Vec<String>,
    /// Agent sessions (~20k characters).
    sessions: Vec<String>,
    /// Long shared documents (~120k characters).
    docs: Vec<String>,
    now: u64,
}

fn build(target_nodes: usize, seed: u64) -> Built {
    let mut w = Words::new(seed);
    let mut rng = Rng(seed ^ 0x5eed);
    let mut tree = RadixTree::new();
    let mut now = 0u64;
    let preamble = format!("You are a helpful assistant. {}", w.text(300));
    let systems: Vec<String> = (0..64)
        .map(|_| format!("{preamble}\n{}", w.text(rng.range(800, 2200))))
        .collect();
    // Long shared documents (RAG over the same corpus), each with its own question.
    let corpus = w.text(120_000);
    let mut docs = Vec::new();
    for i in 0..4 {
        let doc = format!(
            "{}\n\nDocument:\n{corpus}\nQuestion: {}",
            systems[0],
            w.text(80)
        );
        tree.insert(&doc, i as WorkerId, now);
        now += 1;
        docs.push(doc);
    }
    // Agent sessions: histories growing by tool outputs up to ~20k characters.
    let mut sessions = Vec::new();
    for i in 0..16 {
        let mut s = format!("{}\n\nUser: {}", systems[i % 64], w.text(200));
        while s.len() < 20_000 {
            s.push_str("\nTool: ");
            w.push(&mut s, 1500);
            tree.insert(&s, (i % WORKERS) as WorkerId, now);
            now += 1;
        }
        sessions.push(s);
    }
    let mut chats = Vec::new();
    while tree.node_count() < target_nodes {
        // System prompts are skewed too: a few are very popular.
        let sys = &systems[(rng.below(64) * rng.below(64)) / 64];
        let mut worker = rng.below(WORKERS) as WorkerId;
        let mut text = String::with_capacity(4096);
        text.push_str(sys);
        text.push_str("\n\nUser: ");
        let n = rng.range(20, 120);
        w.push(&mut text, n);
        tree.insert(&text, worker, now);
        now += 1;
        if rng.below(10) < 3 {
            for _ in 0..rng.range(1, 5) {
                text.push_str("\nAssistant: ");
                let n = rng.range(40, 160);
                w.push(&mut text, n);
                text.push_str("\nUser: ");
                let n = rng.range(20, 80);
                w.push(&mut text, n);
                if rng.below(8) == 0 {
                    worker = rng.below(WORKERS) as WorkerId;
                }
                tree.insert(&text, worker, now);
                now += 1;
            }
        }
        if chats.len() < 256 && rng.below(64) == 0 {
            chats.push(text);
        }
    }
    Built {
        tree,
        chats,
        sessions,
        docs,
        now,
    }
}

/// Up to 64 prompts of exactly `len` characters whose prefixes are in the tree (a new turn of a
/// known conversation: known text, then new text).
fn probes(b: &Built, len: usize, seed: u64) -> Vec<String> {
    let mut w = Words::new(seed);
    let sources: &[String] = if len > 20_000 {
        &b.docs
    } else if len > 2_000 {
        &b.sessions
    } else {
        &b.chats
    };
    (0..64)
        .map(|i| {
            let src = &sources[i % sources.len()];
            let mut p = take_chars(src, len).to_owned();
            let have = p.chars().count();
            if have < len {
                p.push_str("\nUser: ");
                w.push(&mut p, len - have);
            }
            take_chars(&p, len).to_owned()
        })
        .collect()
}

const LENS: [usize; 5] = [100, 1_000, 4_000, 10_000, 100_000];

fn bench_tree(c: &mut Criterion, name: &str, b: &Built) {
    let mut g = c.benchmark_group("match");
    for len in LENS {
        let ps = probes(b, len, 7);
        let mut i = 0;
        g.throughput(Throughput::Elements(1));
        g.bench_function(BenchmarkId::new(name, len), |bch| {
            bch.iter(|| {
                i = (i + 1) % ps.len();
                black_box(b.tree.longest_match(black_box(&ps[i])))
                    .workers
                    .len()
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("insert");
    for len in LENS {
        let ps = probes(b, len, 11);
        let mut i = 0;
        let mut now = b.now;
        let size = if len >= 10_000 {
            BatchSize::PerIteration
        } else {
            BatchSize::SmallInput
        };
        g.bench_function(BenchmarkId::new(name, len), |bch| {
            bch.iter_batched(
                || {
                    i += 1;
                    now += 1;
                    let key = format!("{} #{i}", ps[i % ps.len()]);
                    (b.tree.clone(), key, now)
                },
                |(mut t, key, now)| {
                    t.insert(&key, (now % WORKERS as u64) as WorkerId, now);
                    (t, key)
                },
                size,
            )
        });
    }
    g.finish();

    let mut g = c.benchmark_group("insert_owned");
    let ps = probes(b, 4_000, 13);
    let mut owned = b.tree.clone();
    // Make the probe paths the writer's own (as within one epoch).
    for p in &ps {
        owned.insert(p, 0, b.now);
    }
    let mut i = 0;
    let mut now = b.now;
    g.bench_function(BenchmarkId::new(name, 4_000), |bch| {
        bch.iter_batched(
            || {
                i += 1;
                now += 1;
                (format!("{} #{i}", ps[i % ps.len()]), now)
            },
            |(key, now)| {
                owned.insert(&key, (now % WORKERS as u64) as WorkerId, now);
                key
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

fn memory_report(name: &str, b: Built) {
    let nodes = b.tree.node_count();
    let stored = b.tree.stored_bytes();
    let chars = b.tree.total_chars();
    let Built {
        tree,
        chats,
        sessions,
        docs,
        ..
    } = b;
    drop((chats, sessions, docs));
    let (req0, round0) = common::live_bytes();
    drop(tree);
    let (req1, round1) = common::live_bytes();
    let req = (req0 - req1) as f64;
    let round = (round0 - round1) as f64;
    let n = nodes as f64;
    eprintln!(
        "memory {name}: {nodes} nodes, {stored} edge bytes ({:.0}/node), {chars} per-worker chars; \
         total {:.1} MB requested / {:.1} MB in size classes; structure (excl. edge bytes) \
         {:.1} B/node requested, {:.1} B/node in size classes",
        stored as f64 / n,
        req / 1e6,
        round / 1e6,
        (req - stored as f64) / n,
        (round - stored as f64) / n,
    );
}

/// One chat stream: conversations that grow by a turn per prompt and restart past ~2.5k chars,
/// so consecutive prompts share system prompts and histories like real traffic.
struct Stream {
    words: Words,
    rng: Rng,
    systems: Vec<String>,
    convs: Vec<(String, WorkerId)>,
    next: usize,
    now: u64,
}

impl Stream {
    fn new(seed: u64) -> Self {
        let mut words = Words::new(seed);
        let mut rng = Rng(seed);
        let preamble = words.text(300);
        let systems = (0..32)
            .map(|_| format!("{preamble}\n{}", words.text(rng.range(1000, 1600))))
            .collect();
        Stream {
            words,
            rng,
            systems,
            convs: Vec::new(),
            next: 0,
            now: 0,
        }
    }

    fn prompt(&mut self) -> Insert {
        if self.convs.len() < 512 {
            self.convs.push((String::new(), 0));
        }
        self.next = (self.next + 1) % self.convs.len();
        let (text, worker) = &mut self.convs[self.next];
        if text.len() > 2_500 || text.is_empty() {
            text.clear();
            text.push_str(&self.systems[self.rng.below(self.systems.len())]);
            *worker = self.rng.below(8) as WorkerId;
        } else {
            text.push_str("\nAssistant: ");
            let n = self.rng.range(40, 200);
            self.words.push(text, n);
        }
        text.push_str("\nUser: ");
        let n = self.rng.range(20, 100);
        self.words.push(text, n);
        self.now += 1;
        Insert {
            tree: radixgate::tree::TreeKey::Default,
            text: radixgate::base::text::SharedText::copy_of(text),
            worker: *worker,
            now_ms: self.now / 64,
        }
    }
}

fn bench_writer(c: &mut Criterion) {
    let h = spawn_writer(WriterConfig {
        max_chars_per_worker: 2_000_000,
        ..WriterConfig::default()
    });
    let mut stream = Stream::new(42);
    let mut g = c.benchmark_group("writer");
    g.throughput(Throughput::Elements(1));
    g.bench_function("2k_prompts", |bch| {
        bch.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                let ins = stream.prompt();
                while !h.try_insert(ins.clone()) {
                    std::thread::yield_now();
                }
            }
            h.sync();
            start.elapsed()
        })
    });
    g.finish();
    let s = h.stats();
    eprintln!(
        "writer: {} applied, {} publishes, {} evictions ({} chars), {} nodes, {} chars at the end",
        s.inserts_applied(),
        s.publishes(),
        s.evictions(),
        s.evicted_chars(),
        s.nodes(),
        s.chars()
    );
}

fn bench_evict(c: &mut Criterion, b: &Built) {
    let counts: Vec<(WorkerId, u64)> = b.tree.worker_char_counts().collect();
    eprintln!(
        "evict: tree of {} nodes, {} chars over {} workers",
        b.tree.node_count(),
        b.tree.total_chars(),
        counts.len()
    );
    let mut g = c.benchmark_group("evict");
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(5));
    g.bench_function("pass_1M_nodes_to_90pct", |bch| {
        bch.iter_batched(
            || b.tree.clone(),
            |mut t| {
                let mut removed = 0;
                for &(w, chars) in &counts {
                    removed += t.evict_worker(w, chars / 10 * 9);
                }
                black_box(removed);
                t
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

fn main() {
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    let t = Instant::now();
    let small = build(10_000, 1);
    eprintln!("built 10k tree in {:?}", t.elapsed());
    let t = Instant::now();
    let big = build(1_000_000, 2);
    eprintln!("built 1M tree in {:?}", t.elapsed());
    bench_tree(&mut c, "10k", &small);
    bench_tree(&mut c, "1M", &big);
    bench_evict(&mut c, &big);
    memory_report("10k", small);
    memory_report("1M", big);
    bench_writer(&mut c);
    c.final_summary();
}
