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
        .filter_map(|s| Some(stat_ticks(&s)? as f64 / hz))
        .sum()
}

/// utime + stime, in clock ticks, of a `/proc/…/stat` line (a process's or a thread's).
pub fn stat_ticks(stat: &str) -> Option<u64> {
    // Fields after the command name (which may hold spaces), from field 3 on.
    let rest = stat.get(stat.rfind(')')? + 1..)?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ut: u64 = f.get(11)?.parse().ok()?;
    let st: u64 = f.get(12)?.parse().ok()?;
    Some(ut + st)
}

/// A `kB` field (`VmRSS`, `VmHWM`) of a `/proc/…/status` text.
pub fn status_kb(status: &str, field: &str) -> Option<u64> {
    let line = status
        .lines()
        .find(|l| l.strip_prefix(field).is_some_and(|r| r.starts_with(':')))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok()
}

/// VmRSS of every PID, in KiB (a PID that is gone counts 0).
pub fn rss_kb(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/status")).ok())
        .filter_map(|s| status_kb(&s, "VmRSS"))
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

    #[test]
    fn stat_and_status_fields_are_read_past_a_command_name_with_spaces_and_parentheses() {
        let stat = "42 (kv-a) b) S 1 1 1 0 -1 4194560 100 0 0 0 7 5 0 0 20 0 9 0";
        assert_eq!(super::stat_ticks(stat), Some(12));
        assert_eq!(super::stat_ticks("42 (cut"), None);
        let status = "Name:\tx\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n";
        assert_eq!(super::status_kb(status, "VmRSS"), Some(1024));
        assert_eq!(super::status_kb(status, "VmHWM"), Some(2048));
        assert_eq!(super::status_kb(status, "VmRS"), None);
    }
}
