//! `sim-worker`: simulated SGLang workers on one or more ports (see `loadtest::sim`).
//!
//! ```text
//! sim-worker --ports 31000-31003 --time-scale 10 --tokenizer approx
//! sim-worker --ports 31000-31001 --page-size 16 \
//!     --kv-events-config '{"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:6557"}'
//! sim-worker --write-tokenizer /tmp/cl100k-llama3     # the `bpe` tokenizer as a HF folder, then exit
//! sim-worker --ports 31000-31001 --tokenizer-path /tmp/cl100k-llama3
//! sim-worker --ports 31000-31001 --disaggregation-mode prefill --disaggregation-bootstrap-port 8998
//! sim-worker --ports 31100 --disaggregation-mode decode
//! sim-worker --engine vllm --ports 31000-31001 --page-size 16 \
//!     --kv-events-config '{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:6557"}'
//! ```
//! `--engine vllm` plays a vLLM server instead (its routes, metrics, KV-event encoding, and
//! `/kv_event_sources` announcing the publishers); the simulated GPU is the same.
//! Prints `sim-worker listening on HOST:PORT` per port once bound (and, with KV events,
//! `sim-worker kv events for HOST:PORT on ENDPOINT replay REPLAY`; in prefill mode
//! `sim-worker bootstrap for HOST:PORT on BOOTSTRAP_PORT`), runs until SIGINT/SIGTERM,
//! and exits 0.

use std::process::ExitCode;

// The simulator's own CPU time must stay small and steady (it is not the GPU time it models):
// glibc's allocator fragmented under the radix cache's many small vectors once it evicted
// (`_int_malloc` 14 % of the worker's samples), so the worker uses the gateway's allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::{Parser, ValueEnum};
use loadtest::sim::disagg::{DisaggMode, DEFAULT_BOOTSTRAP_PORT};
use loadtest::sim::kv_events::KvEventsConfig;
use loadtest::sim::{
    spawn_cluster, EngineKind, Faults, IoDriver, LoraModule, SimConfig, TokenizerMode,
};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum TokenizerArg {
    Bpe,
    Approx,
}

/// `--disaggregation-mode` (a newtype: clap reads a bare `Option` as "flag may be absent").
#[derive(Debug, Clone, Copy)]
struct Mode(Option<DisaggMode>);

