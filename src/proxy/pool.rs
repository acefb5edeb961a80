//! Per-core keep-alive pools of upstream connections, one LIFO stack per worker. Never shared
//! between cores, so no locks. Connections idle longer than the idle timeout (kept below the
//! engines' 5 s keep-alive) are dropped, and a connection is probed before reuse: a peer that
//! closed it, or sent bytes nobody asked for, makes it unusable. Each connection remembers the
//! worker's `serial`: ids are reused after a worker is removed, serials never are, so a
//! connection to a removed worker's host is never handed to the worker that got its id.
//! A pool also carries the headers of the gateway's own calls on its connections (health
//! checks, model cards, `/get_server_info`, admin fan-outs): the key `--worker-api-key` names.

use crate::base::WorkerId;
use crate::proxy::forward::OwnHeaders;
use crate::proxy::io::{peek, Peek};
use crate::workers::registry::Worker;
use monoio::net::TcpStream;
use std::cell::RefCell;
use std::collections::HashMap;
use std::time::{Duration, Instant};

struct Idle {
    stream: TcpStream,
    since: Instant,
    /// The worker incarnation the connection was opened to.
    serial: u64,
}

/// One core's idle upstream connections.
pub struct Pool {
    idle: RefCell<HashMap<WorkerId, Vec<Idle>>>,
    idle_timeout: Duration,
    max_per_worker: usize,
    /// What every request the gateway itself sends through this pool carries.
    own_calls: OwnHeaders,
}

/// A connection returned to the pool this recently is handed out again without the probe (one
/// `recv` syscall per request, 4 % of a core at 16 KiB bodies): a worker closes an idle
/// keep-alive connection only after seconds, and the rare one that closes it in this window is
/// the race `forward::roundtrip` already covers by replaying on a fresh connection.
pub const REUSE_WITHOUT_PROBE: Duration = Duration::from_millis(1);

/// Whether an idle connection is still usable: no EOF and no unexpected bytes pending.
pub fn is_reusable(stream: &TcpStream) -> bool {
    peek(stream) == Peek::Quiet
}

impl Pool {
    /// A pool keeping at most `max_per_worker` idle connections per worker, whose
    /// gateway-originated calls carry `worker_key` (`--worker-api-key`) when set. Taken here,
    /// not per call, so that no call to a worker can forget the key a worker may demand.
    pub fn new(idle_timeout: Duration, max_per_worker: usize, worker_key: Option<&str>) -> Pool {
        Pool {
            idle: RefCell::new(HashMap::new()),
            idle_timeout,
            max_per_worker,
            own_calls: OwnHeaders::for_own_calls(worker_key),
        }
    }

    /// The headers of the gateway's own calls through this pool (see [`Pool::new`]).
    pub fn own_calls(&self) -> &OwnHeaders {
        &self.own_calls
    }

    /// A live idle connection to `worker`, most recently used first.
    pub fn take(&self, worker: &Worker) -> Option<TcpStream> {
        if worker.is_detached() {
            return None;
        }
        let mut map = self.idle.borrow_mut();
        let stack = map.get_mut(&worker.id)?;
        let now = Instant::now();
        while let Some(idle) = stack.pop() {
            let idle_for = now.duration_since(idle.since);
            if idle.serial == worker.serial
                && idle_for < self.idle_timeout
                && (idle_for < REUSE_WITHOUT_PROBE || is_reusable(&idle.stream))
            {
                crate::metrics::upstream_connection("reused");
                return Some(idle.stream);
            }
        }
        None
    }

    /// Return a connection whose last response was read completely. A detached worker's (a
    /// probe of a server not registered yet) is closed instead: every detached worker shares
    /// one id and serial, so a pooled connection would reach another server's probe and make
    /// a server that never answered look healthy.
    pub fn put(&self, worker: &Worker, stream: TcpStream) {
        if worker.is_detached() {
            return;
        }
        let mut map = self.idle.borrow_mut();
        let stack = map.entry(worker.id).or_default();
        stack.retain(|i| i.serial == worker.serial);
        if stack.len() >= self.max_per_worker {
            // Drop the oldest: the newest are the likeliest to still be open upstream.
            stack.remove(0);
        }
        stack.push(Idle {
            stream,
            since: Instant::now(),
            serial: worker.serial,
        });
    }

    /// Drop connections idle too long (called from a per-core timer) and those of workers that
    /// are gone.
    pub fn sweep(&self, live: &dyn Fn(WorkerId) -> bool) {
        let now = Instant::now();
        let mut map = self.idle.borrow_mut();
        map.retain(|w, stack| {
            if !live(*w) {
                return false;
            }
            stack.retain(|i| now.duration_since(i.since) < self.idle_timeout);
            !stack.is_empty()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workers::registry::parse_worker_url;

    fn detached(port: u16) -> Worker {
        let url = format!("http://127.0.0.1:{port}");
        let parsed = parse_worker_url(&url).unwrap();
        Worker::detached(&url, parsed, vec![([127, 0, 0, 1], port).into()])
    }

    /// A registered worker (pooled), unlike a probe's.
    fn worker(port: u16) -> Worker {
        let mut w = detached(port);
        w.id = 3;
        w.serial = 7;
        w
    }

    /// Run `test` on a monoio runtime with a listener standing in for the worker.
    fn with_listener<F: std::future::Future<Output = ()>>(
        test: impl FnOnce(std::net::TcpListener, u16) -> F,
    ) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let mut rt = monoio::RuntimeBuilder::<monoio::LegacyDriver>::new()
            .enable_timer()
            .build()
            .unwrap();
        rt.block_on(test(listener, port));
    }

    /// A connection the worker closed is handed out again only within the moment after its
    /// return (where `roundtrip` replays a request it fails); after that the probe drops it.
    #[test]
    fn a_closed_connection_is_probed_once_it_idled_past_the_moment() {
        with_listener(|listener, port| async move {
            let pool = Pool::new(Duration::from_secs(60), 8, None);
            let w = worker(port);
            assert!(!w.is_detached());
            let stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
            drop(listener.accept().unwrap()); // the worker closes it
            monoio::time::sleep(Duration::from_millis(20)).await; // its FIN arrives
            pool.put(&w, stream);
            let stream = pool.take(&w).expect("returned just now: reused unprobed");
            pool.put(&w, stream);
            monoio::time::sleep(REUSE_WITHOUT_PROBE * 2).await;
            assert!(pool.take(&w).is_none(), "probed, found closed, dropped");
            assert!(pool.idle.borrow().values().all(|s| s.is_empty()));
        });
    }

    /// A connection one probe opened is never handed to another probe (of another server).
    #[test]
    fn a_detached_workers_connection_is_never_pooled() {
        with_listener(|listener, port| async move {
            let pool = Pool::new(Duration::from_secs(60), 8, None);
            let stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
            let _accepted = listener.accept().unwrap();
            let (a, b) = (detached(port), detached(1));
            pool.put(&a, stream);
            assert!(pool.take(&b).is_none(), "a probe of another server got it");
            assert!(pool.take(&a).is_none(), "probes open their own connections");
            assert!(pool.idle.borrow().is_empty());
        });
    }
}
