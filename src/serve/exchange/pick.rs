//! Phase *pick*: the policy's choice of a worker on one [`Lane`], its circuit admitting,
//! counted in flight, and the routing text learned.

use super::{Exchange, Forwarding};
use crate::base::text::SharedText;
use crate::base::WorkerId;
use crate::gateway::kv_routing::{Fallback, KvRouting, KvScratch};
use crate::gateway::requests::IdKey;
use crate::gateway::{Gateway, Router};
use crate::route::extract::RoutingText;
use crate::route::types::{Branch, Decision, ExactInput, PolicyKind, RouteInput};
use crate::serve::error::GatewayError;
use crate::trace::span::now_ns;
use crate::workers::registry::{CircuitSlot, Worker};
use crate::workers::role::Side;
use bytes::Bytes;
use std::sync::Arc;

/// One side of the fleet a request is picked on: every worker, or in PD mode the prefill or the
/// decode workers, each with its own router, and the workers that already failed this request
/// there (every retry goes elsewhere; the reference retries the worker its tree points at, the
/// failing one).
pub(in crate::serve) struct Lane<'a> {
    pub(super) side: Side,
    pub(super) router: &'a Router,
    pub(super) excluded: Vec<WorkerId>,
}

impl<'a> Lane<'a> {
    /// The lane of `side`, picked by `router`.
    pub(in crate::serve) fn new(side: Side, router: &'a Router) -> Lane<'a> {
        Lane {
            side,
            router,
            excluded: Vec::new(),
        }
    }

    /// Whether this lane's workers compute the prompt (all but PD's decode side): they are the
    /// ones measured against the KV-event index, named by `x-smg-target-worker`, and predicted.
    fn computes_prompt(&self) -> bool {
        self.side != Side::Decode
    }
}

/// The worker chosen for one attempt, counted in flight until dropped; its circuit slot records
/// the outcome at most once and frees a half-open probe slot on every path.
pub(in crate::serve) struct Picked<'a> {
    /// First field, so dropped first: the in-flight count is down before the last `Arc` of a
    /// removed worker goes (its id may be reused from then on).
    _in_flight: InFlight<'a>,
    pub(in crate::serve) worker: Arc<Worker>,
    pub(super) slot: CircuitSlot,
    pub(super) decision: Decision,
}

/// Keeps a worker's in-flight count raised while a request is on it, and tells the policy when
/// the request is over, on every path (success, retry, error, client gone).
/// The request id is registered as held by the worker meanwhile (`/abort_request` finds it).
struct InFlight<'a> {
    gw: &'a Gateway,
    /// The router whose policy picked the worker (PD mode: the prefill or the decode side's).
    router: &'a Router,
    worker: WorkerId,
    routing_key: Option<&'a [u8]>,
    /// The request id's key, when the id map took it.
    id: Option<IdKey>,
}

impl<'a> InFlight<'a> {
    fn new(
        gw: &'a Gateway,
        router: &'a Router,
        worker: WorkerId,
        routing_key: Option<&'a [u8]>,
        id: IdKey,
    ) -> Self {
        gw.registry.loads.inc(worker);
        let id = gw.in_flight_ids.insert(id, worker).then_some(id);
        InFlight {
            gw,
            router,
            worker,
            routing_key,
            id,
        }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            self.gw.in_flight_ids.remove(id);
        }
        self.gw.registry.loads.dec(self.worker);
        let now = self.gw.life.now_ms();
        self.router
            .policy
            .request_finished(self.routing_key, self.worker, now);
    }
}

/// A policy's decision with what came with it.
struct Choice {
    decision: Decision,
    /// The tree snapshot's epoch the policy saw.
    epoch: u64,
    /// The prompt's token count when it was measured against the KV-event index (its block
    /// chain is then in this core's scratch).
    measured: Option<usize>,
}

