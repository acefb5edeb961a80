//! `tests/docs.rs` declares `mod common;`: the end-to-end helpers it uses live in
//! tests/e2e/common/ (the e2e binary's), and this file lends them to it.

// docs.rs uses a handful of the helpers; the rest (and their re-exports) are the e2e
// binary's, unused here.
#[allow(dead_code, unused_imports)]
#[path = "../e2e/common/mod.rs"]
mod e2e;

pub use e2e::*;

/// The number of a port on 127.0.0.1 that a server started next may bind: [`reserve`]d (so no
/// bind to port 0 and no outgoing connection takes it meanwhile) and held until the process
/// ends, since the caller keeps only the number. For docs.rs's one call, which hands it to
/// `--prometheus-port`; the e2e tests use `gateway_with_metrics`.
pub fn free_port() -> u16 {
    static HELD: std::sync::Mutex<Vec<Reserved>> = std::sync::Mutex::new(Vec::new());
    let r = reserve();
    let port = r.port;
    HELD.lock().unwrap_or_else(|e| e.into_inner()).push(r);
    port
}
