//! The Prometheus text format as the engines write it (`text/plain; version=0.0.4`), read
//! tolerantly: the few numbers routing needs ([`EngineStats`]), and the merge of every
//! worker's exposition into one with a `worker` label on every sample ([`Merger`], served as
//! `GET /engine_metrics`). Pure: tested alone. A line that cannot be read is skipped, never
//! fatal; sizes are bounded by the caller (each body) and by the merger (the whole output).

use crate::metrics::escape_label_value;
use serde_json::Value;
use std::collections::HashMap;
use std::fmt::Write as _;

/// One sample line: `name{labels} value [timestamp]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample<'a> {
    /// Metric name (the family's, or with a `_bucket`/`_sum`/`_count`/… suffix).
    pub name: &'a str,
    /// The label pairs between the braces, as written (empty without braces).
    pub labels: &'a str,
    /// The value.
    pub value: f64,
    /// Value and optional timestamp, as written (copied to the merged output unchanged).
    pub rest: &'a str,
}

/// One line of an exposition.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Line<'a> {
    /// `# HELP name text`.
    Help(&'a str, &'a str),
    /// `# TYPE name kind`.
    Type(&'a str, &'a str),
    /// A sample.
    Sample(Sample<'a>),
    /// Blank, another comment, or unreadable.
    Skip,
}

fn is_name_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_' || b == b':'
}

fn is_name_char(b: u8) -> bool {
    is_name_start(b) || b.is_ascii_digit()
}

/// Length of the metric (or label) name at the start of `s`.
fn name_len(s: &str) -> usize {
    let b = s.as_bytes();
    if b.first().is_none_or(|&c| !is_name_start(c)) {
        return 0;
    }
    b.iter().take_while(|&&c| is_name_char(c)).count()
}

/// Whether `s` is a whole metric name.
fn is_metric_name(s: &str) -> bool {
    !s.is_empty() && name_len(s) == s.len()
}

/// Read one line (without its `\n`; a trailing `\r` is ignored).
pub fn parse_line(line: &str) -> Line<'_> {
    let line = line.trim_end_matches('\r').trim_start();
    if let Some(c) = line.strip_prefix('#') {
        let c = c.trim_start();
        let (kw, rest) = c.split_once(char::is_whitespace).unwrap_or((c, ""));
        let rest = rest.trim_start();
        let (name, tail) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
        if !is_metric_name(name) {
            return Line::Skip;
        }
        return match kw {
            "HELP" => Line::Help(name, tail.trim_end()),
            "TYPE" => Line::Type(name, tail.trim()),
            _ => Line::Skip,
        };
    }
    parse_sample(line).map_or(Line::Skip, Line::Sample)
}

fn parse_sample(line: &str) -> Option<Sample<'_>> {
    let n = name_len(line);
    if n == 0 {
        return None;
    }
    let name = &line[..n];
    let mut after = &line[n..];
    let mut labels = "";
    if let Some(inner) = after.strip_prefix('{') {
        let close = label_set_end(inner)?;
        labels = &inner[..close];
        after = &inner[close + 1..];
    }
    let rest = after.trim();
    let mut parts = rest.split_whitespace();
    let value = parse_value(parts.next()?)?;
    if let Some(ts) = parts.next() {
        ts.parse::<i64>().ok()?;
    }
    if parts.next().is_some() {
        return None;
    }
    // The label set must be well formed, or its relabelled copy would not be.
    label_pairs(labels)?;
    Some(Sample {
        name,
        labels,
        value,
        rest,
    })
}

/// A sample value: a float, `NaN`, `+Inf`, `-Inf`.
fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ if s
            .bytes()
            .all(|b| b.is_ascii_digit() || b"+-.eE".contains(&b)) =>
        {
            s.parse().ok()
        }
        _ => None,
    }
}

