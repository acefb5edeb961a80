//! cache_aware: send a request to a worker that already holds its prefix, unless the fleet is
//! out of balance. It exists because a prompt whose prefix a server already holds skips that
//! much prefill, and chat traffic repeats its prefixes (system prompts, earlier turns): routing
//! on a radix tree of what was sent where turns those repeats into cache hits, while the
//! balance test keeps affinity from piling work on one server. The algorithm is
//! sgl-model-gateway's `select_worker` (0.3.2) with its tie-breaking bugs fixed:
//!
//! 1. Over eligible, non-excluded workers compute (min, max) in-flight. **Imbalanced** when
//!    `max − min > balance_abs_threshold` AND `max > min × balance_rel_threshold` (both strict)
//!    → the least-loaded worker, random among ties (the reference takes the *first*).
//! 2. Otherwise `match_rate = matched_chars / request_chars` (0 for empty text). Strictly above
//!    `cache_threshold` → the least loaded of the workers holding the deepest matched position
//!    (random among ties; the reference returns an arbitrary holder). If no holder is eligible,
//!    it is a miss.
//! 3. Miss → least-loaded eligible worker, random among ties (the reference's "first minimum"
//!    sent every miss to worker 0 at low concurrency).
//!
//! Every branch that picks a worker asks for the text to be inserted under it (the reference
//! inserts on the imbalanced branch too). No tree for the model → a miss.
//!
//! Opt-in `affinity_window`: when imbalanced and the match rate is above threshold, a prefix
//! holder whose load is at most `min + balance_abs_threshold` still wins. The tree reports only
//! the holders of the deepest matched position, so holders of a shorter prefix are not
//! considered.
use crate::base::rng::Rng;
use crate::base::text::char_count;
use crate::base::WorkerId;
use crate::route::policy::Select;
use crate::route::recent::RecentProbe;
use crate::route::types::{Branch, Decision, ExactInput, PolicyConfig, RouteInput};
use crate::tree::RadixTree;
use crate::workers::load::LoadBoard;

/// The cache_aware policy: its knobs; the tree it reads is the gateway's, handed to each call.
#[derive(Debug, Default)]
pub struct CacheAware {
    params: Params,
}

impl Select for CacheAware {
    fn from_config(cfg: &PolicyConfig) -> Self {
        CacheAware {
            params: Params::from_config(cfg),
        }
    }

    /// The text tree's match alone, or with `--kv-events` the better of it and the servers'
    /// own token counts ([`select_mixed`]).
    fn select(
        &self,
        input: &RouteInput,
        workers: &[WorkerId],
        loads: &LoadBoard,
        tree: Option<&RadixTree>,
        rng: &mut Rng,
    ) -> Option<Decision> {
        let prefix = Lookup {
            text: input.text,
            tree,
            recent: input.recent,
        };
        let p = &self.params;
        let exclude = input.exclude;
        match input.exact {
            Some(exact) => select_mixed(p, exact, prefix, workers, exclude, loads, rng),
            None => select_with_tree(p, prefix, workers, exclude, loads, rng),
        }
    }

    fn needs_tree(&self) -> bool {
        true
    }

    fn reads_text(&self) -> bool {
        true
    }
}

/// The cache_aware knobs, copied out of `PolicyConfig` once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Params {
    /// Match rate strictly above which affinity wins.
    pub cache_threshold: f64,
    /// Imbalance needs `max − min >` this …
    pub balance_abs_threshold: u32,
    /// … and `max >` this × `min`.
    pub balance_rel_threshold: f64,
    /// See the module docs.
    pub affinity_window: bool,
}

impl Params {
    /// The cache_aware part of a policy configuration.
    pub fn from_config(cfg: &PolicyConfig) -> Self {
        Params {
            cache_threshold: cfg.cache_threshold,
            balance_abs_threshold: cfg.balance_abs_threshold,
            balance_rel_threshold: cfg.balance_rel_threshold,
            affinity_window: cfg.affinity_window,
        }
    }

    /// The reference's imbalance test: both gaps strictly exceeded.
    #[inline]
    pub fn is_imbalanced(&self, min: u32, max: u32) -> bool {
        max.saturating_sub(min) > self.balance_abs_threshold
            && max as f64 > min as f64 * self.balance_rel_threshold
    }
}

impl Default for Params {
    fn default() -> Self {
        Params::from_config(&PolicyConfig::default())
    }
}

/// A longest-prefix match result, decoupled from the tree so the decision logic is testable
/// (and benchable) alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatchResult<'a> {
    /// Characters of the request found in the tree.
    pub matched_chars: usize,
    /// Characters in the whole request text.
    pub request_chars: usize,
    /// Workers holding the deepest matched position.
    pub workers: &'a [WorkerId],
}

