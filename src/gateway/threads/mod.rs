//! The gateway's helper threads: they never serve a request, and each runs on its own small
//! runtime at a lower priority than the serving cores. Kept apart from the shared state
//! (`gateway::*`) they read and update, so the folder says which code runs where.
//!
//! Modules: `health` (active checks, the circuits' half-open timer, KV publisher discovery),
//! `telemetry` (the engines' own metrics: load, hit ratio, the merged exposition).

pub mod health;
pub mod telemetry;

/// The nice value of the health thread (and of the tree writer and the KV-event thread): the
/// checks still run, and keep to their timeouts, when the CPU is saturated.
pub use crate::base::priority::HELPER_NICE;

/// How a helper thread yields a CPU it shares with a serving core.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HelperClass {
    /// [`HELPER_NICE`]: a smaller share, never starved (health checks: a starved check would
    /// time out and mark a worker down).
    Nice,
    /// `SCHED_IDLE`: only the CPU time nobody else wants, and a waking core preempts it at once.
    /// For the telemetry scrapes: at 4,096 workers they are ~800 connections a second, and at
    /// nice 10 a serving core woken during one still waited out the scrape's slice (p99 through
    /// one core 7.8-8.1 ms against 1.4-1.7 ms with the scrapes off, bench-worker-scale.sh).
    /// Starved, the scrapes time out and routing falls back to this copy's own in-flight counts.
    Idle,
}

/// Run the future `make` builds on a new std thread named `radixgate-<name>`, with its own
/// small monoio runtime (timers on) and a lower priority ([`HelperClass`]): the helper threads
/// never run on a serving core's runtime, and yield its CPU when they share it. A thread or
/// runtime that cannot start is logged, not fatal.
pub fn spawn_helper<F, Fut>(name: &'static str, class: HelperClass, make: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let spawned = std::thread::Builder::new()
        .name(format!("radixgate-{name}"))
        .spawn(move || {
            let lowered = match class {
                HelperClass::Nice => crate::base::priority::helper_thread(),
                HelperClass::Idle => crate::base::priority::idle_thread(),
            };
            if let Err(e) = lowered {
                crate::log!(Warn, "{name} thread: cannot lower its priority: {e}");
            }
            let rt = monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
                .enable_timer()
                .build();
            match rt {
                Ok(mut rt) => rt.block_on(make()),
                Err(e) => crate::log!(Error, "{name} thread: cannot build its runtime: {e}"),
            }
        });
    if let Err(e) = spawned {
        crate::log!(Error, "cannot start the {name} thread: {e}");
    }
}
