//! A short multi-turn chat workload through the gateway in front of a simulated cluster, as CI's
//! end-to-end check of the whole system: nothing fails, and cache_aware keeps clearly more of the
//! prompt cached on the workers than round_robin on the same seed.

use crate::common::*;
use loadtest::loadgen::{run, LoadConfig};

fn run_policy(policy: &str) -> loadtest::loadgen::Report {
    let cluster = sim(4, |c| c.time_scale = 20.0);
    let gw = gateway_for(&cluster.urls(), &["--policy", policy, "--cores", "2"]);
    let mut cfg = LoadConfig::smoke(&format!("http://{}", gw.addr));
    cfg.model = "meta-llama/Llama-3.1-8B-Instruct".into();
    let report = run(&cfg).expect("workload runs");
    assert_eq!(
        report.failed, 0,
        "{policy}: {:?} {:?}",
        report.errors, report.error_examples
    );
    assert!(
        report.ok >= 12,
        "{policy}: only {} requests completed",
        report.ok
    );
    assert!(report.ttft.count > 0);
    report
}

#[test]
fn cache_aware_keeps_a_higher_hit_rate_than_round_robin_on_a_chat_workload() {
    let rr = run_policy("round_robin");
    let ca = run_policy("cache_aware");
    let (rr_hit, ca_hit) = (rr.hit_rate.unwrap_or(0.0), ca.hit_rate.unwrap_or(0.0));
    eprintln!("hit rate: round_robin {rr_hit:.3}, cache_aware {ca_hit:.3}");
    // Measured on this seed: round_robin 0.47–0.52, cache_aware 0.71–0.76 (idle machine and
    // under parallel test load, io_uring and epoll). A cache_aware that routes like a
    // load balancer lands near round_robin and fails both bounds.
    assert!(
        ca_hit >= 0.6,
        "cache_aware hit rate {ca_hit:.3} < 0.6 (round_robin {rr_hit:.3})"
    );
    assert!(
        ca_hit - rr_hit >= 0.15,
        "cache_aware {ca_hit:.3} is not clearly above round_robin {rr_hit:.3} (margin 0.15)"
    );
}
