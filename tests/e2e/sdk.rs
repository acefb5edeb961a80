//! The official OpenAI and Anthropic Python SDKs against the gateway in front of simulated
//! workers: `client.responses.create` and `client.messages.create`, streaming and not, each in
//! two-turn conversations whose turn 2 must follow turn 1 to its worker; the SDKs' own stream
//! helpers must accept the event streams (tests/fixtures/sdk_clients.py).
//!
//! The interpreter: `common::test_python` (scripts/test.sh installs the SDKs, pinned in
//! tests/requirements.txt, into `.venv-test/`). Without them the test fails, it never skips.

use crate::common::*;
use std::collections::HashSet;
use std::process::{Command, Stdio};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn python() -> Option<String> {
    Some(test_python(&["openai", "anthropic"]))
}

#[test]
fn official_sdks_parse_the_answers_and_turn_2_follows_turn_1() {
    let Some(python) = python() else { return };
    let cluster = sim(3, |_| {});
    let gw = gateway_for(&cluster.urls(), &["--policy", "cache_aware"]);
    let out = Command::new(&python)
        .arg(format!("{ROOT}/tests/fixtures/sdk_clients.py"))
        .arg(format!("http://{}", gw.addr))
        .arg("3")
        .stderr(Stdio::inherit())
        .output()
        .expect("run the SDK client script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "SDK script failed:\n{stdout}");
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut scenarios = HashSet::new();
    let mut homes = HashSet::new();
    for l in &lines {
        let scenario = l["scenario"].as_str().unwrap();
        scenarios.insert(scenario.to_string());
        if scenario == "helpers" {
            assert_eq!(l["ok"], true);
            continue;
        }
        let ports = l["ports"].as_array().unwrap();
        assert_eq!(ports[0], ports[1], "{scenario}: turn 2 moved: {l}");
        homes.insert(ports[0].as_u64().unwrap());
        for t in l["texts"].as_array().unwrap() {
            assert!(
                !t.as_str().unwrap().is_empty(),
                "{scenario}: empty reply: {l}"
            );
        }
        let events: Vec<&str> = l["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.as_str().unwrap())
            .collect();
        match scenario {
            "responses-stream" => {
                for want in [
                    "response.created",
                    "response.output_text.delta",
                    "response.completed",
                ] {
                    assert!(events.contains(&want), "{scenario}: no {want}: {l}");
                }
            }
            "messages-stream" => {
                for want in [
                    "message_start",
                    "content_block_start",
                    "content_block_delta",
                    "content_block_stop",
                    "message_delta",
                    "message_stop",
                ] {
                    assert!(events.contains(&want), "{scenario}: no {want}: {l}");
                }
            }
            _ => assert!(events.is_empty()),
        }
    }
    assert_eq!(
        scenarios,
        [
            "responses",
            "responses-stream",
            "messages",
            "messages-stream",
            "helpers"
        ]
        .map(String::from)
        .into_iter()
        .collect()
    );
    assert!(
        homes.len() >= 2,
        "every conversation on one worker: {homes:?}"
    );
}
