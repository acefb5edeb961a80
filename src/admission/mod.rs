//! Admission: which requests go to the workers now, which wait in the gateway, which are
//! refused.
//!
//! Two models, chosen by flags:
//! - `fixed`: the reference's (`--max-concurrent-requests`, a FIFO queue of `--queue-size`
//!   waiting at most `--queue-timeout-secs`, a token bucket of
//!   `--rate-limit-tokens-per-second`), kept as it is for drop-in use;
//! - flow control (`--saturation-admission`): requests go straight through while some worker
//!   of their model is not saturated, and wait only while every one is, ordered by priority
//!   class (`queue`), then by token-weighted fairness across tenants (`fair`), then arrival.
//!
//! Submodules: `fixed` (the reference's limiter), `flow` (the saturation admission: rooms,
//! verdicts, tenant limits), `queue` (the waiting room, pure), `fair` (the tenants' fairness
//! counters, pure), `saturation` (each worker's last reading and the rule), `tenants` (the
//! tenant table).

pub mod fair;
pub mod fixed;
pub mod flow;
pub mod queue;
pub mod saturation;
pub mod tenants;

pub use fixed::{Admission, Permit, Refusal};

/// A tenant's index in the tenant table; 0 is the default tenant (unknown or no key).
pub type TenantId = u16;

/// The saturation admission's shared state (`--saturation-admission`): the waiting rooms and
/// tenant limits, the workers' last readings, and where a request's tenant comes from.
#[derive(Debug)]
pub struct FlowControl {
    /// Rooms, fairness, tenant limits.
    pub flow: flow::Flow,
    /// Each worker's last reading (written by the telemetry thread).
    pub saturation: saturation::Saturation,
    /// The trusted header naming the tenant (`--tenant-header`), else the API key does.
    pub tenant_header: Option<String>,
}

impl FlowControl {
    /// Identify the tenant of a request from its headers: the trusted header's value when
    /// `--tenant-header` is set, else its API key (`Authorization: Bearer KEY`, or `x-api-key`
    /// as Anthropic clients send it). Anything unknown is the default tenant.
    pub fn tenant<'h>(&self, header: impl Fn(&str) -> Option<&'h str>) -> TenantId {
        let tenants = self.flow.tenants();
        if let Some(name) = &self.tenant_header {
            return header(name).map_or(0, |v| tenants.by_name(v.trim()));
        }
        let bearer = header("authorization").and_then(|v| {
            let v = v.trim();
            v.get(..7)
                .filter(|p| p.eq_ignore_ascii_case("bearer "))
                .map(|_| v[7..].trim())
        });
        match bearer.or_else(|| header("x-api-key").map(str::trim)) {
            Some(key) => tenants.by_key(key),
            None => 0,
        }
    }
}
