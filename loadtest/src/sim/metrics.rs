//! SGLang-named Prometheus metrics for the simulated worker (`--enable-metrics` shapes), or with
//! `--engine vllm` vLLM 0.33's (`vllm/v1/metrics/loggers.py`: `vllm:` names, `model_name` and
//! `engine` labels, rendered as Python's Prometheus client does).
//!
//! Counters and histograms are updated by the engine as requests progress; gauges are read from
//! the engine when `/metrics` renders. Times are in *virtual* seconds (the simulated GPU's
//! clock), so the numbers are those a real worker would report regardless of `time_scale`.

use radixgate::metrics::escape_label_value;
use std::fmt::Write as _;

/// TTFT buckets (seconds): the older SGLang list starting at 1 ms.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    15.0, 20.0, 25.0, 30.0, 40.0, 50.0, 60.0, 80.0, 100.0, 200.0, 400.0,
];
/// End-to-end latency buckets (seconds).
pub const E2E_BUCKETS: &[f64] = &[
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0,
    400.0, 800.0,
];
/// Inter-token latency buckets (seconds).
pub const ITL_BUCKETS: &[f64] = &[
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
    0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0,
];
/// Queue-time buckets (seconds).
pub const QUEUE_BUCKETS: &[f64] = &[
    0.0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// vLLM 0.33's TTFT buckets (`vllm/v1/metrics/buckets.py`).
pub const VLLM_TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM 0.33's inter-token latency buckets.
pub const VLLM_ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM 0.33's request latency buckets (end to end, queue time).
pub const VLLM_LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A number as Python's Prometheus client writes it (`floatToGoString`): `repr` of the float
/// (`3.0`, `0.25`), with Go's exponent form for numbers of seven or more integer digits, and
/// `+Inf`. vLLM's exposition goes through it, so a scraper that parses loosely still sees
/// exactly vLLM's text.
pub fn py_float(v: f64) -> String {
    if v == f64::INFINITY {
        return "+Inf".into();
    }
    if v == f64::NEG_INFINITY {
        return "-Inf".into();
    }
    if v.is_nan() {
        return "NaN".into();
    }
    // Python's repr: shortest round-trip digits, always with a fractional part.
    let r = if v.fract() == 0.0 && v.abs() < 1e16 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    };
    match r.find('.') {
        Some(dot) if v > 0.0 && dot > 6 => {
            let digits = format!("{}{}", &r[1..dot], &r[dot + 1..]);
            let mantissa = format!("{}.{digits}", &r[..1]);
            let mantissa = mantissa.trim_end_matches(['0', '.']);
            format!("{mantissa}e+0{}", dot - 1)
        }
        _ => r,
    }
}

