//! Every end-to-end suite in one test binary: real sockets on 127.0.0.1, gateways in-process or
//! as the `radixgate` binary in a child process, simulated SGLang workers and the Python
//! counterparts. One binary compiles `common` once instead of once per suite, and
//! `cargo test --test e2e` (what scripts/test.sh runs again on epoll) runs a suite added here
//! without any list to keep. The suites are the files of tests/e2e/ (module `e2e` below, so a
//! test's name is `e2e::suite::test`); their helpers are tests/common/, the one helper folder of
//! the end-to-end tests, which `tests/docs.rs` (a binary of its own, like `tests/layers.rs` and
//! `tests/fuzz_corpus.rs`: they check files) also declares for its one running gateway.
//!
//! The suites share one process and run two at a time. What that could disturb is handled in
//! `common`: tests whose figures are delays, CPU shares or memory take [`common::serial`], and
//! tests that keep a CPU busy take [`common::busy`] (one lock: no figure is measured beside
//! another test's figure or a CPU hog); tests that read the process's own memory,
//! process-wide metrics or its threads run in a child process of this binary
//! ([`common::alone_in_a_process`]); and no test picks a port number someone else can take
//! meanwhile (`common::ports`).

mod common;

/// The suites, one file each in tests/e2e/.
mod e2e {
    mod admission;
    mod apis;
    mod backpressure;
    mod data_plane;
    mod dp;
    mod hardening_conn;
    mod hardening_events;
    mod hardening_memory;
    mod hardening_upstream;
    mod k8s_discovery;
    mod kv_intake;
    mod kv_routing;
    mod pd;
    mod reliability;
    mod routing;
    mod sdk;
    mod sglang_events;
    mod soak;
    mod soak_round3;
    mod streaming;
    mod telemetry;
    mod tenants;
    mod tokenizer_golden;
    mod tracing;
    mod vllm_events;
    mod vllm_fleet;
    mod vllm_forms;
    mod worker_key;
    mod workload;
}
