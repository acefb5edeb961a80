//! Seeded random numbers and the few distributions the workload spec needs (exponential,
//! lognormal, geometric, Zipf). Hand-written so a seed gives the same workload on every machine
//! and every build: no crate version can change a benchmark behind our back.

/// SplitMix64: tiny, fast, passes BigCrush; quality is ample for workload shapes.
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator with a fixed seed; equal seeds give equal sequences.
    pub fn new(seed: u64) -> Self {
        Rng {
            state: seed ^ 0x5851_f42d_4c95_7f2d,
        }
    }

    /// An independent stream derived from this seed and a label, so adding draws to one part of
    /// a workload (say, the questions) does not shift another part (the arrival times).
    pub fn fork(seed: u64, label: u64) -> Self {
        let mut r = Rng::new(seed ^ label.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        r.next_u64();
        r
    }

    /// Next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`; 0 when `n == 0`.
    #[inline]
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// Uniform in [0, 1).
    #[inline]
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in (0, 1]: safe to take the logarithm of.
    #[inline]
    fn open_unit(&mut self) -> f64 {
        1.0 - self.unit()
    }

    /// Exponential with the given mean (Poisson inter-arrival gaps).
    pub fn exponential(&mut self, mean: f64) -> f64 {
        -mean * self.open_unit().ln()
    }

    /// Standard normal (Box–Muller; one value per call, the twin is dropped for simplicity).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.open_unit();
        let u2 = self.unit();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Lognormal given its median and σ of the underlying normal, clamped to `[lo, hi]`.
    pub fn lognormal(&mut self, median: f64, sigma: f64, lo: f64, hi: f64) -> f64 {
        (median * (sigma * self.normal()).exp()).clamp(lo, hi)
    }

    /// Number of failures before the first success when the mean is `mean` (geometric on
    /// {0, 1, 2, ...}); 0 when `mean <= 0`.
    pub fn geometric(&mut self, mean: f64) -> u32 {
        if mean <= 0.0 {
            return 0;
        }
        let p = 1.0 / (1.0 + mean);
        let k = (self.open_unit().ln() / (1.0 - p).ln()).floor();
        if k.is_finite() && k >= 0.0 {
            k.min(u32::MAX as f64) as u32
        } else {
            0
        }
    }

    /// Bernoulli trial.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// Fisher–Yates shuffle.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i + 1);
            items.swap(i, j);
        }
    }
}

/// Zipf(α) over `0..n` by inverse CDF on a precomputed table: tenant popularity is drawn once
/// per session, so a binary search over `n` cumulative weights is plenty.
#[derive(Debug, Clone)]
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    /// `alpha == 0` gives the uniform distribution. `n == 0` is treated as 1.
    pub fn new(n: usize, alpha: f64) -> Self {
        let n = n.max(1);
        let mut cdf = Vec::with_capacity(n);
        let mut acc = 0.0;
        for k in 1..=n {
            acc += 1.0 / (k as f64).powf(alpha);
            cdf.push(acc);
        }
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf }
    }

    /// Draw an index in `0..n`; index 0 is the most popular.
    pub fn sample(&self, rng: &mut Rng) -> usize {
        let u = rng.unit();
        self.cdf
            .partition_point(|&c| c <= u)
            .min(self.cdf.len() - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence_and_forks_differ() {
        let a: Vec<u64> = (0..8)
            .map({
                let mut r = Rng::new(42);
                move |_| r.next_u64()
            })
            .collect();
        let b: Vec<u64> = (0..8)
            .map({
                let mut r = Rng::new(42);
                move |_| r.next_u64()
            })
            .collect();
        assert_eq!(a, b);
        assert_ne!(Rng::fork(42, 1).next_u64(), Rng::fork(42, 2).next_u64());
    }

    #[test]
    fn lognormal_median_and_clamp() {
        let mut r = Rng::new(1);
        let mut v: Vec<f64> = (0..20_001)
            .map(|_| r.lognormal(120.0, 1.07, 1.0, 1e9))
            .collect();
        v.sort_by(f64::total_cmp);
        let median = v[v.len() / 2];
        assert!((median - 120.0).abs() < 6.0, "median {median}");
        let mut r = Rng::new(2);
        assert!((0..1000).all(|_| {
            let x = r.lognormal(100.0, 3.0, 50.0, 200.0);
            (50.0..=200.0).contains(&x)
        }));
    }

    #[test]
    fn geometric_and_exponential_means() {
        let mut r = Rng::new(3);
        let n = 40_000;
        let g: f64 = (0..n).map(|_| r.geometric(2.5) as f64).sum::<f64>() / n as f64;
        assert!((g - 2.5).abs() < 0.1, "geometric mean {g}");
        let e: f64 = (0..n).map(|_| r.exponential(0.5)).sum::<f64>() / n as f64;
        assert!((e - 0.5).abs() < 0.02, "exponential mean {e}");
        assert_eq!(r.geometric(0.0), 0);
    }

    #[test]
    fn zipf_prefers_low_ranks() {
        let z = Zipf::new(10, 1.0);
        let mut r = Rng::new(4);
        let mut counts = [0u32; 10];
        for _ in 0..20_000 {
            counts[z.sample(&mut r)] += 1;
        }
        assert!(counts[0] > counts[1] && counts[1] > counts[4] && counts[4] > counts[9]);
        let u = Zipf::new(4, 0.0);
        let mut c = [0u32; 4];
        for _ in 0..8000 {
            c[u.sample(&mut r)] += 1;
        }
        assert!(c.iter().all(|&x| (1700..2300).contains(&x)), "{c:?}");
    }
}
