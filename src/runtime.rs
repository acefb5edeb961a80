//! Process start-up: one pinned thread per core, each running its own monoio runtime
//! (io_uring, epoll fallback) with its own `SO_REUSEPORT` listener; the tree writer thread; the
//! health checker; and the Prometheus listener. `start` returns a handle so tests run a real
//! gateway in-process on 127.0.0.1.

use crate::config::settings::{
    DiscoverySettings, HealthSettings, KvBootstrapSettings, UpstreamSettings,
};
use crate::config::{Config, IoDriver};
use crate::gateway::{Core, Driver, Gateway};
use crate::workers::registry::Registry;
use std::net::{SocketAddr, ToSocketAddrs};
use std::rc::Rc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Pending connections each core's listener queues.
const LISTEN_BACKLOG: i32 = 4096;
/// io_uring submission queue entries per core.
const RING_ENTRIES: u32 = 4096;
/// At most one "accept failed" line per core per this interval: out of descriptors, accept
/// fails every few milliseconds, and a line each time would flood the log.
const ACCEPT_LOG_INTERVAL: Duration = Duration::from_secs(1);

/// Lets a repeating message through at most once per interval, counting what it held back.
#[derive(Debug)]
struct LogLimiter {
    interval: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl LogLimiter {
    fn new(interval: Duration) -> LogLimiter {
        LogLimiter {
            interval,
            last: None,
            suppressed: 0,
        }
    }

    /// `Some(held back since the last line)` when a line may be written at `now`.
    fn allow(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(t) if now.duration_since(t) < self.interval => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

/// A running gateway.
pub struct Running {
    /// The address clients connect to (the real port when `--port 0` was given).
    pub addr: SocketAddr,
    /// The Prometheus endpoint, when enabled.
    pub metrics_addr: Option<SocketAddr>,
    gw: Arc<Gateway>,
    threads: Vec<JoinHandle<()>>,
    /// `--shutdown-grace-period-secs`: how long `shutdown` waits for requests in flight.
    grace: Duration,
}

impl Running {
    /// Shared state (tests inspect it).
    pub fn gateway(&self) -> &Arc<Gateway> {
        &self.gw
    }

    /// Stop accepting; in-flight requests finish within the grace period; then return.
    /// Returns true when everything finished in time.
    pub fn shutdown(self) -> bool {
        self.gw.life.begin_shutdown();
        let until = Instant::now() + self.grace;
        let mut drained = true;
        while self.gw.life.active_requests() > 0 {
            if Instant::now() >= until {
                drained = false;
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // Drained: core threads leave their accept loops within one accept tick. Not drained:
        // the cores are still waiting on requests past the grace period, so do not join them;
        // the caller exits and the process ends them.
        if drained {
            for t in self.threads {
                let _ = t.join();
            }
        }
        // The spans of the requests that finished go out before the process ends.
        if let Some(t) = &self.gw.trace {
            t.close();
        }
        drained
    }
}

/// Create a listening TCP socket with `SO_REUSEPORT` so every core can own one.
pub fn bind_reuseport(addr: SocketAddr, backlog: i32) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_port(true)?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(backlog)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

/// CPUs to serve on: `--cpu-list`, else the first `--cores` usable CPUs, else all usable CPUs.
fn choose_cpus(cfg: &Config) -> Vec<Option<core_affinity::CoreId>> {
    let usable = core_affinity::get_core_ids().unwrap_or_default();
    if let Some(crate::config::CpuList(list)) = &cfg.cpu_list {
        return list
            .iter()
            .map(|&id| Some(core_affinity::CoreId { id }))
            .collect();
    }
    let n = cfg.cores.unwrap_or_else(|| usable.len().max(1)).max(1);
    (0..n)
        .map(|i| usable.get(i % usable.len().max(1)).copied())
        .collect()
}

/// Pick the io driver, or refuse when `--io-driver uring` cannot be honoured.
fn choose_driver(cfg: &Config) -> Result<Driver, String> {
    // monoio caches its io_uring probe (which honours MONOIO_FORCE_LEGACY_DRIVER) on first use,
    // so the probe must not run before `legacy` has set that variable.
    let uring = || monoio::utils::detect_uring();
    match cfg.io_driver {
        IoDriver::Legacy => {
            // monoio reads this once, before its first runtime is built (which is below).
            std::env::set_var("MONOIO_FORCE_LEGACY_DRIVER", "1");
            Ok(Driver::Epoll)
        }
        IoDriver::Uring if uring() => Ok(Driver::IoUring),
        IoDriver::Uring => Err(
            "--io-driver uring: io_uring is not available here (kernel, \
                                seccomp, io_uring_disabled or MONOIO_FORCE_LEGACY_DRIVER); use \
                                --io-driver auto or legacy"
                .into(),
        ),
        IoDriver::Auto if uring() => Ok(Driver::IoUring),
        IoDriver::Auto => Ok(Driver::Epoll),
    }
}

/// Start the gateway described by `cfg`.
pub fn start(cfg: Config) -> Result<Running, String> {
    crate::log::set_level(cfg.log_level);
    raise_nofile_limit();
    let driver = choose_driver(&cfg)?;
    let cpus = choose_cpus(&cfg);
    let (bound, listeners) = bind_listeners(&cfg, cpus.len())?;
    let registry = Registry::new();
    register_workers(&cfg, &registry)?;
    crate::metrics::install();
    crate::metrics::io_driver(driver.as_str());
    let gw = Arc::new(Gateway::new(&cfg, registry, driver, cpus.len()));
    if cfg.kv_events {
        // Asked for and not running is a configuration error, not a quiet fallback.
        match &gw.kv {
            None => return Err("--kv-events could not start (see the log above)".into()),
            Some(kv) if cfg.tokenizer_path.is_some() && kv.tokenizer().is_none() => {
                return Err("--tokenizer-path could not be loaded (see the log above)".into())
            }
            Some(_) => {}
        }
    } else if cfg.tokenizer_path.is_some() {
        crate::log!(
            Warn,
            "--tokenizer-path is used only with --kv-events; ignored"
        );
    }
    let mut threads = Vec::new();
    for (index, (cpu, listener)) in cpus.into_iter().zip(listeners).enumerate() {
        threads.push(spawn_core(gw.clone(), index, cpu, listener)?);
    }
    crate::gateway::kv_routing::spawn_bootstrap(gw.clone(), KvBootstrapSettings::from_config(&cfg));
    crate::gateway::threads::health::spawn(gw.clone());
    crate::gateway::threads::telemetry::spawn(gw.clone());
    crate::discovery::spawn(gw.clone(), DiscoverySettings::from(&cfg));
    let metrics_addr = if cfg.prometheus_port != 0 {
        Some(crate::metrics_server::spawn(
            gw.clone(),
            &cfg.prometheus_host,
            cfg.prometheus_port,
        )?)
    } else {
        None
    };
    crate::log!(
        Info,
        "listening on {bound} with {} core(s), io driver {}, policy {}, {} worker(s)",
        gw.life.cores,
        driver.as_str(),
        cfg.policy.as_str(),
        gw.registry.load().len()
    );
    Ok(Running {
        addr: bound,
        metrics_addr,
        gw,
        threads,
        grace: Duration::from_secs(cfg.shutdown_grace_period_secs),
    })
}

/// Register the configured workers: `--worker-urls`, or in PD mode `--prefill` and
/// `--decode` (the regular list is ignored there, with a warning: no PD route would use it).
fn register_workers(cfg: &Config, registry: &Registry) -> Result<(), String> {
    use crate::workers::role::Role;
    let healthy = cfg.disable_health_check;
    let dp_sizes_at_start = |urls: &[String]| {
        let (health, upstream) = (HealthSettings::from(cfg), UpstreamSettings::from(cfg));
        crate::gateway::dp::dp_sizes_at_start(&health, &upstream, urls)
    };
    if !cfg.pd_disaggregation {
        let dp_sizes = if cfg.dp_aware {
            dp_sizes_at_start(&cfg.worker_urls).map_err(|e| e.to_string())?
        } else {
            Vec::new()
        };
        for (i, url) in cfg.worker_urls.iter().enumerate() {
            let added = match dp_sizes.get(i) {
                Some(&n) => add_dp_server(registry, url, healthy, Role::Regular, n),
                None => registry.add(url, healthy).map(|_| ()),
            };
            added.map_err(|e| format!("--worker-urls {url}: {e}"))?;
        }
        return Ok(());
    }
    if !cfg.worker_urls.is_empty() {
        crate::log!(
            Warn,
            "--worker-urls is ignored with --pd-disaggregation (use --prefill and --decode)"
        );
    }
    let prefill = cfg.prefill_workers().map_err(|e| e.to_string())?;
    let mut servers: Vec<(String, Role, &str)> = prefill
        .into_iter()
        .map(|(url, bootstrap_port)| (url, Role::Prefill { bootstrap_port }, "--prefill"))
        .collect();
    servers.extend(
        cfg.decode
            .iter()
            .map(|u| (u.clone(), Role::Decode, "--decode")),
    );
    // With --dp-aware each side's ranks are targets of their own, as regular servers' are.
    let dp_sizes = if cfg.dp_aware {
        let urls: Vec<String> = servers.iter().map(|(u, _, _)| u.clone()).collect();
        dp_sizes_at_start(&urls).map_err(|e| e.to_string())?
    } else {
        Vec::new()
    };
    for (i, (url, role, flag)) in servers.iter().enumerate() {
        let added = match dp_sizes.get(i) {
            Some(&n) => add_dp_server(registry, url, healthy, *role, n),
            None => registry.add_with_role(url, healthy, *role).map(|_| ()),
        };
        added.map_err(|e| format!("{flag} {url}: {e}"))?;
    }
    Ok(())
}

/// Register a server as `dp_size` DP-rank targets (`--dp-aware`).
fn add_dp_server(
    registry: &Registry,
    url: &str,
    healthy: bool,
    role: crate::workers::role::Role,
    dp_size: u32,
) -> Result<(), crate::workers::registry::RegistryError> {
    use crate::workers::registry::{self, RegistryError};
    let parsed = registry::parse_worker_url(url).map_err(|e| RegistryError::BadUrl(e.0))?;
    let addrs = registry::resolve(&parsed)?;
    registry
        .add_server(url, parsed, addrs, healthy, role, Some(dp_size))
        .map(|_| ())
}

/// One `SO_REUSEPORT` listener per core on `--host:--port`; returns the bound address (the real
/// port when `--port 0` was given).
fn bind_listeners(
    cfg: &Config,
    n: usize,
) -> Result<(SocketAddr, Vec<std::net::TcpListener>), String> {
    let addr = (cfg.host.as_str(), cfg.port)
        .to_socket_addrs()
        .map_err(|e| format!("bad --host {}: {e}", cfg.host))?
        .next()
        .ok_or_else(|| format!("--host {} resolves to nothing", cfg.host))?;
    // Refuse to share the port: our sockets use SO_REUSEPORT, so a second gateway (or anything
    // else listening with it) would silently take part of the traffic.
    if addr.port() != 0 {
        if let Err(e) = std::net::TcpListener::bind(addr) {
            return Err(if e.kind() == std::io::ErrorKind::AddrInUse {
                format!("{addr} is already in use by another process; refusing to start")
            } else {
                format!("cannot listen on {addr}: {e}")
            });
        }
    }
    let first = bind_reuseport(addr, LISTEN_BACKLOG)
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let bound = first.local_addr().map_err(|e| e.to_string())?;
    let mut listeners = vec![first];
    for _ in 1..n {
        let l = bind_reuseport(bound, LISTEN_BACKLOG)
            .map_err(|e| format!("cannot listen on {bound}: {e}"))?;
        listeners.push(l);
    }
    Ok((bound, listeners))
}

/// The serving cores' io_uring setup: `IORING_SETUP_COOP_TASKRUN` (Linux 5.19). A completion
/// that arrives while the core runs user code (a socket made readable by the other CPU's
/// softirq) is then queued for the core's next entry into the kernel, which monoio makes at
/// least once per loop, instead of interrupting it with an IPI to run the task work at once.
/// Measured through one core at 32 connections, 1 KiB chat bodies (static upstream, `perf`):
/// 21.3 → 17.7 µs of CPU per request, the IPI exits and the socket-lock contention they caused
/// gone from the profile. Older kernels refuse the flag; the ring is then built without it.
fn cooperative_ring() -> io_uring::Builder {
    let mut b = io_uring::IoUring::builder();
    b.setup_coop_taskrun();
    b
}

/// Stack of each serving core's thread: the JSON extractor recurses once per nesting level, which
/// a debug build's large frames would take past the default 2 MiB (see
/// `route::extract::STACK_BYTES`). Only the pages a core touches are resident.
pub const CORE_STACK_BYTES: usize = crate::route::extract::STACK_BYTES;

/// Start serving core `index` on its own pinned thread and monoio runtime.
fn spawn_core(
    gw: Arc<Gateway>,
    index: usize,
    cpu: Option<core_affinity::CoreId>,
    listener: std::net::TcpListener,
) -> Result<JoinHandle<()>, String> {
    std::thread::Builder::new()
        .name(format!("radixgate-core-{index}"))
        .stack_size(CORE_STACK_BYTES)
        .spawn(move || {
            if let Some(cpu) = cpu {
                core_affinity::set_for_current(cpu);
            }
            let built = monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
                .enable_timer()
                .with_entries(RING_ENTRIES)
                .uring_builder(cooperative_ring())
                .build()
                .or_else(|_| {
                    monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
                        .enable_timer()
                        .with_entries(RING_ENTRIES)
                        .build()
                });
            match built {
                Ok(mut rt) => rt.block_on(core_main(gw, index, listener)),
                Err(e) => crate::log!(Error, "core {index}: cannot build runtime: {e}"),
            }
        })
        .map_err(|e| format!("cannot spawn core thread: {e}"))
}

async fn core_main(gw: Arc<Gateway>, index: usize, listener: std::net::TcpListener) {
    let listener = match monoio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            crate::log!(Error, "core {index}: cannot adopt listener: {e}");
            return;
        }
    };
    let core = Rc::new(Core::new(gw.clone(), index));
    // Housekeeping: expire idle upstream connections; core 0 also runs policy maintenance.
    {
        let core = core.clone();
        monoio::spawn(async move {
            loop {
                monoio::time::sleep(Duration::from_millis(500)).await;
                if core.gw.life.is_shutting_down() {
                    break;
                }
                let list = core.gw.registry.load_full();
                core.pool.sweep(&|w| list.get(w).is_some());
                if core.index == 0 {
                    for (r, _) in core.gw.routers() {
                        r.policy.maintain(core.gw.life.now_ms());
                        r.recent.sweep(r.epoch());
                    }
                }
            }
        });
    }
    {
        let core = core.clone();
        monoio::spawn(async move {
            let gw = core.gw.clone();
            crate::gateway::busy_poll::spin(
                &core.busy,
                || gw.life.is_shutting_down(),
                Duration::from_millis(200),
            )
            .await;
        });
    }
    // One accept stays pending across shutdown checks: cancelling an in-flight accept can lose
    // a connection the kernel already handed over (monoio #318), so only the timer is dropped.
    {
        let conns = crate::serve::connections::Connections::new(gw.settings.cores.max_connections);
        let mut accept_log = LogLimiter::new(ACCEPT_LOG_INTERVAL);
        let mut accept = std::pin::pin!(listener.accept());
        while !gw.life.is_shutting_down() {
            monoio::select! {
                r = &mut accept => {
                    match r {
                        Ok((stream, _peer)) => match conns.admit() {
                            Some(slot) => {
                                monoio::spawn(crate::serve::conn::serve(core.clone(), stream, slot));
                            }
                            None => {
                                monoio::spawn(crate::serve::conn::refuse_over_cap(stream));
                            }
                        },
                        Err(e) => {
                            // Out of descriptors: an idle keep-alive connection is worth less
                            // than the new one waiting in the backlog.
                            if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) {
                                conns.shed_oldest_idle();
                            }
                            if let Some(suppressed) = accept_log.allow(Instant::now()) {
                                crate::log!(
                                    Warn,
                                    "core {index}: accept failed: {e} ({suppressed} more \
                                     failure(s) not logged in the last {}s)",
                                    ACCEPT_LOG_INTERVAL.as_secs()
                                );
                            }
                            monoio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                    accept.set(listener.accept());
                }
                _ = monoio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
    }
    drop(listener);
    // Let in-flight requests (on every core) finish; the shutdown caller bounds the wait.
    while gw.life.active_requests() > 0 {
        monoio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Raise the open-file soft limit to the hard limit: each client and each pooled upstream
/// connection is a descriptor, and the usual 1024 default caps a gateway at a few hundred
/// concurrent streams (the reference failed at its descriptor ceiling, sglang#7551).
pub fn raise_nofile_limit() {
    // SAFETY: getrlimit/setrlimit with a valid, initialised rlimit struct.
    unsafe {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            let _ = libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeating_log_line_is_written_once_per_interval_with_a_count() {
        let mut l = LogLimiter::new(Duration::from_secs(1));
        let t0 = Instant::now();
        assert_eq!(l.allow(t0), Some(0));
        for i in 1..100 {
            assert_eq!(l.allow(t0 + Duration::from_millis(i * 10 - 9)), None);
        }
        assert_eq!(l.allow(t0 + Duration::from_secs(1)), Some(99));
        assert_eq!(l.allow(t0 + Duration::from_millis(1500)), None);
        assert_eq!(l.allow(t0 + Duration::from_secs(5)), Some(1));
    }
}
