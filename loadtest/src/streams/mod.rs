//! The bundled streaming benchmark's two tools, each one thread on raw epoll so both fit on
//! the one CPU the benchmark leaves them: a paced SSE upstream ([`upstream`], the
//! `stream-upstream` binary) whose every event carries the CLOCK_MONOTONIC time it was written,
//! and a closed-loop streaming client ([`client`], `loadgen streams`) that holds thousands of
//! streams open and times every event against that stamp. `scripts/bench-streams.sh` runs
//! them around each proxy.

#![warn(missing_docs)]

pub mod cli;
pub mod client;
pub mod decode;
pub mod report;
pub mod request;
pub mod sys;
pub mod upstream;
pub mod watch;

#[cfg(test)]
mod e2e_tests;
