//! The overload workload's command-line flags, flattened into `loadgen`'s own (they apply with
//! `--workload overload`; `--target`, `--duration`, `--drain`, `--seed`, `--model` and
//! `--max-inflight` come from the common flags).

use clap::Args;

use super::{BatchParams, InteractiveParams, OverloadConfig, Tenant};

/// `LO-HI` (or one number for both) as an inclusive range.
fn range<T: std::str::FromStr + PartialOrd + Copy>(s: &str) -> Result<(T, T), String> {
    let one = |x: &str| {
        x.trim()
            .parse::<T>()
            .map_err(|_| format!("bad number {x:?} in {s:?}"))
    };
    let (lo, hi) = match s.split_once('-') {
        Some((a, b)) => (one(a)?, one(b)?),
        None => {
            let v = one(s)?;
            (v, v)
        }
    };
    if hi < lo {
        return Err(format!("empty range {s:?}"));
    }
    Ok((lo, hi))
}

fn u32_range(s: &str) -> Result<(u32, u32), String> {
    range::<u32>(s)
}

fn f64_range(s: &str) -> Result<(f64, f64), String> {
    let r = range::<f64>(s)?;
    if r.0 < 0.0 || !r.1.is_finite() {
        return Err(format!("{s:?}: seconds must be finite and >= 0"));
    }
    Ok(r)
}

/// Flags of `--workload overload`.
#[derive(Debug, Clone, Args)]
pub struct OverloadArgs {
    /// Start of the measurement window (goodput, server samples), seconds into the run
    /// (default: a quarter of --duration).
    #[arg(long, help_heading = "overload")]
    pub warmup: Option<f64>,
    /// Interactive chat sessions started per second (Poisson); 0: none.
    #[arg(long, default_value_t = InteractiveParams::default().session_rate, help_heading = "overload")]
    pub interactive_rate: f64,
    /// Interactive tenant's API key (Authorization: Bearer).
    #[arg(long, default_value = "interactive-key", help_heading = "overload")]
    pub interactive_key: String,
    /// Interactive tenant's priority (X-SMG-Priority and the body's priority).
    #[arg(
        long,
        default_value_t = 10,
        allow_negative_numbers = true,
        help_heading = "overload"
    )]
    pub interactive_priority: i64,
    /// Turns per interactive session, LO-HI.
    #[arg(long, default_value = "2-4", value_parser = u32_range, help_heading = "overload")]
    pub interactive_turns: (u32, u32),
    /// Interactive question length, tokens, LO-HI.
    #[arg(long, default_value = "30-150", value_parser = u32_range, help_heading = "overload")]
    pub interactive_question_tokens: (u32, u32),
    /// Interactive answer length, tokens, LO-HI.
    #[arg(long, default_value = "32-96", value_parser = u32_range, help_heading = "overload")]
    pub interactive_answer_tokens: (u32, u32),
    /// The interactive tenant's shared system prompt, tokens.
    #[arg(long, default_value_t = InteractiveParams::default().system_tokens, help_heading = "overload")]
    pub interactive_system_tokens: u32,
    /// Think time between an answer and the next question, seconds, LO-HI.
    #[arg(long, default_value = "1-3", value_parser = f64_range, help_heading = "overload")]
    pub interactive_think: (f64, f64),
    /// Interactive request timeout, seconds from the intended send time.
    #[arg(long, default_value_t = 30.0, help_heading = "overload")]
    pub interactive_timeout: f64,
    /// Batch requests per second (Poisson); 0: none (unless --batch-concurrency).
    #[arg(long, default_value_t = 0.0, help_heading = "overload")]
    pub batch_rate: f64,
    /// Closed loop of N batch users instead of --batch-rate (to measure the fleet's capacity).
    #[arg(long, default_value_t = 0, help_heading = "overload")]
    pub batch_concurrency: usize,
    /// Closed loop: start the users evenly over this many seconds.
    #[arg(long, default_value_t = 0.0, help_heading = "overload")]
    pub batch_ramp: f64,
    /// Batch tenant's API key.
    #[arg(long, default_value = "batch-key", help_heading = "overload")]
    pub batch_key: String,
    /// Batch tenant's priority.
    #[arg(
        long,
        default_value_t = 0,
        allow_negative_numbers = true,
        help_heading = "overload"
    )]
    pub batch_priority: i64,
    /// Batch prompt length, tokens, LO-HI.
    #[arg(long, default_value = "4000-8000", value_parser = u32_range, help_heading = "overload")]
    pub batch_prompt_tokens: (u32, u32),
    /// Batch output length, tokens, LO-HI.
    #[arg(long, default_value = "128-384", value_parser = u32_range, help_heading = "overload")]
    pub batch_output_tokens: (u32, u32),
    /// Batch request timeout, seconds from the intended send time.
    #[arg(long, default_value_t = 60.0, help_heading = "overload")]
    pub batch_timeout: f64,
    /// Leave SGLang's `priority` out of the bodies (the header still carries it).
    #[arg(long, help_heading = "overload")]
    pub no_body_priority: bool,
    /// Workers whose /metrics are sampled during the run (comma-separated base URLs).
    #[arg(long, value_delimiter = ',', help_heading = "overload")]
    pub sample_workers: Vec<String>,
    /// Seconds between samples.
    #[arg(long, default_value_t = 1.0, help_heading = "overload")]
    pub sample_interval: f64,
    /// The workers' --time-scale (their idle counter runs on the virtual clock).
    #[arg(long, default_value_t = 1.0, help_heading = "overload")]
    pub sim_time_scale: f64,
}

