//! Host names of event endpoints, resolved off the event thread: `getaddrinfo` blocks for as
//! long as the name servers take (seconds when one is down), and the event thread must keep
//! applying every other publisher's events meanwhile. Each lookup runs on a short-lived thread
//! of its own, at most [`MAX_LOOKUPS`] at once; the asker keeps its own deadline and ignores a
//! late answer. IP literals need no lookup.
//!
//! **One lookup per name.** A name already being looked up is not looked up again: every asker
//! (each DP rank of a worker, each retry after a deadline) waits for the one answer, given to
//! each with its own port. A name whose lookup never ends therefore holds one place, not one
//! per rank and retry, and the other names go on being resolved.

use crossbeam::channel::{self, Receiver, Sender};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};

/// Names being looked up at once (a new name waits for a free place: the asker retries).
pub const MAX_LOOKUPS: usize = 8;

/// One finished lookup.
#[derive(Debug)]
pub struct Answer {
    /// What the asker passed to [`Resolver::lookup`].
    pub token: u64,
    /// The first address found (with the asker's port), or why there is none.
    pub result: Result<SocketAddr, String>,
}

/// Why a lookup could not start now (ask again later).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy;

/// A lookup thread's answer: the name as asked (lower case) and its first address.
type Found = (String, Result<IpAddr, String>);

/// How a name becomes an address (the system's `getaddrinfo`; unit tests put in their own).
type LookupFn = fn(&str) -> Result<IpAddr, String>;

/// The lookups of one event thread.
pub struct Resolver {
    tx: Sender<Found>,
    rx: Receiver<Found>,
    /// Names being looked up, each with who waits for it (token, port).
    running: HashMap<String, Vec<(u64, u16)>>,
    resolve: LookupFn,
}

impl Default for Resolver {
    fn default() -> Self {
        let (tx, rx) = channel::unbounded();
        Resolver {
            tx,
            rx,
            running: HashMap::new(),
            resolve: system_lookup,
        }
    }
}

/// The first address the system finds for `name`.
fn system_lookup(name: &str) -> Result<IpAddr, String> {
    (name, 0u16)
        .to_socket_addrs()
        .map_err(|e| e.to_string())
        .and_then(|mut a| a.next().ok_or_else(|| "no address".to_string()))
        .map(|a| a.ip())
}

/// `host` as an address when it is an IP literal (IPv6 in brackets or bare).
pub fn literal(host: &str, port: u16) -> Option<SocketAddr> {
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    bare.parse::<IpAddr>()
        .ok()
        .map(|ip| SocketAddr::new(ip, port))
}

impl Resolver {
    /// Resolve `host:port` for `token`: an IP literal answers at once (`Ok(Some)`), a name
    /// answers later (`Ok(None)`: joining the lookup of that name already running, or starting
    /// one), [`Busy`] when [`MAX_LOOKUPS`] other names are being looked up already or no thread
    /// could be started.
    pub fn lookup(
        &mut self,
        token: u64,
        host: &str,
        port: u16,
    ) -> Result<Option<SocketAddr>, Busy> {
        if let Some(addr) = literal(host, port) {
            return Ok(Some(addr));
        }
        let name = host.to_ascii_lowercase();
        if let Some(waiting) = self.running.get_mut(&name) {
            waiting.retain(|&(t, _)| t != token);
            waiting.push((token, port));
            return Ok(None);
        }
        if self.running.len() >= MAX_LOOKUPS {
            return Err(Busy);
        }
        let (tx, resolve) = (self.tx.clone(), self.resolve);
        let asked = name.clone();
        let spawned = std::thread::Builder::new()
            .name("radixgate-kv-dns".into())
            .spawn(move || {
                let result = resolve(&asked);
                let _ = tx.send((asked, result));
            });
        match spawned {
            Ok(_) => {
                self.running.insert(name, vec![(token, port)]);
                Ok(None)
            }
            Err(_) => Err(Busy),
        }
    }