fn parse_mode(s: &str) -> Result<Mode, String> {
    DisaggMode::parse(s).map(Mode)
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum DriverArg {
    Auto,
    Uring,
    Legacy,
}

/// Simulated SGLang (or, with --engine vllm, vLLM) worker(s): radix cache, FCFS prefill-first
/// scheduler and H100 cost model on a virtual clock, the engine's HTTP API and metrics.
#[derive(Debug, Parser)]
#[command(name = "sim-worker", version)]
struct Args {
    /// Ports: ranges and comma lists, e.g. `31000-31007` or `31000,31002,31010-31011`
    /// (0 = ephemeral).
    #[arg(long, default_value = "30000", value_parser = parse_ports)]
    ports: PortList,
    /// Bind address.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Served model name.
    #[arg(long, default_value = "meta-llama/Llama-3.1-8B-Instruct")]
    model_name: String,
    /// KV cache capacity per worker, tokens.
    #[arg(long, default_value_t = 400_000)]
    max_total_tokens: usize,
    /// Radix cache page size, tokens.
    #[arg(long, default_value_t = 1)]
    page_size: usize,
    /// Host memory for KV per worker (per DP rank), tokens: SGLang's hierarchical cache. Pages
    /// the device evicts are backed up there (its least recent pages dropped to make room) and
    /// loaded back, at the cost model's host load rate, when a request's prefix continues into
    /// them; KV events report them with medium CPU_PINNED. 0 = no host tier.
    #[arg(long, default_value_t = 0)]
    host_cache_tokens: usize,
    /// Most new tokens per prefill forward.
    #[arg(long, default_value_t = 8192)]
    chunked_prefill_size: usize,
    /// Most running requests per worker.
    #[arg(long, default_value_t = 256)]
    max_running_requests: usize,
    /// Virtual seconds per real second (10 = simulated GPU runs 10x faster than real time).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Tokenizer: real BPE (cl100k + Llama-3 template) or the cheap approximation.
    #[arg(long, value_enum, default_value = "bpe")]
    tokenizer: TokenizerArg,
    /// Tokenize with this HF tokenizer instead (a tokenizer.json, or a model folder with
    /// tokenizer_config.json / chat_template.jinja), using the gateway's own tokenizer code, so
    /// a gateway given the same path computes the same token ids. Overrides --tokenizer.
    #[arg(long)]
    tokenizer_path: Option<std::path::PathBuf>,
    /// Write the `bpe` tokenizer as a HF model folder (tokenizer.json: cl100k as byte-level BPE
    /// with Llama-3's special tokens at 128000+; tokenizer_config.json: the Llama-3 chat template
    /// the simulator renders) into DIR and exit. Pass DIR as --tokenizer-path to gateway and
    /// simulators alike.
    #[arg(long, value_name = "DIR")]
    write_tokenizer: Option<std::path::PathBuf>,
    /// Fixed duration of every forward, virtual ms (overrides the cost model).
    #[arg(long)]
    token_interval_ms: Option<f64>,
    /// max_tokens when a request gives none.
    #[arg(long, default_value_t = 128)]
    default_max_tokens: usize,
    /// Seed for jitter, generated text and fault draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Fraction of inference requests answered 500.
    #[arg(long, default_value_t = 0.0)]
    fail_rate: f64,
    /// Extra delay before handling each inference request, ms.
    #[arg(long, default_value_t = 0)]
    latency_ms: u64,
    /// Close the listener and all connections after N inference requests.
    #[arg(long)]
    die_after: Option<u64>,
    /// Never answer inference requests after the first N.
    #[arg(long)]
    stall_after: Option<u64>,
    /// /health and /health_generate answer 503.
    #[arg(long)]
    health_fail: bool,
    /// Cut streams (no terminating chunk) after a few events.
    #[arg(long)]
    close_mid_stream: bool,
    /// Keep the last N raw requests for GET /debug/requests.
    #[arg(long, default_value_t = 0)]
    record_requests: usize,
    /// monoio driver.
    #[arg(long, value_enum, default_value = "auto")]
    io_driver: DriverArg,
    /// Publish KV-cache events as SGLang does, e.g.
    /// '{"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:6557"}'
    /// (fields and defaults as SGLang's; sim-only "encoding": "map" (0.5.23, default) | "array"
    /// and "replay_form": "topic" (0.5.23, default) | "plain"). The worker at
    /// index i of --ports publishes on endpoint port + i and replays on replay port + i.
    #[arg(long, value_parser = KvEventsConfig::parse)]
    kv_events_config: Option<KvEventsConfig>,
    /// Prefill/decode disaggregation role, as SGLang's flag: prefill (computes the prompt and
    /// one token, serves bootstrap rooms), decode (generates once the named prefill server's
    /// room is ready), or null (whole requests). Requests without bootstrap fields are refused
    /// in either role.
    #[arg(long, default_value = "null", value_parser = parse_mode)]
    disaggregation_mode: Mode,
    /// Attention-DP ranks per port (SGLang's --dp-size with DP attention): each rank has its own
    /// queue, scheduler and radix cache; a request's `data_parallel_rank` picks one (out of
    /// range: 400), else round robin. With --kv-events-config rank r publishes on port + r.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=256))]
    dp_size: u16,
    /// Prefill: the bootstrap port of the worker at index 0 of --ports (index i listens on
    /// this + i; 0 = ephemeral). Decode: the port asked when a request's bootstrap_port is null.
    #[arg(long, default_value_t = DEFAULT_BOOTSTRAP_PORT)]
    disaggregation_bootstrap_port: u16,
    /// SGLang's priority scheduling: each scheduler orders its waiting queue by the requests'
    /// `priority` field, higher first, FCFS within a priority (a request without one ranks
    /// last). Off, the field is ignored, as SGLang ignores it.
    #[arg(long)]
    enable_priority_scheduling: bool,
    /// SGLang's limit on each scheduler's waiting queue: a request arriving while it is full
    /// is refused with 503 "The request queue is full." (under priority scheduling a queued
    /// request of strictly lower priority is refused instead). Unset: unbounded.
    #[arg(long)]
    max_queued_requests: Option<usize>,
    /// Which server to play: sglang (SGLang's API, `sglang:` metrics, SGLang's KV events and
    /// /get_server_info) or vllm (vLLM's: /inference/v1/generate and no /generate,
    /// /kv_event_sources and no /get_server_info, /reset_prefix_cache for /flush_cache,
    /// `vllm:` metrics, vLLM's KV-event encoding; --kv-events-config then needs
    /// "enable_kv_cache_events": true, as vLLM's does). Scheduler, cache and cost model are
    /// the same for both.
    #[arg(long, default_value = "sglang", value_parser = EngineKind::parse)]
    engine: EngineKind,
    /// vLLM's --lora-modules NAME=PATH ... (--engine vllm): adapters a request names in
    /// `model` (their blocks kept apart in the cache), listed by /v1/models with the base
    /// model as parent.
    #[arg(long, num_args = 1.., value_parser = LoraModule::parse)]
    lora_modules: Vec<LoraModule>,
    /// SGLang's --api-key: every request needs `Authorization: Bearer KEY` except OPTIONS and
    /// paths starting with /health, /ready or /metrics, else 401 {"error": "Unauthorized"}.
    /// With --engine vllm, vLLM's rule: only paths starting with /v1, /v2, /inference or
    /// /cohere need it.
    #[arg(long)]
    api_key: Option<String>,
}

#[derive(Debug, Clone)]
struct PortList(Vec<u16>);

fn parse_ports(s: &str) -> Result<PortList, String> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let port = |x: &str| {
            x.trim()
                .parse::<u16>()
                .map_err(|e| format!("bad port {x:?}: {e}"))
        };
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (port(a)?, port(b)?);
                if a > b {
                    return Err(format!("empty port range {part}"));
                }
                out.extend(a..=b);
            }
            None => out.push(port(part)?),
        }
    }
    if out.is_empty() {
        return Err("no ports given".into());
    }
    Ok(PortList(out))
}

