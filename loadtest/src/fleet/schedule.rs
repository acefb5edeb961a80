//! The phases every shard runs, on one clock: phase i lasts `secs`, then `settle` seconds with
//! nothing published (the gateway drains, late markers are probed), then phase i + 1.

/// One phase: an aggregate rate (blocks/s over the whole fleet; 0 = idle) for some seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Phase {
    /// Blocks stored per second over all publishers.
    pub rate: f64,
    /// Seconds it lasts.
    pub secs: f64,
}

/// The phases and where they start (CLOCK_MONOTONIC ns).
#[derive(Debug, Clone)]
pub struct Schedule {
    /// Start of phase 0.
    pub start_ns: u64,
    /// The phases in order.
    pub phases: Vec<Phase>,
    /// Quiet seconds after each phase.
    pub settle_s: f64,
}

impl Schedule {
    /// Phase `i`'s window `[start, end)`.
    pub fn window(&self, i: usize) -> (u64, u64) {
        let secs: f64 = self.phases[..i]
            .iter()
            .map(|p| p.secs + self.settle_s)
            .sum();
        let start = self.start_ns + (secs * 1e9) as u64;
        (start, start + (self.phases[i].secs * 1e9) as u64)
    }

    /// Where the last settle ends.
    pub fn end_ns(&self) -> u64 {
        match self.phases.len() {
            0 => self.start_ns,
            n => self.window(n - 1).1 + (self.settle_s * 1e9) as u64,
        }
    }
}

/// `"0,100000,1e6"` → rates; each phase `secs` long.
pub fn parse_rates(list: &str, secs: f64) -> Result<Vec<Phase>, String> {
    list.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| {
            let s = s.trim();
            let (num, mult) = match s.chars().last() {
                Some('k' | 'K') => (&s[..s.len() - 1], 1e3),
                Some('m' | 'M') => (&s[..s.len() - 1], 1e6),
                _ => (s, 1.0),
            };
            num.parse::<f64>()
                .ok()
                .filter(|r| r.is_finite() && *r >= 0.0)
                .map(|r| Phase {
                    rate: r * mult,
                    secs,
                })
                .ok_or_else(|| format!("bad rate {s:?}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_follow_each_other_with_settles() {
        let s = Schedule {
            start_ns: 1_000,
            phases: parse_rates("0,100k,1M", 2.0).unwrap(),
            settle_s: 1.0,
        };
        assert_eq!(s.phases[1].rate, 100_000.0);
        assert_eq!(s.phases[2].rate, 1_000_000.0);
        assert_eq!(s.window(0), (1_000, 2_000_001_000));
        assert_eq!(s.window(1), (3_000_001_000, 5_000_001_000));
        assert_eq!(s.end_ns(), 9_000_001_000);
        assert!(parse_rates("x", 1.0).is_err());
        assert!(parse_rates("-1", 1.0).is_err());
    }
}
