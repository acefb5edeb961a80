//! vLLM's request forms routed exactly, on KV events published the way vLLM 0.33 publishes them
//! (`tests/fixtures/kv_publisher.py`, map-encoded events with `lora_name` and per-block
//! `extra_keys`, the salt in a request's first block only, replies in the plain replay form).
//!
//! Two fleets:
//! - simulated workers (`common::sim`, page size 4) for `/v1/completions` with a token-id
//!   prompt, a batch of token lists (routed on its first list), a refused mixed prompt, and
//!   salted and unsalted requests each reaching the worker holding their namespace;
//! - vLLM-shaped fake workers in this file (raw TCP: `/v1/models` with an adapter card whose
//!   `parent` is the base, `POST /inference/v1/generate` answered as JSON or SSE, no
//!   `/get_server_info`), since the simulator serves neither the route nor adapter cards: the
//!   gateway forwards the route to the worker holding the token ids, byte for byte, and a
//!   request naming the adapter by its own name reaches the worker holding the adapter's
//!   blocks, not the one holding the base model's.

use crate::common::fake_vllm::FakeVllm;
use crossbeam::channel::{self, Receiver};
use radixgate::kv::index::{namespace_root, MatchScratch, ROOT_PARENT};
use serde_json::json;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const LIMIT: Duration = Duration::from_secs(20);
const PAGE: u32 = 4;
const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// `tests/fixtures/kv_publisher.py` in the replay form vLLM answers with; killed (by PID) on
/// drop.
struct Publisher {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    live: u16,
    replay: u16,
}

