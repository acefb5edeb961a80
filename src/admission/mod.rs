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

/// The header a client (or the front before it) states its priority class in, as the
/// reference names it; higher is more important (SGLang's default direction). The gateway's
/// own: never forwarded to a worker (the class it used reaches the engine in the body).
pub const PRIORITY_HEADER: &str = "x-smg-priority";

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
    /// Identify the tenant of a request from its headers (name, value; in order): the trusted
    /// header's value when `--tenant-header` is set, else its API key (`Authorization: Bearer
    /// KEY`, or `x-api-key` as Anthropic clients send it). Anything unknown is the default
    /// tenant. Of several copies of the trusted header the last counts: a front appends its
    /// own after whatever the client sent (a proxy that replaces it leaves one copy anyway).
    pub fn tenant<'h>(
        &self,
        headers: impl Iterator<Item = (&'h [u8], &'h [u8])> + Clone,
    ) -> TenantId {
        let tenants = self.flow.tenants();
        let value = |name: &str, last: bool| {
            let mut copies = headers
                .clone()
                .filter(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
                .map(|(_, v)| std::str::from_utf8(v).ok().map(str::trim));
            if last {
                copies.last().flatten()
            } else {
                copies.next().flatten()
            }
        };
        if let Some(name) = &self.tenant_header {
            return value(name, true).map_or(0, |v| tenants.by_name(v));
        }
        // The first copy of a key: the one the key check (`gateway::auth`) read.
        let bearer = value("authorization", false).and_then(|v| {
            v.get(..7)
                .filter(|p| p.eq_ignore_ascii_case("bearer "))
                .map(|_| v[7..].trim())
        });
        match bearer.or_else(|| value("x-api-key", false)) {
            Some(key) => tenants.by_key(key),
            None => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::tenants::{TenantSpec, Tenants};
    use std::time::Duration;

    fn control(header: Option<&str>) -> FlowControl {
        let specs = vec![
            (
                "front".to_string(),
                TenantSpec {
                    keys: vec!["k-front".into()],
                    ..TenantSpec::default()
                },
            ),
            ("client".to_string(), TenantSpec::default()),
        ];
        FlowControl {
            flow: flow::Flow::new(
                flow::FlowConfig {
                    queue_size: 1,
                    queue_timeout: Duration::from_secs(1),
                    sheddable_wait: Duration::from_secs(1),
                },
                Tenants::new(&specs).unwrap(),
            ),
            saturation: saturation::Saturation::new(
                1,
                saturation::Thresholds {
                    queue_reqs: 1,
                    kv_usage: 1.0,
                    headroom: 0.0,
                    chunk_tokens: 1,
                },
            ),
            tenant_header: header.map(str::to_string),
        }
    }

    fn tenant(fc: &FlowControl, headers: &[(&str, &str)]) -> &'static str {
        let id = fc.tenant(headers.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())));
        fc.flow.tenants().name(id)
    }

    #[test]
    fn the_trusted_header_counts_by_its_last_copy_the_one_the_front_appended() {
        let fc = control(Some("X-Tenant"));
        // The client's own copy first, the front's appended after it.
        assert_eq!(
            tenant(&fc, &[("x-tenant", "client"), ("X-Tenant", " front ")]),
            "front"
        );
        assert_eq!(tenant(&fc, &[("x-tenant", "front")]), "front");
        assert_eq!(
            tenant(&fc, &[("authorization", "Bearer k-front")]),
            "default"
        );
    }

    #[test]
    fn without_a_trusted_header_the_key_names_the_tenant() {
        let fc = control(None);
        assert_eq!(tenant(&fc, &[("Authorization", "bearer k-front")]), "front");
        assert_eq!(tenant(&fc, &[("x-api-key", "k-front")]), "front");
        assert_eq!(tenant(&fc, &[("x-api-key", "nope")]), "default");
        assert_eq!(tenant(&fc, &[]), "default");
    }
}