fn main() -> ExitCode {
    let a = Args::parse();
    if let Some(dir) = &a.write_tokenizer {
        return match loadtest::sim::hf_export::write_cl100k_folder(dir) {
            Ok(()) => {
                println!("sim-worker wrote tokenizer folder {}", dir.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("sim-worker: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let cfg = SimConfig {
        ports: a.ports.0,
        host: a.host,
        model_name: a.model_name,
        max_total_tokens: a.max_total_tokens,
        page_size: a.page_size,
        host_cache_tokens: a.host_cache_tokens,
        chunked_prefill_size: a.chunked_prefill_size,
        max_running: a.max_running_requests,
        time_scale: a.time_scale,
        tokenizer: match a.tokenizer {
            TokenizerArg::Bpe => TokenizerMode::Bpe,
            TokenizerArg::Approx => TokenizerMode::Approx,
        },
        tokenizer_path: a.tokenizer_path,
        token_interval_ms: a.token_interval_ms,
        default_max_tokens: a.default_max_tokens,
        seed: a.seed,
        faults: Faults {
            fail_rate: a.fail_rate,
            latency_ms: a.latency_ms,
            die_after: a.die_after,
            stall_after: a.stall_after,
            health_fail: a.health_fail,
            close_mid_stream: a.close_mid_stream,
        },
        record_requests: a.record_requests,
        io_driver: match a.io_driver {
            DriverArg::Auto => IoDriver::Auto,
            DriverArg::Uring => IoDriver::Uring,
            DriverArg::Legacy => IoDriver::Legacy,
        },
        kv_events: a.kv_events_config,
        disaggregation_mode: a.disaggregation_mode.0,
        dp_size: usize::from(a.dp_size),
        disaggregation_bootstrap_port: a.disaggregation_bootstrap_port,
        priority_scheduling: a.enable_priority_scheduling,
        max_queued_requests: a.max_queued_requests,
        api_key: a.api_key,
        engine: a.engine,
        lora_modules: a.lora_modules,
    };
    loadtest::signals::block_stop_signals();
    let host = cfg.host.clone();
    let cluster = match spawn_cluster(cfg) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("sim-worker: {e}");
            return ExitCode::FAILURE;
        }
    };
    eprintln!("sim-worker: io driver {}", cluster.io_driver());
    for p in cluster.ports() {
        println!("sim-worker listening on {host}:{p}");
    }
    for (p, kv) in cluster.ports().iter().zip(cluster.kv_events()) {
        let replay = kv.replay_endpoint.as_deref().unwrap_or("none");
        println!(
            "sim-worker kv events for {host}:{p} on {} replay {replay}",
            kv.endpoint
        );
    }
    for (p, b) in cluster.ports().iter().zip(cluster.bootstrap_ports()) {
        println!("sim-worker bootstrap for {host}:{p} on {b}");
    }
    loadtest::signals::stop_on_signal(cluster.stopper());
    match cluster.join() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sim-worker: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_lists() {
        assert_eq!(
            parse_ports("31000-31003").unwrap().0,
            vec![31000, 31001, 31002, 31003]
        );
        assert_eq!(parse_ports("1, 5-6,9").unwrap().0, vec![1, 5, 6, 9]);
        assert!(parse_ports("5-4").is_err());
        assert!(parse_ports("x").is_err());
        assert!(parse_ports("").is_err());
    }

    #[test]
    fn kv_events_flag() {
        let a = Args::try_parse_from([
            "sim-worker",
            "--kv-events-config",
            r#"{"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:6557"}"#,
        ])
        .unwrap();
        let kv = a.kv_events_config.unwrap();
        assert_eq!(kv.replay_endpoint.as_deref(), Some("tcp://*:6557"));
        assert!(Args::try_parse_from(["sim-worker", "--kv-events-config", "{\"x\":1}"]).is_err());
        assert!(Args::try_parse_from(["sim-worker"])
            .unwrap()
            .kv_events_config
            .is_none());
    }

    #[test]
    fn host_cache_flag_defaults_to_no_host_tier() {
        assert_eq!(
            Args::try_parse_from(["sim-worker"])
                .unwrap()
                .host_cache_tokens,
            0
        );
        let a = Args::try_parse_from(["sim-worker", "--host-cache-tokens", "800000"]).unwrap();
        assert_eq!(a.host_cache_tokens, 800_000);
    }

    #[test]
    fn tokenizer_flags() {
        let a = Args::try_parse_from([
            "sim-worker",
            "--tokenizer-path",
            "/m",
            "--write-tokenizer",
            "/d",
        ])
        .unwrap();
        assert_eq!(
            a.tokenizer_path.as_deref(),
            Some(std::path::Path::new("/m"))
        );
        assert_eq!(
            a.write_tokenizer.as_deref(),
            Some(std::path::Path::new("/d"))
        );
    }

    #[test]
    fn engine_and_lora_flags() {
        let a = Args::try_parse_from(["sim-worker"]).unwrap();
        assert_eq!(a.engine, EngineKind::Sglang);
        assert!(a.lora_modules.is_empty());
        let a = Args::try_parse_from([
            "sim-worker",
            "--engine",
            "vllm",
            "--lora-modules",
            "a=/p/a",
            "b",
        ])
        .unwrap();
        assert_eq!(a.engine, EngineKind::Vllm);
        let names: Vec<&str> = a.lora_modules.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(a.lora_modules[0].path, "/p/a");
        assert!(Args::try_parse_from(["sim-worker", "--engine", "trt"]).is_err());
        assert!(Args::try_parse_from(["sim-worker", "--lora-modules", "=x"]).is_err());
    }
}