/// A cumulative-bucket histogram with fixed bounds.
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// Empty histogram over `bounds` (ascending; `+Inf` is implicit).
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    /// Record one observation.
    pub fn observe(&mut self, v: f64) {
        self.sum += v;
        self.count += 1;
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Sum of observations.
    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// vLLM's rendering (Python's Prometheus client): labels sorted by name with `le` among
    /// them, numbers as Python floats, and a `_created` gauge family after the samples.
    fn render_vllm(&self, out: &mut String, name: &str, help: &str, l: &VllmLabels<'_>) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        let les = self
            .bounds
            .iter()
            .map(|&b| py_float(b))
            .chain(std::iter::once("+Inf".to_string()));
        for (i, le) in les.enumerate() {
            cum += self.counts.get(i).copied().unwrap_or(0);
            let n = if i == self.bounds.len() {
                self.count
            } else {
                cum
            };
            let _ = writeln!(
                out,
                "{name}_bucket{{engine=\"{}\",le=\"{le}\",model_name=\"{}\"}} {}",
                l.engine,
                l.model,
                py_float(n as f64)
            );
        }
        let _ = writeln!(
            out,
            "{name}_count{} {}",
            l.plain(),
            py_float(self.count as f64)
        );
        let _ = writeln!(out, "{name}_sum{} {}", l.plain(), py_float(self.sum));
        render_created(out, name, help, l);
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

/// Monotonic counters and latency histograms of one worker.
#[derive(Debug, Clone)]
pub struct Metrics {
    /// Prompt tokens of finished requests.
    pub prompt_tokens: u64,
    /// Generated tokens of finished requests.
    pub generation_tokens: u64,
    /// Cached prompt tokens of finished requests, from either tier.
    pub cached_tokens: u64,
    /// The part of `cached_tokens` loaded back from host memory (HiCache).
    pub cached_tokens_host: u64,
    /// Finished requests (including aborted ones).
    pub num_requests: u64,
    /// Requests aborted (client disconnect).
    pub num_aborted: u64,
    /// Time to first token.
    pub ttft: Histogram,
    /// Arrival to finish.
    pub e2e: Histogram,
    /// Gap between consecutive tokens of a request.
    pub itl: Histogram,
    /// Arrival to first scheduling.
    pub queue: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            prompt_tokens: 0,
            generation_tokens: 0,
            cached_tokens: 0,
            cached_tokens_host: 0,
            num_requests: 0,
            num_aborted: 0,
            ttft: Histogram::new(TTFT_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            queue: Histogram::new(QUEUE_BUCKETS),
        }
    }
}

impl Metrics {
    /// Counters and histograms with vLLM's histogram buckets (`--engine vllm`).
    pub fn vllm() -> Self {
        Metrics {
            ttft: Histogram::new(VLLM_TTFT_BUCKETS),
            e2e: Histogram::new(VLLM_LATENCY_BUCKETS),
            itl: Histogram::new(VLLM_ITL_BUCKETS),
            queue: Histogram::new(VLLM_LATENCY_BUCKETS),
            ..Metrics::default()
        }
    }

    /// vLLM 0.33's exposition (`vllm/v1/metrics/loggers.py`) for the engine (DP rank)
    /// `engine`: its names, its `model_name` and `engine` labels, counters with `_total` and
    /// `_created` as Python's Prometheus client writes them. `created` is the Unix time the
    /// series were created. Prefix-cache queries and hits count prompt tokens and their
    /// cached part, the ratio vLLM's own hit rate is.
    pub fn render_vllm(
        &self,
        model: &str,
        engine: usize,
        g: &Gauges,
        created: f64,
        block_size: usize,
    ) -> String {
        let model = escape_label_value(model);
        let engine = engine.to_string();
        let l = VllmLabels {
            model: &model,
            engine: &engine,
            created,
        };
        let mut o = String::with_capacity(8192);
        let usage = if g.capacity == 0 {
            0.0
        } else {
            g.used_tokens as f64 / g.capacity as f64
        };
        for (name, help, v) in [
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                g.running as f64,
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                g.queued as f64,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                usage,
            ),
        ] {
            let _ = writeln!(
                o,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{} {}",
                l.plain(),
                py_float(v)
            );
        }
        // vLLM's info gauge of its cache config (one label per CacheConfig field, sorted as
        // Python's client writes them; the fields a consumer reads: the block size and the
        // number of GPU blocks, whose product is the KV capacity in tokens).
        let _ = writeln!(
            o,
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
             # TYPE vllm:cache_config_info gauge\n\
             vllm:cache_config_info{{block_size=\"{block_size}\",cache_dtype=\"auto\",\
             enable_prefix_caching=\"True\",engine=\"{engine}\",\
             gpu_memory_utilization=\"0.9\",num_gpu_blocks=\"{}\"}} 1.0",
            g.capacity / block_size.max(1)
        );
        for (name, help, v) in [
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                self.prompt_tokens,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                self.cached_tokens,
            ),
            (
                "vllm:num_preemptions",
                "Cumulative number of preemption from the engine.",
                0,
            ),
            (
                "vllm:prompt_tokens",
                "Number of prefill tokens processed.",
                self.prompt_tokens,
            ),
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                self.generation_tokens,
            ),
        ] {
            let _ = writeln!(
                o,
                "# HELP {name}_total {help}\n# TYPE {name}_total counter\n{name}_total{} {}",
                l.plain(),
                py_float(v as f64)
            );
            render_created(&mut o, name, help, &l);
        }
        // The two simulator extras the SGLang personality has too (no vLLM series says how
        // much a cache evicted or how long a GPU sat idle; load tests need both).
        for (name, help, v) in [
            (
                "vllm:evicted_tokens",
                "Tokens evicted from the prefix cache (simulator extra).",
                g.evicted_tokens as f64,
            ),
            (
                "vllm:gpu_idle_seconds",
                "Seconds the GPU had no forward to run (simulator extra).",
                g.idle_seconds,
            ),
        ] {
            let _ = writeln!(
                o,
                "# HELP {name}_total {help}\n# TYPE {name}_total counter\n{name}_total{} {}",
                l.plain(),
                py_float(v)
            );
        }
        // Every finish reason vLLM knows gets a series; the simulator finishes by length or
        // abort only.
        let name = "vllm:request_success";
        let help = "Count of successfully processed requests.";
        let _ = writeln!(o, "# HELP {name}_total {help}\n# TYPE {name}_total counter");
        let done = self.num_requests.saturating_sub(self.num_aborted);
        let reasons = [
            ("stop", 0),
            ("length", done),
            ("abort", self.num_aborted),
            ("error", 0),
            ("repetition", 0),
        ];
        for (reason, n) in reasons {
            let _ = writeln!(
                o,
                "{name}_total{{engine=\"{}\",finished_reason=\"{reason}\",model_name=\"{}\"}} {}",
                l.engine,
                l.model,
                py_float(n as f64)
            );
        }
        let _ = writeln!(
            o,
            "# HELP {name}_created {help}\n# TYPE {name}_created gauge"
        );
        for (reason, _) in reasons {
            let _ = writeln!(
                o,
                "{name}_created{{engine=\"{}\",finished_reason=\"{reason}\",model_name=\"{}\"}} {}",
                l.engine,
                l.model,
                py_float(created)
            );
        }
        self.ttft.render_vllm(
            &mut o,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &l,
        );
        self.itl.render_vllm(
            &mut o,
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &l,
        );
        self.e2e.render_vllm(
            &mut o,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &l,
        );
        self.queue.render_vllm(
            &mut o,
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            &l,
        );
        o
    }
}

