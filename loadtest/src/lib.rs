/// Seeded SplitMix64 PRNG and workload distributions, shared by `sim` and `loadgen` so both
/// replay bit-for-bit from a seed.
pub mod rng;

/// Load generator: workloads, open/closed-loop HTTP client, latency and hit-rate report.
pub mod loadgen;

/// Simulated SGLang worker (`sim-worker`): radix cache, scheduler, cost model, HTTP API.
pub mod sim;

/// The streaming benchmark's paced SSE upstream and closed-loop streaming client, each one
/// thread on raw epoll (`stream-upstream`, `loadgen streams`).
pub mod streams;

/// SIGINT/SIGTERM taken by one thread that sets a stop flag (`sim-worker`, `kv-fleet`).
pub mod signals;

/// `kv-fleet`: thousands of simulated SGLang KV-event publishers (ZeroMQ PUB + replay ROUTER per
/// DP rank, a tiny HTTP server per server) in one process, and the driver measuring a gateway.
pub mod fleet;
