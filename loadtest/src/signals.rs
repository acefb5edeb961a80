//! SIGINT and SIGTERM for the simulator binaries: blocked in every thread from the start of
//! `main`, then taken by one thread with `sigwait`, which sets a stop flag. The process then
//! stops as it planned to (results written, sockets closed), never in the middle of a write.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The set: SIGINT and SIGTERM.
fn stop_set() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset/sigaddset initialise it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        set
    }
}

/// Block SIGINT and SIGTERM in the calling thread and the threads it starts afterwards. Call
/// first thing in `main`, before any thread starts.
pub fn block_stop_signals() {
    let set = stop_set();
    // SAFETY: `set` is initialised; pthread_sigmask only reads it.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
}

/// A thread that waits for SIGINT or SIGTERM (blocked by [`block_stop_signals`]) and then sets
/// `stop`.
pub fn stop_on_signal(stop: Arc<AtomicBool>) {
    std::thread::spawn(move || {
        let set = stop_set();
        let mut sig = 0;
        // SAFETY: `set` is initialised; sigwait writes the signal number to `sig`.
        if unsafe { libc::sigwait(&set, &mut sig) } == 0 {
            stop.store(true, Ordering::Release);
        }
    });
}
