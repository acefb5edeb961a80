//! A tiny seeded PRNG (SplitMix64). The simulator must be bit-for-bit reproducible from `--seed`
//! (jitter, fault injection, generated words), and this is the whole of what it needs; pulling a
//! `rand` version into the workspace for it would couple us to its stream-stability policy.

/// SplitMix64: 64-bit state, passes BigCrush, one add + two multiplies per draw.
#[derive(Debug, Clone)]
pub struct SimRng {
    state: u64,
}

impl SimRng {
    /// A generator whose stream is fully determined by `seed`.
    pub fn new(seed: u64) -> Self {
        SimRng { state: seed }
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.state)
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `[0, n)`; `n == 0` yields 0. Multiply-shift, bias < n / 2^64.
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// `true` with probability `p` (clamped to [0, 1]).
    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.next_f64() < p
    }
}

/// The SplitMix64 finaliser: a strong 64-bit mixer, also used to derive per-request seeds.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hash a token sequence into a seed (order-sensitive), so identical prompts get identical
/// generated answers on every worker regardless of routing.
pub fn hash_tokens(seed: u64, tokens: &[u32]) -> u64 {
    let mut h = mix64(seed ^ 0x5851_F42D_4C95_7F2D);
    for &t in tokens {
        h = mix64(h ^ u64::from(t));
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_in_range() {
        let mut a = SimRng::new(7);
        let mut b = SimRng::new(7);
        for _ in 0..1000 {
            assert_eq!(a.next_u64(), b.next_u64());
            let f = a.next_f64();
            b.next_f64();
            assert!((0.0..1.0).contains(&f));
            assert!(a.below(10) < 10);
            b.below(10);
        }
        assert_ne!(SimRng::new(1).next_u64(), SimRng::new(2).next_u64());
        assert_ne!(hash_tokens(0, &[1, 2]), hash_tokens(0, &[2, 1]));
    }
}