/// The common flags an overload run takes from `loadgen`'s own.
#[derive(Debug, Clone)]
pub struct Common {
    /// `--target`.
    pub target: String,
    /// `--model`.
    pub model: String,
    /// `--duration`.
    pub duration_s: f64,
    /// `--drain`.
    pub drain_s: f64,
    /// `--seed`.
    pub seed: u64,
    /// `--max-inflight`.
    pub max_inflight: usize,
}

impl OverloadArgs {
    /// The run these flags (and the common ones) describe.
    pub fn config(&self, c: Common) -> OverloadConfig {
        let d = OverloadConfig::default();
        OverloadConfig {
            warmup_s: self.warmup.unwrap_or(c.duration_s / 4.0),
            target: c.target,
            model: c.model,
            duration_s: c.duration_s,
            drain_s: c.drain_s,
            seed: c.seed,
            max_inflight: c.max_inflight,
            body_priority: !self.no_body_priority,
            interactive: InteractiveParams {
                tenant: Tenant {
                    api_key: self.interactive_key.clone(),
                    priority: self.interactive_priority,
                    request_timeout_s: self.interactive_timeout,
                },
                session_rate: self.interactive_rate,
                min_turns: self.interactive_turns.0,
                max_turns: self.interactive_turns.1,
                system_tokens: self.interactive_system_tokens,
                question_tokens: self.interactive_question_tokens,
                answer_tokens: self.interactive_answer_tokens,
                think_s: self.interactive_think,
                ..d.interactive
            },
            batch: BatchParams {
                tenant: Tenant {
                    api_key: self.batch_key.clone(),
                    priority: self.batch_priority,
                    request_timeout_s: self.batch_timeout,
                },
                rate: self.batch_rate,
                concurrency: self.batch_concurrency,
                ramp_s: self.batch_ramp,
                prompt_tokens: self.batch_prompt_tokens,
                output_tokens: self.batch_output_tokens,
                ..d.batch
            },
            workers: self.sample_workers.clone(),
            sample_interval_s: self.sample_interval,
            sim_time_scale: self.sim_time_scale,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_single_values_and_refuse_empty_ones() {
        assert_eq!(u32_range("4000-8000"), Ok((4000, 8000)));
        assert_eq!(u32_range("7"), Ok((7, 7)));
        assert!(u32_range("9-3").is_err());
        assert!(u32_range("a-3").is_err());
        assert_eq!(f64_range("0.5-2"), Ok((0.5, 2.0)));
        assert!(f64_range("inf").is_err());
    }
}
