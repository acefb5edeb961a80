//! GPU forward cost model (H100 SXM, Llama-3.1-8B BF16, TP1) from the simulator reference §3.
//!
//! Prefill is compute-bound (GEMMs plus attention growing with context), decode memory-bound
//! (weights plus KV read per step). The constants are public so experiments can model other
//! hardware; `fixed_step_ms` replaces the model with a constant per forward for tests that need
//! exact SSE pacing.

use crate::rng::Rng;

/// One request's share of a prefill forward: `uncached` new tokens computed after `context`
/// tokens already present (cached prefix or earlier chunks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillItem {
    /// Tokens computed in this forward (`u_i`).
    pub uncached: usize,
    /// Tokens before them (`c_i`).
    pub context: usize,
}

/// Forward durations in virtual milliseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct CostModel {
    /// Fixed overhead of a prefill forward (launch, sampling, scheduling), ms.
    pub prefill_base_ms: f64,
    /// GEMM throughput `P`, tokens per ms.
    pub prefill_tokens_per_ms: f64,
    /// Context length at which attention doubles a token's cost (attention at ~half GEMM
    /// efficiency).
    pub attention_tokens: f64,
    /// Host-tier load-back throughput, tokens per ms: a prefix page found only in host memory
    /// (HiCache) is copied back to the GPU instead of recomputed.
    pub host_load_tokens_per_ms: f64,
    /// Fixed cost of a decode step (weights read), ms.
    pub decode_base_ms: f64,
    /// Per running request, ms.
    pub decode_per_req_ms: f64,
    /// Per 1000 context tokens across the batch (KV read), ms.
    pub decode_per_kctx_ms: f64,
    /// Relative jitter: each forward is scaled by a uniform factor in `[1 − j, 1 + j]`.
    pub jitter: f64,
    /// When set, every forward (prefill or decode) takes exactly this long and there is no
    /// jitter: tokens are paced at a known interval.
    pub fixed_step_ms: Option<f64>,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            prefill_base_ms: 8.0,
            prefill_tokens_per_ms: 30.0,
            attention_tokens: 15000.0,
            // Llama-3.1-8B keeps K and V for 32 layers × 8 KV heads × 128 dims in BF16:
            // 2 × 32 × 8 × 128 × 2 B = 128 KiB per token. The H100 SXM's host link is PCIe Gen5
            // x16, 64 GB/s raw; pinned host-to-device copies reach about 50 GB/s, so a token
            // loads in 131 072 B / 50 GB/s ≈ 2.6 µs: ~380 tokens/ms, 12.7× the 30 tokens/ms of
            // prefill GEMMs (before attention makes recomputing dearer still). SGLang overlaps
            // the copy layer by layer with the forward; charging all of it is the conservative
            // end.
            host_load_tokens_per_ms: 380.0,
            decode_base_ms: 6.2,
            decode_per_req_ms: 0.02,
            decode_per_kctx_ms: 0.05,
            jitter: 0.05,
            fixed_step_ms: None,
        }
    }
}

impl CostModel {
    /// `8 + Σ u_i·(1 + (c_i + u_i/2)/15000) / P`, without jitter.
    pub fn prefill_ms(&self, items: &[PrefillItem]) -> f64 {
        if let Some(ms) = self.fixed_step_ms {
            return ms;
        }
        let work: f64 = items
            .iter()
            .map(|it| {
                let u = it.uncached as f64;
                u * (1.0 + (it.context as f64 + u / 2.0) / self.attention_tokens)
            })
            .sum();
        self.prefill_base_ms + work / self.prefill_tokens_per_ms
    }

    /// Loading `tokens` back from host memory, ms, without jitter (added to the prefill forward
    /// that needs them; nothing with `fixed_step_ms`, whose forwards take exactly that long).
    pub fn host_load_ms(&self, tokens: usize) -> f64 {
        if self.fixed_step_ms.is_some() || tokens == 0 {
            return 0.0;
        }
        tokens as f64 / self.host_load_tokens_per_ms
    }

