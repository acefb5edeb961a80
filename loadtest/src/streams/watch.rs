//! Reading a proxy's cost from /proc at the load generator's own window edges: CPU time
//! (utime + stime) and resident memory (VmRSS) summed over a set of PIDs. Read here rather
//! than by the calling script, because only the load generator knows exactly when its
//! measurement window opens and closes.

/// utime + stime of every PID, in seconds (a PID that is gone counts 0).
pub fn cpu_seconds(pids: &[u32]) -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).ok())
        .filter_map(|s| {
            // Fields after the command name (which may hold spaces), from field 3 on.
            let rest = &s[s.rfind(')')? + 2..];
            let f: Vec<&str> = rest.split_whitespace().collect();
            let ut: u64 = f.get(11)?.parse().ok()?;
            let st: u64 = f.get(12)?.parse().ok()?;
            Some((ut + st) as f64 / hz)
        })
        .sum()
}

/// VmRSS of every PID, in KiB (a PID that is gone counts 0).
pub fn rss_kb(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/status")).ok())
        .filter_map(|s| {
            let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    #[test]
    fn this_process_has_cpu_time_and_memory() {
        let me = [std::process::id()];
        assert!(super::rss_kb(&me) > 0);
        assert!(super::cpu_seconds(&me) >= 0.0);
        assert_eq!(super::rss_kb(&[u32::MAX]), 0);
    }
}