/// Index of the `}` closing a label set that starts right after `{` (quotes and escapes
/// respected).
fn label_set_end(s: &str) -> Option<usize> {
    let mut in_quotes = false;
    let mut escaped = false;
    for (i, b) in s.bytes().enumerate() {
        if in_quotes {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_quotes = false,
                _ => {}
            }
        } else if b == b'"' {
            in_quotes = true;
        } else if b == b'}' {
            return Some(i);
        }
    }
    None
}

/// The pairs of a label set as (name, quoted value as written); `None` when malformed.
pub fn label_pairs(s: &str) -> Option<Vec<(&str, &str)>> {
    let mut out = Vec::new();
    let mut rest = s.trim_start();
    while !rest.is_empty() {
        let n = name_len(rest);
        if n == 0 {
            return None;
        }
        let name = &rest[..n];
        let after = rest[n..].trim_start().strip_prefix('=')?.trim_start();
        let body = after.strip_prefix('"')?;
        let mut escaped = false;
        let mut end = None;
        for (i, b) in body.bytes().enumerate() {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => {
                    end = Some(i);
                    break;
                }
                _ => {}
            }
        }
        let end = end?;
        out.push((name, &after[..end + 2]));
        rest = body[end + 1..].trim_start();
        rest = match rest.strip_prefix(',') {
            Some(r) => r.trim_start(),
            None if rest.is_empty() => rest,
            None => return None,
        };
    }
    Some(out)
}

/// The unquoted value of label `key` in a label set, when present (escapes are kept: the values
/// compared here never carry any).
pub fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    label_pairs(labels)?
        .into_iter()
        .find(|(k, _)| *k == key)
        .map(|(_, v)| &v[1..v.len() - 1])
}

/// The numbers routing and the hit ratio need from one worker's exposition, in SGLang's names
/// or vLLM's (whichever the worker exports: each worker is read by what it exports, so a fleet
/// may mix them). A number is `None` when the exposition has no sample of it; several label
/// sets (data-parallel ranks, models) are summed, except token usage (the fullest rank).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    /// `sglang:num_running_reqs`, `vllm:num_requests_running`.
    pub running: Option<f64>,
    /// `sglang:num_queue_reqs`, `vllm:num_requests_waiting`.
    pub queued: Option<f64>,
    /// `sglang:token_usage`, `vllm:kv_cache_usage_perc` (before vLLM 0.10
    /// `vllm:gpu_cache_usage_perc`), 0 to 1 (max over label sets).
    pub token_usage: Option<f64>,
    /// `sglang:num_used_tokens` (summed): with the usage, the KV capacity in tokens. vLLM
    /// exports no such gauge: there it is each engine's usage times its capacity, which
    /// `vllm:cache_config_info` gives (`num_gpu_blocks` × `block_size`).
    pub used_tokens: Option<f64>,
    /// `sglang:cached_tokens_total`: the `cache_source="total"` series when the engine exports
    /// one (newer SGLang splits it into device/host/storage *and* total, so summing all would
    /// count every hit twice); otherwise every series. vLLM: `vllm:prefix_cache_hits_total`.
    pub cached_tokens: Option<f64>,
    /// `sglang:prompt_tokens_total`. vLLM: `vllm:prefix_cache_queries_total`, the prompt
    /// tokens its prefix cache was asked about, which its hits are counted out of.
    pub prompt_tokens: Option<f64>,
}

/// Most vLLM engines (DP ranks) of one server whose usage and capacity are paired: past it the
/// rest are left out of the used tokens (the exposition is already bounded in bytes).
const MAX_VLLM_ENGINES: usize = 256;

