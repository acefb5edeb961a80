//! The `radixgate` binary: parse flags (exit 2 on bad ones), start the cores, wait for
//! SIGTERM/SIGINT, drain within the grace period, exit 0.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

fn main() {
    let cfg = radixgate::config::Config::from_env();
    let running = match radixgate::runtime::start(cfg) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("radixgate: {e}");
            std::process::exit(1);
        }
    };
    // SAFETY: installing an async-signal-safe handler that only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
    while !STOP.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(50));
    }
    radixgate::log!(Info, "signal received: draining in-flight requests");
    let drained = running.shutdown();
    if !drained {
        radixgate::log!(Warn, "grace period over with requests still in flight");
    }
    radixgate::log!(Info, "stopped");
    std::process::exit(0);
}
