//! `kv-fleet`: thousands of simulated SGLang KV-event publishers in one process, and the driver
//! that measures a gateway fed by them (see `loadtest::fleet`).

use clap::Parser;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    loadtest::signals::block_stop_signals();
    let limit = loadtest::streams::sys::raise_nofile_limit();
    let args = loadtest::fleet::FleetArgs::parse();
    let need = args
        .servers_of_shard()
        .map_or(0, |s| s.len() * (1 + 5 * args.dp)) as u64
        + 256;
    if limit < need {
        eprintln!(
            "kv-fleet: warning: open-file limit {limit} < ~{need} descriptors this shard needs (5 per publisher, 1 per server); run more shards (--shard K/N) or raise ulimit -n"
        );
    }
    if let Err(e) = loadtest::fleet::run(args) {
        eprintln!("kv-fleet: {e}");
        std::process::exit(1);
    }
}