/// vLLM's per-engine usage and capacity, paired by the `engine` label into used tokens.
#[derive(Default)]
struct VllmKv<'a> {
    usage: Vec<(&'a str, f64)>,
    capacity: Vec<(&'a str, f64)>,
}

impl<'a> VllmKv<'a> {
    /// One value per engine, the largest (a server exporting both of vLLM's usage gauges, the
    /// current and the deprecated one, is counted once).
    fn note(list: &mut Vec<(&'a str, f64)>, engine: &'a str, v: f64) {
        if let Some((_, seen)) = list.iter_mut().find(|(e, _)| *e == engine) {
            *seen = seen.max(v);
        } else if list.len() < MAX_VLLM_ENGINES {
            list.push((engine, v));
        }
    }

    /// `vllm:cache_config_info`'s capacity in tokens: `num_gpu_blocks` × `block_size`.
    fn capacity_of(labels: &str) -> Option<f64> {
        let blocks: f64 = label(labels, "num_gpu_blocks")?.parse().ok()?;
        let size: f64 = label(labels, "block_size")?.parse().ok()?;
        Some(blocks * size).filter(|c| c.is_finite() && *c > 0.0)
    }

    /// Σ usage × capacity over the engines that have both.
    fn used(&self) -> Option<f64> {
        let mut sum = None;
        for (engine, u) in &self.usage {
            if let Some((_, c)) = self.capacity.iter().find(|(e, _)| e == engine) {
                sum = Some(sum.unwrap_or(0.0) + u * c);
            }
        }
        sum
    }
}

impl EngineStats {
    /// Read the numbers out of a whole exposition.
    pub fn from_text(text: &str) -> EngineStats {
        let mut s = EngineStats::default();
        let (mut cached_total, mut cached_other) = (None::<f64>, None::<f64>);
        let mut vllm = VllmKv::default();
        let add = |slot: &mut Option<f64>, v: f64| *slot = Some(slot.unwrap_or(0.0) + v);
        for line in text.lines() {
            let Line::Sample(x) = parse_line(line) else {
                continue;
            };
            if !x.value.is_finite() || x.value < 0.0 {
                continue;
            }
            match x.name {
                "sglang:num_running_reqs" | "vllm:num_requests_running" => {
                    add(&mut s.running, x.value)
                }
                "sglang:num_queue_reqs" | "vllm:num_requests_waiting" => {
                    add(&mut s.queued, x.value)
                }
                "sglang:token_usage" | "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                    s.token_usage = Some(s.token_usage.map_or(x.value, |u| u.max(x.value)));
                    if x.name.starts_with("vllm:") {
                        let engine = label(x.labels, "engine").unwrap_or("");
                        VllmKv::note(&mut vllm.usage, engine, x.value);
                    }
                }
                "vllm:cache_config_info" => {
                    if let Some(c) = VllmKv::capacity_of(x.labels) {
                        let engine = label(x.labels, "engine").unwrap_or("");
                        VllmKv::note(&mut vllm.capacity, engine, c);
                    }
                }
                "sglang:prompt_tokens_total" | "vllm:prefix_cache_queries_total" => {
                    add(&mut s.prompt_tokens, x.value)
                }
                "sglang:num_used_tokens" => add(&mut s.used_tokens, x.value),
                "sglang:cached_tokens_total" => match label(x.labels, "cache_source") {
                    Some("total") => add(&mut cached_total, x.value),
                    _ => add(&mut cached_other, x.value),
                },
                "vllm:prefix_cache_hits_total" => add(&mut cached_other, x.value),
                _ => {}
            }
        }
        s.cached_tokens = cached_total.or(cached_other);
        if s.used_tokens.is_none() {
            s.used_tokens = vllm.used();
        }
        s
    }

    /// Running and queued requests, when the exposition has both.
    pub fn load(&self) -> Option<(f64, f64)> {
        Some((self.running?, self.queued?))
    }
}

/// Running plus queued requests of each attention-DP rank (`dp_rank` label of
/// `sglang:num_running_reqs` and `sglang:num_queue_reqs`, SGLang's scheduler gauges), for a
/// server of `ranks` ranks (`--dp-aware`, which reads SGLang's `dp_size`: vLLM balances its
/// ranks behind one URL itself). `None` when a sample has no usable rank label or there is
/// none: the caller spreads the server's total instead.
pub fn load_by_rank(text: &str, ranks: usize) -> Option<Vec<f64>> {
    let mut out = vec![0.0; ranks];
    let mut seen = false;
    for line in text.lines() {
        let Line::Sample(x) = parse_line(line) else {
            continue;
        };
        if !matches!(x.name, "sglang:num_running_reqs" | "sglang:num_queue_reqs")
            || !x.value.is_finite()
            || x.value < 0.0
        {
            continue;
        }
        let rank: usize = label(x.labels, "dp_rank")?.parse().ok()?;
        *out.get_mut(rank)? += x.value;
        seen = true;
    }
    seen.then_some(out)
}

/// Running and queued requests from a `/get_load` answer, in any of the shapes SGLang has
/// used: `{"load": n}` (early 2025), a list of per-DP-rank `{"num_reqs", "num_waiting_reqs"}`
/// (`num_reqs` counts running and waiting), or `{"loads": [{"num_running_reqs",
/// "num_waiting_reqs"}]}` (`/v1/loads`). `None` for anything else.
pub fn load_from_json(v: &Value) -> Option<(f64, f64)> {
    let num = |o: &Value, k: &str| o.get(k).and_then(Value::as_f64).filter(|x| *x >= 0.0);
    let ranks = |list: &Vec<Value>| -> Option<(f64, f64)> {
        let mut out: Option<(f64, f64)> = None;
        for r in list {
            let waiting = num(r, "num_waiting_reqs").unwrap_or(0.0);
            let running = match num(r, "num_running_reqs") {
                Some(running) => running,
                None => (num(r, "num_reqs")? - waiting).max(0.0),
            };
            let (a, b) = out.unwrap_or((0.0, 0.0));
            out = Some((a + running, b + waiting));
        }
        out
    };
    match v {
        Value::Array(list) => ranks(list),
        Value::Object(o) => {
            if let Some(Value::Array(list)) = o.get("loads") {
                return ranks(list);
            }
            num(v, "load").map(|l| (l, 0.0))
        }
        _ => None,
    }
}

/// Suffixes a sample may add to its family's name (histograms, summaries, OpenMetrics
/// counters and gauge histograms).
const SUFFIXES: &[&str] = &[
    "_bucket", "_sum", "_count", "_total", "_created", "_gsum", "_gcount",
];

/// Whether a sample called `sample` belongs to family `family`.
fn belongs(sample: &str, family: &str) -> bool {
    match sample.strip_prefix(family) {
        Some("") => true,
        Some(suffix) => SUFFIXES.contains(&suffix),
        None => false,
    }
}

/// One family of the merged output.
#[derive(Debug, Default)]
struct Family {
    help: Option<String>,
    kind: Option<String>,
    /// Relabelled sample lines, each ending in `\n`.
    samples: String,
}

/// Merges the workers' expositions into one, with `worker="<url>"` first on every sample, one
/// HELP and TYPE per family, each family's samples together, and at most `cap` bytes of
/// samples: a worker whose samples would pass it is left out whole (and counted).
#[derive(Debug)]
pub struct Merger {
    families: Vec<Family>,
    names: Vec<String>,
    index: HashMap<String, usize>,
    bytes: usize,
    cap: usize,
    /// Workers left out because of the cap.
    pub left_out: usize,
    /// Samples dropped because their worker typed the family differently from the first.
    pub type_conflicts: usize,
}

impl Merger {
    /// An empty merge holding at most `cap` bytes of samples.
    pub fn new(cap: usize) -> Merger {
        Merger {
            families: Vec::new(),
            names: Vec::new(),
            index: HashMap::new(),
            bytes: 0,
            cap,
            left_out: 0,
            type_conflicts: 0,
        }
    }

    /// Add one worker's exposition. Returns false when it was left out (over the cap).
    pub fn add(&mut self, worker: &str, text: &str) -> bool {
        let worker_label = format!("worker=\"{}\"", escape_label_value(worker));
        // This worker's contribution, by family, built apart so it is added whole or not at all.
        let mut mine: Vec<(String, Family)> = Vec::new();
        let mut at: HashMap<String, usize> = HashMap::new();
        let mut current: Option<usize> = None;
        let mut size = 0usize;
        let mut slot = |name: &str, mine: &mut Vec<(String, Family)>| -> usize {
            *at.entry(name.to_string()).or_insert_with(|| {
                mine.push((name.to_string(), Family::default()));
                mine.len() - 1
            })
        };
        for line in text.lines() {
            match parse_line(line) {
                Line::Help(name, help) => {
                    let i = slot(name, &mut mine);
                    mine[i].1.help.get_or_insert_with(|| help.to_string());
                    current = Some(i);
                }
                Line::Type(name, kind) => {
                    let i = slot(name, &mut mine);
                    mine[i].1.kind.get_or_insert_with(|| kind.to_string());
                    current = Some(i);
                }
                Line::Sample(x) => {
                    let i = match current.filter(|&i| belongs(x.name, &mine[i].0)) {
                        Some(i) => i,
                        None => {
                            let i = slot(x.name, &mut mine);
                            current = Some(i);
                            i
                        }
                    };
                    let Some(line) = relabel(&x, &worker_label) else {
                        continue;
                    };
                    size += line.len();
                    mine[i].1.samples.push_str(&line);
                }
                Line::Skip => {}
            }
        }
        if self.bytes + size > self.cap {
            self.left_out += 1;
            return false;
        }
        for (name, f) in mine {
            if f.samples.is_empty() {
                continue;
            }
            let i = match self.index.get(&name) {
                Some(&i) => i,
                None => {
                    self.index.insert(name.clone(), self.families.len());
                    self.names.push(name);
                    self.families.push(Family::default());
                    self.families.len() - 1
                }
            };
            let into = &mut self.families[i];
            let kind = f.kind.as_deref().unwrap_or("untyped");
            if into.kind.as_deref().is_some_and(|k| k != kind) {
                self.type_conflicts += 1;
                continue;
            }
            into.kind.get_or_insert_with(|| kind.to_string());
            if into.help.is_none() {
                into.help = f.help;
            }
            self.bytes += f.samples.len();
            into.samples.push_str(&f.samples);
        }
        true
    }

    /// The merged exposition.
    pub fn finish(self) -> String {
        let mut out = String::with_capacity(self.bytes + 128 * self.families.len());
        for (name, f) in self.names.iter().zip(&self.families) {
            let help = f
                .help
                .as_deref()
                .unwrap_or("Reported by the workers (no HELP text).");
            let kind = f.kind.as_deref().unwrap_or("untyped");
            let _ = write!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n");
            out.push_str(&f.samples);
        }
        if self.left_out > 0 {
            let _ = writeln!(
                out,
                "# radixgate: {} worker(s) left out: the merged exposition is capped at {} bytes",
                self.left_out, self.cap
            );
        }
        out
    }
}

/// The sample with `worker` first in its label set (a `worker` label of the engine's own is
/// kept as `exported_worker`, as Prometheus does on a clash). `None` when the labels are
/// malformed (already checked when parsing, so never in practice).
fn relabel(x: &Sample<'_>, worker_label: &str) -> Option<String> {
    let pairs = label_pairs(x.labels)?;
    let mut line = String::with_capacity(x.name.len() + worker_label.len() + x.labels.len() + 32);
    line.push_str(x.name);
    line.push('{');
    line.push_str(worker_label);
    for (k, v) in pairs {
        line.push(',');
        if k == "worker" {
            line.push_str("exported_worker");
        } else {
            line.push_str(k);
        }
        line.push('=');
        line.push_str(v);
    }
    line.push_str("} ");
    line.push_str(x.rest);
    line.push('\n');
    Some(line)
}

#[cfg(test)]
mod tests;
