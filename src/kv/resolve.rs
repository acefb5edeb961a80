//! Host names of event endpoints, resolved off the event thread: `getaddrinfo` blocks for as
//! long as the name servers take (seconds when one is down), and the event thread must keep
//! applying every other publisher's events meanwhile. Each lookup runs on a short-lived thread
//! of its own, at most [`MAX_LOOKUPS`] at once; the asker keeps its own deadline and ignores a
//! late answer. IP literals need no lookup.

use crossbeam::channel::{self, Receiver, Sender};
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};

/// Lookups running at once (more wait for a free place: the asker retries).
pub const MAX_LOOKUPS: usize = 8;

/// One finished lookup.
#[derive(Debug)]
pub struct Answer {
    /// What the asker passed to [`Resolver::lookup`].
    pub token: u64,
    /// The first address found, or why there is none.
    pub result: Result<SocketAddr, String>,
}

/// Why a lookup could not start now (ask again later).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy;

/// The lookups of one event thread.
pub struct Resolver {
    tx: Sender<Answer>,
    rx: Receiver<Answer>,
    running: usize,
}

impl Default for Resolver {
    fn default() -> Self {
        let (tx, rx) = channel::unbounded();
        Resolver { tx, rx, running: 0 }
    }
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
    /// starts a lookup whose [`Answer`] comes later (`Ok(None)`), [`Busy`] when too many run
    /// already or no thread could be started.
    pub fn lookup(
        &mut self,
        token: u64,
        host: &str,
        port: u16,
    ) -> Result<Option<SocketAddr>, Busy> {
        if let Some(addr) = literal(host, port) {
            return Ok(Some(addr));
        }
        if self.running >= MAX_LOOKUPS {
            return Err(Busy);
        }
        let tx = self.tx.clone();
        let name = format!("{host}:{port}");
        let spawned = std::thread::Builder::new()
            .name("radixgate-kv-dns".into())
            .spawn(move || {
                let result = name
                    .to_socket_addrs()
                    .map_err(|e| e.to_string())
                    .and_then(|mut a| a.next().ok_or_else(|| "no address".to_string()));
                let _ = tx.send(Answer { token, result });
            });
        match spawned {
            Ok(_) => {
                self.running += 1;
                Ok(None)
            }
            Err(_) => Err(Busy),
        }
    }

    /// Lookups finished since the last call.
    pub fn answers(&mut self) -> Vec<Answer> {
        let done: Vec<Answer> = self.rx.try_iter().collect();
        self.running -= done.len().min(self.running);
        done
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
        assert_eq!(r.running, 0);
    }
}
