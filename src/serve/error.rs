//! The request path's one error type. Every answer the gateway writes itself instead of a
//! worker, and every failed attempt on a worker, is a [`GatewayError`]: the status and OpenAI
//! body the client gets, whether another attempt may do better (the retry loop reads it, and
//! `side` says where), the worker's part in it ([`Fault`]: what its circuit and health hear),
//! and whether the connection must close. Decided in one place, written by one writer
//! (`reply::send_error`).

use crate::admission::flow::Denied;
use crate::admission::Refusal;
use crate::proxy::forward::UpstreamError;
use crate::proxy::retry::is_retryable_status;
use crate::workers::breaker::is_worker_failure;
use crate::workers::role::Side;
use std::borrow::Cow;

/// A worker's part in an error: what its circuit breaker and passive health hear of it, and the
/// one word a trace gives as the retry reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// No worker was involved: the gateway's own refusal or answer.
    Gateway,
    /// The gateway could not send the request (out of file descriptors or local ports, or a
    /// body it could not rewrite for this worker): says nothing about the worker.
    Local(&'static str),
    /// The worker could not be reached: a passive health signal.
    Unreachable(&'static str),
    /// The worker was reached but no usable response head came back (timeout, reset, garbage).
    NoAnswer(&'static str),
    /// The worker answered this status.
    Status(u16),
}

impl Fault {
    /// The failure in one word (`status`, `connect`, `timeout`, ...: a trace's retry reason).
    pub fn reason(self) -> &'static str {
        match self {
            Fault::Gateway => "gateway",
            Fault::Local(r) | Fault::Unreachable(r) | Fault::NoAnswer(r) => r,
            Fault::Status(_) => "status",
        }
    }

    /// Whether the worker's circuit counts this as a success (a 429 is the engine working as
    /// designed, not failing). Local faults never reach the circuit (`retry_after_on`).
    pub fn circuit_success(self) -> bool {
        matches!(self, Fault::Status(s) if !is_worker_failure(s))
    }

    /// The worker's status, when it answered one.
    pub fn status(self) -> Option<u16> {
        match self {
            Fault::Status(s) => Some(s),
            _ => None,
        }
    }
}

/// An error answered by the gateway, in the OpenAI shape `{"error":{"message","type","code"}}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayError {
    /// HTTP status (also the body's `code`).
    pub status: u16,
    /// Human-readable message for the body.
    pub message: Cow<'static, str>,
    /// Another worker might answer this request: the exchange retries elsewhere while attempts
    /// and time remain (an attempt's error has it cleared when none do).
    pub retryable: bool,
    /// The connection cannot serve another request after this (broken framing, unread body).
    pub close: bool,
    /// Seconds after which the client may sensibly try again (`Retry-After`), for refusals
    /// under overload.
    pub retry_after: Option<u32>,
    /// The worker's part in it (`Fault::Gateway` when none).
    pub fault: Fault,
    /// Which side of a prefill/decode pair failed (`Side::Any` outside PD mode): the retry
    /// excludes that worker, and a trace ends that side's span.
    pub side: Side,
}

impl GatewayError {
    /// The client's request is at fault, or the gateway refuses it; the connection stays usable.
    pub fn new(status: u16, message: impl Into<Cow<'static, str>>) -> GatewayError {
        GatewayError {
            status,
            message: message.into(),
            retryable: false,
            close: false,
            retry_after: None,
            fault: Fault::Gateway,
            side: Side::Any,
        }
    }

    /// The same error, as the failure of `side` of a prefill/decode pair (its message names
    /// the side).
    pub fn on_side(self, side: Side) -> GatewayError {
        let message = match self.fault {
            Fault::Status(s) => format!("the {} worker answered {s}", side.name()).into(),
            _ => format!("{} worker: {}", side.name(), self.message).into(),
        };
        GatewayError {
            side,
            message,
            ..self
        }
    }

    /// The client's body cannot be rewritten for a worker (a field the gateway must splice in
    /// does not fit it): 400, the client's fault, not the worker's.
    pub fn unsendable(message: impl Into<Cow<'static, str>>) -> GatewayError {
        GatewayError {
            fault: Fault::Local("bad_request"),
            ..GatewayError::bad_request(message)
        }
    }