/// The label values of one vLLM engine's series (escaped), and when they were created.
struct VllmLabels<'a> {
    model: &'a str,
    engine: &'a str,
    created: f64,
}

impl VllmLabels<'_> {
    /// `{engine="0",model_name="m"}`: Python's client sorts labels by name.
    fn plain(&self) -> String {
        format!(
            "{{engine=\"{}\",model_name=\"{}\"}}",
            self.engine, self.model
        )
    }
}

/// The `NAME_created` gauge family Python's client adds after a counter's or histogram's
/// samples.
fn render_created(o: &mut String, name: &str, help: &str, l: &VllmLabels<'_>) {
    let _ = writeln!(
        o,
        "# HELP {name}_created {help}\n# TYPE {name}_created gauge\n{name}_created{} {}",
        l.plain(),
        py_float(l.created)
    );
}

/// Point-in-time scheduler state rendered as gauges.
#[derive(Debug, Clone, Copy, Default)]
pub struct Gauges {
    /// Requests in the running batch (decoding or mid-prefill).
    pub running: usize,
    /// Requests the last scheduling step left waiting (`sglang:num_queue_reqs`, which SGLang
    /// sets when it forms a batch); `/get_load` reports the instantaneous queue instead.
    pub queued: usize,
    /// KV slots pinned by live requests.
    pub used_tokens: usize,
    /// Total KV slots.
    pub capacity: usize,
    /// Cached tokens that nothing pins.
    pub evictable_tokens: usize,
    /// Hit rate of the last prefill batch.
    pub cache_hit_rate: f64,
    /// Decode tokens/s over the last logging window.
    pub gen_throughput: f64,
    /// Tokens evicted since start (simulator extra).
    pub evicted_tokens: u64,
    /// Virtual seconds the GPU had no forward to run (simulator extra).
    pub idle_seconds: f64,
}

impl Metrics {
    /// Prometheus text exposition for this worker. `model` is escaped for the label value.
    pub fn render(&self, model: &str, g: &Gauges) -> String {
        let l = format!("model_name=\"{}\"", escape_label_value(model));
        let mut o = String::with_capacity(8192);
        render_gauges(&mut o, &l, g);
        self.render_counters(&mut o, &l, g);
        self.render_histograms(&mut o, &l);
        o
    }

