//! `--enable-trace`: the exchange's spans. A request that is not recorded pays one branch per
//! phase here and nothing else.

use super::{Exchange, Lane, Picked};
use crate::base::entropy::Entropy;
use crate::gateway::Core;
use crate::http::RequestHead;
use crate::serve::error::GatewayError;
use crate::trace::span::{now_ns, RequestTrace, Value};
use crate::workers::registry::Worker;
use crate::workers::role::Side;
use std::net::IpAddr;

/// The request's trace, when this request is recorded (sampled, or a trusted caller's).
pub(super) fn begin(
    core: &Core,
    head: &RequestHead,
    client_ip: Option<IpAddr>,
) -> Option<RequestTrace> {
    let gw = &core.gw;
    let t = gw.trace.as_ref()?;
    let traceparent = head.header("traceparent");
    // A caller's sampled flag counts only with --trace-trust-caller-sampling, and with
    // --api-key only from a caller presenting it (public pass-through endpoints take calls
    // without).
    let trusted = traceparent.is_some()
        && t.trusts_caller_sampling()
        && gw
            .auth
            .authorize(head, crate::gateway::Scope::Inference, client_ip)
            .is_ok();
    let mut trace = t.begin(
        traceparent,
        head.header("tracestate"),
        trusted,
        &mut core.entropy.borrow_mut(),
    )?;
    trace.set(
        "http.request.method",
        String::from_utf8_lossy(head.method()).into_owned(),
    );
    trace.set(
        "url.path",
        String::from_utf8_lossy(head.path()).into_owned(),
    );
    Some(trace)
}

/// The admit span (from `started_ns`) and what admission learnt of the request.
pub(super) fn admitted(t: &mut RequestTrace, ex: &Exchange<'_>, started_ns: u64) {
    t.child(
        &mut ex.core.entropy.borrow_mut(),
        "admit",
        started_ns,
        now_ns(),
        vec![],
    );
    t.set("radixgate.request_id", ex.request_id.clone());
    if let Some(m) = ex.info.model.as_deref() {
        t.set("gen_ai.request.model", m.to_string());
    }
    t.set("radixgate.stream", ex.info.stream);
}

impl Exchange<'_> {
    /// Traced: the route span of a pick on `lane` that started at `start`.
    pub(super) fn traced_pick(
        &self,
        lane: &Lane<'_>,
        start: u64,
        picked: &Result<Picked<'_>, GatewayError>,
    ) {
        let mut trace = self.trace.borrow_mut();
        let Some(t) = trace.as_mut() else {
            return;
        };
        let mut attrs: Vec<(&'static str, Value)> = Vec::with_capacity(8);
        attrs.push((
            "radixgate.policy",
            lane.router.policy.kind().as_str().into(),
        ));
        if lane.side != Side::Any {
            attrs.push(("radixgate.side", lane.side.name().into()));
        }
        let error = match picked {
            Ok(p) => {
                let d = &p.decision;
                attrs.push(("radixgate.branch", d.branch.as_str().into()));
                attrs.push(("radixgate.matched_length", (d.matched_chars as i64).into()));
                attrs.push((
                    "radixgate.predicted_length",
                    (d.predicted_chars as i64).into(),
                ));
                attrs.push(("radixgate.request_size", (d.request_size as i64).into()));
                attrs.push(("radixgate.worker", p.worker.url.clone().into()));
                None
            }
            Err(e) => Some(e.message.clone()),
        };
        let id = t.new_span_id(&mut self.core.entropy.borrow_mut());
        let kind = crate::trace::span::Kind::Internal;
        t.child_with_id(id, kind, "route", start, now_ns(), attrs, error);
    }

    /// Traced: the status the client got, and why the request failed when it did.
    pub(super) fn traced_status(&self, status: u16, error: Option<&'static str>) {
        if let Some(t) = self.trace.borrow_mut().as_mut() {
            t.set("http.response.status_code", i64::from(status));
            if let Some(e) = error {
                t.fail(e);
            }
        }
    }

    /// Traced: a phase that ran from `start_ns` until now, as a child of the server span.
    pub(super) fn traced_phase(&self, name: &'static str, start_ns: u64) {
        if let Some(t) = self.trace.borrow_mut().as_mut() {
            t.child(
                &mut self.core.entropy.borrow_mut(),
                name,
                start_ns,
                now_ns(),
                vec![],
            );
        }
    }

    /// Traced: `f` on the request's trace (with the core's entropy for new span ids); nothing
    /// when the request is not recorded.
    pub(in crate::serve) fn with_trace(&self, f: impl FnOnce(&mut RequestTrace, &mut Entropy)) {
        if let Some(t) = self.trace.borrow_mut().as_mut() {
            f(t, &mut self.core.entropy.borrow_mut());
        }
    }

    /// Traced: the attributes every attempt span on `worker` starts with (a PD side adds its
    /// side).
    pub(in crate::serve) fn attempt_attrs(&self, worker: &Worker) -> Vec<(&'static str, Value)> {
        let mut attrs = Vec::with_capacity(3);
        attrs.push(("radixgate.worker", Value::from(worker.url.clone())));
        attrs.push(("radixgate.attempt", Value::from(i64::from(self.attempts))));
        attrs
    }

    /// Whether this request is recorded.
    pub(super) fn traced(&self) -> bool {
        self.trace.borrow().is_some()
    }
}
