//! The `/metrics` listener on `--prometheus-port`: plain blocking threads, away from the
//! serving cores, that refresh the gauges derived from shared state and render the exporter.
//! One thread accepts; each connection gets its own short-lived thread (at most
//! [`MAX_CONNECTIONS`] at once) with a whole-connection deadline, so one slow or non-reading
//! client cannot keep Prometheus from scraping.

use crate::gateway::Gateway;
use crate::http::{self, HeadLimits};
use crate::serve::error::GatewayError;
use crate::serve::reply::{Reply, REPLY_WRITE_TIMEOUT};
use bytes::BytesMut;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Connections served at once; one more is closed at once (a scraper retries next interval).
/// A slow client holds its place for at most `--header-timeout-secs` plus the write timeout.
pub const MAX_CONNECTIONS: usize = 8;

/// Bind `--prometheus-host:--prometheus-port` and serve; returns the bound address.
pub fn spawn(gw: Arc<Gateway>, host: &str, port: u16) -> Result<SocketAddr, String> {
    let addr = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("bad --prometheus-host: {e}"))?
        .next()
        .ok_or("bad --prometheus-host")?;
    let listener =
        TcpListener::bind(addr).map_err(|e| format!("cannot listen on {addr} for metrics: {e}"))?;
    let bound = listener.local_addr().map_err(|e| e.to_string())?;
    std::thread::Builder::new()
        .name("radixgate-metrics".into())
        .spawn(move || accept_loop(gw, listener))
        .map_err(|e| e.to_string())?;
    Ok(bound)
}

fn accept_loop(gw: Arc<Gateway>, listener: TcpListener) {
    let active = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        if gw.life.is_shutting_down() {
            break;
        }
        let s = match conn {
            Ok(s) => s,
            Err(_) => {
                // Out of descriptors or similar: do not spin.
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if active.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
            active.fetch_sub(1, Ordering::AcqRel);
            continue;
        }
        let place = Place(active.clone());
        let gw = gw.clone();
        let spawned = std::thread::Builder::new()
            .name("radixgate-metrics-conn".into())
            .spawn(move || {
                let _place = place;
                let _ = serve(&gw, s);
            });
        // A thread that could not start dropped its closure, and with it the place.
        drop(spawned);
    }
}

/// One of the [`MAX_CONNECTIONS`] places, given back when the connection's thread ends.
struct Place(Arc<AtomicUsize>);

impl Drop for Place {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn refresh(gw: &Gateway) {
    let list = gw.registry.load();
    crate::metrics::refresh_process_gauges(list.len());
    let board = &gw.registry.loads;
    for w in &list.workers {
        crate::metrics::worker_state(
            &w.url,
            board.in_flight(w.id),
            board.load(w.id),
            board.is_eligible(w.id),
        );
    }
    if let Some(kv) = &gw.kv {
        let st = &kv.stats;
        crate::metrics::kv_index_stats(
            st.held(),
            st.distinct(),
            st.sources(),
            kv.exact_workers().len(),
        );
        let names = crate::kv::intake::SourceState::ALL.map(|s| s.as_str());
        let urls: std::collections::HashMap<_, _> =
            list.workers.iter().map(|w| (w.id, &w.url)).collect();
        for (source, state) in kv.source_states().iter() {
            if let Some(url) = urls.get(&source.worker) {
                crate::metrics::kv_source_state(url, source.dp_rank, state.as_str(), &names);
            }
        }
        let intake = kv.intake();
        crate::metrics::kv_queue(intake.queued_bytes(), intake.queue_wait(), intake.lagging());
        for (source, staleness, _) in intake.staleness().iter() {
            if let Some(url) = urls.get(&source.worker) {
                crate::metrics::kv_source_staleness(url, source.dp_rank, *staleness);
            }
        }
        for (reason, total) in [
            ("unknown_parent", st.dropped_unknown_parent()),
            ("block_size", st.dropped_block_size()),
            ("malformed", st.dropped_malformed()),
            ("limits", st.dropped_limits()),
        ] {
            crate::metrics::kv_index_dropped(reason, total);
        }
    }
    // Engine series exist from start (zeros until the first scrape), for every registered
    // worker, whenever the telemetry thread runs.
    if gw.telemetry.enabled() {
        let report = gw.telemetry.report();
        // A DP rank shows its server's engine (scraped once, through rank 0, which the registry
        // lists right before the server's other ranks).
        let mut server_serial = 0;
        for w in &list.workers {
            if w.is_primary() {
                server_serial = w.serial;
            }
            let serial = if w.dp.is_some() {
                server_serial
            } else {
                w.serial
            };
            let e = report.workers.get(&serial).copied().unwrap_or_default();
            crate::metrics::engine_state(&w.url, &e.gauges);
        }
        crate::metrics::hit_ratios(report.fleet_hit_ratio, report.predicted_hit_ratio);
    }
    if let Some(t) = &gw.router.tree {
        let s = t.stats();
        crate::metrics::tree_stats(crate::metrics::TreeStats {
            nodes: s.nodes(),
            chars: s.chars(),
            epoch: s.epoch(),
            dropped: s.dropped(),
            applied: s.inserts_applied(),
            evicted_chars: s.evicted_chars(),
            evictions: s.evictions(),
        });
    }
}

fn serve(gw: &Gateway, mut s: TcpStream) -> std::io::Result<()> {
    // The whole head within --header-timeout-secs: a client trickling bytes is cut off too.
    let head_deadline = Instant::now()
        + gw.settings
            .client
            .header_timeout
            .max(Duration::from_secs(1));
    let mut buf = BytesMut::with_capacity(4096);
    let mut tmp = [0u8; 4096];
    let head = loop {
        match http::parse_request_head(&mut buf, &HeadLimits::default()) {
            Ok(Some(h)) => break h,
            Ok(None) => {}
            Err(_) => return Ok(()),
        }
        s.set_read_timeout(Some(left(head_deadline)?))?;
        let n = s.read(&mut tmp)?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&tmp[..n]);
    };
    let resp = if head.path() == b"/metrics" && head.method_kind() == http::Method::Get {
        refresh(gw);
        let body = crate::metrics::install()
            .map(|h| h.render())
            .unwrap_or_default();
        http::response::render(200, "text/plain; version=0.0.4", &[], body.as_bytes(), true)
    } else {
        let e = GatewayError::not_found("only GET /metrics here");
        Reply::error(&e).render(None, true)
    };
    write_by(&mut s, &resp, Instant::now() + REPLY_WRITE_TIMEOUT)
}

/// Time left until `deadline`, or `TimedOut` when none is.
fn left(deadline: Instant) -> std::io::Result<Duration> {
    let d = deadline.saturating_duration_since(Instant::now());
    if d.is_zero() {
        return Err(std::io::ErrorKind::TimedOut.into());
    }
    Ok(d)
}

/// Write all of `data` by `deadline` (a client reading a byte at a time cannot stretch it).
fn write_by(s: &mut TcpStream, mut data: &[u8], deadline: Instant) -> std::io::Result<()> {
    while !data.is_empty() {
        s.set_write_timeout(Some(left(deadline)?))?;
        match s.write(data) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
