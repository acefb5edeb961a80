//! What every target shares around an attempt and its commit: the request a worker gets, how
//! its answer is relayed, and the accounting once it is over (circuit, completions, time to
//! first byte, the tenant's output, the opt-in reply learning).

use super::{Exchange, Forwarding, Picked};
use crate::base::text::SharedText;
use crate::base::WorkerId;
use crate::proxy::capture::Capture;
use crate::proxy::forward::{self, UpstreamRequest};
use crate::proxy::relay::{self, RelayTo};
use crate::route::extract::{capped, MAX_ROUTING_TEXT};
use crate::serve::reply::Reply;
use crate::serve::Outcome;
use crate::trace::span::{now_ns, Leg};
use crate::workers::breaker::is_worker_failure;
use crate::workers::registry::Worker;
use bytes::Bytes;
use monoio::net::TcpStream;
use monoio::time::Instant;
use std::borrow::Cow;

/// Whether a relayed answer of `status` counts as a success for its worker's circuit: not a
/// worker failure, and not broken off.
pub(in crate::serve) fn served(status: u16, relayed: &relay::Relayed) -> bool {
    !is_worker_failure(status) && !relayed.upstream_broke
}

impl Exchange<'_> {
    /// The request to `worker` with `body` (as the attempt span of `leg` when traced): the
    /// client's method, target and end-to-end headers, this request's id, the client appended
    /// to `X-Forwarded-For`. Traced: a `traceparent` naming that attempt span instead of the
    /// client's, so the worker's own spans join this trace.
    pub(in crate::serve) fn upstream_request(
        &self,
        leg: Leg,
        worker: &Worker,
        body: Bytes,
    ) -> UpstreamRequest {
        let trace = self.trace.borrow();
        let ctx = trace.as_ref().map(|t| {
            (
                t.traceparent_for(t.upstream_parent_of(leg)),
                t.trace_state(),
            )
        });
        UpstreamRequest::build(
            self.head.method(),
            self.head.target(),
            Some(self.head),
            self.client_ip,
            &worker.authority,
            &self.request_id,
            body,
            ctx.as_ref().map(|(tp, state)| forward::TraceHeaders {
                traceparent: tp,
                tracestate: state.map(str::as_bytes),
            }),
            &self.gw.own_headers,
        )
    }

    /// How an answer from `worker` is relayed to this client.
    pub(in crate::serve) fn relay_to<'w>(&'w self, worker: &'w Worker) -> RelayTo<'w> {
        RelayTo {
            worker,
            request_id: &self.request_id,
            client_keep_alive: self.head.keep_alive,
            client_http10: self.head.is_http10(),
            deadline: self.deadline,
            shutting_down: self.gw.life.is_shutting_down(),
        }
    }

    /// The outcome of `picked`'s attempt, for its circuit.
    pub(in crate::serve) fn record(&self, picked: &mut Picked<'_>, success: bool) {
        self.gw.record_outcome(&mut picked.slot, success);
    }

    /// `picked` served the request to its end.
    pub(in crate::serve) fn completed(&self, picked: &Picked<'_>) {
        picked
            .worker
            .completed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// An answer was relayed (the answer of `leg`'s worker): its time to first byte, and its
    /// output charged to its tenant. Traced, its attempt span gets the answer's figures, and
    /// every attempt span ends (a PD twin's answer is read by then).
    pub(in crate::serve) fn relayed(&self, leg: Leg, r: &relay::Relayed) {
        if let Some(t) = self.trace.borrow_mut().as_mut() {
            let now = now_ns();
            if let Some(at) = r.first_body_at {
                let ago = Instant::now().saturating_duration_since(at).as_nanos();
                t.event("first_byte", now.saturating_sub(ago as u64));
            }
            t.event("end_of_stream", now);
            t.leg_set(leg, "radixgate.body_bytes", r.body_bytes as i64);
            t.leg_set(leg, "radixgate.stream_events", r.events as i64);
            if r.upstream_broke {
                let why = Cow::Borrowed("the worker's answer broke off");
                t.end_leg(leg, now, Some(why));
            }
            t.end_attempt(now, None);
        }
        if let Some(at) = r.first_body_at {
            crate::metrics::ttft(at.duration_since(self.started));
        }
        self.charge_output(r.events, r.body_bytes);
    }

    /// With `--insert-response-text`, what records the reply from `picked` (`chunked`: its
    /// framing) so the next turn matches this one's whole history.
    pub(in crate::serve) fn capture_for(
        &self,
        picked: &Picked<'_>,
        chunked: bool,
    ) -> Option<Capture> {
        match self.forwarding {
            Forwarding::Routed(api)
                if self.gw.settings.exchange.insert_response_text
                    && picked.decision.insert_text =>
            {
                Some(Capture::new(api, chunked))
            }
            _ => None,
        }
    }

    /// Learn the captured reply of a complete 2xx answer for `worker` (the side whose cache
    /// will hold the next turn's prefix: the regular worker, or PD's prefill worker): "prompt +
    /// reply", so the next turn matches its whole history.
    pub(in crate::serve) fn learn_captured(
        &self,
        capture: Option<Capture>,
        complete: bool,
        status: u16,
        worker: WorkerId,
    ) {
        if !complete || !(200..300).contains(&status) {
            return;
        }
        let Some(reply) = capture.and_then(|c| c.reply()) else {
            return;
        };
        let prompt = &self.info.text;
        let reply = capped(&reply, MAX_ROUTING_TEXT.saturating_sub(prompt.len() + 1));
        let mut full = String::with_capacity(prompt.len() + 1 + reply.len());
        full.push_str(prompt);
        full.push(' ');
        full.push_str(reply);
        let router = &self.gw.router;
        let now = self.gw.life.now_ms();
        router.learn(
            self.tree,
            SharedText::from_string(full),
            worker,
            router.epoch(),
            now,
        );
    }

    /// Write `reply` (a whole answer the gateway composed) with this request's id.
    pub(in crate::serve) async fn send_reply(
        &self,
        client: &mut TcpStream,
        reply: &Reply,
    ) -> Outcome {
        crate::serve::reply::send(
            client,
            reply,
            Some(&self.request_id),
            self.head.keep_alive,
            false,
        )
        .await
    }

    /// The request is over with `status` (`keep_alive`: the client connection may serve
    /// another): the trace's status, and the connection loop's outcome.
    pub(in crate::serve) fn finished(&self, status: u16, keep_alive: bool) -> Outcome {
        self.traced_status(status, None);
        Outcome { status, keep_alive }
    }
}