impl<'a> Exchange<'a> {
    /// Phase *pick* on `lane`: the policy's choice among that lane's workers not yet failed by
    /// this request, its circuit admitting, counted in flight. The routing text is learned
    /// now, as the reference does, so requests arriving while this one is in prefill (a burst
    /// sharing a system prompt) already follow it. With KV events, the lane that computes the
    /// prompt is chosen on the measured prompt.
    pub(in crate::serve) fn pick_on(
        &mut self,
        lane: &mut Lane<'a>,
    ) -> Result<Picked<'a>, GatewayError> {
        let started_ns = self.traced().then(now_ns);
        let picked = self.pick_untraced(lane);
        if let Some(start) = started_ns {
            self.traced_pick(lane, start, &picked);
        }
        picked
    }

    /// [`Exchange::pick_on`] without its span.
    fn pick_untraced(&mut self, lane: &mut Lane<'a>) -> Result<Picked<'a>, GatewayError> {
        let gw = self.gw;
        let mut recycled = false;
        loop {
            let list = gw.registry.load_full();
            let ids = list.ids_on(lane.side);
            let now_ms = gw.life.now_ms();
            let Some(choice) = self.choose(lane, ids, now_ms) else {
                let after_a_failure = self.last_error.is_some();
                if recycle_exclusions(&mut lane.excluded, after_a_failure, &mut recycled) {
                    continue;
                }
                let none = ids.is_empty();
                return Err(self.last_error.take().unwrap_or_else(|| match lane.side {
                    Side::Any => GatewayError::no_workers(list.is_empty()),
                    side => GatewayError::no_workers_on(side.name(), none),
                }));
            };
            let worker = choice.decision.worker;
            // Gone since the snapshot, or half-open with its probe slots taken: try another.
            let slot = list
                .get(worker)
                .filter(|w| lane.side.takes(w.role))
                .and_then(|w| w.admit(&gw.breaker));
            let Some(slot) = slot else {
                lane.router
                    .policy
                    .request_finished(self.routing_key, worker, now_ms);
                lane.excluded.push(worker);
                continue;
            };
            return Ok(self.take(lane, slot, choice, now_ms));
        }
    }

    /// The chosen worker, its circuit slot taken: counted in flight and as KV in use by the
    /// saturation admission, and the prompt learned for it.
    fn take(&self, lane: &Lane<'a>, slot: CircuitSlot, choice: Choice, now_ms: u64) -> Picked<'a> {
        let gw = self.gw;
        let worker = slot.worker().clone();
        let router = lane.router;
        crate::metrics::selection(
            router.policy.kind().as_str(),
            choice.decision.branch.as_str(),
        );
        let in_flight = InFlight::new(gw, router, worker.id, self.routing_key, self.id_key);
        if let Some(fc) = &gw.flow {
            fc.saturation.sent(worker.id, self.admitted_tokens);
        }
        if choice.decision.insert_text {
            self.learn_prompt(lane, &choice, worker.id, now_ms);
        }
        Picked {
            worker,
            slot,
            decision: choice.decision,
            _in_flight: in_flight,
        }
    }

    /// The prompt learned for `worker`: the text tree's insert (unless it holds all of it
    /// already) and, when measured against the KV-event index, its blocks as pending there.
    fn learn_prompt(&self, lane: &Lane<'a>, choice: &Choice, worker: WorkerId, now_ms: u64) {
        let gw = self.gw;
        let decision = &choice.decision;
        if self.attempts == 0 && lane.computes_prompt() {
            // The prediction beside the hit ratio the engines report (first try only, where
            // the prompt is computed), in the decision's own unit: tokens when the prompt was
            // measured against the KV-event index, else characters (counted once, by the
            // match).
            let size = match (decision.request_size, choice.measured) {
                (0, Some(tokens)) => tokens,
                (0, None) => crate::base::text::char_count(self.info.text.as_bytes()),
                (n, _) => n,
            };
            crate::metrics::predicted_hit(decision.predicted_chars, size);
        }
        let measured = choice.measured.is_some();
        if already_held(decision, measured) {
            // The tree (or an unpublished insert) already has all of it under this worker:
            // an insert would re-walk and path-copy the prompt for nothing.
            crate::metrics::insert_skipped();
        } else {
            let text = learned_text(self.body, &self.info.text);
            lane.router
                .learn(self.tree, text, worker, choice.epoch, now_ms);
        }
        if let (true, Some(kv)) = (measured, &gw.kv) {
            // The prompt's chain is still in this core's scratch: nothing awaited since.
            let s = self.core.kv.borrow();
            if !s.holds_all(worker) {
                kv.pending.push(s.model_hash, worker, s.chain(), now_ms);
            }
        }
    }

    /// `lane`'s decision among `workers` (routed) or any selectable worker (pass-through).
    fn choose(&self, lane: &Lane<'_>, workers: &[WorkerId], now_ms: u64) -> Option<Choice> {
        let gw = self.gw;
        let rng = &mut self.core.rng.borrow_mut();
        let exclude = &lane.excluded;
        if self.forwarding == Forwarding::PassThrough {
            let w = gw
                .registry
                .loads
                .pick_random_eligible(workers, exclude, rng);
            return w.map(|w| Choice {
                decision: Decision::plain(w, Branch::Random),
                epoch: 0,
                measured: None,
            });
        }
        let router = lane.router;
        let mut scratch = self.core.kv.borrow_mut();
        let exact_workers = gw.kv.as_ref().map(|kv| kv.exact_workers());
        // The prompt is computed on this lane: measure it (decode gets it handed over).
        let computes = lane.computes_prompt();
        let measured = match (&gw.kv, &self.prompt) {
            (Some(kv), Some(tokens))
                if computes && router.policy.kind() == PolicyKind::CacheAware =>
            {
                self.measure(kv, tokens, &mut scratch, now_ms)
            }
            _ => None,
        };
        let exact = measured.map(|prompt_tokens| ExactInput {
            prompt_tokens,
            cached: &scratch.cached,
            exact_workers: exact_workers.as_ref().map_or(&[][..], |w| &w[..]),
            holders: &scratch.holders,
        });
        let input = RouteInput {
            text: &self.info.text,
            routing_key: self.routing_key,
            target_worker: if computes {
                self.head.header("x-smg-target-worker")
            } else {
                None
            },
            hash_key: self.hash_key,
            exclude,
            now_ms,
            recent: None,
            exact,
        };
        let (d, epoch) = router.choose(self.tree, input, workers, &gw.registry.loads, rng);
        d.map(|decision| Choice {
            decision,
            epoch,
            measured,
        })
    }

    /// This prompt's tokens against the KV-event index (into `s`): its token count, or `None`
    /// when the text tree decides alone (counted by reason, per pick).
    fn measure(
        &self,
        kv: &KvRouting,
        tokens: &Result<Vec<u32>, Fallback>,
        s: &mut KvScratch,
        now_ms: u64,
    ) -> Option<usize> {
        let ns = &self.info.namespace;
        let model = self.info.model.as_deref();
        // A model a worker lists as a LoRA adapter (vLLM's clients name one by its own name):
        // the base model's blocks, in the adapter's namespace.
        let (model, adapter) = match model.and_then(|m| self.gw.models.adapter_base(m)) {
            Some(base) => (Some(base), model),
            None => (model, None),
        };
        let r = match tokens {
            Ok(t) => kv.measure(model, adapter, ns, t, s, now_ms),
            Err(f) => Err(*f),
        };
        match r {
            Ok(n) => {
                let best = s.cached.iter().map(|&(_, c)| c).max().unwrap_or(0);
                crate::metrics::kv_measured(n, best);
                Some(n)
            }
            Err(f) => {
                crate::metrics::kv_fallback(f.as_str(), 1);
                None
            }
        }
    }
}

/// When every eligible worker has failed this request once (the policy finds none outside the
/// exclusions) and attempts remain, the exclusions are forgotten and the policy chooses among
/// all of them again, as the reference reselects on every attempt: excluding failed workers
/// steers retries elsewhere while there is an elsewhere, and a fleet of one or two (a single
/// decode server) still gets its retries. Once per pick, so workers the pick itself skipped
/// (half-open circuits with their probe slots taken) cannot make it loop.
fn recycle_exclusions(
    excluded: &mut Vec<WorkerId>,
    after_a_failure: bool,
    recycled: &mut bool,
) -> bool {
    if *recycled || !after_a_failure || excluded.is_empty() {
        return false;
    }
    *recycled = true;
    excluded.clear();
    true
}

/// Whether the chosen worker already holds the whole routing text in the text tree (or an
/// unpublished insert), so learning it again would change nothing but access times. Only a
/// text-tree decision says so in characters (with KV events the sizes may count tokens). The
/// access time is not refreshed: if the text tree's LRU later evicts a prompt still in use,
/// the next request inserts it again.
fn already_held(decision: &Decision, measured: bool) -> bool {
    !measured && decision.request_size > 0 && decision.predicted_chars == decision.request_size
}

/// The routing text as the tree and the recent-insert ring keep it: a text the extractor joined
/// as it is (shared, no copy); a string of the body as a zero-copy slice of it when the body is
/// not much larger than the text (the common case: the prompt is most of the body), else a
/// copy, so a kept text never pins a large upload (at most twice its size plus 4 KiB).
pub(super) fn learned_text(body: &Bytes, text: &RoutingText<'_>) -> SharedText {
    match text {
        RoutingText::Joined(t) => t.clone(),
        RoutingText::InBody(s) if body.len() <= 2 * s.len() + 4096 => SharedText::within(body, s),
        RoutingText::InBody(s) => SharedText::copy_of(s),
    }
}