    /// The monotonic counters (`cached_tokens_total` carries a second label, and the evicted
    /// tokens are a simulator extra), in the order SGLang exposes them.
    fn render_counters(&self, o: &mut String, l: &str, g: &Gauges) {
        counter(
            o,
            l,
            "prompt_tokens_total",
            "Number of prefill tokens processed.",
            self.prompt_tokens,
        );
        counter(
            o,
            l,
            "generation_tokens_total",
            "Number of generation tokens processed.",
            self.generation_tokens,
        );
        // SGLang splits the cached tokens by where they came from; `total` sums the tiers.
        let _ = writeln!(
            o,
            "# HELP sglang:cached_tokens_total Number of cached prompt tokens.\n# TYPE sglang:cached_tokens_total counter\n\
             sglang:cached_tokens_total{{{l},cache_source=\"device\"}} {d}\n\
             sglang:cached_tokens_total{{{l},cache_source=\"host\"}} {h}\n\
             sglang:cached_tokens_total{{{l},cache_source=\"total\"}} {c}",
            c = self.cached_tokens,
            h = self.cached_tokens_host,
            d = self.cached_tokens.saturating_sub(self.cached_tokens_host),
        );
        counter(
            o,
            l,
            "num_requests_total",
            "Number of requests processed.",
            self.num_requests,
        );
        counter(
            o,
            l,
            "num_aborted_requests_total",
            "Number of requests aborted.",
            self.num_aborted,
        );
        let _ = writeln!(
            o,
            "# HELP sglang:evicted_tokens_total Tokens evicted from the radix cache (simulator extra).\n\
             # TYPE sglang:evicted_tokens_total counter\nsglang:evicted_tokens_total{{{l}}} {}",
            g.evicted_tokens
        );
        // No SGLang series says how long a GPU sat idle; a load test needs it to tell a fleet
        // starved by its gateway from a saturated one.
        let _ = writeln!(
            o,
            "# HELP sglang:gpu_idle_seconds_total Seconds the GPU had no forward to run (simulator extra).\n\
             # TYPE sglang:gpu_idle_seconds_total counter\nsglang:gpu_idle_seconds_total{{{l}}} {}",
            g.idle_seconds
        );
    }

    /// The four latency histograms.
    fn render_histograms(&self, o: &mut String, l: &str) {
        self.ttft.render(
            o,
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            l,
        );
        self.e2e.render(
            o,
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds.",
            l,
        );
        self.itl.render(
            o,
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            l,
        );
        self.queue.render(
            o,
            "sglang:queue_time_seconds",
            "Histogram of queueing time in seconds.",
            l,
        );
    }
}

/// One gauge with its HELP and TYPE lines; `l` is the rendered label set.
fn gauge(o: &mut String, l: &str, name: &str, help: &str, v: f64) {
    let _ = writeln!(
        o,
        "# HELP sglang:{name} {help}\n# TYPE sglang:{name} gauge\nsglang:{name}{{{l}}} {v}"
    );
}

/// One counter with its HELP and TYPE lines; `l` is the rendered label set.
fn counter(o: &mut String, l: &str, name: &str, help: &str, v: u64) {
    let _ = writeln!(
        o,
        "# HELP sglang:{name} {help}\n# TYPE sglang:{name} counter\nsglang:{name}{{{l}}} {v}"
    );
}

