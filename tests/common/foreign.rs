//! The foreign upstream: `tests/fixtures/foreign_upstream.py`, an SGLang-shaped server on
//! aiohttp, run as a child process. The simulated worker shares radixgate's HTTP code, so a
//! framing bug in that code is on both ends of every test against it; against this server the
//! upstream side's parser, keep-alive and chunked writer are aiohttp's. Its interpreter is
//! [`test_python`](super::test_python): without aiohttp the test fails (never skips), saying
//! how to install it.

use super::{request, test_python, ChildGuard};
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Longest wait for the fixture to print its ports (Python and aiohttp start in ~0.3 s; a
/// loaded CI machine is slower).
const START_LIMIT: Duration = Duration::from_secs(30);

/// One running foreign upstream, killed by its PID when dropped. Its stdin is a pipe held
/// here, so it also exits if the test process dies without dropping it.
pub struct Foreign {
    _child: ChildGuard,
    /// Its HTTP port on 127.0.0.1.
    pub port: u16,
    /// A prefill server's bootstrap port.
    pub bootstrap_port: Option<u16>,
}

impl Foreign {
    /// A regular server (no PD role) with these extra flags (`--token-delay-ms 5`, ...).
    pub fn start(flags: &[&str]) -> Foreign {
        let python = test_python(&["aiohttp"]);
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/foreign_upstream.py"
        );
        let mut child = Command::new(&python)
            .arg(script)
            .arg("--exit-on-stdin-eof")
            .args(flags)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("{python} {script}: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let guard = ChildGuard(Some(child));
        // The first line is {"port": P, "bootstrap_port": B}; read on a thread so a fixture
        // that hangs fails the test after START_LIMIT instead of blocking it.
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx
            .recv_timeout(START_LIMIT)
            .unwrap_or_else(|_| panic!("{script} printed no port within {START_LIMIT:?}"));
        let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| {
            panic!("{script} did not start ({e}); it printed {line:?} (its stderr is above)")
        });
        let port = v["port"].as_u64().and_then(|p| u16::try_from(p).ok());
        Foreign {
            _child: guard,
            port: port.unwrap_or_else(|| panic!("no port in {line:?}")),
            bootstrap_port: v["bootstrap_port"]
                .as_u64()
                .and_then(|p| u16::try_from(p).ok()),
        }
    }

    /// A PD prefill server (its bootstrap server on an ephemeral port).
    pub fn prefill(flags: &[&str]) -> Foreign {
        let f = Foreign::start(&[&["--role", "prefill"], flags].concat());
        assert!(
            f.bootstrap_port.is_some(),
            "a prefill server has a bootstrap port"
        );
        f
    }

    /// A PD decode server.
    pub fn decode(flags: &[&str]) -> Foreign {
        Foreign::start(&[&["--role", "decode"], flags].concat())
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// Its URL, as `--worker-urls` takes it.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Change its knobs (see the fixture's doc: `token_delay_ms`, `close_after_events`, ...).
    pub fn knobs(&self, change: Value) -> Value {
        let r = request(
            self.addr(),
            "POST",
            "/fixture/knobs",
            &[],
            change.to_string().as_bytes(),
        )
        .expect("POST /fixture/knobs");
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    }

    /// Its counters (`received`, `answered`, `cancelled`, `inference_connections`, ...).
    pub fn stats(&self) -> Value {
        let r =
            request(self.addr(), "GET", "/fixture/stats", &[], b"").expect("GET /fixture/stats");
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    }

    /// One counter of [`stats`](Self::stats) (0 when it never counted).
    pub fn count(&self, name: &str) -> u64 {
        self.stats()[name].as_u64().unwrap_or(0)
    }

    /// Every request it recorded (oldest first), each with its answer as it wrote it.
    pub fn records(&self) -> Vec<Value> {
        let r = request(self.addr(), "GET", "/fixture/requests", &[], b"")
            .expect("GET /fixture/requests");
        assert_eq!(r.status, 200, "{}", r.text());
        r.json().as_array().cloned().expect("an array")
    }

    /// The last request it received on `path`, with its answer.
    pub fn last(&self, path: &str) -> Value {
        let all = self.records();
        all.iter()
            .rev()
            .find(|r| r["path"] == path)
            .cloned()
            .unwrap_or_else(|| panic!("no {path} among {} recorded requests", all.len()))
    }

    /// The body of the last request on `path`, parsed.
    pub fn last_body(&self, path: &str) -> Value {
        let rec = self.last(path);
        serde_json::from_str(rec["body"].as_str().expect("a body")).expect("a JSON body")
    }

    /// The bytes of the last answer on `path` as the fixture wrote them (before framing).
    pub fn last_answer(&self, path: &str) -> String {
        self.last(path)["response"]
            .as_str()
            .expect("a response")
            .to_string()
    }
}
