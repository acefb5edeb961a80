//! The `/metrics` listener on `--prometheus-port`: a plain blocking thread, away from the
//! serving cores, that refreshes the gauges derived from shared state and renders the exporter.

use crate::gateway::Gateway;
use crate::http::{self, HeadLimits};
use crate::serve::error::GatewayError;
use crate::serve::reply::Reply;
use bytes::BytesMut;
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
                if gw.life.is_shutting_down() {
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
    crate::metrics::worker_pool_size(list.len());
    for w in &list.workers {
        crate::metrics::worker_state(
            &w.url,
            gw.registry.loads.load(w.id),
            gw.registry.loads.is_eligible(w.id),
        );
    }
    if let Some(t) = &gw.router.tree {
        let s = t.stats();
        crate::metrics::tree_stats(
            s.nodes(),
            s.chars(),
            s.epoch(),
            s.dropped(),
            s.evicted_chars(),
        );
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
    let resp = if head.path() == b"/metrics" && head.method_kind() == http::Method::Get {
        refresh(gw);
        let body = crate::metrics::install()
            .map(|h| h.render())
            .unwrap_or_default();
        http::response::render(200, "text/plain; version=0.0.4", &[], body.as_bytes(), true)
    } else {
        let e = GatewayError::new(404, "only GET /metrics here");
        Reply::error(&e).render(None, true)
    };
    s.write_all(&resp)
}
