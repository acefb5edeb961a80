//! The usual target: one worker per attempt, on the lane of every worker.

use super::commit::served;
use super::{Exchange, Forwarding, Lane, Picked, Target};
use crate::http::{BodyFraming, Method};
use crate::proxy::forward::{self, UpstreamError, UpstreamResponse};
use crate::proxy::relay;
use crate::proxy::retry::is_retryable_status;
use crate::route::bootstrap;
use crate::serve::error::GatewayError;
use crate::serve::Outcome;
use crate::trace::span::{now_ns, Leg, RequestTrace};
use crate::workers::registry::Worker;
use crate::workers::role::Side;
use bytes::Bytes;
use monoio::net::TcpStream;
use std::borrow::Cow;

/// One worker per attempt, picked among all of them.
pub(in crate::serve) struct OneWorker<'a> {
    lane: Lane<'a>,
}

impl<'a> OneWorker<'a> {
    /// The target of a request outside PD mode.
    pub(in crate::serve) fn new(ex: &Exchange<'a>) -> OneWorker<'a> {
        OneWorker {
            lane: Lane::new(Side::Any, &ex.gw.router),
        }
    }
}

impl<'a> Target<'a> for OneWorker<'a> {
    type Picked = Picked<'a>;
    type Answer = UpstreamResponse;

    fn computing_lane(&mut self) -> &mut Lane<'a> {
        &mut self.lane
    }

    fn pick(&mut self, ex: &mut Exchange<'a>) -> Result<Picked<'a>, GatewayError> {
        ex.pick_on(&mut self.lane)
    }

    async fn attempt(
        &self,
        ex: &Exchange<'a>,
        picked: &Picked<'a>,
        retry: bool,
    ) -> Result<UpstreamResponse, GatewayError> {
        let worker = &picked.worker;
        ex.with_trace(|t, entropy| {
            t.start_attempt(entropy, now_ns(), ex.attempt_attrs(worker));
        });
        let req = ex.upstream_request(Leg::Prefill, worker, body_for(ex, worker)?);
        let is_head = ex.head.method_kind() == Method::Head;
        let pool = &ex.core.pool;
        let timeout = ex.connect_timeout();
        let answer = forward::roundtrip(pool, worker, &req, is_head, timeout, ex.deadline).await;
        ex.with_trace(|t, _| trace_attempt(t, &answer, retry));
        match answer {
            // Dropping `up` closes that upstream connection: its body is not wanted.
            Ok(up) if is_retryable_status(up.head.status) && retry => {
                Err(GatewayError::worker_answer(&up.head))
            }
            Ok(up) => Ok(up),
            Err(e) => {
                crate::log!(Debug, "worker {}: {}", worker.url, e.message());
                Err(GatewayError::upstream(&e))
            }
        }
    }

    async fn retry_after(
        &mut self,
        ex: &mut Exchange<'a>,
        picked: Picked<'a>,
        error: GatewayError,
    ) -> Result<(), GatewayError> {
        ex.retry_after_on(&mut self.lane, picked, error).await
    }

    /// Relay the answer, account the outcome, and (opt-in) learn the reply.
    async fn commit(
        self,
        ex: Exchange<'a>,
        client: &mut TcpStream,
        mut picked: Picked<'a>,
        up: UpstreamResponse,
    ) -> Outcome {
        let worker = picked.worker.clone();
        let status = up.head.status;
        let chunked = matches!(up.head.framing, BodyFraming::Chunked);
        let mut capture = ex.capture_for(&picked, chunked);
        let how = ex.relay_to(&worker);
        let relayed = relay::relay(&ex.core.pool, client, up, how, capture.as_mut()).await;
        // One outcome per request, once the answer is over (a probe holds its slot until then).
        ex.record(&mut picked, served(status, &relayed));
        ex.answered(&worker, status);
        ex.completed(&picked);
        drop(picked);
        ex.relayed(Leg::Prefill, &relayed);
        ex.learn_captured(capture, relayed.complete, status, worker.id);
        ex.finished(status, relayed.client_keep_alive)
    }
}

/// The body `worker` gets: the client's bytes, with `--dp-aware` the target's rank spliced in
/// as `data_parallel_rank` (a new body per attempt: a retry may go to another rank), and the
/// saturation admission's class as `priority` when it replaces the client's.
fn body_for(ex: &Exchange<'_>, worker: &Worker) -> Result<Bytes, GatewayError> {
    let Forwarding::Routed(_) = ex.forwarding else {
        return Ok(ex.body.clone());
    };
    let added = bootstrap::Added {
        dp_rank: worker.dp.map(|dp| dp.rank),
        priority: ex.engine_priority,
        ..bootstrap::Added::default()
    };
    bootstrap::splice_routed(ex.body, &added)
        .map(|b| b.map_or_else(|| ex.body.clone(), Bytes::from))
        .map_err(|e| GatewayError::unsendable(e.0))
}

/// An attempt's outcome on its span: the status it got, else why it failed and, when another
/// worker gets a try, the retry reason; a failed attempt's span ends here, a relayed one's when
/// its answer is over.
fn trace_attempt(
    t: &mut RequestTrace,
    answer: &Result<UpstreamResponse, UpstreamError>,
    retry: bool,
) {
    let (reason, error): (&'static str, Cow<'static, str>) = match answer {
        Ok(up) => {
            t.attempt_set("http.response.status_code", i64::from(up.head.status));
            if !(is_retryable_status(up.head.status) && retry) {
                return;
            }
            (
                "status",
                Cow::Owned(format!("worker answered {}", up.head.status)),
            )
        }
        Err(e) => (e.kind(), Cow::Owned(e.message())),
    };
    if retry {
        t.attempt_set("radixgate.retry_reason", reason);
    }
    t.end_attempt(now_ns(), Some(error));
}