impl Publisher {
    fn start() -> Publisher {
        let python = crate::common::test_python(&["zmq", "msgpack"]);
        let mut child = Command::new(python)
            .arg(format!("{ROOT}/tests/fixtures/kv_publisher.py"))
            .args(["--replay-form", "plain"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the Python publisher");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = channel::unbounded();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let ready = lines.recv_timeout(LIMIT).expect("the publisher starts");
        let ports: Vec<u16> = ready
            .strip_prefix("ready ")
            .unwrap_or_else(|| panic!("publisher said {ready}"))
            .split(' ')
            .map(|p| p.parse().unwrap())
            .collect();
        Publisher {
            child,
            stdin,
            lines,
            live: ports[0],
            replay: ports[1],
        }
    }

    /// Publishes `tokens` as vLLM stores a request's prompt: a first event of `first` blocks
    /// (its first block's extra keys hold the adapter's name, then the salt), then one event
    /// for the rest chained to it (keys: the adapter's name only). Hashes are `id`'s, above
    /// 2^63 as vLLM's often are.
    fn store_prompt(
        &mut self,
        id: u64,
        tokens: &[u32],
        first: usize,
        salt: Option<&str>,
        lora: Option<&str>,
    ) {
        let blocks = tokens.len() / PAGE as usize;
        let hash = |b: usize| (1u64 << 63) + id * 1000 + b as u64;
        let keys = |b: usize, with_salt: bool| {
            let k: Vec<&str> = lora
                .into_iter()
                .chain(salt.filter(|_| with_salt && b == 0))
                .collect();
            if k.is_empty() {
                serde_json::Value::Null
            } else {
                json!(k)
            }
        };
        let event = |from: usize, to: usize| {
            let mut e = json!({
                "type": "BlockStored",
                "block_hashes": (from..to).map(hash).collect::<Vec<_>>(),
                "parent_block_hash": (from > 0).then(|| hash(from - 1)),
                "token_ids": &tokens[from * PAGE as usize..to * PAGE as usize],
                "block_size": PAGE,
                "lora_id": lora.map(|_| 1),
                "medium": "GPU",
                "lora_name": lora,
            });
            let extra: Vec<serde_json::Value> = (from..to).map(|b| keys(b, from == 0)).collect();
            // `omit_defaults`: no `extra_keys` when no block has any.
            if extra.iter().any(|k| !k.is_null()) {
                e["extra_keys"] = json!(extra);
            }
            e
        };
        for e in [event(0, first), event(first, blocks)] {
            let c = json!({"cmd": "publish", "events": [e], "form": "map", "skip_live": false});
            writeln!(self.stdin, "{c}").unwrap();
            self.stdin.flush().unwrap();
            let line = self
                .lines
                .recv_timeout(LIMIT)
                .expect("the publisher answers");
            assert!(line.starts_with("ok"), "publisher said {line}");
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tokens(n: usize, start: u32) -> Vec<u32> {
    (start..start + n as u32).collect()
}

/// A gateway routing `urls` on the events of `publishers` (one each, named by flags).
fn gateway(urls: &[String], publishers: &[Publisher]) -> radixgate::runtime::Running {
    let mut args = vec![
        "--kv-events".to_string(),
        "--policy".into(),
        "cache_aware".into(),
        "--kv-events-endpoints".into(),
    ];
    args.extend(
        urls.iter()
            .zip(publishers)
            .map(|(u, p)| format!("{u}=tcp://127.0.0.1:{}", p.live)),
    );
    args.push("--kv-events-replay-endpoints".into());
    args.extend(
        urls.iter()
            .zip(publishers)
            .map(|(u, p)| format!("{u}=tcp://127.0.0.1:{}", p.replay)),
    );
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let gw = crate::common::gateway_for(urls, &refs);
    let kv = gw.gateway().kv.as_ref().unwrap();
    crate::common::wait_until("every worker routed by its events", LIMIT, || {
        (kv.exact_workers().len() == urls.len()).then_some(())
    });
    gw
}

/// Waits until the index holds `prompt`'s `blocks` whole blocks in namespace `root` of `model`
/// on exactly one source.
fn wait_held(gw: &radixgate::runtime::Running, model: &str, root: u64, prompt: &[u32]) {
    let kv = gw.gateway().kv.as_ref().unwrap();
    let blocks = (prompt.len() / PAGE as usize) as u32;
    crate::common::wait_until("the index holds what was published", LIMIT, || {
        let snap = kv.reader.load();
        let mut scratch = MatchScratch::default();
        let m = snap.match_prefix(model, root, prompt, &mut scratch);
        (m.len() == 1 && m[0].blocks == blocks).then_some(())
    });
}

/// The index of the worker (by port) that served `r`.
fn served(ports: &[u16], r: &crate::common::Response) -> usize {
    let port = crate::common::served_by(r);
    ports.iter().position(|&p| p == port).unwrap()
}

fn post(
    gw: &radixgate::runtime::Running,
    path: &str,
    body: serde_json::Value,
) -> crate::common::Response {
    crate::common::request(
        gw.addr,
        "POST",
        path,
        &[],
        &serde_json::to_vec(&body).unwrap(),
    )
    .unwrap()
}

#[test]
fn token_id_completions_batches_and_salts_reach_their_holders() {
    let cluster = crate::common::sim(2, |cfg| cfg.page_size = PAGE as usize);
    let ports = cluster.ports().to_vec();
    let urls: Vec<String> = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    let mut pubs = vec![Publisher::start(), Publisher::start()];
    let gw = gateway(&urls, &pubs);
    // The same prompt salted on worker 0 and unsalted on worker 1; another prompt unsalted on
    // worker 0 only.
    let p = tokens(64, 1000);
    let q = tokens(64, 5000);
    pubs[0].store_prompt(1, &p, 5, Some("tenant-a"), None);
    pubs[1].store_prompt(2, &p, 16, None, None);
    pubs[0].store_prompt(3, &q, 3, None, None);
    wait_held(&gw, MODEL, namespace_root(Some("tenant-a"), None), &p);
    wait_held(&gw, MODEL, ROOT_PARENT, &p);
    wait_held(&gw, MODEL, ROOT_PARENT, &q);
    let ask = |t: &[u32]| {
        let mut v = t.to_vec();
        v.extend([7, 7, 7]);
        v
    };
    for _ in 0..3 {
        let salted = post(
            &gw,
            "/v1/completions",
            json!({"model": MODEL, "prompt": ask(&p), "max_tokens": 1, "cache_salt": "tenant-a"}),
        );
        assert_eq!(salted.status, 200, "{}", salted.text());
        assert_eq!(served(&ports, &salted), 0, "salted: the salted holder");
        let plain = post(
            &gw,
            "/v1/completions",
            json!({"model": MODEL, "prompt": ask(&p), "max_tokens": 1}),
        );
        assert_eq!(served(&ports, &plain), 1, "unsalted: the unsalted holder");
        // Another salt holds nothing anywhere: no holder to prefer, but never an error.
        let other = post(
            &gw,
            "/v1/completions",
            json!({"model": MODEL, "prompt": ask(&p), "max_tokens": 1, "cache_salt": "b"}),
        );
        assert_eq!(other.status, 200, "{}", other.text());
    }
    // A batch of token lists goes where its first list is held.
    for _ in 0..3 {
        let qp = post(
            &gw,
            "/v1/completions",
            json!({"model": MODEL, "prompt": [ask(&q), ask(&p)], "max_tokens": 1}),
        );
        assert_eq!(qp.status, 200, "{}", qp.text());
        assert_eq!(served(&ports, &qp), 0, "batch led by q");
        let pq = post(
            &gw,
            "/v1/completions",
            json!({"model": MODEL, "prompt": [ask(&p), ask(&q)], "max_tokens": 1}),
        );
        assert_eq!(served(&ports, &pq), 1, "batch led by p");
    }
    // Token ids of another shape: 400 with an OpenAI-style error, no worker asked.
    let before: Vec<u64> = (0..2)
        .map(|i| crate::common::sim_count(&cluster, i, "inference_received"))
        .collect();
    for bad in [json!([1, "a"]), json!([[1, 2], [3, -4]]), json!([[1], 2])] {
        let r = post(
            &gw,
            "/v1/completions",
            json!({"model": MODEL, "prompt": bad}),
        );
        assert_eq!(r.status, 400, "{}", r.text());
        let e = r.json();
        assert!(
            e["error"]["message"]
                .as_str()
                .unwrap()
                .contains("token ids must be non-negative integers"),
            "{e}"
        );
    }
    let after: Vec<u64> = (0..2)
        .map(|i| crate::common::sim_count(&cluster, i, "inference_received"))
        .collect();
    assert_eq!(before, after);
}

#[test]
fn inference_generate_is_forwarded_and_adapters_are_named_by_their_own_name() {
    let cards = json!([
        {"id": MODEL, "object": "model", "root": MODEL, "parent": null},
        {"id": "sql-lora", "object": "model", "root": "/adapters/sql", "parent": MODEL}]);
    let workers = [
        FakeVllm::start(cards.clone(), json!({})),
        FakeVllm::start(cards, json!({})),
    ];
    let ports: Vec<u16> = workers.iter().map(|w| w.port).collect();
    let urls: Vec<String> = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    let mut pubs = vec![Publisher::start(), Publisher::start()];
    let gw = gateway(&urls, &pubs);
    crate::common::wait_until("the adapter learned from /v1/models", LIMIT, || {
        gw.gateway()
            .models
            .adapter_base("sql-lora")
            .filter(|b| *b == MODEL)
    });
    // Worker 1 holds `g` for the base model; worker 0 holds `a` under the adapter and worker
    // 1 the same tokens for the base model.
    let g = tokens(64, 300);
    let a = tokens(64, 9000);
    pubs[1].store_prompt(1, &g, 4, None, None);
    pubs[0].store_prompt(2, &a, 6, None, Some("sql-lora"));
    pubs[1].store_prompt(3, &a, 16, None, None);
    wait_held(&gw, MODEL, ROOT_PARENT, &g);
    wait_held(&gw, MODEL, namespace_root(None, Some("sql-lora")), &a);
    wait_held(&gw, MODEL, ROOT_PARENT, &a);
    let ask = |t: &[u32]| {
        let mut v = t.to_vec();
        v.extend([1, 2]);
        v
    };
    // /inference/v1/generate: forwarded byte for byte to the holder of its token ids, as JSON
    // and as SSE.
    for stream in [false, true] {
        let body = serde_json::to_vec(&json!({
            "token_ids": ask(&g), "sampling_params": {"max_tokens": 2, "temperature": 0},
            "model": MODEL, "stream": stream,
        }))
        .unwrap();
        for _ in 0..3 {
            let r = crate::common::request(gw.addr, "POST", "/inference/v1/generate", &[], &body)
                .unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
            assert_eq!(served(&ports, &r), 1, "stream {stream}");
            if stream {
                assert!(r
                    .header("content-type")
                    .unwrap()
                    .starts_with("text/event-stream"));
                assert!(r.text().contains("data: [DONE]"), "{}", r.text());
            } else {
                assert_eq!(r.json()["choices"][0]["token_ids"], json!([11, 12]));
            }
        }
        assert_eq!(
            workers[1].asked("/inference/v1/generate").last(),
            Some(&body)
        );
    }
    assert!(workers[0].asked("/inference/v1/generate").is_empty());
    // A bad body is answered by the gateway; an unknown neighbour path is still 404.
    let r = post(&gw, "/inference/v1/generate", json!({"token_ids": []}));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.json()["error"]["message"].as_str().is_some());
    let r = post(&gw, "/inference/v1/abort", json!({}));
    assert_eq!(r.status, 404, "{}", r.text());
    // The adapter by its own name reaches the adapter's holder; the base model the other.
    for _ in 0..3 {
        let lora = post(
            &gw,
            "/v1/completions",
            json!({"model": "sql-lora", "prompt": ask(&a), "max_tokens": 1}),
        );
        assert_eq!(lora.status, 200, "{}", lora.text());
        assert_eq!(served(&ports, &lora), 0, "the adapter's blocks");
        let base = post(
            &gw,
            "/v1/completions",
            json!({"model": MODEL, "prompt": ask(&a), "max_tokens": 1}),
        );
        assert_eq!(served(&ports, &base), 1, "the base model's blocks");
        let tig = post(
            &gw,
            "/inference/v1/generate",
            json!({"model": "sql-lora", "token_ids": ask(&a), "sampling_params": {}}),
        );
        assert_eq!(served(&ports, &tig), 0, "the adapter over the token route");
    }
}
