//! The `/metrics` listener on `--prometheus-port`: a plain blocking thread, away from the
//! serving cores, that refreshes the gauges derived from shared state and renders the exporter.

use crate::gateway::Gateway;
use crate::http::{self, HeadLimits};
use bytes::BytesMut;
use metrics::gauge;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

/// Bind and serve; returns the bound address.
pub fn spawn(gw: Arc<Gateway>) -> Result<SocketAddr, String> {
    let addr = (gw.cfg.prometheus_host.as_str(), gw.cfg.prometheus_port)
        .to_socket_addrs()
        .map_err(|e| format!("bad --prometheus-host: {e}"))?
        .next()
        .ok_or("bad --prometheus-host")?;
    let listener =
        TcpListener::bind(addr).map_err(|e| format!("cannot listen on {addr} for metrics: {e}"))?;
    let bound = listener.local_addr().map_err(|e| e.to_string())?;
    std::thread::Builder::new()
        .name("radixgate-metrics".into())
        .spawn(move || {
            for conn in listener.incoming() {
                if gw.is_shutting_down() {
                    break;
                }
                if let Ok(s) = conn {
                    let _ = serve(&gw, s);
                }
            }
        })
        .map_err(|e| e.to_string())?;
    Ok(bound)
}

fn refresh(gw: &Gateway) {
    let list = gw.registry.load();
    gauge!("smg_worker_pool_size").set(list.len() as f64);
    for w in &list.workers {
        let label = w.url.clone();
        gauge!("smg_worker_requests_active", "worker" => label.clone())
            .set(gw.registry.loads.load(w.id) as f64);
        gauge!("smg_worker_health", "worker" => label).set(
            if gw.registry.loads.is_eligible(w.id) {
                1.0
            } else {
                0.0
            },
        );
    }
    if let Some(t) = &gw.tree {
        let s = t.stats();
        gauge!("radixgate_tree_nodes").set(s.nodes() as f64);
        gauge!("radixgate_tree_chars").set(s.chars() as f64);
        gauge!("radixgate_tree_epoch").set(s.epoch() as f64);
        gauge!("radixgate_tree_inserts_dropped").set(s.dropped() as f64);
        gauge!("radixgate_tree_evicted_chars").set(s.evicted_chars() as f64);
    }
}

fn serve(gw: &Gateway, mut s: TcpStream) -> std::io::Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut buf = BytesMut::with_capacity(4096);
    let mut tmp = [0u8; 4096];
    let head = loop {
        match http::parse_request_head(&mut buf, &HeadLimits::default()) {
            Ok(Some(h)) => break h,
            Ok(None) => {}
            Err(_) => return Ok(()),
        }
        let n = s.read(&mut tmp)?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&tmp[..n]);
    };
    let resp = if head.path() == b"/metrics" && head.method() == b"GET" {
        refresh(gw);
        let body = crate::metrics::install()
            .map(|h| h.render())
            .unwrap_or_default();
        http::response::render(200, "text/plain; version=0.0.4", &[], body.as_bytes(), true)
    } else {
        http::response::error_response(404, "not_found_error", "only GET /metrics here", &[], true)
    };
    s.write_all(&resp)
}
