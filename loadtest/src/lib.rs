/// Seeded SplitMix64 PRNG and workload distributions, shared by `sim` and `loadgen` so both
/// replay bit-for-bit from a seed.
pub mod rng;

/// Load generator: workloads, open/closed-loop HTTP client, latency and hit-rate report.
pub mod loadgen;

/// Simulated SGLang worker (`sim-worker`): radix cache, scheduler, cost model, HTTP API.
pub mod sim;