    /// Lookups finished since the last call, one answer per asker.
    pub fn answers(&mut self) -> Vec<Answer> {
        let mut out = Vec::new();
        for (name, result) in self.rx.try_iter() {
            for (token, port) in self.running.remove(&name).unwrap_or_default() {
                out.push(Answer {
                    token,
                    result: result.clone().map(|ip| SocketAddr::new(ip, port)),
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn literals_answer_at_once_names_answer_later() {
        let mut r = Resolver::default();
        assert_eq!(
            r.lookup(1, "127.0.0.1", 5557),
            Ok(Some("127.0.0.1:5557".parse().unwrap()))
        );
        assert_eq!(
            r.lookup(2, "[::1]", 5557),
            Ok(Some("[::1]:5557".parse().unwrap()))
        );
        assert_eq!(r.lookup(3, "localhost", 5558), Ok(None));
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let a = r.answers();
            if let Some(a) = a.first() {
                assert_eq!(a.token, 3);
                assert_eq!(a.result.as_ref().map(|s| s.port()), Ok(5558));
                break;
            }
            assert!(Instant::now() < until, "no answer");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(r.running.is_empty());
    }

    #[test]
    fn a_name_asked_by_many_is_looked_up_once_and_answered_to_each() {
        let mut r = Resolver::default();
        for (token, port) in [(1, 5557), (2, 5558), (3, 5559), (2, 5558)] {
            assert_eq!(r.lookup(token, "LocalHost", port), Ok(None));
            assert_eq!(r.lookup(token + 10, "localhost", port + 100), Ok(None));
        }
        assert_eq!(r.running.len(), 1, "one lookup for one name");
        let until = Instant::now() + Duration::from_secs(10);
        let mut got = Vec::new();
        while got.len() < 6 {
            assert!(Instant::now() < until, "answers: {got:?}");
            got.extend(
                r.answers()
                    .into_iter()
                    .map(|a| (a.token, a.result.map(|s| s.port()))),
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        got.sort_unstable();
        assert_eq!(
            got,
            [
                (1, Ok(5557)),
                (2, Ok(5558)),
                (3, Ok(5559)),
                (11, Ok(5657)),
                (12, Ok(5658)),
                (13, Ok(5659))
            ]
        );
        assert!(r.running.is_empty());
    }

    /// A lookup that takes 2 s for names starting with `hang`, and finds 127.0.0.1 at once
    /// for the others (no name server involved).
    fn slow_lookup(name: &str) -> Result<IpAddr, String> {
        if name.starts_with("hang") {
            std::thread::sleep(Duration::from_secs(2));
            return Err("timed out".into());
        }
        Ok(IpAddr::from([127, 0, 0, 1]))
    }

    fn wait_for(r: &mut Resolver, n: usize) -> Vec<Answer> {
        let until = Instant::now() + Duration::from_secs(10);
        let mut got = Vec::new();
        while got.len() < n {
            assert!(Instant::now() < until, "answers: {got:?}");
            got.extend(r.answers());
            std::thread::sleep(Duration::from_millis(2));
        }
        got
    }

    #[test]
    fn a_hanging_name_holds_one_place_however_many_ranks_and_retries_ask() {
        let mut r = Resolver {
            resolve: slow_lookup,
            ..Resolver::default()
        };
        // 64 ranks of one worker, each asking twice (a retry after its deadline).
        for round in 0..2 {
            for rank in 0..64u16 {
                let token = u64::from(rank) + 1000 * round;
                assert_eq!(r.lookup(token, "hang.example", 5557 + rank), Ok(None));
            }
        }
        assert_eq!(r.running.len(), 1);
        // Another worker's name is looked up at once meanwhile.
        assert_eq!(r.lookup(7, "gpu-2.example", 6000), Ok(None));
        let a = wait_for(&mut r, 1);
        assert_eq!(
            (a[0].token, a[0].result.as_ref().map(|s| s.port())),
            (7, Ok(6000))
        );
        // Other hanging names fill the places; a new name waits, a running one is joined.
        for i in 1..MAX_LOOKUPS {
            assert_eq!(
                r.lookup(200 + i as u64, &format!("hang-{i}.example"), 1),
                Ok(None)
            );
        }
        assert_eq!(r.lookup(99, "gpu-3.example", 1), Err(Busy));
        assert_eq!(r.lookup(100, "hang.example", 1), Ok(None));
        // The hanging lookup ends: one answer per asker (the last ask of each token).
        let answers = wait_for(&mut r, 129 + (MAX_LOOKUPS - 1));
        let of_first: Vec<&Answer> = answers
            .iter()
            .filter(|a| a.token < 64 || (1000..1064).contains(&a.token) || a.token == 100)
            .collect();
        assert_eq!(of_first.len(), 129);
        assert!(of_first.iter().all(|a| a.result.is_err()));
        assert!(r.running.is_empty());
        assert_eq!(r.lookup(99, "gpu-3.example", 1), Ok(None));
    }
}