    /// The request could not be read or framed: answer, then close (the rest of the stream is
    /// not a request boundary anyone can trust).
    pub fn framing(status: u16, message: impl Into<Cow<'static, str>>) -> GatewayError {
        GatewayError {
            close: true,
            ..GatewayError::new(status, message)
        }
    }

    /// A worker answered `status` (retryable when another worker might do better). Like every
    /// client-visible message, it never names the worker: worker addresses stay internal.
    pub fn worker_status(status: u16) -> GatewayError {
        GatewayError {
            retryable: is_retryable_status(status),
            fault: Fault::Status(status),
            ..GatewayError::new(status, format!("the worker answered {status}"))
        }
    }

    /// [`GatewayError::worker_status`] for the head a worker answered: a backpressure answer
    /// (429, 503) keeps the worker's `Retry-After`, for the client if no worker takes the
    /// request.
    pub fn worker_answer(head: &crate::http::ResponseHead) -> GatewayError {
        let status = head.status;
        let retry_after = if crate::workers::breaker::is_backpressure(status) {
            head.header("retry-after")
                .and_then(crate::proxy::retry::retry_after_secs)
        } else {
            None
        };
        GatewayError {
            retry_after,
            ..GatewayError::worker_status(status)
        }
    }

    /// No response head came back from a worker: always worth another worker.
    pub fn upstream(e: &UpstreamError) -> GatewayError {
        let fault = if e.is_local() {
            Fault::Local(e.kind())
        } else if e.is_connect() {
            Fault::Unreachable(e.kind())
        } else {
            Fault::NoAnswer(e.kind())
        };
        GatewayError {
            retryable: true,
            fault,
            ..GatewayError::new(e.status(), e.message())
        }
    }

    /// No worker can take the request (none registered, or all unhealthy / circuits open).
    pub fn no_workers(none_registered: bool) -> GatewayError {
        GatewayError::new(
            503,
            if none_registered {
                "no workers are registered"
            } else {
                "no available workers (all unhealthy or circuits open)"
            },
        )
    }

    /// PD mode: no worker of one side (`prefill` or `decode`) can take the request.
    pub fn no_workers_on(side: &str, none_registered: bool) -> GatewayError {
        GatewayError::new(
            503,
            if none_registered {
                format!("no {side} workers are registered")
            } else {
                format!("no available {side} workers (all unhealthy or circuits open)")
            },
        )
    }

    /// 400: the request itself is wrong (a body the API does not accept, a field out of range).
    pub fn bad_request(message: impl Into<Cow<'static, str>>) -> GatewayError {
        GatewayError::new(400, message)
    }

    /// 404: nothing answers at this path, or the thing named does not exist.
    pub fn not_found(message: impl Into<Cow<'static, str>>) -> GatewayError {
        GatewayError::new(404, message)
    }

    /// 403: the caller is known but may not do this.
    pub fn forbidden(message: impl Into<Cow<'static, str>>) -> GatewayError {
        GatewayError::new(403, message)
    }

    /// 501: a request this mode does not serve.
    pub fn not_implemented(message: impl Into<Cow<'static, str>>) -> GatewayError {
        GatewayError::new(501, message)
    }

    /// 502: a worker's answer cannot be relayed as a success.
    pub fn bad_gateway(message: impl Into<Cow<'static, str>>) -> GatewayError {
        GatewayError::new(502, message)
    }

    /// 503: the gateway cannot take this now (a helper thread busy, nothing to answer from);
    /// retry shortly.
    pub fn unavailable(message: impl Into<Cow<'static, str>>) -> GatewayError {
        GatewayError::new(503, message)
    }

    /// 409: the thing to create exists already.
    pub fn conflict(message: impl Into<Cow<'static, str>>) -> GatewayError {
        GatewayError::new(409, message)
    }

    /// 405: the path exists, the method does not.
    pub fn method_not_allowed(message: impl Into<Cow<'static, str>>) -> GatewayError {
        GatewayError::new(405, message)
    }

    /// 500: the gateway itself is misconfigured or broke an invariant.
    pub fn internal(message: impl Into<Cow<'static, str>>) -> GatewayError {
        GatewayError::new(500, message)
    }

