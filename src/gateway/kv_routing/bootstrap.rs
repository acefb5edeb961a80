//! `--kv-bootstrap-peer`: copying a running sibling's index before subscribing.

use super::super::Gateway;
use super::*;
use crate::base::WorkerId;
use crate::config::settings::KvBootstrapSettings;
use crate::proxy::blocking::GetError;
use crossbeam::channel::RecvTimeoutError;
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

/// Why no index was copied from the sibling: logged, and the index starts from the servers'
/// replay buffers instead.
#[derive(Debug)]
enum BootstrapError {
    /// The download failed.
    Get(GetError),
    /// The sibling answered this status (and the start of its body).
    Status(u16, String),
    /// The event thread did not take the copy.
    EventThread(CommandError),
    /// The event thread did not answer in time.
    Answer(RecvTimeoutError),
    /// The event thread refused the copy (its reason).
    Refused(String),
}

impl std::fmt::Display for BootstrapError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BootstrapError::Get(e) => write!(f, "{e}"),
            BootstrapError::Status(status, body) => {
                write!(f, "GET /kv_index/snapshot answered {status}: {body}")
            }
            BootstrapError::EventThread(e) => write!(f, "event thread {e:?}"),
            BootstrapError::Answer(e) => write!(f, "event thread: {e}"),
            BootstrapError::Refused(why) => f.write_str(why),
        }
    }
}

fn bootstrap(
    gw: &Gateway,
    kv: &KvRouting,
    settings: &KvBootstrapSettings,
) -> Result<usize, BootstrapError> {
    let (status, body) = crate::proxy::blocking::get(
        &settings.peer,
        "/kv_index/snapshot",
        settings.admin_api_key.as_deref(),
        MAX_BOOTSTRAP_BYTES,
        BOOTSTRAP_TIMEOUT,
    )
    .map_err(BootstrapError::Get)?;
    if status != 200 {
        return Err(BootstrapError::Status(
            status,
            String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
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
        .map_err(BootstrapError::EventThread)?;
    rx.recv_timeout(BOOTSTRAP_TIMEOUT)
        .map_err(BootstrapError::Answer)?
        .map_err(BootstrapError::Refused)
}
