//! Sharing one test process: every suite runs in the e2e binary, two tests at a time (on the
//! 2-core CI machine, `cargo test`'s default there). Most tests only need their own gateways and
//! workers. Two kinds need more:
//!
//! - tests whose figures are delays, CPU shares or rates (a core that must not stall 50 ms, a
//!   soak's every chat within a second, refused replays counted per second) take [`serial`],
//!   and tests that keep a CPU busy for seconds take [`busy`]: the same lock, so a figure is
//!   never measured beside another figure's load or beside a CPU hog (the soak's nice-10 event
//!   thread, starved beside the tokenizer goldens' Python, stalled for seconds), while the hogs
//!   and the light tests run beside each other;
//! - tests that read what is per process (its resident memory, the global metrics recorder all
//!   in-process gateways write to, its threads listed by name) run in a child process of this
//!   binary by themselves
//!   ([`alone_in_a_process`], [`run_in_child`]), since another test's gateways in the same
//!   process would be counted too.

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Names the one test a child process of this binary runs (see [`run_in_child`]).
const CHILD_ENV: &str = "RADIXGATE_TEST_ALONE";

/// The one process-wide lock of the tests that measure and of those that load the CPU. One
/// lock for every suite: the suites share the process and its two test threads.
static CPU: RwLock<()> = RwLock::new(());

/// Held for the whole of a test that measures delays, CPU shares or memory under load: no
/// other such test and no [`busy`] one runs meanwhile, whichever suite it is in (light tests
/// still may). Each call site says why it holds it.
pub fn serial() -> RwLockWriteGuard<'static, ()> {
    // A test that failed while holding it poisons it; the next one may still run.
    CPU.write().unwrap_or_else(|e| e.into_inner())
}

/// Held for the whole of a test that keeps a CPU busy for seconds (of the two this machine
/// has): it runs beside other busy tests and light ones, never beside a [`serial`] one. Each
/// call site says what keeps it busy.
pub fn busy() -> RwLockReadGuard<'static, ()> {
    CPU.read().unwrap_or_else(|e| e.into_inner())
}

/// The test's name as libtest knows it in this binary: `module::function` (the crate's own
/// name, first in `module_path!()`, is not part of it).
fn test_name(module: &str, function: &str) -> String {
    let module = module.split_once("::").map_or("", |(_, rest)| rest);
    if module.is_empty() {
        function.to_string()
    } else {
        format!("{module}::{function}")
    }
}

/// Whether this process is the child started by [`run_in_child`] for test `function` of
/// `module` (pass `module_path!()`).
pub fn is_the_child(module: &str, function: &str) -> bool {
    std::env::var(CHILD_ENV).is_ok_and(|v| v == test_name(module, function))
}

/// Runs test `function` of `module` (pass `module_path!()`) alone in a child process of this
/// binary (one test thread, [`is_the_child`] true there), fails unless exactly that test ran
/// and passed, and returns what it printed (stdout, then stderr).
pub fn run_in_child(module: &str, function: &str) -> String {
    let name = test_name(module, function);
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = std::process::Command::new(exe)
        .args([
            name.as_str(),
            "--exact",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD_ENV, &name)
        .output()
        .expect("run the child test process");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{name} failed in its own process ({}):\n{stdout}\n{stderr}",
        out.status
    );
    // A misspelt name runs nothing and passes: make sure the test itself ran.
    assert!(
        stdout.contains("test result: ok. 1 passed"),
        "the child process did not run {name}:\n{stdout}\n{stderr}"
    );
    format!("{stdout}{stderr}")
}

/// For a test that must have the process to itself: in the parent, runs it in a child process
/// ([`run_in_child`]), prints what it printed (for `--nocapture` and failures) and returns
/// false (the caller returns at once); in that child, returns true (the caller runs the test).
///
/// ```ignore
/// if !alone_in_a_process(module_path!(), "this_test") { return; }
/// ```
pub fn alone_in_a_process(module: &str, function: &str) -> bool {
    if is_the_child(module, function) {
        return true;
    }
    print!("{}", run_in_child(module, function));
    false
}
