//! Thread priority of the calling thread. The helper threads (health, telemetry) lower theirs
//! so that, sharing a CPU with a serving core, they take only what the core leaves.

/// Set the calling thread's nice value to `nice` (Linux applies `PRIO_PROCESS` with a thread id
/// to that thread alone). Raising one's own nice value needs no privilege.
pub fn lower_thread_priority(nice: i32) -> std::io::Result<()> {
    // SAFETY: gettid has no preconditions; setpriority takes plain integers.
    let r = unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice)
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Nice value of the helper threads that must keep up under load (tree writer, KV-event
/// intake, health checks): where one shares a CPU with a serving core, the scheduler gives the
/// core about nine tenths of it (CFS weights 1024 : 110), and a core that wakes preempts them.
pub const HELPER_NICE: i32 = 10;

/// Lower the calling helper thread to [`HELPER_NICE`]. Not `SCHED_IDLE`: these threads must
/// keep up when every CPU is busy (a starved event thread would let the publishers' queues
/// overflow into gaps and resets; a starved tree writer would leave routing on old snapshots).
pub fn helper_thread() -> std::io::Result<()> {
    lower_thread_priority(HELPER_NICE)
}

/// The calling thread's nice value.
pub fn thread_priority() -> i32 {
    // SAFETY: as above; getpriority returns the value (errors are not possible for oneself).
    unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) }
}

/// Put the calling thread in the `SCHED_IDLE` class: it runs on a CPU only when nothing else
/// there wants it, and a normal thread that wakes preempts it at once, without waiting out its
/// slice (a nice value only changes shares: a serving core woken while a nice 10 thread ran
/// still waited milliseconds). Lowering one's own class needs no privilege. Only for work that
/// may be starved without harm when the CPU is saturated.
pub fn idle_thread() -> std::io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: gettid has no preconditions; `param` is a valid sched_param for the call.
    let r = unsafe { libc::sched_setscheduler(libc::gettid(), libc::SCHED_IDLE, &param) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Whether the calling thread is in the `SCHED_IDLE` class.
pub fn thread_is_idle_class() -> bool {
    // SAFETY: as above; the call only reads the thread's policy.
    unsafe { libc::sched_getscheduler(libc::gettid()) == libc::SCHED_IDLE }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_lowers_its_own_priority_only() {
        let main = thread_priority();
        let got = std::thread::spawn(|| {
            lower_thread_priority(main_plus(5)).unwrap();
            thread_priority()
        })
        .join()
        .unwrap();
        assert_eq!(got, main_plus(5));
        assert_eq!(
            thread_priority(),
            main,
            "the spawning thread keeps its priority"
        );
    }

    #[test]
    fn a_thread_can_enter_the_idle_class_alone() {
        let got = std::thread::spawn(|| {
            idle_thread().unwrap();
            thread_is_idle_class()
        })
        .join()
        .unwrap();
        assert!(got);
        assert!(
            !thread_is_idle_class(),
            "the spawning thread keeps its class"
        );
    }

    fn main_plus(n: i32) -> i32 {
        (thread_priority() + n).min(19)
    }
}