    /// Too many calls of this kind are in flight across the gateway (a public endpoint that
    /// makes workers work on a client's behalf): 503 at once, retry shortly.
    pub fn busy(what: &'static str) -> GatewayError {
        GatewayError::new(
            503,
            format!("too many {what} calls in flight on this gateway; retry shortly"),
        )
    }

    /// The OpenAI error `type` for this status: one table for every error the gateway writes.
    pub fn kind(&self) -> &'static str {
        error_type(self.status)
    }
}

impl From<Denied> for GatewayError {
    fn from(d: Denied) -> GatewayError {
        let too_many = |why: &'static str, retry_after: u32| GatewayError {
            retry_after: Some(retry_after),
            ..GatewayError::new(429, why)
        };
        match d {
            Denied::Full { retry_after } => too_many(
                "too many requests: every worker is saturated and the admission queue is full of requests of this priority or higher",
                retry_after,
            ),
            Denied::Shed { retry_after } => too_many(
                "too many requests: shed from the admission queue for a request of higher priority",
                retry_after,
            ),
            Denied::Overloaded { retry_after } => too_many(
                "too many requests: every worker is saturated and a sheddable request would wait longer than it may",
                retry_after,
            ),
            Denied::TenantLimit { retry_after } => too_many(
                "too many requests: this tenant's requests or tokens per minute are used up",
                retry_after,
            ),
            Denied::OverTenantLimit => too_many(
                "too many requests: this request asks for more generations (prompts times n) or tokens than this tenant's whole per-minute limit allows; retrying it will not help",
                60,
            ),
            Denied::Timeout => GatewayError::new(408, "timed out waiting in the admission queue"),
            // Never answered (the client is gone); a status for the logs.
            Denied::ClientGone => GatewayError::new(499, "the client left while its request waited"),
        }
    }
}

impl From<Refusal> for GatewayError {
    fn from(r: Refusal) -> GatewayError {
        match r {
            Refusal::QueueFull => {
                GatewayError::new(429, "too many requests: the admission queue is full")
            }
            Refusal::Timeout => GatewayError::new(408, "timed out waiting in the admission queue"),
        }
    }
}

/// The OpenAI-style `type` for a status the gateway answers itself.
pub fn error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        408 | 504 => "timeout",
        409 => "conflict",
        429 => "rate_limit_exceeded",
        502 => "bad_gateway",
        503 => "service_unavailable",
        400..=499 => "invalid_request_error",
        _ => "server_error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_type_per_status() {
        let table = [
            (400, "invalid_request_error"),
            (405, "invalid_request_error"),
            (413, "invalid_request_error"),
            (431, "invalid_request_error"),
            (401, "authentication_error"),
            (404, "not_found_error"),
            (408, "timeout"),
            (504, "timeout"),
            (429, "rate_limit_exceeded"),
            (502, "bad_gateway"),
            (503, "service_unavailable"),
            (500, "server_error"),
        ];
        for (status, kind) in table {
            assert_eq!(error_type(status), kind, "{status}");
        }
    }

    #[test]
    fn upstream_failures_are_retryable_and_keep_their_status() {
        let e = GatewayError::upstream(&UpstreamError::Timeout);
        assert_eq!((e.status, e.retryable, e.close), (504, true, false));
        assert_eq!(e.kind(), "timeout");
        let s = GatewayError::worker_status(503);
        assert!(s.retryable);
        assert!(!GatewayError::worker_status(501).retryable);
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let local = std::io::Error::from_raw_os_error(libc::EMFILE);
        for e in [
            UpstreamError::Connect(refused),
            UpstreamError::Local(local),
            UpstreamError::BadResponse("x".into()),
        ] {
            let m = GatewayError::upstream(&e).message;
            assert!(!m.contains("http://") && !m.contains("127.0.0.1"), "{m}");
        }
    }

    #[test]
    fn admission_refusals() {
        assert_eq!(GatewayError::from(Refusal::QueueFull).status, 429);
        assert_eq!(GatewayError::from(Refusal::Timeout).status, 408);
        assert!(GatewayError::framing(400, "x").close);
        assert!(!GatewayError::new(400, "x").close);
        assert_eq!(GatewayError::no_workers(true).status, 503);
    }
}
