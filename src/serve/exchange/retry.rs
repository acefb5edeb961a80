//! Phase *retry_after*: a failed attempt's worker hears of it (circuit, passive health,
//! backpressure), then the request backs off for another worker or gives up with the error
//! the client gets.

use super::{Exchange, Lane, Picked};
use crate::serve::error::{Fault, GatewayError};
use crate::workers::breaker::is_backpressure;
use crate::workers::registry::Worker;
use monoio::time::Instant;
use std::time::Duration;

impl<'a> Exchange<'a> {
    /// Account `error`, the failure of `picked` (a worker of `lane`), then either back off and
    /// let the next pick exclude that worker, or give up with the error the client gets.
    /// (PD mode: the pair's other worker was released by the caller, unrecorded: its request
    /// was dropped, not failed.)
    pub(in crate::serve) async fn retry_after_on(
        &mut self,
        lane: &mut Lane<'a>,
        mut picked: Picked<'a>,
        error: GatewayError,
    ) -> Result<(), GatewayError> {
        let worker = picked.worker.clone();
        if matches!(error.fault, Fault::Unreachable(_)) {
            self.gw.on_connect_failure(&worker);
        }
        // A local failure leaves the circuit alone: dropping the slot gives a probe slot back.
        if !matches!(error.fault, Fault::Local(_)) {
            self.gw
                .record_outcome(&mut picked.slot, error.fault.circuit_success());
        }
        if let Some(status) = error.fault.status() {
            self.answered(&worker, status);
        }
        drop(picked);
        if !error.retryable {
            return Err(error);
        }
        lane.excluded.push(worker.id);
        // A worker's Retry-After is waited for only when the retry can go nowhere else.
        let asked = error.retry_after.filter(|_| !self.elsewhere(lane));
        let Some(until) = self.backoff_until(asked) else {
            // The wait asked for does not fit the policy or the deadline: the client hears it.
            return Err(error);
        };
        self.last_error = Some(error);
        crate::metrics::retry();
        monoio::time::sleep_until(until).await;
        Ok(())
    }

    /// When the next attempt may start: after the policy's delay, or after the `asked`
    /// seconds of a worker's `Retry-After` when they are longer; `None` when that wait is past
    /// the policy's longest delay or the request's deadline.
    fn backoff_until(&self, asked: Option<u32>) -> Option<Instant> {
        let u = self.core.rng.borrow_mut().unit();
        let n = self.attempts.saturating_sub(1);
        let wait = Duration::from_millis(self.gw.retry.wait_ms(n, u, asked)?);
        let at = Instant::now() + wait;
        match asked {
            Some(_) if at > self.deadline => None,
            _ => Some(std::cmp::min(at, self.deadline)),
        }
    }

    /// Whether an eligible worker of `lane` has not failed this request yet (a retry can go
    /// elsewhere).
    fn elsewhere(&self, lane: &Lane<'_>) -> bool {
        let list = self.gw.registry.load();
        let loads = &self.gw.registry.loads;
        list.ids_on(lane.side)
            .iter()
            .any(|w| loads.is_eligible(*w) && !lane.excluded.contains(w))
    }

    /// `worker` answered `status`: backpressure (429, 503) is counted, and with
    /// `--saturation-admission` the worker is saturated until its next reading, so the
    /// gateway's own queue holds what the engine's could not.
    pub(in crate::serve) fn answered(&self, worker: &Worker, status: u16) {
        if !is_backpressure(status) {
            return;
        }
        crate::metrics::worker_backpressure(&worker.url);
        if let Some(fc) = &self.gw.flow {
            fc.saturation.push_back(worker.id);
        }
    }
}