impl MatchResult<'_> {
    /// matched / request characters; 0 for an empty request.
    #[inline]
    pub fn rate(&self) -> f64 {
        if self.request_chars == 0 {
            0.0
        } else {
            self.matched_chars as f64 / self.request_chars as f64
        }
    }
}

/// (min, max) in-flight over eligible workers not in `exclude`. Without exclusions this is the
/// board's O(levels) aggregate; with them (retries only) an exact pass over `workers`.
pub fn min_max_excluding(
    workers: &[WorkerId],
    exclude: &[WorkerId],
    loads: &LoadBoard,
) -> Option<(u32, u32)> {
    // Small fleets: one exact pass over the loads (a few ns a worker) is cheaper than the
    // level counts and never sees a transient state between two cores' updates. Large fleets:
    // the level counts, O(levels between min and max).
    if exclude.is_empty() && workers.len() > EXACT_SCAN_WORKERS {
        return loads.min_max();
    }
    workers
        .iter()
        .copied()
        .filter(|&w| loads.selectable(w, exclude))
        .map(|w| loads.load(w))
        .fold(None, |acc, l| match acc {
            None => Some((l, l)),
            Some((lo, hi)) => Some((lo.min(l), hi.max(l))),
        })
}

/// Fleets up to this size get an exact min/max scan.
pub const EXACT_SCAN_WORKERS: usize = 64;

/// A decision that asks for the text to be inserted under the chosen worker; `m` is the match
/// it was made with (`None`: not looked up), which says how much the chosen worker holds.
#[inline]
fn decided(worker: WorkerId, branch: Branch, m: Option<&MatchResult<'_>>) -> Decision {
    let matched_chars = m.map_or(0, |m| m.matched_chars);
    let held = m.is_some_and(|m| m.workers.contains(&worker));
    Decision {
        worker,
        branch,
        insert_text: true,
        matched_chars,
        predicted_chars: if held { matched_chars } else { 0 },
        request_size: m.map_or(0, |m| m.request_chars),
    }
}

/// The cache_aware decision. `lookup` runs the tree match (only when the decision needs it:
/// an imbalanced fleet without the affinity window skips it); `None` means no tree for the
/// model.
pub fn select<'t>(
    p: &Params,
    workers: &[WorkerId],
    exclude: &[WorkerId],
    loads: &LoadBoard,
    rng: &mut Rng,
    lookup: impl FnOnce() -> Option<MatchResult<'t>>,
) -> Option<Decision> {
    let (min, max) = min_max_excluding(workers, exclude, loads)?;
    if p.is_imbalanced(min, max) {
        let mut looked = None;
        if p.affinity_window {
            if let Some(m) = lookup() {
                if m.rate() > p.cache_threshold {
                    let window = min.saturating_add(p.balance_abs_threshold);
                    if let Some(w) = loads
                        .pick_least_loaded(m.workers, exclude, rng)
                        .filter(|&w| loads.load(w) <= window)
                    {
                        return Some(decided(w, Branch::AffinityWindow, Some(&m)));
                    }
                }
                looked = Some(m);
            }
        }
        let w = loads.pick_least_loaded(workers, exclude, rng)?;
        return Some(decided(w, Branch::Imbalanced, looked.as_ref()));
    }
    let Some(m) = lookup() else {
        let w = loads.pick_least_loaded(workers, exclude, rng)?;
        return Some(decided(w, Branch::CacheMiss, None));
    };
    if m.rate() > p.cache_threshold {
        if let Some(w) = loads.pick_least_loaded(m.workers, exclude, rng) {
            return Some(decided(w, Branch::CacheHit, Some(&m)));
        }
    }
    let w = loads.pick_least_loaded(workers, exclude, rng)?;
    Some(decided(w, Branch::CacheMiss, Some(&m)))
}

/// Where one request's prefix is looked up: its routing text, its model's tree in the current
/// snapshot (`None`: no tree for that model yet), and the best match among the inserts the
/// snapshot does not show yet.
#[derive(Debug, Clone, Copy)]
pub struct Lookup<'a> {
    /// The routing text.
    pub text: &'a str,
    /// The model's tree.
    pub tree: Option<&'a RadixTree>,
    /// The unpublished inserts (from every core), asked only for more than the tree matched.
    pub recent: Option<RecentProbe<'a>>,
}

/// The thin wrapper the policy calls: match the text against the tree and the unpublished
/// inserts, then decide.
pub fn select_with_tree(
    p: &Params,
    prefix: Lookup<'_>,
    workers: &[WorkerId],
    exclude: &[WorkerId],
    loads: &LoadBoard,
    rng: &mut Rng,
) -> Option<Decision> {
    let mut recent_holder = [0];
    select(p, workers, exclude, loads, rng, || {
        text_match(prefix, &mut recent_holder)
    })
}

