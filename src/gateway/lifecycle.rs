//! The process's life as the cores see it: the clock every policy reads, the shutdown flag, and
//! the count of requests a graceful shutdown waits for.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// The io driver the cores actually run on (`--io-driver auto` picks one at start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Driver {
    /// Linux io_uring.
    IoUring,
    /// epoll (monoio's legacy driver).
    Epoll,
}

impl Driver {
    /// The name in logs, `/get_server_info` and the `radixgate_io_driver` metric.
    pub fn as_str(self) -> &'static str {
        match self {
            Driver::IoUring => "io_uring",
            Driver::Epoll => "epoll",
        }
    }
}

/// Start time, shutdown flag and requests in flight.
#[derive(Debug)]
pub struct Lifecycle {
    started: Instant,
    shutting_down: AtomicBool,
    active_requests: AtomicU64,
    /// The io driver the cores run on.
    pub io_driver: Driver,
    /// Number of serving cores.
    pub cores: usize,
}

impl Lifecycle {
    /// Starting now.
    pub fn new(io_driver: Driver, cores: usize) -> Lifecycle {
        Lifecycle {
            started: Instant::now(),
            shutting_down: AtomicBool::new(false),
            active_requests: AtomicU64::new(0),
            io_driver,
            cores,
        }
    }

    /// Milliseconds since start: the clock of tree inserts, circuits and policy expiry.
    pub fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Whether shutdown has begun (stop accepting, finish what is in flight).
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Relaxed)
    }

    /// Begin shutdown (SIGTERM/SIGINT or a test).
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    /// Requests being handled by any core right now.
    pub fn active_requests(&self) -> u64 {
        self.active_requests.load(Ordering::Acquire)
    }

    /// Count a request as in progress until the guard drops.
    pub fn request_started(&self) -> ActiveRequest<'_> {
        self.active_requests.fetch_add(1, Ordering::AcqRel);
        ActiveRequest(self)
    }
}

/// Holds one request in the in-progress count (released on every path, panics included).
pub struct ActiveRequest<'a>(&'a Lifecycle);

impl Drop for ActiveRequest<'_> {
    fn drop(&mut self) {
        self.0.active_requests.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn active_requests_follow_their_guards() {
        let life = Lifecycle::new(Driver::Epoll, 1);
        let a = life.request_started();
        let b = life.request_started();
        assert_eq!(life.active_requests(), 2);
        drop(a);
        assert_eq!(life.active_requests(), 1);
        drop(b);
        assert_eq!(life.active_requests(), 0);
        assert!(!life.is_shutting_down());
        life.begin_shutdown();
        assert!(life.is_shutting_down());
    }
}