    /// `6.2 + 0.02·B + 0.05·Σctx/1000`, without jitter.
    pub fn decode_ms(&self, batch: usize, context_tokens: usize) -> f64 {
        if let Some(ms) = self.fixed_step_ms {
            return ms;
        }
        self.decode_base_ms
            + self.decode_per_req_ms * batch as f64
            + self.decode_per_kctx_ms * context_tokens as f64 / 1000.0
    }

    /// Apply the seeded jitter to a duration (no-op with `fixed_step_ms` or zero jitter).
    pub fn jitter(&self, ms: f64, rng: &mut Rng) -> f64 {
        if self.fixed_step_ms.is_some() || self.jitter <= 0.0 {
            return ms;
        }
        ms * (1.0 + self.jitter * (2.0 * rng.next_f64() - 1.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol
    }

    #[test]
    fn reference_consequences() {
        let m = CostModel::default();
        // 20k-token miss ≈ 1.1 s.
        let miss = m.prefill_ms(&[PrefillItem {
            uncached: 20_000,
            context: 0,
        }]);
        assert!(close(
            miss,
            8.0 + 20_000.0 * (1.0 + 10_000.0 / 15_000.0) / 30.0,
            1e-9
        ));
        assert!((1000.0..1200.0).contains(&miss), "{miss}");
        // 20k cached + 100 new ≈ 16 ms (≈70× faster).
        let hit = m.prefill_ms(&[PrefillItem {
            uncached: 100,
            context: 20_000,
        }]);
        assert!((11.0..17.0).contains(&hit), "{hit}");
        assert!(miss / hit > 65.0);
        // 2k miss ≈ 79 ms.
        let two_k = m.prefill_ms(&[PrefillItem {
            uncached: 2000,
            context: 0,
        }]);
        assert!(close(two_k, 79.6, 1.0), "{two_k}");
        // Batch = sum of the items.
        let both = m.prefill_ms(&[
            PrefillItem {
                uncached: 2000,
                context: 0,
            },
            PrefillItem {
                uncached: 100,
                context: 20_000,
            },
        ]);
        assert!(close(both, two_k + hit - 8.0, 1e-9));
        // B=64×4k ctx ≈ 20 ms, B=256×2k ≈ 37 ms.
        assert!(close(
            m.decode_ms(64, 64 * 4096),
            6.2 + 1.28 + 13.1072,
            1e-9
        ));
        assert!(close(
            m.decode_ms(256, 256 * 2048),
            6.2 + 5.12 + 26.2144,
            1e-9
        ));
    }

    #[test]
    fn host_load_is_an_order_of_magnitude_cheaper_than_recomputing() {
        let m = CostModel::default();
        // 20k tokens from host ≈ 53 ms against ≈ 1.1 s to recompute them.
        let load = m.host_load_ms(20_000);
        assert!(close(load, 20_000.0 / 380.0, 1e-9));
        let recompute = m.prefill_ms(&[PrefillItem {
            uncached: 20_000,
            context: 0,
        }]) - m.prefill_base_ms;
        assert!(recompute / load > 12.0, "{recompute} vs {load}");
        assert_eq!(m.host_load_ms(0), 0.0);
        let f = CostModel {
            fixed_step_ms: Some(20.0),
            ..CostModel::default()
        };
        assert_eq!(f.host_load_ms(20_000), 0.0);
    }

    #[test]
    fn jitter_bounds_and_fixed_step() {
        let m = CostModel::default();
        let mut rng = Rng::new(3);
        for _ in 0..1000 {
            let j = m.jitter(100.0, &mut rng);
            assert!((95.0..=105.0).contains(&j));
        }
        let f = CostModel {
            fixed_step_ms: Some(20.0),
            ..CostModel::default()
        };
        assert_eq!(
            f.prefill_ms(&[PrefillItem {
                uncached: 50_000,
                context: 0
            }]),
            20.0
        );
        assert_eq!(f.decode_ms(256, 1 << 20), 20.0);
        assert_eq!(f.jitter(20.0, &mut rng), 20.0);
    }
}
