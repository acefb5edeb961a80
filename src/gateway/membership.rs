//! Changes to which workers may be chosen: a worker refusing a connection, a circuit opening or
//! closing, a worker removed. Each touches the registry, the router and the metrics together,
//! so they live here, in one place, rather than at their callers.

use super::Gateway;
use crate::workers::breaker::Transition;
use crate::workers::registry::{CircuitSlot, RegistryError, Worker};
use std::sync::Arc;

impl Gateway {
    /// Passive health: a worker that refused a connection leaves selection at once; the health
    /// checker re-admits it after `--health-success-threshold` good checks (probed quickly).
    pub fn on_connect_failure(&self, worker: &Worker) {
        for (r, _) in self.routers() {
            r.forget_unpublished(worker.id);
        }
        if self.cfg.disable_health_check {
            return;
        }
        if self.registry.set_healthy(worker, false) {
            crate::log!(
                Warn,
                "worker {} refused a connection: out of selection until healthy",
                worker.url
            );
            self.membership_changed();
        }
    }

    /// Tell the policies the worker set or eligibility changed (rings keyed by URL); in PD
    /// mode each side hears of its own workers only.
    pub fn membership_changed(&self) {
        let list = self.registry.load();
        for (router, side) in self.routers() {
            let named: Vec<_> = list
                .workers
                .iter()
                .filter(|w| side.takes(w.role))
                .map(|w| (w.id, w.url.as_bytes()))
                .collect();
            router.policy.workers_changed_named(&named);
        }
    }

    /// Record a request's outcome on its worker's breaker (at most once per slot); on a
    /// transition, update eligibility.
    pub fn record_outcome(&self, slot: &mut CircuitSlot, success: bool) {
        let t = slot.record(&self.breaker, success, self.life.now_ms());
        self.after_breaker(slot.worker(), t);
    }

    /// Apply a breaker transition (logs, metrics, eligibility).
    pub fn after_breaker(&self, worker: &Worker, t: Transition) {
        if t == Transition::None {
            return;
        }
        let state = worker.breaker.state().as_str();
        crate::log!(Warn, "worker {}: circuit {state}", worker.url);
        crate::metrics::circuit_transition(state);
        self.registry.refresh_eligibility(worker);
        self.membership_changed();
    }

    /// Remove a worker (with `--dp-aware`: its server, every rank): out of selection now,
    /// in-flight requests finish, and its tree entries go.
    pub fn remove_worker(&self, url_or_id: &str) -> Result<Vec<Arc<Worker>>, RegistryError> {
        let removed = self.registry.remove(url_or_id)?;
        for worker in &removed {
            for (r, _) in self.routers() {
                r.forget_worker(worker.id);
            }
            self.forget_models(worker.id);
            crate::log!(Info, "worker {} removed (id {})", worker.url, worker.id);
        }
        self.membership_changed();
        Ok(removed)
    }
}