/// The scheduler gauges, in the order SGLang exposes them.
fn render_gauges(o: &mut String, l: &str, g: &Gauges) {
    let usage = if g.capacity == 0 {
        0.0
    } else {
        g.used_tokens as f64 / g.capacity as f64
    };
    let gauges = [
        (
            "num_running_reqs",
            "The number of running requests.",
            g.running as f64,
        ),
        (
            "num_queue_reqs",
            "The number of requests in the waiting queue.",
            g.queued as f64,
        ),
        (
            "num_used_tokens",
            "The number of used tokens.",
            g.used_tokens as f64,
        ),
        ("token_usage", "The token usage.", usage),
        (
            "kv_used_tokens",
            "KV tokens pinned by live requests.",
            g.used_tokens as f64,
        ),
        (
            "kv_available_tokens",
            "KV tokens free or evictable.",
            (g.capacity - g.used_tokens) as f64,
        ),
        (
            "kv_evictable_tokens",
            "Cached KV tokens nothing pins.",
            g.evictable_tokens as f64,
        ),
        (
            "cache_hit_rate",
            "The prefix cache hit rate of the last prefill batch.",
            g.cache_hit_rate,
        ),
        (
            "gen_throughput",
            "The generation throughput (token/s).",
            g.gen_throughput,
        ),
    ];
    for (name, help, v) in gauges {
        gauge(o, l, name, help, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = Histogram::new(&[1.0, 2.0]);
        h.observe(0.5);
        h.observe(1.5);
        h.observe(9.0);
        let mut s = String::new();
        h.render(&mut s, "x", "help", "a=\"b\"");
        assert!(s.contains("x_bucket{a=\"b\",le=\"1\"} 1\n"));
        assert!(s.contains("x_bucket{a=\"b\",le=\"2\"} 2\n"));
        assert!(s.contains("x_bucket{a=\"b\",le=\"+Inf\"} 3\n"));
        assert!(s.contains("x_count{a=\"b\"} 3\n"));
        assert_eq!(h.sum(), 11.0);
    }

    #[test]
    fn render_names_and_labels() {
        let m = Metrics {
            prompt_tokens: 10,
            cached_tokens: 4,
            cached_tokens_host: 1,
            ..Metrics::default()
        };
        let g = Gauges {
            capacity: 100,
            used_tokens: 25,
            ..Gauges::default()
        };
        let s = m.render("m\"x", &g);
        assert!(s.contains("sglang:prompt_tokens_total{model_name=\"m\\\"x\"} 10\n"));
        for (source, n) in [("device", 3), ("host", 1), ("total", 4)] {
            assert!(
                s.contains(&format!(
                    "sglang:cached_tokens_total{{model_name=\"m\\\"x\",cache_source=\"{source}\"}} {n}\n"
                )),
                "{source}: {s}"
            );
        }
        assert!(s.contains("sglang:token_usage{model_name=\"m\\\"x\"} 0.25\n"));
        assert!(s.contains(
            "sglang:time_to_first_token_seconds_bucket{model_name=\"m\\\"x\",le=\"0.001\"} 0\n"
        ));
    }

    #[test]
    fn numbers_render_as_pythons_prometheus_client_does() {
        assert_eq!(py_float(0.0), "0.0");
        assert_eq!(py_float(12.0), "12.0");
        assert_eq!(py_float(0.25), "0.25");
        assert_eq!(py_float(0.001), "0.001");
        assert_eq!(py_float(2560.0), "2560.0");
        assert_eq!(py_float(1_234_567.0), "1.234567e+06");
        assert_eq!(py_float(1_796_677_913.5), "1.7966779135e+09");
        assert_eq!(py_float(f64::INFINITY), "+Inf");
    }

    #[test]
    fn vllm_names_labels_and_buckets() {
        let mut m = Metrics {
            prompt_tokens: 10,
            cached_tokens: 4,
            generation_tokens: 3,
            num_requests: 2,
            num_aborted: 1,
            ..Metrics::vllm()
        };
        m.ttft.observe(0.03);
        let g = Gauges {
            capacity: 100,
            used_tokens: 25,
            running: 2,
            queued: 1,
            ..Gauges::default()
        };
        let s = m.render_vllm("m\"x", 1, &g, 1000.0, 16);
        let l = "{engine=\"1\",model_name=\"m\\\"x\"}";
        for line in [
            format!("vllm:num_requests_running{l} 2.0"),
            format!("vllm:num_requests_waiting{l} 1.0"),
            format!("vllm:kv_cache_usage_perc{l} 0.25"),
            format!("vllm:prefix_cache_queries_total{l} 10.0"),
            format!("vllm:prefix_cache_hits_total{l} 4.0"),
            format!("vllm:prompt_tokens_total{l} 10.0"),
            format!("vllm:generation_tokens_total{l} 3.0"),
            format!("vllm:num_preemptions_total{l} 0.0"),
            format!("vllm:gpu_idle_seconds_total{l} 0.0"),
            format!("vllm:evicted_tokens_total{l} 0.0"),
            format!("vllm:prompt_tokens_created{l} 1000.0"),
            "vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"1\",gpu_memory_utilization=\"0.9\",num_gpu_blocks=\"6\"} 1.0".to_string(),
            format!("vllm:time_to_first_token_seconds_count{l} 1.0"),
            "# TYPE vllm:prefix_cache_hits_total counter".to_string(),
            "vllm:request_success_total{engine=\"1\",finished_reason=\"abort\",model_name=\"m\\\"x\"} 1.0".to_string(),
            "vllm:time_to_first_token_seconds_bucket{engine=\"1\",le=\"0.02\",model_name=\"m\\\"x\"} 0.0".to_string(),
            "vllm:time_to_first_token_seconds_bucket{engine=\"1\",le=\"0.04\",model_name=\"m\\\"x\"} 1.0".to_string(),
            "vllm:time_to_first_token_seconds_bucket{engine=\"1\",le=\"1.0\",model_name=\"m\\\"x\"} 1.0".to_string(),
            "vllm:time_to_first_token_seconds_bucket{engine=\"1\",le=\"+Inf\",model_name=\"m\\\"x\"} 1.0".to_string(),
        ] {
            assert!(s.lines().any(|x| x == line), "{line} missing:\n{s}");
        }
        for name in [
            "vllm:inter_token_latency_seconds_bucket",
            "vllm:request_queue_time_seconds_bucket",
            "vllm:e2e_request_latency_seconds_bucket",
        ] {
            assert!(s.contains(name), "{name}");
        }
        assert!(!s.contains("sglang:"));
    }
}
