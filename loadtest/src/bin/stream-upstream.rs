//! `stream-upstream`: the paced SSE upstream of `scripts/bench-streams.sh` (see
//! `loadtest::streams::upstream`). Listens on 127.0.0.1 only, prints its port, and serves until
//! killed.

use std::process::ExitCode;
use std::sync::atomic::AtomicBool;

use clap::Parser;
use loadtest::streams::upstream::{Upstream, UpstreamConfig};

/// A worker-shaped HTTP/1.1 server that answers every completion request with one SSE event
/// per interval, each stamped with the CLOCK_MONOTONIC time of its write (`sent_ns`). The first
/// event is written at once with the response head; the last carries `[DONE]`. One thread,
/// raw epoll.
#[derive(Parser)]
#[command(name = "stream-upstream", version)]
struct Cli {
    /// Port on 127.0.0.1 (0: any free port; the port is printed).
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// Milliseconds between two events of a stream (fractions allowed: 2, 12.5, 80).
    #[arg(long, default_value_t = 20.0)]
    interval_ms: f64,
    /// Model name served.
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// Events per stream when the body names no max_tokens.
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    /// Most events per stream, whatever the body asks.
    #[arg(long, default_value_t = 1_000_000)]
    max_tokens_cap: u32,
    /// Print a line of counters to stderr every N seconds (0: never).
    #[arg(long, default_value_t = 0)]
    stats_secs: u64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if !(cli.interval_ms.is_finite() && cli.interval_ms >= 0.01 && cli.interval_ms <= 3.6e6) {
        eprintln!("stream-upstream: --interval-ms must be between 0.01 and 3600000");
        return ExitCode::from(2);
    }
    let up = match Upstream::bind(UpstreamConfig {
        port: cli.port,
        interval_ns: (cli.interval_ms * 1e6).round() as u64,
        model: cli.model,
        default_max_tokens: cli.max_tokens,
        max_tokens_cap: cli.max_tokens_cap,
        stats_every_s: cli.stats_secs,
    }) {
        Ok(u) => u,
        Err(e) => {
            eprintln!("stream-upstream: cannot listen: {e}");
            return ExitCode::from(2);
        }
    };
    println!("stream-upstream listening on 127.0.0.1:{}", up.port());
    let stop = AtomicBool::new(false);
    match up.run(&stop) {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("stream-upstream: {e}");
            ExitCode::from(1)
        }
    }
}
