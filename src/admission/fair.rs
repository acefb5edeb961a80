//! Token-weighted fairness across tenants (a virtual token counter, as VTC proposes): each
//! tenant's counter grows by the tokens it is served (prompt tokens when let in, output tokens
//! as they stream) divided by its weight; the waiting tenant with the smallest counter goes next.
//! Counting tokens, not requests, is the point: one long-prompt tenant cannot take the fleet
//! from many short-prompt ones by sending fewer, larger requests.

use super::TenantId;

/// The counters, one per tenant of the table.
#[derive(Debug, Clone)]
pub struct Fairness {
    counters: Vec<f64>,
    weights: Vec<f64>,
}

impl Fairness {
    /// Counters at zero for tenants of these weights (a weight at or below 0 counts as 1: a
    /// tenant cannot be configured out of service).
    pub fn new(weights: impl IntoIterator<Item = f64>) -> Fairness {
        let weights: Vec<f64> = weights
            .into_iter()
            .map(|w| if w.is_finite() && w > 0.0 { w } else { 1.0 })
            .collect();
        Fairness {
            counters: vec![0.0; weights.len()],
            weights,
        }
    }

    /// Tenant `t`'s service so far, per unit of weight (0 for a tenant not in the table).
    pub fn counter(&self, t: TenantId) -> f64 {
        self.counters.get(usize::from(t)).copied().unwrap_or(0.0)
    }

    /// Tenant `t` was served `tokens` more tokens.
    pub fn charge(&mut self, t: TenantId, tokens: u64) {
        let i = usize::from(t);
        if let (Some(c), Some(w)) = (self.counters.get_mut(i), self.weights.get(i)) {
            *c += tokens as f64 / w;
        }
    }

    /// Tenant `t` starts waiting while others already do: it starts from the least-served of
    /// them (`floor`), so a tenant that was idle does not come back with a bank of credit and
    /// take the fleet for as long as it was away.
    pub fn lift(&mut self, t: TenantId, floor: Option<f64>) {
        if let (Some(c), Some(f)) = (self.counters.get_mut(usize::from(t)), floor) {
            *c = c.max(f);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_is_counted_per_unit_of_weight() {
        let mut f = Fairness::new([1.0, 2.0, 0.0, f64::NAN]);
        f.charge(0, 100);
        f.charge(1, 100);
        f.charge(2, 100);
        f.charge(3, 100);
        assert_eq!(f.counter(0), 100.0);
        assert_eq!(f.counter(1), 50.0, "twice the weight, half the count");
        assert_eq!(f.counter(2), 100.0, "a zero weight counts as 1");
        assert_eq!(f.counter(3), 100.0, "so does a NaN");
        f.charge(9, 100);
        assert_eq!(f.counter(9), 0.0, "a tenant outside the table is ignored");
    }

    #[test]
    fn a_returning_tenant_starts_from_the_least_served_waiter() {
        let mut f = Fairness::new([1.0, 1.0]);
        f.charge(0, 1000);
        f.lift(1, Some(400.0));
        assert_eq!(f.counter(1), 400.0);
        f.lift(0, Some(400.0));
        assert_eq!(f.counter(0), 1000.0, "never lowered");
        f.lift(1, None);
        assert_eq!(f.counter(1), 400.0, "nobody waits: nothing to catch up to");
    }
}