/// The text tree's match, as a (matched, request) pair in characters with its holders:
/// unpublished inserts (from any core) win when they match more of the request (their worker
/// is then written into `recent_holder`, which the result borrows).
fn text_match<'t>(
    prefix: Lookup<'t>,
    recent_holder: &'t mut [WorkerId; 1],
) -> Option<MatchResult<'t>> {
    let Lookup { text, tree, recent } = prefix;
    let from_tree = tree.map(|t| t.longest_match(text));
    let tree_bytes = from_tree.as_ref().map_or(0, |m| m.matched_bytes);
    if let Some(r) = recent.and_then(|p| p.beyond(text, tree_bytes)) {
        recent_holder[0] = r.worker;
        return Some(MatchResult {
            matched_chars: r.matched_chars,
            request_chars: request_chars(text, r.matched_bytes, r.matched_chars),
            workers: &recent_holder[..],
        });
    }
    // Counted only when something matched (a miss on a model without a tree pays nothing).
    let m = from_tree?;
    Some(MatchResult {
        matched_chars: m.matched_chars,
        request_chars: request_chars(text, m.matched_bytes, m.matched_chars),
        workers: m.workers,
    })
}

/// Characters of `text` whose first `matched_bytes` bytes hold `matched_chars` characters:
/// only the unmatched rest is counted, so a prompt matched whole (the steady state of repeated
/// prompts) is not walked again.
fn request_chars(text: &str, matched_bytes: usize, matched_chars: usize) -> usize {
    matched_chars + text.as_bytes().get(matched_bytes..).map_or(0, char_count)
}

/// cache_aware with KV events: the same decision as [`select`], with the match measured in
/// tokens the servers report (index ∪ pending entries) for the workers whose events are
/// complete, and in characters of the text tree for the others. The better rate wins (equal
/// rates: the holders of both); the thresholds, the imbalance test and the random ties are the
/// seed's. `matched_chars` of the decision then counts tokens when the exact side won.
pub fn select_mixed(
    p: &Params,
    exact: ExactInput<'_>,
    prefix: Lookup<'_>,
    workers: &[WorkerId],
    exclude: &[WorkerId],
    loads: &LoadBoard,
    rng: &mut Rng,
) -> Option<Decision> {
    // The buffer stays borrowed for the decision only; nothing else on this core routes
    // meanwhile (no await in between).
    let Ok(mut buf) = exact.holders.try_borrow_mut() else {
        return select_with_tree(p, prefix, workers, exclude, loads, rng);
    };
    let holders: &mut Vec<WorkerId> = &mut buf;
    // With every worker scored by events the text tree cannot win (its holders are only the
    // workers without events): its walk of the prompt is skipped.
    let all_exact = workers
        .iter()
        .all(|w| exact.exact_workers.binary_search(w).is_ok());
    let mut recent_holder = [0];
    select(p, workers, exclude, loads, rng, || {
        let text = if all_exact {
            None
        } else {
            text_match(prefix, &mut recent_holder)
        };
        let best = mixed_holders(exact, text, holders);
        let holders: &Vec<WorkerId> = holders;
        best.map(|(matched, request)| MatchResult {
            matched_chars: matched,
            request_chars: request,
            workers: holders,
        })
    })
}

/// The winning side's holders into `holders`, and its (matched, request) sizes.
pub fn mixed_holders(
    exact: ExactInput<'_>,
    text: Option<MatchResult<'_>>,
    holders: &mut Vec<WorkerId>,
) -> Option<(usize, usize)> {
    holders.clear();
    let best_tokens = exact.cached.iter().map(|&(_, n)| n).max().unwrap_or(0);
    let exact_rate = if exact.prompt_tokens == 0 {
        0.0
    } else {
        best_tokens as f64 / exact.prompt_tokens as f64
    };
    let text_side = text.map(|m| {
        let cold = m
            .workers
            .iter()
            .copied()
            .filter(|w| exact.exact_workers.binary_search(w).is_err());
        (m, cold)
    });
    let mut text_rate = 0.0;
    let mut text_sizes = (0, 0);
    if let Some((m, cold)) = text_side {
        let before = holders.len();
        holders.extend(cold);
        if holders.len() > before && m.matched_chars > 0 {
            text_rate = m.rate();
            text_sizes = (m.matched_chars, m.request_chars);
        } else {
            holders.truncate(before);
        }
    }
    if text_rate > exact_rate {
        return Some(text_sizes);
    }
    if text_rate < exact_rate {
        holders.clear();
    }
    if best_tokens > 0 {
        holders.extend(
            exact
                .cached
                .iter()
                .filter(|&&(_, n)| n == best_tokens)
                .map(|&(w, _)| w),
        );
        return Some((best_tokens, exact.prompt_tokens));
    }
    if holders.is_empty() {
        // Nothing matched anywhere: a miss, measured in tokens when there are tokens.
        return Some((0, exact.prompt_tokens.max(text_sizes.1)));
    }
    Some(text_sizes)
}

#[cfg(test)]
mod tests;
