//! A tiny fast PRNG (wyrand) owned per core: policies need cheap random tie-breaks, tests need
//! deterministic seeds, and neither justifies a crate or a shared generator.

/// Per-core random source; seed it explicitly in tests.
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator with a fixed seed (deterministic sequences for tests).
    pub fn with_seed(seed: u64) -> Self {
        Rng {
            state: seed ^ 0x2d35_8dcc_aa6c_78a5,
        }
    }

    /// A generator seeded from the clock, the thread and an address (production use).
    pub fn from_entropy() -> Self {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let local = 0u8;
        let addr = &local as *const u8 as u64;
        let mut r = Rng::with_seed(t ^ addr.rotate_left(17));
        r.next_u64();
        r
    }

    /// Next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0xa076_1d64_78bd_642f);
        let t = (self.state as u128).wrapping_mul((self.state ^ 0xe703_7ed1_a0b4_28db) as u128);
        ((t >> 64) as u64) ^ (t as u64)
    }

    /// Uniform in `0..n` (`n > 0`; returns 0 for `n == 0`).
    #[inline]
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// Uniform in [0, 1).
    #[inline]
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn below_is_in_range_and_covers_it() {
        let mut r = Rng::with_seed(7);
        let mut seen = [0u32; 5];
        for _ in 0..10_000 {
            let v = r.below(5);
            assert!(v < 5);
            seen[v] += 1;
        }
        assert!(seen.iter().all(|&c| c > 1_500), "{seen:?}");
    }

    #[test]
    fn same_seed_same_sequence() {
        let mut a = Rng::with_seed(42);
        let mut b = Rng::with_seed(42);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
    }
}
