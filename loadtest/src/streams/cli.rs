//! `loadgen streams`: the command line of the streaming client (see [`super::client`]), kept
//! apart from loadgen's workload flags because it shares none of them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

use super::client::{self, StreamsConfig};
use crate::loadgen::Target;

/// Hold N keep-alive connections streaming chat completions in a closed loop, and time every
/// SSE event against the `sent_ns` stamp of `stream-upstream` (the delay a proxy adds to each
/// event), the first event against the request (TTFT), and optionally GET /health while the
/// streams are open. Loopback targets only.
#[derive(Parser, Debug)]
#[command(name = "loadgen streams")]
pub struct StreamsCli {
    /// Base URL of the proxy or upstream (http://127.0.0.1:PORT).
    #[arg(long, default_value = "http://127.0.0.1:30000")]
    target: String,
    /// Concurrent streams (one keep-alive connection each).
    #[arg(long, default_value_t = 1024)]
    streams: usize,
    /// Measurement window, seconds.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Seconds between the last connection opened and the window (events then are not counted).
    #[arg(long, default_value_t = 3.0)]
    warmup: f64,
    /// Most connections opened per millisecond (the ramp; 8,192 streams at 256 take 32 ms).
    #[arg(long, default_value_t = 256)]
    ramp_per_ms: usize,
    /// No byte for this long with a request outstanding is a timeout.
    #[arg(long, default_value_t = 10.0)]
    stall_secs: f64,
    /// Request body size, bytes (approximately).
    #[arg(long, default_value_t = 1024)]
    prompt_bytes: usize,
    /// max_tokens of every request: the events per stream.
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    /// model of every request.
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// Path of the streamed requests.
    #[arg(long, default_value = "/v1/chat/completions")]
    path: String,
    /// Probe this URL (same host and port as --target) with GET on its own connection while the
    /// streams are open, and report its latency.
    #[arg(long)]
    health_url: Option<String>,
    /// Milliseconds between health probes.
    #[arg(long, default_value_t = 10.0)]
    health_every_ms: f64,
    /// Idle mode: each connection sends one GET --idle-path, then the connections are held
    /// without traffic for this many seconds after all have answered (weighs idle keep-alive
    /// connections); no streams.
    #[arg(long)]
    idle_hold_secs: Option<f64>,
    /// The one request of idle mode.
    #[arg(long, default_value = "/health")]
    idle_path: String,
    /// Write a line here when the window starts (idle mode: when all connections are idle).
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// PIDs (comma-separated) whose CPU time and RSS are read at the window's edges: the proxy.
    #[arg(long, value_delimiter = ',')]
    watch_pids: Vec<u32>,
    /// Print the report as one JSON line on stdout (the human summary goes to stderr).
    #[arg(long)]
    json: bool,
    /// A progress line on stderr every second.
    #[arg(long)]
    progress: bool,
}

fn positive(name: &str, v: f64) -> Result<(), String> {
    if v.is_finite() && v > 0.0 && v < 1e7 {
        Ok(())
    } else {
        Err(format!("{name} must be a positive number of seconds"))
    }
}

impl StreamsCli {
    fn config(self) -> Result<StreamsConfig, String> {
        let t = Target::parse(&self.target).map_err(|e| e.to_string())?;
        let SocketAddr::V4(addr) = t.addr else {
            return Err("loadgen streams targets 127.0.0.1 (IPv4) only".into());
        };
        let health_path = match &self.health_url {
            None => None,
            Some(u) => {
                let h = Target::parse(u).map_err(|e| e.to_string())?;
                if h.addr != t.addr {
                    return Err("--health-url must name the --target's host and port".into());
                }
                Some(if h.base_path.is_empty() {
                    "/".into()
                } else {
                    h.base_path
                })
            }
        };
        positive("--duration", self.duration)?;
        positive("--stall-secs", self.stall_secs)?;
        if !(self.warmup.is_finite() && self.warmup >= 0.0) {
            return Err("--warmup must be >= 0".into());
        }
        if let Some(h) = self.idle_hold_secs {
            positive("--idle-hold-secs", h)?;
        }
        if self.streams == 0 {
            return Err("--streams must be at least 1".into());
        }
        if !(self.health_every_ms.is_finite() && self.health_every_ms >= 0.1) {
            return Err("--health-every-ms must be at least 0.1".into());
        }
        Ok(StreamsConfig {
            addr,
            host: t.host,
            path: format!("{}{}", t.base_path, self.path),
            streams: self.streams,
            duration_s: self.duration,
            warmup_s: self.warmup,
            ramp_per_ms: self.ramp_per_ms.max(1),
            stall_s: self.stall_secs,
            prompt_bytes: self.prompt_bytes,
            max_tokens: self.max_tokens,
            model: self.model,
            health_path,
            health_every_ms: self.health_every_ms,
            idle_hold_s: self.idle_hold_secs,
            idle_path: self.idle_path,
            ready_file: self.ready_file,
            watch_pids: self.watch_pids,
            progress: self.progress,
        })
    }
}

/// Parse `args` (from `streams` on), run, print. Exit 0 when it ran (errors are in the report),
/// 1 when no event (or, in idle mode, no connection) got through, 2 on bad flags or setup.
pub fn main(args: impl IntoIterator<Item = std::ffi::OsString>) -> ExitCode {
    let cli = StreamsCli::parse_from(args);
    let json = cli.json;
    let cfg = match cli.config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("loadgen streams: {e}");
            return ExitCode::from(2);
        }
    };
    let idle = cfg.idle_hold_s.is_some();
    let report = match client::run(cfg) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("loadgen streams: {e}");
            return ExitCode::from(2);
        }
    };
    if json {
        eprint!("{}", report.summary());
        match serde_json::to_string(&report) {
            Ok(line) => println!("{line}"),
            Err(e) => {
                eprintln!("loadgen streams: cannot serialise the report: {e}");
                return ExitCode::from(2);
            }
        }
    } else {
        print!("{}", report.summary());
    }
    if (idle && report.open_at_end == 0) || (!idle && report.events == 0) {
        eprintln!("loadgen streams: nothing got through");
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}
