//! `--kv-bootstrap-peer`: copying a running sibling's index before subscribing.

use super::super::Gateway;
use super::*;
use crate::base::WorkerId;
use crate::config::settings::KvBootstrapSettings;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Largest index copy accepted from a sibling: a full index (4 Mi blocks at about 18 bytes
/// each, ~72 MiB) fits three times over; the download is held once, then read in place.
const MAX_BOOTSTRAP_BYTES: usize = 256 << 20;
/// Time allowed for downloading and applying a sibling's copy.
const BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(60);

/// With `--kv-bootstrap-peer`: a helper thread downloads the sibling's index and hands it to the
/// event thread before any subscription (the health thread's discovery waits for it). Any
/// failure is logged and the copy starts cold (the start-up replays still run).
pub fn spawn_bootstrap(gw: Arc<Gateway>, settings: Option<KvBootstrapSettings>) {
    let (Some(kv), Some(settings)) = (&gw.kv, settings) else {
        return;
    };
    if kv.bootstrapped.load(Ordering::Acquire) {
        return;
    }
    let gw2 = gw.clone();
    let spawned = std::thread::Builder::new()
        .name("radixgate-kv-bootstrap".into())
        .spawn(move || {
            let Some(kv) = &gw2.kv else { return };
            let peer = &settings.peer;
            match bootstrap(&gw2, kv, &settings) {
                Ok(n) => crate::log!(
                    Info,
                    "kv events: copied the block index of {peer} ({n} publishers)"
                ),
                Err(e) => crate::log!(
                    Warn,
                    "kv events: no index copied from {peer} ({e}); starting from the servers' \
                     replay buffers"
                ),
            }
            kv.bootstrapped.store(true, Ordering::Release);
        });
    if let Err(e) = spawned {
        crate::log!(Warn, "kv events: cannot start the bootstrap thread: {e}");
        kv.bootstrapped.store(true, Ordering::Release);
    }
}

fn bootstrap(
    gw: &Gateway,
    kv: &KvRouting,
    settings: &KvBootstrapSettings,
) -> Result<usize, String> {
    let (status, body) = crate::proxy::blocking::get(
        &settings.peer,
        "/kv_index/snapshot",
        settings.admin_api_key.as_deref(),
        MAX_BOOTSTRAP_BYTES,
        BOOTSTRAP_TIMEOUT,
    )?;
    if status != 200 {
        return Err(format!(
            "GET /kv_index/snapshot answered {status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        ));
    }
    let workers: Vec<(String, WorkerId)> = gw
        .registry
        .load()
        .workers
        .iter()
        .map(|w| (w.url.clone(), w.id))
        .collect();
    let rx = kv
        .intake
        .import(body, workers)
        .map_err(|e| format!("event thread {e:?}"))?;
    rx.recv_timeout(BOOTSTRAP_TIMEOUT)
        .map_err(|e| format!("event thread: {e}"))?
}
