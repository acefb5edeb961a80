//! Tenants end to end: what the workers get (the class the gateway used in the body's
//! `priority`, no caller key unless asked, none of the gateway's own headers), anonymous callers
//! clamped to class 0, tenant keys beside `--api-key`, and tenant limits that count what a
//! request really asks for. Real sockets on 127.0.0.1; the simulated worker records what it
//! received.

use crate::common::*;
use radixgate::runtime::Running;
use serde_json::{json, Value};
use std::time::Duration;

/// A config file of tenants in a directory of its own.
fn config(tag: &str, text: &str) -> String {
    let dir = std::env::temp_dir().join(format!("radixgate-tenants-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tenants.toml");
    std::fs::write(&path, text).unwrap();
    path.to_string_lossy().into_owned()
}

const TENANTS: &str = r#"
[tenants.capped]
keys = ["k-capped"]
max_priority = 0

[tenants.vip]
keys = ["k-vip"]
max_priority = 10

[tenants.two]
keys = ["k-two"]
requests_per_minute = 2

[tenants.small]
keys = ["k-small"]
tokens_per_minute = 50000

[tenants.none]
keys = ["k-none"]
requests_per_minute = 0
"#;

fn admission_gateway(c: &loadtest::sim::SimCluster, tag: &str, extra: &[&str]) -> Running {
    let cfg = config(tag, TENANTS);
    let mut args = vec!["--config", cfg.as_str(), "--saturation-admission"];
    args.extend_from_slice(extra);
    gateway_for(&c.urls(), &args)
}

fn post(gw: &Running, headers: &[(&str, &str)], body: &Value) -> Response {
    request(
        gw.addr,
        "POST",
        "/generate",
        headers,
        body.to_string().as_bytes(),
    )
    .expect("an answer")
}

/// The headers (lower-case names) and body of the last `/generate` the worker received.
fn last_generate(c: &loadtest::sim::SimCluster) -> (Vec<(String, String)>, Value) {
    let all: Value = serde_json::from_str(&sim_recorded(c, 0)).unwrap();
    let r = all
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|r| r["path"] == "/generate")
        .unwrap_or_else(|| panic!("no /generate recorded: {all}"))
        .clone();
    let headers = r["headers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| {
            (
                h[0].as_str().unwrap().to_ascii_lowercase(),
                h[1].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let body = serde_json::from_str(r["body"].as_str().unwrap()).unwrap();
    (headers, body)
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Vec<&'a str> {
    headers
        .iter()
        .filter(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
        .collect()
}

#[test]
fn the_engine_gets_the_class_the_gateway_used_and_none_of_its_headers() {
    let c = sim(1, |_| {});
    let gw = admission_gateway(&c, "class", &[]);
    let gen = |p: Value| json!({"text": "hello there", "sampling_params": {"max_new_tokens": 2}, "priority": p});
    // A tenant capped at 0 claiming a million (and as a string, and as a float) is class 0 at
    // the engine too.
    for claim in [json!(1_000_000), json!("1000000"), json!(1e6)] {
        let r = post(
            &gw,
            &[("authorization", "Bearer k-capped")],
            &gen(claim.clone()),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        let (headers, body) = last_generate(&c);
        assert_eq!(body["priority"], json!(0), "{claim}: {body}");
        assert_eq!(header(&headers, "x-smg-priority"), Vec::<&str>::new());
    }
    // The header's class, within the tenant's maximum, replaces the body's; the header stays
    // at the gateway.
    let r = post(
        &gw,
        &[("authorization", "Bearer k-vip"), ("x-smg-priority", "50")],
        &gen(json!(3)),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let (headers, body) = last_generate(&c);
    assert_eq!(body["priority"], json!(10), "{body}");
    assert!(header(&headers, "x-smg-priority").is_empty(), "{headers:?}");
    // A priority within the bound reaches the engine as the client wrote it, and a body
    // without one gets none (an engine without priority scheduling refuses one).
    let r = post(&gw, &[("authorization", "Bearer k-vip")], &gen(json!(7)));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(last_generate(&c).1["priority"], json!(7));
    let r = post(
        &gw,
        &[("x-smg-priority", "5")],
        &json!({"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(last_generate(&c).1.get("priority").is_none());
}

#[test]
fn an_anonymous_caller_is_class_0_whatever_it_claims() {
    let c = sim(1, |_| {});
    let gw = admission_gateway(&c, "anon", &[]);
    for headers in [
        vec![("x-smg-priority", "2147483647")],
        vec![
            ("authorization", "Bearer unknown"),
            ("x-smg-priority", "99"),
        ],
    ] {
        let body =
            json!({"text": "hi", "sampling_params": {"max_new_tokens": 2}, "priority": 2147483647});
        let r = post(&gw, &headers, &body);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(last_generate(&c).1["priority"], json!(0), "{headers:?}");
    }
}

#[test]
fn a_tenant_key_is_accepted_beside_the_api_key() {
    let c = sim(1, |_| {});
    let cfg = config("apikey", TENANTS);
    let gw = gateway_for(&c.urls(), &["--config", &cfg, "--api-key", "k-main"]);
    let body = json!({"text": "hi", "sampling_params": {"max_new_tokens": 2}});
    for key in ["Bearer k-main", "Bearer k-vip", "Bearer k-capped"] {
        let r = post(&gw, &[("authorization", key)], &body);
        assert_eq!(r.status, 200, "{key}: {}", r.text());
    }
    assert_eq!(
        post(&gw, &[("authorization", "Bearer nope")], &body).status,
        401
    );
    assert_eq!(post(&gw, &[], &body).status, 401);
    // A tenant key opens no admin read.
    let r = request(
        gw.addr,
        "GET",
        "/workers",
        &[("authorization", "Bearer k-vip")],
        b"",
    )
    .unwrap();
    assert_eq!(r.status, 401, "{}", r.text());
}

#[test]
fn a_callers_key_stops_at_a_gateway_that_checks_keys_unless_asked_and_a_worker_key_goes_instead() {
    let c = sim(1, |_| {});
    let body = json!({"text": "hi", "sampling_params": {"max_new_tokens": 2}});
    let sent = |gw: &Running| {
        let r = post(
            gw,
            &[
                ("authorization", "Bearer k-main"),
                ("x-api-key", "k-main"),
                ("x-tenant", "vip"),
            ],
            &body,
        );
        assert_eq!(r.status, 200, "{}", r.text());
        let (headers, _) = last_generate(&c);
        (
            header(&headers, "authorization")
                .into_iter()
                .map(str::to_string)
                .collect::<Vec<_>>(),
            header(&headers, "x-api-key").len(),
            header(&headers, "x-tenant").len(),
        )
    };
    // Default: nothing of the caller's key reaches the worker.
    let gw = gateway_for(
        &c.urls(),
        &["--api-key", "k-main", "--tenant-header", "x-tenant"],
    );
    assert_eq!(sent(&gw), (vec![], 0, 0));
    drop(gw);
    // A worker key: that one only.
    let gw = gateway_for(
        &c.urls(),
        &["--api-key", "k-main", "--worker-api-key", "wk"],
    );
    assert_eq!(sent(&gw), (vec!["Bearer wk".to_string()], 0, 1));
    drop(gw);
    // The reference's pass-through, on request.
    let gw = gateway_for(
        &c.urls(),
        &["--api-key", "k-main", "--forward-client-authorization"],
    );
    assert_eq!(sent(&gw), (vec!["Bearer k-main".to_string()], 1, 1));
    drop(gw);
    // A gateway that checks no keys passes them on as the reference does.
    let gw = gateway_for(&c.urls(), &[]);
    assert_eq!(sent(&gw), (vec!["Bearer k-main".to_string()], 1, 1));
}

#[test]
fn tenant_limits_count_every_prompt_and_token_and_0_allows_nothing() {
    let c = sim(1, |_| {});
    let gw = admission_gateway(&c, "limits", &[]);
    let received = || sim_count(&c, 0, "inference_received");
    let before = received();
    // Two requests a minute: a batch of three prompts does not fit, nor does n = 3.
    let two = [("authorization", "Bearer k-two")];
    for body in [
        json!({"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 1}}),
        json!({"text": "a", "sampling_params": {"max_new_tokens": 1, "n": 3}}),
        json!({"input_ids": [[1, 2], [3], [4]], "sampling_params": {"max_new_tokens": 1}}),
    ] {
        let r = post(&gw, &two, &body);
        assert_eq!(r.status, 429, "{body}: {}", r.text());
        assert!(r.text().contains("whole per-minute limit"), "{}", r.text());
        assert_eq!(r.header("retry-after"), Some("60"));
    }
    // A batch of two fits once, then the limit is used up for half a minute.
    let pair = json!({"text": ["a", "b"], "sampling_params": {"max_new_tokens": 1}});
    assert_eq!(post(&gw, &two, &pair).status, 200);
    let r = post(
        &gw,
        &two,
        &json!({"text": "a", "sampling_params": {"max_new_tokens": 1}}),
    );
    assert_eq!(r.status, 429, "{}", r.text());
    let retry: u32 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((25..=31).contains(&retry), "{retry}");
    // 50,000 tokens a minute: a 400 KB prompt (about 100,000 tokens) is over it, even though
    // the gateway routes on its first 128 KiB only.
    let long = "lorem ipsum dolor sit amet ".repeat(400_000 / 27);
    let r = post(
        &gw,
        &[("authorization", "Bearer k-small")],
        &json!({"text": long, "sampling_params": {"max_new_tokens": 1}}),
    );
    assert_eq!(r.status, 429, "{}", r.text());
    // A limit of 0 allows nothing, from the first request on, with a sane Retry-After.
    for _ in 0..2 {
        let r = post(
            &gw,
            &[("authorization", "Bearer k-none")],
            &json!({"text": "a", "sampling_params": {"max_new_tokens": 1}}),
        );
        assert_eq!(r.status, 429, "{}", r.text());
        assert_eq!(r.header("retry-after"), Some("60"));
    }
    assert_eq!(
        received(),
        before + 1,
        "only the batch of two reached the worker"
    );
    // Nobody else is held to them.
    let r = post(
        &gw,
        &[],
        &json!({"text": "a", "sampling_params": {"max_new_tokens": 1}}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    wait_until("the worker saw it", Duration::from_secs(5), || {
        (received() == before + 2).then_some(())
    });
}
